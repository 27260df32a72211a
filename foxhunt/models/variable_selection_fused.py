"""The fused path of the TFT's variable selection (``VariableSelectionNetwork(fused=True)``, the default).

Same function and parameters as the reference path (``fused=False``: explicit embeddings, the batched grouped GRNs of
``GroupedGatedResidualNetwork``, a weighted sum over variables), computed another way; tests hold the two equal in
values and gradients. Shapes: N rows (batch x time), V variables, e ``input_size`` (the variables' embedding width),
h the per-variable GRNs' hidden width (``min(e, d)``), d ``hidden_size``.

1. A continuous variable's embedding x_v Ew_v + Eb_v is affine in its scalar, so every linear layer that reads
   embeddings (the scoring GRN's fc2 and skip, each per-variable GRN's fc2 and skip) is composed with it on the fly:
   the [N, V, e] embeddings never exist, on any device.
2. The per-variable GRNs and their selection-weighted sum run as one autograd Function, ``ChunkedVariableGRNs``,
   over chunks of R rows on a variable-major layout (grouped matrix products, never a Python loop over variables).
   Backward applies the chain rule by hand. Between forward and backward autograd keeps O(V N): the inputs and
   selection weights [V, N], each pair's LayerNorm mean and 1/std ([V, N] each), the composed parameters and, with
   dropout on, the sorted positions of the drops (int64, about p V N h of them). Each chunk's activations (ELU
   output, eta1, GLU: V N (2h + 2 + 2d) floats in all) are kept too when they fit in ``keep_bytes``
   (``VariableSelectionNetwork.keep_bytes``, 512 MiB by default: ~400 MiB with ~125 inputs at batch 128 x 64 bars,
   20 MiB with 5), and recomputed chunk by chunk in backward otherwise (about a fifth of the time at ~125 inputs).

What one chunk allocates, forward: the first layer [V, R, h] (and a same-sized temporary inside the ELU), the ELU
output and eta1 [V, R, h+1] each (a constant-1 column carries the biases), the GLU [V, R, 2d] and the pre-norm sum
[V, R, d]; the drops are zeroed in eta1 in place (their 1/(1-p) rides on the GLU weights). Backward adds LN(z) and
its gradient [V, R, d] each, d eta1 [V, R, h] and d fc2 [V, R, h+1].

- CPU: R = min(N, max(1, ``pairs_per_chunk`` // V)) (8192 (row, variable) pairs by default), so a chunk's buffers stay
  in cache; with ``keep_bytes=0`` nothing of size [V, N, h] or [V, N, d] is allocated (the largest whole-batch
  tensors are [V, 3, N] in backward and the output [N, d]). Kept activations are written chunk by chunk and read
  back once in backward.
- CUDA (any device but the CPU): R = N, one chunk, so every buffer above is allocated at full size, [V, N, h],
  [V, N, h+1], [V, N, 2d] and [V, N, d], in forward (and, when not kept, again in backward). Only kept activations
  outlive a pass. The reference path keeps every layer's [N, V, *] activations and dropout masks from forward to
  backward.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from foxhunt.models.tft import VariableSelectionNetwork


def fused_variable_selection(
    vsn: VariableSelectionNetwork, x: Tensor, context: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``vsn`` on continuous inputs x [..., V] -> ([..., d], weights [..., V]), without materialising embeddings.

    The same function as ``vsn.forward_embedded(vsn.embed(x), context)``.
    """
    lead = x.shape[:-1]
    v = vsn.n_variables
    flat_x = x.reshape(-1, v)  # [N, V]
    ctx = None if context is None else _flatten_context(context, lead)
    weights = selection_weights(vsn, flat_x, ctx)  # [N, V]
    # Per-variable GRNs, variable-major: first layer and skip are rank-1 in the scalar x_v.
    g = vsn.variable_grns
    a2 = torch.einsum("ve,veh->vh", vsn.embed_weight, g.fc2_weight)
    b2 = torch.einsum("ve,veh->vh", vsn.embed_bias, g.fc2_weight) + g.fc2_bias
    if g.skip_weight is not None:
        a_s = torch.einsum("ve,veo->vo", vsn.embed_weight, g.skip_weight)
        b_s = torch.einsum("ve,veo->vo", vsn.embed_bias, g.skip_weight) + g.skip_bias
    else:
        a_s, b_s = vsn.embed_weight, vsn.embed_bias
    p = g.dropout.p if g.training else 0.0
    glu_weight = g.glu_weight / (1.0 - p) if p > 0.0 else g.glu_weight  # dropout's 1/(1-p) moved onto W_glu
    n = flat_x.shape[0]
    rows = min(n, max(1, vsn.pairs_per_chunk // v)) if x.device.type == "cpu" else n  # CUDA: one chunk
    params = (a2, b2, g.fc1_weight, g.fc1_bias, glu_weight, g.glu_bias, a_s, b_s, g.norm_weight, g.norm_bias)
    combined = _selected_variable_grns(flat_x.t(), weights.t(), params, p, rows, vsn.keep_bytes)
    return combined.reshape(*lead, vsn.hidden_size), weights.reshape(*lead, v)


def selection_weights(vsn: VariableSelectionNetwork, flat_x: Tensor, ctx: Tensor | None = None) -> Tensor:
    """The scoring GRN's softmax weights [N, V] (float32) of scalar inputs [N, V] and a flat context [N, c]."""
    # It reads concat_v(x_v * Ew_v + Eb_v): its fc2 and skip compose into [V, out] maps of the scalars.
    v, e = vsn.n_variables, vsn.input_size
    fg = vsn.flattened_grn
    w2 = fg.fc2.weight.view(fg.hidden_size, v, e)
    fc2_out = F.linear(
        flat_x,
        torch.einsum("hve,ve->hv", w2, vsn.embed_weight),
        fg.fc2.bias + torch.einsum("hve,ve->h", w2, vsn.embed_bias),
    )
    ws = fg.skip.weight.view(v, v, e) if fg.skip is not None else None
    residual = (
        F.linear(
            flat_x,
            torch.einsum("ove,ve->ov", ws, vsn.embed_weight),
            fg.skip.bias + torch.einsum("ove,ve->o", ws, vsn.embed_bias),
        )
        if ws is not None
        else vsn.embed(flat_x).flatten(-2)
    )
    return torch.softmax(fg.from_projections(fc2_out, residual, ctx).float(), dim=-1)


def _flatten_context(context: Tensor, lead: torch.Size) -> Tensor:
    """Broadcast a static context [B, d] over the time dims of ``lead`` ([B] or [B, T]) and flatten to [N, d]."""
    while context.dim() < len(lead) + 1:
        context = context.unsqueeze(1)
    return context.expand(*lead, context.shape[-1]).reshape(-1, context.shape[-1])


@torch.compiler.disable  # a loop over row chunks: compiling would unroll it, and it is already fused by hand
def _selected_variable_grns(
    x: Tensor, weights: Tensor, params: tuple[Tensor, ...], p: float, rows: int, keep_bytes: int
) -> Tensor:
    """sum_v weights[v, n] * GRN_v(x[v, n]) in float32 (autocast off: the GRNs end in a float32 LayerNorm anyway)."""
    with torch.autocast(x.device.type, enabled=False):
        x, weights = x.float().contiguous(), weights.float().contiguous()  # [V, N]: chunks are row slices
        return ChunkedVariableGRNs.apply(x, weights, p, rows, keep_bytes, *(t.float().contiguous() for t in params))


class ChunkedVariableGRNs(torch.autograd.Function):
    """Per-variable GRNs on scalar inputs and their selection-weighted sum, ``rows`` rows at a time.

    Each chunk's [V, rows, *] intermediates are reduced over variables at once; forward saves each pair's LayerNorm
    mean and 1/std ([V, N] each) and, when they fit in ``keep_bytes``, the chunks' activations up to the GLU (else
    backward recomputes them). Backward rebuilds the centred LayerNorm input (one product of (x, 1, -mean) with
    (a_s, b_s, 1) instead of the statistics' passes) and applies the chain rule by hand (the same maths as autograd
    through the layers, with the forward pass's dropout drops, kept as positions). Biases of fc1 and
    the GLU ride in their products on a constant-1 column. Parameters (variable-major): a2, b2 [V, h]
    (embedding composed with fc2), fc1 [V, h, h] and [V, h], glu [V, h, 2d] (already divided by 1-p) and [V, 2d],
    a_s, b_s [V, d] (embedding composed with skip), norm [V, d] x2.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, p: float, rows: int, keep_bytes: int, *params: Tensor) -> Tensor:  # type: ignore[override]
        """x [V, N] scalars, weights [V, N] -> [N, d]; activations kept for backward if they fit in ``keep_bytes``."""
        (v, n), h, d = x.shape, params[2].shape[-1], params[8].shape[-1]
        gamma, beta, a_s, b_s = params[8].unsqueeze(1), params[9], params[6].unsqueeze(1), params[7].unsqueeze(1)
        out = x.new_empty(n, d)
        mean, rstd = x.new_empty(v * n), x.new_empty(v * n)  # chunk r0:r1 at [v r0, v r1), variable-major
        avg = x.new_full((d, 1), 1.0 / d)
        drops = _chunk_drops(dropout_drops(v * n * h, p, x.device), v * h * rows) if p > 0.0 else None
        # Small problems keep each chunk's activations for backward instead of recomputing them there.
        keep = v * n * (2 * h + 2 + 2 * d) * x.element_size() <= keep_bytes
        chunks: list[tuple[Tensor, Tensor, Tensor]] = []
        aug, elu_buf = _augmented(params), _elu_buffer(x, v, rows, h)
        for c, r0 in enumerate(range(0, n, rows)):
            r1 = min(n, r0 + rows)
            wc, xc = weights[:, r0:r1], x[:, r0:r1].unsqueeze(-1)
            e_buf = _elu_buffer(x, v, r1 - r0, h) if keep else elu_buf
            act = _grn_chunk(xc, _chunk_drop_positions(drops, c), params, aug, e_buf)
            ab = act[-1]
            if keep:
                chunks.append(act)
            z = torch.addcmul(b_s, xc, a_s).addcmul_(ab[..., :d], ab[..., d:])  # skip(embed(x)) + GLU
            # LayerNorm statistics as matrix-vector products (two-pass: mean, then the centred variance), faster
            # than aten's layer_norm over a 32-wide last dim on CPU.
            flat = z.view(-1, d)
            mu, rs = mean[v * r0 : v * r1].view(-1, 1), rstd[v * r0 : v * r1].view(-1, 1)
            centred = flat.sub_(torch.mm(flat, avg, out=mu))
            square = torch.mul(centred, centred) if keep else torch.mul(centred, centred, out=ab.view(-1, 2 * d)[:, :d])
            torch.mm(square, avg, out=rs).add_(1e-5).rsqrt_()
            # sum_v w (LN(z) gamma + beta) = sum_v (centred * rstd * w) gamma + w^T beta
            scaled = z.mul_(rs.view(v, -1, 1) * wc.unsqueeze(-1)).mul_(gamma)
            torch.sum(scaled, 0, out=out[r0:r1])
        out.addmm_(weights.t(), beta)
        ctx.save_for_backward(x, weights, mean, rstd, *params)
        ctx.drops, ctx.rows = drops, rows
        ctx.chunks = chunks if keep else None  # intermediates, not inputs or outputs: held on ctx, used once
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        """Chain rule through each chunk's recomputed forward, in float32 like the forward: under manual
        optimisation Lightning runs backward inside the training step's autocast region."""
        saved = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            return ChunkedVariableGRNs._backward(ctx, grad_out.to(saved[0].dtype), saved)

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
        aug, elu_buf = _augmented(params), _elu_buffer(x, v, ctx.rows, h)
        chunks, ctx.chunks = ctx.chunks, None  # kept activations are consumed (in place): a second backward recomputes
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
            drop = _chunk_drop_positions(ctx.drops, c)
            e, eta, ab = chunks[c] if chunks is not None else _grn_chunk(xc, drop, params, aug, elu_buf)
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
            if drop is not None:
                deta.view(-1).index_fill_(0, drop, 0.0)
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
        return (dx, dweights, None, None, None, *grads)


def _elu_buffer(x: Tensor, v: int, rows: int, h: int) -> Tensor:
    """The ELU output of a chunk [V, rows, h+1], its constant-1 last column set (reused per chunk unless kept)."""
    e = x.new_empty(v, rows, h + 1)
    e[..., h] = 1.0
    return e


def _chunk_drops(drops: Tensor, per_chunk: int) -> tuple[Tensor, list[int], int]:
    """Sorted drop positions over chunks of ``per_chunk`` [V, rows, h] entries, each chunk's range in them, and
    ``per_chunk`` (a chunk's positions are its drops minus its first entry's)."""
    chunk_ends = torch.arange(per_chunk, int(drops[-1]) + per_chunk + 1 if len(drops) else 1, per_chunk)
    offsets = [0, *torch.searchsorted(drops, chunk_ends.to(drops.device)).tolist()]
    return drops, offsets, per_chunk


def _chunk_drop_positions(drops: tuple[Tensor, list[int], int] | None, c: int) -> Tensor | None:
    """Chunk c's drops as positions in its [V, r, h] entries (None: no dropout or no drop in this chunk)."""
    if drops is None:
        return None
    pos, offsets, per_chunk = drops
    if c + 1 >= len(offsets) or offsets[c + 1] == offsets[c]:
        return None
    return pos[offsets[c] : offsets[c + 1]] - c * per_chunk


def dropout_drops(n: int, p: float, device: torch.device) -> Tensor:
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
    """n independent Bernoulli(1-p) keeps as uint8 (1 = kept), from ``dropout_drops``."""
    keep = torch.ones(n, dtype=torch.uint8, device=device)
    keep[dropout_drops(n, p, device)] = 0
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
    xc: Tensor, drop: Tensor | None, params: tuple[Tensor, ...], aug: tuple[Tensor, Tensor], e_buf: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk of the per-variable GRNs up to the GLU, xc [V, R, 1] -> ([ELU, 1], [eta1, 1] (both [V, R, h+1]),
    [V, R, 2d] = [GLU value | sigmoid(GLU gate logit)]): biases ride in the products on the constant-1 column,
    one product gives both GLU halves, the gate's sigmoid runs in place, and the drops (positions in [V, R, h]) are
    zeroed in eta1 directly (their 1/(1-p) is on the GLU weights)."""
    a2, b2 = params[:2]
    w1_aug, wg_aug = aug
    r, h = xc.shape[1], a2.shape[-1]
    d = wg_aug.shape[-1] // 2
    f2 = torch.addcmul(b2.unsqueeze(1), xc, a2.unsqueeze(1))  # W2 embed(x) + b2, rank-1 in x
    e = e_buf[:, :r]
    torch.maximum(f2, f2.clamp(max=0.0).exp_().sub_(1.0), out=e[..., :h])  # ELU: max(x, e^min(x,0) - 1), 2x aten's
    eta = torch.bmm(e, w1_aug)  # [eta1, 1]
    if drop is not None:
        eta.view(-1).index_fill_(0, drop + drop.div(h, rounding_mode="floor"), 0.0)  # [V, R, h] -> [V, R, h+1]
    ab = torch.bmm(eta, wg_aug)
    ab[..., d:].sigmoid_()
    return e, eta, ab
