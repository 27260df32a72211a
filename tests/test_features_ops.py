"""The primitives of foxhunt.features.ops against explicit references (Python loops, numpy, scipy); the Panel; and the
whole registry (short symbols, the last step into the output, the CUDA choice of running sums, causality)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.signal import lfilter
from test_features import make_bars, perturb_after

from foxhunt.features import REGISTRY, ops
from foxhunt.features.compute import _compute
from foxhunt.features.panel import Panel

TOL = 1e-9


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


def test_shift_diff_pct(rng):
    x = padded(rng, level=50.0)
    for k in (1, 3, 299, 300, 400):
        lagged = np.full_like(x, np.nan)
        lagged[:, k:] = x[:, :-k] if k < x.shape[1] else x[:, :0]
        close(ops.shift(t(x), k), lagged)
        close(ops.shift(t(x), k, 0.0), np.where(np.arange(x.shape[1]) < k, 0.0, lagged))
        close(ops.diff(t(x), k), x - lagged)
        close(ops.pct_change(t(x), k), (x / lagged - 1.0) * 100.0)
    with pytest.raises(ValueError):
        ops.shift(t(x), 0)


def test_last_steps_round_once(rng):
    """(a - b) c, its lagged form and the guarded division: the float64 expression exactly, and into a float32 output
    that expression rounded once."""
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


def test_blocked_cumsum(rng):
    """The two-level scan CUDA uses for several long rows: running sums within rounding of the sequential ones."""
    x = padded(rng, T=1000, lengths=(1000, 999, 300), level=100.0)
    for block in (1, 7, 64, 1000, 4096):
        close(ops.blocked_cumsum(t(x), block), np.cumsum(x, axis=1), tol=1e-14)
    y = t(x)
    y[:, 500:] += 1.0  # later bars never change an earlier running sum
    assert np.array_equal(ops.blocked_cumsum(y, 64)[:, :500].numpy(), ops.blocked_cumsum(t(x), 64)[:, :500].numpy(), equal_nan=True)


@pytest.mark.parametrize("start", [0, 1, 7])
def test_rolling_sums_means(rng, start):
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
def test_block_prefix_and_rolling_variance(rng, start):
    x = padded(rng, T=1500, lengths=(1500, 1400, 700), level=1e4)  # price levels: the centred sums matter
    tbp = ops.BlockPrefix(t(x), 200, start, squares=True, block=256)
    for n in (1, 2, 5, 20, 199, 200):
        win = np.lib.stride_tricks.sliding_window_view(x, n, axis=1)
        sums, var = np.full(x.shape, np.nan), np.full(x.shape, np.nan)
        sums[:, n - 1 :], var[:, n - 1 :] = win.sum(axis=2), win.var(axis=2)  # a direct two-pass variance
        sums[:, : start + n - 1] = var[:, : start + n - 1] = np.nan
        close(tbp.sum(n), sums)
        close(tbp.mean(n), sums / n)
        for path in (tbp, ops.BlockPrefix(t(x), n, start, squares=True)):
            mean, v = path.mean_var(n)
            close(mean, sums / n)
            # float64 error stays relative to the local spread, not the 1e4 level (uncentred sums would be off by ~1e-5)
            close(v, var)
            m, half = path.mean_std(n, 2.0)
            close(m, sums / n)
            close(half, (v.sqrt() * 2.0).numpy(), tol=0.0)  # k standard deviations: the root of that variance
            ok = ~(var < 1e-3)  # a std near 0 takes the square root of a rounding error: compare the rest
            close(half[torch.from_numpy(ok)].reshape(1, -1), 2.0 * np.sqrt(var[ok]).reshape(1, -1))
    with pytest.raises(ValueError):
        tbp.mean(201)


def test_rolling_extremes(rng):
    x = padded(rng)
    x[0, 40:60] = 3.0  # ties
    for n in WINDOWS:
        hi, lo = np.full(x.shape, np.nan), np.full(x.shape, np.nan)
        if n <= x.shape[1]:
            win = np.lib.stride_tricks.sliding_window_view(x, n, axis=1)
            hi[:, n - 1 :], lo[:, n - 1 :] = win.max(axis=2), win.min(axis=2)
        close(ops.rolling_max(t(x), n), hi, tol=0.0)
        close(ops.rolling_min(t(x), n), lo, tol=0.0)
    for n in (1, 2, 3, 7, 14, 25, 100, 127, 128, 299, 300):
        for highest in (True, False):
            got = ops.bars_since_extreme(t(x), n, highest)
            assert torch.isnan(got[:, :n]).all()
            want = _bars_since_loop(x, n, highest)
            padding = torch.from_numpy(np.isnan(want))  # windows reaching into the NaN after a row's last bar
            padding[:, :n] = False
            close(got.masked_fill(padding, np.nan), want, tol=0.0)
            aroon = ops.aroon_line(t(x), n, highest).masked_fill(padding, np.nan)
            close(aroon, (n - want) * (100.0 / n), tol=0.0)  # TA-Lib's Aroon line, rounded as it rounds it


def _bars_since_loop(x: np.ndarray, n: int, highest: bool) -> np.ndarray:
    """Bars since the extreme of x[t-n..t], ties to the latest (a plain loop); NaN where the window holds a NaN."""
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


def _first_order_ref(x: np.ndarray, a: float, b: float, y0: np.ndarray) -> np.ndarray:
    """y[t] = a y[t-1] + b x[t] from y[-1] = y0, row by row, as scipy's sequential IIR filter."""
    return np.stack([lfilter([b], [1.0, -a], row, zi=[a * v])[0] for row, v in zip(x, y0)])


