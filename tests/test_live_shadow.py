"""Champion and challengers on one stream: a worse champion is replaced, a better one kept, twins never promote; a
challenger logs what it would have traded alone; the registry attributes every bar; a restart continues exactly; a
failed or killed retrain leaves the session untouched."""

from __future__ import annotations

import json
import math
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
from foxhunt.data.io import write_bars
from foxhunt.data.synthetic import generate_market
from foxhunt.evaluation.backtest import policy_pnl
from foxhunt.evaluation.promotion import PromotionRule
from foxhunt.lit.dqn import DQNModule
from foxhunt.live.gate import BarGate
from foxhunt.live.log import read_decisions
from foxhunt.live.registry import Registry, read_registry, traded_by
from foxhunt.live.replay import replay
from foxhunt.live.retrain import Retrainer, parse_every
from foxhunt.live.shadow import ShadowRunner

SYMBOLS = ["SYN0", "SYN1"]
COST_BPS = 0.1


def momentum(sign: float):
    """A DQN set by hand to hold sign * the sign of the last bar's return (the market's AR(1) signal makes +1 earn and
    -1 lose): long Q = sign (h0 - h1), short Q = -long Q, flat a hair above 0, with h = relu(±logret_1)."""

    def prepare(model) -> None:
        agent = model.agent("dqn")
        net = agent.q_net
        lin, head = net.body[0][0], net.head
        i = (agent.hparams.window - 1) * net.n_features  # the window's last bar, logret_1 (the first feature)
        with torch.no_grad():
            for p in (lin.weight, lin.bias, head.weight, head.bias):
                p.zero_()
            lin.weight[0, i], lin.weight[1, i] = 1.0, -1.0
            head.weight[2] = torch.tensor([sign, -sign])
            head.weight[0] = torch.tensor([-sign, sign])
            head.bias[1] = 1e-4

    return prepare


def _export(root: Path, sign: float, seed: int = 0, **data) -> Path:
    members = {"dqn": DQNModule(window=4, hidden=[2], layer_norm=False, n_envs=4, batch_size=8, learning_starts=8)}
    _, path = small_export(root, members, n_symbols=2, n_bars=300, seed=seed, combine="vote",
                           min_edge_confidence=None, cost_bps=COST_BPS, prepare=momentum(sign), **data)
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """better (momentum), worse (its mirror), twin (the better's weights again, another export directory) and other
    (the better's rule on another feature set: it steps its own features)."""
    root = tmp_path_factory.mktemp("shadow")
    return {"better": _export(root / "better", 1.0), "worse": _export(root / "worse", -1.0),
            "twin": _export(root / "twin", 1.0),
            "other": _export(root / "other", 1.0, features=("logret_1", "std_logret_20"), known_future=())}


@pytest.fixture(scope="module")
def bars() -> pd.DataFrame:
    """A replay with a strong momentum signal, two symbols on one calendar."""
    return generate_market(n_bars=300, n_symbols=2, seed=11, signal_strength=0.3, symbols=SYMBOLS).bars


def _runner(tmp: Path, champion: Path, challengers: list[Path], rule: PromotionRule | None = None,
            retrainer: Retrainer | None = None) -> ShadowRunner:
    return ShadowRunner(str(champion), [str(c) for c in challengers], tmp / "log", tmp / "log.state", BarGate("drop"),
                        rule, Registry(tmp / "registry.jsonl"), retrainer=retrainer)


def _run(runner: ShadowRunner, bars: pd.DataFrame, start: int = 0, stop: int | None = None,
         begin: bool = True) -> list[str]:
    """Replay the timestamps [start, stop) of ``bars`` through the runner (``begin``: start or resume it first), then
    save; its lines."""
    if begin:
        runner.start()
    lines = []
    for i, b in enumerate(replay(bars, 2)):
        if i < start:
            continue
        if stop is not None and i >= stop:
            break
        runner.on_bar(b)
        lines += runner.messages
        runner.messages.clear()
    runner.save()
    return lines


RULES = {"fixed": PromotionRule(min_bars=100, alpha=0.05, method="fixed"),
         "sequential": PromotionRule(min_bars=60, alpha=0.05, method="sequential")}


