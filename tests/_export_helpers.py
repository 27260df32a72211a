"""What the export tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

import foxhunt
from foxhunt.export.metadata import ExportError


def refusal(root: Path) -> str:
    """The one-line ExportError that loading ``root`` raises."""
    with pytest.raises(ExportError) as info:
        foxhunt.load(root)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def small_export(root: Path, members: dict, n_symbols: int = 1, n_bars: int = 600, seed: int = 0,
                 prepare=None, features: tuple[str, ...] = ("logret_1", "rsi_14", "tod_sin"),
                 known_future: tuple[str, ...] = ("tod_sin",), **ensemble):
    """A bound, untrained ensemble of ``members`` (``ensemble``: more EnsembleModule arguments) exported to ``root``
    from a small synthetic market of ``n_symbols`` symbols (SYN0, SYN1, ...) with ``features``, after
    ``prepare(model)`` if given (e.g. weights set by hand), with its data module: what tests of how an export trades
    new bars start from."""
    import torch

    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.export.write import export_ensemble
    from foxhunt.lit.ensemble import EnsembleModule

    dm = BarDataModule(synthetic_bars=n_bars, synthetic_symbols=n_symbols, features=list(features),
                       known_future=list(known_future), lookback=8, horizon=2, cache_dir=None)
    dm.setup()
    torch.manual_seed(seed)
    model = EnsembleModule(members=members, **ensemble)
    model.bind(dm.spec)
    if prepare is not None:
        prepare(model)
    export_ensemble(model, dm, root)
    return dm, root
