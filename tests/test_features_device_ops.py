"""The device (torch) feature path against the numpy path: every op of filters.py, every momentum and trend
feature, the panel, and causality (bars after t never change a feature at t)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from test_features import make_bars, perturb_after

from foxhunt.features import filters as F
from foxhunt.features.compute import REGISTRY, _compute_flat
from foxhunt.features.device import momentum, ops, trend
from foxhunt.features.device.panel import TorchPanel
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
        close(ops.shift(t(x), k), F.shift(x, k))
        close(ops.shift(t(x), k, 0.0), F.shift(x, k, 0.0))
        close(ops.diff(t(x), k), F.diff(x, k))
        close(ops.pct_change(t(x), k), F.pct_change(x, k))
        c = rng.uniform(0.5, 2, x.shape)
        close(ops.lag_diff_times(t(x), k, t(c)), F.lag_diff_times(x, k, c))
    with pytest.raises(ValueError):
        ops.shift(t(x), 0)


def test_safe_div(rng):
    num, den = rng.standard_normal((3, 200)), rng.integers(-2, 3, (3, 200)).astype(float)
    den[0, :5] = np.nan
    for fill, scale in ((0.0, 1.0), (0.5, 100.0), (1.0, -100.0)):
        close(ops.safe_div(t(num), t(den), fill, scale), F.safe_div(num, den, fill, scale=scale), tol=0.0)


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
        close(ops.rolling_sum(t(x), n, start), F.rolling_sum(x, n, start))
        close(ops.rolling_mean(t(x), n, start), F.rolling_mean(x, n, start))
        pre, tpre = F.Prefix(x, start, squares=True), ops.Prefix(t(x), start, squares=True)
        if start + n - 1 < x.shape[1]:
            close(tpre.sum(n), pre.sum(n))
            for got, want in zip(tpre.mean_var(n), pre.mean_var(n)):
                close(got, want)
            close(tpre.std(n), pre.std(n))


@pytest.mark.parametrize("start", [0, 3])
def test_block_prefix_and_rolling_std(rng, start):
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
        close(ops.rolling_std(t(x), n, start) ** 2, direct)  # uncentred sums would be off by ~1e-5
        same = F.BlockPrefix(x, n, start, squares=True)  # the same blocks: the same rounding, even for a std near 0
        close(ops.rolling_std(t(x), n, start), same.mean_std(n)[1])
        for got, want in zip(ops.rolling_mean_std(t(x), n, start, 2.0), same.mean_std(n, 2.0)):
            close(got, want)
    with pytest.raises(ValueError):
        tbp.mean(201)


def test_rolling_extremes(rng):
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
            else:  # filters.py refuses windows over 128 bars; the loop leaves windows with padding undefined
                want = _bars_since_loop(x, n, highest)
                got[torch.from_numpy(np.isnan(want))] = np.nan
            close(got, want, tol=0.0)


def _bars_since_loop(x: np.ndarray, n: int, highest: bool) -> np.ndarray:
    """Bars since the extreme of x[t-n..t], ties to the latest (a plain loop, for windows filters.py refuses)."""
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


def test_first_order_ema_wilder(rng):
    x = padded(rng, T=5000, lengths=(5000, 4321, 3000), level=100.0)
    y0 = rng.standard_normal(3)
    for a in (0.0, 0.005, 0.01, 0.3, 2.0 / 3.0, 0.9, 0.99, 0.999, 1.0):
        want = F.first_order(x, a, 1.0 - a if a < 1 else 0.5, y0, np.empty_like(x))
        close(ops.first_order(t(x), a, 1.0 - a if a < 1 else 0.5, t(y0)), want)
    for n in (1, 2, 5, 14, 200, 4999, 5000, 6000):
        for start in (0, 1, 30):
            close(ops.ema(t(x), n, start), F.ema(x, n, start))
            close(ops.ema(t(x), n, start, seed="first"), F.ema(x, n, start, seed="first"))
            close(ops.wilder(t(x), n, start), F.wilder(x, n, start))
            close(ops.wilder_sum(t(x), n, start), F.wilder_sum(x, n, start))
    close(ops.ema(t(x), 10, alpha=0.3), F.ema(x, 10, alpha=0.3))
    with pytest.raises(ValueError):
        ops.ema(t(x), 5, seed="nope")


def test_linear_recurrence(rng):
    S, T = 3, 4000
    for a_min in (1e-3, 0.5, 5.0 / 9.0, 0.9, 1.0):
        a = rng.uniform(a_min, 1.0, (S, T))
        b = rng.standard_normal((S, T)) * 100
        b[2, 3500:] = np.nan
        y0 = rng.standard_normal(S)
        close(ops.linear_recurrence(t(a), t(b), t(y0), a_min), F.linear_recurrence(a, b, y0, a_min))
    with pytest.raises(ValueError):
        ops.linear_recurrence(t(a), t(b), t(y0), 0.0)


def test_scans_short_and_empty(rng):
    for T in (0, 1, 2, 17):
        x = rng.standard_normal((2, T))
        y0 = rng.standard_normal(2)
        close(ops.first_order(t(x), 0.9, 0.1, t(y0)), F.first_order(x, 0.9, 0.1, y0, np.empty_like(x)))
        a = rng.uniform(0.5, 1, (2, T))
        close(ops.linear_recurrence(t(a), t(x), t(y0), 0.5), F.linear_recurrence(a, x, y0, 0.5))


# ---------------------------------------------------------------- panel


def test_panel_from_flat(rng):
    lengths = (50, 30, 41)
    sym = np.repeat(np.arange(3), lengths)
    N = len(sym)
    ohlcv = rng.uniform(1, 2, (N, 5))
    ts = np.arange(N, dtype=np.int64) * 60
    tp, p = TorchPanel.from_flat(torch.from_numpy(ohlcv), torch.from_numpy(ts), torch.from_numpy(sym)), Panel.from_flat(ohlcv, ts, sym)
    assert tp.shape == p.shape and tp.lengths == list(lengths) and tp.device == torch.device("cpu")
    assert tp.starts.tolist() == list(p.starts)
    np.testing.assert_array_equal(tp.ohlcv.numpy(), p.ohlcv)
    np.testing.assert_array_equal(tp.timestamps.numpy(), p.timestamps)
    for name in ("log_close", "close_change", "prev_close", "true_range", "inv_atr", "typical_price", "hl_range"):
        close(getattr(tp, name)(), getattr(p, name)())
    close(tp.log_return(1), p.log_return(1))
    close(tp.log_return(5), p.log_return(5))
    close(tp.atr(7), p.atr(7))
    close(tp.per_atr(tp.close), p.per_atr(p.close))
    close(tp.volume_mean(10), p.volume_mean(10))
    one = TorchPanel.from_flat(torch.from_numpy(ohlcv[:50]), torch.from_numpy(ts[:50]), torch.zeros(50, dtype=torch.int64))
    assert one.shape == (1, 50) and one.ohlcv.data_ptr() == one.close.data_ptr() - 3 * 50 * 8  # a view of the columns
    with pytest.raises(ValueError):
        TorchPanel.from_flat(torch.from_numpy(ohlcv), torch.from_numpy(ts), torch.from_numpy(sym[::-1].copy()))
    empty = TorchPanel.from_flat(torch.zeros((0, 5)), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert empty.shape == (0, 0)


# ---------------------------------------------------------------- momentum and trend features

FAMILIES = {"momentum": momentum, "trend": trend}
NAMES = [n for n, f in REGISTRY.items() if f.family in FAMILIES]
# worst max|torch - numpy| / (1 + max|numpy|) per feature on these bars (torch 2.13 CPU): ~1e-13 (slope_ema_*,
# a difference of consecutive EMAs in ATR units), 5e-14 macd_hist, under 4e-14 for the rest; a third bit-identical


def arrays(bars: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ohlcv [N, 5] float64, timestamps [N] int64 and symbol_index [N] of a bar frame."""
    ohlcv = bars[["open", "high", "low", "close", "volume"]].to_numpy(dtype=np.float64)
    ts = bars["timestamp"].to_numpy(dtype="datetime64[ns]").astype(np.int64)
    return ohlcv, ts, pd.factorize(bars["symbol"])[0].astype(np.int64)


