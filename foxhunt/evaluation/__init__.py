"""Evaluation: forecast metrics (torchmetrics) and back-test figures."""

from foxhunt.evaluation.forecast_metrics import (
    DirectionalAccuracy,
    IntervalCoverage,
    MeanQuantileLoss,
    MedianForecastMAE,
    QuantileRisk,
    forecast_metrics,
    pinball_loss,
)

__all__ = [
    "DirectionalAccuracy",
    "IntervalCoverage",
    "MeanQuantileLoss",
    "MedianForecastMAE",
    "QuantileRisk",
    "forecast_metrics",
    "pinball_loss",
]
