"""DQNModule as an agent member of the coordinator: configuration checks, binding, targets, logging, target updates,
the non-finite guard, exact resume from a checkpoint, schedules and the backward paths.

The DQN trains only through ``EnsembleModule(members={"dqn": DQNModule(...)})`` fitted on a ``MarketDataModule``;
with a single member ``trainer.global_step`` counts DQN updates, and the Trainer stops at a coordinator step boundary
(after a multiple of ``updates_per_step`` updates).
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from foxhunt.data.market import MarketSpec
from foxhunt.data.market_datamodule import MarketDataModule
from foxhunt.lit.dqn import DQNModule, double_dqn_target
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.quality import agents as quality  # noqa: E402
from foxhunt.training.guard import NonFiniteError


@pytest.fixture(scope="module")
def market():
    return quality.ar1_market(n_bars=12_000, phi=0.3, seed=1)


# 4 updates per coordinator step, 5 steps per epoch: 20 updates per epoch
SMALL = {
    "window": 4, "n_envs": 32, "episode_length": 64, "hidden": (32, 32), "batch_size": 32, "replay_capacity": 4096,
    "learning_starts": 256, "epsilon_steps": 50,
    "optim": {"log_grad_norm_every": 5, "updates_per_step": 4},
    # deterministic networks for the TD arithmetic (the regularisers and the selection: test_dqn_generalisation.py)
    "dropout": 0.0, "obs_noise": 0.0, "select_every": 0,
}
UPDATES_PER_EPOCH = 20


def small(**optim: Any) -> dict[str, Any]:
    """SMALL with these optimisation settings over its own."""
    return {**SMALL, "optim": {**SMALL["optim"], **optim}}


def trainer(tmp_path: Path, **kw) -> L.Trainer:
    args = {
        "max_epochs": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "accelerator": "cpu", "devices": 1, "num_sanity_val_steps": 0, "log_every_n_steps": 5,
        "default_root_dir": str(tmp_path),
    }
    args.update(kw)
    return L.Trainer(**args)


def datamodule(market, validate: bool = False, updates_per_step: int = SMALL["optim"]["updates_per_step"]) -> MarketDataModule:
    """The market's splits; an epoch is UPDATES_PER_EPOCH updates of a member running ``updates_per_step`` per step."""
    assert UPDATES_PER_EPOCH % updates_per_step == 0
    return MarketDataModule(market.train, market.val if validate else None, market.test,
                            steps_per_epoch=UPDATES_PER_EPOCH // updates_per_step)


def fit(member: DQNModule, market, t: L.Trainer, validate: bool = False, model: EnsembleModule | None = None,
        **kw) -> EnsembleModule:
    """Fit the coordinator with ``member`` as its only member (or the given coordinator); returns the coordinator."""
    model = EnsembleModule(members={"dqn": member}) if model is None else model
    if not validate:
        t.limit_val_batches = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        t.fit(model, datamodule=datamodule(market, validate, member.updates_per_step), **kw)
    return model


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def test_constructor_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="gamma"):
        DQNModule(gamma=1.0)
    with pytest.raises(ValueError, match="n_step=1"):
        DQNModule(n_step=3, exogenous="all_actions")
    with pytest.raises(ValueError, match="target_update"):
        DQNModule(target_update="soft")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replay_capacity"):
        DQNModule(n_envs=256, replay_capacity=100)
    with pytest.raises(ValueError, match="updates_per_step"):
        DQNModule(optim={"updates_per_step": 0})
    with pytest.raises(ValueError, match="start_step"):
        DQNModule(optim={"start_step": -1})
    with pytest.raises(ValueError, match="cost_bps"):
        DQNModule(cost_bps=-1.0)
    with pytest.raises(ValueError, match="gradient_clip_val"):
        DQNModule(optim={"gradient_clip_val": -1.0})
    with pytest.raises(ValueError, match="learning rate"):
        DQNModule(optim={"lr": 0.0})
    m = DQNModule(n_features=2)
    with pytest.raises(RuntimeError, match="attach_market"):
        m._build_environment()
    with pytest.raises(RuntimeError, match="bind it"):
        _ = DQNModule().network  # no n_features, not bound: no networks yet


