"""Paired champion/challenger return streams with a known edge: the yardstick of the promotion rule's false-promotion
rate and power (``promotion_rate``; tests/test_promotion.py, scripts/bench_promotion.py).

Every strategy's per-bar return is ``μ_i + β_i f_t + u_i,t``: a common market factor f with GARCH(1,1) volatility and
Student-t innovations, plus the strategy's own AR(1) noise scaled by the same volatility (so the paired difference is
serially correlated, heteroskedastic and fat-tailed). Challengers differ from the champion in exposure β and noise;
their mean return exceeds the champion's by exactly ``edge`` times the difference's marginal standard deviation (0:
equal in expectation, the null of the rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from foxhunt.evaluation.promotion import PromotionRule

GARCH = (0.05, 0.10, 0.85)  # (ω, a, b) of the factor's variance: unconditional 1, persistent
DAILY_VOL = 0.01  # the scale of the factor's return per bar


@dataclass(frozen=True)
class PairedStreams:
    """``champion`` [S, n] and ``challengers`` [S, k, n] per-bar returns of S independent streams; the challengers'
    true mean advantage per bar (``mean_edge``, [k])."""

    champion: np.ndarray
    challengers: np.ndarray
    mean_edge: np.ndarray


def _unit_t(rng: np.random.Generator, dof: float, shape: tuple[int, ...]) -> np.ndarray:
    """Student-t draws scaled to unit variance."""
    return rng.standard_t(dof, size=shape) * math.sqrt((dof - 2.0) / dof)


def paired_streams(n_streams: int, n_bars: int, edge: float | list[float] = 0.0, n_challengers: int = 1,
                   phi: float = 0.3, dof: float = 5.0, seed: int = 0) -> PairedStreams:
    """S streams of n bars: the champion (β 1, AR(1) noise φ) and k challengers (β 1.2 and 0.8 alternately, their own
    AR(1) noise); challenger j's mean return is the champion's plus ``edge[j]`` times the marginal standard deviation
    of its difference to the champion (``edge`` one number: the same for every challenger)."""
    if dof <= 2:
        raise ValueError(f"dof must exceed 2 (a finite variance), got {dof}")
    if not -1.0 < phi < 1.0:
        raise ValueError(f"phi must lie in (-1, 1), got {phi}")
    edges = np.broadcast_to(np.asarray(edge, dtype=np.float64), (n_challengers,)).copy()
    rng = np.random.default_rng(seed)
    omega, a, b = GARCH
    k1 = n_challengers + 1
    beta = np.array([1.0] + [1.2 if j % 2 == 0 else 0.8 for j in range(n_challengers)])
    noise_sd = np.array([0.6] + [0.6] * n_challengers)
    z = _unit_t(rng, dof, (n_bars, n_streams))
    eta = _unit_t(rng, dof, (n_bars, n_streams, k1))
    f = np.empty((n_bars, n_streams))
    u = np.empty((n_bars, n_streams, k1))
    var = np.full(n_streams, omega / (1.0 - a - b))
    prev_f = np.zeros(n_streams)
    prev_u = np.zeros((n_streams, k1))
    scale = math.sqrt(1.0 - phi**2)
    for t in range(n_bars):
        var = omega + a * prev_f**2 + b * var
        sigma = np.sqrt(var)
        prev_f = sigma * z[t]
        prev_u = phi * prev_u + scale * sigma[:, None] * noise_sd * eta[t]
        f[t], u[t] = prev_f, prev_u
    returns = (beta * f[..., None] + u) * DAILY_VOL  # [n, S, k+1]; the unconditional factor variance is 1
    diff_sd = DAILY_VOL * np.sqrt((beta[1:] - beta[0]) ** 2 + noise_sd[1:] ** 2 + noise_sd[0] ** 2)
    mean_edge = edges * diff_sd
    returns[..., 1:] += mean_edge
    returns = np.moveaxis(returns, 0, -1)  # [S, k+1, n]
    return PairedStreams(returns[:, 0], returns[:, 1:], mean_edge)


def promotion_rate(rule: PromotionRule, n_streams: int, n_bars: int, edge: float = 0.0, n_challengers: int = 1,
                   seed: int = 0, phi: float = 0.3, dof: float = 5.0) -> float:
    """The share of ``n_streams`` simulated streams (:func:`paired_streams`) in which ``rule`` promotes some
    challenger, checked on all their bars (a verdict depends only on the bars, so this is the share promoted when
    checked at every bar)."""
    s = paired_streams(n_streams, n_bars, edge=edge, n_challengers=n_challengers, phi=phi, dof=dof, seed=seed)
    hits = 0
    for i in range(n_streams):
        verdicts = rule.check(s.champion[i], {f"c{j}": s.challengers[i, j] for j in range(n_challengers)})
        hits += any(v.decision == "promote" for v in verdicts.values())
    return hits / n_streams
