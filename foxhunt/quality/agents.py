"""Agents' out-of-sample quality yardstick: simulated markets with a known conditional mean, baseline policies (the
causal oracles, flat, random, buy-and-hold) and the train-then-score run of a DQN member through the coordinator.

``scripts/dqn_quality.py`` prints these figures; the learning tests assert them. The AR(1) market is
r_t = φ·r_{t−1} + σ·√(1−φ²)·ε_t (one symbol, 1-minute bars), so the conditional mean known at bar t is m_t = φ·r_{t−1};
features are causal (the last return, the mean of the last 8 returns, the last return over an EWMA volatility),
z-scored with training-split statistics; splits are chronological with purge gaps.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import lightning as L
import numpy as np
import torch

from foxhunt.data.market_datamodule import MarketDataModule
from foxhunt.evaluation.trading import trading_metrics
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.quality.agent_tasks import MINUTE_NS, SyntheticMarket, split_market
from foxhunt.rl.env import MarketTensors
from foxhunt.trading.oracle import oracle_positions

__all__ = [
    "BARS_PER_YEAR",
    "ar1_market",
    "baseline_metrics",
    "best_causal_oracle",
    "default_dqn_kwargs",
    "generator_market",
    "run_quality",
    "splits_from_returns",
    "task_dqn_kwargs",
    "task_scores",
    "train_dqn",
    "train_on_task",
    "updates_per_step_for",
    "with_overrides",
]

BARS_PER_YEAR = 365.25 * 24 * 60


def ar1_market(
    n_bars: int = 200_000, phi: float = 0.1, sigma: float = 1e-3, seed: int = 0,
    fractions: tuple[float, float] = (0.6, 0.2), purge: int = 64,
) -> SyntheticMarket:
    """An AR(1)-returns market cut chronologically into MarketSplits (features fitted on train only)."""
    rng = np.random.default_rng(seed)
    eps = rng.standard_normal(n_bars)
    r = np.empty(n_bars)  # r[t] = ln C[t+1] - ln C[t]
    r[0] = sigma * eps[0]
    innov = sigma * math.sqrt(1.0 - phi * phi) * eps
    for t in range(1, n_bars):  # a scalar recurrence: data generation, not the trading code
        r[t] = phi * r[t - 1] + innov[t]
    expected = phi * np.concatenate([[np.nan], r[:-1]])
    return splits_from_returns(r, expected, np.arange(n_bars, dtype=np.int64) * MINUTE_NS, fractions, purge)


def generator_market(
    n_bars: int = 200_000, signal_strength: float = 0.1, seed: int = 0,
    fractions: tuple[float, float] = (0.6, 0.2), purge: int = 64,
) -> SyntheticMarket:
    """The project's synthetic market (foxhunt.data.synthetic: GARCH, fat tails, sessions) with its exact oracle."""
    from foxhunt.data.synthetic import generate_market

    m = generate_market(n_bars=n_bars, n_symbols=1, seed=seed, signal_strength=signal_strength)
    log_close = np.log(m.bars["close"].to_numpy(np.float64))
    r = np.append(np.diff(log_close), np.nan)
    ts = np.asarray(m.bars["timestamp"].array.asi8, dtype=np.int64)
    return splits_from_returns(r, m.oracle_mean, ts, fractions, purge)


_VOL_WARMUP = 32  # returns the volatility feature's EWMA is seeded with


def splits_from_returns(
    r: np.ndarray, expected: np.ndarray, timestamps_ns: np.ndarray, fractions: tuple[float, float], purge: int
) -> SyntheticMarket:
    """Causal features of one symbol's returns, z-scored on train, cut into train | purge | val | purge | test."""
    n_bars = r.shape[0]
    last_ret = np.concatenate([[np.nan], r[:-1]])  # known at bar t: ln C[t] - ln C[t-1]
    mean8 = np.convolve(np.nan_to_num(last_ret), np.ones(8) / 8.0, mode="full")[:n_bars]
    mean8[:8] = np.nan
    # Volatility-scaled last return: a causal EWMA of squared returns (half-life ~ 22 bars).
    # Seeded with the mean square of the first _VOL_WARMUP returns; the rows that read the seed before those bars
    # are known are warm-up (NaN, so no decision bar), so no row reads a later bar.
    sq = np.nan_to_num(last_ret) ** 2
    ewm = np.empty(n_bars)
    acc, lam = float(np.mean(sq[1 : _VOL_WARMUP + 1])), 0.97
    for t in range(n_bars):  # scalar recurrence of data preparation
        acc = lam * acc + (1 - lam) * sq[t]
        ewm[t] = acc
    vol_scaled = last_ret / np.sqrt(np.concatenate([[np.nan], ewm[:-1]]))
    vol_scaled[: _VOL_WARMUP + 1] = np.nan
    raw = np.stack([last_ret, mean8, vol_scaled], 1)
    names = ["ret_1_z", "ret_mean_8_z", "ret_1_over_ewm_vol_z"]
    return split_market(r, expected, raw, names, timestamps_ns, fractions, purge)


