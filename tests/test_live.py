"""The live session trades exactly what the back-test traded: replayed bar by bar, saved and restored, from the CLI,
through bad bars and a kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from _export_helpers import small_export

import foxhunt
import foxhunt.live
from foxhunt.data.io import write_bars
from foxhunt.data.synthetic import generate_market
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.tft import TFTModule
from foxhunt.live.gate import BarGate
from foxhunt.live.log import read_decisions
from foxhunt.live.replay import replay

SYMBOLS = ["SYN0", "SYN1"]


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TFT (trading its median's sign: no interval to clear) and a DQN on two symbols, voted."""
    torch.manual_seed(0)
    members = {"tft": TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4, policy_interval=[0.5, 0.5]),
               "dqn": DQNModule(window=4, hidden=[16], n_envs=4, batch_size=8, learning_starts=8)}
    _, root = small_export(tmp_path_factory.mktemp("live") / "export", members, n_symbols=2, n_bars=600,
                           combine="vote", min_edge_confidence=None, cost_bps=0.0)
    return root


@pytest.fixture(scope="module")
def bars() -> pd.DataFrame:
    """New bars of both symbols (another seed than training's), their timestamps interleaved."""
    return generate_market(n_bars=160, n_symbols=2, seed=11, symbols=SYMBOLS).bars


def replayed(session: foxhunt.live.LiveSession, bars: pd.DataFrame, start: int = 0, stop: int | None = None) -> dict:
    """{(symbol, ns): positions} of the session over the timestamps [start, stop) of a replay."""
    out = {}
    for i, b in enumerate(replay(bars, session.horizon)):
        if i < start:
            continue
        if stop is not None and i >= stop:
            break
        d = session.on_bar(b.symbols, b.ohlcv, b.timestamp, b.next_timestamps)
        for j, s in enumerate(d.symbols):
            out[(s, d.timestamp)] = {k: float(v[j]) for k, v in d.positions.items()}
    return out


def backtest_rows(loaded: foxhunt.LoadedEnsemble, bars: pd.DataFrame, horizon: int) -> list[tuple[int, str, int]]:
    """(split row, symbol, ns) of every bar the back-test can decide: all but each symbol's last ``horizon``."""
    split = loaded.split(bars)
    sym, ts = split.symbol_index.tolist(), split.timestamps.tolist()
    return [(r, split.symbols[sym[r]], ts[r]) for r in range(len(split) - horizon) if sym[r + horizon] == sym[r]]


@pytest.fixture(scope="module")
def whole_replay(export: Path, bars: pd.DataFrame) -> dict:
    """The session's positions over the whole replay, uninterrupted."""
    return replayed(foxhunt.live.open(export), bars)


def test_a_replay_trades_exactly_what_the_backtest_traded(export: Path, bars: pd.DataFrame, whole_replay: dict) -> None:
    loaded = foxhunt.load(export)
    session = foxhunt.live.LiveSession(loaded)
    live = whole_replay
    ref = loaded.positions(bars)
    rows = backtest_rows(loaded, bars, session.horizon)
    for name in ("tft", "dqn", "ensemble"):
        theirs = np.array([ref[name][r].item() for r, _, _ in rows])
        ours = np.array([live[(s, t)][name] for _, s, t in rows])
        assert (theirs != 0).sum() > 20, f"{name} barely trades: the comparison would prove little"
        assert np.array_equal(ours, theirs), f"{name}: {(ours != theirs).sum()} of {len(rows)} positions differ"


def test_a_restored_session_continues_exactly(export: Path, bars: pd.DataFrame, whole_replay: dict,
                                             tmp_path: Path) -> None:
    whole = whole_replay
    first = foxhunt.live.open(export)
    replayed(first, bars, stop=137)
    first.save(tmp_path / "state")
    second = foxhunt.live.open(export)
    second.restore(tmp_path / "state")
    rest = replayed(second, bars, start=137)
    assert rest and all(whole[k] == v for k, v in rest.items())


