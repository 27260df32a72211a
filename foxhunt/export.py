"""Export a trained ensemble as safetensors plus JSON metadata, and load it back without a Trainer or pickle.

Files written to the export directory:

- ``ensemble.safetensors``: every tensor of the ensemble (members, combination weights, stacking snapshots and
  statistics) and of the preprocessing (``data.feature_normalizer.*``, ``data.target_transform.*``);
- ``<member>.safetensors``: for use outside foxhunt, each member's network that trades, alone, under the keys of the
  member's ``network``: a forecaster's network; an agent's validation-selected weights (``policy_net``) once it chose
  some, else its learning network; no tensor at all when the agent's selection chose flat (it trades nothing). Its
  safetensors header and ``metadata.json`` ``members.<name>.traded`` say which (``network``, ``policy_net`` or
  ``flat``; an agent's header also records ``selected_update``);
- ``metadata.json``: format version, package versions, the fit config, each member's class, hyperparameters and run
  values, the data spec the members were bound to (feature names in column order, known-future inputs, symbols,
  window sizes), the data fingerprint, the latest validation back-test, the SHA-256 of every tensor file it lists
  (``sha256``) and the SHA-256 of its own canonical form (``metadata_sha256``: sorted keys, no spaces, ASCII, of
  everything but ``metadata_sha256`` and the file hashes in ``sha256``, which the files themselves check).

Every file is written atomically (a temporary file beside it, fsync, rename), metadata.json last. ``load`` verifies
metadata.json's own SHA-256 and each listed file's, validates every metadata field it reads (keys, types, finite
values, the spec, the feature names against the registry, the spec and the normaliser), refuses non-finite tensors
and tensors of another dtype or shape than the model's, and checks that each ``<member>.safetensors`` holds exactly
the weights the loaded member trades with: each refusal is one ``ExportError`` line naming the file and the field or
tensor.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import platform
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from foxhunt.cli_errors import UserError
from foxhunt.data.datamodule import BarDataModule
from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.files import json_safe
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.member import Agent, Member
from foxhunt.version import __version__

FORMAT = "foxhunt-export"
FORMAT_VERSION = 3  # 2: metadata.json records the SHA-256 of every tensor file; 3: and of itself (metadata_sha256),
# and <member>.safetensors holds the weights the member trades (members.<name>.traded)


class ExportError(UserError, ValueError):
    """An export that cannot be loaded into this foxhunt: mismatched version, features or shapes."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _strict_json(meta: dict[str, Any]) -> str:
    """metadata.json's text as strict JSON (jq and JSON.parse refuse a bare NaN): a measured figure without a value
    (a NaN Sharpe) is null; any other non-finite value (a constructor argument, a run value that loading would refuse)
    has no JSON form and stops the export, naming its field."""
    meta = {**meta, "metrics": json_safe(meta["metrics"])}
    try:
        return json.dumps(meta, allow_nan=False)
    except ValueError:
        bad = _non_finite_path(meta)
        raise ExportError(f"metadata.json: {bad}: is not a finite number, which JSON cannot hold") from None


def _non_finite_path(value: Any, where: str = "") -> str:
    """The dotted field of the first NaN or infinity in ``value`` ('' if none)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return where if isinstance(value, float) and not math.isfinite(value) else ""
    for key, v in items:
        found = _non_finite_path(v, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return ""


def _hparams(module: Any) -> dict[str, Any]:
    """Constructor arguments saved by save_hyperparameters, without framework bookkeeping keys."""
    return {k: v for k, v in _jsonable(dict(module.hparams)).items() if not k.startswith("_")}


def _tensors(prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}{k}": v.detach().cpu().contiguous().clone() for k, v in module.state_dict().items()}


TRADED = ("network", "policy_net", "flat")


def traded_network(member: Member) -> tuple[str, torch.nn.Module | None]:
    """Which of a member's networks trades, and that network: a forecaster's ``network``; an agent's
    ``policy_network`` (``policy_net`` once validation chose weights, else the learning ``network``); ``("flat",
    None)`` when the agent's selection found nothing that beats flat, so it holds no position."""
    if isinstance(member, Agent):
        if member.holds_flat:
            return "flat", None
        net = member.policy_network
        return ("policy_net" if member.policy_net is not None and net is member.policy_net else "network"), net
    return "network", member.network


