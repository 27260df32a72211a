"""TFT window batches gathered by index from a MarketSplit: no per-sample Python, no copied windows."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from foxhunt.cli_errors import ConfigError
from foxhunt.data.market import MarketSplit
from foxhunt.features.catalog import KNOWN_FUTURE, REGISTRY

__all__ = ["WindowBatches", "check_known_future", "valid_window_starts"]


def check_known_future(names: Sequence[str], where: str, registered_only: bool = False) -> None:
    """Known-future inputs are fed at bars t+1..t+H of a window decided at t, so they must be features the registry
    marks as known in advance (computable from the timestamp alone: the calendar features); any other feature's
    values there are the future itself. One line naming every offending feature and why. ``registered_only``: judge
    only the registry's features and take a column the registry does not know (a caller's own feature matrix, e.g.
    a synthetic task's scheduled inputs) as the caller's declaration."""
    bad = [name for name in names
           if not (name in REGISTRY and REGISTRY[name].known_future) and (name in REGISTRY or not registered_only)]
    if not bad:
        return
    why = "; ".join(
        f"{name!r} is " + (f"a {REGISTRY[name].family} feature of the bars" if name in REGISTRY else "not a registered feature")
        for name in bad
    )
    raise ConfigError(
        f"{where}: {why}: a known-future input's values at bars t+1..t+H must be known at decision time t, which only "
        f"features computable from the timestamp are ({', '.join(KNOWN_FUTURE)})"
    )


def _window_all(flags: Tensor, first: Tensor, length: int) -> Tensor:
    """For each start row s in ``first``: are ``flags[s .. s+length-1]`` all True? (rows must be in range)."""
    bad = torch.cat([flags.new_zeros(1, dtype=torch.int64), torch.cumsum((~flags).to(torch.int64), 0)])
    return bad[first + length] - bad[first] == 0


def _segment_extent(split: MarketSplit) -> tuple[Tensor, Tensor]:
    """Per row: rows since its symbol block's first row, and rows until its block's last row."""
    sym = split.symbol_index
    n = sym.shape[0]
    if n > 1 and bool((sym[1:] != sym[:-1]).sum() + 1 != torch.unique(sym).numel()):
        raise ValueError(f"MarketSplit {split.name!r}: rows of a symbol must be contiguous (sorted by symbol, time)")
    bounds = split.segment_bounds().to(sym.device)
    idx = torch.arange(n, device=sym.device)
    return idx - bounds[sym, 0], bounds[sym, 1] - 1 - idx


def valid_window_starts(split: MarketSplit, lookback: int, horizon: int) -> Tensor:
    """Int64 decision rows t whose window is usable for a ``lookback``/``horizon`` forecast.

    t qualifies when rows t-L+1 .. t+H all belong to t's symbol (row t+H is the known-future input of the last
    step and the close that ends the last target), ``split.valid`` holds on the past rows t-L+1 .. t, and
    ``split.targets`` and ``split.returns`` are finite on t .. t+H-1.
    """
    if lookback < 1 or horizon < 1:
        raise ValueError(f"valid_window_starts: lookback and horizon must be >= 1, got {lookback}, {horizon}")
    n = len(split)
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=split.symbol_index.device)
    since_start, until_end = _segment_extent(split)
    cand = torch.nonzero((since_start >= lookback - 1) & (until_end >= horizon)).flatten()
    ok = _window_all(split.valid.bool(), cand - (lookback - 1), lookback)
    finite = torch.isfinite(split.targets) & torch.isfinite(split.returns)
    ok &= _window_all(finite, cand, horizon)
    return cand[ok]


class WindowBatches(IterableDataset):
    """Whole TFT batches gathered from a split by index: an epoch is a few tensor ops per batch.

    Yields dicts with ``x_past`` [B, L, F] (feature rows t-L+1..t), ``x_future`` [B, H, K] (the ``known_future``
    columns of rows t+1..t+H), ``y`` [B, H] (``targets`` rows t..t+H-1), ``y_raw`` [B, H] (raw log ``returns`` of the
    same rows, for metrics), ``symbol`` [B] and ``t`` [B] (decision row in the split), for t in
    :func:`valid_window_starts`. When the split carries ``target_loc``/``target_scale``, ``y_loc``/``y_scale``
    [B, H] map a prediction of ``y`` back to a log return: ``y * y_scale + y_loc`` (clipping aside). They are the
    decision row t's statistics at every step: where they vary by row (a rolling target scale, whose row t+h reads
    returns up to t+h-1), step h's target is the raw return of row t+h scaled by row t's statistics and clipped to the
    split's ``target_bounds``, so a forecast made at t is trained on, and mapped back with, what is known at t.

    Use it as a Lightning dataloader directly (return it from ``train_dataloader``); Lightning calls ``set_epoch``
    each epoch through ``sampler``. Without ``set_epoch``, each new pass advances the epoch by one, so a plain loop
    reshuffles too. The order of epoch e depends only on (seed, e). Inside a DataLoader (``batch_size=None``) with
    workers, batches are dealt round-robin to workers.

    It resumes mid-epoch: :meth:`state_dict` says which epoch's pass is under way and how many of its batches it has
    served, and after :meth:`load_state_dict` the next pass of that epoch starts at the next batch, so a run resumed
    from a checkpoint written inside an epoch sees exactly the batches an uninterrupted run does. Lightning saves a
    train dataloader's ``state_dict`` with the fit loop in every checkpoint and loads it on resume when it sets the
    loader up after restoring the loops; ``BarDataModule`` carries it in its own state for fits that set the loader up
    earlier (foxhunt's, see ``BarDataModule.state_dict``). Served counts batches handed out, which is the batches
    trained on because Lightning fetches a sized loader's batches one at a time, without prefetching (one process:
    with DataLoader workers the count stays in the workers).
    """

    def __init__(
        self,
        split: MarketSplit,
        lookback: int,
        horizon: int,
        batch_size: int,
        known_future: Sequence[str] = (),
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"WindowBatches: batch_size must be >= 1, got {batch_size}")
        check_known_future(known_future, "WindowBatches: known_future", registered_only=True)
        missing = [name for name in known_future if name not in split.feature_names]
        if missing:
            raise ValueError(
                f"WindowBatches: known-future feature(s) {missing} not in split {split.name!r} "
                f"(has {len(split.feature_names)} features, e.g. {split.feature_names[:8]})"
            )
        if device is not None:
            split = split.to(device)
        self.split_name = split.name
        self.lookback = int(lookback)
        self.horizon = int(horizon)
        self.batch_size = int(batch_size)
        self.known_future = tuple(known_future)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.features = split.features.float().contiguous()
        # On CPU the big x_past gather goes through numpy's single-threaded take: torch's OpenMP index_select was
        # 10x slower with 2 threads on a loaded 2-core machine (scripts/bench_windows.py), and never faster with 1.
        self._features_np = self.features.numpy() if self.features.device.type == "cpu" else None
        cols = [split.feature_names.index(name) for name in self.known_future]
        self.future_features = self.features[:, cols].contiguous()
        self.targets = split.targets.float().contiguous()
        self.returns = split.returns.float().contiguous()
        self.symbol_index = split.symbol_index.long().contiguous()
        loc, scale = getattr(split, "target_loc", None), getattr(split, "target_scale", None)
        self.target_loc = None if loc is None else loc.float().contiguous()
        self.target_scale = None if scale is None else scale.float().contiguous()
        # row-varying statistics: every step of a window is scaled by its decision row's (constant ones: as stored)
        self.decision_row_targets = any(stat is not None and stat.numel() > 0 and not bool((stat == stat[0]).all())
                                        for stat in (self.target_loc, self.target_scale))
        self.target_bounds = tuple(getattr(split, "target_bounds", (-math.inf, math.inf)))
        self.starts = valid_window_starts(split, self.lookback, self.horizon)
        dev = self.starts.device
        self._past_offsets = torch.arange(-self.lookback + 1, 1, device=dev)
        self._target_offsets = torch.arange(self.horizon, device=dev)
        self._epoch = 0
        self._pass_epoch: int | None = None  # the epoch of the pass under way (None before the first) ...
        self._served = 0  # ... and how many of its batches it has handed out
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip) from load_state_dict, for the next pass

    def keep(self, rows: Tensor) -> None:
        """Serve only the windows decided at ``rows`` (row indices; those that are not valid window starts are none)."""
        self.starts = self.starts[torch.isin(self.starts, rows.to(self.starts.device))]

    @property
    def num_windows(self) -> int:
        return int(self.starts.numel())

    def __len__(self) -> int:
        n, b = self.num_windows, self.batch_size
        return n // b if self.drop_last else math.ceil(n / b)

    def set_epoch(self, epoch: int) -> None:
        """Fix the epoch whose order the next pass uses (the shuffle seed is a function of (seed, epoch))."""
        self._epoch = int(epoch)

    @property
    def sampler(self) -> WindowBatches:
        """Lightning looks for ``set_epoch`` on ``dataloader.sampler``; this object is its own sampler."""
        return self

    batch_sampler = None

    def order(self, epoch: int) -> Tensor:
        """Decision rows in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return self.starts
        gen = torch.Generator(device="cpu")
        gen.manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
        perm = torch.randperm(self.num_windows, generator=gen).to(self.starts.device)
        return self.starts[perm]

    def gather(self, t: Tensor) -> dict[str, Tensor]:
        """The batch for decision rows ``t`` [B] (int64, from :func:`valid_window_starts`)."""
        b = t.shape[0]
        past = (t[:, None] + self._past_offsets).reshape(-1)
        ahead = (t[:, None] + self._target_offsets).reshape(-1)
        y_raw = self.returns.index_select(0, ahead).view(b, self.horizon)
        batch = {
            "x_past": self._take_features(past).view(b, self.lookback, -1),
            "x_future": self.future_features.index_select(0, ahead + 1).view(b, self.horizon, -1),
            "y_raw": y_raw,
            "symbol": self.symbol_index.index_select(0, t),
            "t": t,
        }
        if self.decision_row_targets:  # every step scaled by the decision row's statistics
            assert self.target_loc is not None and self.target_scale is not None
            loc = self.target_loc.index_select(0, t)[:, None].expand(b, self.horizon)
            scale = self.target_scale.index_select(0, t)[:, None].expand(b, self.horizon)
            batch.update(y=((y_raw - loc) / scale).clamp(*self.target_bounds), y_loc=loc, y_scale=scale)
            return batch
        batch["y"] = self.targets.index_select(0, ahead).view(b, self.horizon)
        if self.target_loc is not None:
            batch["y_loc"] = self.target_loc.index_select(0, ahead).view(b, self.horizon)
        if self.target_scale is not None:
            batch["y_scale"] = self.target_scale.index_select(0, ahead).view(b, self.horizon)
        return batch

    def _take_features(self, rows: Tensor) -> Tensor:
        if self._features_np is None:
            return self.features.index_select(0, rows)
        return torch.from_numpy(np.take(self._features_np, rows.numpy(), axis=0))

    def _layout(self) -> dict[str, int | bool]:
        """What fixes the batches of an epoch: a saved position only means the same batches under the same layout."""
        return {"num_windows": self.num_windows, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "seed": self.seed, "drop_last": self.drop_last}

    def state_dict(self) -> dict[str, int | bool]:
        """The position in the pass under way: its epoch and the batches it has served (plus the layout that makes
        them the same batches again). Before any pass: the epoch the next one uses, nothing served; after
        :meth:`load_state_dict` and before the next pass: the position loaded."""
        if self._resume is not None:
            epoch, served = self._resume
        elif self._pass_epoch is None:
            epoch, served = self._epoch, 0
        else:
            epoch, served = self._pass_epoch, self._served
        return {"epoch": epoch, "served": served, **self._layout()}

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resume inside the pass :meth:`state_dict` described: the next pass of that epoch (after ``set_epoch`` or
        by the running count) skips the batches it had served. Ignored by a pass of any other epoch (a position
        saved at an epoch's end resumes at the next epoch's start). A state of another layout (other windows, batch
        size, shuffle, seed or drop_last) cannot name the same batches: a warning, and epochs run from their start."""
        layout = self._layout()
        changed = [f"{k} {state.get(k)!r} -> {v!r}" for k, v in layout.items() if state.get(k) != v]
        if changed:
            warnings.warn(
                f"WindowBatches({self.split_name!r}): the saved position is for other batches ({', '.join(changed)}): "
                "the epoch restarts from its first batch instead of resuming exactly",
                stacklevel=2,
            )
            self._resume = None
            return
        epoch, served = int(state["epoch"]), int(state["served"])
        self._epoch = epoch
        self._resume = (epoch, served)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        epoch = self._epoch
        self._epoch = epoch + 1
        skip = 0
        if self._resume is not None:
            if self._resume[0] == epoch:
                skip = self._resume[1]
            self._resume = None
        self._pass_epoch, self._served = epoch, skip
        rows = self.order(epoch)
        n_batches = len(self)
        worker = get_worker_info()
        first, step = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        for i in range(first, n_batches, step):
            if i < skip:
                continue
            batch = self.gather(rows[i * self.batch_size : (i + 1) * self.batch_size])
            self._served = i + 1
            yield batch
