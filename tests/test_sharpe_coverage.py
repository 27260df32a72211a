"""Monte Carlo: do the printed 95% intervals cover the true Sharpe 95% of the time, and does the paired test reject
equal Sharpes 5% of the time? Fixed seeds; tolerances from the Monte Carlo error (3 standard errors of a rate, or the
issue's band 0.93-0.97 where that is wider). Each case also shows the i.i.d. or stacked statistic it replaces failing
on the same draws (issue 45's measurements: 0.752 on AR(1) φ = 0.5, 0.847 on two symbols at ρ = 0.8)."""

from __future__ import annotations

import math

import pytest
import torch

from foxhunt.data.market import MarketSplit
from foxhunt.evaluation.hac import hac_sharpe_variance
from foxhunt.evaluation.portfolio import book
from foxhunt.evaluation.sharpe_difference import sharpe_difference_test, sharpe_difference_z
from foxhunt.evaluation.significance import (
    _mertens_variance_factor,
    psr_vs_benchmark,
    stationary_bootstrap_sharpe_ci,
    studentised_bootstrap_sharpe_ci,
)

REPS, N = 2000, 1000
BAND = (0.93, 0.97)


def _rate_tolerance(p: float, reps: int) -> float:
    return 3.0 * math.sqrt(p * (1 - p) / reps)


def _sharpe(x: torch.Tensor) -> torch.Tensor:
    return x.mean(-1) / x.std(-1)


def _mertens_se(x: torch.Tensor) -> torch.Tensor:
    """The i.i.d. (Mertens) per-bar SE of each row, as today's table printed it."""
    dev = x - x.mean(-1, keepdim=True)
    m2 = (dev**2).mean(-1)
    skew, kurt = (dev**3).mean(-1) / m2**1.5, (dev**4).mean(-1) / m2**2
    sr = _sharpe(x)
    return torch.sqrt((1 - skew * sr + (kurt - 1) / 4 * sr**2) / x.shape[-1])


def _coverage(x: torch.Tensor, true_sr: float, se: torch.Tensor) -> float:
    return float(((_sharpe(x) - true_sr).abs() <= 1.959964 * se).double().mean())


def _hac_se(x: torch.Tensor) -> torch.Tensor:
    return (hac_sharpe_variance(x) / x.shape[-1]).sqrt()


def _ar1(phi: float, gen: torch.Generator, reps: int = REPS, n: int = N) -> torch.Tensor:
    e = torch.randn(reps, n, generator=gen, dtype=torch.float64)
    x = torch.empty_like(e)
    x[:, 0] = e[:, 0] / math.sqrt(1 - phi**2)
    for t in range(1, n):
        x[:, t] = phi * x[:, t - 1] + e[:, t]
    return x


def test_hac_interval_covers_on_iid_pnl() -> None:
    gen = torch.Generator().manual_seed(11)
    x = 0.05 + torch.randn(REPS, N, generator=gen, dtype=torch.float64)
    cover = _coverage(x, 0.05, _hac_se(x))
    assert BAND[0] <= cover <= BAND[1], cover


def test_hac_interval_covers_on_garch_pnl() -> None:
    """GARCH(1,1), α = 0.1, β = 0.85, normal innovations: volatility clustering (the Sharpe's σ part is dependent)."""
    gen = torch.Generator().manual_seed(12)
    omega, alpha, beta, mu = 0.05, 0.1, 0.85, 0.05
    z = torch.randn(REPS, N, generator=gen, dtype=torch.float64)
    var = torch.full((REPS,), omega / (1 - alpha - beta), dtype=torch.float64)
    eps = torch.empty_like(z)
    for t in range(N):
        eps[:, t] = var.sqrt() * z[:, t]
        var = omega + alpha * eps[:, t] ** 2 + beta * var
    true_sr = mu / math.sqrt(omega / (1 - alpha - beta))
    x = mu + eps
    cover = _coverage(x, true_sr, _hac_se(x))
    assert BAND[0] <= cover <= BAND[1], cover


