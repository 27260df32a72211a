"""Back-tests of position series: every policy's after-cost metrics on a split, the oracle's positions, the table.

The coordinator produces positions (``{policy: [T]}``, decided at bar t and held to t+1); this module scores them.
The synthetic market's oracle comes with the data (``MarketSplit.oracle_mean``), so any split that carries it gets
an ``oracle`` row: the better, on these bars, of the two causal cost-aware oracles of :mod:`foxhunt.trading.oracle`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from foxhunt.data.market import MarketSplit
from foxhunt.evaluation.portfolio import Weighting, book, book_metrics
from foxhunt.evaluation.sharpe_difference import sharpe_difference_test
from foxhunt.evaluation.significance import sharpe_summary
from foxhunt.evaluation.trading import bars_per_year as infer_bars_per_year
from foxhunt.evaluation.trading import counted_log_returns, trading_metrics
from foxhunt.trading.oracle import oracle_positions
from foxhunt.trading.pnl import strategy_log_returns

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rich.table import Table

BACKTEST_KEYS = ("sharpe", "total_log_return", "reward_per_bar", "max_drawdown", "turnover", "hit_rate", "n_trades")

COLUMNS = (  # (metric, header: short, on two lines, so that the table fits a 120-column terminal, format)
    ("total_log_return", "log\nreturn", "{:+.4f}"),
    ("sharpe", "\nSharpe", "{:+.2f}"),
    ("sortino", "\nSortino", "{:+.2f}"),
    ("max_drawdown", "max\nDD", "{:.2%}"),
    ("turnover", "\nturnover", "{:.4f}"),
    ("hit_rate", "hit\nrate", "{:.3f}"),
    ("n_trades", "\ntrades", "{:.0f}"),
    ("weight", "ens.\nweight", "{:.3f}"),
    ("sharpe_lo", "Sharpe\nLo", "{:+.2f}"),
    ("sharpe_se", "SE\nHAC", "{:.2f}"),
    ("sharpe_ci", "\n95% CI", "[{:+.2f}, {:+.2f}]"),
    ("psr_vs_flat", "PSR\nflat", "{:.3f}"),
    ("sharpe_diff_vs_bh", "ΔSharpe\nvs B&H", "{:+.2f}"),
    ("p_vs_bh", "p B&H\nHAC", "{:.3f}"),
    ("p_vs_bh_boot", "p B&H\nboot", "{:.3f}"),
)
SIGNIFICANCE_KEYS = ("sharpe_lo", "sharpe_se", "sharpe_ci", "psr_vs_flat", "sharpe_diff_vs_bh", "p_vs_bh",
                     "p_vs_bh_boot")  # a second table's, when too wide
SIGNIFICANCE = ("sharpe_lo", "sharpe_se", "sharpe_se_iid", "sharpe_ci_low", "sharpe_ci_high", "psr_vs_flat",
                "psr_vs_flat_iid", "sharpe_diff_vs_bh", "sharpe_diff_vs_bh_se", "p_vs_bh", "p_vs_bh_boot")
N_BOOT = 999  # bootstrap replicates, on any length of split (the work is chunked)
TABLE_WIDTH = 120  # columns of the terminal the table is laid out for
LEGEND = (
    "log return: total after costs; Sharpe, Sortino: annualised (sqrt of bars a year); max DD: maximum drawdown; "
    "turnover: mean |position change| per bar; hit rate: share of the bars in the market that gained; ens. weight: "
    "weight in the ensemble; Sharpe Lo: annual Sharpe adjusted for autocorrelation (Lo 2002); SE HAC, 95% CI: the "
    "Sharpe's autocorrelation-robust standard error and studentised block-bootstrap interval; PSR flat: probability "
    "the true Sharpe is above 0 (HAC); ΔSharpe vs B&H, p B&H: Sharpe minus buy-and-hold's and the two-sided p-value of Ledoit & "
    "Wolf's paired test that they are equal (HAC delta method; studentised block bootstrap); buy-and-hold is long at "
    "every decision bar, so it exits and re-enters (and pays) at each hole in the data"
)


@dataclass
class PolicyEvaluation:
    """One evaluation of every policy on a split: positions, the forecasters' forecasts and the metrics."""

    split: MarketSplit
    positions: dict[str, Tensor]
    metrics: dict[str, dict[str, float]]
    cost_bps: float
    forecasts: dict[str, Tensor] = field(default_factory=dict)  # forecaster name -> [T, H, Q]


