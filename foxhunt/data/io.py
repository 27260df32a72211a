"""One entry point for bars on disk: ``load_bars`` picks the reader from the file and applies the validation policy."""

from __future__ import annotations

import glob as globlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from foxhunt.data.bars import (
    BAR_COLUMNS,
    DEFAULT_JUMP_SIGMAS,
    PRICE_COLUMNS,
    ROW_COLUMN,
    BadBarPolicy,
    BarLoadError,
    DataError,
    check_jump_sigmas,
    check_policy,
    finalize_bars,
    log,
    symbol_codes,
    timestamps_ns,
    validate_bars,
)
from foxhunt.data.dbn import is_dbn_path, read_dbn, write_dbn

# Column aliases, compared after lower-casing and stripping spaces, underscores and dashes.
ALIASES: dict[str, tuple[str, ...]] = {
    "timestamp": ("timestamp", "ts", "tsevent", "datetime", "date", "time", "datetimeutc", "timeutc", "dt", "opentime"),
    "open": ("open", "o", "openprice", "firstprice"),
    "high": ("high", "h", "highprice", "max"),
    "low": ("low", "l", "lowprice", "min"),
    "close": ("close", "c", "closeprice", "last", "lastprice", "price", "adjclose", "adjustedclose"),
    "volume": ("volume", "vol", "v", "qty", "quantity", "size", "totalvolume"),
    "symbol": ("symbol", "ticker", "instrument", "sym", "rawsymbol", "code"),
}
SUFFIXES = {".csv": "csv", ".txt": "csv", ".parquet": "parquet", ".pq": "parquet"}


def _key(name: str) -> str:
    return "".join(ch for ch in str(name).lower() if ch.isalnum())


