"""Volume: z-scores and relative volume, OBV, MFI, rolling VWAP distance, Amihud illiquidity, ADOSC and CMF.

Window sums are differences of prefix sums shared by every window length (``Panel.prefix``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from foxhunt.features import ops as O
from foxhunt.features.registry import FeatureList

if TYPE_CHECKING:
    from foxhunt.features.panel import Panel

_NAN = float("nan")


def volume_prefix(p: Panel, start: int = 0) -> O.Prefix:
    """Prefix sums of the volume from ``start``."""
    return p.prefix("volume", lambda: p.volume, start)


def _log_volume(p: Panel) -> Tensor:
    return p.memo("log1p_volume", lambda: torch.log1p(p.volume))


def volume_z(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """z-score of ln(1 + V) against its trailing n-bar mean and population std (0 when the std is 0)."""
    x = _log_volume(p)
    x0 = p.op.first(x)  # a past value for every bar: centring keeps the prefix sums of squares small
    mean, var = p.prefix("log1p_volume_centred", lambda: x - x0, 0, True).mean_var(n)
    dev = (x - x0).sub_(mean)
    return O.safe_div(dev, var.sqrt_(), out=out)


def rel_volume(p: Panel, n: int) -> Tensor:
    """ln(1 + V) - ln(1 + SMA(n) of V)."""
    m = p.volume_mean(n).log1p_()
    return torch.sub(_log_volume(p), m, out=m)


def _signed_volume(p: Panel) -> Tensor:
    def f() -> Tensor:
        sv = p.op.diff(p.close, 1).sign_()
        sv *= p.volume
        return p.op.fill_before(sv, 1, p.volume)  # TA-Lib's OBV starts at the first bar's volume

    return p.memo("signed_volume", f)


def obv(p: Panel) -> Tensor:
    """TA-Lib OBV: running sum of volume signed by the close's direction, starting at V[0]."""
    return p.op.cumsum(_signed_volume(p))


