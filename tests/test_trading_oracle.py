"""Oracle policies: the hindsight DP is optimal (brute force), the Markov oracle beats the myopic one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from foxhunt.evaluation.trading import trading_metrics
from foxhunt.trading.oracle import oracle_positions

ACTIONS = torch.tensor([-1.0, 0.0, 1.0])


def expected_total(pos: torch.Tensor, m: torch.Tensor, cost: float, reset: torch.Tensor | None = None) -> float:
    prev = torch.cat([torch.zeros(1), pos[:-1].float()])
    if reset is not None:
        prev = torch.where(reset, torch.zeros_like(prev), prev)
    return float((pos.double() * m.double() - cost * (pos - prev).abs().double()).sum())


def test_hindsight_dp_is_the_brute_force_optimum() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        m = torch.randn(7, generator=g, dtype=torch.float64) * 1e-4
        cost_bps = 1.5
        pos = oracle_positions(m, ACTIONS, cost_bps, kind="hindsight")
        best = max(
            expected_total(torch.tensor(seq, dtype=torch.float32), m, cost_bps * 1e-4)
            for seq in itertools.product([-1.0, 0.0, 1.0], repeat=7)
        )
        assert abs(expected_total(pos, m, cost_bps * 1e-4) - best) < 1e-12, trial


def test_hindsight_respects_decision_mask_and_resets() -> None:
    m = torch.tensor([5e-4, 5e-4, 5e-4, 5e-4, 5e-4, 5e-4], dtype=torch.float64)
    decision = torch.tensor([True, True, False, True, True, True])
    reset = torch.tensor([True, False, False, False, True, False])
    pos = oracle_positions(m, ACTIONS, 1.0, decision=decision, reset=reset, kind="hindsight")
    assert pos.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    for kind in ("markov", "myopic"):
        p = oracle_positions(m, ACTIONS, 1.0, decision=decision, reset=reset, kind=kind)
        assert p[2] == 0.0


def ar1_expected(n: int, phi: float, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    r = np.zeros(n)
    e = rng.standard_normal(n) * 1e-3 * np.sqrt(1 - phi * phi)
    for t in range(1, n):
        r[t] = phi * r[t - 1] + e[t]
    return torch.from_numpy(phi * np.concatenate([[0.0], r[:-1]]))


def test_markov_oracle_beats_myopic_and_is_causal() -> None:
    m = ar1_expected(40_000, 0.3)
    cost = 1.0
    totals = {
        kind: expected_total(oracle_positions(m, ACTIONS, cost, kind=kind), m, cost * 1e-4)
        for kind in ("myopic", "markov", "hindsight")
    }
    assert totals["markov"] > totals["myopic"] > 0
    assert totals["hindsight"] >= totals["markov"]
    # Causal: a decision at t reads m up to t only (the Markov oracle's continuation table is a property of the
    # generator, estimated on the whole sequence, so the per-bar causality is checked on the myopic rule).
    pos = oracle_positions(m, ACTIONS, cost, kind="myopic")
    m2 = m.clone()
    m2[20_001:] = m2[20_001:].flip(0)
    assert torch.equal(oracle_positions(m2, ACTIONS, cost, kind="myopic")[:20_001], pos[:20_001])


def test_no_signal_means_no_trading() -> None:
    m = torch.zeros(1000, dtype=torch.float64)
    for kind in ("markov", "myopic", "hindsight"):
        assert (oracle_positions(m, ACTIONS, 1.0, kind=kind) == 0).all()


def test_myopic_matches_a_loop() -> None:
    m = ar1_expected(500, 0.3, seed=2)
    pos = oracle_positions(m, ACTIONS, 1.0, kind="myopic")
    held = 0.0
    for t in range(500):
        scores = [a * float(m[t]) - 1e-4 * abs(a - held) for a in (-1.0, 0.0, 1.0)]
        held = (-1.0, 0.0, 1.0)[int(np.argmax(scores))]
        assert pos[t] == held


def exact_total(seq: np.ndarray, r: np.ndarray, cost: float) -> float:
    """The back-test's total log return of positions ``seq`` on realised log returns ``r`` (independent numpy)."""
    prev = np.concatenate([[0.0], seq[:-1]])
    return float((np.log1p(seq * np.expm1(r)) + np.log1p(-cost * np.abs(seq - prev))).sum())


def test_exact_hindsight_on_realised_returns_is_the_brute_force_optimum_of_the_back_test() -> None:
    """``exact=True`` scores realised log returns as the back-test does, so hindsight is the true best sequence."""
    actions = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])
    rng = np.random.default_rng(4)
    seqs = np.array(list(itertools.product(actions.tolist(), repeat=6)))
    for trial in range(6):
        r = rng.normal(0.0, 0.15, 6)
        best = max(exact_total(seq, r, 2e-3) for seq in seqs)
        pos = oracle_positions(torch.from_numpy(r), actions, 20.0, kind="hindsight", exact=True).double()
        assert exact_total(pos.numpy(), r, 2e-3) == pytest.approx(best, abs=1e-12), trial
        total = trading_metrics(pos, torch.from_numpy(r), 20.0, 252.0).total_log_return.item()
        assert total == pytest.approx(best, abs=1e-12)


def test_linear_hindsight_keeps_a_short_the_exact_one_lightens() -> None:
    """Short through a +9.5% bar between two -30% bars at 5% costs: the linear reward (-r) says the short costs less
    than the round trip (0.095 < 2 x 0.05); exactly, log(2 - e^0.095) = -0.105 is worse, and lightening pays."""
    actions = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])
    r = np.array([-0.3, 0.095, -0.3])
    linear = oracle_positions(torch.from_numpy(r), actions, 500.0, kind="hindsight").double().numpy()
    exact = oracle_positions(torch.from_numpy(r), actions, 500.0, kind="hindsight", exact=True).double().numpy()
    assert linear.tolist() == [-1.0, -1.0, -1.0]
    best = max(exact_total(np.array(seq), r, 0.05) for seq in itertools.product(actions.tolist(), repeat=3))
    assert exact.tolist() != linear.tolist()
    assert exact_total(exact, r, 0.05) == pytest.approx(best, abs=1e-12)
    assert best > exact_total(linear, r, 0.05) + 1e-3
