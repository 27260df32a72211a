"""The Dockerfile and the commands of docs/GUIDE.md and README.md, checked without a Docker engine.

Fast checks: what the Dockerfile copies exists and is not excluded by .dockerignore; the base image is a CUDA PyTorch
one; the extras it installs exist; it runs as a non-root user with runs/ as a volume; its entrypoint module imports and
its default arguments parse. Every command in a ``bash`` block of the guide or the README names existing modules and
configs, and its arguments parse (``foxhunt.fit`` through LightningCLI's ``--print_config``, ``foxhunt.backtest``
through its own parser, other modules against their ``--help``). The docker commands in the Dockerfile's header are
the guide's. A slow test runs the guide's quick-start walk-through (fit, back-test, resume) verbatim on tiny sizes.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import importlib.util
import io
import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
GUIDE = ROOT / "docs" / "GUIDE.md"
README = ROOT / "README.md"
IMAGE_WORKDIR = "/opt/foxhunt"


# ------------------------------------------------------------------------------------------------ Dockerfile parsing
def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of the Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def _declared_extras() -> dict[str, list[str]]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _args(value: str) -> list[str]:
    """The arguments of an instruction in exec (JSON) or shell form."""
    return json.loads(value) if value.startswith("[") else shlex.split(value)


def _dockerignore() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.exists():
        return []
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: patterns match from the context root; the last matching pattern wins (! negates)."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pat) or (pat.startswith("**/") and fnmatch.fnmatch(p.split("/")[-1], pat[3:])) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerfile_copies_existing_files_not_excluded_from_the_context() -> None:
    patterns = _dockerignore()
    copies = [_args(v) for k, v in instructions() if k in ("COPY", "ADD")]
    assert copies, "the Dockerfile copies nothing"
    for args in copies:
        sources = [a for a in args[:-1] if not a.startswith("--")]
        assert sources, f"COPY {args} has no source"
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"Dockerfile copies {src}, which does not exist"
            assert not _ignored(src.rstrip("/"), patterns), f".dockerignore excludes {src}, which the Dockerfile copies"
            if path.is_dir():
                assert any(path.iterdir()), f"Dockerfile copies the empty directory {src}"
    copied = {s.rstrip("/") for a in copies for s in a[:-1] if not s.startswith("--")}
    assert {"pyproject.toml", "foxhunt", "lightning_configs"} <= copied


def test_dockerfile_base_user_volume_and_installs() -> None:
    steps = instructions()
    args = {k: v for k, v in (a.partition("=")[::2] for kind, a in steps if kind == "ARG")}
    base = next(v for k, v in steps if k == "FROM")
    base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), base)
    assert base.startswith("pytorch/pytorch:") and "cuda" in base, f"base image {base} is not a CUDA PyTorch image"

    installs = " ".join(v for k, v in steps if k == "RUN" and "pip install" in v)
    extras = re.findall(r"\.\[([\w,]+)\]", installs)
    assert extras, "the Dockerfile does not install foxhunt with extras"
    declared = _declared_extras()
    for extra in ",".join(extras).split(","):
        assert extra in declared, f"the Dockerfile installs the extra [{extra}], which pyproject.toml does not declare"
    assert "psycopg2" in installs, "no PostgreSQL driver for Optuna storages in the image"

    users = [v for k, v in steps if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    last_user = max(i for i, (k, _) in enumerate(steps) if k == "USER")
    assert all(k != "RUN" for k, _ in steps[last_user:]), "a RUN after USER would run as the unprivileged user"
    workdir = [v for k, v in steps if k == "WORKDIR"][-1]
    assert workdir == IMAGE_WORKDIR
    volumes = [p for k, v in steps if k == "VOLUME" for p in _args(v)]
    assert f"{workdir}/runs" in volumes, f"runs/ is not a volume: {volumes}"


def test_entrypoint_is_foxhunt_fit_and_default_arguments_parse(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["python"])  # pytest's own arguments are not the CLI's
    monkeypatch.chdir(ROOT)  # the image's working directory holds the same tree
    steps = instructions()
    entry = _args([v for k, v in steps if k == "ENTRYPOINT"][-1])
    assert entry == ["python", "-m", "foxhunt.fit"]
    module = importlib.import_module(entry[2])
    assert callable(module.main)
    cmd = [v for k, v in steps if k == "CMD"]
    if cmd:
        _check_fit_args(_args(cmd[-1]), capsys)


# ------------------------------------------------------------------------------------------------ commands in the docs
def commands(path: Path) -> list[str]:
    """Command lines of the ``bash`` blocks of a Markdown file (``&&`` chains split)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.DOTALL):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.extend(part.strip() for part in line.split("&&"))
    return out


