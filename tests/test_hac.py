"""HAC pieces (foxhunt.evaluation.hac) and Ledoit & Wolf's paired test against hand computations and the papers'
closed forms: autocovariances, kernels, Andrews' bandwidth, Mertens as the i.i.d. limit, Lo's η(q) for AR(1),
Politis & White's block length against its AR(1) value, the delta method against Ledoit & Wolf's 4-moment form."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foxhunt.evaluation.hac import (
    andrews_bandwidth,
    autocorrelation_adjusted_eta,
    autocovariances,
    kernel_weights,
    lo_eta,
    long_run_variance,
    politis_white_block_length,
    sharpe_influence,
)
from foxhunt.evaluation.sharpe_difference import sharpe_difference_test, sharpe_difference_z
from foxhunt.evaluation.significance import (
    _mertens_variance_factor,
    autocorrelation_adjusted_sharpe,
    hac_psr,
    hac_sharpe_standard_error,
    sharpe_moments,
    sharpe_standard_error,
)


def ar1(n: int, phi: float, mean: float = 0.0, seed: int = 0, batch: int | None = None) -> torch.Tensor:
    """AR(1) series of unit innovation variance, started stationary, plus ``mean``."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(*((batch,) if batch else ()), n, generator=g, dtype=torch.float64)
    x = torch.empty_like(e)
    x[..., 0] = e[..., 0] / math.sqrt(1 - phi**2)
    for t in range(1, n):
        x[..., t] = phi * x[..., t - 1] + e[..., t]
    return x + mean


def test_autocovariances_match_the_direct_sums() -> None:
    x = ar1(200, 0.4, seed=1)
    d = (x - x.mean()).numpy()
    direct = [float(d[j:] @ d[: len(d) - j]) / len(d) for j in range(200)]
    np.testing.assert_allclose(autocovariances(x).numpy(), direct, rtol=1e-10, atol=1e-13)


def test_kernels_by_hand() -> None:
    w = kernel_weights(6, torch.tensor(4.0), "bartlett")
    np.testing.assert_allclose(w.numpy(), [1.0, 0.75, 0.5, 0.25, 0.0, 0.0], atol=1e-15)
    q = kernel_weights(3, torch.tensor(1.0), "qs")
    a = 6 * math.pi / 5  # x = 1
    assert float(q[0]) == 1.0
    assert float(q[1]) == pytest.approx(25 / (12 * math.pi**2) * (math.sin(a) / a - math.cos(a)), rel=1e-14)
    assert float(kernel_weights(2, torch.tensor(1e6), "qs")[1]) == pytest.approx(1.0, abs=1e-9)  # k(x) -> 1 at 0
    assert kernel_weights(4, torch.tensor(0.0), "qs").tolist() == [1.0, 0.0, 0.0, 0.0]


def test_long_run_variance_is_newey_west_with_a_given_bandwidth_and_the_variance_at_zero() -> None:
    x = ar1(500, 0.5, seed=2)
    g = autocovariances(x)
    assert float(long_run_variance(x, bandwidth=0.0, prewhiten=False)) == pytest.approx(float(x.var(correction=0)),
                                                                                        rel=1e-12)
    lags = 4  # Newey & West (1987): weights 1 - j / (L + 1), j <= L; Andrews' Bartlett at S = L + 1
    nw = float(g[0]) + 2 * sum((1 - j / (lags + 1)) * float(g[j]) for j in range(1, lags + 1))
    assert float(long_run_variance(x, "bartlett", bandwidth=lags + 1.0, prewhiten=False)) == pytest.approx(nw, rel=1e-12)


def test_andrews_bandwidth_by_hand() -> None:
    x = ar1(1000, 0.3, seed=3)
    d = x - x.mean()
    rho = float((d[1:] * d[:-1]).sum() / (d[:-1] ** 2).sum())
    assert float(andrews_bandwidth(x, "bartlett")) == pytest.approx(
        1.1447 * (4 * rho**2 / ((1 - rho) ** 2 * (1 + rho) ** 2) * 1000) ** (1 / 3), rel=1e-12)
    assert float(andrews_bandwidth(x, "qs")) == pytest.approx(1.3221 * (4 * rho**2 / (1 - rho) ** 4 * 1000) ** 0.2,
                                                              rel=1e-12)


