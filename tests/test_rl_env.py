"""The vectorised market environment: gathers, rewards, episode bounds, no lookahead, exact state restore."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foxhunt.data.market import MarketSplit
from foxhunt.evaluation.trading import trading_metrics
from foxhunt.rl.env import (
    ContinuousMarketEnv,
    MarketEnv,
    MarketTensors,
    greedy_positions,
    greedy_table,
)
from foxhunt.trading.pnl import strategy_log_returns


def make_split(lengths: tuple[int, ...] = (300, 200), n_features: int = 3, seed: int = 0) -> MarketSplit:
    """Several symbols back to back, random features and returns; the last bar of each symbol has no return."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    sym = torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)]).long()
    rets = torch.randn(n, generator=g) * 1e-3
    ends = torch.cumsum(torch.tensor(lengths), 0) - 1
    rets[ends] = float("nan")
    feats = torch.randn(n, n_features, generator=g)
    valid = torch.isfinite(rets)
    valid[5] = False  # an invalid bar inside the first symbol
    return MarketSplit(
        name="unit", symbols=[f"S{i}" for i in range(len(lengths))],
        timestamps=torch.arange(n, dtype=torch.int64) * 60_000_000_000, symbol_index=sym,
        ohlcv=torch.ones(n, 5, dtype=torch.float64), returns=rets, targets=rets.clone(), valid=valid,
        features=feats, feature_names=[f"f{i}" for i in range(n_features)],
    )


def test_decision_bars_respect_window_symbols_and_validity() -> None:
    split = make_split()
    m = MarketTensors(split, window=4)
    d = m.decision
    assert not d[:3].any() and d[3:5].all() and not d[5]  # window warm-up, then the invalid bar
    assert not d[299] and not d[300:303].any() and d[303]  # no return at the symbol's end; new symbol warms up
    assert not d[-1]


def test_non_finite_features_anywhere_in_the_window_block_decisions() -> None:
    split = make_split()
    split.features[50, 1] = float("nan")
    d = MarketTensors(split, window=4).decision
    assert d[49] and not d[50:54].any() and d[54]


def test_window_gather_is_the_past_only() -> None:
    split = make_split()
    m = MarketTensors(split, window=4)
    bars = torch.tensor([3, 10, 303, 400])
    w = m.windows(bars)
    for i, t in enumerate(bars.tolist()):
        assert torch.equal(w[i], split.features[t - 3 : t + 1])
    # Perturbing everything after bar t (features and returns) leaves the observation at t unchanged.
    t = 150
    fut = make_split()
    fut.features[t + 1 :] += 100.0
    fut.returns[t:] *= -7.0
    m2 = MarketTensors(fut, window=4)
    assert torch.equal(m2.windows(torch.tensor([t])), m.windows(torch.tensor([t])))


