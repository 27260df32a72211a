"""A stretch's positions scored as an account of its own: back-test metrics and the Sharpe ratios' significance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from foxhunt.data.market import MarketSplit


def significance_summary() -> Any:
    """``evaluation.significance.sharpe_summary`` when that module exists (None otherwise)."""
    try:
        from foxhunt.evaluation.significance import sharpe_summary
    except ImportError:
        return None
    return sharpe_summary


def score(positions: dict[str, torch.Tensor], split: MarketSplit, cost_bps: float, bars_per_year: float,
          significance: bool = True, n_boot: int | None = None) -> dict[str, dict[str, float]]:
    """Back-test metrics of every policy on a split (one book over its symbols) and, with ``significance``, each
    Sharpe's significance (``evaluation.backtest.SIGNIFICANCE``: HAC standard error, stationary-bootstrap interval of
    ``n_boot`` replicates (default 999), HAC PSR against flat, Lo's annual Sharpe, Ledoit & Wolf's paired test
    against buy-and-hold), under the names the back-test tables use."""
    from foxhunt.evaluation.backtest import N_BOOT, policy_metrics

    return policy_metrics(positions, split, cost_bps, bars_per_year, significance=significance and
                          significance_summary() is not None, n_boot=N_BOOT if n_boot is None else n_boot)


def own_account(positions: dict[str, torch.Tensor], split: MarketSplit,
                 close_after: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], MarketSplit]:
    """One fold's stretch as an account of its own, flat before its first bar and after its last: each symbol's
    rows get one more row after them that is no decision bar (no return, position flat), so a position still held at
    the stretch's last bar (whose return runs into the next fold) is closed and its cost counted there, as
    ``counted_log_returns`` counts every exit. ``close_after`` [T] (bool) closes the account after those rows too
    (before a gap: a fold not gathered). Decision bars, and so every per-bar figure's bar count, are unchanged."""
    from dataclasses import fields, replace

    n = len(split)
    if n == 0:
        return positions, split
    last = split.last_bar
    if close_after is not None:
        last |= close_after
    rows = torch.cat([torch.arange(n), last.nonzero().squeeze(1)])
    order = torch.argsort(rows, stable=True)  # each extra row right after its symbol's last row
    rows, extra = rows[order], (order >= n)
    picked = {f.name: getattr(split, f.name)[rows] for f in fields(split) if isinstance(getattr(split, f.name), torch.Tensor)}
    closed = replace(split, **picked)
    closed.returns = torch.where(extra, torch.full_like(closed.returns, float("nan")), closed.returns)
    closed.valid = closed.valid & ~extra
    held = {p: v[rows.to(v.device)] for p, v in positions.items()}
    return {p: torch.where(extra.to(v.device), torch.zeros_like(v), v) for p, v in held.items()}, closed
