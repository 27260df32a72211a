"""The embedded default market: seeded bars of a liquid futures contract, with a planted signal and its exact oracle.

Why it exists: every learning test and the quick-start run need data whose achievable predictability is *known*, so a
learned forecast or policy can be scored as a fraction of the best possible one.

The model (per symbol; ``t`` counts that symbol's bars; all symbols share one calendar)
---------------------------------------------------------------------------------------
::

    z[t]        i.i.d. Student-t innovations with ``tail_df`` degrees of freedom scaled to unit variance; across symbols
                they are multivariate-t with pairwise correlation ``correlation`` (shared chi-square mixing, so big
                moves tend to come together)
    e[t]        = s * e[t-1] + sqrt(1 - s^2) * z[t],  e[0] = z[0]        (standardised return; AR(1), unit variance)
    h[t+1]      = omega + (alpha * e[t]^2 + beta) * h[t],  h[0] = 1,  omega = 1 - alpha - beta   (GARCH(1,1), E h = 1)
    g[t]        intraday U-shape of volatility by position in the session (deterministic, mean of g^2 over a session 1)
    q[t]        = g[t]^2 + gap_variance_rate * (closed time before bar t, in bars)   (q = g^2 inside a session)
    sigma[t]    = bar_volatility * sqrt(h[t] * q[t]),  bar_volatility = daily_volatility / sqrt(bars per session)
    r[t]        = ln C[t] - ln C[t-1] = sigma[t] * e[t]                  (ln C[-1] = ln base_price)

``s`` is ``signal_strength``, ``alpha``/``beta`` are ``garch_alpha``/``garch_beta``.

The planted predictable component and what its strength means
--------------------------------------------------------------
Because the standardised returns ``e`` follow an AR(1) with coefficient ``s``, the next return splits into a part known
at ``t`` and an independent innovation::

    r[t+1] = oracle_mean[t] + oracle_std[t] * z[t+1]
    oracle_mean[t] = s * sigma[t+1] * e[t]          oracle_std[t] = sqrt(1 - s^2) * sigma[t+1]

Everything on the right is known from the bars ``<= t``: ``e[t] = r[t] / sigma[t]``, ``h[t+1]`` is the GARCH filter of
the past close-to-close returns, and ``q[t+1]`` is a deterministic function of the next bar's open time, which the
exchange calendar fixes in advance (:func:`oracle_from_bars` recomputes the oracle from the bars alone). ``z[t+1]`` is
independent of everything up to ``t``, in every symbol, so the oracle is *exact*:

- ``oracle_mean`` is E[ln C[t+1] - ln C[t] | bars <= t]; ``s = 0`` makes it identically 0 (a log-price martingale).
- ``oracle_quantile(qs)`` gives the exact conditional quantiles ``oracle_mean + oracle_std * F^-1(q)``, with ``F`` the
  unit-variance Student-t distribution function.
- On the standardised scale the strength is exact: corr(oracle_mean[t] / sigma[t+1], r[t+1] / sigma[t+1]) =
  corr(e[t], e[t+1]) = ``s``, so the achievable R^2 of the standardised next return is ``s^2`` (1% at ``s = 0.1``,
  9% at ``s = 0.3``); equivalently (r[t+1] - oracle_mean[t]) / oracle_std[t] are i.i.d. unit-variance Student-t.
- In raw return units the correlation corr(oracle_mean[t], r[t+1]) is somewhat above ``s``, because a large ``|e[t]|``
  raises both ``|oracle_mean[t]|`` and the next GARCH variance: about 1.15 ``s`` at the defaults on 1M bars (0.113-0.121
  for s = 0.1, 0.334 for s = 0.3), and anywhere from about 1.0 ``s`` to 1.35 ``s`` on 200k bars, because the fat tails
  make this raw correlation noisy. Score learned forecasts against the oracle on the same bars, not against these
  figures.

A causal feature set picks the signal up from the last return scaled by a volatility estimate (an EWMA of squared
returns approximates ``h``, the time of day gives ``g``); even the raw lag-1 return autocorrelation is close to ``s``.
Negative ``s`` plants mean reversion instead of momentum.

Calendar (``session_gaps=True``, CME Globex style)
--------------------------------------------------
The session for trading date D runs from 17:00 America/Chicago on the previous calendar day to 16:00 on D (23 hours,
daylight-saving time followed), Monday to Friday, so bars skip the daily 16:00-17:00 maintenance break and the weekend
(holidays are not modelled). ``start`` is the trading date of the first session (a weekend date moves to Monday). The
first bar of each session carries the return over the closed period: its open gaps from the previous close by a
Brownian-bridge share of that bar's return, its body holds the rest. With ``session_gaps=False`` bars run around the
clock from ``start`` 00:00 UTC and the U-shape follows the UTC day. ``bar_seconds`` must divide 3600.

Bars
----
``open`` = previous close inside a session; ``high``/``low`` extend the body by maxima and minima of a Brownian bridge
with the bar's within-bar volatility (so range estimators work); ``volume`` is a positive whole number of contracts,
``base_volume`` times a U-shape in the session, ``sqrt(h)`` and ``exp(volume_return_link * (|e| - 1))`` with lognormal
noise. High, low and volume use their own random streams and never touch the closes, so they cannot leak the future.

Prices are NOT rounded to a tick: rounding closes to e.g. 0.25 would make the next return's distribution discrete and
add bid-ask-bounce-like negative autocorrelation that the oracle does not know, so the oracle would no longer be exact
(nor the best predictor). Exactness of the oracle matters more here.

Random streams are spawned per component from ``seed`` and drawn in bar order, so a longer market of the same seed
starts with exactly the bars of a shorter one (the future never changes the past). Generating the default 200k bars
takes about 0.1 s and 1M bars about 0.5 s on one core; everything is vectorised, the GARCH and AR(1) recursions as
blocked prefix scans (``python scripts/gen_synthetic.py --bench``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pandas as pd

__all__ = ["MarketParams", "SyntheticMarket", "generate_market", "oracle_from_bars", "student_t_ppf"]

_NS = 1_000_000_000
_DAY_S = 86_400
_SESSION_S = 23 * 3600  # CME Globex: 17:00 to 16:00 America/Chicago
_SESSION_OPEN_S = 17 * 3600
_EXCHANGE_TZ = "America/Chicago"
_SCAN_BLOCK = 64  # steps per block of the prefix scan in _linear_recursion
_U_DECAY = 0.08  # e-folding length of the intraday U-shape, as a fraction of the session (about 110 min of 23 h)


@dataclass(frozen=True)
class MarketParams:
    """Every parameter that generated a synthetic market, so its oracle can be recomputed and its run reproduced."""

    n_bars: int
    n_symbols: int
    symbols: tuple[str, ...]
    seed: int
    signal_strength: float
    start: str
    bar_seconds: int
    session_gaps: bool
    correlation: float
    tail_df: float
    garch_alpha: float
    garch_beta: float
    daily_volatility: float
    intraday_volatility_amplitude: float
    intraday_volume_amplitude: float
    gap_variance_rate: float
    base_price: float
    base_volume: float
    volume_return_link: float
    volume_noise: float

    @property
    def garch_omega(self) -> float:
        return 1.0 - self.garch_alpha - self.garch_beta

    @property
    def bars_per_session(self) -> int:
        return (_SESSION_S if self.session_gaps else _DAY_S) // self.bar_seconds

    @property
    def bar_volatility(self) -> float:
        """Average per-bar standard deviation of log returns inside a session."""
        return self.daily_volatility / math.sqrt(self.bars_per_session)

    @property
    def innovation_scale(self) -> float:
        """Scale that turns a standard Student-t variate into a unit-variance one."""
        return 1.0 if math.isinf(self.tail_df) else math.sqrt((self.tail_df - 2.0) / self.tail_df)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["symbols"] = list(self.symbols)
        return d


@dataclass(frozen=True)
class SyntheticMarket:
    """Bars of the synthetic market together with the exact oracle of the next bar's log return."""

    bars: pd.DataFrame = field(repr=False)
    oracle_mean: np.ndarray = field(repr=False)  # float64 [T]: E[r[t+1] | bars <= t]; NaN at each symbol's last bar
    oracle_std: np.ndarray = field(repr=False)  # float64 [T]: sd of r[t+1] given bars <= t; NaN likewise
    params: MarketParams

    @property
    def symbols(self) -> tuple[str, ...]:
        return tuple(sorted(self.params.symbols))

    def oracle_quantile(self, qs: float | Sequence[float] | np.ndarray) -> np.ndarray:
        """Exact conditional quantiles [T, Q] of ln C[t+1] - ln C[t] given bars <= t (NaN at each symbol's last bar)."""
        q = np.atleast_1d(np.asarray(qs, dtype=np.float64))
        if q.ndim != 1 or not np.all((q > 0.0) & (q < 1.0)):
            raise ValueError(f"oracle_quantile: quantile levels must be a 1-d sequence inside (0, 1), got {qs!r}")
        unit = student_t_ppf(q, self.params.tail_df) * self.params.innovation_scale
        return self.oracle_mean[:, None] + self.oracle_std[:, None] * unit[None, :]

    def next_returns(self) -> np.ndarray:
        """Realised ln C[t+1] - ln C[t] per bar (NaN at each symbol's last bar): what the oracle forecasts."""
        return _next_log_returns(self.bars)

    def write(self, path: str | os.PathLike, **kwargs) -> Path:
        """Write the bars with the project's writer, chosen by extension (.dbn, .dbn.zst, .csv, .parquet)."""
        from foxhunt.data.io import write_bars

        return write_bars(self.bars, path, **kwargs)

    def summary(self) -> dict[str, float | int | str]:
        """Headline stylised facts and the oracle's strength, for logs and the quick-start printout."""
        bars = self.bars
        logc = np.log(bars["close"].to_numpy())
        first = _first_rows(bars["symbol"].to_numpy())
        r = np.diff(logc)[~first[1:]]
        rc = r - r.mean()
        a = np.abs(r) - np.abs(r).mean()
        r_next = self.next_returns()
        ok = np.isfinite(self.oracle_mean)
        e_hat = self.oracle_mean[ok] / self.oracle_std[ok]
        e_next = r_next[ok] / self.oracle_std[ok]
        return {
            "symbols": ",".join(self.symbols),
            "bars": len(bars),
            "start": str(bars["timestamp"].iloc[0]),
            "end": str(bars["timestamp"].iloc[-1]),
            "signal_strength": self.params.signal_strength,
            "excess_kurtosis": float(np.mean(rc**4) / np.mean(rc**2) ** 2 - 3.0),
            "abs_return_acf1": float(np.mean(a[1:] * a[:-1]) / np.mean(a * a)),
            "oracle_corr_raw": _corr(self.oracle_mean[ok], r_next[ok]),
            "oracle_corr_standardised": _corr(e_hat, e_next),
            "mean_volume": float(bars["volume"].mean()),
        }


