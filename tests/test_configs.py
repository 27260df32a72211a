"""Every shipped fit config builds through ``foxhunt.fit``'s CLI (parse, validate, instantiate; no training), and
each member receives exactly the values its config writes: a renamed or mistyped key fails here, not in a user's run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from foxhunt.fit import build_cli

CONFIGS = Path(__file__).resolve().parents[1] / "lightning_configs"
FIT_CONFIGS = sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem != "tune")  # tune.yaml is a study, not a fit


def _plain(value: object) -> object:
    """Lists and tuples compare equal (YAML gives lists, hyperparameters may hold tuples)."""
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value


def test_the_shipped_fit_configs_are_the_expected_ones() -> None:
    assert {"quickstart", "dqn", "ppo", "tft", "mamba2", "ensemble"} <= set(FIT_CONFIGS)


@pytest.mark.parametrize("name", FIT_CONFIGS)
def test_every_shipped_config_builds_with_its_values(name, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # loggers and checkpoints write under the working directory
    path = CONFIGS / f"{name}.yaml"
    config = yaml.safe_load(path.read_text())
    cli = build_cli(["--config", str(path)])
    members = config["model"]["members"]
    assert set(cli.model.member_names) == set(members)
    for member_name, spec in members.items():
        member = cli.model.member(member_name)
        assert f"{type(member).__module__}.{type(member).__name__}" == spec["class_path"]
        for key, value in (spec.get("init_args") or {}).items():
            if key == "optim":  # the optimisation settings: the fields it gives, beside the member's defaults
                for field, v in value.items():
                    assert _plain(member.hparams.optim[field]) == _plain(v), (name, member_name, key, field)
                    assert _plain(getattr(member.optim, field)) == _plain(v), (name, member_name, key, field)
                continue
            assert _plain(member.hparams[key]) == _plain(value), (name, member_name, key)
    # do no harm: every shipped config, and the coordinator by default, hold a member without a significant
    # validation edge after costs flat (a config that turned the rule off would let such a member pay costs)
    assert cli.model.hparams.min_edge_confidence == 0.95, name


def test_the_coordinator_does_no_harm_by_default() -> None:
    import inspect

    from foxhunt.lit.ensemble import EnsembleModule

    assert inspect.signature(EnsembleModule.__init__).parameters["min_edge_confidence"].default == 0.95


def test_a_partial_optim_keeps_the_members_other_defaults(tmp_path, monkeypatch) -> None:
    """``optim`` given in part (YAML, through foxhunt.fit's parser): the fields it names are set, every other field
    keeps that member's own default (the DQN's constant 3e-4 and clip 10, the TFT's cosine and weight decay)."""
    from foxhunt.lit.dqn import DQNModule, DQNOptimization
    from foxhunt.lit.tft import TFTModule, TFTOptimization

    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((Path(__file__).parent / "configs" / "tiny.yaml").read_text())
    members = config["model"]["members"]
    members["tft"]["init_args"]["optim"] = {"lr": 0.002}
    members["dqn"]["init_args"]["optim"] = {"scheduler": "cosine", "warmup_steps": 3}
    path = tmp_path / "partial.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = build_cli(["--config", str(path), "--model.members.dqn.init_args.optim.start_step", "2"])
    tft, dqn = cli.model.member("tft"), cli.model.member("dqn")
    assert isinstance(tft, TFTModule) and isinstance(dqn, DQNModule)
    assert tft.optim == TFTOptimization(lr=0.002)
    assert dqn.optim == DQNOptimization(scheduler="cosine", warmup_steps=3, start_step=2)
    assert (dqn.optim.lr, dqn.optim.weight_decay, dqn.optim.gradient_clip_val, dqn.optim.updates_per_step) == (
        3e-4, 0.0, 10.0, 16)
    assert (tft.optim.scheduler, tft.optim.weight_decay, tft.optim.log_grad_norm_every) == ("cosine", 1e-4, 50)
    assert dqn.start_step == 2 and dqn.hparams.optim == dqn.optim.as_dict()
