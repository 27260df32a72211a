"""PPO's actor inference form (a live session's) is the network's deterministic policy, bit for bit."""

from __future__ import annotations

import pytest
import torch

from foxhunt.models.actor_critic import ActorCritic, ActorInference


@pytest.mark.parametrize("space", ["discrete", "continuous"])
@pytest.mark.parametrize("hidden", [(64, 64), (16,), (32, 16, 8)])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_the_form_is_the_deterministic_policy_bit_for_bit(space: str, hidden: tuple[int, ...], batch: int) -> None:
    """Logits (discrete) or tanh(mean) (continuous) equal ``ActorCritic.deterministic`` exactly, on [B, W, F] and
    flat windows, with and without grad mode."""
    torch.manual_seed(0)
    P = 3 if space == "discrete" else 1
    net = ActorCritic(5, 4, P, 3, space, hidden).eval()  # type: ignore[arg-type]
    form = ActorInference(net)
    window, position = torch.randn(batch, 4, 5), torch.randn(batch, P)
    for w in (window, window.flatten(1)):
        with torch.no_grad():
            want, got = net.deterministic(w, position), form.deterministic(w, position)
        assert got.shape == want.shape and torch.equal(got, want)
        assert torch.equal(form.deterministic(w, position).detach(), want)


def test_it_holds_views_of_the_networks_parameters_and_no_critic() -> None:
    """Weights loaded into the network reach the form; it has no parameters of its own and refuses the critic."""
    torch.manual_seed(0)
    net, other = ActorCritic(5, 4, 3, 3), ActorCritic(5, 4, 3, 3)
    form = ActorInference(net)
    assert list(form.parameters()) == []
    net.load_state_dict(other.state_dict())
    w, p = torch.randn(2, 4, 5), torch.eye(3)[:2]
    with torch.no_grad():
        assert torch.equal(form.deterministic(w, p), other.deterministic(w, p))
    with pytest.raises(NotImplementedError, match="no critic"):
        form(w, p)


def test_the_continuous_bar_by_bar_path_is_the_networks() -> None:
    """``actor_prepare`` and ``deterministic_path`` are the network's own (the continuous recurrence)."""
    torch.manual_seed(0)
    net = ActorCritic(5, 4, 1, 1, "continuous", (8,))
    form = ActorInference(net)
    x = torch.randn(3, 20)
    prepared = form.actor_prepare(x).detach()
    assert torch.equal(prepared, net.actor_prepare(x).detach())
    decide, held = torch.ones(3, 1, dtype=torch.bool), torch.zeros(3)
    assert torch.equal(form.deterministic_path(prepared.unsqueeze(1), decide, held, 0.1),
                       net.deterministic_path(prepared.unsqueeze(1), decide, held, 0.1))
