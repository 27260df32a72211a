"""Audit of the coordinator, the shared training code and the metrics: each test pins one defect that was fixed."""

from __future__ import annotations

import math

import pytest
import torch

from foxhunt.evaluation.significance import sharpe_summary
from foxhunt.evaluation.trading import counted_log_returns, trading_metrics


# ------------------------------------------------------------------------------ trading_metrics against significance
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


# ------------------------------------------------------------------------------ one annualisation for every split
def test_every_split_and_the_reloaded_export_annualise_with_the_training_density(tmp_path) -> None:
    """With ``bars_per_year`` unset each split annualised with its own bar density, which on a short split moves
    with the weekends inside it (validation and test Sharpes on different scales); the coordinator infers it once,
    from the training split, records it, and the reloaded export annualises the same way."""
    import foxhunt
    from foxhunt.evaluation.backtest import policy_pnl
    from foxhunt.evaluation.trading import bars_per_year
    from foxhunt.export.write import export_ensemble
    from foxhunt.lit.ensemble import EnsembleModule
    from foxhunt.lit.tft import TFTModule
    from tests.test_ensemble import datamodule, fit

    dm = datamodule()
    tft = TFTModule(hidden_size=8, hidden_continuous_size=4, attention_heads=2, lr=3e-3, scheduler="none",
                    policy_interval=(0.5, 0.5))
    model = EnsembleModule(members={"tft": tft}, combine="vote", min_edge_confidence=None)
    fit(model, dm, tmp_path, max_epochs=1, limit_train_batches=2)
    train, test = model.split("train"), model.split("test")
    bpy = bars_per_year(train.timestamps, train.symbol_index)
    assert model.hparams.bars_per_year == pytest.approx(bpy, rel=1e-12)
    own = bars_per_year(test.timestamps, test.symbol_index)
    assert abs(own / bpy - 1.0) > 1e-3  # the test split's own density differs: the choice of annualisation shows
    table = model.evaluate(test).metrics
    pnl = policy_pnl(model.positions(test)["buy_and_hold"], test, model.hparams.cost_bps)
    want = float(pnl.mean() / pnl.std() * math.sqrt(bpy))
    assert table["buy_and_hold"]["sharpe"] == pytest.approx(want, rel=1e-9)
    export_ensemble(model, dm, tmp_path / "export")
    loaded = foxhunt.load(tmp_path / "export")
    assert loaded.model.hparams.bars_per_year == pytest.approx(bpy, rel=1e-12)
    assert loaded.model.evaluate(test).metrics["buy_and_hold"]["sharpe"] == pytest.approx(want, rel=1e-9)
