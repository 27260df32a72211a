"""The member protocol: what the coordinator (``EnsembleModule``) asks of every member of the ensemble.

There are two kinds of member:

- **forecasters** (the TFT and Mamba-2) learn from window batches and give quantile forecasts ``[T, H, Q]`` of
  the next H log returns of a split; the shared :func:`foxhunt.evaluation.policies.forecast_policy` turns them into
  positions, with the member's ``policy_interval`` and the coordinator's cost;
- **agents** (the Double DQN and PPO) learn by acting in the vectorised market of the training split and give
  positions ``[T]`` of a split themselves.

A member owns its networks, loss, optimizer and schedule (``configure_optimizers``) and its own validation metrics;
the coordinator owns the loop, the backward pass, clipping, grad-norm logging, the non-finite guard and the
combination. Sizes that follow from the data (feature counts, names, symbols, window lengths) reach a member through
:meth:`Member.bind` as a :class:`~foxhunt.data.market.MarketSpec`, never through its hyperparameters, so a member's
``hparams`` are exactly what its config says.

One coordinator step calls, for every member whose ``start_step`` has passed, ``updates_per_step`` rounds of
``training_loss`` -> (backward, guard, clip, optimizer step by the coordinator) -> ``after_update``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.evaluation.forecast_metrics import pinball_loss
from foxhunt.evaluation.significance import sharpe_moments
from foxhunt.evaluation.trading import bars_per_year as infer_bars_per_year
from foxhunt.evaluation.trading import counted_log_returns, counted_position_changes, trading_metrics
from foxhunt.rl.env import MarketTensors
from foxhunt.training.guard import NonFiniteGuard
from foxhunt.training.optim import Optimization, configure_adamw, prefer_fused

MemberKind = Literal["forecaster", "agent"]


@contextlib.contextmanager
def eval_mode(net: nn.Module) -> Iterator[nn.Module]:
    """``net`` in eval mode for the block, then in the mode it had (no walk over its modules when it is in eval
    already: a live session's forecasts call this every bar)."""
    was = net.training
    if was:
        net.eval()
    try:
        yield net
    finally:
        if was:
            net.train()


def fit_updates(
    paces: Sequence[tuple[int, int]], max_coordinator_steps: float = math.inf, max_steps: int | None = None
) -> tuple[float, list[float]]:
    """How a coordinator fit divides its steps among its members: (coordinator steps it runs, optimizer updates of
    each member), ``math.inf`` where nothing bounds the fit.

    ``paces`` is every active member's ``(updates_per_step, start_step)``: coordinator step s (0-based) gives each
    member whose ``start_step`` <= s its ``updates_per_step`` updates. ``global_step``, and so ``max_steps``, counts the
    optimizer steps of all members together, and Lightning checks it between batches, so the fit stops after the first
    coordinator step at whose end the members' updates sum to ``max_steps`` or more; ``max_coordinator_steps`` is the
    epoch limit (``max_epochs`` x batches per epoch). Exact unless a member stops early or skips non-finite updates.
    """
    if not paces:
        return max_coordinator_steps, []
    steps = max_coordinator_steps
    if max_steps is not None and max_steps > 0:

        def total(s: int) -> int:
            return sum(k * max(0, s - start) for k, start in paces)

        lo, hi = 0, max(start for _, start in paces) + int(max_steps)  # total(hi) >= max_steps: every k >= 1
        while lo < hi:  # the fewest coordinator steps whose updates reach max_steps
            mid = (lo + hi) // 2
            if total(mid) >= max_steps:
                hi = mid
            else:
                lo = mid + 1
        steps = min(steps, lo)
    return steps, [k * max(0, steps - start) for k, start in paces]


class Member(pl.LightningModule):
    """Base of every ensemble member: the coordinator drives these methods (see the module docstring)."""

    kind: ClassVar[MemberKind]
    monitor: ClassVar[str]  # the validation metric a plateau schedule watches (lower is better)
    optim: Optimization  # its optimisation settings (the ``optim`` constructor argument, with the member's defaults)
    guard: NonFiniteGuard
    finished: bool = False  # stopped early (e.g. no validation gain for its patience): the coordinator skips it
    # (updates_per_step, start_step) of the other members of the coordinator's fit, set by the coordinator before it
    # configures the member's optimizer (global_step counts every member's updates); empty: the member trains alone
    fit_peers: tuple[tuple[int, int], ...] = ()
    validation_sharpes: list[float]  # per-bar Sharpe of its policy at each validation of the fit (run state)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.validation_sharpes = []

    def init_optim(self, optim: Optimization) -> None:
        """Take the checked optimisation settings and the non-finite guard they choose (a constructor calls it)."""
        optim.check()
        self.optim = optim
        self.guard = NonFiniteGuard(optim.nonfinite)

    @property
    def updates_per_step(self) -> int:
        """Updates per coordinator step once started."""
        return self.optim.updates_per_step

    @property
    def start_step(self) -> int:
        """Coordinator steps before the member's first update (its warm-up wait)."""
        return self.optim.start_step

    @property
    def log_grad_norm_every(self) -> int:
        """Updates between grad-norm logs (0: never)."""
        return self.optim.log_grad_norm_every

    @property
    def gradient_clip_val(self) -> float | None:
        """Max gradient 2-norm (None: the coordinator's; 0: no clipping)."""
        return self.optim.gradient_clip_val

    def configure_optimizers(self) -> Any:
        """AdamW (decay on weights only, by role) and the shared schedules over the member's own updates, switched to
        torch's fused AdamW kernel where allowed (``fused_adamw``)."""
        o = self.optim
        total = o.total_steps
        if o.scheduler == "cosine" and total is None:
            total = self.estimated_updates()
        config = configure_adamw(
            self.network, lr=o.lr, weight_decay=o.weight_decay, scheduler=o.scheduler, betas=tuple(o.betas), eps=o.eps,
            total_steps=total, warmup_steps=o.warmup_steps, step_size=o.step_size, gamma=o.gamma,
            min_lr_ratio=o.min_lr_ratio, plateau_patience=o.plateau_patience, monitor=self.monitor,
            interval="epoch" if o.scheduler == "plateau" else "step",
        )
        if o.fused_adamw:
            prefer_fused(config["optimizer"] if isinstance(config, dict) else config)
        return config

    def bind(self, spec: MarketSpec, extra_inputs: int = 0, seed_offset: int = 0, cost_bps: float | None = None) -> None:
        """Build the networks for the data described by ``spec`` (``extra_inputs`` more feature columns when
        stacked on forecasts; ``seed_offset`` varies exploration per DDP rank; ``cost_bps`` is the ensemble's cost,
        which an agent without its own trades with)."""
        raise NotImplementedError

    @property
    def network(self) -> nn.Module:
        """The trained parameters: what the coordinator clips, measures and guards."""
        raise NotImplementedError

    def training_loss(self, batch: Any, update: int) -> Tensor:
        """The loss of update number ``update`` (0-based, this member's own count)."""
        raise NotImplementedError

    def after_update(self, update: int) -> None:
        """Called after the optimizer step of update number ``update`` (e.g. a target-network sync)."""

    def training_metrics(self) -> dict[str, float]:
        """Snapshot of the member's training figures, logged by the coordinator as ``train/<member>/<key>``."""
        return {}

    def held_out_metrics(self) -> dict[str, float]:
        """Figures the member measured on held-out data since the last call (keys ``train/<key>`` or ``val/<key>``),
        logged by the coordinator as ``train/<member>/<key>`` and ``val/<member>/<key>``; empty when none is new."""
        return {}

    def selection_sharpes(self) -> list[float]:
        """Per-bar validation Sharpe of every candidate policy the member was compared on over the fit, so the
        coordinator can deflate the edge of the one it trades for the choice. By default the policy of each
        validation (:meth:`record_validation_sharpe`): the export takes the epoch of the best validation, so every
        validation's policy was a candidate; an agent that chooses its own weights on validation lists its own."""
        return list(self.validation_sharpes)

    def record_validation_sharpe(self, sharpe: float) -> None:
        """The coordinator's per-bar Sharpe of the member's policy at a (non-sanity) validation: one more candidate."""
        self.validation_sharpes.append(float(sharpe))

    def estimated_updates(self) -> int:
        """Updates this member will take in the attached Trainer's fit (for a schedule without total_steps): its
        share of the coordinator steps the fit runs (:func:`fit_updates`, given ``fit_peers``), where the epoch limit
        is ``max_epochs`` x batches per epoch and ``max_steps`` counts the updates of every member together."""
        trainer = self.trainer
        trainer.estimated_stepping_batches  # noqa: B018 - sets up the train loader, so num_training_batches is known
        per_epoch, epochs = trainer.num_training_batches, trainer.max_epochs
        epoch_limit = math.inf
        if epochs is not None and epochs > 0 and per_epoch != float("inf"):
            epoch_limit = per_epoch * epochs
        _, updates = fit_updates([(self.updates_per_step, self.start_step), *self.fit_peers], epoch_limit,
                                 trainer.max_steps)
        if updates[0] == math.inf:
            raise ValueError("a cosine schedule needs total_steps, or a trainer with max_steps or max_epochs")
        return max(1, int(updates[0]))

    def check_run(self, planned_updates: int) -> list[str]:
        """Settings that do not fit a run of ``planned_updates`` updates (each a warning naming the setting)."""
        return []

    def replace_optim(self, **changes: Any) -> None:
        """New values of some ``optim`` fields before the fit (a shortened run's scaled start or warm-up), in the
        settings and in the hyperparameters that checkpoints and exports record."""
        self.init_optim(replace(self.optim, **changes))
        self.hparams.optim = self.optim.as_dict()

    def run_length_settings(self) -> dict[str, int]:
        """The member's own settings counted in its updates and sized for its config's run (e.g. the DQN's
        exploration decay), which a run shortened on purpose scales with its updates; none by default."""
        return {}

    def scale_run_length(self, name: str, value: int) -> None:
        """Set one of :meth:`run_length_settings` for a shortened run (in the hyperparameters, where it is read)."""
        self.hparams[name] = int(value)

    def export_state(self) -> dict[str, float | int | str | None]:
        """Values beyond parameters and hyperparameters that the member's policy needs after export (JSON)."""
        return {}

    def load_export_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`export_state` wrote."""

    def run_state(self) -> dict[str, Any]:
        """State beyond parameters that an exact resume needs (environment, replay, RNGs, guard, the validation
        candidates)."""
        return {"guard": self.guard.state_dict(), "validation_sharpes": list(self.validation_sharpes)}

    def load_run_state(self, state: dict[str, Any]) -> None:
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        if "validation_sharpes" in state:  # absent in older checkpoints
            self.validation_sharpes = [float(x) for x in state["validation_sharpes"]]

    def check_optimizer_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError (one line, the reason) for a checkpoint's optimizer state this member's optimizer cannot
        take, before Lightning tries to load it (a layout change, not torch's size mismatch)."""


class Forecaster(Member):
    """A member that forecasts quantiles of the next ``horizon`` log returns from window batches."""

    kind: ClassVar[MemberKind] = "forecaster"
    monitor: ClassVar[str] = "val/loss"
    reads_shorter_lookback: ClassVar[bool] = False  # its own ``lookback`` may be below the data's (it reads the tail)
    quantiles: tuple[float, ...]
    quantile_levels: Tensor  # the quantiles as a buffer, for the pinball loss
    test_metrics: Any  # a torchmetrics collection of the forecast metrics, prefixed "test/"
    policy_interval: tuple[float, float]  # the quantiles whose interval must clear the cost to take a position

    def forecast(self, split: MarketSplit, batch_size: int = 2048, net: nn.Module | None = None,
                 rows: Tensor | None = None) -> Tensor:
        """[T, H, Q] forecasts on the log-return scale at every window-valid row of ``split``; NaN elsewhere.
        ``net`` is a frozen copy of the member's network to forecast with instead (a stacking snapshot); ``rows``
        (row indices) forecasts only those of them (a live session's latest bars)."""
        raise NotImplementedError

    @property
    def horizon(self) -> int:
        raise NotImplementedError

    def validation_update(self, batch: dict[str, Tensor]) -> Tensor:
        """Add a validation batch to the member's forecast metrics; returns its loss on the training scale."""
        raise NotImplementedError

    def validation_metrics(self) -> dict[str, Tensor]:
        """The epoch's forecast metrics (keys without stage prefix), then reset them."""
        raise NotImplementedError

    def test_update(self, batch: dict[str, Tensor]) -> None:
        """Add a test batch to ``test_metrics``."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ inverse transform and loss (shared)
    @property
    def target_transform(self) -> nn.Module | None:
        """Maps predictions of ``y`` back to log returns (``inverse(value, loc, scale)``); set by the data side.

        Kept out of the state dict on purpose: the datamodule fits and saves it; a checkpoint loads without it.
        """
        return self._target_transform

    @target_transform.setter
    def target_transform(self, transform: nn.Module | None) -> None:
        self.__dict__["_target_transform"] = transform

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "target_transform":  # nn.Module would register it as a submodule and bypass the property
            Forecaster.target_transform.fset(self, value)  # type: ignore[attr-defined]
            return
        super().__setattr__(name, value)

    def to_return_scale(self, prediction: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """Quantile forecasts [B, H, Q] on the original log-return scale, as known at the decision bar t: every step
        is mapped back with row t's loc/scale (the statistics ``WindowBatches`` scaled every step's target by: a
        rolling scale's row t+h reads returns up to t+h-1, r[t] among them), then the transform; the quantiles are
        sorted (monotone rearrangement: the heads are free to cross, and a crossed interval would read as a signal)."""
        pred = prediction.float()
        loc, scale = batch.get("y_loc"), batch.get("y_scale")
        if loc is not None:
            loc = _broadcast_rows(_decision_row(loc), pred)
        if scale is not None:
            scale = _broadcast_rows(_decision_row(scale), pred)
        return self._inverse(pred, loc, scale).sort(-1).values

    def _inverse(self, pred: Tensor, loc: Tensor | None, scale: Tensor | None) -> Tensor:
        transform = self._target_transform
        if transform is None and loc is None and scale is None:
            raise ValueError(
                f"{type(self).__name__}: the batch has no y_loc/y_scale and no target_transform is set, so predictions of the "
                "preprocessed target cannot be mapped back to log returns (set module.target_transform, or give batches "
                "with y_loc/y_scale)"
            )
        if transform is not None:
            device = pred.device
            checked = self.__dict__.get("_inverse_checked")  # once per transform and device (a walk costs half a
            # bar's inverse); a transform moved away since would fail loudly in torch
            if checked is None or checked[0] is not transform or checked[1] != device:
                if not all(t.device == device for t in chain(transform.buffers(), transform.parameters())):
                    transform.to(device)
                self.__dict__["_inverse_checked"] = (transform, device)
            inverse = getattr(transform, "inverse", None)
            if inverse is None:
                raise TypeError(f"target_transform {type(transform).__name__} has no inverse()")
            if loc is not None or scale is not None:
                return inverse(pred, loc, scale)
            return inverse(pred)
        if scale is not None:
            pred = pred * scale
        if loc is not None:
            pred = pred + loc
        return pred

    def quantile_loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        """Mean pinball loss over finite targets, horizons and quantiles, in float32."""
        loss = pinball_loss(prediction, target, self.quantile_levels)
        finite = torch.isfinite(target)
        if bool(finite.all()):
            return loss.mean()
        return loss[finite].mean()


    # The standalone-training pieces both quantile forecasters share (metrics val_quantile_loss_best and test_metrics).
    def on_train_start(self) -> None:
        """Standalone training: forget the sanity check's best validation loss."""
        self.val_quantile_loss_best.reset()  # forget the sanity check's value

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.test_metrics.compute())
        self.test_metrics.reset()


