"""Forecasters' quality yardstick: the synthetic market with a handful of causal features, the TFT trained on it, and
its test quantile loss and coverage next to those of the market's exact conditional quantiles (the oracle).

``scripts/tft_quality.py`` prints these figures; the learning tests assert them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from scipy.signal import lfilter
from torch import Tensor

from foxhunt.data.market import MarketSplit
from foxhunt.data.synthetic import SyntheticMarket, generate_market
from foxhunt.data.windows import WindowBatches
from foxhunt.evaluation.forecast_metrics import pinball_loss
from foxhunt.lit.member import Forecaster
from foxhunt.lit.tft import TFTModule
from foxhunt.preprocessing import FeatureNormalizer

__all__ = [
    "BASE_FEATURES",
    "KNOWN_FUTURE",
    "QualityData",
    "build_quality_data",
    "evaluate",
    "make_module",
    "train",
    "windows",
]

KNOWN_FUTURE = ["phase_sin", "phase_cos", "gap_log"]
BASE_FEATURES = ["ret", "ret_z", "abs_ret_z", "log_vol_fast", "log_vol_slow"] + KNOWN_FUTURE


@dataclass
class QualityData:
    """Train/val/test splits of one synthetic market, the causal target scale, and the oracle on every row."""

    market: SyntheticMarket
    splits: dict[str, MarketSplit]
    target_scale: dict[str, Tensor]  # float32 [T] per split: y = next return / scale (known at the row)
    oracle_quantiles: dict[str, np.ndarray]  # [T, Q] per split, for `quantiles`
    quantiles: tuple[float, ...]
    known_future: list[str]
    lookback: int
    horizon: int
    normalizer: FeatureNormalizer  # fitted on the train split's features


def _ewma(x: np.ndarray, alpha: float, init: float) -> np.ndarray:
    """Causal EWMA y[t] = (1 - alpha) y[t-1] + alpha x[t], y[-1] = init."""
    y, _ = lfilter([alpha], [1.0, alpha - 1.0], x, zi=[(1.0 - alpha) * init])
    return y


_WARMUP = 200  # bars before a symbol's features are used; the volatility seed is their mean square


def _symbol_features(ts_ns: np.ndarray, close: np.ndarray, bar_seconds: int, bars_per_session: int, n_extra: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Causal features of one symbol (row t reads bars <= t, calendar of bar t), the target scale, and warm-up mask."""
    n = close.shape[0]
    logc = np.log(close)
    r = np.zeros(n)
    r[1:] = np.diff(logc)
    var0 = float(np.mean(r[1 : min(n, _WARMUP)] ** 2))  # seeded from the warm-up bars only: no row after them reads later bars
    fast = np.sqrt(_ewma(r * r, 0.06, var0))
    slow = np.sqrt(_ewma(r * r, 0.01, var0))
    prev_fast = np.r_[math.sqrt(var0), fast[:-1]]
    ret_z = r / prev_fast
    gap = np.zeros(n)
    gap[1:] = np.maximum(np.diff(ts_ns) / (bar_seconds * 1e9) - 1.0, 0.0)
    # position in the trading session (a new session starts after any gap): calendar, known in advance
    new_session = np.r_[True, gap[1:] > 0]
    session_id = np.cumsum(new_session) - 1
    start_idx = np.flatnonzero(new_session)
    pos = np.arange(n) - start_idx[session_id]
    phase = pos / bars_per_session  # the calendar's bars per full session (not counted from the data: a later bar
    # could change the count)
    cols = [r, ret_z, np.abs(ret_z), np.log(fast), np.log(slow), np.sin(2 * np.pi * phase), np.cos(2 * np.pi * phase), np.log1p(gap)]
    for i in range(n_extra):  # extra inputs for width benchmarks: lagged/smoothed returns and noise
        kind = i % 3
        if kind == 0:
            lag = 1 + i // 3
            cols.append(np.r_[np.zeros(lag), ret_z[:-lag]])
        elif kind == 1:
            cols.append(_ewma(ret_z, 1.0 / (2 + i), 0.0))
        else:
            cols.append(rng.standard_normal(n))
    warm = np.arange(n) >= _WARMUP
    return np.stack(cols, axis=1), slow, warm


