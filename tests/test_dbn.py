"""The DBN reader against the format owner's sample files and reference decoder, and the writer's round trip."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import databento_dbn
import numpy as np
import pandas as pd
import pytest
import zstandard
from conftest import make_bars

from foxhunt.data import BarLoadError, load_bars, read_dbn, write_bars
from foxhunt.data.dbn import OHLCV_DTYPE, read_metadata

DBN_DIR = Path(__file__).resolve().parent / "data" / "dbn"  # the official Databento samples, shipped with the tests
SAMPLES = sorted(DBN_DIR.glob("*.dbn*"))


def reference_frame(path: Path) -> pd.DataFrame:
    databento = pytest.importorskip("databento")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return databento.DBNStore.from_file(path).to_df()


def test_samples_are_present() -> None:
    assert len(SAMPLES) == 16, f"expected the 16 official DBN samples in {DBN_DIR}"


@pytest.mark.parametrize("path", SAMPLES, ids=[p.name for p in SAMPLES])
def test_sample_matches_reference_decoder(path: Path) -> None:
    ours = read_dbn(path)
    ref = reference_frame(path)
    assert len(ours) == len(ref)
    if len(ref) == 0:
        return
    ref_ts = pd.DatetimeIndex(ref.index).as_unit("ns").asi8
    assert np.array_equal(pd.DatetimeIndex(ours["timestamp"]).asi8, ref_ts)
    for col in ("open", "high", "low", "close"):
        np.testing.assert_array_equal(ours[col].to_numpy(), ref[col].to_numpy(dtype=np.float64))
    np.testing.assert_array_equal(ours["volume"].to_numpy(), ref["volume"].to_numpy(dtype=np.float64))
    assert list(ours["symbol"].astype(str)) == list(ref["symbol"].astype(str))


def test_sample_versions_and_first_price() -> None:
    versions = {p.name: p.read_bytes() for p in SAMPLES}
    v1 = DBN_DIR / "test_data.ohlcv-1m.v1.dbn.zst"
    raw = zstandard.ZstdDecompressor().stream_reader(v1.open("rb"), read_across_frames=True).read()
    assert raw[:4] == b"DBN\x01"
    assert versions  # all read
    bars = load_bars(DBN_DIR / "test_data.ohlcv-1m.dbn")
    assert bars["open"].iloc[0] == 372025.0
    assert bars["timestamp"].iloc[0] == pd.Timestamp("2020-12-28 13:00", tz="UTC")
    assert bars["timestamp"].dtype == "datetime64[ns, UTC]"
    assert list(bars.columns) == ["timestamp", "open", "high", "low", "close", "volume", "symbol"]
    assert set(bars["symbol"]) == {"ESH1"}
    assert str(read_metadata(DBN_DIR / "test_data.ohlcv-1h.v3.dbn.zst").schema) == "ohlcv-1h"


def test_empty_sample_is_refused_by_load_bars() -> None:
    path = DBN_DIR / "test_data.ohlcv-1d.dbn"
    assert len(read_dbn(path)) == 0
    with pytest.raises(BarLoadError, match=r"test_data\.ohlcv-1d\.dbn: empty file: it holds no bars"):
        load_bars(path)


def test_record_layout_matches_reference_encoder() -> None:
    msg = databento_dbn.OHLCVMsg(0x21, 7, 42, 1_700_000_000_000_000_000, 101_250_000_000, 102_000_000_000, 100_500_000_000, 101_000_000_000, 1234)
    rec = np.zeros(1, dtype=OHLCV_DTYPE)
    rec[0] = (14, 0x21, 7, 42, 1_700_000_000_000_000_000, 101_250_000_000, 102_000_000_000, 100_500_000_000, 101_000_000_000, 1234)
    assert bytes(msg)[: OHLCV_DTYPE.itemsize] == rec.tobytes()


@pytest.mark.parametrize("suffix", [".dbn", ".dbn.zst"])
def test_round_trip_multi_symbol(tmp_path: Path, suffix: str) -> None:
    bars = pd.concat([make_bars(40, "ESZ4", seed=1), make_bars(30, "NQZ4", seed=2)], ignore_index=True)
    path = write_bars(bars, tmp_path / f"bars{suffix}")
    back = load_bars(path)
    assert back["symbol"].tolist() == bars["symbol"].tolist()
    assert (back["timestamp"] == bars["timestamp"]).all()
    for col in ("open", "high", "low", "close"):
        np.testing.assert_allclose(back[col], bars[col], rtol=0, atol=1e-9)  # fixed-point 1e-9
    np.testing.assert_array_equal(back["volume"], bars["volume"])
    # the format owner's decoder reads what we wrote, symbols included
    ref = reference_frame(path)
    assert sorted(set(ref["symbol"])) == ["ESZ4", "NQZ4"]
    assert len(ref) == 70
    meta = read_metadata(path)
    assert str(meta.schema) == "ohlcv-1m" and sorted(meta.symbols) == ["ESZ4", "NQZ4"]


def _trades_file(path: Path) -> Path:
    meta = databento_dbn.Metadata(
        dataset="GLBX.MDP3", start=0, stype_in=databento_dbn.SType.RAW_SYMBOL,
        stype_out=databento_dbn.SType.INSTRUMENT_ID, schema=databento_dbn.Schema.TRADES, symbols=["ES"],
        partial=[], not_found=[], mappings=[],
    )
    path.write_bytes(bytes(meta))
    return path


def test_other_schema_is_refused(tmp_path: Path) -> None:
    path = _trades_file(tmp_path / "trades.dbn")
    with pytest.raises(BarLoadError, match=r"trades\.dbn: DBN schema 'trades' is not bars"):
        load_bars(path)


def test_truncated_file_raises_without_partial_frame(tmp_path: Path) -> None:
    good = write_bars(make_bars(20), tmp_path / "good.dbn")
    cut = tmp_path / "cut.dbn"
    cut.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(BarLoadError, match=r"cut\.dbn: truncated DBN file: 46 trailing byte\(s\) after record 18"):
        load_bars(cut)
    header_only = tmp_path / "header.dbn"
    header_only.write_bytes(good.read_bytes()[:20])
    with pytest.raises(BarLoadError, match=r"header\.dbn: truncated DBN metadata"):
        load_bars(header_only)


def test_truncated_zstd_raises(tmp_path: Path) -> None:
    good = write_bars(make_bars(200), tmp_path / "good.dbn.zst")
    cut = tmp_path / "cut.dbn.zst"
    cut.write_bytes(good.read_bytes()[:-25])
    with pytest.raises(BarLoadError, match=r"cut\.dbn\.zst: (corrupt or truncated zstd stream|truncated DBN)"):
        load_bars(cut)


def test_corrupt_record_raises(tmp_path: Path) -> None:
    good = write_bars(make_bars(5), tmp_path / "good.dbn").read_bytes()
    (meta_len,) = struct.unpack_from("<I", good, 4)
    body_start = 8 + meta_len
    bad = bytearray(good)
    bad[body_start + 2 * 56] = 9  # length byte of record 2
    path = tmp_path / "corrupt.dbn"
    path.write_bytes(bytes(bad))
    with pytest.raises(BarLoadError, match=r"corrupt\.dbn: corrupt DBN record 2 at byte 112"):
        load_bars(path)
    bad = bytearray(good)
    bad[body_start + 56 + 1] = 0xA0  # rtype of record 1: an MBO record type
    path.write_bytes(bytes(bad))
    with pytest.raises(BarLoadError, match=r"DBN record 1 has rtype 0xa0, not an OHLCV bar"):
        load_bars(path)


def test_not_dbn_and_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.dbn"
    path.write_bytes(b"hello world, not a DBN file")
    with pytest.raises(BarLoadError, match=r"junk\.dbn: not a DBN file \(bad magic"):
        load_bars(path)
    empty = tmp_path / "empty.dbn"
    empty.write_bytes(b"")
    with pytest.raises(BarLoadError, match=r"empty\.dbn: empty file"):
        load_bars(empty)


def test_undefined_ts_event_is_a_missing_timestamp_never_sorted_to_the_front(tmp_path: Path) -> None:
    """DBN's undefined time (u64::MAX, -1 as int64) read as 1969-12-31T23:59:59.999999999: "out of order", and
    repair sorted that bar to the front. It is a missing timestamp: reported, or dropped and counted."""
    path = write_bars(make_bars(10), tmp_path / "undef_ts.dbn")
    raw = bytearray(path.read_bytes())
    body = len(raw) - 10 * OHLCV_DTYPE.itemsize
    rec = np.frombuffer(raw, dtype=OHLCV_DTYPE, offset=body).copy()
    rec["ts_event"][5] = np.iinfo(np.uint64).max
    rec["ts_event"][7] = np.uint64(np.iinfo(np.int64).max)  # no bar time either (2262)
    raw[body:] = rec.tobytes()
    path.write_bytes(bytes(raw))
    assert read_dbn(path)["timestamp"].isna().tolist() == [False] * 5 + [True, False, True, False, False]
    with pytest.raises(BarLoadError) as err:
        load_bars(path)
    assert str(err.value) == (f"{path}: row 5 (timestamp missing, symbol ES): missing timestamp (an empty or undefined "
                              "time; a bar without a time cannot be placed or repaired); 1 more row(s) with missing "
                              "timestamps. Pass on_bad_bar='drop' or 'repair' to load it anyway.")
    expected = make_bars(10).drop(index=[5, 7]).reset_index(drop=True)
    for policy, kind in (("drop", "missing timestamps"), ("repair", "missing timestamps (dropped)")):
        bars = load_bars(path, on_bad_bar=policy)
        assert bars.attrs["foxhunt_validation"] == {str(path): {kind: 2}}
        assert (bars["timestamp"] == expected["timestamp"]).all()
        np.testing.assert_allclose(bars["close"].to_numpy(), expected["close"].to_numpy(), rtol=0, atol=1e-9)
