"""One fold: train it through foxhunt.fit, export it, trade only its own test stretch with that export (and the
previous fold's export beside it on that stretch)."""

from __future__ import annotations

import gc
import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from foxhunt.data.bars import utc_ns
from foxhunt.files import atomic_file, json_safe, write_json
from foxhunt.walkforward.plan import DONE, WalkForwardError, fold_dir, folds_of
from foxhunt.walkforward.score import own_account, score
from foxhunt.walkforward.versus_previous import POLICY, versus_previous

if TYPE_CHECKING:
    from foxhunt.walkforward.fit_config import FitConfig

log = logging.getLogger("foxhunt.walkforward")

POSITIONS = "oos.safetensors"


def run_fold(fit: FitConfig, layout: dict[str, Any], k: int, out: Path) -> dict[str, Any]:
    """Train fold k through ``foxhunt.fit``, export it, trade its test stretch with the export; write its positions
    and ``done.json`` (last, so a fold without it is unfinished). A finished fold is skipped."""
    from safetensors.torch import save_file

    from foxhunt.data.bars import timestamps_ns
    from foxhunt.evaluation.backtest import format_table
    from foxhunt.export.load import load
    from foxhunt.export.metadata import overlap_with_training
    from foxhunt.fit import build_cli

    fold = folds_of(layout)[k]
    where = fold_dir(out, k)
    if (where / DONE).exists():
        log.info("fold %d: finished earlier (%s), skipped", k, where / DONE)
        return json.loads((where / DONE).read_text())
    if where.exists():  # an unfinished fold (killed, or failed) starts over: nothing of it is reused
        log.info("fold %d: unfinished, its directory %s is cleared and the fold redone", k, where)
        shutil.rmtree(where)
    where.mkdir(parents=True)
    log.info("fold %d: train %s .. %s (validation from %s), test %s .. %s", k, fold.train_start, fold.test_start,
             fold.val_start, fold.test_start, fold.end or "the end")
    start = time.monotonic()
    export = where / "export"
    args = [*fit.args, *fold.data_args(), "--export_dir", str(export), "--trainer.default_root_dir", str(where),
            *fit.logger_save_dir_arg(where / "runs")]
    cli = build_cli(args)
    cli.fit()
    bars, oracle_mean = cli.datamodule.bars, cli.datamodule.oracle_mean
    del cli
    if fit.data.get("end") is not None:  # the config's own end bounds the walk-forward: no bar at or after it is
        # traded, and the last bar before it has no next return (it would run into data.end); features are causal
        keep = torch.from_numpy(timestamps_ns(bars) < utc_ns(fit.data["end"]))
        bars = bars[keep.numpy()].reset_index(drop=True)
        oracle_mean = None if oracle_mean is None else oracle_mean[keep]

    loaded = load(export)
    split = loaded.split(bars, name=f"fold {k} test", oracle_mean=oracle_mean)
    test = split.select(fold.contains(split.timestamps))
    seen = overlap_with_training(loaded.metadata, test)
    if bool(seen.any()):  # the cuts guarantee this; the export's own record of what it saw confirms it
        raise WalkForwardError(f"fold {k}: {int(seen.sum())} test bars inside the export's training/validation span")
    evaluation = loaded.model.evaluate(test)
    positions = {**evaluation.positions, "flat": torch.zeros(len(test), dtype=torch.float32)}
    metrics = score(*own_account(positions, test), evaluation.cost_bps, layout["bars_per_year"],
                     significance=False)  # significance at gather
    for policy, extra in evaluation.metrics.items():  # members' updates and ensemble weights, for the table's marks
        metrics[policy].update({key: extra[key] for key in ("updates", "weight") if key in extra})
    previous = versus_previous(out, fold, bars, test, positions[POLICY], evaluation.cost_bps, layout["bars_per_year"],
                               oracle_mean)  # the previous fold's model on this stretch, beside this fold's

    tensors = {"timestamps": test.timestamps, "symbol_index": test.symbol_index, "ohlcv": test.ohlcv,
               "returns": test.returns, "valid": test.valid}
    tensors.update({f"position.{p}": v.detach().float().cpu() for p, v in positions.items()})
    with atomic_file(where / POSITIONS) as tmp:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp))
    done = {
        "fold": k,
        "cuts": asdict(fold),
        "fingerprint": layout["fingerprint"],
        "symbols": list(test.symbols),
        "policies": list(positions),
        "cost_bps": float(evaluation.cost_bps),
        "bars_per_year": layout["bars_per_year"],
        "bars": len(test),
        "decision_bars": int(test.valid.sum()),
        "export": "export",
        "positions": POSITIONS,
        "metrics": metrics,
        "versus_previous": previous,
        "seconds": round(time.monotonic() - start, 1),
        "fit_args": args,
    }
    write_json(where / DONE, json_safe(done))
    print(f"\nfold {k}: out-of-sample {fold.test_start} .. {fold.end or 'end'}\n" + format_table(metrics, split=test.name))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return done
