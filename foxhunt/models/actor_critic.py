"""The PPO agent's networks and policy distributions: a separate actor and critic over a feature window and the held
position, as in CleanRL's ``ppo.py`` (tanh MLPs, orthogonal initialisation, a small-gain policy head).

Two action spaces:

- ``discrete``: a categorical distribution over the target positions of the market's ``actions``; the actor's head
  gives one logit per action, the deterministic policy is the argmax;
- ``continuous``: a position in [-1, 1] as a *squashed Gaussian*, position = tanh(u) with u ~ N(mean(s), exp(log_std))
  and a state-independent ``log_std`` (CleanRL's ``actor_logstd``). Its log-density carries the change of variables,
  log π(position) = log N(u; mean, std) − log(1 − tanh²(u)) (:func:`squashed_normal_log_prob`); the deterministic
  policy is tanh(mean).
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

ActionSpace = Literal["discrete", "continuous"]
LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def tanh_log_det(u: Tensor) -> Tensor:
    """log(1 − tanh²(u)) = log |d tanh(u) / du|, computed stably: 2·(log 2 − u − softplus(−2u))."""
    return 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))


def normal_log_prob(u: Tensor, mean: Tensor, log_std: Tensor) -> Tensor:
    """log N(u; mean, exp(log_std))."""
    return -0.5 * ((u - mean) * torch.exp(-log_std)) ** 2 - log_std - LOG_SQRT_2PI


def squashed_normal_log_prob(u: Tensor, mean: Tensor, log_std: Tensor) -> Tensor:
    """log-density of the position tanh(u) when u ~ N(mean, exp(log_std)): the Gaussian's, less the log-Jacobian."""
    return normal_log_prob(u, mean, log_std) - tanh_log_det(u)


def squashed_normal_entropy(mean: Tensor, log_std: Tensor, noise: Tensor) -> Tensor:
    """Entropy of tanh(u), u ~ N(mean, std), estimated with one reparameterised sample u = mean + std·noise:
    H(tanh(u)) = H(u) + E[log(1 − tanh²(u))] (no closed form; the Gaussian's entropy alone ignores the squashing)."""
    return 0.5 + LOG_SQRT_2PI + log_std + tanh_log_det(mean + torch.exp(log_std) * noise)


