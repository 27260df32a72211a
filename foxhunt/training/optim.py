"""AdamW and learning-rate schedules shared by every ensemble member (TFT, DQN, coordinator)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from foxhunt.training.guard import GuardPolicy

SchedulerKind = Literal["none", "step", "cosine", "plateau"]
SCHEDULER_KINDS: tuple[str, ...] = ("none", "step", "cosine", "plateau")

_O = TypeVar("_O", bound="Optimization")


@dataclass(frozen=True)
class Optimization:
    """How a member learns: its AdamW, schedule, clipping, guard and pace in the coordinator, declared once; a
    config gives it as a member's ``optim`` mapping, and each member's subclass holds that member's defaults."""

    lr: float = 1e-3
    """AdamW learning rate (its start, with a schedule), in (0, 1]."""
    weight_decay: float = 1e-4
    """AdamW decoupled weight decay, on weights only (biases, norms and other vectors are not decayed)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused_adamw: bool = True
    """Step AdamW with torch's fused kernel where the parameters' device and dtype allow (one kernel for all)."""
    scheduler: SchedulerKind = "cosine"
    """none, step (by gamma every step_size updates), cosine (to min_lr_ratio over total_steps), plateau (by gamma
    when the validation monitor stalls for plateau_patience epochs)."""
    warmup_steps: int = 0
    """Linear warm-up updates before a step or cosine schedule."""
    step_size: int = 1000
    """Updates between step decays."""
    gamma: float = 0.5
    """The schedule's step-decay / plateau reduction factor."""
    min_lr_ratio: float = 0.0
    """Cosine floor, and plateau floor, as a fraction of lr."""
    plateau_patience: int = 5
    """Validation epochs without improvement before a plateau reduction."""
    total_steps: int | None = None
    """Updates a cosine (or linear) schedule spans; None: the member's estimated updates in the fit."""
    gradient_clip_val: float | None = None
    """Max gradient 2-norm the coordinator clips this member to (None: the coordinator's; 0: no clipping)."""
    nonfinite: GuardPolicy = "raise"
    """On a NaN/Inf loss or gradient: "raise" an error naming the update and blocks, or "skip" the update and count."""
    log_grad_norm_every: int = 50
    """Updates between logs of the total and per-block gradient norms (0: never)."""
    updates_per_step: int = 1
    """Optimizer updates per coordinator step."""
    start_step: int = 0
    """Coordinator steps before the member's first update (e.g. while forecasters warm up)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))  # JSON and YAML give a list

    @classmethod
    def of(cls: type[_O], value: _O | Mapping[str, Any] | None) -> _O:
        """The member's settings from a config's (possibly partial) mapping, its saved hyperparameters or an instance;
        fields not given keep this class's defaults."""
        if value is None:
            return cls()
        if isinstance(value, Optimization):
            return value if type(value) is cls else cls(**dataclasses.asdict(value))
        if not isinstance(value, Mapping):
            raise TypeError(f"optim must be a mapping of {cls.__name__} fields, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"optim has no field(s) {unknown}; it takes {sorted(known)}")
        return cls(**value)

    def check(self) -> None:
        """Refuse settings that would wreck a run before it starts (ValueError, one line, naming the field)."""
        validate_lr(self.lr)
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0.0:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if self.nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {self.nonfinite!r}")
        if self.log_grad_norm_every < 0:
            raise ValueError(f"log_grad_norm_every must be >= 0, got {self.log_grad_norm_every}")
        if self.updates_per_step < 1 or self.start_step < 0:
            raise ValueError(f"updates_per_step must be >= 1 and start_step >= 0, got {self.updates_per_step}, "
                             f"{self.start_step}")
        if self.gradient_clip_val is not None and not self.gradient_clip_val >= 0:
            raise ValueError(f"gradient_clip_val must be >= 0 or None, got {self.gradient_clip_val}")
        # the schedule's own settings, refused here rather than when the fit builds the optimizers (the run's length,
        # which the warm-up must also fit in, is checked before training: foxhunt.lit.run_plan)
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps is not None and self.scheduler in ("cosine", "linear") and not (
                0 <= self.warmup_steps < self.total_steps):
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < total_steps ({self.total_steps})")
        if self.scheduler == "plateau" and self.warmup_steps:
            raise ValueError("warmup_steps is not supported with the plateau scheduler")
        if self.scheduler == "step" and self.step_size <= 0:
            raise ValueError(f"step_size must be > 0, got {self.step_size}")

    def as_dict(self) -> dict[str, Any]:
        """Plain values, as hyperparameters hold them (checkpoints load with weights_only=True; exports write JSON)."""
        return dataclasses.asdict(self)


def validate_lr(lr: float) -> float:
    """Reject learning rates outside (0, 1] before they silently wreck a run."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise ValueError(f"learning rate must be a number in (0, 1], got {lr!r}")  # noqa: TRY004 - one error type for callers
    if not math.isfinite(lr) or not 0.0 < lr <= 1.0:
        raise ValueError(f"learning rate must be in (0, 1], got {lr!r}")
    return float(lr)


def make_adamw(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW with validated hyperparameters (decoupled weight decay, Loshchilov & Hutter)."""
    lr = validate_lr(lr)
    if not math.isfinite(weight_decay) or weight_decay < 0.0:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)


