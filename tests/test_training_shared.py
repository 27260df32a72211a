"""Shared training code: LR validation, schedules, the non-finite guard, grad norms and clipping."""

from __future__ import annotations

import itertools
import math
import unittest.mock

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from foxhunt.models.tft import TemporalFusionTransformer
from foxhunt.training import (
    NonFiniteError,
    NonFiniteGuard,
    clip_and_measure,
    configure_adamw,
    grad_norms,
    make_adamw,
    make_scheduler,
    validate_lr,
)


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def _lrs(optimizer: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        sched.step()
    return out


# ----------------------------------------------------------------------------------------------------------- LR checks
@pytest.mark.parametrize("lr", [0.0, -1e-3, 1.5, float("nan"), float("inf"), True, "0.1"])
def test_validate_lr_rejects_out_of_range(lr: object) -> None:
    with pytest.raises(ValueError, match=r"learning rate must be .*\(0, 1\]") as err:
        validate_lr(lr)  # type: ignore[arg-type]
    assert repr(lr) in str(err.value)


@pytest.mark.parametrize("lr", [1e-6, 3e-4, 1.0])
def test_validate_lr_accepts_range(lr: float) -> None:
    assert validate_lr(lr) == lr


def test_make_adamw_uses_issue_hyperparameters() -> None:
    opt = make_adamw(TwoBlocks().parameters(), lr=1e-3, weight_decay=0.01)
    g = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert g["betas"] == (0.9, 0.999) and g["eps"] == 1e-8 and g["weight_decay"] == 0.01 and g["lr"] == 1e-3
    with pytest.raises(ValueError, match="2.0"):
        make_adamw(TwoBlocks().parameters(), lr=2.0)
    with pytest.raises(ValueError, match="weight_decay"):
        make_adamw(TwoBlocks().parameters(), lr=1e-3, weight_decay=-1.0)


def test_configure_adamw_excludes_biases_from_decay() -> None:
    m = TwoBlocks()
    opt = configure_adamw(m, lr=1e-3, weight_decay=0.1, scheduler="none")
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(m.encoder.weight), id(m.head.weight)}
    assert {id(p) for p in no_decay["params"]} == {id(m.encoder.bias), id(m.head.bias)}
    (only,) = configure_adamw(m, lr=1e-3, weight_decay=0.0, scheduler="none").param_groups
    assert len(only["params"]) == 4 and only["weight_decay"] == 0.0


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 8), nn.RMSNorm(8))
        self.head = nn.Linear(8, 1, bias=False)


def _expected_no_decay(name: str) -> bool:
    """Bias or normalisation parameter, from its name alone (written apart from the rule under test)."""
    leaf = name.rsplit(".", 1)[-1]
    in_norm = ".norm." in f".{name}" or name.startswith(("body.1.", "body.4."))  # GateAddNorm.norm; the MLP's norms
    grouped_norm = leaf in ("norm_weight", "norm_bias")  # the TFT's grouped per-variable LayerNorms
    return "bias" in leaf or in_norm or grouped_norm


@pytest.mark.parametrize("which", ["tft", "mlp"])
def test_weight_decay_by_role_not_by_shape(which: str) -> None:
    """Every bias and norm parameter, including the TFT's [V, d] per-variable biases and LayerNorm gains, goes
    undecayed; every weight matrix (and the embeddings) decays; each parameter is in exactly one group."""
    m: nn.Module = (
        TemporalFusionTransformer(n_features=3, n_known_future=2, n_symbols=2, lookback=6, horizon=2, hidden_size=8,
                                  attention_heads=2, hidden_continuous_size=4)
        if which == "tft"
        else NormedMLP()
    )
    decay, no_decay = configure_adamw(m, lr=1e-3, weight_decay=0.1, scheduler="none").param_groups
    decay_ids, no_decay_ids = {id(p) for p in decay["params"]}, {id(p) for p in no_decay["params"]}
    assert not decay_ids & no_decay_ids
    assert decay_ids | no_decay_ids == {id(p) for p in m.parameters()}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))
    wrong = [n for n, p in m.named_parameters() if (id(p) in no_decay_ids) != _expected_no_decay(n)]
    assert wrong == []
    if isinstance(m, TemporalFusionTransformer):  # what the shape rule got wrong: [V, *] biases and norm gains
        vsn = m.encoder_selection
        grns = vsn.variable_grns
        two_d = (grns.fc2_bias, grns.fc1_bias, grns.glu_bias, grns.norm_weight, grns.norm_bias, vsn.embed_bias)
        assert all(p.ndim == 2 and id(p) in no_decay_ids for p in two_d)
        weights = (grns.fc2_weight, grns.fc1_weight, grns.glu_weight, vsn.embed_weight, m.symbol_embedding.weight)
        assert all(id(p) in decay_ids for p in weights)
        lstm = dict(m.lstm_encoder.named_parameters())
        assert id(lstm["bias_ih_l0"]) in no_decay_ids and id(lstm["weight_ih_l0"]) in decay_ids

