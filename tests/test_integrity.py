"""Nothing corrupt is used, nothing is lost in a crash, every mistake is one line: the drills of each.

Exports (hashes, metadata validation, non-finite tensors), the feature cache (key, content hash, atomic writes) and
checkpoints (atomic writes whatever TMPDIR is, ``--ckpt_path last`` skipping unreadable files, a corrupt
``--ckpt_path`` named in one line).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _export_helpers import refusal
from safetensors.torch import load_file, save_file

import foxhunt
from foxhunt.data.datamodule import BarDataModule
from foxhunt.export.metadata import metadata_digest
from foxhunt.export.write import export_ensemble
from foxhunt.fit import FoxhuntCLI
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.tft import TFTModule
from foxhunt.training.checkpoint_io import (
    AtomicCheckpointIO,
    CheckpointError,
    checkpoint_problem,
    load_verified_checkpoint,
)

FEATS = ["logret_1", "logret_2", "rsi_14", "tod_sin", "tod_cos"]
TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")


def _dm(**kw) -> BarDataModule:
    args = {"synthetic_bars": 1500, "features": FEATS, "known_future": ["tod_sin", "tod_cos"], "lookback": 8,
            "horizon": 2, "cache_dir": None}
    args.update(kw)
    return BarDataModule(**args)


# --- exports ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """An export of a bound (untrained) TFT + DQN ensemble: every file and field a trained one has."""
    dm = _dm()
    dm.setup()
    model = EnsembleModule(members={
        "tft": TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4),
        "dqn": DQNModule(window=4, hidden=(8,), n_envs=4, replay_capacity=256, batch_size=8, learning_starts=16),
    })
    model.bind(dm.spec)
    out = tmp_path_factory.mktemp("export") / "export"
    export_ensemble(model, dm, out)
    return out


@pytest.fixture
def export_copy(exported: Path, tmp_path: Path) -> Path:
    out = tmp_path / "export"
    shutil.copytree(exported, out)
    return out


def _meta(root: Path) -> dict:
    return json.loads((root / "metadata.json").read_text())


def _write_meta(root: Path, meta: object) -> None:
    """Write metadata.json with its own SHA-256 recomputed (a tool that knows the format): the field checks below
    are what stands between such an edit and the model (an edit alone is refused by the hash:
    tests/test_export_integrity.py)."""
    if isinstance(meta, dict):
        meta["metadata_sha256"] = metadata_digest(meta)
    (root / "metadata.json").write_text(json.dumps(meta))




def _tensor_bytes(path: Path, key: str) -> tuple[int, int]:
    """Absolute [start, end) of a tensor's data inside a safetensors file."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    start, end = json.loads(blob[8:8 + n])[key]["data_offsets"]
    return 8 + n + start, 8 + n + end


def _rehash(root: Path, name: str) -> None:
    """Record a changed tensor file's SHA-256 in metadata.json, as a careless tool might."""
    meta = _meta(root)
    key = next(k for k, v in meta["files"].items() if v == name)
    meta["sha256"][key] = hashlib.sha256((root / name).read_bytes()).hexdigest()
    _write_meta(root, meta)


