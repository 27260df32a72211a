"""PPO's per-row loss terms and their gradients in one C loop: the fast path of
:mod:`foxhunt.models.actor_critic_fused`'s loss head, with its torch ops (``loss_head_torch`` there) the reference beside it.

Why: at a minibatch of 64 rows the head (log-softmax or the squashed Gaussian, ratio, clipped surrogate, clipped
value error, entropy, the sums, and the gradients at the actor's and the critic's outputs) is some forty tiny torch
kernels, each of which costs more in dispatch than its arithmetic; here it is one call. The formulas are the torch
head's, row by row (see the module docstring of :mod:`foxhunt.models.actor_critic_fused`); the sums accumulate in
double. The gradients are for an upstream gradient of 1: the loss is linear in it, so the backward scales them.

Built on first use by :mod:`foxhunt.compiled` (cached, verified, and checked against the torch head when loaded);
without a C compiler, or with ``FOXHUNT_NATIVE=0``, the torch head runs.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from foxhunt import compiled

SOURCE = r"""
#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef ptrdiff_t I;
static const double LOG_SQRT_2PI = 0.91893853320467274178;
static const double LOG2 = 0.69314718055994530942;

/* log(1 - tanh^2 u) = 2 (log 2 - u - softplus(-2u)), torch's softplus (linear above 20) */
static inline double tanh_log_det(double u) {
    double v = -2.0 * u;
    double sp = v > 20.0 ? v : log1p(exp(v));
    return 2.0 * (LOG2 - u - sp);
}

/* Rows i < b of a minibatch. n_act > 0: categorical over n_act logits out[i, :], actions idx[i];
   n_act == 0: squashed Gaussian with mean out[i], pre-squash samples u[i], noise[i], log std log_std.
   Row vectors are read with their strides (columns of the rollout's tables). vclip < 0: no value clipping.
   Writes parts[0..3] (policy loss, value loss, entropy, mean(mu^2)), loss[0], logratio[b], and for an upstream
   gradient of 1: d_out[b, max(n_act, 1)], d_value[b], d_log_std[0]. Returns 0, or 3 (nothing written) where an
   action index is outside [0, n_act). */
