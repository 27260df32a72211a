"""`python -m foxhunt.fit --config lightning_configs/<name>.yaml`: train the ensemble with LightningCLI.

Everything is a typed constructor argument of ``EnsembleModule`` (with its named ``members``, each a
``class_path``/``init_args`` entry), ``BarDataModule`` or ``Trainer``, so the usual LightningCLI conventions hold:
``--print_config``, overrides such as ``--trainer.max_epochs 3`` or ``--model.members.tft.init_args.hidden_size 64``,
``--ckpt_path last`` to resume (from the newest checkpoint that loads, ``--checkpoint_every_n_steps`` ones
included; the resumed run logs to a new version but keeps checkpointing where the run it resumes did, so the best
checkpoint, and the export, are the best of the whole run). Sizes that follow from the data (feature counts, names,
symbols, windows) reach the members when the coordinator binds them to the data, so configs never write them. After
training, the best checkpoint (read with its recorded SHA-256 verified) is exported as safetensors with JSON metadata
and back-tested on the test split.

A mistake in the config, the data or a path is one line, ``error: <file/field>: <reason>``, and exit status 2
(:mod:`foxhunt.cli_errors`; ``--debug`` for the traceback); every constructor argument is checked when the classes are
built, before any data is loaded; a ``data.path`` that names nothing is refused when the command line is parsed. Then,
before the Trainer is built, the data is loaded and what the config implies about the run's length and data is
checked once (:mod:`foxhunt.lit.run_plan`): refused in one line naming the key, or, in a run shortened from the config
files' own trainer limits (a smoke run), scaled, one line each.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI

from foxhunt.cli_errors import ConfigError, UserError, run_command
from foxhunt.data.datamodule import BarDataModule
from foxhunt.evaluation.figures import ValidationFigures
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.training.memory import retain_freed_memory

log = logging.getLogger("foxhunt.fit")

# What the main path would print whose cause lies outside foxhunt and that no public API avoids; hidden (by
# ``quiet_outside_causes``) only while the CLI is built and fits. (category, message, module) as warnings.filterwarnings
# takes them:
OUTSIDE_WARNINGS = (
    # Lightning's CLI calls jsonargparse APIs deprecated since jsonargparse 4.49 (add_instantiator,
    # instantiate_classes, skip_none), with the notice jsonargparse puts before the first of them
    (DeprecationWarning, r"(?s).*(was deprecated in v4\.|only one JsonargparseDeprecationWarning per type)",
     r"lightning\.pytorch\.cli"),
    # Lightning's CombinedLoader (every fit's data loaders) builds torch's LeafSpec, which this torch deprecates
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree"),
)
# Lightning's advert for its cloud logger, logged at every Trainer whose logger is not that one
LITLOGGER_TIP = "\N{ELECTRIC LIGHT BULB} Tip: For seamless cloud logging"


class FoxhuntCLI(LightningCLI):
    """LightningCLI with the data-to-model links, foxhunt's default callbacks and logger, the run's plan checked
    before training, and the export step."""

    def __init__(self, *args: Any, plan_before_trainer: bool = False, **kwargs: Any) -> None:
        """``plan_before_trainer``: load the data and check the run's plan (:meth:`check_run_plan`) before the
        Trainer is built (``python -m foxhunt.fit``); otherwise the plan is checked when :meth:`fit` starts, so a CLI
        built without training (a config check) loads no data."""
        self.plan_before_trainer = plan_before_trainer
        self._plan_failure: BaseException | None = None
        super().__init__(*args, **kwargs)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse, then refuse a ``data.path`` that names nothing (one line, before Lightning prints anything)."""
        super().parse_arguments(parser, args)
        config = self.config.get("fit") or self.config  # the fit subcommand's, or the whole config (run=False)
        path = (config.get("data") or {}).get("path") if config is not None else None
        if path is not None:
            from foxhunt.data.io import resolve_paths

            resolve_paths(path)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--checkpoint_monitor", type=str, default="val/sharpe", help="metric the best checkpoint (and the export) is chosen by")
        parser.add_argument("--checkpoint_mode", type=str, default="max", help="'max' or 'min' for checkpoint_monitor")
        parser.add_argument("--torch_threads", type=int | None, default=None, help="intra-op CPU threads (small models on few cores train faster with 1)")
        parser.add_argument("--retain_freed_memory", type=bool, default=True,
                            help="keep freed memory in the process during the fit (glibc), so long-lookback steps do not fault in fresh pages every step; false: the system allocator")
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume from ('last': the newest that loads)")
        parser.add_argument("--checkpoint_every_n_steps", type=int | None, default=None,
                            help="also checkpoint every N training steps inside an epoch (last-steps.ckpt), so a crash loses at most N steps")
        parser.add_argument("--export_dir", type=str | None, default=None, help="where to write the safetensors export (default: <log_dir>/export)")
        parser.add_argument("--backtest", type=bool, default=True, help="back-test the exported model on the test split after fit")
        parser.add_argument("--hparams_tab", type=bool, default=True, help="fill TensorBoard's HPARAMS tab with every hyperparameter and the policies' final validation and test Sharpe (foxhunt.tune writes its own)")
        parser.add_argument("--log_figures", type=bool, default=True, help="equity curves, fan charts and interpretation figures to TensorBoard")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "foxhunt", "default_hp_metric": False},
                },
            }
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with foxhunt's checkpoints where the config names none (the best by ``checkpoint_monitor``,
        exported at the end, and the latest to resume from), the ensemble's figures, and a rich progress bar in place
        of the default one. Callbacks the config names are kept as they are."""
        config = self.config_init.get(self.subcommand) if self.subcommand else self.config_init
        settings = {**((config.get("trainer") or {}) if config else {}), **kwargs}
        if self.plan_before_trainer and not self.config.get("ckpt_path"):  # a resume: its checkpoint is found first
            try:
                parsed = self.config.get(self.subcommand) if self.subcommand else self.config
                check_members(self.model, parsed)
                self.check_run_plan(settings)
            except BaseException as e:  # not a constructor's refusal: instantiate_classes must not relabel it
                self._plan_failure = e
                raise
        named = _listed(settings.get("callbacks"))
        if settings.get("enable_checkpointing") is not False and not any(
            isinstance(cb, ModelCheckpoint) for cb in [*named, *_listed(self.trainer_defaults.get("callbacks"))]
        ):  # given to the Trainer, so that it builds no default checkpoint of its own (nor advertises a cloud one)
            monitor, mode = self.config.get("checkpoint_monitor", "val/sharpe"), self.config.get("checkpoint_mode", "max")
            kwargs["callbacks"] = [
                *named,
                ModelCheckpoint(monitor=monitor, mode=mode, save_top_k=1, filename="best-{epoch}-{step}"),
                ModelCheckpoint(monitor=None, save_top_k=1, filename="last", enable_version_counter=False),
            ]
        trainer = super().instantiate_trainer(**kwargs)
        callbacks = list(trainer.callbacks)
        every = self.config.get("checkpoint_every_n_steps")
        if every is not None:
            from foxhunt.training.checkpoint_io import PeriodicCheckpoint

            callbacks.append(PeriodicCheckpoint(every))
        bars = [cb for cb in callbacks if isinstance(cb, ProgressBar)]
        if len(bars) == 1 and type(bars[0]) is TQDMProgressBar:
            callbacks[callbacks.index(bars[0])] = RichProgressBar(leave=True)
        if self.config.get("log_figures", True) and not any(isinstance(cb, ValidationFigures) for cb in callbacks):
            callbacks.append(ValidationFigures())
        trainer.callbacks = callbacks
        self._use_atomic_checkpoints(trainer)
        return trainer

    def _use_atomic_checkpoints(self, trainer: Trainer) -> None:
        """Checkpoints written atomically in their own directory and unreadable ones named in one line
        (``AtomicCheckpointIO``), set through the strategy's public ``checkpoint_io`` setter after instantiation, unless
        the config names a checkpoint-IO plugin or the strategy's is not Lightning's plain ``TorchCheckpointIO`` (XLA's,
        an async wrapper)."""
        from lightning.fabric.plugins import CheckpointIO
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        from foxhunt.training.checkpoint_io import AtomicCheckpointIO

        config = self.config_init.get(self.subcommand) if self.subcommand else self.config_init
        plugins = (config.get("trainer") or {}).get("plugins") if config else None
        plugins = plugins if isinstance(plugins, (list, tuple)) else [plugins]
        if any(isinstance(p, CheckpointIO) for p in plugins):
            return
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def before_instantiate_classes(self) -> None:
        threads = self.config.get("torch_threads")
        if threads is not None and threads < 1:
            raise ConfigError(f"torch_threads: must be a positive number of threads (or null: torch's default), got {threads}")
        if threads:
            torch.set_num_threads(int(threads))
        every = self.config.get("checkpoint_every_n_steps")
        if every is not None and every < 1:
            raise ConfigError(f"checkpoint_every_n_steps: must be a positive number of steps, got {every}")

    def instantiate_classes(self) -> None:
        """Build the data module, the model with its members and the Trainer (no data is loaded yet); a value a
        constructor refuses becomes one ``ConfigError`` naming the config file and the key of the object."""
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        try:
            super().instantiate_classes()
        except UserError:
            raise
        except (ValueError, TypeError) as e:
            if e is self._plan_failure:
                raise
            raise ConfigError(f"{config_source(config)}{constructor_key(e, config)}: {e}") from e
        check_members(self.model, config)
        seed = config.get("seed_everything")  # an int here: LightningCLI has drawn one if the config said true
        if isinstance(seed, int) and not isinstance(seed, bool) and seed:
            offset_member_seeds(self.model, seed)

    def check_run_plan(self, trainer_settings: dict[str, Any]) -> None:
        """Load the data and check, once, everything the config implies about the run's length and data before any
        training: the training windows against the batch size, each member's start step and warm-up against its
        updates (a run shortened from the config's own trainer limits scales them), and the members' settings that
        outlast the run (:func:`foxhunt.lit.run_plan.check_plan`); a refusal is one ``ConfigError`` naming its key."""
        from foxhunt.lit.run_plan import TrainerLimits, check_data, check_plan, check_trainer

        config = self.config.get(self.subcommand) if self.subcommand else self.config
        source = config_source(config)
        model, dm = self.model, self.datamodule
        dm.setup("fit")
        check_data(model, dm, source)
        train = dm.splits["train"]
        if model.hparams.combine == "stack" and model.forecaster_names:  # as the coordinator's setup will restrict it
            dm.train_window_mask = model.forecaster_window_mask(train, dm.horizon)
        loader = dm.windows("train", shuffle=True)
        if len(loader) == 0:
            raise ConfigError(
                f"{source}data.batch_size: {dm.batch_size}, but the training split has {loader.num_windows:,} complete "
                f"windows of lookback {dm.lookback} + horizon {dm.horizon} (of {len(train):,} bars): not one batch "
                f"an epoch; use at most {max(1, loader.num_windows)}, or more bars"
            )
        limits = TrainerLimits.of(trainer_settings)
        if limits.batches_per_epoch(len(loader)) == 0:
            raise ConfigError(
                f"{source}trainer.limit_train_batches: {limits.limit_train_batches} of the {len(loader):,} training "
                f"batches an epoch is none; use at least {1 / len(loader):.3g}"
            )
        reference = config_file_trainer(config)
        model.run_plan = check_plan(
            {n: model.member(n) for n in model.member_names}, len(loader), limits,
            None if reference is None else TrainerLimits.of(reference), source,
        )
        check_trainer(trainer_settings, limits.batches_per_epoch(len(loader)), model.run_plan,
                      {n: model.member(n).start_step for n in model.member_names}, source)

    def fit(self) -> dict[str, Any]:
        """Train, then export the best weights and back-test them on the test split."""
        cfg = self.config
        trainer, model, dm = self.trainer, self.model, self.datamodule
        ckpt_path = self._resolve_ckpt_path(cfg.get("ckpt_path"))  # before the logger writes: a refusal leaves no run
        if model.run_plan is None:
            self.check_run_plan((cfg.get(self.subcommand) if self.subcommand else cfg).get("trainer") or {})
        continued = self._continue_checkpoint_dirs(ckpt_path) if ckpt_path else False
        if cfg.get("hparams_tab", True):  # every hyperparameter, against the metrics filled in when the fit is over
            for lg in trainer.loggers:
                lg.log_hyperparams(model.hparam_params(), dict.fromkeys(model.hparam_metric_names(), float("nan")))
        with retain_freed_memory(bool(cfg.get("retain_freed_memory", True))):
            with quiet_outside_causes():
                if continued:  # the resumed run's own checkpoints are there, as they should be
                    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
                trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
            return self.export_and_backtest()

    def _continue_checkpoint_dirs(self, ckpt_path: str) -> bool:
        """Checkpoint where the run being resumed did. A resumed run logs to a new ``version_N``, and a
        ``ModelCheckpoint`` left to derive its directory from the logger would write there; Lightning then sees that
        its ``dirpath`` changed and restores none of its best score and best-k files (only ``best_model_path``), so the
        best checkpoint, and the export, would be the best since the resume. Each ``ModelCheckpoint`` without a
        configured ``dirpath`` whose state the checkpoint records, with a ``dirpath`` that is the resumed checkpoint's
        own directory, gets that ``dirpath`` (exactly as recorded, which is what Lightning compares), so its whole state
        is restored and the run lineage keeps one best checkpoint. Returns whether any was kept."""
        from foxhunt.training.checkpoint_io import recorded_checkpoint_dirs

        recorded = recorded_checkpoint_dirs(ckpt_path)
        here = Path(ckpt_path).resolve().parent
        kept = False
        for cb in self.trainer.checkpoint_callbacks:
            if not isinstance(cb, ModelCheckpoint) or cb.dirpath is not None or cb.state_key not in recorded:
                continue
            dirpath = recorded[cb.state_key]
            if Path(dirpath).resolve() == here:
                cb.dirpath = dirpath
                kept = True
            else:
                log.warning(
                    "--ckpt_path %s: the checkpoint is not in the directory its run checkpointed to (%s): this run "
                    "checkpoints to its own version, and its best checkpoint (the export) is the best since the "
                    "resume", ckpt_path, dirpath,
                )
                break
        if kept:
            log.info("checkpoints continue in %s, the resumed run's: the best checkpoint is the best of the whole run",
                     here)
        return kept

    def _resolve_ckpt_path(self, ckpt_path: str | None) -> str | None:
        """'last' means the newest last.ckpt or last-steps.ckpt (``--checkpoint_every_n_steps``) of any earlier
        version of this logger's runs (a new run has its own version directory, where Lightning alone would find nothing and silently start over) that loads: an empty,
        truncated or unreadable one (a crash while it was written by another writer) is skipped with a warning that
        says why, in favour of the next newest."""
        from foxhunt.training.checkpoint_io import CheckpointError, checkpoint_problem

        if ckpt_path != "last":
            return ckpt_path
        logger = self.trainer.logger
        root = Path(logger.save_dir) / (logger.name or "") if logger is not None else Path(self.trainer.default_root_dir)
        found = sorted(root.glob("version_*/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
        if not found:
            raise FileNotFoundError(f"--ckpt_path last: no last.ckpt under {root}/version_*/checkpoints")
        for path in found:
            problem = checkpoint_problem(path)
            if problem is None:
                log.info("resuming from %s", path)
                return str(path)
            log.warning("--ckpt_path last: skipping %s: %s", path, problem)
        raise CheckpointError(
            f"--ckpt_path last: none of the {len(found)} last*.ckpt under {root}/version_*/checkpoints loads "
            "(each is named above with the reason)"
        )

    def export_and_backtest(self) -> dict[str, Any]:
        from foxhunt.evaluation.backtest import format_table
        from foxhunt.export.write import export_ensemble
        from foxhunt.training.checkpoint_io import load_verified_checkpoint  # the recorded SHA-256 verified

        cfg = self.config
        trainer, model, dm = self.trainer, self.model, self.datamodule
        if trainer.global_rank != 0:
            return {}
        ckpt = trainer.checkpoint_callback
        best = getattr(ckpt, "best_model_path", "") if ckpt is not None else ""
        if best:
            model.load_weights(load_verified_checkpoint(best, use="export"))
            log.info("loaded the best checkpoint %s for export", best)
            if "val" in model.splits:  # the validation figures of the weights exported, not of the last epoch
                model.last_evaluation = model.evaluate(model.split("val"), recheck_flat=True)
        out_dir = Path(cfg.get("export_dir") or Path(trainer.log_dir or "runs") / "export")
        meta = export_ensemble(model, dm, out_dir, config=self.parser.dump(cfg, skip_unset=False))
        print(f"\nexported {', '.join(sorted(meta['files']))} to {out_dir}")
        if not cfg.get("backtest", True):
            return {"export": meta}
        table = model.evaluate(model.split("test"), significance=True).metrics
        if cfg.get("hparams_tab", True) and model.last_evaluation is not None:  # the exported weights' val and test Sharpe
            for lg in trainer.loggers:
                lg.log_metrics(model.hparam_metrics(model.last_evaluation.metrics, table), step=trainer.global_step)
        print("\nBack-test after costs, on the test split (untouched by training, weights and checkpoint choice):\n"
              + format_table(table, split="test"))
        return {"export": meta, "backtest": table}


def config_file_trainer(config: Any) -> dict[str, Any] | None:
    """The ``trainer`` settings the config files give (the later file winning), without the command line's: the run
    the config was sized for; None when no config file was given."""
    files = [Path(str(c)) for c in (config.get("config") or [])] if config is not None else []
    files = [f for f in files if f.is_file()]
    if not files:
        return None
    merged: dict[str, Any] = {}
    for f in files:
        loaded = yaml.safe_load(f.read_text()) or {}
        trainer = loaded.get("trainer") if isinstance(loaded, dict) else None
        if isinstance(trainer, dict):
            merged.update(trainer)
    return merged


def offset_member_seeds(model: EnsembleModule, run_seed: int) -> None:
    """Add the run's ``seed_everything`` to every member's own ``seed`` (an agent's initial weights, environments,
    exploration and minibatch order), so that a new run seed gives new agents as well as new data and forecasters;
    ``seed_everything: 0`` leaves each seed as configured. The config stays as written, so a saved config run again
    gives the same seeds; the members' hparams (and so their checkpoints and exports) hold the seeds used."""
    for member in model.members.values():
        seed = member.hparams.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool):
            member.hparams.seed = member.seed = seed + int(run_seed)
            if getattr(member, "n_inputs", None) is not None:  # built at construction: rebuild from the new seed
                member.build_networks(member.n_inputs)


