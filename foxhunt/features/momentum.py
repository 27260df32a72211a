"""Returns and momentum: log returns, ROC, MOM, RSI, CMO, stochastics, Williams %R, MACD, CCI, ADX/DI, Aroon, ULTOSC, TRIX.

Indicator functions return TA-Lib's values (same definition, seeding and look-back); features that are
in price units are divided by ATR(14) so they are scale-free.
"""

from __future__ import annotations

import numpy as np

from foxhunt.features import filters as F
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList


def roc(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib ROC: 100 * (C[t] / C[t-n] - 1)."""
    return F.pct_change(p.close, n, out)


def mom(p: Panel, n: int) -> np.ndarray:
    """TA-Lib MOM: C[t] - C[t-n]."""
    return F.diff(p.close, n)


def _gains(p: Panel) -> tuple[np.ndarray, np.ndarray]:
    """Close-to-close gains and losses (both >= 0), shared by every RSI window."""

    def f():
        down = p.empty()
        return F.blockwise(_gain_loss_block, p.empty(), p.close_change(), down), down

    return p.memo("gains_losses", f)


def _gain_loss_block(d: np.ndarray, down: np.ndarray, out: np.ndarray) -> None:
    """max(d, 0) into out and max(-d, 0) into ``down``."""
    np.maximum(d, 0.0, out=out)
    np.negative(d, out=down)
    np.maximum(down, 0.0, out=down)


def _gain_loss_averages(p: Panel, n: int) -> tuple[np.ndarray, np.ndarray]:
    def f():
        up, down = _gains(p)
        return F.wilder(up, n, start=1, out=p.empty()), F.wilder(down, n, start=1, out=p.empty())

    return p.memo(("gain_loss", n), f)


def _rsi_block(g: np.ndarray, l: np.ndarray, out: np.ndarray) -> None:
    F.safe_div(g, g + l, out=out, scale=100.0)


def _cmo_block(g: np.ndarray, l: np.ndarray, out: np.ndarray) -> None:
    F.safe_div(g - l, g + l, out=out, scale=100.0)


def rsi(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib RSI: 100 * avg gain / (avg gain + avg loss), Wilder-smoothed, seeded with the mean of n changes."""
    g, l = _gain_loss_averages(p, n)
    return F.blockwise(_rsi_block, np.empty(g.shape) if out is None else out, g, l)


def cmo(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib CMO: 100 * (avg gain - avg loss) / (avg gain + avg loss), Wilder-smoothed as TA-Lib does."""
    g, l = _gain_loss_averages(p, n)
    return F.blockwise(_cmo_block, np.empty(g.shape) if out is None else out, g, l)


def hh_ll(p: Panel, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Highest high and lowest low over the last n bars."""
    return p.memo(("hh_ll", n), lambda: (F.rolling_max(p.high, n, p.empty()), F.rolling_min(p.low, n, p.empty())))


def stoch(p: Panel, fastk: int, slowk: int = 3, slowd: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """TA-Lib STOCH with SMA smoothing: slow %K = SMA(fast %K), %D = SMA(slow %K)."""

    def f():
        hh, ll = hh_ll(p, fastk)
        fk = F.blockwise(_stoch_block, p.empty(), p.close, hh, ll)
        k = F.rolling_mean(fk, slowk, start=fastk - 1)
        d = F.rolling_mean(k, slowd, start=fastk + slowk - 2)
        k[:, : fastk + slowk + slowd - 3] = np.nan  # TA-Lib reports %K from %D's first bar
        return k, d

    return p.memo(("stoch", fastk, slowk, slowd), f)


def _stoch_block(c: np.ndarray, hh: np.ndarray, ll: np.ndarray, out: np.ndarray) -> None:
    F.safe_div(c - ll, hh - ll, out=out, scale=100.0)


def _willr_block(c: np.ndarray, hh: np.ndarray, ll: np.ndarray, out: np.ndarray) -> None:
    F.safe_div(hh - c, hh - ll, out=out, scale=-100.0)


def willr(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib WILLR: -100 * (HH - C) / (HH - LL)."""
    hh, ll = hh_ll(p, n)
    return F.blockwise(_willr_block, np.empty(hh.shape) if out is None else out, p.close, hh, ll)


def _macd_line_signal(p: Panel, fast: int, slow: int, signal: int) -> tuple[np.ndarray, np.ndarray]:
    def f():
        line = F.ema(p.close, fast, start=slow - fast, out=p.empty())
        line -= F.ema(p.close, slow)
        sig = F.ema(line, signal, start=slow - 1, out=p.empty())
        line[:, : slow + signal - 2] = np.nan  # TA-Lib reports all three from the signal's first bar
        return line, sig

    return p.memo(("macd", fast, slow, signal), f)


def macd(p: Panel, fast: int, slow: int, signal: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TA-Lib MACD: the fast EMA is seeded at the slow EMA's first bar (TA-Lib's alignment), signal = EMA of the line."""
    line, sig = _macd_line_signal(p, fast, slow, signal)
    return line, sig, line - sig


def _mean_abs_deviation(tp: np.ndarray, sma: np.ndarray, n: int, chunk: int = 32768) -> np.ndarray:
    """Mean over the last n bars of |TP - SMA(TP)[t]|, in chunks of bars that stay in cache through the n passes."""
    S, T = tp.shape
    md = F.nan_empty((S, T), min(T, n - 1))
    buf = np.empty((S, chunk))
    for c0 in range(n - 1, T, chunk):
        c1 = min(T, c0 + chunk)
        m, a, b = sma[:, c0:c1], md[:, c0:c1], buf[:, : c1 - c0]
        np.subtract(tp[:, c0:c1], m, out=a)
        np.abs(a, out=a)
        for k in range(1, n):
            np.subtract(tp[:, c0 - k : c1 - k], m, out=b)
            np.abs(b, out=b)
            a += b
    md *= 0.015 / n
    return md


def cci(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib CCI: (TP - SMA(TP)) / (0.015 * mean |TP - SMA(TP)|) over n bars."""
    tp = p.typical_price()
    sma = p.memo("tp_block_prefix", lambda: F.BlockPrefix(tp, 20)).mean(n)
    md = _mean_abs_deviation(tp, sma, n)
    np.subtract(tp, sma, out=sma)
    return F.safe_div(sma, md, out=out)


def directional(p: Panel, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TA-Lib PLUS_DI, MINUS_DI and ADX: Wilder sums of +DM, -DM and TR, DX smoothed by Wilder into ADX."""

    def moves():
        dp = F.diff(p.high, 1, p.empty())
        dm = F.diff(p.low, 1, p.empty())
        F.blockwise(_moves_block, dm, dp, dm)  # in place, block by block: +DM over dp, -DM over dm
        return dp, dm

    def f():
        plus, minus = p.memo("directional_moves", moves)
        tr_s = F.wilder_sum(p.true_range(), n, start=1)
        pdi = F.wilder_sum(plus, n, start=1, out=p.empty())
        mdi = F.wilder_sum(minus, n, start=1, out=p.empty())
        dx = F.blockwise(_di_dx_block, tr_s, pdi, mdi, tr_s)  # pdi, mdi in place; DX over tr_s
        pdi[:, :n] = np.nan  # DX before bar n is not used: ADX starts from DX[n]
        mdi[:, :n] = np.nan
        adx = F.wilder(dx, n, start=n, out=p.empty())
        return pdi, mdi, adx

    return p.memo(("directional", n), f)


def _moves_block(dp: np.ndarray, dl: np.ndarray, out: np.ndarray) -> None:
    """+DM and -DM from the high's change dp and the low's change dl (dp in place, -DM into out, which is dl)."""
    dm = np.negative(dl, out=out)  # the low's fall
    # masks by multiplication: np.where is slow on random masks
    plus, minus = (dp > 0) & (dp > dm), (dm > 0) & (dp < dm)
    dp *= plus
    np.multiply(dm, minus, out=out)


def _di_dx_block(pdi: np.ndarray, mdi: np.ndarray, tr: np.ndarray, out: np.ndarray) -> None:
    """+DI and -DI (in place over the Wilder sums of +DM and -DM) and DX (into out, which is tr's block)."""
    F.safe_div(pdi, tr, out=pdi, scale=100.0)
    F.safe_div(mdi, tr, out=mdi, scale=100.0)
    dx = np.subtract(mdi, pdi)
    np.abs(dx, out=dx)
    F.safe_div(dx, mdi + pdi, out=out, scale=100.0)


def aroon(p: Panel, n: int) -> tuple[np.ndarray, np.ndarray]:
    """TA-Lib AROON: 100 * (n - bars since the highest high / lowest low of the last n+1 bars) / n."""

    def f():
        up = F.bars_since_extreme(p.high, n, highest=True, out=p.empty())
        down = F.bars_since_extreme(p.low, n, highest=False, out=p.empty())
        for x in (up, down):  # 100 (n - x) / n
            np.subtract(n, x, out=x)
            x *= 100.0
            x /= n
        return up, down

    return p.memo(("aroon", n), f)


def ultosc(p: Panel, n1: int = 7, n2: int = 14, n3: int = 28, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib ULTOSC: 100 * (4 A1 + 2 A2 + A3) / 7, A_k = sum(buying pressure) / sum(true range) over n_k."""
    bp = np.minimum(p.low, p.prev_close(), out=p.empty())
    np.subtract(p.close, bp, out=bp)  # buying pressure C - min(L, C[t-1])
    bps, trs = F.Prefix(bp, 1), F.Prefix(p.true_range(), 1)
    del bp
    a = max(n1, n2, n3)
    out = F.nan_empty(p.shape, min(a, p.shape[1]), out)
    if a < p.shape[1]:
        views = [v for n in (n1, n2, n3) for v in (*bps.parts(n, a), *trs.parts(n, a))]
        F.blockwise(_ultosc_block, out[:, a:], *views)
    return out


def _ultosc_block(*args: np.ndarray, out: np.ndarray) -> None:
    """100/7 (4 A1 + 2 A2 + A3) from (bp hi, bp lo, tr hi, tr lo) window views of the three windows."""
    acc = None
    for w, (bh, bl, th, tl) in zip((4.0, 2.0, 1.0), (args[0:4], args[4:8], args[8:12])):
        t = th - tl
        a = F.safe_div(bh - bl, t, out=t, scale=w)
        acc = a if acc is None else np.add(acc, a, out=acc)
    np.multiply(acc, 100.0 / 7.0, out=out)


def trix(p: Panel, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """TA-Lib TRIX: 1-bar percent change of a triple EMA (each EMA seeded with the SMA of its input)."""
    e1 = F.ema(p.close, n, out=p.empty())
    e2 = F.ema(e1, n, start=n - 1)
    e3 = F.ema(e2, n, start=2 * n - 2, out=e1)
    return F.pct_change(e3, 1, out)


def features() -> FeatureList:
    fl = FeatureList("momentum")
    for h in (1, 2, 3, 5, 10, 20, 50, 100):
        fl.add(f"logret_{h}", f"ln C[t] - ln C[t-{h}]", h, lambda p, out=None, h=h: p.log_return(h, out), talib="ROCR")
    for n in (5, 10, 20):
        fl.add(f"roc_{n}", f"TA-Lib ROC({n}): 100 (C[t]/C[t-{n}] - 1)", n, lambda p, out=None, n=n: roc(p, n, out), talib="ROC")
    for n in (5, 10, 20):
        fl.add(f"mom_{n}", f"TA-Lib MOM({n}) / ATR(14)", max(n, 14), lambda p, out=None, n=n: F.lag_diff_times(p.close, n, p.inv_atr(), out), talib="MOM")
    for n in (6, 14, 21, 28):
        fl.add(f"rsi_{n}", f"TA-Lib RSI({n}), Wilder smoothing, 0..100", n, lambda p, out=None, n=n: rsi(p, n, out), talib="RSI")
    fl.add("cmo_14", "TA-Lib CMO(14), -100..100", 14, lambda p, out=None: cmo(p, 14, out), talib="CMO")
    for n in (5, 14):
        w = n + 1
        fl.add(f"stoch_k_{n}", f"TA-Lib STOCH({n},3,SMA,3,SMA) slow %K", w + 2, lambda p, out=None, n=n: F.put(stoch(p, n)[0], out), talib="STOCH")
        fl.add(f"stoch_d_{n}", f"TA-Lib STOCH({n},3,SMA,3,SMA) slow %D", w + 2, lambda p, out=None, n=n: F.put(stoch(p, n)[1], out), talib="STOCH")
    for n in (14, 28):
        fl.add(f"willr_{n}", f"TA-Lib WILLR({n}): -100 (HH - C) / (HH - LL)", n - 1, lambda p, out=None, n=n: willr(p, n, out), talib="WILLR")
    for f_, s_, g_ in ((12, 26, 9), (5, 35, 5)):
        tag, w = f"{f_}_{s_}_{g_}", s_ + g_ - 2
        fl.add(f"macd_{tag}", f"TA-Lib MACD({f_},{s_},{g_}) line / ATR(14)", w,
               lambda p, out=None, a=(f_, s_, g_): p.per_atr(_macd_line_signal(p, *a)[0], out), talib="MACD")
        fl.add(f"macd_signal_{tag}", f"TA-Lib MACD({f_},{s_},{g_}) signal / ATR(14)", w,
               lambda p, out=None, a=(f_, s_, g_): p.per_atr(_macd_line_signal(p, *a)[1], out), talib="MACD")
        fl.add(f"macd_hist_{tag}", f"TA-Lib MACD({f_},{s_},{g_}) histogram / ATR(14)", w,
               lambda p, out=None, a=(f_, s_, g_): F.diff_times(*_macd_line_signal(p, *a), p.inv_atr(), out), talib="MACD")
    for n in (14, 20):
        fl.add(f"cci_{n}", f"TA-Lib CCI({n}): (TP - SMA(TP)) / (0.015 mean abs deviation)", n - 1, lambda p, out=None, n=n: cci(p, n, out), talib="CCI")
    for n in (14, 28):
        fl.add(f"adx_{n}", f"TA-Lib ADX({n}): Wilder-smoothed DX", 2 * n - 1, lambda p, out=None, n=n: F.put(directional(p, n)[2], out), talib="ADX")
        fl.add(f"plus_di_{n}", f"TA-Lib PLUS_DI({n})", n, lambda p, out=None, n=n: F.put(directional(p, n)[0], out), talib="PLUS_DI")
        fl.add(f"minus_di_{n}", f"TA-Lib MINUS_DI({n})", n, lambda p, out=None, n=n: F.put(directional(p, n)[1], out), talib="MINUS_DI")
    for n in (25,):
        fl.add(f"aroon_up_{n}", f"TA-Lib AROON({n}) up", n, lambda p, out=None, n=n: F.put(aroon(p, n)[0], out), talib="AROON")
        fl.add(f"aroon_down_{n}", f"TA-Lib AROON({n}) down", n, lambda p, out=None, n=n: F.put(aroon(p, n)[1], out), talib="AROON")
    fl.add("aroon_osc_25", "TA-Lib AROONOSC(25): Aroon up - Aroon down", 25, lambda p, out=None: np.subtract(*aroon(p, 25), out=out), talib="AROONOSC")
    fl.add("ultosc_7_14_28", "TA-Lib ULTOSC(7,14,28)", 28, lambda p, out=None: ultosc(p, 7, 14, 28, out), talib="ULTOSC")
    fl.add("trix_15", "TA-Lib TRIX(15): 1-bar % change of a triple EMA", 43, lambda p, out=None: trix(p, 15, out), talib="TRIX")
    return fl