def metadata_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of metadata.json's canonical form (keys sorted, no spaces, ASCII): everything but ``metadata_sha256``
    itself and the tensor files' hashes in ``sha256`` (each checked against its file)."""
    body = {k: v for k, v in meta.items() if k not in ("metadata_sha256", "sha256")}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return _sha256(text.encode("ascii"))


def export_ensemble(model: EnsembleModule, dm: BarDataModule, out_dir: str | Path, config: Any = None) -> dict[str, Any]:
    """Write the export of a fitted EnsembleModule and its BarDataModule; returns the metadata."""
    import lightning

    from foxhunt.data.tensors import fingerprint

    if model.spec is None:
        raise ExportError("the ensemble is not bound to data yet: fit it (or call model.bind(spec)) before exporting")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the target transform is the data side's (saved once, under data.), whichever module also holds a reference
    tensors = {k: v for k, v in _tensors("model.", model).items() if ".target_transform." not in k}
    tensors.update(_tensors("data.feature_normalizer.", dm.feature_normalizer))
    tensors.update(_tensors("data.target_transform.", dm.target_transform))
    files = {"ensemble": "ensemble.safetensors"}
    sha256 = {"ensemble": _save_tensors(tensors, out / files["ensemble"])}
    members = {}
    for name in model.member_names:
        member = model.member(name)
        files[name] = f"{name}.safetensors"
        traded, net = traded_network(member)
        header = {"member": name, "traded": traded}
        if isinstance(member, Agent):
            header["selected_update"] = str(int(member.selected_update))
        sha256[name] = _save_tensors(_tensors("", net) if net is not None else {}, out / files[name], header)
        members[name] = {
            "class_path": f"{type(member).__module__}.{type(member).__qualname__}",
            "init_args": _hparams(member),
            "run": _jsonable(member.export_state()),
            "updates": model.updates[name],
            "traded": traded,
        }
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": {
            "foxhunt": __version__,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "python": platform.python_version(),
        },
        "ensemble": _hparams(model),
        "members": members,
        "stack_ready": model.stack_ready,
        "spec": _jsonable(model.spec.as_dict()),
        "data": {
            "feature_names": list(dm.feature_names),
            "known_future": list(dm.known_future),
            "lookback": dm.lookback,
            "horizon": dm.horizon,
            "symbols": list(dm.train_split.symbols),
            "feature_clip": dm.feature_clip,
            "target_transform": {
                "scale": dm.hparams.target_scale,
                "zscore_window": dm.hparams.target_zscore_window,
                "clip_sigma": dm.hparams.target_clip_sigma,
            },
            "fingerprint": fingerprint(dm.bars) if dm.bars is not None else None,
            "seen_span": seen_span(dm),
        },
        "metrics": _jsonable(model.last_evaluation.metrics if model.last_evaluation is not None else {}),
        "config": config if isinstance(config, str) else _jsonable(config),
        "files": files,
        "sha256": sha256,
    }
    from foxhunt.files import atomic_file

    meta = json.loads(_strict_json(meta))  # what a reader parses (tuples are lists, floats round-trip), then hashed
    meta["metadata_sha256"] = metadata_digest(meta)
    with atomic_file(out / "metadata.json") as tmp:  # last: it vouches for the files above
        tmp.write_text(json.dumps(meta, indent=2, allow_nan=False))
    return meta


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, header: dict[str, str] | None = None) -> str:
    """Write a safetensors file atomically (``header``: more string entries of its metadata); returns its SHA-256."""
    from foxhunt.files import atomic_file

    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, **(header or {})})
    return _sha256(path.read_bytes())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def seen_span(dm: BarDataModule) -> dict[str, list[int]]:
    """Per symbol, the first and last timestamp (ns) of the bars training or selection used (train and validation)."""
    out: dict[str, list[int]] = {}
    for split in (dm.splits.get("train"), dm.splits.get("val")):
        if split is None or len(split) == 0:
            continue
        for code, symbol in enumerate(split.symbols):
            ts = split.timestamps[split.symbol_index == code]
            if ts.numel():
                lo, hi = int(ts.min()), int(ts.max())
                old = out.get(symbol, [lo, hi])
                out[symbol] = [min(old[0], lo), max(old[1], hi)]
    return out


