"""FeatureStream against FeatureSet.compute: every feature, stepped in chunks of 1, 7, a whole series and random
chunkings, restored from a saved state at random bars, on the synthetic market, with holes, and on the official DBN
samples; the stepping primitives against their batch forms; the state's size against the history's length."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.data.io import load_bars
from foxhunt.data.synthetic import generate_market
from foxhunt.features import ops
from foxhunt.features.catalog import REGISTRY
from foxhunt.features.compute import FeatureSet, _compute
from foxhunt.features.stepping import StepOps
from foxhunt.features.stream import FeatureStream

ALL = list(REGISTRY)
DBN = Path(__file__).parent / "data" / "dbn"
# TRIX, a 1-bar percent change of a triple EMA (a level): both forms agree to the rounding of that level, not of the
# (much smaller) change; its tolerance is relative to 100, the level in its units (see _levels).
LEVEL_FEATURES = tuple(n for n in ALL if n.startswith("trix_"))
RTOL = 1e-12


def _grid(bars: pd.DataFrame) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bars as a [S, T] grid by timestamp: ohlcv [S, T, 5], timestamps [S, T], present [S, T]."""
    t = pd.DatetimeIndex(bars["timestamp"])
    ns = (t.tz_convert("UTC").tz_localize(None) if t.tz is not None else t).to_numpy("datetime64[ns]").astype(np.int64)
    syms = np.array(sorted(bars["symbol"].astype(str).unique()))
    ts = np.unique(ns)
    S, T = len(syms), len(ts)
    ohlcv = np.ones((S, T, 5))
    tsg = np.ones((S, T), dtype=np.int64)  # never read where absent
    present = np.zeros((S, T), dtype=bool)
    row, col = np.searchsorted(syms, bars["symbol"].astype(str).to_numpy()), np.searchsorted(ts, ns)
    ohlcv[row, col] = bars[["open", "high", "low", "close", "volume"]].to_numpy(np.float64)
    tsg[row, col] = ns
    present[row, col] = True
    return torch.from_numpy(ohlcv), torch.from_numpy(tsg), torch.from_numpy(present)


