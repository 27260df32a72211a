"""Optuna side of a study: RDB storage, per-trial seeded sampler, pruner, study creation, the trial budget, and the
one retry of a stale trial (a worker killed or hung: its heartbeat stopped)."""

from __future__ import annotations

import copy
import inspect
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from foxhunt.tune.space import _PRUNERS, _SAMPLERS, HEARTBEAT_GRACE_S, HEARTBEAT_INTERVAL_S, TuneConfig, TuneConfigError

try:  # Optuna >= 4.9; the former name, RetryFailedTrialCallback, is deprecated there and goes in 6.0
    from optuna.storages import RetryHeartbeatStaleTrialCallback as RetryCallback
except ImportError:  # Optuna < 4.9
    from optuna.storages import RetryFailedTrialCallback as RetryCallback

log = logging.getLogger("foxhunt.tune")

SQLITE_TIMEOUT_S = 60
COUNTED_FAIL_KINDS = ("error", "oom")  # failures that used up a trial; interrupted, surplus and stale ones do not


# -------------------------------------------------------------------------------------------------- sampler, pruner
def make_pruner(spec: Mapping[str, Any]) -> optuna.pruners.BasePruner:
    return _PRUNERS[spec["name"]](**{k: v for k, v in spec.items() if k != "name"})


class TrialSeededSampler(BaseSampler):
    """Runs a fresh inner sampler per trial, seeded from (seed, trial number).

    A seeded sampler restarted on resume, or run by two workers at once, would replay the same random draws and
    propose the same parameters; seeding by trial number keeps studies reproducible without duplicates.
    """

    def __init__(self, name: str, seed: int | None, **kwargs: Any) -> None:
        self.name, self.seed, self.kwargs = name, seed, kwargs
        self._inner = self._make(None)

    def _make(self, number: int | None) -> BaseSampler:
        seed = None if self.seed is None else (self.seed if number is None else (self.seed * 1_000_003 + number) % 2**31)
        return _SAMPLERS[self.name](seed=seed, **self.kwargs)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._inner = self._make(trial.number)
        self._inner.before_trial(study, trial)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self._inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return self._inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution) -> Any:
        return self._inner.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None) -> None:
        self._inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._inner.reseed_rng()


# ---------------------------------------------------------------------------------------------------------- storage
# trial attributes of a run that a retry must not inherit (the retry writes its own)
_RUN_ATTRS = ("log_dir", "fit_config", "seconds", "history", "fail_kind", "fail_reason", "pruned_reason", "export_dir")


class RetryStaleTrial(RetryCallback):
    """Optuna's ``RetryHeartbeatStaleTrialCallback`` (once) for stale trials, recording on the retry which trial it repeats
    (``retry_of``) and why (``retry_reason``); a retry that goes stale in turn is not retried again."""

    def __init__(self, grace_period: int) -> None:
        super().__init__(max_retry=1)
        self.grace_period = grace_period

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        worker = trial.user_attrs.get("worker", "an unknown worker")
        reason = (f"trial {trial.number} (worker {worker}) sent no heartbeat for {self.grace_period} s: the worker was "
                  "killed or hung; retried once with the same parameters")
        if RetryCallback.retry_history(trial):
            log.warning("trial %d, itself a retry, went stale too (worker %s): not retried again", trial.number, worker)
            return
        log.warning("%s", reason)
        retry = copy.deepcopy(trial)
        retry.user_attrs = {**{k: v for k, v in trial.user_attrs.items() if k not in _RUN_ATTRS},
                            "retry_of": trial.number, "retry_reason": reason}
        super().__call__(study, retry)


def default_storage_url(runs_dir: Path) -> str:
    return f"sqlite:///{(runs_dir / 'optuna.db').resolve()}"


