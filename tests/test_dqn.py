"""DQNModule: configuration checks, logging, target updates, non-finite guard, exact resume from a checkpoint."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import load_script

from foxhunt.lit.dqn import DQNModule, double_dqn_target
from foxhunt.training.guard import NonFiniteError

quality = load_script("dqn_quality")


@pytest.fixture(scope="module")
def market():
    return quality.ar1_market(n_bars=12_000, phi=0.3, seed=1)


SMALL = {
    "window": 4, "n_envs": 32, "episode_length": 64, "hidden": (32, 32), "batch_size": 32, "replay_capacity": 4096,
    "learning_starts": 256, "epsilon_steps": 50, "steps_per_epoch": 20, "log_grad_norm_every": 5,
}


def trainer(tmp_path: Path, **kw) -> L.Trainer:
    args = {
        "max_epochs": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "accelerator": "cpu", "devices": 1, "num_sanity_val_steps": 0, "log_every_n_steps": 5,
        "default_root_dir": str(tmp_path),
    }
    args.update(kw)
    return L.Trainer(**args)


def fit(module: DQNModule, t: L.Trainer, **kw) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        t.fit(module, **kw)


def test_constructor_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="gamma"):
        DQNModule(n_features=2, gamma=1.0)
    with pytest.raises(ValueError, match="n_step=1"):
        DQNModule(n_features=2, n_step=3, exogenous="all_actions")
    with pytest.raises(ValueError, match="target_update"):
        DQNModule(n_features=2, target_update="soft")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replay_capacity"):
        DQNModule(n_features=2, n_envs=256, replay_capacity=100)
    m = DQNModule(n_features=2)
    with pytest.raises(RuntimeError, match="attach_market"):
        m._build_environment()


def test_attach_market_checks_features(market) -> None:
    assert market.train.n_features == 3
    with pytest.raises(ValueError, match="n_features=5"):
        DQNModule(n_features=5).attach_market(market.train)


def test_epsilon_schedules() -> None:
    lin = DQNModule(n_features=2, epsilon_start=1.0, epsilon_end=0.1, epsilon_steps=100)
    assert lin.epsilon(0) == 1.0 and lin.epsilon(50) == pytest.approx(0.55) and lin.epsilon(500) == pytest.approx(0.1)
    exp = DQNModule(n_features=2, epsilon_schedule="exponential", epsilon_start=1.0, epsilon_end=0.01, epsilon_steps=100)
    assert exp.epsilon(50) == pytest.approx(0.1) and exp.epsilon(1000) == pytest.approx(0.01)


def test_same_seed_same_initial_weights_and_no_global_rng_use() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = DQNModule(n_features=2, seed=7), DQNModule(n_features=2, seed=7)
    assert torch.rand(1) == before  # building the networks did not consume the global RNG
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(next(DQNModule(n_features=2, seed=8).parameters()), next(a.parameters()))


def test_double_dqn_target_uses_online_argmax_and_target_values() -> None:
    q_online = torch.tensor([[1.0, 3.0, 2.0], [5.0, 0.0, 1.0]])
    q_target = torch.tensor([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]])
    r, d = torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.0])
    assert double_dqn_target(q_online, q_target, r, d).tolist() == [1.0 + 0.5 * 20.0, -1.0]
    assert double_dqn_target(q_online, q_target, r, d, double=False).tolist() == [1.0 + 0.5 * 30.0, -1.0]


def test_td_targets_of_all_actions_match_a_direct_computation(market) -> None:
    """The exogenous mode regresses every action of (t, p) onto r(t, p, a) + γ·Q_target((t+1, a), argmax Q_online)."""
    module = DQNModule(n_features=market.train.n_features, gamma=0.7, **SMALL)
    module.attach_market(market.train)
    module._build_environment()
    for _ in range(10):
        module._env_step(1.0)
    sample = module.replay.sample(16)
    loss, q = module.td_loss(sample)
    mk = module.env.market
    with torch.no_grad():
        want_q = module.q_net(mk.windows(sample.bars), mk.position_features(sample.positions))
        targets = torch.empty(16, 3)
        for a in range(3):
            nw, npf = mk.windows(sample.bars + 1), mk.position_features(torch.full((16,), a))
            best = module.q_net(nw, npf).argmax(1, keepdim=True)
            nv = module.target_net(nw, npf).gather(1, best).squeeze(1)
            targets[:, a] = mk.rewards(sample.bars, sample.positions, torch.full((16,), a)) + 0.7 * nv
    assert torch.allclose(q, want_q, atol=1e-5)
    assert torch.allclose(loss, torch.nn.functional.huber_loss(want_q, targets), atol=1e-6)


@pytest.mark.parametrize("exogenous,n_step,dueling,encoder", [("all_actions", 1, False, "flat"), ("none", 3, True, "conv")])
def test_fit_logs_training_and_validation_metrics(tmp_path, market, exogenous, n_step, dueling, encoder) -> None:
    module = DQNModule(
        n_features=market.train.n_features, exogenous=exogenous, n_step=n_step, dueling=dueling, encoder=encoder,
        **SMALL,
    )
    module.attach_market(market.train, market.val)
    t = trainer(tmp_path)
    fit(module, t)
    logged = t.callback_metrics
    for key in ("train/td_loss", "train/q_mean", "train/q_max", "train/epsilon", "train/reward_per_bar",
                "train/env_steps_per_s", "train/grad_norm/total", "train/grad_norm/body",
                "val/reward_per_bar", "val/sharpe", "val/total_log_return", "val/max_drawdown", "val/turnover",
                "val/hit_rate"):
        assert key in logged, key
        assert torch.isfinite(logged[key]) or key == "val/hit_rate", key
    assert logged["train/env_steps_per_s"] > 0
    assert module.env_steps == 256 + 20 * 32  # warm-up plus one step of all agents per update
    assert t.global_step == 20


def test_hard_target_sync(tmp_path, market) -> None:
    module = DQNModule(n_features=3, target_update="hard", target_update_every=10, **SMALL)
    module.attach_market(market.train)
    fit(module, trainer(tmp_path, max_steps=10))
    for po, pt in zip(module.q_net.parameters(), module.target_net.parameters()):
        assert torch.equal(po, pt)
    module2 = DQNModule(n_features=3, target_update="hard", target_update_every=10, **SMALL)
    module2.attach_market(market.train)
    fit(module2, trainer(tmp_path, max_steps=9))
    assert any(not torch.equal(po, pt) for po, pt in zip(module2.q_net.parameters(), module2.target_net.parameters()))


def test_nonfinite_loss_raises_or_skips(tmp_path, market, monkeypatch) -> None:
    def nan_loss(self, batch):
        mk = self.env.market
        q = self.q_net(mk.windows(batch.sample.bars), mk.position_features(batch.sample.positions))
        return q.sum() * float("nan"), q.detach()

    monkeypatch.setattr(DQNModule, "_td_loss", nan_loss)
    raising = DQNModule(n_features=3, nonfinite="raise", **SMALL)
    raising.attach_market(market.train)
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        fit(raising, trainer(tmp_path, max_steps=3))
    skipping = DQNModule(n_features=3, nonfinite="skip", **{**SMALL, "updates_per_step": 2})
    skipping.attach_market(market.train)
    before = [p.detach().clone() for p in skipping.q_net.parameters()]
    fit(skipping, trainer(tmp_path, max_steps=3, max_epochs=1, limit_train_batches=3))
    assert skipping.guard.skipped == 6  # two attempted updates per batch, none stepped
    assert skipping.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, skipping.q_net.parameters()))


@pytest.mark.parametrize("env_step_every", [1, 3])
def test_resume_from_checkpoint_is_exact(tmp_path, market, env_step_every) -> None:
    """Two epochs straight equal one epoch, a checkpoint, and a resumed second epoch: weights, replay, env, RNG.

    With env_step_every=3 the 20-update epoch ends two updates into a group of batches drawn ahead: the checkpoint
    carries the unused one.
    """
    kwargs = dict(n_features=3, env_step_every=env_step_every, **SMALL)

    straight = DQNModule(**kwargs)
    straight.attach_market(market.train)
    fit(straight, trainer(tmp_path / "a", max_epochs=2))
    assert straight.global_step == 40

    first = DQNModule(**kwargs)
    first.attach_market(market.train)
    t1 = trainer(tmp_path / "b", max_epochs=1)
    fit(first, t1)
    ckpt = tmp_path / "b" / "one.ckpt"
    t1.save_checkpoint(ckpt)

    resumed = DQNModule(**kwargs)
    resumed.attach_market(market.train)
    fit(resumed, trainer(tmp_path / "c", max_epochs=2), ckpt_path=str(ckpt))

    for pa, pb in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(pa, pb)
    assert resumed.env_steps == straight.env_steps
    sa, sb = straight.replay.state_dict(), resumed.replay.state_dict()
    for k in ("bars", "actions", "rewards", "last", "rng_state"):
        assert torch.equal(sa[k], sb[k]), k
    assert torch.equal(straight.env.bars, resumed.env.bars)
    assert torch.equal(straight.explore_rng.get_state(), resumed.explore_rng.get_state())


def test_updates_per_step_does_not_change_the_updates(tmp_path, market) -> None:
    """Batching updates into training steps is bookkeeping only: 1 or 7 per step train the same weights."""
    nets = []
    for u in (1, 7):
        module = DQNModule(n_features=3, updates_per_step=u, env_step_every=2, **SMALL)
        module.attach_market(market.train)
        t = trainer(tmp_path / str(u), max_epochs=2)
        fit(module, t)
        assert t.global_step == 40 and module.env_steps == 256 + 20 * 32
        nets.append(module.q_net)
    for pa, pb in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(pa, pb)


def test_training_metrics_reach_the_logger_at_update_steps(tmp_path, market) -> None:
    from lightning.pytorch.loggers import CSVLogger

    module = DQNModule(n_features=3, **SMALL)
    module.attach_market(market.train)
    fit(module, trainer(tmp_path, max_epochs=2, logger=CSVLogger(tmp_path, name="csv")))
    import csv

    with open(next(tmp_path.glob("csv/*/metrics.csv"))) as fh:
        rows = list(csv.DictReader(fh))
    steps = sorted({int(r["step"]) for r in rows if r.get("train/td_loss")})
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40]  # log_every_n_steps=5 counts updates, not training steps


def test_plateau_schedule_steps_on_the_validation_reward(tmp_path, market) -> None:
    module = DQNModule(n_features=3, scheduler="plateau", lr=1e-3, **SMALL)
    module.attach_market(market.train, market.val)
    seen = []
    module.on_validation_epoch_end = lambda: (seen.append(module._val_objective), DQNModule.on_validation_epoch_end(module))
    fit(module, trainer(tmp_path, max_epochs=3))
    sched = module.lr_schedulers()
    assert isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert len(seen) == 3 and all(v is not None for v in seen)
    assert sched.best == pytest.approx(min(seen))  # the scheduler saw exactly the validation objectives


def test_polyak_every_k_updates(tmp_path, market) -> None:
    module = DQNModule(n_features=3, polyak_every=4, tau=0.5, **SMALL)
    module.attach_market(market.train)
    before = [p.detach().clone() for p in module.target_net.parameters()]
    fit(module, trainer(tmp_path, max_steps=3))
    assert all(torch.equal(a, b) for a, b in zip(before, module.target_net.parameters()))  # no averaging yet
    fit(module, trainer(tmp_path / "more", max_steps=4))
    assert any(not torch.equal(a, b) for a, b in zip(before, module.target_net.parameters()))


class _StepCounter(L.Callback):
    """Listens to the optimizer-step hook, so the module must route every update through Lightning."""

    def __init__(self) -> None:
        self.before_backward = self.before_step = 0

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.before_backward += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before_step += 1


@pytest.mark.parametrize("exogenous,encoder", [("all_actions", "flat"), ("none", "conv")])
def test_lean_update_equals_lightning_dispatch(tmp_path, market, exogenous, encoder) -> None:
    """Without listeners an update calls backward and the optimizer directly; with one it goes through Lightning's
    hooks. Both train bit-identical weights, and a listening callback sees every single update."""
    kwargs = dict(n_features=market.train.n_features, exogenous=exogenous, encoder=encoder, **{**SMALL, "updates_per_step": 4})
    lean = DQNModule(**kwargs)
    lean.attach_market(market.train)
    fit(lean, trainer(tmp_path, max_steps=30, max_epochs=2))
    assert lean._lean_update

    counter = _StepCounter()
    dispatched = DQNModule(**kwargs)
    dispatched.attach_market(market.train)
    fit(dispatched, trainer(tmp_path, max_steps=30, max_epochs=2, callbacks=[counter]))
    assert not dispatched._lean_update
    assert counter.before_backward == counter.before_step == 30
    assert lean.global_step == dispatched.global_step == 30
    for a, b in zip(lean.q_net.parameters(), dispatched.q_net.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_can_monitor_a_training_metric(tmp_path, market) -> None:
    """Training metrics reach trainer.callback_metrics, so ModelCheckpoint/EarlyStopping can monitor them."""
    module = DQNModule(n_features=market.train.n_features, **SMALL)
    module.attach_market(market.train)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", monitor="train/td_loss", mode="min",
                                               every_n_train_steps=1)
    fit(module, trainer(tmp_path, max_steps=40, enable_checkpointing=True, callbacks=[ckpt]))
    assert ckpt.best_model_path and torch.isfinite(ckpt.best_model_score)
