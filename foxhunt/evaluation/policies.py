"""Turning forecasts and member positions into trading positions: the TFT's own policy and the ensemble combinations."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from foxhunt.trading.policy_table import rollout_policy_table

Combine = Literal["stack", "vote", "sharpe_weighted"]


def forecast_policy(lower: Tensor, median: Tensor, upper: Tensor, cost_bps: float, decision: Tensor, reset: Tensor) -> Tensor:
    """Long when the forecast interval's lower edge clears the cost, short when the upper edge is below −cost.

    Once in a position, it is held while the median does not point against it by more than the cost: leaving costs
    the cost at once, staying costs nothing, so a position is closed only when the expected move against it exceeds
    what closing costs (the myopic cost-aware rule; exiting at the median's first sign change paid the cost about
    every other bar on a weak signal). Otherwise the policy is flat. Rows where ``decision`` is False are flat.
    Positions in {-1, 0, 1}.
    """
    table = forecast_policy_table(lower, median, upper, cost_bps, decision, reset)
    return FORECAST_ACTIONS.to(median.device)[rollout_policy_table(table, FORECAST_FLAT)]


FORECAST_ACTIONS = torch.tensor([-1.0, 0.0, 1.0])  # the forecast policy's positions, by index
FORECAST_FLAT = 1  # the index of flat


def forecast_policy_table(lower: Tensor, median: Tensor, upper: Tensor, cost_bps: float, decision: Tensor,
                          reset: Tensor) -> Tensor:
    """[T, 3] the :func:`forecast_policy` as a table: the position index at bar t for each index held coming in (a
    back-test rolls it out over a split; a live session applies one row a bar to the position it holds)."""
    cost = cost_bps * 1e-4
    enter = torch.where(lower > cost, 2, torch.where(upper < -cost, 0, 1))  # long before short, else none
    entering = enter != FORECAST_FLAT
    # held short stays while the median is below the closing cost, held long while above minus it, flat stays flat
    hold = torch.stack((torch.where(median < cost, 0, 1), torch.ones_like(enter), torch.where(median > -cost, 2, 1)), 1)
    table = torch.where((entering | reset).unsqueeze(1), enter.unsqueeze(1), hold)  # a symbol's first bar: from flat
    return torch.where(decision.unsqueeze(1), table, FORECAST_FLAT)


def vote(positions: Sequence[Tensor]) -> Tensor:
    """Majority vote of member positions: the rounded mean, so one member long and one flat stays flat."""
    mean = torch.stack([p.to(torch.float32) for p in positions]).mean(0)
    return torch.round(mean).clamp(-1.0, 1.0)


def sharpe_weights(sharpes: Sequence[float]) -> list[float]:
    """Weights proportional to each member's positive validation Sharpe (all zero when none is positive)."""
    pos = [0.0 if math.isnan(float(s)) else max(float(s), 0.0) for s in sharpes]
    total = sum(pos)
    return [p / total for p in pos] if total > 0 else [0.0 for _ in pos]


def weighted(positions: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Sum of member positions weighted by ``weights`` (fractional positions in [-1, 1])."""
    out = torch.zeros_like(positions[0], dtype=torch.float32)
    for p, w in zip(positions, weights):
        out = out + float(w) * p.to(torch.float32)
    return out
