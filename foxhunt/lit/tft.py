"""TFTModule: the Temporal Fusion Transformer as a forecaster member, trained on window batches with the pinball loss.

Inside the ensemble the coordinator drives it through the :class:`~foxhunt.lit.member.Forecaster` protocol; it also
trains on its own with a plain ``Trainer`` (automatic optimisation), which the tests and notebooks use.

Batches are dicts from :class:`foxhunt.data.windows.WindowBatches`: ``x_past`` [B, L, F], ``x_future`` [B, H, K],
``y`` [B, H] (preprocessed next-bar returns), ``y_raw`` [B, H] (raw log returns), ``symbol`` [B], ``t`` [B], and
optionally ``y_loc``/``y_scale`` ([B] or [B, H]) mapping a prediction of ``y`` back to a log return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torchmetrics import MinMetric

from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.data.windows import WindowBatches
from foxhunt.evaluation.figures import Interpretation, attention_figure, importance_figure
from foxhunt.evaluation.forecast_metrics import (
    forecast_metrics,
    validate_quantiles,
)
from foxhunt.lit.member import Forecaster, eval_mode
from foxhunt.models.tft import TemporalFusionTransformer, TFTOutput
from foxhunt.training.gradnorm import grad_norms
from foxhunt.training.optim import Optimization

TFTInterpretation = Interpretation  # the name the notebooks use


@dataclass(frozen=True)
class TFTOptimization(Optimization):
    """The TFT's optimisation defaults: those of :class:`~foxhunt.training.optim.Optimization`."""


