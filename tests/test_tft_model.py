"""TFT building blocks and the whole network: exact batched equivalents, causality, mixed precision."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from foxhunt.models.tft import (
    GLU,
    GapDropout,
    GateAddNorm,
    GatedResidualNetwork,
    GroupedGatedResidualNetwork,
    InterpretableMultiHeadAttention,
    TemporalFusionTransformer,
    VariableSelectionNetwork,
)
from foxhunt.models.variable_selection_fused import ChunkedVariableGRNs, _dropout_keep_mask


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_glu_gates_linear_path() -> None:
    glu = GLU(3, 2)
    x = torch.randn(5, 3)
    a, b = glu.linear(x).chunk(2, dim=-1)
    torch.testing.assert_close(glu(x), a * torch.sigmoid(b))


def test_gate_add_norm() -> None:
    gan = GateAddNorm(4, 6).eval()
    x, res = torch.randn(2, 4), torch.randn(2, 6)
    torch.testing.assert_close(gan(x, res), gan.norm(gan.glu(x) + res))


def test_grn_matches_paper_equations_with_context() -> None:
    grn = GatedResidualNetwork(5, 7, 3, context_size=4).eval()
    a, c = torch.randn(2, 9, 5), torch.randn(2, 4)
    eta2 = nn.functional.elu(grn.fc2(a) + grn.context(c).unsqueeze(1))
    eta1 = grn.fc1(eta2)
    expected = grn.gate.norm(grn.skip(a) + grn.gate.glu(eta1))
    torch.testing.assert_close(grn(a, c), expected)
    with pytest.raises(ValueError, match="context"):
        grn(a)


def test_grn_identity_skip_when_sizes_match() -> None:
    grn = GatedResidualNetwork(4, 8, 4).eval()
    assert grn.skip is None
    a = torch.randn(3, 4)
    torch.testing.assert_close(grn(a), grn.gate.norm(a + grn.gate.glu(grn.fc1(nn.functional.elu(grn.fc2(a))))))


def _copy_group_into(grouped: GroupedGatedResidualNetwork, g: int, grn: GatedResidualNetwork) -> None:
    with torch.no_grad():
        grn.fc2.weight.copy_(grouped.fc2_weight[g].t())
        grn.fc2.bias.copy_(grouped.fc2_bias[g])
        grn.fc1.weight.copy_(grouped.fc1_weight[g].t())
        grn.fc1.bias.copy_(grouped.fc1_bias[g])
        grn.gate.glu.linear.weight.copy_(grouped.glu_weight[g].t())
        grn.gate.glu.linear.bias.copy_(grouped.glu_bias[g])
        grn.gate.norm.weight.copy_(grouped.norm_weight[g])
        grn.gate.norm.bias.copy_(grouped.norm_bias[g])
        if grn.skip is not None:
            grn.skip.weight.copy_(grouped.skip_weight[g].t())
            grn.skip.bias.copy_(grouped.skip_bias[g])


@pytest.mark.parametrize("sizes", [(5, 4, 8), (8, 4, 8)])
def test_grouped_grn_equals_independent_grns(sizes: tuple[int, int, int]) -> None:
    d_in, d_h, d_out = sizes
    grouped = GroupedGatedResidualNetwork(6, d_in, d_h, d_out).eval()
    with torch.no_grad():
        grouped.norm_weight.uniform_(0.5, 1.5)
        grouped.norm_bias.normal_()
    x = torch.randn(2, 11, 6, d_in)  # [..., G, in]
    out = grouped(x)
    assert out.shape == (2, 11, 6, d_out)
    for g in range(6):
        grn = GatedResidualNetwork(d_in, d_h, d_out).eval()
        _copy_group_into(grouped, g, grn)
        torch.testing.assert_close(out[..., g, :], grn(x[..., g, :]), rtol=1e-5, atol=1e-5)


def _loop_vsn_reference(vsn: VariableSelectionNetwork, x: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's VSN written naively: embed each variable, one GRN per variable in a Python loop."""
    emb = vsn.embed(x)  # [B, T, V, e]
    flat = emb.flatten(-2)
    weights = torch.softmax(vsn.flattened_grn(flat, ctx), dim=-1)
    outs = []
    for v in range(vsn.n_variables):
        grn = GatedResidualNetwork(vsn.input_size, vsn.variable_grns.hidden_size, vsn.hidden_size).eval()
        _copy_group_into(vsn.variable_grns, v, grn)
        outs.append(grn(emb[..., v, :]))
    stacked = torch.stack(outs, dim=-2)  # [B, T, V, d]
    return (weights.unsqueeze(-1) * stacked).sum(-2), weights


