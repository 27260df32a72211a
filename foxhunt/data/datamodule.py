"""BarDataModule: bars -> causal features -> chronological, purged splits -> preprocessed MarketSplits and TFT windows."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch

from foxhunt.data.bars import (
    DEFAULT_JUMP_SIGMAS,
    BadBarPolicy,
    DataError,
    check_jump_sigmas,
    check_policy,
    symbol_codes,
    timestamps_ns,
    utc_ns,
)
from foxhunt.data.feature_cache import FeatureCache
from foxhunt.data.io import load_bars
from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.data.tensors import bars_tensors
from foxhunt.data.windows import WindowBatches, check_known_future
from foxhunt.features import KNOWN_FUTURE, FeatureSet
from foxhunt.preprocessing import FeatureNormalizer, TargetTransform, next_log_returns

log = logging.getLogger("foxhunt.data")
SPLITS = ("train", "val", "test")


def split_returns(returns: torch.Tensor, symbol_index: torch.Tensor) -> torch.Tensor:
    """A split's next-bar returns (float32) from the whole series' ``returns`` of its rows (ordered by symbol, time):
    NaN at each symbol's last row, whose next bar lies outside the split (purged, or another split's)."""
    r = returns.float()
    last = torch.ones(r.shape[0], dtype=torch.bool, device=r.device)
    if r.shape[0] > 1:
        last[:-1] = symbol_index[1:] != symbol_index[:-1]
    return torch.where(last, torch.nan, r)


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
    r = split_returns(returns, symbol_index)
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
        target_bounds=target_transform.bounds,
    )


class BarDataModule(FeatureCache, pl.LightningDataModule):
    """Loads bars (a file, directory or glob; the embedded synthetic market when ``path`` is None) into MarketSplits.

    Splits are chronological with cut times shared by all symbols; ``purge`` bars at the start of the validation and
    test splits belong to no split, so no window or target crosses a boundary (default: lookback + horizon). Feature
    normalisation and target statistics are fitted on the training split only. ``start``/``end`` (optional) limit the
    bars that enter any split to [start, end); features are still computed on all bars (they are causal), so the first
    training bar after ``start`` has warmed-up features (``foxhunt.walkforward`` cuts its folds this way).
    """

    def __init__(
        self,
        path: str | None = None,
        symbols: list[str] | None = None,
        on_bad_bar: BadBarPolicy = "raise",
        jump_sigmas: float | None = DEFAULT_JUMP_SIGMAS,
        tz: str | None = None,
        synthetic_bars: int = 200_000,
        synthetic_symbols: int = 1,
        synthetic_seed: int = 0,
        synthetic_bar_seconds: int = 60,
        signal_strength: float = 0.1,
        train_fraction: float = 0.7,
        val_fraction: float = 0.15,
        val_start: str | None = None,
        test_start: str | None = None,
        start: str | None = None,
        end: str | None = None,
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
        self.on_bad_bar = check_policy(on_bad_bar)
        self.jump_sigmas = check_jump_sigmas(jump_sigmas)
        if lookback < 1 or horizon < 1:
            raise ValueError(f"BarDataModule: lookback and horizon must be >= 1 bar, got {lookback} and {horizon}")
        if synthetic_bars < 1 or synthetic_symbols < 1:
            raise ValueError(f"BarDataModule: synthetic_bars and synthetic_symbols must be >= 1, got {synthetic_bars} "
                             f"and {synthetic_symbols}")
        if batch_size < 1 or eval_batch_size < 1:
            raise ValueError(f"BarDataModule: batch_size and eval_batch_size must be >= 1, got {batch_size} and "
                             f"{eval_batch_size}")
        self.tz = tz
        self.synthetic_bars = synthetic_bars
        self.synthetic_symbols = synthetic_symbols
        self.synthetic_seed = synthetic_seed
        self.synthetic_bar_seconds = synthetic_bar_seconds
        self.signal_strength = signal_strength
        self.train_fraction = train_fraction
        self.val_fraction = val_fraction
        self.val_start = val_start
        self.test_start = test_start
        self.start = start  # bars before ``start`` or from ``end`` on belong to no split (None: no limit)
        self.end = end
        self.purge = min_purge if purge is None else purge
        self.lookback = lookback
        self.horizon = horizon
        self.feature_set = FeatureSet(features, feature_families)
        if feature_device not in ("cpu", "auto") and not feature_device.startswith("cuda"):
            raise ValueError(f"BarDataModule: feature_device must be 'cpu', 'cuda[:N]' or 'auto', got {feature_device!r}")
        self.feature_device = feature_device
        self.known_future = list(KNOWN_FUTURE if known_future is None else known_future)
        check_known_future(self.known_future, "data.known_future")
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
        self._train_batches: WindowBatches | None = None  # the last training loader handed out, whose position ...
        self._train_batches_state: dict | None = None  # ... a checkpoint saves, and one loaded for the next loader

    # --- loading -------------------------------------------------------------------------------------------------

    def load(self) -> pd.DataFrame:
        """The validated bars this module trains on."""
        if self.path is not None:
            return load_bars(self.path, on_bad_bar=self.on_bad_bar, tz=self.tz, symbols=self.symbols,
                             jump_sigmas=self.jump_sigmas)
        from foxhunt.data.synthetic import generate_market

        self.market = generate_market(
            n_bars=self.synthetic_bars,
            n_symbols=self.synthetic_symbols,
            seed=self.synthetic_seed,
            signal_strength=self.signal_strength,
            bar_seconds=self.synthetic_bar_seconds,
        )
        bars = self.market.bars
        self._oracle_mean = torch.from_numpy(self.market.oracle_mean.copy())
        if self.symbols is not None:
            wanted = [self.symbols] if isinstance(self.symbols, str) else list(self.symbols)
            held = list(pd.unique(bars["symbol"]))
            missing = [s for s in dict.fromkeys(wanted) if s not in held]
            if missing:
                raise DataError(f"data.symbols: {', '.join(map(str, missing))} not in the synthetic market (its symbols: "
                                f"{', '.join(map(str, held))}; data.synthetic_symbols sets how many)")
            keep = bars["symbol"].isin(wanted).to_numpy()
            bars = bars[keep].reset_index(drop=True)
            self._oracle_mean = self._oracle_mean[torch.from_numpy(keep.copy())]
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
            raise DataError("data: the training split is empty; check data.train_fraction, data.val_start or data.start")
        train_ok = ready[train] & torch.isfinite(returns[train])
        self._check_normaliser_rows(raw_features[train][train_ok], int(train.numel()))
        self.feature_normalizer.fit(raw_features[train][train_ok], names=self.feature_set.names)
        features = self.normalise(raw_features)
        # the training split's own returns, as assemble_split builds them: at a symbol's last training row the return
        # runs into the first purged bar, outside the split, so it is NaN there and no statistic sees that bar
        train_r = split_returns(returns[train], sym[train])
        train_r = torch.where(ready[train], train_r, torch.nan)
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

    def _source(self) -> str:
        """The bars, as an error names them: the path, or the synthetic market."""
        return str(self.path) if self.path is not None else f"the synthetic market (seed {self.synthetic_seed})"

    def _bars_needed(self) -> int | None:
        """About how many bars per symbol the splits need: the training split the features' warm-up and one window
        (lookback + horizon), validation and test each the purge and one window. None when dates, not fractions,
        cut the splits (or start/end limit them)."""
        if any(x is not None for x in (self.val_start, self.test_start, self.start, self.end)):
            return None
        window = self.lookback + self.horizon
        shares = [(self.feature_set.max_warmup + window, self.train_fraction),
                  (self.purge + window, self.val_fraction),
                  (self.purge + window, 1 - self.train_fraction - self.val_fraction)]
        return max(math.ceil(bars / share) for bars, share in shares if share > 0)

    def _check_normaliser_rows(self, train_features: torch.Tensor, n_train: int) -> None:
        """The feature normalisation is fitted on the training bars past the features' warm-up: too few of them (a
        file of a few bars) is one line naming the bars and what they lack, not the normaliser's traceback."""
        rows = int(train_features.shape[0])
        finite = torch.isfinite(train_features).sum(0)
        if rows > 1 and bool((finite > 1).all()):
            return
        assert self.bars is not None
        n_symbols = int(self.bars["symbol"].nunique())
        bars = f"{len(self.bars):,} bars" + (f" of {n_symbols} symbols" if n_symbols > 1 else "")
        if rows <= 1:
            warmup = self.feature_set.max_warmup
            longest = max(self.feature_set.warmup, key=self.feature_set.warmup.get)
            needed = self._bars_needed()
            need = f"about {needed:,} bars per symbol or more, " if needed is not None else "more bars, "
            raise DataError(
                f"data: {self._source()}: too few bars for the features' warm-up and the splits: {bars}, "
                f"{n_train:,} in the training split and {rows} of them past the features' warm-up of {warmup} bars "
                f"per symbol ({longest}), where the feature normalisation needs at least 2; use {need}features with "
                "a shorter warm-up (data.features), or a larger data.train_fraction"
            )
        bad = [name for name, n in zip(self.feature_set.names, finite.tolist(), strict=True) if n <= 1]
        raise DataError(
            f"data: {self._source()}: feature(s) {', '.join(bad[:10])} have at most one finite value on the {rows:,} "
            f"training bars past the warm-up ({bars}), so they cannot be normalised; leave them out of data.features "
            "or check the bars"
        )

    def _check_splits(self) -> None:
        """Every split must hold at least one complete window: say so before training, with the sizes that decide it."""
        from foxhunt.data.windows import valid_window_starts

        for name, split in self.splits.items():
            n_windows = int(valid_window_starts(split, self.lookback, self.horizon).numel()) if len(split) else 0
            if n_windows == 0:
                sizes = ", ".join(f"{k} {len(v):,} bars ({int(v.valid.sum()):,} decision bars)" for k, v in self.splits.items())
                needed = self._bars_needed()
                sizes = f"{self._source()}: {sizes}" + (f"; about {needed:,} bars per symbol needed" if needed else "")
                raise DataError(
                    f"data: the {name} split has no complete window of lookback {self.lookback} + horizon "
                    f"{self.horizon} bars after the purge of {self.purge} bars and the features' warm-up ({sizes}); use "
                    f"more bars, larger split fractions, or a shorter lookback"
                )
        self._check_symbol_coverage()

    def _check_symbol_coverage(self) -> None:
        """Every symbol must have bars in every split: splits cut all symbols at shared times, so symbols whose dates
        do not overlap would each land in one split only (one only trained on, another only tested on)."""
        if self.bars is None or self.bars["symbol"].nunique() < 2:
            return
        codes, names = symbol_codes(self.bars)
        ts = timestamps_ns(self.bars)
        for name in SPLITS:
            rows = self.split_rows[name]
            missing = np.flatnonzero(np.bincount(codes[rows], minlength=len(names)) == 0)
            if len(missing):
                sym = int(missing[0])
                own = ts[codes == sym]
                span = f"{_date(int(ts[rows].min()))} .. {_date(int(ts[rows].max()))}" if len(rows) else "nothing"
                raise DataError(
                    f"data: symbol {names[sym]} has no bars in the {name} split (its bars: {_date(int(own.min()))} .. "
                    f"{_date(int(own.max()))}; the {name} split: {span}): the symbols' date ranges do not overlap "
                    "enough to share train/val/test cuts. Give data.symbols with overlapping dates, or data.start/end"
                )

    def normalise(self, raw_features: torch.Tensor) -> torch.Tensor:
        """Features scaled by the train-fitted normaliser and clipped to ±feature_clip (NaN stays NaN)."""
        return self.feature_normalizer(raw_features).clamp(-self.feature_clip, self.feature_clip)

    def _assign_splits(self, ts: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """0/1/2 for train/val/test and -1 for purged bars and bars outside [start, end), by shared cut times."""
        inside = np.ones(len(ts), dtype=bool)
        if self.start is not None:
            inside &= ts >= utc_ns(self.start)
        if self.end is not None:
            inside &= ts < utc_ns(self.end)
        if not inside.any():
            raise DataError(f"data.start/data.end: no bars between start {self.start} and end {self.end}")
        if self.val_start is not None or self.test_start is not None:
            if self.val_start is None or self.test_start is None:
                raise DataError("data.val_start/data.test_start: give both, or neither")
            val_cut = pd.Timestamp(self.val_start, tz="UTC").value if pd.Timestamp(self.val_start).tz is None else pd.Timestamp(self.val_start).value
            test_cut = pd.Timestamp(self.test_start, tz="UTC").value if pd.Timestamp(self.test_start).tz is None else pd.Timestamp(self.test_start).value
            if test_cut <= val_cut:
                raise DataError(f"data.test_start: {self.test_start} must be after data.val_start {self.val_start}")
        else:
            uniq = np.unique(ts[inside])
            val_cut = uniq[min(len(uniq) - 1, int(len(uniq) * self.train_fraction))]
            test_cut = uniq[min(len(uniq) - 1, int(len(uniq) * (self.train_fraction + self.val_fraction)))]
        assign = np.where(ts < val_cut, 0, np.where(ts < test_cut, 1, 2)).astype(np.int64)
        assign[~inside] = -1
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
        """Shuffled training windows; on a resume, from the position the checkpoint recorded (see ``load_state_dict``)."""
        batches = self.windows("train", shuffle=True)
        if self._train_batches_state is not None:
            batches.load_state_dict(self._train_batches_state)
            self._train_batches_state = None
        self._train_batches = batches
        return batches

    def state_dict(self) -> dict:
        """The training loader's position (``WindowBatches.state_dict``: the epoch under way and its batches served),
        saved by Lightning with every checkpoint of a fit.

        The loader is stateful, so Lightning also keeps its position in the fit loop's state; but it loads that state
        only into a loader set up after the checkpoint's loops are restored, and foxhunt's members read
        ``trainer.estimated_stepping_batches`` in ``configure_optimizers``, which sets the loader up before (Lightning
        issue #20550): resuming from a checkpoint written inside an epoch would replay the epoch's first batches. The
        datamodule's own state is restored before any loader is made, so the position comes back through it."""
        return {} if self._train_batches is None else {"train_batches": self._train_batches.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume the training loader where the checkpoint's fit was: the next loader ``train_dataloader`` makes
        (Lightning restores the datamodule before it asks for one), and the loader already handed out, in case a
        strategy restores only after setting up."""
        batches = state.get("train_batches")
        if batches is None:
            return
        self._train_batches_state = dict(batches)
        if self._train_batches is not None:
            self._train_batches.load_state_dict(batches)

    def teardown(self, stage: str) -> None:
        """After a fit: forget its training loader and any position not taken up, so a later fit of this datamodule
        starts from its own beginning (or its own checkpoint)."""
        if stage == "fit":
            self._train_batches = self._train_batches_state = None

    def val_dataloader(self) -> WindowBatches:
        return self.windows("val")

    def test_dataloader(self) -> WindowBatches:
        return self.windows("test")

    def predict_dataloader(self) -> WindowBatches:
        return self.windows("test")

    def describe(self) -> str:
        """A few lines on what was loaded and how it was split."""
        lines = []
        src = self.path or (f"synthetic market (seed {self.synthetic_seed}, signal strength {self.signal_strength}, "
                                f"{self.synthetic_bar_seconds}-second bars)")
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


def _date(ns: int) -> str:
    return f"{pd.Timestamp(ns, tz='UTC'):%Y-%m-%d %H:%M}"