def generate_market(
    n_bars: int = 200_000,
    *,
    n_symbols: int = 1,
    seed: int = 0,
    signal_strength: float = 0.1,
    start: str = "2024-01-02",
    bar_seconds: int = 60,
    session_gaps: bool = True,
    correlation: float = 0.5,
    symbols: Sequence[str] | None = None,
    tail_df: float = 5.0,
    garch_alpha: float = 0.04,
    garch_beta: float = 0.95,
    daily_volatility: float = 0.01,
    intraday_volatility_amplitude: float = 1.0,
    intraday_volume_amplitude: float = 3.0,
    gap_variance_rate: float = 0.05,
    base_price: float = 5000.0,
    base_volume: float = 400.0,
    volume_return_link: float = 0.5,
    volume_noise: float = 0.3,
) -> SyntheticMarket:
    """Generate a seeded synthetic futures market and its exact next-return oracle.

    Args:
        n_bars: bars per symbol.
        n_symbols: number of symbols (ignored names default to ``SYN0``, ``SYN1``...).
        seed: seed of every random stream; the same seed and parameters give identical bars.
        signal_strength: AR(1) coefficient ``s`` of the standardised returns, in (-1, 1); 0 gives a martingale.
        start: trading date of the first session (``session_gaps``) or first UTC day of bars.
        bar_seconds: bar length in seconds; must divide 3600.
        session_gaps: CME Globex calendar (daily break, weekends skipped) instead of round-the-clock bars.
        correlation: pairwise correlation of the symbols' innovations.
        symbols: symbol names (length ``n_symbols``); rows come out sorted by name.
        tail_df: Student-t degrees of freedom of the innovations (> 2; ``math.inf`` for Gaussian).
        garch_alpha: GARCH(1,1) reaction to the last squared standardised return.
        garch_beta: GARCH(1,1) persistence; ``garch_alpha + garch_beta < 1``.
        daily_volatility: standard deviation of a session's log return (closed periods excluded).
        intraday_volatility_amplitude: depth of the volatility U-shape (0 for flat); opening volatility is about
            ``1 + amplitude`` times the midday one.
        intraday_volume_amplitude: depth of the volume U-shape, in the same units.
        gap_variance_rate: return variance per closed bar-length, as a fraction of an average open bar's variance.
        base_price: price before the first bar.
        base_volume: typical volume of a calm midday bar, in contracts.
        volume_return_link: elasticity of volume to the bar's standardised absolute return.
        volume_noise: standard deviation of the lognormal volume noise.
    """
    names = tuple(symbols) if symbols is not None else tuple(f"SYN{i}" for i in range(n_symbols))
    params = MarketParams(
        n_bars=int(n_bars),
        n_symbols=int(n_symbols),
        symbols=names,
        seed=int(seed),
        signal_strength=float(signal_strength),
        start=str(start),
        bar_seconds=int(bar_seconds),
        session_gaps=bool(session_gaps),
        correlation=float(correlation),
        tail_df=float(tail_df),
        garch_alpha=float(garch_alpha),
        garch_beta=float(garch_beta),
        daily_volatility=float(daily_volatility),
        intraday_volatility_amplitude=float(intraday_volatility_amplitude),
        intraday_volume_amplitude=float(intraday_volume_amplitude),
        gap_variance_rate=float(gap_variance_rate),
        base_price=float(base_price),
        base_volume=float(base_volume),
        volume_return_link=float(volume_return_link),
        volume_noise=float(volume_noise),
    )
    _check_params(params)
    return _simulate(params)


