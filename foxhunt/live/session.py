"""A live session: an export trading bars as they arrive, one timestamp at a time, with the back-test's own decisions.

Per symbol it holds the streaming features' state, the last bars' normalised feature rows (as many as a member's window,
the target statistics and stacking need: a bounded tail, never the history), every member's held position and the
bars seen. At each bar it builds the tail as a :class:`~foxhunt.data.market.MarketSplit` (the next bars' known-future
calendar rows scheduled ahead, as the back-test reads them from the file), asks every member for one row of its policy
table (:meth:`~foxhunt.lit.member.Agent.decision_table`, :meth:`~foxhunt.lit.ensemble.EnsembleModule.forecast_table`)
and applies it to the position it holds: the very code that rolls the back-test out, one bar at a time.

That is the plain path (``fast=False``). The default, ``fast=True``, runs the networks' inference forms
(:mod:`foxhunt.models.tft_inference`, :mod:`foxhunt.models.qnet_inference`) and, once a symbol's tail is full, decides
TFT and DQN members from the tail buffers directly (:meth:`LiveSession._decide_lean`), without the split: the same
decisions (tests/test_live.py), a fraction of the small tensor calls, whatever the networks run on (torch, or the
ONNX Runtime sessions of :mod:`foxhunt.live.backend`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from foxhunt.data.datamodule import assemble_split
from foxhunt.evaluation.policies import FORECAST_ACTIONS, FORECAST_FLAT
from foxhunt.export.load import LoadedEnsemble
from foxhunt.export.metadata import sha256_hex
from foxhunt.export.symbols import export_symbol_codes
from foxhunt.features.calendar import calendar_values, phases
from foxhunt.lit.member import eval_mode
from foxhunt.live.state import StateError, load_state, save_state
from foxhunt.preprocessing import OutlierClip, RollingZScore, next_log_returns

Schedule = Callable[[Tensor, Tensor, int], Tensor]  # (symbol codes [P], timestamps [P], H) -> next timestamps [P, H]


@dataclass
class Decision:
    """What the session decided at one timestamp, for the symbols that had a bar there."""

    timestamp: int  # ns UTC, the bars' time
    symbols: list[str]
    bars: Tensor  # [P, 5] float64 OHLCV
    positions: dict[str, Tensor]  # member names and "ensemble" -> [P] float32, held from this close to the next
    ready: Tensor  # [P] bool: a decision bar (features and target statistics defined), as the back-test counts them
    latency_us: float  # bar in to decision out


def model_horizon_quantiles(model: Any, name: str) -> int:
    """How many stacked columns forecaster ``name`` gives the agents: its horizon times its quantiles."""
    member = model.forecaster(name)
    return int(member.horizon) * len(member.quantiles)


def regular_schedule(spacing_ns: Tensor) -> Schedule:
    """The next bars' timestamps at each symbol's regular spacing (what a live feed without a calendar can know)."""

    def schedule(codes: Tensor, ts: Tensor, horizon: int) -> Tensor:
        steps = torch.arange(1, horizon + 1, dtype=torch.int64)
        return ts[:, None] + spacing_ns[codes][:, None] * steps

    return schedule


def bound_graph_applies(net: Any) -> bool:
    """Whether ``net`` is an ONNX Runtime Q-network (:class:`foxhunt.live.backend.OrtQNetwork`) that
    :class:`BoundQGraph` can run (the backend module is loaded wherever such a network exists)."""
    backend = sys.modules.get("foxhunt.live.backend")
    return backend is not None and isinstance(net, backend.OrtQNetwork)


class BoundQGraph:
    """An ONNX Runtime Q-network run on buffers bound once (``InferenceSession.io_binding``) for ``rows`` states: the
    windows written into the bound input, the position rows fixed, the Q-values read from the bound output. The same
    graph on the same inputs as ``OrtQNetwork.forward`` (tests/test_live.py: the same decisions), without its per-call
    array conversions, feed dictionary and module call (a batch-1 decision ~20 -> ~11 µs)."""

    def __init__(self, net: Any, rows: int, position: Tensor) -> None:
        import numpy as np
        from onnxruntime import OrtValue

        self.net, self.rows = net, rows
        session = net.session
        window = np.zeros((rows, net.window, net.n_features), dtype=np.float32)
        q = np.zeros((rows, position.shape[1]), dtype=np.float32)  # Q [B, A]: one value per action
        self.window, self.q = torch.from_numpy(window), torch.from_numpy(q)  # views of the bound buffers
        A = position.shape[1]  # held positions per window: rows = P * A
        self._windows = self.window.view(rows // A, A, net.window, net.n_features)
        self._keep = (window, np.ascontiguousarray(position.numpy(), dtype=np.float32), q)
        self.binding = session.io_binding()
        self.binding.bind_ortvalue_input("window", OrtValue.ortvalue_from_numpy(window))
        self.binding.bind_ortvalue_input("position", OrtValue.ortvalue_from_numpy(self._keep[1]))
        self.binding.bind_ortvalue_output(session.get_outputs()[0].name, OrtValue.ortvalue_from_numpy(q))
        self.session = session

    def __call__(self, obs: Tensor) -> Tensor:
        """[rows, A] Q-values of the windows ``obs`` [P, W, F], each repeated for every position (``greedy_table``'s
        batch: row p·A + a is window p with position a): the bound output itself, valid until the next call."""
        self._windows.copy_(obs.unsqueeze(1))
        self.session.run_with_iobinding(self.binding)
        return self.q


class LiveSession:
    """An exported ensemble trading bars as they arrive (see the module docstring); build it with :func:`open`."""

    def __init__(self, loaded: LoadedEnsemble, features: Any | None = None, fast: bool = True,
                 compile_features: bool = False, compile_networks: bool = False) -> None:
        self.loaded = loaded
        # the networks' inference forms (the TFT's, built once from its frozen weights; the Q-network's direct calls)
        # or, False, the networks' own forwards: the same decisions (tests/test_live.py), several times slower
        self.fast = bool(fast)
        self._agent_nets: dict[str, tuple[Any, Any]] = {}
        self._bound: dict[tuple[str, int], BoundQGraph] = {}  # per agent and rows: its ORT Q-network's IO binding
        self.model = loaded.model
        meta = loaded.metadata
        self.symbols = list(loaded.symbols)
        self.feature_names = list(loaded.feature_names)
        spec = meta["spec"]
        self.lookback, self.horizon = int(spec["lookback"]), int(spec["horizon"])
        self.known_future = list(spec["known_future"])
        self.clip = float(meta["data"]["feature_clip"])
        S, F = len(self.symbols), len(self.feature_names)
        if features is None:
            from foxhunt.features.stream import FeatureStream

            # compile_features: FeatureStream's compiled steady bars (torch.compile at construction, equal to eager)
            features = FeatureStream(self.feature_names, S, compile=compile_features)
        self.features = features
        self.tail = self._tail_length()
        K = self.tail
        self.rows = torch.zeros(S, K, F, dtype=torch.float32)  # normalised feature rows, the latest last
        self.ready_rows = torch.zeros(S, K, dtype=torch.bool)
        self.ohlcv = torch.ones(S, K, 5, dtype=torch.float64)
        self.ts = torch.zeros(S, K, dtype=torch.int64)
        self.seen = torch.zeros(S, dtype=torch.int64)  # bars seen per symbol
        self.held: dict[str, Tensor] = {}  # per member: the policy's held action index (discrete) or position
        for name in self.model.member_names:
            continuous = name in self.model.agent_names and self._continuous(name)
            self.held[name] = torch.zeros(S, dtype=torch.float32) if continuous else self._flat_index(name).repeat(S)
        self.spacing = torch.zeros(S, dtype=torch.int64)  # the latest bar spacing per symbol (regular schedule)
        stacked = sum(model_horizon_quantiles(self.model, n) for n in self.model.forecaster_names)
        self.stack = torch.zeros(S, K, stacked if self.model.hparams.combine == "stack" else 0)  # agents' forecast rows
        self._lean = self._lean_plan()  # the lean decision's constants, or None where it does not apply
        self._served_in_eval()
        self._agent_const: dict[str, tuple[int, Tensor, int, Tensor]] = {}
        self._future_index: dict[int, int] = {}  # scheduled timestamp -> its row of known-future inputs
        self._future_table = torch.zeros(0, len(self.known_future))
        self._codes: dict[tuple[str, ...], Tensor] = {}
        self._cached_nets: list[Any] | None = None
        if compile_networks:
            self._compile_networks()

    # ------------------------------------------------------------------------------------------------ structure
    def _served_in_eval(self) -> None:
        """Served networks (:mod:`foxhunt.live.backend`: modules without parameters around an ONNX Runtime session)
        come in train mode, so ``eval_mode`` would walk them into eval and back twice a bar; the mode changes nothing
        they compute (the graph is the eval forward), so they are put in eval once."""
        from foxhunt.export.traded import traded_network

        for name in self.model.member_names:
            _, net = traded_network(self.model.member(name))
            if net is not None and net.training and next(net.parameters(), None) is None:
                net.eval()

    def _tail_length(self) -> int:
        """Bars of history a decision reads: the forecasters' lookback (over every stacked agent's window), the
        agents' windows and the target statistics' windows, with margin."""
        agents = [int(self.model.agent(n).hparams.window) for n in self.model.agent_names]
        window = max(agents, default=1)
        stack = self.model.hparams.combine == "stack"
        need = self.lookback + (window if stack else 0) + window
        t = self.loaded.target_transform
        for part in (t.scaler, t.clip):
            if isinstance(part, RollingZScore):
                need += part.window + part.lag
            elif isinstance(part, OutlierClip) and getattr(part, "window", None):
                need += int(part.window) + 1
        return need + 2

    def _continuous(self, name: str) -> bool:
        return bool(getattr(self.model.agent(name), "continuous", False))

    def _flat_index(self, name: str) -> Tensor:
        if name in self.model.forecaster_names:
            return torch.tensor([FORECAST_FLAT])
        actions = list(self.model.agent(name).hparams.actions)
        return torch.tensor([min(range(len(actions)), key=lambda i: abs(actions[i]))])

    def codes(self, symbols: Sequence[str]) -> Tensor:
        """The export's codes of these symbols, by name (a symbol the model never saw: one line, see
        :mod:`foxhunt.export.symbols`; a live session refuses it even for agents, since it holds state per code);
        kept per symbol list (a feed repeats its few), never changed by the callers."""
        key = tuple(symbols)
        codes = self._codes.get(key)
        if codes is None:
            codes = export_symbol_codes(list(symbols), self.symbols, self.model.member_names, where="live bars")
            if len(self._codes) >= 256:  # a feed whose symbol sets keep changing: a bounded cache
                self._codes.clear()
            self._codes[key] = codes
        return codes

    def history(self, symbol: str) -> tuple[Tensor, Tensor]:
        """The latest accepted bars of a symbol this session holds: timestamps [n] and OHLCV [n, 5] (n <= its tail)."""
        if symbol not in self.symbols:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, 5, dtype=torch.float64)
        c = self.symbols.index(symbol)
        n = int(min(int(self.seen[c]), self.tail))
        return self.ts[c, self.tail - n :], self.ohlcv[c, self.tail - n :]

    # ------------------------------------------------------------------------------------------------ stepping
    @torch.no_grad()
    def on_bar(self, symbols: Sequence[str], ohlcv: Tensor, timestamp: int,
               next_timestamps: Tensor | None = None) -> Decision:
        """Take the bars of ``symbols`` at ``timestamp`` (ohlcv [P, 5]) and decide every member's position for each.

        ``next_timestamps`` [P, H]: when the next H bars of each symbol will be (the known-future inputs' times; a
        replay knows them from its file, as the back-test does); None: each symbol's last spacing, repeated."""
        start = time.perf_counter_ns()
        values, ready = self.feature_step(symbols, ohlcv, timestamp)
        return self.decide_on(symbols, ohlcv, timestamp, values, ready, next_timestamps, started_ns=start)

    @torch.no_grad()
    def feature_step(self, symbols: Sequence[str], ohlcv: Tensor, timestamp: int) -> tuple[Tensor, Tensor]:
        """Step this session's feature state by the bars of ``symbols``: their raw feature values [P, F] and whether
        each is defined [P] (another session with the same feature names and symbols can decide on them too)."""
        codes = self.codes(symbols)
        P = codes.numel()
        bars = torch.as_tensor(ohlcv, dtype=torch.float64).reshape(P, 5)
        S = len(self.symbols)
        full_ohlcv = torch.ones(S, 1, 5, dtype=torch.float64)
        full_ts = torch.zeros(S, 1, dtype=torch.int64)
        present = torch.zeros(S, 1, dtype=torch.bool)
        full_ohlcv[codes, 0], full_ts[codes, 0], present[codes, 0] = bars, int(timestamp), True
        values, ready = self.features.update(full_ohlcv, full_ts, present)
        return values[codes, 0], ready[codes, 0]

    @torch.no_grad()
    def decide_on(self, symbols: Sequence[str], ohlcv: Tensor, timestamp: int, values: Tensor, ready: Tensor,
                  next_timestamps: Tensor | None = None, started_ns: int | None = None) -> Decision:
        """Decide at ``timestamp`` from the raw feature values [P, F] and readiness [P] of :meth:`feature_step`
        (this session's, or a session's with the same feature set); the tails and held positions move on."""
        start = time.perf_counter_ns() if started_ns is None else started_ns
        codes = self.codes(symbols)
        P = codes.numel()
        # every symbol in the export's order (one symbol, or a panel's whole timestamp): its rows are slices (views)
        sel: Tensor | slice = slice(None) if P == len(self.symbols) and list(symbols) == self.symbols else codes
        bars = torch.as_tensor(ohlcv, dtype=torch.float64).reshape(P, 5)
        ts = torch.full((P,), int(timestamp), dtype=torch.int64)
        rows = self.loaded.feature_normalizer(values).clamp(-self.clip, self.clip)
        seen = self.seen[sel]
        self.spacing[sel] = torch.where(seen > 0, ts - self.ts[sel, -1], self.spacing[sel])
        self._push(sel, rows, ready, bars, ts)
        if next_timestamps is None:
            next_timestamps = regular_schedule(self.spacing.clamp_min(1))(codes, ts, self.horizon)
        next_ts = torch.as_tensor(next_timestamps, dtype=torch.int64).reshape(P, -1)
        positions, decided = self._decide(codes, next_ts, sel)
        latency = (time.perf_counter_ns() - start) / 1e3
        return Decision(int(timestamp), list(symbols), bars, positions, decided, latency)

    def _push(self, sel: Tensor | slice, rows: Tensor, ready: Tensor, bars: Tensor, ts: Tensor) -> None:
        """Append one bar to each of these symbols' tails (the oldest row drops out); ``sel``: their codes, or every
        symbol (a slice: each buffer is replaced by its shifted self in one op)."""
        zero = torch.zeros(rows.shape[0], self.stack.shape[-1])
        for key, new in (("rows", rows.float()), ("ready_rows", ready), ("ohlcv", bars), ("ts", ts), ("stack", zero)):
            buf = getattr(self, key)
            new = new.unsqueeze(1).to(buf.dtype)
            if isinstance(sel, slice):
                setattr(self, key, torch.cat((buf[:, 1:], new), 1))
            else:
                buf[sel] = torch.cat((buf[sel, 1:], new), 1)
        self.seen[sel] += 1

    def _tail_split(self, codes: Tensor, next_ts: Tensor) -> tuple[Any, Tensor, Tensor]:
        """The tails of these symbols as one MarketSplit (each symbol's rows, then H rows scheduled ahead that carry
        only the known-future calendar inputs), each symbol's row of the bar just in, and the mask [P, K + H] of the
        tail slots the split holds (:meth:`_tail_rows` lays other per-symbol buffers out the same way)."""
        H, K, P = max(self.horizon, 1), self.tail, codes.numel()
        n = torch.clamp(self.seen[codes], max=K)
        keep = torch.cat((torch.arange(K) >= K - n[:, None], torch.ones(P, H, dtype=torch.bool)), 1)  # filled slots

        def laid_out(tail: Tensor, ahead: Tensor) -> Tensor:  # [P, K, ...] and [P, H, ...] -> the split's rows
            return torch.cat((tail, ahead), 1)[keep]

        o = self.ohlcv[codes]
        ohlcv = laid_out(o, o[:, -1:].expand(P, H, 5))  # the scheduled rows repeat the last close: its return reads 0
        sym = laid_out(codes[:, None].expand(P, K), codes[:, None].expand(P, H))
        features = laid_out(self.rows[codes], self._future_rows(next_ts[:, :H]))
        ready = laid_out(self.ready_rows[codes], torch.zeros(P, H, dtype=torch.bool))
        ts = laid_out(self.ts[codes], next_ts[:, :H])
        returns = next_log_returns(ohlcv[:, 3], segment=sym)
        split = assemble_split("live", self.symbols, ts, sym, ohlcv, features, ready, returns, self.feature_names,
                               self.loaded.target_transform)
        last = torch.cumsum(n + H, 0) - H - 1
        return split, last, keep

    def _tail_rows(self, buf: Tensor, codes: Tensor, keep: Tensor) -> Tensor:
        """[T, Z] a per-symbol tail buffer [S, K, Z] laid out as the tail split's rows (0 on the scheduled rows)."""
        tail = buf[codes]
        ahead = tail.new_zeros(tail.shape[0], keep.shape[1] - tail.shape[1], tail.shape[2])
        return torch.cat((tail, ahead), 1)[keep]

    def _future_rows(self, next_ts: Tensor) -> Tensor:
        """[P, H, F] normalised rows of the scheduled bars: the known-future columns, NaN (read as 0) elsewhere."""
        P, H = next_ts.shape
        F = len(self.feature_names)
        out = torch.full((P, H, F), float("nan"), dtype=torch.float32)
        if not self.known_future or H == 0:
            return torch.nan_to_num(out, nan=0.0)
        ph = phases(next_ts.reshape(-1))  # the calendar features' own code: a function of the timestamp alone
        raw = torch.full((P * H, F), float("nan"), dtype=torch.float32)
        for k in self.known_future:
            raw[:, self.feature_names.index(k)] = calendar_values(k, ph)
        normed = self.loaded.feature_normalizer(raw).clamp(-self.clip, self.clip)
        return normed.reshape(P, H, F)

    def _decide(self, codes: Tensor, next_ts: Tensor, sel: Tensor | slice | None = None) -> tuple[dict[str, Tensor],
                                                                                                   Tensor]:
        """Each member's position for these symbols from its policy table's row at the bar just in, then the
        combination; the held positions move on."""
        nets = self._forecaster_networks() if self.fast else []
        for net in nets:
            net.cache_inference = True
        try:
            return self._decide_cached(codes, next_ts, codes if sel is None else sel)
        finally:
            for net in nets:
                net.cache_inference = False

    def _compile_networks(self) -> None:
        """``compile_networks``: each TFT forecaster's inference form compiled for the lean decision of a bar of every
        symbol (:meth:`~foxhunt.models.tft_inference.TFTInference.compile_for`, here: seconds); other batches, and the
        warm-up's tails, run the eager form. ValueError where no network of this session would run compiled."""
        from foxhunt.models.tft import TemporalFusionTransformer

        nets = [self.model.forecaster(n).network for n in self.model.forecaster_names]
        nets = [net for net in nets if isinstance(net, TemporalFusionTransformer)]
        if not (self.fast and self._lean is not None and nets):
            raise ValueError("compile_networks compiles the TFT forecasters of the lean decision (fast=True, torch "
                             "networks, no stacking, discrete agents, fitted target statistics): this session has none")
        for net in nets:
            net.inference_form().compile_for(len(self.symbols))

    def _forecaster_networks(self) -> list[Any]:
        """The forecasters' networks (and stacking's snapshots) that keep an inference form between bars (the TFT's:
        :class:`~foxhunt.models.tft_inference.TFTInference`), on only while this session decides; found once (the
        session's model and its modules are fixed)."""
        if self._cached_nets is None:
            model = self.model
            nets = [model.forecaster(n).network for n in model.forecaster_names]
            if model.hparams.combine == "stack":
                nets += [model.snapshots[n] for n in model.forecaster_names]
            self._cached_nets = [net for net in nets if hasattr(net, "cache_inference")]
        return self._cached_nets

    def _decide_cached(self, codes: Tensor, next_ts: Tensor, sel: Tensor | slice) -> tuple[dict[str, Tensor], Tensor]:
        model = self.model
        if self.fast and self._lean_applies(sel):
            return self._decide_lean(codes, next_ts, sel)
        split, last, keep = self._tail_split(codes, next_ts)
        decision, reset = split.valid, split.first_bar
        pos: dict[str, Tensor] = {}
        forecasts = model.forecasts(split, rows=last)
        for name, fc in forecasts.items():  # the policy table's rows of the bars just in (a row reads its own bar)
            table = model.forecast_table(name, fc[last], decision[last], reset[last])
            idx = table.gather(1, self.held[name][codes].long().unsqueeze(1)).squeeze(1)
            self.held[name][codes] = idx
            pos[name] = FORECAST_ACTIONS[idx]
        agents = model.trading_agents()
        inputs = split
        if model.hparams.combine == "stack" and agents:  # the agents' windows read the forecasts of their rows: the
            # latest row's are forecast now, the earlier ones were at their own bars (kept in the tail)
            now = model.stacked(split, rows=last)
            F = split.n_features
            self.stack[codes, -1] = now.features[last, F:]
            z = self._tail_rows(self.stack, codes, keep)
            inputs = replace(now, features=torch.cat((split.features, z), 1))
        for name in agents:
            pos[name] = self._agent_step(name, inputs, last, codes)
        for name in model.agent_names:
            pos.setdefault(name, torch.zeros(codes.numel(), dtype=torch.float32))
        model.combine(pos, decision[last])
        return pos, decision[last]

    # ------------------------------------------------------------------------------------------------ the lean path
    def _lean_plan(self) -> tuple[float, float] | None:
        """The target statistics (loc, scale) every row of a tail has, when the lean decision reproduces
        :meth:`_tail_split`'s exactly for a full tail; None when it does not apply (see :meth:`_decide_lean`)."""
        from foxhunt.lit.dqn import DQNModule
        from foxhunt.lit.ppo import PPOModule
        from foxhunt.lit.tft import TFTModule

        model, t = self.model, self.loaded.target_transform
        if model.hparams.combine == "stack":
            return None
        if any(type(model.forecaster(n)).forecast is not TFTModule.forecast for n in model.forecaster_names):
            return None
        greedy = (DQNModule.decision_table, PPOModule.decision_table)  # both greedy_table's, on Q or logits
        if any(type(a).decision_table not in greedy or getattr(a, "continuous", False)
               for a in map(model.agent, model.agent_names)):
            return None  # (a continuous PPO's position is a recurrence: continuous_step)
        if any(isinstance(part, RollingZScore) or getattr(part, "mode", "fitted") != "fitted"
               for part in (t.scaler, t.clip) if part is not None):
            return None  # rolling statistics: each row's own, from the returns before it
        probe = torch.tensor([0.0, 0.01, -0.01, 0.1, -0.1])
        scaled = t.transform(probe, segment=torch.zeros(5, dtype=torch.int64))
        if not (torch.isfinite(scaled.value).all() and bool((scaled.loc == scaled.loc[0]).all())
                and bool((scaled.scale == scaled.scale[0]).all())):
            return None
        return float(scaled.loc.float()[0]), float(scaled.scale.float()[0])

    def _lean_applies(self, sel: Tensor | slice) -> bool:
        """Whether these symbols' decision can take the lean path: every tail full (the members' kinds are checked
        once, :meth:`_lean_plan`)."""
        return self._lean is not None and bool((self.seen[sel] >= self.tail).all())

    def _decide_lean(self, codes: Tensor, next_ts: Tensor, sel: Tensor | slice) -> tuple[dict[str, Tensor], Tensor]:
        """:meth:`_decide` for full tails without assembling them as a split: what the back-test's code computes at
        the bar just in, read from the tail buffers directly (tests/test_live.py holds the two paths equal).

        A full tail's rows all belong to its symbol and have finite next returns (their closes are positive; the bar
        just in has the scheduled 0), and the target statistics are fitted constants (``_lean_plan``), so a row is a
        decision bar (``MarketSplit.valid``) where its features are ready; a forecaster's window is usable
        (``valid_window_starts``) where its L rows are, and it is forecast as ``TFTModule.forecast`` does (window,
        known-future rows, the decision row's loc/scale); a DQN or discrete PPO agent at a decision bar takes the argmax
        of its Q-values (logits) for the held position (``greedy_table``'s row), flat elsewhere."""
        model, P, K = self.model, codes.numel(), self.tail
        ready = self.ready_rows[sel]  # [P, K]
        decided = ready[:, -1]
        reset = torch.zeros(P, dtype=torch.bool)  # a full tail's last row is not its symbol's first
        pos: dict[str, Tensor] = {}
        if model.forecaster_names:
            L, H = self.lookback, self.horizon
            loc, scale = self._lean
            x_past = torch.nan_to_num(self.rows[sel, K - L :], nan=0.0)
            x_future = self._known_future_inputs(next_ts[:, :H])
            window_ok = ready[:, K - L :].all(1)
            stats = {"y_loc": torch.full((P, H), loc), "y_scale": torch.full((P, H), scale)}
            for name in model.forecaster_names:
                member = model.forecaster(name)
                net = member.network
                with eval_mode(net):
                    pred = net(x_past, x_future, codes).prediction.float()
                fc = member.to_return_scale(pred, stats)
                fc = torch.where(window_ok[:, None, None], fc, torch.nan)
                table = model.forecast_table(name, fc, decided, reset)
                idx = table.gather(1, self.held[name][sel].long().unsqueeze(1)).squeeze(1)
                self.held[name][sel] = idx
                pos[name] = FORECAST_ACTIONS[idx]
        for name in model.trading_agents():
            agent = model.agent(name)
            if agent.holds_flat:
                pos[name] = torch.zeros(P, dtype=torch.float32)
                continue
            window, actions, flat, eye = self._agent_constants(name)
            net = agent.policy_network
            held = self.held[name][sel].long()
            obs = torch.nan_to_num(self.rows[sel, K - window :], nan=0.0)
            with eval_mode(net):
                greedy = self._lean_greedy(name, net, obs, eye, held)
            idx = torch.where(decided, greedy, flat)
            self.held[name][sel] = idx
            pos[name] = actions[idx]
        for name in model.agent_names:
            pos.setdefault(name, torch.zeros(P, dtype=torch.float32))
        model.combine(pos, decided)
        return pos, decided

    def _lean_greedy(self, name: str, net: Any, obs: Tensor, eye: Tensor, held: Tensor) -> Tensor:
        """[P] the greedy action for the held positions ``held`` on the windows ``obs`` [P, W, F] (``greedy_table``'s
        row). A flat-encoder ``QNetwork`` (its rows are independent of the batch: tests/test_qnet_inference.py) is
        called on the held positions alone, through its inference form; any other Q-network (an ONNX Runtime one of
        :mod:`foxhunt.live.backend`, a conv encoder) and a discrete PPO's actor (its logits: ``PPOModule.decision_table``,
        through :class:`~foxhunt.models.actor_critic.ActorInference`) on every position of every window, the batch
        ``greedy_table`` gives it, so its outputs are the back-test's whatever its kernels do with the batch size."""
        from foxhunt.models.actor_critic import ActorCritic
        from foxhunt.models.qnet import QNetwork

        form = self._agent_network(name, net)
        if isinstance(net, QNetwork) and net.flat:
            return form(obs, eye[held]).argmax(1)
        A = eye.shape[0]
        if bound_graph_applies(net):
            key = (name, obs.shape[0] * A)
            got = self._bound.get(key)
            if got is None or got.net is not net:
                got = self._bound[key] = BoundQGraph(net, key[1], eye.repeat(obs.shape[0], 1))
            q = got(obs)
        else:
            q_fn = form.deterministic if isinstance(form, ActorCritic) else form  # PPO: its logits (decision_table's)
            q = q_fn(obs.repeat_interleave(A, 0), eye.repeat(obs.shape[0], 1))
        return q.argmax(1).view(-1, A).gather(1, held.unsqueeze(1)).squeeze(1)

    def _agent_constants(self, name: str) -> tuple[int, Tensor, int, Tensor]:
        """Agent ``name``'s window, actions, flat action's index and held-position one-hots (looked up once)."""
        got = self._agent_const.get(name)
        if got is None:
            hp = self.model.agent(name).hparams
            actions = torch.tensor(tuple(hp.actions), dtype=torch.float32)
            got = self._agent_const[name] = (int(hp.window), actions, int(torch.argmin(actions.abs())),
                                             torch.eye(actions.numel()))
        return got

    def _known_future_inputs(self, next_ts: Tensor) -> Tensor:
        """[P, H, K] the forecasters' known-future inputs at the scheduled timestamps ``next_ts`` [P, H]: the
        known-future columns of :meth:`_future_rows`. A function of the timestamp alone, so rows are kept by timestamp
        (few symbols a bar): a timestamp not kept yet is computed with the next ones at the latest spacing (up to 1,024
        rows at once), which a regular schedule reaches next; at most 4,096 kept."""
        P, H = next_ts.shape
        cols = [self.feature_names.index(k) for k in self.known_future]
        if not cols or P * H > 64:
            return torch.nan_to_num(self._future_rows(next_ts)[:, :, cols], nan=0.0)
        keys = next_ts.reshape(-1).tolist()
        index = self._future_index
        missing = [k for k in keys if k not in index]
        if missing:
            step = int(self.spacing.max().clamp_min(1))
            reach = torch.arange(max(1, 1024 // len(missing)))  # up to 1,024 rows computed at once
            ahead = (torch.tensor(missing, dtype=torch.int64)[:, None] + step * reach).reshape(-1).tolist()
            if len(index) + len(ahead) > 4096:
                index.clear()
                self._future_table = torch.zeros(0, len(cols))
            new = [k for k in dict.fromkeys([*keys, *ahead]) if k not in index]
            rows = torch.nan_to_num(self._future_rows(torch.tensor(new).view(1, -1))[0][:, cols], nan=0.0)
            base = self._future_table.shape[0]
            index.update((k, base + i) for i, k in enumerate(new))
            self._future_table = torch.cat((self._future_table, rows))
        at = torch.tensor([index[k] for k in keys])
        return self._future_table.index_select(0, at).view(P, H, len(cols))

    def _agent_step(self, name: str, inputs: Any, last: Tensor, codes: Tensor) -> Tensor:
        """Agent ``name``'s positions at the bars ``last`` of its market, from what it holds."""
        agent = self.model.agent(name)
        P = codes.numel()
        flat = torch.zeros(P, dtype=torch.float32)
        try:
            market = agent.market_tensors(inputs)
        except ValueError:  # no bar of the tail can be decided yet (warming up): flat, and flat is what it holds
            self.held[name][codes] = 0.0 if self._continuous(name) else self._flat_index(name).to(self.held[name].dtype)
            return flat
        decided = market.decision[last]
        if agent.holds_flat:
            return flat
        net = agent.policy_network
        with eval_mode(net):
            table = agent.decision_table(self._agent_network(name, net), market, bars=last)
            if table is None:
                held = torch.where(market.reset_mask[last], 0.0, self.held[name][codes])
                p = agent.continuous_step(net, market, last, decided, held)
                self.held[name][codes] = p
                return p
        idx = table[last].gather(1, self.held[name][codes].long().unsqueeze(1)).squeeze(1)
        self.held[name][codes] = idx
        return market.actions[idx].float()


    def _agent_network(self, name: str, net: Any) -> Any:
        """What the session calls for agent ``name``'s network: its inference form when :attr:`fast` (built once per
        network object: it holds views of the parameters, so weights loaded into the network reach it), else the
        network."""
        if not self.fast:
            return net
        held = self._agent_nets.get(name)
        if held is None or held[0] is not net:
            from foxhunt.models.actor_critic import ActorCritic, ActorInference
            from foxhunt.models.qnet_inference import q_inference

            form = ActorInference(net) if type(net) is ActorCritic else q_inference(net)  # (not a served subclass)
            held = self._agent_nets[name] = (net, form)
        return held[1]

    # ------------------------------------------------------------------------------------------------ state
    @property
    def export_digest(self) -> str:
        """What identifies the export this session trades: its metadata's and tensor files' SHA-256, hashed."""
        meta = self.loaded.metadata
        return sha256_hex(json.dumps([meta.get("metadata_sha256"), meta.get("sha256")], sort_keys=True).encode())

    def state_dict(self) -> dict[str, Tensor]:
        """Every tensor a restarted session needs to decide exactly as this one would: the features' state, the
        tails, the bars seen and each member's held position."""
        out = {f"features.{k}": v for k, v in self.features.state_dict().items()}
        for key in ("rows", "ready_rows", "ohlcv", "ts", "seen", "spacing", "stack"):
            out[f"session.{key}"] = getattr(self, key)
        out.update({f"held.{name}": held for name, held in self.held.items()})
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict`'s tensors; ValueError in one line naming the first that does not fit."""
        mine = self.state_dict()
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        if missing or extra:
            raise ValueError(f"live state: tensors do not match this session: missing {missing[:3]}, unexpected {extra[:3]}")
        for key, value in mine.items():
            if not key.startswith("features.") and (state[key].shape != value.shape or state[key].dtype != value.dtype):
                raise ValueError(f"live state: {key} has shape {tuple(state[key].shape)} {state[key].dtype}, this "
                                 f"session's is {tuple(value.shape)} {value.dtype}")
        self.features.load_state_dict({k[len("features."):]: v for k, v in state.items() if k.startswith("features.")})
        for key in ("rows", "ready_rows", "ohlcv", "ts", "seen", "spacing", "stack"):
            getattr(self, key).copy_(state[f"session.{key}"])
        for name in self.held:
            self.held[name].copy_(state[f"held.{name}"])

    def save(self, directory: str | Path, **info: Any) -> Path:
        """Save the state (verified, atomic: :mod:`foxhunt.live.state`) with ``info`` (JSON-able) beside it."""
        return save_state(directory, self.state_dict(), {"export": self.export_digest, "symbols": self.symbols, **info})

    def restore(self, directory: str | Path) -> dict[str, Any]:
        """Continue from a saved state of a session of this export; returns the info saved with it."""
        tensors, info = load_state(directory, self.export_digest)
        try:
            self.load_state_dict(tensors)
        except ValueError as e:
            raise StateError(f"{directory}: {e}") from None
        return info


def open(path: str, features: Any | None = None, backend: str = "torch",  # noqa: A001 - like io.open
         fast: bool = True, compile_features: bool = False, compile_networks: bool = False) -> LiveSession:
    """A live session of the export at ``path`` (verified by :func:`foxhunt.load`), flat until it is warmed up;
    ``backend``: what its members compute on (:data:`foxhunt.live.backend.BACKENDS`: torch, or ONNX Runtime on the
    export's float or int8 graphs, :mod:`foxhunt.live.backend`); ``fast``: :attr:`LiveSession.fast`;
    ``compile_features``: the features' steady bars through torch.compile (:class:`~foxhunt.features.stream.FeatureStream`);
    ``compile_networks``: the TFT forecasters' decisions through torch.compile (torch backend; :meth:`LiveSession._compile_networks`)."""
    from foxhunt.export.load import load

    loaded = load(path)
    if backend != "torch":
        if compile_networks:
            raise ValueError(f"compile_networks compiles torch networks; backend {backend!r} runs its own graphs")
        from foxhunt.live.backend import use_backend

        use_backend(loaded, path, backend)
    return LiveSession(loaded, features, fast, compile_features, compile_networks)
