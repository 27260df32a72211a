"""The notebooks in notebooks/: stored clean (fast checks), and executed end to end on tiny settings (slow).

Each notebook has one code cell tagged ``parameters`` (papermill's convention). The slow tests insert a cell after it
with tiny settings and output paths under tmp_path, run every cell with nbclient on a kernel that runs this
interpreter (the virtual environment's), fail on the first cell that raises, and check what the notebook produced.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ("01_quickstart", "02_interpret_tft", "03_optuna_study")

# The notebooks train on the smallest real config (a few seconds of training on CPU) instead of their defaults.
TINY = "tests/configs/tiny.yaml"


def _read(name: str) -> dict[str, Any]:
    return json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_clean_with_one_parameters_cell(name: str) -> None:
    nb = _read(name)
    assert nb["nbformat"] == 4
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, f"{name} has no code cell"
    for i, cell in enumerate(code):
        assert cell.get("outputs") == [], f"{name}: code cell {i} was stored with outputs"
        assert cell.get("execution_count") is None, f"{name}: code cell {i} was stored with an execution count"
    tagged = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{name}: expected one code cell tagged 'parameters', found {len(tagged)}"
    assert tagged[0] is code[0], f"{name}: the parameters cell must be the first code cell"
    source = "".join(tagged[0]["source"])
    compile(source, f"{name}:parameters", "exec")
    for cell in code:
        compile("".join(cell["source"]), name, "exec")  # no syntax error anywhere (magics are not used)


def _parameter_names(name: str) -> set[str]:
    import ast

    cell = next(c for c in _read(name)["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    tree = ast.parse("".join(cell["source"]))
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def execute(name: str, params: dict[str, Any], workdir: Path, timeout: int = 900) -> tuple[Any, float]:
    """Run a notebook with ``params`` injected after its parameters cell; returns the executed notebook and seconds."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    unknown = set(params) - _parameter_names(name)
    assert not unknown, f"{name}: the test sets parameters the notebook does not declare: {sorted(unknown)}"
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()))
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(at + 1, injected)
    # the kernel is `python -m ipykernel_launcher`: put this interpreter's directory first on the kernel's PATH so that
    # "python" is the virtual environment's, whatever the shell had
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(workdir)}})
    t0 = time.perf_counter()
    client.execute(env=env)
    seconds = time.perf_counter() - t0
    return nb, seconds


def outputs(nb: Any) -> tuple[str, int]:
    """All text the notebook printed or displayed, and the number of images it showed."""
    text, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out.get("text", ""))
            data = out.get("data", {})
            if "text/plain" in data:
                text.append(data["text/plain"])
            images += int("image/png" in data)
    return "\n".join(text), images


def _kernel_python(nb: Any) -> str:
    text, _ = outputs(nb)
    line = next(ln for ln in text.splitlines() if "; python " in ln)
    return line.rsplit("; python ", 1)[1].strip()


@pytest.mark.slow
def test_01_quickstart_executes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    params = {
        "CONFIG": TINY,
        "N_BARS": 5000,
        "UNSEEN_BARS": 3000,
        "OUT_DIR": str(out),
        "CACHE_DIR": str(tmp_path / "cache"),
    }
    nb, seconds = execute("01_quickstart", params, tmp_path)
    print(f"01_quickstart executed in {seconds:.1f} s")
    assert Path(_kernel_python(nb)).resolve() == Path(sys.executable).resolve()
    text, images = outputs(nb)
    assert images >= 4, f"expected price/volume, features, equity and back-test figures, got {images}"
    for who in ("tft", "dqn", "ensemble", "buy_and_hold", "oracle"):
        assert who in text
    assert "loaded model reproduces the trained model's positions" in text
    assert "on_bad_bar='raise':" in text and "row" in text
    export = out / "export"
    assert {"ensemble.safetensors", "tft.safetensors", "dqn.safetensors", "metadata.json"} <= {p.name for p in export.iterdir()}
    result = json.loads((out / "backtest_unseen" / "backtest.json").read_text())
    assert {"tft", "dqn", "ensemble", "buy_and_hold"} <= set(result)
    assert list((out / "runs").rglob("events.out.tfevents*"))


@pytest.mark.slow
def test_02_interpret_tft_executes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    params = {
        "CONFIG": TINY,
        "N_BARS": 5000,
        "FIT_OVERRIDES": ["--trainer.max_epochs", "3"],
        "OUT_DIR": str(out),
        "CACHE_DIR": str(tmp_path / "cache"),
    }
    nb, seconds = execute("02_interpret_tft", params, tmp_path)
    print(f"02_interpret_tft executed in {seconds:.1f} s")
    _, images = outputs(nb)
    assert images >= 5, f"expected importance, attention, fan charts and reliability figures, got {images}"
    coverage = json.loads((out / "calibration.json").read_text())
    levels = coverage["quantiles"]
    assert len(levels) >= 5 and sorted(levels) == levels
    # the oracle is the exact conditional distribution: its coverage matches the nominal levels within sampling error
    n = coverage["n_oracle"]
    for q, c in zip(levels, coverage["oracle"]):
        assert abs(c - q) < 4 * (q * (1 - q) / n) ** 0.5 + 0.01, f"oracle coverage {c:.3f} at level {q}"
    # the model's coverage is a real frequency per level and horizon, increasing with the level on average
    model = coverage["model"]
    assert len(model) == coverage["horizon"]
    for row in model:
        assert all(0.0 <= c <= 1.0 for c in row)
        assert row[-1] > row[0]
    assert coverage["importance_top"], "no variable importances"
    # the TFT trained alone: the export holds that one member
    meta = json.loads((out / "export" / "metadata.json").read_text())
    assert list(meta["members"]) == ["tft"] and not (out / "export" / "dqn.safetensors").exists()


@pytest.mark.slow
def test_03_optuna_study_executes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    params = {
        "TRIAL_CONFIG": TINY,
        "N_BARS": 5000,
        "N_TRIALS": 3,
        "LIMIT_TRAIN_BATCHES": 6,
        "STUDY": "nb03",
        "OUT_DIR": str(out),
        "CACHE_DIR": str(tmp_path / "cache"),
    }
    nb, seconds = execute("03_optuna_study", params, tmp_path)
    print(f"03_optuna_study executed in {seconds:.1f} s")
    optuna = pytest.importorskip("optuna")
    storage = f"sqlite:///{out / 'study.db'}"
    assert optuna.get_all_study_names(storage) == ["nb03"]
    study = optuna.load_study(study_name="nb03", storage=storage)
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == 3 and any(t.state == optuna.trial.TrialState.COMPLETE for t in finished)
    for t in finished:
        assert (out / "nb03" / f"trial_{t.number}" / "fit_config.yaml").exists()
    best = out / "nb03" / "best" / "config.yaml"
    assert best.exists() and "hidden_size" in best.read_text()
    text, images = outputs(nb)
    assert images >= 2, f"expected the history and intermediate-value plots, got {images} images"
    assert f"best trial {study.best_trial.number}" in text and "foxhunt.fit builds it unchanged" in text
