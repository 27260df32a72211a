"""Which runtime a loaded export's members compute on: torch (as exported), or ONNX Runtime on the export's float or
int8 graphs (``serving.onnx``, ``serving.onnx_int8`` in metadata.json, :mod:`foxhunt.export.onnx`).

:func:`use_backend` swaps each member's traded network for an ``nn.Module`` whose forward runs an ONNX Runtime session
(one intra-op thread), in place, so everything that calls the network (the back-test's ``LoadedEnsemble.positions``
and ``evaluate``, a live session's ``Agent.decision_table`` and ``EnsembleModule.forecasts``) runs the graph unchanged.
Members held flat trade no network and keep none; the stacking snapshots (``combine: stack``) stay torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from foxhunt.export.load import LoadedEnsemble
from foxhunt.export.metadata import ExportError, serving_bytes
from foxhunt.export.onnx import FLOAT, INT8, ort_session
from foxhunt.export.traded import traded_network
from foxhunt.models.actor_critic import ActorCritic

BACKENDS = ("torch", "onnxruntime", "onnxruntime-int8")
_FORMAT = {"onnxruntime": FLOAT, "onnxruntime-int8": INT8}


class ServedForecast(NamedTuple):
    """What a served forecaster returns: the members read ``.prediction`` only."""

    prediction: Tensor  # [B, H, Q]


class _Session(nn.Module):
    """An ONNX Runtime session and its input names, as a module without parameters."""

    def __init__(self, session: Any, single: Any = None) -> None:
        super().__init__()
        self.session = session
        self.single = single  # the same graph fixed to batch 1 (ort_session(blob, batch=1)), run on one row
        self.names = [i.name for i in session.get_inputs()]

    def run(self, feed: dict[str, np.ndarray]) -> Tensor:
        one = self.single is not None and all(v.shape[0] == 1 for v in feed.values())
        return torch.from_numpy((self.single if one else self.session).run(None, feed)[0])


def _f32(t: Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.float32)


class OrtForecaster(_Session):
    """A forecaster's network on ONNX Runtime: (x_past, x_future, symbol) -> ``ServedForecast``."""

    def forward(self, x_past: Tensor, x_future: Tensor | None = None, symbol: Tensor | None = None) -> ServedForecast:
        b = x_past.shape[0]
        feed = {"x_past": _f32(x_past)}
        if "x_future" in self.names:
            feed["x_future"] = _f32(x_future)  # type: ignore[arg-type]
        sym = torch.zeros(b, dtype=torch.int64) if symbol is None else symbol
        feed["symbol"] = np.ascontiguousarray(sym.detach().cpu().numpy(), dtype=np.int64)
        return ServedForecast(self.run(feed).to(x_past.device))


class OrtQNetwork(_Session):
    """A DQN's Q-network on ONNX Runtime: (window [B, W, F] or [B, W·F], position [B, A]) -> Q [B, A]."""

    def __init__(self, session: Any, window: int, n_features: int) -> None:
        super().__init__(session)
        self.window, self.n_features = window, n_features

    def forward(self, window: Tensor, position: Tensor) -> Tensor:
        w = window.reshape(window.shape[0], self.window, self.n_features)
        return self.run({"window": _f32(w), "position": _f32(position)}).to(window.device)


class OrtActorCritic(ActorCritic):
    """PPO's deterministic actor on ONNX Runtime, with the methods the member's evaluation calls: ``deterministic``
    (discrete logits, or the continuous target), and for the continuous policy's bar-by-bar recurrence
    ``actor_prepare`` (the window itself) and ``deterministic_path`` (the graph on each bar's window and held position,
    the no-trade band as :meth:`ActorCritic.deterministic_path` applies it). The critic is not served."""

    def __init__(self, session: Any, net: ActorCritic) -> None:
        nn.Module.__init__(self)  # no parameters: the graph holds them
        self.session = session
        self.window, self.n_features = net.window, net.n_features
        self.n_position_features, self.action_space = net.n_position_features, net.action_space

    def _run(self, window: Tensor, position: Tensor) -> Tensor:
        w = window.reshape(window.shape[0], self.window, self.n_features)
        return torch.from_numpy(self.session.run(None, {"window": _f32(w), "position": _f32(position)})[0])

    def forward(self, window: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError("a served PPO actor computes its deterministic policy only (no critic)")

    def deterministic(self, window: Tensor, position: Tensor) -> Tensor:
        return self._run(window, position).to(window.device)

    def actor_prepare(self, window_flat: Tensor) -> Tensor:
        return window_flat

    @torch.no_grad()
    def deterministic_path(self, prepared: Tensor, decide: Tensor, held: Tensor, no_trade_band: float = 0.0) -> Tensor:
        if not self.continuous:
            raise ValueError("deterministic_path is the continuous policy's; the discrete one is a policy table")
        p = held.detach().float().cpu().reshape(-1, 1)
        ok = decide.detach().cpu().float()
        out = torch.empty(prepared.shape[0], prepared.shape[1])
        for j in range(prepared.shape[1]):
            target = self._run(prepared[:, j].cpu(), p).reshape(-1, 1)
            if no_trade_band > 0.0:
                target = torch.where((target - p).abs() < no_trade_band, p, target)
            p = target * ok[:, j : j + 1]  # flat where no decision is possible
            out[:, j] = p[:, 0]
        return out.to(prepared.device)


def served_network(net: nn.Module, session: Any, single: Any = None) -> nn.Module:
    """The ONNX Runtime module that stands in for the traded network ``net``; a forecaster also runs ``single`` (its
    graph fixed to batch 1) on one symbol's window."""
    from foxhunt.models.qnet import QNetwork

    if isinstance(net, QNetwork):
        return OrtQNetwork(session, net.window, net.n_features)
    if isinstance(net, ActorCritic):
        return OrtActorCritic(session, net)
    return OrtForecaster(session, single)


def swap_traded_network(member: nn.Module, served: nn.Module) -> None:
    """Put ``served`` where ``member`` keeps the network it trades (its ``policy_net``, or its learning network)."""
    _, net = traded_network(member)  # type: ignore[arg-type]
    for attr, child in member.named_children():
        if child is net:
            setattr(member, attr, served)
            return
    raise ExportError(f"{type(member).__name__}: its traded network is not one of its own submodules")


def use_backend(loaded: LoadedEnsemble, root: str | Path, backend: str) -> LoadedEnsemble:
    """Run ``loaded``'s members on ``backend`` (one of :data:`BACKENDS`), in place; ``root`` is its export folder.
    The graphs are read and checked against metadata.json's SHA-256 first (one ExportError line otherwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return loaded
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise ExportError(f"--backend {backend} needs onnxruntime: pip install -e '.[serve]'") from None
    root = Path(root)
    root = root.parent if root.is_file() else root
    from foxhunt.models.qnet import QNetwork

    key = _FORMAT[backend]
    model = loaded.model
    for name in model.member_names:
        member = model.member(name)
        traded, net = traded_network(member)
        if net is None:
            continue
        blob = serving_bytes(root, loaded.metadata, key, name)
        agent = isinstance(net, (QNetwork, ActorCritic))
        single = None if agent else ort_session(blob, batch=1)  # one symbol's decision: ~5% fewer µs (TFT)
        swap_traded_network(member, served_network(net, ort_session(blob), single))
    return loaded