def _python_module(tokens: list[str]) -> tuple[str, list[str]] | None:
    if len(tokens) >= 3 and tokens[0] in ("python", "python3") and tokens[1] == "-m":
        return tokens[2], tokens[3:]
    return None


def _docker_run(tokens: list[str]) -> tuple[str, list[str]]:
    """The image's command of ``docker run``: (module, arguments) under the entrypoint or an --entrypoint python."""
    i, entrypoint = 2, None
    with_value = {"-v", "--volume", "-e", "--env", "--gpus", "--user", "-u", "--name", "--entrypoint", "-w", "--shm-size", "--network", "-p"}
    while tokens[i].startswith("-"):
        if tokens[i] == "--entrypoint":
            entrypoint = tokens[i + 1]
        i += 2 if tokens[i] in with_value else 1
    image, rest = tokens[i], tokens[i + 1 :]
    assert image == _built_tag(), f"docker run uses image {image!r}, the guide builds {_built_tag()!r}"
    if entrypoint is None:
        return "foxhunt.fit", rest
    assert entrypoint == "python" and rest[0] == "-m", f"unexpected docker entrypoint {entrypoint} {rest[:2]}"
    return rest[1], rest[2:]


def _built_tag() -> str:
    built = [shlex.split(c) for c in commands(GUIDE) if c.startswith("docker build")]
    assert built, "the guide does not say how to build the image"
    tokens = built[0]
    return tokens[tokens.index("-t") + 1]


