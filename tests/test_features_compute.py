"""Audit of the features' edge cases: flat stretches (a volatility or ATR of exactly 0) keep every feature finite past
its warm-up, and NaN or infinite values past a warm-up are reported, never passed on silently."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from test_features import make_bars
from test_features_ops import ALL, every_feature, tensors

from foxhunt.features import REGISTRY, FeatureSet
from foxhunt.features.compute import _compute
from foxhunt.features.registry import Feature


def flat_bars() -> pd.DataFrame:
    """Two symbols: AAA opens with 60 flat bars (H = L = O = C: ATR(14) is exactly 0 at its first value) and has flat
    runs of 6, 60 and 250 bars later (volume 0, as forward-filled bars have); BBB is an ordinary random walk."""
    bars = make_bars(1500, ("AAA", "BBB"), seed=1)
    aaa = np.flatnonzero(bars.symbol.to_numpy() == "AAA")
    for a, n in ((0, 60), (300, 6), (600, 60), (900, 250)):
        rows = aaa[a : a + n]
        price = bars.loc[aaa[max(a - 1, 0)], "close"]
        bars.loc[rows, ["open", "high", "low", "close"]] = price
        bars.loc[rows, "volume"] = 0.0
    return bars


def test_flat_stretches_keep_every_feature_finite_after_warmup():
    """vol_ratio_* were ln(0 / x) = -inf after five unchanged closes (NaN when both volatilities were 0), atr_ratio_7_28
    likewise, and every feature in ATR units was (x - y) / 0 = NaN or inf while ATR(14) was 0: past the warm-up, where
    ``ready`` says the row is usable. Now: 0 where the denominator is 0, the ratio floored at 0.001."""
    bars = flat_bars()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither numpy's divide-by-zero nor the non-finite report
        values = every_feature(bars)
    pos = bars.groupby("symbol", sort=False).cumcount().to_numpy()
    bad = {name: int((~np.isfinite(values[j, pos >= REGISTRY[name].warmup])).sum()) for j, name in enumerate(ALL)}
    assert not any(bad.values()), f"non-finite past the warm-up: { {k: v for k, v in bad.items() if v} }"

    aaa = np.flatnonzero(bars.symbol.to_numpy() == "AAA")
    col = dict(zip(ALL, values, strict=True))
    # bars 50..59 and 949..1149 of AAA: both volatilities 0 (ratio 1); bars 905..948: the short one 0, the long one not
    np.testing.assert_array_equal(col["vol_ratio_5_50"][aaa[50:60]], 0.0)
    np.testing.assert_array_equal(col["vol_ratio_5_50"][aaa[949:1150]], 0.0)
    np.testing.assert_array_equal(col["vol_ratio_5_50"][aaa[905:949]], math.log(1e-3))
    np.testing.assert_array_equal(col["atr_ratio_7_28"][aaa[28:60]], 0.0)
    for name in ("mom_5", "dist_sma_5", "dist_ema_5", "macd_12_26_9", "range_atr", "gap_atr", "vwap_dist_20"):
        np.testing.assert_array_equal(col[name][aaa[REGISTRY[name].warmup : 60]], 0.0, err_msg=name)
    # where ATR is not 0 nothing changed: a bar with a range has a positive range_atr
    rows = aaa[100:300]
    has_range = bars.loc[rows, "high"].to_numpy() > bars.loc[rows, "low"].to_numpy()
    np.testing.assert_array_equal(col["range_atr"][rows] > 0.0, has_range)


def _poisoned() -> Feature:
    """A feature (warm-up 3) that is NaN inside its warm-up, inf at bar 10 and NaN at bar 20 of every symbol."""

    def fn(p, out=None):
        v = torch.zeros(p.shape, dtype=torch.float64)
        v[:, :3] = math.nan
        v[:, 10] = math.inf
        v[:, 20] = math.nan
        return v

    return Feature("poisoned", "shape", "test only", 3, fn)


@pytest.mark.parametrize("symbols", [("AAA",), ("AAA", "BBB", "CCC")])
def test_nonfinite_values_after_warmup_are_reported(symbols, monkeypatch):
    """A NaN or an inf past a feature's warm-up is not covered by ``ready``; it was returned without a word (and the
    DataModule turns NaN into 0 and clips inf to the clip bound). Now one RuntimeWarning names the feature and counts
    its values (two per symbol here; the warm-up's NaNs are not counted), and clean features are not named."""
    args = tensors(make_bars(200, symbols, seed=4))
    monkeypatch.setitem(REGISTRY, "poisoned", _poisoned())  # registered for the run (its release plan's dry run)
    chosen = [REGISTRY["rsi_14"], REGISTRY["poisoned"], REGISTRY["gap"]]
    with pytest.warns(RuntimeWarning, match=rf"poisoned \({2 * len(symbols)}\)") as caught:
        with torch.no_grad():
            values, _ = _compute(chosen, *args)
    text = " ".join(str(w.message) for w in caught)
    assert "rsi_14" not in text and "gap" not in text
    assert np.isinf(values[1].numpy()).sum() == len(symbols)  # reported, not altered

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FeatureSet(names=["rsi_14", "gap"]).compute(*args)  # clean features: no warning


def test_nonfinite_counts_from_a_device_are_read_in_one_report():
    """On a GPU each feature's count stays a 0-d tensor (no host synchronisation per feature) and the report reads them
    all at once, mixed with the CPU's ints; exercised here with CPU tensors."""
    from foxhunt.features.compute import _report_nonfinite

    chosen = [REGISTRY["rsi_14"], REGISTRY["gap"], REGISTRY["bar_return"]]
    with pytest.warns(RuntimeWarning, match=r"3 NaN or infinite value\(s\) after the warm-up, in gap \(3\)$"):
        _report_nonfinite(chosen, [torch.tensor(0), torch.tensor(3), 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _report_nonfinite(chosen, [torch.tensor(0), 0, torch.tensor(0)])