def _batch(ohlcv: torch.Tensor, ts: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """compute's float64 values on the same per-symbol histories, back on the grid [S, T, F] (NaN where absent)."""
    S, T = present.shape
    rows = present.reshape(-1)
    sym = torch.arange(S).repeat_interleave(T)[rows]
    vals, _ = _compute(list(REGISTRY.values()), ohlcv.reshape(-1, 5)[rows], ts.reshape(-1)[rows], sym,
                       dtype=torch.float64)
    out = torch.full((S * T, len(ALL)), float("nan"), dtype=torch.float64)
    out[rows] = vals.T
    return out.view(S, T, -1)


def _levels(ohlcv: torch.Tensor, present: torch.Tensor, batch: torch.Tensor) -> dict[str, float]:
    """Each LEVEL_FEATURES' price level in its own units (median over the bars): C / ATR(14) for ATR units (CCI's
    with its 0.015), 2 / width for Bollinger bands, 100 for TRIX (a percent change of a level)."""
    j = {n: i for i, n in enumerate(ALL)}
    c = ohlcv[..., 3][present]
    atr_units = float(np.nanmedian((c / (batch[..., j["natr_14"]][present] / 100.0 * c)).numpy()))  # C / ATR(14)
    out = {}
    for n in LEVEL_FEATURES:
        if n.startswith("bb_"):
            w = batch[..., j["bb_width_" + n.rsplit("_", 1)[1]]][present]
            out[n] = float(np.nanmedian((2.0 / w).numpy()))
        elif n.startswith("trix_"):
            out[n] = 100.0
        elif n.startswith("cci_"):
            out[n] = atr_units / 0.015
        else:
            out[n] = atr_units
    return out


def _assert_match(stream: torch.Tensor, batch: torch.Tensor, levels: dict[str, float] | None = None) -> int:
    """Same NaNs; values within RTOL of max(|batch|, the feature's median |batch|, its level); the number of
    features that differ at all (bit for bit)."""
    differing = 0
    for j, name in enumerate(ALL):
        a, b = stream[..., j], batch[..., j]
        nan = torch.isnan(b)
        assert torch.equal(torch.isnan(a), nan), f"{name}: NaN at different bars"
        if nan.all():
            continue
        bf, af = b[~nan], a[~nan]
        scale = max(float(bf.abs().median()), (levels or {}).get(name, 0.0))
        err = ((af - bf).abs() / bf.abs().clamp_min(scale)).nan_to_num(nan=0.0).max()  # 0 / 0: equal zeros
        assert err <= RTOL, f"{name}: relative difference {float(err):.3g} > {RTOL}"
        differing += int(not torch.equal(af, bf))
    return differing


def _run(fs: FeatureStream, ohlcv, ts, present, bounds: list[int], dtype=torch.float64,
         ready: list | None = None) -> torch.Tensor:
    """The stream's values over the chunks between bounds (its ready masks appended to ``ready`` when given)."""
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        v, r = fs.update(ohlcv[:, a:b], ts[:, a:b], present[:, a:b], dtype=dtype)
        assert v.shape == (ohlcv.shape[0], b - a, len(fs.names)) and r.shape == (ohlcv.shape[0], b - a)
        parts.append(v)
        if ready is not None:
            ready.append(r)
    return torch.cat(parts, dim=1)


@pytest.fixture(scope="module")
def market():
    """Three synthetic symbols of 560 bars (past every warm-up, 200, and the window sums' first block, 512) and
    compute's values on them."""
    bars = generate_market(560, n_symbols=3, seed=3, session_gaps=False).bars
    ohlcv, ts, present = _grid(bars)
    assert bool(present.all())
    batch = _batch(ohlcv, ts, present)
    return ohlcv, ts, present, batch, _levels(ohlcv, present, batch)


@pytest.mark.parametrize("chunk", [7, 4096])
def test_every_feature_equals_compute_whatever_the_chunk(market, chunk):
    ohlcv, ts, present, batch, levels = market
    T = ohlcv.shape[1]
    fs = FeatureStream(ALL, 3)
    assert fs.names == FeatureSet(ALL).names and fs.warmup == FeatureSet(ALL).max_warmup
    _assert_match(_run(fs, ohlcv, ts, present, list(range(0, T, chunk)) + [T]), batch, levels)


def test_random_chunkings_and_restores_at_random_bars(market):
    """Seeded random chunkings; the stream is saved, rebuilt and restored at random bars (after warm-up too) and
    continues bit for bit as the uninterrupted one; the last bars are stepped one at a time."""
    ohlcv, ts, present, batch, levels = market
    T = ohlcv.shape[1]
    rng = np.random.default_rng(7)
    for trial in range(2):
        cuts = np.sort(rng.choice(np.arange(1, T - 40), size=16, replace=False)).tolist()
        bounds = [0, *cuts, *range(T - 40, T), T] if trial == 0 else [0, *cuts, T]
        fs, ref = FeatureStream(ALL, 3), FeatureStream(ALL, 3)
        parts, ref_parts = [], []
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if i % 5 == 3:  # reopen: a fresh stream from the saved state
                saved = {k: v.clone() for k, v in fs.state_dict().items()}
                fs = FeatureStream(ALL, 3)
                fs.load_state_dict(saved)
            parts.append(fs.update(ohlcv[:, a:b], ts[:, a:b], dtype=torch.float64)[0])
            ref_parts.append(ref.update(ohlcv[:, a:b], ts[:, a:b], dtype=torch.float64)[0])
        got = torch.cat(parts, dim=1)
        assert torch.equal(got.nan_to_num(1e300), torch.cat(ref_parts, dim=1).nan_to_num(1e300))
        _assert_match(got, batch, levels)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(3, 97), min_size=1, max_size=12), reopen=st.integers(0, 11))  # 1: above
def test_any_chunking_property(market, sizes, reopen):
    """Hypothesis draws the chunk sizes (cycled over the series) and the chunk after which the stream is reopened
    from its saved state: every feature still equals compute's."""
    ohlcv, ts, present, batch, levels = market
    T = ohlcv.shape[1]
    bounds, i = [0], 0
    while bounds[-1] < T:
        bounds.append(min(T, bounds[-1] + sizes[i % len(sizes)]))
        i += 1
    fs, parts = FeatureStream(ALL, 3), []
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if j == reopen:
            saved = fs.state_dict()
            fs = FeatureStream(ALL, 3)
            fs.load_state_dict(saved)
        parts.append(fs.update(ohlcv[:, a:b], ts[:, a:b], dtype=torch.float64)[0])
    _assert_match(torch.cat(parts, dim=1), batch, levels)


