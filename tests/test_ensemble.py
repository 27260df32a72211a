"""The coordinator over any set of members: two forecasters and two agents train, validate, export, reload, back-test."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import foxhunt
from foxhunt.data.datamodule import BarDataModule
from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.evaluation.significance import hac_psr, null_max_sharpe, psr_from_moments, sharpe_moments
from foxhunt.export.write import export_ensemble
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.member import Agent, Forecaster
from foxhunt.lit.tft import TFTModule
from foxhunt.quality import agents as quality
from foxhunt.trading.pnl import strategy_log_returns

FEATURES = ["logret_1", "logret_2", "logret_5", "rsi_14", "std_logret_20", "tod_sin", "tod_cos"]


def datamodule() -> BarDataModule:
    return BarDataModule(synthetic_bars=4000, signal_strength=0.3, features=FEATURES, known_future=["tod_sin", "tod_cos"],
                         lookback=8, horizon=2, batch_size=32, eval_batch_size=256, cache_dir=None)


def four_members() -> dict:
    """Two TFTs of different sizes and two DQNs with different windows."""
    tft = {"attention_heads": 2, "policy_interval": (0.5, 0.5),
           "optim": {"lr": 3e-3, "scheduler": "none", "log_grad_norm_every": 2}}
    dqn = {"n_envs": 16, "episode_length": 32, "batch_size": 32, "replay_capacity": 2048, "learning_starts": 128,
           "epsilon_steps": 20, "optim": {"updates_per_step": 2, "start_step": 3, "log_grad_norm_every": 2}}
    return {
        "tft_small": TFTModule(hidden_size=8, hidden_continuous_size=4, **tft),
        "tft_large": TFTModule(hidden_size=16, hidden_continuous_size=8, **tft),
        "dqn_short": DQNModule(window=4, hidden=(16,), seed=1, **dqn),
        "dqn_long": DQNModule(window=8, hidden=(32, 16), seed=2, **dqn),
    }


def fit(model: EnsembleModule, dm: BarDataModule, tmp_path: Path, **kw) -> pl.Trainer:
    args = {"accelerator": "cpu", "max_epochs": 2, "limit_train_batches": 6, "limit_val_batches": 2,
            "num_sanity_val_steps": 0, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
            "enable_model_summary": False, "log_every_n_steps": 2, "default_root_dir": str(tmp_path)}
    args.update(kw)
    trainer = pl.Trainer(**args)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, datamodule=dm)
    return trainer


@pytest.mark.parametrize("combine", ["sharpe_weighted", "vote", "stack"])
def test_two_forecasters_two_agents_train_export_reload_and_backtest(tmp_path: Path, combine: str) -> None:
    dm = datamodule()
    model = EnsembleModule(members=four_members(), combine=combine, cost_bps=0.5)
    fit(model, dm, tmp_path)
    assert model.forecaster_names == ["tft_small", "tft_large"] and model.agent_names == ["dqn_short", "dqn_long"]
    # every member trained at its own pace: forecasters from the first step, agents after their start step
    steps = model.steps
    assert steps == 12
    assert model.updates["tft_small"] == model.updates["tft_large"] == steps
    assert model.updates["dqn_short"] == model.updates["dqn_long"] == 2 * (steps - 3)
    assert model.member("dqn_long").q_net.n_features == model.member("dqn_short").q_net.n_features
    if combine == "stack":  # each agent observes both forecasters' standardised quantiles (2 x H x Q extra columns)
        assert model.member("dqn_short").train_split.n_features == len(FEATURES) + 2 * 2 * 3
    # hyperparameters are what the config said: data-derived sizes live in plain attributes
    assert model.member("tft_small").hparams.n_features is None and model.member("dqn_short").hparams.n_features is None
    evaluation = model.last_evaluation
    assert evaluation is not None and {"ensemble", "buy_and_hold", "oracle", *model.member_names} <= set(evaluation.metrics)
    # validation chose the weights (sharpe_weighted): positive validation Sharpe only, summing to 1 or all zero
    w = model.weights.tolist()
    assert all(x >= 0 for x in w) and (abs(sum(w) - 1) < 1e-6 or sum(w) == 0)

    meta = export_ensemble(model, dm, tmp_path / "export")
    assert set(meta["members"]) == set(model.member_names)
    assert {f"{n}.safetensors" for n in model.member_names} <= {p.name for p in (tmp_path / "export").iterdir()}
    loaded = foxhunt.load(tmp_path / "export")
    test = model.split("test")
    mine, theirs = model.positions(test), loaded.model.positions(test)
    assert set(mine) == set(theirs)
    for who in mine:
        torch.testing.assert_close(theirs[who].cpu(), mine[who].cpu(), msg=f"{who} positions differ after reload")
    table = loaded.backtest(dm.bars)
    assert {"ensemble", "buy_and_hold", *model.member_names} <= set(table)
    assert all(k in table["ensemble"] for k in ("sharpe", "sortino", "max_drawdown", "turnover", "n_trades"))


def test_member_protocol_kinds_and_binding() -> None:
    tft, dqn = TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4), DQNModule(window=3, hidden=(8,))
    assert isinstance(tft, Forecaster) and tft.kind == "forecaster" and isinstance(dqn, Agent) and dqn.kind == "agent"
    with pytest.raises(RuntimeError, match="bind it"):
        _ = tft.network
    spec = MarketSpec(["a", "b", "c"], ["c"], ["S0"], lookback=6, horizon=2)
    before = dict(tft.hparams)
    tft.bind(spec)
    dqn.bind(spec, extra_inputs=4, cost_bps=2.0)
    assert dict(tft.hparams) == before  # binding writes no hyperparameter
    assert tft.horizon == 2 and dqn.n_inputs == 7 and dqn.cost_bps == 2.0
    assert DQNModule(window=3, cost_bps=0.3).cost_bps == 0.3  # a member's own cost wins over the coordinator's
    with pytest.raises(ValueError, match="configured with lookback=9"):
        TFTModule(n_features=3, n_known_future=1, lookback=9, horizon=2, hidden_size=8, attention_heads=2).bind(spec)


def test_coordinator_rejects_bad_member_sets() -> None:
    with pytest.raises(ValueError, match="at least one member"):
        EnsembleModule(members={})
    with pytest.raises(TypeError, match="not a Forecaster or an Agent"):
        EnsembleModule(members={"net": torch.nn.Linear(2, 2)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="needs at least one forecaster and one agent"):
        EnsembleModule(members={"dqn": DQNModule()}, combine="stack")
    with pytest.raises(ValueError, match="identifier"):
        EnsembleModule(members={"my dqn": DQNModule()})


def test_nonfinite_member_loss_is_skipped_and_counted_without_touching_the_others(tmp_path: Path) -> None:
    """One member's NaN loss (policy "skip") skips that member's update only; the other member still learns."""
    members = four_members()
    members = {"tft": members["tft_small"], "dqn": DQNModule(window=4, hidden=(16,), n_envs=16, episode_length=32,
                                                              batch_size=32, replay_capacity=2048, learning_starts=128,
                                                              optim={"updates_per_step": 1, "nonfinite": "skip"})}
    model = EnsembleModule(members=members, combine="vote")
    dqn = model.member("dqn")
    real = dqn.training_loss

    def poisoned(batch, update):  # every other DQN update is NaN
        loss = real(batch, update)
        return loss * float("nan") if update % 2 else loss

    dqn.training_loss = poisoned  # type: ignore[method-assign]
    dm = datamodule()
    dm.setup()
    model.bind(dm.spec)  # binding twice to the same data keeps the networks
    before = {k: v.clone() for k, v in model.member("tft").network.state_dict().items()}
    fit(model, dm, tmp_path, max_epochs=1)
    assert dqn.guard.skipped > 0 and model.updates["dqn"] + dqn.guard.skipped == model.steps
    assert model.updates["tft"] == model.steps
    after = model.member("tft").network.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_export_metadata_names_members_and_spec(tmp_path: Path) -> None:
    dm = datamodule()
    members = four_members()
    model = EnsembleModule(members={"tft": members["tft_small"], "dqn": members["dqn_short"]}, combine="vote")
    fit(model, dm, tmp_path, max_epochs=1)
    meta = export_ensemble(model, dm, tmp_path / "x")
    on_disk = json.loads((tmp_path / "x" / "metadata.json").read_text())
    assert on_disk == json.loads(json.dumps(meta))
    assert on_disk["members"]["tft"]["class_path"] == "foxhunt.lit.tft.TFTModule"
    assert on_disk["spec"]["feature_names"] == FEATURES and on_disk["spec"]["lookback"] == 8
    assert on_disk["members"]["dqn"]["run"]["cost_bps"] == 1.0


def test_a_member_that_would_never_train_is_refused_before_training(tmp_path: Path) -> None:
    members = four_members()
    late = DQNModule(window=4, hidden=(16,), n_envs=16, episode_length=32, batch_size=32, replay_capacity=2048,
                     learning_starts=128, optim={"start_step": 50})
    model = EnsembleModule(members={"tft": members["tft_small"], "dqn": late}, combine="vote")
    with pytest.raises(ValueError, match=r"model\.members\.dqn\.init_args\.optim\.start_step: 50, but this fit runs 6 "
                                         r"coordinator steps .*member 'dqn' would never train; use at most 5"):
        fit(model, datamodule(), tmp_path, max_epochs=1)
    assert model.updates == {"tft": 0, "dqn": 0}


def test_settings_that_outlast_the_run_are_named_and_untrained_members_marked(tmp_path: Path) -> None:
    from foxhunt.evaluation.backtest import format_table

    dqn = DQNModule(window=4, hidden=(16,), n_envs=16, episode_length=32, batch_size=32, replay_capacity=2048,
                    learning_starts=128, optim={"updates_per_step": 1}, epsilon_steps=10_000)
    model = EnsembleModule(members={"tft": four_members()["tft_small"], "dqn": dqn}, combine="vote")
    with pytest.warns(UserWarning, match=r"member 'dqn': epsilon_steps=10000 exceeds the 6 updates"):
        fit(model, datamodule(), tmp_path, max_epochs=1)
    metrics = model.evaluate(model.split("test")).metrics
    assert metrics["dqn"]["updates"] == 6
    metrics["dqn"]["updates"] = 0.0  # as a member that never stepped would be
    table = format_table(metrics, split="test")
    assert table.splitlines()[0] == "split: test" and "dqn (untrained)" in table and "tft (untrained)" not in table


def test_an_empty_validation_split_is_refused_before_training() -> None:
    dm = BarDataModule(synthetic_bars=600, features=FEATURES, known_future=["tod_sin", "tod_cos"], lookback=64, horizon=8,
                       cache_dir=None, val_fraction=0.05)
    with pytest.raises(ValueError, match=r"the val split has no complete window of lookback 64 \+ horizon 8 bars"):
        dm.setup()


def test_a_member_max_steps_leaves_no_step_is_refused_before_training(tmp_path: Path) -> None:
    """max_steps counts every member's updates: the TFT's ten updates end the fit before the DQN's start step."""
    late = DQNModule(window=4, hidden=(16,), n_envs=16, episode_length=32, batch_size=32, replay_capacity=2048,
                     learning_starts=128, optim={"start_step": 12})
    model = EnsembleModule(members={"tft": four_members()["tft_small"], "dqn": late}, combine="vote")
    with pytest.raises(ValueError, match=r"model\.members\.dqn\.init_args\.optim\.start_step: 12, but this fit runs 10 "
                                         r"coordinator steps \(trainer\.max_steps 10 counts the updates of every member "
                                         r"together\): member 'dqn' would never train; use at most 9"):
        fit(model, datamodule(), tmp_path, max_steps=10, max_epochs=-1)


