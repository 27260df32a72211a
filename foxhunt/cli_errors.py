"""One line for every user mistake: ``error: <file/field>: <reason>`` on stderr and exit status 2.

Every command (``foxhunt.fit``, ``foxhunt.tune``, ``foxhunt.backtest``, ``foxhunt.walkforward``, ``foxhunt.data``)
runs its ``main`` through :func:`run_command`. A user mistake is a bad config, bad data or a bad path: an exception of
a :class:`UserError` (foxhunt's bad-bar, data, export, checkpoint, tune and walk-forward errors derive from it, each
raised with a message that starts with the file or field it is about), a parse error of a command line or config, or a
missing or forbidden path. Anything else is a bug and keeps its traceback. ``--debug`` (anywhere on the command line)
keeps the traceback of user mistakes too. This module imports nothing of foxhunt, so every layer can raise a
``UserError`` without an import cycle.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake of the user's (config, data, path), not a bug: reported as one line, without a traceback."""


class ConfigError(UserError, ValueError):
    """A config value that the object it configures refused (raised before any data is loaded), named by its key."""


class CommandLineError(UserError):
    """A command line its parser refused (an unknown option, a bad value, a missing argument)."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose refusals are one line through :func:`run_command`,
    ``error: <prog>: <message>``, exit status 2, instead of the usage text (``--help`` prints it as usual)."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(f"{self.prog}: {message} (--help lists the options)")


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions that report a mistake in a config, a data file or a path."""
    return (UserError, argparse.ArgumentError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError)


def one_line(error: BaseException) -> str:
    """The error's message on one line (jsonargparse's and some of ours span several: their lines joined)."""
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return " ".join(lines) if lines else type(error).__name__


def run_command(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)``; a user mistake prints one ``error:`` line and returns 2 (with ``--debug``: raises).
    Returns ``main``'s integer result, else 0."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    try:
        result = main(args)
    except user_error_types() as e:
        if debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
