"""What each walk-forward fold trades: nothing at or after the config's data end, the exit paid at the end of every
fold's stretch, and a fold not gathered as a gap where the account is flat."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from foxhunt.data.market import MarketSplit
from tests._splits import HOUR, T0, hourly_split

TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")
FAST = ["--data.synthetic_bars", "4000", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4",
        "--trainer.limit_val_batches", "1", "--log_figures", "false", "--trainer.enable_progress_bar", "false"]


def test_walkforward_trades_nothing_after_the_configs_data_end(tmp_path: Path) -> None:
    """A config's ``data.end`` bounds the walk-forward (docs/WALKFORWARD.md): the last fold trades no bar at or after
    it and no return that runs into it; every fold's own figures close the position held at its stretch's end."""
    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.data.tensors import bars_tensors
    from foxhunt.walkforward import main
    from foxhunt.walkforward.gather import load_out_of_sample

    ts = bars_tensors(BarDataModule(synthetic_bars=4000, cache_dir=None, features=["logret_1"], known_future=[]).load())[1]
    end = pd.Timestamp(int(ts[3500]), tz="UTC").isoformat()
    out = tmp_path / "wf"
    table = main(["--config", TINY, "--folds", "2", "--out", str(out), "--no_figure", "--n_boot", "100", "--", *FAST,
                  "--data.end", end])
    oos = load_out_of_sample(out)
    assert int(oos.split.timestamps.max()) == int(ts[3499])  # nothing at or after data.end
    assert not bool(oos.split.valid[-1])  # the last bar's return would run into data.end: not traded
    assert table["decision_bars"] == int(oos.split.valid.sum())
    for k, fold in enumerate(table["per_fold"]):
        done = json.loads((out / f"fold_{k}" / "done.json").read_text())
        # buy-and-hold on one symbol without holes: bought at the stretch's first bar, sold after its last
        assert done["metrics"]["buy_and_hold"]["n_trades"] == 2, k
        assert fold["policies"]["buy_and_hold"]["n_trades"] == 2, k


def _fold_files(out: Path, layout: dict, k: int, part: MarketSplit, positions: dict[str, torch.Tensor]) -> None:
    where = out / f"fold_{k}"
    where.mkdir(parents=True)
    tensors = {"timestamps": part.timestamps, "symbol_index": part.symbol_index, "ohlcv": part.ohlcv,
               "returns": part.returns, "valid": part.valid, **{f"position.{p}": v for p, v in positions.items()}}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(where / "oos.safetensors"))
    done = {"fold": k, "cuts": layout["folds"][k], "fingerprint": layout["fingerprint"], "symbols": part.symbols,
            "policies": list(positions), "cost_bps": 10.0, "positions": "oos.safetensors",
            "metrics": {p: {} for p in positions}}
    (where / "done.json").write_text(json.dumps(done))


def test_gathered_fold_rows_pay_the_exit_at_the_stretch_end(tmp_path: Path) -> None:
    """Two folds of one symbol, buy-and-hold at 10 bp: each fold's row is its stretch traded as an account of its own,
    bought at its first bar and sold after its last, so fold 0 (whose last return runs into fold 1) pays both costs,
    as fold 1 (the data's last bar has no return) does; the concatenated account pays one entry and one exit."""
    from foxhunt.walkforward.gather import gather
    from foxhunt.walkforward.plan import Fold

    r0, r1 = [0.01, -0.02, 0.03, 0.005, -0.01, 0.02], [0.01, 0.01, -0.005, 0.02, -0.01, float("nan")]
    part0, part1 = hourly_split(r0), hourly_split(r1, t0=T0 + 6 * HOUR)
    iso = lambda ns: pd.Timestamp(ns, tz="UTC").isoformat()  # noqa: E731
    folds = [Fold(0, iso(T0 - 100 * HOUR), iso(T0 - 20 * HOUR), iso(T0), iso(T0 + 6 * HOUR)),
             Fold(1, iso(T0 - 100 * HOUR), iso(T0 - 10 * HOUR), iso(T0 + 6 * HOUR), None)]
    layout = {"folds": [asdict(f) for f in folds], "mode": "expanding", "initial_fraction": None, "val_fraction": 0.2,
              "bars_per_year": 1000.0, "fingerprint": "f"}
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    for k, part in enumerate((part0, part1)):
        _fold_files(tmp_path, layout, k, part, {"buy_and_hold": part.valid.float(), "flat": torch.zeros(len(part))})
    table = gather(tmp_path, figure=False, n_boot=200)
    c = math.log1p(-1e-3)
    gross0 = math.fsum(r0)
    gross1 = math.fsum(r1[:-1])
    fold0, fold1 = (f["policies"]["buy_and_hold"] for f in table["per_fold"])
    assert fold0["total_log_return"] == pytest.approx(gross0 + 2 * c, rel=1e-6)
    assert fold1["total_log_return"] == pytest.approx(gross1 + 2 * c, rel=1e-6)
    assert fold0["n_trades"] == fold1["n_trades"] == 2
    assert fold0["n_bars"] == 6 and fold1["n_bars"] == 5 and table["per_fold"][0]["bars"] == 6
    overall = table["policies"]["buy_and_hold"]
    assert overall["total_log_return"] == pytest.approx(gross0 + gross1 + 2 * c, rel=1e-6)
    assert overall["n_trades"] == 2


def test_a_fold_not_gathered_is_a_gap_where_the_account_is_flat(tmp_path: Path) -> None:
    """Folds 0 and 2 gathered, fold 1 not: the concatenated account does not hold fold 0's last position through
    fold 1's stretch into fold 2 (paying only the difference); it sells before the gap and buys again after it."""
    from foxhunt.walkforward.gather import gather
    from foxhunt.walkforward.plan import Fold

    iso = lambda ns: pd.Timestamp(ns, tz="UTC").isoformat()  # noqa: E731
    starts = [T0, T0 + 6 * HOUR, T0 + 12 * HOUR]
    folds = [Fold(k, iso(T0 - 100 * HOUR), iso(T0 - 20 * HOUR), iso(t), iso(starts[k + 1]) if k < 2 else None)
             for k, t in enumerate(starts)]
    layout = {"folds": [asdict(f) for f in folds], "mode": "expanding", "initial_fraction": None, "val_fraction": 0.2,
              "bars_per_year": 1000.0, "fingerprint": "f"}
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    r0, r2 = [0.01, -0.02, 0.03, 0.005, -0.01, 0.02], [0.01, 0.01, -0.005, 0.02, -0.01, float("nan")]
    for k, r in ((0, r0), (2, r2)):
        part = hourly_split(r, t0=starts[k])
        _fold_files(tmp_path, layout, k, part, {"buy_and_hold": part.valid.float(), "flat": torch.zeros(len(part))})
    table = gather(tmp_path, figure=False, n_boot=200)
    assert table["missing"] == [1]
    overall = table["policies"]["buy_and_hold"]
    c = math.log1p(-1e-3)
    assert overall["n_trades"] == 4 and overall["n_bars"] == 11
    assert overall["total_log_return"] == pytest.approx(math.fsum(r0) + math.fsum(r2[:-1]) + 4 * c, rel=1e-6)
