"""A live session's state on disk: safetensors + state.json, verified like an export, written atomically, so a
restarted session continues exactly where the saved one stopped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from foxhunt.export.metadata import sha256_hex
from foxhunt.files import atomic_file, write_json

FORMAT = "foxhunt-live-state"
VERSION = 1
TENSORS = "state.safetensors"
META = "state.json"


class StateError(ValueError):
    """A saved live state that cannot be used (missing, corrupt, or another export's), in one line."""


def save_state(directory: str | Path, tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> Path:
    """Write the state's tensors, then state.json with their SHA-256 (both atomic; the JSON last, so a state is
    complete or the previous one)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    blob = save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    with atomic_file(root / TENSORS) as tmp:
        tmp.write_bytes(blob)
    write_json(root / META, {"format": FORMAT, "format_version": VERSION, "sha256": sha256_hex(blob), **info})
    return root


def load_state(directory: str | Path, export_digest: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and info of a saved state, refused in one line when a file is missing or corrupt, or the state
    belongs to another export (``export_digest``: the loaded export's)."""
    root = Path(directory)
    meta_path, tensor_path = root / META, root / TENSORS
    if not meta_path.is_file() or not tensor_path.is_file():
        raise StateError(f"{root}: no saved live state ({META} and {TENSORS})")
    try:
        info = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateError(f"{meta_path}: not valid JSON ({e})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or info.get("format_version") != VERSION:
        raise StateError(f"{meta_path}: not a {FORMAT} version {VERSION} file")
    blob = tensor_path.read_bytes()
    if sha256_hex(blob) != info.get("sha256"):
        raise StateError(f"{tensor_path}: SHA-256 differs from {META}'s: the state is corrupt or was changed")
    if info.get("export") != export_digest:
        raise StateError(f"{meta_path}: saved by a session of another export ({str(info.get('export'))[:16]}...), "
                         f"this one is {export_digest[:16]}...")
    return load_safetensors(blob), info
