"""What an export is: its format, metadata.json's schema and digest, and the checks that refuse a bad one."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from foxhunt.cli_errors import UserError
from foxhunt.data.market import MarketSplit
from foxhunt.version import __version__

if TYPE_CHECKING:
    from foxhunt.data.datamodule import BarDataModule

FORMAT = "foxhunt-export"
FORMAT_VERSION = 3  # 2: metadata.json records the SHA-256 of every tensor file; 3: and of itself (metadata_sha256),
# and <member>.safetensors holds the weights the member trades (members.<name>.traded)


class ExportError(UserError, ValueError):
    """An export that cannot be loaded into this foxhunt: mismatched version, features or shapes."""


TRADED = ("network", "policy_net", "flat")  # what members.<name>.traded may say (see traded.traded_network)


def metadata_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of metadata.json's canonical form (keys sorted, no spaces, ASCII): everything but ``metadata_sha256``
    itself and the tensor files' hashes in ``sha256`` (each checked against its file)."""
    body = {k: v for k, v in meta.items() if k not in ("metadata_sha256", "sha256")}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return sha256_hex(text.encode("ascii"))


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data`` as 64 lowercase hex digits (what metadata.json records)."""
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


def seen_time_span(meta: dict[str, Any]) -> tuple[int, int] | None:
    """The first and last timestamp (ns) of the bars training or selection used, over every symbol (None: not
    recorded): the stretch of time the model has seen, whatever a symbol is called in another file."""
    spans = list((meta["data"].get("seen_span") or {}).values())
    if not spans:
        return None
    return min(int(s[0]) for s in spans), max(int(s[1]) for s in spans)


def overlap_with_training(meta: dict[str, Any], split: MarketSplit) -> torch.Tensor:
    """[T] True at the split's bars, of any symbol, whose time falls inside the span the export's training and
    validation bars cover (:func:`seen_time_span`): keyed by time, not by symbol name, so a renamed file of the same
    stretch is still in-sample."""
    span = seen_time_span(meta)
    if span is None:
        return torch.zeros(len(split), dtype=torch.bool, device=split.timestamps.device)
    return (split.timestamps >= span[0]) & (split.timestamps <= span[1])


_TOP_REQUIRED = (
    "format", "format_version", "versions", "ensemble", "members", "stack_ready", "spec", "data", "files", "sha256",
    "metadata_sha256",
)
_TOP_OPTIONAL = ("metrics", "config", "serving")
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
            raise self.error(field, f"must be {description}{' or null' if nullable else ''}, got {show_value(value)}")
        return value


# What a member's ``export_state`` may record (``members.<name>.run``), each field's kind; null is allowed for all
# (the member keeps or derives its own value). Agents record the cost they traded with and the reward scale fitted on
# their training split; forecasters record nothing.
_RUN_FIELDS = {"cost_bps": "nonnegative", "reward_scale": "positive"}


def error_line(error: BaseException) -> str:
    """``Type: message`` on one line: a refusal's cause inside an ExportError."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def show_value(value: Any) -> str:
    """A value as a refusal shows it: its type and the first 60 characters of its JSON."""
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool)) or value is None else repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def check_metadata(meta: Any, meta_path: Path) -> None:
    """Every field ``load`` reads, checked for presence, type and agreement before anything is built from it."""
    from foxhunt.features import FeatureSet

    f = _Fields(meta_path)
    if not isinstance(meta, dict):
        raise ExportError(f"{meta_path}: holds {show_value(meta)}, not a JSON object: not a foxhunt export")
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
            raise f.error(where, f"must be a JSON object with class_path and init_args, got {show_value(entry)}")
        f.keys(entry, where, _MEMBER_REQUIRED, _MEMBER_OPTIONAL)
        f.get(entry, "class_path", where, "str")
        f.get(entry, "init_args", where, "object")
        if entry["traded"] not in TRADED:
            raise f.error(f"{where}.traded", f"must be one of {', '.join(TRADED)}, got {show_value(entry['traded'])}")
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
        raise f.error("config", f"must be a string, a JSON object or null, got {show_value(meta['config'])}")

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
        raise f.error("data.feature_names", error_line(e)) from None
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
            raise f.error(f"data.{key}", f"{show_value(data[key])} differs from spec.{key} {show_value(spec[key])}")
    f.get(data, "feature_clip", "data", "positive")
    tt = f.get(data, "target_transform", "data", "object")
    f.keys(tt, "data.target_transform", _TARGET_FIELDS)
    if tt["scale"] not in ("none", "fitted", "rolling"):
        raise f.error("data.target_transform.scale", f"must be 'none', 'fitted' or 'rolling', got {show_value(tt['scale'])}")
    f.get(tt, "zscore_window", "data.target_transform", "count", nullable=True)
    f.get(tt, "clip_sigma", "data.target_transform", "positive", nullable=True)
    if "fingerprint" in data:
        f.get(data, "fingerprint", "data", "str", nullable=True)
    if "seen_span" in data:
        for symbol, span in f.get(data, "seen_span", "data", "object").items():
            ok = isinstance(span, list) and len(span) == 2 and all(_KINDS["int"][1](t) for t in span)
            if not (ok and span[0] <= span[1]):
                raise f.error(f"data.seen_span.{symbol}", f"must be [first, last] integer times, got {show_value(span)}")

    if "serving" in meta:
        _check_serving(f, meta["serving"], members)

    files = f.get(meta, "files", "", "object")
    expected = ["ensemble", *members]
    if sorted(files) != sorted(expected):
        raise f.error("files", f"lists {sorted(files)}, expected {sorted(expected)} (the ensemble and one per member)")
    for key, name in files.items():
        plain = isinstance(name, str) and name == Path(name).name and not name.startswith(".")
        if not (plain and name.endswith(".safetensors")):
            raise f.error(f"files.{key}", f"must be a .safetensors file name in the export folder, got {show_value(name)}")
    sha256 = f.get(meta, "sha256", "", "object")
    if sorted(sha256) != sorted(files):
        raise f.error("sha256", f"has entries {sorted(sha256)}, files lists {sorted(files)}: each file needs one")
    for key in files:
        f.get(sha256, key, "sha256", "sha256")


