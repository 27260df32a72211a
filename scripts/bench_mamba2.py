"""Speed and memory of foxhunt's Mamba-2 (issue 17, section 4): the SSD scan against the official reference
``ssd_minimal_discrete`` (Listing 1 of Dao & Gu, 2024), and the whole forecaster against foxhunt's TFT, at lookbacks
64, 512 and 4096, one thread, in one run.

1. **SSD scan.** The same inputs (b sequences of L steps, H heads of P channels, one group of B and C of size N) go
   through the reference (``mamba_ssm/modules/ssd_minimal.py`` from the mamba-ssm source distribution, fetched at run
   time with ``pip download mamba-ssm --no-deps --no-binary :all:`` into a temporary directory and imported from
   there: nothing of it is copied into foxhunt; it needs ``einops``) and through ``foxhunt.models.mamba2.ssd_chunked``,
   both with the same chunk length. Printed per L: the largest output difference (absolute, and relative to the
   largest output), samples/s of forward + backward and of forward alone (best of the timed repeats, the two
   implementations interleaved so that load from other processes hits both alike), and the peak resident memory
   of each (VmHWM, reset before each measurement through /proc/self/clear_refs; the process's baseline is printed).
2. **Forecasters.** foxhunt's ``Mamba2Forecaster`` and ``TemporalFusionTransformer`` (the member defaults' sizes), one
   AdamW training step on a batch of windows with random inputs (speed does not depend on the values): samples/s
   and peak RSS, interleaved the same way.

    python scripts/bench_mamba2.py                                # everything; about 10 minutes on one core
    python scripts/bench_mamba2.py --lookbacks 64,512 --skip-forecasters
    python scripts/bench_mamba2.py --reference /path/to/mamba_ssm/modules/ssd_minimal.py   # no download

The reference's inter-chunk step is a dense [chunks x chunks] product (quadratic in L / Q); foxhunt's is one
recurrence step per chunk (linear). Both share the O(L Q) intra-chunk quadratic form, which dominates until L passes
about Q^3 (N + P) / (N P) (~20,000 steps for Q = 64, N = 64, P = 16), so at equal chunk length the gap grows slowly
with L. Measured on the shared 2-core machine (--repeats 3; docs/MAMBA2.md has the full tables), foxhunt over the
reference, forward + backward: x3.17 at L = 64, x1.84 at 512, x1.67 at 4096, outputs within 2.6e-06 of the largest;
Mamba-2 over TFT training steps: x1.05 / x0.54 / x0.29 with 8 inputs, x4.95 / x4.74 / x2.39 with 125 inputs.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from foxhunt.models.mamba2 import Mamba2Forecaster, ssd_chunked
from foxhunt.models.tft import TemporalFusionTransformer


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


def peak_rss_mib(fn: Callable[[], object]) -> tuple[float, float]:
    """(peak RSS during one call of fn, and its rise above the RSS before the call), MiB."""
    reset_peak()
    before = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    return peak / 1024, (peak - before) / 1024


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time (s) of each function over ``repeats`` rounds, one call of each per round."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------------------------------------------- 1. SSD
def ssd_inputs(b: int, length: int, heads: int, p: int, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(b, length, heads, p, generator=gen),
        "dt": F.softplus(torch.randn(b, length, heads, generator=gen) - 3.0),  # the initial dt range, ~0.001..0.1
        "A": -torch.empty(heads).uniform_(1.0, 16.0, generator=gen),
        "B": torch.randn(b, length, 1, n, generator=gen),
        "C": torch.randn(b, length, 1, n, generator=gen),
    }


def bench_ssd(reference: Callable, length: int, args: argparse.Namespace) -> dict[str, object]:
    inp = ssd_inputs(args.batch, length, args.heads, args.headdim, args.d_state)
    q = min(args.chunk, length)
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}

    def ref(grad: bool) -> torch.Tensor:
        x, dt, A, B, C = (leaves[k] for k in ("x", "dt", "A", "B", "C"))
        with torch.set_grad_enabled(grad):
            y, _ = reference(x * dt[..., None], A * dt, B, C, q)  # the reference takes the discretised X and A
            if grad:
                y.sum().backward()
        return y

    def ours(grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            y = ssd_chunked(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], q)
            if grad:
                y.sum().backward()
        return y

    with torch.no_grad():
        y_ref, y_ours = ref(False), ours(False)
    diff = float((y_ref - y_ours).abs().max())
    scale = float(y_ref.abs().max())
    train = interleaved({"reference": lambda: ref(True), "foxhunt": lambda: ours(True)}, args.repeats)
    infer = interleaved({"reference": lambda: ref(False), "foxhunt": lambda: ours(False)}, args.repeats)
    out: dict[str, object] = {"L": length, "batch": args.batch, "chunk": q, "max_abs_diff": diff,
                              "max_rel_diff": diff / scale}
    for name in ("reference", "foxhunt"):
        fn = ref if name == "reference" else ours
        peak, rise = peak_rss_mib(lambda fn=fn: fn(True))
        out[name] = {"train_samples_per_s": args.batch / train[name], "forward_samples_per_s": args.batch / infer[name],
                     "peak_rss_mib": peak, "rss_rise_mib": rise}
    out["speedup_train"] = train["reference"] / train["foxhunt"]
    out["speedup_forward"] = infer["reference"] / infer["foxhunt"]
    return out


# ------------------------------------------------------------------------------------------------------- 2. members
def bench_forecasters(length: int, n_features: int, args: argparse.Namespace) -> dict[str, object]:
    known, horizon, b = 3, 6, args.member_batch
    gen = torch.Generator().manual_seed(0)
    x_past = torch.randn(b, length, n_features, generator=gen)
    x_future = torch.randn(b, horizon, known, generator=gen)
    symbol = torch.zeros(b, dtype=torch.long)
    y = torch.randn(b, horizon, generator=gen)
    torch.manual_seed(0)
    nets = {
        "mamba2": Mamba2Forecaster(n_features, list(range(n_features - known, n_features)), 1, horizon, d_model=32,
                                   n_layers=2, d_state=16, headdim=16, chunk_size=args.chunk),
        "tft": TemporalFusionTransformer(n_features, known, 1, length, horizon, hidden_size=32, attention_heads=4,
                                         hidden_continuous_size=16, dropout=0.1),
    }
    qs = torch.tensor([0.1, 0.5, 0.9])
    steps = {}
    for name, net in nets.items():
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

        def step(net=net, opt=opt) -> None:
            pred = net(x_past, x_future, symbol).prediction
            err = y[..., None] - pred
            loss = torch.maximum(qs * err, (qs - 1) * err).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        steps[name] = step
    best = interleaved(steps, args.member_repeats)
    out: dict[str, object] = {"L": length, "inputs": n_features, "batch": b}
    for name, step in steps.items():
        peak, rise = peak_rss_mib(step)
        out[name] = {"train_samples_per_s": b / best[name], "peak_rss_mib": peak, "rss_rise_mib": rise,
                     "params": sum(p.numel() for p in nets[name].parameters())}
    out["mamba2_over_tft"] = best["tft"] / best["mamba2"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lookbacks", default="64,512,4096")
    parser.add_argument("--batch", type=int, default=16, help="sequences per SSD call")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--headdim", type=int, default=16)
    parser.add_argument("--d-state", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64, help="chunk length of both scans (and the forecaster's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--member-batch", type=int, default=32)
    parser.add_argument("--member-repeats", type=int, default=3)
    parser.add_argument("--widths", default="8,125", help="forecaster input counts (the TFT's cost grows with them)")
    parser.add_argument("--reference", type=Path, default=None, help="a local ssd_minimal.py (default: download)")
    parser.add_argument("--skip-forecasters", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lookbacks = [int(v) for v in args.lookbacks.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); peak RSS reset: {reset_peak()}; "
          f"baseline RSS {_status_kib('VmRSS') / 1024:.0f} MiB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.reference or fetch_reference(Path(tmp))
        reference = load_reference(path)
        print(f"reference: {path}", flush=True)
        ssd = [bench_ssd(reference, length, args) for length in lookbacks]
    for row in ssd:
        print(json.dumps(row), flush=True)
    print(f"\nSSD scan, b={args.batch}, H={args.heads}, P={args.headdim}, N={args.d_state}, G=1, chunk {args.chunk}:")
    print("(samples/s of forward + backward, and of forward alone; x: foxhunt over the reference; MiB: peak RSS of one"
          " forward + backward, and its rise above the RSS before it)")
    print(f"{'L':>6} {'max|dy|':>9} {'rel':>8} | {'ref train/s':>11} {'ours train/s':>12} {'x':>6} | "
          f"{'ref fwd/s':>9} {'ours fwd/s':>10} {'x':>6} | {'ref MiB (rise)':>14} {'ours MiB (rise)':>15}")
    for r in ssd:
        ref, ours = r["reference"], r["foxhunt"]
        print(f"{r['L']:>6} {r['max_abs_diff']:>9.1e} {r['max_rel_diff']:>8.1e} | {ref['train_samples_per_s']:>11.1f} "
              f"{ours['train_samples_per_s']:>12.1f} {r['speedup_train']:>6.2f} | {ref['forward_samples_per_s']:>9.1f} "
              f"{ours['forward_samples_per_s']:>10.1f} {r['speedup_forward']:>6.2f} | "
              f"{ref['peak_rss_mib']:>7.0f} ({ref['rss_rise_mib']:>4.0f}) "
              f"{ours['peak_rss_mib']:>8.0f} ({ours['rss_rise_mib']:>4.0f})")
    if args.skip_forecasters:
        return
    members = []
    for width in [int(v) for v in args.widths.split(",")]:
        for length in lookbacks:
            members.append(bench_forecasters(length, width, args))
            print(json.dumps(members[-1]), flush=True)
    print(f"\nForecaster training step (AdamW), batch {args.member_batch}, 3 known-future inputs, horizon 6; "
          "x: Mamba-2 over TFT samples/s:")
    print(f"{'inputs':>6} {'L':>6} | {'mamba2 /s':>9} {'tft /s':>8} {'x':>6} | "
          f"{'mamba2 MiB (rise)':>17} {'tft MiB (rise)':>14}")
    for r in members:
        m, t = r["mamba2"], r["tft"]
        print(f"{r['inputs']:>6} {r['L']:>6} | {m['train_samples_per_s']:>9.1f} {t['train_samples_per_s']:>8.1f} "
              f"{r['mamba2_over_tft']:>6.2f} | {m['peak_rss_mib']:>10.0f} ({m['rss_rise_mib']:>4.0f}) "
              f"{t['peak_rss_mib']:>7.0f} ({t['rss_rise_mib']:>4.0f})")


if __name__ == "__main__":
    main()
