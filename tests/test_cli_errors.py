"""Every command reports a user mistake as one line, ``error: <file/field>: <reason>``, and exits 2; ``--debug`` gives
the traceback; config values are refused before any data is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from foxhunt.cli_errors import ConfigError, run_command

ROOT = Path(__file__).resolve().parents[1]
TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]  # (the subprocess test below checks that no traceback is printed)
    return lines[0]


@pytest.fixture
def no_data_loading(monkeypatch):
    """Loading any bars (or generating the synthetic market) fails the test: config errors must come first."""
    from foxhunt.data.datamodule import BarDataModule

    def refuse(self):
        raise AssertionError("data was loaded before the config was checked")

    monkeypatch.setattr(BarDataModule, "load", refuse)


@pytest.mark.parametrize(
    "override, expected",
    [
        (["--model.members.tft.init_args.optim.lr", "-1"], r"tiny.yaml: model.members.tft (TFTModule): learning rate must be in (0, 1], got -1.0"),
        (["--model.members.dqn.init_args.optim.lr", "2"], r"tiny.yaml: model.members.dqn (DQNModule): learning rate must be in (0, 1], got 2.0"),
        (["--model.members.dqn.init_args.gamma", "1.5"], r"tiny.yaml: model.members.dqn (DQNModule): gamma must be in [0, 1)"),
        (["--model.members.dqn.init_args.epsilon_end", "3"], r"tiny.yaml: model.members.dqn (DQNModule): epsilon_start/end must be in [0, 1]"),
        (["--data.train_fraction", "1.5"], r"tiny.yaml: data: BarDataModule: need 0 < train_fraction"),
        (["--data.lookback", "0"], r"tiny.yaml: data: BarDataModule: lookback and horizon must be >= 1 bar"),
        (["--data.jump_sigmas", "-3"], r"tiny.yaml: data: jump_sigmas must be a positive number"),
        (["--data.on_bad_bar", "ignore"], r"data.on_bad_bar"),
        (["--model.combine", "mean"], r"model.combine"),
        (["--model.members.tft.init_args.hiddn", "3"], r"Option 'hiddn' is not accepted"),
        (["--checkpoint_every_n_steps", "0"], r"checkpoint_every_n_steps: must be a positive number of steps, got 0"),
    ],
    ids=["tft_lr", "dqn_lr", "dqn_gamma", "dqn_epsilon", "train_fraction", "lookback", "jump_sigmas", "on_bad_bar",
         "combine", "unknown_key", "checkpoint_every"],
)
def test_fit_config_errors_are_one_line_before_any_data_is_loaded(override, expected, tmp_path: Path, capsys,
                                                                   no_data_loading) -> None:
    from foxhunt.fit import main

    code = run_command(main, ["--config", TINY, "--trainer.default_root_dir", str(tmp_path), *override])
    line = _one_error_line(capsys)
    assert code == 2 and expected in line, line


def test_debug_gives_the_traceback(tmp_path: Path, no_data_loading) -> None:
    from foxhunt.fit import main

    with pytest.raises(ConfigError, match="learning rate must be in"):
        run_command(main, ["--config", TINY, "--debug", "--model.members.dqn.init_args.optim.lr", "-1"])


def test_fit_data_errors_are_one_line_naming_the_file_or_the_fields(tmp_path: Path, capsys) -> None:
    from foxhunt.fit import main

    args = ["--config", TINY, "--trainer.default_root_dir", str(tmp_path), "--backtest", "false"]
    assert run_command(main, [*args, "--data.path", str(tmp_path / "nowhere.csv")]) == 2
    assert _one_error_line(capsys) == f"error: {tmp_path / 'nowhere.csv'}: no such file or directory"
    # the drill: a lookback longer than the data (it used to surface as "cosine schedule needs total_steps > 0")
    assert run_command(main, [*args, "--data.lookback", "4000", "--data.synthetic_bars", "3000"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: data: the train split has no complete window of lookback 4000 + horizon 3 bars after "
                           "the purge of 4003 bars"), line
    (tmp_path / "bad.csv").write_text("timestamp,open,high,low,close,volume\n2024-01-02T14:30:00Z,1,2,0.5,abc,3\n")
    assert run_command(main, [*args, "--data.path", str(tmp_path / "bad.csv")]) == 2
    assert "bad.csv" in _one_error_line(capsys)


def test_a_corrupt_ckpt_path_is_one_line(tmp_path: Path, capsys) -> None:
    from foxhunt.fit import main

    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"")
    assert run_command(main, ["--config", TINY, "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(bad),
                              "--trainer.max_epochs", "1", "--data.synthetic_bars", "3000"]) == 2
    assert _one_error_line(capsys).startswith(f"error: {bad}: not a readable checkpoint (the file is empty")


def test_backtest_walkforward_data_and_tune_errors_are_one_line(tmp_path: Path, capsys) -> None:
    from foxhunt.backtest import main as backtest
    from foxhunt.data.__main__ import main as data
    from foxhunt.tune import main as tune
    from foxhunt.walkforward import main as walkforward

    assert run_command(backtest, ["--checkpoint", str(tmp_path)]) == 2
    assert _one_error_line(capsys) == f"error: {tmp_path}: no metadata.json: not a foxhunt export directory"
    assert run_command(data, ["--path", str(tmp_path / "nowhere.parquet")]) == 2
    assert _one_error_line(capsys) == f"error: {tmp_path / 'nowhere.parquet'}: no such file or directory"
    assert run_command(walkforward, ["--config", TINY, "--folds", "0", "--out", str(tmp_path / "wf")]) == 2
    assert _one_error_line(capsys) == "error: --folds must be at least 1, got 0"
    assert run_command(walkforward, ["--config", TINY, "--folds", "2", "--out", str(tmp_path / "wf"), "--",
                                     "--model.members.tft.init_args.hiddn", "3"]) == 2
    assert "tiny.yaml: foxhunt.fit rejects this config: Parser key" in _one_error_line(capsys)
    config = tmp_path / "tune.yaml"
    config.write_text(f"base_config: {TINY}\nsearch_space: {{data.lookback: {{type: int, low: 8}}}}\n")
    assert tune(["--config", str(config)]) == 2
    assert _one_error_line(capsys) == f"error: {config.resolve()}: search_space.data.lookback: int needs 'low' and 'high'"


def test_python_m_foxhunt_fit_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    """As a command: exit status 2, one line on stderr, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "foxhunt.fit", "--config", TINY, "--model.members.dqn.init_args.optim.lr",
                           "-1"], capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {TINY}: model.members.dqn (DQNModule): learning rate must be in (0, 1], got -1.0")


def test_ckpt_path_last_with_only_a_corrupt_checkpoint_is_one_line_and_leaves_no_empty_run(tmp_path: Path, capsys,
                                                                                          no_data_loading) -> None:
    """The issue's drill left an empty version folder behind; now the run stops before its logger writes anything."""
    from foxhunt.fit import main

    ckpts = tmp_path / "runs" / "foxhunt" / "version_0" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "last.ckpt").write_bytes(b"PK\x03\x04 truncated")
    code = run_command(main, ["--config", TINY, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                              "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", "last"])
    line = _one_error_line(capsys)
    assert code == 2 and line.startswith("error: --ckpt_path last: none of the 1 last*.ckpt under "), line
    assert sorted(p.name for p in (tmp_path / "runs" / "foxhunt").iterdir()) == ["version_0"]