def _seeded_ref(x: np.ndarray, s: int, seed: np.ndarray, a: float, b: float) -> np.ndarray:
    """NaN before bar s, ``seed`` at s, then y[t] = a y[t-1] + b x[t] (:func:`_first_order_ref`)."""
    out = np.full(x.shape, np.nan)
    if s < x.shape[1]:
        out[:, s] = seed
        out[:, s + 1 :] = _first_order_ref(x[:, s + 1 :], a, b, seed)
    return out


def _ema_ref(x: np.ndarray, n: int, start: int = 0, alpha: float | None = None, seed: str = "sma") -> np.ndarray:
    """TA-Lib's EMA: seeded with the mean of the first n values from ``start`` (or x[start]), then the recursion."""
    alpha = 2.0 / (n + 1) if alpha is None else alpha
    s = start + n - 1 if seed == "sma" else start
    if s >= x.shape[1]:
        return np.full(x.shape, np.nan)
    y0 = x[:, start : s + 1].mean(axis=1) if seed == "sma" else x[:, s]
    return _seeded_ref(x, s, y0, 1.0 - alpha, alpha)


def _wilder_sum_ref(x: np.ndarray, n: int, start: int = 0) -> np.ndarray:
    """TA-Lib's DM/DI running sum: seeded with the sum of n - 1 values, then y = y - y / n + x."""
    s = start + n - 2
    if n < 2 or s >= x.shape[1]:
        return np.full(x.shape, np.nan)
    return _seeded_ref(x, s, x[:, start : s + 1].sum(axis=1), 1.0 - 1.0 / n, 1.0)


def test_first_order_ema_wilder(rng):
    """The scans against a sequential filter, and the EMA against TA-Lib's definition written as a loop."""
    x = padded(rng, T=5000, lengths=(5000, 4321, 3000), level=100.0)
    y0 = rng.standard_normal(3)
    for a in (0.0, 0.005, 0.01, 0.3, 2.0 / 3.0, 0.9, 0.99, 0.999, 1.0):
        b = 1.0 - a if a < 1 else 0.5
        close(ops.first_order(t(x), a, b, t(y0)), _first_order_ref(x, a, b, y0))
    for n in (1, 2, 5, 14, 200, 4999, 5000, 6000):
        for start in (0, 1, 30):
            close(ops.ema(t(x), n, start), _ema_ref(x, n, start))
            close(ops.ema(t(x), n, start, seed="first"), _ema_ref(x, n, start, seed="first"))
            close(ops.wilder(t(x), n, start), _ema_ref(x, n, start, alpha=1.0 / n))
            close(ops.wilder_sum(t(x), n, start), _wilder_sum_ref(x, n, start))
    close(ops.ema(t(x), 10, alpha=0.3), _ema_ref(x, 10, alpha=0.3))
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


def test_linear_recurrence(rng):
    S, T = 3, 4000
    for a_min in (1e-3, 0.5, 5.0 / 9.0, 0.9, 1.0):
        a = rng.uniform(a_min, 1.0, (S, T))
        b = rng.standard_normal((S, T)) * 100
        b[2, 3500:] = np.nan
        y0 = rng.standard_normal(S)
        want = loop_recurrence(a, b, y0)
        close(ops.linear_recurrence(t(a), t(b), t(y0), a_min), want)
    with pytest.raises(ValueError):
        ops.linear_recurrence(t(a), t(b), t(y0), 0.0)