def test_rewards_are_exact_log_returns_and_all_actions_agree() -> None:
    """Raw and training rewards (source "returns") are log1p(w (e^r - 1)) + log1p(-c |Δw|), not w r - c |Δw|."""
    split = make_split()
    bars = torch.tensor([10, 20, 30, 40])
    split.returns[bars] = torch.tensor([0.05, -0.04, 0.03, 0.02])  # moves large enough to tell the forms apart
    acts = (-1.0, 0.0, 0.5, 1.0)
    m = MarketTensors(split, window=4, actions=acts, cost_bps=20.0, reward_scale=10.0)
    held = torch.tensor([0, 1, 3, 2])
    act = torch.tensor([2, 0, 0, 3])
    r = split.returns[bars].double().numpy()
    new, old = np.array(acts)[act.numpy()], np.array(acts)[held.numpy()]
    exact = np.log1p(new * np.expm1(r)) + np.log1p(-2e-3 * np.abs(new - old))
    np.testing.assert_allclose(m.raw_rewards(bars, held, act).double().numpy(), exact, rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(m.rewards(bars, held, act).double().numpy(), 10.0 * exact, rtol=2e-6, atol=1e-8)
    every = m.rewards_all(bars, held)  # [B, A], every action's reward from the held position
    r_all = np.log1p(np.outer(np.expm1(r), acts)) + np.log1p(-2e-3 * np.abs(np.array(acts)[None] - old[:, None]))
    np.testing.assert_allclose(every.double().numpy(), 10.0 * r_all, rtol=2e-6, atol=1e-8)
    assert torch.equal(every.gather(1, act.unsqueeze(1)).squeeze(1), m.rewards(bars, held, act))
    assert m.flat_index == 1
    # the continuous form (position values) is the same function
    vals = torch.tensor(new, dtype=torch.float32)
    prior = torch.tensor(old, dtype=torch.float32)
    torch.testing.assert_close(m.raw_position_rewards(bars, prior, vals), m.raw_rewards(bars, held, act))
    torch.testing.assert_close(m.position_rewards(bars, prior, vals), m.rewards(bars, held, act))
    # what the environments' steps call: both at once, the same values
    for both, one in ((m.step_rewards(bars, held, act), (m.rewards(bars, held, act), m.raw_rewards(bars, held, act))),
                      (m.step_position_rewards(bars, prior, vals),
                       (m.position_rewards(bars, prior, vals), m.raw_position_rewards(bars, prior, vals)))):
        torch.testing.assert_close(both, one, rtol=0, atol=0)


def test_targets_reward_source_scales_costs() -> None:
    """Targets are a normalised surrogate, not a return: their training reward stays linear, costs converted."""
    split = make_split()
    split.targets = split.returns * 1000.0
    m = MarketTensors(split, window=4, reward_source="targets", cost_bps=1.0)
    assert m.signal_cost == pytest.approx(1e-4 * 1000.0, rel=1e-4)
    bars, held, act = torch.tensor([10]), torch.tensor([1]), torch.tensor([2])
    assert torch.allclose(m.rewards(bars, held, act), 1000.0 * m.raw_rewards(bars, held, act), rtol=1e-4)
    bars, held, act = torch.tensor([10, 11]), torch.tensor([2, 1]), torch.tensor([0, 0])
    tgt = split.targets[bars]
    linear = -tgt - m.signal_cost * (m.actions[act] - m.actions[held]).abs()
    torch.testing.assert_close(m.rewards(bars, held, act), linear)
    torch.testing.assert_close(m.rewards_all(bars, held)[:, 0], linear)
    torch.testing.assert_close(m.position_rewards(bars, m.actions[held], m.actions[act]), linear)
    torch.testing.assert_close(m.step_rewards(bars, held, act)[0], linear)
    torch.testing.assert_close(m.step_position_rewards(bars, m.actions[held], m.actions[act])[0], linear)
    # the raw reward is still the exact log return of the short
    r = split.returns[bars].double()
    want = torch.log(2.0 - torch.exp(r)) + torch.log1p(-1e-4 * (m.actions[act] - m.actions[held]).abs().double())
    torch.testing.assert_close(m.raw_rewards(bars, held, act).double(), want, rtol=1e-6, atol=1e-9)


def test_episodes_stay_inside_one_symbol_and_start_flat() -> None:
    split = make_split()
    m = MarketTensors(split, window=4)
    env = MarketEnv(m, n_envs=64, episode_length=40, seed=1)
    g = torch.Generator().manual_seed(0)
    seen_last = 0
    prev_bars = env.bars.clone()
    for _ in range(200):
        bars = env.bars.clone()
        assert m.decision[bars].all()
        tr = env.step(torch.randint(0, 3, (64,), generator=g))
        assert torch.equal(tr.bars, bars)
        cont = ~tr.last
        assert torch.equal(env.bars[cont], bars[cont] + 1)  # time advances one bar inside an episode
        assert m.decision[bars[tr.last] + 1].all()  # the bootstrap state after an episode end is valid
        assert (env.positions[tr.last] == m.flat_index).all() and (env.steps[tr.last] == 0).all()
        assert (m.symbol_index[env.bars[cont]] == m.symbol_index[bars[cont]]).all()
        seen_last += int(tr.last.sum())
        prev_bars = bars
    assert seen_last > 64  # episodes ended and restarted
    assert prev_bars.shape == (64,)
    with pytest.raises(ValueError, match="too long"):
        MarketEnv(m, n_envs=4, episode_length=400)


def test_env_state_dict_restores_exactly() -> None:
    m = MarketTensors(make_split(), window=4)
    a = MarketEnv(m, n_envs=16, episode_length=30, seed=3)
    acts = torch.randint(0, 3, (50, 16), generator=torch.Generator().manual_seed(0))
    for i in range(20):
        a.step(acts[i])
    state = a.state_dict()
    b = MarketEnv(m, n_envs=16, episode_length=30, seed=99)
    b.load_state_dict(state)
    for i in range(20, 50):
        ta, tb = a.step(acts[i]), b.step(acts[i])
        assert torch.equal(ta.bars, tb.bars) and torch.equal(ta.rewards, tb.rewards) and torch.equal(ta.last, tb.last)


def test_greedy_positions_equal_a_sequential_rollout() -> None:
    split = make_split()
    m = MarketTensors(split, window=4)
    net = torch.nn.Linear(4 * 3 + 3, 3)

    def q_fn(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return net(torch.cat([w.flatten(1), p], 1))

    with torch.no_grad():
        pos = greedy_positions(q_fn, m, chunk=97)
        table = greedy_table(q_fn, m)
        held = m.flat_index
        for t in range(m.n_bars):
            if m.reset_mask[t]:
                held = m.flat_index
            if m.decision[t]:
                q = q_fn(m.windows(torch.tensor([t])), m.position_features(torch.tensor([held])))
                held = int(q.argmax(1))
            else:
                held = m.flat_index
            assert table[t, :].ge(0).all()
            assert m.actions[held] == pos[t], t


def episode_paths(env: MarketEnv, actions: list[torch.Tensor]) -> list[tuple[list[int], list[float], list[float]]]:
    """Step ``env`` through ``actions``; per completed-or-running episode of agent 0..N-1: (bars, positions, raw)."""
    n = env.n_envs
    current: list[tuple[list[int], list[float], list[float]]] = [([], [], []) for _ in range(n)]
    done = []
    for a in actions:
        tr = env.step(a)
        taken = tr.actions if tr.actions.is_floating_point() else env.market.actions[tr.actions]
        for i in range(n):
            current[i][0].append(int(tr.bars[i]))
            current[i][1].append(float(taken[i]))
            current[i][2].append(float(tr.raw_rewards[i]))
            if tr.last[i]:
                done.append(current[i])
                current[i] = ([], [], [])
    return done + [c for c in current if c[0]]


@pytest.mark.parametrize("continuous", [False, True])
def test_env_raw_rewards_are_the_back_tests_per_bar_log_returns(continuous: bool) -> None:
    """A rollout's raw rewards equal trading.py's per-bar strategy log returns of the same positions on the same bars,
    and an episode's sum equals the back-test's total log return (the log of its wealth multiple)."""
    split = make_split()
    split.returns = split.returns * 30.0  # daily-sized moves (~3%): the linear form would be visibly off
    m = MarketTensors(split, window=4, actions=(-1.0, -0.5, 0.0, 0.5, 1.0), cost_bps=10.0)
    cls = ContinuousMarketEnv if continuous else MarketEnv
    env = cls(m, n_envs=6, episode_length=25, seed=2)
    g = torch.Generator().manual_seed(5)
    steps = [torch.rand(6, generator=g) * 2 - 1 if continuous else torch.randint(0, 5, (6,), generator=g)
             for _ in range(60)]
    episodes = episode_paths(env, steps)
    assert len(episodes) >= 12
    for bars, positions, raw in episodes:
        assert bars == list(range(bars[0], bars[0] + len(bars)))  # one run of consecutive bars, starting flat
        pos = torch.tensor(positions, dtype=torch.float64)
        ret = split.returns[bars].double()
        want = strategy_log_returns(pos, ret, 10.0)
        np.testing.assert_allclose(raw, want.numpy(), rtol=1e-5, atol=2e-8)
        total = trading_metrics(pos, ret, 10.0, 252.0).total_log_return.item()
        assert math.fsum(raw) == pytest.approx(total, rel=1e-5, abs=1e-7)
        linear = float((pos * ret).sum() - 1e-3 * position_changes_sum(pos))
        shorts = bool((pos < 0).any())
        assert not shorts or abs(linear - total) > 1e-6  # what the old linear reward would have said instead


def position_changes_sum(pos: torch.Tensor) -> float:
    return float((pos - torch.cat([pos.new_zeros(1), pos[:-1]])).abs().sum())


def single_symbol_split(n: int = 200, n_features: int = 3, seed: int = 0) -> MarketSplit:
    """One symbol of random features and returns; its last bar has no return."""
    g = torch.Generator().manual_seed(seed)
    rets = torch.randn(n, generator=g) * 1e-2
    rets[-1] = float("nan")
    return MarketSplit(
        name="unit", symbols=["S0"], timestamps=torch.arange(n, dtype=torch.int64) * 60_000_000_000,
        symbol_index=torch.zeros(n, dtype=torch.int64), ohlcv=torch.ones(n, 5, dtype=torch.float64), returns=rets,
        targets=rets.clone(), valid=torch.isfinite(rets), features=torch.randn(n, n_features, generator=g),
        feature_names=[f"f{i}" for i in range(n_features)],
    )


def test_an_action_set_without_flat_is_refused() -> None:
    """Episodes start flat and the back-test holds no position before the first bar. Without a 0 action the env took
    the action nearest 0 as "flat": with actions (-1, 1) every episode began short for free, so the first step's
    reward (cost measured from -1) was not the back-test's P&L of the same positions (cost measured from 0)."""
    split = single_symbol_split()
    with pytest.raises(ValueError, match="flat"):
        MarketTensors(split, window=4, actions=(-1.0, 1.0), cost_bps=10.0)
    with pytest.raises(ValueError, match="flat"):
        MarketTensors(split, window=4, actions=(-0.5, 0.5, 1.0))
    # with a flat action (anywhere in the tuple) the first step's raw reward is the back-test's, entry cost included
    m = MarketTensors(split, window=4, actions=(1.0, 0.0), cost_bps=10.0)
    assert m.flat_index == 1
    env = MarketEnv(m, n_envs=8, episode_length=10, seed=0)
    env.steps.zero_()  # every agent at the start of an episode
    bars = env.bars.clone()
    tr = env.step(torch.zeros(8, dtype=torch.int64))  # go long
    want = strategy_log_returns(torch.ones(8, 1), split.returns[bars].unsqueeze(1), 10.0).squeeze(1)
    torch.testing.assert_close(tr.raw_rewards, want.float(), rtol=1e-5, atol=1e-8)
