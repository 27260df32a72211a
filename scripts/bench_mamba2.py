"""Speed and memory of foxhunt's Mamba-2 (issue 17, section 4), at the issue's sizes, one thread, in one run.

**What is compared.** One training step (forward, pinball loss, backward, AdamW) of the Mamba-2 forecaster network
(``Mamba2Forecaster``: d_model 32, 2 layers, d_state 16, headdim 8, expand 2, chunk 16, ``--inputs`` features of
which 3 known in advance, horizon 6, so L + 6 rows), batch 128, in three versions that share their weights and differ
only in the SSD scan of each block:

- ``reference``: the official pure-PyTorch ``ssd_minimal_discrete`` (Listing 1 of Dao & Gu, 2024), from
  ``mamba_ssm/modules/ssd_minimal.py`` of the mamba-ssm source distribution, fetched at run time with
  ``pip download mamba-ssm --no-deps --no-binary :all:`` into a temporary directory and imported from there (nothing
  of it is copied into foxhunt; it needs ``einops``). It takes the discretised X = dt x and A dt, B and C per head
  (foxhunt's one group is broadcast to the heads, a view), a length that is a multiple of the chunk (the rows are
  padded with dt = 0, which changes nothing), and has no D skip (added outside, as foxhunt's scan does inside);
- ``chunked``: foxhunt's PyTorch block and scan (``native=False``, :func:`foxhunt.models.mamba2.ssd_chunked`: what runs
  on CUDA and where there is no C compiler);
- ``native``: the defaults, the block's compiled CPU loops (``native=True``, :mod:`foxhunt.kernels.mamba2_block`: the
  causal convolution with SiLU and the SSD step by step, in C);

next to foxhunt's TFT (``TemporalFusionTransformer``, hidden 32, 4 heads, hidden_continuous 16) on the same batch.
All use the same chunk length (16) where they have one.

Printed per lookback L: the largest difference of the three Mamba-2 versions' outputs (every row of the stack's
output, absolute and relative to the largest) and of their parameter gradients (relative to each gradient's largest
entry); samples/s of the training step (median of the timed repeats; the versions interleaved, one step of each per
round, so that load from other processes hits all alike); the fastest foxhunt version's (native, else chunked)
speed-up over each other; the peak
resident memory during a timed step of each (VmHWM reset through /proc/self/clear_refs before each step, outside
its timing) and its rise above the memory before the step; the load average (``os.getloadavg``) before and after
each lookback's timing. The outputs are compared on the first ``--check-rows`` sequences (equality does not depend on
the batch; the reference's full-batch forward at L = 4096 alone costs a step). Then, per version,
its step time at each L over its step time at the smallest L (linear: L / L_min) and the memory rise likewise.

    python scripts/bench_mamba2.py                                   # 64, 512, 4096 at batch 128 (the reference
                                                                     # needs ~10 GiB at 4096; ~15 min on a quiet core)
    python scripts/bench_mamba2.py --lookbacks 64,512,4096 --repeats 3 --no-warmup --batch 32   # docs/MAMBA2.md's run
    python scripts/bench_mamba2.py --lookbacks 64,512 --repeats 5
    python scripts/bench_mamba2.py --variants chunked,tft --lookbacks 512,4096,16384
    python scripts/bench_mamba2.py --reference /path/to/mamba_ssm/modules/ssd_minimal.py   # no download
    python scripts/bench_mamba2.py --trainer --lookbacks 64,512,4096 --trainer-steps 3   # the member modules in a Trainer

``--profile`` measures how far fusing could take a version's step (the first of ``--variants``), without the
reference: at each lookback it profiles the step (torch.profiler, self CPU time), counts its matrix products' FLOPs
(``FlopCounterMode``, products only: its count for a grouped convolution's backward is that of a dense one) and
prints their share of the step, their rate beside this core's rate on a large [2048 x 2048] product, and the step's
speed-up ceilings: every other operation free, and also the products at the large-product rate.

    python scripts/bench_mamba2.py --profile --variants native --lookbacks 4096 --batch 16

``--trainer`` times the objects ``foxhunt.fit`` trains instead of the bare networks: ``Mamba2Module`` (with the
reference scan patched into its blocks for the reference variant) and ``TFTModule`` at the same sizes, each in short
``Trainer.fit`` runs on window batches of a synthetic market (the step as Lightning runs it: batch transfer,
training_step, pinball loss, backward, clipping, AdamW, logging), the modules taking turns, medians over the rounds.
Every run is under ``--allocator retain`` unless told otherwise: the fit's own setting (foxhunt/training/memory.py).

The reference links chunks by a dense [chunks x chunks] decay matrix applied to every chunk's state (quadratic in
L / Q), and builds its intra-chunk decay mask per head ([b, heads, chunks, Q, Q]) through a cumulative sum over a
[Q, Q] repeat; foxhunt's chunked scan links chunks with one recurrence step each (linear) and shares C B^T by the
heads of a group (see ``ssd_chunked``). Measured figures are in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Container
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foxhunt.models.mamba2 import Mamba2Forecaster
from foxhunt.models.tft import TemporalFusionTransformer
from foxhunt.training.memory import retain_freed_memory

QUANTILES = (0.1, 0.5, 0.9)
KNOWN, HORIZON = 3, 6
MAMBA_VARIANTS = ("reference", "chunked", "native")


def fastest(names: Container[str]) -> str | None:
    """The version the others are compared with: native if it runs, else chunked."""
    return next((n for n in ("native", "chunked") if n in names), None)


# ------------------------------------------------------------------------------------------------------- reference
def fetch_reference(dest: Path) -> Path:
    """Download the mamba-ssm source distribution (no build, no dependencies) and unpack its ssd_minimal.py."""
    import tarfile

    env = {"MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "FALSE"}
    cmd = [sys.executable, "-m", "pip", "download", "mamba-ssm", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-d", str(dest)]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **env})
    sdist = next(dest.glob("mamba_ssm-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("mamba_ssm/modules/ssd_minimal.py"))
        path = dest / "ssd_minimal.py"
        path.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
        return path


def load_reference(path: Path) -> Callable:
    """``ssd_minimal_discrete`` from the reference file. Its module also imports the CUDA kernel for its own test;
    a stand-in module answers that import (the function benchmarked never calls it)."""
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.ssd_combined"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["mamba_ssm.ops.triton.ssd_combined"].mamba_chunk_scan_combined = None  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location("ssd_minimal_reference", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.ssd_minimal_discrete


def use_reference_scan(net: nn.Module, ssd_minimal_discrete: Callable) -> None:
    """Make every Mamba-2 block of ``net`` run its SSD with the reference function (an instance-level override of
    ``Mamba2Block.ssd``, same arguments and outputs)."""

    def ssd(block: nn.Module, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial: Tensor | None,
            return_state: bool) -> Tensor | tuple[Tensor, Tensor]:
        b, length, heads, p = x.shape
        q = block.chunk_size
        groups = B.shape[2]
        # head h reads group h // (heads / groups): a broadcast view for one group, a copy otherwise
        Bh, Ch = ((t.expand(b, length, heads, t.shape[-1]) if groups == 1 else t.repeat_interleave(heads // groups, 2))
                  for t in (B, C))
        X, a = x * dt[..., None], dt * A
        pad = (-length) % q
        if pad:  # dt = 0 past the end: X = 0 and A dt = 0 change nothing
            X, Bh, Ch = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (X, Bh, Ch))
            a = F.pad(a, (0, 0, 0, pad))
        init = None if initial is None else initial[:, None]
        y, final = ssd_minimal_discrete(X, a, Bh, Ch, q, initial_states=init)
        y = y[:, :length] + block.D[:, None] * x
        return (y, final) if return_state else y

    for module in net.modules():
        if hasattr(module, "ssd") and hasattr(module, "chunk_size"):
            module.ssd = types.MethodType(ssd, module)


# ------------------------------------------------------------------------------------------------------- measuring
def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return -1


def reset_peak() -> bool:
    """Give freed memory back to the system (glibc keeps it otherwise), then reset the peak resident set (VmHWM) to
    the current one; False where the kernel does not allow the reset."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: bool,
                retain: bool) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
    """Median wall time (s) of each function over ``repeats`` rounds, one call of each per round (after one warm-up
    call of each if ``warmup``), its median CPU time (s, ``time.process_time``: on a machine with more runnable
    processes than cores the wall time includes waiting, the CPU time does not), and the largest peak RSS during a call
    and its largest rise above the RSS before it (MiB; the peak is reset, and freed memory given back, before the
    call, outside the timing). With ``retain`` (freed memory kept, as in ``foxhunt.fit``) giving memory back would undo
    what is measured, so the memory is taken in one untimed round of its own (which also warms up) and the timed
    rounds run on the memory the process holds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    peak = dict.fromkeys(fns, 0.0)
    rise = dict.fromkeys(fns, 0.0)

    def measured(name: str, fn: Callable[[], object], timed: bool) -> None:
        if not retain or not timed:
            reset_peak()
        before = _status_kib("VmRSS")
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        if timed:
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        if not retain or not timed:
            top = _status_kib("VmHWM")
            peak[name], rise[name] = max(peak[name], top / 1024), max(rise[name], (top - before) / 1024)

    if warmup and not retain:
        for fn in fns.values():
            fn()
    if retain:
        for name, fn in fns.items():
            measured(name, fn, timed=False)
    for _ in range(repeats):
        for name, fn in fns.items():
            measured(name, fn, timed=True)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    return median, {name: statistics.median(ts) for name, ts in cpu.items()}, peak, rise


# --------------------------------------------------------------------------------------------- through a Trainer
class StepClock(pl.Callback):
    """Wall and CPU seconds of every training batch (forward, loss, backward, clipping, AdamW, logging)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: object, idx: int) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: object, batch: object,
                           idx: int) -> None:
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() - self._c0)


