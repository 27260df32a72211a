"""The bar checks of ``load_bars`` on bars as they arrive: each new bar is validated with its symbol's latest accepted
bars as context (order, duplicates, non-finite or inconsistent prices, jumps), then dropped, repaired or refused by the
same policy and in the same one line, and counted."""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from foxhunt.data.bars import DEFAULT_JUMP_SIGMAS, BadBarError, BadBarPolicy, check_policy, validate_bars

CONTEXT = 64  # accepted bars of the symbol the new one is checked against (the jump check's robust scale)


class BarGate:
    """Checks every bar before the session sees it; ``counts`` says how many were dropped or repaired, and why."""

    def __init__(self, on_bad_bar: BadBarPolicy = "drop", jump_sigmas: float | None = DEFAULT_JUMP_SIGMAS,
                 source: str = "live") -> None:
        self.policy = check_policy(on_bad_bar)
        self.jump_sigmas = jump_sigmas
        self.source = source
        self.counts: Counter[str] = Counter()
        self.messages: list[str] = []  # one line per bad bar, for the caller to print

    def admit(self, symbols: Sequence[str], ohlcv: Tensor, timestamp: int, history: dict[str, tuple[Tensor, Tensor]]
              ) -> tuple[list[str], Tensor, list[int]]:
        """The bars to trade at ``timestamp``: (symbols, OHLCV [P', 5], their indices in the input), after the checks
        against ``history`` (per symbol: its accepted timestamps [n] and OHLCV [n, 5], the latest last)."""
        if not symbols:
            return [], ohlcv[:0], []
        empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, 5, dtype=torch.float64))
        parts = [tuple(t[-CONTEXT:] for t in history.get(name, empty)) for name in symbols]
        sizes = np.array([len(ts) + 1 for ts, _ in parts])
        stamps = np.concatenate([np.append(ts.numpy(), timestamp) for ts, _ in parts])
        values = np.concatenate([np.concatenate([past.numpy(), ohlcv[i : i + 1].numpy()]) for i, (_, past) in
                                 enumerate(parts)])
        frame = pd.DataFrame(values, columns=["open", "high", "low", "close", "volume"])  # one frame, every symbol
        frame.insert(0, "timestamp", pd.to_datetime(stamps, utc=True))
        frame["symbol"] = np.repeat(np.asarray(list(symbols), dtype=object), sizes)
        frame["_row"] = np.arange(len(frame))
        when = pd.Timestamp(timestamp, unit="ns", tz="UTC").isoformat()
        try:
            validate_bars(frame, self.source, "raise", self.jump_sigmas)
            return list(symbols), ohlcv, list(range(len(symbols)))
        except BadBarError:
            pass
        ends = np.cumsum(sizes)
        frames = []  # something is wrong: each symbol's bar on its own, with its own reason
        for i, end in enumerate(ends):
            one = frame.iloc[end - sizes[i] : end].reset_index(drop=True)
            one["_row"] = np.arange(len(one))
            one["_new"] = -1
            one.loc[len(one) - 1, "_new"] = i
            frames.append(one)
        names, values, kept_idx = [], [], []
        for i, one in enumerate(frames):
            try:
                validate_bars(one.drop(columns="_new"), self.source, "raise", self.jump_sigmas)
                names.append(symbols[i])
                values.append(ohlcv[i])
                kept_idx.append(i)
                continue
            except BadBarError as e:
                reason = str(e).split(". Pass on_bad_bar", 1)[0].split("): ", 1)[-1]
            line = f"{self.source}: {symbols[i]} at {when}: {reason}"
            if self.policy == "raise":
                raise BadBarError(f"{line} (--on-bad-bar drop or repair to go on)") from None
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                kept = validate_bars(one, self.source, self.policy, self.jump_sigmas)
            kept_new = kept[kept["_new"] >= 0]
            if kept_new.empty:
                self._bad(f"{line}: bar dropped", "dropped")
                continue
            self._bad(f"{line}: bar repaired", "repaired")
            names.append(symbols[i])
            values.append(torch.from_numpy(kept_new[["open", "high", "low", "close", "volume"]].to_numpy(np.float64)[0]))
            kept_idx.append(i)
        out = torch.stack(values) if values else ohlcv[:0]
        return names, out, kept_idx

    def _bad(self, line: str, kind: str) -> None:
        self.counts[kind] += 1
        self.messages.append(line)

    def take_messages(self) -> list[str]:
        """The lines of the bad bars since the last call."""
        out, self.messages = self.messages, []
        return out
