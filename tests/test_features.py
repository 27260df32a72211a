"""The feature registry, the DataFrame and tensor paths, causality (no lookahead) and the generated docs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from foxhunt.features import (
    FAMILIES,
    KNOWN_FUTURE,
    REGISTRY,
    FeatureSet,
    compute_features,
    known_future_features,
)

ROOT = Path(__file__).resolve().parents[1]
ALL = list(REGISTRY)


def make_bars(n: int, symbols: tuple[str, ...] = ("AAA", "BBB"), seed: int = 0, flat_every: int = 97) -> pd.DataFrame:
    """Random-walk minute bars per symbol, with some flat bars (H = L) and zero-volume bars."""
    rng = np.random.default_rng(seed)
    frames = []
    for k, sym in enumerate(symbols):
        m = n - 37 * k  # symbols of different lengths
        c = (50.0 + 20 * k) * np.exp(np.cumsum(0.002 * rng.standard_t(4, m)))
        o = np.concatenate([[c[0]], c[:-1] * np.exp(0.0005 * rng.standard_normal(m - 1))])
        h = np.maximum(o, c) * np.exp(np.abs(0.001 * rng.standard_normal(m)))
        lo = np.minimum(o, c) * np.exp(-np.abs(0.001 * rng.standard_normal(m)))
        v = np.round(np.exp(5 + rng.standard_normal(m)))
        flat = np.arange(m) % flat_every == 5
        o[flat] = h[flat] = lo[flat] = c[flat] = c[np.maximum(np.flatnonzero(flat) - 1, 0)]
        v[np.arange(m) % 131 == 7] = 0.0
        ts = pd.date_range("2024-03-01 13:30", periods=m, freq="1min", tz="UTC")
        frames.append(pd.DataFrame({"timestamp": ts, "open": o, "high": h, "low": lo, "close": c, "volume": v, "symbol": sym}))
    return pd.concat(frames, ignore_index=True)


@pytest.fixture(scope="module")
def bars() -> pd.DataFrame:
    return make_bars(1500)


@pytest.fixture(scope="module")
def feats(bars) -> pd.DataFrame:
    return compute_features(bars, dtype=np.float64)


def perturb_after(bars: pd.DataFrame, rows: np.ndarray, rng: np.random.Generator) -> pd.DataFrame:
    """A copy of bars whose given rows get new, still consistent, prices and volumes."""
    out = bars.copy()
    f = np.exp(rng.normal(0, 0.05, len(rows)))
    for col in ("open", "close"):
        out.loc[rows, col] = out.loc[rows, col].to_numpy() * f * np.exp(rng.normal(0, 0.01, len(rows)))
    out.loc[rows, "high"] = np.maximum(out.loc[rows, ["open", "close"]].max(axis=1), out.loc[rows, "high"] * f) * 1.01
    out.loc[rows, "low"] = np.minimum(out.loc[rows, ["open", "close"]].min(axis=1), out.loc[rows, "low"] * f) * 0.99
    out.loc[rows, "volume"] = rng.uniform(0, 5000, len(rows)).round()
    return out


# ---------------------------------------------------------------- registry


def test_registry_covers_the_families():
    counts = Counter(f.family for f in REGISTRY.values())
    assert set(counts) == set(FAMILIES)
    assert 120 <= len(REGISTRY) <= 140
    for f in REGISTRY.values():
        assert f.definition and f.warmup >= 0 and callable(f.fn)
    assert set(KNOWN_FUTURE) == {n for n, f in REGISTRY.items() if f.family == "calendar"}
    assert {"tod_sin", "tod_cos", "dow_sin", "dow_cos"} <= set(KNOWN_FUTURE)


def test_no_feature_is_an_exact_multiple_of_another():
    """Every pair of features differs by more than a scale: a column that is c times another is the same input twice
    once normalised (slope_ema_n was 2 / (n - 1) dist_ema_n, and slope_sma_n was mom_n / n for MOM's windows)."""
    out = compute_features(make_bars(3000, ("AAA",), seed=5))
    v = out.iloc[400:].to_numpy(dtype=np.float64)  # every feature warmed up
    assert np.isfinite(v).all()
    v = v - v.mean(axis=0)
    norm = np.linalg.norm(v, axis=0)
    assert (norm > 0).all(), f"constant features: {list(out.columns[norm == 0])}"
    corr = (v / norm).T @ (v / norm)
    np.fill_diagonal(corr, 0.0)
    i, j = np.unravel_index(np.abs(corr).argmax(), corr.shape)
    assert np.abs(corr).max() < 1.0 - 1e-6, f"{out.columns[i]} and {out.columns[j]} are collinear ({corr[i, j]:.9f})"


def test_selection_by_names_and_families():
    fs = FeatureSet(names=["rsi_14", "gap"], families=["calendar"])
    assert fs.names == [n for n in REGISTRY if n in {"rsi_14", "gap"} or REGISTRY[n].family == "calendar"]
    assert fs.warmup["rsi_14"] == 14 and fs.max_warmup == 14
    assert fs.known_future == list(KNOWN_FUTURE)
    assert FeatureSet().names == ALL
    with pytest.raises(ValueError, match="unknown feature name"):
        FeatureSet(names=["rsi_15"])
    with pytest.raises(ValueError, match="unknown feature family"):
        FeatureSet(families=["astrology"])
    with pytest.raises(TypeError):
        FeatureSet(names="rsi_14")


def test_docs_are_up_to_date():
    from foxhunt.features.docs import features_markdown

    doc = ROOT / "docs" / "FEATURES.md"
    assert doc.exists(), "docs/FEATURES.md missing: run python scripts/gen_features_doc.py"
    assert doc.read_text() == features_markdown(), "docs/FEATURES.md is stale: run python scripts/gen_features_doc.py"
    for name in REGISTRY:
        assert f"`{name}`" in doc.read_text()


# ---------------------------------------------------------------- values


def test_finite_after_warmup_and_nan_inside(bars, feats):
    assert list(feats.columns) == ALL and feats.index.equals(bars.index)
    pos = bars.groupby("symbol", sort=False).cumcount().to_numpy()
    for name, f in REGISTRY.items():
        col = feats[name].to_numpy()
        assert np.isnan(col[pos < f.warmup]).all(), f"{name}: values inside the warm-up"
        bad = ~np.isfinite(col[pos >= f.warmup])
        assert not bad.any(), f"{name}: {bad.sum()} non-finite values after warm-up {f.warmup}"


def test_warmups_are_tight(bars):
    """Each feature's own output is undefined at bar warmup - 1 and defined from bar warmup on: the registry's
    warm-up is neither too short (NaN would reach training) nor longer than needed."""
    from foxhunt.features.panel import Panel

    one = bars[bars.symbol == "AAA"]
    ohlcv = one[["open", "high", "low", "close", "volume"]].to_numpy()
    ts = one["timestamp"].to_numpy(dtype="datetime64[ns]").astype(np.int64)
    panel = Panel.from_flat(torch.tensor(ohlcv), torch.from_numpy(ts), torch.zeros(len(one), dtype=torch.int64))
    with torch.no_grad():
        for name, f in REGISTRY.items():
            raw = f.fn(panel)[0].numpy()
            assert np.isfinite(raw[f.warmup :]).all(), f"{name}: undefined after its warm-up {f.warmup}"
            if f.warmup:
                assert np.isnan(raw[f.warmup - 1]), f"{name}: already defined at bar {f.warmup - 1}, warm-up {f.warmup} too long"


def test_features_are_scale_free(bars, feats):
    """Multiplying every price by 1000 leaves every feature unchanged except Amihud (which shifts by -ln 1000)."""
    scaled = bars.copy()
    scaled[["open", "high", "low", "close"]] *= 1000.0
    g = compute_features(scaled, dtype=np.float64)
    for name in ALL:
        a, b = feats[name].to_numpy(), g[name].to_numpy()
        if name.startswith("amihud"):
            b = b + np.log(1000.0)
        scale = np.nanmax(np.abs(a)) + 1e-12
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7 * scale, err_msg=name)


