"""foxhunt's DQN against Stable-Baselines3's DQN on the same trading task, in one run, side by side.

Same task semantics for both: observation = the last W rows of the features flattened, plus the one-hot held
position; actions short/flat/long; reward = scale·(position·r − cost·|Δposition|) with the same scale; episodes of
the same length starting flat at random bars. Same learner settings: the same MLP (128-128 ReLU, no LayerNorm,
unless --layer-norm), batch size, γ, learning rate, Adam without weight decay, Polyak τ every 4 updates (SB3's
target_update_interval), ε schedule fraction, gradient clipping (10), replay warm-up (16,384 transitions) and
number of gradient updates. SB3 steps one gymnasium env with train_freq 4 (its usual setting); foxhunt, driven by
a Lightning Trainer (its wall time includes the Trainer's start), steps 1024 agents before every 8th update
(--n-envs, --env-step-every: 128 new transitions per update) with a cosine schedule.
It runs three target modes: all_actions (foxhunt's default: Double DQN targets for every action of a sampled state,
three targets per sample), none (Double DQN on the taken action: one more network pass per update than SB3) and dqn
(plain DQN targets on the taken action: SB3's algorithm and work per update).
All greedy policies are scored on the test split with the same vectorised back-test, as a fraction of the
best causal oracle's reward per bar after costs (scripts/dqn_quality.py).
Speed is reported per wall second and per CPU second of the process (both learners run on one thread): on a
shared machine, wall time also counts time taken by other processes, CPU time does not.

    pip install stable-baselines3 gymnasium            # the optional "bench" extra
    python scripts/bench_dqn.py --updates 10000 --phi 0.1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dqn_quality import (
    BARS_PER_YEAR,
    ar1_market,
    baseline_metrics,
    best_causal_oracle,
    train_dqn,
)

from foxhunt.evaluation.trading import trading_metrics
from foxhunt.rl.env import MarketEnv, MarketTensors, greedy_positions


def make_gym_env(market: MarketTensors, episode_length: int, seed: int):
    """A gymnasium env with the semantics of foxhunt's MarketEnv (one agent, numpy, SB3's usual interface)."""
    import gymnasium as gym

    starts = MarketEnv(market, n_envs=1, episode_length=episode_length).starts.numpy()
    feats = market.features.numpy()
    signal = market.signal.numpy().astype(np.float64)
    actions = market.actions.numpy().astype(np.float64)
    cost, scale, w, n_act, flat = market.signal_cost, market.reward_scale, market.window, market.n_actions, market.flat_index

    class MarketGymEnv(gym.Env):
        observation_space = gym.spaces.Box(-np.inf, np.inf, (w * feats.shape[1] + n_act,), np.float32)
        action_space = gym.spaces.Discrete(n_act)

        def __init__(self) -> None:
            self.rng = np.random.default_rng(seed)
            self.t = self.pos = self.k = 0

        def _obs(self) -> np.ndarray:
            onehot = np.zeros(n_act, np.float32)
            onehot[self.pos] = 1.0
            return np.concatenate([feats[self.t - w + 1 : self.t + 1].ravel(), onehot])

        def reset(self, *, seed=None, options=None):
            if seed is not None:
                self.rng = np.random.default_rng(seed)
            self.t, self.pos, self.k = int(starts[self.rng.integers(len(starts))]), flat, 0
            return self._obs(), {}

        def step(self, action):
            a = int(action)
            reward = scale * (actions[a] * signal[self.t] - cost * abs(actions[a] - actions[self.pos]))
            self.t, self.pos, self.k = self.t + 1, a, self.k + 1
            return self._obs(), float(reward), False, self.k >= episode_length, {}

    return MarketGymEnv()


def score(positions: torch.Tensor, market: MarketTensors, oracle: float) -> tuple[float, float, float]:
    m = trading_metrics(positions, market.returns, market.cost_bps, BARS_PER_YEAR, mask=market.decision, reset=market.reset_mask)
    return float(m.reward_per_bar) / oracle, float(m.reward_per_bar), float(m.turnover)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=10_000)
    p.add_argument("--phi", type=float, default=0.1)
    p.add_argument("--n-bars", type=int, default=500_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--env-step-every", type=int, default=8,
                   help="foxhunt steps its agents before every k-th update (n agents: n/k transitions per update)")
    p.add_argument("--n-envs", type=int, default=1024, help="foxhunt's parallel agents")
    p.add_argument("--modes", default="all_actions,none,dqn",
                   help="foxhunt's target modes: all_actions (Double DQN targets for every action of a sampled state), "
                        "none (Double DQN on the taken action), dqn (plain DQN targets on the taken action: SB3's "
                        "algorithm, the same work per update)")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--layer-norm", action="store_true", help="foxhunt's default LayerNorm (SB3's MLP has none)")
    p.add_argument("--no-double", action="store_true", help="foxhunt with plain DQN targets (SB3's)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="foxhunt's AdamW decay (SB3's Adam has none)")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (medians are reported)")
    p.add_argument("--skip-sb3", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = ar1_market(n_bars=args.n_bars, phi=args.phi, seed=args.seed)
    common = {"batch_size": args.batch_size, "hidden": (128, 128), "gamma": 0.9, "lr": 3e-4, "tau": 0.005, "window": args.window,
              "layer_norm": args.layer_norm, "double_dqn": not args.no_double, "weight_decay": args.weight_decay,
              "polyak_every": 4}

    modes = args.modes.split(",")
    rows: dict[str, list[tuple]] = {}
    for rep in range(args.repeats):
        # Each repeat runs every learner once, in the same order: on a shared machine the timings drift, so the
        # figures reported are medians over repeats (and the ratios medians of per-repeat ratios).
        for mode in modes:
            overrides = dict(common, exogenous="none" if mode == "dqn" else mode)
            if mode == "dqn":
                overrides["double_dqn"] = False  # SB3's algorithm exactly: max_a Q_target(s', a)
            cpu0 = time.process_time()
            module, fox_s = train_dqn(
                data, args.updates, seed=args.seed, env_step_every=args.env_step_every, n_envs=args.n_envs,
                **overrides,
            )
            fox_cpu = time.process_time() - cpu0
            hp = module.hparams
            test = MarketTensors(data.test, hp.window, tuple(hp.actions), hp.cost_bps)
            oracle = best_causal_oracle(baseline_metrics(test, data.expected["test"]))
            fox_pos, _ = module.greedy_positions(test)
            rows.setdefault(f"foxhunt/{mode}", []).append(
                (module.env_steps, args.updates, fox_s, *score(fox_pos, test, oracle), fox_cpu)
            )
        if not args.skip_sb3:
            rows.setdefault("sb3", []).append(run_sb3(data, module, test, oracle, args))
        print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1][1] / v[-1][2]:.0f} updates/s" for k, v in rows.items()))

    print(f"\nphi={args.phi} batch={args.batch_size} updates={args.updates} threads={args.threads} "
          f"repeats={args.repeats} (medians) oracle reward/bar={oracle:.3e}")
    print(f"{'':22s}{'env steps':>12s}{'updates':>10s}{'wall s':>9s}{'CPU s':>8s}{'env steps/s':>14s}{'updates/s':>11s}"
          f"{'upd/CPU-s':>11s}{'frac oracle':>13s}{'reward/bar':>13s}{'turnover':>10s}")
    for name, runs in rows.items():
        steps, updates, _, frac, rpb, turn, _ = runs[0]
        secs = statistics.median(r[2] for r in runs)
        cpu = statistics.median(r[6] for r in runs)
        print(f"{name:22s}{steps:12d}{updates:10d}{secs:9.1f}{cpu:8.1f}{steps / secs:14.0f}{updates / secs:11.1f}"
              f"{updates / cpu:11.1f}{frac:13.3f}{rpb:13.3e}{turn:10.3f}")
    if "sb3" in rows:
        sb3 = rows["sb3"]
        for name, runs in rows.items():
            if name == "sb3":
                continue
            env_x = statistics.median((f[0] / f[2]) / (s[0] / s[2]) for f, s in zip(runs, sb3))
            upd_x = [(f[1] / f[2]) / (s[1] / s[2]) for f, s in zip(runs, sb3)]
            cpu_x = [(f[1] / f[6]) / (s[1] / s[6]) for f, s in zip(runs, sb3)]
            print(f"ratio {name}/sb3: env steps/s x{env_x:.1f}, updates/s x{statistics.median(upd_x):.2f} "
                  f"(per repeat {', '.join(f'{x:.2f}' for x in upd_x)}), updates per CPU-second "
                  f"x{statistics.median(cpu_x):.2f} ({', '.join(f'{x:.2f}' for x in cpu_x)}), "
                  f"fraction of oracle {runs[0][3]:.3f} vs {sb3[0][3]:.3f}")
    if not math.isfinite(oracle) or oracle <= 0:
        print("note: the oracle earns nothing on this market, fractions are meaningless")


def run_sb3(data, module, test: MarketTensors, oracle: float, args: argparse.Namespace) -> tuple:
    """Stable-Baselines3's DQN on the same task and settings: (env steps, updates, seconds, frac, reward/bar, turnover)."""
    from stable_baselines3 import DQN

    hp = module.hparams
    train = MarketTensors(data.train, hp.window, tuple(hp.actions), hp.cost_bps, reward_scale=module.reward_scale_used)
    env = make_gym_env(train, hp.episode_length, args.seed)
    learning_starts = 16_384
    total = learning_starts + 4 * args.updates
    model = DQN(
        "MlpPolicy", env, learning_rate=hp.lr, buffer_size=262_144, learning_starts=learning_starts,
        batch_size=args.batch_size, tau=hp.tau, gamma=hp.gamma, train_freq=4, gradient_steps=1,
        target_update_interval=4, exploration_fraction=0.25, exploration_initial_eps=1.0,
        exploration_final_eps=0.05, max_grad_norm=10.0, policy_kwargs={"net_arch": [128, 128]},
        seed=args.seed, device="cpu",
    )
    t0, cpu0 = time.perf_counter(), time.process_time()
    model.learn(total_timesteps=total)
    sb3_s, sb3_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    q = model.q_net.eval()

    def sb3_q(windows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return q(torch.cat([windows.flatten(1), positions], 1))

    with torch.no_grad():
        sb3_pos = greedy_positions(sb3_q, test)
    return (total, model._n_updates, sb3_s, *score(sb3_pos, test, oracle), sb3_cpu)


if __name__ == "__main__":
    main()