def _reference_copy(vsn: VariableSelectionNetwork) -> VariableSelectionNetwork:
    """The same network on the reference path (fused=False), loaded from ``vsn``'s state dict."""
    context = vsn.flattened_grn.context
    ref = VariableSelectionNetwork(
        vsn.n_variables, vsn.input_size, vsn.hidden_size, None if context is None else context.in_features, fused=False
    )
    ref.load_state_dict(vsn.state_dict())
    return ref.train(vsn.training)


@pytest.mark.parametrize("n_vars,e,d,pairs", [(7, 5, 12, 8192), (7, 5, 12, 30), (3, 12, 12, 1), (1, 4, 8, 5)])
def test_vsn_fused_equals_loop_reference(n_vars: int, e: int, d: int, pairs: int) -> None:
    """Whole batch in one chunk, and row chunks of every size down to one row (ragged last chunk included); the
    reference path (fused=False) equals the per-variable loop too."""
    vsn = VariableSelectionNetwork(n_vars, e, d, context_size=d, pairs_per_chunk=pairs).eval()
    with torch.no_grad():
        vsn.variable_grns.norm_weight.uniform_(0.5, 1.5)
    x, ctx = torch.randn(3, 4, n_vars), torch.randn(3, d)
    out, w = vsn(x, ctx)
    ref_out, ref_w = _loop_vsn_reference(vsn, x, ctx.unsqueeze(1))
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    unfused_out, unfused_w = _reference_copy(vsn)(x, ctx)
    torch.testing.assert_close(unfused_w, ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(unfused_out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4))


@pytest.mark.parametrize("e,d,pairs", [(4, 8, 8192), (4, 8, 12), (8, 8, 7)])
def test_vsn_fused_gradients_match_reference(e: int, d: int, pairs: int) -> None:
    """Hand-written chunked backward == autograd through the reference path (parameters and inputs)."""
    vsn = VariableSelectionNetwork(5, e, d, context_size=d, pairs_per_chunk=pairs).eval()
    with torch.no_grad():
        vsn.variable_grns.norm_weight.uniform_(0.5, 1.5)
        vsn.variable_grns.norm_bias.normal_()
    ref = _reference_copy(vsn)
    x, ctx = torch.randn(2, 3, 5, requires_grad=True), torch.randn(2, d)
    x_ref = x.detach().clone().requires_grad_(True)
    vsn(x, ctx)[0].square().sum().backward()
    ref(x_ref, ctx)[0].square().sum().backward()
    for (name, p), q in zip(vsn.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)  # float32 rounding only
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("keep_bytes", [0, 2**30])
@pytest.mark.parametrize("rows", [3, 4, 10])
def test_chunked_variable_grns_gradcheck_with_dropout(rows: int, keep_bytes: int) -> None:
    """Finite differences (float64) through the chunked GRNs with dropout on: the kept masks are the ones used, with
    activations recomputed in backward (keep_bytes=0) and kept from forward."""
    v, n, h, d = 3, 10, 4, 6
    x, w = torch.randn(v, n, dtype=torch.float64), torch.rand(v, n, dtype=torch.float64)
    shapes = [(v, h), (v, h), (v, h, h), (v, h), (v, h, 2 * d), (v, 2 * d), (v, d), (v, d), (v, d), (v, d)]
    params = [torch.randn(*s, dtype=torch.float64) for s in shapes]

    def fn(*args: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1)  # same dropout masks at every evaluation
        return ChunkedVariableGRNs.apply(args[0], args[1], 0.3, rows, keep_bytes, *args[2:])

    inputs = [t.requires_grad_(True) for t in (x, w, *params)]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("pairs", [8192, 7])