def overlap_with_training(meta: dict[str, Any], split: MarketSplit) -> torch.Tensor:
    """[T] True at the split's bars that fall inside the span of the export's training and validation bars."""
    span = meta["data"].get("seen_span") or {}
    out = torch.zeros(len(split), dtype=torch.bool)
    for code, symbol in enumerate(split.symbols):
        if symbol in span:
            lo, hi = span[symbol]
            rows = split.symbol_index == code
            out |= rows & (split.timestamps >= lo) & (split.timestamps <= hi)
    return out


@dataclass
class LoadedEnsemble:
    """A ready ensemble rebuilt from an export: the model in eval mode and the data side it was trained with."""

    model: EnsembleModule  # used as a plain nn.Module (no Trainer)
    feature_set: Any
    feature_normalizer: torch.nn.Module
    target_transform: torch.nn.Module
    metadata: dict[str, Any]

    @property
    def feature_names(self) -> list[str]:
        return list(self.metadata["data"]["feature_names"])

    def split(self, bars: pd.DataFrame, name: str = "data", oracle_mean: torch.Tensor | None = None) -> MarketSplit:
        """A MarketSplit of new bars: features recomputed, scaled with the exported statistics (``oracle_mean``: the
        known conditional means of simulated bars, row-aligned, for an oracle row in back-tests)."""
        from foxhunt.data.datamodule import assemble_split
        from foxhunt.data.tensors import bars_tensors
        from foxhunt.preprocessing import next_log_returns

        symbols, ts, sym, ohlcv = bars_tensors(bars)
        out = self.feature_set.compute(ohlcv, ts, sym)
        clip = float(self.metadata["data"]["feature_clip"])
        with torch.no_grad():
            features = self.feature_normalizer(out.values).clamp(-clip, clip)
        returns = next_log_returns(ohlcv[:, 3], segment=sym)
        return assemble_split(name, symbols, ts, sym, ohlcv, features, out.ready, returns, self.feature_names, self.target_transform, oracle_mean)

    @torch.no_grad()
    def positions(self, bars: pd.DataFrame) -> dict[str, torch.Tensor]:
        """Positions of each member, the ensemble and buy-and-hold on new bars."""
        return self.model.positions(self.split(bars))

    @torch.no_grad()
    def backtest(self, bars: pd.DataFrame) -> dict[str, dict[str, float]]:
        """After-cost back-test of every policy on new bars."""
        return self.model.evaluate(self.split(bars)).metrics


