"""The registry of every feature (name -> definition), built once from the family modules."""

from __future__ import annotations

from foxhunt.features import calendar, momentum, shape, trend, volatility, volume
from foxhunt.features.registry import Feature, build_registry

REGISTRY: dict[str, Feature] = build_registry(
    m.features() for m in (momentum, trend, volatility, volume, shape, calendar)
)
KNOWN_FUTURE: tuple[str, ...] = tuple(n for n, f in REGISTRY.items() if f.known_future)
