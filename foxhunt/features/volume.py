"""Volume: volume z-score, relative volume, OBV change, MFI, distance from a rolling VWAP, Amihud illiquidity, ADOSC, CMF."""

from __future__ import annotations

import functools

import numpy as np

from foxhunt.features import filters as F
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList


def _log_volume(p: Panel) -> np.ndarray:
    return p.memo("log1p_volume", lambda: np.log1p(p.volume))


def volume_z(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """z-score of ln(1 + V) against its trailing n-bar mean and population std (0 when the std is 0)."""
    x = _log_volume(p)
    x0 = x[:, :1]  # a past value for every bar: centring keeps the prefix sums of squares small
    mean, var = p.prefix("log1p_volume_centred", lambda: x - x0, 0, True).mean_var(n)
    dev = np.subtract(x, x0)
    dev -= mean
    return F.safe_div(dev, np.sqrt(var, out=var), out=out)


def rel_volume(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """ln(1 + V) - ln(1 + SMA(n) of V)."""
    m = np.log1p(p.volume_mean(n))
    return np.subtract(_log_volume(p), m, out=out)


def _signed_volume(p: Panel) -> np.ndarray:
    def f():
        d = F.diff(p.close, 1)
        sv = np.sign(d, out=d)
        sv *= p.volume
        sv[:, 0] = p.volume[:, 0]  # TA-Lib's OBV starts at the first bar's volume
        return sv

    return p.memo("signed_volume", f)


def obv(p: Panel) -> np.ndarray:
    """TA-Lib OBV: running sum of volume signed by the close's direction, starting at V[0]."""
    return F.cumsum(_signed_volume(p))


def obv_change(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """(OBV[t] - OBV[t-n]) / sum of V over the last n bars: the net signed share of recent volume, in [-1, 1]."""
    out = F.nan_empty(p.shape, min(n, p.shape[1]), out)
    if n < p.shape[1]:
        signed = p.prefix("signed_volume", lambda: _signed_volume(p), 1).parts(n, n)
        vol = p.prefix("volume", lambda: p.volume, 1).parts(n, n)
        F.blockwise(_obv_block, out[:, n:], *signed, *vol)
    return out


def _obv_block(s_hi: np.ndarray, s_lo: np.ndarray, v_hi: np.ndarray, v_lo: np.ndarray, out: np.ndarray) -> None:
    F.safe_div(s_hi - s_lo, v_hi - v_lo, out=out)


def mfi(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib MFI: 100 * positive money flow / total money flow over n bars (0 when the total is below 1)."""
    def flows():
        tp = p.typical_price()
        d = F.diff(tp, 1)
        mf = tp * p.volume
        return mf * (d > 0), mf * (d < 0)

    up, down = p.memo("money_flows", flows)
    out = F.nan_empty(p.shape, min(n, p.shape[1]), out)
    if n < p.shape[1]:
        pos = p.prefix("money_flow_up", lambda: up, 1).parts(n, n)
        neg = p.prefix("money_flow_down", lambda: down, 1).parts(n, n)
        F.blockwise(_mfi_block, out[:, n:], *pos, *neg)
    return out


def _mfi_block(u_hi: np.ndarray, u_lo: np.ndarray, d_hi: np.ndarray, d_lo: np.ndarray, out: np.ndarray) -> None:
    pos = u_hi - u_lo
    tot = d_hi - d_lo
    tot += pos
    F.safe_div(pos, tot, out=out, scale=100.0)
    np.copyto(out, 0.0, where=tot < 1.0)


def vwap_distance(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """(C - VWAP over n bars) / ATR(14), VWAP = sum(TP V) / sum(V) (TP itself where the volume is 0)."""
    tp = p.typical_price()
    pv = p.prefix("tp_volume", lambda: tp * p.volume).sum(n)
    vol = p.prefix("volume", lambda: p.volume).sum(n)
    vwap = F.safe_div(pv, vol, out=pv)
    flat = vol == 0
    vwap[flat] = tp[flat]
    np.subtract(p.close, vwap, out=vwap)
    return p.per_atr(vwap, out)


def amihud(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """ln of Amihud's illiquidity: mean over n bars of |log return| / (C V), V floored at 1."""
    illiq = p.memo("illiq", lambda: np.abs(p.log_return(1)) / (p.close * np.maximum(p.volume, 1.0)))
    m = p.prefix("illiq", lambda: illiq, 1).sum(n)
    m /= n
    m += 1e-30
    return np.log(m, out=out)


def _clv(p: Panel) -> np.ndarray:
    """Close location value ((C - L) - (H - C)) / (H - L), 0 on a flat bar."""
    return p.memo("clv", lambda: F.blockwise(_clv_block, p.empty(), p.close, p.low, p.high, p.hl_range()))


def _clv_block(c: np.ndarray, lo: np.ndarray, hi: np.ndarray, rng: np.ndarray, out: np.ndarray) -> None:
    num = c - lo
    num -= hi - c
    F.safe_div(num, rng, out=out)


def ad(p: Panel) -> np.ndarray:
    """TA-Lib AD: Chaikin accumulation/distribution line, the running sum of CLV * V."""
    x = _clv(p) * p.volume
    return F.cumsum(x, out=x)


def adosc(p: Panel, fast: int = 3, slow: int = 10) -> np.ndarray:
    """TA-Lib ADOSC: EMA(fast) - EMA(slow) of the AD line, both seeded with AD[0]."""
    line = ad(p)
    out = F.ema(line, fast, seed="first")
    out -= F.ema(line, slow, seed="first")
    out[:, : slow - 1] = np.nan
    return out


def adosc_per_volume(p: Panel, fast: int, slow: int, out: np.ndarray | None = None) -> np.ndarray:
    """ADOSC / SMA(slow) of V (0 where that mean is 0), blockwise from prefix-sum views of the volume."""
    line = adosc(p, fast, slow)
    a = slow - 1
    out = F.nan_empty(p.shape, min(a, p.shape[1]), out)
    if a < p.shape[1]:
        F.blockwise(functools.partial(_per_volume_block, n=slow), out[:, a:], line[:, a:], *p.prefix("volume", lambda: p.volume).parts(slow, a))
    return out


def _per_volume_block(x: np.ndarray, hi: np.ndarray, lo: np.ndarray, out: np.ndarray, n: int) -> None:
    mean = hi - lo
    mean /= n
    F.safe_div(x, mean, out=out)


def cmf(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Chaikin money flow: sum(CLV V) / sum(V) over n bars."""
    flow = p.prefix("clv_volume", lambda: _clv(p) * p.volume).sum(n)
    return F.safe_div(flow, p.volume_mean(n) * n, out=out)


def features() -> FeatureList:
    fl = FeatureList("volume")
    for n in (20, 50, 100):
        fl.add(f"volume_z_{n}", f"z-score of ln(1+V) over {n} bars", n - 1, lambda p, out=None, n=n: volume_z(p, n, out))
    for n in (5, 20):
        fl.add(f"rel_volume_{n}", f"ln(1+V) - ln(1 + SMA({n}) of V)", n - 1, lambda p, out=None, n=n: rel_volume(p, n, out))
    for n in (10, 20, 50):
        fl.add(f"obv_change_{n}", f"(TA-Lib OBV[t] - OBV[t-{n}]) / sum of V over {n} bars", n, lambda p, out=None, n=n: obv_change(p, n, out), talib="OBV")
    for n in (14, 28):
        fl.add(f"mfi_{n}", f"TA-Lib MFI({n}), 0..100", n, lambda p, out=None, n=n: mfi(p, n, out), talib="MFI")
    for n in (20, 50, 100):
        fl.add(f"vwap_dist_{n}", f"(C - rolling VWAP({n})) / ATR(14)", max(n - 1, 14), lambda p, out=None, n=n: vwap_distance(p, n, out))
    for n in (20, 50):
        fl.add(f"amihud_{n}", f"ln mean(|r| / (C V)) over {n} bars", n, lambda p, out=None, n=n: amihud(p, n, out))
    fl.add("adosc_3_10", "TA-Lib ADOSC(3,10) / SMA(10) of V", 9, lambda p, out=None: adosc_per_volume(p, 3, 10, out), talib="ADOSC")
    fl.add("cmf_20", "Chaikin money flow: sum(CLV V) / sum(V) over 20 bars", 19, lambda p, out=None: cmf(p, 20, out))
    return fl
