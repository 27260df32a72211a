"""The stepping forms of ops.py's stateful primitives: a chunk of bars in, the chunk's values out, the state carried.

A stream's :class:`~foxhunt.features.panel.Panel` holds a :class:`StepOps` where a batch panel holds the ``ops`` module,
so every feature's one piece of code (``p.op.ema``, ``p.op.shift``, ``p.op.Prefix``...) drives both. Each call of a
stateful primitive takes the next slot of the state, in call order (fixed by the feature list and the panel's memo,
never by the data), and every slot is created on the first pass, so the state's keys and shapes never change.

Exact primitives step bit for bit as the batch form: shifts, differences, extrema, arg-extrema and window loops run the
batch function on the last bars kept in a ring (one bar: the same reduction of its window, in the batch loop's order
where order matters); running sums continue torch's sequential CPU sum from its total. Rings are circular (the bar of
clock c at column c % w; a symbol's clock is its age plus a shift its stream keeps so that all symbols share one clock)
and stored time-major, so one bar reads and writes one column of S adjacent numbers, at a host-integer column (eager)
or one index for every symbol (compiled). The recursive filters step the recurrence itself (y = a y + u, TA-Lib's
definition), which the batch form's blocked scans equal to rounding; so do block-centred window sums, taken here over
the window itself, centred on the latest value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from foxhunt.features import ops

NAN = ops.NAN


class StepOps:
    """The stateful primitives for one chunk [S, m] of bars: ``age`` [S, m] is each bar's index in its symbol's
    history; ``moved`` [S] (None: all) marks the symbols whose state this chunk moves; ``clock`` [S, m] (None: the
    age) places each bar in the rings (bar of clock c at column c % w): a stream keeps one clock for all symbols,
    whatever their ages, so a bar reads one column of each ring, not one per symbol."""

    def __init__(self, state: dict[str, Tensor], age: Tensor, moved: Tensor | None = None,
                 columns: dict[tuple, Tensor] | None = None, steady: bool = False,
                 clock: Tensor | None = None) -> None:
        self.state, self.age, self.moved = state, age, moved
        self.S, self.m = age.shape
        clock = age if clock is None else clock
        # steady: one bar of every symbol, each past every warm-up, seed and block start this code asks about (the
        # caller checks it from ``asked`` and ``blocks``): no branch on the data, no host int, ring columns from the
        # clock tensor, state written in place, so the step is one traceable graph (torch.compile's fast path)
        self.steady = steady
        if steady and (moved is not None or self.m != 1):
            raise ValueError("StepOps: a steady step is one bar of every symbol")
        self.asked, self.blocks = 0, set()  # the latest bar a warm-up test asked about; the block lengths used
        self.writes: list[Callable[[], object]] = []  # a steady step's state writes, done by :meth:`finish`
        self.ring_keys: set[str] = set()  # the state's rings (placed by the clock; a stream re-clocks them)
        if steady:
            self.youngest, self.common, self.first_clock = None, False, None
        else:
            self.youngest = int(age[:, 0].min()) if age.numel() else 0  # past every warm-up: masks are skipped
            self.first_clock = int(clock[:, 0].min()) if clock.numel() else 0
            # one clock: ring columns are host integers
            self.common = clock.numel() > 0 and int(clock[:, 0].max()) == self.first_clock
        self._calls = 0
        self._columns: dict[tuple, Tensor] = {}  # ring columns per (width, offset), shared by the call sites
        self._common_columns = {} if columns is None else columns  # index tensors by (width, column): a stream keeps them
        self._clock0 = clock[:, :1]

    def finish(self) -> None:
        """Write a steady step's new state (after every read of the old, which no column read after a write of the
        same step needs: a bar's reads are of other columns or before its own write)."""
        for write in self.writes:
            write()
        self.writes.clear()

    # -- the carried state ------------------------------------------------------------------------------------------
    def _slot(self, kind: str) -> str:
        """The next call site's state prefix (call order; the kind guards against a changed feature list)."""
        self._calls += 1
        return f"op{self._calls - 1:03d}.{kind}"

    def _get(self, slot: str, field: str, init: Callable[[], Tensor]) -> Tensor:
        key = f"{slot}.{field}"
        if key not in self.state:
            self.state[key] = init()
        return self.state[key]

    def _put(self, slot: str, field: str, value: Tensor) -> None:
        key = f"{slot}.{field}"
        if self.steady:  # in place, at the step's end (a traced step mutates its inputs, it returns no new state)
            target, value = self.state[key], value.clone()  # a copy: the caller may change ``value`` in place
            self.writes.append(lambda: target.copy_(value))
            return
        value = value.clone(memory_format=torch.contiguous_format)  # never a view of a tensor the caller changes
        if self.moved is not None:
            old = self.state[key]
            value = torch.where(self.moved.view(-1, *([1] * (value.ndim - 1))), value, old)
        self.state[key] = value

    def _get_ring(self, slot: str, field: str, x: Tensor, w: int, fill: float) -> Tensor:
        """The ring ``slot.field`` [S, w] (made by :meth:`_new_ring` the first time), noted in ``ring_keys``."""
        self.ring_keys.add(f"{slot}.{field}")
        return self._get(slot, field, lambda: self._new_ring(x, w, fill))

    def _new_ring(self, x: Tensor, w: int, fill: float) -> Tensor:
        """[S, w] stored time-major (one bar's column of all symbols contiguous): a bar reads and writes S adjacent
        numbers, not one per symbol's row across the whole state."""
        return x.new_full((w, self.S), fill).T

    def _column(self, w: int, offset: int = 0) -> Tensor:
        """[S, 1]: each symbol's ring column of its bar's clock + offset (a ring of w keeps clock c at column c % w)."""
        if self.common:  # every symbol at one clock: one column, an index built once per stream
            c = (self.first_clock + offset) % w
            col = self._common_columns.get((w, c))
            if col is None:
                col = self._common_columns[(w, c)] = torch.full(
                    (1, 1), c, dtype=torch.int64, device=self.age.device).expand(self.S, 1)
            return col
        col = self._columns.get((w, offset))
        if col is None:
            col = self._columns[(w, offset)] = torch.remainder(self._clock0 + offset, w)
        return col

    def _ring(self, x: Tensor, w: int, fill: float = NAN, slot: str | None = None) -> Tensor:
        """[S, w + m]: the last w inputs before this chunk (``fill`` before a symbol's first bar), then x.

        The ring is circular (clock c at column c % w): one bar moves one column in place, not the whole ring."""
        if w == 0:
            return x
        slot = slot or self._slot("ring")
        ring = self._get_ring(slot, "last", x, w, fill)
        xx = x if x.shape[0] == self.S else x.expand(self.S, self.m)
        if self.common:  # the ring from its oldest column (clock - w), in two slices
            c = self.first_clock % w
            ext = torch.cat((ring[:, c:], ring[:, :c], xx) if c else (ring, xx), dim=1)
        else:
            ext = torch.cat((ring.gather(1, self._order(w)), xx), dim=1)
        self._store(ring, w, ext[:, -min(w, self.m):])
        return ext

    def _ring_t(self, x: Tensor, w: int) -> Tensor:
        """One bar (m == 1): [w + 1, S], the last w inputs and x, time along the first axis (the rings' own layout:
        unrolled by contiguous blocks)."""
        ring = self._get_ring(self._slot("ring"), "last", x, w, NAN)
        xx = x if x.shape[0] == self.S else x.expand(self.S, 1)
        if self.common:
            c, stored = self.first_clock % w, ring.T
            ext = torch.cat((stored[c:], stored[:c], xx.T) if c else (stored, xx.T), dim=0)
        else:
            ext = torch.cat((ring.gather(1, self._order(w)).T, xx.T), dim=0)
        self._store(ring, w, xx)
        return ext

    def _order(self, w: int) -> Tensor:
        """[S, w]: the ring columns of clocks c - w ... c - 1 (the last w bars), in time order."""
        order = self._columns.get((w, "order"))
        if order is None:
            order = self._columns[(w, "order")] = torch.remainder(self._clock0 + torch.arange(w, device=self.age.device), w)
        return order

    def _lag(self, x: Tensor, w: int, fill: float = NAN) -> Tensor:
        """x[t - w] over the chunk (``fill`` before a symbol's bar w): one column of the ring read, one written."""
        if self.m > 1:
            return self._ring(x, w, fill)[:, : self.m]
        ring = self._get_ring(self._slot("ring"), "last", x, w, fill)
        col = self._column(w)
        old = ring.gather(1, col)
        self._store(ring, w, x if x.shape[0] == self.S else x.expand(self.S, 1), old)
        return old

    def _store(self, ring: Tensor, w: int, new: Tensor, old: Tensor | None = None) -> None:
        """Write the chunk's last bars ``new`` [S, j] (j <= w) into the ring in place, where ``moved``."""
        j = new.shape[1]
        cols = self._column(w) if j == 1 else torch.remainder(
            self._clock0 + (self.m - j) + torch.arange(j, device=self.age.device), w)
        if self.moved is not None:
            new = torch.where(self.moved[:, None], new, ring.gather(1, cols) if old is None else old)
        if self.steady:  # at the step's end, as an index_put_: inductor then writes the ring in place (a scatter_,
            # or a write before the last read of the ring, makes it copy the whole ring)
            rows, new = self._symbols(), new[:, 0].clone()
            self.writes.append(lambda: ring.index_put_((rows, cols[:, 0]), new))
            return
        ring.scatter_(1, cols, new)

    def _symbols(self) -> Tensor:
        """[S]: 0 .. S - 1 (each symbol's row), built once per step."""
        rows = self._columns.get("symbols")
        if rows is None:
            rows = self._columns["symbols"] = torch.arange(self.S, device=self.age.device)
        return rows

    def _before(self, a: int) -> Tensor:
        return self.age < a

    def _all_past(self, a: int) -> bool:
        """Whether every bar of the chunk is at or after each symbol's bar a (no warm-up mask to apply)."""
        self.asked = max(self.asked, a)
        return self.steady or self.youngest >= a

    # -- warm-up and positions --------------------------------------------------------------------------------------
    def nans(self, x: Tensor, defined_from: int | None = None, out: Tensor | None = None) -> Tensor:
        """NaN before ``defined_from`` (everywhere when None), as ops.nans."""
        y = x.new_full((self.S, self.m), NAN) if defined_from is None else self.blank(x.clone(), defined_from)
        return y if out is None else out.copy_(y)

    def blank(self, x: Tensor, a: int) -> Tensor:
        """NaN on each symbol's first ``a`` bars, in place."""
        return x if self._all_past(a) else x.masked_fill_(self._before(a), NAN)

    def fill_before(self, x: Tensor, a: int, value: Tensor) -> Tensor:
        """``value`` on each symbol's first ``a`` bars, in place."""
        return x if self._all_past(a) else x.copy_(torch.where(self._before(a), value, x))

    def first(self, x: Tensor) -> Tensor:
        """Each symbol's first value of x, [S, 1]."""
        slot = self._slot("first")
        v = self._get(slot, "value", lambda: x.new_full((self.S, 1), NAN))
        if self.steady:  # every symbol is past its first bar
            return v
        v = torch.where(self.age[:, :1] == 0, x[:, :1], v)
        self._put(slot, "value", v)
        return v

    # -- shifts and differences (bit for bit) -----------------------------------------------------------------------
    def shift(self, x: Tensor, k: int, fill: float = NAN) -> Tensor:
        """x[t - k], ``fill`` before a symbol's bar k."""
        if k <= 0:
            raise ValueError(f"shift: k must be positive (a look-back), got {k}")
        return self._lag(x, k, fill)

    def diff(self, x: Tensor, k: int = 1, out: Tensor | None = None) -> Tensor:
        y = self.blank(x - self.shift(x, k), k)
        return y if out is None else out.copy_(y)

    def lag_diff_times(self, x: Tensor, k: int, c: Tensor, out: Tensor | None = None) -> Tensor:
        y = self.blank(torch.mul(x - self.shift(x, k), c), k)
        return y if out is None else out.copy_(y)

    def pct_change(self, x: Tensor, k: int, out: Tensor | None = None) -> Tensor:
        y = self.blank(torch.mul(x / self.shift(x, k) - 1.0, 100.0), k)
        return y if out is None else out.copy_(y)

    # -- running and window sums (bit for bit) ----------------------------------------------------------------------
    def cumsum(self, x: Tensor) -> Tensor:
        """Running sum from each symbol's first bar: torch's sequential CPU sum carried on from the total."""
        slot = self._slot("cumsum")
        total = self._get(slot, "total", lambda: x.new_zeros((self.S, 1)))
        cs = total + x if self.m == 1 else torch.cumsum(torch.cat((total, x), dim=1), dim=1)[:, 1:]
        self._put(slot, "total", cs[:, -1:])
        return cs

    def _window_sum(self, cs: Tensor, n: int, a: int) -> Tensor:
        """cs[t] - cs[t - n] (0 before the first bar), NaN before bar a."""
        return self.blank(cs - self._lag(cs, n, 0.0), a)

    def rolling_sum(self, x: Tensor, n: int, start: int = 0) -> Tensor:
        if n < 1:
            raise ValueError(f"window must be >= 1, got {n}")
        xs = x if self._all_past(start) else x.masked_fill(self._before(start), 0.0)
        return self._window_sum(self.cumsum(xs), n, start + n - 1)

    def rolling_mean(self, x: Tensor, n: int, start: int = 0) -> Tensor:
        if n > 4:
            return self.rolling_sum(x, n, start).div_(n)
        ext = self._ring(x, n - 1)
        acc = x.clone()
        for k in range(1, n):
            acc += ext[:, n - 1 - k : n - 1 - k + self.m]
        acc /= n
        return self.blank(acc, start + n - 1)

    def Prefix(self, x: Tensor, start: int = 0, squares: bool = False) -> StepPrefix:  # noqa: N802 (ops.Prefix's name)
        return StepPrefix(self, x, start, squares)

    def BlockPrefix(  # noqa: N802 (ops.BlockPrefix's name)
        self, x: Tensor, max_window: int, start: int = 0, squares: bool = False
    ) -> StepBlockPrefix:
        return StepBlockPrefix(self, x, max_window, start, squares)

    # -- extrema and window loops (bit for bit: the batch function on the ring) -------------------------------------
    def _on_window(self, fn: Callable[[Tensor], Tensor], x: Tensor, w: int, a: int) -> Tensor:
        """fn of the last w - 1 bars and this chunk, cut to the chunk, NaN before bar a."""
        return self.blank(fn(self._ring(x, w - 1))[:, w - 1 :].clone(), a)

    def _extreme(self, x: Tensor, n: int, highest: bool) -> Tensor:
        """One bar's extreme of its window: the ring's (in any order) and the bar's own (exact, as the doubling)."""
        ring = self._get_ring(self._slot("ring"), "last", x, n - 1, NAN)
        xx = x if x.shape[0] == self.S else x.expand(self.S, 1)
        y = (torch.maximum if highest else torch.minimum)(
            (ring.amax if highest else ring.amin)(dim=1, keepdim=True), xx)
        self._store(ring, n - 1, xx)
        return self.blank(y, n - 1)

    def rolling_max(self, x: Tensor, n: int) -> Tensor:
        if self.m == 1 and n > 1:
            return self._extreme(x, n, True)
        return self._on_window(lambda e: ops.rolling_max(e, n), x, n, n - 1)

    def rolling_min(self, x: Tensor, n: int) -> Tensor:
        if self.m == 1 and n > 1:
            return self._extreme(x, n, False)
        return self._on_window(lambda e: ops.rolling_min(e, n), x, n, n - 1)

    def bars_since_extreme(self, x: Tensor, n: int, highest: bool) -> Tensor:
        if self.m == 1:  # one bar: the latest bar holding the window's extreme (ties to the latest, as the doubling;
            # a NaN counts as the extreme, as argmax's); reductions over time, not an argmax across the rings' layout
            ext = self._ring_t(x, n)  # [n + 1, S]: bars t - n ... t
            hit = (ext == (ext.amax if highest else ext.amin)(dim=0, keepdim=True)).logical_or_(ext != ext)
            rows = self._common_columns.get(("rows", n + 1))
            if rows is None:
                rows = self._common_columns[("rows", n + 1)] = torch.arange(
                    n + 1, dtype=x.dtype, device=x.device)[:, None]
            latest = torch.where(hit, rows, -1.0).amax(dim=0, keepdim=True)
            return self.blank(latest.T.neg_().add_(n), n)
        return self._on_window(lambda e: ops.bars_since_extreme(e, n, highest), x, n + 1, n)

    def aroon_line(self, x: Tensor, n: int, highest: bool) -> Tensor:
        return self.bars_since_extreme(x, n, highest).neg_().add_(n).mul_(100.0 / n)

    def mean_abs_deviation(self, x: Tensor, dev: Tensor, n: int, scale: float = 1.0) -> Tensor:
        if self.m == 1 and n > 1:  # one bar: the n terms at once, summed in the batch loop's order (k = 0, 1, ...)
            ext, dt = self._ring_t(x, n - 1), dev.T
            terms = torch.cat((torch.abs(dt), (ext[: n - 1] - x.T).add_(dt).abs_().flip(0)), dim=0)
            return self.blank(torch.cumsum(terms, dim=0)[-1:].T.mul_(scale / n), n - 1)
        ext = self._ring(x, n - 1)
        acc = torch.abs(dev)
        for k in range(1, n):
            acc += (ext[:, n - 1 - k : n - 1 - k + self.m] - x).add_(dev).abs_()
        return self.blank(acc.mul_(scale / n), n - 1)

    # -- recursive filters (the recurrence, stepped) ----------------------------------------------------------------
    def _scan(self, c: float | Tensor, u: Tensor, s: int, seed: Callable[[], Tensor | float]) -> Tensor:
        """NaN before bar s, seed() at s, then y[t] = c[t] y[t-1] + u[t]."""
        slot = self._slot("scan")
        y0 = self._get(slot, "y", lambda: u.new_zeros((self.S, 1)))
        if self._all_past(s + 1):  # past the seed everywhere: the recurrence alone
            y = c * y0 + u if self.m == 1 else ops.affine_scan(
                u.new_full((self.S, self.m), c) if isinstance(c, float) else c, u, y0[:, 0])
            self._put(slot, "y", y if self.m == 1 else y[:, -1:])
            return y
        upto = self.age <= s
        cc = u.new_full((self.S, self.m), c) if isinstance(c, float) else c.clone()
        cc.masked_fill_(upto, 0.0)
        uu = u.masked_fill(upto, 0.0)
        at = self.age == s
        if bool(at.any()):
            sv = seed()
            sv = sv if isinstance(sv, Tensor) else torch.as_tensor(sv, dtype=u.dtype, device=u.device)
            uu = torch.where(at, sv.expand_as(uu), uu)
        y = cc * y0 + uu if self.m == 1 else ops.affine_scan(cc, uu, y0[:, 0])
        self._put(slot, "y", y[:, -1:])
        return self.blank(y, s)

    def _seed_ring(self, x: Tensor, w: int, s: int) -> Tensor:
        """The last w - 1 bars and the chunk, for a seed at bar s; once every symbol is past s the ring no longer
        moves (it is never read again: a restored stream skips it alike)."""
        slot = self._slot("seed")
        if w <= 1:
            return x
        if self._all_past(s + 1):
            self._get_ring(slot, "last", x, w - 1, NAN)
            return x  # never read
        return self._ring(x, w - 1, slot=slot)

    def _seed_window(self, x: Tensor, w: int, s: int, reduce: Callable[[Tensor], Tensor]) -> Callable[[], Tensor]:
        """The reduction over the last w bars at every bar of the chunk, computed only when asked (at a seeding bar)."""
        ext = self._seed_ring(x, w, s)
        return lambda: reduce(ext.unfold(1, w, 1))

    def seeded_scan(self, x: Tensor, s: int, y0: Tensor | float, a: float, b: float) -> Tensor:
        seed = y0[:, None] if isinstance(y0, Tensor) else float(y0)
        return self._scan(a, b * x, s, lambda: seed)

    def ema(self, x: Tensor, n: int | None = None, start: int = 0, alpha: float | None = None,
            seed: str = "sma") -> Tensor:
        if alpha is None:
            alpha = 2.0 / (n + 1)
        if seed not in ("sma", "first"):
            raise ValueError(f"unknown EMA seeding {seed!r}")
        if seed == "sma":
            s = start + n - 1
            return self._scan(1.0 - alpha, alpha * x, s, self._seed_window(x, n, s, lambda w: w.mean(dim=-1)))
        return self._scan(1.0 - alpha, alpha * x, start, lambda: x)

    def ema_distance(self, x: Tensor, dx: Tensor, n: int, start: int = 0) -> Tensor:
        a, s = 1.0 - 2.0 / (n + 1), start + n - 1
        ext = self._seed_ring(x, n, s)
        return self._scan(a, a * dx, s, lambda: (ext.unfold(1, n, 1) - x[..., None]).mean(dim=-1).neg_())

    def wilder(self, x: Tensor, n: int, start: int = 0) -> Tensor:
        return self.ema(x, n, start, alpha=1.0 / n)

    def wilder_sum(self, x: Tensor, n: int, start: int = 0) -> Tensor:
        if n < 2:
            return self.nans(x)
        s = start + n - 2
        return self._scan(1.0 - 1.0 / n, 1.0 * x, s, self._seed_window(x, n - 1, s, lambda w: w.sum(dim=-1)))

    def seeded_recurrence(self, a: Tensor, b: Tensor, seed: Tensor, s: int, a_min: float) -> Tensor:
        return self._scan(a, b, s, lambda: seed)


