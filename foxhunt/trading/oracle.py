"""Oracle trading policies from the generator's conditional mean returns, the yardstick of the DQN's quality.

Given m_t = E[r_t | bars <= t] (the synthetic generator knows it exactly), the oracles score moving from position p
to a at bar t by a·m_t − c·|a − p|: the linear (first-order) approximation of the expected per-bar log return. The
exact per-bar log return the back-test counts is log1p(a·(e^r − 1)) + log1p(−c·|a − p|)
(:mod:`foxhunt.trading.pnl`), whose expectation also depends on the conditional variance of r (about
a·m + (a − a²)·σ²/2 − c·|a − p|), which the oracle is not given; so the oracles maximise the linear approximation,
and their positions are scored exactly, like every policy's, by :func:`~foxhunt.evaluation.trading.trading_metrics`.
For a ±1/0 action set and small per-bar returns the two differ by about σ² a bar for a short (and not at all for a
long), typically far below a planted signal's m. Three policies, all vectorised over bars:

- ``markov`` (the default, causal): the optimal policy of the MDP whose state is (m_t, p), assuming m is a Markov
  process. m is discretised into quantile bins, the bin-to-bin transition matrix is counted on the sequence itself
  (a property of the generator, which the oracle knows), and value iteration gives the continuation value C[bin, a];
  the decision at t uses the exact m_t for the immediate reward: argmax_a a·m_t − c·|a − p| + C[bin(m_t), a].
  Exact for a Markov signal up to the discretisation of the continuation value (for AR(1) returns, m_t = φ·r_{t−1}
  is Markov); for a non-Markov signal it is the best policy on this state summary.
- ``myopic`` (causal): the same without continuation value (one-bar greedy with a cost hurdle).
- ``hindsight`` (NOT causal, an upper bound): a backward dynamic programme over positions on the realised
  sequence of m, i.e. knowing future conditional means; computed as a max-plus parallel suffix scan.

``exact=True`` reads the signal as realised log returns r and uses the exact per-bar log return
log1p(a·expm1(r)) + log1p(−c·|a − p|) as the reward instead: with ``kind="hindsight"`` on a split's realised returns
the positions are then the best sequence of actions in hindsight by the back-test's own measure (its total log
return is the maximum over all such sequences). On a conditional mean it would have no meaning (E[log1p(a·(e^r − 1))]
is not log1p(a·(e^m − 1))), so the default stays linear.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from foxhunt.trading.pnl import cost_log_returns, log_growth
from foxhunt.trading.policy_table import rollout_policy_table

OracleKind = Literal["markov", "myopic", "hindsight"]


def _reward_matrices(expected: Tensor, actions: Tensor, cost: float, exact: bool = False) -> Tensor:
    """[T, P, A] reward of moving from position P to action A at each bar: linear a·m − c·|a − p|, or with ``exact``
    the exact log return log1p(a·expm1(r)) + log1p(−c·|a − p|) of a realised log return r."""
    a = actions.view(1, 1, -1)
    p = actions.view(1, -1, 1)
    if exact:
        return log_growth(a * torch.expm1(expected).view(-1, 1, 1)) + cost_log_returns((a - p).abs(), cost * 1e4)
    return a * expected.view(-1, 1, 1) - cost * (a - p).abs()


def _constrain(table: Tensor, decision: Tensor, reset: Tensor, flat: int) -> Tensor:
    """Flat at non-decision bars; a bar that starts a symbol sees a flat position coming in."""
    table = torch.where(decision.unsqueeze(1), table, torch.full_like(table, flat))
    return torch.where(reset.unsqueeze(1), table[:, flat : flat + 1].expand_as(table), table)


def oracle_positions(
    expected: Tensor,
    actions: Tensor,
    cost_bps: float,
    decision: Tensor | None = None,
    reset: Tensor | None = None,
    kind: OracleKind = "markov",
    gamma: float = 0.99,
    n_bins: int = 64,
    exact: bool = False,
) -> Tensor:
    """[T] positions (values from ``actions``) of the oracle policy; flat where ``decision`` is False.

    ``expected`` is m_t = E[r_t | bars <= t], scored linearly (the module docstring); with ``exact`` it is read as
    realised log returns and scored by the exact per-bar log return (meant for ``kind="hindsight"``)."""
    expected = expected.to(torch.float64)
    actions = actions.to(device=expected.device, dtype=torch.float64)
    n = expected.shape[0]
    if decision is None:
        decision = torch.isfinite(expected)
    decision = decision & torch.isfinite(expected)
    if reset is None:
        reset = torch.zeros(n, dtype=torch.bool, device=expected.device)
        reset[0] = True
    m = torch.where(decision, expected, torch.zeros_like(expected))
    flat = int(torch.argmin(actions.abs()))
    cost = cost_bps * 1e-4
    rewards = _reward_matrices(m, actions, cost, exact)
    if kind == "myopic":
        table = rewards.argmax(-1)
    elif kind == "markov":
        cont = _markov_continuation(m, decision, reset, actions, cost, gamma, n_bins, exact)
        table = (rewards + cont.unsqueeze(1)).argmax(-1)
    elif kind == "hindsight":
        table = _hindsight_table(rewards, decision, reset, flat)
    else:
        raise ValueError(f"oracle kind must be 'markov', 'myopic' or 'hindsight', got {kind!r}")
    table = _constrain(table, decision, reset, flat)
    return actions[rollout_policy_table(table, flat)].to(torch.float32)


def _markov_continuation(
    m: Tensor, decision: Tensor, reset: Tensor, actions: Tensor, cost: float, gamma: float, n_bins: int,
    exact: bool = False,
) -> Tensor:
    """[T, A] γ·E[V(m_{t+1}, a) | bin(m_t)] from value iteration on the binned Markov chain of m."""
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"oracle gamma must be in [0, 1), got {gamma}")
    dev = m.device
    qs = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=dev)[1:-1]
    edges = torch.quantile(m[decision], qs)
    bins = torch.bucketize(m, edges)  # [T] in 0..n_bins-1
    pair = decision[:-1] & decision[1:] & ~reset[1:]
    counts = torch.zeros(n_bins * n_bins, dtype=torch.float64, device=dev)
    counts.index_add_(0, (bins[:-1] * n_bins + bins[1:])[pair], torch.ones(int(pair.sum()), dtype=torch.float64, device=dev))
    counts = counts.view(n_bins, n_bins)
    transition = counts / counts.sum(1, keepdim=True).clamp_min(1.0)
    occupied = torch.zeros(n_bins, dtype=torch.float64, device=dev).index_add_(0, bins[decision], torch.ones_like(m[decision]))
    bin_mean = torch.zeros(n_bins, dtype=torch.float64, device=dev).index_add_(0, bins[decision], m[decision])
    bin_mean = bin_mean / occupied.clamp_min(1.0)
    r = _reward_matrices(bin_mean, actions, cost, exact)  # [K, P, A]
    v = torch.zeros(n_bins, actions.shape[0], dtype=torch.float64, device=dev)  # V[bin, held position]
    for _ in range(10_000):
        cont = gamma * transition @ v  # [K, A]: continuation after choosing a in bin k
        v_new = (r + cont.unsqueeze(1)).amax(-1)
        if float((v_new - v).abs().max()) < 1e-12:
            v = v_new
            break
        v = v_new
    cont = gamma * transition @ v
    return cont[bins]


def _hindsight_table(rewards: Tensor, decision: Tensor, reset: Tensor, flat: int) -> Tensor:
    """[T, P] argmax_a R_t[p, a] + V_{t+1}[a], with V the max-plus suffix products of the reward matrices."""
    n, n_act, _ = rewards.shape
    # Only "go flat" is allowed at non-decision bars (its reward there is the cost of closing).
    mats = torch.where(decision.view(-1, 1, 1), rewards, torch.full_like(rewards, float("-inf")))
    mats[..., flat] = rewards[..., flat]
    # Segment of each bar: products never cross into the next symbol.
    seg = torch.cumsum(reset.long(), 0)
    suffix = mats.clone()
    d = 1
    while d < n:
        same = (seg[:-d] == seg[d:]).view(-1, 1, 1)
        prod = (suffix[:-d].unsqueeze(-1) + suffix[d:].unsqueeze(1)).amax(2)  # max-plus product [T-d, P, A]
        suffix = torch.cat([torch.where(same, prod, suffix[:-d]), suffix[-d:]], 0)
        d *= 2
    value = suffix.amax(-1)  # [T, P]: best total from bar t onward given position P coming in
    nxt = torch.zeros(n, n_act, dtype=rewards.dtype, device=rewards.device)
    cont = seg[1:] == seg[:-1]
    nxt[:-1] = torch.where(cont.view(-1, 1), value[1:], torch.zeros_like(value[1:]))
    return (mats + nxt.unsqueeze(1)).argmax(-1)
