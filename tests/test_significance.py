"""Sharpe-ratio statistics: hand-computed SEs and PSR/DSR, the stationary bootstrap's paths, coverage and widths."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import scipy.signal
import scipy.stats
import torch

from foxhunt.evaluation import significance as sig
from foxhunt.evaluation.significance import (
    autocorrelation_adjusted_sharpe,
    deflated_sharpe_ratio,
    expected_max_sharpe,
    hac_psr,
    hac_sharpe_standard_error,
    probabilistic_sharpe_ratio,
    psr_from_moments,
    psr_vs_benchmark,
    psr_vs_flat,
    sharpe_moments,
    sharpe_standard_error,
    sharpe_summary,
    stationary_bootstrap_indices,
    stationary_bootstrap_sharpe_ci,
    studentised_bootstrap_sharpe_ci,
)
from foxhunt.evaluation.trading import trading_metrics

PNL = [0.012, -0.004, 0.007, -0.015, 0.021, 0.003, -0.006, 0.009, 0.030, -0.011]


def hand_moments(xs: list[float]) -> tuple[float, float, float]:
    """Per-bar SR (sample std), skewness and kurtosis (divisor-n central moments), in plain Python."""
    n = len(xs)
    mu = sum(xs) / n
    m2, m3, m4 = (sum((x - mu) ** k for x in xs) / n for k in (2, 3, 4))
    sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1))
    return mu / sd, m3 / m2**1.5, m4 / m2**2


def iid_normal(n: int, sr_per_bar: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) + sr_per_bar) * 0.01


def ar1(innovations: torch.Tensor, phi: float) -> torch.Tensor:
    """AR(1) with the innovations' marginal variance: x[t] = phi x[t-1] + sqrt(1 - phi²) e[t], started stationary."""
    e = innovations.numpy() * math.sqrt(1.0 - phi * phi)
    e[0] = innovations[0].item()
    return torch.from_numpy(scipy.signal.lfilter([1.0], [1.0, -phi], e))


# ---- moments and standard errors -----------------------------------------------------------------------------------


def test_moments_match_hand_and_scipy() -> None:
    m = sharpe_moments(torch.tensor(PNL, dtype=torch.float64))
    sr, skew, kurt = hand_moments(PNL)
    assert m.n_bars == len(PNL)
    assert m.sr_per_bar == pytest.approx(statistics.mean(PNL) / statistics.stdev(PNL), rel=1e-12)
    assert m.sr_per_bar == pytest.approx(sr, rel=1e-12)
    assert m.skew == pytest.approx(skew, rel=1e-12)
    assert m.skew == pytest.approx(scipy.stats.skew(PNL, bias=True), rel=1e-12)
    assert m.kurtosis == pytest.approx(kurt, rel=1e-12)
    assert m.kurtosis == pytest.approx(scipy.stats.kurtosis(PNL, fisher=False, bias=True), rel=1e-12)


def test_lo_and_mertens_standard_errors_by_hand() -> None:
    sr, skew, kurt = hand_moments(PNL)
    n, bpy = len(PNL), 252.0
    lo = math.sqrt((1 + sr**2 / 2) / n) * math.sqrt(bpy)
    mertens = math.sqrt((1 - skew * sr + (kurt - 1) / 4 * sr**2) / n) * math.sqrt(bpy)
    assert sharpe_standard_error(PNL, bpy, method="lo") == pytest.approx(lo, rel=1e-12)
    assert sharpe_standard_error(PNL, bpy, method="mertens") == pytest.approx(mertens, rel=1e-12)
    assert sharpe_standard_error(PNL, bpy) == sharpe_standard_error(PNL, bpy, method="mertens")
    # Annualisation scales the SE by sqrt(bars per year), as it scales the Sharpe.
    assert sharpe_standard_error(PNL, 4 * bpy, "lo") == pytest.approx(2 * lo, rel=1e-12)