@pytest.mark.parametrize("method", sorted(RULES))
def test_the_worse_champion_is_replaced_the_better_kept_and_twins_never_promote(
        exports: dict[str, Path], bars: pd.DataFrame, tmp_path: Path, method: str) -> None:
    rule = RULES[method]
    outcomes = {}
    for case, (champ, chall) in {"worse champion": ("worse", "better"), "better champion": ("better", "worse"),
                                 "twins": ("better", "twin")}.items():
        runner = _runner(tmp_path / case, exports[champ], [exports[chall]], rule)
        _run(runner, bars)
        records = read_registry(tmp_path / case / "registry.jsonl")
        outcomes[case] = ([r["event"] for r in records], runner.champion.path)
        if case == "worse champion":
            (promo,) = [r for r in records if r["event"] == "promotion"]
            assert promo["model"] == "model1" and promo["export"] == str(exports["better"])
            assert promo["evidence"]["method"] == method and promo["bars"] >= rule.min_bars
            assert promo["sha256"] == foxhunt.live.open(exports["better"]).export_digest
    assert outcomes["worse champion"] == (["start", "challenger", "promotion", "retirement"], str(exports["better"]))
    assert outcomes["better champion"] == (["start", "challenger", "retirement"], str(exports["better"]))
    assert outcomes["twins"][1] == str(exports["better"]) and "promotion" not in outcomes["twins"][0]


def test_a_challenger_logs_what_it_would_have_traded_alone(exports: dict[str, Path], bars: pd.DataFrame,
                                                          tmp_path: Path) -> None:
    """Shadowed (sharing the champion's features), its log equals a lone session's, its scored P&L the back-test's,
    and the per-bar returns the rule read are the back-test's book returns."""
    from foxhunt.live.run import main
    from foxhunt.live.score import score_decisions

    runner = _runner(tmp_path / "shadow", exports["worse"], [exports["better"], exports["twin"], exports["other"]])
    _run(runner, bars)  # no rule: no verdict
    streams = [id(m.session.features) for m in runner.models]
    assert len(set(streams[:3])) == 1 and streams[3] != streams[0], "one stream per feature set"
    data = tmp_path / "bars.parquet"
    write_bars(bars, data)
    for label, name in (("model1", "better"), ("model3", "other")):
        assert main(["--checkpoint", str(exports[name]), "--replay", str(data), "--decisions",
                     str(tmp_path / f"alone-{name}"), "--status-every", "0"]) == 0
        alone = read_decisions(tmp_path / f"alone-{name}")
        shadowed = read_decisions(tmp_path / "shadow" / "log.models" / label)
        pd.testing.assert_frame_equal(shadowed.drop(columns="latency_us"), alone.drop(columns="latency_us"))
    shadowed = read_decisions(tmp_path / "shadow" / "log.models" / "model1")
    loaded = foxhunt.load(exports["better"])
    theirs = loaded.backtest(bars)
    ours = score_decisions(shadowed, bars, cost_bps=COST_BPS, significance=False)
    assert theirs["dqn"]["n_trades"] > 50
    for who in ("dqn", "ensemble"):
        assert ours[who]["total_log_return"] == pytest.approx(theirs[who]["total_log_return"], abs=1e-9)
        assert ours[who]["sharpe"] == pytest.approx(theirs[who]["sharpe"], abs=1e-9)
    split = loaded.split(bars)
    book = policy_pnl(loaded.positions(bars)["ensemble"], split, COST_BPS).numpy()
    evidence = next(m for m in runner.models if m.label == "model1").evidence.values
    assert evidence.size == book.size  # every stamp the book counts is realised at the bar after it
    np.testing.assert_allclose(evidence[:-1], book[:-1], rtol=0, atol=1e-10)  # (the split's returns are float32)
    assert book[-1] < evidence[-1]  # the book pays the exit at the file's end, which a stream cannot know of
    traded = read_decisions(tmp_path / "shadow" / "log")
    champion = read_decisions(tmp_path / "shadow" / "log.models" / "model0")
    assert np.array_equal(traded["ensemble"].to_numpy(), champion["ensemble"].to_numpy())


