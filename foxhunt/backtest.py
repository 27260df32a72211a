"""`python -m foxhunt.backtest --checkpoint <export dir> [--data FILE] [--split test]`: after-cost back-test.

Prints, for each member, the ensemble and buy-and-hold (and the oracle on the synthetic market): total log return,
annualised Sharpe and Sortino, max drawdown, turnover, hit rate and number of trades; writes them as JSON and the
equity curves as PNG. With ``--data`` the model trades a file it never saw: features are recomputed and scaled with
the exported statistics. Without it, the split of the data the model was trained on is rebuilt from the export's
config.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

COLUMNS = (
    ("total_log_return", "total log ret", "{:+.4f}"),
    ("sharpe", "Sharpe", "{:+.2f}"),
    ("sortino", "Sortino", "{:+.2f}"),
    ("max_drawdown", "max DD", "{:.2%}"),
    ("turnover", "turnover", "{:.4f}"),
    ("hit_rate", "hit rate", "{:.3f}"),
    ("n_trades", "trades", "{:.0f}"),
)


def sortino(positions: torch.Tensor, returns: torch.Tensor, cost_bps: float, bars_per_year: float, mask: torch.Tensor, reset: torch.Tensor) -> float:
    """Annualised Sortino ratio: mean per-bar P&L over the root mean square of its negative part."""
    from foxhunt.evaluation.trading import strategy_log_returns

    pos = torch.where(mask, positions.double(), torch.zeros_like(positions, dtype=torch.float64))
    pnl = strategy_log_returns(pos, returns.double(), cost_bps, reset)[mask]
    if pnl.numel() < 2:
        return float("nan")
    downside = pnl.clamp_max(0).pow(2).mean().sqrt()
    return float(pnl.mean() / downside * math.sqrt(bars_per_year)) if downside > 0 else float("nan")


@torch.no_grad()
def equity_curves(positions: dict[str, torch.Tensor], split: Any, cost_bps: float) -> dict[str, torch.Tensor]:
    """Cumulative after-cost log return of every policy's positions on a split."""
    from foxhunt.evaluation.trading import strategy_log_returns
    from foxhunt.lit.ensemble import _resets

    curves = {}
    for who, p in positions.items():
        returns, mask, reset = split.returns.to(p.device), split.valid.to(p.device), _resets(split, p.device)
        held = torch.where(mask, p.double(), torch.zeros_like(p, dtype=torch.float64))
        curves[who] = torch.cumsum(strategy_log_returns(held, returns.double(), cost_bps, reset), 0).cpu()
    return curves


def equity_figure(positions: dict[str, torch.Tensor], split: Any, cost_bps: float) -> Any:
    """A matplotlib figure of the equity curves of every policy on a split."""
    return _equity_figure(equity_curves(positions, split, cost_bps), split)


