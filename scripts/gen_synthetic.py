"""Generate the embedded synthetic market, print its stylised facts, optionally write it; --bench times generation.

    python scripts/gen_synthetic.py --n-bars 200000 --out data/synthetic.dbn.zst
    python scripts/gen_synthetic.py --bench
"""

from __future__ import annotations

import argparse
import time

from foxhunt.data.synthetic import generate_market, oracle_from_bars


def bench(sizes: list[int], repeats: int) -> None:
    """Best-of-``repeats`` wall time of generate_market and of recomputing the oracle from bars."""
    generate_market(1_000)  # warm imports and caches
    print(f"{'bars':>10} {'symbols':>7} {'generate_s':>11} {'bars_per_s':>12} {'oracle_from_bars_s':>19}")
    for n in sizes:
        for k in (1, 3):
            best, best_filter = float("inf"), float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                m = generate_market(n, n_symbols=k)
                best = min(best, time.perf_counter() - t0)
                t0 = time.perf_counter()
                oracle_from_bars(m.bars, m.params)
                best_filter = min(best_filter, time.perf_counter() - t0)
            print(f"{n:>10} {k:>7} {best:>11.3f} {n * k / best:>12,.0f} {best_filter:>19.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-bars", type=int, default=200_000, help="bars per symbol")
    ap.add_argument("--n-symbols", type=int, default=1, help="number of correlated symbols")
    ap.add_argument("--seed", type=int, default=0, help="seed of every random stream")
    ap.add_argument("--signal-strength", type=float, default=0.1, help="AR(1) coefficient of standardised returns")
    ap.add_argument("--correlation", type=float, default=0.5, help="pairwise correlation of the symbols' innovations")
    ap.add_argument("--no-session-gaps", action="store_true", help="bars around the clock, no Globex calendar")
    ap.add_argument("--out", type=str, default=None, help="write bars here (.dbn, .dbn.zst, .csv, .parquet)")
    ap.add_argument("--bench", action="store_true", help="time generation for 200k and 1M bars instead")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per benchmark size (best is reported)")
    args = ap.parse_args()
    if args.bench:
        bench([200_000, 1_000_000], args.repeats)
        return
    t0 = time.perf_counter()
    m = generate_market(
        args.n_bars,
        n_symbols=args.n_symbols,
        seed=args.seed,
        signal_strength=args.signal_strength,
        correlation=args.correlation,
        session_gaps=not args.no_session_gaps,
    )
    print(f"generated {len(m.bars):,} bars in {time.perf_counter() - t0:.3f} s")
    for key, value in m.summary().items():
        print(f"  {key:<26} {value:.4f}" if isinstance(value, float) else f"  {key:<26} {value}")
    if args.out:
        t0 = time.perf_counter()
        path = m.write(args.out)
        print(f"wrote {path} in {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