def test_a_state_of_another_export_or_a_corrupt_one_is_refused(export: Path, tmp_path: Path) -> None:
    session = foxhunt.live.open(export)
    session.save(tmp_path / "state")
    blob = (tmp_path / "state" / "state.safetensors").read_bytes()
    (tmp_path / "state" / "state.safetensors").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(ValueError, match="SHA-256 differs"):
        session.restore(tmp_path / "state")
    session.save(tmp_path / "other")
    meta = (tmp_path / "other" / "state.json").read_text().replace(session.export_digest, "0" * 64)
    (tmp_path / "other" / "state.json").write_text(meta)
    with pytest.raises(ValueError, match="another export"):
        session.restore(tmp_path / "other")


def test_a_symbol_the_model_never_saw_is_refused_in_one_line(export: Path) -> None:
    session = foxhunt.live.open(export)
    with pytest.raises(ValueError) as info:
        session.on_bar(["XYZ"], torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]]), 0)
    assert "XYZ" in str(info.value) and "SYN0" in str(info.value) and "\n" not in str(info.value)


def test_bad_bars_are_dropped_or_repaired_with_one_line_each_and_counted(bars: pd.DataFrame) -> None:
    one = bars[bars["symbol"] == "SYN0"].reset_index(drop=True)
    history = (torch.tensor(pd.DatetimeIndex(one["timestamp"][:50]).as_unit("ns").asi8),
               torch.tensor(one[["open", "high", "low", "close", "volume"]][:50].to_numpy()))
    good = torch.tensor(one[["open", "high", "low", "close", "volume"]].iloc[50].to_numpy())[None]
    when = int(pd.Timestamp(one["timestamp"][50]).value)
    cases = {"below max(open, close)": good * torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0]),
             "jumped": good * torch.tensor([1.0, 80.0, 1.0, 80.0, 1.0]),
             "non-finite": good * torch.tensor([1.0, 1.0, 1.0, float("nan"), 1.0])}
    gate = BarGate("drop")
    for reason, bar in cases.items():
        names, kept, _ = gate.admit(["SYN0"], bar, when, {"SYN0": history})
        assert names == [] and kept.shape == (0, 5)
        (line,) = gate.take_messages()
        assert "SYN0" in line and reason in line and "dropped" in line
    names, _, _ = gate.admit(["SYN0"], good, int(history[0][-1]), {"SYN0": history})  # a duplicate time
    assert names == [] and "duplicate" in gate.take_messages()[0]
    assert gate.counts["dropped"] == 4
    names, kept, _ = gate.admit(["SYN0"], good, when, {"SYN0": history})
    assert names == ["SYN0"] and torch.equal(kept, good) and gate.take_messages() == []
    with pytest.raises(ValueError, match="below max"):
        BarGate("raise").admit(["SYN0"], cases["below max(open, close)"], when, {"SYN0": history})


