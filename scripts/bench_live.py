"""Live latency (issue 44 section 6): bar in to decision out, 1 thread, p50/p99/p99.9 of interleaved repeats, each
section's peers timed beside ours in the same run, and the issue's goals marked met or not.

(a) the streaming features (all registered ones; eager and FeatureStream(compile=True)) at 1, 100 and 1,000 symbols
    a timestamp, after short and long histories, against TA-Lib 0.8's O(1) stream handles (``talib.stream.X(history)`` opens one, ``.update(bar)`` steps
    it) and talipp's incremental indicators (``.add``) on the indicators they have;
(b) ``LiveSession.on_bar`` of one-member exports (ensemble.yaml's TFT, Mamba-2, DQN, PPO), of the quickstart ensemble
    and of ensemble.yaml's four members, and each member's network forward on one decision;
(c) Stable-Baselines3 ``model.predict(obs, deterministic=True)`` on an MLP policy of the agents' layer sizes against
    the agent network's own forward at batch 1;
(d) the naive way: ``LoadedEnsemble.positions`` over a trailing window of 512 bars, recomputed at every bar;
(e) ``--serve`` alone (issue 48): each member's network on one decision at 1 and 1,000 symbols in torch eager, torch
    int8 (torchao), ONNX Runtime float and static int8, beside SB3 ``predict`` and SB3's ONNX recipe (``serve`` extra).

The exports are built here from the configs' members, bound to a short synthetic market and not trained (latency does
not depend on the weights). Peers: TA-Lib (``dev`` extra), talipp and Stable-Baselines3 (``bench`` extra); a peer that
is not installed is left out with a line saying so.

    python scripts/bench_live.py --repeats 5          # the full run (5-8 minutes on 2 shared cores)
    python scripts/bench_live.py --quick              # a smoke run, under a minute
    python scripts/bench_live.py --features --repeats 5   # section (a) alone and its goals
    python scripts/bench_live.py --serve --repeats 3  # section (e) alone (4-5 minutes; docs/SERVING.md)
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART, ENSEMBLE = ROOT / "lightning_configs" / "quickstart.yaml", ROOT / "lightning_configs" / "ensemble.yaml"


# ---------------------------------------------------------------------------------------------------- timing
@dataclass
class Case:
    """One timed thing: ``step()`` does one bar (or decision) and returns nothing, or the (wall, CPU) µs of the part
    of it that is timed (the rest is preparation); ``per`` divides a sample into units."""

    section: str
    name: str
    step: Callable[[], None]
    per: int = 1  # symbols per bar: a per symbol-bar figure is the sample / per
    note: str = ""
    runs: list[np.ndarray] = field(default_factory=list)  # µs samples of each repeat
    cpu: list[np.ndarray] = field(default_factory=list)  # this thread's CPU µs of the same samples


def _sample(case: Case, n: int, budget_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``n`` timed steps (at least 5), stopping once ``budget_s`` is spent: wall µs per step, and the thread's
    CPU µs (on a shared machine the wall time also counts the waits for a core; the CPU time does not)."""
    out, cpu = [], []
    deadline = time.perf_counter() + budget_s
    while len(out) < n and (len(out) < 5 or time.perf_counter() < deadline):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        part = case.step()
        wall, used = (time.perf_counter_ns() - t0) / 1e3, (time.thread_time_ns() - c0) / 1e3
        wall, used = part if part is not None else (wall, used)
        out.append(wall)
        cpu.append(used)
    return np.asarray(out), np.asarray(cpu)


def run_interleaved(cases: list[Case], repeats: int, n: int, budget_s: float) -> None:
    """Each repeat times every case once, in an order rotated by the repeat (so load drifts touch them alike)."""
    for case in cases:  # one untimed step each: first-call allocations out of the figures
        case.step()
    for r in range(repeats):
        for case in cases[r % len(cases):] + cases[: r % len(cases)]:
            wall, cpu = _sample(case, n, budget_s)
            case.runs.append(wall)
            case.cpu.append(cpu)


def stats(case: Case) -> dict[str, float]:
    """Medians over the repeats of each repeat's p50, p99 and p99.9 (µs) and CPU p50 and p99, and the samples in all
    (the thread's CPU time: on a shared box a wall p99 is mostly waits for a core, a CPU p99 the work's own tail)."""
    q = np.array([np.percentile(r, [50, 99, 99.9]) for r in case.runs])
    med = np.median(q, axis=0)
    cpu = np.median([np.percentile(c, [50, 99]) for c in case.cpu], axis=0) if case.cpu else (math.nan, math.nan)
    return {"p50": med[0], "p99": med[1], "p999": med[2], "cpu50": float(cpu[0]), "cpu99": float(cpu[1]),
            "n": int(sum(len(r) for r in case.runs))}


def _us(x: float) -> str:
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def print_table(title: str, cases: list[Case], per_unit: bool = False) -> None:
    """One section's table: p50/p99/p99.9 per step (and per symbol-bar when ``per_unit``), samples, notes."""
    print(f"\n## {title}\n")
    head = ("| case | p50 µs | p99 µs | p99.9 µs | CPU p50 µs | CPU p99 µs |" + (" p50 µs / symbol-bar |" if per_unit else "")
            + " samples | note |")
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for c in cases:
        s = stats(c)
        unit = f" {_us(s['p50'] / c.per)} |" if per_unit else ""
        print(f"| {c.name} | {_us(s['p50'])} | {_us(s['p99'])} | {_us(s['p999'])} | {_us(s['cpu50'])} | "
              f"{_us(s['cpu99'])} |{unit} "
              f"{s['n']} | {c.note} |")


# ---------------------------------------------------------------------------------------------------- bars
def market_bars(n_bars: int, n_symbols: int, seed: int) -> Any:
    """The embedded synthetic market's bars (a validated frame) of ``n_symbols`` symbols."""
    from foxhunt.data.synthetic import generate_market

    return generate_market(n_bars=n_bars, n_symbols=n_symbols, seed=seed, signal_strength=0.1).bars


