"""Volatility: rolling std of log returns, ATR/NATR, Parkinson, Garman-Klass, Rogers-Satchell, Bollinger %B and bandwidth."""

from __future__ import annotations

import numpy as np

from foxhunt.features import filters as F
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList

_LN2 = np.log(2.0)


def std_logret(p: Panel, n: int) -> np.ndarray:
    """TA-Lib STDDEV(n, 1) of 1-bar log returns (population std)."""
    return p.memo(("std_logret", n), lambda: np.sqrt(p.prefix("log_return_1", p.log_return, 1, True).mean_var(n)[1]))


def natr(p: Panel, n: int) -> np.ndarray:
    """TA-Lib NATR: 100 * ATR(n) / C."""
    return 100.0 * p.atr(n) / p.close


def bbands(p: Panel, n: int, k: float = 2.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TA-Lib BBANDS(n, k, k, SMA): middle SMA, bands at k population standard deviations."""

    def f():
        mid, var = p.close_prefix().mean_var(n)
        sd = np.sqrt(var)
        return mid + k * sd, mid, mid - k * sd

    return p.memo(("bbands", n, k), f)


def _log_hl_sq(p: Panel) -> np.ndarray:
    return p.memo("log_hl_sq", lambda: np.log(p.high / p.low) ** 2)


def parkinson(p: Panel, n: int) -> np.ndarray:
    """Parkinson (1980): sqrt(mean(ln(H/L)^2) / (4 ln 2)) over n bars."""
    return np.sqrt(p.prefix("log_hl_sq", lambda: _log_hl_sq(p)).sum(n) / (n * 4.0 * _LN2))


def garman_klass(p: Panel, n: int) -> np.ndarray:
    """Garman-Klass (1980): sqrt(mean(0.5 ln(H/L)^2 - (2 ln 2 - 1) ln(C/O)^2)) over n bars."""

    def term():
        return 0.5 * _log_hl_sq(p) - (2.0 * _LN2 - 1.0) * np.log(p.close / p.open) ** 2

    return np.sqrt(np.maximum(p.prefix("gk_term", term).sum(n) / n, 0.0))


def rogers_satchell(p: Panel, n: int) -> np.ndarray:
    """Rogers-Satchell (1991): sqrt(mean(ln(H/C) ln(H/O) + ln(L/C) ln(L/O))) over n bars."""

    def term():
        lh, ll, lc, lo = (np.log(a) for a in (p.high, p.low, p.close, p.open))
        return (lh - lc) * (lh - lo) + (ll - lc) * (ll - lo)

    return np.sqrt(np.maximum(p.prefix("rs_term", term).sum(n) / n, 0.0))


def features() -> FeatureList:
    fl = FeatureList("volatility")
    for n in (5, 10, 20, 50, 100):
        fl.add(f"std_logret_{n}", f"TA-Lib STDDEV({n}) of 1-bar log returns", n, lambda p, n=n: std_logret(p, n), talib="STDDEV")
    fl.add("vol_ratio_5_50", "ln(std_logret_5 / std_logret_50)", 50, lambda p: np.log(std_logret(p, 5) / std_logret(p, 50)))
    fl.add("vol_ratio_10_100", "ln(std_logret_10 / std_logret_100)", 100, lambda p: np.log(std_logret(p, 10) / std_logret(p, 100)))
    for n in (7, 14, 28):
        fl.add(f"natr_{n}", f"TA-Lib NATR({n}): 100 ATR({n}) / C (ATR by Wilder smoothing)", n, lambda p, n=n: natr(p, n), talib="NATR")
    fl.add("atr_ratio_7_28", "ln(ATR(7) / ATR(28))", 28, lambda p: np.log(p.atr(7) / p.atr(28)), talib="ATR")
    for n in (10, 20, 50):
        fl.add(f"parkinson_{n}", f"Parkinson volatility over {n} bars", n - 1, lambda p, n=n: parkinson(p, n))
    for n in (10, 20, 50):
        fl.add(f"garman_klass_{n}", f"Garman-Klass volatility over {n} bars", n - 1, lambda p, n=n: garman_klass(p, n))
    for n in (10, 20, 50):
        fl.add(f"rogers_satchell_{n}", f"Rogers-Satchell volatility over {n} bars", n - 1, lambda p, n=n: rogers_satchell(p, n))
    for n in (20, 50):
        fl.add(f"bb_pctb_{n}", f"Bollinger %B: (C - lower) / (upper - lower), TA-Lib BBANDS({n},2,2,SMA)", n - 1,
               lambda p, n=n: F.safe_div(p.close - bbands(p, n)[2], bbands(p, n)[0] - bbands(p, n)[2], 0.5), talib="BBANDS")
        fl.add(f"bb_width_{n}", f"Bollinger bandwidth: (upper - lower) / middle, TA-Lib BBANDS({n},2,2,SMA)", n - 1,
               lambda p, n=n: (bbands(p, n)[0] - bbands(p, n)[2]) / bbands(p, n)[1], talib="BBANDS")
    return fl
