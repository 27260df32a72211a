"""When a challenger replaces the champion: a promotion rule declared before the stream, that does not peek its way to
false promotions.

Both trade the same bars; the rule decides on the paired after-cost return difference ``d_t = challenger_t -
champion_t`` (H0: E[d] <= 0; H1: the challenger earns more per bar). Two designs, both valid under repeated looks:

- ``"fixed"``: one one-sided Diebold-Mariano test (:func:`foxhunt.evaluation.paired.diebold_mariano`, the
  prewhitened long-run variance of Andrews & Monahan 1992, t(n - 1); the Newey-West form with Harvey, Leybourne &
  Newbold's correction ran 6% false promotions at 500 bars of AR(1) differences, docs/STATISTICS.md, and is
  reported beside it) on exactly the first ``horizon`` bars, whenever it is asked;
  before the horizon every challenger is undecided. Several challengers: Holm's (1979) step-down over their p-values
  (family-wise error <= alpha under any dependence).
- ``"sequential"``: an always-valid test checked at every bar from ``min_bars`` on: the one-sided normal-mixture
  e-process (Robbins 1970; the one-sided form of Howard, Ramdas, McAuliffe & Sekhon 2021) of the sum of d, self-normalised by its
  running Newey-West long-run variance, as in Waudby-Smith, Arnold, Wu & Ramdas' (2024) asymptotic confidence
  sequences. Ville's inequality bounds the chance that it ever crosses ``k / alpha`` (k challengers: Bonferroni) by
  alpha/k, asymptotically; a crossing of the mirrored e-process means the challenger is worse (keep, stop testing).
  With a ``horizon`` an undecided challenger is kept there.

Challengers added together are one family, tested at ``alpha``. A session that keeps starting families (a retrain
every N bars, a new family after each promotion) would spend ``alpha`` again on each; ``spending="families"`` spends it
once over the session instead: the j-th family is tested at ``alpha * 6 / (pi^2 j^2)``, whose sum over every j is
``alpha`` (a union bound: false promotions over all the families the session ever starts stay <= alpha).

Every verdict is a function of the bars passed, never of when or how often ``check`` was called: a decision at bar
t uses bars <= t, and a later call reports the same decision at the same bar. docs/STATISTICS.md has the formulas and
the measured false-promotion rate and power (``scripts/bench_promotion.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
from scipy.special import log_ndtr

from foxhunt.evaluation.paired import diebold_mariano
from foxhunt.evaluation.sharpe_difference import sharpe_difference_z
from foxhunt.evaluation.significance import SHARPE_RTOL, normal_cdf
from foxhunt.files import json_safe

METHODS = ("fixed", "sequential")
SPENDING = ("none", "families")
DECISIONS = ("promote", "keep", "undecided")
MIN_BARS = 30  # fewer paired bars than this make no test of a mean difference on dependent returns
REFRESH = 1_000  # the sequential test's variance is refreshed every max(1, t // REFRESH) bars (variance_bars)


@dataclass(frozen=True)
class Verdict:
    """One challenger's state under the rule: promote, keep (it is not better: stop testing it) or undecided."""

    decision: str
    bars: int  # the paired bars the decision was taken on (the bars seen so far while undecided)
    evidence: dict = field(default_factory=dict)  # strict JSON values: the statistics that decided (NaN, inf: None)

    def __post_init__(self) -> None:
        if self.decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {self.decision!r}")
        object.__setattr__(self, "evidence", json_safe(dict(self.evidence)))


