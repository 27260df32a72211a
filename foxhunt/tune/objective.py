"""A trial's objective (a fit from ``foxhunt.fit.build_cli``, pruning, metric reduction) and ``run_study``."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from foxhunt.tune.space import (
    FitConfigParser,
    TuneConfig,
    TuneConfigError,
    _check_search_space,
    compose_fit_config,
    trainer_overrides,
    write_fit_config,
)
from foxhunt.tune.study import _budget_used, counts_toward_budget, default_storage_url, open_study

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback

log = logging.getLogger("foxhunt.tune")

#: how often a worker whose budget is taken looks again for other workers' running trials to end (a cheap query;
#: staleness is judged by the heartbeat grace, not by this)
WAIT_POLL_S = 1.0


# ----------------------------------------------------------------------------------------------------- a trial
class TrialError(RuntimeError):
    """A trial failed; the study records it and goes on."""


class MetricMissingError(TuneConfigError):
    """The objective metric is not logged: every trial would fail, so the study stops."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, ``kill``) during a study: handled as Ctrl-C is, but recorded as SIGTERM."""


INTERRUPT_REASONS = {
    "SIGINT": "KeyboardInterrupt (Ctrl-C); the next run replaces this trial",
    "SIGTERM": "SIGTERM (the worker was told to stop); the next run replaces this trial",
}


def _signal_name(e: BaseException) -> str:
    return "SIGTERM" if isinstance(e, Terminated) else "SIGINT"


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signal.Signals(signum).name}")


class _Recorder:
    """Lightning callback (built lazily): records objective metrics per validation and writes TensorBoard hparams."""

    @staticmethod
    def make(cfg: TuneConfig, params: Mapping[str, Any], number: int) -> Callback:
        from lightning.pytorch.callbacks import Callback

        class ObjectiveRecorder(Callback):
            def __init__(self) -> None:
                self.history: dict[str, list[float]] = {o.metric: [] for o in cfg.objectives}
                self._hparams_written = False

            def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
                if trainer.sanity_checking:
                    return
                metrics = trainer.callback_metrics
                missing = [o.metric for o in cfg.objectives if o.metric not in metrics]
                if missing:
                    known = sorted(k for k in metrics if k.startswith("val"))
                    raise MetricMissingError(f"{cfg.path}: objective metric(s) {missing} are not logged; "
                                             f"validation logs {known}")
                for o in cfg.objectives:
                    self.history[o.metric].append(float(metrics[o.metric]))
                best = {f"hp/{o.metric}": o.value(self.history[o.metric]) for o in cfg.objectives}
                for lg in trainer.loggers:
                    if not self._hparams_written:  # the hparams tab: this trial's parameters against its objective
                        lg.log_hyperparams({"trial": number, **_scalar_params(params)}, metrics=best)
                    else:
                        lg.log_metrics(best, step=trainer.global_step)
                self._hparams_written = True

        return ObjectiveRecorder()


def _scalar_params(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (int, float, str, bool)) else json.dumps(v)) for k, v in params.items()}


def _record_validation_moments(trial: optuna.Trial, model: Any) -> None:
    """The moments of the ensemble's validation P&L with the exported weights (a pruned trial: at the validation it
    was pruned on): what the study's deflated Sharpe ratio needs of each trial (per-bar Sharpe, bars, skewness,
    kurtosis), and whether it was held flat throughout."""
    evaluation = getattr(model, "last_evaluation", None)
    if evaluation is None or "ensemble" not in evaluation.positions:
        return
    from foxhunt.evaluation.backtest import policy_pnl
    from foxhunt.evaluation.significance import sharpe_moments

    positions = evaluation.positions["ensemble"]
    m = sharpe_moments(policy_pnl(positions, evaluation.split, evaluation.cost_bps))
    # held_flat: no position at any bar (the do-no-harm rule held every member flat), so no P&L and no Sharpe
    trial.set_user_attr("validation_moments", {"sr_per_bar": m.sr_per_bar, "n_bars": m.n_bars, "skew": m.skew,
                                               "kurtosis": m.kurtosis, "held_flat": bool((positions == 0).all())})


