"""FeatureStream: the registered features bar by bar (or chunk by chunk) for S symbols, O(1) per bar in history.

The same feature code as :class:`~foxhunt.features.compute.FeatureSet` runs on a panel of the new bars whose stateful
primitives are the stepping forms of :mod:`foxhunt.features.stepping`; the values equal ``compute``'s on the same
per-symbol history (tests/test_features_stream.py), rounded once to float32 as it does.
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from foxhunt.features.catalog import REGISTRY
from foxhunt.features.panel import Panel
from foxhunt.features.registry import select
from foxhunt.features.stepping import StepOps

__all__ = ["FeatureStream"]

_CONFIG_KEY = "config"


def _eager_unary(x: Tensor, name: str) -> Tensor:
    """torch's own kernel of the transcendental ``name`` (MKL's on CPU: what compute runs); inductor's vectorised log
    and sin differ from it by an ulp, which a variance of returns turns into ~1e-11."""
    return getattr(torch.ops.aten, name).default(x.contiguous())


def _eager_unary_fake(x: Tensor, name: str) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# an opaque op to inductor (the plain torch.library registration: a dispatcher call, without custom_op's wrappers)
_LIB = torch.library.Library("foxhunt", "FRAGMENT")
_LIB.define("eager_unary(Tensor x, str name) -> Tensor")
_LIB.impl("eager_unary", _eager_unary, "CompositeExplicitAutograd")
torch.library.register_fake("foxhunt::eager_unary", _eager_unary_fake, lib=_LIB)
_EAGER_UNARY = torch.ops.foxhunt.eager_unary.default

# the elementwise functions that are not correctly rounded: in a compiled step each call is torch's kernel (opaque)
_UNARY = ("log", "log1p", "log2", "log10", "exp", "exp2", "expm1", "sin", "cos", "tan", "tanh", "sinh", "cosh", "asin",
          "acos", "atan", "asinh", "acosh", "atanh", "erf", "erfc", "sigmoid")
_REDIRECTS = tuple((f, name, False) for name in _UNARY for f in (getattr(torch, name), getattr(Tensor, name))) + tuple(
    (getattr(Tensor, name + "_"), name, True) for name in _UNARY)


class _TorchKernels(TorchFunctionMode):
    """Inside a compiled step: every function of ``_UNARY`` through ``foxhunt::eager_unary`` (torch's kernel, bit for bit
    the eager stream's), the rest as it is; in an eager step it changes no value."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        kwargs = kwargs or {}
        for f, name, inplace in _REDIRECTS:
            if func is f and len(args) == 1 and set(kwargs) <= {"out"}:
                y = _EAGER_UNARY(args[0], name)
                if inplace:
                    return args[0].copy_(y)
                out = kwargs.get("out")
                return y if out is None else out.copy_(y)
        return func(*args, **kwargs)


def _compile_options() -> dict:
    """torch.compile's options for the steady step: its tensor guards only (FeatureStream._compile says why), no size
    asserts of the inputs in the graph's wrapper (their tensor guards check the same shapes and strides), and that
    wrapper in C++ (the same kernels; ~10% less time a bar at one symbol than a Python wrapper)."""
    return {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe, "size_asserts": False, "cpp_wrapper": True}


class FeatureStream:
    """Stepping features of ``names`` (FeatureSet's selection and order) for ``n_symbols`` symbols on ``device``.

    ``compile=True`` is the fast path for live bars: a bar of every symbol past every warm-up (off a 512-bar block
    start) runs the same feature code as one graph compiled by torch.compile (inductor, at construction: minutes the
    first time, its cache after), equal to the eager stream and to compute within 1e-12; every other bar, and every
    bar by default, runs eagerly, the reference."""

    def __init__(self, names: Sequence[str], n_symbols: int, device: str | torch.device = "cpu",
                 compile: bool = False) -> None:
        if isinstance(names, str):
            raise TypeError("FeatureStream: names must be a sequence of feature names, not a single string")
        self.features = select(REGISTRY, list(names), None)
        if not self.features:
            raise ValueError("FeatureStream: the selection is empty")
        if int(n_symbols) < 1:
            raise ValueError(f"FeatureStream: n_symbols must be >= 1, got {n_symbols}")
        self.names: list[str] = [f.name for f in self.features]
        self.n_symbols, self.device = int(n_symbols), torch.device(device)
        self.warmup: int = max(f.warmup for f in self.features)
        self._warmups = torch.tensor([f.warmup for f in self.features], dtype=torch.int64, device=self.device)
        S = self.n_symbols
        self._columns: dict[tuple, Tensor] = {}  # the rings' column indices, built once (not state)
        self._state: dict[str, Tensor] = {
            "age": torch.zeros(S, dtype=torch.int64, device=self.device),  # bars seen per symbol
            "last_ts": torch.full((S,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=self.device),
            "ring_shift": torch.zeros(S, dtype=torch.int64, device=self.device),  # a symbol's ring clock less its age
        }
        # one pass that moves no symbol creates every slot at its empty value: the state's keys never change
        op = self._step(torch.ones((S, 1, 5), dtype=torch.float64, device=self.device),
                        torch.zeros((S, 1), dtype=torch.int64, device=self.device),
                        torch.zeros(S, dtype=torch.bool, device=self.device), torch.float64)[2]
        # from this bar on every warm-up test of the code is passed: a bar of every symbol there, off the block
        # starts, is a steady step (one graph, no branch on the data)
        self._steady_from, self._blocks = max(op.asked, self.warmup), tuple(sorted(op.blocks))
        self._ring_keys = tuple(sorted(op.ring_keys))
        self._zeros = torch.zeros(S, dtype=torch.int64, device=self.device)
        self._ages()
        # compile: steady bars run the feature code traced by torch.compile (inductor); the rest, and every bar when
        # False, the eager reference
        self.compiled = bool(compile)
        self._steady = self._steady_values
        if compile:
            self._compile()

    def _compile(self) -> None:
        """Compile the steady step here (not on the first live bar), once, on a copy of the state (the graph reads the
        state's tensors by key at every call, so it serves the real state, and a restored one, as well).

        The stream gets its own copy of the code, so its compiled graph is the only one torch.compile keeps for it,
        and only the tensor guards are kept (the inputs' shapes, strides, dtypes, devices: a change recompiles). The
        rest never changes in a stream's life: its features, symbols and device are fixed at construction,
        load_state_dict keeps every key and copies into tensors laid out as the stream's own, no two inputs alias
        (every state tensor is its own; the step builds its bar's inputs afresh) and the step runs under no_grad.
        Checking those on every bar costs ~0.3 ms at 1 symbol."""
        own = types.FunctionType(FeatureStream._steady_values.__code__.replace(), globals())
        self._steady = torch.compile(types.MethodType(own, self), dynamic=False, fullgraph=True,
                                     options=_compile_options())
        S, real = self.n_symbols, self._state
        self._state = {k: v.clone() for k, v in real.items()}  # clone keeps the strides (time-major rings)
        try:
            with torch.no_grad():
                self._steady(torch.ones((5, S, 1), dtype=torch.float64, device=self.device),
                             torch.zeros((S, 1), dtype=torch.int64, device=self.device),
                             torch.full((1, 1), self._steady_from, dtype=torch.int64, device=self.device))
        finally:
            self._state = real

    def config(self) -> dict:
        """What the state belongs to (JSON-able): the feature names in order and the number of symbols."""
        return {"kind": "foxhunt.features.FeatureStream", "version": 2, "names": list(self.names),
                "n_symbols": self.n_symbols}

    def update(self, ohlcv: Tensor, timestamps: Tensor, present: Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """Values [S, k, F] (``dtype``: float32 as compute gives, float64 before its rounding) and ready [S, k] for
        the next k bars of every symbol; a symbol absent in a slot (``present`` False) keeps its state there and
        gets NaN, not ready."""
        S = self.n_symbols
        ohlcv = torch.as_tensor(ohlcv).to(self.device, torch.float64)
        timestamps = torch.as_tensor(timestamps).to(self.device, torch.int64)
        if ohlcv.ndim != 3 or ohlcv.shape[0] != S or ohlcv.shape[2] != 5 or ohlcv.shape[1] < 1:
            raise ValueError(f"FeatureStream.update: ohlcv must be [{S}, k >= 1, 5] (open, high, low, close, volume), "
                             f"got {list(ohlcv.shape)}")
        k = ohlcv.shape[1]
        if tuple(timestamps.shape) != (S, k):
            raise ValueError(f"FeatureStream.update: timestamps must be [{S}, {k}], got {list(timestamps.shape)}")
        if present is not None:
            present = torch.as_tensor(present).to(self.device, torch.bool)
            if tuple(present.shape) != (S, k):
                raise ValueError(f"FeatureStream.update: present must be [{S}, {k}] bool, got {list(present.shape)}")
            if bool(present.all()):
                present = None
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"FeatureStream.update: dtype must be torch.float32 or torch.float64, got {dtype}")
        self._check(ohlcv, timestamps, present)
        with torch.no_grad():
            if present is None:
                if k == 1 and self.compiled and self._is_steady():
                    return self._steady_step(ohlcv, timestamps, dtype)
                out = self._step(ohlcv, timestamps, None, dtype)[:2]
                self._advanced(k)
                return out
            parts = [self._step(ohlcv[:, j : j + 1], timestamps[:, j : j + 1], present[:, j], dtype) for j in range(k)]
        self._ages()
        return torch.cat([v for v, _, _ in parts], dim=1), torch.cat([r for _, r, _ in parts], dim=1)

    def _ages(self) -> None:
        """The host's copy of the youngest symbol's age and of the one age all share (None if they differ); every
        symbol on one ring clock (:meth:`_align`)."""
        age = self._state["age"]
        self._min_age = int(age.min())
        self._common_age = self._min_age if int(age.max()) == self._min_age else None
        self._align()

    def _advanced(self, k: int) -> None:
        """The host's copies after k bars of every symbol (ages and the one clock move together)."""
        self._min_age += k
        self._common_age = None if self._common_age is None else self._common_age + k
        self._clock += k

    def _align(self) -> None:
        """Put every symbol on the latest symbol's ring clock: a symbol that missed bars has its rings rotated by its
        lag (the bar of clock c moves from column c % w to (c + lag) % w) and its shift raised by as much. A bar of
        every symbol then reads one column of each ring (a host integer, or in the compiled step one index for all
        symbols) instead of one column per symbol; the values are the same."""
        clock = self._state["age"] + self._state["ring_shift"]
        latest = int(clock.max())
        lag = latest - clock
        rows = torch.nonzero(lag).flatten()
        if rows.numel():
            back = lag[rows, None]
            index: dict[int, Tensor] = {}  # per ring width: the lagging rows' rotated columns (many rings share one)
            for key in self._ring_keys:
                ring = self._state[key]
                w = ring.shape[1]
                if w not in index:
                    index[w] = torch.remainder(torch.arange(w, device=self.device) - back, w)
                ring[rows] = ring[rows].gather(1, index[w])
            self._state["ring_shift"] = self._state["ring_shift"] + lag
        self._clock = latest

    def _is_steady(self) -> bool:
        """Whether the next bar of every symbol is a steady step: past every warm-up, no symbol starting a block."""
        if self._min_age < self._steady_from:
            return False
        if self._common_age is not None:
            return all(self._common_age % b for b in self._blocks)
        age = self._state["age"]
        return not any(bool((age % b == 0).any()) for b in self._blocks)

    def _steady_values(self, cols: Tensor, timestamps: Tensor, clock: Tensor) -> Tensor:
        """Every feature of one steady bar, [S, F] float64 (the state moves in place): the same feature code through
        a StepOps that never branches on the data, so torch.compile can trace it whole; ``clock`` [1, 1] is the one
        ring clock of every symbol (a steady step reads no age: every symbol is past every warm-up)."""
        S = self.n_symbols
        op = StepOps(self._state, clock.expand(S, 1), steady=True)
        panel = Panel(cols, timestamps, self._zeros, [1] * S, op=op)
        with _TorchKernels():
            values = torch.cat([f.fn(panel) for f in self.features], dim=1)
        op.finish()
        return values

    def _steady_step(self, ohlcv: Tensor, timestamps: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """One steady bar of every symbol (:meth:`_steady_values`, compiled when the stream is) and its state moved."""
        S, dev = self.n_symbols, self.device  # inputs of the compiled graph's fixed layout (strides too, even of a
        # size-1 axis, which .contiguous() leaves as they are)
        cols = torch.empty((5, S, 1), dtype=torch.float64, device=dev).copy_(ohlcv.permute(2, 0, 1))
        timestamps = torch.empty((S, 1), dtype=torch.int64, device=dev).copy_(timestamps)
        values = self._steady(cols, timestamps, torch.full((1, 1), self._clock, dtype=torch.int64, device=dev))
        self._state["age"] = self._state["age"] + 1
        self._state["last_ts"] = timestamps[:, -1].clone()
        self._advanced(1)
        return values.to(dtype)[:, None], torch.ones((S, 1), dtype=torch.bool, device=self.device)

    def _all_valid(self, ohlcv: Tensor, timestamps: Tensor) -> bool:
        """Whether every bar passes :meth:`_check` (NaN propagates through aminmax, so a NaN fails), in two reductions
        read once: a live bar's check, not ten tensor calls."""
        lo, hi = torch.aminmax(ohlcv.reshape(-1, 5), dim=0)
        late = (timestamps[:, 0] <= self._state["last_ts"]).any()
        if timestamps.shape[1] > 1:
            late = late | (timestamps[:, 1:] <= timestamps[:, :-1]).any()
        lo, hi, late = lo.tolist(), hi.tolist(), bool(late)
        return not late and all(v > 0.0 for v in lo[:4]) and lo[4] >= 0.0 and all(v < math.inf for v in hi)

    def _check(self, ohlcv: Tensor, timestamps: Tensor, present: Tensor | None) -> None:
        """One line naming the symbol row and slot of the first bar compute would refuse (prices > 0 and finite,
        volume >= 0 and finite, timestamps increasing per symbol)."""
        if present is None and self._all_valid(ohlcv, timestamps):
            return
        ok = torch.isfinite(ohlcv).all(dim=2) & (ohlcv[..., :4] > 0).all(dim=2) & (ohlcv[..., 4] >= 0)
        prev = torch.cat((self._state["last_ts"][:, None], timestamps[:, :-1]), dim=1)
        if present is not None:  # an absent slot is not checked and does not move the last time
            ok |= ~present
            last = self._state["last_ts"].clone()
            cols = []
            for j in range(timestamps.shape[1]):
                cols.append(last.clone())
                last = torch.where(present[:, j], timestamps[:, j], last)
            prev = torch.stack(cols, dim=1)
        late = timestamps <= prev
        if present is not None:
            late &= present
        for bad, why in ((~ok, "a non-finite or non-positive price, or a negative or non-finite volume"),
                         (late, "a timestamp not after the symbol's previous bar")):
            if bool(bad.any()):
                s, j = (int(i) for i in torch.nonzero(bad)[0])
                raise ValueError(f"FeatureStream.update: symbol row {s}, bar {j} of the chunk has {why} "
                                 f"(ohlcv {ohlcv[s, j].tolist()}, timestamp {int(timestamps[s, j])})")

    def _step(self, ohlcv: Tensor, timestamps: Tensor, moved: Tensor | None,
              dtype: torch.dtype) -> tuple[Tensor, Tensor, StepOps]:
        """One chunk [S, m] through every feature; ``moved`` [S] (None: all) are the symbols with these bars. Returns
        the values, ready and the chunk's StepOps."""
        S, m = timestamps.shape
        age = self._state["age"][:, None] + torch.arange(m, device=self.device)
        op = StepOps(self._state, age, moved, self._columns, clock=age + self._state["ring_shift"][:, None])
        cols = ohlcv.permute(2, 0, 1).contiguous()
        panel = Panel(cols, timestamps, torch.zeros(S, dtype=torch.int64, device=self.device), [m] * S, op=op)
        out = []
        for f in self.features:
            v = f.fn(panel)
            if tuple(v.shape) != (S, m):
                raise RuntimeError(f"feature {f.name!r} returned shape {tuple(v.shape)}, expected {(S, m)}")
            out.append(v)
        values = (torch.cat(out, dim=1)[:, None] if m == 1 else torch.stack(out, dim=2)).to(dtype)  # rounded once
        if op.youngest < self.warmup:
            values.masked_fill_(age[:, :, None] < self._warmups, float("nan"))
        ready = age >= self.warmup
        if moved is None:
            self._state["age"] = self._state["age"] + m
            self._state["last_ts"] = timestamps[:, -1].clone()
        else:
            values[~moved] = float("nan")
            ready &= moved[:, None]
            self._state["age"] = torch.where(moved, self._state["age"] + m, self._state["age"])
            self._state["last_ts"] = torch.where(moved, timestamps[:, -1], self._state["last_ts"])
        return values, ready, op

    def state_dict(self) -> dict[str, Tensor]:
        """Every tensor of the state (copies), and the config as JSON bytes under "config": safetensors-ready."""
        out = {k: v.detach().clone().contiguous() for k, v in self._state.items()}
        out[_CONFIG_KEY] = torch.tensor(list(json.dumps(self.config(), sort_keys=True).encode()), dtype=torch.uint8)
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore a state from :meth:`state_dict`; ValueError in one line naming the first key that does not fit."""
        if _CONFIG_KEY not in state:
            raise ValueError(f"FeatureStream.load_state_dict: key {_CONFIG_KEY!r} is missing")
        try:
            theirs = json.loads(bytes(state[_CONFIG_KEY].to(torch.uint8).tolist()).decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"FeatureStream.load_state_dict: key {_CONFIG_KEY!r} is not the JSON of a config "
                             f"({e})") from None
        if theirs != self.config():
            diff = [k for k in sorted(set(theirs) | set(self.config())) if theirs.get(k) != self.config().get(k)]
            raise ValueError(f"FeatureStream.load_state_dict: key {_CONFIG_KEY!r} differs in {diff} (the state is of "
                             f"another stream: {theirs.get('n_symbols')} symbols, "
                             f"{len(theirs.get('names', []))} features)")
        extra = sorted(set(state) - set(self._state) - {_CONFIG_KEY})
        if extra:
            raise ValueError(f"FeatureStream.load_state_dict: unexpected key {extra[0]!r}")
        new = {}
        if "ring_shift" not in state:  # a state saved before ring clocks: its rings are placed by age (shift 0)
            state = {**state, "ring_shift": torch.zeros_like(self._state["ring_shift"])}
        for key, mine in self._state.items():
            if key not in state:
                raise ValueError(f"FeatureStream.load_state_dict: key {key!r} is missing")
            t = state[key]
            if not isinstance(t, Tensor) or t.dtype != mine.dtype or tuple(t.shape) != tuple(mine.shape):
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"FeatureStream.load_state_dict: key {key!r} is {got}, expected {mine.dtype} "
                                 f"{list(mine.shape)}")
            new[key] = torch.empty_like(mine).copy_(t.detach())  # the layout of a fresh stream's (time-major rings)
        self._state = new
        self._ages()

    def __repr__(self) -> str:
        return f"FeatureStream({len(self.names)} features, {self.n_symbols} symbols, warm-up {self.warmup})"
