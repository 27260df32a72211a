"""`python -m foxhunt.walkforward`: fold layout, out-of-sample coverage, resume after a kill, one fold, --gather.

The end-to-end tests train 3-fold walk-forwards of tests/configs/tiny.yaml (one short epoch per fold) through the
module's ``main``, and check them with the export (``foxhunt.load``) and back-test machinery only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

import foxhunt
from foxhunt.data.datamodule import BarDataModule
from foxhunt.data.tensors import bars_tensors
from foxhunt.walkforward import main
from foxhunt.walkforward.gather import load_out_of_sample
from foxhunt.walkforward.plan import WalkForwardError, fold_layout

TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")
FOLDS = 3
FAST = ["--data.synthetic_bars", "4000", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4",
        "--trainer.limit_val_batches", "1", "--log_figures", "false", "--trainer.enable_progress_bar", "false"]


def _ns(iso: str | None) -> int | None:
    return None if iso is None else pd.Timestamp(iso).value


def _walkforward(out: Path, *extra: str, overrides: list[str] | None = None) -> dict:
    return main(["--config", TINY, "--folds", str(FOLDS), "--out", str(out), "--n_boot", "100", *extra, "--", *FAST,
                 *(overrides or [])])


def _bars_timestamps() -> torch.Tensor:
    dm = BarDataModule(synthetic_bars=4000, signal_strength=0.3, lookback=12, horizon=3, cache_dir=None,
                       features=["logret_1"], known_future=[])
    return bars_tensors(dm.load())[1]


# ------------------------------------------------------------------------------------------------------- the layout
@pytest.mark.parametrize("mode", ["expanding", "rolling"])
def test_layout_folds_are_disjoint_chronological_and_after_their_training(mode: str) -> None:
    ts = torch.arange(0, 10_000, dtype=torch.int64) * 60_000_000_000 + 1_700_000_000_000_000_000
    folds = fold_layout(ts, 4, mode, val_fraction=0.2, min_bars=30)
    assert len(folds) == 4
    for k, f in enumerate(folds):
        assert f.index == k
        assert _ns(f.train_start) < _ns(f.val_start) < _ns(f.test_start) < (_ns(f.end) or math.inf)
        if k + 1 < len(folds):  # a fold's test stretch ends where the next one's begins
            assert f.end == folds[k + 1].test_start
    assert folds[-1].end is None  # the last one runs to the end of the data
    lengths = [_ns(f.test_start) - _ns(f.train_start) for f in folds]
    if mode == "rolling":  # a window of fixed length slides forward
        assert len(set(lengths)) == 1 and [f.train_start for f in folds] == sorted({f.train_start for f in folds})
    else:  # every window starts at the first bar and grows
        assert {f.train_start for f in folds} == {folds[0].train_start} and lengths == sorted(lengths)
    # test stretches tile the data after the initial stretch: every bar in exactly one, none before the first
    inside = torch.stack([f.contains(ts) for f in folds])
    assert int(inside.sum(0).max()) == 1
    assert torch.equal(inside.any(0), ts >= _ns(folds[0].test_start))
    assert abs(int(inside[0].sum()) - int(inside[-1].sum())) <= 1  # nearly equal stretches


def test_layout_refuses_stretches_too_short() -> None:
    ts = torch.arange(200, dtype=torch.int64) * 60_000_000_000
    with pytest.raises(WalkForwardError, match="fewer folds"):
        fold_layout(ts, 5, min_bars=30)


def test_datamodule_start_end_limit_the_splits() -> None:
    ts = _bars_timestamps()
    start, end = pd.Timestamp(int(ts[500]), tz="UTC").isoformat(), pd.Timestamp(int(ts[3000]), tz="UTC").isoformat()
    dm = BarDataModule(synthetic_bars=4000, lookback=12, horizon=3, cache_dir=None, start=start, end=end,
                       features=["logret_1", "std_logret_20"], known_future=[])
    dm.setup()
    for split in dm.splits.values():
        assert int(split.timestamps.min()) >= int(ts[500]) and int(split.timestamps.max()) < int(ts[3000])
    assert int(dm.train_split.timestamps.min()) == int(ts[500])
    assert bool(dm.train_split.valid[0])  # features computed on all bars: warmed up at the first training bar
    assert int(dm.test_split.timestamps.max()) == int(ts[2999])


# ------------------------------------------------------------------------------------------------ end to end runs
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("wf") / "whole"
    return out, _walkforward(out)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Fold 0 alone (``--fold 0``), a kill in the middle of fold 1 (its directory left without done.json), then a
    full rerun."""
    out = tmp_path_factory.mktemp("wf") / "resumed"
    done0 = _walkforward(out, "--fold", "0")
    assert sorted(p.name for p in out.iterdir()) == ["fold_0", "layout.json"]  # one fold, nothing gathered
    marker = out / "fold_0" / "marker"
    marker.write_text("fold 0 finished before the kill")
    mtime = (out / "fold_0" / "done.json").stat().st_mtime_ns
    (out / "fold_1" / "export").mkdir(parents=True)
    (out / "fold_1" / "export" / "metadata.json").write_text("{half written")
    table = _walkforward(out)
    return out, done0, marker, mtime, table


