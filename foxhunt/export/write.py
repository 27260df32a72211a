"""export_ensemble: a fitted ensemble and its data side as safetensors plus a hashed metadata.json, written atomically."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from foxhunt.data.datamodule import BarDataModule
from foxhunt.data.tensors import fingerprint
from foxhunt.export.metadata import FORMAT, FORMAT_VERSION, ExportError, metadata_digest, seen_span, sha256_hex
from foxhunt.export.traded import state_tensors, traded_network
from foxhunt.files import atomic_file, json_safe
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.member import Agent
from foxhunt.version import __version__


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


def export_ensemble(model: EnsembleModule, dm: BarDataModule, out_dir: str | Path, config: Any = None) -> dict[str, Any]:
    """Write the export of a fitted EnsembleModule and its BarDataModule; returns the metadata."""
    import lightning

    if model.spec is None:
        raise ExportError("the ensemble is not bound to data yet: fit it (or call model.bind(spec)) before exporting")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the target transform is the data side's (saved once, under data.), whichever module also holds a reference
    tensors = {k: v for k, v in state_tensors("model.", model).items() if ".target_transform." not in k}
    tensors.update(state_tensors("data.feature_normalizer.", dm.feature_normalizer))
    tensors.update(state_tensors("data.target_transform.", dm.target_transform))
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
        sha256[name] = _save_tensors(state_tensors("", net) if net is not None else {}, out / files[name], header)
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
    meta = json.loads(_strict_json(meta))  # what a reader parses (tuples are lists, floats round-trip), then hashed
    meta["metadata_sha256"] = metadata_digest(meta)
    with atomic_file(out / "metadata.json") as tmp:  # last: it vouches for the files above
        tmp.write_text(json.dumps(meta, indent=2, allow_nan=False))
    return meta


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, header: dict[str, str] | None = None) -> str:
    """Write a safetensors file atomically (``header``: more string entries of its metadata); returns its SHA-256."""
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, **(header or {})})
    return sha256_hex(path.read_bytes())
