"""BarDataModule: bars -> causal features -> chronological, purged splits -> preprocessed MarketSplits and TFT windows."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset

from foxhunt.data.bars import BadBarPolicy, symbol_codes, timestamps_ns
from foxhunt.data.io import load_bars
from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.data.windows import WindowBatches
from foxhunt.features import KNOWN_FUTURE, FeatureSet
from foxhunt.preprocessing import FeatureNormalizer, TargetTransform, next_log_returns

log = logging.getLogger("foxhunt.data")
SPLITS = ("train", "val", "test")


def assemble_split(
    name: str,
    symbols: list[str],
    timestamps: torch.Tensor,
    symbol_index: torch.Tensor,
    ohlcv: torch.Tensor,
    features: torch.Tensor,
    ready: torch.Tensor,
    returns: torch.Tensor,
    feature_names: list[str],
    target_transform: TargetTransform,
    oracle_mean: torch.Tensor | None = None,
) -> MarketSplit:
    """A MarketSplit from rows (ordered by symbol, time) of normalised features and raw next-bar returns.

    A symbol's last row has no next return inside the rows, so it is never a decision bar.
    """
    r = returns.float()
    last = torch.ones(r.shape[0], dtype=torch.bool)
    if r.shape[0] > 1:
        last[:-1] = symbol_index[1:] != symbol_index[:-1]
    r = torch.where(last, torch.nan, r)
    scaled = target_transform.transform(r, segment=symbol_index)
    valid = ready & torch.isfinite(r) & torch.isfinite(scaled.value)
    return MarketSplit(
        name=name,
        symbols=symbols,
        timestamps=timestamps,
        symbol_index=symbol_index,
        ohlcv=ohlcv,
        returns=r,
        targets=torch.nan_to_num(scaled.value, nan=0.0),
        valid=valid,
        features=torch.nan_to_num(features, nan=0.0).float(),
        feature_names=list(feature_names),
        target_loc=scaled.loc.float(),
        target_scale=scaled.scale.float(),
        oracle_mean=oracle_mean,
    )


def bars_tensors(bars: pd.DataFrame) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symbols, timestamps [T] int64 ns, symbol codes [T] and OHLCV [T, 5] float64 of a bar frame."""
    codes, names = symbol_codes(bars)
    ts = torch.from_numpy(timestamps_ns(bars).copy())
    sym = torch.from_numpy(codes)
    ohlcv = torch.from_numpy(bars[["open", "high", "low", "close", "volume"]].to_numpy(np.float64, copy=True))
    return list(names), ts, sym, ohlcv


def fingerprint(bars: pd.DataFrame) -> str:
    """A content hash of bars (timestamps, OHLCV, symbols): what a cache key or an export records."""
    names, ts, sym, ohlcv = bars_tensors(bars)
    h = hashlib.blake2b(digest_size=16)
    for t in (ohlcv, ts, sym):
        h.update(t.numpy().tobytes())
    h.update("\n".join(names).encode())
    return h.hexdigest()


