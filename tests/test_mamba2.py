"""Mamba-2: the chunked SSD against the step-by-step recurrence (values, gradients, chunk sizes, odd lengths), the
block's recurrent step against its parallel form, causality (bit-identical outputs under future perturbations), and
the forecaster member: training, precision, checkpoints, the ensemble, export and reload, the fit config."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import foxhunt
from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.data.windows import WindowBatches
from foxhunt.kernels.build import compiler
from foxhunt.lit.mamba2 import Mamba2Module
from foxhunt.models.mamba2 import (
    Mamba2Block,
    Mamba2Forecaster,
    Mamba2Stack,
    decay_mask,
    kernels_available,
    segsum,
    ssd_chunked,
    ssd_recurrent,
)
from foxhunt.training.optim import decay_param_groups

ROOT = Path(__file__).resolve().parents[1]
LOOKBACK, HORIZON = 16, 3
FEATURES = ["ret", "abs_ret", "tod_sin"]


# ------------------------------------------------------------------------------------------------------ the SSD scan
def ssd_inputs(b: int = 2, length: int = 37, heads: int = 4, p: int = 3, groups: int = 2, n: int = 5, seed: int = 0,
               dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return {
        "x": rand(b, length, heads, p),
        "dt": torch.nn.functional.softplus(rand(b, length, heads) - 1.0),
        "A": -torch.rand(heads, generator=gen, dtype=dtype) * 3 - 0.1,
        "B": rand(b, length, groups, n),
        "C": rand(b, length, groups, n),
        "D": rand(heads),
        "initial_state": rand(b, heads, p, n),
    }


def test_segsum_and_decay_mask_by_hand() -> None:
    a = torch.tensor([-0.5, -1.0, -2.0], dtype=torch.float64)
    s = segsum(a.cumsum(0))
    inf = math.inf
    expected = torch.tensor([[0.0, -inf, -inf], [-1.0, 0.0, -inf], [-3.0, -2.0, 0.0]], dtype=torch.float64)
    assert torch.equal(s, expected)
    torch.testing.assert_close(decay_mask(a.cumsum(0)), expected.exp())
    a_cum = (-torch.rand(2, 3, 7, dtype=torch.float64)).cumsum(-1).requires_grad_()
    assert torch.autograd.gradcheck(decay_mask, (a_cum,))


@pytest.mark.parametrize("chunk", [1, 3, 8, 16, 37, 64])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_chunked_scan_equals_recurrence_values_and_gradients(chunk: int, with_state: bool,
                                                             groups: int) -> None:
    """The chunked scan against the step-by-step recurrence, values and gradients: any chunk
    length, a length (37) that is no multiple of it, one or two groups of B and C, an initial state or none."""
    inputs = ssd_inputs(groups=groups)
    if not with_state:
        inputs["initial_state"] = None
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items() if v is not None}
    gen = torch.Generator().manual_seed(1)
    w_y = torch.randn(2, 37, 4, 3, generator=gen, dtype=torch.float64)
    w_s = torch.randn(2, 4, 3, 5, generator=gen, dtype=torch.float64)

    def run(fn, **kw):  # type: ignore[no-untyped-def]
        args = {k: leaves.get(k) for k in inputs}
        y, final = fn(**args, **kw)
        grads = torch.autograd.grad((y * w_y).sum() + (final * w_s).sum(), list(leaves.values()))
        return y, final, dict(zip(leaves, grads, strict=True))

    y_ref, s_ref, g_ref = run(ssd_recurrent)
    y, s, g = run(ssd_chunked, chunk_size=chunk, return_final_state=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)
    for name in leaves:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-9, atol=1e-9, msg=name)


def test_chunked_scan_float32_matches_and_returns_input_dtype() -> None:
    inputs = ssd_inputs(length=200, dtype=torch.float64)
    y_ref, _ = ssd_recurrent(**inputs)
    y = ssd_chunked(**{k: v.float() for k, v in inputs.items()}, chunk_size=64)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    y16 = ssd_chunked(**{k: v.bfloat16() for k, v in inputs.items()}, chunk_size=64)
    assert y16.dtype == torch.bfloat16 and torch.isfinite(y16).all()


def test_chunked_scan_without_final_state_and_state_chaining() -> None:
    """Two halves chained through the final state are the whole sequence; y alone is the same with or without it."""
    fn = ssd_chunked
    inputs = ssd_inputs(length=40)
    y_all, s_all = fn(**inputs, chunk_size=8, return_final_state=True)
    torch.testing.assert_close(fn(**inputs, chunk_size=8), y_all, rtol=0, atol=0)
    first = {k: (v[:, :25] if v.dim() > 1 and k != "initial_state" else v) for k, v in inputs.items()}
    y1, s1 = fn(**first, chunk_size=8, return_final_state=True)
    second = {k: (v[:, 25:] if v.dim() > 1 and k != "initial_state" else v) for k, v in inputs.items()}
    second["initial_state"] = s1
    y2, s2 = fn(**second, chunk_size=8, return_final_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_all, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s_all, rtol=1e-10, atol=1e-10)


def test_chunked_scan_is_causal_bit_for_bit() -> None:
    inputs = ssd_inputs(length=50, dtype=torch.float32)
    y = ssd_chunked(**inputs, chunk_size=16)
    t = 20  # inside the second chunk: the rest of that chunk and every later one change
    changed = {k: v.clone() for k, v in inputs.items()}
    for key in ("x", "B", "C"):
        changed[key][:, t + 1 :] = torch.randn_like(changed[key][:, t + 1 :]).abs() * 5
    changed["dt"][:, t + 1 :] = torch.rand_like(changed["dt"][:, t + 1 :]) * 2  # new step sizes within the limit
    y2 = ssd_chunked(**changed, chunk_size=16)
    assert torch.equal(y[:, : t + 1], y2[:, : t + 1])
    assert not torch.equal(y[:, t + 1 :], y2[:, t + 1 :])
    # step sizes so large that a later chunk decays past exp(-60): still bit-identical up to t
    changed["dt"][:, t + 1 :] = 50.0
    y3 = ssd_chunked(**changed, chunk_size=16)
    assert torch.equal(y[:, : t + 1], y3[:, : t + 1])


# ---------------------------------------------------------------------------------------------------------- the block
def block(**kw) -> Mamba2Block:  # type: ignore[no-untyped-def]
    args = {"d_model": 8, "d_state": 5, "d_conv": 4, "headdim": 4, "ngroups": 2, "chunk_size": 6}
    args.update(kw)
    torch.manual_seed(0)
    return Mamba2Block(**args)


def test_block_parameters_follow_the_paper() -> None:
    m = block(dt_min=0.01, dt_max=0.05, A_init_range=(2.0, 4.0))
    assert m.n_heads == 4 and m.d_inner == 16
    # in_proj -> z (E), x (E), B (G N), C (G N), dt (H)
    assert m.in_proj.out_features == 2 * 16 + 2 * 2 * 5 + 4 and m.in_proj.bias is None
    assert m.conv1d.groups == m.conv1d.in_channels == 16 + 2 * 2 * 5
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert bool((dt >= 0.01 - 1e-6).all() and (dt <= 0.05 + 1e-6).all())
    A = -torch.exp(m.A_log)
    assert bool((A <= -2.0 + 1e-6).all() and (A >= -4.0 - 1e-6).all())
    assert torch.equal(m.D.detach(), torch.ones(4))
    with pytest.raises(ValueError, match="divide by headdim"):
        Mamba2Block(8, headdim=5)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2Block(8, headdim=4, ngroups=3)
    limited = block(dt_limit=(0.02, 0.03))
    assert float(limited._dt(torch.full((4,), 50.0)).max().detach()) == pytest.approx(0.03)


@pytest.mark.parametrize("native", [False, True])
def test_block_step_equals_parallel_form(native: bool) -> None:
    m = block().double()
    u = torch.randn(3, 23, 8, dtype=torch.float64)
    y, final = m(u, return_state=True)
    state, steps = m.init_state(3), []
    for t in range(23):
        out, state = m.step(u[:, t], state)
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, 1), y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.ssm, final.ssm, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.conv, final.conv, rtol=1e-12, atol=1e-14)  # in_proj of [b, d] vs [b, L, d]
    # a prefix in parallel, then bar by bar from its state
    y1, state = m(u[:, :10], return_state=True)
    rest = []
    for t in range(10, 23):
        out, state = m.step(u[:, t], state)
        rest.append(out)
    torch.testing.assert_close(torch.cat([y1, torch.stack(rest, 1)], 1), y, rtol=1e-10, atol=1e-12)
    # and the same in float32, within float32 rounding
    m32 = block(native=native)
    assert (m32.native_library(u.float()) is not None) == (native and compiler() is not None)
    y32 = m32(u.float())
    state, steps = m32.init_state(3), []
    for t in range(23):
        out, state = m32.step(u[:, t].float(), state)
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, 1), y32, rtol=1e-4, atol=1e-5)


def test_stack_step_equals_parallel_form() -> None:
    torch.manual_seed(0)
    stack = Mamba2Stack(8, n_layers=3, d_state=5, headdim=4, chunk_size=4).double()
    u = torch.randn(2, 19, 8, dtype=torch.float64)
    y = stack(u)
    states, steps = stack.init_state(2), []
    for t in range(19):
        out, states = stack.step(u[:, t], states)
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, 1), y, rtol=1e-10, atol=1e-12)


def test_stack_tail_equals_the_last_rows_of_the_full_output() -> None:
    """``tail`` (the forecaster reads only its decoder rows) changes what is computed, not the values or gradients."""
    torch.manual_seed(0)
    stack = Mamba2Stack(8, n_layers=2, d_state=5, headdim=4, chunk_size=4).double()
    u = torch.randn(2, 19, 8, dtype=torch.float64, requires_grad=True)
    full = stack(u)[:, -3:]
    grads_full = torch.autograd.grad(full.square().sum(), [u, *stack.parameters()])
    tail, states = stack(u, return_state=True, tail=3)
    _, states_full = stack(u, return_state=True)
    torch.testing.assert_close(tail, full, rtol=1e-12, atol=1e-12)
    for a, b in zip(states, states_full, strict=True):
        torch.testing.assert_close(a.ssm, b.ssm, rtol=0, atol=0)
        torch.testing.assert_close(a.conv, b.conv, rtol=0, atol=0)
    grads_tail = torch.autograd.grad(tail.square().sum(), [u, *stack.parameters()], allow_unused=True)
    for a, b in zip(grads_tail, grads_full, strict=True):
        torch.testing.assert_close(a if a is not None else torch.zeros_like(b), b, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="tail"):
        stack(u, tail=0)


@pytest.mark.parametrize("native", [False, True])
def test_block_and_forecaster_are_causal_bit_for_bit(native: bool) -> None:
    m = block(chunk_size=8, native=native)
    u = torch.randn(2, 30, 8)
    y = m(u)
    t = 12
    u2 = u.clone()
    u2[:, t + 1 :] = torch.randn_like(u2[:, t + 1 :]) * 10
    y2 = m(u2)
    assert torch.equal(y[:, : t + 1], y2[:, : t + 1]) and not torch.equal(y[:, t + 1 :], y2[:, t + 1 :])
    # the forecaster: decoder step h sees the known-future inputs up to step h only
    torch.manual_seed(0)
    net = Mamba2Forecaster(5, [3, 4], n_symbols=2, horizon=4, d_model=8, headdim=4, d_state=4, chunk_size=8,
                           native=native).eval()
    x_past, x_future, sym = torch.randn(3, 10, 5), torch.randn(3, 4, 2), torch.tensor([0, 1, 1])
    pred = net(x_past, x_future, sym).prediction
    later = x_future.clone()
    later[:, 2:] += 5.0
    pred2 = net(x_past, later, sym).prediction
    assert torch.equal(pred[:, :2], pred2[:, :2]) and not torch.equal(pred[:, 2:], pred2[:, 2:])


def test_forecaster_decoder_rows_are_zeros_plus_indicator() -> None:
    """The decoder rows' embedding is the input projection of (known columns in place, zeros elsewhere, indicator 1)."""
    torch.manual_seed(0)
    net = Mamba2Forecaster(5, [3, 1], n_symbols=1, horizon=2, d_model=8, headdim=4, d_state=4)
    x_past, x_future = torch.randn(2, 6, 5), torch.randn(2, 2, 2)
    rows = torch.zeros(2, 2, 6)
    rows[..., 3], rows[..., 1], rows[..., 5] = x_future[..., 0], x_future[..., 1], 1.0
    past = torch.cat([x_past, torch.zeros(2, 6, 1)], -1)
    expected = net.input_proj(torch.cat([past, rows], 1)) + net.symbol_embedding.weight[0]
    torch.testing.assert_close(net.embed(x_past, x_future, torch.zeros(2, dtype=torch.long)), expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not kernels_available(), reason="needs CUDA and mamba_ssm")
