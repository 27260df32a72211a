"""Temporal Fusion Transformer (Lim et al., 2021) as a plain nn.Module, in the paper's vocabulary.

Shapes: B batch, L lookback (encoder), H horizon (decoder), F observed past inputs, K known-future inputs,
d ``hidden_size``, Q quantiles. Inputs are continuous variables (scalars) plus an optional symbol id as static input.

Speed: a continuous variable's embedding (``hidden_continuous_size``) is affine in its scalar, so every linear layer
that reads embeddings directly (the per-variable GRNs' first layer and skip, the flattened GRN that scores variables)
is composed with it on the fly: the same function and parameters as the paper's, without materialising the
[N, V, hidden_continuous] embeddings. The per-variable GRNs and their selection-weighted sum then run as one autograd
Function over cache-sized chunks of rows (grouped matrix products over a variable-major [V, rows, d] layout, never a
Python loop over variables): nothing of size [V, N, d] exists in forward or backward, which recomputes each chunk and
applies the chain rule by hand. With ~125 inputs those [V, N, d] intermediates were the whole cost of a step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
        self.dropout = nn.Dropout(dropout)
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
    """G independent GRNs (one per variable) evaluated in one batched product on a variable-major [G, N, in] layout."""

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
        """[G, N, input_size] -> [G, N, output_size]."""
        residual = a if self.skip_weight is None else torch.baddbmm(self.skip_bias.unsqueeze(1), a, self.skip_weight)
        return self.from_projections(torch.baddbmm(self.fc2_bias.unsqueeze(1), a, self.fc2_weight), residual)

    def from_projections(self, fc2_out: Tensor, residual: Tensor) -> Tensor:
        """The GRNs after their input-reading layers, for callers that compute W2 a + b2 and skip(a) fused."""
        eta1 = torch.baddbmm(self.fc1_bias.unsqueeze(1), F.elu(fc2_out), self.fc1_weight)
        gated = F.glu(torch.baddbmm(self.glu_bias.unsqueeze(1), self.dropout(eta1), self.glu_weight), dim=-1)
        z = F.layer_norm(gated + residual, (self.output_size,))
        return z * self.norm_weight.unsqueeze(1) + self.norm_bias.unsqueeze(1)


class VariableSelectionNetwork(nn.Module):
    """Soft, instance-wise selection of V input variables: softmax(GRN_v(flat inputs, c_s)) weighting per-variable GRNs.

    ``continuous=True``: inputs are scalars [..., V]; each variable owns a linear embedding to ``input_size``
    (the paper's linear transformation of continuous inputs) that is composed into the layers reading it.
    ``continuous=False``: inputs are already embedded, [..., V, input_size] (e.g. categorical embeddings).
    """

    def __init__(
        self,
        n_variables: int,
        input_size: int,
        hidden_size: int,
        context_size: int | None = None,
        dropout: float = 0.0,
        continuous: bool = True,
        pairs_per_chunk: int = 8192,
    ) -> None:
        super().__init__()
        self.pairs_per_chunk = pairs_per_chunk  # (row, variable) pairs per chunk of the per-variable GRNs on CPU
        if n_variables < 1:
            raise ValueError(f"a variable selection network needs at least one variable, got {n_variables}")
        self.n_variables, self.input_size, self.hidden_size, self.continuous = n_variables, input_size, hidden_size, continuous
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

    def embed(self, x: Tensor) -> Tensor:
        """Explicit per-variable embeddings [..., V] -> [..., V, input_size] (reference path; forward fuses it)."""
        return x.unsqueeze(-1) * self.embed_weight + self.embed_bias

    def forward(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns the selected combination [..., hidden_size] and the variable weights [..., V]."""
        if not self.continuous:
            return self.forward_embedded(x, context)
        if x.shape[-1] != self.n_variables:
            raise ValueError(f"expected {self.n_variables} input variables in the last dim, got {x.shape[-1]}")
        lead = x.shape[:-1]
        v, e = self.n_variables, self.input_size
        flat_x = x.reshape(-1, v)  # [N, V]
        ctx = None if context is None else _flatten_context(context, lead)
        # Scoring GRN reads concat_v(x_v * Ew_v + Eb_v): its fc2 and skip compose into [V, out] maps of the scalars.
        fg = self.flattened_grn
        w2 = fg.fc2.weight.view(fg.hidden_size, v, e)
        fc2_out = F.linear(
            flat_x,
            torch.einsum("hve,ve->hv", w2, self.embed_weight),
            fg.fc2.bias + torch.einsum("hve,ve->h", w2, self.embed_bias),
        )
        ws = fg.skip.weight.view(v, v, e) if fg.skip is not None else None
        residual = (
            F.linear(
                flat_x,
                torch.einsum("ove,ve->ov", ws, self.embed_weight),
                fg.skip.bias + torch.einsum("ove,ve->o", ws, self.embed_bias),
            )
            if ws is not None
            else self.embed(flat_x).flatten(-2)
        )
        weights = torch.softmax(fg.from_projections(fc2_out, residual, ctx).float(), dim=-1)  # [N, V]
        # Per-variable GRNs, variable-major: first layer and skip are rank-1 in the scalar x_v.
        g = self.variable_grns
        a2 = torch.einsum("ve,veh->vh", self.embed_weight, g.fc2_weight)
        b2 = torch.einsum("ve,veh->vh", self.embed_bias, g.fc2_weight) + g.fc2_bias
        if g.skip_weight is not None:
            a_s = torch.einsum("ve,veo->vo", self.embed_weight, g.skip_weight)
            b_s = torch.einsum("ve,veo->vo", self.embed_bias, g.skip_weight) + g.skip_bias
        else:
            a_s, b_s = self.embed_weight, self.embed_bias
        p = g.dropout.p if g.training else 0.0
        glu_weight = g.glu_weight / (1.0 - p) if p > 0.0 else g.glu_weight  # dropout's 1/(1-p) moved onto W_glu
        rows = max(1, self.pairs_per_chunk // v) if x.device.type == "cpu" else flat_x.shape[0]
        combined = _selected_variable_grns(
            flat_x.t(), weights.t(), (a2, b2, g.fc1_weight, g.fc1_bias, glu_weight, g.glu_bias, a_s, b_s,
                                  g.norm_weight, g.norm_bias), p, rows,
        )
        return combined.reshape(*lead, self.hidden_size), weights.reshape(*lead, v)

    def forward_embedded(self, e: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Selection over pre-embedded inputs [..., V, input_size] (also the unfused reference for continuous inputs)."""
        lead = e.shape[:-2]
        flat = e.reshape(-1, self.n_variables, self.input_size)
        ctx = None if context is None else _flatten_context(context, lead)
        weights = torch.softmax(self.flattened_grn(flat.flatten(-2), ctx).float(), dim=-1)
        processed = self.variable_grns(flat.transpose(0, 1))
        combined = _weighted_sum(processed, weights)
        return combined.reshape(*lead, self.hidden_size), weights.reshape(*lead, self.n_variables)


@torch.compiler.disable  # a loop of cache-sized chunks: compiling would unroll it, and it is already fused by hand
def _selected_variable_grns(x: Tensor, weights: Tensor, params: tuple[Tensor, ...], p: float, rows: int) -> Tensor:
    """sum_v weights[v, n] * GRN_v(x[v, n]) in float32 (autocast off: the GRNs end in a float32 LayerNorm anyway)."""
    with torch.autocast(x.device.type, enabled=False):
        x, weights = x.float().contiguous(), weights.float().contiguous()  # [V, N]: chunks are row slices
        return _VariableGRNs.apply(x, weights, p, rows, *(t.float().contiguous() for t in params))


class _VariableGRNs(torch.autograd.Function):
    """Per-variable GRNs on scalar inputs and their selection-weighted sum, ``rows`` rows at a time.

    Forward keeps nothing of size [V, N, d]: each chunk's [V, rows, *] intermediates stay in cache and are reduced
    over variables at once; it keeps each pair's LayerNorm mean and 1/std ([V, N] each). Backward recomputes a
    chunk's forward up to the centred LayerNorm input (one product of (x, 1, -mean) with (a_s, b_s, 1) instead of
    the statistics' passes) and applies the chain rule by hand (the same maths as autograd through the layers, with
    the forward pass's dropout drops, kept as positions and laid out per chunk in a reused mask). Biases of fc1 and
    the GLU ride in their products on a constant-1 column. Parameters (variable-major): a2, b2 [V, h]
    (embedding composed with fc2), fc1 [V, h, h] and [V, h], glu [V, h, 2d] (already divided by 1-p) and [V, 2d],
    a_s, b_s [V, d] (embedding composed with skip), norm [V, d] x2.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, p: float, rows: int, *params: Tensor) -> Tensor:  # type: ignore[override]
        """x [V, N] scalars, weights [V, N] -> [N, d]."""
        (v, n), h, d = x.shape, params[2].shape[-1], params[8].shape[-1]
        gamma, beta, a_s, b_s = params[8].unsqueeze(1), params[9], params[6].unsqueeze(1), params[7].unsqueeze(1)
        out = x.new_empty(n, d)
        mean, rstd = x.new_empty(v * n), x.new_empty(v * n)  # chunk r0:r1 at [v r0, v r1), variable-major
        avg = x.new_full((d, 1), 1.0 / d)
        drops = _chunk_drops(_dropout_drops(v * n * h, p, x.device), v * h * rows) if p > 0.0 else None
        aug, bufs = _augmented(params), _chunk_buffers(x, v, rows, h)
        for c, r0 in enumerate(range(0, n, rows)):
            r1 = min(n, r0 + rows)
            mask = _chunk_mask(drops, bufs, c, r1 - r0)
            wc, xc = weights[:, r0:r1], x[:, r0:r1].unsqueeze(-1)
            ab = _grn_chunk(xc, mask, params, aug, bufs)[-1]
            z = torch.addcmul(b_s, xc, a_s).addcmul_(ab[..., :d], ab[..., d:])  # skip(embed(x)) + GLU
            # LayerNorm statistics as matrix-vector products (two-pass: mean, then the centred variance), faster
            # than aten's layer_norm over a 32-wide last dim on CPU.
            flat = z.view(-1, d)
            mu, rs = mean[v * r0 : v * r1].view(-1, 1), rstd[v * r0 : v * r1].view(-1, 1)
            centred = flat.sub_(torch.mm(flat, avg, out=mu))
            torch.mm(torch.mul(centred, centred, out=ab.view(-1, 2 * d)[:, :d]), avg, out=rs).add_(1e-5).rsqrt_()
            # sum_v w (LN(z) gamma + beta) = sum_v (centred * rstd * w) gamma + w^T beta
            scaled = z.mul_(rs.view(v, -1, 1) * wc.unsqueeze(-1)).mul_(gamma)
            torch.sum(scaled, 0, out=out[r0:r1])
        out.addmm_(weights.t(), beta)
        ctx.save_for_backward(x, weights, mean, rstd, *params)
        ctx.drops, ctx.rows = drops, rows
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        """Chain rule through each chunk's recomputed forward, in float32 like the forward: under manual
        optimisation Lightning runs backward inside the training step's autocast region."""
        saved = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            return _VariableGRNs._backward(ctx, grad_out.to(saved[0].dtype), saved)

    @staticmethod
    def _backward(ctx, grad_out: Tensor, saved: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
        """Parameter gradients accumulate over chunks. The GLU's backward runs in place over its [value | gate]
        buffer, leaving [d gate-logit | d value]; its products use the weights with halves swapped to match."""
        x, weights, mean, rstd, *params = saved
        a2, _b2, w1, _b1, wg, _bg, a_s, b_s, gamma, beta = params
        (v, n), h, d = x.shape, w1.shape[-1], gamma.shape[-1]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads: list[Tensor] = [None] * len(params)  # type: ignore[list-item]
        dgamma, dbeta = torch.zeros_like(gamma), torch.zeros_like(beta)
        # with a row of bias grads: [dW1; db1] and [dWg; dbg] with the GLU's halves as [gate | value]
        dw1_aug, dwg_sw = x.new_zeros(v, h + 1, h), x.new_zeros(v, h + 1, 2 * d)
        # rank-1 layers' (a, b) grads, accumulated by one product per chunk: fc2's (dELU wide) and the skip's
        dab2, dab_s = x.new_zeros(v, 2, h + 1), x.new_zeros(v, 2, d)
        aug, bufs = _augmented(params), _chunk_buffers(x, v, ctx.rows, h)
        dx = torch.empty_like(x) if need_x else None
        dweights = torch.empty_like(weights) if need_w else None
        grad_out = grad_out.contiguous()
        # [V, 3, N] rows (x, 1, -mean): one product with (x, 1) gives a rank-1 layer's (a, b) grads; (x, 1, -mean)
        # times (a_s, b_s, 1) is the skip minus the LayerNorm mean. Rows, not a [V, N, 3] stack (a strided write,
        # ~10 ms); the products take chunk views of them (transposed) without copies.
        x1m = x.new_empty(v, 3, n)
        x1m[:, 0] = x
        x1m[:, 1] = 1.0
        sw = torch.stack([a_s, b_s, torch.ones_like(a_s)], dim=1)  # [V, 3, d]
        # transposed weights, contiguous: d eta1 is [V, R, h]; dELU is [V, R, h+1] like the ELU buffer it is
        # multiplied with (elu_backward is vectorised on contiguous operands only); its last column is never read
        w1_aug_t = aug[0].transpose(1, 2)[:, :h].contiguous()  # [V, h, h+1] = [W1^T | b1]
        wg_sw_t = torch.cat([wg[..., d:], wg[..., :d]], dim=-1).transpose(1, 2).contiguous()  # [V, 2d, h]
        gamma_col, a2_col, a_s_col = gamma.unsqueeze(-1), F.pad(a2, (0, 1)).unsqueeze(-1), a_s.unsqueeze(-1)
        gamma_b = gamma.unsqueeze(1)
        for c, r0 in enumerate(range(0, n, ctx.rows)):
            r1 = min(n, r0 + ctx.rows)
            rr = r1 - r0
            xc, wc, gc = x[:, r0:r1].unsqueeze(-1), weights[:, r0:r1], grad_out[r0:r1]
            x1c = x1m[:, :2, r0:r1]  # [V, 2, R]: (x, 1)
            torch.neg(mean[v * r0 : v * r1].view(v, rr), out=x1m[:, 2, r0:r1])
            xm = x1m[:, :, r0:r1].transpose(1, 2)  # [V, R, 3]: (x, 1, -mean)
            rs = rstd[v * r0 : v * r1].view(v, rr, 1)
            mask = _chunk_mask(ctx.drops, bufs, c, rr)
            e, eta, ab = _grn_chunk(xc, mask, params, aug, bufs)
            glu_a, gate = ab[..., :d], ab[..., d:]
            ln = torch.bmm(xm, sw).addcmul_(glu_a, gate).mul_(rs)  # LN(z) before its affine
            u = ln * gc  # [V, R, d]
            s2 = torch.bmm(u, gamma_col)  # [V, R, 1]: sum_k LN(z) gamma G
            dgamma.unsqueeze(1).baddbmm_(wc.unsqueeze(1), u)
            dbeta.addmm_(wc, gc)
            if dweights is not None:
                torch.addmm(s2.squeeze(-1), beta, gc.t(), out=dweights[:, r0:r1])
            # LayerNorm backward with dLN = w gamma G: dz = rstd w (gamma G - mean_k(gamma G) - LN(z) mean_k(LN(z) gamma G))
            dz = torch.addcmul((gamma @ gc.t()).unsqueeze(-1).mul_(-1.0 / d), gamma_b, gc, out=u)
            dz.addcmul_(ln, s2, value=-1.0 / d).mul_(rs * wc.unsqueeze(-1))
            dab_s.baddbmm_(x1c, dz)  # skip(embed(x)) = a_s x + b_s
            # GLU z = A sigmoid(B), in place: A <- dz A sigmoid'(B) (d gate logit), sigmoid(B) <- dz sigmoid(B) (d A)
            glu_a.mul_(dz)
            torch.ops.aten.sigmoid_backward.grad_input(glu_a, gate, grad_input=glu_a)
            gate.mul_(dz)
            dwg_sw.baddbmm_(eta.transpose(1, 2), ab)
            deta = torch.bmm(ab, wg_sw_t)  # [V, R, h]
            if mask is not None:
                deta.mul_(mask)
            dw1_aug.baddbmm_(e.transpose(1, 2), deta)  # e's constant column gives db1's row
            df2 = torch.bmm(deta, w1_aug_t)
            torch.ops.aten.elu_backward.grad_input(df2, 1.0, 1, 1, True, e, grad_input=df2)
            dab2.baddbmm_(x1c, df2)
            if dx is not None:  # dz (the u buffer) is intact: the GLU's backward only read it
                dx[:, r0:r1] = torch.bmm(dz, a_s_col).baddbmm_(df2, a2_col).squeeze(-1)
        grads[0], grads[1] = dab2[:, 0, :h], dab2[:, 1, :h]
        grads[6], grads[7], grads[8], grads[9] = dab_s[:, 0], dab_s[:, 1], dgamma, dbeta
        grads[2], grads[3] = dw1_aug[:, :h], dw1_aug[:, h]
        grads[4] = torch.cat([dwg_sw[:, :h, d:], dwg_sw[:, :h, :d]], dim=-1)
        grads[5] = torch.cat([dwg_sw[:, h, d:], dwg_sw[:, h, :d]], dim=-1)
        return (dx, dweights, None, None, *grads)


def _chunk_buffers(x: Tensor, v: int, rows: int, h: int) -> tuple[Tensor, Tensor]:
    """Reused per chunk: the dropout mask [V, rows, h] and the ELU output [V, rows, h+1] with a constant-1 last column."""
    e = x.new_empty(v, rows, h + 1)
    e[..., h] = 1.0
    return x.new_empty(v * rows * h), e


def _chunk_drops(drops: Tensor, per_chunk: int) -> tuple[Tensor, list[int], int]:
    """Sorted drop positions over chunks of ``per_chunk`` [V, rows, h] entries, each chunk's range in them, and
    ``per_chunk`` (a chunk's positions are its drops minus its first entry's)."""
    chunk_ends = torch.arange(per_chunk, int(drops[-1]) + per_chunk + 1 if len(drops) else 1, per_chunk)
    offsets = [0, *torch.searchsorted(drops, chunk_ends.to(drops.device)).tolist()]
    return drops, offsets, per_chunk


def _chunk_mask(drops: tuple[Tensor, list[int], int] | None, bufs: tuple[Tensor, Tensor], c: int, r: int) -> Tensor | None:
    """Chunk c's (r rows) keep mask [V, r, h] (1 = kept) from its drops, in the reused buffer."""
    if drops is None:
        return None
    pos, offsets, per_chunk = drops
    buf, e = bufs
    v, h = e.shape[0], e.shape[-1] - 1
    mask = buf[: v * r * h].fill_(1.0)
    if c + 1 < len(offsets) and offsets[c + 1] > offsets[c]:
        mask.index_fill_(0, pos[offsets[c] : offsets[c + 1]] - c * per_chunk, 0.0)
    return mask.view(v, r, h)


def _dropout_drops(n: int, p: float, device: torch.device) -> Tensor:
    """Sorted positions of the drops among n independent Bernoulli(p) drops, drawn as the geometric gaps between
    them: the same process as nn.Dropout's, with one random number per drop instead of one per entry. A gap is
    1 + floor(ln(1 - U) / ln(1 - p)) for U uniform on [0, 1) (2.5x faster than ``geometric_`` on CPU)."""
    inv_log_keep = 1.0 / math.log1p(-p)
    drops, last = [], -1  # ``last``: the latest drop drawn; every position up to it is decided
    while last < n:
        todo = n - last
        m = int(todo * p + 8.0 * math.sqrt(todo * p * (1.0 - p))) + 16  # almost always one round
        u = torch.empty(m, device=device).uniform_()
        gaps = u.neg_().add_(1.0).log_().mul_(inv_log_keep).floor_().clamp_(max=float(n))  # ln(0): capped
        pos = gaps.to(torch.int64).add_(1).cumsum_(0).add_(last)
        drops.append(pos)
        last = int(pos[-1])
    pos = torch.cat(drops) if len(drops) > 1 else drops[0]
    return pos[: int(torch.searchsorted(pos, n))]


def _dropout_keep_mask(n: int, p: float, device: torch.device) -> Tensor:
    """n independent Bernoulli(1-p) keeps as uint8 (1 = kept), from ``_dropout_drops``."""
    keep = torch.ones(n, dtype=torch.uint8, device=device)
    keep[_dropout_drops(n, p, device)] = 0
    return keep


def _augmented(params: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """fc1 and GLU weights with their bias as an extra input row, for inputs carrying a constant-1 last column:
    [W1 b1-row | e_h] [V, h+1, h+1] (its last output column is the constant 1 again) and [Wg; bg] [V, h+1, 2d].
    One product then adds the bias, instead of a separate pass over the product's output."""
    w1, b1, wg, bg = params[2:6]
    v, h = b1.shape
    w1_aug = w1.new_zeros(v, h + 1, h + 1)
    w1_aug[:, :h, :h] = w1
    w1_aug[:, h, :h] = b1
    w1_aug[:, h, h] = 1.0
    return w1_aug, torch.cat([wg, bg.unsqueeze(1)], dim=1)


def _grn_chunk(
    xc: Tensor, mask: Tensor | None, params: tuple[Tensor, ...], aug: tuple[Tensor, Tensor], bufs: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk of the per-variable GRNs up to the GLU, xc [V, R, 1] -> ([ELU, 1], [eta1, 1] (both [V, R, h+1]),
    [V, R, 2d] = [GLU value | sigmoid(GLU gate logit)]): biases ride in the products on the constant-1 column,
    one product gives both GLU halves, the gate's sigmoid runs in place."""
    a2, b2 = params[:2]
    w1_aug, wg_aug = aug
    r, h = xc.shape[1], a2.shape[-1]
    d = wg_aug.shape[-1] // 2
    f2 = torch.addcmul(b2.unsqueeze(1), xc, a2.unsqueeze(1))  # W2 embed(x) + b2, rank-1 in x
    e = bufs[1][:, :r]
    torch.maximum(f2, f2.clamp(max=0.0).exp_().sub_(1.0), out=e[..., :h])  # ELU: max(x, e^min(x,0) - 1), 2x aten's
    eta = torch.bmm(e, w1_aug)  # [eta1, 1]
    if mask is not None:
        eta[..., :h].mul_(mask)
    ab = torch.bmm(eta, wg_aug)
    ab[..., d:].sigmoid_()
    return e, eta, ab


def _weighted_sum(processed: Tensor, weights: Tensor) -> Tensor:
    """sum_v w[n, v] * processed[v, n, :] in one pass over the variable-major tensor."""
    return (processed * weights.t().unsqueeze(-1).to(processed.dtype)).sum(0)


def _flatten_context(context: Tensor, lead: torch.Size) -> Tensor:
    """Broadcast a static context [B, d] over the time dims of ``lead`` ([B] or [B, T]) and flatten to [N, d]."""
    while context.dim() < len(lead) + 1:
        context = context.unsqueeze(1)
    return context.expand(*lead, context.shape[-1]).reshape(-1, context.shape[-1])


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
        self.dropout = nn.Dropout(dropout)

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


class TFTOutput(NamedTuple):
    """Forecast quantiles with everything needed to interpret them."""

    prediction: Tensor  # [B, H, Q]
    static_weights: Tensor  # [B, S]
    encoder_weights: Tensor  # [B, L, V_enc]
    decoder_weights: Tensor  # [B, H, V_dec]
    attention: Tensor  # [B, heads, H, L + H], decoder queries over all positions


class TemporalFusionTransformer(nn.Module):
    """Multi-horizon quantile forecaster: static encoders, variable selection, LSTM seq2seq, interpretable attention.

    Encoder variables are the F observed past inputs plus (``add_relative_time``) the relative time index; decoder
    variables are the K known-future inputs plus the relative time index. The static input is the symbol embedding.
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
            self.n_encoder_variables, hidden_continuous_size, d, d, dropout, continuous=True
        )
        self.decoder_selection = VariableSelectionNetwork(
            self.n_decoder_variables, hidden_continuous_size, d, d, dropout, continuous=True
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
        self.register_buffer("causal_mask", _decoder_causal_mask(lookback, horizon), persistent=False)

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
        enc_out, state = self.lstm_encoder(past, (h0, c0))
        dec_out, _ = self.lstm_decoder(future.to(enc_out.dtype), state)
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
        prediction = self.quantile_head(decoded)
        return TFTOutput(prediction, static_weights, encoder_weights, decoder_weights, attention)


def _decoder_causal_mask(lookback: int, horizon: int) -> Tensor:
    """[H, L+H] True where decoder step i (position L+i) would see a later position j > L+i."""
    return torch.ones(horizon, lookback + horizon, dtype=torch.bool).triu(diagonal=lookback + 1)
