"""The Q-network's eval forward as a handful of direct calls (its inference form, for one decision at a time).

At batch 1 :meth:`~foxhunt.models.qnet.QNetwork.forward` is ~30 µs of which the arithmetic is a third: the rest is
module attribute lookups and ``F.linear``'s wrapper around ``addmm``. :class:`QNetworkInference` takes the same
parameters (views of them, not copies: a ``load_state_dict`` into the network reaches it) and calls ``addmm``,
``layer_norm`` and an in-place ReLU per hidden layer, which is what ``F.linear`` runs (the same values, bit for bit).
Built for the flat encoder (the default); :func:`q_inference` returns the network itself for any other.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from foxhunt.models.qnet import QNetwork


class QNetworkInference:
    """``net``'s forward in eval mode (no dropout, whatever mode the network is in): window [B, W, F] or [B, W·F] and
    position features [B, P] -> Q."""

    def __init__(self, net: QNetwork) -> None:
        if not net.flat:
            raise ValueError("QNetworkInference covers the flat encoder; call the network itself for the others")
        self.net = net
        self.layers: list[tuple[Tensor, Tensor, tuple | None]] = []
        for block in net.body:
            linear = block[0]
            # the LayerNorm's shape, weight, bias and eps looked up once (a module attribute costs about a microsecond)
            norm = block[1] if net.layer_norm else None
            ln = None if norm is None else (tuple(norm.normalized_shape), norm.weight, norm.bias, norm.eps)
            self.layers.append((linear.weight.t(), linear.bias, ln))
        if net.dueling:
            self.head = None
            self.value = (net.value_head.weight.t(), net.value_head.bias)
            self.advantage = (net.advantage_head.weight.t(), net.advantage_head.bias)
        else:
            self.head = (net.head.weight.t(), net.head.bias)

    def __call__(self, window: Tensor, position: Tensor) -> Tensor:
        x = torch.cat([window.flatten(1) if window.dim() == 3 else window, position], 1)
        for weight_t, bias, ln in self.layers:
            x = torch.addmm(bias, x, weight_t)
            if ln is not None:
                x = torch.layer_norm(x, *ln)  # what F.layer_norm calls, without its wrapper
            x = x.relu_()
        if self.head is not None:
            return torch.addmm(self.head[1], x, self.head[0])
        adv = torch.addmm(self.advantage[1], x, self.advantage[0])
        return torch.addmm(self.value[1], x, self.value[0]) + adv - adv.mean(-1, keepdim=True)


def q_inference(net: nn.Module) -> nn.Module | QNetworkInference:
    """The inference form of a flat-encoder :class:`QNetwork`; any other network (a conv encoder, another member's
    network, a serving wrapper) as it is."""
    if isinstance(net, QNetwork) and net.flat:
        return QNetworkInference(net)
    return net
