"""TFTModule: trains the Temporal Fusion Transformer on window batches with the pinball loss and shared machinery.

Batches are dicts from :class:`foxhunt.data.windows.WindowBatches`: ``x_past`` [B, L, F], ``x_future`` [B, H, K],
``y`` [B, H] (preprocessed next-bar returns), ``y_raw`` [B, H] (raw log returns), ``symbol`` [B], ``t`` [B], and
optionally ``y_loc``/``y_scale`` ([B] or [B, H]) mapping a prediction of ``y`` back to a log return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torchmetrics import MinMetric

from foxhunt.evaluation.forecast_metrics import (
    forecast_metrics,
    pinball_loss,
    validate_quantiles,
)
from foxhunt.models.tft import TemporalFusionTransformer, TFTOutput
from foxhunt.training.gradnorm import grad_norms
from foxhunt.training.guard import NonFiniteGuard
from foxhunt.training.optim import SchedulerKind, configure_adamw, validate_lr


@dataclass
class TFTInterpretation:
    """What the TFT attended to: per-sample variable importances and head-averaged attention."""

    static_importance: Tensor  # [B, S]
    encoder_importance: Tensor  # [B, V_enc], selection weights averaged over the lookback
    decoder_importance: Tensor  # [B, V_dec], averaged over the horizon
    attention: Tensor  # [B, H, L + H], decoder queries over all positions, averaged over heads
    static_names: list[str]
    encoder_names: list[str]
    decoder_names: list[str]


class TFTModule(pl.LightningModule):
    """Quantile forecasts of the next ``horizon`` bar returns from ``lookback`` bars of features."""

    def __init__(
        self,
        n_features: int,
        n_known_future: int,
        n_symbols: int = 1,
        lookback: int = 64,
        horizon: int = 6,
        hidden_size: int = 32,
        attention_heads: int = 4,
        hidden_continuous_size: int = 16,
        lstm_layers: int = 1,
        dropout: float = 0.1,
        quantiles: tuple[float, ...] = (0.1, 0.5, 0.9),
        add_relative_time: bool = True,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        scheduler: SchedulerKind = "cosine",
        warmup_steps: int = 0,
        step_size: int = 1000,
        gamma: float = 0.5,
        min_lr_ratio: float = 0.0,
        plateau_patience: int = 5,
        total_steps: int | None = None,
        nonfinite: Literal["raise", "skip"] = "raise",
        log_grad_norm_every: int = 50,
        log_figures: bool = True,
        compile_network: bool = False,
        feature_names: list[str] | None = None,
        known_future_names: list[str] | None = None,
        symbol_names: list[str] | None = None,
    ) -> None:
        """
        Args:
            n_features: observed past inputs per bar (F).
            n_known_future: known-future inputs per step (K, e.g. calendar); 0 for none.
            n_symbols: symbols trained together; the symbol is the static input.
            lookback: encoder length L in bars.
            horizon: forecast steps H.
            hidden_size: model width d.
            attention_heads: heads of the interpretable attention (d must divide by it).
            hidden_continuous_size: embedding size of each continuous input.
            lstm_layers: layers of the LSTM encoder and decoder.
            dropout: dropout rate in GRNs, gates and attention.
            quantiles: forecast quantile levels, increasing, including 0.5.
            add_relative_time: add the relative time index as a known input of encoder and decoder.
            lr: AdamW learning rate, in (0, 1].
            weight_decay: AdamW decoupled weight decay (matrices only; biases and norms are not decayed).
            betas: AdamW betas.
            eps: AdamW epsilon.
            scheduler: none, step (decay by gamma every step_size steps), cosine (to min_lr_ratio over total_steps),
                plateau (by gamma when val/loss stalls for plateau_patience epochs).
            warmup_steps: linear warm-up steps before step/cosine.
            step_size: optimizer steps between step decays.
            gamma: step-decay / plateau reduction factor.
            min_lr_ratio: cosine floor, and plateau floor, as a fraction of lr.
            plateau_patience: validation epochs without improvement before a plateau reduction.
            total_steps: cosine length; defaults to the trainer's estimated stepping batches.
            nonfinite: on a NaN/Inf loss or gradient, "raise" an error naming step and blocks, or "skip" and count.
            log_grad_norm_every: log total and per-block gradient norms every N optimizer steps (0: never).
            log_figures: log variable-importance and attention figures to TensorBoard at validation end.
            compile_network: torch.compile the network in place at fit start.
            feature_names: names of the F past inputs, for interpretation figures.
            known_future_names: names of the K known-future inputs.
            symbol_names: names of the symbols.
        """
        super().__init__()
        self.save_hyperparameters()
        validate_lr(lr)
        self.quantiles = validate_quantiles(quantiles)
        if log_grad_norm_every < 0:
            raise ValueError(f"log_grad_norm_every must be >= 0, got {log_grad_norm_every}")
        for name, names, n in (("feature_names", feature_names, n_features), ("known_future_names", known_future_names, n_known_future)):
            if names is not None and len(names) != n:
                raise ValueError(f"{name} has {len(names)} entries, expected {n}")
        self.net = TemporalFusionTransformer(
            n_features=n_features,
            n_known_future=n_known_future,
            n_symbols=n_symbols,
            lookback=lookback,
            horizon=horizon,
            hidden_size=hidden_size,
            attention_heads=attention_heads,
            hidden_continuous_size=hidden_continuous_size,
            lstm_layers=lstm_layers,
            dropout=dropout,
            n_quantiles=len(self.quantiles),
            add_relative_time=add_relative_time,
        )
        self.register_buffer("quantile_levels", torch.tensor(self.quantiles, dtype=torch.float32), persistent=False)
        self.guard = NonFiniteGuard(nonfinite)
        self.val_metrics = forecast_metrics(self.quantiles, prefix="val/")
        self.test_metrics = forecast_metrics(self.quantiles, prefix="test/")
        self.val_quantile_loss_best = MinMetric()
        self._target_transform: nn.Module | None = None
        self._figure_batch: dict[str, Tensor] | None = None

    # ------------------------------------------------------------------------------------------------ inverse transform
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
            TFTModule.target_transform.fset(self, value)  # type: ignore[attr-defined]
            return
        super().__setattr__(name, value)

    def to_return_scale(self, prediction: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """Quantile forecasts [B, H, Q] on the original log-return scale (per-row loc/scale first, then the transform)."""
        pred = prediction.float()
        loc, scale = batch.get("y_loc"), batch.get("y_scale")
        if loc is not None:
            loc = _broadcast_rows(loc, pred)
        if scale is not None:
            scale = _broadcast_rows(scale, pred)
        transform = self._target_transform
        if transform is not None:
            transform.to(pred.device)
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

    # ----------------------------------------------------------------------------------------------------------- steps
    def forward(self, batch: dict[str, Tensor]) -> TFTOutput:
        return self.net(batch["x_past"], batch.get("x_future"), batch.get("symbol"))

    def quantile_loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        """Mean pinball loss over finite targets, horizons and quantiles, in float32."""
        loss = pinball_loss(prediction, target, self.quantile_levels)
        finite = torch.isfinite(target)
        if bool(finite.all()):
            return loss.mean()
        return loss[finite].mean()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        out = self(batch)
        loss = self.quantile_loss(out.prediction, batch["y"])
        if not self.guard.check_loss(loss, self.global_step):
            return None  # Lightning skips backward and the optimizer step
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=batch["y"].shape[0])
        return loss

    def _evaluate(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        out = self(batch)
        loss = self.quantile_loss(out.prediction, batch["y"])
        self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch["y"].shape[0])
        metrics = self.val_metrics if stage == "val" else self.test_metrics
        metrics.update(self.to_return_scale(out.prediction, batch), batch["y_raw"].float())
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 0 and self.hparams.log_figures:
            self._figure_batch = {k: v[:256].detach() for k, v in batch.items() if isinstance(v, Tensor)}
        return self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, "test")

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Quantiles [B, H, Q] of the next H log returns on the original scale, with the rows they belong to."""
        out = self(batch)
        pred = {"quantiles": self.to_return_scale(out.prediction, batch)}
        for key in ("symbol", "t"):
            if key in batch:
                pred[key] = batch[key]
        return pred

    def on_train_start(self) -> None:
        self.val_quantile_loss_best.reset()  # forget the sanity check's value

    def on_validation_epoch_end(self) -> None:
        values = self.val_metrics.compute()
        self.val_metrics.reset()
        self.log_dict(values)
        if not self.trainer.sanity_checking:
            self.val_quantile_loss_best.update(values["val/quantile_loss"])
            self.log("val/quantile_loss_best", self.val_quantile_loss_best.compute())
        if self.hparams.log_figures and self._figure_batch is not None:
            self._log_figures(self._figure_batch)
        self._figure_batch = None

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.test_metrics.compute())
        self.test_metrics.reset()

    # ------------------------------------------------------------------------------------------------------ optimiser
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        total = hp.total_steps
        if hp.scheduler == "cosine" and total is None:
            estimated = self.trainer.estimated_stepping_batches
            if not (isinstance(estimated, (int, float)) and estimated < float("inf")):
                raise ValueError("cosine schedule needs total_steps, or a trainer with max_steps or max_epochs")
            total = int(estimated)
        return configure_adamw(
            self.net,
            lr=hp.lr,
            weight_decay=hp.weight_decay,
            scheduler=hp.scheduler,
            betas=tuple(hp.betas),
            eps=hp.eps,
            total_steps=total,
            warmup_steps=hp.warmup_steps,
            step_size=hp.step_size,
            gamma=hp.gamma,
            min_lr_ratio=hp.min_lr_ratio,
            plateau_patience=hp.plateau_patience,
            monitor="val/loss",
            interval="epoch" if hp.scheduler == "plateau" else "step",
        )

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log grad norms every N steps, then apply the non-finite guard (Lightning has already unscaled here)."""
        every = self.hparams.log_grad_norm_every
        if every and self.global_step % every == 0:
            self.log_dict(grad_norms(self.net))
        if getattr(self.trainer.precision_plugin, "scaler", None) is None:
            # (under 16-mixed the GradScaler skips overflowing steps itself and lowers the scale)
            self.guard.check_gradients(self.net, self.global_step)
        self.log("train/nonfinite_skipped", float(self.guard.skipped), on_step=True, on_epoch=False)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.hparams.compile_network:
            self.net.compile()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["nonfinite_guard"] = self.guard.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "nonfinite_guard" in checkpoint:
            self.guard.load_state_dict(checkpoint["nonfinite_guard"])

    # ------------------------------------------------------------------------------------------------ interpretation
    def variable_names(self) -> tuple[list[str], list[str], list[str]]:
        """Names of the static, encoder and decoder selection variables, in network order."""
        hp = self.hparams
        time = ["relative_time"] if hp.add_relative_time else []
        feats = list(hp.feature_names) if hp.feature_names else [f"x{i}" for i in range(hp.n_features)]
        known = list(hp.known_future_names) if hp.known_future_names else [f"k{i}" for i in range(hp.n_known_future)]
        return ["symbol"], feats + time, known + time

    @torch.no_grad()
    def interpret(self, batch: dict[str, Tensor]) -> TFTInterpretation:
        """Variable importances of the three selection networks and head-averaged attention, in eval mode."""
        was_training = self.training
        self.eval()
        try:
            batch = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
            out = self(batch)
        finally:
            self.train(was_training)
        static, encoder, decoder = self.variable_names()
        return TFTInterpretation(
            static_importance=out.static_weights.float(),
            encoder_importance=out.encoder_weights.float().mean(dim=1),
            decoder_importance=out.decoder_weights.float().mean(dim=1),
            attention=out.attention.float().mean(dim=1),
            static_names=static,
            encoder_names=encoder,
            decoder_names=decoder,
        )

    def _log_figures(self, batch: dict[str, Tensor]) -> None:
        loggers = [lg for lg in self.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return
        interp = self.interpret(batch)
        importance, attention = importance_figure(interp), attention_figure(interp, self.hparams.lookback)
        for lg in loggers:
            lg.experiment.add_figure("interpret/variable_importance", importance, self.global_step, close=False)
            lg.experiment.add_figure("interpret/attention", attention, self.global_step, close=False)


def _broadcast_rows(stat: Tensor, pred: Tensor) -> Tensor:
    """Per-row [B] or per-step [B, H] statistics shaped to broadcast against [B, H, Q]."""
    stat = stat.to(device=pred.device, dtype=pred.dtype)
    if stat.dim() == 1:
        return stat.view(-1, 1, 1)
    if stat.dim() == 2:
        return stat.unsqueeze(-1)
    raise ValueError(f"y_loc/y_scale must be [B] or [B, H], got {list(stat.shape)}")


def importance_figure(interp: TFTInterpretation, top: int = 20) -> Any:
    """Bar charts of the mean selection weights: the top encoder variables, decoder variables and static inputs."""
    from matplotlib.figure import (
        Figure,  # the OO API renders with Agg and touches no global pyplot state
    )

    fig = Figure(figsize=(10, 6), layout="constrained")
    axes = fig.subplots(1, 3, width_ratios=[3, 1.2, 0.8])
    panels = (
        ("encoder (past)", interp.encoder_importance, interp.encoder_names, top),
        ("decoder (known future)", interp.decoder_importance, interp.decoder_names, top),
        ("static", interp.static_importance, interp.static_names, top),
    )
    for ax, (title, weights, names, k) in zip(axes, panels):
        mean = weights.mean(dim=0).cpu()
        order = torch.argsort(mean, descending=True)[:k].flip(0)
        ax.barh([names[i] for i in order.tolist()], mean[order].numpy())
        ax.set_title(title)
        ax.set_xlabel("mean selection weight")
    return fig


def attention_figure(interp: TFTInterpretation, lookback: int) -> Any:
    """Heat map of head-averaged attention: decoder step (rows) over position relative to the forecast origin."""
    from matplotlib.figure import Figure

    att = interp.attention.mean(dim=0).cpu().numpy()  # [H, L+H]
    horizon, positions = att.shape
    fig = Figure(figsize=(10, 3), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(
        att, aspect="auto", cmap="viridis", extent=(-lookback + 0.5, positions - lookback + 0.5, horizon + 0.5, 0.5)
    )
    ax.set_xlabel("position relative to forecast origin t")
    ax.set_ylabel("horizon step")
    ax.set_title("interpretable attention (mean over heads and batch)")
    fig.colorbar(image, ax=ax)
    return fig
