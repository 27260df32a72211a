"""The accelerator checks of issues 3, 4, 6, 17, 18 and 19 in one short run, for a session that is lent a GPU.

Prints one block per check and a final JSON line; exits non-zero if any training produced a non-finite loss or
metric, or the features computed on the device differ from the CPU path's (NaN positions, or more than 1e-5
relative). Meant to run once on the device machine (about 5 minutes on one GPU), well inside its time limit:

    python scripts/device_check.py                                      # CUDA: 16-mixed and bf16-mixed
    python scripts/device_check.py --accelerator cpu --precisions bf16-mixed --steps 20 --bars 100000   # dry run

- issue 6: the quick-start ensemble through ``foxhunt.fit`` (TFT and DQN in one Trainer) with each precision:
  training steps/s, TFT samples/s, and whether every logged training and validation figure is finite.
- issue 4: the TFT alone at the benchmark sizes with the full feature set (~125 inputs; ``tft.yaml``): samples/s
  per precision and finite losses.
- issue 17: the Mamba-2 member alone (``mamba2.yaml``) with each precision: samples/s and finite losses.
- issues 17 and 18: the four-member ensemble (``ensemble.yaml``: TFT, DQN, PPO and Mamba-2 in one Trainer, the agents
  starting after 20 coordinator steps instead of 4,000 so they train inside the check, the forecasters' LR warm-up
  5 steps instead of 500) with each precision.
- the tests marked ``cuda``, which skip without a GPU (features on the GPU, the bootstrap on the GPU, and Mamba-2's mamba_ssm kernels
  against the pure PyTorch scan when mamba_ssm is importable there): pytest's summary, skips named.
- issues 3 and 19: the feature set (one implementation: plain torch ops on CUDA, CPU kernels on the CPU) over
  ``--bars`` bars from tensors on the device, next to TA-Lib's equivalent calls on the CPU (when installed): seconds
  and ns per bar per feature, including the transfer of the result to the host; then, on CUDA, ``bench_features.py
  --device cuda --bars 1000000 --repeat 3 --no-exactness`` (per family, peak GPU memory and "foxhunt on cuda vs
  TA-Lib on CPU per feature").
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch


class StepClock(L.Callback):
    """Wall time of the training batches after the first ``skip`` (start-up, compilation and cuDNN autotuning)."""

    def __init__(self, skip: int = 5) -> None:
        self.skip, self.batches, self.start, self.end = skip, 0, None, None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.batches == self.skip:
            _sync()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches += 1
        if self.start is not None:
            _sync()
            self.end = time.perf_counter()

    def rate(self) -> float:
        """Timed training batches per second (nan when too few ran)."""
        if self.start is None or self.end is None or self.end <= self.start:
            return float("nan")
        return (self.batches - self.skip - 1) / (self.end - self.start)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Best wall seconds of ``repeat`` runs (the least disturbed one on a shared machine) and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        _sync()
        t = time.perf_counter()
        out = fn()
        _sync()
        best = min(best, time.perf_counter() - t)
    return best, out


def non_finite(metrics: dict[str, Any]) -> list[str]:
    """Names of logged figures that are NaN or infinite (hit rates are NaN when a policy never trades: allowed)."""
    bad = []
    for key, value in metrics.items():
        v = float(value)
        if not math.isfinite(v) and "hit_rate" not in key:
            bad.append(key)
    return bad


def fit_check(config: str, accelerator: str, precision: str, steps: int, extra: list[str]) -> dict[str, Any]:
    """Train one fit config for ``steps`` training batches; throughput and finiteness of what it logged."""
    from foxhunt.fit import build_cli

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        cli = build_cli([
            "--config", config, "--trainer.accelerator", accelerator, "--trainer.devices", "1",
            "--trainer.precision", precision, "--trainer.max_epochs", "1", "--trainer.max_steps", "-1",
            "--trainer.limit_train_batches", str(steps), "--trainer.limit_val_batches", "2",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", str(Path(tmp) / "runs"),
            "--export_dir", str(Path(tmp) / "export"), "--backtest", "false", *extra,
        ], callbacks=[clock])
        t0 = time.perf_counter()
        cli.fit()
        seconds = time.perf_counter() - t0
        metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    batch_size = int(cli.datamodule.hparams.get("batch_size", 0)) if hasattr(cli.datamodule, "hparams") else 0
    rate = clock.rate()
    return {
        "config": config, "precision": precision, "steps": clock.batches, "fit_seconds": round(seconds, 1),
        "train_steps_per_s": round(rate, 2), "tft_samples_per_s": round(rate * batch_size, 1),
        "non_finite": non_finite(metrics), "n_metrics": len(metrics),
        "losses": {k: round(v, 5) for k, v in metrics.items() if "loss" in k},
    }


def feature_check(device: str, bars: int) -> dict[str, Any]:
    """The whole feature set from tensors on ``device``; TA-Lib's equivalent calls on CPU when installed."""
    from foxhunt.features import FeatureSet
    from foxhunt.quality.talib_reference import make_bars, talib_calls

    ohlcv, ts, sym = make_bars(bars, 0)
    fs = FeatureSet()
    dev = torch.device(device)
    args = (ohlcv.to(dev), ts.to(dev), sym.to(dev))

    def run() -> Any:
        out = fs.compute(*args)
        host = type(out)(out.values.cpu(), out.names, out.ready.cpu())  # the result on the host, as the DataModule uses it
        _sync()
        return host

    best, out = best_of(run, 3)
    n_feat = len(fs.names)
    result = {"device": device, "bars": bars, "features": n_feat, "seconds": round(best, 3),
              "ns_per_bar_feature": round(best / bars / n_feat * 1e9, 2), "computed_on": str(args[0].device),
              "includes_transfer_to_host": True}
    if dev.type != "cpu":  # the device's torch path against the CPU kernels: same NaNs, worst relative difference
        ref, got = fs.compute(ohlcv, ts, sym).values.double(), out.values.cpu().double()
        both = ~torch.isnan(ref)
        scale = torch.nan_to_num(ref, nan=0.0).abs().amax(dim=0)
        err = ((got - ref).abs() / (ref.abs() + 1e-3 * scale))[both]
        result.update({"nan_positions_equal": bool(torch.equal(torch.isnan(ref), torch.isnan(got))),
                       "max_rel_diff_vs_cpu": float(err.max()) if err.numel() else 0.0})
    try:
        import talib  # noqa: F401
    except ImportError:
        return result
    o, h, low, c, v = (ohlcv[:, i].double().numpy() for i in range(5))
    calls = talib_calls(o, h, low, c, v)
    t_best, _ = best_of(lambda: [fn() for _, fn in calls], 3)
    result.update({"talib_cpu_seconds": round(t_best, 3), "talib_calls": len(calls),
                   "talib_ns_per_bar_call": round(t_best / bars / len(calls) * 1e9, 2)})
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerator", default="gpu")
    ap.add_argument("--precisions", nargs="+", default=["16-mixed", "bf16-mixed"])
    ap.add_argument("--steps", type=int, default=150, help="training batches per fit")
    ap.add_argument("--bars", type=int, default=1_000_000, help="bars for the feature check")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["ensemble", "tft", "mamba2", "ensemble4", "tests", "features"])
    args = ap.parse_args()
    print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}"
          + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""), flush=True)
    results: dict[str, Any] = {}
    for precision in args.precisions:
        if "ensemble" not in args.skip:
            r = fit_check("lightning_configs/quickstart.yaml", args.accelerator, precision, args.steps, [])
            results[f"ensemble/{precision}"] = r
            print(f"[issue 6] ensemble {precision}: {r}", flush=True)
        if "tft" not in args.skip:
            r = fit_check("lightning_configs/tft.yaml", args.accelerator, precision, args.steps,
                          ["--data.synthetic_bars", "100000"])
            results[f"tft/{precision}"] = r
            print(f"[issue 4] tft (~125 inputs) {precision}: {r}", flush=True)
        if "mamba2" not in args.skip:
            r = fit_check("lightning_configs/mamba2.yaml", args.accelerator, precision, args.steps,
                          ["--data.synthetic_bars", "100000"])
            results[f"mamba2/{precision}"] = r
            print(f"[issue 17] mamba2 {precision}: {r}", flush=True)
        if "ensemble4" not in args.skip:
            r = fit_check("lightning_configs/ensemble.yaml", args.accelerator, precision, args.steps,
                          ["--data.synthetic_bars", "100000", "--data.synthetic_symbols", "1",
                           "--model.members.dqn.init_args.optim.start_step", "20",
                           "--model.members.ppo.init_args.optim.start_step", "20",
                           "--model.members.tft.init_args.optim.warmup_steps", "5",
                           "--model.members.mamba2.init_args.optim.warmup_steps", "5"])
            results[f"ensemble4/{precision}"] = r
            print(f"[issues 17, 18] ensemble of four members {precision}: {r}", flush=True)
    if "tests" not in args.skip:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda", "tests"],
                               capture_output=True, text=True, check=False)
        summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
        skipped = [line for line in tests.stdout.splitlines() if line.startswith("SKIPPED")]
        results["cuda_tests"] = {"returncode": tests.returncode, "summary": summary, "skipped": skipped}
        print(f"[issues 17, 19] tests that need CUDA: {results['cuda_tests']}", flush=True)
        if tests.returncode != 0:
            print(tests.stdout[-4000:], tests.stderr[-2000:], flush=True)
    if "features" not in args.skip:
        device = "cuda" if args.accelerator == "gpu" and torch.cuda.is_available() else "cpu"
        r = feature_check(device, args.bars)
        results["features"] = r
        print(f"[issue 3] features: {r}", flush=True)
        if device == "cuda":
            subprocess.run([sys.executable, str(Path(__file__).with_name("bench_features.py")), "--device", "cuda", "--bars", "1000000", "--repeat", "3", "--no-exactness"], check=False)
    print(json.dumps(results))
    feats = results.get("features", {})
    if any(r.get("non_finite") for r in results.values()) or feats.get("nan_positions_equal") is False \
            or feats.get("max_rel_diff_vs_cpu", 0.0) > 1e-5 or results.get("cuda_tests", {}).get("returncode", 0) != 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