def test_mertens_equals_lo_for_normal_moments() -> None:
    # By the formula: γ3 = 0, γ4 = 3 turns 1 - γ3 SR + (γ4 - 1)/4 SR² into Lo's 1 + SR²/2.
    for sr in (-0.3, 0.0, 0.05, 0.4):
        assert sig._mertens_variance_factor(sr, 0.0, 3.0) == pytest.approx(1 + sr**2 / 2, rel=1e-15)
    # On data: mean + {-c, 0, c} in shares 1/6, 2/3, 1/6 has skewness 0 and kurtosis exactly 3 (1 / share of ±c).
    pnl = 0.002 + 0.01 * torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64).repeat(20)
    m = sharpe_moments(pnl)
    assert m.skew == pytest.approx(0.0, abs=1e-12) and m.kurtosis == pytest.approx(3.0, rel=1e-12)
    lo, mertens = sharpe_standard_error(pnl, 252.0, "lo"), sharpe_standard_error(pnl, 252.0, "mertens")
    assert mertens == pytest.approx(lo, rel=1e-12)


def test_negative_skew_and_fat_tails_widen_the_mertens_se() -> None:
    # A positive-Sharpe series with rare large losses (negative skew, kurtosis > 3): Lo's i.i.d.-normal SE is too small.
    pnl = torch.tensor([0.004] * 95 + [-0.05] * 5, dtype=torch.float64)
    m = sharpe_moments(pnl)
    assert m.sr_per_bar > 0 and m.skew < -3 and m.kurtosis > 10
    assert sharpe_standard_error(pnl, 252.0, "mertens") > 1.2 * sharpe_standard_error(pnl, 252.0, "lo")


# ---- PSR and DSR ---------------------------------------------------------------------------------------------------


def test_psr_against_a_hand_computed_value() -> None:
    sr, skew, kurt = hand_moments(PNL)
    n = len(PNL)
    for sr_star in (0.0, 0.1, -0.2):
        z = (sr - sr_star) * math.sqrt(n - 1) / math.sqrt(1 - skew * sr + (kurt - 1) / 4 * sr**2)
        assert probabilistic_sharpe_ratio(PNL, sr_star) == pytest.approx(scipy.stats.norm.cdf(z), rel=1e-12)
    assert psr_vs_flat(PNL) == probabilistic_sharpe_ratio(PNL, 0.0)
    # Far tails stay accurate (erfc, not 1 - erf).
    assert psr_from_moments(-0.5, 10_000, 0.0, 3.0, 0.0) == pytest.approx(
        scipy.stats.norm.cdf(-0.5 * math.sqrt(9_999) / math.sqrt(1.125)), rel=1e-9
    )


def test_psr_at_the_observed_sharpe_is_one_half_and_falls_with_the_benchmark() -> None:
    pnl = iid_normal(400, 0.08, seed=1)
    m = sharpe_moments(pnl)
    assert probabilistic_sharpe_ratio(pnl, m.sr_per_bar) == pytest.approx(0.5, abs=1e-15)
    psrs = [probabilistic_sharpe_ratio(pnl, s) for s in (-0.1, 0.0, 0.05, 0.1, 0.2)]
    assert all(a > b for a, b in zip(psrs, psrs[1:], strict=False))
    assert 0.0 < psrs[-1] < psrs[0] < 1.0


def test_psr_vs_benchmark_uses_the_benchmark_series_sharpe() -> None:
    pnl, bench = iid_normal(300, 0.1, seed=2), iid_normal(300, 0.03, seed=3)
    bench_sr = statistics.mean(bench.tolist()) / statistics.stdev(bench.tolist())
    assert psr_vs_benchmark(pnl, bench) == pytest.approx(probabilistic_sharpe_ratio(pnl, bench_sr), rel=1e-12)
    assert psr_vs_benchmark(pnl, pnl) == pytest.approx(0.5, abs=1e-12)
    assert math.isnan(psr_vs_benchmark(pnl, torch.zeros(300, dtype=torch.float64)))  # a benchmark with no Sharpe