@pytest.mark.parametrize("n_envs,replay_capacity,learning_starts,n_step", [
    (8, 8 * 40, 8 * 60, 1),  # more warm-up than the replay holds
    (64, 1000, 1000, 1),  # equal, but the capacity rounds down to 15 steps of 64 agents and the warm-up needs 16
    (8, 24, 0, 3),  # an n-step sample needs n_step + 1 steps, the replay keeps 3
])
def test_a_warm_up_the_replay_cannot_hold_is_refused(market, n_envs, replay_capacity, learning_starts, n_step) -> None:
    """start() fills the replay until it holds the warm-up; a replay too small for it would loop forever, so the
    constructor refuses it in one line naming the settings."""
    kwargs = {"n_envs": n_envs, "replay_capacity": replay_capacity, "learning_starts": learning_starts, "n_step": n_step,
              "exogenous": "none", "batch_size": 16}
    with pytest.raises(ValueError, match=rf"learning_starts={learning_starts} with n_envs={n_envs} .*"
                                         rf"replay_capacity={replay_capacity} .*the warm-up would never end"):
        DQNModule(**kwargs)
    # the largest warm-up that fits fills the replay exactly and returns
    slots = replay_capacity // n_envs
    kwargs.update(learning_starts=slots * n_envs if slots > n_step else 0, replay_capacity=max(replay_capacity, (n_step + 1) * n_envs))
    module = DQNModule(window=4, hidden=(8,), dropout=0.0, obs_noise=0.0, select_every=0, **kwargs)
    module.attach_market(market.train)
    module.start()
    assert module.replay.size == max(slots if slots > n_step else 0, n_step + 1)


def test_attach_market_and_bind_check_features(tmp_path, market) -> None:
    assert market.train.n_features == 3
    with pytest.raises(ValueError, match="built for 5"):
        DQNModule(n_features=5).attach_market(market.train)
    with pytest.raises(ValueError, match="n_features=5"):
        DQNModule(n_features=5).bind(MarketSpec.of(market.train))
    with pytest.raises(ValueError, match="n_features=5"):  # the coordinator binds the member to the data at setup
        fit(DQNModule(n_features=5, **SMALL), market, trainer(tmp_path, max_steps=4))
    # without n_features the sizes come from the data, never into the hyperparameters
    bound = DQNModule(**SMALL)
    bound.bind(MarketSpec.of(market.train), extra_inputs=2)
    assert bound.n_inputs == 5 and bound.hparams.n_features is None
    attached = DQNModule(**SMALL)
    attached.attach_market(market.train)
    assert attached.n_inputs == 3 and attached.q_net.n_features == 3


def test_epsilon_schedules() -> None:
    lin = DQNModule(epsilon_start=1.0, epsilon_end=0.1, epsilon_steps=100)
    assert lin.epsilon(0) == 1.0 and lin.epsilon(50) == pytest.approx(0.55) and lin.epsilon(500) == pytest.approx(0.1)
    exp = DQNModule(epsilon_schedule="exponential", epsilon_start=1.0, epsilon_end=0.01, epsilon_steps=100)
    assert exp.epsilon(50) == pytest.approx(0.1) and exp.epsilon(1000) == pytest.approx(0.01)


def test_same_seed_same_initial_weights_and_no_global_rng_use(market) -> None:
    spec = MarketSpec.of(market.train)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = DQNModule(n_features=2, seed=7), DQNModule(n_features=2, seed=7)
    c, d = DQNModule(seed=7), DQNModule(seed=7)
    c.bind(spec)
    d.bind(spec)
    assert torch.rand(1) == before  # building the networks (at construction or binding) did not consume the global RNG
    assert same_parameters(a, b) and same_parameters(c, d)
    assert not torch.equal(next(DQNModule(n_features=2, seed=8).parameters()), next(a.parameters()))


