"""The run a fit config implies, worked out once before training: the coordinator steps and each member's updates
from the Trainer's limits and the training split's windows. A setting the run cannot honour is one ``ConfigError``
naming its dotted config key, its value and what would work; a run shortened on purpose (the config's trainer limits
overridden, e.g. ``--trainer.max_epochs 1 --trainer.limit_train_batches 10``) scales the settings that outlast it in
proportion to the config's own run, and says so, one line each."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from foxhunt.cli_errors import ConfigError
from foxhunt.lit.member import Member, fit_updates

log = logging.getLogger(__name__)
LENGTH_SCHEDULES = ("cosine", "linear")  # schedules that span the member's updates when total_steps is None


@dataclass(frozen=True)
class TrainerLimits:
    """The Trainer settings that bound a fit's length, as a config gives them (Lightning's defaults where it does not)."""

    max_epochs: int | None = None
    max_steps: int = -1
    limit_train_batches: int | float | None = None
    bounded_by_time: bool = False

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> TrainerLimits:
        """From a Trainer's settings (a config's ``trainer`` mapping)."""
        steps = settings.get("max_steps")
        return cls(settings.get("max_epochs"), -1 if steps is None else int(steps), settings.get("limit_train_batches"),
                   settings.get("max_time") is not None)

    def batches_per_epoch(self, loader_batches: int) -> int:
        """Training batches an epoch runs, as Lightning limits them (an int caps them, a float is a share)."""
        limit = 1.0 if self.limit_train_batches is None else self.limit_train_batches
        if isinstance(limit, bool) or not isinstance(limit, int):
            return int(loader_batches * float(limit))
        return min(loader_batches, limit)

    def epochs(self) -> float:
        """The epoch limit, as Lightning resolves it (1,000 when nothing bounds the fit; unbounded with -1)."""
        if self.max_epochs is None:
            return 1000 if self.max_steps == -1 and not self.bounded_by_time else math.inf
        return math.inf if self.max_epochs < 0 else self.max_epochs

    def describe(self, batches: int) -> str:
        limit = "" if self.limit_train_batches is None else f", limit_train_batches {self.limit_train_batches}"
        return f"max_epochs {self.max_epochs} x {batches} training batches an epoch{limit}"


@dataclass(frozen=True)
class RunPlan:
    """What a fit will run: coordinator steps and each member's optimizer updates (``math.inf``: unbounded)."""

    batches_per_epoch: int
    steps: float
    updates: dict[str, float]
    bound: str  # what bounds the steps, for messages

    def member_updates(self, name: str) -> float:
        return self.updates.get(name, 0)


def plan_run(paces: Mapping[str, tuple[int, int]], loader_batches: int, limits: TrainerLimits) -> RunPlan:
    """The coordinator steps and updates of a fit of members at ``paces`` ((updates_per_step, start_step) each) over
    a training loader of ``loader_batches`` batches."""
    batches_per_epoch = limits.batches_per_epoch(loader_batches)
    epoch_limit = batches_per_epoch * limits.epochs() if batches_per_epoch else 0
    max_steps = limits.max_steps if limits.max_steps > 0 else None
    steps, updates = fit_updates(list(paces.values()), epoch_limit, max_steps)
    bound = (limits.describe(batches_per_epoch) if steps == epoch_limit
             else f"trainer.max_steps {max_steps} counts the updates of every member together")
    return RunPlan(batches_per_epoch, steps, dict(zip(paces, updates, strict=True)), bound)


def member_key(name: str, field: str, optim: bool = True) -> str:
    """The dotted config key of a member's setting."""
    return f"model.members.{name}.init_args.{'optim.' if optim else ''}{field}"


