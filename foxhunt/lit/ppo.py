"""PPOModule: a PPO agent member (Schulman et al. 2017, as CleanRL's ``ppo.py`` does it) trading a MarketSplit.

The coordinator (:class:`foxhunt.lit.ensemble.EnsembleModule`) trains it, alone (``ppo.yaml``) or with other members.
One coordinator update is one minibatch gradient step. :meth:`PPOModule.training_loss` reads top to bottom like
CleanRL's update: when the current rollout is used up (``n_epochs`` x ``n_minibatches`` minibatches, or stopped early
because the approximate KL passed ``target_kl`` at the end of an epoch) it collects a new one (N agents x T steps of
the stochastic policy on the vectorised market, then the critic's values and GAE(λ), truncations bootstrapped from
the final state's value; :mod:`foxhunt.rl.rollout`); then it takes the next shuffled minibatch: the new log-probabilities
and values, the ratio, the approximate KL, advantages normalised per minibatch, the clipped surrogate, the (clipped)
value loss and the entropy bonus. The coordinator runs backward, the non-finite guard, gradient clipping
(``gradient_clip_val``, CleanRL's ``max_grad_norm``) and the AdamW step; the learning rate anneals linearly to 0 per
update by default.

Actions: ``action_space="discrete"`` picks a target position of ``actions`` from a categorical distribution;
``"continuous"`` picks a position in [-1, 1] from a squashed Gaussian (tanh with the log-Jacobian correction, see
:mod:`foxhunt.models.actor_critic` and ``docs/PPO.md`` for why not a Beta). Both observe the feature window and the
held position. Back-tests use the deterministic policy (argmax / tanh of the mean) over a whole split: a policy table
rolled out by parallel prefix composition (discrete), or bar by bar vectorised over symbols (continuous).

Usage::

    member = PPOModule(window=16)
    model = EnsembleModule(members={"ppo": member})
    Trainer(max_steps=20_000).fit(model, datamodule=MarketDataModule(train_split, val_split))
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.lit.member import Agent
from foxhunt.models.actor_critic import (
    ActionSpace,
    ActorCritic,
    squashed_normal_entropy,
    squashed_normal_log_prob,
)
from foxhunt.rl.env import (
    ContinuousMarketEnv,
    MarketEnv,
    MarketTensors,
    RewardSource,
    greedy_positions,
    greedy_table,
    reward_scale_for,
    sequential_positions,
)
from foxhunt.rl.rollout import RolloutBatch, RolloutBuffer
from foxhunt.training.optim import Optimization, configure_adamw, prefer_fused

PPOScheduler = Literal["none", "linear", "step", "cosine", "plateau"]
INPUTS_BYTES = 128 << 20  # largest rollout of network inputs kept for minibatches to select from (else gathered)


def clipped_surrogate_loss(ratio: Tensor, advantages: Tensor, clip_coef: float) -> Tensor:
    """PPO's policy loss: mean of max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)) (the negated clipped surrogate objective)."""
    negated = -advantages
    return torch.max(negated * ratio, negated * torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef)).mean()


def approx_kl(logratio: Tensor) -> Tensor:
    """The low-variance estimator of KL(π_old || π_new) from log(π_new / π_old) of the sampled actions:
    mean((ρ − 1) − log ρ) (Schulman's k3; CleanRL's approx_kl)."""
    return (logratio.exp() - 1.0 - logratio).mean()


def value_loss(new_values: Tensor, old_values: Tensor, returns: Tensor, clip_coef: float | None) -> Tensor:
    """½·mean of the squared error to the returns; with ``clip_coef``, the larger of it and the error of the old value
    moved by at most ``clip_coef`` toward the new one (PPO2's value clipping)."""
    unclipped = (new_values - returns) ** 2
    if clip_coef is None:
        return 0.5 * unclipped.mean()
    clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    return 0.5 * torch.max(unclipped, (clipped - returns) ** 2).mean()