def series(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One symbol's OHLCV [n, 5] float64 and timestamps [n] ns."""
    from foxhunt.quality.talib_reference import make_bars

    ohlcv, ts, _ = make_bars(n, seed)
    return ohlcv.numpy(), ts.numpy()


# ---------------------------------------------------------------------------------------------------- (a) features
def feature_case(names: list[str], S: int, history: int, ohlcv: np.ndarray, ts: np.ndarray, chunk: int,
                 warmed: Any | None = None) -> tuple[Case, Any]:
    """FeatureStream of ``names`` for S symbols, warmed on ``history`` bars in chunks, then timed one bar at a time;
    with ``warmed`` (such a stream, warmed alike), FeatureStream(compile=True) restored from its state instead."""
    from foxhunt.features.stream import FeatureStream

    scale = torch.linspace(0.5, 2.0, S, dtype=torch.float64)[:, None, None]  # S distinct series of one shape
    price = torch.from_numpy(ohlcv)
    tst = torch.from_numpy(ts)
    if warmed is None:
        fs = FeatureStream(names, S)
        pos = 0
        while pos < history:
            k = min(chunk, history - pos)
            o = price[pos : pos + k].unsqueeze(0) * scale
            o[..., 4] = price[pos : pos + k, 4]
            fs.update(o, tst[pos : pos + k].unsqueeze(0).expand(S, k))
            pos += k
    else:
        fs = FeatureStream(names, S, compile=True)
        fs.load_state_dict(warmed.state_dict())
    state = {"i": history}

    def step() -> None:
        i = state["i"]
        o = price[i : i + 1].unsqueeze(0) * scale
        o[..., 4] = price[i, 4]
        fs.update(o, tst[i : i + 1].unsqueeze(0).expand(S, 1))
        state["i"] = i + 1

    form = "FeatureStream(compile=True)" if warmed is not None else "FeatureStream"
    return Case("features", f"foxhunt {form}, {len(names)} features, {S} sym, {history:,} bars", step, S,
                f"{fs.warmup} warm-up bars"), fs


def _talib_handles(history: dict[str, np.ndarray]) -> list[tuple[Any, str]]:
    """TA-Lib 0.8 stream handles of the indicators of ``foxhunt.quality.talib_reference.talib_calls``, opened on a
    history: (handle, which inputs ``update`` takes)."""
    import talib.stream as st

    from foxhunt.quality.talib_reference import WINDOWS

    o, h, lo, c, v, r = (history[k] for k in ("o", "h", "l", "c", "v", "r"))
    hs: list[tuple[Any, str]] = []
    hs += [(st.ROCR(c, k), "c") for k in (1, 2, 3, 5, 10, 20, 50, 100)]
    hs += [(st.ROC(c, k), "c") for k in (5, 10, 20)] + [(st.MOM(c, k), "c") for k in (5, 10, 20)]
    hs += [(st.ATR(h, lo, c, k), "hlc") for k in (7, 14, 28)] + [(st.NATR(h, lo, c, k), "hlc") for k in (7, 14, 28)]
    hs += [(st.RSI(c, k), "c") for k in (6, 14, 21, 28)]
    hs += [(st.STOCH(h, lo, c, k, 3, 0, 3, 0), "hlc") for k in (5, 14)]
    hs += [(st.WILLR(h, lo, c, k), "hlc") for k in (14, 28)]
    hs += [(st.MACD(c, *a), "c") for a in ((12, 26, 9), (5, 35, 5))]
    hs += [(st.CCI(h, lo, c, k), "hlc") for k in (14, 20)]
    for k in (14, 28):
        hs += [(st.ADX(h, lo, c, k), "hlc"), (st.PLUS_DI(h, lo, c, k), "hlc"), (st.MINUS_DI(h, lo, c, k), "hlc")]
    hs += [(st.AROON(h, lo, 25), "hl"), (st.AROONOSC(h, lo, 25), "hl"), (st.ULTOSC(h, lo, c, 7, 14, 28), "hlc"),
           (st.TRIX(c, 15), "c")]
    hs += [(st.SMA(c, k), "c") for k in WINDOWS] + [(st.EMA(c, k), "c") for k in WINDOWS]
    hs += [(st.KAMA(c, k), "c") for k in (10, 30)]
    hs += [(st.STDDEV(r, k, 1.0), "r") for k in (5, 10, 20, 50, 100)]
    hs += [(st.BBANDS(c, k, 2.0, 2.0, 0), "c") for k in (20, 50)]
    hs += [(st.OBV(c, v), "cv")] + [(st.MFI(h, lo, c, v, k), "hlcv") for k in (14, 28)]
    hs += [(st.ADOSC(h, lo, c, v, 3, 10), "hlcv"), (st.BOP(o, h, lo, c), "ohlc")]
    return hs


def _history_arrays(ohlcv: np.ndarray, lo: int, hi: int, scale: float) -> dict[str, np.ndarray]:
    o, h, l_, c = (np.ascontiguousarray(ohlcv[lo:hi, i] * scale) for i in range(4))
    v = np.ascontiguousarray(ohlcv[lo:hi, 4])
    return {"o": o, "h": h, "l": l_, "c": c, "v": v, "r": np.diff(np.log(c), prepend=np.nan)}


def talib_case(S: int, history: int, ohlcv: np.ndarray) -> Case | None:
    """TA-Lib's stream handles for S symbols (a Python loop over symbols and handles: TA-Lib has no panel form)."""
    try:
        import talib  # noqa: F401
    except ImportError:
        print("(TA-Lib is not installed: its rows are left out; pip install ta-lib)")
        return None
    scales = np.linspace(0.5, 2.0, S)
    books = [_talib_handles(_history_arrays(ohlcv, 0, history, float(scales[s]))) for s in range(S)]
    state = {"i": history}
    n_handles = len(books[0])

    def step() -> None:
        i = state["i"]
        bar = ohlcv[i]
        for s in range(S):
            k = float(scales[s])
            o, h, lo, c, v = bar[0] * k, bar[1] * k, bar[2] * k, bar[3] * k, float(bar[4])
            r = math.log(bar[3] / ohlcv[i - 1, 3])
            args = {"c": (c,), "hlc": (h, lo, c), "hl": (h, lo), "r": (r,), "cv": (c, v), "hlcv": (h, lo, c, v),
                    "ohlc": (o, h, lo, c)}
            for handle, kind in books[s]:
                handle.update(*args[kind])
        state["i"] = i + 1

    return Case("features", f"TA-Lib 0.8 stream handles, {n_handles} indicators, {S} sym, {history:,} bars", step, S,
                "O(1) handles (.update); covers the TA-Lib-derived features only")


def talipp_case(S: int, history: int, ohlcv: np.ndarray) -> Case | None:
    """talipp's incremental indicators (``.add``) for S symbols, on the indicators talipp has."""
    try:
        import talipp.indicators as ti
        from talipp.ohlcv import OHLCV
    except ImportError:
        print("(talipp is not installed: its rows are left out; pip install talipp)")
        return None
    from foxhunt.quality.talib_reference import WINDOWS

    def book() -> tuple[list[Any], list[Any]]:
        close = [ti.ROC(k) for k in (1, 2, 3, 5, 10, 20, 50, 100)] + [ti.RSI(k) for k in (6, 14, 21, 28)]
        close += [ti.MACD(12, 26, 9), ti.MACD(5, 35, 5), ti.TRIX(15)]
        close += [ti.SMA(k) for k in WINDOWS] + [ti.EMA(k) for k in WINDOWS]
        close += [ti.KAMA(k, 2, 30) for k in (10, 30)] + [ti.StdDev(k) for k in (5, 10, 20, 50, 100)]
        close += [ti.BB(k, 2.0) for k in (20, 50)]
        bars = [ti.ATR(k) for k in (7, 14, 28)] + [ti.NATR(k) for k in (7, 14, 28)]
        bars += [ti.Stoch(k, 3) for k in (5, 14)] + [ti.Williams(k) for k in (14, 28)] + [ti.CCI(k) for k in (14, 20)]
        bars += [ti.ADX(k, k) for k in (14, 28)] + [ti.Aroon(25), ti.UO(7, 14, 28), ti.OBV(), ti.ChaikinOsc(3, 10),
                                                     ti.BOP()]
        return close, bars

    scales = np.linspace(0.5, 2.0, S)
    books = [book() for _ in range(S)]
    for s, (close, bars) in enumerate(books):
        k = float(scales[s])
        for i in range(history):
            b = ohlcv[i]
            bar = OHLCV(b[0] * k, b[1] * k, b[2] * k, b[3] * k, float(b[4]))
            for ind in close:
                ind.add(b[3] * k)
            for ind in bars:
                ind.add(bar)
    n_ind = len(books[0][0]) + len(books[0][1])
    state = {"i": history}

    def step() -> None:
        i = state["i"]
        b = ohlcv[i]
        for s, (close, bars) in enumerate(books):
            k = float(scales[s])
            bar = OHLCV(b[0] * k, b[1] * k, b[2] * k, b[3] * k, float(b[4]))
            for ind in close:
                ind.add(b[3] * k)
            for ind in bars:
                ind.add(bar)
        state["i"] = i + 1

    return Case("features", f"talipp {importlib.metadata.version('talipp')} .add, {n_ind} indicators, {S} sym, "
                f"{history:,} bars", step, S, "pure Python; keeps every output in lists (memory grows per bar)")


# ---------------------------------------------------------------------------------------------------- exports
def _members(cfg: dict, names: list[str]) -> dict[str, Any]:
    """The config's members ``names``, built from their class_path and init_args (untrained)."""
    out = {}
    for n in names:
        entry = cfg["model"]["members"][n]
        module, _, cls = entry["class_path"].rpartition(".")
        out[n] = getattr(importlib.import_module(module), cls)(**entry.get("init_args", {}))
    return out


def build_export(config: Path, names: list[str], root: Path, n_symbols: int, n_bars: int,
                 combine: str | None = None) -> Path:
    """An untrained export of the config's members ``names`` on a short synthetic market of its data section.

    Members are not held flat (``min_edge_confidence: None``: an untrained member would be, and its network would
    never run); under ``combine: stack`` the forecasters' snapshots are taken as they are, so the agents trade."""
    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.export.write import export_ensemble
    from foxhunt.lit.ensemble import EnsembleModule

    cfg = yaml.safe_load(config.read_text())
    data = {k: v for k, v in cfg["data"].items() if k != "path"}
    data.update(synthetic_bars=n_bars, synthetic_symbols=n_symbols, cache_dir=None)
    dm = BarDataModule(**data)
    dm.setup()
    torch.manual_seed(0)
    ens = {k: v for k, v in cfg["model"].items() if k != "members"}
    ens["min_edge_confidence"] = None
    if combine is not None:
        ens["combine"] = combine
    model = EnsembleModule(members=_members(cfg, names), **ens)
    model.bind(dm.spec)
    if model.hparams.combine == "stack":  # as tests/test_live.py does: the snapshots an export of a fit carries
        for name in model.forecaster_names:
            model.snapshots[name].load_state_dict(model.member(name).network.state_dict())
        model.stack_std.fill_(1e-4)
        model._snapshots_loaded = True
    export_ensemble(model, dm, root)
    return root


def _feed(n_symbols: int, n_bars: int, horizon: int) -> Iterator[Any]:
    from foxhunt.live.replay import replay

    return replay(market_bars(n_bars, n_symbols, seed=1), horizon)


def session_case(label: str, root: Path, n_symbols: int, warm: int, n_bars: int,
                 fast: bool = True, backend: str = "torch", compile_features: bool = False,
                 compile_networks: bool = False) -> tuple[Case, Any]:
    """``on_bar`` of a live session of the export, warmed on ``warm`` bars (past every member's warm-up); ``fast``:
    ``LiveSession.fast`` (False: the plain path, the members' own code and networks); ``backend``: what the networks
    run on (``foxhunt.live.open``'s); ``compile_features``, ``compile_networks``: the features' steady bars, the TFT's
    decisions through torch.compile."""
    import foxhunt.live

    session = foxhunt.live.open(str(root), fast=fast, backend=backend, compile_features=compile_features,
                                compile_networks=compile_networks)
    feed = _feed(n_symbols, n_bars, session.horizon)
    for _ in range(max(warm, session.tail + session.features.warmup + 8)):
        b = next(feed)
        d = session.on_bar(b.symbols, b.ohlcv, b.timestamp, b.next_timestamps)
    if not bool(d.ready.all()):
        raise SystemExit(f"bench_live: {label}: the session is not ready after its warm-up")

    def step() -> tuple[float, float]:  # on_bar timed, not the feed's next bar
        b = next(feed)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        session.on_bar(b.symbols, b.ohlcv, b.timestamp, b.next_timestamps)
        return (time.perf_counter_ns() - t0) / 1e3, (time.thread_time_ns() - c0) / 1e3

    return Case("session", f"{label}, {n_symbols} sym", step, n_symbols, f"tail {session.tail} bars"), session


ORT_LABEL = "quickstart ensemble (tft, dqn), backend onnxruntime"
COMPILED_LABEL = "quickstart ensemble (tft, dqn), compiled features and networks"


def served_copy(root: Path, to: Path) -> Path | None:
    """A copy of the export ``root`` with its float ONNX graphs written (foxhunt.export.onnx), or None (with a note)
    without the serve extra."""
    try:
        import onnxruntime  # noqa: F401

        from foxhunt.export.onnx import write_onnx
    except ImportError:
        print("# no onnxruntime (pip install -e '.[serve]'): the backend onnxruntime rows are left out")
        return None
    shutil.copytree(root, to)
    write_onnx(to)
    return to


def decision_case(label: str, root: Path, n_bars: int, fast: bool = True, backend: str = "torch") -> Case:
    """``decide_on`` alone (every member's position from the bar's feature values: on_bar less the feature stream),
    each bar's ``feature_step`` run before it, untimed."""
    import foxhunt.live

    session = foxhunt.live.open(str(root), fast=fast, backend=backend)
    feed = _feed(1, n_bars, session.horizon)
    for _ in range(session.tail + session.features.warmup + 8):
        b = next(feed)
        session.on_bar(b.symbols, b.ohlcv, b.timestamp, b.next_timestamps)

    def step() -> tuple[float, float]:
        b = next(feed)
        values, ready = session.feature_step(b.symbols, b.ohlcv, b.timestamp)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        session.decide_on(b.symbols, b.ohlcv, b.timestamp, values, ready, b.next_timestamps)
        return (time.perf_counter_ns() - t0) / 1e3, (time.thread_time_ns() - c0) / 1e3

    return Case("session", f"{label}, 1 sym: decide_on alone", step, 1, "on_bar less the feature stream")


def capture_forward(session: Any, name: str, feed_step: Callable[[], None]) -> tuple[Callable, tuple, int, str]:
    """What member ``name``'s network computes in one ``on_bar``, as the session calls it: a forecaster's ``forward``
    (its inference form on, as while the session decides), a DQN's Q-network inference form (``fast``) or ``forward``,
    PPO's ``deterministic`` actor; the arguments of its first call there, the rows that call carried and its name."""
    member = session.model.member(name)
    agent = name in session.model.agent_names
    net = member.policy_network if agent else member.network
    form = session._agent_network(name, net) if agent else net
    if form is not net:  # the session calls the network's inference form: record its calls at the class
        method = "deterministic" if callable(getattr(form, "deterministic", None)) else "__call__"  # PPO's actor
        target, what = type(form), f"{type(form).__name__}.{method}"
    else:
        method = "deterministic" if agent and callable(getattr(net, "deterministic", None)) else "forward"
        target, what = net, f"{type(net).__name__}.{method}"
    original = getattr(target, method)
    got: list[tuple] = []

    def record(*args: Any) -> Any:
        call = args[1:] if target is type(form) else args
        if not got:
            got.append(call)
        return original(*args)

    setattr(target, method, record)  # deleted or restored below: the network's own class is untouched
    try:
        feed_step()
    finally:
        if target is type(form):
            setattr(target, method, original)
        else:
            delattr(net, method)
    if not got:
        raise SystemExit(f"bench_live: {name}'s network did not run in on_bar (held flat?)")
    rows = next((a.shape[0] for a in got[0] if isinstance(a, torch.Tensor) and a.ndim), 1)
    if net.training:  # (eval() on an eval network would drop a TFT's inference form, a compiled one too)
        net.eval()
    if form is not net:
        return (form if method == "__call__" else getattr(form, method)), got[0], int(rows), what
    fn = getattr(net, method)
    if hasattr(net, "cache_inference"):  # on while a session decides: on for its timing too
        def with_form(*args: Any, fn: Callable = fn) -> Any:
            net.cache_inference = True
            return fn(*args)

        return with_form, got[0], int(rows), what
    return fn, got[0], int(rows), what


def first_rows(args: tuple) -> tuple:
    """The arguments of one decision: every batched tensor's first row."""
    return tuple(a[:1].clone() if isinstance(a, torch.Tensor) and a.ndim >= 1 and a.shape[0] > 1 else a for a in args)


def forward_case(label: str, fn: Callable, args: tuple, section: str = "forward") -> Case:
    def step() -> None:
        with torch.no_grad():
            fn(*args)

    return Case(section, label, step)


# ---------------------------------------------------------------------------------------------------- (c) SB3
def sb3_case(algo: str, obs_dim: int, n_actions: int, hidden: list[int]) -> Case | None:
    """SB3 ``predict(obs, deterministic=True)`` of a DQN or PPO with an MLP of ``hidden`` on ``obs_dim`` inputs."""
    try:
        import gymnasium as gym
        import stable_baselines3 as sb3
    except ImportError:
        print("(stable-baselines3 is not installed: its rows are left out; pip install stable-baselines3)")
        return None

    class Env(gym.Env):
        """The shape of the agents' task only: predict never steps it."""

        observation_space = gym.spaces.Box(-10.0, 10.0, (obs_dim,), np.float32)
        action_space = gym.spaces.Discrete(n_actions)

        def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
            return np.zeros(obs_dim, np.float32), {}

        def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
            return np.zeros(obs_dim, np.float32), 0.0, True, False, {}

    if algo == "dqn":
        model = sb3.DQN("MlpPolicy", Env(), policy_kwargs={"net_arch": list(hidden)}, device="cpu", buffer_size=1,
                        learning_starts=0)
    else:
        model = sb3.PPO("MlpPolicy", Env(), policy_kwargs={"net_arch": {"pi": list(hidden), "vf": list(hidden)}},
                        device="cpu", n_steps=8, batch_size=8)
    obs = np.random.default_rng(0).standard_normal(obs_dim).astype(np.float32)

    def step() -> None:
        model.predict(obs, deterministic=True)

    return Case("sb3", f"SB3 {sb3.__version__} {algo.upper()} predict, MLP {obs_dim}-{'-'.join(map(str, hidden))}-"
                f"{n_actions}, batch 1", step)


# ---------------------------------------------------------------------------------------------------- (d) naive
def naive_case(root: Path, window: int, n_bars: int) -> Case:
    """``LoadedEnsemble.positions`` on the trailing ``window`` bars, recomputed at every new bar."""
    import foxhunt

    loaded = foxhunt.load(root)
    bars = market_bars(n_bars, 1, seed=1)
    state = {"i": window}

    def step() -> None:
        i = state["i"]
        loaded.positions(bars.iloc[i - window : i].reset_index(drop=True))
        state["i"] = i + 1

    return Case("naive", f"LoadedEnsemble.positions over the last {window} bars, 1 sym", step, 1,
                "the whole window recomputed per bar")


# ---------------------------------------------------------------------------------------------------- (e) serving
# Issue 48: each member's network per decision in torch eager, torch int8 (torchao weight-only), ONNX Runtime float
# and static int8, at 1 and 1,000 symbols, 1 thread, beside SB3 predict and SB3's ONNX recipe on an equal MLP.
# Self-contained: `python scripts/bench_live.py --serve` runs this section alone.
SERVE_SYMBOLS = (1, 1000)


def serve_export(root: Path, n_bars: int) -> Path:
    """The quickstart's data sizes with its TFT and DQN, mamba2.yaml's Mamba-2 and ppo.yaml's PPO (untrained, not held
    flat), exported with the data config recorded, then its float and int8 graphs written."""
    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.export.onnx import write_onnx
    from foxhunt.export.quantise import write_int8
    from foxhunt.export.write import export_ensemble
    from foxhunt.lit.ensemble import EnsembleModule

    quick = yaml.safe_load(QUICKSTART.read_text())
    data = {k: v for k, v in quick["data"].items() if k != "path"}
    data.update(synthetic_bars=n_bars, synthetic_symbols=1, cache_dir=None)
    dm = BarDataModule(**data)
    dm.setup()
    members = _members(quick, ["tft", "dqn"])
    for config, name in ((ROOT / "lightning_configs" / "mamba2.yaml", "mamba2"),
                         (ROOT / "lightning_configs" / "ppo.yaml", "ppo")):
        members.update(_members(yaml.safe_load(config.read_text()), [name]))
    torch.manual_seed(0)
    model = EnsembleModule(members=members, combine="vote", min_edge_confidence=None, cost_bps=1.0)
    model.bind(dm.spec)
    export_ensemble(model, dm, root, config={"data": data})
    write_onnx(root)
    write_int8(root, rows=2048)
    return root


def _decision_rows(graph: Any, symbols: int) -> tuple:
    """The inputs of one decision for each of ``symbols`` symbols: a forecaster's window each, an agent's window
    under every held position (what its policy table evaluates)."""
    from foxhunt.export.onnx import parity_inputs

    rows = symbols * (graph.example[1].shape[1] if graph.kind in ("dqn", "ppo_discrete") else 1)
    return parity_inputs(graph, rows)


class _Quantiles(torch.nn.Module):
    """A forecaster network's quantiles, for torchao to quantise (its Linear layers: the reference path's)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.net(*(inputs if len(inputs) == 3 else (inputs[0], None, inputs[1]))).prediction


def _torch_int8(member: Any, graph: Any) -> tuple[Callable | None, str]:
    """The member's traded network on its plain torch path (:func:`~foxhunt.export.onnx.plain_copy`) with torchao's
    weight-only int8 on its Linear layers, called like the graph, or why not."""
    import logging

    from foxhunt.export.onnx import plain_copy
    from foxhunt.export.traded import traded_network

    logging.getLogger("torchao").setLevel(logging.ERROR)  # its optional CUDA kernels' load failures on a CPU build
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except Exception as e:  # noqa: BLE001 - absent, or present for another torch
        return None, f"torchao unavailable ({type(e).__name__})"
    net = plain_copy(traded_network(member)[1])
    if graph.kind == "forecaster":
        module: Any = _Quantiles(net)
    elif graph.kind == "dqn":
        module = net
    else:
        module = net.deterministic
    try:
        # its Linear layers of both widths > 1 (torchao's scales refuse a width of 1) whose weight is not sliced
        # (Mamba-2's input_proj is read by columns)
        quantize_(net, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear)
                  and min(m.in_features, m.out_features) > 1 and not fqn.endswith("input_proj"))
        with torch.no_grad():
            module(*graph.example)
    except Exception as e:  # noqa: BLE001 - a layer torchao cannot take
        return None, f"torchao failed: {type(e).__name__}: {str(e)[:80]}"
    return module, "torchao Int8WeightOnlyConfig"


def _sb3_onnx(algo: str, obs_dim: int, n_actions: int, hidden: list[int]) -> tuple[Any, Any, str] | None:
    """An SB3 model of ``hidden`` and its policy exported by SB3's documented recipe (``OnnxableSB3Policy``:
    ``policy(obs, deterministic=True)`` through ``torch.onnx.export``, opset 17, input "input"), or None."""
    try:
        import gymnasium as gym
        import stable_baselines3 as sb3
    except ImportError:
        return None

    class Env(gym.Env):
        observation_space = gym.spaces.Box(-10.0, 10.0, (obs_dim,), np.float32)
        action_space = gym.spaces.Discrete(n_actions)

        def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
            return np.zeros(obs_dim, np.float32), {}

        def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
            return np.zeros(obs_dim, np.float32), 0.0, True, False, {}

    if algo == "dqn":
        model = sb3.DQN("MlpPolicy", Env(), policy_kwargs={"net_arch": list(hidden)}, device="cpu", buffer_size=1,
                        learning_starts=0)
    else:
        model = sb3.PPO("MlpPolicy", Env(), policy_kwargs={"net_arch": {"pi": list(hidden), "vf": list(hidden)}},
                        device="cpu", n_steps=8, batch_size=8)

    class OnnxableSB3Policy(torch.nn.Module):
        def __init__(self, policy: Any) -> None:
            super().__init__()
            self.policy = policy

        def forward(self, observation: torch.Tensor) -> Any:
            return self.policy(observation, deterministic=True)

    import io

    from foxhunt.export.onnx import ort_session, quiet_exporter

    policy = OnnxableSB3Policy(model.policy)
    with quiet_exporter():
        try:  # the recipe as documented, with torch.onnx.export's default (dynamo) exporter
            prog = torch.onnx.export(policy, torch.randn(1, obs_dim), opset_version=17, input_names=["input"],
                                     verbose=False, dynamic_shapes=({0: torch.export.Dim("batch")},))
            return model, ort_session(prog.model_proto.SerializeToString()), "dynamo"
        except Exception:  # noqa: BLE001 - its graph fails to load (PPO: ReduceLogSumExp at opset 17): TorchScript,
            buf = io.BytesIO()  # the exporter the recipe was written for
            torch.onnx.export(policy, torch.randn(1, obs_dim), buf, opset_version=17, input_names=["input"],
                              dynamic_axes={"input": {0: "batch"}}, dynamo=False)
            return model, ort_session(buf.getvalue()), "TorchScript"


def _void(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` as a step that returns nothing (a step's return value is read as its own timing)."""

    def step() -> None:
        fn()

    return step


