"""Trend: distance of the close from SMA / EMA / KAMA and their slopes, in ATR(14) units.

Slopes that are exact multiples of another feature are left out, since after any per-feature normalisation they
are the same input twice: EMA(n)'s slope is alpha (C - EMA[t-1]) = 2 / (n - 1) (C - EMA[t]), so slope_ema_n would be
2 / (n - 1) dist_ema_n; SMA(n)'s slope is (C[t] - C[t-n]) / n, so slope_sma_n would be mom_n / n for the MOM windows
(5, 10, 20). KAMA's smoothing changes with every bar, so its slope is its own feature.

Distances and slopes are taken from differences of the close, never as a difference of two price levels: the SMA's
slope as (C[t] - C[t-n]) / n, its distance from window sums centred on a past close, the EMA's and KAMA's distances as
recurrences of their own on C[t] - C[t-1]; their rounding is relative to the distance, not to the level (and the
stepping form, which rounds differently, agrees with them to ~1e-14 of the distance).
"""

from __future__ import annotations

import torch
from torch import Tensor

from foxhunt.features import ops
from foxhunt.features.momentum import MOM_WINDOWS
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList

WINDOWS = (5, 10, 20, 50, 100, 200)
SLOPE_SMA_WINDOWS = tuple(n for n in WINDOWS if n not in MOM_WINDOWS)  # see the module docstring
_FASTEST, _SLOWEST = 2.0 / 3.0, 2.0 / 31.0


def sma(p: Panel, n: int) -> Tensor:
    """TA-Lib SMA of the close (block-centred prefix sums: error relative to the local spread, not the level)."""
    return p.memo(("sma", n), lambda: p.close_prefix().mean(n))


def ema(p: Panel, n: int) -> Tensor:
    """TA-Lib EMA of the close, seeded with the SMA of the first n closes (the distance features use
    :func:`ema_distance`, the same filter written on the close's changes)."""
    return p.memo(("ema", n), lambda: p.op.ema(p.close, n))


def ema_distance(p: Panel, n: int) -> Tensor:
    """C - TA-Lib EMA(n) of the close, as a recurrence on the close's changes (rounding relative to the distance)."""
    return p.memo(("ema_distance", n), lambda: p.op.ema_distance(p.close, p.close_change(), n))


def _abs_change_prefix(p: Panel) -> ops.Prefix:
    """Prefix sums of |C[t] - C[t-1]| from bar 1, shared by every KAMA window."""
    return p.prefix("abs_close_change", lambda: torch.abs(p.close_change()), 1)


def kama_distance(p: Panel, n: int) -> tuple[Tensor, Tensor]:
    """C - TA-Lib KAMA(n) and KAMA's smoothing constant sc, (ER (2/3 - 2/31) + 2/31)^2.

    KAMA, k[t] = k[t-1] + sc (C[t] - k[t-1]) seeded at C[n-1], is written on d = C - k: d[t] = (1 - sc) (d[t-1] +
    C[t] - C[t-1]) from d = 0 at bar n - 1, so its rounding is relative to the distance, not to the price level.
    """

    def f():
        c = p.close
        noise = _abs_change_prefix(p).sum(n)  # sum of |C[t] - C[t-1]| over the window
        # efficiency ratio |change| / noise <= 1, with equality exactly when TA-Lib sets ER = 1; a flat window
        # (0 / 0) gives 1 too: min(ER, 1) with 1 for NaN (the warm-up too, which the seed at bar n - 1 hides)
        er = p.op.diff(c, n).abs_().div_(noise).clamp_(max=1.0).nan_to_num_(nan=1.0)
        sc = er.mul_(_FASTEST - _SLOWEST).add_(_SLOWEST).square_()
        a = 1.0 - sc
        d = p.op.seeded_recurrence(a, a * p.close_change(), torch.zeros_like(c), n - 1, a_min=1.0 - _FASTEST**2)
        return p.op.blank(d, n), sc  # TA-Lib reports KAMA from bar n

    return p.memo(("kama_distance", n), f)


def kama(p: Panel, n: int) -> Tensor:
    """TA-Lib KAMA(n): Kaufman's adaptive average, seeded at C[n-1] (the close less :func:`kama_distance`)."""
    return p.close - kama_distance(p, n)[0]


def _kama_slope(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """(KAMA[t] - KAMA[t-1]) / ATR(14) = sc (C[t] - KAMA[t-1]) = sc d[t] / (1 - sc), in ATR units."""
    d, sc = kama_distance(p, n)
    slope = p.op.blank(torch.mul(d, sc).div_(1.0 - sc), n + 1)  # TA-Lib's KAMA has no value at bar n - 1
    return p.per_atr(slope, out)


def features() -> FeatureList:
    fl = FeatureList("trend")
    for n in WINDOWS:
        fl.add(f"dist_sma_{n}", f"(C - TA-Lib SMA({n})) / ATR(14)", max(n - 1, 14), lambda p, out=None, n=n: p.per_atr(p.close_prefix().deviation(p.close, n), out), talib="SMA")
    for n in WINDOWS:
        fl.add(f"dist_ema_{n}", f"(C - TA-Lib EMA({n})) / ATR(14)", max(n - 1, 14), lambda p, out=None, n=n: p.per_atr(ema_distance(p, n), out), talib="EMA")
    for n in (10, 30):
        fl.add(f"dist_kama_{n}", f"(C - TA-Lib KAMA({n})) / ATR(14)", max(n, 14), lambda p, out=None, n=n: p.per_atr(kama_distance(p, n)[0], out), talib="KAMA")
    for n in SLOPE_SMA_WINDOWS:
        fl.add(f"slope_sma_{n}", f"(SMA({n})[t] - SMA({n})[t-1]) / ATR(14)", max(n, 14), lambda p, out=None, n=n: p.op.lag_diff_times(p.close, n, p.inv_atr() / n, out), talib="SMA")
    for n in (10, 30):
        fl.add(f"slope_kama_{n}", f"(KAMA({n})[t] - KAMA({n})[t-1]) / ATR(14)", max(n + 1, 14), lambda p, out=None, n=n: _kama_slope(p, n, out), talib="KAMA")
    for a, b in ((5, 20), (20, 50), (50, 200)):
        fl.add(f"ema_cross_{a}_{b}", f"(EMA({a}) - EMA({b})) / ATR(14)", max(b - 1, 14),
               lambda p, out=None, a=a, b=b: ops.diff_times(ema_distance(p, b), ema_distance(p, a), p.inv_atr(), out), talib="EMA")
    return fl
