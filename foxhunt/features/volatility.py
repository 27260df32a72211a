"""Volatility: standard deviation of log returns, NATR, range estimators (Parkinson, Garman-Klass, Rogers-Satchell)
and Bollinger bands.

Bollinger bands take their rolling mean and variance of the close from prefix sums inside blocks centred on a past
close (``Panel.close_prefix``), so float64 error stays relative to the local spread of the price, not to its level
times the series length.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from foxhunt.features import ops as O
from foxhunt.features.registry import FeatureList

if TYPE_CHECKING:
    from foxhunt.features.panel import Panel

_LN2 = math.log(2.0)
_NAN = float("nan")
_RATIO_FLOOR = 1e-3  # the floor of the volatility ratios (as range_rel_20's): a flat stretch stays finite


def std_logret(p: Panel, n: int) -> Tensor:
    """TA-Lib STDDEV(n, 1) of 1-bar log returns (population std)."""
    return p.memo(("std_logret", n), lambda: p.prefix("log_return_1", lambda: p.log_return(1), 1, True).std(n))


def natr(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """TA-Lib NATR: 100 * ATR(n) / C."""
    return O.safe_div(p.atr(n), p.close, scale=100.0, out=out)  # the close is never 0


def _mid_halfwidth(p: Panel, n: int, k: float) -> tuple[Tensor, Tensor]:
    """Bollinger middle band (SMA) and half-width (k population standard deviations), shared by the band features."""
    return p.memo(("bb_mid_halfwidth", n, k), lambda: p.close_prefix().mean_std(n, k))


def bbands(p: Panel, n: int, k: float = 2.0) -> tuple[Tensor, Tensor, Tensor]:
    """TA-Lib BBANDS(n, k, k, SMA): upper, middle and lower bands."""
    mid, half = _mid_halfwidth(p, n, k)
    return mid + half, mid, mid - half


def bb_pctb(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """Bollinger %B: (C - lower) / (upper - lower) = (C - middle + half-width) / (2 half-width), 0.5 where the bands meet."""
    mid, half = _mid_halfwidth(p, n, 2.0)
    return O.safe_div((p.close - mid).add_(half), half, 0.5, scale=0.5, out=out)


def bb_width(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """Bollinger bandwidth: (upper - lower) / middle = 2 half-width / middle."""
    mid, half = _mid_halfwidth(p, n, 2.0)
    return O.safe_div(half, mid, scale=2.0, out=out)  # the middle band (a mean of closes) is never 0


def _log_hl_sq(p: Panel) -> Tensor:
    def f() -> Tensor:
        x = torch.div(p.high, p.low).log_()
        return x.mul_(x)

    return p.memo("log_hl_sq", f)


def _sqrt_mean(s: Tensor, n: int) -> Tensor:
    """sqrt(max(s / n, 0)) of a window sum s (overwritten)."""
    s /= n
    return s.clamp_(min=0.0).sqrt_()


def parkinson(p: Panel, n: int) -> Tensor:
    """Parkinson (1980): sqrt(mean(ln(H/L)^2) / (4 ln 2)) over n bars."""
    s = p.prefix("log_hl_sq", lambda: _log_hl_sq(p)).sum(n)
    s /= n * 4.0 * _LN2
    return s.sqrt_()


def garman_klass(p: Panel, n: int) -> Tensor:
    """Garman-Klass (1980): sqrt(mean(0.5 ln(H/L)^2 - (2 ln 2 - 1) ln(C/O)^2)) over n bars."""

    def term() -> Tensor:
        lco = torch.div(p.close, p.open).log_()
        lco.mul_(lco).mul_(2.0 * _LN2 - 1.0)
        return torch.mul(_log_hl_sq(p), 0.5).sub_(lco)

    return _sqrt_mean(p.prefix("gk_term", term).sum(n), n)


def rogers_satchell(p: Panel, n: int) -> Tensor:
    """Rogers-Satchell (1991): sqrt(mean(ln(H/C) ln(H/O) + ln(L/C) ln(L/O))) over n bars."""

    def term() -> Tensor:
        """ln(H/C) ln(H/O) + ln(L/C) ln(L/O) as (lh - lc) (lh - lo) + (ll - lc) (ll - lo)."""
        lh, ll, lc, lo = (torch.log(a) for a in (p.high, p.low, p.close, p.open))
        return (lh - lc) * (lh - lo) + (ll - lc) * (ll - lo)

    return _sqrt_mean(p.prefix("rs_term", term).sum(n), n)


def features() -> FeatureList:
    fl = FeatureList("volatility")
    for n in (5, 10, 20, 50, 100):
        fl.add(f"std_logret_{n}", f"TA-Lib STDDEV({n}) of 1-bar log returns", n, lambda p, n=n: std_logret(p, n), talib="STDDEV")
    fl.add("vol_ratio_5_50", "ln(max(std_logret_5 / std_logret_50, 0.001)), 0 where std_logret_50 is 0", 50,
           lambda p, out=None: O.log_ratio(std_logret(p, 5), std_logret(p, 50), out, _RATIO_FLOOR))
    fl.add("vol_ratio_10_100", "ln(max(std_logret_10 / std_logret_100, 0.001)), 0 where std_logret_100 is 0", 100,
           lambda p, out=None: O.log_ratio(std_logret(p, 10), std_logret(p, 100), out, _RATIO_FLOOR))
    for n in (7, 14, 28):
        fl.add(f"natr_{n}", f"TA-Lib NATR({n}): 100 ATR({n}) / C (ATR by Wilder smoothing)", n, lambda p, out=None, n=n: natr(p, n, out), talib="NATR")
    fl.add("atr_ratio_7_28", "ln(max(ATR(7) / ATR(28), 0.001)), 0 where ATR(28) is 0", 28,
           lambda p, out=None: O.log_ratio(p.atr(7), p.atr(28), out, _RATIO_FLOOR), talib="ATR")
    for n in (10, 20, 50):
        fl.add(f"parkinson_{n}", f"Parkinson volatility over {n} bars", n - 1, lambda p, n=n: parkinson(p, n))
    for n in (10, 20, 50):
        fl.add(f"garman_klass_{n}", f"Garman-Klass volatility over {n} bars", n - 1, lambda p, n=n: garman_klass(p, n))
    for n in (10, 20, 50):
        fl.add(f"rogers_satchell_{n}", f"Rogers-Satchell volatility over {n} bars", n - 1, lambda p, n=n: rogers_satchell(p, n))
    for n in (20, 50):
        fl.add(f"bb_pctb_{n}", f"Bollinger %B: (C - lower) / (upper - lower), TA-Lib BBANDS({n},2,2,SMA)", n - 1,
               lambda p, out=None, n=n: bb_pctb(p, n, out), talib="BBANDS")
        fl.add(f"bb_width_{n}", f"Bollinger bandwidth: (upper - lower) / middle, TA-Lib BBANDS({n},2,2,SMA)", n - 1,
               lambda p, out=None, n=n: bb_width(p, n, out), talib="BBANDS")
    return fl
