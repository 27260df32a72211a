"""The coordinator's update of its members: guard, one backward a round, grad norms, clipping, each member's step.

:class:`MemberUpdates` is the part of :class:`foxhunt.lit.ensemble.EnsembleModule` that steps the members under
manual optimisation (see that module's docstring for the order of one round); it reads the coordinator's
``member``, ``member_names``, ``updates``, ``_schedulers``, ``_plan`` and ``hparams.gradient_clip_val``.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from foxhunt.lit.member import Member
from foxhunt.training.gradnorm import grad_norms


@dataclass
class UpdatePlan:
    """The lookups of every update, done once per fit (an update of a small network costs about a millisecond)."""

    members: dict[str, Member]
    optimizers: dict[str, Any]  # LightningOptimizers: stepping them advances global_step
    params: dict[str, list[nn.Parameter]]
    clip: dict[str, float | None]
    scaler: Any  # the GradScaler of 16-mixed (None otherwise): gradients are unscaled only inside the optimizer step
    active: str | None = None  # the member whose optimizer is stepping (read by on_before_optimizer_step)

    @property
    def scaled(self) -> bool:
        return self.scaler is not None


class MemberUpdates:
    """The members' updates of one coordinator step, mixed into the coordinator's LightningModule."""

    def _optimizer(self, name: str) -> Any:
        return self._loop_plan().optimizers[name]

    def _update(self, losses: dict[str, Tensor]) -> None:
        """Guard each loss, one backward of their sum (one per member under a GradScaler), then per member: grad norms,
        guard and clip, step, after_update.

        Without a GradScaler the gradients are final after backward: the guard and the clip share one norm here.
        With one (16-mixed) they are scaled until the optimizer step unscales them, so the norms are logged and the
        clip applied in ``on_before_optimizer_step``. Lightning updates the scale after every optimizer step, so there
        each member's backward runs just before its own step, at the scale that step unscales by; a step the scaler
        skips (overflow) is counted and leaves the member's schedule, update count and ``after_update`` alone.
        """
        plan = self._loop_plan()
        live = {n: loss for n, loss in losses.items() if plan.members[n].guard.check_loss(loss, self.updates[n])}
        if not live:
            return
        for name in live:
            for p in plan.params[name]:
                p.grad = None
        if not plan.scaled:
            self._backward(functools.reduce(operator.add, live.values()))
        for name in live:
            member, update = plan.members[name], self.updates[name]
            if plan.scaled:
                self._backward(live[name])
                scale = plan.scaler.get_scale()
            else:
                if member.log_grad_norm_every and update % member.log_grad_norm_every == 0:
                    self._log_grad_norms(name)
                if not member.guard.clip_gradients(member.network, plan.clip[name], update, params=plan.params[name]):
                    continue  # non-finite gradients, policy "skip": counted by the guard, weights untouched
            plan.active = name
            plan.optimizers[name].step()
            plan.active = None
            if plan.scaled and plan.scaler.get_scale() < scale:  # the scaler found inf/NaN and skipped the step
                member.guard.scaler_skipped += 1
                continue
            sched = self._schedulers.get(name)
            if sched is not None and not isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step()
            member.after_update(update)
            self.updates[name] = update + 1

    def _backward(self, loss: Tensor) -> None:
        """Backward outside Lightning's autocast (on around training_step, where the members are stepped): under it
        the hand-written backwards (Mamba-2's C loops, the TFT's selection) would see their products recast."""
        device = loss.device.type
        with torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext():
            self.manual_backward(loss)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Under a GradScaler the gradients are unscaled only here: log the active member's norms, then clip them."""
        plan = self._loop_plan()
        name = plan.active
        if name is None or not plan.scaled:
            return
        member = self.member(name)
        every = member.log_grad_norm_every
        if every and self.updates[name] % every == 0:
            self._log_grad_norms(name)
        clip = plan.clip[name]
        if clip:
            torch.nn.utils.clip_grad_norm_(member.network.parameters(), clip)

    @property
    def stepping_member(self) -> str | None:
        """The member whose optimizer is stepping now (None outside an optimizer step), for callbacks' hooks."""
        return None if self._plan is None else self._plan.active

    def _log_grad_norms(self, name: str) -> None:
        norms = grad_norms(self.member(name).network)
        self.log_dict({f"grad_norm/{name}/{k.split('/', 1)[1]}": v for k, v in norms.items()})

    def _loop_plan(self) -> UpdatePlan:
        """What every update of this fit reads, looked up once (members, optimizers, parameter lists, switches)."""
        plan = self._plan
        if plan is None:
            opts = self.optimizers()
            opts = opts if isinstance(opts, list) else [opts]
            members = {n: self.member(n) for n in self.member_names}
            clip: dict[str, float | None] = {}
            for n, m in members.items():
                value = m.gradient_clip_val if m.gradient_clip_val is not None else self.hparams.gradient_clip_val
                clip[n] = float(value) if value and value > 0 else None
            plan = self._plan = UpdatePlan(
                members=members,
                optimizers=dict(zip(self.member_names, opts, strict=True)),
                params={n: list(m.network.parameters()) for n, m in members.items()},
                clip=clip,
                scaler=getattr(self.trainer.precision_plugin, "scaler", None),
            )
        return plan
