"""Crash-safe checkpoints: written atomically next to their target (:func:`foxhunt.files.atomic_file`), and a
corrupt checkpoint named in one line.

``AtomicCheckpointIO`` is Lightning's ``TorchCheckpointIO`` with three changes for local paths:

- ``save_checkpoint`` writes through ``atomic_file``, whatever ``TMPDIR`` is (Lightning's fsspec transaction stages
  the file in ``TMPDIR`` and moves it, which is a copy, not an atomic rename, when ``TMPDIR`` is on another file
  system);
- it records a SHA-256 of the checkpoint's contents in the checkpoint (``foxhunt_sha256``), and ``load_checkpoint``
  recomputes it: ``torch.load`` reads a checkpoint with flipped bytes inside a tensor (a replay buffer, say) without
  a word, and training would go on from corrupt state;
- ``load_checkpoint`` turns a file ``torch.load`` cannot read (empty, truncated, not a checkpoint) or whose contents
  differ from its SHA-256 into one :class:`CheckpointError` that names the file, instead of a bare ``EOFError`` from
  deep inside the unpickler;
- it always reads with ``weights_only=True``, whatever the caller passes (Lightning passes ``None`` for
  ``Trainer.fit(ckpt_path=...)``, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` would turn into a full unpickling
  that runs code a crafted ``.ckpt`` carries).

Remote paths (``s3://`` and the like) go to ``TorchCheckpointIO``, also with ``weights_only=True``.
:func:`load_verified_checkpoint` is the same verified read for other uses (``foxhunt.fit`` reads the best checkpoint
through it for the export). ``checkpoint_problem`` says why a file cannot be resumed from (``--ckpt_path last``
skips such files); ``recorded_checkpoint_dirs`` reads which directory each ModelCheckpoint of a run wrote to. ``PeriodicCheckpoint`` writes ``last-steps.ckpt``
every N training steps inside an epoch (``foxhunt.fit --checkpoint_every_n_steps N``), through the same IO.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO

from foxhunt.cli_errors import UserError
from foxhunt.files import atomic_file, first_line


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be resumed from (missing, empty, truncated, not a checkpoint), named in one line."""


def _is_local(path: Any) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def _local(path: Any) -> Path:
    text = str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


DIGEST_KEY = "foxhunt_sha256"


def checkpoint_digest(checkpoint: Any) -> str:
    """SHA-256 of a checkpoint's contents: every tensor's and array's dtype, shape and bytes, every other value's repr
    (sets in sorted order), in the checkpoint's own order."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(x.shape)}".encode())
            h.update(t.view(torch.uint8).numpy())
        elif isinstance(x, np.ndarray):
            h.update(f"N{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
        elif isinstance(x, dict):
            h.update(b"{")
            for k, v in x.items():
                walk(k)
                walk(v)
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__}[".encode())
            for v in x:
                walk(v)
            h.update(b"]")
        elif isinstance(x, (set, frozenset)):
            h.update(repr(sorted(repr(v) for v in x)).encode())
        else:
            h.update(f"{type(x).__name__}:{x!r}".encode())

    walk(checkpoint)
    return h.hexdigest()


def _digest_problem(checkpoint: Any) -> str | None:
    """Why a loaded checkpoint's contents are not what was saved (None when they match, or it records no digest)."""
    if not isinstance(checkpoint, dict) or DIGEST_KEY not in checkpoint:
        return None
    recorded = checkpoint.pop(DIGEST_KEY)
    if checkpoint_digest(checkpoint) != recorded:
        return "its contents differ from the SHA-256 recorded when it was saved (corrupted after writing)"
    return None


def _load_lazily(p: Path) -> Any:
    """``torch.load(weights_only=True)`` with tensors memory-mapped (a large checkpoint is not read into memory), or
    read plainly where mmap cannot be used (not the zip format), so a failure says the real reason."""
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - mmap needs the zip format: read it plainly for the real reason
        return torch.load(p, map_location="cpu", weights_only=True)


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be resumed from (None when ``torch.load(weights_only=True)`` reads it and it holds a
    ``state_dict``). Tensors are memory-mapped, so a large checkpoint is not read into memory to be checked."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as e:
        return first_line(e)
    if size == 0:
        return "the file is empty (0 bytes)"
    try:
        ckpt = _load_lazily(p)
    except Exception as e:  # noqa: BLE001 - any failure to read is the reason to skip it
        return f"not a readable checkpoint ({first_line(e)})"
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        return "no 'state_dict' in it: not a Lightning checkpoint"
    return _digest_problem(ckpt)


