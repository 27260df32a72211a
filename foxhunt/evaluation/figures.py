"""Figures of a validation (equity curves, forecast fan chart, TFT interpretation) and the callback that logs them.

Every figure is a matplotlib ``Figure`` built with the object-oriented API (rendered by Agg, no global pyplot
state). :class:`ValidationFigures` draws them from what the coordinator's validation left in
``pl_module.last_evaluation`` (a :class:`foxhunt.evaluation.backtest.PolicyEvaluation`) and writes them to every
TensorBoard logger of the Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.figure import Figure
from torch import Tensor

from foxhunt.data.market import MarketSplit
from foxhunt.evaluation.backtest import PolicyEvaluation, equity_curves
from foxhunt.evaluation.portfolio import Weighting, book


@dataclass
class Interpretation:
    """What a forecaster attended to: per-sample variable importances and head-averaged attention."""

    static_importance: Tensor  # [B, S]
    encoder_importance: Tensor  # [B, V_enc], selection weights averaged over the lookback
    decoder_importance: Tensor  # [B, V_dec], averaged over the horizon
    attention: Tensor  # [B, H, L + H], decoder queries over all positions, averaged over heads
    static_names: list[str]
    encoder_names: list[str]
    decoder_names: list[str]


_STYLES = ("-", "--", "-.", ":")


def equity_figure(positions: dict[str, Tensor], split: MarketSplit, cost_bps: float,
                  weighting: Weighting = "equal") -> Figure:
    """Equity (cumulative log return after costs), drawdown and rolling mean position of every policy on a split,
    against dates.

    Several symbols are drawn as the book the tables score (:mod:`foxhunt.evaluation.portfolio`, ``weighting``): its
    cumulative log return per timestamp, the drawdown of that, and its net exposure Σ_s w_s position_s; one symbol is
    drawn bar by bar. Policies with identical positions share one line whose legend names all of them ("tft =
    ensemble"), so no member hides behind another; the other lines differ in style, so curves that only nearly
    coincide stay distinguishable. The position panel shows each policy's mean position over the last ~1% of the
    points (``position_window``): over tens of thousands of bars the positions themselves, flipping every few bars,
    would fill the panel as a solid band.
    """
    groups = coinciding_policies(positions)
    lead = {names[0]: positions[names[0]] for names in groups}
    books = {who: book(p, split, cost_bps, weighting) for who, p in lead.items()}
    k = next(iter(books.values())).n_symbols if books else 1
    if k == 1:  # bar by bar, every row of the split
        curves = equity_curves(lead, split, cost_bps)
        held = {who: p.cpu() for who, p in lead.items()}
        stamps, reset = split.timestamps.cpu(), split.first_bar.cpu()
    else:
        curves = {who: torch.cumsum(b.pnl, 0).cpu() for who, b in books.items()}
        held = {who: b.position.cpu() for who, b in books.items()}
        stamps = next(iter(books.values())).timestamps.cpu()
        reset = torch.arange(stamps.numel()) == 0
    n = stamps.numel()
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    ax_eq, ax_dd, ax_pos = fig.subplots(3, 1, sharex=True, height_ratios=[3, 1.3, 1.3])
    x = torch.arange(n).numpy()
    window = position_window(n)
    for i, names in enumerate(groups):
        curve = curves[names[0]]
        label = " = ".join(names)
        style = dict(lw=1.8 if "ensemble" in names else 1.0, ls=_STYLES[i % len(_STYLES)], label=label)
        ax_eq.plot(x, curve.numpy(), **style)
        peak = torch.cummax(torch.cat([torch.zeros(1, dtype=curve.dtype), curve]), 0).values[1:]
        ax_dd.plot(x, (1 - torch.exp(curve - peak)).neg().numpy(), **style)
        ax_pos.step(x, rolling_mean(held[names[0]], window, reset).numpy(), where="post", **style)
    what = "position" if k == 1 else "net exposure"
    ax_eq.set_ylabel("cumulative log return\nafter costs" if k == 1 else "book's cumulative log\nreturn after costs")
    ax_eq.legend(ncol=3, fontsize=8)
    ax_dd.set_ylabel("drawdown" if k == 1 else "book's drawdown")
    ax_pos.set_ylabel(what if window == 1 else f"{what}, mean\nof {window:,} {'bars' if k == 1 else 'timestamps'}")
    ax_pos.set_ylim(-1.1, 1.1 if k == 1 or weighting == "equal" else k + 0.1)
    for ax in (ax_eq, ax_dd, ax_pos):
        ax.grid(alpha=0.3)
    ticks = torch.linspace(0, max(n - 1, 0), 6).round().long().unique()
    ax_pos.set_xticks(ticks.numpy())
    ax_pos.set_xticklabels([_date_label(stamps, int(t)) for t in ticks], fontsize=8)
    present = [split.symbols[i] for i in torch.unique_consecutive(split.symbol_index).tolist()]  # in row order
    if k == 1:
        names = f"symbols {', '.join(present)} in turn" if len(present) > 1 else present[0] if present else ""
        ax_pos.set_xlabel(f"bar date (UTC), split {split.name!r}, {names}")
    else:
        b = next(iter(books.values()))
        ax_pos.set_xlabel(f"timestamp (UTC), split {split.name!r}: the book of {k} symbols ({', '.join(present)}), "
                          f"{weighting} weight {b.weight:.3g} each")
    return fig


def figure_x(split: MarketSplit, weighting: Weighting = "equal") -> Tensor:
    """[T] the x coordinate of each row of ``split`` in :func:`equity_figure`: its row, or for several symbols the
    index of its timestamp among the book's (a row between the book's timestamps at the next one)."""
    b = book(torch.zeros(len(split)), split, 0.0, weighting)
    if b.n_symbols == 1:
        return torch.arange(len(split))
    return torch.searchsorted(b.timestamps.cpu(), split.timestamps.cpu())


def position_window(n_bars: int) -> int:
    """Bars the position panel averages over: about 1% of the split, so it reads the same at any length."""
    return max(1, round(n_bars / 100))


def rolling_mean(values: Tensor, window: int, reset: Tensor) -> Tensor:
    """[T] mean of ``values`` over the last ``window`` bars of the same symbol (fewer at its start; a symbol starts at
    each ``reset`` bar), so one symbol's positions never blur into the next one's."""
    v = values.detach().double().nan_to_num()
    total = torch.cat([torch.zeros(1, dtype=v.dtype), torch.cumsum(v, 0)])
    t = torch.arange(len(v))
    start = torch.cummax(torch.where(reset.cpu(), t, torch.zeros_like(t)), 0).values if len(v) else t
    low = torch.maximum(t - window + 1, start)
    return (total[t + 1] - total[low]) / (t + 1 - low)


def coinciding_policies(positions: dict[str, Tensor]) -> list[list[str]]:
    """Policies grouped by identical positions (hence identical equity), in first-seen order: one line per group."""
    groups: list[list[str]] = []
    for who, p in positions.items():
        p = p.detach().float().cpu()
        for names in groups:
            if torch.equal(positions[names[0]].detach().float().cpu(), p):
                names.append(who)
                break
        else:
            groups.append([who])
    return groups


def _date_label(timestamps: Tensor, i: int) -> str:
    import pandas as pd

    if timestamps.numel() == 0:
        return ""
    return f"{pd.Timestamp(int(timestamps[i]), tz='UTC'):%Y-%m-%d\n%H:%M}"


def fan_chart(forecasts: Tensor, split: MarketSplit, start: int | None = None, length: int = 300) -> Figure:
    """Next-bar forecast quantiles (outer band and median) against the realised log returns over a stretch."""
    ok = torch.isfinite(forecasts[:, 0, :]).all(1).nonzero().squeeze(1).cpu()
    fig = Figure(figsize=(10, 3.5), layout="constrained")
    ax = fig.subplots()
    if ok.numel() == 0:
        ax.set_title("no forecasts")
        return fig
    a = int(ok[0]) if start is None else start
    rows = torch.arange(a, min(a + length, forecasts.shape[0]))
    fc = forecasts[rows, 0, :].cpu().float()
    q = fc.shape[1]
    x = rows.numpy()
    ax.fill_between(x, fc[:, 0].numpy(), fc[:, q - 1].numpy(), alpha=0.3, label="outer quantile band")
    ax.plot(x, fc[:, q // 2].numpy(), lw=1.0, label="median forecast")
    ax.plot(x, split.returns[rows].cpu().numpy(), ".", ms=2, color="k", label="realised next-bar log return")
    ax.set_xlabel(f"bar of split {split.name!r}")
    ax.legend(loc="upper right")
    return fig


def importance_figure(interp: Interpretation, top: int = 20) -> Figure:
    """Bar charts of the mean selection weights: the top encoder variables, decoder variables and static inputs."""
    fig = Figure(figsize=(10, 6), layout="constrained")
    axes = fig.subplots(1, 3, width_ratios=[3, 1.2, 0.8])
    panels = (
        ("encoder (past)", interp.encoder_importance, interp.encoder_names, top),
        ("decoder (known future)", interp.decoder_importance, interp.decoder_names, top),
        ("static", interp.static_importance, interp.static_names, top),
    )
    for ax, (title, weights, names, k) in zip(axes, panels):
        mean = weights.mean(dim=0).cpu()
        order = torch.argsort(mean, descending=True)[:k].flip(0)
        ax.barh([names[i] for i in order.tolist()], mean[order].numpy())
        ax.set_title(title)
        ax.set_xlabel("mean selection weight")
    return fig


def attention_figure(interp: Interpretation, lookback: int) -> Figure:
    """Heat map of head-averaged attention: decoder step (rows) over position relative to the forecast origin."""
    att = interp.attention.mean(dim=0).cpu().numpy()  # [H, L+H]
    horizon, positions = att.shape
    fig = Figure(figsize=(10, 3), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(
        att, aspect="auto", cmap="viridis", extent=(-lookback + 0.5, positions - lookback + 0.5, horizon + 0.5, 0.5)
    )
    lags = range(-lookback + 1, positions - lookback + 1)
    step = max(1, len(lags) // 12)
    ax.set_xticks([lag for lag in lags if lag % step == 0])  # whole lags: bar t+k is column k
    ax.set_yticks(range(1, horizon + 1))
    ax.set_xlabel("position relative to forecast origin t (bars)")
    ax.set_ylabel("horizon step")
    ax.set_title("interpretable attention (mean over heads and batch)")
    fig.colorbar(image, ax=ax)
    return fig


class ValidationFigures(pl.Callback):
    """Logs, after each validation (not the sanity check), the equity curves of every policy, each forecaster's fan
    chart and, for forecasters that can explain themselves (``interpret``), variable importance and attention."""

    def __init__(self, interpret_rows: int = 256) -> None:
        self.interpret_rows = int(interpret_rows)
        self._batch: dict[str, Tensor] | None = None

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if batch_idx == 0 and isinstance(batch, dict):
            self._batch = {k: v[: self.interpret_rows].detach() for k, v in batch.items() if isinstance(v, Tensor)}

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        evaluation = getattr(pl_module, "last_evaluation", None)
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if trainer.sanity_checking or not loggers or not isinstance(evaluation, PolicyEvaluation):
            return
        figures = {f"backtest/equity_{evaluation.split.name}": equity_figure(evaluation.positions, evaluation.split, evaluation.cost_bps)}
        for name, fc in evaluation.forecasts.items():
            figures[f"forecast/{name}/fan_chart_{evaluation.split.name}"] = fan_chart(fc, evaluation.split)
        members = getattr(pl_module, "members", {})
        for name in evaluation.forecasts:
            member = members[name] if name in members else None
            explain = getattr(member, "interpret", None)
            if self._batch is not None and callable(explain) and getattr(member.hparams, "log_figures", True):
                interp = explain(self._batch)
                lookback = interp.attention.shape[-1] - interp.attention.shape[-2]
                figures[f"interpret/{name}/variable_importance"] = importance_figure(interp)
                figures[f"interpret/{name}/attention"] = attention_figure(interp, lookback)
        for lg in loggers:
            for tag, fig in figures.items():
                lg.experiment.add_figure(tag, fig, trainer.global_step, close=False)
        self._batch = None
