"""The torch (device) backend of FeatureSet.compute against the numpy backend: values, warm-ups, ready mask,
causality, input errors, backend choice, and CUDA when there is one."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from test_features import make_bars, perturb_after

from foxhunt.features import REGISTRY, FeatureSet
from foxhunt.features import compute as C

ALL = list(REGISTRY)
RTOL = 1e-6  # |torch - numpy| <= RTOL (|numpy| + 1e-3 max|numpy| of the feature), in the float32 output


def tensors(bars: pd.DataFrame, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ohlcv [N, 5] float64, timestamps [N] int64 ns and symbol_index [N] of a bar frame, on ``device``."""
    ohlcv = torch.tensor(bars[["open", "high", "low", "close", "volume"]].to_numpy(), dtype=torch.float64)
    ts = torch.from_numpy(bars["timestamp"].to_numpy(dtype="datetime64[ns]").astype(np.int64))
    sym = torch.from_numpy(pd.factorize(bars["symbol"])[0].astype(np.int64))
    return ohlcv.to(device), ts.to(device), sym.to(device)


def relative_errors(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per feature, max |ours - ref| / (|ref| + 1e-3 max|ref|) over the rows where ref is defined."""
    scale = np.nanmax(np.abs(ref), axis=0, initial=0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(ours.astype(np.float64) - ref) / (np.abs(ref) + 1e-3 * scale + 1e-30)
    return np.nanmax(np.where(np.isnan(ref), 0.0, err), axis=0, initial=0.0)


def assert_matches(got, want, names: list[str]) -> None:
    """Identical NaN positions and ready mask; values within RTOL; the message names the worst features."""
    a, b = got.values.cpu().numpy(), want.values.cpu().numpy()
    assert a.shape == b.shape and got.names == want.names == names
    nan_diff = [names[j] for j in np.flatnonzero((np.isnan(a) != np.isnan(b)).any(axis=0))]
    assert not nan_diff, f"NaN positions differ in {nan_diff}"
    assert torch.equal(got.ready.cpu(), want.ready.cpu())
    err = relative_errors(a, b)
    worst = ", ".join(f"{names[j]} {err[j]:.1e}" for j in np.argsort(-err)[:5])
    print(f"\nworst torch vs numpy: {worst}")
    assert (err <= RTOL).all(), f"torch differs from numpy beyond {RTOL}: {worst}"


@pytest.fixture(scope="module")
def bars() -> pd.DataFrame:
    return make_bars(1200, ("AAA", "BBB", "CCC"))  # three symbols of different lengths


@pytest.fixture(scope="module")
def reference(bars):
    return FeatureSet().compute(*tensors(bars), backend="numpy")


@pytest.fixture(scope="module")
def ours(bars):
    return FeatureSet().compute(*tensors(bars), backend="torch")


def test_every_feature_has_a_device_function():
    from foxhunt.features.device import DEVICE_FUNCTIONS

    assert list(DEVICE_FUNCTIONS) == ALL


def test_torch_matches_numpy_on_several_symbols(ours, reference):
    assert ours.values.dtype == torch.float32 and ours.values.shape == reference.values.shape
    assert_matches(ours, reference, ALL)


def test_torch_matches_numpy_on_one_symbol(bars):
    one = bars[bars.symbol == "BBB"].reset_index(drop=True)
    fs = FeatureSet()
    assert_matches(fs.compute(*tensors(one), backend="torch"), fs.compute(*tensors(one), backend="numpy"), ALL)


def test_ready_mask_and_warmups(bars, ours, reference):
    fs = FeatureSet()
    pos = bars.groupby("symbol", sort=False).cumcount().to_numpy()
    np.testing.assert_array_equal(ours.ready.numpy(), pos >= fs.max_warmup)
    assert torch.equal(ours.ready, reference.ready)
    v = ours.values.numpy()
    for j, name in enumerate(ALL):
        w = REGISTRY[name].warmup
        assert np.isnan(v[pos < w, j]).all() and np.isfinite(v[pos >= w, j]).all(), name


def test_selection_and_short_series(bars):
    fs = FeatureSet(names=["bb_pctb_50", "adosc_3_10", "tod_sin"], families=["shape"])
    head = bars.groupby("symbol", sort=False).head(30).reset_index(drop=True)  # shorter than some warm-ups
    for frame in (bars, head):
        assert_matches(fs.compute(*tensors(frame), backend="torch"), fs.compute(*tensors(frame), backend="numpy"), fs.names)
    empty = fs.compute(*(t[:0] for t in tensors(bars)), backend="torch")
    assert empty.values.shape == (0, len(fs.names)) and empty.ready.shape == (0,)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_lookahead_perturbing_the_future(bars, ours, seed):
    """Change every bar of one symbol after a random t: no torch-path feature of that symbol at bars <= t, nor of
    the other symbols, moves at all."""
    rng = np.random.default_rng(seed)
    sym = ("AAA", "BBB", "CCC")[seed % 3]
    idx = bars.index[bars.symbol == sym].to_numpy()
    t = int(rng.integers(0, len(idx) - 1))
    after = idx[t + 1 :]
    g = FeatureSet().compute(*tensors(perturb_after(bars, after, rng)), backend="torch").values.numpy()
    keep = np.ones(len(bars), dtype=bool)
    keep[after] = False
    a, b = ours.values.numpy()[keep], g[keep]
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    moved = [ALL[j] for j in np.flatnonzero(~same.all(axis=0))]
    assert not moved, f"features at bars <= {t} changed when later bars changed: {moved}"
    assert not np.array_equal(ours.values.numpy()[after[-1]], g[after[-1]], equal_nan=True), "perturbation had no effect"


def _message(fs: FeatureSet, args, backend: str) -> str:
    with pytest.raises(ValueError) as e:
        fs.compute(*args, backend=backend)
    return str(e.value)


def test_bad_input_is_named_as_numpy_names_it():
    fs = FeatureSet(families=["shape"])
    cases = []
    b = make_bars(300, ("AAA",))
    b.loc[120, "close"] = np.nan
    cases.append((b, "row 120"))
    neg = make_bars(300, ("AAA",))
    neg.loc[77, "low"] = -1.0
    cases.append((neg, "row 77"))
    two = make_bars(300)
    cases.append((pd.concat([two.iloc[:10], two[two.symbol == "BBB"], two[two.symbol == "AAA"].iloc[10:]], ignore_index=True),
                  "grouped by symbol"))
    back = make_bars(300, ("AAA",))
    back.loc[50, "timestamp"] = back.loc[10, "timestamp"]
    cases.append((back, "row 50 is not after row 49"))
    for frame, expected in cases:
        args = tensors(frame)
        if expected == "grouped by symbol":  # factorize would renumber the symbols in order of appearance
            args = (*args[:2], torch.from_numpy(np.where(frame.symbol == "AAA", 0, 1)))
        msg = _message(fs, args, "torch")
        assert expected in msg and msg == _message(fs, args, "numpy")
    t = torch.arange(10, dtype=torch.int64)
    with pytest.raises(ValueError, match="timestamps must increase"):
        fs.compute(torch.ones(10, 5, dtype=torch.float64), t.flip(0), torch.zeros(10, dtype=torch.int64), backend="torch")
    with pytest.raises(ValueError, match=r"must be \[T, 5\]"):
        fs.compute(torch.ones(10, 4, dtype=torch.float64), t, torch.zeros(10, dtype=torch.int64), backend="torch")


def test_backend_choice(bars, monkeypatch):
    fs = FeatureSet(families=["shape"])
    args = tensors(bars.iloc[:200])
    with pytest.raises(ValueError, match="unknown backend 'cupy'"):
        fs.compute(*args, backend="cupy")

    def refuse(*a, **k):
        raise AssertionError("auto chose the torch backend for CPU tensors")

    monkeypatch.setattr(C, "_compute_device", refuse)
    out = fs.compute(*args)  # auto on CPU: numpy
    np.testing.assert_array_equal(out.values.numpy(), fs.compute(*args, backend="numpy").values.numpy())


def _held(memo: dict) -> int:
    """Bytes of the arrays and tensors a panel's memo holds (inside tuples and prefix-sum objects too)."""
    def size(o) -> int:
        if isinstance(o, torch.Tensor):
            return o.numel() * o.element_size()
        if isinstance(o, np.ndarray):
            return o.nbytes
        if isinstance(o, (tuple, list)):
            return sum(size(x) for x in o)
        if isinstance(o, dict):
            return sum(size(x) for x in o.values())
        return sum(size(x) for x in vars(o).values()) if hasattr(o, "__dict__") else 0

    return size(memo)


def test_intermediates_are_released():
    """With the release plan the whole registry leaves no memoised intermediate behind, and never holds more at
    once than the numpy path does."""
    from foxhunt.features.device import DEVICE_FUNCTIONS, TorchPanel
    from foxhunt.features.panel import Panel

    names = tuple(ALL)
    plan, numpy_plan = C._device_release_plan(names), C._release_plan(names)
    keys = [repr(k) for ks in plan for k in ks]
    assert len(keys) == len(set(keys)), "a key released twice"
    ohlcv, ts, sym = tensors(make_bars(400, ("AAA", "BBB")))
    panel, ref = TorchPanel.from_flat(ohlcv, ts, sym), Panel.from_flat(ohlcv.numpy(), ts.numpy(), sym.numpy())
    held, ref_held = 0, 0
    with np.errstate(all="ignore"):
        for j, name in enumerate(names):
            DEVICE_FUNCTIONS[name](panel)
            REGISTRY[name].fn(ref)
            held, ref_held = max(held, _held(panel._memo)), max(ref_held, _held(ref._memo))
            panel.forget(plan[j])
            ref.forget(numpy_plan[j])
    assert not panel._memo, f"left over: {list(panel._memo)}"
    assert held <= 1.1 * ref_held, f"torch path held {held} bytes at once, numpy {ref_held}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_on_cuda_matches_numpy_on_cpu(bars, reference):
    fs = FeatureSet()
    got = fs.compute(*tensors(bars, "cuda"))  # auto: torch on CUDA
    assert got.values.is_cuda and got.ready.is_cuda and got.values.dtype == torch.float32
    assert_matches(got, reference, ALL)
    one = bars[bars.symbol == "AAA"].reset_index(drop=True)
    assert_matches(fs.compute(*tensors(one, "cuda"), backend="torch"), fs.compute(*tensors(one), backend="numpy"), ALL)
    args = tensors(bars, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # every host synchronisation raises a warning
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fs.compute(*args, backend="torch")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    print(f"\nhost synchronisations for {len(ALL)} features on CUDA: {len(syncs)}")
    assert len(syncs) < len(ALL) // 4, f"{len(syncs)} host synchronisations: not O(1) per run"
