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


class GroupedLinear(nn.Module):
    """``groups`` linear layers of one shape as [G, out, in] weights and [G, out] biases: one batched product runs
    them all (the actor's and the critic's layers of equal widths, for the fused loss)."""

    def __init__(self, groups: int, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(groups, n_out))

    def forward(self, x: Tensor) -> Tensor:
        """[G, B, out] from inputs [G, B, in], or [B, in] shared by every group."""
        if x.dim() == 2:
            x = x.expand(self.weight.shape[0], *x.shape)
        return torch.baddbmm(self.bias.unsqueeze(1), x, self.weight.transpose(1, 2))


ACTOR, CRITIC = 0, 1  # the towers' indices in a GroupedLinear


class ActorCritic(nn.Module):
    """Actor and critic MLPs (no shared body) over the flattened window [B, W·F] and position features [B, P].

    ``P`` is the number of actions (a one-hot of the held action) for the discrete policy and 1 (the held position
    value) for the continuous one. The actor's head has gain 0.01 (near-uniform initial policy), the critic's gain 1.

    Layout: the two networks' hidden layers have the same widths, so each hidden layer of both is one
    :class:`GroupedLinear` (``tower.<l>``: weight [2, out, in], tower 0 the actor's, 1 the critic's); the heads differ
    in width and stay apart (``actor_head``, ``critic_head``). The fused loss runs both towers in one batched product
    per layer (8 parameter tensors instead of 12 for the optimizer, the clip and the guard); :meth:`actor_out` and
    :meth:`value` run each network on its own slices, as two plain MLPs. Initial values are exactly those of two
    ``tanh_mlp``s built actor first (:meth:`two_mlps` gives them back); state dicts of the former two-MLP layout
    (``actor.<i>``, ``critic.<i>``) load through :func:`grouped_state_dict`.
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
        n_out = n_actions if action_space == "discrete" else 1
        # built as two tanh MLPs (the RNG draws, hence the initial values, of the plain layout), then grouped
        actor = tanh_mlp(n_in, hidden, n_out, head_gain=0.01)
        critic = tanh_mlp(n_in, hidden, 1, head_gain=1.0)
        self.tower = nn.ModuleList(GroupedLinear(2, a, b) for a, b in itertools.pairwise((n_in, *hidden)))
        self.actor_head = nn.Linear(hidden[-1], n_out)
        self.critic_head = nn.Linear(hidden[-1], 1)
        self.load_state_dict(grouped_state_dict({**{f"actor.{k}": v for k, v in actor.state_dict().items()},
                                                 **{f"critic.{k}": v for k, v in critic.state_dict().items()}}),
                             strict=False)
        if action_space == "continuous":
            self.actor_logstd = nn.Parameter(torch.full((1,), float(log_std_init)))
        self.register_load_state_dict_pre_hook(_load_two_mlp_layout)

    @property
    def continuous(self) -> bool:
        return self.action_space == "continuous"

    def inputs(self, window: Tensor, position: Tensor) -> Tensor:
        """[B, W·F + P]: the window (as [B, W, F] or already flat) and the position features."""
        return torch.cat([window.flatten(1) if window.dim() == 3 else window, position], 1)

    def actor_out(self, x: Tensor) -> Tensor:
        """Logits [B, A] (discrete) or the Gaussian's mean [B] (continuous) of inputs ``x``."""
        out = _head(self.actor_head, self._hidden(x, ACTOR))
        return out.squeeze(1) if self.continuous else out

    def value(self, x: Tensor) -> Tensor:
        """[B] the critic's state values of inputs ``x``."""
        return _head(self.critic_head, self._hidden(x, CRITIC)).squeeze(1)

    def forward(self, window: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
        """(actor output, value) of a batch of states."""
        x = self.inputs(window, position)
        return self.actor_out(x), self.value(x)

    def _hidden(self, x: Tensor, tower: int, start: int = 0) -> Tensor:
        """The last hidden activation of one network (``tower``: ACTOR or CRITIC) from hidden layer ``start`` on, on
        its own slices of the grouped weights (a plain MLP; per-module calls cost as much as a small network's
        arithmetic on CPU)."""
        for layer in list(self.tower)[start:]:
            x = torch.tanh(F.linear(x, layer.weight[tower], layer.bias[tower]))
        return x

    def two_mlps(self) -> tuple[nn.Sequential, nn.Sequential]:
        """Copies of the actor and the critic as the plain layout's ``tanh_mlp``s (for references and tests)."""
        nets = []
        for tower, head in ((ACTOR, self.actor_head), (CRITIC, self.critic_head)):
            layers: list[nn.Module] = []
            for layer in self.tower:
                lin = nn.Linear(layer.weight.shape[2], layer.weight.shape[1])
                lin.weight.data.copy_(layer.weight.data[tower])
                lin.bias.data.copy_(layer.bias.data[tower])
                layers += [lin, nn.Tanh()]
            out = nn.Linear(head.in_features, head.out_features)
            out.load_state_dict(head.state_dict())
            nets.append(nn.Sequential(*layers, out))
        return nets[0], nets[1]

    # -------------------------------------------------------------------------------------- deterministic policy
    def deterministic(self, window: Tensor, position: Tensor) -> Tensor:
        """Logits [B, A] to take the argmax of (discrete), or the position tanh(mean) [B] (continuous)."""
        out = self.actor_out(self.inputs(window, position))
        return torch.tanh(out) if self.continuous else out

    def actor_prepare(self, window_flat: Tensor) -> Tensor:
        """[B, H] the actor's first pre-activation without the position's share (for a bar-by-bar evaluation)."""
        first = self.tower[0]
        n = self.window * self.n_features
        return F.linear(window_flat, first.weight[ACTOR, :, :n], first.bias[ACTOR])

    def actor_step(self, prepared: Tensor, position: Tensor) -> Tensor:
        """The deterministic position tanh(mean) [L] from :meth:`actor_prepare`'s rows and held positions [L, P]."""
        first = self.tower[0]
        x = torch.tanh(prepared + F.linear(position, first.weight[ACTOR, :, self.window * self.n_features :]))
        return torch.tanh(_head(self.actor_head, self._hidden(x, ACTOR, start=1)).squeeze(1))

    @torch.no_grad()
    def deterministic_path(self, prepared: Tensor, decide: Tensor, held: Tensor, no_trade_band: float = 0.0) -> Tensor:
        """[L, S] continuous positions through S bars of L lanes: p_s = tanh(mean(s, p_{s-1})) where ``decide``, else
        flat, from :meth:`actor_prepare`'s rows ``prepared`` [L, S, H] and the positions ``held`` [L] coming in; a
        target within ``no_trade_band`` of p_{s-1} keeps p_{s-1} (the environment's rule, ``apply_no_trade_band``).

        The fast path of :meth:`actor_step` applied bar by bar: a recurrence over bars cannot be batched, and per bar
        the work is a few [L, H] products, where a torch call's dispatch costs several times numpy's (about 5 µs a
        bar here against 20-45). Same parameters, float32 on the host; tested equal to :meth:`deterministic`.
        """
        if not self.continuous:
            raise ValueError("deterministic_path is the continuous policy's; the discrete one is a policy table")
        first = self.tower[0]
        n = self.window * self.n_features
        w_pos = first.weight[ACTOR, :, n].detach().cpu().numpy()  # [H]: the held position's column
        layers = [(w[ACTOR].detach().cpu().numpy().T.copy(), b[ACTOR].detach().cpu().numpy())
                  for w, b in ((m.weight, m.bias) for m in list(self.tower)[1:])]
        head = self.actor_head
        layers.append((head.weight.detach().cpu().numpy().T.copy(), head.bias.detach().cpu().numpy()))
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


def _head(head: nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x, head.weight, head.bias)


def grouped_state_dict(state: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """The state of the former two-MLP layout (``actor.<2l>``/``critic.<2l>`` hidden layers, the last index each
    network's head) in :class:`ActorCritic`'s grouped layout; other keys pass through. Values are copied exactly."""
    out = {k: v for k, v in state.items() if not k.startswith((f"{prefix}actor.", f"{prefix}critic."))}
    linears = sorted({int(k[len(prefix) + 6 :].split(".")[0]) for k in state if k.startswith(f"{prefix}actor.")})
    if not linears:
        return dict(state)
    *hidden, head = linears
    for i, idx in enumerate(hidden):
        for kind in ("weight", "bias"):
            out[f"{prefix}tower.{i}.{kind}"] = torch.stack([state[f"{prefix}actor.{idx}.{kind}"],
                                                            state[f"{prefix}critic.{idx}.{kind}"]])
    for kind in ("weight", "bias"):
        out[f"{prefix}actor_head.{kind}"] = state[f"{prefix}actor.{head}.{kind}"]
        out[f"{prefix}critic_head.{kind}"] = state[f"{prefix}critic.{head}.{kind}"]
    return out


def _load_two_mlp_layout(module: nn.Module, state: dict[str, Tensor], prefix: str, *_: object) -> None:
    """load_state_dict pre-hook: checkpoints of the two-MLP layout load into the grouped one."""
    if any(k.startswith(f"{prefix}actor.") for k in state):
        converted = grouped_state_dict(state, prefix)
        state.clear()
        state.update(converted)
