"""How much a back-test's Sharpe ratio can be trusted: standard errors, PSR, DSR and a block-bootstrap interval.

Every function takes a strategy's per-bar P&L (``pnl``: a 1-D series of per-bar log returns after costs, as
:func:`foxhunt.evaluation.trading.strategy_log_returns` makes them; the bars that count, masked bars already
dropped) and works in float64. Conventions, shared by all of them (docs/STATISTICS.md has the formulas and the
references):

- ``SR`` is the per-bar Sharpe ratio ``mean / std`` with the sample standard deviation (divisor n - 1), the same
  estimate :func:`~foxhunt.evaluation.trading.trading_metrics` annualises; the annualised Sharpe is
  ``SR * sqrt(bars_per_year)``.
- ``skew`` (γ3) and ``kurtosis`` (γ4, not excess: 3 for a normal) are the moment estimators ``m3 / m2**1.5`` and
  ``m4 / m2**2`` with central moments ``m_k = mean((x - mean(x))**k)`` (divisor n, as in Bailey & Lopez de Prado
  and ``scipy.stats.skew`` / ``kurtosis(fisher=False)``).
- A series with fewer than 3 bars, a non-finite value or zero variance has no Sharpe: every result is NaN, never an
  exception; except that a flat book (every bar 0, or none) has the Sharpe 0 that ``trading_metrics`` reports too
  (it earned nothing at no risk), with no standard error, interval or PSR. Invalid arguments (a non-positive ``bars_per_year``, a ``level`` outside (0, 1), ...) raise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import torch
from torch import Tensor

from foxhunt.evaluation.block_bootstrap import studentised_block_bootstrap
from foxhunt.evaluation.hac import (
    Kernel,
    autocorrelation_adjusted_eta,
    hac_sharpe_variance,
    politis_white_block_length,
    sharpe_influence,
)

EULER_MASCHERONI = 0.5772156649015329
MIN_BARS = 3
SHARPE_RTOL = 1e-12  # a spread at most this times the largest |P&L| is rounding: the series is constant, no Sharpe
_MAX_BOOTSTRAP_ELEMENTS = 1 << 22  # bars resampled per chunk of replicates (~200 MiB of temporaries at most)


@dataclass(frozen=True)
class SharpeMoments:
    """The per-bar Sharpe of a series and the moments its sampling distribution depends on (NaN when undefined)."""

    sr_per_bar: float
    n_bars: int
    skew: float  # γ3
    kurtosis: float  # γ4, not excess (3 for a normal)


def _series(pnl: Tensor | Sequence[float]) -> Tensor:
    x = torch.as_tensor(pnl, dtype=torch.float64)
    if x.dim() != 1:
        raise ValueError(f"pnl must be a 1-D series of per-bar returns, got shape {tuple(x.shape)}")
    return x


def _check_bars_per_year(bars_per_year: float) -> None:
    if not (bars_per_year > 0 and math.isfinite(bars_per_year)):
        raise ValueError(f"bars_per_year must be a positive number, got {bars_per_year}")


def _has_sharpe(x: Tensor) -> bool:
    """At least 3 finite bars whose spread is more than the rounding of their mean (a constant series has none)."""
    if x.numel() < MIN_BARS or not bool(torch.isfinite(x).all()):
        return False
    return float(x.std()) > SHARPE_RTOL * float(x.abs().max())


def sharpe_moments(pnl: Tensor | Sequence[float]) -> SharpeMoments:
    """Per-bar Sharpe (sample std, n - 1), skewness and kurtosis (divisor-n moments) of a P&L series."""
    x = _series(pnl)
    n = x.numel()
    if not _has_sharpe(x):
        return SharpeMoments(math.nan, n, math.nan, math.nan)
    dev = x - x.mean()
    m2, m3, m4 = (dev**2).mean(), (dev**3).mean(), (dev**4).mean()
    return SharpeMoments(
        sr_per_bar=float(x.mean() / x.std()),
        n_bars=n,
        skew=float(m3 / m2**1.5),
        kurtosis=float(m4 / m2**2),
    )


def _mertens_variance_factor(sr: float, skew: float, kurt: float) -> float:
    """``1 - γ3 SR + (γ4 - 1)/4 SR²``: n times the asymptotic variance of the per-bar SR (NaN if not positive).

    Non-negative for any sample moments (their kurtosis is at least 1 + skew²); zero only for a two-point series.
    """
    v = 1.0 - skew * sr + (kurt - 1.0) / 4.0 * sr * sr
    return v if v > 0 else math.nan


def normal_cdf(x: float) -> float:
    """Φ(x), accurate in both tails (through erfc)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def sharpe_standard_error(pnl: Tensor | Sequence[float], bars_per_year: float, method: str = "mertens") -> float:
    """Standard error of the annualised Sharpe: the per-bar SR's asymptotic SE times ``sqrt(bars_per_year)``.

    ``method="lo"``: Lo (2002), i.i.d. normal returns, ``sqrt((1 + SR²/2) / n)``. ``method="mertens"``: Mertens
    (2002), i.i.d. returns of any skewness γ3 and kurtosis γ4, ``sqrt((1 - γ3 SR + (γ4 - 1)/4 SR²) / n)`` (equal to
    Lo's when γ3 = 0 and γ4 = 3). Neither accounts for autocorrelation: see :func:`hac_sharpe_standard_error`.
    """
    _check_bars_per_year(bars_per_year)
    if method not in ("lo", "mertens"):
        raise ValueError(f"method must be 'lo' or 'mertens', got {method!r}")
    m = sharpe_moments(pnl)
    if math.isnan(m.sr_per_bar):
        return math.nan
    if method == "lo":
        factor = 1.0 + m.sr_per_bar**2 / 2.0
    else:
        factor = _mertens_variance_factor(m.sr_per_bar, m.skew, m.kurtosis)
    return math.sqrt(factor / m.n_bars) * math.sqrt(bars_per_year)


