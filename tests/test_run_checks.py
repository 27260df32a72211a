"""The run's plan, checked once before training (foxhunt/lit/run_plan.py, foxhunt.fit): what a config implies about
the run's length and data is refused in one line naming its dotted key, or, in a run shortened from the config's own
trainer limits, scaled and said. Unit tests build members only (no Trainer); the smoke test runs every shipped fit
config as ``--trainer.max_epochs 1 --trainer.limit_train_batches 10``."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foxhunt.cli_errors import ConfigError, run_command
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.mamba2 import Mamba2Module
from foxhunt.lit.run_plan import TrainerLimits, check_plan, plan_run

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "lightning_configs"
TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")
FIT_CONFIGS = sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem != "tune")  # tune.yaml is a study, not a fit


def _dqn(**kwargs) -> DQNModule:
    return DQNModule(window=4, hidden=(8,), n_envs=8, episode_length=16, batch_size=16, replay_capacity=1024,
                     learning_starts=64, **kwargs)


def _mamba(**optim) -> Mamba2Module:
    return Mamba2Module(d_model=8, n_layers=1, d_state=4, headdim=4, chunk_size=4, optim=optim)


def test_trainer_limits_count_batches_and_epochs_as_lightning_does() -> None:
    assert TrainerLimits(limit_train_batches=10).batches_per_epoch(53) == 10
    assert TrainerLimits(limit_train_batches=250).batches_per_epoch(53) == 53
    assert TrainerLimits(limit_train_batches=0.5).batches_per_epoch(53) == 26
    assert TrainerLimits().batches_per_epoch(53) == 53
    assert TrainerLimits().epochs() == 1000  # nothing bounds it: Lightning's 1,000 epochs
    assert TrainerLimits(max_steps=100).epochs() == float("inf")  # max_steps alone bounds it
    assert TrainerLimits(max_epochs=-1).epochs() == float("inf")
    assert TrainerLimits.of({"max_epochs": 3, "max_steps": None, "limit_train_batches": 7}) == TrainerLimits(3, -1, 7)


def test_plan_counts_each_members_updates_from_its_start_and_pace() -> None:
    plan = plan_run({"tft": (1, 0), "dqn": (16, 4)}, 53, TrainerLimits(max_epochs=1, limit_train_batches=10))
    assert plan.steps == 10 and plan.updates == {"tft": 10, "dqn": 16 * 6}
    by_steps = plan_run({"tft": (1, 0), "dqn": (1, 0)}, 53, TrainerLimits(max_epochs=5, max_steps=20))
    assert by_steps.steps == 10 and by_steps.bound.startswith("trainer.max_steps 20")


def test_a_start_step_beyond_the_run_is_one_line_naming_the_key_and_what_works() -> None:
    dqn = _dqn(optim={"start_step": 150, "updates_per_step": 1})
    limits = TrainerLimits(max_epochs=6, limit_train_batches=250)
    with pytest.raises(ConfigError) as e:
        check_plan({"dqn": dqn}, 15, limits, reference=limits, source="quickstart.yaml: ")
    assert str(e.value) == (
        "quickstart.yaml: model.members.dqn.init_args.optim.start_step: 150, but this fit runs 90 coordinator steps "
        "(max_epochs 6 x 15 training batches an epoch, limit_train_batches 250): member 'dqn' would never train; use "
        "at most 89, or train longer (e.g. trainer.max_epochs 11)")
    assert dqn.start_step == 150  # nothing changed


def test_a_warm_up_longer_than_the_members_updates_is_refused_unless_the_run_was_shortened(caplog) -> None:
    config = TrainerLimits(max_epochs=4, limit_train_batches=250)
    mamba = _mamba(scheduler="cosine", warmup_steps=50)
    with pytest.raises(ConfigError, match=r"^model\.members\.mamba2\.init_args\.optim\.warmup_steps: 50, but member "
                                          r"'mamba2' takes 10 updates in this fit .* use at most 9"):
        check_plan({"mamba2": mamba}, 10, TrainerLimits(max_epochs=1), reference=None)
    smoke = TrainerLimits(max_epochs=1, limit_train_batches=10)
    with caplog.at_level(logging.WARNING, logger="foxhunt.lit.run_plan"):
        plan = check_plan({"mamba2": mamba}, 781, smoke, reference=config)
    assert plan.steps == 10 and mamba.optim.warmup_steps == 0  # 50 of 1,000 updates: 5% of 10
    assert mamba.hparams.optim["warmup_steps"] == 0  # what the checkpoints and the export record
    assert caplog.messages == ["scaled for this run of 10 of the config's 1,000 coordinator steps: "
                               "model.members.mamba2.init_args.optim.warmup_steps 50 -> 0 (of the member's 10 updates)"]
    explicit = _mamba(scheduler="cosine", warmup_steps=50, total_steps=1000)  # its own span: the run does not matter
    check_plan({"mamba2": explicit}, 10, TrainerLimits(max_epochs=1), reference=None)
    assert explicit.optim.warmup_steps == 50


def test_a_shortened_run_scales_start_steps_and_the_agents_schedules_in_proportion(caplog) -> None:
    dqn = _dqn(optim={"start_step": 150, "updates_per_step": 1}, epsilon_steps=300, target_update="hard",
               target_update_every=500)
    tft_like = _mamba(scheduler="none")
    with caplog.at_level(logging.WARNING, logger="foxhunt.lit.run_plan"):
        plan = check_plan({"tft": tft_like, "dqn": dqn}, 250, TrainerLimits(max_epochs=1, limit_train_batches=10),
                          reference=TrainerLimits(max_epochs=6, limit_train_batches=250))
    assert dqn.start_step == 1 and plan.updates == {"tft": 10, "dqn": 9}  # 150 of 1,500 steps: 1 of 10
    assert dqn.hparams.epsilon_steps == 2 and dqn.hparams.target_update_every == 3  # of 1,350 updates, 9 here
    assert [m.split(": ", 1)[1] for m in caplog.messages] == [
        "model.members.dqn.init_args.optim.start_step 150 -> 1",
        "model.members.dqn.init_args.epsilon_steps 300 -> 2 (of the member's 9 updates)",
        "model.members.dqn.init_args.target_update_every 500 -> 3 (of the member's 9 updates)",
    ]


def test_a_setting_that_outlasts_the_configs_own_run_is_not_scaled_but_refused() -> None:
    dqn = _dqn(optim={"start_step": 2000, "updates_per_step": 1})
    with pytest.raises(ConfigError, match=r"optim\.start_step: 2000, but this fit runs 10 coordinator steps"):
        check_plan({"dqn": dqn}, 250, TrainerLimits(max_epochs=1, limit_train_batches=10),
                   reference=TrainerLimits(max_epochs=6, limit_train_batches=250))


def test_a_long_run_leaves_every_setting_as_written_and_warns_about_the_ones_that_outlast_it() -> None:
    dqn = _dqn(optim={"updates_per_step": 1}, epsilon_steps=10_000)
    with pytest.warns(UserWarning, match=r"member 'dqn': epsilon_steps=10000 exceeds the 100 updates"):
        check_plan({"dqn": dqn}, 100, TrainerLimits(max_epochs=1), reference=TrainerLimits(max_epochs=1))
    assert dqn.hparams.epsilon_steps == 10_000


def test_an_agent_whose_validation_choices_outlast_the_run_is_warned_before_training() -> None:
    """select_every beyond the run: no validation choice, so the last weights trade (a silent surprise before)."""
    dqn = _dqn(optim={"updates_per_step": 1}, select_every=500)
    with pytest.warns(UserWarning, match=r"member 'dqn': select_every=500 exceeds the 100 updates of this run: no "
                                         r"validation choice is made, so the last weights trade"):
        check_plan({"dqn": dqn}, 100, TrainerLimits(max_epochs=1), reference=TrainerLimits(max_epochs=1))
    assert not any("select_every" in note for note in _dqn(select_every=50).check_run(100))


def test_a_missing_data_path_fails_before_lightning_prints_anything(tmp_path: Path, capsys, caplog) -> None:
    from foxhunt.fit import main

    with caplog.at_level(logging.INFO):
        code = run_command(main, ["--config", TINY, "--data.path", str(tmp_path / "nowhere.csv")])
    err = capsys.readouterr()
    assert code == 2 and err.err.strip() == f"error: {tmp_path / 'nowhere.csv'}: no such file or directory"
    assert not caplog.messages and "GPU available" not in err.out + err.err  # no seed, no banner, no tip


def test_a_batch_larger_than_the_training_windows_is_one_line_before_the_trainer(tmp_path: Path, monkeypatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    from foxhunt.fit import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LightningCLI, "instantiate_trainer", lambda *a, **k: pytest.fail("the Trainer was built"))
    with pytest.raises(ConfigError, match=r"tiny\.yaml: data\.batch_size: 100000, but the training split has [\d,]+ "
                                          r"complete windows of lookback 12 \+ horizon 3 .* use at most \d+"):
        build_cli(["--config", TINY, "--data.batch_size", "100000"], plan_before_trainer=True)


def test_an_agents_episodes_longer_than_its_training_bars_are_one_line_before_the_trainer(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    from foxhunt.fit import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LightningCLI, "instantiate_trainer", lambda *a, **k: pytest.fail("the Trainer was built"))
    with pytest.raises(ConfigError, match=r"tiny\.yaml: model\.members\.dqn\.init_args\.episode_length: 9000: "
                                          r"MarketSplit 'train': no run of 9001 consecutive decision bars"):
        build_cli(["--config", TINY, "--model.members.dqn.init_args.episode_length", "9000"], plan_before_trainer=True)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("horizon", 2, r"model\.members\.tft\.init_args\.horizon: 2, but the data forecasts 3 steps \(data\.horizon\)"),
    ("lookback", 8, r"model\.members\.tft\.init_args\.lookback: 8, but the data's windows have 12 past bars, which "
                    r"TFTModule reads whole"),
])
def test_a_forecaster_sized_for_other_windows_is_one_line_before_the_trainer(key: str, value: int, message: str,
                                                                              tmp_path: Path, monkeypatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    from foxhunt.fit import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LightningCLI, "instantiate_trainer", lambda *a, **k: pytest.fail("the Trainer was built"))
    sizes = {"n_features": 9, "n_known_future": 2, "lookback": 12, "horizon": 3, key: value}
    args = [a for k, v in sizes.items() for a in (f"--model.members.tft.init_args.{k}", str(v))]
    with pytest.raises(ConfigError, match=message):
        build_cli(["--config", TINY, *args], plan_before_trainer=True)


def _smoke(name: str, tmp: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    export = tmp / "export"
    cmd = [sys.executable, "-m", "foxhunt.fit", "--config", str(CONFIGS / f"{name}.yaml"),
           "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "10",
           "--trainer.logger.init_args.save_dir", str(tmp / "runs"), "--export_dir", str(export), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000), export


# ensemble.yaml's own market (1,000,000 bars x 4 symbols) is a GPU run: its smoke run forecasts ~5.5 million windows
# with each forecaster (the 1.4 million training bars after the cut and the ~593,000 validation bars at the agents'
# start, the validation steps, the validation back-test by the live forecasters and the snapshots, the test split by
# both), and a forecast takes ~4 ms of CPU a window with its TFT (float32 or bf16 autocast alike; ~0.1 GFLOP, most
# of it the variable selection's per-variable GRNs at each of the window's 64 bars), ~1.6 ms with Mamba-2: ~8.6 hours
# on one core.
# On a CPU it runs on 30,000 bars a symbol instead (about the fewest on which its agents' start step of 4,000 fits the
# config's own 30 epochs, so the plan scales it rather than refusing): the same members, sizes, precision and stacking
# (measured: exit 0 in 847 s with OMP_NUM_THREADS=1 on 2 shared, loaded cores).
CPU_ENSEMBLE_BARS = ["--data.synthetic_bars", "30000"]


@pytest.mark.slow
@pytest.mark.parametrize("name", FIT_CONFIGS)
def test_every_shipped_config_runs_as_a_smoke_run_or_fails_in_one_line(name: str, tmp_path: Path) -> None:
    """``--trainer.max_epochs 1 --trainer.limit_train_batches 10`` of every shipped fit config: it trains and exports,
    or exits 2 with one ``error:`` line and no traceback. ensemble.yaml without a GPU runs on 30,000 synthetic bars a
    symbol (``CPU_ENSEMBLE_BARS``: its 1,000,000 are hours of forecasting on a CPU) and must train and export."""
    import torch

    extra = CPU_ENSEMBLE_BARS if name == "ensemble" and not torch.cuda.is_available() else []
    start = time.monotonic()
    run, export = _smoke(name, tmp_path, *extra)
    if extra:  # every member trains, the agents on the stacked forecasts, and the export is written
        assert run.returncode == 0, run.stderr[-3000:]
    took = time.monotonic() - start
    if run.returncode == 0:
        assert (export / "metadata.json").is_file(), run.stdout[-2000:]
        assert "Traceback" not in run.stderr, run.stderr[-3000:]
    else:
        errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
        assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    scaled = [line.split(": ", 1)[1] for line in run.stderr.splitlines() if "scaled for this run" in line]
    print(f"{name}: exit {run.returncode} in {took:.0f} s", *scaled, sep="\n  ")


@pytest.mark.parametrize("optim, message", [
    ({"scheduler": "cosine", "warmup_steps": 100, "total_steps": 50}, r"warmup_steps \(100\) must be < total_steps \(50\)"),
    ({"scheduler": "plateau", "warmup_steps": 10}, "warmup_steps is not supported with the plateau scheduler"),
    ({"scheduler": "step", "step_size": 0}, "step_size must be > 0"),
])
def test_a_schedule_that_cannot_work_in_any_run_is_refused_when_the_member_is_built(optim, message) -> None:
    with pytest.raises(ValueError, match=message):
        _mamba(**optim)


def test_a_scaled_start_step_stays_after_the_first_step() -> None:
    """ensemble.yaml's agents start at 4,000 of 60,000 steps: in a 10-step run at step 1, still after the forecasters'
    first update (0 would start them on untrained forecasts, as no run of the config does)."""
    dqn = _dqn(optim={"start_step": 4000, "updates_per_step": 1})
    check_plan({"dqn": dqn, "tft": _mamba(scheduler="none")}, 2000, TrainerLimits(max_epochs=1, limit_train_batches=10),
               reference=TrainerLimits(max_epochs=30, limit_train_batches=2000))
    assert dqn.start_step == 1


@pytest.mark.parametrize("settings, message", [
    ({"val_check_interval": 50}, r"^q\.yaml: trainer\.val_check_interval: 50, but an epoch runs 10 training batches "
                                 r"and validation would never run; use at most 10"),
    ({"val_check_interval": 1.5}, r"^q\.yaml: trainer\.val_check_interval: 1\.5, but a float is the share of an "
                                  r"epoch's 10 training batches .* use a value in \(0, 1\]"),
    ({"min_epochs": 3, "max_epochs": 1}, r"^q\.yaml: trainer\.min_epochs: 3, but trainer\.max_epochs is 1, which stops "
                                         r"the fit first \(Lightning ignores min_epochs then\); use at most 1"),
    ({"min_steps": 30, "max_steps": 20}, r"^q\.yaml: trainer\.min_steps: 30, but trainer\.max_steps is 20"),
])
def test_trainer_settings_lightning_would_refuse_in_fit_or_ignore_are_one_line_before_it(settings, message) -> None:
    from foxhunt.lit.run_plan import check_trainer

    with pytest.raises(ConfigError, match=message):
        check_trainer({"check_val_every_n_epoch": 1, **settings}, 10, source="q.yaml: ")


def test_trainer_settings_that_fit_pass_and_a_time_bound_run_warns_about_late_members() -> None:
    from foxhunt.lit.run_plan import check_trainer

    check_trainer({"check_val_every_n_epoch": 1, "val_check_interval": 10, "min_epochs": 1, "max_epochs": 1}, 10)
    check_trainer({"check_val_every_n_epoch": None, "val_check_interval": 50}, 10)  # counted across epochs
    check_trainer({"max_epochs": -1, "min_epochs": 3}, 10)  # unbounded epochs
    with pytest.warns(UserWarning, match=r"trainer\.max_time 00:00:10:00 may stop this fit before a member starts "
                                         r"\('dqn' at step 150\)"):
        check_trainer({"max_time": "00:00:10:00"}, 10, paces={"tft": 0, "dqn": 150})


def test_a_dqn_batch_larger_than_its_replay_is_refused_when_it_is_built() -> None:
    with pytest.raises(ValueError, match=r"^batch_size=2048 exceeds replay_capacity=1024: .* use at most 1024"):
        DQNModule(window=4, hidden=(8,), n_envs=8, episode_length=16, batch_size=2048, replay_capacity=1024,
                  learning_starts=64)


def test_a_val_check_interval_beyond_the_epoch_fails_before_the_trainer(tmp_path: Path, monkeypatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    from foxhunt.fit import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LightningCLI, "instantiate_trainer", lambda *a, **k: pytest.fail("the Trainer was built"))
    with pytest.raises(ConfigError, match=r"tiny\.yaml: trainer\.val_check_interval: 100000, but an epoch runs \d+ "):
        build_cli(["--config", TINY, "--trainer.val_check_interval", "100000"], plan_before_trainer=True)


def test_a_tune_trials_trainer_keys_go_on_the_command_line_so_a_shortened_trial_scales(tmp_path: Path) -> None:
    import yaml

    from foxhunt.tune.space import compose_fit_config, load_tune_config, trainer_overrides

    base = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    study = tmp_path / "tune.yaml"
    study.write_text(yaml.safe_dump({
        "base_config": str(CONFIGS / "quickstart.yaml"), "fixed": {"trainer.max_epochs": 1},
        "search_space": {"model.members.dqn.optim.lr": {"type": "float", "low": 1e-4, "high": 1e-3, "log": True}}}))
    cfg = load_tune_config(study)
    params = {"model.members.dqn.optim.lr": 3e-4}
    written = compose_fit_config(cfg, params, trainer=False)
    assert written["trainer"] == base["trainer"]  # the run the config was sized for: the plan's reference
    assert written["model"]["members"]["dqn"]["init_args"]["optim"]["lr"] == 3e-4
    assert trainer_overrides(cfg, params) == ["--trainer.max_epochs", "1"]
    assert compose_fit_config(cfg, params)["trainer"]["max_epochs"] == 1  # the best config written in full
