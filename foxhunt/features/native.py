"""The CPU loops that numpy cannot write in one pass, in plain C: the scans y[t] = a y[t-1] + b x[t] (EMA, Wilder
smoothing) and y[t] = a[t] y[t-1] + b[t] (KAMA), as TA-Lib itself computes them, and the features' commonest last
steps ((a - b) c, the guarded division, the ratio of two differences, a rolling standard deviation from window sums),
rounded once into the float32 output.

A first-order recurrence is sequential: numpy can only block it (a multiply, block sums, a running sum and a
multiply per block, ~6 ms a million bars), where a C loop takes one multiply-add a bar (~1.2 ms; TA-Lib's EMA
~2.1 ms with its fresh output). A last step in numpy is two or three passes over cache-sized runs (~1.9 ms a million
bars for (a - b) c into float32, ~1.85 for the guarded division) where one C pass takes ~1.0 and ~1.4 ms, with the
same float64 operations in the same order and one rounding: bit-identical results.

The source below is compiled on first use, cached and verified by :mod:`foxhunt.compiled` (one library per source,
flags, compiler and CPU; a damaged one is rebuilt, one that fails its self-check against the same arithmetic in Python
is removed). Without a compiler (or with ``FOXHUNT_NATIVE=0``) :func:`available` is False, one warning says so, and
:mod:`foxhunt.features.ops` runs those primitives' torch path on the CPU instead: the same values, slower.

The loops read bar t only from bars <= t (causal by construction), in float64, with strict IEEE arithmetic (no
``-ffast-math``, no contraction into fused multiply-adds), so results do not depend on the machine.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from foxhunt import compiled
from foxhunt.compiled import compiler as compiler  # re-exported: the tests ask whether the loops can be built

SOURCE = r"""
#include <math.h>
#include <stddef.h>

/* y[s, t] = a y[s, t-1] + b x[s, t] from y[s, -1] = y0[s]; rows s at strides xs, ys (in elements). */
void first_order(const double *x, double *y, ptrdiff_t rows, ptrdiff_t length, ptrdiff_t xs, ptrdiff_t ys,
                 double a, double b, const double *y0) {
    for (ptrdiff_t s = 0; s < rows; s++) {
        const double *xr = x + s * xs;
        double *yr = y + s * ys;
        double v = y0[s];
        for (ptrdiff_t t = 0; t < length; t++) {
            v = a * v + b * xr[t];
            yr[t] = v;
        }
    }
}

/* y[s, t] = a[s, t] y[s, t-1] + b[s, t] from y[s, -1] = y0[s]; y may be b (in place). */
void linear_recurrence(const double *a, const double *b, double *y, ptrdiff_t rows, ptrdiff_t length,
                       ptrdiff_t as, ptrdiff_t bs, ptrdiff_t ys, const double *y0) {
    for (ptrdiff_t s = 0; s < rows; s++) {
        const double *ar = a + s * as;
        const double *br = b + s * bs;
        double *yr = y + s * ys;
        double v = y0[s];
        for (ptrdiff_t t = 0; t < length; t++) {
            v = ar[t] * v + br[t];
            yr[t] = v;
        }
    }
}

/* out[s, t] = (a - b) c, in float64, stored as OUT; out may be a, b or c. */
#define DIFF_TIMES(NAME, OUT)                                                                                      \
    void NAME(const double *a, const double *b, const double *c, OUT *out, ptrdiff_t rows, ptrdiff_t length,     \
              ptrdiff_t as, ptrdiff_t bs, ptrdiff_t cs, ptrdiff_t os) {                                          \
        for (ptrdiff_t s = 0; s < rows; s++)                                                                     \
            for (ptrdiff_t t = 0; t < length; t++)                                                               \
                out[s * os + t] = (OUT)((a[s * as + t] - b[s * bs + t]) * c[s * cs + t]);                        \
    }
DIFF_TIMES(diff_times_f64, double)
DIFF_TIMES(diff_times_f32, float)

