"""The trading environment of the RL member: vectorised market, replay buffer and oracle policies."""

from foxhunt.rl.env import (
    MarketEnv,
    MarketTensors,
    Transition,
    greedy_positions,
    greedy_table,
    rollout_policy_table,
)
from foxhunt.rl.oracle import oracle_positions
from foxhunt.rl.replay import ReplayBuffer, ReplaySample

__all__ = [
    "MarketEnv",
    "MarketTensors",
    "ReplayBuffer",
    "ReplaySample",
    "Transition",
    "greedy_positions",
    "greedy_table",
    "oracle_positions",
    "rollout_policy_table",
]
