"""The finished folds' out-of-sample positions as one series, scored into one table and one equity figure."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from foxhunt.files import json_safe, write_json
from foxhunt.walkforward.plan import DONE, LAYOUT, WalkForwardError, fold_dir, folds_of, is_done, iso_utc, read_layout
from foxhunt.walkforward.score import own_account, score, significance_summary

if TYPE_CHECKING:
    from foxhunt.data.market import MarketSplit

TABLE = "walkforward.json"
FIGURE = "equity.png"


@dataclass
class OutOfSample:
    """The finished folds' out-of-sample positions as one series ordered by (symbol, time)."""

    split: MarketSplit
    positions: dict[str, torch.Tensor]
    fold: torch.Tensor  # [T] int64: the fold each row was traded by
    done: list[dict[str, Any]]


def load_out_of_sample(out: Path, layout: dict[str, Any] | None = None) -> OutOfSample:
    """Concatenate the finished folds' positions (in time, per symbol); refuses folds from another layout and
    overlapping rows."""
    from safetensors.torch import load_file

    from foxhunt.data.market import MarketSplit

    layout = read_layout(out) if layout is None else layout
    parts, done = [], []
    for fold in folds_of(layout):
        where = fold_dir(out, fold.index)
        if not (where / DONE).exists():
            continue
        meta = json.loads((where / DONE).read_text())
        if meta["cuts"] != asdict(fold) or meta["fingerprint"] != layout["fingerprint"]:
            raise WalkForwardError(f"{where}: this fold was run with other cuts or another fit config than {out / LAYOUT}")
        parts.append(load_file(str(where / meta["positions"])))
        done.append(meta)
    if not done:
        raise WalkForwardError(f"{out}: no finished fold to gather")
    symbols, policies, cost = done[0]["symbols"], done[0]["policies"], done[0]["cost_bps"]
    for meta in done[1:]:
        if meta["symbols"] != symbols or meta["policies"] != policies or meta["cost_bps"] != cost:
            raise WalkForwardError(f"{out}: folds differ in symbols, policies or cost ({meta['fold']} vs {done[0]['fold']})")
    cat = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    fold_id = torch.cat([torch.full((len(p["timestamps"]),), m["fold"], dtype=torch.int64) for p, m in zip(parts, done, strict=True)])
    order = torch.argsort(cat["timestamps"], stable=True)
    order = order[torch.argsort(cat["symbol_index"][order], stable=True)]
    cat = {name: t[order] for name, t in cat.items()}
    ts, sym = cat["timestamps"], cat["symbol_index"]
    if len(ts) > 1 and bool(((ts[1:] == ts[:-1]) & (sym[1:] == sym[:-1])).any()):
        raise WalkForwardError(f"{out}: folds' test stretches overlap")
    split = MarketSplit(
        name=f"walk-forward out-of-sample, folds {', '.join(str(m['fold']) for m in done)} of {len(layout['folds'])}",
        symbols=list(symbols), timestamps=ts, symbol_index=sym, ohlcv=cat["ohlcv"], returns=cat["returns"],
        targets=torch.nan_to_num(cat["returns"]), valid=cat["valid"].bool(),
    )
    positions = {p: cat[f"position.{p}"] for p in policies}
    return OutOfSample(split, positions, fold_id[order], done)


def gather(out: Path, figure: bool = True, n_boot: int | None = None) -> dict[str, Any]:
    """One table (and equity figure) of the finished folds' concatenated out-of-sample positions, with per-fold
    rows; written to ``walkforward.json`` (and ``equity.png``) in ``out``, printed and returned (NaN as None)."""
    from foxhunt.evaluation.backtest import COLUMNS, format_symbols, format_table, symbol_metrics

    layout = read_layout(out)
    oos = load_out_of_sample(out, layout)
    cost, bpy = oos.done[0]["cost_bps"], layout["bars_per_year"]
    # a fold not gathered is a gap in the account: what was held before it is sold there, and bought again after it
    gap = torch.zeros(len(oos.split), dtype=torch.bool)
    gap[:-1] = (oos.fold[1:] > oos.fold[:-1] + 1) & (oos.split.symbol_index[1:] == oos.split.symbol_index[:-1])
    overall = score(*own_account(oos.positions, oos.split, gap), cost, bpy, n_boot=n_boot)
    per_fold = []
    for meta in oos.done:
        rows = oos.fold == meta["fold"]
        split = oos.split.select(rows)
        metrics = score(*own_account({p: v[rows] for p, v in oos.positions.items()}, split), cost, bpy, n_boot=n_boot)
        for policy, m in metrics.items():
            m.update({key: meta["metrics"][policy][key] for key in ("updates", "weight") if key in meta["metrics"][policy]})
        per_fold.append({**meta["cuts"], "fold": meta["fold"], "bars": len(split), "decision_bars": int(split.valid.sum()),
                         "first": iso_utc(int(split.timestamps.min())), "last": iso_utc(int(split.timestamps.max())),
                         "policies": metrics, "versus_previous": meta.get("versus_previous")})
    per_symbol = symbol_metrics(*own_account(oos.positions, oos.split, gap), cost, bpy) \
        if len(torch.unique(oos.split.symbol_index)) > 1 else {}
    missing = [f.index for f in folds_of(layout) if not is_done(out, f.index)]
    table = {
        "folds": len(layout["folds"]),
        "gathered": [m["fold"] for m in oos.done],
        "missing": missing,
        "mode": layout["mode"],
        "cost_bps": cost,
        "bars_per_year": bpy,
        "bars": len(oos.split),
        "decision_bars": int(oos.split.valid.sum()),
        "significance": significance_summary() is not None,
        "policies": overall,
        "per_fold": per_fold,
        "per_symbol": per_symbol,
    }
    table = json_safe(table)  # NaN (no Sharpe, no hit rate) as null, in the file and the returned table alike
    write_json(out / TABLE, table)
    if figure:
        _equity_figure(oos, cost).savefig(out / FIGURE, dpi=110)
    print("\n" + format_table(overall, split=oos.split.name))
    if table["significance"] and not any(key == "sharpe_se" for key, *_ in COLUMNS):  # else the table shows it
        print("\n" + format_significance(overall))
    if per_symbol:
        print("\n" + format_symbols(per_symbol))
    print("\n" + format_folds(per_fold))
    if any(f["versus_previous"] is not None for f in per_fold):
        print("\n" + format_versus_previous(per_fold))
    if missing:
        print(f"\nnot finished yet: folds {missing}")
    print(f"\nwrote {out / TABLE}" + (f" and {out / FIGURE}" if figure else ""))
    return table


