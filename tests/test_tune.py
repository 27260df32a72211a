"""`python -m foxhunt.tune` on tiny studies: pruning, resume, two workers on one SQLite study, failures, Ctrl-C."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from optuna.trial import TrialState

from foxhunt.tune import (
    SearchParam,
    Terminated,
    TrialSeededSampler,
    TuneConfigError,
    counts_toward_budget,
    decoded_params,
    load_tune_config,
    main,
    run_study,
    set_dotted,
)

CONFIGS = Path(__file__).parent / "configs"
TUNE_TINY = CONFIGS / "tune_tiny.yaml"
ROOT = Path(__file__).resolve().parents[1]


def _config(tmp: Path, name: str = "tune.yaml", fixed: dict[str, Any] | None = None, **changes: Any) -> Path:
    """tune_tiny.yaml with absolute paths into ``tmp`` (runs, SQLite, feature cache) and the given changes."""
    raw = yaml.safe_load(TUNE_TINY.read_text())
    raw["base_config"] = str(CONFIGS / raw["base_config"])
    raw["runs_dir"] = str(tmp / "runs")
    raw["fixed"] = {**raw["fixed"], "data.cache_dir": str(tmp / "cache"), **(fixed or {})}
    raw.update(changes)
    path = tmp / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _study(tmp: Path, name: str = "tune-tiny") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp / 'runs' / 'optuna.db'}")


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    path = _config(tmp)
    assert main(["--config", str(path)]) == 0
    return tmp, path


def test_study_prunes_the_bad_region_logs_each_trial_and_summarises(tiny_study) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _ = tiny_study
    study = _study(tmp)
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert all(counts_toward_budget(t) for t in trials)
    states = [t.state for t in trials]
    assert TrialState.PRUNED in states and TrialState.COMPLETE in states, states
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    for t in trials:
        if t.params["model.members.tft.optim.lr"] > 0.7:  # the deliberately bad region is pruned after its first validation
            assert t.state == TrialState.PRUNED, (t.number, t.params)
        if t.state == TrialState.PRUNED:
            assert "pruned" in t.user_attrs["pruned_reason"]
            first = t.intermediate_values[0]
            assert first > min(c.intermediate_values[0] for c in complete if c.number < t.number)
            assert len(t.intermediate_values) == 1
    assert any(t.params["model.members.tft.optim.lr"] > 0.7 for t in trials), "the seeded start-up no longer samples the bad region"
    for t in complete:  # the objective is the best validation quantile loss, reported every epoch
        assert t.value == pytest.approx(min(t.intermediate_values.values()), rel=1e-6)
        assert len(t.intermediate_values) == 2

    runs = tmp / "runs" / "tune-tiny"
    for t in trials:
        trial_dir = runs / f"trial_{t.number}"
        assert t.user_attrs["log_dir"] == str(trial_dir)
        fit_config = yaml.safe_load((trial_dir / "fit_config.yaml").read_text())
        assert fit_config["model"]["members"]["tft"]["init_args"]["optim"]["lr"] == t.params["model.members.tft.optim.lr"]
        assert fit_config["model"]["members"]["dqn"]["init_args"]["hidden"] == json.loads(t.params["model.members.dqn.hidden"])
        events = list(trial_dir.glob("events.out.tfevents*"))
        assert events, f"trial {t.number} wrote no TensorBoard events"
        acc = EventAccumulator(str(events[0]))
        acc.Reload()
        hparams = acc.PluginTagToContent("hparams")
        assert any(b"model.members.tft.optim.lr" in content for content in hparams.values()), "parameters missing from the hparams tab"
        assert "hp/val/tft/quantile_loss" in acc.Tags()["scalars"]
    # the feature cache is shared: every trial read the same features
    assert len(list((tmp / "cache").glob("features-*.safetensors"))) == 1

    best = runs / "best"
    summary = json.loads((best / "summary.json").read_text())
    assert summary["counts"]["pruned"] == len(summary["pruned"]) >= 1
    best_trial = study.best_trial
    assert summary["best"][0]["number"] == best_trial.number
    # the best trial's validation Sharpe deflated by the number of trials tried (pruned ones included) and the spread
    # of the Sharpes of the complete ones
    deflated = summary["best"][0]["deflated_sharpe"]
    assert deflated["n_trials"] == len(complete) + len(summary["pruned"])
    mine = best_trial.user_attrs["validation_moments"]
    if math.isnan(mine["sr_per_bar"]):  # an ensemble that never traded has no Sharpe to deflate
        assert deflated["value"] is None and deflated["reason"]
    else:
        assert 0.0 <= deflated["value"] <= 1.0
    assert all("validation_moments" in t.user_attrs for t in complete)
    # a pruned trial's moments at the validation it was pruned on: a trial of the spread too (issue 45)
    assert all("validation_moments" in t.user_attrs for t in trials if t.state == TrialState.PRUNED)
    finite = [t for t in trials if math.isfinite(t.user_attrs["validation_moments"]["sr_per_bar"])]
    assert deflated["n_sharpes"] == len(finite)
    for name in ("optimization_history.png", "param_importances.png"):
        assert (best / name).stat().st_size > 5000
    if len(complete) >= 2:
        assert set(summary["importances"]["val/tft/quantile_loss"]) == set(best_trial.params)
    config = yaml.safe_load((best / "config.yaml").read_text())
    assert config["model"]["members"]["tft"]["init_args"]["optim"]["lr"] == best_trial.params["model.members.tft.optim.lr"]
    assert config["trainer"]["max_epochs"] == 2  # the fixed keys are part of the ready config


def test_rerun_resumes_and_adds_trials(tiny_study, capsys) -> None:
    tmp, path = tiny_study
    assert main(["--config", str(path)]) == 0  # the study already holds its 4 trials: nothing to do
    assert len(_study(tmp).trials) == 4
    assert main(["--config", str(path), "--n-trials", "5"]) == 0
    trials = _study(tmp).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    assert trials[4].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert (tmp / "runs" / "tune-tiny" / "trial_4" / "fit_config.yaml").exists()
    capsys.readouterr()
    assert main(["--config", str(path), "--best"]) == 0
    out = capsys.readouterr().out
    assert "study 'tune-tiny': 5 trials" in out and "pruned" in out and "best trial" in out
    assert "optuna-dashboard sqlite:///" in out


def test_best_config_runs_in_fit_unchanged(tiny_study, tmp_path: Path, monkeypatch) -> None:
    from foxhunt.fit import main as fit_main

    tmp, _ = tiny_study
    best = tmp / "runs" / "tune-tiny" / "best" / "config.yaml"
    monkeypatch.chdir(tmp_path)  # the config's own logger writes runs/ here
    cli = fit_main(["--config", str(best)])
    study = _study(tmp)
    assert cli.model.member("tft").optim.lr == pytest.approx(study.best_params["model.members.tft.optim.lr"])
    assert list(cli.model.member("dqn").hparams.hidden) == json.loads(study.best_params["model.members.dqn.hidden"])
    assert "ensemble" in cli.results["backtest"]
    assert list((tmp_path / "runs").rglob("ensemble.safetensors"))


def test_tied_best_trials_give_the_config_of_the_study_best_trial(tiny_study, tmp_path: Path) -> None:
    """Ties (every trial's validation Sharpe 0 when the do-no-harm rule holds every member flat) write the config of
    ``study.best_trial``, the first of them, and the summary says it is tied; before, each tie overwrote config.yaml."""
    from foxhunt.tune import summarize
    from foxhunt.tune.report import format_summary

    tmp, path = tiny_study
    cfg = load_tune_config(path)
    done = [t for t in _study(tmp).get_trials() if t.state == TrialState.COMPLETE]
    lr = "model.members.tft.optim.lr"
    first = done[0]
    other = {**first.params, lr: first.distributions[lr].high}  # a different configuration with the same score
    tied = optuna.create_study(direction="maximize")
    for params in (first.params, other, other):  # old code kept the last tie's config
        tied.add_trial(optuna.trial.create_trial(params=params, distributions=first.distributions, value=0.0))
    summary = summarize(tied, cfg, out_dir=tmp_path / "best", plots=False)
    assert tied.best_trial.number == 0 and [b["number"] for b in summary["best"]] == [0]
    text = format_summary({**summary, "summary_path": "s"}, "db")
    assert summary["best"][0]["tied"] == 2 and "tied with 2 other" in text and "edge_confidence" in text
    written = yaml.safe_load((tmp_path / "best" / "config.yaml").read_text())
    assert written["model"]["members"]["tft"]["init_args"]["optim"]["lr"] == pytest.approx(first.params[lr]) != other[lr]


def _tune_worker(argv: list[str]) -> None:
    sys.exit(main(argv))


def test_two_workers_share_one_sqlite_study(tmp_path: Path) -> None:
    """Two processes on one SQLite study finish N trials together: none lost, none run twice."""
    import multiprocessing

    path = _config(tmp_path, fixed={"trainer.max_epochs": 1}, pruner={"name": "none"})
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    argv = ["--config", str(path), "--storage", storage, "--study-name", "shared", "--n-trials", "4"]
    # two independent processes running foxhunt.tune's main, forked from a server that imported Lightning once
    # (a fresh `python -m foxhunt.tune` pays that import per worker: ~10-20 s on a loaded 2-core machine)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["foxhunt.fit", "foxhunt.tune"])
    workers = [ctx.Process(target=_tune_worker, args=(argv,)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    assert [w.exitcode for w in workers] == [0, 0]
    study = optuna.load_study(study_name="shared", storage=storage)
    trials = study.get_trials()
    counted = [t for t in trials if counts_toward_budget(t)]
    assert len(counted) == 4, [(t.number, t.state, t.user_attrs) for t in trials]
    assert all(t.state == TrialState.COMPLETE for t in counted)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    others = [t for t in trials if not counts_toward_budget(t)]
    assert all(t.user_attrs.get("fail_kind") == "surplus" for t in others)  # a lost race costs no training
    assert len({t.number for t in trials}) == len(trials)
    assert len({t.user_attrs["worker"] for t in counted}) == 2, "one worker did all the work"
    # no two workers proposed the same parameters (per-trial seeding), and each trial trained in its own folder
    assert len({json.dumps(t.params, sort_keys=True) for t in counted}) == 4
    dirs = {t.user_attrs["log_dir"] for t in counted}
    assert len(dirs) == 4 and all(list(Path(d).glob("events.out.tfevents*")) for d in dirs)


class _Inject(Callback):
    """Makes trial ``number`` fail in a chosen way at its first training batch."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.how == "nan":  # the non-finite guard must catch it
            with torch.no_grad():
                next(pl_module.member("tft").network.parameters()).fill_(float("nan"))
        elif self.how == "raise":
            raise RuntimeError("boom in trial")
        elif self.how == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        elif self.how == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
        elif self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)


