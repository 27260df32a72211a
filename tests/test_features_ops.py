"""The primitives of foxhunt.features.ops: the reference torch path (what runs on CUDA) against the CPU kernels
(what runs on the CPU) and against brute force; the Panel; and the whole registry on both paths (values, causality)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from test_features import make_bars, perturb_after

from foxhunt.features import REGISTRY, ops
from foxhunt.features import cpu_kernels as F
from foxhunt.features.compute import _compute
from foxhunt.features.panel import Panel

TOL = 1e-9


@pytest.fixture
def reference(monkeypatch):
    """Route every primitive through its reference torch path, as on CUDA, while the tensors stay on the CPU."""
    monkeypatch.setattr(ops, "fast_path", lambda x: False)

def close(got: torch.Tensor, want: np.ndarray, tol: float = TOL) -> None:
    """Same shape and NaN positions, and max |got - want| <= tol (1 + max |want|) over the finite values."""
    g = got.detach().cpu().numpy()
    assert g.shape == want.shape
    gn, wn = np.isnan(g), np.isnan(want)
    assert (gn == wn).all(), f"NaN positions differ at {np.argwhere(gn != wn)[:5].tolist()}"
    fin = ~wn
    if fin.any():
        scale = 1.0 + np.abs(want[fin & np.isfinite(want)]).max(initial=0.0)
        gi, wi = np.isinf(g[fin]), np.isinf(want[fin])
        assert (gi == wi).all() and (g[fin][wi] == want[fin][wi]).all()
        err = np.abs(g[fin][~wi] - want[fin][~wi]).max(initial=0.0)
        assert err <= tol * scale, f"max error {err:.3g} > {tol:.1g} * {scale:.3g}"


def padded(rng: np.random.Generator, T: int = 300, lengths: tuple[int, ...] = (300, 251, 190), level: float = 0.0) -> np.ndarray:
    """Random [S, T] rows (a random walk around ``level``), NaN after each row's length."""
    x = level + np.cumsum(rng.standard_normal((len(lengths), T)), axis=1)
    for s, m in enumerate(lengths):
        x[s, m:] = np.nan
    return x


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.float64))


WINDOWS = (1, 2, 3, 4, 5, 14, 33, 299, 300, 301, 500)


# ---------------------------------------------------------------- ops


def test_shift_diff_pct(rng, reference):
    x = padded(rng, level=50.0)
    for k in (1, 3, 299, 300, 400):
        lagged = np.full_like(x, np.nan)
        lagged[:, k:] = x[:, :-k] if k < x.shape[1] else x[:, :0]
        close(ops.shift(t(x), k), lagged)
        close(ops.shift(t(x), k, 0.0), np.where(np.arange(x.shape[1]) < k, 0.0, lagged))
        close(ops.diff(t(x), k), x - lagged)
        close(ops.pct_change(t(x), k), F.pct_change(x, k))
    with pytest.raises(ValueError):
        ops.shift(t(x), 0)


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_last_steps_round_once(rng, path, monkeypatch):
    """(a - b) c, its lagged form and the guarded division, on both paths: the float64 expression exactly, and
    into a float32 output that expression rounded once."""
    if path == "reference":
        monkeypatch.setattr(ops, "fast_path", lambda x: False)
    x, c = padded(rng, level=50.0), rng.uniform(0.5, 2, (3, 300))
    for k in (1, 3, 299, 300, 400):
        lagged = np.full_like(x, np.nan)
        lagged[:, k:] = x[:, :-k] if k < x.shape[1] else x[:, :0]
        close(ops.lag_diff_times(t(x), k, t(c)), (x - lagged) * c, tol=0.0)
    y = rng.standard_normal((3, 300))
    close(ops.diff_times(t(x), t(y), t(c)), (x - y) * c, tol=0.0)
    f32 = torch.empty(3, 300, dtype=torch.float32)
    ops.diff_times(t(x), t(y), t(c), out=f32)
    np.testing.assert_array_equal(f32.numpy(), ((x - y) * c).astype(np.float32))
    num, den = rng.standard_normal((3, 200)), rng.integers(-2, 3, (3, 200)).astype(float)
    den[0, :5] = np.nan
    for fill, scale in ((0.0, 1.0), (0.5, 100.0), (1.0, -100.0)):
        with np.errstate(divide="ignore", invalid="ignore"):
            want = np.where(den == 0, fill, scale * num / den)
        close(ops.safe_div(t(num), t(den), fill, scale), want, tol=0.0)
        f32 = torch.empty(3, 200, dtype=torch.float32)
        ops.safe_div(t(num), t(den), fill, scale, out=f32)
        np.testing.assert_array_equal(f32.numpy(), want.astype(np.float32))
        inplace = t(num.copy())
        ops.safe_div(inplace, t(den), fill, scale, out=inplace)  # out may be num
        close(inplace, want, tol=0.0)


