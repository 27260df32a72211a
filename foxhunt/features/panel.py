"""Panel: the bars of several symbols as [S, T] float64 arrays, with a memo of shared intermediates."""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable

import numpy as np

from foxhunt.features import filters as F


class PanelBase:
    """What both backends' panels share: the OHLCV rows of an ``ohlcv`` [5, S, T] array and the memo."""

    ohlcv: object
    _memo: dict
    trace: set | None

    open = property(lambda self: self.ohlcv[0])
    high = property(lambda self: self.ohlcv[1])
    low = property(lambda self: self.ohlcv[2])
    close = property(lambda self: self.ohlcv[3])
    volume = property(lambda self: self.ohlcv[4])

    def memo(self, key: Hashable, fn: Callable[[], object]):
        """Compute ``fn()`` once per panel under ``key``."""
        if self.trace is not None:
            self.trace.add(key)
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]


class Panel(PanelBase):
    """OHLCV of S symbols, one row each, padded with NaN after a symbol's last bar.

    Padding sits after every real bar and every computation is causal, so it never reaches a real
    bar's value. Intermediates shared by several features (log close, true range, ATR...) are computed
    once per panel through :meth:`memo`.
    """

    def __init__(self, ohlcv: np.ndarray, timestamps: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        self.ohlcv = ohlcv  # [5, S, T]
        self.timestamps = timestamps  # [S, T] int64 ns UTC
        self.starts = starts  # [S] first flat row of each symbol
        self.lengths = lengths  # [S] bars of each symbol
        self._memo: dict[Hashable, object] = {}
        self.trace: set | None = None  # when a set, records every memo key touched (for release plans)
        self._spare: list[np.ndarray] = []  # released [S, T] buffers, reused by empty()

    @classmethod
    def from_flat(cls, ohlcv: np.ndarray, timestamps: np.ndarray, symbol_index: np.ndarray) -> Panel:
        """Build from rows sorted by (symbol, time): ohlcv [N, 5], timestamps [N], symbol_index [N]."""
        return cls.from_columns(np.ascontiguousarray(ohlcv.T, dtype=np.float64), timestamps, symbol_index)

    @classmethod
    def from_columns(cls, cols: np.ndarray, timestamps: np.ndarray, symbol_index: np.ndarray) -> Panel:
        """Build from the columns [5, N] (open, high, low, close, volume; float64, contiguous) of rows sorted by
        (symbol, time); a single symbol's panel is a view of them."""
        n = cols.shape[1]
        step = np.diff(symbol_index)
        if (step < 0).any():
            raise ValueError("features: rows must be sorted by symbol then time (symbol_index decreases somewhere)")
        # rows are grouped by symbol: a symbol starts where the index moves (no sort, unlike np.unique)
        starts = np.concatenate([[0], np.flatnonzero(step) + 1]) if n else np.zeros(0, dtype=np.int64)
        lengths = np.diff(np.append(starts, n))
        S, T = len(lengths), int(lengths.max()) if n else 0
        if S == 1:
            arr = cols.reshape(5, 1, T)
            ts = np.asarray(timestamps, dtype=np.int64).reshape(1, T)
        else:
            arr = np.full((5, S, T), np.nan)
            ts = np.zeros((S, T), dtype=np.int64)
            for s, (a, m) in enumerate(zip(starts, lengths)):
                arr[:, s, :m] = cols[:, a : a + m]
                ts[s, :m] = timestamps[a : a + m]
        return cls(arr, ts, starts, lengths)

    @property
    def shape(self) -> tuple[int, int]:
        return self.ohlcv.shape[1:]

    def forget(self, keys) -> None:
        """Drop memoised intermediates no later feature needs, to bound peak memory; their buffers serve later ones."""
        for k in keys:
            items = self._memo.pop(k, None)
            probe = (object(),)  # a tuple nothing else holds (built at run time, not a constant)
            if isinstance(items, tuple) and sys.getrefcount(items) > sys.getrefcount(probe):
                continue  # the tuple itself is still held elsewhere, and with it its arrays
            if not isinstance(items, tuple):
                items = (items,)
            for i in range(len(items)):
                self._keep_if_unshared(items, i)

    def _keep_if_unshared(self, items: tuple, i: int, keep: int = 8) -> None:
        """Keep items[i] for :meth:`empty` if it is a whole [S, T] float64 array that nothing else references."""
        a = items[i]
        probe_items = (np.empty(0),)  # the same references to an object nothing else holds: the unshared count
        probe = probe_items[0]
        if (
            len(self._spare) < keep
            and isinstance(a, np.ndarray)
            and a.base is None
            and a.shape == self.shape
            and a.dtype == np.float64
            and a.flags.writeable
            and sys.getrefcount(a) <= sys.getrefcount(probe)
        ):
            self._spare.append(a)

    def empty(self) -> np.ndarray:
        """A float64 [S, T] buffer for an intermediate: a released one when there is one (its pages are already
        mapped: a fresh 8 MB array costs ~2,000 page faults, which is more than computing into it), else a new one."""
        return self._spare.pop() if self._spare else np.empty(self.shape)

    def prefix(self, key: Hashable, fn: Callable[[], np.ndarray], start: int = 0, squares: bool = False) -> F.Prefix:
        """Shared prefix sums of the series ``fn()`` (named ``key``): every window length is then one subtraction."""
        return self.memo(("prefix", key, start, squares), lambda: F.Prefix(fn(), start, squares))

    def close_prefix(self) -> F.BlockPrefix:
        """Block-centred prefix sums of the close and its square, shared by the SMAs and Bollinger bands."""
        return self.memo("close_block_prefix", lambda: F.BlockPrefix(self.close, 200, squares=True))

    # shared intermediates used across families
    def log_close(self) -> np.ndarray:
        return self.memo("log_close", lambda: np.log(self.close, out=self.empty()))

    def log_return(self, k: int = 1, out: np.ndarray | None = None) -> np.ndarray:
        """ln C[t] - ln C[t-k], into ``out`` when given; only the 1-bar return is shared (memoised)."""
        if k == 1:
            return F.put(self.memo(("log_return", 1), lambda: F.diff(self.log_close(), 1, self.empty())), out)
        return F.diff(self.log_close(), k, out)

    def close_change(self) -> np.ndarray:
        """C[t] - C[t-1]."""
        return self.memo("close_change", lambda: F.diff(self.close, 1, self.empty()))

    def prev_close(self) -> np.ndarray:
        return self.memo("prev_close", lambda: F.shift(self.close, 1, out=self.empty()))

    def true_range(self) -> np.ndarray:
        """TA-Lib TRANGE: max(H, C[t-1]) - min(L, C[t-1]); undefined at the first bar."""

        def f():
            pc = self.prev_close()
            tr = np.maximum(self.high, pc, out=self.empty())
            tr -= np.minimum(self.low, pc)
            return tr

        return self.memo("true_range", f)

    def atr(self, n: int = 14) -> np.ndarray:
        """TA-Lib ATR: Wilder smoothing of the true range, seeded with its mean over bars 1..n."""
        return self.memo(("atr", n), lambda: F.wilder(self.true_range(), n, start=1, out=self.empty()))

    def inv_atr(self) -> np.ndarray:
        """1 / ATR(14): features in ATR units multiply by it (a multiply is cheaper than a divide)."""
        return self.memo("inv_atr_14", lambda: np.divide(1.0, self.atr(14), out=self.empty()))

    def per_atr(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x / ATR(14): price units to ATR units."""
        return np.multiply(x, self.inv_atr(), out=out)

    def typical_price(self) -> np.ndarray:
        def f():
            tp = np.add(self.high, self.low, out=self.empty())
            tp += self.close
            tp /= 3.0
            return tp

        return self.memo("typical_price", f)

    def hl_range(self) -> np.ndarray:
        return self.memo("hl_range", lambda: np.subtract(self.high, self.low, out=self.empty()))

    def volume_mean(self, n: int) -> np.ndarray:
        """SMA(n) of the volume."""
        return self.prefix("volume", lambda: self.volume).sum(n) / n
