"""The agents' trading task as a gymnasium environment with :class:`~foxhunt.rl.env.MarketEnv`'s semantics, so that
a gym learner (Stable-Baselines3's DQN and PPO in the benchmarks) trains on exactly foxhunt's task and rewards.

One agent, numpy observations: the last ``window`` rows of features flattened, then the one-hot held position;
actions are the market's action indices; the reward of every (held position, bar, action) is tabulated once from
:meth:`~foxhunt.rl.env.MarketTensors.rewards_all`, so both learners see the same numbers. Episodes start flat at
the MarketEnv's starts and end by time limit (``truncated``). Needs ``gymnasium`` (the ``bench`` extra).

    env = make_sb3_env(MarketTensors(data.train, window=4), episode_length=256, seed=0)
    stable_baselines3.DQN("MlpPolicy", env).learn(10_000)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from foxhunt.rl.env import MarketEnv, MarketTensors

__all__ = ["make_gym_env", "make_sb3_env"]


def make_gym_env(market: MarketTensors, episode_length: int, seed: int) -> Any:
    """A gymnasium env with the semantics of foxhunt's MarketEnv (one agent, numpy, SB3's usual interface)."""
    import gymnasium as gym

    starts = MarketEnv(market, n_envs=1, episode_length=episode_length).starts.numpy()
    feats = market.features.numpy()
    w, n_act, flat = market.window, market.n_actions, market.flat_index
    # [held, bar, action] training reward, from foxhunt's own reward function: the same reward for both learners
    bars = torch.arange(market.n_bars)
    rewards = torch.stack([market.rewards_all(bars, torch.full_like(bars, p)) for p in range(n_act)]).double().numpy()

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
            reward = rewards[self.pos, self.t, a]
            self.t, self.pos, self.k = self.t + 1, a, self.k + 1
            return self._obs(), float(reward), False, self.k >= episode_length, {}

    return MarketGymEnv()


def make_sb3_env(market: MarketTensors, episode_length: int, seed: int, n_envs: int = 1) -> Any:
    """What SB3's learners train on: one :func:`make_gym_env` (SB3 wraps it itself), or ``n_envs`` of them (seeds
    ``seed``, ``seed + 1``, ..) in a ``DummyVecEnv``, faster than ``SubprocVecEnv`` on 2 cores."""
    if n_envs == 1:
        return make_gym_env(market, episode_length, seed)
    from stable_baselines3.common.vec_env import DummyVecEnv

    return DummyVecEnv([lambda i=i: make_gym_env(market, episode_length, seed + i) for i in range(n_envs)])
