"""PPOModule as an agent member of the coordinator: GAE, the clipped losses, the squashed Gaussian, rollouts and their
schedule, the continuous environment and deterministic positions, logging, exact resume, learning (planted AR(1)
signal and a martingale), and fit/export/load through ``python -m foxhunt.fit``.

PPO trains only through ``EnsembleModule(members={"ppo": PPOModule(...)})`` fitted on a ``MarketDataModule``; one
coordinator update is one minibatch gradient step, so ``trainer.global_step`` counts minibatches.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from safetensors.torch import load_file, save_file

from foxhunt.data.market import MarketSplit
from foxhunt.data.market_datamodule import MarketDataModule
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.ppo import LinearDecay, PPOModule, clipped_surrogate_loss, value_loss
from foxhunt.models.actor_critic import (
    ActorCritic,
    squashed_normal_entropy,
    squashed_normal_log_prob,
    tanh_log_det,
)
from foxhunt.quality import agents as quality
from foxhunt.quality.ppo_runs import train_ppo
from foxhunt.rl.env import ContinuousMarketEnv, MarketEnv, MarketTensors, apply_no_trade_band, sequential_positions
from foxhunt.rl.rollout import RolloutBuffer, generalized_advantages
from foxhunt.trading.pnl import strategy_log_returns


@pytest.fixture(scope="module")
def market():
    return quality.ar1_market(n_bars=12_000, phi=0.3, seed=1)


# a rollout is 16 agents x 8 steps = 128 steps in 8 minibatches of 16, used for 2 epochs: 16 updates per rollout;
# 4 updates per coordinator step, 5 steps per epoch: 20 updates per epoch (the first epoch ends inside rollout 2)
SMALL = {
    "window": 4, "n_envs": 16, "n_steps": 8, "episode_length": 16, "n_minibatches": 8, "n_epochs": 2,
    "hidden": (16, 16), "optim": {"log_grad_norm_every": 5, "updates_per_step": 4},
}
UPDATES_PER_EPOCH = 20


def small(**optim: Any) -> dict[str, Any]:
    """SMALL with these optimisation settings over its own."""
    return {**SMALL, "optim": {**SMALL["optim"], **optim}}


def trainer(tmp_path: Path, **kw) -> L.Trainer:
    args = {
        "max_epochs": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "accelerator": "cpu", "devices": 1, "num_sanity_val_steps": 0,
        "log_every_n_steps": 5, "default_root_dir": str(tmp_path),
    }
    args.update(kw)
    return L.Trainer(**args)


def fit(member: PPOModule, market, t: L.Trainer, validate: bool = False, model: EnsembleModule | None = None,
        steps_per_epoch: int | None = None, **kw) -> EnsembleModule:
    """Fit the coordinator with ``member`` as its only member; an epoch is UPDATES_PER_EPOCH updates."""
    model = EnsembleModule(members={"ppo": member}) if model is None else model
    if not validate:
        t.limit_val_batches = 0
    steps = steps_per_epoch or UPDATES_PER_EPOCH // member.updates_per_step
    dm = MarketDataModule(market.train, market.val if validate else None, market.test, steps_per_epoch=steps)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        t.fit(model, datamodule=dm, **kw)
    return model


def make_split(lengths: tuple[int, ...] = (300, 200), n_features: int = 3, seed: int = 0) -> MarketSplit:
    """Several symbols back to back, random features and returns, an invalid bar inside the first symbol."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    sym = torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)]).long()
    rets = torch.randn(n, generator=g) * 1e-3
    rets[torch.cumsum(torch.tensor(lengths), 0) - 1] = float("nan")
    valid = torch.isfinite(rets)
    valid[40] = False
    return MarketSplit(
        name="unit", symbols=[f"S{i}" for i in range(len(lengths))],
        timestamps=torch.arange(n, dtype=torch.int64) * 60_000_000_000, symbol_index=sym,
        ohlcv=torch.ones(n, 5, dtype=torch.float64), returns=rets, targets=rets.clone(), valid=valid,
        features=torch.randn(n, n_features, generator=g), feature_names=[f"f{i}" for i in range(n_features)],
    )


# ------------------------------------------------------------------------------------------------ maths
def test_gae_matches_a_hand_computation_with_a_truncation_bootstrap() -> None:
    """T=3 steps of one agent whose episode hits its time limit after step 1: step 1 bootstraps from the final state's
    value (0.9), the recursion stops there, and step 2 bootstraps from the state the rollout stopped in (0.2)."""
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [0.4], [0.3]])
    next_values = torch.tensor([[0.4], [0.9], [0.2]])
    last = torch.tensor([[False], [True], [False]])
    adv, ret = generalized_advantages(rewards, values, next_values, last, gamma=0.9, lam=0.8)
    d0, d1, d2 = 1 + 0.9 * 0.4 - 0.5, 2 + 0.9 * 0.9 - 0.4, 3 + 0.9 * 0.2 - 0.3
    want = torch.tensor([[d0 + 0.9 * 0.8 * d1], [d1], [d2]])
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret, want + values)
    # a true terminal state (not in the market, but the function supports it) drops the bootstrap
    adv_t, _ = generalized_advantages(rewards, values, next_values, last, 0.9, 0.8, terminated=torch.tensor([[False], [True], [False]]))
    assert adv_t[1, 0].item() == pytest.approx(2 - 0.4)
    # λ = 1, no truncation (each successor is the next state): discounted returns to go with the final bootstrap
    successors = torch.tensor([[0.4], [0.3], [0.2]])
    adv1, ret1 = generalized_advantages(rewards, values, successors, torch.zeros_like(last), 0.9, 1.0)
    g2 = 3 + 0.9 * 0.2
    g1 = 2 + 0.9 * g2
    torch.testing.assert_close(ret1, torch.tensor([[1 + 0.9 * g1], [g1], [g2]]))


