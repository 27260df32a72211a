"""Back-test metrics: hand-computed cases, batching, masks and resets, and a loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from foxhunt.evaluation.trading import (
    bars_per_year,
    position_changes,
    strategy_log_returns,
    trading_metrics,
)


def test_hand_computed_series() -> None:
    pos = torch.tensor([1.0, 1.0, -1.0, 0.0])
    ret = torch.tensor([0.01, -0.02, -0.01, 0.05])
    m = trading_metrics(pos, ret, cost_bps=10.0, bars_per_year=4.0)
    c = 1e-3
    pnl = torch.tensor([0.01 - c, -0.02, 0.01 - 2 * c, 0.0 - c], dtype=torch.float64)
    assert torch.allclose(strategy_log_returns(pos, ret, 10.0).double(), pnl.float().double(), atol=1e-7)
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
            pnl.append(p * r - 2e-4 * abs(p - prev))
            prev = p
        assert row.total_log_return.item() == pytest.approx(sum(pnl), abs=1e-9)


def test_flat_policy_and_costs() -> None:
    ret = torch.randn(100) * 1e-3
    flat = trading_metrics(torch.zeros(100), ret, 1.0, 252.0)
    assert flat.reward_per_bar.item() == 0 and flat.turnover.item() == 0 and flat.sharpe.item() == 0
    assert math.isnan(flat.hit_rate.item()) and flat.max_drawdown.item() == 0
    # Churning loses exactly the cost of the flips on a zero-return market.
    churn = trading_metrics(torch.tensor([1.0, -1.0] * 50), torch.zeros(100), 1.0, 252.0)
    assert churn.total_log_return.item() == pytest.approx(-(1 + 2 * 99) * 1e-4)


def test_mask_and_reset() -> None:
    pos = torch.tensor([1.0, 1.0, 1.0, 1.0])
    ret = torch.tensor([0.01, 0.01, float("nan"), 0.01])
    # NaN returns are excluded by default and the position is closed there (a cost is paid at the masked bar).
    m = trading_metrics(pos, ret, 10.0, 1.0)
    assert m.n_bars.item() == 3
    assert m.n_trades.item() == 2  # open at bar 0, re-open at bar 3 (the close at bar 2 is outside the mask)
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
