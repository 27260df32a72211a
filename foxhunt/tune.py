"""`python -m foxhunt.tune --config lightning_configs/tune.yaml`: Optuna studies over ``foxhunt.fit`` configs.

A tune config (YAML) names a base fit config, a search space over any dotted fit key (``model.tft.hidden_size``,
``data.lookback``, ``trainer.max_epochs``...), the objective(s), the sampler and the pruner. Each trial writes the
fit config it runs (base + ``fixed`` + its parameters) to ``<runs_dir>/<study>/trial_<n>/fit_config.yaml``, trains it
through :func:`foxhunt.fit.build_cli` with TensorBoard logging into the same folder, and reports the objective.

Storage is an Optuna RDB (SQLite under ``runs/`` by default, any SQLAlchemy URL otherwise), so a study survives a
crash, the same command resumes it, and several processes on one storage and study name share it. ``n_trials`` is
the study's total, shared by all workers: a worker starts a trial only while finished-and-counted plus running
trials stay below it (``MaxTrialsCallback`` checks only after a trial ends, so two workers overshoot; here a worker
that loses the race for the last slot records a zero-cost "surplus" trial that does not count). Each trial's sampler
randomness is seeded from (seed, trial number), so seeded studies are reproducible and parallel workers do not
propose the same parameters.

Failures: a non-finite loss or gradient (the guard's NonFiniteError) or a NaN objective prunes the trial (a bad
region the sampler should learn to avoid); an out-of-memory error or any other exception fails it; in every case the
reason is a user attribute (``fail_kind``/``fail_reason`` or ``pruned_reason``) and the study continues. Ctrl-C
marks the running trial failed with ``fail_kind=interrupted`` (it does not count, so the next run replaces it) and
leaves the storage consistent; a worker killed outright is found by Optuna's heartbeat and failed as stale.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import signal
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import yaml
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback

log = logging.getLogger("foxhunt.tune")

SQLITE_TIMEOUT_S = 60
HEARTBEAT_INTERVAL_S = 30
HEARTBEAT_GRACE_S = 120
COUNTED_FAIL_KINDS = ("error", "oom")  # failures that used up a trial; interrupted, surplus and stale ones do not


class TuneConfigError(ValueError):
    """A tune config or its base fit config is invalid (raised before any trial runs, naming the file and field)."""


# ----------------------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SearchParam:
    """One dimension of the search space: a dotted fit key and its Optuna distribution."""

    key: str
    kind: str  # float | int | categorical
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    @property
    def encoded(self) -> bool:
        """Optuna's categorical choices are scalars; lists or mappings are stored as their JSON text."""
        return self.kind == "categorical" and any(isinstance(c, (list, tuple, dict)) for c in self.choices)

    def suggest(self, trial: optuna.Trial) -> Any:
        """The trial's value for this key (decoded: what the fit config receives)."""
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        labels = [json.dumps(c) for c in self.choices] if self.encoded else list(self.choices)
        return self.decode(trial.suggest_categorical(self.key, labels))

    def decode(self, value: Any) -> Any:
        return json.loads(value) if self.encoded else value

    def describe(self) -> dict[str, Any]:
        if self.kind == "categorical":
            return {"type": "categorical", "choices": list(self.choices)}
        out: dict[str, Any] = {"type": self.kind, "low": self.low, "high": self.high, "log": self.log}
        if self.step is not None:
            out["step"] = self.step
        return out


@dataclass(frozen=True)
class Objective:
    """A logged metric to optimise; ``reduce`` picks its best or last value over the trial's validations."""

    metric: str = "val/sharpe"
    direction: str = "maximize"
    reduce: str = "best"

    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == "maximize" else a < b

    def value(self, history: Sequence[float]) -> float:
        finite = [v for v in history if math.isfinite(v)]
        if not history:
            return float("nan")
        if self.reduce == "last" or not finite:
            return history[-1]
        return max(finite) if self.direction == "maximize" else min(finite)


@dataclass(frozen=True)
class TuneConfig:
    """A study: what to train, what to search, what to optimise and how."""

    path: Path
    base_config: Path
    study_name: str
    search_space: tuple[SearchParam, ...]
    objectives: tuple[Objective, ...] = (Objective(),)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    sampler: Mapping[str, Any] = field(default_factory=lambda: {"name": "tpe", "seed": 0})
    pruner: Mapping[str, Any] = field(default_factory=lambda: {"name": "median"})
    storage: str | None = None
    runs_dir: Path = Path("runs")
    n_trials: int | None = None
    timeout: float | None = None
    progress_bar: bool = False

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    def param(self, key: str) -> SearchParam:
        return next(p for p in self.search_space if p.key == key)


