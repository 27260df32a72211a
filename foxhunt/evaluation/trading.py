"""Back-test metrics of position series after transaction costs, as batched tensor code.

The per-bar P&L and its conventions (positions as fractions of equity held from close t to close t+1, costs per unit
traded, the exact log return, the ruin floor) are :mod:`foxhunt.trading.pnl`'s; this module says which bars count.
``mask`` (optional) selects them. Positions are forced flat at excluded bars, so the only P&L that can arise at one is
the cost of closing the position held at the bar before it (a symbol's last bar, a data hole); that cost and its
|Δposition| are attributed to the last counted bar before it of the same symbol (:func:`counted_log_returns`), so the
sum of the counted per-bar P&L is the total log return, and the per-bar figures (reward per bar, Sharpe, PSR,
intervals), turnover and the number of trades all include every exit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from foxhunt.evaluation.significance import MIN_BARS, SHARPE_RTOL
from foxhunt.trading.pnl import cost_log_returns, position_changes, position_log_returns, strategy_log_returns

NS_PER_YEAR = 365.25 * 24 * 3600 * 1e9


@dataclass
class TradingMetrics:
    """Back-test figures of one or a batch of position series (each field has the batch shape)."""

    reward_per_bar: Tensor  # mean per-bar strategy log return after costs over the counted bars (exits included)
    sharpe: Tensor  # annualised mean / std * sqrt(bars_per_year) of the counted per-bar log returns (0 flat, NaN: none)
    total_log_return: Tensor  # sum of the counted per-bar strategy log returns (= reward_per_bar * n_bars)
    max_drawdown: Tensor  # largest peak-to-trough fall of equity, as a fraction in [0, 1)
    turnover: Tensor  # mean |Δposition| per counted bar (the closes at excluded bars included)
    hit_rate: Tensor  # fraction of bars in the market whose gross P&L is positive (NaN if never in the market)
    n_trades: Tensor  # number of position changes (the closes at excluded bars included)
    exposure: Tensor  # fraction of bars with a non-zero position
    n_bars: Tensor  # bars counted

    def as_dict(self, prefix: str = "") -> dict[str, Tensor]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


def _counted_bar_of(mask: Tensor, reset: Tensor | None) -> Tensor:
    """[..., T] the bar each bar's P&L is counted at: itself where ``mask`` is True; for an excluded bar the last
    counted bar before it of the same segment (a segment starts at every ``reset`` bar), found with a running max of
    counted bar indices; itself again where there is none (nothing can be paid there: positions were flat since the
    segment's start)."""
    t = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    last = torch.cummax(torch.where(mask, t, torch.full_like(t, -1)), -1).values  # last counted bar <= t
    attributable = ~mask & (last >= 0)
    if reset is not None:
        seg = torch.cumsum(reset.to(torch.int64), -1)
        attributable &= seg.gather(-1, last.clamp_min(0)) == seg
    return torch.where(attributable, last, t)


def _on_counted_bars(values: Tensor, counted_bar: Tensor, mask: Tensor) -> Tensor:
    """``values`` summed onto the bars they are counted at (:func:`_counted_bar_of`), zero at excluded bars."""
    moved = torch.zeros_like(values).scatter_add_(-1, counted_bar, values)
    return torch.where(mask, moved, torch.zeros_like(moved))


def counted_log_returns(
    positions: Tensor, returns: Tensor, cost_bps: float, mask: Tensor | None = None, reset: Tensor | None = None
) -> Tensor:
    """[..., T] per-bar strategy log return after costs of the bars that count, 0 at the others (float64).

    Positions are forced flat outside ``mask`` (default: the bars with a finite return); the cost of closing a
    position at an excluded bar is attributed to the last counted bar before it of the same symbol (``reset`` starts
    a symbol), so ``counted_log_returns(...).sum(-1)`` is the strategy's whole log return and
    ``counted_log_returns(...)[mask]`` the per-bar P&L that Sharpe, PSR and their intervals read. These are exactly
    the per-bar figures :func:`trading_metrics` computes with the same arguments.
    """
    pos, rets, mask, reset = _prepare(positions, returns, mask, reset)
    if pos.shape[-1] == 0:
        return pos
    return _on_counted_bars(strategy_log_returns(pos, rets, cost_bps, reset), _counted_bar_of(mask, reset), mask)


def counted_position_changes(positions: Tensor, mask: Tensor, reset: Tensor | None = None) -> Tensor:
    """[..., T] |Δposition| per counted bar, 0 at the others (float64): positions forced flat outside ``mask``, each
    close at an excluded bar attributed like its cost (:func:`counted_log_returns`); the turnover of
    :func:`trading_metrics` is its mean over the counted bars."""
    pos, _, mask, reset = _prepare(positions, positions, mask, reset)
    changes = position_changes(pos, reset)
    return changes if pos.shape[-1] == 0 else _on_counted_bars(changes, _counted_bar_of(mask, reset), mask)


def _prepare(
    positions: Tensor, returns: Tensor, mask: Tensor | None, reset: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(positions forced flat outside the mask, returns, mask, reset), float64 and broadcast to one shape."""
    if positions.shape[-1] != returns.shape[-1]:
        raise ValueError(f"positions have {positions.shape[-1]} bars, returns {returns.shape[-1]}")
    pos = positions.to(torch.float64)
    rets = returns.to(torch.float64)
    shape = torch.broadcast_shapes(pos.shape, rets.shape)
    pos, rets = pos.expand(shape), rets.expand(shape)
    if mask is None:
        mask = torch.isfinite(rets)
    mask = mask.to(torch.bool).expand(shape)
    reset = None if reset is None else reset.to(torch.bool).expand(shape)
    pos = torch.where(mask, pos, torch.zeros_like(pos))
    return pos, rets, mask, reset


def pnl_figures(
    pnl: Tensor, mask: Tensor, bars_per_year: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(reward per bar, annualised Sharpe, total log return, max drawdown, bars) of per-bar log returns ``pnl``
    [..., T] over the ``mask`` bars (0 at the others), one rule for a symbol's series and a book's: a flat book has
    Sharpe 0, fewer than 3 bars or no spread beyond rounding none (NaN)."""
    w = mask.to(torch.float64)
    n = w.sum(-1)
    n_safe = n.clamp_min(1.0)
    total = pnl.sum(-1)
    mean = total / n_safe
    var = (((pnl - mean.unsqueeze(-1)) ** 2) * w).sum(-1) / (n_safe - 1.0).clamp_min(1.0)
    std = var.sqrt()
    scale = torch.where(mask, pnl.abs(), torch.zeros_like(pnl)).amax(-1) if pnl.shape[-1] else torch.zeros_like(mean)
    has_sharpe = (n >= MIN_BARS) & (std > SHARPE_RTOL * scale)  # significance's rule: no spread beyond rounding, none
    no_sharpe = torch.where(scale == 0, torch.zeros_like(mean), torch.full_like(mean, math.nan))  # flat: 0
    sharpe = torch.where(has_sharpe, mean / std.clamp_min(1e-300) * math.sqrt(bars_per_year), no_sharpe)
    equity = torch.cumsum(pnl, -1)
    peak = torch.cummax(torch.cat([torch.zeros_like(equity[..., :1]), equity], -1), -1).values[..., 1:]
    drawdown_log = (peak - equity).amax(-1) if equity.shape[-1] else torch.zeros_like(mean)
    return mean, sharpe, total, 1.0 - torch.exp(-drawdown_log), n


def trading_metrics(
    positions: Tensor,
    returns: Tensor,
    cost_bps: float,
    bars_per_year: float,
    mask: Tensor | None = None,
    reset: Tensor | None = None,
) -> TradingMetrics:
    """Metrics over the last axis (bars); leading axes are a batch of strategies. Computed in float64.

    Positions are forced flat outside ``mask`` (default: the bars with a finite return); every exit paid at an
    excluded bar is counted at the last counted bar before it (:func:`counted_log_returns`).

    The Sharpe follows :mod:`foxhunt.evaluation.significance`: a flat book (no counted bar with P&L) has Sharpe 0, it
    earned nothing at no risk; any other P&L with fewer than 3 counted bars or no spread beyond rounding (a constant
    P&L) has none, NaN (tables print n/a), never a ratio of rounding errors.
    """
    if bars_per_year <= 0 or not math.isfinite(bars_per_year):
        raise ValueError(f"bars_per_year must be a positive number, got {bars_per_year}")
    pos, rets, mask, reset = _prepare(positions, returns, mask, reset)
    gross = position_log_returns(pos, torch.expm1(torch.nan_to_num(rets, nan=0.0, posinf=0.0, neginf=0.0)))
    changes = position_changes(pos, reset)
    # Per-bar figures of the counted bars, each exit at an excluded bar moved onto the counted bar before it.
    if pos.shape[-1]:
        counted_bar = _counted_bar_of(mask, reset)
        pnl = _on_counted_bars(gross + cost_log_returns(changes, cost_bps), counted_bar, mask)
        traded = _on_counted_bars(changes, counted_bar, mask)
        trades = _on_counted_bars((changes > 0).to(torch.float64), counted_bar, mask)
    else:
        pnl = traded = trades = changes
    mean, sharpe, total, max_drawdown, n = pnl_figures(pnl, mask, bars_per_year)
    n_safe = n.clamp_min(1.0)
    in_market = (pos != 0) & mask
    n_in = in_market.sum(-1).to(torch.float64)
    hits = ((gross > 0) & in_market).sum(-1).to(torch.float64)
    hit_rate = torch.where(n_in > 0, hits / n_in.clamp_min(1.0), torch.full_like(n_in, float("nan")))
    return TradingMetrics(
        reward_per_bar=mean,
        sharpe=sharpe,
        total_log_return=total,
        max_drawdown=max_drawdown,
        turnover=traded.sum(-1) / n_safe,
        hit_rate=hit_rate,
        n_trades=trades.sum(-1).round().to(torch.int64),
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
