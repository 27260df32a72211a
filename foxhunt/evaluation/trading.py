"""Back-test metrics of position series after transaction costs, as batched tensor code.

Conventions (shared by the DQN, the ensemble and the back-test):
- ``positions[..., t]`` is the position held from the close of bar t to the close of bar t+1 (decided at bar t);
- ``returns[..., t]`` is the raw log return ln C[t+1] - ln C[t] earned by that position;
- the per-bar strategy log return is ``positions[t] * returns[t] - cost * |positions[t] - positions[t-1]|`` with
  ``cost = cost_bps * 1e-4`` per unit of position traded (the position before the first bar, or at a bar where
  ``reset`` is True, e.g. a new symbol, is flat). For positions in [-1, 1] this is the usual log-return approximation
  of a continuously rebalanced position; it is exact for fully long/flat positions apart from the cost term.
- ``mask`` (optional) selects the bars that count; excluded bars contribute nothing to any metric.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

NS_PER_YEAR = 365.25 * 24 * 3600 * 1e9


@dataclass
class TradingMetrics:
    """Back-test figures of one or a batch of position series (each field has the batch shape)."""

    reward_per_bar: Tensor  # mean per-bar strategy log return after costs
    sharpe: Tensor  # annualised: mean / std * sqrt(bars_per_year)
    total_log_return: Tensor  # sum of per-bar strategy log returns
    max_drawdown: Tensor  # largest peak-to-trough fall of equity, as a fraction in [0, 1)
    turnover: Tensor  # mean |Δposition| per bar
    hit_rate: Tensor  # fraction of bars in the market whose gross P&L is positive (NaN if never in the market)
    n_trades: Tensor  # number of bars at which the position changed
    exposure: Tensor  # fraction of bars with a non-zero position
    n_bars: Tensor  # bars counted

    def as_dict(self, prefix: str = "") -> dict[str, Tensor]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


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
    """Per-bar log return of the strategy after proportional costs (see the module docstring)."""
    positions = positions.to(returns.dtype)
    returns = torch.nan_to_num(returns, nan=0.0, posinf=0.0, neginf=0.0)
    return positions * returns - cost_bps * 1e-4 * position_changes(positions, reset)


def trading_metrics(
    positions: Tensor,
    returns: Tensor,
    cost_bps: float,
    bars_per_year: float,
    mask: Tensor | None = None,
    reset: Tensor | None = None,
) -> TradingMetrics:
    """Metrics over the last axis (bars); leading axes are a batch of strategies. Computed in float64."""
    if positions.shape[-1] != returns.shape[-1]:
        raise ValueError(f"positions have {positions.shape[-1]} bars, returns {returns.shape[-1]}")
    if bars_per_year <= 0 or not math.isfinite(bars_per_year):
        raise ValueError(f"bars_per_year must be a positive number, got {bars_per_year}")
    pos = positions.to(torch.float64)
    rets = returns.to(torch.float64).expand_as(pos)
    if mask is None:
        mask = torch.isfinite(returns)
    mask = mask.expand_as(pos)
    # Bars outside the mask are forced flat: what was held before them is closed (and paid) at their first bar.
    pos = torch.where(mask, pos, torch.zeros_like(pos))
    pnl = strategy_log_returns(pos, rets, cost_bps, reset if reset is None else reset.expand_as(pos))
    gross = pos * torch.nan_to_num(rets, nan=0.0, posinf=0.0, neginf=0.0)
    changes = position_changes(pos, reset if reset is None else reset.expand_as(pos))
    w = mask.to(torch.float64)
    n = w.sum(-1)
    n_safe = n.clamp_min(1.0)
    total = pnl.sum(-1)  # closing costs paid at masked bars count too
    mean = (pnl * w).sum(-1) / n_safe
    var = (((pnl - mean.unsqueeze(-1)) ** 2) * w).sum(-1) / (n_safe - 1.0).clamp_min(1.0)
    std = var.sqrt()
    sharpe = torch.where(std > 0, mean / std.clamp_min(1e-300) * math.sqrt(bars_per_year), torch.zeros_like(mean))
    equity = torch.cumsum(pnl, -1)
    peak = torch.cummax(torch.cat([torch.zeros_like(equity[..., :1]), equity], -1), -1).values[..., 1:]
    drawdown_log = (peak - equity).amax(-1) if equity.shape[-1] else torch.zeros_like(mean)
    in_market = (pos != 0) & mask
    n_in = in_market.sum(-1).to(torch.float64)
    hits = ((gross > 0) & in_market).sum(-1).to(torch.float64)
    hit_rate = torch.where(n_in > 0, hits / n_in.clamp_min(1.0), torch.full_like(n_in, float("nan")))
    return TradingMetrics(
        reward_per_bar=mean,
        sharpe=sharpe,
        total_log_return=total,
        max_drawdown=1.0 - torch.exp(-drawdown_log),
        turnover=(changes * w).sum(-1) / n_safe,
        hit_rate=hit_rate,
        n_trades=((changes > 0) & mask).sum(-1),
        exposure=n_in / n_safe,
        n_bars=n,
    )


def bars_per_year(timestamps_ns: Tensor, symbol_index: Tensor | None = None) -> float:
    """Bars per year as observed: bars per elapsed year of the data, pooled over symbols, for annualising Sharpe.

    A symbol with n bars spanning first..last counts n bars over (last - first) · n / (n - 1) of time (each bar
    stands for one interval). The density follows the trading calendar itself: daily equity bars give about 252 a
    year, 24x5 hourly FX about 6,260, 23x5 one-minute futures about 360,000, where the median spacing (365.25 days
    over one bar's spacing) would give 365, 8,766 and 525,960 and inflate every Sharpe by up to 1.2x. Over a short
    stretch the density depends on whether a weekend falls inside it: pass ``bars_per_year`` explicitly there.
    """
    ts = timestamps_ns.to(torch.int64)
    if ts.numel() < 2:
        raise ValueError("need at least two timestamps to infer the bar frequency")
    sym = torch.zeros_like(ts) if symbol_index is None else symbol_index.to(torch.int64)
    bars = elapsed = 0.0
    for s in torch.unique(sym).tolist():
        t = ts[sym == s]
        n = t.numel()
        span = float(t.max() - t.min())
        if n < 2 or span <= 0:
            continue
        bars += n
        elapsed += span * n / (n - 1)
    if elapsed <= 0:
        raise ValueError("no symbol has two distinct timestamps to infer the bar frequency from")
    return bars / (elapsed / NS_PER_YEAR)
