"""`python -m foxhunt.backtest --checkpoint <export dir> [--data FILE] [--split test]`: after-cost back-test.

Prints, for each member, the ensemble and buy-and-hold (and the oracle on the synthetic market): total log return,
annualised Sharpe and Sortino, max drawdown, turnover, hit rate and number of trades; writes them as JSON and the
equity curves as PNG. With ``--data`` the model trades a file it never saw: features are recomputed and scaled with
the exported statistics. Without it, the split of the data the model was trained on is rebuilt from the export's
config. The scoring itself is :mod:`foxhunt.evaluation.backtest`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from pathlib import Path

import torch

from foxhunt.cli_errors import ArgumentParser, run_command
from foxhunt.data.bars import DEFAULT_JUMP_SIGMAS, DataError
from foxhunt.data.market import MarketSplit
from foxhunt.evaluation.backtest import PolicyEvaluation, format_symbols, format_table, symbol_metrics
from foxhunt.evaluation.figures import equity_figure
from foxhunt.export.load import LoadedEnsemble, load
from foxhunt.export.metadata import overlap_with_training, seen_time_span
from foxhunt.export.splits import training_split  # the back-test's own splits (also foxhunt.backtest.training_split)
from foxhunt.files import write_json

log = logging.getLogger("foxhunt.backtest")


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = ArgumentParser(prog="python -m foxhunt.backtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="export directory (or its metadata.json) written by foxhunt.fit")
    parser.add_argument("--decisions", default=None,
                        help="a decision log of python -m foxhunt.live to score against --data (the bars it traded)")
    parser.add_argument("--cost-bps", type=float, default=None,
                        help="cost per unit of turnover for --decisions (default: the --checkpoint's)")
    parser.add_argument("--data", default=None, help="bars file, directory or glob to trade (default: the training data)")
    parser.add_argument("--split", default="test", choices=["train", "val", "test", "all"], help="split of the training data (without --data)")
    parser.add_argument("--on-bad-bar", default="raise", choices=["raise", "drop", "repair"])
    parser.add_argument("--jump-sigmas", type=float, default=DEFAULT_JUMP_SIGMAS,
                        help="flag a close of --data that moves more than this many robust std (0: off)")
    parser.add_argument("--debug", action="store_true", help="a traceback for data and path errors too")
    parser.add_argument("--allow-overlap", action="store_true",
                        help="back-test --data bars that overlap the training/validation span (a second table shows the unseen bars)")
    parser.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "onnxruntime-int8"],
                        help="what the members compute on: torch, or ONNX Runtime on the export's float or int8 graphs "
                        "(python -m foxhunt.export --onnx [--int8]); other than torch, a second table compares what "
                        "it trades with the float export's trading")
    parser.add_argument("--out", default=None, help="output directory for backtest.json and equity.png (default: the export directory)")
    args = parser.parse_args(argv)
    if args.decisions is not None:
        return _score_log(args)
    if args.checkpoint is None:
        parser.error("--checkpoint is required (or --decisions with --data)")

    loaded = load(args.checkpoint)
    reference = None
    if args.backend != "torch":  # the served model trades; the float torch export is what it is held against
        from foxhunt.live.backend import use_backend

        reference = load(args.checkpoint)
        use_backend(loaded, args.checkpoint, args.backend)
    root = Path(args.checkpoint)
    root = root.parent if root.is_file() else root
    out = Path(args.out) if args.out else root
    out.mkdir(parents=True, exist_ok=True)
    if args.data is not None:
        from foxhunt.data import load_bars

        split = loaded.split(load_bars(args.data, on_bad_bar=args.on_bad_bar, jump_sigmas=args.jump_sigmas or None), name=Path(args.data).name)
        unseen = guard_overlap(loaded, split, args.allow_overlap)
    else:
        split, unseen = training_split(loaded, args.split), None
    evaluation = loaded.model.evaluate(split, significance=True)
    print(format_table(evaluation.metrics, split=split.name if args.data is not None else f"{args.split} (training data)"))
    if len(torch.unique(split.symbol_index)) > 1:  # the table is the book's; each symbol's own Sharpe beside it
        print("\n" + format_symbols(symbol_metrics(evaluation.positions, split, evaluation.cost_bps,
                                                    loaded.model.hparams.bars_per_year)))
    if reference is not None:
        _compare_served(reference, evaluation, args.backend)
    never_seen = loaded.unseen_symbols(split)
    if never_seen:  # the unseen-symbol rule (foxhunt.export.symbols): only members that do not read the symbol
        print(f"\nsymbols the model was never trained on (it knows {', '.join(loaded.symbols)}), traded by members "
              f"that do not read the symbol: {', '.join(never_seen)}")
    if unseen is not None:
        print(f"\nthe model on the {int(unseen.valid.sum()):,} decision bars after the training span only (positions "
              "decided again there, starting flat):")
        print(format_table(loaded.model.evaluate(unseen, significance=True).metrics, split=unseen.name))
    equity_figure(evaluation.positions, split, evaluation.cost_bps).savefig(out / "equity.png", dpi=110)
    write_json(out / "backtest.json", evaluation.metrics)  # strict JSON: a figure without a value is null
    print(f"\nwrote {out / 'backtest.json'} and {out / 'equity.png'}")
    return evaluation.metrics


def _compare_served(reference: LoadedEnsemble, evaluation: PolicyEvaluation, backend: str) -> None:
    """Print what the served model trades against the float export on the same split, and add it to each policy's
    metrics (``vs_float_changed_share``, ``vs_float_sharpe_change`` and its ``_se``: backtest.json has them)."""
    from foxhunt.export.quantise import format_served_vs_float, served_vs_float

    split = evaluation.split
    rows = served_vs_float(reference.model.positions(split), evaluation.positions, split, evaluation.cost_bps,
                           reference.model.hparams.bars_per_year)
    print("\n" + format_served_vs_float(rows, backend))
    for who, r in rows.items():
        evaluation.metrics[who].update(vs_float_changed_share=r["changed_share"],
                                       vs_float_sharpe_change=r["sharpe_change"],
                                       vs_float_sharpe_change_se=r["sharpe_change_se"])


def _score_log(args) -> dict[str, dict[str, float]]:
    """``--decisions LOG --data FILE``: the logged positions' after-cost table on the bars they traded."""
    from foxhunt.data import load_bars
    from foxhunt.live.log import read_decisions
    from foxhunt.live.score import score_decisions

    if args.data is None:
        raise DataError("--decisions needs --data: the bars the log traded")
    cost = args.cost_bps
    if cost is None:
        if args.checkpoint is None:
            raise DataError("--decisions needs --cost-bps or --checkpoint (whose cost it then uses)")
        cost = float(load(args.checkpoint).model.hparams.cost_bps)
    metrics = score_decisions(read_decisions(args.decisions), load_bars(args.data, on_bad_bar=args.on_bad_bar), cost)
    print(format_table(metrics, split=f"decision log {Path(args.decisions).name}"))
    out = Path(args.out) if args.out else Path(args.decisions).parent
    write_json(out / "decisions_backtest.json", metrics)
    print(f"\nwrote {out / 'decisions_backtest.json'}")
    return metrics


