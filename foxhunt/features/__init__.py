"""Causal, vectorised bar features (122, in six families) checked against TA-Lib.

Entry points: :func:`compute_features` (DataFrame in, DataFrame out) for users and notebooks,
:class:`FeatureSet` (tensors in, :class:`FeatureOutput` out) for the DataModule, and :class:`FeatureStream` (the same
features bar by bar, with a state to save and restore) for live use. ``REGISTRY`` maps
every name to its family, definition, warm-up and function; docs/FEATURES.md is generated from it.
"""

from foxhunt.features.compute import (
    KNOWN_FUTURE,
    REGISTRY,
    FeatureOutput,
    FeatureSet,
    compute_features,
    known_future_features,
)
from foxhunt.features.registry import FAMILIES, Feature
from foxhunt.features.stream import FeatureStream

__all__ = [
    "FAMILIES",
    "KNOWN_FUTURE",
    "REGISTRY",
    "Feature",
    "FeatureOutput",
    "FeatureSet",
    "FeatureStream",
    "compute_features",
    "known_future_features",
]
