"""Audit of the agent members' environment (s12): defects found and pinned by a test each."""

from __future__ import annotations

import pytest
import torch

from foxhunt.data.market import MarketSplit
from foxhunt.rl.env import MarketEnv, MarketTensors
from foxhunt.trading.pnl import strategy_log_returns


def make_split(n: int = 200, n_features: int = 3, seed: int = 0) -> MarketSplit:
    g = torch.Generator().manual_seed(seed)
    rets = torch.randn(n, generator=g) * 1e-2
    rets[-1] = float("nan")
    return MarketSplit(
        name="unit", symbols=["S0"], timestamps=torch.arange(n, dtype=torch.int64) * 60_000_000_000,
        symbol_index=torch.zeros(n, dtype=torch.int64), ohlcv=torch.ones(n, 5, dtype=torch.float64), returns=rets,
        targets=rets.clone(), valid=torch.isfinite(rets), features=torch.randn(n, n_features, generator=g),
        feature_names=[f"f{i}" for i in range(n_features)],
    )


def test_an_action_set_without_flat_is_refused() -> None:
    """Episodes start flat and the back-test holds no position before the first bar. Without a 0 action the env took
    the action nearest 0 as "flat": with actions (-1, 1) every episode began short for free, so the first step's
    reward (cost measured from -1) was not the back-test's P&L of the same positions (cost measured from 0)."""
    split = make_split()
    with pytest.raises(ValueError, match="flat"):
        MarketTensors(split, window=4, actions=(-1.0, 1.0), cost_bps=10.0)
    with pytest.raises(ValueError, match="flat"):
        MarketTensors(split, window=4, actions=(-0.5, 0.5, 1.0))
    # with a flat action (anywhere in the tuple) the first step's raw reward is the back-test's, entry cost included
    m = MarketTensors(split, window=4, actions=(1.0, 0.0), cost_bps=10.0)
    assert m.flat_index == 1
    env = MarketEnv(m, n_envs=8, episode_length=10, seed=0)
    env.steps.zero_()  # every agent at the start of an episode
    bars = env.bars.clone()
    tr = env.step(torch.zeros(8, dtype=torch.int64))  # go long
    want = strategy_log_returns(torch.ones(8, 1), split.returns[bars].unsqueeze(1), 10.0).squeeze(1)
    torch.testing.assert_close(tr.raw_rewards, want.float(), rtol=1e-5, atol=1e-8)


def test_the_benchmark_markets_features_never_read_a_later_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """foxhunt.quality.agents' features (ar1_market, generator_market, the DQN's quality script, the agents' learning tests): a
    row's raw features are the same whatever follows it. The volatility EWMA was seeded with the mean square of the
    first 10% of the returns, so every early row read later bars; now the seed is the first bars' and the rows that
    precede them are warm-up."""
    import numpy as np

    from foxhunt.quality import agents as agent_quality

    captured: list[np.ndarray] = []

    def capture(r, expected, raw, names, ts, fractions, purge):  # type: ignore[no-untyped-def]
        captured.append(raw)

    rng = np.random.default_rng(0)
    r = rng.standard_normal(3000) * 1e-3
    r[:200] *= 5.0  # a volatile start: a seed over more bars than the row has seen differs clearly
    monkeypatch.setattr(agent_quality, "split_market", capture)
    for n in (3000, 600):
        agent_quality.splits_from_returns(r[:n].copy(), np.zeros(n), np.arange(n, dtype=np.int64), (0.6, 0.2), 8)
    long, short = captured
    np.testing.assert_array_equal(np.isnan(long[:600]), np.isnan(short))
    ok = ~np.isnan(short)
    np.testing.assert_allclose(long[:600][ok], short[ok], rtol=1e-12, atol=0.0)
    assert ok[:, 2].sum() > 500  # the volatility feature is there after its warm-up
