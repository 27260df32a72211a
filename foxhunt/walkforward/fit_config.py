"""The fit config every fold trains, parsed once by foxhunt.fit's own parser: what the layout and the folds need."""

from __future__ import annotations

import argparse
import hashlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from foxhunt.cli_errors import one_line
from foxhunt.walkforward.plan import WalkForwardError


class FitConfig:
    """``foxhunt.fit``'s own parser over the fit config and overrides (nothing instantiated): the resolved data,
    model and logger settings the layout and the folds' arguments need."""

    def __init__(self, config: str, overrides: Sequence[str]) -> None:
        from foxhunt.data.datamodule import BarDataModule
        from foxhunt.fit import FoxhuntCLI, default_trainer_kwargs
        from foxhunt.lit.ensemble import EnsembleModule

        class _ParseOnly(FoxhuntCLI):
            def instantiate_classes(self) -> None:
                pass

        # each fold trades its own test stretch with its export, so the fit's own test back-test is off by default
        # (an override ``--backtest true`` turns it back on)
        self.args = ["--config", str(config), "--backtest", "false", *overrides]
        try:
            with warnings.catch_warnings():  # the command's own argv differs from the fit arguments on purpose
                warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
                cli = _ParseOnly(EnsembleModule, BarDataModule, subclass_mode_model=False, subclass_mode_data=False,
                                 trainer_defaults=default_trainer_kwargs(), args=self.args, run=False,
                                 parser_kwargs={"exit_on_error": False})
        except argparse.ArgumentError as e:
            raise WalkForwardError(f"{config}: foxhunt.fit rejects this config: {one_line(e)}") from e
        self.config = cli.config
        self.data = self.config.data.as_dict()
        self.model = self.config.model.as_dict()
        devices, nodes = self.config.get("trainer.devices"), self.config.get("trainer.num_nodes") or 1
        if devices == "auto":  # Lightning would take every GPU (DDP, one process per GPU, each rerunning this command)
            self.args += ["--trainer.devices", "1"]
        elif not _one_device(devices) or int(nodes) != 1:
            raise WalkForwardError(
                f"trainer.devices={devices!r}, num_nodes={nodes}: a walk-forward trains each fold on one device; to "
                "use several, run one `--fold k` process per device (e.g. with CUDA_VISIBLE_DEVICES)"
            )

    def fingerprint(self) -> str:
        """A hash of the resolved data and model settings and the seed: what every fold of one walk-forward shares
        (trainer settings may differ between machines)."""
        data = {k: v for k, v in self.data.items() if k not in ("start", "end", "val_start", "test_start", "cache_dir")}
        body = json.dumps({"data": data, "model": self.model, "seed": self.config.get("seed_everything")},
                          sort_keys=True, default=str)
        return hashlib.blake2b(body.encode(), digest_size=12).hexdigest()

    def logger_save_dir_arg(self, save_dir: Path) -> list[str]:
        """``--trainer.logger.init_args.save_dir DIR`` when the configured logger has a save_dir (TensorBoard, CSV)."""
        logger = self.config.get("trainer.logger")
        init = logger.get("init_args") if hasattr(logger, "get") else None
        if init is not None and "save_dir" in init:
            return ["--trainer.logger.init_args.save_dir", str(save_dir)]
        return []

    def min_bars(self) -> int:
        """Timestamps a stretch must exceed: the purge, and one window of lookback + horizon after it."""
        lookback, horizon = int(self.data["lookback"]), int(self.data["horizon"])
        purge = self.data.get("purge") or lookback + horizon
        return int(purge) + lookback + horizon


def _one_device(devices: Any) -> bool:
    """Lightning's ``devices`` value names a single device: 1, "1", [k] or "k,"."""
    if isinstance(devices, (list, tuple)):
        return len(devices) == 1
    text = str(devices).strip()
    return text == "1" or (text.endswith(",") and text[:-1].strip().isdigit())
