"""Bars in, MarketSplits out: loading, validation, the synthetic market and the DataModule."""

from foxhunt.data.bars import BAR_COLUMNS, BadBarError, BarLoadError, validate_bars
from foxhunt.data.dbn import read_dbn, write_dbn
from foxhunt.data.io import load_bars, write_bars
from foxhunt.data.market import MarketSplit

__all__ = [
    "BAR_COLUMNS",
    "BadBarError",
    "BarLoadError",
    "MarketSplit",
    "load_bars",
    "read_dbn",
    "validate_bars",
    "write_bars",
    "write_dbn",
]
