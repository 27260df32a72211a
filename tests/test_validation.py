"""One test per bad-bar case: the raise names file, row, timestamp and reason; drop and repair count what they touch."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import make_bars

from foxhunt.data import BadBarError, load_bars, write_bars


def _write(tmp_path: Path, bars: pd.DataFrame, name: str = "bars.csv") -> Path:
    return write_bars(bars, tmp_path / name)


def _counts(bars: pd.DataFrame) -> dict[str, int]:
    (counts,) = bars.attrs["foxhunt_validation"].values()
    return counts


def test_clean_bars_pass_untouched(tmp_path: Path) -> None:
    bars = make_bars(20)
    back = load_bars(_write(tmp_path, bars, "clean.parquet"))
    pd.testing.assert_frame_equal(back, bars, check_like=False)
    assert back.attrs["foxhunt_validation"] == {}


def test_non_finite_value(tmp_path: Path, caplog) -> None:
    bars = make_bars(20)
    bars.loc[7, "close"] = np.nan
    bars.loc[9, "volume"] = np.inf
    path = _write(tmp_path, bars, "nan.parquet")
    ts = re.escape(bars["timestamp"].iloc[7].isoformat())
    with pytest.raises(BadBarError, match=rf"nan\.parquet: row 7 \(timestamp {ts}, symbol ES\): non-finite value \(close=nan\); 1 more row\(s\) with non-finite values"):
        load_bars(path)
    with caplog.at_level("WARNING", logger="foxhunt.data"):
        dropped = load_bars(path, on_bad_bar="drop")
    assert len(dropped) == 18 and _counts(dropped) == {"non-finite values": 2}
    assert "dropped 2 bar(s): non-finite values" in caplog.text
    repaired = load_bars(path, on_bad_bar="repair")
    assert len(repaired) == 20 and _counts(repaired) == {"non-finite values": 2}
    # forward-filled: a flat bar at the previous close with zero volume
    assert repaired.loc[7, ["open", "high", "low", "close"]].tolist() == [bars.loc[6, "close"]] * 4
    assert repaired.loc[7, "volume"] == 0.0


def test_non_positive_price(tmp_path: Path) -> None:
    bars = make_bars(10)
    bars.loc[0, "low"] = 0.0  # first bar: nothing to forward-fill from
    bars.loc[4, ["open", "low"]] = [-1.0, -2.0]
    path = _write(tmp_path, bars, "neg.csv")
    with pytest.raises(BadBarError, match=r"neg\.csv: row 0 \(timestamp 2024-01-02T14:30:00\+00:00, symbol ES\): non-positive price \(low=0\.0\); 1 more row"):
        load_bars(path)
    assert _counts(load_bars(path, on_bad_bar="drop")) == {"non-positive prices": 2}
    repaired = load_bars(path, on_bad_bar="repair")
    assert len(repaired) == 9
    assert _counts(repaired) == {"non-positive prices": 2, "bad bars with no earlier close to forward-fill (dropped)": 1}


def test_high_below_open_close(tmp_path: Path) -> None:
    bars = make_bars(10)
    bars.loc[3, "high"] = min(bars.loc[3, "open"], bars.loc[3, "close"]) - 0.01
    path = _write(tmp_path, bars, "high.csv")
    with pytest.raises(BadBarError, match=r"high\.csv: row 3 \(timestamp 2024-01-02T14:33:00\+00:00, symbol ES\): high .* is below max\(open, close\)"):
        load_bars(path)
    assert len(load_bars(path, on_bad_bar="drop")) == 9
    repaired = load_bars(path, on_bad_bar="repair")
    assert _counts(repaired) == {"high below max(open, close)": 1}
    row = repaired.loc[3]
    assert row["high"] == max(row["open"], row["close"], bars.loc[3, "low"]) and row["low"] <= min(row["open"], row["close"])


def test_low_above_open_close(tmp_path: Path) -> None:
    bars = make_bars(10)
    bars.loc[5, "low"] = max(bars.loc[5, "open"], bars.loc[5, "close"]) + 0.01
    path = _write(tmp_path, bars, "low.parquet")
    with pytest.raises(BadBarError, match=r"row 5 .*: low .* is above min\(open, close\)"):
        load_bars(path)
    repaired = load_bars(path, on_bad_bar="repair")
    assert _counts(repaired) == {"low above min(open, close)": 1}
    assert repaired.loc[5, "low"] == min(repaired.loc[5, ["open", "close"]])


def test_negative_volume(tmp_path: Path) -> None:
    bars = make_bars(10)
    bars.loc[2, "volume"] = -5.0
    path = _write(tmp_path, bars, "vol.csv")
    with pytest.raises(BadBarError, match=r"vol\.csv: row 2 .*: negative volume -5\.0"):
        load_bars(path)
    assert len(load_bars(path, on_bad_bar="drop")) == 9
    repaired = load_bars(path, on_bad_bar="repair")
    assert repaired.loc[2, "volume"] == 0.0 and _counts(repaired) == {"negative volume": 1}


def test_duplicate_timestamps(tmp_path: Path) -> None:
    bars = make_bars(10)
    dup = pd.concat([bars.iloc[:5], bars.iloc[4:5].assign(close=bars.loc[4, "close"]), bars.iloc[5:]], ignore_index=True)
    path = _write(tmp_path, dup, "dup.csv")
    with pytest.raises(BadBarError, match=r"dup\.csv: row 5 \(timestamp 2024-01-02T14:34:00\+00:00, symbol ES\): duplicate timestamp"):
        load_bars(path)
    dropped = load_bars(path, on_bad_bar="drop")
    assert len(dropped) == 10 and _counts(dropped) == {"duplicate timestamps": 1}
    repaired = load_bars(path, on_bad_bar="repair")
    assert len(repaired) == 10 and _counts(repaired) == {"duplicate timestamps (kept the first)": 1}


def test_out_of_order_timestamps(tmp_path: Path) -> None:
    bars = make_bars(10)
    swapped = bars.iloc[[0, 1, 2, 4, 3, 5, 6, 7, 8, 9]].reset_index(drop=True)
    path = _write(tmp_path, swapped, "ooo.csv")  # the DBN writer puts records in time order, as the format asks
    with pytest.raises(BadBarError, match=r"ooo\.csv: row 4 \(timestamp 2024-01-02T14:33:00\+00:00, symbol ES\): timestamp out of order"):
        load_bars(path)
    dropped = load_bars(path, on_bad_bar="drop")
    assert len(dropped) == 9 and _counts(dropped) == {"out-of-order timestamps": 1}
    repaired = load_bars(path, on_bad_bar="repair")
    assert _counts(repaired) == {"out-of-order timestamps (sorted)": 1}
    pd.testing.assert_series_equal(repaired["timestamp"], bars["timestamp"])


def test_interleaved_symbols_are_checked_per_symbol(tmp_path: Path) -> None:
    a, b = make_bars(6, "A", seed=1), make_bars(6, "B", seed=2)
    inter = pd.concat([a, b]).sort_values(["timestamp", "symbol"], kind="stable").reset_index(drop=True)
    back = load_bars(_write(tmp_path, inter, "inter.csv"))
    assert back["symbol"].tolist() == ["A"] * 6 + ["B"] * 6
    inter.loc[7, "high"] = 0.5 * inter.loc[7, "low"]  # row 7 in the file is B's 4th bar
    with pytest.raises(BadBarError, match=r"row 7 \(timestamp 2024-01-02T14:33:00\+00:00, symbol B\)"):
        load_bars(_write(tmp_path, inter, "inter_bad.csv"))


def test_bad_policy_name() -> None:
    with pytest.raises(ValueError, match=r"on_bad_bar must be 'raise', 'drop' or 'repair', got 'fix'"):
        load_bars("whatever.csv", on_bad_bar="fix")  # type: ignore[arg-type]


# --- checks that catch what breaks models: float32's range, jumps, mixed spacings, disjoint dates --------------------
def _spike(n: int = 200, at: int = 120, factor: float = 1000.0) -> pd.DataFrame:
    """Bars with one bar whose prices are ``factor`` times its neighbours' (a bad print)."""
    bars = make_bars(n)
    bars.loc[at, ["open", "high", "low", "close"]] *= factor
    return bars