# ------------------------------------------------------------------------------------- do no harm: the candidates
def stubbed_forecaster(monkeypatch: pytest.MonkeyPatch) -> tuple[EnsembleModule, TFTModule, dict]:
    """A coordinator with one forecaster whose policy's positions are ``script["pos"]`` (no costs), so each
    validation's P&L is the test's to choose."""
    tft = TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4)
    monkeypatch.setattr(tft, "forecast", lambda split, batch_size=2048, net=None, rows=None: torch.zeros(len(split), 1, 3))
    script: dict = {}
    model = EnsembleModule(members={"tft": tft}, cost_bps=0.0)
    # a policy table whose every row takes the scripted position, whatever is held (index = position + 1)
    monkeypatch.setattr(model, "forecast_table",
                        lambda *args: (script["pos"].long() + 1)[:, None].expand(-1, 3))
    return model, tft, script


def long_or_flat(split: MarketSplit, q: float, seed: int) -> torch.Tensor:
    """Long before a rise and flat before a fall with probability q, the other way round otherwise (0.5: no edge)."""
    u = torch.rand(len(split), generator=torch.Generator().manual_seed(seed))
    up = split.returns > 0
    return torch.where(u < q, up, ~up).float() * split.valid.float()


def confidence(split: MarketSplit, pos: torch.Tensor, n_candidates: int) -> float:
    """The rule's confidence, by hand, for one symbol: the HAC PSR of its counted P&L against the null's best."""
    pnl = strategy_log_returns(pos, split.returns, 0.0, split.first_bar)[split.valid & torch.isfinite(split.returns)]
    return hac_psr(pnl, null_max_sharpe(n_candidates, pnl.numel()))