def test_the_registry_attributes_every_traded_bar_to_the_model_that_produced_it(
        exports: dict[str, Path], bars: pd.DataFrame, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from foxhunt.live.run import main

    runner = _runner(tmp_path, exports["worse"], [exports["better"]], RULES["fixed"])
    _run(runner, bars)
    records = read_registry(tmp_path / "registry.jsonl")
    traded = read_decisions(tmp_path / "log")
    who = traded_by(records, traded["ts_event"].tolist())
    assert set(who) == {"model0", "model1"}
    logs = {m: read_decisions(tmp_path / "log.models" / m).set_index(["symbol", "ts_event"]) for m in set(who)}
    produced = [logs[m].loc[(s, t), "ensemble"] for m, s, t in zip(who, traded["symbol"], traded["ts_event"],
                                                                      strict=True)]
    assert np.array_equal(traded["ensemble"].to_numpy(), np.array(produced))
    promo = next(r for r in records if r["event"] == "promotion")
    assert (traded["ts_event"] > promo["at"]).sum() > 50  # the promoted model traded the bars after its promotion
    assert main(["--registry", str(tmp_path / "registry.jsonl"), "--show"]) == 0
    out = capsys.readouterr().out
    assert "promotion" in out and "retirement" in out and promo["sha256"][:12] in out


@pytest.mark.parametrize("cut", [60, 200])
def test_a_restored_run_continues_exactly(exports: dict[str, Path], bars: pd.DataFrame, tmp_path: Path,
                                          cut: int) -> None:
    """Saved before (60) or after (200) the promotion, restored into a fresh runner: the logs, the registry and the
    rule's evidence equal an uninterrupted run's."""
    whole = _runner(tmp_path / "whole", exports["worse"], [exports["better"], exports["twin"]], RULES["sequential"])
    _run(whole, bars)
    first = _runner(tmp_path / "cut", exports["worse"], [exports["better"], exports["twin"]], RULES["sequential"])
    _run(first, bars, stop=cut)
    second = _runner(tmp_path / "cut", exports["worse"], [exports["better"], exports["twin"]], RULES["sequential"])
    _run(second, bars, start=cut)
    for log in ("log", "log.models/model0", "log.models/model1", "log.models/model2"):
        a, b = read_decisions(tmp_path / "whole" / log), read_decisions(tmp_path / "cut" / log)
        pd.testing.assert_frame_equal(a.drop(columns="latency_us"), b.drop(columns="latency_us"))

    def events(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "time"} for r in read_registry(path) if r["event"] != "resume"]

    assert events(tmp_path / "whole" / "registry.jsonl") == events(tmp_path / "cut" / "registry.jsonl")
    assert any(r["event"] == "promotion" for r in events(tmp_path / "whole" / "registry.jsonl"))
    assert [m.label for m in whole.models] == [m.label for m in second.models]
    for a, b in zip(whole.models, second.models, strict=True):
        np.testing.assert_array_equal(a.evidence.values, b.evidence.values)