def build_quality_data(
    n_bars: int = 200_000,
    *,
    seed: int = 0,
    signal_strength: float = 0.1,
    n_symbols: int = 1,
    lookback: int = 64,
    horizon: int = 6,
    quantiles: tuple[float, ...] = (0.1, 0.5, 0.9),
    fractions: tuple[float, float] = (0.7, 0.15),
    n_extra_features: int = 0,
) -> QualityData:
    """Generate the market, compute causal features, split chronologically with a purge, fit the normaliser on train."""
    market = generate_market(n_bars=n_bars, n_symbols=n_symbols, seed=seed, signal_strength=signal_strength)
    bars = market.bars
    ts = pd.DatetimeIndex(bars["timestamp"]).as_unit("ns").asi8
    symbols = list(market.symbols)
    sym = pd.Categorical(bars["symbol"], categories=symbols).codes.astype(np.int64)
    close = bars["close"].to_numpy(np.float64)
    next_ret = market.next_returns()
    rng = np.random.default_rng(seed + 1)
    feats, scale, warm = [], [], []
    for s in range(len(symbols)):
        rows = sym == s
        f, sc, w = _symbol_features(ts[rows], close[rows], market.params.bar_seconds, market.params.bars_per_session,
                                   n_extra_features, rng)
        feats.append(f), scale.append(sc), warm.append(w)
    features, target_scale, warm_ok = np.concatenate(feats), np.concatenate(scale), np.concatenate(warm)
    names = BASE_FEATURES + [f"extra_{i}" for i in range(n_extra_features)]
    oracle_q = market.oracle_quantile(list(quantiles))
    # chronological split by bar position within each symbol (symbols share one calendar), purged
    pos = np.concatenate([np.arange(int((sym == s).sum())) for s in range(len(symbols))])
    n_per = int(pos.max()) + 1
    purge = lookback + horizon
    a = int(n_per * fractions[0])
    b = int(n_per * (fractions[0] + fractions[1]))
    bounds = {"train": (0, a), "val": (a + purge, b), "test": (b + purge, n_per)}
    ohlcv = bars[["open", "high", "low", "close", "volume"]].to_numpy(np.float64)
    splits, scales, oracles = {}, {}, {}
    normalizer = FeatureNormalizer()
    for name, (lo, hi) in bounds.items():
        rows = (pos >= lo) & (pos < hi)
        ret = torch.from_numpy(next_ret[rows]).float()
        sc = torch.from_numpy(target_scale[rows]).float()
        x = torch.from_numpy(features[rows]).float()
        if name == "train":
            normalizer.fit(x[torch.from_numpy(warm_ok[rows])], names)
        splits[name] = MarketSplit(
            name=name,
            symbols=symbols,
            timestamps=torch.from_numpy(ts[rows]),
            symbol_index=torch.from_numpy(sym[rows]),
            ohlcv=torch.from_numpy(ohlcv[rows]),
            returns=ret,
            targets=ret / sc,
            target_loc=torch.zeros_like(sc),
            target_scale=sc,
            valid=torch.from_numpy(warm_ok[rows]) & torch.isfinite(ret),
            features=normalizer(x).contiguous(),
            feature_names=list(names),
        )
        scales[name] = sc
        oracles[name] = oracle_q[rows]
    return QualityData(
        market, splits, scales, oracles, tuple(quantiles), list(KNOWN_FUTURE), lookback, horizon, normalizer
    )


def windows(data: QualityData, split: str, batch_size: int, shuffle: bool = False, seed: int = 0) -> WindowBatches:
    """Window batches of a split; they carry ``y_scale`` (the split's target scale) to map forecasts back."""
    return WindowBatches(
        data.splits[split],
        lookback=data.lookback,
        horizon=data.horizon,
        batch_size=batch_size,
        known_future=data.known_future,
        shuffle=shuffle,
        seed=seed,
        drop_last=shuffle,
    )


