"""BarDataModule: chronological purged splits, train-only statistics, no lookahead, feature cache."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from foxhunt.data import write_bars
from foxhunt.data.datamodule import BarDataModule
from foxhunt.data.synthetic import generate_market

FEATS = ["logret_1", "logret_5", "rsi_14", "std_logret_20", "tod_sin", "tod_cos"]


def _dm(path: Path | None = None, **kw) -> BarDataModule:
    args = {"features": FEATS, "known_future": ["tod_sin", "tod_cos"], "lookback": 16, "horizon": 4, "cache_dir": None,
            "synthetic_bars": 6_000, "synthetic_symbols": 2, "batch_size": 32}
    args.update(kw)
    return BarDataModule(path=None if path is None else str(path), **args)


@pytest.fixture(scope="module")
def market():
    return generate_market(n_bars=6_000, n_symbols=2, seed=3, signal_strength=0.2)


@pytest.fixture
def bars_file(tmp_path: Path, market) -> Path:
    return write_bars(market.bars, tmp_path / "m.parquet")


def test_splits_are_chronological_purged_and_per_symbol(bars_file: Path) -> None:
    dm = _dm(bars_file)
    dm.setup()
    tr, va, te = dm.train_split, dm.val_split, dm.test_split
    assert tr.symbols == va.symbols == ["SYN0", "SYN1"]
    for s in (0, 1):
        t_end = tr.timestamps[tr.symbol_index == s].max()
        v = va.timestamps[va.symbol_index == s]
        t = te.timestamps[te.symbol_index == s]
        assert t_end < v.min() and v.max() < t.min()
        # at least `purge` bars of this symbol lie strictly between the splits
        bars = dm.bars[dm.bars["symbol"] == tr.symbols[s]]
        ts = pd.DatetimeIndex(bars["timestamp"]).asi8
        assert ((ts > int(t_end)) & (ts < int(v.min()))).sum() >= dm.purge == 16 + 4
        assert ((ts > int(v.max())) & (ts < int(t.min()))).sum() >= dm.purge
    n = len(tr) + len(va) + len(te)
    assert abs(len(tr) / n - 0.7) < 0.01
    # every window lies inside its split: the last decision bar of a symbol has no next return in the split
    for split in (tr, va, te):
        last = torch.ones(len(split), dtype=torch.bool)
        last[:-1] = split.symbol_index[1:] != split.symbol_index[:-1]
        assert not split.valid[last].any()
        assert torch.isfinite(split.features).all()
        assert torch.isfinite(split.targets[split.valid]).all()


def test_statistics_fitted_on_train_only(bars_file: Path, tmp_path: Path, market) -> None:
    dm = _dm(bars_file)
    dm.setup()
    changed = market.bars.copy()
    cut = dm.val_split.timestamps.min().item()
    late = pd.DatetimeIndex(changed["timestamp"]).asi8 >= cut
    for col in ("open", "high", "low", "close"):
        changed.loc[late, col] *= np.exp(np.linspace(0, 0.5, late.sum()))
    changed.loc[late, "volume"] *= 7
    # the change is a level shift of 0.25 in log price at the cut: the jump check would rightly flag it
    dm2 = _dm(write_bars(changed, tmp_path / "changed.parquet"), jump_sigmas=None)
    dm2.setup()
    for a, b in zip(dm.feature_normalizer.state_dict().values(), dm2.feature_normalizer.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(dm.target_transform.state_dict().values(), dm2.target_transform.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(dm.train_split.features, dm2.train_split.features)
    assert torch.equal(dm.train_split.targets, dm2.train_split.targets)
    assert not torch.equal(dm.test_split.features, dm2.test_split.features)


def test_no_lookahead_in_features_of_any_split(bars_file: Path, tmp_path: Path, market) -> None:
    """Perturb every bar after a time t: features and the returns of bars before t do not move."""
    dm = _dm(bars_file)
    dm.setup()
    t_cut = int(dm.val_split.timestamps[len(dm.val_split) // 3])
    changed = market.bars.copy()
    late = pd.DatetimeIndex(changed["timestamp"]).asi8 > t_cut
    rng = np.random.default_rng(0)
    factor = np.exp(rng.normal(0, 0.01, late.sum()))
    for col in ("open", "high", "low", "close"):
        changed.loc[late, col] *= factor
    dm2 = _dm(write_bars(changed, tmp_path / "perturbed.parquet"), jump_sigmas=None)  # 1% noise on 0.02% moves: jumps
    dm2.setup()
    a, b = dm.val_split, dm2.val_split
    early = a.timestamps <= t_cut
    assert early.any() and (~early).any()
    assert torch.equal(a.features[early], b.features[early])
    # a return at t uses bar t+1 by definition: only bars strictly before the cut keep their target
    strictly = a.timestamps < t_cut
    nxt = torch.zeros_like(strictly)
    nxt[:-1] = a.timestamps[1:] <= t_cut
    same_sym = torch.zeros_like(strictly)
    same_sym[:-1] = a.symbol_index[1:] == a.symbol_index[:-1]
    keep = strictly & nxt & same_sym
    assert torch.equal(a.targets[keep], b.targets[keep])
    assert not torch.equal(a.features[~early], b.features[~early])


def test_split_dates_and_errors(bars_file: Path, market) -> None:
    ts = market.bars["timestamp"]
    val_start = str(ts.iloc[3000].tz_convert(None))
    test_start = str(ts.iloc[4500].tz_convert(None))
    dm = _dm(bars_file, val_start=val_start, test_start=test_start)
    dm.setup()
    assert int(dm.train_split.timestamps.max()) < pd.Timestamp(val_start, tz="UTC").value
    assert int(dm.test_split.timestamps.min()) >= pd.Timestamp(test_start, tz="UTC").value
    with pytest.raises(ValueError, match="purge=5 is below lookback \\+ horizon = 20"):
        _dm(bars_file, purge=5)
    with pytest.raises(ValueError, match="train_fraction"):
        _dm(bars_file, train_fraction=0.9, val_fraction=0.2)
    with pytest.raises(ValueError, match="known_future features \\['dow_sin'\\] are not among"):
        _dm(bars_file, known_future=["dow_sin"])


def test_window_batches_from_the_datamodule(bars_file: Path) -> None:
    dm = _dm(bars_file)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["x_past"].shape == (32, 16, len(FEATS))
    assert batch["x_future"].shape == (32, 4, 2)
    assert batch["y"].shape == batch["y_raw"].shape == (32, 4)
    split = dm.train_split
    t = batch["t"]
    # y is the transformed raw return of the same rows; y_raw the raw log return
    torch.testing.assert_close(batch["y_raw"][:, 0], split.returns[t])
    expected = (split.returns[t] - split.target_loc[t]) / split.target_scale[t]
    clip = dm.target_transform.clip
    lo, hi = clip.lower, clip.upper
    torch.testing.assert_close(batch["y"][:, 0], expected.clamp(lo.item(), hi.item()), rtol=1e-5, atol=1e-6)


def test_rolling_target_scale_scales_every_step_of_a_window_by_what_is_known_at_its_decision_bar(bars_file: Path) -> None:
    """With a rolling target scale, row t+h's statistics read returns up to t+h-1. A window decided at t is trained on
    (and its forecast mapped back with) row t's statistics at every step, clipped like the stored targets."""
    dm = _dm(bars_file, target_scale="rolling", target_zscore_window=50)
    dm.setup()
    split = dm.train_split
    assert not bool((split.target_scale == split.target_scale[0]).all())  # the statistics vary by row
    batch = next(iter(dm.train_dataloader()))
    t = batch["t"]
    loc, scale = split.target_loc[t][:, None], split.target_scale[t][:, None]
    assert torch.equal(batch["y_loc"], loc.expand(-1, 4)) and torch.equal(batch["y_scale"], scale.expand(-1, 4))
    lo, hi = split.target_bounds
    assert (lo, hi) == (dm.target_transform.clip.lower.item(), dm.target_transform.clip.upper.item())
    torch.testing.assert_close(batch["y"], ((batch["y_raw"] - loc) / scale).clamp(lo, hi))
    torch.testing.assert_close(batch["y"][:, 0], split.targets[t], rtol=1e-5, atol=1e-6)  # step 0: the stored target
    later = split.targets[t + 3]  # the stored target of row t+3 is scaled by row t+3's statistics: not what step 3 is
    assert not torch.allclose(batch["y"][:, 3], later, rtol=1e-3, atol=0)


