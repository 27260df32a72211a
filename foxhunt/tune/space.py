"""The tune config: search space (parsed, sampled per dotted fit key), objectives, and the fit configs it gives."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial

from foxhunt.cli_errors import ConfigError, UserError, one_line

HEARTBEAT_INTERVAL_S = 30  # a running trial's heartbeat; one silent for the grace period is stale (killed worker)
HEARTBEAT_GRACE_S = 120


class TuneConfigError(UserError, ValueError):
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
    heartbeat_interval: int = HEARTBEAT_INTERVAL_S
    heartbeat_grace: int = HEARTBEAT_GRACE_S

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    def param(self, key: str) -> SearchParam:
        return next(p for p in self.search_space if p.key == key)


_TOP_KEYS = {"base_config", "study_name", "search_space", "objective", "fixed", "sampler", "pruner", "storage",
             "runs_dir", "n_trials", "timeout", "progress_bar", "heartbeat_interval", "heartbeat_grace"}


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
    beat = {"heartbeat_interval": raw.get("heartbeat_interval", HEARTBEAT_INTERVAL_S),
            "heartbeat_grace": raw.get("heartbeat_grace", HEARTBEAT_GRACE_S)}
    for k, v in beat.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TuneConfigError(f"{where}: '{k}' must be a positive whole number of seconds, got {v!r}")
    if beat["heartbeat_grace"] <= beat["heartbeat_interval"]:
        raise TuneConfigError(f"{where}: 'heartbeat_grace' ({beat['heartbeat_grace']} s) must exceed "
                              f"'heartbeat_interval' ({beat['heartbeat_interval']} s), or live trials look stale")
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
        heartbeat_interval=beat["heartbeat_interval"],
        heartbeat_grace=beat["heartbeat_grace"],
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


# -------------------------------------------------------------------------------------------------- fit configs
_CLASS_KEYS = ("class_path", "init_args")


def _class_args(node: dict[str, Any], part: str, key: str, where: Sequence[str]) -> dict[str, Any]:
    """The section that holds ``part``: where ``node`` gives a class, its ``init_args`` (created if missing or null)."""
    if part in _CLASS_KEYS or not any(k in node for k in _CLASS_KEYS):
        return node
    args = node.get("init_args")
    if args is None:
        args = node["init_args"] = {}
    if not isinstance(args, dict):
        raise TuneConfigError(f"cannot set {key!r}: {'.'.join([*where, 'init_args'])} is {args!r}, not a section")
    return args


def set_dotted(config: dict[str, Any], key: str, value: Any) -> None:
    """Set ``model.members.tft.hidden_size`` (or ``model.tft.hidden_size``...) in a nested fit config.

    At any depth, a section that gives a class (``class_path``/``init_args``) takes the keys under its ``init_args``:
    ``model.members.tft.hidden_size`` sets ``model["members"]["tft"]["init_args"]["hidden_size"]``.
    """
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, dict):
            node = _class_args(node, part, key, parts[:i])
        nxt = node.get(part) if isinstance(node, dict) else None
        if nxt is None:
            if isinstance(node, dict) and part in node:
                raise TuneConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])} is null in the base config")
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise TuneConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])} is {nxt!r}, not a section")
        node = nxt
    node = _class_args(node, parts[-1], key, parts[:-1])
    node[parts[-1]] = value


def compose_fit_config(cfg: TuneConfig, params: Mapping[str, Any], trainer: bool = True) -> dict[str, Any]:
    """The base fit config with the fixed keys and a trial's (decoded) parameters set; ``trainer=False`` leaves the
    base config's ``trainer`` as it is (:func:`trainer_overrides` are then given on the command line)."""
    config = yaml.safe_load(cfg.base_config.read_text()) or {}
    for key, value in {**cfg.fixed, **params}.items():
        if trainer or not key.startswith("trainer."):
            set_dotted(config, key, value)
    return config


def trainer_overrides(cfg: TuneConfig, params: Mapping[str, Any]) -> list[str]:
    """The fixed keys' and parameters' ``trainer.*`` settings as foxhunt.fit arguments: given on the command line,
    not in the trial's config file, so that a trial shortened from the base config's run (e.g. ``fixed:
    {trainer.max_epochs: 1}``) scales the settings that outlast it, as a shortened fit does (foxhunt.lit.run_plan)."""
    return [arg for key, value in {**cfg.fixed, **params}.items() if key.startswith("trainer.")
            for arg in (f"--{key}", json.dumps(value))]


def decoded_params(cfg: TuneConfig, trial: FrozenTrial) -> dict[str, Any]:
    keys = {p.key for p in cfg.search_space}
    return {k: (cfg.param(k).decode(v) if k in keys else v) for k, v in trial.params.items()}


def write_fit_config(config: Mapping[str, Any], path: Path, header: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False)
    path.write_text("".join(f"# {line}\n" for line in header.splitlines()) + body)
    return path


class FitConfigParser:
    """foxhunt.fit's own parser, for checking configs without loading data or training: ``check`` parses a config and
    builds its data module and model (their constructors check every value), as foxhunt.fit would."""

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
            cli = _ParseOnly(EnsembleModule, BarDataModule, subclass_mode_model=False, subclass_mode_data=False,
                             trainer_defaults=default_trainer_kwargs(), args=["--config", str(first)], run=False)
        self.parser = cli.parser
        self._build(cli.config, first)

    @staticmethod
    @contextlib.contextmanager
    def _errors(path: Path) -> Iterator[None]:
        """jsonargparse prints its error and exits: turn that into TuneConfigError with its message."""
        import io

        stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            yield
        except (argparse.ArgumentError, ConfigError) as e:  # build_cli raises instead of exiting
            sys.stderr = stderr
            raise TuneConfigError(f"{path}: foxhunt.fit rejects this config: {one_line(e)}") from None
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
            config = self.parser.parse_args(["--config", str(path)])
        self._build(config, path)

    def _build(self, config: Any, path: Path) -> None:
        """The config's data module and model, built as foxhunt.fit builds them (no data is loaded, no Trainer)."""
        from foxhunt.fit import check_members, constructor_key

        with warnings.catch_warnings(), self._errors(path):
            warnings.simplefilter("ignore")
            try:
                built = self.parser.instantiate_classes(config)
                check_members(built.model, config)
            except UserError:
                raise
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{constructor_key(e, config)}: {e}") from e


def _check_search_space(cfg: TuneConfig) -> None:
    """Every searched key at its low end, at its high end, and every categorical choice, must give a config that
    foxhunt.fit parses and whose data module and model it builds (every constructor checks its values)."""
    import tempfile

    def end(p: SearchParam, value: float | None) -> Any:
        return int(value) if p.kind == "int" else value

    highs = {p.key: end(p, p.high) for p in cfg.search_space if p.kind != "categorical"}
    corners: list[dict[str, Any]] = [{}, highs] if highs else [{}]
    for p in cfg.search_space:
        if p.kind == "categorical":
            corners += [{p.key: c} for c in p.choices[1:]]
    first = {p.key: (p.choices[0] if p.kind == "categorical" else end(p, p.low)) for p in cfg.search_space}
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
