"""The Q-network's inference form is its eval forward, bit for bit, and follows weights loaded into the network."""

from __future__ import annotations

import pytest
import torch

from foxhunt.models.qnet import QNetwork
from foxhunt.models.qnet_inference import QNetworkInference, q_inference


@pytest.mark.parametrize("kw", [{}, {"dueling": True}, {"layer_norm": False}, {"hidden": (16,)}])
@pytest.mark.parametrize("b", [1, 9])
def test_inference_form_is_the_eval_forward_bit_for_bit(kw: dict, b: int) -> None:
    torch.manual_seed(0)
    net = QNetwork(5, 4, 3, 3, dropout=0.2, **{"hidden": (32, 16), **kw}).eval()
    form = q_inference(net)
    assert isinstance(form, QNetworkInference)
    window, position = torch.randn(b, 4, 5), torch.eye(3)[torch.arange(b) % 3]
    with torch.no_grad():
        assert torch.equal(form(window, position), net(window, position))
        assert torch.equal(form(window.flatten(1), position), net(window, position))


def test_inference_form_reads_the_networks_parameters_and_other_networks_pass_through() -> None:
    torch.manual_seed(1)
    net, other = QNetwork(5, 4, 3, 3).eval(), QNetwork(5, 4, 3, 3).eval()
    form = q_inference(net)
    window, position = torch.randn(2, 4, 5), torch.eye(3)[:2]
    with torch.no_grad():
        net.load_state_dict(other.state_dict())
        assert torch.equal(form(window, position), other(window, position))
    conv = QNetwork(5, 4, 3, 3, encoder="conv")
    assert q_inference(conv) is conv
    with pytest.raises(ValueError, match="flat encoder"):
        QNetworkInference(conv)
