"""The vectorised market environment: gathers, rewards, episode bounds, no lookahead, exact state restore."""

from __future__ import annotations

import pytest
import torch

from foxhunt.data.market import MarketSplit
from foxhunt.rl.env import (
    MarketEnv,
    MarketTensors,
    greedy_positions,
    greedy_table,
    rollout_policy_table,
)


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


def test_rewards_follow_the_formula_and_all_actions_agree() -> None:
    split = make_split()
    m = MarketTensors(split, window=4, actions=(-1.0, 0.0, 0.5, 1.0), cost_bps=2.0, reward_scale=10.0)
    bars = torch.tensor([10, 20, 30])
    held = torch.tensor([0, 1, 3])
    act = torch.tensor([3, 1, 2])
    r = split.returns[bars]
    new, old = m.actions[act], m.actions[held]
    expected = 10.0 * (new * r - 2e-4 * (new - old).abs())
    assert torch.allclose(m.rewards(bars, held, act), expected)
    assert torch.allclose(m.raw_rewards(bars, held, act), expected / 10.0)
    every = m.rewards_all(bars, held)
    assert torch.allclose(every.gather(1, act.unsqueeze(1)).squeeze(1), expected)
    assert m.flat_index == 1


def test_targets_reward_source_scales_costs() -> None:
    split = make_split()
    split.targets = split.returns * 1000.0
    m = MarketTensors(split, window=4, reward_source="targets", cost_bps=1.0)
    assert m.signal_cost == pytest.approx(1e-4 * 1000.0, rel=1e-4)
    bars, held, act = torch.tensor([10]), torch.tensor([1]), torch.tensor([2])
    assert torch.allclose(m.rewards(bars, held, act), 1000.0 * m.raw_rewards(bars, held, act), rtol=1e-4)


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


def test_rollout_policy_table_matches_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 64, 1000):
        table = torch.randint(0, 4, (n, 4), generator=g)
        p, ref = 2, []
        for t in range(n):
            p = int(table[t, p])
            ref.append(p)
        assert rollout_policy_table(table, 2).tolist() == ref


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
