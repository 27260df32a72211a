"""End-to-end training throughput, memory and accuracy of foxhunt's TFT beside pytorch-forecasting's (issues 4, 22).

Both models train on the same windows of the synthetic market (same features, same scaled targets, same known-future
inputs), with the same sizes (hidden 32, 4 heads, hidden_continuous 16, encoder 64, horizon 6, batch 128,
quantiles 0.1/0.5/0.9, dropout 0.1), AdamW (lr 1e-3, no weight decay) and clipping at 1.0, each on the path its users
run, through a Lightning ``Trainer.fit``:

- foxhunt: the coordinator ``EnsembleModule`` with one ``TFTModule`` member (manual optimisation: the member's loss,
  the coordinator's backward, guard, clip and the member's own AdamW step), fed by ``WindowBatches`` (windows gathered
  by index, ``foxhunt.data.windows``) from a LightningDataModule holding the splits; ``--path module``: the
  ``TFTModule`` alone under automatic optimisation;
- pytorch-forecasting: its ``TemporalFusionTransformer`` (optimizer "adamw", its default plateau schedule) fed by its
  ``TimeSeriesDataSet.to_dataloader`` (``num_workers=0``, one thread each, like ours).

How it measures: the two fits of a repeat run in two threads that take one training step at a time each, in turn
(a condition variable handed over at every ``on_train_batch_start``), so whatever else loads the machine hits both
alike, a step apart. A step is timed from one batch start to the next, while its fit holds the turn: drawing the next
batch (Lightning prefetches one), forward, backward, clipping, the optimizer step, and Lightning's and the
coordinator's own work per step. A repeat is one ``fit`` per model of ``--warmup`` + ``--steps`` + 1 steps; its
throughput is ``--steps`` x batch over the summed times of the steps after the warm-up. Repeats alternate which model
steps first, and each repeat continues training the same models (a new Trainer, so a fresh AdamW state, for both
alike; a new window order for foxhunt, a new shuffle for the peer). The loader's share is timed around each batch
draw (median per batch).

Printed per width: the median over ``--repeats`` of the per-repeat throughput ratio (foxhunt / peer) with its
spread ((max - min) / median), each model's median samples/s and spread, whole-step and loader ms, peak tensor memory
of one training step (torch's MemTracker, on a copy of each network), the test quantile loss (scaled target, all
horizons, the same test windows for both) after all repeats, and the 1-minute load average (os.getloadavg) seen
before and after every fit. ``--profile`` prints where foxhunt's step goes instead.

    python scripts/bench_tft.py --widths 5 --repeats 5 --no-gc                          # needs pytorch-forecasting
    python scripts/bench_tft.py --widths 125 --repeats 5 --steps 10 --no-gc --no-memory
    python scripts/bench_tft.py --widths 5 --profile              # foxhunt's step, piece by piece

Measured (issue 22; the shared 2-core box at a 1-minute load average of 8-27 from other jobs, 5-30x the issue's
quiet 0.8, so absolute times are inflated; ratios are per repeat, the two fits stepping in turn):
    5 inputs, seed 0 (load 20-27):  throughput x2.24 median of 5 (x1.96-x2.29, spread 14.9%), whole step 957 vs 2140 ms
                                    (loader 0.4 vs 360 ms), memory x0.65 (70 vs 107 MiB), test loss x0.996
    5 inputs, seed 1 (load 10-16):  throughput x2.21 median of 5 (x2.13-x2.26, spread 6.1%), whole step 632 vs 1395 ms
                                    (loader 0.4 vs 258 ms), memory x0.65, test loss x0.998
    125 inputs, --steps 6 --no-memory (load 8-14): throughput x3.39 median of 5 (x2.98-x3.54, spread 16.4%), whole
                                    step 1920 vs 6794 ms (loader 1.6 vs 268 ms), test loss x1.005 after 45 steps
    125 inputs, --steps 10 --no-memory (load 3-8): throughput x3.55 median of 5 (x2.98-x3.62, spread 18.1%), whole
                                    step 1492 vs 5218 ms (loader 1.5 vs 189 ms), test loss x1.001 after 65 steps
    with --no-gc (cyclic GC off inside each repeat's fits, as timeit does), a quieter box (load 1-6):
    125 inputs, --steps 10 --no-memory --no-gc: throughput x3.53 median of 5 (x3.38-x3.71, spread 9.3%), whole step
                                    911 vs 3199 ms (loader 1.2 vs 110 ms), test loss x1.001 after 65 steps
    5 inputs, --no-gc:              throughput x2.27 median of 5 (x2.26-x2.29, spread 1.5%), whole step 246 vs 563 ms
                                    (loader 0.4 vs 103 ms), memory x0.65 (70 vs 107 MiB), test loss x0.996
    125 inputs, memory (mem125 probe in the issue-22 notes): foxhunt 491 MiB (104 with keep_activations_mib=0);
                                    pytorch-forecasting 1464 MiB (earlier runs), so about x0.34 (x0.07)
Before issue 22 (manual loop, no Lightning, back-to-back steps): x2.72 at 125 and x1.74 at 5 on a quiet box.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch

from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.evaluation.forecast_metrics import pinball_loss
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.tft import TFTModule
from foxhunt.quality.forecasters import QualityData, build_quality_data, windows

QUANTILES = (0.1, 0.5, 0.9)
SMALL = ["ret_z", "log_vol_slow", "phase_sin", "phase_cos", "gap_log"]


def select_features(data: QualityData, names: list[str]) -> QualityData:
    """The same data restricted to ``names`` (known-future columns must stay)."""
    for name, split in data.splits.items():
        idx = [split.feature_names.index(n) for n in names]
        data.splits[name] = MarketSplit(**{**split.__dict__, "features": split.features[:, idx].contiguous(), "feature_names": list(names)})
    return data


# ------------------------------------------------------------------------------------------------------- timing
class TimedLoader:
    """A training loader whose batch draws are timed: the loader's share of each end-to-end step."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.seconds: list[float] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.seconds.append(time.perf_counter() - t0)
            yield batch