def test_clipped_surrogate_and_value_clipping_match_hand_values() -> None:
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.7])
    adv = torch.tensor([1.0, 1.0, -2.0, -1.0])
    # per row: max(-A·ρ, -A·clip(ρ, 0.8, 1.2)) = max(-1.5, -1.2), max(-0.5, -0.8), max(2.2, 2.2), max(0.7, 0.8)
    assert clipped_surrogate_loss(ratio, adv, 0.2).item() == pytest.approx((-1.2 - 0.5 + 2.2 + 0.8) / 4)
    new, old, ret = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 0.5, 2.0]), torch.tensor([2.0, 1.0, 2.5])
    # unclipped errors (1, 1, 0.25); clipped values (0.7, 0.3, 2.0): errors (1.69, 0.49, 0.25); max per row
    assert value_loss(new, old, ret, 0.2).item() == pytest.approx(0.5 * (1.69 + 1.0 + 0.25) / 3)
    assert value_loss(new, old, ret, None).item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.25) / 3)


def test_squashed_gaussian_log_prob_and_entropy() -> None:
    """The closed form against torch's TransformedDistribution, a Monte-Carlo histogram of tanh(u), and the entropy
    estimate against the Monte-Carlo mean of −log π."""
    from torch.distributions import Normal, TanhTransform, TransformedDistribution

    mean, log_std = torch.tensor([0.3, -1.0]), torch.tensor([-0.5, 0.2])
    u = torch.linspace(-3, 3, 13).unsqueeze(1).expand(13, 2)
    reference = TransformedDistribution(Normal(mean, log_std.exp()), [TanhTransform()])
    torch.testing.assert_close(squashed_normal_log_prob(u, mean, log_std), reference.log_prob(torch.tanh(u)), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tanh_log_det(torch.tensor([0.0, 20.0])), torch.tensor([0.0, math.log(4.0) - 40.0]))
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(400_000, generator=g)
    m, s = 0.3, math.exp(-0.5)
    y = torch.tanh(m + s * noise)
    edges = torch.linspace(-0.9, 0.9, 19)
    counts = torch.histc(y, bins=18, min=-0.9, max=0.9)
    density = counts / (y.numel() * (edges[1] - edges[0]))
    centres = (edges[:-1] + edges[1:]) / 2
    closed = squashed_normal_log_prob(torch.atanh(centres), torch.tensor(m), torch.tensor(-0.5)).exp()
    torch.testing.assert_close(density, closed, rtol=0.05, atol=0.01)
    # the entropy estimate against H = E_u[−log π(tanh u)] by quadrature over u (to Monte-Carlo error)
    grid = torch.linspace(m - 10 * s, m + 10 * s, 200_001, dtype=torch.float64)
    weight = Normal(torch.tensor(m, dtype=torch.float64), s).log_prob(grid).exp() * (grid[1] - grid[0])
    exact = -(weight * squashed_normal_log_prob(grid, torch.tensor(m, dtype=torch.float64),
                                                torch.tensor(-0.5, dtype=torch.float64))).sum()
    estimate = squashed_normal_entropy(torch.full((400_000,), m), torch.full((400_000,), -0.5), noise).mean()
    assert estimate.item() == pytest.approx(exact.item(), abs=3e-3)
    assert estimate.item() < Normal(m, s).entropy().item()  # squashing removes entropy


def test_linear_decay_and_constructor_checks() -> None:
    f = LinearDecay(100, warmup_steps=10)
    assert f(0) == pytest.approx(0.1) and f(10) == 1.0 and f(55) == pytest.approx(0.5) and f(100) == 0.0 and f(200) == 0.0
    with pytest.raises(ValueError, match="n_minibatches"):
        PPOModule(n_envs=10, n_steps=3, n_minibatches=4)
    with pytest.raises(ValueError, match="action_space"):
        PPOModule(action_space="box")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gamma"):
        PPOModule(gamma=1.0)
    with pytest.raises(ValueError, match="target_kl"):
        PPOModule(target_kl=0.0)
    with pytest.raises(ValueError, match="scheduler"):
        PPOModule(optim={"scheduler": "exp"})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="bind it"):
        _ = PPOModule().network


def test_orthogonal_init_is_seeded_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    a, b = PPOModule(n_features=3, seed=7), PPOModule(n_features=3, seed=7)
    assert torch.rand(1) == before
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    net = ActorCritic(3, 4, 3, 3, hidden=(8, 8))
    for mlp in (net.actor, net.critic):
        w = mlp[0].weight  # orthogonal rows scaled by sqrt(2), the actor's and the critic's
        torch.testing.assert_close(w @ w.T, 2.0 * torch.eye(8), atol=1e-5, rtol=0)
    assert net.actor[-1].weight.norm() < 0.05 and torch.all(net.critic[-1].bias == 0)


@pytest.mark.parametrize("space", ["discrete", "continuous"])
def test_actor_critic_is_two_tanh_mlps(space) -> None:
    """The network is CleanRL's two separate tanh MLPs: the initial values of ``tanh_mlp`` actor then critic from the
    same seed, the same outputs, and a state dict of their layers (``actor.<i>``, ``critic.<i>``, ``actor_logstd``)."""
    from foxhunt.models.actor_critic import tanh_mlp

    n_out = 3 if space == "discrete" else 1
    n_pos = 1 if space == "continuous" else 3
    torch.manual_seed(4)
    net = ActorCritic(3, 4, n_pos, 3, action_space=space, hidden=(8, 6), log_std_init=-0.3)
    torch.manual_seed(4)
    n_in = 4 * 3 + n_pos
    actor, critic = tanh_mlp(n_in, (8, 6), n_out, 0.01), tanh_mlp(n_in, (8, 6), 1, 1.0)
    x = torch.randn(7, n_in)
    with torch.no_grad():
        torch.testing.assert_close(net.actor_out(x), actor(x).squeeze(1) if space == "continuous" else actor(x), rtol=0, atol=0)
        torch.testing.assert_close(net.value(x), critic(x).squeeze(1), rtol=0, atol=0)
    want = [f"actor.{k}" for k in actor.state_dict()] + [f"critic.{k}" for k in critic.state_dict()]
    assert set(net.state_dict()) == set(want) | ({"actor_logstd"} if space == "continuous" else set())
    if space == "continuous":
        assert net.actor_logstd.item() == pytest.approx(-0.3)


