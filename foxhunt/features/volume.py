"""Volume: volume z-score, relative volume, OBV change, MFI, distance from a rolling VWAP, Amihud illiquidity, ADOSC, CMF."""

from __future__ import annotations

import numpy as np

from foxhunt.features import filters as F
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList


def _log_volume(p: Panel) -> np.ndarray:
    return p.memo("log1p_volume", lambda: np.log1p(p.volume))


def volume_z(p: Panel, n: int) -> np.ndarray:
    """z-score of ln(1 + V) against its trailing n-bar mean and population std (0 when the std is 0)."""
    x = _log_volume(p)
    x0 = x[:, :1]  # a past value for every bar: centring keeps the prefix sums of squares small
    mean, var = p.prefix("log1p_volume_centred", lambda: x - x0, 0, True).mean_var(n)
    return F.safe_div(x - x0 - mean, np.sqrt(var))


def _signed_volume(p: Panel) -> np.ndarray:
    def f():
        d = F.diff(p.close, 1)
        sv = np.sign(d) * p.volume
        sv[:, 0] = p.volume[:, 0]  # TA-Lib's OBV starts at the first bar's volume
        return sv

    return p.memo("signed_volume", f)


def obv(p: Panel) -> np.ndarray:
    """TA-Lib OBV: running sum of volume signed by the close's direction, starting at V[0]."""
    return np.cumsum(_signed_volume(p), axis=1)


def obv_change(p: Panel, n: int) -> np.ndarray:
    """(OBV[t] - OBV[t-n]) / sum of V over the last n bars: the net signed share of recent volume, in [-1, 1]."""
    num = p.prefix("signed_volume", lambda: _signed_volume(p), 1).sum(n)
    return F.safe_div(num, p.prefix("volume", lambda: p.volume, 1).sum(n))


def mfi(p: Panel, n: int) -> np.ndarray:
    """TA-Lib MFI: 100 * positive money flow / total money flow over n bars (0 when the total is below 1)."""
    def flows():
        tp = p.typical_price()
        d = F.diff(tp, 1)
        mf = tp * p.volume
        return mf * (d > 0), mf * (d < 0)

    up, down = p.memo("money_flows", flows)
    pos = p.prefix("money_flow_up", lambda: up, 1).sum(n)
    tot = pos + p.prefix("money_flow_down", lambda: down, 1).sum(n)
    out = 100.0 * F.safe_div(pos, tot)
    out[tot < 1.0] = 0.0
    return out


def vwap_distance(p: Panel, n: int) -> np.ndarray:
    """(C - VWAP over n bars) / ATR(14), VWAP = sum(TP V) / sum(V) (TP itself where the volume is 0)."""
    tp = p.typical_price()
    pv = p.prefix("tp_volume", lambda: tp * p.volume).sum(n)
    vol = p.prefix("volume", lambda: p.volume).sum(n)
    vwap = F.safe_div(pv, vol)
    flat = vol == 0
    vwap[flat] = tp[flat]
    return (p.close - vwap) / p.atr(14)


def amihud(p: Panel, n: int) -> np.ndarray:
    """ln of Amihud's illiquidity: mean over n bars of |log return| / (C V), V floored at 1."""
    illiq = p.memo("illiq", lambda: np.abs(p.log_return(1)) / (p.close * np.maximum(p.volume, 1.0)))
    return np.log(1e-30 + p.prefix("illiq", lambda: illiq, 1).sum(n) / n)


def _clv(p: Panel) -> np.ndarray:
    """Close location value ((C - L) - (H - C)) / (H - L), 0 on a flat bar."""
    return p.memo("clv", lambda: F.safe_div((p.close - p.low) - (p.high - p.close), p.hl_range()))


def ad(p: Panel) -> np.ndarray:
    """TA-Lib AD: Chaikin accumulation/distribution line, the running sum of CLV * V."""
    return np.cumsum(_clv(p) * p.volume, axis=1)


def adosc(p: Panel, fast: int = 3, slow: int = 10) -> np.ndarray:
    """TA-Lib ADOSC: EMA(fast) - EMA(slow) of the AD line, both seeded with AD[0]."""
    line = ad(p)
    out = F.ema(line, fast, seed="first") - F.ema(line, slow, seed="first")
    out[:, : slow - 1] = np.nan
    return out


def features() -> FeatureList:
    fl = FeatureList("volume")
    for n in (20, 50, 100):
        fl.add(f"volume_z_{n}", f"z-score of ln(1+V) over {n} bars", n - 1, lambda p, n=n: volume_z(p, n))
    for n in (5, 20):
        fl.add(f"rel_volume_{n}", f"ln(1+V) - ln(1 + SMA({n}) of V)", n - 1, lambda p, n=n: _log_volume(p) - np.log1p(p.volume_mean(n)))
    for n in (10, 20, 50):
        fl.add(f"obv_change_{n}", f"(TA-Lib OBV[t] - OBV[t-{n}]) / sum of V over {n} bars", n, lambda p, n=n: obv_change(p, n), talib="OBV")
    for n in (14, 28):
        fl.add(f"mfi_{n}", f"TA-Lib MFI({n}), 0..100", n, lambda p, n=n: mfi(p, n), talib="MFI")
    for n in (20, 50, 100):
        fl.add(f"vwap_dist_{n}", f"(C - rolling VWAP({n})) / ATR(14)", max(n - 1, 14), lambda p, n=n: vwap_distance(p, n))
    for n in (20, 50):
        fl.add(f"amihud_{n}", f"ln mean(|r| / (C V)) over {n} bars", n, lambda p, n=n: amihud(p, n))
    fl.add("adosc_3_10", "TA-Lib ADOSC(3,10) / SMA(10) of V", 9, lambda p: F.safe_div(adosc(p, 3, 10), p.volume_mean(10)), talib="ADOSC")
    fl.add("cmf_20", "Chaikin money flow: sum(CLV V) / sum(V) over 20 bars", 19,
           lambda p: F.safe_div(F.rolling_sum(_clv(p) * p.volume, 20), 20 * p.volume_mean(20)))
    return fl