def _bound(session: Any, feed: dict[str, np.ndarray]) -> Callable[[], None]:
    """A step running ``session`` with its inputs and outputs bound once (IO binding: preallocated tensors in and
    out, as a deployed runtime calls it) instead of ``session.run``'s per-call conversions."""
    import onnxruntime as ort

    io = session.io_binding()
    for name, value in feed.items():
        io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
    for out in session.get_outputs():
        io.bind_output(out.name)
    session.run_with_iobinding(io)  # sizes the outputs; later calls reuse them
    for out, value in zip(session.get_outputs(), io.get_outputs(), strict=True):
        io.bind_ortvalue_output(out.name, value)
    return _void(lambda: session.run_with_iobinding(io))


def serve_cases(root: Path) -> tuple[list[Case], list[str]]:
    """Each member's network on one decision at every size of :data:`SERVE_SYMBOLS`, in every format, and the SB3
    peers on an equal MLP; notes on what was left out."""
    import foxhunt
    from foxhunt.export.onnx import member_graph, ort_session

    loaded = foxhunt.load(root)
    meta = loaded.metadata["serving"]
    cases: list[Case] = []
    notes: list[str] = []
    for name in loaded.model.member_names:
        member = loaded.model.member(name)
        graph = member_graph(member)
        eager = member_graph(member, plain=False).module
        int8_torch, why = _torch_int8(member, graph)
        sessions = {f: ort_session((root / meta[k]["members"][name]["file"]).read_bytes())
                    for f, k in (("ORT float", "onnx"), ("ORT int8", "onnx_int8"))}
        if int8_torch is None:
            notes.append(f"{name}: torch int8 left out: {why}")
        for S in SERVE_SYMBOLS:
            inputs = _decision_rows(graph, S)
            rows = inputs[0].shape[0]
            feed = {n: t.contiguous().numpy() for n, t in zip(graph.inputs, inputs, strict=True)}
            label = f"{name} ({graph.kind}), {S:,} sym ({rows:,} rows)"

            def run_torch(module: Callable = eager, args: tuple = inputs) -> None:
                with torch.no_grad():
                    module(*args)

            cases.append(Case("serve", f"{label}: torch eager", run_torch, S))
            if int8_torch is not None:
                step = _void(lambda m=int8_torch, x=inputs: run_torch(m, x))
                cases.append(Case("serve", f"{label}: torch int8", step, S, why))
            for fmt, sess in sessions.items():
                cases.append(Case("serve", f"{label}: {fmt}", _void(lambda s=sess, f=feed: s.run(None, f)), S,
                                  "session.run, numpy in and out"))
                cases.append(Case("serve", f"{label}: {fmt}, IO binding", _bound(sess, feed), S,
                                  "inputs and outputs bound once"))
                if S == 1 and graph.kind == "forecaster":  # what the backend runs on one symbol's window
                    blob = (root / meta["onnx" if fmt == "ORT float" else "onnx_int8"]["members"][name]["file"])
                    single = ort_session(blob.read_bytes(), batch=1)
                    cases.append(Case("serve", f"{label}: {fmt}, batch-1 graph, IO binding", _bound(single, feed), S,
                                      "the graph fixed to batch 1 (fixed_batch), inputs and outputs bound once"))
        if name in loaded.model.agent_names:
            obs_dim = int(graph.example[0][0].numel() + graph.example[1].shape[1])
            hidden = [int(x) for x in member.hparams.hidden]
            peer = _sb3_onnx(name if name == "dqn" else "ppo", obs_dim, len(member.hparams.actions), hidden)
            if peer is None:
                notes.append("stable-baselines3 is not installed: its rows are left out")
                continue
            model, sess, how = peer
            for S in SERVE_SYMBOLS:
                obs = np.random.default_rng(0).standard_normal((S, obs_dim)).astype(np.float32)
                mlp = f"SB3 {name.upper()} MLP {obs_dim}-{'-'.join(map(str, hidden))}, {S:,} sym"
                predict = _void(lambda m=model, o=obs: m.predict(o, deterministic=True))
                cases.append(Case("serve", f"{mlp}: predict", predict, S))
                recipe = _void(lambda s=sess, o=obs: s.run(None, {"input": o}))
                cases.append(Case("serve", f"{mlp}: SB3 ONNX recipe", recipe, S,
                                  f"OnnxableSB3Policy, {how} exporter, ORT 1 thread"))
                cases.append(Case("serve", f"{mlp}: SB3 ONNX recipe, IO binding", _bound(sess, {"input": obs}), S,
                                  "inputs and outputs bound once"))
    return cases, notes


