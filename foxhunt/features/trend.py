"""Trend: distance of close from SMA / EMA / KAMA and their slopes, in units of ATR(14)."""

from __future__ import annotations

import numpy as np

from foxhunt.features import filters as F
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList

WINDOWS = (5, 10, 20, 50, 100, 200)


def sma(p: Panel, n: int) -> np.ndarray:
    """TA-Lib SMA of the close."""
    return p.memo(("sma", n), lambda: p.close_prefix().sum(n) / n)


def ema(p: Panel, n: int) -> np.ndarray:
    """TA-Lib EMA of the close, seeded with the SMA of the first n closes."""
    return p.memo(("ema", n), lambda: F.ema(p.close, n))


def kama(p: Panel, n: int) -> np.ndarray:
    """TA-Lib KAMA(n): Kaufman's adaptive average, smoothing (ER (2/3 - 2/31) + 2/31)^2, seeded at C[n-1]."""

    def f():
        c = p.close
        S, T = c.shape
        out = np.full((S, T), np.nan)
        if T <= n:
            return out
        noise = F.rolling_sum(np.abs(F.diff(c, 1)), n, start=1)[:, n:]
        change = c[:, n:] - c[:, :-n]
        # |change| <= noise, with equality exactly when TA-Lib sets ER = 1; a flat window (noise 0) gives 1 too
        er = np.minimum(F.safe_div(np.abs(change), noise, fill=1.0), 1.0)
        fastest, slowest = 2.0 / 3.0, 2.0 / 31.0
        sc = (er * (fastest - slowest) + slowest) ** 2
        out[:, n:] = F.linear_recurrence(1.0 - sc, sc * c[:, n:], c[:, n - 1], a_min=1.0 - fastest**2)
        return out

    return p.memo(("kama", n), f)


def _dist(p: Panel, ma: np.ndarray) -> np.ndarray:
    return (p.close - ma) / p.atr(14)


def _slope(p: Panel, ma: np.ndarray) -> np.ndarray:
    return F.diff(ma, 1) / p.atr(14)


def features() -> FeatureList:
    fl = FeatureList("trend")
    for n in WINDOWS:
        fl.add(f"dist_sma_{n}", f"(C - TA-Lib SMA({n})) / ATR(14)", max(n - 1, 14), lambda p, n=n: _dist(p, sma(p, n)), talib="SMA")
    for n in WINDOWS:
        fl.add(f"dist_ema_{n}", f"(C - TA-Lib EMA({n})) / ATR(14)", max(n - 1, 14), lambda p, n=n: _dist(p, ema(p, n)), talib="EMA")
    for n in (10, 30):
        fl.add(f"dist_kama_{n}", f"(C - TA-Lib KAMA({n})) / ATR(14)", max(n, 14), lambda p, n=n: _dist(p, kama(p, n)), talib="KAMA")
    for n in WINDOWS:
        fl.add(f"slope_sma_{n}", f"(SMA({n})[t] - SMA({n})[t-1]) / ATR(14)", max(n, 14), lambda p, n=n: _slope(p, sma(p, n)), talib="SMA")
    for n in WINDOWS:
        fl.add(f"slope_ema_{n}", f"(EMA({n})[t] - EMA({n})[t-1]) / ATR(14)", max(n, 14), lambda p, n=n: _slope(p, ema(p, n)), talib="EMA")
    for n in (10, 30):
        fl.add(f"slope_kama_{n}", f"(KAMA({n})[t] - KAMA({n})[t-1]) / ATR(14)", max(n + 1, 14), lambda p, n=n: _slope(p, kama(p, n)), talib="KAMA")
    for a, b in ((5, 20), (20, 50), (50, 200)):
        fl.add(f"ema_cross_{a}_{b}", f"(EMA({a}) - EMA({b})) / ATR(14)", max(b - 1, 14), lambda p, a=a, b=b: (ema(p, a) - ema(p, b)) / p.atr(14), talib="EMA")
    return fl