def test_walkforward_test_stretches_are_unseen_disjoint_and_chronological(uninterrupted) -> None:
    out, table = uninterrupted
    layout = json.loads((out / "layout.json").read_text())
    assert table["gathered"] == [0, 1, 2] and table["missing"] == []
    previous_end = -math.inf
    for k, cut in enumerate(layout["folds"]):
        done = json.loads((out / f"fold_{k}" / "done.json").read_text())
        assert done["cuts"] == cut
        meta = foxhunt.load(out / f"fold_{k}" / "export").metadata
        # the export's own record of the bars it trained and selected on lies before its test stretch
        seen = meta["data"]["seen_span"]["SYN0"]
        assert seen[0] >= _ns(cut["train_start"]) and seen[1] < _ns(cut["test_start"])
        from safetensors.torch import load_file

        ts = load_file(str(out / f"fold_{k}" / "oos.safetensors"))["timestamps"]
        assert int(ts.min()) == _ns(cut["test_start"]) and int(ts.min()) > previous_end
        if cut["end"] is not None:
            assert int(ts.max()) < _ns(cut["end"])
        previous_end = int(ts.max())
        # no training bar of this fold (or an earlier one) inside this test stretch
        for j in range(k + 1):
            span = foxhunt.load(out / f"fold_{j}" / "export").metadata["data"]["seen_span"]["SYN0"]
            assert not bool(((ts >= span[0]) & (ts <= span[1])).any()), (j, k)
        assert (out / f"fold_{k}" / "runs").is_dir()  # each fold logs to its own directory
    assert (out / "equity.png").stat().st_size > 0


def test_out_of_sample_series_covers_exactly_the_test_stretches(uninterrupted) -> None:
    out, table = uninterrupted
    layout = json.loads((out / "layout.json").read_text())
    oos = load_out_of_sample(out)
    ts = _bars_timestamps()
    expected = ts[ts >= _ns(layout["folds"][0]["test_start"])]
    assert torch.equal(oos.split.timestamps, expected)  # every bar from the first test bar on, once, in order
    assert set(oos.positions) == {"tft", "dqn", "ensemble", "buy_and_hold", "flat", "oracle"}
    assert not bool(oos.positions["flat"].any())
    for k, cut in enumerate(layout["folds"]):
        rows = (oos.split.timestamps >= _ns(cut["test_start"])) & (oos.split.timestamps < (_ns(cut["end"]) or 2**62))
        assert torch.equal(rows, oos.fold == k)
    # the table is the back-test of the concatenated positions
    from foxhunt.evaluation.backtest import policy_metrics

    again = policy_metrics(oos.positions, oos.split, table["cost_bps"], table["bars_per_year"])
    for who, row in table["policies"].items():
        assert row["sharpe"] == pytest.approx(again[who]["sharpe"], abs=1e-12), who
        assert row["n_bars"] == table["decision_bars"]
    assert sum(f["bars"] for f in table["per_fold"]) == table["bars"] == len(expected)
    assert json.loads((out / "walkforward.json").read_text())["gathered"] == [0, 1, 2]


