"""Live sources of bars: CSV lines or a DBN byte stream on stdin (as piped from a recorder or Databento's live
client), decoded incrementally, grouped into the bars of one timestamp as they arrive."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator
from typing import BinaryIO, TextIO

import numpy as np
import pandas as pd
import torch

from foxhunt.data.bars import BarLoadError
from foxhunt.live.replay import BarsAt

CSV_COLUMNS = ("timestamp", "symbol", "open", "high", "low", "close", "volume")


def group_by_time(bars: Iterable[tuple[int, str, list[float]]], symbols: int | None = None) -> Iterator[BarsAt]:
    """Consecutive bars of one timestamp as one :class:`BarsAt`, yielded when a later timestamp arrives or, with
    ``symbols``, as soon as that many symbols have a bar (a feed of one symbol decides at once)."""
    now: int | None = None
    names: list[str] = []
    rows: list[list[float]] = []

    def flush() -> BarsAt:
        return BarsAt(int(now), list(names), torch.tensor(rows, dtype=torch.float64).reshape(-1, 5),
                      torch.zeros(len(names), 0, dtype=torch.int64))

    for ts, name, values in bars:
        if now is not None and ts != now and names:
            yield flush()
            names, rows = [], []
        now = ts
        names.append(name)
        rows.append(values)
        if symbols is not None and len(names) >= symbols:
            yield flush()
            names, rows = [], []
    if names:
        yield flush()


def csv_bars(lines: TextIO, source: str = "stdin") -> Iterator[tuple[int, str, list[float]]]:
    """Bars from CSV lines with a header naming timestamp, symbol, open, high, low, close, volume (any order)."""
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None:
        return
    cols = [c.strip().lower() for c in header]
    missing = [c for c in CSV_COLUMNS if c not in cols]
    if missing:
        raise BarLoadError(f"{source}: CSV header {header} lacks {missing} (needs {', '.join(CSV_COLUMNS)})")
    at = {c: cols.index(c) for c in CSV_COLUMNS}
    for n, row in enumerate(reader, start=2):
        if not row:
            continue
        try:
            ts = pd.Timestamp(row[at["timestamp"]])
            ts = ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")
            values = [float(row[at[c]]) for c in ("open", "high", "low", "close", "volume")]
        except (ValueError, IndexError) as e:
            raise BarLoadError(f"{source}: line {n}: not a bar ({e}): {','.join(row)[:120]}") from None
        yield int(ts.value), row[at["symbol"]].strip(), values


def dbn_bars(stream: BinaryIO, source: str = "stdin", chunk: int = 1 << 16) -> Iterator[tuple[int, str, list[float]]]:
    """OHLCV bars from a DBN byte stream, decoded as bytes arrive (databento-dbn's ``DBNDecoder``)."""
    import databento_dbn

    from foxhunt.data.dbn import FIXED_PRICE_SCALE, UNDEF_PRICE, instrument_symbols

    decoder = databento_dbn.DBNDecoder()
    meta = None
    names: dict[int, str] = {}  # instrument id -> symbol, from symbol mapping records
    while True:
        data = stream.read1(chunk) if hasattr(stream, "read1") else stream.read(chunk)
        if not data:
            break
        decoder.write(data)
        for rec in decoder.decode():
            if isinstance(rec, databento_dbn.Metadata):
                meta = rec
            elif isinstance(rec, databento_dbn.SymbolMappingMsg):
                names[int(rec.instrument_id)] = str(rec.stype_out_symbol)
            elif isinstance(rec, databento_dbn.OHLCVMsg):
                iid, ts = int(rec.instrument_id), int(rec.ts_event)
                name = names.get(iid)
                if name is None:
                    name = str(instrument_symbols(meta, np.array([iid]), np.array([ts]))[0]) if meta else str(iid)
                px = [np.nan if int(v) == UNDEF_PRICE else int(v) * FIXED_PRICE_SCALE
                      for v in (rec.open, rec.high, rec.low, rec.close)]
                yield ts, name, [*px, float(rec.volume)]
    if decoder.buffer():
        raise BarLoadError(f"{source}: the DBN stream ended inside a record ({len(decoder.buffer())} bytes left)")
