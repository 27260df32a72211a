"""The TFT's inference form (``cache_inference``) is the network's eval forward: equal to the reference and fused
paths, used only where it may be, and dropped whenever the parameters may have changed."""

from __future__ import annotations

import copy

import pytest
import torch

from foxhunt.models.tft import TemporalFusionTransformer
from foxhunt.models.tft_inference import TFTInference


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _model(**kw) -> TemporalFusionTransformer:  # type: ignore[no-untyped-def]
    args = {"n_features": 5, "n_known_future": 2, "n_symbols": 3, "lookback": 12, "horizon": 4, "hidden_size": 16,
            "attention_heads": 4, "hidden_continuous_size": 8, "dropout": 0.1}
    args.update(kw)
    net = TemporalFusionTransformer(**args).eval()
    with torch.no_grad():  # LayerNorm affines away from (1, 0), so they are checked in general position
        for m in net.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
        for vsn in (net.encoder_selection, net.decoder_selection):
            vsn.variable_grns.norm_weight.uniform_(0.5, 1.5)
            vsn.variable_grns.norm_bias.normal_()
    return net


def _inputs(net: TemporalFusionTransformer, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(b, net.lookback, net.n_features), torch.randn(b, net.horizon, net.n_known_future),
            torch.arange(b) % net.n_symbols)


@pytest.mark.parametrize("kw", [
    {},
    {"n_known_future": 0},  # the decoder selects among one variable (relative time)
    {"hidden_continuous_size": 16},  # embedding width = hidden size: the per-variable GRNs have no skip layer
    {"lstm_layers": 2},
    {"n_features": 1, "n_known_future": 0, "hidden_continuous_size": 1},  # embeddings of width 1: no scoring skip
    {"add_relative_time": False},
])
@pytest.mark.parametrize("b", [1, 7])
def test_inference_form_equals_reference_and_fused(kw: dict, b: int) -> None:
    fused = _model(**kw)
    reference = copy.deepcopy(fused)
    reference.fused = False
    cached = copy.deepcopy(fused)
    cached.cache_inference = True
    x = _inputs(fused, b)
    with torch.no_grad():
        out, ref, fus = cached(*x), reference(*x), fused(*x)
    assert isinstance(cached._inference, TFTInference) and fused._inference is None
    for name, a, r, f in zip(out._fields, out, ref, fus):
        assert a.shape == r.shape, name
        torch.testing.assert_close(a, r, rtol=1e-5, atol=2e-6, msg=name)
        torch.testing.assert_close(a, f, rtol=1e-5, atol=2e-6, msg=name)


def test_inference_form_chunks_rows_like_the_fused_path() -> None:
    """Row chunks of the per-variable GRNs (ragged last chunk included) give the one-chunk values."""
    net = _model()
    net.cache_inference = True
    x = _inputs(net, 5)
    with torch.no_grad():
        whole = net(*x).prediction
        net.encoder_selection.pairs_per_chunk = net.decoder_selection.pairs_per_chunk = 7 * 6  # 7 rows of 6 variables
        net.eval()  # a new form, with the new chunking
        chunked = net(*x).prediction
    assert net._inference is not None and net._inference.encoder.rows == 7
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7)


def test_inference_form_only_in_eval_without_grad_and_when_on() -> None:
    net = _model()
    x = _inputs(net, 2)
    with torch.no_grad():
        net(*x)
    assert net._inference is None  # off by default: fits and back-tests run the fused path
    net.cache_inference = True
    net(*x)
    assert net._inference is None  # gradients wanted
    net.train()
    with torch.no_grad():
        net(*x)
    assert net._inference is None  # training mode (dropout)
    net.eval()
    with torch.no_grad():
        net(*x)
    form = net._inference
    assert form is not None
    net.cache_inference = False  # off: not used, but kept for when it is on again
    with torch.no_grad():
        net(*x)
        net.cache_inference = True
        net(*x)
    assert net._inference is form


def test_inference_form_is_dropped_when_the_parameters_may_change() -> None:
    """train()/eval() and load_state_dict (also through a parent module) drop it; the next forward reads the new
    parameters."""
    net = _model()
    net.cache_inference = True
    other = _model()
    x = _inputs(net, 3)
    with torch.no_grad():
        before = net(*x).prediction
        assert net._inference is not None
        net.load_state_dict(other.state_dict())
        assert net._inference is None
        torch.testing.assert_close(net(*x).prediction, other(*x).prediction, rtol=1e-5, atol=2e-6)
        parent = torch.nn.ModuleDict({"tft": net})
        parent.load_state_dict({f"tft.{k}": v for k, v in _model().state_dict().items()})
        assert net._inference is None
        net(*x)
        parent.train(False)
        assert net._inference is None
    assert not torch.equal(before, net(*x).prediction)


@pytest.mark.parametrize("layers", [1, 2])
def test_lstm_steps_equal_the_module(layers: int) -> None:
    """The recurrence written out step by step (what the compiled form runs) is nn.LSTM's, gate order included."""
    from foxhunt.models.tft_inference import lstm_layers, lstm_steps

    lstm = torch.nn.LSTM(5, 8, num_layers=layers, batch_first=True).eval()
    x, h, c = torch.randn(3, 7, 5), torch.randn(layers, 3, 8), torch.randn(layers, 3, 8)
    with torch.no_grad():
        want, (want_h, want_c) = lstm(x, (h, c))
        got, (got_h, got_c) = lstm_steps(lstm_layers(lstm), x, (h, c))
        swapped = [(w.roll(8, 0), u.roll(8, 0), b) for w, u, b in lstm_layers(lstm)]  # gates i, f swapped with g, o
        wrong, _ = lstm_steps(swapped, x, (h, c))
    for a, b in ((got, want), (got_h, want_h), (got_c, want_c)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert (wrong - want).abs().max() > 1e-2


@pytest.mark.slow
def test_compiled_form_equals_the_eager_form_for_its_batch() -> None:
    """``compile_for(rows)``: a batch of ``rows`` windows runs the compiled graph, equal to the eager form (float32
    rounding); any other batch runs the eager form itself."""
    net = _model(lstm_layers=2)
    net.cache_inference = True
    form = net.inference_form()
    compiled_calls = []
    form.compile_for(3)
    graph = form._compiled
    form._compiled = lambda *a: compiled_calls.append(1) or graph(*a)  # type: ignore[assignment]
    with torch.no_grad():
        for b in (3, 5):
            x = _inputs(net, b)
            got = net(*x)
            want = TFTInference(net)(*x)
            for name, a, r in zip(got._fields, got, want):
                if b == 3:
                    torch.testing.assert_close(a, r, rtol=1e-5, atol=2e-6, msg=name)
                else:
                    assert torch.equal(a, r), name
    assert net.inference_form() is form and len(compiled_calls) == 1
