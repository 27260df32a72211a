"""Shared fixtures: small, deterministic bar frames."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

# The tests' networks are tiny: intra-op threads only add synchronisation (and thrash when processes share cores).
torch.set_num_threads(1)


def make_bars(n: int = 50, symbol: str = "ES", start: str = "2024-01-02 14:30", seed: int = 0, freq: str = "1min") -> pd.DataFrame:
    """A consistent random-walk bar frame in the bar schema."""
    rng = np.random.default_rng(seed)
    close = 100.0 * np.exp(np.cumsum(rng.normal(0, 1e-3, n)))
    open_ = np.r_[100.0, close[:-1]]
    high = np.maximum(open_, close) * (1 + np.abs(rng.normal(0, 5e-4, n)))
    low = np.minimum(open_, close) * (1 - np.abs(rng.normal(0, 5e-4, n)))
    return pd.DataFrame(
        {
            "timestamp": pd.date_range(start, periods=n, freq=freq, tz="UTC").as_unit("ns"),
            "open": open_,
            "high": high,
            "low": low,
            "close": close,
            "volume": rng.integers(1, 1000, n).astype(np.float64),
            "symbol": pd.Series([symbol] * n, dtype="str"),
        }
    )


@pytest.fixture
def bars() -> pd.DataFrame:
    return make_bars()