def test_a_1000x_price_spike_is_reported_under_raise_naming_file_row_and_field(tmp_path: Path) -> None:
    path = _write(tmp_path, _spike(), "spike.parquet")
    ts = re.escape(make_bars(200)["timestamp"].iloc[120].isoformat())
    with pytest.raises(BadBarError, match=rf"spike\.parquet: row 120 \(timestamp {ts}, symbol ES\): close jumped from "
                                          r"[0-9.]+ to [0-9.]+ \(log return \+6\.91, [0-9]+ robust standard deviations; "
                                          r"the limit is jump_sigmas=100\); 1 more row\(s\) with price jumps"):
        load_bars(path)
    assert len(load_bars(path, jump_sigmas=None)) == 200  # the check can be turned off


def test_a_price_spike_is_counted_under_drop_and_repair_and_costs_one_bar(tmp_path: Path) -> None:
    bars = make_bars(200)
    path = _write(tmp_path, _spike(), "spike.parquet")
    dropped = load_bars(path, on_bad_bar="drop")
    assert _counts(dropped) == {"price jumps above 100 robust standard deviations": 1}
    assert len(dropped) == 199 and bars["timestamp"].iloc[120] not in set(dropped["timestamp"])
    np.testing.assert_allclose(dropped["close"].to_numpy(), np.delete(bars["close"].to_numpy(), 120))
    repaired = load_bars(path, on_bad_bar="repair")
    assert len(repaired) == 200 and _counts(repaired) == {"price jumps above 100 robust standard deviations": 1}
    assert repaired.loc[120, ["open", "high", "low", "close"]].tolist() == [bars.loc[119, "close"]] * 4
    assert repaired.loc[120, "volume"] == 0.0
    np.testing.assert_allclose(repaired["close"].to_numpy()[121:], bars["close"].to_numpy()[121:])


