"""Trend on the device: distance of close from SMA / EMA / KAMA and their slopes in ATR(14) units (twins of
``foxhunt/features/trend.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from foxhunt.features.device import ops
from foxhunt.features.device.panel import TorchPanel

WINDOWS = (5, 10, 20, 50, 100, 200)
_FASTEST, _SLOWEST = 2.0 / 3.0, 2.0 / 31.0


def sma(p: TorchPanel, n: int) -> Tensor:
    """TA-Lib SMA of the close (block-centred prefix sums: error relative to the local spread, not the level)."""
    return p.memo(("sma", n), lambda: p.close_prefix().mean(n))


def ema(p: TorchPanel, n: int) -> Tensor:
    """TA-Lib EMA of the close, seeded with the SMA of the first n closes."""
    return p.memo(("ema", n), lambda: ops.ema(p.close, n))


def _abs_change_prefix(p: TorchPanel) -> ops.Prefix:
    """Prefix sums of |C[t] - C[t-1]| from bar 1, shared by every KAMA window."""
    return p.prefix("abs_close_change", lambda: torch.abs(p.close_change()), 1)


def kama(p: TorchPanel, n: int) -> Tensor:
    """TA-Lib KAMA(n): Kaufman's adaptive average, smoothing (ER (2/3 - 2/31) + 2/31)^2, seeded at C[n-1]."""

    def f():
        c = p.close
        out = ops.nans(c)
        if c.shape[1] <= n:
            return out
        now = c[:, n:]
        hi, lo = _abs_change_prefix(p).parts(n, n)
        # |change| <= noise, with equality exactly when TA-Lib sets ER = 1; a flat window (0 / 0) gives 1 too:
        # fmin takes 1 over NaN
        er = torch.fmin(torch.abs(now - c[:, :-n]) / (hi - lo), torch.ones_like(now))
        sc = torch.square(er * (_FASTEST - _SLOWEST) + _SLOWEST)
        out[:, n:] = ops.linear_recurrence(1.0 - sc, sc * now, c[:, n - 1], a_min=1.0 - _FASTEST**2)
        return out

    return p.memo(("kama", n), f)


def _dist(p: TorchPanel, ma: Tensor) -> Tensor:
    return ops.diff_times(p.close, ma, p.inv_atr())


def _slope(p: TorchPanel, ma: Tensor) -> Tensor:
    return ops.lag_diff_times(ma, 1, p.inv_atr())


def functions() -> dict[str, Callable[[TorchPanel], Tensor]]:
    """Every trend feature of the numpy registry, by name, as a function of a TorchPanel."""
    fs: dict[str, Callable[[TorchPanel], Tensor]] = {}
    averages = (("sma", sma, WINDOWS), ("ema", ema, WINDOWS), ("kama", kama, (10, 30)))
    for kind, of in (("dist", _dist), ("slope", _slope)):
        for name, ma, windows in averages:
            for n in windows:
                fs[f"{kind}_{name}_{n}"] = lambda p, of=of, ma=ma, n=n: of(p, ma(p, n))
    for a, b in ((5, 20), (20, 50), (50, 200)):
        fs[f"ema_cross_{a}_{b}"] = lambda p, a=a, b=b: ops.diff_times(ema(p, a), ema(p, b), p.inv_atr())
    return fs
