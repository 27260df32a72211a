"""PPO's minibatch loss on the :class:`~foxhunt.models.actor_critic.ActorCritic` with a hand-written backward: the fast
path beside the plain autograd one (``PPOModule(fused_loss=...)``), tested equal to it in ``tests/test_ppo.py``.

Why: at CleanRL's and Stable-Baselines3's minibatch of 64 rows, an update of two small tanh MLPs is a few dozen tiny
kernels, and on a CPU the autograd engine's bookkeeping (recording the graph, scheduling some forty backward nodes,
accumulating a gradient per parameter tensor) costs more than the arithmetic. Here the forward runs without recording, keeps the
activations, and one backward node computes every parameter's gradient by the chain rule written out:

- actor (logits z, or the Gaussian's mean μ) and critic (value v) are tanh MLPs, ``a_l = h_{l-1} W_lᵀ + b_l``,
  ``h_l = tanh(a_l)``: ``dW_l = δ_lᵀ h_{l-1}``, ``db_l = Σ δ_l``, ``δ_{l-1} = (δ_l W_l) ⊙ (1 − h_{l-1}²)``;
- the clipped surrogate ``mean(max(−Â·ρ, −Â·clip(ρ, 1 ± ε)))`` passes ``−Â/B`` to ρ where the unclipped term is the
  larger one or ρ is inside the clip range (torch's ``clamp`` passes no gradient outside it), else nothing, and
  ``dρ = ρ · d log π``;
- categorical: ``d log π(a)/dz = onehot(a) − p``, ``dH/dz = −p ⊙ (log p + H)``;
- squashed Gaussian (u stored, μ = actor output, state-independent log σ): ``d log π/dμ = (u − μ)/σ²``,
  ``d log π/d log σ = ((u − μ)/σ)² − 1``; the one-sample entropy ``H = ½ + log√(2π) + log σ + log(1 − tanh²(y))``,
  y = μ + σ·noise, has ``dH/dμ = −2 tanh(y)`` and ``dH/d log σ = 1 − 2 tanh(y)·σ·noise``;
- the (clipped) value loss ``½·mean(max((v − R)², (v_old + clip(v − v_old, ±ε) − R)²))`` passes ``(v − R)/B`` where
  the unclipped error is the larger, else ``(v_c − R)/B`` where v is inside the clip range.

The loss head (everything after the two networks' outputs: the terms above, their sums, and the gradients at the
outputs, taken in the forward for an upstream gradient of 1, which the backward then scales) runs as one compiled C
call (:mod:`foxhunt.models.ppo_loss_native`, ``PPOModule(native_loss=True)``) where a C compiler is available, and
as :func:`loss_head_torch`, its reference, elsewhere; the two are checked equal when the library loads and in
``tests/test_ppo.py``. At a minibatch of 64 the head in torch ops is some forty kernel calls, about 40% of an update.
The same library also runs the towers' tanh and its backward (a vectorised rational fit, within 4e-7 of tanh); the
torch form, 2σ(2a) − 1, stays beside it as the reference.

Float32 only: under autocast (mixed precision) :class:`PPOModule` uses the plain path.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from foxhunt.models import ppo_loss_native
from foxhunt.models.actor_critic import LOG_SQRT_2PI, ActorCritic, tanh_log_det


def _float32_cpu(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)


def _forward(x: Tensor, tower: tuple[Tensor, ...], heads: tuple[Tensor, Tensor, Tensor, Tensor],
             lib: ctypes.CDLL | None = None) -> list[Tensor]:
    """[h_1, ..., h_L, actor output, value]: the towers' activations [2, B, H_l] (both networks in one batched
    product per layer, (W_1, b_1, ..., W_L, b_L) of [2, out, in] and [2, out]) and the heads' outputs; the tanh by
    the compiled loop of ``lib`` (:func:`~foxhunt.models.ppo_loss_native.tanh_`), else in torch ops."""
    n = len(tower) // 2
    acts: list[Tensor] = []
    h = x.expand(2, *x.shape)
    lib = lib if _float32_cpu(x, *tower) else None  # then every product below is a fresh float32 CPU tensor
    for i in range(n):
        if lib is not None:
            h = ppo_loss_native.tanh_(lib, torch.baddbmm(tower[2 * i + 1].unsqueeze(1), h, tower[2 * i].transpose(1, 2)),
                                      checked=True)
        else:
            # tanh(a) = 2·σ(2a) − 1, the 2a from the product's own scalars: torch's CPU tanh cost about four sigmoids
            # on the machine this was written on (on an AVX-512 core tanh_ was faster per op but end to end within
            # noise; on an AVX2 Zen core the sigmoid form is the faster one; docs/PPO.md)
            h = torch.baddbmm(tower[2 * i + 1].unsqueeze(1), h, tower[2 * i].transpose(1, 2), beta=2.0, alpha=2.0)
            h = h.sigmoid_().mul_(2.0).sub_(1.0)
        acts.append(h)
    w_a, b_a, w_c, b_c = heads
    if lib is not None:  # the two narrow head products in one compiled call
        acts.extend(ppo_loss_native.heads_forward(lib, h, w_a, b_a, w_c, b_c))
    else:
        acts.append(torch.addmm(b_a, h[0], w_a.t()))
        acts.append(torch.addmm(b_c, h[1], w_c.t()))
    return acts


def _backward(delta_a: Tensor, delta_c: Tensor, x: Tensor, acts: list[Tensor], tower: tuple[Tensor, ...],
              heads: tuple[Tensor, Tensor, Tensor, Tensor], lib: ctypes.CDLL | None = None) -> list[Tensor]:
    """Gradients (dW_1, db_1, ..., dW_L, db_L, dW_actor, db_actor, dW_critic, db_critic) from δ at the actor's and the
    critic's outputs: heads, then both towers at once, ``δ_{l-1} = (δ_l W_l) ⊙ (1 − h_{l-1}²)``."""
    n = len(tower) // 2
    w_a, _, w_c, _ = heads
    h = acts[n - 1]
    lib = lib if _float32_cpu(delta_a, delta_c, *tower) else None  # then every δ below is a fresh float32 CPU tensor
    # delta: the gradient at the top layer's pre-activations a_L [2, B, H_L], through h_L = tanh(a_L); d_b: its sum
    if lib is not None:  # heads, their backward and the tanh's in one compiled call
        head_grads, delta, d_b = ppo_loss_native.heads_backward(lib, h, delta_a.contiguous(), delta_c.contiguous(),
                                                                w_a, w_c)
    else:
        head_grads = [delta_a.t().mm(h[0]), delta_a.sum(0), delta_c.t().mm(h[1]), delta_c.sum(0)]
        delta = torch.ops.aten.tanh_backward(torch.stack([delta_a.mm(w_a), delta_c.mm(w_c)]), h)
        d_b = delta.sum(1)
    grads: list[Tensor] = [delta] * (2 * n)
    for i in range(n - 1, -1, -1):
        h_in = acts[i - 1] if i > 0 else x.expand(2, *x.shape)
        grads[2 * i] = torch.bmm(delta.transpose(1, 2), h_in)
        grads[2 * i + 1] = d_b
        if i > 0:  # through h_{i-1} = tanh(a_{i-1}) (the compiled loop scales the fresh product in place and sums it)
            delta = torch.bmm(delta, tower[2 * i])
            if lib is not None:
                d_b = ppo_loss_native.tanh_backward_sum_(lib, delta, acts[i - 1])
            else:
                delta = torch.ops.aten.tanh_backward(delta, acts[i - 1])
                d_b = delta.sum(1)
    return grads + head_grads


