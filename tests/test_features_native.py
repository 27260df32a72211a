"""The compiled CPU loops (foxhunt.features.native): built once into a verified cache, equal bit for bit to the same
arithmetic in Python or numpy, rebuilt when the cached file is damaged, and replaced by the plain torch path (the same
values) without a compiler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_features import make_bars
from test_features_ops import assert_same_features, every_feature
from test_features_ops import loop_recurrence as loop

from foxhunt import compiled
from foxhunt.features import native, ops

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler here")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory and no library loaded yet in this process (restored afterwards)."""
    monkeypatch.setenv("FOXHUNT_CACHE", str(tmp_path))
    native.library.cache_clear()
    yield tmp_path / "native"
    native.library.cache_clear()


def test_loops_equal_the_same_arithmetic_bit_for_bit(fresh_cache):
    """Strided rows (a view of every other row) and an in-place recurrence; identical to the Python loop, which
    performs the same IEEE operations in the same order."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 1001))[::2]  # row stride 2 x 1001
    y0 = rng.standard_normal(3)
    out = np.empty((3, 1001))
    native.first_order(x, 0.75, 0.25, y0, out)
    np.testing.assert_array_equal(out, loop(np.full_like(x, 0.75), 0.25 * x, y0))
    a = rng.uniform(0.1, 1.0, (3, 1001))
    b = rng.standard_normal((3, 1001))
    want = loop(a, b, y0)
    np.testing.assert_array_equal(native.linear_recurrence(a, b.copy(), y0, np.empty_like(b)), want)
    native.linear_recurrence(a, b, y0, b)  # in place
    np.testing.assert_array_equal(b, want)
    c = rng.uniform(0.5, 2.0, (3, 1001))
    for dtype in (np.float64, np.float32):
        np.testing.assert_array_equal(native.diff_times(x, a, c, np.empty((3, 1001), dtype)), ((x - a) * c).astype(dtype))
        den = np.where(a > 0.5, a, 0.0)
        with np.errstate(divide="ignore"):
            want = np.where(den == 0, 0.25, (-100.0 * x) / den).astype(dtype)
        np.testing.assert_array_equal(native.safe_div(x, den, 0.25, -100.0, np.empty((3, 1001), dtype)), want)
        d = a + np.where(a > 0.5, 0.0, c)  # c - d = 0 where a > 0.5
        with np.errstate(divide="ignore", invalid="ignore"):
            want = np.where(d - a == 0, 0.0, (-100.0 * (x - c)) / (a - d)).astype(dtype)
            ratio = native.difference_ratio(x, c, a, d, -100.0, np.empty((3, 1001), dtype))
        np.testing.assert_array_equal(ratio, want)
        sums, sums2 = np.cumsum(x, axis=1), np.cumsum(x * x, axis=1)
        m = (sums[:, 5:] - sums[:, :-5]) / 5.0
        want = np.sqrt(np.maximum((sums2[:, 5:] - sums2[:, :-5]) / 5.0 - m * m, 0.0)).astype(dtype)
        got = native.window_std(sums[:, 5:], sums[:, :-5], sums2[:, 5:], sums2[:, :-5], 5, np.empty((3, 996), dtype))
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="float64 or float32"):
        native.diff_times(x, a, c, np.empty((3, 1001), np.int64))
    with pytest.raises(ValueError, match="contiguous bars"):
        native.first_order(np.asfortranarray(rng.standard_normal((3, 50))), 0.5, 0.5, y0, np.empty((3, 50)))
    with pytest.raises(ValueError, match="shapes differ"):
        native.linear_recurrence(a, b[:, :10], y0, b)


def test_cache_is_built_once_and_verified(fresh_cache):
    """The first call compiles into the cache and records the library's digest; a damaged library (its digest no
    longer matches) is rebuilt rather than loaded."""
    assert native.available()
    libs = list(fresh_cache.glob("features-*.so"))
    assert len(libs) == 1 and libs[0].with_suffix(".sha256").read_text().strip() == compiled.digest(libs[0])
    built = libs[0].stat().st_mtime_ns
    native.library.cache_clear()
    assert native.available() and libs[0].stat().st_mtime_ns == built  # reused, not rebuilt
    libs[0].unlink()  # damaged on disk (a new file: the loaded one stays mapped in this process)
    libs[0].write_bytes(b"not a library")
    native.library.cache_clear()
    assert native.available()
    assert libs[0].read_bytes() != b"not a library"
    assert libs[0].with_suffix(".sha256").read_text().strip() == compiled.digest(libs[0])


def test_without_a_compiler_the_torch_scans_give_the_same_values(fresh_cache, monkeypatch):
    """No compiler: one warning, available() False, and ops' scans run the torch path with the same values."""
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((2, 3000)))
    a = torch.from_numpy(rng.uniform(0.5, 1.0, (2, 3000)))
    fast = ops.ema(x, 20), ops.wilder(x, 14, start=3), ops.linear_recurrence(a, x, 0.5, a_min=0.5)
    monkeypatch.setenv("CC", "no-such-compiler-foxhunt")
    native.library.cache_clear()
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert not native.available()
    plain = ops.ema(x, 20), ops.wilder(x, 14, start=3), ops.linear_recurrence(a, x, 0.5, a_min=0.5)
    for f, p in zip(fast, plain, strict=True):
        torch.testing.assert_close(p, f, rtol=1e-10, atol=1e-10, equal_nan=True)
    monkeypatch.setenv("FOXHUNT_NATIVE", "0")
    native.library.cache_clear()
    assert not native.available()  # switched off: no warning needed


def test_without_the_loops_every_feature_is_the_same(fresh_cache, monkeypatch):
    """The whole registry with the compiled loops and with ``FOXHUNT_NATIVE=0`` (their torch paths): equal to 1e-9."""
    bars = make_bars(1500, ("AAA", "BBB"), seed=3)
    assert native.available()
    fast = every_feature(bars)
    monkeypatch.setenv("FOXHUNT_NATIVE", "0")
    native.library.cache_clear()
    assert_same_features(every_feature(bars), fast)


def test_a_compiler_without_march_native_still_builds(fresh_cache, tmp_path, monkeypatch):
    """A compiler that refuses -march=native (some do) gets the portable flags: the loops build and check."""
    wrapper = tmp_path / "cc-no-native"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "-march=native" ] && exit 1; done\nexec {native.compiler()} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    native.library.cache_clear()
    assert native.available()
    x = np.random.default_rng(5).standard_normal((1, 300))
    out = np.empty_like(x)
    np.testing.assert_array_equal(native.first_order(x, 0.5, 0.5, np.zeros(1), out), loop(np.full_like(x, 0.5), 0.5 * x, np.zeros(1)))
