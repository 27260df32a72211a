"""The forecast policy's table (one row a bar in a live session, a whole split in a back-test) is the rule written out
bar by bar: enter long when the lower edge clears the cost (before short when the upper edge is below minus it), hold
while the median does not point against the position by more than the cost, flat where no decision is possible, a
symbol's first bar comes in flat."""

from __future__ import annotations

import math

import pytest
import torch

from foxhunt.evaluation.policies import FORECAST_FLAT, forecast_policy_table


def rule(lower: float, median: float, upper: float, cost: float, decision: bool, reset: bool, held: int) -> int:
    """The position index (0 short, 1 flat, 2 long) from ``held``, in plain Python floats."""
    if not decision:
        return FORECAST_FLAT
    held = FORECAST_FLAT if reset else held
    if lower > cost:
        return 2
    if upper < -cost:
        return 0
    if held == 0 and median < cost:
        return 0
    if held == 2 and median > -cost:
        return 2
    return FORECAST_FLAT


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cost_bps", [0.0, 2.5])
def test_the_table_is_the_rule_bar_by_bar(dtype: torch.dtype, cost_bps: float) -> None:
    """Every row and held position of the table equals the rule, over random intervals with NaNs, signed zeros, values
    exactly at plus/minus the cost and contradictory edges (lower above the cost and upper below minus it)."""
    g = torch.Generator().manual_seed(int(cost_bps * 10) + (dtype == torch.float64))
    n = 4000
    cost = cost_bps * 1e-4
    lower, median, upper = (torch.randn(n, generator=g, dtype=dtype) * 1e-3 for _ in range(3))
    for t in (lower, median, upper):
        t[torch.rand(n, generator=g) < 0.05] = math.nan
        t[torch.rand(n, generator=g) < 0.05] = cost
        t[torch.rand(n, generator=g) < 0.05] = -cost
        t[torch.rand(n, generator=g) < 0.03] = -0.0
    both = torch.rand(n, generator=g) < 0.05
    lower[both], upper[both] = 1.0, -1.0
    decision, reset = torch.rand(n, generator=g) > 0.2, torch.rand(n, generator=g) > 0.8
    table = forecast_policy_table(lower, median, upper, cost_bps, decision, reset)
    assert table.shape == (n, 3) and table.dtype == torch.int64
    c = float(torch.tensor(cost, dtype=dtype))  # the cost as the tensor compares it (float32 rounds it)
    got = table.tolist()
    for t in range(n):
        args = (float(lower[t]), float(median[t]), float(upper[t]), c, bool(decision[t]), bool(reset[t]))
        assert got[t] == [rule(*args, held) for held in range(3)], (t, args)
    assert {v for row in got for v in row} == {0, 1, 2}


def test_an_empty_split_gives_an_empty_table() -> None:
    """No bars: a [0, 3] table."""
    e = torch.zeros(0)
    assert forecast_policy_table(e, e, e, 1.0, e.bool(), e.bool()).shape == (0, 3)