def split_bars_per_year(split: MarketSplit, override: float | None = None) -> float:
    """The Sharpe annualisation of a split: ``override`` when given, else inferred from its timestamps."""
    return float(override) if override else infer_bars_per_year(split.timestamps, split.symbol_index)


def oracle_split_positions(split: MarketSplit, cost_bps: float, device: torch.device | str = "cpu") -> Tensor | None:
    """[T] positions of the better causal oracle on ``split`` (None when the data has no known conditional mean)."""
    if split.oracle_mean is None:
        return None
    decision, reset = split.valid.to(device), split.first_bar.to(device)
    actions = torch.tensor([-1.0, 0.0, 1.0], device=device)
    mean = torch.nan_to_num(split.oracle_mean.to(device).double())
    returns = torch.nan_to_num(split.returns.to(device).double())
    best, best_reward = None, -float("inf")
    # the Markov oracle approximates the GARCH-scaled signal; the myopic one is sometimes better on a given stretch
    for kind in ("markov", "myopic"):
        p = oracle_positions(mean, actions, cost_bps, decision, reset, kind=kind).float()
        reward = float(counted_log_returns(p.double(), returns, cost_bps, decision, reset)[decision].mean())
        if reward > best_reward:
            best, best_reward = p, reward
    return best


def policy_pnl(positions: Tensor, split: MarketSplit, cost_bps: float, weighting: Weighting = "equal") -> Tensor:
    """Per-bar log return after costs of a position series on a split (float64): one symbol's counted bars, or for
    several symbols the book's return per timestamp (:mod:`foxhunt.evaluation.portfolio`, ``weighting``); the cost of
    closing at a bar that is not a decision bar (a symbol's last bar, a hole) counts at the decision bar before it."""
    return book(positions, split, cost_bps, weighting).pnl


def significance_metrics(pnl: Tensor, benchmark: Tensor | None, bars_per_year: float, n_boot: int = N_BOOT,
                         seed: int = 0) -> dict[str, float]:
    """The ``SIGNIFICANCE`` figures of one policy's P&L: its Sharpe's HAC SE, bootstrap interval, PSR and Lo's annual
    Sharpe (:func:`sharpe_summary`) and Ledoit & Wolf's paired test against ``benchmark`` (buy-and-hold) on the same
    bars (:func:`sharpe_difference_test`; NaN without one)."""
    stats = sharpe_summary(pnl, bars_per_year, n_boot=n_boot, seed=seed)
    out = {k: float(stats[k]) for k in SIGNIFICANCE if k in stats}
    test = None if benchmark is None else sharpe_difference_test(pnl, benchmark.to(pnl.device), bars_per_year,
                                                                 n_boot=n_boot, seed=seed)
    nan = float("nan")
    out["sharpe_diff_vs_bh"] = nan if test is None else test.difference
    out["sharpe_diff_vs_bh_se"] = nan if test is None else test.se
    out["p_vs_bh"] = nan if test is None else test.p_value
    out["p_vs_bh_boot"] = nan if test is None else test.p_value_bootstrap
    return out


def sortino(pnl: Tensor, bars_per_year: float) -> float:
    """Annualised Sortino ratio of per-bar P&L: the mean over the root mean square of its negative part."""
    if pnl.numel() < 2:
        return float("nan")
    downside = pnl.clamp_max(0).pow(2).mean().sqrt()
    return float(pnl.mean() / downside * math.sqrt(bars_per_year)) if downside > 0 else float("nan")