def serve_main(a: argparse.Namespace) -> int:
    """The serving section alone: build, time, print the table and the issue's goals."""
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    t0 = time.perf_counter()
    root = serve_export(tmp / "export", 3000)
    print(f"# built the export and its float and int8 graphs in {time.perf_counter() - t0:.1f} s", flush=True)
    cases, notes = serve_cases(root)
    run_interleaved(cases, a.repeats, a.samples, a.budget)
    print_table("(e) serving: each member's network on one decision per symbol, 1 thread", cases, per_unit=True)
    for n in notes:
        print(f"# {n}")
    by = {c.name: stats(c) for c in cases}
    print("\n## Goals of issue 48\n")
    print("| goal | measured | target | verdict |")
    print("| --- | --- | --- | --- |")
    for name, target in (("dqn", 10.0), ("ppo", 10.0), ("tft", 200.0), ("mamba2", 200.0)):
        mine = [c for c in cases if c.name.startswith(f"{name} (") and ", 1 sym " in c.name
                and "int8" not in c.name]  # the formats that trade exactly what the float back-test trades
        if not mine:
            continue
        best = min(mine, key=lambda c: by[c.name]["p50"])
        p50, cpu = by[best.name]["p50"], by[best.name]["cpu50"]
        fmt = best.name.rsplit(": ", 1)[1]
        print(goal(f"{name} p50 per decision, 1 sym, fastest float format ({fmt})",
                   f"{_us(p50)} µs (CPU {_us(cpu)} µs)", f"<= {target:.0f} µs", p50 <= target))
    print(f"\n# wall {time.perf_counter() - started:.0f} s")
    return 0