def oracle_from_bars(bars: pd.DataFrame, params: MarketParams) -> tuple[np.ndarray, np.ndarray]:
    """Recompute (oracle_mean, oracle_std) from the bars alone: the oracle at t reads closes <= t and the calendar.

    ``bars`` must start at each symbol's first generated bar (the GARCH state starts at its unconditional value there);
    any later bars may be missing or altered without changing the values before them.
    """
    p = params
    ts = pd.DatetimeIndex(bars["timestamp"]).as_unit("ns").asi8
    sym = bars["symbol"].to_numpy()
    first = _first_rows(sym)
    last = np.r_[first[1:], True]
    g2, gap = _calendar_factors(ts, first, p)
    q = g2 + p.gap_variance_rate * gap
    logc = np.log(bars["close"].to_numpy(dtype=np.float64))
    r = np.empty_like(logc)
    r[1:] = np.diff(logc)
    r[first] = logc[first] - math.log(p.base_price)
    bv2 = p.bar_volatility**2
    x = p.garch_omega + p.garch_alpha * r * r / (bv2 * q)  # h[t+1] = beta * h[t] + x[t]
    h = np.empty_like(r)
    starts = np.flatnonzero(first)
    for a, b in zip(starts, np.r_[starts[1:], len(r)]):
        h[a:b] = _linear_recursion(p.garch_beta, x[a : b - 1], 1.0)
    sigma = p.bar_volatility * np.sqrt(h * q)
    e = r / sigma
    return _oracle(e, sigma, last, p.signal_strength)