def stacked_confidence(pnl: torch.Tensor, n_candidates: int) -> float:
    """The rule before issue 45: the i.i.d. PSR of the bars of every symbol stacked one after another."""
    m = sharpe_moments(pnl)
    return psr_from_moments(m.sr_per_bar, m.n_bars, m.skew, m.kurtosis, null_max_sharpe(n_candidates, m.n_bars))


def twice(split: MarketSplit) -> MarketSplit:
    """Two symbols with the same bars at the same times (correlation 1): a book of two is the one symbol again."""
    n = len(split)
    symbol = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)])
    return MarketSplit(split.name, ["A", "B"], split.timestamps.repeat(2), symbol, split.ohlcv.repeat(2, 1),
                       split.returns.repeat(2), split.targets.repeat(2), split.valid.repeat(2))


@pytest.fixture(scope="module")
def martingale_val() -> MarketSplit:
    return quality.ar1_market(n_bars=20_000, phi=0.0, seed=3).val


@pytest.fixture(scope="module")
def lucky(martingale_val: MarketSplit) -> torch.Tensor:
    """Positions whose validation edge passes the rule as one candidate (PSR >= 0.97), not as the best of ten."""
    for k in range(60):
        pos = long_or_flat(martingale_val, 0.5 + 0.002 * k, seed=0)
        if confidence(martingale_val, pos, 1) >= 0.97 and confidence(martingale_val, pos, 10) <= 0.85:
            return pos
    raise AssertionError("no q in the grid gives the edge the test needs")


