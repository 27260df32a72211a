"""Window batches: exact gathers, symbol and validity boundaries, epoch order, coverage."""

from __future__ import annotations

import math

import pytest
import torch

from foxhunt.data.market import MarketSplit
from foxhunt.data.windows import WindowBatches, valid_window_starts

FEATURES = ["f0", "f1", "tod_sin", "tod_cos", "f4"]


def make_split(
    lengths: tuple[int, ...] = (60, 45, 70), seed: int = 0, invalid: tuple[int, ...] = (), nan_targets: tuple[int, ...] = ()
) -> MarketSplit:
    """Hand-built multi-symbol split: row r of feature c holds 1000*c + r, so any gathered value names its row."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    sym = torch.cat([torch.full((k,), i, dtype=torch.int64) for i, k in enumerate(lengths)])
    close = 100 * torch.exp(torch.cumsum(0.01 * torch.randn(n, generator=gen, dtype=torch.float64), 0))
    returns = torch.full((n,), math.nan, dtype=torch.float64)
    returns[:-1] = torch.log(close[1:]) - torch.log(close[:-1])
    ends = torch.cumsum(torch.tensor(lengths), 0) - 1
    returns[ends] = math.nan  # a symbol's last bar has no next return
    returns = returns.float()
    loc = 0.5 * torch.sin(torch.arange(n, dtype=torch.float32))  # per-row target statistics, as a rolling scale gives
    scale = 1.0 + torch.arange(n, dtype=torch.float32) / n
    targets = (returns - loc) / scale  # a visibly different "preprocessed" target
    targets[list(nan_targets)] = math.nan
    valid = torch.ones(n, dtype=torch.bool)
    valid[:3] = False  # warm-up of the first symbol
    valid[list(invalid)] = False
    rows = torch.arange(n, dtype=torch.float32)
    features = torch.stack([1000 * c + rows for c in range(len(FEATURES))], dim=1)
    ohlcv = torch.stack([close, close, close, close, torch.ones(n, dtype=torch.float64)], dim=1)
    return MarketSplit(
        name="train",
        symbols=[f"S{i}" for i in range(len(lengths))],
        timestamps=torch.arange(n, dtype=torch.int64) * 60_000_000_000,
        symbol_index=sym,
        ohlcv=ohlcv,
        returns=returns,
        targets=targets,
        valid=valid,
        features=features,
        feature_names=list(FEATURES),
        target_loc=loc,
        target_scale=scale,
    )


def naive_starts(split: MarketSplit, lookback: int, horizon: int) -> list[int]:
    """Per-row Python reference for valid_window_starts."""
    sym = split.symbol_index.tolist()
    out = []
    for t in range(len(split)):
        lo, hi = t - lookback + 1, t + horizon
        if lo < 0 or hi >= len(split):
            continue
        if any(sym[r] != sym[t] for r in range(lo, hi + 1)):
            continue
        if not all(bool(split.valid[r]) for r in range(lo, t + 1)):
            continue
        if not all(math.isfinite(split.targets[r]) and math.isfinite(split.returns[r]) for r in range(t, t + horizon)):
            continue
        out.append(t)
    return out


@pytest.mark.parametrize("lookback,horizon", [(1, 1), (8, 3), (20, 6)])
def test_valid_window_starts_matches_naive(lookback: int, horizon: int) -> None:
    split = make_split(invalid=(30, 31, 100), nan_targets=(80, 150))
    got = valid_window_starts(split, lookback, horizon)
    assert got.dtype == torch.int64
    assert got.tolist() == naive_starts(split, lookback, horizon)


def test_no_window_crosses_a_symbol_or_touches_an_invalid_row() -> None:
    lookback, horizon = 10, 4
    split = make_split(invalid=(30, 100), nan_targets=(150,))
    starts = valid_window_starts(split, lookback, horizon)
    assert starts.numel() > 50
    rows = starts[:, None] + torch.arange(-lookback + 1, horizon + 1)
    assert (split.symbol_index[rows] == split.symbol_index[starts][:, None]).all()
    assert split.valid[rows[:, :lookback]].all()
    for bad in (30, 100):  # an invalid row can never be inside a past window
        assert not ((rows[:, :lookback] == bad).any())
    assert not ((rows[:, lookback - 1 : lookback - 1 + horizon] == 150).any())  # target rows t..t+H-1 skip the NaN
    # the three symbol blocks each contribute, and the first starts only after warm-up + lookback
    assert set(split.symbol_index[starts].tolist()) == {0, 1, 2}
    assert int(starts.min()) == 3 + lookback - 1


def test_batch_shapes_dtypes_and_exact_content() -> None:
    split = make_split()
    lookback, horizon = 12, 5
    known = ["tod_sin", "tod_cos"]
    wb = WindowBatches(split, lookback, horizon, batch_size=16, known_future=known, shuffle=True, seed=3)
    batch = next(iter(wb))
    b = 16
    assert batch["x_past"].shape == (b, lookback, len(FEATURES)) and batch["x_past"].dtype == torch.float32
    assert batch["x_future"].shape == (b, horizon, 2) and batch["x_future"].dtype == torch.float32
    assert batch["y"].shape == (b, horizon) and batch["y_raw"].shape == (b, horizon)
    assert batch["symbol"].shape == (b,) and batch["symbol"].dtype == torch.int64
    assert batch["t"].shape == (b,) and batch["t"].dtype == torch.int64
    cols = [FEATURES.index(k) for k in known]
    for i in range(b):  # naive gather, window by window
        t = int(batch["t"][i])
        assert torch.equal(batch["x_past"][i], split.features[t - lookback + 1 : t + 1])
        assert torch.equal(batch["x_future"][i], split.features[t + 1 : t + horizon + 1][:, cols])
        # the split's statistics vary by row (as a rolling scale's do): every step is scaled by the decision row's
        loc, scale = split.target_loc[t], split.target_scale[t]
        assert torch.equal(batch["y"][i], (split.returns[t : t + horizon] - loc) / scale)
        torch.testing.assert_close(batch["y"][i, 0], split.targets[t])  # step 0: the stored target
        assert torch.equal(batch["y_raw"][i], split.returns[t : t + horizon])
        assert torch.equal(batch["y_loc"][i], loc.expand(horizon))
        assert torch.equal(batch["y_scale"][i], scale.expand(horizon))
        assert int(batch["symbol"][i]) == int(split.symbol_index[t])
    # the feature encoding makes the row of every value explicit: past ends at t, future starts at t+1
    assert torch.equal(batch["x_past"][:, -1, 0].long(), batch["t"])
    assert torch.equal(batch["x_future"][:, 0, 0].long(), 2000 + batch["t"] + 1)
    assert torch.isfinite(batch["y"]).all() and torch.isfinite(batch["y_raw"]).all()
    # y_loc / y_scale map y back to the raw return of the same row
    torch.testing.assert_close(batch["y"] * batch["y_scale"] + batch["y_loc"], batch["y_raw"])


def test_constant_statistics_keep_the_stored_targets_and_row_varying_ones_are_clipped_to_the_split_bounds() -> None:
    """Fitted (constant) statistics: the stored targets, bit for bit, per step. Row-varying ones: each step scaled by
    the decision row's statistics, then clipped like the stored targets (the split's ``target_bounds``)."""
    from dataclasses import replace

    split = make_split()
    n = len(split)
    fitted = replace(split, target_loc=torch.full((n,), 0.001), target_scale=torch.full((n,), 0.02),
                     targets=torch.nan_to_num((split.returns - 0.001) / 0.02).clamp(-0.5, 0.5), target_bounds=(-0.5, 0.5))
    batch = next(iter(WindowBatches(fitted, 8, 4, batch_size=32)))
    rows = batch["t"][:, None] + torch.arange(4)
    assert torch.equal(batch["y"], fitted.targets[rows])
    assert torch.equal(batch["y_scale"], fitted.target_scale[rows])

    clipped = replace(split, target_bounds=(-0.004, 0.004))
    batch = next(iter(WindowBatches(clipped, 8, 4, batch_size=32)))
    loc, scale = split.target_loc[batch["t"]][:, None], split.target_scale[batch["t"]][:, None]
    unclipped = (batch["y_raw"] - loc) / scale
    assert bool((unclipped.abs() > 0.004).any()) and bool((unclipped.abs() < 0.004).any())
    assert torch.equal(batch["y"], unclipped.clamp(-0.004, 0.004))


def test_no_known_future_columns_gives_empty_x_future() -> None:
    wb = WindowBatches(make_split(), 8, 3, batch_size=4)
    batch = next(iter(wb))
    assert batch["x_future"].shape == (4, 3, 0)


def test_unknown_known_future_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"dow_sin.*'train'"):
        WindowBatches(make_split(), 8, 3, batch_size=4, known_future=["dow_sin"])


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_start_once_per_epoch(drop_last: bool) -> None:
    split = make_split()
    wb = WindowBatches(split, 6, 2, batch_size=7, shuffle=True, seed=1, drop_last=drop_last)
    starts = valid_window_starts(split, 6, 2)
    batches = list(wb)
    assert len(batches) == len(wb)
    seen = torch.cat([b["t"] for b in batches])
    if drop_last:
        assert len(wb) == starts.numel() // 7 and all(b["t"].numel() == 7 for b in batches)
        assert seen.unique().numel() == seen.numel() == len(wb) * 7
        assert set(seen.tolist()) <= set(starts.tolist())
    else:
        assert len(wb) == math.ceil(starts.numel() / 7)
        assert sorted(seen.tolist()) == starts.tolist()


def test_order_is_seeded_and_changes_across_epochs() -> None:
    split = make_split()

    def epoch_order(wb: WindowBatches) -> list[int]:
        return torch.cat([b["t"] for b in wb]).tolist()

    a = WindowBatches(split, 6, 2, batch_size=32, shuffle=True, seed=7)
    b = WindowBatches(split, 6, 2, batch_size=32, shuffle=True, seed=7)
    c = WindowBatches(split, 6, 2, batch_size=32, shuffle=True, seed=8)
    a0, a1 = epoch_order(a), epoch_order(a)  # a second pass advances the epoch by itself
    assert a0 == epoch_order(b)
    assert a0 != a1 and sorted(a0) == sorted(a1)
    assert a0 != epoch_order(c)
    b.set_epoch(1)
    assert epoch_order(b) == a1  # the order is a function of (seed, epoch) only
    b.set_epoch(0)
    assert epoch_order(b) == a0
    assert b.sampler is b  # Lightning calls set_epoch through dataloader.sampler
    plain = WindowBatches(split, 6, 2, batch_size=32, shuffle=False)
    assert epoch_order(plain) == valid_window_starts(split, 6, 2).tolist() == epoch_order(plain)


def test_works_inside_a_dataloader_with_workers() -> None:
    split = make_split()
    wb = WindowBatches(split, 6, 2, batch_size=9, shuffle=True, seed=2)
    loader = torch.utils.data.DataLoader(wb, batch_size=None, num_workers=2)
    seen = torch.cat([b["t"] for b in loader])
    assert sorted(seen.tolist()) == valid_window_starts(split, 6, 2).tolist()


def test_non_contiguous_symbols_are_rejected() -> None:
    split = make_split(lengths=(20, 20))
    split.symbol_index[5:10] = 1
    with pytest.raises(ValueError, match="contiguous"):
        valid_window_starts(split, 4, 2)


def test_device_argument_moves_the_gathers() -> None:
    wb = WindowBatches(make_split(), 8, 3, batch_size=4, device="cpu")
    assert next(iter(wb))["x_past"].device.type == "cpu"
    if torch.cuda.is_available():
        wb = WindowBatches(make_split(), 8, 3, batch_size=4, device="cuda")
        assert all(v.device.type == "cuda" for v in next(iter(wb)).values())


def test_lightning_reshuffles_each_epoch_through_set_epoch() -> None:
    import lightning.pytorch as pl

    split = make_split()
    wb = WindowBatches(split, 6, 2, batch_size=32, shuffle=True, seed=5)
    ref = WindowBatches(split, 6, 2, batch_size=32, shuffle=True, seed=5)
    expected = []
    for e in range(3):
        ref.set_epoch(e)
        expected.append(torch.cat([b["t"] for b in ref]).tolist())

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(len(FEATURES), 1)
            self.seen: dict[int, list[int]] = {}

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            self.seen.setdefault(self.current_epoch, []).extend(batch["t"].tolist())
            return self.layer(batch["x_past"][:, -1]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    model = Recorder()
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    wb.set_epoch(99)  # stale state: Lightning must overwrite it with the real epoch
    trainer.fit(model, train_dataloaders=wb)
    assert trainer.num_training_batches == len(wb)
    assert [model.seen[e] for e in range(3)] == expected


def _rows(batches) -> list[list[int]]:
    return [b["t"].tolist() for b in batches]


def test_resumes_mid_epoch_from_its_state_dict() -> None:
    """state_dict after k batches of an epoch + load_state_dict into a new loader: the new one serves batches k.. of
    that epoch, then the next epochs in full, and a second cut in the same epoch resumes as exactly."""
    split = make_split()

    def new() -> WindowBatches:
        return WindowBatches(split, 6, 2, batch_size=7, shuffle=True, seed=3, drop_last=True)

    ref = new()
    expected = {}
    for e in (1, 2):
        ref.set_epoch(e)
        expected[e] = _rows(ref)
    n = len(expected[1])
    assert n > 8

    first = new()
    first.set_epoch(1)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    assert (state["epoch"], state["served"]) == (1, 3)
    assert _rows(head) == expected[1][:3]

    second = new()
    second.load_state_dict(state)
    assert second.state_dict() == state  # loaded, not yet resumed: a checkpoint now keeps the same position
    second.set_epoch(1)  # Lightning sets the epoch it resumes, then iterates
    it = iter(second)
    middle = [next(it) for _ in range(2)]
    assert _rows(middle) == expected[1][3:5]
    state = second.state_dict()
    assert (state["epoch"], state["served"]) == (1, 5)  # counts on from the resumed position

    third = new()
    third.load_state_dict(state)  # a plain loop, no set_epoch: the state's epoch is the next pass
    assert _rows(third) == expected[1][5:]
    assert third.state_dict()["served"] == n
    assert _rows(third) == expected[2]  # the next pass is the next epoch, whole


def test_a_position_saved_at_an_epoch_end_starts_the_next_epoch_whole() -> None:
    split = make_split()
    a = WindowBatches(split, 6, 2, batch_size=7, shuffle=True, seed=3)
    a.set_epoch(0)
    list(a)
    b = WindowBatches(split, 6, 2, batch_size=7, shuffle=True, seed=3)
    b.load_state_dict(a.state_dict())
    b.set_epoch(1)
    ref = WindowBatches(split, 6, 2, batch_size=7, shuffle=True, seed=3)
    ref.set_epoch(1)
    assert _rows(b) == _rows(ref)
    fresh = WindowBatches(split, 6, 2, batch_size=7, shuffle=True, seed=3).state_dict()
    assert (fresh["epoch"], fresh["served"]) == (0, 0)  # before any pass: nothing served


def test_a_position_of_other_batches_is_refused_with_a_warning() -> None:
    split = make_split()
    a = WindowBatches(split, 6, 2, batch_size=7, shuffle=True, seed=3)
    it = iter(a)
    next(it)
    b = WindowBatches(split, 6, 2, batch_size=8, shuffle=True, seed=3)
    with pytest.warns(UserWarning, match=r"batch_size 7 -> 8.*restarts from its first batch"):
        b.load_state_dict(a.state_dict())
    assert len(list(b)) == len(b)


def test_lightning_resumes_mid_epoch_through_the_loaders_state(tmp_path) -> None:
    """Lightning's own mechanism: a checkpoint written inside an epoch holds the loader's state_dict, and a fit
    resumed from it sees the rest of that epoch's batches, not its first ones again."""
    import lightning.pytorch as pl

    split = make_split()

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(len(FEATURES), 1)
            self.seen: list[tuple[int, int, list[int]]] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            self.seen.append((self.current_epoch, batch_idx, batch["t"].tolist()))
            return self.layer(batch["x_past"][:, -1]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Crash(pl.Callback):
        def __init__(self, path: str) -> None:
            self.path = path

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.current_epoch == 1 and batch_idx == 2:
                trainer.save_checkpoint(self.path)
                raise RuntimeError("crash")

    def trainer(*callbacks: pl.Callback) -> pl.Trainer:
        return pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))

    def loader() -> WindowBatches:
        return WindowBatches(split, 6, 2, batch_size=16, shuffle=True, seed=5)

    whole = Recorder()
    trainer().fit(whole, train_dataloaders=loader())
    path = str(tmp_path / "mid.ckpt")
    cut = Recorder()
    with pytest.raises(RuntimeError, match="crash"):
        trainer(Crash(path)).fit(cut, train_dataloaders=loader())
    resumed = Recorder()
    trainer().fit(resumed, train_dataloaders=loader(), ckpt_path=path)
    n = len(loader())
    assert cut.seen == whole.seen[: n + 3]
    assert resumed.seen == whole.seen[n + 3 :]


def test_known_future_columns_must_be_known_in_advance() -> None:
    """x_future holds rows t+1..t+H: of the registry's features only the calendar ones (known from the timestamp) may
    be there; rsi_14 is not. A column the registry does not know (a caller's own matrix) is the caller's declaration
    here; BarDataModule, whose columns are all registry features, refuses it (tests/test_datamodule.py)."""
    from foxhunt.cli_errors import ConfigError
    from foxhunt.data.windows import check_known_future

    with pytest.raises(ConfigError) as err:
        WindowBatches(make_split(), 8, 3, batch_size=4, known_future=["tod_sin", "rsi_14"])
    assert str(err.value) == (
        "WindowBatches: known_future: 'rsi_14' is a momentum feature of the bars: a known-future input's values at bars "
        "t+1..t+H must be known at decision time t, which only features computable from the timestamp are (tod_sin, "
        "tod_cos, dow_sin, dow_cos, toy_sin, toy_cos)")
    check_known_future(["f0"], "here", registered_only=True)  # the caller's own column: accepted
    with pytest.raises(ConfigError, match="'f0' is not a registered feature"):
        check_known_future(["f0"], "here")
