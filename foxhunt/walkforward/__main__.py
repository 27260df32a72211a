"""``python -m foxhunt.walkforward``: runs the command line of :mod:`foxhunt.walkforward.cli`."""

import sys

from foxhunt.cli_errors import run_command
from foxhunt.walkforward.cli import main

if __name__ == "__main__":
    sys.exit(run_command(main))
