"""Does each speed path earn its keep? The whole ``python -m foxhunt.fit`` of a shipped config, the path on and off.

Every row is one shipped config run end to end as users run it (data, features, the Trainer's fit, the export and
the test back-test), once with a fast path on ("on") and once with it off ("off"), each in its own process on one
thread (``--torch_threads 1``, ``OMP_NUM_THREADS=1``), interleaved: every repeat runs every arm of every row once, in
turn, so the shared machine's drift falls on all of them alike. The "on" arm first runs once untimed (compiled
loops built, the feature cache written where the row keeps it). The figures are medians over repeats of the process's
wall time and of its CPU time (children's ``ru_utime + ru_stime``, which a loaded machine does not inflate); the ratio is
the median of the per-repeat off / on ratios. A path stays only where that ratio is at least 1.5 (docs/PERFORMANCE.md).

Rows (``--rows``), each with the shortening in ``ROWS`` so a repeat fits in minutes (a shorter fit pays its fixed
costs, data and features, over fewer steps, which favours a path that speeds those up):

- ``mamba2``: mamba2.yaml; the compiled C block (``native``) against the PyTorch block (the chunked scan through
  autograd);
- ``tft125``: tft.yaml (every feature: ~125 inputs) on 60,000 bars (one epoch of 100 steps and a validation of
  ~9,000 windows: the shipped epoch's 500 steps to ~30,000 windows), evaluated in batches of 128 (at the default
  1,024 the plain path's evaluation is killed for memory on a 24 GiB machine); the fused variable selection
  against the plain grouped GRNs;
- ``memory``: mamba2.yaml at a 1,024-bar lookback; glibc keeping freed memory against the system allocator.

    python scripts/bench_fast_paths.py --repeats 3 --rows mamba2,tft125

The paths that did not earn their keep (docs/PERFORMANCE.md) were measured by this script's rows at the commit
before they were removed; a row exists only for a path that is still here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Arm:
    args: list[str] = field(default_factory=list)  # the switch's setting, as fit arguments


@dataclass
class Row:
    config: str
    common: list[str]
    on: Arm
    off: Arm
    cache: bool = True  # keep the feature cache (written by the untimed run); False: every fit computes its features


ROWS: dict[str, Row] = {
    "mamba2": Row("mamba2.yaml", ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "120"], Arm(),
                  Arm(["--model.members.mamba2.init_args.native", "false"])),
    "tft125": Row("tft.yaml", ["--data.synthetic_bars", "60000", "--trainer.max_epochs", "1",
                               "--trainer.limit_train_batches", "100", "--data.eval_batch_size", "128"], Arm(),
                  Arm(["--model.members.tft.init_args.fused", "false"])),
    "memory": Row("mamba2.yaml", ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "20",
                                  "--data.lookback", "1024", "--data.batch_size", "64"],
                  Arm(), Arm(["--retain_freed_memory", "false"])),
}


def run_fit(row: Row, arm: Arm, workdir: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one fit in a fresh process; (nan, nan) where the fit fails (its error is printed)."""
    argv = ["--config", str(ROOT / "lightning_configs" / row.config), "--torch_threads", "1",
            "--trainer.logger.init_args.save_dir", str(workdir / "runs"), *row.common, *arm.args]
    if not row.cache:
        argv += ["--data.cache_dir", "null"]
    else:
        argv += ["--data.cache_dir", str(workdir / "features")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "FOXHUNT_CACHE": str(workdir / "native"),
           "PYTHONPATH": str(ROOT)}  # this checkout's foxhunt, whatever is installed
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "foxhunt.fit", *argv], cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:  # e.g. killed for memory (-9): the arm is reported as failed, the other rows go on
        print(f"fit failed, exit {done.returncode} ({row.config} {arm.args or 'on'}):\n"
              f"{done.stderr[-1500:]}", flush=True)
        return math.nan, math.nan
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="mamba2,tft125", help="comma-separated rows of ROWS")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (>= 1) after the untimed first run")
    p.add_argument("--json", type=Path, default=None, help="also write every timing here")
    args = p.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1 (a median needs a timing)")
    names = args.rows.split(",")
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; known: {sorted(ROWS)}")
    times: dict[str, dict[str, list[tuple[float, float]]]] = {n: {"on": [], "off": []} for n in names}
    with tempfile.TemporaryDirectory(prefix="foxhunt-bench-") as tmp:
        work = Path(tmp)
        for n in names:  # untimed: build the compiled loops and the feature cache
            t = run_fit(ROWS[n], ROWS[n].on, work)
            print(f"untimed   {n:12s} on  wall {t[0]:7.1f} s  cpu {t[1]:7.1f} s", flush=True)
        for r in range(args.repeats):
            for n in names:
                for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    t = run_fit(ROWS[n], getattr(ROWS[n], side), work)
                    times[n][side].append(t)
                    print(f"repeat {r + 1} {n:12s} {side:3s} wall {t[0]:7.1f} s  cpu {t[1]:7.1f} s", flush=True)
    print(f"\n{'row':12s} | {'on wall s':>9s} | {'off wall s':>10s} | {'off/on wall':>11s} | {'off/on cpu':>10s} | keep")
    print("|".join(["-" * 13, "-" * 11, "-" * 12, "-" * 13, "-" * 12, "-" * 6]))
    for n in names:
        on, off = times[n]["on"], times[n]["off"]
        if any(math.isnan(t[0]) for t in on + off):
            print(f"{n:12s} | failed: {sum(math.isnan(t[0]) for t in on)} on, {sum(math.isnan(t[0]) for t in off)} off")
            continue
        ratio_w = statistics.median(b[0] / a[0] for a, b in zip(on, off))
        ratio_c = statistics.median(b[1] / a[1] for a, b in zip(on, off))
        print(f"{n:12s} | {statistics.median(a[0] for a in on):9.1f} | {statistics.median(b[0] for b in off):10.1f} | "
              f"{ratio_w:11.2f} | {ratio_c:10.2f} | {'yes' if min(ratio_w, ratio_c) >= 1.5 else 'no'}")
    if args.json:
        args.json.write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