def test_the_cli_shadows_challengers_and_refuses_one_of_other_symbols_in_one_line(
        exports: dict[str, Path], bars: pd.DataFrame, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from foxhunt.live.run import main

    data = tmp_path / "bars.csv"
    write_bars(bars, data)
    args = ["--checkpoint", str(exports["worse"]), "--challenger", str(exports["better"]), "--replay", str(data),
            "--decisions", str(tmp_path / "log"), "--status-every", "0", "--promotion-min-bars", "100",
            "--promotion-method", "fixed"]
    assert main(args) == 0
    records = read_registry(tmp_path / "log.registry.jsonl")
    assert records[0]["rule"] == {"min_bars": 100, "alpha": 0.05, "method": "fixed", "horizon": None, "spending": "none"}
    assert [r["event"] for r in records] == ["start", "challenger", "promotion", "retirement"]
    assert "promoted over model0" in capsys.readouterr().err
    torch.manual_seed(0)
    members = {"dqn": DQNModule(window=4, hidden=[2], layer_norm=False, n_envs=4, batch_size=8, learning_starts=8)}
    _, one = small_export(tmp_path / "one", members, n_symbols=1, n_bars=300, combine="vote", min_edge_confidence=None,
                          cost_bps=COST_BPS)
    assert main([*args[:2], "--challenger", str(one), *args[4:6], "--decisions", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(one) in err and "champion's symbols" in err


def test_retrain_every_reads_bars_or_a_duration() -> None:
    assert parse_every("500") == (500, None)
    assert parse_every("30d") == (None, 30 * 86400 * 10**9)
    assert parse_every("12h") == (None, 12 * 3600 * 10**9)
    with pytest.raises(ValueError, match="a number of bars"):
        parse_every("soon")


def _wait_for(runner: ShadowRunner, seconds: float = 300) -> list[str]:
    """Poll (as each bar does) until the retrain in flight has ended; its lines."""
    deadline = time.time() + seconds  # bounds a broken child only: the loop ends when the child does
    while runner.retrainer.running and time.time() < deadline:
        time.sleep(0.1)
        runner.poll()
    assert not runner.retrainer.running
    out = list(runner.messages)
    runner.messages.clear()
    return out


def test_a_failed_retrain_leaves_the_session_untouched_and_says_why(exports: dict[str, Path], bars: pd.DataFrame,
                                                                   tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  no_such_setting: 1\n")
    plain = _runner(tmp_path / "plain", exports["better"], [exports["worse"]])
    _run(plain, bars)
    runner = _runner(tmp_path / "retrain", exports["better"], [exports["worse"]],
                     retrainer=Retrainer("100", tmp_path / "retrain" / "work", str(bad)))
    runner.start()
    lines = []
    for i, b in enumerate(replay(bars, 2)):
        runner.on_bar(b)
        if runner.retrainer.running:
            lines += runner.messages
            runner.messages.clear()
            lines += _wait_for(runner)
        if i == 150:
            break
    assert any("retrain 1 started" in line for line in lines)
    (failed,) = [line for line in lines if "retrain 1 failed" in line]
    assert "exit status 2" in failed and "no_such_setting" in failed and "untouched" in failed
    _run(runner, bars, start=151, begin=False)
    assert [m.label for m in runner.models] == ["model0", "model1"]
    for log in ("log", "log.models/model0", "log.models/model1"):
        a, b = read_decisions(tmp_path / "plain" / log), read_decisions(tmp_path / "retrain" / log)
        pd.testing.assert_frame_equal(a.drop(columns="latency_us"), b.drop(columns="latency_us"))


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_a_killed_retrain_is_reported_and_leaves_the_session_untouched(exports: dict[str, Path], bars: pd.DataFrame,
                                                                      tmp_path: Path) -> None:
    """kill -9 of the retrain process, once its fit runs: one line says so, the fit dies with it, the session goes
    on."""
    config = Path(__file__).parent / "configs" / "tiny.yaml"
    runner = _runner(tmp_path, exports["better"], [], retrainer=Retrainer("50", tmp_path / "work", str(config)))
    runner.start()
    it = iter(replay(bars, 2))
    for b in it:
        runner.on_bar(b)
        if runner.retrainer.running:
            break
    pid = runner.retrainer.proc.pid
    deadline = time.time() + 300  # bounds a broken child only: the kill waits for its fit process to start
    while not (fit := _children(pid)) and runner.retrainer.proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert fit, "the retrain started no fit process"
    os.kill(pid, signal.SIGKILL)
    lines = _wait_for(runner)
    deadline = time.time() + 60
    while any(_alive(f) for f in fit) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(_alive(f) for f in fit), "the fit process outlived its killed retrain"

    assert len(lines) == 2 and "retrain 1 failed (killed by signal 9)" in lines[1], lines
    for b in it:
        runner.on_bar(b)
    runner.save()
    assert [m.label for m in runner.models] == ["model0"]
    assert len(read_decisions(tmp_path / "log")) == len(bars)


def test_the_export_s_recorded_config_is_the_default_and_its_absence_one_line(exports: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    meta = json.loads((exports["better"] / "metadata.json").read_text())
    with pytest.raises(ValueError, match="--retrain-config"):
        Retrainer("100", tmp_path, None, {**meta, "config": None})
    r = Retrainer("100", tmp_path, None, {**meta, "config": "model:\n  cost_bps: 0.5\n"})
    assert Path(r.config_path(tmp_path)).read_text() == "model:\n  cost_bps: 0.5\n"


@pytest.mark.slow
def test_a_scheduled_retrain_trains_on_past_bars_only_and_starts_as_a_challenger(exports: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    """tiny.yaml retrained on the first 1,000 bars while the stream goes on; its export, warmed on those bars and
    caught up on the ones since, shadows the champion from the next bar, registered with its digest."""
    config = Path(__file__).parent / "configs" / "tiny.yaml"
    long = generate_market(n_bars=1400, n_symbols=2, seed=12, signal_strength=0.3, symbols=SYMBOLS).bars
    runner = _runner(tmp_path, exports["better"], [], retrainer=Retrainer("1000", tmp_path / "work", str(config)))
    runner.start()
    stamps = []
    lines = []
    for b in replay(long, 2):
        runner.on_bar(b)
        stamps.append(b.timestamp)
        lines += runner.messages
        runner.messages.clear()
        if runner.retrainer.running and len(stamps) == 1100:  # let the stream run ahead of it, then wait for it
            lines += _wait_for(runner, 900)
    runner.close()
    assert any("retrain 1 done: model1" in line for line in lines), lines
    (rec,) = [r for r in read_registry(tmp_path / "registry.jsonl") if r["event"] == "challenger"]
    assert rec["source"] == "retrain" and rec["data_until"] == stamps[999] and rec["at"] == stamps[1099]
    assert rec["sha256"] == foxhunt.live.open(rec["export"]).export_digest
    trained_on = pd.read_parquet(tmp_path / "work" / "retrain-0001" / "bars.parquet")
    assert pd.DatetimeIndex(trained_on["timestamp"]).max().value == stamps[999] and len(trained_on) == 2000
    shadowed = read_decisions(tmp_path / "log.models" / "model1")
    assert shadowed["ts_event"].min() == stamps[1100] and len(shadowed) == 2 * (len(stamps) - 1100)
    traded, champion = read_decisions(tmp_path / "log"), read_decisions(tmp_path / "log.models" / "model0")
    assert np.array_equal(traded["ensemble"].to_numpy(), champion["ensemble"].to_numpy())
    assert [m.label for m in runner.models] == ["model0", "model1"]


def _stdin_cli(exports: dict[str, Path], out: Path) -> subprocess.Popen:
    """The CLI with a challenger, reading CSV bars on stdin (it waits for more: the test decides where it stops)."""
    cmd = [sys.executable, "-m", "foxhunt.live", "--checkpoint", str(exports["worse"]), "--challenger",
           str(exports["better"]), "--source", "stdin", "--decisions", str(out), "--flush-every", "50",
           "--status-every", "0", "--promotion-min-bars", "100"]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_kill_9_after_a_promotion_and_before_its_save_resumes_exactly(exports: dict[str, Path], bars: pd.DataFrame,
                                                                        tmp_path: Path) -> None:
    """Killed after the promotion was registered but before the state that holds it was saved: the restart re-decides
    it from the saved state, writes no registry record twice, and logs what an uninterrupted run logs."""
    frame = bars.sort_values(["timestamp", "symbol"])[["timestamp", "symbol", "open", "high", "low", "close", "volume"]]
    lines = frame.to_csv(index=False).splitlines(keepends=True)
    whole = _stdin_cli(exports, tmp_path / "whole")
    _, err = whole.communicate("".join(lines), timeout=600)
    assert whole.returncode == 0, err
    killed = _stdin_cli(exports, tmp_path / "killed")
    killed.stdin.write("".join(lines[: 1 + 2 * 140]))  # the header and 140 bars: past the promotion, before bar 150
    killed.stdin.flush()
    registry = tmp_path / "killed.registry.jsonl"
    deadline = time.time() + 600  # bounds a broken run only: the kill waits for the promotion, never for a time
    while killed.poll() is None and time.time() < deadline and \
            not (registry.is_file() and '"promotion"' in registry.read_text()):
        time.sleep(0.05)
    assert killed.poll() is None, killed.stderr.read()
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    saved = json.loads((tmp_path / "killed.state" / "state.json").read_text())
    assert saved["bars"] == 100 and [m["label"] for m in saved["models"]] == ["model0", "model1"]  # before it
    restarted = _stdin_cli(exports, tmp_path / "killed")
    _, err = restarted.communicate("".join(lines), timeout=600)
    assert restarted.returncode == 0, err
    for log in ("", ".models/model0", ".models/model1"):
        a, b = read_decisions(f"{tmp_path / 'whole'}{log}"), read_decisions(f"{tmp_path / 'killed'}{log}")
        pd.testing.assert_frame_equal(a.drop(columns="latency_us"), b.drop(columns="latency_us"))

    def events(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "time"} for r in read_registry(path) if r["event"] != "resume"]

    assert events(tmp_path / "whole.registry.jsonl") == events(registry)
    assert [r["event"] for r in events(registry)] == ["start", "challenger", "promotion", "retirement"]


def test_a_retrain_sees_the_warmup_history_and_the_traded_bars_up_to_its_bar_only(bars: pd.DataFrame,
                                                                                   tmp_path: Path) -> None:
    from foxhunt.live.log import DecisionLog
    from foxhunt.live.retrain import bars_until

    ts = pd.DatetimeIndex(bars["timestamp"])
    cut, until = ts.sort_values()[100], ts.sort_values()[400]
    write_bars(bars[ts < cut].reset_index(drop=True), tmp_path / "history.parquet")
    log = DecisionLog(tmp_path / "log")
    later = bars[ts >= cut]
    log.append([{"ts_event": int(pd.Timestamp(r.timestamp).value), "symbol": r.symbol, "open": r.open, "high": r.high,
                 "low": r.low, "close": r.close, "volume": r.volume, "ensemble": 0.0, "ready": True, "latency_us": 1.0}
                for r in later.itertuples()])
    log.flush()
    seen = bars_until(tmp_path / "log", until.value, str(tmp_path / "history.parquet"))
    expected = bars[ts <= until].sort_values(["timestamp", "symbol"]).reset_index(drop=True)
    assert len(seen) == len(expected) and pd.DatetimeIndex(seen["timestamp"]).max() == until
    np.testing.assert_array_equal(seen[["open", "high", "low", "close", "volume"]].to_numpy(),
                                  expected[["open", "high", "low", "close", "volume"]].to_numpy())
    assert list(seen["symbol"]) == list(expected["symbol"])


def test_families_are_numbered_in_the_session_and_spend_alpha_once(exports: dict[str, Path], bars: pd.DataFrame,
                                                                   tmp_path: Path) -> None:
    """With spending="families" the starting challengers are family 1, tested at alpha 6/pi^2; after a promotion the
    challenger left is family 2 against the new champion, tested at alpha 6/(4 pi^2); a resumed run keeps counting."""
    rule = PromotionRule(min_bars=100, alpha=0.05, method="fixed", spending="families")
    runner = _runner(tmp_path, exports["worse"], [exports["better"], exports["twin"]], rule)
    _run(runner, bars, stop=150)
    resumed = _runner(tmp_path, exports["worse"], [exports["better"], exports["twin"]], rule)
    _run(resumed, bars, start=150)
    assert resumed.families == 2
    records = read_registry(tmp_path / "registry.jsonl")
    (promo,) = [r for r in records if r["event"] == "promotion"]
    assert promo["evidence"]["family"] == 1 and promo["evidence"]["declared_alpha"] == 0.05
    assert promo["evidence"]["alpha"] == pytest.approx(0.05 * 6 / math.pi**2)
    kept = [r for r in records if r["event"] == "retirement" and r["evidence"] is not None]
    assert len(kept) == 1 and kept[0]["evidence"]["family"] == 2, kept  # the twin of the new champion: never promoted
    assert kept[0]["evidence"]["alpha"] == pytest.approx(0.05 * 6 / (4 * math.pi**2))
