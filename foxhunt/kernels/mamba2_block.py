"""The Mamba-2 block's CPU fast path in plain C: its causal convolution with SiLU, its SSD step by step, and its
norms (the residual stream's RMSNorm and the gated norm).

On a CPU the chunked SSD (:func:`foxhunt.models.mamba2.ssd_chunked`) spends its time in small batched products and
element-wise passes over [b, L, heads, P] tensors; the recurrence it computes,

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t    (per head; h_t [P, N])

costs 2 P N multiply-adds a step and head, which a C loop does in vector registers: the state of a group's heads is
kept as [N, R P] (the R heads sharing B and C side by side, so one step is N vector updates of R P channels) and never
leaves the cache. The forward stores the state every Q steps (Q = the block's ``chunk_size``: 1 / Q of the state a
step); the backward recomputes each chunk of Q steps from its checkpoint and runs it backwards (the adjoint
recurrence, written out in the C source). The convolution reads the W taps of a row, from the W - 1 steps before the
sequence and the sequence in place (no padded copy), and applies SiLU in one pass; its backward recomputes the row
instead of storing it. The norms are one pass each way. All are linear in L, as the chunked scan is; the block's
matrix products stay torch's.

The block's shape (heads, head width, groups, state size, convolved channels, kernel width, d_model) is compiled into
the library (one per shape, built on first use by :mod:`foxhunt.kernels.build`, cached and verified): the short loops then
unroll into registers, about x3 over the same loops with the sizes as arguments. Float32 only, with fused
multiply-adds and reassociated sums (tolerance ~1e-6 relative against the float64 recurrence, checked when the
library is loaded). The batch (or the rows, for the norms) is split over ``torch.get_num_threads()`` threads (ctypes
releases the GIL).

:class:`foxhunt.models.mamba2.Mamba2Block` runs this path on CPU tensors when ``native=True`` (the default) and the
library is available; its pure-PyTorch paths stay the reference beside it (``native=False``, CUDA, float64, no C
compiler, ``FOXHUNT_NATIVE=0``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from foxhunt.kernels import build
from foxhunt.kernels.ssd_recurrence import ssd_recurrent

SOURCE = (Path(__file__).parent / "mamba2_block.c").read_text()  # shipped beside this module as package data

#: optimised and vectorised for this CPU; fused multiply-adds, and sums that may be reassociated (so that the
#: reductions over channels vectorise); no errno and no traps. Not -ffast-math: infinities and NaN propagate as IEEE.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")

_P, _N = ctypes.c_void_p, ctypes.c_ssize_t


class BlockShape(NamedTuple):
    """What the library is compiled for: heads H, head width P, groups G, state size N, convolved channels
    (H P + 2 G N), the convolution's width W, and the residual stream's width d (its RMSNorm; the block's gated norm
    is H P wide)."""

    heads: int
    headdim: int
    groups: int
    d_state: int
    channels: int
    d_conv: int
    d_model: int


def _declare(lib: ctypes.CDLL) -> None:
    lib.conv_silu_fwd.argtypes = [_P] * 5 + [_N] * 4
    lib.conv_silu_bwd.argtypes = [_P] * 9 + [_N] * 4
    lib.ssd_fwd.argtypes = [_P] * 8 + [_N] * 8
    lib.ssd_bwd.argtypes = [_P] * 12 + [_N] * 8
    lib.norm_fwd.argtypes = [_P] * 5 + [_N] * 2 + [ctypes.c_float]
    lib.norm_bwd.argtypes = [_P] * 8 + [_N] * 2
    for f in (lib.conv_silu_fwd, lib.conv_silu_bwd, lib.ssd_fwd, lib.ssd_bwd, lib.norm_fwd, lib.norm_bwd):
        f.restype = ctypes.c_int


def _ptr(t: Tensor | None, lo: int = 0, hi: int | None = None) -> int | None:
    """The address of t[lo:hi] (a slice of the batch or of the rows), or NULL for None."""
    return None if t is None else t[lo:hi].data_ptr()


def _call(f: Callable[..., int], *args: object) -> None:
    status = f(*args)
    if status:
        raise RuntimeError(f"foxhunt's compiled Mamba-2 loop {f.__name__} failed "
                           f"({'shape not compiled in' if status == 1 else 'out of memory'})")


def _ranges(n: int) -> list[tuple[int, int]]:
    """[lo, hi) slices of n sequences (or rows), one per thread (at most torch's thread count)."""
    k = max(1, min(n, torch.get_num_threads()))
    step = -(-n // k)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _over_batch(run: Callable[[int, int, int], None], n: int) -> None:
    """run(part, lo, hi) for each of :func:`_ranges` (n), in threads when there are several."""
    parts = _ranges(n)
    if len(parts) == 1:
        run(0, *parts[0])
    else:
        with ThreadPoolExecutor(len(parts)) as pool:
            list(pool.map(lambda job: run(job[0], *job[1]), enumerate(parts)))


# ------------------------------------------------------------------------------------------------- the convolution
class _ConvSiLU(torch.autograd.Function):
    """silu(causal depthwise convolution) of channels-last rows [b, L, channels] after the W - 1 rows ``past``
    [b, W - 1, channels] (None: zeros) -> [b, L, channels]; the padded input is never built."""

    @staticmethod
    def forward(ctx, past: Tensor | None, xbc: Tensor, weight: Tensor, bias: Tensor | None,  # type: ignore[override]
                lib: ctypes.CDLL) -> Tensor:
        past = None if past is None else past.float().contiguous()
        xbc = xbc.float().contiguous()
        wt = weight.detach().float()[:, 0].t().contiguous()  # [W, channels]
        b_ = None if bias is None else bias.detach().float().contiguous()
        nb, length, ch = xbc.shape
        width = wt.shape[0]
        out = xbc.new_empty(nb, length, ch)
        _over_batch(lambda _, lo, hi: _call(lib.conv_silu_fwd, _ptr(past, lo, hi),
                                            _ptr(xbc, lo, hi), _ptr(wt), _ptr(b_), _ptr(out, lo, hi), hi - lo, length,
                                            ch, width), nb)
        ctx.save_for_backward(past, xbc, wt, b_)
        ctx.lib, ctx.param_dtype = lib, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def, override]
        past, xbc, wt, b_ = ctx.saved_tensors
        grad = grad.float().contiguous()
        nb, length, ch = xbc.shape
        width = wt.shape[0]
        g_xbc = torch.empty_like(xbc)
        g_past = None if past is None else torch.empty_like(past)
        parts = len(_ranges(nb))
        g_wt, g_b = wt.new_empty(parts, width, ch), wt.new_empty(parts, ch)
        _over_batch(lambda j, lo, hi: _call(
            ctx.lib.conv_silu_bwd, _ptr(past, lo, hi), _ptr(xbc, lo, hi), _ptr(wt), _ptr(b_),
            _ptr(grad, lo, hi), _ptr(g_past, lo, hi), _ptr(g_xbc, lo, hi), _ptr(g_wt[j]),
            _ptr(g_b[j]), hi - lo, length, ch, width), nb)
        g_w = g_wt.sum(0).t()[:, None].to(ctx.param_dtype)
        return g_past, g_xbc, g_w, None if b_ is None else g_b.sum(0).to(ctx.param_dtype), None


# ------------------------------------------------------------------------------------------------------- the SSD
class _SSD(torch.autograd.Function):
    """The SSD step by step over the convolved rows xbc [b, L, H P + 2 G N] (x, B, C), dt and decay = exp(dt A)
    [b, L, H], D [H], initial state [b, H, P, N] or None -> y [b, tail, H P] (the last ``tail`` steps' outputs),
    final state [b, H, P, N]."""

    @staticmethod
    def forward(ctx, xbc: Tensor, dt: Tensor, decay: Tensor, D: Tensor, init: Tensor | None,  # type: ignore[override]
                lib: ctypes.CDLL, shape: BlockShape, chunk: int, tail: int) -> tuple[Tensor, Tensor]:
        nb, length, _ = xbc.shape
        h, p, g, n = shape.heads, shape.headdim, shape.groups, shape.d_state
        y, final = xbc.new_empty(nb, tail, h * p), xbc.new_empty(nb, h, p, n)
        ckpt = xbc.new_empty(nb, -(-length // chunk), h * p * n)
        _over_batch(lambda _, lo, hi: _call(
            lib.ssd_fwd, _ptr(xbc, lo, hi), _ptr(dt, lo, hi), _ptr(decay, lo, hi), _ptr(D),
            _ptr(init, lo, hi), _ptr(y, lo, hi), _ptr(final, lo, hi), _ptr(ckpt, lo, hi),
            hi - lo, length, h, p, g, n, chunk, length - tail), nb)
        ctx.save_for_backward(xbc, dt, decay, D, ckpt)
        ctx.lib, ctx.shape, ctx.chunk, ctx.tail, ctx.has_init = lib, shape, chunk, tail, init is not None
        return y, final

    @staticmethod
    def backward(ctx, gy: Tensor, g_final: Tensor):  # type: ignore[no-untyped-def, override]
        xbc, dt, decay, D, ckpt = ctx.saved_tensors
        shape = ctx.shape
        h, p, g, n = shape.heads, shape.headdim, shape.groups, shape.d_state
        nb, length, _ = xbc.shape
        gy, g_final = gy.float().contiguous(), g_final.float().contiguous()  # (autograd gives zeros for unused ones)
        g_xbc, g_dt, g_decay = torch.empty_like(xbc), torch.empty_like(dt), torch.empty_like(decay)
        g_D = xbc.new_empty(len(_ranges(nb)), h)
        g_init = xbc.new_empty(nb, h, p, n) if ctx.has_init else None
        _over_batch(lambda j, lo, hi: _call(
            ctx.lib.ssd_bwd, _ptr(xbc, lo, hi), _ptr(dt, lo, hi), _ptr(decay, lo, hi), _ptr(D), _ptr(ckpt, lo, hi),
            _ptr(gy, lo, hi), _ptr(g_final, lo, hi), _ptr(g_xbc, lo, hi), _ptr(g_dt, lo, hi),
            _ptr(g_decay, lo, hi), _ptr(g_D[j]), _ptr(g_init, lo, hi),
            hi - lo, length, h, p, g, n, ctx.chunk, length - ctx.tail), nb)
        return g_xbc, g_dt, g_decay, g_D.sum(0), g_init, None, None, None, None


# ------------------------------------------------------------------------------------------------------ the norms
class _RMSNorm(torch.autograd.Function):
    """RMSNorm of the last dimension, gated by silu(z) when z is given: norm(x silu(z)) weight (float32)."""

    @staticmethod
    def forward(ctx, x: Tensor, z: Tensor | None, weight: Tensor, lib: ctypes.CDLL,  # type: ignore[override]
                eps: float) -> Tensor:
        x = x.float().contiguous()
        zf = None if z is None else z.float().contiguous()
        w = weight.detach().float().contiguous()
        width = x.shape[-1]
        rows = x.numel() // width
        out, rinv = torch.empty_like(x), x.new_empty(rows)
        x2, z2, out2 = (None if t is None else t.view(rows, width) for t in (x, zf, out))
        _over_batch(lambda _, lo, hi: _call(lib.norm_fwd, _ptr(x2, lo, hi), _ptr(z2, lo, hi), _ptr(w),
                                            _ptr(out2, lo, hi), _ptr(rinv, lo, hi), hi - lo, width, eps), rows)
        ctx.save_for_backward(x, zf, w, rinv)
        ctx.lib, ctx.dtypes = lib, (None if z is None else z.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def, override]
        x, zf, w, rinv = ctx.saved_tensors
        grad = grad.float().contiguous()
        width = x.shape[-1]
        rows = x.numel() // width
        gx, gz = torch.empty_like(x), None if zf is None else torch.empty_like(zf)
        gw = w.new_empty(len(_ranges(rows)), width)
        x2, z2, g2, gx2, gz2 = (None if t is None else t.view(rows, width) for t in (x, zf, grad, gx, gz))
        _over_batch(lambda j, lo, hi: _call(
            ctx.lib.norm_bwd, _ptr(x2, lo, hi), _ptr(z2, lo, hi), _ptr(w), _ptr(rinv, lo, hi), _ptr(g2, lo, hi),
            _ptr(gx2, lo, hi), _ptr(gz2, lo, hi), _ptr(gw[j]), hi - lo, width), rows)
        z_dtype, w_dtype = ctx.dtypes
        return gx, None if gz is None else gz.to(z_dtype), gw.sum(0).to(w_dtype), None, None


# ------------------------------------------------------------------------------------------------- the interface
@torch.compiler.disable  # foreign calls: torch.compile runs them as they are, between its graphs
def conv_silu(lib: ctypes.CDLL, past: Tensor | None, xbc: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """silu(causal depthwise convolution) in float32 of xbc [b, L, channels] after ``past`` [b, W - 1, channels]
    (the W - 1 steps before the first; None: zeros), weight [channels, 1, W], bias [channels] or None
    -> [b, L, channels]."""
    return _ConvSiLU.apply(past, xbc, weight, bias, lib)


@torch.compiler.disable  # foreign calls: torch.compile runs them as they are, between its graphs
def rms_norm(lib: ctypes.CDLL, x: Tensor, z: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of the last dimension (the residual stream's width or the block's inner width) in float32:
    norm(x) weight, or with z the block's gated norm norm(x silu(z)) weight."""
    return _RMSNorm.apply(x, z, weight, lib, eps)


@torch.compiler.disable  # foreign calls: torch.compile runs them as they are, between its graphs
def ssd(lib: ctypes.CDLL, shape: BlockShape, xbc: Tensor, dt: Tensor, A: Tensor, D: Tensor, initial: Tensor | None,
        chunk: int, tail: int | None = None) -> tuple[Tensor, Tensor]:
    """The SSD with the D skip in float32 over the convolved rows xbc [b, L, H P + 2 G N] (x, B, C), dt [b, L, H]
    (after softplus and limits), A [H] (< 0), D [H], initial state [b, H, P, N] or None; ``chunk`` steps between
    the backward's checkpoints. Returns y [b, L, H, P] (with ``tail``: the last ``tail`` steps' only, [b, tail, H, P];
    the others' outputs are not computed) and the final state [b, H, P, N]."""
    length = xbc.shape[1]
    if tail is not None and not 1 <= tail <= length:
        raise ValueError(f"tail must be in [1, {length}], got {tail}")
    dt = dt.float().contiguous()
    decay = torch.exp(dt * A.float())
    init = None if initial is None else initial.float().contiguous()
    y, final = _SSD.apply(xbc.float().contiguous(), dt, decay.contiguous(), D.float().contiguous(), init, lib, shape,
                          chunk, length if tail is None else tail)
    return y.view(*y.shape[:2], shape.heads, shape.headdim), final


def _self_check(shape: BlockShape, lib: ctypes.CDLL) -> bool:
    """The loops against autograd through float64 PyTorch on a few short sequences: values and every gradient (with
    grad mode on: the first use may come under no_grad or inference_mode)."""
    with torch.inference_mode(False), torch.enable_grad():
        gen = torch.Generator().manual_seed(0)
        h, p, g, n, ch, w, d = shape
        nb, length, chunk = 2, 11, 4

        def rand(*size: int, lo: float = -1.0, hi: float = 1.0) -> Tensor:
            return (torch.rand(*size, generator=gen, dtype=torch.float64) * (hi - lo) + lo).requires_grad_()

        padded, weight, bias = rand(nb, w - 1 + length, ch), rand(ch, 1, w), rand(ch)
        dt, A, D, init = rand(nb, length, h, lo=0.01, hi=0.5), rand(h, lo=-2.0, hi=-0.2), rand(h), rand(nb, h, p, n)
        leaves = (padded, weight, bias, dt, A, D, init)
        conv = F.silu(F.conv1d(padded.transpose(1, 2), weight, bias, groups=ch)).transpose(1, 2)
        x, B, C = conv.split([h * p, g * n, g * n], -1)
        y, final = ssd_recurrent(x.reshape(nb, length, h, p), dt, A, B.reshape(nb, length, g, n),
                                 C.reshape(nb, length, g, n), D, init)
        gy, gf = torch.randn(y.shape, generator=gen, dtype=torch.float64), torch.randn(final.shape, generator=gen,
                                                                                         dtype=torch.float64)
        want: list[Tensor] = []
        got: list[Tensor] = []
        for tail in (None, 5):  # every step's outputs, and the last steps' only (a forecaster's last layer)
            rows = slice(0 if tail is None else length - tail, length)
            want += [y[:, rows], final, *torch.autograd.grad((y[:, rows] * gy[:, rows]).sum() + (final * gf).sum(),
                                                             leaves, retain_graph=True)]
            fleaves = [t.detach().float().requires_grad_() for t in leaves]
            fconv = conv_silu(lib, fleaves[0][:, : w - 1], fleaves[0][:, w - 1 :], *fleaves[1:3])
            fy, ffinal = ssd(lib, shape, fconv, *fleaves[3:], chunk=chunk, tail=tail)
            loss = (fy * gy[:, rows].float()).sum() + (ffinal * gf.float()).sum()
            got += [fy, ffinal, *torch.autograd.grad(loss, fleaves)]
        for width, gated in ((d, False), (h * p, True)):
            xn, z, wn = rand(3, 5, width), rand(3, 5, width) if gated else None, rand(width)
            nleaves = [t for t in (xn, z, wn) if t is not None]
            ref = xn * F.silu(z) if gated else xn
            ref = ref * torch.rsqrt(ref.square().mean(-1, keepdim=True) + 1e-5) * wn
            go = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
            want += [ref, *torch.autograd.grad((ref * go).sum(), nleaves)]
            fl = [t.detach().float().requires_grad_() for t in nleaves]
            out = rms_norm(lib, fl[0], fl[1] if gated else None, fl[-1], 1e-5)
            got += [out, *torch.autograd.grad((out * go.float()).sum(), fl)]
        return all(bool((a.double() - b).abs().max() <= 1e-4 * (1.0 + b.abs().max())) for a, b in zip(got, want,
                                                                                                        strict=True))


@functools.cache
def library(shape: BlockShape) -> ctypes.CDLL | None:
    """The loops compiled for one block shape, built or verified once per process; None (one warning) where they
    cannot be had."""
    if any(not isinstance(v, int) or v < 1 for v in shape) or shape.heads % shape.groups:
        raise ValueError(f"not a block shape: {shape}")
    if shape.channels != shape.heads * shape.headdim + 2 * shape.groups * shape.d_state:
        raise ValueError(f"{shape}: channels must be heads * headdim + 2 * groups * d_state")
    names = ("SSD_H", "SSD_P", "SSD_G", "SSD_N", "CONV_C", "CONV_W", "NORM_D")
    defines = tuple(f"-D{k}={v}" for k, v in zip(names, shape, strict=True))
    return build.load("mamba2", SOURCE, FLAGS, _declare, functools.partial(_self_check, shape),
                         "the Mamba-2 blocks run their PyTorch path on the CPU (the same model, slower)", defines)


def available(shape: BlockShape) -> bool:
    """Whether the compiled loops for this block shape can run here."""
    return library(shape) is not None


__all__ = ["BlockShape", "available", "conv_silu", "library", "rms_norm", "ssd"]
