"""What README.md, docs/GUIDE.md, docs/ARCHITECTURE.md, docs/DATA.md and docs/TUNING.md tell a user exists and agrees
with the code: every repository path they name (``foxhunt/...``, ``scripts/...``, ``tests/...``, configs, notebooks),
every ``python -m foxhunt.*`` command's module and options, every dotted ``foxhunt.*`` name, the modules
ARCHITECTURE.md's package table lists (and that it lists every module), the PyTorch and Python versions they quote
(against pyproject.toml), the quick start's oracle Sharpe (the same figure in the config and the docs) and the P&L
convention (the exact per-bar log return, not the linear form). The commands of the GUIDE's and README's ``bash``
blocks are parsed in full by tests/test_dockerfile.py."""

from __future__ import annotations

import glob
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "foxhunt"
DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{n}.md" for n in ("GUIDE", "ARCHITECTURE", "DATA", "TUNING"))]
SUBPACKAGES = ("data", "features", "models", "lit", "rl", "training", "evaluation", "tune")


def _text(doc: Path) -> str:
    return doc.read_text()


def named_paths(text: str) -> set[str]:
    """Repository paths a doc names: ``foxhunt/...``, ``scripts/...``, ``tests/...``, ``lightning_configs/...``,
    ``notebooks/...``, ``docs/...`` (globs kept), and ``<subpackage>/<module>.py`` relative to ``foxhunt/``. Paths
    under ``runs/``, a cache or a user's data folder (preceded by a ``/`` or a word character) are not the
    repository's."""
    out = set()
    for m in re.finditer(r"(?<![\w./~*-])((?:foxhunt|scripts|tests|lightning_configs|notebooks|docs)/[\w./*-]*[\w*])", text):
        out.add(m.group(1))
    for m in re.finditer(rf"(?<![\w./~*-])((?:{'|'.join(SUBPACKAGES)})/\w+\.py)\b", text):
        out.add(f"foxhunt/{m.group(1)}")
    return out