/* out[s, t] = (scale num) / den, fill where den == 0, in float64, stored as OUT; out may be num or den. */
#define SAFE_DIV(NAME, OUT)                                                                                        \
    void NAME(const double *num, const double *den, OUT *out, ptrdiff_t rows, ptrdiff_t length, ptrdiff_t ns,     \
              ptrdiff_t ds, ptrdiff_t os, double fill, double scale) {                                           \
        for (ptrdiff_t s = 0; s < rows; s++)                                                                     \
            for (ptrdiff_t t = 0; t < length; t++) {                                                             \
                double d = den[s * ds + t];                                                                      \
                out[s * os + t] = d == 0.0 ? (OUT)fill : (OUT)((scale * num[s * ns + t]) / d);                   \
            }                                                                                                    \
    }
SAFE_DIV(safe_div_f64, double)
SAFE_DIV(safe_div_f32, float)

/* out[s, t] = (scale (a - b)) / (c - d), 0 where c == d (a window sum's ratio to another's, a distance over a range). */
#define DIFFERENCE_RATIO(NAME, OUT)                                                                                \
    void NAME(const double *a, const double *b, const double *c, const double *d, OUT *out, ptrdiff_t rows,      \
              ptrdiff_t length, ptrdiff_t as, ptrdiff_t bs, ptrdiff_t cs, ptrdiff_t ds, ptrdiff_t os,            \
              double scale) {                                                                                    \
        for (ptrdiff_t s = 0; s < rows; s++)                                                                     \
            for (ptrdiff_t t = 0; t < length; t++) {                                                             \
                double den = c[s * cs + t] - d[s * ds + t];                                                      \
                out[s * os + t] = den == 0.0 ? (OUT)0.0 : (OUT)((scale * (a[s * as + t] - b[s * bs + t])) / den); \
            }                                                                                                    \
    }
DIFFERENCE_RATIO(difference_ratio_f64, double)
DIFFERENCE_RATIO(difference_ratio_f32, float)

/* out[s, t] = sqrt(max((hi2 - lo2) / n - ((hi - lo) / n)^2, 0)): a population standard deviation from window sums
   of x and x^2 (NaN stays NaN, as torch's clamp keeps it). */
#define WINDOW_STD(NAME, OUT)                                                                                      \
    void NAME(const double *hi, const double *lo, const double *hi2, const double *lo2, OUT *out, ptrdiff_t rows, \
              ptrdiff_t length, ptrdiff_t hs, ptrdiff_t ls, ptrdiff_t h2s, ptrdiff_t l2s, ptrdiff_t os, double n) { \
        for (ptrdiff_t s = 0; s < rows; s++)                                                                     \
            for (ptrdiff_t t = 0; t < length; t++) {                                                             \
                double m = (hi[s * hs + t] - lo[s * ls + t]) / n;                                                \
                double v = (hi2[s * h2s + t] - lo2[s * l2s + t]) / n - m * m;                                    \
                out[s * os + t] = (OUT)sqrt(v < 0.0 ? 0.0 : v);                                                  \
            }                                                                                                    \
    }
WINDOW_STD(window_std_f64, double)
WINDOW_STD(window_std_f32, float)

/* The block-centred windows of BlockPrefix (one row per block, ref[s] its centre): mean = (hi - lo) / n + ref and,
   with sd, k sqrt(max((hi2 - lo2) / n - ((hi - lo) / n)^2, 0)) (TA-Lib's SMA and k STDDEV). Outputs contiguous. */
void block_mean(const double *hi, const double *lo, const double *ref, double *mean, ptrdiff_t rows,
                ptrdiff_t length, ptrdiff_t hs, ptrdiff_t ls, double n) {
    for (ptrdiff_t s = 0; s < rows; s++)
        for (ptrdiff_t t = 0; t < length; t++)
            mean[s * length + t] = (hi[s * hs + t] - lo[s * ls + t]) / n + ref[s];
}