def test_significance_per_policy_when_available(uninterrupted) -> None:
    pytest.importorskip("foxhunt.evaluation.significance")
    _, table = uninterrupted
    assert table["significance"]
    for row in [table["policies"], *(f["policies"] for f in table["per_fold"])]:
        for who, m in row.items():
            if m["n_trades"] == 0:  # flat, or a member (or ensemble) that never traded: no Sharpe to test (null)
                assert m["sharpe_se"] is None and m["sharpe_ci_low"] is None, who
                continue
            assert m["sharpe_se"] > 0 and m["sharpe_ci_low"] <= m["sharpe_ci_high"], who
            assert 0.0 <= m["psr_vs_flat"] <= 1.0 and m["sharpe_lo"] is not None, who
            if who != "buy_and_hold":  # Ledoit & Wolf's paired test against buy-and-hold, on the same bars
                assert 0.0 <= m["p_vs_bh"] <= 1.0 and 0.0 < m["p_vs_bh_boot"] <= 1.0, who
                assert m["sharpe_diff_vs_bh"] == pytest.approx(m["sharpe"] - row["buy_and_hold"]["sharpe"]), who
    assert table["policies"]["buy_and_hold"]["p_vs_bh"] is None  # no difference to itself to test


def test_resume_skips_finished_folds_and_matches_an_uninterrupted_run(uninterrupted, resumed) -> None:
    _, whole = uninterrupted
    out, done0, marker, mtime, table = resumed
    assert done0["fold"] == 0
    assert marker.exists() and (out / "fold_0" / "done.json").stat().st_mtime_ns == mtime  # fold 0 was not redone
    assert json.loads((out / "fold_1" / "export" / "metadata.json").read_text())["format"] == "foxhunt-export"
    assert table["policies"] == whole["policies"]
    assert table["per_fold"] == whole["per_fold"]


def test_gather_only_reads_finished_folds(resumed, uninterrupted) -> None:
    out, *_ = resumed
    (out / "walkforward.json").unlink()
    table = main(["--gather", "--out", str(out), "--no_figure", "--n_boot", "100"])
    assert table["policies"] == uninterrupted[1]["policies"]
    assert json.loads((out / "walkforward.json").read_text())["gathered"] == [0, 1, 2]
    # an unfinished fold is left out (and named), not trained
    (out / "fold_2" / "done.json").rename(out / "fold_2" / "done.json.bak")
    try:
        partial = main(["--gather", "--out", str(out), "--no_figure", "--n_boot", "100"])
        assert partial["gathered"] == [0, 1] and partial["missing"] == [2]
        assert partial["per_fold"] == table["per_fold"][:2]
    finally:
        (out / "fold_2" / "done.json.bak").rename(out / "fold_2" / "done.json")


def test_rerun_with_another_layout_is_refused(resumed) -> None:
    out, *_ = resumed
    with pytest.raises(WalkForwardError, match="another layout"):
        main(["--config", TINY, "--folds", "2", "--out", str(out), "--", *FAST])
    with pytest.raises(WalkForwardError, match="another layout"):  # another data or model setting
        _walkforward(out, overrides=["--model.cost_bps", "3.0"])


def test_several_devices_per_fold_are_refused(tmp_path: Path) -> None:
    with pytest.raises(WalkForwardError, match="one device"):
        main(["--config", TINY, "--folds", "3", "--out", str(tmp_path / "wf"), "--", "--trainer.devices", "2"])
    assert not (tmp_path / "wf").exists()


@pytest.mark.slow
def test_martingale_walkforward_sharpe_intervals_cover_zero(tmp_path: Path) -> None:
    """No signal and no costs: no policy's out-of-sample Sharpe is significantly different from zero."""
    pytest.importorskip("foxhunt.evaluation.significance")
    table = main(["--config", TINY, "--folds", "3", "--out", str(tmp_path / "wf"), "--no_figure", "--",
                  "--data.synthetic_bars", "20000", "--data.signal_strength", "0", "--model.cost_bps", "0",
                  "--log_figures", "false", "--trainer.enable_progress_bar", "false"])
    for who, row in table["policies"].items():
        if row["n_trades"] == 0:  # flat (and any policy that never trades): no Sharpe
            continue
        assert row["sharpe_ci_low"] <= 0.0 <= row["sharpe_ci_high"], (who, row)


