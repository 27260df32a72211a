"""Throughput of the TFT window loader (WindowBatches) against a per-sample Dataset + DataLoader collate.

    python scripts/bench_windows.py                       # T=200k, F=125, B=128, L=64, H=6
    python scripts/bench_windows.py --batches 2000 --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from foxhunt.data.market import MarketSplit
from foxhunt.data.windows import WindowBatches


def random_split(n_rows: int, n_features: int, n_symbols: int, seed: int) -> MarketSplit:
    gen = torch.Generator().manual_seed(seed)
    sym = torch.div(torch.arange(n_rows) * n_symbols, n_rows, rounding_mode="floor")
    returns = 1e-3 * torch.randn(n_rows, generator=gen)
    close = 100 * torch.exp(torch.cumsum(returns.double(), 0))
    names = [f"f{i}" for i in range(n_features - 4)] + ["tod_sin", "tod_cos", "dow_sin", "dow_cos"]
    valid = torch.ones(n_rows, dtype=torch.bool)
    valid[:100] = False
    return MarketSplit(
        name="bench",
        symbols=[f"S{i}" for i in range(n_symbols)],
        timestamps=torch.arange(n_rows, dtype=torch.int64) * 60_000_000_000,
        symbol_index=sym,
        ohlcv=close[:, None].expand(n_rows, 5).contiguous(),
        returns=returns,
        targets=returns * 100,
        valid=valid,
        features=torch.randn(n_rows, n_features, generator=gen),
        feature_names=names,
    )


def time_loader(loader, n_batches: int) -> tuple[float, int, int]:
    """Seconds, batches and samples for up to ``n_batches`` batches (one warm-up batch not counted)."""
    it = iter(loader)
    next(it)
    done, samples = 0, 0
    start = time.perf_counter()
    for batch in it:
        samples += int(batch["t"].shape[0])
        done += 1
        if done >= n_batches:
            break
    if batch["x_past"].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, done, samples


class PerSampleDataset(torch.utils.data.Dataset):
    """The usual pattern this loader replaces: one window sliced per __getitem__, collated by the DataLoader."""

    def __init__(self, wb: WindowBatches) -> None:
        self.wb = wb

    def __len__(self) -> int:
        return self.wb.num_windows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        t = int(self.wb.starts[i])
        wb = self.wb
        return {
            "x_past": wb.features[t - wb.lookback + 1 : t + 1],
            "x_future": wb.future_features[t + 1 : t + wb.horizon + 1],
            "y": wb.targets[t : t + wb.horizon],
            "y_raw": wb.returns[t : t + wb.horizon],
            "symbol": wb.symbol_index[t],
            "t": torch.tensor(t),
        }


def report(label: str, seconds: float, batches: int, samples: int) -> None:
    print(
        f"{label:<44} {batches / seconds:10.1f} batches/s {samples / seconds:12.0f} samples/s"
        f"  ({batches} batches, {seconds:.2f} s)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--features", type=int, default=125)
    p.add_argument("--symbols", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lookback", type=int, default=64)
    p.add_argument("--horizon", type=int, default=6)
    p.add_argument("--batches", type=int, default=500, help="batches timed per run (an epoch here is ~1560)")
    p.add_argument("--naive-batches", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    split = random_split(args.rows, args.features, args.symbols, args.seed)
    t0 = time.perf_counter()
    wb = WindowBatches(
        split, args.lookback, args.horizon, args.batch_size,
        known_future=["tod_sin", "tod_cos", "dow_sin", "dow_cos"], shuffle=True, seed=args.seed, device=args.device,
    )
    setup = time.perf_counter() - t0
    mb = args.batch_size * args.lookback * args.features * 4 / 2**20
    print(
        f"T={args.rows} F={args.features} symbols={args.symbols} B={args.batch_size} L={args.lookback} "
        f"H={args.horizon} device={args.device} torch={torch.__version__} threads={torch.get_num_threads()}"
    )
    print(f"{wb.num_windows} windows, {len(wb)} batches/epoch, x_past {mb:.1f} MiB/batch; setup {setup * 1e3:.0f} ms")

    report(f"WindowBatches ({torch.get_num_threads()} threads)", *time_loader(wb, args.batches))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    report("WindowBatches (1 thread)", *time_loader(wb, args.batches))
    if args.device == "cpu":
        loader = torch.utils.data.DataLoader(PerSampleDataset(wb), batch_size=args.batch_size, shuffle=True)
        report("per-sample Dataset + DataLoader (1 thread)", *time_loader(loader, args.naive_batches))
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