void block_mean_std(const double *hi, const double *lo, const double *hi2, const double *lo2, const double *ref,
                    double *mean, double *sd, ptrdiff_t rows, ptrdiff_t length, ptrdiff_t hs, ptrdiff_t ls,
                    ptrdiff_t h2s, ptrdiff_t l2s, double n, double k) {
    for (ptrdiff_t s = 0; s < rows; s++)
        for (ptrdiff_t t = 0; t < length; t++) {
            double m = (hi[s * hs + t] - lo[s * ls + t]) / n;
            double v = (hi2[s * h2s + t] - lo2[s * l2s + t]) / n - m * m;
            sd[s * length + t] = sqrt(v < 0.0 ? 0.0 : v) * k;
            mean[s * length + t] = m + ref[s];
        }
}
"""

#: compiler flags: optimised and vectorised for this machine's CPU, strict floating point (no contraction into FMA;
#: vector and scalar IEEE division and square root round alike, so the values do not depend on the CPU); sqrt without
#: errno, so that it vectorises. Where the compiler refuses -march=native: the same without it (foxhunt.compiled).
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off")

_P, _N, _F = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_double


def _declare(lib: ctypes.CDLL) -> None:
    lib.first_order.argtypes = [_P, _P, _N, _N, _N, _N, _F, _F, _P]
    lib.first_order.restype = None
    lib.linear_recurrence.argtypes = [_P, _P, _P, _N, _N, _N, _N, _N, _P]
    lib.linear_recurrence.restype = None
    for name in ("diff_times_f64", "diff_times_f32"):
        getattr(lib, name).argtypes = [_P, _P, _P, _P, _N, _N, _N, _N, _N, _N]
        getattr(lib, name).restype = None
    for name in ("safe_div_f64", "safe_div_f32"):
        getattr(lib, name).argtypes = [_P, _P, _P, _N, _N, _N, _N, _N, _F, _F]
        getattr(lib, name).restype = None
    lib.block_mean.argtypes = [_P, _P, _P, _P, _N, _N, _N, _N, _F]
    lib.block_mean.restype = None
    lib.block_mean_std.argtypes = [_P, _P, _P, _P, _P, _P, _P, _N, _N, _N, _N, _N, _N, _F, _F]
    lib.block_mean_std.restype = None
    for name in ("difference_ratio_f64", "difference_ratio_f32", "window_std_f64", "window_std_f32"):
        getattr(lib, name).argtypes = [_P, _P, _P, _P, _P, _N, _N, _N, _N, _N, _N, _N, _F]
        getattr(lib, name).restype = None


def _self_check(lib: ctypes.CDLL) -> bool:
    """Every loop against the same arithmetic in Python or numpy, on two short rows."""
    rng = np.random.default_rng(0)
    x, a = rng.standard_normal((2, 9)), rng.uniform(0.5, 1.0, (2, 9))
    y0 = np.array([0.25, -1.0])
    want_f, want_l = np.empty_like(x), np.empty_like(x)
    for s in range(2):
        v = w = y0[s]
        for t in range(9):
            v = 0.8 * v + 0.2 * x[s, t]
            w = a[s, t] * w + x[s, t]
            want_f[s, t], want_l[s, t] = v, w
    got_f, got_l = np.empty_like(x), np.empty_like(x)
    lib.first_order(x.ctypes.data, got_f.ctypes.data, 2, 9, 9, 9, 0.8, 0.2, y0.ctypes.data)
    lib.linear_recurrence(a.ctypes.data, x.ctypes.data, got_l.ctypes.data, 2, 9, 9, 9, 9, y0.ctypes.data)
    den = np.where(a > 0.75, a, 0.0)
    got_d, got_q = np.empty((2, 9), np.float32), np.empty((2, 9), np.float32)
    lib.diff_times_f32(x.ctypes.data, a.ctypes.data, den.ctypes.data, got_d.ctypes.data, 2, 9, 9, 9, 9, 9)
    lib.safe_div_f32(x.ctypes.data, den.ctypes.data, got_q.ctypes.data, 2, 9, 9, 9, 9, 0.5, 100.0)
    got_r, got_s = np.empty((2, 9)), np.empty((2, 9))
    lib.difference_ratio_f64(x.ctypes.data, a.ctypes.data, den.ctypes.data, a.ctypes.data, got_r.ctypes.data, 2, 9,
                             9, 9, 9, 9, 9, -100.0)
    lib.window_std_f64(a.ctypes.data, x.ctypes.data, den.ctypes.data, x.ctypes.data, got_s.ctypes.data, 2, 9, 9, 9,
                       9, 9, 9, 3.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        want_q = np.where(den == 0, 0.5, 100.0 * x / den).astype(np.float32)
        want_r = np.where(den - a == 0, 0.0, (-100.0 * (x - a)) / (den - a))
        m = (a - x) / 3.0
        want_s = np.sqrt(np.maximum((den - x) / 3.0 - m * m, 0.0))
    got_m, got_sd = np.empty((2, 9)), np.empty((2, 9))
    lib.block_mean_std(a.ctypes.data, x.ctypes.data, den.ctypes.data, x.ctypes.data, y0.ctypes.data, got_m.ctypes.data,
                       got_sd.ctypes.data, 2, 9, 9, 9, 9, 9, 3.0, 2.0)
    want_m = (a - x) / 3.0 + y0[:, None]
    ok_block = np.array_equal(got_m, want_m) and np.array_equal(got_sd, want_s * 2.0)
    lib.block_mean(a.ctypes.data, x.ctypes.data, y0.ctypes.data, got_m.ctypes.data, 2, 9, 9, 9, 3.0)
    ok_block = ok_block and np.array_equal(got_m, want_m)
    return bool(ok_block and np.array_equal(got_f, want_f) and np.array_equal(got_l, want_l)
                and np.array_equal(got_d, ((x - a) * den).astype(np.float32)) and np.array_equal(got_q, want_q)
                and np.array_equal(got_r, want_r) and np.array_equal(got_s, want_s))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled loops, built or verified once per process; None (with one warning) where they cannot be had."""
    return compiled.load("features", SOURCE, FLAGS, _declare, _self_check,
                         "the CPU features run the plain torch path (the same values, slower)")


