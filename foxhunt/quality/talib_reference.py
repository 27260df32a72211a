"""The features' yardstick: TA-Lib's calls equivalent to the registry's TA-Lib-derived features, and the synthetic bars
the feature benchmarks time and check them on (``scripts/bench_features.py``, ``scripts/device_check.py``).

    ohlcv, ts, sym = make_bars(1_000_000, seed=0)
    o, h, l, c, v = (ohlcv[:, i].numpy() for i in range(5))
    for name, call in talib_calls(o, h, l, c, v): call()     # needs TA-Lib (the ``talib`` extra)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from foxhunt.data.synthetic import generate_market
from foxhunt.features.trend import WINDOWS

__all__ = ["WINDOWS", "make_bars", "talib_calls"]


def make_bars(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(OHLCV [n, 5] float64, timestamps [n] ns, symbol codes [n]) of one symbol of the synthetic market."""
    b = generate_market(n_bars=n, n_symbols=1, seed=seed, signal_strength=0.1).bars
    ohlcv = torch.from_numpy(b[["open", "high", "low", "close", "volume"]].to_numpy(np.float64).copy())
    ts = torch.from_numpy(b["timestamp"].to_numpy(dtype="datetime64[ns]").astype(np.int64))
    return ohlcv, ts, torch.zeros(n, dtype=torch.int64)


def talib_calls(
    o: np.ndarray, h: np.ndarray, l: np.ndarray, c: np.ndarray, v: np.ndarray
) -> list[tuple[str, Callable[[], object]]]:
    """TA-Lib calls equivalent to the registry's TA-Lib-derived features (outputs kept), and the features they cover."""
    import talib

    calls = []
    calls += [(f"ROCR({k})", lambda k=k: talib.ROCR(c, k)) for k in (1, 2, 3, 5, 10, 20, 50, 100)]
    calls += [(f"ROC({k})", lambda k=k: talib.ROC(c, k)) for k in (5, 10, 20)]
    calls += [(f"MOM({k})", lambda k=k: talib.MOM(c, k)) for k in (5, 10, 20)]
    calls += [(f"ATR({k})", lambda k=k: talib.ATR(h, l, c, k)) for k in (7, 14, 28)]
    calls += [(f"NATR({k})", lambda k=k: talib.NATR(h, l, c, k)) for k in (7, 14, 28)]
    calls += [(f"RSI({k})", lambda k=k: talib.RSI(c, k)) for k in (6, 14, 21, 28)]
    calls += [(f"STOCH({k})", lambda k=k: talib.STOCH(h, l, c, k, 3, 0, 3, 0)) for k in (5, 14)]
    calls += [(f"WILLR({k})", lambda k=k: talib.WILLR(h, l, c, k)) for k in (14, 28)]
    calls += [(f"MACD{a}", lambda a=a: talib.MACD(c, *a)) for a in ((12, 26, 9), (5, 35, 5))]
    calls += [(f"CCI({k})", lambda k=k: talib.CCI(h, l, c, k)) for k in (14, 20)]
    for k in (14, 28):
        calls += [(f"ADX({k})", lambda k=k: talib.ADX(h, l, c, k)), (f"PLUS_DI({k})", lambda k=k: talib.PLUS_DI(h, l, c, k)),
                  (f"MINUS_DI({k})", lambda k=k: talib.MINUS_DI(h, l, c, k))]
    calls += [("AROON(25)", lambda: talib.AROON(h, l, 25))]
    calls += [("AROONOSC(25)", lambda: talib.AROONOSC(h, l, 25)), ("ULTOSC", lambda: talib.ULTOSC(h, l, c, 7, 14, 28)),
              ("TRIX(15)", lambda: talib.TRIX(c, 15))]
    calls += [(f"SMA({k})", lambda k=k: talib.SMA(c, k)) for k in WINDOWS]
    calls += [(f"EMA({k})", lambda k=k: talib.EMA(c, k)) for k in WINDOWS]
    calls += [(f"KAMA({k})", lambda k=k: talib.KAMA(c, k)) for k in (10, 30)]
    r = np.diff(np.log(c), prepend=np.nan)
    calls += [(f"STDDEV({k})", lambda k=k: talib.STDDEV(r, k, 1.0)) for k in (5, 10, 20, 50, 100)]
    calls += [(f"BBANDS({k})", lambda k=k: talib.BBANDS(c, k, 2.0, 2.0, 0)) for k in (20, 50)]
    calls += [("OBV", lambda: talib.OBV(c, v))] + [(f"MFI({k})", lambda k=k: talib.MFI(h, l, c, v, k)) for k in (14, 28)]
    calls += [("ADOSC", lambda: talib.ADOSC(h, l, c, v, 3, 10)), ("BOP", lambda: talib.BOP(o, h, l, c))]
    return calls
