"""Calendar features as torch tensors on the bars' device, mirroring :mod:`foxhunt.features.calendar`.

Phases in float64 from the int64 ns timestamps, trigonometry in float32 as the numpy path does; returned as float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from foxhunt.features.calendar import CALENDAR_DEFINITIONS, DAYS_PER_NS, phases_of_days

if TYPE_CHECKING:
    from foxhunt.features.device.panel import TorchPanel

_TWO_PI = 2.0 * math.pi
_TRIG = {"sin": torch.sin, "cos": torch.cos}


def phases(ts_ns: Tensor) -> dict[str, Tensor]:
    """Phases in [0, 1) of the day, week and year (float64) of int64 ns UTC timestamps."""
    return phases_of_days(ts_ns.to(torch.float64) * DAYS_PER_NS)


def calendar_feature(p: TorchPanel, name: str) -> Tensor:
    """One calendar feature of the panel's timestamps: float32 trigonometry, as float64 [S, T]."""
    _, key, _ = CALENDAR_DEFINITIONS[name]
    ph = p.memo("calendar_phases", lambda: phases(p.timestamps))
    return _TRIG[name.rsplit("_", 1)[1]]((_TWO_PI * ph[key]).to(torch.float32)).to(torch.float64)


def functions() -> dict[str, Callable[[TorchPanel], Tensor]]:
    """Every calendar feature of the numpy registry, by name, as a function of a :class:`TorchPanel`."""
    return {name: (lambda p, name=name: calendar_feature(p, name)) for name in CALENDAR_DEFINITIONS}
