"""Differentiable, causal preprocessing: log returns, rolling z-scores, outlier clipping and target scaling.

Every transform is an ``nn.Module`` whose fitted statistics are buffers, so they move with ``.to()``, save in
``state_dict``/checkpoints, and are fitted once on the training split. All of it is tensor code with no Python
branch on data values and no host round-trip, so it runs on any device and gradients flow end to end.

Conventions
-----------
* Time axis: dim 0 of a ``[T]`` or ``[T, F]`` tensor, dim -2 of a batched ``[B, T, F]`` tensor.
* Missing values are NaN. Fitted statistics ignore NaN; rolling statistics mark any window that holds a NaN, that
  crosses a segment (symbol) boundary, or that is shorter than ``window`` as *not ready*: the output there is NaN.
* Causality: a rolling statistic at row t reads rows ``t - lag - window + 1 .. t - lag`` only. ``lag=0`` suits
  quantities known at bar t (features); ``lag=1`` suits the next-bar return target, whose own value is not known at
  decision time, so its scale is.
* Clipping is not invertible. Every reported metric must be computed against the raw, unclipped returns
  (``MarketSplit.returns``), never against ``inverse(forward(returns))``.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from foxhunt.features.ops import BlockPrefix

__all__ = [
    "FeatureNormalizer",
    "OutlierClip",
    "RollingMoments",
    "RollingZScore",
    "ScaledTarget",
    "TargetTransform",
    "log_returns",
    "next_log_returns",
    "segment_position",
]


# ----------------------------------------------------------------------------------------------------------------------
# Log returns
# ----------------------------------------------------------------------------------------------------------------------


def _segment_breaks(segment: Tensor | None, n: int, dim: int, ndim: int) -> Tensor | None:
    """Bool [n-1] (shaped to broadcast along ``dim``): True where row i+1 starts a new segment."""
    if segment is None:
        return None
    if segment.shape != (n,):
        raise ValueError(f"segment must have shape ({n},) to match the time axis, got {tuple(segment.shape)}")
    breaks = segment[1:] != segment[:-1]
    shape = [1] * ndim
    shape[dim] = n - 1
    return breaks.view(shape)


def _log_diff(close: Tensor, dim: int, segment: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """ln C[t+1] - ln C[t] for t < n-1 (NaN across segment breaks), a NaN pad of one row, and the dim."""
    dim = dim % close.ndim
    n = close.shape[dim]
    log_c = torch.log(close)
    diff = log_c.narrow(dim, 1, n - 1) - log_c.narrow(dim, 0, n - 1)
    breaks = _segment_breaks(segment, n, dim, close.ndim)
    if breaks is not None:
        diff = torch.where(breaks, torch.full_like(diff, math.nan), diff)
    return diff, torch.full_like(log_c.narrow(dim, 0, 1), math.nan), dim


def log_returns(close: Tensor, dim: int = -1, segment: Tensor | None = None) -> Tensor:
    """Backward log return ln C[t] - ln C[t-1], known at bar t; NaN at t=0 and at each segment's first row."""
    diff, pad, dim = _log_diff(close, dim, segment)
    return torch.cat([pad, diff], dim=dim)


def next_log_returns(close: Tensor, dim: int = -1, segment: Tensor | None = None) -> Tensor:
    """Next-bar log return ln C[t+1] - ln C[t] (the target at bar t); NaN at each segment's last row."""
    diff, pad, dim = _log_diff(close, dim, segment)
    return torch.cat([diff, pad], dim=dim)


# ----------------------------------------------------------------------------------------------------------------------
# Rolling moments (causal, O(T), float32-safe)
# ----------------------------------------------------------------------------------------------------------------------


def _rolling_moments(x: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """Count, mean and centred sum of squares of the finite values among the ``window`` rows ending at each row
    (time first, any trailing shape, differentiable): the features' block-centred prefix sums, one block per window,
    so rounding error grows with ``window``, not with T, and float32 stays accurate on long trending series."""
    T, rest = x.shape[0], x.shape[1:]
    bp = BlockPrefix(x.reshape(T, math.prod(rest)).T, window, squares=True, block=window, finite=True)
    return tuple(a.T.reshape(T, *rest) for a in bp.moments(window))


def _time_dim(x: Tensor) -> int:
    return 0 if x.ndim <= 2 else x.ndim - 2


def segment_position(segment: Tensor) -> Tensor:
    """Int64 [T]: rows since the start of each row's contiguous segment (0 at a segment's first row)."""
    n = segment.shape[0]
    idx = torch.arange(n, device=segment.device)
    starts = torch.ones(n, dtype=torch.bool, device=segment.device)
    starts[1:] = segment[1:] != segment[:-1]
    return idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=0).values


