"""`python -m foxhunt.compare EXPORT_A EXPORT_B [...] --data FILE [--cost-bps X]`: exports traded on the same bars.

Each export trades the file (features recomputed and scaled with its own statistics, as ``foxhunt.backtest --data``
does, with the same refusal of bars inside an export's training span); every one is scored after the same costs on
the bars they all decide on, as one book per timestamp; the table gives each one's Sharpe and, against the first,
the Sharpe difference with its HAC standard error and Ledoit & Wolf's p-values and Diebold-Mariano on the per-bar
return difference, and with three or more Hansen's SPA and the model confidence set
(:func:`foxhunt.evaluation.paired.paired_report`; docs/STATISTICS.md).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from foxhunt.backtest import guard_overlap  # the back-test's refusal of bars an export was fitted or selected on
from foxhunt.cli_errors import ArgumentParser, run_command
from foxhunt.data.bars import DEFAULT_JUMP_SIGMAS, DataError
from foxhunt.evaluation.backtest import N_BOOT, policy_pnl, split_bars_per_year
from foxhunt.evaluation.paired import format_paired_report, paired_report
from foxhunt.export.load import LoadedEnsemble, load
from foxhunt.files import write_json

MIN_COMMON_BARS = 10  # fewer bars that every export decides on make no paired table


def _names(paths: list[str]) -> list[str]:
    """Each export's label: its directory name, or the path as given where two names would clash."""
    short = [Path(p).parent.name if Path(p).name == "metadata.json" else Path(p).name for p in paths]
    return short if len(set(short)) == len(short) else list(paths)


def paired_returns(exports: dict[str, LoadedEnsemble], bars: Any, data_name: str, cost_bps: float | None = None,
                   allow_overlap: bool = False, policy: str = "ensemble") -> tuple[dict[str, torch.Tensor], float]:
    """({label: the book's per-bar log returns after costs}, bars per year) of each export's ``policy`` on the bars
    of ``bars`` that every export decides on (positions elsewhere flat), at ``cost_bps`` (default: the exports'
    common cost). Refuses bars inside an export's training span unless ``allow_overlap`` (then all bars count)."""
    costs = {name: float(e.model.hparams.cost_bps) for name, e in exports.items()}
    if cost_bps is None:
        if len(set(costs.values())) > 1:
            raise DataError("the exports differ in cost_bps (" + ", ".join(f"{n} {c:g}" for n, c in costs.items())
                            + "); pass --cost-bps to compare them at one cost")
        cost_bps = next(iter(costs.values()))
    splits, positions = {}, {}
    for name, loaded in exports.items():
        split = loaded.split(bars, name=data_name)
        guard_overlap(loaded, split, allow_overlap)
        evaluation = loaded.model.evaluate(split)
        if policy not in evaluation.positions:
            raise DataError(f"{name}: no policy {policy!r} (it has {', '.join(evaluation.positions)})")
        splits[name], positions[name] = split, evaluation.positions[policy]
    first = next(iter(splits))
    ref = splits[first]
    keys = [ref.symbols[i] for i in ref.symbol_index.tolist()]
    for name, split in splits.items():  # the same rows of the file, in the same order, for every export
        same = len(split) == len(ref) and torch.equal(split.timestamps, ref.timestamps) and \
            [split.symbols[i] for i in split.symbol_index.tolist()] == keys
        if not same:
            raise DataError(f"{data_name}: {name} reads other rows of it than {first} (symbols or bars differ)")
    common = torch.stack([s.valid for s in splits.values()]).all(0)
    n_common = int(common.sum())
    if n_common < MIN_COMMON_BARS:
        raise DataError(f"{data_name}: only {n_common} bars that every export decides on; need at least "
                        f"{MIN_COMMON_BARS} (a longer file, or exports with shorter warm-ups)")
    pnl = {name: policy_pnl(positions[name], replace(splits[name], valid=common), cost_bps) for name in splits}
    bpy = split_bars_per_year(ref, exports[first].model.hparams.bars_per_year)
    return pnl, bpy


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = ArgumentParser(prog="python -m foxhunt.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", help="export directories (or their metadata.json); the first is the reference")
    parser.add_argument("--data", required=True, help="bars file, directory or glob that every export trades")
    parser.add_argument("--cost-bps", type=float, default=None,
                        help="cost per unit of turnover for every export (default: theirs, which must agree)")
    parser.add_argument("--policy", default="ensemble", help="which policy of each export trades (default: ensemble)")
    parser.add_argument("--on-bad-bar", default="raise", choices=["raise", "drop", "repair"])
    parser.add_argument("--jump-sigmas", type=float, default=DEFAULT_JUMP_SIGMAS,
                        help="flag a close that moves more than this many robust std (0: off)")
    parser.add_argument("--allow-overlap", action="store_true",
                        help="compare on bars inside an export's training/validation span too (in-sample for it)")
    parser.add_argument("--n-boot", type=int, default=N_BOOT, help="bootstrap replicates (Sharpe test, SPA, MCS)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the table as JSON to this file")
    parser.add_argument("--debug", action="store_true", help="a traceback for data and path errors too")
    args = parser.parse_args(argv)
    if len(args.exports) < 2:
        parser.error("give at least two exports to compare")
    if args.n_boot < 1:
        parser.error(f"--n-boot must be at least 1, got {args.n_boot}")
    from foxhunt.data import load_bars

    names = _names(args.exports)
    exports = {name: load(path) for name, path in zip(names, args.exports, strict=True)}
    bars = load_bars(args.data, on_bad_bar=args.on_bad_bar, jump_sigmas=args.jump_sigmas or None)
    data_name = Path(args.data).name
    pnl, bpy = paired_returns(exports, bars, data_name, args.cost_bps, args.allow_overlap, args.policy)
    report = paired_report(pnl, bpy, n_boot=args.n_boot, seed=args.seed)
    print(format_paired_report(report, f"{data_name}, policy {args.policy}"))
    if args.out is not None:
        write_json(args.out, report)
        print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    sys.exit(run_command(main))