# ---------------------------------------------------------------------------------------------------- main
def feature_goals(feats: list[Case], peers: list[Case], big: int, n_all: int, n_talib: int) -> None:
    """Section (a)'s goal rows, eager and compiled: against TA-Lib's handles per symbol-bar at ``big`` symbols (timed
    beside them), at most 1 ms a bar at 1 symbol, flat in history."""
    by = {c.name: stats(c) for c in feats + peers}
    talib_big = next((c for c in peers if c.name.startswith("TA-Lib") and f", {big} sym," in c.name), None)
    same_big = next((c for c in feats if f", {big} sym," in c.name and "TA-Lib also" in c.name), None)
    for form in ("FeatureStream,", "FeatureStream(compile=True),"):
        mine = [c for c in feats if f" {form} " in c.name and "TA-Lib also" not in c.name]
        ours_big = next((c for c in mine if f", {big} sym," in c.name), None)
        if talib_big is not None and ours_big is not None:
            r = (by[talib_big.name]["p50"] / talib_big.per) / (by[ours_big.name]["p50"] / ours_big.per)
            print(goal(f"{form[:-1]}: all {n_all} features vs TA-Lib stream per symbol-bar, {big} sym",
                       f"{r:.2f}x faster", ">= 10x", r >= 10))
        one = [c for c in mine if ", 1 sym," in c.name]
        if one:
            worst = max(by[c.name]["p50"] for c in one)
            print(goal(f"{form[:-1]}: features per bar, 1 sym (p50, worst history)", f"{_us(worst)} µs",
                       "<= 1,000 µs", worst <= 1000))
            flat = [by[c.name]["p50"] for c in one]
            print(goal(f"{form[:-1]}: flat in history, 1 sym (p50 longest / shortest)", f"{flat[-1] / flat[0]:.2f}",
                       "about 1 (O(1))", abs(flat[-1] / flat[0] - 1) <= 0.2))
    if talib_big is not None and same_big is not None:
        r = (by[talib_big.name]["p50"] / talib_big.per) / (by[same_big.name]["p50"] / same_big.per)
        print(goal(f"the {n_talib} TA-Lib-derived features (eager) vs TA-Lib stream per symbol-bar, {big} sym",
                   f"{r:.2f}x faster", "(same indicators)", None))


