"""Volatility: rolling std of log returns, ATR/NATR, Parkinson, Garman-Klass, Rogers-Satchell, Bollinger %B and bandwidth."""

from __future__ import annotations

import numpy as np

from foxhunt.features import filters as F
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList

_LN2 = np.log(2.0)


def std_logret(p: Panel, n: int) -> np.ndarray:
    """TA-Lib STDDEV(n, 1) of 1-bar log returns (population std)."""

    def f():
        return p.prefix("log_return_1", p.log_return, 1, True).std(n, out=p.empty())

    return p.memo(("std_logret", n), f)


def natr(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib NATR: 100 * ATR(n) / C."""
    atr = p.atr(n)
    return F.blockwise(_natr_block, np.empty(atr.shape) if out is None else out, atr, p.close)


def _natr_block(atr: np.ndarray, c: np.ndarray, out: np.ndarray) -> None:
    np.divide(100.0 * atr, c, out=out)


def _mid_halfwidth(p: Panel, n: int, k: float) -> tuple[np.ndarray, np.ndarray]:
    """Bollinger middle band (SMA) and half-width (k population standard deviations), shared by the band features."""

    def f():
        return p.close_prefix().mean_std(n, k)

    return p.memo(("bb_mid_halfwidth", n, k), f)


def bbands(p: Panel, n: int, k: float = 2.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TA-Lib BBANDS(n, k, k, SMA): middle SMA, bands at k population standard deviations."""
    mid, half = _mid_halfwidth(p, n, k)
    return mid + half, mid, mid - half


def bb_pctb(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Bollinger %B: (C - lower) / (upper - lower) = (C - middle + half-width) / (2 half-width), 0.5 where the bands meet."""
    mid, half = _mid_halfwidth(p, n, 2.0)
    return F.blockwise(_pctb_block, np.empty(mid.shape) if out is None else out, p.close, mid, half)


def _pctb_block(c: np.ndarray, mid: np.ndarray, half: np.ndarray, out: np.ndarray) -> None:
    num = c - mid
    num += half
    F.safe_div(num, half, 0.5, out, scale=0.5)


def bb_width(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Bollinger bandwidth: (upper - lower) / middle = 2 half-width / middle."""
    mid, half = _mid_halfwidth(p, n, 2.0)
    return np.divide(2.0 * half, mid, out=out)


def log_ratio(num: np.ndarray, den: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ln(num / den), into ``out`` when given; blockwise."""
    return F.blockwise(_log_ratio_block, np.empty(num.shape) if out is None else out, num, den)


def _log_ratio_block(num: np.ndarray, den: np.ndarray, out: np.ndarray) -> None:
    np.log(num / den, out=out)


def _log_hl_sq(p: Panel) -> np.ndarray:
    return p.memo("log_hl_sq", lambda: np.log(p.high / p.low) ** 2)


def parkinson(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Parkinson (1980): sqrt(mean(ln(H/L)^2) / (4 ln 2)) over n bars."""
    s = p.prefix("log_hl_sq", lambda: _log_hl_sq(p)).sum(n)
    s /= n * 4.0 * _LN2
    return np.sqrt(s, out=out)


def _sqrt_mean(s: np.ndarray, n: int, out: np.ndarray | None) -> np.ndarray:
    """sqrt(max(s / n, 0)) of a window sum s (overwritten), into ``out`` when given."""
    s /= n
    np.maximum(s, 0.0, out=s)
    return np.sqrt(s, out=out)


def garman_klass(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Garman-Klass (1980): sqrt(mean(0.5 ln(H/L)^2 - (2 ln 2 - 1) ln(C/O)^2)) over n bars."""

    def term():
        return 0.5 * _log_hl_sq(p) - (2.0 * _LN2 - 1.0) * np.log(p.close / p.open) ** 2

    return _sqrt_mean(p.prefix("gk_term", term).sum(n), n, out)


def rogers_satchell(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rogers-Satchell (1991): sqrt(mean(ln(H/C) ln(H/O) + ln(L/C) ln(L/O))) over n bars."""

    def term():
        lh, ll, lc, lo = (np.log(a) for a in (p.high, p.low, p.close, p.open))
        return (lh - lc) * (lh - lo) + (ll - lc) * (ll - lo)

    return _sqrt_mean(p.prefix("rs_term", term).sum(n), n, out)


def features() -> FeatureList:
    fl = FeatureList("volatility")
    for n in (5, 10, 20, 50, 100):
        fl.add(f"std_logret_{n}", f"TA-Lib STDDEV({n}) of 1-bar log returns", n, lambda p, out=None, n=n: F.put(std_logret(p, n), out), talib="STDDEV")
    fl.add("vol_ratio_5_50", "ln(std_logret_5 / std_logret_50)", 50, lambda p, out=None: log_ratio(std_logret(p, 5), std_logret(p, 50), out))
    fl.add("vol_ratio_10_100", "ln(std_logret_10 / std_logret_100)", 100, lambda p, out=None: log_ratio(std_logret(p, 10), std_logret(p, 100), out))
    for n in (7, 14, 28):
        fl.add(f"natr_{n}", f"TA-Lib NATR({n}): 100 ATR({n}) / C (ATR by Wilder smoothing)", n, lambda p, out=None, n=n: natr(p, n, out), talib="NATR")
    fl.add("atr_ratio_7_28", "ln(ATR(7) / ATR(28))", 28, lambda p, out=None: log_ratio(p.atr(7), p.atr(28), out), talib="ATR")
    for n in (10, 20, 50):
        fl.add(f"parkinson_{n}", f"Parkinson volatility over {n} bars", n - 1, lambda p, out=None, n=n: parkinson(p, n, out))
    for n in (10, 20, 50):
        fl.add(f"garman_klass_{n}", f"Garman-Klass volatility over {n} bars", n - 1, lambda p, out=None, n=n: garman_klass(p, n, out))
    for n in (10, 20, 50):
        fl.add(f"rogers_satchell_{n}", f"Rogers-Satchell volatility over {n} bars", n - 1, lambda p, out=None, n=n: rogers_satchell(p, n, out))
    for n in (20, 50):
        fl.add(f"bb_pctb_{n}", f"Bollinger %B: (C - lower) / (upper - lower), TA-Lib BBANDS({n},2,2,SMA)", n - 1,
               lambda p, out=None, n=n: bb_pctb(p, n, out), talib="BBANDS")
        fl.add(f"bb_width_{n}", f"Bollinger bandwidth: (upper - lower) / middle, TA-Lib BBANDS({n},2,2,SMA)", n - 1,
               lambda p, out=None, n=n: bb_width(p, n, out), talib="BBANDS")
    return fl
