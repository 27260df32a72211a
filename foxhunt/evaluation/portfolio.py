"""A multi-symbol policy scored as the book it is: one P&L per timestamp, the symbols' weighting made explicit.

Each symbol's counted per-bar P&L (:func:`~foxhunt.evaluation.trading.counted_log_returns`: its position a fraction
of that symbol's capital, every exit counted) is a sleeve of the book. ``weighting="equal"`` gives every symbol traded
on the split the same capital, 1/K of the book's equity, rebalanced each bar; ``"gross"`` takes the positions as
fractions of the whole book's equity (a gross exposure up to K). At each timestamp the book's simple return is
``Σ_s w_s expm1(pnl_s,t)`` (a symbol without a bar then holds its sleeve in cash) and its log return that, floored
at ruin as :mod:`foxhunt.trading.pnl`. Every figure of a multi-symbol back-test is computed on this series: stacking
the symbols' bars one after another would treat same-time, correlated bars as independent ones and compute a
drawdown no account had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from foxhunt.evaluation.trading import TradingMetrics, counted_log_returns, counted_position_changes, pnl_figures
from foxhunt.trading.pnl import log_growth, position_changes

if TYPE_CHECKING:
    from foxhunt.data.market import MarketSplit

Weighting = Literal["equal", "gross"]
WEIGHTINGS = ("equal", "gross")


@dataclass
class Book:
    """One policy's book on a split, per counted timestamp (a timestamp where some symbol has a decision bar)."""

    timestamps: Tensor  # [N] int64, increasing
    pnl: Tensor  # [N] float64: the book's log return after costs
    gross: Tensor  # [N] float64: the book's simple return before costs
    traded: Tensor  # [N] float64: Σ_s w_s |Δposition_s| (each exit counted at its symbol's bar before it)
    in_market: Tensor  # [N] bool: some symbol holds a position
    position: Tensor  # [N] float64: Σ_s w_s position_s, the book's net exposure (a fraction of its equity)
    n_trades: int  # position changes over all symbols
    n_symbols: int  # K, the symbols traded on the split
    weight: float  # w_s of every symbol: 1/K (equal) or 1 (gross)


def symbol_weight(n_symbols: int, weighting: Weighting) -> float:
    """Each symbol's weight in a book of ``n_symbols``: 1/K for ``equal``, 1 for ``gross``."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    return 1.0 / n_symbols if weighting == "equal" else 1.0


def book(positions: Tensor, split: MarketSplit, cost_bps: float, weighting: Weighting = "equal") -> Book:
    """The book of one policy's positions [T] on ``split`` (rows by symbol and time, as ``MarketSplit``)."""
    dev = positions.device
    decision, reset = split.valid.to(dev), split.first_bar.to(dev)
    returns = split.returns.to(dev).double()
    pos = torch.where(decision, positions.double(), torch.zeros_like(positions, dtype=torch.float64))
    rows = counted_log_returns(pos, returns, cost_bps, decision, reset)
    traded_rows = counted_position_changes(pos, decision, reset)
    gross_rows = pos * torch.expm1(torch.nan_to_num(returns, nan=0.0, posinf=0.0, neginf=0.0))
    n_trades = int((position_changes(pos, reset) > 0).sum())
    ts = split.timestamps.to(dev)[decision]
    symbols = split.symbol_index.to(dev)[decision]
    k = max(1, int(torch.unique(symbols).numel()))
    w = symbol_weight(k, weighting)
    stamps, at = torch.unique(ts, return_inverse=True)

    def per_stamp(values: Tensor) -> Tensor:
        return torch.zeros(stamps.numel(), dtype=torch.float64, device=dev).index_add_(0, at, values)

    in_market = per_stamp((pos[decision] != 0).double()) > 0
    if k == 1:  # one symbol: the book is its own series, bit for bit
        return Book(stamps, rows[decision], gross_rows[decision], traded_rows[decision], in_market, pos[decision],
                    n_trades, 1, 1.0)
    pnl = log_growth(per_stamp(w * torch.expm1(rows[decision])))
    return Book(stamps, pnl, per_stamp(w * gross_rows[decision]), per_stamp(w * traded_rows[decision]), in_market,
                per_stamp(w * pos[decision]), n_trades, k, w)


def book_metrics(b: Book, bars_per_year: float) -> TradingMetrics:
    """The back-test figures of a book, as :func:`~foxhunt.evaluation.trading.trading_metrics` gives them for one
    series: per-bar figures per timestamp, trades over all symbols, exposure the share of timestamps in the market."""
    mask = torch.ones_like(b.pnl, dtype=torch.bool)
    mean, sharpe, total, max_drawdown, n = pnl_figures(b.pnl, mask, bars_per_year)
    n_safe = n.clamp_min(1.0)
    n_in = b.in_market.sum().double()
    hits = ((b.gross > 0) & b.in_market).sum().double()
    return TradingMetrics(
        reward_per_bar=mean,
        sharpe=sharpe,
        total_log_return=total,
        max_drawdown=max_drawdown,
        turnover=b.traded.sum() / n_safe,
        hit_rate=hits / n_in if n_in > 0 else torch.tensor(float("nan"), dtype=torch.float64),
        n_trades=torch.tensor(b.n_trades),
        exposure=n_in / n_safe,
        n_bars=n,
    )