def member_modules(variants: list[str], data: object, args: argparse.Namespace,
                   reference: Callable | None) -> dict[str, pl.LightningModule]:
    """The member modules foxhunt.fit trains (``Mamba2Module``, ``TFTModule``), at the bench's sizes, bound to the
    data; the reference variant is the Mamba2Module with the reference scan in every block."""
    from foxhunt.data.market import MarketSpec
    from foxhunt.lit.mamba2 import Mamba2Module
    from foxhunt.quality.forecasters import make_module

    split = data.splits["train"]
    spec = MarketSpec(list(split.feature_names), list(data.known_future), list(split.symbols), data.lookback,
                      data.horizon)
    modules: dict[str, pl.LightningModule] = {}
    for name in variants:
        torch.manual_seed(0)
        if name == "tft":
            modules[name] = make_module(data, hidden_size=args.d_model, attention_heads=4, hidden_continuous_size=16,
                                        dropout=0.1, optim={"log_grad_norm_every": 0})
            continue
        module = Mamba2Module(quantiles=QUANTILES, d_model=args.d_model, n_layers=args.layers, d_state=args.d_state,
                              headdim=args.headdim, expand=args.expand, chunk_size=args.chunk, optim={"log_grad_norm_every": 0},
                              native=name == "native")
        module.bind(spec)
        if name.startswith("reference"):
            use_reference_scan(module.net, reference)  # type: ignore[arg-type]
        modules[name] = module
    return modules


