"""The quick-start market looks like real life: its oracle's annualised Sharpe after costs is between 1 and 5."""

from __future__ import annotations

from pathlib import Path

import yaml

from foxhunt.data.datamodule import BarDataModule
from foxhunt.evaluation.backtest import oracle_split_positions, policy_metrics

QUICKSTART = Path(__file__).resolve().parents[1] / "lightning_configs" / "quickstart.yaml"


def test_quickstart_oracle_sharpe_is_realistic(tmp_path: Path) -> None:
    """The config's own market, features and cost: the causal oracle (which knows the planted signal) earns an
    annualised Sharpe of 1-5 on validation and test, significantly above zero, at the observed bar density."""
    cfg = yaml.safe_load(QUICKSTART.read_text())
    data = {**cfg["data"], "cache_dir": str(tmp_path)}
    cost = float(cfg["model"]["cost_bps"])
    dm = BarDataModule(**data)
    dm.setup("fit")
    for name in ("val", "test"):
        split = dm.splits[name]
        oracle = oracle_split_positions(split, cost)
        row = policy_metrics({"oracle": oracle, "long": split.valid.float()}, split, cost, significance=True)
        bars_per_year = len(split) / ((int(split.timestamps[-1]) - int(split.timestamps[0])) / 3.15576e16)
        assert 5_000 < bars_per_year < 6_500, bars_per_year  # hourly 23x5 sessions: about 5,980 bars a year
        assert 1.0 <= row["oracle"]["sharpe"] <= 5.0, (name, row["oracle"])
        assert row["oracle"]["sharpe_ci_low"] > 0.0, (name, row["oracle"])
        assert 0.1 < row["oracle"]["turnover"] < 1.0  # it trades, and pays for it
