"""The feature registry: every feature's name, family, one-line definition, warm-up and function."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor

FAMILIES = ("momentum", "trend", "volatility", "volume", "shape", "calendar")


@dataclass(frozen=True)
class Feature:
    """One named feature.

    ``warmup`` is the number of leading bars of each symbol on which the feature is not yet defined
    (TA-Lib's lookback for indicators TA-Lib also computes). ``talib`` names the TA-Lib function whose
    output this feature is, or is a transform of; ``known_future`` marks features computable from the
    timestamp alone, usable as known-future inputs. ``fn(panel)`` returns the feature as a float64 [S, T]
    tensor on the panel's device (the one implementation, for CPU and CUDA alike); ``fn(panel, out=dest)``, where
    the feature supports it, writes its last step into ``dest`` ([S, T], float32 or float64: one rounding from
    float64, no full-size temporary) and returns it, and otherwise returns its own tensor.
    """

    name: str
    family: str
    definition: str
    warmup: int
    fn: Callable[..., Tensor]
    talib: str | None = None
    known_future: bool = False
    writes_out: bool = False  # whether ``fn`` takes ``out`` (a destination for its last step)


class FeatureList:
    """Collects a family's features in declaration order."""

    def __init__(self, family: str) -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown feature family {family!r}")
        self.family = family
        self.features: list[Feature] = []

    def add(self, name: str, definition: str, warmup: int, fn: Callable[..., Tensor], talib: str | None = None, known_future: bool = False) -> None:
        writes_out = "out" in inspect.signature(fn).parameters
        self.features.append(Feature(name, self.family, definition, int(warmup), fn, talib, known_future, writes_out))


def build_registry(lists: Iterable[FeatureList]) -> dict[str, Feature]:
    reg: dict[str, Feature] = {}
    for fl in lists:
        for f in fl.features:
            if f.name in reg:
                raise ValueError(f"duplicate feature name {f.name!r}")
            reg[f.name] = f
    return reg


def select(registry: dict[str, Feature], names: Sequence[str] | None, families: Sequence[str] | None) -> list[Feature]:
    """Features chosen by names and/or families (union, in registry order); all when both are None."""
    if isinstance(names, str) or isinstance(families, str):
        raise TypeError("names and families must be sequences of strings, not a single string")
    if names is None and families is None:
        return list(registry.values())
    chosen: set[str] = set()
    for fam in families or ():
        if fam not in FAMILIES:
            raise ValueError(f"unknown feature family {fam!r}; known: {', '.join(FAMILIES)}")
        chosen.update(n for n, f in registry.items() if f.family == fam)
    unknown = [n for n in names or () if n not in registry]
    if unknown:
        raise ValueError(f"unknown feature name(s) {unknown}; see docs/FEATURES.md for the list")
    chosen.update(names or ())
    return [f for n, f in registry.items() if n in chosen]
