"""Bar shape: range, body, wicks, close location, bar return and gaps (scale-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from foxhunt.features import ops as O
from foxhunt.features.registry import FeatureList

if TYPE_CHECKING:
    from foxhunt.features.panel import Panel


def bop(p: Panel, out: Tensor | None = None) -> Tensor:
    """TA-Lib BOP: (C - O) / (H - L), 0 on a flat bar."""
    return O.safe_div(p.close - p.open, p.hl_range(), out=out)


def _upper_wick(p: Panel) -> Tensor:
    """H - max(O, C)."""
    return p.high - torch.maximum(p.open, p.close)


def _lower_wick(p: Panel) -> Tensor:
    """min(O, C) - L."""
    return torch.minimum(p.open, p.close).sub_(p.low)


def range_rel(p: Panel, n: int) -> Tensor:
    """ln(max((H - L) / SMA(n) of (H - L), 0.001)), 0 where that SMA is 0."""
    r = O.safe_div(p.hl_range(), p.op.rolling_mean(p.hl_range(), n), 1.0)
    return r.clamp_(min=1e-3).log_()


def features() -> FeatureList:
    fl = FeatureList("shape")
    fl.add("range_log", "ln(H / L)", 0, lambda p, out=None: O.log_ratio(p.high, p.low, out))
    fl.add("range_atr", "(H - L) / ATR(14)", 14, lambda p, out=None: p.per_atr(p.hl_range(), out), talib="ATR")
    fl.add("range_rel_20", "ln(max((H - L) / SMA(20) of (H - L), 0.001))", 19, lambda p: range_rel(p, 20))
    fl.add("body", "TA-Lib BOP: (C - O) / (H - L)", 0, bop, talib="BOP")
    fl.add("upper_wick", "(H - max(O, C)) / (H - L)", 0, lambda p, out=None: O.safe_div(_upper_wick(p), p.hl_range(), out=out))
    fl.add("lower_wick", "(min(O, C) - L) / (H - L)", 0, lambda p, out=None: O.safe_div(_lower_wick(p), p.hl_range(), out=out))
    fl.add("close_location", "(C - L) / (H - L), 0.5 on flat bars", 0, lambda p, out=None: O.safe_div(p.close - p.low, p.hl_range(), 0.5, out=out))
    fl.add("bar_return", "ln(C / O)", 0, lambda p, out=None: O.log_ratio(p.close, p.open, out))
    fl.add("gap", "ln(O[t] / C[t-1])", 1, lambda p, out=None: O.log_ratio(p.open, p.prev_close(), out))
    fl.add("gap_atr", "(O[t] - C[t-1]) / ATR(14)", 14, lambda p, out=None: p.per_atr(p.open - p.prev_close(), out), talib="ATR")
    return fl