class BarDataModule(pl.LightningDataModule):
    """Loads bars (a file, directory or glob; the embedded synthetic market when ``path`` is None) into MarketSplits.

    Splits are chronological with cut times shared by all symbols; ``purge`` bars at the start of the validation and
    test splits belong to no split, so no window or target crosses a boundary (default: lookback + horizon). Feature
    normalisation and target statistics are fitted on the training split only.
    """

    def __init__(
        self,
        path: str | None = None,
        symbols: list[str] | None = None,
        on_bad_bar: BadBarPolicy = "raise",
        tz: str | None = None,
        synthetic_bars: int = 200_000,
        synthetic_symbols: int = 1,
        synthetic_seed: int = 0,
        signal_strength: float = 0.1,
        train_fraction: float = 0.7,
        val_fraction: float = 0.15,
        val_start: str | None = None,
        test_start: str | None = None,
        purge: int | None = None,
        lookback: int = 64,
        horizon: int = 6,
        features: list[str] | None = None,
        feature_families: list[str] | None = None,
        known_future: list[str] | None = None,
        feature_clip: float = 10.0,
        feature_device: str = "cpu",
        target_scale: Literal["none", "fitted", "rolling"] = "fitted",
        target_zscore_window: int | None = None,
        target_clip_sigma: float | None = 6.0,
        batch_size: int = 128,
        eval_batch_size: int = 512,
        seed: int = 0,
        cache_dir: str | None = ".cache/foxhunt",
    ) -> None:
        super().__init__()
        if not 0 < train_fraction < 1 or not 0 <= val_fraction < 1 or train_fraction + val_fraction >= 1:
            raise ValueError(
                f"BarDataModule: need 0 < train_fraction, 0 <= val_fraction and train_fraction + val_fraction < 1, "
                f"got {train_fraction} and {val_fraction}"
            )
        min_purge = lookback + horizon
        if purge is not None and purge < min_purge:
            raise ValueError(f"BarDataModule: purge={purge} is below lookback + horizon = {min_purge}")
        self.save_hyperparameters(logger=False)
        self.path = path
        self.symbols = symbols
        self.on_bad_bar = on_bad_bar
        self.tz = tz
        self.synthetic_bars = synthetic_bars
        self.synthetic_symbols = synthetic_symbols
        self.synthetic_seed = synthetic_seed
        self.signal_strength = signal_strength
        self.train_fraction = train_fraction
        self.val_fraction = val_fraction
        self.val_start = val_start
        self.test_start = test_start
        self.purge = min_purge if purge is None else purge
        self.lookback = lookback
        self.horizon = horizon
        self.feature_set = FeatureSet(features, feature_families)
        if feature_device not in ("cpu", "auto") and not feature_device.startswith("cuda"):
            raise ValueError(f"BarDataModule: feature_device must be 'cpu', 'cuda[:N]' or 'auto', got {feature_device!r}")
        self.feature_device = feature_device
        self.known_future = list(KNOWN_FUTURE if known_future is None else known_future)
        missing = [k for k in self.known_future if k not in self.feature_set.names]
        if missing:
            raise ValueError(f"BarDataModule: known_future features {missing} are not among the selected features")
        self.feature_clip = feature_clip
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.target_transform = TargetTransform(
            scale=target_scale, zscore_window=target_zscore_window, clip_sigma=target_clip_sigma
        )
        self.feature_normalizer = FeatureNormalizer()
        self.bars: pd.DataFrame | None = None
        self.market = None  # the SyntheticMarket when no path is given (it holds the oracle)
        self.splits: dict[str, MarketSplit] = {}
        self.train_window_mask: torch.Tensor | None = None  # optional restriction of TFT training windows (stacking)
        self.split_rows: dict[str, np.ndarray] = {}
        self._oracle_mean: torch.Tensor | None = None  # the synthetic market's conditional means, row-aligned with bars

    # --- loading -------------------------------------------------------------------------------------------------

    def load(self) -> pd.DataFrame:
        """The validated bars this module trains on."""
        if self.path is not None:
            return load_bars(self.path, on_bad_bar=self.on_bad_bar, tz=self.tz, symbols=self.symbols)
        from foxhunt.data.synthetic import generate_market

        self.market = generate_market(
            n_bars=self.synthetic_bars,
            n_symbols=self.synthetic_symbols,
            seed=self.synthetic_seed,
            signal_strength=self.signal_strength,
        )
        bars = self.market.bars
        self._oracle_mean = torch.from_numpy(self.market.oracle_mean.copy())
        if self.symbols is not None:
            keep = bars["symbol"].isin(self.symbols).to_numpy()
            bars = bars[keep].reset_index(drop=True)
            self._oracle_mean = self._oracle_mean[torch.from_numpy(keep)]
        return bars

    @property
    def oracle_mean(self) -> torch.Tensor | None:
        """The synthetic market's conditional mean of each bar's next return, row-aligned with the bars (else None)."""
        return self._oracle_mean

    @property
    def n_symbols(self) -> int:
        """Symbols in the data (loads the bars once if needed; setup reuses them)."""
        if self.bars is None:
            self.bars = self.load()
        return int(self.bars["symbol"].nunique())

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        bars = self.bars if self.bars is not None else self.load()
        self.bars = bars
        names, ts, sym, ohlcv = bars_tensors(bars)
        codes = sym.numpy()
        raw_features, ready = self._features(bars, ohlcv, ts, sym)
        returns = next_log_returns(ohlcv[:, 3], segment=sym).to(torch.float64)

        assign = self._assign_splits(ts.numpy(), codes)
        for name in SPLITS:
            self.split_rows[name] = np.flatnonzero(assign == SPLITS.index(name))
        train = torch.from_numpy(self.split_rows["train"])
        if train.numel() == 0:
            raise ValueError("BarDataModule: the training split is empty; check the split fractions or dates")
        train_ok = ready[train] & torch.isfinite(returns[train])
        self.feature_normalizer.fit(raw_features[train][train_ok], names=self.feature_set.names)
        features = self.normalise(raw_features)
        train_r = torch.where(train_ok, returns[train], torch.nan).float()
        self.target_transform.fit(train_r, segment=sym[train])

        for name in SPLITS:
            rows = torch.from_numpy(self.split_rows[name])
            self.splits[name] = assemble_split(
                name, list(names), ts[rows], sym[rows], ohlcv[rows], features[rows], ready[rows], returns[rows],
                self.feature_names, self.target_transform,
                None if self._oracle_mean is None else self._oracle_mean[rows],
            )
        self._check_splits()
        log.info("%s", self.describe())

    def _check_splits(self) -> None:
        """Every split must hold at least one complete window: say so before training, with the sizes that decide it."""
        from foxhunt.data.windows import valid_window_starts

        for name, split in self.splits.items():
            n_windows = int(valid_window_starts(split, self.lookback, self.horizon).numel()) if len(split) else 0
            if n_windows == 0:
                sizes = ", ".join(f"{k} {len(v):,} bars ({int(v.valid.sum()):,} decision bars)" for k, v in self.splits.items())
                raise ValueError(
                    f"BarDataModule: the {name} split has no complete window of lookback {self.lookback} + horizon "
                    f"{self.horizon} bars after the purge of {self.purge} bars and the features' warm-up ({sizes}); use "
                    f"more bars, larger split fractions, or a shorter lookback"
                )

    def normalise(self, raw_features: torch.Tensor) -> torch.Tensor:
        """Features scaled by the train-fitted normaliser and clipped to ±feature_clip (NaN stays NaN)."""
        return self.feature_normalizer(raw_features).clamp(-self.feature_clip, self.feature_clip)

    def _features(self, bars: pd.DataFrame, ohlcv: torch.Tensor, ts: torch.Tensor, sym: torch.Tensor):
        """Raw features, from the on-disk cache when the same bars and feature set were seen before."""
        key = None
        if self.cache_dir is not None:
            h = hashlib.blake2b(digest_size=16)
            h.update(fingerprint(bars).encode())
            h.update("\n".join(self.feature_set.names).encode())
            key = self.cache_dir / f"features-{h.hexdigest()}.safetensors"
            if key.exists():
                cached = load_file(str(key))
                log.info("feature cache hit: %s", key)
                return cached["values"], cached["ready"].bool()
        out = self._compute_features(ohlcv, ts, sym)
        if key is not None:
            key.parent.mkdir(parents=True, exist_ok=True)
            save_file({"values": out.values.contiguous(), "ready": out.ready.to(torch.uint8)}, str(key))
            log.info("feature cache miss: computed %d features, saved %s", len(out.names), key)
        return out.values, out.ready

    def _compute_features(self, ohlcv: torch.Tensor, ts: torch.Tensor, sym: torch.Tensor):
        """On the CPU (numpy backend) or, with ``feature_device`` cuda (or auto with a GPU), on the GPU (torch
        backend, no host round trip until the finished float32 features come back)."""
        device = self.feature_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            return self.feature_set.compute(ohlcv, ts, sym)
        out = self.feature_set.compute(ohlcv.to(device), ts.to(device), sym.to(device), backend="torch")
        return type(out)(out.values.cpu(), out.names, out.ready.cpu())

    def _assign_splits(self, ts: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """0/1/2 for train/val/test and -1 for purged bars, by shared cut times."""
        if self.val_start is not None or self.test_start is not None:
            if self.val_start is None or self.test_start is None:
                raise ValueError("BarDataModule: give both val_start and test_start, or neither")
            val_cut = pd.Timestamp(self.val_start, tz="UTC").value if pd.Timestamp(self.val_start).tz is None else pd.Timestamp(self.val_start).value
            test_cut = pd.Timestamp(self.test_start, tz="UTC").value if pd.Timestamp(self.test_start).tz is None else pd.Timestamp(self.test_start).value
            if test_cut <= val_cut:
                raise ValueError(f"BarDataModule: test_start {self.test_start} must be after val_start {self.val_start}")
        else:
            uniq = np.unique(ts)
            val_cut = uniq[min(len(uniq) - 1, int(len(uniq) * self.train_fraction))]
            test_cut = uniq[min(len(uniq) - 1, int(len(uniq) * (self.train_fraction + self.val_fraction)))]
        assign = np.where(ts < val_cut, 0, np.where(ts < test_cut, 1, 2)).astype(np.int64)
        # purge: the first `purge` bars of each symbol in val and test belong to no split
        block = np.r_[True, (assign[1:] != assign[:-1]) | (codes[1:] != codes[:-1])]
        block_id = np.cumsum(block) - 1
        pos = np.arange(len(ts)) - np.flatnonzero(block)[block_id]
        assign[(assign > 0) & (pos < self.purge)] = -1
        return assign

    # --- access --------------------------------------------------------------------------------------------------

    @property
    def train_split(self) -> MarketSplit:
        return self.splits["train"]

    @property
    def val_split(self) -> MarketSplit:
        return self.splits["val"]

    @property
    def test_split(self) -> MarketSplit:
        return self.splits["test"]

    @property
    def feature_names(self) -> list[str]:
        return list(self.feature_set.names)

    @property
    def spec(self) -> MarketSpec:
        """Feature and window sizes the members build their networks for (call after setup)."""
        return MarketSpec(self.feature_names, list(self.known_future), list(self.train_split.symbols), self.lookback, self.horizon)

    def windows(self, split: str, shuffle: bool = False, batch_size: int | None = None) -> WindowBatches:
        """TFT window batches of one split (training windows restricted by ``train_window_mask`` when set)."""
        market = self.splits[split]
        if split == "train" and self.train_window_mask is not None:
            market = replace(market, valid=market.valid & self.train_window_mask.to(market.valid.device))
        return WindowBatches(
            market,
            lookback=self.lookback,
            horizon=self.horizon,
            batch_size=batch_size or (self.batch_size if split == "train" else self.eval_batch_size),
            known_future=self.known_future,
            shuffle=shuffle,
            seed=self.seed,
            drop_last=shuffle,
        )

    def train_dataloader(self) -> WindowBatches:
        return self.windows("train", shuffle=True)

    def val_dataloader(self) -> WindowBatches:
        return self.windows("val")

    def test_dataloader(self) -> WindowBatches:
        return self.windows("test")

    def predict_dataloader(self) -> WindowBatches:
        return self.windows("test")

    def describe(self) -> str:
        """A few lines on what was loaded and how it was split."""
        lines = []
        src = self.path or f"synthetic market (seed {self.synthetic_seed}, signal strength {self.signal_strength})"
        lines.append(f"bars: {src}: {0 if self.bars is None else len(self.bars):,} bars, symbols {self.train_split.symbols}")
        lines.append(f"features: {len(self.feature_names)} ({len(self.known_future)} known-future), purge {self.purge} bars")
        for name, s in self.splits.items():
            if len(s) == 0:
                lines.append(f"{name:>5}: empty")
                continue
            t0 = pd.Timestamp(int(s.timestamps[0]), tz="UTC")
            t1 = pd.Timestamp(int(s.timestamps[-1]), tz="UTC")
            r = s.returns[s.valid].double()
            lines.append(
                f"{name:>5}: {len(s):>9,} bars, {int(s.valid.sum()):>9,} decision bars, {t0:%Y-%m-%d %H:%M} .. "
                f"{t1:%Y-%m-%d %H:%M} UTC, next-bar log return mean {r.mean():+.2e} std {r.std():.2e}"
            )
        return "\n".join(lines)


class StepDataset(Dataset[int]):
    """``n`` dummy items: one per training step, for members that make their own data by acting."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"need at least one step per epoch, got {n}")
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class MarketDataModule(pl.LightningDataModule):
    """Ready MarketSplits (e.g. a simulated market) for agent-only ensembles: training steps drive the loop only."""

    def __init__(
        self,
        train: MarketSplit,
        val: MarketSplit | None = None,
        test: MarketSplit | None = None,
        steps_per_epoch: int = 100,
        known_future: list[str] | None = None,
        lookback: int = 1,
        horizon: int = 1,
    ) -> None:
        super().__init__()
        self.splits = {k: v for k, v in (("train", train), ("val", val), ("test", test)) if v is not None}
        self.steps_per_epoch = int(steps_per_epoch)
        self.spec = MarketSpec.of(train, known_future, lookback, horizon)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StepDataset(self.steps_per_epoch), batch_size=None, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(StepDataset(1), batch_size=None, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(StepDataset(1), batch_size=None, shuffle=False)
