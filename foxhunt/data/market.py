"""MarketSplit: the one tensor object every ensemble member reads; MarketSpec: what members size themselves by."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class MarketSplit:
    """One chronological split of the market, flat over symbols, kept as tensors on one device.

    Rows are bars ordered by (symbol, time); ``symbol_index`` tells which symbol a row belongs to, so a
    window or an episode that crosses a symbol boundary can be rejected with a tensor test.
    """

    name: str
    symbols: list[str]
    timestamps: torch.Tensor  # int64 [T], bar open time, ns since epoch, UTC
    symbol_index: torch.Tensor  # int64 [T], index into ``symbols``
    ohlcv: torch.Tensor  # float64 [T, 5]: open, high, low, close, volume (raw)
    returns: torch.Tensor  # float32 [T]: raw next-bar log return ln C[t+1] - ln C[t]; NaN where undefined
    targets: torch.Tensor  # float32 [T]: preprocessed next-bar return (equal to ``returns`` when untransformed)
    valid: torch.Tensor  # bool [T]: a decision may be taken at this bar (features warmed up, return defined)
    features: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0))  # float32 [T, F]
    feature_names: list[str] = field(default_factory=list)
    target_loc: torch.Tensor | None = None  # float32 [T]: targets = (returns - target_loc) / target_scale (pre-clip)
    target_scale: torch.Tensor | None = None  # float32 [T]; with target_loc, maps predicted targets back to returns
    oracle_mean: torch.Tensor | None = None  # float64 [T]: the known conditional mean of returns[t] (synthetic data only)
    target_bounds: tuple[float, float] = (-math.inf, math.inf)  # the clip applied to targets after scaling

    def __post_init__(self) -> None:
        n = self.timestamps.shape[0]
        if self.target_loc is None:
            self.target_loc = torch.zeros(n, dtype=torch.float32, device=self.targets.device)
        if self.target_scale is None:
            self.target_scale = torch.ones(n, dtype=torch.float32, device=self.targets.device)
        for f in ("symbol_index", "ohlcv", "returns", "targets", "valid", "target_loc", "target_scale", "oracle_mean"):
            if getattr(self, f) is not None and getattr(self, f).shape[0] != n:
                raise ValueError(f"MarketSplit {self.name!r}: {f} has {getattr(self, f).shape[0]} rows, expected {n}")
        if self.features.numel() == 0 and self.features.shape[0] != n:
            self.features = torch.empty(n, 0, dtype=torch.float32)
        if self.features.shape[0] != n:
            raise ValueError(f"MarketSplit {self.name!r}: features have {self.features.shape[0]} rows, expected {n}")
        if self.features.shape[1] != len(self.feature_names):
            raise ValueError(
                f"MarketSplit {self.name!r}: {self.features.shape[1]} feature columns but {len(self.feature_names)} names"
            )

    def __len__(self) -> int:
        return int(self.timestamps.shape[0])

    @property
    def close(self) -> torch.Tensor:
        return self.ohlcv[:, 3]

    @property
    def n_features(self) -> int:
        return int(self.features.shape[1])

    @property
    def first_bar(self) -> torch.Tensor:
        """[T] True at the first bar of each symbol: no position is carried in from another symbol (or from before)."""
        first = torch.ones_like(self.symbol_index, dtype=torch.bool)
        first[1:] = self.symbol_index[1:] != self.symbol_index[:-1]
        return first

    @property
    def last_bar(self) -> torch.Tensor:
        """[T] True at the last bar of each symbol: a position held there is closed after it."""
        last = torch.ones_like(self.symbol_index, dtype=torch.bool)
        last[:-1] = self.symbol_index[1:] != self.symbol_index[:-1]
        return last

    def segment_bounds(self) -> torch.Tensor:
        """[S, 2] start/end (exclusive) row of each symbol's contiguous block, in any order of blocks (an export's codes
        need not follow the file's order); [0, 0] for a symbol without rows."""
        sym = self.symbol_index
        n = len(self.symbols)
        idx = torch.arange(sym.shape[0], device=sym.device)
        start = torch.full((n,), sym.shape[0], dtype=torch.int64, device=sym.device).scatter_reduce(0, sym, idx, "amin")
        end = torch.zeros(n, dtype=torch.int64, device=sym.device).scatter_reduce(0, sym, idx + 1, "amax")
        return torch.stack([torch.where(end > 0, start, 0), end], dim=1)

    def select(self, rows: torch.Tensor) -> MarketSplit:
        """The rows picked by a boolean mask [T], as a split of its own (order kept)."""
        idx = rows.nonzero().squeeze(1)
        picked = {f.name: getattr(self, f.name)[idx] for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **picked)

    def to(self, device: torch.device | str) -> MarketSplit:
        """Move every tensor to ``device`` (ohlcv stays float64 except on devices without it)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


@dataclass(frozen=True)
class MarketSpec:
    """What members size their networks by, derived from the data (so never written into their hyperparameters)."""

    feature_names: list[str]
    known_future: list[str]
    symbols: list[str]
    lookback: int
    horizon: int

    @property
    def n_features(self) -> int:
        return len(self.feature_names)

    @classmethod
    def of(cls, split: MarketSplit, known_future: list[str] | None = None, lookback: int = 1, horizon: int = 1) -> MarketSpec:
        """The spec of a split's columns (for markets built without a BarDataModule)."""
        return cls(list(split.feature_names), list(known_future or []), list(split.symbols), int(lookback), int(horizon))

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