def test_symbols_are_computed_apart(bars, feats):
    for sym in ("AAA", "BBB"):
        one = bars[bars.symbol == sym]
        alone = compute_features(one.reset_index(drop=True), dtype=np.float64)
        together = feats.loc[one.index].reset_index(drop=True)
        pd.testing.assert_frame_equal(alone, together, rtol=1e-12, atol=1e-12)


def test_known_future_features_match_calendar_columns(bars, feats):
    ts = torch.from_numpy(bars["timestamp"].to_numpy(dtype="datetime64[ns]").astype(np.int64))
    kf = known_future_features(ts[:500].reshape(100, 5))  # e.g. [B, H] future timestamps
    assert kf.shape == (100, 5, len(KNOWN_FUTURE)) and kf.dtype == torch.float32
    flat = kf.reshape(-1, len(KNOWN_FUTURE)).numpy()
    np.testing.assert_allclose(flat, feats[list(KNOWN_FUTURE)].to_numpy()[:500], atol=2e-6)
    t = pd.Timestamp("2024-03-04 12:00", tz="UTC")  # a Monday, noon UTC
    tod_sin, tod_cos, dow_sin, dow_cos = known_future_features(pd.DatetimeIndex([t]), ["tod_sin", "tod_cos", "dow_sin", "dow_cos"])[0]
    assert abs(tod_sin) < 1e-6 and abs(tod_cos + 1) < 1e-6 and abs(dow_sin) < 1e-6 and abs(dow_cos - 1) < 1e-6
    with pytest.raises(ValueError, match="not known-future"):
        known_future_features(ts[:3], ["rsi_14"])