def _equity_figure(oos: OutOfSample, cost_bps: float) -> Any:
    from foxhunt.evaluation.figures import equity_figure, figure_x

    fig = equity_figure(oos.positions, oos.split, cost_bps)
    starts = torch.nonzero((oos.fold[1:] != oos.fold[:-1]) & (oos.split.symbol_index[1:] == oos.split.symbol_index[:-1]))
    at = torch.unique(figure_x(oos.split)[starts.squeeze(1) + 1])  # the book's timestamp where several symbols
    for ax in fig.axes:
        for x in at.tolist():
            ax.axvline(x, color="0.4", lw=0.8, ls=":")
    fig.axes[0].set_title("walk-forward: each fold's export trades its own test stretch (dotted: fold boundaries)",
                          fontsize=9)
    return fig


def _cell(v: Any, fmt: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def format_significance(metrics: dict[str, dict[str, Any]]) -> str:
    """Each policy's Sharpe ratio with its standard error, 95% interval and probabilistic Sharpe ratios."""
    cols = (("sharpe", "Sharpe", "{:+.2f}"), ("sharpe_lo", "Sharpe Lo", "{:+.2f}"), ("sharpe_se", "s.e. HAC", "{:.2f}"),
            ("sharpe_ci_low", "CI low", "{:+.2f}"), ("sharpe_ci_high", "CI high", "{:+.2f}"),
            ("psr_vs_flat", "PSR vs flat", "{:.3f}"), ("sharpe_diff_vs_bh", "ΔSR vs B&H", "{:+.2f}"),
            ("p_vs_bh", "p HAC", "{:.3f}"), ("p_vs_bh_boot", "p boot", "{:.3f}"))
    head = f"{'policy':<22}" + "".join(f"{label:>13}" for _, label, _ in cols)
    rows = ["significance of the Sharpe ratios (HAC standard error; 95% stationary-bootstrap interval; PSR: "
            "probability the true Sharpe exceeds 0; Ledoit & Wolf's paired test of the Sharpe against buy-and-hold's)",
            head, "-" * len(head)]
    for who, m in metrics.items():
        rows.append(f"{who:<22}" + "".join(f"{_cell(m.get(key), fmt):>13}" for key, _, fmt in cols))
    return "\n".join(rows)


def format_folds(per_fold: list[dict[str, Any]]) -> str:
    """One row per fold: its test stretch and every policy's Sharpe ratio on it."""
    policies = list(per_fold[0]["policies"]) if per_fold else []
    head = f"{'fold':<5}{'test stretch (UTC)':<36}{'bars':>7}" + "".join(f"{p[:13]:>14}" for p in policies)
    rows = ["Sharpe ratio per fold (each fold's own test stretch)", head, "-" * len(head)]
    for f in per_fold:
        span = f"{f['first'][:16]} .. {f['last'][:16]}"
        rows.append(f"{f['fold']:<5}{span:<36}{f['bars']:>7}"
                    + "".join(f"{_cell(f['policies'][p].get('sharpe'), '{:+.2f}'):>14}" for p in policies))
    return "\n".join(rows)


def format_versus_previous(per_fold: list[dict[str, Any]]) -> str:
    """One row per fold from the second: the previous fold's model and this fold's on this fold's stretch."""
    head = (f"{'fold':<6}{'bars':>7}{'Sharpe prev':>13}{'Sharpe this':>13}{'ΔSharpe':>10}{'s.e. HAC':>10}"
            f"{'p HAC':>8}{'p boot':>8}{'DM':>8}{'p DM':>8}")
    rows = ["each fold's model against the previous fold's on this fold's test stretch (ΔSharpe: this - previous; "
            "Ledoit & Wolf p-values; DM two-sided)", head, "-" * len(head)]
    for f in per_fold:
        vs = f.get("versus_previous")
        if vs is None:
            continue
        if "rows" not in vs:
            rows.append(f"{f['fold']:<6}  n/a: {vs.get('reason', 'no comparison')}")
            continue
        prev, this = (vs["rows"][name] for name in (f"fold {vs['fold']}", f"fold {f['fold']}"))
        rows.append(f"{f['fold']:<6}{vs['bars']:>7}{_cell(prev['sharpe'], '{:+.2f}'):>13}"
                    f"{_cell(this['sharpe'], '{:+.2f}'):>13}{_cell(this['sharpe_diff'], '{:+.2f}'):>10}"
                    f"{_cell(this['sharpe_diff_se'], '{:.2f}'):>10}{_cell(this['p_hac'], '{:.3f}'):>8}"
                    f"{_cell(this['p_boot'], '{:.3f}'):>8}{_cell(this['dm'], '{:+.2f}'):>8}"
                    f"{_cell(this['dm_p'], '{:.3f}'):>8}")
    return "\n".join(rows)