def test_the_sharpe_influence_variance_is_mertens_factor() -> None:
    """The delta method's plain variance is Mertens' 1 - γ3 SR + (γ4 - 1)/4 SR² (at the divisor-n SR), exactly."""
    g = torch.Generator().manual_seed(4)
    x = 0.05 + torch.distributions.StudentT(4.0).sample((3000,)).double() * 0.8 + 0.1 * torch.randn(3000, generator=g,
                                                                                                      dtype=torch.float64)
    m = sharpe_moments(x)
    sr_n = float(x.mean() / x.std(correction=0))
    assert float(sharpe_influence(x).var(correction=0)) == pytest.approx(
        _mertens_variance_factor(sr_n, m.skew, m.kurtosis), rel=1e-12)
    # independent bars: the HAC SE is Mertens' to within the noise of its bandwidth
    assert hac_sharpe_standard_error(x, 252.0) == pytest.approx(sharpe_standard_error(x, 252.0), rel=0.1)


def test_hac_se_widens_on_positively_autocorrelated_pnl() -> None:
    """AR(1) φ = 0.5 P&L: the Sharpe's true SE is about sqrt((1 + φ)/(1 - φ)) = 1.73x the i.i.d. one."""
    x = ar1(20_000, 0.5, mean=0.1, seed=5)
    ratio = hac_sharpe_standard_error(x, 252.0) / sharpe_standard_error(x, 252.0)
    assert ratio == pytest.approx(math.sqrt(3.0), rel=0.1)
    assert 0.5 < hac_psr(x) < 1.0 and hac_psr(x) < hac_psr(x[torch.randperm(20_000, generator=torch.Generator().manual_seed(0))])


def test_lo_eta_matches_lo_2002_ar1_closed_form() -> None:
    """Lo (2002) eq. 20: for AR(1) returns η(q) = sqrt(q) [1 + 2φ/(1-φ) (1 - (1 - φ^q)/(q (1-φ)))]^(-1/2)."""
    for q, phi in ((12, 0.5), (52, 0.2), (252, -0.3), (6260, 0.13)):
        rho = torch.tensor([phi**k for k in range(1, q)], dtype=torch.float64)
        closed = math.sqrt(q) / math.sqrt(1 + 2 * phi / (1 - phi) * (1 - (1 - phi**q) / (q * (1 - phi))))
        assert float(lo_eta(q, rho)) == pytest.approx(closed, rel=1e-12)
    assert float(lo_eta(12, torch.zeros(11))) == pytest.approx(math.sqrt(12), rel=1e-15)  # uncorrelated: sqrt(q)
    # estimated on a long AR(1) with φ = 0.13 (foxhunt's buy-and-hold): sqrt(q) overstates the annual Sharpe ~1.14x
    x = ar1(50_000, 0.13, mean=0.02, seed=6)
    eta = float(autocorrelation_adjusted_eta(x, 6260.0))
    assert math.sqrt(6260) / eta == pytest.approx(math.sqrt(1.13 / 0.87), rel=0.03)
    sr = float(x.mean() / x.std())
    assert autocorrelation_adjusted_sharpe(x, 6260.0) == pytest.approx(sr * eta, rel=1e-12)


def test_politis_white_block_length_approaches_its_ar1_value() -> None:
    """For AR(1) the stationary bootstrap's optimal mean block is (2φ / (1 - φ²))^(2/3) n^(1/3) (Politis & White
    2004 with the true autocovariances: G = 2γ0 φ/(1-φ)², g(0) = γ0 (1+φ)/(1-φ)); the circular one (3/2)^(1/3) of it."""
    n, phi = 20_000, 0.5
    true = (2 * phi / (1 - phi**2)) ** (2 / 3) * n ** (1 / 3)
    estimates = [politis_white_block_length(ar1(n, phi, seed=s)) for s in range(5)]
    assert float(np.median(estimates)) == pytest.approx(true, rel=0.25)
    x = ar1(n, phi, seed=0)
    assert politis_white_block_length(x, circular=True) == pytest.approx(1.5 ** (1 / 3) * politis_white_block_length(x),
                                                                         rel=1e-6)
    iid = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert politis_white_block_length(iid) < 4.0