def test_expected_max_sharpe_by_hand() -> None:
    trials = [0.01, 0.05, -0.02, 0.03, 0.00, 0.04, -0.01, 0.02]
    n, g = len(trials), 0.5772156649015329
    sr0 = statistics.stdev(trials) * (
        (1 - g) * scipy.stats.norm.ppf(1 - 1 / n) + g * scipy.stats.norm.ppf(1 - 1 / (n * math.e))
    )
    assert g == pytest.approx(np.euler_gamma, rel=1e-15)
    assert expected_max_sharpe(trials) == pytest.approx(sr0, rel=1e-12)
    assert expected_max_sharpe(torch.tensor(trials)) == pytest.approx(sr0, rel=1e-6)  # float32 input is fine too
    assert expected_max_sharpe([0.05]) == 0.0  # one trial: nothing selected
    assert expected_max_sharpe([0.05] * 10) == 0.0  # identical trials: no selection bias
    assert expected_max_sharpe([float("nan"), 0.05]) == 0.0  # a failed trial (no Sharpe) does not count
    assert math.isnan(expected_max_sharpe([]))
    # n_trials: the trials the selection ran over, some without a Sharpe (pruned); the spread is the finite ones'
    assert expected_max_sharpe(trials, n_trials=len(trials)) == expected_max_sharpe(trials)
    assert expected_max_sharpe(trials + [float("nan")] * 3, n_trials=len(trials)) == pytest.approx(sr0, rel=1e-12)
    assert expected_max_sharpe(trials, n_trials=len(trials) + 5) > sr0
    assert expected_max_sharpe([0.05], n_trials=10) == 0.0  # one Sharpe: no spread to estimate
    assert math.isnan(expected_max_sharpe([float("nan")], n_trials=3))
    with pytest.raises(ValueError, match="below"):
        expected_max_sharpe(trials, n_trials=len(trials) - 1)


def test_dsr_is_psr_for_one_trial_and_falls_as_trials_grow() -> None:
    pnl = iid_normal(1000, 0.08, seed=4)
    m = sharpe_moments(pnl)
    args = (m.sr_per_bar, m.n_bars, m.skew, m.kurtosis)
    assert deflated_sharpe_ratio(*args, [m.sr_per_bar]) == pytest.approx(psr_vs_flat(pnl), rel=1e-15)
    assert deflated_sharpe_ratio(*args, [m.sr_per_bar] * 5) == pytest.approx(psr_vs_flat(pnl), rel=1e-15)
    # Trials with the same spread (sample std 0.03 per bar), ever more of them: the expected maximum rises, DSR falls.
    g = torch.Generator().manual_seed(5)
    dsrs = []
    for n_trials in (2, 5, 10, 50, 200, 1000):
        z = torch.randn(n_trials, generator=g, dtype=torch.float64)
        trials = (z - z.mean()) / z.std() * 0.03
        assert float(trials.std()) == pytest.approx(0.03, rel=1e-12)
        dsrs.append(deflated_sharpe_ratio(*args, trials))
    assert psr_vs_flat(pnl) > dsrs[0]
    assert all(a > b for a, b in zip(dsrs, dsrs[1:], strict=False))
    # the same Sharpes with pruned trials (no Sharpe) among them: more trials tried, lower DSR
    assert deflated_sharpe_ratio(*args, trials, n_trials=2000) < dsrs[-1]
    assert dsrs[-1] < 0.5 < psr_vs_flat(pnl)  # 1000 trials of this spread explain away a Sharpe of 0.08 per bar


# ---- the stationary bootstrap --------------------------------------------------------------------------------------


