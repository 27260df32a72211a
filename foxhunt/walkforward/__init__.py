"""`python -m foxhunt.walkforward --config <fit config> --folds K [-- fit overrides]`: walk-forward out-of-sample test.

The data's time span is cut into an initial stretch and K consecutive test stretches. Fold k trains an ordinary
``foxhunt.fit`` run (``build_cli`` with the fit config, the overrides and the fold's dates: ``data.start``,
``data.val_start``, ``data.test_start``, ``data.end``) on the window before its test stretch (``expanding``: every bar
before it; ``rolling``: as many bars as the initial stretch), with a validation tail carved from the window's end
and BarDataModule's purge gaps; it exports the best checkpoint and then trades only its own test stretch with that
export (``foxhunt.load``: features recomputed, scaled with the exported statistics). The folds' out-of-sample
positions are concatenated per policy into one series, scored with ``evaluation/backtest.py`` (and with
``evaluation/significance.py`` where it exists) into one table and one equity figure.

A finished fold writes ``fold_<k>/done.json`` beside its positions (``fold_<k>/oos.safetensors``): a rerun skips
finished folds and redoes unfinished ones; ``--fold k`` runs one fold (separate processes or machines), ``--gather``
only gathers the finished folds. See docs/WALKFORWARD.md.

Modules: ``plan`` (the folds' cut times, the layout every fold of one walk-forward shares, the run directory),
``fit_config`` (the fit config the folds train, parsed once), ``fold`` (one fold: fit, export, trade its stretch),
``score`` (a stretch scored as an account of its own), ``gather`` (the finished folds as one out-of-sample table and
figure), ``cli`` (the command line that ``python -m foxhunt.walkforward`` runs).
"""

from foxhunt.walkforward.cli import main

__all__ = ["main"]
