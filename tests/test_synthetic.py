"""The embedded synthetic market: determinism, bar consistency, stylised facts, and the exactness of its oracle."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from foxhunt.data.synthetic import (
    MarketParams,
    SyntheticMarket,
    generate_market,
    oracle_from_bars,
    student_t_ppf,
)

N = 200_000
QS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)


@pytest.fixture(scope="module")
def market() -> SyntheticMarket:
    return generate_market(N, seed=0, signal_strength=0.1)


@pytest.fixture(scope="module")
def strong() -> SyntheticMarket:
    return generate_market(N, seed=1, signal_strength=0.3)


@pytest.fixture(scope="module")
def martingale() -> SyntheticMarket:
    return generate_market(N, seed=2, signal_strength=0.0)


@pytest.fixture(scope="module")
def trio() -> SyntheticMarket:
    return generate_market(60_000, n_symbols=3, seed=3, correlation=0.5, symbols=("NQ", "ES", "YM"))


def log_returns(m: SyntheticMarket) -> np.ndarray:
    """Close-to-close log returns inside each symbol (the first bar of a symbol has none)."""
    logc = np.log(m.bars["close"].to_numpy())
    sym = m.bars["symbol"].to_numpy()
    return np.diff(logc)[sym[1:] == sym[:-1]]


def innovations(m: SyntheticMarket) -> tuple[np.ndarray, np.ndarray]:
    """(r[t+1] - oracle_mean[t]) / oracle_std[t] and the mask of rows where it is defined."""
    ok = np.isfinite(m.oracle_mean)
    return (m.next_returns()[ok] - m.oracle_mean[ok]) / m.oracle_std[ok], ok


def chicago(m: SyntheticMarket) -> pd.DatetimeIndex:
    return pd.DatetimeIndex(m.bars["timestamp"]).tz_convert("America/Chicago")


def minutes_since_session_open(m: SyntheticMarket) -> np.ndarray:
    local = chicago(m)
    return ((local.hour.to_numpy() * 60 + local.minute.to_numpy()) - 17 * 60) % (24 * 60)


def corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


# --- the Student-t quantile function the oracle relies on ----------------------------------------------------------


def test_student_t_ppf_matches_known_values():
    p = np.array([0.001, 0.1, 0.3, 0.5, 0.8, 0.999])
    for df, odd_terms in ((3.0, lambda c: 1.0), (5.0, lambda c: 1.0 + 2.0 / 3.0 * c * c)):  # closed-form CDFs, odd df
        theta = np.arctan(student_t_ppf(p, df) / math.sqrt(df))
        cdf = 0.5 + (theta + np.sin(theta) * np.cos(theta) * odd_terms(np.cos(theta))) / math.pi
        np.testing.assert_allclose(cdf, p, rtol=1e-12, atol=1e-14)
    alpha = 4 * p * (1 - p)  # df = 4 has a closed-form quantile
    q4 = np.cos(np.arccos(np.sqrt(alpha)) / 3) / np.sqrt(alpha)
    np.testing.assert_allclose(student_t_ppf(p, 4.0), np.sign(p - 0.5) * 2 * np.sqrt(q4 - 1), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(student_t_ppf(p, 1.0), np.tan(np.pi * (p - 0.5)), rtol=1e-10, atol=1e-12)  # Cauchy
    np.testing.assert_allclose(student_t_ppf(p, 2.0), (2 * p - 1) / np.sqrt(2 * p * (1 - p)), rtol=1e-10, atol=1e-12)
    assert student_t_ppf(0.975, math.inf) == pytest.approx(1.959963984540054, rel=1e-12)
    np.testing.assert_allclose(student_t_ppf(p, 3.5), -student_t_ppf(1 - p, 3.5), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="probabilities"):
        student_t_ppf([0.5, 1.0], 5.0)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1_000])
def test_blocked_scan_equals_the_sequential_recursion(n):
    from foxhunt.data.synthetic import _linear_recursion

    rng = np.random.default_rng(n)
    coef, inc = 0.9 + 0.1 * rng.random(n), rng.standard_normal(n)
    for c, b in ((coef, inc), (0.3, inc), (coef, 0.05)):
        expected = [0.7]
        for t in range(n):
            expected.append((c if isinstance(c, float) else c[t]) * expected[-1] + (b if isinstance(b, float) else b[t]))
        np.testing.assert_allclose(_linear_recursion(c, b, 0.7), expected, rtol=1e-12, atol=1e-12)


# --- determinism, schema, OHLC, calendar ----------------------------------------------------------------------------


def test_same_seed_same_market_other_seed_other_market():
    a = generate_market(5_000, n_symbols=2, seed=7)
    b = generate_market(5_000, n_symbols=2, seed=7)
    c = generate_market(5_000, n_symbols=2, seed=8)
    pd.testing.assert_frame_equal(a.bars, b.bars)
    np.testing.assert_array_equal(a.oracle_mean, b.oracle_mean)
    np.testing.assert_array_equal(a.oracle_std, b.oracle_std)
    assert not np.allclose(a.bars["close"], c.bars["close"])
    assert not np.allclose(a.bars["volume"], c.bars["volume"])
    pd.testing.assert_series_equal(a.bars["timestamp"], c.bars["timestamp"])  # the calendar does not depend on the seed


def test_schema_sorting_and_ohlc_consistency(trio):
    bars = trio.bars
    assert list(bars.columns) == ["timestamp", "open", "high", "low", "close", "volume", "symbol"]
    assert str(bars["timestamp"].dtype) == "datetime64[ns, UTC]"
    for c in ("open", "high", "low", "close", "volume"):
        assert bars[c].dtype == np.float64, c
    assert pd.api.types.is_string_dtype(bars["symbol"])
    assert isinstance(bars.index, pd.RangeIndex) and bars.index.start == 0
    assert len(bars) == 3 * 60_000
    assert trio.symbols == ("ES", "NQ", "YM")
    sym = bars["symbol"].to_numpy().astype(str)
    assert (sym[1:] >= sym[:-1]).all() and list(np.unique(sym)) == ["ES", "NQ", "YM"]
    ts = pd.DatetimeIndex(bars["timestamp"]).asi8.reshape(3, -1)
    assert (np.diff(ts, axis=1) > 0).all()
    assert (ts == ts[:1]).all()  # one calendar for every symbol
    o, h, l, c, v = (bars[k].to_numpy() for k in ("open", "high", "low", "close", "volume"))
    assert np.isfinite(bars[["open", "high", "low", "close", "volume"]].to_numpy()).all()
    assert (l > 0).all()
    assert (h >= np.maximum(o, c)).all() and (l <= np.minimum(o, c)).all()
    assert (h > np.maximum(o, c)).mean() > 0.9 and (l < np.minimum(o, c)).mean() > 0.9  # bars have wicks
    assert (v >= 1).all() and (v == np.round(v)).all()
    assert trio.oracle_mean.shape == trio.oracle_std.shape == (len(bars),)
    last = np.r_[bars["symbol"].to_numpy()[1:] != bars["symbol"].to_numpy()[:-1], True]
    assert np.isnan(trio.oracle_mean[last]).all() and np.isnan(trio.oracle_std[last]).all()
    assert np.isfinite(trio.oracle_mean[~last]).all() and (trio.oracle_std[~last] > 0).all()


def test_globex_session_calendar(market):
    local = chicago(market)
    since_open = minutes_since_session_open(market)
    assert (since_open < 23 * 60).all()  # nothing in the 16:00-17:00 maintenance break
    assert not (local.day_of_week == 5).any()  # Saturday
    assert not ((local.day_of_week == 6) & (local.hour < 17)).any()  # Sunday before the open
    assert not ((local.day_of_week == 4) & (local.hour >= 16)).any()  # Friday after the close
    dt = np.diff(pd.DatetimeIndex(market.bars["timestamp"]).asi8) // 1_000_000_000
    session_start = np.r_[True, dt != 60]
    np.testing.assert_array_equal(session_start, since_open == 0)
    closed = set((np.unique(dt[dt != 60]) - 60).tolist())  # daily break, weekend (48 or 50 h over a DST change)
    assert {3600, 49 * 3600, 48 * 3600} <= closed <= {3600, 48 * 3600, 49 * 3600, 50 * 3600}
    assert local[0] == pd.Timestamp("2024-01-01 17:00", tz="America/Chicago")  # session of trading date 2024-01-02
    assert {-6, -5} <= {int(t.utcoffset().total_seconds() // 3600) for t in local[since_open == 0]}
    o, c = market.bars["open"].to_numpy(), market.bars["close"].to_numpy()
    np.testing.assert_array_equal(o[1:][~session_start[1:]], c[:-1][~session_start[1:]])
    assert (o[1:][session_start[1:]] != c[:-1][session_start[1:]]).all()  # a gap return applies at session opens


def test_round_the_clock_calendar_and_other_bar_lengths():
    m = generate_market(3_000, seed=1, session_gaps=False, bar_seconds=1, start="2024-03-09")
    ts = pd.DatetimeIndex(m.bars["timestamp"])
    assert ts[0] == pd.Timestamp("2024-03-09", tz="UTC")
    assert (np.diff(ts.asi8) == 1_000_000_000).all()
    np.testing.assert_array_equal(m.bars["open"].to_numpy()[1:], m.bars["close"].to_numpy()[:-1])
    hourly = generate_market(500, seed=1, bar_seconds=3600)
    assert (minutes_since_session_open(hourly) % 60 == 0).all()
    assert len(np.unique(minutes_since_session_open(hourly))) == 23


# --- stylised facts ------------------------------------------------------------------------------------------------


def test_fat_tails(market):
    r = log_returns(market)
    r = r - r.mean()
    assert np.mean(r**4) / np.mean(r**2) ** 2 - 3 > 1
    inside = np.diff(pd.DatetimeIndex(market.bars["timestamp"]).asi8) == 60 * 1_000_000_000
    ri = r[inside] - r[inside].mean()
    assert np.mean(ri**4) / np.mean(ri**2) ** 2 - 3 > 1  # not only from session gaps


def test_volatility_clustering(market):
    a = np.abs(log_returns(market))
    a = a - a.mean()
    acf = [np.mean(a[k:] * a[:-k]) / np.mean(a * a) for k in range(1, 11)]
    assert all(x > 0.05 for x in acf), acf


def test_intraday_u_shape_in_volume_and_volatility(market):
    since_open = minutes_since_session_open(market)
    first_hour, last_hour = since_open < 60, since_open >= 22 * 60
    midday = (since_open >= 11 * 60) & (since_open < 12 * 60)
    inside = np.r_[False, np.diff(pd.DatetimeIndex(market.bars["timestamp"]).asi8) == 60 * 1_000_000_000]
    vol = market.bars["volume"].to_numpy()
    abs_r = np.abs(np.r_[np.nan, np.diff(np.log(market.bars["close"].to_numpy()))])
    for x, mask in ((vol, np.ones_like(inside)), (abs_r, inside)):  # |r| without the gap bars at the open
        mid = x[midday & mask].mean()
        assert x[first_hour & mask].mean() > 1.2 * mid
        assert x[last_hour & mask].mean() > 1.2 * mid


def test_volume_rises_with_absolute_return(market):
    since_open = minutes_since_session_open(market)
    midday = (since_open >= 8 * 60) & (since_open < 15 * 60)  # flat part of the U, so the season does not drive it
    abs_r = np.abs(np.r_[0.0, np.diff(np.log(market.bars["close"].to_numpy()))])
    assert corr(np.log(market.bars["volume"].to_numpy()[midday]), abs_r[midday]) > 0.5


# --- the oracle ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, s", [("market", 0.1), ("strong", 0.3)])
def test_oracle_signal_has_documented_strength(name, s, request):
    m: SyntheticMarket = request.getfixturevalue(name)
    ok = np.isfinite(m.oracle_mean)
    r_next = m.next_returns()[ok]
    sigma_next = m.oracle_std[ok] / math.sqrt(1 - s * s)
    # exact on the standardised scale: corr(e[t], e[t+1]) = s, achievable R^2 = s^2
    assert corr(m.oracle_mean[ok] / sigma_next, r_next / sigma_next) == pytest.approx(s, abs=0.015)
    # in raw units a little above s (the documented 1.1-1.2 s), never below it by more than noise
    assert 0.9 * s < corr(m.oracle_mean[ok], r_next) < 1.6 * s
    # the oracle takes out all linear predictability: what is left is an i.i.d. unit-variance innovation
    u, _ = innovations(m)
    assert abs(u.mean()) < 0.01 and u.var() == pytest.approx(1.0, abs=0.03)
    assert abs(corr(u[1:], u[:-1])) < 0.01 and abs(corr(u, m.oracle_mean[ok])) < 0.01
    # and a forecast that ignores it does worse: the oracle beats the lag-1 return regression out of sample
    r = m.next_returns()
    x = np.r_[np.nan, r[:-1]][ok]
    fit = np.isfinite(x)
    beta = np.polyfit(x[fit][: len(x) // 2], r_next[fit][: len(x) // 2], 1)
    tail = slice(len(x) // 2, None)
    mse_lin = np.mean((r_next[fit][tail] - np.polyval(beta, x[fit][tail])) ** 2)
    mse_oracle = np.mean((r_next[fit][tail] - m.oracle_mean[ok][fit][tail]) ** 2)
    assert mse_oracle < mse_lin


def test_zero_strength_is_a_martingale(martingale):
    m = martingale
    ok = np.isfinite(m.oracle_std)
    assert (m.oracle_mean[ok] == 0).all() and np.isnan(m.oracle_mean[~ok]).all()
    u, _ = innovations(m)
    assert abs(corr(u[1:], u[:-1])) < 0.01


@pytest.mark.parametrize("name", ["market", "strong"])
def test_oracle_quantiles_are_calibrated(name, request):
    m: SyntheticMarket = request.getfixturevalue(name)
    quant = m.oracle_quantile(QS)
    assert quant.shape == (len(m.bars), len(QS))
    ok = np.isfinite(m.oracle_mean)
    assert np.isnan(quant[~ok]).all() and (np.diff(quant[ok], axis=1) > 0).all()
    np.testing.assert_allclose(quant[ok][:, QS.index(0.5)], m.oracle_mean[ok], rtol=0, atol=1e-15)
    below = (m.next_returns()[ok][:, None] <= quant[ok]).mean(axis=0)
    np.testing.assert_allclose(below, QS, atol=0.01)
    # fat tails matter: Gaussian quantiles with the same mean and sd miss the 1% tails
    z = np.array([-2.3263478740408408, 2.3263478740408408])
    gauss = m.oracle_mean[ok][:, None] + m.oracle_std[ok][:, None] * z
    gauss_below = (m.next_returns()[ok][:, None] <= gauss).mean(axis=0)
    assert abs(gauss_below[0] - 0.01) > 0.001 or abs(gauss_below[1] - 0.99) > 0.001
    with pytest.raises(ValueError, match="quantile levels"):
        m.oracle_quantile([0.0, 0.5])


def test_several_symbols_are_correlated_as_configured(trio):
    u, _ = innovations(trio)
    u = u.reshape(3, -1)
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert corr(u[i], u[j]) == pytest.approx(0.5, abs=0.03)
        r = np.diff(np.log(trio.bars["close"].to_numpy()).reshape(3, -1), axis=1)
        assert 0.3 < corr(r[i], r[j]) < 0.6
    pair = generate_market(60_000, n_symbols=2, seed=3, correlation=-0.4)
    u2, _ = innovations(pair)
    assert corr(*u2.reshape(2, -1)) == pytest.approx(-0.4, abs=0.03)
    free = generate_market(60_000, n_symbols=2, seed=3, correlation=0.0)
    assert abs(corr(*innovations(free)[0].reshape(2, -1))) < 0.03


def test_a_longer_market_starts_with_the_shorter_one():
    short = generate_market(3_000, n_symbols=2, seed=11, signal_strength=0.2)
    long = generate_market(5_000, n_symbols=2, seed=11, signal_strength=0.2)
    for k in range(2):
        rows_s = slice(k * 3_000, (k + 1) * 3_000)
        rows_l = slice(k * 5_000, k * 5_000 + 3_000)
        head_of_long = long.bars.iloc[rows_l].reset_index(drop=True)
        pd.testing.assert_frame_equal(short.bars.iloc[rows_s].reset_index(drop=True), head_of_long)
        np.testing.assert_array_equal(short.oracle_mean[rows_s][:-1], long.oracle_mean[rows_l][:-1])
        np.testing.assert_array_equal(short.oracle_std[rows_s][:-1], long.oracle_std[rows_l][:-1])
        assert np.isfinite(long.oracle_mean[rows_l][-1])


def test_oracle_is_recomputable_from_past_bars_only(trio):
    mean, std = oracle_from_bars(trio.bars, trio.params)
    np.testing.assert_allclose(mean, trio.oracle_mean, rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(std, trio.oracle_std, rtol=1e-9)
    t0 = 30_000  # perturb every symbol's bars after row t0 of its block
    bars = trio.bars.copy()
    rng = np.random.default_rng(0)
    future = np.tile(np.arange(60_000) > t0, 3)
    for col in ("open", "high", "low", "close", "volume"):
        bars.loc[future, col] = bars.loc[future, col].to_numpy() * np.exp(rng.normal(0, 0.01, future.sum()))
    mean2, std2 = oracle_from_bars(bars, trio.params)
    past = np.tile(np.arange(60_000) <= t0, 3)
    np.testing.assert_array_equal(mean2[past], mean[past])
    np.testing.assert_array_equal(std2[past], std[past])
    assert not np.allclose(mean2[~past], mean[~past])  # the check has teeth: the future did move
    head = bars[np.tile(np.arange(60_000) <= t0, 3)].reset_index(drop=True)  # and a truncated history agrees
    mean3, _ = oracle_from_bars(head, trio.params)
    np.testing.assert_array_equal(np.isnan(mean3), np.tile(np.arange(t0 + 1) == t0, 3))
    np.testing.assert_allclose(mean3[np.isfinite(mean3)], mean[past][np.isfinite(mean3)], rtol=1e-12, atol=1e-16)


# --- parameters and writing ----------------------------------------------------------------------------------------


def test_params_are_recorded():
    m = generate_market(1_000, seed=5, tail_df=math.inf, garch_alpha=0.1, garch_beta=0.8)
    assert isinstance(m.params, MarketParams)
    assert (m.params.seed, m.params.tail_df, m.params.garch_omega) == (5, math.inf, pytest.approx(0.1))
    assert m.params.to_dict()["symbols"] == ["SYN0"]
    again = generate_market(**{k: v for k, v in m.params.to_dict().items()})
    pd.testing.assert_frame_equal(again.bars, m.bars)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_bars": 1}, "n_bars"),
        ({"signal_strength": 1.0}, "signal_strength"),
        ({"bar_seconds": 7}, "bar_seconds"),
        ({"n_symbols": 3, "correlation": -0.6}, "correlation"),
        ({"tail_df": 2.0}, "tail_df"),
        ({"garch_alpha": 0.1, "garch_beta": 0.9}, "garch"),
        ({"daily_volatility": 0.0}, "daily_volatility"),
        ({"n_symbols": 2, "symbols": ["A"]}, "symbols"),
        ({"n_symbols": 2, "symbols": ["A", "A"]}, "symbols"),
        ({"start": "not a date"}, "start"),
    ],
)
def test_bad_parameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_market(**{"n_bars": 100, **kwargs})


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".dbn.zst"])
def test_write_round_trips_through_the_loader(tmp_path, suffix):
    from foxhunt.data.io import load_bars

    m = generate_market(2_000, n_symbols=2, seed=4)
    path = m.write(tmp_path / f"market{suffix}")
    assert path.exists()
    back = load_bars(path)
    pd.testing.assert_series_equal(back["timestamp"], m.bars["timestamp"])
    assert back["symbol"].tolist() == m.bars["symbol"].tolist()
    for col in ("open", "high", "low", "close", "volume"):
        np.testing.assert_allclose(back[col].to_numpy(), m.bars[col].to_numpy(), rtol=1e-12, err_msg=col)