def test_jump_limit_is_configurable_and_ordinary_moves_pass(tmp_path: Path) -> None:
    path = _write(tmp_path, _spike(factor=1.05), "small.parquet")  # 5%: ~50 robust std of 0.1% moves
    assert len(load_bars(path)) == 200
    with pytest.raises(BadBarError, match="the limit is jump_sigmas=10"):
        load_bars(path, jump_sigmas=10)
    with pytest.raises(ValueError, match="jump_sigmas must be a positive number"):
        load_bars(path, jump_sigmas=-1)


@pytest.mark.parametrize("column, value", [("close", 1e39), ("volume", 1e39), ("low", 1e-39)])
def test_values_outside_float32_range_are_reported_under_raise_and_counted(tmp_path: Path, column: str, value: float) -> None:
    bars = make_bars(30)
    if column == "close":
        bars.loc[11, "high"] = value
    bars.loc[11, column] = value
    path = _write(tmp_path, bars, "f32.parquet")
    with pytest.raises(BadBarError, match=rf"f32\.parquet: row 11 .*: value outside float32's range \(.*{column}={re.escape(repr(value))}"):
        load_bars(path)
    dropped = load_bars(path, on_bad_bar="drop")
    assert len(dropped) == 29 and _counts(dropped) == {"values outside float32's range": 1}
    repaired = load_bars(path, on_bad_bar="repair")
    assert _counts(repaired) == {"values outside float32's range": 1} and repaired.loc[11, "close"] == bars.loc[10, "close"]


