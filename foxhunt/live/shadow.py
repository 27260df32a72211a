"""Champion and challengers on one stream: every export decides on the same bars, the champion's positions are traded,
each challenger's are logged as if traded, and a promotion rule declared before the stream decides on their paired
after-cost returns when a challenger replaces the champion.

- **The same bars.** One :class:`~foxhunt.live.gate.BarGate` checks each bar against the champion's history, so a bad
  bar dropped is dropped for all; every model books at one cost (the starting champion's ``cost_bps``).
- **Features stepped once per feature set.** Exports with the same feature names and symbols share one
  :class:`~foxhunt.features.stream.FeatureStream`: it is stepped once a bar and each of them decides on its values
  (:meth:`~foxhunt.live.session.LiveSession.decide_on`); a different feature set steps its own.
- **Logs.** ``DECISIONS`` is what was traded: one row per symbol and bar, the bar, ``ensemble`` (the champion's
  position), ``ready`` and ``latency_us`` (the whole bar's, every model included). Each model also has its own log,
  ``DECISIONS.models/<label>/``, in the single-session format (its members' columns, ``ensemble``, its own
  ``latency_us``), so ``foxhunt.backtest --decisions`` scores a challenger as if it had traded. Without challengers
  (and no retraining) ``DECISIONS`` is the champion's own log, as a lone session writes it.
- **Evidence.** :class:`BookReturns` realises each model's book return per bar as the bars arrive: the P&L of
  :mod:`foxhunt.trading.pnl`, positions flat outside decision bars and an exit at a bar that is not one paid at the
  decision bar before it (:func:`~foxhunt.evaluation.trading.counted_log_returns`), the symbols' sleeves weighted 1/K
  (:func:`~foxhunt.evaluation.portfolio.book`). A bar's return becomes known at the next bar, so a step's evidence is
  the return realised at it; a step counts when some model had a decision bar. Challengers added together form one
  family (the rule's multiple-comparison correction counts them all; one it decided keeps its returns, padded with
  the champion's after its decision). Families are numbered in the order the session starts them (those given at the
  start: 1; each retrain's, and the challengers left after a promotion: the next), the number the rule's ``spending``
  reads.
- **Verdicts.** The rule is asked at every step from the bars it needs on, then every 1% of the bars since
  (:func:`check_due`). ``promote``: the challenger (the best, :func:`~foxhunt.evaluation.promotion.best_promoted`, if several)
  trades from the next bar on; the old champion is retired. ``keep``: the challenger is retired (the rule stopped
  testing it). After a promotion the evidence restarts: the remaining challengers are one new family against the new
  champion from the next bar on (the new champion's past was selected for beating the old one). Every start,
  challenger, promotion and retirement goes to the registry (:mod:`foxhunt.live.registry`).
- **State.** One saved state (:mod:`foxhunt.live.state`, one atomic write) holds every model's session, book and
  evidence and the logs' part counts, so a restart continues exactly, promotions included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from foxhunt.live.log import DecisionLog
from foxhunt.live.replay import BarsAt
from foxhunt.live.session import Decision, LiveSession
from foxhunt.live.state import StateError, load_state, save_state
from foxhunt.trading.pnl import cost_log_returns, log_growth, position_log_returns

MODELS_SUFFIX = ".models"  # DECISIONS.models/<label>/: each model's own decision log


def rows_of(d: Decision, latency_us: float, session: LiveSession, features: bool) -> list[dict]:
    """The decision log's rows of one decision (a lone session's format: every member's column and ``ensemble``)."""
    out = []
    for i, name in enumerate(d.symbols):
        row = {"ts_event": d.timestamp, "symbol": name}
        row.update(dict(zip(("open", "high", "low", "close", "volume"), d.bars[i].tolist(), strict=True)))
        row.update({k: float(v[i]) for k, v in d.positions.items()})
        row.update({"ready": bool(d.ready[i]), "latency_us": float(latency_us)})
        if features:
            c = session.symbols.index(name)
            row.update({f"feature.{f}": float(x) for f, x in zip(session.feature_names, session.rows[c, -1].tolist(),
                                                                   strict=True)})
        out.append(row)
    return out


