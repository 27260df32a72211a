"""Hand-made market splits the back-test and walk-forward tests share."""

from __future__ import annotations

import torch

from foxhunt.data.market import MarketSplit

HOUR = 3_600_000_000_000
T0 = 1_700_000_000_000_000_000


def hourly_split(returns: list[float], name: str = "s", t0: int = T0) -> MarketSplit:
    """One symbol of hourly bars from ``t0`` with these next returns (NaN: none, not a decision bar)."""
    r = torch.tensor(returns, dtype=torch.float32)
    n = len(returns)
    ts = t0 + torch.arange(n, dtype=torch.int64) * HOUR
    return MarketSplit(name, ["A"], ts, torch.zeros(n, dtype=torch.int64), torch.ones(n, 5, dtype=torch.float64), r,
                       torch.nan_to_num(r), torch.isfinite(r))
