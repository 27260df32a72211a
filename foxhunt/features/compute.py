"""Compute a selection of registered features for bars of several symbols: the DataFrame and tensor paths.

One implementation for every device: each feature is a function of a :class:`Panel` of float64 tensors on the
bars' device, written in the plain torch primitives of :mod:`foxhunt.features.ops`, so the same code serves a CPU
and a GPU.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from foxhunt.features import calendar
from foxhunt.features.catalog import KNOWN_FUTURE, REGISTRY
from foxhunt.features.panel import Panel, one_symbol
from foxhunt.features.registry import Feature, select

__all__ = ["KNOWN_FUTURE", "REGISTRY", "FeatureOutput", "FeatureSet", "compute_features", "known_future_features"]


@dataclass
class FeatureOutput:
    """Feature values [T, F] float32 (NaN during warm-up), their names, and the rows where all are warmed up.

    ``values`` is a transposed view of a feature-major [F, T] buffer (each feature is written as one
    contiguous row, which is what keeps the computation fast and within memory), on the input's device;
    call ``values.contiguous()`` for row-major storage.
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
    panel = Panel.from_flat(*(torch.from_numpy(a) for a in _dry_run_bars()))
    touched: list[set] = []
    with torch.no_grad():
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


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of mask's first True as a 0-d tensor, len(mask) when there is none (no host synchronisation)."""
    return torch.cat((mask, mask.new_ones(1))).to(torch.uint8).argmax()