def recorded_checkpoint_dirs(path: str | Path) -> dict[str, str]:
    """``{state_key: dirpath}`` of every callback state in the checkpoint at ``path`` that records a ``dirpath`` (the
    directory a ``ModelCheckpoint`` wrote to), exactly as recorded; empty when the file cannot be read (loading it
    names the problem). Tensors are memory-mapped, not read."""
    if not _is_local(path):
        return {}
    try:
        ckpt = _load_lazily(_local(path))
    except Exception:  # noqa: BLE001 - the resume itself reports an unreadable file in one line
        return {}
    states = ckpt.get("callbacks") if isinstance(ckpt, dict) else None
    if not isinstance(states, dict):
        return {}
    return {str(key): state["dirpath"] for key, state in states.items()
            if isinstance(state, dict) and isinstance(state.get("dirpath"), str) and state["dirpath"]}


def load_verified_checkpoint(path: Any, map_location: Any = "cpu", use: str = "resume from") -> dict[str, Any]:
    """A checkpoint read with ``weights_only=True`` and its recorded SHA-256 verified: anything unreadable or changed
    since it was saved is one :class:`CheckpointError` naming the file (``use``: what the caller wanted it for, said in
    the message). Remote paths are read through ``TorchCheckpointIO``."""
    if not _is_local(path):
        checkpoint = TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=True)
        where: Any = path
    else:
        where = p = _local(path)
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such checkpoint file")
        try:
            checkpoint = torch.load(p, map_location=map_location, weights_only=True)
        except Exception as e:  # noqa: BLE001 - every unreadable file gets the same one-line error
            reason = "the file is empty (0 bytes)" if p.stat().st_size == 0 else first_line(e)
            advice = "; resume from an earlier one" if use == "resume from" else ""
            error = CheckpointError(f"{p}: not a readable checkpoint ({reason}){advice}")
            # a weights_only refusal's advice spans many lines: keep it as the cause; corruption needs no frames
            raise error from (e if isinstance(e, pickle.UnpicklingError) else None)
    problem = _digest_problem(checkpoint)
    if problem is not None:
        advice = "; resume from an earlier one" if use == "resume from" else ""
        raise CheckpointError(f"{where}: not a checkpoint to {use}: {problem}{advice}")
    return checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO writing local checkpoints atomically in their own directory, reading every checkpoint with
    ``weights_only=True`` and naming unreadable or changed ones."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        with atomic_file(_local(path)) as tmp:
            torch.save({**checkpoint, DIGEST_KEY: checkpoint_digest(checkpoint)}, tmp)

    def load_checkpoint(
        self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """``weights_only`` is ignored: a checkpoint is always read with ``weights_only=True`` (a pickled object that
        is not plain data is refused, never run), whatever the caller or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says."""
        return load_verified_checkpoint(path, map_location=map_location)


class PeriodicCheckpoint(Callback):
    """Saves ``last-steps.ckpt`` beside the run's other checkpoints every ``every_n_steps`` training steps (batches of
    the coordinator, counted within the epoch), so a crash inside a long epoch loses at most that many steps. It goes
    through ``Trainer.save_checkpoint`` (on every rank, as that requires), hence through ``AtomicCheckpointIO``.
    A resume from it is exact: the checkpoint holds the training loader's position in the epoch
    (``BarDataModule.state_dict``, ``WindowBatches.state_dict``), so the resumed run goes on with the next batch."""

    FILENAME = "last-steps.ckpt"

    def __init__(self, every_n_steps: int) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % self.every_n_steps:
            return
        ckpt = trainer.checkpoint_callback
        dirpath = getattr(ckpt, "dirpath", None) or Path(trainer.default_root_dir) / "checkpoints"
        trainer.save_checkpoint(Path(dirpath) / self.FILENAME)
