"""Calendar: time of day, day of week and time of year as sin/cos, from UTC timestamps; known in advance."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from foxhunt.features.registry import FeatureList

if TYPE_CHECKING:
    from foxhunt.features.panel import Panel

_NS_PER_S = 1_000_000_000
_DAY_S = 86_400
_YEAR_DAYS = 365.2425
_TWO_PI = 2.0 * math.pi
DAYS_PER_NS = 1.0 / (_NS_PER_S * _DAY_S)

CALENDAR_DEFINITIONS = {  # name: (definition, phase, function)
    "tod_sin": ("sin(2 pi (UTC seconds since midnight) / 86400)", "tod", torch.sin),
    "tod_cos": ("cos(2 pi (UTC seconds since midnight) / 86400)", "tod", torch.cos),
    "dow_sin": ("sin(2 pi weekday / 7), Monday = 0 (UTC)", "dow", torch.sin),
    "dow_cos": ("cos(2 pi weekday / 7), Monday = 0 (UTC)", "dow", torch.cos),
    "toy_sin": ("sin(2 pi (days since epoch mod 365.2425) / 365.2425)", "toy", torch.sin),
    "toy_cos": ("cos(2 pi (days since epoch mod 365.2425) / 365.2425)", "toy", torch.cos),
}


def phases(ts_ns: Tensor) -> dict[str, Tensor]:
    """Phases in [0, 1) of the day, week and year (float64) of int64 ns UTC timestamps; float64 days are exact
    to well under a second."""
    days = ts_ns.to(torch.float64) * DAYS_PER_NS  # float64 before the multiply
    whole = torch.floor(days)
    weeks = (whole + 3.0).div_(7.0)  # 1970-01-01 was a Thursday; Monday = 0
    years = days / _YEAR_DAYS
    return {"tod": days - whole, "dow": weeks - torch.floor(weeks), "toy": years - torch.floor(years)}


def calendar_values(name: str, ph: dict[str, Tensor], out: Tensor | None = None) -> Tensor:
    """One calendar feature from the phases, trigonometry in float32 (what the output keeps), into ``out`` when it
    is a float32 tensor."""
    _, key, fn = CALENDAR_DEFINITIONS[name]
    angle = ph[key] * _TWO_PI
    if out is not None and out.dtype == torch.float32:
        return fn(out.copy_(angle), out=out)
    return fn(angle.to(torch.float32))


def calendar_feature(p: Panel, name: str, out: Tensor | None = None) -> Tensor:
    """One calendar feature of the panel's timestamps, as float64 [S, T] (into ``out`` when given)."""
    v = calendar_values(name, p.memo("calendar_phases", lambda: phases(p.timestamps)), out)
    return v.to(torch.float64) if out is None else v if v is out else out.copy_(v)


def features() -> FeatureList:
    fl = FeatureList("calendar")
    for name, (definition, _, _) in CALENDAR_DEFINITIONS.items():
        fl.add(name, definition, 0, lambda p, out=None, name=name: calendar_feature(p, name, out), known_future=True)
    return fl