def config_source(config: Any) -> str:
    """``<the last config file>: `` of a parsed fit config (empty when it came from the command line alone)."""
    files = [str(c) for c in (config.get("config") or [])] if config is not None else []
    return f"{files[-1]}: " if files else ""


def constructor_key(error: BaseException, config: Any) -> str:
    """The config key of the object whose constructor raised ``error`` (the innermost ``__init__`` frame of a
    configured object: the data module, the Trainer, the ensemble or a member, not the helpers they build, such as a
    data module's ``FeatureSet`` or a member's network): ``data``, ``trainer``, ``model`` or
    ``model.members.<name> (<class>)``."""
    from lightning.pytorch import LightningDataModule

    from foxhunt.lit.member import Member

    owner = None
    tb: types.TracebackType | None = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        candidate = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        if isinstance(candidate, (LightningDataModule, Trainer, EnsembleModule, Member)):
            owner = candidate
        tb = tb.tb_next
    if isinstance(owner, LightningDataModule):
        return "data"
    if isinstance(owner, Trainer):
        return "trainer"
    if isinstance(owner, Member):
        members = (config.get("model") or {}).get("members") or {}
        def class_name(m: Any) -> str:
            path = getattr(m, "class_path", None) or (m.get("class_path") if hasattr(m, "get") else "")
            return str(path).rsplit(".", 1)[-1]

        names = [n for n, m in members.items() if class_name(m) == type(owner).__name__]
        where = f"model.members.{names[0]}" if len(names) == 1 else f"model.members.{{{','.join(names)}}}"
        return f"{where} ({type(owner).__name__})"
    return "model"


