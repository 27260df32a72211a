"""Back-test metrics: hand-computed cases, batching, masks and resets, and a loop reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foxhunt.evaluation.significance import sharpe_summary
from foxhunt.evaluation.trading import bars_per_year, counted_log_returns, counted_position_changes, trading_metrics
from foxhunt.trading.pnl import LOG_RUIN_FLOOR, RUIN_FLOOR, position_changes, strategy_log_returns


def exact_pnl(pos: np.ndarray, ret: np.ndarray, c: float) -> np.ndarray:
    """Per-bar log return of an account rebalanced to ``pos`` of equity each bar, paying c per unit traded (numpy)."""
    prev = np.concatenate([[0.0], pos[:-1]])
    return np.log1p(pos * np.expm1(ret)) + np.log1p(-c * np.abs(pos - prev))


def test_hand_computed_series() -> None:
    pos = torch.tensor([1.0, 1.0, -1.0, 0.0])
    ret = torch.tensor([0.01, -0.02, -0.01, 0.05], dtype=torch.float64)
    m = trading_metrics(pos, ret, cost_bps=10.0, bars_per_year=4.0)
    c = 1e-3
    # exact per-bar log returns: long bars earn r, the short earns ln(2 - e^r), each trade pays ln(1 - c |Δw|)
    pnl = torch.tensor([0.01 + math.log1p(-c), -0.02, math.log(2 - math.exp(-0.01)) + math.log1p(-2 * c),
                        math.log1p(-c)], dtype=torch.float64)
    assert torch.allclose(strategy_log_returns(pos.double(), ret, 10.0), pnl, rtol=0, atol=1e-15)
    assert m.reward_per_bar.item() == pytest.approx(pnl.mean().item(), abs=1e-9)
    assert m.total_log_return.item() == pytest.approx(pnl.sum().item(), abs=1e-9)
    assert m.sharpe.item() == pytest.approx((pnl.mean() / pnl.std() * 2.0).item(), rel=1e-6)
    assert m.turnover.item() == pytest.approx((1 + 0 + 2 + 1) / 4)
    assert m.n_trades.item() == 3
    assert m.hit_rate.item() == pytest.approx(2 / 3)  # bars 0 and 2 gain gross, bar 1 loses; bar 3 is flat
    assert m.exposure.item() == pytest.approx(3 / 4)
    equity = torch.cumsum(pnl, 0)
    peak = torch.cummax(torch.cat([torch.zeros(1, dtype=torch.float64), equity]), 0).values[1:]
    assert m.max_drawdown.item() == pytest.approx(1 - math.exp(-(peak - equity).max().item()), rel=1e-6)


def test_batched_matches_rows_and_a_loop_reference() -> None:
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(-1, 2, (5, 300), generator=g).float()
    ret = torch.randn(300, generator=g) * 1e-3
    batch = trading_metrics(pos, ret, 2.0, 252.0)
    for i in range(5):
        row = trading_metrics(pos[i], ret, 2.0, 252.0)
        for k, v in row.as_dict().items():
            assert torch.allclose(v.double(), batch.as_dict()[k][i].double(), equal_nan=True), k
        prev, pnl = 0.0, []
        for p, r in zip(pos[i].tolist(), ret.tolist()):
            pnl.append(math.log1p(p * math.expm1(r)) + math.log1p(-2e-4 * abs(p - prev)))
            prev = p
        assert row.total_log_return.item() == pytest.approx(sum(pnl), abs=1e-9)


def test_flat_policy_and_costs() -> None:
    ret = torch.randn(100) * 1e-3
    flat = trading_metrics(torch.zeros(100), ret, 1.0, 252.0)
    assert flat.reward_per_bar.item() == 0 and flat.turnover.item() == 0 and flat.sharpe.item() == 0
    assert math.isnan(flat.hit_rate.item()) and flat.max_drawdown.item() == 0
    # Churning loses exactly the cost of the flips on a zero-return market: equity x (1 - c)(1 - 2c)^99.
    churn = trading_metrics(torch.tensor([1.0, -1.0] * 50), torch.zeros(100), 1.0, 252.0)
    assert churn.total_log_return.item() == pytest.approx(math.log1p(-1e-4) + 99 * math.log1p(-2e-4), rel=1e-12)


def test_mask_and_reset() -> None:
    pos = torch.tensor([1.0, 1.0, 1.0, 1.0])
    ret = torch.tensor([0.01, 0.01, float("nan"), 0.01])
    # NaN returns are excluded by default and the position is closed there (a cost is paid at the masked bar).
    m = trading_metrics(pos, ret, 10.0, 1.0)
    assert m.n_bars.item() == 3
    # open at bar 0, close at bar 2 (outside the mask: counted at bar 1, the last counted bar), re-open at bar 3
    assert m.n_trades.item() == 3
    assert m.turnover.item() == pytest.approx(3 / 3)
    assert m.total_log_return.item() == pytest.approx(m.reward_per_bar.item() * 3, rel=1e-12)
    # A reset bar sees a flat position coming in, so it pays to open again.
    changes = position_changes(pos, reset=torch.tensor([False, False, True, False]))
    assert changes.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_bars_per_year() -> None:
    minute = 60 * 10**9
    ts = torch.arange(0, 1000) * minute
    assert bars_per_year(ts) == pytest.approx(365.25 * 24 * 60)
    two = torch.cat([ts, ts])
    sym = torch.cat([torch.zeros(1000), torch.ones(1000)]).long()
    assert bars_per_year(two, sym) == pytest.approx(365.25 * 24 * 60)
    with pytest.raises(ValueError, match="two timestamps"):
        bars_per_year(ts[:1])
    with pytest.raises(ValueError, match="bars_per_year"):
        trading_metrics(torch.zeros(3), torch.zeros(3), 1.0, 0.0)


def _ns(index) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(index.as_unit("ns").asi8, dtype=np.int64))


def test_bars_per_year_follows_the_trading_calendar() -> None:
    """Observed bar density, not 365.25 days over the median spacing (which inflates Sharpe by up to 1.2x)."""
    import pandas as pd

    from foxhunt.evaluation.trading import bars_per_year

    # daily equities: business days less ~9 exchange holidays a year -> about 252
    days = pd.bdate_range("2019-01-01", "2023-12-31", tz="UTC")
    firsts = days.to_series().groupby([days.year, days.month]).first()
    days = days.difference(pd.DatetimeIndex(firsts[firsts.index.get_level_values(1) <= 9]))  # 9 holidays a year
    assert 248 <= bars_per_year(_ns(days)) <= 256
    # 24x5 hourly FX (Sunday 22:00 to Friday 22:00 UTC): 120 bars a week -> about 6,260
    hours = pd.date_range("2023-01-01 22:00", "2023-12-29 21:00", freq="h", tz="UTC")
    since_sunday_22 = ((hours.day_of_week + 1) % 7 * 24 + hours.hour - 22) % 168
    fx = hours[since_sunday_22 < 120]
    assert abs(bars_per_year(_ns(fx)) - 52.18 * 120) / (52.18 * 120) < 0.01
    # the synthetic market's 23x5 one-minute futures calendar, two symbols -> about 360,000
    from foxhunt.data.synthetic import generate_market

    bars = generate_market(n_bars=60_000, n_symbols=2, seed=0).bars
    ts = _ns(pd.DatetimeIndex(bars["timestamp"]))
    sym = torch.from_numpy(bars["symbol"].astype("category").cat.codes.to_numpy().astype("int64"))
    assert abs(bars_per_year(ts, sym) - 52.18 * 5 * 23 * 60) / (52.18 * 5 * 23 * 60) < 0.03


# ------------------------------------------------------------------------------------------- exact log returns
def test_short_long_and_fractional_positions_are_exact_log_returns() -> None:
    """A position w rebalanced each bar multiplies wealth by (1 - c|Δw|)(1 + w (e^r - 1)): checked against the
    account simulated on prices, for a short, a long, fractional and levered positions (w·r is exact only for 0/1)."""
    rng = np.random.default_rng(7)
    close = 100.0 * np.exp(np.cumsum(np.concatenate([[0.0], rng.normal(0.0, 0.03, 60)])))
    ret = np.diff(np.log(close))  # [60]
    c = 5e-4
    rows = [np.full(60, -1.0), np.full(60, 1.0), np.full(60, 0.5), np.full(60, -0.3), np.full(60, 1.5),
            rng.choice([-1.0, -0.5, 0.0, 0.25, 1.0], 60)]
    pos = np.stack(rows)
    got = strategy_log_returns(torch.from_numpy(pos), torch.from_numpy(ret), 5.0)
    np.testing.assert_allclose(got.numpy(), np.stack([exact_pnl(p, ret, c) for p in pos]), rtol=0, atol=1e-15)
    m = trading_metrics(torch.from_numpy(pos), torch.from_numpy(ret), 5.0, 252.0)
    for i, p in enumerate(pos):
        wealth, held = 1.0, 0.0  # the account itself: pay the trade, then hold w of equity in the asset for the bar
        for t in range(60):
            wealth *= 1.0 - c * abs(p[t] - held)
            wealth *= 1.0 + p[t] * (close[t + 1] / close[t] - 1.0)
            held = p[t]
        assert m.total_log_return[i].item() == pytest.approx(math.log(wealth), rel=1e-12, abs=1e-14)
    # the linear form overstates a short by about r² a bar (and understates a half position by about σ²/8)
    short_linear = float((-ret).sum() - c)
    assert m.total_log_return[0].item() < short_linear - 0.5 * float((ret**2).sum())
    pnl = exact_pnl(pos[0], ret, c)
    assert m.sharpe[0].item() == pytest.approx(pnl.mean() / pnl.std(ddof=1) * math.sqrt(252.0), rel=1e-12)
    assert m.reward_per_bar[0].item() == pytest.approx(pnl.mean(), rel=1e-12)


def test_ruin_is_floored_and_finite() -> None:
    """A short through a bar on which the price triples would leave negative equity: the multiplier is floored."""
    ret = torch.tensor([0.01, math.log(3.0), -0.01], dtype=torch.float64)
    pos = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    pnl = strategy_log_returns(pos, ret, 0.0)
    assert pnl[1].item() == pytest.approx(math.log(RUIN_FLOOR), rel=1e-9) and LOG_RUIN_FLOOR == math.log(RUIN_FLOOR)
    assert pnl[0].item() == pytest.approx(math.log(2 - math.exp(0.01)), rel=1e-12)
    # exactly at ruin (the price doubles) and in float32 too
    assert strategy_log_returns(torch.tensor([-1.0]), torch.tensor([math.log(2.0)]), 0.0).item() == pytest.approx(
        LOG_RUIN_FLOOR, rel=1e-6)
    m = trading_metrics(pos, ret, 1.0, 252.0)
    assert all(math.isfinite(float(v)) for k, v in m.as_dict().items() if k != "hit_rate")
    assert m.max_drawdown.item() == pytest.approx(1.0, abs=1e-11)
    # a cost of 100% of equity or more is floored the same way
    assert strategy_log_returns(torch.tensor([1.0]), torch.tensor([0.0]), 10_000.0).item() == pytest.approx(
        LOG_RUIN_FLOOR, rel=1e-6)


def loop_counted(pos: np.ndarray, ret: np.ndarray, mask: np.ndarray, reset: np.ndarray, c: float):
    """Reference: P&L and |Δw| per bar, each excluded bar's moved to the last counted bar before it of its symbol."""
    n = len(pos)
    held = np.where(mask, pos, 0.0)
    pnl, chg, trades = np.zeros(n), np.zeros(n), np.zeros(n)
    prev, last = 0.0, -1
    for t in range(n):
        if reset[t]:
            prev, last = 0.0, -1
        d = abs(held[t] - prev)
        v = math.log1p(held[t] * math.expm1(0.0 if not np.isfinite(ret[t]) else ret[t])) + math.log1p(-c * d)
        at = t if mask[t] else last
        if at >= 0:
            pnl[at] += v
            chg[at] += d
            trades[at] += d > 0
        else:
            assert v == 0.0 and d == 0.0  # flat since the symbol started: nothing to pay
        if mask[t]:
            last = t
        prev = held[t]
    return pnl, chg, trades


