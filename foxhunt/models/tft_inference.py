"""The TFT's eval forward with everything that does not depend on the inputs computed once (its inference form).

A live session forecasts one window a bar, where a :class:`~foxhunt.models.tft.TemporalFusionTransformer` forward
is ~100 module calls on [1, L, *] tensors: dispatch, not arithmetic. :class:`TFTInference` is the same function of
the same parameters (eval mode: no dropout), written for that case:

- what depends on the symbol alone is computed once for every symbol: the static selection, the four static contexts,
  the LSTM's initial state and the contexts' projections inside the selection and enrichment GRNs (folded into their
  first layers' biases);
- each variable selection's embeddings composed into the layers that read them once (the fused path's maths,
  :mod:`foxhunt.models.variable_selection_fused`), its per-variable GRNs as a few grouped products on a variable-major
  layout, in row chunks of ``pairs_per_chunk`` (row, variable) pairs like the fused path on CPU;
- the attention's query, key and value projections as one product (the scores' 1/sqrt(head size) on the query's);
  layers called as functions on parameters looked up once, not as modules.

It derives its tensors from its network's parameters when built: with ``TemporalFusionTransformer.cache_inference``
on, the first eval forward under ``torch.no_grad`` builds it and later ones reuse it until ``train()``, ``eval()`` or
``load_state_dict`` drop it (a live session, whose weights never change, turns it on while it decides). Tests hold it
equal (float32 rounding) to the reference and fused paths; the live parity tests hold a session's positions identical
to the back-test's, which runs the fused path.

:meth:`TFTInference.compile_for` is its fast path for one batch size (a live session's bar of every symbol): the same
code through torch.compile with inductor's C++ wrapper, the LSTMs' recurrence written out step by step
(:func:`lstm_steps`, which inductor fuses into a few kernels a step; eagerly the module's own kernel is faster), ~3x
less time a window than the eager form at one symbol; equal to it to float32 rounding (tests).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foxhunt.models.linear_skip import add_skip
from foxhunt.models.tft_output import TFTOutput

if TYPE_CHECKING:
    from foxhunt.models.tft import (
        GateAddNorm,
        GatedResidualNetwork,
        TemporalFusionTransformer,
        VariableSelectionNetwork,
    )


Gate = tuple[Tensor, Tensor, tuple[int, ...], Tensor, Tensor, float]  # GLU weight and bias, LayerNorm's shape, affine, eps
GRN = tuple[Tensor | None, Tensor | None, Tensor, Tensor, Tensor, Tensor, Gate]  # skip, fc2, fc1 (weight, bias), gate


def _gate_params(g: GateAddNorm) -> Gate:
    """A GateAddNorm's tensors, looked up once (a module attribute lookup costs about a microsecond)."""
    return g.glu.linear.weight, g.glu.linear.bias, tuple(g.norm.normalized_shape), g.norm.weight, g.norm.bias, g.norm.eps


def _grn_params(grn: GatedResidualNetwork) -> GRN:
    skip_w, skip_b = (None, None) if grn.skip is None else (grn.skip.weight, grn.skip.bias)
    return skip_w, skip_b, grn.fc2.weight, grn.fc2.bias, grn.fc1.weight, grn.fc1.bias, _gate_params(grn.gate)


LSTMLayer = tuple[Tensor, Tensor, Tensor]  # weight_ih [4d, n], weight_hh [4d, d], bias_ih + bias_hh [4d]

# torch.compile's options for the compiled form: inductor's C++ wrapper (a Python wrapper costs ~0.5 ms a call in
# kernel launches at this size) and its tensor guards only: a form's other attributes never change in its life
_COMPILE_OPTIONS = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe, "cpp_wrapper": True}


def lstm_layers(lstm: nn.LSTM) -> list[LSTMLayer]:
    """An ``nn.LSTM``'s tensors per layer, as :func:`lstm_steps` reads them (its gates in torch's order: i, f, g, o)."""
    if lstm.proj_size or lstm.bidirectional or not lstm.batch_first or not lstm.bias:
        raise ValueError("lstm_steps covers batch-first, biased, one-directional LSTMs without projections")
    return [(getattr(lstm, f"weight_ih_l{k}"), getattr(lstm, f"weight_hh_l{k}"),
             getattr(lstm, f"bias_ih_l{k}") + getattr(lstm, f"bias_hh_l{k}")) for k in range(lstm.num_layers)]


