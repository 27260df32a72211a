"""Audit of the walk-forward and back-test figures: bounds of the traded bars, exits paid at the end of every scored
stretch, non-finite positions refused, bars before a model's training span never reported as after it."""

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
from foxhunt.evaluation.backtest import policy_metrics

TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")
FAST = ["--data.synthetic_bars", "4000", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4",
        "--trainer.limit_val_batches", "1", "--log_figures", "false", "--trainer.enable_progress_bar", "false"]
HOUR = 3_600_000_000_000
T0 = 1_700_000_000_000_000_000


def _split(returns: list[float], name: str = "s", t0: int = T0) -> MarketSplit:
    r = torch.tensor(returns, dtype=torch.float32)
    n = len(returns)
    ts = t0 + torch.arange(n, dtype=torch.int64) * HOUR
    return MarketSplit(name, ["A"], ts, torch.zeros(n, dtype=torch.int64), torch.ones(n, 5, dtype=torch.float64), r,
                       torch.nan_to_num(r), torch.isfinite(r))


# ------------------------------------------------------------------------------------- walk-forward: bounds and exits
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
    part0, part1 = _split(r0), _split(r1, t0=T0 + 6 * HOUR)
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
        part = _split(r, t0=starts[k])
        _fold_files(tmp_path, layout, k, part, {"buy_and_hold": part.valid.float(), "flat": torch.zeros(len(part))})
    table = gather(tmp_path, figure=False, n_boot=200)
    assert table["missing"] == [1]
    overall = table["policies"]["buy_and_hold"]
    c = math.log1p(-1e-3)
    assert overall["n_trades"] == 4 and overall["n_bars"] == 11
    assert overall["total_log_return"] == pytest.approx(math.fsum(r0) + math.fsum(r2[:-1]) + 4 * c, rel=1e-6)


# ------------------------------------------------------------------------------------------- evaluation/backtest.py
def test_policy_metrics_refuse_non_finite_positions_at_decision_bars() -> None:
    """A NaN position at a decision bar made the P&L NaN and the Sharpe a silent 0.00; it is refused by name."""
    s = _split([0.01, -0.02, 0.03, 0.0, 0.01, float("nan")])
    bad = torch.tensor([1.0, float("nan"), 1.0, 0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match=r"ppo: 1 non-finite position"):
        policy_metrics({"long": torch.ones(6), "ppo": bad}, s, cost_bps=1.0, bars_per_year=100.0)
    # outside the decision bars a position is never held (forced flat), so a NaN there is harmless
    ok = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, float("nan")])
    m = policy_metrics({"ppo": ok}, s, cost_bps=1.0, bars_per_year=100.0)["ppo"]
    assert math.isfinite(m["sharpe"]) and math.isfinite(m["total_log_return"])


# ---------------------------------------------------------------------------------------------------- foxhunt.backtest
class _Loaded:
    """What ``foxhunt.backtest`` reads of an export: its config and metadata, and ``split`` (raw returns, no model)."""

    def __init__(self, data: dict | None = None, seen: dict | None = None) -> None:
        self.metadata = {"config": {"data": data or {}}, "data": {"symbols": list(seen or {}), "seen_span": seen or {}}}

    def split(self, bars: pd.DataFrame, name: str = "data", oracle_mean: torch.Tensor | None = None) -> MarketSplit:
        from foxhunt.data.tensors import bars_tensors
        from foxhunt.preprocessing import next_log_returns

        symbols, ts, sym, ohlcv = bars_tensors(bars)
        r = next_log_returns(ohlcv[:, 3], segment=sym).float()
        return MarketSplit(name, symbols, ts, sym, ohlcv, r, torch.nan_to_num(r), torch.isfinite(r),
                           oracle_mean=oracle_mean)


@pytest.mark.parametrize("name", ["train", "val", "test"])
def test_backtest_training_split_ends_with_no_decision_bar(name: str) -> None:
    """``foxhunt.backtest --split`` rebuilds a split of the training data as the fit saw it: each symbol's last row
    has no next return inside the split (it would run into a purged bar, another split's or one after data.end), so
    it is no decision bar and every position is closed there, as in the fit's own tables."""
    from foxhunt.backtest import training_split
    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.data.tensors import bars_tensors

    data = {"synthetic_bars": 3000, "synthetic_symbols": 2, "lookback": 8, "horizon": 2, "cache_dir": None,
            "features": ["logret_1"], "known_future": []}
    ts = bars_tensors(BarDataModule(**data).load())[1]
    data["end"] = pd.Timestamp(int(ts[2800]), tz="UTC").isoformat()  # the test split ends before the data does
    s = training_split(_Loaded(data), name)
    last = torch.ones(len(s), dtype=torch.bool)
    last[:-1] = s.symbol_index[1:] != s.symbol_index[:-1]
    assert int(last.sum()) == 2
    assert not bool(s.valid[last].any()) and bool(torch.isnan(s.returns[last]).all())
    assert bool(s.valid[~last].all())
    m = policy_metrics({"buy_and_hold": s.valid.float()}, s, cost_bps=1.0, bars_per_year=1000.0)["buy_and_hold"]
    assert m["n_trades"] == 4  # bought and sold once per symbol


def test_backtest_unseen_table_holds_only_bars_after_the_training_span() -> None:
    """With --allow-overlap the second table is of the bars after the span the model trained and was selected on;
    bars before that span (which a model fitted on later data has in effect seen the future of) are not among them."""
    from foxhunt.backtest import _guard_overlap

    s = _split([0.001] * 40)
    lo, hi = int(s.timestamps[10]), int(s.timestamps[25])
    unseen = _guard_overlap(_Loaded(seen={"A": [lo, hi]}), s, allow=True)
    assert unseen is not None and "after the training span" in unseen.name
    assert torch.equal(unseen.timestamps, s.timestamps[26:])
    # a file that ends inside the span has no bar after it: no second table (not one of the bars before the span)
    assert _guard_overlap(_Loaded(seen={"A": [lo, int(s.timestamps[-1])]}), s, allow=True) is None


def test_backtest_warns_about_bars_before_the_training_span(caplog) -> None:
    """A file entirely before the span the model was fitted on passes the overlap guard (nothing overlaps), but the
    model learned from those bars' future: one warning says so; a file after the span gets none."""
    import logging

    from foxhunt.backtest import _guard_overlap

    s = _split([0.001] * 40)
    with caplog.at_level(logging.WARNING, logger="foxhunt.backtest"):
        later = int(s.timestamps[-1]) + 10**12
        assert _guard_overlap(_Loaded(seen={"A": [later, later + 10**12]}), s, allow=False) is None
    assert any("lie before the span" in r.getMessage() and "no out-of-sample test" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="foxhunt.backtest"):
        earlier = int(s.timestamps[0]) - 10**12
        assert _guard_overlap(_Loaded(seen={"A": [earlier - 10**12, earlier]}), s, allow=False) is None
    assert not any("lie before the span" in r.getMessage() for r in caplog.records)
