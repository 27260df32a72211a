"""Stacking's forecasts are made once where they can be: the agents' start forecasts their training bars one time,
and a whole split's forecasts are made again only when the weights, the modes or the split changed (ForecastMemo)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch

from foxhunt.data.datamodule import BarDataModule
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.tft import TFTModule

FEATURES = ["logret_1", "logret_2", "logret_5", "rsi_14", "std_logret_20", "tod_sin", "tod_cos"]


@pytest.fixture(scope="module")
def stacked_fit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EnsembleModule, list[tuple[str, int]]]]:
    """A stacking coordinator (TFT + DQN) after 4 steps, its agent started at step 2, and the log of the TFT's passes
    ("snapshot" or "live", rows forecast), which goes on recording for the tests."""
    dm = BarDataModule(synthetic_bars=3000, signal_strength=0.3, features=FEATURES, known_future=["tod_sin", "tod_cos"],
                       lookback=8, horizon=2, batch_size=32, eval_batch_size=256, cache_dir=None)
    members = {
        "tft": TFTModule(hidden_size=8, hidden_continuous_size=4, attention_heads=2, optim={"scheduler": "none"}),
        "dqn": DQNModule(window=4, hidden=(16,), n_envs=8, episode_length=32, batch_size=16, replay_capacity=1024,
                         learning_starts=32, epsilon_steps=10, optim={"start_step": 2}),
    }
    model = EnsembleModule(members=members, combine="stack", cost_bps=0.5)
    calls: list[tuple[str, int]] = []
    forecast = TFTModule.forecast

    def counted(self, split, batch_size=2048, net=None, rows=None):  # noqa: ANN001, ANN202 - the method's own
        calls.append(("live" if net is None else "snapshot", len(split) if rows is None else len(rows)))
        return forecast(self, split, batch_size=batch_size, net=net, rows=rows)

    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=4, limit_val_batches=0,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path_factory.mktemp("fit")))
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(TFTModule, "forecast", counted)
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, datamodule=dm)
        yield model, calls


def test_the_agents_start_forecasts_their_training_bars_once_and_they_observe_those_forecasts(stacked_fit) -> None:
    """The standardisation is fitted on the snapshots' forecasts of the bars after the cut and the agents observe the
    same forecasts: one pass per forecaster (two passes took ~40% of ensemble.yaml's agents' start on CPU), values
    equal to a fresh pass of the frozen snapshots in the same (training step's) mode."""
    model, calls = stacked_fit
    assert model.started == {"dqn"}
    train, val = model.split("train"), model.split("val")
    post_cut = train.select(~model._stack_cut(train))
    assert calls[:2] == [("snapshot", len(post_cut)), ("snapshot", len(val))]  # after the cut once, then validation
    observed = model.agent("dqn").train_split
    with torch.enable_grad():
        again = model.stacked(post_cut)  # grad mode on, no autocast: the training step's mode
    assert observed.feature_names == again.feature_names and observed.n_features == train.n_features + 2 * 3
    assert torch.equal(observed.features, again.features)
    with torch.enable_grad():
        raw = model._raw_stack(post_cut)
    ok = torch.isfinite(raw).all(1)
    assert ok.sum() > 100
    torch.testing.assert_close(model.stack_mean, raw[ok].mean(0), rtol=0, atol=0)
    torch.testing.assert_close(model.stack_std, raw[ok].std(0).clamp_min(1e-12), rtol=0, atol=0)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN (a row without a window has no forecast)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_a_whole_split_is_forecast_again_only_when_the_weights_the_mode_or_the_split_changed(stacked_fit) -> None:
    """A second evaluation of the validation split with the same weights makes no pass and gives the same positions;
    new live weights make the live network's pass again (the frozen snapshot's is still reused), and a pass in
    another mode or on another split object is a pass of its own."""
    model, calls = stacked_fit
    val = model.split("val")
    first = model.evaluate(val)
    del calls[:]
    second = model.evaluate(val)
    assert calls == []  # no forward at all: the live TFT's and the snapshot's forecasts were kept
    for who in first.positions:
        assert torch.equal(first.positions[who], second.positions[who]), who
    assert same(first.forecasts["tft"], second.forecasts["tft"]) and first.forecasts["tft"].isfinite().any()
    second.forecasts["tft"].zero_()  # a caller's copy: the kept forecasts are not touched
    assert same(model.evaluate(val).forecasts["tft"], first.forecasts["tft"])

    net = model.forecaster("tft").network
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        next(net.parameters()).add_(0.5)
    del calls[:]
    moved = model.forecasts(val)["tft"]
    assert calls == [("live", len(val))]
    assert not same(moved, first.forecasts["tft"])
    net.load_state_dict(saved)
    del calls[:]
    back = model.forecasts(val)["tft"]
    assert calls == [("live", len(val))] and same(back, first.forecasts["tft"])

    del calls[:]
    model.stacked(val)  # outside no_grad: not the evaluation's mode
    copy = replace(val)  # equal tensors, another split object
    model.forecasts(copy)
    assert calls == [("snapshot", len(val)), ("live", len(val))]
    del calls[:]
    model.forecasts(val, rows=torch.arange(len(val) - 3, len(val)))  # a live bar's rows: never kept
    assert calls == [("live", 3)]