def test_closing_costs_at_excluded_bars_are_counted() -> None:
    """Always long at 10 bp on zero returns: entry and exit (at the symbol's last bar, outside the mask) both count
    in reward per bar, turnover and trades, and total == the sum of the counted per-bar P&L."""
    ret = torch.zeros(10, dtype=torch.float64)
    ret[-1] = float("nan")
    m = trading_metrics(torch.ones(10), ret, 10.0, 252.0)
    assert m.total_log_return.item() == pytest.approx(2 * math.log1p(-1e-3), rel=1e-12)
    assert m.reward_per_bar.item() * m.n_bars.item() == pytest.approx(2 * math.log1p(-1e-3), rel=1e-12)
    assert m.n_trades.item() == 2 and m.turnover.item() * 9 == pytest.approx(2.0)
    counted = counted_log_returns(torch.ones(10), ret, 10.0)
    assert counted.tolist() == [math.log1p(-1e-3)] + [0.0] * 7 + [math.log1p(-1e-3), 0.0]


def test_counted_log_returns_match_a_loop_with_holes_symbols_and_a_batch() -> None:
    rng = np.random.default_rng(3)
    n = 40
    ret = rng.normal(0, 0.02, n)
    reset = np.zeros(n, bool)
    reset[[0, 17, 30]] = True
    mask = np.ones(n, bool)
    mask[[5, 6, 16, 17, 18, 29, 39]] = False  # holes, a symbol's last bar, a symbol's first bars
    ret[[16, 29, 39]] = np.nan
    pos = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], (4, n))
    c = 3e-4
    got = counted_log_returns(torch.from_numpy(pos), torch.from_numpy(ret), 3.0, torch.from_numpy(mask),
                              torch.from_numpy(reset))
    m = trading_metrics(torch.from_numpy(pos), torch.from_numpy(ret), 3.0, 100.0, torch.from_numpy(mask),
                        torch.from_numpy(reset))
    moved = 0
    for i in range(4):
        pnl, chg, trades = loop_counted(pos[i], ret, mask, reset, c)
        np.testing.assert_allclose(got[i].numpy(), pnl, rtol=0, atol=1e-15)
        uncounted = strategy_log_returns(torch.from_numpy(np.where(mask, pos[i], 0.0)), torch.from_numpy(ret), 3.0,
                                         torch.from_numpy(reset))
        assert got[i].sum().item() == pytest.approx(uncounted.sum().item(), abs=1e-15)  # nothing lost or added
        assert m.total_log_return[i].item() == pytest.approx(pnl.sum(), abs=1e-14)
        assert m.reward_per_bar[i].item() == pytest.approx(pnl[mask].mean(), abs=1e-15)
        x = pnl[mask]
        assert m.sharpe[i].item() == pytest.approx(x.mean() / x.std(ddof=1) * 10.0, rel=1e-12)
        assert m.turnover[i].item() == pytest.approx(chg[mask].mean(), abs=1e-15)
        traded = counted_position_changes(torch.from_numpy(pos[i]), torch.from_numpy(mask), torch.from_numpy(reset))
        np.testing.assert_allclose(traded.numpy(), chg, rtol=0, atol=1e-15)
        assert m.n_trades[i].item() == int(trades.sum())
        moved += int((uncounted.numpy()[~mask] != 0).sum())
    assert moved > 0  # the case exercised exits at excluded bars