def test_failures_are_recorded_study_continues_and_ctrl_c_resumes(tmp_path: Path) -> None:
    objectives = [{"metric": "val/sharpe", "direction": "maximize"},
                  {"metric": "val/ensemble/max_drawdown", "direction": "minimize", "reduce": "last"}]
    path = _config(tmp_path, fixed={"trainer.max_epochs": 1}, objective=objectives, pruner={"name": "none"})
    cfg = load_tune_config(path)
    plan = {0: "nan", 1: "raise", 2: "oom", 3: "sigint"}
    # Ctrl-C as a terminal delivers it, whatever an earlier test of this session left installed
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_study(cfg, extra_callbacks=lambda trial: [_Inject(plan[trial.number])])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Lightning's SIG_IGN does not outlive the trial
    finally:
        signal.signal(signal.SIGINT, before)
    trials = _study(tmp_path).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert trials[0].state == TrialState.PRUNED
    assert trials[0].user_attrs["pruned_reason"].startswith("diverged: NonFiniteError: non-finite loss")
    assert trials[1].state == TrialState.FAIL and trials[1].user_attrs["fail_kind"] == "error"
    assert "boom in trial" in trials[1].user_attrs["fail_reason"]
    assert trials[2].state == TrialState.FAIL and trials[2].user_attrs["fail_kind"] == "oom"
    assert trials[3].state == TrialState.FAIL and trials[3].user_attrs["fail_kind"] == "interrupted"
    # the interrupted trial does not count: resuming runs one more trial and the study is complete
    run = run_study(cfg, check=False)
    trials = _study(tmp_path).get_trials()
    assert run.ran == [4] and trials[4].state == TrialState.COMPLETE
    assert len(trials[4].values) == 2
    assert sum(counts_toward_budget(t) for t in trials) == 4
    from foxhunt.tune import summarize

    summary = summarize(run.study, cfg)
    assert summary["counts"] == {"pruned": 1, "error": 1, "oom": 1, "interrupted": 1, "complete": 1}
    assert (tmp_path / "runs" / "tune-tiny" / "best" / "config_trial_4.yaml").exists()


