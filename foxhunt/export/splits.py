"""The splits of the data an export was fitted on, rebuilt from its recorded fit config with the exported statistics:
what the back-test reports on without ``--data``, and where int8 calibration reads its training bars."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from foxhunt.data.market import MarketSplit
from foxhunt.export.metadata import ExportError

if TYPE_CHECKING:
    from foxhunt.export.load import LoadedEnsemble


def training_split(loaded: LoadedEnsemble, name: str) -> MarketSplit:
    """The named split of the training data, rebuilt from the export's data config with the exported statistics."""
    import yaml

    from foxhunt.data.datamodule import BarDataModule, split_returns

    config = loaded.metadata.get("config")
    cfg = yaml.safe_load(config) if isinstance(config, str) else (config or {})
    data_args = dict(cfg.get("data", {}))
    data_args["cache_dir"] = data_args.get("cache_dir")
    dm = BarDataModule(**data_args)
    bars = dm.load()
    oracle = dm.oracle_mean
    split = loaded.split(bars, name, oracle_mean=oracle)
    if name == "all":
        return split
    dm.bars = bars
    dm.setup()
    mask = torch.zeros(len(split), dtype=torch.bool)
    mask[torch.from_numpy(dm.split_rows[name])] = True
    picked = split.select(mask)
    # as the fit built it: a symbol's last row has no next return inside the split (it would run into a purged bar,
    # the next split or past data.end), so it is no decision bar and every position is closed there
    returns = split_returns(picked.returns, picked.symbol_index)
    return replace(picked, returns=returns, valid=picked.valid & torch.isfinite(returns))


def recorded_training_split(loaded: LoadedEnsemble, where: str) -> MarketSplit:
    """:func:`training_split` ``"train"`` of an export that records its fit config (ExportError naming ``where``
    when it records none: its training bars cannot be told apart then)."""
    config = loaded.metadata.get("config")
    if not config or (isinstance(config, dict) and not config.get("data")):
        raise ExportError(f"{where}: metadata.json records no fit config with a data section, so the training split "
                          "cannot be rebuilt for calibration (export it with python -m foxhunt.fit)")
    return training_split(loaded, "train")
