"""Paired evidence between strategies traded on the same bars: Diebold-Mariano, Hansen's SPA, the model confidence set.

The inputs are per-bar after-cost log returns on identical bars (a champion and its challengers, or several exports
on one file). Diebold & Mariano (1995) test the mean of the paired return difference ``d_t = a_t - b_t`` with its
Newey-West long-run variance (:mod:`foxhunt.evaluation.hac`, Bartlett kernel) and Harvey, Leybourne & Newbold's
(1997) small-sample correction read against Student's t. With several challengers, Hansen's (2005) test of superior
predictive ability and Hansen, Lunde & Nason's (2011) model confidence set account for the multiple comparison; both
are :mod:`arch.bootstrap`'s, fed losses ``-returns``. The Sharpe-ratio difference is
:mod:`foxhunt.evaluation.sharpe_difference`'s. docs/STATISTICS.md has the formulas.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from scipy import stats

from foxhunt.evaluation.hac import long_run_variance, politis_white_block_length
from foxhunt.evaluation.sharpe_difference import sharpe_difference_test
from foxhunt.evaluation.significance import SHARPE_RTOL
from foxhunt.evaluation.trading import pnl_figures

Alternative = Literal["two-sided", "greater", "less"]
ALTERNATIVES = ("two-sided", "greater", "less")
Variance = Literal["newey-west", "andrews-monahan"]
VARIANCES = ("newey-west", "andrews-monahan")


def newey_west_lags(n: int) -> int:
    """Newey & West's (1994) rule-of-thumb truncation lag ``floor(4 (n / 100)^(2/9))`` (at most n - 1)."""
    return max(0, min(n - 1, math.floor(4.0 * (n / 100.0) ** (2.0 / 9.0))))


def hln_factor(n: int, h: int) -> float:
    """Harvey, Leybourne & Newbold's (1997) correction of the DM statistic: ``sqrt((n + 1 - 2h + h(h-1)/n)/n)``."""
    return math.sqrt(max(0.0, (n + 1 - 2 * h + h * (h - 1) / n) / n))


@dataclass(frozen=True)
class DieboldMariano:
    """The Diebold-Mariano test of ``E[a - b] = 0`` on paired per-bar returns (NaN where the difference is constant)."""

    statistic: float  # HLN-corrected DM statistic, read against t(n - 1)
    p_value: float  # for ``alternative``
    raw_statistic: float  # d̄ / sqrt(LRV_NW(d) / n), the uncorrected DM
    mean_difference: float  # d̄, per bar
    se: float  # sqrt(LRV_NW(d) / n), the standard error of d̄
    lags: int  # Newey-West truncation lag (Bartlett weights 1 - j / (lags + 1)); 0 for "andrews-monahan"
    n_bars: int
    alternative: str
    variance: str = "newey-west"

    def to_dict(self) -> dict[str, float | int | str]:
        """JSON-able fields (NaN kept as float; callers that write strict JSON use foxhunt.files.json_safe)."""
        return {"dm_statistic": self.statistic, "dm_p_value": self.p_value, "dm_raw_statistic": self.raw_statistic,
                "mean_difference": self.mean_difference, "mean_difference_se": self.se, "dm_lags": self.lags,
                "n_bars": self.n_bars, "dm_alternative": self.alternative, "dm_variance": self.variance}


