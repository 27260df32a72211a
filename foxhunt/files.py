"""Files the package writes and reads back: one atomic write, and an error's gist in one line.

``atomic_file(target)`` is the one atomic write of the package (checkpoints, the feature cache, exports): the caller
writes a temporary file in the target's own directory; it is flushed to disk and renamed over the target, so a reader
sees the old file or the whole new one, never a torn one, and a failed write leaves the old file as it was.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=1)
def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(target: str | Path) -> Iterator[Path]:
    """A temporary path beside ``target`` for the caller to write; on a clean exit it is fsynced and renamed over
    ``target`` (then the directory is fsynced), on an error it is removed and ``target`` is untouched."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # mkstemp makes the file private (0600): give it the mode a plain open() would have
        os.chmod(tmp, target.stat().st_mode & 0o777 if target.exists() else 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (skipped where a directory cannot be opened, e.g. on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``: an error's gist for a one-line report."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def json_safe(value: Any) -> Any:
    """``value`` with every NaN and infinity as None (null): JSON has no such numbers, and strict parsers (jq, a
    browser's JSON.parse) refuse the bare ``NaN`` Python's json writes by default."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(target: str | Path, value: Any) -> None:
    """``value`` as strict JSON (:func:`json_safe`), indented, written atomically (:func:`atomic_file`)."""
    with atomic_file(target) as tmp:
        tmp.write_text(json.dumps(json_safe(value), indent=2, allow_nan=False))