class LinearDecay:
    """LambdaLR factor: linear warm-up, then linear decay from 1 to 0 at ``total_steps`` (CleanRL's LR annealing,
    per update). A class, not a lambda, so the scheduler pickles into checkpoints."""

    def __init__(self, total_steps: int, warmup_steps: int = 0) -> None:
        if total_steps <= 0 or not 0 <= warmup_steps < total_steps:
            raise ValueError(f"linear schedule needs total_steps > warmup_steps >= 0, got {total_steps}, {warmup_steps}")
        self.total_steps, self.warmup_steps = total_steps, warmup_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return max(0.0, 1.0 - (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))


@dataclass(frozen=True)
class PPOOptimization(Optimization):
    """PPO's optimisation defaults, CleanRL's: 3e-4 annealed linearly to 0, AdamW epsilon 1e-5 (the "37
    implementation details"), no weight decay, max gradient norm 0.5, 16 updates a step."""

    lr: float = 3e-4
    eps: float = 1e-5
    weight_decay: float = 0.0
    scheduler: PPOScheduler = "linear"  # type: ignore[assignment]
    gradient_clip_val: float | None = 0.5
    log_grad_norm_every: int = 100
    updates_per_step: int = 16


@dataclass
class _Counters:
    """Running tallies (not parameters: they travel in the checkpoint's run state)."""

    env_steps: int = 0
    rollouts: int = 0
    kl_stops: int = 0
    rollout_seconds: float = 0.0  # time spent collecting rollouts (acting, values, GAE)
    reward_sum: Tensor | None = None  # raw reward since the last log (a tensor: no sync per step)
    reward_count: int = 0
    clock: tuple[float, int, float] = field(default_factory=lambda: (time.perf_counter(), 0, 0.0))
    explained_variance: float = float("nan")
    last: dict[str, Tensor] = field(default_factory=dict)  # the last minibatch's losses and statistics


