"""Q-network of the DQN trader: an MLP with LayerNorm over a feature window and the held position."""

from __future__ import annotations

import itertools
from typing import Literal

import torch
from torch import Tensor, nn

EncoderKind = Literal["flat", "conv"]


def mlp_block(n_in: int, n_out: int, layer_norm: bool) -> nn.Sequential:
    """Linear → LayerNorm → ReLU: LayerNorm keeps Q-learning's moving targets from blowing activations up."""
    layers: list[nn.Module] = [nn.Linear(n_in, n_out)]
    if layer_norm:
        layers.append(nn.LayerNorm(n_out))
    layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TemporalConvEncoder(nn.Module):
    """A small 1-D convolution over the window's time axis, flattened: weights shared across time steps."""

    def __init__(self, n_features: int, window: int, channels: int = 16, kernel_size: int = 3) -> None:
        super().__init__()
        kernel_size = min(kernel_size, window)
        self.conv = nn.Conv1d(n_features, channels, kernel_size)
        self.n_out = channels * (window - kernel_size + 1)

    def forward(self, window: Tensor) -> Tensor:
        return torch.relu(self.conv(window.transpose(1, 2))).flatten(1)


class QNetwork(nn.Module):
    """Q(s, ·) for every action from window [B, W, F] and position features [B, P]; optional dueling head."""

    def __init__(
        self,
        n_features: int,
        window: int,
        n_actions: int,
        n_position_features: int,
        hidden: tuple[int, ...] = (128, 128),
        layer_norm: bool = True,
        dueling: bool = False,
        encoder: EncoderKind = "flat",
        conv_channels: int = 16,
    ) -> None:
        super().__init__()
        if not hidden:
            raise ValueError("QNetwork needs at least one hidden layer")
        if encoder not in ("flat", "conv"):
            raise ValueError(f"encoder must be 'flat' or 'conv', got {encoder!r}")
        self.window, self.n_features, self.n_actions = window, n_features, n_actions
        if encoder == "conv":
            self.encoder: nn.Module = TemporalConvEncoder(n_features, window, conv_channels)
            n_enc = self.encoder.n_out  # type: ignore[union-attr]
        else:
            self.encoder = nn.Flatten(1)
            n_enc = window * n_features
        widths = (n_enc + n_position_features, *hidden)
        self.body = nn.Sequential(*(mlp_block(a, b, layer_norm) for a, b in itertools.pairwise(widths)))
        self.dueling = dueling
        if dueling:
            self.value_head = nn.Linear(hidden[-1], 1)
            self.advantage_head = nn.Linear(hidden[-1], n_actions)
        else:
            self.head = nn.Linear(hidden[-1], n_actions)

    def forward(self, window: Tensor, position: Tensor) -> Tensor:
        z = self.body(torch.cat([self.encoder(window), position], 1))
        if self.dueling:
            adv = self.advantage_head(z)
            return self.value_head(z) + adv - adv.mean(1, keepdim=True)
        return self.head(z)
