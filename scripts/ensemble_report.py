"""Validation and test Sharpe of each member, the ensemble under each combination, buy-and-hold and the oracle.

Trains the given fit config once per combination (same seed, same data) and prints one table:

    python scripts/ensemble_report.py --config lightning_configs/quickstart.yaml [--combine stack vote sharpe_weighted]
        [-- extra fit overrides...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="lightning_configs/quickstart.yaml")
    parser.add_argument("--combine", nargs="+", default=["sharpe_weighted", "vote", "stack"])
    parser.add_argument("--json", default=None, help="also write the table as JSON here")
    parser.add_argument("overrides", nargs="*", help="extra fit arguments after --")
    args = parser.parse_args()

    from foxhunt.fit import build_cli

    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for combine in args.combine:
            t0 = time.perf_counter()
            out = Path(tmp) / combine
            cli = build_cli([
                "--config", args.config, "--model.combine", combine, "--trainer.enable_progress_bar", "false",
                "--trainer.logger.init_args.save_dir", str(out / "runs"), "--export_dir", str(out / "export"),
                "--backtest", "false", *args.overrides,
            ])
            cli.fit()
            model = cli.model
            val, test = model.evaluate(model.split("val")).metrics, model.evaluate(model.split("test")).metrics
            seconds = time.perf_counter() - t0
            for who in val:
                key = f"ensemble ({combine})" if who == "ensemble" else f"{who} [{combine} run]" if who in model.member_names else who
                rows[key] = {"val_sharpe": val[who]["sharpe"], "test_sharpe": test[who]["sharpe"],
                             "test_total_log_return": test[who]["total_log_return"], "test_turnover": test[who]["turnover"]}
            print(f"{combine}: trained and back-tested in {seconds:.0f} s", flush=True)
    print(f"\n{'policy':<28}{'val Sharpe':>12}{'test Sharpe':>13}{'test log ret':>14}{'test turnover':>15}")
    for who, m in rows.items():
        print(f"{who:<28}{m['val_sharpe']:>12.2f}{m['test_sharpe']:>13.2f}{m['test_total_log_return']:>14.4f}{m['test_turnover']:>15.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