class PPOModule(Agent):
    """PPO agent over a vectorised market environment (see the module docstring)."""

    def __init__(
        self,
        window: int = 16,
        actions: tuple[float, ...] = (-1.0, 0.0, 1.0),
        action_space: ActionSpace = "discrete",
        n_envs: int = 512,
        n_steps: int = 16,
        episode_length: int = 16,
        cost_bps: float | None = None,
        reward_source: RewardSource = "returns",
        reward_scale: float | None = None,
        gamma: float = 0.7,
        gae_lambda: float = 0.95,
        n_epochs: int = 4,
        n_minibatches: int = 32,
        clip_coef: float = 0.2,
        clip_vloss: bool = True,
        vf_coef: float = 0.5,
        ent_coef: float = 0.01,
        norm_adv: bool = True,
        target_kl: float | None = None,
        hidden: tuple[int, ...] = (64, 64),
        log_std_init: float = 2.0,
        no_trade_band: float = 0.1,
        mean_reg_coef: float = 0.0,
        select_every: int = 80,
        patience: int = 0,
        optim: PPOOptimization | Mapping[str, Any] = PPOOptimization(),
        seed: int = 0,
        n_features: int | None = None,
    ) -> None:
        """
        Args:
            window: bars of features in one observation (t-window+1..t).
            actions: target positions of the discrete policy (short/flat/long by default).
            action_space: "discrete" (categorical over ``actions``) or "continuous" (a position in [-1, 1] from a
                squashed Gaussian).
            n_envs: parallel agents stepped in one call (CleanRL's num_envs).
            n_steps: steps of every agent per rollout (CleanRL's num_steps): a rollout holds n_envs x n_steps steps
                (8,192 at the defaults, 512 x 16: one 16-bar episode per agent; the fastest of three shapes of 8,192
                steps that were all level with the former defaults on validation, docs/PPO.md).
            episode_length: decisions per episode. Episodes start flat at random bars and end by time limit, which is
                bootstrapped from the final state's value, so the length only sets how often the agents learn from a
                flat start: short episodes teach the policy to stay flat when nothing pays (see docs/PPO.md).
            cost_bps: proportional cost per unit of position traded, in basis points; None: the coordinator's.
            reward_source: "returns" (raw log returns) or "targets" (the split's preprocessed targets; costs scaled).
            reward_scale: multiplies rewards; None scales by 1 / std of the training returns at decision bars.
            gamma: discount factor (0.7: the market's rewards are noisy and a position's effect on later rewards is
                only the cost of changing it, so a short horizon keeps advantages precise; see docs/PPO.md).
            gae_lambda: GAE's λ.
            n_epochs: passes over each rollout (CleanRL's update_epochs).
            n_minibatches: shuffled minibatches per epoch; a gradient update takes n_envs x n_steps / n_minibatches
                steps (must divide evenly). The defaults, 4 x 32 (128 updates of 256 steps per 8,192-step rollout),
                were level with the best of the schedules compared on the validation splits of the agents' task family
                (10 x 8) at 2.5x less update arithmetic per step, and were chosen for that by a rule fixed before the
                comparison (docs/PPO.md, "Schedule and rollout shape").
            clip_coef: the surrogate's clipping ε (and the value clipping's, with ``clip_vloss``).
            clip_vloss: clip the value loss around the rollout's values.
            vf_coef: weight of the value loss.
            ent_coef: weight of the entropy bonus.
            norm_adv: normalise advantages per minibatch.
            target_kl: stop using a rollout at the end of an epoch whose last minibatch's approximate KL exceeds this
                (None: never stop early).
            hidden: widths of the actor's and the critic's hidden layers (tanh).
            log_std_init: initial log standard deviation of the continuous policy's Gaussian (state-independent).
                2.0 (σ ≈ 7.4: most samples squash near ±1, exploring like the discrete short/long) was chosen on the
                validation splits of the agents' task family among 0, ±0.5, ±1, 1.5, 2, 3 (docs/PPO.md).
            no_trade_band: continuous positions: a target within this distance of the held position is not traded, in
                training and in the deterministic policy (a no-trade region, as proportional costs call for; see
                docs/PPO.md).
            mean_reg_coef: continuous policy: weight of a penalty on the squared pre-squash mean, mean(μ²) (rlkit's
                ``policy_mean_reg_weight``), which pulls the position toward flat unless the advantages pay for it.
                Off by default: every weight tried (0.03, 0.1) cost validation reward on the signals; staying flat
                where nothing pays is the coordinator's do-no-harm rule's job, as for every agent (docs/PPO.md).
            select_every: updates between scores of the deterministic policy on the validation split (reward per bar
                after costs, as the DQN's); the best-scoring weights become the policy it trades (``policy_net``).
                80 (0.625 of a rollout at the defaults; the setting the schedules were compared with). 0: the last
                weights trade.
            patience: scores without a better validation reward after which the member stops learning (0: never; the
                default, so the learning rate anneals over the whole run).
            optim: the optimisation settings (:class:`~foxhunt.training.optim.Optimization`; fields not given keep
                :class:`PPOOptimization`'s defaults); its ``scheduler`` may also be "linear" (to 0 at ``total_steps``,
                CleanRL's annealing); a plateau schedule watches the validation reward.
            seed: seeds network initialisation, environment, action sampling and minibatch shuffling.
            n_features: feature columns observed; None: taken from the data when the coordinator binds the member.
        """
        super().__init__()
        self.init_optim(PPOOptimization.of(optim))
        optim = self.optim.as_dict()  # noqa: F841 - hyperparameters hold plain values (read by save_hyperparameters)
        self.save_hyperparameters()
        if action_space not in ("discrete", "continuous"):
            raise ValueError(f"action_space must be 'discrete' or 'continuous', got {action_space!r}")
        if not 0.0 <= gamma < 1.0:
            raise ValueError(f"gamma must be in [0, 1), got {gamma}")
        if not 0.0 <= gae_lambda <= 1.0:
            raise ValueError(f"gae_lambda must be in [0, 1], got {gae_lambda}")
        counts = {"window": window, "n_envs": n_envs, "n_steps": n_steps, "episode_length": episode_length,
                  "n_epochs": n_epochs, "n_minibatches": n_minibatches}
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if (n_envs * n_steps) % n_minibatches:
            raise ValueError(f"n_minibatches={n_minibatches} must divide the rollout's n_envs x n_steps = {n_envs * n_steps} steps")
        if not clip_coef > 0:
            raise ValueError(f"clip_coef must be > 0, got {clip_coef}")
        if vf_coef < 0 or ent_coef < 0:
            raise ValueError(f"vf_coef and ent_coef must be >= 0, got {vf_coef}, {ent_coef}")
        if target_kl is not None and not target_kl > 0:
            raise ValueError(f"target_kl must be > 0 or None, got {target_kl}")
        if self.optim.scheduler not in ("none", "linear", "step", "cosine", "plateau"):
            raise ValueError(f"scheduler must be one of none, linear, step, cosine, plateau; got {self.optim.scheduler!r}")
        if cost_bps is not None and cost_bps < 0:
            raise ValueError(f"cost_bps must be >= 0, got {cost_bps}")
        if select_every < 0 or patience < 0:
            raise ValueError(f"select_every and patience must be >= 0, got {select_every}, {patience}")
        if mean_reg_coef < 0:
            raise ValueError(f"mean_reg_coef must be >= 0, got {mean_reg_coef}")
        if not 0.0 <= no_trade_band < 2.0:
            raise ValueError(f"no_trade_band must be in [0, 2), got {no_trade_band}")
        self.continuous = action_space == "continuous"
        # derived from the data and the coordinator at bind time (plain attributes, never hyperparameters)
        self.n_inputs: int | None = None
        self.cost_bps = 1.0 if cost_bps is None else float(cost_bps)
        self.seed = int(seed)
        self.net: ActorCritic | None = None
        self.init_selection(select_every)  # policy_net: the weights chosen on validation (select_every > 0)
        self.register_load_state_dict_pre_hook(self._upgrade_hook)
        self.train_split: MarketSplit | None = None
        self.val_split: MarketSplit | None = None
        self.env: MarketEnv | None = None
        self.rollout: RolloutBuffer | None = None
        self.sample_rng: torch.Generator | None = None
        self._pending_state: dict[str, Any] | None = None
        self.reward_scale_used: float | None = None
        self.counters = _Counters()  # a plain object: nn.Module attribute writes are slow in the hot loop
        if n_features is not None:
            self.build_networks(n_features)

    @property
    def env_steps(self) -> int:
        """Single-agent environment steps taken so far."""
        return self.counters.env_steps

    @property
    def network(self) -> nn.Module:
        if self.net is None:
            raise RuntimeError("PPOModule has no networks yet: bind it to the data (or give n_features)")
        return self.net

    # ----------------------------------------------------------------------------------------------- wiring
    def bind(self, spec: MarketSpec, extra_inputs: int = 0, seed_offset: int = 0, cost_bps: float | None = None) -> None:
        """Networks for the spec's features plus ``extra_inputs`` stacked columns; the coordinator's cost unless the
        member has its own; environment, sampling and shuffling seeded ``seed_offset`` further (one per DDP rank)."""
        hp = self.hparams
        n = spec.n_features + extra_inputs
        if hp.n_features is not None and hp.n_features + extra_inputs != n:
            raise ValueError(f"PPOModule was built for n_features={hp.n_features}, the data has {spec.n_features} features")
        if hp.cost_bps is None and cost_bps is not None:
            self.cost_bps = float(cost_bps)
        self.seed = int(hp.seed) + int(seed_offset)
        if self.n_inputs != n:
            self.build_networks(n)

    def build_networks(self, n_inputs: int) -> None:
        """The actor-critic for ``n_inputs`` feature columns, orthogonally initialised from the seed."""
        hp = self.hparams
        n_act = len(hp.actions)
        args = {"n_features": n_inputs, "window": hp.window, "n_position_features": 1 if self.continuous else n_act,
                "n_actions": n_act, "action_space": hp.action_space, "hidden": tuple(hp.hidden),
                "log_std_init": hp.log_std_init}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            self.net = ActorCritic(**args)  # type: ignore[arg-type]
            if hp.select_every:  # built inside the fork: the global RNG stays untouched
                self.policy_net = ActorCritic(**args)  # type: ignore[arg-type]
        self.freeze_policy_copy()
        self.n_inputs = n_inputs

    def release_environment(self) -> None:
        """Drop the environment and rollout buffer of the previous market."""
        self.env, self.rollout = None, None

    def _build_environment(self) -> None:
        """Environment, rollout buffer and sampling RNG on the module's device (then a resumed state, if any)."""
        if self.train_split is None:
            raise RuntimeError("PPOModule has no market: call module.attach_market(train_split, val_split) before fit")
        hp = self.hparams
        self.warn_without_validation()
        market = self.market_tensors(self.train_split)
        if self.reward_scale_used is None:
            self.reward_scale_used = reward_scale_for(market, hp.reward_scale)
        market.reward_scale = self.reward_scale_used
        if self.continuous:
            self.env = ContinuousMarketEnv(market, hp.n_envs, hp.episode_length, seed=self.seed,
                                           no_trade_band=hp.no_trade_band)
        else:
            self.env = MarketEnv(market, hp.n_envs, hp.episode_length, seed=self.seed)
        self.rollout = RolloutBuffer(hp.n_steps, hp.n_envs, self.continuous, device=self.device, seed=self.seed + 1)
        self.sample_rng = torch.Generator(device=self.device)
        self.sample_rng.manual_seed(self.seed + 2)
        if self._pending_state is not None:
            self._apply_run_state(self._pending_state)
            self._pending_state = None

    def start(self) -> None:
        """Build the environment (or restore it); the first update collects the first rollout."""
        if self.env is None:
            self._build_environment()
        c = self.counters
        c.clock = (time.perf_counter(), c.env_steps, c.rollout_seconds)

    # ----------------------------------------------------------------------------------------------- acting
    def position_features(self, market: MarketTensors, held: Tensor) -> Tensor:
        """[B, P] the held position as the networks see it: one-hot of the action index, or the value itself."""
        return held.unsqueeze(1) if self.continuous else market.position_features(held)

    @torch.no_grad()
    def collect_rollout(self) -> None:
        """n_steps steps of all agents with the stochastic policy, then the critic's values and GAE(λ).

        Only the actor runs per step. The critic then evaluates every visited state in one pass; the value of the
        state after step t is the next step's (the same state: bar + 1, holding the action), except after an
        episode's last step (a time limit: the final state, bar + 1 holding the action, is bootstrapped) and after the
        rollout's last step, which get a second, small pass.
        """
        hp, env, buf, net = self.hparams, self.env, self.rollout, self.net
        assert env is not None and buf is not None and net is not None and self.sample_rng is not None
        t0 = time.perf_counter()
        market, n = env.market, env.n_envs
        reward_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        taken = torch.zeros((hp.n_steps, n), device=self.device) if self.continuous else None  # after the band
        inputs = self._inputs_table()  # every step's network inputs, kept for the critic and the minibatches
        for t in range(hp.n_steps):
            held = env.positions
            x = net.inputs(market.windows(env.bars, flat=True), self.position_features(market, held),
                           out=None if inputs is None else inputs[t * n : (t + 1) * n])
            out = net.actor_out(x)
            if self.continuous:
                noise = torch.randn(n, generator=self.sample_rng, device=self.device)
                u = out + net.actor_logstd.exp() * noise
                log_prob = squashed_normal_log_prob(u, out, net.actor_logstd)
                tr = env.step(torch.tanh(u))
                taken[t] = tr.actions  # type: ignore[index]
                buf.add(t, tr.bars, held, u, log_prob, tr.rewards, tr.last, noise)
            else:
                logp = torch.log_softmax(out.float(), 1)
                draw = torch.rand(n, 1, generator=self.sample_rng, device=self.device)
                action = (logp.exp().cumsum(1) < draw).sum(1).clamp_max(logp.shape[1] - 1)  # inverse-CDF sample
                tr = env.step(action)
                buf.add(t, tr.bars, held, action, logp.gather(1, action.unsqueeze(1)).squeeze(1), tr.rewards, tr.last)
            reward_sum += tr.raw_rewards.sum(dtype=torch.float64)
        if inputs is not None:
            values = torch.cat([net.value(x).float() for x in inputs.split(16_384)]).view_as(buf.rewards)
        else:
            values = self._values(market, buf.bars.view(-1), buf.held.view(-1)).view_as(buf.rewards)
        ends = buf.last.clone()
        ends[-1] = True  # the rollout's last step bootstraps from the state it stopped in
        next_positions = taken[ends] if taken is not None else buf.actions[ends]
        next_values = torch.cat([values[1:], values[:1]], 0)  # V of the next step's state (the last row is an end)
        next_values[ends] = self._values(market, buf.bars[ends] + 1, next_positions)
        buf.finish(values, next_values, hp.gamma, hp.gae_lambda, hp.n_epochs, hp.n_minibatches, hp.norm_adv, inputs)
        c = self.counters
        c.env_steps += n * hp.n_steps
        c.rollouts += 1
        c.reward_sum = reward_sum + (c.reward_sum if c.reward_sum is not None else 0.0)
        c.reward_count += n * hp.n_steps
        c.explained_variance = buf.explained_variance()
        c.rollout_seconds += time.perf_counter() - t0

    def _inputs_table(self) -> Tensor | None:
        """An empty [T·N, W·F + P] table for the network inputs of every step of a rollout (its critic pass and
        minibatches then select rows instead of gathering windows), or None where it would pass ``INPUTS_BYTES``."""
        assert self.env is not None and self.rollout is not None
        market, buf = self.env.market, self.rollout
        width = market.window * market.n_features + (1 if self.continuous else market.n_actions)
        if buf.size * width * 4 > INPUTS_BYTES:
            return None
        return torch.empty(buf.size, width, dtype=market.features.dtype, device=self.device)

    def _rollout_inputs(self) -> Tensor | None:
        """The stored rollout's inputs table (:meth:`_inputs_table`) gathered again from its steps (a resumed
        rollout), or None."""
        assert self.env is not None and self.rollout is not None and self.net is not None
        market, buf = self.env.market, self.rollout
        table = self._inputs_table()
        if table is None:
            return None
        return self.net.inputs(market.windows(buf.bars.view(-1), flat=True),
                               self.position_features(market, buf.held.view(-1)), out=table)

    def _values(self, market: MarketTensors, bars: Tensor, held: Tensor, chunk: int = 16_384) -> Tensor:
        """[B] the critic's values of states (bars, held positions), in chunks (a window gather is W·F per row)."""
        assert self.net is not None
        parts = [
            self.net.value(self.net.inputs(market.windows(b, flat=True), self.position_features(market, h))).float()
            for b, h in zip(bars.split(chunk), held.split(chunk), strict=True)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, device=bars.device)

    # ----------------------------------------------------------------------------------------------- learning
    def training_loss(self, batch: Any, update: int) -> Tensor:
        """Update number ``update`` up to its loss: a new rollout when the last one is used up, then the next
        minibatch's clipped-surrogate, value and entropy terms.

        The coordinator then runs backward, the non-finite guard, clipping and the optimizer step.
        """
        hp, buf, net = self.hparams, self.rollout, self.net
        assert buf is not None and net is not None and self.env is not None
        if buf.exhausted:
            self.collect_rollout()
        mb = buf.next_minibatch()
        market = self.env.market
        x = mb.inputs if mb.inputs is not None else net.inputs(market.windows(mb.bars, flat=True),
                                                                self.position_features(market, mb.held))
        new_log_prob, entropy, mean = self._log_prob_and_entropy(x, mb)
        new_value = net.value(x).float()
        logratio = new_log_prob - mb.log_probs
        ratio = logratio.exp()
        # advantages were normalised per minibatch (norm_adv) by the buffer when the epoch began
        pg_loss = clipped_surrogate_loss(ratio, mb.advantages, hp.clip_coef)
        v_loss = value_loss(new_value, mb.values, mb.returns, hp.clip_coef if hp.clip_vloss else None)
        entropy_loss = entropy.mean()
        loss = pg_loss - hp.ent_coef * entropy_loss + hp.vf_coef * v_loss
        if self.continuous and hp.mean_reg_coef > 0:
            loss = loss + hp.mean_reg_coef * mean.square().mean()  # pulls the pre-squash mean toward flat
        logratio = logratio.detach()  # approximate KL and clip fraction come from it (ratio_statistics) when logged
        if hp.target_kl is not None and buf.at_epoch_end and float(approx_kl(logratio)) > hp.target_kl:
            buf.stop()  # this minibatch still steps; the next update collects a new rollout (CleanRL's epoch break)
            self.counters.kl_stops += 1
        self.counters.last = {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(),
                              "entropy": entropy_loss.detach(), "logratio": logratio}
        return loss

    def after_update(self, update: int) -> None:
        self.maybe_select(update)

    def _log_prob_and_entropy(self, x: Tensor, mb: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
        """log π_new(stored action | state), the policy's entropy at each state of a minibatch, and the actor's output
        (logits, or the Gaussian's mean)."""
        assert self.net is not None
        out = self.net.actor_out(x).float()
        if self.continuous:
            log_std = self.net.actor_logstd
            return (squashed_normal_log_prob(mb.actions, out, log_std),
                    squashed_normal_entropy(out, log_std.expand_as(out), mb.noise), out)
        logp = torch.log_softmax(out, 1)
        return logp.gather(1, mb.actions.unsqueeze(1)).squeeze(1), -(logp.exp() * logp).sum(1), out

    def training_metrics(self) -> dict[str, float]:
        """The last minibatch's losses, entropy, approximate KL and clip fraction; the last rollout's explained
        variance; reward per bar of the acting agents since the last log; environment steps per second and the share
        of time spent collecting rollouts."""
        c = self.counters
        now = time.perf_counter()
        then, steps_then, rollout_then = c.clock
        c.clock = (now, c.env_steps, c.rollout_seconds)
        elapsed = max(now - then, 1e-9)
        out = {k: float(v) for k, v in c.last.items() if k != "logratio"}
        if "logratio" in c.last:
            out.update(self.ratio_statistics(c.last["logratio"]))
        out.update({
            "explained_variance": c.explained_variance,
            "reward_per_bar": float(c.reward_sum or 0.0) / max(c.reward_count, 1),
            "env_steps": float(c.env_steps),
            "env_steps_per_s": (c.env_steps - steps_then) / elapsed,
            "rollout_time_fraction": (c.rollout_seconds - rollout_then) / elapsed,
            "rollouts": float(c.rollouts),
            "kl_stops": float(c.kl_stops),
        })
        if self.continuous and self.net is not None:
            out["std"] = float(self.net.actor_logstd.detach().exp())
        c.reward_sum, c.reward_count = None, 0
        return out

    def ratio_statistics(self, logratio: Tensor) -> dict[str, float]:
        """CleanRL's debug figures of a minibatch: the approximate KL and the fraction of ratios outside the clip."""
        clipfrac = ((logratio.exp() - 1.0).abs() > self.hparams.clip_coef).float().mean()
        return {"approx_kl": float(approx_kl(logratio)), "clipfrac": float(clipfrac)}

    def configure_optimizers(self) -> Any:
        """The members' AdamW and schedules (the matrices decay; biases and the log std do not), or CleanRL's linear
        annealing to 0 over the member's updates."""
        o = self.optim
        if o.scheduler != "linear":
            return super().configure_optimizers()
        total = o.total_steps if o.total_steps is not None else self.estimated_updates()
        optimizer = configure_adamw(self.network, lr=o.lr, weight_decay=o.weight_decay, scheduler="none",
                                    betas=tuple(o.betas), eps=o.eps)
        if o.fused_adamw:
            prefer_fused(optimizer)  # type: ignore[arg-type]
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearDecay(total, o.warmup_steps))  # type: ignore[arg-type]
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1,
                                                         "name": "lr-linear"}}

    def check_run(self, planned_updates: int) -> list[str]:
        hp = self.hparams
        notes = super().check_run(planned_updates)
        per_rollout = hp.n_epochs * hp.n_minibatches
        if per_rollout > planned_updates:
            notes.append(f"n_epochs x n_minibatches = {per_rollout} updates per rollout exceeds the {planned_updates} "
                         "updates of this run: it ends inside its first rollout")
        return notes

    # ----------------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def positions_of(self, net: nn.Module, market: MarketTensors) -> Tensor:
        """[T] positions of ``net``'s deterministic policy over ``market``.

        Discrete: the argmax action for every bar and held position in batched passes, rolled out as a policy table
        (:func:`~foxhunt.rl.env.greedy_positions`). Continuous: tanh of the mean, bar by bar, vectorised over symbols,
        with the first layer's share of the window precomputed in chunks (:func:`~foxhunt.rl.env.sequential_positions`).
        """
        assert isinstance(net, ActorCritic)
        if not self.continuous:
            return greedy_positions(net.deterministic, market)
        band = float(self.hparams.no_trade_band)
        return sequential_positions(
            lambda bars: net.actor_prepare(market.windows(bars, flat=True)),
            lambda prepared, decide, held: net.deterministic_path(prepared, decide, held, band), market,
        )

    def decision_table(self, net: nn.Module, market: MarketTensors, bars: Tensor | None = None) -> Tensor | None:
        assert isinstance(net, ActorCritic)
        return None if self.continuous else greedy_table(net.deterministic, market, bars=bars)

    @torch.no_grad()
    def continuous_step(self, net: nn.Module, market: MarketTensors, bars: Tensor, decide: Tensor,
                        held: Tensor) -> Tensor:
        assert isinstance(net, ActorCritic)
        safe = torch.where(decide, bars, torch.full_like(bars, market.window - 1))  # a gatherable bar, result unused
        prepared = net.actor_prepare(market.windows(safe, flat=True))
        band = float(self.hparams.no_trade_band)
        return net.deterministic_path(prepared.unsqueeze(1), decide.unsqueeze(1), held, band)[:, 0].float()

    deterministic_positions = Agent.policy_positions  # the deterministic policy it trades over a whole split

    # ----------------------------------------------------------------------------------------------- checkpoints
    def run_state(self) -> dict[str, Any]:
        """Environment, rollout (contents, minibatch schedule, shuffling RNG), sampling RNG and counters."""
        state = super().run_state()  # the guard and the validation candidates
        if self.env is None:
            return state
        assert self.rollout is not None and self.sample_rng is not None
        c = self.counters
        state.update({
            "env": self.env.state_dict(),
            "rollout": self.rollout.state_dict(),
            "sample_rng": self.sample_rng.get_state(),
            "reward_scale": self.reward_scale_used,
            "counters": {"env_steps": c.env_steps, "rollouts": c.rollouts, "kl_stops": c.kl_stops,
                         "explained_variance": c.explained_variance},
            "selection": self.selection.state_dict(self.finished),
        })
        return state

    def load_run_state(self, state: dict[str, Any]) -> None:
        super().load_run_state(state)
        if "env" in state:
            self.reward_scale_used = state["reward_scale"]
            self._pending_state = state
            self.env = None  # rebuilt on the right device at start, then the state is applied

    def upgrade_state_dict(self, state: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
        """``state`` of a member saved before it chose weights on validation (no ``policy_net.*``, no
        ``selected_update``) with its learning network's tensors as the policy and no choice made, so older exports
        and checkpoints still load (their last weights trade, as they did)."""
        if self.policy_net is None or f"{prefix}selected_update" in state:
            return state
        state = dict(state)
        state[f"{prefix}selected_update"] = torch.tensor(-1, dtype=torch.int64)
        for key in [k for k in state if k.startswith(f"{prefix}net.")]:
            state[f"{prefix}policy_net.{key[len(prefix) + 4:]}"] = state[key]
        return state

    def _upgrade_hook(self, module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        """load_state_dict pre-hook: :meth:`upgrade_state_dict` in place (checkpoints without validation selection)."""
        upgraded = self.upgrade_state_dict(state, prefix)
        if upgraded is not state:
            state.update(upgraded)

    def check_optimizer_state(self, state: dict[str, Any]) -> None:
        """Refuse, in one line, a checkpoint whose AdamW state covers another number of tensors than the network's
        parameters (another actor-critic layout), before torch's group-size mismatch."""
        n = sum(len(group["params"]) for group in state.get("param_groups", []))
        want = sum(p.requires_grad for p in self.network.parameters())
        if n != want:
            raise ValueError(
                f"PPO member: the checkpoint's optimizer state holds {n} parameter tensors, the network has {want}: "
                "it was written for another actor-critic layout and cannot be resumed")

    def _apply_run_state(self, state: dict[str, Any]) -> None:
        assert self.env is not None and self.rollout is not None and self.sample_rng is not None
        self.env.load_state_dict(state["env"])
        self.rollout.load_state_dict(state["rollout"])
        if self.rollout.filled:
            self.rollout.set_inputs(self._rollout_inputs())
        self.sample_rng.set_state(state["sample_rng"].cpu())
        c = self.counters
        saved = state["counters"]
        c.env_steps, c.rollouts, c.kl_stops = int(saved["env_steps"]), int(saved["rollouts"]), int(saved["kl_stops"])
        c.explained_variance = float(saved["explained_variance"])
        self.load_selection_state(state.get("selection"))
