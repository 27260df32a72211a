"""The loop-free rollout of a policy table equals the bar-by-bar chain p_t = table[t, p_{t-1}]."""

from __future__ import annotations

import torch

from foxhunt.trading.policy_table import rollout_policy_table


def test_rollout_policy_table_matches_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 64, 1000):
        table = torch.randint(0, 4, (n, 4), generator=g)
        p, ref = 2, []
        for t in range(n):
            p = int(table[t, p])
            ref.append(p)
        assert rollout_policy_table(table, 2).tolist() == ref