int ppo_head(I b, I n_act, const float *out, I s_out, const float *value, I s_value,
             const int64_t *idx, I s_idx, const float *u, I s_u, const float *noise, I s_noise,
             const float *old_logp, I s_olp, const float *old_value, I s_ov, const float *adv, I s_adv,
             const float *ret, I s_ret, float log_std, float clip, float vclip, float vf_coef, float ent_coef,
             float mean_reg, float *parts, float *loss, float *logratio, float *d_out, float *d_value,
             float *d_log_std) {
    const double inv_b = 1.0 / (double)b, ent = ent_coef * inv_b;
    double sum_obj = 0.0, sum_v = 0.0, sum_ent = 0.0, sum_mu2 = 0.0, sum_dls = 0.0, sum_tn = 0.0;
    const double sigma = exp((double)log_std);
    double p[n_act > 0 ? n_act : 1];  /* one row's probabilities */
    if (n_act > 0)
        for (I i = 0; i < b; i++)
            if (idx[i * s_idx] < 0 || idx[i * s_idx] >= n_act) return 3;
    for (I i = 0; i < b; i++) {
        const double v = value[i * s_value], R = ret[i * s_ret], A = adv[i * s_adv];
        double log_prob, entropy;
        const float *o = out + i * s_out;
        double z = 0.0, y = 0.0, e = 0.0, lse = 0.0;
        if (n_act > 0) {
            double mx = o[0];
            for (I j = 1; j < n_act; j++) mx = o[j] > mx ? o[j] : mx;
            double se = 0.0;
            for (I j = 0; j < n_act; j++) se += (p[j] = exp(o[j] - mx));
            lse = mx + log(se);
            const double inv_se = 1.0 / se;
            double neg_h = 0.0;
            for (I j = 0; j < n_act; j++) { p[j] *= inv_se; neg_h += p[j] * (o[j] - lse); }  /* p = softmax */
            log_prob = o[idx[i * s_idx]] - lse;
            entropy = -neg_h;
        } else {
            const double mu = o[0];
            z = (u[i * s_u] - mu) / sigma;
            log_prob = -(log_std + 0.5 * z * z) - LOG_SQRT_2PI - tanh_log_det(u[i * s_u]);
            e = noise[i * s_noise];
            y = mu + sigma * e;
            entropy = tanh_log_det(y) + log_std + 0.5 + LOG_SQRT_2PI;
            sum_mu2 += mu * mu;
        }
        const double lr = log_prob - old_logp[i * s_olp], ratio = exp(lr);
        const double rc = ratio < 1.0 - clip ? 1.0 - clip : (ratio > 1.0 + clip ? 1.0 + clip : ratio);
        const double s = A * ratio, sc = A * rc;
        sum_obj += s < sc ? s : sc;
        const double d_logp = (s > sc ? 0.0 : -s) * inv_b;  /* d loss / d log pi */
        const double err = v - R;
        double g_value = err;
        if (vclip < 0.0f) {
            sum_v += err * err;
        } else {
            const double ov = old_value[i * s_ov], moved = v - ov;
            const double mc = moved < -vclip ? -vclip : (moved > vclip ? vclip : moved);
            const double err_c = (ov - R) + mc, sq = err * err, sq_c = err_c * err_c;
            sum_v += sq > sq_c ? sq : sq_c;
            if (sq < sq_c && fabs(moved) > vclip) g_value = 0.0;
        }
        sum_ent += entropy;
        logratio[i] = (float)lr;
        d_value[i] = (float)(g_value * inv_b * vf_coef);
        if (n_act > 0) {
            /* d log pi(a)/dz = onehot(a) - p; dH/dz = -p (log p + H) */
            const I a = idx[i * s_idx];
            float *d = d_out + i * n_act;
            const double neg_h = -entropy;
            for (I j = 0; j < n_act; j++)
                d[j] = (float)(((o[j] - lse - neg_h) * ent - d_logp) * p[j] + (j == a ? d_logp : 0.0));
        } else {
            const double t = tanh(y), mu = o[0];
            double d = d_logp * z / sigma + 2.0 * ent * t;
            if (mean_reg > 0.0f) d += mu * inv_b * 2.0 * mean_reg;
            d_out[i] = (float)d;
            sum_dls += d_logp * (z * z - 1.0);
            sum_tn += t * e;
        }
    }
    parts[0] = (float)(-sum_obj * inv_b);
    parts[1] = (float)(0.5 * sum_v * inv_b);
    parts[2] = (float)(sum_ent * inv_b);
    parts[3] = (float)(sum_mu2 * inv_b);
    double total = -sum_obj * inv_b + vf_coef * 0.5 * sum_v * inv_b - ent_coef * sum_ent * inv_b;
    if (n_act == 0 && mean_reg > 0.0f) total += mean_reg * sum_mu2 * inv_b;
    loss[0] = (float)total;
    d_log_std[0] = n_act > 0 ? 0.0f : (float)(sum_dls - ent * ((double)b - 2.0 * sum_tn * sigma));
    return 0;
}

/* The towers' activation, in place: x = tanh(x) as x P(x^2) / Q(x^2), a rational fit on |x| <= 7.9053 (beyond it
   tanh rounds to +-1 in float32), within 4e-7 of tanh everywhere (2.8e-7 with fused multiply-adds; checked on
   load); a NaN stays NaN, so a broken weight still reaches the guard. A straight loop of multiply-adds and one
   division that the compiler vectorises, where torch's CPU tanh (or its sigmoid) costs several times more per
   element on some cores. */
void tanh_inplace(float *restrict x, I n) {
    const float lim = 7.90531110763549805f;
    for (I i = 0; i < n; i++) {
        float v = x[i];
        v = v < -lim ? -lim : v;
        v = v > lim ? lim : v;
        const float v2 = v * v;
        float p = -2.76076847742355e-16f;
        p = p * v2 + 2.00018790482477e-13f;
        p = p * v2 - 8.60467152213735e-11f;
        p = p * v2 + 5.12229709037114e-08f;
        p = p * v2 + 1.48572235717979e-05f;
        p = p * v2 + 6.37261928875436e-04f;
        p = p * v2 + 4.89352455891786e-03f;
        float q = 1.19825839466702e-06f;
        q = q * v2 + 1.18534705686654e-04f;
        q = q * v2 + 2.26843463243900e-03f;
        q = q * v2 + 4.89352518554385e-03f;
        x[i] = v * p / q;
    }
}

