"""TFTModule: training loop, shared guard/optimiser wiring, metrics, inverse transform, interpretation, precision."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from foxhunt.data.market import MarketSplit
from foxhunt.data.windows import WindowBatches
from foxhunt.evaluation.forecast_metrics import (
    DirectionalAccuracy,
    IntervalCoverage,
    MeanQuantileLoss,
    MedianForecastMAE,
    QuantileRisk,
    forecast_metrics,
    validate_quantiles,
)
from foxhunt.lit.tft import TFTModule
from foxhunt.preprocessing import TargetTransform
from foxhunt.training.guard import NonFiniteError

LOOKBACK, HORIZON = 16, 3
FEATURES = ["ret", "abs_ret", "tod_sin"]


def make_split(n: int = 1200, seed: int = 0, name: str = "train", scale: float = 1.0) -> MarketSplit:
    """Two symbols of AR(1) returns; features are the last return, its size and a known-future clock."""
    gen = torch.Generator().manual_seed(seed)
    per = n // 2
    rets, feats = [], []
    for _ in range(2):
        e = torch.randn(per + 1, generator=gen, dtype=torch.float64)
        r = torch.zeros(per + 1, dtype=torch.float64)
        for i in range(1, per + 1):
            r[i] = 0.3 * r[i - 1] + e[i]
        r = r * 1e-3
        nxt = torch.cat([r[2:], torch.tensor([math.nan], dtype=torch.float64)])
        clock = torch.sin(torch.arange(per, dtype=torch.float64) / 7.0)
        feats.append(torch.stack([r[1:] * 1e3, r[1:].abs() * 1e3, clock], 1))
        rets.append(nxt)
    returns = torch.cat(rets).float()
    close = torch.exp(torch.cumsum(torch.nan_to_num(returns.double()), 0)) * 100
    return MarketSplit(
        name=name,
        symbols=["A", "B"],
        timestamps=torch.arange(2 * per, dtype=torch.int64) * 60_000_000_000,
        symbol_index=torch.arange(2).repeat_interleave(per),
        ohlcv=torch.stack([close] * 4 + [torch.ones_like(close)], 1),
        returns=returns,
        targets=returns / (1e-3 * scale),
        valid=torch.isfinite(returns),
        features=torch.cat(feats).float(),
        feature_names=list(FEATURES),
        target_loc=torch.zeros_like(returns),
        target_scale=torch.full_like(returns, 1e-3 * scale),
    )


def loader(split: MarketSplit, batch_size: int = 32, shuffle: bool = True) -> WindowBatches:
    return WindowBatches(split, LOOKBACK, HORIZON, batch_size, known_future=["tod_sin"], shuffle=shuffle, drop_last=shuffle)


def module(**kw) -> TFTModule:  # type: ignore[no-untyped-def]
    args = {"n_features": 3, "n_known_future": 1, "n_symbols": 2, "lookback": LOOKBACK, "horizon": HORIZON, "hidden_size": 8,
                "attention_heads": 2, "hidden_continuous_size": 4, "dropout": 0.0, "feature_names": FEATURES,
                "known_future_names": ["tod_sin"]}
    optim = {"lr": 3e-3, "scheduler": "cosine", "log_grad_norm_every": 5, **kw.pop("optim", {})}
    args.update(kw, optim=optim)
    return TFTModule(**args)


def trainer(tmp_path: Path | None = None, **kw) -> pl.Trainer:  # type: ignore[no-untyped-def]
    args = {"max_steps": 20, "accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                "enable_model_summary": False, "gradient_clip_val": 1.0, "limit_val_batches": 2, "num_sanity_val_steps": 0,
                "default_root_dir": tmp_path}
    args.update(kw)
    return pl.Trainer(**args)


# --------------------------------------------------------------------------------------------------------- metrics
def test_forecast_metrics_by_hand() -> None:
    qs = (0.1, 0.5, 0.9)
    pred = torch.tensor([[[-1.0, 0.0, 1.0], [-1.0, 0.5, 2.0]]])  # [1, 2, 3]
    y = torch.tensor([[0.5, -2.0]])
    ql = MeanQuantileLoss(qs)
    ql.update(pred, y)
    # y=0.5: q.1 -> 0.1*1.5, q.5 -> 0.5*0.5, q.9 -> 0.1*0.5 ; y=-2: 0.9*1, 0.5*2.5, 0.1*4
    expected = (0.15 + 0.25 + 0.05 + 0.9 + 1.25 + 0.4) / 6
    assert float(ql.compute()) == pytest.approx(expected)
    risk = QuantileRisk(0.5, 1)
    risk.update(pred, y)
    assert float(risk.compute()) == pytest.approx(2 * (0.25 + 1.25) / 2.5)
    cov = IntervalCoverage(0, 2)
    cov.update(pred, y)
    assert float(cov.compute()) == pytest.approx(0.5)
    mae = MedianForecastMAE(1)
    mae.update(pred, y)
    assert float(mae.compute()) == pytest.approx((0.5 + 2.5) / 2)
    da = DirectionalAccuracy(1)
    da_pred = torch.tensor([[[-1.0, 0.2, 1.0], [-1.0, 0.0, 2.0]]])
    da.update(da_pred, torch.tensor([[0.5, 0.0]]))  # sign matches; zero target ignored
    da.update(da_pred, torch.tensor([[-0.5, float("nan")]]))  # sign wrong; NaN ignored
    da.update(da_pred, torch.tensor([[float("nan"), 1.0]]))  # a zero forecast counts as wrong
    assert float(da.compute()) == pytest.approx(1 / 3)
    coll = forecast_metrics(qs, prefix="val/")
    coll.update(pred, y)
    assert set(coll.compute()) == {f"val/{k}" for k in ("quantile_loss", "q_risk_p50", "q_risk_p90", "coverage",
                                                          "mae_median", "directional_accuracy")}


def test_quantile_validation() -> None:
    with pytest.raises(ValueError, match="median"):
        validate_quantiles((0.1, 0.9))
    with pytest.raises(ValueError, match="increasing"):
        validate_quantiles((0.5, 0.1))
    with pytest.raises(ValueError, match="quantiles"):
        module(quantiles=(0.2, 0.8))


def test_lr_validated_at_construction() -> None:
    with pytest.raises(ValueError, match=r"learning rate must be in \(0, 1\], got 2.0"):
        module(optim={"lr": 2.0})


# ---------------------------------------------------------------------------------------------------------- training
def test_training_learns_and_logs(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    m = module()
    train, val = make_split(seed=0), make_split(seed=1, name="val")
    before = evaluate_loss(m, val)
    m.train()
    t = trainer(tmp_path, max_steps=60, val_check_interval=30, check_val_every_n_epoch=None)
    t.fit(m, loader(train), loader(val, 64, shuffle=False))
    after = evaluate_loss(m, val)
    assert after < 0.9 * before, (before, after)
    logged = t.logged_metrics
    for key in ("train/loss_step", "val/loss", "val/quantile_loss", "val/q_risk_p50", "val/q_risk_p90",
                "val/coverage", "val/mae_median", "val/directional_accuracy", "val/quantile_loss_best",
                "grad_norm/total", "grad_norm/encoder_selection", "grad_norm/lstm_encoder", "train/nonfinite_skipped"):
        assert key in logged, key
    assert all(math.isfinite(float(v)) for v in logged.values())
    # cosine schedule over the trainer's 60 steps, starting from lr
    sched = t.lr_scheduler_configs[0]
    assert sched.interval == "step"
    assert t.optimizers[0].param_groups[0]["lr"] < 3e-3 * 0.05


def evaluate_loss(m: TFTModule, split: MarketSplit) -> float:
    m.eval()
    with torch.no_grad():
        losses = [float(m.quantile_loss(m(b).prediction, b["y"])) for b in loader(split, 256, shuffle=False)]
    return sum(losses) / len(losses)


def test_bf16_mixed_on_cpu_trains_without_nan(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    m = module(optim={"nonfinite": "raise"})  # any NaN loss or gradient would raise
    t = trainer(tmp_path, max_steps=8, precision="bf16-mixed", limit_val_batches=0)
    t.fit(m, loader(make_split()))
    assert t.global_step == 8
    assert all(torch.isfinite(p).all() for p in m.parameters())


def _poisoned(split: MarketSplit, rows: slice) -> MarketSplit:
    feats = split.features.clone()
    feats[rows] = float("nan")
    return MarketSplit(**{**split.__dict__, "features": feats})


def test_nonfinite_loss_raise_names_step(tmp_path: Path) -> None:
    split = _poisoned(make_split(), slice(0, 600))  # all of symbol A: every early batch meets it
    with pytest.raises(NonFiniteError, match=r"non-finite loss .* at step 0"):
        trainer(tmp_path, max_steps=3, limit_val_batches=0).fit(module(optim={"nonfinite": "raise"}), loader(split))


def test_nonfinite_skip_counts_and_keeps_weights(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    m = module(optim={"nonfinite": "skip", "scheduler": "none"})
    before = {k: v.clone() for k, v in m.state_dict().items()}
    split = _poisoned(make_split(), slice(0, 1200))  # every window is poisoned
    trainer(tmp_path, max_steps=4, limit_train_batches=4, max_epochs=1, limit_val_batches=0).fit(m, loader(split))
    assert m.guard.skipped_loss == 4
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


class _PoisonGrad(pl.Callback):
    """Corrupts the LSTM encoder's gradients just before the module's guard looks at them."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == 2:
            pl_module.net.lstm_encoder.weight_hh_l0.grad[0, 0] = float("inf")


