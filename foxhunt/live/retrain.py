"""Scheduled retraining beside a live run: every N bars (or a duration of bar time), a separate process trains the
run's config on the bars traded so far (past only, like a walk-forward fold), exports it and warms a live state of
the export on the same bars; the live loop only polls it (never waits), then starts the export as a challenger.

The child is ``python -m foxhunt.live.retrain``: it reads the traded decision log (its bars, up to the bar the retrain
was started at; the ``--warmup`` history first), writes them to ``bars.parquet``, runs ``python -m foxhunt.fit`` on
them (``--data.path``, ``--export_dir``, no back-test; killed with it), and saves the export's session state after replaying them. Its
output goes to ``RETRAIN_DIR/retrain-NNNN/retrain.log``. A child that fails or is killed leaves the live session as it
was; the run prints one line with its exit and the log's last line. One retrain runs at a time: one due while another
runs waits for it. A retrain in flight when the run stops is stopped (one line); after a kill -9 of the run it is
forgotten and the schedule goes on from the saved state.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DURATION = re.compile(r"^(\d+)\s*(s|m|h|d|w)$")
UNIT_NS = {"s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "d": 86400 * 10**9, "w": 7 * 86400 * 10**9}
LOG = "retrain.log"


def parse_every(text: str) -> tuple[int | None, int | None]:
    """``--retrain-every``: bars (``500``) or a duration of bar time (``30d``, ``12h``, ``90m``, ``45s``, ``2w``), as
    (bars, None) or (None, nanoseconds); anything else is one ValueError line."""
    t = str(text).strip().lower()
    if t.isdigit() and int(t) > 0:
        return int(t), None
    m = DURATION.match(t)
    if m and int(m.group(1)) > 0:
        return None, int(m.group(1)) * UNIT_NS[m.group(2)]
    raise ValueError(f"--retrain-every {text!r}: give a number of bars (500) or a duration (30d, 12h, 90m, 45s, 2w)")


def export_config(metadata: dict[str, Any]) -> str | None:
    """The training config an export records (``metadata.json``'s ``config``, as foxhunt.fit writes it) as YAML text,
    or None when it records none."""
    import yaml

    config = metadata.get("config")
    if config is None or config == {} or config == "":
        return None
    return config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)


@dataclass
class RetrainResult:
    """A retrain that ended: its export and warmed state, the last bar its data holds, or the one line of why not."""

    number: int
    until: int
    export: Path | None = None
    state: Path | None = None
    error: str | None = None


class Retrainer:
    """Starts, polls and stops the retraining child processes of a live run (see the module docstring)."""

    def __init__(self, every: str, workdir: str | Path, config: str | None = None, export_metadata: dict | None = None,
                 warmup: str | None = None) -> None:
        self.every_text = str(every)
        self.every_bars, self.every_ns = parse_every(every)
        self.workdir = Path(workdir)
        self.warmup = None if warmup is None else str(Path(warmup).resolve())
        if config is not None:
            if not Path(config).is_file():
                raise ValueError(f"--retrain-config {config}: no such file")
            self.config_text, self.config_source = None, str(Path(config).resolve())
        else:
            self.config_text = export_config(export_metadata or {})
            self.config_source = "the export's recorded config"
            if self.config_text is None:
                raise ValueError("--retrain-every: the export records no training config (metadata.json's config): "
                                 "give --retrain-config CONFIG")
        self.count = 0  # retrains started
        self.last_bars = 0  # bars when the last one started
        self.last_ts: int | None = None  # its bar time (or the first bar's, before any)
        self.proc: subprocess.Popen | None = None
        self.current: tuple[int, int, Path] | None = None  # (number, until, its directory)
        self._bars = 0  # the run's bars at the last due()

    def declared(self) -> dict[str, Any]:
        """The schedule as the registry's start record holds it."""
        return {"every": self.every_text, "config": self.config_source, "workdir": str(self.workdir)}

    @property
    def running(self) -> bool:
        return self.proc is not None

    def due(self, bars: int, ts: int) -> bool:
        """Whether a retrain should start after this bar (never while one runs)."""
        self._bars = int(bars)
        if self.last_ts is None:
            self.last_ts = int(ts)
        if self.running:
            return False
        if self.every_bars is not None:
            return bars - self.last_bars >= self.every_bars
        return int(ts) - self.last_ts >= self.every_ns

    def config_path(self, directory: Path) -> str:
        if self.config_text is None:
            return str(self.config_source)
        path = directory / "config.yaml"
        path.write_text(self.config_text)
        return str(path)

    def start(self, decisions: str | Path, until: int, python: str | None = None) -> list[str]:
        """Start retrain number count+1 on the traded bars up to ``until`` (ns); returns its one line."""
        self.count += 1
        out = (self.workdir / f"retrain-{self.count:04d}").resolve()
        out.mkdir(parents=True, exist_ok=True)
        cmd = [python or sys.executable, "-m", "foxhunt.live.retrain", "--decisions", str(Path(decisions).resolve()),
               "--until", str(int(until)), "--config", self.config_path(out), "--out", str(out)]
        if self.warmup:
            cmd += ["--warmup", self.warmup]
        with open(out / LOG, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=out, start_new_session=True,
                                         stdin=subprocess.DEVNULL)
        self.current = (self.count, int(until), out)
        self.last_ts = int(until)
        self.last_bars = self._bars
        return [f"live: retrain {self.count} started on the bars up to {_when(until)} (pid {self.proc.pid}, "
                f"{out / LOG})"]

    def poll(self) -> RetrainResult | None:
        """The retrain that ended since the last call, if one did (non-blocking)."""
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            return None
        number, until, out = self.current
        self.proc, self.current = None, None
        export, state = out / "export", out / "state"
        if rc == 0 and (export / "metadata.json").is_file() and (state / "state.json").is_file():
            return RetrainResult(number, until, export, state)
        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        return RetrainResult(number, until, error=f"live: retrain {number} failed ({how}), the session goes on "
                                                  f"untouched: {last_line(out / LOG)}")

    def stop(self, reason: str) -> str | None:
        """Stop a retrain in flight (its process group: SIGTERM, then SIGKILL after 10 s); its one line."""
        if self.proc is None:
            return None
        number = self.current[0]
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        except ProcessLookupError:
            pass
        self.proc, self.current = None, None
        return f"live: retrain {number} stopped: {reason}"

    def info(self) -> dict[str, Any]:
        """What the saved state keeps of the schedule."""
        return {"count": self.count, "last_bars": self.last_bars, "last_ts": self.last_ts}

    def resume(self, info: dict[str, Any]) -> None:
        self.count, self.last_bars, self.last_ts = int(info["count"]), int(info["last_bars"]), info.get("last_ts")


def last_line(path: Path) -> str:
    """The last non-empty line of a child's log (its error line), or a note that it wrote none."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return lines[-1][:300] if lines else f"it wrote nothing ({path})"


def _when(ts: int) -> str:
    import pandas as pd

    return pd.Timestamp(int(ts), unit="ns", tz="UTC").isoformat()


# ---------------------------------------------------------------------------------------------------- the child
def bars_until(decisions: str | Path, until: int, warmup: str | None = None) -> Any:
    """The bars of a traded decision log up to ``until`` (ns, inclusive), after a warm-up history file's: the past the
    retrain may see."""
    import pandas as pd

    from foxhunt.data.io import load_bars
    from foxhunt.live.log import read_decisions

    log = read_decisions(decisions)
    log = log[log["ts_event"].to_numpy() <= int(until)]
    frame = pd.DataFrame({"timestamp": pd.to_datetime(log["ts_event"].to_numpy(), utc=True),
                          "symbol": log["symbol"].astype(str).to_numpy()})
    for c in ("open", "high", "low", "close", "volume"):
        frame[c] = log[c].to_numpy()
    if warmup is not None:
        past = load_bars(warmup, on_bad_bar="raise")
        past = past[pd.DatetimeIndex(past["timestamp"]) < frame["timestamp"].min()] if len(frame) else past
        if "symbol" not in past.columns:
            past = past.assign(symbol=frame["symbol"].iloc[0] if len(frame) else "default")
        frame = pd.concat([past[list(frame.columns)], frame], ignore_index=True)
    return frame.sort_values(["timestamp", "symbol"], kind="stable").reset_index(drop=True)


def _die_with_parent() -> None:
    """In the fit process, before it runs: be killed when the retrain process dies (Linux's PR_SET_PDEATHSIG), so a
    retrain killed by any signal leaves no training behind."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def child(argv: list[str] | None = None) -> int:
    """``python -m foxhunt.live.retrain``: write the past bars, fit and export on them, warm the export's state."""
    p = argparse.ArgumentParser(prog="python -m foxhunt.live.retrain", description=__doc__)
    p.add_argument("--decisions", required=True)
    p.add_argument("--until", type=int, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--warmup")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        from foxhunt.data.io import write_bars

        bars = bars_until(args.decisions, args.until, args.warmup)
        data = write_bars(bars, out / "bars.parquet")
        print(f"retrain: {len(bars)} bars up to {_when(args.until)} in {data}", flush=True)
    except Exception as e:
        print(f"error: retrain data: {str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)
        return 2
    fit = [sys.executable, "-m", "foxhunt.fit", "--config", args.config, "--data.path", str(data), "--export_dir",
           str(out / "export"), "--backtest", "false", "--trainer.default_root_dir", str(out)]
    rc = subprocess.run(fit, cwd=out, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, check=False).returncode
    if rc != 0:
        return rc if rc > 0 else 128 - rc
    import foxhunt.live
    from foxhunt.data.io import load_bars
    from foxhunt.live.replay import replay

    session = foxhunt.live.open(str(out / "export"))
    for b in replay(load_bars(data, on_bad_bar="raise"), session.horizon):
        session.on_bar(b.symbols, b.ohlcv, b.timestamp, b.next_timestamps)
    session.save(out / "state", last_timestamp=int(args.until))
    print(f"retrain: exported {out / 'export'} and warmed its state on the bars up to {_when(args.until)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child())
