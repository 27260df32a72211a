"""The causal building blocks (rolling sums, extrema, scans) against direct, loop-based definitions."""

from __future__ import annotations

import numpy as np

from foxhunt.features import filters as F


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


def test_linear_recurrence_matches_loop():
    rng = np.random.default_rng(1)
    a = rng.uniform(0.5, 1.0, (2, 3001))
    b = rng.standard_normal((2, 3001))
    y0 = np.array([1.0, -2.0])
    ref = np.empty_like(a)
    y = y0.copy()
    for t in range(a.shape[1]):
        y = a[:, t] * y + b[:, t]
        ref[:, t] = y
    np.testing.assert_allclose(F.linear_recurrence(a, b, y0, a_min=0.5), ref, rtol=1e-9, atol=1e-9)


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
