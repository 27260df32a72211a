"""The raw features of a bar frame, computed once and kept on disk under a key of everything they depend on."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import ClassVar

import pandas as pd
import torch
from safetensors.torch import save_file

from foxhunt.data.tensors import fingerprint
from foxhunt.features import FeatureOutput, FeatureSet

log = logging.getLogger("foxhunt.data")


class FeatureCache:
    """The features of a DataModule's bars (one that sets ``feature_set``, ``feature_device`` and ``cache_dir``, None
    for no cache): read from the cache when its stored key and content hash check out, else computed and written."""

    feature_set: FeatureSet
    feature_device: str
    cache_dir: Path | None

    def _features(
        self, bars: pd.DataFrame, ohlcv: torch.Tensor, ts: torch.Tensor, sym: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw features, from the on-disk cache when the same bars and feature set were seen before by this foxhunt
        version with these feature definitions. A cached file is used only when its stored key and content hash check
        out; an unreadable, truncated or mismatching one is recomputed and rewritten, with a warning naming it."""
        path = key = None
        if self.cache_dir is not None:
            key = self._feature_cache_key(bars)
            path = self.cache_dir / f"features-{key[:32]}.safetensors"
            if path.exists():
                cached = self._read_feature_cache(path, key, (len(bars), len(self.feature_set.names)))
                if cached is not None:
                    log.info("feature cache hit: %s", path)
                    return cached
        out = self._compute_features(ohlcv, ts, sym)
        if path is not None and key is not None:
            self._write_feature_cache(path, key, out.values.contiguous(), out.ready.to(torch.uint8))
            log.info("feature cache miss: computed %d features, saved %s", len(out.names), path)
        return out.values, out.ready

    _FEATURE_CACHE_FORMAT: ClassVar[str] = "foxhunt-feature-cache/1"
    _feature_code_hash: ClassVar[str | None] = None  # of this process's feature package, computed once

    @classmethod
    def _feature_code(cls) -> str:
        """SHA-256 of the feature definitions: every registry entry (name, family, definition, warm-up, TA-Lib name,
        known-future flag, parameters bound into its function) and the source of every module of foxhunt.features."""
        if cls._feature_code_hash is None:
            import foxhunt.features as package
            from foxhunt.features import REGISTRY

            h = hashlib.sha256()
            for f in REGISTRY.values():
                params = getattr(f.fn, "__defaults__", None)
                h.update(repr((f.name, f.family, f.definition, f.warmup, f.talib, f.known_future, params)).encode())
            root = Path(package.__file__).parent
            for source in sorted(root.rglob("*.py")):
                h.update(source.relative_to(root).as_posix().encode())
                h.update(source.read_bytes())
            cls._feature_code_hash = h.hexdigest()
        return cls._feature_code_hash

    def _feature_cache_key(self, bars: pd.DataFrame) -> str:
        """SHA-256 of what the cached values depend on: the bars, the feature list, foxhunt's version and the feature
        definitions (so a new release or an edited indicator misses instead of serving stale values)."""
        from foxhunt.version import __version__

        h = hashlib.sha256()
        for part in (self._FEATURE_CACHE_FORMAT, __version__, self._feature_code(), fingerprint(bars),
                     *self.feature_set.names):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    @staticmethod
    def _feature_content_hash(values: torch.Tensor, ready: torch.Tensor) -> str:
        """SHA-256 of the cached tensors' dtypes, shapes and bytes (stored in the file, checked on every read)."""
        h = hashlib.sha256()
        for t in (values, ready):
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.contiguous().numpy().data)
        return h.hexdigest()

    def _read_feature_cache(
        self, path: Path, key: str, shape: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cached (values [T, F] float32, ready [T] bool), or None with a warning naming the file and what is
        wrong with it (unreadable or truncated, another key, another shape, content not matching its stored hash)."""
        from safetensors import safe_open

        from foxhunt.files import first_line

        problem = None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                values, ready = f.get_tensor("values"), f.get_tensor("ready")
        except Exception as e:  # whatever is wrong with the file, it is recomputed, never used
            problem = f"unreadable or truncated ({first_line(e)})"
        else:
            if meta.get("format") != self._FEATURE_CACHE_FORMAT or meta.get("key") != key:
                problem = "written for other bars, features, feature code or foxhunt version (its stored key differs)"
            elif (values.dtype, tuple(values.shape), ready.dtype, tuple(ready.shape)) != (
                torch.float32, shape, torch.uint8, shape[:1]
            ):
                problem = (f"of the wrong shape: values {tuple(values.shape)} {values.dtype}, ready "
                           f"{tuple(ready.shape)} {ready.dtype}, expected {shape} float32 and {shape[:1]} uint8")
            elif meta.get("sha256") != self._feature_content_hash(values, ready):
                problem = "corrupt: its content does not match the SHA-256 stored in it"
        if problem is not None:
            log.warning("feature cache %s is %s: recomputing the features", path, problem)
            return None
        return values, ready.bool()

    def _write_feature_cache(self, path: Path, key: str, values: torch.Tensor, ready: torch.Tensor) -> None:
        """Write atomically (a temporary file in the cache directory, fsync, rename) with the key and a content hash in
        the metadata; a cache that cannot be written is warned about and skipped (the fit goes on)."""
        from foxhunt.files import atomic_file

        meta = {"format": self._FEATURE_CACHE_FORMAT, "key": key, "sha256": self._feature_content_hash(values, ready),
                "features": ",".join(self.feature_set.names)}
        try:
            with atomic_file(path) as tmp:
                save_file({"values": values, "ready": ready}, str(tmp), metadata=meta)
        except OSError as e:
            log.warning("feature cache %s could not be written (%s): continuing without it", path, e)

    def _compute_features(self, ohlcv: torch.Tensor, ts: torch.Tensor, sym: torch.Tensor) -> FeatureOutput:
        """On the CPU or, with ``feature_device`` cuda (or auto with a GPU), on the GPU (the same feature code, no host
        round trip until the finished float32 features come back)."""
        device = self.feature_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            return self.feature_set.compute(ohlcv, ts, sym)
        out = self.feature_set.compute(ohlcv.to(device), ts.to(device), sym.to(device))
        return type(out)(out.values.cpu(), out.names, out.ready.cpu())
