"""After the trials: best trial(s) as ready fit configs, importances, plots, summary.json, the printed summary."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from foxhunt.tune.space import TuneConfig, compose_fit_config, decoded_params, write_fit_config
from foxhunt.tune.study import COUNTED_FAIL_KINDS


# ------------------------------------------------------------------------------------------------------- summary
def _kind(t: FrozenTrial) -> str:
    if t.state == TrialState.FAIL:
        return str(t.user_attrs.get("fail_kind", "stale"))
    return t.state.name.lower()


def summarize(study: optuna.Study, cfg: TuneConfig, out_dir: Path | None = None, plots: bool = True) -> dict[str, Any]:
    """Best trial(s), ready fit configs, importances and plots, written under ``out_dir`` (default runs/<study>/best)."""
    out_dir = out_dir or cfg.runs_dir / study.study_name / "best"
    out_dir.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for t in trials:
        counts[_kind(t)] = counts.get(_kind(t), 0) + 1
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    summary: dict[str, Any] = {
        "study": study.study_name,
        "objectives": [{"metric": o.metric, "direction": o.direction, "reduce": o.reduce} for o in cfg.objectives],
        "n_trials": len(trials),
        "counts": counts,
        "pruned": [t.number for t in trials if t.state == TrialState.PRUNED],
        "failed": {t.number: t.user_attrs.get("fail_reason", _kind(t)) for t in trials if t.state == TrialState.FAIL},
        "best": [],
        "importances": {},
        "plots": [],
    }
    # one objective: study.best_trial, the first of any tied (best_trials would hold every tie, each overwriting
    # config.yaml, the last winning); several: the Pareto front, one config each
    best_trials = (study.best_trials if cfg.multi_objective else [study.best_trial]) if complete else []
    for t in best_trials:
        params = decoded_params(cfg, t)
        name = "config.yaml" if not cfg.multi_objective else f"config_trial_{t.number}.yaml"
        values = dict(zip([o.metric for o in cfg.objectives], t.values, strict=True))
        path = write_fit_config(
            compose_fit_config(cfg, params), out_dir / name,
            f"best trial {t.number} of study {study.study_name}: {json.dumps(values)}\n"
            f"written by foxhunt.tune; run: python -m foxhunt.fit --config {out_dir / name}",
        )
        summary["best"].append({"number": t.number, "values": values, "params": params, "config": str(path),
                                "log_dir": t.user_attrs.get("log_dir"), "export_dir": t.user_attrs.get("export_dir"),
                                "deflated_sharpe": deflated_sharpe(study, t),
                                "tied": sum(1 for c in complete if c.values == t.values) - 1})
    for i, o in enumerate(cfg.objectives):
        target = (lambda t, i=i: t.values[i]) if cfg.multi_objective else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                summary["importances"][o.metric] = {
                    k: round(v, 4) for k, v in optuna.importance.get_param_importances(study, target=target).items()
                }
        except (RuntimeError, ValueError) as e:
            summary["importances"][o.metric] = f"n/a: {e}"
        if plots and complete:
            summary["plots"] += _plots(study, target, o.metric, out_dir, i if cfg.multi_objective else None,
                                       isinstance(summary["importances"][o.metric], dict))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["summary_path"] = str(out_dir / "summary.json")
    return summary


def _plots(study: optuna.Study, target: Callable[[FrozenTrial], float] | None, metric: str, out_dir: Path,
           index: int | None, importances: bool) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    suffix = "" if index is None else f"_{index}"
    written = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        makers = [("optimization_history", ovm.plot_optimization_history)]
        if importances:
            makers.append(("param_importances", ovm.plot_param_importances))
        for name, fn in makers:
            ax = fn(study, target=target, target_name=metric)
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            path = out_dir / f"{name}{suffix}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(str(path))
    return written


def dsr_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The trials the best one was selected over, the N of its deflated Sharpe ratio: every complete and every pruned
    trial (the sampler proposed it and validation judged it, a pruned one before its fit ended), and every failure
    that uses up the budget (error, out of memory) once it had been scored on validation at least once. Interrupted,
    surplus and stale trials, and failures before any validation, were never judged and do not count."""
    def counted(t: FrozenTrial) -> bool:
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            return True
        if t.state != TrialState.FAIL or t.user_attrs.get("fail_kind") not in COUNTED_FAIL_KINDS:
            return False
        history = t.user_attrs.get("history") or {}
        return bool(t.intermediate_values) or any(len(h) for h in history.values())

    return [t for t in study.get_trials(deepcopy=False) if counted(t)]


