"""The agents' generalisation task family: markets an agent was never tuned on, cut chronologically into train | val |
test, with the conditional mean an oracle trades on (synthetic) or none (real).

- :func:`task_market`: AR(1) log returns with GARCH(1,1) volatility,
  ``r_t = φ·r_{t−1} + ε_t``, ``ε_t = √h_t·z_t``, ``h_t = ω + α·ε²_{t−1} + β·h_{t−1}`` (one symbol, 1-minute bars), so
  the mean known at bar t is ``m_t = φ·r_{t−1}``; ω is set so the returns' unconditional standard deviation is
  ``sigma`` (2e-3 by default: at 1 bp of cost the causal oracle then earns about 0.16, 0.8 and 4 bp a bar at
  φ = 0.05, 0.1 and 0.3, and nothing at φ = 0).
- :func:`real_market`: a public OHLCV CSV (e.g. daily SPY), no oracle.

Both observe the same three simple causal features, z-scored with training-split statistics: the last return, its
absolute value and the standard deviation of the last ``vol_bars`` returns. The window length is the agent's own
hyperparameter (32 in the benchmark). ``scripts/agent_generalisation.py`` scores agents on these tasks; the PPO
quality table uses the same API.

    data = task_market(phi=0.1, seed=0)      # SyntheticMarket(train, val, test, expected)
    data.expected["test"]                     # [T] float64 m_t of the test bars (the oracle's input)
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from foxhunt.data.market import MarketSplit

__all__ = [
    "MINUTE_NS",
    "SyntheticMarket",
    "TASK_FEATURES",
    "TASK_PHIS",
    "add_task_family_arguments",
    "garch_ar1_returns",
    "read_rows",
    "real_market",
    "record_row",
    "score_cell",
    "simple_features",
    "split_market",
    "task_family",
    "task_market",
]

MINUTE_NS = 60 * 1_000_000_000
TASK_PHIS = (0.0, 0.05, 0.1, 0.3)
TASK_FEATURES = ["ret_1_z", "abs_ret_1_z", "vol_16_z"]


@dataclass
class SyntheticMarket:
    """Train/val/test splits of one market and the conditional mean return of each split's bars (NaN: unknown)."""

    train: MarketSplit
    val: MarketSplit
    test: MarketSplit
    expected: dict[str, torch.Tensor]  # split name -> [T] float64 E[returns[t] | bars <= t]

    @property
    def has_oracle(self) -> bool:
        """The conditional mean is known on the test bars (a synthetic market), so oracles can be scored."""
        return bool(torch.isfinite(self.expected["test"]).any())


def garch_ar1_returns(
    n_bars: int, phi: float, seed: int, sigma: float = 1e-3, alpha: float = 0.05, beta: float = 0.90
) -> tuple[np.ndarray, np.ndarray]:
    """(r [T], m [T]): AR(1) returns with GARCH(1,1) innovations and their conditional means m_t = φ·r_{t−1}."""
    if not 0.0 <= phi < 1.0:
        raise ValueError(f"phi must be in [0, 1), got {phi}")
    if not (alpha >= 0 and beta >= 0 and alpha + beta < 1):
        raise ValueError(f"GARCH needs alpha, beta >= 0 and alpha + beta < 1, got {alpha}, {beta}")
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n_bars)
    var_eps = sigma * sigma * (1.0 - phi * phi)  # innovation variance giving returns of std sigma
    omega = var_eps * (1.0 - alpha - beta)
    r = np.empty(n_bars)
    h, e_prev, r_prev = var_eps, 0.0, 0.0
    for t in range(n_bars):  # a scalar recurrence: data generation, not the trading code
        h = omega + alpha * e_prev * e_prev + beta * h
        e_prev = math.sqrt(h) * z[t]
        r_prev = phi * r_prev + e_prev
        r[t] = r_prev
    expected = phi * np.concatenate([[np.nan], r[:-1]])
    return r, expected


