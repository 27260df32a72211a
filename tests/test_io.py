"""CSV and Parquet readers, globs and directories, round trips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import make_bars

from foxhunt.data import BarLoadError, load_bars, write_bars


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".dbn", ".dbn.zst"])
def test_round_trip(tmp_path: Path, suffix: str) -> None:
    bars = pd.concat([make_bars(30, "A", seed=1), make_bars(20, "B", seed=2)], ignore_index=True)
    back = load_bars(write_bars(bars, tmp_path / f"bars{suffix}"))
    assert list(back.columns) == list(bars.columns)
    assert back["timestamp"].dtype == "datetime64[ns, UTC]"
    assert (back["timestamp"] == bars["timestamp"]).all()
    assert back["symbol"].tolist() == bars["symbol"].tolist()
    atol = 1e-9 if "dbn" in suffix else 0.0
    for col in ("open", "high", "low", "close", "volume"):
        np.testing.assert_allclose(back[col].to_numpy(), bars[col].to_numpy(), rtol=0, atol=atol)


def test_round_trip_keeps_nanoseconds(tmp_path: Path) -> None:
    bars = make_bars(5)
    bars["timestamp"] = bars["timestamp"] + pd.to_timedelta(np.arange(5) + 1, unit="ns")
    for suffix in (".csv", ".parquet", ".dbn"):
        back = load_bars(write_bars(bars, tmp_path / f"ns{suffix}"))
        assert (back["timestamp"] == bars["timestamp"]).all(), suffix


def test_csv_aliases_daily_yahoo_style(tmp_path: Path) -> None:
    path = tmp_path / "SPY.csv"
    path.write_text(
        "Date,Open,High,Low,Close,Adj Close,Volume\n"
        "2024-01-02,472.16,473.67,470.49,472.65,468.79,123623700\n"
        "2024-01-03,470.43,471.19,468.17,468.79,464.96,103585900\n"
    )
    bars = load_bars(path)
    assert bars["symbol"].tolist() == ["SPY", "SPY"]  # from the file name
    assert bars["close"].tolist() == [472.65, 468.79]  # the real close wins over Adj Close
    assert bars["timestamp"].iloc[0] == pd.Timestamp("2024-01-02", tz="UTC")


def test_csv_aliases_lowercase_short_names_and_adj_close_only(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("datetime,o,h,l,adj_close,vol,Ticker\n2024-01-02 14:30:00,1,2,0.5,1.5,10,ABC\n")
    bars = load_bars(path)
    assert bars.iloc[0][["open", "high", "low", "close", "volume"]].tolist() == [1, 2, 0.5, 1.5, 10]
    assert bars["symbol"].iloc[0] == "ABC"


def test_csv_naive_timestamps_in_configured_timezone(tmp_path: Path) -> None:
    path = tmp_path / "ny.csv"
    path.write_text("Time,Open,High,Low,Close,Volume\n2024-07-01 09:30:00,1,1,1,1,1\n")
    utc = load_bars(path)
    ny = load_bars(path, tz="America/New_York")
    assert utc["timestamp"].iloc[0] == pd.Timestamp("2024-07-01 09:30", tz="UTC")
    assert ny["timestamp"].iloc[0] == pd.Timestamp("2024-07-01 13:30", tz="UTC")


def test_csv_aware_timestamps_and_separate_date_time(tmp_path: Path) -> None:
    aware = tmp_path / "aware.csv"
    aware.write_text("timestamp,open,high,low,close,volume\n2024-07-01T09:30:00-04:00,1,1,1,1,1\n")
    assert load_bars(aware)["timestamp"].iloc[0] == pd.Timestamp("2024-07-01 13:30", tz="UTC")
    split = tmp_path / "split.csv"
    split.write_text("Date,Time,Open,High,Low,Close,Vol\n2024-07-01,09:31,1,1,1,1,1\n2024-07-01,09:32,1,1,1,1,2\n")
    bars = load_bars(split)
    assert bars["timestamp"].iloc[1] == pd.Timestamp("2024-07-01 09:32", tz="UTC")


def test_csv_epoch_timestamps(tmp_path: Path) -> None:
    path = tmp_path / "epoch.csv"
    path.write_text("ts_event,open,high,low,close,volume\n1704205800000000000,1,1,1,1,1\n1704205860000000000,1,1,1,1,1\n")
    assert load_bars(path)["timestamp"].iloc[1] == pd.Timestamp("2024-01-02 14:31", tz="UTC")
    ms = tmp_path / "ms.csv"
    ms.write_text("time,open,high,low,close,volume\n1704205800000,1,1,1,1,1\n")
    assert load_bars(ms)["timestamp"].iloc[0] == pd.Timestamp("2024-01-02 14:30", tz="UTC")


def test_csv_non_numeric_value_names_row_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("Date,Open,High,Low,Close,Volume\n2024-01-02,1,1,1,1,1\n2024-01-03,1,abc,1,1,1\n")
    with pytest.raises(BarLoadError, match=r"bad\.csv: row 1: column 'High' value 'abc' is not a number"):
        load_bars(path)


def test_csv_unparseable_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "badts.csv"
    path.write_text("Date,Open,High,Low,Close,Volume\n2024-01-02,1,1,1,1,1\nnot-a-date,1,1,1,1,1\n")
    with pytest.raises(BarLoadError, match=r"badts\.csv: row 1: column 'Date': cannot parse timestamp 'not-a-date' "
                                           r"\(Time data not-a-date is not ISO8601 format\)$"):
        load_bars(path)


def test_parquet_with_aliases_and_naive_time(tmp_path: Path) -> None:
    bars = make_bars(10)
    other = bars.rename(columns={"timestamp": "Datetime", "volume": "Vol", "close": "Close"})
    other["Datetime"] = other["Datetime"].dt.tz_localize(None)
    path = tmp_path / "alias.parquet"
    other.to_parquet(path)
    back = load_bars(path)
    assert (back["timestamp"] == bars["timestamp"]).all()
    assert np.array_equal(back["close"], bars["close"])


def test_directory_and_glob_concatenate_per_symbol_in_time_order(tmp_path: Path) -> None:
    full = make_bars(60, "ES", seed=3)
    write_bars(full.iloc[30:], tmp_path / "es_2.parquet")  # later file, earlier name order irrelevant
    write_bars(full.iloc[:30], tmp_path / "es_1.csv")
    write_bars(make_bars(10, "AA", seed=4), tmp_path / "aa.dbn")
    for source in (tmp_path, str(tmp_path / "*")):
        bars = load_bars(source)
        assert bars["symbol"].tolist() == ["AA"] * 10 + ["ES"] * 60
        es = bars[bars["symbol"] == "ES"]
        assert es["timestamp"].is_monotonic_increasing
        np.testing.assert_array_equal(es["close"].to_numpy(), full["close"].to_numpy())
    assert load_bars(tmp_path, symbols=["AA"])["symbol"].unique().tolist() == ["AA"]


def test_overlapping_files_raise(tmp_path: Path) -> None:
    full = make_bars(20)
    write_bars(full.iloc[:12], tmp_path / "a.csv")
    write_bars(full.iloc[10:], tmp_path / "b.csv")
    with pytest.raises(BarLoadError, match=r"files overlap: 2 bar\(s\) appear in more than one file"):
        load_bars(tmp_path)


def test_missing_required_columns(tmp_path: Path) -> None:
    path = tmp_path / "nocol.csv"
    path.write_text("Date,Open,High,Close\n2024-01-02,1,1,1\n")
    with pytest.raises(BarLoadError, match=r"nocol\.csv: missing required column\(s\) low, volume; found columns \['Date', 'Open', 'High', 'Close'\]"):
        load_bars(path)


def test_empty_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(BarLoadError, match=r"empty\.csv: empty file"):
        load_bars(empty)
    header_only = tmp_path / "header.csv"
    header_only.write_text("Date,Open,High,Low,Close,Volume\n")
    with pytest.raises(BarLoadError, match=r"header\.csv: empty file: it holds no bars"):
        load_bars(header_only)
    empty_pq = tmp_path / "e.parquet"
    empty_pq.write_bytes(b"")
    with pytest.raises(BarLoadError, match=r"e\.parquet: empty file"):
        load_bars(empty_pq)


def test_empty_file_in_a_directory_is_skipped_and_logged_under_drop(tmp_path: Path, caplog) -> None:
    write_bars(make_bars(5), tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text("Date,Open,High,Low,Close,Volume\n")
    with pytest.raises(BarLoadError, match=r"b\.csv: empty file"):
        load_bars(tmp_path)
    with caplog.at_level("WARNING", logger="foxhunt.data"):
        assert len(load_bars(tmp_path, on_bad_bar="drop")) == 5
    assert "b.csv: skipped an empty file" in caplog.text


def test_unreadable_paths(tmp_path: Path) -> None:
    with pytest.raises(BarLoadError, match=r"missing\.csv: no such file or directory"):
        load_bars(tmp_path / "missing.csv")
    with pytest.raises(BarLoadError, match=r"glob matched no files"):
        load_bars(str(tmp_path / "*.parquet"))
    odd = tmp_path / "bars.xlsx"
    odd.write_bytes(b"PK\x03\x04")
    with pytest.raises(BarLoadError, match=r"bars\.xlsx: unknown bar file type"):
        load_bars(odd)
    locked = tmp_path / "locked.csv"
    locked.write_text("Date,Open,High,Low,Close,Volume\n2024-01-02,1,1,1,1,1\n")
    locked.chmod(0)
    import os

    if os.geteuid() != 0:  # root reads anything
        with pytest.raises(BarLoadError, match=r"locked\.csv: cannot read file"):
            load_bars(locked)
    directory_as_file = tmp_path / "dir.parquet"
    directory_as_file.mkdir()
    with pytest.raises(BarLoadError, match=r"dir\.parquet: directory holds no bar files"):
        load_bars(directory_as_file)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all")
    with pytest.raises(BarLoadError, match=r"garbage\.parquet: cannot read Parquet"):
        load_bars(garbage)


# --- one line for every bad input: file, row, column, reason ---------------------------------------------------------
def _bar_frame(n: int = 4) -> pd.DataFrame:
    return make_bars(n, "X")[["timestamp", "open", "high", "low", "close", "volume", "symbol"]]


def test_boolean_price_or_volume_columns_are_refused(tmp_path: Path) -> None:
    """true/false passed pandas' is_numeric_dtype and became volumes of 1.0 and 0.0."""
    csv = tmp_path / "boolvol.csv"
    csv.write_text("timestamp,open,high,low,close,volume\n2024-01-02T00:00:00Z,100,101,99,100.5,true\n"
                   "2024-01-02T00:01:00Z,100.5,102,100,101,false\n")
    with pytest.raises(BarLoadError) as err:
        load_bars(csv)
    assert str(err.value) == f"{csv}: column 'volume' holds true/false values, not numbers: it cannot be the bars' volume"
    frame = _bar_frame()
    frame["close"] = [True, False, True, True]
    pq_path = tmp_path / "boolclose.parquet"
    frame.to_parquet(pq_path)
    with pytest.raises(BarLoadError) as err:
        load_bars(pq_path)
    assert str(err.value) == f"{pq_path}: column 'close' holds true/false values, not numbers: it cannot be the bars' close"


