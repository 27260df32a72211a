"""On-policy rollout storage for PPO: N agents x T steps on the device, GAE(λ), and the epochs of shuffled minibatches.

A step of the exogenous market is described by (bar, position held, action, reward, episode end), as in the replay
buffer: observations are gathered from the split's features when a minibatch is drawn, never copied. Every episode end
of :class:`~foxhunt.rl.env.MarketEnv` is a time limit (a truncation, not a terminal state), so the TD error of an
episode's last step bootstraps from the value of the state after it, and the GAE recursion stops there.

One rollout is used for ``n_epochs`` passes of ``n_minibatches`` shuffled minibatches (a fresh permutation of the N·T
steps per epoch, drawn from the buffer's own generator), unless the caller stops it early (PPO's approximate-KL stop).
Each epoch's minibatches are gathered at once when the epoch begins (and, with ``norm_adv``, their advantages
normalised per minibatch), so taking a minibatch is a row select: at minibatches of 64 steps an update is a few
hundred microseconds, and per-minibatch gathers were a measurable part of it. The caller may also store the network
inputs of every step (:meth:`RolloutBuffer.set_inputs`), gathered with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def generalized_advantages(
    rewards: Tensor, values: Tensor, next_values: Tensor, last: Tensor, gamma: float, lam: float,
    terminated: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GAE(λ) advantages and λ-returns (advantages + values) of [T, N] steps (Schulman et al. 2016).

    ``next_values[t]`` is V of the state after step t: the next step's state, or, where the episode ended after step
    t (``last``, a time limit), the final state it reached (the bootstrap of a truncation), and at t = T−1 the state
    the rollout stopped in. δ_t = r_t + γ·V(s_{t+1})·(1 − terminated_t) − V(s_t);
    A_t = δ_t + γλ·(1 − last_t)·A_{t+1}, with A_T = 0. ``terminated`` (true terminal states: no bootstrap) is for
    environments that have them; the market has none.
    """
    if not rewards.shape == values.shape == next_values.shape == last.shape:
        raise ValueError(f"shapes differ: rewards {tuple(rewards.shape)}, values {tuple(values.shape)}, "
                         f"next_values {tuple(next_values.shape)}, last {tuple(last.shape)}")
    bootstrap = next_values if terminated is None else torch.where(terminated, torch.zeros_like(next_values), next_values)
    deltas = rewards + gamma * bootstrap - values
    carry = gamma * lam * (~(last if terminated is None else last | terminated)).to(values.dtype)
    advantages = torch.empty_like(values)
    running = torch.zeros_like(values[0])
    for t in range(values.shape[0] - 1, -1, -1):
        running = deltas[t] + carry[t] * running
        advantages[t] = running
    return advantages, advantages + values


@dataclass
class RolloutBatch:
    """One minibatch of rollout steps (rows of the flattened [T·N] rollout)."""

    bars: Tensor  # bar of the decision
    held: Tensor  # position held coming into the bar: action index (discrete) or value (continuous)
    actions: Tensor  # action index (discrete) or the pre-squash Gaussian sample u (continuous)
    noise: Tensor  # continuous: the standard normal draw behind u (u = mean + std·noise); discrete: zeros
    log_probs: Tensor  # log π_old(action | state)
    values: Tensor  # V_old(state)
    advantages: Tensor  # normalised per minibatch when the rollout was finished with norm_adv
    returns: Tensor  # λ-returns: the critic's targets
    inputs: Tensor | None = None  # the network inputs of the steps, if the caller stored them (set_inputs)