def test_calendar_phases_keep_float64_precision():
    """Phases of ns timestamps are computed in float64 (an int64 x float multiply would round them in float32)."""
    from foxhunt.features.calendar import phases

    t = pd.Timestamp("2024-03-04 12:34:56.789", tz="UTC")
    ph = phases(torch.tensor([t.value]))
    assert abs(float(ph["tod"][0]) - (12 * 3600 + 34 * 60 + 56.789) / 86400) < 1e-9
    assert float(ph["dow"][0]) == 0.0  # a Monday


def test_tensor_path_matches_dataframe_path(bars):
    fs = FeatureSet(families=["trend", "shape", "calendar"])
    ohlcv = torch.tensor(bars[["open", "high", "low", "close", "volume"]].to_numpy(), dtype=torch.float64)
    ts = torch.from_numpy(bars["timestamp"].to_numpy(dtype="datetime64[ns]").astype(np.int64))
    sym = torch.from_numpy(pd.factorize(bars["symbol"])[0].astype(np.int64))
    out = fs.compute(ohlcv, ts, sym)
    assert out.names == fs.names and out.values.shape == (len(bars), len(fs.names)) and out.values.dtype == torch.float32
    df = compute_features(bars, families=["trend", "shape", "calendar"])
    np.testing.assert_array_equal(out.values.numpy(), df.to_numpy())
    pos = bars.groupby("symbol", sort=False).cumcount().to_numpy()
    np.testing.assert_array_equal(out.ready.numpy(), pos >= fs.max_warmup)
    assert torch.isfinite(out.values[out.ready]).all()
    assert torch.isnan(out.values[~out.ready]).any(dim=1).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensor_path_on_cuda(bars):
    fs = FeatureSet(families=["momentum"])
    ohlcv = torch.tensor(bars[["open", "high", "low", "close", "volume"]].to_numpy(), dtype=torch.float64)
    ts = torch.from_numpy(bars["timestamp"].to_numpy(dtype="datetime64[ns]").astype(np.int64))
    sym = torch.from_numpy(pd.factorize(bars["symbol"])[0].astype(np.int64))
    cpu = fs.compute(ohlcv, ts, sym)
    gpu = fs.compute(ohlcv.cuda(), ts.cuda(), sym.cuda())
    assert gpu.values.is_cuda and gpu.ready.is_cuda
    assert torch.equal(gpu.ready.cpu(), cpu.ready)
    torch.testing.assert_close(gpu.values.cpu(), cpu.values, equal_nan=True, rtol=1e-5, atol=1e-5)


