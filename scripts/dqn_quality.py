"""DQN quality on a synthetic market with a planted signal: fraction of the oracle's reward per bar, out of sample.

The market is AR(1) log returns r_t = φ·r_{t−1} + σ·√(1−φ²)·ε_t (one symbol, 1-minute bars), so the conditional
mean known at bar t is m_t = φ·r_{t−1}. The yardstick is the better of the two causal oracles of foxhunt.trading.oracle
("markov": cost-aware value iteration on the binned Markov chain of m; "myopic": one-bar cost hurdle) on the test bars;
the non-causal hindsight DP is printed as an upper bound only.
Features are causal: the last return, the mean of the last 8 returns and the last return over an EWMA volatility,
z-scored with training-split statistics. ``--market synthetic`` uses foxhunt.data.synthetic's generator instead
(GARCH volatility, fat tails, sessions; phi is its signal_strength) with its exact oracle mean.
Chronological split train | val | test with purge gaps. The DQN trains on train, is selected on nothing (the last
weights are tested), and is scored on test against the oracle, flat, a random policy and buy-and-hold. It trains as the
only member of the coordinator (``EnsembleModule(members={"dqn": DQNModule(...)})`` on a ``MarketDataModule``).

    python scripts/dqn_quality.py --phi 0.1 --steps 10000          # weak signal
    python scripts/dqn_quality.py --phi 0.3 --steps 10000          # strong signal
    python scripts/dqn_quality.py --phi 0.0 --steps 10000          # no signal: must not churn
"""

from __future__ import annotations

import argparse
import json

import torch

from foxhunt.quality.agents import run_quality


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phi", type=float, nargs="+", default=[0.1, 0.3, 0.0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--n-bars", type=int, default=500_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exogenous", choices=["none", "all_actions"], default="all_actions")
    p.add_argument("--market", choices=["ar1", "synthetic"], default="ar1",
                   help="ar1: AR(1) returns (phi = coefficient); synthetic: foxhunt.data.synthetic (phi = signal_strength)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the full result dicts as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    keys = ("reward_per_bar", "sharpe", "turnover", "total_log_return", "max_drawdown", "hit_rate")
    for phi in args.phi:
        res = run_quality(phi, args.steps, args.n_bars, args.seed, market=args.market, exogenous=args.exogenous)
        if args.json:
            print(json.dumps(res, indent=1))
        print(f"\nmarket={args.market} phi={phi} steps={args.steps} exogenous={args.exogenous} train {res['train_seconds']:.0f}s "
              f"fraction_of_oracle={res['fraction_of_oracle']:.3f}")
        print(f"{'policy':16s}" + "".join(f"{k:>18s}" for k in keys))
        for name in ("dqn", "oracle_markov", "oracle_myopic", "oracle_hindsight", "flat", "random", "buy_and_hold"):
            print(f"{name:16s}" + "".join(f"{res[name][k]:18.6g}" for k in keys))


if __name__ == "__main__":
    main()