@torch.no_grad()
def policy_metrics(
    positions: dict[str, Tensor], split: MarketSplit, cost_bps: float, bars_per_year: float | None = None,
    significance: bool = False, seed: int = 0, weighting: Weighting = "equal", n_boot: int = N_BOOT,
) -> dict[str, dict[str, float]]:
    """After-cost metrics (Sharpe, Sortino, drawdown, turnover, ...) of every policy's positions on a split.

    Several symbols are one book (:mod:`foxhunt.evaluation.portfolio`, ``weighting``): every figure is the book's,
    per timestamp; ``n_symbols`` and ``symbol_weight`` say which book. ``significance`` adds, per policy, the
    ``SIGNIFICANCE`` figures (:func:`significance_metrics`, ``n_boot`` bootstrap replicates; docs/STATISTICS.md);
    the reported tables use it, validation (which runs every epoch) does not.
    """
    bpy = split_bars_per_year(split, bars_per_year)
    results: dict[str, dict[str, float]] = {}
    pnls: dict[str, Tensor] = {}
    for who, p in positions.items():
        dev = p.device
        returns, decision, reset = split.returns.to(dev), split.valid.to(dev), split.first_bar.to(dev)
        bad = decision & ~torch.isfinite(p)  # would make its P&L NaN and its Sharpe a silent 0
        if bool(bad.any()):
            raise ValueError(f"{who}: {int(bad.sum())} non-finite position(s) at decision bars of split {split.name!r} "
                             f"(first at row {int(bad.nonzero()[0])}); refusing to score it")
        b = book(p, split, cost_bps, weighting)
        m = trading_metrics(p, returns, cost_bps, bpy, mask=decision, reset=reset) if b.n_symbols == 1 else \
            book_metrics(b, bpy)
        results[who] = {k: float(v) for k, v in m.as_dict().items()}
        results[who].update(n_symbols=float(b.n_symbols), symbol_weight=b.weight)
        pnls[who] = b.pnl
        results[who]["sortino"] = sortino(pnls[who], bpy)
    if significance:
        benchmark = policy_pnl(split.valid.float(), split, cost_bps, weighting)  # buy-and-hold
        for who, pnl in pnls.items():
            results[who].update(significance_metrics(pnl, benchmark, bpy, n_boot, seed))
    return results