def _classify(e: BaseException) -> tuple[str, str]:
    """(kind, reason) of a trial's exception."""
    from foxhunt.training.guard import NonFiniteError

    reason = f"{type(e).__name__}: {e}".strip()[:2000]
    text = str(e).lower()
    if isinstance(e, NonFiniteError):
        return "diverged", reason
    import torch

    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text or "can't allocate memory" in text:
        return "oom", reason
    return "error", reason


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class FitObjective:
    """Optuna objective: compose the trial's fit config, train it with a pruning callback, return the objective."""

    cfg: TuneConfig
    study_name: str
    n_trials: int | None = None
    extra_callbacks: Callable[[optuna.Trial], list[Any]] | None = None  # tests inject failures through this
    worker: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")

    def trial_dir(self, number: int) -> Path:
        return self.cfg.runs_dir / self.study_name / f"trial_{number}"

    def __call__(self, trial: optuna.Trial) -> float | list[float]:
        trial.set_user_attr("worker", self.worker)
        if self.n_trials is not None and _budget_used(trial.study, before=trial.number) >= self.n_trials:
            trial.set_user_attr("fail_kind", "surplus")
            trial.set_user_attr("fail_reason", f"another worker took the last of the study's {self.n_trials} trials")
            raise TrialError("surplus trial: the study's budget is already taken")
        params = {p.key: p.suggest(trial) for p in self.cfg.search_space}
        out = self.trial_dir(trial.number)
        overrides = trainer_overrides(self.cfg, params)
        config_path = write_fit_config(
            compose_fit_config(self.cfg, params, trainer=False), out / "fit_config.yaml",
            f"trial {trial.number} of study {self.study_name} (foxhunt.tune)\nparams: {json.dumps(params)}"
            + (f"\ntrainer on the command line: {' '.join(overrides)}" if overrides else ""),
        )
        trial.set_user_attr("log_dir", str(out))
        trial.set_user_attr("fit_config", str(config_path))
        start = time.monotonic()
        try:
            return self._fit(trial, params, config_path, out)
        finally:
            trial.set_user_attr("seconds", round(time.monotonic() - start, 1))
            _free_memory()

    def _fit(self, trial: optuna.Trial, params: dict[str, Any], config_path: Path, out: Path) -> float | list[float]:
        from lightning.pytorch.trainer.states import TrainerStatus
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        from foxhunt.fit import build_cli

        recorder = _Recorder.make(self.cfg, params, trial.number)
        callbacks: list[Any] = [recorder]
        if not self.cfg.multi_objective and self.cfg.pruner["name"] != "none":
            from optuna_integration import PyTorchLightningPruningCallback

            callbacks.append(PyTorchLightningPruningCallback(trial, monitor=self.cfg.objectives[0].metric))
        if self.extra_callbacks is not None:
            callbacks += self.extra_callbacks(trial)
        logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                  "init_args": {"save_dir": str(self.cfg.runs_dir), "name": self.study_name,
                                "version": f"trial_{trial.number}", "default_hp_metric": False}}
        args = ["--config", str(config_path), "--trainer.logger", json.dumps(logger),
                "--trainer.default_root_dir", str(out), "--export_dir", str(out / "export"), "--backtest", "false",
                "--hparams_tab", "false",  # the trial's hparams tab is the study's (its parameters against the objective)
                *trainer_overrides(self.cfg, params)]
        if not self.cfg.progress_bar:
            args += ["--trainer.enable_progress_bar", "false"]
        sigint = signal.getsignal(signal.SIGINT)
        cli = None
        try:
            try:
                with FitConfigParser._errors(config_path):  # a parse error's message becomes the fail reason
                    cli = build_cli(args, callbacks=callbacks)
            except TuneConfigError as e:
                trial.set_user_attr("fail_kind", "error")
                trial.set_user_attr("fail_reason", str(e)[:2000])
                raise TrialError(str(e)) from None
            cli.fit()
            _record_validation_moments(trial, cli.model)
        except optuna.TrialPruned as e:
            trial.set_user_attr("pruned_reason", str(e) or "pruned")
            self._record_history(trial, recorder)
            if cli is not None:  # its last validation, the one pruned on: a trial of the study's deflated Sharpe
                _record_validation_moments(trial, cli.model)
            raise
        except TrialError:
            raise
        except SystemExit as e:  # Lightning turns Ctrl-C (and SIGTERM: our Terminated) into sys.exit(1) after its shutdown
            if cli is not None and cli.trainer.state.status == TrainerStatus.INTERRUPTED:
                cause = e.__context__ if isinstance(e.__context__, KeyboardInterrupt) else KeyboardInterrupt()
                if isinstance(e, SIGTERMException):  # Lightning's own SIGTERM path (our handler not installed)
                    cause = Terminated("signal SIGTERM")
                self._interrupted(trial, recorder, _signal_name(cause))
                raise cause from None
            trial.set_user_attr("fail_kind", "error")
            trial.set_user_attr("fail_reason", f"SystemExit({e.code}) during the trial")
            raise TrialError(f"the trial exited with {e.code}") from e
        except KeyboardInterrupt as e:
            self._interrupted(trial, recorder, _signal_name(e))
            raise
        except MetricMissingError:
            trial.set_user_attr("fail_kind", "config")
            raise
        except Exception as e:
            kind, reason = _classify(e)
            self._record_history(trial, recorder)
            if kind == "diverged":
                trial.set_user_attr("pruned_reason", f"diverged: {reason}")
                raise optuna.TrialPruned(f"diverged: {reason}") from e
            trial.set_user_attr("fail_kind", kind)
            trial.set_user_attr("fail_reason", reason)
            raise TrialError(reason) from e
        finally:
            if signal.getsignal(signal.SIGINT) is not sigint:
                signal.signal(signal.SIGINT, sigint)  # Lightning leaves SIGINT ignored after an interrupt
            del cli
        self._record_history(trial, recorder)
        values = [o.value(recorder.history[o.metric]) for o in self.cfg.objectives]
        bad = [o.metric for o, v in zip(self.cfg.objectives, values, strict=True) if not math.isfinite(v)]
        if bad:
            trial.set_user_attr("pruned_reason", f"diverged: objective {bad} is not finite")
            raise optuna.TrialPruned(f"objective {bad} is not finite")
        trial.set_user_attr("export_dir", str(out / "export"))
        return values if self.cfg.multi_objective else values[0]

    def _record_history(self, trial: optuna.Trial, recorder: Any) -> None:
        trial.set_user_attr("history", {m: [round(v, 6) if math.isfinite(v) else str(v) for v in h]
                                        for m, h in recorder.history.items()})

    def _interrupted(self, trial: optuna.Trial, recorder: Any, how: str) -> None:
        with contextlib.suppress(Exception):  # a second Ctrl-C must not leave the trial RUNNING
            self._record_history(trial, recorder)
            trial.set_user_attr("fail_kind", "interrupted")
            trial.set_user_attr("fail_reason", INTERRUPT_REASONS[how])