# ----------------------------------------------------------------------------------------------------------- schedules
def test_cosine_with_warmup_curve() -> None:
    opt = make_adamw(TwoBlocks().parameters(), lr=1e-2)
    cfg = make_scheduler(opt, "cosine", total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert cfg is not None and cfg["interval"] == "step" and cfg["frequency"] == 1
    lrs = _lrs(opt, cfg["scheduler"], 115)
    # linear warm-up 1e-3, 2e-3, ... 1e-2
    assert lrs[:10] == pytest.approx([1e-3 * (i + 1) for i in range(10)])
    assert lrs[10] == pytest.approx(1e-2)
    # half way through the cosine: mean of peak and floor
    assert lrs[60] == pytest.approx(1e-3 + (1e-2 - 1e-3) * 0.5)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:111]))
    assert lrs[110] == pytest.approx(1e-3) and lrs[114] == pytest.approx(1e-3)  # held at the floor afterwards
    expected_30 = 1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * 20 / 100))
    assert lrs[30] == pytest.approx(expected_30)


def test_step_decay_curve() -> None:
    opt = make_adamw(TwoBlocks().parameters(), lr=0.1)
    cfg = make_scheduler(opt, "step", step_size=5, gamma=0.5)
    lrs = _lrs(opt, cfg["scheduler"], 16)
    assert lrs == pytest.approx([0.1] * 5 + [0.05] * 5 + [0.025] * 5 + [0.0125])


def test_step_decay_with_warmup_curve() -> None:
    opt = make_adamw(TwoBlocks().parameters(), lr=0.1)
    cfg = make_scheduler(opt, "step", step_size=3, gamma=0.1, warmup_steps=2)
    lrs = _lrs(opt, cfg["scheduler"], 8)
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01])


def test_plateau_reduces_after_patience() -> None:
    opt = make_adamw(TwoBlocks().parameters(), lr=0.1)
    cfg = make_scheduler(opt, "plateau", plateau_patience=2, gamma=0.5, monitor="val/loss", interval="epoch")
    assert cfg["monitor"] == "val/loss" and cfg["interval"] == "epoch"
    sched = cfg["scheduler"]
    seen = []
    for metric in [1.0, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]:
        sched.step(metric)
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05])


def test_none_and_bad_scheduler_config() -> None:
    opt = make_adamw(TwoBlocks().parameters(), lr=0.1)
    assert make_scheduler(opt, "none") is None
    with pytest.raises(ValueError, match="linear"):
        make_scheduler(opt, "linear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="total_steps"):
        make_scheduler(opt, "cosine")
    with pytest.raises(ValueError, match="warmup_steps"):
        make_scheduler(opt, "cosine", total_steps=10, warmup_steps=10)


def test_configure_adamw_returns_lightning_dict() -> None:
    out = configure_adamw(TwoBlocks(), lr=1e-3, weight_decay=0.0, scheduler="cosine", total_steps=100)
    assert set(out) == {"optimizer", "lr_scheduler"}
    assert out["lr_scheduler"]["scheduler"].optimizer is out["optimizer"]


# ----------------------------------------------------------------------------------------------------------- the guard
def _backward(model: nn.Module, poison: str | None = None) -> None:
    model.zero_grad(set_to_none=True)
    model(torch.randn(3, 4)).sum().backward()
    if poison is not None:
        getattr(model, poison).weight.grad[0, 0] = float("nan")


def test_guard_check_loss_raise_names_step() -> None:
    guard = NonFiniteGuard("raise")
    assert guard.check_loss(torch.tensor(1.5), step=3)
    with pytest.raises(NonFiniteError, match=r"step 17"):
        guard.check_loss(torch.tensor(float("inf")), step=17)


def test_guard_check_loss_skip_counts() -> None:
    guard = NonFiniteGuard("skip")
    assert not guard.check_loss(torch.tensor(float("nan")), step=1)
    assert not guard.check_loss(torch.tensor([1.0, float("inf")]), step=2)
    assert guard.check_loss(torch.tensor(0.2), step=3)
    assert guard.skipped == 2 and guard.skipped_loss == 2


def test_guard_gradient_raise_names_step_and_block() -> None:
    model = TwoBlocks()
    guard = NonFiniteGuard("raise")
    _backward(model)
    assert guard.check_gradients(model, step=0)
    _backward(model, poison="head")
    with pytest.raises(NonFiniteError) as err:
        guard.check_gradients(model, step=42)
    msg = str(err.value)
    assert "step 42" in msg and "head" in msg and "encoder" not in msg


def test_guard_gradient_skip_counts_and_leaves_params_unchanged() -> None:
    model = TwoBlocks()
    opt = make_adamw(model.parameters(), lr=0.1, weight_decay=0.1)
    guard = NonFiniteGuard("skip")
    _backward(model)  # one good step so that AdamW has momentum that would otherwise move the weights
    assert guard.check_gradients(model, step=0)
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _backward(model, poison="encoder")
    assert not guard.check_gradients(model, step=1)
    opt.step()
    assert guard.skipped == 1 and guard.skipped_gradients == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    _backward(model)
    assert guard.check_gradients(model, step=2)
    opt.step()
    assert not torch.equal(model.head.weight, before["head.weight"])


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_guard_clip_gradients_clips_like_torch_and_catches_nonfinite(policy: str) -> None:
    """clip_gradients: torch's clip_grad_norm_ result on finite gradients (above and below the limit), finite gradients
    whose squares overflow float32 clipped rather than taken for NaN, and NaN/Inf gradients raised or skipped."""
    model, twin = TwoBlocks(), TwoBlocks()
    guard = NonFiniteGuard(policy)  # type: ignore[arg-type]
    for max_norm in (0.05, 1e3):
        torch.manual_seed(1)
        _backward(model)
        torch.manual_seed(1)
        _backward(twin)
        assert guard.clip_gradients(model, max_norm, step=0)
        torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad)
    _backward(model)
    with torch.no_grad():
        model.head.weight.grad.fill_(1e30)  # finite, but its square overflows
    assert guard.clip_gradients(model, 1.0, step=1)
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    assert float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], 2.0)) == pytest.approx(1.0, rel=1e-4)
    _backward(model, poison="head")
    if policy == "raise":
        with pytest.raises(NonFiniteError, match="step 2.*head"):
            guard.clip_gradients(model, 1.0, step=2)
    else:
        assert not guard.clip_gradients(model, 1.0, step=2)
        assert guard.skipped_gradients == 1 and all(p.grad is None for p in model.parameters())


