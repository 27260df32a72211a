"""DQNModule: a Double DQN agent member that trades a MarketSplit through a vectorised market environment.

The coordinator (:class:`foxhunt.lit.ensemble.EnsembleModule`) trains it, alone (``dqn.yaml``) or with other members.
One update, in CleanRL's order: step all N agents with the ε-greedy online policy (every ``env_step_every`` updates),
storing the transitions as bar indices and positions in the on-device replay buffer; sample a batch; compute the
Double DQN target under ``no_grad`` from the target network; the Huber loss (:meth:`DQNModule.training_loss`); the
coordinator's backward, guard, clip and optimizer step; the target sync (:meth:`DQNModule.after_update`).
Validation runs the greedy policy over the whole validation split in one vectorised pass.

Against memorising the training path (issue 16): every ``select_every`` updates the member scores its greedy policy on
the validation split (reward per bar after costs) and keeps the best weights as its policy (``policy_net``; never
chosen on training reward), stops learning after ``patience`` evaluations without a gain, and reports the train /
validation gap (``train/dqn/greedy_reward_per_bar``, ``val/dqn/greedy_reward_per_bar``); the selection is the
:class:`~foxhunt.lit.member.Agent` base's, which PPO shares. Dropout, observation noise,
weight decay, a training-only turnover penalty and the window length are hyperparameters; the coordinator's
``min_edge_confidence`` keeps the member flat when its validation edge is not significant.

Usage::

    member = DQNModule(window=16)
    model = EnsembleModule(members={"dqn": member})
    Trainer(max_steps=20_000).fit(model, datamodule=MarketDataModule(train_split, val_split))
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.lit.member import Agent
from foxhunt.models.qnet import EncoderKind, QNetwork
from foxhunt.rl.batches import PresampledBatches, TDBatch
from foxhunt.rl.env import MarketEnv, MarketTensors, RewardSource, greedy_positions, greedy_table, reward_scale_for
from foxhunt.rl.replay import ReplayBuffer, ReplaySample
from foxhunt.training.optim import Optimization, SchedulerKind

TargetUpdate = Literal["hard", "polyak"]
EpsilonSchedule = Literal["linear", "exponential"]
ExogenousMode = Literal["none", "all_actions"]


def double_dqn_target(
    q_next_online: Tensor | None, q_next_target: Tensor, rewards: Tensor, discounts: Tensor | float, double: bool = True
) -> Tensor:
    """rewards + discount · Q_target(s', argmax_a Q_online(s', a)); plain DQN's max_a Q_target(s', a) if not double."""
    if double:
        if q_next_online is None:
            raise ValueError("Double DQN targets need the online network's successor values")
        next_value = q_next_target.gather(1, q_next_online.argmax(1, keepdim=True)).squeeze(1)
    else:
        next_value = q_next_target.amax(1)
    return rewards + discounts * next_value


def _check_warm_up(learning_starts: int, replay_capacity: int, n_envs: int, n_step: int) -> int:
    """Steps of all agents the warm-up takes before the first update (``learning_starts`` transitions, and at least
    ``n_step`` + 1 steps for a first n-step sample); a ValueError when the replay cannot hold them (it keeps
    ``replay_capacity // n_envs`` steps of every agent, so the warm-up would never end)."""
    if learning_starts < 0:
        raise ValueError(f"learning_starts must be >= 0, got {learning_starts}")
    warm = max(math.ceil(learning_starts / n_envs), n_step + 1)
    slots = replay_capacity // n_envs
    if warm > slots:
        raise ValueError(
            f"learning_starts={learning_starts} with n_envs={n_envs} and n_step={n_step} needs {warm} warm-up steps of "
            f"every agent ({warm * n_envs} transitions), but replay_capacity={replay_capacity} holds {slots} steps of "
            f"{n_envs} agents: the warm-up would never end. Raise replay_capacity to at least {warm * n_envs}"
            + (f" or lower learning_starts to at most {slots * n_envs}" if slots > n_step else "")
        )
    return warm


@dataclass(frozen=True)
class DQNOptimization(Optimization):
    """The DQN's optimisation defaults: a constant 3e-4 without weight decay, clipped at 10, 16 updates a step."""

    lr: float = 3e-4
    weight_decay: float = 0.0
    scheduler: SchedulerKind = "none"
    gradient_clip_val: float | None = 10.0
    log_grad_norm_every: int = 100
    updates_per_step: int = 16
    fused_adamw: bool = True


@dataclass
class _Counters:
    """Running tallies of the acting loop (not parameters: they travel in the checkpoint's run state)."""

    env_steps: int = 0  # steps of single agents so far
    reward_sum: Tensor | None = None  # raw reward since the last log (a tensor, so no device sync per step)
    reward_count: int = 0
    clock: tuple[float, int] = field(default_factory=lambda: (time.perf_counter(), 0))
    last_loss: Tensor | None = None
    last_q: Tensor | None = None
    last_epsilon: float = 1.0
    acted_for: int = -1  # the update the agents last stepped for: an update the guard skipped does not step them again


class DQNModule(Agent):
    """Double DQN agent over a vectorised market environment (see the module docstring)."""

    def __init__(
        self,
        window: int = 16,
        actions: tuple[float, ...] = (-1.0, 0.0, 1.0),
        n_envs: int = 256,
        episode_length: int = 256,
        cost_bps: float | None = None,
        reward_source: RewardSource = "returns",
        reward_scale: float | None = None,
        gamma: float = 0.9,
        hidden: tuple[int, ...] = (128, 128),
        layer_norm: bool = True,
        dueling: bool = False,
        encoder: EncoderKind = "flat",
        double_dqn: bool = True,
        batch_size: int = 256,
        replay_capacity: int = 262_144,
        learning_starts: int = 16_384,
        n_step: int = 1,
        target_update: TargetUpdate = "polyak",
        target_update_every: int = 1000,
        tau: float = 0.005,
        polyak_every: int = 1,
        epsilon_schedule: EpsilonSchedule = "linear",
        epsilon_start: float = 1.0,
        epsilon_end: float = 0.05,
        epsilon_steps: int = 5_000,
        env_steps_per_update: int = 1,
        env_step_every: int = 1,
        exogenous: ExogenousMode = "all_actions",
        huber_delta: float = 1.0,
        dropout: float = 0.2,
        obs_noise: float = 0.5,
        turnover_penalty_bps: float = 0.0,
        select_every: int = 1000,
        patience: int = 10,
        optim: DQNOptimization | Mapping[str, Any] = DQNOptimization(),
        seed: int = 0,
        n_features: int | None = None,
    ) -> None:
        """
        Args:
            window: bars of features in one observation (t-window+1..t).
            actions: target positions the agent can choose (short/flat/long by default).
            n_envs: parallel agents stepped in one call.
            episode_length: decisions per episode (episodes start flat at random bars).
            cost_bps: proportional cost per unit of position traded, in basis points; None: the coordinator's.
            reward_source: "returns" (raw log returns) or "targets" (the split's preprocessed targets; costs scaled).
            reward_scale: multiplies rewards; None scales by 1 / std of the training returns at decision bars.
            gamma: discount factor.
            hidden: widths of the Q-network's hidden layers.
            layer_norm: LayerNorm after each hidden linear layer.
            dueling: dueling value/advantage head.
            encoder: "flat" (flattened window) or "conv" (a small temporal convolution).
            double_dqn: Double DQN targets (online argmax, target evaluation); False for plain DQN.
            batch_size: transitions per gradient update.
            replay_capacity: transitions kept in the replay buffer.
            learning_starts: transitions collected with a uniform random policy before the first update.
            n_step: n-step returns (exogenous="none" only).
            target_update: "hard" (copy every ``target_update_every`` updates) or "polyak" (τ every
                ``polyak_every`` updates).
            target_update_every: updates between hard target syncs.
            tau: Polyak averaging rate.
            polyak_every: updates between Polyak averaging steps (Stable-Baselines3's target_update_interval).
            epsilon_schedule: "linear" or "exponential" decay of ε from start to end over ``epsilon_steps`` updates.
            epsilon_start: initial exploration rate.
            epsilon_end: final exploration rate.
            epsilon_steps: updates over which ε decays.
            env_steps_per_update: steps of all agents before each gradient update that steps the environment.
            env_step_every: step the environment before every this many-th update only (N agents give N
                transitions per step, so with hundreds of agents the replay stays fresh with fewer steps).
            exogenous: "all_actions" regresses Q(s, a) for every action of a sampled state onto its known reward
                plus the bootstrapped value of (t+1, a); "none" is plain DQN on the taken action.
            huber_delta: Huber loss threshold (in reward units).
            dropout: dropout rate after each hidden layer of the Q-networks while learning (0: none): in acting and
                in both networks' values of the TD target too, as in DroQ (Hiraoka et al. 2021); the greedy policies
                scored on validation, traded and exported run without it.
            obs_noise: standard deviation of Gaussian noise added to the (z-scored) feature windows of the states
                the online network learns from (0: none); the successors' targets see clean windows.
            turnover_penalty_bps: extra cost per unit of position traded, in basis points, in the training reward
                only (the agent learns to trade less than the real cost alone asks; metrics count the real cost).
            select_every: updates between scores of the greedy policy on the validation split; the best-scoring
                weights (reward per bar after costs) become the policy (``policy_net``). 0: the last weights trade.
            patience: evaluations without a better validation score after which the member stops learning (0: never).
            optim: the optimisation settings (:class:`~foxhunt.training.optim.Optimization`; fields not given keep
                :class:`DQNOptimization`'s defaults; a plateau schedule watches the validation reward).
            seed: seeds network initialisation, environment, replay sampling and exploration.
            n_features: feature columns observed; None: taken from the data when the coordinator binds the member.
        """
        super().__init__()
        self.init_optim(DQNOptimization.of(optim))
        optim = self.optim.as_dict()  # noqa: F841 - hyperparameters hold plain values (read by save_hyperparameters)
        self.save_hyperparameters()
        if not 0.0 <= gamma < 1.0:
            raise ValueError(f"gamma must be in [0, 1), got {gamma}")
        if n_step < 1:
            raise ValueError(f"n_step must be >= 1, got {n_step}")
        if exogenous == "all_actions" and n_step != 1:
            raise ValueError("exogenous='all_actions' uses one-step targets for every action; set n_step=1 or exogenous='none'")
        if exogenous not in ("none", "all_actions"):
            raise ValueError(f"exogenous must be 'none' or 'all_actions', got {exogenous!r}")
        if target_update not in ("hard", "polyak"):
            raise ValueError(f"target_update must be 'hard' or 'polyak', got {target_update!r}")
        if epsilon_schedule not in ("linear", "exponential"):
            raise ValueError(f"epsilon_schedule must be 'linear' or 'exponential', got {epsilon_schedule!r}")
        if not (0.0 <= epsilon_end <= 1.0 and 0.0 <= epsilon_start <= 1.0):
            raise ValueError(f"epsilon_start/end must be in [0, 1], got {epsilon_start}, {epsilon_end}")
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {tau}")
        counts = (batch_size, env_steps_per_update, env_step_every, target_update_every, polyak_every)
        if min(*counts, epsilon_steps) < 1:
            raise ValueError(
                "batch_size, env_steps_per_update, env_step_every, target_update_every, polyak_every"
                " and epsilon_steps must be >= 1"
            )
        if select_every < 0 or patience < 0:
            raise ValueError(f"select_every and patience must be >= 0, got {select_every}, {patience}")
        if obs_noise < 0 or turnover_penalty_bps < 0:
            raise ValueError(f"obs_noise and turnover_penalty_bps must be >= 0, got {obs_noise}, {turnover_penalty_bps}")
        if cost_bps is not None and cost_bps < 0:
            raise ValueError(f"cost_bps must be >= 0, got {cost_bps}")
        if n_envs < 1:
            raise ValueError(f"n_envs must be >= 1, got {n_envs}")
        if replay_capacity < n_envs * max(2, n_step):
            raise ValueError(f"replay_capacity ({replay_capacity}) must hold at least {max(2, n_step)} steps of {n_envs} agents")
        if batch_size > replay_capacity:
            raise ValueError(f"batch_size={batch_size} exceeds replay_capacity={replay_capacity}: every batch would draw "
                             f"the same transitions many times over; use at most {replay_capacity}, or raise replay_capacity")
        _check_warm_up(learning_starts, replay_capacity, n_envs, n_step)
        self.obs_noise = float(obs_noise)  # read every update: a plain attribute
        # derived from the data and the coordinator at bind time (plain attributes, never hyperparameters)
        self.n_inputs: int | None = None  # feature columns observed (the data's, plus stacked forecasts)
        self.cost_bps = 1.0 if cost_bps is None else float(cost_bps)
        self.seed = int(seed)
        self.q_net: QNetwork | None = None
        self.target_net: QNetwork | None = None
        self.init_selection(select_every)  # policy_net: the weights chosen on validation (select_every > 0)
        self.noise_rng: torch.Generator | None = None
        self.train_split: MarketSplit | None = None
        self.val_split: MarketSplit | None = None
        self.env: MarketEnv | None = None
        self.replay: ReplayBuffer | None = None
        self.explore_rng: torch.Generator | None = None
        self.batches = PresampledBatches(batch_size, n_step, gamma, exogenous == "all_actions")
        self._pending_state: dict[str, Any] | None = None
        self.reward_scale_used: float | None = None
        self.counters = _Counters()  # a plain object: nn.Module attribute writes are slow in the hot loop
        if n_features is not None:
            self.build_networks(n_features)

    @property
    def env_steps(self) -> int:
        """Single-agent environment steps taken so far (warm-up included)."""
        return self.counters.env_steps

    @property
    def network(self) -> nn.Module:
        if self.q_net is None:
            raise RuntimeError("DQNModule has no networks yet: bind it to the data (or give n_features)")
        return self.q_net

    # ----------------------------------------------------------------------------------------------- wiring
    def bind(self, spec: MarketSpec, extra_inputs: int = 0, seed_offset: int = 0, cost_bps: float | None = None) -> None:
        """Networks for the spec's features plus ``extra_inputs`` stacked columns; the coordinator's cost unless the
        member has its own; exploration seeded ``seed_offset`` further (one stream per DDP rank)."""
        hp = self.hparams
        n = spec.n_features + extra_inputs
        if hp.n_features is not None and hp.n_features + extra_inputs != n:
            raise ValueError(f"DQNModule was built for n_features={hp.n_features}, the data has {spec.n_features} features")
        if hp.cost_bps is None and cost_bps is not None:
            self.cost_bps = float(cost_bps)
        self.seed = int(hp.seed) + int(seed_offset)
        if self.n_inputs != n:
            self.build_networks(n)

    def build_networks(self, n_inputs: int) -> None:
        """The online and target Q-networks for ``n_inputs`` feature columns, seeded."""
        hp = self.hparams
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            net_args = {
                "n_features": n_inputs, "window": hp.window, "n_actions": len(hp.actions),
                "n_position_features": len(hp.actions), "hidden": tuple(hp.hidden), "layer_norm": hp.layer_norm,
                "dueling": hp.dueling, "encoder": hp.encoder, "dropout": hp.dropout,
            }
            self.q_net = QNetwork(**net_args)  # type: ignore[arg-type]
            self.target_net = QNetwork(**net_args)  # type: ignore[arg-type]
            if hp.select_every:
                self.policy_net = QNetwork(**net_args)  # type: ignore[arg-type]
        self.target_net.load_state_dict(self.q_net.state_dict())
        self.target_net.requires_grad_(False)
        self.freeze_policy_copy()
        self.n_inputs = n_inputs

    def release_environment(self) -> None:
        """Drop the environment and replay buffer of the previous market."""
        self.env, self.replay = None, None

    def _build_environment(self) -> None:
        """Environment, replay buffer and exploration RNG on the module's device (then a resumed state, if any)."""
        if self.train_split is None:
            raise RuntimeError("DQNModule has no market: call module.attach_market(train_split, val_split) before fit")
        hp = self.hparams
        market = self.market_tensors(self.train_split)
        if self.reward_scale_used is None:
            self.reward_scale_used = reward_scale_for(market, hp.reward_scale)
        market.reward_scale = self.reward_scale_used
        if hp.turnover_penalty_bps:  # training reward only: raw rewards (and every metric) keep the real cost
            extra = hp.turnover_penalty_bps * 1e-4 * market.signal_cost / max(market.cost, 1e-12) if market.cost else (
                hp.turnover_penalty_bps * 1e-4)
            market.switch_cost = market.switch_cost + extra * (market.actions.unsqueeze(0) - market.actions.unsqueeze(1)).abs()
        self.env = MarketEnv(market, hp.n_envs, hp.episode_length, seed=self.seed)
        self.replay = ReplayBuffer(hp.replay_capacity, hp.n_envs, device=self.device, seed=self.seed + 1)
        self.explore_rng = torch.Generator(device=self.device)
        self.explore_rng.manual_seed(self.seed + 2)
        self.noise_rng = torch.Generator(device=self.device)
        self.noise_rng.manual_seed(self.seed + 3)
        for net in (self.q_net, self.target_net):  # dropout masks from the member's own stream, not the global one
            if net is not None:
                net.generator = self.noise_rng
        self.warn_without_validation()
        if self._pending_state is not None:
            self._apply_run_state(self._pending_state)
            self._pending_state = None

    def start(self) -> None:
        """Build the environment (or restore it) and fill the replay buffer with uniformly random actions."""
        if self.env is None:
            self._build_environment()
        assert self.replay is not None and self.env is not None
        hp = self.hparams
        warm = _check_warm_up(hp.learning_starts, self.replay.capacity, self.env.n_envs, hp.n_step)
        while self.replay.size < warm:
            self.act(1.0)
        self.counters.clock = (time.perf_counter(), self.counters.env_steps)

    # ----------------------------------------------------------------------------------------------- acting
    def epsilon(self, update: int) -> float:
        """Exploration rate after ``update`` gradient updates."""
        hp = self.hparams
        frac = min(1.0, update / hp.epsilon_steps)
        if hp.epsilon_schedule == "linear":
            return hp.epsilon_start + frac * (hp.epsilon_end - hp.epsilon_start)
        if hp.epsilon_start == 0 or hp.epsilon_end == 0:
            return hp.epsilon_start if frac < 1.0 else hp.epsilon_end
        return hp.epsilon_start * (hp.epsilon_end / hp.epsilon_start) ** frac

    @torch.no_grad()
    def act(self, epsilon: float) -> None:
        """One ε-greedy step of all N agents; the transitions go to the replay buffer."""
        env, replay = self.env, self.replay
        assert env is not None and replay is not None and self.explore_rng is not None and self.q_net is not None
        n, n_act = env.n_envs, env.market.n_actions
        randoms = torch.randint(0, n_act, (n,), generator=self.explore_rng, device=self.device)
        if epsilon >= 1.0:
            actions = randoms
        else:
            explore = torch.rand(n, generator=self.explore_rng, device=self.device) < epsilon
            greedy = self.q_net(*env.observe()).argmax(1)
            actions = torch.where(explore, randoms, greedy)
        tr = env.step(actions)
        replay.add(tr.bars, tr.positions, tr.actions, tr.rewards, tr.last)
        c = self.counters
        c.env_steps += n
        c.reward_sum = tr.raw_rewards.sum(dtype=torch.float64) + (c.reward_sum if c.reward_sum is not None else 0.0)
        c.reward_count += n

    # ----------------------------------------------------------------------------------------------- learning
    def training_loss(self, batch: Any, update: int) -> Tensor:
        """Update number ``update`` up to its loss: act, sample, Double DQN target under no_grad, Huber loss.

        The coordinator then runs backward, the non-finite guard, clipping and the optimizer step, and calls
        :meth:`after_update` (the target sync).
        """
        hp = self.hparams
        eps = self.epsilon(update)
        if update % hp.env_step_every == 0 and self.counters.acted_for != update:
            for _ in range(hp.env_steps_per_update):
                self.act(eps)
            self.batches.clear()
            self.counters.acted_for = update
        assert self.env is not None and self.replay is not None and self.q_net is not None
        b = self.batches.next(self.replay, self.env.market, self.q_net, hp.env_step_every)
        loss, q = self._td_loss(b)
        c = self.counters
        c.last_loss, c.last_q, c.last_epsilon = loss.detach(), q, eps
        return loss

    def after_update(self, update: int) -> None:
        self.update_target(update + 1)
        self.maybe_select(update)

    # ----------------------------------------------------------------------------------------------- selection
    def positions_of(self, net: nn.Module, market: MarketTensors) -> Tensor:
        """[T] positions of ``net``'s greedy policy over ``market``: Q(s_t, p) for every bar and held position p in
        batched forward passes, and the position path from the table p_t = argmax_a Q(s_t(p_{t-1}), a) by a parallel
        prefix composition."""
        return greedy_positions(net, market)

    def decision_table(self, net: nn.Module, market: MarketTensors, bars: Tensor | None = None) -> Tensor:
        return greedy_table(net, market, bars=bars)

    def td_loss(self, sample: ReplaySample) -> tuple[Tensor, Tensor]:
        """Huber TD loss of a replay batch and the online Q-values of its states."""
        from foxhunt.rl.batches import prepare_td_batches

        assert self.env is not None and self.q_net is not None
        hp = self.hparams
        b = prepare_td_batches(self.env.market, sample, sample.bars.shape[0], self.q_net, hp.exogenous == "all_actions", hp.n_step)
        return self._td_loss(b[0])

    def _td_loss(self, b: TDBatch) -> tuple[Tensor, Tensor]:
        """Huber TD loss of a prepared batch and the online Q-values of its states.

        Only the sampled states go through the online network with gradient; successor states are evaluated under
        no_grad (so backward touches B rows, not B plus every successor).
        """
        hp, net = self.hparams, self.q_net
        assert net is not None
        if self.obs_noise:
            q = self._noisy_q(net, b)
        else:
            q = net.mlp(b.states) if b.states is not None else net(b.windows, b.positions)
        with torch.no_grad():
            q_next_online, q_next_target = self._successor_values(b)
            if hp.exogenous == "all_actions":
                assert b.rewards is not None
                target = double_dqn_target(q_next_online, q_next_target, b.rewards.reshape(-1), hp.gamma, hp.double_dqn)
                target, prediction = target.view(q.shape[0], -1), q
            else:
                target = double_dqn_target(q_next_online, q_next_target, b.sample.returns, b.sample.discounts, hp.double_dqn)
        if hp.exogenous != "all_actions":
            prediction = q.gather(1, b.sample.actions.unsqueeze(1)).squeeze(1)
        return F.huber_loss(prediction, target, delta=hp.huber_delta), q.detach()

    def _noisy_q(self, net: QNetwork, b: TDBatch) -> Tensor:
        """Online Q-values of the batch's states with Gaussian noise (``obs_noise``) on their feature windows."""
        assert self.noise_rng is not None
        noise = torch.randn(b.windows.shape, generator=self.noise_rng, device=b.windows.device) * self.hparams.obs_noise
        if b.states is not None:  # flat encoder: the window is the first W·F columns of the prepared rows
            n = b.windows.shape[1]
            return net.mlp(torch.cat([b.states[:, :n] + noise, b.states[:, n:]], 1))
        return net(b.windows + noise, b.positions)

    def _successor_values(self, b: TDBatch) -> tuple[Tensor | None, Tensor]:
        """(online, target) Q-values of a batch's successor states (rows B·A in the all-actions mode).

        The online values are only needed for Double DQN's argmax (None otherwise). With a flat encoder the prepared
        input rows serve both networks.
        """

        def values(net: QNetwork) -> Tensor:
            if b.successors is not None:
                return net.mlp(b.successors)
            if b.next_positions is None:
                return net.forward_positions(b.next_windows).flatten(0, 1)
            return net(b.next_windows, b.next_positions)

        assert self.q_net is not None and self.target_net is not None
        return (values(self.q_net) if self.hparams.double_dqn else None), values(self.target_net)

    def update_target(self, updates: int) -> None:
        """Polyak-average the target network every ``polyak_every`` updates, or copy it every ``target_update_every``."""
        hp = self.hparams
        assert self.q_net is not None and self.target_net is not None
        if hp.target_update == "polyak":
            if updates % hp.polyak_every:
                return
            with torch.no_grad():
                for target, online in zip(self.target_net.parameters(), self.q_net.parameters()):
                    target.lerp_(online, hp.tau)
        elif updates % hp.target_update_every == 0:
            self.target_net.load_state_dict(self.q_net.state_dict())

    def training_metrics(self) -> dict[str, float]:
        """TD loss, Q-values, ε, reward per bar of the acting agents since the last log, environment steps per second."""
        c = self.counters
        now = time.perf_counter()
        then, steps_then = c.clock
        c.clock = (now, c.env_steps)
        scale = self.reward_scale_used or 1.0
        out = {
            "epsilon": c.last_epsilon,
            "reward_per_bar": float(c.reward_sum or 0.0) / max(c.reward_count, 1),
            "env_steps": float(c.env_steps),
            "env_steps_per_s": (c.env_steps - steps_then) / max(now - then, 1e-9),
        }
        if c.last_loss is not None and c.last_q is not None:
            out.update({"td_loss": float(c.last_loss), "q_mean": float(c.last_q.mean()) / scale,
                        "q_max": float(c.last_q.max()) / scale})
        c.reward_sum, c.reward_count = None, 0
        return out

    def run_length_settings(self) -> dict[str, int]:
        hp = self.hparams
        settings = {"epsilon_steps": int(hp.epsilon_steps)}
        if hp.target_update == "hard":
            settings["target_update_every"] = int(hp.target_update_every)
        return settings

    def check_run(self, planned_updates: int) -> list[str]:
        hp = self.hparams
        notes = super().check_run(planned_updates)
        if hp.epsilon_steps > planned_updates:
            notes.append(f"epsilon_steps={hp.epsilon_steps} exceeds the {planned_updates} updates of this run: exploration "
                         f"ends at epsilon {self.epsilon(planned_updates):.3f}, not epsilon_end={hp.epsilon_end}")
        if hp.target_update == "hard" and hp.target_update_every > planned_updates:
            notes.append(f"target_update_every={hp.target_update_every} exceeds the {planned_updates} updates of this run: "
                         "the target network never leaves its initial weights")
        return notes

    # ----------------------------------------------------------------------------------------------- evaluation
    greedy_positions = Agent.policy_positions  # the greedy policy it trades over a whole split (the former name)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def run_state(self) -> dict[str, Any]:
        """Environment, replay buffer, RNGs and unused presampled batches: a resumed run continues exactly."""
        state = super().run_state()  # the guard and the validation candidates
        if self.env is None:
            return state
        assert self.replay is not None and self.explore_rng is not None
        state.update({
            "env": self.env.state_dict(),
            "replay": self.replay.state_dict(),
            "explore_rng": self.explore_rng.get_state(),
            "env_steps": self.counters.env_steps,
            "acted_for": self.counters.acted_for,
            "reward_scale": self.reward_scale_used,
            "presampled": self.batches.state_dict(),
            "noise_rng": self.noise_rng.get_state() if self.noise_rng is not None else None,
            "selection": self.selection.state_dict(self.finished),
        })
        return state

    def load_run_state(self, state: dict[str, Any]) -> None:
        super().load_run_state(state)
        if "env" in state:
            self.reward_scale_used = state["reward_scale"]
            self._pending_state = state
            self.env = None  # rebuilt on the right device at start, then the state is applied

    def _apply_run_state(self, state: dict[str, Any]) -> None:
        assert self.env is not None and self.replay is not None and self.explore_rng is not None and self.q_net is not None
        self.env.load_state_dict(state["env"])
        self.replay.load_state_dict(state["replay"])
        self.explore_rng.set_state(state["explore_rng"].cpu())
        self.counters.env_steps = int(state["env_steps"])
        self.counters.acted_for = int(state.get("acted_for", -1))  # (absent from checkpoints before it was kept)
        if state.get("noise_rng") is not None and self.noise_rng is not None:
            self.noise_rng.set_state(state["noise_rng"].cpu())
        self.load_selection_state(state.get("selection"))
        self.batches.load_state_dict(state.get("presampled"), self.env.market, self.q_net)
