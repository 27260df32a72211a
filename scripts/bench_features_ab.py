"""A/B of two foxhunt checkouts' TA-Lib-derived features against TA-Lib, in alternating processes (issue 19).

Each round runs one process per checkout, in turn. A process imports foxhunt from its checkout and times that
checkout's TA-Lib-derived features (``FeatureSet.compute`` on 1,000,000 bars; tensors in, float32 out) and TA-Lib's 69
equivalent calls (outputs kept), both with freed memory retained (glibc's mallopt, as ``foxhunt.fit`` runs), one
thread, CPU time. It prints best and median of ``--repeat`` runs of each, and the ratio. The bars and TA-Lib's calls
come from scripts/talib_reference.py, which imports no foxhunt module but the synthetic market, so that an old
checkout (one without ``foxhunt.training.memory``, say) runs too.

    git worktree add /tmp/old 123d703          # the numpy backend that the single backend replaced
    python scripts/bench_features_ab.py --other /tmp/old --rounds 3

Measured 2026-12-01, eight alternating pairs over three runs (load 1-2), best-of-runs ratio per process: 123d703
1.90 1.62 1.53 1.65 1.67 1.55 1.66 1.78 (median 1.66x TA-Lib), 823f31d 1.67 1.64 1.56 1.89 1.76 1.70 1.70 1.67
(median 1.69x): level within the run-to-run spread. Then with the compiled loops of foxhunt.features.native (four
pairs, idle machine): this code 1.23 1.11 1.22 1.28 against 823f31d's 1.95 1.72 2.03 1.94 (TA-Lib's calls come from
this checkout's talib_reference.py, so both sides ran without CMO, which this code no longer derives a feature from).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

from talib_reference import make_bars, talib_calls

ROOT = Path(__file__).resolve().parents[1]


def worker(checkout: Path, n: int, repeat: int) -> None:
    """Time one checkout's TA-Lib-derived features and TA-Lib's calls, alternately, in retained memory."""
    sys.path.insert(0, str(checkout))
    import torch

    from foxhunt.features.compute import FeatureSet
    try:
        from foxhunt.features.catalog import REGISTRY
    except ImportError:  # before the single backend
        from foxhunt.features.compute import REGISTRY

    torch.set_num_threads(1)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-4, 0)  # M_MMAP_MAX: no big block mapped alone
    libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD: freed memory kept
    ohlcv, ts, sym = make_bars(n, 0)
    o, h, low, c, v = (ohlcv[:, i].numpy().copy() for i in range(5))
    calls = [fn for _, fn in talib_calls(o, h, low, c, v)]
    names = [k for k, f in REGISTRY.items() if f.talib]
    fs = FeatureSet(names=names)
    fs.compute(ohlcv[:2000], ts[:2000], sym[:2000])
    ours, theirs = [], []
    for _ in range(repeat):
        gc.collect()
        t = time.process_time()
        out = fs.compute(ohlcv, ts, sym)
        ours.append(time.process_time() - t)
        del out
        gc.collect()
        t = time.process_time()
        kept = [fn() for fn in calls]
        theirs.append(time.process_time() - t)
        del kept
    print(f"{checkout}: {len(names)} features; foxhunt best {min(ours):.3f} s, median {statistics.median(ours):.3f}; "
          f"TA-Lib ({len(calls)} calls) best {min(theirs):.3f}, median {statistics.median(theirs):.3f}; ratio best "
          f"{min(ours) / min(theirs):.2f}, median {statistics.median(ours) / statistics.median(theirs):.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", type=Path, required=True, help="the other foxhunt checkout (e.g. a git worktree)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating pairs of processes")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each side inside a process")
    ap.add_argument("--bars", type=int, default=1_000_000)
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.bars, args.repeat)
        return
    for _ in range(args.rounds):
        for checkout in (args.other.resolve(), ROOT):
            subprocess.run([sys.executable, __file__, "--worker", str(checkout), "--bars", str(args.bars),
                            "--repeat", str(args.repeat), "--other", str(args.other)], check=True)


if __name__ == "__main__":
    main()
