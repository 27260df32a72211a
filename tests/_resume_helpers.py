"""A callback that kills its own process, for the exact-resume test (imported by the fit subprocess)."""

from __future__ import annotations

import os
import signal

from lightning.pytorch.callbacks import Callback


class KillAfterEpoch(Callback):
    """SIGKILL the process at the end of training epoch ``epoch`` (0-based), after its checkpoint was written."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)
