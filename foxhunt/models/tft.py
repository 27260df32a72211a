"""Temporal Fusion Transformer (Lim et al., 2021) as a plain nn.Module, in the paper's vocabulary.

Shapes: B batch, L lookback (encoder), H horizon (decoder), F observed past inputs, K known-future inputs,
d ``hidden_size``, Q quantiles. Inputs are continuous variables (scalars) plus an optional symbol id as static input.

Speed: the variable selection of continuous inputs has two interchangeable paths behind one switch, ``fused``
(the same parameters, so a state dict trained with one loads in the other). ``fused=False`` is the reference, the
paper's maths as written: per-variable embeddings [..., V, e], batched grouped GRNs (``einsum`` over variables) whose
every layer materialises [..., V, *], and their selection-weighted sum. ``fused=True`` (the default) runs
``foxhunt.models.variable_selection_fused``: embeddings composed into the layers that read them, and the per-variable
GRNs as one autograd Function over row chunks with a hand-written backward; its docstring says what it materialises
on CPU and on CUDA. With ~125 inputs the per-variable GRNs are nearly the whole cost of a step.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foxhunt.models.linear_skip import LinearSkip, add_skip
from foxhunt.models.tft_inference import TFTInference
from foxhunt.models.tft_output import TFTOutput
from foxhunt.models.variable_selection_fused import dropout_drops, fused_variable_selection


class GapDropout(nn.Dropout):
    """nn.Dropout whose fast path (``fused``, float32 on CPU) draws only where the drops fall, as geometric gaps.

    The same process as nn.Dropout (i.i.d. Bernoulli(p) drops, kept entries scaled by 1/(1-p)) from one random number
    per drop instead of one per entry: CPU's per-entry ``bernoulli_`` took ~7% of a 5-input training step (more
    than the LSTM's forward). ``fused=False``, other dtypes and other devices (where ``bernoulli_`` is fast, and reading the last
    drop's position would wait for the device) run nn.Dropout itself. The masks differ draw by draw, not in law.
    """

    def __init__(self, p: float = 0.5, fused: bool = True) -> None:
        super().__init__(p)
        self.fused = fused

    def forward(self, x: Tensor) -> Tensor:
        if not (self.fused and self.training and self.p > 0.0 and x.device.type == "cpu" and x.dtype == torch.float32):
            return super().forward(x)
        return x * _gap_keep(x.numel(), self.p).view(x.shape)


@torch.compiler.disable  # a data-dependent loop over rounds of gaps: nothing for a compiler to fuse
def _gap_keep(n: int, p: float) -> Tensor:
    """n float32 multipliers on CPU: 0 at Bernoulli(p) drops, 1/(1-p) elsewhere (p < 1; p = 1 drops everything)."""
    if p >= 1.0:
        return torch.zeros(n)
    keep = torch.full((n,), 1.0 / (1.0 - p))
    return keep.index_fill_(0, dropout_drops(n, p, keep.device), 0.0)


class GLU(nn.Module):
    """Gated linear unit: sigma(W4 x + b4) * (W5 x + b5), lets the network shut a path off entirely."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(input_size, 2 * output_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.glu(self.linear(x), dim=-1)


