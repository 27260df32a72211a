"""The Mamba-2 block's compiled CPU loops (foxhunt.kernels.mamba2_block) against the PyTorch paths they stand beside:
values and every gradient against the float64 step-by-step recurrence (odd lengths, several checkpoint intervals,
groups, an entering state), the whole block and forecaster against the plain block, causality, threads, NaN, the
shape check, and the fallback without the loops."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from foxhunt.kernels import mamba2_block
from foxhunt.kernels.build import compiler
from foxhunt.models.mamba2 import Mamba2Block, Mamba2Forecaster, ssd_recurrent

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler here")


def conv_and_ssd_inputs(shape: mamba2_block.BlockShape, b: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    """float64 leaves: padded rows, conv weight and bias, dt, A, D, initial state."""
    gen = torch.Generator().manual_seed(seed)
    h, p, _, n, ch, w, _ = shape

    def rand(*size: int, lo: float = -1.0, hi: float = 1.0) -> torch.Tensor:
        return (torch.rand(*size, generator=gen, dtype=torch.float64) * (hi - lo) + lo).requires_grad_()

    return [rand(b, w - 1 + length, ch, lo=-2.0, hi=2.0), rand(ch, 1, w), rand(ch),
            rand(b, length, h, lo=0.001, hi=0.3), rand(h, lo=-8.0, hi=-0.5), rand(h), rand(b, h, p, n)]


def reference(shape: mamba2_block.BlockShape, padded, weight, bias, dt, A, D, init):  # type: ignore[no-untyped-def]
    """The same computation in float64 PyTorch: conv1d + SiLU, then the recurrence step by step."""
    h, p, g, n, ch, _, _ = shape
    b, length = dt.shape[:2]
    conv = F.silu(F.conv1d(padded.transpose(1, 2), weight, bias, groups=ch)).transpose(1, 2)
    x, B, C = conv.split([h * p, g * n, g * n], -1)
    return ssd_recurrent(x.reshape(b, length, h, p), dt, A, B.reshape(b, length, g, n), C.reshape(b, length, g, n),
                         D, init)


@pytest.mark.parametrize(("shape", "length", "chunk", "tail"), [
    ((4, 3, 2, 5, 32, 4), 37, 8, None),   # two groups, an odd head width, L not a multiple of the chunk
    ((4, 3, 2, 5, 32, 4), 37, 1, None),   # a checkpoint every step
    ((4, 3, 2, 5, 32, 4), 37, 64, None),  # one chunk longer than the sequence
    ((8, 8, 1, 16, 96, 4), 50, 16, None),  # the block: one group of 8 heads
    ((2, 4, 1, 3, 14, 2), 5, 3, None),
    ((4, 3, 2, 5, 32, 4), 2, 8, None),    # fewer steps than the convolution's past
    ((4, 3, 2, 5, 32, 4), 37, 8, 11),     # only the last 11 steps' outputs, from inside a chunk
    ((8, 8, 1, 16, 96, 4), 50, 16, 1),    # the last step's only
    ((8, 8, 1, 16, 96, 4), 50, 16, 50),   # every step's, asked as a tail
])
def test_values_and_gradients_equal_the_float64_recurrence(shape, length: int, chunk: int, tail: int | None) -> None:
    shape = mamba2_block.BlockShape(*shape, 6)
    lib = mamba2_block.library(shape)
    assert lib is not None
    leaves = conv_and_ssd_inputs(shape, 3, length)
    y, final = reference(shape, *leaves)
    y = y if tail is None else y[:, length - tail :]
    gen = torch.Generator().manual_seed(1)
    gy, gf = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (y, final))
    want = [y, final, *torch.autograd.grad((y * gy).sum() + (final * gf).sum(), leaves)]
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    k = shape.d_conv - 1  # the steps before the first, as the convolution's past
    conv = mamba2_block.conv_silu(lib, f32[0][:, :k], f32[0][:, k:], *f32[1:3])
    fy, ffinal = mamba2_block.ssd(lib, shape, conv, *f32[3:], chunk=chunk, tail=tail)
    got = [fy, ffinal, *torch.autograd.grad((fy * gy.float()).sum() + (ffinal * gf.float()).sum(), f32)]
    names = ["y", "final", "padded", "weight", "bias", "dt", "A", "D", "initial"]
    for name, a, b in zip(names, got, want, strict=True):
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert err < 2e-6, f"{name}: {err:.2e} of the largest"


@pytest.mark.parametrize("gated", [False, True])
def test_norms_equal_the_float64_norm(gated: bool) -> None:
    """The residual stream's RMSNorm and the block's gated norm norm(y silu(z)) w: values and gradients."""
    shape = mamba2_block.BlockShape(4, 3, 2, 5, 32, 4, 6)
    lib = mamba2_block.library(shape)
    width = 12 if gated else 6
    gen = torch.Generator().manual_seed(2)
    leaves = [(torch.randn(3, 41, width, generator=gen, dtype=torch.float64) * 3).requires_grad_()
              for _ in range(3 if gated else 2)]
    x, z, w = leaves[0], leaves[1] if gated else None, leaves[-1][0, 0]
    ref = x * F.silu(z) if gated else x
    ref = ref * torch.rsqrt(ref.square().mean(-1, keepdim=True) + 1e-5) * w
    go = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    want = [ref, *torch.autograd.grad((ref * go).sum(), leaves)]
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    out = mamba2_block.rms_norm(lib, f32[0], f32[1] if gated else None, f32[-1][0, 0], 1e-5)
    got = [out, *torch.autograd.grad((out * go.float()).sum(), f32)]
    for a, b in zip(got, want, strict=True):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() < 2e-6
    with pytest.raises(RuntimeError, match="shape not compiled in"):
        mamba2_block.rms_norm(lib, torch.randn(2, 7), None, torch.ones(7), 1e-5)


def plain_and_native(native_first: bool = False, **kw) -> tuple[Mamba2Block, Mamba2Block]:  # type: ignore[no-untyped-def]
    args = {"d_model": 8, "d_state": 5, "d_conv": 4, "headdim": 4, "ngroups": 2, "chunk_size": 6, "bias": True}
    args.update(kw)
    torch.manual_seed(0)
    plain = Mamba2Block(**args, native=False)
    native = Mamba2Block(**args, native=True)
    native.load_state_dict(plain.state_dict())
    return plain, native


def test_block_equals_the_plain_block_from_zeros_and_from_a_state() -> None:
    """Outputs, states and every parameter gradient of the native block against the plain PyTorch block (float32),
    a prefix in one call, then two steps (fewer than the convolution's past) and the rest, each from the last state."""
    plain, native = plain_and_native()
    u = torch.randn(3, 41, 8)
    runs = []
    for m in (plain, native):
        y, state = m(u[:, :17], return_state=True)
        y2, state2 = m(u[:, 17:19], state, return_state=True)  # fewer steps than the convolution's past
        y3, state3 = m(u[:, 19:], state2, return_state=True)
        grads = torch.autograd.grad(y.square().sum() + y2.sum() + y3.sum(), list(m.parameters()))
        runs.append((y, y2, y3, state2.conv, state3.conv, state3.ssm, *grads))
    assert native.native_library(u) is not None and plain.native_library(u) is None
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5)


