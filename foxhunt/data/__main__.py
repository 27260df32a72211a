"""`python -m foxhunt.data [--path FILE]`: load, validate, featurise and split bars, then print what was built."""

from __future__ import annotations

import logging
import sys
import time

from foxhunt.cli_errors import ArgumentParser, run_command
from foxhunt.data.bars import DEFAULT_JUMP_SIGMAS


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m foxhunt.data", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("--path", default=None, help="bars file, directory or glob (default: the embedded synthetic market)")
    parser.add_argument("--on-bad-bar", default="raise", choices=["raise", "drop", "repair"])
    parser.add_argument("--jump-sigmas", type=float, default=DEFAULT_JUMP_SIGMAS,
                        help="flag a close that moves more than this many robust std of its symbol's earlier log returns (0: off)")
    parser.add_argument("--debug", action="store_true", help="a traceback for data and path errors too")
    parser.add_argument("--bars", type=int, default=200_000, help="synthetic bars per symbol")
    parser.add_argument("--symbols", type=int, default=1, help="synthetic symbols")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from foxhunt.data.datamodule import BarDataModule

    t0 = time.perf_counter()
    dm = BarDataModule(
        path=args.path, on_bad_bar=args.on_bad_bar, jump_sigmas=args.jump_sigmas or None, synthetic_bars=args.bars, synthetic_symbols=args.symbols,
        synthetic_seed=args.seed,
    )
    dm.setup()
    print(dm.describe())
    if dm.market is not None:
        print("synthetic market:", ", ".join(f"{k}={v}" for k, v in dm.market.summary().items()))
    print(f"built in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(run_command(main))
