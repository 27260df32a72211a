"""EnsembleModule: trains a TFTModule and a DQNModule together in one Trainer and combines their positions.

The coordinator owns the loop, the members own their maths: it uses manual optimisation with each member's own
AdamW and schedule (from the member's ``configure_optimizers``), clips and logs *unscaled* gradients per member in
``on_before_optimizer_step`` (Lightning's precision plugin unscales a GradScaler's gradients just before that hook,
so clipping there is correct under ``16-mixed``), applies each member's non-finite guard, and schedules the members:
TFT-only warm-up steps, then joint steps.

Combinations (``combine``):

- ``vote``: the rounded mean of the member positions (one long and one flat stays flat).
- ``sharpe_weighted``: member positions weighted by their positive validation Sharpe (FinRL's ensemble picks the
  agent with the best validation Sharpe; this is its soft version). Weights come from the latest validation.
- ``stack``: the DQN observes the TFT's quantile forecasts of the next H bars as extra features. Forecasts on the
  TFT's own training bars would be in-sample, so the training split is cut in time: the TFT trains on the first
  ``stack_fraction`` of it; at the end of the warm-up a frozen snapshot of the TFT forecasts the remaining training
  bars (which it never saw), the validation and the test split; the DQN trains on those later training bars only.
  The ensemble's position is the stacked DQN's.

The TFT's own policy is long (short) when the lower (upper) edge of its forecast interval for the next bar clears
the cost, and holds while its median keeps the sign; see :func:`foxhunt.evaluation.policies.forecast_policy`.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor

from foxhunt.data.market import MarketSplit
from foxhunt.data.windows import WindowBatches
from foxhunt.evaluation.policies import (
    Combine,
    forecast_policy,
    sharpe_weights,
    vote,
    weighted,
)
from foxhunt.evaluation.trading import bars_per_year as infer_bars_per_year
from foxhunt.evaluation.trading import strategy_log_returns, trading_metrics
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.tft import TFTModule
from foxhunt.training.gradnorm import grad_norms

BACKTEST_KEYS = ("sharpe", "total_log_return", "reward_per_bar", "max_drawdown", "turnover", "hit_rate", "n_trades")


class EnsembleModule(L.LightningModule):
    """The coordinator: one Trainer, two members, one trading policy."""

    def __init__(
        self,
        tft: TFTModule | None = None,
        dqn: DQNModule | None = None,
        combine: Combine = "sharpe_weighted",
        tft_warmup_steps: int = 200,
        tft_steps_per_joint_step: int = 1,
        dqn_updates_per_joint_step: int = 1,
        gradient_clip_val: float = 1.0,
        cost_bps: float = 1.0,
        tft_interval: tuple[float, float] = (0.1, 0.9),
        stack_fraction: float = 0.5,
        bars_per_year: float | None = None,
        log_figures: bool = True,
        seed: int = 0,
    ) -> None:
        """
        Args:
            tft: the forecasting member (None for a DQN-only run).
            dqn: the trading member (None for a TFT-only run).
            combine: how member positions become the ensemble's ("stack", "vote", "sharpe_weighted").
            tft_warmup_steps: training steps in which only the TFT learns.
            tft_steps_per_joint_step: TFT updates per training step after the warm-up (0: the TFT stops).
            dqn_updates_per_joint_step: DQN updates per training step after the warm-up.
            gradient_clip_val: max gradient norm per member (0: no clipping), applied to unscaled gradients.
            cost_bps: transaction cost per unit of position traded, in basis points, for every back-test.
            tft_interval: the forecast quantiles whose interval must clear the cost for the TFT to take a position.
            stack_fraction: with combine="stack", the share of the training split (in time) the TFT trains on.
            bars_per_year: Sharpe annualisation; None infers it from the bar spacing.
            log_figures: draw equity curves, the fan chart and the TFT's interpretation figures at validation end.
            seed: seeds the members' RNG-dependent parts not seeded by themselves.
        """
        super().__init__()
        if tft is None and dqn is None:
            raise ValueError("EnsembleModule needs at least one member: give tft, dqn or both")
        if combine == "stack" and (tft is None or dqn is None):
            raise ValueError("combine='stack' needs both a tft and a dqn member")
        if combine not in ("stack", "vote", "sharpe_weighted"):
            raise ValueError(f"combine must be 'stack', 'vote' or 'sharpe_weighted', got {combine!r}")
        if not 0.0 < stack_fraction < 1.0:
            raise ValueError(f"stack_fraction must be in (0, 1), got {stack_fraction}")
        if tft is not None:
            qs = list(tft.quantiles)
            for q in tft_interval:
                if not any(abs(q - x) < 1e-9 for x in qs):
                    raise ValueError(f"tft_interval quantile {q} is not one of the TFT's quantiles {qs}")
        self.save_hyperparameters(ignore=["tft", "dqn"])
        self.automatic_optimization = False
        self.tft = tft
        self.dqn = dqn
        if combine == "stack":
            assert tft is not None and dqn is not None
            n_stack = tft.hparams.horizon * len(tft.quantiles)
            # a frozen copy of the TFT taken at the end of its warm-up produces the DQN's extra inputs
            self.tft_snapshot = copy.deepcopy(tft.net).requires_grad_(False)
            self.register_buffer("stack_mean", torch.zeros(n_stack))
            self.register_buffer("stack_std", torch.ones(n_stack))
            dqn.build_networks(dqn.hparams.n_features + n_stack)
        self.member_names = [n for n, m in (("tft", tft), ("dqn", dqn)) if m is not None]
        self.dqn_updates = 0
        self.tft_updates = 0
        self._weights = [1.0 / len(self.member_names)] * len(self.member_names)
        self._splits: dict[str, MarketSplit] = {}
        self._stacked: dict[str, MarketSplit] = {}
        self._dqn_ready = False
        self._active: str | None = None
        self._oracle: dict[str, Tensor] = {}
        self.last_backtest: dict[str, dict[str, float]] = {}

    # ------------------------------------------------------------------------------------------------ wiring
    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "splits"):
            raise RuntimeError("EnsembleModule needs a BarDataModule (it reads its MarketSplits)")
        dm.setup(stage)
        self._splits = dict(dm.splits)
        if self.tft is not None:
            self.tft.target_transform = dm.target_transform
        if self.hparams.combine == "stack":
            dm.train_window_mask = self._tft_window_mask(dm.train_split)
        market = getattr(dm, "market", None)
        if market is not None:  # the synthetic market knows the oracle's conditional means
            from foxhunt.data.datamodule import SPLITS

            for name in SPLITS:
                rows = torch.from_numpy(dm.split_rows[name])
                self._oracle[name] = torch.from_numpy(market.oracle_mean)[rows]
        if self.dqn is not None and self.trainer.world_size > 1:
            # each DDP rank explores its own episodes: environment, replay and exploration seeds differ by rank
            self.dqn.hparams.seed = int(self.dqn.hparams.seed) + 1000 * self.global_rank
        if self.dqn is not None and self.hparams.combine != "stack":
            self.dqn.attach_market(dm.train_split, dm.val_split)

    def _stack_mask(self, split: MarketSplit) -> Tensor:
        """[T] rows of the training split before the stacking cut time (the TFT's share; the DQN gets the rest)."""
        ts = split.timestamps
        cut_time = torch.quantile(ts.unique().double(), self.hparams.stack_fraction)
        return ts.double() < cut_time

    def _tft_window_mask(self, split: MarketSplit) -> Tensor:
        """Decision rows whose H targets all lie before the stacking cut, so the TFT never sees the DQN's labels."""
        before = self._stack_mask(split)
        h = self.tft.hparams.horizon if self.tft is not None else 1
        ok = torch.zeros_like(before)
        if len(split) > h:
            ok[:-h] = before[h:] & (split.symbol_index[h:] == split.symbol_index[:-h])
        return ok

    # ------------------------------------------------------------------------------------------------ training
    def configure_optimizers(self) -> tuple[list[Any], list[Any]]:
        """Each member's own AdamW and schedule; Lightning saves and restores their states with the checkpoint."""
        optimizers, schedulers = [], []
        self._scheduler_of: dict[str, Any] = {}
        for name in self.member_names:
            config = getattr(self, name).configure_optimizers()
            optimizer = config["optimizer"] if isinstance(config, dict) else config
            optimizers.append(optimizer)
            sched = config.get("lr_scheduler") if isinstance(config, dict) else None
            if sched is not None:
                sched = dict(sched) if isinstance(sched, dict) else {"scheduler": sched}
                sched["name"] = f"lr-{name}"
                schedulers.append(sched)
                self._scheduler_of[name] = sched["scheduler"]
        return optimizers, schedulers

    def _opt(self, name: str):
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        return opts[self.member_names.index(name)]

    def _sched_step(self, name: str) -> None:
        sched = self._scheduler_of.get(name)
        if sched is None or isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return  # plateau schedules step at validation end
        sched.step()

    def in_warmup(self) -> bool:
        return self.tft is not None and self.tft_updates < self.hparams.tft_warmup_steps

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """One round per update: the participating members' losses, one backward of their sum, each optimizer steps.

        The members' parameters are disjoint, so the gradient of the sum is each member's own gradient; one backward
        per round is also what DDP expects of a forward.
        """
        hp = self.hparams
        warm = self.in_warmup()
        n_tft = 0 if self.tft is None else (1 if warm else hp.tft_steps_per_joint_step)
        n_dqn = 0 if (self.dqn is None or warm) else hp.dqn_updates_per_joint_step
        if n_dqn and not self._dqn_ready:
            self._start_dqn()
        for r in range(max(n_tft, n_dqn)):
            losses = {}
            if r < n_tft:
                losses["tft"] = self._tft_loss(batch)
            if r < n_dqn:
                losses["dqn"] = self._dqn_loss()
            self._joint_step(losses)

    def _tft_loss(self, batch: dict[str, Tensor]) -> Tensor:
        tft = self.tft
        assert tft is not None
        loss = tft.quantile_loss(tft(batch).prediction, batch["y"])
        self.log("train/tft_loss", loss.detach(), on_step=True, prog_bar=True, batch_size=batch["y"].shape[0])
        return loss

    def _start_dqn(self) -> None:
        """Build the DQN's environment (stacked with TFT forecasts when combining by stacking) and fill its replay."""
        dqn = self.dqn
        assert dqn is not None
        if self.hparams.combine == "stack":
            self._take_snapshot()
            self._stacked = {k: self.stacked(self._slice_for(k)) for k in ("train", "val")}
            dqn.attach_market(self._stacked["train"], self._stacked["val"])
        dqn.on_train_start()
        self._dqn_ready = True

    def _dqn_loss(self) -> Tensor:
        """The DQN's environment steps and TD loss, paced exactly as when it trains alone."""
        dqn = self.dqn
        assert dqn is not None and dqn.replay is not None
        hp = dqn.hparams
        loss, q, eps = dqn.act_and_td_loss(self.dqn_updates)
        scale = dqn.reward_scale_used or 1.0
        self.log_dict(
            {"train/dqn_td_loss": loss.detach(), "train/q_mean": q.mean() / scale, "train/q_max": q.max() / scale,
             "train/epsilon": float(eps), "train/env_steps": float(dqn.env_steps)},
            on_step=True, batch_size=hp.batch_size,
        )
        return loss

    def _net(self, name: str) -> torch.nn.Module:
        member = getattr(self, name)
        return member.net if name == "tft" else member.q_net

    def _updates(self, name: str) -> int:
        return self.tft_updates if name == "tft" else self.dqn_updates

    def _joint_step(self, losses: dict[str, Tensor]) -> None:
        """Guard each loss, backward their sum once, then guard, clip (in the hook) and step each member."""
        live = {}
        for name, loss in losses.items():
            member = getattr(self, name)
            if member.guard.check_loss(loss, self._updates(name)):
                live[name] = loss
            else:
                self.log(f"train/{name}_nonfinite_skipped", float(member.guard.skipped))
        if not live:
            return
        for name in live:
            self._opt(name).zero_grad(set_to_none=True)
        self.manual_backward(sum(live.values()))
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        for name in live:
            member, opt = getattr(self, name), self._opt(name)
            # Without a GradScaler the gradients are final here: a non-finite one raises or skips the member's step.
            # With one (16-mixed), the scaler itself skips overflowing steps and lowers its scale.
            if scaler is None and not member.guard.check_gradients(self._net(name), self._updates(name)):
                self.log(f"train/{name}_nonfinite_skipped", float(member.guard.skipped))
                opt.zero_grad(set_to_none=True)
                continue
            self._active = name
            opt.step()
            self._active = None
            self._sched_step(name)
            if name == "tft":
                self.tft_updates += 1
            else:
                self.dqn_updates += 1
                self.dqn.update_target(self.dqn_updates)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients are unscaled here (by the precision plugin): log the active member's norms, then clip them."""
        name = self._active
        if name is None:
            return
        member = getattr(self, name)
        net = self._net(name)
        step = self._updates(name)
        every = member.hparams.log_grad_norm_every
        if every and step % every == 0:
            self.log_dict({f"grad_norm/{name}/{k.split('/')[-1]}": v for k, v in grad_norms(net).items()})
        clip = self.hparams.gradient_clip_val
        if clip and clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)

    # ------------------------------------------------------------------------------------------------ stacking
    @torch.no_grad()
    def forecasts(self, split: MarketSplit, net: torch.nn.Module | None = None) -> Tensor:
        """[T, H, Q] quantile forecasts (original return scale) at every window-valid row of ``split``; NaN elsewhere."""
        tft = self.tft
        assert tft is not None
        net = net if net is not None else tft.net
        hp = tft.hparams
        known = list(hp.known_future_names or [])
        batches = WindowBatches(split, hp.lookback, hp.horizon, batch_size=2048, known_future=known, device=self.device)
        out = torch.full((len(split), hp.horizon, len(tft.quantiles)), float("nan"), device=self.device)
        was = net.training
        net.eval()
        loc_all, scale_all = split.target_loc.to(self.device), split.target_scale.to(self.device)
        for batch in batches:
            pred = net(batch["x_past"], batch["x_future"], batch["symbol"]).prediction.float()
            batch["y_loc"], batch["y_scale"] = loc_all[batch["t"]], scale_all[batch["t"]]
            out[batch["t"]] = tft.to_return_scale(pred, batch)
        net.train(was)
        return out

    def _take_snapshot(self) -> None:
        """Freeze the TFT as it is now and fit the standardisation of its forecasts on the DQN's training bars."""
        assert self.tft is not None
        self.tft_snapshot.load_state_dict(self.tft.net.state_dict())
        fc = self.forecasts(self._slice_for("train"), self.tft_snapshot).flatten(1)
        ref = fc[torch.isfinite(fc).all(1)]
        self.stack_mean.copy_(ref.mean(0))
        self.stack_std.copy_(ref.std(0).clamp_min(1e-12))

    def stacked(self, split: MarketSplit) -> MarketSplit:
        """The split with the snapshot's standardised forecasts appended to its features (the DQN's inputs)."""
        assert self.tft is not None
        fc = self.forecasts(split, self.tft_snapshot).flatten(1)
        z = torch.nan_to_num((fc - self.stack_mean) / self.stack_std, nan=0.0).clamp(-10, 10).float().to(split.features.device)
        names = [f"tft_h{h}_q{q}" for h in range(self.tft.hparams.horizon) for q in self.tft.quantiles]
        return replace(split, features=torch.cat([split.features, z], 1), feature_names=split.feature_names + names)

    # ------------------------------------------------------------------------------------------------ evaluation
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self.tft is None:
            return
        if batch_idx == 0:
            self._figure_batch = {k: v[:256].detach() for k, v in batch.items() if isinstance(v, Tensor)}
        out = self.tft(batch)
        loss = self.tft.quantile_loss(out.prediction, batch["y"])
        self.log("val/tft_loss", loss, on_epoch=True, batch_size=batch["y"].shape[0])
        self.tft.val_metrics.update(self.tft.to_return_scale(out.prediction, batch), batch["y_raw"].float())

    def on_validation_epoch_end(self) -> None:
        values: dict[str, Tensor] = {}
        if self.tft is not None:
            values = self.tft.val_metrics.compute()
            self.tft.val_metrics.reset()
            self.log_dict({k.replace("val/", "val/tft/"): v for k, v in values.items()})
        split = self._splits["val"]
        fc = self.forecasts(split) if self.tft is not None else None
        pos = self.positions(split, self._oracle.get("val"), forecasts=fc)
        results = self.backtest(split, update_weights=True, positions=pos)
        for who, metrics in results.items():
            self.log_dict({f"val/{who}/{k}": float(v) for k, v in metrics.items() if k in BACKTEST_KEYS})
        self.log("val/sharpe", float(results["ensemble"]["sharpe"]), prog_bar=True)
        for name, sched in getattr(self, "_scheduler_of", {}).items():
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) and not self.trainer.sanity_checking:
                # lower is better: the TFT's quantile loss, the DQN's negated reward per bar
                sched.step(float(values["val/quantile_loss"]) if name == "tft" else -results["dqn"]["reward_per_bar"])
        for i, name in enumerate(self.member_names):
            self.log(f"val/weight_{name}", float(self._weights[i]))
        self.last_backtest = results
        if self.hparams.log_figures and not self.trainer.sanity_checking:
            self._log_figures(split, pos, fc)

    def _log_figures(self, split: MarketSplit, pos: dict[str, Tensor], fc: Tensor | None) -> None:
        """Equity curves of every policy, the TFT's forecast fan chart and variable importances, to TensorBoard."""
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers = [lg for lg in self.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return
        from foxhunt.backtest import equity_figure, fan_chart

        figures = {"backtest/equity_val": equity_figure(pos, split, self.hparams.cost_bps)}
        if fc is not None:
            figures["forecast/fan_chart_val"] = fan_chart(fc, split)
            batch = getattr(self, "_figure_batch", None)
            if batch is not None and self.tft.hparams.log_figures:
                from foxhunt.lit.tft import attention_figure, importance_figure

                interp = self.tft.interpret(batch)
                figures["interpret/variable_importance"] = importance_figure(interp)
                figures["interpret/attention"] = attention_figure(interp, self.tft.hparams.lookback)
        for lg in loggers:
            for tag, fig in figures.items():
                lg.experiment.add_figure(tag, fig, self.global_step, close=False)

    def on_fit_start(self) -> None:
        """Record every member's hyperparameters in the logger's hparams tab."""
        params: dict[str, Any] = {f"ensemble/{k}": v for k, v in self.hparams.items()}
        for name in self.member_names:
            params.update({f"{name}/{k}": v for k, v in getattr(self, name).hparams.items() if not isinstance(v, (list, tuple)) or len(v) <= 8})
        for lg in self.loggers:
            lg.log_hyperparams(params)

    def positions(self, split: MarketSplit, oracle_mean: Tensor | None = None, forecasts: Tensor | None = None) -> dict[str, Tensor]:
        """[T] positions of every member, the ensemble, buy-and-hold (and the oracle when its means are given)."""
        decision = split.valid.to(self.device)
        reset = _resets(split, self.device)
        pos: dict[str, Tensor] = {}
        if self.tft is not None:
            fc = (self.forecasts(split) if forecasts is None else forecasts)[:, 0, :]  # next-bar quantiles
            qs = list(self.tft.quantiles)
            lo, hi = (qs.index(min(qs, key=lambda x: abs(x - q))) for q in self.hparams.tft_interval)
            mid = qs.index(min(qs, key=lambda x: abs(x - 0.5)))
            ok = decision & torch.isfinite(fc).all(1)
            pos["tft"] = forecast_policy(fc[:, lo], fc[:, mid], fc[:, hi], self.hparams.cost_bps, ok, reset)
        if self.dqn is not None and (self.hparams.combine != "stack" or self._dqn_ready):
            p, _ = self.dqn.greedy_positions(self.stacked(split) if self.hparams.combine == "stack" else split)
            pos["dqn"] = p.to(self.device).float()
        names = [n for n in self.member_names if n in pos]
        members = [pos[n] for n in names]
        if self.hparams.combine == "stack":
            pos["ensemble"] = pos.get("dqn", torch.zeros(len(split), device=self.device))
        elif self.hparams.combine == "vote":
            pos["ensemble"] = vote(members)
        else:
            pos["ensemble"] = weighted(members, [self._weights[self.member_names.index(n)] for n in names])
        pos["buy_and_hold"] = decision.float()
        if oracle_mean is not None:
            from foxhunt.rl.oracle import oracle_positions

            # the better of the two causal oracles on these bars (the Markov one approximates the GARCH-scaled signal)
            actions = torch.tensor([-1.0, 0.0, 1.0], device=self.device)
            m = oracle_mean.to(self.device)
            best, best_reward = None, -float("inf")
            for kind in ("markov", "myopic"):
                p = oracle_positions(m, actions, self.hparams.cost_bps, decision, reset, kind=kind).float()
                reward = float(strategy_log_returns(p.double(), torch.nan_to_num(split.returns.to(self.device).double()), self.hparams.cost_bps, reset)[decision].mean())
                if reward > best_reward:
                    best, best_reward = p, reward
            pos["oracle"] = best
        return pos

    @torch.no_grad()
    def backtest(
        self,
        split: MarketSplit | str,
        update_weights: bool = False,
        oracle_mean: Tensor | None = None,
        positions: dict[str, Tensor] | None = None,
    ) -> dict[str, dict[str, float]]:
        """After-cost metrics of every policy on a split; with ``update_weights``, refresh the Sharpe weights (and
        the ensemble's entry of ``positions``, when given) from this split."""
        if isinstance(split, str):
            oracle_mean = self._oracle.get(split) if oracle_mean is None else oracle_mean
            split = self._splits[split]
        returns = split.returns.to(self.device)
        decision = split.valid.to(self.device)
        reset = _resets(split, self.device)
        bpy = self.hparams.bars_per_year or infer_bars_per_year(split.timestamps, split.symbol_index)

        def metrics(p: Tensor) -> dict[str, float]:
            m = trading_metrics(p, returns, self.hparams.cost_bps, bpy, mask=decision, reset=reset)
            return {k: float(v) for k, v in m.as_dict().items()}

        pos = self.positions(split, oracle_mean) if positions is None else positions
        results = {who: metrics(p) for who, p in pos.items()}
        if update_weights and self.hparams.combine == "sharpe_weighted":
            self._weights = sharpe_weights([results[n]["sharpe"] if n in results else 0.0 for n in self.member_names])
            names = [n for n in self.member_names if n in pos]
            pos["ensemble"] = weighted([pos[n] for n in names], [self._weights[self.member_names.index(n)] for n in names])
            results["ensemble"] = metrics(pos["ensemble"])
        return results

    # ------------------------------------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Members' run state (replay, env, guards), counters, weights and RNG states, for an exact resume."""
        for name in self.member_names:
            getattr(self, name).on_save_checkpoint(checkpoint)
        checkpoint["ensemble_state"] = {
            "dqn_updates": self.dqn_updates,
            "tft_updates": self.tft_updates,
            "weights": list(self._weights),
            "dqn_ready": self._dqn_ready,
            "torch_rng": torch.get_rng_state(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for name in self.member_names:
            getattr(self, name).on_load_checkpoint(checkpoint)
        state = checkpoint.get("ensemble_state", {})
        self.dqn_updates = int(state.get("dqn_updates", 0))
        self.tft_updates = int(state.get("tft_updates", 0))
        self._weights = list(state.get("weights", self._weights))
        self._resume_rng = state.get("torch_rng")
        self._resume_dqn = bool(state.get("dqn_ready", False))

    def on_train_start(self) -> None:
        if getattr(self, "_resume_dqn", False) and self.dqn is not None and not self._dqn_ready:
            if self.hparams.combine == "stack":  # the snapshot and its statistics came back with the state dict
                self._stacked = {k: self.stacked(self._slice_for(k)) for k in ("train", "val")}
                self.dqn.attach_market(self._stacked["train"], self._stacked["val"])
            self.dqn.on_train_start()
            self._dqn_ready = True
        if getattr(self, "_resume_rng", None) is not None:
            torch.set_rng_state(self._resume_rng)
            self._resume_rng = None

    def _slice_for(self, name: str) -> MarketSplit:
        if name == "train":
            train = self._splits["train"]
            return train.select(~self._stack_mask(train))
        return self._splits[name]


def _resets(split: MarketSplit, device: torch.device) -> Tensor:
    """[T] True at the first bar of each symbol (a position cannot be carried in from another symbol)."""
    sym = split.symbol_index.to(device)
    reset = torch.ones_like(sym, dtype=torch.bool)
    reset[1:] = sym[1:] != sym[:-1]
    return reset
