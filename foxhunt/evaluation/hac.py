"""Autocorrelation-robust (HAC) uncertainty of Sharpe ratios: long-run variances, block lengths and Lo's η(q).

The i.i.d. formulas of :mod:`foxhunt.evaluation.significance` assume independent bars; a strategy's P&L rarely has
them (positions held over many bars, volatility clustering). Here the Sharpe's sampling variance is the long-run
variance of its linearised (influence) series, estimated with a kernel over the sample autocovariances (Andrews 1991,
prewhitened as Andrews & Monahan 1992), the bandwidth chosen from the data (Andrews' AR(1) plug-in); the bootstrap's
block length is Politis & White's (2004, corrected by Patton, Politis & White 2009). Every function works over the
last axis of a float64 tensor, leading axes a batch (a Monte Carlo of series at once). docs/STATISTICS.md has the
formulas and their sources.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Kernel = Literal["qs", "bartlett"]
MAX_PREWHITEN_AR = 0.97  # the prewhitening AR(1) coefficient is clipped here: (1 - ρ)^-2 stays below 1,111


def _demeaned(z: Tensor) -> Tensor:
    return z - z.mean(-1, keepdim=True)


def autocovariances(z: Tensor) -> Tensor:
    """[..., n] sample autocovariances γ_0 .. γ_{n-1} of each series (divisor n, demeaned), through one FFT."""
    n = z.shape[-1]
    size = 1 << (2 * n - 1).bit_length()
    f = torch.fft.rfft(_demeaned(z), n=size)
    return torch.fft.irfft(f * f.conj(), n=size)[..., :n] / n


def ar1_coefficient(z: Tensor) -> Tensor:
    """[...] least-squares AR(1) coefficient of each demeaned series (0 where the series is constant)."""
    e = _demeaned(z)
    den = (e[..., :-1] ** 2).sum(-1)
    return torch.where(den > 0, (e[..., 1:] * e[..., :-1]).sum(-1) / den.clamp_min(1e-300), torch.zeros_like(den))


def andrews_bandwidth(z: Tensor, kernel: Kernel = "qs") -> Tensor:
    """[...] Andrews' (1991) data-chosen bandwidth S_T of each series, from its AR(1) fit (his eqs. 6.2, 6.4).

    Bartlett: ``1.1447 (α(1) n)^(1/3)``, ``α(1) = 4ρ² / ((1 - ρ)² (1 + ρ)²)``; quadratic spectral:
    ``1.3221 (α(2) n)^(1/5)``, ``α(2) = 4ρ² / (1 - ρ)⁴`` (one series, so the σ⁴ weights cancel).
    """
    n = z.shape[-1]
    rho = ar1_coefficient(z).clamp(-MAX_PREWHITEN_AR, MAX_PREWHITEN_AR)
    if kernel == "bartlett":
        alpha = 4 * rho**2 / ((1 - rho) ** 2 * (1 + rho) ** 2)
        return 1.1447 * (alpha * n) ** (1.0 / 3.0)
    if kernel == "qs":
        alpha = 4 * rho**2 / (1 - rho) ** 4
        return 1.3221 * (alpha * n) ** 0.2
    raise ValueError(f"kernel must be 'qs' or 'bartlett', got {kernel!r}")


def kernel_weights(n_lags: int, bandwidth: Tensor, kernel: Kernel = "qs") -> Tensor:
    """[..., n_lags] weights k(j / S_T) of lags j = 0 .. n_lags - 1: Bartlett ``max(0, 1 - x)``; quadratic
    spectral ``25 / (12 π² x²) (sin(6πx/5) / (6πx/5) - cos(6πx/5))`` (1 at x = 0). A bandwidth of 0 keeps lag 0 only."""
    j = torch.arange(n_lags, dtype=torch.float64, device=bandwidth.device)
    s = bandwidth.to(torch.float64).unsqueeze(-1)
    x = j / s.clamp_min(1e-300)
    if kernel == "bartlett":
        w = (1.0 - x).clamp_min(0.0)
    elif kernel == "qs":
        a = 6.0 * math.pi * x / 5.0
        a_safe = torch.where(a > 0, a, torch.ones_like(a))
        w = 25.0 / (12.0 * math.pi**2 * x.clamp_min(1e-300) ** 2) * (torch.sin(a_safe) / a_safe - torch.cos(a_safe))
        series = 1.0 - a**2 / 10.0 + a**4 / 280.0  # its Taylor series where the difference above cancels
        w = torch.where(a > 0.05, w, series)
    else:
        raise ValueError(f"kernel must be 'qs' or 'bartlett', got {kernel!r}")
    return torch.where((j == 0) | (s > 0), w, torch.zeros_like(w))


def long_run_variance(
    z: Tensor, kernel: Kernel = "qs", bandwidth: float | Tensor | None = None, prewhiten: bool = True
) -> Tensor:
    """[...] HAC long-run variance ``Σ_j k(j/S) γ_j`` (j from -(n-1) to n-1) of each series: n times the variance
    of its mean under autocorrelation and heteroskedasticity.

    ``prewhiten`` (Andrews & Monahan 1992): the kernel estimate is taken of the AR(1) residuals
    ``e_t = z_t - ρ z_{t-1}`` and recoloured, ``LRV(e) / (1 - ρ)²`` (ρ clipped to ±0.97). ``bandwidth`` None:
    Andrews' plug-in on the (prewhitened) series; 0: lag 0 only, the i.i.d. variance (divisor n).
    """
    z = torch.as_tensor(z, dtype=torch.float64)
    rho = torch.zeros(z.shape[:-1], dtype=torch.float64, device=z.device)
    if prewhiten:
        rho = ar1_coefficient(z).clamp(-MAX_PREWHITEN_AR, MAX_PREWHITEN_AR)
        e = _demeaned(z)
        z = e[..., 1:] - rho.unsqueeze(-1) * e[..., :-1]
    gamma = autocovariances(z)
    s = andrews_bandwidth(z, kernel) if bandwidth is None else torch.as_tensor(bandwidth, dtype=torch.float64,
                                                                                 device=z.device).expand(rho.shape)
    w = kernel_weights(z.shape[-1], s, kernel)
    lrv = gamma[..., 0] + 2.0 * (w[..., 1:] * gamma[..., 1:]).sum(-1)
    return lrv.clamp_min(0.0) / (1.0 - rho) ** 2


def sharpe_influence(x: Tensor) -> Tensor:
    """[..., n] the per-bar Sharpe's linearised contributions ``(x_t - μ)/σ - SR ((x_t - μ)² - σ²) / (2σ²)``.

    The delta method on the moments (μ, σ²) (Lo 2002's GMM form; Ledoit & Wolf 2008 use (μ, E x²), with the same
    influence series): SR - SR_true ≈ mean of these, so the Sharpe's variance is their long-run variance over n.
    Their plain variance is Mertens' ``1 - γ3 SR + (γ4 - 1)/4 SR²`` (with the divisor-n σ of this form).
    """
    mu = x.mean(-1, keepdim=True)
    dev = x - mu
    var = (dev**2).mean(-1, keepdim=True)
    sigma = var.sqrt()
    sr = mu / sigma
    return dev / sigma - sr * (dev**2 - var) / (2.0 * var)


def hac_sharpe_variance(x: Tensor, kernel: Kernel = "qs", bandwidth: float | None = None,
                        prewhiten: bool = True) -> Tensor:
    """[...] n times the asymptotic variance of the per-bar Sharpe of each series: the HAC long-run variance of
    :func:`sharpe_influence` (its i.i.d. limit, ``bandwidth=0`` without prewhitening, is Mertens' factor)."""
    return long_run_variance(sharpe_influence(x), kernel, bandwidth, prewhiten)


def lo_eta(q: float, autocorrelations: Tensor) -> Tensor:
    """[...] Lo's (2002, eq. 19) ``η(q) = q / sqrt(q + 2 Σ_{k=1}^{q-1} (q - k) ρ_k)``: the annual Sharpe of q bars a year
    is ``η(q) SR``, ``sqrt(q)`` only for uncorrelated bars. ``autocorrelations`` [..., L]: ρ_1, ρ_2, ... (lags beyond L
    count as 0); a real q sums the lags k < q."""
    if not q > 0:
        raise ValueError(f"q must be positive, got {q}")
    rho = torch.as_tensor(autocorrelations, dtype=torch.float64)
    k = torch.arange(1, rho.shape[-1] + 1, dtype=torch.float64, device=rho.device)
    weight = (q - k).clamp_min(0.0)
    return q / torch.sqrt((q + 2.0 * (weight * rho).sum(-1)).clamp_min(1e-300))


def autocorrelation_adjusted_eta(x: Tensor, q: float, kernel: Kernel = "qs") -> Tensor:
    """[...] Lo's η(q) of each series with its sample autocorrelations ρ̂_k tapered by the kernel at Andrews'
    bandwidth (``k(k/S) ρ̂_k``): Lo's estimator with raw ρ̂_k sums up to q - 1 noisy lags (q = bars a year is often
    more than the series has); the taper keeps it consistent and, for q much longer than the dependence, makes
    ``η(q)² / q`` the ratio of the variance to the long-run variance, as in the HAC standard error."""
    gamma = autocovariances(x)
    n_lags = min(gamma.shape[-1], max(1, math.ceil(q)))
    w = kernel_weights(n_lags, andrews_bandwidth(x, kernel), kernel)
    g0 = gamma[..., :1]
    rho = torch.where(g0 > 0, gamma[..., 1:n_lags] / g0.clamp_min(1e-300), torch.zeros_like(gamma[..., 1:n_lags]))
    return lo_eta(q, w[..., 1:] * rho)


def politis_white_block_length(x: Tensor, circular: bool = False) -> float:
    """Politis & White's (2004) optimal block length of a 1-D series, with Patton, Politis & White's (2009) correction:
    ``b = (2 G² / D)^(1/3) n^(1/3)``, ``G = Σ_{|k|≤M} λ(k/M) |k| R(k)``, ``D = 2 ĝ(0)²`` for the stationary bootstrap
    (mean block) and ``(4/3) ĝ(0)²`` for the circular one, ``ĝ(0) = Σ_{|k|≤M} λ(k/M) R(k)``, λ the flat-top
    trapezoid (1 to 1/2, then 2(1 - t)); ``M = 2 m̂``, m̂ the smallest lag after which K_n = max(5, sqrt(log10 n))
    sample autocorrelations all lie within ``2 sqrt(log10 n / n)`` (at most ``ceil(sqrt n) + K_n``); capped at
    ``min(3 sqrt n, n / 3)``, at least 1. ``n ** (1/3)`` for series under 9 bars or with no spread."""
    x = torch.as_tensor(x, dtype=torch.float64).flatten()
    n = x.numel()
    if n < 9:
        return max(1.0, n ** (1.0 / 3.0))
    gamma = autocovariances(x)
    if not float(gamma[0]) > 0:
        return max(1.0, n ** (1.0 / 3.0))
    k_n = max(5, int(math.sqrt(math.log10(n))))
    m_max = min(n - 1, math.ceil(math.sqrt(n)) + k_n)
    rho = (gamma[1 : m_max + k_n + 1] / gamma[0]).abs()
    small = rho < 2.0 * math.sqrt(math.log10(n) / n)
    m_hat = m_max
    for m in range(0, m_max + 1):  # the first m whose next K_n autocorrelations are all insignificant
        if bool(small[m : m + k_n].all()) and small[m : m + k_n].numel() == k_n:
            m_hat = m
            break
    big_m = min(2 * max(m_hat, 1), m_max)
    k = torch.arange(1, big_m + 1, dtype=torch.float64, device=gamma.device)
    t = k / big_m
    lam = torch.where(t <= 0.5, torch.ones_like(t), 2.0 * (1.0 - t))
    g = 2.0 * float((lam * k * gamma[1 : big_m + 1]).sum())
    g0 = float(gamma[0] + 2.0 * (lam * gamma[1 : big_m + 1]).sum())
    d = (4.0 / 3.0 if circular else 2.0) * g0**2
    b = (2.0 * g**2 / d) ** (1.0 / 3.0) * n ** (1.0 / 3.0) if d > 0 else 1.0
    return float(min(max(b, 1.0), math.ceil(min(3.0 * math.sqrt(n), n / 3.0))))