# ------------------------------------------------------------------------------------------------ environment
def test_continuous_env_rewards_episodes_and_state() -> None:
    split = make_split()
    m = MarketTensors(split, window=4, cost_bps=2.0, reward_scale=3.0)
    env = ContinuousMarketEnv(m, n_envs=5, episode_length=7, seed=1)
    twin = MarketEnv(m, n_envs=5, episode_length=7, seed=1)  # same starts and draws as the discrete environment
    assert torch.equal(env.bars, twin.bars) and env.positions.dtype == torch.float32 and not env.positions.any()
    window, held = env.observe()
    assert window.shape == (5, 4, 3) and held.shape == (5, 1)
    state = env.state_dict()
    moves = torch.tensor([0.5, -1.0, 0.0, 0.25, 1.0])
    bars = env.bars.clone()
    tr = env.step(moves)
    want = 3.0 * (moves * m.signal[bars] - 2e-4 * moves.abs())
    torch.testing.assert_close(tr.rewards, want)
    torch.testing.assert_close(tr.raw_rewards, moves * m.returns[bars] - 2e-4 * moves.abs())
    assert torch.equal(env.positions, torch.where(tr.last, torch.zeros(5), moves))
    second = env.step(torch.zeros(5))  # closing pays the cost of the held position
    torch.testing.assert_close(second.raw_rewards, -2e-4 * torch.where(tr.last, torch.zeros(5), moves).abs())
    env.load_state_dict(state)
    assert torch.equal(env.step(moves).rewards, tr.rewards)
    # the no-trade band: a target within 0.3 of the held position (flat here) is not traded, and pays nothing
    banded = ContinuousMarketEnv(m, n_envs=5, episode_length=7, seed=1, no_trade_band=0.3)
    taken = banded.step(moves)
    assert torch.equal(taken.actions, torch.tensor([0.5, -1.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(taken.raw_rewards, taken.actions * m.returns[bars] - 2e-4 * taken.actions.abs())
    with pytest.raises(ValueError, match="no_trade_band"):
        ContinuousMarketEnv(m, n_envs=5, episode_length=7, no_trade_band=2.0)


def test_deterministic_positions_equal_a_bar_by_bar_loop() -> None:
    """Discrete (policy table) and continuous (lanes, numpy recurrence) positions equal the policy applied bar by bar,
    symbol by symbol from flat, flat where no decision can be taken."""
    split = make_split((300, 200, 150))
    for space in ("discrete", "continuous"):
        band = 0.05
        member = PPOModule(window=4, action_space=space, hidden=(16, 16), seed=3, log_std_init=0.0, no_trade_band=band)
        member.attach_market(split)
        with torch.no_grad():  # a policy that depends visibly on the held position, with targets across [-1, 1]
            member.net.actor[0].weight.mul_(30.0)  # the actor's first layer
            member.net.actor[-1].weight.mul_(50.0)
        positions, m = member.deterministic_positions(split)
        want = torch.zeros(m.n_bars)
        held = 0.0
        for t in range(m.n_bars):
            if m.reset_mask[t]:
                held = 0.0
            if not m.decision[t]:
                held = 0.0
            else:
                if space == "discrete":
                    idx = int(torch.argmin((m.actions - held).abs()))
                    logits = member.net.deterministic(m.windows(torch.tensor([t])), m.position_features(torch.tensor([idx])))
                    held = float(m.actions[logits.argmax(1)])
                else:
                    with torch.no_grad():
                        target = float(member.net.deterministic(m.windows(torch.tensor([t])), torch.tensor([[held]])))
                    held = held if abs(target - held) < band else target  # the no-trade band
            want[t] = held
        torch.testing.assert_close(positions, want, atol=1e-5, rtol=0)
        assert (positions[~m.decision] == 0).all() and positions[m.decision].abs().sum() > 0
        assert positions.unique().numel() > (3 if space == "continuous" else 1)
    # the lane bookkeeping alone: a recurrence that counts decisions since the last flat bar
    m = MarketTensors(split, window=4)
    counts = sequential_positions(lambda b: torch.zeros(b.numel(), 1),
                                  lambda pre, decide, held: _count_path(decide, held), m, chunk=64)
    want = torch.zeros(m.n_bars)
    for t in range(m.n_bars):
        want[t] = 0.0 if not m.decision[t] else (1.0 if m.reset_mask[t] or t == 0 else want[t - 1] + 1.0)
    torch.testing.assert_close(counts, want)


def _count_path(decide: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(decide.shape)
    p = held.clone()
    for j in range(decide.shape[1]):
        p = torch.where(decide[:, j], p + 1.0, torch.zeros_like(p))
        out[:, j] = p
    return out


# ------------------------------------------------------------------------------------------------ rollouts
@pytest.mark.parametrize("space", ["discrete", "continuous"])
def test_rollout_values_bootstrap_from_final_states(market, space) -> None:
    """The buffer's advantages equal GAE computed from the critic's values of every state and of every successor
    (bar + 1 holding the action: the final state after a time limit, the next state otherwise); the first minibatch
    of a rollout has ratio 1 (the stored log-probabilities are the policy's)."""
    member = PPOModule(**{**SMALL, "action_space": space, "gamma": 0.8, "gae_lambda": 0.9})
    member.attach_market(market.train)
    member.start()
    member.collect_rollout()
    buf, m, net = member.rollout, member.env.market, member.net
    assert buf.last.any()  # episodes of 16 steps: time limits inside the rollout
    # the position taken: the target tanh(u), or the held one where the target is within the no-trade band
    nxt = apply_no_trade_band(torch.tanh(buf.actions), buf.held, 0.1) if space == "continuous" else buf.actions
    inner = ~buf.last[:-1]
    assert torch.equal(buf.bars[1:][inner], (buf.bars[:-1] + 1)[inner])
    assert torch.allclose(buf.held[1:][inner].float(), nxt[:-1][inner].float())
    with torch.no_grad():
        def v(bars, held):
            pos = held.float().unsqueeze(1) if space == "continuous" else m.position_features(held)
            return net.value(net.inputs(m.windows(bars), pos))

        values = v(buf.bars.reshape(-1), buf.held.reshape(-1)).view(buf.bars.shape)
        successors = v(buf.bars.reshape(-1) + 1, nxt.reshape(-1)).view(buf.bars.shape)
    adv, ret = generalized_advantages(buf.rewards, values, successors, buf.last, 0.8, 0.9)
    torch.testing.assert_close(buf.advantages, adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(buf.returns, ret, atol=1e-5, rtol=1e-5)
    loss = member.training_loss(None, 0)
    assert torch.isfinite(loss)
    stats = member.ratio_statistics(member.counters.last["logratio"])
    assert abs(stats["approx_kl"]) < 1e-6 and stats["clipfrac"] == 0 and member.counters.last["logratio"].abs().max() < 1e-5


def test_rollout_schedule_epochs_minibatches_and_kl_stop() -> None:
    buf = RolloutBuffer(4, 3, seed=0)
    buf.finish(torch.zeros(4, 3), torch.zeros(4, 3), 0.9, 0.95, n_epochs=2, n_minibatches=3)
    seen = [buf.next_indices() for _ in range(6)]
    assert buf.exhausted and all(len(i) == 4 for i in seen)
    for epoch in (seen[:3], seen[3:]):
        assert torch.equal(torch.sort(torch.cat(epoch)).values, torch.arange(12))  # each epoch covers every step once
    assert not torch.equal(torch.cat(seen[:3]), torch.cat(seen[3:]))  # reshuffled
    with pytest.raises(RuntimeError, match="used up"):
        buf.next_indices()
    buf.finish(torch.zeros(4, 3), torch.zeros(4, 3), 0.9, 0.95, n_epochs=2, n_minibatches=3)
    buf.next_indices()
    buf.stop()
    assert buf.exhausted


def test_rollout_minibatches_gathered_per_epoch_equal_the_rows_they_index() -> None:
    """next_minibatch serves, from the epoch's gathered tables, exactly the rows of its indices: fields, the stored
    network inputs, and advantages normalised over the minibatch (norm_adv) as CleanRL normalises them."""
    g = torch.Generator().manual_seed(0)
    for continuous in (False, True):
        buf = RolloutBuffer(4, 6, continuous=continuous, seed=3)
        for t in range(4):
            held = torch.randn(6, generator=g) if continuous else torch.randint(0, 3, (6,), generator=g)
            act = torch.randn(6, generator=g) if continuous else torch.randint(0, 3, (6,), generator=g)
            buf.add(t, torch.arange(6) + 10 * t, held, act, torch.randn(6, generator=g), torch.randn(6, generator=g),
                    torch.zeros(6, dtype=torch.bool), torch.randn(6, generator=g))
        inputs = torch.randn(24, 5, generator=g)
        buf.finish(torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), 0.9, 0.95, n_epochs=2,
                   n_minibatches=3, norm_adv=True, inputs=inputs)
        twin = RolloutBuffer(4, 6, continuous=continuous, seed=3)
        twin.load_state_dict(buf.state_dict())
        twin.set_inputs(inputs)
        for _ in range(6):
            idx = twin.next_indices()
            mb, ref = buf.next_minibatch(), twin.minibatch(idx)
            for name in ("bars", "held", "actions", "noise", "log_probs", "values", "returns", "inputs"):
                assert torch.equal(getattr(mb, name), getattr(ref, name)), name
            std, mean = torch.std_mean(ref.advantages)
            torch.testing.assert_close(mb.advantages, (ref.advantages - mean) / (std + 1e-8))


# ------------------------------------------------------------------------------------------------ through the coordinator
@pytest.mark.parametrize("space", ["discrete", "continuous"])
def test_fit_logs_training_and_validation_metrics(tmp_path, market, space) -> None:
    module = PPOModule(action_space=space, **SMALL)
    t = trainer(tmp_path)
    model = fit(module, market, t, validate=True, model=EnsembleModule(members={"ppo": module}, cost_bps=0.5,
                                                                min_edge_confidence=None))  # the member itself
    assert module.cost_bps == 0.5
    logged = t.callback_metrics
    keys = [f"train/ppo/{k}" for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac",
                                       "explained_variance", "reward_per_bar", "env_steps", "env_steps_per_s",
                                       "rollout_time_fraction", "rollouts", "kl_stops", "nonfinite_skipped", "updates")]
    keys += [f"val/ppo/{k}" for k in ("sharpe", "reward_per_bar", "turnover", "max_drawdown")]
    keys += ["lr/ppo", "val/sharpe", "grad_norm/ppo/total", "grad_norm/ppo/actor", "grad_norm/ppo/critic"]
    keys += ["train/ppo/std"] if space == "continuous" else []
    for key in keys:
        assert key in logged, key
        assert torch.isfinite(logged[key]), key
    assert t.global_step == model.updates["ppo"] == UPDATES_PER_EPOCH
    assert module.counters.rollouts == 2 and module.env_steps == 2 * 16 * 8  # 16 updates per rollout
    assert logged["train/ppo/rollouts"] == 2 and 0 < logged["train/ppo/rollout_time_fraction"] < 1
    evaluation = model.last_evaluation
    torch.testing.assert_close(evaluation.positions["ppo"].cpu(), module.positions(market.val).cpu())


def test_target_kl_stops_a_rollout_early_and_the_lr_anneals_to_zero(tmp_path, market) -> None:
    kwargs = {**small(lr=3e-2, updates_per_step=5), "target_kl": 1e-6}
    module = PPOModule(**kwargs)
    model = fit(module, market, trainer(tmp_path, max_epochs=2))
    assert model.updates["ppo"] == 40
    assert module.counters.kl_stops > 0
    assert module.counters.rollouts > math.ceil(40 / 16)  # rollouts are cut short: more of them
    assert model.optimizers().param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # linear to zero over the fit


def test_nonfinite_loss_skips_and_the_minibatch_is_consumed(tmp_path, market, monkeypatch) -> None:
    original = PPOModule._log_prob_and_entropy

    def nan_once(self, x, mb):
        lp, ent, out = original(self, x, mb)
        return (lp * float("nan"), ent, out) if self.rollout.cursor == 1 and self.rollout.epoch == 1 else (lp, ent, out)

    monkeypatch.setattr(PPOModule, "_log_prob_and_entropy", nan_once)
    module = PPOModule(**small(nonfinite="skip"))
    model = fit(module, market, trainer(tmp_path, max_steps=8))
    # three coordinator steps of 4 attempts, one skipped: 11 updates, and the 12 minibatches were all taken
    assert module.guard.skipped_loss == 1 and model.updates["ppo"] == 11
    assert (module.rollout.epoch, module.rollout.cursor) == (2, 4)


@pytest.mark.parametrize("space", ["discrete", "continuous"])
def test_resume_from_checkpoint_is_exact(tmp_path, market, space) -> None:
    """Two epochs straight equal one epoch, a checkpoint, and a resumed second epoch: weights, optimizer, schedule,
    rollout (contents, minibatch schedule, shuffling RNG), environment, sampling RNG, counters. The first epoch ends
    inside the second rollout's first epoch."""
    # the linear LR schedule spans both epochs in both runs (the first leg's Trainer alone would plan one)
    kwargs = {**small(total_steps=2 * UPDATES_PER_EPOCH), "action_space": space, "target_kl": 0.05}

    straight = PPOModule(**kwargs)
    straight_model = fit(straight, market, trainer(tmp_path / "a", max_epochs=2))
    assert straight_model.updates["ppo"] == 2 * UPDATES_PER_EPOCH

    first = PPOModule(**kwargs)
    t1 = trainer(tmp_path / "b", max_epochs=1)
    fit(first, market, t1)
    ckpt = tmp_path / "b" / "one.ckpt"
    t1.save_checkpoint(ckpt)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["ensemble_state"]["members"]["ppo"]
    assert {"env", "rollout", "sample_rng", "counters", "guard"} <= set(state)
    assert state["rollout"]["epoch"] == 1 and state["rollout"]["cursor"] == 4  # mid-epoch of rollout 2

    resumed = PPOModule(**kwargs)
    resumed_model = fit(resumed, market, trainer(tmp_path / "c", max_epochs=2), ckpt_path=str(ckpt))
    assert resumed_model.updates == straight_model.updates and resumed_model.steps == straight_model.steps
    for (ka, pa), (kb, pb) in zip(straight_model.state_dict().items(), resumed_model.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(pa, pb), ka
    oa, ob = straight_model.optimizers().optimizer.state_dict(), resumed_model.optimizers().optimizer.state_dict()
    for i, s in oa["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][i][k])), (i, k)
    assert resumed.env_steps == straight.env_steps and resumed.counters.rollouts == straight.counters.rollouts
    ra, rb = straight.rollout.state_dict(), resumed.rollout.state_dict()
    for k, v in ra.items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(rb[k])) if v is not None else rb[k] is None, k
    ea, eb = straight.env.state_dict(), resumed.env.state_dict()
    for k in ea:
        assert torch.equal(torch.as_tensor(ea[k]), torch.as_tensor(eb[k])), k
    assert torch.equal(straight.sample_rng.get_state(), resumed.sample_rng.get_state())


def test_weights_are_chosen_on_validation() -> None:
    """A planted signal: every ``select_every`` updates the learning network's deterministic policy is scored on
    validation (reward per bar after costs); the best candidate that beats flat becomes the policy that trades, and the
    others are counted for the coordinator's deflation."""
    data = quality.ar1_market(n_bars=60_000, phi=0.3, seed=3)
    _, module, _ = train_ppo(data, 320, validate=True, select_every=80, **LEARN)
    s = module.selection
    assert len(s.sharpes) == len(module.selection_sharpes()) == 4
    assert s.best_update in (80, 160, 240, 320) and int(module.selected_update) == s.best_update and s.best > 0
    _, val_market = module._held_out_markets()
    assert module.policy_score(module.policy_network, val_market)[0] == pytest.approx(s.best, rel=1e-6)
    assert module.policy_network is module.policy_net and module.policy_net is not module.net
    assert not module.holds_flat and not any(p.requires_grad for p in module.policy_net.parameters())
    chosen = module.positions_of(module.policy_net, module.market_tensors(data.test))
    torch.testing.assert_close(module.positions(data.test), chosen.float(), rtol=0, atol=0)
    assert float(chosen.abs().sum()) > 0


@pytest.mark.parametrize("space", ["discrete", "continuous"])
def test_an_agent_holds_flat_until_a_candidate_beats_flat_on_validation(tmp_path, market, space) -> None:
    """Costs far above any edge (5% per unit traded): no candidate earns more than flat (0) after costs on validation,
    so the member holds no position; a checkpoint resumes the selection exactly; a state dict from before selection
    loads. (At 1 bp the premise rested on luck: on this AR 0.3 market an untrained candidate can beat flat.)"""
    kwargs = {**small(total_steps=2 * UPDATES_PER_EPOCH), "action_space": space, "select_every": 5, "cost_bps": 500.0}
    module = PPOModule(**kwargs)
    model = fit(module, market, trainer(tmp_path / "a", max_epochs=2), validate=True)
    s = module.selection
    assert len(s.sharpes) == 2 * UPDATES_PER_EPOCH // 5
    assert module.holds_flat and s.best_update == int(module.selected_update) == 0 and s.best == 0.0
    _, val_market = module._held_out_markets()
    assert module.policy_score(module.net, val_market)[0] <= 0.0  # the last candidate did not beat flat either
    assert float(module.positions(market.test).abs().max()) == 0.0
    assert model.evaluate(market.test).metrics["ppo"]["turnover"] == 0.0
    stepped = {id(p) for group in model.optimizers().param_groups for p in group["params"]}
    assert stepped == {id(p) for p in module.net.parameters()}  # only the learning network learns

    first = PPOModule(**kwargs)
    t1 = trainer(tmp_path / "b", max_epochs=1)
    fit(first, market, t1, validate=True)
    t1.save_checkpoint(tmp_path / "b" / "one.ckpt")
    resumed = PPOModule(**kwargs)
    fit(resumed, market, trainer(tmp_path / "c", max_epochs=2), validate=True, ckpt_path=str(tmp_path / "b" / "one.ckpt"))
    torch.testing.assert_close(torch.tensor(resumed.selection.sharpes), torch.tensor(s.sharpes), rtol=0, atol=0,
                               equal_nan=True)  # NaN: a candidate that never traded on validation
    assert resumed.selection.best_update == s.best_update
    assert same_weights(resumed.policy_net, module.policy_net)

    # a state dict written before selection (no policy_net, no selected_update) loads: the learning network trades
    old = {k: v for k, v in model.state_dict().items() if ".policy_net." not in k and not k.endswith("selected_update")}
    fresh = EnsembleModule(members={"ppo": PPOModule(**kwargs, n_features=market.train.n_features)})
    fresh.load_state_dict(old)
    member = fresh.member("ppo")
    assert int(member.selected_update) == -1 and member.policy_network is member.net
    assert same_weights(member.policy_net, module.net)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two networks hold exactly the same tensors under the same names."""
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_checkpoint_of_another_network_layout_is_refused_in_one_line(tmp_path, market) -> None:
    """A checkpoint whose AdamW state covers another number of tensors than the network's 13 parameters (here 2:
    another actor-critic layout): resuming from it is refused with one line naming the reason, before torch's
    group-size mismatch."""
    kwargs = {**SMALL, "action_space": "continuous"}
    t1 = trainer(tmp_path / "a", max_epochs=1)
    fit(PPOModule(**kwargs), market, t1)
    ckpt = tmp_path / "a" / "one.ckpt"
    t1.save_checkpoint(ckpt)
    blob = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert sum(len(g["params"]) for g in blob["optimizer_states"][0]["param_groups"]) == 13
    other = [torch.nn.Parameter(torch.zeros(700)), torch.nn.Parameter(torch.zeros(70))]
    optimizer = torch.optim.AdamW(other, lr=3e-4, eps=1e-5)
    for p in other:
        p.grad = torch.ones_like(p)
    optimizer.step()
    blob["optimizer_states"][0] = optimizer.state_dict()
    torch.save(blob, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="holds 2 parameter tensors, the network has 13") as info:
        fit(PPOModule(**kwargs), market, trainer(tmp_path / "b", max_epochs=2), ckpt_path=str(tmp_path / "other.ckpt"))
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ learning
# the schedule and rollout shape these tests' thresholds were set with (the member's defaults before December 2026
# were 128 x 64 rollouts; the defaults' own quality is measured by scripts/ppo_quality.py, docs/PPO.md)
LEARN = {"window": 4, "n_epochs": 4, "n_minibatches": 4, "n_envs": 128, "n_steps": 64}
# the continuous policy's former defaults (mean penalty 0.1, log-std 0), with which the penalised tests' thresholds were
# set; the defaults now are no penalty and log-std 2 (chosen on validation, docs/PPO.md)
PENALISED = {"mean_reg_coef": 0.1, "log_std_init": 0.0}


def learn(data, updates: int, seed: int = 0, **overrides) -> PPOModule:
    """PPO trained through the coordinator (cost 1 bp) by the one train_ppo of the tests and the quality script."""
    return train_ppo(data, updates, seed=seed, **{**LEARN, **overrides})[1]


def t_stat(positions: torch.Tensor, market: MarketTensors) -> float:
    pnl = strategy_log_returns(positions, market.returns, market.cost_bps, market.reset_mask)[market.decision].double()
    return float(pnl.mean() / (pnl.std() / math.sqrt(pnl.numel())))


def test_ppo_learns_a_planted_signal_out_of_sample() -> None:
    """φ = 0.3, 320 updates (~160k environment steps): profitable after costs on unseen bars, near the oracle."""
    data = quality.ar1_market(n_bars=60_000, phi=0.3, seed=3)
    member = learn(data, 320)
    positions, test = member.deterministic_positions(data.test)
    base = quality.baseline_metrics(test, data.expected["test"])
    oracle = quality.best_causal_oracle(base)
    ppo = member.evaluate(data.test)
    assert t_stat(positions, test) > 8.0  # clearly beats flat after costs, out of sample
    assert ppo["reward_per_bar"] >= 0.8 * oracle  # measured 0.97-0.99
    assert ppo["reward_per_bar"] > base["random"]["reward_per_bar"] + oracle


def test_ppo_stays_flat_on_a_martingale() -> None:
    """φ = 0: nothing to earn, so the deterministic policy must not trade: small turnover, and no loss beyond one
    round trip of costs over the whole test split (measured: flat on every bar for seeds 0-2)."""
    data = quality.ar1_market(n_bars=60_000, phi=0.0, seed=4)
    member = learn(data, 960, seed=1)
    ppo = member.evaluate(data.test)
    assert ppo["turnover"] < 1e-3, ppo
    assert ppo["total_log_return"] > -2 * 1e-4, ppo


def test_penalised_continuous_ppo_beats_flat_on_a_signal_and_the_rule_holds_it_flat_on_a_martingale() -> None:
    """The continuous position with the mean penalty (0.1, log-std 0, no-trade band 0.1; not the defaults): φ = 0.3
    clearly beats flat after costs out of sample (measured 0.66 of the oracle); on the martingale the member alone
    keeps small positions (mean |position| below 0.1; without the band and the penalty the same run sat at 0.94,
    docs/PPO.md) but does not reliably stop trading (the known gap test_ppo_learning_over_seeds marks: seed 1 turns
    over 0.044 a bar; here 0.025 since the benchmark markets' features became causal), so, as for every agent, the
    coordinator's do-no-harm rule, decided on validation, holds it flat on every test bar."""
    signal = quality.ar1_market(n_bars=60_000, phi=0.3, seed=3)
    member = learn(signal, 640, action_space="continuous", **PENALISED)
    positions, test = member.deterministic_positions(signal.test)
    oracle = quality.best_causal_oracle(quality.baseline_metrics(test, signal.expected["test"]))
    assert t_stat(positions, test) > 8.0
    assert member.evaluate(signal.test)["reward_per_bar"] >= 0.5 * oracle
    martingale = quality.ar1_market(n_bars=60_000, phi=0.0, seed=3)
    ensemble, member, _ = train_ppo(martingale, 960, seed=0, validate=True, min_edge_confidence=0.95,
                                    **{**LEARN, "action_space": "continuous", **PENALISED})
    positions, test = member.deterministic_positions(martingale.test)
    assert float(positions[test.decision].abs().mean()) < 0.1
    assert bool(ensemble.held_flat[0])
    ruled = ensemble.evaluate(martingale.test).metrics["ppo"]
    assert ruled["turnover"] == 0.0 and ruled["total_log_return"] == 0.0, ruled


def test_continuous_ppo_at_its_defaults_beats_flat_on_a_signal_and_the_rule_holds_it_flat_on_a_martingale() -> None:
    """The continuous position at its defaults (no penalty, log-std 2, band 0.1): φ = 0.3 near the oracle out of sample
    (measured 0.998 of it, t 19.4); on the martingale the member alone holds a near-full position (measured mean
    |position| 0.997, turnover 8e-5 a bar: market exposure, not flat), and the coordinator's do-no-harm rule, decided on
    validation, holds it flat on every test bar: flat there is the rule's doing, as for every agent (docs/PPO.md)."""
    signal = quality.ar1_market(n_bars=60_000, phi=0.3, seed=3)
    member = learn(signal, 640, action_space="continuous")
    positions, test = member.deterministic_positions(signal.test)
    oracle = quality.best_causal_oracle(quality.baseline_metrics(test, signal.expected["test"]))
    assert t_stat(positions, test) > 12.0
    assert member.evaluate(signal.test)["reward_per_bar"] >= 0.85 * oracle
    martingale = quality.ar1_market(n_bars=60_000, phi=0.0, seed=3)
    ensemble, member, _ = train_ppo(martingale, 960, seed=0, validate=True, min_edge_confidence=0.95,
                                    **LEARN, action_space="continuous")
    assert bool(ensemble.held_flat[0])
    assert float(ensemble.positions(martingale.test)["ppo"].abs().max()) == 0.0
    ruled = ensemble.evaluate(martingale.test).metrics["ppo"]
    assert ruled["turnover"] == 0.0 and ruled["total_log_return"] == 0.0, ruled


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    "discrete",
    # a known gap of the penalised continuous member (issue 18): alone on the martingale seed 1 keeps trading
    # (turnover 0.044 a bar); strict: the test fails once the member stays flat by itself, so the mark must then go.
    pytest.param("continuous_penalised", marks=pytest.mark.xfail(
        strict=True, raises=AssertionError, reason="penalised continuous PPO trades on the martingale (seed 1)")),
    "continuous",
])
def test_ppo_learning_over_seeds(case) -> None:
    """Seeds 0-2, φ = 0.3 and a martingale. Discrete and the penalised continuous member (PENALISED): near the oracle,
    and the member alone does not trade on the martingale. The continuous member at its defaults: near the oracle
    (measured 0.95-1.01), and on the martingale it holds a near-full position (mean |position| 0.97-1.00, turnover
    below 1e-3: market exposure, so the member's own turnover says nothing of flatness); the coordinator's rule holds
    it flat (measured on all three seeds), which is what is asserted."""
    space = "discrete" if case == "discrete" else "continuous"
    settings = {"action_space": space, **(PENALISED if case == "continuous_penalised" else {})}
    for seed in (0, 1, 2):
        data = quality.ar1_market(n_bars=60_000, phi=0.3, seed=seed + 3)
        member = learn(data, 640, seed=seed, **settings)
        test = MarketTensors(data.test, 4, (-1.0, 0.0, 1.0), 1.0)
        oracle = quality.best_causal_oracle(quality.baseline_metrics(test, data.expected["test"]))
        # penalised continuous: its mean penalty caps a strong signal's positions (measured 0.66 of the oracle, seed 0)
        share = 0.5 if case == "continuous_penalised" else 0.8
        assert member.evaluate(data.test)["reward_per_bar"] >= share * oracle, (case, seed)
        martingale = quality.ar1_market(n_bars=60_000, phi=0.0, seed=seed + 3)
        if case == "continuous":
            ensemble, _, _ = train_ppo(martingale, 960, seed=seed, validate=True, min_edge_confidence=0.95,
                                       **LEARN, **settings)
            assert bool(ensemble.held_flat[0]), (case, seed)
            assert float(ensemble.positions(martingale.test)["ppo"].abs().max()) == 0.0, (case, seed)
            continue
        flat = learn(martingale, 960, seed=seed, **settings)
        res = flat.evaluate(martingale.test)
        assert res["turnover"] < (1e-3 if space == "discrete" else 0.01), (case, seed, res)


# ------------------------------------------------------------------------------------------------ fit, export, load
PPO_ONLY = {"class_path": "foxhunt.lit.ppo.PPOModule", "init_args": {
    "window": 4, "n_envs": 16, "n_steps": 16, "episode_length": 16, "n_minibatches": 4, "hidden": [16],
    "optim": {"updates_per_step": 4, "log_grad_norm_every": 2}}}


@pytest.mark.parametrize("space", ["discrete", "continuous"])
def test_fit_export_load_through_the_cli(tmp_path, space) -> None:
    import foxhunt
    from foxhunt.fit import main

    tiny = str(Path(__file__).parent / "configs" / "tiny.yaml")
    member = {**PPO_ONLY, "init_args": {**PPO_ONLY["init_args"], "action_space": space, "select_every": 8}}
    cli = main(["--config", tiny, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                "--trainer.default_root_dir", str(tmp_path), "--export_dir", str(tmp_path / "export"),
                "--model.members", json.dumps({"ppo": member}), "--trainer.max_epochs", "1", "--log_figures", "false",
                "--model.min_edge_confidence", "null"])  # the member trades: its positions are what is compared
    model = cli.model
    assert tuple(model.member_names) == ("ppo",) and model.updates["ppo"] == 6 * 4
    ppo = model.member("ppo")
    assert len(ppo.selection.sharpes) == 3 and int(ppo.selected_update) == ppo.selection.best_update in (0, 8, 16, 24)
    assert {"ppo", "ensemble", "buy_and_hold"} <= set(cli.results["backtest"])
    export = tmp_path / "export"
    assert {"ensemble.safetensors", "ppo.safetensors", "metadata.json"} <= {p.name for p in export.iterdir()}
    meta = json.loads((export / "metadata.json").read_text())
    assert meta["members"]["ppo"]["class_path"] == "foxhunt.lit.ppo.PPOModule"
    assert meta["members"]["ppo"]["init_args"]["action_space"] == space
    loaded = foxhunt.load(export)
    split = model.split("test")
    mine, theirs = model.positions(split), loaded.model.positions(split)
    for who in ("ppo", "ensemble"):
        torch.testing.assert_close(theirs[who].cpu(), mine[who].cpu())
    table = loaded.model.evaluate(split).metrics
    assert table["ppo"]["sharpe"] == pytest.approx(cli.results["backtest"]["ppo"]["sharpe"], abs=1e-9)

    # an export written before validation selection (no chosen weights, no `selected_update`) loads, and its
    # learning network trades, as it did then
    before = tmp_path / "before_selection"
    shutil.copytree(export, before)
    tensors = {k: v for k, v in load_file(before / "ensemble.safetensors").items()
               if ".policy_net." not in k and not k.endswith(".selected_update")}
    assert len(tensors) < len(load_file(before / "ensemble.safetensors"))
    save_file(tensors, before / "ensemble.safetensors")
    meta["sha256"]["ensemble"] = hashlib.sha256((before / "ensemble.safetensors").read_bytes()).hexdigest()
    (before / "metadata.json").write_text(json.dumps(meta))
    reloaded = foxhunt.load(before).model
    assert int(reloaded.member("ppo").selected_update) == -1
    learning = ppo.positions_of(ppo.network.eval(), ppo.market_tensors(split))
    torch.testing.assert_close(reloaded.positions(split)["ppo"].cpu(), learning.float().cpu(), rtol=0, atol=0)


def test_an_ensemble_with_a_ppo_member_trains_exports_and_reloads(tmp_path) -> None:
    """tests/configs/tiny.yaml's TFT and DQN with a PPO member beside them, through ``python -m foxhunt.fit``: every
    member updates, the export holds PPO's weights, and ``foxhunt.load`` gives every member's and the ensemble's
    positions back."""
    import yaml

    import foxhunt
    from foxhunt.fit import main

    tiny = Path(__file__).parent / "configs" / "tiny.yaml"
    members = yaml.safe_load(tiny.read_text())["model"]["members"]
    optim = {**PPO_ONLY["init_args"]["optim"], "start_step": 2, "updates_per_step": 2}
    ppo = {**PPO_ONLY, "init_args": {**PPO_ONLY["init_args"], "optim": optim}}
    members["ppo"] = ppo
    cli = main(["--config", str(tiny), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                "--trainer.default_root_dir", str(tmp_path), "--export_dir", str(tmp_path / "export"),
                "--model.members", json.dumps(members), "--log_figures", "false"])
    model = cli.model
    assert set(model.member_names) == {"tft", "dqn", "ppo"}
    best = cli.trainer.checkpoint_callback.best_model_path
    last = torch.load(Path(best).parent / "last.ckpt", map_location="cpu", weights_only=True)["ensemble_state"]["updates"]
    assert last["ppo"] == (2 * 6 - 2) * 2 and last["tft"] > 0 and last["dqn"] > 0
    # the exported weights are the best checkpoint's, and so are the update counts beside them
    assert model.updates == torch.load(best, map_location="cpu", weights_only=True)["ensemble_state"]["updates"]
    assert {"ppo", "ensemble"} <= set(cli.results["backtest"])
    assert (tmp_path / "export" / "ppo.safetensors").is_file()
    loaded = foxhunt.load(tmp_path / "export")
    split = model.split("test")
    mine, theirs = model.positions(split), loaded.model.positions(split)
    assert set(mine) >= {"tft", "dqn", "ppo", "ensemble"}
    for who in mine:
        torch.testing.assert_close(theirs[who].cpu(), mine[who].cpu())


def test_two_members_fitted_with_max_steps_anneal_over_their_own_share(tmp_path, market) -> None:
    """max_steps counts every member's updates together: each member's linear schedule spans its own share of them
    (here 40 and 14 of the 54 updates the fit takes) and reaches 0 at the member's last update."""
    one = {**small(log_grad_norm_every=0, scheduler="linear"), "n_minibatches": 2, "select_every": 0}
    other = {**one, "optim": {**one["optim"], "updates_per_step": 2, "start_step": 3}}
    members = {"ppo": PPOModule(**one), "ppo_b": PPOModule(**other, seed=1)}
    model = EnsembleModule(members=members, min_edge_confidence=None)
    t = trainer(tmp_path, max_steps=50, max_epochs=-1, limit_val_batches=0)
    fit(members["ppo"], market, t, model=model)
    assert model.updates == {"ppo": 40, "ppo_b": 14} and t.global_step == 54  # the tenth step overshoots 50
    for name, member in members.items():
        assert member.estimated_updates() == model.updates[name]
        schedule = model._schedulers[name]
        assert schedule.last_epoch == model.updates[name] and schedule.lr_lambdas[0].total_steps == model.updates[name]
        assert model._optimizer(name).param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12), name