def test_vsn_kept_activations_equal_recomputed(pairs: int) -> None:
    """Keeping the chunks' activations for backward gives exactly the outputs and gradients of recomputing them
    (same weights and drops from the same seed); a second backward through the retained graph recomputes them."""
    results = []
    for keep_bytes in (0, 2**30):
        torch.manual_seed(0)
        vsn = VariableSelectionNetwork(5, 4, 8, context_size=8, dropout=0.3, pairs_per_chunk=pairs, keep_bytes=keep_bytes)
        x, ctx = torch.randn(3, 6, 5, requires_grad=True), torch.randn(3, 8)
        out = vsn.train()(x, ctx)[0]
        loss = out.square().sum()
        loss.backward(retain_graph=True)
        first = [out.detach(), x.grad.clone(), *(p.grad.clone() for p in vsn.parameters())]
        loss.backward()
        for a, b in zip(first[1:], [x.grad, *(p.grad for p in vsn.parameters())]):
            torch.testing.assert_close(b, 2 * a)
        results.append(first)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_mask_is_bernoulli(p: float) -> None:
    """Geometric gaps between drops give i.i.d. Bernoulli(p) drops: the rate, and pairs at lag 1 and 7 at rate p^2."""
    n = 400_000
    dropped = 1.0 - _dropout_keep_mask(n, p, torch.device("cpu")).double()
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(float(dropped.mean()) - p) < 5 * sd
    for lag in (1, 7):
        both = float((dropped[lag:] * dropped[:-lag]).mean())
        assert abs(both - p * p) < 5 * (p * p * (1 - p * p) / n) ** 0.5
    assert _dropout_keep_mask(5, 0.999, torch.device("cpu")).shape == (5,)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_gap_dropout_is_dropout(p: float) -> None:
    """The fast dropout zeroes Bernoulli(p) entries and scales the rest by 1/(1-p), and its gradient is that same
    mask; eval is the identity; fused=False is nn.Dropout itself (same draws for the same seed)."""
    drop = GapDropout(p).train()
    x = (torch.rand(200, 500) + 0.5).requires_grad_(True)
    out = drop(x)
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept] / (1 - p))
    rate, sd = 1.0 - float(kept.double().mean()), (p * (1 - p) / x.numel()) ** 0.5
    assert abs(rate - p) < 5 * sd
    out.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / (1 - p))
    assert torch.equal(drop.eval()(x), x)
    reference = GapDropout(p, fused=False).train()
    torch.manual_seed(3)
    expected = torch.nn.functional.dropout(x, p, training=True)
    torch.manual_seed(3)
    assert torch.equal(reference(x), expected)


def test_tft_fused_switch_reaches_every_dropout() -> None:
    """One switch: the network's fused flag sets every variable selection's path and every dropout's draw."""
    model = _model(fused=False)
    flags = [m.fused for m in model.modules() if isinstance(m, (GapDropout, VariableSelectionNetwork))]
    assert flags and not any(flags)
    model.fused = True
    assert all(m.fused for m in model.modules() if isinstance(m, (GapDropout, VariableSelectionNetwork)))


def test_vsn_dropout_in_training_only() -> None:
    vsn = VariableSelectionNetwork(6, 4, 8, context_size=8, dropout=0.5, pairs_per_chunk=10)
    x, ctx = torch.randn(3, 5, 6), torch.randn(3, 8)
    evaluated = vsn.eval()(x, ctx)[0]
    trained = vsn.train()(x, ctx)[0]
    assert not torch.allclose(trained, evaluated)
    no_dropout = VariableSelectionNetwork(6, 4, 8, context_size=8, dropout=0.0, pairs_per_chunk=10)
    no_dropout.load_state_dict(vsn.state_dict())
    torch.testing.assert_close(no_dropout.train()(x, ctx)[0], no_dropout.eval()(x, ctx)[0])


def test_vsn_rejects_wrong_width() -> None:
    vsn = VariableSelectionNetwork(4, 3, 8)
    with pytest.raises(ValueError, match="expected 4 input variables"):
        vsn(torch.randn(2, 5))