def test_sigterm_during_a_trial_is_recorded_as_sigterm_and_the_next_run_replaces_it(tmp_path: Path, capsys) -> None:
    """The issue's drill: SIGTERM (a scheduler's stop) was recorded as "KeyboardInterrupt (Ctrl-C)"."""
    path = _config(tmp_path, fixed={"trainer.max_epochs": 1}, n_trials=1)
    cfg = load_tune_config(path)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        run_study(cfg, extra_callbacks=lambda trial: [_Inject("sigterm" if trial.number == 0 else "none")])
    assert signal.getsignal(signal.SIGTERM) is before  # the study's handler does not outlive it
    (trial,) = _study(tmp_path).get_trials()
    assert trial.state == TrialState.FAIL and trial.user_attrs["fail_kind"] == "interrupted"
    assert trial.user_attrs["fail_reason"].startswith("SIGTERM (the worker was told to stop)")
    assert "KeyboardInterrupt" not in trial.user_attrs["fail_reason"]
    run = run_study(cfg, check=False)  # it did not count: the study's one trial is run again
    assert run.ran == [1] and _study(tmp_path).get_trials()[1].state == TrialState.COMPLETE


def test_a_stale_trial_is_retried_once_with_its_parameters_and_the_reason(tmp_path: Path) -> None:
    """A worker killed outright (no heartbeat for the grace period): its trial is failed as stale and its parameters
    run again, once, by the next worker, which records what it retries and why."""
    import time

    from foxhunt.tune import open_study

    path = _config(tmp_path, fixed={"trainer.max_epochs": 1}, n_trials=1, heartbeat_interval=1, heartbeat_grace=2)
    cfg = load_tune_config(path)
    storage = f"sqlite:///{tmp_path / 'runs' / 'optuna.db'}"
    study = open_study(cfg, storage, cfg.study_name)
    dead = study.ask()  # a trial whose worker died after its parameters were drawn and one heartbeat was sent
    params = {p.key: p.suggest(dead) for p in cfg.search_space}
    dead.set_user_attr("worker", "lost-host:1")
    study._storage.record_heartbeat(dead._trial_id)
    time.sleep(3)
    run = run_study(cfg, storage=storage, check=False)
    trials = _study(tmp_path).get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE] and run.ran == [1]
    retry = trials[1]
    assert retry.user_attrs["retry_of"] == 0 and retry.params == trials[0].params
    assert decoded_params(cfg, retry) == params
    assert retry.user_attrs["retry_reason"].startswith("trial 0 (worker lost-host:1) sent no heartbeat for 2 s")
    assert retry.user_attrs["worker"] != "lost-host:1"


