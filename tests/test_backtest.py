"""``python -m foxhunt.backtest``: the training split it rebuilds ends with no decision bar, and the table of unseen
bars holds only the bars after the model's training span."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from foxhunt.data.market import MarketSplit
from foxhunt.evaluation.backtest import policy_metrics
from tests._splits import hourly_split


class _Loaded:
    """What ``foxhunt.backtest`` reads of an export: its config and metadata, and ``split`` (raw returns, no model)."""

    def __init__(self, data: dict | None = None, seen: dict | None = None) -> None:
        self.metadata = {"config": {"data": data or {}}, "data": {"symbols": list(seen or {}), "seen_span": seen or {}}}

    def split(self, bars: pd.DataFrame, name: str = "data", oracle_mean: torch.Tensor | None = None) -> MarketSplit:
        from foxhunt.data.tensors import bars_tensors
        from foxhunt.preprocessing import next_log_returns

        symbols, ts, sym, ohlcv = bars_tensors(bars)
        r = next_log_returns(ohlcv[:, 3], segment=sym).float()
        return MarketSplit(name, symbols, ts, sym, ohlcv, r, torch.nan_to_num(r), torch.isfinite(r),
                           oracle_mean=oracle_mean)


@pytest.mark.parametrize("name", ["train", "val", "test"])
def test_backtest_training_split_ends_with_no_decision_bar(name: str) -> None:
    """``foxhunt.backtest --split`` rebuilds a split of the training data as the fit saw it: each symbol's last row
    has no next return inside the split (it would run into a purged bar, another split's or one after data.end), so
    it is no decision bar and every position is closed there, as in the fit's own tables."""
    from foxhunt.backtest import training_split
    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.data.tensors import bars_tensors

    data = {"synthetic_bars": 3000, "synthetic_symbols": 2, "lookback": 8, "horizon": 2, "cache_dir": None,
            "features": ["logret_1"], "known_future": []}
    ts = bars_tensors(BarDataModule(**data).load())[1]
    data["end"] = pd.Timestamp(int(ts[2800]), tz="UTC").isoformat()  # the test split ends before the data does
    s = training_split(_Loaded(data), name)
    last = torch.ones(len(s), dtype=torch.bool)
    last[:-1] = s.symbol_index[1:] != s.symbol_index[:-1]
    assert int(last.sum()) == 2
    assert not bool(s.valid[last].any()) and bool(torch.isnan(s.returns[last]).all())
    assert bool(s.valid[~last].all())
    m = policy_metrics({"buy_and_hold": s.valid.float()}, s, cost_bps=1.0, bars_per_year=1000.0)["buy_and_hold"]
    assert m["n_trades"] == 4  # bought and sold once per symbol


def test_backtest_unseen_table_holds_only_bars_after_the_training_span() -> None:
    """With --allow-overlap the second table is of the bars after the span the model trained and was selected on;
    bars before that span (which a model fitted on later data has in effect seen the future of) are not among them."""
    from foxhunt.backtest import guard_overlap

    s = hourly_split([0.001] * 40)
    lo, hi = int(s.timestamps[10]), int(s.timestamps[25])
    unseen = guard_overlap(_Loaded(seen={"A": [lo, hi]}), s, allow=True)
    assert unseen is not None and "after the training span" in unseen.name
    assert torch.equal(unseen.timestamps, s.timestamps[26:])
    # a file that ends inside the span has no bar after it: no second table (not one of the bars before the span)
    assert guard_overlap(_Loaded(seen={"A": [lo, int(s.timestamps[-1])]}), s, allow=True) is None


def test_backtest_warns_about_bars_before_the_training_span(caplog) -> None:
    """A file entirely before the span the model was fitted on passes the overlap guard (nothing overlaps), but the
    model learned from those bars' future: one warning says so; a file after the span gets none."""
    import logging

    from foxhunt.backtest import guard_overlap

    s = hourly_split([0.001] * 40)
    with caplog.at_level(logging.WARNING, logger="foxhunt.backtest"):
        later = int(s.timestamps[-1]) + 10**12
        assert guard_overlap(_Loaded(seen={"A": [later, later + 10**12]}), s, allow=False) is None
    assert any("lie before the span" in r.getMessage() and "no out-of-sample test" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="foxhunt.backtest"):
        earlier = int(s.timestamps[0]) - 10**12
        assert guard_overlap(_Loaded(seen={"A": [earlier - 10**12, earlier]}), s, allow=False) is None
    assert not any("lie before the span" in r.getMessage() for r in caplog.records)