def device_features(bars: pd.DataFrame, device: str = "cpu") -> tuple[TorchPanel, dict[str, torch.Tensor]]:
    """The TorchPanel of the bars (on ``device``) and every momentum and trend feature of it, [S, T] each."""
    ohlcv, ts, sym = (torch.tensor(a, device=device) for a in arrays(bars))
    panel = TorchPanel.from_flat(ohlcv, ts, sym)
    fns = {**momentum.functions(), **trend.functions()}
    return panel, {name: fns[name](panel) for name in NAMES}


@pytest.fixture(scope="module")
def bars3() -> pd.DataFrame:
    return make_bars(3000, ("AAA", "BBB", "CCC"), seed=11)


@pytest.fixture(scope="module")
def computed(bars3):
    return device_features(bars3)


def test_functions_cover_the_registry():
    for fam, mod in FAMILIES.items():
        assert list(mod.functions()) == [n for n, f in REGISTRY.items() if f.family == fam]


def assert_features_match(bars: pd.DataFrame, panel: TorchPanel, got: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per symbol, after each feature's warm-up: the same NaN positions and values within TOL; the errors by name."""
    selected = [REGISTRY[n] for n in NAMES]
    want, _ = _compute_flat(selected, *arrays(bars), dtype=np.float64)
    errors = {}
    for j, f in enumerate(selected):
        g = got[f.name]
        assert g.shape == panel.shape and g.dtype == torch.float64 and g.device == panel.device, f.name
        g = g.cpu().numpy()
        w_rows, g_rows = [], []
        for s, (a, m) in enumerate(zip(panel.starts.tolist(), panel.lengths)):
            w_rows.append(want[j, a + f.warmup : a + m])
            g_rows.append(g[s, f.warmup : m])
        w, gg = np.concatenate(w_rows), np.concatenate(g_rows)
        assert (np.isnan(w) == np.isnan(gg)).all(), f"{f.name}: NaN positions differ"
        scale = 1.0 + np.nanmax(np.abs(w), initial=0.0)
        errors[f.name] = float(np.nanmax(np.abs(gg - w), initial=0.0)) / scale
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, f"features off the numpy path: {bad}"
    return errors


def test_features_match_numpy(bars3, computed):
    assert_features_match(bars3, *computed)


def test_features_match_numpy_one_symbol(bars3):
    one = bars3[bars3.symbol == "BBB"].reset_index(drop=True)
    panel, got = device_features(one)
    assert panel.shape == (1, len(one))
    assert_features_match(one, panel, got)


def test_features_are_causal(bars3, computed):
    """New prices at every bar after a random t (per symbol) leave every feature at bars <= t bit-identical."""
    assert_causal(bars3, *computed)


def assert_causal(bars3: pd.DataFrame, panel: TorchPanel, base: dict[str, torch.Tensor]) -> None:
    rng = np.random.default_rng(5)
    cut = [int(rng.integers(50, m - 1)) for m in panel.lengths]
    pos = bars3.groupby("symbol", sort=False).cumcount().to_numpy()
    sym = pd.factorize(bars3["symbol"])[0]
    after = np.flatnonzero(pos > np.asarray(cut)[sym])
    _, moved = device_features(perturb_after(bars3, after, rng), str(panel.device))
    for name in NAMES:
        a, b = base[name].cpu().numpy(), moved[name].cpu().numpy()
        for s, t_ in enumerate(cut):
            assert np.array_equal(a[s, : t_ + 1], b[s, : t_ + 1], equal_nan=True), f"{name}: symbol {s} changed at <= {t_}"
            later = a[s, t_ + 1 : panel.lengths[s]] != b[s, t_ + 1 : panel.lengths[s]]
            assert later.any() or name.startswith(("aroon", "stoch", "willr")), f"{name}: the perturbation did not reach it"


@pytest.mark.parametrize("lengths", [(1,), (2,), (15,), (30, 4), (60, 1, 27)])
def test_features_on_short_symbols(lengths):
    """Symbols shorter than the warm-ups: NaN where the numpy path has NaN, no error."""
    frames = [make_bars(max(lengths) + 40, (f"S{k}",), seed=k).iloc[:m] for k, m in enumerate(lengths)]
    bars = pd.concat(frames, ignore_index=True)
    assert_features_match(bars, *device_features(bars))


def test_features_with_blocked_running_sums(bars3, monkeypatch):
    """The CUDA choice of two-level running sums for several long rows, forced on CPU, keeps the numpy values."""
    plain = ops.cumsum
    monkeypatch.setattr(ops, "cumsum", lambda x, block=256: ops.blocked_cumsum(x, block) if x.shape[-1] > block else plain(x))
    assert_features_match(bars3, *device_features(bars3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_features_on_cuda():
    """On the GPU (its scans and reductions round differently): the numpy values, causality, several long rows."""
    bars = make_bars(6000, ("AAA", "BBB", "CCC"), seed=2)  # rows over 4096 bars: the two-level running sums
    panel, got = device_features(bars, "cuda")
    assert panel.device.type == "cuda"
    assert_features_match(bars, panel, got)
    assert_causal(bars, panel, got)
    x = torch.randn(3, 10000, dtype=torch.float64, device="cuda").cumsum(-1)
    close(ops.cumsum(x), np.cumsum(x.cpu().numpy(), axis=1), tol=1e-14)
