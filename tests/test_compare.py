"""`python -m foxhunt.compare`: several exports after costs on the same unseen bars, the paired table, the refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from _export_helpers import small_export

import foxhunt
from foxhunt.compare import main, paired_returns
from foxhunt.data import load_bars
from foxhunt.data.io import write_bars
from foxhunt.data.synthetic import generate_market
from foxhunt.evaluation.paired import paired_report
from foxhunt.lit.tft import TFTModule


def _tft() -> TFTModule:
    return TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4, policy_interval=[0.5, 0.5])


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three untrained TFT exports of other seeds at no cost (each trades its median's sign), a fourth at a cost."""
    root = tmp_path_factory.mktemp("compare")
    out = {}
    for name, seed, cost in (("a", 0, 0.0), ("b", 1, 0.0), ("c", 2, 0.0), ("costly", 3, 1.0)):
        _, out[name] = small_export(root / name, {"tft": _tft()}, n_bars=600, seed=seed, cost_bps=cost,
                                    min_edge_confidence=None)
    return out


@pytest.fixture(scope="module")
def unseen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bars a year after the exports' training span."""
    path = tmp_path_factory.mktemp("bars") / "unseen.csv"
    write_bars(generate_market(n_bars=400, seed=11, start="2025-01-02").bars, path)
    return path


def test_two_exports_paired_table_on_the_same_bars(exports, unseen, capsys) -> None:
    report = main([str(exports["a"]), str(exports["b"]), "--data", str(unseen), "--n-boot", "99"])
    out = capsys.readouterr().out
    assert "each against a" in out and "ΔSharpe" in out and "Diebold-Mariano" in out
    rows = report["rows"]
    assert list(rows) == ["a", "b"] and report["spa"] is None and report["mcs"] is None
    assert "sharpe_diff" not in rows["a"] and math.isfinite(rows["b"]["sharpe_diff_se"])
    # the table is the paired report of the two books that paired_returns builds, on the same bars
    loaded = {k: foxhunt.load(exports[k]) for k in ("a", "b")}
    pnl, bpy = paired_returns(loaded, pd.read_csv(unseen), unseen.name)
    assert pnl["a"].shape == pnl["b"].shape and report["bars"] == pnl["a"].numel()
    ref = paired_report(pnl, bpy, n_boot=99)
    assert rows["b"]["sharpe_diff"] == pytest.approx(ref["rows"]["b"]["sharpe_diff"], rel=1e-12)
    assert rows["b"]["dm"] == pytest.approx(ref["rows"]["b"]["dm"], rel=1e-12)
    assert not torch.equal(pnl["a"], pnl["b"])


def test_an_export_against_itself_differs_by_nothing(exports, unseen) -> None:
    report = main([str(exports["a"]), str(exports["a"].parent / "a" / "metadata.json"), "--data", str(unseen),
                   "--n-boot", "19"])
    row = list(report["rows"].values())[1]
    assert row["sharpe_diff"] is None or math.isnan(row["sharpe_diff"])  # identical: nothing to test
    assert math.isnan(row["dm"])


def test_three_exports_add_spa_and_the_model_confidence_set(exports, unseen, capsys, tmp_path) -> None:
    report = main([str(exports[k]) for k in ("a", "b", "c")] + ["--data", str(unseen), "--n-boot", "99",
                                                                "--out", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert "Hansen's SPA" in out and "model confidence set" in out
    assert 0.0 <= report["spa"]["spa_p_value"] <= 1.0 and set(report["mcs"]["mcs_included"]) <= {"a", "b", "c"}
    assert (tmp_path / "t.json").exists()


def _error(argv: list[str], capsys) -> str:
    from foxhunt.cli_errors import run_command

    assert run_command(main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_refusals_are_one_line_exit_2(exports, unseen, capsys, tmp_path) -> None:
    seen = tmp_path / "seen.csv"
    write_bars(generate_market(n_bars=600, seed=0).bars, seen)  # the training span itself
    assert "overlaps the time span the model was trained" in _error(
        [str(exports["a"]), str(exports["b"]), "--data", str(seen)], capsys)
    assert "differ in cost_bps" in _error([str(exports["a"]), str(exports["costly"]), "--data", str(unseen)], capsys)
    assert "at least two exports" in _error([str(exports["a"]), "--data", str(unseen)], capsys)
    assert "no policy 'nope'" in _error([str(exports["a"]), str(exports["b"]), "--data", str(unseen), "--policy",
                                         "nope"], capsys)
    assert str(tmp_path / "missing") in _error([str(exports["a"]), str(tmp_path / "missing"), "--data", str(unseen)],
                                               capsys)
    allowed = main([str(exports["a"]), str(exports["b"]), "--data", str(seen), "--allow-overlap", "--n-boot", "9"])
    assert allowed["bars"] > 500  # in-sample bars too, when asked
    # at one given cost the two are compared
    report = main([str(exports["a"]), str(exports["costly"]), "--data", str(unseen), "--cost-bps", "2", "--n-boot", "9"])
    assert list(report["rows"]) == ["a", "costly"]


def test_walkforward_pair_is_the_paired_table_of_both_exports_on_the_stretch(exports, unseen, tmp_path) -> None:
    """versus_previous on a fold whose previous fold's export is ``a`` and whose own is ``b`` (untrained models
    that trade, unlike the walk-forward fixtures' flat tiny fits): the paired table of both as accounts of their own
    on the stretch; a previous fold not finished is said so."""
    import shutil

    from foxhunt.evaluation.backtest import policy_pnl
    from foxhunt.walkforward.plan import Fold
    from foxhunt.walkforward.score import own_account
    from foxhunt.walkforward.versus_previous import versus_previous

    bars = load_bars(unseen)
    stamps = [pd.Timestamp(t).isoformat() for t in sorted(pd.to_datetime(bars["timestamp"], utc=True).unique())]
    fold = Fold(1, stamps[0], stamps[50], stamps[100], None)
    out = tmp_path / "wf"
    assert versus_previous(out, Fold(0, stamps[0], stamps[50], stamps[100], None), bars, None, None, 0.0, 1.0) is None
    (out / "fold_0").mkdir(parents=True)
    assert "not finished" in versus_previous(out, fold, bars, None, None, 0.0, 1.0)["reason"]
    shutil.copytree(exports["a"], out / "fold_0" / "export")
    (out / "fold_0" / "done.json").write_text("{}")
    mine = foxhunt.load(exports["b"])
    split = mine.split(bars)
    test = split.select(fold.contains(split.timestamps))
    own = mine.model.evaluate(test).positions["ensemble"]
    report = versus_previous(out, fold, bars, test, own, 0.0, 1_000.0, n_boot=49)
    assert report["fold"] == 0 and list(report["rows"]) == ["fold 0", "fold 1"]
    theirs = foxhunt.load(exports["a"]).split(bars)
    theirs = theirs.select(fold.contains(theirs.timestamps))
    pnl = {}
    for name, loaded, rows in (("fold 0", foxhunt.load(exports["a"]), theirs), ("fold 1", mine, test)):
        held, account = own_account({"e": loaded.model.evaluate(rows).positions["ensemble"]}, rows)
        pnl[name] = policy_pnl(held["e"], account, 0.0)
    ref = paired_report(pnl, 1_000.0, n_boot=49)
    assert report["bars"] == ref["bars"] and math.isfinite(report["rows"]["fold 1"]["dm"])
    for key in ("sharpe_diff", "sharpe_diff_se", "p_hac", "dm", "dm_p"):
        assert report["rows"]["fold 1"][key] == pytest.approx(ref["rows"]["fold 1"][key], rel=1e-12), key