def test_a_worker_waits_for_other_workers_running_trials_and_gives_up_on_ones_without_heartbeat(tmp_path: Path) -> None:
    """The rest of the budget held by another worker's running trial: wait for it to end or go stale (then retry it);
    a trial that never sent a heartbeat can do neither, so the wait ends after two grace periods."""
    from foxhunt.tune import open_study

    path = _config(tmp_path, n_trials=1, heartbeat_interval=1, heartbeat_grace=2)
    cfg = load_tune_config(path)
    storage = f"sqlite:///{tmp_path / 'runs' / 'optuna.db'}"
    study = open_study(cfg, storage, cfg.study_name)
    study.ask()  # another worker's trial, killed before its first heartbeat
    run = run_study(cfg, storage=storage, check=False)
    assert run.waited and run.ran == []
    assert [t.state for t in _study(tmp_path).get_trials()] == [TrialState.RUNNING]


def test_a_retry_that_goes_stale_is_not_retried_again(tmp_path: Path) -> None:
    from foxhunt.tune import RetryStaleTrial

    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'r.db'}")
    study = optuna.create_study(storage=storage)
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    first = optuna.trial.create_trial(state=TrialState.FAIL, params={"x": 0.5}, distributions=dist,
                                      user_attrs={"worker": "a:1"})
    study.add_trial(first)
    RetryStaleTrial(5)(study, study.get_trials()[0])
    retry = study.get_trials()[1]
    assert retry.state == TrialState.WAITING and retry.params == {"x": 0.5} and retry.user_attrs["retry_of"] == 0
    study._storage.set_trial_state_values(retry._trial_id, TrialState.RUNNING)
    study._storage.set_trial_state_values(retry._trial_id, TrialState.FAIL)
    RetryStaleTrial(5)(study, study.get_trials()[1])
    assert len(study.get_trials()) == 2