def test_delta_method_is_ledoit_wolf_four_moment_form() -> None:
    """Ledoit & Wolf (2008) eq. (3.x): se = sqrt(∇f(v)' Ψ ∇f(v) / T), v = (μa, μb, γa, γb) with γ = E x², Ψ the
    (HAC) covariance of y_t = (a - μa, b - μb, a² - γa, b² - γb); ours is the same number for any kernel weights."""
    a, b = ar1(800, 0.3, mean=0.1, seed=7), 0.6 * ar1(800, 0.3, mean=0.0, seed=7) + ar1(800, 0.2, mean=0.05, seed=8)
    mu_a, mu_b, g_a, g_b = float(a.mean()), float(b.mean()), float((a**2).mean()), float((b**2).mean())
    grad = np.array([g_a / (g_a - mu_a**2) ** 1.5, -g_b / (g_b - mu_b**2) ** 1.5,
                     -mu_a / (2 * (g_a - mu_a**2) ** 1.5), mu_b / (2 * (g_b - mu_b**2) ** 1.5)])
    y = np.stack([a - mu_a, b - mu_b, a**2 - g_a, b**2 - g_b], axis=1)
    y = y - y.mean(0)
    for bandwidth in (0.0, 6.0):
        psi = y.T @ y / 800
        for j in range(1, 800):
            w = max(0.0, 1 - j / bandwidth) if bandwidth else 0.0
            if w == 0:
                break
            gamma_j = y[j:].T @ y[:-j] / 800
            psi += w * (gamma_j + gamma_j.T)
        lw = math.sqrt(grad @ psi @ grad / 800)
        _, se = sharpe_difference_z(a, b, kernel="bartlett", prewhiten=False, bandwidth=bandwidth)
        assert float(se) == pytest.approx(lw, rel=1e-10)


def test_paired_test_basic_properties() -> None:
    a, b = ar1(600, 0.2, mean=0.15, seed=9), ar1(600, 0.2, mean=0.0, seed=10)
    t = sharpe_difference_test(a, b, 252.0, n_boot=299, seed=1)
    assert t == sharpe_difference_test(a, b, 252.0, n_boot=299, seed=1)  # reproducible
    back = sharpe_difference_test(b, a, 252.0, n_boot=299, seed=1)
    assert back.difference == pytest.approx(-t.difference) and back.p_value == pytest.approx(t.p_value)
    sr = lambda x: float(x.mean() / x.std()) * math.sqrt(252.0)  # noqa: E731
    assert t.difference == pytest.approx(sr(a) - sr(b), rel=1e-12)
    assert 0 < t.p_value < 0.05 and 1 / 300 <= t.p_value_bootstrap < 0.05 and t.ci_low > 0 < t.ci_high
    assert t.ci_low < t.difference < t.ci_high and t.block >= 1 and t.n_bars == 600
    same = sharpe_difference_test(a, a, 252.0, n_boot=50)
    assert math.isnan(same.p_value) and math.isnan(same.p_value_bootstrap)  # nothing to test
    assert math.isnan(sharpe_difference_test(torch.zeros(600), b, 252.0, n_boot=50).p_value)  # a flat book
    with pytest.raises(ValueError, match="same bars"):
        sharpe_difference_test(a, b[:-1], 252.0)
    with pytest.raises(ValueError, match="block"):
        sharpe_difference_test(a, b, 252.0, block=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_hac_and_the_paired_test_on_cuda() -> None:
    """The same figures on the series' device (the bootstrap draws differ: its interval agrees only roughly)."""
    a, b = ar1(2000, 0.3, mean=0.1, seed=11), ar1(2000, 0.3, mean=0.02, seed=12)
    assert hac_sharpe_standard_error(a.cuda(), 252.0) == pytest.approx(hac_sharpe_standard_error(a, 252.0), rel=1e-9)
    assert politis_white_block_length(a.cuda()) == pytest.approx(politis_white_block_length(a), rel=1e-9)
    cpu, gpu = sharpe_difference_test(a, b, 252.0, n_boot=499), sharpe_difference_test(a.cuda(), b.cuda(), 252.0, n_boot=499)
    assert gpu.difference == pytest.approx(cpu.difference, rel=1e-9) and gpu.p_value == pytest.approx(cpu.p_value, rel=1e-6)
    assert gpu.p_value_bootstrap == pytest.approx(cpu.p_value_bootstrap, abs=0.05)