def test_bad_input_is_named():
    b = make_bars(300, ("AAA",))
    b.loc[120, "close"] = np.nan
    with pytest.raises(ValueError, match="row 120"):
        compute_features(b)
    b = make_bars(300)
    shuffled = pd.concat([b.iloc[:10], b[b.symbol == "BBB"], b[b.symbol == "AAA"].iloc[10:]], ignore_index=True)
    with pytest.raises(ValueError, match="grouped by symbol"):
        compute_features(shuffled)
    back = make_bars(300, ("AAA",))
    back.loc[50, "timestamp"] = back.loc[10, "timestamp"]
    with pytest.raises(ValueError, match="timestamps must increase"):
        compute_features(back)
    neg = make_bars(300, ("AAA",))
    neg.loc[77, "low"] = -1.0
    with pytest.raises(ValueError, match="row 77"):
        compute_features(neg)
    fs = FeatureSet(families=["shape"])
    t = torch.arange(10, dtype=torch.int64)
    with pytest.raises(ValueError, match="timestamps must increase"):
        fs.compute(torch.ones(10, 5, dtype=torch.float64), t.flip(0), torch.zeros(10, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"must be \[T, 5\]"):
        fs.compute(torch.ones(10, 4, dtype=torch.float64), t, torch.zeros(10, dtype=torch.int64))


# ---------------------------------------------------------------- causality


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_no_lookahead_perturbing_the_future(bars, feats, seed):
    """Change every bar of one symbol after a random t: no feature of that symbol at bars <= t, and no feature
    of the other symbol, moves at all (exact equality, float64)."""
    rng = np.random.default_rng(seed)
    sym = ("AAA", "BBB")[seed % 2]
    idx = bars.index[bars.symbol == sym].to_numpy()
    t = int(rng.integers(0, len(idx) - 1))
    after = idx[t + 1 :]
    g = compute_features(perturb_after(bars, after, rng), dtype=np.float64)
    keep = np.ones(len(bars), dtype=bool)
    keep[after] = False
    a, b = feats.to_numpy()[keep], g.to_numpy()[keep]
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    moved = [ALL[j] for j in np.flatnonzero(~same.all(axis=0))]
    assert not moved, f"features at bars <= {t} changed when later bars changed: {moved}"
    assert not np.array_equal(feats.to_numpy()[after[-1]], g.to_numpy()[after[-1]], equal_nan=True), "perturbation had no effect"


@pytest.mark.parametrize("cut", [1, 63, 400, 1001])
def test_no_lookahead_truncating_the_future(bars, feats, cut):
    """Features of bars[:cut] (of every symbol) are exactly those computed with the whole history present."""
    head = bars.groupby("symbol", sort=False).head(cut)
    g = compute_features(head.reset_index(drop=True), dtype=np.float64)
    np.testing.assert_array_equal(g.to_numpy(), feats.loc[head.index].to_numpy())


def test_no_lookahead_on_the_synthetic_market():
    pytest.importorskip("foxhunt.data.synthetic")
    from foxhunt.data.synthetic import generate_market

    bars = generate_market(n_bars=2500, n_symbols=1, seed=7, signal_strength=0.1).bars
    full = compute_features(bars, dtype=np.float64).to_numpy()
    rng = np.random.default_rng(7)
    for t in rng.integers(0, len(bars) - 1, 3):
        g = compute_features(perturb_after(bars, bars.index[t + 1 :], rng), dtype=np.float64).to_numpy()
        np.testing.assert_array_equal(g[: t + 1], full[: t + 1])


def test_ready_mask_and_warmups_on_several_symbols():
    """Every feature is NaN inside its warm-up and finite after it, per symbol; ready is past the longest warm-up."""
    bars = make_bars(1200, ("AAA", "BBB", "CCC"))
    fs = FeatureSet()
    out = fs.compute(*tensors(bars))
    assert out.values.dtype == torch.float32 and out.values.shape == (len(bars), len(ALL))
    pos = bars.groupby("symbol", sort=False).cumcount().to_numpy()
    np.testing.assert_array_equal(out.ready.numpy(), pos >= fs.max_warmup)
    v = out.values.numpy()
    for j, name in enumerate(ALL):
        w = REGISTRY[name].warmup
        assert np.isnan(v[pos < w, j]).all() and np.isfinite(v[pos >= w, j]).all(), name


@pytest.mark.parametrize("symbols", [("AAA",), ("AAA", "BBB", "CCC")])
def test_compute_into_out_overwrites_every_value(symbols):
    """out= (an earlier result's values, filled with junk) gets exactly the fresh result, NaN warm-ups included."""
    args = tensors(make_bars(600, symbols))
    fs = FeatureSet()
    fresh = fs.compute(*args)
    buf = torch.full((len(fs.names), len(args[0])), 12345.0).T  # the layout of values: [N, F], feature-major
    again = fs.compute(*args, out=buf)
    assert again.values.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(again.values, fresh.values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(again.ready, fresh.ready)
    for bad in (buf.contiguous(), buf.double(), buf[:-1]):
        with pytest.raises(ValueError, match="out must be a float32"):
            fs.compute(*args, out=bad)


def test_selection_short_series_and_empty_input(bars):
    fs = FeatureSet(names=["bb_pctb_50", "adosc_3_10", "tod_sin"], families=["shape"])
    head = bars.groupby("symbol", sort=False).head(30).reset_index(drop=True)  # shorter than some warm-ups
    full, short = fs.compute(*tensors(bars)), fs.compute(*tensors(head))
    assert short.names == fs.names and not short.ready.any()
    np.testing.assert_array_equal(short.values.numpy(), full.values.numpy()[head_rows(bars, 30)])
    empty = fs.compute(*(t[:0] for t in tensors(bars)))
    assert empty.values.shape == (0, len(fs.names)) and empty.ready.shape == (0,)


def head_rows(bars: pd.DataFrame, m: int) -> np.ndarray:
    """Row numbers of the first m bars of each symbol."""
    return np.flatnonzero(bars.groupby("symbol", sort=False).cumcount().to_numpy() < m)


def tensors(bars: pd.DataFrame, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ohlcv [N, 5] float64, timestamps [N] int64 ns and symbol_index [N] of a bar frame, on ``device``."""
    ohlcv = torch.tensor(bars[["open", "high", "low", "close", "volume"]].to_numpy(), dtype=torch.float64)
    ts = torch.from_numpy(bars["timestamp"].to_numpy(dtype="datetime64[ns]").astype(np.int64))
    sym = torch.from_numpy(pd.factorize(bars["symbol"])[0].astype(np.int64))
    return ohlcv.to(device), ts.to(device), sym.to(device)


def test_intermediates_are_released():
    """With the release plan the whole registry leaves no memoised intermediate behind, each released once."""
    from foxhunt.features import compute as C
    from foxhunt.features.panel import Panel

    names = tuple(ALL)
    plan = C._release_plan(names)
    keys = [repr(k) for ks in plan for k in ks]
    assert len(keys) == len(set(keys)), "a key released twice"
    panel = Panel.from_flat(*tensors(make_bars(400, ("AAA", "BBB"))))
    most = 0
    with torch.no_grad():
        for j, name in enumerate(names):
            REGISTRY[name].fn(panel)
            most = max(most, len(panel._memo))
            panel.forget(plan[j])
    assert not panel._memo, f"left over: {list(panel._memo)}"
    assert 0 < most < 25, f"{most} intermediates held at once"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_few_host_synchronisations_on_cuda(bars):
    import warnings

    fs = FeatureSet()
    args = tensors(bars, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # every host synchronisation raises a warning
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fs.compute(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    print(f"\nhost synchronisations for {len(ALL)} features on CUDA: {len(syncs)}")
    assert len(syncs) < len(ALL) // 4, f"{len(syncs)} host synchronisations: not O(1) per run"