def psr_from_moments(sr_per_bar: float, n_bars: int, skew: float, kurt: float, benchmark_sr_per_bar: float) -> float:
    """Bailey & Lopez de Prado (2012) PSR from the moments: ``Φ((SR - SR*) sqrt(n - 1) / sqrt(1 - γ3 SR + (γ4-1)/4 SR²))``.

    The probability that the true per-bar Sharpe exceeds ``benchmark_sr_per_bar`` (SR*, treated as known), given the
    observed ``sr_per_bar`` of ``n_bars`` bars of skewness ``skew`` and (non-excess) kurtosis ``kurt``. NaN when any
    input is NaN or ``n_bars < 3``.
    """
    if n_bars < MIN_BARS or any(math.isnan(v) for v in (sr_per_bar, skew, kurt, benchmark_sr_per_bar)):
        return math.nan
    factor = _mertens_variance_factor(sr_per_bar, skew, kurt)
    if math.isnan(factor):
        return math.nan
    return normal_cdf((sr_per_bar - benchmark_sr_per_bar) * math.sqrt(n_bars - 1) / math.sqrt(factor))


def probabilistic_sharpe_ratio(pnl: Tensor | Sequence[float], benchmark_sr_per_bar: float = 0.0) -> float:
    """PSR of a P&L series against a per-bar benchmark Sharpe SR* (see :func:`psr_from_moments`), in [0, 1]."""
    m = sharpe_moments(pnl)
    return psr_from_moments(m.sr_per_bar, m.n_bars, m.skew, m.kurtosis, benchmark_sr_per_bar)


def psr_vs_flat(pnl: Tensor | Sequence[float]) -> float:
    """PSR against a flat book (SR* = 0): the probability that the strategy's true Sharpe is positive."""
    return probabilistic_sharpe_ratio(pnl, 0.0)


def psr_vs_benchmark(pnl: Tensor | Sequence[float], benchmark_pnl: Tensor | Sequence[float]) -> float:
    """PSR against the observed per-bar Sharpe of ``benchmark_pnl`` (e.g. buy-and-hold on the same bars).

    The benchmark's Sharpe enters as a known constant: its own estimation error is not counted, so this answers "does
    the strategy beat a Sharpe of that size", not "is the difference of the two Sharpes significant". NaN when the
    benchmark has no Sharpe (e.g. zero variance).
    """
    return probabilistic_sharpe_ratio(pnl, sharpe_moments(benchmark_pnl).sr_per_bar)


def hac_sharpe_standard_error(pnl: Tensor | Sequence[float], bars_per_year: float, kernel: Kernel = "qs") -> float:
    """Autocorrelation-robust SE of the annualised Sharpe: ``sqrt(LRV(ψ) / n) · sqrt(bars_per_year)``.

    ψ is the Sharpe's influence series (Lo 2002's GMM form, :func:`~foxhunt.evaluation.hac.sharpe_influence`), LRV
    its prewhitened kernel long-run variance at Andrews' (1991) data-chosen bandwidth; on independent bars it tends
    to Mertens' SE, on autocorrelated or volatility-clustered P&L it widens as the Sharpe's spread does.
    """
    _check_bars_per_year(bars_per_year)
    x = _series(pnl)
    if not _has_sharpe(x):
        return math.nan
    return math.sqrt(float(hac_sharpe_variance(x, kernel)) / x.numel() * bars_per_year)


