"""Panel: the bars of several symbols as [S, T] float64 tensors on one device, with a memo of shared intermediates."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import torch
from torch import Tensor

from foxhunt.features import ops


class Panel:
    """OHLCV of S symbols, one row each, padded with NaN after a symbol's last bar.

    Padding sits after every real bar and every computation is causal, so it never reaches a real bar's
    value. Intermediates shared by several features (log close, true range, ATR...) are computed once per
    panel through :meth:`memo` and dropped by :meth:`forget` after their last use.
    """

    def __init__(self, ohlcv: Tensor, timestamps: Tensor, starts: Tensor, lengths: list[int], op=ops) -> None:
        self.ohlcv = ohlcv  # [5, S, T] float64
        self.op = op  # the stateful primitives: the ops module (batch), or a stepping.StepOps (a stream's chunk)
        self.timestamps = timestamps  # [S, T] int64 ns UTC
        self.starts = starts  # [S] first flat row of each symbol
        self.lengths = [int(m) for m in lengths]  # [S] bars of each symbol (host ints: they size the output)
        self._memo: dict[Hashable, object] = {}
        self.trace: set | None = None  # when a set, records every memo key touched (for release plans)
        # views of the columns, taken once (a stream's bar reads them ~100 times)
        self.open, self.high, self.low, self.close, self.volume = ohlcv.unbind(0)

    @classmethod
    def from_flat(cls, ohlcv: Tensor, timestamps: Tensor, symbol_index: Tensor) -> Panel:
        """Build from rows sorted by (symbol, time): ohlcv [N, 5], timestamps [N], symbol_index [N]."""
        return cls.from_columns(ohlcv.to(torch.float64).T.contiguous(), timestamps, symbol_index)

    @classmethod
    def from_columns(cls, cols: Tensor, timestamps: Tensor, symbol_index: Tensor, single: bool | None = None) -> Panel:
        """Build from the columns [5, N] (float64) of rows sorted by (symbol, time); one symbol's panel is a view
        (``single``: :func:`one_symbol` of the index when the caller has it; None: computed here).

        Three host synchronisations in all (the order check, the symbol boundaries, their lengths), none per symbol.
        """
        dev = cols.device
        cols = cols.to(torch.float64)
        n = cols.shape[1]
        timestamps = timestamps.to(dev, torch.int64)
        if n == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=dev)
            return cls(cols.reshape(5, 0, 0), timestamps.reshape(0, 0), empty, [])
        sym = symbol_index.to(dev)
        if one_symbol(sym) if single is None else single:
            return cls(cols.reshape(5, 1, n), timestamps.reshape(1, n), torch.zeros(1, dtype=torch.int64, device=dev), [n])
        step = sym[1:] - sym[:-1]
        if bool((step < 0).any()):
            raise ValueError("features: rows must be sorted by symbol then time (symbol_index decreases somewhere)")
        moved = step != 0  # rows are grouped by symbol: a symbol starts where the index moves
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        starts = torch.cat((zero, torch.nonzero(moved).flatten() + 1))
        lengths = torch.diff(starts, append=torch.full((1,), n, dtype=torch.int64, device=dev)).tolist()
        S, T = len(lengths), max(lengths)
        if S == 1:
            return cls(cols.reshape(5, 1, T), timestamps.reshape(1, T), starts, lengths)
        group = torch.cat((zero, torch.cumsum(moved, 0)))  # symbol row of each flat row
        pos = torch.arange(n, device=dev) - starts[group]
        arr = torch.full((5, S, T), float("nan"), dtype=torch.float64, device=dev)
        arr[:, group, pos] = cols
        ts = torch.zeros((S, T), dtype=torch.int64, device=dev)
        ts[group, pos] = timestamps
        return cls(arr, ts, starts, lengths)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ohlcv.shape[1:])

    @property
    def device(self) -> torch.device:
        return self.ohlcv.device

    def memo(self, key: Hashable, fn: Callable[[], object]):
        """Compute ``fn()`` once per panel under ``key``."""
        if self.trace is not None:
            self.trace.add(key)
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop memoised intermediates no later feature needs, to bound peak memory."""
        for k in keys:
            self._memo.pop(k, None)

    def prefix(self, key: Hashable, fn: Callable[[], Tensor], start: int = 0, squares: bool = False) -> ops.Prefix:
        """Shared prefix sums of the series ``fn()`` (named ``key``): every window length is then one subtraction."""
        return self.memo(("prefix", key, start, squares), lambda: self.op.Prefix(fn(), start, squares))

    def close_prefix(self) -> ops.BlockPrefix:
        """Block-centred prefix sums of the close and its square, shared by the SMAs and Bollinger bands."""
        return self.memo("close_block_prefix", lambda: self.op.BlockPrefix(self.close, 200, squares=True))

    # shared intermediates used across families
    def log_close(self) -> Tensor:
        return self.memo("log_close", lambda: torch.log(self.close))

    def log_return(self, k: int = 1, out: Tensor | None = None) -> Tensor:
        """ln C[t] - ln C[t-k], into ``out`` when given; only the 1-bar return is shared (memoised)."""
        if k == 1:
            r = self.memo(("log_return", 1), lambda: self.op.diff(self.log_close(), 1))
            return r if out is None else out.copy_(r)
        return self.op.diff(self.log_close(), k, out)

    def close_change(self) -> Tensor:
        """C[t] - C[t-1]."""
        return self.memo("close_change", lambda: self.op.diff(self.close, 1))

    def prev_close(self) -> Tensor:
        return self.memo("prev_close", lambda: self.op.shift(self.close, 1))

    def true_range(self) -> Tensor:
        """TA-Lib TRANGE: max(H, C[t-1]) - min(L, C[t-1]); undefined at the first bar."""

        def f() -> Tensor:
            prev = self.prev_close()
            return torch.maximum(self.high, prev).sub_(torch.minimum(self.low, prev))

        return self.memo("true_range", f)

    def atr(self, n: int = 14) -> Tensor:
        """TA-Lib ATR: Wilder smoothing of the true range, seeded with its mean over bars 1..n."""
        return self.memo(("atr", n), lambda: self.op.wilder(self.true_range(), n, start=1))

    def inv_atr(self) -> Tensor:
        """1 / ATR(14), 0 where ATR(14) is 0 (a flat stretch: 0 where a denominator is 0, as elsewhere, not inf,
        whose product with a 0 distance is NaN): features in ATR units multiply by it (cheaper than a divide)."""

        def f():
            r = torch.reciprocal(self.atr(14))
            return r.nan_to_num_(nan=ops.NAN, posinf=0.0)  # ATR >= 0: only 1 / 0 is infinite; warm-up stays NaN

        return self.memo("inv_atr_14", f)

    def per_atr(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x / ATR(14): price units to ATR units, into ``out`` when given."""
        return ops.multiply(x, self.inv_atr(), out)

    def typical_price(self) -> Tensor:
        def f():
            return (self.high + self.low).add_(self.close).div_(3.0)

        return self.memo("typical_price", f)

    def hl_range(self) -> Tensor:
        return self.memo("hl_range", lambda: self.high - self.low)

    def volume_mean(self, n: int) -> Tensor:
        """SMA(n) of the volume."""
        return self.prefix("volume", lambda: self.volume).sum(n).div_(n)


def one_symbol(symbol_index: Tensor) -> bool:
    """Whether every row is of one symbol, on the CPU (one comparison pass instead of the index steps' three or four:
    ~2 ms at a million bars); False on other devices, where it would cost a host synchronisation."""
    if symbol_index.device.type != "cpu" or symbol_index.numel() == 0:
        return False
    return bool((symbol_index == symbol_index[0]).all())
