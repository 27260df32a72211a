"""foxhunt.quality.agents: the benchmark markets' causal features."""

from __future__ import annotations

import pytest


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