def hac_psr(pnl: Tensor | Sequence[float], benchmark_sr_per_bar: float = 0.0, kernel: Kernel = "qs") -> float:
    """PSR with the HAC standard error: ``Φ((SR - SR*) / sqrt(LRV(ψ) / n))``, the probability that the true per-bar
    Sharpe exceeds ``benchmark_sr_per_bar`` when bars are dependent (Bailey & Lopez de Prado's PSR is its i.i.d. form)."""
    x = _series(pnl)
    if not _has_sharpe(x) or math.isnan(benchmark_sr_per_bar):
        return math.nan
    variance = float(hac_sharpe_variance(x, kernel))
    if not variance > 0:
        return math.nan
    sr = float(x.mean() / x.std())
    return normal_cdf((sr - benchmark_sr_per_bar) / math.sqrt(variance / x.numel()))


def autocorrelation_adjusted_sharpe(pnl: Tensor | Sequence[float], bars_per_year: float) -> float:
    """Lo's (2002) annual Sharpe of a serially correlated P&L, ``η(q) · SR`` with q = ``bars_per_year``, where the
    plain annualisation is ``sqrt(q) · SR`` (:func:`~foxhunt.evaluation.hac.autocorrelation_adjusted_eta`)."""
    _check_bars_per_year(bars_per_year)
    x = _series(pnl)
    if not _has_sharpe(x):
        return math.nan
    return float(x.mean() / x.std()) * float(autocorrelation_adjusted_eta(x, bars_per_year))


def sharpe_block_length(pnl: Tensor | Sequence[float]) -> float:
    """The stationary bootstrap's mean block for a Sharpe: Politis & White's (2004) length of its influence series
    (the P&L and its squares: autocorrelation and volatility clustering); ``n ** (1/3)`` where there is no Sharpe."""
    x = _series(pnl)
    if not _has_sharpe(x):
        return max(1.0, x.numel() ** (1.0 / 3.0))
    return politis_white_block_length(sharpe_influence(x))


def expected_max_sharpe(trial_srs_per_bar: Tensor | Sequence[float], n_trials: int | None = None) -> float:
    """SR0 of Bailey & Lopez de Prado (2014): the expected maximum of N trial Sharpes whose true Sharpe is zero.

    ``sqrt(V) ((1 - γ) Φ⁻¹(1 - 1/N) + γ Φ⁻¹(1 - 1/(N e)))`` with V the sample variance (divisor K - 1) of the K trials
    with a finite per-bar Sharpe and γ the Euler-Mascheroni constant. N is ``n_trials``, the number of trials the
    selection ran over, which may exceed K when some trials were tried but have no Sharpe (pruned or failed before
    their Sharpe was measured); by default N = K. 0 for a single trial (no selection), for trials of equal Sharpe
    (zero variance) and when fewer than two trials have a Sharpe (no spread to estimate); NaN when none has one.
    """
    srs = torch.as_tensor(trial_srs_per_bar, dtype=torch.float64).flatten()
    srs = srs[torch.isfinite(srs)]
    k = srs.numel()
    n = k if n_trials is None else int(n_trials)
    if n < k:
        raise ValueError(f"n_trials={n_trials} is below the {k} trials with a finite Sharpe")
    if k == 0:
        return math.nan
    if n == 1 or k == 1:
        return 0.0
    std = float(srs.std())
    if std <= SHARPE_RTOL * float(srs.abs().max()):  # equal Sharpes, up to rounding
        return 0.0
    inv = NormalDist().inv_cdf
    g = EULER_MASCHERONI
    return std * ((1.0 - g) * inv(1.0 - 1.0 / n) + g * inv(1.0 - 1.0 / (n * math.e)))


