"""Q-network of the DQN trader: an MLP with LayerNorm over a feature window and the held position."""

from __future__ import annotations

import itertools
from typing import Literal

import torch
import torch.nn.functional as F
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
    """Q(s, ·) for every action from window [B, W, F] (or [B, W·F]) and position features [B, P]; optional dueling head.

    ``dropout`` after each hidden layer (training mode only) fights memorising the training path on weak signals.
    """

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
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
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
        self.layer_norm, self.flat, self.dropout = layer_norm, encoder == "flat", float(dropout)
        self.generator: torch.Generator | None = None  # the owner's seeded stream for dropout masks (None: global)
        # One-hot rows of every held position (forward_positions); not saved, it moves with the module's device.
        self.register_buffer("position_eye", torch.eye(n_position_features), persistent=False)
        self.dueling = dueling
        if dueling:
            self.value_head = nn.Linear(hidden[-1], 1)
            self.advantage_head = nn.Linear(hidden[-1], n_actions)
        else:
            self.head = nn.Linear(hidden[-1], n_actions)

    def forward(self, window: Tensor, position: Tensor) -> Tensor:
        return self.mlp(self.inputs(window, position))

    def forward_positions(self, window: Tensor) -> Tensor:
        """[B, P, A] Q-values of each window under every one-hot held position."""
        return self.mlp(self.inputs_all_positions(window)).view(window.shape[0], self.position_eye.shape[0], -1)

    @property
    def parameter_free_inputs(self) -> bool:
        """True when :meth:`inputs` has no parameters, so one input tensor serves every network of this shape."""
        return self.flat

    def inputs(self, window: Tensor, position: Tensor) -> Tensor:
        """[B, in] the MLP's input: the encoded window and the position features."""
        return torch.cat([self._encode(window), position], 1)

    def inputs_all_positions(self, window: Tensor) -> Tensor:
        """[B·P, in] the MLP's inputs of each window under every one-hot held position (one replicating concat)."""
        enc = self._encode(window)
        b, p = enc.shape[0], self.position_eye.shape[0]
        x = torch.cat([enc.unsqueeze(1).expand(b, p, enc.shape[1]), self.position_eye.expand(b, p, p)], 2)
        return x.flatten(0, 1)

    def _encode(self, window: Tensor) -> Tensor:
        """Windows come as [B, W, F] or already flattened [B, W·F] (the DQN's gather yields the flat form)."""
        if self.flat:
            return window.flatten(1) if window.dim() == 3 else window
        return self.encoder(window.reshape(-1, self.window, self.n_features))

    def _dropout(self, x: Tensor) -> Tensor:
        """Inverted dropout, its mask drawn from ``generator`` when one is set (a seeded run stays reproducible)."""
        if self.generator is None:
            return F.dropout(x, self.dropout, True)
        keep = 1.0 - self.dropout
        mask = torch.rand(x.shape, generator=self.generator, device=x.device) < keep
        return x * mask / keep

    def mlp(self, x: Tensor) -> Tensor:
        """Body and head by functional calls: the DQN update runs this network several times on small batches, where
        per-module call overhead (hooks, Sequential dispatch) costs as much as the arithmetic. Same parameters."""
        for block in self.body:
            linear = block[0]
            x = F.linear(x, linear.weight, linear.bias)
            if self.layer_norm:
                norm = block[1]
                x = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            x = torch.relu(x)
            if self.dropout and self.training:  # after each hidden layer, training only (evaluation is greedy)
                x = self._dropout(x)
        if self.dueling:
            adv = F.linear(x, self.advantage_head.weight, self.advantage_head.bias)
            return F.linear(x, self.value_head.weight, self.value_head.bias) + adv - adv.mean(-1, keepdim=True)
        return F.linear(x, self.head.weight, self.head.bias)
