"""On-device ring buffer of market transitions, stored as bar indices and positions (not observation copies).

A transition of the exogenous market is fully described by (bar, position held, action, reward, episode end): the
observation is a gather into the split's features at sampling time, so memory is O(capacity), not O(capacity·W·F).
Slots are laid out time-major per agent ([slots, n_envs]), so an agent's next transitions sit in the next slots and
n-step returns are a gather along the slot axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields as fields_of

import torch
from torch import Tensor


@dataclass
class ReplaySample:
    """A batch of (n-step) transitions; the bootstrap state is (next_bars, next_positions)."""

    bars: Tensor
    positions: Tensor
    actions: Tensor
    returns: Tensor  # discounted sum of up to n rewards (reward units)
    next_bars: Tensor
    next_positions: Tensor
    discounts: Tensor  # gamma ** (number of rewards summed): the factor on the bootstrap value


    def split(self, size: int) -> list[ReplaySample]:
        """Consecutive batches of ``size`` rows (one large draw serves several updates between environment steps)."""
        fields = [getattr(self, f.name).split(size) for f in fields_of(self)]
        return [ReplaySample(*parts) for parts in zip(*fields)]

    def state_dict(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields_of(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> ReplaySample:
        return cls(**state)

    @staticmethod
    def cat(samples: list[ReplaySample]) -> ReplaySample:
        return ReplaySample(*(torch.cat([getattr(x, f.name) for x in samples]) for f in fields_of(samples[0])))


class ReplayBuffer:
    """Uniform replay over the last ``capacity`` transitions of ``n_envs`` agents (capacity rounded down to N·k)."""

    def __init__(self, capacity: int, n_envs: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        if n_envs < 1:
            raise ValueError(f"n_envs must be >= 1, got {n_envs}")
        if capacity < n_envs:
            raise ValueError(f"replay capacity ({capacity}) must hold at least one step of all {n_envs} agents")
        self.n_envs = int(n_envs)
        self.n_slots = int(capacity) // self.n_envs
        shape = (self.n_slots, self.n_envs)
        self.bars = torch.zeros(shape, dtype=torch.int64, device=device)
        self.positions = torch.zeros(shape, dtype=torch.int8, device=device)
        self.actions = torch.zeros(shape, dtype=torch.int8, device=device)
        self.rewards = torch.zeros(shape, dtype=torch.float32, device=device)
        self.last = torch.zeros(shape, dtype=torch.bool, device=device)
        self.head = 0  # next slot to write
        self.size = 0  # filled slots
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int(seed))

    @property
    def capacity(self) -> int:
        return self.n_slots * self.n_envs

    def __len__(self) -> int:
        return self.size * self.n_envs

    @property
    def device(self) -> torch.device:
        return self.bars.device

    def add(self, bars: Tensor, positions: Tensor, actions: Tensor, rewards: Tensor, last: Tensor) -> None:
        """Store one step of all agents (tensors of shape [n_envs])."""
        i = self.head
        self.bars[i] = bars
        self.positions[i] = positions.to(torch.int8)
        self.actions[i] = actions.to(torch.int8)
        self.rewards[i] = rewards
        self.last[i] = last
        self.head = (i + 1) % self.n_slots
        self.size = min(self.size + 1, self.n_slots)

    def sample(self, batch_size: int, n_step: int = 1, gamma: float = 0.99) -> ReplaySample:
        """Uniformly sample transitions whose next ``n_step`` slots are stored; n-step returns stop at episode ends."""
        if n_step < 1:
            raise ValueError(f"n_step must be >= 1, got {n_step}")
        usable = self.size - n_step + 1
        if usable < 1:
            raise ValueError(f"replay holds {self.size} steps per agent, needs at least {n_step} to sample")
        dev = self.device
        logical = torch.randint(0, usable, (batch_size,), generator=self.generator, device=dev)
        env = torch.randint(0, self.n_envs, (batch_size,), generator=self.generator, device=dev)
        oldest = self.head - self.size
        slot0 = (oldest + logical) % self.n_slots
        flat = slot0 * self.n_envs + env  # one flat index, four 1-D gathers (cheaper than 2-D advanced indexing)
        bars = self.bars.view(-1)[flat]
        positions = self.positions.view(-1)[flat].long()
        actions = self.actions.view(-1)[flat].long()
        if n_step == 1:
            return ReplaySample(
                bars, positions, actions, self.rewards.view(-1)[flat], bars + 1, actions,
                torch.full((batch_size,), gamma, dtype=torch.float32, device=dev),
            )
        k = torch.arange(n_step, device=dev)
        slots = (slot0.unsqueeze(1) + k) % self.n_slots  # [B, n]
        rewards = self.rewards[slots, env.unsqueeze(1)]
        last = self.last[slots, env.unsqueeze(1)]
        # alive[k]: no episode end among the first k steps, so reward k belongs to this transition's episode.
        ended_before = torch.cumsum(last.long(), 1) - last.long()
        alive = ended_before == 0
        powers = gamma ** k.to(torch.float32)
        returns = (rewards * powers * alive).sum(1)
        steps = alive.sum(1)
        final_action = self.actions[slots.gather(1, (steps - 1).unsqueeze(1)).squeeze(1), env].long()
        return ReplaySample(
            bars, positions, actions, returns, bars + steps, final_action,
            torch.pow(torch.full_like(returns, gamma), steps.to(torch.float32)),
        )

    def state_dict(self) -> dict[str, Tensor | int]:
        """Contents, write position and RNG, so a resumed run samples exactly what an uninterrupted one would."""
        return {
            "bars": self.bars.clone(), "positions": self.positions.clone(), "actions": self.actions.clone(),
            "rewards": self.rewards.clone(), "last": self.last.clone(), "head": self.head, "size": self.size,
            "rng_state": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Tensor | int]) -> None:
        bars = state["bars"]
        assert isinstance(bars, Tensor)
        if tuple(bars.shape) != (self.n_slots, self.n_envs):
            raise ValueError(
                f"saved replay buffer has shape {tuple(bars.shape)} (slots, agents), this one {(self.n_slots, self.n_envs)}"
            )
        for name in ("bars", "positions", "actions", "rewards", "last"):
            value = state[name]
            assert isinstance(value, Tensor)
            setattr(self, name, value.to(self.device))
        self.head, self.size = int(state["head"]), int(state["size"])
        rng = state["rng_state"]
        assert isinstance(rng, Tensor)
        self.generator.set_state(rng.cpu())
