"""Causal building blocks on [S, T] float64 panels (one row per symbol, time on the last axis).

Every function here reads bar t only from bars <= t: recursive filters run as IIR filters
(``scipy.signal.lfilter``) or as a blocked linear-recurrence scan, rolling sums as differences of
prefix sums (sequential, so a sum at t never depends on later bars; rolling variance of price levels
takes its prefix sums inside blocks, centred on a past value, so float64 error stays relative to the
local spread rather than to a million squared prices), rolling extrema and arg-extrema by doubling
(log2(n) vectorised passes, exact). No Python loop runs over bars.
Rows that an indicator has not yet filled are NaN.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided
from scipy.signal import lfilter


def shift(x: np.ndarray, k: int, fill: float = np.nan) -> np.ndarray:
    """x[t - k] (k > 0 looks back), padded with ``fill``."""
    out = np.empty_like(x)
    if k <= 0:
        raise ValueError(f"shift: k must be positive (a look-back), got {k}")
    out[:, :k] = fill
    out[:, k:] = x[:, :-k] if k < x.shape[1] else x[:, :0]
    return out


def diff(x: np.ndarray, k: int = 1) -> np.ndarray:
    """x[t] - x[t - k]."""
    out = np.empty_like(x)
    out[:, :k] = np.nan
    np.subtract(x[:, k:], x[:, :-k], out=out[:, k:])
    return out


def safe_div(num: np.ndarray, den: np.ndarray, fill: float = 0.0) -> np.ndarray:
    """num / den with ``fill`` where den is 0 (TA-Lib's convention for flat ranges)."""
    zero = den == 0
    if not zero.any():
        return num / den
    out = num / np.where(zero, 1.0, den)
    out[zero] = fill
    return out


def rolling_sum(x: np.ndarray, n: int, start: int = 0) -> np.ndarray:
    """Sum of x[t-n+1..t] as a difference of prefix sums; defined from t = start + n - 1 (x valid from ``start``)."""
    S, T = x.shape
    if n < 1:
        raise ValueError(f"window must be >= 1, got {n}")
    out = np.full((S, T), np.nan)
    if T < start + n:
        return out
    cs = np.cumsum(x[:, start:], axis=1)
    out[:, start + n - 1] = cs[:, n - 1]
    np.subtract(cs[:, n:], cs[:, :-n], out=out[:, start + n :])
    return out


def rolling_mean(x: np.ndarray, n: int, start: int = 0) -> np.ndarray:
    """Simple moving average over n bars (TA-Lib SMA) of a series near zero or of small windows.

    For long windows over price levels use :class:`BlockPrefix`, whose error does not grow with the level.
    """
    return rolling_sum(x, n, start) / n


class Prefix:
    """Prefix sums of x (and x^2) from ``start``, shared by every window length over the same series.

    A window sum is then one subtraction. Sequential prefix sums never mix in later bars; their
    rounding error is relative to the running total, so use :class:`BlockPrefix` for price levels.
    """

    def __init__(self, x: np.ndarray, start: int = 0, squares: bool = False) -> None:
        self.shape, self.start = x.shape, start
        xs = x[:, start:]
        self.cs = np.cumsum(xs, axis=1)
        self.cs2 = np.cumsum(xs * xs, axis=1) if squares else None

    def _window(self, cs: np.ndarray, n: int) -> np.ndarray:
        S, T = self.shape
        out = np.full((S, T), np.nan)
        a = self.start + n - 1
        if a < T:
            out[:, a] = cs[:, n - 1]
            np.subtract(cs[:, n:], cs[:, :-n], out=out[:, a + 1 :])
        return out

    def sum(self, n: int) -> np.ndarray:
        """Sum of x[t-n+1..t]; NaN before start + n - 1."""
        return self._window(self.cs, n)

    def mean_var(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rolling mean and population variance over n bars."""
        if self.cs2 is None:
            raise ValueError("Prefix built without squares")
        s1, s2 = self._window(self.cs, n), self._window(self.cs2, n)
        mean = s1 / n
        var = s2 / n - mean * mean
        np.maximum(var, 0.0, out=var)
        return mean, var


class BlockPrefix:
    """Prefix sums of x - r (and (x - r)^2) inside blocks, for windows up to ``max_window`` bars of a price level.

    Each block of ``block`` output bars carries the max_window - 1 bars before it and is centred on r,
    x at the block's first output bar (a past value for every bar of the block). Rounding error then
    scales with the local spread of x, not with its level times the series length, and a sum at t
    still depends only on bars <= t.
    """

    def __init__(self, x: np.ndarray, max_window: int, start: int = 0, squares: bool = False, block: int = 512) -> None:
        S, T = x.shape
        W, B = max_window, max(block, max_window)
        nb = max(1, -(-T // B))
        self.shape, self.start, self.W, self.B, self.nb = (S, T), start, W, B, nb
        xp = np.zeros((S, W - 1 + nb * B))
        xp[:, W - 1 + start : W - 1 + T] = x[:, start:]
        st0, st1 = xp.strides
        view = as_strided(xp, shape=(S, nb, B + W - 1), strides=(st0, B * st1, st1), writeable=False)
        self.ref = view[:, :, W - 1 : W].copy()  # [S, nb, 1]
        early = min(nb, -(-start // B))  # blocks that begin before ``start``: centre on x[start] instead
        if early and start < T:
            self.ref[:, :early, 0] = x[:, start : start + 1]
        d = np.zeros((S, nb, B + W))
        np.subtract(view, self.ref, out=d[:, :, 1:])
        for k in range(min(nb, (start + W - 1) // B + 1)):  # bars before ``start`` (and the padding) add nothing
            d[:, k, 1 : 1 + max(0, start + W - 1 - k * B)] = 0.0
        self.cs2 = np.cumsum(d * d, axis=2) if squares else None
        self.cs = np.cumsum(d, axis=2, out=d)

    def _window(self, cs: np.ndarray, n: int) -> np.ndarray:
        if n > self.W:
            raise ValueError(f"window {n} exceeds this prefix's max_window {self.W}")
        S, T = self.shape
        W, B = self.W, self.B
        w = cs[:, :, W : W + B] - cs[:, :, W - n : W - n + B]
        out = w.reshape(S, self.nb * B)[:, :T]
        out[:, : min(T, self.start + n - 1)] = np.nan
        return out

    def _ref_flat(self) -> np.ndarray:
        S, T = self.shape
        return np.broadcast_to(self.ref, (S, self.nb, self.B)).reshape(S, self.nb * self.B)[:, :T]

    def sum(self, n: int) -> np.ndarray:
        """Sum of x[t-n+1..t]."""
        out = self._window(self.cs, n)
        out += n * self._ref_flat()
        return out

    def mean_var(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rolling mean and population variance over n bars (TA-Lib SMA and VAR)."""
        if self.cs2 is None:
            raise ValueError("BlockPrefix built without squares")
        s1, s2 = self._window(self.cs, n), self._window(self.cs2, n)
        m = s1 / n
        var = s2 / n - m * m
        np.maximum(var, 0.0, out=var)
        m += self._ref_flat()
        return m, var


def rolling_max(x: np.ndarray, n: int) -> np.ndarray:
    """Highest value of x[t-n+1..t] (doubling: ceil(log2 n) + 1 passes, exact)."""
    return _rolling_extreme(x, n, np.maximum)


def rolling_min(x: np.ndarray, n: int) -> np.ndarray:
    """Lowest value of x[t-n+1..t]."""
    return _rolling_extreme(x, n, np.minimum)


def _rolling_extreme(x, n, op):
    S, T = x.shape
    out = np.full((S, T), np.nan)
    if T < n:
        return out
    m, k = x, 1  # m[t] = extreme of x[t-k+1..t]
    while 2 * k <= n:
        nxt = np.empty_like(m)
        nxt[:, :k] = m[:, :k]
        op(m[:, k:], m[:, :-k], out=nxt[:, k:])
        m, k = nxt, 2 * k
    # window of n = [t-n+1, t-n+k] U [t-k+1, t]
    op(m[:, n - 1 :], m[:, k - 1 : T - n + k], out=out[:, n - 1 :])
    return out


def bars_since_extreme(x: np.ndarray, n: int, highest: bool) -> np.ndarray:
    """Bars since the highest (lowest) value of x[t-n..t], n+1 bars, ties to the latest bar (TA-Lib AROON).

    Doubling on (value, position) pairs: when two halves tie the later one wins.
    """
    S, T = x.shape
    out = np.full((S, T), np.nan)
    w = n + 1
    if T < w:
        return out
    v = x if highest else -x
    pos = np.broadcast_to(np.arange(T, dtype=np.int32 if T < 2**31 else np.int64), (S, T))
    m, i, k = v, pos, 1
    while 2 * k <= w:
        later = m[:, k:] >= m[:, :-k]
        nm, ni = np.empty_like(m), np.empty(i.shape, i.dtype)
        nm[:, :k], ni[:, :k] = m[:, :k], i[:, :k]
        np.maximum(m[:, k:], m[:, :-k], out=nm[:, k:])
        d = i[:, k:] - i[:, :-k]
        d *= later
        np.add(i[:, :-k], d, out=ni[:, k:])
        m, i, k = nm, ni, 2 * k
    a, b = slice(w - 1, None), slice(k - 1, T - w + k)  # recent half ends at t, older half at t - w + k
    later = m[:, a] >= m[:, b]
    d = i[:, a] - i[:, b]
    d *= later
    d += i[:, b]
    np.subtract(pos[:, w - 1 :], d, out=out[:, w - 1 :])
    return out


def ema(x: np.ndarray, n: int | None = None, start: int = 0, alpha: float | None = None, seed: str = "sma") -> np.ndarray:
    """Exponential moving average as TA-Lib computes it.

    x is valid from ``start``; the filter is seeded at ``start + n - 1`` with the simple mean of the
    first n valid values (TA-Lib's default seeding), then y[t] = y[t-1] + alpha * (x[t] - y[t-1]) with
    alpha = 2 / (n + 1) unless given (Wilder smoothing: alpha = 1 / n). ``seed="first"`` seeds with the
    first valid value at ``start`` instead (TA-Lib's ADOSC).
    """
    if alpha is None:
        alpha = 2.0 / (n + 1)
    S, T = x.shape
    out = np.full((S, T), np.nan)
    if seed == "sma":
        s = start + n - 1
        if s >= T:
            return out
        y0 = x[:, start : s + 1].mean(axis=1)
    elif seed == "first":
        s = start
        if s >= T:
            return out
        y0 = x[:, s].copy()
    else:
        raise ValueError(f"unknown EMA seeding {seed!r}")
    out[:, s] = y0
    if s + 1 < T:
        a = 1.0 - alpha
        zi = (a * y0)[:, None]
        out[:, s + 1 :] = lfilter([alpha], [1.0, -a], x[:, s + 1 :], axis=1, zi=zi)[0]
    return out


def wilder(x: np.ndarray, n: int, start: int = 0) -> np.ndarray:
    """Wilder's smoothing (RSI, ATR, ADX): an EMA with alpha = 1/n, seeded with the mean of the first n values."""
    return ema(x, n, start, alpha=1.0 / n)


def wilder_sum(x: np.ndarray, n: int, start: int = 0) -> np.ndarray:
    """Wilder's running sum as TA-Lib's DM/DI: seeded with the sum of n-1 values, then y = y - y/n + x."""
    S, T = x.shape
    out = np.full((S, T), np.nan)
    s = start + n - 2
    if s >= T or n < 2:
        return out
    y0 = x[:, start : s + 1].sum(axis=1)
    out[:, s] = y0
    if s + 1 < T:
        a = 1.0 - 1.0 / n
        out[:, s + 1 :] = lfilter([1.0], [1.0, -a], x[:, s + 1 :], axis=1, zi=(a * y0)[:, None])[0]
    return out


def linear_recurrence(a: np.ndarray, b: np.ndarray, y0: np.ndarray, a_min: float) -> np.ndarray:
    """y[t] = a[t] * y[t-1] + b[t] for t = 0..T-1 from y[-1] = y0, with a_min <= a <= 1 (blocked scan).

    Within a block of B bars, y = A * (y_in + cumsum(b / A)) with A the running product of a; B comes
    from the caller's bound ``a_min`` (never from the data, so the blocking, and hence the rounding, of
    bar t cannot depend on later bars) and keeps A above float64 underflow. Block carries are passed
    on by a short loop over blocks, not bars.
    """
    S, T = a.shape
    if not 0.0 < a_min <= 1.0:
        raise ValueError(f"linear_recurrence: a_min must be in (0, 1], got {a_min}")
    B = int(min(1024, max(1, 250 // max(1e-12, -np.log10(a_min)))))
    nb = -(-T // B)
    ap = np.ones((S, nb * B))
    bp = np.zeros((S, nb * B))
    ap[:, :T] = a
    bp[:, :T] = b
    A = np.cumprod(ap.reshape(S, nb, B), axis=2)
    P = A * np.cumsum(bp.reshape(S, nb, B) / A, axis=2)  # block-local response to b from a zero start
    carry = np.empty((S, nb))
    c = np.asarray(y0, dtype=np.float64).copy()
    Aend, Pend = A[:, :, -1], P[:, :, -1]
    for k in range(nb):  # one step per block of B bars
        carry[:, k] = c
        c = Aend[:, k] * c + Pend[:, k]
    y = A * carry[:, :, None] + P
    return y.reshape(S, nb * B)[:, :T]