_TOP_KEYS = {"base_config", "study_name", "search_space", "objective", "fixed", "sampler", "pruner", "storage",
             "runs_dir", "n_trials", "timeout", "progress_bar"}


def load_tune_config(path: str | Path) -> TuneConfig:
    """Read and validate a tune config; every error names the file and the field."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise TuneConfigError(f"{where}: no such tune config")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise TuneConfigError(f"{where}: a tune config is a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise TuneConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(_TOP_KEYS)}")
    if "base_config" not in raw:
        raise TuneConfigError(f"{where}: 'base_config' (the foxhunt.fit config to tune) is required")
    base = _resolve_base(path, str(raw["base_config"]))
    space = raw.get("search_space") or {}
    if not isinstance(space, dict) or not space:
        raise TuneConfigError(f"{where}: 'search_space' must map dotted fit keys to distributions, got {space!r}")
    params = tuple(_parse_param(where, str(k), v) for k, v in space.items())
    objectives = _parse_objectives(where, raw.get("objective", {"metric": "val/sharpe", "direction": "maximize"}))
    fixed = raw.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise TuneConfigError(f"{where}: 'fixed' must map dotted fit keys to values, got {fixed!r}")
    clash = sorted(set(fixed) & {p.key for p in params})
    if clash:
        raise TuneConfigError(f"{where}: key(s) {clash} are both fixed and searched")
    sampler = _parse_named(where, "sampler", raw.get("sampler"), {"name": "tpe", "seed": 0}, _SAMPLERS)
    default_pruner = "none" if len(objectives) > 1 else "median"
    pruner = _parse_named(where, "pruner", raw.get("pruner"), {"name": default_pruner}, _PRUNERS)
    if len(objectives) > 1 and pruner["name"] != "none":
        raise TuneConfigError(
            f"{where}: pruner {pruner['name']!r} needs a single objective (Optuna's Trial.report does not support "
            "multi-objective studies); set 'pruner: {name: none}'"
        )
    n_trials = raw.get("n_trials")
    if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 1):
        raise TuneConfigError(f"{where}: 'n_trials' must be a positive integer or null, got {n_trials!r}")
    timeout = raw.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise TuneConfigError(f"{where}: 'timeout' must be a positive number of seconds or null, got {timeout!r}")
    return TuneConfig(
        path=path.resolve(),
        base_config=base,
        study_name=str(raw.get("study_name") or path.stem),
        search_space=params,
        objectives=objectives,
        fixed=dict(fixed),
        sampler=sampler,
        pruner=pruner,
        storage=raw.get("storage"),
        runs_dir=Path(raw.get("runs_dir") or "runs"),
        n_trials=n_trials,
        timeout=float(timeout) if timeout is not None else None,
        progress_bar=bool(raw.get("progress_bar", False)),
    )


def _resolve_base(path: Path, base: str) -> Path:
    """Relative to the tune config's folder, else to the working directory."""
    candidates = [Path(base)] if Path(base).is_absolute() else [path.parent / base, Path(base)]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise TuneConfigError(f"{path}: base_config {base!r} not found (looked at {', '.join(map(str, candidates))})")


def _parse_param(where: str, key: str, spec: Any) -> SearchParam:
    at = f"{where}: search_space.{key}"
    if isinstance(spec, list):
        spec = {"type": "categorical", "choices": spec}
    if not isinstance(spec, dict):
        raise TuneConfigError(f"{at}: expected a mapping with 'type' (float, int, categorical) or a list of choices")
    allowed = {"type", "low", "high", "log", "step", "choices"}
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise TuneConfigError(f"{at}: unknown field(s) {unknown}; expected some of {sorted(allowed)}")
    kind = spec.get("type")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise TuneConfigError(f"{at}: categorical needs a non-empty list 'choices'")
        return SearchParam(key, "categorical", choices=tuple(choices))
    if kind not in ("float", "int"):
        raise TuneConfigError(f"{at}: type must be float, int or categorical, got {kind!r}")
    if "low" not in spec or "high" not in spec:
        raise TuneConfigError(f"{at}: {kind} needs 'low' and 'high'")
    try:
        low, high = float(spec["low"]), float(spec["high"])
        step = None if spec.get("step") is None else float(spec["step"])
    except (TypeError, ValueError) as e:
        raise TuneConfigError(f"{at}: low, high and step must be numbers ({e})") from None
    if kind == "int" and not all(float(v).is_integer() for v in (low, high, step or 1)):
        raise TuneConfigError(f"{at}: int bounds and step must be whole numbers")
    if not low < high:
        raise TuneConfigError(f"{at}: need low < high, got {low} and {high}")
    log_scale = bool(spec.get("log", False))
    if log_scale and low <= 0:
        raise TuneConfigError(f"{at}: a log scale needs low > 0, got {low}")
    if log_scale and step is not None and not (kind == "int" and step == 1):
        raise TuneConfigError(f"{at}: 'step' and 'log' cannot be combined")
    return SearchParam(key, kind, low=low, high=high, log=log_scale, step=step)


