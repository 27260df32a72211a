"""Device-native (torch) feature computation: the same features as the numpy path, on the input tensor's device.

``DEVICE_FUNCTIONS`` maps every registered feature name to a function of a :class:`TorchPanel` returning its
[S, T] float64 tensor; ``FeatureSet.compute(..., backend="torch")`` runs them. The check below keeps it in
step with the numpy registry: a feature added to one path and not the other fails at import.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from foxhunt.features.catalog import REGISTRY
from foxhunt.features.device import calendar, momentum, shape, trend, volatility, volume
from foxhunt.features.device.panel import TorchPanel


def _merge() -> dict[str, Callable[[TorchPanel], Tensor]]:
    """The six families' functions in registry order, refusing duplicates and any mismatch with the numpy registry."""
    out: dict[str, Callable[[TorchPanel], Tensor]] = {}
    for fam in (momentum, trend, volatility, volume, shape, calendar):
        for name, fn in fam.functions().items():
            if name in out:
                raise ValueError(f"device features: duplicate feature name {name!r}")
            out[name] = fn
    missing, extra = sorted(set(REGISTRY) - set(out)), sorted(set(out) - set(REGISTRY))
    if missing or extra:
        raise RuntimeError(f"device features out of step with the numpy registry: missing {missing}, not registered {extra}")
    return {name: out[name] for name in REGISTRY}


DEVICE_FUNCTIONS: dict[str, Callable[[TorchPanel], Tensor]] = _merge()

__all__ = ["DEVICE_FUNCTIONS", "TorchPanel"]