def test_attention_shares_values_and_averages_heads() -> None:
    att = InterpretableMultiHeadAttention(8, 4).eval()
    assert att.value.out_features == 2 and att.out.in_features == 2
    q, k = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    out, w = att(q, k, k)
    assert w.shape == (2, 4, 3, 5)
    expected = att.out(torch.matmul(w, att.value(k).unsqueeze(1)).mean(1))
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="divisible"):
        InterpretableMultiHeadAttention(10, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_mask_uses_finite_minimum(dtype: torch.dtype) -> None:
    att = InterpretableMultiHeadAttention(8, 2).eval().to(dtype)
    x = (torch.randn(2, 6, 8) * 50).to(dtype)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    out, w = att(x, x, x, mask)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert float(w.detach().masked_select(mask.expand_as(w)).abs().max()) == 0.0
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 6))


def _model(**kw) -> TemporalFusionTransformer:  # type: ignore[no-untyped-def]
    args = {"n_features": 5, "n_known_future": 2, "n_symbols": 3, "lookback": 12, "horizon": 4, "hidden_size": 16,
                "attention_heads": 4, "hidden_continuous_size": 8, "dropout": 0.1}
    args.update(kw)
    return TemporalFusionTransformer(**args)


def _inputs(b: int = 6, lookback: int = 12, horizon: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(b, lookback, 5), torch.randn(b, horizon, 2), torch.arange(b) % 3


def test_tft_shapes_and_weights() -> None:
    model = _model().eval()
    out = model(*_inputs())
    assert out.prediction.shape == (6, 4, 3)
    assert out.static_weights.shape == (6, 1)
    assert out.encoder_weights.shape == (6, 12, 6)  # 5 features + relative time
    assert out.decoder_weights.shape == (6, 4, 3)  # 2 known + relative time
    assert out.attention.shape == (6, 4, 4, 16)
    torch.testing.assert_close(out.encoder_weights.sum(-1), torch.ones(6, 12))
    torch.testing.assert_close(out.attention.sum(-1), torch.ones(6, 4, 4))


@pytest.mark.parametrize("fused", [True, False])
def test_tft_all_parameters_get_gradients(fused: bool) -> None:
    model = _model(lstm_layers=2, fused=fused)
    model(*_inputs()).prediction.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []


def test_tft_fused_and_reference_share_state_dict() -> None:
    """Same parameter names and shapes: a checkpoint of either path loads strictly into the other."""
    fused, reference = _model(fused=True), _model(fused=False)
    assert fused.fused and not reference.fused
    shapes = {k: v.shape for k, v in fused.state_dict().items()}
    assert shapes == {k: v.shape for k, v in reference.state_dict().items()}
    reference.load_state_dict(fused.state_dict())
    fused.load_state_dict(reference.state_dict())


@pytest.mark.parametrize("keep_bytes", [0, 2**30])
@pytest.mark.parametrize("pairs", [8192, 7])
@pytest.mark.parametrize("mode", ["eval", "train_without_dropout"])
def test_tft_fused_equals_reference(mode: str, pairs: int, keep_bytes: int) -> None:
    """With the same weights, the fused and the reference variable selection give the same outputs and the same
    gradients for every parameter and input (one chunk, and chunks of one row of the encoder's 6 variables; the
    chunks' activations recomputed in backward, and kept from forward)."""
    if mode == "eval":
        fused = _model(fused=True).eval()  # dropout 0.1, off in eval mode
    else:
        fused = _model(fused=True, dropout=0.0).train()
    fused.encoder_selection.pairs_per_chunk = fused.decoder_selection.pairs_per_chunk = pairs
    fused.encoder_selection.keep_bytes = fused.decoder_selection.keep_bytes = keep_bytes
    with torch.no_grad():  # LayerNorm affines away from (1, 0), so their gradients are checked in general position
        for vsn in (fused.encoder_selection, fused.decoder_selection):
            vsn.variable_grns.norm_weight.uniform_(0.5, 1.5)
            vsn.variable_grns.norm_bias.normal_()
    reference = copy.deepcopy(fused)
    reference.fused = False
    assert not reference.encoder_selection.fused and not reference.decoder_selection.fused
    x, xf, sym = _inputs()
    inputs = [t.requires_grad_(True) for t in (x, xf)]
    inputs_ref = [t.detach().clone().requires_grad_(True) for t in inputs]
    out, out_ref = fused(*inputs, sym), reference(*inputs_ref, sym)
    for name, a, b in zip(out._fields, out, out_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    (out.prediction.square().sum() + out.encoder_weights.square().sum()).backward()
    (out_ref.prediction.square().sum() + out_ref.encoder_weights.square().sum()).backward()
    for (name, p), q in zip(fused.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    for a, b in zip(inputs, inputs_ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_tft_decoder_is_causal_in_known_future_inputs() -> None:
    """The step-h forecast may read known-future inputs of steps <= h only (decoder LSTM and masked attention)."""
    model = _model().eval()
    x, xf, sym = _inputs()
    base = model(x, xf, sym)
    for h in range(3):
        moved = xf.clone()
        moved[:, h + 1 :] += 5.0 * torch.randn_like(moved[:, h + 1 :])
        out = model(x, moved, sym)
        torch.testing.assert_close(out.prediction[:, : h + 1], base.prediction[:, : h + 1])
        assert not torch.allclose(out.prediction[:, h + 1 :], base.prediction[:, h + 1 :])
        assert float(base.attention[:, :, h, 12 + h + 1 :].abs().max()) == 0.0


def test_tft_symbol_is_used_and_samples_independent() -> None:
    model = _model().eval()
    x, xf, sym = _inputs()
    base = model(x, xf, sym).prediction
    other = model(x, xf, (sym + 1) % 3).prediction
    assert not torch.allclose(base, other)
    x2 = x.clone()
    x2[0] += 1.0
    out = model(x2, xf, sym).prediction
    torch.testing.assert_close(out[1:], base[1:])  # no cross-sample leakage


def test_tft_without_known_future_inputs() -> None:
    model = _model(n_known_future=0).eval()
    out = model(torch.randn(2, 12, 5), torch.empty(2, 4, 0), torch.zeros(2, dtype=torch.long))
    assert out.prediction.shape == (2, 4, 3) and out.decoder_weights.shape == (2, 4, 1)
    assert model(torch.randn(2, 12, 5)).prediction.shape == (2, 4, 3)
    with pytest.raises(ValueError, match="decoder needs an input"):
        _model(n_known_future=0, add_relative_time=False)


def test_tft_rejects_bad_shapes() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"x_past must be \[B, 12, 5\]"):
        model(torch.randn(2, 10, 5), torch.randn(2, 4, 2))
    with pytest.raises(ValueError, match="x_future"):
        model(torch.randn(2, 12, 5), torch.randn(2, 3, 2))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_tft_autocast_cpu_is_finite(dtype: torch.dtype, fused: bool) -> None:
    model = _model(fused=fused)
    x, xf, sym = _inputs()
    with torch.autocast("cpu", dtype=dtype):
        out = model(x * 100, xf, sym)
    assert all(torch.isfinite(t.float()).all() for t in out)
    out.prediction.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_lstm_under_cpu_autocast_runs_in_float32_on_every_core() -> None:
    """oneDNN has no bfloat16 LSTM on CPUs without AVX-512: under CPU autocast the TFT's LSTMs run in float32 (the same
    numbers as outside autocast, cast to the input's dtype) instead of failing on those machines."""
    from foxhunt.models.tft import _run_lstm

    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(3, 5, 8)
    state = (torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    want, (wh, wc) = lstm(x, state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, (h, c) = _run_lstm(lstm, x.bfloat16(), (state[0].bfloat16(), state[1].bfloat16()))
    assert got.dtype == h.dtype == c.dtype == torch.bfloat16
    for g, w in ((got, want), (h, wh), (c, wc)):
        torch.testing.assert_close(g.float(), w, atol=0.03, rtol=0.03)  # bf16 inputs and outputs, float32 inside
    out, _ = _run_lstm(lstm, x, state)  # outside autocast: the module's own call
    torch.testing.assert_close(out, want, atol=0.0, rtol=0.0)


def test_tft_backward_inside_autocast_region() -> None:
    """Under manual optimisation Lightning runs backward inside the training step's autocast region: the chunked
    variable selection's hand-written backward must still compute in float32 and give float32 gradients."""
    model = _model()
    x, xf, sym = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, xf, sym).prediction.float().sum().backward()
    grads = [(n, p.grad) for n, p in model.named_parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for _, g in grads)
