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
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

ActionSpace = Literal["discrete", "continuous"]
InplaceTanh = Callable[[Tensor], Tensor]  # x -> tanh(x), written into x
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


ACTOR, CRITIC = 0, 1  # the towers' indices in a grouped [2, out, in] weight


class ActorCritic(nn.Module):
    """Actor and critic MLPs (no shared body) over the flattened window [B, W·F] and position features [B, P].

    ``P`` is the number of actions (a one-hot of the held action) for the discrete policy and 1 (the held position
    value) for the continuous one. The actor's head has gain 0.01 (near-uniform initial policy), the critic's gain 1.

    Layout. The two networks' hidden layers have the same widths, so each hidden layer of both is one grouped tensor
    (``tower.<l>.weight`` [2, out, in], ``tower.<l>.bias`` [2, out]; index 0 the actor's, 1 the critic's); the heads
    differ in width and stay apart (``actor_head.*``, ``critic_head.*``, and ``actor_logstd``). These named tensors are
    the state dict (checkpoints, exports) and are views (:meth:`tensor`) into two flat parameters, ``weights`` (the
    matrices) and ``biases`` (biases and the log standard deviation), which are all the optimizer, the gradient clip
    and the guard see: at a minibatch of 64 rows their per-tensor Python (AdamW's, autograd's gradient accumulation)
    costs as much as the arithmetic. The fused loss runs both towers in one batched product per layer and returns
    the two flat gradients; :meth:`actor_out` and :meth:`value` run each network on its own slices, as two plain MLPs
    through autograd. Initial values are exactly those of two ``tanh_mlp``s built actor first (:meth:`two_mlps` gives
    them back); state dicts of the former two-MLP layout (``actor.<i>``, ``critic.<i>``) load as well.
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
        self.n_hidden = len(hidden)
        n_in = window * n_features + n_position_features
        n_out = n_actions if action_space == "discrete" else 1
        # built as two tanh MLPs (the RNG draws, hence the initial values, of the plain layout), then grouped
        actor = tanh_mlp(n_in, hidden, n_out, head_gain=0.01)
        critic = tanh_mlp(n_in, hidden, 1, head_gain=1.0)
        state = grouped_state_dict({**{f"actor.{k}": v for k, v in actor.state_dict().items()},
                                    **{f"critic.{k}": v for k, v in critic.state_dict().items()}})
        if action_space == "continuous":
            state["actor_logstd"] = torch.full((1,), float(log_std_init))
        names = self.tensor_names()
        self.layout: dict[str, tuple[int, int, int, tuple[int, ...]]] = {}  # name -> (flat, start, end, shape)
        flats: list[list[Tensor]] = [[], []]
        for flat, group in enumerate(names):
            start = 0
            for name in group:
                t = state[name].detach()
                self.layout[name] = (flat, start, start + t.numel(), tuple(t.shape))
                flats[flat].append(t.reshape(-1))
                start += t.numel()
        self.weights = nn.Parameter(torch.cat(flats[0]))
        self.biases = nn.Parameter(torch.cat(flats[1]))
        self._views: tuple[tuple[int, int], tuple[Tensor, ...]] | None = None

    @staticmethod
    def upgrade_state_dict(state: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
        """``state`` with this network's tensors of the former two-MLP layout (``actor.*``/``critic.*``, exports
        written before the grouped towers) under their current names (``foxhunt.load`` checks names before loading)."""
        return grouped_state_dict(state, prefix)

    def tensor_names(self) -> tuple[list[str], list[str]]:
        """The named tensors in ``weights`` and in ``biases``, in order: the hidden layers', then the heads'."""
        layers = range(self.n_hidden)
        weights = [f"tower.{i}.weight" for i in layers] + ["actor_head.weight", "critic_head.weight"]
        biases = [f"tower.{i}.bias" for i in layers] + ["actor_head.bias", "critic_head.bias"]
        return weights, biases + (["actor_logstd"] if self.continuous else [])

    def tensor(self, name: str) -> Tensor:
        """The named tensor as a view of its flat parameter (gradients reach the parameter through autograd)."""
        flat, start, end, shape = self.layout[name]
        return (self.weights if flat == 0 else self.biases)[start:end].view(shape)

    def detached_tensors(self) -> tuple[Tensor, ...]:
        """Every named tensor as a detached view (``tower.<l>`` weight and bias per layer, the actor head's weight and
        bias, the critic head's, ``actor_logstd``), made once per storage: optimizer steps update them in place."""
        key = (self.weights.data_ptr(), self.biases.data_ptr())
        if self._views is None or self._views[0] != key:
            w, b = self.tensor_names()
            names = [n for i in range(self.n_hidden) for n in (w[i], b[i])]
            names += ["actor_head.weight", "actor_head.bias", "critic_head.weight", "critic_head.bias"]
            names += ["actor_logstd"] if self.continuous else []
            with torch.no_grad():
                self._views = (key, tuple(self.tensor(n).detach() for n in names))
        return self._views[1]

    @property
    def actor_logstd(self) -> Tensor:
        """[1] the continuous policy's state-independent log standard deviation (a view of ``biases``)."""
        return self.tensor("actor_logstd")

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """The named tensors (copies, so that exports hold no shared storage), not the flat parameters."""
        for name in self.layout:
            t = self.tensor(name)
            destination[prefix + name] = t if keep_vars else t.detach().clone()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """Copy the named tensors (or those of the former two-MLP layout) into the flat parameters."""
        own = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
        if any(k.startswith(f"{prefix}actor.") for k in own):
            own = grouped_state_dict(own, prefix)
        for name, (_, _, _, shape) in self.layout.items():
            key = prefix + name
            if key not in own:
                missing_keys.append(key)
            elif tuple(own[key].shape) != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(own[key].shape)}, "
                                  f"the model has {shape}")
            else:
                with torch.no_grad():
                    self.tensor(name).copy_(own[key])
        if strict:
            unexpected_keys.extend(k for k in own if k[len(prefix):] not in self.layout)

    @property
    def continuous(self) -> bool:
        return self.action_space == "continuous"

    def inputs(self, window: Tensor, position: Tensor, out: Tensor | None = None) -> Tensor:
        """[B, W·F + P]: the window (as [B, W, F] or already flat) and the position features (written into ``out``
        where given, e.g. rows of a rollout's table)."""
        return torch.cat([window.flatten(1) if window.dim() == 3 else window, position], 1, out=out)

    def actor_out(self, x: Tensor, tanh_: InplaceTanh | None = None) -> Tensor:
        """Logits [B, A] (discrete) or the Gaussian's mean [B] (continuous) of inputs ``x`` (``tanh_``: see
        :meth:`_hidden`)."""
        out = self._head(self._hidden(x, ACTOR, tanh_=tanh_), "actor")
        return out.squeeze(1) if self.continuous else out

    def value(self, x: Tensor, tanh_: InplaceTanh | None = None) -> Tensor:
        """[B] the critic's state values of inputs ``x`` (``tanh_``: see :meth:`_hidden`)."""
        return self._head(self._hidden(x, CRITIC, tanh_=tanh_), "critic").squeeze(1)

    def forward(self, window: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
        """(actor output, value) of a batch of states."""
        x = self.inputs(window, position)
        return self.actor_out(x), self.value(x)

    def _hidden(self, x: Tensor, tower: int, start: int = 0, tanh_: InplaceTanh | None = None) -> Tensor:
        """The last hidden activation of one network (``tower``: ACTOR or CRITIC) from hidden layer ``start`` on, on
        its own slices of the grouped weights (a plain MLP through autograd).

        ``tanh_``: an in-place tanh for inference (e.g. the compiled loop of
        :func:`foxhunt.models.ppo_loss_native.tanh_`, for rollouts), used only where autograd is off; None, or with
        autograd on: ``torch.tanh``, the reference.
        """
        fast = tanh_ is not None and not torch.is_grad_enabled()
        for i in range(start, self.n_hidden):
            a = F.linear(x, self.tensor(f"tower.{i}.weight")[tower], self.tensor(f"tower.{i}.bias")[tower])
            x = tanh_(a) if fast else torch.tanh(a)  # type: ignore[misc]
        return x

    def _head(self, x: Tensor, which: str) -> Tensor:
        return F.linear(x, self.tensor(f"{which}_head.weight"), self.tensor(f"{which}_head.bias"))

    def two_mlps(self) -> tuple[nn.Sequential, nn.Sequential]:
        """Copies of the actor and the critic as the plain layout's ``tanh_mlp``s (for references and tests)."""
        nets = []
        with torch.no_grad():
            for tower, which in ((ACTOR, "actor"), (CRITIC, "critic")):
                layers: list[nn.Module] = []
                for i in range(self.n_hidden):
                    w, b = self.tensor(f"tower.{i}.weight")[tower], self.tensor(f"tower.{i}.bias")[tower]
                    lin = nn.Linear(w.shape[1], w.shape[0])
                    lin.weight.copy_(w)
                    lin.bias.copy_(b)
                    layers += [lin, nn.Tanh()]
                w, b = self.tensor(f"{which}_head.weight"), self.tensor(f"{which}_head.bias")
                head = nn.Linear(w.shape[1], w.shape[0])
                head.weight.copy_(w)
                head.bias.copy_(b)
                nets.append(nn.Sequential(*layers, head))
        return nets[0], nets[1]

    # -------------------------------------------------------------------------------------- deterministic policy
    def deterministic(self, window: Tensor, position: Tensor) -> Tensor:
        """Logits [B, A] to take the argmax of (discrete), or the position tanh(mean) [B] (continuous)."""
        out = self.actor_out(self.inputs(window, position))
        return torch.tanh(out) if self.continuous else out

    def actor_prepare(self, window_flat: Tensor) -> Tensor:
        """[B, H] the actor's first pre-activation without the position's share (for a bar-by-bar evaluation)."""
        n = self.window * self.n_features
        return F.linear(window_flat, self.tensor("tower.0.weight")[ACTOR, :, :n], self.tensor("tower.0.bias")[ACTOR])

    def actor_step(self, prepared: Tensor, position: Tensor) -> Tensor:
        """The deterministic position tanh(mean) [L] from :meth:`actor_prepare`'s rows and held positions [L, P]."""
        first = self.tensor("tower.0.weight")[ACTOR]
        x = torch.tanh(prepared + F.linear(position, first[:, self.window * self.n_features :]))
        return torch.tanh(self._head(self._hidden(x, ACTOR, start=1), "actor").squeeze(1))

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
        n = self.window * self.n_features
        w_pos = self.tensor("tower.0.weight")[ACTOR, :, n].detach().cpu().numpy()  # [H]: the held position's column
        layers = [(self.tensor(f"tower.{i}.weight")[ACTOR].detach().cpu().numpy().T.copy(),
                   self.tensor(f"tower.{i}.bias")[ACTOR].detach().cpu().numpy()) for i in range(1, self.n_hidden)]
        layers.append((self.tensor("actor_head.weight").detach().cpu().numpy().T.copy(),
                       self.tensor("actor_head.bias").detach().cpu().numpy()))
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