def bench_trainer(length: int, variants: list[str], args: argparse.Namespace,
                  reference: Callable | None) -> dict[str, object]:
    """Training steps of the member modules inside ``lightning.pytorch.Trainer.fit`` on window batches of a synthetic
    market (8 features of which 3 known in advance, horizon 6): ``--repeats`` rounds, each a short fit of every
    module in turn (``--trainer-steps`` steps; a fit's first step is dropped as its warm-up), medians over the rest.
    Memory: the peak resident set's rise during each module's first fit, freed memory given back before it."""
    from foxhunt.quality.forecasters import build_quality_data, windows

    n_bars = max(20_000, int((length + HORIZON + args.batch * (args.trainer_steps + 1)) / 0.65))
    data = build_quality_data(n_bars, lookback=length, horizon=HORIZON, quantiles=QUANTILES)
    modules = member_modules(variants, data, args, reference)
    clocks = {name: StepClock() for name in modules}
    row: dict[str, object] = {"L": length, "batch": args.batch, "load_before": os.getloadavg()}
    rise = dict.fromkeys(modules, 0.0)
    for rep in range(args.repeats):
        for name, module in modules.items():
            if rep == 0:  # memory in the first round (freed memory given back first; later rounds run on what is held)
                reset_peak()
                before = _status_kib("VmRSS")
            trainer = pl.Trainer(max_steps=args.trainer_steps, accelerator="cpu", gradient_clip_val=1.0, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 limit_val_batches=0, num_sanity_val_steps=0, callbacks=[clocks[name]])
            n_before = len(clocks[name].cpu)
            trainer.fit(module, train_dataloaders=windows(data, "train", args.batch, shuffle=True))
            del clocks[name].wall[n_before], clocks[name].cpu[n_before]  # the fit's first step
            if rep == 0:
                rise[name] = (_status_kib("VmHWM") - before) / 1024
    row["load"] = os.getloadavg()
    for name, clock in clocks.items():
        wall, cpu = statistics.median(clock.wall), statistics.median(clock.cpu)
        row[name] = {"step_s": wall, "step_cpu_s": cpu, "samples_per_s": args.batch / wall,
                     "cpu_samples_per_s": args.batch / cpu, "steps_timed": len(clock.cpu), "rss_rise_mib": rise[name]}
    best = fastest(clocks)
    if best is not None:
        row["speedup_of"] = best
        row["speedup"] = {n: row[n]["step_s"] / row[best]["step_s"] for n in clocks if n != best}
        row["speedup_cpu"] = {n: row[n]["step_cpu_s"] / row[best]["step_cpu_s"] for n in clocks if n != best}
    return row


