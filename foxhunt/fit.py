"""`python -m foxhunt.fit --config lightning_configs/<name>.yaml`: train the ensemble with LightningCLI.

Everything is a typed constructor argument of ``EnsembleModule`` (with its ``tft`` and ``dqn`` members),
``BarDataModule`` or ``Trainer``, so the usual LightningCLI conventions hold: ``--print_config``, overrides such as
``--trainer.max_epochs 3`` or ``--model.tft.hidden_size 64``, ``--ckpt_path last`` to resume. Sizes that follow from
the data (feature counts, symbols) are linked from the DataModule and need not be written in configs. After
training, the best or last weights are exported as safetensors with JSON metadata and back-tested on the test split.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    RichProgressBar,
)
from lightning.pytorch.cli import LightningCLI

from foxhunt.data.datamodule import BarDataModule
from foxhunt.lit.ensemble import EnsembleModule

log = logging.getLogger("foxhunt.fit")


def _n_features(dm: BarDataModule) -> int:
    return len(dm.feature_names)


def _n_known(dm: BarDataModule) -> int:
    return len(dm.known_future)


def _n_symbols(dm: BarDataModule) -> int:
    return dm.n_symbols


class FoxhuntCLI(LightningCLI):
    """LightningCLI with the data-to-model links, foxhunt's default callbacks and logger, and the export step."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--checkpoint_monitor", type=str, default="val/sharpe", help="metric the best checkpoint (and the export) is chosen by")
        parser.add_argument("--checkpoint_mode", type=str, default="max", help="'max' or 'min' for checkpoint_monitor")
        parser.add_argument("--torch_threads", type=int | None, default=None, help="intra-op CPU threads (small models on few cores train faster with 1)")
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume from ('last' for the latest)")
        parser.add_argument("--export_dir", type=str | None, default=None, help="where to write the safetensors export (default: <log_dir>/export)")
        parser.add_argument("--backtest", type=bool, default=True, help="back-test the exported model on the test split after fit")
        parser.link_arguments("data", "model.tft.init_args.n_features", compute_fn=_n_features, apply_on="instantiate")
        parser.link_arguments("data", "model.tft.init_args.n_known_future", compute_fn=_n_known, apply_on="instantiate")
        parser.link_arguments("data", "model.tft.init_args.n_symbols", compute_fn=_n_symbols, apply_on="instantiate")
        parser.link_arguments("data.lookback", "model.tft.init_args.lookback")
        parser.link_arguments("data.horizon", "model.tft.init_args.horizon")
        parser.link_arguments("data", "model.tft.init_args.feature_names", compute_fn=lambda dm: dm.feature_names, apply_on="instantiate")
        parser.link_arguments("data", "model.tft.init_args.known_future_names", compute_fn=lambda dm: list(dm.known_future), apply_on="instantiate")
        parser.link_arguments("data", "model.dqn.init_args.n_features", compute_fn=_n_features, apply_on="instantiate")
        parser.link_arguments("model.cost_bps", "model.dqn.init_args.cost_bps")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "foxhunt", "default_hp_metric": False},
                },
            }
        )

    def _add_instantiators(self) -> None:
        """Keep LightningCLI's hparams instantiator for the data only: for the model it writes links into members
        configured as null (``--model.dqn null``) and fails; the ensemble saves its own hyperparameters and the
        export records every member's, so nothing is lost."""
        from lightning.pytorch.cli import _get_module_type, _InstantiatorFn

        self.parser.add_instantiator(
            _InstantiatorFn(cli=self, key="data"), _get_module_type(self._datamodule_class), subclasses=self.subclass_mode_data
        )

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        """A rich progress bar unless progress bars are off or another one was configured."""
        configured = list(config.get("callbacks") or []) + list(callbacks)
        if config.get("enable_checkpointing", True) is not False:
            # the best model by the configured metric (exported at the end), and the latest one to resume from
            monitor, mode = self.config.get("checkpoint_monitor", "val/sharpe"), self.config.get("checkpoint_mode", "max")
            callbacks = [
                ModelCheckpoint(monitor=monitor, mode=mode, save_top_k=1, filename="best-{epoch}-{step}"),
                ModelCheckpoint(monitor=None, save_top_k=1, filename="last", enable_version_counter=False),
                *callbacks,
            ]
        if config.get("enable_progress_bar", True) is not False and not any(
            type(cb).__name__.endswith("ProgressBar") for cb in configured
        ):
            callbacks = [*callbacks, RichProgressBar(leave=True)]
        return super()._instantiate_trainer(config, callbacks)

    def before_instantiate_classes(self) -> None:
        threads = self.config.get("torch_threads")
        if threads:
            torch.set_num_threads(int(threads))

    def fit(self) -> dict[str, Any]:
        """Train, then export the best weights and back-test them on the test split."""
        cfg = self.config
        trainer, model, dm = self.trainer, self.model, self.datamodule
        if trainer.loggers and not any(isinstance(cb, LearningRateMonitor) for cb in trainer.callbacks):
            trainer.callbacks.append(LearningRateMonitor(logging_interval="step"))
        trainer.fit(model, datamodule=dm, ckpt_path=self._resolve_ckpt_path(cfg.get("ckpt_path")))
        return self.export_and_backtest()

    def _resolve_ckpt_path(self, ckpt_path: str | None) -> str | None:
        """'last' means the newest last.ckpt of any earlier version of this logger's runs (a new run has its own
        version directory, where Lightning alone would find nothing and silently start over)."""
        if ckpt_path != "last":
            return ckpt_path
        logger = self.trainer.logger
        root = Path(logger.save_dir) / (logger.name or "") if logger is not None else Path(self.trainer.default_root_dir)
        found = sorted(root.glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise FileNotFoundError(f"--ckpt_path last: no last.ckpt under {root}/version_*/checkpoints")
        log.info("resuming from %s", found[-1])
        return str(found[-1])

    def export_and_backtest(self) -> dict[str, Any]:
        from foxhunt.backtest import backtest_table, format_table
        from foxhunt.export import export_ensemble

        cfg = self.config
        trainer, model, dm = self.trainer, self.model, self.datamodule
        if trainer.global_rank != 0:
            return {}
        ckpt = trainer.checkpoint_callback
        best = getattr(ckpt, "best_model_path", "") if ckpt is not None else ""
        if best:
            state = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
            model.load_state_dict(state)
            log.info("loaded the best checkpoint %s for export", best)
        out_dir = Path(cfg.get("export_dir") or Path(trainer.log_dir or "runs") / "export")
        meta = export_ensemble(model, dm, out_dir, config=self.parser.dump(cfg, skip_none=False))
        print(f"\nexported {', '.join(sorted(meta['files']))} to {out_dir}")
        if not cfg.get("backtest", True):
            return {"export": meta}
        table = backtest_table(model, "test")
        print("\nBack-test on the test split, after costs:\n" + format_table(table))
        return {"export": meta, "backtest": table}


def default_trainer_kwargs() -> dict[str, Any]:
    """Trainer defaults: precision by device, checkpoints on the ensemble's validation Sharpe, rich progress."""
    precision = "32-true"
    if torch.cuda.is_available():
        precision = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return {
        "precision": precision,
        "callbacks": [],
        "log_every_n_steps": 10,
    }


def build_cli(args: list[str] | None = None, callbacks: list[Any] | None = None) -> FoxhuntCLI:
    """Parse a config and overrides into a ready CLI (model, data, trainer) without training; ``callbacks`` are
    added to the Trainer's (e.g. an Optuna pruning callback)."""
    defaults = default_trainer_kwargs()
    defaults["callbacks"] = [*defaults["callbacks"], *(callbacks or [])]
    return FoxhuntCLI(
        EnsembleModule,
        BarDataModule,
        subclass_mode_model=False,
        subclass_mode_data=False,
        trainer_defaults=defaults,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=False,
    )


def main(args: list[str] | None = None) -> FoxhuntCLI:
    """Parse the config and overrides, train, export and back-test."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cli = build_cli(args)
    cli.results = cli.fit()
    return cli


if __name__ == "__main__":
    main()
