"""Stacking's forecasts are made once where they can be: the agents' start forecasts their training bars one time."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

from foxhunt.data.datamodule import BarDataModule
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.tft import TFTModule

FEATURES = ["logret_1", "logret_2", "logret_5", "rsi_14", "std_logret_20", "tod_sin", "tod_cos"]


def test_the_agents_start_forecasts_their_training_bars_once_and_they_observe_those_forecasts(tmp_path: Path,
                                                                                             monkeypatch) -> None:
    """The standardisation is fitted on the snapshots' forecasts of the bars after the cut and the agents observe the
    same forecasts: one pass per forecaster (two passes took ~40% of ensemble.yaml's agents' start on CPU), values
    equal to a fresh pass of the frozen snapshots in the same (training step's) mode."""
    dm = BarDataModule(synthetic_bars=3000, signal_strength=0.3, features=FEATURES, known_future=["tod_sin", "tod_cos"],
                       lookback=8, horizon=2, batch_size=32, eval_batch_size=256, cache_dir=None)
    members = {
        "tft": TFTModule(hidden_size=8, hidden_continuous_size=4, attention_heads=2, optim={"scheduler": "none"}),
        "dqn": DQNModule(window=4, hidden=(16,), n_envs=8, episode_length=32, batch_size=16, replay_capacity=1024,
                         learning_starts=32, epsilon_steps=10, optim={"start_step": 2}),
    }
    model = EnsembleModule(members=members, combine="stack", cost_bps=0.5)
    calls: list[int] = []
    forecast = TFTModule.forecast

    def counted(self, split, batch_size=2048, net=None, rows=None):  # noqa: ANN001, ANN202 - the method's own
        if net is not None:  # a snapshot's pass (the live network's are the validation's)
            calls.append(len(split))
        return forecast(self, split, batch_size=batch_size, net=net, rows=rows)

    monkeypatch.setattr(TFTModule, "forecast", counted)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=4, limit_val_batches=0,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, datamodule=dm)
    assert model.started == {"dqn"}
    train, val = model.split("train"), model.split("val")
    post_cut = train.select(~model._stack_cut(train))
    assert calls == [len(post_cut), len(val)]  # the bars after the cut once, then the validation split
    observed = model.agent("dqn").train_split
    again = model.stacked(post_cut)  # grad mode on, no autocast: the training step's mode
    assert observed.feature_names == again.feature_names and observed.n_features == train.n_features + 2 * 3
    assert torch.equal(observed.features, again.features)
    raw = model._raw_stack(post_cut)
    ok = torch.isfinite(raw).all(1)
    assert ok.sum() > 100
    torch.testing.assert_close(model.stack_mean, raw[ok].mean(0), rtol=0, atol=0)
    torch.testing.assert_close(model.stack_std, raw[ok].std(0).clamp_min(1e-12), rtol=0, atol=0)