# serving: the members' networks in other formats (foxhunt.export.onnx, foxhunt.export.quantise), each file hashed
SERVING_FORMATS = ("onnx", "onnx_int8")
_SERVING_FIELDS = ("opset", "exporter", "checked_with", "members")
_SERVING_OPTIONAL = ("quantisation",)
_GRAPH_FIELDS = ("file", "sha256", "kind", "inputs", "outputs")
_GRAPH_OPTIONAL = ("max_abs_diff_vs_torch",)
_GRAPH_KINDS = ("forecaster", "dqn", "ppo_discrete", "ppo_continuous")


def _check_serving(f: _Fields, serving: Any, members: dict[str, Any]) -> None:
    """``serving.<format>.members.<name>``: a plain ``.onnx`` file name, its SHA-256, its kind and its named inputs and
    outputs, for members of this export only."""
    if not isinstance(serving, dict):
        raise f.error("serving", f"must be a JSON object, got {show_value(serving)}")
    f.keys(serving, "serving", (), SERVING_FORMATS)
    for key, record in serving.items():
        where = f"serving.{key}"
        f.get(serving, key, "serving", "object")
        f.keys(record, where, _SERVING_FIELDS, _SERVING_OPTIONAL)
        f.get(record, "opset", where, "count")
        for name, graph in f.get(record, "members", where, "object").items():
            at = f"{where}.members.{name}"
            if name not in members:
                raise f.error(at, f"is not a member of this export (members: {', '.join(members)})")
            f.get(record["members"], name, f"{where}.members", "object")
            if "max_abs_diff_vs_torch" in graph:
                f.get(graph, "max_abs_diff_vs_torch", at, "nonnegative")
            f.keys(graph, at, _GRAPH_FIELDS, _GRAPH_OPTIONAL)
            file = f.get(graph, "file", at, "str")
            if not (file == Path(file).name and not file.startswith(".") and file.endswith(".onnx")):
                raise f.error(f"{at}.file", f"must be a .onnx file name in the export folder, got {show_value(file)}")
            f.get(graph, "sha256", at, "sha256")
            if graph["kind"] not in _GRAPH_KINDS:
                kinds = ", ".join(_GRAPH_KINDS)
                raise f.error(f"{at}.kind", f"must be one of {kinds}, got {show_value(graph['kind'])}")
            for side in ("inputs", "outputs"):
                ports = graph[side]
                ok = isinstance(ports, list) and ports and all(
                    isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("shape"), list)
                    and isinstance(p.get("dtype"), str) for p in ports)
                if not ok:
                    raise f.error(f"{at}.{side}", f"must list {{name, shape, dtype}} objects, got {show_value(ports)}")


def serving_bytes(root: Path, meta: dict[str, Any], key: str, member: str) -> bytes:
    """The bytes of member ``member``'s ``serving.<key>`` graph, read once and checked against the SHA-256
    metadata.json records (ExportError naming the file otherwise)."""
    meta_path = root / "metadata.json"
    record = (meta.get("serving") or {}).get(key)
    if record is None:
        raise ExportError(f"{meta_path}: serving.{key}: is missing (write it with python -m foxhunt.export "
                          f"{'--onnx' if key == 'onnx' else '--onnx --int8'} {root})")
    graph = record["members"].get(member)
    if graph is None:
        raise ExportError(f"{meta_path}: serving.{key}.members.{member}: is missing")
    file = root / graph["file"]
    if not file.is_file():
        raise ExportError(f"{file}: missing, but {meta_path.name} serving.{key}.members.{member} lists it")
    blob = file.read_bytes()
    actual = sha256_hex(blob)
    if actual != graph["sha256"]:
        raise ExportError(
            f"{file}: SHA-256 {actual[:16]}... differs from {graph['sha256'][:16]}... recorded in {meta_path.name} "
            f"serving.{key}.members.{member}.sha256: the file is corrupt or was changed after export"
        )
    return blob


def check_serving_files(root: Path, meta: dict[str, Any]) -> None:
    """Every graph ``serving`` lists is present and has its recorded SHA-256 (what :func:`foxhunt.load` checks)."""
    for key, record in (meta.get("serving") or {}).items():
        for member in record["members"]:
            serving_bytes(root, meta, key, member)