class GateAddNorm(nn.Module):
    """Gated skip connection: LayerNorm(residual + GLU(dropout(x)))."""

    def __init__(self, input_size: int, output_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = GapDropout(dropout)
        self.glu = GLU(input_size, output_size)
        self.norm = nn.LayerNorm(output_size)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.norm(self.glu(self.dropout(x)) + residual)


class GatedResidualNetwork(nn.Module):
    """GRN(a, c) = LayerNorm(skip(a) + GLU(W1 ELU(W2 a + W3 c + b2) + b1)): non-linearity only where the data needs it."""

    def __init__(
        self, input_size: int, hidden_size: int, output_size: int, context_size: int | None = None, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.input_size, self.hidden_size, self.output_size = input_size, hidden_size, output_size
        self.skip = nn.Linear(input_size, output_size) if input_size != output_size else None
        self.fc2 = nn.Linear(input_size, hidden_size)
        self.context = nn.Linear(context_size, hidden_size, bias=False) if context_size else None
        self.fc1 = nn.Linear(hidden_size, hidden_size)
        self.gate = GateAddNorm(hidden_size, output_size, dropout)

    def forward(self, a: Tensor, context: Tensor | None = None) -> Tensor:
        residual = a if self.skip is None else self.skip(a)
        return self.from_projections(self.fc2(a), residual, context)

    def from_projections(self, fc2_out: Tensor, residual: Tensor, context: Tensor | None = None) -> Tensor:
        """The GRN after its input-reading layers (W2 a + b2 and skip(a)), for callers that compute those fused."""
        if self.context is not None:
            if context is None:
                raise ValueError("this GatedResidualNetwork was built with a context input; pass context=")
            c = self.context(context)
            while c.dim() < fc2_out.dim():
                c = c.unsqueeze(-2)
            fc2_out = fc2_out + c
        return self.gate(self.fc1(F.elu(fc2_out)), residual)


class GroupedGatedResidualNetwork(nn.Module):
    """G independent GRNs (one per variable) evaluated at once: grouped weights, ``einsum`` over [..., G, in]."""

    # Biases and the LayerNorm gain and shift, by role: [G, *]-shaped, so not told apart from weights by ndim.
    no_decay_params: ClassVar[tuple[str, ...]] = (
        "skip_bias", "fc2_bias", "fc1_bias", "glu_bias", "norm_weight", "norm_bias"
    )

    def __init__(self, n_groups: int, input_size: int, hidden_size: int, output_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_groups, self.input_size, self.hidden_size, self.output_size = n_groups, input_size, hidden_size, output_size
        g = n_groups
        self.skip_weight = nn.Parameter(torch.empty(g, input_size, output_size)) if input_size != output_size else None
        self.skip_bias = nn.Parameter(torch.zeros(g, output_size)) if input_size != output_size else None
        self.fc2_weight = nn.Parameter(torch.empty(g, input_size, hidden_size))
        self.fc2_bias = nn.Parameter(torch.zeros(g, hidden_size))
        self.fc1_weight = nn.Parameter(torch.empty(g, hidden_size, hidden_size))
        self.fc1_bias = nn.Parameter(torch.zeros(g, hidden_size))
        self.glu_weight = nn.Parameter(torch.empty(g, hidden_size, 2 * output_size))
        self.glu_bias = nn.Parameter(torch.zeros(g, 2 * output_size))
        self.norm_weight = nn.Parameter(torch.ones(g, output_size))
        self.norm_bias = nn.Parameter(torch.zeros(g, output_size))
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each group initialised like its own nn.Linear (uniform +-1/sqrt(fan_in))."""
        for w, b in (
            (self.skip_weight, self.skip_bias),
            (self.fc2_weight, self.fc2_bias),
            (self.fc1_weight, self.fc1_bias),
            (self.glu_weight, self.glu_bias),
        ):
            if w is None:
                continue
            bound = 1.0 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    def forward(self, a: Tensor) -> Tensor:
        """[..., G, input_size] -> [..., G, output_size]: GRN_g(a[..., g, :]) for every group g."""
        if self.skip_weight is None:
            residual = a
        else:
            residual = torch.einsum("...gi,gio->...go", a, self.skip_weight) + self.skip_bias
        eta2 = F.elu(torch.einsum("...gi,gih->...gh", a, self.fc2_weight) + self.fc2_bias)
        eta1 = torch.einsum("...gh,ghk->...gk", eta2, self.fc1_weight) + self.fc1_bias
        gated = F.glu(torch.einsum("...gh,gho->...go", self.dropout(eta1), self.glu_weight) + self.glu_bias, dim=-1)
        z = F.layer_norm(gated + residual, (self.output_size,))
        return z * self.norm_weight + self.norm_bias


class VariableSelectionNetwork(nn.Module):
    """Soft, instance-wise selection of V input variables: softmax(GRN_v(flat inputs, c_s)) weighting per-variable GRNs.

    ``continuous=True``: inputs are scalars [..., V]; each variable owns a linear embedding to ``input_size``
    (the paper's linear transformation of continuous inputs). ``continuous=False``: inputs are already embedded,
    [..., V, input_size] (e.g. categorical embeddings).

    ``fused`` chooses how continuous inputs are computed, with the same parameters: True, the fused path of
    ``foxhunt.models.variable_selection_fused`` (embeddings composed into the layers, per-variable GRNs in row chunks
    of ``pairs_per_chunk`` (row, variable) pairs on CPU, one chunk on CUDA; their activations kept for backward when
    they fit in ``keep_bytes``, recomputed there otherwise); False, the reference path ``forward_embedded(embed(x))``.
    Pre-embedded inputs always take the reference path.
    """

    no_decay_params: ClassVar[tuple[str, ...]] = ("embed_bias",)  # the per-variable embeddings' biases

    def __init__(
        self,
        n_variables: int,
        input_size: int,
        hidden_size: int,
        context_size: int | None = None,
        dropout: float = 0.0,
        continuous: bool = True,
        pairs_per_chunk: int = 8192,
        fused: bool = True,
        keep_bytes: int = 512 * 2**20,
    ) -> None:
        super().__init__()
        if n_variables < 1:
            raise ValueError(f"a variable selection network needs at least one variable, got {n_variables}")
        self.n_variables, self.input_size, self.hidden_size, self.continuous = n_variables, input_size, hidden_size, continuous
        self.pairs_per_chunk = pairs_per_chunk  # (row, variable) pairs per chunk of the fused per-variable GRNs on CPU
        self.keep_bytes = keep_bytes  # the fused path keeps its activations for backward up to this size, else recomputes
        self._fused = fused
        if continuous:
            self.embed_weight = nn.Parameter(torch.empty(n_variables, input_size))
            self.embed_bias = nn.Parameter(torch.empty(n_variables, input_size))
            nn.init.uniform_(self.embed_weight, -1.0, 1.0)  # nn.Linear(1, input_size) initialisation
            nn.init.uniform_(self.embed_bias, -1.0, 1.0)
        self.flattened_grn = GatedResidualNetwork(
            n_variables * input_size, min(hidden_size, n_variables), n_variables, context_size, dropout
        )
        self.variable_grns = GroupedGatedResidualNetwork(
            n_variables, input_size, min(input_size, hidden_size), hidden_size, dropout
        )
        self.fused = fused  # and the scoring GRN's dropout

    @property
    def fused(self) -> bool:
        """Whether continuous inputs take the fused path and dropouts draw gaps (settable: the same parameters)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self._fused = bool(value)
        for module in self.modules():
            if isinstance(module, GapDropout):
                module.fused = self._fused

    def embed(self, x: Tensor) -> Tensor:
        """Per-variable linear embeddings [..., V] -> [..., V, input_size]."""
        return x.unsqueeze(-1) * self.embed_weight + self.embed_bias

    def forward(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns the selected combination [..., hidden_size] and the variable weights [..., V]."""
        if not self.continuous:
            return self.forward_embedded(x, context)
        if x.shape[-1] != self.n_variables:
            raise ValueError(f"expected {self.n_variables} input variables in the last dim, got {x.shape[-1]}")
        if self.fused:
            return fused_variable_selection(self, x, context)
        return self.forward_embedded(self.embed(x), context)

    def forward_embedded(self, e: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Selection over embedded inputs [..., V, input_size] (the reference path): every [..., V, *] materialised."""
        weights = torch.softmax(self.flattened_grn(e.flatten(-2), context).float(), dim=-1)  # [..., V]
        processed = self.variable_grns(e)  # [..., V, d]
        combined = (processed * weights.unsqueeze(-1).to(processed.dtype)).sum(-2)
        return combined, weights


class InterpretableMultiHeadAttention(nn.Module):
    """Multi-head attention whose heads share one value projection and are averaged, so the weights are interpretable."""

    def __init__(self, hidden_size: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if hidden_size % n_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by attention heads ({n_heads})")
        self.n_heads, self.head_size = n_heads, hidden_size // n_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, self.head_size)  # shared across heads
        self.out = nn.Linear(self.head_size, hidden_size)
        self.dropout = GapDropout(dropout)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """q [B, Tq, d], k/v [B, Tk, d], mask [Tq, Tk] True where attention is forbidden -> ([B, Tq, d], [B, h, Tq, Tk])."""
        b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
        qh = self.query(q).view(b, tq, self.n_heads, self.head_size).transpose(1, 2)
        kh = self.key(k).view(b, tk, self.n_heads, self.head_size).transpose(1, 2)
        vs = self.value(v)  # [B, Tk, dh]
        scores = torch.matmul(qh, kh.transpose(-1, -2)).float() / math.sqrt(self.head_size)
        if mask is not None:
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        attn = torch.softmax(scores, dim=-1)  # float32 even under autocast
        heads = torch.matmul(self.dropout(attn).to(vs.dtype), vs.unsqueeze(1))  # [B, h, Tq, dh]
        return self.out(heads.mean(dim=1)), attn


def _run_lstm(lstm: nn.LSTM, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``lstm(x, state)``; on CPU under autocast in float32 (outputs cast back to ``x``'s dtype): oneDNN builds its
    bfloat16 LSTM only on cores with AVX-512 and fails on the others ("could not create a primitive descriptor"), so
    a CPU ``bf16-mixed`` fit would run on some machines and not others; float32 runs the same everywhere."""
    if x.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return lstm(x, state)
    with torch.autocast("cpu", enabled=False):
        out, (h, c) = lstm(x.float(), (state[0].float(), state[1].float()))
    return out.to(x.dtype), (h.to(x.dtype), c.to(x.dtype))


class TemporalFusionTransformer(nn.Module):
    """Multi-horizon quantile forecaster: static encoders, variable selection, LSTM seq2seq, interpretable attention.

    Encoder variables are the F observed past inputs plus (``add_relative_time``) the relative time index; decoder
    variables are the K known-future inputs plus the relative time index. The static input is the symbol embedding.
    ``fused`` picks the encoder and decoder variable selection's path (see ``VariableSelectionNetwork``) and the
    dropouts' draw (``GapDropout``); both paths have the same parameters, so a state dict saved with either loads into
    a model built with the other. ``keep_activations_mib``: per variable selection, the fused path keeps its
    activations from forward to backward up to this size (about 400 MiB with ~125 inputs at batch 128 x 64 bars,
    20 MiB with 5), instead of recomputing them in backward (a fifth of its time at ~125 inputs); 0 recomputes always.
    ``linear_skip`` adds a linear quantile regression on the decision row's inputs to the output
    (:class:`~foxhunt.models.linear_skip.LinearSkip`, zero at initialisation): the direct path to a weak signal.
    """

    def __init__(
        self,
        n_features: int,
        n_known_future: int = 0,
        n_symbols: int = 1,
        lookback: int = 64,
        horizon: int = 6,
        hidden_size: int = 32,
        attention_heads: int = 4,
        hidden_continuous_size: int = 16,
        lstm_layers: int = 1,
        dropout: float = 0.1,
        n_quantiles: int = 3,
        add_relative_time: bool = True,
        fused: bool = True,
        keep_activations_mib: int = 512,
        linear_skip: bool = False,
    ) -> None:
        super().__init__()
        if n_features < 1:
            raise ValueError(f"n_features must be >= 1, got {n_features}")
        if n_known_future < 0:
            raise ValueError(f"n_known_future must be >= 0, got {n_known_future}")
        if n_known_future == 0 and not add_relative_time:
            raise ValueError("the decoder needs an input: set add_relative_time=True or give known-future inputs")
        if min(n_symbols, lookback, horizon, hidden_size, hidden_continuous_size, lstm_layers, n_quantiles) < 1:
            raise ValueError("n_symbols, lookback, horizon, sizes, lstm_layers and n_quantiles must all be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if keep_activations_mib < 0:
            raise ValueError(f"keep_activations_mib must be >= 0, got {keep_activations_mib}")
        d = hidden_size
        self.n_features, self.n_known_future, self.n_symbols = n_features, n_known_future, n_symbols
        self.lookback, self.horizon, self.hidden_size, self.lstm_layers = lookback, horizon, d, lstm_layers
        self.add_relative_time = add_relative_time
        extra = 1 if add_relative_time else 0
        self.n_encoder_variables, self.n_decoder_variables = n_features + extra, n_known_future + extra

        self.symbol_embedding = nn.Embedding(n_symbols, d)
        self.static_selection = VariableSelectionNetwork(1, d, d, None, dropout, continuous=False)
        self.static_context_selection = GatedResidualNetwork(d, d, d, dropout=dropout)  # c_s
        self.static_context_enrichment = GatedResidualNetwork(d, d, d, dropout=dropout)  # c_e
        self.static_context_state_h = GatedResidualNetwork(d, d, d, dropout=dropout)  # c_h
        self.static_context_state_c = GatedResidualNetwork(d, d, d, dropout=dropout)  # c_c
        self.encoder_selection = VariableSelectionNetwork(
            self.n_encoder_variables, hidden_continuous_size, d, d, dropout, continuous=True, fused=fused,
            keep_bytes=keep_activations_mib * 2**20,
        )
        self.decoder_selection = VariableSelectionNetwork(
            self.n_decoder_variables, hidden_continuous_size, d, d, dropout, continuous=True, fused=fused,
            keep_bytes=keep_activations_mib * 2**20,
        )
        lstm_dropout = dropout if lstm_layers > 1 else 0.0
        self.lstm_encoder = nn.LSTM(d, d, num_layers=lstm_layers, batch_first=True, dropout=lstm_dropout)
        self.lstm_decoder = nn.LSTM(d, d, num_layers=lstm_layers, batch_first=True, dropout=lstm_dropout)
        self.post_lstm_gate = GateAddNorm(d, d, dropout)
        self.static_enrichment = GatedResidualNetwork(d, d, d, context_size=d, dropout=dropout)
        self.attention = InterpretableMultiHeadAttention(d, attention_heads, dropout)
        self.post_attention_gate = GateAddNorm(d, d, dropout)
        self.positionwise_grn = GatedResidualNetwork(d, d, d, dropout=dropout)
        self.pre_output_gate = GateAddNorm(d, d, 0.0)
        self.quantile_head = nn.Linear(d, n_quantiles)
        # the decision row's inputs straight to the quantiles (models/linear_skip.py; the inference form adds it too)
        self.linear_skip = LinearSkip(n_features, horizon, n_quantiles) if linear_skip else None
        self.register_buffer("causal_mask", _decoder_causal_mask(lookback, horizon), persistent=False)
        self.fused = fused  # every variable selection and dropout of the network
        # an eval forward under torch.no_grad runs the inference form (TFTInference, built from the parameters once
        # and kept until train()/eval()/load_state_dict; turning this off only stops using it): a live session turns
        # it on around its decisions, its weights never changing; off by default, so fits and back-tests are as ever
        self.cache_inference = False
        self._inference: TFTInference | None = None
        self.register_load_state_dict_post_hook(_drop_inference_form)

    @property
    def fused(self) -> bool:
        """Whether the variable selections run the fused path and the dropouts draw gaps (settable: same parameters)."""
        return self.encoder_selection.fused

    @fused.setter
    def fused(self, value: bool) -> None:
        for module in self.modules():
            if isinstance(module, (VariableSelectionNetwork, GapDropout)):
                module.fused = value

    def drop_inference_form(self) -> None:
        """Forget the built inference form (the next cached eval forward builds it from the parameters again)."""
        self._inference = None

    def train(self, mode: bool = True) -> TemporalFusionTransformer:
        self._inference = None
        return super().train(mode)

    def _inference_form(self, like: Tensor) -> TFTInference | None:
        """The inference form when this forward may use it (``cache_inference`` on, eval, no grad, no autocast, not
        traced or compiled), built if it is not yet."""
        if not self.cache_inference or self.training or torch.is_grad_enabled():
            return None
        if torch.is_autocast_enabled(like.device.type) or torch.jit.is_tracing() or torch.compiler.is_compiling():
            return None
        return self.inference_form(like)

    def inference_form(self, like: Tensor | None = None) -> TFTInference:
        """The inference form of the current parameters (for inputs like ``like``), built if it is not yet: what a
        cached eval forward runs (a live session compiles it here before its first bar: ``TFTInference.compile_for``)."""
        like = self.quantile_head.weight if like is None else like
        if self._inference is None or not self._inference.matches(like):
            self._inference = TFTInference(self)
        return self._inference

    def relative_time(self, steps: int, start: int, like: Tensor) -> Tensor:
        """Known time index (t - t0) / lookback for ``steps`` positions from ``start``, broadcast to [B, steps, 1]."""
        idx = torch.arange(start, start + steps, device=like.device, dtype=like.dtype) / self.lookback
        return idx.view(1, steps, 1).expand(like.shape[0], steps, 1)

    def forward(self, x_past: Tensor, x_future: Tensor | None = None, symbol: Tensor | None = None) -> TFTOutput:
        """x_past [B, L, F], x_future [B, H, K] (K may be 0 or None), symbol [B] int64 -> TFTOutput."""
        b = x_past.shape[0]
        if x_past.dim() != 3 or x_past.shape[1:] != (self.lookback, self.n_features):
            raise ValueError(f"x_past must be [B, {self.lookback}, {self.n_features}], got {list(x_past.shape)}")
        if x_future is None:
            x_future = x_past.new_zeros(b, self.horizon, 0)
        if x_future.dim() != 3 or x_future.shape[0] != b or x_future.shape[1:] != (self.horizon, self.n_known_future):
            raise ValueError(
                f"x_future must be [{b}, {self.horizon}, {self.n_known_future}], got {list(x_future.shape)}"
            )
        if symbol is None:
            symbol = torch.zeros(b, dtype=torch.long, device=x_past.device)
        form = self._inference_form(x_past)
        if form is not None:
            return form(x_past, x_future, symbol)
        inputs = x_past  # the decision row's inputs, for the linear skip
        if self.add_relative_time:
            x_past = torch.cat([x_past, self.relative_time(self.lookback, 1 - self.lookback, x_past)], dim=-1)
            x_future = torch.cat([x_future, self.relative_time(self.horizon, 1, x_past)], dim=-1)

        # Static covariate encoders: one selected static embedding, four contexts.
        static, static_weights = self.static_selection(self.symbol_embedding(symbol).unsqueeze(1))
        c_selection = self.static_context_selection(static)
        c_enrichment = self.static_context_enrichment(static)
        c_h = self.static_context_state_h(static)
        c_c = self.static_context_state_c(static)

        # Variable selection for past and future inputs, conditioned on c_s.
        past, encoder_weights = self.encoder_selection(x_past, c_selection)  # [B, L, d]
        future, decoder_weights = self.decoder_selection(x_future, c_selection)  # [B, H, d]

        # Sequence-to-sequence LSTM, initial state from the static context.
        dtype = past.dtype
        h0 = c_h.to(dtype).unsqueeze(0).expand(self.lstm_layers, -1, -1).contiguous()
        c0 = c_c.to(dtype).unsqueeze(0).expand(self.lstm_layers, -1, -1).contiguous()
        enc_out, state = _run_lstm(self.lstm_encoder, past, (h0, c0))
        dec_out, _ = _run_lstm(self.lstm_decoder, future.to(enc_out.dtype), state)
        lstm_out = torch.cat([enc_out, dec_out], dim=1)
        selected = torch.cat([past, future.to(past.dtype)], dim=1)
        temporal = self.post_lstm_gate(lstm_out, selected)  # [B, L+H, d]

        # Static enrichment, then causal interpretable attention from the decoder positions.
        enriched = self.static_enrichment(temporal, c_enrichment)
        queries = enriched[:, self.lookback :]
        attended, attention = self.attention(queries, enriched, enriched, self.causal_mask)
        decoded = self.post_attention_gate(attended, queries)
        decoded = self.positionwise_grn(decoded)
        decoded = self.pre_output_gate(decoded, temporal[:, self.lookback :])
        prediction = add_skip(self.quantile_head(decoded), self.linear_skip, inputs)
        return TFTOutput(prediction, static_weights, encoder_weights, decoder_weights, attention)


def _drop_inference_form(module: TemporalFusionTransformer, incompatible_keys: object) -> None:
    """load_state_dict's post-hook: new parameters, so the inference form built from the old ones goes."""
    module.drop_inference_form()


def _decoder_causal_mask(lookback: int, horizon: int) -> Tensor:
    """[H, L+H] True where decoder step i (position L+i) would see a later position j > L+i."""
    return torch.ones(horizon, lookback + horizon, dtype=torch.bool).triu(diagonal=lookback + 1)
