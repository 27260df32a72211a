"""ForecastMemo: a network's forecasts on a whole split, kept until something they depend on changes.

The coordinator forecasts the validation split at every validation with every forecaster and, under stacking, with
every frozen snapshot (the agents' inputs), and again when the export's recheck has loaded the best checkpoint. A
forecast of a whole split is a function of the split, the network's parameters and buffers, the grad, inference and
autocast modes it runs under (the TFT's eval forward without grad takes its inference form, equal to float rounding)
and the forecaster's target transform. When all of these are what they were at the last pass on the same split
object, the memo hands back that pass's forecasts, the same values, instead of a forward over every window: the
snapshots never change after the agents start, and a checkpoint loaded from the last epoch holds the weights that
last forecast (ensemble.yaml's validation split is ~593,000 windows: ~45 minutes of the TFT on one CPU core).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from foxhunt.data.market import MarketSplit


@dataclass
class _Pass:
    """One whole-split pass and what it depended on."""

    split: MarketSplit
    net: nn.Module
    mode: tuple[Any, ...]
    transform: Any
    state: list[Tensor]  # copies of the network's parameters and buffers at the pass
    forecasts: Tensor


def _mode(device: torch.device) -> tuple[Any, ...]:
    """The autograd and autocast modes a forward on ``device`` runs under."""
    kind = device.type
    autocast = torch.is_autocast_enabled(kind)
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast,
            torch.get_autocast_dtype(kind) if autocast else None)


def _same_state(kept: list[Tensor], now: list[Tensor]) -> bool:
    return len(kept) == len(now) and all(
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
        for a, b in zip(kept, now, strict=True))


class ForecastMemo:
    """The last whole-split pass of each (forecaster name, network), reused while nothing it depended on changed."""

    def __init__(self) -> None:
        self._passes: dict[tuple[str, int], _Pass] = {}

    def forecast(self, name: str, forecaster: Any, split: MarketSplit, net: nn.Module | None = None) -> Tensor:
        """``forecaster.forecast(split, net=net)``, or a copy of the same forecasts when the last pass of this
        network on this split object ran with equal weights, modes and target transform."""
        network = forecaster.network if net is None else net
        state = [t.detach() for t in (*network.parameters(), *network.buffers())]
        mode = _mode(state[0].device if state else torch.device("cpu"))
        transform = forecaster.target_transform
        key = (name, id(network))
        kept = self._passes.get(key)
        if (kept is not None and kept.split is split and kept.net is network and kept.mode == mode
                and kept.transform is transform and _same_state(kept.state, state)):
            return kept.forecasts.clone()
        out = forecaster.forecast(split, net=net)
        self._passes[key] = _Pass(split, network, mode, transform, [t.clone() for t in state], out.clone())
        return out