class Turns:
    """Fits in threads that take one training step at a time each, in a fixed rotation: whatever else loads the machine
    hits every model alike, a step apart."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.turn, self.done, self.arrived = list(names), 0, set(), set()
        self.cond = threading.Condition()

    def _advance(self) -> None:  # the caller holds the condition
        for _ in self.names:
            self.turn = (self.turn + 1) % len(self.names)
            if self.names[self.turn] not in self.done:
                break
        self.cond.notify_all()

    def take(self, name: str, passing: bool) -> None:
        """Hand the turn on (``passing``: this fit has just finished a step), then wait for this fit's next turn; the
        first steps wait until every fit has reached its first batch (its setup no longer competes)."""
        with self.cond:
            self.arrived.add(name)
            if passing and self.names[self.turn] == name:
                self._advance()
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.names[self.turn] == name and self.arrived | self.done >= set(self.names))

    def finish(self, name: str) -> None:
        """This fit is over (or failed): the rotation goes on without it."""
        with self.cond:
            if name not in self.done:
                self.done.add(name)
                if self.names[self.turn] == name:
                    self._advance()
                self.cond.notify_all()


class StepClock(pl.Callback):
    """Times each whole training step: from a batch start to the next one's (which includes drawing that batch), while
    this fit holds its turn."""

    def __init__(self, turns: Turns | None = None, name: str = "") -> None:
        self.turns, self.name = turns, name
        self.intervals: list[float] = []
        self.start: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        passing = self.start is not None
        if passing:
            self.intervals.append(time.perf_counter() - self.start)
        if self.turns is not None:
            self.turns.take(self.name, passing)
        self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.turns is not None:
            self.turns.finish(self.name)


@dataclass
class Timing:
    """One fit's figures: samples/s over the timed steps, ms per whole step, ms per batch draw, load around it."""

    samples_per_s: float
    step_ms: float
    loader_ms: float
    load: tuple[float, float]


def fit_steps(run: Callable[[pl.Trainer], None], loader_seconds: Callable[[], list[float]], steps: int, warmup: int,
              batch_size: int, clip: float | None = None, turns: Turns | None = None, name: str = "") -> Timing:
    """``run(trainer)`` (one Trainer.fit) for warmup + steps + 1 steps; timed: the ``steps`` steps after the warm-up."""
    clock = StepClock(turns, name)
    trainer = pl.Trainer(
        max_steps=warmup + steps + 1, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[clock], gradient_clip_val=clip,
    )
    load0 = os.getloadavg()[0]
    try:
        run(trainer)
    finally:
        if turns is not None:
            turns.finish(name)
    load1 = os.getloadavg()[0]
    timed = clock.intervals[warmup : warmup + steps]
    if len(timed) < steps:
        raise RuntimeError(f"the fit ran {len(clock.intervals) + 1} steps, fewer than warmup + steps + 1 (too few windows?)")
    elapsed = sum(timed)
    draws = loader_seconds()
    draws = draws[warmup:] or draws
    return Timing(steps * batch_size / elapsed, elapsed / steps * 1e3, statistics.median(draws) * 1e3, (load0, load1))