@dataclass(frozen=True)
class PromotionRule:
    """A champion/challenger promotion rule, declared before the stream starts (JSON-able: to_dict / from_dict)."""

    min_bars: int = 500  # no decision before this many paired bars
    alpha: float = 0.05  # family-wise false-promotion rate over the challengers of one check
    method: str = "fixed"  # "fixed": tested once at ``horizon``; "sequential": always valid, checked every bar
    horizon: int | None = None  # fixed: the bars of the one test (default min_bars); sequential: keep there if undecided
    spending: str = "none"  # "none": every family at alpha; "families": the j-th at alpha 6 / (pi^2 j^2)

    def __post_init__(self) -> None:
        if isinstance(self.min_bars, bool) or not isinstance(self.min_bars, int) or self.min_bars < MIN_BARS:
            raise ValueError(f"min_bars must be an integer of at least {MIN_BARS}, got {self.min_bars!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0.0 < self.alpha < 0.5:
            raise ValueError(f"alpha must be a number in (0, 0.5), got {self.alpha!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.horizon is not None and (isinstance(self.horizon, bool) or not isinstance(self.horizon, int)
                                         or self.horizon < self.min_bars):
            raise ValueError(f"horizon must be an integer of at least min_bars ({self.min_bars}), got {self.horizon!r}")
        if self.spending not in SPENDING:
            raise ValueError(f"spending must be one of {SPENDING}, got {self.spending!r}")

    @property
    def bars_needed(self) -> int:
        """The bars before which no challenger can be decided."""
        if self.method == "fixed":
            return self.horizon if self.horizon is not None else self.min_bars
        return self.min_bars

    def to_dict(self) -> dict[str, Any]:
        """The rule as plain JSON values."""
        return {"min_bars": self.min_bars, "alpha": float(self.alpha), "method": self.method, "horizon": self.horizon,
                "spending": self.spending}

    def family_alpha(self, family: int) -> float:
        """The false-promotion rate the ``family``-th family of challengers (1, 2, ...) of a session is tested at."""
        if isinstance(family, bool) or not isinstance(family, int) or family < 1:
            raise ValueError(f"family must be an integer of at least 1, got {family!r}")
        return float(self.alpha) if self.spending == "none" else float(self.alpha) * 6.0 / (math.pi**2 * family**2)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PromotionRule:
        """The rule from :meth:`to_dict`'s form; an unknown key or a bad value is one ValueError naming it."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a promotion rule must be a mapping of {[f.name for f in fields(cls)]}, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"promotion rule: unknown key {unknown[0]!r} (known: {sorted(known)})")
        return cls(**dict(d))

    def check(self, champion: np.ndarray | torch.Tensor, challengers: Mapping[str, np.ndarray | torch.Tensor],
              family: int = 1) -> dict[str, Verdict]:
        """Each challenger's verdict on the per-bar after-cost log returns of the champion and the challengers on the
        same bars so far (equal lengths). Pass every challenger of the family on every call, decided ones too: the
        multiple-comparison correction counts them. ``family``: the family's ordinal in the session (its alpha:
        :meth:`family_alpha`)."""
        spent = {"family": family, "declared_alpha": float(self.alpha), "spending": self.spending}
        rule = replace(self, alpha=self.family_alpha(family), spending="none")
        base, series = _inputs(champion, challengers)
        n = base.size
        if n < rule.bars_needed:
            ev = {"method": rule.method, "alpha": float(rule.alpha), "bars_needed": rule.bars_needed}
            verdicts = {name: Verdict("undecided", n, dict(ev)) for name in series}
        elif rule.method == "fixed":
            verdicts = _fixed(rule, base, series)
        else:
            verdicts = _sequential(rule, base, series)
        return {name: Verdict(v.decision, v.bars, {**v.evidence, **spent}) for name, v in verdicts.items()}


def best_promoted(verdicts: Mapping[str, Verdict]) -> str | None:
    """The challenger to promote among those promoted: the largest mean return difference (None if none is)."""
    promoted = [(v.evidence.get("mean_difference", -math.inf), name) for name, v in verdicts.items()
                if v.decision == "promote"]
    return max(promoted)[1] if promoted else None


def _inputs(champion: Any, challengers: Mapping[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    def as_array(x: Any, name: str) -> np.ndarray:
        arr = np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
        if arr.ndim != 1:
            raise ValueError(f"{name}: per-bar returns must be 1-D, got shape {arr.shape}")
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            raise ValueError(f"{name}: bar {int(bad[0])} is not finite ({arr[bad[0]]})")
        return arr

    if not challengers:
        raise ValueError("check needs at least one challenger")
    base = as_array(champion, "champion")
    series = {}
    for name, x in challengers.items():
        arr = as_array(x, f"challenger {name!r}")
        if arr.size != base.size:
            raise ValueError(f"challenger {name!r}: {arr.size} bars, the champion {base.size}; pass the same bars")
        # a bar where the two differ by rounding only (the same positions computed twice) is the same bar: no
        # rounding residue can accumulate into evidence
        same = np.abs(arr - base) <= SHARPE_RTOL * np.maximum(np.abs(arr), np.abs(base))
        series[str(name)] = np.where(same, base, arr)
    return base, series


def _common(rule: PromotionRule, k: int) -> dict[str, Any]:
    return {"method": rule.method, "alpha": float(rule.alpha), "n_challengers": k, "min_bars": rule.min_bars,
            "horizon": rule.horizon}


def _paired_evidence(challenger: np.ndarray, champion: np.ndarray) -> dict[str, Any]:
    """DM (one-sided; prewhitened, and Newey-West with HLN) and the Sharpe difference with its HAC s.e. (Ledoit &
    Wolf), per bar, on these bars."""
    out: dict[str, Any] = diebold_mariano(challenger, champion, alternative="greater",
                                          variance="andrews-monahan").to_dict()
    nw = diebold_mariano(challenger, champion, alternative="greater")
    out.update({"dm_nw_statistic": nw.statistic, "dm_nw_p_value": nw.p_value, "dm_nw_lags": nw.lags})
    del out["dm_lags"]
    diff, se = sharpe_difference_z(torch.from_numpy(challenger), torch.from_numpy(champion))
    diff, se = float(diff), float(se)
    out["sharpe_difference_per_bar"] = diff
    out["sharpe_difference_se_per_bar"] = se
    out["sharpe_p_value"] = 2.0 * normal_cdf(-abs(diff) / se) if se > 0 and math.isfinite(diff) else math.nan
    return out


def holm_adjusted(p: np.ndarray) -> np.ndarray:
    """Holm's (1979) step-down adjusted p-values: reject where adjusted <= alpha (FWER alpha, any dependence)."""
    k = p.size
    order = np.argsort(p, kind="stable")
    adj = np.empty(k)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (k - rank) * p[i]))
        adj[i] = running
    return adj


