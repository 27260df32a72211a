"""An export maps bars to the symbols it was trained on by name (foxhunt.export.symbols).

- the positions (and forecasts) of a symbol do not depend on which other symbols share the file, nor on their order,
  for every member that reads the symbol (TFT, Mamba-2) and for an agent (DQN);
- a symbol the model never saw is refused in one line when a member reads the symbol, and trades, named in the
  back-test's output, when none does;
- the overlap guard is keyed by the time span the model trained and chose on: a renamed symbol of the same bars is
  refused unless --allow-overlap.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
from _export_helpers import small_export

import foxhunt
from foxhunt.data.bars import DataError
from foxhunt.export.symbols import UnseenSymbolError, coded_symbols, export_symbol_codes
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.mamba2 import Mamba2Module
from foxhunt.lit.tft import TFTModule

SYMBOLS = ["SYN0", "SYN1", "SYN2"]


def _dqn() -> DQNModule:
    return DQNModule(window=4, hidden=(8,), n_envs=4, replay_capacity=256, batch_size=8, learning_starts=16)


def _frame(bars: pd.DataFrame, symbols: list[str], rename: dict[str, str] | None = None) -> pd.DataFrame:
    """The bars of ``symbols`` only, their blocks in that order (a categorical column in that order), renamed."""
    names = [(rename or {}).get(s, s) for s in symbols]
    parts = [bars[bars["symbol"] == s].assign(symbol=n) for s, n in zip(symbols, names, strict=True)]
    out = pd.concat(parts, ignore_index=True)
    out["symbol"] = pd.Categorical(out["symbol"], categories=names)
    return out


def _by_symbol(split, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each symbol's rows of ``values`` (in time order), by the symbol's name."""
    return {s: values[split.symbol_index == i] for i, s in enumerate(split.symbols) if bool((split.symbol_index == i).any())}


def test_codes_are_by_name_and_unseen_symbols_follow_the_rule() -> None:
    """A frame's symbols get the export's codes by name, whatever their order or which are present; an unseen one is
    refused in one line naming it and the known symbols when a member reads the symbol, else coded after them."""
    assert export_symbol_codes(["SYN1"], SYMBOLS).tolist() == [1]
    assert export_symbol_codes(["SYN2", "SYN0"], SYMBOLS).tolist() == [2, 0]
    assert export_symbol_codes(["XYZ", "SYN1"], SYMBOLS).tolist() == [3, 1]
    assert coded_symbols(["XYZ", "SYN1"], SYMBOLS) == [*SYMBOLS, "XYZ"]
    with pytest.raises(UnseenSymbolError) as info:
        export_symbol_codes(["SYN1", "XYZ"], SYMBOLS, readers=["tft"], where="new.csv")
    message = str(info.value)
    assert "\n" not in message and message.startswith("new.csv: symbol XYZ never seen")
    assert "SYN0, SYN1, SYN2" in message and "tft" in message


@pytest.fixture(scope="module")
def three_symbols(tmp_path_factory):
    """An untrained TFT + Mamba-2 + DQN ensemble exported from three symbols, and its bars."""
    members = {"tft": TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4),
               "mamba2": Mamba2Module(d_model=16, n_layers=1, d_state=8, headdim=8, native=False),
               "dqn": _dqn()}
    def distinct_symbols(model) -> None:  # untrained, the symbol embeddings barely move a forecast: make them count
        with torch.no_grad():
            model.member("mamba2").network.symbol_embedding.weight.mul_(10.0)

    # at no cost a position follows the forecast interval's sign, which then differs between Mamba-2's symbols
    dm, root = small_export(tmp_path_factory.mktemp("sym") / "export", members, n_symbols=3, prepare=distinct_symbols,
                            cost_bps=0.0)
    return foxhunt.load(root), dm.bars


def test_positions_of_a_symbol_do_not_depend_on_the_other_symbols_in_the_file(three_symbols) -> None:
    """Every subset of the three symbols, in every order: each symbol's forecasts (TFT, Mamba-2) and positions (every
    member and the ensemble) are those of the file holding all three (property over all 15 arrangements)."""
    loaded, bars = three_symbols
    assert loaded.symbol_readers == ["tft", "mamba2"]
    full = loaded.split(_frame(bars, SYMBOLS))
    ref_pos = {k: _by_symbol(full, v) for k, v in loaded.model.positions(full).items()}
    ref_fc = {m: _by_symbol(full, loaded.model.member(m).forecast(full)) for m in ("tft", "mamba2")}
    # the test can fail: SYN1 alone traded with SYN0's code (the file's own order) moves forecasts and positions
    alone = loaded.split(_frame(bars, ["SYN1"]))
    wrong = replace(alone, symbol_index=torch.zeros_like(alone.symbol_index))
    for m in ("tft", "mamba2"):
        assert not torch.allclose(loaded.model.member(m).forecast(wrong), ref_fc[m]["SYN1"], equal_nan=True)
    assert not torch.equal(loaded.model.positions(wrong)["mamba2"], ref_pos["mamba2"]["SYN1"])
    for k in (1, 2, 3):
        for order in itertools.permutations(SYMBOLS, k):
            split = loaded.split(_frame(bars, list(order)))
            assert split.symbols == SYMBOLS
            for m in ("tft", "mamba2"):
                for s, fc in _by_symbol(split, loaded.model.member(m).forecast(split)).items():
                    torch.testing.assert_close(fc, ref_fc[m][s], rtol=1e-5, atol=1e-10, equal_nan=True,
                                               msg=f"{m} {s} in {order}")
            for policy, pos in loaded.model.positions(split).items():
                for s, p in _by_symbol(split, pos).items():
                    assert torch.equal(p, ref_pos[policy][s]), f"{policy} positions of {s} differ in a file of {order}"


