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

Float32 only: under autocast (mixed precision) :class:`PPOModule` uses the plain path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from foxhunt.models.actor_critic import LOG_SQRT_2PI, ActorCritic, tanh_log_det


def _forward(x: Tensor, tower: tuple[Tensor, ...], heads: tuple[Tensor, Tensor, Tensor, Tensor]) -> list[Tensor]:
    """[h_1, ..., h_L, actor output, value]: the towers' activations [2, B, H_l] (both networks in one batched
    product per layer, (W_1, b_1, ..., W_L, b_L) of [2, out, in] and [2, out]) and the heads' outputs."""
    n = len(tower) // 2
    acts: list[Tensor] = []
    h = x.expand(2, *x.shape)
    for i in range(n):
        # tanh(a) = 2·σ(2a) − 1, the 2a from the product's own scalars: torch's CPU tanh costs about four sigmoids
        h = torch.baddbmm(tower[2 * i + 1].unsqueeze(1), h, tower[2 * i].transpose(1, 2), beta=2.0, alpha=2.0)
        h = h.sigmoid_().mul_(2.0).sub_(1.0)
        acts.append(h)
    w_a, b_a, w_c, b_c = heads
    acts.append(torch.addmm(b_a, h[0], w_a.t()))
    acts.append(torch.addmm(b_c, h[1], w_c.t()))
    return acts


def _backward(delta_a: Tensor, delta_c: Tensor, x: Tensor, acts: list[Tensor], tower: tuple[Tensor, ...],
              heads: tuple[Tensor, Tensor, Tensor, Tensor]) -> list[Tensor]:
    """Gradients (dW_1, db_1, ..., dW_L, db_L, dW_actor, db_actor, dW_critic, db_critic) from δ at the actor's and the
    critic's outputs: heads, then both towers at once, ``δ_{l-1} = (δ_l W_l) ⊙ (1 − h_{l-1}²)``."""
    n = len(tower) // 2
    w_a, _, w_c, _ = heads
    h = acts[n - 1]
    head_grads = [delta_a.t().mm(h[0]), delta_a.sum(0), delta_c.t().mm(h[1]), delta_c.sum(0)]
    delta = torch.stack([delta_a.mm(w_a), delta_c.mm(w_c)])  # [2, B, H_L]
    grads: list[Tensor] = [delta] * (2 * n)
    for i in range(n - 1, -1, -1):
        delta = torch.ops.aten.tanh_backward(delta, acts[i])  # through h_i = tanh(a_i)
        h_in = acts[i - 1] if i > 0 else x.expand(2, *x.shape)
        grads[2 * i] = torch.bmm(delta.transpose(1, 2), h_in)
        grads[2 * i + 1] = delta.sum(1)
        if i > 0:
            delta = torch.bmm(delta, tower[2 * i])
    return grads + head_grads