class TFTModule(Forecaster):
    """Quantile forecasts of the next ``horizon`` bar returns from ``lookback`` bars of features."""

    def __init__(
        self,
        n_features: int | None = None,
        n_known_future: int | None = None,
        n_symbols: int | None = None,
        lookback: int | None = None,
        horizon: int | None = None,
        hidden_size: int = 32,
        attention_heads: int = 4,
        hidden_continuous_size: int = 16,
        lstm_layers: int = 1,
        dropout: float = 0.1,
        quantiles: tuple[float, ...] = (0.1, 0.5, 0.9),
        add_relative_time: bool = True,
        log_figures: bool = True,
        compile_network: bool = False,
        fused: bool = True,
        keep_activations_mib: int = 512,
        linear_skip: bool = False,
        policy_interval: tuple[float, float] = (0.1, 0.9),
        optim: TFTOptimization | Mapping[str, Any] = TFTOptimization(),
        feature_names: list[str] | None = None,
        known_future_names: list[str] | None = None,
        symbol_names: list[str] | None = None,
    ) -> None:
        """
        Sizes that follow from the data (``n_features`` .. ``horizon`` and the names) may be left None: the coordinator
        binds them from the data (:meth:`bind`). Given, they build the network at once (and must match the data).

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
            log_figures: log variable-importance and attention figures to TensorBoard at validation end.
            compile_network: torch.compile the network in place at fit start.
            fused: run the per-variable GRNs of variable selection as the chunked fused kernel (False: the plain
                reference path; both compute the same function with the same parameters).
            keep_activations_mib: per variable selection, the fused path keeps activations for backward up to this
                size (MiB) rather than recompute them there (~400 MiB with ~125 inputs at batch 128 x 64 bars); 0: never.
            linear_skip: add a linear quantile regression on the decision row's inputs to the network's output
                (:mod:`foxhunt.models.linear_skip`): the direct path the quick start's weak signal needs (without it
                the median does not find the signal in the quick start's 1,500 steps).
            policy_interval: the forecast quantiles whose interval must clear the cost for the member's policy to take
                a position (see :func:`foxhunt.evaluation.policies.forecast_policy`).
            optim: the optimisation settings (:class:`~foxhunt.training.optim.Optimization`; fields not given keep
                :class:`TFTOptimization`'s defaults).
            feature_names: names of the F past inputs, for interpretation figures.
            known_future_names: names of the K known-future inputs.
            symbol_names: names of the symbols.
        """
        super().__init__()
        self.init_optim(TFTOptimization.of(optim))
        optim = self.optim.as_dict()  # noqa: F841 - hyperparameters hold plain values (read by save_hyperparameters)
        self.save_hyperparameters()
        self.quantiles = validate_quantiles(quantiles)
        for name, names, n in (("feature_names", feature_names, n_features), ("known_future_names", known_future_names, n_known_future)):
            if names is not None and n is not None and len(names) != n:
                raise ValueError(f"{name} has {len(names)} entries, expected {n}")
        for q in policy_interval:
            if not any(abs(q - x) < 1e-9 for x in self.quantiles):
                raise ValueError(f"policy_interval quantile {q} is not one of the quantiles {list(self.quantiles)}")
        if not policy_interval[0] <= 0.5 <= policy_interval[1]:
            raise ValueError(f"policy_interval must be (lower, upper) with lower <= 0.5 <= upper (the long edge is the "
                             f"lower quantile, the short edge the upper one), got {tuple(policy_interval)}")
        self.policy_interval = (float(policy_interval[0]), float(policy_interval[1]))
        self.spec: MarketSpec | None = None  # what the network was built for (plain attribute, never a hyperparameter)
        self.net: TemporalFusionTransformer | None = None
        sizes = (n_features, n_known_future, lookback, horizon)
        if all(v is not None for v in sizes):
            feats = list(feature_names) if feature_names else [f"x{i}" for i in range(n_features)]  # type: ignore[arg-type]
            known = list(known_future_names) if known_future_names else [f"k{i}" for i in range(n_known_future)]  # type: ignore[arg-type]
            symbols = list(symbol_names) if symbol_names else [f"s{i}" for i in range(n_symbols or 1)]
            self._build(MarketSpec(feats, known, symbols, int(lookback), int(horizon)))  # type: ignore[arg-type]
        elif any(v is not None for v in sizes):
            raise ValueError("give all of n_features, n_known_future, lookback and horizon, or none (bound from the data)")
        self.register_buffer("quantile_levels", torch.tensor(self.quantiles, dtype=torch.float32), persistent=False)
        self.val_metrics = forecast_metrics(self.quantiles, prefix="val/")
        self.test_metrics = forecast_metrics(self.quantiles, prefix="test/")
        self.val_quantile_loss_best = MinMetric()
        self._target_transform: nn.Module | None = None
        self._figure_batch: dict[str, Tensor] | None = None

    # ------------------------------------------------------------------------------------------------ member protocol
    def _build(self, spec: MarketSpec) -> None:
        hp = self.hparams
        self.net = TemporalFusionTransformer(
            n_features=spec.n_features,
            n_known_future=len(spec.known_future),
            n_symbols=len(spec.symbols),
            lookback=spec.lookback,
            horizon=spec.horizon,
            hidden_size=hp.hidden_size,
            attention_heads=hp.attention_heads,
            hidden_continuous_size=hp.hidden_continuous_size,
            lstm_layers=hp.lstm_layers,
            dropout=hp.dropout,
            n_quantiles=len(self.quantiles),
            add_relative_time=hp.add_relative_time,
            fused=hp.fused,
            keep_activations_mib=hp.keep_activations_mib,
            linear_skip=hp.get("linear_skip", False),
        )
        self.spec = spec

    def bind(self, spec: MarketSpec, extra_inputs: int = 0, seed_offset: int = 0, cost_bps: float | None = None) -> None:
        """Build the network for the data's features, known-future inputs, symbols and windows (checked if given)."""
        hp = self.hparams
        given = {"n_features": spec.n_features, "n_known_future": len(spec.known_future), "n_symbols": len(spec.symbols),
                 "lookback": spec.lookback, "horizon": spec.horizon}
        for key, value in given.items():
            if hp.get(key) is not None and int(hp[key]) != value:
                raise ValueError(f"TFTModule was configured with {key}={hp[key]}, the data has {value}")
        if self.spec is None or self.spec != spec:
            self._build(spec)

    @property
    def network(self) -> nn.Module:
        if self.net is None:
            raise RuntimeError("TFTModule has no network yet: bind it to the data (or give its sizes)")
        return self.net

    @property
    def horizon(self) -> int:
        assert self.spec is not None
        return self.spec.horizon

    def training_loss(self, batch: Any, update: int) -> Tensor:
        self._last_loss = self.quantile_loss(self(batch).prediction, batch["y"])
        return self._last_loss

    def training_metrics(self) -> dict[str, float]:
        loss = getattr(self, "_last_loss", None)
        return {} if loss is None else {"loss": float(loss.detach())}

    def validation_update(self, batch: dict[str, Tensor]) -> Tensor:
        out = self(batch)
        self.val_metrics.update(self.to_return_scale(out.prediction, batch), batch["y_raw"].float())
        return self.quantile_loss(out.prediction, batch["y"])

    def test_update(self, batch: dict[str, Tensor]) -> None:
        out = self(batch)
        self.test_metrics.update(self.to_return_scale(out.prediction, batch), batch["y_raw"].float())

    def validation_metrics(self) -> dict[str, Tensor]:
        values = self.val_metrics.compute()
        self.val_metrics.reset()
        return {k.removeprefix("val/"): v for k, v in values.items()}

    @torch.no_grad()
    def forecast(self, split: MarketSplit, batch_size: int = 2048, net: nn.Module | None = None,
                 rows: Tensor | None = None) -> Tensor:
        """[T, H, Q] quantile forecasts (log-return scale) at every window-valid row of ``split``; NaN elsewhere."""
        assert self.spec is not None
        net = self.network if net is None else net
        spec = self.spec
        batches = WindowBatches(split, spec.lookback, spec.horizon, batch_size=batch_size, known_future=list(spec.known_future),
                                device=self.device)
        if rows is not None:
            batches.keep(rows)
        out = torch.full((len(split), spec.horizon, len(self.quantiles)), float("nan"), device=self.device)
        with eval_mode(net):
            for batch in batches:
                pred = net(batch["x_past"], batch["x_future"], batch["symbol"]).prediction.float()
                out[batch["t"]] = self.to_return_scale(pred, batch)
        return out

    # ----------------------------------------------------------------------------------------------------------- steps
    def forward(self, batch: dict[str, Tensor]) -> TFTOutput:
        return self.network(batch["x_past"], batch.get("x_future"), batch.get("symbol"))

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

    # ------------------------------------------------------------------------------------------------------ optimiser
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log grad norms every N steps, then apply the non-finite guard (Lightning has already unscaled here)."""
        every = self.optim.log_grad_norm_every
        if every and self.global_step % every == 0:
            self.log_dict(grad_norms(self.network))
        if getattr(self.trainer.precision_plugin, "scaler", None) is None:
            # (under 16-mixed the GradScaler skips overflowing steps itself and lowers the scale)
            self.guard.check_gradients(self.network, self.global_step)
        self.log("train/nonfinite_skipped", float(self.guard.skipped), on_step=True, on_epoch=False)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.hparams.compile_network:
            self.network.compile()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["nonfinite_guard"] = self.guard.state_dict()
        if self.spec is not None:
            checkpoint["market_spec"] = self.spec.as_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Rebuild the network for the spec it was trained on (Lightning loads the state dict after this hook)."""
        if "market_spec" in checkpoint:
            self.bind(MarketSpec(**checkpoint["market_spec"]))
        if "nonfinite_guard" in checkpoint:
            self.guard.load_state_dict(checkpoint["nonfinite_guard"])

    # ------------------------------------------------------------------------------------------------ interpretation
    def variable_names(self) -> tuple[list[str], list[str], list[str]]:
        """Names of the static, encoder and decoder selection variables, in network order."""
        assert self.spec is not None
        time = ["relative_time"] if self.hparams.add_relative_time else []
        return ["symbol"], list(self.spec.feature_names) + time, list(self.spec.known_future) + time

    @torch.no_grad()
    def interpret(self, batch: dict[str, Tensor]) -> Interpretation:
        """Variable importances of the three selection networks and head-averaged attention, in eval mode."""
        was_training = self.training
        self.eval()
        try:
            batch = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
            out = self(batch)
        finally:
            self.train(was_training)
        static, encoder, decoder = self.variable_names()
        return Interpretation(
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
        importance, attention = importance_figure(interp), attention_figure(interp, self.spec.lookback)
        for lg in loggers:
            lg.experiment.add_figure("interpret/variable_importance", importance, self.global_step, close=False)
            lg.experiment.add_figure("interpret/attention", attention, self.global_step, close=False)
