"""foxhunt.load: an export rebuilt without a Trainer or pickle, every hash, field and tensor checked before use."""

from __future__ import annotations

import importlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load as load_safetensors

from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.export.metadata import (
    ExportError,
    check_metadata,
    check_serving_files,
    error_line,
    sha256_hex,
    show_value,
)
from foxhunt.export.symbols import coded_symbols, export_symbol_codes
from foxhunt.export.traded import state_tensors, traded_network
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.member import Member


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

    @property
    def symbols(self) -> list[str]:
        """The symbols the model was trained on, in the order of their codes (``metadata.data.symbols``)."""
        return list(self.metadata["data"]["symbols"])

    @property
    def symbol_readers(self) -> list[str]:
        """The members whose positions depend on which symbol a bar is: the forecasters (their symbol embedding) and,
        under ``combine: stack``, the agents too (they read the forecasts)."""
        stacked = self.model.hparams.combine == "stack"
        return [n for n in self.model.member_names if n in self.model.forecaster_names or stacked]

    def unseen_symbols(self, split: MarketSplit) -> list[str]:
        """The split's symbols with bars that the model was never trained on (they trade under the unseen-symbol rule
        of :mod:`foxhunt.export.symbols`)."""
        present = set(torch.unique(split.symbol_index).tolist())
        return [s for i, s in enumerate(split.symbols) if i >= len(self.symbols) and i in present]

    def split(self, bars: pd.DataFrame, name: str = "data", oracle_mean: torch.Tensor | None = None) -> MarketSplit:
        """A MarketSplit of new bars: features recomputed, scaled with the exported statistics, each symbol coded as the
        export codes it by name (its ``symbols`` are the export's, then any unseen ones; a symbol the model never saw
        follows :mod:`foxhunt.export.symbols`' rule) (``oracle_mean``: the known conditional means of simulated bars,
        row-aligned, for an oracle row in back-tests)."""
        from foxhunt.data.datamodule import assemble_split
        from foxhunt.data.tensors import bars_tensors
        from foxhunt.preprocessing import next_log_returns

        names, ts, local, ohlcv = bars_tensors(bars)
        out = self.feature_set.compute(ohlcv, ts, local)
        clip = float(self.metadata["data"]["feature_clip"])
        with torch.no_grad():
            features = self.feature_normalizer(out.values).clamp(-clip, clip)
        returns = next_log_returns(ohlcv[:, 3], segment=local)
        # by name, never by the file's order: row i trades as the export's symbol of its own name (foxhunt.export.symbols);
        # only symbols with bars count (a categorical column may list more)
        used = torch.unique(local).tolist()
        present = [names[i] for i in used]
        lookup = torch.full((len(names),), -1, dtype=torch.int64)
        lookup[used] = export_symbol_codes(present, self.symbols, self.symbol_readers, where=name)
        return assemble_split(name, coded_symbols(present, self.symbols), ts, lookup[local], ohlcv, features, out.ready,
                              returns, self.feature_names, self.target_transform, oracle_mean)

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
    check_metadata(meta, meta_path)
    check_serving_files(root, meta)  # the ONNX graphs it lists (foxhunt.export.onnx), by their SHA-256
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
        raise ExportError(f"{meta_path}: {field}: {error_line(e)}") from None


def _member_keys(state: dict[str, torch.Tensor], name: str) -> set[str]:
    return {k for k in state if k.startswith(f"members.{name}.")}


def _check_traded(member: Member, name: str, entry: dict[str, Any], tensors: dict[str, torch.Tensor],
                  header: dict[str, str], file: Path, meta_path: Path, ensemble_file: Path) -> None:
    """``<member>.safetensors`` holds exactly the weights the loaded member trades with (none when it holds flat), and
    its header and ``members.<name>.traded`` say which network that is."""
    traded, net = traded_network(member)
    if entry.get("traded") != traded:
        raise ExportError(
            f"{meta_path}: members.{name}.traded: says {show_value(entry.get('traded'))}, but the loaded member trades "
            f"{traded!r} (by its selected_update in {ensemble_file.name})"
        )
    if header.get("traded") != traded:
        raise ExportError(f"{file}: its header says it holds {header.get('traded')!r}, the member trades {traded!r}")
    expected = state_tensors("", net) if net is not None else {}
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
        actual, expected = sha256_hex(blob), meta["sha256"][key]
        if actual != expected:
            raise ExportError(
                f"{file}: SHA-256 {actual[:16]}... differs from {expected[:16]}... recorded in {meta_path.name} "
                f"sha256.{key}: the file is corrupt or was changed after export"
            )
        try:
            tensors = load_safetensors(blob)
            header = _safetensors_header(blob)
        except Exception as e:  # a re-hashed file that is not safetensors: say which, in one line
            raise ExportError(f"{file}: not a readable safetensors file ({error_line(e)})") from None
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
        raise ExportError(f"{meta_path}: members.{name}.class_path {entry['class_path']!r}: {error_line(e)}") from None
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