def test_scans_short_and_empty(rng):
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


# ---------------------------------------------------------------- the whole registry

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
    assert (err <= TOL).all(), f"the values differ beyond {TOL}: {worst}"


@pytest.fixture(scope="module")
def bars3() -> pd.DataFrame:
    return make_bars(3000, ("AAA", "BBB", "CCC"), seed=11)


@pytest.fixture(scope="module")
def values3(bars3) -> np.ndarray:
    return every_feature(bars3)


def test_symbols_shorter_than_the_warmups():
    """Symbols of 1 to 60 bars, shorter than most warm-ups: every feature computes, each symbol's values and NaNs the
    ones it has alone (one symbol's panel is a view of its bars; several are padded rows)."""
    short = [make_bars(100, (f"S{k}",), seed=k).iloc[:m] for k, m in enumerate((1, 2, 15, 30, 4, 60))]
    bars = pd.concat(short, ignore_index=True)
    together = every_feature(bars)
    rows = np.cumsum([0] + [len(b) for b in short])
    for k, b in enumerate(short):
        assert_same_features(every_feature(b.reset_index(drop=True)), together[:, rows[k] : rows[k + 1]])


def test_last_step_into_the_output_rounds_once(bars3):
    """One symbol: features that write their last step into the float32 output give exactly the float64 values
    rounded once, as those that return their own float64 tensor do."""
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


def test_blocked_running_sums_keep_the_values(bars3, values3, monkeypatch):
    """The CUDA choice of two-level running sums for several long rows, forced on CPU, keeps the values."""
    plain = ops.cumsum
    monkeypatch.setattr(ops, "cumsum", lambda x, block=256: ops.blocked_cumsum(x, block)
                        if x.shape[-1] > block else plain(x))
    assert_same_features(every_feature(bars3), values3)


def test_every_feature_is_causal(bars3):
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
def test_features_on_cuda(bars3, values3):
    """On the GPU (its scans and reductions round differently): the CPU values, and several long rows."""
    assert_same_features(every_feature(bars3, "cuda"), values3)
    bars = make_bars(6000, ("AAA", "BBB", "CCC"), seed=2)  # rows over 4096 bars: the two-level running sums
    assert_same_features(every_feature(bars, "cuda"), every_feature(bars))
    x = torch.randn(3, 10000, dtype=torch.float64, device="cuda").cumsum(-1)
    close(ops.cumsum(x), np.cumsum(x.cpu().numpy(), axis=1), tol=1e-14)


# ---------------------------------------------------------------- brute force

def test_bars_since_extreme_matches_brute_force():
    rng = np.random.default_rng(2)
    x = np.round(rng.standard_normal((2, 300)), 1)  # coarse values: many ties, which go to the latest bar
    for n in (1, 2, 4, 7, 25):
        for highest in (True, False):
            ref = np.full_like(x, np.nan)
            for i in range(n, x.shape[1]):
                w = x[:, i - n : i + 1][:, ::-1]
                ref[:, i] = np.argmax(w, axis=1) if highest else np.argmin(w, axis=1)
            np.testing.assert_array_equal(ops.bars_since_extreme(t(x), n, highest).numpy(), ref)


def test_block_prefix_matches_direct_sums():
    rng = np.random.default_rng(3)
    x = 1000.0 + np.cumsum(rng.standard_normal((2, 5000)), axis=1)
    bp = ops.BlockPrefix(t(x), 200, start=3, squares=True)
    for n in (1, 7, 200):
        m, v = (a.numpy() for a in bp.mean_var(n))
        ref_m = np.full_like(x, np.nan)
        ref_v = np.full_like(x, np.nan)
        for i in range(3 + n - 1, x.shape[1]):
            ref_m[:, i] = x[:, i - n + 1 : i + 1].mean(axis=1)
            ref_v[:, i] = x[:, i - n + 1 : i + 1].var(axis=1)
        np.testing.assert_allclose(m, ref_m, rtol=1e-12)
        np.testing.assert_allclose(v, ref_v, rtol=1e-7, atol=1e-7)
        np.testing.assert_allclose(bp.sum(n).numpy(), n * ref_m, rtol=1e-12)


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
