"""foxhunt's PPO, trained the way users train it, against Stable-Baselines3's PPO at its defaults: speed side by side.

foxhunt's learner is the path ``python -m foxhunt.fit`` builds: ``PPOModule`` as the one member of an
``EnsembleModule`` coordinator, fitted by a Lightning ``Trainer`` on a ``MarketDataModule`` (logger, checkpoints,
progress bar, model summary, sanity check and validation off; ``max_steps`` = minibatch updates). Stable-Baselines3
2.x runs its own ``PPO`` at its defaults (MlpPolicy 64-64 tanh, ``n_steps`` 2048, batch 64, 10 epochs) with
``--sb3-envs`` environments (8, the issue's peer) in a ``DummyVecEnv`` (faster than ``SubprocVecEnv`` on 2 cores) on
scripts/bench_dqn.py's gymnasium copy of the same market (same observation: the last W feature rows flattened plus
the one-hot held position; actions short/flat/long; the same reward scale and episode length), on the issue's
window-32 task by default (``--window``). Eight environments step SB3 about 1.7x faster per environment step than
one (its policy acts on the eight observations in one forward); earlier versions of this bench ran one, at window 4,
which flattered foxhunt's ratios.

Rows (``--rows``):

- ``ppo-defaults``: PPOModule's defaults (``n_envs`` agents x ``n_steps`` per rollout, 4 epochs of 32 minibatches):
  the vectorised learner as shipped, compared on environment steps per second (target >= 20x SB3's);
- ``ppo-<E>x<M>[-<N>x<T>]``: the defaults with E epochs of M minibatches [and rollouts of N agents x T steps], e.g.
  ``ppo-10x8-128x64``, the former defaults (10 epochs of 8 minibatches of 1,024 over 128 x 64 rollouts);
- ``ppo-mb64``: SB3's own schedule (2048 steps per rollout, here 16 agents x 128 steps, 10 epochs of minibatches of 64:
  320 updates per rollout), compared on minibatch updates per second at the same minibatch size (target >= 2x SB3's).

Every learner runs on one thread (``torch.set_num_threads(1)``), interleaved: every repeat runs every learner once, in
turn; figures are medians over repeats (ratios: medians of per-repeat ratios). Timing starts at the first training
batch (foxhunt) or at the start of ``learn`` (SB3) and ends with the last update. Each learner's time is split into
rollout (acting, the critic's values, GAE) and update (minibatch losses, backward, clipping, optimizer steps; for
foxhunt also the Trainer's per-step bookkeeping); updates/s is counted over the update time, env steps/s over the whole.
Both clocks are reported: wall time, and the process's CPU time (``time.process_time``), which on a shared, loaded
machine counts only the time the learner actually ran (the wall clock then also counts time waiting for a core).

    pip install 'stable-baselines3>=2.3' 'gymnasium>=0.29'      # the optional "bench" extra
    python scripts/bench_ppo.py --env-steps 65536 --repeats 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from foxhunt.quality.agents import ar1_market
from foxhunt.quality.gym_env import make_sb3_env
from foxhunt.rl.env import MarketTensors

ACTIONS = (-1.0, 0.0, 1.0)
COST_BPS = 1.0

# name -> PPOModule overrides
ROWS = {
    "ppo-defaults": {},
    "ppo-mb64": {"n_envs": 16, "n_steps": 128, "n_minibatches": 32, "n_epochs": 10},
}


def row_overrides(name: str) -> dict | None:
    """A row's PPOModule overrides: a named row, or ``ppo-<E>x<M>[-<N>x<T>]`` (the defaults with E epochs of M
    minibatches[, rollouts of N agents x T steps])."""
    if name in ROWS:
        return ROWS[name]
    m = re.fullmatch(r"ppo-(\d+)x(\d+)(?:-(\d+)x(\d+))?", name)
    if m is None:
        return None
    shape = {"n_envs": int(m[3]), "n_steps": int(m[4])} if m[3] else {}
    return {"n_epochs": int(m[1]), "n_minibatches": int(m[2]), **shape}


@dataclass
class Run:
    env_steps: int
    updates: int
    wall: float  # training seconds
    rollout: float  # of which collecting rollouts
    cpu: float  # the same two in CPU seconds of the process
    cpu_rollout: float

    @property
    def update_time(self) -> float:
        return self.wall - self.rollout

    def on_cpu(self) -> Run:
        """The same run measured in CPU time."""
        return Run(self.env_steps, self.updates, self.cpu, self.cpu_rollout, self.cpu, self.cpu_rollout)

    @property
    def env_steps_per_s(self) -> float:
        return self.env_steps / self.wall

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.update_time

    @property
    def rollout_fraction(self) -> float:
        return self.rollout / self.wall


def run_foxhunt(data, env_steps: int, window: int, episode_length: int, overrides: dict, seed: int) -> Run:
    import lightning as L

    from foxhunt.data.market_datamodule import MarketDataModule
    from foxhunt.lit.ensemble import EnsembleModule
    from foxhunt.lit.ppo import PPOModule

    kwargs = {"window": window, "episode_length": episode_length, "seed": seed, **overrides,
              "optim": {"log_grad_norm_every": 0, **overrides.get("optim", {})}}
    member = PPOModule(**kwargs)
    hp = member.hparams
    rollouts = max(1, env_steps // (hp.n_envs * hp.n_steps))
    per_rollout = hp.n_epochs * hp.n_minibatches
    updates = rollouts * per_rollout
    model = EnsembleModule(members={"ppo": member}, cost_bps=COST_BPS)
    dm = MarketDataModule(data.train, steps_per_epoch=-(-updates // member.updates_per_step))
    mark: dict[str, float] = {"cpu_rollout": 0.0}
    collect = member.collect_rollout

    def timed_collect() -> None:  # the member counts its rollouts' wall time itself; CPU time is counted here
        t0 = time.process_time()
        collect()
        mark["cpu_rollout"] += time.process_time() - t0

    member.collect_rollout = timed_collect  # type: ignore[method-assign]

    class Mark(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if "wall" not in mark:
                mark["wall"], mark["cpu"] = time.perf_counter(), time.process_time()

    trainer = L.Trainer(max_steps=updates, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[Mark()])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, datamodule=dm)
    wall, cpu = time.perf_counter() - mark["wall"], time.process_time() - mark["cpu"]
    assert model.updates["ppo"] == trainer.global_step >= updates, (model.updates, updates)
    return Run(member.env_steps, model.updates["ppo"], wall, member.counters.rollout_seconds, cpu, mark["cpu_rollout"])


def run_sb3(train: MarketTensors, env_steps: int, episode_length: int, seed: int, n_envs: int = 8) -> Run:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    model = PPO("MlpPolicy", make_sb3_env(train, episode_length, seed, n_envs), seed=seed, device="cpu")
    clock = {"rollout": 0.0, "cpu_rollout": 0.0}

    class Mark(BaseCallback):
        def _on_training_start(self) -> None:
            clock["start"], clock["cpu"] = time.perf_counter(), time.process_time()

        def _on_rollout_start(self) -> None:
            clock["began"], clock["cpu_began"] = time.perf_counter(), time.process_time()

        def _on_rollout_end(self) -> None:
            clock["rollout"] += time.perf_counter() - clock["began"]
            clock["cpu_rollout"] += time.process_time() - clock["cpu_began"]

        def _on_step(self) -> bool:
            return True

    model.learn(total_timesteps=env_steps, callback=Mark())
    wall, cpu = time.perf_counter() - clock["start"], time.process_time() - clock["cpu"]
    updates = model.n_epochs * (model.num_timesteps // model.batch_size)
    return Run(model.num_timesteps, updates, wall, clock["rollout"], cpu, clock["cpu_rollout"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env-steps", type=int, default=65_536, help="environment steps of every learner (SB3: whole "
                   "rollouts of 2048 steps per environment; foxhunt: whole rollouts, at least one)")
    p.add_argument("--sb3-envs", type=int, default=8, help="SB3's environments in its DummyVecEnv (the issue's 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default="ppo-defaults,ppo-mb64", help=f"foxhunt configurations, of {', '.join(ROWS)}")
    p.add_argument("--skip-sb3", action="store_true")
    p.add_argument("--phi", type=float, default=0.1)
    p.add_argument("--n-bars", type=int, default=200_000)
    p.add_argument("--window", type=int, default=32, help="bars of features in an observation (the issue's 32)")
    p.add_argument("--episode-length", type=int, default=None, help="default: PPOModule's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if row_overrides(r) is None]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    torch.set_num_threads(args.threads)
    from foxhunt.lit.ppo import PPOModule

    episode = args.episode_length or PPOModule().hparams.episode_length
    data = ar1_market(n_bars=args.n_bars, phi=args.phi, seed=args.seed)
    train = MarketTensors(data.train, args.window, ACTIONS, COST_BPS)
    train.reward_scale = 1.0 / float(train.signal[train.decision].std())  # PPOModule's own rule, given to SB3

    names = ([] if args.skip_sb3 else ["sb3"]) + [f"foxhunt/{r}" for r in rows]
    runs: dict[str, list[Run]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:  # every learner once per repeat, in turn: drift on a shared machine hits all alike
            if name == "sb3":
                r = run_sb3(train, args.env_steps, episode, args.seed, args.sb3_envs)
            else:
                r = run_foxhunt(data, args.env_steps, args.window, episode, row_overrides(name.split("/", 1)[1]), args.seed)
            runs[name].append(r)
            c = r.on_cpu()
            print(f"repeat {rep + 1}/{args.repeats} {name:22s} {r.env_steps_per_s:10.0f} env steps/s "
                  f"{r.updates_per_s:8.0f} updates/s (update time)  rollout {r.rollout_fraction:5.1%}  | CPU time: "
                  f"{c.env_steps_per_s:10.0f} env steps/s {c.updates_per_s:8.0f} updates/s rollout {c.rollout_fraction:5.1%}",
                  flush=True)
    for clock in ("wall", "CPU"):
        table = runs if clock == "wall" else {n: [r.on_cpu() for r in rs] for n, rs in runs.items()}
        report(table, names, args, episode, clock)


def report(runs: dict[str, list[Run]], names: list[str], args: argparse.Namespace, episode: int, clock: str) -> None:
    """The table and the ratios to SB3 of one clock's figures."""
    from foxhunt.lit.ppo import PPOModule

    def med(name: str, f) -> float:
        return statistics.median(f(r) for r in runs[name])

    print(f"\n[{clock} time] AR(1) phi={args.phi} window={args.window} episode_length={episode} env steps={args.env_steps} "
          f"threads={args.threads} repeats={args.repeats} (medians)")
    print(f"{'learner':24s}{'rollout':>14s}{'minibatch':>10s}{'env steps':>10s}{'updates':>9s}{'train s':>9s}"
          f"{'rollout s':>10s}{'update s':>9s}{'rollout %':>10s}{'env steps/s':>13s}{'updates/s':>11s}")
    for name in names:
        if name == "sb3":
            shape, mb = f"{args.sb3_envs} x 2048", 64
        else:
            kw = {**PPOModule().hparams, **row_overrides(name.split("/", 1)[1])}
            shape, mb = f"{kw['n_envs']} x {kw['n_steps']}", kw["n_envs"] * kw["n_steps"] // kw["n_minibatches"]
        r0 = runs[name][0]
        print(f"{name:24s}{shape:>14s}{mb:10d}{r0.env_steps:10d}{r0.updates:9d}{med(name, lambda r: r.wall):9.2f}"
              f"{med(name, lambda r: r.rollout):10.2f}{med(name, lambda r: r.update_time):9.2f}"
              f"{med(name, lambda r: r.rollout_fraction):10.1%}{med(name, lambda r: r.env_steps_per_s):13.0f}"
              f"{med(name, lambda r: r.updates_per_s):11.0f}")
    if "sb3" not in runs:
        return
    print()
    sb3 = runs["sb3"]
    for name in names[1:]:
        def ratio(f, name=name) -> tuple[float, list[float]]:
            xs = [f(a) / f(b) for a, b in zip(runs[name], sb3, strict=True)]
            return statistics.median(xs), xs

        env, env_x = ratio(lambda r: r.env_steps_per_s)
        upd, upd_x = ratio(lambda r: r.updates_per_s)
        print(f"{name}/sb3: env steps/s x{env:.1f} ({', '.join(f'{x:.1f}' for x in env_x)}), "
              f"updates/s x{upd:.2f} ({', '.join(f'{x:.2f}' for x in upd_x)})")
    for name, key, label, target in (
        ("foxhunt/ppo-defaults", lambda r: r.env_steps_per_s, "environment steps/s", 20.0),
        ("foxhunt/ppo-mb64", lambda r: r.updates_per_s, "minibatch updates/s at minibatch 64", 2.0),
    ):
        if name in runs:
            x = statistics.median(key(a) / key(b) for a, b in zip(runs[name], sb3, strict=True))
            print(f"[{clock} time] target >= {target:g}x SB3's {label}: {name} x{x:.2f} -> "
                  f"{'met' if x >= target else 'NOT met'}")


if __name__ == "__main__":
    main()