def test_cuda_kernels_match_the_pure_pytorch_scan() -> None:
    m = block(d_model=64, headdim=32, d_state=16, ngroups=1, chunk_size=32).cuda()
    u = torch.randn(2, 100, 64, device="cuda")
    y_pure = m(u)
    m.use_kernels = True
    y_kernel = m(u)
    torch.testing.assert_close(y_kernel, y_pure, rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------------------------------------- the member
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
        name=name, symbols=["A", "B"], timestamps=torch.arange(2 * per, dtype=torch.int64) * 60_000_000_000,
        symbol_index=torch.arange(2).repeat_interleave(per),
        ohlcv=torch.stack([close] * 4 + [torch.ones_like(close)], 1), returns=returns, targets=returns / (1e-3 * scale),
        valid=torch.isfinite(returns), features=torch.cat(feats).float(),
        feature_names=list(FEATURES), target_loc=torch.zeros_like(returns),
        target_scale=torch.full_like(returns, 1e-3 * scale),
    )


SPEC = MarketSpec(list(FEATURES), ["tod_sin"], ["A", "B"], LOOKBACK, HORIZON)


def loader(split: MarketSplit, batch_size: int = 32, shuffle: bool = True) -> WindowBatches:
    return WindowBatches(split, LOOKBACK, HORIZON, batch_size, known_future=["tod_sin"], shuffle=shuffle,
                         drop_last=shuffle)