def student_t_ppf(q: float | Sequence[float] | np.ndarray, df: float) -> np.ndarray:
    """Quantile function of the standard Student-t distribution (``df = inf``: standard normal), to ~1e-12.

    With x = sqrt(df) tan(theta), P(0 < T < x) = I(theta) / (2 I(pi/2)) where I(theta) is the integral of
    cos(u)^(df-1) on [0, theta]: a smooth, bounded integrand, integrated by Gauss-Legendre and inverted by bisection.
    """
    q = np.asarray(q, dtype=np.float64)
    if not np.all((q > 0.0) & (q < 1.0)):
        raise ValueError(f"student_t_ppf: probabilities must lie in (0, 1), got {q!r}")
    if not df > 0:
        raise ValueError(f"student_t_ppf: df must be positive, got {df}")
    if math.isinf(df):
        nd = NormalDist()
        return np.vectorize(nd.inv_cdf, otypes=[np.float64])(q)
    target = np.abs(2.0 * q - 1.0).ravel()  # = I(theta) / I(pi/2)
    total = 0.5 * math.sqrt(math.pi) * math.exp(math.lgamma(df / 2.0) - math.lgamma((df + 1.0) / 2.0))
    nodes, weights = np.polynomial.legendre.leggauss(128)
    lo = np.zeros_like(target)
    hi = np.full_like(target, math.pi / 2.0)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        u = 0.5 * mid[:, None] * (nodes[None, :] + 1.0)
        frac = 0.5 * mid * (np.cos(u) ** (df - 1.0) @ weights) / total
        below = frac < target
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    x = math.sqrt(df) * np.tan(0.5 * (lo + hi))
    return (np.sign(q.ravel() - 0.5) * x).reshape(q.shape)