def layer_init(layer: nn.Linear, gain: float = math.sqrt(2.0), bias: float = 0.0) -> nn.Linear:
    """Orthogonal weights with ``gain``, constant biases (CleanRL's ``layer_init``)."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, bias)
    return layer


def tanh_mlp(n_in: int, hidden: tuple[int, ...], n_out: int, head_gain: float) -> nn.Sequential:
    """Linear → tanh per hidden width, then a linear head with orthogonal gain ``head_gain``."""
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise((n_in, *hidden)):
        layers += [layer_init(nn.Linear(a, b)), nn.Tanh()]
    layers.append(layer_init(nn.Linear(hidden[-1], n_out), head_gain))
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Actor and critic MLPs (no shared body, CleanRL's ``Agent``) over the flattened window [B, W·F] and position
    features [B, P].

    ``P`` is the number of actions (a one-hot of the held action) for the discrete policy and 1 (the held position
    value) for the continuous one. The actor's head has gain 0.01 (near-uniform initial policy), the critic's gain 1;
    the continuous policy's ``actor_logstd`` is one state-independent parameter.
    """

    def __init__(
        self,
        n_features: int,
        window: int,
        n_position_features: int,
        n_actions: int,
        action_space: ActionSpace = "discrete",
        hidden: tuple[int, ...] = (64, 64),
        log_std_init: float = 0.0,
    ) -> None:
        super().__init__()
        if not hidden:
            raise ValueError("ActorCritic needs at least one hidden layer")
        if action_space not in ("discrete", "continuous"):
            raise ValueError(f"action_space must be 'discrete' or 'continuous', got {action_space!r}")
        self.window, self.n_features, self.n_position_features = window, n_features, n_position_features
        self.action_space: ActionSpace = action_space
        n_in = window * n_features + n_position_features
        self.actor = tanh_mlp(n_in, hidden, n_actions if action_space == "discrete" else 1, head_gain=0.01)
        self.critic = tanh_mlp(n_in, hidden, 1, head_gain=1.0)
        if action_space == "continuous":
            self.actor_logstd = nn.Parameter(torch.full((1,), float(log_std_init)))

    @property
    def continuous(self) -> bool:
        return self.action_space == "continuous"

    def inputs(self, window: Tensor, position: Tensor, out: Tensor | None = None) -> Tensor:
        """[B, W·F + P]: the window (as [B, W, F] or already flat) and the position features (written into ``out``
        where given, e.g. rows of a rollout's table)."""
        return torch.cat([window.flatten(1) if window.dim() == 3 else window, position], 1, out=out)

    def actor_out(self, x: Tensor) -> Tensor:
        """Logits [B, A] (discrete) or the Gaussian's mean [B] (continuous) of inputs ``x``."""
        out = self.actor(x)
        return out.squeeze(1) if self.continuous else out

    def value(self, x: Tensor) -> Tensor:
        """[B] the critic's state values of inputs ``x``."""
        return self.critic(x).squeeze(1)

    def forward(self, window: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
        """(actor output, value) of a batch of states."""
        x = self.inputs(window, position)
        return self.actor_out(x), self.value(x)

    # -------------------------------------------------------------------------------------- deterministic policy
    def deterministic(self, window: Tensor, position: Tensor) -> Tensor:
        """Logits [B, A] to take the argmax of (discrete), or the position tanh(mean) [B] (continuous)."""
        out = self.actor_out(self.inputs(window, position))
        return torch.tanh(out) if self.continuous else out

    def actor_linears(self) -> list[nn.Linear]:
        """The actor's linear layers, first to head (for the bar-by-bar evaluation)."""
        return [m for m in self.actor if isinstance(m, nn.Linear)]

    def actor_prepare(self, window_flat: Tensor) -> Tensor:
        """[B, H] the actor's first pre-activation without the position's share (for a bar-by-bar evaluation)."""
        first = self.actor_linears()[0]
        return F.linear(window_flat, first.weight[:, : self.window * self.n_features], first.bias)

    @torch.no_grad()
    def deterministic_path(self, prepared: Tensor, decide: Tensor, held: Tensor, no_trade_band: float = 0.0) -> Tensor:
        """[L, S] continuous positions through S bars of L lanes: p_s = tanh(mean(s, p_{s-1})) where ``decide``, else
        flat, from :meth:`actor_prepare`'s rows ``prepared`` [L, S, H] and the positions ``held`` [L] coming in; a
        target within ``no_trade_band`` of p_{s-1} keeps p_{s-1} (the environment's rule, ``apply_no_trade_band``).

        :meth:`deterministic` applied bar by bar in numpy: a recurrence over bars cannot be batched, and per bar the
        work is a few [L, H] products, where a torch call's dispatch costs several times numpy's (about 5 µs a bar
        here against 20-45). Same parameters, float32 on the host; tested equal to :meth:`deterministic`.
        """
        if not self.continuous:
            raise ValueError("deterministic_path is the continuous policy's; the discrete one is a policy table")
        first, *rest = self.actor_linears()
        w_pos = first.weight[:, self.window * self.n_features].detach().cpu().numpy()  # [H]: the held position's column
        layers = [(lin.weight.detach().cpu().numpy().T.copy(), lin.bias.detach().cpu().numpy()) for lin in rest]
        (w_head, b_head), hidden = layers[-1], layers[:-1]
        pre = prepared.detach().float().transpose(0, 1).contiguous().cpu().numpy()  # [S, L, H]: bar-major
        ok = decide.transpose(0, 1).unsqueeze(2).float().cpu().numpy()  # [S, L, 1]
        p = held.detach().float().cpu().numpy().reshape(-1, 1)
        out = np.empty((pre.shape[0], pre.shape[1], 1), dtype=np.float32)
        for j in range(pre.shape[0]):  # in-place numpy: a handful of calls per bar
            h = pre[j] + p * w_pos
            np.tanh(h, out=h)
            for w, b in hidden:
                h = h @ w
                h += b
                np.tanh(h, out=h)
            target = h @ w_head
            target += b_head
            np.tanh(target, out=target)
            if no_trade_band > 0.0:
                np.copyto(target, p, where=np.abs(target - p) < no_trade_band)
            p = target * ok[j]  # flat where no decision is possible
            out[j] = p
        return torch.from_numpy(out[:, :, 0].T.copy()).to(prepared.device)


class ActorInference(ActorCritic):
    """``net``'s deterministic actor for one decision at a time (its inference form; a live session's): the same
    values as :meth:`ActorCritic.deterministic`, bit for bit, as ``cat`` + (``addmm``, in-place ``tanh``) per layer
    (``F.linear`` is ``addmm`` on the transposed weight), without the ``nn.Sequential`` and module lookups that are
    most of a batch-1 call. Views of ``net``'s parameters, not copies (a ``load_state_dict`` into ``net`` reaches it);
    the bar-by-bar continuous path (:meth:`actor_prepare`, :meth:`deterministic_path`) and everything else are
    ``net``'s own. No critic: ``forward`` is refused."""

    def __init__(self, net: ActorCritic) -> None:
        nn.Module.__init__(self)  # no parameters of its own: they are net's
        self.__dict__["net"] = net  # not a submodule: its parameters stay net's alone
        self.window, self.n_features = net.window, net.n_features
        self.n_position_features, self.action_space = net.n_position_features, net.action_space
        self.layers = [(lin.weight.t(), lin.bias) for lin in net.actor_linears()]

    def forward(self, window: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError("ActorInference computes the deterministic policy only (no critic): call the network")

    def deterministic(self, window: Tensor, position: Tensor) -> Tensor:
        x = torch.cat([window.flatten(1) if window.dim() == 3 else window, position], 1)
        *hidden, (w_head, b_head) = self.layers
        for weight_t, bias in hidden:
            x = torch.addmm(bias, x, weight_t).tanh_()
        out = torch.addmm(b_head, x, w_head)
        return out.squeeze(1).tanh_() if self.continuous else out

    def actor_linears(self) -> list[nn.Linear]:
        return self.net.actor_linears()

    def actor_prepare(self, window_flat: Tensor) -> Tensor:
        return self.net.actor_prepare(window_flat)

    def deterministic_path(self, prepared: Tensor, decide: Tensor, held: Tensor, no_trade_band: float = 0.0) -> Tensor:
        return self.net.deterministic_path(prepared, decide, held, no_trade_band)
