"""Is one strategy's Sharpe ratio higher than another's on the same bars: Ledoit & Wolf's (2008) paired test.

Both Sharpes are estimated, from P&L series that are correlated (the same market) and autocorrelated. The test of
``H0: SR_a = SR_b`` studentises the difference with its HAC standard error (the delta method on the four moments of
the pair, :mod:`foxhunt.evaluation.hac`) and reads its p-value either from the normal distribution or from a
studentised circular block bootstrap that resamples both series on the same time paths (Ledoit & Wolf 2008,
section 3.2). One implementation, for the back-test's "vs buy-and-hold" columns and for any champion/challenger
comparison. docs/STATISTICS.md has the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from foxhunt.evaluation.block_bootstrap import studentised_block_bootstrap
from foxhunt.evaluation.hac import Kernel, long_run_variance, sharpe_influence
from foxhunt.evaluation.significance import SHARPE_RTOL, normal_cdf


@dataclass(frozen=True)
class SharpeDifference:
    """The paired test of two Sharpe ratios on the same bars (annualised figures; NaN where undefined)."""

    difference: float  # Sharpe_a - Sharpe_b, annualised
    se: float  # HAC standard error of the difference, annualised (delta method)
    p_value: float  # two-sided, HAC delta method against the normal
    p_value_bootstrap: float  # two-sided, studentised circular block bootstrap
    ci_low: float  # the bootstrap's symmetric studentised interval of the difference at ``level``
    ci_high: float
    block: int  # the circular bootstrap's block length (bars)
    n_bars: int


def _pair(pnl_a: Tensor | Sequence[float], pnl_b: Tensor | Sequence[float]) -> tuple[Tensor, Tensor]:
    a = torch.as_tensor(pnl_a, dtype=torch.float64)
    b = torch.as_tensor(pnl_b, dtype=torch.float64).to(a.device)
    if a.shape != b.shape or a.dim() < 1:
        raise ValueError(f"the two P&L series must have the same bars, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return a, b


def _has_spread(x: Tensor) -> bool:
    return float(x.std()) > SHARPE_RTOL * float(x.abs().max())


def _sharpe(x: Tensor) -> Tensor:
    """Per-bar Sharpe over the last axis (sample std), NaN where the spread is rounding."""
    std = x.std(-1)
    tol = SHARPE_RTOL * x.abs().amax(-1)
    return torch.where(std > tol, x.mean(-1) / std.clamp_min(1e-300), torch.full_like(std, math.nan))


def sharpe_difference_z(
    pnl_a: Tensor, pnl_b: Tensor, kernel: Kernel = "qs", prewhiten: bool = True, bandwidth: float | None = None
) -> tuple[Tensor, Tensor]:
    """([...], [...]): the per-bar ``SR_a - SR_b`` of each pair of series (last axis: bars) and its HAC standard
    error, ``sqrt(LRV(ψ_a - ψ_b) / n)`` with ψ the Sharpe's influence series (:func:`~foxhunt.evaluation.hac.
    sharpe_influence`): Ledoit & Wolf's ``sqrt(∇f' Ψ ∇f / T)``, the bandwidth (default Andrews') chosen on the
    linearised difference."""
    a, b = _pair(pnl_a, pnl_b)
    diff = _sharpe(a) - _sharpe(b)
    d = sharpe_influence(a) - sharpe_influence(b)
    return diff, (long_run_variance(d, kernel, bandwidth, prewhiten) / a.shape[-1]).sqrt()


def sharpe_difference_test(
    pnl_a: Tensor | Sequence[float],
    pnl_b: Tensor | Sequence[float],
    bars_per_year: float,
    n_boot: int = 999,
    block: int | None = None,
    level: float = 0.95,
    seed: int = 0,
) -> SharpeDifference:
    """Ledoit & Wolf's (2008) test of ``SR_a = SR_b`` for two P&L series on the same bars (1-D, aligned).

    HAC: ``z = Δ / se``, ``p = 2 (1 - Φ(|z|))``. Bootstrap (their section 3.2.2): ``n_boot`` circular block resamples
    of the pair on shared index paths, each studentised by its own block-sum variance ``s* = sqrt(Σ_j (Σ_{t∈j}
    ψ*_t)² / (l b) / T')`` (l blocks of ``block`` bars, T' = l·b, ψ* the resample's own influence series);
    ``p = (1 + #{|Δ* - Δ| / s* ≥ |Δ| / se}) / (M + 1)`` over the M resamples with a Sharpe, and the interval
    ``Δ ± q_level(|Δ* - Δ| / s*) · se``. ``block`` defaults to Politis & White's circular block length of the
    linearised difference. NaN where either series has no Sharpe or the two are identical (se 0).
    """
    if not (bars_per_year > 0 and math.isfinite(bars_per_year)):
        raise ValueError(f"bars_per_year must be a positive number, got {bars_per_year}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    a, b = _pair(pnl_a, pnl_b)
    if a.dim() != 1:
        raise ValueError(f"pnl_a and pnl_b must be 1-D series of per-bar returns, got shape {tuple(a.shape)}")
    n = a.numel()
    nan = SharpeDifference(math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, 0, n)
    if n < 9 or not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
        return nan
    if not (_has_spread(a) and _has_spread(b)) or torch.equal(a, b):  # no Sharpe, or nothing to compare
        return nan
    diff, se, boot, block = studentised_block_bootstrap(torch.stack([a, b]), (1.0, -1.0), n_boot, seed, SHARPE_RTOL,
                                                        block)
    scale = math.sqrt(bars_per_year)
    if math.isnan(diff) or not se > 0:
        return nan
    boot = boot.abs()
    if boot.numel() == 0:
        return SharpeDifference(diff * scale, se * scale, 2.0 * normal_cdf(-abs(diff) / se), math.nan, math.nan,
                                math.nan, block, n)
    observed = abs(diff) / se
    p_boot = (1.0 + float((boot >= observed).sum())) / (boot.numel() + 1.0)
    q = float(torch.quantile(boot, level))
    return SharpeDifference(
        difference=diff * scale,
        se=se * scale,
        p_value=2.0 * normal_cdf(-abs(diff) / se),
        p_value_bootstrap=p_boot,
        ci_low=(diff - q * se) * scale,
        ci_high=(diff + q * se) * scale,
        block=block,
        n_bars=n,
    )
