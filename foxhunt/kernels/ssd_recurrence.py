"""The SSD of Mamba-2 step by step, in PyTorch: the ground truth the chunked scans (:mod:`foxhunt.models.mamba2`)
and the compiled loops (:mod:`foxhunt.kernels.mamba2_block`) are tested and checked against, and the recurrent form a
block runs bar by bar (``Mamba2Block.step``).

Per head and step, with a scalar-times-identity state matrix A < 0: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,
y_t = h_t C_t + D x_t (h_t [P, N]).
"""

from __future__ import annotations

import torch
from torch import Tensor


def ssd_step(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One step of the recurrence: h = exp(dt A) h + dt x B^T, y = h C + D x.

    Shapes: state [b, H, P, N], x [b, H, P], dt [b, H], A [H], B, C [b, G, N]. Returns (y [b, H, P], new state).
    """
    n_heads, g = x.shape[1], B.shape[1]
    B = B.repeat_interleave(n_heads // g, 1)
    C = C.repeat_interleave(n_heads // g, 1)
    decay = (dt * A).exp()[..., None, None]
    state = decay * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = (state @ C[..., None]).squeeze(-1)
    if D is not None:
        y = y + D[:, None] * x
    return y, state


def ssd_recurrent(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The SSD model step by step (the reference of the chunked scans and of the compiled loops), in the inputs' dtype.

    Shapes as :func:`foxhunt.models.mamba2.ssd_chunked`; returns (y [b, L, H, P], final state [b, H, P, N]).
    """
    b, length, n_heads, p = x.shape
    state = x.new_zeros(b, n_heads, p, B.shape[-1]) if initial_state is None else initial_state
    ys = []
    for t in range(length):
        y, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        ys.append(y)
    return torch.stack(ys, 1), state
