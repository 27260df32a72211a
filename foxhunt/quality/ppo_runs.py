"""PPO's train-then-score runs: one ``train_ppo`` for the learning tests, ``scripts/ppo_quality.py`` and the quality
table on the agents' task family (:mod:`foxhunt.quality.agent_tasks`), always through the coordinator as ``python -m
foxhunt.fit`` trains it (``EnsembleModule`` with PPO as its only member, a ``MarketDataModule``, a Lightning Trainer).

    ensemble, member, seconds = train_ppo(data, updates_for_env_steps(500_000), window=32)
    member.evaluate(data.test)                      # the member's own deterministic policy
    ensemble.positions(data.test)["ppo"]            # the same, flat if the coordinator's do-no-harm rule held it flat
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import lightning as L

from foxhunt.data.market_datamodule import MarketDataModule
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.ppo import PPOModule
from foxhunt.quality.agent_tasks import SyntheticMarket
from foxhunt.quality.agents import with_overrides


def updates_for_env_steps(env_steps: int, **overrides: Any) -> int:
    """Minibatch updates of the whole rollouts nearest ``env_steps`` environment steps (at least one rollout) for a
    PPOModule with ``overrides``: rollouts x ``n_epochs`` x ``n_minibatches``."""
    hp = PPOModule(**overrides).hparams
    rollouts = max(1, round(env_steps / (hp.n_envs * hp.n_steps)))
    return rollouts * hp.n_epochs * hp.n_minibatches


def train_ppo(
    data: SyntheticMarket, updates: int, seed: int = 0, cost_bps: float = 1.0, validate: bool = False,
    min_edge_confidence: float | None = None, **overrides: Any,
) -> tuple[EnsembleModule, PPOModule, float]:
    """Train a PPOModule (``overrides`` on its defaults) for ``updates`` minibatch updates on ``data.train`` as the
    coordinator's only member; with ``validate``, the coordinator then decides on ``data.val`` whether it trades
    (``min_edge_confidence``, its do-no-harm rule). Returns (the coordinator, the member, seconds)."""
    member = PPOModule(seed=seed, **with_overrides({"optim": {"log_grad_norm_every": 0}}, overrides, updates))
    ensemble = EnsembleModule(members={"ppo": member}, cost_bps=cost_bps, min_edge_confidence=min_edge_confidence)
    dm = MarketDataModule(data.train, data.val if validate else None, data.test,
                          steps_per_epoch=math.ceil(updates / member.updates_per_step))
    trainer = L.Trainer(max_steps=updates, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        limit_val_batches=0, num_sanity_val_steps=0)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(ensemble, datamodule=dm)
        if validate:
            ensemble.evaluate(data.val, choose_weights=True)  # the do-no-harm rule, on validation
    return ensemble, member, time.perf_counter() - t0
