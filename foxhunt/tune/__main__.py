"""``python -m foxhunt.tune``: runs the command line of :mod:`foxhunt.tune.cli`."""

import sys

from foxhunt.tune.cli import main

if __name__ == "__main__":
    sys.exit(main())