def loss_head_torch(
    out: Tensor, value: Tensor, actions: Tensor, noise: Tensor, old_log_probs: Tensor, old_values: Tensor,
    advantages: Tensor, returns: Tensor, log_std: Tensor | None, clip_coef: float, vclip: float | None,
    vf_coef: float, ent_coef: float, mean_reg: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The loss head in torch ops (the reference of :mod:`foxhunt.models.ppo_loss_native`): from the actor's output
    ``out`` [B, A] (logits, or the Gaussian's mean [B, 1] when ``log_std`` is given) and the critic's ``value`` [B],
    (loss, parts (policy loss, value loss, entropy[, mean(μ²)]), logratio, d loss/d out, d loss/d value [B, 1],
    d loss/d log σ) for an upstream gradient of 1. Written for few kernel calls: the per-row terms are stacked and
    reduced once, the loss is one dot product with their coefficients, masks select by ``masked_fill``."""
    b = out.shape[0]
    scale = 1.0 / b
    continuous = log_std is not None
    if continuous:
        std = log_std.exp()
        mean = out.view(-1)
        z = (actions - mean).div_(std)  # (u − μ)/σ
        # log N(u; μ, σ) − log(1 − tanh² u): the Jacobian term is the old policy's too, so only the Gaussian part
        # enters the ratio; it is still computed for the logged log-ratio to equal the plain path's
        log_prob = torch.add(log_std, z * z, alpha=0.5).neg_().sub_(LOG_SQRT_2PI + 0.0).sub_(tanh_log_det(actions))
        y = torch.addcmul(mean, std, noise)  # μ + σ·noise
        entropy = tanh_log_det(y).add_(log_std).add_(0.5 + LOG_SQRT_2PI)
        ent_sign = 1.0  # the entropy row is H itself
    else:
        logp = torch.log_softmax(out, 1)
        log_prob = logp.gather(1, actions.view(-1, 1)).view(-1)
        p = logp.exp()
        entropy = (p * logp).sum(1)  # −H: the sign goes into the row's scale
        ent_sign = -1.0
    logratio = log_prob - old_log_probs
    ratio = logratio.exp()
    surrogate = advantages * ratio  # the objective is min(Â·ρ, Â·clip(ρ)); its gradient reaches ρ where Â·ρ is it
    surrogate_clipped = advantages * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef)
    objective = torch.minimum(surrogate, surrogate_clipped)
    # d loss/d log π = −Â·ρ/B where the unclipped term is the minimum, else 0
    d_logp = surrogate.masked_fill(surrogate > surrogate_clipped, 0.0).mul_(-scale)
    err = value - returns
    if vclip is None:
        v_rows = err.square()
        g_value = err
    else:
        moved = value - old_values
        err_c = (old_values - returns).add_(moved.clamp(-vclip, vclip))
        sq, sq_c = err.square(), err_c.square()
        v_rows = torch.maximum(sq, sq_c)
        # where the clipped error is the larger and v moved past the clip, no gradient; inside the clip the two
        # errors are equal (to rounding) and so are their gradients
        g_value = err.masked_fill((sq < sq_c) & (moved.abs() > vclip), 0.0)
    rows = [objective, v_rows, entropy]
    row_scale = [-scale, 0.5 * scale, ent_sign * scale]  # row sums to (policy loss, value loss, entropy, mean(μ²))
    weight = [1.0, vf_coef, -ent_coef]  # the loss's coefficients of those
    if continuous and mean_reg > 0:
        rows.append(mean.square())  # the pre-squash mean's penalty
        row_scale.append(scale)
        weight.append(mean_reg)
    coef = torch.tensor([row_scale, weight], dtype=out.dtype, device=out.device)
    parts = torch.stack(rows).sum(1).mul_(coef[0])
    loss = torch.dot(parts, coef[1])
    d_value = g_value.mul(scale * vf_coef).view(-1, 1)
    ent = scale * ent_coef  # d loss / dH_i = −ent_coef/B
    if continuous:
        t = torch.tanh(y)
        # d log π/dμ = z/σ; dH/dμ = −2 tanh(y): d loss/dμ = d_logp·z/σ + 2·ent·tanh(y)
        d_out = (d_logp * z / std).add_(t, alpha=2.0 * ent)
        if mean_reg > 0:
            d_out = d_out.add_(mean * (scale * 2.0 * mean_reg))  # d(β·mean(μ²))/dμ = 2βμ/B
        # d log π/d log σ = z² − 1; dH/d log σ = 1 − 2 tanh(y)·σ·noise
        d_log_std = ((d_logp * (z * z - 1.0)).sum() - ent * (b - 2.0 * (t * noise).sum() * std)).view(1)
        return loss, parts, logratio, d_out.view(-1, 1), d_value, d_log_std
    # d log π(a)/dz = onehot(a) − p; dH/dz = −p ⊙ (log p + H)
    d_out = (logp - entropy.view(-1, 1)).mul_(ent).sub_(d_logp.view(-1, 1)).mul_(p)
    d_out.scatter_add_(1, actions.view(-1, 1), d_logp.view(-1, 1))
    return loss, parts, logratio, d_out, d_value, None


def _native_self_check(lib: ctypes.CDLL) -> bool:
    """:func:`_native_checks` in float32 and outside any autocast region, whatever the caller's settings: the library
    is first needed inside a training step, which may run under mixed precision (its reference products in bfloat16
    would fail the comparison, and the library would be refused for the whole process)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.autocast("cpu", enabled=False), torch.no_grad():
            return _native_checks(lib)
    finally:
        torch.set_default_dtype(dtype)


def _native_checks(lib: ctypes.CDLL) -> bool:
    """The compiled head against :func:`loss_head_torch` on random minibatches of both policies, with and without
    value clipping and the mean penalty, on strided row vectors like the rollout's; the heads and the tanh loops
    against torch's ops."""
    g = torch.Generator().manual_seed(0)
    ok = True
    for n_act, vclip, mean_reg in ((3, 0.2, 0.0), (5, None, 0.0), (0, 0.2, 0.3), (0, None, 0.0)):
        b = 37
        table = torch.randn(b, 8, generator=g)
        rows = table.unbind(1)  # strided columns
        out = torch.randn(b, max(n_act, 1), generator=g) * 2.0
        value = rows[0] * 0.5 + 0.1 * torch.randn(b, generator=g)
        if n_act:
            actions = torch.randint(0, n_act, (b, 2), generator=g)[:, 0]
            old = torch.log_softmax(out + 0.3 * torch.randn(out.shape, generator=g), 1).gather(1, actions.view(-1, 1))
            log_std = None
        else:
            actions = rows[6] * 1.5
            old = -(rows[6] * 0.5).square() - 1.0 + 0.2 * torch.randn(b, generator=g)
            log_std = torch.tensor([-0.4])
        old_log_probs = table[:, 7].copy_(old.view(-1))
        args = (out, value, actions, rows[1], old_log_probs, rows[2], rows[3], rows[4])
        coefs = (0.2, vclip, 0.5, 0.05, mean_reg)
        want = loss_head_torch(*args, log_std, *coefs)
        got = ppo_loss_native.head(lib, *args, 0.0 if log_std is None else float(log_std), *coefs)
        n_parts = want[1].numel()
        got = (got[0], got[1][:n_parts], *got[2:5], got[5] if n_act == 0 else None)
        for w, x in zip(want, got, strict=True):
            if w is not None:
                ok &= bool(torch.allclose(x, w.view(x.shape), rtol=1e-4, atol=1e-6))
    # the towers' activation and its backward: within 5e-7 of tanh on a grid past the clamp (measured 2.8e-7 with
    # fused multiply-adds, 3.9e-7 without), NaN kept
    a = torch.cat([torch.linspace(-12.0, 12.0, 4801), torch.tensor([0.0, 1e-30, -1e-7, float("inf"), -float("inf")])])
    h = ppo_loss_native.tanh_(lib, a.clone())
    ok &= bool((h.double() - torch.tanh(a.double())).abs().max() <= 5e-7)
    ok &= bool(ppo_loss_native.tanh_(lib, torch.tensor([float("nan")])).isnan().all())
    # its backward with the row sums, on the same grid as stacked layers [2, 3, 801]
    delta, h = torch.randn(2, 3, 801, generator=g), h.view(2, 3, 801)
    want_delta = torch.ops.aten.tanh_backward(delta, h)
    d_b = ppo_loss_native.tanh_backward_sum_(lib, delta, h)
    ok &= bool(torch.allclose(delta, want_delta, rtol=1e-6, atol=1e-7))
    ok &= bool(torch.allclose(d_b, want_delta.sum(1), rtol=1e-5, atol=1e-5))
    # the heads and their backward against torch's ops (a width that is not a multiple of the dot's 32 partial sums)
    for n_out in (3, 1):
        h = torch.rand(2, 37, 21, generator=g) * 2.0 - 1.0
        w_a, b_a = torch.randn(n_out, 21, generator=g), torch.randn(n_out, generator=g)
        w_c, b_c = torch.randn(1, 21, generator=g), torch.randn(1, generator=g)
        out, value = ppo_loss_native.heads_forward(lib, h, w_a, b_a, w_c, b_c)
        ok &= bool(torch.allclose(out, torch.addmm(b_a, h[0], w_a.t()), rtol=1e-5, atol=1e-5))
        ok &= bool(torch.allclose(value, torch.addmm(b_c, h[1], w_c.t()), rtol=1e-5, atol=1e-5))
        d_out, d_value = torch.randn(37, n_out, generator=g), torch.randn(37, 1, generator=g)
        grads, delta, d_b = ppo_loss_native.heads_backward(lib, h, d_out, d_value, w_a, w_c)
        want_delta = torch.ops.aten.tanh_backward(torch.stack([d_out.mm(w_a), d_value.mm(w_c)]), h)
        want = [d_out.t().mm(h[0]), d_out.sum(0), d_value.t().mm(h[1]), d_value.sum(0), want_delta, want_delta.sum(1)]
        for w, x in zip(want, [*grads, delta, d_b], strict=True):
            ok &= w.shape == x.shape and bool(torch.allclose(x, w, rtol=1e-5, atol=1e-5))
    return ok


def native_library(enabled: bool = True) -> ctypes.CDLL | None:
    """The compiled loss head and tanh loops (checked against the torch head when they load), or None where
    ``enabled`` is False or they cannot be had."""
    return ppo_loss_native.library(_native_self_check) if enabled else None


class _FusedPPOLoss(torch.autograd.Function):
    """PPO's total loss of one minibatch as one autograd node (see the module docstring): the forward runs the towers
    and the loss head (compiled, or :func:`loss_head_torch`), which also gives the gradients at the heads' outputs;
    the backward scales them by the upstream gradient and runs them back through the towers."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, actions: Tensor, old_log_probs: Tensor, old_values: Tensor, advantages: Tensor,
                returns: Tensor, noise: Tensor, coefs: tuple[float, float | None, float, float, float], continuous: bool,
                params: tuple[Tensor, ...], lib: ctypes.CDLL | None, weights: Tensor, biases: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        """``params``: :meth:`ActorCritic.detached_tensors` (views of ``weights`` and ``biases``, the parameters);
        ``lib``: the compiled head, or None for the torch one."""
        ctx.set_materialize_grads(False)
        n_tower = len(params) - 4 - continuous
        tower, heads = params[:n_tower], params[n_tower : n_tower + 4]
        acts = _forward(x, tower, heads, lib)
        out, value = acts[-2], acts[-1].view(-1)
        log_std = params[-1] if continuous else None
        rows = (actions, noise, old_log_probs, old_values, advantages, returns)
        if lib is not None and ppo_loss_native.usable(out, value, *rows):
            loss, parts, logratio, d_out, d_value, d_log_std = ppo_loss_native.head(
                lib, out, value, *rows, float(log_std) if continuous else 0.0, *coefs)
        else:
            loss, parts, logratio, d_out, d_value, d_log_std = loss_head_torch(out, value, *rows, log_std, *coefs)
        ctx.save_for_backward(x, d_out, d_value, *acts[:-2])
        ctx.d_log_std = d_log_std if continuous else None
        ctx.params = params  # views of the parameters, which only the optimizer changes, after backward
        ctx.n_tower = n_tower
        ctx.lib = lib
        ctx.mark_non_differentiable(parts, logratio)
        return loss, parts, logratio

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        if grad is None:
            return (None,) * 13
        x, d_out, d_value, *acts = ctx.saved_tensors
        params, n_tower, d_log_std = ctx.params, ctx.n_tower, ctx.d_log_std
        g = float(grad)
        if g != 1.0:  # the loss is linear in the upstream gradient
            d_out, d_value = d_out * g, d_value * g
            d_log_std = None if d_log_std is None else d_log_std * g
        grads = _backward(d_out, d_value, x, acts, params[:n_tower], params[n_tower : n_tower + 4], ctx.lib)
        if d_log_std is not None:
            grads.append(d_log_std)
        # the flat parameters' gradients, in ActorCritic.tensor_names order: matrices, then biases (and log σ)
        d_weights = torch.cat([g.reshape(-1) for g in (*grads[:n_tower:2], grads[n_tower], grads[n_tower + 2])])
        d_biases = torch.cat([g.reshape(-1) for g in (*grads[1:n_tower:2], grads[n_tower + 1], *grads[n_tower + 3 :])])
        return (None,) * 11 + (d_weights, d_biases)


def fused_ppo_loss(
    net: ActorCritic, x: Tensor, actions: Tensor, old_log_probs: Tensor, old_values: Tensor, advantages: Tensor,
    returns: Tensor, noise: Tensor, clip_coef: float, value_clip: float | None, vf_coef: float, ent_coef: float,
    mean_reg_coef: float = 0.0, native: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's loss of a minibatch (the plain path's ``pg − ent_coef·H + vf_coef·V`` [+ mean_reg_coef·mean(μ²)
    for the continuous policy]) and its detached parts
    (``policy_loss``, ``value_loss``, ``entropy``, ``logratio``); its gradient reaches ``net``'s parameters through
    one hand-written backward. ``advantages`` are already normalised; ``actions`` are indices (discrete) or the
    pre-squash samples u (continuous), ``noise`` the standard normal draws behind them (continuous)."""
    loss, parts, logratio = _FusedPPOLoss.apply(
        x, actions, old_log_probs, old_values, advantages, returns, noise,
        (float(clip_coef), value_clip, float(vf_coef), float(ent_coef), float(mean_reg_coef)), net.continuous,
        net.detached_tensors(), native_library(native), net.weights, net.biases,
    )
    pg, vl, ent = parts.unbind()[:3]
    return loss, {"policy_loss": pg, "value_loss": vl, "entropy": ent, "logratio": logratio}