# --- internals -----------------------------------------------------------------------------------------------------


def _check_params(p: MarketParams) -> None:
    def bad(name: str, why: str) -> None:
        raise ValueError(f"generate_market: {name}={getattr(p, name)!r} {why}")

    if p.n_bars < 2:
        bad("n_bars", "must be at least 2")
    if p.n_symbols < 1:
        bad("n_symbols", "must be at least 1")
    if len(p.symbols) != p.n_symbols:
        bad("symbols", f"must name exactly n_symbols={p.n_symbols} symbols")
    if len(set(p.symbols)) != len(p.symbols) or not all(isinstance(s, str) and s for s in p.symbols):
        bad("symbols", "must be distinct non-empty strings")
    if not -1.0 < p.signal_strength < 1.0:
        bad("signal_strength", "must lie in (-1, 1)")
    if p.bar_seconds <= 0 or 3600 % p.bar_seconds:
        bad("bar_seconds", "must be a positive divisor of 3600")
    lower = -1.0 / (p.n_symbols - 1) if p.n_symbols > 1 else -1.0
    if not lower < p.correlation < 1.0:
        bad("correlation", f"must lie in ({lower:g}, 1) for {p.n_symbols} symbols")
    if not p.tail_df > 2.0:
        bad("tail_df", "must exceed 2 (unit-variance innovations need a finite variance)")
    if p.garch_alpha < 0 or p.garch_beta < 0 or p.garch_alpha + p.garch_beta >= 1.0:
        bad("garch_alpha", f"and garch_beta={p.garch_beta!r} must be >= 0 with a sum below 1")
    for name in ("daily_volatility", "base_price", "base_volume"):
        if not (math.isfinite(getattr(p, name)) and getattr(p, name) > 0):
            bad(name, "must be positive and finite")
    for name in ("intraday_volatility_amplitude", "intraday_volume_amplitude", "gap_variance_rate", "volume_noise"):
        if not (math.isfinite(getattr(p, name)) and getattr(p, name) >= 0):
            bad(name, "must be non-negative and finite")
    if not math.isfinite(p.volume_return_link):
        bad("volume_return_link", "must be finite")
    try:
        pd.Timestamp(p.start)
    except ValueError as err:
        raise ValueError(f"generate_market: start={p.start!r} is not a date: {err}") from None