def test_the_storage_and_its_stale_trial_retry_use_no_deprecated_optuna_api(tmp_path: Path) -> None:
    """Optuna 4.9 deprecated RetryFailedTrialCallback and RDBStorage's failed_trial_callback (gone in 6.0): opening a
    study's storage must not warn of either."""
    import warnings

    from foxhunt.tune.study import open_storage

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", heartbeat_interval=30, grace_period=60)
    assert storage.heartbeat_stale_trial_callback is not None


def test_unknown_objective_metric_stops_the_study(tmp_path: Path, capsys) -> None:
    path = _config(tmp_path, fixed={"trainer.max_epochs": 1}, objective={"metric": "val/sharp"})
    assert main(["--config", str(path), "--n-trials", "3"]) == 2
    err = capsys.readouterr().err
    assert "val/sharp" in err and "val/sharpe" in err  # names the metric and lists the logged ones
    trials = _study(tmp_path).get_trials()
    assert len(trials) == 1 and trials[0].state == TrialState.FAIL and trials[0].user_attrs["fail_kind"] == "config"


# ------------------------------------------------------------------------------------------------- fast checks
def test_config_errors_name_file_and_field(tmp_path: Path, capsys) -> None:
    def bad(text: str, match: str) -> None:
        path = tmp_path / "bad.yaml"
        path.write_text(f"base_config: {CONFIGS / 'tiny.yaml'}\n" + text)
        with pytest.raises(TuneConfigError, match=match) as info:
            load_tune_config(path)
        assert str(path) in str(info.value)

    space = "search_space: {model.members.tft.optim.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}}\n"
    bad("search_space: {model.members.tft.optim.lr: {type: float, low: 0, high: 1, log: true}}\n",
        r"search_space\.model\.members\.tft\.optim\.lr.*low > 0")
    bad("search_space: {model.members.tft.optim.lr: {type: gaussian}}\n", "float, int or categorical")
    bad("search_space: {data.lookback: {type: int, low: 8}}\n", "needs 'low' and 'high'")
    bad(space + "objective: {metric: val/sharpe, direction: up}\n", "direction")
    bad(space + "objective: [val/sharpe, val/ensemble/max_drawdown]\npruner: {name: median}\n", "single objective")
    bad(space + "pruner: {name: median, patience: 3}\n", "rejects its arguments")
    bad(space + "sampler: {name: annealing}\n", "sampler.name")
    bad(space + "searchspace: {}\n", "unknown key")
    bad(space + "fixed: {model.members.tft.optim.lr: 0.1}\n", "both fixed and searched")
    path = tmp_path / "nobase.yaml"
    path.write_text("base_config: nowhere.yaml\n" + space)
    assert main(["--config", str(path)]) == 2
    assert "nowhere.yaml" in capsys.readouterr().err
    # the module runs as a command (a config error exits before Lightning is even imported)
    proc = subprocess.run([sys.executable, "-m", "foxhunt.tune", "--config", str(path)], check=False,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "base_config 'nowhere.yaml' not found" in proc.stderr


def test_search_space_keys_are_checked_by_the_fit_parser(tmp_path: Path) -> None:
    path = _config(tmp_path, search_space={"model.members.tft.hidden_sise": {"type": "int", "low": 4, "high": 8}})
    with pytest.raises(TuneConfigError, match="hidden_sise"):
        run_study(load_tune_config(path), n_trials=1)
    assert not (tmp_path / "runs" / "optuna.db").exists() or not _study(tmp_path).trials


@pytest.mark.parametrize("space, expected", [
    ({"model.members.dqn.optim.lr": {"type": "float", "low": 1e-4, "high": 5.0, "log": True}},
     "model.members.dqn (DQNModule): learning rate must be in (0, 1], got 5.0"),
    ({"model.members.dqn.gamma": {"type": "float", "low": 0.9, "high": 1.0}}, "gamma must be in [0, 1), got 1.0"),
    ({"model.combine": ["sharpe_weighted", "stack", "mean"]}, "model.combine"),
], ids=["dqn_lr_high_end", "gamma_high_end", "bad_choice"])
def test_every_value_of_the_search_space_is_checked_by_the_constructors_before_any_trial(
        tmp_path: Path, space: dict, expected: str) -> None:
    """The members' ranges too (the DQN checked its learning rate only after loading the data): the high end of
    every range and every choice is built, without data, before the first trial."""
    path = _config(tmp_path, search_space=space)
    with pytest.raises(TuneConfigError, match=re.escape(expected)):
        run_study(load_tune_config(path), n_trials=1)
    assert not (tmp_path / "runs" / "optuna.db").exists() or not _study(tmp_path).trials


def test_a_trial_config_rejected_by_fit_fails_with_the_parser_message(tmp_path: Path) -> None:
    path = _config(tmp_path, fixed={"trainer.max_epochs": "three"})
    run = run_study(load_tune_config(path), n_trials=1, check=False)  # the up-front check would refuse it
    trial = run.study.trials[0]
    assert trial.state == TrialState.FAIL and trial.user_attrs["fail_kind"] == "error"
    assert "max_epochs" in trial.user_attrs["fail_reason"] and "three" in trial.user_attrs["fail_reason"]


def test_set_dotted_creates_missing_sections_and_refuses_null_entries() -> None:
    config = {"model": {"members": {"tft": {"class_path": "foxhunt.lit.TFTModule", "init_args": {"lr": 0.1}},
                                    "dqn": None}}}
    set_dotted(config, "model.members.tft.hidden_size", 16)
    set_dotted(config, "data.lookback", 8)
    assert config["model"]["members"]["tft"]["init_args"] == {"lr": 0.1, "hidden_size": 16}
    assert config["data"] == {"lookback": 8}
    # a member the base config nulls out is not silently brought back as a class-less section
    with pytest.raises(TuneConfigError, match=r"model\.members\.dqn is null"):
        set_dotted(config, "model.members.dqn.optim.lr", 0.1)
    assert config["model"]["members"]["dqn"] is None


def test_set_dotted_steps_into_init_args_at_any_depth() -> None:
    """Members as a dict of named class_path/init_args entries: ``model.members.tft.hidden_size`` lands in init_args."""
    config = {"model": {"members": {
        "tft": {"class_path": "foxhunt.lit.TFTModule", "init_args": {"lr": 0.1}},
        "dqn": {"class_path": "foxhunt.lit.DQNModule"},  # no init_args yet: created
    }}}
    set_dotted(config, "model.members.tft.hidden_size", 16)
    set_dotted(config, "model.members.tft.init_args.dropout", 0.2)  # the explicit path gives the same place
    set_dotted(config, "model.members.dqn.hidden", [32, 32])
    set_dotted(config, "model.members.tft.class_path", "foxhunt.lit.OtherTFT")  # the class itself stays beside
    members = config["model"]["members"]
    assert members["tft"] == {"class_path": "foxhunt.lit.OtherTFT",
                              "init_args": {"lr": 0.1, "hidden_size": 16, "dropout": 0.2}}
    assert members["dqn"] == {"class_path": "foxhunt.lit.DQNModule", "init_args": {"hidden": [32, 32]}}
    # a class inside a class: the ensemble given by class_path, its members too
    nested = {"model": {"class_path": "foxhunt.lit.EnsembleModule",
                        "init_args": {"members": {"tft": {"class_path": "foxhunt.lit.TFTModule", "init_args": None}}}}}
    set_dotted(nested, "model.members.tft.optim.lr", 0.01)
    assert nested["model"]["init_args"]["members"]["tft"]["init_args"] == {"optim": {"lr": 0.01}}
    assert set(nested["model"]) == {"class_path", "init_args"}
    # a member the base config does not name is a plain section; a non-mapping init_args is refused by name
    set_dotted(config, "model.members.extra.lr", 0.5)
    assert members["extra"] == {"lr": 0.5}
    with pytest.raises(TuneConfigError, match=r"model\.members\.bad\.init_args is 3"):
        set_dotted({"model": {"members": {"bad": {"class_path": "X", "init_args": 3}}}}, "model.members.bad.lr", 0.1)


def test_trial_seeded_sampler_is_reproducible_and_distinct_across_workers() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = [SearchParam("a", "float", 1e-4, 1.0, log=True), SearchParam("b", "categorical", choices=([8], [16, 16]))]

    def proposals(seed: int, n: int) -> list[list[Any]]:
        study = optuna.create_study(sampler=TrialSeededSampler("tpe", seed, n_startup_trials=3))
        out = []
        for _ in range(n):
            trial = study.ask()
            out.append([p.suggest(trial) for p in space])
            study.tell(trial, float(out[-1][0]))
        return out

    first, again = proposals(0, 5), proposals(0, 5)
    assert first == again  # seeded: reproducible, TPE phase included
    assert len({json.dumps(p) for p in first}) == 5
    assert all(p[1] in ([8], [16, 16]) for p in first)  # list-valued choices come back decoded
    assert proposals(1, 1)[0] != first[0]


def test_lightning_config_is_valid() -> None:
    cfg = load_tune_config(ROOT / "lightning_configs" / "tune.yaml")
    assert cfg.base_config == (ROOT / "lightning_configs" / "quickstart.yaml").resolve()
    assert cfg.objectives[0].metric == "val/sharpe" and cfg.objectives[0].direction == "maximize"
    assert cfg.sampler["name"] == "tpe" and cfg.sampler["seed"] == 0


# ---- the deflated Sharpe ratio of the best trial, on fixed trials ----------------------------------------------------
_X = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}


