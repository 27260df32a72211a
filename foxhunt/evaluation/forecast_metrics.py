"""Quantile-forecast metrics as torchmetrics (one object per stage), always fed the original log-return scale.

Every metric takes ``update(pred, target)`` with ``pred`` [..., Q] quantile forecasts and ``target`` [...] realised
returns; non-finite targets are ignored, so a padded or undefined row never counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection


def validate_quantiles(quantiles: Sequence[float]) -> tuple[float, ...]:
    """Quantile levels must be strictly increasing inside (0, 1) and include the median."""
    qs = tuple(float(q) for q in quantiles)
    if len(qs) < 1 or not all(0.0 < q < 1.0 for q in qs) or any(b <= a for a, b in itertools.pairwise(qs)):
        raise ValueError(f"quantiles must be strictly increasing inside (0, 1), got {tuple(quantiles)!r}")
    if 0.5 not in qs:
        raise ValueError(f"quantiles must include the median 0.5 (median metrics use it), got {qs!r}")
    return qs


def pinball_loss(pred: Tensor, target: Tensor, quantiles: Tensor) -> Tensor:
    """Elementwise quantile (pinball) loss [..., Q] in float32: max(q e, (q - 1) e), e = y - y_hat."""
    err = target.float().unsqueeze(-1) - pred.float()
    q = quantiles.to(device=err.device, dtype=err.dtype)
    return torch.maximum(q * err, (q - 1.0) * err)


def _finite(pred: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    keep = torch.isfinite(target)
    return pred[keep], target[keep]


class _SumCountMetric(Metric):
    """Ratio of two summed states, synchronised across processes by summation."""

    full_state_update = False
    higher_is_better: bool | None = None

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.add_state("numerator", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("denominator", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def compute(self) -> Tensor:
        return (self.numerator / self.denominator).float()


class MeanQuantileLoss(_SumCountMetric):
    """Pinball loss averaged over targets, horizons and quantile levels."""

    higher_is_better = False

    def __init__(self, quantiles: Sequence[float], **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.register_buffer("quantiles", torch.tensor(list(quantiles), dtype=torch.float32), persistent=False)

    def update(self, pred: Tensor, target: Tensor) -> None:
        pred, target = _finite(pred, target)
        loss = pinball_loss(pred, target, self.quantiles)
        self.numerator += loss.double().sum()
        self.denominator += loss.numel()


class QuantileRisk(_SumCountMetric):
    """The TFT paper's normalised q-risk: 2 * sum QL(y, y_hat_q, q) / sum |y| for one quantile level."""

    higher_is_better = False

    def __init__(self, quantile: float, index: int, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.quantile, self.index = float(quantile), int(index)

    def update(self, pred: Tensor, target: Tensor) -> None:
        pred, target = _finite(pred, target)
        p = pred[..., self.index].float()
        err = target.float() - p
        ql = torch.maximum(self.quantile * err, (self.quantile - 1.0) * err)
        self.numerator += 2.0 * ql.double().sum()
        self.denominator += target.double().abs().sum()


class IntervalCoverage(_SumCountMetric):
    """Share of targets inside [pred[lower], pred[upper]]; nominal is q_upper - q_lower."""

    def __init__(self, lower: int = 0, upper: int = -1, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.lower, self.upper = int(lower), int(upper)

    def update(self, pred: Tensor, target: Tensor) -> None:
        pred, target = _finite(pred, target)
        inside = (target >= pred[..., self.lower]) & (target <= pred[..., self.upper])
        self.numerator += inside.double().sum()
        self.denominator += inside.numel()


class MedianForecastMAE(_SumCountMetric):
    """Mean absolute error of the median forecast (pred[..., median])."""

    higher_is_better = False

    def __init__(self, median: int, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.median = int(median)

    def update(self, pred: Tensor, target: Tensor) -> None:
        pred, target = _finite(pred, target)
        self.numerator += (pred[..., self.median].double() - target.double()).abs().sum()
        self.denominator += target.numel()


class DirectionalAccuracy(_SumCountMetric):
    """Share of non-zero targets whose sign the median forecast gets right (a zero forecast counts as wrong)."""

    higher_is_better = True

    def __init__(self, median: int, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.median = int(median)

    def update(self, pred: Tensor, target: Tensor) -> None:
        pred, target = _finite(pred, target)
        moved = target != 0
        hit = torch.sign(pred[..., self.median]) == torch.sign(target)
        self.numerator += (hit & moved).double().sum()
        self.denominator += moved.double().sum()


def forecast_metrics(quantiles: Sequence[float], prefix: str = "") -> MetricCollection:
    """The forecast metrics of one stage: quantile_loss, q_risk_p50, q_risk_p90 (if 0.9 is a level), coverage
    (outer interval), mae_median, directional_accuracy."""
    qs = validate_quantiles(quantiles)
    median = qs.index(0.5)
    metrics: dict[str, Metric] = {
        "quantile_loss": MeanQuantileLoss(qs),
        "q_risk_p50": QuantileRisk(0.5, median),
    }
    if 0.9 in qs:
        metrics["q_risk_p90"] = QuantileRisk(0.9, qs.index(0.9))
    if len(qs) >= 2:
        metrics["coverage"] = IntervalCoverage(0, len(qs) - 1)
    metrics["mae_median"] = MedianForecastMAE(median)
    metrics["directional_accuracy"] = DirectionalAccuracy(median)
    return MetricCollection(metrics, prefix=prefix, compute_groups=False)