def test_bootstrap_paths_are_wrapped_blocks_of_the_mean_length() -> None:
    n, mean_block = 50, 5.0
    idx = stationary_bootstrap_indices(n, 2000, mean_block, torch.Generator().manual_seed(0))
    assert idx.shape == (2000, n) and idx.dtype == torch.int64
    assert int(idx.min()) >= 0 and int(idx.max()) < n
    step = (idx[:, 1:] - idx[:, :-1]) % n
    continues = step == 1
    # A block continues with probability 1 - 1/mean_block (a restart can land on the next bar by chance: +1/n).
    assert continues.double().mean().item() == pytest.approx((1 - 1 / mean_block) + (1 / mean_block) / n, abs=0.01)
    assert bool(((idx[:, :-1] == n - 1) & (idx[:, 1:] == 0)).any())  # blocks wrap around the end
    # Starts are uniform over bars: every bar appears, in roughly equal shares.
    counts = torch.bincount(idx.flatten(), minlength=n).double()
    assert counts.min().item() > 0.85 * counts.mean().item()
    # mean_block = 1 restarts at every bar (i.i.d. resampling); a huge one never restarts (a circular shift).
    iid = stationary_bootstrap_indices(n, 500, 1.0, torch.Generator().manual_seed(1))
    assert ((iid[:, 1:] - iid[:, :-1]) % n == 1).double().mean().item() == pytest.approx(1 / n, abs=0.01)
    shift = stationary_bootstrap_indices(n, 500, 1e12, torch.Generator().manual_seed(2))
    assert torch.equal(shift, (shift[:, :1] + torch.arange(n)) % n)


def test_bootstrap_ci_covers_the_true_sharpe_at_about_the_nominal_rate() -> None:
    sr_per_bar, bpy = 0.05, 252.0
    true_sharpe = sr_per_bar * math.sqrt(bpy)
    g = torch.Generator().manual_seed(6)
    series = (torch.randn(200, 500, generator=g, dtype=torch.float64) + sr_per_bar) * 0.01
    hits = 0
    for i, pnl in enumerate(series):
        low, high = stationary_bootstrap_sharpe_ci(pnl, bpy, level=0.95, n_boot=200, seed=i)
        assert low < high
        hits += low <= true_sharpe <= high
    assert 0.88 <= hits / len(series) <= 0.99


def test_bootstrap_ci_is_reproducible_with_a_seed() -> None:
    pnl = iid_normal(500, 0.05, seed=7)
    a = stationary_bootstrap_sharpe_ci(pnl, 252.0, n_boot=300, seed=11)
    assert a == stationary_bootstrap_sharpe_ci(pnl, 252.0, n_boot=300, seed=11)
    assert a != stationary_bootstrap_sharpe_ci(pnl, 252.0, n_boot=300, seed=12)
    sharpe = sharpe_moments(pnl).sr_per_bar * math.sqrt(252.0)
    low, high = a
    assert low < sharpe < high


def test_bootstrap_in_chunks_matches_the_unchunked_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    pnl = iid_normal(500, 0.05, seed=8)
    whole = stationary_bootstrap_sharpe_ci(pnl, 252.0, n_boot=2000, seed=0)
    monkeypatch.setattr(sig, "_MAX_BOOTSTRAP_ELEMENTS", 500 * 7)  # 7 replicates a chunk, the last one short
    chunked = stationary_bootstrap_sharpe_ci(pnl, 252.0, n_boot=2000, seed=0)
    assert chunked != whole  # other draws ...
    for a, b in zip(whole, chunked, strict=True):
        assert a == pytest.approx(b, abs=0.15 * (whole[1] - whole[0]))  # ... of the same interval


