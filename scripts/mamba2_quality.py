"""Mamba-2 forecaster quality against exact oracles (issue 17, section 3).

1. **Weak planted signal** (the TFT's yardstick, :mod:`foxhunt.quality.forecasters`): the synthetic market with
   signal strength 0.1 and a handful of causal features; Mamba2Module is trained on it and compared on the test
   split, at the first horizon step, with the market's exact conditional quantiles: quantile-loss ratio to the
   oracle, share of the no-skill-to-oracle gap closed, [q0.1, q0.9] coverage. ``--tft`` trains the TFT on the same
   data and steps for comparison.
2. **Lookback table** (``--lookbacks 16,32,64``): the same, per member lookback (the data's windows are the longest).
3. **Long-memory planted signal** (``--long-memory``): returns r[t+1] = sigma (s m[t] + sqrt(1 - s^2) e[t+1]), where
   m[t] = sum of the last W values of an observed flow series f (i.i.d. N(0, 1)) / sqrt(W): the oracle needs W bars of
   memory. A forecaster with lookback L < W sees the share L / W of the signal's variance, so the gap it can close
   grows with L until L = W. Printed per lookback: loss ratio, gap closed (and its expectation for the best forecaster
   at that lookback; the test split's sampling noise is a few hundredths), coverage, training time.
4. **Lookback table on the weak signal** (``--table 64,512,4096 --tft-table 64,512``): Mamba-2 and the TFT at each
   lookback on the same windows: the data is built for the longest lookback and, for a shorter one, every split loses
   its first (longest - L) rows, so every model is trained and tested on windows ending at the same rows. Test
   pinball loss (ratio to the oracle's, gap closed) and coverage, with training time; ``--table-steps`` and
   ``--table-batch-size`` size it to the CPU at hand.

    python scripts/mamba2_quality.py --threads 1                       # 1: weak signal, 200k bars, 800 steps
    python scripts/mamba2_quality.py --n-bars 40000 --steps 300 --tft  # quick look, with the TFT beside it
    python scripts/mamba2_quality.py --skip-weak --long-memory --window 128 --lm-lookbacks 32,64,128,256
    python scripts/mamba2_quality.py --skip-weak --long-memory --lm-lookbacks 128,512 --lm-tft-lookbacks 64
    python scripts/mamba2_quality.py --skip-weak --table 64,512,4096 --tft-table 64,512 --table-steps 150
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace

import lightning.pytorch as pl
import numpy as np
import torch
from scipy.stats import norm

from foxhunt.data.market import MarketSpec, MarketSplit
from foxhunt.lit.mamba2 import Mamba2Module
from foxhunt.preprocessing import FeatureNormalizer
from foxhunt.quality.forecasters import QualityData, build_quality_data, evaluate, windows
from foxhunt.quality.forecasters import train as train_tft
from foxhunt.training.memory import retain_freed_memory


def train_mamba2(data: QualityData, *, steps: int, batch_size: int = 128, seed: int = 0, **hparams) -> Mamba2Module:
    """Fit Mamba2Module for ``steps`` optimizer steps with clipping at 1.0 (no validation)."""
    pl.seed_everything(seed, workers=True, verbose=False)
    optim = {"log_grad_norm_every": 0, **hparams.pop("optim", {})}
    module = Mamba2Module(quantiles=data.quantiles, optim=optim, **hparams)
    split = data.splits["train"]
    module.bind(MarketSpec(list(split.feature_names), list(data.known_future), list(split.symbols), data.lookback,
                           data.horizon))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=windows(data, "train", batch_size, shuffle=True, seed=seed))
    return module


def report_of(module: object, data: QualityData) -> dict[str, float]:
    """foxhunt.quality.forecasters.evaluate's figures, with the model's keys named ``model_*`` (windows in batches of about
    64k bars: 1024 windows at lookback 64, 16 at 4096, so a long lookback's forward fits in memory)."""
    batch = max(8, 65536 // data.lookback)
    return {k.replace("tft_", "model_"): v  # type: ignore[arg-type]
            for k, v in evaluate(module, data, "test", batch_size=batch).items()}


def long_memory_data(n_bars: int, *, window: int, strength: float, seed: int, lookback: int, horizon: int = 1,
                     quantiles: tuple[float, ...] = (0.1, 0.5, 0.9)) -> QualityData:
    """One symbol whose next return loads on the sum of the last ``window`` values of an observed flow series.

    The one feature at bar t is ``flow`` f[t]; past returns are not inputs (they carry m, which would let a short
    window read the long sum off them). Targets: r[t+1] / sigma. The oracle's conditional quantiles are exact:
    sigma (s m[t] + sqrt(1 - s^2) Phi^-1(q)).
    """
    rng = np.random.default_rng(seed)
    sigma = 1e-3
    flow = rng.standard_normal(n_bars)
    csum = np.concatenate([[0.0], np.cumsum(flow)])
    idx = np.arange(n_bars)
    m = (csum[idx + 1] - csum[np.maximum(idx + 1 - window, 0)]) / math.sqrt(window)  # m[t]: flow[t-W+1 .. t]
    noise = math.sqrt(1.0 - strength**2)
    ret = np.full(n_bars, np.nan)  # ret[t] = r[t+1], the next-bar return of row t
    ret[:-1] = sigma * (strength * m[:-1] + noise * rng.standard_normal(n_bars - 1))
    features = flow[:, None].astype(np.float32)
    oracle = sigma * (strength * m[:, None] + noise * norm.ppf(np.asarray(quantiles))[None, :])
    warm = idx >= window  # m is a full window from here on
    purge = lookback + horizon
    a, b = int(n_bars * 0.7), int(n_bars * 0.85)
    bounds = {"train": (0, a), "val": (a + purge, b), "test": (b + purge, n_bars)}
    close = 100.0 * np.exp(np.nancumsum(np.concatenate([[0.0], ret[:-1]])))
    ts = idx.astype(np.int64) * 60_000_000_000
    splits, scales, oracles = {}, {}, {}
    for name, (lo, hi) in bounds.items():
        rows = slice(lo, hi)
        r = torch.from_numpy(ret[rows]).float()
        sc = torch.full_like(r, sigma)
        c = torch.from_numpy(close[rows])
        splits[name] = MarketSplit(
            name=name, symbols=["LM0"], timestamps=torch.from_numpy(ts[rows]),
            symbol_index=torch.zeros(hi - lo, dtype=torch.int64), ohlcv=torch.stack([c] * 4 + [torch.ones_like(c)], 1),
            returns=r, targets=r / sc, target_loc=torch.zeros_like(sc), target_scale=sc,
            valid=torch.from_numpy(warm[rows]) & torch.isfinite(r), features=torch.from_numpy(features[rows]),
            feature_names=["flow"],
        )
        scales[name], oracles[name] = sc, oracle[rows]
    return QualityData(None, splits, scales, oracles, tuple(quantiles), [], lookback, horizon,  # type: ignore[arg-type]
                       FeatureNormalizer())


def at_lookback(data: QualityData, lookback: int, test_windows: int = 0) -> QualityData:
    """``data`` read with a shorter lookback on the same windows: each split loses its first (data.lookback -
    lookback) rows, so its first full window ends at the same row as with the longest lookback. ``test_windows`` > 0
    keeps only the test split's last rows, those that the last ``test_windows`` windows need (the same for every
    lookback)."""
    drop = data.lookback - lookback
    if drop < 0:
        raise ValueError(f"lookback {lookback} is longer than the data's {data.lookback}")
    keep = {name: torch.arange(len(split)) >= drop for name, split in data.splits.items()}
    if test_windows > 0:
        n_test = len(data.splits["test"])
        keep["test"] = torch.arange(n_test) >= max(drop, n_test - (test_windows + lookback - 1 + data.horizon))
    return replace(data, lookback=lookback,
                   splits={name: split.select(keep[name]) for name, split in data.splits.items()},
                   target_scale={name: sc[keep[name]] for name, sc in data.target_scale.items()},
                   oracle_quantiles={name: q[keep[name].numpy()] for name, q in data.oracle_quantiles.items()})


def best_gap(lookback: int, window: int, strength: float) -> float:
    """The share of the no-skill-to-oracle gap that the best forecaster seeing ``lookback`` bars closes in expectation.

    It sees the share k = min(L, W) / W of the signal's variance; every loss here is Gaussian, so a forecast's pinball
    loss is proportional to its residual standard deviation: sqrt(1 - s^2 k) against the oracle's sqrt(1 - s^2)."""
    k = min(lookback, window) / window
    return (1.0 - math.sqrt(1.0 - strength**2 * k)) / (1.0 - math.sqrt(1.0 - strength**2))


def main() -> None:
    with retain_freed_memory():  # as foxhunt.fit trains (foxhunt/training/memory.py)
        run()


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-bars", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--signal", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--lookback", type=int, default=32)
    parser.add_argument("--horizon", type=int, default=6)
    parser.add_argument("--lookbacks", default="", help="member lookbacks for the table of section 2 (<= --lookback)")
    parser.add_argument("--tft", action="store_true", help="train the TFT on the same data for comparison")
    parser.add_argument("--skip-weak", action="store_true", help="skip sections 1 and 2")
    parser.add_argument("--long-memory", action="store_true", help="section 3")
    parser.add_argument("--window", type=int, default=128, help="memory W of the long-memory signal")
    parser.add_argument("--strength", type=float, default=0.4, help="loading s of the long-memory signal")
    parser.add_argument("--lm-bars", type=int, default=60_000)
    parser.add_argument("--lm-steps", type=int, default=400)
    parser.add_argument("--lm-batch-size", type=int, default=64)
    parser.add_argument("--lm-lookbacks", default="32,64,128,256")
    parser.add_argument("--lm-tft-lookbacks", default="",
                        help="section 3: TFT lookbacks on the same windows, e.g. 64 (the issue's yardstick)")
    parser.add_argument("--table", default="", help="section 4: Mamba-2 lookbacks, e.g. 64,512,4096")
    parser.add_argument("--tft-table", default="", help="section 4: TFT lookbacks, e.g. 64,512")
    parser.add_argument("--table-steps", type=int, default=150)
    parser.add_argument("--table-batch-size", type=int, default=16)
    parser.add_argument("--table-bars", type=int, default=200_000)
    parser.add_argument("--table-test-windows", type=int, default=0,
                        help="evaluate on the last N test windows only (0: all; a 4096-bar forward is costly)")
    parser.add_argument("--table-longest", type=int, default=0,
                        help="build the windows for this lookback at least (to split one table over processes)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hp = {"d_model": args.d_model, "headdim": args.d_model // 2, "d_state": 16, "n_layers": 2,
          "optim": {"lr": args.lr, "warmup_steps": min(100, args.steps // 10)}}
    if not args.skip_weak:
        t0 = time.perf_counter()
        data = build_quality_data(args.n_bars, seed=args.seed, signal_strength=args.signal, lookback=args.lookback,
                                  horizon=args.horizon)
        t1 = time.perf_counter()
        module = train_mamba2(data, steps=args.steps, batch_size=args.batch_size, seed=args.seed, **hp)
        t2 = time.perf_counter()
        report = report_of(module, data)
        report.update(model="mamba2", n_bars=args.n_bars, steps=args.steps, seed=args.seed, signal=args.signal,
                      lookback=args.lookback, data_s=round(t1 - t0, 1), train_s=round(t2 - t1, 1))
        print(json.dumps(report, indent=2), flush=True)
        print(f"mamba2: loss ratio to the oracle {report['loss_ratio']:.4f} "
              f"(no-skill {report['unconditional_loss_ratio']:.4f}, gap closed {report['gap_closed']:.2f}); "
              f"coverage {report['model_coverage']:.4f} (oracle {report['oracle_coverage']:.4f}); "
              f"{report['train_s']} s", flush=True)
        if args.tft:
            t2 = time.perf_counter()
            tft, _ = train_tft(data, steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                               hidden_size=args.d_model, optim=hp["optim"])
            tr = report_of(tft, data)
            print(f"tft:    loss ratio to the oracle {tr['loss_ratio']:.4f} (gap closed {tr['gap_closed']:.2f}); "
                  f"coverage {tr['model_coverage']:.4f}; {time.perf_counter() - t2:.1f} s", flush=True)
        for lb in [int(v) for v in args.lookbacks.split(",") if v]:
            t2 = time.perf_counter()
            m = train_mamba2(data, steps=args.steps, batch_size=args.batch_size, seed=args.seed, lookback=lb, **hp)
            r = report_of(m, data)
            print(f"lookback {lb:>4}: loss ratio {r['loss_ratio']:.4f}, gap closed {r['gap_closed']:.2f}, "
                  f"coverage {r['model_coverage']:.4f}, {time.perf_counter() - t2:.1f} s", flush=True)
    table = [("mamba2", int(v)) for v in args.table.split(",") if v]
    table += [("tft", int(v)) for v in args.tft_table.split(",") if v]
    if table:
        longest = max(args.table_longest, *(lb for _, lb in table))
        full = build_quality_data(args.table_bars, seed=args.seed, signal_strength=args.signal, lookback=longest,
                                  horizon=args.horizon)
        print(f"\nlookback table: weak signal {args.signal}, {args.table_bars} bars, windows of the longest lookback "
              f"({longest}), {args.table_steps} steps of batch {args.table_batch_size}", flush=True)
        for name, lb in table:
            data = at_lookback(full, lb, args.table_test_windows)
            t2 = time.perf_counter()
            warm = min(100, args.table_steps // 10)
            if name == "mamba2":
                m = train_mamba2(data, steps=args.table_steps, batch_size=args.table_batch_size, seed=args.seed,
                                 **{**hp, "optim": {"lr": args.lr, "warmup_steps": warm}})
            else:
                m, _ = train_tft(data, steps=args.table_steps, batch_size=args.table_batch_size, seed=args.seed,
                                 hidden_size=args.d_model, optim={"lr": args.lr, "warmup_steps": warm})
            train_s = time.perf_counter() - t2
            r = report_of(m, data)
            first = int(data.splits["test"].timestamps[windows(data, "test", 1024).starts[0]])  # the same for all
            print(json.dumps({"model": name, "lookback": lb, "train_s": round(train_s, 1),
                              "test_windows": len(windows(data, "test", 1024).starts), "first_test_ts": first, **r}),
                  flush=True)
            print(f"{name:>6} lookback {lb:>5}: loss ratio {r['loss_ratio']:.4f} "
                  f"(no-skill {r['unconditional_loss_ratio']:.4f}), gap closed {r['gap_closed']:.2f}, "
                  f"coverage {r['model_coverage']:.4f} (oracle {r['oracle_coverage']:.4f}), {train_s:.0f} s",
                  flush=True)
    if args.long_memory:
        lookbacks = [int(v) for v in args.lm_lookbacks.split(",")]
        data = long_memory_data(args.lm_bars, window=args.window, strength=args.strength, seed=args.seed,
                                lookback=max(lookbacks))
        print(f"\nlong memory: W={args.window}, s={args.strength}, {args.lm_bars} bars, {args.lm_steps} steps, "
              f"batch {args.lm_batch_size}, data lookback {max(lookbacks)}", flush=True)
        warm = min(100, args.lm_steps // 10)
        runs = [("mamba2", lb) for lb in lookbacks] + [("tft", int(v)) for v in args.lm_tft_lookbacks.split(",") if v]
        for name, lb in runs:
            t2 = time.perf_counter()
            if name == "mamba2":
                m = train_mamba2(data, steps=args.lm_steps, batch_size=args.lm_batch_size, seed=args.seed,
                                 lookback=lb, **{**hp, "optim": {"lr": args.lr, "warmup_steps": warm}})
                r = report_of(m, data)
            else:  # the TFT reads the same windows cut to its lookback (they end at the same rows)
                short = at_lookback(data, lb)
                m, _ = train_tft(short, steps=args.lm_steps, batch_size=args.lm_batch_size, seed=args.seed,
                                 hidden_size=args.d_model, optim={"lr": args.lr, "warmup_steps": warm})
                r = report_of(m, short)
            print(json.dumps({"model": name, "lookback": lb, **r}), flush=True)
            print(f"{name:>6} lookback {lb:>4}: loss ratio {r['loss_ratio']:.4f} "
                  f"(no-skill {r['unconditional_loss_ratio']:.4f}), gap closed {r['gap_closed']:.2f} "
                  f"(expected at best {best_gap(lb, args.window, args.strength):.2f}), "
                  f"coverage {r['model_coverage']:.4f}, {time.perf_counter() - t2:.1f} s", flush=True)

if __name__ == "__main__":
    main()