def test_a_forecasters_candidates_are_its_validations(monkeypatch, martingale_val, lucky) -> None:
    """A forecaster is compared on validation at every validation of the fit: the rule deflates its edge for the
    number of validations, so the same policy that passes as the first candidate is held flat as the tenth."""
    model, tft, script = stubbed_forecaster(monkeypatch)
    script["pos"] = lucky
    model.evaluate(martingale_val, choose_weights=True)  # the first validation
    assert len(tft.selection_sharpes()) == 1 and not bool(model.held_flat[0])
    assert float(model.edge_confidence[0]) == pytest.approx(confidence(martingale_val, lucky, 1), abs=0.01)
    for _ in range(9):
        model.evaluate(martingale_val, choose_weights=True)
    assert len(tft.selection_sharpes()) == 10 and bool(model.held_flat[0])
    assert float(model.edge_confidence[0]) == pytest.approx(confidence(martingale_val, lucky, 10), abs=0.01)
    assert tft.selection_sharpes()[0] == pytest.approx(tft.selection_sharpes()[-1])  # the same policy each time
    model.evaluate(martingale_val)  # a report (or the sanity check) compares nothing
    model.evaluate(martingale_val, recheck_flat=True)  # nor does the rule applied again
    assert len(tft.selection_sharpes()) == 10 and tft.run_state()["validation_sharpes"] == tft.selection_sharpes()