def test_forecaster_equals_the_plain_forecaster() -> None:
    """The whole forecaster (two blocks, the last one computing only its decoder rows) and its gradients."""
    kw = {"d_model": 16, "n_layers": 2, "headdim": 8, "d_state": 16, "chunk_size": 16}
    torch.manual_seed(0)
    plain = Mamba2Forecaster(6, [4, 5], n_symbols=2, horizon=3, native=False, **kw)
    native = Mamba2Forecaster(6, [4, 5], n_symbols=2, horizon=3, **kw)
    native.load_state_dict(plain.state_dict())
    x_past, x_future, sym = torch.randn(4, 100, 6), torch.randn(4, 3, 2), torch.tensor([0, 1, 1, 0])
    outs = []
    for net in (plain, native):
        pred = net(x_past, x_future, sym).prediction
        outs.append((pred, *torch.autograd.grad(pred.square().sum(), list(net.parameters()))))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5)


def test_threads_split_the_batch_without_changing_outputs() -> None:
    """Sequences are independent: the loops' outputs and per-sequence gradients are bit-identical on 1 and 3 threads;
    the gradients of the shared weights equal to rounding (the threads' partial sums are added in another order)."""
    shape = mamba2_block.BlockShape(4, 3, 2, 5, 32, 4, 6)
    lib = mamba2_block.library(shape)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            f32 = [t.detach().float().requires_grad_() for t in conv_and_ssd_inputs(shape, 7, 30)]
            conv = mamba2_block.conv_silu(lib, f32[0][:, :3], f32[0][:, 3:], *f32[1:3])
            y, final = mamba2_block.ssd(lib, shape, conv, *f32[3:], chunk=8)
            runs.append((y, final, *torch.autograd.grad(y.square().sum() + final.sum(), f32)))
    finally:
        torch.set_num_threads(before)
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        if i in (3, 4, 6, 7):  # conv weight, conv bias, A, D: sums over the batch
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b), i