def test_bootstrap_ci_is_wider_for_positively_autocorrelated_pnl() -> None:
    g = torch.Generator().manual_seed(9)
    e = torch.randn(2000, generator=g, dtype=torch.float64)
    iid = (e + 0.05) * 0.01
    ar = (ar1(e, 0.5) + 0.05) * 0.01  # same N(0.05, 1) marginal, lag-1 autocorrelation 0.5
    assert float(ar.std()) == pytest.approx(float(iid.std()), rel=0.1)
    assert sharpe_moments(ar).sr_per_bar == pytest.approx(sharpe_moments(iid).sr_per_bar, abs=0.1)

    def width(pnl: torch.Tensor, mean_block: float | None = None) -> float:
        low, high = stationary_bootstrap_sharpe_ci(pnl, 252.0, n_boot=500, mean_block=mean_block, seed=0)
        return high - low

    # The variance of a mean of AR(1) returns is (1 + phi) / (1 - phi) = 3 times the i.i.d. one: about 1.7x the width.
    assert width(ar) > 1.35 * width(iid)
    assert width(ar) > 1.3 * width(ar, mean_block=1.0)  # the i.i.d. bootstrap misses the dependence
    assert width(iid, mean_block=1.0) == pytest.approx(width(iid), rel=0.2)  # and blocks cost little without it


def test_mean_block_one_matches_the_normal_theory_and_long_blocks_collapse() -> None:
    pnl, bpy = iid_normal(1000, 0.05, seed=10), 252.0
    low, high = stationary_bootstrap_sharpe_ci(pnl, bpy, n_boot=1000, mean_block=1.0)
    se = sharpe_standard_error(pnl, bpy, "lo")
    assert (high - low) == pytest.approx(2 * 1.959964 * se, rel=0.12)
    # Blocks far longer than the series: every replicate is a circular shift, the same bars, the same Sharpe.
    sharpe = sharpe_moments(pnl).sr_per_bar * math.sqrt(bpy)
    low, high = stationary_bootstrap_sharpe_ci(pnl, bpy, n_boot=200, mean_block=1e12)
    assert low == pytest.approx(sharpe, rel=1e-9) and high == pytest.approx(sharpe, rel=1e-9)
    # Blocks several times the series' length: a replicate is one to a few long wrapped pieces, nearly the series
    # itself, and the interval is far too narrow (the mean block must stay well below n).
    low, high = stationary_bootstrap_sharpe_ci(pnl, bpy, n_boot=400, mean_block=5 * len(pnl))
    assert 0 < high - low < 0.8 * 2 * 1.959964 * se


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_bootstrap_on_cuda() -> None:
    pnl = iid_normal(1000, 0.05, seed=12)
    cpu = stationary_bootstrap_sharpe_ci(pnl, 252.0, n_boot=2000)
    gpu = stationary_bootstrap_sharpe_ci(pnl.cuda(), 252.0, n_boot=2000)
    assert gpu == stationary_bootstrap_sharpe_ci(pnl.cuda(), 252.0, n_boot=2000)
    for a, b in zip(cpu, gpu, strict=True):
        assert a == pytest.approx(b, abs=0.1 * (cpu[1] - cpu[0]))
    assert sharpe_summary(pnl.cuda(), 252.0)["sharpe"] == pytest.approx(sharpe_summary(pnl, 252.0)["sharpe"])


# ---- the summary and the edge cases --------------------------------------------------------------------------------


