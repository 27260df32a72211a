"""The trading environment of the agent members: vectorised market, replay buffer, TD batches and rollouts."""

from foxhunt.rl.env import (
    MarketEnv,
    MarketTensors,
    Transition,
    greedy_positions,
    greedy_table,
)
from foxhunt.rl.replay import ReplayBuffer, ReplaySample

__all__ = [
    "MarketEnv",
    "MarketTensors",
    "ReplayBuffer",
    "ReplaySample",
    "Transition",
    "greedy_positions",
    "greedy_table",
]