def test_an_unseen_symbol_is_refused_in_one_line_when_a_member_reads_it(three_symbols) -> None:
    loaded, bars = three_symbols
    with pytest.raises(UnseenSymbolError) as info:
        loaded.split(_frame(bars, ["SYN0", "SYN1"], rename={"SYN1": "eurusd"}), name="new.csv")
    message = str(info.value)
    assert "\n" not in message
    assert "eurusd never seen" in message and "SYN0, SYN1, SYN2" in message and "tft, mamba2" in message
    # a symbol without bars (a categorical column's unused category) is no symbol of the file
    frame = _frame(bars, ["SYN1"])
    frame["symbol"] = frame["symbol"].cat.add_categories(["eurusd"])
    assert loaded.split(frame).symbols == SYMBOLS


@pytest.fixture(scope="module")
def agent_export(tmp_path_factory) -> tuple[Path, pd.DataFrame]:
    """An untrained DQN alone (no member reads the symbol), exported from one symbol, SYN0."""
    dm, root = small_export(tmp_path_factory.mktemp("dqn") / "export", {"dqn": _dqn()}, n_symbols=1)
    return root, dm.bars


def test_agent_positions_do_not_depend_on_the_symbols_name_or_company(agent_export) -> None:
    """With no member reading the symbol, an unseen symbol trades (coded after the export's) exactly as the bars of
    a known one: the agent reads only features."""
    root, bars = agent_export
    loaded = foxhunt.load(root)
    assert loaded.symbol_readers == []
    ref = loaded.model.positions(loaded.split(bars))["dqn"]
    two = pd.concat([bars.assign(symbol="AAA"), bars], ignore_index=True)
    two["symbol"] = pd.Categorical(two["symbol"], categories=["AAA", "SYN0"])
    split = loaded.split(two)
    assert split.symbols == ["SYN0", "AAA"] and loaded.unseen_symbols(split) == ["AAA"]
    pos = _by_symbol(split, loaded.model.positions(split)["dqn"])
    assert torch.equal(pos["AAA"], ref) and torch.equal(pos["SYN0"], ref)


def test_overlap_guard_is_keyed_by_time_not_symbol_name(agent_export, tmp_path: Path, capsys) -> None:
    """The very bars the model trained on, under another symbol's name, are refused as in-sample (one line naming the
    span and the renamed symbol); with --allow-overlap they trade, and the output says the symbol was never seen."""
    from foxhunt.backtest import main
    from foxhunt.cli_errors import run_command
    from foxhunt.data.io import write_bars

    root, bars = agent_export
    path = write_bars(bars.assign(symbol="eurusd_hourly"), tmp_path / "eurusd_hourly.parquet")
    out = tmp_path / "out"
    with pytest.raises(DataError) as info:
        main(["--checkpoint", str(root), "--data", str(path), "--out", str(out)])
    message = str(info.value)
    assert "\n" not in message and "time span the model was trained or selected on" in message
    assert "eurusd_hourly" in message
    assert run_command(main, ["--checkpoint", str(root), "--data", str(path), "--out", str(out)]) == 2
    capsys.readouterr()
    main(["--checkpoint", str(root), "--data", str(path), "--out", str(out), "--allow-overlap"])
    printed = capsys.readouterr().out
    assert "symbols the model was never trained on (it knows SYN0)" in printed and "eurusd_hourly" in printed


def test_stacked_agents_read_the_symbol_through_the_forecasts() -> None:
    """Under ``combine: stack`` an agent's inputs are the forecasters' forecasts, so it reads the symbol too; without
    stacking only the forecasters do."""
    from foxhunt.export.load import LoadedEnsemble
    from foxhunt.lit.ensemble import EnsembleModule

    def readers(combine: str) -> list[str]:
        model = EnsembleModule(members={"tft": TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4),
                                        "dqn": _dqn()}, combine=combine)
        return LoadedEnsemble(model, None, torch.nn.Identity(), torch.nn.Identity(), {"data": {"symbols": SYMBOLS}}).symbol_readers

    assert readers("stack") == ["tft", "dqn"]
    assert readers("vote") == ["tft"]
