"""Diebold-Mariano with the HLN correction against hand computations and SciPy's t test; SPA and the model confidence
set wired to arch.bootstrap (same numbers as arch's own on the same losses) and finding a planted edge."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from foxhunt.evaluation.paired import (
    diebold_mariano,
    format_paired_report,
    hln_factor,
    model_confidence_set,
    newey_west_lags,
    paired_report,
    superior_predictive_ability,
)
from foxhunt.quality.promotion_streams import paired_streams


def _returns(n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_t(5, n) * 0.01
    return a, 0.6 * a + rng.standard_t(5, n) * 0.008 + 0.0004


def test_dm_without_lags_is_the_one_sample_t_test() -> None:
    a, b = _returns()
    dm = diebold_mariano(a, b, lags=0)
    ref = stats.ttest_1samp(a - b, 0.0)
    assert dm.statistic == pytest.approx(ref.statistic, rel=1e-12)
    assert dm.p_value == pytest.approx(ref.pvalue, rel=1e-9)
    one = diebold_mariano(a, b, lags=0, alternative="less")
    assert one.p_value == pytest.approx(stats.ttest_1samp(a - b, 0.0, alternative="less").pvalue, rel=1e-9)


def test_dm_with_lags_against_a_hand_computation() -> None:
    d = np.array([0.5, -1.0, 2.0, 0.25, -0.75, 1.5, 0.0, 1.0])
    n, lags = d.size, 2
    e = d - d.mean()
    gamma = [float((e[j:] * e[: n - j]).sum() / n) for j in range(lags + 1)]
    lrv = gamma[0] + 2 * (2 / 3 * gamma[1] + 1 / 3 * gamma[2])  # Bartlett weights 1 - j / (lags + 1)
    raw = d.mean() / math.sqrt(lrv / n)
    h = lags + 1
    hln = raw * math.sqrt((n + 1 - 2 * h + h * (h - 1) / n) / n)
    dm = diebold_mariano(d, np.zeros(n), lags=lags, alternative="greater")
    assert dm.raw_statistic == pytest.approx(raw, rel=1e-12)
    assert dm.statistic == pytest.approx(hln, rel=1e-12)
    assert dm.p_value == pytest.approx(stats.t.sf(hln, n - 1), rel=1e-10)
    assert hln_factor(n, h) == pytest.approx(math.sqrt((n + 1 - 2 * h + h * (h - 1) / n) / n))


def test_dm_defaults_and_refusals() -> None:
    a, b = _returns(1_000)
    assert diebold_mariano(a, b).lags == newey_west_lags(1_000) == 6
    assert diebold_mariano(a, b, variance="andrews-monahan").lags == 0
    assert math.isnan(diebold_mariano(a, a).statistic)  # identical: nothing to test
    assert math.isnan(diebold_mariano(a + 0.001, a).statistic)  # a constant difference, up to rounding: nor that
    with pytest.raises(ValueError, match="same bars"):
        diebold_mariano(a, b[:-1])
    with pytest.raises(ValueError, match="b: bar 3 is not finite"):
        diebold_mariano(a, np.where(np.arange(a.size) == 3, np.inf, b))
    with pytest.raises(ValueError, match="alternative"):
        diebold_mariano(a, b, alternative="bigger")


def test_spa_is_archs_on_the_losses() -> None:
    from arch.bootstrap import SPA

    s = paired_streams(1, 800, edge=[0.0, 0.0, 0.0], n_challengers=3, seed=5)
    champ, models = s.champion[0], {f"m{j}": s.challengers[0, j] for j in range(3)}
    ours = superior_predictive_ability(champ, models, reps=499, block=7, seed=3)
    ref = SPA(-champ, -np.column_stack(list(models.values())), block_size=7, reps=499, seed=3)
    ref.compute()
    assert ours.p_value == ref.pvalues["consistent"] and ours.p_value_lower == ref.pvalues["lower"]
    assert ours.p_value_upper == ref.pvalues["upper"] and ours.block == 7


def test_spa_finds_a_planted_edge_and_not_one_without() -> None:
    s = paired_streams(1, 1_500, edge=[0.0, 0.3, 0.0], n_challengers=3, seed=6)
    models = {f"m{j}": s.challengers[0, j] for j in range(3)}
    found = superior_predictive_ability(s.champion[0], models, reps=499, seed=0)
    assert found.p_value < 0.01 and found.better == ("m1",)
    null = paired_streams(1, 1_500, edge=0.0, n_challengers=3, seed=7)
    none = superior_predictive_ability(null.champion[0], {f"m{j}": null.challengers[0, j] for j in range(3)},
                                       reps=499, seed=0)
    assert none.p_value > 0.05 and none.better == ()


def test_mcs_is_archs_and_keeps_the_best() -> None:
    from arch.bootstrap import MCS

    s = paired_streams(1, 1_500, edge=[0.4, -0.4], n_challengers=2, seed=8)
    returns = {"champion": s.champion[0], "good": s.challengers[0, 0], "bad": s.challengers[0, 1]}
    ours = model_confidence_set(returns, size=0.1, reps=499, block=5, seed=1)
    ref = MCS(-np.column_stack(list(returns.values())), 0.1, reps=499, block_size=5, seed=1)
    ref.compute()
    assert ours.p_values == {["champion", "good", "bad"][i]: float(p) for i, p in ref.pvalues["Pvalue"].items()}
    assert ours.included == ("good",)
    with pytest.raises(ValueError, match="every series must have the same bars"):
        model_confidence_set({"a": s.champion[0], "b": s.challengers[0, 0][:-1]})


def test_paired_report_counts_identical_strategies_once() -> None:
    """SPA and the MCS (arch's MCS fails on two identical series) see each distinct series once; a twin shares its
    MCS p-value and the table says it trades exactly as the other."""
    s = paired_streams(1, 800, edge=[0.3, 0.0], n_challengers=2, seed=9)
    a, b = s.champion[0], s.challengers[0, 0]
    report = paired_report({"a": a, "b": b, "b2": b.copy(), "a2": a.copy()}, 252.0, n_boot=99)
    assert report["identical"] == {"b2": "b", "a2": "a"}
    assert report["mcs"]["mcs_p_values"]["b2"] == report["mcs"]["mcs_p_values"]["b"]
    assert report["spa"]["spa_better"] == ["b"]
    assert "b2 trades exactly as b" in format_paired_report(report, "t")
    flat = paired_report({k: np.zeros(100) for k in "xyz"}, 252.0, n_boot=9)
    assert flat["spa"] is None and flat["mcs"] is None and flat["rows"]["x"]["sharpe"] == 0.0