def resolve_paths(path_or_glob: str | Path | Sequence[str | Path]) -> list[Path]:
    """Expand a file, a directory (its bar files) or a glob into a sorted list of files; nothing found raises."""
    if isinstance(path_or_glob, (list, tuple)):
        return [p for item in path_or_glob for p in resolve_paths(item)]
    text = str(path_or_glob)
    path = Path(text).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and reader_kind(p, strict=False) is not None)
        if not files:
            raise BarLoadError(f"{path}: directory holds no bar files (.dbn, .dbn.zst, .csv, .parquet)")
        return files
    if any(ch in text for ch in "*?["):
        files = sorted(Path(p) for p in globlib.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise BarLoadError(f"{text}: glob matched no files")
        return files
    if not path.exists():
        raise BarLoadError(f"{path}: no such file or directory")
    return [path]


def reader_kind(path: Path, strict: bool = True) -> str | None:
    """'dbn', 'csv' or 'parquet', from the name, then from the leading bytes."""
    if is_dbn_path(path):
        return "dbn"
    name = path.name.lower()
    for suffix, kind in SUFFIXES.items():
        if name.endswith((suffix, suffix + ".gz")):
            return kind
    if strict:
        try:
            head = path.open("rb").read(4)
        except OSError as exc:
            raise BarLoadError(f"{path}: cannot read file: {exc.strerror or exc}") from exc
        if head[:3] == b"DBN" or head == b"\x28\xb5\x2f\xfd":
            return "dbn"
        if head == b"PAR1":
            return "parquet"
        raise BarLoadError(f"{path}: unknown bar file type (expected .dbn, .dbn.zst, .csv or .parquet)")
    return None


def load_bars(
    path_or_glob: str | Path | Sequence[str | Path],
    *,
    on_bad_bar: BadBarPolicy = "raise",
    tz: str | None = None,
    symbol: str | None = None,
    symbols: Sequence[str] | None = None,
    jump_sigmas: float | None = DEFAULT_JUMP_SIGMAS,
) -> pd.DataFrame:
    """Load, validate and concatenate bars from DBN, CSV or Parquet files into the bar schema.

    ``tz`` is the timezone of timezone-naive timestamps in CSV/Parquet files (default UTC); ``symbol`` names the
    instrument of files without a symbol column (default: the file's stem); ``symbols`` keeps only those symbols;
    ``jump_sigmas`` is the jump check's limit (:mod:`foxhunt.data.bars`; None: off). Symbols of different bar
    spacings cannot make one dataset: that raises :class:`DataError`.
    """
    policy = check_policy(on_bad_bar)
    jump_sigmas = check_jump_sigmas(jump_sigmas)
    if isinstance(symbols, str):
        symbols = [symbols]
    files = resolve_paths(path_or_glob)
    source = ", ".join(map(str, files)) if len(files) < 4 else f"{path_or_glob} ({len(files)} files)"
    frames = []
    found: set[str] = set()  # every symbol in the files, to name requested ones that are not there
    for path in files:
        kind = reader_kind(path)
        if kind == "dbn":
            raw = read_dbn(path)
        elif kind == "csv":
            raw = read_csv_bars(path, tz=tz, symbol=symbol)
        else:
            raw = read_parquet_bars(path, tz=tz, symbol=symbol)
        if len(raw) == 0:
            if policy == "raise" or len(files) == 1:
                raise BarLoadError(f"{path}: empty file: it holds no bars")
            log.warning("%s: skipped an empty file (no bars)", path)
            continue
        if symbols is not None:
            found.update(str(v) for v in pd.unique(raw["symbol"].dropna()))
            raw = raw[raw["symbol"].isin(list(symbols))]
            if len(raw) == 0:
                continue
        frames.append(validate_bars(raw, str(path), policy, jump_sigmas))
    if symbols is not None:
        missing = [s for s in dict.fromkeys(symbols) if s not in found]
        if missing:
            held = sorted(found)
            shown = ", ".join(held[:20]) + (f", ... ({len(held)} in all)" if len(held) > 20 else "")
            raise DataError(f"{source}: requested symbol(s) {', '.join(map(str, missing))} not in the data; it holds "
                            f"{shown or 'no symbols'}")
    if not frames:
        wanted = f" for symbols {list(symbols)}" if symbols is not None else ""
        raise BarLoadError(f"{path_or_glob}: no bars{wanted} in any file")
    bars = finalize_bars(frames)
    _check_cross_file(bars, files, policy)
    check_bar_spacing(bars, source)
    return bars


def bar_spacings(bars: pd.DataFrame) -> dict[str, int]:
    """Each symbol's bar spacing in nanoseconds: the most common gap between its consecutive bars (symbols with one
    bar have none). The mode, not the mean: overnight and weekend gaps do not move it."""
    ts = timestamps_ns(bars)
    codes, categories = symbol_codes(bars)
    same = codes[1:] == codes[:-1]
    gaps = pd.DataFrame({"sym": codes[1:][same], "gap": np.diff(ts)[same]})
    if gaps.empty:
        return {}
    counts = gaps.value_counts().reset_index(name="n").sort_values(["sym", "n", "gap"], ascending=[True, False, True])
    first = counts.drop_duplicates("sym")
    return {str(categories[int(s)]): int(g) for s, g in zip(first["sym"], first["gap"], strict=True)}


def check_bar_spacing(bars: pd.DataFrame, source: str) -> None:
    """Symbols of one dataset must share one bar spacing (a model's lookback and horizon count bars)."""
    spacings = bar_spacings(bars)
    if len(set(spacings.values())) <= 1:
        return
    shown = ", ".join(f"{sym} {pd.Timedelta(ns)}" for sym, ns in sorted(spacings.items()))
    raise DataError(
        f"{source}: symbols have different bar spacings ({shown}); one dataset needs one spacing: resample them to "
        "one, or load one spacing at a time (data.symbols)"
    )


def _check_cross_file(bars: pd.DataFrame, files: list[Path], policy: BadBarPolicy) -> None:
    if len(files) < 2 or len(bars) < 2:
        return
    ts = timestamps_ns(bars)
    sym, _ = symbol_codes(bars)
    dup = np.r_[False, (ts[1:] == ts[:-1]) & (sym[1:] == sym[:-1])]
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise BarLoadError(
            f"{', '.join(map(str, files))}: files overlap: {int(dup.sum())} bar(s) appear in more than one file, "
            f"first {bars['symbol'].iloc[i]} at {bars['timestamp'].iloc[i].isoformat()}"
        )


# --- CSV -----------------------------------------------------------------------------------------------------------


def _map_columns(columns: Sequence[str], path: Path) -> dict[str, str]:
    """Source column for each schema column, by alias; missing required columns raise, naming what was found."""
    by_key: dict[str, str] = {}
    for c in columns:
        by_key.setdefault(_key(c), c)
    mapping: dict[str, str] = {}
    for target, aliases in ALIASES.items():
        for alias in aliases:
            if alias in by_key and by_key[alias] not in mapping.values():
                mapping[target] = by_key[alias]
                break
    # A real close wins over an adjusted one: adjusted closes are inconsistent with unadjusted open/high/low.
    missing = [c for c in ("timestamp", *PRICE_COLUMNS, "volume") if c not in mapping]
    if missing:
        raise BarLoadError(
            f"{path}: missing required column(s) {', '.join(missing)}; found columns {list(columns)} "
            f"(accepted names: " + "; ".join(f"{m}: {'/'.join(ALIASES[m][:4])}..." for m in missing) + ")"
        )
    return mapping


def _to_utc_ns(values: pd.Series | pd.Index, tz: str | None, path: Path, column: str) -> pd.DatetimeIndex:
    """Parse timestamps (strings, epoch numbers or datetimes) to UTC at nanosecond resolution. Empty cells become NaT
    (validation reports them as missing timestamps); anything else that is not a time raises one line naming the file,
    the column, the first bad row and why."""
    values = pd.Series(values).reset_index(drop=True)
    if pd.api.types.is_numeric_dtype(values.dtype) and not pd.api.types.is_bool_dtype(values.dtype):
        return _epoch_to_utc_ns(values, path, column)
    if isinstance(values.dtype, pd.DatetimeTZDtype):
        idx = pd.DatetimeIndex(values)
    else:
        idx = _parse_times(values, path, column)
    if idx.tz is None:
        idx = _localize(idx, tz, path, column)
    return idx.tz_convert("UTC").as_unit("ns")


_EPOCH_UNITS = (("ns", 1), ("us", 1_000), ("ms", 1_000_000), ("s", 1_000_000_000))


def _epoch_to_utc_ns(values: pd.Series, path: Path, column: str) -> pd.DatetimeIndex:
    """Epoch numbers, in s/ms/us/ns by the magnitude of their median."""
    v = np.asarray(values, dtype=np.float64)
    finite = v[np.isfinite(v)]
    mag = float(np.nanmedian(np.abs(finite))) if finite.size else 0.0
    unit = "ns" if mag > 1e17 else "us" if mag > 1e14 else "ms" if mag > 1e11 else "s"
    per_ns = dict(_EPOCH_UNITS)[unit]
    with np.errstate(invalid="ignore"):
        outside = np.isfinite(v) & (np.abs(v) * per_ns >= 2.0**63)
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise BarLoadError(f"{path}: row {i}: column {column!r}: epoch time {float(v[i])!r} is out of range (read "
                           f"in {unit} like the column's typical value {mag:.0f}, it lies outside the years 1677-2262)")
    return pd.DatetimeIndex(pd.to_datetime(np.asarray(values), unit=unit, utc=True)).as_unit("ns")


# a time of day followed by a UTC offset (Z, UTC, +hh, +hhmm, +hh:mm) at the end of the text
_OFFSET = r"(?i)\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?\s*(?:Z|UTC|GMT|[+-]\d{2}(?::?\d{2})?)$"


def _parse_times(values: pd.Series, path: Path, column: str) -> pd.DatetimeIndex:
    """Timestamps from text (or Python datetimes). Values with different UTC offsets are converted to UTC; a value that
    is no time, or a column mixing values with and without an offset, raises one line naming the first such row."""
    fmt = "ISO8601" if _looks_iso(values) else None
    try:
        return pd.DatetimeIndex(pd.to_datetime(values, format=fmt))
    except (ValueError, TypeError, OverflowError) as exc:
        error = exc
    present = values.notna().to_numpy() & (values.astype(str).str.strip() != "").to_numpy()
    coerced = pd.DatetimeIndex(pd.to_datetime(values, format=fmt, errors="coerce", utc=True))
    bad = np.flatnonzero(present & coerced.isna())
    if len(bad):
        i = int(bad[0])
        raise BarLoadError(f"{path}: row {i}: column {column!r}: cannot parse timestamp {_show(values.iloc[i])} "
                           f"({_parse_reason(values, i, fmt)})") from error
    aware = _has_offset(values)
    if aware is not None and aware[present].any():
        if aware[present].all():  # every value carries an offset: each is one instant, converted to UTC
            return coerced
        first = int(np.flatnonzero(present)[0])  # with and without an offset: the naive ones' zone is unknown
        i = int(np.flatnonzero(present & (aware != aware[first]))[0])
        has, other = ("has", "has none") if aware[i] else ("has no", "has one")
        raise BarLoadError(
            f"{path}: row {i}: column {column!r}: timestamp {_show(values.iloc[i])} {has} UTC offset while row {first} "
            f"({_show(values.iloc[first])}) {other}; give every timestamp an offset, or none (naive times are read in tz=, "
            "UTC by default)"
        ) from error
    i = int(np.flatnonzero(present)[0]) if present.any() else 0
    raise BarLoadError(f"{path}: column {column!r}: cannot parse its timestamps, first {_show(values.iloc[i])} "
                       f"({_first_sentence(error)})") from error


def _parse_reason(values: pd.Series, i: int, fmt: str | None) -> str:
    """Why value ``i`` is no time: pandas' reason for it alone, or that it does not share the first value's format."""
    try:
        pd.to_datetime(values.iloc[i : i + 1], format=fmt)
    except (ValueError, TypeError, OverflowError) as exc:
        return _first_sentence(exc)
    first = values.loc[values.first_valid_index()]
    return f"not in the format of the column's first value {_show(first)}"


def _show(value: object) -> str:
    """A cell as an error shows it: repr of the Python value (True, not np.True_)."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _has_offset(values: pd.Series) -> np.ndarray | None:
    """Per value: does it carry a UTC offset (text ending in Z or +hh:mm; an aware datetime)? None: cannot tell."""
    if pd.api.types.is_string_dtype(values.dtype) or values.dtype == object:
        text = values.where(values.notna(), "")
        if all(isinstance(v, str) for v in text.iloc[:1000]):
            return text.astype(str).str.strip().str.contains(_OFFSET, regex=True).to_numpy(dtype=bool)
        return np.array([getattr(v, "tzinfo", None) is not None for v in text], dtype=bool)
    return None


def _first_sentence(error: BaseException) -> str:
    """pandas' reason without its multi-line advice ("You might want to try: ...")."""
    text = " ".join(str(error).split("You might want to try")[0].split()).rstrip(" .:,")
    return text or type(error).__name__


def _localize(idx: pd.DatetimeIndex, tz: str | None, path: Path, column: str) -> pd.DatetimeIndex:
    """Naive times as local times of ``tz`` (UTC when None). A local time that a daylight-saving change skips or
    repeats has no single UTC instant: one line names the first such row."""
    zone = tz or "UTC"
    try:
        return idx.tz_localize(zone, ambiguous="raise", nonexistent="raise")
    except Exception as exc:  # pandas' ValueError for a skipped or repeated time; the zone library's for a bad name
        try:
            probe = idx.tz_localize(zone, ambiguous="NaT", nonexistent="NaT")
        except Exception:  # not a zone at all
            raise BarLoadError(f"{path}: column {column!r}: tz={tz!r} is not a time zone ({_first_sentence(exc)})") from exc
        bad = np.flatnonzero(probe.isna() & ~idx.isna())
        if not len(bad):
            raise BarLoadError(f"{path}: column {column!r}: cannot place its times in {zone} ({_first_sentence(exc)})") from exc
        i = int(bad[0])
        skipped = not idx[i : i + 1].tz_localize(zone, ambiguous="NaT", nonexistent="shift_forward").isna()[0]
        why = ("does not exist there (the clocks skip it when daylight saving starts)" if skipped else
               "is ambiguous there (it happens twice when daylight saving ends)")
        raise BarLoadError(
            f"{path}: row {i}: column {column!r}: local time {idx[i]} in tz={zone!r} {why}; give times with a UTC "
            "offset, or in UTC"
        ) from exc


def _looks_iso(values: pd.Series) -> bool:
    at = values.first_valid_index()
    first = None if at is None else values.loc[at]
    return isinstance(first, str) and len(first) >= 10 and first[4] == "-" and first[7] == "-"


def read_csv_bars(path: str | Path, *, tz: str | None = None, symbol: str | None = None) -> pd.DataFrame:
    """Read a CSV of bars with case-insensitive, aliased column names; unvalidated."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise BarLoadError(f"{path}: empty file (no header, no bars)")
        raw = pd.read_csv(path, engine="pyarrow") if not path.name.endswith(".gz") else pd.read_csv(path)
    except BarLoadError:
        raise
    except OSError as exc:
        raise BarLoadError(f"{path}: cannot read file: {exc.strerror or exc}") from exc
    except Exception as exc:  # parser errors from pyarrow or pandas
        raise BarLoadError(f"{path}: not a readable CSV: {exc}") from exc
    return _normalise_table(raw, path, tz=tz, symbol=symbol)


def _normalise_table(raw: pd.DataFrame, path: Path, *, tz: str | None, symbol: str | None) -> pd.DataFrame:
    cols = list(raw.columns)
    keys = {_key(c): c for c in cols}
    # separate date and time columns (e.g. "Date","Time") are joined into one timestamp
    if "date" in keys and "time" in keys and not any(k in keys for k in ("timestamp", "datetime", "ts", "tsevent")):
        combined = raw[keys["date"]].astype(str) + " " + raw[keys["time"]].astype(str)
        raw = raw.drop(columns=[keys["date"], keys["time"]]).assign(timestamp=combined)
        cols = list(raw.columns)
    mapping = _map_columns(cols, path)
    if "close" in mapping and _key(mapping["close"]) in ("adjclose", "adjustedclose") and "close" in keys:
        mapping["close"] = keys["close"]
    out = pd.DataFrame({"timestamp": _to_utc_ns(raw[mapping["timestamp"]], tz, path, mapping["timestamp"])})
    for col in (*PRICE_COLUMNS, "volume"):
        src = raw[mapping[col]]
        if pd.api.types.is_bool_dtype(src.dtype) or (
            src.dtype == object and pd.api.types.infer_dtype(src, skipna=True) == "boolean"
        ):
            raise BarLoadError(f"{path}: column {mapping[col]!r} holds true/false values, not numbers: it cannot be the "
                               f"bars' {col}")
        if not pd.api.types.is_numeric_dtype(src.dtype):
            num = pd.to_numeric(src, errors="coerce")
            bad = num.isna() & src.notna() & (src.astype(str).str.strip().str.lower().isin(["nan", "inf", "-inf", ""]) == False)
            if bad.any():
                i = int(np.flatnonzero(bad.to_numpy())[0])
                raise BarLoadError(f"{path}: row {i}: column {mapping[col]!r} value {src.iloc[i]!r} is not a number")
            src = num
        out[col] = src.to_numpy(dtype=np.float64, na_value=np.nan)
    if "symbol" in mapping:  # null cells stay null (validation drops or reports them), not the text "nan"
        sym = raw[mapping["symbol"]]
        out["symbol"] = pd.Categorical(sym.astype(str).where(sym.notna().to_numpy()))
    else:
        name = symbol or path.name.split(".")[0]
        out["symbol"] = pd.Categorical.from_codes(np.zeros(len(out), dtype=np.int8), categories=[name])
    out[ROW_COLUMN] = np.arange(len(out), dtype=np.int64)
    return out


# --- Parquet -------------------------------------------------------------------------------------------------------


def read_parquet_bars(path: str | Path, *, tz: str | None = None, symbol: str | None = None) -> pd.DataFrame:
    """Read a Parquet file of bars (the schema above, or aliased names); unvalidated."""
    path = Path(path)
    if path.is_file() and path.stat().st_size == 0:
        raise BarLoadError(f"{path}: empty file (not a Parquet file)")
    try:
        table = pq.read_table(path)
    except OSError as exc:
        if path.exists() and path.stat().st_size == 0:
            raise BarLoadError(f"{path}: empty file (not a Parquet file)") from exc
        raise BarLoadError(f"{path}: cannot read Parquet: {exc}") from exc
    except pa.ArrowException as exc:
        raise BarLoadError(f"{path}: cannot read Parquet: {exc}") from exc
    if _is_bar_schema(table):
        frame = _fast_parquet(table, tz, path)
    else:  # aliased names or other types (text prices, ...): the checks of the CSV reader
        frame = _normalise_table(table.to_pandas(), path, tz=tz, symbol=symbol)
    return frame


def _is_bar_schema(table: pa.Table) -> bool:
    """The bar schema itself: a timestamp column, integer or float prices and volume, a text symbol column."""
    schema = table.schema
    if list(schema.names[:7]) != list(BAR_COLUMNS) or not pa.types.is_timestamp(schema.field("timestamp").type):
        return False
    numeric = all(pa.types.is_integer(schema.field(c).type) or pa.types.is_floating(schema.field(c).type)
                  for c in (*PRICE_COLUMNS, "volume"))
    sym = schema.field("symbol").type
    sym = sym.value_type if pa.types.is_dictionary(sym) else sym
    is_view = getattr(pa.types, "is_string_view", lambda t: False)  # pyarrow >= 16
    return numeric and (pa.types.is_string(sym) or pa.types.is_large_string(sym) or is_view(sym))


def _fast_parquet(table: pa.Table, tz: str | None, path: Path) -> pd.DataFrame:
    ts_type = table.schema.field("timestamp").type
    ts = table.column("timestamp")
    if ts_type.tz is None:
        idx = _localize(pd.DatetimeIndex(ts.to_numpy()), tz, path, "timestamp").tz_convert("UTC")
    else:
        idx = pd.DatetimeIndex(ts.to_pandas()).tz_convert("UTC")
    out = {"timestamp": idx.as_unit("ns")}
    for col in (*PRICE_COLUMNS, "volume"):
        out[col] = table.column(col).to_numpy().astype(np.float64, copy=False)
    sym = table.column("symbol")
    out["symbol"] = (sym if pa.types.is_dictionary(sym.type) else sym.dictionary_encode()).to_pandas()
    frame = pd.DataFrame(out)
    frame[ROW_COLUMN] = np.arange(len(frame), dtype=np.int64)
    return frame


# --- writing -------------------------------------------------------------------------------------------------------


def write_bars(bars: pd.DataFrame, path: str | Path, **kwargs) -> Path:
    """Write bars by extension: .dbn / .dbn.zst (DBN), .csv (ISO-8601 UTC timestamps), .parquet."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = reader_kind(path, strict=False)
    bars = bars[list(BAR_COLUMNS)]
    if kind == "dbn":
        return write_dbn(bars, path, **kwargs)
    if kind == "csv":
        out = bars.copy()
        # whole seconds as compact ISO-8601 with Z; sub-second stamps keep all nine digits
        out["timestamp"] = out["timestamp"].astype(str) if _has_subsecond(bars) else out["timestamp"].dt.strftime("%Y-%m-%dT%H:%M:%SZ")
        out.to_csv(path, index=False, float_format="%.17g")
        return path
    if kind == "parquet":
        out = bars.copy()
        out["symbol"] = out["symbol"].astype(str)
        table = pa.Table.from_pandas(out, preserve_index=False)
        pq.write_table(table, path, compression=kwargs.get("compression", "zstd"))
        return path
    raise ValueError(f"{path}: unknown bar file type (use .dbn, .dbn.zst, .csv or .parquet)")


def _has_subsecond(bars: pd.DataFrame) -> bool:
    ts = timestamps_ns(bars)
    return bool(np.any(ts % 1_000_000_000))