def lstm_steps(layers: list[LSTMLayer], x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``nn.LSTM`` in eval mode (no dropout between layers) on x [B, T, n] from (h, c) [layers, B, d], written out
    step by step so that torch.compile can fuse each step."""
    h, c = state
    hs, cs = [], []
    for k, (w_ih, w_hh, bias) in enumerate(layers):
        projected = F.linear(x, w_ih, bias)  # [B, T, 4d]: every step's input term at once
        hk, ck = h[k], c[k]
        outs = []
        for t in range(x.shape[1]):
            i, f, g, o = (projected[:, t] + F.linear(hk, w_hh)).chunk(4, 1)
            ck = torch.sigmoid(f) * ck + torch.sigmoid(i) * torch.tanh(g)
            hk = torch.sigmoid(o) * torch.tanh(ck)
            outs.append(hk)
        x = torch.stack(outs, 1)
        hs.append(hk)
        cs.append(ck)
    return x, (torch.stack(hs), torch.stack(cs))


def _gate(g: Gate, x: Tensor, residual: Tensor) -> Tensor:
    """GateAddNorm in eval mode: LayerNorm(residual + GLU(x))."""
    glu_w, glu_b, shape, norm_w, norm_b, eps = g
    return F.layer_norm(F.glu(F.linear(x, glu_w, glu_b), dim=-1).add_(residual), shape, norm_w, norm_b, eps)


def _grn(grn: GRN, a: Tensor, fc2_bias: Tensor | None = None) -> Tensor:
    """A GRN in eval mode; ``fc2_bias`` [B, 1, h] replaces its first layer's bias (a context folded in)."""
    skip_w, skip_b, fc2_w, fc2_b, fc1_w, fc1_b, gate = grn
    residual = a if skip_w is None else F.linear(a, skip_w, skip_b)
    f2 = F.linear(a, fc2_w, fc2_b) if fc2_bias is None else F.linear(a, fc2_w).add_(fc2_bias)
    return _gate(gate, F.linear(F.elu(f2), fc1_w, fc1_b), residual)


class _SelectionForm:
    """One continuous variable selection's input-free parts: the scoring GRN's layers composed with the embeddings
    (its context folded into the first layer's bias, per symbol) and the per-variable GRNs' parameters, variable-major."""

    def __init__(self, vsn: VariableSelectionNetwork, context: Tensor | None) -> None:
        v, e = vsn.n_variables, vsn.input_size
        fg, g = vsn.flattened_grn, vsn.variable_grns
        self.fc1 = (fg.fc1.weight, fg.fc1.bias)
        self.gate = _gate_params(fg.gate)
        w2 = fg.fc2.weight.view(fg.hidden_size, v, e)
        self.fc2_weight = torch.einsum("hve,ve->hv", w2, vsn.embed_weight)
        bias = fg.fc2.bias + torch.einsum("hve,ve->h", w2, vsn.embed_bias)
        self.per_symbol = fg.context is not None
        if fg.context is not None:
            if context is None:
                raise ValueError("this variable selection was built with a context input; pass its context")
            bias = bias + F.linear(context, fg.context.weight)  # [S, h]: one bias per symbol
        self.fc2_bias = bias
        if fg.skip is not None:
            ws = fg.skip.weight.view(v, v, e)
            self.skip_weight = torch.einsum("ove,ve->ov", ws, vsn.embed_weight)
            self.skip_bias = fg.skip.bias + torch.einsum("ove,ve->o", ws, vsn.embed_bias)
        else:  # embeddings of width 1: the residual is the embeddings themselves, x_v Ew_v + Eb_v
            self.skip_weight, self.skip_bias = torch.diag(vsn.embed_weight[:, 0]), vsn.embed_bias[:, 0]
        # per-variable GRNs on scalars: first layer and skip rank-1 in x_v (a x + b), [V, 1, *] to broadcast over rows
        self.a2 = torch.einsum("ve,veh->vh", vsn.embed_weight, g.fc2_weight).unsqueeze(1)
        self.b2 = (torch.einsum("ve,veh->vh", vsn.embed_bias, g.fc2_weight) + g.fc2_bias).unsqueeze(1)
        if g.skip_weight is not None:
            self.a_s = torch.einsum("ve,veo->vo", vsn.embed_weight, g.skip_weight).unsqueeze(1)
            self.b_s = (torch.einsum("ve,veo->vo", vsn.embed_bias, g.skip_weight) + g.skip_bias).unsqueeze(1)
        else:
            self.a_s, self.b_s = vsn.embed_weight.unsqueeze(1), vsn.embed_bias.unsqueeze(1)
        self.fc1_weight, self.fc1_bias = g.fc1_weight, g.fc1_bias.unsqueeze(1)
        self.glu_weight, self.glu_bias = g.glu_weight, g.glu_bias.unsqueeze(1)
        self.norm_weight, self.norm_bias = g.norm_weight.unsqueeze(1), g.norm_bias
        self.d = g.output_size
        self.rows = max(1, vsn.pairs_per_chunk // v)

    def __call__(self, x: Tensor, symbol: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, V] scalars of symbols [B] -> (selected [B, T, d], weights [B, T, V])."""
        b, t, v = x.shape
        f2 = F.linear(x, self.fc2_weight).add_(self.fc2_bias[symbol].unsqueeze(1) if self.per_symbol else self.fc2_bias)
        residual = F.linear(x, self.skip_weight, self.skip_bias)
        weights = torch.softmax(_gate(self.gate, F.linear(F.elu(f2), *self.fc1), residual), dim=-1)
        flat_x, flat_w = x.reshape(-1, v).t(), weights.reshape(-1, v).t()  # [V, N]
        n = flat_x.shape[1]
        if n <= self.rows:
            out = self._grns(flat_x, flat_w)
        else:
            out = torch.cat([self._grns(flat_x[:, r : r + self.rows], flat_w[:, r : r + self.rows])
                             for r in range(0, n, self.rows)])
        return out.view(b, t, self.d), weights

    def _grns(self, x: Tensor, w: Tensor) -> Tensor:
        """sum_v w[v, n] GRN_v(x[v, n]) for x, w [V, R] -> [R, d]."""
        xc = x.unsqueeze(-1)
        eta = torch.baddbmm(self.fc1_bias, F.elu(torch.addcmul(self.b2, xc, self.a2)), self.fc1_weight)
        z = F.glu(torch.baddbmm(self.glu_bias, eta, self.glu_weight), dim=-1).addcmul_(xc, self.a_s).add_(self.b_s)
        ln = F.layer_norm(z, (self.d,)).mul_(self.norm_weight).mul_(w.unsqueeze(-1))  # w (LN(z) gamma), then + w beta
        return ln.sum(0).addmm_(w.t(), self.norm_bias)


class TFTInference:
    """``net``'s eval forward with its input-free parts computed once (see the module docstring)."""

    def __init__(self, net: TemporalFusionTransformer) -> None:
        self.net, self.output = net, TFTOutput
        p = net.quantile_head.weight
        self.device, self.dtype = p.device, p.dtype
        with torch.no_grad():
            symbols = torch.arange(net.n_symbols, device=p.device)
            static, static_weights = net.static_selection(net.symbol_embedding(symbols).unsqueeze(1))
            c_selection = net.static_context_selection(static)
            c_enrichment = net.static_context_enrichment(static)
            c_h, c_c = net.static_context_state_h(static), net.static_context_state_c(static)
            self.static_weights = static_weights  # [S, 1]
            self.h0, self.c0 = c_h, c_c  # [S, d]
            self.encoder = _SelectionForm(net.encoder_selection, c_selection)
            self.decoder = _SelectionForm(net.decoder_selection, c_selection)
            enrich = net.static_enrichment
            assert enrich.context is not None
            self.enrich_bias = (enrich.fc2.bias + F.linear(c_enrichment, enrich.context.weight)).unsqueeze(1)
            self.lookback, self.horizon, self.hidden_size = net.lookback, net.horizon, net.hidden_size
            self.lstm_layers, self.relative = net.lstm_layers, net.add_relative_time
            self.lstm_encoder, self.lstm_decoder = net.lstm_encoder, net.lstm_decoder
            self.post_lstm_gate, self.post_attention_gate = _gate_params(net.post_lstm_gate), _gate_params(net.post_attention_gate)
            self.pre_output_gate = _gate_params(net.pre_output_gate)
            self.static_enrichment, self.positionwise_grn = _grn_params(enrich), _grn_params(net.positionwise_grn)
            self.attention_out = (net.attention.out.weight, net.attention.out.bias)
            self.heads, self.head_size = net.attention.n_heads, net.attention.head_size
            self.causal_mask = net.causal_mask
            self.quantile_head = (net.quantile_head.weight, net.quantile_head.bias)
            att = net.attention
            scale = 1.0 / math.sqrt(att.head_size)  # the scores' 1/sqrt(head size), on the query projection
            self.qkv_weight = torch.cat([att.query.weight * scale, att.key.weight, att.value.weight])
            self.qkv_bias = torch.cat([att.query.bias * scale, att.key.bias, att.value.bias])
            self.masked = torch.finfo(p.dtype).min
            one = torch.ones(1, 1, 1, device=p.device, dtype=p.dtype)
            self.past_time = net.relative_time(net.lookback, 1 - net.lookback, one)  # [1, L, 1]
            self.future_time = net.relative_time(net.horizon, 1, one)  # [1, H, 1]
        self.compiled_rows: int | None = None  # compile_for's batch size, and its compiled graph
        self._compiled: Callable[..., tuple[Tensor, ...]] | None = None

    def matches(self, like: Tensor) -> bool:
        """Whether the parameters are still on the device and in the dtype this form was built from."""
        p = self.net.quantile_head.weight
        return p.device == self.device and p.dtype == self.dtype and like.dtype == self.dtype

    def compile_for(self, rows: int) -> None:
        """Compile this form for batches of ``rows`` windows, here and once (torch.compile, inductor's C++ wrapper:
        seconds): such calls then run the compiled graph, any other batch the eager form. The form gets its own copy
        of the code, so its graph is the only one torch.compile keeps for it."""
        net = self.net
        own = types.FunctionType(TFTInference._stepped.__code__.replace(), globals())
        compiled = torch.compile(types.MethodType(own, self), dynamic=False, fullgraph=True, options=_COMPILE_OPTIONS)
        like = {"device": self.device, "dtype": self.dtype}
        with torch.no_grad():
            self.stepped_lstms = (lstm_layers(self.lstm_encoder), lstm_layers(self.lstm_decoder))
            compiled(torch.zeros(rows, self.lookback, net.n_features, **like),
                     torch.zeros(rows, self.horizon, net.n_known_future, **like),
                     torch.zeros(rows, dtype=torch.int64, device=self.device))
        self._compiled, self.compiled_rows = compiled, rows

    def __call__(self, x_past: Tensor, x_future: Tensor, symbol: Tensor) -> TFTOutput:
        """The same as ``net(x_past, x_future, symbol)`` in eval mode (inputs already checked by the network)."""
        if self.compiled_rows == x_past.shape[0] and symbol.dtype == torch.int64:
            return self.output(*self._compiled(x_past.contiguous(), x_future.contiguous(), symbol.contiguous()))
        return self.output(*self._tensors(x_past, x_future, symbol))

    def _stepped(self, x_past: Tensor, x_future: Tensor, symbol: Tensor) -> tuple[Tensor, ...]:
        """What :meth:`compile_for` compiles: the form with the LSTMs' recurrence step by step."""
        return self._tensors(x_past, x_future, symbol, stepped=True)

    def _tensors(self, x_past: Tensor, x_future: Tensor, symbol: Tensor, stepped: bool = False) -> tuple[Tensor, ...]:
        """TFTOutput's tensors; ``stepped``: the LSTMs through :func:`lstm_steps` (for torch.compile)."""
        b, L, H, d = x_past.shape[0], self.lookback, self.horizon, self.hidden_size
        inputs = x_past  # the decision row's inputs, for the network's linear skip
        if self.relative:
            x_past = torch.cat([x_past, self.past_time.expand(b, L, 1)], dim=-1)
            x_future = torch.cat([x_future, self.future_time.expand(b, H, 1)], dim=-1)
        past, encoder_weights = self.encoder(x_past, symbol)
        future, decoder_weights = self.decoder(x_future, symbol)
        h0, c0 = self.h0[symbol].unsqueeze(0), self.c0[symbol].unsqueeze(0)
        if self.lstm_layers > 1:
            h0 = h0.expand(self.lstm_layers, -1, -1).contiguous()
            c0 = c0.expand(self.lstm_layers, -1, -1).contiguous()
        if stepped:
            enc_out, state = lstm_steps(self.stepped_lstms[0], past, (h0, c0))
            dec_out, _ = lstm_steps(self.stepped_lstms[1], future, state)
        else:
            enc_out, state = self.lstm_encoder(past, (h0, c0))
            dec_out, _ = self.lstm_decoder(future, state)
        temporal = _gate(self.post_lstm_gate, torch.cat([enc_out, dec_out], 1), torch.cat([past, future], 1))
        enriched = _grn(self.static_enrichment, temporal, self.enrich_bias[symbol])
        nh, dh = self.heads, self.head_size
        qkv = F.linear(enriched, self.qkv_weight, self.qkv_bias)
        qh = qkv[:, L:, :d].reshape(b, H, nh, dh).transpose(1, 2)
        kh = qkv[:, :, d : 2 * d].reshape(b, L + H, nh, dh).transpose(1, 2)
        scores = torch.matmul(qh, kh.transpose(-1, -2)).masked_fill_(self.causal_mask, self.masked)
        attention = torch.softmax(scores, dim=-1)
        heads = torch.matmul(attention, qkv[:, :, 2 * d :].unsqueeze(1))  # [B, h, H, dh]
        attended = F.linear(heads.mean(dim=1), *self.attention_out)
        decoded = _grn(self.positionwise_grn, _gate(self.post_attention_gate, attended, enriched[:, L:]))
        decoded = _gate(self.pre_output_gate, decoded, temporal[:, L:])
        prediction = add_skip(F.linear(decoded, *self.quantile_head), self.net.linear_skip, inputs)
        return prediction, self.static_weights[symbol], encoder_weights, decoder_weights, attention