def make_module(data: QualityData, **overrides) -> TFTModule:  # type: ignore[no-untyped-def]
    """A TFTModule sized for ``data`` (its features, known-future inputs, symbols, lookback, horizon, quantiles)."""
    split = data.splits["train"]
    kwargs = {
        "n_features": split.n_features,
        "n_known_future": len(data.known_future),
        "n_symbols": len(split.symbols),
        "lookback": data.lookback,
        "horizon": data.horizon,
        "quantiles": data.quantiles,
        "feature_names": split.feature_names,
        "known_future_names": data.known_future,
        "symbol_names": split.symbols,
    }
    kwargs.update(overrides)
    return TFTModule(**kwargs)


def train(
    data: QualityData,
    *,
    steps: int,
    batch_size: int = 128,
    seed: int = 0,
    precision: str = "32-true",
    val_every: int | None = None,
    logger: object = False,
    **module_kwargs,
) -> tuple[TFTModule, pl.Trainer]:
    """Fit for ``steps`` optimizer steps with gradient clipping; validation only if ``val_every`` is given."""
    pl.seed_everything(seed, workers=True, verbose=False)
    module = make_module(data, **module_kwargs)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        precision=precision,
        gradient_clip_val=1.0,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0 if val_every is None else 20,
        val_check_interval=val_every,
        check_val_every_n_epoch=None if val_every is not None else 1,
        num_sanity_val_steps=0,
        deterministic=False,
    )
    train_dl = windows(data, "train", batch_size, shuffle=True, seed=seed)
    val_dl = windows(data, "val", 512)
    trainer.fit(module, train_dataloaders=train_dl, val_dataloaders=val_dl)
    return module, trainer


@torch.no_grad()
def evaluate(module: Forecaster, data: QualityData, split: str = "test", batch_size: int = 1024) -> dict[str, float]:
    """A forecaster against the oracle on the first horizon step of every window of ``split``: quantile loss, interval
    coverage and their ratios (the ``tft_*`` keys hold the module's figures, whichever forecaster it is)."""
    module.eval()
    qs = torch.tensor(data.quantiles)
    tft_loss, oracle_loss, tft_in, oracle_in, n = 0.0, 0.0, 0.0, 0.0, 0
    oracle = torch.from_numpy(data.oracle_quantiles[split]).float()
    train_r = data.splits["train"].returns
    train_r = train_r[torch.isfinite(train_r)]
    unconditional = torch.quantile(train_r.double(), qs.double()).float()  # the no-skill forecast
    base_loss = 0.0
    for batch in windows(data, split, batch_size):
        pred = module.to_return_scale(module(batch).prediction, batch)[:, 0]  # [B, Q], h = 0
        y = batch["y_raw"][:, 0]
        orc = oracle[batch["t"]]
        tft_loss += float(pinball_loss(pred, y, qs).mean(-1).sum())
        oracle_loss += float(pinball_loss(orc, y, qs).mean(-1).sum())
        base_loss += float(pinball_loss(unconditional.expand_as(orc), y, qs).mean(-1).sum())
        tft_in += float(((y >= pred[:, 0]) & (y <= pred[:, -1])).sum())
        oracle_in += float(((y >= orc[:, 0]) & (y <= orc[:, -1])).sum())
        n += y.numel()
    return {
        "rows": n,
        "tft_quantile_loss": tft_loss / n,
        "oracle_quantile_loss": oracle_loss / n,
        "loss_ratio": tft_loss / oracle_loss,
        "unconditional_loss_ratio": base_loss / oracle_loss,
        "gap_closed": (base_loss - tft_loss) / (base_loss - oracle_loss),
        "tft_coverage": tft_in / n,
        "oracle_coverage": oracle_in / n,
        "nominal_coverage": data.quantiles[-1] - data.quantiles[0],
    }