def test_blocked_cumsum(rng, reference):
    """The two-level scan CUDA uses for several long rows: running sums within rounding of the sequential ones."""
    x = padded(rng, T=1000, lengths=(1000, 999, 300), level=100.0)
    for block in (1, 7, 64, 1000, 4096):
        close(ops.blocked_cumsum(t(x), block), np.cumsum(x, axis=1), tol=1e-14)
    y = t(x)
    y[:, 500:] += 1.0  # later bars never change an earlier running sum
    assert np.array_equal(ops.blocked_cumsum(y, 64)[:, :500].numpy(), ops.blocked_cumsum(t(x), 64)[:, :500].numpy(), equal_nan=True)


@pytest.mark.parametrize("start", [0, 1, 7])
def test_rolling_sums_means(rng, start, reference):
    x = padded(rng)
    for n in WINDOWS:
        direct = np.full(x.shape, np.nan)  # sums of the window, NaN before start + n - 1
        if start + n - 1 < x.shape[1]:
            direct[:, start + n - 1 :] = np.lib.stride_tricks.sliding_window_view(x[:, start:], n, axis=1).sum(axis=2)
        close(ops.rolling_sum(t(x), n, start), direct)
        close(ops.rolling_mean(t(x), n, start), direct / n)
        var = np.full(x.shape, np.nan)
        if start + n - 1 < x.shape[1]:
            var[:, start + n - 1 :] = np.lib.stride_tricks.sliding_window_view(x[:, start:], n, axis=1).var(axis=2)
        pre = ops.Prefix(t(x), start, squares=True)
        close(pre.sum(n), direct)
        mean, v = pre.mean_var(n)
        close(mean, direct / n)
        close(v, var, tol=1e-7)  # prefix sums of squares of a random walk: error relative to their running total
        close(pre.std(n), np.sqrt(v.numpy()))


@pytest.mark.parametrize("start", [0, 3])
def test_block_prefix_and_rolling_variance(rng, start, reference):
    x = padded(rng, T=1500, lengths=(1500, 1400, 700), level=1e4)  # price levels: the centred sums matter
    bp, tbp = F.BlockPrefix(x, 200, start, squares=True, block=256), ops.BlockPrefix(t(x), 200, start, squares=True, block=256)
    for n in (1, 2, 5, 20, 199, 200):
        close(tbp.sum(n), bp.sum(n))
        close(tbp.mean(n), bp.mean(n))
        for got, want in zip(tbp.mean_std(n, 2.0), bp.mean_std(n, 2.0)):
            close(got, want)
        for got, want in zip(tbp.mean_var(n), bp.mean_var(n)):
            close(got, want)
        # against a direct two-pass variance: float64 error stays relative to the local spread, not the 1e4 level
        # (a std near 0 takes the square root of a rounding error, so compare variances)
        win = np.lib.stride_tricks.sliding_window_view(x, n, axis=1)
        direct = np.full(x.shape, np.nan)
        direct[:, n - 1 :] = win.var(axis=2)
        direct[:, : start + n - 1] = np.nan
        same = F.BlockPrefix(x, n, start, squares=True)  # the same blocks: the same rounding, even for a std near 0
        for path in (ops.block_prefix(t(x), n, start, squares=True), ops.HostBlockPrefix(t(x), n, start, squares=True)):
            close(path.mean_var(n)[1], direct)  # uncentred sums would be off by ~1e-5
            for got, want in zip(path.mean_std(n, 2.0), same.mean_std(n, 2.0)):
                close(got, want)
    with pytest.raises(ValueError):
        tbp.mean(201)