def deflated_sharpe_ratio(
    sr_per_bar: float,
    n_bars: int,
    skew: float,
    kurt: float,
    trial_srs_per_bar: Tensor | Sequence[float],
    n_trials: int | None = None,
) -> float:
    """Bailey & Lopez de Prado (2014) DSR: the PSR of the selected strategy against SR0 = :func:`expected_max_sharpe`.

    ``sr_per_bar``, ``n_bars``, ``skew`` and ``kurt`` describe the selected trial's P&L (:func:`sharpe_moments`);
    ``trial_srs_per_bar`` holds the per-bar Sharpe of every trial that has one, the selected one included, on the same
    bars' frequency; ``n_trials`` the number of trials the selection ran over (default: those with a finite Sharpe),
    pruned ones included. With one trial the DSR is the PSR against flat; it falls as more trials of the same spread
    are tried.
    """
    sr0 = expected_max_sharpe(trial_srs_per_bar, n_trials)
    return psr_from_moments(sr_per_bar, n_bars, skew, kurt, sr0)


def stationary_bootstrap_indices(n: int, n_boot: int, mean_block: float, generator: torch.Generator) -> Tensor:
    """[n_boot, n] index paths of Politis & Romano's (1994) stationary bootstrap, wrapping around the series.

    Each path starts at a uniform bar; at every later bar it restarts at a fresh uniform bar with probability
    ``1 / mean_block`` and otherwise moves to the next bar (``n - 1`` is followed by 0), so blocks have geometric
    lengths of mean ``mean_block``. Built at once: the start of each bar's block is carried forward by a running
    maximum of the restart positions. ``mean_block = 1`` is the i.i.d. bootstrap.
    """
    device = generator.device
    restart = torch.rand(n_boot, n, generator=generator, device=device, dtype=torch.float64) < 1.0 / mean_block
    restart[:, 0] = True
    starts = torch.randint(0, n, (n_boot, n), generator=generator, device=device)
    bar = torch.arange(n, device=device).expand(n_boot, n)
    block_start = torch.where(restart, bar, torch.zeros_like(bar)).cummax(dim=1).values  # bar where each block began
    return (starts.gather(1, block_start) + bar - block_start) % n


def _check_interval(bars_per_year: float, level: float, n_boot: int) -> None:
    """The arguments every bootstrap interval of the Sharpe takes, refused in one line when they cannot work."""
    _check_bars_per_year(bars_per_year)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")