def goal(label: str, measured: str, target: str, met: bool | None) -> str:
    verdict = "n/a" if met is None else ("met" if met else "NOT met")
    return f"| {label} | {measured} | {target} | {verdict} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (medians of their percentiles)")
    p.add_argument("--samples", type=int, default=400, help="most timed steps per case and repeat")
    p.add_argument("--budget", type=float, default=1.5, help="seconds per case and repeat (at least 5 steps)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small histories and few samples (< 60 s)")
    p.add_argument("--no-100", action="store_true", help="skip the 100- and 1,000-symbol sessions")
    p.add_argument("--decisions", action="store_true", help="sections (b)-(d) only: decisions, networks, SB3, naive")
    p.add_argument("--features", action="store_true", help="section (a) only: the feature streams, eager and "
                   "compiled, beside TA-Lib and talipp, and their goals")
    p.add_argument("--serve", action="store_true", help="only section (e): each member's network in torch, torch int8, "
                   "ONNX Runtime float and int8, beside SB3 (issue 48; needs the serve extra)")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.samples < 5 or a.budget <= 0:
        print("bench_live: --repeats must be >= 1, --samples >= 5 and --budget > 0", file=sys.stderr)
        return 2
    if a.quick:
        a.repeats, a.samples, a.budget = min(a.repeats, 2), min(a.samples, 20), min(a.budget, 0.2)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.serve:
        return serve_main(a)
    started = time.perf_counter()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %cd", "--date=format:%H:%M"],
                          capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"# bench_live: commit {head}, torch {torch.__version__}, 1 thread, {os.cpu_count()} cores; "
          f"load at start: {load}")
    print(f"# {a.repeats} interleaved repeats, up to {a.samples} samples or {a.budget} s per case and repeat; "
          "figures are the medians over repeats of each repeat's percentiles")

    from foxhunt.features import REGISTRY

    names = list(REGISTRY)
    talib_names = [n for n, f in REGISTRY.items() if f.talib]
    # (a) ------------------------------------------------------------------------------------------------------
    if a.quick:
        histories = {1: [1_000, 20_000], 100: [600]}
        talipp_history = 300
    else:
        # 1M bars is reached at 1 symbol (the O(1) check); the panels are warmed on 10k (100 symbols) and 2,048
        # (1,000 symbols: 2M symbol-bars) bars, well past every feature's warm-up, to keep the run in minutes
        histories = {1: [10_000, 1_000_000], 100: [10_000], 1000: [2_048]}
        talipp_history = 400
    longest = max(max(h) for h in histories.values())
    ohlcv, ts = series(longest + a.repeats * a.samples + 64)
    feats, peers = [], []
    for S, hs in histories.items() if not a.decisions else ():
        for h in hs:
            t0 = time.perf_counter()
            case, fs = feature_case(names, S, h, ohlcv, ts, chunk=4096)
            feats.append(case)
            print(f"# warmed {case.name} in {time.perf_counter() - t0:.1f} s", flush=True)
            if a.quick:  # compiling takes 15 s from inductor's cache, minutes without
                continue
            t0 = time.perf_counter()
            feats.append(feature_case(names, S, h, ohlcv, ts, chunk=4096, warmed=fs)[0])
            print(f"# compiled {feats[-1].name} in {time.perf_counter() - t0:.1f} s (inductor, or its cache)",
                  flush=True)
        if S == max(histories):  # the same indicators as the peers: the features TA-Lib also computes
            feats.append(feature_case(talib_names, S, min(hs), ohlcv, ts, chunk=4096)[0])
            feats[-1].name += " (those TA-Lib also computes)"
        tl = talib_case(S, min(hs), ohlcv)
        tp = talipp_case(S, min(talipp_history, min(hs)), ohlcv) if S <= 100 or a.quick else None
        peers += [c for c in (tl, tp) if c is not None]
    if feats:
        run_interleaved(feats + peers, a.repeats, a.samples, a.budget)
        print_table("(a) features: one bar of every symbol in, values out", feats + peers, per_unit=True)
    if a.features:
        print("\n## Goals of issue 44 (features)\n")
        print("| goal | measured | target | verdict |")
        print("| --- | --- | --- | --- |")
        feature_goals(feats, peers, max(histories), len(names), len(talib_names))
        print(f"\n# bench_live: {time.perf_counter() - started:.0f} s")
        return 0

    # (b) ------------------------------------------------------------------------------------------------------
    tmp = Path(tempfile.mkdtemp(prefix="bench_live_"))
    n_export = 3000
    need = 600 + a.repeats * a.samples + 200
    exports = {
        "quickstart ensemble (tft, dqn)": (QUICKSTART, ["tft", "dqn"], None),
        "ensemble.yaml (tft, dqn, ppo, mamba2; stack)": (ENSEMBLE, ["tft", "dqn", "ppo", "mamba2"], None),
    }
    for m in ("tft", "mamba2", "dqn", "ppo"):
        exports[f"{m} alone (ensemble.yaml)"] = (ENSEMBLE, [m], "vote")
    if a.quick:  # ensemble.yaml's 122 features and 64-bar lookback take ~10 s an export to warm: the full run only
        exports = {k: v for k, v in exports.items() if v[0] == QUICKSTART}
    exports["dqn alone (quickstart.yaml)"] = (QUICKSTART, ["dqn"], "vote")
    sessions: dict[str, Any] = {}
    cases: list[Case] = []
    roots: dict[str, Path] = {}
    for i, (label, (cfg, members, combine)) in enumerate(exports.items()):
        t0 = time.perf_counter()
        roots[label] = build_export(cfg, members, tmp / f"e{i}", 1, n_export, combine)
        case, sessions[label] = session_case(label, roots[label], 1, 0, need)
        cases.append(case)
        print(f"# built and warmed {label} in {time.perf_counter() - t0:.1f} s", flush=True)
    quick_root = roots["quickstart ensemble (tft, dqn)"]
    plain_label = "quickstart ensemble (tft, dqn), fast=False (the plain path)"
    case, _ = session_case(plain_label, quick_root, 1, 0, need, fast=False)
    cases.append(case)
    cases.append(decision_case("quickstart ensemble (tft, dqn)", quick_root, need))
    cases.append(decision_case(plain_label, quick_root, need, fast=False))
    ort_root = served_copy(quick_root, tmp / "q_ort")
    if ort_root is not None:  # the same export's float graphs on ONNX Runtime (the fast path decides with them too)
        case, sessions[ORT_LABEL] = session_case(ORT_LABEL, ort_root, 1, 0, need, backend="onnxruntime")
        cases.append(case)
        cases.append(decision_case(ORT_LABEL, ort_root, need, backend="onnxruntime"))
    if not a.quick:  # the same sessions with the features' steady bars compiled (--compile-features)
        t0 = time.perf_counter()
        case, _ = session_case("quickstart ensemble (tft, dqn), compiled features", quick_root, 1, 0, need,
                               compile_features=True)
        cases.append(case)
        case, sessions[COMPILED_LABEL] = session_case(COMPILED_LABEL, quick_root, 1, 0, need,
                                                      compile_features=True, compile_networks=True)
        cases.append(case)
        if ort_root is not None:
            case, _ = session_case(f"{ORT_LABEL}, compiled features", ort_root, 1, 0, need, backend="onnxruntime",
                                   compile_features=True)
            cases.append(case)
        print(f"# compiled the features (and networks) of the quickstart sessions in {time.perf_counter() - t0:.1f} s",
              flush=True)
    if not a.no_100 and not a.quick:
        label = "quickstart ensemble (tft, dqn)"
        root = build_export(QUICKSTART, ["tft", "dqn"], tmp / "q100", 100, n_export, None)
        case, _ = session_case(label, root, 100, 0, need)
        cases.append(case)
        t0 = time.perf_counter()  # 1,000 symbols: ~0.1 s a bar, so a shorter export and feed (the budget caps samples)
        root = build_export(QUICKSTART, ["tft", "dqn"], tmp / "q1000", 1000, 600, None)
        case, _ = session_case(label, root, 1000, 0, 300 + a.repeats * int(a.budget / 0.05 + 10))
        cases.append(case)
        print(f"# built and warmed the 1,000-symbol session in {time.perf_counter() - t0:.1f} s", flush=True)
    forwards: list[Case] = []
    agent_nets: dict[str, tuple[Callable, tuple, str]] = {}
    for label, session in sessions.items():
        if "alone" not in label:
            continue
        member = session.model.member_names[0]
        step = next(c.step for c in cases if c.name == f"{label}, 1 sym")
        fn, args, rows, what = capture_forward(session, member, step)
        forwards.append(forward_case(f"{label}: {what}, one decision (batch 1)", fn, first_rows(args)))
        if rows > 1:
            forwards.append(forward_case(f"{label}: {what} as on_bar calls it ({rows} rows)", fn, args))
        if member in session.model.agent_names:
            agent_nets[label] = (fn, first_rows(args), what, member)
    for label in ("quickstart ensemble (tft, dqn)", COMPILED_LABEL):  # its TFT as on_bar calls it: eager, compiled
        if label in sessions:
            step = next(c.step for c in cases if c.name == f"{label}, 1 sym")
            fn, args, _, what = capture_forward(sessions[label], "tft", step)
            form = "compiled" if label == COMPILED_LABEL else "eager"
            forwards.append(forward_case(f"quickstart ensemble (tft, dqn): {what}, {form} inference form, one "
                                         "decision (batch 1)", fn, args))
    if ORT_LABEL in sessions:  # its DQN as the lean path runs it: the graph on IO-bound buffers (one decision: the
        # window with every held position), and the backend's module call beside it
        session = sessions[ORT_LABEL]
        next(c.step for c in cases if c.name == f"{ORT_LABEL}, 1 sym")()
        bound = next(b for k, b in session._bound.items() if k[0] == "dqn")
        net = bound.net
        window, position = torch.zeros(1, net.window, net.n_features), session._agent_constants("dqn")[3][:1]
        what = "BoundQGraph (its OrtQNetwork's graph, IO binding)"
        forwards.append(forward_case(f"{ORT_LABEL}: {what}, one decision ({bound.rows} rows: every held position)",
                                     bound, (window,)))
        forwards.append(forward_case(f"{ORT_LABEL}: OrtQNetwork.forward (the module call), batch 1", net,
                                     (window, position)))
        agent_nets[ORT_LABEL] = (lambda w, p: bound(w), (window, position), what, "dqn")
    run_interleaved(cases + forwards, a.repeats, a.samples, a.budget)
    print_table("(b) decisions: LiveSession.on_bar, bar in to every member's position out", cases, per_unit=True)
    print_table("(b) each member's network on one decision (torch.no_grad, eval), and as on_bar calls it", forwards)

    # (c) ------------------------------------------------------------------------------------------------------
    sb3_cases: list[Case] = []
    pairs: list[tuple[Case, Case]] = []
    for label, (fn, args, what, member) in agent_nets.items():
        agent = sessions[label].model.member(member)
        window, position = args  # [1, W, F] (or [1, W*F]) and [1, position features]
        obs_dim = int(window[0].numel() + position.shape[1])
        hidden = [int(x) for x in agent.hparams.hidden]
        algo = "ppo" if "ppo" in member else "dqn"
        twin = sb3_case(algo, obs_dim, len(agent.hparams.actions), hidden)
        one = "one decision, 3 rows" if label == ORT_LABEL else "batch 1"  # (every held position: greedy_table's)
        ours = forward_case(f"{label}: {what}, {one}", fn, args, "sb3")
        if twin is not None:
            sb3_cases += [ours, twin]
            pairs.append((ours, twin))
    if sb3_cases:
        run_interleaved(sb3_cases, a.repeats, a.samples, a.budget)
        print_table("(c) agent network vs Stable-Baselines3 predict on an equal MLP, batch 1", sb3_cases)

    # (d) ------------------------------------------------------------------------------------------------------
    quick_label = "quickstart ensemble (tft, dqn)"
    naive = naive_case(roots[quick_label], 512, 512 + a.repeats * a.samples + 64)
    live_again = next(c for c in cases if c.name == f"{quick_label}, 1 sym")
    again = Case("naive", f"{live_again.name}: LiveSession.on_bar (again, beside it)", live_again.step)
    run_interleaved([naive, again], a.repeats, min(a.samples, 100), a.budget)
    print_table("(d) the naive way: the whole trailing window recomputed per bar", [naive, again])

    # goals ------------------------------------------------------------------------------------------------------
    print("\n## Goals of issue 44\n")
    print("| goal | measured | target | verdict |")
    print("| --- | --- | --- | --- |")
    by = {c.name: stats(c) for c in feats + peers + cases + forwards + sb3_cases}
    feature_goals(feats, peers, max(histories), len(names), len(talib_names))
    q = by[f"{quick_label}, 1 sym"]
    print(goal("quickstart ensemble on_bar p99, 1 sym", f"{_us(q['p99'])} µs", "<= 2,000 µs", q["p99"] <= 2000))
    d = by[f"{quick_label}, 1 sym: decide_on alone"]
    print(goal("its decision alone (decide_on: on_bar less the features), p50 / p99", f"{_us(d['p50'])} / "
               f"{_us(d['p99'])} µs", "(the rest of the 2,000)", None))
    for label in (f"{quick_label}, compiled features", COMPILED_LABEL, f"{ORT_LABEL}, compiled features"):
        if f"{label}, 1 sym" in by:
            q = by[f"{label}, 1 sym"]
            print(goal(f"{label} on_bar p99, 1 sym", f"{_us(q['p99'])} µs", "<= 2,000 µs", q["p99"] <= 2000))
    if f"{ORT_LABEL}, 1 sym" in by:
        q, d = by[f"{ORT_LABEL}, 1 sym"], by[f"{ORT_LABEL}, 1 sym: decide_on alone"]
        print(goal("quickstart ensemble on_bar p99, 1 sym, backend onnxruntime", f"{_us(q['p99'])} µs", "<= 2,000 µs",
                   q["p99"] <= 2000))
        print(goal("its decision alone, backend onnxruntime, p50 / p99", f"{_us(d['p50'])} / {_us(d['p99'])} µs",
                   "(the rest of the 2,000)", None))
    # the agent-network goals are the quickstart ensemble's (issue 44: "Decision latency, quickstart ensemble");
    # ensemble.yaml's 3,907-input networks are printed beside them, outside the goal
    outside = "(outside the goal: the quickstart's networks)"
    for c in forwards:
        agent = any(k in c.name.partition(":")[2] for k in ("QNetwork", "Actor", "BoundQGraph", "OrtQNetwork"))
        if "one decision" in c.name and agent:  # as the session calls it
            inside = "quickstart" in c.name
            print(goal(f"agent network p50: {c.name}", f"{_us(by[c.name]['p50'])} µs",
                       "<= 20 µs" if inside else outside, by[c.name]["p50"] <= 20 if inside else None))
    for ours, twin in pairs:
        r = by[twin.name]["p50"] / by[ours.name]["p50"]
        inside = "quickstart" in ours.name
        print(goal(f"vs SB3 predict: {ours.name.split(':')[0]}", f"{r:.1f}x faster", ">= 5x" if inside else outside,
                   r >= 5 if inside else None))
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\n# load at end: {load}; wall {time.perf_counter() - started:.0f} s")
    return 0