def test_named_paths_finds_and_skips() -> None:
    text = ("`foxhunt/data/io.py`, (`lit/ensemble.py`), `scripts/bench_*.py`, runs/foxhunt/version_0/export, "
            "`~/.cache/foxhunt/native/`, `.cache/foxhunt/`, data/ES/x.dbn.zst, `tests/test_dbn.py`).")
    assert named_paths(text) == {"foxhunt/data/io.py", "foxhunt/lit/ensemble.py", "scripts/bench_*.py", "tests/test_dbn.py"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_named_repository_path_exists(doc: Path) -> None:
    missing = [p for p in sorted(named_paths(_text(doc))) if not glob.glob(str(ROOT / p.rstrip("/")))]
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def _resolve(dotted: str) -> object:
    """The module, class, function or attribute ``dotted`` names (``foxhunt.a.b.C.method``); raises if none."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def named_dotted(text: str) -> set[str]:
    """``foxhunt.x.y`` names in a doc (a sentence's full stop and a possessive dropped)."""
    return {m.group(1).rstrip(".") for m in re.finditer(r"(?<![\w./-])(foxhunt(?:\.\w+)+)", text)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_dotted_foxhunt_name_resolves(doc: Path) -> None:
    bad = []
    for dotted in sorted(named_dotted(_text(doc))):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as e:
            bad.append(f"{dotted} ({type(e).__name__}: {e})")
    assert not bad, f"{doc.name} names what does not exist: {bad}"


def inline_commands(text: str) -> list[str]:
    """``python -m foxhunt.*`` command lines of a doc: its ``bash`` block lines and its inline code spans."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        for line in block.splitlines():
            line = line.split(" #")[0].strip().rstrip("&").strip()
            out.extend(part.strip() for part in line.split("&&"))
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL)):
        out.append(span.strip())
    return [c[c.index("python -m foxhunt"):] for c in out if "python -m foxhunt" in c]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_command_module_exists_and_takes_its_options(doc: Path, monkeypatch, capsys) -> None:
    """Every ``python -m foxhunt.X`` a doc shows names an existing module; the options of commands of modules with an
    argparse command line are among those its ``--help`` lists (``foxhunt.fit``'s options are LightningCLI's, parsed in
    full for the GUIDE's and README's commands by tests/test_dockerfile.py and for the configs by tests/test_configs.py)."""
    from test_dockerfile import _help

    monkeypatch.chdir(ROOT)
    helps: dict[str, str] = {}
    for line in inline_commands(_text(doc)):
        try:
            tokens = shlex.split(line)
        except ValueError:  # a code span cut inside a quote: the module is still checked
            tokens = line.split()
        module = tokens[2]
        assert importlib.util.find_spec(module) is not None, f"{doc.name}: {line}: no module {module}"
        if module == "foxhunt.fit":
            continue
        if "--" in tokens:  # foxhunt.walkforward hands everything after `--` to foxhunt.fit
            tokens = tokens[: tokens.index("--")]
        if module not in helps:
            helps[module] = _help(module, monkeypatch, capsys)
        for opt in (t.split("=", 1)[0] for t in tokens[3:] if t.startswith("--")):
            assert re.search(re.escape(opt) + r"(?![\w-])", helps[module]), f"{doc.name}: {line}: {module} has no {opt}"


def _architecture_rows() -> dict[str, str]:
    """ARCHITECTURE.md's package table: the package cell (``foxhunt/data``) -> the row's text."""
    rows = {}
    for line in _text(ROOT / "docs" / "ARCHITECTURE.md").splitlines():
        m = re.match(r"\| `(foxhunt/\w+)`[^|]*\| (.*) \|$", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_architecture_package_table_lists_every_module_and_only_existing_ones() -> None:
    rows = _architecture_rows()
    assert {f"foxhunt/{p}" for p in SUBPACKAGES} <= set(rows), sorted(rows)
    for package, row in rows.items():
        folder = ROOT / package
        if not folder.is_dir():
            continue
        named = set(re.findall(r"`(\w+\.py)`", row))
        missing = [n for n in sorted(named) if not (folder / n).is_file()]
        assert not missing, f"ARCHITECTURE.md's {package} row names modules that do not exist: {missing}"
        unnamed = [p.name for p in sorted(folder.glob("*.py"))
                   if p.name != "__init__.py" and p.name not in named and f"`{p.stem}`" not in row]
        assert not unnamed, f"ARCHITECTURE.md's {package} row does not say what {unnamed} hold"


def _requirement(name: str) -> str:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    if name == "python":
        return re.search(r">=\s*([\d.]+)", project["requires-python"]).group(1)
    spec = next(d for d in project["dependencies"] if re.match(rf"{name}\b", d))
    return re.search(r">=\s*([\d.]+)", spec).group(1)


def test_quoted_minimum_versions_are_pyprojects() -> None:
    torch_min, python_min = _requirement("torch"), _requirement("python")
    for doc in (ROOT / "README.md", ROOT / "docs" / "GUIDE.md"):
        text = _text(doc)
        quoted = re.findall(r"PyTorch (?:>= ?)?(\d+\.\d+)(?: or newer)?", text)
        assert quoted, f"{doc.name} quotes no PyTorch version"
        assert all(v == torch_min for v in quoted), f"{doc.name} quotes PyTorch {quoted}, pyproject.toml needs >={torch_min}"
        pythons = re.findall(r"Python (\d+\.\d+)", text)
        assert pythons and all(v == python_min for v in pythons), f"{doc.name}: Python {pythons}, pyproject >={python_min}"


def test_quickstart_oracle_sharpe_is_quoted_alike() -> None:
    """The quick start's oracle test Sharpe after costs (measured: 3.37) is one figure in its config and the docs."""
    pattern = r"oracle's annualised Sharpe\s+after\s+costs\s+is\s+about\s+(\d+\.\d+)"
    figures = {}
    for path in (ROOT / "lightning_configs" / "quickstart.yaml", ROOT / "docs" / "GUIDE.md", ROOT / "docs" / "DATA.md"):
        text = re.sub(r"\s*#\s*", " ", path.read_text()) if path.suffix == ".yaml" else path.read_text()
        found = re.findall(pattern, text)
        assert found, f"{path.name} does not quote the quick start oracle's Sharpe"
        figures[path.name] = set(found)
    assert len(set.union(*figures.values())) == 1, figures


def test_guide_states_the_exact_pnl_convention() -> None:
    """The back-test conventions of GUIDE section 8 give the exact per-bar log return of evaluation/trading.py,
    ``log1p(w·expm1(r)) + log1p(-c|Δw|)``, not the linear ``w·r - c|Δw|`` foxhunt used before."""
    text = _text(ROOT / "docs" / "GUIDE.md")
    conventions = text[text.index("Conventions: a position"):]
    conventions = conventions[: conventions.index("\n\n")]
    assert "log1p(" in conventions and "expm1(" in conventions, conventions
    assert not re.search(r"earns p · \(ln C\[t\+1\] − ln C\[t\]\) minus", conventions), conventions


def test_tune_yaml_documents_every_field() -> None:
    """GUIDE section 9: ``lightning_configs/tune.yaml`` "documents every field" of a tune config."""
    import yaml

    from foxhunt.tune import load_tune_config
    from foxhunt.tune.space import _TOP_KEYS

    path = ROOT / "lightning_configs" / "tune.yaml"
    assert "documents every field" in _text(ROOT / "docs" / "GUIDE.md")
    missing = sorted(_TOP_KEYS - set(yaml.safe_load(path.read_text())))
    assert not missing, f"tune.yaml does not show {missing}"
    load_tune_config(path)


def test_tuning_cost_names_the_quick_start_it_was_measured_on() -> None:
    """docs/TUNING.md's trial cost was measured on a smaller quick start than lightning_configs/quickstart.yaml: the
    sizes it quotes as "the quick start" must be the config's, or be named as an earlier one."""
    import yaml

    quick = yaml.safe_load((ROOT / "lightning_configs" / "quickstart.yaml").read_text())
    text = _text(ROOT / "docs" / "TUNING.md")
    for m in re.finditer(r"the quick start: ([\d,]+) synthetic bars, (\d+) epochs of (\d+) batches", text):
        bars, epochs, batches = (int(g.replace(",", "")) for g in m.groups())
        assert (bars, epochs, batches) == (quick["data"]["synthetic_bars"], quick["trainer"]["max_epochs"],
                                           quick["trainer"]["limit_train_batches"]), m.group(0)


def test_python_m_foxhunt_data_refuses_a_bad_command_line_in_one_line(capsys) -> None:
    """DATA.md: on the command line an error is one ``error:`` line and exit status 2, a bad option or value included
    (argparse's own refusal printed the usage text over several lines)."""
    from foxhunt.cli_errors import run_command
    from foxhunt.data.__main__ import main

    for argv, reason in ((["--on-bad-bar", "ignore"], "argument --on-bad-bar: invalid choice: 'ignore'"),
                         (["--bars", "many"], "argument --bars: invalid int value: 'many'"),
                         (["--no-such-option"], "unrecognized arguments: --no-such-option")):
        assert run_command(main, argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: python -m foxhunt.data: {reason}"), err


@pytest.mark.parametrize("module", ["foxhunt.backtest", "foxhunt.walkforward", "foxhunt.tune.cli"])
def test_every_command_refuses_a_bad_command_line_in_one_line(module: str, capsys) -> None:
    """backtest, walkforward and tune as foxhunt.data: an unknown option is one ``error:`` line and exit status 2,
    not argparse's usage text."""
    import importlib

    from foxhunt.cli_errors import run_command

    main = importlib.import_module(module).main
    assert run_command(main, ["--no-such-option", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: python -m foxhunt."), err
    assert "usage:" not in err


@pytest.mark.parametrize("kwargs,match", [({"synthetic_bars": -5}, "synthetic_bars"), ({"batch_size": 0}, "batch_size"),
                                          ({"eval_batch_size": 0}, "batch_size")])
def test_datamodule_refuses_sizes_below_one_before_loading(kwargs: dict, match: str) -> None:
    from foxhunt.data.datamodule import BarDataModule

    with pytest.raises(ValueError, match=match):
        BarDataModule(**kwargs)


@pytest.mark.parametrize("kwargs,match", [({"cost_bps": -1.0}, "cost_bps"), ({"cost_bps": float("nan")}, "cost_bps"),
                                          ({"bars_per_year": 0.0}, "bars_per_year")])
def test_ensemble_refuses_a_negative_cost_or_a_bad_annualisation(kwargs: dict, match: str) -> None:
    from foxhunt.lit.dqn import DQNModule
    from foxhunt.lit.ensemble import EnsembleModule

    with pytest.raises(ValueError, match=match):
        EnsembleModule(members={"dqn": DQNModule()}, **kwargs)