def test_parquet_text_prices_name_file_row_and_column(tmp_path: Path) -> None:
    """The bar schema's layout with a text price column was cast by numpy: a bare ValueError without file or row."""
    frame = _bar_frame()
    frame["close"] = ["100.5", "oops", "101.2", "101.5"]
    path = tmp_path / "textclose.parquet"
    frame.to_parquet(path)
    with pytest.raises(BarLoadError) as err:
        load_bars(path)
    assert str(err.value) == f"{path}: row 1: column 'close' value 'oops' is not a number"
    frame["close"] = ["100.5", "101", "101.2", "101.5"]  # numbers as text read as they do from a CSV
    frame["high"] = 102.0
    frame.to_parquet(path)
    assert load_bars(path)["close"].tolist() == [100.5, 101.0, 101.2, 101.5]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_local_times_a_clock_change_skips_or_repeats_name_the_row(tmp_path: Path, suffix: str) -> None:
    times = {"skipped": (["2024-03-10 01:59:00", "2024-03-10 02:30:00"], "does not exist there (the clocks skip it "
                                                                          "when daylight saving starts)"),
             "repeated": (["2024-11-03 00:59:00", "2024-11-03 01:30:00"], "is ambiguous there (it happens twice when "
                                                                          "daylight saving ends)")}
    for name, (stamps, why) in times.items():
        frame = make_bars(2, "X")
        frame["timestamp"] = pd.DatetimeIndex(stamps).as_unit("ns")
        path = tmp_path / f"{name}{suffix}"
        frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
        with pytest.raises(BarLoadError) as err:
            load_bars(path, tz="America/New_York")
        assert str(err.value) == (f"{path}: row 1: column 'timestamp': local time {stamps[1]} in "
                                  f"tz='America/New_York' {why}; give times with a UTC offset, or in UTC")
        assert len(load_bars(path)) == 2  # as UTC they are fine