# ---------------------------------------------------------------------------------------------------- (f) shadowing
# Issue 47: a champion with k = 0, 1, 2, 4 challengers of the same feature set on one stream (foxhunt.live.shadow:
# features stepped once, every model deciding, logging and booking), against one lone session's on_bar; and the
# promotion rule's check on k challengers' paired returns. Self-contained: `python scripts/bench_live.py --shadow`.
SHADOW_K = (0, 1, 2, 4)


def shadow_cases(root: Path, n_bars: int, state: Path) -> list[Case]:
    """One lone session and runners of k challengers (the quickstart export again: latency does not depend on the
    weights), each warmed past its warm-up on its own copy of one synthetic stream (1 symbol)."""
    import foxhunt.live
    from foxhunt.live.gate import BarGate
    from foxhunt.live.shadow import ShadowRunner

    lone = foxhunt.live.open(str(root))
    warm = lone.tail + lone.features.warmup + 8
    feed = _feed(1, n_bars, lone.horizon)
    for _ in range(warm):
        b = next(feed)
        lone.on_bar(b.symbols, b.ohlcv, b.timestamp, b.next_timestamps)

    def lone_step() -> None:
        b = next(feed)
        lone.on_bar(b.symbols, b.ohlcv, b.timestamp, b.next_timestamps)

    cases = [Case("shadow", "one session: LiveSession.on_bar", lone_step)]
    for k in SHADOW_K:
        runner = ShadowRunner(str(root), [str(root)] * k, state / f"k{k}" / "log", state / f"k{k}" / "log.state",
                              BarGate("drop"), None, None)
        runner.start()
        stream = _feed(1, n_bars, lone.horizon)
        for _ in range(warm):
            runner.on_bar(next(stream))

        def step(runner: ShadowRunner = runner, stream: Iterator[Any] = stream) -> None:
            runner.on_bar(next(stream))

        shared = len({id(m.session.features) for m in runner.models})
        cases.append(Case("shadow", f"champion + {k} challengers: ShadowRunner.on_bar", step, 1,
                          f"{k + 1} models, {shared} feature stream"))
    return cases