@pytest.mark.parametrize(
    ("positions", "returns"),
    [
        ([1.0] * 50, [0.001] * 50),  # a constant P&L: its spread is rounding, so it has no Sharpe
        ([0.0] * 50, [0.003, -0.002] * 25),  # a flat book: Sharpe 0, and nothing to test
        ([1.0, 1.0], [0.01, -0.02]),  # two bars: too few for a Sharpe
        ([1.0, -1.0, 1.0, 0.0] * 10, [0.002, -0.001, 0.004, 0.0] * 10),  # an ordinary series
    ],
    ids=["constant", "flat", "two-bars", "ordinary"],
)
def test_trading_metrics_sharpe_is_the_significance_tables_sharpe(positions, returns) -> None:
    """The back-test table's Sharpe (trading_metrics) and its SE / PSR columns (sharpe_summary) come from one rule:
    a constant P&L gave a Sharpe of ~1e14 (a ratio of rounding errors) and 2 bars a Sharpe, where significance has
    none."""
    pos = torch.tensor(positions, dtype=torch.float64)
    ret = torch.tensor(returns, dtype=torch.float64)
    m = trading_metrics(pos, ret, 0.0, 252.0)
    pnl = counted_log_returns(pos, ret, 0.0)
    s = sharpe_summary(pnl, 252.0, n_boot=20)
    got, want = float(m.sharpe), s["sharpe"]
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-9), (got, want)
    if not math.isfinite(want):
        assert math.isnan(s["sharpe_se"]) and math.isnan(s["psr_vs_flat"])


def test_a_flat_book_has_sharpe_zero_and_no_statistics_and_a_constant_pnl_none() -> None:
    flat = sharpe_summary(torch.zeros(100, dtype=torch.float64), 252.0, n_boot=20)
    assert flat["sharpe"] == 0.0
    assert all(math.isnan(flat[k]) for k in ("sharpe_se", "sharpe_ci_low", "sharpe_ci_high", "psr_vs_flat"))
    const = trading_metrics(torch.ones(100), torch.full((100,), 0.001, dtype=torch.float64), 0.0, 252.0)
    assert math.isnan(float(const.sharpe))  # not mean / (rounding noise)
    assert float(const.reward_per_bar) == pytest.approx(0.001, rel=1e-12)  # the other figures stay
    batch = trading_metrics(torch.stack([torch.zeros(100), torch.ones(100)]), torch.full((100,), 0.001), 0.0, 252.0)
    assert float(batch.sharpe[0]) == 0.0 and math.isnan(float(batch.sharpe[1]))
