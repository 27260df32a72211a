"""Callbacks that kill their own process or log its batches, and the forked fit command, for the exact-resume tests."""

from __future__ import annotations

import os
import signal

from lightning.pytorch.callbacks import Callback


class KillAfterEpoch(Callback):
    """SIGKILL the process once epoch ``epoch`` (0-based) is over and checkpointed: as the next epoch starts.

    (ModelCheckpoint writes at the end of a training epoch, after every other callback's hook.)
    """

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch + 1:
            os.kill(os.getpid(), signal.SIGKILL)


class KillAtBatch(Callback):
    """SIGKILL the process at the end of training batch ``batch`` (0-based) of epoch ``epoch``: a crash inside an
    epoch (config callbacks run before foxhunt's PeriodicCheckpoint, so that batch's periodic save never happens)."""

    def __init__(self, epoch: int = 1, batch: int = 2) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


class BatchLog(Callback):
    """Append one line per training batch to ``path``: epoch, batch index and the decision rows ``t`` the batch holds
    (every member, the agents included, gets the coordinator's batch), so two runs can be compared batch by batch."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rows = ",".join(str(t) for t in batch["t"].tolist())
        with open(self.path, "a") as f:
            f.write(f"{trainer.current_epoch} {batch_idx} {rows}\n")


def fit_command(argv: list[str], stdout: str, stderr: str) -> None:
    """``python -m foxhunt.fit argv`` as a process forked from a server that imported Lightning once (each fit of the
    drills is still a fresh process, without paying ~6 s of CPU for that import): its output goes to two files."""
    import sys

    from foxhunt.cli_errors import run_command
    from foxhunt.fit import main

    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.exit(run_command(main, argv))