def test_guard_rejects_bad_policy() -> None:
    with pytest.raises(ValueError, match="ignore"):
        NonFiniteGuard("ignore")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------- grad norms, clip
def test_grad_norms_total_and_blocks() -> None:
    model = TwoBlocks()
    _backward(model)
    norms = grad_norms(model)
    enc = torch.cat([model.encoder.weight.grad.flatten(), model.encoder.bias.grad]).norm()
    head = torch.cat([model.head.weight.grad.flatten(), model.head.bias.grad]).norm()
    total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert set(norms) == {"grad_norm/encoder", "grad_norm/head", "grad_norm/total"}
    assert norms["grad_norm/encoder"] == pytest.approx(float(enc), rel=1e-5)
    assert norms["grad_norm/head"] == pytest.approx(float(head), rel=1e-5)
    assert norms["grad_norm/total"] == pytest.approx(float(total), rel=1e-5)
    inf_norms = grad_norms(model, norm_type=float("inf"))
    assert inf_norms["grad_norm/total"] == pytest.approx(float(max(p.grad.abs().max() for p in model.parameters())))


def test_clip_and_measure() -> None:
    model = TwoBlocks()
    _backward(model)
    for p in model.parameters():
        p.grad.mul_(100.0)
    before = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    total = clip_and_measure(model, max_norm=1.0)
    after = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert float(total) == pytest.approx(float(before), rel=1e-5)
    assert float(after) == pytest.approx(1.0, rel=1e-4)


