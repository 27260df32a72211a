"""Q-network: shapes, the dueling head's identifiability, the temporal encoder, gradients reach every block."""

from __future__ import annotations

import pytest
import torch

from foxhunt.models.qnet import QNetwork


@pytest.mark.parametrize("dueling", [False, True])
@pytest.mark.parametrize("encoder", ["flat", "conv"])
def test_shapes_and_gradients(dueling: bool, encoder: str) -> None:
    torch.manual_seed(0)
    net = QNetwork(n_features=5, window=6, n_actions=3, n_position_features=3, hidden=(16, 8), dueling=dueling, encoder=encoder)  # type: ignore[arg-type]
    w, p = torch.randn(11, 6, 5), torch.eye(3)[torch.randint(0, 3, (11,))]
    q = net(w, p)
    assert q.shape == (11, 3) and torch.isfinite(q).all()
    q.sum().backward()
    for name, param in net.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert any(isinstance(m, torch.nn.LayerNorm) for m in net.modules())


def test_dueling_advantages_are_centred() -> None:
    net = QNetwork(2, 3, 4, 4, hidden=(8,), dueling=True)
    w, p = torch.randn(7, 3, 2), torch.eye(4)[torch.randint(0, 4, (7,))]
    with torch.no_grad():
        z = net.body(torch.cat([net.encoder(w), p], 1))
        q = net(w, p)
        assert torch.allclose(q.mean(1, keepdim=True), net.value_head(z), atol=1e-6)


def test_output_depends_on_position_and_window() -> None:
    torch.manual_seed(0)
    net = QNetwork(2, 3, 3, 3, hidden=(8,))
    w = torch.randn(1, 3, 2)
    a, b = net(w, torch.eye(3)[[0]]), net(w, torch.eye(3)[[2]])
    assert not torch.allclose(a, b)
    assert not torch.allclose(net(w + 1, torch.eye(3)[[0]]), a)


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="hidden"):
        QNetwork(2, 3, 3, 3, hidden=())
    with pytest.raises(ValueError, match="encoder"):
        QNetwork(2, 3, 3, 3, encoder="lstm")  # type: ignore[arg-type]


@pytest.mark.parametrize("dueling", [False, True])
@pytest.mark.parametrize("encoder", ["flat", "conv"])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_forward_positions_equals_one_forward_per_position(dueling: bool, encoder: str, layer_norm: bool) -> None:
    """The shared-encoding path gives each (window, position) exactly what the plain forward gives it."""
    torch.manual_seed(1)
    net = QNetwork(4, 5, 3, 3, hidden=(16, 8), layer_norm=layer_norm, dueling=dueling, encoder=encoder)  # type: ignore[arg-type]
    w = torch.randn(9, 5, 4)
    all_q = net.forward_positions(w)
    assert all_q.shape == (9, 3, 3)
    for p in range(3):
        want = net(w, torch.eye(3)[[p] * 9])
        assert torch.allclose(all_q[:, p], want, atol=1e-5), p
    all_q.sum().backward()
    assert all(param.grad is not None for param in net.parameters())
