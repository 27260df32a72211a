"""A vectorised market environment over a MarketSplit: N price-taking agents stepped in one tensor call.

The agent's state at bar t is (the last ``window`` rows of features up to and including t, the position held
coming into t). Its action is a target position w_t from ``actions`` (a fraction of equity), held from bar t to t+1,
and the raw reward is the back-test's per-bar strategy log return (:mod:`foxhunt.trading.pnl`), exactly:

    log1p(w_t * expm1(r_t)) + log1p(-cost * |w_t - w_{t-1}|),    r_t = ln C[t+1] - ln C[t] (``returns[t]``),

so the sum of an episode's raw rewards is the log of its wealth multiple and the agents are trained on what they are
scored on (the linear w·r - cost·|Δw| would favour shorts by about r² a bar). With ``reward_source="returns"`` the
training reward is that times ``reward_scale``. With ``reward_source="targets"`` it is the linear surrogate
``w_t * target_t - cost' * |Δw|`` on the preprocessed (normalised) targets, with the cost converted into target units:
a training signal, not a return, so it has no exact form; raw rewards are the exact log returns either way.
The observation never reads past bar t; r_t enters only the reward. Because the market is exogenous the reward of
every action at every bar is known (:meth:`MarketTensors.rewards_all`), which the DQN's exogenous mode exploits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from foxhunt.data.market import MarketSplit
from foxhunt.trading.pnl import cost_log_returns, log_growth, position_log_returns
from foxhunt.trading.policy_table import rollout_policy_table

RewardSource = Literal["returns", "targets"]


def segment_starts(first_bar: Tensor) -> Tensor:
    """[T] first row of each row's symbol block, from the split's ``first_bar`` mask (rows ordered by symbol, time)."""
    t = torch.arange(first_bar.shape[0], device=first_bar.device)
    return torch.cummax(torch.where(first_bar, t, torch.zeros_like(t)), 0).values


class MarketTensors:
    """A split's tensors on one device, with the bars at which a decision can be taken and the window gather."""

    def __init__(
        self,
        split: MarketSplit,
        window: int,
        actions: tuple[float, ...] = (-1.0, 0.0, 1.0),
        cost_bps: float = 1.0,
        reward_source: RewardSource = "returns",
        reward_scale: float = 1.0,
        device: torch.device | str | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if len(actions) < 2:
            raise ValueError(f"need at least two actions (target positions), got {actions!r}")
        if 0.0 not in actions:
            # episodes start flat, non-decision bars and symbol starts are flat, and the back-test's position before
            # the first bar is 0: without a flat action the nearest one would stand in for it, free of entry costs
            raise ValueError(f"actions must include 0.0 (flat), got {actions!r}")
        if cost_bps < 0:
            raise ValueError(f"cost_bps must be >= 0, got {cost_bps}")
        if reward_source not in ("returns", "targets"):
            raise ValueError(f"reward_source must be 'returns' or 'targets', got {reward_source!r}")
        if split.n_features == 0:
            raise ValueError(f"MarketSplit {split.name!r} has no feature columns: the agent would observe nothing")
        device = torch.device(device) if device is not None else split.features.device
        self.name = split.name
        self.window = int(window)
        self.cost_bps = float(cost_bps)
        self.cost = self.cost_bps * 1e-4
        self.reward_source = reward_source
        self.reward_scale = float(reward_scale)
        self.actions = torch.tensor(actions, dtype=torch.float32, device=device)
        self.flat_index = int(torch.argmin(self.actions.abs()))
        self.features = split.features.to(device=device, dtype=torch.float32).contiguous()
        raw = split.returns.to(device=device, dtype=torch.float32)
        finite = torch.isfinite(raw)
        self.returns = torch.where(finite, raw, torch.zeros_like(raw))  # raw log returns, 0 where undefined
        self.simple_returns = torch.expm1(self.returns)  # e^r - 1: a position w earns log1p(w * simple) over the bar
        self.symbol_index = split.symbol_index.to(device)
        self.reset_mask = split.first_bar.to(device)
        t = torch.arange(len(split), device=device)
        # Every row of the window must hold finite features (a NaN a few bars back would poison the Q-network).
        bad = (~torch.isfinite(self.features).all(1)).to(torch.int64)
        bad_csum = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(bad, 0)])
        first = (t - self.window + 1).clamp_min(0)
        window_ok = (bad_csum[t + 1] - bad_csum[first]) == 0
        self.decision = (
            split.valid.to(device) & finite & window_ok & (t - self.window + 1 >= segment_starts(self.reset_mask))
        )
        if not bool(self.decision.any()):
            raise ValueError(
                f"MarketSplit {split.name!r}: no bar has a valid decision state (valid bars, finite next return and"
                f" features, and {self.window - 1} earlier bars of the same symbol for the window)"
            )
        # Rewards are computed in "reward units": the chosen signal times reward_scale. "returns": the exact per-bar
        # log return (as raw_rewards); "targets": the linear surrogate on the preprocessed targets, with costs
        # converted by the targets' scale. Raw rewards and metrics always use raw returns and raw costs, exactly.
        self.exact = reward_source == "returns"
        if reward_source == "targets":
            tgt = split.targets.to(device=device, dtype=torch.float32)
            tgt_ok = torch.isfinite(tgt) & self.decision
            self.decision &= torch.isfinite(tgt)
            ratio = tgt[tgt_ok].std() / self.returns[tgt_ok].std().clamp_min(1e-12)
            self.signal = torch.where(torch.isfinite(tgt), tgt, torch.zeros_like(tgt))
            self.signal_cost = self.cost * float(ratio)
        else:
            self.signal = self.returns
            self.signal_cost = self.cost
        # [P, A] cost of moving from held position p to action a: -log1p(-cost |a - p|) for the raw rewards, and in
        # signal units for the training rewards (the same with "returns"; linear in target units with "targets").
        # The training one may carry a member's extra turnover penalty (DQNModule adds one); the raw one never does.
        moves = (self.actions.unsqueeze(0) - self.actions.unsqueeze(1)).abs()
        self.raw_switch_cost = -cost_log_returns(moves, self.cost_bps)
        self.switch_cost = self.raw_switch_cost.clone() if self.exact else self.signal_cost * moves
        self._span_views: dict[int, Tensor] = {}
        self.position_eye = torch.eye(self.n_actions, device=device)  # rows gathered: cheaper than one_hot per call

    @property
    def n_bars(self) -> int:
        return int(self.features.shape[0])

    @property
    def n_actions(self) -> int:
        return int(self.actions.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.features.shape[1])

    @property
    def device(self) -> torch.device:
        return self.features.device

    def windows(self, bars: Tensor, extra: int = 0, flat: bool = False) -> Tensor:
        """[B, W + extra, F] features of bars t-W+1..t+extra for each t in ``bars`` ([B, (W + extra)·F] if ``flat``).

        The rows of one window are contiguous in the feature matrix, so the gather is one row lookup in a strided
        view whose row i is the flattened span starting at bar i (nothing is copied ahead of time). ``extra`` > 0
        reads past t: only for successor states (a replay sample's t+1), never for an observation at t.
        """
        span = self.window + extra
        out = self._spans(span)[bars - (self.window - 1)]
        return out if flat else out.view(-1, span, self.n_features)

    def _spans(self, span: int) -> Tensor:
        view = self._span_views.get(span)
        if view is None:
            f = self.features
            view = self._span_views[span] = f.as_strided((f.shape[0] - span + 1, span * f.shape[1]), (f.shape[1], 1))
        return view

    def position_features(self, positions: Tensor) -> Tensor:
        """[B, A] one-hot of the held position's action index (the agent's own state)."""
        return self.position_eye[positions]

    def step_rewards(self, bars: Tensor, positions: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
        """(training reward in reward units, raw per-bar strategy log return after raw costs) of moving from position
        index ``positions`` to ``actions`` at ``bars``, the gross log return computed once. The training reward is the
        raw one (scaled) with "returns", the linear surrogate on the targets with "targets"."""
        new = self.actions[actions]
        gross = position_log_returns(new, self.simple_returns[bars])
        raw = gross - self.raw_switch_cost[positions, actions]
        gain = gross if self.exact else new * self.signal[bars]
        return self.reward_scale * (gain - self.switch_cost[positions, actions]), raw

    def rewards_all(self, bars: Tensor, positions: Tensor) -> Tensor:
        """[B, A] reward of every action: the market is exogenous, so all of them are known."""
        if self.exact:
            gain = log_growth(torch.outer(self.simple_returns[bars], self.actions))
        else:
            gain = torch.outer(self.signal[bars], self.actions)
        return self.reward_scale * (gain - self.switch_cost[positions])

    def rewards(self, bars: Tensor, positions: Tensor, actions: Tensor) -> Tensor:
        """Reward (reward units) of moving from position index ``positions`` to ``actions`` at ``bars``."""
        return self.step_rewards(bars, positions, actions)[0]

    def raw_rewards(self, bars: Tensor, positions: Tensor, actions: Tensor) -> Tensor:
        """Per-bar strategy log return after raw costs (what the back-test metrics count), exactly."""
        return self.step_rewards(bars, positions, actions)[1]

    def step_position_rewards(self, bars: Tensor, held: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(training reward, raw per-bar log return) of moving from position value ``held`` to ``positions`` (values,
        e.g. in [-1, 1]), each log return computed once."""
        moves = (positions - held).abs()
        raw = position_log_returns(positions, self.simple_returns[bars]) + cost_log_returns(moves, self.cost_bps)
        if self.exact:
            return self.reward_scale * raw, raw
        return self.reward_scale * (positions * self.signal[bars] - self.signal_cost * moves), raw

    def position_rewards(self, bars: Tensor, held: Tensor, positions: Tensor) -> Tensor:
        """Reward (reward units) of moving from position value ``held`` to ``positions``."""
        return self.step_position_rewards(bars, held, positions)[0]

    def raw_position_rewards(self, bars: Tensor, held: Tensor, positions: Tensor) -> Tensor:
        """Per-bar strategy log return after raw costs of moving from position value ``held`` to ``positions``."""
        return self.step_position_rewards(bars, held, positions)[1]


def reward_scale_for(market: MarketTensors, configured: float | None = None) -> float:
    """The agents' reward scale: ``configured``, or 1 / std of the training signal at decision bars."""
    if configured is not None:
        return float(configured)
    std = float(market.signal[market.decision].std())
    if not math.isfinite(std) or std <= 0:
        raise ValueError(f"train split {market.name!r}: returns have no spread to scale rewards by")
    return 1.0 / std


@torch.no_grad()
def greedy_table(
    q_fn: Callable[[Tensor, Tensor], Tensor], market: MarketTensors, chunk: int = 65_536, bars: Tensor | None = None
) -> Tensor:
    """[T, A] greedy action index for every bar and every held position (flat rows where no decision is possible).

    ``q_fn(windows [B, W, F], position_features [B, A]) -> Q [B, A]``. The market is exogenous, so every state a
    policy could reach is known in advance and evaluated in batched forward passes; rows of symbol starts are made
    constant (a flat position comes in). ``bars`` (row indices): only those rows are evaluated, the others are flat
    (a live session reads the latest bar's row alone).
    """
    n_act, flat = market.n_actions, market.flat_index
    table = torch.full((market.n_bars, n_act), flat, dtype=torch.int64, device=market.device)
    bars = torch.nonzero(market.decision).squeeze(1) if bars is None else bars[market.decision[bars]]
    pos_ids = torch.arange(n_act, device=market.device)
    per = max(1, chunk // n_act)
    for i in range(0, bars.numel(), per):
        b = bars[i : i + per]
        w = market.windows(b).repeat_interleave(n_act, 0)
        p = market.position_features(pos_ids.repeat(b.numel()))
        table[b] = q_fn(w, p).argmax(1).view(-1, n_act)
    return torch.where(market.reset_mask.unsqueeze(1), table[:, flat : flat + 1].expand_as(table), table)


def greedy_positions(q_fn: Callable[[Tensor, Tensor], Tensor], market: MarketTensors, chunk: int = 65_536) -> Tensor:
    """[T] positions (values) of the greedy policy of ``q_fn`` over a whole split, without a loop over bars."""
    return market.actions[rollout_policy_table(greedy_table(q_fn, market, chunk), market.flat_index)]


@torch.no_grad()
def sequential_positions(
    prepare: Callable[[Tensor], Tensor],
    run: Callable[[Tensor, Tensor, Tensor], Tensor],
    market: MarketTensors,
    chunk: int = 4096,
) -> Tensor:
    """[T] positions (values) of a deterministic policy whose decision at bar t reads the position held coming in.

    For a continuous position the chain p_t = f(s_t, p_{t-1}) cannot be tabulated like :func:`greedy_table`'s, so it
    runs bar by bar, but vectorised over symbols (each symbol's rows are one lane, starting flat) and with the
    position-free part of the policy computed in batches: ``prepare(bars [B]) -> [B, H]`` (e.g. the first layer on the
    feature window) for ``chunk`` bars of every lane at once, then ``run(prepared [L, S, H], decide [L, S], held [L])
    -> [L, S]`` steps the recurrence through those S bars from the held positions. Bars where no decision is possible
    are flat (``decide`` False; the position carried out of them is flat too), like the rows :func:`greedy_table`
    makes flat.
    """
    dev = market.device
    starts = torch.nonzero(market.reset_mask).squeeze(1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), starts])
    lengths = torch.diff(starts, append=torch.tensor([market.n_bars], device=dev))
    out = torch.zeros(market.n_bars, dtype=torch.float32, device=dev)
    held = torch.zeros(starts.numel(), dtype=torch.float32, device=dev)
    longest = int(lengths.max())
    for first in range(0, longest, chunk):
        offsets = torch.arange(first, min(first + chunk, longest), device=dev)
        inside = offsets.unsqueeze(0) < lengths.unsqueeze(1)  # [L, S]
        rows = torch.where(inside, starts.unsqueeze(1) + offsets, torch.zeros_like(inside, dtype=torch.int64))
        decide = inside & market.decision[rows]
        safe = torch.where(decide, rows, torch.full_like(rows, market.window - 1))  # a gatherable bar, result unused
        prepared = prepare(safe.reshape(-1)).view(*rows.shape, -1)
        positions = run(prepared, decide, held).to(device=dev, dtype=torch.float32)
        held = positions[:, -1]
        out[rows[inside]] = positions[inside]
    return out


@dataclass
class Transition:
    """What one environment step of N agents produced (tensors of shape [N])."""

    bars: Tensor  # bar of the decision
    positions: Tensor  # action index of the position held coming into the bar
    actions: Tensor  # action index chosen
    rewards: Tensor  # reward units
    raw_rewards: Tensor  # raw strategy log return after costs
    last: Tensor  # the episode ended (time limit) after this step; the next state (bar+1, action) is still valid


def episode_starts(market: MarketTensors, episode_length: int) -> Tensor:
    """The bars an episode may start at: the first of ``episode_length`` + 1 consecutive decision bars of one symbol;
    a ValueError when there are none (the episodes are too long for the split)."""
    dev = market.device
    span = int(episode_length) + 1
    ok = market.decision.to(torch.int64)
    csum = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(ok, 0)])
    t = torch.arange(max(0, market.n_bars - span + 1), device=dev)
    full = (csum[t + span] - csum[t]) == span
    same = market.symbol_index[t] == market.symbol_index[t + span - 1]
    starts = t[full & same]
    if starts.numel() == 0:
        raise ValueError(
            f"MarketSplit {market.name!r}: no run of {span} consecutive decision bars of one symbol: "
            f"episode_length={episode_length} is too long for this split (or too few valid bars)"
        )
    return starts