def _cli(export: Path, data: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "foxhunt.live", "--checkpoint", str(export), "--replay", str(data),
           "--decisions", str(out), "--flush-every", "7", "--status-every", "0", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stdin_cli(export: Path, out: Path) -> subprocess.Popen:
    """The CLI reading CSV bars on stdin (it waits for more, so a test decides where in the stream it stops)."""
    cmd = [sys.executable, "-m", "foxhunt.live", "--checkpoint", str(export), "--source", "stdin",
           "--decisions", str(out), "--flush-every", "7", "--status-every", "0"]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_kill_9_restart_of_the_cli_decides_as_an_uninterrupted_run(dqn_export: Path, bars: pd.DataFrame,
                                                                    tmp_path: Path) -> None:
    """Killed mid-stream (it is waiting for bars it has not been given, so the kill cannot come after the end), then
    restarted on the whole stream: the log equals an uninterrupted run's and the back-test's positions."""
    frame = bars.sort_values(["timestamp", "symbol"])[["timestamp", "symbol", "open", "high", "low", "close", "volume"]]
    lines = frame.to_csv(index=False).splitlines(keepends=True)
    whole = _stdin_cli(dqn_export, tmp_path / "whole")
    whole.communicate("".join(lines), timeout=600)
    assert whole.returncode == 0
    killed = _stdin_cli(dqn_export, tmp_path / "killed")
    killed.stdin.write("".join(lines[: len(lines) * 2 // 3]))
    killed.stdin.flush()
    deadline = time.time() + 600  # only bounds a broken run: the kill waits for a part, never for a time
    while not list((tmp_path / "killed").glob("part-000003.parquet")) and killed.poll() is None \
            and time.time() < deadline:
        time.sleep(0.05)
    assert killed.poll() is None, killed.stderr.read()  # still waiting for bars: killed mid-stream
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    restarted = _stdin_cli(dqn_export, tmp_path / "killed")
    _, err = restarted.communicate("".join(lines), timeout=600)
    assert restarted.returncode == 0, err
    a, b = read_decisions(tmp_path / "whole"), read_decisions(tmp_path / "killed")
    assert len(a) == len(bars)
    pd.testing.assert_frame_equal(a.drop(columns="latency_us"), b.drop(columns="latency_us"))
    loaded = foxhunt.load(dqn_export)
    ref = loaded.positions(bars)
    keyed = a.set_index(["symbol", "ts_event"])
    rows = backtest_rows(loaded, bars, 1)
    for name in ("dqn", "ensemble"):
        ours = np.array([keyed.loc[(s, t), name] for _, s, t in rows])
        theirs = np.array([ref[name][r].item() for r, _, _ in rows])
        assert (theirs != 0).sum() > 20 and np.array_equal(ours, theirs)


@pytest.mark.slow
def test_sigterm_flushes_the_log_and_saves_the_state(export: Path, bars: pd.DataFrame, tmp_path: Path) -> None:
    data = tmp_path / "bars.parquet"
    write_bars(bars, data)
    proc = _cli(export, data, tmp_path / "log")
    deadline = time.time() + 120
    while not list((tmp_path / "log").glob("part-000001.parquet")) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait() == 0
    logged = read_decisions(tmp_path / "log")
    import json

    saved = json.loads((tmp_path / "log.state" / "state.json").read_text())
    assert saved["last_timestamp"] == int(logged["ts_event"].max()) and saved["parts"] >= 2


KINDS = {
    "mamba2": lambda: {"mamba2": __import__("foxhunt.lit.mamba2", fromlist=["Mamba2Module"]).Mamba2Module(
        d_model=16, n_layers=1, d_state=8, headdim=8, native=False, policy_interval=[0.5, 0.5])},
    "ppo_discrete": lambda: {"ppo": __import__("foxhunt.lit.ppo", fromlist=["PPOModule"]).PPOModule(
        window=4, hidden=[16], n_envs=4)},
    "ppo_continuous": lambda: {"ppo": __import__("foxhunt.lit.ppo", fromlist=["PPOModule"]).PPOModule(
        window=4, hidden=[16], n_envs=4, action_space="continuous", no_trade_band=0.0)},
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_member_kind_replays_as_its_backtest(kind: str, bars: pd.DataFrame, tmp_path: Path) -> None:
    torch.manual_seed(1)
    _, root = small_export(tmp_path / "export", KINDS[kind](), n_symbols=2, n_bars=600, combine="vote",
                           min_edge_confidence=None, cost_bps=0.0)
    _assert_parity(root, bars, continuous=kind == "ppo_continuous")


@pytest.mark.slow
def test_a_four_member_stacked_coordinator_replays_as_its_backtest(bars: pd.DataFrame, tmp_path: Path) -> None:
    """ensemble.yaml's four kinds under ``combine: stack`` (the agents read the forecasters' snapshots)."""
    from foxhunt.lit.mamba2 import Mamba2Module
    from foxhunt.lit.ppo import PPOModule

    torch.manual_seed(2)
    members = {"tft": TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4, policy_interval=[0.5, 0.5]),
               "mamba2": Mamba2Module(d_model=16, n_layers=1, d_state=8, headdim=8, native=False,
                                      policy_interval=[0.5, 0.5]),
               "dqn": DQNModule(window=4, hidden=[16], n_envs=4, batch_size=8, learning_starts=8),
               "ppo": PPOModule(window=4, hidden=[16], n_envs=4)}

    def snapshots(model) -> None:
        for name in model.forecaster_names:
            model.snapshots[name].load_state_dict(model.member(name).network.state_dict())
        model.stack_std.fill_(1e-4)  # untrained forecasts are tiny: standardise them to a visible scale
        model._snapshots_loaded = True

    _, root = small_export(tmp_path / "export", members, n_symbols=2, n_bars=600, combine="stack",
                           min_edge_confidence=None, cost_bps=0.0, prepare=snapshots)
    loaded = foxhunt.load(root)
    assert loaded.model.stack_ready
    _assert_parity(root, bars)


def _assert_parity(root: Path, bars: pd.DataFrame, continuous: bool = False) -> None:
    loaded = foxhunt.load(root)
    session = foxhunt.live.LiveSession(loaded)
    live = replayed(session, bars)
    ref = loaded.positions(bars)
    rows = backtest_rows(loaded, bars, session.horizon)
    traded = 0
    for name in [*loaded.model.member_names, "ensemble"]:
        theirs = np.array([ref[name][r].item() for r, _, _ in rows])
        ours = np.array([live[(s, t)][name] for _, s, t in rows])
        traded += int((theirs != 0).sum() > 20)
        if continuous and name != "ensemble":
            np.testing.assert_allclose(ours, theirs, atol=1e-6, err_msg=name)
        else:
            assert np.array_equal(ours, theirs), f"{name}: {(ours != theirs).sum()} of {len(rows)} positions differ"
    assert traded >= 1, "nothing trades: the comparison would prove little"


@pytest.fixture(scope="module")
def dqn_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DQN alone on two symbols, with costs (it decides at every decision bar, so every bar's P&L is comparable)."""
    torch.manual_seed(3)
    members = {"dqn": DQNModule(window=4, hidden=[16], n_envs=4, batch_size=8, learning_starts=8)}
    _, root = small_export(tmp_path_factory.mktemp("live_dqn") / "export", members, n_symbols=2, n_bars=600,
                           combine="vote", min_edge_confidence=None, cost_bps=2.0)
    return root


def test_the_logs_after_cost_pnl_is_the_backtests(dqn_export: Path, bars: pd.DataFrame, tmp_path: Path) -> None:
    from foxhunt.live.run import main
    from foxhunt.live.score import score_decisions

    data = tmp_path / "bars.csv"
    write_bars(bars, data)
    threads = torch.get_num_threads()
    assert main(["--checkpoint", str(dqn_export), "--replay", str(data), "--decisions", str(tmp_path / "log"),
                 "--status-every", "0", "--torch-threads", str(threads)]) == 0
    log = read_decisions(tmp_path / "log")
    loaded = foxhunt.load(dqn_export)
    theirs = loaded.backtest(bars)
    ours = score_decisions(log, bars, cost_bps=2.0, significance=False)
    assert theirs["dqn"]["n_trades"] > 10
    for who in ("dqn", "ensemble", "buy_and_hold"):
        assert ours[who]["total_log_return"] == pytest.approx(theirs[who]["total_log_return"], abs=1e-9)
        assert ours[who]["sharpe"] == pytest.approx(theirs[who]["sharpe"], abs=1e-9)
    from foxhunt.backtest import main as backtest

    table = backtest(["--decisions", str(tmp_path / "log"), "--data", str(data), "--cost-bps", "2"])
    assert table["dqn"]["total_log_return"] == pytest.approx(theirs["dqn"]["total_log_return"], abs=1e-9)


def test_a_csv_feed_on_stdin_trades_as_the_replay(dqn_export: Path, bars: pd.DataFrame, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from foxhunt.live.run import main

    csv = io.StringIO()
    frame = bars.sort_values(["timestamp", "symbol"])
    frame[["timestamp", "symbol", "open", "high", "low", "close", "volume"]].to_csv(csv, index=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO(csv.getvalue()))
    threads = str(torch.get_num_threads())
    assert main(["--checkpoint", str(dqn_export), "--source", "stdin", "--decisions", str(tmp_path / "stdin"),
                 "--status-every", "0", "--torch-threads", threads]) == 0
    data = tmp_path / "bars.parquet"
    write_bars(bars, data)
    assert main(["--checkpoint", str(dqn_export), "--replay", str(data), "--decisions", str(tmp_path / "replay"),
                 "--status-every", "0", "--torch-threads", threads]) == 0
    a, b = read_decisions(tmp_path / "stdin"), read_decisions(tmp_path / "replay")
    pd.testing.assert_frame_equal(a.drop(columns="latency_us"), b.drop(columns="latency_us"))


def test_logged_features_are_the_backtests_normalised_features(dqn_export: Path, bars: pd.DataFrame,
                                                               tmp_path: Path) -> None:
    from foxhunt.live.run import main

    data = tmp_path / "bars.parquet"
    write_bars(bars, data)
    assert main(["--checkpoint", str(dqn_export), "--replay", str(data), "--decisions", str(tmp_path / "log"),
                 "--status-every", "0", "--log-features", "--torch-threads", str(torch.get_num_threads())]) == 0
    log = read_decisions(tmp_path / "log").set_index(["symbol", "ts_event"])
    loaded = foxhunt.load(dqn_export)
    split = loaded.split(bars)
    rows = [(split.symbols[int(s)], int(t)) for s, t in zip(split.symbol_index, split.timestamps, strict=True)]
    logged = log.loc[rows, [f"feature.{f}" for f in loaded.feature_names]].to_numpy(np.float32)
    ready = split.valid.numpy()
    assert ready.sum() > 100
    np.testing.assert_array_equal(np.nan_to_num(logged[ready]), split.features.numpy()[ready])


def test_a_session_warmed_from_history_decides_as_one_that_saw_it_live(dqn_export: Path, bars: pd.DataFrame,
                                                                       tmp_path: Path) -> None:
    from foxhunt.live.run import main

    ts = pd.DatetimeIndex(bars["timestamp"])
    cut = ts.sort_values()[len(ts) // 2]
    write_bars(bars, tmp_path / "all.parquet")
    write_bars(bars[ts < cut].reset_index(drop=True), tmp_path / "history.parquet")
    write_bars(bars[ts >= cut].reset_index(drop=True), tmp_path / "later.parquet")
    threads = str(torch.get_num_threads())
    common = ["--checkpoint", str(dqn_export), "--status-every", "0", "--torch-threads", threads]
    assert main([*common, "--replay", str(tmp_path / "all.parquet"), "--decisions", str(tmp_path / "whole")]) == 0
    assert main([*common, "--warmup", str(tmp_path / "history.parquet"), "--replay", str(tmp_path / "later.parquet"),
                 "--decisions", str(tmp_path / "warmed")]) == 0
    whole, warmed = read_decisions(tmp_path / "whole"), read_decisions(tmp_path / "warmed")
    later = whole[whole["ts_event"] >= cut.value].reset_index(drop=True)
    assert len(warmed) == len(later) > 100 and warmed["ready"].all()
    pd.testing.assert_frame_equal(warmed.drop(columns="latency_us"), later.drop(columns="latency_us"))


def assert_fast_trades_as_plain(fast: foxhunt.live.LiveSession, plain: foxhunt.live.LiveSession,
                                bars: pd.DataFrame) -> dict:
    """Replay ``bars`` through both sessions: the same positions on every bar, the lean path deciding most timestamps
    (once the tails were full: > 100) and the same state after; the positions."""
    lean_calls = []
    lean = fast._decide_lean
    fast._decide_lean = lambda *a: lean_calls.append(1) or lean(*a)  # type: ignore[method-assign]
    got, want = replayed(fast, bars), replayed(plain, bars)
    assert got == want and len(lean_calls) > 100
    mine, theirs = fast.state_dict(), plain.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    return got


def test_the_fast_and_plain_decision_paths_decide_alike(export: Path, bars: pd.DataFrame, whole_replay: dict) -> None:
    """``fast`` (the networks' inference forms and, once a symbol's tail is full, the lean decision read from the
    tails) against the plain path (a split of the tails through the members' own code, the networks' own forwards):
    the same positions on every bar of the replay, warm-up included, and the same state after it."""
    fast, plain = foxhunt.live.open(export), foxhunt.live.open(export, fast=False)
    assert assert_fast_trades_as_plain(fast, plain, bars) == whole_replay


def test_the_lean_path_decides_with_onnx_runtime_networks_as_the_plain_path(export: Path, bars: pd.DataFrame,
                                                                              tmp_path: Path) -> None:
    """With ``backend="onnxruntime"`` (the members' networks swapped for ONNX Runtime sessions) the fast session still
    takes the lean decision and trades what the plain path trades with the same graphs, on every bar, state included."""
    pytest.importorskip("onnxruntime", reason="the serve extra is not installed (pip install -e '.[serve]')")
    import shutil

    from foxhunt.export.onnx import write_onnx
    from foxhunt.live.backend import OrtQNetwork

    root = shutil.copytree(export, tmp_path / "export")
    write_onnx(root)
    fast = foxhunt.live.open(str(root), backend="onnxruntime")
    plain = foxhunt.live.open(str(root), backend="onnxruntime", fast=False)
    assert isinstance(fast.model.agent("dqn").policy_network, OrtQNetwork)
    got = assert_fast_trades_as_plain(fast, plain, bars)
    assert sum(p["dqn"] != 0 for p in got.values()) > 20  # the agent trades: the check proves something


def test_a_discrete_ppo_takes_the_lean_path_and_trades_as_the_plain_one(bars: pd.DataFrame, tmp_path: Path) -> None:
    """A discrete PPO agent (its actor's inference form, on the lean path once its tail is full) trades what the plain
    path trades on every bar, state included."""
    from foxhunt.lit.ppo import PPOModule

    torch.manual_seed(0)
    _, root = small_export(tmp_path / "export", {"ppo": PPOModule(window=4, hidden=[16])}, n_symbols=2, n_bars=600,
                           combine="vote", min_edge_confidence=None, cost_bps=0.0)
    fast, plain = foxhunt.live.open(root), foxhunt.live.open(root, fast=False)
    got = assert_fast_trades_as_plain(fast, plain, bars)
    assert sum(p["ppo"] != 0 for p in got.values()) > 20  # the agent trades: the check proves something


def test_known_future_inputs_kept_by_timestamp_are_the_computed_ones(export: Path) -> None:
    """The fast path's known-future inputs, kept by timestamp (computed ahead at the latest spacing, dropped past
    4,096), equal the scheduled rows computed afresh, on a regular and an irregular schedule."""
    session = foxhunt.live.open(export)
    session.spacing.fill_(3_600 * 10**9)
    cols = [session.feature_names.index(k) for k in session.known_future]
    rng = np.random.default_rng(0)
    start = 1_700_000_000 * 10**9
    for i in range(300):  # regular for 150 bars, then gaps of 1-30 hours: misses, refills, one reset of the store
        ts = start + i * 3_600 * 10**9 if i < 150 else start + int(rng.integers(1, 30)) * 3_600 * 10**9
        start = ts if i >= 150 else start
        nxt = torch.tensor([[ts + h * 3_600 * 10**9 for h in (1, 2)], [ts + h * 7_200 * 10**9 for h in (1, 2)]])
        want = torch.nan_to_num(session._future_rows(nxt)[:, :, cols], nan=0.0)
        assert torch.equal(session._known_future_inputs(nxt), want)
    assert len(session._future_index) <= 4096


@pytest.mark.slow
def test_a_session_with_compiled_networks_trades_as_the_eager_one(export: Path, bars: pd.DataFrame) -> None:
    """``compile_networks=True`` (the TFT's inference form compiled for a bar of every symbol): the lean decisions run
    the compiled graph, and the positions are the eager session's on every bar."""
    compiled = foxhunt.live.open(export, compile_networks=True)
    form = compiled.model.forecaster("tft").network.inference_form()
    assert form.compiled_rows == 2
    calls = []
    graph = form._compiled
    form._compiled = lambda *a: calls.append(1) or graph(*a)
    got, want = replayed(compiled, bars), replayed(foxhunt.live.open(export), bars)
    assert len(calls) > 50, len(calls)  # the compiled graph decided most bars
    assert got == want
    assert sum(p["tft"] != 0 for p in got.values()) > 20  # the TFT trades: the check proves something


@pytest.mark.slow
def test_the_cli_with_compile_networks_logs_the_eager_runs_decisions(export: Path, bars: pd.DataFrame,
                                                                     tmp_path: Path) -> None:
    from foxhunt.live.run import main

    data = tmp_path / "bars.csv"
    write_bars(bars, data)
    logs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile-networks"])):
        assert main(["--checkpoint", str(export), "--replay", str(data), "--decisions", str(tmp_path / name),
                     "--status-every", "0", *extra]) == 0
        logs[name] = read_decisions(tmp_path / name)
    cols = ["ts_event", "symbol", "tft", "dqn", "ensemble", "ready"]
    pd.testing.assert_frame_equal(logs["compiled"][cols], logs["eager"][cols])
    assert (logs["compiled"]["tft"] != 0).sum() > 20
    assert main(["--checkpoint", str(export), "--replay", str(data), "--decisions", str(tmp_path / "ort"),
                 "--backend", "onnxruntime", "--compile-networks"]) == 2  # refused in one line


def test_compile_networks_is_refused_where_no_network_would_run_compiled(export: Path) -> None:
    with pytest.raises(ValueError, match="compile_networks compiles the TFT forecasters of the lean decision"):
        foxhunt.live.open(export, fast=False, compile_networks=True)


@pytest.mark.slow
def test_a_session_with_compiled_features_trades_as_the_eager_one(export: Path) -> None:
    """``compile_features=True`` (FeatureStream's steady bars through torch.compile, compiled at the session's start):
    on a replay long enough for most bars to be steady, the same positions on every bar and the same feature state."""
    long_bars = generate_market(n_bars=420, n_symbols=2, seed=11, symbols=SYMBOLS).bars
    compiled, eager = foxhunt.live.open(export, compile_features=True), foxhunt.live.open(export)
    assert compiled.features.compiled and not eager.features.compiled
    steady = []
    step = compiled.features._steady_step
    compiled.features._steady_step = lambda *a: steady.append(1) or step(*a)  # type: ignore[method-assign]
    got, want = replayed(compiled, long_bars), replayed(eager, long_bars)
    assert len(steady) > 100, len(steady)  # the compiled graph stepped most bars
    assert got == want
    assert sum(p["ensemble"] != 0 for p in got.values()) > 20  # it trades: the check proves something
    mine, theirs = compiled.features.state_dict(), eager.features.state_dict()
    assert all(torch.allclose(mine[k].double().nan_to_num(1e300), theirs[k].double().nan_to_num(1e300), rtol=1e-12,
                              atol=1e-12) for k in theirs)
