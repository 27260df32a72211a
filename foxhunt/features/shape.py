"""Bar shape: range, body, wicks, close location, gap from the previous close, intrabar return."""

from __future__ import annotations

import numpy as np

from foxhunt.features import filters as F
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList


def bop(p: Panel, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib BOP: (C - O) / (H - L), 0 on a flat bar."""
    return F.blockwise(_bop_block, np.empty(p.shape) if out is None else out, p.close, p.open, p.hl_range())


def _bop_block(c: np.ndarray, o: np.ndarray, hl: np.ndarray, out: np.ndarray) -> None:
    F.safe_div(c - o, hl, out=out)


def log_ratio(num: np.ndarray, den: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ln(num / den), into ``out`` when given."""
    return np.log(num / den, out=out)


def range_rel(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """ln(max((H - L) / SMA(n) of (H - L), 0.001)), 0 where that SMA is 0."""
    r = F.safe_div(p.hl_range(), F.rolling_mean(p.hl_range(), n), 1.0)
    np.maximum(r, 1e-3, out=r)
    return np.log(r, out=out)


def features() -> FeatureList:
    fl = FeatureList("shape")
    fl.add("range_log", "ln(H / L)", 0, lambda p, out=None: log_ratio(p.high, p.low, out))
    fl.add("range_atr", "(H - L) / ATR(14)", 14, lambda p, out=None: p.per_atr(p.hl_range(), out), talib="ATR")
    fl.add("range_rel_20", "ln(max((H - L) / SMA(20) of (H - L), 0.001))", 19, lambda p, out=None: range_rel(p, 20, out))
    fl.add("body", "TA-Lib BOP: (C - O) / (H - L)", 0, bop, talib="BOP")
    fl.add("upper_wick", "(H - max(O, C)) / (H - L)", 0,
           lambda p, out=None: F.safe_div(p.high - np.maximum(p.open, p.close), p.hl_range(), out=out))
    fl.add("lower_wick", "(min(O, C) - L) / (H - L)", 0,
           lambda p, out=None: F.safe_div(np.minimum(p.open, p.close) - p.low, p.hl_range(), out=out))
    fl.add("close_location", "(C - L) / (H - L), 0.5 on flat bars", 0, lambda p, out=None: F.safe_div(p.close - p.low, p.hl_range(), 0.5, out))
    fl.add("bar_return", "ln(C / O)", 0, lambda p, out=None: log_ratio(p.close, p.open, out))
    fl.add("gap", "ln(O[t] / C[t-1])", 1, lambda p, out=None: log_ratio(p.open, p.prev_close(), out))
    fl.add("gap_atr", "(O[t] - C[t-1]) / ATR(14)", 14, lambda p, out=None: p.per_atr(p.open - p.prev_close(), out), talib="ATR")
    return fl
