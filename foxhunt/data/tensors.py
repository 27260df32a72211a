"""A bar frame as the tensors every stage reads, and its content hash (what a cache key or an export records)."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import torch

from foxhunt.data.bars import symbol_codes, timestamps_ns


def bars_tensors(bars: pd.DataFrame) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symbols, timestamps [T] int64 ns, symbol codes [T] and OHLCV [T, 5] float64 of a bar frame."""
    codes, names = symbol_codes(bars)
    ts = torch.from_numpy(timestamps_ns(bars).copy())
    sym = torch.from_numpy(codes)
    ohlcv = torch.from_numpy(bars[["open", "high", "low", "close", "volume"]].to_numpy(np.float64, copy=True))
    return list(names), ts, sym, ohlcv


def fingerprint(bars: pd.DataFrame) -> str:
    """A content hash of bars (timestamps, OHLCV, symbols): what a cache key or an export records."""
    names, ts, sym, ohlcv = bars_tensors(bars)
    h = hashlib.blake2b(digest_size=16)
    for t in (ohlcv, ts, sym):
        h.update(t.numpy().tobytes())
    h.update("\n".join(names).encode())
    return h.hexdigest()
