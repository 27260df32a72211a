"""`python -m foxhunt.fit` end to end on tiny configs: TensorBoard, export, load, back-test, precision, resume."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import foxhunt
from foxhunt.data.bars import DataError
from foxhunt.fit import build_cli, main

TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")
ROOT = Path(__file__).resolve().parents[1]


class _capture_log:
    """Collect the messages of one logger inside a with block."""

    def __init__(self, name: str) -> None:
        import logging

        self.logger, self.records = logging.getLogger(name), []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.records.append(record.getMessage())  # type: ignore[method-assign]

    def __enter__(self) -> list[str]:
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)


def _fit(tmp_path: Path, *extra: str):
    args = ["--config", TINY, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
            "--trainer.default_root_dir", str(tmp_path), "--export_dir", str(tmp_path / "export"), *extra]
    return main(args)


def _event_file(tmp_path: Path) -> Path:
    files = sorted((tmp_path / "runs").rglob("events.out.tfevents*"))
    assert files, "no TensorBoard event file"
    return files[-1]


@dataclass
class TinyFit:
    """The module's one tiny fit: its directory and CLI, every warning it raised and what Lightning logged."""

    tmp: Path
    cli: Any
    warnings: list[warnings.WarningMessage]
    notices: list[str]


@pytest.fixture(scope="module")
def tiny_fit(tmp_path_factory) -> TinyFit:
    tmp = tmp_path_factory.mktemp("fit")
    with warnings.catch_warnings(record=True) as caught, _capture_log("lightning.pytorch") as notices:
        warnings.simplefilter("always")  # each one, however often it was raised before in this process
        cli = _fit(tmp, "--model.members.dqn.init_args.select_every", "2")  # the DQN chooses its weights on validation
    return TinyFit(tmp, cli, list(caught), list(notices))


@pytest.fixture(scope="module")
def tiny_run(tiny_fit: TinyFit):
    return tiny_fit.tmp, tiny_fit.cli


def test_the_fit_prints_no_warning_foxhunt_can_avoid(tiny_fit: TinyFit) -> None:
    """Every warning shown: the only one left is foxhunt's own about this config (the DQN's exploration outlasts the
    run); Lightning's deprecations of its own dependencies are hidden, and it logs no tip (its checkpoint tip has no
    cause: foxhunt's checkpoints are given to the Trainer; its cloud-logger advert is hidden)."""
    shown = [f"{w.category.__name__}: {w.message}" for w in tiny_fit.warnings
             if not (torch.cuda.is_available() and "GPU available but not used" in str(w.message))]  # tiny.yaml: cpu
    assert shown == ["UserWarning: member 'dqn': epsilon_steps=20 exceeds the 9 updates of this run: exploration ends "
                     "at epsilon 0.573, not epsilon_end=0.05"], shown
    assert Path(tiny_fit.warnings[-1].filename).is_relative_to(Path(foxhunt.__file__).parent)
    assert any("`Trainer.fit` stopped" in line for line in tiny_fit.notices)  # Lightning's log is captured
    assert not [line for line in tiny_fit.notices if "Tip" in line or "was configured so" in line], tiny_fit.notices