@pytest.mark.slow
def test_martingale_walkforward_no_policy_loses_more_than_its_costs(tmp_path: Path) -> None:
    """No signal, 1 bp costs: out of sample, every policy's gross P&L (before costs) is consistent with zero, so what it
    lost is what it paid; a z-bound of 3 on the gross sum under the martingale null, whose variance is sum p_t^2 r_t^2."""
    from foxhunt.trading.pnl import position_changes

    out = tmp_path / "wf"
    main(["--config", TINY, "--folds", "3", "--out", str(out), "--no_figure", "--",
          "--data.synthetic_bars", "20000", "--data.signal_strength", "0", "--model.cost_bps", "1.0",
          "--log_figures", "false", "--trainer.enable_progress_bar", "false"])
    oos = load_out_of_sample(out)
    returns = torch.nan_to_num(oos.split.returns.double())
    valid = oos.split.valid
    reset = oos.split.first_bar
    for who, p in oos.positions.items():
        pos = torch.where(valid, p.double(), torch.zeros_like(p, dtype=torch.float64))
        gross = pos * returns
        costs = 1e-4 * float(position_changes(pos, reset).sum())
        net = float(gross.sum()) - costs
        se = math.sqrt(float((gross**2).sum()))
        assert net >= -costs - 3.0 * se, (who, net, costs, se)  # never worse than flat by more than its costs


def test_a_layout_without_finished_folds_is_replaced(tmp_path) -> None:
    """A first run refused before any fold finished (a config error, say) does not block the corrected rerun."""
    from foxhunt.walkforward.plan import WalkForwardError, fold_dir, settle_layout

    first = {"folds": [{"k": 0}, {"k": 1}], "fingerprint": "a"}
    settle_layout(tmp_path, first)
    fixed = {"folds": [{"k": 0}, {"k": 1}], "fingerprint": "b"}
    assert settle_layout(tmp_path, fixed) == fixed
    fold_dir(tmp_path, 0).mkdir(parents=True)
    (fold_dir(tmp_path, 0) / "done.json").write_text("{}")
    with pytest.raises(WalkForwardError, match="differs in"):
        settle_layout(tmp_path, first)  # now a finished fold belongs to the layout on disk


def test_each_fold_is_reported_against_the_previous_folds_model_on_its_stretch(uninterrupted, capsys) -> None:
    """Fold k's done.json and the gathered table hold fold k's ensemble against fold k-1's export, both trading fold
    k's test stretch as an account of its own: fold k's row is its own per-fold figure, fold k-1's the previous
    export's back-test on that stretch, recomputed here."""
    from foxhunt.evaluation.backtest import policy_pnl
    from foxhunt.evaluation.trading import pnl_figures
    from foxhunt.walkforward.gather import format_versus_previous
    from foxhunt.walkforward.plan import Fold
    from foxhunt.walkforward.score import own_account

    out, table = uninterrupted
    layout = json.loads((out / "layout.json").read_text())
    per_fold = table["per_fold"]
    assert per_fold[0]["versus_previous"] is None
    bars = BarDataModule(synthetic_bars=4000, signal_strength=0.3, lookback=12, horizon=3, cache_dir=None,
                         features=["logret_1"], known_future=[]).load()
    for f in per_fold[1:]:
        k, vs = f["fold"], f["versus_previous"]
        assert vs == json.loads((out / f"fold_{k}" / "done.json").read_text())["versus_previous"]
        assert vs["fold"] == k - 1 and vs["reference"] == f"fold {k - 1}"
        assert list(vs["rows"]) == [f"fold {k - 1}", f"fold {k}"] and vs["bars"] == f["decision_bars"]
        own = vs["rows"][f"fold {k}"]
        assert own["sharpe"] == pytest.approx(f["policies"]["ensemble"]["sharpe"], abs=1e-12)
        previous = foxhunt.load(out / f"fold_{k - 1}" / "export")
        split = previous.split(bars)
        stretch = split.select(Fold(**layout["folds"][k]).contains(split.timestamps))
        held, account = own_account({"e": previous.model.evaluate(stretch).positions["ensemble"]}, stretch)
        pnl = policy_pnl(held["e"], account, table["cost_bps"])
        sharpe = float(pnl_figures(pnl, torch.ones_like(pnl, dtype=torch.bool), table["bars_per_year"])[1])
        assert vs["rows"][f"fold {k - 1}"]["sharpe"] == pytest.approx(sharpe, abs=1e-12)
        for key in ("sharpe_diff", "sharpe_diff_se", "p_hac", "p_boot", "dm", "dm_p"):
            assert key in own
    text = format_versus_previous(per_fold)
    assert "against the previous fold's" in text and len(text.splitlines()) == 3 + len(per_fold) - 1