def test_nonfinite_gradient_raise_names_block(tmp_path: Path) -> None:
    t = trainer(tmp_path, max_steps=5, limit_val_batches=0, callbacks=[_PoisonGrad()], gradient_clip_val=None)
    with pytest.raises(NonFiniteError, match=r"step 2 in block\(s\): lstm_encoder \("):
        t.fit(module(optim={"nonfinite": "raise"}), loader(make_split()))


def test_nonfinite_gradient_skip_counts(tmp_path: Path) -> None:
    m = module(optim={"nonfinite": "skip"})
    t = trainer(tmp_path, max_steps=5, limit_val_batches=0, callbacks=[_PoisonGrad()], gradient_clip_val=None)
    t.fit(m, loader(make_split()))
    assert m.guard.skipped_gradients == 1 and m.guard.skipped == 1
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("kind,expected", [("step", "StepDecay"), ("plateau", "ReduceLROnPlateau"), ("none", None)])
def test_scheduler_choices(tmp_path: Path, kind: str, expected: str | None) -> None:
    m = module(optim={"scheduler": kind, "step_size": 5, "gamma": 0.5})
    t = trainer(tmp_path, max_steps=10, limit_val_batches=1, val_check_interval=5, check_val_every_n_epoch=None)
    t.fit(m, loader(make_split()), loader(make_split(seed=1), 64, shuffle=False))
    configs = t.lr_scheduler_configs
    if expected is None:
        assert configs == []
        assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(3e-3)
        return
    sched = configs[0].scheduler
    assert expected in type(sched).__name__ or expected in type(getattr(sched, "lr_lambdas", [None])[0]).__name__
    if kind == "step":
        assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(3e-3 * 0.25)
    if kind == "plateau":
        assert configs[0].monitor == "val/loss" and configs[0].interval == "epoch"


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_fused_adamw_steps_like_plain_adamw(weight_decay: float) -> None:
    """fused_adamw switches the member's AdamW to the fused kernel; three steps on the same gradients give the same
    weights as the plain AdamW (fused_adamw=False), decay groups included."""
    fused = module(optim={"fused_adamw": True, "weight_decay": weight_decay, "scheduler": "none"})
    plain = module(optim={"fused_adamw": False, "scheduler": "none", "weight_decay": weight_decay})
    plain.load_state_dict(fused.state_dict())
    before = [p.detach().clone() for p in fused.parameters()]
    opt_fused, opt_plain = fused.configure_optimizers(), plain.configure_optimizers()
    assert all(g["fused"] for g in opt_fused.param_groups) and not any(g.get("fused") for g in opt_plain.param_groups)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(fused.parameters(), plain.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt_fused.step()
        opt_plain.step()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert all(not torch.equal(p, b) for p, b in zip(fused.parameters(), before))  # every tensor moved


# ---------------------------------------------------------------------------------------------- inverse & predict
def test_predict_step_returns_original_scale(tmp_path: Path) -> None:
    split = make_split(scale=2.0)
    m = module()
    batch = next(iter(loader(split, 16, shuffle=False)))
    raw_pred = m.eval()(batch).prediction
    out = m.predict_step(batch, 0)
    torch.testing.assert_close(out["quantiles"], (raw_pred * 2e-3).sort(-1).values)  # y_scale carried by the batch
    assert torch.equal(out["t"], batch["t"]) and torch.equal(out["symbol"], batch["symbol"])
    no_stats = {k: v for k, v in batch.items() if k not in ("y_loc", "y_scale")}
    with pytest.raises(ValueError, match="no y_loc/y_scale and no target_transform"):
        m.predict_step(no_stats, 0)  # predictions of the preprocessed target cannot pass for log returns
    per_row = {**no_stats, "y_scale": torch.full((16,), 3.0), "y_loc": torch.full((16,), 1.0)}
    torch.testing.assert_close(m.predict_step(per_row, 0)["quantiles"], (raw_pred * 3 + 1).sort(-1).values)
    # a fitted target transform is applied when the batch has no per-row statistics
    tt = TargetTransform(scale="fitted").fit(split.returns[torch.isfinite(split.returns)])
    m.target_transform = tt
    expected = raw_pred * tt.scaler.std + tt.scaler.mean
    torch.testing.assert_close(m.predict_step(no_stats, 0)["quantiles"], expected.sort(-1).values)
    assert not any("target_transform" in k for k in m.state_dict())
    preds = trainer(tmp_path).predict(module(), loader(split, 64, shuffle=False))
    assert preds[0]["quantiles"].shape == (64, HORIZON, 3)


def test_metrics_use_raw_scale(tmp_path: Path) -> None:
    """The same forecasts scored with target scale 1x and 10x give the same raw-scale metrics."""
    results = []
    for scale in (1.0, 10.0):
        pl.seed_everything(0, verbose=False)
        m = module()
        with torch.no_grad():  # scale the network's output so raw forecasts coincide
            m.net.quantile_head.weight /= scale
            m.net.quantile_head.bias /= scale
        res = trainer(tmp_path).validate(m, loader(make_split(seed=1, scale=scale), 256, shuffle=False), verbose=False)
        results.append(res[0])
    for key in ("val/quantile_loss", "val/coverage", "val/mae_median", "val/q_risk_p50"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-4), key
    assert results[0]["val/loss"] == pytest.approx(results[1]["val/loss"] * 10, rel=1e-4)


# ------------------------------------------------------------------------------------------------- interpretation
def test_interpret_and_tensorboard_figures(tmp_path: Path) -> None:
    m = module()
    batch = next(iter(loader(make_split(), 32, shuffle=False)))
    interp = m.interpret(batch)
    assert interp.encoder_importance.shape == (32, 4) and interp.encoder_names == FEATURES + ["relative_time"]
    assert interp.decoder_importance.shape == (32, 2) and interp.decoder_names == ["tod_sin", "relative_time"]
    assert interp.static_importance.shape == (32, 1) and interp.static_names == ["symbol"]
    assert interp.attention.shape == (32, HORIZON, LOOKBACK + HORIZON)
    torch.testing.assert_close(interp.encoder_importance.sum(-1), torch.ones(32))
    torch.testing.assert_close(interp.attention.sum(-1), torch.ones(32, HORIZON))
    assert float(interp.attention[:, 0, LOOKBACK + 1 :].abs().max()) == 0.0  # causal
    assert m.training  # interpret restores the mode
    logger = TensorBoardLogger(tmp_path, name="tb")
    t = trainer(tmp_path, max_steps=2, logger=logger, limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None)
    t.fit(m, loader(make_split()), loader(make_split(seed=1), 64, shuffle=False))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    acc.Reload()
    assert {"interpret/variable_importance", "interpret/attention"} <= set(acc.Tags()["images"])


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    m = module(optim={"nonfinite": "skip"})
    t = trainer(tmp_path, max_steps=3, limit_val_batches=0, enable_checkpointing=True)
    t.fit(m, loader(make_split()))
    m.guard.skipped_loss = 2
    path = tmp_path / "tft.ckpt"
    t.save_checkpoint(path)
    loaded = TFTModule.load_from_checkpoint(path, weights_only=False)
    assert loaded.hparams.hidden_size == 8 and loaded.guard.skipped_loss == 2
    batch = next(iter(loader(make_split(), 8, shuffle=False)))
    torch.testing.assert_close(loaded.eval()(batch).prediction, m.eval()(batch).prediction)


def test_forecasts_are_mapped_back_with_the_decision_rows_statistics_and_never_cross() -> None:
    """Step h's row t+h statistics of a rolling target scale read returns up to t+h-1, r[t] among them (the return the
    position at t earns): every step is mapped back with row t's. Crossed quantile heads come back sorted."""
    split = make_split(scale=2.0)
    m = module().eval()
    batch = next(iter(loader(split, 16, shuffle=False)))
    raw = m(batch).prediction
    steps = torch.arange(1, HORIZON + 1, dtype=torch.float32)
    per_step = {**batch, "y_loc": 0.1 * steps.expand(16, -1), "y_scale": steps.expand(16, -1) * 1e-3}
    out = m.to_return_scale(raw, per_step)
    torch.testing.assert_close(out, (raw * 1e-3 + 0.1).sort(-1).values)  # row t's (step 0's) loc and scale only
    crossed = raw.flip(-1)  # the heads in the wrong order
    back = m.to_return_scale(crossed, batch)
    assert (back.diff(dim=-1) >= 0).all()
    torch.testing.assert_close(back, m.to_return_scale(raw, batch))
