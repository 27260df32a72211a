"""Loading speed and peak memory of load_bars for 1,000,000 bars from DBN (plain, zstd), Parquet and CSV.

Each format is timed in a fresh subprocess (one thread), so peak RSS is that load's own: the figure printed is the
process's peak resident memory during the first load minus its resident memory just before it (imports done, file
not yet read), also as a multiple of the returned frame's size.

    python scripts/bench_load.py [--bars 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
import pyarrow as pa
pa.set_cpu_count(1); pa.set_io_thread_count(1)
from foxhunt.data import load_bars
path, repeat = sys.argv[1], int(sys.argv[2])
def status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
def rss_kb():
    return status_kb("VmRSS:")
base = rss_kb()
t0 = time.perf_counter(); bars = load_bars(path); times = [time.perf_counter() - t0]
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent
peak = status_kb("VmHWM:")  # the first load's peak (later repeats reuse freed memory)
out_mb = bars.memory_usage(deep=True).sum() / 2**20
n = len(bars); del bars
for _ in range(repeat - 1):
    t0 = time.perf_counter(); bars = load_bars(path); times.append(time.perf_counter() - t0)
    del bars
print(json.dumps({"n": n, "best_s": min(times), "median_s": sorted(times)[len(times) // 2], "peak_mb": (peak - base) / 1024, "out_mb": out_mb}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bars", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from foxhunt.data import write_bars

    bars = _bars(args.bars)
    out_mb = bars.memory_usage(deep=True).sum() / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for label, name in (("DBN", "b.dbn"), ("DBN+zstd", "b.dbn.zst"), ("Parquet", "b.parquet"), ("CSV", "b.csv")):
            t0 = time.perf_counter()
            files[label] = write_bars(bars, Path(tmp) / name)
            print(f"wrote {label:<9} {files[label].stat().st_size / 2**20:8.1f} MiB in {time.perf_counter() - t0:6.2f} s")
        print(f"\nload_bars, {args.bars:,} bars, 1 thread, best of {args.repeat}; output frame {out_mb:.0f} MiB")
        print(f"{'format':<10}{'seconds':>10}{'bars/s':>16}{'peak MB':>10}{'peak/output':>13}")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        for label, path in files.items():
            res = subprocess.run(
                ["taskset", "-c", "0", sys.executable, "-c", CHILD, str(path), str(args.repeat)]
                if _has_taskset() else [sys.executable, "-c", CHILD, str(path), str(args.repeat)],
                capture_output=True, text=True, env=env, check=True,
            )
            r = json.loads(res.stdout.strip().splitlines()[-1])
            assert r["n"] == args.bars
            print(f"{label:<10}{r['best_s']:>10.3f}{r['n'] / r['best_s']:>16,.0f}{r['peak_mb']:>10.0f}{r['peak_mb'] / r['out_mb']:>13.1f}")


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


def _bars(n: int):
    try:
        from foxhunt.data.synthetic import generate_market

        return generate_market(n_bars=n, seed=0).bars
    except ImportError:  # before the synthetic market exists: a plain random walk
        import numpy as np
        import pandas as pd

        rng = np.random.default_rng(0)
        close = 4000 * np.exp(np.cumsum(rng.normal(0, 5e-4, n)))
        open_ = np.r_[4000.0, close[:-1]]
        return pd.DataFrame({
            "timestamp": pd.date_range("2020-01-01", periods=n, freq="1min", tz="UTC").as_unit("ns"),
            "open": open_, "high": np.maximum(open_, close) * 1.0002, "low": np.minimum(open_, close) * 0.9998,
            "close": close, "volume": rng.integers(1, 500, n).astype(float), "symbol": "ES",
        })


if __name__ == "__main__":
    main()
