"""PPO's out-of-sample quality on the agents' task family (foxhunt.quality.agent_tasks, issue 16's), next to
Stable-Baselines3's PPO at its defaults given the same number of environment steps.

Tasks: AR(1)-in-returns with GARCH(1,1) volatility at strengths ``--phis`` and seeds ``--seeds`` (300,000 one-minute
bars, 60% train | 20% val | 20% test, chronological with purge gaps), and the real series ``--real`` (a CSV with
timestamp and close columns, 70% | 15% | 15%; trained at every seed of ``--seeds``, which varies only the learners'
sampling and init). Observation: 32 bars x 3 simple causal features (z-scored on train)
plus the held position; 1 bp cost per unit traded. Per learner, task and seed, on the test split: the fraction of the
best causal oracle's reward per bar after costs (synthetic tasks), the test log return and the turnover
(``foxhunt.quality.agents.task_scores``, the DQN benchmark's scoring).

Learners (``--learners``), each trained on the training split for ``--env-steps`` single-agent environment steps:

- ``ppo``: PPOModule at its defaults (discrete short/flat/long) with a 32-bar window, trained as the one member of the
  coordinator (foxhunt.quality.ppo_runs.train_ppo); ``ppo_continuous`` the same with ``action_space="continuous"``.
  Scored twice: the member's own deterministic policy (``ppo``), and after the coordinator's do-no-harm rule on the
  validation split (``ppo+rule``: held flat unless P(validation edge after costs > 0) >= ``--min-edge-confidence``),
  the rule the DQN benchmark applies;
- ``sb3_ppo``: Stable-Baselines3's PPO at its defaults (MlpPolicy 64-64 tanh, n_steps 2048, batch 64, 10 epochs,
  lr 3e-4, γ 0.99, λ 0.95, clip 0.2; one environment, or ``--sb3-envs`` in a DummyVecEnv, e.g. 8 as the issue's
  speed peer, rows ``sb3_ppo_8envs``) on a gymnasium copy of the same market (scripts/bench_dqn.py's
  ``make_gym_env``: same observation, actions, reward scale, 16-bar episodes, time limits bootstrapped); its
  deterministic policy (argmax) is rolled out over the test split exactly like foxhunt's.

Results are appended as JSON lines to ``--out`` and printed as a table; ``--table FILE ...`` prints earlier results.
Runs one thread.

    pip install 'stable-baselines3>=2.3' 'gymnasium>=0.29'      # the optional "bench" extra, for sb3_ppo
    python scripts/ppo_quality.py --phis 0 0.05 0.1 0.3 --seeds 0 1 --env-steps 131072 --real spy_daily.csv --out q.jsonl
    python scripts/ppo_quality.py --table q.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import replace

import torch

from foxhunt.quality.agent_tasks import (
    SyntheticMarket,
    add_task_family_arguments,
    read_rows,
    record_row,
    score_cell,
    task_family,
)
from foxhunt.quality.agents import task_scores
from foxhunt.quality.ppo_runs import train_ppo, updates_for_env_steps
from foxhunt.rl.env import MarketTensors, greedy_positions, reward_scale_for

WINDOW = 32
COST_BPS = 1.0
LEARNERS = ("ppo", "ppo_continuous", "sb3_ppo")


def scored_on(data: SyntheticMarket, split: str) -> SyntheticMarket:
    """The market with ``split``'s bars in the test slot, for ``task_scores`` (which scores the test split): schedules
    and settings are chosen with ``--score-split val``, and only the chosen ones are scored on test."""
    if split == "test":
        return data
    return replace(data, test=getattr(data, split), expected={**data.expected, "test": data.expected[split]})


def run_ppo(data: SyntheticMarket, env_steps: int, seed: int, space: str, confidence: float | None,
            overrides: dict, split: str = "test") -> list[tuple[str, dict]]:
    """PPO through the coordinator: the member's policy, and the same after the do-no-harm rule on validation, scored
    on ``split``."""
    kwargs = {"window": WINDOW, "action_space": space, **overrides}
    updates = updates_for_env_steps(env_steps, **kwargs)
    ensemble, member, seconds = train_ppo(data, updates, seed=seed, cost_bps=COST_BPS, validate=True,
                                          min_edge_confidence=confidence, **kwargs)
    common = {"seconds": seconds, "env_steps": member.env_steps, "updates": ensemble.updates["ppo"], "split": split}
    scored = scored_on(data, split)
    own = task_scores(member.positions(scored.test), scored, COST_BPS, WINDOW)
    ruled = task_scores(ensemble.positions(scored.test)["ppo"], scored, COST_BPS, WINDOW)
    ruled.update(held_flat=bool(ensemble.held_flat[0]), edge_confidence=float(ensemble.edge_confidence[0]))
    name = "ppo" if space == "discrete" else "ppo_continuous"
    return [(name, {**own, **common}), (f"{name}+rule", {**ruled, **common})]


def run_sb3(data: SyntheticMarket, env_steps: int, seed: int, episode_length: int = 16, n_envs: int = 1) -> dict:
    """Stable-Baselines3's PPO at its defaults for ``env_steps`` steps on ``n_envs`` environments (a DummyVecEnv),
    scored by its deterministic policy."""
    from stable_baselines3 import PPO

    from foxhunt.quality.gym_env import make_sb3_env

    train = MarketTensors(data.train, WINDOW, (-1.0, 0.0, 1.0), COST_BPS)
    train.reward_scale = reward_scale_for(train)  # the members' own rule, given to SB3
    test = MarketTensors(data.test, WINDOW, (-1.0, 0.0, 1.0), COST_BPS)
    model = PPO("MlpPolicy", make_sb3_env(train, episode_length, seed, n_envs), seed=seed, device="cpu")
    t0 = time.perf_counter()
    model.learn(total_timesteps=env_steps)
    seconds = time.perf_counter() - t0
    policy = model.policy.eval()

    def logits(windows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return policy.action_net(policy.mlp_extractor.forward_actor(torch.cat([windows.flatten(1), positions], 1)))

    with torch.no_grad():
        positions = greedy_positions(logits, test)
    return {**task_scores(positions, data, COST_BPS, WINDOW), "seconds": seconds, "env_steps": int(model.num_timesteps)}


def print_table(rows: list[dict]) -> None:
    """One line per task and seed, the learners side by side (fraction of oracle, test log return, turnover)."""
    order = ["ppo", "ppo+rule", "ppo_continuous", "ppo_continuous+rule", "sb3_ppo", "sb3_ppo_8envs"]
    learners = sorted({r["learner"] for r in rows}, key=lambda n: order.index(n) if n in order else len(order))
    by_task: dict[tuple[str, int, int], dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_task[(r["task"], r["seed"], r["env_steps_asked"])][r["learner"]] = r
    print("| task | seed | env steps | " + " | ".join(learners) + " |")
    print("|" + "---|" * (3 + len(learners)))

    for (task, seed, steps), got in sorted(by_task.items()):
        print(f"| {task} | {seed} | {steps:,} | " + " | ".join(score_cell(got.get(n), " (flat)") for n in learners) + " |")
    print("\ncells: fraction of the causal oracle's test reward after costs (synthetic tasks), test log return, turnover"
          " per bar; (flat): held flat by the do-no-harm rule")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_family_arguments(p)
    p.add_argument("--env-steps", type=int, default=131_072, help="environment steps of every learner")
    p.add_argument("--learners", nargs="+", choices=LEARNERS, default=list(LEARNERS))
    p.add_argument("--ppo", type=json.loads, default={}, help="JSON of PPOModule overrides")
    p.add_argument("--sb3-envs", type=int, default=1, help="SB3's environments (1: the most updates per environment "
                   "step, the stronger learner at equal steps; 8: the issue's speed peer); its rows are named "
                   "sb3_ppo, or sb3_ppo_<n>envs")
    p.add_argument("--score-split", choices=("test", "val"), default="test",
                   help="the split PPO is scored on: val to choose settings, test to report the chosen ones")
    args = p.parse_args()
    if args.table:
        print_table(read_rows(args.table))
        return
    torch.set_num_threads(1)
    confidence = None if args.min_edge_confidence < 0 else args.min_edge_confidence
    rows = []
    for task, seed, data in task_family(args):
        for learner in args.learners:
            torch.manual_seed(seed)
            if learner == "sb3_ppo":
                name = "sb3_ppo" if args.sb3_envs == 1 else f"sb3_ppo_{args.sb3_envs}envs"
                results = [(name, run_sb3(data, args.env_steps, seed, n_envs=args.sb3_envs))]
            else:
                space = "continuous" if learner == "ppo_continuous" else "discrete"
                results = run_ppo(data, args.env_steps, seed, space, confidence, dict(args.ppo), args.score_split)
            for name, res in results:
                row = {"learner": name, "task": task, "seed": seed, "env_steps_asked": args.env_steps,
                       "ppo": args.ppo if name.startswith("ppo") else {}, **res}
                rows.append(row)
                record_row(row, args.out)
    print_table(rows)

if __name__ == "__main__":
    main()
