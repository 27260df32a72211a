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
  deep inside the unpickler.

Remote paths (``s3://`` and the like) go to ``TorchCheckpointIO`` unchanged. ``checkpoint_problem`` says why a file
cannot be resumed from (``--ckpt_path last`` skips such files). ``PeriodicCheckpoint`` writes ``last-steps.ckpt``
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
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - mmap needs the zip format: read it plainly for the real reason
            ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is the reason to skip it
        return f"not a readable checkpoint ({first_line(e)})"
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        return "no 'state_dict' in it: not a Lightning checkpoint"
    return _digest_problem(ckpt)


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO writing local checkpoints atomically in their own directory and naming unreadable ones."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        with atomic_file(_local(path)) as tmp:
            torch.save({**checkpoint, DIGEST_KEY: checkpoint_digest(checkpoint)}, tmp)

    def load_checkpoint(
        self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not _is_local(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        p = _local(path)
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such checkpoint file")
        try:
            checkpoint = torch.load(p, map_location=map_location, weights_only=weights_only)
        except Exception as e:  # noqa: BLE001 - every unreadable file gets the same one-line error
            reason = "the file is empty (0 bytes)" if p.stat().st_size == 0 else first_line(e)
            error = CheckpointError(f"{p}: not a readable checkpoint ({reason}); resume from an earlier one")
            # a weights_only refusal's advice spans many lines: keep it as the cause; corruption needs no frames
            raise error from (e if isinstance(e, pickle.UnpicklingError) else None)
        problem = _digest_problem(checkpoint)
        if problem is not None:
            raise CheckpointError(f"{p}: not a checkpoint to resume from: {problem}; resume from an earlier one")
        return checkpoint


class PeriodicCheckpoint(Callback):
    """Saves ``last-steps.ckpt`` beside the run's other checkpoints every ``every_n_steps`` training steps (batches of
    the coordinator, counted within the epoch), so a crash inside a long epoch loses at most that many steps. It goes
    through ``Trainer.save_checkpoint`` (on every rank, as that requires), hence through ``AtomicCheckpointIO``."""

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