def test_do_no_harm_judges_the_book_not_the_stacked_bars(monkeypatch, martingale_val) -> None:
    """Issue 45: on two symbols whose bars are the same (correlation 1) the book is the one symbol's P&L; stacking
    them doubles the bars and, read as independent, clears an edge that one symbol does not. The rule now judges the
    book's per-timestamp P&L with the HAC PSR: the same decision and confidence as on one symbol."""
    both = twice(martingale_val)
    for k in range(40):
        pos = long_or_flat(martingale_val, 0.5 + 0.001 * k, seed=1)
        pnl = strategy_log_returns(pos, martingale_val.returns, 0.0, martingale_val.first_bar)[martingale_val.valid]
        if confidence(martingale_val, pos, 1) < 0.94 and stacked_confidence(torch.cat([pnl, pnl]), 1) > 0.97:
            break
    else:
        raise AssertionError("no q in the grid gives the edge the test needs")
    model, _, script = stubbed_forecaster(monkeypatch)
    script["pos"] = torch.cat([pos, pos])
    model.evaluate(both, choose_weights=True)
    assert bool(model.held_flat[0])  # the stacked bars would have passed it (> 0.97)
    assert float(model.edge_confidence[0]) == pytest.approx(confidence(martingale_val, pos, 1), rel=1e-6)  # float32
    alone, _, script = stubbed_forecaster(monkeypatch)
    script["pos"] = pos
    alone.evaluate(martingale_val, choose_weights=True)
    assert float(alone.edge_confidence[0]) == pytest.approx(float(model.edge_confidence[0]), rel=1e-6)
    assert bool(alone.held_flat[0])


def test_the_export_of_the_best_validation_is_held_to_the_runs_candidates(monkeypatch, martingale_val, lucky) -> None:
    """e4: a forecaster without edge over ten validations; the first is lucky and passes as one candidate, so its
    checkpoint has the best validation Sharpe and is exported. Loaded, it keeps the run's ten candidates, and the
    rule applied again holds it flat, without choosing the ensemble's weights again."""
    model, tft, script = stubbed_forecaster(monkeypatch)
    checkpoints, sharpes = [], []
    for epoch in range(10):
        script["pos"] = lucky if epoch == 0 else long_or_flat(martingale_val, 0.5, seed=100 + epoch)
        model.updates["tft"] = model.steps = 6 * (epoch + 1)
        sharpe = model.evaluate(martingale_val, choose_weights=True).metrics["ensemble"]["sharpe"]
        sharpes.append(-math.inf if math.isnan(sharpe) else sharpe)
        checkpoint = {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}}
        model.on_save_checkpoint(checkpoint)
        checkpoints.append(checkpoint)
    best = max(range(10), key=sharpes.__getitem__)  # ModelCheckpoint(monitor="val/sharpe", mode="max")
    assert best == 0 and checkpoints[0]["ensemble_state"]["candidates"] == {"tft": 1}
    assert not bool(checkpoints[0]["state_dict"]["held_flat"][0])  # decided with the candidates up to its epoch

    model.load_weights(checkpoints[best])
    assert model.updates == {"tft": 6} and model.steps == 6  # the counts of the weights loaded
    assert model.candidate_counts() == {"tft": 10} and not bool(model.held_flat[0])
    weights = model.weights.clone()
    assert float(weights[0]) == 1.0
    script["pos"] = lucky  # the exported epoch's policy
    evaluation = model.evaluate(martingale_val, recheck_flat=True)
    assert bool(model.held_flat[0]) and float(evaluation.positions["tft"].abs().sum()) == 0.0
    assert float(model.edge_confidence[0]) == pytest.approx(confidence(martingale_val, lucky, 10), abs=0.01)
    assert torch.equal(model.weights, weights) and len(tft.selection_sharpes()) == 10
    assert model.recheck_edges(martingale_val).metrics["tft"]["held_flat"] == 1.0

    # a coordinator that did not run the fit takes the count the checkpoint recorded, and keeps the larger one
    fresh, _, script = stubbed_forecaster(monkeypatch)
    fresh.load_weights(checkpoints[-1])
    fresh.load_weights(checkpoints[0])
    assert fresh.candidate_counts() == {"tft": 10}


