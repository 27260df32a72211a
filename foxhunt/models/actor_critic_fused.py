"""PPO's minibatch loss on the :class:`~foxhunt.models.actor_critic.ActorCritic` with a hand-written backward: the fast
path beside the plain autograd one (``PPOModule(fused_loss=...)``), tested equal to it in ``tests/test_ppo.py``.

Why: at CleanRL's and Stable-Baselines3's minibatch of 64 rows, an update of two small tanh MLPs is a few dozen tiny
kernels, and on a CPU the autograd engine's bookkeeping (recording the graph, scheduling some forty backward nodes,
accumulating twelve gradients) costs more than the arithmetic. Here the forward runs without recording, keeps the
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

Float32 only: under autocast (mixed precision) :class:`PPOModule` uses the plain path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from foxhunt.models.actor_critic import LOG_SQRT_2PI, ActorCritic, tanh_log_det


def _linears(seq: torch.nn.Sequential) -> list[torch.nn.Linear]:
    return [m for m in seq if isinstance(m, torch.nn.Linear)]


def _forward(x: Tensor, params: tuple[Tensor, ...]) -> list[Tensor]:
    """[h_0 = x, h_1, ..., h_{L-1}, out]: activations of a tanh MLP given as (W_1, b_1, ..., W_L, b_L)."""
    acts = [x]
    h = x
    n = len(params) // 2
    for i in range(n):
        h = torch.addmm(params[2 * i + 1], h, params[2 * i].t())
        if i < n - 1:
            h = torch.tanh(h)
        acts.append(h)
    return acts


def _backward(delta: Tensor, acts: list[Tensor], params: tuple[Tensor, ...]) -> list[Tensor]:
    """Gradients (dW_1, db_1, ..., dW_L, db_L) of a tanh MLP from δ at its output and its activations h_0..h_{L-1}."""
    n = len(params) // 2
    grads: list[Tensor] = [delta] * (2 * n)
    for i in range(n - 1, -1, -1):
        h_in = acts[i]
        grads[2 * i] = delta.t().mm(h_in)
        grads[2 * i + 1] = delta.sum(0)
        if i > 0:
            delta = torch.ops.aten.tanh_backward(delta.mm(params[2 * i]), h_in)  # (δ W) ⊙ (1 − h²)
    return grads


class _FusedPPOLoss(torch.autograd.Function):
    """PPO's total loss of one minibatch as one autograd node (see the module docstring). Written for few kernel
    calls: Python scalars are folded into ``alpha`` arguments, masks multiply instead of selecting."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, actions: Tensor, old_log_probs: Tensor, old_values: Tensor, advantages: Tensor,
                returns: Tensor, noise: Tensor, coefs: tuple[float, float | None, float, float, float], continuous: bool,
                n_actor: int, *params: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        clip_coef, vclip, vf_coef, ent_coef, mean_reg = coefs
        ctx.set_materialize_grads(False)
        actor_p = params[:n_actor]
        critic_p = params[n_actor : len(params) - 1] if continuous else params[n_actor:]
        a_acts = _forward(x, actor_p)
        c_acts = _forward(x, critic_p)
        out, value = a_acts[-1], c_acts[-1].view(-1)
        if continuous:
            log_std = params[-1]
            std = log_std.exp()
            z = (actions - out.view(-1)).div_(std)  # (u − μ)/σ
            # log N(u; μ, σ) − log(1 − tanh² u): the Jacobian term is the old policy's too, so only the Gaussian part
            # enters the ratio; it is still computed for the logged log-ratio to equal the plain path's
            log_prob = torch.add(log_std, z * z, alpha=0.5).neg_().sub_(LOG_SQRT_2PI + 0.0).sub_(tanh_log_det(actions))
            y = torch.addcmul(out.view(-1), std, noise)  # μ + σ·noise
            entropy = tanh_log_det(y).add_(log_std).add_(0.5 + LOG_SQRT_2PI)
            saved: tuple[Tensor, ...] = (z, y, out)
        else:
            logp = torch.log_softmax(out, 1)
            log_prob = logp.gather(1, actions.view(-1, 1)).view(-1)
            p = logp.exp()
            entropy = (p * logp).sum(1).neg_()
            saved = (logp, p, entropy)
        logratio = log_prob - old_log_probs
        ratio = logratio.exp()
        surrogate = advantages * ratio  # the objective is min(Â·ρ, Â·clip(ρ)); its gradient reaches ρ where Â·ρ is it
        surrogate_clipped = advantages * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef)
        pg_loss = torch.minimum(surrogate, surrogate_clipped).mean().neg_()
        g_logp = surrogate.mul((surrogate <= surrogate_clipped).to(surrogate.dtype))  # −d pg/d log π, times B
        err = value - returns
        if vclip is None:
            v_loss = err.square().mean().mul_(0.5)
            g_value = err
        else:
            moved = value - old_values
            err_c = (old_values - returns).add_(moved.clamp(-vclip, vclip))
            sq, sq_c = err.square(), err_c.square()
            v_loss = torch.maximum(sq, sq_c).mean().mul_(0.5)
            # where the clipped error is the larger and v moved past the clip, no gradient; inside the clip the two
            # errors are equal (to rounding) and so are their gradients
            g_value = err.mul(((sq >= sq_c) | (moved.abs() <= vclip)).to(err.dtype))
        entropy_mean = entropy.mean()
        loss = torch.add(pg_loss, entropy_mean, alpha=-ent_coef).add_(v_loss, alpha=vf_coef)
        if continuous and mean_reg > 0:
            loss = loss.add_(out.square().mean(), alpha=mean_reg)  # the pre-squash mean's penalty
        ctx.save_for_backward(actions, noise, g_logp, g_value, *saved, *a_acts[:-1], *c_acts[:-1], *params)
        ctx.meta = (x.shape[0], n_actor, continuous, vf_coef, ent_coef, mean_reg, len(a_acts) - 1, len(saved))
        ctx.mark_non_differentiable(pg_loss, v_loss, entropy_mean, logratio)
        return loss, pg_loss, v_loss, entropy_mean, logratio

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        b, n_actor, continuous, vf_coef, ent_coef, mean_reg, n_layers, n_saved = ctx.meta
        saved = ctx.saved_tensors
        actions, noise, g_logp, g_value = saved[:4]
        extra = saved[4 : 4 + n_saved]
        a_acts = list(saved[4 + n_saved : 4 + n_saved + n_layers])
        c_acts = list(saved[4 + n_saved + n_layers : 4 + n_saved + 2 * n_layers])
        params = saved[4 + n_saved + 2 * n_layers :]
        if grad is None:
            return (None,) * (10 + len(params))
        scale = grad / b
        d_logp = g_logp * scale.neg()  # d loss / d log π, per row
        ent = scale * ent_coef  # d loss / dH_i = −ent_coef/B
        if continuous:
            z, y, mean = extra
            log_std = params[-1]
            t = torch.tanh(y)
            # d log π/dμ = z/σ; dH/dμ = −2 tanh(y): d loss/dμ = d_logp·z/σ + 2·ent·tanh(y)
            delta = torch.addcmul(d_logp * z / log_std.exp(), t, ent, value=2.0).view(-1, 1)
            if mean_reg > 0:
                delta = delta.add_(mean * (scale * (2.0 * mean_reg)))  # d(β·mean(μ²))/dμ = 2βμ/B
            # d log π/d log σ = z² − 1; dH/d log σ = 1 − 2 tanh(y)·σ·noise
            d_log_std = (d_logp * (z * z - 1.0)).sum() - ent * (b - 2.0 * (t * noise).sum() * log_std.exp())
            grads = _backward(delta, a_acts, params[:n_actor])
            grads += _backward((g_value * (scale * vf_coef)).view(-1, 1), c_acts, params[n_actor:-1])
            grads.append(d_log_std.view(1))
        else:
            logp, p, entropy = extra
            # d log π(a)/dz = onehot(a) − p; dH/dz = −p ⊙ (log p + H)
            delta = (logp + entropy.view(-1, 1)).mul_(ent).sub_(d_logp.view(-1, 1)).mul_(p)
            delta.scatter_add_(1, actions.view(-1, 1), d_logp.view(-1, 1))
            grads = _backward(delta, a_acts, params[:n_actor])
            grads += _backward((g_value * (scale * vf_coef)).view(-1, 1), c_acts, params[n_actor:])
        return (None,) * 10 + tuple(grads)


