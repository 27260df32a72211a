"""Compute a selection of registered features for bars of several symbols: the DataFrame and tensor paths.

Two backends compute the same values: "numpy" (float64 numpy on the host, tuned for one CPU core) and "torch"
(float64 torch ops on the input tensors' device, :mod:`foxhunt.features.device`, for CUDA); ``FeatureSet.compute``
picks torch for CUDA input and numpy otherwise unless told.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from foxhunt.features import calendar
from foxhunt.features.catalog import KNOWN_FUTURE, REGISTRY
from foxhunt.features.panel import Panel
from foxhunt.features.registry import Feature, select

BACKENDS: tuple[str, ...] = ("auto", "numpy", "torch")
__all__ = ["BACKENDS", "KNOWN_FUTURE", "REGISTRY", "FeatureOutput", "FeatureSet", "compute_features"]

@dataclass
class FeatureOutput:
    """Feature values [T, F] float32 (NaN during warm-up), their names, and the rows where all are warmed up.

    ``values`` is a transposed view of a feature-major [F, T] buffer (each feature is written as one
    contiguous row, which is what keeps the computation fast and within memory); call
    ``values.contiguous()`` for row-major storage. Both backends give the same layout, on the input's device.
    """

    values: torch.Tensor
    names: list[str]
    ready: torch.Tensor


@functools.lru_cache(maxsize=64)
def _release_plan(names: tuple[str, ...]) -> tuple[tuple[Hashable, ...], ...]:
    """For each feature of the selection, the memoised intermediates no later feature uses.

    Found by a dry run on a short random panel that records which intermediates each feature touches,
    so a full run frees every intermediate right after its last use and peak memory stays bounded.
    """
    ohlcv, ts, sym = _dry_run_bars()
    panel = Panel.from_flat(ohlcv, ts, sym)
    touched: list[set] = []
    with np.errstate(all="ignore"):
        for name in names:
            panel.trace = set()
            REGISTRY[name].fn(panel)
            touched.append(panel.trace)
    return _plan_from_traces(touched)


def _dry_run_bars(n: int = 512) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A short random single-symbol series (ohlcv [n, 5], timestamps, symbol index) for the release plans' dry runs."""
    rng = np.random.default_rng(0)
    c = 100.0 * np.exp(np.cumsum(0.01 * rng.standard_normal(n)))
    o = np.concatenate([[100.0], c[:-1]])
    ohlcv = np.stack([o, np.maximum(o, c) * 1.001, np.minimum(o, c) * 0.999, c, rng.uniform(100, 200, n)], axis=1)
    return ohlcv, np.arange(n, dtype=np.int64) * 60_000_000_000, np.zeros(n, dtype=np.int64)


def _plan_from_traces(touched: list[set]) -> tuple[tuple[Hashable, ...], ...]:
    """From the memo keys each feature touched, in order, the keys to release after each feature (their last use)."""
    last: dict[Hashable, int] = {}
    for j, keys in enumerate(touched):
        for k in keys:
            last[k] = j
    plan: list[list[Hashable]] = [[] for _ in touched]
    for k, j in last.items():
        plan[j].append(k)
    return tuple(tuple(p) for p in plan)


def _output_buffer(shape: tuple[int, int], dtype) -> np.ndarray:
    """An uninitialised private array: numpy asks for transparent huge pages on large ones, which makes first
    touching a ~500 MB output several times cheaper than 4 KiB page faults (a shared mmap would not get them)."""
    return np.empty(shape, dtype=dtype)


def _check_input(cols: np.ndarray, timestamps: np.ndarray, symbol_index: np.ndarray) -> None:
    """Clear errors, naming the row, for input the features cannot be computed from; cols is ohlcv [5, N].

    Whole-array extremes first (a NaN fails every comparison): per-row checks cost ~50 ms at a million bars.
    """
    prices, volume = cols[:4], cols[4]
    if not (prices.min() > 0 and prices.max() < np.inf and volume.min() >= 0 and volume.max() < np.inf):
        rows = np.isfinite(cols).all(axis=0) & (prices > 0).all(axis=0) & (volume >= 0)
        bad = int(np.flatnonzero(~rows)[0])
        raise ValueError(
            f"features: row {bad} has a non-finite or non-positive price, or a negative or non-finite volume "
            f"(open, high, low, close, volume = {cols[:, bad].tolist()})"
        )
    step = np.diff(symbol_index)
    if (step < 0).any():
        bad = int(np.flatnonzero(step < 0)[0]) + 1
        raise ValueError(f"features: rows must be grouped by symbol, sorted by (symbol, time); row {bad} goes back to an earlier symbol")
    back = (step == 0) & (np.diff(timestamps) <= 0)
    if back.any():
        bad = int(np.flatnonzero(back)[0]) + 1
        raise ValueError(f"features: timestamps must increase within a symbol; row {bad} is not after row {bad - 1}")


