"""A decision log scored against the bars it traded: the back-test's after-cost metrics of the positions it logged."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from foxhunt.data.bars import DataError
from foxhunt.data.datamodule import split_returns
from foxhunt.data.market import MarketSplit
from foxhunt.data.tensors import bars_tensors
from foxhunt.evaluation.backtest import policy_metrics
from foxhunt.preprocessing import next_log_returns

LOG_COLUMNS = ("ts_event", "symbol", "open", "high", "low", "close", "volume", "ready", "latency_us")


def decisions_split(log: pd.DataFrame, bars: pd.DataFrame, name: str = "decisions") -> tuple[MarketSplit, dict]:
    """The bars as a split whose decision bars are the log's ready rows, and the log's positions [T] per policy
    (member columns and ``ensemble``) aligned to its rows; refused in one line when a logged bar is not in the data."""
    symbols, ts, sym, ohlcv = bars_tensors(bars)
    returns = split_returns(next_log_returns(ohlcv[:, 3], segment=sym), sym)
    key = pd.MultiIndex.from_arrays([np.asarray(symbols, dtype=object)[sym.numpy()], ts.numpy()])
    logged = pd.MultiIndex.from_arrays([log["symbol"].astype(str).to_numpy(), log["ts_event"].to_numpy(np.int64)])
    where = key.get_indexer(logged)
    if (where < 0).any():
        i = int(np.flatnonzero(where < 0)[0])
        raise DataError(f"{name}: logged bar {logged[i][0]} at {pd.Timestamp(logged[i][1], tz='UTC')} is not in the "
                        "data: score a log against the bars it traded")
    ready = torch.zeros(len(ts), dtype=torch.bool)
    ready[torch.from_numpy(where)] = torch.from_numpy(log["ready"].to_numpy(bool, copy=True))
    valid = ready & torch.isfinite(returns)
    split = MarketSplit(name=name, symbols=list(symbols), timestamps=ts, symbol_index=sym, ohlcv=ohlcv,
                        returns=returns, targets=torch.nan_to_num(returns), valid=valid)
    positions = {}
    for col in (c for c in log.columns if c not in LOG_COLUMNS and not str(c).startswith("feature.")):
        p = torch.zeros(len(ts), dtype=torch.float32)
        p[torch.from_numpy(where)] = torch.from_numpy(log[col].to_numpy(np.float32, copy=True))
        positions[col] = torch.where(valid, p, torch.zeros_like(p))
    positions["buy_and_hold"] = valid.float()
    return split, positions


def score_decisions(log: pd.DataFrame, bars: pd.DataFrame, cost_bps: float, bars_per_year: float | None = None,
                    significance: bool = True) -> dict[str, dict[str, float]]:
    """After-cost metrics of every policy the log holds, on the bars it traded (the back-test's own scoring)."""
    split, positions = decisions_split(log, bars)
    return policy_metrics(positions, split, cost_bps, bars_per_year, significance=significance)