def _shift_rows(x: Tensor, lag: int, fill: float) -> Tensor:
    if lag == 0:
        return x
    return torch.cat([torch.full_like(x[:lag], fill), x[:-lag]], dim=0)


class RollingMoments(NamedTuple):
    """Causal trailing statistics per row; ``mean``/``std`` are NaN where ``ready`` is False (warm-up)."""

    mean: Tensor
    std: Tensor
    ready: Tensor


class RollingZScore(nn.Module):
    """Causal trailing-window z-score (x[t] - mean) / std over ``window`` rows ending at ``t - lag``.

    Warm-up: a row is *ready* only when its whole window (``window`` rows ending at ``t - lag``) is finite and lies in
    the same segment as t; otherwise the output is NaN. Without segments, the first ``window - 1 + lag`` rows are NaN.
    The std is floored at ``eps`` (via clamp, not a branch), so a constant window yields 0, not inf.
    Time is dim 0 of ``[T]``/``[T, F]`` and dim -2 of ``[B, T, F]``. O(T) time and memory; exact to ~1e-12
    relative in float64 against a per-window computation.
    """

    def __init__(self, window: int, eps: float = 1e-8, ddof: int = 1, lag: int = 0) -> None:
        super().__init__()
        if window < 1 + ddof:
            raise ValueError(f"RollingZScore: window must be >= {1 + ddof} with ddof={ddof}, got {window}")
        if lag < 0:
            raise ValueError(f"RollingZScore: lag must be >= 0, got {lag}")
        if eps <= 0:
            raise ValueError(f"RollingZScore: eps must be > 0, got {eps}")
        self.window = int(window)
        self.eps = float(eps)
        self.ddof = int(ddof)
        self.lag = int(lag)

    def extra_repr(self) -> str:
        return f"window={self.window}, eps={self.eps}, ddof={self.ddof}, lag={self.lag}"

    def _moments(self, x: Tensor, segment: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Finite-filled (mean, std, ready) with time first; safe to differentiate everywhere."""
        n = x.shape[0]
        if n == 0:
            return torch.zeros_like(x), torch.ones_like(x), torch.zeros_like(x, dtype=torch.bool)
        count, mean, m2 = _rolling_moments(x, self.window)
        var = m2 / (count - self.ddof).clamp_min(1)
        std = torch.sqrt(var.clamp_min(self.eps * self.eps))
        full = count >= self.window
        mean = _shift_rows(torch.where(full, mean, torch.zeros_like(mean)), self.lag, 0.0)
        std = _shift_rows(torch.where(full, std, torch.ones_like(std)), self.lag, 1.0)
        full = _shift_rows(full, self.lag, False) if self.lag else full
        if segment is not None:
            if segment.shape != (n,):
                raise ValueError(f"RollingZScore: segment must have shape ({n},), got {tuple(segment.shape)}")
            pos = segment_position(segment.to(x.device))
            enough = (pos >= self.window - 1 + self.lag).view(n, *([1] * (x.ndim - 1)))
            full = full & enough
        return mean, std, full

    def moments(self, x: Tensor, segment: Tensor | None = None) -> RollingMoments:
        """Trailing mean and std at each row (NaN where not ready), in the layout of ``x``."""
        tdim = _time_dim(x)
        xt = x.movedim(tdim, 0)
        mean, std, ready = self._moments(xt, segment)
        nan = torch.full_like(mean, math.nan)
        mean = torch.where(ready, mean, nan).movedim(0, tdim)
        std = torch.where(ready, std, nan).movedim(0, tdim)
        return RollingMoments(mean, std, ready.movedim(0, tdim))

    def forward(self, x: Tensor, segment: Tensor | None = None) -> Tensor:
        tdim = _time_dim(x)
        xt = x.movedim(tdim, 0)
        mean, std, ready = self._moments(xt, segment)
        ok = ready & torch.isfinite(xt)
        z = (torch.where(ok, xt, torch.zeros_like(xt)) - mean) / std
        return torch.where(ok, z, torch.full_like(z, math.nan)).movedim(0, tdim)

    @staticmethod
    def inverse(z: Tensor, mean: Tensor, std: Tensor) -> Tensor:
        """Map z-scores back with the per-row statistics returned by :meth:`moments`."""
        return z * std + mean


# ----------------------------------------------------------------------------------------------------------------------
# Fitted statistics
# ----------------------------------------------------------------------------------------------------------------------


def _nan_mean_std(x: Tensor, ddof: int, who: str, names: list[str] | None = None) -> tuple[Tensor, Tensor]:
    """Per-column mean and std over every axis but the last (all axes for 1-D), ignoring NaN/inf."""
    flat = x.reshape(-1) if x.ndim == 1 else x.reshape(-1, x.shape[-1])
    finite = torch.isfinite(flat)
    count = finite.sum(0)
    too_few = count <= ddof
    if bool(too_few.any()):  # fit-time validation only, never on the forward path
        cols = too_few.reshape(-1).nonzero().flatten().tolist()
        label = [names[c] for c in cols] if names is not None else cols
        have = int(count.reshape(-1)[cols[0]])
        raise ValueError(f"{who}.fit: column(s) {label[:10]} have {have} finite value(s), need more than {ddof}")
    acc = torch.float32 if flat.device.type == "mps" else torch.float64  # accumulate in float64 where available
    xv = torch.where(finite, flat, torch.zeros_like(flat))
    mean = xv.sum(0, dtype=acc) / count
    dev = torch.where(finite, flat.to(acc) - mean, torch.zeros((), dtype=acc, device=flat.device))
    std = torch.sqrt((dev * dev).sum(0) / (count - ddof))
    return mean.to(x.dtype), std.to(x.dtype)


class _FittedModule(nn.Module):
    """Base for modules whose buffer shapes are set by ``fit``: loading a state_dict resizes them first."""

    _fitted_buffers: tuple[str, ...] = ()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        for name in self._fitted_buffers:
            key = prefix + name
            if key in state_dict:
                current = getattr(self, name)
                setattr(self, name, torch.empty_like(state_dict[key], dtype=current.dtype, device=current.device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "fitted" in state_dict:  # mirror the saved flag on the host once, at load time
            self._fitted_flag = bool(state_dict[prefix + "fitted"])

    def _set_buffer(self, name: str, value: Tensor) -> None:
        """Replace a fitted buffer: it takes the fitted data's dtype and stays on the module's device."""
        current = getattr(self, name)
        setattr(self, name, value.detach().to(device=current.device).clone())

    _fitted_flag: bool = False

    @property
    def is_fitted(self) -> bool:
        """Host-side mirror of the ``fitted`` buffer, so forward never syncs with the device to check it."""
        return self._fitted_flag

    def _require_fitted(self) -> None:
        if not self.is_fitted:
            raise RuntimeError(f"{type(self).__name__} is used before fit(): fit it on the training split first")


class FeatureNormalizer(_FittedModule):
    """Per-column (x - mean) / std with statistics fitted on the training split only; NaN-aware; invertible.

    Fit reduces over every axis but the last (all axes for 1-D input). A constant column has its std floored at
    ``eps``, so it maps to 0 rather than inf. NaN inputs stay NaN.
    """

    _fitted_buffers = ("mean", "std")

    def __init__(self, eps: float = 1e-8, ddof: int = 1) -> None:
        super().__init__()
        self.eps = float(eps)
        self.ddof = int(ddof)
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("std", torch.ones(()))
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))

    @torch.no_grad()
    def fit(self, x: Tensor, names: list[str] | None = None) -> FeatureNormalizer:
        mean, std = _nan_mean_std(x, self.ddof, type(self).__name__, names)
        self._set_buffer("mean", mean)
        self._set_buffer("std", std.clamp_min(self.eps))
        self.fitted.fill_(True)
        self._fitted_flag = True
        return self

    def forward(self, x: Tensor) -> Tensor:
        self._require_fitted()
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)

    def inverse(self, z: Tensor) -> Tensor:
        self._require_fitted()
        return z * self.std.to(z.dtype) + self.mean.to(z.dtype)


class OutlierClip(_FittedModule):
    """Clip to mean ± n_sigma·std per column: bounds fitted on the training split, or causal trailing statistics.

    ``mode="fitted"``: ``fit(train)`` stores the bounds in buffers; ``forward`` never changes them.
    ``mode="rolling"``: bounds from the trailing ``window`` rows ending at ``t - lag`` (same warm-up rules as
    :class:`RollingZScore`: rows that are not ready come out NaN). Clipping is not invertible.
    Gradients pass through unclipped values (and, in rolling mode, into the bounds).
    """

    _fitted_buffers = ("lower", "upper")

    def __init__(
        self,
        n_sigma: float,
        mode: Literal["fitted", "rolling"] = "fitted",
        window: int | None = None,
        lag: int = 0,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        if not n_sigma > 0:
            raise ValueError(f"OutlierClip: n_sigma must be > 0, got {n_sigma}")
        if mode not in ("fitted", "rolling"):
            raise ValueError(f"OutlierClip: mode must be 'fitted' or 'rolling', got {mode!r}")
        if mode == "rolling" and window is None:
            raise ValueError("OutlierClip: mode='rolling' needs a window")
        if mode == "fitted" and window is not None:
            raise ValueError("OutlierClip: window is only used with mode='rolling'")
        self.n_sigma = float(n_sigma)
        self.mode = mode
        self.window = window
        self.rolling = RollingZScore(window, eps=eps, lag=lag) if mode == "rolling" else None
        self.register_buffer("lower", torch.full((), -math.inf))
        self.register_buffer("upper", torch.full((), math.inf))
        self.register_buffer("fitted", torch.tensor(mode == "rolling"))
        self._fitted_flag = mode == "rolling"

    def extra_repr(self) -> str:
        return f"n_sigma={self.n_sigma}, mode={self.mode!r}, window={self.window}"

    @torch.no_grad()
    def fit(self, x: Tensor, names: list[str] | None = None) -> OutlierClip:
        """Fit the bounds on training data (a no-op in rolling mode, whose bounds are computed on the fly)."""
        if self.mode == "rolling":
            return self
        mean, std = _nan_mean_std(x, 1, type(self).__name__, names)
        self._set_buffer("lower", mean - self.n_sigma * std)
        self._set_buffer("upper", mean + self.n_sigma * std)
        self.fitted.fill_(True)
        self._fitted_flag = True
        return self

    def bounds(self, x: Tensor, segment: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Lower and upper bound that apply to each element of ``x`` (NaN in rolling warm-up)."""
        if self.rolling is None:
            self._require_fitted()
            lo, hi = self.lower.to(x.dtype), self.upper.to(x.dtype)
            return lo.expand_as(x), hi.expand_as(x)
        mean, std, _ = self.rolling.moments(x, segment)
        return mean - self.n_sigma * std, mean + self.n_sigma * std

    def forward(self, x: Tensor, segment: Tensor | None = None) -> Tensor:
        if self.rolling is None:
            self._require_fitted()
            return torch.minimum(torch.maximum(x, self.lower.to(x.dtype)), self.upper.to(x.dtype))
        tdim = _time_dim(x)
        xt = x.movedim(tdim, 0)
        mean, std, ready = self.rolling._moments(xt, segment)
        clipped = torch.minimum(torch.maximum(xt, mean - self.n_sigma * std), mean + self.n_sigma * std)
        return torch.where(ready, clipped, torch.full_like(clipped, math.nan)).movedim(0, tdim)


# ----------------------------------------------------------------------------------------------------------------------
# Target transform
# ----------------------------------------------------------------------------------------------------------------------


class ScaledTarget(NamedTuple):
    """Transformed target and the per-row (loc, scale) that maps a prediction of it back: r ≈ value·scale + loc."""

    value: Tensor
    loc: Tensor
    scale: Tensor


class TargetTransform(_FittedModule):
    """Next-bar return target: optional scaling (fitted or causal rolling z-score), then optional outlier clipping.

    * ``scale="none"``: returns pass through; ``"fitted"``: (r - mean) / std fitted on train;
      ``"rolling"``: causal z-score over ``zscore_window`` returns ending at t-1 (``lag=1``), i.e. only returns
      known at decision bar t, so a prediction made at bar t for row t can be mapped back at bar t.
    * ``clip_sigma``: clip the scaled value to mean ± clip_sigma·std, fitted on the scaled training returns
      (``clip_mode="fitted"``) or over the trailing ``clip_window`` scaled values ending at t-1 (``"rolling"``).
    * ``inverse`` undoes the scaling only. Clipping is not inverted, so metrics must use the raw returns.
    * Rolling warm-up: row t is NaN until ``zscore_window`` finite returns precede it within its segment (plus
      ``clip_window`` finite scaled values with rolling clipping); NaN returns (a segment's last bar) stay NaN.

    Multi-horizon note: with ``scale="rolling"`` the statistics of row t+h use returns up to t+h-1, so a forecast made
    at bar t uses row t's at every step: ``WindowBatches`` scales step h's target (the return of row t+h) by row t's
    ``loc``/``scale`` and clips it to :attr:`bounds`, and the forecasters map every step back with row t's.
    """

    _fitted_buffers = ()

    def __init__(
        self,
        scale: Literal["none", "fitted", "rolling"] = "none",
        zscore_window: int | None = None,
        clip_sigma: float | None = None,
        clip_mode: Literal["fitted", "rolling"] = "fitted",
        clip_window: int | None = None,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        if scale not in ("none", "fitted", "rolling"):
            raise ValueError(f"TargetTransform: scale must be 'none', 'fitted' or 'rolling', got {scale!r}")
        if (scale == "rolling") != (zscore_window is not None):
            raise ValueError("TargetTransform: zscore_window is required with scale='rolling' and only used there")
        if clip_sigma is None and clip_window is not None:
            raise ValueError("TargetTransform: clip_window given without clip_sigma")
        self.scale_mode = scale
        self.scaler: nn.Module | None
        if scale == "fitted":
            self.scaler = FeatureNormalizer(eps=eps)
        elif scale == "rolling":
            assert zscore_window is not None
            self.scaler = RollingZScore(zscore_window, eps=eps, lag=1)
        else:
            self.scaler = None
        self.clip = (
            OutlierClip(clip_sigma, mode=clip_mode, window=clip_window, lag=1 if clip_mode == "rolling" else 0, eps=eps)
            if clip_sigma is not None
            else None
        )

    @property
    def is_fitted(self) -> bool:
        return all(getattr(m, "is_fitted", True) for m in (self.scaler, self.clip) if m is not None)

    @property
    def needs_fit(self) -> bool:
        return isinstance(self.scaler, FeatureNormalizer) or (self.clip is not None and self.clip.mode == "fitted")

    @torch.no_grad()
    def fit(self, train_returns: Tensor, segment: Tensor | None = None) -> TargetTransform:
        """Fit every fitted statistic on the training returns only (NaN ignored)."""
        if isinstance(self.scaler, FeatureNormalizer):
            self.scaler.fit(train_returns)
        if self.clip is not None and self.clip.mode == "fitted":
            self.clip.fit(self._scale(train_returns, segment)[0])
        return self

    @property
    def bounds(self) -> tuple[float, float]:
        """The fitted clip applied after scaling ((-inf, inf) without one); a rolling clip has no fixed bounds."""
        if self.clip is None:
            return (-math.inf, math.inf)
        if self.clip.mode != "fitted":
            raise ValueError("TargetTransform.bounds: a rolling clip has per-row bounds, not one pair")
        return (float(self.clip.lower), float(self.clip.upper))

    def _scale(self, r: Tensor, segment: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        if isinstance(self.scaler, FeatureNormalizer):
            y = self.scaler(r)
            return y, self.scaler.mean.to(r.dtype).expand_as(r), self.scaler.std.to(r.dtype).expand_as(r)
        if isinstance(self.scaler, RollingZScore):
            y = self.scaler(r, segment)
            mean, std, _ = self.scaler.moments(r, segment)
            return y, mean, std
        return r, torch.zeros_like(r), torch.ones_like(r)

    def transform(self, returns: Tensor, segment: Tensor | None = None) -> ScaledTarget:
        """Transformed target plus the per-row (loc, scale) needed to map predictions of it back."""
        if not self.is_fitted:
            raise RuntimeError("TargetTransform is used before fit(): fit it on the training returns first")
        y, loc, scale = self._scale(returns, segment)
        if self.clip is not None:
            y = self.clip(y, segment) if self.clip.mode == "rolling" else self.clip(y)
        return ScaledTarget(y, loc, scale)

    def forward(self, returns: Tensor, segment: Tensor | None = None) -> Tensor:
        return self.transform(returns, segment).value

    def inverse(self, value: Tensor, loc: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        """Map (predicted) transformed targets back to log returns: value·scale + loc; clipping is not undone.

        ``loc``/``scale`` are the per-row statistics from :meth:`transform` (gathered to the prediction's rows and
        broadcastable to it); they are required with rolling scaling and default to the fitted ones otherwise.
        """
        if isinstance(self.scaler, RollingZScore):
            if loc is None or scale is None:
                raise ValueError("TargetTransform.inverse: scale='rolling' needs the per-row loc and scale of transform()")
            return value * scale + loc
        if isinstance(self.scaler, FeatureNormalizer):
            if loc is None and scale is None:
                return self.scaler.inverse(value)
            if loc is None or scale is None:
                raise ValueError("TargetTransform.inverse: pass both loc and scale, or neither")
            return value * scale + loc
        if loc is not None and scale is not None:
            return value * scale + loc
        return value