def simple_features(r: np.ndarray, vol_bars: int = 16) -> np.ndarray:
    """[T, 3] causal features at bar t (known at C[t]): the last return, its absolute value, the std of the last
    ``vol_bars`` returns (NaN until enough bars exist)."""
    last = np.concatenate([[np.nan], r[:-1]])  # ln C[t] - ln C[t-1]
    x = np.nan_to_num(last)
    c1 = np.concatenate([[0.0], np.cumsum(x)])
    c2 = np.concatenate([[0.0], np.cumsum(x * x)])
    n = r.shape[0]
    t = np.arange(n)
    lo = np.maximum(t + 1 - vol_bars, 0)
    s1, s2 = c1[t + 1] - c1[lo], c2[t + 1] - c2[lo]
    var = np.maximum(s2 / vol_bars - (s1 / vol_bars) ** 2, 0.0) * vol_bars / (vol_bars - 1)
    vol = np.sqrt(var)
    vol[: vol_bars] = np.nan  # the first return is unknown at bar 0: a full window exists from bar vol_bars on
    return np.stack([last, np.abs(last), vol], 1)


def split_market(
    r: np.ndarray, expected: np.ndarray, features: np.ndarray, feature_names: list[str], timestamps_ns: np.ndarray,
    fractions: tuple[float, float], purge: int, symbol: str = "SYN",
) -> SyntheticMarket:
    """Features z-scored on train, cut chronologically into train | purge | val | purge | test MarketSplits."""
    n_bars = r.shape[0]
    if not (0 < fractions[0] and 0 < fractions[1] and sum(fractions) < 1):
        raise ValueError(f"fractions (train, val) must be positive and leave a test share, got {fractions}")
    close = 100.0 * np.exp(np.concatenate([[0.0], np.cumsum(np.nan_to_num(r))])[:n_bars])
    n_train, n_val = int(n_bars * fractions[0]), int(n_bars * fractions[1])
    bounds = {"train": (0, n_train), "val": (n_train + purge, n_train + n_val), "test": (n_train + n_val + purge, n_bars)}
    mu = np.nanmean(features[:n_train], 0)
    sd = np.nanstd(features[:n_train], 0)
    feats = (features - mu) / np.where(sd > 0, sd, 1.0)
    splits: dict[str, MarketSplit] = {}
    exp_t: dict[str, torch.Tensor] = {}
    for name, (a, b) in bounds.items():
        n = b - a
        if n < 2:
            raise ValueError(f"split {name!r} has {n} bars: too few bars ({n_bars}) for fractions {fractions}")
        rets = r[a:b].astype(np.float32).copy()
        rets[-1] = np.nan  # the next close lies outside the split
        f = feats[a:b].astype(np.float32)
        valid = np.isfinite(f).all(1) & np.isfinite(rets)
        c = close[a:b]
        splits[name] = MarketSplit(
            name=name, symbols=[symbol],
            timestamps=torch.from_numpy(timestamps_ns[a:b].astype(np.int64).copy()),
            symbol_index=torch.zeros(n, dtype=torch.int64),
            ohlcv=torch.from_numpy(np.stack([c, c, c, c, np.ones(n)], 1)),
            returns=torch.from_numpy(rets), targets=torch.from_numpy(rets.copy()),
            valid=torch.from_numpy(valid), features=torch.from_numpy(f), feature_names=list(feature_names),
        )
        exp_t[name] = torch.from_numpy(np.array(expected[a:b], dtype=np.float64))
    return SyntheticMarket(splits["train"], splits["val"], splits["test"], exp_t)


def task_market(
    phi: float, seed: int, n_bars: int = 300_000, sigma: float = 2e-3, vol_bars: int = 16,
    fractions: tuple[float, float] = (0.6, 0.2), purge: int = 64,
) -> SyntheticMarket:
    """One market of the family: AR(1)-in-returns of strength ``phi`` with GARCH(1,1) volatility, seeded."""
    r, expected = garch_ar1_returns(n_bars, phi, seed, sigma)
    ts = np.arange(n_bars, dtype=np.int64) * MINUTE_NS
    return split_market(r, expected, simple_features(r, vol_bars), TASK_FEATURES, ts, fractions, purge)


