"""Gradient-norm measurement and clipping shared by every member and the ensemble coordinator.

Automatic optimisation: clip with ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` and log
``grad_norms(self)`` from ``on_before_optimizer_step`` every N steps (Lightning calls that hook after unscaling).

Manual optimisation (the coordinator): do the clipping in ``on_before_optimizer_step(optimizer)`` as well, e.g.
``clip_and_measure(self.members[name], max_norm)`` for the member that owns ``optimizer``. Under ``16-mixed``,
Lightning's ``opt.step()`` calls ``scaler.unscale_(optimizer)`` *before* that hook, so the hook sees true gradients.
Do not clip between ``manual_backward`` and ``opt.step()``: the gradients there are still multiplied by the loss scale,
and calling ``scaler.unscale_(optimizer)`` yourself makes Lightning's own ``unscale_`` inside ``opt.step()`` fail
("unscale_() has already been called on this optimizer since the last update()"). bf16-mixed has no scaler.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn


def grad_norms(module: nn.Module, norm_type: float = 2.0, prefix: str = "grad_norm") -> dict[str, float]:
    """The total gradient norm and one norm per top-level child block, keyed ``{prefix}/total``, ``{prefix}/<block>``.

    Per-parameter norms come from Lightning's ``grad_norm``; block norms combine them exactly (p-norm of p-norms).
    """
    norm_type = float(norm_type)
    per_param = grad_norm(module, norm_type)
    head = f"grad_{norm_type}_norm/"
    blocks: dict[str, list[Tensor]] = {}
    for key, value in per_param.items():
        if not key.startswith(head):
            continue
        name = key[len(head) :]
        blocks.setdefault(name.split(".", 1)[0], []).append(torch.as_tensor(value))
    out: dict[str, float] = {}
    if not blocks:
        return out
    every: list[Tensor] = []
    for block, norms in blocks.items():
        out[f"{prefix}/{block}"] = _combine(norms, norm_type)
        every.extend(norms)
    out[f"{prefix}/total"] = _combine(every, norm_type)
    return out


def _combine(norms: list[Tensor], norm_type: float) -> float:
    stacked = torch.stack([n.float().cpu() for n in norms])
    return float(torch.linalg.vector_norm(stacked, ord=norm_type))


def clip_and_measure(
    module_or_params: nn.Module | Iterable[Tensor], max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """Clip gradients to ``max_norm`` in place and return the total norm measured before clipping.

    Call it where gradients are unscaled (``on_before_optimizer_step`` under 16-mixed, see the module docstring).
    A non-finite total norm is returned as is, for the non-finite guard to act on; the gradients are then left as they
    were rather than scaled by NaN.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    params = module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm([p.grad for p in grads], norm_type=norm_type)
    if torch.isfinite(total):
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)
    return total