def _moments(sr: float, held_flat: bool = False) -> dict[str, Any]:
    return {"validation_moments": {"sr_per_bar": sr, "n_bars": 400, "skew": -0.2, "kurtosis": 4.0,
                                   "held_flat": held_flat}}


def _fixed_study(srs: list[float], pruned: int = 0, failed: tuple[tuple[str, bool], ...] = (), held_flat: bool = False):
    """Complete trials with validation Sharpes ``srs`` (objective = the Sharpe), ``pruned`` pruned trials with an
    intermediate value, and failed trials of (fail_kind, scored on validation before failing)."""
    study = optuna.create_study(direction="maximize")
    for i, sr in enumerate(srs):
        value = sr if math.isfinite(sr) else 0.0
        study.add_trial(optuna.trial.create_trial(params={"x": i / 10}, distributions=_X, value=value,
                                                  user_attrs=_moments(sr, held_flat)))
    for i in range(pruned):
        study.add_trial(optuna.trial.create_trial(params={"x": 0.5 + i / 10}, distributions=_X,
                                                  state=TrialState.PRUNED, intermediate_values={0: -1.0}))
    for kind, scored in failed:
        attrs = {"fail_kind": kind, "fail_reason": kind, "history": {"val/sharpe": [-0.5] if scored else []}}
        study.add_trial(optuna.trial.create_trial(params={"x": 0.9}, distributions=_X, state=TrialState.FAIL,
                                                  user_attrs=attrs))
    return study


