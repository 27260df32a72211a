"""Deterministic policies given as a table of the next position for every bar and held position, rolled out over a
whole split without a Python loop over bars: the oracle, the greedy agents and the forecast policy share it."""

from __future__ import annotations

import torch
from torch import Tensor


def rollout_policy_table(table: Tensor, initial: int) -> Tensor:
    """Positions of a deterministic policy given as a table: p_t = table[t, p_{t-1}], p_{-1} = ``initial``.

    The sequential chain is evaluated as a parallel prefix composition of the per-bar maps (Hillis-Steele, log2 T
    gathers over [T, A]), so a policy over a whole split runs without a Python loop over bars. Resets (a flat
    position coming into a bar) are expressed in the table itself: make that bar's row constant.
    """
    comp = table.clone()
    n = comp.shape[0]
    d = 1
    while d < n:
        # comp[t] maps p_{t-d'-1} -> p_t for a span d'; compose with comp[t-d] to double the span.
        comp = torch.cat([comp[:d], torch.gather(comp[d:], 1, comp[:-d])], 0)
        d *= 2
    return comp[:, initial]