def load(path: str | Path, map_location: str | torch.device = "cpu") -> LoadedEnsemble:
    """Rebuild an exported ensemble (no Trainer, no pickle). Refuses, with one ExportError line naming the file and the
    field or tensor: a tensor file whose SHA-256 differs from metadata.json's, a missing, unknown or mistyped metadata
    field, mismatched versions, features or shapes, and non-finite tensors."""
    from foxhunt.features import FeatureSet
    from foxhunt.preprocessing import FeatureNormalizer, TargetTransform

    root = Path(path)
    if root.is_file():
        root = root.parent
    meta_path = root / "metadata.json"
    if not meta_path.exists():
        raise ExportError(f"{root}: no metadata.json: not a foxhunt export directory")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{meta_path}: not valid JSON ({e})") from None
    _check_metadata(meta, meta_path)
    data = meta["data"]
    feature_set = FeatureSet(data["feature_names"])
    files = _verified_tensors(root, meta, meta_path)
    state = files.pop("ensemble")[0]
    tensor_file = root / meta["files"]["ensemble"]
    members = {name: _member(entry, meta_path, name) for name, entry in meta["members"].items()}
    model = _build(meta_path, "ensemble", lambda: EnsembleModule(members=members, **meta["ensemble"]))
    _build(meta_path, "spec", lambda: model.bind(MarketSpec(**meta["spec"])))
    tt = data["target_transform"]
    transform = _build(meta_path, "data.target_transform", lambda: TargetTransform(
        scale=tt["scale"], zscore_window=tt["zscore_window"], clip_sigma=tt["clip_sigma"]))
    normalizer = FeatureNormalizer()
    parts: dict[str, tuple[torch.nn.Module, str]] = {
        "model.": (model, "model"),
        "data.feature_normalizer.": (normalizer, "feature normaliser"),
        "data.target_transform.": (transform, "target transform"),
    }
    stray = sorted(k for k in state if not k.startswith(tuple(parts)))
    if stray:
        raise ExportError(
            f"{tensor_file}: unexpected tensors {stray[:5]} (not model., data.feature_normalizer. or "
            "data.target_transform.)"
        )
    defaults = {prefix + k: v for prefix, (module, _) in parts.items() for k, v in module.state_dict().items()}
    _check_finite(state, defaults, tensor_file)
    n_features = len(data["feature_names"])
    for key in ("data.feature_normalizer.mean", "data.feature_normalizer.std"):
        if key in state and tuple(state[key].shape) != (n_features,):
            raise ExportError(
                f"{tensor_file}: tensor {key!r} has shape {tuple(state[key].shape)}, but {meta_path.name} "
                f"data.feature_names lists {n_features} features"
            )
    former: set[str] = set()  # members whose tensors were in a former layout (converted by _upgraded)
    for prefix, (module, what) in parts.items():
        given = {k[len(prefix):]: v.to(map_location) for k, v in state.items() if k.startswith(prefix)}
        own = _upgraded(module, given)
        if module is model and own is not given:
            former = {name for name in meta["members"] if _member_keys(own, name) != _member_keys(given, name)}
        _load_strict(module, own, what, tensor_file, shapes=module is not normalizer)
    for name, entry in meta["members"].items():
        member = model.member(name)
        _build(meta_path, f"members.{name}.run", lambda: member.load_export_state(entry.get("run") or {}))  # noqa: B023
        model.updates[name] = int(entry.get("updates", -1))  # -1: not recorded
        if name in model.forecaster_names:
            member.target_transform = transform  # type: ignore[attr-defined]
        if name not in former:  # a former layout's member file is not the traded network's (it predates that rule)
            tensors, header = files[name]
            _check_traded(member, name, entry, tensors, header, root / meta["files"][name], meta_path, tensor_file)
    model._snapshots_loaded = bool(meta.get("stack_ready"))
    model.eval()
    return LoadedEnsemble(model, feature_set, normalizer, transform, meta)


def _build(meta_path: Path, field: str, make: Any) -> Any:
    """``make()``, with a constructor's refusal of what metadata.json says turned into one line naming the field."""
    try:
        return make()
    except (TypeError, ValueError, KeyError, RuntimeError, AssertionError) as e:
        raise ExportError(f"{meta_path}: {field}: {_one_line(e)}") from None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _member_keys(state: dict[str, torch.Tensor], name: str) -> set[str]:
    return {k for k in state if k.startswith(f"members.{name}.")}


