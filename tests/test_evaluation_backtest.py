"""Back-test scoring (foxhunt.evaluation.backtest) and the back-test CLI's pieces, on hand-built splits."""

from __future__ import annotations

import math
import re

import pytest
import torch

from foxhunt.data.market import MarketSplit
from foxhunt.evaluation.backtest import equity_curves, format_table, oracle_split_positions, policy_metrics, sortino
from tests._splits import hourly_split


def split(n: int = 8, symbols: int = 2, oracle: bool = False) -> MarketSplit:
    sym = torch.arange(symbols).repeat_interleave(n // symbols)
    returns = torch.tensor([0.01, -0.02, 0.03, 0.0, 0.01, 0.01, -0.01, 0.02])[:n]
    ts = (torch.arange(n) % (n // symbols)) * 3_600_000_000_000 + 1_700_000_000_000_000_000
    valid = torch.ones(n, dtype=torch.bool)
    return MarketSplit(
        "t", [f"S{i}" for i in range(symbols)], ts, sym, torch.ones(n, 5, dtype=torch.float64), returns, returns, valid,
        oracle_mean=returns.double() if oracle else None,
    )


def test_first_bar_marks_each_symbol_start() -> None:
    assert split().first_bar.tolist() == [True, False, False, False, True, False, False, False]


def _book(row_pnl: list[float], stamp: list[int], k: int = 2) -> torch.Tensor:
    """The equal-weight book's log return per timestamp, by hand: log(1 + Σ_s expm1(pnl_s) / K) at each stamp."""
    stamps = sorted(set(stamp))
    return torch.tensor([math.log1p(math.fsum(math.expm1(p) for p, t in zip(row_pnl, stamp) if t == u) / k)
                         for u in stamps], dtype=torch.float64)


def test_policy_metrics_by_hand() -> None:
    """Two symbols are one equal-weight book: one P&L per timestamp, every figure on it."""
    s = split()
    long = torch.ones(8)
    m = policy_metrics({"long": long}, s, cost_bps=10.0, bars_per_year=100.0)["long"]
    # a new symbol starts flat: the position is bought twice (once per symbol), 10 bp each, i.e. log(1 - 0.001)
    rows = s.returns.double() + math.log1p(-1e-3) * torch.tensor([1, 0, 0, 0, 1, 0, 0, 0], dtype=torch.float64)
    pnl = _book(rows.tolist(), [0, 1, 2, 3, 0, 1, 2, 3])
    assert m["n_symbols"] == 2 and m["symbol_weight"] == 0.5 and m["n_bars"] == 4
    assert math.isclose(m["total_log_return"], float(pnl.sum()), rel_tol=1e-12)
    assert math.isclose(m["sharpe"], float(pnl.mean() / pnl.std() * 10.0), rel_tol=1e-9)
    assert math.isclose(m["sortino"], sortino(pnl, 100.0), rel_tol=1e-12)
    assert m["n_trades"] == 2 and m["turnover"] == 0.25  # two buys at half the book each, over 4 timestamps
    gross = policy_metrics({"long": long}, s, cost_bps=10.0, bars_per_year=100.0, weighting="gross")["long"]
    both = torch.tensor([math.log1p(math.expm1(a) + math.expm1(b)) for a, b in zip(rows[:4], rows[4:])],
                        dtype=torch.float64)
    assert gross["symbol_weight"] == 1.0 and math.isclose(gross["total_log_return"], float(both.sum()), rel_tol=1e-12)
    one = policy_metrics({"long": long[:4]}, s.select(s.symbol_index == 0), cost_bps=10.0, bars_per_year=100.0)["long"]
    assert one["n_symbols"] == 1 and one["total_log_return"] == float(rows[:4].sum())  # one symbol: its own series


def test_policy_metrics_count_the_exits_at_excluded_bars() -> None:
    """Each symbol's last bar (no next return) and a data hole force the position flat: the closing costs there count
    in reward per bar, turnover and trades, and total == reward_per_bar * n_bars; a short earns ln(2 - e^r)."""
    s = split()
    s.returns = s.returns.clone()
    s.returns[[3, 7]] = float("nan")  # each symbol's last bar
    s.valid = torch.isfinite(s.returns)
    s.valid[1] = False  # a data hole inside the first symbol
    r = torch.nan_to_num(s.returns.double()).tolist()
    c = math.log1p(-1e-3)
    short = -torch.ones(8)
    m = policy_metrics({"short": short}, s, cost_bps=10.0, bars_per_year=100.0)["short"]
    # counted bars 0, 2, 4, 5, 6; open at 0, close at 1 (hole, counted at 0), open at 2, close at 3 (counted at 2),
    # open at 4, close at 7 (counted at 6); the book counts timestamps 0, 1, 2 (rows 0 + 4, 5, 2 + 6)
    short_log = [math.log(2.0 - math.exp(x)) for x in r]
    rows = [short_log[0] + 2 * c, short_log[2] + 2 * c, short_log[4] + c, short_log[5], short_log[6] + c]
    x = _book(rows, [0, 2, 0, 1, 2])
    assert m["n_bars"] == 3
    assert math.isclose(m["total_log_return"], float(x.sum()), rel_tol=1e-12)
    assert math.isclose(m["reward_per_bar"] * m["n_bars"], m["total_log_return"], rel_tol=1e-12)
    assert math.isclose(m["sharpe"], float(x.mean() / x.std() * 10.0), rel_tol=1e-9)
    assert m["n_trades"] == 6 and math.isclose(m["turnover"], 6 * 0.5 / 3)


def test_sortino_uses_downside_deviation() -> None:
    pnl = torch.tensor([0.02, -0.01, 0.03, -0.02], dtype=torch.float64)
    expected = float(pnl.mean() / math.sqrt((0.01**2 + 0.02**2) / 4) * math.sqrt(252))
    assert math.isclose(sortino(pnl, 252), expected, rel_tol=1e-12)
    assert math.isnan(sortino(torch.tensor([0.01, 0.02], dtype=torch.float64), 252))  # no losing bar


def test_oracle_comes_from_the_data_only() -> None:
    assert oracle_split_positions(split(), 1.0) is None
    pos = oracle_split_positions(split(oracle=True), cost_bps=1.0)
    assert pos is not None and pos.shape == (8,)
    # with perfect knowledge of the next return it is never on the wrong side of a move larger than the cost
    r = split().returns
    assert bool(((pos * r) >= 0).all())


def test_equity_curves_and_table() -> None:
    s = split()
    curves = equity_curves({"flat": torch.zeros(8), "long": torch.ones(8)}, s, cost_bps=0.0)
    assert torch.equal(curves["flat"], torch.zeros(8, dtype=torch.float64))
    torch.testing.assert_close(curves["long"], torch.cumsum(s.returns.double(), 0))
    table = format_table({"long": {"sharpe": 1.5, "total_log_return": 0.04}})
    row = table_rows(table)["long"]
    assert row["Sharpe"] == "+1.50" and row["log return"] == "+0.0400"
    assert row["Sortino"] == "n/a" and row["95% CI"] == "n/a"  # missing metrics print as n/a


def table_rows(table: str) -> dict[str, dict[str, str]]:
    """The rows of a printed back-test table (of both, when it is two), policy -> {header (its lines joined): figure
    as printed}."""
    lines = table.splitlines()
    def cells(line: str) -> list[tuple[int, str]]:  # (right edge, text) of the cells, apart by two spaces or more
        return [(m.end(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", line)]
    rows: dict[str, dict[str, str]] = {}
    for rule in (i for i, line in enumerate(lines) if line and set(line) == {"-"}):
        top = dict(cells(lines[rule - 2]))
        headers = ["policy"] + [f"{top[end]} {text}" if end in top else text for end, text in cells(lines[rule - 1])[1:]]
        for line in lines[rule + 1:]:
            values = [text for _, text in cells(line)]
            if len(values) != len(headers):  # the end of this table
                break
            rows.setdefault(values[0], {}).update(zip(headers, values))
    return rows


def test_reported_tables_carry_significance() -> None:
    """With significance on, every policy's row has its Sharpe SE, a bootstrap interval around its Sharpe and PSRs."""
    from foxhunt.data.datamodule import BarDataModule
    from foxhunt.evaluation.backtest import policy_pnl
    from foxhunt.evaluation.significance import sharpe_summary

    dm = BarDataModule(synthetic_bars=4000, features=["logret_1", "rsi_14", "tod_sin"], known_future=["tod_sin"],
                       lookback=8, horizon=2, cache_dir=None)
    dm.setup()
    s = dm.test_split
    pos = {"long": s.valid.float(), "flat": torch.zeros(len(s))}
    m = policy_metrics(pos, s, cost_bps=1.0, significance=True)
    row = m["long"]
    assert row["sharpe_se"] > 0 and row["sharpe_ci_low"] < row["sharpe"] < row["sharpe_ci_high"]
    assert 0 < row["psr_vs_flat"] < 1 and math.isnan(m["flat"]["psr_vs_flat"])  # a flat series has no Sharpe
    # being buy-and-hold itself: no difference to test (its Sharpe minus its own is 0, no standard error)
    assert row["sharpe_diff_vs_bh"] == 0.0 or math.isnan(row["sharpe_diff_vs_bh"])
    assert math.isnan(row["p_vs_bh"]) and math.isnan(row["p_vs_bh_boot"])
    direct = sharpe_summary(policy_pnl(s.valid.float(), s, 1.0), _bpy(s))
    assert math.isclose(direct["sharpe_se"], row["sharpe_se"], rel_tol=1e-9)
    assert math.isclose(direct["sharpe"], row["sharpe"], rel_tol=1e-9)
    table = format_table(m)
    printed = table_rows(table)["long"]
    assert printed["95% CI"] == f"[{row['sharpe_ci_low']:+.2f}, {row['sharpe_ci_high']:+.2f}]"
    assert printed["SE HAC"] == f"{row['sharpe_se']:.2f}" and printed["p B&H HAC"] == "n/a"
    assert printed["PSR flat"] == f"{row['psr_vs_flat']:.3f}" and table_rows(table)["flat"]["PSR flat"] == "n/a"
    assert printed["Sharpe Lo"] == f"{row['sharpe_lo']:+.2f}"
    assert "Ledoit & Wolf's paired test" in " ".join(table.split())
    if row["n_symbols"] > 1:
        assert f"one book of {int(row['n_symbols'])} symbols" in table


def strategy_pnl(s: MarketSplit) -> torch.Tensor:
    from foxhunt.evaluation.trading import counted_log_returns

    return counted_log_returns(s.valid.double(), torch.nan_to_num(s.returns.double()), 1.0, s.valid, s.first_bar)[s.valid]


def _bpy(s: MarketSplit) -> float:
    from foxhunt.evaluation.backtest import split_bars_per_year

    return split_bars_per_year(s)


def test_equity_figure_shows_every_policy_when_curves_coincide() -> None:
    """Policies with identical positions share one line whose legend names each of them; distinct ones keep theirs."""
    from foxhunt.evaluation.figures import coinciding_policies, equity_figure

    s = split()
    long, flat = torch.ones(8), torch.zeros(8)
    pos = {"tft": long.clone(), "dqn": flat.clone(), "ensemble": long.clone(), "buy_and_hold": long.clone()}
    assert coinciding_policies(pos) == [["tft", "ensemble", "buy_and_hold"], ["dqn"]]
    fig = equity_figure(pos, s, cost_bps=1.0)
    ax_eq = fig.axes[0]
    labels = [t.get_text() for t in ax_eq.get_legend().get_texts()]
    assert labels == ["tft = ensemble = buy_and_hold", "dqn"]
    assert len(ax_eq.get_lines()) == 2 and len(fig.axes[2].get_lines()) == 2
    pos["ensemble"][3] = 0.0  # one bar apart: no longer the same line
    assert coinciding_policies(pos) == [["tft", "buy_and_hold"], ["dqn"], ["ensemble"]]


def test_the_position_panel_of_30000_bars_shows_rolling_mean_positions() -> None:
    """Over 30,000 bars the position panel draws, per line of the equity panel, the mean position over the last 300
    bars (1%), not the positions themselves (which would fill it as a solid band)."""
    import io

    from foxhunt.evaluation.figures import equity_figure, rolling_mean

    n = 30_000
    ts = torch.arange(n) * 3_600_000_000_000 + 1_700_000_000_000_000_000
    returns = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    s = MarketSplit("test", ["A"], ts, torch.zeros(n, dtype=torch.long), torch.zeros(n, 1, dtype=torch.float64),
                    returns, returns, torch.ones(n, dtype=torch.bool))
    flip = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)  # changes every bar
    pos = {"tft": flip, "dqn": torch.where(torch.arange(n) < 15_000, 1.0, -0.5), "ensemble": flip.clone(),
           "buy_and_hold": torch.ones(n)}
    fig = equity_figure(pos, s, cost_bps=1.0)
    ax_pos = fig.axes[2]
    assert ax_pos.get_ylabel() == "position, mean\nof 300 bars" and not ax_pos.collections  # no filled band
    lines = ax_pos.get_lines()
    assert [line.get_label() for line in lines] == ["tft = ensemble", "dqn", "buy_and_hold"]
    tft, dqn, hold = (torch.from_numpy(line.get_ydata()) for line in lines)
    settled = torch.arange(n) >= 299  # the first 299 bars average fewer bars
    assert len(tft) == n and float(tft[settled].abs().max()) < 0.01 and float(hold.min()) == 1.0  # flips average out
    assert dqn[14_999] == 1.0 and dqn[15_299] == -0.5 and math.isclose(float(dqn[15_149]), 0.25, abs_tol=1e-12)
    torch.testing.assert_close(rolling_mean(pos["dqn"], 300, s.first_bar), dqn, rtol=0, atol=0)
    reset = torch.arange(n) % 20_000 == 0  # a series that starts afresh at row 20,000: no earlier value blurs into it
    assert float(rolling_mean(pos["dqn"], 300, reset)[20_000]) == -0.5
    fig.savefig(io.BytesIO(), format="png", dpi=50)  # it renders


def test_the_equity_figure_of_several_symbols_draws_the_book() -> None:
    """Issue 45: a two-symbol policy is drawn as the book its table scores, one point per timestamp (not each
    symbol's bars in turn): the book's cumulative log return after costs, the drawdown of that and its net exposure
    Σ w_s position_s, with the table's weighting. One symbol is still drawn bar by bar."""
    from foxhunt.evaluation.figures import equity_figure, figure_x
    from foxhunt.evaluation.portfolio import book

    s = split()  # two symbols at the same four timestamps
    pos = {"tft": torch.tensor([1.0, 1, 0, -1, 1, 0, 0, 1]), "buy_and_hold": torch.ones(8)}
    for weighting in ("equal", "gross"):
        fig = equity_figure(pos, s, cost_bps=1.0, weighting=weighting)
        ax_eq, ax_dd, ax_pos = fig.axes[:3]
        table = policy_metrics(pos, s, 1.0, weighting=weighting)
        for who, eq, dd, held in zip(pos, ax_eq.get_lines(), ax_dd.get_lines(), ax_pos.get_lines(), strict=True):
            b = book(pos[who], s, 1.0, weighting)
            curve = torch.from_numpy(eq.get_ydata())
            assert len(curve) == 4 and eq.get_label() == who
            torch.testing.assert_close(curve, torch.cumsum(b.pnl, 0), rtol=0, atol=0)
            assert float(curve[-1]) == pytest.approx(table[who]["total_log_return"], abs=1e-12)
            assert -float(dd.get_ydata().min()) == pytest.approx(table[who]["max_drawdown"], abs=1e-12)
            w = 0.5 if weighting == "equal" else 1.0
            torch.testing.assert_close(torch.from_numpy(held.get_ydata()), w * (pos[who][:4] + pos[who][4:]).double())
        assert ax_eq.get_ylabel() == "book's cumulative log\nreturn after costs"
        assert ax_pos.get_xlabel().endswith(f"the book of 2 symbols (S0, S1), {weighting} weight "
                                            f"{0.5 if weighting == 'equal' else 1} each")
    assert figure_x(s).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # where the walk-forward draws a row's fold boundary
    one = split(symbols=1)
    fig = equity_figure({"tft": pos["tft"]}, one, cost_bps=1.0)
    torch.testing.assert_close(torch.from_numpy(fig.axes[0].get_lines()[0].get_ydata()),
                               equity_curves({"tft": pos["tft"]}, one, 1.0)["tft"], rtol=0, atol=0)
    assert fig.axes[0].get_ylabel() == "cumulative log return\nafter costs" and figure_x(one).tolist() == list(range(8))


def test_table_says_what_the_oracle_is_and_which_members_are_held_flat() -> None:
    row = {"sharpe": 1.0}
    assert "oracle: the best causal" in format_table({"oracle": row, "tft": row})
    assert "oracle:" not in format_table({"tft": row})
    held = format_table({"tft": {**row, "held_flat": 1.0, "edge_confidence": 0.17}, "dqn": {**row, "held_flat": 0.0}})
    assert set(table_rows(held)) == {"tft (held flat)", "dqn"}
    assert "held flat (validation edge confidence: tft 0.17): by the do-no-harm rule" in held


def test_the_table_of_every_policy_fits_a_120_column_terminal() -> None:
    """A realistic test-split table (members with weights, one untrained and one held flat, the ensemble, buy-and-hold
    and the oracle, with significance) is at most 120 columns wide, one line per policy, no figure cut short."""
    from foxhunt.data.datamodule import BarDataModule

    dm = BarDataModule(synthetic_bars=8_000, synthetic_bar_seconds=3600, signal_strength=0.1,  # the quickstart's market
                       features=["logret_1", "tod_sin"], known_future=["tod_sin"], lookback=8, horizon=2, cache_dir=None)
    dm.setup()
    s = dm.test_split
    gen = torch.Generator().manual_seed(0)
    oracle = oracle_split_positions(s, cost_bps=1.0)
    assert oracle is not None
    flips = torch.rand(len(s), generator=gen) < 0.3
    pos = {"tft": torch.where(flips, -oracle, oracle), "dqn": torch.zeros(len(s)), "ppo": torch.zeros(len(s)),
           "ensemble": torch.where(flips, 0.0, oracle), "buy_and_hold": s.valid.float(), "oracle": oracle}
    metrics = policy_metrics(pos, s, cost_bps=1.0, significance=True)
    for who, weight in (("tft", 0.6), ("dqn", 0.0), ("ppo", 0.4)):
        metrics[who].update(weight=weight, updates=1500.0, held_flat=0.0, edge_confidence=0.97)
    metrics["dqn"].update(updates=0.0)
    metrics["ppo"].update(held_flat=1.0, edge_confidence=0.41)
    table = format_table(metrics, split="test")
    width = max(len(line) for line in table.splitlines())
    assert width <= 120, f"{width} columns:\n{table}"
    rows = table_rows(table)
    assert list(rows) == ["tft", "dqn (untrained)", "ppo (held flat)", "ensemble", "buy_and_hold", "oracle"], table
    assert "\u2026" not in table and rows["oracle"]["log return"] == f"{metrics['oracle']['total_log_return']:+.4f}"
    assert rows["tft"]["ens. weight"] == "0.600" and rows["oracle"]["trades"] == f"{metrics['oracle']['n_trades']:.0f}"
    assert [header for header, figure in rows["oracle"].items() if figure == "n/a"] == ["ens. weight"]  # all shown
    assert sum(set(line) == {"-"} for line in table.splitlines()) == 2  # the figures, then the Sharpe's significance


def test_figures_too_wide_for_one_table_fill_two() -> None:
    """Sharpes in the hundreds (a few days of minute bars) and a long member name: the Sharpe's significance moves to
    a second table, each within 120 columns, every figure and name whole."""
    row = {"total_log_return": 0.0508, "sharpe": 121.4, "sortino": 188.78, "max_drawdown": 0.0047, "turnover": 0.4005,
           "hit_rate": 0.617, "n_trades": 148.0, "sharpe_se": 30.48, "sharpe_ci_low": 60.34, "sharpe_ci_high": 186.05,
           "psr_vs_flat": 1.0, "sharpe_lo": 98.7, "sharpe_diff_vs_bh": 120.9, "p_vs_bh": 0.0001, "p_vs_bh_boot": 0.001}
    table = format_table({"a_rather_long_member_name": {**row, "weight": 0.5, "updates": 0.0}, "oracle": row})
    assert max(len(line) for line in table.splitlines()) <= 120 and "\u2026" not in table
    assert sum(set(line) == {"-"} for line in table.splitlines()) == 2
    rows = table_rows(table)
    assert list(rows) == ["a_rather_long_member_name (untrained)", "oracle"]
    assert rows["oracle"]["95% CI"] == "[+60.34, +186.05]" and rows["oracle"]["Sharpe"] == "+121.40"
    assert rows["a_rather_long_member_name (untrained)"]["ens. weight"] == "0.500"
    assert set(rows["oracle"]) == {"policy", "log return", "Sharpe", "Sortino", "max DD", "turnover", "hit rate",
                                   "trades", "ens. weight", "Sharpe Lo", "SE HAC", "95% CI", "PSR flat",
                                   "ΔSharpe vs B&H", "p B&H HAC", "p B&H boot"}


def test_policy_metrics_refuse_non_finite_positions_at_decision_bars() -> None:
    """A NaN position at a decision bar made the P&L NaN and the Sharpe a silent 0.00; it is refused by name."""
    s = hourly_split([0.01, -0.02, 0.03, 0.0, 0.01, float("nan")])
    bad = torch.tensor([1.0, float("nan"), 1.0, 0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match=r"ppo: 1 non-finite position"):
        policy_metrics({"long": torch.ones(6), "ppo": bad}, s, cost_bps=1.0, bars_per_year=100.0)
    # outside the decision bars a position is never held (forced flat), so a NaN there is harmless
    ok = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, float("nan")])
    m = policy_metrics({"ppo": ok}, s, cost_bps=1.0, bars_per_year=100.0)["ppo"]
    assert math.isfinite(m["sharpe"]) and math.isfinite(m["total_log_return"])


def test_backtest_cli_prints_the_book_of_several_symbols_and_each_symbols_sharpe(tmp_path, capsys) -> None:
    """``python -m foxhunt.backtest`` on an export of two symbols: the table is the equal-weight book's (its header
    says so, its bars are timestamps), with the paired test against buy-and-hold, and each symbol's own Sharpe below."""
    from foxhunt.backtest import main as backtest
    from foxhunt.lit.dqn import DQNModule
    from tests._export_helpers import small_export

    dqn = DQNModule(window=4, hidden=(8,), n_envs=4, replay_capacity=256, batch_size=8, learning_starts=16)
    dm, root = small_export(tmp_path / "export", {"dqn": dqn}, n_symbols=2, n_bars=600)
    dm.bars.to_csv(tmp_path / "bars.csv", index=False)
    results = backtest(["--checkpoint", str(root), "--data", str(tmp_path / "bars.csv"), "--allow-overlap",
                        "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "one book of 2 symbols, each position a fraction of 1/2 of the equity (equal weight)" in out
    assert "sharpe per symbol" in out and "SYN0" in out and "SYN1" in out
    bh = results["buy_and_hold"]
    assert bh["n_symbols"] == 2 and bh["symbol_weight"] == 0.5 and bh["sharpe_se"] > 0
    assert math.isnan(bh["p_vs_bh"])  # buy-and-hold against itself: nothing to test
    assert "Ledoit & Wolf's paired test" in " ".join(out.split())