def symbol_metrics(positions: dict[str, Tensor], split: MarketSplit, cost_bps: float,
                   bars_per_year: float | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """``{symbol: {policy: metrics}}``: each symbol's own back-test (:func:`policy_metrics` on its rows), the tables
    beside a book's."""
    bpy = split_bars_per_year(split, bars_per_year)
    out = {}
    for code in torch.unique(split.symbol_index).tolist():
        rows = split.symbol_index == code
        if bool(split.valid[rows].any()):
            out[split.symbols[code]] = policy_metrics({w: p[rows.to(p.device)] for w, p in positions.items()},
                                                      split.select(rows), cost_bps, bpy)
    return out


def format_symbols(per_symbol: dict[str, dict[str, dict[str, float]]], key: str = "sharpe") -> str:
    """One row per policy, one column per symbol: each symbol's own ``key`` (Sharpe by default)."""
    symbols = list(per_symbol)
    policies = list(next(iter(per_symbol.values()))) if per_symbol else []
    head = f"{'policy':<22}" + "".join(f"{s[:11]:>12}" for s in symbols)
    rows = [f"{key} per symbol (each symbol traded on its own capital)", head, "-" * len(head)]
    for who in policies:
        rows.append(f"{who[:21]:<22}" + "".join(f"{_cell(per_symbol[s].get(who, {}), key, '{:+.2f}'):>12}"
                                               for s in symbols))
    return "\n".join(rows)


@torch.no_grad()
def equity_curves(positions: dict[str, Tensor], split: MarketSplit, cost_bps: float) -> dict[str, Tensor]:
    """Cumulative after-cost log return of every policy's positions on a split (on the CPU)."""
    curves = {}
    for who, p in positions.items():
        returns, mask, reset = split.returns.to(p.device), split.valid.to(p.device), split.first_bar.to(p.device)
        held = torch.where(mask, p.double(), torch.zeros_like(p, dtype=torch.float64))
        curves[who] = torch.cumsum(strategy_log_returns(held, returns.double(), cost_bps, reset), 0).cpu()
    return curves


ORACLE_NOTE = (
    "oracle: the best causal cost-aware policy given the synthetic market's true conditional mean of the next return "
    "(it knows the planted signal, never a future bar); a ceiling for the members, not a tradable strategy"
)


def format_table(results: dict[str, dict[str, float]], split: str | None = None, width: int = TABLE_WIDTH) -> str:
    """A plain-text table no wider than ``width`` (rich; a terminal's 120 columns by default), one row per policy (a
    member that never updated is marked "untrained", one the do-no-harm rule holds flat "held flat", with its
    validation edge confidence below), headed by the split it was computed on, its short headers explained below.
    Figures too wide for one table (Sharpes in the hundreds on a few days of minute bars) put the Sharpe's
    significance in a second one, so that no figure is ever cut short."""
    import io

    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, markup=False, emoji=False, highlight=False,
                      force_jupyter=False)  # in a notebook too: the text, not a displayed widget
    tables = [_rich_table(results, COLUMNS)]
    if console.measure(tables[0], options=console.options.update_width(10 * width)).maximum > width:  # natural width
        significance = {"sharpe", *SIGNIFICANCE_KEYS}
        tables = [_rich_table(results, [c for c in COLUMNS if c[0] not in SIGNIFICANCE_KEYS]),
                  _rich_table(results, [c for c in COLUMNS if c[0] in significance])]
    for k, table in enumerate(tables):
        console.print(*([""] if k else []), table)
    rows = [f"split: {split}"] if split else []
    first = next(iter(results.values()), {})
    if first.get("n_symbols", 1) > 1:
        k, w = int(first["n_symbols"]), first.get("symbol_weight", float("nan"))
        rows.append(f"one book of {k} symbols, each position a fraction of "
                    + (f"1/{k} of the equity (equal weight)" if abs(w * k - 1) < 1e-12
                       else "the whole equity (gross)") + ": every figure is the book's, per timestamp")
    rows += [line.rstrip() for line in out.getvalue().splitlines()]
    rows += _wrapped(LEGEND, width)
    flat = {who: m.get("edge_confidence", float("nan")) for who, m in results.items() if m.get("held_flat") == 1}
    if flat:
        confidence = ", ".join(f"{w} {c:.2f}" for w, c in flat.items())
        rows += _wrapped(f"held flat (validation edge confidence: {confidence}): by the do-no-harm rule, a member "
                         "without a significant edge after costs on validation does not trade", width)
    if "oracle" in results:
        rows += _wrapped(ORACLE_NOTE, width)
    return "\n".join(rows)


def _rich_table(results: dict[str, dict[str, float]], columns: Sequence[tuple[str, str, str]]) -> Table:
    """The rich table of ``columns`` (of ``COLUMNS``), one row per policy, a dashed line under the headers."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rule = box.Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)
    table = Table(box=rule, show_edge=False, pad_edge=False, collapse_padding=True, header_style="none")
    table.add_column(Text("\npolicy"), overflow="fold")  # a long member name wraps; the figures never do
    for _, label, _ in columns:
        table.add_column(Text(label), justify="right", no_wrap=True)
    for who, m in results.items():
        label = f"{who} (untrained)" if m.get("updates") == 0 else f"{who} (held flat)" if m.get("held_flat") == 1 else who
        table.add_row(Text(label), *(Text(_cell(m, key, fmt)) for key, _, fmt in columns))
    return table


def _cell(m: dict[str, float], key: str, fmt: str) -> str:
    """One figure of a table row as printed ("n/a" where it has no value)."""
    if key == "sharpe_ci":
        lo, hi = m.get("sharpe_ci_low", float("nan")), m.get("sharpe_ci_high", float("nan"))
        return "n/a" if math.isnan(lo) or math.isnan(hi) else fmt.format(lo, hi)
    v = m.get(key, float("nan"))
    return "n/a" if math.isnan(v) else fmt.format(v)


def _wrapped(text: str, width: int) -> list[str]:
    """A note under the table, wrapped at word boundaries to the table's width."""
    import textwrap

    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)
