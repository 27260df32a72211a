"""Distributed tuning on a real PostgreSQL server that the test starts: several worker processes share one study, one
is killed with SIGKILL in the middle of a trial, and the study still ends with exactly the requested complete trials,
none run twice, the killed one's parameters retried once.

Needs PostgreSQL's server binaries (``initdb``, ``pg_ctl``, ``postgres``: on PATH or in /usr/lib/postgresql/*/bin;
``.ci/run`` installs them with apt-get where they are missing) and a SQLAlchemy driver (``pip install -e
'.[postgres]'``). Where no server can start, the test is skipped with the reason. Slow (a minute or two): ``.ci/run``
runs it explicitly.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from foxhunt.tune import counts_toward_budget, decoded_params, load_tune_config, main

CONFIGS = Path(__file__).parent / "configs"
N_TRIALS = 5
N_WORKERS = 3

pytestmark = pytest.mark.slow


def _server_binary(name: str) -> str | None:
    """``name`` on PATH, else in the newest /usr/lib/postgresql/<version>/bin (Debian's layout, not on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[-3]))
    return versions[-1] if versions else None


def _driver() -> str | None:
    """The SQLAlchemy dialect+driver of an installed PostgreSQL driver."""
    for module, dialect in (("psycopg", "postgresql+psycopg"), ("psycopg2", "postgresql+psycopg2")):
        with contextlib.suppress(ImportError):
            __import__(module)
            return dialect
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_server_user() -> tuple[list[str], int | None]:
    """PostgreSQL refuses to run as root: as root, run its binaries as the 'postgres' (or 'nobody') user."""
    if os.geteuid() != 0:
        return [], None
    for user in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            uid = pwd.getpwnam(user).pw_uid
            runner = shutil.which("runuser") or shutil.which("setpriv")
            if runner and runner.endswith("runuser"):
                return [runner, "-u", user, "--"], uid
            if runner:
                gid = pwd.getpwnam(user).pw_gid
                return [runner, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"], uid
    pytest.skip("running as root, and neither a 'postgres' nor a 'nobody' user with runuser/setpriv to run the server as")


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A throw-away PostgreSQL server on a free local port; its SQLAlchemy URL."""
    initdb, pg_ctl = _server_binary("initdb"), _server_binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql/*/bin; "
                    ".ci/run installs them with `apt-get install postgresql`")
    dialect = _driver()
    if dialect is None:
        pytest.skip("no PostgreSQL driver for SQLAlchemy (psycopg or psycopg2): pip install -e '.[postgres]'")
    prefix, uid = _as_server_user()
    root = Path(tempfile.mkdtemp(prefix="foxhunt-pg-"))
    root.chmod(0o755)
    data, log = root / "data", root / "server.log"
    data.mkdir()
    log.touch()
    if uid is not None:
        for p in (data, log, root):
            os.chown(p, uid, -1)
    port = _free_port()
    init = subprocess.run([*prefix, initdb, "-D", str(data), "-U", "foxhunt", "--auth=trust", "-E", "UTF8"],
                          capture_output=True, text=True, timeout=120, check=False)
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"initdb failed, no server can start: {init.stderr.strip()[-500:]}")
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=50"
    start = subprocess.run([*prefix, pg_ctl, "-D", str(data), "-o", opts, "-l", str(log), "-w", "-t", "60", "start"],
                           capture_output=True, text=True, timeout=120, check=False)
    if start.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"pg_ctl start failed, no server can start: {start.stderr.strip()[-300:]} {log.read_text()[-500:]}")
    try:
        yield f"{dialect}://foxhunt@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True,
                       timeout=120, check=False)
        shutil.rmtree(root, ignore_errors=True)


def _worker(argv: list[str]) -> None:
    sys.exit(main(argv))


def _config(tmp: Path) -> Path:
    """tune_tiny.yaml with absolute paths, no pruning (every trial completes) and a heartbeat of 1 s, stale after 4."""
    raw = yaml.safe_load((CONFIGS / "tune_tiny.yaml").read_text())
    raw["base_config"] = str(CONFIGS / raw["base_config"])
    raw["runs_dir"] = str(tmp / "runs")
    raw["fixed"] = {**raw["fixed"], "data.cache_dir": str(tmp / "cache"), "trainer.max_epochs": 1}
    raw.update(pruner={"name": "none"}, heartbeat_interval=1, heartbeat_grace=4, n_trials=N_TRIALS)
    path = tmp / "tune.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_workers_on_postgres_survive_a_sigkill_mid_trial(postgres_url: str, tmp_path: Path) -> None:
    import multiprocessing

    path = _config(tmp_path)
    argv = ["--config", str(path), "--storage", postgres_url, "--study-name", "pg"]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["foxhunt.fit", "foxhunt.tune"])
    workers = [ctx.Process(target=_worker, args=(argv,)) for _ in range(N_WORKERS)]
    for w in workers:
        w.start()
    pids = {w.pid: w for w in workers}
    # kill, with SIGKILL, the worker of the first trial seen running with its fit config written (mid-trial)
    victim, killed_trial, deadline = None, None, time.monotonic() + 600
    while victim is None and time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # the study may not exist yet
            study = optuna.load_study(study_name="pg", storage=postgres_url)
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                pid = int(str(t.user_attrs.get("worker", ":0")).rsplit(":", 1)[-1])
                if "fit_config" in t.user_attrs and pid in pids:
                    os.kill(pid, signal.SIGKILL)
                    victim, killed_trial = pids[pid], t.number
                    break
        time.sleep(0.2)
    assert victim is not None, "no trial was seen running"
    for w in workers:
        w.join(timeout=900)
    assert victim.exitcode == -signal.SIGKILL
    assert [w.exitcode for w in workers if w is not victim] == [0] * (N_WORKERS - 1)

    study = optuna.load_study(study_name="pg", storage=postgres_url)
    trials = study.get_trials()
    about = [(t.number, t.state.name, t.user_attrs.get("fail_kind"), t.user_attrs.get("retry_of")) for t in trials]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == N_TRIALS, about
    assert sum(counts_toward_budget(t) for t in trials) == N_TRIALS, about
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)], about
    assert len({t.number for t in trials}) == len(trials)
    # no duplicate: every complete trial ran its own parameters in its own folder
    cfg = load_tune_config(path)
    assert len({yaml.safe_dump(decoded_params(cfg, t)) for t in complete}) == N_TRIALS, about
    assert len({t.user_attrs["log_dir"] for t in complete}) == N_TRIALS
    # the killed trial: failed as stale (no fail_kind: its worker never got to write one), retried once, completed
    dead = trials[killed_trial]
    assert dead.state == TrialState.FAIL and "fail_kind" not in dead.user_attrs, about
    (retry,) = [t for t in trials if t.user_attrs.get("retry_of") == killed_trial]
    assert retry.state == TrialState.COMPLETE and retry.params == dead.params
    assert retry.user_attrs["retry_reason"].startswith(f"trial {killed_trial} (worker ")
    others = [t for t in trials if t.state == TrialState.FAIL and t is not dead]
    assert all(t.user_attrs.get("fail_kind") == "surplus" for t in others), about  # lost races cost no training