def test_double_dqn_target_uses_online_argmax_and_target_values() -> None:
    q_online = torch.tensor([[1.0, 3.0, 2.0], [5.0, 0.0, 1.0]])
    q_target = torch.tensor([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]])
    r, d = torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.0])
    assert double_dqn_target(q_online, q_target, r, d).tolist() == [1.0 + 0.5 * 20.0, -1.0]
    assert double_dqn_target(q_online, q_target, r, d, double=False).tolist() == [1.0 + 0.5 * 30.0, -1.0]
    with pytest.raises(ValueError, match="online"):
        double_dqn_target(None, q_target, r, d)


def test_td_targets_of_all_actions_match_a_direct_computation(tmp_path, market) -> None:
    """The exogenous mode regresses every action of (t, p) onto r(t, p, a) + γ·Q_target((t+1, a), argmax Q_online).

    Checked after a few coordinator updates, so the online and target networks differ (Polyak averaging)."""
    module = DQNModule(gamma=0.7, tau=0.5, **SMALL)
    fit(module, market, trainer(tmp_path, max_steps=8))
    assert not same_parameters(module.q_net, module.target_net)
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
    module = DQNModule(exogenous=exogenous, n_step=n_step, dueling=dueling, encoder=encoder, **SMALL)
    t = trainer(tmp_path)
    model = fit(module, market, t, validate=True, model=EnsembleModule(members={"dqn": module}, cost_bps=0.5,
                                                                min_edge_confidence=None))  # the member itself
    assert module.cost_bps == 0.5  # the member has no cost of its own: the coordinator's
    logged = t.callback_metrics
    blocks = [f"grad_norm/dqn/{b}" for b in ("total", "body", *(("encoder",) if encoder == "conv" else ()))]
    blocks += ["grad_norm/dqn/value_head", "grad_norm/dqn/advantage_head"] if dueling else ["grad_norm/dqn/head"]
    keys = [f"train/dqn/{k}" for k in ("td_loss", "q_mean", "q_max", "epsilon", "reward_per_bar", "env_steps_per_s",
                                       "nonfinite_skipped", "updates")]
    keys += [f"val/dqn/{k}" for k in ("sharpe", "reward_per_bar", "total_log_return", "max_drawdown", "turnover",
                                      "hit_rate", "n_trades")]
    keys += ["lr/dqn", "val/ensemble/sharpe", "val/sharpe", *blocks]
    for key in keys:
        assert key in logged, key
        assert torch.isfinite(logged[key]) or key == "val/dqn/hit_rate", key
    assert logged["train/dqn/env_steps_per_s"] > 0
    assert logged["train/dqn/updates"] == UPDATES_PER_EPOCH and logged["train/dqn/nonfinite_skipped"] == 0
    assert module.env_steps == 256 + UPDATES_PER_EPOCH * 32  # warm-up plus one step of all agents per update
    assert t.global_step == model.updates["dqn"] == UPDATES_PER_EPOCH
    assert model.steps == UPDATES_PER_EPOCH // SMALL["optim"]["updates_per_step"]
    # what was logged is the coordinator's evaluation of the member's greedy policy
    evaluation = model.last_evaluation
    assert evaluation is not None
    assert float(logged["val/dqn/reward_per_bar"]) == pytest.approx(evaluation.metrics["dqn"]["reward_per_bar"], rel=1e-5)
    torch.testing.assert_close(evaluation.positions["dqn"].cpu(), module.positions(market.val).cpu())


def test_hard_target_sync(tmp_path, market) -> None:
    kwargs = {**small(updates_per_step=5), "target_update": "hard", "target_update_every": 10}
    synced = DQNModule(**kwargs)
    fit(synced, market, trainer(tmp_path, max_steps=10))
    assert same_parameters(synced.q_net, synced.target_net)
    later = DQNModule(**kwargs)
    fit(later, market, trainer(tmp_path, max_steps=15))  # five updates after the sync at 10
    assert not same_parameters(later.q_net, later.target_net)
    assert same_parameters(synced.q_net, later.target_net)  # the target holds the online weights of update 10