def module(**kw) -> Mamba2Module:  # type: ignore[no-untyped-def]
    args = {"d_model": 16, "n_layers": 2, "d_state": 8, "headdim": 8, "chunk_size": 8}
    optim = {"lr": 3e-3, "scheduler": "cosine", "log_grad_norm_every": 5, **kw.pop("optim", {})}
    args.update(kw, optim=optim)
    m = Mamba2Module(**args)
    m.bind(SPEC)
    return m


def trainer(tmp_path: Path | None = None, **kw) -> pl.Trainer:  # type: ignore[no-untyped-def]
    args = {"max_steps": 20, "accelerator": "cpu", "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "gradient_clip_val": 1.0,
            "limit_val_batches": 2, "num_sanity_val_steps": 0, "default_root_dir": tmp_path}
    args.update(kw)
    return pl.Trainer(**args)


def evaluate_loss(m: Mamba2Module, split: MarketSplit) -> float:
    m.eval()
    with torch.no_grad():
        losses = [float(m.quantile_loss(m(b).prediction, b["y"])) for b in loader(split, 256, shuffle=False)]
    return sum(losses) / len(losses)


def test_member_sizes_are_bound_never_hyperparameters() -> None:
    m = Mamba2Module(d_model=16, headdim=8)
    assert "n_features" not in m.hparams and m.net is None
    with pytest.raises(RuntimeError, match="bind it"):
        _ = m.network
    m.bind(SPEC)
    assert m.net.n_features == 3 and m.net.n_known_future == 1 and m.net.n_symbols == 2 and m.horizon == HORIZON
    with pytest.raises(ValueError, match="data.lookback"):
        Mamba2Module(lookback=LOOKBACK + 1).bind(SPEC)
    with pytest.raises(ValueError, match="not among the features"):
        Mamba2Module().bind(MarketSpec(list(FEATURES), ["dow_sin"], ["A"], LOOKBACK, HORIZON))
    with pytest.raises(ValueError, match="policy_interval"):
        Mamba2Module(policy_interval=(0.2, 0.9))
    with pytest.raises(ValueError, match="divide by headdim"):
        Mamba2Module(d_model=16, headdim=5)


