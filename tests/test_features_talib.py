"""Every feature built on a TA-Lib indicator matches TA-Lib (definition, seeding, warm-up) to 1e-6 relative."""

from __future__ import annotations

import numpy as np
import pytest
import torch

talib = pytest.importorskip("talib")

from foxhunt.features import REGISTRY
from foxhunt.features import momentum as M
from foxhunt.features import shape as SH
from foxhunt.features import trend as TR
from foxhunt.features import volatility as V
from foxhunt.features import volume as VO
from foxhunt.features.panel import Panel

RTOL = 1e-6


def random_walk_bars(n: int, seed: int, price: float = 30.0, vol: float = 0.02) -> np.ndarray:
    """OHLCV [n, 5] of a fat-tailed random walk with opening gaps and lognormal volume."""
    rng = np.random.default_rng(seed)
    c = price * np.exp(np.cumsum(vol * rng.standard_t(4, n) / 2))
    o = np.empty(n)
    o[0] = price
    o[1:] = c[:-1] * np.exp(0.002 * rng.standard_normal(n - 1))
    hi = np.maximum(o, c) * np.exp(np.abs(vol * rng.standard_normal(n)) / 2)
    lo = np.minimum(o, c) * np.exp(-np.abs(vol * rng.standard_normal(n)) / 2)
    v = np.round(np.exp(6 + rng.standard_normal(n)))
    return np.stack([o, hi, lo, c, v], axis=1)


def market_bars(n: int) -> np.ndarray:
    from foxhunt.data.synthetic import generate_market

    b = generate_market(n_bars=n, n_symbols=1, seed=3, signal_strength=0.1).bars
    return b[["open", "high", "low", "close", "volume"]].to_numpy(np.float64)


@pytest.fixture(scope="module", params=["market", "walk"])
def bars(request) -> np.ndarray:
    return market_bars(3000) if request.param == "market" else random_walk_bars(3000, seed=11)


def panel_of(ohlcv: np.ndarray) -> Panel:
    n = ohlcv.shape[0]
    return Panel.from_flat(torch.tensor(ohlcv), torch.arange(n) * 60_000_000_000, torch.zeros(n, dtype=torch.int64))