def real_market(
    path: str | Path, vol_bars: int = 16, fractions: tuple[float, float] = (0.7, 0.15), purge: int = 16
) -> SyntheticMarket:
    """A real series from a CSV with ``timestamp`` and ``close`` columns (one symbol), no oracle (NaN means)."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (daily SPY: see scripts/agent_generalisation.py --help; hourly "
                                "EURUSD: python scripts/fetch_eurusd.py FILE)")
    df = pd.read_csv(path)
    for col in ("timestamp", "close"):
        if col not in df.columns:
            raise ValueError(f"{path}: no column {col!r} (columns: {list(df.columns)})")
    close = df["close"].to_numpy(np.float64)
    bad = np.flatnonzero(~(np.isfinite(close) & (close > 0)))
    if bad.size:
        raise ValueError(f"{path}: row {int(bad[0]) + 2}, field 'close': {close[bad[0]]!r} is not a positive price")
    ts = pd.to_datetime(df["timestamp"], utc=True).astype("int64").to_numpy()
    if np.any(np.diff(ts) <= 0):
        row = int(np.flatnonzero(np.diff(ts) <= 0)[0]) + 3
        raise ValueError(f"{path}: row {row}, field 'timestamp': not after the previous row")
    r = np.append(np.diff(np.log(close)), np.nan)
    symbol = str(df["symbol"].iloc[0]) if "symbol" in df.columns else path.stem
    return split_market(r, np.full(r.shape[0], np.nan), simple_features(r, vol_bars), TASK_FEATURES, ts, fractions,
                        purge, symbol=symbol)


# --- what every task-family benchmark script shares (scripts/agent_generalisation.py, scripts/ppo_quality.py) -----


def add_task_family_arguments(p: argparse.ArgumentParser) -> None:
    """The task-family options of the agent benchmarks: tasks, seeds, the real series, the rule, output."""
    p.add_argument("--phis", type=float, nargs="*", default=[0.0, 0.05, 0.1, 0.3])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--real", type=str, default=None, help="CSV of a real series (timestamp, close)")
    p.add_argument("--n-bars", type=int, default=300_000)
    p.add_argument("--min-edge-confidence", type=float, default=0.95, help="the coordinator's rule (-1: off)")
    p.add_argument("--out", type=str, default=None, help="append JSON lines here")
    p.add_argument("--table", nargs="+", default=None, help="print the table of these JSON-lines files and exit")


def task_family(args: argparse.Namespace) -> Iterator[tuple[str, int, SyntheticMarket]]:
    """(task name, seed, market) of every AR strength and seed asked for, then the real series at every seed: one
    series, so the seed varies only the learners' training (sampling, init), the split stays the same."""
    for phi in args.phis:
        for seed in args.seeds:
            yield f"AR {phi:g}", seed, task_market(phi, seed, n_bars=args.n_bars)
    if args.real:
        for seed in args.seeds:
            yield f"real {Path(args.real).stem}", seed, real_market(args.real)


def read_rows(paths: list[str]) -> list[dict]:
    """The JSON-lines result rows of earlier runs."""
    return [json.loads(line) for f in paths for line in Path(f).read_text().splitlines() if line.strip()]


def record_row(row: dict, out: str | None) -> None:
    """Print a result row as JSON and append it to ``out`` (when given), so a killed sweep keeps what it ran."""
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def score_cell(row: dict | None, flat_mark: str = " (held flat)") -> str:
    """A table cell: fraction of the oracle (synthetic tasks), test log return and turnover, and the rule's mark."""
    if row is None:
        return "-"
    frac = "" if math.isnan(row["fraction_of_oracle"]) else f"{row['fraction_of_oracle']:+.2f}, "
    flat = flat_mark if row.get("held_flat") else ""
    return f"{frac}{row['log_return']:+.4f}, {row['turnover']:.4f}{flat}"
