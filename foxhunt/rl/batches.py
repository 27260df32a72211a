"""TD batches for the DQN: replay draws with their parameter-free inputs prepared ahead, several updates at a time.

A replay draw is a set of (bar, position, action, n-step return) rows; the DQN's loss also needs the windows of the
states and successors, one-hot positions, and in the all-actions mode the reward of every action. These cost per
call rather than per row, and the buffer does not change between environment steps, so the batches of all updates
until the next environment step are drawn and prepared in one call (:class:`PresampledBatches`).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from foxhunt.models.qnet import QNetwork
from foxhunt.rl.env import MarketTensors
from foxhunt.rl.replay import ReplayBuffer, ReplaySample


class TDBatch(NamedTuple):
    """A replay batch with the parameter-free inputs of its TD loss."""

    sample: ReplaySample
    windows: Tensor  # [B, W·F] states' windows
    positions: Tensor  # [B, A] one-hot held positions
    next_windows: Tensor  # [B, W·F] successors' windows
    next_positions: Tensor | None  # [B, A]; None: every held position (all-actions mode)
    rewards: Tensor | None  # [B, A] reward of every action (all-actions mode)
    states: Tensor | None  # [B, in] the networks' input rows (flat encoder only)
    successors: Tensor | None  # [B·A, in] or [B, in] successor input rows (flat encoder only)


def prepare_td_batches(
    market: MarketTensors, draw: ReplaySample, batch_size: int, net: QNetwork, all_actions: bool, n_step: int = 1
) -> list[TDBatch]:
    """The draw's TD inputs computed at once, then split into batches of ``batch_size``.

    Rows t-W+1 .. t+1 are gathered once per sample: the state's window is the first W rows, the successor's the last
    W. In the all-actions mode the successors of (t, p) are (t+1, a) for every action a, one input row each.
    """
    n_feat = market.n_features
    both = market.windows(draw.bars, extra=1, flat=True)
    windows, next_windows = both[:, : both.shape[1] - n_feat], both[:, n_feat:]
    if not all_actions and n_step != 1:
        next_windows = market.windows(draw.next_bars, flat=True)
    positions = market.position_features(draw.positions)
    next_positions = None if all_actions else market.position_features(draw.next_positions)
    rewards = market.rewards_all(draw.bars, draw.positions) if all_actions else None
    states = successors = None
    if net.parameter_free_inputs:
        states = net.inputs(windows, positions)
        successors = net.inputs_all_positions(next_windows) if all_actions else net.inputs(next_windows, next_positions)
    per_sample = market.n_actions if all_actions else 1  # successor rows per sample
    samples = draw.split(batch_size)

    def split(x: Tensor | None, rows: int = 1) -> list[Tensor | None]:
        return [None] * len(samples) if x is None else list(x.split(batch_size * rows))

    return [
        TDBatch(*fields)
        for fields in zip(
            samples, split(windows), split(positions), split(next_windows), split(next_positions),
            split(rewards), split(states), split(successors, per_sample), strict=True,
        )
    ]


class PresampledBatches:
    """Replay batches drawn ahead until the next environment step, in order of use (and saved with a checkpoint)."""

    def __init__(self, batch_size: int, n_step: int, gamma: float, all_actions: bool) -> None:
        self.batch_size, self.n_step, self.gamma, self.all_actions = batch_size, n_step, gamma, all_actions
        self._ahead: list[TDBatch] = []

    def clear(self) -> None:
        """New transitions arrived: later batches are drawn afresh."""
        self._ahead = []

    def next(self, replay: ReplayBuffer, market: MarketTensors, net: QNetwork, updates_ahead: int) -> TDBatch:
        """The next batch; when none is left, ``updates_ahead`` batches are drawn and prepared in one call."""
        if not self._ahead:
            draw = replay.sample(self.batch_size * updates_ahead, self.n_step, self.gamma)
            self._ahead = prepare_td_batches(market, draw, self.batch_size, net, self.all_actions, self.n_step)[::-1]
        return self._ahead.pop()

    def state_dict(self) -> dict[str, Tensor] | None:
        if not self._ahead:
            return None
        return ReplaySample.cat([b.sample for b in self._ahead[::-1]]).state_dict()

    def load_state_dict(self, state: dict[str, Tensor] | None, market: MarketTensors, net: QNetwork) -> None:
        self._ahead = []
        if state is not None:
            draw = ReplaySample.from_state_dict({k: v.to(market.device) for k, v in state.items()})
            self._ahead = prepare_td_batches(market, draw, self.batch_size, net, self.all_actions, self.n_step)[::-1]

