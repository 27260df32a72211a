"""The forecaster members (TFT, Mamba-2) under the member protocol: test metrics on the return scale, a standalone
checkpoint of a member bound to the data, the policy interval's check, and forecasts causal bit for bit."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from foxhunt.data.market import MarketSpec
from foxhunt.evaluation.forecast_metrics import forecast_metrics
from foxhunt.lit.mamba2 import Mamba2Module
from foxhunt.lit.tft import TFTModule
from tests.test_tft_module import FEATURES, HORIZON, LOOKBACK, loader, make_split, trainer

SPEC = MarketSpec(list(FEATURES), ["tod_sin"], ["A", "B"], LOOKBACK, HORIZON)


def _bound(cls: type, **kw) -> TFTModule | Mamba2Module:  # type: ignore[no-untyped-def]
    """A member as the coordinator builds it: hyperparameters only, sizes bound from the data."""
    args: dict = {"optim": {"lr": 3e-3, "scheduler": "none", "log_grad_norm_every": 0, **kw.pop("optim", {})}}
    args.update({"hidden_size": 8, "attention_heads": 2, "hidden_continuous_size": 4, "dropout": 0.0}
                if cls is TFTModule else {"d_model": 16, "headdim": 8, "d_state": 8, "chunk_size": 8})
    args.update(kw)
    torch.manual_seed(0)
    m = cls(**args)
    m.bind(SPEC)
    return m


@pytest.mark.parametrize("cls", [TFTModule, Mamba2Module])
def test_test_update_feeds_the_test_metrics_on_the_return_scale(cls: type) -> None:
    """``EnsembleModule.test_step`` calls every forecaster's ``test_update``: the Mamba-2 had none (the protocol's
    NotImplementedError), so testing an ensemble with a Mamba-2 member crashed. Both members add the batch's
    forecasts, mapped back to log returns, against the raw returns."""
    m = _bound(cls).eval()
    batches = list(loader(make_split(scale=2.0), 64, shuffle=False))[:3]
    expected = forecast_metrics(m.quantiles, prefix="test/")
    with torch.no_grad():
        for batch in batches:
            m.test_update(batch)
            expected.update(m.to_return_scale(m(batch).prediction, batch), batch["y_raw"].float())
    got, want = m.test_metrics.compute(), expected.compute()
    assert set(got) == set(want) and "test/quantile_loss" in got
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key)


def test_a_bound_tft_reloads_from_its_standalone_checkpoint(tmp_path: Path) -> None:
    """A TFT bound to the data (no sizes in its hyperparameters, as every config builds it) saves the spec it was
    built for and rebuilds its network from it on load; before, ``load_from_checkpoint`` failed on the network's
    unexpected keys."""
    pl.seed_everything(0, verbose=False)
    m = _bound(TFTModule, optim={"nonfinite": "skip"})
    assert m.hparams.get("n_features") is None
    t = trainer(tmp_path, max_steps=2, limit_val_batches=0)
    t.fit(m, loader(make_split()))
    m.guard.skipped_loss = 3
    path = tmp_path / "tft.ckpt"
    t.save_checkpoint(path)
    loaded = TFTModule.load_from_checkpoint(path, weights_only=False)
    assert loaded.spec == SPEC and loaded.guard.skipped_loss == 3
    batch = next(iter(loader(make_split(), 8, shuffle=False)))
    torch.testing.assert_close(loaded.eval()(batch).prediction, m.eval()(batch).prediction)


@pytest.mark.parametrize("cls", [TFTModule, Mamba2Module])
@pytest.mark.parametrize("interval", [(0.9, 0.1), (0.5, 0.1), (0.9, 0.5)])
def test_a_policy_interval_must_hold_the_median(cls: type, interval: tuple[float, float]) -> None:
    """The forecast policy goes long when the interval's lower quantile clears the cost and short when its upper one
    is below -cost. A reversed interval (0.9, 0.1) would go long on the 90% quantile (nearly always above the
    cost) and an interval beside the median would take one side on less than the median's edge: both refused."""
    with pytest.raises(ValueError, match="policy_interval"):
        cls(policy_interval=interval)


@pytest.mark.parametrize("cls", [TFTModule, Mamba2Module])
def test_policy_intervals_around_the_median_are_accepted(cls: type) -> None:
    for interval in ((0.1, 0.9), (0.5, 0.5), (0.1, 0.5)):
        assert cls(policy_interval=interval).policy_interval == interval


def test_tft_forecast_at_t_is_bit_identical_whatever_comes_after() -> None:
    """The standard is bit for bit (tests/test_tft_model.py checks the known-future inputs within a tolerance only):
    changing the unknown features after bar t, or the known-future inputs after bar t+1+h, leaves forecast step h of
    every row up to t exactly as it was."""
    from foxhunt.data.market import MarketSplit

    split = make_split()
    m = _bound(TFTModule).eval()
    fc = m.forecast(split, batch_size=100)
    ok = torch.isfinite(fc).all(-1).all(-1)
    t0 = 300
    feats = split.features.clone()
    feats[t0 + 1 :, :2] = torch.randn(feats[t0 + 1 :, :2].shape, generator=torch.Generator().manual_seed(1)) * 3
    fc2 = m.forecast(MarketSplit(**{**split.__dict__, "features": feats}), batch_size=100)
    assert torch.equal(fc[: t0 + 1][ok[: t0 + 1]], fc2[: t0 + 1][ok[: t0 + 1]])
    assert not torch.equal(fc[t0 + 1 :][ok[t0 + 1 :]], fc2[t0 + 1 :][ok[t0 + 1 :]])
    batch = next(iter(loader(split, 32, shuffle=False)))
    with torch.no_grad():
        base = m(batch).prediction
        for h in range(HORIZON - 1):
            moved = batch["x_future"].clone()
            moved[:, h + 1 :] += 5.0
            out = m({**batch, "x_future": moved}).prediction
            assert torch.equal(out[:, : h + 1], base[:, : h + 1]) and not torch.equal(out[:, h + 1 :], base[:, h + 1 :])
