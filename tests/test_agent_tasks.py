"""The agent benchmarks' task family: every seed asked for trains every task, the real series included (small sizes)."""

from __future__ import annotations

import argparse

import numpy as np
import torch

from foxhunt.quality.agent_tasks import add_task_family_arguments, task_family


def test_real_series_runs_at_every_seed(tmp_path) -> None:
    path = tmp_path / "spy.csv"
    days = np.datetime64("2020-01-01") + np.arange(400)
    close = 100.0 * np.exp(np.cumsum(np.random.default_rng(0).normal(0.0, 0.01, 400)))
    path.write_text("timestamp,close\n" + "".join(f"{d},{c:.6f}\n" for d, c in zip(days, close)))
    p = argparse.ArgumentParser()
    add_task_family_arguments(p)
    args = p.parse_args(["--phis", "--seeds", "0", "1", "3", "--real", str(path)])
    tasks = list(task_family(args))
    assert [(name, seed) for name, seed, _ in tasks] == [("real spy", 0), ("real spy", 1), ("real spy", 3)]
    first = tasks[0][2]
    for _, _, data in tasks[1:]:  # the seed varies the learners' training, never the split
        torch.testing.assert_close(data.test.returns, first.test.returns, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(data.train.timestamps, first.train.timestamps)


def test_synthetic_tasks_then_real_per_seed(tmp_path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("timestamp,close\n" + "".join(f"2020-01-01T00:{i // 60:02d}:{i % 60:02d},{100 + i % 7}\n"
                                                   for i in range(300)))
    p = argparse.ArgumentParser()
    add_task_family_arguments(p)
    args = p.parse_args(["--phis", "0.1", "--seeds", "0", "2", "--n-bars", "2000", "--real", str(path)])
    assert [(name, seed) for name, seed, _ in task_family(args)] == [
        ("AR 0.1", 0), ("AR 0.1", 2), ("real x", 0), ("real x", 2)]


def test_fetched_eurusd_format_reads_as_a_real_series(tmp_path) -> None:
    """scripts/fetch_eurusd.py turns the backtesting package's CSV layout into bars that ``real_market`` reads, keeping
    every row, its UTC time and its close (the download itself needs the package registry and is not run here)."""
    import importlib.util
    from pathlib import Path

    from foxhunt.quality.agent_tasks import real_market

    spec = importlib.util.spec_from_file_location("fetch_eurusd", Path(__file__).parents[1] / "scripts" / "fetch_eurusd.py")
    fetch_eurusd = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(fetch_eurusd)  # type: ignore[union-attr]
    hours = np.datetime64("2017-04-19T09:00") + np.arange(300).astype("timedelta64[h]")
    close = 1.07 * np.exp(np.cumsum(np.random.default_rng(1).normal(0.0, 1e-3, 300)))
    raw = (",Open,High,Low,Close,Volume\n" + "".join(
        f"{str(h).replace('T', ' ')}:00,{c:.5f},{c * 1.001:.5f},{c * 0.999:.5f},{c:.5f},{100 + i}\n"
        for i, (h, c) in enumerate(zip(hours, close)))).encode()
    bars = fetch_eurusd.to_bars(raw)
    assert list(bars.columns) == ["timestamp", "symbol", "open", "high", "low", "close", "volume"]
    assert len(bars) == 300 and bars["timestamp"].iloc[0] == "2017-04-19T09:00:00Z"
    path = tmp_path / "eurusd_hourly.csv"
    bars.to_csv(path, index=False)
    market = real_market(path)
    assert market.train.symbols == ["EURUSD"]
    n = len(market.train) + len(market.val) + len(market.test)
    assert 300 - 2 * 16 - 1 <= n <= 300  # purge gaps only
    np.testing.assert_allclose(market.train.returns[:5].numpy(), np.diff(np.log(np.round(close, 5)))[:5], rtol=1e-5)


def test_a_missing_real_series_says_where_to_get_one(tmp_path) -> None:
    import pytest

    from foxhunt.quality.agent_tasks import real_market

    with pytest.raises(FileNotFoundError, match=r"eurusd\.csv: no such file .*agent_generalisation\.py.*fetch_eurusd\.py"):
        real_market(tmp_path / "eurusd.csv")
