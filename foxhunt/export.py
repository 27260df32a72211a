"""Export a trained ensemble as safetensors plus JSON metadata, and load it back without a Trainer or pickle.

Files written to the export directory:

- ``ensemble.safetensors``: every tensor of the ensemble (members, combination weights, stacking snapshots and
  statistics) and of the preprocessing (``data.feature_normalizer.*``, ``data.target_transform.*``);
- ``<member>.safetensors``: each member's network alone, for use outside foxhunt;
- ``metadata.json``: format version, package versions, the fit config, each member's class and hyperparameters, the
  data spec the members were bound to (feature names in column order, known-future inputs, symbols, window sizes),
  the data fingerprint and the latest validation back-test.
"""

from __future__ import annotations

import importlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from foxhunt.data.datamodule import BarDataModule
from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.member import Member
from foxhunt.version import __version__

FORMAT = "foxhunt-export"
FORMAT_VERSION = 1


class ExportError(ValueError):
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


def _hparams(module: Any) -> dict[str, Any]:
    """Constructor arguments saved by save_hyperparameters, without framework bookkeeping keys."""
    return {k: v for k, v in _jsonable(dict(module.hparams)).items() if not k.startswith("_")}


def _tensors(prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}{k}": v.detach().cpu().contiguous().clone() for k, v in module.state_dict().items()}


def export_ensemble(model: EnsembleModule, dm: BarDataModule, out_dir: str | Path, config: Any = None) -> dict[str, Any]:
    """Write the export of a fitted EnsembleModule and its BarDataModule; returns the metadata."""
    import lightning

    from foxhunt.data.datamodule import fingerprint

    if model.spec is None:
        raise ExportError("the ensemble is not bound to data yet: fit it (or call model.bind(spec)) before exporting")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the target transform is the data side's (saved once, under data.), whichever module also holds a reference
    tensors = {k: v for k, v in _tensors("model.", model).items() if ".target_transform." not in k}
    tensors.update(_tensors("data.feature_normalizer.", dm.feature_normalizer))
    tensors.update(_tensors("data.target_transform.", dm.target_transform))
    files = {"ensemble": "ensemble.safetensors"}
    save_file(tensors, str(out / files["ensemble"]), metadata={"format": FORMAT})
    members = {}
    for name in model.member_names:
        member = model.member(name)
        files[name] = f"{name}.safetensors"
        save_file(_tensors("", member.network), str(out / files[name]), metadata={"format": FORMAT})
        members[name] = {
            "class_path": f"{type(member).__module__}.{type(member).__qualname__}",
            "init_args": _hparams(member),
            "run": _jsonable(member.export_state()),
            "updates": model.updates[name],
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
    }
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    return meta


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
        from foxhunt.data.datamodule import assemble_split, bars_tensors
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
    """Rebuild an exported ensemble (no Trainer, no pickle); refuses mismatched versions, features or shapes."""
    from foxhunt.features import FeatureSet
    from foxhunt.preprocessing import FeatureNormalizer, TargetTransform
    root = Path(path)
    if root.is_file():
        root = root.parent
    meta_path = root / "metadata.json"
    if not meta_path.exists():
        raise ExportError(f"{root}: no metadata.json: not a foxhunt export directory")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ExportError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    if int(meta.get("format_version", -1)) != FORMAT_VERSION:
        raise ExportError(f"{meta_path}: export format version {meta.get('format_version')} is not {FORMAT_VERSION}, which this foxhunt reads")
    exported = meta["versions"]["foxhunt"].split(".")[:2]
    if exported != __version__.split(".")[:2]:
        raise ExportError(
            f"{meta_path}: exported by foxhunt {meta['versions']['foxhunt']}, this is {__version__} "
            "(major.minor must match)"
        )
    data = meta["data"]
    feature_set = FeatureSet(data["feature_names"])
    if feature_set.names != data["feature_names"]:
        raise ExportError(
            f"{meta_path}: feature order differs from this foxhunt's registry: exported {data['feature_names'][:5]}..., "
            f"computed {feature_set.names[:5]}..."
        )
    members = {name: _member(entry, meta_path) for name, entry in meta["members"].items()}
    model = EnsembleModule(members=members, **meta["ensemble"])
    model.bind(MarketSpec(**meta["spec"]))
    tt = data["target_transform"]
    transform = TargetTransform(scale=tt["scale"], zscore_window=tt["zscore_window"], clip_sigma=tt["clip_sigma"])
    normalizer = FeatureNormalizer()
    state = load_file(str(root / meta["files"]["ensemble"]), device=str(map_location))
    _load_strict(model, {k[6:]: v for k, v in state.items() if k.startswith("model.")}, "model", root)
    _load_strict(normalizer, {k[24:]: v for k, v in state.items() if k.startswith("data.feature_normalizer.")}, "feature normaliser", root, shapes=False)
    _load_strict(transform, {k[22:]: v for k, v in state.items() if k.startswith("data.target_transform.")}, "target transform", root, shapes=False)
    for name, entry in meta["members"].items():
        member = model.member(name)
        member.load_export_state(entry.get("run") or {})
        model.updates[name] = int(entry.get("updates", -1))  # -1: not recorded
        if name in model.forecaster_names:
            member.target_transform = transform  # type: ignore[attr-defined]
    model._snapshots_loaded = bool(meta.get("stack_ready"))
    model.eval()
    return LoadedEnsemble(model, feature_set, normalizer, transform, meta)


def _member(entry: dict[str, Any], meta_path: Path) -> Member:
    """A member rebuilt from its class path and hyperparameters (only foxhunt's own member classes are imported)."""
    module_name, _, cls_name = str(entry["class_path"]).rpartition(".")
    if not module_name.startswith("foxhunt."):
        raise ExportError(f"{meta_path}: member class {entry['class_path']!r} is not one of foxhunt's")
    cls = getattr(importlib.import_module(module_name), cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Member)):
        raise ExportError(f"{meta_path}: {entry['class_path']!r} is not a foxhunt member class")
    return cls(**entry["init_args"])


def _load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, root: Path, shapes: bool = True) -> None:
    """Load a state dict, naming the missing, unexpected or mis-shaped tensors (fitted statistics are sized at load)."""
    own = {k: v for k, v in module.state_dict().items() if ".target_transform." not in k}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ExportError(f"{root}: {what} tensors do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in state.items():
        if shapes and own[k].shape != v.shape:
            raise ExportError(f"{root}: {what} tensor {k!r} has shape {tuple(v.shape)} in the export, the model expects {tuple(own[k].shape)}")
    module.load_state_dict(state, strict=False)