def available() -> bool:
    """Whether the compiled loops can run here."""
    return library() is not None


def _row_stride(x: np.ndarray, dtype: type = np.float64) -> int:
    """Elements between rows of a [S, T] array of ``dtype`` whose bars are contiguous (checked)."""
    size = np.dtype(dtype).itemsize
    if x.dtype != dtype or x.ndim != 2 or (x.shape[1] > 1 and x.strides[1] != size) or x.strides[0] % size:
        raise ValueError(f"the compiled loops take [S, T] {np.dtype(dtype)} rows with contiguous bars, got {x.dtype} "
                         f"{x.shape} strides {x.strides}")
    return x.strides[0] // size


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the compiled CPU loops are unavailable (see foxhunt.features.native.available)")
    return lib


def _out_kind(out: np.ndarray, *shaped: np.ndarray) -> str:
    """"f64" or "f32" by the output's dtype, after checking that every input has its shape."""
    if any(x.shape != out.shape for x in shaped):
        raise ValueError(f"shapes differ: {[x.shape for x in shaped]} and out {out.shape}")
    if out.dtype == np.float64:
        return "f64"
    if out.dtype == np.float32:
        return "f32"
    raise ValueError(f"the compiled loops write float64 or float32, not {out.dtype}")


def first_order(x: np.ndarray, a: float, b: float, y0: np.ndarray, out: np.ndarray) -> np.ndarray:
    """y[t] = a y[t-1] + b x[t] along the last axis from y[-1] = y0 (one per row), written into ``out``."""
    lib = _lib()
    if x.shape != out.shape:
        raise ValueError(f"first_order: shapes differ: x {x.shape}, out {out.shape}")
    y0 = np.ascontiguousarray(np.broadcast_to(np.asarray(y0, dtype=np.float64), (x.shape[0],)))
    lib.first_order(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], _row_stride(x), _row_stride(out),
                    float(a), float(b), y0.ctypes.data)
    return out


def linear_recurrence(a: np.ndarray, b: np.ndarray, y0: np.ndarray, out: np.ndarray) -> np.ndarray:
    """y[t] = a[t] y[t-1] + b[t] along the last axis from y[-1] = y0, written into ``out`` (which may be b)."""
    lib = _lib()
    if a.shape != b.shape or b.shape != out.shape:
        raise ValueError(f"linear_recurrence: shapes differ: a {a.shape}, b {b.shape}, out {out.shape}")
    y0 = np.ascontiguousarray(np.broadcast_to(np.asarray(y0, dtype=np.float64), (a.shape[0],)))
    lib.linear_recurrence(a.ctypes.data, b.ctypes.data, out.ctypes.data, a.shape[0], a.shape[1], _row_stride(a),
                          _row_stride(b), _row_stride(out), y0.ctypes.data)
    return out


