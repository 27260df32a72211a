"""Bars' symbols as an export's symbol codes, by name: what every scorer of new bars (back-test, walk-forward, a live
session) maps a bar frame through, so a symbol trades with its own parameters whatever else shares the file.

The rule for a symbol the export never saw (not in ``metadata.data.symbols``): it is refused, in one line naming it
and the symbols the export knows, when any member reads the symbol (a forecaster, TFT or Mamba-2, adds the symbol's
embedding to its inputs; an agent stacked on forecasts reads them); when no member reads it (agents alone read only
features), it trades under a code after the export's own, and the back-test names it as traded unseen. Never another
symbol's parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from foxhunt.data.bars import DataError


class UnseenSymbolError(DataError):
    """Bars of a symbol the export never saw, for a model that reads the symbol (it has no parameters for it)."""


def unseen_symbols(bar_symbols: Sequence[str], export_symbols: Sequence[str]) -> list[str]:
    """The bar frame's symbols the export does not list, in the frame's order."""
    known = set(export_symbols)
    return [s for s in bar_symbols if s not in known]


def coded_symbols(bar_symbols: Sequence[str], export_symbols: Sequence[str]) -> list[str]:
    """The symbols the codes of :func:`export_symbol_codes` index: the export's, then the frame's unseen ones."""
    return [*export_symbols, *unseen_symbols(bar_symbols, export_symbols)]


def export_symbol_codes(
    bar_symbols: Sequence[str], export_symbols: Sequence[str], readers: Sequence[str] = (), where: str = "bars"
) -> torch.Tensor:
    """[S] int64: each of the frame's symbols (its local codes' names, in order) as the export's code, by name: its
    index in ``export_symbols``; an unseen symbol gets ``len(export_symbols) + j`` (j-th unseen), unless ``readers``
    (the members that read the symbol) is not empty: then one :class:`UnseenSymbolError` line naming it."""
    if len(set(bar_symbols)) != len(bar_symbols):
        raise ValueError(f"{where}: symbols {list(bar_symbols)} repeat a name")
    unseen = unseen_symbols(bar_symbols, export_symbols)
    if unseen and readers:
        raise UnseenSymbolError(
            f"{where}: symbol{'s' if len(unseen) > 1 else ''} {', '.join(unseen)} never seen by the model, which knows "
            f"{', '.join(export_symbols)}; {'members' if len(readers) > 1 else 'member'} {', '.join(readers)} "
            f"read{'' if len(readers) > 1 else 's'} the symbol and {'have' if len(readers) > 1 else 'has'} no "
            "parameters for it (rename the bars' symbol to the one the model was trained on if it is the same instrument)"
        )
    codes = {s: i for i, s in enumerate(coded_symbols(bar_symbols, export_symbols))}
    return torch.tensor([codes[s] for s in bar_symbols], dtype=torch.int64)
