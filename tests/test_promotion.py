"""The promotion rule: its declaration, its verdicts on plain cases, that peeking changes nothing, and its
false-promotion rate and power on 200 simulated paired streams (fat-tailed, serially correlated, a common factor)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from foxhunt.evaluation.hac import long_run_variance
from foxhunt.evaluation.paired import newey_west_lags
from foxhunt.evaluation.promotion import (
    PromotionRule,
    Verdict,
    best_promoted,
    holm_adjusted,
    mixture_log_e,
    mixture_rho2,
    newey_west_at,
    running_newey_west,
    variance_bars,
)
from foxhunt.quality.promotion_streams import paired_streams, promotion_rate

STREAMS = 200


def _pair(n: int = 800, edge: float = 0.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    s = paired_streams(1, n, edge=edge, seed=seed)
    return s.champion[0], s.challengers[0, 0]


def test_rule_round_trips_through_json_and_refuses_bad_values() -> None:
    rule = PromotionRule(min_bars=300, alpha=0.01, method="sequential", horizon=2_000)
    assert PromotionRule.from_dict(json.loads(json.dumps(rule.to_dict()))) == rule
    assert PromotionRule.from_dict({}) == PromotionRule()
    assert PromotionRule().bars_needed == 500 and PromotionRule(horizon=800).bars_needed == 800
    for bad, word in [({"alpha": 0.7}, "alpha"), ({"method": "peek"}, "method"), ({"min_bars": 5}, "min_bars"),
                      ({"min_bars": 500, "horizon": 100}, "horizon"), ({"min_bars": 500.0}, "min_bars"),
                      ({"bars": 3}, "'bars'")]:
        with pytest.raises(ValueError, match=word):
            PromotionRule.from_dict(bad)


def test_check_refuses_unequal_or_non_finite_series() -> None:
    champ, chal = _pair()
    rule = PromotionRule()
    with pytest.raises(ValueError, match="challenger 'b': 799 bars"):
        rule.check(champ, {"b": chal[:-1]})
    bad = chal.copy()
    bad[17] = np.nan
    with pytest.raises(ValueError, match="challenger 'b': bar 17 is not finite"):
        rule.check(champ, {"b": bad})
    with pytest.raises(ValueError, match="at least one challenger"):
        rule.check(champ, {})


@pytest.mark.parametrize("method", ["fixed", "sequential"])
def test_plain_cases_promote_keep_and_never_promote_identical(method: str) -> None:
    champ, better = _pair(2_000, edge=0.3, seed=1)
    rule = PromotionRule(min_bars=500, method=method, horizon=2_000)
    worse = champ - (better - champ)  # the mirror image: as much worse as ``better`` is better
    early = rule.check(champ[:499], {"better": better[:499]})
    assert early["better"].decision == "undecided" and early["better"].bars == 499
    rounded = champ * (1.0 + 1e-15 * np.sign(champ))  # the same positions computed twice: equal up to rounding
    verdicts = rule.check(champ, {"better": better, "worse": worse, "same": champ.copy(), "rounded": rounded})
    assert verdicts["better"].decision == "promote"
    assert verdicts["worse"].decision == "keep" and verdicts["same"].decision == "keep"
    assert verdicts["same"].evidence["identical"] is True and verdicts["rounded"].evidence["identical"] is True
    assert verdicts["rounded"].decision == "keep"
    assert best_promoted(verdicts) == "better"
    for v in verdicts.values():  # strict JSON, with the promised fields
        json.dumps(v.evidence, allow_nan=False)
        assert v.evidence["method"] == method and v.evidence["alpha"] == 0.05
    ev = verdicts["better"].evidence
    for key in ("statistic", "p_value", "dm_statistic", "sharpe_difference_per_bar", "sharpe_difference_se_per_bar"):
        assert math.isfinite(ev[key]), key
    assert 0 <= ev["p_value"] < 0.05 and ev["mean_difference"] > 0


def test_fixed_rule_tests_once_at_the_horizon_whatever_follows() -> None:
    champ, chal = _pair(1_500, edge=0.15, seed=2)
    rule = PromotionRule(min_bars=400, horizon=600)
    at = rule.check(champ[:600], {"c": chal[:600]})["c"]
    tail = chal.copy()
    tail[600:] -= 1.0  # whatever happens after the horizon does not change the decision taken there
    later = rule.check(champ, {"c": tail})["c"]
    assert later.bars == at.bars == 600 and later.decision == at.decision
    assert later.evidence.keys() == at.evidence.keys()
    for key, value in at.evidence.items():  # equal but for the last bit of a reduction over another allocation
        assert later.evidence[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key
    assert all(rule.check(champ[:t], {"c": chal[:t]})["c"].decision == "undecided" for t in (400, 599))


def test_sequential_decision_is_the_same_checked_every_bar_or_once() -> None:
    champ, chal = _pair(1_500, edge=0.2, seed=3)
    rule = PromotionRule(min_bars=300, method="sequential")
    once = rule.check(champ, {"c": chal})["c"]
    assert once.decision == "promote"
    first = next(t for t in range(300, 1_501) if rule.check(champ[:t], {"c": chal[:t]})["c"].decision != "undecided")
    assert first == once.bars
    assert rule.check(champ[:first], {"c": chal[:first]})["c"] == once


def test_running_newey_west_is_hacs_estimate_at_every_bar() -> None:
    champ, chal = _pair(700, seed=4)
    d = chal - champ
    path = newey_west_at(d, np.arange(50, 701))
    for t in (50, 99, 100, 333, 700):
        ref = long_run_variance(torch.from_numpy(d[:t]), "bartlett", float(newey_west_lags(t) + 1), prewhiten=False)
        assert path[t - 50] == pytest.approx(float(ref), rel=1e-10)


def test_the_sequential_variance_is_refreshed_from_past_bars_only() -> None:
    t = np.arange(30, 60_000)
    g = variance_bars(t)
    assert np.all(g <= t) and np.all(np.diff(g) >= 0) and np.all(t - g < np.maximum(1, t // 1_000))
    assert np.array_equal(g[t < 2_000], t[t < 2_000])  # every bar at first
    champ, chal = _pair(5_000, seed=5)
    d = chal - champ
    path = running_newey_west(d, 500)
    for bar in (500, 1_999, 2_001, 4_321, 5_000):
        end = int(variance_bars(np.array([bar]))[0])
        assert path[bar - 500] == pytest.approx(float(newey_west_at(d[:end], np.array([end]))[0]), rel=1e-10)


def test_mixture_e_process_is_the_half_normal_mixture_and_has_mean_one() -> None:
    rho2, v = mixture_rho2(0.05, 500), 500.0
    lam = np.linspace(0, 20 * math.sqrt(rho2), 200_001)  # quadrature of ∫ exp(λs - λ²v/2) half-normal(ρ) dλ
    dens = 2 * stats.norm.pdf(lam, scale=math.sqrt(rho2))
    for s in (-30.0, 0.0, 12.5, 60.0):
        ref = np.trapezoid(np.exp(lam * s - lam**2 * v / 2) * dens, lam)
        assert math.exp(float(mixture_log_e(np.array([s]), np.array([v]), rho2)[0])) == pytest.approx(ref, rel=1e-6)
    z = np.linspace(-30, 30, 300_001)  # a martingale: E[E_t] = 1 for s ~ N(0, v) (quadrature: its variance is infinite)
    e = np.exp(mixture_log_e(z * math.sqrt(v), np.full_like(z, v), rho2))
    assert float(np.trapezoid(e * stats.norm.pdf(z), z)) == pytest.approx(1.0, rel=1e-6)


def test_holm_adjusted_p_values() -> None:
    adj = holm_adjusted(np.array([0.01, 0.04, 0.03, 0.2]))  # sorted 0.01, 0.03, 0.04, 0.2: 0.04, 0.09, 0.09, 0.2
    np.testing.assert_allclose(adj, [0.04, 0.09, 0.09, 0.2])


def test_verdict_refuses_an_unknown_decision_and_makes_evidence_strict_json() -> None:
    with pytest.raises(ValueError, match="decision"):
        Verdict("maybe", 3)
    assert Verdict("keep", 3, {"x": math.inf, "y": [math.nan]}).evidence == {"x": None, "y": [None]}


RULES = {
    "fixed@500": PromotionRule(min_bars=500),
    "fixed@2000": PromotionRule(min_bars=500, horizon=2_000),
    "sequential": PromotionRule(min_bars=500, method="sequential", horizon=2_000),
}


def promotion_rates(rule: PromotionRule, n_streams: int, edge: float, n_challengers: int, seed: int) -> float:
    """Share of 2,000-bar streams in which the rule promotes some challenger."""
    return promotion_rate(rule, n_streams, 2_000, edge, n_challengers, seed)


def binomial_bound(n: int, p: float = 0.05, level: float = 0.99) -> float:
    """The largest share of n streams that a true rate p reaches with probability ``level``."""
    return float(stats.binom.ppf(level, n, p)) / n


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("n_challengers", [1, 3])
def test_false_promotions_stay_within_alpha_on_200_null_streams(name: str, n_challengers: int) -> None:
    rate = promotion_rates(RULES[name], STREAMS, 0.0, n_challengers, seed=11 + n_challengers)
    assert rate <= binomial_bound(STREAMS), rate


@pytest.mark.parametrize("name,minimum", [("fixed@500", 0.5), ("fixed@2000", 0.95), ("sequential", 0.9)])
def test_a_planted_edge_is_promoted_in_most_streams(name: str, minimum: float) -> None:
    assert promotion_rates(RULES[name], STREAMS, 0.12, 1, seed=21) >= minimum


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RULES))
def test_false_promotions_on_2000_null_streams(name: str) -> None:
    """The bigger version: 2,000 streams, the bound about 1.1 points above alpha."""
    rate = promotion_rates(RULES[name], 2_000, 0.0, 2, seed=31)
    assert rate <= binomial_bound(2_000), rate


@pytest.mark.parametrize("method", ["fixed", "sequential"])
def test_several_challengers_promote_only_the_better_one(method: str) -> None:
    s = paired_streams(1, 2_000, edge=[0.0, 0.3, 0.0], n_challengers=3, seed=41)
    rule = PromotionRule(min_bars=500, method=method, horizon=2_000)
    verdicts = rule.check(s.champion[0], {f"c{j}": s.challengers[0, j] for j in range(3)})
    assert [verdicts[f"c{j}"].decision for j in range(3)] == ["keep", "promote", "keep"]
    assert best_promoted(verdicts) == "c1" and verdicts["c1"].evidence["n_challengers"] == 3
    if method == "fixed":  # Holm: the smallest p-value times the family's size
        assert verdicts["c1"].evidence["p_value_adjusted"] == pytest.approx(3 * verdicts["c1"].evidence["p_value"])
    else:  # Bonferroni: each e-process against k / alpha
        assert verdicts["c1"].evidence["e_threshold"] == pytest.approx(60.0)


def test_family_alpha_spends_alpha_once_over_the_session() -> None:
    rule = PromotionRule(alpha=0.05, spending="families")
    assert PromotionRule(alpha=0.05).family_alpha(7) == 0.05
    assert rule.family_alpha(1) == pytest.approx(0.05 * 6 / math.pi**2)
    assert sum(rule.family_alpha(j) for j in range(1, 100_001)) == pytest.approx(0.05, rel=1e-4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="family"):
            rule.family_alpha(bad)
    with pytest.raises(ValueError, match="spending"):
        PromotionRule(spending="bonferroni")


def test_successive_null_families_promote_within_alpha_only_when_alpha_is_spent() -> None:
    """A session that tests a new family of one null challenger again and again (a retrain every N bars): each at
    alpha, some family is promoted in far more than alpha of the sessions; with spending="families", in at most
    alpha (within the Monte-Carlo bound)."""
    families = 8
    s = paired_streams(STREAMS, 500, edge=0.0, n_challengers=families, seed=51)
    rates = {}
    for spending in ("none", "families"):
        rule = PromotionRule(min_bars=500, spending=spending)
        ever = [any(rule.check(s.champion[i], {"c": s.challengers[i, j]}, family=j + 1)["c"].decision == "promote"
                    for j in range(families)) for i in range(STREAMS)]
        rates[spending] = float(np.mean(ever))
    assert rates["families"] <= binomial_bound(STREAMS), rates
    assert rates["none"] > 2 * binomial_bound(STREAMS), rates
