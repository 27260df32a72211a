"""Crash-safe checkpoints: written atomically next to their target (:func:`foxhunt.files.atomic_file`), and a
corrupt checkpoint named in one line.

``AtomicCheckpointIO`` is Lightning's ``TorchCheckpointIO`` with two changes for local paths:

- ``save_checkpoint`` writes through ``atomic_file``, whatever ``TMPDIR`` is (Lightning's fsspec transaction stages
  the file in ``TMPDIR`` and moves it, which is a copy, not an atomic rename, when ``TMPDIR`` is on another file
  system);
- ``load_checkpoint`` turns a file ``torch.load`` cannot read (empty, truncated, not a checkpoint) into one
  ``RuntimeError`` that names the file, instead of a bare ``EOFError`` from deep inside the unpickler.

Remote paths (``s3://`` and the like) go to ``TorchCheckpointIO`` unchanged. ``checkpoint_problem`` says why a file
cannot be resumed from (``--ckpt_path last`` skips such files).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from foxhunt.files import atomic_file, first_line


def _is_local(path: Any) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def _local(path: Any) -> Path:
    text = str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


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
    return None


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO writing local checkpoints atomically in their own directory and naming unreadable ones."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        with atomic_file(_local(path)) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(
        self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not _is_local(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        p = _local(path)
        if not p.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {p}")
        try:
            return torch.load(p, map_location=map_location, weights_only=weights_only)
        except Exception as e:  # noqa: BLE001 - every unreadable file gets the same one-line error
            reason = "the file is empty (0 bytes)" if p.stat().st_size == 0 else first_line(e)
            error = RuntimeError(f"{p}: not a readable checkpoint ({reason}); resume from an earlier one")
            # a weights_only refusal's advice spans many lines: keep it as the cause; corruption needs no frames
            raise error from (e if isinstance(e, pickle.UnpicklingError) else None)
