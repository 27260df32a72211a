"""Causal building blocks on [S, T] float64 tensors (one row per symbol, time on the last axis), on any device.

Every feature is written once, against these primitives, in plain torch ops written for a GPU (no loop over bars, no
host synchronisation on data); the same code runs on a CPU. Recursive filters are blocked scans (fixed block offsets
from the first bar, so bar t never depends on later bars) whose block carries are solved by a doubling
(Hillis-Steele) scan over the blocks; rolling sums are differences of prefix sums (centred inside blocks for price
levels); rolling extrema and arg-extrema use doubling. NaN marks bars before an indicator is defined; TA-Lib's seeding
and look-backs are kept. A primitive given ``out`` (a feature's row of the float32 output) writes its last step there:
the float64 result rounded once, with no full-size temporary.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

NAN = float("nan")


def nans(x: Tensor, defined_from: int | None = None, out: Tensor | None = None) -> Tensor:
    """A float64 tensor shaped like x (or ``out``), NaN on every bar, or only before bar ``defined_from`` when the
    caller writes every later bar itself (no pass over memory it will overwrite)."""
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    out[..., : x.shape[-1] if defined_from is None else max(0, defined_from)] = NAN
    return out


def rows(y0: Tensor | float, x: Tensor) -> Tensor:
    """y0 as one float64 value per row of x (a tensor [S] on x's device)."""
    y0 = torch.as_tensor(y0, dtype=x.dtype, device=x.device)
    return y0.expand(x.shape[0]) if y0.ndim == 0 else y0


def pad_right(x: Tensor, k: int, value: float = 0.0) -> Tensor:
    """x followed by k bars of ``value`` on the last axis (a copy; faster than ``F.pad`` on CPU)."""
    T = x.shape[-1]
    out = x.new_empty(x.shape[:-1] + (T + k,))
    out[..., :T] = x
    out[..., T:] = value
    return out


def cumsum(x: Tensor, block: int = 4096) -> Tensor:
    """Running sum along the last axis; on CUDA, several rows longer than ``block`` take :func:`blocked_cumsum`.

    torch scans a lone row with CUB but each row of a 2-D tensor within one thread block, chunk after chunk,
    which leaves a GPU nearly idle for a few long symbols.
    """
    if x.is_cuda and x.shape[-1] > block and x.numel() != x.shape[-1]:
        return blocked_cumsum(x, block)
    return torch.cumsum(x, dim=-1)


def blocked_cumsum(x: Tensor, block: int = 4096) -> Tensor:
    """Running sum along the last axis as a two-level scan: running sums inside fixed blocks of ``block`` bars
    plus the running sum of the block totals before each block (causal: the blocks do not depend on the data)."""
    T = x.shape[-1]
    nb = -(-T // block)
    lead = x.shape[:-1]
    inner = torch.cumsum(pad_right(x, nb * block - T).view(*lead, nb, block), dim=-1)
    carry = torch.cumsum(inner[..., -1], dim=-1)  # sums up to each block's end
    inner[..., 1:, :] += carry[..., :-1, None]
    return inner.view(*lead, nb * block)[..., :T]


def blank(x: Tensor, a: int) -> Tensor:
    """x with each symbol's first ``a`` bars set to NaN (in place; a feature reported from a later bar than its parts)."""
    x[..., : max(0, a)] = NAN
    return x


def fill_before(x: Tensor, a: int, value: Tensor) -> Tensor:
    """x with each symbol's first ``a`` bars taken from ``value`` (a tensor shaped like x), in place."""
    x[..., :a] = value[..., :a]
    return x


def first(x: Tensor) -> Tensor:
    """Each symbol's first value of x, [S, 1] (a past value for every bar: a centre for prefix sums)."""
    return x[..., :1]


def mean_abs_deviation(x: Tensor, dev: Tensor, n: int, scale: float = 1.0) -> Tensor:
    """scale times the mean over the last n bars of |x[t-k] - m[t]| (k = 0..n-1) for a centre m = x - dev, taken as
    |(x[t-k] - x[t]) + dev[t]| (rounding relative to the deviations, not the level): a loop over the window's n
    offsets, not over bars."""
    T, a = x.shape[-1], n - 1
    md = nans(x, a)
    if a < T:
        now, d, acc = x[..., a:], dev[..., a:], md[..., a:]
        torch.abs(d, out=acc)
        for k in range(1, n):
            acc += (x[..., a - k : T - k] - now).add_(d).abs_()
    return md.mul_(scale / n)


def shift(x: Tensor, k: int, fill: float = NAN) -> Tensor:
    """x[t - k] (k > 0 looks back), padded with ``fill``."""
    if k <= 0:
        raise ValueError(f"shift: k must be positive (a look-back), got {k}")
    out = torch.empty_like(x)
    out[..., :k] = fill
    if k < x.shape[-1]:
        out[..., k:] = x[..., :-k]
    return out


def diff(x: Tensor, k: int = 1, out: Tensor | None = None) -> Tensor:
    """x[t] - x[t - k], NaN for the first k bars, into ``out`` when given (which may be float32: one rounding)."""
    out = nans(x, k, out)
    if k < x.shape[-1]:
        torch.sub(x[..., k:], x[..., :-k], out=out[..., k:])
    return out


def diff_times(a: Tensor, b: Tensor, c: Tensor, out: Tensor | None = None) -> Tensor:
    """(a - b) * c (distances in ATR units), into ``out`` when given."""
    return torch.mul(a - b, c, out=out)


def lag_diff_times(x: Tensor, k: int, c: Tensor, out: Tensor | None = None) -> Tensor:
    """(x[t] - x[t-k]) * c[t], NaN for the first k bars, into ``out`` when given."""
    out = nans(x, k, out)
    if k < x.shape[-1]:
        torch.mul(x[..., k:] - x[..., :-k], c[..., k:], out=out[..., k:])
    return out


def pct_change(x: Tensor, k: int, out: Tensor | None = None) -> Tensor:
    """100 (x[t] / x[t-k] - 1), NaN for the first k bars (TA-Lib ROC), into ``out`` when given."""
    out = nans(x, k, out)
    if k < x.shape[-1]:
        torch.mul(x[..., k:] / x[..., :-k] - 1.0, 100.0, out=out[..., k:])
    return out


def multiply(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a * b, into ``out`` when given."""
    return torch.mul(a, b, out=out)


def log_ratio(num: Tensor, den: Tensor, out: Tensor | None = None, floor: float | None = None) -> Tensor:
    """ln(num / den), into ``out`` when given. With ``floor``: ln(max(num / den, floor)), 0 where den is 0, for ratios
    of quantities that can be 0 (a volatility over a flat stretch), finite instead of -inf (num 0) or NaN (both 0)."""
    if floor is None:
        q = num / den
    else:  # NaN (warm-up) stays NaN
        q = safe_div(num, den, 1.0).clamp_(min=floor)
    return torch.log(q, out=out)


def safe_div(num: Tensor, den: Tensor, fill: float = 0.0, scale: float = 1.0, out: Tensor | None = None) -> Tensor:
    """scale * num / den with ``fill`` where den is 0 (TA-Lib's convention for flat ranges), into ``out`` when given
    (which may be num or den)."""
    zero = den == 0
    q = torch.div(num if scale == 1.0 else scale * num, den, out=out)
    return q.masked_fill_(zero, fill)


def difference_ratio(a: Tensor, b: Tensor, c: Tensor, d: Tensor, scale: float = 1.0,
                     out: Tensor | None = None) -> Tensor:
    """scale (a - b) / (c - d), 0 where c == d (e.g. a window sum's ratio to another's, or a distance over a high-low
    range), into ``out`` when given."""
    return safe_div(a - b, c - d, scale=scale, out=out)


def rolling_sum(x: Tensor, n: int, start: int = 0) -> Tensor:
    """Sum of x[t-n+1..t] as a difference of prefix sums; defined from t = start + n - 1 (x valid from ``start``)."""
    if n < 1:
        raise ValueError(f"window must be >= 1, got {n}")
    T = x.shape[-1]
    out = nans(x, start + n - 1)
    if T < start + n:
        return out
    cs = cumsum(x[..., start:])
    out[..., start + n - 1] = cs[..., n - 1]
    torch.sub(cs[..., n:], cs[..., :-n], out=out[..., start + n :])
    return out


def rolling_mean(x: Tensor, n: int, start: int = 0) -> Tensor:
    """TA-Lib SMA of a series near zero or of a small window (up to 4 bars: shifted adds, exact as numpy's)."""
    if n > 4:
        return rolling_sum(x, n, start).div_(n)
    T = x.shape[-1]
    a = start + n - 1
    out = nans(x, a)
    if a < T:
        acc = out[..., a:].copy_(x[..., a:])
        for k in range(1, n):
            acc += x[..., a - k : T - k]
        acc /= n
    return out


class Prefix:
    """Prefix sums of x (and x^2) from ``start``, shared by every window length over the same series near zero.

    Rounding error is relative to the running total: use :class:`BlockPrefix` for price levels.
    """

    def __init__(self, x: Tensor, start: int = 0, squares: bool = False) -> None:
        self.shape, self.start = tuple(x.shape), start
        xs = x[..., start:]
        self.cs = _running_sum0(xs)  # cs[:, k] = sum of the first k values
        self.cs2 = _running_sum0(xs * xs) if squares else None

    def parts(self, n: int, at: int, squares: bool = False) -> tuple[Tensor, Tensor]:
        """Views (hi, lo) aligned with bars at.. (at >= start + n - 1): the window sum over n bars is hi - lo."""
        cs = self.cs2 if squares else self.cs
        if cs is None:
            raise ValueError("Prefix built without squares")
        k = at - self.start + 1
        return cs[..., k:], cs[..., k - n : cs.shape[-1] - n]

    def sum(self, n: int, squares: bool = False) -> Tensor:
        """Sum of x[t-n+1..t] (of x^2 with ``squares``); NaN before start + n - 1."""
        a = self.start + n - 1
        out = self.cs.new_empty(self.shape)
        out[..., :a] = NAN
        if a < self.shape[-1]:
            torch.sub(*self.parts(n, a, squares), out=out[..., a:])
        return out

    def mean_var(self, n: int) -> tuple[Tensor, Tensor]:
        """Rolling mean and population variance over n bars."""
        mean = self.sum(n).div_(n)
        return mean, self.sum(n, squares=True).div_(n).sub_(mean * mean).clamp_(min=0.0)

    def std(self, n: int) -> Tensor:
        """Rolling population standard deviation over n bars (the root of :meth:`mean_var`'s variance)."""
        return self.mean_var(n)[1].sqrt_()


def _running_sum0(x: Tensor) -> Tensor:
    """Running sums of x along the last axis after a leading 0 (so a window sum is always one subtraction)."""
    out = x.new_empty(tuple(x.shape[:-1]) + (x.shape[-1] + 1,))
    out[..., 0] = 0.0
    out[..., 1:] = cumsum(x)
    return out


class BlockPrefix:
    """Prefix sums of x - r (and (x - r)^2) inside blocks, for windows up to ``max_window`` bars of a price level.

    Each block of ``block`` output bars carries the max_window - 1 bars before it and is centred on r, x at
    the block's first output bar (a past value for every bar of the block): rounding error scales with the
    local spread of x, not with its level times the series length, and a sum at t depends only on bars <= t.

    ``finite=True`` (the rolling moments of ``foxhunt.preprocessing``; any float dtype, torch only): values that are
    not finite add nothing and are counted out (:meth:`moments`), a block is centred on the last finite value at or
    before its first output bar (0 if there is none), and autograd can differentiate everything in x.
    """

    def __init__(self, x: Tensor, max_window: int, start: int = 0, squares: bool = False, block: int = 512,
                 finite: bool = False) -> None:
        S, T = x.shape
        W, B = max_window, max(block, max_window)
        nb = max(1, -(-T // B))
        self.shape, self.start, self.W, self.B, self.nb = (S, T), start, W, B, nb
        if finite:
            ok = torch.isfinite(x)
            ok[:, :start] = False
            x = torch.where(ok, x, torch.zeros_like(x))
        xp = x.new_zeros((S, W - 1 + nb * B))
        xp[:, W - 1 + start : W - 1 + T] = x[:, start:]
        view = xp.unfold(-1, B + W - 1, B)  # [S, nb, B + W - 1], block j's bars j B - W + 1 .. (j + 1) B - 1
        d = x.new_zeros((S, nb, B + W))
        if finite:
            okp = torch.zeros(xp.shape, dtype=torch.bool, device=x.device)
            okp[:, W - 1 :][:, :T] = ok
            okv = okp.unfold(-1, B + W - 1, B)
            self.ref = _last_finite_at(x.detach(), ok, B, nb)[:, :, None]  # [S, nb, 1]
            d[:, :, 1:] = torch.where(okv, view - self.ref, torch.zeros_like(view))
            self.cf = torch.cumsum(torch.cat((okv.new_zeros((S, nb, 1)), okv), dim=-1).to(x.dtype), dim=-1)
        else:
            self.cf = None
            self.ref = view[:, :, W - 1 : W].clone()  # [S, nb, 1]
            early = min(nb, -(-start // B))  # blocks that begin before ``start``: centre on x[start] instead
            if early and start < T:
                self.ref[:, :early, 0] = x[:, start : start + 1]
            torch.sub(view, self.ref, out=d[:, :, 1:])
        for k in range(min(nb, (start + W - 1) // B + 1)):  # bars before ``start`` (and the padding) add nothing
            d[:, k, 1 : 1 + max(0, start + W - 1 - k * B)] = 0.0
        self.cs2 = torch.cumsum(d * d, dim=-1) if squares else None  # inside blocks: short rows, many of them
        self.cs = torch.cumsum(d, dim=-1)

    def _parts(self, cs: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """(hi, lo) in block layout [S, nb, B]: the window sums over n bars are hi - lo."""
        if n > self.W:
            raise ValueError(f"window {n} exceeds this prefix's max_window {self.W}")
        W, B = self.W, self.B
        return cs[:, :, W : W + B], cs[:, :, W - n : W - n + B]

    def _flat(self, w: Tensor, n: int) -> Tensor:
        """Block layout [S, nb, B] to bars [S, T], NaN before the first full window."""
        S, T = self.shape
        out = w.reshape(S, self.nb * self.B)[:, :T]
        out[:, : min(T, self.start + n - 1)] = NAN
        return out

    def sum(self, n: int) -> Tensor:
        """Sum of x[t-n+1..t]."""
        hi, lo = self._parts(self.cs, n)
        return self._flat(hi - lo + n * self.ref, n)

    def deviation(self, y: Tensor, n: int) -> Tensor:
        """y - mean of x[t-n+1..t] as (y - r) - (the window's sum of x - r) / n: rounding relative to the window's
        spread, not to the level (y: a series near x, e.g. x itself)."""
        S, T = self.shape
        hi, lo = self._parts(self.cs, n)
        yb = pad_right(y, self.nb * self.B - T).view(S, self.nb, self.B)
        return self._flat((yb - self.ref).sub_((hi - lo).div_(n)), n)

    def mean(self, n: int) -> Tensor:
        """Mean of x[t-n+1..t] (TA-Lib SMA)."""
        hi, lo = self._parts(self.cs, n)
        return self._flat((hi - lo) / n + self.ref, n)

    def mean_var(self, n: int) -> tuple[Tensor, Tensor]:
        """Rolling mean and population variance over n bars (TA-Lib SMA and VAR)."""
        if self.cs2 is None:
            raise ValueError("BlockPrefix built without squares")
        hi, lo = self._parts(self.cs, n)
        hi2, lo2 = self._parts(self.cs2, n)
        m = (hi - lo) / n
        var = torch.clamp_min((hi2 - lo2) / n - m * m, 0.0)
        return self._flat(m + self.ref, n), self._flat(var, n)

    def mean_std(self, n: int, k: float = 1.0) -> tuple[Tensor, Tensor]:
        """Rolling mean and k population standard deviations over n bars (TA-Lib SMA and k STDDEV)."""
        m, var = self.mean_var(n)
        return m, torch.sqrt(var) * k

    def moments(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Count, mean and centred sum of squares of the finite values among x[t-n+1..t], at every bar (``finite``
        and ``squares`` only): windows cut by the start are partial, an empty one has count 0, mean r and sum 0,
        so every value is finite and safe to differentiate; the caller decides from the count what is ready."""
        if self.cs2 is None or self.cf is None:
            raise ValueError("BlockPrefix.moments needs finite=True and squares=True")
        S, T = self.shape
        count, s1, s2 = (torch.sub(*self._parts(cs, n)) for cs in (self.cf, self.cs, self.cs2))
        mean_c = s1 / count.clamp_min(1)
        m2 = s2 - s1 * mean_c
        return tuple(a.reshape(S, self.nb * self.B)[:, :T] for a in (count, mean_c + self.ref, m2))


def _last_finite_at(x: Tensor, ok: Tensor, step: int, k: int) -> Tensor:
    """[S, k]: the last value of x with ``ok`` at or before bars 0, step, 2 step, ..., 0 where there is none."""
    idx = torch.arange(x.shape[1], device=x.device).expand_as(x)
    last = torch.where(ok, idx, torch.full_like(idx, -1)).cummax(dim=1).values[:, ::step][:, :k]
    return torch.where(last >= 0, x.gather(1, last.clamp_min(0)), torch.zeros_like(last, dtype=x.dtype))


def rolling_max(x: Tensor, n: int) -> Tensor:
    """Highest value of x[t-n+1..t] (doubling: ceil(log2 n) + 1 passes, exact)."""
    return _rolling_extreme(x, n, torch.maximum)


def rolling_min(x: Tensor, n: int) -> Tensor:
    """Lowest value of x[t-n+1..t]."""
    return _rolling_extreme(x, n, torch.minimum)


def _rolling_extreme(x: Tensor, n: int, op: Callable[..., Tensor]) -> Tensor:
    if n < 1:
        raise ValueError(f"window must be >= 1, got {n}")
    T = x.shape[-1]
    out = nans(x, n - 1)
    if n > T:
        return out
    m, k = x, 1  # m[t] = extreme of x[t-k+1..t] (for t >= k - 1)
    bufs = (torch.empty_like(out), torch.empty_like(out))  # ping-pong: no allocation per pass
    while 2 * k <= n:
        nxt = bufs[0] if m is not bufs[0] else bufs[1]
        nxt[..., :k] = m[..., :k]
        op(m[..., k:], m[..., :-k], out=nxt[..., k:])
        m, k = nxt, 2 * k
    # window of n = [t-n+1, t-n+k] U [t-k+1, t]
    op(m[..., n - 1 :], m[..., k - 1 : T - n + k], out=out[..., n - 1 :])
    return out


def bars_since_extreme(x: Tensor, n: int, highest: bool) -> Tensor:
    """Bars since the highest (lowest) value of x[t-n..t], n+1 bars, ties to the latest bar (TA-Lib AROON).

    Doubling on (extreme, age) pairs: when two halves tie the later one wins.
    """
    T = x.shape[-1]
    w = n + 1
    out = nans(x, w - 1)
    if w > T:
        return out
    op = torch.maximum if highest else torch.minimum
    later_of = torch.greater_equal if highest else torch.less_equal
    m, age, k = x, torch.zeros_like(out), 1  # extreme of x[t-k+1..t] and bars since it
    vals, ages = (torch.empty_like(out), torch.empty_like(out)), (torch.empty_like(out), torch.empty_like(out))
    later = torch.empty(out.shape, dtype=torch.bool, device=out.device)
    while 2 * k <= w:
        nm, na = vals[0] if m is not vals[0] else vals[1], ages[0] if age is not ages[0] else ages[1]
        nm[..., :k], na[..., :k] = m[..., :k], age[..., :k]
        _merge(m[..., k:], age[..., k:], m[..., :-k], age[..., :-k], k, op, later_of, nm[..., k:], na[..., k:], later[..., k:])
        m, age, k = nm, na, 2 * k
    # window of w = [t-w+1, t-w+k] (ends w - k bars back) U [t-k+1, t]
    a, b = slice(w - 1, None), slice(k - 1, T - w + k)
    _merge(m[..., a], age[..., a], m[..., b], age[..., b], w - k, op, later_of, None, out[..., a], later[..., a])
    return out


def aroon_line(x: Tensor, n: int, highest: bool) -> Tensor:
    """TA-Lib's Aroon up (down) line: (100 / n) (n - bars since the highest (lowest) of x[t-n..t])."""
    return bars_since_extreme(x, n, highest).neg_().add_(n).mul_(100.0 / n)


def _merge(m_new: Tensor, age_new: Tensor, m_old: Tensor, age_old: Tensor, lag: int, op: Callable[..., Tensor],
           later_of: Callable[..., Tensor],
           m_out: Tensor | None, age_out: Tensor, later: Tensor) -> None:
    """Combine a recent window's (extreme, age) with an older one's ending ``lag`` bars back; ties go to the recent.

    The combined extreme goes to ``m_out`` unless it is None (the last merge needs only the age).
    """
    later_of(m_new, m_old, out=later)
    if m_out is not None:
        op(m_new, m_old, out=m_out)
    torch.add(age_old, lag, out=age_out)  # the older window's age, seen from t
    torch.where(later, age_new, age_out, out=age_out)


def _scan_block(a: float) -> int:
    """Block length of the first-order scan: a^-B stays below 2^500, far from float64 overflow."""
    return int(min(2048, max(16, 500.0 / -math.log2(a))))


def const_scan(u: Tensor, c: float, y0: Tensor) -> Tensor:
    """y[j] = c y[j-1] + u[j] along the last axis from y[-1] = y0, a constant c (doubling: log2 passes, stops
    once c^k underflows to 0)."""
    y = u.clone()
    if y.shape[-1] == 0:
        return y
    y[..., 0] += c * y0
    ck, k, m = c, 1, y.shape[-1]
    while k < m and ck != 0.0:
        y = torch.cat((y[..., :k], torch.add(y[..., k:], y[..., :-k], alpha=ck)), dim=-1)
        ck, k = ck * ck, 2 * k
    return y


def affine_scan(c: Tensor, u: Tensor, y0: Tensor) -> Tensor:
    """y[j] = c[j] y[j-1] + u[j] along the last axis from y[-1] = y0 (Hillis-Steele doubling: log2 passes, causal)."""
    y = u.clone()
    if y.shape[-1] == 0:
        return y
    y[..., 0] += c[..., 0] * y0
    k, m = 1, y.shape[-1]
    while k < m:  # pairs (c, y) now compose the k steps ending at each bar
        y = torch.cat((y[..., :k], torch.addcmul(y[..., k:], c[..., k:], y[..., :-k])), dim=-1)
        c = torch.cat((c[..., :k], c[..., k:] * c[..., :-k]), dim=-1)
        k *= 2
    return y


def first_order(x: Tensor, a: float, b: float, y0: Tensor | float) -> Tensor:
    """y[t] = a y[t-1] + b x[t] along the last axis from y[-1] = y0 (a blocked scan).

    Inside a block of B bars y[k] = a^k (a y_in + b sum_{j<=k} a^-j x[j]) (a multiply, a running sum and a
    multiply); the block carries, y_in[j+1] = a^B y_in[j] + (block j's sum), are a doubling scan over the T / B
    blocks. Blocks start at fixed offsets from the first bar, so bar t only sees bars <= t.
    """
    S, L = x.shape
    y0 = rows(y0, x)
    if L == 0:
        return x.new_empty((S, 0))
    if not 0.01 <= a < 1.0:  # no gain from blocking: a^k vanishes within a few doublings
        return const_scan(b * x, a, y0)
    B = _scan_block(a)
    nf = -(-L // B)
    k = torch.arange(B, dtype=x.dtype, device=x.device)
    g, h = b * torch.pow(a, -k), torch.pow(a, k)
    V = pad_right(x, nf * B - L).view(S, nf, B) * g  # zeros after the last bar feed no earlier bar
    ends = const_scan(h[-1] * V.sum(dim=-1), a**B, y0)  # y at each block's end
    V[:, 0, 0] += a * y0
    V[:, 1:, 0] += a * ends[:, :-1]
    V = torch.cumsum(V, dim=-1)  # inside blocks: short rows, many of them
    V *= h
    return V.view(S, nf * B)[:, :L]


def ema(x: Tensor, n: int | None = None, start: int = 0, alpha: float | None = None, seed: str = "sma") -> Tensor:
    """Exponential moving average as TA-Lib computes it.

    x is valid from ``start``; seeded at ``start + n - 1`` with the mean of the first n valid values (TA-Lib's
    default seeding), then y[t] = y[t-1] + alpha (x[t] - y[t-1]), alpha = 2 / (n + 1) unless given (Wilder
    smoothing: alpha = 1 / n); ``seed="first"`` seeds with x[start] instead (TA-Lib's ADOSC).
    """
    if alpha is None:
        alpha = 2.0 / (n + 1)
    if seed not in ("sma", "first"):
        raise ValueError(f"unknown EMA seeding {seed!r}")
    s = start + n - 1 if seed == "sma" else start
    y0 = x[:, start : s + 1].mean(dim=1) if seed == "sma" else x[:, s].clone()
    return seeded_scan(x, s, y0, 1.0 - alpha, alpha)


def ema_distance(x: Tensor, dx: Tensor, n: int, start: int = 0) -> Tensor:
    """x minus its TA-Lib EMA(n) (SMA seeding, x valid from ``start``) as a recurrence of its own on the changes dx of
    x: d[t] = a (d[t-1] + dx[t]), a = 1 - 2 / (n + 1), from d = x - mean(x[start..s]) at s = start + n - 1, so its
    rounding is relative to the distance, not to the level of x."""
    s = start + n - 1
    if s >= x.shape[-1]:
        return nans(x)
    a = 1.0 - 2.0 / (n + 1)
    seed = (x[:, start : s + 1] - x[:, s : s + 1]).mean(dim=1).neg_()
    return seeded_scan(dx, s, seed, a, a)


def wilder(x: Tensor, n: int, start: int = 0) -> Tensor:
    """Wilder's smoothing (RSI, ATR, ADX): an EMA with alpha = 1/n, seeded with the mean of the first n values."""
    return ema(x, n, start, alpha=1.0 / n)


def wilder_sum(x: Tensor, n: int, start: int = 0) -> Tensor:
    """Wilder's running sum as TA-Lib's DM/DI: seeded with the sum of n-1 values, then y = y - y/n + x."""
    if n < 2:
        return nans(x)
    s = start + n - 2
    return seeded_scan(x, s, x[:, start : s + 1].sum(dim=1), 1.0 - 1.0 / n, 1.0)


def seeded_scan(x: Tensor, s: int, y0: Tensor | float, a: float, b: float) -> Tensor:
    """NaN before bar s, y0 at s, then y[t] = a y[t-1] + b x[t]."""
    out = nans(x, s)
    if s < x.shape[-1]:
        out[:, s] = y0
        out[:, s + 1 :] = first_order(x[:, s + 1 :], a, b, rows(y0, x))
    return out


def seeded_recurrence(a: Tensor, b: Tensor, seed: Tensor, s: int, a_min: float) -> Tensor:
    """NaN before bar s, seed[s] at s, then y[t] = a[t] y[t-1] + b[t] (a_min <= a <= 1: :func:`linear_recurrence`)."""
    out = nans(b, s)
    if s < b.shape[-1]:
        out[:, s] = seed[:, s]
        out[:, s + 1 :] = linear_recurrence(a[:, s + 1 :], b[:, s + 1 :], seed[:, s], a_min)
    return out


def linear_recurrence(a: Tensor, b: Tensor, y0: Tensor | float, a_min: float) -> Tensor:
    """y[t] = a[t] y[t-1] + b[t] for t = 0..T-1 from y[-1] = y0, with a_min <= a <= 1 (blocked scan).

    Within a block of B bars y = A (y_in + cumsum(b / A)), A the running product of a; B comes from the
    caller's bound ``a_min`` (never from the data) and keeps A above float64 underflow. The block carries
    y_in[j+1] = A_end[j] (y_in[j] + P_end[j]) are solved by a doubling scan over the blocks, on the device.
    """
    if not 0.0 < a_min <= 1.0:
        raise ValueError(f"linear_recurrence: a_min must be in (0, 1], got {a_min}")
    S, T = a.shape
    y0 = rows(y0, a)
    if T == 0:
        return a.new_empty((S, 0))
    B = int(min(1024, max(1, 250 // max(1e-12, -math.log10(a_min)))))
    nb = -(-T // B)
    A = torch.cumprod(pad_right(a, nb * B - T, 1.0).view(S, nb, B), dim=-1)
    P = torch.cumsum(pad_right(b, nb * B - T).view(S, nb, B) / A, dim=-1)
    a_end = A[..., -1]
    ends = affine_scan(a_end, a_end * P[..., -1], y0)  # y at each block's end
    P += torch.cat((y0[:, None], ends[:, :-1]), dim=1)[..., None]
    P *= A
    return P.view(S, nb * B)[:, :T]