def test_rolling_extremes(rng, reference):
    x = padded(rng)
    x[0, 40:60] = 3.0  # ties
    for n in WINDOWS:
        close(ops.rolling_max(t(x), n), F.rolling_max(x, n), tol=0.0)
        close(ops.rolling_min(t(x), n), F.rolling_min(x, n), tol=0.0)
    for n in (1, 2, 3, 7, 14, 25, 100, 127, 299, 300):
        for highest in (True, False):
            got = ops.bars_since_extreme(t(x), n, highest)
            if n < 128:
                want = F.bars_since_extreme(x, n, highest)
            else:  # the CPU kernel refuses windows over 128 bars; the loop leaves windows with padding undefined
                want = _bars_since_loop(x, n, highest)
                got[torch.from_numpy(np.isnan(want))] = np.nan
            close(got, want, tol=0.0)
            if n < 128:  # the Aroon line, written by the kernel's last pass: as the reference rounds it
                close(ops.aroon_line(t(x), n, highest), F.bars_since_extreme(x, n, highest, aroon=True), tol=0.0)


def _bars_since_loop(x: np.ndarray, n: int, highest: bool) -> np.ndarray:
    """Bars since the extreme of x[t-n..t], ties to the latest (a plain loop, for windows the CPU kernel refuses)."""
    S, T = x.shape
    out = np.full((S, T), np.nan)
    for s in range(S):
        for i in range(n, T):
            w = x[s, i - n : i + 1]
            if np.isnan(w).any():
                continue
            e = w.max() if highest else w.min()
            out[s, i] = n - np.flatnonzero(w == e)[-1]
    return out


def test_first_order_ema_wilder(rng, monkeypatch):
    """The scans on both paths, and the EMA against TA-Lib's definition written as a loop."""
    x = padded(rng, T=5000, lengths=(5000, 4321, 3000), level=100.0)
    y0 = rng.standard_normal(3)

    def both(fn, *args, **kw):
        fast = fn(*args, **kw)
        with monkeypatch.context() as m:
            m.setattr(ops, "fast_path", lambda x: False)
            return fn(*args, **kw), fast.numpy()

    for a in (0.0, 0.005, 0.01, 0.3, 2.0 / 3.0, 0.9, 0.99, 0.999, 1.0):
        close(*both(ops.first_order, t(x), a, 1.0 - a if a < 1 else 0.5, t(y0)))
    for n in (1, 2, 5, 14, 200, 4999, 5000, 6000):
        for start in (0, 1, 30):
            close(*both(ops.ema, t(x), n, start))
            close(*both(ops.ema, t(x), n, start, seed="first"))
            close(*both(ops.wilder, t(x), n, start))
            close(*both(ops.wilder_sum, t(x), n, start))
    close(*both(ops.ema, t(x), 10, alpha=0.3))
    loop = np.full(x.shape[1], np.nan)  # TA-Lib's EMA(14) of row 0: SMA seed, then the recursion
    loop[13] = x[0, :14].mean()
    for i in range(14, x.shape[1]):
        loop[i] = loop[i - 1] + 2.0 / 15.0 * (x[0, i] - loop[i - 1])
    close(ops.ema(t(x), 14)[:1], loop[None], tol=1e-12)
    with pytest.raises(ValueError):
        ops.ema(t(x), 5, seed="nope")


def loop_recurrence(a: np.ndarray, b: np.ndarray, y0: np.ndarray) -> np.ndarray:
    """y[t] = a[t] y[t-1] + b[t] from y[-1] = y0, row by row, bar by bar (brute force)."""
    y = np.empty_like(b)
    for s in range(b.shape[0]):
        v = y0[s]
        for i in range(b.shape[1]):
            v = a[s, i] * v + b[s, i]
            y[s, i] = v
    return y


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_linear_recurrence(rng, path, monkeypatch):
    if path == "reference":
        monkeypatch.setattr(ops, "fast_path", lambda x: False)
    S, T = 3, 4000
    for a_min in (1e-3, 0.5, 5.0 / 9.0, 0.9, 1.0):
        a = rng.uniform(a_min, 1.0, (S, T))
        b = rng.standard_normal((S, T)) * 100
        b[2, 3500:] = np.nan
        y0 = rng.standard_normal(S)
        want = loop_recurrence(a, b, y0)
        close(ops.linear_recurrence(t(a), t(b), t(y0), a_min), want)
        bt = t(b.copy())
        close(ops.linear_recurrence(t(a), bt, t(y0), a_min, overwrite=True), want)
    with pytest.raises(ValueError):
        ops.linear_recurrence(t(a), t(b), t(y0), 0.0)


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_scans_short_and_empty(rng, path, monkeypatch):
    if path == "reference":
        monkeypatch.setattr(ops, "fast_path", lambda x: False)
    for T in (0, 1, 2, 17):
        x = rng.standard_normal((2, T))
        y0 = rng.standard_normal(2)
        close(ops.first_order(t(x), 0.9, 0.1, t(y0)), loop_recurrence(np.full_like(x, 0.9), 0.1 * x, y0))
        a = rng.uniform(0.5, 1, (2, T))
        close(ops.linear_recurrence(t(a), t(x), t(y0), 0.5), loop_recurrence(a, x, y0))