FLAT = 0  # ``selected_update`` when no candidate has beaten flat on validation: the agent holds no position


@dataclass
class Selection:
    """Model selection on held-out data: the best validation reward so far, the candidates' Sharpes, patience."""

    best: float = 0.0  # best validation reward per bar after costs (raw log return); flat's 0 until a candidate beats it
    best_update: int = -1  # update whose weights are the policy (-1: nothing scored yet; FLAT: no candidate beat flat)
    since_best: int = 0  # evaluations since the best
    sharpes: list[float] = field(default_factory=list)  # per-bar validation Sharpe of every candidate scored
    latest: dict[str, float] = field(default_factory=dict)  # the last evaluation's figures, until logged

    def state_dict(self, finished: bool) -> dict[str, Any]:
        return {"best": self.best, "best_update": self.best_update, "since_best": self.since_best,
                "sharpes": list(self.sharpes), "finished": finished}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Selection:
        return cls(state["best"], state["best_update"], state["since_best"], list(state["sharpes"]))


class Agent(Member):
    """A member that learns positions by acting in the vectorised market of the training split.

    Against memorising the training path (issue 16), every agent can choose its weights on validation: every
    ``select_every`` updates it scores the deterministic policy of its learning network on the validation split
    (reward per bar after costs), keeps the best weights as the policy it trades (``policy_net``; never chosen on
    training reward), stops learning after ``patience`` scores without a gain, and reports the train / validation gap.
    Flat is the first candidate (it earns 0 after costs): until a candidate's validation reward beats it, the agent
    holds no position, so a member that shows no edge after costs stays flat rather than pay them.
    A subclass sets ``select_every``, ``policy_net`` (a frozen copy of its network when ``select_every`` > 0),
    ``selected_update``, ``selection``, ``train_split``/``val_split``, ``n_inputs`` and implements :meth:`positions_of`,
    :meth:`build_networks` and :meth:`release_environment`.
    """

    kind: ClassVar[MemberKind] = "agent"
    monitor: ClassVar[str] = "val/reward_per_bar_neg"
    cost_bps: float  # the cost it trades with: its own, or the ensemble's from bind
    reward_scale_used: float | None  # fitted on the training split when the environment is first built
    select_every: int  # updates between validation scores of the learning network (0: the last weights trade)
    policy_net: nn.Module | None  # the weights chosen on validation (select_every > 0)
    selected_update: Tensor  # buffer: the update whose weights policy_net holds (-1: none scored yet; FLAT: none beat flat)
    selection: Selection
    train_split: MarketSplit | None
    val_split: MarketSplit | None
    n_inputs: int | None  # features a bar the networks were built for (None: not built yet)
    _held_out: tuple[MarketTensors, MarketTensors] | None  # (train tail, val) markets for selection

    def positions_of(self, net: nn.Module, market: MarketTensors) -> Tensor:
        """[T] positions of ``net``'s deterministic policy over ``market`` (``net`` in eval mode)."""
        raise NotImplementedError

    def check_run(self, planned_updates: int) -> list[str]:
        every = self.select_every
        if every and every > planned_updates:
            return [f"select_every={every} exceeds the {planned_updates} updates of this run: no validation choice is "
                    "made, so the last weights trade and no candidate counts for the do-no-harm rule"]
        return []

    def decision_table(self, net: nn.Module, market: MarketTensors, bars: Tensor | None = None) -> Tensor | None:
        """[T, A] the action index ``net``'s deterministic policy takes at each bar for each action index held coming
        in (what :meth:`positions_of` rolls out; a live session applies one row a bar: ``bars`` evaluates only those
        rows, the others flat); None for a continuous policy, which steps with :meth:`continuous_step`."""
        raise NotImplementedError

    def continuous_step(self, net: nn.Module, market: MarketTensors, bars: Tensor, decide: Tensor,
                        held: Tensor) -> Tensor:
        """[B] positions a continuous policy takes at ``bars`` [B] of ``market`` from the positions ``held`` [B]
        coming in (flat where ``decide`` is False): one step of :meth:`positions_of`'s recurrence."""
        raise NotImplementedError(f"{type(self).__name__} has no continuous policy")

    def init_selection(self, select_every: int) -> None:
        """The selection's state, nothing chosen yet (a subclass's constructor calls it; its ``build_networks`` makes
        ``policy_net`` when ``select_every`` > 0 and calls :meth:`freeze_policy_copy`)."""
        self.select_every = int(select_every)  # read every update: a plain attribute
        self.policy_net = None
        self.register_buffer("selected_update", torch.tensor(-1, dtype=torch.int64))
        self.selection = Selection()
        self.finished = False
        self._held_out = None

    def freeze_policy_copy(self) -> None:
        """The policy copy starts as the learning network's weights, and never learns."""
        if self.policy_net is not None:
            self.policy_net.load_state_dict(self.network.state_dict())
            self.policy_net.requires_grad_(False)

    def warn_without_validation(self) -> None:
        """Say once that selection cannot run: the data has no validation split."""
        if self.select_every and self.val_split is None:
            rank_zero_warn(f"{type(self).__name__}: select_every > 0 but the data has no validation split: the last "
                           "weights trade")

    def load_selection_state(self, state: dict[str, Any] | None) -> None:
        """Restore what ``Selection.state_dict`` wrote into a run state (absent in older checkpoints)."""
        if state is not None:
            self.selection = Selection.from_state(state)
            self.finished = bool(state["finished"])

    @property
    def policy_network(self) -> nn.Module:
        """The network that trades: the validation-selected weights once chosen, else the learning network."""
        if self.policy_net is not None and int(self.selected_update) > FLAT:
            return self.policy_net
        return self.network

    @property
    def holds_flat(self) -> bool:
        """True when validation selection ran and no candidate beat flat after costs: the agent trades nothing."""
        return self.policy_net is not None and int(self.selected_update) == FLAT

    @torch.no_grad()
    def policy_positions(self, split: MarketSplit | MarketTensors) -> tuple[Tensor, MarketTensors]:
        """[T] positions of the policy it trades over a whole split (flat where no decision can be taken, and
        everywhere while :attr:`holds_flat`), and the market they are on."""
        market = split if isinstance(split, MarketTensors) else self.market_tensors(split)
        if self.holds_flat:
            return torch.zeros(market.n_bars, dtype=torch.float32, device=market.returns.device), market
        net = self.policy_network
        with eval_mode(net):
            return self.positions_of(net, market), market

    def maybe_select(self, update: int) -> None:
        """After update number ``update`` (0-based): score and choose on validation when ``select_every`` says so."""
        every = self.select_every
        if every and (update + 1) % every == 0 and self.val_split is not None:
            self.select(update + 1)

    def _held_out_markets(self) -> tuple[MarketTensors, MarketTensors]:
        """(the last stretch of the training split, at most 16,384 bars and no longer than the validation split, the
        validation split): the markets the policy is scored on, with real costs (the train one measures the
        generalisation gap; shorter than validation because it is not what chooses)."""
        if self._held_out is None:
            assert self.train_split is not None and self.val_split is not None
            train = self.train_split
            n = min(len(self.val_split), len(train), 16_384)
            tail = torch.zeros(len(train), dtype=torch.bool)
            tail[len(train) - n :] = True
            self._held_out = (self.market_tensors(train.select(tail)), self.market_tensors(self.val_split))
        return self._held_out

    def policy_score(self, net: nn.Module, market: MarketTensors) -> tuple[float, float, float]:
        """(reward per bar after costs, per-bar Sharpe, turnover) of ``net``'s deterministic policy on ``market``."""
        with eval_mode(net):
            pos = self.positions_of(net, market)
        pnl = counted_log_returns(pos, market.returns, market.cost_bps, market.decision, market.reset_mask)[market.decision]
        changes = counted_position_changes(pos, market.decision, market.reset_mask)[market.decision]
        return float(pnl.mean()), sharpe_moments(pnl).sr_per_bar, float(changes.mean())

    @torch.no_grad()
    def select(self, update: int) -> None:
        """Score the learning network's policy on the validation split; keep it as the policy if it is the best so
        far (reward per bar after costs), and stop learning after ``patience`` scores without a gain."""
        net = self.network
        assert self.policy_net is not None
        train_market, val_market = self._held_out_markets()
        val_reward, val_sharpe, val_turnover = self.policy_score(net, val_market)
        train_reward, _, _ = self.policy_score(net, train_market)
        s = self.selection
        s.sharpes.append(val_sharpe)
        if s.best_update < 0:  # the first score: flat (0 after costs) is the incumbent
            s.best_update = FLAT
            self.selected_update.fill_(FLAT)
        if val_reward > s.best:
            s.best, s.best_update, s.since_best = val_reward, update, 0
            self.policy_net.load_state_dict(net.state_dict())
            self.selected_update.fill_(update)
        else:
            s.since_best += 1
        patience = self.hparams.patience
        if patience and s.since_best >= patience:
            self.finished = True
        s.latest = {
            "train/greedy_reward_per_bar": train_reward, "val/greedy_reward_per_bar": val_reward,
            "val/greedy_turnover": val_turnover, "val/best_reward_per_bar": s.best,
            "train/generalisation_gap": train_reward - val_reward, "val/selected_update": float(s.best_update),
        }

    def held_out_metrics(self) -> dict[str, float]:
        latest, self.selection.latest = self.selection.latest, {}
        return latest

    def selection_sharpes(self) -> list[float]:
        """Its own validation scores when it chooses its weights (each validation's policy is one of them), else
        the policy of each validation (the learning network's), as every member's."""
        return list(self.selection.sharpes) if self.select_every else super().selection_sharpes()

    def record_validation_sharpe(self, sharpe: float) -> None:
        if not self.select_every:  # choosing on validation, its own scores are the candidates
            super().record_validation_sharpe(sharpe)

    def build_networks(self, n_inputs: int) -> None:
        """Its networks for ``n_inputs`` features a bar (sets ``n_inputs``)."""
        raise NotImplementedError

    def release_environment(self) -> None:
        """Drop the environment and buffers built for the previous market (:meth:`start` builds them anew)."""
        raise NotImplementedError

    def attach_market(self, train: MarketSplit, val: MarketSplit | None = None) -> None:
        """Give the agent its training market (the environment) and, optionally, the validation market."""
        if self.n_inputs is None:
            self.build_networks(train.n_features)
        if train.n_features != self.n_inputs:
            raise ValueError(f"train split {train.name!r} has {train.n_features} features, {type(self).__name__}'s "
                             f"networks were built for {self.n_inputs}")
        if val is not None and val.n_features != train.n_features:
            raise ValueError(f"validation split {val.name!r} has {val.n_features} features, train has {train.n_features}")
        self.train_split, self.val_split = train, val
        self._held_out = None
        self.release_environment()

    def start(self) -> None:
        """Before the first update: build the environment on the member's device and warm up (e.g. fill replay)."""
        raise NotImplementedError

    @torch.no_grad()
    def positions(self, split: MarketSplit) -> Tensor:
        """[T] positions of the traded policy over ``split`` (flat where no decision can be taken)."""
        return self.policy_positions(split)[0].float()

    def evaluate(self, split: MarketSplit, bars_per_year: float | None = None) -> dict[str, float]:
        """Back-test metrics of the traded policy on ``split`` (raw returns, raw costs)."""
        positions, market = self.policy_positions(split)
        bpy = bars_per_year or infer_bars_per_year(split.timestamps, split.symbol_index)
        m = trading_metrics(positions, market.returns, market.cost_bps, bpy, mask=market.decision, reset=market.reset_mask)
        return {k: float(v) for k, v in m.as_dict().items()}

    # The market and exported values every agent keeps the same way (a window of features, its actions, the cost it
    # was bound with, the reward scale fitted on its training split).
    def market_tensors(self, split: MarketSplit) -> MarketTensors:
        """The split as the agent's market: its window, actions, cost and reward scale, on the member's device."""
        hp = self.hparams
        return MarketTensors(
            split, hp.window, tuple(hp.actions), self.cost_bps, hp.reward_source,
            1.0 if self.reward_scale_used is None else self.reward_scale_used, device=self.device,
        )

    def export_state(self) -> dict[str, float | int | str | None]:
        return {"cost_bps": self.cost_bps, "reward_scale": self.reward_scale_used}

    def load_export_state(self, state: dict[str, Any]) -> None:
        if state.get("cost_bps") is not None:
            self.cost_bps = float(state["cost_bps"])
        self.reward_scale_used = state.get("reward_scale")


def _decision_row(stat: Tensor) -> Tensor:
    """Per-step [B, H] statistics reduced to the decision row's, [B, 1] (per-row [B] ones are already)."""
    return stat[:, :1] if stat.dim() == 2 else stat


def _broadcast_rows(stat: Tensor, pred: Tensor) -> Tensor:
    """Per-row [B] or per-step [B, H] statistics shaped to broadcast against [B, H, Q]."""
    stat = stat.to(device=pred.device, dtype=pred.dtype)
    if stat.dim() == 1:
        return stat.view(-1, 1, 1)
    if stat.dim() == 2:
        return stat.unsqueeze(-1)
    raise ValueError(f"y_loc/y_scale must be [B] or [B, H], got {list(stat.shape)}")