def _elementwise(name: str, out: np.ndarray, inputs: tuple[np.ndarray, ...], *scalars: float) -> np.ndarray:
    """Run the loop ``name`` (its float64 or float32 version, by ``out``'s dtype) over [S, T] inputs of out's shape:
    the C signature (inputs, out, rows, length, each input's row stride, out's row stride, scalars)."""
    kind = _out_kind(out, *inputs)
    getattr(_lib(), f"{name}_{kind}")(*(x.ctypes.data for x in inputs), out.ctypes.data, out.shape[0], out.shape[1],
                                       *(_row_stride(x) for x in inputs), _row_stride(out, out.dtype.type),
                                       *(float(v) for v in scalars))
    return out


def diff_times(a: np.ndarray, b: np.ndarray, c: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = (a - b) c, computed in float64 and rounded once into ``out`` (float64 or float32)."""
    return _elementwise("diff_times", out, (a, b, c))


def safe_div(num: np.ndarray, den: np.ndarray, fill: float, scale: float, out: np.ndarray) -> np.ndarray:
    """out = (scale num) / den, ``fill`` where den == 0, computed in float64 and rounded once into ``out``."""
    return _elementwise("safe_div", out, (num, den), fill, scale)


def difference_ratio(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray, scale: float,
                     out: np.ndarray) -> np.ndarray:
    """out = (scale (a - b)) / (c - d), 0 where c == d, computed in float64 and rounded once into ``out``."""
    return _elementwise("difference_ratio", out, (a, b, c, d), scale)


def window_std(hi: np.ndarray, lo: np.ndarray, hi2: np.ndarray, lo2: np.ndarray, n: int,
               out: np.ndarray) -> np.ndarray:
    """out = sqrt(max((hi2 - lo2) / n - ((hi - lo) / n)^2, 0)) from window sums of x and x^2 (population std)."""
    return _elementwise("window_std", out, (hi, lo, hi2, lo2), n)


def _rows(x: np.ndarray) -> np.ndarray:
    """A [S, nb, B] block-layout view as [S nb, B] rows (no copy: a block's row follows the previous one's)."""
    S, nb, B = x.shape
    rows = x.reshape(S * nb, B)
    if not np.shares_memory(rows, x):
        raise ValueError(f"block layout {x.shape} strides {x.strides} cannot be viewed as rows")
    return rows


def block_mean(hi: np.ndarray, lo: np.ndarray, ref: np.ndarray, n: int, mean: np.ndarray) -> np.ndarray:
    """mean = (hi - lo) / n + ref on block layouts [S, nb, B] (ref [S, nb, 1]); ``mean`` contiguous float64."""
    h, lw, m = _rows(hi), _rows(lo), _rows(mean)
    _out_kind(m, h, lw)
    if not mean.flags.c_contiguous or mean.dtype != np.float64:
        raise ValueError("block_mean writes a contiguous float64 output")
    r = np.ascontiguousarray(ref.reshape(-1))
    _lib().block_mean(h.ctypes.data, lw.ctypes.data, r.ctypes.data, m.ctypes.data, m.shape[0], m.shape[1],
                      _row_stride(h), _row_stride(lw), float(n))
    return mean


def block_mean_std(hi: np.ndarray, lo: np.ndarray, hi2: np.ndarray, lo2: np.ndarray, ref: np.ndarray, n: int,
                   k: float, mean: np.ndarray, sd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`block_mean` and k population standard deviations from window sums of x and x^2, on block layouts."""
    h, lw, h2, l2, m, d = (_rows(x) for x in (hi, lo, hi2, lo2, mean, sd))
    _out_kind(m, h, lw, h2, l2, d)
    if not (mean.flags.c_contiguous and sd.flags.c_contiguous and mean.dtype == sd.dtype == np.float64):
        raise ValueError("block_mean_std writes contiguous float64 outputs")
    r = np.ascontiguousarray(ref.reshape(-1))
    _lib().block_mean_std(h.ctypes.data, lw.ctypes.data, h2.ctypes.data, l2.ctypes.data, r.ctypes.data, m.ctypes.data,
                          d.ctypes.data, m.shape[0], m.shape[1], _row_stride(h), _row_stride(lw), _row_stride(h2),
                          _row_stride(l2), float(n), float(k))
    return mean, sd