/* its backward, in place, for the towers' layers stacked [t, b, n_h] (actor rows, then critic rows): delta *= 1 - h^2,
   with h = tanh(a) the layer's output, also writing d_b [t, n_h], the scaled delta summed over rows (the layer's bias
   gradients): one pass instead of two. */
void tanh_backward_sum(float *restrict delta, const float *restrict h, I t, I b, I n_h, float *restrict d_b) {
    for (I k = 0; k < t; k++) {
        float *restrict s = d_b + k * n_h;
        for (I j = 0; j < n_h; j++) s[j] = 0.0f;
        for (I i = 0; i < b; i++) {
            float *restrict d = delta + (k * b + i) * n_h;
            const float *restrict hi = h + (k * b + i) * n_h;
            for (I j = 0; j < n_h; j++) {
                d[j] *= 1.0f - hi[j] * hi[j];
                s[j] += d[j];
            }
        }
    }
}

/* x . w over n floats in 32 independent partial sums added in a fixed order: vectorised without reassociating,
   and enough independent chains that the multiply-adds' latency does not bound a 64-wide dot */
static inline float dot32(const float *restrict x, const float *restrict w, I n) {
    float acc[32] = {0.0f};
    I j = 0;
    for (; j + 32 <= n; j += 32)
        for (int k = 0; k < 32; k++) acc[k] += x[j + k] * w[j + k];
    for (int k = 0; k < 16; k++) acc[k] += acc[k + 16];
    for (int k = 0; k < 8; k++) acc[k] += acc[k + 8];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; j < n; j++) s += x[j] * w[j];
    return s;
}

/* The two heads on the towers' last activations h [2, b, n_h] (actor rows, then critic rows): out [b, n_out] =
   h_actor w_a^T + b_a, value [b] = h_critic w_c^T + b_c. Two products too narrow (n_out = 3 and 1 columns) for a
   BLAS call to pay for its setup. */
void ppo_heads_forward(I b, I n_h, I n_out, const float *restrict h, const float *restrict w_a,
                       const float *restrict b_a, const float *restrict w_c, const float *restrict b_c,
                       float *restrict out, float *restrict value) {
    const float *h_c = h + b * n_h;
    for (I i = 0; i < b; i++) {
        for (I a = 0; a < n_out; a++) out[i * n_out + a] = b_a[a] + dot32(h + i * n_h, w_a + a * n_h, n_h);
        value[i] = b_c[0] + dot32(h_c + i * n_h, w_c, n_h);
    }
}

/* Their backward from d_out [b, n_out] and d_value [b]: the heads' gradients d_w_a [n_out, n_h], d_b_a [n_out],
   d_w_c [n_h], d_b_c [1]; delta [2, b, n_h], the gradient at the last tower layer's pre-activations (back through
   the heads and its tanh: times 1 - h^2); and d_b [2, n_h], delta summed over rows (that layer's bias gradients). */