# ---------------------------------------------------------------- panel


def test_panel_from_flat(rng):
    lengths = (50, 30, 41)
    sym = np.repeat(np.arange(3), lengths)
    N = len(sym)
    ohlcv = rng.uniform(1, 2, (N, 5))
    ts = np.arange(N, dtype=np.int64) * 60
    p = Panel.from_flat(torch.from_numpy(ohlcv), torch.from_numpy(ts), torch.from_numpy(sym))
    assert p.shape == (3, 50) and p.lengths == list(lengths) and p.device == torch.device("cpu")
    assert p.starts.tolist() == [0, 50, 80]
    for s, (a, m) in enumerate(zip((0, 50, 80), lengths)):  # each symbol's bars in its row, NaN after them
        np.testing.assert_array_equal(p.ohlcv[:, s, :m].numpy(), ohlcv[a : a + m].T)
        np.testing.assert_array_equal(p.timestamps[s, :m].numpy(), ts[a : a + m])
        assert torch.isnan(p.ohlcv[:, s, m:]).all()
    one = Panel.from_flat(torch.from_numpy(ohlcv[:50]), torch.from_numpy(ts[:50]), torch.zeros(50, dtype=torch.int64))
    assert one.shape == (1, 50) and one.ohlcv.data_ptr() == one.close.data_ptr() - 3 * 50 * 8  # a view of the columns
    with pytest.raises(ValueError):
        Panel.from_flat(torch.from_numpy(ohlcv), torch.from_numpy(ts), torch.from_numpy(sym[::-1].copy()))
    empty = Panel.from_flat(torch.zeros((0, 5)), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert empty.shape == (0, 0)


# ---------------------------------------------------------------- the whole registry on both paths

ALL = list(REGISTRY)


def tensors(bars: pd.DataFrame, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ohlcv [N, 5] float64, timestamps [N] int64 ns and symbol_index [N] of a bar frame, on ``device``."""
    ohlcv = torch.tensor(bars[["open", "high", "low", "close", "volume"]].to_numpy(), dtype=torch.float64)
    ts = torch.from_numpy(bars["timestamp"].to_numpy(dtype="datetime64[ns]").astype(np.int64))
    sym = torch.from_numpy(pd.factorize(bars["symbol"])[0].astype(np.int64))
    return ohlcv.to(device), ts.to(device), sym.to(device)


def every_feature(bars: pd.DataFrame, device: str = "cpu") -> np.ndarray:
    """The whole registry as float64 [F, N] (NaN in warm-ups), computed from tensors on ``device``."""
    with torch.no_grad():
        values, _ = _compute(list(REGISTRY.values()), *tensors(bars, device), dtype=torch.float64)
    return values.cpu().numpy()


def assert_same_features(got: np.ndarray, want: np.ndarray) -> None:
    """The same NaN positions, and per feature max |got - want| <= TOL (1 + max |want|)."""
    nan_diff = [ALL[j] for j in np.flatnonzero((np.isnan(got) != np.isnan(want)).any(axis=1))]
    assert not nan_diff, f"NaN positions differ in {nan_diff}"
    scale = 1.0 + np.nanmax(np.abs(want), axis=1, initial=0.0)
    err = np.nanmax(np.abs(got - want), axis=1, initial=0.0) / scale
    worst = ", ".join(f"{ALL[j]} {err[j]:.1e}" for j in np.argsort(-err)[:5])
    assert (err <= TOL).all(), f"the two paths differ beyond {TOL}: {worst}"


@pytest.fixture(scope="module")
def bars3() -> pd.DataFrame:
    return make_bars(3000, ("AAA", "BBB", "CCC"), seed=11)


@pytest.fixture(scope="module")
def fast(bars3) -> np.ndarray:
    return every_feature(bars3)


def test_reference_path_matches_fast_path(bars3, fast, reference):
    assert_same_features(every_feature(bars3), fast)


def test_reference_path_one_symbol_and_short_symbols(bars3, monkeypatch):
    """One symbol, and symbols shorter than the warm-ups: the same values and NaNs on both paths, no error."""
    short = [make_bars(100, (f"S{k}",), seed=k).iloc[:m] for k, m in enumerate((1, 2, 15, 30, 4, 60))]
    for bars in (bars3[bars3.symbol == "BBB"].reset_index(drop=True), pd.concat(short, ignore_index=True)):
        want = every_feature(bars)
        with monkeypatch.context() as m:
            m.setattr(ops, "fast_path", lambda x: False)
            assert_same_features(every_feature(bars), want)


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_last_step_into_the_output_rounds_once(bars3, path, monkeypatch):
    """One symbol: features that write their last step into the float32 output give exactly the float64 values
    rounded once, as those that return their own float64 tensor do."""
    if path == "reference":
        monkeypatch.setattr(ops, "fast_path", lambda x: False)
    one = tensors(bars3[bars3.symbol == "CCC"].reset_index(drop=True))
    assert sum(f.writes_out for f in REGISTRY.values()) > len(REGISTRY) // 2
    with torch.no_grad():
        f32, _ = _compute(list(REGISTRY.values()), *one, dtype=torch.float32)
        panel = Panel.from_flat(*one)
        rounded = torch.stack([f.fn(panel)[0] for f in REGISTRY.values()]).to(torch.float32)  # no ``out`` given
    for j, f in enumerate(REGISTRY.values()):
        rounded[j, : f.warmup] = np.nan
    same = (f32 == rounded) | (torch.isnan(f32) & torch.isnan(rounded))
    assert same.all(), f"differ: {[ALL[j] for j in torch.nonzero(~same.all(dim=1)).flatten().tolist()]}"


def test_reference_path_with_blocked_running_sums(bars3, fast, reference, monkeypatch):
    """The CUDA choice of two-level running sums for several long rows, forced on CPU, keeps the values."""
    plain = ops.cumsum
    monkeypatch.setattr(ops, "cumsum", lambda x, block=256, out=None: ops._put(ops.blocked_cumsum(x, block), out)
                        if x.shape[-1] > block else plain(x, out=out))
    assert_same_features(every_feature(bars3), fast)


def test_reference_path_is_causal(bars3, reference):
    """New prices at every bar after a random t (per symbol) leave every feature at bars <= t bit-identical."""
    base = every_feature(bars3)
    rng = np.random.default_rng(5)
    lengths = bars3.groupby("symbol", sort=False).size().to_numpy()
    cut = np.array([int(rng.integers(50, m - 1)) for m in lengths])
    pos = bars3.groupby("symbol", sort=False).cumcount().to_numpy()
    sym = pd.factorize(bars3["symbol"])[0]
    after = np.flatnonzero(pos > cut[sym])
    moved = every_feature(perturb_after(bars3, after, rng))
    keep = pos <= cut[sym]
    same = (base[:, keep] == moved[:, keep]) | (np.isnan(base[:, keep]) & np.isnan(moved[:, keep]))
    assert same.all(), f"changed at bars <= t: {[ALL[j] for j in np.flatnonzero(~same.all(axis=1))]}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_features_on_cuda(bars3, fast):
    """On the GPU (its scans and reductions round differently): the CPU values, and several long rows."""
    assert_same_features(every_feature(bars3, "cuda"), fast)
    bars = make_bars(6000, ("AAA", "BBB", "CCC"), seed=2)  # rows over 4096 bars: the two-level running sums
    assert_same_features(every_feature(bars, "cuda"), every_feature(bars))
    x = torch.randn(3, 10000, dtype=torch.float64, device="cuda").cumsum(-1)
    close(ops.cumsum(x), np.cumsum(x.cpu().numpy(), axis=1), tol=1e-14)


# ---------------------------------------------------------------- the CPU kernels against brute force

def test_rolling_max_min_match_brute_force():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 257))
    for n in (1, 2, 3, 5, 16, 26, 257):
        ref_max = np.full_like(x, np.nan)
        ref_min = np.full_like(x, np.nan)
        for t in range(n - 1, x.shape[1]):
            ref_max[:, t] = x[:, t - n + 1 : t + 1].max(axis=1)
            ref_min[:, t] = x[:, t - n + 1 : t + 1].min(axis=1)
        np.testing.assert_array_equal(F.rolling_max(x, n), ref_max)
        np.testing.assert_array_equal(F.rolling_min(x, n), ref_min)


def test_bars_since_extreme_matches_brute_force():
    rng = np.random.default_rng(2)
    x = np.round(rng.standard_normal((2, 300)), 1)  # coarse values: many ties, which go to the latest bar
    for n in (1, 2, 4, 7, 25):
        for highest in (True, False):
            ref = np.full_like(x, np.nan)
            for t in range(n, x.shape[1]):
                w = x[:, t - n : t + 1][:, ::-1]
                ref[:, t] = np.argmax(w, axis=1) if highest else np.argmin(w, axis=1)
            np.testing.assert_array_equal(F.bars_since_extreme(x, n, highest), ref)


def test_block_prefix_matches_direct_sums():
    rng = np.random.default_rng(3)
    x = 1000.0 + np.cumsum(rng.standard_normal((2, 5000)), axis=1)
    bp = F.BlockPrefix(x, 200, start=3, squares=True)
    for n in (1, 7, 200):
        m, v = bp.mean_var(n)
        ref_m = np.full_like(x, np.nan)
        ref_v = np.full_like(x, np.nan)
        for t in range(3 + n - 1, x.shape[1]):
            ref_m[:, t] = x[:, t - n + 1 : t + 1].mean(axis=1)
            ref_v[:, t] = x[:, t - n + 1 : t + 1].var(axis=1)
        np.testing.assert_allclose(m, ref_m, rtol=1e-12)
        np.testing.assert_allclose(v, ref_v, rtol=1e-7, atol=1e-7)
        np.testing.assert_allclose(bp.sum(n), n * ref_m, rtol=1e-12)


@pytest.mark.parametrize("start", [0, 3])
def test_block_prefix_finite_moments(start):
    """finite=True (preprocessing's rolling moments): NaN/inf counted out, partial and empty windows finite, causal
    to the bit, and differentiable."""
    rng = np.random.default_rng(4)
    x = 1000.0 + np.cumsum(rng.standard_normal((2, 700)), axis=1)
    x[rng.random(x.shape) < 0.05] = np.nan
    x[0, 10:40] = np.nan  # a window with no finite value
    x[1, 50] = np.inf
    for n, block in ((1, 512), (9, 9), (60, 64)):
        count, mean, m2 = ops.BlockPrefix(t(x), n, start, squares=True, block=block, finite=True).moments(n)
        assert torch.isfinite(count).all() and torch.isfinite(mean).all() and torch.isfinite(m2).all()
        for s in range(2):
            for j in range(x.shape[1]):
                w = x[s, max(start, j - n + 1) : j + 1]
                w = w[np.isfinite(w)]
                assert count[s, j] == w.size
                if w.size:
                    np.testing.assert_allclose(mean[s, j].item(), w.mean(), rtol=1e-12)
                    np.testing.assert_allclose(m2[s, j].item(), ((w - w.mean()) ** 2).sum(), rtol=1e-6, atol=1e-7)
    base = ops.BlockPrefix(t(x), 60, start, squares=True, block=64, finite=True).moments(60)
    y = x.copy()
    y[:, 300:] = 7e5 * rng.standard_normal((2, 400))
    moved = ops.BlockPrefix(t(y), 60, start, squares=True, block=64, finite=True).moments(60)
    for a, b in zip(base, moved):
        assert torch.equal(a[:, :300], b[:, :300])
    xg = t(x).requires_grad_(True)
    count, mean, m2 = ops.BlockPrefix(xg, 9, start, squares=True, block=9, finite=True).moments(9)
    (mean.sum() + m2.sum()).backward()
    assert torch.isfinite(xg.grad).all() and (xg.grad[~torch.isfinite(t(x))] == 0).all()


def test_buffer_pool_lends_only_free_buffers():
    """A pooled buffer is lent again only once no array or tensor built on it is alive; trim keeps a few idle."""
    from foxhunt.features import cpu_kernels as K

    with K.recycling() as pool:
        a = K.empty((2, 300_000))
        t = torch.from_numpy(K.empty((2, 299_000)))
        view = t[:, 5:].numpy()  # a numpy view of a tensor view keeps the buffer lent
        assert len(pool._bufs) == 2 and a.ctypes.data % K.BufferPool.GRANULE == 0
        del a
        b = K.empty((2, 300_001))  # a's buffer, same size class
        del t
        c = K.empty((2, 300_000))  # view still holds t's buffer: a new one
        assert len(pool._bufs) == 3
        c[:] = 1.0
        assert not np.shares_memory(b, c) and not np.shares_memory(c, view)
        del b, c, view
        pool.trim(keep=1)
        assert len(pool._bufs) == 1
        assert K.empty((10,)).base is None  # small arrays are not pooled
    assert K._POOL.get() is None