def _parse_objectives(where: str, spec: Any) -> tuple[Objective, ...]:
    items = spec if isinstance(spec, list) else [spec]
    out = []
    for i, item in enumerate(items):
        at = f"{where}: objective" + (f"[{i}]" if isinstance(spec, list) else "")
        if isinstance(item, str):
            item = {"metric": item}
        if not isinstance(item, dict) or "metric" not in item:
            raise TuneConfigError(f"{at}: expected a mapping with 'metric' (and 'direction', 'reduce'), got {item!r}")
        unknown = sorted(set(item) - {"metric", "direction", "reduce"})
        if unknown:
            raise TuneConfigError(f"{at}: unknown field(s) {unknown}")
        direction = str(item.get("direction", "maximize"))
        if direction not in ("maximize", "minimize"):
            raise TuneConfigError(f"{at}: direction must be maximize or minimize, got {direction!r}")
        reduce = str(item.get("reduce", "best"))
        if reduce not in ("best", "last"):
            raise TuneConfigError(f"{at}: reduce must be best or last, got {reduce!r}")
        out.append(Objective(str(item["metric"]), direction, reduce))
    if not out:
        raise TuneConfigError(f"{where}: objective is empty")
    if len({o.metric for o in out}) != len(out):
        raise TuneConfigError(f"{where}: objective metrics must differ")
    return tuple(out)


_SAMPLERS: dict[str, Callable[..., BaseSampler]] = {
    "tpe": optuna.samplers.TPESampler,
    "random": optuna.samplers.RandomSampler,
    "cmaes": optuna.samplers.CmaEsSampler,
    "gp": optuna.samplers.GPSampler,
    "nsgaii": optuna.samplers.NSGAIISampler,
    "qmc": optuna.samplers.QMCSampler,
}
_PRUNERS: dict[str, Callable[..., optuna.pruners.BasePruner]] = {
    "median": optuna.pruners.MedianPruner,
    "percentile": optuna.pruners.PercentilePruner,
    "hyperband": optuna.pruners.HyperbandPruner,
    "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
    "none": optuna.pruners.NopPruner,
}


def _parse_named(where: str, what: str, spec: Any, default: dict[str, Any], table: Mapping[str, Callable[..., Any]]) -> dict[str, Any]:
    if spec is None:
        spec = default
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or "name" not in spec:
        raise TuneConfigError(f"{where}: {what} must be a mapping with 'name' (one of {sorted(table)}), got {spec!r}")
    spec = {**({"seed": 0} if what == "sampler" else {}), **spec}
    name = str(spec["name"])
    if name not in table:
        raise TuneConfigError(f"{where}: {what}.name must be one of {sorted(table)}, got {name!r}")
    kwargs = {k: v for k, v in spec.items() if k not in ("name", "seed")}
    try:  # build once now so a bad argument fails before any trial
        table[name](**kwargs) if what == "pruner" else table[name](seed=0, **kwargs)
    except (TypeError, ValueError) as e:
        raise TuneConfigError(f"{where}: {what} {name!r} rejects its arguments {kwargs}: {e}") from None
    return dict(spec)


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
def default_storage_url(runs_dir: Path) -> str:
    return f"sqlite:///{(runs_dir / 'optuna.db').resolve()}"


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """An RDB storage with a heartbeat (stale trials of killed workers are failed) and SQLite's busy timeout."""
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        db = url.split("///", 1)[-1]
        if db and db != ":memory:":
            Path(db).parent.mkdir(parents=True, exist_ok=True)
        engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(6):
        try:
            return optuna.storages.RDBStorage(
                url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_INTERVAL_S,
                grace_period=HEARTBEAT_GRACE_S,
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
    store = open_storage(storage)
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


# -------------------------------------------------------------------------------------------------- fit configs
def set_dotted(config: dict[str, Any], key: str, value: Any) -> None:
    """Set ``model.tft.hidden_size`` in a nested fit config (stepping into ``init_args`` where a class is given)."""
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, dict) and "init_args" in node and part not in ("init_args", "class_path"):
            node = node["init_args"]
        nxt = node.get(part) if isinstance(node, dict) else None
        if nxt is None:
            if isinstance(node, dict) and part in node:
                raise TuneConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])} is null in the base config")
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise TuneConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])} is {nxt!r}, not a section")
        node = nxt
    if "init_args" in node and parts[-1] not in ("init_args", "class_path"):
        node = node["init_args"]
    node[parts[-1]] = value


