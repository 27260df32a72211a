"""foxhunt's DQN, trained the way users train it, against Stable-Baselines3's DQN on the same trading task.

foxhunt's learner is the path ``python -m foxhunt.fit`` builds: ``DQNModule`` as the one member of an
``EnsembleModule`` coordinator, fitted by a Lightning ``Trainer`` on a ``MarketDataModule`` (logger, checkpoints,
progress bar, model summary, sanity check and validation off; ``max_steps`` = gradient updates, since
``global_step`` counts optimizer updates). Stable-Baselines3 2.x runs its own ``DQN`` on a gymnasium env with the
semantics of foxhunt's ``MarketEnv`` (foxhunt.quality.gym_env).

Same task for both (scripts/dqn_quality.py's AR(1) market): observation = the last W rows of the features flattened,
plus the one-hot held position; actions short/flat/long; reward = scale·(log1p(position·expm1(r)) + log1p(−cost·|Δposition|)),
foxhunt's own exact per-bar log return (``MarketTensors.rewards_all``, tabulated for the gym env), the same
scale (1 / std of the training returns); episodes of the same length start flat at random bars and end by time limit
(bootstrapped by both). Same learner settings, SB3's own DQN configuration: a 128-128 ReLU MLP without LayerNorm,
Adam at lr 1e-4 without decay or schedule, batch 64, γ, Huber loss (δ = 1), gradient clipping at 10, the same replay
warm-up with uniform random actions, hard target syncs every ``--target-update-interval`` updates (SB3's default
10,000; its counter runs over environment steps including the warm-up, so the warm-up defaults to the interval and
the syncs fall on the same updates, SB3's one update earlier), the same linear ε schedule per update (SB3's
``exploration_fraction`` is set so that ε reaches its end at the same update, foxhunt's ε starts where SB3's stands
after the warm-up), and the same number of gradient updates. SB3 steps one environment per update (``train_freq`` 1,
``gradient_steps`` 1).

foxhunt rows (``--rows``; all plain DQN targets on the taken action, ``exogenous="none"``, ``double_dqn=False``,
SB3's algorithm, unless the name says otherwise):

- ``dqn-1x1``: 1 agent stepped before every update: one new transition per update, exactly SB3's loop;
- ``dqn-8x8``: 8 agents stepped before every 8th update: one transition per update on average, acting batched;
- ``dqn-1024x8``: 1024 agents stepped before every 8th update (128 transitions per update): vectorised acting;
- ``all_actions-1024x8``: foxhunt's default targets (Double DQN, regressing every action of a sampled state).

Both learners run on one thread (``torch.set_num_threads(1)``), interleaved: every repeat runs every learner once, in
turn, and the figures are medians over repeats (ratios: medians of per-repeat ratios). Speeds are measured over the
training phase (from the end of the replay warm-up to the last update; for foxhunt from the end of the first Trainer
step, i.e. after the warm-up and the first ``updates_per_step`` updates), per wall second and per CPU second of the
process; "total s" is the whole ``learn`` / ``Trainer.fit`` call (Trainer start and warm-up included). On a shared
machine wall time also counts time taken by other processes, CPU time does not. Greedy policies are scored on the
test split with the same vectorised back-test, as a fraction of the best causal oracle's reward per bar after costs.

    pip install 'stable-baselines3>=2.3' 'gymnasium>=0.29'      # the optional "bench" extra
    python scripts/bench_dqn.py --updates 10000 --repeats 3
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from foxhunt.evaluation.trading import trading_metrics
from foxhunt.quality.agent_tasks import SyntheticMarket
from foxhunt.quality.agents import BARS_PER_YEAR, ar1_market, baseline_metrics, best_causal_oracle
from foxhunt.quality.gym_env import make_gym_env
from foxhunt.rl.env import MarketTensors, greedy_positions

ACTIONS = (-1.0, 0.0, 1.0)
COST_BPS = 1.0
EPS_START, EPS_END = 1.0, 0.05

# name -> (n_envs, env_step_every, exogenous, double_dqn)
ROWS = {
    "dqn-1x1": (1, 1, "none", False),
    "dqn-8x8": (8, 8, "none", False),
    "dqn-1024x8": (1024, 8, "none", False),
    "all_actions-1024x8": (1024, 8, "all_actions", True),
}


@dataclass
class Run:
    """One training run: its training-phase counts and times, the whole call's time, and the test score."""

    env_steps: int  # environment transitions during the training phase
    updates: int  # gradient updates during the training phase
    wall: float  # training-phase seconds
    cpu: float  # training-phase CPU seconds of the process
    total: float  # the whole learn / fit call (start and warm-up included)
    frac: float  # test reward per bar / the oracle's
    reward_per_bar: float
    turnover: float

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.wall

    @property
    def updates_per_cpu_s(self) -> float:
        return self.updates / self.cpu

    @property
    def env_steps_per_s(self) -> float:
        return self.env_steps / self.wall


