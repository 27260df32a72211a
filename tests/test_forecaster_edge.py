"""The forecasters trade the edge they forecast (issue 46): the forecast policy's cost-aware holding rule, the linear
skip that lets a TFT or a Mamba-2 find a weak signal, and (slow) the quick start's TFT's fraction of the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from foxhunt.evaluation.policies import forecast_policy
from foxhunt.models.linear_skip import LinearSkip
from foxhunt.models.mamba2 import Mamba2Forecaster
from foxhunt.models.tft import TemporalFusionTransformer

ROOT = Path(__file__).resolve().parents[1]
COST_BPS = 1.0
C = COST_BPS * 1e-4


def _median_policy(median: list[float]) -> list[float]:
    """Positions of the forecast policy trading its median alone (the quick start's policy_interval [0.5, 0.5])."""
    m = torch.tensor(median, dtype=torch.float64)
    decision = torch.ones(len(median), dtype=torch.bool)
    reset = torch.zeros(len(median), dtype=torch.bool)
    reset[0] = True
    return forecast_policy(m, m, m, COST_BPS, decision, reset).tolist()


def test_a_position_is_held_until_the_median_points_against_it_by_more_than_the_cost() -> None:
    """Long on a median above the cost, kept through a median below zero but above -cost (closing would cost the
    cost at once), turned short when the median is below -cost, and kept short while it is below +cost."""
    median = [2 * C, -0.5 * C, -0.9 * C, 0.3 * C, -1.5 * C, 0.5 * C, 0.9 * C, 1.2 * C]
    assert _median_policy(median) == [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0]


def test_a_median_inside_the_cost_never_opens_a_position() -> None:
    """No forecast inside (-cost, cost) is worth its cost: flat throughout."""
    median = [0.99 * C, -0.99 * C, 0.5 * C, 0.0, -0.2 * C]
    assert _median_policy(median) == [0.0] * 5


def test_an_interval_must_clear_the_cost_to_enter_but_the_median_decides_the_exit() -> None:
    """policy_interval (q_lo, q_hi): entry needs q_lo > cost; once long, the median's view decides how long to stay."""
    lower = torch.tensor([2 * C, -5 * C, -5 * C, -5 * C], dtype=torch.float64)
    median = torch.tensor([3 * C, 0.1 * C, -0.5 * C, -2 * C], dtype=torch.float64)
    upper = median + 5 * C
    decision = torch.ones(4, dtype=torch.bool)
    reset = torch.tensor([True, False, False, False])
    assert forecast_policy(lower, median, upper, COST_BPS, decision, reset).tolist() == [1.0, 1.0, 1.0, 0.0]


def _tft(linear_skip: bool) -> TemporalFusionTransformer:
    torch.manual_seed(0)
    return TemporalFusionTransformer(n_features=5, n_known_future=2, n_symbols=2, lookback=8, horizon=3,
                                     hidden_size=8, attention_heads=2, hidden_continuous_size=4, dropout=0.0,
                                     linear_skip=linear_skip)


def _batch(b: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 8, 5, generator=g), torch.randn(b, 3, 2, generator=g), torch.tensor([0, 1] * (b // 2))


def test_the_linear_skip_starts_at_zero_and_reads_only_the_decision_row() -> None:
    """A TFT with the skip starts as the same TFT without it; trained, the skip adds a linear function of row t alone
    (earlier rows change nothing it adds)."""
    plain, skipped = _tft(False).eval(), _tft(True).eval()
    x, k, s = _batch()
    with torch.no_grad():
        torch.testing.assert_close(skipped(x, k, s).prediction, plain(x, k, s).prediction, rtol=0, atol=0)
        torch.nn.init.normal_(skipped.linear_skip.linear.weight)
        torch.nn.init.normal_(skipped.linear_skip.linear.bias)
        added = skipped(x, k, s).prediction - plain(x, k, s).prediction
        earlier = x.clone()
        earlier[:, :-1] += 3.0
        torch.testing.assert_close(skipped.linear_skip(earlier), added, atol=1e-5, rtol=1e-5)
        expected = (x[:, -1] @ skipped.linear_skip.linear.weight.T + skipped.linear_skip.linear.bias).view(6, 3, 3)
        torch.testing.assert_close(added, expected, atol=1e-5, rtol=1e-5)


def test_the_tft_inference_form_adds_the_skip_too() -> None:
    """The cached inference form a live session turns on forecasts what the reference path does, skip included."""
    net = _tft(True).eval()
    torch.nn.init.normal_(net.linear_skip.linear.weight)
    x, k, s = _batch()
    with torch.no_grad():
        reference = net(x, k, s).prediction
        net.cache_inference = True
        cached = net(x, k, s).prediction
    torch.testing.assert_close(cached, reference, atol=1e-5, rtol=1e-5)


def test_the_mamba2_forecaster_takes_the_same_skip() -> None:
    """The Mamba-2 network's output plus the same zero-initialised linear map of row t."""
    torch.manual_seed(0)
    plain = Mamba2Forecaster(5, (3, 4), 2, horizon=3, d_model=8, n_layers=1, d_state=4, headdim=4, native=False).eval()
    torch.manual_seed(0)
    skipped = Mamba2Forecaster(5, (3, 4), 2, horizon=3, d_model=8, n_layers=1, d_state=4, headdim=4, native=False,
                               linear_skip=True).eval()
    assert isinstance(skipped.linear_skip, LinearSkip) and plain.linear_skip is None
    x, _, s = _batch()
    k = x[:, :3, 3:5]
    with torch.no_grad():
        torch.testing.assert_close(skipped(x, k, s).prediction, plain(x, k, s).prediction, rtol=0, atol=0)
        torch.nn.init.normal_(skipped.linear_skip.linear.weight)
        added = skipped(x, k, s).prediction - plain(x, k, s).prediction
    torch.testing.assert_close(added, skipped.linear_skip(x), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_the_quick_start_tft_trades_at_least_half_the_oracle_sharpe(tmp_path: Path) -> None:
    """Learning test (seed 0, the quick start's market, features, cost and TFT, alone in the coordinator): on the test
    split after costs the TFT earns at least half of the oracle's Sharpe and is not held flat (measured 2026-12-07:
    see docs/GUIDE.md's quick-start table). About 3 minutes on a shared 2-core machine."""
    from foxhunt.fit import main

    cfg = yaml.safe_load((ROOT / "lightning_configs" / "quickstart.yaml").read_text())
    members = json.dumps({"tft": cfg["model"]["members"]["tft"]})
    cli = main(["--config", str(ROOT / "lightning_configs" / "quickstart.yaml"), "--model.members", members,
                "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
                "--data.cache_dir", str(tmp_path / "cache")])
    table = cli.results["backtest"]
    tft, oracle = table["tft"], table["oracle"]
    assert not tft["held_flat"], tft
    assert tft["sharpe"] >= 0.5 * oracle["sharpe"], (tft["sharpe"], oracle["sharpe"])