class _FusedPPOLoss(torch.autograd.Function):
    """PPO's total loss of one minibatch as one autograd node (see the module docstring). Written for few kernel
    calls: the per-row terms are stacked and reduced once, the loss is one dot product with their coefficients,
    Python scalars are folded into ``alpha`` arguments and masks select by ``masked_fill``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, actions: Tensor, old_log_probs: Tensor, old_values: Tensor, advantages: Tensor,
                returns: Tensor, noise: Tensor, coefs: tuple[float, float | None, float, float, float], continuous: bool,
                params: tuple[Tensor, ...], weights: Tensor, biases: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``params``: :meth:`ActorCritic.detached_tensors` (views of ``weights`` and ``biases``, the parameters)."""
        clip_coef, vclip, vf_coef, ent_coef, mean_reg = coefs
        ctx.set_materialize_grads(False)
        n_tower = len(params) - 4 - continuous
        tower, heads = params[:n_tower], params[n_tower : n_tower + 4]
        acts = _forward(x, tower, heads)
        out, value = acts[-2], acts[-1].view(-1)
        b = x.shape[0]
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
            ent_sign = 1.0  # the entropy row is H itself
        else:
            logp = torch.log_softmax(out, 1)
            log_prob = logp.gather(1, actions.view(-1, 1)).view(-1)
            p = logp.exp()
            entropy = (p * logp).sum(1)  # −H: the sign goes into the row's scale
            saved = (logp, p, entropy)
            ent_sign = -1.0
        logratio = log_prob - old_log_probs
        ratio = logratio.exp()
        surrogate = advantages * ratio  # the objective is min(Â·ρ, Â·clip(ρ)); its gradient reaches ρ where Â·ρ is it
        surrogate_clipped = advantages * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef)
        objective = torch.minimum(surrogate, surrogate_clipped)
        g_logp = surrogate.masked_fill(surrogate > surrogate_clipped, 0.0)  # −d pg/d log π, times B
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
        scale = [-1.0 / b, 0.5 / b, ent_sign / b]  # row sums to (policy loss, value loss, entropy, mean(μ²))
        weight = [1.0, vf_coef, -ent_coef]  # the loss's coefficients of those
        if continuous and mean_reg > 0:
            rows.append(out.view(-1).square())  # the pre-squash mean's penalty
            scale.append(1.0 / b)
            weight.append(mean_reg)
        coef = torch.tensor([scale, weight], dtype=x.dtype, device=x.device)
        parts = torch.stack(rows).sum(1).mul_(coef[0])
        loss = torch.dot(parts, coef[1])
        ctx.save_for_backward(x, actions, noise, g_logp, g_value, *saved, *acts[:-2])
        ctx.params = params  # views of the parameters, which only the optimizer changes, after backward
        ctx.meta = (b, n_tower, continuous, vf_coef, ent_coef, mean_reg, len(acts) - 2, len(saved))
        ctx.mark_non_differentiable(parts, logratio)
        return loss, parts, logratio

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        b, n_tower, continuous, vf_coef, ent_coef, mean_reg, n_layers, n_saved = ctx.meta
        saved = ctx.saved_tensors
        x, actions, noise, g_logp, g_value = saved[:5]
        extra = saved[5 : 5 + n_saved]
        acts = list(saved[5 + n_saved : 5 + n_saved + n_layers])
        params = ctx.params
        if grad is None:
            return (None,) * 12
        tower, heads = params[:n_tower], params[n_tower : n_tower + 4]
        scale = grad / b
        d_logp = g_logp * scale.neg()  # d loss / d log π, per row
        ent = scale * ent_coef  # d loss / dH_i = −ent_coef/B
        delta_c = (g_value * (scale * vf_coef)).view(-1, 1)
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
            grads = _backward(delta, delta_c, x, acts, tower, heads)
            grads.append(d_log_std.view(1))
        else:
            logp, p, neg_entropy = extra
            # d log π(a)/dz = onehot(a) − p; dH/dz = −p ⊙ (log p + H)
            delta = (logp - neg_entropy.view(-1, 1)).mul_(ent).sub_(d_logp.view(-1, 1)).mul_(p)
            delta.scatter_add_(1, actions.view(-1, 1), d_logp.view(-1, 1))
            grads = _backward(delta, delta_c, x, acts, tower, heads)
        # the flat parameters' gradients, in ActorCritic.tensor_names order: matrices, then biases (and log σ)
        d_weights = torch.cat([g.reshape(-1) for g in (*grads[:n_tower:2], grads[n_tower], grads[n_tower + 2])])
        d_biases = torch.cat([g.reshape(-1) for g in (*grads[1:n_tower:2], grads[n_tower + 1], *grads[n_tower + 3 :])])
        return (None,) * 10 + (d_weights, d_biases)


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
    loss, parts, logratio = _FusedPPOLoss.apply(
        x, actions, old_log_probs, old_values, advantages, returns, noise,
        (float(clip_coef), value_clip, float(vf_coef), float(ent_coef), float(mean_reg_coef)), net.continuous,
        net.detached_tensors(), net.weights, net.biases,
    )
    pg, vl, ent = parts.unbind()[:3]
    return loss, {"policy_loss": pg, "value_loss": vl, "entropy": ent, "logratio": logratio}