def test_nonfinite_loss_raises_or_skips(tmp_path, market, monkeypatch) -> None:
    def nan_loss(self, batch):
        mk = self.env.market
        q = self.q_net(mk.windows(batch.sample.bars), mk.position_features(batch.sample.positions))
        return q.sum() * float("nan"), q.detach()

    monkeypatch.setattr(DQNModule, "_td_loss", nan_loss)
    raising = DQNModule(**small(nonfinite="raise"))
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        fit(raising, market, trainer(tmp_path, max_steps=3))
    skipping = DQNModule(**small(nonfinite="skip", updates_per_step=2))
    skipping.attach_market(market.train)  # builds the networks now, to compare the weights after
    before = [p.detach().clone() for p in skipping.q_net.parameters()]
    t = trainer(tmp_path, max_steps=3, limit_train_batches=3, log_every_n_steps=1)
    model = fit(skipping, market, t)
    assert skipping.guard.skipped == 6  # two attempted updates per coordinator step, none stepped
    assert model.updates["dqn"] == 0 and t.global_step == 0
    assert t.callback_metrics["train/dqn/nonfinite_skipped"] == 6
    assert all(torch.equal(a, b) for a, b in zip(before, skipping.q_net.parameters()))
    # six attempts at update 0 stepped the agents once: the warm-up's steps, then one act's (as one attempt would)
    warm_up = -(-SMALL["learning_starts"] // SMALL["n_envs"]) * SMALL["n_envs"]
    assert skipping.env_steps == warm_up + SMALL["n_envs"], skipping.env_steps


def test_nonfinite_gradients_raise_or_skip(tmp_path, market, monkeypatch) -> None:
    """A finite loss with NaN gradients: the coordinator applies the member's guard to the gradients too."""

    def nan_gradients(self, batch):
        mk = self.env.market
        q = self.q_net(mk.windows(batch.sample.bars), mk.position_features(batch.sample.positions))
        return torch.sqrt(q.sum() * 0.0), q.detach()  # loss 0, gradient inf·0 = NaN

    monkeypatch.setattr(DQNModule, "_td_loss", nan_gradients)
    with pytest.raises(NonFiniteError, match="non-finite gradients"):
        fit(DQNModule(**small(nonfinite="raise")), market, trainer(tmp_path, max_steps=3))
    skipping = DQNModule(**small(nonfinite="skip", updates_per_step=2))
    model = fit(skipping, market, trainer(tmp_path, max_steps=3, limit_train_batches=3))
    assert skipping.guard.skipped_gradients == 6 and skipping.guard.skipped_loss == 0
    assert model.updates["dqn"] == 0


@pytest.mark.parametrize("env_step_every", [1, 3])
def test_resume_from_checkpoint_is_exact(tmp_path, market, env_step_every) -> None:
    """Two epochs straight equal one epoch, a checkpoint, and a resumed second epoch: weights, optimizer, replay,
    environment, RNGs, counters.

    With env_step_every=3 the 20-update epoch ends two updates into a group of batches drawn ahead: the checkpoint
    carries the unused one.
    """
    kwargs = dict(env_step_every=env_step_every, **SMALL)
    if env_step_every == 3:  # dropout masks and observation noise come from the member's own saved stream
        kwargs.update(dropout=0.2, obs_noise=0.5)

    straight = DQNModule(**kwargs)
    straight_model = fit(straight, market, trainer(tmp_path / "a", max_epochs=2))
    assert straight_model.updates["dqn"] == 2 * UPDATES_PER_EPOCH

    first = DQNModule(**kwargs)
    t1 = trainer(tmp_path / "b", max_epochs=1)
    fit(first, market, t1)
    ckpt = tmp_path / "b" / "one.ckpt"
    t1.save_checkpoint(ckpt)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["ensemble_state"]
    assert state["updates"] == {"dqn": UPDATES_PER_EPOCH} and state["started"] == ["dqn"]
    assert {"env", "replay", "explore_rng", "presampled", "guard"} <= set(state["members"]["dqn"])
    assert (state["members"]["dqn"]["presampled"] is None) == (UPDATES_PER_EPOCH % env_step_every == 0)

    resumed = DQNModule(**kwargs)
    t2 = trainer(tmp_path / "c", max_epochs=2)
    resumed_model = fit(resumed, market, t2, ckpt_path=str(ckpt))

    assert resumed_model.updates == straight_model.updates and resumed_model.steps == straight_model.steps
    assert t2.global_step == 2 * UPDATES_PER_EPOCH
    for (ka, pa), (kb, pb) in zip(straight_model.state_dict().items(), resumed_model.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(pa, pb), ka
    oa, ob = straight_model.optimizers().optimizer.state_dict(), resumed_model.optimizers().optimizer.state_dict()
    for i, s in oa["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][i][k])), (i, k)
    assert resumed.env_steps == straight.env_steps
    sa, sb = straight.replay.state_dict(), resumed.replay.state_dict()
    for k in ("bars", "positions", "actions", "rewards", "last", "rng_state"):
        assert torch.equal(sa[k], sb[k]), k
    assert (sa["head"], sa["size"]) == (sb["head"], sb["size"])
    ea, eb = straight.env.state_dict(), resumed.env.state_dict()
    assert ea.keys() == eb.keys()
    for k in ea:
        assert torch.equal(torch.as_tensor(ea[k]), torch.as_tensor(eb[k])), k
    assert torch.equal(straight.explore_rng.get_state(), resumed.explore_rng.get_state())


def test_updates_per_step_does_not_change_the_updates(tmp_path, market) -> None:
    """Grouping updates into coordinator steps is bookkeeping only: 1 or 4 per step train bit-identical weights."""
    models = []
    for u in (1, 4):
        module = DQNModule(**{**small(updates_per_step=u), "env_step_every": 2})
        t = trainer(tmp_path / str(u), max_epochs=2)
        model = fit(module, market, t)
        assert t.global_step == model.updates["dqn"] == 2 * UPDATES_PER_EPOCH
        assert model.steps == 2 * UPDATES_PER_EPOCH // u
        assert module.env_steps == 256 + UPDATES_PER_EPOCH * 32  # one step of all agents every second update
        models.append(model)
    a, b = (m.member("dqn") for m in models)
    assert same_parameters(a.q_net, b.q_net) and same_parameters(a.target_net, b.target_net)


def test_training_metrics_reach_the_logger_every_log_every_n_steps(tmp_path, market) -> None:
    from lightning.pytorch.loggers import CSVLogger

    module = DQNModule(**SMALL)
    model = fit(module, market, trainer(tmp_path, max_epochs=2, log_every_n_steps=2,
                                        logger=CSVLogger(tmp_path, name="csv")))
    assert model.steps == 10
    with open(next(tmp_path.glob("csv/*/metrics.csv"))) as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("train/dqn/td_loss")]
    # every second coordinator step (of 4 updates each), at the logger's step count
    assert [int(float(r["train/dqn/updates"])) for r in rows] == [8, 16, 24, 32, 40]
    assert all(float(r["lr/dqn"]) == pytest.approx(SMALL["optim"].get("lr", 3e-4)) for r in rows)


def test_plateau_schedule_steps_on_the_validation_reward(tmp_path, market) -> None:
    seen: list[float] = []

    class Record(L.Callback):
        def on_validation_end(self, trainer, pl_module) -> None:
            seen.append(-pl_module.last_evaluation.metrics["dqn"]["reward_per_bar"])

    module = DQNModule(**small(scheduler="plateau", lr=1e-3))
    model = fit(module, market, trainer(tmp_path, max_epochs=3, callbacks=[Record()]), validate=True)
    sched = model.lr_schedulers()
    assert isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert model._schedulers["dqn"] is sched
    assert len(seen) == 3 and sched.last_epoch == 3
    assert sched.best == pytest.approx(min(seen))  # the scheduler saw exactly the negated validation rewards


def test_plateau_schedule_steps_on_the_agents_own_reward_while_the_rule_holds_it_flat(tmp_path, market) -> None:
    """Held flat by the do-no-harm rule, the agent's table reward is 0 at every validation; its plateau schedule
    must see the reward of its own policy, or it cuts the rate every plateau_patience epochs whatever it learns."""
    from foxhunt.evaluation.backtest import policy_metrics

    own: list[float] = []
    held: list[bool] = []

    class Record(L.Callback):
        def on_validation_end(self, trainer, pl_module) -> None:
            split = pl_module._splits["val"]
            pos = pl_module.agent("dqn").positions(split)
            own.append(-policy_metrics({"dqn": pos}, split, pl_module.hparams.cost_bps)["dqn"]["reward_per_bar"])
            held.append(bool(pl_module.held_flat[0]))

    module = DQNModule(**small(scheduler="plateau", lr=1e-3))
    model = EnsembleModule(members={"dqn": module}, min_edge_confidence=0.999999)
    model = fit(module, market, trainer(tmp_path, max_epochs=3, callbacks=[Record()]), validate=True, model=model)
    sched = model.lr_schedulers()
    assert len(own) == 3 and all(held) and any(v != 0.0 for v in own)
    assert sched.best == pytest.approx(min(own))  # its own policy's negated rewards, not the held table's zeros


def test_polyak_every_k_updates(tmp_path, market) -> None:
    kwargs = {**small(updates_per_step=1), "polyak_every": 4, "tau": 0.5}
    three = DQNModule(**kwargs)
    initial = [p.detach().clone() for p in DQNModule(**kwargs, n_features=3).target_net.parameters()]
    fit(three, market, trainer(tmp_path, max_steps=3))
    assert all(torch.equal(a, b) for a, b in zip(initial, three.target_net.parameters()))  # no averaging yet
    four = DQNModule(**kwargs)
    fit(four, market, trainer(tmp_path / "more", max_steps=4))
    assert not same_parameters(four.target_net, three.target_net)
    for init, online, target in zip(initial, four.q_net.parameters(), four.target_net.parameters(), strict=True):
        assert torch.equal(target, init.lerp(online, 0.5))  # one average, after the fourth update


@pytest.mark.parametrize("limit", [
    {"max_epochs": 2},
    {"max_steps": 40, "max_epochs": 10},  # max_steps counts updates: it caps the span as it is, not x updates_per_step
    {"max_steps": 40, "max_epochs": -1},
])
def test_cosine_schedule_without_total_steps_spans_the_fit(tmp_path, market, limit) -> None:
    """total_steps=None: the cosine decays to zero over the updates the fit actually takes (40 either way)."""
    module = DQNModule(**small(scheduler="cosine"))
    model = fit(module, market, trainer(tmp_path, **limit))
    assert model.updates["dqn"] == 2 * UPDATES_PER_EPOCH
    assert model.optimizers().param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


class _StepCounter(L.Callback):
    """Listens to the backward hook, so the coordinator must route every update through Lightning's dispatch."""

    def __init__(self) -> None:
        self.before_backward = self.before_step = 0

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.before_backward += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before_step += 1


@pytest.mark.parametrize("exogenous,encoder", [("all_actions", "flat"), ("none", "conv")])
def test_a_callback_listening_to_backward_sees_every_update(tmp_path, market, exogenous, encoder) -> None:
    """The coordinator's backward goes through Lightning's manual_backward, so a callback hooking backward and the
    optimizer step is called at every DQN update."""
    member = DQNModule(exogenous=exogenous, encoder=encoder, **SMALL)
    model = EnsembleModule(members={"dqn": member})
    counter = _StepCounter()
    t = trainer(tmp_path, max_steps=32, max_epochs=2, callbacks=[counter])
    fit(member, market, t, model=model)
    assert t.global_step == model.updates["dqn"] == 32
    assert counter.before_backward == counter.before_step == 32


def test_checkpoint_can_monitor_a_training_metric(tmp_path, market) -> None:
    """Training metrics reach trainer.callback_metrics, so ModelCheckpoint/EarlyStopping can monitor them."""
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", monitor="train/dqn/td_loss", mode="min",
                                               every_n_train_steps=1)
    fit(DQNModule(**SMALL), market, trainer(tmp_path, max_steps=40, max_epochs=2, enable_checkpointing=True,
                                            callbacks=[ckpt]))
    assert ckpt.best_model_path and torch.isfinite(ckpt.best_model_score)
    state = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=False)
    assert "ensemble_state" in state and state["ensemble_state"]["members"]["dqn"]["replay"]["size"] > 0
