"""The command line: ``python -m foxhunt.tune --config <tune.yaml>`` (run, resume or join a study; ``--best``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence

import optuna

from foxhunt.cli_errors import ArgumentParser, run_command
from foxhunt.tune.objective import Terminated, run_study
from foxhunt.tune.report import format_summary, summarize
from foxhunt.tune.space import TuneConfigError, load_tune_config
from foxhunt.tune.study import default_storage_url, open_study

DESCRIPTION = "`python -m foxhunt.tune --config lightning_configs/tune.yaml`: Optuna studies over ``foxhunt.fit`` configs."


# -------------------------------------------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m foxhunt.tune", description=DESCRIPTION)
    p.add_argument("--config", required=True, help="tune config YAML (base fit config, search space, objective...)")
    p.add_argument("--n-trials", type=int, default=None,
                   help="the study's total of trials, shared by all workers (default: the config's n_trials)")
    p.add_argument("--timeout", type=float, default=None, help="stop starting trials after this many seconds")
    p.add_argument("--storage", default=None, help="SQLAlchemy URL (default: sqlite:///<runs_dir>/optuna.db)")
    p.add_argument("--study-name", default=None, help="default: the config's study_name")
    p.add_argument("--best", action="store_true",
                   help="run no trial: print the best trial(s), write their fit configs, importances and plots")
    p.add_argument("--debug", action="store_true", help="a traceback for config, data and path errors too")
    return p


@contextlib.contextmanager
def _logging() -> Iterator[None]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    optuna.logging.set_verbosity(optuna.logging.INFO)
    yield


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or resume, or join) a study; print the summary. Exit codes: 0 done, 2 bad config (one ``error:`` line),
    130 interrupted (Ctrl-C), 143 terminated (SIGTERM)."""
    return run_command(_main, argv)


def _main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    with _logging():
        cfg = load_tune_config(args.config)
        if args.n_trials is not None and args.n_trials < 1:
            raise TuneConfigError(f"--n-trials: must be positive, got {args.n_trials}")
        storage = args.storage or cfg.storage or default_storage_url(cfg.runs_dir)
        name = args.study_name or cfg.study_name
        code = 0
        if args.best:
            study = open_study(cfg, storage, name, create=False)
        else:
            try:
                study = run_study(cfg, args.n_trials, args.timeout, storage, name).study
            except KeyboardInterrupt as e:
                how, code = ("terminated (SIGTERM)", 143) if isinstance(e, Terminated) else ("interrupted", 130)
                print(f"\n{how}: the running trial is marked failed (interrupted); rerun to resume", file=sys.stderr)
                study = open_study(cfg, storage, name)
        print(format_summary(summarize(study, cfg), storage))
        return code