def test_member_lookback_reads_the_last_rows() -> None:
    full, short = module(), module(lookback=5)
    short.load_state_dict(full.state_dict())
    batch = next(iter(loader(make_split(), 8, shuffle=False)))
    trimmed = {**batch, "x_past": batch["x_past"][:, -5:]}
    torch.testing.assert_close(short.eval()(batch).prediction, full.eval()(trimmed).prediction)


def test_weight_decay_by_role() -> None:
    net = module().network
    groups = decay_param_groups(net, 0.1)
    names = {id(p): n for n, p in net.named_parameters()}
    decayed = {names[id(p)] for p in groups[0]["params"]}
    kept = {names[id(p)] for p in groups[1]["params"]}
    for name in ("A_log", "D", "dt_bias", "norm.weight", "conv1d.bias", "norm_f.weight", "input_proj.bias"):
        assert any(n.endswith(name) for n in kept) and not any(n.endswith(name) for n in decayed), name
    for name in ("in_proj.weight", "out_proj.weight", "conv1d.weight", "input_proj.weight", "symbol_embedding.weight",
                 "quantile_head.weight"):
        assert any(n.endswith(name) for n in decayed), name


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
    for key in ("train/loss_step", "val/loss", "val/quantile_loss", "val/coverage", "val/quantile_loss_best",
                "grad_norm/total", "grad_norm/backbone", "grad_norm/input_proj", "train/nonfinite_skipped"):
        assert key in logged, key
    assert all(math.isfinite(float(v)) for v in logged.values())
    assert t.optimizers[0].param_groups[0]["lr"] < 3e-3 * 0.05  # cosine over the trainer's 60 steps