def test_symbols_with_different_bar_spacings_are_one_error(tmp_path: Path) -> None:
    from foxhunt.data.bars import DataError

    _write(tmp_path, make_bars(100, symbol="AAA"), "AAA.parquet")
    _write(tmp_path, make_bars(100, symbol="BBB", freq="5min"), "BBB.parquet")
    with pytest.raises(DataError, match=r"symbols have different bar spacings \(AAA 0 days 00:01:00, BBB 0 days 00:05:00\)"):
        load_bars(tmp_path)
    assert load_bars(tmp_path, symbols=["BBB"])["symbol"].unique().tolist() == ["BBB"]


def test_gaps_do_not_change_a_symbol_bar_spacing(tmp_path: Path) -> None:
    """Overnight gaps and missing bars leave the most common gap, the spacing, as it is."""
    a = make_bars(300, symbol="AAA")
    a = a.drop(index=list(range(50, 60)) + [200]).reset_index(drop=True)
    b = make_bars(300, symbol="BBB", start="2024-01-02 14:31")
    _write(tmp_path, a, "AAA.parquet")
    _write(tmp_path, b, "BBB.parquet")
    assert sorted(load_bars(tmp_path)["symbol"].unique()) == ["AAA", "BBB"]


def test_symbols_whose_dates_do_not_overlap_are_one_error_naming_symbol_and_split(tmp_path: Path) -> None:
    """Splits cut all symbols at shared times: symbols with disjoint dates would each land in one split only."""
    from foxhunt.data.bars import DataError
    from foxhunt.data.datamodule import BarDataModule

    _write(tmp_path, make_bars(600, symbol="AAA", start="2024-01-02 14:30"), "AAA.parquet")
    _write(tmp_path, make_bars(600, symbol="BBB", start="2024-03-02 14:30"), "BBB.parquet")
    dm = BarDataModule(path=str(tmp_path), lookback=4, horizon=1, features=["logret_1"], known_future=[], cache_dir=None)
    with pytest.raises(DataError, match=r"data: symbol AAA has no bars in the val split \(its bars: 2024-01-02 14:30 \.\. "
                                        r"2024-01-03 00:29; the val split: 2024-03-02 "):
        dm.setup()
    BarDataModule(path=str(tmp_path), symbols=["BBB"], lookback=4, horizon=1, features=["logret_1"], known_future=[],
                  cache_dir=None).setup()


def test_returns_without_spread_give_no_jump_scale_and_no_false_alarm(tmp_path: Path) -> None:
    """A close growing by the same factor every bar (a deviation of 0) or moving mostly by one tick: no jump is
    invented from a zero scale, while a real spike among one-tick moves is still caught."""
    steady = make_bars(100)
    steady["close"] = 100.0 * 1.001 ** np.arange(100)
    steady["open"] = np.r_[100.0, steady["close"].to_numpy()[:-1]]
    steady["high"] = steady[["open", "close"]].max(axis=1)
    steady["low"] = steady[["open", "close"]].min(axis=1)
    assert len(load_bars(_write(tmp_path, steady, "steady.parquet"))) == 100
    ticks = steady.copy()
    ticks["close"] = 100.0 + 0.25 * (np.arange(100) % 3 == 0)  # mostly +-1 tick, so the median deviation is 0
    ticks.loc[50, "close"] = 1000.0
    ticks["open"] = np.r_[100.0, ticks["close"].to_numpy()[:-1]]
    ticks["high"] = ticks[["open", "close"]].max(axis=1)
    ticks["low"] = ticks[["open", "close"]].min(axis=1)
    with pytest.raises(BadBarError, match=r"ticks\.parquet: row 50 .*close jumped from 100\.0 to 1000\.0"):
        load_bars(_write(tmp_path, ticks, "ticks.parquet"))