def test_the_best_checkpoint_brings_its_update_counts_and_the_runs_candidates(tmp_path: Path) -> None:
    """The exported checkpoint's weights come with its own update counts (an untrained DQN is marked untrained);
    every validation (not the sanity check) is a candidate of the TFT and of a DQN that does not choose its weights,
    saved in the checkpoint's run state for a resume; loading keeps the run's counts."""
    from foxhunt.evaluation.backtest import format_table

    dqn = DQNModule(window=4, hidden=(16,), n_envs=16, episode_length=32, batch_size=32, replay_capacity=2048,
                    learning_starts=128, epsilon_steps=20, optim={"updates_per_step": 2, "start_step": 7},
                    select_every=0)
    tft = four_members()["tft_small"]
    model = EnsembleModule(members={"tft": tft, "dqn": dqn}, combine="vote")
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", filename="{epoch}", save_top_k=-1)
    fit(model, datamodule(), tmp_path, max_epochs=3, num_sanity_val_steps=1, enable_checkpointing=True, callbacks=[saver])
    assert model.updates == {"tft": 18, "dqn": 2 * (18 - 7)} and model.steps == 18
    assert len(tft.selection_sharpes()) == len(dqn.selection_sharpes()) == 3

    first = torch.load(tmp_path / "ck" / "epoch=0.ckpt", map_location="cpu", weights_only=True)
    state = first["ensemble_state"]
    assert state["updates"] == {"tft": 6, "dqn": 0} and state["steps"] == 6 and state["candidates"] == {"tft": 1, "dqn": 1}
    assert state["members"]["tft"]["validation_sharpes"] == pytest.approx(tft.selection_sharpes()[:1], nan_ok=True)
    model.load_weights(first)
    assert model.updates == {"tft": 6, "dqn": 0} and model.steps == 6
    assert model.candidate_counts() == {"tft": 3, "dqn": 3}
    model.last_evaluation = model.evaluate(model.split("val"), recheck_flat=True)
    assert model.candidate_counts() == {"tft": 3, "dqn": 3} and model.last_evaluation.metrics["dqn"]["updates"] == 0
    table = format_table(model.evaluate(model.split("test")).metrics, split="test")
    assert "dqn (untrained)" in table and "tft (untrained)" not in table

    last = torch.load(tmp_path / "ck" / "epoch=2.ckpt", map_location="cpu", weights_only=True)
    resumed = TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4)
    resumed.load_run_state(last["ensemble_state"]["members"]["tft"])
    assert resumed.selection_sharpes() == pytest.approx(tft.selection_sharpes(), nan_ok=True)
    assert len(resumed.selection_sharpes()) == 3