def _check_fit_args(args: list[str], capsys) -> str:
    from foxhunt.fit import build_cli

    with pytest.raises(SystemExit) as exit_info:
        build_cli([*args, "--print_config"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, f"foxhunt.fit {' '.join(args)} does not parse:\n{captured.err[-2000:]}"
    return captured.out


class _Parsed(Exception):
    pass


def _check_backtest_args(args: list[str], monkeypatch) -> None:
    import foxhunt.backtest

    def stop(*a, **k):
        raise _Parsed

    # foxhunt.backtest imports `load` by name: patch it where the command reads it
    monkeypatch.setattr(foxhunt.backtest, "load", stop)
    with pytest.raises(_Parsed):
        foxhunt.backtest.main(args)


def _help(module: str, monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(io.StringIO()):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    monkeypatch.setattr(sys, "argv", ["python"])
    assert exit_info.value.code in (0, None), f"python -m {module} --help failed"
    return capsys.readouterr().out


def _check_tuned_config_path(config: str) -> None:
    """A fit config the guide says a study writes: where foxhunt.tune --best writes the best trial's config."""
    from foxhunt.tune import load_tune_config

    tune = load_tune_config(ROOT / "lightning_configs" / "tune.yaml")
    expected = f"{tune.runs_dir.as_posix()}/{tune.study_name}/best/config.yaml"
    assert config == expected, f"the guide trains {config}, but foxhunt.tune writes the best config to {expected}"


def _check_paths(args: list[str]) -> None:
    for a in args:
        if a.endswith((".yaml", ".yml")) and not a.startswith("runs/"):
            assert (ROOT / a).is_file(), f"the config {a} does not exist"


def doc_commands() -> list[tuple[str, str]]:
    return [(doc.name, c) for doc in (GUIDE, README) if doc.exists() for c in commands(doc)]


def test_guide_exists_and_links_its_references() -> None:
    text = GUIDE.read_text()
    for link in ("DATA.md", "FEATURES.md"):
        assert f"({link})" in text, f"the guide does not link {link}"
    for nb in ("01_quickstart", "02_interpret_tft", "03_optuna_study"):
        assert f"notebooks/{nb}.ipynb" in text and (ROOT / "notebooks" / f"{nb}.ipynb").exists()
    assert len(doc_commands()) >= 10


def test_doc_commands_name_existing_modules_and_configs_and_parse(monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["python"])
    helps: dict[str, str] = {}
    checked = 0
    for doc, line in doc_commands():
        tokens = shlex.split(line)
        if tokens[:2] == ["docker", "build"]:
            assert tokens[-1] == "." and DOCKERFILE.exists()
            continue
        if tokens[:2] == ["docker", "run"]:
            module, args = _docker_run(tokens)
        elif _python_module(tokens) is not None:
            module, args = _python_module(tokens)
        elif tokens[0] == "tensorboard":
            assert importlib.util.find_spec("tensorboard") is not None
            continue
        else:
            continue
        if module == "pip" or module == "pytest":
            extras = re.findall(r"\.\[([\w,]+)\]", line)
            if extras:
                declared = _declared_extras()
                assert all(e in declared for e in ",".join(extras).split(",")), f"{doc}: {line}: unknown extra"
            continue
        assert module.startswith("foxhunt"), f"{doc}: unexpected module in {line}"
        assert importlib.util.find_spec(module) is not None, f"{doc}: {line}: module {module} does not exist"
        _check_paths(args)
        config = args[args.index("--config") + 1] if "--config" in args else ""
        if module == "foxhunt.fit" and config.startswith("runs/"):
            _check_tuned_config_path(config)
        elif module == "foxhunt.fit":
            _check_fit_args(args, capsys)
        elif module == "foxhunt.backtest":
            _check_backtest_args(args, monkeypatch)
        else:
            if module not in helps:
                helps[module] = _help(module, monkeypatch, capsys)
            for opt in (a.split("=", 1)[0] for a in args if a.startswith("--")):
                assert re.search(re.escape(opt) + r"(?![\w-])", helps[module]), f"{doc}: {line}: {module} has no option {opt}"
            if module == "foxhunt.tune":
                from foxhunt.tune import load_tune_config

                load_tune_config(ROOT / config)  # raises naming the field when the config is invalid
        checked += 1
    assert checked >= 8, f"only {checked} foxhunt commands found in the guide and README"


def test_dockerfile_header_commands_are_the_guides() -> None:
    header = [ln.lstrip("#").strip() for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("#   docker ")]
    assert header, "the Dockerfile's header shows no docker command"
    guide = set(commands(GUIDE))
    for line in header:
        assert line in guide, f"Dockerfile header command not in docs/GUIDE.md: {line}"


# ------------------------------------------------------------------------------------------------ the walk-through, run
QUICKSTART = "python -m foxhunt.fit --config lightning_configs/quickstart.yaml"
BACKTEST = "python -m foxhunt.backtest --checkpoint runs/foxhunt/version_0/export --split test"
RESUME = ("python -m foxhunt.fit --config lightning_configs/quickstart.yaml --trainer.logger.init_args.version 0 "
          "--ckpt_path runs/foxhunt/version_0/checkpoints/last.ckpt")
# appended to the guide's fit commands so the walk-through takes seconds
TINY = ["--data.synthetic_bars", "5000", "--data.lookback", "12", "--data.horizon", "3", "--trainer.limit_train_batches", "6",
        "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
        "--model.members.dqn.init_args.optim.start_step", "3", "--model.members.dqn.init_args.learning_starts", "256",
        "--model.members.dqn.init_args.n_envs", "16"]


def test_walkthrough_commands_are_in_the_guide() -> None:
    guide = commands(GUIDE)
    for line in (QUICKSTART, BACKTEST, RESUME):
        assert line in guide, f"the guide no longer shows: {line}"


@pytest.mark.slow
def test_guide_walkthrough_runs(tmp_path: Path, monkeypatch) -> None:
    """The guide's quick start, back-test and resume commands, verbatim plus tiny sizes, in a fresh directory."""
    import torch

    from foxhunt.backtest import main as backtest
    from foxhunt.fit import main as fit

    (tmp_path / "lightning_configs").symlink_to(ROOT / "lightning_configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pytest"])
    cli = fit(shlex.split(QUICKSTART)[3:] + TINY + ["--trainer.max_epochs", "1"])
    assert {"tft", "dqn", "ensemble", "buy_and_hold"} <= set(cli.results["backtest"])
    export = tmp_path / "runs" / "foxhunt" / "version_0" / "export"
    assert (export / "metadata.json").exists()

    results = backtest(shlex.split(BACKTEST)[3:])
    assert {"tft", "dqn", "ensemble", "buy_and_hold", "oracle"} <= set(results)
    assert (export / "backtest.json").exists() and (export / "equity.png").exists()

    last = tmp_path / "runs" / "foxhunt" / "version_0" / "checkpoints" / "last.ckpt"
    before = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    resumed = fit(shlex.split(RESUME)[3:] + TINY + ["--trainer.max_epochs", "2"])
    after = torch.load(last, map_location="cpu", weights_only=True)
    assert after["epoch"] == 1 and after["global_step"] > before, "the resumed run did not continue from last.ckpt"
    assert resumed.trainer.logger.version == 0