def test_hac_interval_covers_on_ar1_pnl_where_the_iid_one_does_not() -> None:
    gen = torch.Generator().manual_seed(13)
    phi, true_sr = 0.5, 0.05
    x = _ar1(phi, gen) + true_sr / math.sqrt(1 - phi**2)  # SR = mean / stationary sd, 1 / sqrt(1 - φ²)
    cover = _coverage(x, true_sr, _hac_se(x))
    assert BAND[0] <= cover <= BAND[1], cover
    iid = _coverage(x, true_sr, _mertens_se(x))
    assert iid < 0.80, iid  # today's SE: about 0.75


def _two_symbol_split(a: torch.Tensor, b: torch.Tensor) -> MarketSplit:
    """Two symbols on one calendar, with log returns ``a`` and ``b`` (rows by symbol, then time)."""
    n = a.numel()
    ts = torch.arange(n, dtype=torch.int64) * 3_600_000_000_000 + 1_700_000_000_000_000_000
    returns = torch.cat([a, b]).float()
    return MarketSplit("mc", ["A", "B"], torch.cat([ts, ts]), torch.arange(2).repeat_interleave(n),
                       torch.ones(2 * n, 5, dtype=torch.float64), returns, returns, torch.ones(2 * n, dtype=torch.bool))


def test_the_book_of_two_correlated_symbols_is_covered_where_the_stacked_series_is_not() -> None:
    """Two symbols whose same-time returns correlate at 0.8, long both: the equal-weight book's Sharpe ± 1.96 HAC SE
    covers the book's true Sharpe; stacking the symbols' bars (today's scoring) covers its own target far less."""
    gen = torch.Generator().manual_seed(14)
    rho, mu, sd, reps = 0.8, 0.0005, 0.01, 1000
    e1 = torch.randn(reps, N, generator=gen, dtype=torch.float64)
    e2 = rho * e1 + math.sqrt(1 - rho**2) * torch.randn(reps, N, generator=gen, dtype=torch.float64)
    a, b = ((mu + sd * e).float().double() for e in (e1, e2))  # the split stores float32 returns
    books = torch.stack([book(torch.ones(2 * N), _two_symbol_split(a[r], b[r]), 0.0).pnl for r in range(reps)])
    # the book's true per-bar Sharpe, from 4 million draws of the same model
    big = torch.Generator().manual_seed(15)
    f1 = torch.randn(4_000_000, generator=big, dtype=torch.float64)
    f2 = rho * f1 + math.sqrt(1 - rho**2) * torch.randn(4_000_000, generator=big, dtype=torch.float64)
    truth = torch.log1p((torch.expm1(mu + sd * f1) + torch.expm1(mu + sd * f2)) / 2)
    true_sr = float(truth.mean() / truth.std())
    cover = _coverage(books, true_sr, _hac_se(books))
    assert BAND[0] - 0.01 <= cover <= BAND[1] + 0.01, cover  # 1,000 books: MC error 0.007
    stacked = torch.cat([a, b], dim=1)  # one long series of 2N "independent" bars
    stacked_sr = mu / sd
    assert _coverage(stacked, stacked_sr, _mertens_se(stacked)) < 0.88  # about 0.85


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_paired_test_size_is_five_percent_under_equal_sharpes(rho: float) -> None:
    """Ledoit & Wolf's HAC delta test of SR_a = SR_b, equal true Sharpes, correlation ``rho``: rejects ~5%."""
    gen = torch.Generator().manual_seed(20 + int(10 * rho))
    reps, sr = 2500, 0.05
    e1 = torch.randn(reps, N, generator=gen, dtype=torch.float64)
    e2 = rho * e1 + math.sqrt(1 - rho**2) * torch.randn(reps, N, generator=gen, dtype=torch.float64)
    diff, se = sharpe_difference_z(sr + e1, sr + e2)
    size = float(((diff / se).abs() > 1.959964).double().mean())
    assert abs(size - 0.05) <= _rate_tolerance(0.05, reps), size


