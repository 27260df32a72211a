"""Out-of-sample skill of foxhunt's DQN on markets it was never tuned on, next to Stable-Baselines3's DQN (issue 16).

Tasks (foxhunt.quality.agent_tasks): AR(1)-in-returns with GARCH(1,1) volatility at strengths ``--phis`` and seeds
``--seeds`` (300,000 one-minute bars, 60% train | 20% val | 20% test, chronological with purge gaps), and the real
series given by ``--real`` (a CSV with timestamp and close columns; 70% | 15% | 15%). Observation: 32 bars x 3 features
(last return, its absolute value, 16-bar volatility; z-scored on train) plus the held position; actions short / flat /
long; 1 bp cost per unit traded. Per task and seed the script prints, on the test split: the fraction of the best causal
oracle's reward per bar after costs (synthetic tasks), the test log return and the turnover.

Learners (``--learners``), with the same budget of ``--updates`` gradient updates of batch 64:

- ``foxhunt``: ``DQNModule`` at its defaults (window 32, batch 64), trained as the one member of the coordinator; it
  chooses its weights on the validation split, and the coordinator's do-no-harm rule (``--min-edge-confidence``)
  holds it flat when its validation edge after costs is not significant. ``--dqn '{"dropout": 0.0}'`` overrides
  member hyperparameters (the ablations).
- ``sb3``: Stable-Baselines3's ``DQN("MlpPolicy", env)`` at its defaults (a 64-64 MLP, lr 1e-4, train_freq 4,
  hard target syncs every 10,000 steps, ε to 0.05 over the first 10% of steps), batch 64 and 4 x updates environment
  steps (so the same number of updates), on a gymnasium env with the semantics of foxhunt's market and the same
  reward scale; no validation, the last weights are scored.

Results are appended as JSON lines to ``--out`` (one per learner, task and seed) and printed as a table; ``--table
FILE ...`` prints the table of earlier results only. Runs one thread.

    # the real series: https://github.com/DrRobAnthony/market-data, data/SPY.csv, columns date->timestamp (+ symbol)
    python scripts/agent_generalisation.py --phis 0 0.05 0.1 0.3 --seeds 0 1 --real spy_daily.csv --out gen.jsonl
    python scripts/agent_generalisation.py --table gen.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from foxhunt.quality.agent_tasks import (
    SyntheticMarket,
    add_task_family_arguments,
    read_rows,
    record_row,
    score_cell,
    task_family,
)
from foxhunt.quality.agents import task_scores, train_on_task
from foxhunt.rl.env import MarketTensors, greedy_positions, reward_scale_for

WINDOW = 32
COST_BPS = 1.0


def run_foxhunt(data: SyntheticMarket, updates: int, seed: int, confidence: float | None, overrides: dict) -> dict:
    """foxhunt's DQN through the coordinator: weights chosen on validation, then the do-no-harm rule."""
    ensemble, member, seconds = train_on_task(data, updates, seed=seed, cost_bps=COST_BPS,
                                              min_edge_confidence=confidence, **overrides)
    out = task_scores(ensemble.positions(data.test)["dqn"], data, COST_BPS, member.hparams.window)
    out.update(seconds=seconds, updates=ensemble.updates["dqn"], held_flat=bool(ensemble.held_flat[0]),
               edge_confidence=float(ensemble.edge_confidence[0]), selected_update=member.selection.best_update,
               train_reward_per_bar=member.evaluate(data.train)["reward_per_bar"])
    return out


def run_sb3(data: SyntheticMarket, updates: int, seed: int) -> dict:
    """Stable-Baselines3's DQN at its defaults, batch 64, for ``updates`` gradient updates."""
    from stable_baselines3 import DQN

    from foxhunt.quality.gym_env import make_gym_env

    train = MarketTensors(data.train, WINDOW, (-1.0, 0.0, 1.0), COST_BPS)
    train.reward_scale = reward_scale_for(train)
    test = MarketTensors(data.test, WINDOW, (-1.0, 0.0, 1.0), COST_BPS)
    model = DQN("MlpPolicy", make_gym_env(train, 256, seed), batch_size=64, seed=seed, device="cpu")
    t0 = time.perf_counter()
    model.learn(total_timesteps=model.learning_starts + model.train_freq.frequency * updates)
    seconds = time.perf_counter() - t0
    q = model.q_net.eval()

    def sb3_q(windows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return q(torch.cat([windows.flatten(1), positions], 1))

    with torch.no_grad():
        positions = greedy_positions(sb3_q, test)
    out = task_scores(positions, data, COST_BPS, WINDOW)
    out.update(seconds=seconds, updates=int(model._n_updates))
    return out


def print_table(rows: list[dict]) -> None:
    """One line per task and seed, the learners side by side; then the per-learner medians of each task."""
    learners = sorted({r["learner"] for r in rows})
    by_task: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_task[(r["task"], r["seed"])][r["learner"]] = r
    head = "| task | seed | " + " | ".join(f"{n}: frac. of oracle, log return, turnover" for n in learners) + " |"
    print(head)
    print("|" + "---|" * (2 + len(learners)))

    for (task, seed), got in sorted(by_task.items()):
        print(f"| {task} | {seed} | " + " | ".join(score_cell(got.get(n)) for n in learners) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_family_arguments(p)
    p.add_argument("--updates", type=int, default=50_000)
    p.add_argument("--learners", nargs="+", choices=["foxhunt", "sb3"], default=["foxhunt", "sb3"])
    p.add_argument("--dqn", type=json.loads, default={}, help="JSON of DQNModule overrides (ablations)")
    p.add_argument("--name", type=str, default=None, help="the foxhunt learner's name in the table")
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
            if learner == "foxhunt":
                res = run_foxhunt(data, args.updates, seed, confidence, dict(args.dqn))
                name = args.name or "foxhunt"
            else:
                res = run_sb3(data, args.updates, seed)
                name = "sb3"
            row = {"learner": name, "task": task, "seed": seed, "dqn": args.dqn if learner == "foxhunt" else {}, **res}
            rows.append(row)
            record_row(row, args.out)
    print_table(rows)

if __name__ == "__main__":
    main()