class _GuardedRegressor(pl.LightningModule):
    """Minimal automatic-optimisation module using the shared pieces the way members do."""

    def __init__(self, policy: str, poison_steps: tuple[int, ...]) -> None:
        super().__init__()
        self.net = TwoBlocks()
        self.guard = NonFiniteGuard(policy)  # type: ignore[arg-type]
        self.poison_steps = poison_steps
        self.logged: list[dict[str, float]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        if self.global_step in self.poison_steps:
            loss = loss * float("nan")
        if not self.guard.check_loss(loss, self.global_step):
            return None
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.logged.append(grad_norms(self.net))
        self.guard.check_gradients(self.net, self.global_step)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return configure_adamw(self.net, lr=1e-2, weight_decay=0.0, scheduler="cosine", total_steps=10, warmup_steps=2)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x[:, 0] * 2.0
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _trainer() -> pl.Trainer:
    return pl.Trainer(
        max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=1.0,
    )


def test_lightning_skip_policy_counts_and_continues() -> None:
    module = _GuardedRegressor("skip", poison_steps=(3,))
    _trainer().fit(module, _loader())
    assert module.guard.skipped_loss == 1
    assert all(math.isfinite(v) for d in module.logged for v in d.values())
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_lightning_raise_policy_names_step() -> None:
    module = _GuardedRegressor("raise", poison_steps=(2,))
    with pytest.raises(NonFiniteError, match="step 2"):
        _trainer().fit(module, _loader())


def test_guard_foreach_kernels_equal_the_public_path() -> None:
    """The private foreach kernels the guard isolates give what torch's public functions give (finite, overflowing and
    NaN gradients), so the fallback and the fast path are interchangeable."""
    from foxhunt.training.guard import scale_, total_norm

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen), torch.randn(2, 2, 2, generator=gen)]
    assert total_norm(grads, foreach=True) == pytest.approx(total_norm(grads, foreach=False), rel=1e-6)
    assert total_norm(grads, foreach=False) == pytest.approx(float(torch.cat([g.flatten() for g in grads]).norm()),
                                                             rel=1e-6)
    a, b = [g.clone() for g in grads], [g.clone() for g in grads]
    scale_(a, 0.25, foreach=True)
    scale_(b, 0.25, foreach=False)
    for x, y, g in zip(a, b, grads, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
        torch.testing.assert_close(x, g * 0.25, rtol=0, atol=0)
    big = [g * 1e30 for g in grads]
    assert math.isinf(total_norm(big, foreach=True)) and math.isinf(total_norm(big, foreach=False))
    bad = [grads[0], torch.tensor([float("nan")])]
    assert math.isnan(total_norm(bad, foreach=True)) and math.isnan(total_norm(bad, foreach=False))


def _simulate_fit(paces: list[tuple[int, int]], epoch_steps: float, max_steps: int | None) -> tuple[int, list[int]]:
    """The coordinator's loop step by step: every started member's updates, global_step checked between steps."""
    updates, steps = [0] * len(paces), 0
    while steps < epoch_steps and not (max_steps and sum(updates) >= max_steps):
        for i, (k, start) in enumerate(paces):
            if steps >= start:
                updates[i] += k
        steps += 1
    return steps, updates


@pytest.mark.parametrize("paces,epoch_steps,max_steps", [
    ([(4, 0)], math.inf, 64),
    ([(4, 0), (4, 0)], math.inf, 64),  # two equal members: half of max_steps each
    ([(4, 0), (2, 3)], math.inf, 50),  # the last step overshoots max_steps (Lightning checks between batches)
    ([(1, 0), (16, 5), (3, 2)], math.inf, 1000),
    ([(1, 0), (16, 5)], 12, 1000),  # the epoch limit ends it first
    ([(2, 0), (16, 5)], 40, 100),  # max_steps ends it first
    ([(3, 0), (5, 7)], 30, None),
    ([(4, 0), (1, 100)], math.inf, 10),  # the second never starts
])
def test_fit_updates_equals_the_coordinators_loop(paces, epoch_steps, max_steps) -> None:
    """Each member's share of a fit: global_step (so max_steps) counts every member's updates together."""
    from foxhunt.lit.member import fit_updates

    steps, updates = fit_updates(paces, epoch_steps, max_steps)
    assert (steps, updates) == _simulate_fit(paces, epoch_steps, max_steps)
    assert fit_updates([(2, 0)], math.inf, None) == (math.inf, [math.inf])  # nothing bounds it


# ---------------------------------------------------------------------------------------------- fused AdamW
def test_prefer_fused_switches_to_torchs_fused_adamw_before_the_first_step_only() -> None:
    """Every member's AdamW is made by make_adamw and switched by prefer_fused: on CPU float tensors the step then runs
    torch's fused kernel and gives the default implementation's weights (two groups, one without decay); an optimizer
    that already stepped keeps its implementation."""
    from torch.optim import adam

    from foxhunt.training.optim import prefer_fused

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(5, 3, generator=g), torch.randn(3, generator=g)]
    runs = {}
    for fused in (False, True):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = make_adamw([{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}],
                         lr=1e-2, weight_decay=0.1, eps=1e-5)
        if fused:
            prefer_fused(opt)
        assert all(group["fused"] is (True if fused else None) for group in opt.param_groups)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 0.5 - step) * (i + 1)
            with unittest.mock.patch.object(adam, "_fused_adam", wraps=adam._fused_adam) as kernel:
                opt.step()
            assert kernel.called is fused
        runs[fused] = params
    for a, b in zip(runs[False], runs[True], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    stepped = make_adamw([nn.Parameter(torch.ones(2))], lr=0.1)
    stepped.param_groups[0]["params"][0].grad = torch.ones(2)
    stepped.step()
    prefer_fused(stepped)
    assert stepped.param_groups[0]["fused"] is None