def test_timestamps_with_and_without_offsets_in_one_column_name_the_row(tmp_path: Path) -> None:
    """Was "cannot parse timestamp '2024-01-02T00:00:00Z'", a valid value, with pandas' advice to pass utc=True."""
    path = tmp_path / "mixed.csv"
    path.write_text("timestamp,open,high,low,close,volume\n2024-01-02T00:00:00Z,100,101,99,100.5,10\n"
                    "2024-01-02T01:01:00+01:00,100.5,102,100,101,11\n2024-01-02 00:02:00,101,101.5,100.5,101.2,12\n")
    with pytest.raises(BarLoadError) as err:
        load_bars(path)
    assert str(err.value) == (f"{path}: row 2: column 'timestamp': timestamp '2024-01-02 00:02:00' has no UTC offset "
                              "while row 0 ('2024-01-02T00:00:00Z') has one; give every timestamp an offset, or none "
                              "(naive times are read in tz=, UTC by default)")


@pytest.mark.parametrize("name", ["offsets.csv", "offsets.csv.gz"])  # pyarrow's reader, pandas' reader
def test_timestamps_with_different_offsets_are_converted_to_utc(tmp_path: Path, name: str) -> None:
    text = ("timestamp,open,high,low,close,volume\n2024-01-02T00:00:00+00:00,100,101,99,100.5,10\n"
            "2024-01-02T01:01:00+01:00,100.5,102,100,101,11\n2024-01-01T19:02:00-05:00,101,101.5,100.5,101.2,12\n")
    path = tmp_path / name
    if name.endswith(".gz"):
        import gzip

        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    expected = pd.DatetimeIndex(["2024-01-02 00:00", "2024-01-02 00:01", "2024-01-02 00:02"], tz="UTC").as_unit("ns")
    assert pd.DatetimeIndex(load_bars(path)["timestamp"]).equals(expected)


