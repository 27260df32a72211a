"""Trend: distance of close from SMA / EMA / KAMA and their slopes, in units of ATR(14)."""

from __future__ import annotations

import numpy as np

from foxhunt.features import filters as F
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList

WINDOWS = (5, 10, 20, 50, 100, 200)


def sma(p: Panel, n: int) -> np.ndarray:
    """TA-Lib SMA of the close."""
    return p.memo(("sma", n), lambda: p.close_prefix().mean(n))


def ema(p: Panel, n: int) -> np.ndarray:
    """TA-Lib EMA of the close, seeded with the SMA of the first n closes."""
    return p.memo(("ema", n), lambda: F.ema(p.close, n, out=p.empty()))


def _abs_change_prefix(p: Panel) -> F.Prefix:
    """Prefix sums of |C[t] - C[t-1]| from bar 1, shared by every KAMA window."""
    return p.prefix("abs_close_change", lambda: np.abs(p.close_change()), 1)


def kama(p: Panel, n: int) -> np.ndarray:
    """TA-Lib KAMA(n): Kaufman's adaptive average, smoothing (ER (2/3 - 2/31) + 2/31)^2, seeded at C[n-1]."""

    def f():
        c = p.close
        S, T = c.shape
        out = F.nan_empty((S, T), min(n, T), p.empty())
        if T <= n:
            return out
        a = np.empty((S, T - n))
        y = F.blockwise(_kama_block, out[:, n:], c[:, n:], c[:, :-n], *_abs_change_prefix(p).parts(n, n), a)
        F.linear_recurrence_inplace(a, y, c[:, n - 1], a_min=1.0 - _FASTEST**2)
        return out

    return p.memo(("kama", n), f)


_FASTEST, _SLOWEST = 2.0 / 3.0, 2.0 / 31.0


def _kama_block(now: np.ndarray, then: np.ndarray, hi: np.ndarray, lo: np.ndarray, a: np.ndarray, out: np.ndarray) -> None:
    """KAMA's recurrence y = a y[t-1] + b: a = 1 - sc into ``a``, b = sc C into out, from the closes n bars apart
    and the prefix sums (hi - lo) of |C[t] - C[t-1]| over the window."""
    er = np.subtract(now, then)
    np.abs(er, out=er)
    # |change| <= noise, with equality exactly when TA-Lib sets ER = 1; a flat window (0 / 0) gives 1 too:
    # fmin takes 1 over NaN
    er /= hi - lo
    np.fmin(er, 1.0, out=er)
    er *= _FASTEST - _SLOWEST
    er += _SLOWEST
    sc = np.square(er, out=er)
    np.subtract(1.0, sc, out=a)
    np.multiply(sc, now, out=out)


def _dist(p: Panel, ma: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    return F.diff_times(p.close, ma, p.inv_atr(), out)


def _slope(p: Panel, ma: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    return F.lag_diff_times(ma, 1, p.inv_atr(), out)


def features() -> FeatureList:
    fl = FeatureList("trend")
    for n in WINDOWS:
        fl.add(f"dist_sma_{n}", f"(C - TA-Lib SMA({n})) / ATR(14)", max(n - 1, 14), lambda p, out=None, n=n: _dist(p, sma(p, n), out), talib="SMA")
    for n in WINDOWS:
        fl.add(f"dist_ema_{n}", f"(C - TA-Lib EMA({n})) / ATR(14)", max(n - 1, 14), lambda p, out=None, n=n: _dist(p, ema(p, n), out), talib="EMA")
    for n in (10, 30):
        fl.add(f"dist_kama_{n}", f"(C - TA-Lib KAMA({n})) / ATR(14)", max(n, 14), lambda p, out=None, n=n: _dist(p, kama(p, n), out), talib="KAMA")
    for n in WINDOWS:
        fl.add(f"slope_sma_{n}", f"(SMA({n})[t] - SMA({n})[t-1]) / ATR(14)", max(n, 14), lambda p, out=None, n=n: _slope(p, sma(p, n), out), talib="SMA")
    for n in WINDOWS:
        fl.add(f"slope_ema_{n}", f"(EMA({n})[t] - EMA({n})[t-1]) / ATR(14)", max(n, 14), lambda p, out=None, n=n: _slope(p, ema(p, n), out), talib="EMA")
    for n in (10, 30):
        fl.add(f"slope_kama_{n}", f"(KAMA({n})[t] - KAMA({n})[t-1]) / ATR(14)", max(n + 1, 14), lambda p, out=None, n=n: _slope(p, kama(p, n), out), talib="KAMA")
    for a, b in ((5, 20), (20, 50), (50, 200)):
        fl.add(f"ema_cross_{a}_{b}", f"(EMA({a}) - EMA({b})) / ATR(14)", max(b - 1, 14),
               lambda p, out=None, a=a, b=b: F.diff_times(ema(p, a), ema(p, b), p.inv_atr(), out), talib="EMA")
    return fl