def test_bf16_mixed_on_cpu_trains_without_nan(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    m = module(optim={"nonfinite": "raise"})  # any NaN loss or gradient would raise
    t = trainer(tmp_path, max_steps=8, precision="bf16-mixed", limit_val_batches=0)
    t.fit(m, loader(make_split()))
    assert t.global_step == 8
    assert all(torch.isfinite(p).all() for p in m.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = m.eval()(next(iter(loader(make_split(), 16, shuffle=False)))).prediction
    assert torch.isfinite(pred).all()


def test_bf16_mixed_on_cpu_trains_through_the_coordinator(tmp_path: Path) -> None:
    """The path foxhunt.fit runs: the coordinator steps its members by hand inside training_step, where Lightning's
    autocast is on; the block's scan and C loops compute in float32 under it and train without NaN."""
    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.lit.ensemble import EnsembleModule

    pl.seed_everything(0, verbose=False)
    dm = BarDataModule(synthetic_bars=3000, signal_strength=0.3, features=["logret_1", "logret_5", "rsi_14", "tod_sin"],
                       known_future=["tod_sin"], lookback=8, horizon=2, batch_size=16, cache_dir=None)
    m = Mamba2Module(d_model=16, headdim=8, d_state=8, optim={"lr": 3e-3, "scheduler": "none", "nonfinite": "raise"})
    model = EnsembleModule(members={"mamba2": m}, min_edge_confidence=None)
    t = trainer(tmp_path, max_steps=4, precision="bf16-mixed", limit_val_batches=0, gradient_clip_val=None)
    t.fit(model, datamodule=dm)
    assert model.updates["mamba2"] == 4
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_predict_returns_original_scale_and_checkpoint_round_trip(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    split = make_split(scale=2.0)
    m = module(optim={"nonfinite": "skip"})
    batch = next(iter(loader(split, 16, shuffle=False)))
    raw = m.eval()(batch).prediction
    # mapped back with the batch's y_scale, the quantiles sorted (the untrained heads may cross)
    torch.testing.assert_close(m.predict_step(batch, 0)["quantiles"], (raw * 2e-3).sort(-1).values)
    t = trainer(tmp_path, max_steps=3, limit_val_batches=0, enable_checkpointing=True)
    t.fit(m, loader(split))
    m.guard.skipped_loss = 2
    path = tmp_path / "mamba2.ckpt"
    t.save_checkpoint(path)
    loaded = Mamba2Module.load_from_checkpoint(path, weights_only=False)
    assert loaded.spec == SPEC and loaded.guard.skipped_loss == 2 and loaded.hparams.d_state == 8
    torch.testing.assert_close(loaded.eval()(batch).prediction, m.eval()(batch).prediction)


def test_forecast_rows_and_no_lookahead() -> None:
    """forecast() fills every window-valid row and NaN elsewhere; changing the unknown features after bar t leaves
    the forecasts of bars up to t bit-identical."""
    split = make_split()
    m = module()
    m.target_transform = None
    fc = m.forecast(split, batch_size=100)
    starts = WindowBatches(split, LOOKBACK, HORIZON, 1, known_future=["tod_sin"]).starts
    ok = torch.zeros(len(split), dtype=torch.bool)
    ok[starts] = True
    assert torch.isfinite(fc[ok]).all() and torch.isnan(fc[~ok]).all()
    t0 = 300
    feats = split.features.clone()
    feats[t0 + 1 :, :2] = torch.randn_like(feats[t0 + 1 :, :2]) * 3  # the unknown (past-only) features
    fc2 = m.forecast(MarketSplit(**{**split.__dict__, "features": feats}), batch_size=100)
    assert torch.equal(fc[: t0 + 1][ok[: t0 + 1]], fc2[: t0 + 1][ok[: t0 + 1]])
    assert not torch.equal(fc[t0 + 1 :][ok[t0 + 1 :]], fc2[t0 + 1 :][ok[t0 + 1 :]])


def test_in_an_ensemble_with_a_tft_export_reload_and_backtest(tmp_path: Path) -> None:
    import warnings

    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.export.write import export_ensemble
    from foxhunt.lit.ensemble import EnsembleModule
    from foxhunt.lit.tft import TFTModule

    features = ["logret_1", "logret_2", "logret_5", "rsi_14", "std_logret_20", "tod_sin", "tod_cos"]
    dm = BarDataModule(synthetic_bars=4000, signal_strength=0.3, features=features, known_future=["tod_sin", "tod_cos"],
                       lookback=8, horizon=2, batch_size=32, eval_batch_size=256, cache_dir=None)
    members = {
        "mamba2": Mamba2Module(d_model=16, headdim=8, d_state=8, lookback=6, policy_interval=(0.5, 0.5),
                               optim={"lr": 3e-3, "scheduler": "none", "log_grad_norm_every": 2}),
        "tft": TFTModule(hidden_size=8, hidden_continuous_size=4, attention_heads=2, policy_interval=(0.5, 0.5),
                         optim={"scheduler": "none"}),
    }
    model = EnsembleModule(members=members, cost_bps=0.5)
    t = pl.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=5, limit_val_batches=2, num_sanity_val_steps=0,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   log_every_n_steps=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        t.fit(model, datamodule=dm)
    assert model.updates["mamba2"] == 10 and "mamba2" in model.last_evaluation.metrics
    for key in ("train/mamba2/loss", "val/mamba2/quantile_loss", "val/mamba2/sharpe", "grad_norm/mamba2/total"):
        assert key in t.logged_metrics, key
    assert model.member("mamba2").hparams.get("n_features") is None
    export_ensemble(model, dm, tmp_path / "export")
    loaded = foxhunt.load(tmp_path / "export")
    split = model.split("test")
    mine, theirs = model.positions(split), loaded.model.positions(split)
    for who in ("mamba2", "tft", "ensemble"):
        assert torch.equal(theirs[who].cpu(), mine[who].cpu()), who
    torch.testing.assert_close(loaded.model.forecasts(split)["mamba2"], model.forecasts(split)["mamba2"],
                               equal_nan=True)


def test_fit_config_runs_with_overrides(tmp_path: Path) -> None:
    """lightning_configs/mamba2.yaml through foxhunt.fit, shrunk; the d_state override reaches the member."""
    from foxhunt.fit import main

    args = ["--config", str(ROOT / "lightning_configs" / "mamba2.yaml"),
            "--model.members.mamba2.init_args.d_state", "64", "--model.members.mamba2.init_args.optim.warmup_steps", "0",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2",
            "--trainer.num_sanity_val_steps", "0", "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false",
            "--data.synthetic_bars", "3000", "--data.lookback", "12", "--data.horizon", "2", "--data.cache_dir", "null",
            "--data.features", "[logret_1, logret_5, rsi_14, tod_sin, tod_cos]",
            "--data.known_future", "[tod_sin, tod_cos]",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.default_root_dir", str(tmp_path),
            "--export_dir", str(tmp_path / "export"), "--log_figures", "false"]
    cli = main(args)
    member = cli.model.member("mamba2")
    assert member.hparams.d_state == 64 and member.network.backbone.layers[0].mixer.d_state == 64
    assert "mamba2" in cli.results["backtest"]
    loaded = foxhunt.load(tmp_path / "export")
    table = loaded.model.evaluate(cli.model.split("test")).metrics
    assert table["mamba2"]["sharpe"] == pytest.approx(cli.results["backtest"]["mamba2"]["sharpe"], abs=1e-9)


# ----------------------------------------------------------------------------------------------------------- quality
def _train_on_quality_data(n_bars: int, steps: int, lookback: int, horizon: int) -> dict[str, float]:
    """The TFT's yardstick (foxhunt.quality.forecasters): the weak planted signal and its exact oracle."""
    from foxhunt.quality.forecasters import build_quality_data, evaluate, windows

    torch.set_num_threads(1)
    data = build_quality_data(n_bars, seed=0, lookback=lookback, horizon=horizon)
    pl.seed_everything(0, verbose=False)
    m = Mamba2Module(d_model=16, headdim=8, d_state=16, quantiles=data.quantiles,
                     optim={"lr": 3e-3, "warmup_steps": steps // 10, "log_grad_norm_every": 0})
    split = data.splits["train"]
    m.bind(MarketSpec(list(split.feature_names), list(data.known_future), list(split.symbols), lookback, horizon))
    trainer(None, max_steps=steps, limit_val_batches=0).fit(m, windows(data, "train", 128, shuffle=True))
    return evaluate(m, data, "test")


@pytest.mark.slow
def test_close_to_oracle_on_the_weak_planted_signal() -> None:
    """40k bars, 300 steps (~20-40 s on 2 shared cores). Measured: loss ratio 1.0055, gap closed 0.87, coverage 0.81."""
    report = _train_on_quality_data(40_000, 300, lookback=32, horizon=6)
    assert report["unconditional_loss_ratio"] > 1.03, report
    assert report["loss_ratio"] < 1.02, report
    assert report["gap_closed"] > 0.6, report
    assert abs(report["tft_coverage"] - 0.80) < 0.03, report  # (evaluate's key names the TFT; here it is the Mamba-2)