def in_turns(fits: dict[str, Callable[[Turns], Any]]) -> dict[str, Any]:
    """Run the fits in threads, a step each in turn (in the dict's order); their results, or the first error."""
    turns = Turns(list(fits))
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def work(name: str, fit: Callable[[Turns], Any]) -> None:
        try:
            results[name] = fit(turns)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)
        finally:
            turns.finish(name)

    threads = [threading.Thread(target=work, args=item, name=item[0]) for item in fits.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# ------------------------------------------------------------------------------------------------------- ours
class BenchData(pl.LightningDataModule):
    """The quality market's training split as the coordinator reads it (``splits``, ``spec``), windows by index."""

    def __init__(self, data: QualityData, batch_size: int, seed: int) -> None:
        super().__init__()
        self.data, self.batch_size, self.next_seed = data, batch_size, seed
        self.splits = {"train": data.splits["train"]}
        self.spec = MarketSpec.of(data.splits["train"], data.known_future, data.lookback, data.horizon)
        self.target_transform = None  # batches carry y_loc / y_scale
        self.loader: TimedLoader | None = None

    def train_dataloader(self) -> TimedLoader:
        """WindowBatches as BarDataModule gives them; each fit (repeat) draws a new order, like the next epoch."""
        self.loader = TimedLoader(windows(self.data, "train", self.batch_size, shuffle=True, seed=self.next_seed))
        self.next_seed += 1
        return self.loader


class Ours:
    name = "foxhunt"

    def __init__(self, data: QualityData, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)
        self.member = TFTModule(
            hidden_size=32, attention_heads=4, hidden_continuous_size=16, dropout=0.1, quantiles=QUANTILES,
            log_figures=False, fused=not args.reference,
            optim={"lr": args.lr, "weight_decay": 0.0, "scheduler": "none", "fused_adamw": not args.reference},
        )
        self.dm = BenchData(data, args.batch_size, args.seed)
        self.path = args.path
        if self.path == "ensemble":
            self.module: pl.LightningModule = EnsembleModule({"tft": self.member}, combine="vote", gradient_clip_val=1.0)
            self.module.bind(self.dm.spec)
        else:
            self.member.bind(self.dm.spec)
            self.module = self.member
        self.net = self.member.network
        if args.compile:
            self.net.compile()
        self.data, self.batch_size = data, args.batch_size

    def fit(self, steps: int, warmup: int, turns: Turns | None = None) -> Timing:
        """One repeat: the coordinator's (or the module's) fit on the datamodule's window batches."""
        if self.path == "ensemble":  # the coordinator clips (gradient_clip_val=1.0); manual optimisation
            def run(trainer: pl.Trainer) -> None:
                trainer.fit(self.module, datamodule=self.dm)

            return fit_steps(run, lambda: self.dm.loader.seconds, steps, warmup, self.batch_size, turns=turns, name=self.name)
        loader = self.dm.train_dataloader()
        return fit_steps(lambda trainer: trainer.fit(self.module, train_dataloaders=loader), lambda: loader.seconds,
                         steps, warmup, self.batch_size, clip=1.0, turns=turns, name=self.name)

    @torch.no_grad()
    def test_losses(self) -> dict[int, float]:
        """Per decision row t: pinball loss on the scaled target, averaged over horizons and quantiles."""
        self.net.eval()
        qs = torch.tensor(QUANTILES)
        out: dict[int, float] = {}
        for batch in windows(self.data, "test", 512):
            pred = self.net(batch["x_past"], batch["x_future"], batch["symbol"]).prediction
            loss = pinball_loss(pred, batch["y"], qs).mean(dim=(1, 2))
            out.update(zip(batch["t"].tolist(), loss.tolist()))
        return out

    def memory_probe(self) -> tuple[Any, Any, Callable[[], None]]:
        """A copy of the network, its AdamW, and one training step of it (forward, loss, backward, clip, step)."""
        net = copy.deepcopy(self.net).train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=self.member.optim.fused_adamw)
        batch = next(iter(windows(self.data, "train", self.batch_size, shuffle=True)))

        def step() -> None:
            out = net(batch["x_past"], batch["x_future"], batch["symbol"])
            loss = self.member.quantile_loss(out.prediction, batch["y"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()

        return net, opt, step


# ------------------------------------------------------------------------------------------------------- peer
def pf_frame(split: MarketSplit, known: list[str]) -> pd.DataFrame:
    """One row per bar; target column ``y`` at row i is our target of row i-1, so the decoder rows t+1..t+H hold
    exactly our y[t..t+H-1] and the known-future inputs of rows t+1..t+H match ours."""
    feats = split.features.numpy()
    df = pd.DataFrame(feats, columns=split.feature_names)
    y = np.full(len(split), np.nan, dtype=np.float32)
    y[1:] = split.targets.numpy()[:-1]
    df["y"] = y
    df["time_idx"] = np.arange(len(split))
    df["symbol"] = "S0"
    ok = split.valid.numpy().copy()
    ok[0] = False
    first = int(np.argmax(ok))
    df = df.iloc[first:]
    return df[np.isfinite(df["y"].to_numpy())].reset_index(drop=True)


class Peer:
    name = "pytorch-forecasting"

    def __init__(self, data: QualityData, args: argparse.Namespace) -> None:
        from pytorch_forecasting import TemporalFusionTransformer, TimeSeriesDataSet
        from pytorch_forecasting.metrics import QuantileLoss

        torch.manual_seed(args.seed)
        split = data.splits["train"]
        known = list(data.known_future)
        unknown = [n for n in split.feature_names if n not in known]
        common = {
            "time_idx": "time_idx", "target": "y", "group_ids": ["symbol"], "max_encoder_length": data.lookback,
            "min_encoder_length": data.lookback, "max_prediction_length": data.horizon, "min_prediction_length": data.horizon,
            "time_varying_unknown_reals": unknown, "time_varying_known_reals": known, "add_relative_time_idx": True,
            "add_target_scales": False, "add_encoder_length": False, "target_normalizer": None,
        }
        self.train_ds = TimeSeriesDataSet(pf_frame(split, known), **common)
        self.test_ds = TimeSeriesDataSet.from_dataset(self.train_ds, pf_frame(data.splits["test"], known), predict=False, stop_randomization=True)
        self.model = TemporalFusionTransformer.from_dataset(
            self.train_ds, hidden_size=32, attention_head_size=4, hidden_continuous_size=16, dropout=0.1,
            loss=QuantileLoss(list(QUANTILES)), learning_rate=args.lr, log_interval=-1, optimizer="adamw",
            weight_decay=0.0,  # its plateau schedule (patience 1000, never reached here) is its default
        )
        self.net = self.model
        if args.compile_peer:
            self.model.compile()
        self.batch_size = args.batch_size

    def fit(self, steps: int, warmup: int, turns: Turns | None = None) -> Timing:
        """One repeat: its Trainer.fit (automatic optimisation, the Trainer clips) on its own dataloader."""
        loader = TimedLoader(self.train_ds.to_dataloader(train=True, batch_size=self.batch_size, num_workers=0))
        return fit_steps(lambda trainer: trainer.fit(self.model, train_dataloaders=loader), lambda: loader.seconds,
                         steps, warmup, self.batch_size, clip=1.0, turns=turns, name=self.name)

    @torch.no_grad()
    def test_losses(self) -> dict[int, float]:
        self.model.eval()
        qs = torch.tensor(QUANTILES)
        out: dict[int, float] = {}
        for x, y in self.test_ds.to_dataloader(train=False, batch_size=512, num_workers=0):
            pred = self.model(x)["prediction"]
            loss = pinball_loss(pred, y[0], qs).mean(dim=(1, 2))
            t = (x["decoder_time_idx"][:, 0] - 1).tolist()
            out.update(zip(t, loss.tolist()))
        return out

    def memory_probe(self) -> tuple[Any, Any, Callable[[], None]]:
        """A copy of the model, its AdamW, and one training step of it."""
        model = copy.deepcopy(self.model).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = next(iter(self.train_ds.to_dataloader(train=True, batch_size=self.batch_size, num_workers=0)))

        def step() -> None:
            loss = model.loss(model(x)["prediction"], y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        return model, opt, step


# ------------------------------------------------------------------------------------------------------- bench
def peak_memory_mb(model: Any, opt: Any, step: Callable[[], None]) -> float | None:
    """Peak live tensor memory (MiB) during one training step, by torch's MemTracker; None if it cannot track."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        snap = tracker.get_tracker_snapshot("peak")
        return max(v["Total"] for v in snap.values()) / 2**20
    except Exception as err:  # noqa: BLE001 - report, don't fail the benchmark
        print(f"  (memory tracking failed: {type(err).__name__}: {err})", file=sys.stderr)
        return None


def spread(values: list[float]) -> float:
    """(max - min) / median: how far apart the repeats landed."""
    return (max(values) - min(values)) / statistics.median(values)


def bench_data(width: int, args: argparse.Namespace) -> QualityData:
    """The synthetic market with ``width`` observed inputs (extra lagged, smoothed and noise inputs above 8)."""
    data = build_quality_data(args.n_bars, seed=args.seed, lookback=64, horizon=6, n_extra_features=max(0, width - 8))
    if width < 8:
        data = select_features(data, SMALL[:width] if width >= 3 else SMALL[-3:])
    return data


def bench_width(width: int, args: argparse.Namespace) -> dict[str, Any]:
    data = bench_data(width, args)
    impls = [Ours(data, args), Peer(data, args)]
    memory = {impl.name: None if args.no_memory else peak_memory_mb(*impl.memory_probe()) for impl in impls}
    runs: dict[str, list[Timing]] = {impl.name: [] for impl in impls}
    ratios: list[float] = []
    for r in range(args.repeats):
        order = impls if r % 2 == 0 else impls[::-1]  # alternate who goes first
        gc.collect()
        if args.no_gc:  # like timeit: no cyclic collection inside the timed fits (collected between repeats)
            gc.disable()
        try:
            timings = in_turns({impl.name: lambda turns, impl=impl: impl.fit(args.steps, args.warmup, turns) for impl in order})
        finally:
            gc.enable()
        for impl in impls:
            runs[impl.name].append(timings[impl.name])
        ratios.append(runs["foxhunt"][-1].samples_per_s / runs["pytorch-forecasting"][-1].samples_per_s)
        print(f"  [{data.splits['train'].n_features} inputs] repeat {r + 1}/{args.repeats}: throughput x{ratios[-1]:.2f} "
              f"({runs['foxhunt'][-1].samples_per_s:.0f} vs {runs['pytorch-forecasting'][-1].samples_per_s:.0f} samples/s, "
              f"load {runs['foxhunt'][-1].load[0]:.1f})", file=sys.stderr, flush=True)
    losses = {impl.name: impl.test_losses() for impl in impls}
    common_rows = sorted(set.intersection(*(set(v) for v in losses.values())))
    loads = [x for timings in runs.values() for t in timings for x in t.load]
    result: dict[str, Any] = {
        "inputs": data.splits["train"].n_features, "path": args.path, "repeats": args.repeats, "timed_steps": args.steps,
        "steps_per_repeat": args.warmup + args.steps + 1, "test_windows": len(common_rows), "threads": torch.get_num_threads(),
        "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads), "cores": os.cpu_count()},
    }
    for impl in impls:
        timings = runs[impl.name]
        sps = [t.samples_per_s for t in timings]
        step_ms, loader_ms = statistics.median(t.step_ms for t in timings), statistics.median(t.loader_ms for t in timings)
        result[impl.name] = {
            "samples_per_s_median": statistics.median(sps), "samples_per_s_spread": spread(sps),
            "samples_per_s": sps, "step_ms_median": step_ms, "loader_ms_median": loader_ms,
            "peak_mem_mib": memory[impl.name], "params": sum(p.numel() for p in impl.net.parameters()),
            "test_quantile_loss": float(np.mean([losses[impl.name][t] for t in common_rows])),
        }
    ours, peer = result["foxhunt"], result["pytorch-forecasting"]
    result["ratios_foxhunt_over_peer"] = {
        "throughput_median": statistics.median(ratios), "throughput_spread": spread(ratios), "throughput": ratios,
        "step_without_loader_speedup": (peer["step_ms_median"] - peer["loader_ms_median"]) / (ours["step_ms_median"] - ours["loader_ms_median"]),
        "peak_memory": (ours["peak_mem_mib"] / peer["peak_mem_mib"]) if ours["peak_mem_mib"] and peer["peak_mem_mib"] else None,
        "test_quantile_loss": ours["test_quantile_loss"] / peer["test_quantile_loss"],
    }
    return result


# ------------------------------------------------------------------------------------------------------- profile
def _grad_inputs(args: Any) -> Any:
    """Detached copies of captured inputs (tuples too); float tensors require grad, as they do inside the step."""
    if isinstance(args, tuple):
        return tuple(_grad_inputs(a) for a in args)
    if isinstance(args, torch.Tensor):
        return args.detach().clone().requires_grad_(args.is_floating_point())
    return args


def _fwd_bwd(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[], None]:
    """One forward and backward of ``fn(*args)`` (its first output, against a fixed random gradient)."""
    inputs = _grad_inputs(args)
    first = fn(*inputs)
    first = first[0] if isinstance(first, tuple) else first
    grad = torch.randn_like(first)

    def run() -> None:
        out = fn(*inputs)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    return run


def profile_width(width: int, args: argparse.Namespace) -> dict[str, float]:
    """Where foxhunt's end-to-end step goes (ms, medians over interleaved rounds): the fit's whole step and loader
    share, and each piece of the network's forward + backward timed alone on inputs captured from a real batch."""
    from foxhunt.models.variable_selection_fused import selection_weights

    data = bench_data(width, args)
    ours = Ours(data, args)
    member = ours.member
    net = copy.deepcopy(ours.net)  # the pieces run on a copy, in turn with the fit's steps (the same machine load)
    batch = next(iter(windows(data, "train", args.batch_size, shuffle=True)))
    captured: dict[str, tuple[Any, ...]] = {}

    def capture(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            captured.setdefault(name, (*args, *kwargs.values()))

        return hook

    hooks = [getattr(net, name).register_forward_pre_hook(capture(name), with_kwargs=True)
             for name in ("encoder_selection", "decoder_selection", "lstm_encoder", "lstm_decoder", "post_lstm_gate",
                          "static_enrichment", "attention", "post_attention_gate", "positionwise_grn", "pre_output_gate",
                          "quantile_head")]
    net.train()
    out = net(batch["x_past"], batch["x_future"], batch["symbol"])
    for h in hooks:
        h.remove()

    def scoring(name: str) -> Callable[[], None]:
        vsn = getattr(net, name)
        x, ctx = captured[name][:2]
        lead = x.shape[:-1]
        flat_ctx = ctx.unsqueeze(1).expand(*lead, ctx.shape[-1]).reshape(-1, ctx.shape[-1])
        return _fwd_bwd(lambda a, c: selection_weights(vsn, a, c), (x.reshape(-1, x.shape[-1]), flat_ctx))

    def modules(*names: str) -> Callable[[], None]:
        runs = [_fwd_bwd(getattr(net, name), captured[name]) for name in names]
        return lambda: [run() for run in runs] and None

    def both(*runs: Callable[[], None]) -> Callable[[], None]:
        return lambda: [run() for run in runs] and None

    del out
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=member.optim.fused_adamw)

    def whole() -> None:
        pred = net(batch["x_past"], batch["x_future"], batch["symbol"]).prediction
        member.quantile_loss(pred, batch["y"]).backward()

    def optimizer() -> None:
        member.guard.clip_gradients(net, 1.0, 0, params=params)
        opt.step()
        for p in params:
            p.grad = None

    pieces: dict[str, Callable[[], None]] = {
        "network forward + loss + backward, whole": whole,
        "variable selection, whole (encoder + decoder)": modules("encoder_selection", "decoder_selection"),
        "  of which the scoring GRNs (flattened GRN + softmax)": both(scoring("encoder_selection"), scoring("decoder_selection")),
        "LSTM encoder + decoder": modules("lstm_encoder", "lstm_decoder"),
        "post-LSTM gate + static enrichment GRN": modules("post_lstm_gate", "static_enrichment"),
        "interpretable attention": modules("attention"),
        "post-attention gate, position-wise GRN, output gate, head": modules(
            "post_attention_gate", "positionwise_grn", "pre_output_gate", "quantile_head"),
    }
    times: dict[str, list[float]] = {k: [] for k in (*pieces, "guard + clip + AdamW step")}

    def rounds(turns: Turns) -> None:
        """One round of every piece per turn, as many rounds as the fit has steps; the warm-up ones untimed."""
        for r in range(args.warmup + args.steps + 1):
            turns.take("pieces", passing=r > 0)
            for name, fn in pieces.items():
                net.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                fn()
                if r >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
            whole()
            t0 = time.perf_counter()
            optimizer()
            if r >= args.warmup:
                times["guard + clip + AdamW step"].append(time.perf_counter() - t0)
        turns.finish("pieces")

    fits = [in_turns({ours.name: lambda turns: ours.fit(args.steps, args.warmup, turns), "pieces": rounds})[ours.name]
            for _ in range(args.repeats)]
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    step, loader = statistics.median(f.step_ms for f in fits), statistics.median(f.loader_ms for f in fits)
    parts = sum(v for k, v in ms.items() if not k.startswith(("network", " ", "guard")))
    report = {
        "end-to-end step (coordinator fit)": step,
        "loader (batch draw)": loader,
        **ms,
        "  glue: static encoders, cat/concat, relative time, loss, autograd (whole minus pieces)": ms["network forward + loss + backward, whole"] - parts,
        "Lightning + coordinator per step (end-to-end minus loader, network, optimizer)": step - loader - ms["network forward + loss + backward, whole"] - ms["guard + clip + AdamW step"],
    }
    n_in = data.splits["train"].n_features
    print(f"\n{n_in} inputs, foxhunt ({args.path}), 1 thread, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; ms per step, "
          f"medians over {args.repeats} fits x {args.steps} steps, each piece timed in turn with the fit's steps\n")
    print("| piece | ms | share of end-to-end |\n|---|---|---|")
    for k, v in report.items():
        print(f"| {k} | {v:.1f} | {v / step:.0%} |")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="125,5", help="input counts to run, comma separated")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (fits) per model")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per repeat (0: 12 at >= 50 inputs, else 60)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each repeat")
    parser.add_argument("--n-bars", type=int, default=40_000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both (0: leave)")
    parser.add_argument("--path", choices=("ensemble", "module"), default="ensemble",
                        help="foxhunt through the coordinator (as foxhunt.fit runs it) or the TFTModule alone")
    parser.add_argument("--reference", action="store_true", help="foxhunt's reference paths (fused=False, plain AdamW)")
    parser.add_argument("--compile", action="store_true", help="torch.compile foxhunt's network")
    parser.add_argument("--compile-peer", action="store_true", help="torch.compile pytorch-forecasting's model")
    parser.add_argument("--profile", action="store_true", help="print where foxhunt's step goes instead of comparing")
    parser.add_argument("--no-gc", action="store_true", help="disable Python's cyclic GC during each repeat's fits (timeit-style)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory probe (MemTracker scans every live tensor at every op: minutes at 125 inputs)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    for width in [int(w) for w in args.widths.split(",")]:
        width_args = argparse.Namespace(**{**vars(args), "steps": args.steps or (12 if width >= 50 else 60)})
        if args.profile:
            profile_width(width, width_args)
            continue
        res = bench_width(width, width_args)
        print(json.dumps(res, indent=2), flush=True)
        r, ours, peer, load = res["ratios_foxhunt_over_peer"], res["foxhunt"], res["pytorch-forecasting"], res["load_1min"]
        print(f"[{res['inputs']} inputs] throughput x{r['throughput_median']:.2f} (median of {res['repeats']}, spread "
              f"{r['throughput_spread']:.1%}; foxhunt {ours['samples_per_s_median']:.0f} samples/s spread "
              f"{ours['samples_per_s_spread']:.1%}, peer {peer['samples_per_s_median']:.0f} spread {peer['samples_per_s_spread']:.1%}), "
              f"step w/o loader x{r['step_without_loader_speedup']:.2f} ({ours['step_ms_median']:.0f} vs {peer['step_ms_median']:.0f} ms "
              f"whole step, loader {ours['loader_ms_median']:.1f} vs {peer['loader_ms_median']:.1f} ms), memory "
              f"x{r['peak_memory'] if r['peak_memory'] is None else round(r['peak_memory'], 2)}, test loss "
              f"x{r['test_quantile_loss']:.3f}, load {load['min']:.1f}-{load['max']:.1f} (median {load['median']:.1f}) "
              f"on {load['cores']} cores", flush=True)


if __name__ == "__main__":
    main()
