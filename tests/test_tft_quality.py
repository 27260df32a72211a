"""TFT quality on the synthetic market against its exact oracle (small fixed-seed version of scripts/tft_quality.py)."""

from __future__ import annotations

import pytest
import torch


def _quality_module():  # type: ignore[no-untyped-def]
    from foxhunt.quality import forecasters as forecaster_quality

    return forecaster_quality


def test_features_and_targets_are_causal() -> None:
    """A longer market (same seed: same early bars, more future) leaves every train-row input and target unchanged."""
    q = _quality_module()
    short = q.build_quality_data(6000, seed=3, lookback=16, horizon=2, fractions=(0.98, 0.01))
    long = q.build_quality_data(9000, seed=3, lookback=16, horizon=2, fractions=(0.98, 0.01))
    s, lg = short.splits["train"], long.splits["train"]
    n = len(s)
    raw_s = short.normalizer.inverse(s.features)
    raw_l = long.normalizer.inverse(lg.features[:n])
    torch.testing.assert_close(raw_s, raw_l, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(short.target_scale["train"], long.target_scale["train"][:n])
    torch.testing.assert_close(s.targets, lg.targets[:n], equal_nan=True)
    torch.testing.assert_close(s.valid, lg.valid[:n])


def test_features_of_a_short_market_do_not_read_past_its_warm_up() -> None:
    """Markets shorter than 2,000 bars too: the volatility seed comes from the warm-up bars only (it was the mean square
    of the first 2,000 returns, so every early row read returns after it)."""
    q = _quality_module()
    short = q.build_quality_data(1200, seed=5, lookback=16, horizon=2, fractions=(0.98, 0.01))
    long = q.build_quality_data(4000, seed=5, lookback=16, horizon=2, fractions=(0.98, 0.01))
    s, lg = short.splits["train"], long.splits["train"]
    n = len(s)
    assert n > 1000
    torch.testing.assert_close(short.normalizer.inverse(s.features), long.normalizer.inverse(lg.features[:n]),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(short.target_scale["train"], long.target_scale["train"][:n])


def test_tft_close_to_oracle_small() -> None:
    """30k bars, 200 steps (~10-30 s on 2 shared cores): quantile loss near the oracle's and calibrated coverage."""
    torch.set_num_threads(1)
    q = _quality_module()
    data = q.build_quality_data(30_000, seed=0, lookback=24, horizon=2)
    module, _ = q.train(data, steps=200, batch_size=128, seed=0, hidden_size=16, attention_heads=2,
                        hidden_continuous_size=8, optim={"lr": 3e-3, "warmup_steps": 20})
    report = q.evaluate(module, data, "test")
    assert report["rows"] > 4000
    # The no-skill forecast (train quantiles) is only ~5% worse than the oracle here, so the loss bound is stated as
    # the share of that gap the TFT closes (it must learn volatility and the planted mean, not just the marginal).
    assert report["unconditional_loss_ratio"] > 1.03, report
    assert report["loss_ratio"] < 1.04, report
    assert report["gap_closed"] > 0.3, report
    assert abs(report["tft_coverage"] - 0.80) < 0.03, report
    assert abs(report["oracle_coverage"] - 0.80) < 0.03, report


@pytest.mark.slow
def test_tft_quality_full() -> None:
    """The issue's bound: within 5% of the oracle's quantile loss and 0.80 +- 0.03 coverage (200k bars, ~5-15 min).

    The no-skill forecast is itself within ~3-5% here, so also require most of that gap closed (measured: 0.84).
    """
    torch.set_num_threads(1)
    q = _quality_module()
    data = q.build_quality_data(200_000, seed=0, lookback=32, horizon=6)
    module, _ = q.train(data, steps=800, batch_size=128, seed=0, hidden_size=16,
                        optim={"lr": 3e-3, "warmup_steps": 80})
    report = q.evaluate(module, data, "test")
    assert report["loss_ratio"] <= 1.05, report
    assert report["gap_closed"] > 0.6, report
    assert abs(report["tft_coverage"] - 0.80) <= 0.03, report