@dataclass
class Settings:
    """What both learners share (derived from the command line)."""

    window: int
    episode_length: int
    gamma: float
    lr: float
    batch_size: int
    learning_starts: int
    target_update_interval: int
    updates: int
    epsilon_updates: int  # updates over which ε decays to its end
    reward_scale: float
    seed: int

    @property
    def epsilon_start(self) -> float:
        """SB3's ε after the warm-up: it decays over environment steps from the first one (warm-up included)."""
        return EPS_START + (EPS_END - EPS_START) * self.learning_starts / (self.learning_starts + self.epsilon_updates)

    @property
    def exploration_fraction(self) -> float:
        """SB3's fraction of ``learning_starts + updates`` steps after which ε stays at its end."""
        return (self.learning_starts + self.epsilon_updates) / (self.learning_starts + self.updates)


def score(positions: torch.Tensor, market: MarketTensors, oracle: float) -> tuple[float, float, float]:
    m = trading_metrics(positions, market.returns, market.cost_bps, BARS_PER_YEAR, mask=market.decision, reset=market.reset_mask)
    return float(m.reward_per_bar) / oracle, float(m.reward_per_bar), float(m.turnover)


def run_foxhunt(data: SyntheticMarket, test: MarketTensors, oracle: float, s: Settings, row: str, updates_per_step: int) -> Run:
    """foxhunt's learner as users run it: DQNModule in an EnsembleModule, a MarketDataModule and a Lightning Trainer."""
    import lightning as L

    from foxhunt.data.market_datamodule import MarketDataModule
    from foxhunt.lit.dqn import DQNModule
    from foxhunt.lit.ensemble import EnsembleModule

    n_envs, every, exogenous, double = ROWS[row]
    member = DQNModule(
        window=s.window, actions=ACTIONS, n_envs=n_envs, env_step_every=every, episode_length=s.episode_length,
        reward_scale=s.reward_scale, gamma=s.gamma, hidden=(128, 128), layer_norm=False, double_dqn=double,
        exogenous=exogenous, batch_size=s.batch_size, learning_starts=s.learning_starts,
        target_update="hard", target_update_every=s.target_update_interval,
        epsilon_start=s.epsilon_start, epsilon_end=EPS_END, epsilon_steps=s.epsilon_updates,
        huber_delta=1.0, dropout=0.0, obs_noise=0.0, turnover_penalty_bps=0.0, select_every=0, patience=0,  # SB3 has none of these
        optim={"lr": s.lr, "weight_decay": 0.0, "scheduler": "none", "gradient_clip_val": 10.0,
               "updates_per_step": updates_per_step},
        seed=s.seed,
    )
    model = EnsembleModule(members={"dqn": member}, cost_bps=COST_BPS)
    steps = math.ceil(s.updates / updates_per_step)
    dm = MarketDataModule(data.train, steps_per_epoch=steps)
    mark: dict[str, float] = {}

    class Mark(L.Callback):
        """The training phase starts after the first Trainer step (the warm-up and its first updates)."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 1 and not mark:
                mark.update(wall=time.perf_counter(), cpu=time.process_time(), env=member.env_steps,
                            updates=trainer.global_step)

    trainer = L.Trainer(
        max_steps=s.updates, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[Mark()],
    )
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, datamodule=dm)
    wall1, cpu1 = time.perf_counter(), time.process_time()
    done = model.updates["dqn"]
    assert done == trainer.global_step, (done, trainer.global_step)
    positions, _ = member.greedy_positions(test)
    return Run(member.env_steps - int(mark["env"]), done - int(mark["updates"]), wall1 - mark["wall"], cpu1 - mark["cpu"],
               wall1 - t0, *score(positions, test, oracle))


def run_sb3(train: MarketTensors, test: MarketTensors, oracle: float, s: Settings) -> Run:
    """Stable-Baselines3's DQN at its own configuration, on the same task and settings."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback

    env = make_gym_env(train, s.episode_length, s.seed)
    model = DQN(
        "MlpPolicy", env, learning_rate=s.lr, buffer_size=262_144, learning_starts=s.learning_starts,
        batch_size=s.batch_size, tau=1.0, gamma=s.gamma, train_freq=1, gradient_steps=1,
        target_update_interval=s.target_update_interval, exploration_fraction=s.exploration_fraction,
        exploration_initial_eps=EPS_START, exploration_final_eps=EPS_END, max_grad_norm=10.0,
        policy_kwargs={"net_arch": [128, 128]}, seed=s.seed, device="cpu",
    )
    mark: dict[str, float] = {}

    class Mark(BaseCallback):
        """The training phase starts after the warm-up's last step (updates follow the steps after it)."""

        def _on_step(self) -> bool:
            if self.num_timesteps == s.learning_starts:
                mark.update(wall=time.perf_counter(), cpu=time.process_time(), env=self.num_timesteps,
                            updates=self.model._n_updates)
            return True

    t0 = time.perf_counter()
    model.learn(total_timesteps=s.learning_starts + s.updates, callback=Mark())
    wall1, cpu1 = time.perf_counter(), time.process_time()
    assert model._n_updates == s.updates, (model._n_updates, s.updates)
    q = model.q_net.eval()

    def sb3_q(windows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return q(torch.cat([windows.flatten(1), positions], 1))

    with torch.no_grad():
        positions = greedy_positions(sb3_q, test)
    return Run(model.num_timesteps - int(mark["env"]), model._n_updates - int(mark["updates"]), wall1 - mark["wall"],
               cpu1 - mark["cpu"], wall1 - t0, *score(positions, test, oracle))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=10_000, help="gradient updates of every learner")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (medians are reported)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"foxhunt configurations, of {', '.join(ROWS)}")
    p.add_argument("--skip-sb3", action="store_true")
    p.add_argument("--phi", type=float, default=0.1)
    p.add_argument("--n-bars", type=int, default=500_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--gamma", type=float, default=0.9)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--episode-length", type=int, default=256)
    p.add_argument("--target-update-interval", type=int, default=10_000,
                   help="updates between hard target syncs (SB3's default; the same for both)")
    p.add_argument("--learning-starts", type=int, default=None,
                   help="replay warm-up transitions (default: the target interval, so both learners sync after the same updates)")
    p.add_argument("--updates-per-step", type=int, default=16, help="foxhunt's updates per Trainer step (its default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    torch.set_num_threads(args.threads)

    data = ar1_market(n_bars=args.n_bars, phi=args.phi, seed=args.seed)
    train = MarketTensors(data.train, args.window, ACTIONS, COST_BPS)
    train.reward_scale = 1.0 / float(train.signal[train.decision].std())  # DQNModule's own rule, given to both
    test = MarketTensors(data.test, args.window, ACTIONS, COST_BPS)
    oracle = best_causal_oracle(baseline_metrics(test, data.expected["test"]))
    s = Settings(
        window=args.window, episode_length=args.episode_length, gamma=args.gamma, lr=args.lr, batch_size=args.batch_size,
        learning_starts=args.target_update_interval if args.learning_starts is None else args.learning_starts,
        target_update_interval=args.target_update_interval, updates=args.updates,
        epsilon_updates=max(1, args.updates // 4), reward_scale=train.reward_scale, seed=args.seed,
    )

    names = ([] if args.skip_sb3 else ["sb3"]) + [f"foxhunt/{r}" for r in rows]
    runs: dict[str, list[Run]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:  # every learner once per repeat, in turn: drift on a shared machine hits all alike
            if name == "sb3":
                runs[name].append(run_sb3(train, test, oracle, s))
            else:
                runs[name].append(run_foxhunt(data, test, oracle, s, name.split("/", 1)[1], args.updates_per_step))
            r = runs[name][-1]
            print(f"repeat {rep + 1}/{args.repeats} {name:28s} {r.updates_per_s:8.0f} updates/s {r.updates_per_cpu_s:8.0f} "
                  f"updates/CPU-s {r.env_steps_per_s:10.0f} env steps/s  frac oracle {r.frac:.3f}", flush=True)

    def med(name: str, f) -> float:
        return statistics.median(f(r) for r in runs[name])

    print(f"\nAR(1) phi={args.phi} batch={s.batch_size} lr={s.lr} gamma={s.gamma} updates={s.updates} "
          f"warm-up={s.learning_starts} hard target sync every {s.target_update_interval} updates, threads={args.threads}, "
          f"repeats={args.repeats} (medians); foxhunt {args.updates_per_step} updates per Trainer step; "
          f"oracle reward/bar={oracle:.3e}")
    print(f"{'learner':30s}{'agents/every':>13s}{'env steps':>11s}{'updates':>9s}{'total s':>9s}{'train s':>9s}{'CPU s':>8s}"
          f"{'env steps/s':>13s}{'updates/s':>11s}{'upd/CPU-s':>11s}{'frac oracle':>13s}{'reward/bar':>12s}{'turnover':>10s}")
    for name in names:
        shape = "1/1" if name == "sb3" else "{}/{}".format(*ROWS[name.split("/", 1)[1]][:2])
        print(f"{name:30s}{shape:>13s}{runs[name][0].env_steps:11d}{runs[name][0].updates:9d}{med(name, lambda r: r.total):9.1f}"
              f"{med(name, lambda r: r.wall):9.2f}{med(name, lambda r: r.cpu):8.2f}{med(name, lambda r: r.env_steps_per_s):13.0f}"
              f"{med(name, lambda r: r.updates_per_s):11.0f}{med(name, lambda r: r.updates_per_cpu_s):11.0f}"
              f"{med(name, lambda r: r.frac):13.3f}{med(name, lambda r: r.reward_per_bar):12.3e}{med(name, lambda r: r.turnover):10.3f}")
    if "sb3" not in runs:
        return
    print()
    sb3 = runs["sb3"]
    for name in names[1:]:
        def ratio(f, name=name) -> tuple[float, list[float]]:
            xs = [f(a) / f(b) for a, b in zip(runs[name], sb3, strict=True)]
            return statistics.median(xs), xs

        upd, upd_x = ratio(lambda r: r.updates_per_s)
        cpu, cpu_x = ratio(lambda r: r.updates_per_cpu_s)
        env, _ = ratio(lambda r: r.env_steps_per_s)
        print(f"{name}/sb3: updates/s x{upd:.2f} ({', '.join(f'{x:.2f}' for x in upd_x)}), updates/CPU-s x{cpu:.2f} "
              f"({', '.join(f'{x:.2f}' for x in cpu_x)}), env steps/s x{env:.1f}, "
              f"frac oracle {med(name, lambda r: r.frac):.3f} vs {med('sb3', lambda r: r.frac):.3f}")
    equal = [n for n in names[1:] if ROWS[n.split("/", 1)[1]][0] == ROWS[n.split("/", 1)[1]][1]]
    vector = [n for n in names[1:] if n not in equal]
    for label, group, key, target in (
        ("gradient updates/s at one transition per update", equal, lambda r: r.updates_per_s, 2.0),
        ("environment steps/s with vectorised agents", vector, lambda r: r.env_steps_per_s, 20.0),
    ):
        for name in group:
            x = statistics.median(key(a) / key(b) for a, b in zip(runs[name], sb3, strict=True))
            print(f"target >= {target:g}x SB3's {label}: {name} x{x:.2f} -> {'met' if x >= target else 'NOT met'}")
    if not math.isfinite(oracle) or oracle <= 0:
        print("note: the oracle earns nothing on this market, fractions are meaningless")


if __name__ == "__main__":
    main()