def _series(x: np.ndarray | torch.Tensor | Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D series of per-bar returns, got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise ValueError(f"{name}: bar {int(bad[0])} is not finite ({arr[bad[0]]}); drop or fill masked bars first")
    return arr


def t_p_value(statistic: float, dof: int, alternative: Alternative) -> float:
    """p-value of a statistic read against Student's t with ``dof`` degrees of freedom."""
    if alternative == "greater":
        return float(stats.t.sf(statistic, dof))
    if alternative == "less":
        return float(stats.t.cdf(statistic, dof))
    return float(2.0 * stats.t.sf(abs(statistic), dof))


def diebold_mariano(a: np.ndarray | torch.Tensor | Sequence[float], b: np.ndarray | torch.Tensor | Sequence[float],
                    lags: int | None = None, alternative: Alternative = "two-sided",
                    variance: Variance = "newey-west") -> DieboldMariano:
    """Diebold & Mariano's (1995) test on ``d = a - b`` with the HLN correction (1997).

    ``DM = d̄ / sqrt(LRV(d) / n)``. ``variance="newey-west"``: LRV the Bartlett estimate with ``lags`` truncation
    (default Newey & West's 1994 rule) over divisor-n autocovariances, and ``DM* = DM · sqrt((n + 1 - 2h + h(h-1)/n)
    / n)`` with h = lags + 1. ``"andrews-monahan"``: LRV :func:`~foxhunt.evaluation.hac.long_run_variance`'s default
    (AR(1)-prewhitened quadratic spectral kernel, Andrews' bandwidth; less downward bias on autocorrelated d), h = 1.
    p from t(n - 1). "greater": H1 E[a] > E[b]. With ``lags=0`` DM* is the one-sample t statistic of d.
    """
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    if variance not in VARIANCES:
        raise ValueError(f"variance must be one of {VARIANCES}, got {variance!r}")
    x, y = _series(a, "a"), _series(b, "b")
    if x.shape != y.shape:
        raise ValueError(f"the two series must have the same bars, got {x.size} and {y.size}")
    n = x.size
    if n < 3:
        raise ValueError(f"the Diebold-Mariano test needs at least 3 paired bars, got {n}")
    lags = newey_west_lags(n) if lags is None else int(lags)
    if not 0 <= lags < n:
        raise ValueError(f"lags must lie in 0..{n - 1}, got {lags}")
    d = x - y
    mean = float(d.mean())
    if variance == "newey-west":
        lrv = float(long_run_variance(torch.from_numpy(d), "bartlett", float(lags + 1), prewhiten=False))
    else:
        lrv, lags = float(long_run_variance(torch.from_numpy(d))), 0
    se = math.sqrt(lrv / n)
    if not se > SHARPE_RTOL * float(np.abs(d).max()):  # a constant difference (up to rounding): nothing random to test
        nan = math.nan
        return DieboldMariano(nan, nan, nan, mean, se, lags, n, alternative, variance)
    raw = mean / se
    stat = raw * hln_factor(n, lags + 1)
    return DieboldMariano(stat, t_p_value(stat, n - 1, alternative), raw, mean, se, lags, n, alternative, variance)


def _matrix(returns: Mapping[str, np.ndarray | torch.Tensor | Sequence[float]]) -> tuple[list[str], np.ndarray]:
    names = list(returns)
    cols = [_series(returns[k], str(k)) for k in names]
    if len({c.size for c in cols}) > 1:
        sizes = ", ".join(f"{k} {c.size}" for k, c in zip(names, cols, strict=True))
        raise ValueError(f"every series must have the same bars, got {sizes}")
    return names, np.column_stack(cols)


def stationary_block(differences: np.ndarray) -> int:
    """The stationary bootstrap's mean block for several paired differences [n, k]: the largest of Politis & White's
    (2004) lengths of each column (:func:`~foxhunt.evaluation.hac.politis_white_block_length`)."""
    lengths = [politis_white_block_length(torch.from_numpy(np.ascontiguousarray(col))) for col in differences.T]
    return max(1, round(max(lengths)))


@dataclass(frozen=True)
class SuperiorPredictiveAbility:
    """Hansen's SPA test that no model beats the benchmark (its three p-values) and the models StepM-style found
    better at ``alpha`` (``arch``'s ``better_models`` on the consistent p-value)."""

    p_value: float  # the consistent p-value (Hansen's recommended one)
    p_value_lower: float
    p_value_upper: float
    better: tuple[str, ...]
    block: int
    reps: int

    def to_dict(self) -> dict[str, float | int | list[str]]:
        """JSON-able fields."""
        return {"spa_p_value": self.p_value, "spa_p_value_lower": self.p_value_lower,
                "spa_p_value_upper": self.p_value_upper, "spa_better": list(self.better), "spa_block": self.block,
                "spa_reps": self.reps}


def superior_predictive_ability(
    benchmark: np.ndarray | torch.Tensor | Sequence[float],
    models: Mapping[str, np.ndarray | torch.Tensor | Sequence[float]],
    reps: int = 999, block: int | None = None, seed: int = 0, alpha: float = 0.05,
) -> SuperiorPredictiveAbility:
    """Hansen's (2005) SPA test of H0 "no model's expected return exceeds the benchmark's" (``arch.bootstrap.SPA``,
    studentised, stationary bootstrap of mean ``block`` bars, default Politis & White's of the differences), on
    losses ``-returns``."""
    from arch.bootstrap import SPA

    if not models:
        raise ValueError("superior_predictive_ability needs at least one model")
    base = _series(benchmark, "benchmark")
    names, mat = _matrix(models)
    if mat.shape[0] != base.size:
        raise ValueError(f"the models have {mat.shape[0]} bars, the benchmark {base.size}")
    block = stationary_block(mat - base[:, None]) if block is None else int(block)
    spa = SPA(-base, -mat, block_size=block, reps=reps, bootstrap="stationary", seed=seed)
    spa.compute()
    p = spa.pvalues
    better = tuple(names[i] for i in spa.better_models(alpha, "consistent"))
    return SuperiorPredictiveAbility(float(p["consistent"]), float(p["lower"]), float(p["upper"]), better, block, reps)


@dataclass(frozen=True)
class ModelConfidenceSet:
    """Hansen, Lunde & Nason's model confidence set: the strategies not excluded at ``size`` and each one's MCS p-value."""

    included: tuple[str, ...]
    p_values: dict[str, float]
    size: float
    block: int
    reps: int

    def to_dict(self) -> dict[str, object]:
        """JSON-able fields."""
        return {"mcs_included": list(self.included), "mcs_p_values": dict(self.p_values), "mcs_size": self.size,
                "mcs_block": self.block, "mcs_reps": self.reps}


def model_confidence_set(
    returns: Mapping[str, np.ndarray | torch.Tensor | Sequence[float]],
    size: float = 0.10, reps: int = 999, block: int | None = None, seed: int = 0,
) -> ModelConfidenceSet:
    """The set of best strategies at confidence ``1 - size`` (``arch.bootstrap.MCS``, range statistic "R",
    stationary bootstrap of mean ``block`` bars, default Politis & White's of the differences to the first), on
    losses ``-returns``."""
    from arch.bootstrap import MCS

    if len(returns) < 2:
        raise ValueError("the model confidence set needs at least two strategies")
    if not 0.0 < size < 1.0:
        raise ValueError(f"size must lie in (0, 1), got {size}")
    names, mat = _matrix(returns)
    block = stationary_block(mat[:, 1:] - mat[:, :1]) if block is None else int(block)
    mcs = MCS(-mat, size, reps=reps, block_size=block, method="R", bootstrap="stationary", seed=seed)
    mcs.compute()
    pv = mcs.pvalues["Pvalue"]
    p_values = {names[int(i)]: float(v) for i, v in pv.items()}
    included = tuple(names[int(i)] for i in mcs.included)
    return ModelConfidenceSet(included, p_values, size, block, reps)


TABLE_WIDTH = 120  # the terminal the legend lines are wrapped for
PAIRED_COLUMNS = (  # (key, header, format) of the paired table
    ("sharpe", "Sharpe", "{:+.2f}"),
    ("total_log_return", "log return", "{:+.4f}"),
    ("sharpe_diff", "ΔSharpe", "{:+.2f}"),
    ("sharpe_diff_se", "s.e. HAC", "{:.2f}"),
    ("p_hac", "p HAC", "{:.3f}"),
    ("p_boot", "p boot", "{:.3f}"),
    ("dm", "DM", "{:+.2f}"),
    ("dm_p", "p DM", "{:.3f}"),
    ("mcs_p", "p MCS", "{:.3f}"),
)


def paired_report(returns: Mapping[str, torch.Tensor | np.ndarray], bars_per_year: float, n_boot: int = 999,
                  seed: int = 0, mcs_size: float = 0.10) -> dict[str, object]:
    """The paired table of strategies on the same bars, each against the first: Sharpe and total log return, the
    Sharpe difference with its HAC s.e. and Ledoit & Wolf's two p-values, Diebold-Mariano (Newey-West, HLN,
    two-sided); with three or more, Hansen's SPA of the others against the first and the model confidence set.
    Annualised by ``bars_per_year``. JSON-able but for NaN (``foxhunt.files.json_safe``)."""
    names = list(returns)
    if len(names) < 2:
        raise ValueError("a paired table needs at least two strategies")
    series = {k: torch.as_tensor(np.asarray(returns[k], dtype=np.float64) if not isinstance(returns[k], torch.Tensor)
                                 else returns[k].double().cpu()) for k in names}
    _matrix(series)  # same bars, finite
    first = names[0]
    rows: dict[str, dict[str, float]] = {}
    for name in names:
        x = series[name]
        _, sharpe, total, _, _ = pnl_figures(x, torch.ones_like(x, dtype=torch.bool), bars_per_year)
        row = {"sharpe": float(sharpe), "total_log_return": float(total), "mean_per_bar": float(x.mean())}
        if name != first:
            test = sharpe_difference_test(x, series[first], bars_per_year, n_boot=n_boot, seed=seed)
            dm = diebold_mariano(x, series[first])
            row.update({"sharpe_diff": test.difference, "sharpe_diff_se": test.se, "p_hac": test.p_value,
                        "p_boot": test.p_value_bootstrap, "dm": dm.statistic, "dm_p": dm.p_value, "dm_lags": dm.lags})
        rows[name] = row
    report: dict[str, object] = {"reference": first, "bars": int(series[first].numel()),
                                 "bars_per_year": float(bars_per_year), "rows": rows, "spa": None, "mcs": None}
    twin: dict[str, str] = {}  # each strategy's first identical one (itself if none): SPA and MCS see each once
    for name in names:
        twin[name] = next((u for u in twin.values() if u == twin.get(u) and torch.equal(series[u], series[name])), name)
    distinct = list(dict.fromkeys(twin.values()))
    report["identical"] = {name: u for name, u in twin.items() if u != name}
    if len(names) >= 3:
        others = {k: series[k].numpy() for k in distinct if k != twin[first]}
        if others:  # a strategy identical to the reference cannot beat it; SPA's studentisation needs a spread
            report["spa"] = superior_predictive_ability(series[first].numpy(), others, reps=n_boot,
                                                        seed=seed).to_dict()
        if len(distinct) >= 2:
            mcs = model_confidence_set({k: series[k].numpy() for k in distinct}, size=mcs_size, reps=n_boot, seed=seed)
            result = mcs.to_dict()
            result["mcs_included"] = [n for n in names if twin[n] in mcs.included]
            result["mcs_p_values"] = {n: mcs.p_values[twin[n]] for n in names}
            report["mcs"] = result
            for name in names:
                rows[name]["mcs_p"] = mcs.p_values[twin[name]]
    return report


def format_paired_report(report: Mapping[str, object], title: str) -> str:
    """The paired table as text: one row per strategy, the first the reference, then SPA and the MCS if present."""
    rows: dict[str, dict[str, float]] = report["rows"]  # type: ignore[assignment]
    cols = [c for c in PAIRED_COLUMNS if any(c[0] in r for r in rows.values())]
    width = max(12, *(len(n) + 2 for n in rows))

    def cell(v: object, fmt: str) -> str:
        return fmt.format(v) if isinstance(v, int | float) and math.isfinite(v) else ("" if v is None else "n/a")

    head = f"{'':<{width}}" + "".join(f"{label:>11}" for _, label, _ in cols)
    lines = [f"{title}: {report['bars']:,} bars every strategy decides on, after costs; each against "
             f"{report['reference']}", head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:<{width}}" + "".join(f"{cell(r.get(k), fmt):>11}" for k, _, fmt in cols))
    lines.append(textwrap.fill(
        "ΔSharpe: annualised Sharpe minus the reference's, its HAC s.e. and Ledoit & Wolf's (2008) two-sided p-values "
        "(HAC delta method; studentised block bootstrap); DM: Diebold-Mariano on the per-bar return difference "
        "(Newey-West, Harvey-Leybourne-Newbold, t), two-sided", TABLE_WIDTH))
    for name, u in (report.get("identical") or {}).items():
        lines.append(f"{name} trades exactly as {u} on these bars (SPA and the MCS count them once)")
    spa, mcs = report.get("spa"), report.get("mcs")
    if isinstance(spa, Mapping):
        better = ", ".join(spa["spa_better"]) or "none"
        lines.append(textwrap.fill(
            f"Hansen's SPA, H0 no strategy beats {report['reference']}: p = {spa['spa_p_value']:.3f} (consistent; "
            f"lower {spa['spa_p_value_lower']:.3f}, upper {spa['spa_p_value_upper']:.3f}); better at 5%: {better}",
            TABLE_WIDTH))
    if isinstance(mcs, Mapping):
        lines.append(textwrap.fill(f"model confidence set at {1 - mcs['mcs_size']:.0%} (Hansen, Lunde & Nason 2011): "
                                   + ", ".join(mcs["mcs_included"]) + "; p MCS: each one's MCS p-value", TABLE_WIDTH))
    return "\n".join(lines)