def deflated_sharpe(study: optuna.Study, best: FrozenTrial) -> dict[str, Any] | None:
    """The deflated Sharpe ratio (Bailey and Lopez de Prado 2014) of the best trial's validation Sharpe: the
    probability that it beats the best Sharpe expected from that many trials of no skill.

    N counts every trial of :func:`dsr_trials`; the spread V of the trials' Sharpes comes from those that have one:
    the complete trials' validation moments and a pruned trial's at the validation it was pruned on (its last
    reported value; pruning stops the worst trials, so leaving them out shrinks V), floored at the null's own
    sampling spread (``null_max_sharpe``). A failed trial counts in N but not in V (no moments recorded). ``value``
    is None, with ``reason`` saying why, when the best trial has no Sharpe to deflate."""
    from foxhunt.evaluation.significance import expected_max_sharpe, null_max_sharpe, psr_from_moments

    mine = best.user_attrs.get("validation_moments")
    if mine is None:
        return None
    tried = dsr_trials(study)
    kinds: dict[str, int] = {}
    for t in tried:
        kinds[_kind(t)] = kinds.get(_kind(t), 0) + 1
    srs = [float(t.user_attrs["validation_moments"]["sr_per_bar"]) for t in tried
           if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and "validation_moments" in t.user_attrs]
    srs = [sr for sr in srs if math.isfinite(sr)]
    out: dict[str, Any] = {"value": None, "n_trials": len(tried), "trials": kinds, "n_sharpes": len(srs),
                           "reason": None}
    if not math.isfinite(mine["sr_per_bar"]):
        out["reason"] = ("the ensemble was held flat on validation (the do-no-harm rule: no trade, no P&L), so there "
                         "is no Sharpe to deflate" if mine.get("held_flat") else
                         "its validation P&L has no Sharpe (constant or non-finite), so there is none to deflate")
        return out
    n_trials, n_bars = max(len(tried), len(srs)), int(mine["n_bars"])
    # SR0 is at least what N trials of no skill show from sampling noise alone (variance 1/(T-1)): the trials' own
    # spread is missing with fewer than two Sharpes and shrunk by pruning, which drops the worst trials' Sharpes
    sr0 = max(expected_max_sharpe(srs, n_trials) if srs else 0.0, null_max_sharpe(n_trials, n_bars))
    out["value"] = float(psr_from_moments(mine["sr_per_bar"], n_bars, mine["skew"], mine["kurtosis"], sr0))
    out["sr0_per_bar"] = float(sr0)
    return out


def _format_dsr(d: Mapping[str, Any]) -> str:
    if d.get("value") is None:
        return f"    deflated Sharpe ratio of its validation Sharpe: none, {d['reason']}"
    trials = d.get("trials") or {}
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(trials.items()))
    return (f"    deflated Sharpe ratio of its validation Sharpe: {d['value']:.3f} (given {d['n_trials']} trials tried: "
            f"{kinds}; spread of {d['n_sharpes']} validation Sharpe(s); Bailey and Lopez de Prado 2014)")


def format_summary(summary: Mapping[str, Any], storage: str) -> str:
    counts = ", ".join(f"{v} {k}" for k, v in sorted(summary["counts"].items()))
    lines = [f"\nstudy {summary['study']!r}: {summary['n_trials']} trials ({counts})"]
    if summary["pruned"]:
        lines.append(f"  pruned: {summary['pruned']}")
    for number, reason in summary["failed"].items():
        lines.append(f"  failed trial {number}: {reason}")
    if not summary["best"]:
        lines.append("  no complete trial yet")
    for b in summary["best"]:
        vals = ", ".join(f"{k}={v:.6g}" for k, v in b["values"].items())
        lines.append(f"  best trial {b['number']} of {summary['n_trials']}: {vals}")
        if b.get("tied"):
            lines.append(f"    tied with {b['tied']} other complete trial(s), the first is taken (a validation Sharpe of 0 "
                         "usually means every member was held flat: no significant edge after costs; tune "
                         "val/<member>/edge_confidence instead, see docs/TUNING.md)")
        if b.get("deflated_sharpe"):
            lines.append(_format_dsr(b["deflated_sharpe"]))
        lines += [f"    {k}: {v}" for k, v in b["params"].items()]
        lines.append(f"    fit config: {b['config']}")
        lines.append(f"    weights:    {b['export_dir']}")
    for metric, imp in summary["importances"].items():
        text = ", ".join(f"{k} {v:.2f}" for k, v in imp.items()) if isinstance(imp, dict) else imp
        lines.append(f"  importances ({metric}): {text}")
    for p in summary["plots"]:
        lines.append(f"  plot: {p}")
    lines.append(f"  summary: {summary['summary_path']}")
    lines.append(f"  dashboard: optuna-dashboard {storage}")
    return "\n".join(lines)