def _columns(ohlcv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bars' columns [5, N] float64 (one contiguous row per field) and each field's lowest and highest value
    (NaN if it holds one, as the checks expect)."""
    cols = _output_buffer((5, ohlcv.shape[0]), torch.float64, ohlcv.device).copy_(ohlcv.T)
    return cols, cols.amin(dim=1), cols.amax(dim=1)


def _check_input(cols: torch.Tensor, timestamps: torch.Tensor, symbol_index: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, single: bool) -> None:
    """Clear errors, naming the row, for input the features cannot be computed from (cols: ohlcv [5, N] float64,
    lo and hi: each field's extremes from :func:`_columns`; single: :func:`one_symbol` of the index).

    Whole-row extremes first (a NaN fails every comparison; per-bar checks cost ~50 ms at a million bars on one
    core), then the bars only when something is wrong; one host synchronisation on a GPU.
    """
    if single:  # one_symbol: one pass over the index instead of four
        step, back_ts = None, timestamps[1:] <= timestamps[:-1]
        decreasing = torch.zeros((), dtype=torch.bool)
    else:
        step = symbol_index[1:] - symbol_index[:-1]
        back_ts = (step == 0) & (timestamps[1:] <= timestamps[:-1])
        decreasing = (step < 0).any()
    flags = torch.stack((lo[:4].min() > 0, hi.max() < float("inf"), lo[4] >= 0, decreasing, back_ts.any()))
    prices_pos, finite, volume_ok, unsorted, late = flags.tolist()
    if not (prices_pos and finite and volume_ok):
        ok = torch.isfinite(cols).all(dim=0) & (cols[:4] > 0).all(dim=0) & (cols[4] >= 0)
        bad = int(_first_true(~ok))
        raise ValueError(
            f"features: row {bad} has a non-finite or non-positive price, or a negative or non-finite volume "
            f"(open, high, low, close, volume = {cols[:, bad].tolist()})"
        )
    if unsorted:
        raise ValueError(f"features: rows must be grouped by symbol, sorted by (symbol, time); row "
                         f"{int(_first_true(step < 0)) + 1} goes back to an earlier symbol")
    if late:
        row = int(_first_true(back_ts)) + 1
        raise ValueError(f"features: timestamps must increase within a symbol; row {row} is not after row {row - 1}")


def _output_buffer(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output (or the bars' columns); on the CPU a numpy array's memory, for which numpy asks for
    transparent huge pages (first touching a ~500 MB output is then several times cheaper than 4 KiB page faults)."""
    if device.type == "cpu":
        return torch.from_numpy(np.empty(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype))
    return torch.empty(shape, dtype=dtype, device=device)


def _compute(
    selected: list[Feature], ohlcv: torch.Tensor, timestamps: torch.Tensor, symbol_index: torch.Tensor,
    dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature-major values [F, N] and ready [N] on ohlcv's device from rows sorted by (symbol, time): each
    feature's [S, T] values go to its flat output row, each symbol's warm-up is blanked with NaN. Every element of
    ``out`` (the caller's [F, N] buffer, else a fresh one) is written."""
    dev = ohlcv.device
    n = ohlcv.shape[0]
    if out is None:
        out = _output_buffer((len(selected), n), dtype, dev)
    if n == 0:
        return out, torch.zeros(0, dtype=torch.bool, device=dev)
    cols, lo, hi = _columns(ohlcv.detach())  # [5, N]: one contiguous row per field
    ts = timestamps.detach().to(dev, torch.int64)
    sym = symbol_index.detach().to(dev)
    single = one_symbol(sym)  # once, for the check and the panel
    _check_input(cols, ts, sym, lo, hi, single)
    panel = Panel.from_columns(cols, ts, sym, single)
    del cols
    S, T = panel.shape
    plan = _release_plan(tuple(f.name for f in selected))
    if S == 1:
        pos = torch.arange(n, device=dev)
    else:
        moved = sym[1:] != sym[:-1]
        group = torch.cat((moved.new_zeros(1, dtype=torch.int64), torch.cumsum(moved, 0)))  # symbol row of each row
        pos = torch.arange(n, device=dev) - panel.starts[group]  # bar within its symbol
        flat = group * T + pos
    nonfinite: list[torch.Tensor | int] = []  # per feature: non-finite values past its warm-up
    for j, f in enumerate(selected):
        dest = out[j].view(1, T) if S == 1 and f.writes_out else None  # one symbol: its output row, by the last step
        v = f.fn(panel) if dest is None else f.fn(panel, out=dest)
        if tuple(v.shape) != (S, T):
            raise RuntimeError(f"feature {f.name!r} returned shape {tuple(v.shape)}, expected {(S, T)}")
        if S == 1:
            if v is not dest:
                out[j].copy_(v[0])
            out[j, : f.warmup] = float("nan")
        else:
            out[j].copy_(torch.take(v, flat).masked_fill_(pos < f.warmup, float("nan")))
        del v
        nonfinite.append(_nonfinite_after_warmup(out[j], f.warmup, pos, S == 1))
        panel.forget(plan[j])  # every intermediate goes after its last use: peak memory stays near the live set
    del panel
    _report_nonfinite(selected, nonfinite)
    warm = max((f.warmup for f in selected), default=0)
    return out, pos >= warm


def _nonfinite_after_warmup(row: torch.Tensor, warmup: int, pos: torch.Tensor, single: bool) -> torch.Tensor | int:
    """How many values of one feature's output row are NaN or infinite past each symbol's warm-up (an int on the CPU,
    a 0-d tensor elsewhere, read with every other feature's in one host synchronisation). On the CPU one sum first:
    it is finite when every value is (or nearly: an overflowing sum is then counted exactly, to 0)."""
    tail = row[warmup:] if single else row.masked_fill(pos < warmup, 0.0)
    if tail.device.type != "cpu":
        return torch.isfinite(tail).logical_not_().sum()
    if math.isfinite(float(tail.sum())):
        return 0
    return int(torch.isfinite(tail).logical_not_().sum())


def _report_nonfinite(selected: list[Feature], counts: list[torch.Tensor | int]) -> None:
    """One RuntimeWarning naming every feature with NaN or infinite values past its warm-up (the ``ready`` mask does
    not cover them: they are defects of the bars or of the feature, never to pass silently)."""
    tensors = [c for c in counts if isinstance(c, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    counts = [next(values) if isinstance(c, torch.Tensor) else c for c in counts]
    bad = {f.name: int(c) for f, c in zip(selected, counts, strict=True) if c}
    if bad:
        listed = ", ".join(f"{name} ({n:,})" for name, n in bad.items())
        warnings.warn(f"features: {sum(bad.values()):,} NaN or infinite value(s) after the warm-up, in {listed}",
                      RuntimeWarning, stacklevel=4)


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
                out: torch.Tensor | None = None) -> FeatureOutput:
        """Features of rows sorted by (symbol, time), computed and returned on ohlcv's device (float64 inside).

        ``out``: where to write the values instead of a fresh buffer (numpy's ``out=``), e.g. the ``values`` of an
        earlier result for bars of the same length, which is then overwritten: repeated calls skip mapping and
        zeroing ~4 bytes x features x bars of new memory each. A float32 [N, F] tensor on ohlcv's device whose
        transpose is contiguous (the layout of ``values``).
        """
        if ohlcv.ndim != 2 or ohlcv.shape[1] != 5:
            raise ValueError(f"FeatureSet.compute: ohlcv must be [T, 5] (open, high, low, close, volume), got {tuple(ohlcv.shape)}")
        if timestamps.shape != ohlcv.shape[:1] or symbol_index.shape != ohlcv.shape[:1]:
            raise ValueError(
                f"FeatureSet.compute: timestamps {tuple(timestamps.shape)} and symbol_index {tuple(symbol_index.shape)} "
                f"must both be [{ohlcv.shape[0]}]"
            )
        dest = None if out is None else self._check_out(out, ohlcv)
        with torch.no_grad():
            values, ready = _compute(self.features, ohlcv, timestamps, symbol_index, out=dest)
        return FeatureOutput(values.T, list(self.names), ready)

    def _check_out(self, out: torch.Tensor, ohlcv: torch.Tensor) -> torch.Tensor:
        """The feature-major [F, N] buffer behind a caller's ``out`` ([N, F], the layout of ``values``)."""
        want = (ohlcv.shape[0], len(self.names))
        if tuple(out.shape) != want or out.dtype != torch.float32 or out.device != ohlcv.device or not out.T.is_contiguous():
            raise ValueError(
                f"FeatureSet.compute: out must be a float32 {list(want)} tensor on {ohlcv.device} whose transpose is "
                f"contiguous (an earlier result's values), got {out.dtype} {list(out.shape)} on {out.device} "
                f"(transpose contiguous: {out.T.is_contiguous()})"
            )
        return out.T

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
    with torch.no_grad():
        bars_t = (torch.from_numpy(np.require(a, requirements="W")) for a in (ohlcv, ts_ns, symbol_index))
        values, _ = _compute(selected, *bars_t, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype)
    return pd.DataFrame(values.numpy().T, columns=[f.name for f in selected], index=bars.index, copy=False)


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
        return _calendar_stack(timestamps.detach(), chosen)
    if isinstance(timestamps, (pd.DatetimeIndex, pd.Series)):
        t = pd.DatetimeIndex(timestamps)
        t = t.tz_convert("UTC").tz_localize(None) if t.tz is not None else t
        timestamps = t.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    return _calendar_stack(torch.from_numpy(np.asarray(timestamps, dtype=np.int64)), chosen).numpy()


def _calendar_stack(ts_ns: torch.Tensor, names: list[str]) -> torch.Tensor:
    """[..., K] float32 calendar features of int64 ns UTC timestamps, on their device."""
    ph = calendar.phases(ts_ns)
    if not names:
        return torch.empty(ts_ns.shape + (0,), dtype=torch.float32, device=ts_ns.device)
    return torch.stack([calendar.calendar_values(n, ph) for n in names], dim=-1)
