"""PPO quality on a synthetic market with a planted signal, against foxhunt's DQN and Stable-Baselines3's PPO at its
defaults, all given the same number of environment steps; scored out of sample as a fraction of the oracle.

The market is scripts/dqn_quality.py's (foxhunt.lit.agent_quality): AR(1) log returns r_t = φ·r_{t−1} + noise (one
symbol, 1-minute bars), causal features (last return, mean of the last 8, last return over an EWMA volatility)
z-scored on the training split, chronological train | val | test with purge gaps. ``--market synthetic`` uses
foxhunt.data.synthetic's generator (GARCH volatility, fat tails, sessions; φ is its signal_strength).
The yardstick is the better causal oracle's reward per bar after costs on the test bars; nothing is selected on the
validation split (the last weights are tested).

Learners, each trained on the training split for ``--env-steps`` single-agent environment steps:

- ``ppo``: PPOModule as the only member of the coordinator (``EnsembleModule`` + ``MarketDataModule`` + Trainer), at
  its defaults (discrete actions) except ``window`` (``--window``) and any ``--ppo key=value`` overrides;
  ``ppo_continuous`` the same with ``action_space="continuous"`` (``--continuous``);
- ``dqn``: foxhunt's DQN at the configuration of scripts/dqn_quality.py (agent_quality.default_dqn_kwargs), with as
  many updates as make the same environment steps (256 agents stepped per update, after the replay warm-up);
- ``sb3_ppo``: Stable-Baselines3's PPO at its defaults (MlpPolicy 64-64 tanh, n_steps 2048, batch 64, 10 epochs,
  lr 3e-4, γ 0.99, λ 0.95, clip 0.2, one environment), on a gymnasium copy of the same market (scripts/bench_dqn.py's
  ``make_gym_env``: same observation, actions, reward scale, episode length; time limits bootstrapped by both).
  Its deterministic policy (argmax of its logits) is rolled out over the test split exactly like foxhunt's.

    pip install 'stable-baselines3>=2.3' 'gymnasium>=0.29'      # the optional "bench" extra, for sb3_ppo
    python scripts/ppo_quality.py --phi 0.1 0.3 0.0 --env-steps 500000
    python scripts/ppo_quality.py --phi 0.3 --env-steps 200000 --skip-sb3 --continuous
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch

from foxhunt.lit.agent_quality import (
    BARS_PER_YEAR,
    SyntheticMarket,
    ar1_market,
    baseline_metrics,
    best_causal_oracle,
    generator_market,
    train_dqn,
    updates_per_step_for,
)
from foxhunt.rl.env import MarketTensors, greedy_positions

COST_BPS = 1.0
KEYS = ("reward_per_bar", "sharpe", "turnover", "total_log_return", "max_drawdown", "exposure")


def train_ppo(data: SyntheticMarket, env_steps: int, seed: int = 0, **overrides):
    """PPOModule for about ``env_steps`` environment steps (whole rollouts) on ``data.train`` through the coordinator;
    returns (the trained member, seconds)."""
    import lightning as L

    from foxhunt.data.datamodule import MarketDataModule
    from foxhunt.lit.ensemble import EnsembleModule
    from foxhunt.lit.ppo import PPOModule

    probe = PPOModule(**overrides)
    hp = probe.hparams
    rollouts = max(1, round(env_steps / (hp.n_envs * hp.n_steps)))
    updates = rollouts * hp.n_epochs * hp.n_minibatches
    overrides.setdefault("updates_per_step", updates_per_step_for(updates))
    member = PPOModule(seed=seed, **overrides)
    model = EnsembleModule(members={"ppo": member}, cost_bps=COST_BPS)
    dm = MarketDataModule(data.train, None, data.test, steps_per_epoch=math.ceil(updates / member.updates_per_step))
    trainer = L.Trainer(max_steps=updates, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        limit_val_batches=0, num_sanity_val_steps=0)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, datamodule=dm)
    return member, time.perf_counter() - t0


def train_sb3_ppo(train: MarketTensors, env_steps: int, episode_length: int, seed: int = 0):
    """Stable-Baselines3's PPO at its defaults for ``env_steps`` steps; returns (a logits function for
    greedy_positions, seconds)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_dqn import make_gym_env
    from stable_baselines3 import PPO

    model = PPO("MlpPolicy", make_gym_env(train, episode_length, seed), seed=seed, device="cpu")
    t0 = time.perf_counter()
    model.learn(total_timesteps=env_steps)
    seconds = time.perf_counter() - t0
    policy = model.policy.eval()

    def logits(windows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        latent = policy.mlp_extractor.forward_actor(torch.cat([windows.flatten(1), positions], 1))
        return policy.action_net(latent)

    return logits, seconds


def score(positions: torch.Tensor, market: MarketTensors) -> dict[str, float]:
    from foxhunt.evaluation.trading import trading_metrics

    m = trading_metrics(positions, market.returns, market.cost_bps, BARS_PER_YEAR, mask=market.decision,
                        reset=market.reset_mask)
    return {k: float(v) for k, v in m.as_dict().items()}


def run(phi: float, args: argparse.Namespace, overrides: dict) -> dict:
    data = (ar1_market(n_bars=args.n_bars, phi=phi, seed=args.seed) if args.market == "ar1"
            else generator_market(n_bars=args.n_bars, signal_strength=phi, seed=args.seed))
    test = MarketTensors(data.test, args.window, (-1.0, 0.0, 1.0), COST_BPS)
    base = baseline_metrics(test, data.expected["test"], seed=args.seed)
    oracle = best_causal_oracle(base)
    rows: dict[str, dict] = {}
    spaces = ["discrete"] + (["continuous"] if args.continuous else [])
    for space in spaces:
        member, seconds = train_ppo(data, args.env_steps, args.seed, window=args.window, action_space=space, **overrides)
        name = "ppo" if space == "discrete" else "ppo_continuous"
        rows[name] = {**member.evaluate(data.test, BARS_PER_YEAR), "seconds": seconds, "env_steps": member.env_steps}
    if not args.skip_dqn:
        updates = max(16, (args.env_steps - 16_384) // 256 // 16 * 16)
        dqn, seconds = train_dqn(data, updates, seed=args.seed, window=args.window)
        rows["dqn"] = {**dqn.evaluate(data.test, BARS_PER_YEAR), "seconds": seconds, "env_steps": dqn.env_steps}
    if not args.skip_sb3:
        train = MarketTensors(data.train, args.window, (-1.0, 0.0, 1.0), COST_BPS)
        train.reward_scale = 1.0 / float(train.signal[train.decision].std())  # the members' own rule, given to SB3
        episode = overrides.get("episode_length", 16)
        logits, seconds = train_sb3_ppo(train, args.env_steps, episode, args.seed)
        with torch.no_grad():
            positions = greedy_positions(logits, test)
        rows["sb3_ppo"] = {**score(positions, test), "seconds": seconds, "env_steps": args.env_steps}
    for name in rows:
        rows[name]["fraction_of_oracle"] = rows[name]["reward_per_bar"] / oracle if oracle > 0 else float("nan")
    return {"phi": phi, "market": args.market, "env_steps": args.env_steps, "oracle": oracle, "rows": rows, **base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phi", type=float, nargs="+", default=[0.1, 0.3, 0.0])
    p.add_argument("--env-steps", type=int, default=500_000, help="environment steps of every learner")
    p.add_argument("--n-bars", type=int, default=500_000)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--market", choices=["ar1", "synthetic"], default="ar1")
    p.add_argument("--continuous", action="store_true", help="also train the continuous-action PPO")
    p.add_argument("--skip-dqn", action="store_true")
    p.add_argument("--skip-sb3", action="store_true")
    p.add_argument("--ppo", nargs="*", default=[], metavar="KEY=VALUE",
                   help="PPOModule overrides, e.g. gamma=0.9 n_envs=256 (values parsed as JSON, else strings)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the full result dicts as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    overrides = {}
    for item in args.ppo:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    for phi in args.phi:
        res = run(phi, args, overrides)
        if args.json:
            print(json.dumps(res, indent=1))
        print(f"\nmarket={args.market} phi={phi} env_steps={args.env_steps} cost={COST_BPS}bp oracle reward/bar="
              f"{res['oracle']:.3e} overrides={overrides}")
        print(f"{'policy':16s}{'frac oracle':>12s}" + "".join(f"{k:>17s}" for k in KEYS) + f"{'env steps':>11s}{'train s':>9s}")
        for name, row in res["rows"].items():
            print(f"{name:16s}{row['fraction_of_oracle']:12.3f}" + "".join(f"{row[k]:17.6g}" for k in KEYS)
                  + f"{row['env_steps']:11d}{row['seconds']:9.0f}")
        for name in ("oracle_markov", "oracle_myopic", "flat", "random", "buy_and_hold"):
            row = res[name]
            frac = row["reward_per_bar"] / res["oracle"] if res["oracle"] > 0 else float("nan")
            print(f"{name:16s}{frac:12.3f}" + "".join(f"{row[k]:17.6g}" for k in KEYS))


if __name__ == "__main__":
    main()