def stationary_bootstrap_sharpe_ci(
    pnl: Tensor | Sequence[float],
    bars_per_year: float,
    level: float = 0.95,
    n_boot: int = 1000,
    mean_block: float | None = None,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval ``(low, high)`` of the annualised Sharpe under the stationary block bootstrap.

    ``mean_block`` (bars; default :func:`sharpe_block_length`, Politis & White's) is the mean block length: blocks keep the series' short-range
    dependence (autocorrelation, volatility clustering) that the i.i.d. formulas ignore. Replicates whose Sharpe is
    undefined (zero variance) are left out of the percentiles. Reproducible for a given ``seed`` and device (the
    series' device draws the random numbers). NaN, NaN when the series has no Sharpe.
    """
    _check_interval(bars_per_year, level, n_boot)
    if mean_block is not None and not mean_block >= 1.0:
        raise ValueError(f"mean_block must be at least 1 bar, got {mean_block}")
    x = _series(pnl)
    if not _has_sharpe(x):
        return math.nan, math.nan
    n = x.numel()
    mean_block = sharpe_block_length(x) if mean_block is None else float(mean_block)
    generator = torch.Generator(device=x.device).manual_seed(seed)
    chunk = max(1, _MAX_BOOTSTRAP_ELEMENTS // n)
    tol = SHARPE_RTOL * float(x.abs().max())
    srs = []
    for first in range(0, n_boot, chunk):
        sample = x[stationary_bootstrap_indices(n, min(chunk, n_boot - first), mean_block, generator)]
        std = sample.std(dim=1)
        srs.append(torch.where(std > tol, sample.mean(dim=1) / std, torch.full_like(std, math.nan)))
    sr = torch.cat(srs) * math.sqrt(bars_per_year)
    if bool(torch.isnan(sr).all()):
        return math.nan, math.nan
    alpha = (1.0 - level) / 2.0
    low, high = torch.nanquantile(sr, torch.tensor([alpha, 1.0 - alpha], dtype=sr.dtype, device=sr.device))
    return float(low), float(high)


def studentised_bootstrap_sharpe_ci(
    pnl: Tensor | Sequence[float],
    bars_per_year: float,
    level: float = 0.95,
    n_boot: int = 999,
    block: int | None = None,
    seed: int = 0,
) -> tuple[float, float]:
    """Interval ``SR ± q_level(|t*|) · SE_HAC`` of the annualised Sharpe, ``t* = (SR* - SR) / s*`` over ``n_boot``
    circular block resamples each studentised by its own block-sum variance (Ledoit & Wolf 2008's bootstrap, one
    series; :mod:`foxhunt.evaluation.block_bootstrap`); ``block`` defaults to Politis & White's. The percentile
    interval of :func:`stationary_bootstrap_sharpe_ci` ignores that the Sharpe's spread varies with the resample and
    undercovers on dependent P&L (0.92 on AR(1) φ = 0.5); this one covers. NaN, NaN without a Sharpe."""
    _check_interval(bars_per_year, level, n_boot)
    x = _series(pnl)
    if not _has_sharpe(x) or x.numel() < 9:
        return math.nan, math.nan
    sr, se, boot, _ = studentised_block_bootstrap(x.unsqueeze(0), (1.0,), n_boot, seed, SHARPE_RTOL, block)
    if boot.numel() == 0 or not se > 0:
        return math.nan, math.nan
    q = float(torch.quantile(boot.abs(), level))
    scale = math.sqrt(bars_per_year)
    return (sr - q * se) * scale, (sr + q * se) * scale


def sharpe_summary(
    pnl: Tensor | Sequence[float],
    bars_per_year: float,
    level: float = 0.95,
    n_boot: int = 999,
    block: int | None = None,
    seed: int = 0,
    method: str = "mertens",
) -> dict[str, float]:
    """One P&L series' Sharpe with its uncertainty, as the back-test table shows it.

    Keys: ``sharpe`` (annualised, ``sqrt(bars_per_year)``), ``sharpe_lo`` (Lo's autocorrelation-adjusted annual
    Sharpe), ``sharpe_se`` (HAC, annualised), ``sharpe_se_iid`` (``method``, independent bars), ``sharpe_ci_low`` /
    ``sharpe_ci_high`` (:func:`studentised_bootstrap_sharpe_ci` at ``level``, ``block``: Politis & White's by default),
    ``psr_vs_flat`` (HAC), ``psr_vs_flat_iid`` (Bailey & Lopez de Prado's), ``n_bars``, ``skew`` and ``kurtosis``
    (non-excess). NaN where undefined; a flat book's ``sharpe`` is 0, as in ``trading_metrics`` (the rest NaN:
    nothing to test). A comparison with a benchmark is :func:`foxhunt.evaluation.sharpe_difference.
    sharpe_difference_test`.
    """
    se = sharpe_standard_error(pnl, bars_per_year, method)
    m = sharpe_moments(pnl)
    low, high = studentised_bootstrap_sharpe_ci(pnl, bars_per_year, level, n_boot, block, seed)
    flat = not bool(_series(pnl).ne(0).any())  # no bar with P&L: Sharpe 0, the table's and trading_metrics' figure
    return {
        "sharpe": 0.0 if flat else m.sr_per_bar * math.sqrt(bars_per_year),
        "sharpe_lo": autocorrelation_adjusted_sharpe(pnl, bars_per_year),
        "sharpe_se": hac_sharpe_standard_error(pnl, bars_per_year),
        "sharpe_se_iid": se,
        "sharpe_ci_low": low,
        "sharpe_ci_high": high,
        "psr_vs_flat": hac_psr(pnl, 0.0),
        "psr_vs_flat_iid": psr_from_moments(m.sr_per_bar, m.n_bars, m.skew, m.kurtosis, 0.0),
        "n_bars": float(m.n_bars),
        "skew": m.skew,
        "kurtosis": m.kurtosis,
    }


def null_max_sharpe(n_candidates: int, n_bars: int) -> float:
    """Per-bar Sharpe the best of ``n_candidates`` policies without edge shows on ``n_bars`` bars, in expectation.

    Bailey & Lopez de Prado's expected maximum (``expected_max_sharpe``) with the null's own sampling variance
    1 / (n_bars - 1) in place of the candidates' spread: a member's candidates are successive checkpoints of one
    learning run, whose spread measures learning, not luck, and independent candidates bound correlated ones from
    above. 0 for a single candidate (or none).
    """
    if n_candidates <= 1 or n_bars < 3:
        return 0.0
    unit = torch.linspace(-1.0, 1.0, n_candidates, dtype=torch.float64)
    unit = unit / unit.std()  # N trials of unit spread: expected_max_sharpe returns E[max of N] in units of the spread
    return expected_max_sharpe(unit) / math.sqrt(n_bars - 1)
