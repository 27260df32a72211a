"""Bar shape: range, body, wicks, close location, gap from the previous close, intrabar return."""

from __future__ import annotations

import numpy as np

from foxhunt.features import filters as F
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList


def bop(p: Panel) -> np.ndarray:
    """TA-Lib BOP: (C - O) / (H - L), 0 on a flat bar."""
    return F.safe_div(p.close - p.open, p.hl_range())


def features() -> FeatureList:
    fl = FeatureList("shape")
    fl.add("range_log", "ln(H / L)", 0, lambda p: np.log(p.high / p.low))
    fl.add("range_atr", "(H - L) / ATR(14)", 14, lambda p: p.hl_range() / p.atr(14), talib="ATR")
    fl.add("range_rel_20", "ln(max((H - L) / SMA(20) of (H - L), 0.001))", 19,
           lambda p: np.log(np.maximum(F.safe_div(p.hl_range(), F.rolling_mean(p.hl_range(), 20), 1.0), 1e-3)))
    fl.add("body", "TA-Lib BOP: (C - O) / (H - L)", 0, bop, talib="BOP")
    fl.add("upper_wick", "(H - max(O, C)) / (H - L)", 0, lambda p: F.safe_div(p.high - np.maximum(p.open, p.close), p.hl_range()))
    fl.add("lower_wick", "(min(O, C) - L) / (H - L)", 0, lambda p: F.safe_div(np.minimum(p.open, p.close) - p.low, p.hl_range()))
    fl.add("close_location", "(C - L) / (H - L), 0.5 on flat bars", 0, lambda p: F.safe_div(p.close - p.low, p.hl_range(), 0.5))
    fl.add("bar_return", "ln(C / O)", 0, lambda p: np.log(p.close / p.open))
    fl.add("gap", "ln(O[t] / C[t-1])", 1, lambda p: np.log(p.open / p.prev_close()))
    fl.add("gap_atr", "(O[t] - C[t-1]) / ATR(14)", 14, lambda p: (p.open - p.prev_close()) / p.atr(14), talib="ATR")
    return fl
