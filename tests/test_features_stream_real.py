"""FeatureStream on a real series (tests/data/real: the S&P 500's daily bars, 1999-2018): every feature, stepped
bar by bar, in chunks of 7 and 4,096 bars, and resumed from a saved state, against FeatureSet.compute on the same
history, with the tolerances of tests/test_features_stream.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_features_stream import ALL, _assert_match, _batch, _grid, _levels, _run

from foxhunt.data.io import load_bars
from foxhunt.features.stream import FeatureStream

REAL = Path(__file__).parent / "data" / "real" / "sp500_daily.csv"


@pytest.fixture(scope="module")
def real():
    ohlcv, ts, present = _grid(load_bars(REAL, symbol="SPX"))
    batch = _batch(ohlcv, ts, present)
    return ohlcv, ts, present, batch, _levels(ohlcv, present, batch)


def _bounds(T: int, chunk: int, head: int, tail: int) -> list[int]:
    """Chunks of ``chunk`` bars over the first ``head`` and the last ``tail`` bars, one chunk between."""
    return sorted({*range(0, head, chunk), *range(T - tail, T, chunk), T})


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_a_real_series_streams_to_the_batch_values_whatever_the_chunking(real, chunk):
    """Every warm-up and the last years stepped in chunks of ``chunk`` (the years between in one chunk)."""
    ohlcv, ts, present, batch, levels = real
    T = ohlcv.shape[1]
    _assert_match(_run(FeatureStream(ALL, 1), ohlcv, ts, present, _bounds(T, chunk, 300, 250)), batch, levels)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 7])
def test_a_real_series_streams_bar_by_bar_over_twenty_years(real, chunk):
    ohlcv, ts, present, batch, levels = real
    T = ohlcv.shape[1]
    _assert_match(_run(FeatureStream(ALL, 1), ohlcv, ts, present, _bounds(T, chunk, T, 0)), batch, levels)


def test_a_real_series_resumed_from_a_saved_state_continues_exactly(real):
    ohlcv, ts, present, batch, levels = real
    T = ohlcv.shape[1]
    first = FeatureStream(ALL, 1)
    head = _run(first, ohlcv, ts, present, [0, 2_517])
    second = FeatureStream(ALL, 1)
    second.load_state_dict({k: v.clone() for k, v in first.state_dict().items()})
    tail = _run(second, ohlcv, ts, present, [2_517, 2_518, 2_600, T])
    _assert_match(torch.cat((head, tail), dim=1), batch, levels)