def open_storage(url: str, heartbeat_interval: int = HEARTBEAT_INTERVAL_S,
                 grace_period: int = HEARTBEAT_GRACE_S) -> optuna.storages.RDBStorage:
    """An RDB storage with a heartbeat (stale trials of killed workers are failed, and retried once) and SQLite's
    busy timeout."""
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        db = url.split("///", 1)[-1]
        if db and db != ":memory:":
            Path(db).parent.mkdir(parents=True, exist_ok=True)
        engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    from sqlalchemy.exc import IntegrityError, OperationalError

    params = inspect.signature(optuna.storages.RDBStorage).parameters  # Optuna 5 renamed the stale-trial callback
    callback = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params else "failed_trial_callback"
    for attempt in range(6):
        try:
            return optuna.storages.RDBStorage(
                url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                **{callback: RetryStaleTrial(grace_period)},
            )
        except (IntegrityError, OperationalError):
            # workers started together on a new database race to create its tables and version row: the loser
            # finds them created when it tries again
            if attempt == 5:
                raise
            time.sleep(0.2 * (attempt + 1) + 0.1 * (os.getpid() % 7))
    raise AssertionError("unreachable")


def open_study(cfg: TuneConfig, storage: str, study_name: str, create: bool = True) -> optuna.Study:
    """Create or resume the study; a resumed study must keep its objective directions."""
    store = open_storage(storage, cfg.heartbeat_interval, cfg.heartbeat_grace)
    sampler = TrialSeededSampler(cfg.sampler["name"], cfg.sampler.get("seed"),
                                 **{k: v for k, v in cfg.sampler.items() if k not in ("name", "seed")})
    pruner = make_pruner(cfg.pruner)
    if not create:
        try:
            return optuna.load_study(study_name=study_name, storage=store, sampler=sampler, pruner=pruner)
        except KeyError:
            names = optuna.get_all_study_names(store)
            raise TuneConfigError(f"no study {study_name!r} in {storage} (studies there: {names})") from None
    study = optuna.create_study(study_name=study_name, storage=store, sampler=sampler, pruner=pruner,
                                directions=cfg.directions, load_if_exists=True)
    wanted = [StudyDirection.MAXIMIZE if d == "maximize" else StudyDirection.MINIMIZE for d in cfg.directions]
    if list(study.directions) != wanted:
        raise TuneConfigError(
            f"study {study_name!r} in {storage} optimises {[d.name.lower() for d in study.directions]}, but "
            f"{cfg.path} asks for {cfg.directions}; use another --study-name"
        )
    record = {"foxhunt:metrics": [o.metric for o in cfg.objectives],
              "foxhunt:search_space": {p.key: p.describe() for p in cfg.search_space},
              "foxhunt:base_config": str(cfg.base_config)}
    old = study.user_attrs
    if "foxhunt:search_space" in old and old["foxhunt:search_space"] != record["foxhunt:search_space"]:
        log.warning("study %r was started with another search space; Optuna continues with the new one", study_name)
    if "foxhunt:metrics" in old and old["foxhunt:metrics"] != record["foxhunt:metrics"]:
        raise TuneConfigError(f"study {study_name!r} optimises {old['foxhunt:metrics']}, not "
                              f"{record['foxhunt:metrics']}; use another --study-name")
    for k, v in record.items():
        if old.get(k) != v:
            study.set_user_attr(k, v)
    return study


def counts_toward_budget(t: FrozenTrial) -> bool:
    """Finished trials that used up the budget: complete, pruned, or failed by an error or out of memory."""
    if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return t.state == TrialState.FAIL and t.user_attrs.get("fail_kind") in COUNTED_FAIL_KINDS


def _budget_used(study: optuna.Study, before: int | None = None, exclude: int | None = None) -> int:
    """Counted plus running trials (optionally only those numbered below ``before``)."""
    n = 0
    for t in study.get_trials(deepcopy=False):
        if t.number == exclude or (before is not None and t.number >= before):
            continue
        n += counts_toward_budget(t) or t.state in (TrialState.RUNNING, TrialState.WAITING)
    return n
