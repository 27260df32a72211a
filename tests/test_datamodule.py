"""BarDataModule: chronological purged splits, train-only statistics, no lookahead, feature cache."""

from __future__ import annotations

import logging
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