def test_a_nan_input_reaches_the_outputs_from_its_step_on() -> None:
    """A NaN is not hidden by the loops: the outputs before its step are finite, from it on they are not (the
    member's non-finite guard then stops or skips the step)."""
    _, m = plain_and_native()
    u = torch.randn(2, 20, 8)
    u[0, 9, 3] = float("nan")
    y = m(u)
    assert torch.isfinite(y[0, :9]).all() and not torch.isfinite(y[0, 9:]).all(dim=-1).any()
    assert torch.isfinite(y[1]).all()


def test_a_tail_outside_the_sequence_is_refused() -> None:
    """The scan computes the outputs of the last 1..L steps; another tail is an error, not an empty or clipped output."""
    shape = mamba2_block.BlockShape(2, 4, 1, 3, 14, 2, 6)
    lib = mamba2_block.library(shape)
    leaves = [t.detach().float() for t in conv_and_ssd_inputs(shape, 1, 5)]
    for tail in (0, 6):
        with pytest.raises(ValueError, match="tail must be in"):
            mamba2_block.ssd(lib, shape, leaves[0][:, 1:], *leaves[3:], chunk=3, tail=tail)


def test_a_library_refuses_another_shape() -> None:
    """Each library is compiled for one block shape; called with another it raises rather than reading out of
    bounds, and a shape that cannot exist is refused before compiling."""
    shape = mamba2_block.BlockShape(4, 3, 2, 5, 32, 4, 6)
    other = mamba2_block.BlockShape(2, 4, 1, 3, 14, 2, 6)
    leaves = [t.detach().float() for t in conv_and_ssd_inputs(other, 2, 9)]
    conv = mamba2_block.conv_silu(mamba2_block.library(other), None, leaves[0][:, 1:], *leaves[1:3])
    with pytest.raises(RuntimeError, match="shape not compiled in"):
        mamba2_block.ssd(mamba2_block.library(shape), other, conv, *leaves[3:], chunk=4)
    with pytest.raises(ValueError, match="channels must be"):
        mamba2_block.library(mamba2_block.BlockShape(4, 3, 2, 5, 31, 4, 6))


