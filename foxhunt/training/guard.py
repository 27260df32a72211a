"""Non-finite loss and gradient guard shared by every member and the ensemble coordinator.

A NaN or Inf never passes silently: by ``policy`` the guard either raises :class:`NonFiniteError` naming the step and
the top-level blocks whose gradients went bad, or skips the update and counts the skip.

Automatic optimisation (LightningModule)::

    def training_step(self, batch, batch_idx):
        loss = ...
        if not self.guard.check_loss(loss, self.global_step):
            return None                      # Lightning skips backward and the optimizer step
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.guard.check_gradients(self, self.global_step)   # on "skip": grads set to None, AdamW leaves params alone

Under ``16-mixed`` the GradScaler itself skips steps whose (unscaled) gradients overflow and lowers the scale; such
overflows are expected, so members check only the loss there and leave gradient overflow to the scaler.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

GuardPolicy = Literal["raise", "skip"]

# torch's foreach kernels (``torch._foreach_norm``, ``torch._foreach_mul_``) are private, but torch.optim and
# torch.nn.utils run on them: one call for a list of small tensors, where the public get_total_norm and
# clip_grads_with_norm_ group by device and dtype first (~30 us an update, a few % of a small network's update).
# Isolated in the two functions below, with the public path beside them as the fallback (tested equal); pyproject
# bounds torch below 3.
_FOREACH = hasattr(torch, "_foreach_norm") and hasattr(torch, "_foreach_mul_")


def total_norm(grads: list[Tensor], foreach: bool = _FOREACH) -> float:
    """The global 2-norm of ``grads`` (float32 squares: inf when they overflow, NaN when a gradient is NaN)."""
    if foreach:
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()
    return torch.nn.utils.get_total_norm(grads, 2.0).item()


def scale_(grads: list[Tensor], factor: float, foreach: bool = _FOREACH) -> None:
    """Multiply every gradient by ``factor`` in place."""
    if foreach:
        torch._foreach_mul_(grads, factor)
    else:
        for g in grads:
            g.mul_(factor)


class NonFiniteError(RuntimeError):
    """A loss or gradient became NaN or Inf and the guard's policy is "raise"."""


def _max_abs(tensors: list[Tensor]) -> Tensor:
    """Max |x| over all tensors in one reduction (NaN and Inf propagate; no overflow, unlike a 2-norm)."""
    if not tensors:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(tensors, float("inf"))


class NonFiniteGuard:
    """Detects NaN/Inf losses and gradients; raises or skips-and-counts according to ``policy``."""

    def __init__(self, policy: GuardPolicy = "raise") -> None:
        if policy not in ("raise", "skip"):
            raise ValueError(f"non-finite policy must be 'raise' or 'skip', got {policy!r}")
        self.policy: GuardPolicy = policy
        self.skipped_loss = 0
        self.skipped_gradients = 0
        self.scaler_skipped = 0  # steps a GradScaler (16-mixed) skipped on overflow: expected, counted apart

    @property
    def skipped(self) -> int:
        """Updates skipped so far (non-finite loss or gradients)."""
        return self.skipped_loss + self.skipped_gradients

    def check_loss(self, loss: Tensor, step: int) -> bool:
        """True when ``loss`` is finite; otherwise raise, or count the skip and return False."""
        loss = loss.detach()
        finite = math.isfinite(loss.item()) if loss.numel() == 1 else bool(torch.isfinite(loss).all())
        if finite:
            return True
        if self.policy == "raise":
            raise NonFiniteError(f"non-finite loss ({_describe(loss)}) at step {step}")
        self.skipped_loss += 1
        return False

    def check_gradients(self, module: nn.Module, step: int) -> bool:
        """True when every gradient is finite; otherwise raise naming the bad blocks, or drop all grads and count.

        Dropping means ``param.grad = None``: torch optimizers skip parameters without a gradient, so neither the
        weights nor AdamW's moments move, and weight decay is not applied for that step.
        """
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads or bool(torch.isfinite(_max_abs(grads))):
            return True
        if self.policy == "raise":
            blocks = nonfinite_blocks(module)
            raise NonFiniteError(
                f"non-finite gradients at step {step} in block(s): {', '.join(blocks)}"
                f" (of {type(module).__name__})"
            )
        for p in module.parameters():
            p.grad = None
        self.skipped_gradients += 1
        return False

    def clip_gradients(
        self, module: nn.Module, max_norm: float | None, step: int, params: list[Tensor] | None = None
    ) -> bool:
        """Check and clip gradients from one global 2-norm (one reduction for both, for small hot-loop updates).

        Returns what :meth:`check_gradients` returns; a finite result clips to ``max_norm`` (None or 0: no clipping).
        ``params``: the module's parameters, if the caller keeps the list (walking the module costs per call).
        """
        grads = [p.grad for p in (module.parameters() if params is None else params) if p.grad is not None]
        if not grads:
            return True
        norm = total_norm(grads)
        if not math.isfinite(norm):
            # NaN/Inf gradients, or finite ones whose squares overflow: the max-abs check tells them apart.
            if not self.check_gradients(module, step):
                return False
            # finite, so their squares overflowed float32: the norm again in float64
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])).item()
        if max_norm and norm > max_norm:  # clip_grads_with_norm_'s factor
            scale_(grads, max_norm / (norm + 1e-6))
        return True

    def state_dict(self) -> dict[str, int | str]:
        """Counts survive checkpoints so a resumed run keeps its tally."""
        return {"policy": self.policy, "skipped_loss": self.skipped_loss, "skipped_gradients": self.skipped_gradients,
                "scaler_skipped": self.scaler_skipped}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        self.skipped_loss = int(state.get("skipped_loss", 0))
        self.skipped_gradients = int(state.get("skipped_gradients", 0))
        self.scaler_skipped = int(state.get("scaler_skipped", 0))


def nonfinite_blocks(module: nn.Module) -> list[str]:
    """Names of the top-level children (or direct parameters) whose gradients hold NaN or Inf."""
    bad: list[str] = []
    for name, child in module.named_children():
        grads = [p.grad for p in child.parameters() if p.grad is not None]
        if grads and not bool(torch.isfinite(_max_abs(grads))):
            bad.append(name)
    for name, p in module.named_parameters(recurse=False):
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            bad.append(name)
    return bad


def _describe(t: Tensor) -> str:
    t = t.detach()
    if t.numel() == 1:
        return f"{t.item()}"
    return f"{int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} Inf of {t.numel()}"