def baseline_metrics(
    market: MarketTensors, expected: torch.Tensor, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Oracle (markov, myopic, hindsight), flat, random and buy-and-hold on the same bars and costs."""
    def score(pos: torch.Tensor) -> dict[str, float]:
        m = trading_metrics(pos, market.returns, market.cost_bps, BARS_PER_YEAR, mask=market.decision, reset=market.reset_mask)
        return {k: float(v) for k, v in m.as_dict().items()}

    out = {}
    for kind in ("markov", "myopic", "hindsight"):
        pos = oracle_positions(expected, market.actions, market.cost_bps, market.decision, market.reset_mask, kind=kind)
        out[f"oracle_{kind}"] = score(pos)
    g = torch.Generator().manual_seed(seed)
    out["random"] = score(market.actions[torch.randint(0, market.n_actions, (market.n_bars,), generator=g)])
    out["flat"] = score(torch.zeros(market.n_bars))
    out["buy_and_hold"] = score(torch.ones(market.n_bars))
    return out


def best_causal_oracle(base: dict[str, dict[str, float]]) -> float:
    """The yardstick: the better causal oracle's reward per bar (the Markov one is only approximate when the
    conditional mean is not Markov in itself, e.g. under GARCH volatility, where the myopic rule can beat it)."""
    return max(base["oracle_markov"]["reward_per_bar"], base["oracle_myopic"]["reward_per_bar"])


def default_dqn_kwargs(steps: int) -> dict:
    """The configuration the quality figures are measured with (kept in one place for the test and the bench).

    ``cost_bps`` is the coordinator's (the member takes it from there); ``updates_per_epoch`` sets the data module's
    epoch length (validation every that many updates when validating); the rest are the DQN member's.
    """
    return {
        "window": 4, "n_envs": 256, "episode_length": 256, "cost_bps": 1.0, "gamma": 0.9, "hidden": (128, 128), "batch_size": 256,
        "replay_capacity": 262_144, "learning_starts": 16_384, "target_update": "polyak", "tau": 0.005,
        "epsilon_start": 1.0, "epsilon_end": 0.05, "epsilon_steps": max(1, steps // 4), "exogenous": "all_actions",
        "optim": {"lr": 3e-4, "weight_decay": 1e-4, "scheduler": "cosine", "total_steps": steps, "log_grad_norm_every": 0},
        "updates_per_epoch": min(steps, 1000), "dropout": 0.0, "obs_noise": 0.0, "select_every": 0, "patience": 0,
    }


def with_overrides(kwargs: dict[str, Any], overrides: dict[str, Any], updates: int) -> dict[str, Any]:
    """A member's arguments with ``overrides`` over them, its ``optim`` merged field by field, and updates per step
    that divide ``updates`` unless set."""
    optim = {"updates_per_step": updates_per_step_for(updates), **kwargs.get("optim", {}), **overrides.get("optim", {})}
    return {**kwargs, **overrides, "optim": optim}


def updates_per_step_for(steps: int, most: int = 16) -> int:
    """The largest number of updates per coordinator step, at most ``most``, that divides ``steps``: the Trainer
    stops at a step boundary, so this trains exactly ``steps`` updates."""
    return max(k for k in range(1, most + 1) if steps % k == 0)


def train_dqn(data: SyntheticMarket, steps: int, seed: int = 0, validate: bool = False, **overrides):
    """Train a DQN member for ``steps`` updates on ``data.train`` through the coordinator (``EnsembleModule`` with the
    DQN as its only member, fitted on a ``MarketDataModule``); returns (the trained DQNModule, seconds).

    The member keeps the coordinator's cost (``module.cost_bps``); ``module.evaluate(split)`` back-tests its greedy
    policy as before.
    """
    kwargs = with_overrides(default_dqn_kwargs(steps), overrides, steps)
    cost_bps = kwargs.pop("cost_bps")
    updates_per_epoch = kwargs.pop("updates_per_epoch")
    module = DQNModule(seed=seed, **kwargs)
    ensemble = EnsembleModule(members={"dqn": module}, cost_bps=cost_bps)
    dm = MarketDataModule(data.train, data.val if validate else None, data.test,
                          steps_per_epoch=math.ceil(updates_per_epoch / module.updates_per_step))
    trainer = L.Trainer(
        max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        limit_val_batches=1 if validate else 0, num_sanity_val_steps=0, deterministic=False,
    )
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(ensemble, datamodule=dm)
    return module, time.perf_counter() - t0


def run_quality(phi: float, steps: int, n_bars: int, seed: int = 0, market: str = "ar1", **overrides) -> dict:
    """Train on one market and report test-split metrics of the DQN next to the baselines."""
    if market == "ar1":
        data = ar1_market(n_bars=n_bars, phi=phi, seed=seed)
    else:
        data = generator_market(n_bars=n_bars, signal_strength=phi, seed=seed)
    module, seconds = train_dqn(data, steps, seed=seed, **overrides)
    dqn = module.evaluate(data.test)
    test_market = MarketTensors(data.test, module.hparams.window, tuple(module.hparams.actions), module.cost_bps)
    base = baseline_metrics(test_market, data.expected["test"], seed=seed)
    oracle = best_causal_oracle(base)
    return {
        "phi": phi, "steps": steps, "n_bars": n_bars, "seed": seed, "train_seconds": seconds,
        "env_steps": module.env_steps,
        "fraction_of_oracle": dqn["reward_per_bar"] / oracle if oracle > 0 else float("nan"),
        "dqn": dqn, **base,
    }


# ----------------------------------------------------------------------------------------------- generalisation tasks
def task_dqn_kwargs(updates: int) -> dict:
    """The DQN of the generalisation benchmark (foxhunt.quality.agent_tasks): the member's defaults (the measured ones),
    a 32-bar window, batches of 64 and the environment stepped every 4 updates (64 transitions per update);
    ``updates`` sets the exploration and the cosine schedule's length."""
    return {
        "window": 32, "batch_size": 64, "env_step_every": 4, "epsilon_steps": max(1, updates // 10),
        "optim": {"scheduler": "cosine", "total_steps": updates, "log_grad_norm_every": 0},
    }


def train_on_task(
    data: SyntheticMarket, updates: int, seed: int = 0, cost_bps: float = 1.0,
    min_edge_confidence: float | None = 0.95, **overrides,
) -> tuple[EnsembleModule, DQNModule, float]:
    """Train a DQN member through the coordinator on ``data.train`` (choosing its weights on ``data.val``), then let
    the coordinator decide on ``data.val`` whether it trades (``min_edge_confidence``); returns (the coordinator, the
    member, seconds)."""
    kwargs = with_overrides(task_dqn_kwargs(updates), overrides, updates)
    member = DQNModule(seed=seed, **kwargs)
    ensemble = EnsembleModule(members={"dqn": member}, cost_bps=cost_bps, min_edge_confidence=min_edge_confidence)
    dm = MarketDataModule(data.train, data.val, data.test, steps_per_epoch=math.ceil(updates / member.updates_per_step))
    trainer = L.Trainer(
        max_steps=updates, max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1, limit_val_batches=0, num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(ensemble, datamodule=dm)
        ensemble.evaluate(data.val, choose_weights=True)  # the weight choice and the do-no-harm rule, on validation
    return ensemble, member, time.perf_counter() - t0


def task_scores(positions: torch.Tensor, data: SyntheticMarket, cost_bps: float = 1.0, window: int = 32) -> dict:
    """Test-split figures of a policy's positions: fraction of the best causal oracle's reward per bar after costs
    (NaN without an oracle), total log return, turnover, reward per bar; plus the oracle's and buy-and-hold's."""
    market = MarketTensors(data.test, window, (-1.0, 0.0, 1.0), cost_bps)
    m = trading_metrics(positions.float(), market.returns, cost_bps, BARS_PER_YEAR, mask=market.decision,
                        reset=market.reset_mask)
    out = {"reward_per_bar": float(m.reward_per_bar), "log_return": float(m.total_log_return),
           "turnover": float(m.turnover), "fraction_of_oracle": float("nan"), "oracle_reward_per_bar": float("nan")}
    bh = trading_metrics(market.decision.float(), market.returns, cost_bps, BARS_PER_YEAR, mask=market.decision,
                         reset=market.reset_mask)
    out["buy_and_hold_log_return"] = float(bh.total_log_return)
    if data.has_oracle:
        oracle = best_causal_oracle(baseline_metrics(market, data.expected["test"]))
        out["oracle_reward_per_bar"] = oracle
        out["fraction_of_oracle"] = out["reward_per_bar"] / oracle if oracle > 0 else float("nan")
    return out
