"""A bar file as a live feed: its bars one timestamp at a time, with each symbol's next timestamps (the known-future
inputs' times, which the back-test reads from the same file)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from foxhunt.data.bars import timestamps_ns


@dataclass
class BarsAt:
    """The bars of one timestamp: symbols, OHLCV [P, 5] float64, and each symbol's next ``horizon`` timestamps."""

    timestamp: int
    symbols: list[str]
    ohlcv: Tensor
    next_timestamps: Tensor  # [P, H] int64 ns; past a symbol's last bar, its last spacing repeated


def replay(bars: pd.DataFrame, horizon: int) -> Iterator[BarsAt]:
    """The bars of a validated frame, timestamp by timestamp in time order, symbols by name."""
    ts = timestamps_ns(bars)
    symbols = bars["symbol"].astype(str).to_numpy() if "symbol" in bars.columns else np.full(len(bars), "default")
    ohlcv = bars[["open", "high", "low", "close", "volume"]].to_numpy(np.float64)
    ahead = np.zeros((len(bars), max(horizon, 1)), dtype=np.int64)
    for name in pd.unique(symbols):
        rows = np.flatnonzero(symbols == name)
        rows = rows[np.argsort(ts[rows], kind="stable")]
        t = ts[rows]
        step = int(t[-1] - t[-2]) if len(t) > 1 else 0
        padded = np.concatenate([t, t[-1] + step * np.arange(1, ahead.shape[1] + 1)])
        for h in range(ahead.shape[1]):
            ahead[rows, h] = padded[1 + h : 1 + h + len(t)]
    order = np.lexsort((symbols, ts))
    cuts = np.flatnonzero(np.diff(ts[order])) + 1
    for group in np.split(order, cuts):
        yield BarsAt(int(ts[group[0]]), [str(s) for s in symbols[group]], torch.from_numpy(ohlcv[group]),
                     torch.from_numpy(ahead[group, :horizon] if horizon > 0 else ahead[group, :0]))