def _scaled(value: int, run: float, reference: float) -> int:
    """``value`` of a ``reference`` run, kept in proportion in a run of ``run`` (rounded down)."""
    return int(value * run // reference)


def check_plan(
    members: Mapping[str, Member], loader_batches: int, limits: TrainerLimits,
    reference: TrainerLimits | None = None, source: str = "",
) -> RunPlan:
    """Refuse (``ConfigError``, one line) or, in a run shorter than the ``reference`` run the config's own trainer
    limits give, scale every member setting that outlasts the run; warn about the rest that do not fit (the members'
    ``check_run``). ``loader_batches``: the training loader's length, before ``limit_train_batches``. Returns the plan
    with the scaled settings. ``source`` prefixes messages (the config file)."""
    paces = {n: (m.updates_per_step, m.start_step) for n, m in members.items() if not m.finished}
    plan = plan_run(paces, loader_batches, limits)
    if plan.steps == math.inf:
        return plan
    ref = plan_run(paces, loader_batches, reference) if reference is not None and reference != limits else None
    shortened = ref is not None and math.isfinite(ref.steps) and plan.steps < ref.steps
    note = (f"scaled for this run of {int(plan.steps):,} of the config's {int(ref.steps):,} coordinator steps"
            if shortened and ref is not None else "")
    scaled: list[str] = []
    for name, (_, start) in paces.items():
        if start < plan.steps:
            continue
        key = member_key(name, "start_step")
        if shortened and ref is not None and start < ref.steps:
            new = min(max(1, _scaled(start, plan.steps, ref.steps)), int(plan.steps) - 1)  # still after step 0
            members[name].replace_optim(start_step=new)
            scaled.append(f"{note}: {key} {start} -> {new}")
            continue
        batches_per_epoch = plan.batches_per_epoch
        needed = ("" if batches_per_epoch == 0 or plan.bound.startswith("trainer.max_steps")
                  else f" (e.g. trainer.max_epochs {math.ceil((start + 1) / batches_per_epoch)})")
        raise ConfigError(f"{source}{key}: {start}, but this fit runs {int(plan.steps):,} coordinator steps "
                          f"({plan.bound}): member {name!r} would never train; use at most {int(plan.steps) - 1}, "
                          f"or train longer{needed}")
    if scaled:
        paces = {n: (m.updates_per_step, m.start_step) for n, m in members.items() if not m.finished}
        plan = plan_run(paces, loader_batches, limits)
    for name in paces:
        member, updates = members[name], int(plan.member_updates(name))
        ref_updates = int(ref.member_updates(name)) if shortened and ref is not None else 0
        o = member.optim
        if o.scheduler in LENGTH_SCHEDULES and o.total_steps is None and o.warmup_steps >= max(1, updates):
            key = member_key(name, "warmup_steps")
            if shortened and o.warmup_steps < ref_updates:
                new = _scaled(o.warmup_steps, updates, ref_updates)
                member.replace_optim(warmup_steps=new)
                scaled.append(f"{note}: {key} {o.warmup_steps} -> {new} (of the member's {updates:,} updates)")
            else:
                raise ConfigError(
                    f"{source}{key}: {o.warmup_steps}, but member {name!r} takes {updates:,} updates in this fit "
                    f"({plan.bound}) and its {o.scheduler} schedule must end its warm-up inside them; use at most "
                    f"{max(0, updates - 1)}, or give optim.total_steps, or train longer"
                )
        if shortened:
            for field, value in member.run_length_settings().items():
                if value > updates and value <= ref_updates:
                    new = max(1, _scaled(value, updates, ref_updates))
                    member.scale_run_length(field, new)
                    scaled.append(f"{note}: {member_key(name, field, optim=False)} {value} -> {new} (of the "
                                  f"member's {updates:,} updates)")
    for line in scaled:
        log.warning("%s", line)
    for name in paces:
        for problem in members[name].check_run(int(plan.member_updates(name))):
            rank_zero_warn(f"member {name!r}: {problem}")
    return plan


def check_trainer(settings: Mapping[str, Any], batches_per_epoch: int, plan: RunPlan | None = None,
                  paces: Mapping[str, int] | None = None, source: str = "") -> None:
    """The Trainer settings that bound or pace a fit, against each other and the batches an epoch runs, before the
    Trainer is built (``ConfigError``, one line naming the key; Lightning would raise inside ``fit`` or ignore them):
    ``val_check_interval``, ``min_epochs``/``min_steps`` beyond ``max_epochs``/``max_steps``; with ``max_time``, a
    warning naming the members whose start step (``paces``: name -> start step) the time may never reach."""
    vci = settings.get("val_check_interval")
    every_epoch = settings.get("check_val_every_n_epoch", 1)
    if isinstance(vci, bool):
        raise ConfigError(f"{source}trainer.val_check_interval: {vci}, but it is a share of an epoch (a float in "
                          "(0, 1]) or a number of training batches (an int)")
    if isinstance(vci, float) and not 0.0 < vci <= 1.0:
        raise ConfigError(f"{source}trainer.val_check_interval: {vci}, but a float is the share of an epoch's "
                          f"{batches_per_epoch:,} training batches between validations; use a value in (0, 1], or an "
                          f"int number of batches")
    if isinstance(vci, int) and every_epoch is not None and vci > batches_per_epoch:
        raise ConfigError(f"{source}trainer.val_check_interval: {vci}, but an epoch runs {batches_per_epoch:,} training "
                          f"batches and validation would never run; use at most {batches_per_epoch}, a float share of "
                          f"the epoch, or trainer.check_val_every_n_epoch null to count batches across epochs")
    for low, high in (("min_epochs", "max_epochs"), ("min_steps", "max_steps")):
        lo, hi = settings.get(low), settings.get(high)
        if lo is not None and hi is not None and hi >= 0 and lo > hi:
            raise ConfigError(f"{source}trainer.{low}: {lo}, but trainer.{high} is {hi}, which stops the fit first "
                              f"(Lightning ignores {low} then); use at most {hi}, or raise trainer.{high}")
    if settings.get("max_time") is not None and paces:
        late = {n: s for n, s in paces.items() if s > 0}
        if late:
            starts = ", ".join(f"{n!r} at step {s:,}" for n, s in late.items())
            rank_zero_warn(f"trainer.max_time {settings['max_time']} may stop this fit before a member starts ({starts}"
                           f"{'' if plan is None else f' of {int(plan.steps):,} planned'}): a member that never "
                           "trained is exported with its initial weights; bound the run by epochs or steps to be sure")


def check_data(model: Any, dm: Any, source: str = "") -> None:
    """What the members need of the loaded data, before training (``model`` an ``EnsembleModule``, ``dm`` its data
    module, set up; ``ConfigError``, one line, naming the member's key): a forecaster's own lookback within the data's
    windows, and each agent's window and episode length within the training bars it acts on (with stacking, those
    after the cut)."""
    from foxhunt.rl.env import MarketTensors, episode_starts

    train = dm.splits["train"]
    for name in model.forecaster_names:
        member = model.member(name)
        lookback = member.hparams.get("lookback")
        if lookback is not None and lookback > dm.lookback:
            raise ConfigError(f"{source}{member_key(name, 'lookback', optim=False)}: {lookback}, but the data's windows "
                              f"have {dm.lookback} past bars; use at most {dm.lookback}, or raise data.lookback")
        if lookback is not None and lookback != dm.lookback and not member.reads_shorter_lookback:
            raise ConfigError(f"{source}{member_key(name, 'lookback', optim=False)}: {lookback}, but the data's windows "
                              f"have {dm.lookback} past bars, which {type(member).__name__} reads whole; leave it "
                              f"unset or set data.lookback {lookback}")
        horizon = member.hparams.get("horizon")
        if horizon is not None and horizon != dm.horizon:
            raise ConfigError(f"{source}{member_key(name, 'horizon', optim=False)}: {horizon}, but the data forecasts "
                              f"{dm.horizon} steps (data.horizon); leave it unset or set data.horizon {horizon}")
    acted_on = train.select(~model._stack_cut(train)) if model.hparams.combine == "stack" else train
    for name in model.agent_names:
        hp = model.member(name).hparams
        try:
            market = MarketTensors(acted_on, hp.window, tuple(hp.actions), 0.0, hp.reward_source, 1.0, device="cpu")
        except ValueError as e:
            raise ConfigError(f"{source}{member_key(name, 'window', optim=False)}: {hp.window}: {e}") from e
        try:
            episode_starts(market, hp.episode_length)
        except ValueError as e:
            raise ConfigError(f"{source}{member_key(name, 'episode_length', optim=False)}: {hp.episode_length}: {e}; "
                              f"use a shorter episode_length, or more bars") from e