# --- bars without a time or a symbol: never kept ---------------------------------------------------------------------
def test_a_missing_timestamp_is_its_own_check_and_the_bar_is_never_kept(tmp_path: Path, caplog) -> None:
    """An empty time cell is not "out of order", and repair cannot sort a bar without a time to the front."""
    path = tmp_path / "nat.csv"
    path.write_text("timestamp,open,high,low,close,volume\n2024-01-02T00:00:00Z,100,101,99,100.5,10\n"
                    ",100.5,102,100,101,11\n2024-01-02T00:02:00Z,101,101.5,100.5,101.2,12\n"
                    "2024-01-02T00:03:00Z,101.2,101.8,100.9,101.5,13\n")
    with pytest.raises(BadBarError) as err:
        load_bars(path)
    assert str(err.value) == (f"{path}: row 1 (timestamp missing, symbol nat): missing timestamp (an empty or undefined "
                              "time; a bar without a time cannot be placed or repaired). Pass on_bad_bar='drop' or "
                              "'repair' to load it anyway.")
    expected = pd.DatetimeIndex(["2024-01-02 00:00", "2024-01-02 00:02", "2024-01-02 00:03"], tz="UTC").as_unit("ns")
    with caplog.at_level("WARNING", logger="foxhunt.data"):
        dropped = load_bars(path, on_bad_bar="drop")
        repaired = load_bars(path, on_bad_bar="repair")
    assert _counts(dropped) == {"missing timestamps": 1}
    assert _counts(repaired) == {"missing timestamps (dropped)": 1}
    assert "repaired 1 bar(s): missing timestamps (dropped)" in caplog.text
    for bars in (dropped, repaired):
        assert pd.DatetimeIndex(bars["timestamp"]).equals(expected)
        assert bars["close"].tolist() == [100.5, 101.2, 101.5]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
@pytest.mark.parametrize("blank", [None, "", "  "])
def test_a_missing_symbol_is_reported_or_dropped_never_given_to_another_symbol(
    tmp_path: Path, suffix: str, blank: str | None
) -> None:
    """A null or blank symbol used to get code -1 and land, silently, in the alphabetically last symbol (ZZZ)."""
    frame = pd.DataFrame({
        "timestamp": pd.to_datetime(["2024-01-02 00:00", "2024-01-02 00:01", "2024-01-02 00:00", "2024-01-02 00:01",
                                     "2024-01-02 00:02"], utc=True).as_unit("ns"),
        "open": [10.0, 10.5, 500.0, 505.0, 10.8], "high": [11.0, 11.0, 510.0, 510.0, 11.0],
        "low": [9.0, 10.0, 490.0, 500.0, 10.5], "close": [10.5, 10.8, 505.0, 507.0, 10.9],
        "volume": [1.0] * 5, "symbol": ["AAA", "AAA", "ZZZ", "ZZZ", blank],
    })
    path = tmp_path / f"nullsym{suffix}"
    if suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)  # the bar schema's own layout: the fast path
    with pytest.raises(BadBarError) as err:
        load_bars(path, jump_sigmas=None)
    assert str(err.value) == (f"{path}: row 4 (timestamp 2024-01-02T00:02:00+00:00, symbol missing): missing symbol (an "
                              "empty or blank symbol; the bar belongs to no instrument). Pass on_bad_bar='drop' or "
                              "'repair' to load it anyway.")
    for policy, kind in (("drop", "missing symbols"), ("repair", "missing symbols (dropped)")):
        bars = load_bars(path, on_bad_bar=policy, jump_sigmas=None)
        assert _counts(bars) == {kind: 1}
        assert bars["symbol"].tolist() == ["AAA", "AAA", "ZZZ", "ZZZ"]
        assert bars["close"].tolist() == [10.5, 10.8, 505.0, 507.0]


# --- the jump check is causal: later bars never change the verdict on an earlier one --------------------------------
def _walk(returns: np.ndarray) -> pd.DataFrame:
    close = 100 * np.exp(np.cumsum(returns))
    open_ = np.r_[100.0, close[:-1]]
    return pd.DataFrame({
        "timestamp": pd.date_range("2024-01-02", periods=len(returns), freq="1min", tz="UTC").as_unit("ns"),
        "open": open_, "high": np.maximum(open_, close) * 1.0001, "low": np.minimum(open_, close) * 0.9999,
        "close": close, "volume": 10.0, "symbol": pd.Series(["X"] * len(returns), dtype="str"),
    })