def _fixed(rule: PromotionRule, base: np.ndarray, series: dict[str, np.ndarray]) -> dict[str, Verdict]:
    """One one-sided DM test per challenger on exactly the first ``horizon`` bars; Holm over the challengers."""
    h = rule.bars_needed
    champ = base[:h]
    names = list(series)
    evidence, p = {}, np.ones(len(names))
    for i, name in enumerate(names):
        ch = series[name][:h]
        ev = _paired_evidence(ch, champ)
        ev["identical"] = bool(np.array_equal(ch, champ))
        stat = ev["dm_statistic"]
        if math.isnan(stat):  # a constant difference: certain, not random
            p[i] = 0.0 if ev["mean_difference"] > 0 else 1.0
        else:
            p[i] = ev["dm_p_value"]
        evidence[name] = ev
    adj = holm_adjusted(p)
    out = {}
    for i, name in enumerate(names):
        ev = {**_common(rule, len(names)), **evidence[name], "test": "Diebold-Mariano, prewhitened variance, one-sided, Holm",
              "statistic": evidence[name]["dm_statistic"], "p_value": float(p[i]), "p_value_adjusted": float(adj[i])}
        out[name] = Verdict("promote" if adj[i] <= rule.alpha else "keep", h, ev)
    return out


def mixture_log_e(s: np.ndarray, v: np.ndarray, rho2: float) -> np.ndarray:
    """log of the one-sided normal-mixture e-process ``2 / sqrt(1 + ρ² v) exp(ρ² s² / (2 (1 + ρ² v))) Φ(ρ s / sqrt(1 +
    ρ² v))`` (Howard et al. 2021's one-sided normal mixture: ``exp(λ s - λ² v / 2)`` mixed over a half-normal λ of scale ρ)."""
    a = 1.0 + rho2 * v
    return math.log(2.0) - 0.5 * np.log(a) + rho2 * s**2 / (2.0 * a) + log_ndtr(math.sqrt(rho2) * s / np.sqrt(a))


def mixture_rho2(alpha: float, tuned_at: int) -> float:
    """The mixture scale ρ² that makes the boundary tightest near ``tuned_at`` bars (Waudby-Smith et al. 2024):
    ``(-2 log α + log(-2 log α + 1)) / tuned_at``."""
    la = -2.0 * math.log(alpha)
    return (la + math.log(la + 1.0)) / tuned_at