def test_summary_matches_the_parts_and_the_backtest_sharpe() -> None:
    pnl, bpy = iid_normal(600, 0.06, seed=13), 6260.0
    s = sharpe_summary(pnl, bpy, n_boot=300, seed=3)
    assert set(s) == {
        "sharpe", "sharpe_lo", "sharpe_se", "sharpe_se_iid", "sharpe_ci_low", "sharpe_ci_high", "psr_vs_flat",
        "psr_vs_flat_iid", "n_bars", "skew", "kurtosis",
    }  # fmt: skip
    assert all(isinstance(v, float) for v in s.values())
    m = sharpe_moments(pnl)
    # The back-test's Sharpe of a position of 1 on returns ``pnl`` at zero cost is the same number.
    backtest = trading_metrics(torch.ones(600), pnl, cost_bps=0.0, bars_per_year=bpy).sharpe.item()
    assert s["sharpe"] == pytest.approx(backtest, rel=1e-12)
    assert s["sharpe_se"] == hac_sharpe_standard_error(pnl, bpy)
    assert s["sharpe_se_iid"] == sharpe_standard_error(pnl, bpy, "mertens")
    assert s["sharpe_se"] == pytest.approx(s["sharpe_se_iid"], rel=0.15)  # independent bars: HAC ~ Mertens
    assert (s["sharpe_ci_low"], s["sharpe_ci_high"]) == studentised_bootstrap_sharpe_ci(pnl, bpy, n_boot=300, seed=3)
    assert s["sharpe_ci_low"] < s["sharpe"] < s["sharpe_ci_high"]
    assert s["psr_vs_flat"] == hac_psr(pnl) and s["psr_vs_flat_iid"] == psr_vs_flat(pnl)
    assert s["sharpe_lo"] == autocorrelation_adjusted_sharpe(pnl, bpy)
    assert (s["n_bars"], s["skew"], s["kurtosis"]) == (600.0, m.skew, m.kurtosis)
    assert sharpe_summary(pnl, bpy, n_boot=50, method="lo")["sharpe_se_iid"] == sharpe_standard_error(pnl, bpy, "lo")


@pytest.mark.parametrize(
    "pnl",
    [
        [],
        [0.01],
        [0.01, -0.02],  # fewer than 3 bars
        [0.0] * 100,  # a flat book
        [0.001] * 100,  # constant: zero variance up to rounding
        [0.01, float("nan"), -0.02, 0.03],  # a masked bar left in
        [0.01, float("inf"), -0.02, 0.03],
    ],
)
def test_series_without_a_sharpe_give_nan_not_exceptions(pnl: list[float]) -> None:
    s = sharpe_summary(torch.tensor(pnl, dtype=torch.float64), 252.0, n_boot=20)
    assert s["n_bars"] == len(pnl)
    flat = not any(pnl)  # a flat book (or no bar) has the Sharpe 0 of trading_metrics, and no statistics
    assert s["sharpe"] == 0.0 if flat else math.isnan(s["sharpe"]), s
    assert all(math.isnan(v) for k, v in s.items() if k not in ("n_bars", "sharpe")), s
    assert math.isnan(sharpe_standard_error(pnl, 252.0, "lo"))
    assert math.isnan(psr_vs_flat(pnl))
    assert math.isnan(deflated_sharpe_ratio(math.nan, len(pnl), math.nan, math.nan, [0.1, 0.2]))
    assert math.isnan(psr_from_moments(0.1, 2, 0.0, 3.0, 0.0))


def test_mostly_flat_strategy_still_gets_an_interval() -> None:
    # In the market on 3 bars of 300: about one i.i.d. replicate in twenty misses them all (zero variance, no
    # Sharpe) and is left out of the percentiles.
    pnl = torch.zeros(300, dtype=torch.float64)
    pnl[[10, 150, 290]] = torch.tensor([0.02, -0.01, 0.015], dtype=torch.float64)
    low, high = stationary_bootstrap_sharpe_ci(pnl, 252.0, n_boot=500, mean_block=1.0)
    assert math.isfinite(low) and math.isfinite(high) and low < high


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="bars_per_year"):
        sharpe_standard_error(PNL, 0.0)
    with pytest.raises(ValueError, match="method"):
        sharpe_standard_error(PNL, 252.0, method="bootstrap")
    with pytest.raises(ValueError, match="level"):
        stationary_bootstrap_sharpe_ci(PNL, 252.0, level=1.0)
    with pytest.raises(ValueError, match="n_boot"):
        stationary_bootstrap_sharpe_ci(PNL, 252.0, n_boot=0)
    with pytest.raises(ValueError, match="mean_block"):
        stationary_bootstrap_sharpe_ci(PNL, 252.0, mean_block=0.5)
    with pytest.raises(ValueError, match="1-D"):
        sharpe_moments(torch.zeros(3, 4))