def rule_cases(bars: int) -> list[Case]:
    """PromotionRule.check on ``bars`` paired returns of k challengers (what each bar adds once past min_bars)."""
    from foxhunt.evaluation.promotion import PromotionRule

    rng = np.random.default_rng(0)
    champ = rng.normal(0, 1e-4, bars)
    out = []
    for method in ("fixed", "sequential"):
        rule = PromotionRule(min_bars=min(500, bars), method=method)
        for k in SHADOW_K[1:]:
            series = {f"c{i}": champ + rng.normal(0, 1e-4, bars) for i in range(k)}
            out.append(Case("rule", f"PromotionRule({method!r}).check, {k} challengers, {bars:,} bars",
                            lambda rule=rule, series=series: rule.check(champ, series)))
    return out


def shadow_main(argv: list[str] | None = None) -> int:
    """Section (f) alone: champion + k challengers per bar against k x one session's on_bar."""
    p = argparse.ArgumentParser(description="bench_live --shadow: the cost of shadowing k challengers (issue 47)")
    p.add_argument("--shadow", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--budget", type=float, default=1.5)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.samples, a.budget = min(a.repeats, 2), min(a.samples, 20), min(a.budget, 0.2)
    torch.set_num_threads(1)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_shadow_"))
    root = build_export(QUICKSTART, ["tft", "dqn"], tmp / "export", 1, 3000, None)
    n_bars = 600 + a.repeats * a.samples * 2 + 400
    cases = shadow_cases(root, n_bars, tmp)
    rules = rule_cases(2_000 if a.quick else 10_000)
    run_interleaved(cases, a.repeats, a.samples, a.budget)
    run_interleaved(rules, a.repeats, min(a.samples, 50), a.budget)
    print_table("(f) shadowing: quickstart ensemble (tft, dqn), 1 sym, per bar (gate, decisions, logs, books)", cases)
    print_table("(f) the promotion rule's check per bar", rules)
    by = {c.name: stats(c) for c in cases}
    one = by["one session: LiveSession.on_bar"]["p50"]
    base = by["champion + 0 challengers: ShadowRunner.on_bar"]["p50"]
    print("\n## Goal of issue 47\n")
    print("| goal | measured | target | verdict |")
    print("| --- | --- | --- | --- |")
    for k in SHADOW_K[1:]:
        extra = by[f"champion + {k} challengers: ShadowRunner.on_bar"]["p50"] - base
        print(goal(f"{k} challengers: added p50 per bar", f"{_us(extra)} µs ({extra / one:.2f} x one session)",
                   f"<= {k} x {_us(one)} µs", extra <= k * one))
    print(f"\n# wall {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(shadow_main(sys.argv[1:]) if "--shadow" in sys.argv[1:] else main())