class RolloutBuffer:
    """T steps of N agents, their GAE, and the minibatch schedule over them (see the module docstring)."""

    _FLOATS = ("noise", "log_probs", "values", "advantages", "returns", "rewards")

    def __init__(self, n_steps: int, n_envs: int, continuous: bool = False, device: torch.device | str = "cpu",
                 seed: int = 0) -> None:
        if n_steps < 1 or n_envs < 1:
            raise ValueError(f"n_steps and n_envs must be >= 1, got {n_steps}, {n_envs}")
        self.n_steps, self.n_envs, self.continuous = int(n_steps), int(n_envs), bool(continuous)
        shape = (self.n_steps, self.n_envs)
        action_dtype = torch.float32 if continuous else torch.int64
        self.bars = torch.zeros(shape, dtype=torch.int64, device=device)
        self.held = torch.zeros(shape, dtype=action_dtype, device=device)
        self.actions = torch.zeros(shape, dtype=torch.float32 if continuous else torch.int64, device=device)
        self.last = torch.zeros(shape, dtype=torch.bool, device=device)
        for name in self._FLOATS:
            setattr(self, name, torch.zeros(shape, dtype=torch.float32, device=device))
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int(seed))
        self.filled = False  # a complete rollout with advantages is stored
        # the minibatch schedule over the stored rollout
        self.n_epochs = self.n_minibatches = 0
        self.epoch = 0  # epochs begun
        self.cursor = 0  # minibatches taken in the current epoch
        self.permutation: Tensor | None = None
        self.stopped = False  # the caller ended the rollout's use early
        self.norm_adv = False
        self.inputs: Tensor | None = None  # [T·N, D] network inputs of the stored steps (derived, never saved)
        self._epoch: tuple[Tensor, Tensor, Tensor | None] | None = None  # this epoch's minibatches, gathered

    @property
    def size(self) -> int:
        return self.n_steps * self.n_envs

    @property
    def device(self) -> torch.device:
        return self.bars.device

    def add(self, t: int, bars: Tensor, held: Tensor, actions: Tensor, log_probs: Tensor, rewards: Tensor,
            last: Tensor, noise: Tensor | None = None) -> None:
        """Store step ``t`` of every agent (``actions``: indices, or the pre-squash samples u when continuous)."""
        self.bars[t], self.held[t], self.actions[t] = bars, held, actions
        self.log_probs[t], self.rewards[t], self.last[t] = log_probs, rewards, last
        if noise is not None:
            self.noise[t] = noise
        self.filled = False

    def finish(self, values: Tensor, next_values: Tensor, gamma: float, lam: float, n_epochs: int,
               n_minibatches: int, norm_adv: bool = False, inputs: Tensor | None = None) -> None:
        """Advantages and returns from the critic's values of every state and successor ([T, N] each); the rollout is
        then served as ``n_epochs`` epochs of ``n_minibatches`` shuffled minibatches, their advantages normalised
        per minibatch if ``norm_adv``, with the steps' network ``inputs`` ([T·N, D], optional) beside them."""
        if self.size % n_minibatches:
            raise ValueError(f"{self.size} rollout steps do not split into {n_minibatches} equal minibatches")
        self.values = values.float()
        self.advantages, self.returns = generalized_advantages(self.rewards, self.values, next_values.float(),
                                                               self.last, gamma, lam)
        self.n_epochs, self.n_minibatches, self.norm_adv = int(n_epochs), int(n_minibatches), bool(norm_adv)
        self.epoch, self.cursor, self.permutation, self.stopped = 0, 0, None, False
        self.filled = True
        self._pack()
        self.set_inputs(inputs)

    def set_inputs(self, inputs: Tensor | None) -> None:
        """Store the network inputs of every step (row i of the flattened rollout), or None to have none."""
        if inputs is not None and inputs.shape[0] != self.size:
            raise ValueError(f"inputs have {inputs.shape[0]} rows, the rollout {self.size} steps")
        self.inputs = inputs
        self._gather_epoch()

    def _pack(self) -> None:
        """The minibatch fields as two row tables, integer and float: a minibatch is two gathers, not eight (an update
        of a small network costs about a millisecond, a gather a few microseconds)."""
        ints = [self.bars] if self.continuous else [self.bars, self.held, self.actions]
        floats = [self.noise, self.log_probs, self.values, self.advantages, self.returns]
        floats += [self.held, self.actions] if self.continuous else []
        self._ints = torch.stack(ints, -1).view(self.size, len(ints))
        self._floats = torch.stack(floats, -1).view(self.size, len(floats))

    @property
    def exhausted(self) -> bool:
        """No minibatch is left: nothing stored yet, every epoch used, or stopped early."""
        return not self.filled or self.stopped or (self.epoch >= self.n_epochs and self.at_epoch_end)

    @property
    def at_epoch_end(self) -> bool:
        """The current epoch's minibatches are all taken (or no epoch has begun)."""
        return self.permutation is None or self.cursor >= self.n_minibatches

    def stop(self) -> None:
        """End this rollout's use now (e.g. the approximate KL passed the target); the next call must refill."""
        self.stopped = True

    def next_indices(self) -> Tensor:
        """Flat step indices of the next minibatch; a new epoch draws a new permutation (and gathers its minibatches)."""
        if self.exhausted:
            raise RuntimeError("the rollout is used up: collect a new one")
        if self.at_epoch_end:
            self.permutation = torch.randperm(self.size, generator=self.generator, device=self.device)
            self.epoch += 1
            self.cursor = 0
            self._gather_epoch()
        size = self.size // self.n_minibatches
        idx = self.permutation[self.cursor * size : (self.cursor + 1) * size]  # type: ignore[index]
        self.cursor += 1
        return idx

    def _gather_epoch(self) -> None:
        """This epoch's minibatches as [n_minibatches, size, ...] tables in permutation order (advantages normalised
        per minibatch with ``norm_adv``): one gather per table an epoch instead of one per minibatch."""
        if self.permutation is None or not self.filled:
            self._epoch = None
            return
        shape = (self.n_minibatches, self.size // self.n_minibatches)
        ints = self._ints.index_select(0, self.permutation).view(*shape, -1)  # (index_select: ~2x advanced indexing)
        floats = self._floats.index_select(0, self.permutation).view(*shape, -1)
        if self.norm_adv:
            adv = floats[..., self._ADVANTAGES]
            std, mean = torch.std_mean(adv, dim=1, keepdim=True)
            floats[..., self._ADVANTAGES] = (adv - mean) / (std + 1e-8)
        inputs = None if self.inputs is None else self.inputs.index_select(0, self.permutation).view(*shape, -1)
        self._epoch = (ints, floats, inputs)

    _ADVANTAGES = 3  # the advantages' column in the float table

    def _batch(self, ints: Tensor, floats: Tensor, inputs: Tensor | None) -> RolloutBatch:
        int_cols, float_cols = ints.unbind(-1), floats.unbind(-1)
        noise, log_probs, values, advantages, returns = float_cols[:5]
        bars, held, actions = (int_cols[0], *float_cols[5:]) if self.continuous else int_cols
        return RolloutBatch(bars, held, actions, noise, log_probs, values, advantages, returns, inputs)

    def minibatch(self, idx: Tensor) -> RolloutBatch:
        """The stored steps at flat indices ``idx`` (advantages as stored: not normalised)."""
        return self._batch(self._ints[idx], self._floats[idx], None if self.inputs is None else self.inputs[idx])

    def next_minibatch(self) -> RolloutBatch:
        """The next minibatch of the schedule, from the epoch's gathered tables."""
        self.next_indices()
        assert self._epoch is not None
        k = self.cursor - 1
        ints, floats, inputs = self._epoch
        return self._batch(ints[k], floats[k], None if inputs is None else inputs[k])

    def explained_variance(self) -> float:
        """1 − Var(returns − values) / Var(returns) of the stored rollout (how much of the return the critic explains)."""
        var = self.returns.var()
        return float(1.0 - (self.returns - self.values).var() / var) if float(var) > 0 else float("nan")

    # ------------------------------------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Contents, schedule and generator: a resumed run takes exactly the minibatches an uninterrupted one would."""
        state: dict[str, Any] = {name: getattr(self, name).clone() for name in ("bars", "held", "actions", "last",
                                                                                *self._FLOATS)}
        state.update({
            "filled": self.filled, "n_epochs": self.n_epochs, "n_minibatches": self.n_minibatches, "epoch": self.epoch,
            "norm_adv": self.norm_adv,
            "cursor": self.cursor, "stopped": self.stopped, "rng_state": self.generator.get_state(),
            "permutation": None if self.permutation is None else self.permutation.clone(),
        })
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["bars"].shape) != (self.n_steps, self.n_envs):
            raise ValueError(f"saved rollout is {tuple(state['bars'].shape)} steps x agents, this buffer "
                             f"{(self.n_steps, self.n_envs)}")
        dev = self.device
        for name in ("bars", "held", "actions", "last", *self._FLOATS):
            setattr(self, name, state[name].to(dev))
        self.filled, self.stopped = bool(state["filled"]), bool(state["stopped"])
        self.n_epochs, self.n_minibatches = int(state["n_epochs"]), int(state["n_minibatches"])
        self.norm_adv = bool(state.get("norm_adv", False))
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.permutation = None if state["permutation"] is None else state["permutation"].to(dev)
        self.generator.set_state(state["rng_state"].cpu())
        self.inputs = None  # derived: the caller stores them again (set_inputs)
        if self.filled:
            self._pack()
        self._gather_epoch()