# ------------------------------------------------------------------------------------------------------- networks
def build(variants: list[str], length: int, args: argparse.Namespace, reference: Callable | None) -> dict[str, nn.Module]:
    """The networks to compare, the Mamba-2 versions sharing one set of initial weights."""
    torch.manual_seed(0)
    base = Mamba2Forecaster(args.inputs, list(range(args.inputs - KNOWN, args.inputs)), 1, HORIZON,
                            d_model=args.d_model, n_layers=args.layers, d_state=args.d_state, headdim=args.headdim,
                            expand=args.expand, chunk_size=args.chunk, n_quantiles=len(QUANTILES))
    nets: dict[str, nn.Module] = {}
    for name in variants:
        if name == "tft":
            torch.manual_seed(0)
            nets[name] = TemporalFusionTransformer(args.inputs, KNOWN, 1, length, HORIZON, hidden_size=args.d_model,
                                                   attention_heads=4, hidden_continuous_size=16,
                                                   n_quantiles=len(QUANTILES), dropout=0.1)
            continue
        net = copy.deepcopy(base)
        for module in net.modules():
            if hasattr(module, "native"):  # the plain block around the reference scan, or the C loops
                module.native = name == "native"
        if name.startswith("reference"):
            use_reference_scan(net, reference)  # type: ignore[arg-type]
        nets[name] = net
    return nets


def batch(length: int, args: argparse.Namespace) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"x_past": torch.randn(args.batch, length, args.inputs, generator=gen),
            "x_future": torch.randn(args.batch, HORIZON, KNOWN, generator=gen),
            "symbol": torch.zeros(args.batch, dtype=torch.long),
            "y": torch.randn(args.batch, HORIZON, generator=gen)}


def pinball(pred: Tensor, y: Tensor) -> Tensor:
    qs = torch.tensor(QUANTILES)
    err = y[..., None] - pred
    return torch.maximum(qs * err, (qs - 1) * err).mean()


