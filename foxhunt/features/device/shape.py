"""Bar shape features as torch tensors on the bars' device, mirroring :mod:`foxhunt.features.shape`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from foxhunt.features.device import ops as O

if TYPE_CHECKING:
    from foxhunt.features.device.panel import TorchPanel


def log_ratio(num: Tensor, den: Tensor) -> Tensor:
    """ln(num / den)."""
    return (num / den).log_()


def range_rel(p: TorchPanel, n: int) -> Tensor:
    """ln(max((H - L) / SMA(n) of (H - L), 0.001)), 0 where that SMA is 0."""
    r = O.safe_div(p.hl_range(), O.rolling_mean(p.hl_range(), n), 1.0)
    return r.clamp_(min=1e-3).log_()


def functions() -> dict[str, Callable[[TorchPanel], Tensor]]:
    """Every shape feature of the numpy registry, by name, as a function of a :class:`TorchPanel`."""
    return {
        "range_log": lambda p: log_ratio(p.high, p.low),
        "range_atr": lambda p: p.per_atr(p.hl_range()),
        "range_rel_20": lambda p: range_rel(p, 20),
        "body": lambda p: O.safe_div(p.close - p.open, p.hl_range()),
        "upper_wick": lambda p: O.safe_div(p.high - torch.maximum(p.open, p.close), p.hl_range()),
        "lower_wick": lambda p: O.safe_div(torch.minimum(p.open, p.close) - p.low, p.hl_range()),
        "close_location": lambda p: O.safe_div(p.close - p.low, p.hl_range(), 0.5),
        "bar_return": lambda p: log_ratio(p.close, p.open),
        "gap": lambda p: log_ratio(p.open, p.prev_close()),
        "gap_atr": lambda p: p.per_atr(p.open - p.prev_close()),
    }
