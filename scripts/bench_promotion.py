"""The promotion rule's false-promotion rate and power, per method, with their Monte Carlo errors.

Simulated paired streams (``foxhunt.quality.promotion_streams``: a GARCH(1,1) common factor with Student-t(5)
innovations, each strategy's own AR(1) noise at φ = 0.3): under the null every challenger earns the champion's mean
return; with an edge each earns ``--edge`` times the marginal standard deviation of its difference more per bar.
A stream counts as a promotion when the rule promotes some challenger on its bars (a verdict depends only on the
bars, so checking once at the end equals checking at every bar). Monte Carlo error: the binomial standard error
``sqrt(p (1 - p) / streams)``. Measured (1,000 streams, 2,000 bars, seed 0, about 2 minutes on one core):
see docs/STATISTICS.md, "Promotion rule".

    python scripts/bench_promotion.py --streams 1000
"""

from __future__ import annotations

import argparse
import math
import os
import time

from foxhunt.evaluation.promotion import PromotionRule
from foxhunt.quality.promotion_streams import promotion_rate


def rules(min_bars: int, bars: int, alpha: float) -> dict[str, PromotionRule]:
    """The methods compared: the fixed test at min_bars and at the last bar, the sequential test up to the last bar."""
    return {
        f"fixed, horizon {min_bars}": PromotionRule(min_bars=min_bars, alpha=alpha),
        f"fixed, horizon {bars}": PromotionRule(min_bars=min_bars, alpha=alpha, horizon=bars),
        f"sequential, {min_bars}..{bars}": PromotionRule(min_bars=min_bars, alpha=alpha, method="sequential",
                                                        horizon=bars),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1_000, help="simulated streams per cell")
    p.add_argument("--bars", type=int, default=2_000, help="paired bars per stream")
    p.add_argument("--min-bars", type=int, default=500)
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--edge", type=float, default=0.12,
                   help="the planted edge: mean advantage per bar in standard deviations of the difference")
    p.add_argument("--challengers", type=int, nargs="+", default=[1, 3])
    p.add_argument("--phi", type=float, default=0.3, help="AR(1) coefficient of each strategy's own noise")
    p.add_argument("--dof", type=float, default=5.0, help="Student-t degrees of freedom of the innovations")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{args.streams:,} streams of {args.bars:,} bars, AR(1) phi {args.phi}, t({args.dof:g}), alpha {args.alpha}, "
          f"edge {args.edge} sd per bar; rate ± Monte Carlo s.e.")
    head = f"{'method':<26}{'challengers':>12}{'false promotions':>22}{'power':>20}{'seconds':>9}"
    print(head + "\n" + "-" * len(head))
    for k in args.challengers:
        for name, rule in rules(args.min_bars, args.bars, args.alpha).items():
            start = time.perf_counter()
            null = promotion_rate(rule, args.streams, args.bars, 0.0, k, seed=args.seed + 1_000 * k, phi=args.phi,
                                  dof=args.dof)
            power = promotion_rate(rule, args.streams, args.bars, args.edge, k, seed=args.seed + 1_000 * k + 1,
                                   phi=args.phi, dof=args.dof)
            cells = [f"{r:.3f} ± {math.sqrt(r * (1 - r) / args.streams):.3f}" for r in (null, power)]
            print(f"{name:<26}{k:>12}{cells[0]:>22}{cells[1]:>20}{time.perf_counter() - start:>9.1f}")


if __name__ == "__main__":
    main()