def training_step(net: nn.Module, data: dict[str, Tensor]) -> Callable[[], None]:
    """One timed step on ``data``: forward, pinball loss, backward, AdamW (its own optimizer)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step() -> None:
        loss = pinball(net(data["x_past"], data["x_future"], data["symbol"]).prediction, data["y"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def agreement(nets: dict[str, nn.Module], data: dict[str, Tensor], rows: int) -> dict[str, float]:
    """Largest differences between the Mamba-2 versions on the first ``rows`` sequences of the batch: every step of
    the stack's output, and every parameter's gradient of the loss (relative to its largest entry), against the
    first version."""
    data = {k: v[:rows] for k, v in data.items()}
    names = [n for n in nets if n in MAMBA_VARIANTS]
    outs, grads = {}, {}
    for name in names:
        net = nets[name]
        h = net.backbone(net.embed(data["x_past"], data["x_future"], data["symbol"]))
        loss = pinball(net.quantile_head(h[:, -HORIZON:]), data["y"])
        grads[name] = torch.autograd.grad(loss, list(net.parameters()))
        outs[name] = h.detach()
    first = names[0]
    out: dict[str, float] = {}
    for name in names[1:]:
        diff = float((outs[name] - outs[first]).abs().max())
        out[f"{name}_vs_{first}_max_abs"] = diff
        out[f"{name}_vs_{first}_max_rel"] = diff / float(outs[first].abs().max())
        out[f"{name}_vs_{first}_grad_max_rel"] = max(float((g - g0).abs().max() / g0.abs().max().clamp_min(1e-30))
                                                     for g, g0 in zip(grads[name], grads[first], strict=True))
    return out


def bench_lookback(length: int, variants: list[str], args: argparse.Namespace,
                   reference: Callable | None) -> dict[str, object]:
    nets = build(variants, length, args, reference)
    data = batch(length, args)
    row: dict[str, object] = {"L": length, "batch": args.batch}
    if sum(v in MAMBA_VARIANTS for v in variants) > 1:
        row["agreement"] = agreement(nets, data, args.check_rows)
    steps = {name: training_step(net, data) for name, net in nets.items()}
    row["load_before"] = os.getloadavg()
    seconds, cpu, peak, rise = interleaved(steps, args.repeats, not args.no_warmup, args.allocator == "retain")
    row["load"] = os.getloadavg()
    for name in steps:
        row[name] = {"step_s": seconds[name], "step_cpu_s": cpu[name], "samples_per_s": args.batch / seconds[name],
                     "cpu_samples_per_s": args.batch / cpu[name], "peak_rss_mib": peak[name],
                     "rss_rise_mib": rise[name]}
    best = fastest(seconds)
    if best is not None:
        row["speedup_of"] = best
        row["speedup"] = {n: seconds[n] / seconds[best] for n in seconds if n != best}
        row["speedup_cpu"] = {n: cpu[n] / cpu[best] for n in cpu if n != best}
    return row


MATRIX_OPS = ("aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm", "aten::addbmm")


def sgemm_rate() -> float:
    """This core's FLOP/s on one large float32 matrix product (the ceiling a fused kernel's products could reach)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t = time.process_time()
    for _ in range(5):
        a @ b
    return 5 * 2 * 2048**3 / (time.process_time() - t)