def test_feature_cache_hit_and_miss(bars_file: Path, tmp_path: Path, caplog) -> None:
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="foxhunt.data"):
        a = _dm(bars_file, cache_dir=str(cache))
        a.setup()
        assert "feature cache miss" in caplog.text
        caplog.clear()
        b = _dm(bars_file, cache_dir=str(cache))
        b.setup()
        assert "feature cache hit" in caplog.text
        caplog.clear()
        c = _dm(bars_file, cache_dir=str(cache), features=FEATS[:-1] + ["logret_10"], known_future=["tod_sin"])
        c.setup()
        assert "feature cache miss" in caplog.text
    assert torch.equal(a.train_split.features, b.train_split.features)
    assert len(list(cache.glob("features-*.safetensors"))) == 2


def test_synthetic_default_market_without_path() -> None:
    dm = _dm(None, synthetic_bars=3_000, synthetic_symbols=1)
    dm.setup()
    assert dm.market is not None and len(dm.bars) == 3_000
    assert dm.train_split.symbols == ["SYN0"]


def test_feature_device_is_checked_and_auto_without_gpu_is_the_cpu_path(bars_file: Path) -> None:
    with pytest.raises(ValueError, match="feature_device"):
        _dm(bars_file, feature_device="tpu")
    a, b = _dm(bars_file), _dm(bars_file, feature_device="auto")
    a.setup()
    b.setup()
    torch.testing.assert_close(a.train_split.features, b.train_split.features, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_features_on_the_gpu_match_the_cpu_path(bars_file: Path) -> None:
    cpu, gpu = _dm(bars_file), _dm(bars_file, feature_device="cuda")
    cpu.setup()
    gpu.setup()
    for s in ("train_split", "val_split", "test_split"):
        x, y = getattr(cpu, s).features, getattr(gpu, s).features
        assert y.device.type == "cpu"
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_target_statistics_never_see_the_purged_bar_after_training(bars_file: Path, tmp_path: Path, market) -> None:
    """At a symbol's last training row the whole series' next return runs into the first purged bar. The split never
    uses that return (a symbol's last row is no decision bar), and now neither does the target fit: a 5% change of
    that purged bar moved the fitted std ~3x and every training target."""
    dm = _dm(bars_file, jump_sigmas=None)
    dm.setup()
    codes = dm.bars["symbol"].astype("category").cat.codes.to_numpy()
    train = dm.split_rows["train"]
    changed = market.bars.copy()
    for s in (0, 1):
        purged = int(train[codes[train] == s].max()) + 1  # the first bar after the symbol's training block
        assert not any(purged in rows for rows in dm.split_rows.values())
        changed.loc[purged, ["open", "high", "low", "close"]] *= 1.05
    dm2 = _dm(write_bars(changed, tmp_path / "purged.parquet"), jump_sigmas=None)
    dm2.setup()
    a, b = dm.target_transform.state_dict(), dm2.target_transform.state_dict()
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for name in ("targets", "target_loc", "target_scale", "returns", "valid"):  # bit for bit (NaN where NaN)
        torch.testing.assert_close(getattr(dm2.train_split, name), getattr(dm.train_split, name), rtol=0, atol=0,
                                   equal_nan=True, msg=name)
    # the fit sees exactly the training split's decision-bar returns
    split = dm.train_split
    r = split.returns[split.valid].double()
    torch.testing.assert_close(dm.target_transform.scaler.mean.double().squeeze(), r.mean(), rtol=1e-5, atol=1e-9)


def test_known_future_inputs_must_be_known_in_advance(bars_file: Path) -> None:
    """Decoder inputs are read at bars t+1..t+H: any feature of the bars there is the future itself."""
    from foxhunt.cli_errors import ConfigError

    feats = FEATS + ["dow_sin"]
    with pytest.raises(ConfigError) as err:
        _dm(bars_file, features=feats, known_future=["tod_sin", "rsi_14", "no_such_feature"])
    assert str(err.value) == (
        "data.known_future: 'rsi_14' is a momentum feature of the bars; 'no_such_feature' is not a registered feature: "
        "a known-future input's values at bars t+1..t+H must be known at decision time t, which only features "
        "computable from the timestamp are (tod_sin, tod_cos, dow_sin, dow_cos, toy_sin, toy_cos)")
    dm = _dm(bars_file, features=feats, known_future=["tod_sin", "dow_sin"])  # calendar features are fine
    assert dm.known_future == ["tod_sin", "dow_sin"]


def test_requested_symbols_missing_from_the_data_are_an_error(bars_file: Path) -> None:
    from foxhunt.data.bars import DataError

    with pytest.raises(DataError) as err:
        _dm(None, synthetic_bars=3_000, symbols=["SYN0", "TYPO"]).setup()
    assert str(err.value) == ("data.symbols: TYPO not in the synthetic market (its symbols: SYN0, SYN1; "
                              "data.synthetic_symbols sets how many)")
    with pytest.raises(DataError) as err:
        _dm(bars_file, symbols=["SYN1", "SYN7"]).setup()
    assert str(err.value) == f"{bars_file}: requested symbol(s) SYN7 not in the data; it holds SYN0, SYN1"
    dm = _dm(None, synthetic_bars=3_000, symbols=["SYN1"])
    dm.setup()
    assert dm.train_split.symbols == ["SYN1"] and len(dm.bars) == 3_000


def test_a_fit_resumed_inside_an_epoch_sees_the_batches_of_an_uninterrupted_one(tmp_path: Path) -> None:
    """The training loader's position travels in the datamodule's state: a fit whose configure_optimizers reads
    trainer.estimated_stepping_batches (as foxhunt's members do, which sets the loader up before Lightning restores
    its loops and so before the loop's own copy of the position could be loaded) resumes from a checkpoint written
    inside an epoch at the next batch, not at the epoch's first."""
    import lightning.pytorch as pl

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(len(FEATS), 1)
            self.seen: list[tuple[int, int, list[int]]] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            self.seen.append((self.current_epoch, batch_idx, batch["t"].tolist()))
            return self.layer(batch["x_past"][:, -1]).pow(2).mean()

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1e-3)
            steps = self.trainer.estimated_stepping_batches  # sets up the train loader now
            return [optimizer], [torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=int(steps))]

    class Crash(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.current_epoch == 1 and batch_idx == 2:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")
                raise RuntimeError("crash")

    def fit(model: Recorder, *callbacks: pl.Callback, ckpt_path: Path | None = None,
            dm: BarDataModule | None = None) -> BarDataModule:
        dm = dm or _dm(synthetic_symbols=1, batch_size=64)
        trainer = pl.Trainer(max_epochs=2, limit_train_batches=5, limit_val_batches=0, accelerator="cpu", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=list(callbacks))
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return dm

    whole = Recorder()
    dm = fit(whole)
    cut = Recorder()
    with pytest.raises(RuntimeError, match="crash"):
        fit(cut, Crash())
    resumed = Recorder()
    fit(resumed, ckpt_path=tmp_path / "mid.ckpt", dm=dm)  # a datamodule that served a whole fit before
    assert len(whole.seen) == 10 and cut.seen == whole.seen[:8]
    assert resumed.seen == whole.seen[8:]
    again = Recorder()
    fit(again, dm=dm)  # and a fresh fit of it after the resume starts from the beginning
    assert again.seen == whole.seen
    state = torch.load(tmp_path / "mid.ckpt", weights_only=True)["BarDataModule"]["train_batches"]
    assert (state["epoch"], state["served"]) == (1, 3)


def test_a_file_of_a_few_bars_is_one_line_naming_it_and_what_it_lacks(tmp_path: Path, market, capsys) -> None:
    """`python -m foxhunt.data` on a file whose bars all fall in the features' warm-up: one error line naming the
    file, the bars it has and about how many the splits need (it used to be FeatureNormalizer.fit's traceback)."""
    from foxhunt.cli_errors import run_command
    from foxhunt.data.__main__ import main
    from foxhunt.data.bars import DataError

    few = write_bars(market.bars[market.bars["symbol"] == "SYN0"].iloc[:150], tmp_path / "few.parquet")
    assert run_command(main, ["--path", str(few)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: data: {few}: too few bars for the features' warm-up and the splits: 150 bars, "
                             "105 in the training split and 0 of them past the features' warm-up of 200 bars"), err[0]
    assert "about 934 bars per symbol" in err[0]  # default features: warm-up 200, lookback 64 + horizon 6, purge 70
    dm = _dm(write_bars(market.bars.iloc[:25], tmp_path / "fewer.parquet"), synthetic_symbols=1)
    with pytest.raises(DataError, match=r"fewer.parquet: too few bars .*: 25 bars, 17 in the training split and 0 of "
                                        r"them past the features' warm-up of 20 bars per symbol \(std_logret_20\)"):
        dm.setup()
    # enough for the warm-up but not for a validation window: the split error names the file and the bars needed
    short = write_bars(market.bars[market.bars["symbol"] == "SYN0"].iloc[:400], tmp_path / "short.parquet")
    assert run_command(main, ["--path", str(short)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: data: the val split has no complete window") and str(short) in line, line
    assert "about 934 bars per symbol needed" in line
    with pytest.raises(DataError, match=r"feature\(s\) rsi_14 have at most one finite value on the 3 training bars"):
        x = torch.ones(3, len(FEATS))
        x[:, dm.feature_names.index("rsi_14")] = math.nan  # degenerate bars: a feature never defined on them
        dm._check_normaliser_rows(x, 10)
