"""Mamba2Module: a Mamba-2 forecaster member, trained on window batches with the pinball loss.

The network is :class:`foxhunt.models.mamba2.Mamba2Forecaster`: the L past rows of features, then H decoder rows
carrying the known-future inputs (zeros where a feature is not known in advance, and a decoder indicator), the symbol
embedding on every row, a causal stack of Mamba-2 blocks, and a quantile head read from the H decoder rows.

Inside the ensemble the coordinator drives it through the :class:`~foxhunt.lit.member.Forecaster` protocol, exactly
like the TFT; it also trains on its own with a plain ``Trainer`` (automatic optimisation). Sizes that follow from the
data (features, known-future inputs, symbols, window lengths) reach it through :meth:`Mamba2Module.bind` and are
never hyperparameters; a standalone checkpoint carries the bound spec, so ``load_from_checkpoint`` rebuilds it.

**Lookback.** The member reads the coordinator's window batches, whose past length is the data's ``lookback``
(``data.lookback`` in a fit config), shared by every forecaster. A long-memory Mamba-2 (its cost is linear in the
lookback) therefore needs ``data.lookback`` set to the lookback it should read; the member's own ``lookback``
(optional, <= the data's) reads only the last rows of each window, so a TFT and a Mamba-2 can share one data
module with different memories.

Batches are dicts from :class:`foxhunt.data.windows.WindowBatches`: ``x_past`` [B, L, F], ``x_future`` [B, H, K],
``y`` [B, H], ``y_raw`` [B, H], ``symbol`` [B], ``t`` [B], and optionally ``y_loc``/``y_scale``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import MinMetric

from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.data.windows import WindowBatches
from foxhunt.evaluation.forecast_metrics import forecast_metrics, validate_quantiles
from foxhunt.lit.member import Forecaster, eval_mode
from foxhunt.models.mamba2 import Mamba2Forecaster, Mamba2Output
from foxhunt.training.gradnorm import grad_norms
from foxhunt.training.optim import Optimization


@dataclass(frozen=True)
class Mamba2Optimization(Optimization):
    """The Mamba-2's optimisation defaults: :class:`~foxhunt.training.optim.Optimization`'s, with torch's default
    (unfused) AdamW."""

    fused_adamw: bool = False


class Mamba2Module(Forecaster):
    """Quantile forecasts of the next ``horizon`` bar returns from a window of features, by a Mamba-2 stack."""

    reads_shorter_lookback = True

    def __init__(
        self,
        d_model: int = 32,
        n_layers: int = 2,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        headdim: int = 16,
        ngroups: int = 1,
        chunk_size: int = 16,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        dt_limit: tuple[float, float] | None = None,
        dropout: float = 0.0,
        linear_skip: bool = False,
        lookback: int | None = None,
        use_kernels: bool = False,
        native: bool = True,
        quantiles: tuple[float, ...] = (0.1, 0.5, 0.9),
        compile_network: bool = False,
        policy_interval: tuple[float, float] = (0.1, 0.9),
        optim: Mamba2Optimization | Mapping[str, Any] = Mamba2Optimization(),
    ) -> None:
        """
        The network is built when the member is bound to the data (:meth:`bind`; the coordinator does it in setup).

        Args:
            d_model: model width d (the residual stream).
            n_layers: Mamba-2 blocks in the stack.
            d_state: SSM state size N.
            d_conv: width of the causal depthwise convolution over (x, B, C).
            expand: inner width E = expand * d_model.
            headdim: channels per SSM head P (E must divide by it; heads H = E / P).
            ngroups: groups G of B and C shared by heads (H must divide by it).
            chunk_size: longest chunk of the PyTorch SSD scan and the C loops' checkpoint interval; a speed setting
                only (outputs do not depend on it).
            A_init_range: A = -U(range) at initialisation.
            dt_min: smallest step size dt at initialisation (log-uniform in [dt_min, dt_max]).
            dt_max: largest step size dt at initialisation.
            dt_init_floor: floor of dt at initialisation.
            dt_limit: clamp dt into [lo, hi] in training and inference; None: no clamp.
            dropout: dropout on each block's output, before the residual sum.
            linear_skip: add a linear quantile regression on the decision row's inputs to the network's output
                (:mod:`foxhunt.models.linear_skip`): the direct path to a weak signal.
            lookback: past rows the member reads, <= the data's lookback (the last rows of each window); None: all.
            use_kernels: on CUDA, run the SSD scan with mamba_ssm's fused kernel if installed (``foxhunt[cuda]``).
            native: on the CPU, run each block's convolution, SSD and norms in foxhunt's compiled C loops (the SSD
                step by step; ``foxhunt.kernels.mamba2_block``) where a C compiler is available, else the plain
                PyTorch block. The same parameters and outputs (to float32 rounding).
            quantiles: forecast quantile levels, increasing, including 0.5.
            compile_network: torch.compile the network in place at fit start.
            policy_interval: the forecast quantiles whose interval must clear the cost for the member's policy to take
                a position (see :func:`foxhunt.evaluation.policies.forecast_policy`).
            optim: the optimisation settings (:class:`~foxhunt.training.optim.Optimization`; fields not given keep
                :class:`Mamba2Optimization`'s defaults; weight decay spares biases, norms, A_log, D and dt_bias).
        """
        super().__init__()
        self.init_optim(Mamba2Optimization.of(optim))
        optim = self.optim.as_dict()  # noqa: F841 - hyperparameters hold plain values (read by save_hyperparameters)
        self.save_hyperparameters()
        self.quantiles = validate_quantiles(quantiles)
        for q in policy_interval:
            if not any(abs(q - x) < 1e-9 for x in self.quantiles):
                raise ValueError(f"policy_interval quantile {q} is not one of the quantiles {list(self.quantiles)}")
        if not policy_interval[0] <= 0.5 <= policy_interval[1]:
            raise ValueError(f"policy_interval must be (lower, upper) with lower <= 0.5 <= upper (the long edge is the "
                             f"lower quantile, the short edge the upper one), got {tuple(policy_interval)}")
        if lookback is not None and lookback < 1:
            raise ValueError(f"lookback must be >= 1 (or None: the data's), got {lookback}")
        self.policy_interval = (float(policy_interval[0]), float(policy_interval[1]))
        self.spec: MarketSpec | None = None  # what the network was built for (plain attribute, never a hyperparameter)
        self.net: Mamba2Forecaster | None = None
        with torch.device("meta"):  # the blocks' own checks (widths, heads, groups, ranges) now, on a throwaway network
            self._network_for(MarketSpec(["x"], [], ["s"], 1, 1))
        self.register_buffer("quantile_levels", torch.tensor(self.quantiles, dtype=torch.float32), persistent=False)
        self.val_metrics = forecast_metrics(self.quantiles, prefix="val/")
        self.test_metrics = forecast_metrics(self.quantiles, prefix="test/")
        self.val_quantile_loss_best = MinMetric()
        self._target_transform: nn.Module | None = None

    # ------------------------------------------------------------------------------------------------ member protocol
    def _network_for(self, spec: MarketSpec) -> Mamba2Forecaster:
        hp = self.hparams
        missing = [name for name in spec.known_future if name not in spec.feature_names]
        if missing:
            raise ValueError(f"known-future input(s) {missing} are not among the features {spec.feature_names[:8]}...")
        return Mamba2Forecaster(
            n_features=spec.n_features,
            known_future_index=[spec.feature_names.index(name) for name in spec.known_future],
            n_symbols=len(spec.symbols),
            horizon=spec.horizon,
            d_model=hp.d_model,
            n_layers=hp.n_layers,
            n_quantiles=len(self.quantiles),
            dropout=hp.dropout,
            linear_skip=hp.get("linear_skip", False),
            d_state=hp.d_state,
            d_conv=hp.d_conv,
            expand=hp.expand,
            headdim=hp.headdim,
            ngroups=hp.ngroups,
            chunk_size=hp.chunk_size,
            A_init_range=tuple(hp.A_init_range),
            dt_min=hp.dt_min,
            dt_max=hp.dt_max,
            dt_init_floor=hp.dt_init_floor,
            dt_limit=None if hp.dt_limit is None else tuple(hp.dt_limit),
            use_kernels=hp.use_kernels,
            native=hp.get("native", True),
        )

    def bind(
        self, spec: MarketSpec, extra_inputs: int = 0, seed_offset: int = 0, cost_bps: float | None = None
    ) -> None:
        """Build the network for the data's features, known-future inputs, symbols and windows."""
        lookback = self.hparams.lookback
        if lookback is not None and lookback > spec.lookback:
            raise ValueError(
                f"Mamba2Module has lookback={lookback}, but the data's windows have {spec.lookback} past rows: set the "
                f"data's lookback (data.lookback) to at least {lookback}"
            )
        if self.spec is None or self.spec != spec:
            self.net = self._network_for(spec)
            self.spec = spec

    @property
    def network(self) -> nn.Module:
        if self.net is None:
            raise RuntimeError("Mamba2Module has no network yet: bind it to the data (module.bind(spec))")
        return self.net

    @property
    def horizon(self) -> int:
        assert self.spec is not None
        return self.spec.horizon

    @property
    def lookback(self) -> int:
        """Past rows the network reads: the member's ``lookback``, or the data's."""
        assert self.spec is not None
        return self.hparams.lookback or self.spec.lookback

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
        self.test_metrics.update(self.to_return_scale(self(batch).prediction, batch), batch["y_raw"].float())

    def validation_metrics(self) -> dict[str, Tensor]:
        values = self.val_metrics.compute()
        self.val_metrics.reset()
        return {k.removeprefix("val/"): v for k, v in values.items()}

    @torch.no_grad()
    def forecast(self, split: MarketSplit, batch_size: int = 2048, net: nn.Module | None = None,
                 rows: Tensor | None = None) -> Tensor:
        """[T, H, Q] quantile forecasts (log-return scale) at every window-valid row of ``split``; NaN elsewhere.

        Windows are the data's (its lookback), so every forecaster of an ensemble forecasts the same rows."""
        assert self.spec is not None
        net = self.network if net is None else net
        spec = self.spec
        batches = WindowBatches(split, spec.lookback, spec.horizon, batch_size=batch_size,
                                known_future=list(spec.known_future), device=self.device)
        if rows is not None:
            batches.keep(rows)
        out = torch.full((len(split), spec.horizon, len(self.quantiles)), float("nan"), device=self.device)
        with eval_mode(net):
            for batch in batches:
                out[batch["t"]] = self.to_return_scale(self._run(net, batch).prediction.float(), batch)
        return out

    # ----------------------------------------------------------------------------------------------------------- steps
    def _run(self, net: nn.Module, batch: dict[str, Tensor]) -> Mamba2Output:
        return net(batch["x_past"][:, -self.lookback :], batch.get("x_future"), batch.get("symbol"))

    def forward(self, batch: dict[str, Tensor]) -> Mamba2Output:
        return self._run(self.network, batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        loss = self.quantile_loss(self(batch).prediction, batch["y"])
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
        return self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, "test")

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Quantiles [B, H, Q] of the next H log returns on the original scale, with the rows they belong to."""
        pred = {"quantiles": self.to_return_scale(self(batch).prediction, batch)}
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

    # ------------------------------------------------------------------------------------------------------ optimiser
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log grad norms every N steps, then apply the non-finite guard (Lightning has already unscaled here)."""
        every = self.optim.log_grad_norm_every
        if every and self.global_step % every == 0:
            self.log_dict(grad_norms(self.network))
        if getattr(self.trainer.precision_plugin, "scaler", None) is None:
            self.guard.check_gradients(self.network, self.global_step)
        self.log("train/nonfinite_skipped", float(self.guard.skipped), on_step=True, on_epoch=False)

    def setup(self, stage: str) -> None:
        if self.net is None:
            raise RuntimeError("Mamba2Module has no network yet: bind it to the data (module.bind(spec)) before fit")
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