def fan_chart(forecasts: torch.Tensor, split: Any, start: int | None = None, length: int = 300) -> Any:
    """Next-bar forecast quantiles (outer band and median) against the realised log returns over a stretch."""
    from matplotlib.figure import Figure

    ok = torch.isfinite(forecasts[:, 0, :]).all(1).nonzero().squeeze(1).cpu()
    fig = Figure(figsize=(10, 3.5), layout="constrained")
    ax = fig.subplots()
    if ok.numel() == 0:
        ax.set_title("no forecasts")
        return fig
    a = int(ok[0]) if start is None else start
    rows = torch.arange(a, min(a + length, forecasts.shape[0]))
    fc = forecasts[rows, 0, :].cpu().float()
    q = fc.shape[1]
    x = rows.numpy()
    ax.fill_between(x, fc[:, 0].numpy(), fc[:, q - 1].numpy(), alpha=0.3, label="outer quantile band")
    ax.plot(x, fc[:, q // 2].numpy(), lw=1.0, label="median forecast")
    ax.plot(x, split.returns[rows].cpu().numpy(), ".", ms=2, color="k", label="realised next-bar log return")
    ax.set_xlabel(f"bar of split {split.name!r}")
    ax.legend(loc="upper right")
    return fig


@torch.no_grad()
def backtest_table(model: Any, split: Any, oracle_mean: torch.Tensor | None = None, equity_png: str | Path | None = None) -> dict[str, dict[str, float]]:
    """Metrics of every policy of an EnsembleModule on a split (a MarketSplit or the name of one of its splits)."""
    from foxhunt.evaluation.trading import bars_per_year
    from foxhunt.lit.ensemble import _resets

    if isinstance(split, str):
        oracle_mean = model._oracle.get(split) if oracle_mean is None else oracle_mean
        split = model._splits[split]
    device = model.device
    pos = model.positions(split, oracle_mean)
    results = model.backtest(split, oracle_mean=oracle_mean, positions=pos)
    returns, mask, reset = split.returns.to(device), split.valid.to(device), _resets(split, device)
    bpy = model.hparams.bars_per_year or bars_per_year(split.timestamps, split.symbol_index)
    for who, p in pos.items():
        results[who]["sortino"] = sortino(p, returns, model.hparams.cost_bps, bpy, mask, reset)
    if equity_png is not None:
        _equity_figure(equity_curves(pos, split, model.hparams.cost_bps), split).savefig(equity_png, dpi=110)
    return results


def _equity_figure(curves: dict[str, torch.Tensor], split: Any) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.subplots()
    for who, curve in curves.items():
        ax.plot(curve.numpy(), label=who, lw=1.8 if who == "ensemble" else 1.0)
    ax.set_xlabel(f"bar of split {split.name!r} (symbols in turn)")
    ax.set_ylabel("cumulative log return after costs")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def format_table(results: dict[str, dict[str, float]]) -> str:
    """A plain-text table, one row per policy."""
    head = f"{'policy':<14}" + "".join(f"{label:>15}" for _, label, _ in COLUMNS)
    rows = [head, "-" * len(head)]
    for who, m in results.items():
        cells = []
        for key, _, fmt in COLUMNS:
            v = m.get(key, float("nan"))
            cells.append(f"{'n/a' if math.isnan(v) else fmt.format(v):>15}")
        rows.append(f"{who:<14}" + "".join(cells))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(prog="python -m foxhunt.backtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="export directory (or its metadata.json) written by foxhunt.fit")
    parser.add_argument("--data", default=None, help="bars file, directory or glob to trade (default: the training data)")
    parser.add_argument("--split", default="test", choices=["train", "val", "test", "all"], help="split of the training data (without --data)")
    parser.add_argument("--on-bad-bar", default="raise", choices=["raise", "drop", "repair"])
    parser.add_argument("--out", default=None, help="output directory for backtest.json and equity.png (default: the export directory)")
    args = parser.parse_args(argv)

    from foxhunt.export import load

    loaded = load(args.checkpoint)
    root = Path(args.checkpoint)
    root = root.parent if root.is_file() else root
    out = Path(args.out) if args.out else root
    out.mkdir(parents=True, exist_ok=True)
    oracle = None
    if args.data is not None:
        from foxhunt.data import load_bars

        split = loaded.split(load_bars(args.data, on_bad_bar=args.on_bad_bar), name=Path(args.data).name)
    else:
        split, oracle = _training_split(loaded, args.split)
    results = backtest_table(loaded.model, split, oracle, equity_png=out / "equity.png")
    print(format_table(results))
    (out / "backtest.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out / 'backtest.json'} and {out / 'equity.png'}")
    return results


def _training_split(loaded: Any, name: str) -> tuple[Any, torch.Tensor | None]:
    """The named split of the training data, rebuilt from the export's data config with the exported statistics."""
    import yaml

    from foxhunt.data.datamodule import BarDataModule

    config = loaded.metadata.get("config")
    cfg = yaml.safe_load(config) if isinstance(config, str) else (config or {})
    data_args = dict(cfg.get("data", {}))
    data_args["cache_dir"] = data_args.get("cache_dir")
    dm = BarDataModule(**data_args)
    bars = dm.load()
    if name == "all":
        return loaded.split(bars, "all"), (torch.from_numpy(dm.market.oracle_mean) if dm.market is not None else None)
    dm.bars = bars
    dm.setup()
    rows = torch.from_numpy(dm.split_rows[name])
    split = loaded.split(bars, name)
    mask = torch.zeros(len(split), dtype=torch.bool)
    mask[rows] = True
    oracle = torch.from_numpy(dm.market.oracle_mean)[rows] if dm.market is not None else None
    return split.select(mask), oracle


if __name__ == "__main__":
    main()
