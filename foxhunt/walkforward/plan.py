"""The folds' cut times, and the layout and run directory that every fold of one walk-forward shares."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from foxhunt.cli_errors import UserError
from foxhunt.data.bars import utc_ns
from foxhunt.files import write_json

if TYPE_CHECKING:
    from foxhunt.walkforward.fit_config import FitConfig

log = logging.getLogger("foxhunt.walkforward")

LAYOUT = "layout.json"
DONE = "done.json"


class WalkForwardError(UserError, ValueError):
    """A walk-forward that cannot run or be gathered as asked (a layout that does not fit, mixed runs)."""


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
        inside = timestamps >= utc_ns(self.test_start)
        return inside & (timestamps < utc_ns(self.end)) if self.end is not None else inside

    def data_args(self) -> list[str]:
        """The fold's ``foxhunt.fit`` overrides: BarDataModule's date cuts and the limits of the bars it uses."""
        args = ["--data.start", self.train_start, "--data.val_start", self.val_start, "--data.test_start", self.test_start]
        return args + ["--data.end", self.end] if self.end is not None else args


def iso_utc(ns: int) -> str:
    """UTC nanoseconds as an ISO timestamp (how the layout records its cuts)."""
    import pandas as pd

    return pd.Timestamp(int(ns), tz="UTC").isoformat()


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
        end = iso_utc(int(times[hi])) if hi < n else None
        out.append(Fold(k, iso_utc(int(times[first])), iso_utc(int(times[lo - n_val])), iso_utc(int(times[lo])), end))
    return out


def make_layout(fit: FitConfig, folds: int, mode: str, initial_fraction: float | None,
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
        keep &= ts >= utc_ns(data["start"])
    if data.get("end") is not None:
        keep &= ts < utc_ns(data["end"])
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
        "first_bar": iso_utc(int(ts.min())),
        "last_bar": iso_utc(int(ts.max())),
    }


def settle_layout(out: Path, layout: dict[str, Any]) -> dict[str, Any]:
    """Write the layout to ``out``, or check it equals the one already there (same config, folds and dates)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LAYOUT
    if path.exists():
        old = json.loads(path.read_text())
        finished = [i for i in range(len(old.get("folds", []))) if is_done(out, i)]
        if old != layout and not finished:  # nothing belongs to the old layout yet (e.g. its config was refused)
            log.warning("%s: no fold of the earlier walk-forward finished; its layout is replaced", out)
            write_json(path, layout)
            return layout
        if old != layout:
            diff = sorted(k for k in set(old) | set(layout) if old.get(k) != layout.get(k))
            raise WalkForwardError(
                f"{out} holds a walk-forward with another layout or fit config (differs in {diff}); finished folds would "
                "not belong together. Use another --out, or delete the directory to start over"
            )
        return old
    write_json(path, layout)
    return layout


def read_layout(out: Path) -> dict[str, Any]:
    path = out / LAYOUT
    if not path.exists():
        raise WalkForwardError(f"{out}: no {LAYOUT}; run the walk-forward (or one --fold) there first")
    return json.loads(path.read_text())


def folds_of(layout: dict[str, Any]) -> list[Fold]:
    return [Fold(**f) for f in layout["folds"]]


def fold_dir(out: Path, k: int) -> Path:
    return out / f"fold_{k}"


def is_done(out: Path, k: int) -> bool:
    return (fold_dir(out, k) / DONE).exists()