def guard_overlap(loaded: LoadedEnsemble, split: MarketSplit, allow: bool) -> MarketSplit | None:
    """Refuse bars inside the time span the model trained or was selected on, of every symbol whatever its name
    (unless allowed: then the bars after the span, for a second table); warn about bars before it."""
    seen = overlap_with_training(loaded.metadata, split)
    span = seen_time_span(loaded.metadata)
    if span is None:
        return None
    before = split.timestamps < span[0]  # bars earlier than the span: the model learned from their future
    if bool((before & split.valid).any()):
        log.warning("%s: %s decision bars lie before the span the model was trained and selected on (it was fitted on "
                    "their future), so their figures are no out-of-sample test in time", split.name,
                    f"{int((before & split.valid).sum()):,}")
    if not bool(seen.any()):
        return None
    where = f"{_date(span[0])} .. {_date(span[1])}, any symbol: " + ", ".join(
        f"{sym} {int((seen & (split.symbol_index == i)).sum()):,} bars"
        for i, sym in enumerate(split.symbols) if bool((seen & (split.symbol_index == i)).any())
    )
    if not allow:
        raise DataError(
            f"{split.name}: it overlaps the time span the model was trained or selected on ({where}); its "
            "figures there would be in-sample. Back-test later bars, or pass --allow-overlap to see both"
        )
    log.warning("%s overlaps the training/validation span (%s): the first table includes those bars", split.name, where)
    # the second table's bars: those after the span only (a model fitted on later bars has in effect seen the future
    # of earlier ones)
    after = split.timestamps > span[1]
    if not bool((after & split.valid).any()):
        log.warning("%s: no decision bar after the training span, so no second table", split.name)
        return None
    return replace(split.select(after), name=f"{split.name} (bars after the training span)")


def _date(ns: int) -> str:
    import pandas as pd

    return f"{pd.Timestamp(ns, tz='UTC'):%Y-%m-%d %H:%M}"


if __name__ == "__main__":
    sys.exit(run_command(main))