# Modules whose every parameter is a normalisation gain or shift (nn.RMSNorm exists from torch 2.4).
NORM_MODULES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm* and their lazy and sync variants
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def is_no_decay(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Whether ``param``, registered as ``name`` on ``module`` (its owner, not an ancestor), is a bias or a
    normalisation parameter, which weight decay must not pull toward zero.

    By role, in this order: the owner lists ``name`` in its class attribute ``no_decay_params`` (custom layers whose
    biases and gains are [G, d] matrices, e.g. the TFT's grouped per-variable GRNs); the owner is a normalisation
    module (``NORM_MODULES``: gain and shift); the name says bias (``bias``, ``b``, ``*_bias``, ``bias_*`` as in
    nn.LSTM's ``bias_ih_l0``). Any other parameter is a weight (matrices, convolution kernels, embeddings) and
    decays, whatever its shape, except vectors and scalars of no recognised role (ndim < 2), left undecayed.
    """
    if name in getattr(module, "no_decay_params", ()):
        return True
    if isinstance(module, NORM_MODULES):
        return True
    if name in ("bias", "b") or name.endswith("_bias") or name.startswith("bias_"):
        return True
    return param.ndim < 2


def decay_param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay weights (matrices, kernels, embeddings) only: biases and normalisation parameters, found by their role
    (``is_no_decay``), are not regularised toward zero, whatever their shape.

    Without weight decay there is one group (each group costs a kernel launch per optimizer step).
    """
    trainable = [p for p in module.parameters() if p.requires_grad]
    if weight_decay == 0.0:
        return [{"params": trainable, "weight_decay": 0.0}]
    no_decay_ids = {
        id(p)
        for owner in module.modules()
        for name, p in owner.named_parameters(recurse=False)
        if is_no_decay(owner, name, p)
    }  # a parameter shared by several owners is not decayed if any of them says so
    decay = [p for p in trainable if id(p) not in no_decay_ids]
    no_decay = [p for p in trainable if id(p) in no_decay_ids]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def warmup_cosine_factor(step: int, *, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """LR multiplier: linear warm-up from 1/warmup to 1, then half-cosine down to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_step_factor(step: int, *, step_size: int, gamma: float, warmup_steps: int = 0) -> float:
    """LR multiplier: linear warm-up, then multiply by ``gamma`` every ``step_size`` steps after it."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    return gamma ** ((step - warmup_steps) // step_size)


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    kind: SchedulerKind,
    *,
    total_steps: int | None = None,
    warmup_steps: int = 0,
    step_size: int = 1000,
    gamma: float = 0.5,
    min_lr_ratio: float = 0.0,
    plateau_patience: int = 5,
    monitor: str = "val/loss",
    interval: str = "step",
    frequency: int = 1,
) -> dict[str, Any] | None:
    """A Lightning ``lr_scheduler`` config dict for ``kind``, or None for a constant learning rate.

    ``step`` and ``cosine`` count in units of ``interval`` (optimizer steps by default). ``plateau`` reduces the LR by
    ``gamma`` when ``monitor`` stops improving for ``plateau_patience`` checks; a validation metric exists only at the
    end of an epoch, so pass ``interval="epoch"`` for ``monitor="val/..."``.
    """
    if kind not in SCHEDULER_KINDS:
        raise ValueError(f"scheduler must be one of {SCHEDULER_KINDS}, got {kind!r}")
    if interval not in ("step", "epoch"):
        raise ValueError(f"scheduler interval must be 'step' or 'epoch', got {interval!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if kind == "none":
        return None
    if kind == "cosine":
        if total_steps is None or total_steps <= 0:
            raise ValueError(f"cosine schedule needs total_steps > 0, got {total_steps!r}")
        if warmup_steps >= total_steps:
            raise ValueError(f"warmup_steps ({warmup_steps}) must be < total_steps ({total_steps})")
        fn = _Cosine(total_steps, warmup_steps, min_lr_ratio)
        sched: Any = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
    elif kind == "step":
        if step_size <= 0:
            raise ValueError(f"step_size must be > 0, got {step_size}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, _StepDecay(step_size, gamma, warmup_steps))
    else:
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"plateau gamma (reduction factor) must be in (0, 1), got {gamma}")
        if warmup_steps:
            raise ValueError("warmup_steps is not supported with the plateau scheduler")
        min_lr = [g["lr"] * min_lr_ratio for g in optimizer.param_groups]
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=gamma, patience=plateau_patience, min_lr=min_lr
        )
    config: dict[str, Any] = {"scheduler": sched, "interval": interval, "frequency": frequency, "name": f"lr-{kind}"}
    if kind == "plateau":
        config["monitor"] = monitor
        config["strict"] = True
    return config


class _Cosine:
    """Picklable LambdaLR factor (a lambda would break checkpoint pickling of the scheduler)."""

    def __init__(self, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> None:
        self.total_steps, self.warmup_steps, self.min_lr_ratio = total_steps, warmup_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        return warmup_cosine_factor(
            step, total_steps=self.total_steps, warmup_steps=self.warmup_steps, min_lr_ratio=self.min_lr_ratio
        )


class _StepDecay:
    """Picklable LambdaLR factor for step decay with warm-up."""

    def __init__(self, step_size: int, gamma: float, warmup_steps: int) -> None:
        self.step_size, self.gamma, self.warmup_steps = step_size, gamma, warmup_steps

    def __call__(self, step: int) -> float:
        return warmup_step_factor(step, step_size=self.step_size, gamma=self.gamma, warmup_steps=self.warmup_steps)


def configure_adamw(
    module_or_params: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    lr: float,
    weight_decay: float,
    scheduler: SchedulerKind,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    total_steps: int | None = None,
    warmup_steps: int = 0,
    step_size: int = 1000,
    gamma: float = 0.5,
    min_lr_ratio: float = 0.0,
    plateau_patience: int = 5,
    monitor: str = "val/loss",
    interval: str = "step",
    exclude_bias_and_norm: bool = True,
) -> torch.optim.AdamW | dict[str, Any]:
    """What ``LightningModule.configure_optimizers`` returns: AdamW alone, or with its scheduler config.

    Given a module, weights decay and biases/norm parameters do not (``exclude_bias_and_norm``, see ``is_no_decay``).
    """
    if isinstance(module_or_params, nn.Module):
        params: Any = (
            decay_param_groups(module_or_params, weight_decay)
            if exclude_bias_and_norm
            else [p for p in module_or_params.parameters() if p.requires_grad]
        )
    else:
        params = list(module_or_params)
    optimizer = make_adamw(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    sched = make_scheduler(
        optimizer,
        scheduler,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        step_size=step_size,
        gamma=gamma,
        min_lr_ratio=min_lr_ratio,
        plateau_patience=plateau_patience,
        monitor=monitor,
        interval=interval,
    )
    if sched is None:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": sched}


FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # AdamW(fused=True)'s, as torch documents


def prefer_fused(optimizer: torch.optim.Optimizer) -> None:
    """Switch AdamW to torch's fused kernel (one kernel for all parameters) before its first step, where every
    parameter is a CPU or CUDA tensor of a dtype it supports; otherwise torch's default implementation stays."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or not params:
        return
    if all(p.device.type in ("cpu", "cuda") and p.dtype in FUSED_DTYPES for p in params):
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
