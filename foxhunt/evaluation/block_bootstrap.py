"""Ledoit & Wolf's (2008) studentised circular block bootstrap of a contrast of Sharpe ratios, ``Σ_i c_i SR_i``.

One engine for one Sharpe (``c = (1,)``: the back-test's interval) and for a difference of two on the same bars
(``c = (1, -1)``: :mod:`foxhunt.evaluation.sharpe_difference`). All series are resampled on shared circular block
paths; each resample is studentised by its own block-sum variance, so the bootstrap distribution of the t-statistic
keeps the series' dependence within blocks (Ledoit & Wolf 2008, section 3.2.2; docs/STATISTICS.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from foxhunt.evaluation.hac import long_run_variance, politis_white_block_length, sharpe_influence

_MAX_BOOTSTRAP_ELEMENTS = 1 << 22  # bars resampled per chunk of replicates (all series)


def contrast_sharpe(x: Tensor, weights: Sequence[float], tol: float) -> Tensor:
    """[...] ``Σ_i c_i SR_i`` of series ``x`` [k, ..., n] (per-bar Sharpe, sample std); NaN where a series with a
    non-zero weight has no spread beyond ``tol`` times its largest |value|."""
    out = torch.zeros(x.shape[1:-1], dtype=torch.float64, device=x.device)
    for series, c in zip(x, weights, strict=True):
        std = series.std(-1)
        ok = std > tol * series.abs().amax(-1)
        out = out + c * torch.where(ok, series.mean(-1) / std.clamp_min(1e-300), torch.full_like(std, math.nan))
    return out


def contrast_influence(x: Tensor, weights: Sequence[float]) -> Tensor:
    """[..., n] the contrast's influence series ``Σ_i c_i ψ_i`` (:func:`~foxhunt.evaluation.hac.sharpe_influence`)."""
    return sum(c * sharpe_influence(series) for series, c in zip(x, weights, strict=True))


def circular_block_paths(n: int, block: int, n_boot: int, generator: torch.Generator) -> Tensor:
    """[n_boot, l·block] circular block bootstrap paths, l = n // block blocks of uniform start, wrapping."""
    n_blocks = n // block
    starts = torch.randint(0, n, (n_boot, n_blocks, 1), generator=generator, device=generator.device)
    return ((starts + torch.arange(block, device=starts.device)) % n).reshape(n_boot, n_blocks * block)


def studentised_block_bootstrap(
    x: Tensor, weights: Sequence[float], n_boot: int, seed: int, tol: float, block: int | None = None
) -> tuple[float, float, Tensor, int]:
    """(contrast, its HAC SE, [M] bootstrap t-statistics ``(θ* - θ) / s*`` of the resamples with a value, block).

    ``x`` [k, n]: the series, resampled on the same paths. ``s* = sqrt((1/l) Σ_j (b^(-1/2) Σ_{t∈j} ψ*_t)² / T')`` (l
    blocks of b bars, T' = l·b, ψ* the resample's own influence series). ``block`` defaults to Politis & White's
    circular length of the contrast's influence series (at most n/2). Per-bar scale.
    """
    n = x.shape[-1]
    theta = float(contrast_sharpe(x, weights, tol))
    psi = contrast_influence(x, weights)
    se = math.sqrt(float(long_run_variance(psi)) / n)
    if block is None:
        block = max(1, min(n // 2, round(politis_white_block_length(psi, circular=True))))
    if not 1 <= block <= n:
        raise ValueError(f"block must be between 1 and the {n} bars, got {block}")
    generator = torch.Generator(device=x.device).manual_seed(seed)
    chunk = max(1, _MAX_BOOTSTRAP_ELEMENTS // (x.shape[0] * n))
    stats = []
    for first in range(0, n_boot, chunk):
        idx = circular_block_paths(n, block, min(chunk, n_boot - first), generator)
        sample = x[:, idx]  # [k, M, T']
        sums = contrast_influence(sample, weights).reshape(idx.shape[0], -1, block).sum(-1)  # [M, l] block sums
        s = ((sums**2).mean(-1) / block / idx.shape[1]).sqrt()
        stats.append((contrast_sharpe(sample, weights, tol) - theta) / s)
    boot = torch.cat(stats)
    return theta, se, boot[torch.isfinite(boot)], block