# -------------------------------------------------------------------------------------------------------- a study
@dataclass
class StudyRun:
    study: optuna.Study
    cfg: TuneConfig
    storage: str
    ran: list[int] = field(default_factory=list)
    interrupted: bool = False
    waited: bool = False  # the budget was taken by other workers' running trials, and this worker waited on them


def run_study(
    cfg: TuneConfig,
    n_trials: int | None = None,
    timeout: float | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    extra_callbacks: Callable[[optuna.Trial], list[Any]] | None = None,
    check: bool = True,
) -> StudyRun:
    """Run trials until the study holds ``n_trials`` counted trials (all workers together) or ``timeout`` passes.

    KeyboardInterrupt (Ctrl-C) and ``Terminated`` (SIGTERM, while this runs in the main thread) propagate after the
    running trial is marked ``interrupted`` with the signal's name. A trial waiting to be retried (a stale one's
    parameters) is run before the study counts as done.
    """
    n_trials = cfg.n_trials if n_trials is None else n_trials
    timeout = cfg.timeout if timeout is None else timeout
    storage = storage or cfg.storage or default_storage_url(cfg.runs_dir)
    name = study_name or cfg.study_name
    if check:
        _check_search_space(cfg)
    study = open_study(cfg, storage, name)
    objective = FitObjective(cfg, name, n_trials, extra_callbacks)
    run = StudyRun(study, cfg, storage)
    start = time.monotonic()
    log.info("study %r in %s: %s", name, storage, "until interrupted" if n_trials is None and timeout is None else
             f"n_trials={n_trials} (study total), timeout={timeout}")
    waiting_on: set[int] = set()
    waiting_since = start
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        while True:
            if timeout is not None and time.monotonic() - start >= timeout:
                log.info("timeout of %.0f s reached", timeout)
                break
            if n_trials is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    optuna.storages.fail_stale_trials(study)  # a killed worker's trial must not hold a slot
                used = _budget_used(study)
                waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                if used >= n_trials and not waiting:
                    trials = study.get_trials(deepcopy=False)
                    if sum(counts_toward_budget(t) for t in trials) >= n_trials:
                        log.info("study %r holds %d of %d trials: done", name, used, n_trials)
                        break
                    # the rest of the budget is other workers' running trials: wait for them to end, or to go stale
                    # (a killed worker's), when their parameters are retried here; give up on trials that do
                    # neither (killed before their first heartbeat) after two grace periods
                    running = {t.number for t in trials if t.state == TrialState.RUNNING}
                    if running != waiting_on:
                        waiting_on, waiting_since = running, time.monotonic()
                        log.info("study %r: waiting for the running trials %s of other workers", name, sorted(running))
                    elif time.monotonic() - waiting_since > 2 * cfg.heartbeat_grace:
                        log.warning("study %r: trials %s neither end nor go stale (killed before their first "
                                    "heartbeat?): stopping; they hold the budget until failed (or raise --n-trials)",
                                    name, sorted(running))
                        break
                    run.waited = True
                    time.sleep(min(cfg.heartbeat_interval, WAIT_POLL_S))
                    continue
            before = {t.number for t in study.get_trials(deepcopy=False) if t.state != TrialState.WAITING}
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is experimental.*")
                study.optimize(objective, n_trials=1, catch=(TrialError,), gc_after_trial=True)
            run.ran += sorted({t.number for t in study.get_trials(deepcopy=False)
                               if t.user_attrs.get("worker") == objective.worker} - before)
    except KeyboardInterrupt as e:
        run.interrupted = True
        _release_own_trials(study, objective.worker, _signal_name(e))
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return run


def _release_own_trials(study: optuna.Study, worker: str, how: str) -> None:
    """Fail this worker's trials that an interrupt left RUNNING (e.g. Ctrl-C during a storage write)."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("worker") == worker:
            with contextlib.suppress(Exception):
                study._storage.set_trial_user_attr(t._trial_id, "fail_kind", "interrupted")
                study._storage.set_trial_user_attr(t._trial_id, "fail_reason", INTERRUPT_REASONS[how])
                study.tell(t.number, state=TrialState.FAIL)
