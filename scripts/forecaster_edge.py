"""Do the forecasters trade the edge they forecast? The quick start's members on the test split, seeds x markets (issue 46).

Each run is ``python -m foxhunt.fit`` of a quick-start config (in this process, one after another, one thread), its
export chosen on validation and its test table reported: every member's, the ensemble's and the oracle's annualised
Sharpe after costs, each member's fraction of the oracle's Sharpe, whether the do-no-harm rule holds it flat, and its
turnover and trades (for the do-no-harm markets: one round trip costs 2 x cost_bps, so a member within one round trip
of costs has lost at most that much over the split).

    python scripts/forecaster_edge.py                                   # the table of docs/GUIDE.md's quick start
    python scripts/forecaster_edge.py --seeds 0 --runs planted          # one run of each config
    python scripts/forecaster_edge.py --out /tmp/edge.json              # the raw tables too

Runs (``--runs``): ``planted``: quickstart.yaml (TFT + DQN) and quickstart_mamba2.yaml (Mamba-2) at each seed (the
fit's seed: initialisation, batch order, exploration; the market is the quick start's own, so its oracle is one
figure); ``martingale``: the same market with ``signal_strength: 0`` and ``real``: the S&P 500's daily bars
(tests/data/real/sp500_daily.csv, 1999-2018), each with the TFT, the Mamba-2 and the DQN in one coordinator at the first
seed. 4 to 12 minutes a run on a shared 2-core machine (5 to 7 measured: see docs/GUIDE.md, section 2).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"tft": ROOT / "lightning_configs" / "quickstart.yaml",
           "mamba2": ROOT / "lightning_configs" / "quickstart_mamba2.yaml"}
REAL = ROOT / "tests" / "data" / "real" / "sp500_daily.csv"


def all_members() -> str:
    """--model.members for one coordinator of the quick start's TFT, its Mamba-2 and its DQN (the do-no-harm runs)."""
    import yaml

    tft = yaml.safe_load(CONFIGS["tft"].read_text())["model"]["members"]
    mamba = yaml.safe_load(CONFIGS["mamba2"].read_text())["model"]["members"]
    return json.dumps({"tft": tft["tft"], "mamba2": mamba["mamba2"], "dqn": tft["dqn"]})


def fit(args: list[str]) -> dict[str, dict[str, float]]:
    """One fit, export and test back-test; the test table."""
    from foxhunt.fit import main

    cli = main(args)
    return cli.results["backtest"]


def row(label: str, seed: int, table: dict[str, dict[str, float]], cost_bps: float) -> dict[str, Any]:
    """The figures of one run: per policy Sharpe, SE, fraction of the oracle's, held flat, turnover, total log return,
    and the round trips of cost its total log return amounts to (negative: lost)."""
    oracle = table.get("oracle", {}).get("sharpe", math.nan)
    out: dict[str, Any] = {"run": label, "seed": seed, "policies": {}}
    for who, m in table.items():
        sharpe = float(m.get("sharpe", math.nan))
        out["policies"][who] = {
            "sharpe": sharpe, "sharpe_se": float(m.get("sharpe_se", math.nan)),
            "of_oracle": sharpe / oracle if oracle and math.isfinite(oracle) and who != "oracle" else math.nan,
            "held_flat": bool(m.get("held_flat", 0.0)), "edge_confidence": float(m.get("edge_confidence", math.nan)),
            "turnover": float(m.get("turnover", math.nan)), "total_log_return": float(m.get("total_log_return", math.nan)),
            "round_trips": float(m.get("total_log_return", math.nan)) / (2 * cost_bps * 1e-4),
        }
    return out


def show(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: one line per run and policy."""
    lines = ["| run | seed | policy | Sharpe | SE | of oracle | held flat | turnover | log return | round trips |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for who, p in r["policies"].items():
            if who == "buy_and_hold":
                continue
            frac = "" if math.isnan(p["of_oracle"]) else f"{p['of_oracle']:.2f}"
            lines.append(f"| {r['run']} | {r['seed']} | {who} | {p['sharpe']:+.2f} | {p['sharpe_se']:.2f} | {frac} | "
                         f"{'yes' if p['held_flat'] else 'no'} | {p['turnover']:.3f} | {p['total_log_return']:+.4f} | "
                         f"{p['round_trips']:+.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", nargs="+", default=["planted", "martingale", "real"],
                        choices=["planted", "martingale", "real"])
    parser.add_argument("--configs", nargs="+", default=["tft", "mamba2"], choices=sorted(CONFIGS),
                        help="the planted runs' configs")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the runs (logs, checkpoints, exports) here (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = str(args.workdir or scratch)

        def run(label: str, config: Path, seed: int, extra: list[str]) -> None:
            t0 = time.perf_counter()
            table = fit(["--config", str(config), "--seed_everything", str(seed), "--data.seed", str(seed),
                         "--trainer.logger.init_args.save_dir", tmp, "--trainer.enable_progress_bar", "false", *extra])
            rows.append(row(label, seed, table, 1.0))
            rows[-1]["seconds"] = round(time.perf_counter() - t0)
            print(show(rows[-1:]), flush=True)
            if args.out is not None:
                args.out.write_text(json.dumps(rows, indent=1))

        for seed in args.seeds if "planted" in args.runs else []:
            for name in args.configs:
                run(f"planted {name}", CONFIGS[name], seed, [])
        members = ["--model.members", all_members()]
        if "martingale" in args.runs:
            run("martingale", CONFIGS["tft"], args.seeds[0], ["--data.signal_strength", "0", *members])
        if "real" in args.runs:
            run("real S&P 500 daily", CONFIGS["tft"], args.seeds[0], ["--data.path", str(REAL), *members])
    print("\n" + show(rows))


if __name__ == "__main__":
    main()
