"""The decision log: one row per symbol and bar, appended to a Parquet dataset directory in atomic chunks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from foxhunt.files import atomic_file

PART = "part-{:06d}.parquet"


class DecisionLog:
    """Rows buffered in memory and written as numbered Parquet parts of one directory (pandas and pyarrow read the
    directory as one table); a part is written whole or not at all, so a killed session loses only its buffer."""

    def __init__(self, directory: str | Path, parts: int = 0) -> None:
        self.root = Path(directory)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"{self.root}: exists and is not a decision log directory")
        self.root.mkdir(parents=True, exist_ok=True)
        self.parts = int(parts)
        for stale in sorted(self.root.glob("part-*.parquet")):  # written after the saved state: decided again
            if int(stale.stem.split("-")[1]) >= self.parts:
                stale.unlink()
        self.rows: list[dict] = []

    def append(self, rows: list[dict]) -> None:
        self.rows.extend(rows)

    def flush(self) -> int:
        """Write the buffered rows as the next part; returns the number of parts."""
        if self.rows:
            frame = pd.DataFrame(self.rows)
            with atomic_file(self.root / PART.format(self.parts)) as tmp:
                frame.to_parquet(tmp, index=False)
            self.parts += 1
            self.rows = []
        return self.parts


def read_decisions(path: str | Path) -> pd.DataFrame:
    """A decision log (its directory, or one part) as one frame ordered by (symbol, time)."""
    root = Path(path)
    files = sorted(root.glob("part-*.parquet")) if root.is_dir() else [root]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"{root}: no decision log parts (part-*.parquet)")
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    order = np.lexsort((frame["ts_event"].to_numpy(), frame["symbol"].astype(str).to_numpy()))
    return frame.iloc[order].reset_index(drop=True)