def assert_matches(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Same warm-up (NaN pattern) as TA-Lib, then equal to 1e-6 relative.

    Values that cross zero (CCI, MACD, OBV...) are differences of large numbers in both
    implementations, so an absolute floor of 1e-9 of the indicator's largest magnitude applies.
    """
    ours = np.asarray(ours).ravel()
    ref = np.asarray(ref, dtype=np.float64)
    first_ref = int(np.argmax(~np.isnan(ref)))
    first_ours = int(np.argmax(~np.isnan(ours)))
    assert first_ours == first_ref, f"{what}: first defined bar {first_ours}, TA-Lib {first_ref}"
    assert not np.isnan(ours[first_ref:]).any(), f"{what}: NaN after warm-up"
    scale = np.nanmax(np.abs(ref)) + 1e-300
    np.testing.assert_allclose(ours[first_ref:], ref[first_ref:], rtol=RTOL, atol=1e-9 * scale, err_msg=what)


def _c(b):
    return b[:, 3]


# One check per TA-Lib function a registered feature is (a transform of); each name below is a
# registry ``talib`` tag. The features' params are re-read from the registry where they vary.
def check_ROC(p, b):
    for n in (5, 10, 20):
        assert_matches(M.roc(p, n), talib.ROC(_c(b), n), f"ROC({n})")


def check_ROCR(p, b):
    for h in (1, 2, 3, 5, 10, 20, 50, 100):
        assert_matches(p.log_return(h), np.log(talib.ROCR(_c(b), h)), f"ln ROCR({h})")


def check_MOM(p, b):
    for n in (5, 10, 20):
        assert_matches(M.mom(p, n), talib.MOM(_c(b), n), f"MOM({n})")


def check_ATR(p, b):
    for n in (7, 14, 28):
        assert_matches(p.atr(n), talib.ATR(b[:, 1], b[:, 2], b[:, 3], n), f"ATR({n})")
    assert_matches(p.true_range(), talib.TRANGE(b[:, 1], b[:, 2], b[:, 3]), "TRANGE")


def check_NATR(p, b):
    for n in (7, 14, 28):
        assert_matches(V.natr(p, n), talib.NATR(b[:, 1], b[:, 2], b[:, 3], n), f"NATR({n})")


def check_RSI(p, b):
    for n in (6, 14, 21, 28):
        assert_matches(M.rsi(p, n), talib.RSI(_c(b), n), f"RSI({n})")


def check_STOCH(p, b):
    for n in (5, 14):
        k, d = talib.STOCH(b[:, 1], b[:, 2], b[:, 3], fastk_period=n, slowk_period=3, slowk_matype=0, slowd_period=3, slowd_matype=0)
        ok, od = M.stoch(p, n)
        assert_matches(ok, k, f"STOCH({n}) %K")
        assert_matches(od, d, f"STOCH({n}) %D")


def check_WILLR(p, b):
    for n in (14, 28):
        assert_matches(M.willr(p, n), talib.WILLR(b[:, 1], b[:, 2], b[:, 3], n), f"WILLR({n})")


def check_MACD(p, b):
    for a in ((12, 26, 9), (5, 35, 5)):
        ref = talib.MACD(_c(b), *a)
        for ours, r, part in zip(M.macd(p, *a), ref, ("line", "signal", "hist")):
            assert_matches(ours, r, f"MACD{a} {part}")


def check_CCI(p, b):
    for n in (14, 20):
        assert_matches(M.cci(p, n), talib.CCI(b[:, 1], b[:, 2], b[:, 3], n), f"CCI({n})")


def check_ADX(p, b):
    for n in (14, 28):
        assert_matches(M.directional(p, n)[2], talib.ADX(b[:, 1], b[:, 2], b[:, 3], n), f"ADX({n})")


def check_PLUS_DI(p, b):
    for n in (14, 28):
        assert_matches(M.directional(p, n)[0], talib.PLUS_DI(b[:, 1], b[:, 2], b[:, 3], n), f"PLUS_DI({n})")


def check_MINUS_DI(p, b):
    for n in (14, 28):
        assert_matches(M.directional(p, n)[1], talib.MINUS_DI(b[:, 1], b[:, 2], b[:, 3], n), f"MINUS_DI({n})")


def check_AROON(p, b):
    for n in (25,):
        down, up = talib.AROON(b[:, 1], b[:, 2], n)
        assert_matches(M.aroon(p, n)[0], up, f"AROON({n}) up")
        assert_matches(M.aroon(p, n)[1], down, f"AROON({n}) down")


def check_AROONOSC(p, b):
    up, down = M.aroon(p, 25)
    assert_matches(up - down, talib.AROONOSC(b[:, 1], b[:, 2], 25), "AROONOSC(25)")


def check_ULTOSC(p, b):
    assert_matches(M.ultosc(p, 7, 14, 28), talib.ULTOSC(b[:, 1], b[:, 2], b[:, 3], 7, 14, 28), "ULTOSC")


def check_TRIX(p, b):
    assert_matches(M.trix(p, 15), talib.TRIX(_c(b), 15), "TRIX(15)")


def check_SMA(p, b):
    for n in TR.WINDOWS:
        assert_matches(TR.sma(p, n), talib.SMA(_c(b), n), f"SMA({n})")


def check_EMA(p, b):
    for n in TR.WINDOWS:
        assert_matches(TR.ema(p, n), talib.EMA(_c(b), n), f"EMA({n})")


def check_KAMA(p, b):
    for n in (10, 30):
        assert_matches(TR.kama(p, n), talib.KAMA(_c(b), n), f"KAMA({n})")


def check_STDDEV(p, b):
    r = np.diff(np.log(_c(b)), prepend=np.nan)
    for n in (5, 10, 20, 50, 100):
        assert_matches(V.std_logret(p, n), talib.STDDEV(r, n, 1.0), f"STDDEV({n}) of log returns")


def check_BBANDS(p, b):
    for n in (20, 50):
        ref = talib.BBANDS(_c(b), n, 2.0, 2.0, 0)
        for ours, r, part in zip(V.bbands(p, n), ref, ("upper", "middle", "lower")):
            assert_matches(ours, r, f"BBANDS({n}) {part}")
        # the band half-width itself (2 std), which %B and bandwidth divide by
        assert_matches(V.bbands(p, n)[0] - V.bbands(p, n)[1], ref[0] - ref[1], f"BBANDS({n}) 2 std")


def check_OBV(p, b):
    assert_matches(VO.obv(p), talib.OBV(_c(b), b[:, 4]), "OBV")


def check_MFI(p, b):
    for n in (14, 28):
        assert_matches(VO.mfi(p, n), talib.MFI(b[:, 1], b[:, 2], b[:, 3], b[:, 4], n), f"MFI({n})")


def check_ADOSC(p, b):
    assert_matches(VO.ad(p), talib.AD(b[:, 1], b[:, 2], b[:, 3], b[:, 4]), "AD")
    assert_matches(VO.adosc(p, 3, 10), talib.ADOSC(b[:, 1], b[:, 2], b[:, 3], b[:, 4], 3, 10), "ADOSC(3,10)")


def check_BOP(p, b):
    assert_matches(SH.bop(p), talib.BOP(b[:, 0], b[:, 1], b[:, 2], b[:, 3]), "BOP")


CHECKS = {name[len("check_") :]: fn for name, fn in globals().items() if name.startswith("check_")}
TAGS = sorted({f.talib for f in REGISTRY.values() if f.talib})


def test_every_talib_tag_has_a_check():
    assert set(TAGS) <= set(CHECKS), f"registry features tagged with TA-Lib functions without a check: {set(TAGS) - set(CHECKS)}"


@pytest.mark.parametrize("tag", TAGS)
def test_matches_talib(tag, bars):
    CHECKS[tag](panel_of(bars), bars)


@pytest.mark.parametrize("tag", TAGS)
def test_registry_warmup_is_talibs(tag, bars):
    """Each TA-Lib-derived feature's warm-up is at least its TA-Lib quantity's look-back, and its value is defined right after."""
    from foxhunt.features.compute import _compute

    feats = [f for f in REGISTRY.values() if f.talib == tag]
    n = bars.shape[0]
    vals, _ = _compute(feats, torch.tensor(bars), torch.arange(n), torch.zeros(n, dtype=torch.int64), dtype=torch.float64)
    for j, f in enumerate(feats):
        col = vals[j].numpy()
        assert np.isnan(col[: f.warmup]).all(), f"{f.name}: values inside its warm-up"
        assert np.isfinite(col[f.warmup :]).all(), f"{f.name}: non-finite after warm-up {f.warmup}"


def test_rolling_sums_stay_exact_on_long_series():
    """Blocked prefix sums: rolling variance of price levels ~5000 over 200k bars still matches TA-Lib."""
    b = random_walk_bars(200_000, seed=5, price=5000.0, vol=0.002)
    p = panel_of(b)
    for n in (20, 200):
        ref = talib.BBANDS(_c(b), n, 2.0, 2.0, 0)
        assert_matches(V.bbands(p, n)[0] - V.bbands(p, n)[1], ref[0] - ref[1], f"BBANDS({n}) 2 std on 200k bars")
    assert_matches(TR.sma(p, 200), talib.SMA(_c(b), 200), "SMA(200) on 200k bars")
    assert_matches(TR.kama(p, 30), talib.KAMA(_c(b), 30), "KAMA(30) on 200k bars")


@pytest.mark.slow
@pytest.mark.parametrize("tag", TAGS)
def test_matches_talib_on_a_million_bars(tag, million_bars):
    """Prefix sums and scans stay within 1e-6 of TA-Lib over 1,000,000 bars of the synthetic market."""
    CHECKS[tag](million_bars[0], million_bars[1])


@pytest.fixture(scope="module")
def million_bars():
    b = market_bars(1_000_000)
    return panel_of(b), b