def test_float32_values_and_ready_are_computes(market):
    """The float32 output is compute's rounding of the same float64 values; ready is compute's ready mask."""
    ohlcv, ts, present, batch, _ = market
    S, T = present.shape
    fs = FeatureStream(ALL, S)
    v, ready = fs.update(ohlcv, ts)
    assert v.dtype == torch.float32
    flat = FeatureSet(ALL).compute(ohlcv.reshape(-1, 5), ts.reshape(-1), torch.arange(S).repeat_interleave(T))
    want = flat.values.contiguous().view(S, T, -1)
    assert torch.equal(ready, flat.ready.view(S, T))
    same = (v == want) | (v.isnan() & want.isnan())
    assert same.float().mean() > 0.999, f"{int((~same).sum())} of {same.numel()} float32 values differ"


def test_holes_keep_the_state_still(market):
    """Symbols with missing bars (present False): their state does not move there, their row is NaN and not ready,
    and their values are compute's on their own bars."""
    ohlcv, ts, present, _, _ = market
    rng = np.random.default_rng(1)
    holes = present.clone()
    holes[0, rng.choice(60, 25, replace=False)] = False
    holes[2, 100:110] = False
    holes[1, 0:2] = False
    T = 260
    ohlcv, ts, holes = ohlcv[:, :T], ts[:, :T], holes[:, :T]
    batch = _batch(ohlcv, ts, holes)
    fs = FeatureStream(ALL, 3)
    bounds = [0, 1, 5, 60, 100, 110, *range(111, 140), T]  # chunks with holes go slot by slot; then single bars at
    # ages that differ between the symbols (ring columns per symbol)
    readies: list[torch.Tensor] = []
    got = _run(fs, ohlcv, ts, holes, bounds, ready=readies)
    _assert_match(got, batch, _levels(ohlcv, holes, batch))
    assert got[~holes].isnan().all()
    ready = torch.cat(readies, dim=1)
    assert not ready[~holes].any()
    assert torch.equal(ready, holes & (holes.cumsum(dim=1) > fs.warmup))  # compute's: past each symbol's warm-up
    state = fs.state_dict()
    assert torch.equal(state["age"], holes.sum(dim=1))
    # the symbols that missed bars were put back on the stream's one ring clock (their rings rotated)
    assert torch.equal(state["ring_shift"], T - holes.sum(dim=1)) and bool(state["ring_shift"].any())


def test_a_state_saved_with_rings_placed_by_age_is_restored(market):
    """A state without ``ring_shift`` (saved before ring clocks: each ring placed by the symbol's age) restores onto
    the clock and continues bit for bit as a stream that keeps placing rings by age."""
    ohlcv, ts, present, _, _ = market
    holes = present.clone()
    holes[0, 30:45] = False
    holes[2, 100:103] = False
    T = 300
    ohlcv, ts, holes = ohlcv[:, :T], ts[:, :T], holes[:, :T]
    by_age = FeatureStream(ALL, 3)
    by_age._align = lambda: None  # the old layout: ring columns by age, a shift of 0
    first = _run(by_age, ohlcv, ts, holes, [0, 120])
    saved = {k: v for k, v in by_age.state_dict().items() if k != "ring_shift"}
    fs = FeatureStream(ALL, 3)
    fs.load_state_dict(saved)
    assert bool(fs.state_dict()["ring_shift"].any())  # rotated onto one clock at the restore
    bounds = [120, *range(121, 160), T]
    got, want = _run(fs, ohlcv, ts, holes, bounds), _run(by_age, ohlcv, ts, holes, bounds)
    assert torch.equal(got.nan_to_num(1e300), want.nan_to_num(1e300))
    batch = _batch(ohlcv, ts, holes)
    _assert_match(torch.cat((first, got), dim=1), batch, _levels(ohlcv, holes, batch))