class MarketEnv:
    """N agents, each in its own episode of ``episode_length`` decisions starting at a random bar of the split.

    Episodes never cross a symbol boundary or the split's end: a start is drawn only where the next
    ``episode_length + 1`` bars are all decision bars of one symbol, so the state after the last step is a valid
    state to bootstrap from (episode ends are time limits, not terminal states). Episodes start flat.
    """

    def __init__(self, market: MarketTensors, n_envs: int = 256, episode_length: int = 256, seed: int = 0) -> None:
        if n_envs < 1:
            raise ValueError(f"n_envs must be >= 1, got {n_envs}")
        if episode_length < 1:
            raise ValueError(f"episode_length must be >= 1, got {episode_length}")
        self.market = market
        self.n_envs = int(n_envs)
        self.episode_length = int(episode_length)
        dev = market.device
        self.starts = episode_starts(market, self.episode_length)
        self.generator = torch.Generator(device=dev)
        self.generator.manual_seed(int(seed))
        self.bars = torch.zeros(self.n_envs, dtype=torch.int64, device=dev)
        self.positions = torch.full((self.n_envs,), market.flat_index, dtype=torch.int64, device=dev)
        self.steps = torch.zeros(self.n_envs, dtype=torch.int64, device=dev)
        self.episode_returns = torch.zeros(self.n_envs, dtype=torch.float64, device=dev)
        self.reset()

    def _draw_starts(self) -> Tensor:
        idx = torch.randint(0, self.starts.numel(), (self.n_envs,), generator=self.generator, device=self.starts.device)
        return self.starts[idx]

    def reset(self) -> None:
        """Start every agent on a fresh episode, flat. Episodes are desynchronised by a random elapsed length."""
        self.bars = self._draw_starts()
        self.positions.fill_(self.market.flat_index)
        self.steps = torch.randint(
            0, self.episode_length, (self.n_envs,), generator=self.generator, device=self.bars.device
        )
        self.episode_returns.zero_()

    def observe(self) -> tuple[Tensor, Tensor]:
        """(window [N, W, F], position features [N, A]) of every agent's current state."""
        return self.market.windows(self.bars), self.market.position_features(self.positions)

    def step(self, actions: Tensor) -> Transition:
        """Apply one action per agent; episodes that reach their length restart at a new random bar, flat."""
        bars, held = self.bars, self.positions
        rewards, raw = self.market.step_rewards(bars, held, actions)
        steps = self.steps + 1
        last = steps >= self.episode_length
        self.episode_returns += raw.to(torch.float64)
        fresh = self._draw_starts()
        self.bars = torch.where(last, fresh, bars + 1)
        self.positions = torch.where(last, torch.full_like(actions, self.market.flat_index), actions)
        self.steps = torch.where(last, torch.zeros_like(steps), steps)
        self.episode_returns = torch.where(last, torch.zeros_like(self.episode_returns), self.episode_returns)
        return Transition(bars, held, actions, rewards, raw, last)

    def state_dict(self) -> dict[str, Tensor]:
        """Everything needed to continue exactly where the agents are (the RNG included)."""
        return {
            "bars": self.bars.clone(),
            "positions": self.positions.clone(),
            "steps": self.steps.clone(),
            "episode_returns": self.episode_returns.clone(),
            "rng_state": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if state["bars"].shape[0] != self.n_envs:
            raise ValueError(f"saved env state has {state['bars'].shape[0]} agents, this env {self.n_envs}")
        dev = self.bars.device
        self.bars = state["bars"].to(dev)
        self.positions = state["positions"].to(dev)
        self.steps = state["steps"].to(dev)
        self.episode_returns = state["episode_returns"].to(dev)
        self.generator.set_state(state["rng_state"].cpu())


class ContinuousMarketEnv(MarketEnv):
    """:class:`MarketEnv` whose agents choose a position value (e.g. in [-1, 1]) instead of an action index.

    Same episodes, starts and RNG draws as the discrete environment; the held position is a float (flat, 0.0, at every
    episode start) and the raw reward is the exact per-bar log return
    ``log1p(position_t * expm1(r_t)) + log1p(-cost * |position_t - position_{t-1}|)`` (the module docstring). A target
    within ``no_trade_band`` of the held position is not traded (:func:`apply_no_trade_band`: under proportional costs
    the optimal policy has a no-trade region, and a continuous policy's small corrections would otherwise pay the cost
    every bar). A step's :class:`Transition` holds position values in ``positions`` (held) and ``actions`` (the
    position taken, after the band).
    """

    def __init__(self, market: MarketTensors, n_envs: int = 256, episode_length: int = 256, seed: int = 0,
                 no_trade_band: float = 0.0) -> None:
        if not 0.0 <= no_trade_band < 2.0:
            raise ValueError(f"no_trade_band must be in [0, 2), got {no_trade_band}")
        self.no_trade_band = float(no_trade_band)
        super().__init__(market, n_envs, episode_length, seed)

    def reset(self) -> None:
        super().reset()
        self.positions = torch.zeros(self.n_envs, dtype=torch.float32, device=self.bars.device)

    def observe(self) -> tuple[Tensor, Tensor]:
        """(window [N, W, F], held position [N, 1]) of every agent's current state."""
        return self.market.windows(self.bars), self.positions.unsqueeze(1)

    def step(self, actions: Tensor) -> Transition:
        """Move every agent to the target position ``actions[i]`` (values; not traded within the no-trade band);
        episodes that reach their length restart flat."""
        bars, held = self.bars, self.positions
        actions = apply_no_trade_band(actions.to(torch.float32), held, self.no_trade_band)
        rewards, raw = self.market.step_position_rewards(bars, held, actions)
        steps = self.steps + 1
        last = steps >= self.episode_length
        self.episode_returns += raw.to(torch.float64)
        fresh = self._draw_starts()
        self.bars = torch.where(last, fresh, bars + 1)
        self.positions = torch.where(last, torch.zeros_like(actions), actions)
        self.steps = torch.where(last, torch.zeros_like(steps), steps)
        self.episode_returns = torch.where(last, torch.zeros_like(self.episode_returns), self.episode_returns)
        return Transition(bars, held, actions, rewards, raw, last)


def apply_no_trade_band(targets: Tensor, held: Tensor, band: float) -> Tensor:
    """The positions taken: the held position where the target is within ``band`` of it, else the target."""
    if band <= 0.0:
        return targets
    return torch.where((targets - held).abs() < band, held, targets)