def _timestamps(p: MarketParams) -> np.ndarray:
    """Bar open times (int64 ns, UTC) of one symbol: the exchange calendar, known in advance."""
    bar_ns = p.bar_seconds * _NS
    day = pd.Timestamp(p.start).normalize()
    if day.tzinfo is not None:
        day = day.tz_convert("UTC").tz_localize(None)
    if not p.session_gaps:
        return pd.Timestamp(day, tz="UTC").value + np.arange(p.n_bars, dtype=np.int64) * bar_ns
    per = p.bars_per_session
    n_sessions = -(-p.n_bars // per)
    dates = pd.bdate_range(day, periods=n_sessions)
    opens = (dates - pd.Timedelta(hours=24 - 17)).tz_localize(_EXCHANGE_TZ).tz_convert("UTC").as_unit("ns").asi8
    return (opens[:, None] + np.arange(per, dtype=np.int64)[None, :] * bar_ns).ravel()[: p.n_bars]


def _u_shape(phase: np.ndarray, amplitude: float) -> np.ndarray:
    return 1.0 + amplitude * (np.exp(-phase / _U_DECAY) + np.exp(-(1.0 - phase) / _U_DECAY))


def _phase(ts: np.ndarray, p: MarketParams) -> np.ndarray:
    """Position of each bar's middle in its session (or UTC day), in [0, 1)."""
    half = p.bar_seconds * _NS // 2
    if p.session_gaps:
        local = pd.DatetimeIndex(ts, tz="UTC").tz_convert(_EXCHANGE_TZ).tz_localize(None).as_unit("ns").asi8
        since_open = (local - _SESSION_OPEN_S * _NS) % (_DAY_S * _NS)
        return (since_open + half) / (_SESSION_S * _NS)
    return (ts % (_DAY_S * _NS) + half) / (_DAY_S * _NS)


def _calendar_factors(ts: np.ndarray, first: np.ndarray, p: MarketParams) -> tuple[np.ndarray, np.ndarray]:
    """Seasonal variance factor g^2 (session mean 1) and closed time before each bar in bar-lengths (0 in a session)."""
    per = p.bars_per_session
    grid = _u_shape((np.arange(per) + 0.5) / per, p.intraday_volatility_amplitude)
    norm = float(np.mean(grid**2))
    g2 = _u_shape(_phase(ts, p), p.intraday_volatility_amplitude) ** 2 / norm
    gap = np.zeros(len(ts))
    gap[1:] = (np.diff(ts) - p.bar_seconds * _NS) / (p.bar_seconds * _NS)
    gap[first] = 0.0
    return g2, np.maximum(gap, 0.0)


def _linear_recursion(coef: np.ndarray | float, inc: np.ndarray | float, x0: float) -> np.ndarray:
    """x[0] = x0, x[t+1] = coef[t] * x[t] + inc[t] (AR(1), GARCH) without a Python loop per bar.

    A parallel prefix scan of the affine maps x -> coef * x + inc inside blocks of ``_SCAN_BLOCK`` steps, then one
    short sequential pass over the blocks. Each x[t] reads steps < t only and the blocks are fixed from step 0, so a longer
    input gives bit-identical leading values; the result equals the sequential loop up to rounding.
    """
    n = max(np.size(coef), np.size(inc))
    size = -(-n // _SCAN_BLOCK) * _SCAN_BLOCK
    a = np.ones(size)
    b = np.zeros(size)
    a[:n] = coef
    b[:n] = inc
    a = a.reshape(-1, _SCAN_BLOCK)
    b = b.reshape(-1, _SCAN_BLOCK)
    d = 1
    while d < _SCAN_BLOCK:  # compose each map with the one d steps before it (Hillis-Steele)
        b[:, d:] = a[:, d:] * b[:, :-d] + b[:, d:]
        a[:, d:] = a[:, d:] * a[:, :-d]
        d *= 2
    block_start = np.fromiter(
        accumulate(zip(a[:, -1].tolist(), b[:, -1].tolist()), lambda x, ab: ab[0] * x + ab[1], initial=float(x0)),
        np.float64,
        a.shape[0] + 1,
    )
    out = np.empty(n + 1)
    out[0] = x0
    out[1:] = (a * block_start[:-1, None] + b).ravel()[:n]
    return out


def _first_rows(sym: np.ndarray) -> np.ndarray:
    first = np.ones(len(sym), dtype=bool)
    first[1:] = sym[1:] != sym[:-1]
    return first


def _oracle(e: np.ndarray, sigma: np.ndarray, last: np.ndarray, s: float) -> tuple[np.ndarray, np.ndarray]:
    sigma_next = np.empty_like(sigma)
    sigma_next[:-1] = sigma[1:]
    sigma_next[last] = np.nan
    return s * sigma_next * e, math.sqrt(1.0 - s * s) * sigma_next


def _next_log_returns(bars: pd.DataFrame) -> np.ndarray:
    logc = np.log(bars["close"].to_numpy(dtype=np.float64))
    out = np.full(len(logc), np.nan)
    out[:-1] = np.diff(logc)
    out[np.r_[_first_rows(bars["symbol"].to_numpy())[1:], True]] = np.nan
    return out


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    a = a - a.mean()
    b = b - b.mean()
    den = math.sqrt(float(a @ a) * float(b @ b))
    return float(a @ b) / den if den > 0 else 0.0


def _innovations(normal_rng: np.random.Generator, mix_rng: np.random.Generator, p: MarketParams) -> np.ndarray:
    """[n, S] unit-variance multivariate Student-t innovations with equicorrelation ``p.correlation``."""
    n, k = p.n_bars, p.n_symbols
    normals = normal_rng.standard_normal((n, k))
    if k > 1:
        corr = np.full((k, k), p.correlation)
        np.fill_diagonal(corr, 1.0)
        normals = normals @ np.linalg.cholesky(corr).T
    if math.isinf(p.tail_df):
        return normals
    mix = mix_rng.chisquare(p.tail_df, n)
    return normals * np.sqrt((p.tail_df - 2.0) / mix)[:, None]


def _simulate(p: MarketParams) -> SyntheticMarket:
    n, k, s = p.n_bars, p.n_symbols, p.signal_strength
    # one stream per component, each drawn in bar order, so a longer market starts with the bars of a shorter one
    streams = [np.random.default_rng(c) for c in np.random.SeedSequence(p.seed).spawn(5)]
    z = _innovations(streams[0], streams[1], p)
    bridge = streams[2].standard_normal((n, k))  # splits a session's first return into gap and body
    extremes = streams[3].random((n, k, 2))  # Brownian-bridge maximum and minimum of each bar
    vol_noise = streams[4].standard_normal((n, k))

    ts = _timestamps(p)
    first_bar = np.zeros(n, dtype=bool)
    first_bar[0] = True
    g2, gap = _calendar_factors(ts, first_bar, p)
    q = g2 + p.gap_variance_rate * gap
    gap_share = (p.gap_variance_rate * gap) / q  # share of the bar's variance that falls in the closed period
    vol_shape = _u_shape(_phase(ts, p), p.intraday_volume_amplitude) / _u_shape(0.5, p.intraday_volume_amplitude)

    c = math.sqrt(1.0 - s * s)
    last = np.zeros(n, dtype=bool)
    last[-1] = True
    blocks = []
    means, stds = [], []
    for j in range(k):
        zj = z[:, j]
        e = zj.copy() if s == 0.0 else _linear_recursion(s, c * zj[1:], float(zj[0]))
        h = _linear_recursion(p.garch_alpha * e[:-1] ** 2 + p.garch_beta, p.garch_omega, 1.0)
        sigma = p.bar_volatility * np.sqrt(h * q)
        r = sigma * e
        logc = math.log(p.base_price) + np.cumsum(r)
        prev = np.r_[math.log(p.base_price), logc[:-1]]
        gap_ret = gap_share * r + np.sqrt(gap_share * (1.0 - gap_share)) * sigma * c * bridge[:, j]
        logo = prev + gap_ret
        body = logc - logo
        body_var = (sigma * sigma) * (1.0 - gap_share)
        up = 0.5 * (body + np.sqrt(body * body - 2.0 * body_var * np.log1p(-extremes[:, j, 0])))
        down = 0.5 * (body - np.sqrt(body * body - 2.0 * body_var * np.log1p(-extremes[:, j, 1])))
        volume = p.base_volume * vol_shape * np.sqrt(h)
        volume = volume * np.exp(p.volume_return_link * (np.abs(e) - 1.0) + p.volume_noise * vol_noise[:, j])
        blocks.append(
            {
                "open": np.exp(logo),
                "high": np.exp(logo + np.maximum(up, np.maximum(body, 0.0))),
                "low": np.exp(logo + np.minimum(down, np.minimum(body, 0.0))),
                "close": np.exp(logc),
                "volume": np.maximum(np.rint(volume), 1.0),
            }
        )
        m, sd = _oracle(e, sigma, last, s)
        means.append(m)
        stds.append(sd)

    order = sorted(range(k), key=lambda j: p.symbols[j])
    stamps = pd.DatetimeIndex(np.tile(ts, k), tz="UTC").as_unit("ns")
    cols = {name: np.concatenate([blocks[j][name] for j in order]) for name in blocks[0]}
    # exp(log) round-trips can put open or close a hair outside [low, high]; clamp so OHLC is consistent bit-for-bit
    cols["high"] = np.maximum(cols["high"], np.maximum(cols["open"], cols["close"]))
    cols["low"] = np.minimum(cols["low"], np.minimum(cols["open"], cols["close"]))
    bars = pd.DataFrame(
        {
            "timestamp": stamps,
            **cols,
            "symbol": pd.Series(np.repeat(np.array([p.symbols[j] for j in order], dtype=object), n), dtype="str"),
        }
    )
    oracle_mean = np.concatenate([means[j] for j in order])
    oracle_std = np.concatenate([stds[j] for j in order])
    oracle_mean.flags.writeable = False
    oracle_std.flags.writeable = False
    return SyntheticMarket(bars=bars, oracle_mean=oracle_mean, oracle_std=oracle_std, params=p)
