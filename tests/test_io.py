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
    with pytest.raises(BarLoadError, match=r"badts\.csv: column 'Date': cannot parse timestamp"):
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
