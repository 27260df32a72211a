"""Training machinery shared by every member: AdamW and schedules, grad norms and clipping, the non-finite guard."""

from foxhunt.training.gradnorm import clip_and_measure, grad_norms
from foxhunt.training.guard import NonFiniteError, NonFiniteGuard
from foxhunt.training.optim import (
    SchedulerKind,
    configure_adamw,
    make_adamw,
    make_scheduler,
    validate_lr,
)

__all__ = [
    "NonFiniteError",
    "NonFiniteGuard",
    "SchedulerKind",
    "clip_and_measure",
    "configure_adamw",
    "grad_norms",
    "make_adamw",
    "make_scheduler",
    "validate_lr",
]
