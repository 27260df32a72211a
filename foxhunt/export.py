"""Export a trained ensemble as safetensors plus JSON metadata, and load it back without a Trainer or pickle.

Files written to the export directory:

- ``ensemble.safetensors``: every tensor of the ensemble (members, TFT snapshot, stacking statistics) and of the
  preprocessing (``data.feature_normalizer.*``, ``data.target_transform.*``);
- ``tft.safetensors`` / ``dqn.safetensors``: each member's network alone, for use outside foxhunt;
- ``metadata.json``: format version, package versions, the fit config, every hyperparameter needed to rebuild the
  modules, the feature names in column order, the known-future inputs, window sizes, the data fingerprint and the
  latest validation back-test.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

import foxhunt
from foxhunt.data.market import MarketSplit

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


def export_ensemble(model: Any, dm: Any, out_dir: str | Path, config: Any = None) -> dict[str, Any]:
    """Write the export of a fitted EnsembleModule and its BarDataModule; returns the metadata."""
    import lightning

    from foxhunt.data.datamodule import fingerprint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the target transform is the data side's (saved once, under data.), whichever module also holds a reference
    tensors = {k: v for k, v in _tensors("model.", model).items() if ".target_transform." not in k}
    tensors.update(_tensors("data.feature_normalizer.", dm.feature_normalizer))
    tensors.update(_tensors("data.target_transform.", dm.target_transform))
    files = {"ensemble": "ensemble.safetensors"}
    save_file(tensors, str(out / files["ensemble"]), metadata={"format": FORMAT})
    if model.tft is not None:
        files["tft"] = "tft.safetensors"
        save_file(_tensors("", model.tft.net), str(out / files["tft"]), metadata={"format": FORMAT})
    if model.dqn is not None:
        files["dqn"] = "dqn.safetensors"
        save_file(_tensors("", model.dqn.q_net), str(out / files["dqn"]), metadata={"format": FORMAT})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": {
            "foxhunt": foxhunt.__version__,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "python": platform.python_version(),
        },
        "ensemble": _hparams(model),
        "members": list(model.member_names),
        "weights": list(model._weights),
        "tft": _hparams(model.tft) if model.tft is not None else None,
        "dqn": {**_hparams(model.dqn), "n_features": len(dm.feature_names)} if model.dqn is not None else None,
        "dqn_reward_scale": getattr(model.dqn, "reward_scale_used", None) if model.dqn is not None else None,
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
        },
        "metrics": _jsonable(getattr(model, "last_backtest", {})),
        "config": config if isinstance(config, str) else _jsonable(config),
        "files": files,
    }
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    return meta


@dataclass
class LoadedEnsemble:
    """A ready ensemble rebuilt from an export: the model in eval mode and the data side it was trained with."""

    model: Any  # EnsembleModule, used as a plain nn.Module
    feature_set: Any
    feature_normalizer: torch.nn.Module
    target_transform: torch.nn.Module
    metadata: dict[str, Any]

    @property
    def feature_names(self) -> list[str]:
        return list(self.metadata["data"]["feature_names"])

    def split(self, bars: pd.DataFrame, name: str = "data") -> MarketSplit:
        """A MarketSplit of new bars: features recomputed, scaled with the exported statistics."""
        from foxhunt.data.datamodule import assemble_split, bars_tensors
        from foxhunt.preprocessing import next_log_returns

        symbols, ts, sym, ohlcv = bars_tensors(bars)
        out = self.feature_set.compute(ohlcv, ts, sym)
        clip = float(self.metadata["data"]["feature_clip"])
        with torch.no_grad():
            features = self.feature_normalizer(out.values).clamp(-clip, clip)
        returns = next_log_returns(ohlcv[:, 3], segment=sym)
        return assemble_split(name, symbols, ts, sym, ohlcv, features, out.ready, returns, self.feature_names, self.target_transform)

    @torch.no_grad()
    def positions(self, bars: pd.DataFrame) -> dict[str, torch.Tensor]:
        """Positions of each member, the ensemble and buy-and-hold on new bars."""
        return self.model.positions(self.split(bars))

    @torch.no_grad()
    def backtest(self, bars: pd.DataFrame, oracle_mean: torch.Tensor | None = None) -> dict[str, dict[str, float]]:
        """After-cost back-test of every policy on new bars."""
        return self.model.backtest(self.split(bars), oracle_mean=oracle_mean)


def load(path: str | Path, map_location: str | torch.device = "cpu") -> LoadedEnsemble:
    """Rebuild an exported ensemble (no Trainer, no pickle); refuses mismatched versions, features or shapes."""
    from foxhunt.features import FeatureSet
    from foxhunt.lit.dqn import DQNModule
    from foxhunt.lit.ensemble import EnsembleModule
    from foxhunt.lit.tft import TFTModule
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
    if exported != foxhunt.__version__.split(".")[:2]:
        raise ExportError(
            f"{meta_path}: exported by foxhunt {meta['versions']['foxhunt']}, this is {foxhunt.__version__} "
            "(major.minor must match)"
        )
    data = meta["data"]
    feature_set = FeatureSet(data["feature_names"])
    if feature_set.names != data["feature_names"]:
        raise ExportError(
            f"{meta_path}: feature order differs from this foxhunt's registry: exported {data['feature_names'][:5]}..., "
            f"computed {feature_set.names[:5]}..."
        )
    tft = TFTModule(**meta["tft"]) if meta["tft"] is not None else None
    dqn = DQNModule(**meta["dqn"]) if meta["dqn"] is not None else None
    model = EnsembleModule(tft=tft, dqn=dqn, **meta["ensemble"])
    tt = data["target_transform"]
    transform = TargetTransform(scale=tt["scale"], zscore_window=tt["zscore_window"], clip_sigma=tt["clip_sigma"])
    normalizer = FeatureNormalizer()
    state = load_file(str(root / meta["files"]["ensemble"]), device=str(map_location))
    _load_strict(model, {k[6:]: v for k, v in state.items() if k.startswith("model.")}, "model", root)
    if tft is not None:
        tft.target_transform = transform
    _load_strict(normalizer, {k[24:]: v for k, v in state.items() if k.startswith("data.feature_normalizer.")}, "feature normaliser", root, shapes=False)
    _load_strict(transform, {k[22:]: v for k, v in state.items() if k.startswith("data.target_transform.")}, "target transform", root, shapes=False)
    if tft is not None:
        tft.target_transform = transform
    if dqn is not None:
        dqn.reward_scale_used = meta.get("dqn_reward_scale")
    model._weights = list(meta.get("weights", model._weights))
    model._dqn_ready = True
    model.eval()
    return LoadedEnsemble(model, feature_set, normalizer, transform, meta)


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