def check_members(model: EnsembleModule, config: Any) -> None:
    """What the members' constructors leave to later: every learning rate in (0, 1] (the agents check theirs only when
    their optimiser is built, after the data is loaded)."""
    from foxhunt.training.optim import validate_lr

    for name, member in model.members.items():
        try:
            validate_lr(member.optim.lr)
        except ValueError as e:
            raise ConfigError(f"{config_source(config)}model.members.{name} ({type(member).__name__}): {e}") from e


def _listed(callbacks: Any) -> list[Any]:
    """A Trainer's ``callbacks`` argument as a list (it takes None, one callback or a list)."""
    return [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def _not_the_litlogger_tip(record: logging.LogRecord) -> bool:
    """A logging filter that drops Lightning's cloud-logger advert (``LITLOGGER_TIP``) and keeps everything else."""
    return not record.getMessage().startswith(LITLOGGER_TIP)


@contextlib.contextmanager
def quiet_outside_causes() -> Iterator[None]:
    """Hide, inside the block, the warnings of ``OUTSIDE_WARNINGS`` and Lightning's cloud-logger advert: neither has a
    cause in foxhunt or in its config, so the lines left are the ones worth reading."""
    notices = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where Lightning's rank_zero_info logs
    with warnings.catch_warnings():
        for category, message, module in OUTSIDE_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        notices.addFilter(_not_the_litlogger_tip)
        try:
            yield
        finally:
            notices.removeFilter(_not_the_litlogger_tip)


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


def build_cli(args: list[str] | None = None, callbacks: list[Any] | None = None,
              plan_before_trainer: bool = False) -> FoxhuntCLI:
    """Parse a config and overrides into a ready CLI (model, data, trainer) without training; ``callbacks`` are
    added to the Trainer's (e.g. an Optuna pruning callback); ``plan_before_trainer`` loads the data and checks the
    run's plan before the Trainer is built (else :meth:`FoxhuntCLI.fit` checks it first)."""
    defaults = default_trainer_kwargs()
    defaults["callbacks"] = [*defaults["callbacks"], *(callbacks or [])]
    with quiet_outside_causes():  # `python -m foxhunt.fit` passes its own argv (less --debug) on purpose
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return FoxhuntCLI(
            EnsembleModule,
            BarDataModule,
            subclass_mode_model=False,
            subclass_mode_data=False,
            trainer_defaults=defaults,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False},  # a parse error is raised: one line (foxhunt.cli_errors), not usage
            args=args,
            run=False,
            plan_before_trainer=plan_before_trainer,
        )


def main(args: list[str] | None = None) -> FoxhuntCLI:
    """Parse the config and overrides, train, export and back-test."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cli = build_cli(args, plan_before_trainer=True)
    cli.results = cli.fit()
    return cli


if __name__ == "__main__":
    sys.exit(run_command(main))