void ppo_heads_backward(I b, I n_h, I n_out, const float *restrict h, const float *restrict d_out,
                        const float *restrict d_value, const float *restrict w_a, const float *restrict w_c,
                        float *restrict d_w_a, float *restrict d_b_a, float *restrict d_w_c, float *restrict d_b_c,
                        float *restrict delta, float *restrict d_b) {
    const float *h_c = h + b * n_h;
    float *delta_c = delta + b * n_h;
    double sum_c = 0.0, sum_a[n_out];
    for (I a = 0; a < n_out; a++) sum_a[a] = 0.0;
    for (I j = 0; j < n_out * n_h; j++) d_w_a[j] = 0.0f;
    for (I j = 0; j < n_h; j++) d_w_c[j] = 0.0f;
    for (I j = 0; j < 2 * n_h; j++) d_b[j] = 0.0f;
    for (I i = 0; i < b; i++) {
        const float *restrict ha = h + i * n_h, *restrict hc = h_c + i * n_h;
        float *restrict da = delta + i * n_h, *restrict dc = delta_c + i * n_h;
        const float dv = d_value[i];
        sum_c += dv;
        for (I j = 0; j < n_h; j++) {
            d_w_c[j] += dv * hc[j];
            dc[j] = dv * w_c[j] * (1.0f - hc[j] * hc[j]);
            d_b[n_h + j] += dc[j];
            da[j] = 0.0f;
        }
        for (I a = 0; a < n_out; a++) {
            const float g = d_out[i * n_out + a];
            const float *restrict wa = w_a + a * n_h;
            float *restrict dwa = d_w_a + a * n_h;
            sum_a[a] += g;
            for (I j = 0; j < n_h; j++) {
                dwa[j] += g * ha[j];
                da[j] += g * wa[j];
            }
        }
        for (I j = 0; j < n_h; j++) {
            da[j] *= 1.0f - ha[j] * ha[j];
            d_b[j] += da[j];
        }
    }
    for (I a = 0; a < n_out; a++) d_b_a[a] = (float)sum_a[a];
    d_b_c[0] = (float)sum_c;
}
"""

# exact libm functions, no reassociation (the head is a few hundred operations, its cost is the call); no FP traps,
# so the activation's clamps become vector min/max and its loop vectorises (results as without: nothing here traps)
FLAGS = ("-O3", "-march=native", "-fno-trapping-math")

_P, _N, _F = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> None:
    lib.ppo_head.argtypes = [_N, _N] + [_P, _N] * 9 + [_F] * 6 + [_P] * 6
    lib.ppo_head.restype = ctypes.c_int
    lib.tanh_inplace.argtypes = [_P, _N]
    lib.tanh_inplace.restype = None
    lib.tanh_backward_sum.argtypes = [_P, _P, _N, _N, _N, _P]
    lib.tanh_backward_sum.restype = None
    lib.ppo_heads_forward.argtypes = [_N, _N, _N] + [_P] * 7
    lib.ppo_heads_forward.restype = None
    lib.ppo_heads_backward.argtypes = [_N, _N, _N] + [_P] * 11
    lib.ppo_heads_backward.restype = None


def flat_cpu(*tensors: Tensor) -> bool:
    """Whether every tensor is a contiguous float32 CPU tensor (what the loops read and write)."""
    return all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def tanh_(lib: ctypes.CDLL, x: Tensor, checked: bool = False) -> Tensor:
    """``x`` = tanh(``x``) in place by the compiled loop (torch's ``tanh_`` where ``x`` is not a contiguous float32
    CPU tensor; ``checked``: the caller knows it is, e.g. a product's fresh output from float32 CPU operands)."""
    if not checked and not flat_cpu(x):
        return x.tanh_()
    lib.tanh_inplace(x.data_ptr(), x.numel())
    return x


def tanh_backward_sum_(lib: ctypes.CDLL, delta: Tensor, h: Tensor) -> Tensor:
    """``delta`` *= 1 − ``h``² in place for stacked layers [t, b, n_h] (contiguous float32 CPU tensors of one shape,
    as the caller guarantees), and [t, n_h] their sums over rows (the layers' bias gradients)."""
    t, b, n_h = delta.shape
    d_b = torch.empty(t, n_h, dtype=torch.float32)
    lib.tanh_backward_sum(delta.data_ptr(), h.data_ptr(), t, b, n_h, d_b.data_ptr())
    return d_b


def heads_forward(lib: ctypes.CDLL, h: Tensor, w_a: Tensor, b_a: Tensor, w_c: Tensor, b_c: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """(out [b, A], value [b, 1]): the actor's and the critic's heads on the towers' last activations ``h``
    [2, b, n_h], with weights ``w_a`` [A, n_h], ``w_c`` [1, n_h] and biases (contiguous float32 CPU tensors, as the
    caller guarantees)."""
    _, b, n_h = h.shape
    n_out = w_a.shape[0]
    buf = torch.empty(b * (n_out + 1), dtype=torch.float32)
    out, value = buf.split_with_sizes([b * n_out, b])
    lib.ppo_heads_forward(b, n_h, n_out, h.data_ptr(), w_a.data_ptr(), b_a.data_ptr(), w_c.data_ptr(), b_c.data_ptr(),
                          out.data_ptr(), value.data_ptr())
    return out.view(b, n_out), value.view(b, 1)


def heads_backward(lib: ctypes.CDLL, h: Tensor, d_out: Tensor, d_value: Tensor, w_a: Tensor, w_c: Tensor
                   ) -> tuple[list[Tensor], Tensor, Tensor]:
    """([d w_a, d b_a, d w_c, d b_c], delta [2, b, n_h], d_b [2, n_h]): the heads' gradients from ``d_out`` [b, A]
    and ``d_value`` [b, 1], the gradient at the last tower layer's pre-activations (through its tanh), and that
    layer's bias gradients (contiguous float32 CPU tensors, as the caller guarantees)."""
    _, b, n_h = h.shape
    n_out = w_a.shape[0]
    sizes = [n_out * n_h, n_out, n_h, 1, 2 * b * n_h, 2 * n_h]
    d_w_a, d_b_a, d_w_c, d_b_c, delta, d_b = torch.empty(sum(sizes), dtype=torch.float32).split_with_sizes(sizes)
    lib.ppo_heads_backward(b, n_h, n_out, h.data_ptr(), d_out.data_ptr(), d_value.data_ptr(), w_a.data_ptr(),
                           w_c.data_ptr(), d_w_a.data_ptr(), d_b_a.data_ptr(), d_w_c.data_ptr(), d_b_c.data_ptr(),
                           delta.data_ptr(), d_b.data_ptr())
    return [d_w_a.view(n_out, n_h), d_b_a, d_w_c.view(1, n_h), d_b_c], delta.view(2, b, n_h), d_b.view(2, n_h)


@functools.cache
def library(self_check: Callable[[ctypes.CDLL], bool]) -> ctypes.CDLL | None:
    """The compiled head, built or verified once per process and checked by ``self_check`` (the caller's comparison
    with its torch head); None (one warning) where it cannot be had."""
    return compiled.load("ppo_head", SOURCE, FLAGS, _declare, self_check,
                         "PPO's fused loss computes its head with torch ops (the same loss, slower)")


_ROW_DTYPES = (torch.float32, torch.int64)


def usable(out: Tensor, *rows: Tensor) -> bool:
    """Whether the C head can read these tensors: float32 (int64 action indices) on the CPU, actor output rows
    contiguous, every row vector one-dimensional."""
    if not out.is_cpu or out.dtype != torch.float32 or out.dim() != 2 or out.stride(1) != 1:
        return False
    return all(r.is_cpu and r.dim() == 1 and r.dtype in _ROW_DTYPES for r in rows)


def head(lib: ctypes.CDLL, out: Tensor, value: Tensor, actions: Tensor, noise: Tensor, old_log_probs: Tensor,
         old_values: Tensor, advantages: Tensor, returns: Tensor, log_std: float, clip: float, vclip: float | None,
         vf_coef: float, ent_coef: float, mean_reg: float
         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, parts [4], logratio [b], d_out [b, A], d_value [b, 1], d_log_std [1]) of a minibatch, the gradients
    for an upstream gradient of 1; ``out`` [b, A] logits (``actions`` int64 indices) or [b, 1] Gaussian means
    (``actions`` the float pre-squash samples); see the C source for the rest."""
    b, n_out = out.shape
    discrete = actions.dtype == torch.int64
    buf = torch.empty(b * (n_out + 2) + 6, dtype=torch.float32)
    base, f = buf.data_ptr(), 4
    at_value, at_ratio, at_tail = b * n_out, b * (n_out + 1), b * (n_out + 2)
    status = lib.ppo_head(
        b, n_out if discrete else 0, out.data_ptr(), out.stride(0), value.data_ptr(), value.stride(0),
        actions.data_ptr() if discrete else None, actions.stride(0),
        None if discrete else actions.data_ptr(), actions.stride(0), noise.data_ptr(), noise.stride(0),
        old_log_probs.data_ptr(), old_log_probs.stride(0), old_values.data_ptr(), old_values.stride(0),
        advantages.data_ptr(), advantages.stride(0), returns.data_ptr(), returns.stride(0),
        log_std, clip, -1.0 if vclip is None else vclip, vf_coef, ent_coef, mean_reg,
        base + f * at_tail, base + f * (at_tail + 4), base + f * at_ratio, base, base + f * at_value,
        base + f * (at_tail + 5),
    )
    if status == 3:
        raise ValueError(f"PPO loss: an action index is outside [0, {n_out}) (a corrupted rollout or checkpoint?)")
    if status:
        raise RuntimeError(f"foxhunt's compiled PPO head failed (status {status})")
    d_out, d_value, logratio, parts, loss, d_log_std = buf.split_with_sizes([at_value, b, b, 4, 1, 1])
    return loss.view(()), parts, logratio, d_out.view(b, n_out), d_value.view(b, 1), d_log_std


__all__ = ["flat_cpu", "head", "heads_backward", "heads_forward", "library", "tanh_", "tanh_backward_sum_",
           "usable"]
