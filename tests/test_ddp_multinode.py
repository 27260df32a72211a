"""The multi-node training path on one machine: two ``torchrun`` "nodes" of one process each (static rendezvous on
localhost, gloo on the CPU) train the ensemble, checkpoint, resume with ``--ckpt_path last`` and export (rank 0)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import foxhunt

ROOT = Path(__file__).resolve().parents[1]
TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(tmp: Path, *extra: str) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes 2 --nproc_per_node 1 --node_rank k`` for k = 0, 1, started together; both results."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    fit = ["-m", "foxhunt.fit", "--config", TINY, "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu",
           "--trainer.strategy", "ddp_find_unused_parameters_true", "--trainer.num_nodes", "2", "--trainer.devices", "1",
           "--trainer.logger.init_args.save_dir", str(tmp / "runs"), "--trainer.logger.init_args.version", "0",
           "--trainer.default_root_dir", str(tmp), "--export_dir", str(tmp / "export"), "--backtest", "false",
           "--trainer.enable_progress_bar", "false", *extra]
    nodes = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                          "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port), *fit],
                         env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    out = []
    for node in nodes:
        stdout, stderr = node.communicate(timeout=900)
        out.append(subprocess.CompletedProcess(node.args, node.returncode, stdout, stderr))
    return out


def test_two_nodes_train_checkpoint_resume_and_export(tmp_path: Path) -> None:
    first = _two_nodes(tmp_path)
    assert [r.returncode for r in first] == [0, 0], first[0].stderr[-3000:] + first[1].stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in first[0].stderr + first[0].stdout
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in first[1].stderr + first[1].stdout
    last = tmp_path / "runs" / "foxhunt" / "version_0" / "checkpoints" / "last.ckpt"
    one = torch.load(last, map_location="cpu", weights_only=True)
    assert one["epoch"] == 0 and one["global_step"] > 0

    resumed = _two_nodes(tmp_path, "--ckpt_path", "last", "--trainer.max_epochs", "2")
    assert [r.returncode for r in resumed] == [0, 0], resumed[0].stderr[-3000:] + resumed[1].stderr[-3000:]
    for node in resumed:  # every rank resolves 'last' to the same file and restores from it
        assert f"resuming from {last}" in node.stderr
    two = torch.load(last, map_location="cpu", weights_only=True)
    assert two["epoch"] == 1 and two["global_step"] > one["global_step"]

    exported = foxhunt.load(tmp_path / "export")  # written by rank 0 only, verified on load
    assert set(exported.model.member_names) == {"tft", "dqn"}
    assert "exported" in resumed[0].stdout and "exported" not in resumed[1].stdout