def test_psr_vs_buy_and_hold_was_no_test_of_a_difference() -> None:
    """Today's 'PSR vs B&H' (the benchmark's Sharpe taken as known), two-sided at 5%, under equal Sharpes: about 12%
    false positives at correlation 0 and none at 0.9 (issue 45), where the paired test keeps 5%."""
    gen = torch.Generator().manual_seed(30)
    reps, sr = 1000, 0.05
    rates = {}
    for rho in (0.0, 0.9):
        e1 = torch.randn(reps, N, generator=gen, dtype=torch.float64)
        e2 = rho * e1 + math.sqrt(1 - rho**2) * torch.randn(reps, N, generator=gen, dtype=torch.float64)
        psr = torch.tensor([psr_vs_benchmark(sr + e1[r], sr + e2[r]) for r in range(reps)])
        rates[rho] = float(((psr > 0.975) | (psr < 0.025)).double().mean())
    assert rates[0.0] > 0.09 and rates[0.9] < 0.01, rates


@pytest.mark.slow
@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_paired_bootstrap_size_is_five_percent_under_equal_sharpes(rho: float) -> None:
    """The studentised circular block bootstrap p-value (Ledoit & Wolf 2008, 3.2.2), on AR(1) φ = 0.2 pairs."""
    gen = torch.Generator().manual_seed(40 + int(10 * rho))
    reps, n, sr, phi = 800, 1000, 0.05, 0.2
    e1, e2 = _ar1(phi, gen, reps, n), _ar1(phi, gen, reps, n)
    b = rho * e1 + math.sqrt(1 - rho**2) * e2
    p = [sharpe_difference_test(sr + e1[r], sr + b[r], 252.0, n_boot=199, seed=r).p_value_bootstrap
         for r in range(reps)]
    size = sum(v <= 0.05 for v in p) / reps
    assert abs(size - 0.05) <= _rate_tolerance(0.05, reps), size


@pytest.mark.slow
def test_the_tables_bootstrap_interval_covers_on_ar1_pnl_where_the_percentile_one_does_not() -> None:
    """The table's interval (Ledoit & Wolf's studentised circular block bootstrap, Politis & White's block) on AR(1)
    φ = 0.5 P&L; the stationary bootstrap's percentile interval with the same kind of block undercovers (~0.92)."""
    gen = torch.Generator().manual_seed(50)
    reps, phi, true_sr = 600, 0.5, 0.05
    x = _ar1(phi, gen, reps) + true_sr / math.sqrt(1 - phi**2)
    hits = percentile = 0
    for r in range(reps):  # 1 bar a "year": the interval of the per-bar Sharpe
        low, high = studentised_bootstrap_sharpe_ci(x[r], 1.0, n_boot=499, seed=r)
        hits += low <= true_sr <= high
        low, high = stationary_bootstrap_sharpe_ci(x[r], 1.0, n_boot=499, seed=r)
        percentile += low <= true_sr <= high
    assert BAND[0] - 0.01 <= hits / reps <= BAND[1] + 0.01, hits / reps  # 600 reps: MC error 0.009
    assert percentile / reps < hits / reps, (percentile / reps, hits / reps)


def test_mertens_factor_is_what_the_mc_compares_against() -> None:
    """The i.i.d. SE the Monte Carlo calls today's is the module's own Mertens factor."""
    x = 0.05 + torch.randn(1, 500, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dev = x[0] - x[0].mean()
    m2 = (dev**2).mean()
    factor = _mertens_variance_factor(float(_sharpe(x)[0]), float((dev**3).mean() / m2**1.5),
                                      float((dev**4).mean() / m2**2))
    assert float(_mertens_se(x)[0]) == pytest.approx(math.sqrt(factor / 500), rel=1e-12)
