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
    files = resolve_paths(path_or_glob)
    frames = []
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
            raw = raw[raw["symbol"].isin(list(symbols))]
            if len(raw) == 0:
                continue
        frames.append(validate_bars(raw, str(path), policy, jump_sigmas))
    if not frames:
        wanted = f" for symbols {list(symbols)}" if symbols is not None else ""
        raise BarLoadError(f"{path_or_glob}: no bars{wanted} in any file")
    bars = finalize_bars(frames)
    _check_cross_file(bars, files, policy)
    check_bar_spacing(bars, ", ".join(map(str, files)) if len(files) < 4 else f"{path_or_glob} ({len(files)} files)")
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
    """Parse timestamps (strings, epoch numbers or datetimes) to UTC at nanosecond resolution."""
    if pd.api.types.is_numeric_dtype(values.dtype) and not pd.api.types.is_bool_dtype(values.dtype):
        v = np.asarray(values, dtype=np.float64)
        finite = v[np.isfinite(v)]
        mag = float(np.nanmedian(np.abs(finite))) if finite.size else 0.0
        unit = "ns" if mag > 1e17 else "us" if mag > 1e14 else "ms" if mag > 1e11 else "s"
        idx = pd.DatetimeIndex(pd.to_datetime(np.asarray(values), unit=unit, utc=True))
    else:
        try:
            idx = pd.DatetimeIndex(pd.to_datetime(values, format="ISO8601" if _looks_iso(values) else None))
        except (ValueError, TypeError) as exc:
            bad = _first_unparseable(values)
            raise BarLoadError(f"{path}: column {column!r}: cannot parse timestamp {bad!r} ({exc})") from exc
        if idx.tz is None:
            idx = idx.tz_localize(tz or "UTC", ambiguous="raise", nonexistent="raise")
        idx = idx.tz_convert("UTC")
    return idx.as_unit("ns")


def _looks_iso(values: pd.Series) -> bool:
    first = values.iloc[0] if len(values) else None
    return isinstance(first, str) and len(first) >= 10 and first[4] == "-" and first[7] == "-"


def _first_unparseable(values: pd.Series) -> str:
    for v in values:
        try:
            pd.Timestamp(v)
        except (ValueError, TypeError):
            return str(v)
    return str(values.iloc[0])


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
        if not pd.api.types.is_numeric_dtype(src.dtype):
            num = pd.to_numeric(src, errors="coerce")
            bad = num.isna() & src.notna() & (src.astype(str).str.strip().str.lower().isin(["nan", "inf", "-inf", ""]) == False)
            if bad.any():
                i = int(np.flatnonzero(bad.to_numpy())[0])
                raise BarLoadError(f"{path}: row {i}: column {mapping[col]!r} value {src.iloc[i]!r} is not a number")
            src = num
        out[col] = src.to_numpy(dtype=np.float64, na_value=np.nan)
    if "symbol" in mapping:
        out["symbol"] = pd.Categorical(raw[mapping["symbol"]].astype(str))
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
    names = table.column_names
    if list(names[:7]) == list(BAR_COLUMNS) and pa.types.is_timestamp(table.schema.field("timestamp").type):
        frame = _fast_parquet(table, tz)
    else:
        frame = _normalise_table(table.to_pandas(), path, tz=tz, symbol=symbol)
    return frame


def _fast_parquet(table: pa.Table, tz: str | None) -> pd.DataFrame:
    ts_type = table.schema.field("timestamp").type
    ts = table.column("timestamp")
    if ts_type.tz is None:
        idx = pd.DatetimeIndex(ts.to_numpy()).tz_localize(tz or "UTC").tz_convert("UTC")
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