def test_deflated_sharpe_counts_pruned_and_scored_failed_trials() -> None:
    from foxhunt.evaluation.significance import deflated_sharpe_ratio
    from foxhunt.tune.report import deflated_sharpe

    srs = [0.12, 0.02, -0.03]
    complete_only = _fixed_study(srs)
    d0 = deflated_sharpe(complete_only, complete_only.best_trial)
    assert d0["n_trials"] == 3 and d0["n_sharpes"] == 3 and d0["trials"] == {"complete": 3}
    # two pruned, one error scored on validation before it failed (counted); an error before any validation, an
    # interrupted and a surplus trial were never judged (not counted)
    pruned = _fixed_study(srs, pruned=2, failed=(("error", True), ("error", False), ("interrupted", True),
                                                 ("surplus", False)))
    d = deflated_sharpe(pruned, pruned.best_trial)
    assert d["n_trials"] == 6 and d["n_sharpes"] == 3 and d["trials"] == {"complete": 3, "pruned": 2, "error": 1}
    assert d["value"] == pytest.approx(deflated_sharpe_ratio(0.12, 400, -0.2, 4.0, srs, n_trials=6), rel=1e-12)
    assert 0.0 < d["value"] < d0["value"] < 1.0  # more trials tried, same spread: deflated further

    from foxhunt.tune.report import format_summary

    summary = {"study": "s", "n_trials": 9, "counts": {}, "pruned": [3, 4], "failed": {}, "importances": {}, "plots": [],
               "summary_path": "p", "best": [{"number": 0, "values": {"val/sharpe": 0.12}, "params": {}, "config": "c",
                                              "export_dir": "e", "deflated_sharpe": d}]}
    text = format_summary(summary, "db")
    assert "given 6 trials tried: 3 complete, 1 error, 2 pruned; spread of 3 validation Sharpe(s)" in text