def traded_rows(d: Decision, latency_us: float) -> list[dict]:
    """The traded log's rows with challengers: the bar, the champion's ``ensemble`` position, ``ready``, latency."""
    out = []
    for i, name in enumerate(d.symbols):
        row = {"ts_event": d.timestamp, "symbol": name}
        row.update(dict(zip(("open", "high", "low", "close", "volume"), d.bars[i].tolist(), strict=True)))
        row.update({"ensemble": float(d.positions["ensemble"][i]), "ready": bool(d.ready[i]),
                    "latency_us": float(latency_us)})
        out.append(row)
    return out


CHECK_SHARE = 100  # past the first 100 bars it can decide on, the rule is checked every 1/100 of the bars so far


def check_due(n: int, needed: int) -> bool:
    """Whether the rule is asked at ``n`` paired bars: from ``needed`` on, every bar for the first ``CHECK_SHARE``,
    then every ``(n - needed) // CHECK_SHARE`` bars. A verdict is a function of the bars (the first bar a sequential test
    crosses), so asking less often only delays acting on it, by at most 1% of the bars so far, and keeps the check's
    cost per bar flat although one check reads every bar."""
    return n >= needed and (n - needed) % max(1, (n - needed) // CHECK_SHARE) == 0


def ahead_for(session: LiveSession, ahead: Tensor | None) -> Tensor | None:
    """The next timestamps [P, H'] a feed gave, for a session of horizon H: as they are when H' >= H, else None (the
    session schedules its own at each symbol's latest spacing, as for a live feed)."""
    if ahead is None or ahead.shape[1] < session.horizon:
        return None
    return ahead


class BookReturns:
    """One model's book return per bar, realised as bars arrive (see the module docstring); its state is tensors."""

    KEYS = ("close", "held", "before", "counted")

    def __init__(self, n_symbols: int, cost_bps: float) -> None:
        self.close = torch.full((n_symbols,), math.nan, dtype=torch.float64)  # each symbol's last close
        self.held = torch.zeros(n_symbols, dtype=torch.float64)  # position decided at its last bar (0 if not counted)
        self.before = torch.zeros(n_symbols, dtype=torch.float64)  # that of the bar before
        self.counted = torch.zeros(n_symbols, dtype=torch.bool)  # its last bar was a decision bar
        self.cost_bps = float(cost_bps)
        self.weight = 1.0 / n_symbols

    def realise(self, codes: Tensor, close: Tensor, ready: Tensor, position: Tensor) -> float | None:
        """Book the bars of ``codes`` (closes, decision-bar flags and the positions decided at them): the book's log
        return earned since these symbols' previous bars, None when none of them was a decision bar."""
        close = close.double()
        prev = self.close[codes]
        counted = self.counted[codes] & torch.isfinite(prev)
        simple = torch.expm1(torch.nan_to_num(torch.log(close) - torch.log(prev), nan=0.0, posinf=0.0, neginf=0.0))
        held = self.held[codes]
        row = position_log_returns(held, simple) + cost_log_returns((held - self.before[codes]).abs(), self.cost_bps)
        row = row + torch.where(ready, torch.zeros_like(row), cost_log_returns(held.abs(), self.cost_bps))  # an exit
        # at a bar that is not a decision bar is paid at the decision bar before it
        now = torch.where(ready, position.double(), torch.zeros_like(held))
        self.before[codes], self.held[codes] = held, now
        self.close[codes], self.counted[codes] = close, ready.bool()
        if not bool(counted.any()):
            return None
        rows = row[counted]
        if self.weight == 1.0:
            return float(rows[0])
        return float(log_growth((self.weight * torch.expm1(rows)).sum()))

    def state_dict(self) -> dict[str, Tensor]:
        return {k: getattr(self, k).clone() for k in self.KEYS}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for k in self.KEYS:
            getattr(self, k).copy_(state[k])


class Series:
    """A growing float64 series with amortised appends (the evidence of one model)."""

    def __init__(self, values: np.ndarray | None = None) -> None:
        self.buf = np.zeros(max(64, 0 if values is None else 2 * values.size))
        self.n = 0
        if values is not None:
            self.buf[: values.size] = values
            self.n = values.size

    def append(self, x: float) -> None:
        if self.n == self.buf.size:
            self.buf = np.concatenate([self.buf, np.zeros(self.buf.size)])
        self.buf[self.n] = x
        self.n += 1

    @property
    def values(self) -> np.ndarray:
        return self.buf[: self.n]


@dataclass
class Model:
    """One export of the run: its label, session, logs, book and evidence (a model the rule kept the champion over
    keeps only its evidence, until its family ends)."""

    label: str
    path: str
    digest: str  # its export digest (LiveSession.export_digest)
    session: LiveSession | None
    book: BookReturns | None
    log: DecisionLog | None
    source: str  # "checkpoint", "challenger" or "retrain"
    start: int = 0  # the evidence step its series begins at
    evidence: Series = field(default_factory=Series)
    decided: int | None = None  # the series length at which the rule kept the champion over it (then retired)
    family: int = 1  # the ordinal of its family in the session (the rule's spending)

    @property
    def number(self) -> int:
        return int(self.label[len("model"):])


class ShadowRunner:
    """A champion and its challengers on one bar stream (see the module docstring)."""

    def __init__(self, champion: str, challengers: Sequence[str], decisions: str | Path, state: str | Path,
                 gate: Any, rule: Any | None = None, registry: Any | None = None, log_features: bool = False,
                 retrainer: Any | None = None, compile_features: bool = False,
                 compile_networks: bool = False) -> None:
        self.decisions, self.state_dir = Path(decisions), Path(state)
        self.gate, self.rule, self.registry, self.retrainer = gate, rule, registry, retrainer
        self.log_features = log_features
        self.compile_features = compile_features  # every session's FeatureStream(compile=...)
        self.compile_networks = compile_networks  # every session's LiveSession(compile_networks=...)
        self.shadowing = bool(challengers) or retrainer is not None
        self.streams: dict[tuple, Any] = {}  # (feature names, symbols) -> the FeatureStream they share
        self.models: list[Model] = []  # the active ones, the champion first
        self.decided: list[Model] = []  # retired by the rule's keep: their evidence stays in their family
        self.retired: list[Model] = []  # retired since the last save: their logs are flushed there
        self.messages: list[str] = []  # lines for the caller to print
        self.next_label = 0
        self.steps = 0  # evidence steps so far
        self.families = 1  # families of challengers started so far (the starting challengers are the first)
        self.bars = 0
        self.last_ts: int | None = None
        self.traded: DecisionLog | None = None  # the traded log, opened by start()
        self.traded_pnl = 0.0
        self.catch_up: list[BarsAt] = []  # bars admitted since a running retrain's data ends
        first = self._model(self._session(champion), champion, "checkpoint")
        self.run_digest = first.digest
        self.cost_bps = float(first.session.model.hparams.cost_bps)
        first.book.cost_bps = self.cost_bps
        self.traded_book = BookReturns(len(first.session.symbols), self.cost_bps)
        self.models.append(first)
        for path in challengers:
            self.models.append(self._model(self._session(path), path, "challenger"))

    # ------------------------------------------------------------------------------------------------ models
    @property
    def champion(self) -> Model:
        return self.models[0]

    @property
    def challengers(self) -> list[Model]:
        return self.models[1:]

    def _session(self, path: str, session: LiveSession | None = None) -> LiveSession:
        """A session of the export at ``path`` (or ``session``, warmed elsewhere) on the feature stream of its feature
        set: the one its feature names and symbols share, or its own."""
        if session is None:
            from foxhunt.export.load import load

            session = LiveSession(load(path), None, compile_features=self.compile_features,
                                  compile_networks=self.compile_networks)
        if self.models:
            mine, theirs = sorted(session.symbols), sorted(self.models[0].session.symbols)
            if mine != theirs:
                raise ValueError(f"{path}: trades symbols {mine}, the champion {theirs}: a challenger must trade the "
                                 "champion's symbols")
        key = (tuple(session.feature_names), tuple(session.symbols))
        if key in self.streams:
            session.features = self.streams[key]  # same names, same bars seen: the shared stream holds its state
        else:
            self.streams[key] = session.features
        return session

    def _log(self, label: str, parts: int = 0) -> DecisionLog | None:
        if not self.shadowing:
            return None
        return DecisionLog(self.decisions.with_name(self.decisions.name + MODELS_SUFFIX) / label, parts=parts)

    def _model(self, session: LiveSession, path: str, source: str) -> Model:
        label = f"model{self.next_label}"
        self.next_label += 1
        return Model(label, str(path), session.export_digest, session,  # its log is opened by start() or restore()
                     BookReturns(len(session.symbols), getattr(self, "cost_bps", 0.0)), None, source)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self, warmup: Any | None = None) -> None:
        """Resume from the saved state if there is one, else warm every model on ``warmup`` (a bar frame; undecided,
        unlogged, unbooked) and register the start."""
        from foxhunt.live.replay import replay
        from foxhunt.live.state import META

        if (self.state_dir / META).is_file():
            self.restore()
            return
        if warmup is not None:
            for b in replay(warmup, self.horizon):
                self._decide_all(b.symbols, b.ohlcv, b.timestamp, b.next_timestamps)
        self.traded = DecisionLog(self.decisions)
        for m in self.models:
            m.log = self._log(m.label)
        rule = None if self.rule is None else self.rule.to_dict()
        self._register("start", self.champion, role="champion", rule=rule, cost_bps=self.cost_bps,
                       symbols=list(self.champion.session.symbols), shadowing=self.shadowing,
                       retrain=None if self.retrainer is None else self.retrainer.declared())
        for m in self.challengers:
            self._register("challenger", m, role="challenger", source=m.source)

    def _register(self, event: str, m: Model, at: int | None = None, **fields: Any) -> None:
        """A registry record of ``m`` at bar time ``at`` (default: the last bar's)."""
        if self.registry is not None:
            self.registry.append(event, at=self.last_ts if at is None else int(at), model=m.label, export=m.path,
                                 sha256=m.digest, **fields)

    def close(self) -> None:
        """Stop a retrain in flight (one line says so) and save."""
        if self.retrainer is not None:
            line = self.retrainer.stop("the stream ended")
            if line:
                self.messages.append(line)
        self.save()

    # ------------------------------------------------------------------------------------------------ each bar
    def _decide_all(self, names: list[str], ohlcv: Tensor, ts: int, ahead: Tensor | None) -> dict[str, Decision]:
        """Every model's decision at this bar: each feature stream stepped once (its time counted in the latency of
        the model that stepped it), every model deciding on its stream's values."""
        stepped: dict[int, tuple[Tensor, Tensor]] = {}
        out = {}
        for m in self.models:
            started = time.perf_counter_ns()
            key = id(m.session.features)
            if key not in stepped:
                stepped[key] = m.session.feature_step(names, ohlcv, ts)
            values, ready = stepped[key]
            out[m.label] = m.session.decide_on(names, ohlcv, ts, values, ready, ahead_for(m.session, ahead),
                                               started_ns=started)
        return out

    @property
    def horizon(self) -> int:
        """The most next timestamps any model reads (a replay schedules that many per bar)."""
        return max(m.session.horizon for m in self.models)

    def on_bar(self, b: BarsAt) -> Decision | None:
        """One timestamp of the stream: gate, every model's decision, the logs, the books, the rule; the champion's
        decision (None when every bar of it was dropped)."""
        start = time.perf_counter_ns()
        self.poll()
        champ = self.champion.session
        names, ohlcv, kept = self.gate.admit(b.symbols, b.ohlcv, b.timestamp, {s: champ.history(s) for s in b.symbols})
        d = None
        if names:
            ahead = b.next_timestamps[kept] if b.next_timestamps.shape[1] else None
            decisions = self._decide_all(names, ohlcv, b.timestamp, ahead)
            returns = {}
            close = ohlcv[:, 3]
            for m in self.models:
                md = decisions[m.label]
                if m.log is not None:
                    m.log.append(rows_of(md, md.latency_us, m.session, self.log_features))
                returns[m.label] = m.book.realise(m.session.codes(names), close, md.ready, md.positions["ensemble"])
            d = decisions[self.champion.label]
            got = self.traded_book.realise(champ.codes(names), close, d.ready, d.positions["ensemble"])
            self.traded_pnl += got or 0.0
            if self.retrainer is not None and self.retrainer.running:
                empty = torch.zeros(len(names), 0, dtype=torch.int64)
                self.catch_up.append(BarsAt(b.timestamp, names, ohlcv, empty if ahead is None else ahead))
            if any(r is not None for r in returns.values()):
                for m in self.models:
                    m.evidence.append(returns[m.label] or 0.0)
                self.steps += 1
                self._judge(b.timestamp)
            d.latency_us = (time.perf_counter_ns() - start) / 1e3
            rows = traded_rows(d, d.latency_us) if self.shadowing else rows_of(d, d.latency_us, champ,
                                                                               self.log_features)
            self.traded.append(rows)
        self.bars += 1
        self.last_ts = b.timestamp
        if self.retrainer is not None and self.retrainer.due(self.bars, b.timestamp):
            self.save()  # the retrain reads the bars traded so far from the flushed log
            self.catch_up = []
            self.messages.extend(self.retrainer.start(self.decisions, b.timestamp))
        return d

    # ------------------------------------------------------------------------------------------------ the rule
    def _judge(self, ts: int) -> None:
        """The rule's verdicts on each family of challengers (added at one step, with any it decided earlier);
        promotions and retirements take effect at the next bar."""
        if self.rule is None or not self.challengers:
            return
        champ = self.champion
        families: dict[tuple[int, int], list[Model]] = {}
        for m in sorted([*self.challengers, *self.decided], key=lambda m: m.number):
            families.setdefault((m.start, m.family), []).append(m)
        promoted: dict[str, Any] = {}
        for (start, ordinal), family in families.items():
            active = [m for m in family if m.decided is None]
            if not active or not check_due(self.steps - start, self.rule.bars_needed):
                continue
            base = champ.evidence.values[start - champ.start:]
            series = {m.label: m.evidence.values if m.decided is None else
                      np.concatenate([m.evidence.values[: m.decided], base[m.decided:]]) for m in family}
            verdicts = self.rule.check(base, series, family=ordinal)
            for m in active:
                v = verdicts[m.label]
                if v.decision == "keep":
                    self._retire(m, ts, f"the rule kept {champ.label}: not better", v)
                elif v.decision == "promote":
                    promoted[m.label] = v
        if promoted:
            from foxhunt.evaluation.promotion import best_promoted

            winner = next(m for m in self.models if m.label == best_promoted(promoted))
            self._promote(winner, ts, promoted[winner.label])

    def _retire(self, m: Model, ts: int, reason: str, verdict: Any | None = None) -> None:
        self.models.remove(m)
        self.retired.append(m)
        if verdict is not None:
            m.decided = m.evidence.n
            self.decided.append(m)
        self._register("retirement", m, ts, reason=reason, evidence=None if verdict is None else verdict.evidence,
                       bars=None if verdict is None else verdict.bars)
        self.messages.append(f"live: {m.label} ({m.path}) retired at {_when(ts)}: {reason}")

    def _promote(self, m: Model, ts: int, verdict: Any) -> None:
        old = self.champion
        self.models.remove(m)
        self.models.insert(0, m)
        self._register("promotion", m, ts, replaces=old.label, evidence=verdict.evidence, bars=verdict.bars)
        self.messages.append(f"live: {m.label} ({m.path}) promoted over {old.label} at {_when(ts)} (on "
                             f"{verdict.bars} bars): it trades from the next bar")
        self._retire(old, ts, f"replaced by {m.label}")
        self.decided = []  # every family ends with the promotion
        if self.challengers:
            self.families += 1
        for other in self.models:  # the evidence restarts against the new champion, the challengers one new family
            other.start, other.evidence, other.family = self.steps, Series(), self.families

    # ------------------------------------------------------------------------------------------------ retraining
    def poll(self) -> None:
        """Start a finished retrain's export as a challenger, or say in one line why not; never waits."""
        if self.retrainer is None:
            return
        result = self.retrainer.poll()
        if result is None:
            return
        catch_up, self.catch_up = self.catch_up, []
        if result.error is not None:
            self.messages.append(result.error)
            return
        try:
            from foxhunt.export.load import load

            session = LiveSession(load(result.export), None, compile_features=self.compile_features,
                                  compile_networks=self.compile_networks)
            session.restore(result.state)  # warmed by the retrain on the bars it trained on
            for b in catch_up:  # then the bars since, on its own feature stream
                if b.timestamp > result.until:
                    session.on_bar(b.symbols, b.ohlcv, b.timestamp, ahead_for(session, b.next_timestamps))
            session = self._session(str(result.export), session)
        except Exception as e:  # the live session goes on untouched
            self.messages.append(f"live: retrain {result.number}: its export {result.export} was not started: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
            return
        m = self._model(session, str(result.export), "retrain")
        self.families += 1
        m.log, m.start, m.family = self._log(m.label), self.steps, self.families
        self.models.append(m)
        self._register("challenger", m, role="challenger", source="retrain", data_until=result.until,
                       retrain=result.number)
        self.messages.append(f"live: retrain {result.number} done: {m.label} ({result.export}) shadows the champion "
                             "from the next bar")

    # ------------------------------------------------------------------------------------------------ state
    def save(self) -> None:
        """Flush every log, then save one state of every model, book and evidence (atomic: the JSON last)."""
        parts = self.traded.flush()
        for m in self.retired:
            if m.log is not None:
                m.log.flush()
            m.log = m.session = m.book = None
        self.retired = []
        tensors: dict[str, Tensor] = {}
        models = []
        for m in [*self.models, *self.decided]:
            active = m.session is not None
            if active:
                tensors.update({f"{m.label}/{k}": v for k, v in m.session.state_dict().items()})
                tensors.update({f"{m.label}/book.{k}": v for k, v in m.book.state_dict().items()})
            tensors[f"{m.label}/evidence"] = torch.from_numpy(m.evidence.values.copy())
            models.append({"label": m.label, "export": m.path, "sha256": m.digest, "source": m.source,
                           "start": m.start, "decided": m.decided, "active": active, "family": m.family,
                           "parts": m.log.flush() if m.log is not None else None})
        tensors.update({f"traded/book.{k}": v for k, v in self.traded_book.state_dict().items()})
        info = {"export": self.run_digest, "parts": parts, "last_timestamp": self.last_ts, "bars": self.bars,
                "bad_bars": dict(self.gate.counts), "models": models, "steps": self.steps,
                "next_label": self.next_label, "families": self.families, "traded_pnl": self.traded_pnl, "cost_bps": self.cost_bps,
                "shadowing": self.shadowing}
        if self.retrainer is not None:
            info["retrain"] = self.retrainer.info()
        save_state(self.state_dir, tensors, info)

    def restore(self) -> None:
        """Continue from the saved state: its models (reopened by path, each verified against its digest), sessions,
        books, evidence and logs."""
        tensors, info = load_state(self.state_dir, self.run_digest)
        opened = {(m.path, m.digest): m for m in self.models}
        self.models, self.decided, self.retired, self.streams = [], [], [], {}
        self.shadowing = bool(info.get("shadowing", self.shadowing))
        for rec in info["models"]:
            m = opened.get((rec["export"], rec["sha256"]))
            if rec["active"]:
                try:
                    session = self._session(rec["export"], None if m is None else m.session)
                except Exception as e:
                    raise StateError(f"{self.state_dir}: model {rec['label']} ({rec['export']}) cannot be reopened: "
                                     f"{str(e).splitlines()[0]}") from None
                if session.export_digest != rec["sha256"]:
                    raise StateError(f"{self.state_dir}: model {rec['label']}'s export {rec['export']} changed since "
                                     "the state was saved (its digest differs)")
                prefix = f"{rec['label']}/"
                mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
                try:
                    session.load_state_dict({k: v for k, v in mine.items()
                                             if not k.startswith("book.") and k != "evidence"})
                except ValueError as e:
                    raise StateError(f"{self.state_dir}: {rec['label']}: {e}") from None
                book = BookReturns(len(session.symbols), self.cost_bps)
                book.load_state_dict({k[len("book."):]: v for k, v in mine.items() if k.startswith("book.")})
                log = self._log(rec["label"], int(rec["parts"] or 0))
            else:
                session = book = log = None
            m = Model(rec["label"], rec["export"], rec["sha256"], session, book, log, rec["source"], int(rec["start"]),
                      Series(tensors[f"{rec['label']}/evidence"].numpy().astype(np.float64)), rec["decided"],
                      int(rec.get("family", 1)))
            (self.models if rec["active"] else self.decided).append(m)
        saved = {(rec["export"], rec["sha256"]) for rec in info["models"]}
        for key, m in opened.items():
            if key not in saved and m.source == "challenger":
                self.messages.append(f"live: --challenger {m.path} not shadowed: the run resumes with the models of "
                                     f"its saved state ({self.state_dir}); challengers are declared at its start")
        self.traded_book.load_state_dict({k[len("traded/book."):]: v for k, v in tensors.items()
                                          if k.startswith("traded/book.")})
        self.traded = DecisionLog(self.decisions, parts=int(info.get("parts", 0)))
        self.next_label, self.steps, self.bars = int(info["next_label"]), int(info["steps"]), int(info["bars"])
        self.families = int(info.get("families", 1))
        self.last_ts, self.traded_pnl = info.get("last_timestamp"), float(info.get("traded_pnl", 0.0))
        self.gate.counts.update(info.get("bad_bars", {}))
        if self.retrainer is not None and "retrain" in info:
            self.retrainer.resume(info["retrain"])
        if self.registry is not None:
            self._register("resume", self.champion, bars=self.bars)


def _when(ts: int) -> str:
    import pandas as pd

    return pd.Timestamp(int(ts), unit="ns", tz="UTC").isoformat()