def test_unparseable_and_out_of_range_timestamps_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "month13.csv"
    bad.write_text("timestamp,open,high,low,close,volume\n2024-01-02T00:00:00Z,100,101,99,100.5,10\n"
                   "2024-13-45T00:01:00Z,100.5,102,100,101,11\n")
    with pytest.raises(BarLoadError) as err:
        load_bars(bad)
    assert str(err.value) == (f"{bad}: row 1: column 'timestamp': cannot parse timestamp '2024-13-45T00:01:00Z' (Time "
                              "data 2024-13-45T00:01:00Z is not ISO8601 format)")
    epoch = tmp_path / "epoch.csv"
    epoch.write_text("time,open,high,low,close,volume\n1704205800,1,1,1,1,1\n1704205860,1,1,1,1,1\n"
                     "1704205920,1,1,1,1,1\n1e12,1,1,1,1,1\n")
    with pytest.raises(BarLoadError) as err:
        load_bars(epoch)
    assert str(err.value) == (f"{epoch}: row 3: column 'time': epoch time 1000000000000.0 is out of range (read in s "
                              "like the column's typical value 1704205890, it lies outside the years 1677-2262)")


def test_requested_symbols_that_are_not_in_the_data_are_an_error(tmp_path: Path) -> None:
    """They were silently ignored: symbols=['AA', 'ESX'] loaded AA alone."""
    from foxhunt.data.bars import DataError

    path = write_bars(pd.concat([make_bars(10, "AA"), make_bars(10, "ES")], ignore_index=True), tmp_path / "two.parquet")
    with pytest.raises(DataError) as err:
        load_bars(path, symbols=["AA", "ESX", "ZZ"])
    assert str(err.value) == f"{path}: requested symbol(s) ESX, ZZ not in the data; it holds AA, ES"
    assert load_bars(path, symbols=["ES"])["symbol"].unique().tolist() == ["ES"]
    assert load_bars(path, symbols="ES")["symbol"].unique().tolist() == ["ES"]  # one name, not its letters