def variance_bars(t: np.ndarray) -> np.ndarray:
    """The prefix whose variance the sequential test uses at bar t: t itself up to ``2 * REFRESH`` bars, then t
    rounded down to a multiple of ``t // REFRESH`` (refreshed every 0.1% of the history: the statistic's sum moves
    every bar, its scale is at most that stale), so a check of n bars evaluates the variance at about
    ``2 REFRESH + REFRESH ln(n / 2 REFRESH)`` prefixes instead of n."""
    step = np.maximum(1, t // REFRESH)
    return t - t % step


def newey_west_at(d: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """[len(ends)] the Newey-West long-run variance of each prefix d[:t], t in ``ends`` (increasing), each with its own
    lag ``newey_west_lags(t)`` and Bartlett weights over divisor-t demeaned autocovariances: exactly
    ``hac.long_run_variance(d[:t], "bartlett", lags + 1, prewhiten=False)``, from running sums (bars < t only):
    ``γ_j(t) = (P_j(t) - m_t (C_t - C_j + C_{t-j}) + (t - j) m_t²) / t`` with P_j the running sum of d_s d_{s-j}, C
    that of d and m_t = C_t / t."""
    n = d.size
    ti = np.asarray(ends, dtype=np.int64)
    t = ti.astype(np.float64)
    lags = np.minimum(np.floor(4.0 * (t / 100.0) ** (2.0 / 9.0)), t - 1)  # newey_west_lags of every t at once
    max_lag = int(lags.max()) if lags.size else 0
    j = np.arange(max_lag + 1)[:, None]
    prods = np.zeros((max_lag + 1, n + 1))  # prods[j, s + 1] = d_s d_{s-j} (0 for s < j)
    for lag in range(max_lag + 1):
        prods[lag, lag + 1:] = d[lag:] * d[: n - lag]
    if ti.size == 0:
        return np.zeros(0)
    starts = np.concatenate([[0], ti[:-1] + 1])  # P_j(t_k) = Σ of prods[j, :t_k + 1]: sums between ends, accumulated
    running = np.cumsum(np.add.reduceat(prods[:, : ti[-1] + 1], starts, axis=1), axis=1)  # [L+1, T]
    c = np.concatenate([[0.0], np.cumsum(d)])  # c[t] = Σ_{s<t} d_s (0-based bars)
    mean = c[ti] / t
    cross = running - mean * ((c[ti] - c[np.minimum(j, n)]) + c[np.maximum(ti - j, 0)]) + (ti - j) * mean**2
    weight = np.where(j <= lags, (1.0 - j / (lags + 1.0)) * np.where(j > 0, 2.0, 1.0), 0.0)
    return np.maximum((weight * cross).sum(0) / t, 0.0)


def running_newey_west(d: np.ndarray, first: int) -> np.ndarray:
    """[n - first + 1] the sequential test's variance at every bar t = first .. n: the Newey-West long-run variance
    of d[:variance_bars(t)] (:func:`newey_west_at`; bars <= t only)."""
    ends, at = np.unique(variance_bars(np.arange(first, d.size + 1)), return_inverse=True)
    return newey_west_at(d, ends)[at]


def _sequential(rule: PromotionRule, base: np.ndarray, series: dict[str, np.ndarray]) -> dict[str, Verdict]:
    """The first bar t >= min_bars where a challenger's e-process (or its mirror) crosses k / alpha; at the horizon
    (if any) an undecided challenger is kept."""
    k = len(series)
    log_threshold = math.log(k / rule.alpha)
    tuned_at = rule.horizon if rule.horizon is not None else rule.min_bars
    rho2 = mixture_rho2(rule.alpha / k, tuned_at)
    n = base.size
    last = n if rule.horizon is None else min(n, rule.horizon)
    out = {}
    for name, ch in series.items():
        d = ch[:last] - base[:last]
        common = {**_common(rule, k), "test": "normal-mixture e-process on the paired difference, Bonferroni",
                  "e_threshold": math.exp(log_threshold), "tuned_at": tuned_at}
        if not np.any(d[: rule.min_bars]):  # identical returns on the first min_bars bars: nothing to promote
            out[name] = Verdict("keep", rule.min_bars, {**common, "identical": True, "e_value": 1.0, "p_value": 1.0,
                                                        "statistic": 0.0, "mean_difference": 0.0})
            continue
        t = np.arange(rule.min_bars, last + 1, dtype=np.float64)
        lrv = running_newey_west(d, rule.min_bars)
        total = np.cumsum(d)[rule.min_bars - 1:]
        sd = np.sqrt(lrv)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(sd > 0, total / np.where(sd > 0, sd, 1.0), np.sign(total) * np.inf)
        up, down = mixture_log_e(s, t, rho2), mixture_log_e(-s, t, rho2)
        up, down = np.nan_to_num(up, nan=0.0), np.nan_to_num(down, nan=0.0)
        crossed = np.flatnonzero((up >= log_threshold) | (down >= log_threshold))
        if crossed.size:
            i = int(crossed[0])
            decision = "promote" if up[i] >= log_threshold else "keep"
        elif rule.horizon is not None and n >= rule.horizon:
            i, decision = t.size - 1, "keep"
        else:
            i, decision = t.size - 1, "undecided"
        bars = int(t[i])
        best_up = float(np.max(up[: i + 1]))
        ev = {**common, "identical": False, "e_value": _exp(float(up[i])), "e_value_worse": _exp(float(down[i])),
              "p_value": min(1.0, _exp(-best_up)), "statistic": float(s[i] / math.sqrt(bars)) if math.isfinite(s[i])
              else float(s[i]), "mean_difference": float(total[i] / bars), "long_run_variance": float(lrv[i])}
        if decision != "undecided":
            ev.update({key: val for key, val in _paired_evidence(ch[:bars], base[:bars]).items()
                       if key != "mean_difference"})
        out[name] = Verdict(decision, bars, ev)
    return out


def _exp(x: float) -> float:
    return math.inf if x > 700 else math.exp(x)

