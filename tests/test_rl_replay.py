"""Replay ring buffer: wrap-around, n-step returns against a brute-force reference, exact state restore."""

from __future__ import annotations

import pytest
import torch

from foxhunt.rl.replay import ReplayBuffer


def fill(buf: ReplayBuffer, steps: int, n_envs: int, episode: int = 5, start: int = 0) -> list[dict]:
    """Deterministic transitions: agent e at step k sits at bar 1000·e + k, episodes end every ``episode`` steps."""
    log = []
    for k in range(start, start + steps):
        bars = torch.arange(n_envs) * 1000 + k
        pos = torch.full((n_envs,), k % 3)
        act = torch.full((n_envs,), (k + 1) % 3)
        rew = torch.arange(n_envs).float() + 0.01 * k
        last = torch.full((n_envs,), (k + 1) % episode == 0)
        buf.add(bars, pos, act, rew, last)
        log.append({"bars": bars, "pos": pos, "act": act, "rew": rew, "last": last})
    return log


def test_capacity_and_wraparound_keep_the_latest() -> None:
    buf = ReplayBuffer(capacity=4 * 10 + 3, n_envs=4)
    assert buf.capacity == 40 and buf.n_slots == 10
    fill(buf, 25, 4)
    assert len(buf) == 40
    s = buf.sample(5000)
    k = s.bars % 1000
    assert int(k.min()) >= 15 and int(k.max()) <= 24  # only the last 10 steps remain
    assert set((s.bars // 1000).tolist()) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="at least one step"):
        ReplayBuffer(capacity=3, n_envs=4)


def test_one_step_sample_is_consistent() -> None:
    buf = ReplayBuffer(capacity=400, n_envs=4)
    fill(buf, 30, 4)
    s = buf.sample(256, gamma=0.9)
    k = s.bars % 1000
    e = s.bars // 1000
    assert torch.equal(s.positions, k % 3) and torch.equal(s.actions, (k + 1) % 3)
    assert torch.allclose(s.returns, e.float() + 0.01 * k.float())
    assert torch.equal(s.next_bars, s.bars + 1) and torch.equal(s.next_positions, s.actions)
    assert torch.allclose(s.discounts, torch.full_like(s.discounts, 0.9))


@pytest.mark.parametrize("n_step", [2, 3, 7])
def test_n_step_returns_match_brute_force(n_step: int) -> None:
    gamma, episode, n_envs = 0.8, 5, 3
    buf = ReplayBuffer(capacity=n_envs * 12, n_envs=n_envs)
    log = fill(buf, 40, n_envs, episode)  # wraps around several times
    s = buf.sample(2000, n_step=n_step, gamma=gamma)
    stored = {int(step["bars"][e]): (i, e) for i, step in enumerate(log[-12:]) for e in range(n_envs)}
    latest = log[-12:]
    for j in range(s.bars.shape[0]):
        i, e = stored[int(s.bars[j])]
        assert i + n_step <= len(latest)  # the whole n-step chain is stored
        ret, disc = 0.0, 1.0
        for k in range(n_step):
            step = latest[i + k]
            ret += disc * float(step["rew"][e])
            disc *= gamma
            if bool(step["last"][e]):
                break
        assert float(s.returns[j]) == pytest.approx(ret, rel=1e-5)
        assert float(s.discounts[j]) == pytest.approx(disc, rel=1e-5)
        assert int(s.next_bars[j]) == int(latest[i + k]["bars"][e]) + 1
        assert int(s.next_positions[j]) == int(latest[i + k]["act"][e])


def test_state_dict_restores_contents_and_rng() -> None:
    a = ReplayBuffer(capacity=64, n_envs=4, seed=5)
    fill(a, 20, 4)
    a.sample(8)
    state = a.state_dict()
    b = ReplayBuffer(capacity=64, n_envs=4, seed=123)
    b.load_state_dict(state)
    fill(a, 3, 4, start=20)
    fill(b, 3, 4, start=20)
    sa, sb = a.sample(32, n_step=2), b.sample(32, n_step=2)
    for f in ("bars", "positions", "actions", "returns", "next_bars", "discounts"):
        assert torch.equal(getattr(sa, f), getattr(sb, f)), f
    with pytest.raises(ValueError, match="shape"):
        ReplayBuffer(capacity=128, n_envs=4).load_state_dict(state)


def test_sampling_needs_enough_steps() -> None:
    buf = ReplayBuffer(capacity=64, n_envs=4)
    fill(buf, 2, 4)
    with pytest.raises(ValueError, match="needs at least 3"):
        buf.sample(4, n_step=3)
