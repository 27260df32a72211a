"""AdamW whose step over float32 CPU parameters is one compiled C loop per tensor: for small networks updated
thousands of times (PPO's two flat parameters), where ``torch.optim.AdamW``'s Python around its fused kernel costs
several times the arithmetic.

:class:`CompiledAdamW` is a ``torch.optim.AdamW``: the same constructor, parameter groups, state (``step``,
``exp_avg``, ``exp_avg_sq`` per parameter, so checkpoints load into either class), schedulers and ``state_dict``. Its
:meth:`~CompiledAdamW.step` runs the loop where every parameter with a gradient is a contiguous float32 CPU tensor
with a dense gradient and the group asks for nothing else (no amsgrad, maximize, capturable or differentiable), and
otherwise, or without the library (no C compiler, ``FOXHUNT_NATIVE=0``), torch's own step. The arithmetic is
torch's (Loshchilov & Hutter): with t the step count,

    p ← p·(1 − lr·wd);  m ← m + (1 − β1)(g − m);  v ← β2·v + (1 − β2)·g²;
    p ← p − lr / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

checked against ``torch.optim.AdamW`` when the library loads and in ``tests/test_training_shared.py`` (within float32
rounding: the same operations, evaluated in another order by the compiler's vector loop).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from foxhunt import compiled

SOURCE = r"""
#include <math.h>
#include <stddef.h>

typedef ptrdiff_t I;

/* One AdamW step over n floats: step[0] += 1, then the update in the module docstring. */
void adamw_step(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                float *restrict step, I n, double lr, double beta1, double beta2, double eps, double wd) {
    const double t = (double)(step[0] += 1.0f);
    const float decay = (float)(1.0 - lr * wd);
    const float step_size = (float)(lr / (1.0 - pow(beta1, t)));
    const float inv_bc2 = (float)(1.0 / sqrt(1.0 - pow(beta2, t)));
    const float c1 = (float)(1.0 - beta1), b2 = (float)beta2, c2 = (float)(1.0 - beta2), e = (float)eps;
    for (I i = 0; i < n; i++) {
        const float gi = g[i];
        const float mi = m[i] + c1 * (gi - m[i]);
        const float vi = b2 * v[i] + c2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) * inv_bc2 + e);
    }
}
"""

# no reassociation or approximate math: the loop is torch's arithmetic; no FP traps or errno, so it vectorises
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math")

_P, _N, _D = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_double


def _declare(lib: ctypes.CDLL) -> None:
    lib.adamw_step.argtypes = [_P, _P, _P, _P, _P, _N, _D, _D, _D, _D, _D]
    lib.adamw_step.restype = None


def _self_check(lib: ctypes.CDLL) -> bool:
    """The loop against ``torch.optim.AdamW`` over five steps, with and without weight decay."""
    g = torch.Generator().manual_seed(0)
    ok = True
    for wd in (0.0, 0.05):
        p0 = torch.randn(1037, generator=g)
        grads = [torch.randn(1037, generator=g) * 0.1 for _ in range(5)]
        ref, got = p0.clone().requires_grad_(), p0.clone().requires_grad_()
        ref_opt = torch.optim.AdamW([ref], lr=3e-3, betas=(0.9, 0.999), eps=1e-5, weight_decay=wd)
        got_opt = CompiledAdamW([got], lr=3e-3, betas=(0.9, 0.999), eps=1e-5, weight_decay=wd, lib=lib)
        for grad in grads:
            ref.grad, got.grad = grad.clone(), grad.clone()
            ref_opt.step()
            if not got_opt.compiled_step():
                return False
        ok &= bool(torch.allclose(got, ref, rtol=1e-5, atol=1e-6))
        ok &= float(got_opt.state[got]["step"]) == float(ref_opt.state[ref]["step"]) == 5.0
    return ok


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled step, built or verified once per process and checked against torch's AdamW; None (one warning)
    where it cannot be had."""
    return compiled.load("adamw", SOURCE, FLAGS, _declare, _self_check, "AdamW steps in torch (the same update)")


class CompiledAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with its step over float32 CPU parameters in one compiled loop per tensor (see the module
    docstring); ``lib``: the library to use (default: :func:`library`, loaded on the first step)."""

    def __init__(self, params: Any, *args: Any, lib: ctypes.CDLL | None = None, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._lib = lib
        self._checked: dict[Tensor, tuple[Tensor, Tensor, Tensor]] = {}  # p -> its state tensors, once they fit

    def compiled_step(self) -> bool:
        """One step by the compiled loop; False (nothing changed) where it does not apply: a group asks for what the
        loop does not do (amsgrad, maximize, capturable, differentiable), or a parameter with a gradient is not a
        contiguous float32 CPU tensor with a dense contiguous float32 gradient and a state the loop can use. (No
        ``no_grad`` needed: the loop writes through data pointers, which autograd never sees.)"""
        lib = self._lib if self._lib is not None else library()
        if lib is None:
            return False
        live = []  # every check first: a step runs for all parameters or for none
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]:
                return False
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if not (p.is_cpu and p.dtype == torch.float32 and grad.dtype == torch.float32 and not grad.is_sparse
                        and p.is_contiguous() and grad.is_contiguous() and self._state_fits(p)):
                    return False
                live.append((group, p, grad))
        for group, p, grad in live:
            beta1, beta2 = group["betas"]
            state = self.state[p]
            if not state:  # AdamW's own initial state
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            lib.adamw_step(p.data_ptr(), grad.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
                           state["step"].data_ptr(), p.numel(), float(group["lr"]), beta1, beta2, float(group["eps"]),
                           float(group["weight_decay"]))
        return True

    def _state_fits(self, p: Tensor) -> bool:
        """Whether ``p``'s state (none yet, or one loaded from a checkpoint) is what the loop reads and writes."""
        state = self.state[p]
        if not state:
            return True
        step, m, v = state.get("step"), state.get("exp_avg"), state.get("exp_avg_sq")
        seen = self._checked.get(p)
        if seen is not None and seen[0] is step and seen[1] is m and seen[2] is v:
            return True  # the same tensors as checked before (a loaded state brings new ones)
        fits = (isinstance(step, Tensor) and step.dtype == torch.float32 and step.device.type == "cpu"
                and step.numel() == 1 and all(isinstance(t, Tensor) and t.dtype == torch.float32 and t.is_contiguous()
                                              and t.shape == p.shape and t.device.type == "cpu" for t in (m, v)))
        if fits:
            self._checked[p] = (step, m, v)  # type: ignore[assignment]
        return fits

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """AdamW's step: the compiled loop where it applies, else torch's."""
        if closure is None:
            loss = None
        elif torch.is_grad_enabled():  # torch's AdamW enters enable_grad; no need when it is on already
            loss = closure()
        else:
            with torch.enable_grad():
                loss = closure()
        if not self.compiled_step():
            super().step()
        return loss


__all__ = ["CompiledAdamW", "library"]
