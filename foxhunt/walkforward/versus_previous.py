"""Each fold's model against the previous fold's on the same test stretch: did retraining help on bars neither saw?

Fold k's export and fold k-1's both trade fold k's test stretch (unseen by either: fold k-1 trained on less), each as
an account of its own over the bars both decide on, at the fold's cost; the paired table
(:func:`foxhunt.evaluation.paired.paired_report`) holds fold k's ensemble against fold k-1's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from foxhunt.walkforward.plan import DONE, Fold, WalkForwardError, fold_dir
from foxhunt.walkforward.score import own_account

if TYPE_CHECKING:
    import pandas as pd

    from foxhunt.data.market import MarketSplit

POLICY = "ensemble"  # what an export trades


def versus_previous(out: Path, fold: Fold, bars: pd.DataFrame, test: MarketSplit, own: torch.Tensor,
                    cost_bps: float, bars_per_year: float, oracle_mean: torch.Tensor | None = None,
                    n_boot: int | None = None) -> dict[str, Any] | None:
    """The paired table of fold k's ensemble positions ``own`` on its stretch ``test`` against fold k-1's export
    trading the same rows of ``bars``; None for the first fold, ``{"fold": k-1, "reason": ...}`` when fold k-1 had
    not finished when fold k ran (folds run as separate processes)."""
    from foxhunt.evaluation.backtest import N_BOOT, policy_pnl
    from foxhunt.evaluation.paired import paired_report
    from foxhunt.export.load import load
    from foxhunt.export.metadata import overlap_with_training

    k = fold.index
    if k == 0:
        return None
    where = fold_dir(out, k - 1)
    if not (where / DONE).exists():
        return {"fold": k - 1, "reason": f"fold {k - 1} was not finished when fold {k} ran"}
    loaded = load(where / "export")
    split = loaded.split(bars, name=f"fold {k} test", oracle_mean=oracle_mean)
    theirs = split.select(fold.contains(split.timestamps))
    if not (torch.equal(theirs.timestamps, test.timestamps) and theirs.symbols == test.symbols
            and torch.equal(theirs.symbol_index, test.symbol_index)):
        raise WalkForwardError(f"fold {k}: fold {k - 1}'s export reads other rows of the stretch (symbols differ)")
    if bool(overlap_with_training(loaded.metadata, theirs).any()):
        raise WalkForwardError(f"fold {k}: fold {k - 1}'s export saw bars of fold {k}'s test stretch")
    previous = loaded.model.evaluate(theirs).positions[POLICY]
    common = test.valid & theirs.valid
    pnl = {}
    for name, positions in ((f"fold {k - 1}", previous), (f"fold {k}", own)):
        held, account = own_account({POLICY: positions}, replace(test, valid=common))
        pnl[name] = policy_pnl(held[POLICY], account, cost_bps)
    report = paired_report(pnl, bars_per_year, n_boot=N_BOOT if n_boot is None else n_boot)
    return {"fold": k - 1, **report}

