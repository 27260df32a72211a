"""MarketDataModule: ready MarketSplits (a simulated market) for agent-only ensembles, which make their own data."""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

from foxhunt.data.market import MarketSpec, MarketSplit


class StepDataset(Dataset[int]):
    """``n`` dummy items: one per training step, for members that make their own data by acting."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"need at least one step per epoch, got {n}")
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class MarketDataModule(pl.LightningDataModule):
    """Ready MarketSplits (e.g. a simulated market) for agent-only ensembles: training steps drive the loop only."""

    def __init__(
        self,
        train: MarketSplit,
        val: MarketSplit | None = None,
        test: MarketSplit | None = None,
        steps_per_epoch: int = 100,
        known_future: list[str] | None = None,
        lookback: int = 1,
        horizon: int = 1,
    ) -> None:
        super().__init__()
        self.splits = {k: v for k, v in (("train", train), ("val", val), ("test", test)) if v is not None}
        self.steps_per_epoch = int(steps_per_epoch)
        self.spec = MarketSpec.of(train, known_future, lookback, horizon)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StepDataset(self.steps_per_epoch), batch_size=None, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(StepDataset(1), batch_size=None, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(StepDataset(1), batch_size=None, shuffle=False)
