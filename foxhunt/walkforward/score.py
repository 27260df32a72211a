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


SIGNIFICANCE = ("sharpe_se", "sharpe_ci_low", "sharpe_ci_high", "psr_vs_flat", "psr_vs_benchmark")


def score(positions: dict[str, torch.Tensor], split: MarketSplit, cost_bps: float, bars_per_year: float,
           significance: bool = True, n_boot: int | None = None) -> dict[str, dict[str, float]]:
    """Back-test metrics of every policy on a split and, with ``significance`` where ``evaluation.significance``
    exists, the significance of each Sharpe ratio (``SIGNIFICANCE``: standard error, 95% stationary-bootstrap interval
    of ``n_boot`` replicates, PSR against flat and against buy-and-hold), under the names the back-test tables use."""
    from foxhunt.evaluation.backtest import policy_metrics, policy_pnl

    metrics = policy_metrics(positions, split, cost_bps, bars_per_year)
    summary = significance_summary()
    if summary is None or not significance:
        return metrics
    benchmark = policy_pnl(positions["buy_and_hold"], split, cost_bps) if "buy_and_hold" in positions else None
    if n_boot is None:  # 1000 replicates, fewer (not under 200) on long series: bounded work
        n_boot = max(200, min(1000, int(2e7 // max(int(split.valid.sum()), 1))))
    for policy, p in positions.items():
        stats = summary(policy_pnl(p, split, cost_bps), bars_per_year, benchmark_pnl=benchmark, n_boot=n_boot, seed=0)
        metrics[policy].update({key: float(stats[key]) for key in SIGNIFICANCE})
    return metrics


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
