"""The CPU fast paths of :mod:`foxhunt.features.ops`: numpy kernels on [S, T] float64 arrays, tuned for one core.

``ops`` hands a CPU tensor's zero-copy numpy view here (the switch ``ops.fast_path``); each kernel computes what its
torch reference in ``ops`` computes (the recursive scans, the commonest last steps and the windowed moments run as
compiled loops instead: :mod:`foxhunt.features.native`). Every function reads bar t only from bars <= t: rolling
variance of price levels takes its prefix sums inside blocks centred on a past value (float64 error relative to the
local spread, not to a million squared prices), rolling extrema and arg-extrema double (log2(n) passes, exact; ages
in uint8), and elementwise tails run in cache-sized blocks with a float32 destination written once. No Python loop
runs over bars; rows that an indicator has not yet filled are NaN.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from foxhunt.features import native


class BufferPool:
    """Float64 scratch buffers recycled within one computation, so that a freed 8 MB temporary is not handed back
    to the OS and faulted in again (~2,000 page faults) by the next one.

    A buffer is lent as a view of a flat array that the pool keeps; it is free again once nothing else refers to
    that array (no view, tensor or numpy array built on it is alive: CPython's reference count says so, with no
    bookkeeping by the borrower). Requests are rounded up to whole 2 MiB (huge) pages, so series of T, T + 1 or
    T - n bars share buffers, and start on one (a fresh 8 MB buffer then costs 4 page faults, not ~500).
    :meth:`trim` frees idle buffers beyond a few; everything goes with the pool (the end of the computation).
    """

    GRANULE = 1 << 21  # bytes; also the transparent huge page size numpy asks for
    MIN_BYTES = 1 << 20  # smaller requests go to malloc, which keeps them on its heap anyway

    def __init__(self) -> None:
        self._bufs: list[np.ndarray] = []  # the arrays that own the memory
        self._offs: list[int] = []  # where each one's first 2 MiB-aligned element is
        self._idle_refs = 0
        self._bufs.append(np.empty(0))
        self._idle_refs = self._refs(0)  # the count of a buffer only the pool holds, measured the same way
        self._bufs.clear()

    def _refs(self, i: int) -> int:
        return sys.getrefcount(self._bufs[i])

    def trim(self, keep: int = 8) -> None:
        """Free all but ``keep`` idle buffers (called between features): the pool then holds what is in use plus a
        few buffers for the next feature's temporaries, so peak memory stays near what the features keep alive."""
        idle = [i for i in range(len(self._bufs)) if self._refs(i) == self._idle_refs]
        for i in reversed(idle[keep:]):
            del self._bufs[i], self._offs[i]

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (lent or idle)."""
        return sum(b.nbytes for b in self._bufs)

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialised float64 array of ``shape``: an idle buffer of the same size class, or a new one."""
        n = math.prod(shape)
        if 8 * n < self.MIN_BYTES:
            return np.empty(shape)
        g = self.GRANULE // 8
        cap = -(-n // g) * g + g  # whole huge pages, and one more to align the start on one
        for i in range(len(self._bufs)):  # by index: a loop variable would hold a reference itself
            if self._bufs[i].size == cap and self._refs(i) == self._idle_refs:
                return self._bufs[i][self._offs[i] : self._offs[i] + n].reshape(shape)
        self._bufs.append(np.empty(cap))
        self._offs.append(-self._bufs[-1].ctypes.data % self.GRANULE // 8)  # huge pages cover all of it
        return self._bufs[-1][self._offs[-1] : self._offs[-1] + n].reshape(shape)


_POOL: contextvars.ContextVar[BufferPool | None] = contextvars.ContextVar("foxhunt_feature_buffer_pool", default=None)


@contextlib.contextmanager
def recycling():
    """Within this block (one feature computation), :func:`empty` lends recycled buffers from one
    :class:`BufferPool`, dropped on exit. A scoped mode, like ``torch.no_grad``: nothing outlives the block."""
    token = _POOL.set(BufferPool())
    try:
        yield _POOL.get()
    finally:
        _POOL.reset(token)


def empty(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised float64 array: from the active :class:`BufferPool` inside :func:`recycling`, else numpy's."""
    pool = _POOL.get()
    return np.empty(shape) if pool is None else pool.empty(tuple(shape))


def zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A float64 array of zeros, from :func:`empty`."""
    out = empty(shape)
    out.fill(0.0)
    return out


def nan_empty(shape: tuple[int, ...], filled: int, out: np.ndarray | None = None) -> np.ndarray:
    """An uninitialised float64 array (``out`` if given) whose first ``filled`` bars (last axis) are NaN."""
    out = empty(shape) if out is None else out
    out[..., :filled] = np.nan
    return out


def cumsum(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Running sum along the last axis: torch's sequential loop gives numpy's result bit for bit, ~4x faster."""
    if out is None:
        out = empty(x.shape)
    if not x.flags.writeable:
        x = x.copy()
    torch.cumsum(torch.from_numpy(x), dim=-1, out=torch.from_numpy(out))
    return out


def blockwise(fn, out: np.ndarray, *arrays: np.ndarray, block: int = 32768) -> np.ndarray:
    """out = fn(*arrays) evaluated on blocks of bars (last axis), ``fn(*blocks, out=block_of_out)`` elementwise:
    the expression's temporaries then stay in cache instead of making full-length round trips to memory."""
    T = out.shape[-1]
    for a in range(0, T, block):
        b = min(T, a + block)
        fn(*(x[..., a:b] for x in arrays), out=out[..., a:b])
    return out


def pct_change(x: np.ndarray, k: int, out: np.ndarray | None = None) -> np.ndarray:
    """100 (x[t] / x[t-k] - 1), NaN for the first k bars, into ``out`` when given (TA-Lib ROC); blockwise."""
    out = empty(x.shape) if out is None else out
    out[:, :k] = np.nan
    blockwise(_pct_block, out[:, k:], x[:, k:], x[:, :-k])
    return out


def _pct_block(now: np.ndarray, then: np.ndarray, out: np.ndarray) -> None:
    r = now / then
    r -= 1.0
    np.multiply(r, 100.0, out=out)


def _cumsum_of_squares(x: np.ndarray) -> np.ndarray:
    """Running sum of x^2 along the last axis, in one buffer."""
    sq = np.square(x, out=empty(x.shape))
    return cumsum(sq, out=sq)


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
        xp = zeros((S, W - 1 + nb * B))
        xp[:, W - 1 + start : W - 1 + T] = x[:, start:]
        st0, st1 = xp.strides
        view = as_strided(xp, shape=(S, nb, B + W - 1), strides=(st0, B * st1, st1), writeable=False)
        self.ref = view[:, :, W - 1 : W].copy()  # [S, nb, 1]
        early = min(nb, -(-start // B))  # blocks that begin before ``start``: centre on x[start] instead
        if early and start < T:
            self.ref[:, :early, 0] = x[:, start : start + 1]
        d = zeros((S, nb, B + W))
        np.subtract(view, self.ref, out=d[:, :, 1:])
        for k in range(min(nb, (start + W - 1) // B + 1)):  # bars before ``start`` (and the padding) add nothing
            d[:, k, 1 : 1 + max(0, start + W - 1 - k * B)] = 0.0
        self.cs2 = _cumsum_of_squares(d) if squares else None
        self.cs = cumsum(d, out=d)

    def _parts(self, cs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(hi, lo) in block layout [S, nb, B]: their window sums over n bars are hi - lo."""
        if n > self.W:
            raise ValueError(f"window {n} exceeds this prefix's max_window {self.W}")
        W, B = self.W, self.B
        return cs[:, :, W : W + B], cs[:, :, W - n : W - n + B]

    def _window(self, cs: np.ndarray, n: int) -> np.ndarray:
        """Window sums [S, nb, B] of the centred series (block layout)."""
        return np.subtract(*self._parts(cs, n), out=empty((self.shape[0], self.nb, self.B)))

    def _flat(self, w: np.ndarray, n: int) -> np.ndarray:
        """Block layout [S, nb, B] to bars [S, T], NaN before the first full window."""
        S, T = self.shape
        out = w.reshape(S, self.nb * self.B)[:, :T]
        out[:, : min(T, self.start + n - 1)] = np.nan
        return out

    def sum(self, n: int) -> np.ndarray:
        """Sum of x[t-n+1..t]."""
        w = self._window(self.cs, n)
        w += n * self.ref
        return self._flat(w, n)

    def mean(self, n: int) -> np.ndarray:
        """Mean of x[t-n+1..t] (TA-Lib SMA): one compiled pass over the blocks (:mod:`foxhunt.features.native`)."""
        w = empty((self.shape[0], self.nb, self.B))
        native.block_mean(*self._parts(self.cs, n), self.ref, n, w)
        return self._flat(w, n)

    def mean_std(self, n: int, k: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Rolling mean and k population standard deviations over n bars (TA-Lib SMA and k STDDEV), one compiled pass."""
        if self.cs2 is None:
            raise ValueError("BlockPrefix built without squares")
        S = self.shape[0]
        mean, sd = empty((S, self.nb, self.B)), empty((S, self.nb, self.B))
        native.block_mean_std(*self._parts(self.cs, n), *self._parts(self.cs2, n), self.ref, n, k, mean, sd)
        return self._flat(mean, n), self._flat(sd, n)

    def mean_var(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rolling mean and population variance over n bars (TA-Lib SMA and VAR)."""
        if self.cs2 is None:
            raise ValueError("BlockPrefix built without squares")
        m, var = self._window(self.cs, n), self._window(self.cs2, n)
        m /= n
        var /= n
        var -= m * m
        np.maximum(var, 0.0, out=var)
        m += self.ref
        return self._flat(m, n), self._flat(var, n)


def rolling_max(x: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Highest value of x[t-n+1..t] (doubling: ceil(log2 n) + 1 passes, exact)."""
    return _rolling_extreme(x, n, np.maximum, out)


def rolling_min(x: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Lowest value of x[t-n+1..t]."""
    return _rolling_extreme(x, n, np.minimum, out)


def _rolling_extreme(x: np.ndarray, n: int, op, out: np.ndarray | None, chunk: int = 32768) -> np.ndarray:
    S, T = x.shape
    out = nan_empty((S, T), min(T, n - 1), out)
    for a in range(n - 1, T, chunk):  # runs of bars (with the n - 1 before them) that stay in cache
        b = min(T, a + chunk)
        _extreme_tail(x[:, a - n + 1 : b], n, op, out[:, a:b])
    return out


def _extreme_tail(x: np.ndarray, n: int, op, dst: np.ndarray) -> None:
    """Extreme of the last n bars at each bar n-1.. of x, into dst (doubling: ceil(log2 n) + 1 passes, exact)."""
    T = x.shape[1]
    m, k = x, 1  # m[t] = extreme of x[t-k+1..t]
    spare = [np.empty_like(x), np.empty_like(x)] if 4 <= n else [np.empty_like(x)]
    while 2 * k <= n:
        nxt = spare[0] if m is not spare[0] else spare[-1]
        nxt[:, :k] = m[:, :k]
        op(m[:, k:], m[:, :-k], out=nxt[:, k:])
        m, k = nxt, 2 * k
    # window of n = [t-n+1, t-n+k] U [t-k+1, t]
    op(m[:, n - 1 :], m[:, k - 1 : T - n + k], out=dst)


def bars_since_extreme(x: np.ndarray, n: int, highest: bool, out: np.ndarray | None = None, chunk: int = 32768,
                       aroon: bool = False) -> np.ndarray:
    """Bars since the highest (lowest) value of x[t-n..t], n+1 bars, ties to the latest bar (TA-Lib AROON); with
    ``aroon``, TA-Lib's Aroon line (100 / n) (n - age) instead, written in the same pass.

    Doubling on (extreme, age) pairs, the age (bars since the window's extreme, < 256) in uint8 so that
    it costs little memory traffic: when two halves tie the later one wins. Runs of bars stay in cache.
    """
    S, T = x.shape
    w = n + 1
    out = nan_empty((S, T), min(T, w - 1), out)
    if w > 128:
        raise ValueError(f"bars_since_extreme: window {w} exceeds 128 bars")
    for a in range(w - 1, T, chunk):
        b = min(T, a + chunk)
        _bars_since_tail(x[:, a - w + 1 : b], w, highest, out[:, a:b], n if aroon else None)
    return out


def _bars_since_tail(x: np.ndarray, w: int, highest: bool, dst: np.ndarray, aroon: int | None = None) -> None:
    """Bars since the extreme of the last w bars at each bar w-1.. of x, into dst (the Aroon line of n = ``aroon``
    bars instead when given: (n - age) times 100 / n, as the reference path rounds it)."""
    S, T = x.shape
    op, later_of = (np.maximum, np.greater_equal) if highest else (np.minimum, np.less_equal)
    m, age, k = x, np.zeros((S, T), np.uint8), 1  # extreme of x[t-k+1..t] and bars since it
    vals, ages = [np.empty_like(x), np.empty_like(x)], [np.empty((S, T), np.uint8), age]
    later, d = np.empty((S, T), bool), np.empty((S, T), np.uint8)
    while 2 * k <= w:
        j = 0 if m is not vals[0] else 1
        nm, na = vals[j], ages[0] if age is not ages[0] else ages[1]
        nm[:, :k], na[:, :k] = m[:, :k], age[:, :k]
        _merge(m[:, k:], age[:, k:], m[:, :-k], age[:, :-k], k, op, later_of, nm[:, k:], na[:, k:], later[:, k:], d[:, k:])
        m, age, k = nm, na, 2 * k
    # window of w = [t-w+1, t-w+k] (ends k - w bars back) U [t-k+1, t]
    a, b = slice(w - 1, None), slice(k - 1, T - w + k)
    res = ages[0] if age is not ages[0] else ages[1]
    _merge(m[:, a], age[:, a], m[:, b], age[:, b], w - k, op, later_of, None, res[:, a], later[:, a], d[:, a])
    if aroon is None:
        dst[...] = res[:, a]
    else:
        np.subtract(float(aroon), res[:, a], out=dst)  # n - age, exact
        dst *= 100.0 / aroon


def _merge(m_new, age_new, m_old, age_old, lag, op, later_of, m_out, age_out, later, d) -> None:
    """Combine a recent window's (extreme, age) with an older one's ending ``lag`` bars back; ties go to the recent.

    The combined extreme goes to ``m_out`` unless it is None (the last merge needs only the age).
    """
    later_of(m_new, m_old, out=later)
    if m_out is not None:
        op(m_new, m_old, out=m_out)
    np.add(age_old, lag, out=age_out)  # the older window's age, seen from t
    np.subtract(age_out, age_new, out=d)
    d *= later
    age_out -= d
