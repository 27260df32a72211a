"""Returns and momentum: log returns, ROC, MOM, RSI, stochastics, Williams %R, MACD, CCI, ADX/DI, Aroon, ULTOSC, TRIX.

TA-Lib's CMO(n) is not among them: with Wilder smoothing it is 2 RSI(n) - 100, the same input as RSI once normalised.

Indicator functions return TA-Lib's values (same definition, seeding and look-back); features that are in
price units are divided by ATR(14) so they are scale-free.
"""

from __future__ import annotations

import torch
from torch import Tensor

from foxhunt.features import ops
from foxhunt.features.panel import Panel
from foxhunt.features.registry import FeatureList

MOM_WINDOWS = (5, 10, 20)


def roc(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """TA-Lib ROC: 100 * (C[t] / C[t-n] - 1)."""
    return p.op.pct_change(p.close, n, out)


def mom(p: Panel, n: int) -> Tensor:
    """TA-Lib MOM: C[t] - C[t-n]."""
    return p.op.diff(p.close, n)


def _gains(p: Panel) -> tuple[Tensor, Tensor]:
    """Close-to-close gains (>= 0) and absolute changes (NaN at the first bar), shared by every RSI window."""

    def f():
        d = p.close_change()
        return torch.clamp_min(d, 0.0), torch.abs(d)

    return p.memo("gains_moves", f)


def _gain_loss_averages(p: Panel, n: int) -> tuple[Tensor, Tensor]:
    """Wilder averages of the gains and of the absolute changes: the second is avg gain + avg loss (Wilder smoothing
    is linear), so RSI needs no pass to add them."""

    def f():
        up, moves = _gains(p)
        return p.op.wilder(up, n, start=1), p.op.wilder(moves, n, start=1)

    return p.memo(("gain_move", n), f)


def rsi(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """TA-Lib RSI: 100 * avg gain / (avg gain + avg loss), Wilder-smoothed, seeded with the mean of n changes."""
    g, s = _gain_loss_averages(p, n)
    return ops.safe_div(g, s, scale=100.0, out=out)


def hh_ll(p: Panel, n: int) -> tuple[Tensor, Tensor]:
    """Highest high and lowest low over the last n bars."""
    return p.memo(("hh_ll", n), lambda: (p.op.rolling_max(p.high, n), p.op.rolling_min(p.low, n)))


def stoch(p: Panel, fastk: int, slowk: int = 3, slowd: int = 3) -> tuple[Tensor, Tensor]:
    """TA-Lib STOCH with SMA smoothing: slow %K = SMA(fast %K), %D = SMA(slow %K)."""

    def f():
        hh, ll = hh_ll(p, fastk)
        fk = ops.safe_div(p.close - ll, hh - ll, scale=100.0)
        k = p.op.rolling_mean(fk, slowk, start=fastk - 1)
        d = p.op.rolling_mean(k, slowd, start=fastk + slowk - 2)
        return p.op.blank(k, fastk + slowk + slowd - 3), d  # TA-Lib reports %K from %D's first bar

    return p.memo(("stoch", fastk, slowk, slowd), f)


def willr(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """TA-Lib WILLR: -100 * (HH - C) / (HH - LL)."""
    hh, ll = hh_ll(p, n)
    return ops.difference_ratio(hh, p.close, hh, ll, scale=-100.0, out=out)


def macd_line_signal(p: Panel, fast: int, slow: int, signal: int) -> tuple[Tensor, Tensor]:
    """TA-Lib MACD line and signal: the fast EMA seeded at the slow EMA's first bar, signal = EMA of the line."""

    def f():
        dc = p.close_change()  # EMA(fast) - EMA(slow) = (C - EMA(slow)) - (C - EMA(fast)): differences, not levels
        line = p.op.ema_distance(p.close, dc, slow) - p.op.ema_distance(p.close, dc, fast, start=slow - fast)
        sig = p.op.ema(line, signal, start=slow - 1)
        return p.op.blank(line, slow + signal - 2), sig  # TA-Lib reports all three from the signal's first bar

    return p.memo(("macd", fast, slow, signal), f)


def macd(p: Panel, fast: int, slow: int, signal: int) -> tuple[Tensor, Tensor, Tensor]:
    """TA-Lib MACD line, signal and histogram."""
    line, sig = macd_line_signal(p, fast, slow, signal)
    return line, sig, line - sig


def cci(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """TA-Lib CCI: (TP - SMA(TP)) / (0.015 * mean |TP - SMA(TP)|) over n bars."""
    tp = p.typical_price()
    dev = p.memo("tp_block_prefix", lambda: p.op.BlockPrefix(tp, 20)).deviation(tp, n)  # TP - SMA(TP)
    return ops.safe_div(dev, p.op.mean_abs_deviation(tp, dev, n, 0.015), out=out)  # 0.015: CCI's constant


def _moves(p: Panel) -> tuple[Tensor, Tensor]:
    """+DM and -DM: the high's rise / the low's fall where it is positive and the larger (NaN at the first bar)."""
    rise, fall = p.op.diff(p.high, 1), p.op.diff(p.low, 1).neg_()
    plus, minus = (rise > 0) & (rise > fall), (fall > 0) & (rise < fall)
    return rise.mul_(plus), fall.mul_(minus)  # masks by multiplication, so NaN * False stays NaN at the first bar


def directional(p: Panel, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """TA-Lib PLUS_DI, MINUS_DI and ADX: Wilder sums of +DM, -DM and TR, DX smoothed by Wilder into ADX."""

    def f():
        plus, minus = p.memo("directional_moves", lambda: _moves(p))
        tr_s = p.op.wilder_sum(p.true_range(), n, start=1)
        pdi = ops.safe_div(p.op.wilder_sum(plus, n, start=1), tr_s, scale=100.0)
        mdi = ops.safe_div(p.op.wilder_sum(minus, n, start=1), tr_s, scale=100.0)
        dx = ops.safe_div((mdi - pdi).abs_(), mdi + pdi, scale=100.0)
        adx = p.op.wilder(dx, n, start=n)
        return p.op.blank(pdi, n), p.op.blank(mdi, n), adx  # DX before bar n is not used: ADX starts from DX[n]

    return p.memo(("directional", n), f)


def aroon(p: Panel, n: int) -> tuple[Tensor, Tensor]:
    """TA-Lib AROON: 100 * (n - bars since the highest high / lowest low of the last n+1 bars) / n."""

    def f():
        return p.op.aroon_line(p.high, n, highest=True), p.op.aroon_line(p.low, n, highest=False)

    return p.memo(("aroon", n), f)


def ultosc(p: Panel, n1: int = 7, n2: int = 14, n3: int = 28, out: Tensor | None = None) -> Tensor:
    """TA-Lib ULTOSC: 100 * (4 A1 + 2 A2 + A3) / 7, A_k = sum(buying pressure) / sum(true range) over n_k, into
    ``out`` when given."""
    bps = p.op.Prefix(p.close - torch.minimum(p.low, p.prev_close()), 1)  # buying pressure C - min(L, C[t-1])
    trs = p.op.Prefix(p.true_range(), 1)
    acc = None
    for w, n in zip((4.0, 2.0, 1.0), (n1, n2, n3)):
        t = trs.sum(n)
        term = ops.safe_div(bps.sum(n), t, scale=w, out=t)
        acc = term if acc is None else acc.add_(term)
    acc = p.op.blank(acc, max(n1, n2, n3))
    return torch.mul(acc, 100.0 / 7.0, out=out)


def trix(p: Panel, n: int, out: Tensor | None = None) -> Tensor:
    """TA-Lib TRIX: 1-bar percent change of a triple EMA (each EMA seeded with the SMA of its input)."""
    e1 = p.op.ema(p.close, n)
    e2 = p.op.ema(e1, n, start=n - 1)
    return p.op.pct_change(p.op.ema(e2, n, start=2 * n - 2), 1, out)


def features() -> FeatureList:
    fl = FeatureList("momentum")
    for h in (1, 2, 3, 5, 10, 20, 50, 100):
        fl.add(f"logret_{h}", f"ln C[t] - ln C[t-{h}]", h, lambda p, out=None, h=h: p.log_return(h, out), talib="ROCR")
    for n in (5, 10, 20):
        fl.add(f"roc_{n}", f"TA-Lib ROC({n}): 100 (C[t]/C[t-{n}] - 1)", n, lambda p, out=None, n=n: roc(p, n, out), talib="ROC")
    for n in MOM_WINDOWS:
        fl.add(f"mom_{n}", f"TA-Lib MOM({n}) / ATR(14)", max(n, 14), lambda p, out=None, n=n: p.op.lag_diff_times(p.close, n, p.inv_atr(), out), talib="MOM")
    for n in (6, 14, 21, 28):
        fl.add(f"rsi_{n}", f"TA-Lib RSI({n}), Wilder smoothing, 0..100", n, lambda p, out=None, n=n: rsi(p, n, out), talib="RSI")
    for n in (5, 14):
        w = n + 1
        fl.add(f"stoch_k_{n}", f"TA-Lib STOCH({n},3,SMA,3,SMA) slow %K", w + 2, lambda p, n=n: stoch(p, n)[0], talib="STOCH")
        fl.add(f"stoch_d_{n}", f"TA-Lib STOCH({n},3,SMA,3,SMA) slow %D", w + 2, lambda p, n=n: stoch(p, n)[1], talib="STOCH")
    for n in (14, 28):
        fl.add(f"willr_{n}", f"TA-Lib WILLR({n}): -100 (HH - C) / (HH - LL)", n - 1, lambda p, out=None, n=n: willr(p, n, out), talib="WILLR")
    for f_, s_, g_ in ((12, 26, 9), (5, 35, 5)):
        tag, w, a = f"{f_}_{s_}_{g_}", s_ + g_ - 2, (f_, s_, g_)
        fl.add(f"macd_{tag}", f"TA-Lib MACD({f_},{s_},{g_}) line / ATR(14)", w,
               lambda p, out=None, a=a: p.per_atr(macd_line_signal(p, *a)[0], out), talib="MACD")
        fl.add(f"macd_signal_{tag}", f"TA-Lib MACD({f_},{s_},{g_}) signal / ATR(14)", w,
               lambda p, out=None, a=a: p.per_atr(macd_line_signal(p, *a)[1], out), talib="MACD")
        fl.add(f"macd_hist_{tag}", f"TA-Lib MACD({f_},{s_},{g_}) histogram / ATR(14)", w,
               lambda p, out=None, a=a: ops.diff_times(*macd_line_signal(p, *a), p.inv_atr(), out), talib="MACD")
    for n in (14, 20):
        fl.add(f"cci_{n}", f"TA-Lib CCI({n}): (TP - SMA(TP)) / (0.015 mean abs deviation)", n - 1, lambda p, out=None, n=n: cci(p, n, out), talib="CCI")
    for n in (14, 28):
        fl.add(f"adx_{n}", f"TA-Lib ADX({n}): Wilder-smoothed DX", 2 * n - 1, lambda p, n=n: directional(p, n)[2], talib="ADX")
        fl.add(f"plus_di_{n}", f"TA-Lib PLUS_DI({n})", n, lambda p, n=n: directional(p, n)[0], talib="PLUS_DI")
        fl.add(f"minus_di_{n}", f"TA-Lib MINUS_DI({n})", n, lambda p, n=n: directional(p, n)[1], talib="MINUS_DI")
    fl.add("aroon_up_25", "TA-Lib AROON(25) up", 25, lambda p: aroon(p, 25)[0], talib="AROON")
    fl.add("aroon_down_25", "TA-Lib AROON(25) down", 25, lambda p: aroon(p, 25)[1], talib="AROON")
    fl.add("aroon_osc_25", "TA-Lib AROONOSC(25): Aroon up - Aroon down", 25, lambda p, out=None: torch.sub(*aroon(p, 25), out=out), talib="AROONOSC")
    fl.add("ultosc_7_14_28", "TA-Lib ULTOSC(7,14,28)", 28, lambda p, out=None: ultosc(p, 7, 14, 28, out=out), talib="ULTOSC")
    fl.add("trix_15", "TA-Lib TRIX(15): 1-bar % change of a triple EMA", 43, lambda p, out=None: trix(p, 15, out), talib="TRIX")
    return fl