class StepPrefix:
    """ops.Prefix stepped: running sums of x (and x^2) from ``start`` carried on, and a ring of them per window."""

    def __init__(self, step: StepOps, x: Tensor, start: int, squares: bool) -> None:
        self.step, self.start = step, start
        xs = x if step._all_past(start) else x.masked_fill(step._before(start), 0.0)
        self.cs = step.cumsum(xs)
        self.cs2 = step.cumsum(xs * xs) if squares else None

    def sum(self, n: int, squares: bool = False) -> Tensor:
        cs = self.cs2 if squares else self.cs
        if cs is None:
            raise ValueError("Prefix built without squares")
        return self.step._window_sum(cs, n, self.start + n - 1)

    def mean_var(self, n: int) -> tuple[Tensor, Tensor]:
        mean = self.sum(n).div_(n)
        return mean, self.sum(n, squares=True).div_(n).sub_(mean * mean).clamp_(min=0.0)

    def std(self, n: int) -> Tensor:
        return self.mean_var(n)[1].sqrt_()


class StepBlockPrefix:
    """ops.BlockPrefix stepped bit for bit: the same blocks of ``block`` bars from each symbol's first bar, each
    centred on its first value, whose running sums (over the block and the max_window - 1 bars before it) carry on
    from a circular ring of their last max_window + 1 values; a new block starts them again from the raw bars kept in
    a ring. One bar inside a block reads and writes one column of each ring."""

    def __init__(self, step: StepOps, x: Tensor, max_window: int, start: int = 0, squares: bool = False,
                 block: int = 512) -> None:
        if start != 0:
            raise ValueError("the stepping BlockPrefix takes start=0 only")
        W, B = max_window, max(block, max_window)
        S, m = step.S, step.m
        self.step, self.W, self.x = step, W, x
        slot = step._slot("block_prefix")
        raw = step._get_ring(slot, "last", x, W - 1, NAN)
        ref = step._get(slot, "ref", lambda: x.new_zeros((S, 1)))
        self.rings = [step._get_ring(slot, "cs", x, W + 1, 0.0)]
        if squares:
            self.rings.append(step._get_ring(slot, "cs2", x, W + 1, 0.0))
        step.blocks.add(B)
        begins = step.age % B == 0  # a symbol's new block starts at this bar
        if m == 1 and (step.steady or not bool(begins.any())):  # one bar inside every symbol's block: running sums carried on
            d = x - ref
            last = step._column(W + 1, -1)
            self.ref, self.news = ref, []
            for ring, dd in zip(self.rings, (d, d * d), strict=False):
                new = ring.gather(1, last) + dd
                step._store(ring, W + 1, new)
                self.news.append(new)
            if W > 1:
                step._store(raw, W - 1, x)
            self.parts = None
            return
        raw_c = raw.gather(1, step._order(W - 1)) if W > 1 else raw  # in time order
        rings = [r.gather(1, step._order(W + 1))[:, 1:] for r in self.rings]
        cuts = [0, *(i for i in range(1, m) if bool(begins[:, i].any())), m]
        self.parts: list[tuple[Tensor, list[Tensor]]] | None = []  # per piece: its centre [S, 1], its sums [S, W + k]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            xs, new = x[:, a:b], begins[:, a]
            if bool(new.any()):
                ref = torch.where(new[:, None], xs[:, :1], ref)
                d0 = raw_c - ref  # the bars before the block, centred on its first value (none before a first bar)
                fresh = (step.age[:, a] == 0)[:, None]
                for i, dd in enumerate((d0, d0 * d0)[: len(rings)]):
                    restart = torch.cumsum(torch.cat((dd.new_zeros((S, 1)), dd), dim=1), dim=1).masked_fill_(fresh, 0.0)
                    rings[i] = torch.where(new[:, None], restart, rings[i])
            d = xs - ref
            exts = []
            for i, dd in enumerate((d, d * d)[: len(rings)]):
                ext = torch.cat((rings[i], torch.cumsum(torch.cat((rings[i][:, -1:], dd), dim=1), dim=1)[:, 1:]), dim=1)
                rings[i] = ext[:, -W:]
                exts.append(ext)
            raw_c = torch.cat((raw_c, xs), dim=1)[:, -(W - 1) :] if W > 1 else raw_c
            self.parts.append((ref, exts))
        if W > 1:
            step._store(raw, W - 1, raw_c)
        step._put(slot, "ref", ref)
        for ring, ext in zip(self.rings, self.parts[-1][1], strict=True):
            step._store(ring, W + 1, ext[:, -(W + 1) :])

    def _each(self, n: int, fn: Callable[[Tensor, Tensor, Tensor, slice], Tensor]) -> Tensor:
        """fn(ref, hi - lo, (hi - lo) of the squares or None, the piece's bars) over the pieces, joined, NaN before
        bar n - 1."""
        if n > self.W:
            raise ValueError(f"window {n} exceeds this prefix's max_window {self.W}")
        if self.parts is None:  # one bar: lo is the ring's column of bar t - n (bar t's own was just written)
            lo = self.step._column(self.W + 1, -n)
            sums = [new - ring.gather(1, lo) for new, ring in zip(self.news, self.rings, strict=True)]
            return self.step.blank(fn(self.ref, sums[0], sums[1] if len(sums) > 1 else None, slice(0, 1)), n - 1)
        W, out, at = self.W, [], 0
        for ref, exts in self.parts:
            k = exts[0].shape[1] - W
            sums = [e[:, W:] - e[:, W - n : W - n + k] for e in exts]
            out.append(fn(ref, sums[0], sums[1] if len(sums) > 1 else None, slice(at, at + k)))
            at += k
        return self.step.blank(out[0] if len(out) == 1 else torch.cat(out, dim=1), n - 1)

    def sum(self, n: int) -> Tensor:
        return self._each(n, lambda r, s1, s2, bars: s1 + n * r)

    def mean(self, n: int) -> Tensor:
        return self._each(n, lambda r, s1, s2, bars: s1 / n + r)

    def deviation(self, y: Tensor, n: int) -> Tensor:
        return self._each(n, lambda r, s1, s2, bars: (y[:, bars] - r).sub_(s1.div_(n)))

    def mean_var(self, n: int) -> tuple[Tensor, Tensor]:
        if len(self.rings) < 2:
            raise ValueError("BlockPrefix built without squares")
        mean = self._each(n, lambda r, s1, s2, bars: s1 / n + r)
        var = self._each(n, lambda r, s1, s2, bars: torch.clamp_min(s2 / n - (s1 / n) * (s1 / n), 0.0))
        return mean, var

    def mean_std(self, n: int, k: float = 1.0) -> tuple[Tensor, Tensor]:
        m, var = self.mean_var(n)
        return m, torch.sqrt(var) * k
