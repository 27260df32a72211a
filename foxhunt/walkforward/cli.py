"""The command line of ``python -m foxhunt.walkforward``: run every fold (or one), then gather them (or only gather)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from foxhunt.cli_errors import ArgumentParser
from foxhunt.walkforward.fit_config import FitConfig
from foxhunt.walkforward.fold import run_fold
from foxhunt.walkforward.gather import gather
from foxhunt.walkforward.plan import make_layout, settle_layout


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m foxhunt.walkforward",
        description="Walk-forward test of a foxhunt.fit config: train on each fold's past, trade its unseen test "
                    "stretch with its export, and score the concatenated out-of-sample positions. Arguments after "
                    "'--' are foxhunt.fit overrides (e.g. -- --trainer.max_epochs 3).",
    )
    p.add_argument("--config", help="foxhunt.fit config YAML (not needed with --gather)")
    p.add_argument("--folds", type=int, default=None, help="number of folds (test stretches); not needed with --gather")
    p.add_argument("--mode", choices=["expanding", "rolling"], default="expanding",
                   help="training window: everything before the test stretch, or a fixed length (the initial stretch's)")
    p.add_argument("--initial_fraction", type=float, default=None,
                   help="share of the data before the first test stretch (default 1/(folds+1): equal stretches)")
    p.add_argument("--val_fraction", type=float, default=None,
                   help="share of each training window kept for validation (default: the config's "
                        "val_fraction / (train_fraction + val_fraction))")
    p.add_argument("--out", default=None, help="output directory (default: runs/walkforward/<config name>)")
    p.add_argument("--fold", type=int, default=None, help="run this fold only (skipped if finished); no gathering")
    p.add_argument("--gather", action="store_true", help="train nothing: gather the finished folds into the table")
    p.add_argument("--no_figure", action="store_true", help="skip the equity figure")
    p.add_argument("--n_boot", type=int, default=None,
                   help="bootstrap replicates of each Sharpe interval (default 1000, fewer on long series)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the walk-forward (or one fold, or only the gathering); returns the table (or the fold's done.json)."""
    import sys

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    parser = _parser()
    args = parser.parse_args(argv)
    if args.out is None and args.config is None:
        parser.error("give --config (or --out with --gather)")
    out = Path(args.out) if args.out else Path("runs") / "walkforward" / Path(args.config).stem
    if args.gather:
        return gather(out, figure=not args.no_figure, n_boot=args.n_boot)
    if args.config is None or args.folds is None:
        parser.error("--config and --folds are needed to run folds")
    fit = FitConfig(args.config, overrides)
    layout = settle_layout(out, make_layout(fit, args.folds, args.mode, args.initial_fraction, args.val_fraction))
    if args.fold is not None:
        if not 0 <= args.fold < args.folds:
            parser.error(f"--fold must lie in 0..{args.folds - 1}, got {args.fold}")
        return run_fold(fit, layout, args.fold, out)
    for k in range(args.folds):
        run_fold(fit, layout, k, out)
    return gather(out, figure=not args.no_figure, n_boot=args.n_boot)
