"""DQNModule: a Double DQN that trades a MarketSplit through a vectorised market environment.

Each update (``updates_per_step`` of them per ``training_step``, under manual optimisation) first steps all N
agents with the ε-greedy online policy every ``env_step_every`` updates, storing the transitions (as bar indices
and positions) in the on-device replay buffer, then takes one gradient step on the Huber TD loss against Double DQN
targets from a target network. The dataloader only drives the loop (:class:`StepDataset`). Validation runs the
greedy policy over the whole validation split in one vectorised pass.

Usage::

    module = DQNModule(n_features=split.n_features, window=16, gradient_clip_val=10.0)
    module.attach_market(train_split, val_split)
    Trainer(max_steps=20_000).fit(module)   # max_steps counts gradient updates
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from foxhunt.data.market import MarketSplit
from foxhunt.evaluation.trading import bars_per_year as infer_bars_per_year
from foxhunt.evaluation.trading import trading_metrics
from foxhunt.models.qnet import EncoderKind, QNetwork
from foxhunt.rl.env import MarketEnv, MarketTensors, RewardSource, greedy_positions
from foxhunt.rl.replay import ReplayBuffer, ReplaySample
from foxhunt.training.gradnorm import grad_norms
from foxhunt.training.guard import GuardPolicy, NonFiniteGuard
from foxhunt.training.optim import SchedulerKind, configure_adamw

TargetUpdate = Literal["hard", "polyak"]
EpsilonSchedule = Literal["linear", "exponential"]
ExogenousMode = Literal["none", "all_actions"]


class StepDataset(Dataset[int]):
    """``n`` dummy items: one per training step (the module generates its own data by acting)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"need at least one step per epoch, got {n}")
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


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


@dataclass
class _Counters:
    """Running tallies of the acting loop (not parameters: they travel in the checkpoint's run state)."""

    env_steps: int = 0  # steps of single agents so far
    reward_sum: Tensor | None = None  # raw reward since the last log (a tensor, so no device sync per step)
    reward_count: int = 0
    clock: tuple[float, int] = field(default_factory=lambda: (time.perf_counter(), 0))


class _TDBatch(NamedTuple):
    """A replay batch with the parameter-free inputs of its TD loss (see DQNModule._prepare)."""

    sample: ReplaySample
    windows: Tensor  # [B, W·F] states' windows
    positions: Tensor  # [B, A] one-hot held positions
    next_windows: Tensor  # [B, W·F] successors' windows
    next_positions: Tensor | None  # [B, A]; None: every held position (all-actions mode)
    rewards: Tensor | None  # [B, A] reward of every action (all-actions mode)
    states: Tensor | None  # [B, in] the networks' input rows (flat encoder only)
    successors: Tensor | None  # [B·P, in] or [B, in] successor input rows (flat encoder only)


