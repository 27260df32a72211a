"""``python -m foxhunt.live``: an export trading a replayed file or a live stdin feed, with a decision log, a saved
state (a restart continues exactly), the bar checks of ``load_bars`` and a status line."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from foxhunt.data.bars import DEFAULT_JUMP_SIGMAS
from foxhunt.live.gate import BarGate
from foxhunt.live.log import DecisionLog
from foxhunt.live.replay import BarsAt, replay
from foxhunt.live.session import Decision, LiveSession
from foxhunt.live.state import META
from foxhunt.trading.pnl import cost_log_returns, position_log_returns


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m foxhunt.live", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="the export directory (foxhunt.fit's export)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--replay", help="a DBN/CSV/Parquet bar file replayed as a feed")
    src.add_argument("--source", choices=["stdin"], help="bars on stdin, as they arrive")
    p.add_argument("--format", choices=["csv", "dbn"], default="csv", help="stdin's format (default csv)")
    p.add_argument("--decisions", required=True, help="the decision log (a directory of Parquet parts)")
    p.add_argument("--state", help="where the session state is saved and resumed from (default DECISIONS.state)")
    p.add_argument("--warmup", help="a history file replayed first, undecided and unlogged (a cold start is flat)")
    p.add_argument("--log-features", action="store_true", help="log the normalised feature vector the members saw")
    p.add_argument("--on-bad-bar", choices=["raise", "drop", "repair"], default="drop")
    p.add_argument("--jump-sigmas", type=float, default=DEFAULT_JUMP_SIGMAS)
    p.add_argument("--flush-every", type=int, default=100, help="bars between log parts and state saves")
    p.add_argument("--status-every", type=int, default=1000, help="bars between status lines (0: none)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--debug", action="store_true", help="a traceback instead of one line on errors")
    return p.parse_args(argv)


class Account:
    """The ensemble's running after-cost log return per symbol, the exact P&L of foxhunt.trading.pnl."""

    def __init__(self, n: int, cost_bps: float) -> None:
        self.position = torch.zeros(n, dtype=torch.float64)
        self.close = torch.full((n,), float("nan"), dtype=torch.float64)
        self.pnl = torch.zeros(n, dtype=torch.float64)
        self.cost_bps = cost_bps

    def book(self, codes: torch.Tensor, close: torch.Tensor, position: torch.Tensor) -> None:
        r = torch.log(close / self.close[codes])
        gross = position_log_returns(self.position[codes], torch.expm1(torch.nan_to_num(r, nan=0.0)))
        cost = cost_log_returns((position.double() - self.position[codes]).abs(), self.cost_bps)
        self.pnl[codes] += gross + cost
        self.close[codes], self.position[codes] = close, position.double()


def feed(args: argparse.Namespace, session: LiveSession) -> Iterator[BarsAt]:
    """The bars of ``--replay`` or ``--source stdin``, one timestamp at a time."""
    if args.replay:
        from foxhunt.data.io import load_bars

        yield from replay(load_bars(args.replay, on_bad_bar="raise"), session.horizon)
        return
    from foxhunt.live.feeds import csv_bars, dbn_bars, group_by_time

    bars = dbn_bars(sys.stdin.buffer) if args.format == "dbn" else csv_bars(sys.stdin)
    yield from group_by_time(bars, symbols=len(session.symbols))


def rows_of(d: Decision, latency_us: float, session: LiveSession, features: bool) -> list[dict]:
    """The decision log's rows of one decision."""
    out = []
    for i, name in enumerate(d.symbols):
        row = {"ts_event": d.timestamp, "symbol": name}
        row.update(dict(zip(("open", "high", "low", "close", "volume"), d.bars[i].tolist(), strict=True)))
        row.update({k: float(v[i]) for k, v in d.positions.items()})
        row.update({"ready": bool(d.ready[i]), "latency_us": float(latency_us)})
        if features:
            c = session.symbols.index(name)
            row.update({f"feature.{f}": float(x) for f, x in zip(session.feature_names, session.rows[c, -1].tolist(),
                                                                   strict=True)})
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except Exception as e:  # one line for the user, a traceback with --debug
        if args.debug:
            raise
        print(f"foxhunt.live: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    from foxhunt.live.session import open as open_session

    torch.set_num_threads(args.torch_threads)
    session = open_session(args.checkpoint)
    state_dir = Path(args.state or f"{args.decisions}.state")
    info = session.restore(state_dir) if (state_dir / META).is_file() else {}
    if not info and args.warmup:
        from foxhunt.data.io import load_bars

        for b in replay(load_bars(args.warmup, on_bad_bar="raise"), session.horizon):
            session.on_bar(b.symbols, b.ohlcv, b.timestamp, b.next_timestamps)
    log = DecisionLog(args.decisions, parts=int(info.get("parts", 0)))
    done_until = info.get("last_timestamp")
    gate = BarGate(args.on_bad_bar, args.jump_sigmas, source=args.replay or "stdin")
    gate.counts.update(info.get("bad_bars", {}))
    account = Account(len(session.symbols), float(session.model.hparams.cost_bps))
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    bars, latencies, last_ts = int(info.get("bars", 0)), [], done_until

    def save() -> None:
        parts = log.flush()
        session.save(state_dir, parts=parts, last_timestamp=last_ts, bars=bars, bad_bars=dict(gate.counts))

    try:
        for b in feed(args, session):
            if done_until is not None and b.timestamp <= done_until:
                continue  # decided before the restart (a replay resumes after its saved state)
            start = time.perf_counter_ns()
            names, ohlcv, kept = gate.admit(b.symbols, b.ohlcv, b.timestamp, {s: session.history(s) for s in b.symbols})
            for line in gate.take_messages():
                print(line, file=sys.stderr)
            if names:
                ahead = b.next_timestamps[kept] if b.next_timestamps.shape[1] else None
                d = session.on_bar(names, ohlcv, b.timestamp, ahead)
                latency = (time.perf_counter_ns() - start) / 1e3
                latencies.append(latency)
                log.append(rows_of(d, latency, session, args.log_features))
                account.book(session.codes(names), ohlcv[:, 3], d.positions["ensemble"])
            bars += 1
            last_ts = b.timestamp
            if bars % args.flush_every == 0:
                save()
            if args.status_every and bars % args.status_every == 0:
                status(bars, account, latencies, gate)
            if stop["now"]:
                break
    finally:
        save()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if args.status_every:
        status(bars, account, latencies, gate)
    return 0


def status(bars: int, account: Account, latencies: list[float], gate: BarGate) -> None:
    """One status line: bars, ensemble positions, P&L, latency p50/p99, bad bars."""
    from rich.console import Console

    lat = np.asarray(latencies[-10_000:]) if latencies else np.zeros(1)
    Console(stderr=True, highlight=False).print(
        f"[bold]live[/] bars {bars}  positions {account.position.tolist()}  P&L {float(account.pnl.sum()):+.5f}  "
        f"latency p50 {np.percentile(lat, 50):.0f} µs p99 {np.percentile(lat, 99):.0f} µs  "
        f"bad bars {dict(gate.counts) or 0}")
