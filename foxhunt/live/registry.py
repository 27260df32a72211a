"""Who traded when: a JSON-lines registry of a live run's models (start, challenger added, promotion, retirement,
resume), one record a line, each appended whole and fsynced, so the live P&L can be attributed to the model that
produced every bar's position.

A record holds ``event``, ``time`` (wall clock, UTC ISO), ``at`` (the stream's bar time in ns UTC at which it
happened; None before the first bar), ``model`` (the run's label of the export), ``export`` (its path), ``sha256`` (its
export digest, :attr:`~foxhunt.live.session.LiveSession.export_digest`) and what else the event has (``evidence``: the
promotion rule's verdict; ``rule``: the rule declared at the start). A promotion at bar ``at`` makes its model trade
the bars after ``at``; the start's champion trades from the first bar. Records are idempotent: one that equals an
earlier record but for its ``time`` is not written again (a resumed run re-deciding the bars after its saved state
re-appends nothing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

EVENTS = ("start", "challenger", "promotion", "retirement", "resume")


class RegistryError(ValueError):
    """A registry file that cannot be read, in one line naming the file and line."""


def read_registry(path: str | Path) -> list[dict[str, Any]]:
    """The records of a registry, in order; a line that is not a JSON object with a known ``event`` is refused in one
    line naming the file and line (a torn last line, which a crash mid-write can leave, is skipped)."""
    root = Path(path)
    if not root.is_file():
        raise RegistryError(f"{root}: no registry file")
    lines = root.read_text().split("\n")
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # the last line, without its newline: a write that did not finish
                break
            raise RegistryError(f"{root}: line {n}: not JSON ({e})") from None
        if not isinstance(record, dict) or record.get("event") not in EVENTS:
            raise RegistryError(f"{root}: line {n}: not a registry record (its event must be one of {EVENTS})")
        out.append(record)
    return out


def _key(record: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in record.items() if k != "time"}, sort_keys=True)


class Registry:
    """Appends records to a registry file (created if missing): one line each, flushed and fsynced before it returns."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise RegistryError(f"{self.path}: exists and is not a registry file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records = read_registry(self.path) if self.path.is_file() and self.path.stat().st_size else []
        self._seen = {_key(r) for r in self.records}
        self._torn_tail()

    def _torn_tail(self) -> None:
        """A file not ending in a newline (a crash mid-write) gets one, so the next record starts a line."""
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
            if last != b"\n":
                with open(self.path, "ab") as f:
                    f.write(b"\n")
                    f.flush()
                    os.fsync(f.fileno())

    def append(self, event: str, **fields: Any) -> dict[str, Any] | None:
        """Write one record (``time`` is now); returns it, or None when an equal record is already there."""
        if event not in EVENTS:
            raise ValueError(f"registry: unknown event {event!r} (one of {EVENTS})")
        record = {"event": event, "time": datetime.now(UTC).isoformat(), **fields}
        key = _key(record)
        if key in self._seen:
            return None
        line = json.dumps(record, sort_keys=False, allow_nan=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._seen.add(key)
        self.records.append(record)
        return record


def traded_by(records: Sequence[dict[str, Any]], timestamps: Sequence[int]) -> list[str | None]:
    """The label of the model whose position was traded at each bar time (ns): the start's champion, then each
    promoted model from the bar after its promotion on (None before any start)."""
    changes = [(None if r.get("at") is None else int(r["at"]), r["model"]) for r in records
               if r["event"] == "start" or r["event"] == "promotion"]
    out: list[str | None] = []
    for ts in timestamps:
        who = None
        for at, model in changes:
            if at is None or int(ts) > at:
                who = model
        out.append(who)
    return out


def show(path: str | Path) -> None:
    """Print a registry as a table: when, what, which model and export, and the evidence of each record."""
    import pandas as pd
    from rich.console import Console
    from rich.table import Table

    table = Table(title=str(path), show_lines=False)
    for col in ("time", "event", "at (bar)", "model", "export", "sha256", "details"):
        table.add_column(col, overflow="fold")
    for r in read_registry(path):
        at = "" if r.get("at") is None else pd.Timestamp(int(r["at"]), unit="ns", tz="UTC").isoformat()
        rest = {k: v for k, v in r.items() if k not in ("time", "event", "at", "model", "export", "sha256")}
        table.add_row(str(r.get("time", ""))[:19], r["event"], at, str(r.get("model", "")), str(r.get("export", "")),
                      str(r.get("sha256", ""))[:12], json.dumps(rest, sort_keys=True)[:300])
    Console(width=200).print(table)