def test_held_flat_best_trial_prints_the_reason_not_nan() -> None:
    from foxhunt.tune.report import deflated_sharpe, format_summary

    study = _fixed_study([math.nan, math.nan], pruned=2, held_flat=True)
    d = deflated_sharpe(study, study.best_trial)
    assert d["value"] is None and d["n_trials"] == 4 and d["n_sharpes"] == 0  # NaN Sharpes give no spread
    summary = {"study": "s", "n_trials": 4, "counts": {"complete": 2, "pruned": 2}, "pruned": [2, 3], "failed": {},
               "importances": {}, "plots": [], "summary_path": "p",
               "best": [{"number": 0, "values": {"val/sharpe": 0.0}, "params": {}, "config": "c", "export_dir": "e",
                         "deflated_sharpe": d}]}
    text = format_summary(summary, "db")
    line = next(ln for ln in text.splitlines() if "deflated Sharpe ratio" in ln)
    assert "held flat" in line and "no Sharpe to deflate" in line
    assert "nan" not in text.lower()
    # a best trial with a Sharpe among trials without one: counted in N, left out of the spread
    mixed = _fixed_study([0.1, math.nan, 0.02])
    d = deflated_sharpe(mixed, mixed.best_trial)
    assert d["n_trials"] == 3 and d["n_sharpes"] == 2 and 0.0 < d["value"] < 1.0


def test_deflated_sharpe_counts_the_pruned_trials_sharpes_in_the_spread() -> None:
    """Issue 45: pruning stops the worst trials, so a spread of the complete trials' Sharpes alone is too narrow (SR0
    too low, DSR too high). A pruned trial's Sharpe at the validation it was pruned on counts in V as in N; one
    without recorded moments (a study run before) counts in N only."""
    from foxhunt.evaluation.significance import deflated_sharpe_ratio
    from foxhunt.tune.report import deflated_sharpe

    srs, pruned_srs = [0.12, 0.02, -0.03], [-0.15, -0.11]
    study = _fixed_study(srs, pruned=1)  # one pruned trial without moments
    for i, sr in enumerate(pruned_srs):
        study.add_trial(optuna.trial.create_trial(params={"x": 0.05 + i / 10}, distributions=_X, state=TrialState.PRUNED,
                                                  intermediate_values={0: sr}, user_attrs=_moments(sr)))
    d = deflated_sharpe(study, study.best_trial)
    assert d["n_trials"] == 6 and d["n_sharpes"] == 5 and d["trials"] == {"complete": 3, "pruned": 3}
    assert d["value"] == pytest.approx(deflated_sharpe_ratio(0.12, 400, -0.2, 4.0, srs + pruned_srs, n_trials=6),
                                       rel=1e-12)
    assert d["value"] < deflated_sharpe_ratio(0.12, 400, -0.2, 4.0, srs, n_trials=6)  # the wider spread deflates more


def test_deflated_sharpe_with_one_complete_trial_of_many_uses_the_nulls_spread() -> None:
    """Issue 45: one complete trial among 50 (49 pruned) gave SR0 = 0 (no spread to estimate) and a DSR of ~0.99; the
    null's own sampling variance 1/(T - 1) bounds SR0 from below (the issue's T = 1,000, SR 0.07: 0.986 -> 0.475)."""
    from foxhunt.evaluation.significance import null_max_sharpe, psr_from_moments
    from foxhunt.tune.report import deflated_sharpe

    assert psr_from_moments(0.07, 1000, 0.0, 3.0, null_max_sharpe(50, 1000)) == pytest.approx(0.475, abs=0.005)
    study = _fixed_study([0.07], pruned=4)
    for i in range(45):  # 45 more pruned trials, each at its own point of the search space
        study.add_trial(optuna.trial.create_trial(params={"x": 0.01 * i}, distributions=_X, state=TrialState.PRUNED,
                                                  intermediate_values={0: -1.0}))
    d = deflated_sharpe(study, study.best_trial)
    assert d["n_trials"] == 50 and d["n_sharpes"] == 1
    assert d["sr0_per_bar"] == pytest.approx(null_max_sharpe(50, 400), rel=1e-12)
    assert d["value"] == pytest.approx(psr_from_moments(0.07, 400, -0.2, 4.0, null_max_sharpe(50, 400)), rel=1e-12)
    assert d["value"] < 0.5 < psr_from_moments(0.07, 400, -0.2, 4.0, 0.0)