def test_only_the_named_outside_warnings_are_hidden() -> None:
    """``quiet_outside_causes`` hides Lightning's data-loader deprecation, raised by Lightning's module, while the
    same kind of warning raised anywhere else (as foxhunt would) still shows."""
    from lightning.pytorch.utilities import CombinedLoader

    from foxhunt.fit import quiet_outside_causes

    def raised(quiet: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_outside_causes() if quiet else contextlib.nullcontext():
                CombinedLoader([[1.0, 2.0]], "max_size_cycle")  # every fit's loaders go through it
                warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated (here)", FutureWarning, stacklevel=1)
        return [f"{Path(w.filename).name}: {w.message}" for w in caught]

    ours = "test_fit.py: `isinstance(treespec, LeafSpec)` is deprecated (here)"
    assert raised(quiet=True) == [ours]
    assert ours in raised(quiet=False) and any(line.startswith("_pytree.py: ") for line in raised(quiet=False))


def test_fit_logs_scalars_and_figures_to_tensorboard(tiny_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _ = tiny_run
    # the run's directory: the HPARAMS tab's final values are written after fit, into a second event file
    acc = EventAccumulator(str(_event_file(tmp).parent), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for tag in ("train/tft/loss", "train/dqn/td_loss", "train/dqn/epsilon", "train/dqn/q_mean", "val/sharpe",
                "val/tft/quantile_loss", "val/tft/coverage", "val/dqn/sharpe", "val/tft/sharpe", "val/ensemble/sharpe",
                "val/buy_and_hold/sharpe", "val/oracle/sharpe", "val/tft/weight", "grad_norm/tft/total",
                "grad_norm/dqn/total", "lr/tft", "lr/dqn"):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
    # one naming scheme: every scalar is stage/member/key, grad_norm/member/block or lr/member
    for tag in scalars - {"epoch", "val/sharpe"}:
        head = tag.split("/")
        assert head[0] in ("train", "val", "grad_norm", "lr", "hp") and len(head) == (2 if head[0] == "lr" else 3), tag
    images = set(acc.Tags()["images"])
    for tag in ("backtest/equity_val", "forecast/tft/fan_chart_val", "interpret/tft/variable_importance",
                "interpret/tft/attention"):
        assert tag in images, f"figure {tag} missing from {sorted(images)}"
    # the HPARAMS tab lists the policies' validation and test Sharpe, filled in with finite values at the end
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")
    infos = [plugin_data_pb2.HParamsPluginData.FromString(c).experiment for t, c in content.items() if "experiment" in t]
    named = {m.name.tag for e in infos for m in e.metric_infos}
    assert {"hp/test_sharpe/ensemble", "hp/val_sharpe/tft", "hp/test_sharpe/buy_and_hold"} <= named, named
    assert math.isfinite(acc.Scalars("hp/test_sharpe/ensemble")[-1].value)
    hparams = list((tmp / "runs").rglob("hparams.yaml"))
    assert hparams and "tft" in hparams[0].read_text()


def test_export_loads_without_trainer_and_matches(tiny_run) -> None:
    tmp, cli = tiny_run
    export = tmp / "export"
    names = {p.name for p in export.iterdir()}
    assert {"ensemble.safetensors", "tft.safetensors", "dqn.safetensors", "metadata.json"} <= names
    meta = json.loads((export / "metadata.json").read_text())
    assert meta["data"]["feature_names"][:2] == ["logret_1", "logret_2"]
    assert meta["versions"]["foxhunt"] == foxhunt.__version__
    assert "data" in meta["config"] and meta["data"]["fingerprint"]
    loaded = foxhunt.load(export)
    model = cli.model
    for name in ("val", "test"):  # bit for bit
        split = model.split(name)
        mine = model.positions(split)
        theirs = loaded.model.positions(split)
        for who in ("tft", "dqn", "ensemble"):
            assert torch.equal(theirs[who].cpu(), mine[who].cpu()), f"{who} positions on {name} differ after reload"
    split = model.split("test")
    # the loader recomputes features from bars with the exported statistics: same as the DataModule's
    rebuilt = loaded.split(cli.datamodule.bars)
    rows = torch.from_numpy(cli.datamodule.split_rows["test"])
    torch.testing.assert_close(rebuilt.features[rows], split.features)


def test_member_files_hold_the_weights_each_member_trades(tiny_run) -> None:
    """dqn.safetensors holds the network the DQN trades after its validation choice (policy_net, or nothing when it
    chose flat), not its learning network; the reloaded member trades exactly those weights."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from foxhunt.export.traded import traded_network

    tmp, cli = tiny_run
    export = tmp / "export"
    meta = json.loads((export / "metadata.json").read_text())
    dqn = cli.model.member("dqn")
    assert int(dqn.selected_update) >= 0 and len(dqn.selection.sharpes) > 0  # validation chose
    traded, net = traded_network(dqn)
    assert traded == ("flat" if int(dqn.selected_update) == 0 else "policy_net")
    assert meta["members"]["dqn"]["traded"] == traded and meta["members"]["tft"]["traded"] == "network"
    with safe_open(str(export / "dqn.safetensors"), framework="pt") as f:
        assert f.metadata()["traded"] == traded and f.metadata()["selected_update"] == str(int(dqn.selected_update))
    in_file = load_file(str(export / "dqn.safetensors"))
    loaded = foxhunt.load(export).model.member("dqn")
    if net is None:
        assert in_file == {} and loaded.holds_flat
    else:
        assert net is dqn.policy_net
        for key, value in loaded.policy_network.state_dict().items():
            assert torch.equal(in_file[key], value) and torch.equal(in_file[key], net.state_dict()[key].cpu())


def test_export_is_the_best_checkpoint_exactly(tiny_run) -> None:
    """Every exported tensor (combination weights included) is the best checkpoint's, except the do-no-harm rule's
    decisions, which the export re-applies with the whole run's candidate counts (never less cautious), and the
    printed test table is what the reloaded export computes."""
    from safetensors.torch import load_file

    tmp, cli = tiny_run
    best = cli.trainer.checkpoint_callback.best_model_path
    assert best and "best-" in best
    state = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
    exported = {k[len("model."):]: v for k, v in load_file(str(tmp / "export" / "ensemble.safetensors")).items()
                if k.startswith("model.")}
    assert set(exported) == {k for k in state if ".target_transform." not in k}
    rechecked = ("edge_confidence", "held_flat")
    for key, value in exported.items():
        if key not in rechecked:
            assert torch.equal(value, state[key].cpu()), f"{key} differs from the best checkpoint"
    # deflated for at least as many candidates: confidence no higher, and a member held flat at the checkpoint stays so
    assert (exported["edge_confidence"] <= state["edge_confidence"] + 1e-12).all()
    assert (exported["held_flat"] >= state["held_flat"]).all()
    assert torch.equal(exported["held_flat"], exported["edge_confidence"] < cli.model.hparams.min_edge_confidence)
    loaded = foxhunt.load(tmp / "export")
    table = loaded.model.evaluate(cli.model.split("test")).metrics
    for who, row in cli.results["backtest"].items():
        assert row["sharpe"] == pytest.approx(table[who]["sharpe"], abs=1e-9), who
    meta = json.loads((tmp / "export" / "metadata.json").read_text())
    assert meta["metrics"]["ensemble"]["sharpe"] == pytest.approx(
        loaded.model.evaluate(cli.model.split("val")).metrics["ensemble"]["sharpe"], abs=1e-9)


def test_load_refuses_mismatches(tiny_run, tmp_path: Path) -> None:
    """Edits of metadata.json are refused by its own SHA-256; re-sealed (a tool that knows the format), each mismatch
    is still refused by name."""
    import shutil

    from foxhunt.export.metadata import ExportError, metadata_digest

    src, _ = tiny_run
    bad = tmp_path / "bad"
    shutil.copytree(src / "export", bad)
    meta = json.loads((bad / "metadata.json").read_text())
    meta["members"]["tft"]["init_args"]["hidden_size"] = 12
    (bad / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=r"metadata\.json: its contents' SHA-256 .* recorded in its metadata_sha256"):
        foxhunt.load(bad)

    def write(meta: dict) -> None:
        meta["metadata_sha256"] = metadata_digest(meta)
        (bad / "metadata.json").write_text(json.dumps(meta))

    write(meta)
    with pytest.raises(ExportError, match=r"model tensor 'members\.tft\.net\..*' has shape"):
        foxhunt.load(bad)
    meta["members"]["tft"]["init_args"]["hidden_size"] = 8
    meta["members"]["tft"]["class_path"] = "os.system"
    write(meta)
    with pytest.raises(ExportError, match="not one of foxhunt's"):
        foxhunt.load(bad)
    meta["members"]["tft"]["class_path"] = "foxhunt.lit.tft.TFTModule"
    meta["versions"]["foxhunt"] = "9.9.0"
    write(meta)
    with pytest.raises(ExportError, match=r"exported by foxhunt 9\.9\.0"):
        foxhunt.load(bad)
    meta["versions"]["foxhunt"] = foxhunt.__version__
    meta["data"]["feature_names"] = ["logret_2", "logret_1"] + meta["data"]["feature_names"][2:]
    write(meta)
    with pytest.raises(ExportError, match="feature order differs"):
        foxhunt.load(bad)
    assert not list(bad.glob("*.pt")) and not list(bad.glob("*.pkl"))


def test_backtest_cli_on_unseen_data(tiny_run, tmp_path: Path, capsys) -> None:
    from foxhunt.backtest import main as backtest_main
    from foxhunt.data.synthetic import generate_market

    src, _ = tiny_run
    path = generate_market(n_bars=3000, seed=11, signal_strength=0.3, start="2024-03-04").write(tmp_path / "unseen.parquet")
    results = backtest_main(["--checkpoint", str(src / "export"), "--data", str(path), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for who in ("tft", "dqn", "ensemble", "buy_and_hold"):
        assert who in results and who in out
        for key in ("total_log_return", "sharpe", "sortino", "max_drawdown", "turnover", "hit_rate", "n_trades"):
            assert key in results[who]
    assert (tmp_path / "backtest.json").exists() and (tmp_path / "equity.png").stat().st_size > 1000

    def no_constants(name: str) -> float:
        raise AssertionError(f"backtest.json holds {name}, which strict JSON parsers refuse")

    written = json.loads((tmp_path / "backtest.json").read_text(), parse_constant=no_constants)
    assert set(written) == set(results)
    nan_keys = [(who, k) for who, m in results.items() for k, v in m.items() if isinstance(v, float) and v != v]
    assert nan_keys  # a figure without a value (e.g. a held-flat member's hit rate) is there, written as null
    assert all(written[who][k] is None for who, k in nan_keys)
    results = backtest_main(["--checkpoint", str(src / "export"), "--split", "test", "--out", str(tmp_path)])
    assert "oracle" in results  # the synthetic training data knows its oracle


def test_backtest_refuses_bars_the_model_trained_on(tiny_run, tmp_path: Path, capsys) -> None:
    """A file whose dates overlap the training/validation span is refused; with --allow-overlap a second table is
    computed on the bars after that span only. A symbol the model never saw is refused in one line (its TFT reads the
    symbol)."""
    from foxhunt.backtest import main as backtest_main
    from foxhunt.data.synthetic import generate_market

    src, _ = tiny_run
    overlapping = generate_market(n_bars=8000, seed=11, signal_strength=0.3).write(tmp_path / "overlap.parquet")
    with pytest.raises(DataError, match=r"overlap.parquet: it overlaps the time span the model was trained or selected on \(.*any symbol: SYN0 [0-9,]+ bars\)"):
        backtest_main(["--checkpoint", str(src / "export"), "--data", str(overlapping), "--out", str(tmp_path)])
    backtest_main(["--checkpoint", str(src / "export"), "--data", str(overlapping), "--out", str(tmp_path), "--allow-overlap"])
    out = capsys.readouterr().out
    assert "split: overlap.parquet" in out and "split: overlap.parquet (bars after the training span)" in out
    other = generate_market(n_bars=3000, seed=12, start="2024-03-04", symbols=["OTHER"]).write(tmp_path / "other.parquet")
    with pytest.raises(DataError, match=r"^other.parquet: symbol OTHER never seen by the model, which knows SYN0; member tft reads"):
        backtest_main(["--checkpoint", str(src / "export"), "--data", str(other), "--out", str(tmp_path)])


def test_cli_conventions(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", TINY, "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "hidden_size: 8" in printed and "synthetic_bars: 5000" in printed
    # a parse error is raised (python -m foxhunt.fit prints it as one line and exits 2: tests/test_cli_errors.py)
    with pytest.raises(argparse.ArgumentError, match="no_such_key"):
        main(["--config", TINY, "--model.members.tft.init_args.no_such_key", "3"])
    with pytest.raises(argparse.ArgumentError, match="combine"):
        main(["--config", TINY, "--model.combine", "average"])


def test_a_refused_value_names_the_key_of_the_configured_object(tmp_path: Path, monkeypatch) -> None:
    """A value refused inside a helper the data module builds (its FeatureSet) is named as the data's, not the
    model's; the same for the run-level torch_threads, refused before any object is built."""
    from foxhunt.cli_errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"tiny\.yaml: data: unknown feature name\(s\) \['nope'\]"):
        build_cli(["--config", TINY, "--data.features", "[nope]"])
    with pytest.raises(ConfigError, match=r"tiny\.yaml: data: unknown feature family 'nope'"):
        build_cli(["--config", TINY, "--data.feature_families", "[nope]"])
    with pytest.raises(ConfigError, match=r"tiny\.yaml: model\.members\.tft \(TFTModule\): quantiles"):
        build_cli(["--config", TINY, "--model.members.tft.init_args.quantiles", "[0.9, 0.1]"])
    for threads in ("0", "-2"):  # 0 was silently ignored, -2 a RuntimeError traceback from torch
        with pytest.raises(ConfigError, match=rf"torch_threads: must be a positive number of threads.*got {threads}"):
            build_cli(["--config", TINY, "--torch_threads", threads])


def test_seed_everything_offsets_the_agents_own_seeds(tmp_path: Path, monkeypatch) -> None:
    """A new run seed gives new agents (their weights, environments, exploration come from their own seed), and
    seed_everything 0 leaves the configured seeds alone."""
    monkeypatch.chdir(tmp_path)
    seeds = {}
    for extra in ((), ("--seed_everything", "3"), ("--seed_everything", "3", "--model.members.dqn.init_args.seed", "5")):
        cli = build_cli(["--config", TINY, *extra])
        seeds[extra] = cli.model.members["dqn"].hparams.seed
        assert cli.model.members["dqn"].seed == seeds[extra]
        assert cli.config["model"]["members"]["dqn"]["init_args"]["seed"] == (5 if len(extra) > 2 else 0)  # as written
    assert list(seeds.values()) == [0, 3, 8]


def test_bf16_mixed_on_cpu_runs_without_nan(tmp_path: Path) -> None:
    cli = _fit(tmp_path, "--trainer.precision", "bf16-mixed", "--trainer.max_epochs", "1", "--backtest", "false")
    for p in cli.model.parameters():
        assert torch.isfinite(p).all()
    assert cli.model.updates["tft"] > 0 and cli.model.updates["dqn"] > 0


def _fit_argv(tmp: Path, extra: tuple[str, ...], version: bool) -> list[str]:
    """``python -m foxhunt.fit``'s arguments for a fit of the tiny config in ``tmp``; ``version``: log to version_0
    always (else a new version a run)."""
    return ["--config", TINY, "--trainer.max_epochs", "2", "--trainer.logger.init_args.save_dir", str(tmp / "runs"),
            *(("--trainer.logger.init_args.version", "0") if version else ()),
            "--trainer.default_root_dir", str(tmp), "--export_dir", str(tmp / "export"), "--backtest", "false",
            "--trainer.enable_progress_bar", "false", "--torch_threads", "1", *extra]


def _fit_subprocess(tmp: Path, *extra: str, version: bool = True) -> subprocess.CompletedProcess:
    """``python -m foxhunt.fit`` on the tiny config, as a command (its own interpreter: a DDP launch re-runs it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "foxhunt.fit", *_fit_argv(tmp, extra, version)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def _fit_process(tmp: Path, *extra: str, version: bool = True) -> subprocess.CompletedProcess:
    """One fit as :func:`_fit_processes` runs them."""
    return _fit_processes((tmp, extra, version))[0]


def _fit_processes(*runs: tuple[Path, tuple[str, ...], bool]) -> list[subprocess.CompletedProcess]:
    """Independent fits (``(tmp, extra, version)`` as :func:`_fit_argv` takes them) run side by side, each a fresh
    process on one thread in its own folder, forked from a server that imported foxhunt.fit once (a fresh interpreter
    pays ~6 s of CPU for Lightning's import, more than the fit): on two cores two fits take the time of one, and what
    each writes depends on nothing the other does. Returns each one's exit status (-9: killed) and output."""
    import multiprocessing

    from _resume_helpers import fit_command

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["foxhunt.fit", "foxhunt.tune"])  # as test_tune: the session has one server
    procs = []
    for i, (tmp, extra, version) in enumerate(runs):
        tmp.mkdir(parents=True, exist_ok=True)
        argv, out = _fit_argv(tmp, extra, version), (tmp / f"fit-{i}.stdout", tmp / f"fit-{i}.stderr")
        proc = ctx.Process(target=fit_command, args=(argv, str(out[0]), str(out[1])))
        proc.start()
        procs.append((argv, proc, out))
    done = []
    for argv, proc, (stdout, stderr) in procs:
        proc.join(timeout=600)
        if proc.exitcode is None:
            proc.kill()
            raise subprocess.TimeoutExpired(argv, 600, stdout.read_text(), stderr.read_text())
        done.append(subprocess.CompletedProcess(argv, proc.exitcode, stdout.read_text(), stderr.read_text()))
    return done


def _batch_log(path: Path) -> tuple[str, ...]:
    """Fit arguments that log every training batch the run sees to ``path`` (``_resume_helpers.BatchLog``)."""
    return ("--trainer.callbacks+=_resume_helpers.BatchLog", f"--trainer.callbacks.path={path}")


def _batches(path: Path) -> list[str]:
    """(epoch, batch index, decision rows) of every training batch a run logged, one string each."""
    return path.read_text().splitlines()


def _assert_same_final_tensors(tmp_path: Path, a: str, b: str) -> None:
    """The runs ``a`` and ``b`` end with bit-identical weights (last.ckpt) and exports."""
    from safetensors.torch import load_file

    def final(run: str) -> dict[str, torch.Tensor]:
        ckpt = torch.load(tmp_path / run / "runs" / "foxhunt" / "version_0" / "checkpoints" / "last.ckpt",
                          map_location="cpu", weights_only=True)
        assert ckpt["epoch"] == 1
        return ckpt["state_dict"]

    for key_a, key_b in ((final(a), final(b)),
                         (load_file(str(tmp_path / a / "export" / "ensemble.safetensors")),
                          load_file(str(tmp_path / b / "export" / "ensemble.safetensors")))):
        assert key_a.keys() == key_b.keys()
        differ = [key for key in key_a if not torch.equal(key_a[key], key_b[key])]
        assert not differ, f"{len(differ)} of {len(key_a)} tensors differ after resume, e.g. {differ[:5]}"


def test_resume_after_kill_is_exact(tmp_path: Path) -> None:
    """A run killed after its first epoch (of two) and resumed from last.ckpt sees the batches of an uninterrupted
    run's second epoch and ends with its weights, bit for bit."""
    whole, killed = _fit_processes(
        (tmp_path / "whole", _batch_log(tmp_path / "whole.batches"), True),
        (tmp_path / "cut", ("--trainer.callbacks+=_resume_helpers.KillAfterEpoch", "--trainer.callbacks.epoch=0",
                            *_batch_log(tmp_path / "killed.batches")), True))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert killed.returncode == -9, killed.stderr[-3000:]
    last = tmp_path / "cut" / "runs" / "foxhunt" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.exists()
    resumed = _fit_process(tmp_path / "cut", "--ckpt_path", str(last), *_batch_log(tmp_path / "resumed.batches"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    seen = _batches(tmp_path / "whole.batches")
    assert len(seen) == 12 and _batches(tmp_path / "killed.batches") == seen[:6]
    assert _batches(tmp_path / "resumed.batches") == seen[6:]
    _assert_same_final_tensors(tmp_path, "whole", "cut")


def test_a_resumed_run_exports_the_best_checkpoint_of_the_whole_run(tmp_path: Path) -> None:
    """The audit's drill: a run killed after its second epoch (of four) and resumed with --ckpt_path last (logging
    to a new version) exports the checkpoint an uninterrupted run exports, though that best epoch came before the
    cut: the resumed run checkpoints where the run it resumes did, so Lightning restores its best score."""
    from safetensors.torch import load_file

    def best(run: subprocess.CompletedProcess) -> Path:
        (line,) = [x for x in run.stderr.splitlines() if "loaded the best checkpoint" in x]
        return Path(line.split("loaded the best checkpoint ")[1].split(" for export")[0])

    common = ("--trainer.max_epochs", "4", "--log_figures", "false", "--hparams_tab", "false")
    whole, killed = _fit_processes(
        (tmp_path / "whole", common, False),
        (tmp_path / "cut", (*common, "--trainer.callbacks+=_resume_helpers.KillAfterEpoch", "--trainer.callbacks.epoch=1"),
         False))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _fit_process(tmp_path / "cut", *common, "--ckpt_path", "last", version=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    runs = tmp_path / "cut" / "runs" / "foxhunt"
    assert f"resuming from {runs / 'version_0' / 'checkpoints' / 'last.ckpt'}" in resumed.stderr
    assert (runs / "version_1").is_dir()  # the resumed run logs to its own version ...
    assert best(resumed).parent == runs / "version_0" / "checkpoints"  # ... and checkpoints with the run it resumes
    assert "dirpath has changed" not in resumed.stderr and "exists and is not empty" not in resumed.stderr
    # the uninterrupted run's best epoch came before the cut: the resumed run only had it if it kept the state
    assert best(whole).name == best(resumed).name and best(whole).name.startswith(("best-epoch=0-", "best-epoch=1-"))
    a = load_file(str(tmp_path / "whole" / "export" / "ensemble.safetensors"))
    b = load_file(str(tmp_path / "cut" / "export" / "ensemble.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs between the uninterrupted and the resumed run's export"
    metrics = [json.loads((tmp_path / run / "export" / "metadata.json").read_text())["metrics"] for run in ("whole", "cut")]
    assert metrics[0] == metrics[1]
    assert sorted(p.name for p in (runs / "version_0" / "checkpoints").glob("*.ckpt")) == [best(whole).name, "last.ckpt"]
    final = torch.load(runs / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["epoch"] == 3


def test_periodic_checkpoints_inside_an_epoch_and_ckpt_path_last_resumes_from_the_newest(tmp_path: Path) -> None:
    """--checkpoint_every_n_steps 2: a run killed at the third step of its second epoch loses one step, not the
    epoch; --ckpt_path last picks that mid-epoch checkpoint (the newest that loads), and the resumed run sees exactly
    the batches an uninterrupted run sees from there (none replayed, none skipped: the training loader's position
    is in the checkpoint) and ends with its weights and export, bit for bit."""
    periodic_every = ("--checkpoint_every_n_steps", "2")
    whole, killed = _fit_processes(
        (tmp_path / "whole", (*periodic_every, *_batch_log(tmp_path / "whole.batches")), True),
        (tmp_path / "cut", (*periodic_every, "--trainer.callbacks+=_resume_helpers.KillAtBatch",
                            "--trainer.callbacks.epoch=1", "--trainer.callbacks.batch=2",
                            *_batch_log(tmp_path / "killed.batches")), True))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert killed.returncode == -9, killed.stderr[-3000:]
    ckpts = tmp_path / "cut" / "runs" / "foxhunt" / "version_0" / "checkpoints"
    epoch_end = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)
    periodic = torch.load(ckpts / "last-steps.ckpt", map_location="cpu", weights_only=True)
    assert epoch_end["epoch"] == 0 and periodic["epoch"] == 1 and periodic["global_step"] > epoch_end["global_step"]
    assert periodic["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 2  # 2 steps in
    assert not list(ckpts.glob(".*.tmp"))  # written atomically: no temporary file left beside them
    resumed = _fit_process(tmp_path / "cut", "--ckpt_path", "last", *periodic_every,
                              *_batch_log(tmp_path / "resumed.batches"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {ckpts / 'last-steps.ckpt'}" in resumed.stderr
    final = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["epoch"] == 1 and final["global_step"] > periodic["global_step"]
    # 6 batches an epoch: the killed run trained epoch 0 and batches 0-2 of epoch 1, the last after its periodic
    # checkpoint, so the resumed run starts again at batch 2, and from there sees the uninterrupted run's batches
    seen = _batches(tmp_path / "whole.batches")
    assert len(seen) == 12 and _batches(tmp_path / "killed.batches") == seen[:9]
    assert _batches(tmp_path / "resumed.batches") == seen[8:]
    _assert_same_final_tensors(tmp_path, "whole", "cut")
    # the loader's position that brought it back (epoch 1, 2 batches served); Lightning sees a resumable loader
    assert "dataloader is not resumable" not in resumed.stderr
    assert {k: periodic["BarDataModule"]["train_batches"][k] for k in ("epoch", "served")} == {"epoch": 1, "served": 2}


TFT_ONLY = {"class_path": "foxhunt.lit.tft.TFTModule", "init_args": {"hidden_size": 8, "attention_heads": 2, "hidden_continuous_size": 4}}
DQN_ONLY = {"class_path": "foxhunt.lit.dqn.DQNModule", "init_args": {"window": 4, "n_envs": 16, "episode_length": 64,
            "hidden": [16], "batch_size": 32, "replay_capacity": 4096, "learning_starts": 256,
            "optim": {"updates_per_step": 4}}}


@pytest.mark.parametrize(
    "extra, members",
    [
        (("--model.combine", "stack"), ("tft", "dqn")),
        (("--model.combine", "vote", "--trainer.max_epochs", "1"), ("tft", "dqn")),
        (("--model.members", json.dumps({"tft": TFT_ONLY}), "--trainer.max_epochs", "1"), ("tft",)),
        (("--model.members", json.dumps({"dqn": DQN_ONLY}), "--trainer.max_epochs", "1"), ("dqn",)),
    ],
    ids=["stack", "vote", "tft-only", "dqn-only"],
)
def test_combinations_and_single_members(tmp_path: Path, extra: tuple[str, ...], members: tuple[str, ...]) -> None:
    cli = _fit(tmp_path, *extra)
    model = cli.model
    assert tuple(model.member_names) == members
    table = cli.results["backtest"]
    assert {"ensemble", "buy_and_hold", *members} <= set(table)
    if model.hparams.combine == "stack":
        # the DQN saw the TFT snapshot's forecasts as extra inputs, and the TFT never trained on the DQN's bars
        tft, dqn = model.member("tft"), model.member("dqn")
        n_stack = tft.horizon * len(tft.quantiles)
        assert dqn.train_split.n_features == len(cli.datamodule.feature_names) + n_stack
        dm = cli.datamodule
        tft_rows = dm.train_window_mask.nonzero().squeeze(1)
        dqn_first = dm.train_split.timestamps[~model._stack_cut(dm.train_split)].min()
        horizon = tft.horizon
        # the last TFT window's targets (rows t..t+H-1, returns reaching row t+H) end before the DQN's first bar
        assert int(dm.train_split.timestamps[tft_rows.max() + horizon]) < int(dqn_first)
        assert int(dm.train_split.timestamps[tft_rows].max()) < int(dqn_first)
        assert int(dqn.train_split.timestamps.min()) >= int(dqn_first)
        assert table["ensemble"]["sharpe"] == table["dqn"]["sharpe"]
    loaded = foxhunt.load(tmp_path / "export")
    assert tuple(loaded.model.member_names) == members


def test_16_mixed_clips_and_logs_unscaled_gradients(tmp_path: Path) -> None:
    """Under a GradScaler, per-member clipping and grad-norm logging see unscaled gradients."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import MixedPrecision

    from foxhunt.training.gradnorm import grad_norms

    seen: list[tuple[str, float, float]] = []

    class Probe(Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:  # runs before the module's hook
            name = module.stepping_member
            net = module.member(name).network
            self.name, self.before = name, grad_norms(net)[next(iter(grad_norms(net)))]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if getattr(self, "name", None) is not None:
                net = module.member(self.name).network
                after = torch.norm(torch.stack([p.grad.norm() for p in net.parameters() if p.grad is not None]))
                seen.append((self.name, float(self.before), float(after)))

    import lightning.pytorch as pl

    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.lit.dqn import DQNModule
    from foxhunt.lit.ensemble import EnsembleModule

    feats = ["logret_1", "logret_2", "rsi_14", "tod_sin", "tod_cos"]
    dm = BarDataModule(synthetic_bars=3000, features=feats, known_future=["tod_sin", "tod_cos"], lookback=8, horizon=2,
                       batch_size=16, cache_dir=None)
    # fp16 autocast on CPU has no LSTM kernel, so the DQN member carries this check (the coordinator's code path
    # for clipping and grad norms is the same for both members)
    dqn = DQNModule(window=4, n_envs=16, episode_length=32, hidden=(16,), batch_size=32, replay_capacity=2048,
                    learning_starts=64,
                    optim={"log_grad_norm_every": 1, "updates_per_step": 1, "gradient_clip_val": None})
    model = EnsembleModule(members={"dqn": dqn}, gradient_clip_val=1e-3)
    scale = 2.0**14
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scale))
    trainer = pl.Trainer(accelerator="cpu", plugins=[plugin], max_steps=4, limit_val_batches=1, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[Probe()],
                         default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    assert seen, "no optimizer step reached the probe"
    for name, before, after in seen:
        assert name == "dqn"
        assert 1e-6 < before < 1e3, f"gradient norm {before} looks scaled by {scale}"
        assert after <= 1e-3 * (1 + 1e-3), f"clipped norm {after} exceeds the clip value"


@pytest.mark.slow
def test_ddp_two_processes_on_cpu(tmp_path: Path) -> None:
    """Two gloo ranks train the ensemble for a few steps; each rank explores with its own environment seed."""
    run = _fit_subprocess(tmp_path, "--trainer.strategy", "ddp_find_unused_parameters_true", "--trainer.devices", "2",
                          "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1")
    assert run.returncode == 0, run.stderr[-4000:]
    ckpt = torch.load(tmp_path / "runs" / "foxhunt" / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)
    assert ckpt["global_step"] > 0
    assert (tmp_path / "export" / "ensemble.safetensors").exists()


def _replay_tensor(checkpoint: dict) -> torch.Tensor:
    """The largest tensor of the DQN's replay buffer in a fit checkpoint (the bar indices of its transitions)."""
    found: list[torch.Tensor] = []

    def walk(x, inside: bool) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, inside or k == "replay")
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, inside)
        elif inside and isinstance(x, torch.Tensor):
            found.append(x)

    walk(checkpoint, False)
    return max(found, key=lambda t: t.numel() * t.element_size())


def test_flipped_bytes_in_a_checkpoint_replay_buffer_are_refused_naming_the_file(tiny_run, tmp_path: Path) -> None:
    """The issue's drill: 16 bytes flipped inside the replay buffer of last.ckpt loaded, trained, then failed with an
    IndexError far away. The checkpoint's SHA-256 catches it: one line naming the file, and --ckpt_path last skips it."""
    import shutil

    from foxhunt.training.checkpoint_io import CheckpointError, checkpoint_problem

    src, _ = tiny_run
    last = next((src / "runs").rglob("last.ckpt"))
    bad = tmp_path / "runs" / "foxhunt" / "version_0" / "checkpoints" / "last.ckpt"
    bad.parent.mkdir(parents=True)
    shutil.copy(last, bad)
    replay = _replay_tensor(torch.load(bad, map_location="cpu", weights_only=True))
    raw = replay.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    data = bytearray(bad.read_bytes())
    # a stretch of the buffer's filled part that occurs once in the file
    stretch = next(raw[i:i + 64] for i in range(0, len(raw) - 64, 64)
                   if raw[i:i + 64].count(0) < 56 and bytes(data).count(raw[i:i + 64]) == 1)
    at = bytes(data).find(stretch)
    for i in range(16):
        data[at + i] ^= 0xFF
    bad.write_bytes(bytes(data))
    torch.load(bad, map_location="cpu", weights_only=True)  # torch itself reads it without a word
    assert checkpoint_problem(last) is None
    assert "differ from the SHA-256 recorded when it was saved" in (checkpoint_problem(bad) or "")
    with pytest.raises(CheckpointError, match=rf"^{bad}: not a checkpoint to resume from: its contents differ"):
        _fit(tmp_path, "--ckpt_path", str(bad), "--trainer.max_epochs", "3", "--backtest", "false")


def test_a_changed_best_checkpoint_is_not_exported(tiny_run, tmp_path: Path, monkeypatch) -> None:
    """The audit's drill: bytes flipped inside a weight of the best checkpoint after it was written. The export reads
    it through the verified path: one line naming the file, and no export written."""
    import shutil

    from foxhunt.cli_errors import UserError
    from foxhunt.training.checkpoint_io import CheckpointError

    _, cli = tiny_run
    best = Path(cli.trainer.checkpoint_callback.best_model_path)
    bad = tmp_path / best.name
    shutil.copy(best, bad)
    state = torch.load(bad, map_location="cpu", weights_only=True)["state_dict"]
    key = next(k for k, v in state.items() if v.is_floating_point() and v.numel() >= 64)
    raw = state[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes()[:16]
    blob = bytearray(bad.read_bytes())
    at = bytes(blob).find(raw)
    assert at > 0 and bytes(blob).count(raw) == 1
    for i in range(16):
        blob[at + i] ^= 0xFF
    bad.write_bytes(bytes(blob))
    monkeypatch.setattr(cli.trainer.checkpoint_callback, "best_model_path", str(bad))
    monkeypatch.setitem(cli.config, "export_dir", str(tmp_path / "export"))
    with pytest.raises(CheckpointError) as info:
        cli.export_and_backtest()
    assert isinstance(info.value, UserError)  # python -m foxhunt.fit: "error: <file>: ..." and exit status 2
    assert str(info.value) == (f"{bad}: not a checkpoint to export: its contents differ from the SHA-256 recorded "
                               "when it was saved (corrupted after writing)")
    assert not (tmp_path / "export").exists()


def test_ckpt_path_last_resumes_the_newest_run(tiny_run, caplog) -> None:
    tmp, first = tiny_run
    with caplog.at_level("INFO", logger="foxhunt.fit"):
        cli = _fit(tmp, "--ckpt_path", "last", "--trainer.max_epochs", "3", "--backtest", "false",
                   "--model.members.dqn.init_args.select_every", "2")
    assert "resuming from" in caplog.text and "version_0/checkpoints/last.ckpt" in caplog.text
    assert cli.trainer.current_epoch == 3 and cli.trainer.global_step > first.trainer.global_step
    # the best checkpoint (the export) is the best of the whole run, in the directory the run checkpointed to
    ours, theirs = cli.trainer.checkpoint_callback, first.trainer.checkpoint_callback
    assert "checkpoints continue in" in caplog.text and ours.dirpath == theirs.dirpath
    assert float(ours.best_model_score) >= float(theirs.best_model_score)
    assert Path(ours.best_model_path).parent == Path(theirs.best_model_path).parent


def test_ensemble_dqn_steps_its_agents_every_env_step_every_updates(tmp_path: Path) -> None:
    """The coordinator paces the DQN member's environment like the DQN alone: N agents every k-th update."""
    import lightning.pytorch as pl

    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.lit.dqn import DQNModule
    from foxhunt.lit.ensemble import EnsembleModule

    feats = ["logret_1", "logret_2", "rsi_14"]
    dm = BarDataModule(synthetic_bars=3000, features=feats, known_future=[], lookback=8, horizon=2, batch_size=16,
                       cache_dir=None)
    dqn = DQNModule(window=4, n_envs=16, episode_length=32, hidden=(16,), batch_size=32, replay_capacity=2048,
                    learning_starts=64, env_step_every=3, optim={"updates_per_step": 1})
    model = EnsembleModule(members={"dqn": dqn})
    trainer = pl.Trainer(accelerator="cpu", max_steps=7, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    updates = model.updates["dqn"]
    assert updates >= 7
    assert dqn.env_steps == 64 + math.ceil(updates / 3) * 16  # warm-up, then one step of all agents per 3 updates


def test_16_mixed_each_member_unscales_at_its_own_scale_and_skipped_steps_leave_schedules_alone(tmp_path: Path) -> None:
    """Lightning updates a GradScaler's scale after every optimizer step, and the coordinator steps one optimizer per
    member: each member's gradients must be made at the scale its own step unscales by (one backward of the sum would
    leave the second member's gradients off by the first step's change), and a step the scaler skips on overflow
    (inf gradients at a huge initial scale) must leave the member's LR schedule, update count and target sync alone."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.lit.dqn import DQNModule
    from foxhunt.lit.ensemble import EnsembleModule
    from foxhunt.lit.ppo import PPOModule

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=4)

    class Plugin(MixedPrecision):
        """Records the scale each backward runs at and the scale each step unscales by."""

        log: list[tuple[str, float]] = []

        def pre_backward(self, tensor, module):
            self.log.append(("backward", scaler.get_scale()))
            return super().pre_backward(tensor, module)

        def optimizer_step(self, optimizer, model, closure, **kwargs):
            self.log.append(("step", scaler.get_scale()))
            return super().optimizer_step(optimizer, model, closure, **kwargs)

    feats = ["logret_1", "logret_2", "rsi_14", "tod_sin", "tod_cos"]
    dm = BarDataModule(synthetic_bars=3000, features=feats, known_future=["tod_sin", "tod_cos"], lookback=8, horizon=2,
                       batch_size=16, cache_dir=None)
    dqn = DQNModule(window=4, n_envs=16, episode_length=32, hidden=(16,), batch_size=32, replay_capacity=2048,
                    learning_starts=64,
                    optim={"updates_per_step": 1, "scheduler": "cosine", "total_steps": 100, "warmup_steps": 2})
    ppo = PPOModule(window=4, n_envs=8, n_steps=16, n_minibatches=2, n_epochs=1, hidden=(16,),
                    optim={"updates_per_step": 2})
    model = EnsembleModule(members={"dqn": dqn, "ppo": ppo}, gradient_clip_val=1.0)
    plugin = Plugin("16-mixed", "cpu", scaler=scaler)
    trainer = pl.Trainer(accelerator="cpu", plugins=[plugin], max_steps=60, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)

    steps = [i for i, (what, _) in enumerate(plugin.log) if what == "step"]
    assert len(steps) > 10
    for i in steps:  # the last backward before each step ran at the scale that step unscales by
        backward = max(j for j in range(i) if plugin.log[j][0] == "backward")
        assert plugin.log[backward][1] == plugin.log[i][1], plugin.log[backward - 1:i + 1]
    skipped = {n: model.member(n).guard.scaler_skipped for n in ("dqn", "ppo")}
    assert all(s > 0 for s in skipped.values()), skipped  # 2**24 overflows fp16 gradients at first
    assert sum(skipped.values()) + sum(model.updates.values()) == len(steps)
    for name in ("dqn", "ppo"):
        sched = model._schedulers[name]
        assert sched.last_epoch == model.updates[name] > 0, (name, sched.last_epoch, model.updates[name])
        assert model.member(name).guard.skipped == 0, model.member(name).guard.state_dict()  # overflow is the scaler's, not the non-finite guard's
