"""Issue 16: the task family, model selection on held-out data, early stopping, the regularisers and the coordinator's
do-no-harm rule (fixed seeds, small sizes; quality asserted, never timing)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foxhunt.models.qnet import QNetwork
from foxhunt.quality import agents as quality
from foxhunt.quality.agent_tasks import garch_ar1_returns, real_market, simple_features, task_market
from foxhunt.rl.env import MarketTensors
from foxhunt.trading.pnl import strategy_log_returns

SMALL = {
    "window": 8, "n_envs": 64, "episode_length": 64, "hidden": (64, 64), "batch_size": 64, "replay_capacity": 32_768,
    "learning_starts": 2048, "optim": {"lr": 1e-3}, "env_step_every": 2,
}


def test_task_market_is_causal_and_scored_on_train() -> None:
    r, m = garch_ar1_returns(2_000, 0.3, seed=0)
    assert np.isnan(m[0]) and np.allclose(m[1:], 0.3 * r[:-1])
    f = simple_features(r)
    bumped = r.copy()
    bumped[1000] += 1.0  # r[1000] = ln C[1001] - ln C[1000] is first known at bar 1001
    g = simple_features(bumped)
    assert np.array_equal(np.nan_to_num(f[:1001]), np.nan_to_num(g[:1001])) and not np.allclose(f[1001], g[1001])
    data = task_market(0.1, seed=1, n_bars=20_000)
    train = data.train.features[data.train.valid]
    assert torch.allclose(train.mean(0), torch.zeros(3), atol=0.05) and torch.allclose(train.std(0), torch.ones(3), atol=0.05)
    assert data.has_oracle and data.train.timestamps[-1] < data.val.timestamps[0] < data.test.timestamps[0]


def test_real_market_names_a_bad_row(tmp_path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("timestamp,close\n2020-01-01,1.0\n2020-01-02,-2.0\n")
    with pytest.raises(ValueError, match="row 3, field 'close'"):
        real_market(path)


def test_dropout_only_while_training() -> None:
    torch.manual_seed(0)
    net = QNetwork(3, 4, 3, 3, hidden=(16, 16), dropout=0.5)
    w, p = torch.randn(8, 4, 3), torch.eye(3)[torch.zeros(8, dtype=torch.int64)]
    assert not torch.equal(net(w, p), net(w, p))
    net.eval()
    assert torch.equal(net(w, p), net(w, p))


def t_stat(positions: torch.Tensor, market: MarketTensors) -> float:
    pnl = strategy_log_returns(positions, market.returns, market.cost_bps, market.reset_mask)[market.decision].double()
    return float(pnl.mean() / (pnl.std() / math.sqrt(pnl.numel())))


@pytest.fixture(scope="module")
def planted():
    return task_market(0.3, seed=5, n_bars=40_000)


def test_weights_chosen_on_validation_and_the_agent_beats_flat(planted) -> None:
    """A planted signal: the policy is the best of the validation scores, the rule lets it trade, and it earns a
    significant after-cost return on unseen bars."""
    torch.manual_seed(0)
    ensemble, member, _ = quality.train_on_task(planted, 1_200, seed=0, select_every=200, **SMALL)
    s = member.selection
    assert len(s.sharpes) == 6 and s.best_update in range(200, 1_201, 200)
    _, val_market = member._held_out_markets()
    assert member.policy_score(member.policy_network, val_market)[0] == pytest.approx(s.best, rel=1e-6)
    assert not bool(ensemble.held_flat[0]) and float(ensemble.edge_confidence[0]) > 0.99
    test = MarketTensors(planted.test, member.hparams.window, (-1.0, 0.0, 1.0), 1.0)
    positions = ensemble.positions(planted.test)["dqn"]
    assert t_stat(positions, test) > 5.0  # clearly beats flat after costs on unseen bars
    scores = quality.task_scores(positions, planted, window=member.hparams.window)
    assert scores["fraction_of_oracle"] > 0.5, scores


@pytest.mark.slow
def test_patience_stops_learning_early(planted) -> None:
    ensemble, member, _ = quality.train_on_task(planted, 4_000, seed=0, select_every=100, patience=1, **SMALL)
    assert member.finished and ensemble.updates["dqn"] < 4_000
    assert member.selection.since_best >= 1


def test_martingale_is_held_flat() -> None:
    """No signal: whatever the agent learnt in sample, the rule keeps it flat out of sample (no turnover, no cost)."""
    data = task_market(0.0, seed=2, n_bars=40_000)
    ensemble, member, _ = quality.train_on_task(data, 1_200, seed=0, select_every=200, **SMALL)
    assert bool(ensemble.held_flat[0]) and float(ensemble.edge_confidence[0]) < 0.95
    scores = quality.task_scores(ensemble.positions(data.test)["dqn"], data, window=member.hparams.window)
    assert scores["turnover"] == 0.0 and scores["log_return"] == 0.0


@pytest.mark.parametrize("agent", ["dqn", "ppo"])
def test_selection_keeps_flat_until_a_candidate_beats_it_and_then_the_best(agent, monkeypatch) -> None:
    """The Agent base's selection, with scripted candidates (positions a fixed fraction long): flat (0 after costs) is
    the incumbent; a losing candidate does not replace it; the best that beats it trades; a worse one later does not;
    patience counts scores since the best. Both agents use this one implementation."""
    from foxhunt.lit.dqn import DQNModule
    from foxhunt.lit.ppo import PPOModule

    data = task_market(0.0, seed=1, n_bars=6_000)
    # scripted candidates: long on every bar (earns the validation split's drift less one entry cost), short, and half
    val = MarketTensors(data.val, 4, (-1.0, 0.0, 1.0), 1.0)
    drift = float(val.returns[val.decision].mean())
    sign = 1.0 if drift > 0 else -1.0
    script = iter([-sign, 0.5 * sign, sign, -0.5 * sign])  # loses, beats flat, best, worse than best
    calls = {"level": 0.0}

    def scripted(self, net, market):
        return torch.full((market.n_bars,), calls["level"], device=market.returns.device)

    kind = DQNModule if agent == "dqn" else PPOModule
    monkeypatch.setattr(kind, "positions_of", scripted)
    member = kind(window=4, select_every=10, patience=2, n_features=data.train.n_features, cost_bps=1.0)
    member.attach_market(data.train, data.val)
    assert int(member.selected_update) == -1 and not member.holds_flat  # nothing scored yet: the learning net trades
    expected_best, chosen = 0.0, 0
    for k, update in enumerate((10, 20, 30, 40), start=1):
        calls["level"] = next(script)
        _, val_market = member._held_out_markets()
        reward = member.policy_score(member.network, val_market)[0]
        member.select(update)
        if reward > expected_best:
            expected_best, chosen = reward, update
        assert member.selection.best == pytest.approx(expected_best) and member.selection.best_update == chosen, k
        assert int(member.selected_update) == chosen and member.holds_flat == (chosen == 0)
        assert len(member.selection_sharpes()) == k
        assert (k != 1 or member.holds_flat) and (k != 2 or chosen == 20)  # the loser left flat; half beat it
    assert chosen == 30 and member.selection.since_best == 1 and not member.finished
    member.select(50)  # a second score without a gain: patience 2 stops learning
    assert member.finished and member.selection.best_update == 30
    latest = member.held_out_metrics()
    assert latest["val/selected_update"] == 30.0 and latest["val/best_reward_per_bar"] == pytest.approx(expected_best)