def test_without_the_loops_the_block_runs_its_pytorch_path(monkeypatch) -> None:
    """``FOXHUNT_NATIVE=0`` (or no compiler): the block runs the PyTorch path, with the same outputs."""
    plain, native = plain_and_native()
    u = torch.randn(2, 25, 8)
    fast = native(u)
    monkeypatch.setenv("FOXHUNT_NATIVE", "0")
    mamba2_block.library.cache_clear()
    try:
        assert native.native_library(u) is None
        torch.testing.assert_close(native(u), plain(u), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(native(u), fast, rtol=2e-5, atol=2e-5)
    finally:
        mamba2_block.library.cache_clear()


@pytest.mark.slow
def test_torch_compile_runs_around_the_loops_without_warnings() -> None:
    """``compile_network``: torch.compile traces the forecaster and calls the loops between its graphs (they are
    marked ``torch.compiler.disable``), with the eager outputs and no warning from its tracer. ~1 min."""
    torch.manual_seed(0)
    net = Mamba2Forecaster(5, [3, 4], n_symbols=1, horizon=3, d_model=8, headdim=4, d_state=4, chunk_size=8)
    x_past, x_future, sym = torch.randn(2, 20, 5), torch.randn(2, 3, 2), torch.zeros(2, dtype=torch.long)
    eager = net(x_past, x_future, sym).prediction
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(net)(x_past, x_future, sym).prediction
        compiled.sum().backward()
    dynamo = [str(w.message)[:120] for w in caught if "_dynamo" in w.filename]  # (not torch's own deprecations)
    assert not dynamo, dynamo
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_first_use_under_inference_mode_builds_and_checks_the_library(tmp_path, monkeypatch) -> None:
    """A library first needed inside ``torch.inference_mode`` (a validation or predict step) still passes its
    self-check (which takes gradients) and is used; the forward equals the PyTorch path's."""
    monkeypatch.setenv("FOXHUNT_CACHE", str(tmp_path))
    mamba2_block.library.cache_clear()
    try:
        plain, native = plain_and_native(d_state=7)  # a shape no other test compiles
        u = torch.randn(2, 19, 8)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("error")  # no "unavailable" warning
            assert native.native_library(u) is not None
            out = native(u)
        torch.testing.assert_close(out, plain(u).detach(), rtol=2e-5, atol=2e-5)
        assert len(list((tmp_path / "native").glob("mamba2-*.so"))) == 1
    finally:
        mamba2_block.library.cache_clear()


def test_a_library_that_computes_wrongly_is_refused_and_removed(tmp_path, monkeypatch) -> None:
    """The check after loading compares every output and gradient with float64 PyTorch: a library whose scan is off
    (here its outputs half of what they should be) is refused with a warning, removed from the cache, and the block
    runs its PyTorch path."""
    monkeypatch.setenv("FOXHUNT_CACHE", str(tmp_path))
    wrong = mamba2_block.SOURCE.replace("y[g * WG + w] += c * s[w];", "y[g * WG + w] += 0.5f * c * s[w];")
    assert wrong != mamba2_block.SOURCE
    monkeypatch.setattr(mamba2_block, "SOURCE", wrong)
    mamba2_block.library.cache_clear()
    try:
        plain, native = plain_and_native(d_state=9)
        u = torch.randn(2, 19, 8)
        with pytest.warns(RuntimeWarning, match="computes wrongly"):
            assert native.native_library(u) is None
        assert not list((tmp_path / "native").glob("mamba2-*.so"))
        torch.testing.assert_close(native(u), plain(u), rtol=1e-5, atol=1e-6)
    finally:
        mamba2_block.library.cache_clear()


def test_subnormals_are_flushed_inside_the_loops_and_the_callers_mode_is_restored() -> None:
    """An adjoint that decays through many steps (the last layer's, whose output gradient is only its tail's) crosses
    into subnormal floats, which x86 cores compute in microcode at ~100x the cost: a step at 4,096 bars ran 3-4x slower
    on such a core. The loops flush them to zero (the gradient they return holds none where the float64 recurrence's
    falls in float32's subnormal range) and give the caller back its floating-point mode (torch's own products still
    make subnormals after the call)."""
    shape = mamba2_block.BlockShape(8, 8, 1, 16, 96, 4, 6)
    h, p, g, n = shape.heads, shape.headdim, shape.groups, shape.d_state
    lib = mamba2_block.library(shape)
    assert lib is not None
    b, length = 2, 700
    gen = torch.Generator().manual_seed(0)
    xbc = torch.randn(b, length, shape.channels, generator=gen, dtype=torch.float64).requires_grad_()
    dt = torch.full((b, length, h), 0.1, dtype=torch.float64)
    A = torch.full((h,), -2.0, dtype=torch.float64)  # the adjoint decays by e^-0.2 a step
    D = torch.ones(h, dtype=torch.float64)
    x, B, C = xbc.split([h * p, g * n, g * n], -1)
    y, _ = ssd_recurrent(x.reshape(b, length, h, p), dt, A, B.reshape(b, length, g, n), C.reshape(b, length, g, n),
                         D, None)
    want = torch.autograd.grad(y[:, -1].sum(), xbc)[0]
    tiny = torch.finfo(torch.float32).tiny
    assert int(((want.abs() < tiny) & (want.abs() > 1e-45)).sum()) > 100, "the setting must reach the subnormal range"
    x32 = xbc.detach().float().requires_grad_()
    fy, _ = mamba2_block.ssd(lib, shape, x32, dt.float(), A.float(), D.float(), None, chunk=16, tail=1)
    got = torch.autograd.grad(fy.sum(), x32)[0]  # the loops' own output, no torch operation after them
    subnormal = (got != 0) & (got.abs() < tiny)
    assert not bool(subnormal.any()), f"{int(subnormal.sum())} subnormal gradients"
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < 2e-6, f"the gradient is off by {err:.2e} of the largest"
    assert float(torch.tensor([1e-30]) * torch.tensor([1e-10])) != 0.0  # the caller's mode: subnormals kept