def compose_fit_config(cfg: TuneConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """The base fit config with the fixed keys and a trial's (decoded) parameters set."""
    config = yaml.safe_load(cfg.base_config.read_text()) or {}
    for key, value in {**cfg.fixed, **params}.items():
        set_dotted(config, key, value)
    return config


def decoded_params(cfg: TuneConfig, trial: FrozenTrial) -> dict[str, Any]:
    keys = {p.key for p in cfg.search_space}
    return {k: (cfg.param(k).decode(v) if k in keys else v) for k, v in trial.params.items()}


def write_fit_config(config: Mapping[str, Any], path: Path, header: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False)
    path.write_text("".join(f"# {line}\n" for line in header.splitlines()) + body)
    return path


class FitConfigParser:
    """foxhunt.fit's own parser, for checking configs without building data or models."""

    def __init__(self, first: Path) -> None:
        """Build the parser by parsing ``first`` (LightningCLI parses as it builds); check() reuses it."""
        from foxhunt.data.datamodule import BarDataModule
        from foxhunt.fit import FoxhuntCLI, default_trainer_kwargs
        from foxhunt.lit.ensemble import EnsembleModule

        class _ParseOnly(FoxhuntCLI):
            def instantiate_classes(self) -> None:
                pass

        with warnings.catch_warnings(), self._errors(first):
            warnings.simplefilter("ignore")
            self.parser = _ParseOnly(EnsembleModule, BarDataModule, subclass_mode_model=False, subclass_mode_data=False,
                                     trainer_defaults=default_trainer_kwargs(), args=["--config", str(first)],
                                     run=False).parser

    @staticmethod
    @contextlib.contextmanager
    def _errors(path: Path) -> Iterator[None]:
        """jsonargparse prints its error and exits: turn that into TuneConfigError with its message."""
        import io

        stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            yield
        except SystemExit:
            message = sys.stderr.getvalue().strip()
            if "error:" in message:  # jsonargparse prints its usage first; keep the error
                message = message[message.index("error:"):]
            sys.stderr = stderr
            raise TuneConfigError(f"{path}: foxhunt.fit rejects this config:\n{message}") from None
        else:
            stderr.write(sys.stderr.getvalue())  # nothing printed on the way is lost
        finally:
            sys.stderr = stderr

    def check(self, path: Path) -> None:
        with self._errors(path):
            self.parser.parse_args(["--config", str(path)])


def _check_search_space(cfg: TuneConfig) -> None:
    """Every searched key at its low end, and every categorical choice, must give a config foxhunt.fit accepts."""
    import tempfile

    corners: list[dict[str, Any]] = [{}]
    for p in cfg.search_space:
        if p.kind == "categorical":
            corners += [{p.key: c} for c in p.choices[1:]]
    first = {p.key: (p.choices[0] if p.kind == "categorical" else (int(p.low) if p.kind == "int" else p.low))
             for p in cfg.search_space}
    parser: FitConfigParser | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, corner in enumerate(corners):
            path = write_fit_config(compose_fit_config(cfg, {**first, **corner}), Path(tmp) / f"check{i}.yaml")
            try:
                if parser is None:
                    parser = FitConfigParser(path)
                else:
                    parser.check(path)
            except TuneConfigError as e:
                raise TuneConfigError(f"{cfg.path}: the search space gives invalid fit configs ({e})") from None


# ----------------------------------------------------------------------------------------------------- a trial
class TrialError(RuntimeError):
    """A trial failed; the study records it and goes on."""


class MetricMissingError(TuneConfigError):
    """The objective metric is not logged: every trial would fail, so the study stops."""


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
        config_path = write_fit_config(
            compose_fit_config(self.cfg, params), out / "fit_config.yaml",
            f"trial {trial.number} of study {self.study_name} (foxhunt.tune)\nparams: {json.dumps(params)}",
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
                "--trainer.default_root_dir", str(out), "--export_dir", str(out / "export"), "--backtest", "false"]
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
        except optuna.TrialPruned as e:
            trial.set_user_attr("pruned_reason", str(e) or "pruned")
            self._record_history(trial, recorder)
            raise
        except TrialError:
            raise
        except SystemExit as e:  # Lightning turns Ctrl-C into sys.exit(1) after its graceful shutdown
            if cli is not None and cli.trainer.state.status == TrainerStatus.INTERRUPTED:
                self._interrupted(trial, recorder)
                raise KeyboardInterrupt from e
            trial.set_user_attr("fail_kind", "error")
            trial.set_user_attr("fail_reason", f"SystemExit({e.code}) during the trial")
            raise TrialError(f"the trial exited with {e.code}") from e
        except KeyboardInterrupt:
            self._interrupted(trial, recorder)
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

    def _interrupted(self, trial: optuna.Trial, recorder: Any) -> None:
        with contextlib.suppress(Exception):  # a second Ctrl-C must not leave the trial RUNNING
            self._record_history(trial, recorder)
            trial.set_user_attr("fail_kind", "interrupted")
            trial.set_user_attr("fail_reason", "KeyboardInterrupt (Ctrl-C); the next run replaces this trial")


# -------------------------------------------------------------------------------------------------------- a study
@dataclass
class StudyRun:
    study: optuna.Study
    cfg: TuneConfig
    storage: str
    ran: list[int] = field(default_factory=list)
    interrupted: bool = False


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

    KeyboardInterrupt propagates after the running trial is marked ``interrupted``.
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
                if used >= n_trials:
                    log.info("study %r holds %d of %d trials (counted or running): done", name, used, n_trials)
                    break
            before = {t.number for t in study.get_trials(deepcopy=False)}
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is experimental.*")
                study.optimize(objective, n_trials=1, catch=(TrialError,), gc_after_trial=True)
            run.ran += sorted({t.number for t in study.get_trials(deepcopy=False)
                               if t.user_attrs.get("worker") == objective.worker} - before)
    except KeyboardInterrupt:
        run.interrupted = True
        _release_own_trials(study, objective.worker)
        raise
    return run


def _release_own_trials(study: optuna.Study, worker: str) -> None:
    """Fail this worker's trials that an interrupt left RUNNING (e.g. Ctrl-C during a storage write)."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("worker") == worker:
            with contextlib.suppress(Exception):
                study._storage.set_trial_user_attr(t._trial_id, "fail_kind", "interrupted")
                study.tell(t.number, state=TrialState.FAIL)


# ------------------------------------------------------------------------------------------------------- summary
def _kind(t: FrozenTrial) -> str:
    if t.state == TrialState.FAIL:
        return str(t.user_attrs.get("fail_kind", "stale"))
    return t.state.name.lower()


def summarize(study: optuna.Study, cfg: TuneConfig, out_dir: Path | None = None, plots: bool = True) -> dict[str, Any]:
    """Best trial(s), ready fit configs, importances and plots, written under ``out_dir`` (default runs/<study>/best)."""
    out_dir = out_dir or cfg.runs_dir / study.study_name / "best"
    out_dir.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for t in trials:
        counts[_kind(t)] = counts.get(_kind(t), 0) + 1
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    summary: dict[str, Any] = {
        "study": study.study_name,
        "objectives": [{"metric": o.metric, "direction": o.direction, "reduce": o.reduce} for o in cfg.objectives],
        "n_trials": len(trials),
        "counts": counts,
        "pruned": [t.number for t in trials if t.state == TrialState.PRUNED],
        "failed": {t.number: t.user_attrs.get("fail_reason", _kind(t)) for t in trials if t.state == TrialState.FAIL},
        "best": [],
        "importances": {},
        "plots": [],
    }
    best_trials = study.best_trials if complete else []
    for t in best_trials:
        params = decoded_params(cfg, t)
        name = "config.yaml" if not cfg.multi_objective else f"config_trial_{t.number}.yaml"
        values = dict(zip([o.metric for o in cfg.objectives], t.values, strict=True))
        path = write_fit_config(
            compose_fit_config(cfg, params), out_dir / name,
            f"best trial {t.number} of study {study.study_name}: {json.dumps(values)}\n"
            f"written by foxhunt.tune; run: python -m foxhunt.fit --config {out_dir / name}",
        )
        summary["best"].append({"number": t.number, "values": values, "params": params, "config": str(path),
                                "log_dir": t.user_attrs.get("log_dir"), "export_dir": t.user_attrs.get("export_dir")})
    for i, o in enumerate(cfg.objectives):
        target = (lambda t, i=i: t.values[i]) if cfg.multi_objective else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                summary["importances"][o.metric] = {
                    k: round(v, 4) for k, v in optuna.importance.get_param_importances(study, target=target).items()
                }
        except (RuntimeError, ValueError) as e:
            summary["importances"][o.metric] = f"n/a: {e}"
        if plots and complete:
            summary["plots"] += _plots(study, target, o.metric, out_dir, i if cfg.multi_objective else None,
                                       isinstance(summary["importances"][o.metric], dict))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["summary_path"] = str(out_dir / "summary.json")
    return summary


def _plots(study: optuna.Study, target: Callable[[FrozenTrial], float] | None, metric: str, out_dir: Path,
           index: int | None, importances: bool) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    suffix = "" if index is None else f"_{index}"
    written = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        makers = [("optimization_history", ovm.plot_optimization_history)]
        if importances:
            makers.append(("param_importances", ovm.plot_param_importances))
        for name, fn in makers:
            ax = fn(study, target=target, target_name=metric)
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            path = out_dir / f"{name}{suffix}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(str(path))
    return written


def format_summary(summary: Mapping[str, Any], storage: str) -> str:
    counts = ", ".join(f"{v} {k}" for k, v in sorted(summary["counts"].items()))
    lines = [f"\nstudy {summary['study']!r}: {summary['n_trials']} trials ({counts})"]
    if summary["pruned"]:
        lines.append(f"  pruned: {summary['pruned']}")
    for number, reason in summary["failed"].items():
        lines.append(f"  failed trial {number}: {reason}")
    if not summary["best"]:
        lines.append("  no complete trial yet")
    for b in summary["best"]:
        vals = ", ".join(f"{k}={v:.6g}" for k, v in b["values"].items())
        lines.append(f"  best trial {b['number']}: {vals}")
        lines += [f"    {k}: {v}" for k, v in b["params"].items()]
        lines.append(f"    fit config: {b['config']}")
        lines.append(f"    weights:    {b['export_dir']}")
    for metric, imp in summary["importances"].items():
        text = ", ".join(f"{k} {v:.2f}" for k, v in imp.items()) if isinstance(imp, dict) else imp
        lines.append(f"  importances ({metric}): {text}")
    for p in summary["plots"]:
        lines.append(f"  plot: {p}")
    lines.append(f"  summary: {summary['summary_path']}")
    lines.append(f"  dashboard: optuna-dashboard {storage}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m foxhunt.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="tune config YAML (base fit config, search space, objective...)")
    p.add_argument("--n-trials", type=int, default=None,
                   help="the study's total of trials, shared by all workers (default: the config's n_trials)")
    p.add_argument("--timeout", type=float, default=None, help="stop starting trials after this many seconds")
    p.add_argument("--storage", default=None, help="SQLAlchemy URL (default: sqlite:///<runs_dir>/optuna.db)")
    p.add_argument("--study-name", default=None, help="default: the config's study_name")
    p.add_argument("--best", action="store_true",
                   help="run no trial: print the best trial(s), write their fit configs, importances and plots")
    return p


@contextlib.contextmanager
def _logging() -> Iterator[None]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    optuna.logging.set_verbosity(optuna.logging.INFO)
    yield


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or resume, or join) a study; print the summary. Exit codes: 0 done, 2 bad config, 130 interrupted."""
    args = _parser().parse_args(argv)
    with _logging():
        try:
            cfg = load_tune_config(args.config)
            if args.n_trials is not None and args.n_trials < 1:
                raise TuneConfigError(f"--n-trials must be positive, got {args.n_trials}")
            storage = args.storage or cfg.storage or default_storage_url(cfg.runs_dir)
            name = args.study_name or cfg.study_name
            code = 0
            if args.best:
                study = open_study(cfg, storage, name, create=False)
            else:
                try:
                    study = run_study(cfg, args.n_trials, args.timeout, storage, name).study
                except KeyboardInterrupt:
                    print("\ninterrupted: the running trial is marked failed (interrupted); rerun to resume",
                          file=sys.stderr)
                    study, code = open_study(cfg, storage, name), 130
        except TuneConfigError as e:
            print(f"foxhunt.tune: {e}", file=sys.stderr)
            return 2
        print(format_summary(summarize(study, cfg), storage))
        return code


if __name__ == "__main__":
    sys.exit(main())
