"""`python -m foxhunt.backtest --checkpoint <export dir> [--data FILE] [--split test]`: after-cost back-test.

Prints, for each member, the ensemble and buy-and-hold (and the oracle on the synthetic market): total log return,
annualised Sharpe and Sortino, max drawdown, turnover, hit rate and number of trades; writes them as JSON and the
equity curves as PNG. With ``--data`` the model trades a file it never saw: features are recomputed and scaled with
the exported statistics. Without it, the split of the data the model was trained on is rebuilt from the export's
config. The scoring itself is :mod:`foxhunt.evaluation.backtest`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from foxhunt.data.market import MarketSplit
from foxhunt.evaluation.backtest import format_table
from foxhunt.evaluation.figures import equity_figure
from foxhunt.export import LoadedEnsemble, load


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(prog="python -m foxhunt.backtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="export directory (or its metadata.json) written by foxhunt.fit")
    parser.add_argument("--data", default=None, help="bars file, directory or glob to trade (default: the training data)")
    parser.add_argument("--split", default="test", choices=["train", "val", "test", "all"], help="split of the training data (without --data)")
    parser.add_argument("--on-bad-bar", default="raise", choices=["raise", "drop", "repair"])
    parser.add_argument("--out", default=None, help="output directory for backtest.json and equity.png (default: the export directory)")
    args = parser.parse_args(argv)

    loaded = load(args.checkpoint)
    root = Path(args.checkpoint)
    root = root.parent if root.is_file() else root
    out = Path(args.out) if args.out else root
    out.mkdir(parents=True, exist_ok=True)
    if args.data is not None:
        from foxhunt.data import load_bars

        split = loaded.split(load_bars(args.data, on_bad_bar=args.on_bad_bar), name=Path(args.data).name)
    else:
        split = training_split(loaded, args.split)
    evaluation = loaded.model.evaluate(split)
    print(format_table(evaluation.metrics, split=split.name if args.data is not None else f"{args.split} (training data)"))
    equity_figure(evaluation.positions, split, evaluation.cost_bps).savefig(out / "equity.png", dpi=110)
    (out / "backtest.json").write_text(json.dumps(evaluation.metrics, indent=2))
    print(f"\nwrote {out / 'backtest.json'} and {out / 'equity.png'}")
    return evaluation.metrics


def training_split(loaded: LoadedEnsemble, name: str) -> MarketSplit:
    """The named split of the training data, rebuilt from the export's data config with the exported statistics."""
    import yaml

    from foxhunt.data.datamodule import BarDataModule

    config = loaded.metadata.get("config")
    cfg = yaml.safe_load(config) if isinstance(config, str) else (config or {})
    data_args = dict(cfg.get("data", {}))
    data_args["cache_dir"] = data_args.get("cache_dir")
    dm = BarDataModule(**data_args)
    bars = dm.load()
    oracle = dm.oracle_mean
    split = loaded.split(bars, name, oracle_mean=oracle)
    if name == "all":
        return split
    dm.bars = bars
    dm.setup()
    mask = torch.zeros(len(split), dtype=torch.bool)
    mask[torch.from_numpy(dm.split_rows[name])] = True
    return split.select(mask)


if __name__ == "__main__":
    main()