def test_export_records_the_sha256_of_every_tensor_file_and_loads(export_copy: Path) -> None:
    meta = _meta(export_copy)
    assert meta["format_version"] == 3 and set(meta["sha256"]) == set(meta["files"]) == {"ensemble", "tft", "dqn"}
    assert meta["metadata_sha256"] == metadata_digest(meta)
    for key, name in meta["files"].items():
        assert meta["sha256"][key] == hashlib.sha256((export_copy / name).read_bytes()).hexdigest()
    assert not [p for p in export_copy.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    loaded = foxhunt.load(export_copy)
    assert loaded.model.member_names == ["tft", "dqn"]


@pytest.mark.parametrize(
    "name, key",
    [
        ("ensemble.safetensors", "data.feature_normalizer.mean"),
        ("ensemble.safetensors", "model.members.tft.net.symbol_embedding.weight"),
        ("ensemble.safetensors", "model.weights"),
        ("tft.safetensors", "symbol_embedding.weight"),
    ],
)
def test_flipped_bytes_in_a_tensor_file_are_refused(export_copy: Path, name: str, key: str) -> None:
    """Drill: bytes flipped inside an exported weight or the feature normaliser (which loaded silently before)."""
    path = export_copy / name
    start, end = _tensor_bytes(path, key)
    blob = bytearray(path.read_bytes())
    blob[(start + end) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    message = refusal(export_copy)
    assert str(path) in message and "SHA-256" in message and "metadata.json sha256." in message


@pytest.mark.parametrize(
    "key, value",
    [("model.weights", math.nan), ("model.weights", math.inf), ("data.feature_normalizer.std", math.nan),
     ("model.members.tft.net.symbol_embedding.weight", math.nan)],
    ids=["nan-weights", "inf-weights", "nan-normaliser", "nan-parameter"],
)
def test_non_finite_tensors_of_a_rehashed_file_are_refused(export_copy: Path, key: str, value: float) -> None:
    """Drill: a NaN written into the ensemble's combination weights (file re-hashed, so only the check stops it)."""
    path = export_copy / "ensemble.safetensors"
    state = load_file(str(path))
    state[key].view(-1)[0] = value
    save_file(state, str(path), metadata={"format": "foxhunt-export"})
    _rehash(export_copy, path.name)
    message = refusal(export_copy)
    assert str(path) in message and repr(key) in message and "non-finite" in message


def test_last_feature_name_removed_is_one_error_naming_data_feature_names(export_copy: Path) -> None:
    meta = _meta(export_copy)
    meta["data"]["feature_names"] = meta["data"]["feature_names"][:-1]
    _write_meta(export_copy, meta)
    message = refusal(export_copy)
    assert "metadata.json: data.feature_names: lists 4 features" in message and "missing ['tod_cos']" in message


def test_a_feature_normaliser_of_another_width_is_refused(export_copy: Path) -> None:
    path = export_copy / "ensemble.safetensors"
    state = load_file(str(path))
    state["data.feature_normalizer.mean"] = torch.zeros(7)
    save_file(state, str(path), metadata={"format": "foxhunt-export"})
    _rehash(export_copy, path.name)
    message = refusal(export_copy)
    assert "'data.feature_normalizer.mean' has shape (7,)" in message
    assert "data.feature_names lists 5 features" in message


def _delete(*keys):
    def edit(meta):
        for k in keys[:-1]:
            meta = meta[k]
        del meta[keys[-1]]
    return edit


def _set(*keys, value):
    def edit(meta):
        for k in keys[:-1]:
            meta = meta[k]
        meta[keys[-1]] = value
    return edit


@pytest.mark.parametrize(
    "edit, expected",
    [
        (_delete("data", "feature_clip"), "data.feature_clip: is missing"),
        (_set("data", "feature_clip", value="10"), "data.feature_clip: must be a finite positive number, got str"),
        (_delete("members", "tft", "class_path"), "members.tft.class_path: is missing"),
        (_set("members", "tft", "init_args", value=[8]), "members.tft.init_args: must be a JSON object, got list"),
        (_set("members", "tft", value="TFTModule"), "members.tft: must be a JSON object"),
        (_set("members", "tft", "init_args", "no_such_arg", value=1), "members.tft.init_args: TypeError"),
        (_set("members", "tft", "class_path", value="foxhunt.nowhere.TFTModule"), "members.tft.class_path"),
        (_set("members", value={}), "members: lists no member"),
        (_set("spec", "lookback", value="8"), "spec.lookback: must be a positive integer, got str"),
        (_delete("spec", "horizon"), "spec.horizon: is missing"),
        (_set("spec", "extra", value=1), "spec.extra: is not a field this foxhunt reads"),
        (_set("versions", value="0.1.0"), "versions: must be a JSON object"),
        (_delete("versions", "foxhunt"), "versions.foxhunt: is missing"),
        (_delete("sha256"), "sha256: is missing"),
        (_set("sha256", "ensemble", value="abc"), "sha256.ensemble: must be 64 lowercase hex digits"),
        (_set("files", "ensemble", value="../ensemble.safetensors"), "files.ensemble: must be a .safetensors file"),
        (_delete("files", "dqn"), "files: lists ['ensemble', 'tft'], expected"),
        (_set("ensemble", value=None), "ensemble: must be a JSON object, got NoneType"),
        (_set("ensemble", "combine", value="average"), "ensemble: "),
        (_set("stack_ready", value="yes"), "stack_ready: must be true or false"),
        (_set("data", "target_transform", "scale", value=3), "data.target_transform.scale: must be"),
        (_set("data", "known_future", value=["tod_sin"]), "data.known_future: list [\"tod_sin\"] differs from spec"),
        (_set("data", "seen_span", value={"SYN0": [3]}), "data.seen_span.SYN0: must be [first, last]"),
        (_set("data", "feature_names", value="logret_1"), "data.feature_names: must be a list of strings"),
        (_set("data", "feature_names", value=["logret_1", "nope"]), "data.feature_names: ValueError: unknown"),
        (_set("unexpected", value=1), "unexpected: is not a field this foxhunt reads"),
        (_set("format_version", value=2), "export format version 2 is not 3"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_missing_or_mistyped_metadata_is_one_line_naming_the_field(export_copy: Path, edit, expected: str) -> None:
    """Drill: keys missing or of the wrong type give an ExportError naming metadata.json and the field (never a bare
    KeyError, TypeError or AttributeError)."""
    meta = _meta(export_copy)
    edit(meta)
    _write_meta(export_copy, meta)
    message = refusal(export_copy)
    assert "metadata.json" in message and expected in message, message


def test_metadata_that_is_not_an_object_or_not_json_is_refused(export_copy: Path) -> None:
    _write_meta(export_copy, ["not", "an", "object"])
    assert "metadata.json: holds list" in refusal(export_copy)
    (export_copy / "metadata.json").write_text('{"format": "foxhunt-export", ')
    assert "metadata.json: not valid JSON" in refusal(export_copy)


# --- feature cache ---------------------------------------------------------------------------------------------------


def _raw_features(dm: BarDataModule) -> tuple[torch.Tensor, torch.Tensor]:
    from foxhunt.data.tensors import bars_tensors

    bars = dm.load()
    _, ts, sym, ohlcv = bars_tensors(bars)
    values, ready = dm._features(bars, ohlcv, ts, sym)
    return values.contiguous(), ready


@pytest.fixture(scope="module")
def fresh_features() -> tuple[torch.Tensor, torch.Tensor]:
    return _raw_features(_dm())


def _assert_same(values: torch.Tensor, ready: torch.Tensor, fresh: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Bit-equal to features computed without a cache (NaN warm-up included)."""
    torch.testing.assert_close(values, fresh[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ready, fresh[1])


def _cache_file(cache: Path) -> Path:
    (path,) = cache.glob("features-*.safetensors")
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "foxhunt.data"]


def test_truncated_feature_cache_is_recomputed_with_a_warning(tmp_path: Path, fresh_features, caplog) -> None:
    cache = tmp_path / "cache"
    _raw_features(_dm(cache_dir=str(cache)))
    path = _cache_file(cache)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.INFO, logger="foxhunt.data"):
        values, ready = _raw_features(_dm(cache_dir=str(cache)))
    (warning,) = _warnings(caplog)
    assert str(path) in warning and "truncated" in warning and "recomputing" in warning
    _assert_same(values, ready, fresh_features)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="foxhunt.data"):  # rewritten whole: the next read is a plain hit
        again, _ = _raw_features(_dm(cache_dir=str(cache)))
    assert "feature cache hit" in caplog.text and not _warnings(caplog)
    _assert_same(again, ready, fresh_features)


def _stale_without_metadata(path: Path) -> None:
    """A valid file with other values and no key or hash (what an older foxhunt wrote)."""
    state = load_file(str(path))
    save_file({"values": state["values"] + 1, "ready": state["ready"]}, str(path))


def _stale_values_kept_metadata(path: Path) -> None:
    """Other values under the original key and hash (a file changed on disk)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    state = load_file(str(path))
    save_file({"values": state["values"] * 2, "ready": state["ready"]}, str(path), metadata=meta)


def _stale_other_key(path: Path) -> None:
    """A self-consistent file (its own hash matches) written for another key: e.g. before a feature-code change."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    state = load_file(str(path))
    values = state["values"] + 1
    meta["key"] = "0" * 64
    meta["sha256"] = BarDataModule._feature_content_hash(values, state["ready"])
    save_file({"values": values, "ready": state["ready"]}, str(path), metadata=meta)


@pytest.mark.parametrize(
    "make_stale, reason",
    [(_stale_without_metadata, "stored key differs"), (_stale_values_kept_metadata, "does not match the SHA-256"),
     (_stale_other_key, "stored key differs")],
    ids=["no-metadata", "values-changed", "other-key"],
)
def test_stale_feature_cache_is_detected_and_recomputed(tmp_path: Path, fresh_features, caplog, make_stale,
                                                        reason: str) -> None:
    cache = tmp_path / "cache"
    _raw_features(_dm(cache_dir=str(cache)))
    path = _cache_file(cache)
    make_stale(path)
    with caplog.at_level(logging.WARNING, logger="foxhunt.data"):
        values, ready = _raw_features(_dm(cache_dir=str(cache)))
    (warning,) = _warnings(caplog)
    assert str(path) in warning and reason in warning
    _assert_same(values, ready, fresh_features)


def test_feature_cache_key_covers_version_and_feature_definitions(monkeypatch) -> None:
    import foxhunt.version

    dm = _dm()
    bars = dm.load()
    key = dm._feature_cache_key(bars)
    assert key == dm._feature_cache_key(bars)
    monkeypatch.setattr(foxhunt.version, "__version__", "0.2.0")
    assert dm._feature_cache_key(bars) != key
    monkeypatch.undo()
    monkeypatch.setattr(BarDataModule, "_feature_code_hash", "an edited indicator")
    assert dm._feature_cache_key(bars) != key


def test_a_failed_feature_cache_write_leaves_the_old_file_and_the_fit_goes_on(tmp_path: Path, fresh_features,
                                                                             monkeypatch, caplog) -> None:
    import foxhunt.data.feature_cache as datamodule

    cache = tmp_path / "cache"
    _raw_features(_dm(cache_dir=str(cache)))
    path = _cache_file(cache)
    good = path.read_bytes()
    path.write_bytes(good[:100])  # force a recompute and rewrite ...

    def failing_save(tensors, filename, metadata=None):  # ... that dies half-way
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(datamodule, "save_file", failing_save)
    with caplog.at_level(logging.WARNING, logger="foxhunt.data"):
        values, _ = _raw_features(_dm(cache_dir=str(cache)))
    assert any("could not be written" in w and str(path) in w for w in _warnings(caplog))
    torch.testing.assert_close(values, fresh_features[0], rtol=0, atol=0, equal_nan=True)
    assert path.read_bytes() == good[:100] and [p.name for p in cache.iterdir()] == [path.name]


# --- checkpoints -----------------------------------------------------------------------------------------------------


def _ckpt(value: float) -> dict:
    return {"state_dict": {"w": torch.full((4,), value)}, "epoch": int(value)}


def test_atomic_checkpoint_write_keeps_the_previous_file_when_the_write_fails(tmp_path: Path, monkeypatch) -> None:
    """Drill: torch.save dies after writing part of the file; TMPDIR points nowhere usable, and is never used."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no_such_tmpdir"))
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint(_ckpt(1.0), path)
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()

    def torn_save(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint(_ckpt(2.0), path)
    monkeypatch.undo()
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary file left
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.full((4,), 1.0))
    io.save_checkpoint(_ckpt(3.0), path)
    assert torch.load(path, weights_only=True)["epoch"] == 3


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _runs(tmp_path: Path, files: dict[int, bytes | dict | None]) -> Path:
    """runs/foxhunt/version_<n>/checkpoints/last.ckpt, written oldest (lowest n) first with increasing mtimes."""
    root = tmp_path / "runs" / "foxhunt"
    for i, (version, content) in enumerate(sorted(files.items())):
        path = root / f"version_{version}" / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True)
        if isinstance(content, dict):
            torch.save(content, path)
        else:
            path.write_bytes(content or b"")
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    return root


def _resolve(root: Path) -> str | None:
    fake = SimpleNamespace(trainer=SimpleNamespace(logger=SimpleNamespace(save_dir=str(root.parent), name=root.name),
                                                   default_root_dir=str(root)))
    return FoxhuntCLI._resolve_ckpt_path(fake, "last")  # type: ignore[arg-type]


def test_ckpt_path_last_skips_unreadable_newest_checkpoints(tmp_path: Path, caplog) -> None:
    buf = tmp_path / "whole.ckpt"
    torch.save(_ckpt(9.0), buf)
    truncated = buf.read_bytes()[: buf.stat().st_size // 2]
    root = _runs(tmp_path, {0: _ckpt(0.0), 1: _ckpt(1.0), 2: {"no": "state dict"}, 3: truncated, 4: None})
    with caplog.at_level(logging.INFO, logger="foxhunt.fit"):
        chosen = _resolve(root)
    assert chosen == str(root / "version_1" / "checkpoints" / "last.ckpt")
    skipped = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(skipped) == 3
    assert "version_4" in skipped[0] and "empty (0 bytes)" in skipped[0]
    assert "version_3" in skipped[1] and "not a readable checkpoint" in skipped[1]
    assert "version_2" in skipped[2] and "no 'state_dict'" in skipped[2]
    assert f"resuming from {chosen}" in caplog.text


def test_ckpt_path_last_takes_the_newest_of_epoch_and_periodic_checkpoints_that_loads(tmp_path: Path, caplog) -> None:
    """last-steps.ckpt (--checkpoint_every_n_steps) competes with last.ckpt by age; a corrupt newest one is skipped."""
    root = _runs(tmp_path, {0: _ckpt(0.0)})
    steps = root / "version_0" / "checkpoints" / "last-steps.ckpt"
    torch.save(_ckpt(1.0), steps)
    os.utime(steps, (1_700_000_100, 1_700_000_100))
    assert _resolve(root) == str(steps)
    steps.write_bytes(steps.read_bytes()[:100])
    os.utime(steps, (1_700_000_100, 1_700_000_100))
    with caplog.at_level(logging.WARNING, logger="foxhunt.fit"):
        assert _resolve(root) == str(root / "version_0" / "checkpoints" / "last.ckpt")
    assert "skipping" in caplog.text and "last-steps.ckpt: not a readable checkpoint" in caplog.text


def test_ckpt_path_last_with_nothing_loadable_says_so(tmp_path: Path) -> None:
    root = _runs(tmp_path, {0: None})
    with pytest.raises(CheckpointError, match=r"none of the 1 last\*\.ckpt under .* loads"):
        _resolve(root)
    with pytest.raises(FileNotFoundError, match="no last.ckpt under"):
        _resolve(tmp_path / "elsewhere" / "foxhunt")


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated"], ids=["empty", "truncated"])
def test_a_corrupt_checkpoint_is_one_line_naming_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.ckpt"
    path.write_bytes(content)
    with pytest.raises(RuntimeError) as info:
        AtomicCheckpointIO().load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"{path}: not a readable checkpoint (") and "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert checkpoint_problem(path) is not None


class _RunsCode:
    """Unpickling it (a full, not weights-only, torch.load) creates ``marker``: code a crafted .ckpt would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _crafted_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    marker, path = tmp_path / "code-ran", tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 0, "x": _RunsCode(marker)}, path)
    return path, marker


@pytest.mark.parametrize("weights_only", [None, False, True])
@pytest.mark.parametrize("force", [None, "1"], ids=["default", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_a_crafted_checkpoint_never_runs_code(tmp_path: Path, monkeypatch, weights_only, force) -> None:
    """Drill: with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (a documented torch switch), the weights_only=None that
    Trainer.fit(ckpt_path=FILE) passes became a full unpickling that ran the file's code. Every read is weights-only:
    the file is refused in one line naming it, and nothing runs."""
    if force is None:
        monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    else:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", force)
    path, marker = _crafted_checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as info:
        AtomicCheckpointIO().load_checkpoint(path, weights_only=weights_only)
    message = str(info.value)
    assert message.startswith(f"{path}: not a readable checkpoint (UnpicklingError: Weights only load failed")
    assert "\n" not in message
    with pytest.raises(CheckpointError, match=f"^{path}: not a readable checkpoint"):
        load_verified_checkpoint(path, use="export")
    assert "not a readable checkpoint" in (checkpoint_problem(path) or "")
    assert not marker.exists()


def test_verified_read_names_a_changed_checkpoint_for_its_use(tmp_path: Path) -> None:
    """The best checkpoint's read for the export (foxhunt.fit) verifies the SHA-256 as a resume does."""
    path = tmp_path / "best.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), path)
    assert torch.equal(load_verified_checkpoint(path)["state_dict"]["w"], torch.full((4,), 1.0))
    blob = bytearray(path.read_bytes())
    raw = torch.full((4,), 1.0).numpy().tobytes()
    at = bytes(blob).find(raw)
    blob[at + 1] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError) as info:
        load_verified_checkpoint(path, use="export")
    assert str(info.value) == (f"{path}: not a checkpoint to export: its contents differ from the SHA-256 recorded "
                               "when it was saved (corrupted after writing)")
    with pytest.raises(CheckpointError, match="not a checkpoint to resume from: .*; resume from an earlier one$"):
        AtomicCheckpointIO().load_checkpoint(path)


def test_fit_registers_the_atomic_checkpoint_io_and_names_a_corrupt_ckpt_path(tmp_path: Path, monkeypatch) -> None:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from foxhunt.fit import build_cli

    args = ["--config", TINY, "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path),
            "--data.synthetic_bars", "2000", "--trainer.enable_progress_bar", "false"]
    cli = build_cli(args)
    assert type(cli.trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"")
    with pytest.raises(RuntimeError, match=f"^{bad}: not a readable checkpoint \\(the file is empty"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(bad))
    # --ckpt_path FILE of a crafted checkpoint, with torch told to unpickle fully where the caller does not say
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    crafted, marker = _crafted_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=f"^{crafted}: not a readable checkpoint \\(UnpicklingError"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(crafted))
    assert not marker.exists()
    # a checkpoint-IO plugin the config names is kept
    mine = build_cli([*args, "--trainer.plugins", "lightning.pytorch.plugins.io.TorchCheckpointIO"])
    assert type(mine.trainer.strategy.checkpoint_io) is TorchCheckpointIO
