"""The bar schema and its validation: every reader hands its raw table here, so every policy lives in one place.

Schema (one row per bar, rows ordered by symbol then time, RangeIndex):

========== ======================== =====================================================
column     dtype                    meaning
========== ======================== =====================================================
timestamp  datetime64[ns, UTC]      bar open time
open       float64                  first trade price of the bar
high       float64                  highest price
low        float64                  lowest price
close      float64                  last trade price
volume     float64                  traded quantity (float so fractional volumes fit)
symbol     str                      instrument symbol
========== ======================== =====================================================

Validation policies (``on_bad_bar``):

- ``raise`` (default): the first offending row of the first failing check raises :class:`BadBarError`, naming the
  file, the row (its position in the file, 0-based among data rows), its timestamp and symbol, the reason, and how many
  rows of the file share that problem.
- ``drop``: offending rows are removed.
- ``repair``: rows are fixed where a fix is well defined (high/low widened to cover open and close, negative volume set
  to 0, non-finite or non-positive prices forward-filled from the previous good close with volume 0, duplicates keep
  the first bar, out-of-order bars are sorted); rows that cannot be fixed (no previous close, no timestamp, no symbol)
  are dropped.

``drop`` and ``repair`` log one line per problem kind with its count, and record the counts in
``frame.attrs["foxhunt_validation"]``. Missing columns, empty files and unreadable or corrupt files always raise. A bar
without a timestamp (an empty cell, DBN's undefined time) or a symbol (a null or blank cell) is never kept: under
``drop`` and ``repair`` it is dropped and counted.

Two checks catch what breaks models rather than the schema: values outside float32's range (the tensors' dtype: a
price of 1e39 would become inf) are treated like non-finite ones, and a **jump check** flags a bar whose close's log
return from the previous bar lies more than ``jump_sigmas`` robust standard deviations from the median of its
symbol's earlier log returns (the scale: the interquartile range / 1.349 of the earlier non-zero ones; see
:func:`_robust_scale`; ``None`` turns the check off). The statistics are causal: a bar is judged only by the bars
before it, so bars added later never change the verdict on an earlier one. Under ``drop`` the bar that starts a jump
is removed and under ``repair`` it becomes a flat bar at the previous close with volume 0; the next bar is then
compared with the bar before it, so a one-bar spike costs one bar (a lasting level shift, e.g. an unadjusted split,
is left after a few rounds, with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
import pyarrow as pa

from foxhunt.cli_errors import UserError

log = logging.getLogger("foxhunt.data")

BadBarPolicy = Literal["raise", "drop", "repair"]
PRICE_COLUMNS: tuple[str, ...] = ("open", "high", "low", "close")
BAR_COLUMNS: tuple[str, ...] = ("timestamp", *PRICE_COLUMNS, "volume", "symbol")
ROW_COLUMN = "_row"  # position of the bar in its source file; dropped before the frame is returned
DEFAULT_JUMP_SIGMAS = 100.0  # a 1000x spike is thousands of robust std on any bar spacing; real crashes stay below
JUMP_MIN_RETURNS = 20  # a bar with fewer non-zero returns of its symbol before it has no robust scale to judge it by
JUMP_ROUNDS = 5  # drop/repair rounds (each fixes the first bar of every jump left)
_JUMP_SCALE_FLOOR = 1e-9  # returns that do not vary (rounding noise only) must not make every bar a jump
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


class BarLoadError(UserError, ValueError):
    """A file could not be turned into bars at all (unreadable, empty, corrupt, wrong schema, missing columns)."""


class DataError(UserError, ValueError):
    """The bars and the data settings do not make one dataset (mixed bar spacings, disjoint dates, an empty split)."""


class BadBarError(BarLoadError):
    """A bar failed validation under ``on_bad_bar='raise'``."""


@dataclass
class ValidationReport:
    """Counts of the rows each check touched, per file; what ``drop`` and ``repair`` log."""

    source: str
    policy: BadBarPolicy
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int) -> None:
        if n:
            self.counts[kind] = self.counts.get(kind, 0) + int(n)

    def log(self) -> None:
        verb = "dropped" if self.policy == "drop" else "repaired"
        for kind, n in self.counts.items():
            log.warning("%s: %s %d bar(s): %s", self.source, verb, n, kind)


SYM_COLUMN = "_sym"  # integer symbol code while validating; strings are materialised once at the end


def symbol_codes(frame: pd.DataFrame) -> tuple[np.ndarray, pd.Index]:
    """Integer codes and their symbols for the symbol column (cheap for categoricals)."""
    col = frame["symbol"]
    if isinstance(col.dtype, pd.CategoricalDtype):
        return col.cat.codes.to_numpy(dtype=np.int64), pd.Index(col.cat.categories.astype(str))
    codes, uniques = pd.factorize(col, sort=True)
    return codes.astype(np.int64), pd.Index(np.asarray(uniques, dtype=object).astype(str))


def symbols_from_codes(codes: np.ndarray, categories: Sequence[str]) -> pd.Series:
    """A pandas ``str`` column from integer codes, built by an Arrow take instead of a million Python strings."""
    arr = pa.array(list(categories), type=pa.large_string()).take(pa.array(codes))
    return pd.Series(arr.to_pandas(types_mapper={pa.large_string(): pd.StringDtype("pyarrow", na_value=np.nan)}.get))


def timestamps_ns(frame: pd.DataFrame) -> np.ndarray:
    """The timestamp column as int64 nanoseconds since the epoch (UTC)."""
    return pd.DatetimeIndex(frame["timestamp"]).as_unit("ns").asi8


def utc_ns(when: str) -> int:
    """A date or timestamp string as UTC nanoseconds (naive strings are UTC): how cut dates compare with bars."""
    t = pd.Timestamp(when)
    return (t.tz_localize("UTC") if t.tz is None else t).value


def empty_bars() -> pd.DataFrame:
    """A frame of the bar schema with no rows."""
    return pd.DataFrame(
        {
            "timestamp": pd.Series([], dtype="datetime64[ns, UTC]"),
            **{c: pd.Series([], dtype="float64") for c in (*PRICE_COLUMNS, "volume")},
            "symbol": pd.Series([], dtype="str"),
        }
    )


def check_policy(on_bad_bar: str) -> BadBarPolicy:
    if on_bad_bar not in ("raise", "drop", "repair"):
        raise ValueError(f"on_bad_bar must be 'raise', 'drop' or 'repair', got {on_bad_bar!r}")
    return on_bad_bar  # type: ignore[return-value]


def _describe_row(frame: pd.DataFrame, i: int) -> str:
    row = frame.iloc[i]
    ts = row["timestamp"]
    ts_text = "missing" if pd.isna(ts) else ts.isoformat() if isinstance(ts, pd.Timestamp) else str(ts)
    sym = row["symbol"]
    sym_text = "missing" if pd.isna(sym) or not str(sym).strip() else str(sym)
    return f"row {int(row[ROW_COLUMN])} (timestamp {ts_text}, symbol {sym_text})"


def _fail(frame: pd.DataFrame, mask: np.ndarray, source: str, reason_of_row, kind: str) -> None:
    first = int(np.flatnonzero(mask)[0])
    n = int(mask.sum())
    others = f"; {n - 1} more row(s) with {kind}" if n > 1 else ""
    raise BadBarError(
        f"{source}: {_describe_row(frame, first)}: {reason_of_row(first)}{others}. "
        f"Pass on_bad_bar='drop' or 'repair' to load it anyway."
    )


_NAT = np.iinfo(np.int64).min  # NaT as int64 nanoseconds


def _check_missing(
    frame: pd.DataFrame, source: str, policy: BadBarPolicy, report: ValidationReport
) -> tuple[pd.DataFrame, np.ndarray, list[str]]:
    """Bars without a timestamp (an empty cell, DBN's undefined time) or without a symbol (a null or blank cell) cannot
    be placed in any series, so they are never kept: an error under ``raise``, dropped and counted otherwise. Returns
    the frame, its integer symbol codes and their symbols (blank ones removed)."""
    codes, categories = symbol_codes(frame)
    blank = np.array([not str(c).strip() for c in categories], dtype=bool)
    no_symbol = codes < 0
    if blank.any():
        no_symbol |= blank[np.maximum(codes, 0)] & (codes >= 0)
    no_time = timestamps_ns(frame) == _NAT
    checks = (
        (no_time, "missing timestamps", "missing timestamp (an empty or undefined time; a bar without a time cannot be "
                                        "placed or repaired)"),
        (no_symbol, "missing symbols", "missing symbol (an empty or blank symbol; the bar belongs to no instrument)"),
    )
    for mask, kind, reason in checks:
        if mask.any():
            if policy == "raise":
                _fail(frame, mask, source, lambda i, reason=reason: reason, kind)
            report.add(kind if policy == "drop" else f"{kind} (dropped)", int(mask.sum()))
    bad = no_time | no_symbol
    if bad.any():
        frame, codes = frame[~bad], codes[~bad]
    if blank.any():
        new_code = np.cumsum(~blank) - 1
        codes = new_code[codes]
        categories = categories[~blank]
    return frame, codes, list(categories)


def _group_by_symbol(frame: pd.DataFrame, codes: np.ndarray, categories: list[str]) -> pd.DataFrame:
    """Add integer symbol codes and make each symbol's rows contiguous, keeping file order within a symbol."""
    frame = frame.assign(**{SYM_COLUMN: codes})
    frame.attrs["symbols"] = list(categories)
    if len(categories) > 1 and not bool(np.all(codes[1:] >= codes[:-1])):
        frame = frame.iloc[np.argsort(codes, kind="stable")]
    return frame.reset_index(drop=True)


def check_jump_sigmas(jump_sigmas: float | None) -> float | None:
    if jump_sigmas is not None and (isinstance(jump_sigmas, bool) or not np.isfinite(jump_sigmas) or jump_sigmas <= 0):
        raise ValueError(
            f"jump_sigmas must be a positive number of robust standard deviations or None, got {jump_sigmas!r}"
        )
    return None if jump_sigmas is None else float(jump_sigmas)


def validate_bars(
    frame: pd.DataFrame,
    source: str,
    on_bad_bar: BadBarPolicy = "raise",
    jump_sigmas: float | None = DEFAULT_JUMP_SIGMAS,
) -> pd.DataFrame:
    """Apply the bar checks to one file's rows (schema columns plus ``_row``) and return the cleaned frame."""
    policy = check_policy(on_bad_bar)
    jump_sigmas = check_jump_sigmas(jump_sigmas)
    report = ValidationReport(source, policy)
    # 0. Bars without a time or a symbol (never kept: they belong nowhere).
    frame, codes, categories = _check_missing(frame, source, policy, report)
    frame = _group_by_symbol(frame, codes, categories)
    categories = frame.attrs["symbols"]
    prices = frame[list(PRICE_COLUMNS)].to_numpy(dtype=np.float64)
    volume = frame["volume"].to_numpy(dtype=np.float64)

    # 1. Non-finite values, non-positive prices, values float32 cannot hold.
    nonfinite = ~np.isfinite(prices).all(axis=1) | ~np.isfinite(volume)
    nonpositive = ~nonfinite & (prices <= 0).any(axis=1)
    with np.errstate(invalid="ignore"):
        huge_value = (np.abs(prices) > _F32_MAX) | ((prices > 0) & (prices < _F32_TINY))
        outside = ~nonfinite & ~nonpositive & (huge_value.any(axis=1) | (np.abs(volume) > _F32_MAX))
    out_kind = "values outside float32's range"
    for mask, kind in ((nonfinite, "non-finite values"), (nonpositive, "non-positive prices"), (outside, out_kind)):
        if not mask.any():
            continue
        if policy == "raise":
            cols = ["open", "high", "low", "close", "volume"]
            values = np.column_stack([prices, volume])

            def bad_value(c: str, v: float, kind: str) -> bool:
                if kind == "non-finite values":
                    return not np.isfinite(v)
                if kind == out_kind:
                    return abs(v) > _F32_MAX or (c != "volume" and 0 < v < _F32_TINY)
                return c != "volume" and v <= 0

            def reason(i: int, kind=kind, cols=cols, values=values) -> str:
                bad = [c for c, v in zip(cols, values[i]) if bad_value(c, float(v), kind)]
                shown = ", ".join(f"{c}={float(values[i][cols.index(c)])!r}" for c in bad)
                singular = {"non-finite values": "non-finite value", "non-positive prices": "non-positive price",
                            out_kind: "value outside float32's range"}[kind]
                return f"{singular} ({shown})"

            _fail(frame, mask, source, reason, kind)
        report.add(kind, int(mask.sum()))
    bad_price = nonfinite | nonpositive | outside
    if bad_price.any():
        if policy == "drop":
            keep = ~bad_price
            frame, prices, volume = frame[keep].reset_index(drop=True), prices[keep], volume[keep]
        else:
            frame, prices, volume = _forward_fill_bad(frame, prices, volume, bad_price, report)

    # 2. OHLC consistency.
    o, h, lo, c = prices.T
    high_bad = h < np.maximum(o, c)
    low_bad = lo > np.minimum(o, c)
    if high_bad.any() or low_bad.any():
        if policy == "raise":
            if high_bad.any():
                _fail(frame, high_bad, source, lambda i: f"high {float(h[i])!r} is below max(open, close) {float(max(o[i], c[i]))!r}", "high below max(open, close)")
            _fail(frame, low_bad, source, lambda i: f"low {float(lo[i])!r} is above min(open, close) {float(min(o[i], c[i]))!r}", "low above min(open, close)")
        report.add("high below max(open, close)", int(high_bad.sum()))
        report.add("low above min(open, close)", int(low_bad.sum()))
        if policy == "drop":
            keep = ~(high_bad | low_bad)
            frame, prices, volume = frame[keep].reset_index(drop=True), prices[keep], volume[keep]
        else:
            frame = frame.copy()
            frame["high"] = prices.max(axis=1)
            frame["low"] = prices.min(axis=1)

    # 3. Negative volume.
    neg_vol = volume < 0
    if neg_vol.any():
        if policy == "raise":
            _fail(frame, neg_vol, source, lambda i: f"negative volume {float(volume[i])!r}", "negative volume")
        report.add("negative volume", int(neg_vol.sum()))
        if policy == "drop":
            frame = frame[~neg_vol].reset_index(drop=True)
        else:
            frame = frame.copy()
            frame.loc[neg_vol, "volume"] = 0.0

    # 4. Time order and duplicates, per symbol, in file order.
    frame = _check_time(frame, source, policy, report)

    # 5. Jumps of the close (on time-ordered bars).
    if jump_sigmas is not None:
        frame = _check_jumps(frame.reset_index(drop=True), source, policy, report, jump_sigmas)

    if policy != "raise":
        report.log()
    frame = frame.reset_index(drop=True)
    frame.attrs = {"foxhunt_validation": {source: dict(report.counts)} if report.counts else {}, "symbols": categories}
    return frame


def _forward_fill_bad(
    frame: pd.DataFrame, prices: np.ndarray, volume: np.ndarray, bad: np.ndarray, report: ValidationReport
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """Replace a bad bar by a flat bar at the previous good close of its symbol, with zero volume."""
    idx = np.arange(len(frame))
    seg_first = _segment_first_row(frame[SYM_COLUMN].to_numpy())
    prev_good = np.maximum.accumulate(np.where(bad, -1, idx))
    fixable = bad & (prev_good >= seg_first)
    unfixable = bad & ~fixable
    prices = prices.copy()
    volume = volume.copy()
    prices[fixable] = prices[prev_good[fixable], 3][:, None]
    volume[fixable] = 0.0
    frame = frame.copy()
    for j, col in enumerate(PRICE_COLUMNS):
        frame[col] = prices[:, j]
    frame["volume"] = volume
    if unfixable.any():
        report.add("bad bars with no earlier close to forward-fill (dropped)", int(unfixable.sum()))
        keep = ~unfixable
        frame, prices, volume = frame[keep].reset_index(drop=True), prices[keep], volume[keep]
    return frame, prices, volume


def _segment_first_row(symbols: np.ndarray) -> np.ndarray:
    """For rows grouped by symbol, the index of the first row of each row's symbol block."""
    start = np.r_[True, symbols[1:] != symbols[:-1]] if len(symbols) else np.zeros(0, dtype=bool)
    return np.maximum.accumulate(np.where(start, np.arange(len(symbols)), 0))


def _check_time(frame: pd.DataFrame, source: str, policy: BadBarPolicy, report: ValidationReport) -> pd.DataFrame:
    if len(frame) < 2:
        return frame
    ts = timestamps_ns(frame)
    symbols = frame[SYM_COLUMN].to_numpy()
    seg_first = _segment_first_row(symbols)
    run_max = pd.Series(ts).groupby(seg_first, sort=False).cummax().to_numpy()
    prev_max = np.r_[np.iinfo(np.int64).min, run_max[:-1]]
    prev_max[seg_first == np.arange(len(ts))] = np.iinfo(np.int64).min
    dup = ts == prev_max  # same time as the latest bar already seen for this symbol
    ooo = ts < prev_max  # earlier than a bar already seen for this symbol
    if policy == "raise":
        if dup.any():
            _fail(frame, dup, source, lambda i: "duplicate timestamp (an earlier bar of this symbol has the same time)", "duplicate timestamps")
        if ooo.any():
            _fail(frame, ooo, source, lambda i: "timestamp out of order (earlier than a preceding bar of this symbol)", "out-of-order timestamps")
        return frame
    if policy == "drop":
        report.add("duplicate timestamps", int(dup.sum()))
        report.add("out-of-order timestamps", int(ooo.sum()))
        return frame[~(dup | ooo)]
    # repair: sort out-of-order bars into place (stable, so the first of equal times stays first), drop duplicates
    report.add("out-of-order timestamps (sorted)", int(ooo.sum()))
    if ooo.any():
        frame = frame.iloc[np.lexsort((ts, symbols))].reset_index(drop=True)
        ts = timestamps_ns(frame)
        symbols = frame[SYM_COLUMN].to_numpy()
    dup_sorted = np.r_[False, (ts[1:] == ts[:-1]) & (symbols[1:] == symbols[:-1])]
    report.add("duplicate timestamps (kept the first)", int(dup_sorted.sum()))
    return frame[~dup_sorted]


def _jump_checkpoints(n: int) -> np.ndarray:
    """The counts of earlier non-zero returns at which the jump statistics are recomputed, up to ``n``:
    ``JUMP_MIN_RETURNS``, then each time the count has doubled (20, 40, 80, 160, ...)."""
    out = []
    k = JUMP_MIN_RETURNS
    while k <= n:
        out.append(k)
        k *= 2
    return np.asarray(out, dtype=np.int64)


def _robust_scale(r: np.ndarray, seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, a causal center and robust scale of its symbol's non-zero log returns *before* that row.

    The center is the median and the scale the interquartile range / 1.349 (1.4826 x the MAD for a symmetric
    distribution; 1.2533 x the mean absolute deviation from the median where the range is 0; at least
    ``_JUMP_SCALE_FLOOR``) of the first k of those returns, k the largest of :func:`_jump_checkpoints` not above the
    count of non-zero returns before the row (so at least half of them); NaN scale (no check) while fewer than
    ``JUMP_MIN_RETURNS`` precede it. A row's statistics depend only on earlier rows, so later bars never change whether
    an earlier bar is a jump. Rows are grouped by symbol (``seg``: each row's first row of its symbol). Work: one
    partition of k values per checkpoint for all symbols at once, about twice the returns in all (an exact expanding
    median per row, e.g. pandas' expanding quantile, took seconds per million bars)."""
    n = len(r)
    nz = np.isfinite(r)
    nz &= r != 0
    excl = np.cumsum(nz)
    excl -= nz  # non-zero returns before the row, over the whole frame
    firsts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]]) if n else np.zeros(0, dtype=np.int64)
    x = r[nz]  # every symbol's non-zero returns, in row order
    x_start = excl[firsts]
    x_len = np.diff(np.r_[x_start, len(x)])
    checkpoints = _jump_checkpoints(int(x_len.max()) if len(x_len) else 0)
    if not len(checkpoints):
        return np.zeros(n), np.full(n, np.nan)
    n_cp = len(checkpoints)
    med = np.zeros((len(firsts), n_cp + 1))  # column 0: fewer than JUMP_MIN_RETURNS earlier returns, no check
    sd = np.full((len(firsts), n_cp + 1), np.nan)
    for j, k in enumerate(checkpoints.tolist(), start=1):
        sym = np.flatnonzero(x_len >= k)
        if not len(sym):
            break
        starts = x_start[sym].tolist()
        part = np.stack([x[a : a + k] for a in starts]) if len(starts) > 1 else x[None, starts[0] : starts[0] + k].copy()
        h25, h75 = 0.25 * (k - 1), 0.75 * (k - 1)
        i25, i75 = int(h25), int(h75)
        part.partition(sorted({i25, min(i25 + 1, k - 1), (k - 1) // 2, k // 2, i75, min(i75 + 1, k - 1)}), axis=1)
        m = 0.5 * (part[:, (k - 1) // 2] + part[:, k // 2])
        q25 = part[:, i25] + (h25 - i25) * (part[:, min(i25 + 1, k - 1)] - part[:, i25])
        q75 = part[:, i75] + (h75 - i75) * (part[:, min(i75 + 1, k - 1)] - part[:, i75])
        s = (q75 - q25) / 1.349
        flat = ~(s > 0)
        if flat.any():  # more than half the returns alike: the mean absolute deviation from the median
            s[flat] = 1.2533 * np.abs(part[flat] - m[flat, None]).mean(axis=1)
        med[sym, j] = m
        sd[sym, j] = np.maximum(s, _JUMP_SCALE_FLOOR)
    # each row's column: the latest checkpoint not above its count of earlier returns of its symbol
    if len(firsts) == 1:
        at = np.searchsorted(checkpoints, excl, side="right")
        return med[0].take(at), sd[0].take(at)
    counts = np.diff(np.r_[firsts, n])
    excl -= np.repeat(x_start, counts)  # ... within the row's symbol
    at = np.searchsorted(checkpoints, excl, side="right")
    at += np.repeat(np.arange(len(firsts)) * (n_cp + 1), counts)
    return med.ravel().take(at), sd.ravel().take(at)


def _jumps(close: np.ndarray, seg: np.ndarray, keep: np.ndarray, center: np.ndarray, scale: np.ndarray,
           k: float) -> tuple[np.ndarray, np.ndarray]:
    """(rows whose close jumped from the previous kept bar of its symbol, the jump in robust std) among kept rows."""
    rows = np.flatnonzero(keep)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.diff(np.log(close[rows]))
        z = np.abs(r - center[rows[1:]]) / scale[rows[1:]]
    same = seg[rows[1:]] == seg[rows[:-1]]
    jump = same & (z > k)
    return rows[1:][jump], z[jump]


def _check_jumps(
    frame: pd.DataFrame, source: str, policy: BadBarPolicy, report: ValidationReport, k: float
) -> pd.DataFrame:
    if len(frame) < 3:
        return frame
    close = frame["close"].to_numpy(dtype=np.float64).copy()
    seg = _segment_first_row(frame[SYM_COLUMN].to_numpy())
    with np.errstate(divide="ignore", invalid="ignore"):
        r_all = np.r_[np.nan, np.diff(np.log(close))]
    r_all[np.r_[True, seg[1:] != seg[:-1]]] = np.nan
    center, scale = _robust_scale(r_all, seg)
    keep = np.ones(len(frame), dtype=bool)
    rows, z = _jumps(close, seg, keep, center, scale, k)
    if not len(rows):
        return frame
    if policy == "raise":
        mask = np.zeros(len(frame), dtype=bool)
        mask[rows] = True
        zs = dict(zip(rows.tolist(), z.tolist()))

        def reason(i: int) -> str:
            prev = np.flatnonzero(seg[:i] == seg[i])[-1]
            return (f"close jumped from {float(close[prev])!r} to {float(close[i])!r} (log return "
                    f"{float(np.log(close[i] / close[prev])):+.3g}, "
                    f"{zs[i]:.0f} robust standard deviations; the limit is jump_sigmas={k:g})")

        _fail(frame, mask, source, reason, "price jumps")
    flat = np.zeros(len(frame), dtype=bool)
    fixed = 0
    for _ in range(JUMP_ROUNDS):
        if not len(rows):
            break
        kept = np.flatnonzero(keep)  # the first bar of each run of consecutive jumps is fixed
        prev_is_jump = np.isin(kept[np.searchsorted(kept, rows) - 1], rows)
        start = rows[~prev_is_jump] if (~prev_is_jump).any() else rows[:1]
        if policy == "drop":
            keep[start] = False
        else:
            close[start] = close[kept[np.searchsorted(kept, start) - 1]]
            flat[start] = True
        fixed += len(start)
        rows, z = _jumps(close, seg, keep, center, scale, k)
    report.add(f"price jumps above {k:g} robust standard deviations", fixed)
    if len(rows):
        log.warning("%s: %d jump(s) of the close are left after %d rounds of %s: a lasting level shift (an unadjusted "
                    "split?), first at %s", source, len(rows), JUMP_ROUNDS, policy, _describe_row(frame, int(rows[0])))
    if policy == "drop":
        return frame[keep].reset_index(drop=True)
    frame = frame.copy()
    for col in PRICE_COLUMNS:
        frame.loc[flat, col] = close[flat]
    frame.loc[flat, "volume"] = 0.0
    return frame


def finalize_bars(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate validated per-file frames, order rows by symbol then time, and materialise the symbol strings."""
    attrs: dict[str, dict[str, int]] = {}
    categories = sorted({sym for f in frames for sym in f.attrs.get("symbols", [])})
    parts = []
    for f in frames:
        attrs.update(f.attrs.get("foxhunt_validation", {}))
        remap = np.searchsorted(np.asarray(categories, dtype=object), np.asarray(f.attrs["symbols"], dtype=object))
        parts.append(f.drop(columns=["symbol"]).assign(**{SYM_COLUMN: remap[f[SYM_COLUMN].to_numpy()]}))
    frame = parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True)
    ts = timestamps_ns(frame)
    codes = frame[SYM_COLUMN].to_numpy()
    sorted_already = len(frame) < 2 or bool(
        np.all((codes[1:] > codes[:-1]) | ((codes[1:] == codes[:-1]) & (ts[1:] > ts[:-1])))
    )
    if not sorted_already:
        order = np.lexsort((ts, codes))
        frame = frame.iloc[order]
        codes = codes[order]
    out = frame.reset_index(drop=True)
    out["symbol"] = symbols_from_codes(codes, categories)
    out = out[list(BAR_COLUMNS)]
    out.attrs = {"foxhunt_validation": attrs}
    return out