def obv_change(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """(OBV[t] - OBV[t-n]) / sum of V over the last n bars: the net signed share of recent volume, in [-1, 1]
    (into ``out`` when given)."""
    signed = p.prefix("signed_volume", lambda: _signed_volume(p), 1).sum(n)
    return O.safe_div(signed, volume_prefix(p, 1).sum(n), out=out)  # signed volume / volume, per window


def _money_flows(p: Panel) -> tuple[Tensor, Tensor]:
    """Money flow TP V on bars whose typical price rose, and on bars where it fell."""

    def f() -> tuple[Tensor, Tensor]:
        tp = p.typical_price()
        d = p.op.diff(tp, 1)
        mf = tp * p.volume
        return mf * (d > 0), mf.mul_(d < 0)

    return p.memo("money_flows", f)


def mfi(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """TA-Lib MFI: 100 * positive money flow / total money flow over n bars (0 when the total is below 1), into
    ``out`` when given."""
    up, down = _money_flows(p)
    pos = p.prefix("money_flow_up", lambda: up, 1).sum(n)
    tot = p.prefix("money_flow_down", lambda: down, 1).sum(n).add_(pos)
    return O.safe_div(pos, tot, scale=100.0, out=out).masked_fill_(tot < 1.0, 0.0)


def vwap_distance(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """(C - VWAP over n bars) / ATR(14), VWAP = sum(TP V) / sum(V) (TP itself where the volume is 0)."""
    tp = p.typical_price()
    pv = p.prefix("tp_volume", lambda: tp * p.volume).sum(n)
    vol = volume_prefix(p).sum(n)
    zero = vol == 0
    vwap = pv.div_(vol).masked_fill_(zero, 0.0).addcmul_(tp, zero)
    return torch.mul(vwap.neg_().add_(p.close), p.inv_atr(), out=out)


def amihud(p: Panel, n: int) -> Tensor:
    """ln of Amihud's illiquidity: mean over n bars of |log return| / (C V), V floored at 1."""
    illiq = p.memo("illiq", lambda: p.log_return(1).abs() / (p.close * p.volume.clamp(min=1.0)))
    m = p.prefix("illiq", lambda: illiq, 1).sum(n)
    m /= n
    m += 1e-30
    return m.log_()


def _clv(p: Panel) -> Tensor:
    """Close location value ((C - L) - (H - C)) / (H - L), 0 on a flat bar."""

    def f() -> Tensor:
        return O.safe_div((p.close - p.low).sub_(p.high - p.close), p.hl_range())

    return p.memo("clv", f)


def _clv_volume(p: Panel) -> Tensor:
    """CLV * V: the money flow whose running sum is the AD line, shared by AD, ADOSC and CMF."""
    return p.memo("clv_volume", lambda: _clv(p) * p.volume)


def ad(p: Panel) -> Tensor:
    """TA-Lib AD: Chaikin accumulation/distribution line, the running sum of CLV * V."""
    return p.op.cumsum(_clv_volume(p))


def adosc(p: Panel, fast: int = 3, slow: int = 10) -> Tensor:
    """TA-Lib ADOSC: EMA(fast) - EMA(slow) of the AD line, both seeded with AD[0].

    An EMA's distance below the line it smooths, d = AD - EMA(AD), follows d[t] = a (d[t-1] + CLV V[t]) from
    d[0] = 0 (a = 1 - alpha), so ADOSC = d_slow - d_fast comes from the money flow itself: no running sum of AD (a
    level that grows with the series, which the EMAs' rounding would scale with) and one pass fewer.
    """
    flow = _clv_volume(p)
    a_fast, a_slow = 1.0 - 2.0 / (fast + 1), 1.0 - 2.0 / (slow + 1)
    d_fast = p.op.seeded_scan(flow, 0, 0.0, a_fast, a_fast)
    return p.op.blank(p.op.seeded_scan(flow, 0, 0.0, a_slow, a_slow).sub_(d_fast), slow - 1)


def adosc_per_volume(p: Panel, fast: int, slow: int, out: Tensor | None = None) -> Tensor:
    """ADOSC / SMA(slow) of V (0 where that mean is 0), into ``out`` when given (one rounding, no copy)."""
    return O.safe_div(adosc(p, fast, slow), volume_prefix(p).sum(slow).div_(slow), out=out)


def cmf(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """Chaikin money flow: sum(CLV V) / sum(V) over n bars."""
    flow = p.prefix("clv_volume", lambda: _clv_volume(p)).sum(n)
    return O.safe_div(flow, p.volume_mean(n).mul_(n), out=out)


def features() -> FeatureList:
    fl = FeatureList("volume")
    for n in (20, 50, 100):
        fl.add(f"volume_z_{n}", f"z-score of ln(1+V) over {n} bars", n - 1, lambda p, out=None, n=n: volume_z(p, n, out))
    for n in (5, 20):
        fl.add(f"rel_volume_{n}", f"ln(1+V) - ln(1 + SMA({n}) of V)", n - 1, lambda p, n=n: rel_volume(p, n))
    for n in (10, 20, 50):
        fl.add(f"obv_change_{n}", f"(TA-Lib OBV[t] - OBV[t-{n}]) / sum of V over {n} bars", n, lambda p, out=None, n=n: obv_change(p, n, out), talib="OBV")
    for n in (14, 28):
        fl.add(f"mfi_{n}", f"TA-Lib MFI({n}), 0..100", n, lambda p, out=None, n=n: mfi(p, n, out), talib="MFI")
    for n in (20, 50, 100):
        fl.add(f"vwap_dist_{n}", f"(C - rolling VWAP({n})) / ATR(14)", max(n - 1, 14), lambda p, out=None, n=n: vwap_distance(p, n, out))
    for n in (20, 50):
        fl.add(f"amihud_{n}", f"ln mean(|r| / (C V)) over {n} bars", n, lambda p, n=n: amihud(p, n))
    fl.add("adosc_3_10", "TA-Lib ADOSC(3,10) / SMA(10) of V", 9, lambda p, out=None: adosc_per_volume(p, 3, 10, out), talib="ADOSC")
    fl.add("cmf_20", "Chaikin money flow: sum(CLV V) / sum(V) over 20 bars", 19, lambda p, out=None: cmf(p, 20, out))
    return fl
