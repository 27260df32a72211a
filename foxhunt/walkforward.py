"""`python -m foxhunt.walkforward --config <fit config> --folds K [-- fit overrides]`: walk-forward out-of-sample test.

The data's time span is cut into an initial stretch and K consecutive test stretches. Fold k trains an ordinary
``foxhunt.fit`` run (``build_cli`` with the fit config, the overrides and the fold's dates: ``data.start``,
``data.val_start``, ``data.test_start``, ``data.end``) on the window before its test stretch (``expanding``: every bar
before it; ``rolling``: as many bars as the initial stretch), with a validation tail carved from the window's end
and BarDataModule's purge gaps; it exports the best checkpoint and then trades only its own test stretch with that
export (``foxhunt.load``: features recomputed, scaled with the exported statistics). The folds' out-of-sample
positions are concatenated per policy into one series, scored with ``evaluation/backtest.py`` (and with
``evaluation/significance.py`` where it exists) into one table and one equity figure.

A finished fold writes ``fold_<k>/done.json`` beside its positions (``fold_<k>/oos.safetensors``): a rerun skips
finished folds and redoes unfinished ones; ``--fold k`` runs one fold (separate processes or machines), ``--gather``
only gathers the finished folds. See docs/WALKFORWARD.md.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import math
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from foxhunt.cli_errors import ArgumentParser, UserError, one_line, run_command

if TYPE_CHECKING:
    from foxhunt.data.market import MarketSplit

log = logging.getLogger("foxhunt.walkforward")

LAYOUT = "layout.json"
DONE = "done.json"
POSITIONS = "oos.safetensors"
TABLE = "walkforward.json"
FIGURE = "equity.png"


class WalkForwardError(UserError, ValueError):
    """A walk-forward that cannot run or be gathered as asked (a layout that does not fit, mixed runs)."""


# ------------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Fold:
    """One fold's cut times (ISO UTC timestamps; ``end`` None: to the end of the data). Training and validation rows
    lie in [train_start, test_start), the validation tail from ``val_start``; the fold trades [test_start, end)."""

    index: int
    train_start: str
    val_start: str
    test_start: str
    end: str | None

    def contains(self, timestamps: torch.Tensor) -> torch.Tensor:
        """[T] True at the timestamps (int64 ns) inside the test stretch."""
        inside = timestamps >= _ns(self.test_start)
        return inside & (timestamps < _ns(self.end)) if self.end is not None else inside

    def data_args(self) -> list[str]:
        """The fold's ``foxhunt.fit`` overrides: BarDataModule's date cuts and the limits of the bars it uses."""
        args = ["--data.start", self.train_start, "--data.val_start", self.val_start, "--data.test_start", self.test_start]
        return args + ["--data.end", self.end] if self.end is not None else args


def _iso(ns: int) -> str:
    import pandas as pd

    return pd.Timestamp(int(ns), tz="UTC").isoformat()


def _ns(iso: str) -> int:
    import pandas as pd

    t = pd.Timestamp(iso)
    return (t.tz_localize("UTC") if t.tz is None else t).value


def fold_layout(
    timestamps: torch.Tensor,
    folds: int,
    mode: str = "expanding",
    initial_fraction: float | None = None,
    val_fraction: float = 0.15 / 0.85,
    min_bars: int = 1,
) -> list[Fold]:
    """Folds over the distinct timestamps of the data: an initial stretch (``initial_fraction`` of them, default
    1/(folds + 1)), then ``folds`` test stretches of (nearly) equal length. Fold k's training window ends where its
    test stretch begins and starts at the first bar (``expanding``) or as many timestamps earlier as the initial
    stretch holds (``rolling``); its last ``val_fraction`` is the validation tail. Every stretch (training,
    validation, test) must hold more than ``min_bars`` timestamps (BarDataModule's purge, lookback and horizon)."""
    if folds < 1:
        raise WalkForwardError(f"--folds must be at least 1, got {folds}")
    if mode not in ("expanding", "rolling"):
        raise WalkForwardError(f"--mode must be 'expanding' or 'rolling', got {mode!r}")
    initial = 1.0 / (folds + 1) if initial_fraction is None else float(initial_fraction)
    if not 0 < initial < 1:
        raise WalkForwardError(f"--initial_fraction must lie in (0, 1), got {initial}")
    if not 0 < val_fraction < 1:
        raise WalkForwardError(f"the validation share of a training window must lie in (0, 1), got {val_fraction}")
    times = torch.unique(timestamps.to(torch.int64))  # sorted
    n = int(times.numel())
    n0 = round(n * initial)
    bounds = [n0 + round(j * (n - n0) / folds) for j in range(folds + 1)]
    out = []
    for k in range(folds):
        lo, hi = bounds[k], bounds[k + 1]
        first = 0 if mode == "expanding" else max(0, lo - n0)
        n_val = round((lo - first) * val_fraction)
        sizes = {"training": lo - first - n_val, "validation": n_val, "test": hi - lo}
        small = {name: size for name, size in sizes.items() if size <= min_bars}
        if small:
            raise WalkForwardError(
                f"fold {k} of {folds} ({mode}) over {n:,} timestamps: {small} timestamps, need more than {min_bars} "
                f"(purge + lookback + horizon) in each stretch; use fewer folds, more data or another --initial_fraction"
            )
        end = _iso(int(times[hi])) if hi < n else None
        out.append(Fold(k, _iso(int(times[first])), _iso(int(times[lo - n_val])), _iso(int(times[lo])), end))
    return out


# ---------------------------------------------------------------------------------------------------- the fit config
class _FitConfig:
    """``foxhunt.fit``'s own parser over the fit config and overrides (nothing instantiated): the resolved data,
    model and logger settings the layout and the folds' arguments need."""

    def __init__(self, config: str, overrides: Sequence[str]) -> None:
        from foxhunt.data.datamodule import BarDataModule
        from foxhunt.fit import FoxhuntCLI, default_trainer_kwargs
        from foxhunt.lit.ensemble import EnsembleModule

        class _ParseOnly(FoxhuntCLI):
            def instantiate_classes(self) -> None:
                pass

        # each fold trades its own test stretch with its export, so the fit's own test back-test is off by default
        # (an override ``--backtest true`` turns it back on)
        self.args = ["--config", str(config), "--backtest", "false", *overrides]
        try:
            with warnings.catch_warnings():  # the command's own argv differs from the fit arguments on purpose
                warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
                cli = _ParseOnly(EnsembleModule, BarDataModule, subclass_mode_model=False, subclass_mode_data=False,
                                 trainer_defaults=default_trainer_kwargs(), args=self.args, run=False,
                                 parser_kwargs={"exit_on_error": False})
        except argparse.ArgumentError as e:
            raise WalkForwardError(f"{config}: foxhunt.fit rejects this config: {one_line(e)}") from e
        self.config = cli.config
        self.data = self.config.data.as_dict()
        self.model = self.config.model.as_dict()
        devices, nodes = self.config.get("trainer.devices"), self.config.get("trainer.num_nodes") or 1
        if devices == "auto":  # Lightning would take every GPU (DDP, one process per GPU, each rerunning this command)
            self.args += ["--trainer.devices", "1"]
        elif not _one_device(devices) or int(nodes) != 1:
            raise WalkForwardError(
                f"trainer.devices={devices!r}, num_nodes={nodes}: a walk-forward trains each fold on one device; to "
                "use several, run one `--fold k` process per device (e.g. with CUDA_VISIBLE_DEVICES)"
            )

    def fingerprint(self) -> str:
        """A hash of the resolved data and model settings and the seed: what every fold of one walk-forward shares
        (trainer settings may differ between machines)."""
        data = {k: v for k, v in self.data.items() if k not in ("start", "end", "val_start", "test_start", "cache_dir")}
        body = json.dumps({"data": data, "model": self.model, "seed": self.config.get("seed_everything")},
                          sort_keys=True, default=str)
        return hashlib.blake2b(body.encode(), digest_size=12).hexdigest()

    def logger_save_dir_arg(self, save_dir: Path) -> list[str]:
        """``--trainer.logger.init_args.save_dir DIR`` when the configured logger has a save_dir (TensorBoard, CSV)."""
        logger = self.config.get("trainer.logger")
        init = logger.get("init_args") if hasattr(logger, "get") else None
        if init is not None and "save_dir" in init:
            return ["--trainer.logger.init_args.save_dir", str(save_dir)]
        return []

    def min_bars(self) -> int:
        """Timestamps a stretch must exceed: the purge, and one window of lookback + horizon after it."""
        lookback, horizon = int(self.data["lookback"]), int(self.data["horizon"])
        purge = self.data.get("purge") or lookback + horizon
        return int(purge) + lookback + horizon


def _one_device(devices: Any) -> bool:
    """Lightning's ``devices`` value names a single device: 1, "1", [k] or "k,"."""
    if isinstance(devices, (list, tuple)):
        return len(devices) == 1
    text = str(devices).strip()
    return text == "1" or (text.endswith(",") and text[:-1].strip().isdigit())


def make_layout(fit: _FitConfig, folds: int, mode: str, initial_fraction: float | None,
                val_fraction: float | None) -> dict[str, Any]:
    """The walk-forward's layout (folds, Sharpe annualisation, the fit config's fingerprint) from the data itself."""
    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.data.tensors import bars_tensors
    from foxhunt.evaluation.trading import bars_per_year

    data = dict(fit.data)
    if val_fraction is None:
        val_fraction = float(data["val_fraction"]) / (float(data["train_fraction"]) + float(data["val_fraction"]))
    dm = BarDataModule(**data)
    _, ts, sym, _ = bars_tensors(dm.load())
    keep = torch.ones_like(ts, dtype=torch.bool)  # the config's own start/end, if any, bound the walk-forward
    if data.get("start") is not None:
        keep &= ts >= _ns(data["start"])
    if data.get("end") is not None:
        keep &= ts < _ns(data["end"])
    ts, sym = ts[keep], sym[keep]
    layout = fold_layout(ts, folds, mode, initial_fraction, val_fraction, fit.min_bars())
    bpy = fit.model.get("bars_per_year") or bars_per_year(ts, sym)  # the whole data's density: one value for all folds
    return {
        "folds": [asdict(f) for f in layout],
        "mode": mode,
        "initial_fraction": initial_fraction,
        "val_fraction": val_fraction,
        "bars_per_year": float(bpy),
        "fingerprint": fit.fingerprint(),
        "first_bar": _iso(int(ts.min())),
        "last_bar": _iso(int(ts.max())),
    }


def _write_json(path: Path, value: Any) -> None:
    """Atomically (a reader never sees half a file; concurrent writers of the same content are harmless), as strict
    JSON (NaN as null)."""
    from foxhunt.files import write_json

    write_json(path, value)


def settle_layout(out: Path, layout: dict[str, Any]) -> dict[str, Any]:
    """Write the layout to ``out``, or check it equals the one already there (same config, folds and dates)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LAYOUT
    if path.exists():
        old = json.loads(path.read_text())
        finished = [i for i in range(len(old.get("folds", []))) if is_done(out, i)]
        if old != layout and not finished:  # nothing belongs to the old layout yet (e.g. its config was refused)
            log.warning("%s: no fold of the earlier walk-forward finished; its layout is replaced", out)
            _write_json(path, layout)
            return layout
        if old != layout:
            diff = sorted(k for k in set(old) | set(layout) if old.get(k) != layout.get(k))
            raise WalkForwardError(
                f"{out} holds a walk-forward with another layout or fit config (differs in {diff}); finished folds would "
                "not belong together. Use another --out, or delete the directory to start over"
            )
        return old
    _write_json(path, layout)
    return layout


def read_layout(out: Path) -> dict[str, Any]:
    path = out / LAYOUT
    if not path.exists():
        raise WalkForwardError(f"{out}: no {LAYOUT}; run the walk-forward (or one --fold) there first")
    return json.loads(path.read_text())


def folds_of(layout: dict[str, Any]) -> list[Fold]:
    return [Fold(**f) for f in layout["folds"]]


# --------------------------------------------------------------------------------------------------------- one fold
def fold_dir(out: Path, k: int) -> Path:
    return out / f"fold_{k}"


def is_done(out: Path, k: int) -> bool:
    return (fold_dir(out, k) / DONE).exists()


def run_fold(fit: _FitConfig, layout: dict[str, Any], k: int, out: Path) -> dict[str, Any]:
    """Train fold k through ``foxhunt.fit``, export it, trade its test stretch with the export; write its positions
    and ``done.json`` (last, so a fold without it is unfinished). A finished fold is skipped."""
    from safetensors.torch import save_file

    from foxhunt.data.bars import timestamps_ns
    from foxhunt.evaluation.backtest import format_table
    from foxhunt.export.load import load
    from foxhunt.export.metadata import overlap_with_training
    from foxhunt.files import atomic_file
    from foxhunt.fit import build_cli

    fold = folds_of(layout)[k]
    where = fold_dir(out, k)
    if (where / DONE).exists():
        log.info("fold %d: finished earlier (%s), skipped", k, where / DONE)
        return json.loads((where / DONE).read_text())
    if where.exists():  # an unfinished fold (killed, or failed) starts over: nothing of it is reused
        log.info("fold %d: unfinished, its directory %s is cleared and the fold redone", k, where)
        shutil.rmtree(where)
    where.mkdir(parents=True)
    log.info("fold %d: train %s .. %s (validation from %s), test %s .. %s", k, fold.train_start, fold.test_start,
             fold.val_start, fold.test_start, fold.end or "the end")
    start = time.monotonic()
    export = where / "export"
    args = [*fit.args, *fold.data_args(), "--export_dir", str(export), "--trainer.default_root_dir", str(where),
            *fit.logger_save_dir_arg(where / "runs")]
    cli = build_cli(args)
    cli.fit()
    bars, oracle_mean = cli.datamodule.bars, cli.datamodule.oracle_mean
    del cli
    if fit.data.get("end") is not None:  # the config's own end bounds the walk-forward: no bar at or after it is
        # traded, and the last bar before it has no next return (it would run into data.end); features are causal
        keep = torch.from_numpy(timestamps_ns(bars) < _ns(fit.data["end"]))
        bars = bars[keep.numpy()].reset_index(drop=True)
        oracle_mean = None if oracle_mean is None else oracle_mean[keep]

    loaded = load(export)
    split = loaded.split(bars, name=f"fold {k} test", oracle_mean=oracle_mean)
    test = split.select(fold.contains(split.timestamps))
    seen = overlap_with_training(loaded.metadata, test)
    if bool(seen.any()):  # the cuts guarantee this; the export's own record of what it saw confirms it
        raise WalkForwardError(f"fold {k}: {int(seen.sum())} test bars inside the export's training/validation span")
    evaluation = loaded.model.evaluate(test)
    positions = {**evaluation.positions, "flat": torch.zeros(len(test), dtype=torch.float32)}
    metrics = _score(*_own_account(positions, test), evaluation.cost_bps, layout["bars_per_year"],
                     significance=False)  # significance at gather
    for policy, extra in evaluation.metrics.items():  # members' updates and ensemble weights, for the table's marks
        metrics[policy].update({key: extra[key] for key in ("updates", "weight") if key in extra})

    tensors = {"timestamps": test.timestamps, "symbol_index": test.symbol_index, "ohlcv": test.ohlcv,
               "returns": test.returns, "valid": test.valid}
    tensors.update({f"position.{p}": v.detach().float().cpu() for p, v in positions.items()})
    with atomic_file(where / POSITIONS) as tmp:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp))
    done = {
        "fold": k,
        "cuts": asdict(fold),
        "fingerprint": layout["fingerprint"],
        "symbols": list(test.symbols),
        "policies": list(positions),
        "cost_bps": float(evaluation.cost_bps),
        "bars_per_year": layout["bars_per_year"],
        "bars": len(test),
        "decision_bars": int(test.valid.sum()),
        "export": "export",
        "positions": POSITIONS,
        "metrics": metrics,
        "seconds": round(time.monotonic() - start, 1),
        "fit_args": args,
    }
    _write_json(where / DONE, _finite(done))
    print(f"\nfold {k}: out-of-sample {fold.test_start} .. {fold.end or 'end'}\n" + format_table(metrics, split=test.name))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return done


# ------------------------------------------------------------------------------------------------------- scoring
def _sharpe_summary() -> Any:
    """``evaluation.significance.sharpe_summary`` when that module exists (None otherwise)."""
    try:
        from foxhunt.evaluation.significance import sharpe_summary
    except ImportError:
        return None
    return sharpe_summary


SIGNIFICANCE = ("sharpe_se", "sharpe_ci_low", "sharpe_ci_high", "psr_vs_flat", "psr_vs_benchmark")


def _score(positions: dict[str, torch.Tensor], split: MarketSplit, cost_bps: float, bars_per_year: float,
           significance: bool = True, n_boot: int | None = None) -> dict[str, dict[str, float]]:
    """Back-test metrics of every policy on a split and, with ``significance`` where ``evaluation.significance``
    exists, the significance of each Sharpe ratio (``SIGNIFICANCE``: standard error, 95% stationary-bootstrap interval
    of ``n_boot`` replicates, PSR against flat and against buy-and-hold), under the names the back-test tables use."""
    from foxhunt.evaluation.backtest import policy_metrics, policy_pnl

    metrics = policy_metrics(positions, split, cost_bps, bars_per_year)
    summary = _sharpe_summary()
    if summary is None or not significance:
        return metrics
    benchmark = policy_pnl(positions["buy_and_hold"], split, cost_bps) if "buy_and_hold" in positions else None
    if n_boot is None:  # 1000 replicates, fewer (not under 200) on long series: bounded work
        n_boot = max(200, min(1000, int(2e7 // max(int(split.valid.sum()), 1))))
    for policy, p in positions.items():
        stats = summary(policy_pnl(p, split, cost_bps), bars_per_year, benchmark_pnl=benchmark, n_boot=n_boot, seed=0)
        metrics[policy].update({key: float(stats[key]) for key in SIGNIFICANCE})
    return metrics


def _own_account(positions: dict[str, torch.Tensor], split: MarketSplit,
                 close_after: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], MarketSplit]:
    """One fold's stretch as an account of its own, flat before its first bar and after its last: each symbol's
    rows get one more row after them that is no decision bar (no return, position flat), so a position still held at
    the stretch's last bar (whose return runs into the next fold) is closed and its cost counted there, as
    ``counted_log_returns`` counts every exit. ``close_after`` [T] (bool) closes the account after those rows too
    (before a gap: a fold not gathered). Decision bars, and so every per-bar figure's bar count, are unchanged."""
    from dataclasses import fields, replace

    n = len(split)
    if n == 0:
        return positions, split
    last = split.last_bar
    if close_after is not None:
        last |= close_after
    rows = torch.cat([torch.arange(n), last.nonzero().squeeze(1)])
    order = torch.argsort(rows, stable=True)  # each extra row right after its symbol's last row
    rows, extra = rows[order], (order >= n)
    picked = {f.name: getattr(split, f.name)[rows] for f in fields(split) if isinstance(getattr(split, f.name), torch.Tensor)}
    closed = replace(split, **picked)
    closed.returns = torch.where(extra, torch.full_like(closed.returns, float("nan")), closed.returns)
    closed.valid = closed.valid & ~extra
    held = {p: v[rows.to(v.device)] for p, v in positions.items()}
    return {p: torch.where(extra.to(v.device), torch.zeros_like(v), v) for p, v in held.items()}, closed


# -------------------------------------------------------------------------------------------------------- gather
@dataclass
class OutOfSample:
    """The finished folds' out-of-sample positions as one series ordered by (symbol, time)."""

    split: MarketSplit
    positions: dict[str, torch.Tensor]
    fold: torch.Tensor  # [T] int64: the fold each row was traded by
    done: list[dict[str, Any]]


def load_out_of_sample(out: Path, layout: dict[str, Any] | None = None) -> OutOfSample:
    """Concatenate the finished folds' positions (in time, per symbol); refuses folds from another layout and
    overlapping rows."""
    from safetensors.torch import load_file

    from foxhunt.data.market import MarketSplit

    layout = read_layout(out) if layout is None else layout
    parts, done = [], []
    for fold in folds_of(layout):
        where = fold_dir(out, fold.index)
        if not (where / DONE).exists():
            continue
        meta = json.loads((where / DONE).read_text())
        if meta["cuts"] != asdict(fold) or meta["fingerprint"] != layout["fingerprint"]:
            raise WalkForwardError(f"{where}: this fold was run with other cuts or another fit config than {out / LAYOUT}")
        parts.append(load_file(str(where / meta["positions"])))
        done.append(meta)
    if not done:
        raise WalkForwardError(f"{out}: no finished fold to gather")
    symbols, policies, cost = done[0]["symbols"], done[0]["policies"], done[0]["cost_bps"]
    for meta in done[1:]:
        if meta["symbols"] != symbols or meta["policies"] != policies or meta["cost_bps"] != cost:
            raise WalkForwardError(f"{out}: folds differ in symbols, policies or cost ({meta['fold']} vs {done[0]['fold']})")
    cat = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    fold_id = torch.cat([torch.full((len(p["timestamps"]),), m["fold"], dtype=torch.int64) for p, m in zip(parts, done, strict=True)])
    order = torch.argsort(cat["timestamps"], stable=True)
    order = order[torch.argsort(cat["symbol_index"][order], stable=True)]
    cat = {name: t[order] for name, t in cat.items()}
    ts, sym = cat["timestamps"], cat["symbol_index"]
    if len(ts) > 1 and bool(((ts[1:] == ts[:-1]) & (sym[1:] == sym[:-1])).any()):
        raise WalkForwardError(f"{out}: folds' test stretches overlap")
    split = MarketSplit(
        name=f"walk-forward out-of-sample, folds {', '.join(str(m['fold']) for m in done)} of {len(layout['folds'])}",
        symbols=list(symbols), timestamps=ts, symbol_index=sym, ohlcv=cat["ohlcv"], returns=cat["returns"],
        targets=torch.nan_to_num(cat["returns"]), valid=cat["valid"].bool(),
    )
    positions = {p: cat[f"position.{p}"] for p in policies}
    return OutOfSample(split, positions, fold_id[order], done)


def gather(out: Path, figure: bool = True, n_boot: int | None = None) -> dict[str, Any]:
    """One table (and equity figure) of the finished folds' concatenated out-of-sample positions, with per-fold
    rows; written to ``walkforward.json`` (and ``equity.png``) in ``out``, printed and returned (NaN as None)."""
    from foxhunt.evaluation.backtest import COLUMNS, format_table

    layout = read_layout(out)
    oos = load_out_of_sample(out, layout)
    cost, bpy = oos.done[0]["cost_bps"], layout["bars_per_year"]
    # a fold not gathered is a gap in the account: what was held before it is sold there, and bought again after it
    gap = torch.zeros(len(oos.split), dtype=torch.bool)
    gap[:-1] = (oos.fold[1:] > oos.fold[:-1] + 1) & (oos.split.symbol_index[1:] == oos.split.symbol_index[:-1])
    overall = _score(*_own_account(oos.positions, oos.split, gap), cost, bpy, n_boot=n_boot)
    per_fold = []
    for meta in oos.done:
        rows = oos.fold == meta["fold"]
        split = oos.split.select(rows)
        metrics = _score(*_own_account({p: v[rows] for p, v in oos.positions.items()}, split), cost, bpy, n_boot=n_boot)
        for policy, m in metrics.items():
            m.update({key: meta["metrics"][policy][key] for key in ("updates", "weight") if key in meta["metrics"][policy]})
        per_fold.append({**meta["cuts"], "fold": meta["fold"], "bars": len(split), "decision_bars": int(split.valid.sum()),
                         "first": _iso(int(split.timestamps.min())), "last": _iso(int(split.timestamps.max())),
                         "policies": metrics})
    missing = [f.index for f in folds_of(layout) if not is_done(out, f.index)]
    table = {
        "folds": len(layout["folds"]),
        "gathered": [m["fold"] for m in oos.done],
        "missing": missing,
        "mode": layout["mode"],
        "cost_bps": cost,
        "bars_per_year": bpy,
        "bars": len(oos.split),
        "decision_bars": int(oos.split.valid.sum()),
        "significance": _sharpe_summary() is not None,
        "policies": overall,
        "per_fold": per_fold,
    }
    table = _finite(table)  # NaN (no Sharpe, no hit rate) as null, in the file and the returned table alike
    _write_json(out / TABLE, table)
    if figure:
        _equity_figure(oos, cost).savefig(out / FIGURE, dpi=110)
    print("\n" + format_table(overall, split=oos.split.name))
    if table["significance"] and not any(key == "sharpe_se" for key, *_ in COLUMNS):  # else the table shows it
        print("\n" + format_significance(overall))
    print("\n" + format_folds(per_fold))
    if missing:
        print(f"\nnot finished yet: folds {missing}")
    print(f"\nwrote {out / TABLE}" + (f" and {out / FIGURE}" if figure else ""))
    return table


def _finite(value: Any) -> Any:
    """NaN and infinities as null (JSON has none)."""
    from foxhunt.files import json_safe

    return json_safe(value)


def _equity_figure(oos: OutOfSample, cost_bps: float) -> Any:
    from foxhunt.evaluation.figures import equity_figure

    fig = equity_figure(oos.positions, oos.split, cost_bps)
    starts = torch.nonzero((oos.fold[1:] != oos.fold[:-1]) & (oos.split.symbol_index[1:] == oos.split.symbol_index[:-1]))
    for ax in fig.axes:
        for row in (starts.squeeze(1) + 1).tolist():
            ax.axvline(row, color="0.4", lw=0.8, ls=":")
    fig.axes[0].set_title("walk-forward: each fold's export trades its own test stretch (dotted: fold boundaries)",
                          fontsize=9)
    return fig


def _cell(v: Any, fmt: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def format_significance(metrics: dict[str, dict[str, Any]]) -> str:
    """Each policy's Sharpe ratio with its standard error, 95% interval and probabilistic Sharpe ratios."""
    cols = (("sharpe", "Sharpe", "{:+.2f}"), ("sharpe_se", "s.e.", "{:.2f}"), ("sharpe_ci_low", "CI low", "{:+.2f}"),
            ("sharpe_ci_high", "CI high", "{:+.2f}"), ("psr_vs_flat", "PSR vs flat", "{:.3f}"),
            ("psr_vs_benchmark", "PSR vs B&H", "{:.3f}"))
    head = f"{'policy':<22}" + "".join(f"{label:>13}" for _, label, _ in cols)
    rows = ["significance of the Sharpe ratios (95% stationary-bootstrap interval; PSR: probability the true Sharpe "
            "exceeds flat's 0 / buy-and-hold's)", head, "-" * len(head)]
    for who, m in metrics.items():
        rows.append(f"{who:<22}" + "".join(f"{_cell(m.get(key), fmt):>13}" for key, _, fmt in cols))
    return "\n".join(rows)


def format_folds(per_fold: list[dict[str, Any]]) -> str:
    """One row per fold: its test stretch and every policy's Sharpe ratio on it."""
    policies = list(per_fold[0]["policies"]) if per_fold else []
    head = f"{'fold':<5}{'test stretch (UTC)':<36}{'bars':>7}" + "".join(f"{p[:13]:>14}" for p in policies)
    rows = ["Sharpe ratio per fold (each fold's own test stretch)", head, "-" * len(head)]
    for f in per_fold:
        span = f"{f['first'][:16]} .. {f['last'][:16]}"
        rows.append(f"{f['fold']:<5}{span:<36}{f['bars']:>7}"
                    + "".join(f"{_cell(f['policies'][p].get('sharpe'), '{:+.2f}'):>14}" for p in policies))
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m foxhunt.walkforward",
        description="Walk-forward test of a foxhunt.fit config: train on each fold's past, trade its unseen test "
                    "stretch with its export, and score the concatenated out-of-sample positions. Arguments after "
                    "'--' are foxhunt.fit overrides (e.g. -- --trainer.max_epochs 3).",
    )
    p.add_argument("--config", help="foxhunt.fit config YAML (not needed with --gather)")
    p.add_argument("--folds", type=int, default=None, help="number of folds (test stretches); not needed with --gather")
    p.add_argument("--mode", choices=["expanding", "rolling"], default="expanding",
                   help="training window: everything before the test stretch, or a fixed length (the initial stretch's)")
    p.add_argument("--initial_fraction", type=float, default=None,
                   help="share of the data before the first test stretch (default 1/(folds+1): equal stretches)")
    p.add_argument("--val_fraction", type=float, default=None,
                   help="share of each training window kept for validation (default: the config's "
                        "val_fraction / (train_fraction + val_fraction))")
    p.add_argument("--out", default=None, help="output directory (default: runs/walkforward/<config name>)")
    p.add_argument("--fold", type=int, default=None, help="run this fold only (skipped if finished); no gathering")
    p.add_argument("--gather", action="store_true", help="train nothing: gather the finished folds into the table")
    p.add_argument("--no_figure", action="store_true", help="skip the equity figure")
    p.add_argument("--n_boot", type=int, default=None,
                   help="bootstrap replicates of each Sharpe interval (default 1000, fewer on long series)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the walk-forward (or one fold, or only the gathering); returns the table (or the fold's done.json)."""
    import sys

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    parser = _parser()
    args = parser.parse_args(argv)
    if args.out is None and args.config is None:
        parser.error("give --config (or --out with --gather)")
    out = Path(args.out) if args.out else Path("runs") / "walkforward" / Path(args.config).stem
    if args.gather:
        return gather(out, figure=not args.no_figure, n_boot=args.n_boot)
    if args.config is None or args.folds is None:
        parser.error("--config and --folds are needed to run folds")
    fit = _FitConfig(args.config, overrides)
    layout = settle_layout(out, make_layout(fit, args.folds, args.mode, args.initial_fraction, args.val_fraction))
    if args.fold is not None:
        if not 0 <= args.fold < args.folds:
            parser.error(f"--fold must lie in 0..{args.folds - 1}, got {args.fold}")
        return run_fold(fit, layout, args.fold, out)
    for k in range(args.folds):
        run_fold(fit, layout, k, out)
    return gather(out, figure=not args.no_figure, n_boot=args.n_boot)


if __name__ == "__main__":
    import sys

    sys.exit(run_command(main))