def _steady_run(fs: FeatureStream, ohlcv, ts, present, start: int) -> tuple[torch.Tensor, int]:
    """The stream's float64 values bar by bar from bar ``start`` (the bars before in one chunk) and how many of those
    bars were steady steps (the fast path's)."""
    steady, inner = 0, fs._steady_step

    def counted(*args):
        nonlocal steady
        steady += 1
        return inner(*args)

    fs._steady_step = counted
    return _run(fs, ohlcv, ts, present, [0, start, *range(start + 1, ohlcv.shape[1] + 1)]), steady


@pytest.mark.parametrize("with_holes", [False, True])
def test_steady_step_code_equals_the_reference_bit_for_bit(market, with_holes):
    """The code torch.compile traces (StepOps(steady=True): ring columns from the age tensor, state moved in place,
    no branch on the data), run eagerly, equals the plain stream bit for bit, values and state; one bar at a time
    across the 512-bar block start, and, with holes, at ages that differ between symbols."""
    ohlcv, ts, present, batch, levels = market
    present = present.clone()
    if with_holes:
        present[1, 490:494] = False
        present[2, 500:501] = False
    fast, ref = FeatureStream(ALL, 3), FeatureStream(ALL, 3)
    fast.compiled = True  # the steady path, not compiled (fast._steady is the eager _steady_values)
    got, steady = _steady_run(fast, ohlcv, ts, present, 480)
    want = _run(ref, ohlcv, ts, present, [0, 480, *range(481, ohlcv.shape[1] + 1)])
    assert steady >= 70, steady  # the steady path did run (not on the block start, nor on bars with holes)
    assert torch.equal(got.nan_to_num(1e300), want.nan_to_num(1e300))
    mine, theirs = fast.state_dict(), ref.state_dict()
    assert all(torch.equal(mine[k].nan_to_num(1e300), theirs[k].nan_to_num(1e300)) for k in theirs)
    if not with_holes:
        _assert_match(got, batch, levels)


