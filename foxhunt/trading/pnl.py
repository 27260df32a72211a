"""The exact per-bar P&L of a position series after transaction costs, shared by the agents' environment, the oracle
and the back-test so that every member is trained and scored on the same arithmetic.

Conventions:
- ``positions[..., t]`` is the position held from the close of bar t to the close of bar t+1 (decided at bar t), as a
  fraction of equity: the account is rebalanced to ``positions[t]`` of its equity at every close (-1 a full short,
  0.5 half long);
- ``returns[..., t]`` is the raw log return r_t = ln C[t+1] - ln C[t] earned by that position (NaN counts as 0);
- a trade of |Δw| = |positions[t] - positions[t-1]| pays ``c = cost_bps * 1e-4`` of equity per unit of position
  traded, at the close of bar t (the position before the first bar, or at a bar where ``reset`` is True, e.g. a new
  symbol, is flat);
- so bar t multiplies wealth by (1 - c|Δw|)(1 + w (e^r - 1)), and the per-bar strategy log return is exactly

      log1p(-c |Δw|) + log1p(w * expm1(r))       (:func:`cost_log_returns` + :func:`position_log_returns`).

  It equals w·r - c|Δw| only to first order: the gross part is exact for w in {0, 1}; for a short, log1p(-expm1(r))
  = -r - r² - ..., so the linear form w·r would overstate a short by about r² a bar (always short SPY, daily bars
  1993-2026: 3.4% a year) and understate a fractional long by about w(1-w)σ²/2 a bar. Per-bar log returns add up:
  the equity curve is their cumulative sum, i.e. the product of the per-bar wealth multipliers.
- Ruin: where a multiplier is <= 0 (a short through a bar whose simple return is >= 1/|w|, for a full short the price
  doubling, r >= ln 2; a levered long, w > 1, through a fall of 1/w or more; a cost of 100% of equity or more) it is
  floored at ``RUIN_FLOOR`` (1e-12, a log return of about -27.6), so every figure stays finite; the account is in
  effect wiped out there.

Which bars count (masks, exits at excluded bars) and the metrics built on these returns are
:mod:`foxhunt.evaluation.trading`'s.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

RUIN_FLOOR = 1e-12  # the smallest wealth multiplier of one bar (an account wiped out), keeps log returns finite
LOG_RUIN_FLOOR = math.log(RUIN_FLOOR)


def log_growth(x: Tensor) -> Tensor:
    """log(1 + x) of a change of wealth by a fraction ``x`` of equity, floored at log(``RUIN_FLOOR``) where
    1 + x <= ``RUIN_FLOOR`` (ruin; see the module docstring). Accurate for small ``x`` (log1p) in any float dtype."""
    return torch.log1p(x.clamp_min(-1.0)).clamp_min_(LOG_RUIN_FLOOR)


def position_log_returns(positions: Tensor, simple_returns: Tensor) -> Tensor:
    """Gross per-bar log return log(1 + w (e^r - 1)) of holding ``positions`` w (fractions of equity, rebalanced every
    bar) through bars of simple return ``simple_returns`` = e^r - 1 (pass ``torch.expm1(log_returns)``, computed once
    where the same returns are used many times); ruin-floored."""
    return log_growth(positions * simple_returns)


def cost_log_returns(changes: Tensor, cost_bps: float) -> Tensor:
    """Log return log(1 - c |Δw|) of paying ``cost_bps`` per unit of position traded (``changes`` = |Δw|)."""
    return log_growth(changes * (-cost_bps * 1e-4))


def position_changes(positions: Tensor, reset: Tensor | None = None) -> Tensor:
    """|Δposition| per bar, with a flat position before the first bar and before every ``reset`` bar."""
    prev = torch.zeros_like(positions)
    prev[..., 1:] = positions[..., :-1]
    if reset is not None:
        prev = torch.where(reset, torch.zeros_like(prev), prev)
    return (positions - prev).abs()


def strategy_log_returns(
    positions: Tensor, returns: Tensor, cost_bps: float, reset: Tensor | None = None
) -> Tensor:
    """Per-bar log return of the strategy after proportional costs, at every bar (see the module docstring).

    No mask: a position held into a bar is paid for there. To score a policy on the bars that count (positions forced
    flat elsewhere, exits attributed to the counted bars) use :func:`foxhunt.evaluation.trading.counted_log_returns`.
    """
    positions = positions.to(returns.dtype)
    simple = torch.expm1(torch.nan_to_num(returns, nan=0.0, posinf=0.0, neginf=0.0))
    return position_log_returns(positions, simple) + cost_log_returns(position_changes(positions, reset), cost_bps)