def _place(row: np.ndarray, dest: np.ndarray, panel: Panel, warmup: int) -> None:
    """Move a feature's [S, T] values into its flat output row and blank each symbol's warm-up."""
    if dest.shape[0] == 1:  # dest is the row itself
        row[:warmup] = np.nan
        return
    for s, (a, m) in enumerate(zip(panel.starts, panel.lengths)):
        row[a : a + m] = dest[s, :m]
        row[a : a + min(m, warmup)] = np.nan


def _compute_flat(
    selected: list[Feature], ohlcv: np.ndarray, timestamps: np.ndarray, symbol_index: np.ndarray, dtype=np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Feature-major values [F, N] and ready [N] from rows sorted by (symbol, time)."""
    n = ohlcv.shape[0]
    out = _output_buffer((len(selected), n), dtype)
    if n == 0:
        return out, np.zeros(0, dtype=bool)
    cols = np.ascontiguousarray(ohlcv.T, dtype=np.float64)
    _check_input(cols, timestamps, symbol_index)
    panel = Panel.from_columns(cols, timestamps, symbol_index)
    S, T = panel.shape
    plan = _release_plan(tuple(f.name for f in selected))
    scratch = None if S == 1 else np.empty((S, T), dtype=dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for j, f in enumerate(selected):
            dest = out[j].reshape(1, T) if S == 1 else scratch
            v = f.fn(panel, dest)
            if v.shape != (S, T):
                raise RuntimeError(f"feature {f.name!r} returned shape {v.shape}, expected {(S, T)}")
            if v is not dest:
                np.copyto(dest, v, casting="same_kind")
            del v
            _place(out[j], dest, panel, f.warmup)
            panel.forget(plan[j])
    warm = max((f.warmup for f in selected), default=0)
    pos = np.arange(n) - np.repeat(panel.starts, panel.lengths)
    return out, pos >= warm


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of mask's first True as a 0-d tensor, len(mask) when there is none (no host synchronisation)."""
    return torch.cat((mask, mask.new_ones(1))).to(torch.uint8).argmax()


def _check_input_device(ohlcv: torch.Tensor, timestamps: torch.Tensor, symbol_index: torch.Tensor) -> None:
    """:func:`_check_input`'s checks and messages on the bars' device (ohlcv [N, 5] float64): one host sync."""
    n = ohlcv.shape[0]
    ok = torch.isfinite(ohlcv).all(dim=1) & (ohlcv[:, :4] > 0).all(dim=1) & (ohlcv[:, 4] >= 0)
    step = symbol_index[1:] - symbol_index[:-1]
    back_ts = (step == 0) & (timestamps[1:] <= timestamps[:-1])
    bad, back, late = torch.stack((_first_true(~ok), _first_true(step < 0), _first_true(back_ts))).tolist()
    if bad < n:
        raise ValueError(
            f"features: row {bad} has a non-finite or non-positive price, or a negative or non-finite volume "
            f"(open, high, low, close, volume = {ohlcv[bad].tolist()})"
        )
    if back < n - 1:
        raise ValueError(f"features: rows must be grouped by symbol, sorted by (symbol, time); row {back + 1} goes back to an earlier symbol")
    if late < n - 1:
        raise ValueError(f"features: timestamps must increase within a symbol; row {late + 1} is not after row {late}")


@functools.lru_cache(maxsize=64)
def _device_release_plan(names: tuple[str, ...]) -> tuple[tuple[Hashable, ...], ...]:
    """:func:`_release_plan` for the torch path: per feature, the TorchPanel memo keys no later feature touches
    (a dry run on a short random CPU panel), so each intermediate is freed right after its last use."""
    from foxhunt.features.device import DEVICE_FUNCTIONS, TorchPanel

    panel = TorchPanel.from_flat(*(torch.from_numpy(a) for a in _dry_run_bars()))
    touched: list[set] = []
    with torch.no_grad():
        for name in names:
            panel.trace = set()
            DEVICE_FUNCTIONS[name](panel)
            touched.append(panel.trace)
    return _plan_from_traces(touched)


def _compute_device(
    selected: list[Feature], ohlcv: torch.Tensor, timestamps: torch.Tensor, symbol_index: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature-major values [F, N] and ready [N] on ohlcv's device, by the torch backend, from rows sorted by
    (symbol, time); the same checks, warm-up blanking and ready mask as :func:`_compute_flat`."""
    from foxhunt.features.device import DEVICE_FUNCTIONS, TorchPanel

    dev = ohlcv.device
    n = ohlcv.shape[0]
    out = torch.empty((len(selected), n), dtype=dtype, device=dev)
    if n == 0:
        return out, torch.zeros(0, dtype=torch.bool, device=dev)
    x = ohlcv.detach().to(torch.float64)
    ts = timestamps.detach().to(dev, torch.int64)
    sym = symbol_index.detach().to(dev)
    _check_input_device(x, ts, sym)
    panel = TorchPanel.from_columns(x.T.contiguous(), ts, sym)
    del x
    S, T = panel.shape
    plan = _device_release_plan(tuple(f.name for f in selected))
    moved = sym[1:] != sym[:-1]
    group = torch.cat((moved.new_zeros(1, dtype=torch.int64), torch.cumsum(moved, 0)))  # symbol row of each row
    pos = torch.arange(n, device=dev) - torch.as_tensor(panel.starts, device=dev)[group]  # bar within its symbol
    flat = group * T + pos
    for j, f in enumerate(selected):
        v = DEVICE_FUNCTIONS[f.name](panel)
        if tuple(v.shape) != (S, T):
            raise RuntimeError(f"feature {f.name!r} returned shape {tuple(v.shape)}, expected {(S, T)}")
        if S == 1:
            out[j].copy_(v[0])
            out[j, : f.warmup] = float("nan")
        else:
            out[j].copy_(torch.take(v, flat).masked_fill_(pos < f.warmup, float("nan")))
        del v
        panel.forget(plan[j])
    warm = max((f.warmup for f in selected), default=0)
    return out, pos >= warm


class FeatureSet:
    """A chosen set of registered features (by names and/or families) and its tensor path for the DataModule."""

    def __init__(self, names: Sequence[str] | None = None, families: Sequence[str] | None = None) -> None:
        self.features = select(REGISTRY, names, families)
        if not self.features:
            raise ValueError("FeatureSet: the selection is empty")
        self.names: list[str] = [f.name for f in self.features]
        self.warmup: dict[str, int] = {f.name: f.warmup for f in self.features}

    @property
    def known_future(self) -> list[str]:
        """The selected features computable from timestamps alone (pass to known_future_features)."""
        return [f.name for f in self.features if f.known_future]

    @property
    def max_warmup(self) -> int:
        """Bars each symbol needs before every selected feature is defined."""
        return max(self.warmup.values())

    def compute(self, ohlcv: torch.Tensor, timestamps: torch.Tensor, symbol_index: torch.Tensor,
                backend: str = "auto") -> FeatureOutput:
        """Features of rows sorted by (symbol, time), returned on ohlcv's device.

        ``backend``: "numpy" computes in float64 numpy on the host; "torch" in float64 torch ops on ohlcv's
        device (no host round trip); "auto" (default) is torch for CUDA tensors and numpy otherwise. Both give
        the same values (to float32 rounding), NaN warm-ups, ready mask and errors.
        """
        if backend not in BACKENDS:
            raise ValueError(f"FeatureSet.compute: unknown backend {backend!r}; choose from {list(BACKENDS)}")
        if ohlcv.ndim != 2 or ohlcv.shape[1] != 5:
            raise ValueError(f"FeatureSet.compute: ohlcv must be [T, 5] (open, high, low, close, volume), got {tuple(ohlcv.shape)}")
        if timestamps.shape != ohlcv.shape[:1] or symbol_index.shape != ohlcv.shape[:1]:
            raise ValueError(
                f"FeatureSet.compute: timestamps {tuple(timestamps.shape)} and symbol_index {tuple(symbol_index.shape)} "
                f"must both be [{ohlcv.shape[0]}]"
            )
        if backend == "torch" or (backend == "auto" and ohlcv.device.type == "cuda"):
            with torch.no_grad():
                values, ready = _compute_device(self.features, ohlcv, timestamps, symbol_index)
            return FeatureOutput(values.T, list(self.names), ready)
        device = ohlcv.device
        values, ready = _compute_flat(
            self.features,
            ohlcv.detach().to("cpu", torch.float64).numpy(),
            timestamps.detach().cpu().numpy().astype(np.int64, copy=False),
            symbol_index.detach().cpu().numpy(),
        )
        return FeatureOutput(torch.from_numpy(values).to(device).T, list(self.names), torch.from_numpy(ready).to(device))

    def __repr__(self) -> str:
        return f"FeatureSet({len(self.names)} features, max warm-up {self.max_warmup})"


def compute_features(
    bars: pd.DataFrame,
    names: Sequence[str] | None = None,
    families: Sequence[str] | None = None,
    *,
    dtype: type = np.float32,
) -> pd.DataFrame:
    """One column per feature for bars sorted by (symbol, timestamp); NaN where a feature is still warming up."""
    missing = [c for c in ("timestamp", "open", "high", "low", "close", "volume") if c not in bars.columns]
    if missing:
        raise ValueError(f"compute_features: bars lack column(s) {missing}")
    selected = select(REGISTRY, names, families)
    ohlcv = bars[["open", "high", "low", "close", "volume"]].to_numpy(dtype=np.float64)
    ts = bars["timestamp"]
    if not isinstance(ts.dtype, pd.DatetimeTZDtype) and not pd.api.types.is_datetime64_dtype(ts.dtype):
        raise ValueError(f"compute_features: column 'timestamp' must be datetime64 (UTC), got {ts.dtype}")
    ts_ns = ts.dt.tz_convert("UTC").dt.tz_localize(None) if isinstance(ts.dtype, pd.DatetimeTZDtype) else ts
    ts_ns = ts_ns.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    if "symbol" in bars.columns:
        codes, _ = pd.factorize(bars["symbol"], sort=False)
        bad = np.flatnonzero(np.diff(codes) < 0)
        if bad.size:
            raise ValueError(f"compute_features: rows must be grouped by symbol; row {bars.index[bad[0] + 1]!r} "
                             f"(symbol {bars['symbol'].iloc[bad[0] + 1]!r}) comes after another symbol's rows")
        symbol_index = codes.astype(np.int64)
    else:
        symbol_index = np.zeros(len(bars), dtype=np.int64)
    values, _ = _compute_flat(selected, ohlcv, ts_ns, symbol_index, dtype=dtype)
    return pd.DataFrame(values.T, columns=[f.name for f in selected], index=bars.index, copy=False)


def known_future_features(timestamps, names: Sequence[str] | None = None):
    """Calendar features of arbitrary timestamps (e.g. bars t+1..t+H): [..., K] with K = len(names or KNOWN_FUTURE).

    Takes an int64 ns UTC torch tensor (returns float32 on its device) or a numpy array / DatetimeIndex
    (returns float32 numpy).
    """
    chosen = list(KNOWN_FUTURE if names is None else names)
    bad = [n for n in chosen if n not in KNOWN_FUTURE]
    if bad:
        raise ValueError(f"known_future_features: {bad} are not known-future features; choose from {list(KNOWN_FUTURE)}")
    if isinstance(timestamps, torch.Tensor):
        arr = calendar.calendar_array(timestamps.detach().cpu().numpy(), chosen)
        return torch.from_numpy(np.moveaxis(arr, 0, -1).astype(np.float32)).to(timestamps.device)
    if isinstance(timestamps, (pd.DatetimeIndex, pd.Series)):
        t = pd.DatetimeIndex(timestamps)
        t = t.tz_convert("UTC").tz_localize(None) if t.tz is not None else t
        timestamps = t.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    arr = calendar.calendar_array(np.asarray(timestamps, dtype=np.int64), chosen)
    return np.moveaxis(arr, 0, -1).astype(np.float32)