def test_compiled_step_runs_torchs_own_transcendentals():
    """In the traced step, log/sin/... (plain, in place, out=) are torch's kernel through one opaque op, so inductor's
    vectorised versions (an ulp off MKL's) never reach a feature; run eagerly, the values are torch's bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from foxhunt.features.stream import _TorchKernels

    seen: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.rand(37, 3, dtype=torch.float64) + 0.5
    want = (torch.log(x), x.log1p(), torch.sin(x.float()), torch.exp(-x))
    out = torch.empty_like(x)
    with Ops(), _TorchKernels():
        got = (torch.log(x), x.clone().log1p_(), torch.sin(x.float()), torch.exp(-x, out=out))
        plain = x * 2.0
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) and torch.equal(plain, x * 2.0)
    assert got[3] is out
    assert sum("foxhunt.eager_unary" in f for f in seen) == 4, seen
    assert not any(f.startswith(("aten.log.", "aten.sin.", "aten.exp.", "aten.log1p")) for f in seen), seen


@pytest.mark.slow
def test_compiled_stream_equals_compute_and_the_eager_stream():
    """FeatureStream(compile=True) on 27 symbols (inductor's vectorised loops and their tails): steady bars through
    the compiled graph are within the tolerance of compute and of the eager stream, one bar at a time across the block
    start and after two symbols missed bars (their ages differ, their ring clock does not); so is a second compiled stream of another selection beside it (each stream its own graph, whose
    non-tensor guards are dropped), the same compiled stream after load_state_dict replaced its state's tensors, and a
    fresh compiled stream restored from a saved state."""
    bars = generate_market(560, n_symbols=27, seed=5, session_gaps=False).bars
    ohlcv, ts, present = _grid(bars)
    present[4, 300:303] = False  # symbols that miss bars: later steady bars at ages that differ (one ring clock)
    present[11, 320] = False
    batch = _batch(ohlcv, ts, present)
    levels = _levels(ohlcv, present, batch)
    some = ALL[::3]
    fast, other, ref = FeatureStream(ALL, 27, compile=True), FeatureStream(some, 27, compile=True), FeatureStream(ALL, 27)
    T = ohlcv.shape[1]
    bounds = [0, 240, *range(241, T + 1)]
    parts, others, steady = [], [], 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if a == 380:  # the same compiled stream, its state's tensors replaced
            fast.load_state_dict(fast.state_dict())
        if a == 450:
            saved = fast.state_dict()
            fast = FeatureStream(ALL, 27, compile=True)
            fast.load_state_dict(saved)
        steady += int(b - a == 1 and bool(present[:, a].all()) and fast._is_steady())
        parts.append(fast.update(ohlcv[:, a:b], ts[:, a:b], present[:, a:b], dtype=torch.float64)[0])
        others.append(other.update(ohlcv[:, a:b], ts[:, a:b], present[:, a:b], dtype=torch.float64)[0])
    got = torch.cat(parts, dim=1)
    assert steady >= 300, steady
    assert bool(fast.state_dict()["ring_shift"][[4, 11]].all())
    _assert_match(got, batch, levels)
    _assert_match(got, _run(ref, ohlcv, ts, present, bounds), levels)
    idx = [ALL.index(n) for n in some]
    full = torch.full_like(batch, float("nan"))
    full[..., idx] = torch.cat(others, dim=1)
    sub = torch.full_like(batch, float("nan"))
    sub[..., idx] = batch[..., idx]
    _assert_match(full, sub, levels)


@pytest.mark.parametrize("name", sorted(p.name for p in DBN.glob("*.dbn*") if "ohlcv-1d" not in p.name))
def test_official_dbn_samples(name):
    """Databento's own sample files (two real-format bars each): the stream gives compute's values and NaNs."""
    bars = load_bars(DBN / name)
    ohlcv, ts, present = _grid(bars)
    fs = FeatureStream(ALL, ohlcv.shape[0])
    _assert_match(_run(fs, ohlcv, ts, present, [0, 1, ohlcv.shape[1]]), _batch(ohlcv, ts, present))


def test_state_does_not_grow_with_history(market):
    """The same keys, shapes and dtypes at construction, after 30 bars and after every bar: O(1) memory."""
    ohlcv, ts, _, _, _ = market
    fs = FeatureStream(ALL, 3)

    def layout():
        return {k: (v.dtype, tuple(v.shape)) for k, v in fs.state_dict().items()}

    empty = layout()
    fs.update(ohlcv[:, :30], ts[:, :30])
    assert layout() == empty
    fs.update(ohlcv[:, 30:], ts[:, 30:])
    assert layout() == empty
    assert sum(v.numel() for v in fs.state_dict().values()) < 3 * 20_000


def test_state_dict_is_verified(market):
    ohlcv, ts, _, _, _ = market
    fs = FeatureStream(ALL, 3)
    fs.update(ohlcv[:, :10], ts[:, :10])
    good = fs.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in good.values())
    with pytest.raises(ValueError, match="'config'"):
        FeatureStream(ALL[:-1], 3).load_state_dict(good)
    with pytest.raises(ValueError, match="'config'"):
        FeatureStream(ALL, 2).load_state_dict(good)
    key = next(k for k in good if k.startswith("op"))
    for bad, why in (({**good, key: good[key][:1]}, key), ({**good, key: good[key].float()}, key),
                     ({k: v for k, v in good.items() if k != key}, key), ({**good, "extra": good[key]}, "extra")):
        with pytest.raises(ValueError, match=repr(why).replace(".", r"\.")):
            FeatureStream(ALL, 3).load_state_dict(bad)
    with pytest.raises(ValueError, match="symbol row 1, bar 0"):
        bad_bar = ohlcv[:, 10:11].clone()
        bad_bar[1, 0, 3] = float("nan")
        fs.update(bad_bar, ts[:, 10:11])
    with pytest.raises(ValueError, match="symbol row 0, bar 0 .* timestamp not after"):
        fs.update(ohlcv[:, 9:10], ts[:, 9:10])


def _stepped(fn, xs: list[torch.Tensor], bounds: list[int]) -> torch.Tensor:
    """fn(op, *chunks) over the chunks of xs [S, T] between bounds, one state carried."""
    state: dict[str, torch.Tensor] = {}
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        age = torch.arange(a, b).expand(xs[0].shape[0], b - a)
        out.append(fn(StepOps(state, age), *(x[:, a:b] for x in xs)))
    return torch.cat(out, dim=1)


EXACT = {  # the stepping forms bit for bit equal to the batch forms
    "shift": lambda o, x: o.shift(x, 3),
    "diff": lambda o, x: o.diff(x, 5),
    "pct_change": lambda o, x: o.pct_change(x, 2),
    "cumsum": lambda o, x: o.cumsum(x),
    "rolling_sum": lambda o, x: o.rolling_sum(x, 9, start=2),
    "rolling_mean_3": lambda o, x: o.rolling_mean(x, 3, start=1),
    "rolling_max": lambda o, x: o.rolling_max(x, 6),
    "rolling_min": lambda o, x: o.rolling_min(x, 5),
    "bars_since_extreme": lambda o, x: o.bars_since_extreme(x, 7, True),
    "aroon_line": lambda o, x: o.aroon_line(x, 4, False),
    "mean_abs_deviation": lambda o, x: o.mean_abs_deviation(x, torch.sin(x), 6, 0.015),
    "prefix_std": lambda o, x: o.Prefix(x, 1, True).std(6),
    "first": lambda o, x: o.first(x).expand_as(x),
    "blank": lambda o, x: o.blank(x.clone(), 4),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_primitives_step_bit_for_bit(name):
    torch.manual_seed(0)
    x = torch.randn(3, 61, dtype=torch.float64).cumsum(1).round(decimals=1) + 50.0  # ties for the extrema
    batch = _stepped(EXACT[name], [x], [0, 61])
    for bounds in (list(range(62)), [0, 7, 14, 20, 33, 61], [0, 2, 61]):
        assert torch.equal(_stepped(EXACT[name], [x], bounds).nan_to_num(1e300), batch.nan_to_num(1e300)), bounds
    want = {"shift": ops.shift(x, 3), "diff": ops.diff(x, 5), "cumsum": ops.cumsum(x),
            "rolling_sum": ops.rolling_sum(x, 9, 2), "rolling_max": ops.rolling_max(x, 6),
            "bars_since_extreme": ops.bars_since_extreme(x, 7, True), "prefix_std": ops.Prefix(x, 1, True).std(6),
            "mean_abs_deviation": ops.mean_abs_deviation(x, torch.sin(x), 6, 0.015)}
    if name in want:  # one chunk from the empty state is the batch form itself
        assert torch.equal(batch.nan_to_num(1e300), want[name].nan_to_num(1e300))


SCANS = {  # the recurrences, stepped, against the batch form's blocked scans (to rounding)
    "ema": (lambda o, x: o.ema(x, 10, start=2), lambda x: ops.ema(x, 10, start=2)),
    "ema_first": (lambda o, x: o.ema(x, 4, seed="first"), lambda x: ops.ema(x, 4, seed="first")),
    "wilder": (lambda o, x: o.wilder(x, 14, start=1), lambda x: ops.wilder(x, 14, start=1)),
    "wilder_sum": (lambda o, x: o.wilder_sum(x, 14, start=1), lambda x: ops.wilder_sum(x, 14, start=1)),
    "seeded_scan": (lambda o, x: o.seeded_scan(x, 0, 0.0, 0.5, 0.5), lambda x: ops.seeded_scan(x, 0, 0.0, 0.5, 0.5)),
    "recurrence": (lambda o, x: o.seeded_recurrence(0.3 + 0.5 / x, x / 10, x, 3, 0.3),
                   lambda x: ops.seeded_recurrence(0.3 + 0.5 / x, x / 10, x, 3, 0.3)),
}


@pytest.mark.parametrize("name", sorted(SCANS))
def test_recursive_primitives_step_to_rounding(name):
    torch.manual_seed(1)
    x = torch.randn(2, 3000, dtype=torch.float64).mul(0.01).cumsum(1).exp() * 100.0
    step, batch = SCANS[name]
    want = batch(x)
    for bounds in ([0, 3000], [0, 1, 2, 5, 13, 1000, 2999, 3000], [0, *range(1, 40), 3000]):
        got = _stepped(step, [x], bounds)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.allclose(got, want, rtol=1e-13, atol=0.0, equal_nan=True), bounds


def test_block_prefix_steps_bit_for_bit():
    """The block-centred window sums (SMA, Bollinger, CCI) across block starts (512, 1024), in any chunking."""
    torch.manual_seed(2)
    x = torch.randn(3, 1300, dtype=torch.float64).mul(0.01).cumsum(1).exp() * 100.0
    bp = ops.BlockPrefix(x, 20, squares=True)
    want = torch.cat([bp.mean(12), *bp.mean_std(20, 2.0), bp.deviation(x, 7), bp.sum(5)], dim=1)

    def step(o, x):
        sp = o.BlockPrefix(x, 20, squares=True)
        return torch.cat([sp.mean(12), *sp.mean_std(20, 2.0), sp.deviation(x, 7), sp.sum(5)], dim=1)

    for bounds in ([0, 1300], [0, 1, 2, 300, 511, 512, 513, 700, 1023, 1025, 1300], [0, *range(500, 530), 1300]):
        parts = []
        state: dict[str, torch.Tensor] = {}
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            parts.append(step(StepOps(state, torch.arange(a, b).expand(3, b - a)), x[:, a:b]).view(3, 5, b - a))
        got = torch.cat(parts, dim=2).reshape(3, -1)
        assert torch.equal(got.nan_to_num(1e300), want.view(3, 5, 1300).reshape(3, -1).nan_to_num(1e300)), bounds


def test_a_selection_and_a_safetensors_round_trip(market, tmp_path):
    """A few features (each one's own state slots), saved to and restored from a safetensors file mid-stream."""
    from safetensors.torch import load_file, save_file

    ohlcv, ts, _, batch, _ = market
    names = ["tod_sin", "rsi_14", "bb_pctb_20", "trix_15"]
    fs, ref = FeatureStream(names, 3), FeatureStream(names, 3)
    assert fs.names == FeatureSet(names).names and fs.warmup == FeatureSet(names).max_warmup == 43
    for a, b in ((0, 50), (50, 51)):
        fs.update(ohlcv[:, a:b], ts[:, a:b])
        ref.update(ohlcv[:, a:b], ts[:, a:b])
    save_file(fs.state_dict(), tmp_path / "stream.safetensors")
    back = FeatureStream(names, 3)
    back.load_state_dict(load_file(tmp_path / "stream.safetensors"))
    got = back.update(ohlcv[:, 51:], ts[:, 51:], dtype=torch.float64)[0]
    want = ref.update(ohlcv[:, 51:], ts[:, 51:], dtype=torch.float64)[0]
    assert torch.equal(got.nan_to_num(1e300), want.nan_to_num(1e300))
    cols = [ALL.index(n) for n in fs.names]
    assert torch.allclose(got, batch[:, 51:, cols], rtol=1e-10, atol=1e-10, equal_nan=True)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("field, value", [(0, float("nan")), (1, float("inf")), (2, -float("inf")), (3, 0.0),
                                          (2, -1.0), (4, -1.0), (4, float("nan")), (4, float("inf")),
                                          ("ts", "repeat"), ("ts", "back")])
def test_a_bad_bar_is_refused_in_one_line_and_moves_nothing(market, k, field, value):
    """Whichever field is bad (any position among the symbols and bars of a chunk), update refuses the chunk in one
    line naming the symbol row and bar, and the state does not move; the same chunk, good, passes."""
    ohlcv, ts, _, _, _ = market
    fs = FeatureStream(ALL, 3)
    fs.update(ohlcv[:, :250], ts[:, :250])
    before = fs.state_dict()
    for s, j in ((0, 0), (2, k - 1), (1, k // 2)):
        bars, times = ohlcv[:, 250 : 250 + k].clone(), ts[:, 250 : 250 + k].clone()
        if field == "ts":
            times[s, j] = times[s, j - 1] if j else ts[s, 249]
            if value == "back":
                times[s, j] -= 1
        else:
            bars[s, j, field] = value
        with pytest.raises(ValueError, match=rf"symbol row {s}, bar {j} of the chunk has "):
            fs.update(bars, times)
        after = fs.state_dict()
        assert all(torch.equal(after[key].nan_to_num(1e300), before[key].nan_to_num(1e300)) for key in before)
    fs.update(ohlcv[:, 250 : 250 + k], ts[:, 250 : 250 + k])