def fused_ppo_loss(
    net: ActorCritic, x: Tensor, actions: Tensor, old_log_probs: Tensor, old_values: Tensor, advantages: Tensor,
    returns: Tensor, noise: Tensor, clip_coef: float, value_clip: float | None, vf_coef: float, ent_coef: float,
    mean_reg_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's loss of a minibatch (the plain path's ``pg − ent_coef·H + vf_coef·V`` [+ mean_reg_coef·mean(μ²)
    for the continuous policy]) and its detached parts
    (``policy_loss``, ``value_loss``, ``entropy``, ``logratio``); its gradient reaches ``net``'s parameters through
    one hand-written backward. ``advantages`` are already normalised; ``actions`` are indices (discrete) or the
    pre-squash samples u (continuous), ``noise`` the standard normal draws behind them (continuous)."""
    actor = [t for lin in _linears(net.actor) for t in (lin.weight, lin.bias)]
    critic = [t for lin in _linears(net.critic) for t in (lin.weight, lin.bias)]
    params = [*actor, *critic] + ([net.actor_logstd] if net.continuous else [])
    loss, pg, vl, ent, logratio = _FusedPPOLoss.apply(
        x, actions, old_log_probs, old_values, advantages, returns, noise,
        (float(clip_coef), value_clip, float(vf_coef), float(ent_coef), float(mean_reg_coef)), net.continuous, len(actor), *params,
    )
    return loss, {"policy_loss": pg, "value_loss": vl, "entropy": ent, "logratio": logratio}

