"""EnsembleModule: the coordinator that trains any set of members in one Trainer and combines their positions.

Members (:mod:`foxhunt.lit.member`) are named: ``members={"tft": TFTModule(...), "dqn": DQNModule(...)}``, any number
of forecasters and agents. The coordinator owns the loop, the members own their maths: under manual optimisation,
each coordinator step gives every started member (``start_step`` passed) ``updates_per_step`` rounds of
``training_loss`` -> one backward of the round's summed losses (the members' parameters are disjoint, so each gets its
own gradient; one backward per round is also what DDP expects) -> per member: the non-finite guard, grad-norm logging
and clipping of *unscaled* gradients (in ``on_before_optimizer_step``, which Lightning's precision plugin calls after
unscaling a GradScaler's gradients, so ``16-mixed`` clips true gradients), the member's own AdamW step and schedule
-> ``after_update`` (e.g. the DQN's target sync). ``global_step`` counts optimizer steps of all members (Lightning's
convention for manual optimisation with several optimizers), so ``max_steps`` counts member updates.

Combinations (``combine``), for any set of members:

- ``vote``: the rounded mean of the member positions (one long and one flat stays flat).
- ``sharpe_weighted``: member positions weighted by their positive validation Sharpe (FinRL's ensemble picks the
  agent with the best validation Sharpe; this is its soft version). The weights are a buffer set at each
  validation, so a checkpoint (and the export of the best one) carries the weights that were chosen with it.
- ``stack``: the agents observe the forecasters' standardised quantile forecasts as extra features. Forecasts on a
  forecaster's own training bars would be in-sample, so the training split is cut in time: forecasters train on
  windows whose targets end before the ``stack_fraction`` cut; when the first agent starts, a frozen snapshot of every
  forecaster forecasts the later training bars (which it never saw), the validation and the test split; the agents
  train on those later bars only. The ensemble's position is the agents' vote.

Do no harm (``min_edge_confidence``, any member, on by default): at each validation a member whose validation
edge after costs is not significant (the HAC PSR of its book's P&L per timestamp against
:func:`foxhunt.evaluation.significance.null_max_sharpe` of the candidates it was compared on) is
held flat until a later validation clears it. A member's candidates are every policy of it compared on validation
over the fit (``Member.selection_sharpes``): an agent's own validation scores when it chooses its weights, else its
policy at each validation (the export takes the epoch of the best validation). The export loads the best
checkpoint, whose state knows only the candidates up to its epoch: :meth:`EnsembleModule.load_weights` keeps the
run's counts and ``evaluate(split, recheck_flat=True)`` applies the rule again with them. Members that stop early
(``Member.finished``) are skipped; the Trainer stops when all have.

Logged names: ``train/<member>/<key>``, ``lr/<member>`` (every ``log_every_n_steps`` coordinator steps),
``grad_norm/<member>/<block>`` (every member's ``log_grad_norm_every`` updates), ``val/<member>/<metric>`` (forecast
metrics and back-tests), ``val/<policy>/<metric>`` for ``ensemble``, ``buy_and_hold`` and ``oracle``,
``val/<member>/weight``, ``val/<member>/edge_confidence`` and ``val/<member>/held_flat`` (with the rule on), a
member's own held-out scores (``Member.held_out_metrics``) as ``train/<member>/<key>`` and ``val/<member>/<key>``,
and ``val/sharpe`` (the ensemble's, the default checkpoint monitor).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.evaluation.backtest import (
    BACKTEST_KEYS,
    PolicyEvaluation,
    oracle_split_positions,
    policy_metrics,
    policy_pnl,
)
from foxhunt.evaluation.policies import (
    FORECAST_ACTIONS,
    FORECAST_FLAT,
    Combine,
    forecast_policy_table,
    sharpe_weights,
    vote,
    weighted,
)
from foxhunt.evaluation.significance import hac_psr, null_max_sharpe, sharpe_moments
from foxhunt.evaluation.trading import bars_per_year as infer_bars_per_year
from foxhunt.lit.forecast_memo import ForecastMemo
from foxhunt.lit.member import Agent, Forecaster, Member
from foxhunt.lit.member_updates import MemberUpdates, UpdatePlan
from foxhunt.trading.policy_table import rollout_policy_table


class EnsembleModule(MemberUpdates, pl.LightningModule):
    """The coordinator: one Trainer, any named members, one trading policy (see the module docstring)."""

    def __init__(
        self,
        members: dict[str, Member],
        combine: Combine = "sharpe_weighted",
        gradient_clip_val: float = 1.0,
        cost_bps: float = 1.0,
        stack_fraction: float = 0.5,
        bars_per_year: float | None = None,
        min_edge_confidence: float | None = 0.95,
    ) -> None:
        """
        Args:
            members: the named members (forecasters and agents), e.g. ``{"tft": TFTModule(), "dqn": DQNModule()}``.
            combine: how member positions become the ensemble's ("stack", "vote", "sharpe_weighted").
            gradient_clip_val: max gradient 2-norm of a member without its own ``optim.gradient_clip_val`` (0: none).
            cost_bps: transaction cost per unit of position traded, in basis points, for every policy and back-test
                (and for the agents' rewards unless they set their own).
            stack_fraction: with combine="stack", the share of the training split (in time) the forecasters train on.
            bars_per_year: Sharpe annualisation; None infers it once at setup from the training split's observed bar
                density (the longest split) and records it here, so every split's table, the checkpoints and the
                export (and a back-test of a reloaded export) annualise with that one value.
            min_edge_confidence: do no harm: a member trades only when the probability that its validation edge after
                costs is real reaches this level: the PSR of its validation P&L against flat, or, when it chose its
                weights among N candidates on validation, against the Sharpe the best of N would show without edge
                (:func:`null_max_sharpe`). Otherwise it is held flat (in every table and in the combination) until a
                later validation clears it. On by default (0.95): a member with no edge stays flat rather than pay
                costs. None: every member trades (for studying a member by itself).
        """
        super().__init__()
        if not members:
            raise ValueError("EnsembleModule needs at least one member")
        for name, member in members.items():
            if not isinstance(member, (Forecaster, Agent)):
                raise TypeError(f"member {name!r} is a {type(member).__name__}, not a Forecaster or an Agent")
            if not name.isidentifier():
                raise ValueError(f"member name {name!r} must be an identifier (it names logs and exported tensors)")
        if combine not in ("stack", "vote", "sharpe_weighted"):
            raise ValueError(f"combine must be 'stack', 'vote' or 'sharpe_weighted', got {combine!r}")
        self.forecaster_names = [n for n, m in members.items() if isinstance(m, Forecaster)]
        self.agent_names = [n for n, m in members.items() if isinstance(m, Agent)]
        if combine == "stack" and (not self.forecaster_names or not self.agent_names):
            raise ValueError("combine='stack' needs at least one forecaster and one agent")
        if min_edge_confidence is not None and not 0.0 <= min_edge_confidence < 1.0:
            raise ValueError(f"min_edge_confidence must be in [0, 1) or None, got {min_edge_confidence}")
        if not 0.0 < stack_fraction < 1.0:
            raise ValueError(f"stack_fraction must be in (0, 1), got {stack_fraction}")
        if not (math.isfinite(cost_bps) and cost_bps >= 0.0):
            raise ValueError(f"cost_bps must be a finite number >= 0, got {cost_bps}")
        if bars_per_year is not None and not (math.isfinite(bars_per_year) and bars_per_year > 0.0):
            raise ValueError(f"bars_per_year must be a positive number or None, got {bars_per_year}")
        self.save_hyperparameters(ignore=["members"])
        self.automatic_optimization = False
        self.members = nn.ModuleDict(members)
        self.member_names = list(members)
        self.register_buffer("weights", torch.full((len(members),), 1.0 / len(members)))
        # do no harm: each member's confidence in its validation edge and whether it is held flat (checkpointed)
        self.register_buffer("edge_confidence", torch.full((len(members),), -1.0))  # -1: not measured yet
        self.register_buffer("held_flat", torch.zeros(len(members), dtype=torch.bool))
        self.snapshots = nn.ModuleDict()  # frozen forecasters whose forecasts the agents observe (stack)
        self.spec: MarketSpec | None = None
        self.updates = dict.fromkeys(members, 0)  # optimizer updates per member
        self.steps = 0  # coordinator (training) steps
        self.started: set[str] = set()  # agents whose environments are running
        self.last_evaluation: PolicyEvaluation | None = None
        self._splits: dict[str, MarketSplit] = {}
        self._stacked: dict[str, MarketSplit] = {}
        self._schedulers: dict[str, Any] = {}
        self._own_val_reward: dict[str, float] = {}  # each member's validation reward per bar before the rule's hold
        self._resume_rng: Tensor | None = None
        self._plan: UpdatePlan | None = None  # looked up at the first update of a fit
        self._snapshots_loaded = False  # set when a checkpoint or an export brings taken snapshots back
        self._candidate_floor: dict[str, int] = {}  # the run's candidate counts, kept by load_weights
        self.run_plan: Any = None  # the fit's RunPlan once checked (foxhunt.fit checks it before the Trainer)
        self._memo = ForecastMemo()  # whole-split forecasts, reused while weights, modes and split are unchanged

    def member(self, name: str) -> Member:
        member = self.members[name]
        assert isinstance(member, Member)
        return member

    def forecaster(self, name: str) -> Forecaster:
        member = self.members[name]
        assert isinstance(member, Forecaster), f"member {name!r} is not a forecaster"
        return member

    def agent(self, name: str) -> Agent:
        member = self.members[name]
        assert isinstance(member, Agent), f"member {name!r} is not an agent"
        return member

    # ------------------------------------------------------------------------------------------------ wiring
    def bind(self, spec: MarketSpec, seed_offset: int = 0) -> None:
        """Build every member's networks for the data (and the stacking snapshots and statistics)."""
        self.spec = spec
        for name in self.forecaster_names:
            self.member(name).bind(spec)
        n_stack = sum(self.forecaster(n).horizon * len(self.forecaster(n).quantiles) for n in self.forecaster_names)
        stacked = self.hparams.combine == "stack"
        for name in self.agent_names:
            self.agent(name).bind(spec, extra_inputs=n_stack if stacked else 0, seed_offset=seed_offset,
                                  cost_bps=self.hparams.cost_bps)
        if stacked and not len(self.snapshots):
            for name in self.forecaster_names:
                self.snapshots[name] = copy.deepcopy(self.member(name).network).requires_grad_(False)
            self.register_buffer("stack_mean", torch.zeros(n_stack, device=self.weights.device))
            self.register_buffer("stack_std", torch.ones(n_stack, device=self.weights.device))

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule
        if dm is None or not hasattr(dm, "splits"):
            raise RuntimeError("EnsembleModule needs a DataModule with MarketSplits (BarDataModule or MarketDataModule)")
        dm.setup(stage)
        self._splits = dict(dm.splits)
        train = self._splits.get("train")
        if self.hparams.bars_per_year is None and train is not None and len(train) > 1:
            # one annualisation for every split: each short split's own density moves with the weekends inside it
            with contextlib.suppress(ValueError):  # no symbol with two timestamps: each split infers its own
                self.hparams.bars_per_year = infer_bars_per_year(train.timestamps, train.symbol_index)
        for member in self.members.values():
            member.trainer = self.trainer  # members sit in a ModuleDict, which Lightning's setter does not walk
        # each DDP rank explores its own episodes: environment, replay and exploration seeds differ by rank
        self.bind(dm.spec, seed_offset=1000 * self.global_rank)
        transform = getattr(dm, "target_transform", None)
        for name in self.forecaster_names:
            forecaster = self.forecaster(name)
            if transform is not None:
                forecaster.target_transform = transform
            forecaster.setup(stage)
        if self.hparams.combine == "stack" and hasattr(dm, "train_window_mask"):
            dm.train_window_mask = self.forecaster_window_mask(self._splits["train"], dm.spec.horizon)
        if self.hparams.combine != "stack":
            for name in self.agent_names:
                self.agent(name).attach_market(self._splits["train"], self._splits.get("val"))

    def _stack_cut(self, split: MarketSplit) -> Tensor:
        """[T] rows of the training split before the stacking cut time (the forecasters' share)."""
        cut_time = torch.quantile(split.timestamps.unique().double(), self.hparams.stack_fraction)
        return split.timestamps.double() < cut_time

    def forecaster_window_mask(self, split: MarketSplit, h: int) -> Tensor:
        """Decision rows whose ``h`` targets (the data's horizon, every forecaster's) all lie before the stacking cut,
        so no forecaster sees the agents' bars."""
        before = self._stack_cut(split)
        ok = torch.zeros_like(before)
        if len(split) > h:
            ok[:-h] = before[h:] & (split.symbol_index[h:] == split.symbol_index[:-h])
        return ok

    def agent_split(self, name: str, raw: Tensor | None = None) -> MarketSplit:
        """The split an agent trains or is validated on: with stacking, the bars after the cut, with forecasts
        (``raw``: the snapshots' raw forecasts on those bars when already made, see :meth:`stacked`)."""
        split = self._splits[name]
        if self.hparams.combine != "stack":
            return split
        if name == "train":
            split = split.select(~self._stack_cut(split))
        return self.stacked(split, raw=raw)

    # ------------------------------------------------------------------------------------------------ training
    def configure_optimizers(self) -> tuple[list[Any], list[Any]]:
        """Each member's own AdamW and schedule; Lightning saves and restores their states with the checkpoint."""
        self._plan = None
        optimizers, schedulers = [], []
        self._schedulers = {}
        paces = self._paces()
        for name in self.member_names:
            member = self.member(name)
            # global_step (so max_steps) counts every member's updates: a schedule spans the member's share of them
            member.fit_peers = tuple(pace for other, pace in paces.items() if other != name)
            config = member.configure_optimizers()
            optimizers.append(config["optimizer"] if isinstance(config, dict) else config)
            sched = config.get("lr_scheduler") if isinstance(config, dict) else None
            if sched is not None:
                # manual optimisation: the coordinator steps every schedule itself (plateau ones at validation end)
                sched = {k: v for k, v in (sched if isinstance(sched, dict) else {"scheduler": sched}).items()
                         if k not in ("monitor", "strict")}
                sched["name"] = f"lr/{name}"
                schedulers.append(sched)
                self._schedulers[name] = sched["scheduler"]
        return optimizers, schedulers

    def _paces(self) -> dict[str, tuple[int, int]]:
        """(updates_per_step, start_step) of every member still training."""
        return {n: (self.member(n).updates_per_step, self.member(n).start_step) for n in self.member_names
                if not self.member(n).finished}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """Every started member's updates of this step, in rounds of one backward each."""
        active = {n: self.member(n).updates_per_step for n in self.member_names
                  if self.steps >= self.member(n).start_step and not self.member(n).finished}
        for name in active:
            if name in self.agent_names and name not in self.started:
                self._start_agent(name)
        for r in range(max(active.values(), default=0)):
            losses = {n: self.member(n).training_loss(batch, self.updates[n])
                      for n, k in active.items() if r < k and not self.member(n).finished}
            self._update(losses)
        self.steps += 1
        if all(self.member(n).finished for n in self.member_names):
            self.trainer.should_stop = True  # every member stopped early
        every = self.trainer.log_every_n_steps
        if every and self.steps % every == 0:
            self._log_training(active)

    def _log_training(self, active: dict[str, int]) -> None:
        metrics: dict[str, float] = {}
        for name in active:
            member = self.member(name)
            metrics.update({f"train/{name}/{k}": v for k, v in member.training_metrics().items()})
            metrics[f"train/{name}/nonfinite_skipped"] = float(member.guard.skipped)
            if self._loop_plan().scaled:
                metrics[f"train/{name}/scaler_skipped"] = float(member.guard.scaler_skipped)
            metrics[f"train/{name}/updates"] = float(self.updates[name])
            metrics[f"lr/{name}"] = float(self._optimizer(name).param_groups[0]["lr"])
        for name in self.member_names:  # held-out scores a member took since the last log (e.g. its weight choice)
            for key, value in self.member(name).held_out_metrics().items():
                stage, rest = key.split("/", 1)
                metrics[f"{stage}/{name}/{rest}"] = float(value)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def _start_agent(self, name: str) -> None:
        """Give the agent its market (stacked on frozen forecasts when combining by stacking) and warm it up."""
        agent = self.agent(name)
        if self.hparams.combine == "stack":
            if not self._stacked:
                # the snapshots' forecasts on the agents' training bars, made once: the standardisation is fitted
                # on them and the agents observe them (a second pass was ~40% of the agents' start)
                post_cut = None if self.stack_ready else self._take_snapshots()
                self._stacked = {k: self.agent_split(k, raw=post_cut if k == "train" else None)
                                 for k in ("train", "val") if k in self._splits}
            agent.attach_market(self._stacked["train"], self._stacked.get("val"))
        agent.start()
        self.started.add(name)

    # ------------------------------------------------------------------------------------------------ stacking
    def _take_snapshots(self) -> Tensor:
        """Freeze every forecaster as it is now and fit the standardisation of their forecasts on the agents' bars;
        returns those raw forecasts ([T, sum H·Q] on the training split's bars after the cut)."""
        for name in self.forecaster_names:
            self.snapshots[name].load_state_dict(self.member(name).network.state_dict())
        train = self._splits["train"]
        fc = self._raw_stack(train.select(~self._stack_cut(train)))
        ref = fc[torch.isfinite(fc).all(1)]
        self.stack_mean.copy_(ref.mean(0))
        self.stack_std.copy_(ref.std(0).clamp_min(1e-12))
        return fc

    def _raw_stack(self, split: MarketSplit, rows: Tensor | None = None) -> Tensor:
        """[T, sum H·Q] the snapshots' forecasts, forecaster by forecaster (at ``rows`` only when given; NaN elsewhere)."""
        parts = [self._forecast(n, split, net=self.snapshots[n], rows=rows).flatten(1) for n in self.forecaster_names]
        return torch.cat(parts, 1)

    def _forecast(self, name: str, split: MarketSplit, net: nn.Module | None = None,
                  rows: Tensor | None = None) -> Tensor:
        """Forecaster ``name``'s [T, H, Q] forecasts (by ``net``, a snapshot, when given); a whole split's through
        the memo (:class:`ForecastMemo`: the same values without a second pass when nothing they depend on changed)."""
        member = self.forecaster(name)
        if rows is not None or getattr(member, "spec", None) is None:  # a live bar's rows; or not bound to data
            return member.forecast(split, net=net, rows=rows)
        return self._memo.forecast(name, member, split, net)

    def stacked(self, split: MarketSplit, rows: Tensor | None = None, raw: Tensor | None = None) -> MarketSplit:
        """The split with the snapshots' standardised forecasts appended to its features (the agents' inputs);
        ``raw``: :meth:`_raw_stack` of this split by the current snapshots, when the caller already has it."""
        fc = self._raw_stack(split, rows) if raw is None else raw
        z = torch.nan_to_num((fc - self.stack_mean) / self.stack_std, nan=0.0).clamp(-10, 10).float()
        names = [
            f"{n}_h{h}_q{q}" for n in self.forecaster_names
            for h in range(self.forecaster(n).horizon) for q in self.forecaster(n).quantiles
        ]
        return replace(split, features=torch.cat([split.features, z.to(split.features.device)], 1),
                       feature_names=split.feature_names + names)

    @property
    def stack_ready(self) -> bool:
        """The snapshots have been taken (agents started, resumed, or loaded from an export)."""
        return bool(self.started) or self._snapshots_loaded

    # ------------------------------------------------------------------------------------------------ policies
    @torch.no_grad()
    def forecasts(self, split: MarketSplit, rows: Tensor | None = None) -> dict[str, Tensor]:
        """[T, H, Q] forecasts of every forecaster on a split (at ``rows`` only when given; NaN elsewhere)."""
        return {n: self._forecast(n, split, rows=rows) for n in self.forecaster_names}

    def forecast_table(self, name: str, forecasts: Tensor, decision: Tensor, reset: Tensor) -> Tensor:
        """[T, 3] forecaster ``name``'s policy table (:func:`forecast_policy_table`) from its [T, H, Q] forecasts: its
        ``policy_interval`` quantiles and median of the next step, against the coordinator's cost."""
        member = self.forecaster(name)
        qs = list(member.quantiles)
        lo, hi = (qs.index(min(qs, key=lambda x, q=q: abs(x - q))) for q in member.policy_interval)
        mid = qs.index(min(qs, key=lambda x: abs(x - 0.5)))
        nxt = forecasts[:, 0, :].to(decision.device)
        ok = decision & torch.isfinite(nxt).all(1)
        return forecast_policy_table(nxt[:, lo], nxt[:, mid], nxt[:, hi], self.hparams.cost_bps, ok, reset)

    @torch.no_grad()
    def positions(
        self, split: MarketSplit, forecasts: dict[str, Tensor] | None = None, choose_flat: bool = False,
        recheck_flat: bool = False,
    ) -> dict[str, Tensor]:
        """[T] positions of every member, the ensemble, buy-and-hold (and the oracle when the data knows it).
        ``choose_flat`` (validation only) first decides from this split which members are held flat, each member's
        policy on it counting as one more candidate; ``recheck_flat`` decides it again with the candidates the
        members already have (and those :meth:`load_weights` kept), adding none."""
        device = self.weights.device
        decision, reset = split.valid.to(device), split.first_bar.to(device)
        forecasts = self.forecasts(split) if forecasts is None else forecasts
        pos: dict[str, Tensor] = {}
        for name, fc in forecasts.items():
            table = self.forecast_table(name, fc, decision, reset)
            pos[name] = FORECAST_ACTIONS.to(device)[rollout_policy_table(table, FORECAST_FLAT)]
        agents = self.trading_agents()
        inputs = self.stacked(split) if self.hparams.combine == "stack" and agents else split
        for name in agents:
            pos[name] = self.agent(name).positions(inputs).to(device).float()
        if choose_flat or recheck_flat:
            self._choose_flat(pos, split, new_candidate=choose_flat)
        self.combine(pos, decision)
        pos["buy_and_hold"] = decision.float()
        oracle = oracle_split_positions(split, self.hparams.cost_bps, device)
        if oracle is not None:
            pos["oracle"] = oracle
        return pos

    def trading_agents(self) -> list[str]:
        """The agents whose positions count: all of them, but none under ``combine: stack`` before the snapshots."""
        return [n for n in self.agent_names if self.hparams.combine != "stack" or self.stack_ready]

    def combine(self, pos: dict[str, Tensor], decision: Tensor) -> None:
        """In place: members held flat (do no harm) set to 0, and ``pos["ensemble"]`` from the members' positions
        (each [T], or [S] for one bar of a live session) by the combination rule."""
        for i, name in enumerate(self.member_names):
            if name in pos and bool(self.held_flat[i]):
                pos[name] = torch.zeros_like(pos[name])
        agents = self.trading_agents()
        if self.hparams.combine == "stack":  # flat until the agents start
            pos["ensemble"] = vote([pos[n] for n in agents]) if agents else torch.zeros_like(decision, dtype=torch.float32)
        elif self.hparams.combine == "vote":
            pos["ensemble"] = vote([pos[n] for n in self.member_names])
        else:
            pos["ensemble"] = weighted([pos[n] for n in self.member_names], self.weights.tolist())

    @torch.no_grad()
    def evaluate(
        self, split: MarketSplit, choose_weights: bool = False, significance: bool = False, recheck_flat: bool = False
    ) -> PolicyEvaluation:
        """Positions and after-cost metrics of every policy on a split. ``choose_weights`` (validation only) sets the
        Sharpe weights from this split first: what chooses is the validation split, never the one that reports.
        ``significance`` adds each policy's Sharpe standard error, bootstrap interval and probabilistic Sharpe ratios
        (for the reported tables). ``recheck_flat`` (validation only; after :meth:`load_weights` for an export)
        applies the do-no-harm rule again on this split with every member's candidates of the whole run, without
        choosing the combination weights again: a checkpoint's own state knows only the candidates up to its epoch,
        but it was chosen among all the run's validations."""
        forecasts = self.forecasts(split)
        pos = self.positions(split, forecasts, choose_flat=choose_weights, recheck_flat=recheck_flat)
        metrics = policy_metrics(pos, split, self.hparams.cost_bps, self.hparams.bars_per_year, significance=significance)
        for i, name in enumerate(self.member_names):  # a member that never updated is marked in every table
            if name in metrics:
                metrics[name]["updates"] = float(self.updates[name])
                if self.hparams.combine == "sharpe_weighted":  # the weight the ensemble row was computed with
                    metrics[name]["weight"] = float(self.weights[i])
                if self.hparams.min_edge_confidence is not None:
                    metrics[name]["edge_confidence"] = float(self.edge_confidence[i])
                    metrics[name]["held_flat"] = float(self.held_flat[i])
        if choose_weights and self.hparams.combine == "sharpe_weighted" and all(n in metrics for n in self.member_names):
            w = sharpe_weights([metrics[n]["sharpe"] for n in self.member_names])
            self.weights.copy_(torch.tensor(w, dtype=self.weights.dtype))
            for name, weight in zip(self.member_names, w, strict=True):
                metrics[name]["weight"] = float(weight)
            pos["ensemble"] = weighted([pos[n] for n in self.member_names], w)
            metrics["ensemble"] = policy_metrics({"ensemble": pos["ensemble"]}, split, self.hparams.cost_bps,
                                                 self.hparams.bars_per_year, significance=significance)["ensemble"]
        return PolicyEvaluation(split, pos, metrics, self.hparams.cost_bps, forecasts)

    def _choose_flat(self, pos: dict[str, Tensor], split: MarketSplit, new_candidate: bool = True) -> None:
        """Do no harm: each member's confidence that its edge on ``split`` (validation) after costs is real; members
        below ``min_edge_confidence`` are held flat. The HAC PSR (:func:`hac_psr`: dependent bars) of its validation
        book's P&L per timestamp (:func:`policy_pnl`, the tables' equal weighting: same-time bars of several symbols
        are one bar of the book, not independent ones) against the Sharpe the best of the candidates it was compared
        on over the fit would show with no edge at all (:func:`null_max_sharpe` on the book's timestamps; 0 for a
        single candidate), since choosing the best of N on the same bars inflates its Sharpe. ``new_candidate`` (a
        validation of the fit): each member's policy here is one more candidate (``Member.record_validation_sharpe``;
        an agent choosing its own weights has already counted it)."""
        threshold = self.hparams.min_edge_confidence
        for i, name in enumerate(self.member_names):
            if name not in pos:
                continue
            pnl = policy_pnl(pos[name].to(self.weights.device), split, self.hparams.cost_bps)
            m = sharpe_moments(pnl)
            self._own_val_reward[name] = float(pnl.mean()) if pnl.numel() else math.nan
            if new_candidate:
                self.member(name).record_validation_sharpe(m.sr_per_bar)
            if threshold is None:
                continue
            sr0 = null_max_sharpe(self.candidate_counts()[name], m.n_bars)
            conf = hac_psr(pnl, sr0)
            conf = 0.0 if math.isnan(conf) else conf  # no variance (e.g. a flat member): no evidence of an edge
            self.edge_confidence[i] = conf
            self.held_flat[i] = conf < threshold

    def candidate_counts(self) -> dict[str, int]:
        """Each member's candidates for the do-no-harm rule: the policies it was compared on over the fit
        (``Member.selection_sharpes``), or the count :meth:`load_weights` kept from the run when larger."""
        return {n: max(len(self.member(n).selection_sharpes()), self._candidate_floor.get(n, 0)) for n in self.member_names}

    def recheck_edges(self, split: MarketSplit) -> PolicyEvaluation:
        """:meth:`evaluate` with ``recheck_flat``: the rule again on ``split`` (validation) with the run's candidates."""
        return self.evaluate(split, recheck_flat=True)

    # ------------------------------------------------------------------------------------------------ validation
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        for name in self.forecaster_names:
            loss = self.forecaster(name).validation_update(batch)
            self.log(f"val/{name}/loss", loss, on_epoch=True, batch_size=batch["y"].shape[0])

    def on_validation_epoch_end(self) -> None:
        forecast_values: dict[str, dict[str, Tensor]] = {}
        for name in self.forecaster_names:
            forecast_values[name] = self.forecaster(name).validation_metrics()
            self.log_dict({f"val/{name}/{k}": v for k, v in forecast_values[name].items()})
        if "val" not in self._splits:
            return
        evaluation = self.evaluate(self._splits["val"], choose_weights=not self.trainer.sanity_checking)
        for who, metrics in evaluation.metrics.items():
            self.log_dict({f"val/{who}/{k}": float(v) for k, v in metrics.items() if k in BACKTEST_KEYS})
        self.log("val/sharpe", float(evaluation.metrics["ensemble"]["sharpe"]), prog_bar=True)
        for i, name in enumerate(self.member_names):
            self.log(f"val/{name}/weight", float(self.weights[i]))
            if self.hparams.min_edge_confidence is not None:
                self.log(f"val/{name}/edge_confidence", float(self.edge_confidence[i]))
                self.log(f"val/{name}/held_flat", float(self.held_flat[i]))
        if not self.trainer.sanity_checking:
            for name, sched in self._schedulers.items():
                if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    # lower is better: a forecaster's quantile loss, an agent's negated reward per bar of its own
                    # policy (held flat by the rule its table's reward is 0 at every validation, which would cut the
                    # rate every plateau_patience epochs whatever it learns)
                    value = (forecast_values[name]["quantile_loss"] if name in forecast_values
                             else -self._own_val_reward.get(name, evaluation.metrics[name]["reward_per_bar"]))
                    sched.step(float(value))
        self.last_evaluation = evaluation

    def test_step(self, batch: Any, batch_idx: int) -> None:
        for name in self.forecaster_names:
            member = self.forecaster(name)
            member.test_update(batch)

    def on_test_epoch_end(self) -> None:
        for name in self.forecaster_names:
            metrics = self.forecaster(name).test_metrics
            self.log_dict({f"test/{name}/{k.removeprefix('test/')}": v for k, v in metrics.compute().items()})
            metrics.reset()
        if "test" in self._splits:
            evaluation = self.evaluate(self._splits["test"])
            for who, m in evaluation.metrics.items():
                self.log_dict({f"test/{who}/{k}": float(v) for k, v in m.items() if k in BACKTEST_KEYS})

    def hparam_metric_names(self) -> list[str]:
        """The HPARAMS tab's metrics: each policy's validation and test Sharpe (filled in when the fit is over)."""
        policies = [*self.member_names, "ensemble", "buy_and_hold"]
        return [f"hp/{stage}_sharpe/{who}" for stage in ("val", "test") for who in policies]

    def hparam_params(self) -> dict[str, Any]:
        """The coordinator's and every member's hyperparameters, flat, for the logger's HPARAMS tab."""
        params: dict[str, Any] = {f"ensemble/{k}": v for k, v in self.hparams.items()}
        for name in self.member_names:
            hp = self.member(name).hparams
            params.update({f"{name}/{k}": v for k, v in hp.items() if not isinstance(v, (list, tuple)) or len(v) <= 8})
        return params

    def hparam_metrics(self, val: dict[str, dict[str, float]], test: dict[str, dict[str, float]]) -> dict[str, float]:
        """The values of :meth:`hparam_metric_names` from a validation and a test back-test."""
        out = {}
        for name in self.hparam_metric_names():
            stage, who = name.removeprefix("hp/").split("_sharpe/")
            table = val if stage == "val" else test
            out[name] = float(table.get(who, {}).get("sharpe", float("nan")))
        return out

    # ------------------------------------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Members' run state (replay, environments, guards), counters and the torch RNG, for an exact resume."""
        checkpoint["ensemble_state"] = {
            "updates": dict(self.updates),
            "steps": self.steps,
            "candidates": self.candidate_counts(),
            "started": sorted(self.started),
            "members": {name: self.member(name).run_state() for name in self.member_names},
            "torch_rng": torch.get_rng_state(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("ensemble_state")
        if state is None:
            raise ValueError("checkpoint has no 'ensemble_state': it was not written by this EnsembleModule")
        self.updates.update({k: int(v) for k, v in state["updates"].items()})
        self.steps = int(state["steps"])
        for name, member_state in state["members"].items():
            self.member(name).load_run_state(member_state)
        for name, optimizer_state in zip(self.member_names, checkpoint.get("optimizer_states") or [], strict=False):
            self.member(name).check_optimizer_state(optimizer_state)  # one optimizer per member, in member order
        self._resume_started = list(state["started"])
        self._resume_rng = state["torch_rng"]

    def load_weights(self, checkpoint: dict[str, Any]) -> None:
        """The parameters and buffers of a checkpoint of this module (weights, snapshots) and the update counts
        they were trained with, for evaluation or export (not the run state a resume needs).

        The checkpoint was chosen among every validation of the run, so each member's candidate count for the
        do-no-harm rule stays the larger of the run's (counted before loading) and the checkpoint's:
        ``evaluate(split, recheck_flat=True)`` applies the rule with them (the held-flat flags loaded are the
        checkpoint's, decided with its epoch's counts)."""
        run = self.candidate_counts()
        state = checkpoint.get("ensemble_state", {})
        saved = state.get("candidates", {})
        self.load_state_dict(checkpoint["state_dict"])
        self._candidate_floor = {n: max(run[n], int(saved.get(n, 0))) for n in self.member_names}
        if "updates" in state:
            self.updates.update({k: int(v) for k, v in state["updates"].items() if k in self.updates})
        if "steps" in state:
            self.steps = int(state["steps"])
        started = state.get("started", [])
        self.started, self._snapshots_loaded = set(started), bool(started)

    @property
    def splits(self) -> dict[str, MarketSplit]:
        """The data's splits by name, as the coordinator read them at setup."""
        return dict(self._splits)

    def split(self, name: str) -> MarketSplit:
        """The data's split ``name`` ("train", "val", "test"), as the coordinator read it at setup."""
        if name not in self._splits:
            raise KeyError(f"no split {name!r}: the coordinator has {sorted(self._splits)} (is it set up?)")
        return self._splits[name]

    def _check_run(self) -> None:
        """Before training, when no plan was checked before the Trainer (``foxhunt.fit`` checks it there): a member
        that would never start or a warm-up that outlasts its updates is an error; settings that outlast the run are
        warnings (:func:`foxhunt.lit.run_plan.check_plan`, with this Trainer's limits)."""
        from foxhunt.lit.run_plan import TrainerLimits, check_plan

        trainer = self.trainer
        trainer.estimated_stepping_batches  # noqa: B018 - sets up the train loader, so num_training_batches is known
        per_epoch = trainer.num_training_batches
        if per_epoch == float("inf"):
            return
        limits = TrainerLimits(trainer.max_epochs, trainer.max_steps)  # per_epoch is already limited
        self.run_plan = check_plan({n: self.member(n) for n in self.member_names}, int(per_epoch), limits)

    def on_train_start(self) -> None:
        if self.updates and not any(self.updates.values()) and self.run_plan is None:
            self._check_run()
        resumed = getattr(self, "_resume_started", [])
        self._snapshots_loaded = self._snapshots_loaded or bool(resumed)  # they came back with the state dict
        for name in resumed:
            if name not in self.started:
                self._start_agent(name)
        self._resume_started = []
        if self._resume_rng is not None:
            torch.set_rng_state(self._resume_rng)
            self._resume_rng = None