def profile_lookback(length: int, variant: str, args: argparse.Namespace) -> dict[str, float]:
    """Share and rate of a version's matrix products in its step, and the step's speed-up ceilings under fusion."""
    from torch.utils.flop_counter import FlopCounterMode

    step = training_step(build([variant], length, args, None)[variant], batch(length, args))
    step()
    rounds = max(1, args.repeats)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            step()
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6 / rounds
    matrix = sum(e.self_cpu_time_total for e in prof.key_averages()
                 if e.key.startswith(MATRIX_OPS)) / 1e6 / rounds
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    products = {str(k).removeprefix("aten.") for k in ("mm", "bmm", "baddbmm", "addmm", "addbmm")}
    flops = sum(v for k, v in counter.get_flop_counts()["Global"].items() if str(k).removeprefix("aten.") in products)
    peak = sgemm_rate()
    return {"L": length, "batch": args.batch, "variant": variant, "step_s_profiled": total, "matrix_share": matrix / total,
            "matrix_gflop": flops / 1e9, "matrix_gflop_per_s": flops / matrix / 1e9,
            "large_sgemm_gflop_per_s": peak / 1e9, "ceiling_rest_free": total / matrix,
            "ceiling_rest_free_products_at_peak": total / (flops / peak)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lookbacks", default="64,512,4096")
    parser.add_argument("--variants", default="reference,chunked,native,tft",
                        help="any of reference, chunked, native (Mamba-2 versions) and tft")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--inputs", type=int, default=8, help="features per bar (the TFT's cost grows with them)")
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-state", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=8)
    parser.add_argument("--expand", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=16, help="chunk length of every scan")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    parser.add_argument("--no-warmup", action="store_true", help="no warm-up round (for the long lookbacks)")
    parser.add_argument("--check-rows", type=int, default=16, help="sequences of the batch the outputs are compared on")
    parser.add_argument("--reference", type=Path, default=None, help="a local ssd_minimal.py (default: download)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--trainer", action="store_true",
                        help="time the member modules (Mamba2Module, TFTModule) inside Lightning's Trainer.fit, the path "
                             "foxhunt.fit runs, instead of the bare networks")
    parser.add_argument("--profile", action="store_true",
                        help="profile the first variant's step: its matrix products' share and rate, and the "
                             "speed-up ceilings of fusing the rest")
    parser.add_argument("--trainer-steps", type=int, default=4, help="steps of each short fit in --trainer mode")
    parser.add_argument("--allocator", choices=("retain", "system"), default="retain",
                        help="retain: freed memory kept in the process, as foxhunt.fit does (foxhunt.training.memory); "
                             "system: glibc's default (big blocks mapped and unmapped every step)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lookbacks = [int(v) for v in args.lookbacks.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = set(variants) - {*MAMBA_VARIANTS, "tft"}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} CPUs; peak RSS reset: "
          f"{reset_peak()}; baseline RSS {_status_kib('VmRSS') / 1024:.0f} MiB; load {os.getloadavg()}", flush=True)
    if args.profile:
        with retain_freed_memory(args.allocator == "retain"):
            for length in lookbacks:
                r = profile_lookback(length, variants[0], args)
                print(json.dumps(r), flush=True)
                print(f"L {length}, batch {args.batch}: matrix products {r['matrix_share']:.0%} of the {variants[0]} step "
                      f"({r['matrix_gflop']:.2f} GFLOP at {r['matrix_gflop_per_s']:.1f} GFLOP/s; a large product runs "
                      f"{r['large_sgemm_gflop_per_s']:.1f} here). Ceiling of the step's speed-up: "
                      f"x{r['ceiling_rest_free']:.1f} with every other operation free, "
                      f"x{r['ceiling_rest_free_products_at_peak']:.1f} with the products also at the large-product rate.")
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp, retain_freed_memory(args.allocator == "retain") as retained:
        print(f"allocator: {args.allocator} (freed memory retained: {retained})", flush=True)
        reference = None
        if "reference" in variants:
            path = args.reference or fetch_reference(Path(tmp))
            reference = load_reference(path)
            print(f"reference: {path}", flush=True)
        for length in lookbacks:
            rows.append((bench_trainer if args.trainer else bench_lookback)(length, variants, args, reference))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    what = ("the member modules (Mamba2Module, TFTModule) inside Lightning's Trainer.fit" if args.trainer
            else "the Mamba-2 forecaster network and the TFT's")
    print(f"\nTraining step (forward, pinball loss, backward, AdamW) of {what} (d_model "
          f"{args.d_model}, {args.layers} layers, d_state {args.d_state}, headdim {args.headdim}, expand {args.expand}, "
          f"chunk {args.chunk}) and the TFT (hidden {args.d_model}), batch {args.batch}, {args.inputs} inputs, "
          f"{args.threads} thread(s), allocator {args.allocator}, median of {args.repeats} interleaved rounds:")
    best = fastest(variants)
    print(f"(samples/s by wall time, and by CPU time in brackets; x: the {best} version's speed-up, wall (CPU))")
    print(f"{'L':>6} | " + " | ".join(f"{v + ' /s (cpu)':>22} {'MiB rise':>8}" for v in variants)
          + f" | {best} over: " + " ".join(f"{v:>13}" for v in variants if v != best)
          + " | 1-min load before -> after")
    for r in rows:
        cells = " | ".join(f"{r[v]['samples_per_s']:>12.2f} ({r[v]['cpu_samples_per_s']:>7.2f}) {r[v].get('rss_rise_mib', float('nan')):>8.0f}"
                           for v in variants)
        speed = " ".join(f"{r['speedup'][v]:>6.2f} ({r['speedup_cpu'][v]:>4.2f})"
                         for v in variants if v != best) if "speedup" in r else ""
        print(f"{r['L']:>6} | {cells} | {'':15}{speed} | {r['load_before'][0]:.1f} -> {r['load'][0]:.1f}")
    print("\nOutputs of the Mamba-2 versions against the first (max |diff| relative to the largest output; gradients "
          "relative to each parameter's largest):")
    for r in rows:
        if "agreement" in r:
            print(f"{r['L']:>6} | " + ", ".join(f"{k} {v:.1e}" for k, v in r["agreement"].items()))
    base = rows[0]
    print(f"\nScaling against L = {base['L']} (CPU-time ratio of a step, memory-rise ratio; linear would be "
          f"L / {base['L']}):")
    for r in rows[1:]:
        cells = ", ".join(f"{v} x{r[v]['step_cpu_s'] / base[v]['step_cpu_s']:.1f} time, "
                          f"x{r[v].get('rss_rise_mib', math.nan) / max(base[v].get('rss_rise_mib', math.nan), 1.0):.1f} memory"
                          for v in variants)
        print(f"{r['L']:>6} (x{r['L'] / base['L']:.0f}) | {cells}")


if __name__ == "__main__":
    main()
