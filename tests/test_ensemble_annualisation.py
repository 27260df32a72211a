"""The coordinator annualises every split's Sharpe with the training split's bar density, and its export keeps it."""

from __future__ import annotations

import math

import pytest


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
    tft = TFTModule(hidden_size=8, hidden_continuous_size=4, attention_heads=2, policy_interval=(0.5, 0.5),
                    optim={"lr": 3e-3, "scheduler": "none"})
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