def test_later_bars_never_change_whether_an_earlier_bar_is_a_jump(tmp_path: Path) -> None:
    """The statistics that judge a bar come from the bars before it only. With whole-file statistics, 3,000 volatile
    bars after a 2% one-bar spike on 0.01% moves (~200 robust standard deviations) hid it: the same bar was a jump in
    the first 1,000 bars and not in the whole file."""
    rng = np.random.default_rng(0)
    early = rng.normal(0, 1e-4, 1000)
    early[500], early[501] = 0.02, -0.02  # a one-bar spike
    early[800] = 0.004  # 40 robust standard deviations: a real move, no jump at the default limit
    later = {
        "none": np.zeros(0),
        "calm": rng.normal(0, 1e-5, 3000),
        "volatile": rng.normal(0, 3e-3, 3000),
        "volatile with a spike": np.r_[rng.normal(0, 3e-3, 1500), 0.5, -0.5, rng.normal(0, 3e-3, 1498)],
    }
    results = {}
    for name, tail in later.items():
        path = _write(tmp_path, _walk(np.r_[early, tail]), f"{name.replace(' ', '_')}.parquet")
        with pytest.raises(BadBarError) as err:
            load_bars(path)
        message = str(err.value).replace(str(path), "<file>")
        results[name] = {
            "raise": re.sub(r"; \d+ more row\(s\) with price jumps", "", message),
            "drop": load_bars(path, on_bad_bar="drop").iloc[:999],
            "repair": load_bars(path, on_bad_bar="repair").iloc[:1000],
        }
    base = results["none"]
    assert base["raise"].startswith("<file>: row 500 (timestamp 2024-01-02T08:20:00+00:00, symbol X): close jumped")
    assert base["repair"]["volume"].iloc[500] == 0.0 and base["repair"]["volume"].iloc[800] == 10.0
    assert _walk(early)["timestamp"].iloc[500] not in set(base["drop"]["timestamp"])  # only the spike's bar is gone
    assert base["drop"]["timestamp"].iloc[500] == _walk(early)["timestamp"].iloc[501]
    for name, got in results.items():
        assert got["raise"] == base["raise"], name
        pd.testing.assert_frame_equal(got["drop"], base["drop"], obj=f"drop, later {name}")
        pd.testing.assert_frame_equal(got["repair"], base["repair"], obj=f"repair, later {name}")


def test_jump_statistics_of_a_bar_use_only_earlier_returns() -> None:
    """The center and scale at every row equal the median and IQR / 1.349 of its symbol's non-zero returns before it,
    as of the latest refresh point (20, 40, 80, ... earlier returns), for two symbols in one frame."""
    from foxhunt.data.bars import _jump_checkpoints, _robust_scale, _segment_first_row

    assert _jump_checkpoints(200).tolist() == [20, 40, 80, 160]
    rng = np.random.default_rng(4)
    sym = np.repeat([0, 1], [300, 120])
    r = rng.standard_t(3, len(sym)) * 1e-3
    r[rng.random(len(r)) < 0.2] = 0.0  # flat bars: not counted
    seg = _segment_first_row(sym)
    r[seg == np.arange(len(r))] = np.nan  # a symbol's first bar has no return
    center, scale = _robust_scale(r, seg)
    for i in range(len(r)):
        before = r[seg[i] : i]
        before = before[np.isfinite(before) & (before != 0)]
        if len(before) < 20:
            assert center[i] == 0.0 and np.isnan(scale[i]), i
            continue
        x = before[: _jump_checkpoints(len(before))[-1]]
        q25, q75 = np.quantile(x, [0.25, 0.75])
        np.testing.assert_allclose([center[i], scale[i]], [np.median(x), (q75 - q25) / 1.349], rtol=1e-12, atol=0)