class DQNModule(L.LightningModule):
    """Double DQN trader over a vectorised market environment (see the module docstring)."""

    def __init__(
        self,
        n_features: int,
        window: int = 16,
        actions: tuple[float, ...] = (-1.0, 0.0, 1.0),
        n_envs: int = 256,
        episode_length: int = 256,
        cost_bps: float = 1.0,
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
        updates_per_step: int = 16,
        gradient_clip_val: float | None = 10.0,
        exogenous: ExogenousMode = "all_actions",
        huber_delta: float = 1.0,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        fused_adamw: bool = True,
        scheduler: SchedulerKind = "none",
        total_steps: int | None = None,
        warmup_steps: int = 0,
        nonfinite: GuardPolicy = "raise",
        log_grad_norm_every: int = 100,
        steps_per_epoch: int = 1_000,
        bars_per_year: float | None = None,
        seed: int = 0,
    ) -> None:
        """
        Args:
            n_features: feature columns of the MarketSplit.
            window: bars of features in one observation (t-window+1..t).
            actions: target positions the agent can choose (short/flat/long by default).
            n_envs: parallel agents stepped in one call.
            episode_length: decisions per episode (episodes start flat at random bars).
            cost_bps: proportional cost per unit of position traded, in basis points.
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
            updates_per_step: gradient updates per Lightning training step. The update of a small Q-network takes
                about a millisecond on CPU, as long as the Trainer's own per-step bookkeeping, so several run in one
                step; ``max_steps``, ε, schedules and ``global_step`` still count single updates. Inside an
                EnsembleModule the coordinator's ``dqn_updates_per_joint_step`` sets the pace instead.
            gradient_clip_val: clip gradients to this global 2-norm before each update (None or 0: no clipping).
                The module clips itself (it optimises manually): do not set the Trainer's ``gradient_clip_val``.
                Inside an EnsembleModule the coordinator's ``gradient_clip_val`` applies instead.
            exogenous: "all_actions" regresses Q(s, a) for every action of a sampled state onto its known reward
                plus the bootstrapped value of (t+1, a); "none" is plain DQN on the taken action.
            huber_delta: Huber loss threshold (in reward units).
            lr: AdamW learning rate.
            weight_decay: AdamW decoupled weight decay (matrices only).
            fused_adamw: use PyTorch's fused AdamW kernel where the parameters' device supports it (the small
                Q-network's update is dominated by per-parameter op overhead on CPU otherwise).
            scheduler: learning-rate schedule ("none", "step", "cosine", "plateau").
            total_steps: updates the cosine schedule spans (defaults to the Trainer's estimate).
            warmup_steps: linear LR warm-up updates.
            nonfinite: "raise" on a NaN/Inf loss or gradient, or "skip" the update and count it.
            log_grad_norm_every: log gradient norms every this many updates (0: never).
            steps_per_epoch: gradient updates per epoch.
            bars_per_year: annualisation of validation Sharpe; None infers it from the split's timestamps.
            seed: seeds network initialisation, environment, replay sampling and exploration.
        """
        super().__init__()
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
        counts = (batch_size, env_steps_per_update, env_step_every, updates_per_step, target_update_every, polyak_every)
        if min(*counts, epsilon_steps) < 1:
            raise ValueError(
                "batch_size, env_steps_per_update, env_step_every, updates_per_step, target_update_every, polyak_every"
                " and epsilon_steps must be >= 1"
            )
        if gradient_clip_val is not None and not gradient_clip_val >= 0:
            raise ValueError(f"gradient_clip_val must be >= 0 or None, got {gradient_clip_val}")
        if replay_capacity < n_envs * max(2, n_step):
            raise ValueError(f"replay_capacity ({replay_capacity}) must hold at least {max(2, n_step)} steps of {n_envs} agents")
        self.automatic_optimization = False  # several updates per training step (see updates_per_step)
        self.build_networks(n_features)
        self.guard = NonFiniteGuard(nonfinite)
        self.train_split: MarketSplit | None = None
        self.val_split: MarketSplit | None = None
        self.env: MarketEnv | None = None
        self.replay: ReplayBuffer | None = None
        self.explore_rng: torch.Generator | None = None
        self._val_market: MarketTensors | None = None
        self._pending_state: dict[str, Any] | None = None
        self._val_objective: float | None = None
        self._step = 0  # the update in progress (global_step before its optimizer step)
        self._presampled: list[_TDBatch] = []  # replay batches drawn ahead, until the next environment step
        self.reward_scale_used: float | None = None
        self.counters = _Counters()  # a plain object: nn.Module attribute writes are slow in the hot loop
        self._lean_update = False  # decided at train start: see lean_update_possible

    @property
    def env_steps(self) -> int:
        """Single-agent environment steps taken so far (warm-up included)."""
        return self.counters.env_steps

    # ----------------------------------------------------------------------------------------------- data
    def attach_market(self, train: MarketSplit, val: MarketSplit | None = None) -> None:
        """Give the module its training market (the environment) and, optionally, the validation market."""
        if train.n_features != self.hparams.n_features:
            raise ValueError(
                f"train split {train.name!r} has {train.n_features} features, the module was built for "
                f"n_features={self.hparams.n_features}"
            )
        if val is not None and val.n_features != train.n_features:
            raise ValueError(f"validation split {val.name!r} has {val.n_features} features, train has {train.n_features}")
        self.train_split, self.val_split = train, val
        self.env, self.replay, self._val_market = None, None, None

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(StepDataset(math.ceil(hp.steps_per_epoch / hp.updates_per_step)), batch_size=None, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(StepDataset(1), batch_size=None, shuffle=False)

    def _market(self, split: MarketSplit) -> MarketTensors:
        hp = self.hparams
        return MarketTensors(
            split, hp.window, tuple(hp.actions), hp.cost_bps, hp.reward_source,
            1.0 if self.reward_scale_used is None else self.reward_scale_used, device=self.device,
        )

    def _build_environment(self) -> None:
        """Environment, replay buffer and exploration RNG on the module's device (then a resumed state, if any)."""
        if self.train_split is None:
            raise RuntimeError("DQNModule has no market: call module.attach_market(train_split, val_split) before fit")
        hp = self.hparams
        market = self._market(self.train_split)
        if self.reward_scale_used is None:
            if hp.reward_scale is not None:
                scale = float(hp.reward_scale)
            else:
                std = float(market.signal[market.decision].std())
                if not math.isfinite(std) or std <= 0:
                    raise ValueError(f"train split {self.train_split.name!r}: returns have no spread to scale rewards by")
                scale = 1.0 / std
            self.reward_scale_used = scale
        market.reward_scale = self.reward_scale_used
        self.env = MarketEnv(market, hp.n_envs, hp.episode_length, seed=hp.seed)
        self.replay = ReplayBuffer(hp.replay_capacity, hp.n_envs, device=self.device, seed=hp.seed + 1)
        self.explore_rng = torch.Generator(device=self.device)
        self.explore_rng.manual_seed(hp.seed + 2)
        if self._pending_state is not None:
            self._load_run_state(self._pending_state)
            self._pending_state = None

    # ----------------------------------------------------------------------------------------------- acting
    def epsilon(self, update: int | None = None) -> float:
        """Exploration rate after ``update`` gradient updates."""
        hp = self.hparams
        u = self.global_step if update is None else update
        frac = min(1.0, u / hp.epsilon_steps)
        if hp.epsilon_schedule == "linear":
            return hp.epsilon_start + frac * (hp.epsilon_end - hp.epsilon_start)
        if hp.epsilon_start == 0 or hp.epsilon_end == 0:
            return hp.epsilon_start if frac < 1.0 else hp.epsilon_end
        return hp.epsilon_start * (hp.epsilon_end / hp.epsilon_start) ** frac

    @torch.no_grad()
    def _env_step(self, epsilon: float) -> None:
        env, replay = self.env, self.replay
        assert env is not None and replay is not None and self.explore_rng is not None
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

    def on_train_start(self) -> None:
        if self.env is None:
            self._build_environment()
        assert self.replay is not None and self.env is not None
        warm = math.ceil(self.hparams.learning_starts / self.env.n_envs)
        while self.replay.size < max(warm, self.hparams.n_step + 1):
            self._env_step(1.0)
        self.counters.clock = (time.perf_counter(), self.counters.env_steps)
        self._params = (list(self.target_net.parameters()), list(self.q_net.parameters()))
        self._lean_update = lean_update_possible(self.trainer, self)

    # ----------------------------------------------------------------------------------------------- learning
    def act_and_td_loss(self, update: int) -> tuple[Tensor, Tensor, float]:
        """Before gradient update number ``update``: step the agents (every ``env_step_every`` updates), then the TD
        loss of the next replay batch. Returns (loss, online Q of the batch's states, ε). The ensemble calls it too."""
        hp = self.hparams
        eps = self.epsilon(update)
        if update % hp.env_step_every == 0:
            for _ in range(hp.env_steps_per_update):
                self._env_step(eps)
            self._presampled = []  # new transitions: draw afresh
        loss, q = self._td_loss(self._next_batch())
        return loss, q, eps

    def td_loss(self, sample: ReplaySample) -> tuple[Tensor, Tensor]:
        """Huber TD loss of a replay batch and the online Q-values of its states."""
        return self._td_loss(self._prepare(sample, sample.bars.shape[0])[0])

    def _prepare(self, draw: ReplaySample, batch_size: int) -> list[_TDBatch]:
        """The parameter-free inputs of the TD loss (window gathers, position one-hots, all-action rewards, and with
        a flat encoder the networks' whole inputs) for a draw of one or more batches, computed for the whole draw
        at once, since they cost per call rather than per row, then split into batches of ``batch_size``.

        Rows t-W+1 .. t+1 are gathered once per sample: the state's window is the first W rows, the successor's the
        last W. In the all-actions mode the successors of (t, p) are (t+1, a) for every action a, one input row each.
        """
        assert self.env is not None
        market, hp, net = self.env.market, self.hparams, self.q_net
        all_actions = hp.exogenous == "all_actions"
        n_feat = market.n_features
        both = market.windows(draw.bars, extra=1, flat=True)
        windows, next_windows = both[:, : both.shape[1] - n_feat], both[:, n_feat:]
        if not all_actions and hp.n_step != 1:
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
            _TDBatch(*fields)
            for fields in zip(
                samples, split(windows), split(positions), split(next_windows), split(next_positions),
                split(rewards), split(states), split(successors, per_sample), strict=True,
            )
        ]

    def _td_loss(self, b: _TDBatch) -> tuple[Tensor, Tensor]:
        """Huber TD loss of a prepared batch and the online Q-values of its states.

        Only the sampled states go through the online network with gradient; successor states are evaluated under
        no_grad (so backward touches B rows, not B plus every successor).
        """
        hp, net = self.hparams, self.q_net
        q = net.mlp(b.states) if b.states is not None else net(b.windows, b.positions)
        with torch.no_grad():
            q_next_online, q_next_target = self._successor_values(b)
            if hp.exogenous == "all_actions":
                target = double_dqn_target(q_next_online, q_next_target, b.rewards.reshape(-1), hp.gamma, hp.double_dqn)
                target, prediction = target.view(q.shape[0], -1), q
            else:
                target = double_dqn_target(q_next_online, q_next_target, b.sample.returns, b.sample.discounts, hp.double_dqn)
        if hp.exogenous != "all_actions":
            prediction = q.gather(1, b.sample.actions.unsqueeze(1)).squeeze(1)
        return F.huber_loss(prediction, target, delta=hp.huber_delta), q.detach()

    def _successor_values(self, b: _TDBatch) -> tuple[Tensor | None, Tensor]:
        """(online, target) Q-values of a batch's successor states (rows B·P in the all-actions mode).

        The online values are only needed for Double DQN's argmax (None otherwise). With a flat encoder the prepared
        input rows serve both networks.
        """

        def values(net: QNetwork) -> Tensor:
            if b.successors is not None:
                return net.mlp(b.successors)
            if b.next_positions is None:
                return net.forward_positions(b.next_windows).flatten(0, 1)
            return net(b.next_windows, b.next_positions)

        return (values(self.q_net) if self.hparams.double_dqn else None), values(self.target_net)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """Up to ``updates_per_step`` updates (fewer at the end of an epoch or at ``max_steps``)."""
        hp = self.hparams
        n = min(hp.updates_per_step, hp.steps_per_epoch - batch_idx * hp.updates_per_step)
        max_steps = self.trainer.max_steps
        if max_steps is not None and max_steps >= 0:
            n = min(n, max_steps - self.global_step)
        opt = self.optimizers()
        sched = self.lr_schedulers()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched = None  # stepped on the validation metric at epoch end
        every = self.trainer.log_every_n_steps
        step = self.global_step  # counted here: the Trainer's property walks several objects per read
        for _ in range(n):
            self._step = step
            loss, q, eps, stepped = self._update(opt, sched, step)
            if stepped:
                step += 1
                if every and step % every == 0:
                    self._log_training(loss, q, eps)

    def _update(self, opt: Any, sched: Any, step: int) -> tuple[Tensor, Tensor, float, bool]:
        """Gradient update number ``step`` (after stepping the agents, every ``env_step_every`` updates)."""
        loss, q, eps = self.act_and_td_loss(step)
        if not self.guard.check_loss(loss, step):
            return loss, q, eps, False
        for p in self._params[1]:  # the optimizer's (or the module's) zero_grad costs several times more per call
            p.grad = None
        if self._lean_update:
            # What manual_backward and opt.step do when no callback, precision plugin, strategy or profiler listens
            # (see lean_update_possible): the same calls in the same order, without the per-call hook dispatch.
            loss.backward()
            opt._on_before_step()  # Lightning's step progress (global_step) and profiler bookkeeping
            self.on_before_optimizer_step(opt.optimizer)
            opt.optimizer.step()
            opt._on_after_step()
        else:
            self.manual_backward(loss)
            opt.step()  # on_before_optimizer_step: non-finite guard, grad-norm logging, clipping
        if sched is not None:
            sched.step()
        self.update_target(step + 1)
        return loss, q, eps, True

    def _next_batch(self) -> _TDBatch:
        """The next replay batch, prepared. The buffer does not change between environment steps, so the batches of
        the ``env_step_every`` updates until the next step are drawn and prepared in one call (uniform sampling
        either way)."""
        if not self._presampled:
            assert self.replay is not None
            hp = self.hparams
            draw = self.replay.sample(hp.batch_size * hp.env_step_every, hp.n_step, hp.gamma)
            self._presampled = self._prepare(draw, hp.batch_size)[::-1]
        return self._presampled.pop()

    def _log_training(self, loss: Tensor, q: Tensor, eps: float) -> None:
        c = self.counters
        now = time.perf_counter()
        then, steps_then = c.clock
        c.clock = (now, c.env_steps)
        scale = self.reward_scale_used or 1.0
        self._log_at_update({
            "train/td_loss": float(loss.detach()),
            "train/q_mean": float(q.mean()) / scale,
            "train/q_max": float(q.max()) / scale,
            "train/epsilon": eps,
            "train/reward_per_bar": float(c.reward_sum or 0.0) / max(c.reward_count, 1),
            "train/env_steps_per_s": (c.env_steps - steps_then) / max(now - then, 1e-9),
            "train/nonfinite_skipped": float(self.guard.skipped),
            "train/lr": float(self.optimizers().param_groups[0]["lr"]),
        })
        c.reward_sum, c.reward_count = None, 0

    def _log_at_update(self, metrics: dict[str, float]) -> None:
        """Training metrics go to the loggers at the update count (the x-axis RL users read), and to the callbacks.

        Callbacks (ModelCheckpoint, EarlyStopping) read ``trainer.callback_metrics``; the values are put there
        directly because ``self.log`` costs about a millisecond per key in Lightning 2.6 (it deep-copies its metadata
        on every call), more than a whole update, and these metrics are per-update snapshots with nothing to reduce.
        """
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.global_step)
        self.trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in metrics.items()})

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients are final (unscaled) here: guard them, log their norms, clip them."""
        hp = self.hparams
        step = self._step
        every = hp.log_grad_norm_every
        if every and step % every == 0:
            norms = grad_norms(self.q_net, prefix="train/grad_norm")
            if norms:
                self._log_at_update({k: float(v) for k, v in norms.items()})
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            # 16-mixed: the GradScaler skips overflowing steps itself and lowers its scale (expected, not an error).
            if hp.gradient_clip_val:
                torch.nn.utils.clip_grad_norm_(self.q_net.parameters(), hp.gradient_clip_val)
            return
        self.guard.clip_gradients(self.q_net, hp.gradient_clip_val, step, params=self._params[1])

    def on_validation_epoch_end(self) -> None:
        """A plateau schedule steps on this validation's negated reward per bar (manual optimisation steps it)."""
        sched = self.lr_schedulers()
        plateau = isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if plateau and self._val_objective is not None and not self.trainer.sanity_checking:
            sched.step(self._val_objective)
        self._val_objective = None

    def update_target(self, updates: int) -> None:
        """Polyak-average the target network every ``polyak_every`` updates, or copy it every ``target_update_every``."""
        hp = self.hparams
        if hp.target_update == "polyak":
            if updates % hp.polyak_every:
                return
            with torch.no_grad():
                torch._foreach_lerp_(*self._params, hp.tau)
        elif updates % hp.target_update_every == 0:
            self.target_net.load_state_dict(self.q_net.state_dict())

    def build_networks(self, n_features: int) -> None:
        """(Re)build the online and target Q-networks for ``n_features`` inputs, seeded (stacking widens them)."""
        hp = self.hparams
        hp.n_features = n_features
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            net_args = {
                "n_features": n_features, "window": hp.window, "n_actions": len(hp.actions),
                "n_position_features": len(hp.actions), "hidden": tuple(hp.hidden), "layer_norm": hp.layer_norm,
                "dueling": hp.dueling, "encoder": hp.encoder,
            }
            self.q_net = QNetwork(**net_args)  # type: ignore[arg-type]
            self.target_net = QNetwork(**net_args)  # type: ignore[arg-type]
        self.target_net.load_state_dict(self.q_net.state_dict())
        self.target_net.requires_grad_(False)
        self._params = (list(self.target_net.parameters()), list(self.q_net.parameters()))

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        total = hp.total_steps
        if hp.scheduler == "cosine" and total is None:
            total = self._estimated_updates()
        config = configure_adamw(
            self.q_net, lr=hp.lr, weight_decay=hp.weight_decay, scheduler=hp.scheduler, total_steps=total,
            warmup_steps=hp.warmup_steps, monitor="val/reward_per_bar_neg",
            interval="epoch" if hp.scheduler == "plateau" else "step",
        )
        if hp.fused_adamw:
            _prefer_fused(config["optimizer"] if isinstance(config, dict) else config)
        if isinstance(config, dict):
            # Manual optimisation: the module steps its schedule itself (the plateau one on validation reward).
            config["lr_scheduler"] = {k: v for k, v in config["lr_scheduler"].items() if k not in ("monitor", "strict")}
        return config

    def _estimated_updates(self) -> int:
        """Updates this fit will take: max_steps, or the Trainer's batches times the updates each one runs."""
        if self.trainer.max_steps is not None and self.trainer.max_steps > 0:
            return int(self.trainer.max_steps)
        return int(self.trainer.estimated_stepping_batches) * int(self.hparams.updates_per_step)

    # ----------------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def greedy_positions(self, split: MarketSplit | MarketTensors, chunk: int = 65_536) -> tuple[Tensor, MarketTensors]:
        """[T] positions of the greedy policy over a whole split (flat where no decision can be taken), and its market.

        Q(s_t, p) is evaluated for every bar and every held position p in batched forward passes, and the position
        path follows from the table p_t = argmax_a Q(s_t(p_{t-1}), a) by a parallel prefix composition.
        """
        market = split if isinstance(split, MarketTensors) else self._market(split)
        was_training = self.q_net.training
        self.q_net.eval()
        try:
            return greedy_positions(self.q_net, market, chunk), market
        finally:
            self.q_net.train(was_training)

    def evaluate(self, split: MarketSplit) -> dict[str, float]:
        """Back-test metrics of the greedy policy on ``split`` (raw returns, raw costs)."""
        positions, market = self.greedy_positions(split)
        bpy = self.hparams.bars_per_year or infer_bars_per_year(split.timestamps, split.symbol_index)
        m = trading_metrics(positions, market.returns, market.cost_bps, bpy, mask=market.decision, reset=market.reset_mask)
        return {k: float(v) for k, v in m.as_dict().items()}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.val_split is None:
            return
        if self._val_market is None or self._val_market.device != self.device:
            self._val_market = self._market(self.val_split)
        positions, market = self.greedy_positions(self._val_market)
        bpy = self.hparams.bars_per_year or infer_bars_per_year(self.val_split.timestamps, self.val_split.symbol_index)
        m = trading_metrics(positions, market.returns, market.cost_bps, bpy, mask=market.decision, reset=market.reset_mask)
        metrics = {f"val/{k}": v.float() for k, v in m.as_dict().items() if k in _VAL_KEYS}
        metrics["val/reward_per_bar_neg"] = -metrics["val/reward_per_bar"]
        self._val_objective = float(metrics["val/reward_per_bar_neg"])
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def _run_state(self) -> dict[str, Any]:
        assert self.env is not None and self.replay is not None and self.explore_rng is not None
        return {
            "env": self.env.state_dict(),
            "replay": self.replay.state_dict(),
            "explore_rng": self.explore_rng.get_state(),
            "guard": self.guard.state_dict(),
            "env_steps": self.counters.env_steps,
            "reward_scale": self.reward_scale_used,
            # batches drawn ahead and not used yet (in order of use), so a resumed run trains on the same ones
            "presampled": ReplaySample.cat([b.sample for b in self._presampled[::-1]]).state_dict() if self._presampled else None,
        }

    def _load_run_state(self, state: dict[str, Any]) -> None:
        assert self.env is not None and self.replay is not None and self.explore_rng is not None
        self.env.load_state_dict(state["env"])
        self.replay.load_state_dict(state["replay"])
        self.explore_rng.set_state(state["explore_rng"].cpu())
        self.guard.load_state_dict(state["guard"])
        self.counters.env_steps = int(state["env_steps"])
        ahead = state.get("presampled")
        if ahead is not None:
            dev = self.device
            draw = ReplaySample.from_state_dict({k: v.to(dev) for k, v in ahead.items()})
            self._presampled = self._prepare(draw, self.hparams.batch_size)[::-1]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Environment, replay buffer and RNGs travel in the checkpoint, so a resumed run continues exactly."""
        if self.env is not None:
            checkpoint["dqn_run_state"] = self._run_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("dqn_run_state")
        if state is not None:
            self.reward_scale_used = state["reward_scale"]
            self._pending_state = state
            self.env = None  # rebuilt on the right device at train start, then the state is applied


_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


def lean_update_possible(trainer: L.Trainer, module: L.LightningModule) -> bool:
    """True when Lightning's per-update backward and optimizer-step dispatch does nothing observable.

    That is: one device (no DDP gradient hooks), a precision plugin that neither scales nor casts gradients (32-true,
    or bf16-mixed whose autocast already wraps ``training_step``), no profiler, no Trainer-level clipping, and no
    callback or module override of the backward and optimizer-step hooks beyond this module's own
    ``on_before_optimizer_step``. Then an update may call ``backward`` and the optimizer directly: Lightning's
    dispatch costs about a fifth of a small Q-network's update. Otherwise every update goes through Lightning.
    """
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.profilers import PassThroughProfiler
    from lightning.pytorch.strategies import SingleDeviceStrategy

    plugin = trainer.precision_plugin
    plain_precision = type(plugin) is Precision or (type(plugin) is MixedPrecision and plugin.scaler is None)
    callbacks_listen = any(
        getattr(type(cb), hook) is not getattr(L.Callback, hook) for cb in trainer.callbacks for hook in _STEP_HOOKS
    )
    module_listens = any(
        getattr(type(module), hook) is not getattr(L.LightningModule, hook)
        for hook in ("on_before_backward", "on_after_backward", "backward", "optimizer_step")
    )
    return (
        plain_precision
        and type(trainer.strategy) is SingleDeviceStrategy
        and isinstance(trainer.profiler, PassThroughProfiler)
        and not trainer.gradient_clip_val
        and not callbacks_listen
        and not module_listens
    )


def _prefer_fused(optimizer: torch.optim.Optimizer) -> None:
    """Switch AdamW to its fused kernel before its first step, where every parameter's device and dtype allow it."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or not params:
        return
    if all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params):
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False


_VAL_KEYS = ("reward_per_bar", "sharpe", "total_log_return", "max_drawdown", "turnover", "hit_rate", "n_trades", "exposure")
