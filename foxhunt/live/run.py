"""``python -m foxhunt.live``: an export trading a replayed file or a live stdin feed, with a decision log, a saved
state (a restart continues exactly), the bar checks of ``load_bars`` and a status line; with ``--challenger``, exports
shadowing it under a promotion rule declared before the stream (:mod:`foxhunt.live.shadow`), a registry of who traded
when (``--registry``, ``--show``) and scheduled retraining (``--retrain-every``, :mod:`foxhunt.live.retrain`)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator

import numpy as np
import torch

from foxhunt.data.bars import DEFAULT_JUMP_SIGMAS
from foxhunt.live.gate import BarGate
from foxhunt.live.replay import BarsAt, replay
from foxhunt.live.session import LiveSession
from foxhunt.live.shadow import ShadowRunner, rows_of
from foxhunt.live.state import META

__all__ = ["main", "parse_args", "rows_of", "run"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m foxhunt.live", description=__doc__)
    p.add_argument("--checkpoint", help="the export directory (foxhunt.fit's export): the champion, whose positions "
                   "are traded")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--replay", help="a DBN/CSV/Parquet bar file replayed as a feed")
    src.add_argument("--source", choices=["stdin"], help="bars on stdin, as they arrive")
    p.add_argument("--format", choices=["csv", "dbn"], default="csv", help="stdin's format (default csv)")
    p.add_argument("--decisions", help="the decision log (a directory of Parquet parts)")
    p.add_argument("--state", help="where the session state is saved and resumed from (default DECISIONS.state)")
    p.add_argument("--warmup", help="a history file replayed first, undecided and unlogged (a cold start is flat)")
    p.add_argument("--log-features", action="store_true", help="log the normalised feature vector the members saw")
    p.add_argument("--on-bad-bar", choices=["raise", "drop", "repair"], default="drop")
    p.add_argument("--jump-sigmas", type=float, default=DEFAULT_JUMP_SIGMAS)
    p.add_argument("--flush-every", type=int, default=100, help="bars between log parts and state saves")
    p.add_argument("--status-every", type=int, default=1000, help="bars between status lines (0: none)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--backend", choices=["torch", "onnxruntime", "onnxruntime-int8"], default="torch",
                   help="what every export's members compute on: torch, or ONNX Runtime on its float or int8 graphs "
                   "(written by python -m foxhunt.export --onnx [--int8]; docs/SERVING.md)")
    p.add_argument("--compile-features", action="store_true",
                   help="step the features of bars past every warm-up through torch.compile (compiled once at the "
                   "start: seconds from inductor's cache, minutes the first time; the same values as eager, ~4x less "
                   "CPU a bar at one symbol; docs/LIVE.md)")
    p.add_argument("--compile-networks", action="store_true",
                   help="decide with the TFT forecasters' inference form compiled by torch.compile for a bar of "
                   "every symbol (torch backend; compiled once at the start, seconds; the same positions, ~3x less "
                   "time in the TFT a bar; docs/LIVE.md)")
    p.add_argument("--debug", action="store_true", help="a traceback instead of one line on errors")
    shadow = p.add_argument_group("champion and challengers (docs/LIVE.md)")
    shadow.add_argument("--challenger", action="append", default=[], metavar="EXPORT",
                        help="an export shadowing the champion on the same bars, logged as if traded (repeatable)")
    shadow.add_argument("--promotion-min-bars", type=int, default=500, help="no verdict before this many paired bars")
    shadow.add_argument("--promotion-alpha", type=float, default=0.05, help="the false-promotion rate (family-wise)")
    shadow.add_argument("--promotion-method", choices=["fixed", "sequential"], default="fixed",
                        help="fixed: one test at the horizon; sequential: always valid, checked every bar")
    shadow.add_argument("--promotion-horizon", type=int, help="fixed: the test's bars (default: min bars); "
                        "sequential: the champion is kept there if undecided")
    shadow.add_argument("--promotion-spending", choices=["none", "families"],
                        help="none: every family of challengers tested at the alpha; families: the j-th family the "
                        "session starts at alpha 6/(pi^2 j^2), alpha over the whole session (default: families with "
                        "--retrain-every, else none)")
    shadow.add_argument("--registry", help="the JSON-lines registry of who traded when (default "
                        "DECISIONS.registry.jsonl); with --show: the one to print")
    shadow.add_argument("--show", action="store_true", help="print --registry as a table and exit")
    shadow.add_argument("--retrain-every", metavar="N|DURATION", help="retrain every N bars or a duration of bar time "
                        "(30d, 12h) in a separate process on the bars seen so far; its export starts as a challenger")
    shadow.add_argument("--retrain-config", help="the config retrained (default: the one the export records)")
    args = p.parse_args(argv)
    if args.show:
        if not args.registry:
            p.error("--show needs --registry FILE")
    elif not (args.checkpoint and args.decisions and (args.replay or args.source)):
        p.error("the following arguments are required: --checkpoint, --decisions and one of --replay, --source")
    return args


def feed(args: argparse.Namespace, session: LiveSession, horizon: int | None = None) -> Iterator[BarsAt]:
    """The bars of ``--replay`` or ``--source stdin``, one timestamp at a time (a replay schedules each bar's next
    ``horizon`` timestamps, default the session's)."""
    if args.replay:
        from foxhunt.data.io import load_bars

        yield from replay(load_bars(args.replay, on_bad_bar="raise"), session.horizon if horizon is None else horizon)
        return
    from foxhunt.live.feeds import csv_bars, dbn_bars, group_by_time

    bars = dbn_bars(sys.stdin.buffer) if args.format == "dbn" else csv_bars(sys.stdin)
    yield from group_by_time(bars, symbols=len(session.symbols))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except Exception as e:  # one line for the user, a traceback with --debug
        if args.debug:
            raise
        print(f"foxhunt.live: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


def build_runner(args: argparse.Namespace) -> ShadowRunner:
    """The champion, its challengers, the promotion rule, the registry and the retraining schedule of the command."""
    from foxhunt.evaluation.promotion import PromotionRule
    from foxhunt.live.registry import Registry
    from foxhunt.live.retrain import Retrainer

    rule = None
    if args.challenger or args.retrain_every:
        rule = PromotionRule(min_bars=args.promotion_min_bars, alpha=args.promotion_alpha,
                             method=args.promotion_method, horizon=args.promotion_horizon,
                             spending=args.promotion_spending or ("families" if args.retrain_every else "none"))
    retrainer = None
    if args.retrain_every:
        from foxhunt.export.load import load

        metadata = None if args.retrain_config else load(args.checkpoint).metadata
        retrainer = Retrainer(args.retrain_every, f"{args.decisions}.retrain", args.retrain_config, metadata,
                              args.warmup)
    gate = BarGate(args.on_bad_bar, args.jump_sigmas, source=args.replay or "stdin")
    return ShadowRunner(args.checkpoint, args.challenger, args.decisions, args.state or f"{args.decisions}.state",
                        gate, rule, Registry(args.registry or f"{args.decisions}.registry.jsonl"), args.log_features,
                        retrainer, compile_features=args.compile_features, compile_networks=args.compile_networks)


def run(args: argparse.Namespace) -> int:
    if args.show:
        from foxhunt.live.registry import show

        show(args.registry)
        return 0
    torch.set_num_threads(args.torch_threads)
    if args.compile_networks and args.backend != "torch":
        raise ValueError(f"--compile-networks compiles torch networks; --backend {args.backend} runs its own graphs")
    runner = build_runner(args)
    if args.backend != "torch":  # the serving backend of every export the run opened (foxhunt.live.backend)
        from foxhunt.live.backend import use_backend

        for model in runner.models:
            use_backend(model.session.loaded, model.path, args.backend)
    warmup = None
    if args.warmup and not (runner.state_dir / META).is_file():
        from foxhunt.data.io import load_bars

        warmup = load_bars(args.warmup, on_bad_bar="raise")
    runner.start(warmup)
    done_until = runner.last_ts
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    latencies: list[float] = []

    def say() -> None:
        for line in [*runner.gate.take_messages(), *runner.messages]:
            print(line, file=sys.stderr)
        runner.messages.clear()

    try:
        for b in feed(args, runner.champion.session, runner.horizon):
            if done_until is not None and b.timestamp <= done_until:
                continue  # decided before the restart (a replay resumes after its saved state)
            d = runner.on_bar(b)
            say()
            if d is not None:
                latencies.append(d.latency_us)
            if runner.bars % args.flush_every == 0:
                runner.save()
            if args.status_every and runner.bars % args.status_every == 0:
                status(runner, latencies)
            if stop["now"]:
                break
    finally:
        runner.close()
        say()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if args.status_every:
        status(runner, latencies)
    return 0


def status(runner: ShadowRunner, latencies: list[float]) -> None:
    """One status line: bars, the champion, its positions, the traded P&L, latency p50/p99, bad bars."""
    from rich.console import Console

    lat = np.asarray(latencies[-10_000:]) if latencies else np.zeros(1)
    others = f" (+{len(runner.challengers)} challengers)" if runner.challengers else ""
    Console(stderr=True, highlight=False).print(
        f"[bold]live[/] bars {runner.bars}  champion {runner.champion.label}{others}  positions "
        f"{runner.traded_book.held.tolist()}  P&L {runner.traded_pnl:+.5f}  latency p50 {np.percentile(lat, 50):.0f} µs "
        f"p99 {np.percentile(lat, 99):.0f} µs  bad bars {dict(runner.gate.counts) or 0}")
