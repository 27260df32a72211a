"""Which of a member's networks trades, and tensors as the export stores them: what the writer and the loader share."""

from __future__ import annotations

import torch

from foxhunt.lit.member import Agent, Member


def state_tensors(prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's state dict as detached, contiguous CPU copies, under ``prefix``."""
    return {f"{prefix}{k}": v.detach().cpu().contiguous().clone() for k, v in module.state_dict().items()}


def traded_network(member: Member) -> tuple[str, torch.nn.Module | None]:
    """Which of a member's networks trades, and that network: a forecaster's ``network``; an agent's
    ``policy_network`` (``policy_net`` once validation chose weights, else the learning ``network``); ``("flat",
    None)`` when the agent's selection found nothing that beats flat, so it holds no position."""
    if isinstance(member, Agent):
        if member.holds_flat:
            return "flat", None
        net = member.policy_network
        return ("policy_net" if member.policy_net is not None and net is member.policy_net else "network"), net
    return "network", member.network