def _check_traded(member: Member, name: str, entry: dict[str, Any], tensors: dict[str, torch.Tensor],
                  header: dict[str, str], file: Path, meta_path: Path, ensemble_file: Path) -> None:
    """``<member>.safetensors`` holds exactly the weights the loaded member trades with (none when it holds flat), and
    its header and ``members.<name>.traded`` say which network that is."""
    traded, net = traded_network(member)
    if entry.get("traded") != traded:
        raise ExportError(
            f"{meta_path}: members.{name}.traded: says {_show(entry.get('traded'))}, but the loaded member trades "
            f"{traded!r} (by its selected_update in {ensemble_file.name})"
        )
    if header.get("traded") != traded:
        raise ExportError(f"{file}: its header says it holds {header.get('traded')!r}, the member trades {traded!r}")
    expected = _tensors("", net) if net is not None else {}
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise ExportError(
            f"{file}: does not hold the {traded} weights member {name!r} trades with: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for key, value in expected.items():
        if tensors[key].dtype != value.dtype or not torch.equal(tensors[key], value):
            raise ExportError(
                f"{file}: tensor {key!r} differs from the {traded} weights member {name!r} trades with "
                f"(in {ensemble_file.name})"
            )


def _safetensors_header(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` string map of a safetensors file's bytes (empty when it has none)."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    extra = header.get("__metadata__") if isinstance(header, dict) else None
    return {str(k): str(v) for k, v in extra.items()} if isinstance(extra, dict) else {}


def _verified_tensors(
    root: Path, meta: dict[str, Any], meta_path: Path
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """Check every listed tensor file against its recorded SHA-256 (before anything in it is used); returns each
    file's tensors and header entries by its key in ``files``, read from the very bytes that were hashed."""
    out: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]] = {}
    for key, name in meta["files"].items():
        file = root / name
        if not file.is_file():
            raise ExportError(f"{file}: missing, but {meta_path.name} files.{key} lists it")
        blob = file.read_bytes()
        actual, expected = _sha256(blob), meta["sha256"][key]
        if actual != expected:
            raise ExportError(
                f"{file}: SHA-256 {actual[:16]}... differs from {expected[:16]}... recorded in {meta_path.name} "
                f"sha256.{key}: the file is corrupt or was changed after export"
            )
        try:
            tensors = load_safetensors(blob)
            header = _safetensors_header(blob)
        except Exception as e:  # a re-hashed file that is not safetensors: say which, in one line
            raise ExportError(f"{file}: not a readable safetensors file ({_one_line(e)})") from None
        out[key] = (tensors, header)
    return out


def _check_finite(state: dict[str, torch.Tensor], defaults: dict[str, torch.Tensor], file: Path) -> None:
    """No NaN anywhere (combination weights, statistics, parameters); ±inf only where the module itself starts with
    that value (an unfitted clip bound)."""
    for key, value in state.items():
        if not value.is_floating_point():
            continue
        bad = ~torch.isfinite(value)
        if not bad.any():
            continue
        default = defaults.get(key)
        if (default is not None and default.numel() == 1 and bool(torch.isinf(default).all())
                and bool((value[bad] == default.reshape(()).to(value.dtype)).all())):
            continue
        n_nan = int(torch.isnan(value).sum())
        raise ExportError(
            f"{file}: tensor {key!r} holds non-finite values ({n_nan} NaN, {int(bad.sum()) - n_nan} inf of "
            f"{value.numel()}): refusing to use it"
        )


_TOP_REQUIRED = (
    "format", "format_version", "versions", "ensemble", "members", "stack_ready", "spec", "data", "files", "sha256",
    "metadata_sha256",
)
_TOP_OPTIONAL = ("metrics", "config")
_MEMBER_REQUIRED, _MEMBER_OPTIONAL = ("class_path", "init_args", "traded"), ("run", "updates")
_SPEC_FIELDS = ("feature_names", "known_future", "symbols", "lookback", "horizon")
_DATA_REQUIRED = (*_SPEC_FIELDS, "feature_clip", "target_transform")
_DATA_OPTIONAL = ("fingerprint", "seen_span")
_TARGET_FIELDS = ("scale", "zscore_window", "clip_sigma")
_KINDS = {
    "object": ("a JSON object", lambda v: isinstance(v, dict)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "count": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    "positive": ("a finite positive number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                 and math.isfinite(v) and v > 0),
    "nonnegative": ("a finite number >= 0", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) and v >= 0),
    "updates": ("an integer >= -1 (-1: not recorded)", lambda v: isinstance(v, int) and not isinstance(v, bool)
                and v >= -1),
    "names": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "sha256": ("64 lowercase hex digits", lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v) is not None),
}


class _Fields:
    """Typed reads of metadata.json: every problem is one ExportError naming the file and the dotted field."""

    def __init__(self, meta_path: Path) -> None:
        self.meta_path = meta_path

    def error(self, field: str, problem: str) -> ExportError:
        return ExportError(f"{self.meta_path}: {field}: {problem}")

    def keys(self, obj: dict[str, Any], where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
        prefix = f"{where}." if where else ""
        for key in required:
            if key not in obj:
                raise self.error(prefix + key, "is missing")
        unknown = [k for k in obj if k not in required and k not in optional]
        if unknown:
            known = ", ".join((*required, *optional))
            raise self.error(prefix + str(unknown[0]), f"is not a field this foxhunt reads (known: {known})")

    def get(self, obj: dict[str, Any], key: str, where: str, kind: str, nullable: bool = False) -> Any:
        field = f"{where}.{key}" if where else key
        if key not in obj:
            raise self.error(field, "is missing")
        value = obj[key]
        description, ok = _KINDS[kind]
        if not (ok(value) or (nullable and value is None)):
            raise self.error(field, f"must be {description}{' or null' if nullable else ''}, got {_show(value)}")
        return value


# What a member's ``export_state`` may record (``members.<name>.run``), each field's kind; null is allowed for all
# (the member keeps or derives its own value). Agents record the cost they traded with and the reward scale fitted on
# their training split; forecasters record nothing.
_RUN_FIELDS = {"cost_bps": "nonnegative", "reward_scale": "positive"}


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool)) or value is None else repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _check_metadata(meta: Any, meta_path: Path) -> None:
    """Every field ``load`` reads, checked for presence, type and agreement before anything is built from it."""
    from foxhunt.features import FeatureSet

    f = _Fields(meta_path)
    if not isinstance(meta, dict):
        raise ExportError(f"{meta_path}: holds {_show(meta)}, not a JSON object: not a foxhunt export")
    if meta.get("format") != FORMAT:
        raise ExportError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION or isinstance(meta.get("format_version"), bool):
        raise ExportError(
            f"{meta_path}: export format version {meta.get('format_version')} is not {FORMAT_VERSION}, which this "
            "foxhunt reads"
        )
    recorded = f.get(meta, "metadata_sha256", "", "sha256")
    actual = metadata_digest(meta)
    if actual != recorded:
        raise ExportError(
            f"{meta_path}: its contents' SHA-256 {actual[:16]}... differs from {recorded[:16]}... recorded in its "
            "metadata_sha256: the file is corrupt or was edited after export"
        )
    f.keys(meta, "", _TOP_REQUIRED, _TOP_OPTIONAL)
    versions = f.get(meta, "versions", "", "object")
    exported = f.get(versions, "foxhunt", "versions", "str")
    if exported.split(".")[:2] != __version__.split(".")[:2]:
        raise ExportError(
            f"{meta_path}: exported by foxhunt {exported}, this is {__version__} (major.minor must match)"
        )

    members = f.get(meta, "members", "", "object")
    if not members:
        raise f.error("members", "lists no member")
    for name, entry in members.items():
        where = f"members.{name}"
        if not isinstance(entry, dict):
            raise f.error(where, f"must be a JSON object with class_path and init_args, got {_show(entry)}")
        f.keys(entry, where, _MEMBER_REQUIRED, _MEMBER_OPTIONAL)
        f.get(entry, "class_path", where, "str")
        f.get(entry, "init_args", where, "object")
        if entry["traded"] not in TRADED:
            raise f.error(f"{where}.traded", f"must be one of {', '.join(TRADED)}, got {_show(entry['traded'])}")
        if "run" in entry:
            run = f.get(entry, "run", where, "object", nullable=True) or {}
            f.keys(run, f"{where}.run", (), tuple(_RUN_FIELDS))
            for key, kind in _RUN_FIELDS.items():
                if key in run:
                    f.get(run, key, f"{where}.run", kind, nullable=True)
        if "updates" in entry:
            f.get(entry, "updates", where, "updates")
    f.get(meta, "ensemble", "", "object")
    f.get(meta, "stack_ready", "", "bool")
    if "metrics" in meta:
        f.get(meta, "metrics", "", "object")
    if "config" in meta and not isinstance(meta["config"], (str, dict)) and meta["config"] is not None:
        raise f.error("config", f"must be a string, a JSON object or null, got {_show(meta['config'])}")

    spec = f.get(meta, "spec", "", "object")
    data = f.get(meta, "data", "", "object")
    f.keys(spec, "spec", _SPEC_FIELDS)
    f.keys(data, "data", _DATA_REQUIRED, _DATA_OPTIONAL)
    for where, obj in (("spec", spec), ("data", data)):
        for key in ("feature_names", "known_future", "symbols"):
            names = f.get(obj, key, where, "names")
            if len(set(names)) != len(names):
                raise f.error(f"{where}.{key}", "names a value twice")
        for key in ("lookback", "horizon"):
            f.get(obj, key, where, "count")
        if not obj["feature_names"]:
            raise f.error(f"{where}.feature_names", "is empty")
    names = data["feature_names"]
    try:
        computed = FeatureSet(names).names
    except (ValueError, TypeError) as e:
        raise f.error("data.feature_names", _one_line(e)) from None
    if computed != names:
        raise f.error(
            "data.feature_names",
            f"feature order differs from this foxhunt's registry: exported {names[:5]}..., computed {computed[:5]}...",
        )
    if names != spec["feature_names"]:
        missing = [n for n in spec["feature_names"] if n not in names]
        extra = [n for n in names if n not in spec["feature_names"]]
        raise f.error(
            "data.feature_names",
            f"lists {len(names)} features, spec.feature_names (what the members were built for) "
            f"{len(spec['feature_names'])} (missing {missing[:5]}, extra {extra[:5]}"
            f"{', order differs' if not (missing or extra) else ''})",
        )
    outside = [k for k in spec["known_future"] if k not in names]
    if outside:
        raise f.error("spec.known_future", f"{outside} are not among the feature names")
    for key in ("known_future", "symbols", "lookback", "horizon"):
        if data[key] != spec[key]:
            raise f.error(f"data.{key}", f"{_show(data[key])} differs from spec.{key} {_show(spec[key])}")
    f.get(data, "feature_clip", "data", "positive")
    tt = f.get(data, "target_transform", "data", "object")
    f.keys(tt, "data.target_transform", _TARGET_FIELDS)
    if tt["scale"] not in ("none", "fitted", "rolling"):
        raise f.error("data.target_transform.scale", f"must be 'none', 'fitted' or 'rolling', got {_show(tt['scale'])}")
    f.get(tt, "zscore_window", "data.target_transform", "count", nullable=True)
    f.get(tt, "clip_sigma", "data.target_transform", "positive", nullable=True)
    if "fingerprint" in data:
        f.get(data, "fingerprint", "data", "str", nullable=True)
    if "seen_span" in data:
        for symbol, span in f.get(data, "seen_span", "data", "object").items():
            ok = isinstance(span, list) and len(span) == 2 and all(_KINDS["int"][1](t) for t in span)
            if not (ok and span[0] <= span[1]):
                raise f.error(f"data.seen_span.{symbol}", f"must be [first, last] integer times, got {_show(span)}")

    files = f.get(meta, "files", "", "object")
    expected = ["ensemble", *members]
    if sorted(files) != sorted(expected):
        raise f.error("files", f"lists {sorted(files)}, expected {sorted(expected)} (the ensemble and one per member)")
    for key, name in files.items():
        plain = isinstance(name, str) and name == Path(name).name and not name.startswith(".")
        if not (plain and name.endswith(".safetensors")):
            raise f.error(f"files.{key}", f"must be a .safetensors file name in the export folder, got {_show(name)}")
    sha256 = f.get(meta, "sha256", "", "object")
    if sorted(sha256) != sorted(files):
        raise f.error("sha256", f"has entries {sorted(sha256)}, files lists {sorted(files)}: each file needs one")
    for key in files:
        f.get(sha256, key, "sha256", "sha256")


def _member(entry: dict[str, Any], meta_path: Path, name: str) -> Member:
    """A member rebuilt from its class path and hyperparameters (only foxhunt's own member classes are imported)."""
    module_name, _, cls_name = str(entry["class_path"]).rpartition(".")
    if not module_name.startswith("foxhunt."):
        raise ExportError(
            f"{meta_path}: members.{name}.class_path: member class {entry['class_path']!r} is not one of foxhunt's"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ExportError(f"{meta_path}: members.{name}.class_path {entry['class_path']!r}: {_one_line(e)}") from None
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Member)):
        raise ExportError(
            f"{meta_path}: members.{name}.class_path: {entry['class_path']!r} is not a foxhunt member class"
        )
    return _build(meta_path, f"members.{name}.init_args", lambda: cls(**entry["init_args"]))


def _upgraded(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors of a former layout in the current one, by the submodules that know theirs (``upgrade_state_dict``:
    PPO's ActorCritic reads its former two-MLP ``actor.*``/``critic.*`` keys), so older exports still load."""
    for name, sub in module.named_modules():
        upgrade = getattr(sub, "upgrade_state_dict", None)
        if callable(upgrade):
            state = upgrade(state, f"{name}." if name else "")
    return state


def _load_strict(
    module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, file: Path, shapes: bool = True
) -> None:
    """Load a state dict, naming the missing, unexpected, mis-shaped or mistyped tensors (fitted statistics are sized
    at load). A dtype must be the model's, but for a narrower float in a wider one (a ``bf16-true`` fit's weights),
    which is exact: ``load_state_dict`` would cast silently (float64 rounded, 0.5 a True flag, 2.7 update 2)."""
    own = {k: v for k, v in module.state_dict().items() if ".target_transform." not in k}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ExportError(f"{file}: {what} tensors do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in state.items():
        if shapes and own[k].shape != v.shape:
            raise ExportError(
                f"{file}: {what} tensor {k!r} has shape {tuple(v.shape)} in the export, the model expects "
                f"{tuple(own[k].shape)}"
            )
        if not _exact_cast(v.dtype, own[k].dtype):
            raise ExportError(
                f"{file}: {what} tensor {k!r} has dtype {str(v.dtype).removeprefix('torch.')} in the export, the "
                f"model expects {str(own[k].dtype).removeprefix('torch.')}"
            )
    module.load_state_dict(state, strict=False)


def _exact_cast(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of ``source`` is the same value in ``target``: the same dtype, or a narrower float into
    float32 or float64."""
    if source == target:
        return True
    floats = (torch.float16, torch.bfloat16, torch.float32)
    return (source in floats and target in (torch.float32, torch.float64)
            and torch.finfo(target).bits > torch.finfo(source).bits)
