"""Preprocessing: correctness against naive references, causality, train-only fitting, gradients, buffers."""

from __future__ import annotations

import io
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch.autograd import gradcheck

from foxhunt.preprocessing import (
    FeatureNormalizer,
    OutlierClip,
    RollingZScore,
    TargetTransform,
    log_returns,
    next_log_returns,
    segment_position,
)


def random_walk_close(n: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 100.0 * torch.exp(torch.cumsum(0.01 * torch.randn(n, generator=gen, dtype=torch.float64), 0)).to(dtype)


def heavy_tailed_returns(n: int, seed: int = 0) -> torch.Tensor:
    """Student-t-like returns with a few large outliers, float64."""
    gen = torch.Generator().manual_seed(seed)
    r = 0.001 * torch.randn(n, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, n, (max(n // 50, 1),), generator=gen)
    r[idx] *= 25.0
    return r


def naive_rolling_zscore(x: np.ndarray, window: int, lag: int = 0, ddof: int = 1) -> np.ndarray:
    """Per-window loop: z[t] = (x[t] - mean(w)) / std(w), w = x[t-lag-window+1 .. t-lag]; NaN if w is short/has NaN."""
    out = np.full(x.shape, np.nan)
    for t in range(x.shape[0]):
        end = t - lag + 1
        start = end - window
        if start < 0:
            continue
        w = x[start:end]
        if not np.all(np.isfinite(w), axis=0).all():
            ok = np.all(np.isfinite(w), axis=0)
            mean = np.where(ok, np.nanmean(np.where(ok, w, 0.0), axis=0), np.nan)
            std = np.where(ok, np.std(np.where(ok, w, 0.0), axis=0, ddof=ddof), np.nan)
        else:
            mean, std = w.mean(axis=0), w.std(axis=0, ddof=ddof)
        out[t] = (x[t] - mean) / std
    return out


# ----------------------------------------------------------------------------------------------------------------------
# log returns
# ----------------------------------------------------------------------------------------------------------------------


def test_log_returns_values_and_conventions() -> None:
    close = torch.tensor([100.0, 101.0, 99.0, 99.5], dtype=torch.float64)
    back = log_returns(close)
    fwd = next_log_returns(close)
    expected = np.diff(np.log(close.numpy()))
    assert math.isnan(back[0]) and math.isnan(fwd[-1])
    np.testing.assert_allclose(back[1:].numpy(), expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(fwd[:-1].numpy(), expected, rtol=0, atol=1e-15)
    # batched along another dim
    two = torch.stack([close, close * 2], dim=1)  # [T, 2]
    np.testing.assert_allclose(log_returns(two, dim=0)[1:, 1].numpy(), expected, atol=1e-15)
    c = random_walk_close(20, 1).requires_grad_(True)
    assert gradcheck(lambda v: log_returns(v)[1:], (c,))
    assert gradcheck(lambda v: next_log_returns(v)[:-1], (c,))


def test_log_returns_respect_segments() -> None:
    close = torch.tensor([10.0, 11.0, 12.0, 50.0, 55.0], dtype=torch.float64)
    seg = torch.tensor([0, 0, 0, 1, 1])
    fwd = next_log_returns(close, segment=seg)
    back = log_returns(close, segment=seg)
    assert torch.isnan(fwd[2]) and torch.isnan(fwd[4]) and torch.isfinite(fwd[[0, 1, 3]]).all()
    assert torch.isnan(back[0]) and torch.isnan(back[3]) and torch.isfinite(back[[1, 2, 4]]).all()
    assert fwd[3].item() == pytest.approx(math.log(55 / 50))


def test_segment_position() -> None:
    seg = torch.tensor([3, 3, 3, 1, 1, 7, 7, 7, 7])
    assert segment_position(seg).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


# ----------------------------------------------------------------------------------------------------------------------
# RollingZScore
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lag", [0, 1, 3])
@pytest.mark.parametrize("window", [2, 7, 32])
def test_rolling_zscore_matches_naive_and_pandas(window: int, lag: int) -> None:
    # trending random walk in three columns at very different levels, with a NaN hole
    x = torch.stack([random_walk_close(400, s) * lvl for s, lvl in [(1, 1.0), (2, 1e3), (3, 1e-3)]], dim=1)
    x[150, 1] = math.nan
    z = RollingZScore(window, lag=lag)(x).numpy()
    ref = naive_rolling_zscore(x.numpy(), window, lag)
    assert np.array_equal(np.isnan(z), np.isnan(ref))
    # rtol as well: with window=2 some |z| reach ~2000 (two nearly equal values), where both sides carry ~1e-7 error
    np.testing.assert_allclose(z, ref, rtol=1e-9, atol=1e-9, equal_nan=True)
    df = pd.DataFrame(x.numpy())
    roll = df.rolling(window, min_periods=window)
    ref_pd = ((df - roll.mean().shift(lag)) / roll.std().shift(lag)).to_numpy()
    np.testing.assert_allclose(z, ref_pd, rtol=1e-9, atol=1e-9, equal_nan=True)
    # warm-up: exactly the first window - 1 + lag rows are not ready (column 0 has no NaN)
    assert np.isnan(z[: window - 1 + lag, 0]).all() and np.isfinite(z[window - 1 + lag :, 0]).all()


def test_rolling_zscore_long_series_matches_two_pass_reference() -> None:
    x = random_walk_close(20_000, 5) + 1e4  # high level, small moves: cumulative-sum cancellation would show here
    z = RollingZScore(50)(x).numpy()
    w = np.lib.stride_tricks.sliding_window_view(x.numpy(), 50)  # every window, two-pass mean and std
    ref = np.full(x.shape, np.nan)
    ref[49:] = (x.numpy()[49:] - w.mean(1)) / w.std(1, ddof=1)
    np.testing.assert_allclose(z, ref, rtol=0, atol=1e-9, equal_nan=True)
    # pandas' online rolling algorithm drifts by ~1e-8 here (it is the less exact side, checked with math.fsum)
    s = pd.Series(x.numpy())
    ref_pd = ((s - s.rolling(50).mean()) / s.rolling(50).std()).to_numpy()
    np.testing.assert_allclose(z, ref_pd, rtol=0, atol=1e-7, equal_nan=True)


def test_rolling_zscore_float32_stays_accurate_on_trending_series() -> None:
    x64 = random_walk_close(100_000, 9) * 50  # level ~5e3, T=1e5: naive float32 cumsums would lose everything
    z32 = RollingZScore(64)(x64.float()).double().numpy()
    z64 = RollingZScore(64)(x64.float().double()).numpy()  # same float32 inputs, float64 arithmetic
    np.testing.assert_allclose(z32, z64, rtol=0, atol=2e-3, equal_nan=True)


def test_rolling_zscore_batched_layout_and_segments() -> None:
    x = torch.randn(3, 100, 4, dtype=torch.float64)
    mod = RollingZScore(10)
    batched = mod(x)
    for b in range(3):
        torch.testing.assert_close(batched[b], mod(x[b]), equal_nan=True)
    # with segments, a window never crosses a boundary: equal to computing each segment alone
    flat = torch.randn(90, 2, dtype=torch.float64)
    seg = torch.tensor([0] * 40 + [1] * 50)
    out = RollingZScore(8, lag=1)(flat, segment=seg)
    torch.testing.assert_close(out[:40], RollingZScore(8, lag=1)(flat[:40]), equal_nan=True)
    torch.testing.assert_close(out[40:], RollingZScore(8, lag=1)(flat[40:]), equal_nan=True)
    assert torch.isnan(out[40:48]).all() and torch.isfinite(out[48:]).all()


def test_rolling_zscore_constant_window_uses_eps_not_inf() -> None:
    x = torch.ones(30, dtype=torch.float64)
    x[20:] = 2.0
    z = RollingZScore(5, eps=1e-6)(x)
    assert torch.isfinite(z[4:]).all()
    assert z[10].item() == 0.0  # constant window: (1 - 1) / eps
    assert z[20].item() > 0


@pytest.mark.parametrize("lag", [0, 1])
def test_rolling_zscore_is_causal(lag: int) -> None:
    x = torch.randn(300, 3, dtype=torch.float64)
    mod = RollingZScore(16, lag=lag)
    base = mod(x)
    gen = torch.Generator().manual_seed(1)
    for t in [0, 15, 16, 17, 150, 298]:
        y = x.clone()
        y[t + 1 :] = 1e6 * torch.randn(y[t + 1 :].shape, generator=gen, dtype=torch.float64)
        out = mod(y)
        assert torch.equal(torch.nan_to_num(out[: t + 1], nan=-7.0), torch.nan_to_num(base[: t + 1], nan=-7.0)), t
        if t + 20 < x.shape[0]:
            assert not torch.equal(out[t + 20 :], base[t + 20 :])


def test_rolling_inverse_roundtrip() -> None:
    x = random_walk_close(200, 3)
    mod = RollingZScore(12, lag=1)
    mean, std, ready = mod.moments(x)
    z = mod(x)
    back = mod.inverse(z, mean, std)
    torch.testing.assert_close(back[ready], x[ready], rtol=0, atol=1e-10)
    assert torch.isnan(back[~ready]).all()


def test_rolling_zscore_gradcheck() -> None:
    x = torch.randn(40, 2, dtype=torch.float64, requires_grad=True)
    mod = RollingZScore(6, lag=1)
    assert gradcheck(lambda v: mod(v)[6:], (x,))
    assert gradcheck(lambda v: torch.stack(mod.moments(v)[:2], dim=-1)[6:], (x,))


def test_rolling_zscore_gradient_is_finite_with_nans() -> None:
    x = torch.randn(50, dtype=torch.float64)
    x[10] = math.nan
    x = x.requires_grad_(True)
    z = RollingZScore(5)(x)
    torch.nan_to_num(z, nan=0.0).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert x.grad[10] == 0.0


# ----------------------------------------------------------------------------------------------------------------------
# Fitted modules
# ----------------------------------------------------------------------------------------------------------------------


def split_series(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[0]
    a, b = int(n * 0.6), int(n * 0.8)
    return x[:a], x[a:b], x[b:]


def test_feature_normalizer_fit_nan_aware_and_invertible() -> None:
    scale, level = torch.tensor([1.0, 10.0, 0.1, 3.0]), torch.tensor([0.0, 5.0, -2.0, 1e3])
    x = torch.randn(500, 4, dtype=torch.float64) * scale + level
    x[::7, 2] = math.nan
    norm = FeatureNormalizer().fit(x)
    ref_mean = np.nanmean(x.numpy(), axis=0)
    ref_std = np.nanstd(x.numpy(), axis=0, ddof=1)
    np.testing.assert_allclose(norm.mean.numpy(), ref_mean, rtol=1e-12)
    np.testing.assert_allclose(norm.std.numpy(), ref_std, rtol=1e-12)
    z = norm(x)
    assert torch.isnan(z[::7, 2]).all()
    torch.testing.assert_close(norm.inverse(z), x, equal_nan=True)
    assert gradcheck(norm, (torch.randn(6, 4, dtype=torch.float64, requires_grad=True),))


def test_feature_normalizer_errors_are_clear() -> None:
    with pytest.raises(RuntimeError, match="before fit"):
        FeatureNormalizer()(torch.randn(3, 2))
    x = torch.randn(10, 3)
    x[:, 1] = math.nan
    with pytest.raises(ValueError, match=r"\['vwap_dist'\]"):
        FeatureNormalizer().fit(x, names=["a", "vwap_dist", "c"])


def test_fitted_statistics_depend_on_train_only() -> None:
    r = heavy_tailed_returns(3000, 4)
    train, val, test = split_series(r)
    modules = [
        lambda: FeatureNormalizer(),
        lambda: OutlierClip(3.0),
        lambda: TargetTransform(scale="fitted", clip_sigma=4.0),
    ]
    for make in modules:
        fitted = make().fit(train)
        before = {k: v.clone() for k, v in fitted.state_dict().items()}
        # apply to the other splits with changed data: no buffer moves
        fitted(val * 100 + 3)
        fitted(test.flip(0) - 1)
        for k, v in fitted.state_dict().items():
            assert torch.equal(v, before[k]), k
        # refitting on the same train with completely different val/test is identical
        r2 = torch.cat([train, 50 * torch.randn_like(val), torch.zeros_like(test)])
        refit = make().fit(split_series(r2)[0])
        for k, v in refit.state_dict().items():
            assert torch.equal(v, before[k]), k
        # and fitting on everything would have given different statistics (so the check above can fail)
        leaky = make().fit(r2)
        assert any(not torch.equal(v, before[k]) for k, v in leaky.state_dict().items() if v.is_floating_point())


def test_outlier_clip_fitted_bounds() -> None:
    r = heavy_tailed_returns(2000, 1)
    train, val, _ = split_series(r)
    clip = OutlierClip(3.0).fit(train)
    mean, std = train.mean(), train.std()
    torch.testing.assert_close(clip.lower, mean - 3 * std)
    torch.testing.assert_close(clip.upper, mean + 3 * std)
    out = clip(val)
    assert out.max() <= clip.upper and out.min() >= clip.lower
    inside = (val > clip.lower) & (val < clip.upper)
    assert torch.equal(out[inside], val[inside]) and (~inside).any()
    # per column for 2-D input
    two = torch.stack([train, 10 * train], dim=1)
    clip2 = OutlierClip(2.0).fit(two)
    assert clip2.upper.shape == (2,)
    torch.testing.assert_close(clip2.upper[1], 10 * clip2.upper[0])


def test_outlier_clip_rolling_is_causal_and_matches_reference() -> None:
    r = heavy_tailed_returns(600, 2)
    clip = OutlierClip(2.5, mode="rolling", window=30)
    out = clip(r)
    s = pd.Series(r.numpy())
    m, sd = s.rolling(30).mean(), s.rolling(30).std()
    ref = s.clip(m - 2.5 * sd, m + 2.5 * sd).to_numpy(copy=True)
    ref[:29] = np.nan
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-12, equal_nan=True)
    perturbed = r.clone()
    perturbed[301:] = 5.0
    assert torch.equal(clip(perturbed)[:301].nan_to_num(7.0), out[:301].nan_to_num(7.0))
    with pytest.raises(ValueError, match="window"):
        OutlierClip(3.0, mode="rolling")


def test_outlier_clip_gradcheck_both_modes() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(60, dtype=torch.float64, generator=gen)
    x[[10, 30, 50]] = torch.tensor([8.0, -9.0, 7.5], dtype=torch.float64)
    fitted = OutlierClip(2.0).fit(x[:40])
    assert gradcheck(fitted, (x.clone().requires_grad_(True),))
    rolling = OutlierClip(2.0, mode="rolling", window=8)
    assert gradcheck(lambda v: rolling(v)[7:], (x.clone().requires_grad_(True),))
    # clipped elements get zero gradient, others one (fitted mode)
    xg = x.clone().requires_grad_(True)
    fitted(xg).sum().backward()
    assert xg.grad[10] == 0.0 and xg.grad[0] == 1.0


# ----------------------------------------------------------------------------------------------------------------------
# TargetTransform
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["none", "fitted", "rolling"])
def test_target_transform_inverse_roundtrip_without_clipping(scale: str) -> None:
    r = heavy_tailed_returns(1000, 5)
    train = r[:600]
    tt = TargetTransform(scale=scale, zscore_window=50 if scale == "rolling" else None).fit(train)
    out = tt.transform(r)
    back = tt.inverse(out.value, out.loc, out.scale)
    finite = torch.isfinite(out.value)
    torch.testing.assert_close(back[finite], r[finite], rtol=0, atol=1e-12)
    if scale != "rolling":
        torch.testing.assert_close(tt.inverse(out.value), r, rtol=0, atol=1e-12)
    else:
        assert finite.sum() == 1000 - 50  # warm-up: row t needs the 50 returns before it, never r[t] itself
        with pytest.raises(ValueError, match="loc and scale"):
            tt.inverse(out.value)


def test_target_transform_rolling_scale_uses_only_returns_known_at_decision_time() -> None:
    r = heavy_tailed_returns(400, 6)
    tt = TargetTransform(scale="rolling", zscore_window=20, clip_sigma=3.0, clip_mode="rolling", clip_window=25)
    base = tt.transform(r)
    for t in [100, 250]:
        p = r.clone()
        p[t:] += 0.5  # change r[t] itself and everything after it
        out = tt.transform(p)
        # loc/scale at rows <= t do not use r[t]: the prediction for row t can be mapped back at bar t
        assert torch.equal(out.loc[: t + 1].nan_to_num(9.0), base.loc[: t + 1].nan_to_num(9.0))
        assert torch.equal(out.scale[: t + 1].nan_to_num(9.0), base.scale[: t + 1].nan_to_num(9.0))
        assert torch.equal(out.value[:t].nan_to_num(9.0), base.value[:t].nan_to_num(9.0))
        assert not torch.equal(out.value[t], base.value[t])
    # warm-up: 20 returns before the first scaled row, then 25 scaled values before the first clip bounds
    assert torch.isnan(base.value[:45]).all() and torch.isfinite(base.value[45:]).all()


def test_target_transform_clipping_is_not_inverted() -> None:
    r = heavy_tailed_returns(2000, 7)
    tt = TargetTransform(scale="fitted", clip_sigma=2.0).fit(r[:1200])
    out = tt.transform(r)
    back = tt.inverse(out.value)
    clipped = (out.value == tt.clip.upper) | (out.value == tt.clip.lower)
    assert clipped.any()
    assert (back[clipped] - r[clipped]).abs().min() > 0  # the raw returns are lost where clipped
    torch.testing.assert_close(back[~clipped], r[~clipped], rtol=0, atol=1e-12)


def test_target_transform_config_errors() -> None:
    with pytest.raises(ValueError, match="zscore_window"):
        TargetTransform(scale="rolling")
    with pytest.raises(ValueError, match="zscore_window"):
        TargetTransform(scale="fitted", zscore_window=10)
    with pytest.raises(RuntimeError, match="before fit"):
        TargetTransform(scale="fitted")(torch.randn(10))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale": "fitted", "clip_sigma": 2.0},
        {"scale": "rolling", "zscore_window": 6, "clip_sigma": 2.0},
        {"scale": "rolling", "zscore_window": 6, "clip_sigma": 2.0, "clip_mode": "rolling", "clip_window": 5},
    ],
)
def test_target_transform_gradcheck(kwargs: dict) -> None:
    gen = torch.Generator().manual_seed(11)
    r = torch.randn(50, dtype=torch.float64, generator=gen)
    r[[20, 40]] = torch.tensor([6.0, -6.0], dtype=torch.float64)
    tt = TargetTransform(**kwargs).fit(r[:30])
    finite = torch.isfinite(tt(r))
    assert finite.sum() > 30
    assert gradcheck(lambda v: tt(v)[finite], (r.clone().requires_grad_(True),))


def test_gradient_reaches_raw_prices_through_whole_chain() -> None:
    close = random_walk_close(120, 8).requires_grad_(True)
    zscore = RollingZScore(10, lag=1)
    clip = OutlierClip(2.0, mode="rolling", window=10)

    def chain(c: torch.Tensor) -> torch.Tensor:
        return clip(zscore(next_log_returns(c)))

    out = chain(close)
    ready = torch.isfinite(out)
    assert ready.sum() > 80
    out[ready].pow(2).sum().backward()
    assert close.grad is not None and torch.isfinite(close.grad).all()
    assert (close.grad[12:-1] != 0).float().mean() > 0.9
    assert gradcheck(lambda c: chain(c)[ready], (close.detach().clone().requires_grad_(True),))


# ----------------------------------------------------------------------------------------------------------------------
# Buffers: state_dict, dtype/device, checkpoint round-trip
# ----------------------------------------------------------------------------------------------------------------------


def test_buffers_in_state_dict_follow_dtype_and_reload_into_fresh_modules() -> None:
    x = torch.randn(300, 5)
    norm = FeatureNormalizer().fit(x)
    clip = OutlierClip(3.0).fit(x)
    tt = TargetTransform(scale="fitted", clip_sigma=3.0).fit(x[:, 0])
    assert {"mean", "std", "fitted"} <= set(norm.state_dict())
    assert {"lower", "upper", "fitted"} <= set(clip.state_dict())
    assert {"scaler.mean", "scaler.std", "clip.lower", "clip.upper"} <= set(tt.state_dict())
    pairs = [(norm, FeatureNormalizer()), (clip, OutlierClip(3.0)), (tt, TargetTransform(scale="fitted", clip_sigma=3.0))]
    for mod, fresh in pairs:
        buf = io.BytesIO()
        torch.save(mod.state_dict(), buf)
        buf.seek(0)
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        for k, v in mod.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), k
        data = x[:, 0] if mod is tt else x
        torch.testing.assert_close(fresh(data), mod(data), equal_nan=True)
    norm64 = norm.to(torch.float64)
    assert norm64.mean.dtype == torch.float64 and norm64.std.dtype == torch.float64
    assert norm64(x.double()).dtype == torch.float64
    assert tt.to(torch.float64).clip.upper.dtype == torch.float64
    if torch.cuda.is_available():
        assert norm.to("cuda").mean.device.type == "cuda"
