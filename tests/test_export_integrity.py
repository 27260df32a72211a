"""The export carries the weights each member trades, and nothing in it changes silently.

- ``<member>.safetensors`` holds the network the member trades with (an agent's validation-selected ``policy_net``,
  its learning network before any choice, no tensor when it holds flat), says which in its header and in
  ``metadata.json``, and ``foxhunt.load`` refuses a file that is not exactly what the reloaded member trades;
- ``metadata.json`` records the SHA-256 of its own canonical form: any edit (one byte of ``lookback``) is one line
  naming it; a re-sealed edit still meets the field checks (run values finite and in range, per field) and tensors of
  another dtype than the model's are refused rather than cast.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from _export_helpers import refusal
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import foxhunt
from foxhunt.data.datamodule import BarDataModule
from foxhunt.export.metadata import FORMAT, metadata_digest
from foxhunt.export.write import export_ensemble
from foxhunt.lit.dqn import DQNModule
from foxhunt.lit.ensemble import EnsembleModule
from foxhunt.lit.member import FLAT
from foxhunt.lit.tft import TFTModule

FEATS = ["logret_1", "logret_2", "rsi_14", "tod_sin", "tod_cos"]


@pytest.fixture(scope="module")
def data() -> BarDataModule:
    dm = BarDataModule(synthetic_bars=1500, features=FEATS, known_future=["tod_sin", "tod_cos"], lookback=8, horizon=2,
                       cache_dir=None)
    dm.setup()
    return dm


def _model(dm: BarDataModule, selected: str) -> EnsembleModule:
    """A bound TFT + DQN ensemble whose DQN has chosen weights on validation (``policy_net``: different from its
    learning network), chosen flat (``flat``) or not chosen yet (``network``)."""
    torch.manual_seed(0)
    model = EnsembleModule(members={
        "tft": TFTModule(hidden_size=8, attention_heads=2, hidden_continuous_size=4),
        "dqn": DQNModule(window=4, hidden=(8,), n_envs=4, replay_capacity=256, batch_size=8, learning_starts=16),
    })
    model.bind(dm.spec)
    dqn = model.member("dqn")
    assert dqn.policy_net is not None and int(dqn.selected_update) == -1
    if selected == "policy_net":
        with torch.no_grad():
            for p in dqn.policy_net.parameters():
                p.add_(torch.randn_like(p))
        dqn.selected_update.fill_(5)
    elif selected == "flat":
        dqn.selected_update.fill_(FLAT)
    return model


@pytest.fixture(scope="module")
def exports(data: BarDataModule, tmp_path_factory) -> dict[str, tuple[EnsembleModule, Path]]:
    out = {}
    for selected in ("policy_net", "flat", "network"):
        model = _model(data, selected)
        root = tmp_path_factory.mktemp(selected) / "export"
        export_ensemble(model, data, root)
        out[selected] = (model, root)
    return out


@pytest.fixture
def export_copy(exports, tmp_path: Path) -> Path:
    out = tmp_path / "export"
    shutil.copytree(exports["policy_net"][1], out)
    return out


def _meta(root: Path) -> dict:
    return json.loads((root / "metadata.json").read_text())


def _write_meta(root: Path, meta: dict, seal: bool = True) -> None:
    """Write metadata.json, with its own SHA-256 recomputed (``seal``) as a tool that knows the format would."""
    if seal:
        meta["metadata_sha256"] = metadata_digest(meta)
    (root / "metadata.json").write_text(json.dumps(meta))


def _rewrite(root: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Rewrite a tensor file, keeping its header, and record its new SHA-256 (a careless tool)."""
    path = root / name
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
    save_file(tensors, str(path), metadata=header)
    meta = _meta(root)
    key = next(k for k, v in meta["files"].items() if v == name)
    meta["sha256"][key] = hashlib.sha256(path.read_bytes()).hexdigest()
    _write_meta(root, meta)




# --- the traded weights ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("selected", ["policy_net", "flat", "network"])
def test_member_file_holds_the_traded_weights_and_reload_trades_them_bit_for_bit(exports, data, selected: str) -> None:
    model, root = exports[selected]
    dqn = model.member("dqn")
    meta = _meta(root)
    assert meta["format_version"] == 3
    assert meta["members"]["dqn"]["traded"] == selected and meta["members"]["tft"]["traded"] == "network"
    with safe_open(str(root / "dqn.safetensors"), framework="pt") as f:
        header = f.metadata()
    assert header == {"format": FORMAT, "member": "dqn", "traded": selected,
                      "selected_update": str(int(dqn.selected_update))}
    in_file = load_file(str(root / "dqn.safetensors"))
    if selected == "flat":
        assert in_file == {}  # it trades nothing: no network to use outside foxhunt
    else:
        traded = dqn.policy_net if selected == "policy_net" else dqn.q_net
        state = traded.state_dict()
        assert set(in_file) == set(state) and all(torch.equal(in_file[k], state[k]) for k in state)
    if selected == "policy_net":  # the learning network is another one: the file is not it
        assert not all(torch.equal(in_file[k], v) for k, v in dqn.q_net.state_dict().items())
    tft_file = load_file(str(root / "tft.safetensors"))
    assert all(torch.equal(tft_file[k], v) for k, v in model.member("tft").network.state_dict().items())

    loaded = foxhunt.load(root)
    for name in ("val", "test"):
        split = data.splits[name]
        mine, theirs = model.positions(split), loaded.model.positions(split)
        assert set(mine) == set(theirs)
        for who in mine:
            assert torch.equal(theirs[who].cpu(), mine[who].cpu()), f"{who} positions on {name} differ after reload"
    test = data.splits["test"]
    if selected == "flat":
        assert not loaded.model.positions(test)["dqn"].any()
    elif selected == "policy_net":  # and what the file's network trades is what the reloaded member trades
        net = loaded.model.member("dqn").policy_network
        assert all(torch.equal(in_file[k], v) for k, v in net.state_dict().items())
        learning = dqn.positions_of(dqn.q_net.eval(), dqn.market_tensors(test))
        assert not torch.equal(learning.float(), loaded.model.positions(test)["dqn"])


def test_a_member_file_holding_the_learning_network_is_refused(exports, export_copy: Path) -> None:
    """Drill: dqn.safetensors written with the learning network (as before), re-hashed: load names the file."""
    model, _ = exports["policy_net"]
    _rewrite(export_copy, "dqn.safetensors", {k: v.contiguous() for k, v in model.member("dqn").q_net.state_dict().items()})
    message = refusal(export_copy)
    assert str(export_copy / "dqn.safetensors") in message and "differs from the policy_net weights" in message


def test_a_member_file_with_a_tensor_missing_is_refused(export_copy: Path) -> None:
    tensors = load_file(str(export_copy / "dqn.safetensors"))
    tensors.pop("head.bias")
    _rewrite(export_copy, "dqn.safetensors", tensors)
    assert "missing ['head.bias']" in refusal(export_copy)


def test_traded_field_that_disagrees_with_the_loaded_member_is_refused(export_copy: Path) -> None:
    meta = _meta(export_copy)
    meta["members"]["dqn"]["traded"] = "network"
    _write_meta(export_copy, meta)
    message = refusal(export_copy)
    assert "metadata.json: members.dqn.traded: says str \"network\", but the loaded member trades 'policy_net'" in message
    meta["members"]["dqn"]["traded"] = "q_net"
    _write_meta(export_copy, meta)
    assert "members.dqn.traded: must be one of network, policy_net, flat" in refusal(export_copy)


# --- metadata.json is hashed -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "old, new",
    [(b'"lookback": 8', b'"lookback": 9'), (b'"horizon": 2', b'"horizon": 3'), (b'"cost_bps": 1.0', b'"cost_bps": 7.0')],
    ids=["lookback", "horizon", "cost_bps"],
)
def test_a_one_byte_edit_of_metadata_is_refused_naming_it(export_copy: Path, old: bytes, new: bytes) -> None:
    """Drill: the audit's edits (lookback 12 -> 13 and horizon 3 -> 2 in spec and data loaded and changed positions)."""
    path = export_copy / "metadata.json"
    raw = path.read_bytes()
    assert raw.count(old) >= 1
    path.write_bytes(raw.replace(old, new))
    message = refusal(export_copy)
    assert message.startswith(f"{path}: its contents' SHA-256 ") and "recorded in its metadata_sha256" in message


def test_metadata_hash_is_of_the_content_not_the_layout(export_copy: Path, data: BarDataModule, exports) -> None:
    """Reformatted (other indentation, key order) but the same values: it loads, to the same positions."""
    meta = _meta(export_copy)
    (export_copy / "metadata.json").write_text(json.dumps(dict(reversed(list(meta.items())))))
    model, _ = exports["policy_net"]
    split = data.splits["test"]
    assert torch.equal(foxhunt.load(export_copy).model.positions(split)["ensemble"], model.positions(split)["ensemble"])
    del meta["metadata_sha256"]
    _write_meta(export_copy, meta, seal=False)
    assert "metadata.json: metadata_sha256: is missing" in refusal(export_copy)
    meta["metadata_sha256"] = "0" * 16
    _write_meta(export_copy, meta, seal=False)
    assert "metadata.json: metadata_sha256: must be 64 lowercase hex digits" in refusal(export_copy)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("reward_scale", "abc", "members.dqn.run.reward_scale: must be a finite positive number or null, got str"),
        ("reward_scale", math.nan, "members.dqn.run.reward_scale: must be a finite positive number or null, got float"),
        ("reward_scale", -2.0, "members.dqn.run.reward_scale: must be a finite positive number or null"),
        ("reward_scale", 0, "members.dqn.run.reward_scale: must be a finite positive number or null"),
        ("cost_bps", "abc", "members.dqn.run.cost_bps: must be a finite number >= 0 or null, got str"),
        ("cost_bps", math.inf, "members.dqn.run.cost_bps: must be a finite number >= 0 or null, got float"),
        ("cost_bps", -0.5, "members.dqn.run.cost_bps: must be a finite number >= 0 or null"),
        ("extra", 1.0, "members.dqn.run.extra: is not a field this foxhunt reads"),
    ],
    ids=lambda v: str(v),
)
def test_run_values_are_checked_per_field(export_copy: Path, field: str, value: object, expected: str) -> None:
    """Drill: re-sealed run values that loaded (then failed later with a bare ValueError, or traded with NaN)."""
    meta = _meta(export_copy)
    meta["members"]["dqn"]["run"][field] = value
    _write_meta(export_copy, meta)
    message = refusal(export_copy)
    assert "metadata.json: " + expected in message, message


def test_run_values_null_and_zero_cost_load(export_copy: Path) -> None:
    meta = _meta(export_copy)
    meta["members"]["dqn"]["run"].update(reward_scale=None, cost_bps=0)
    _write_meta(export_copy, meta)
    dqn = foxhunt.load(export_copy).model.member("dqn")
    assert dqn.reward_scale_used is None and dqn.cost_bps == 0.0


def test_members_optimisation_settings_travel_as_one_mapping(exports, export_copy: Path) -> None:
    """metadata.json holds each member's ``optim`` as one JSON mapping, and ``foxhunt.load`` rebuilds the same
    settings from it."""
    model = exports["policy_net"][0]
    meta = _meta(export_copy)
    loaded = foxhunt.load(export_copy).model
    for name in model.member_names:
        assert meta["members"][name]["init_args"]["optim"] == json.loads(json.dumps(model.member(name).optim.as_dict()))
        assert loaded.member(name).optim == model.member(name).optim


def test_an_export_with_the_optimisation_arguments_beside_the_others_is_refused_in_one_line(export_copy: Path) -> None:
    """An export written before the members took their optimisation settings as one ``optim`` (``lr`` and the rest
    among the member's own arguments) is refused, naming the field; it is not rebuilt with other settings."""
    meta = _meta(export_copy)
    args = meta["members"]["tft"]["init_args"]
    args.update(args.pop("optim"))
    _write_meta(export_copy, meta)
    message = refusal(export_copy)
    assert "metadata.json: members.tft.init_args: " in message and "unexpected keyword argument" in message, message


def test_updates_below_minus_one_are_refused(export_copy: Path) -> None:
    meta = _meta(export_copy)
    meta["members"]["dqn"]["updates"] = -5
    _write_meta(export_copy, meta)
    assert "members.dqn.updates: must be an integer >= -1 (-1: not recorded), got int -5" in refusal(export_copy)


# --- dtypes ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, change, expected",
    [
        ("model.weights", lambda t: t.double(), "tensor 'weights' has dtype float64 in the export, the model expects float32"),
        ("model.held_flat", lambda t: t.float() + 0.5, "tensor 'held_flat' has dtype float32 in the export, the model expects bool"),
        ("model.members.dqn.selected_update", lambda t: t.double() + 0.7,
         "tensor 'members.dqn.selected_update' has dtype float64 in the export, the model expects int64"),
        ("data.feature_normalizer.mean", lambda t: t.double(), "feature normaliser tensor 'mean' has dtype float64"),
    ],
    ids=["float64-weights", "float-flag", "float-update", "float64-normaliser"],
)
def test_tensors_of_another_dtype_are_refused_not_cast(export_copy: Path, key: str, change, expected: str) -> None:
    """Drill: a re-hashed ensemble file with tensors of another dtype (which load_state_dict casts without a word)."""
    state = load_file(str(export_copy / "ensemble.safetensors"))
    state[key] = change(state[key]).contiguous()
    _rewrite(export_copy, "ensemble.safetensors", state)
    message = refusal(export_copy)
    assert str(export_copy / "ensemble.safetensors") in message and expected in message, message


def test_a_narrower_float_widened_exactly_loads(export_copy: Path) -> None:
    """bf16 values (a bf16-true fit's) into the float32 model are exact: accepted."""
    state = load_file(str(export_copy / "ensemble.safetensors"))
    state["model.weights"] = state["model.weights"].bfloat16()
    _rewrite(export_copy, "ensemble.safetensors", state)
    loaded = foxhunt.load(export_copy)
    assert loaded.model.weights.dtype == torch.float32
    assert torch.equal(loaded.model.weights, state["model.weights"].float())


# --- strict JSON -----------------------------------------------------------------------------------------------------


def _strict(text: str) -> dict:
    """Parse as jq or JSON.parse would: a bare NaN or Infinity is an error."""
    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_metadata_is_strict_json_a_figure_without_a_value_is_null(data: BarDataModule, tmp_path: Path) -> None:
    """A NaN figure among the metrics (a flat member's Sharpe) is written as null, and the export still loads."""
    from types import SimpleNamespace

    model = _model(data, "policy_net")
    model.last_evaluation = SimpleNamespace(metrics={"ensemble": {"sharpe": math.nan, "log_return": 0.5,
                                                                  "max_drawdown": -math.inf}})
    root = tmp_path / "export"
    export_ensemble(model, data, root)
    meta = _strict((root / "metadata.json").read_text())
    assert meta["metrics"] == {"ensemble": {"sharpe": None, "log_return": 0.5, "max_drawdown": None}}
    loaded = foxhunt.load(root)
    split = data.splits["test"]
    assert torch.equal(loaded.model.positions(split)["ensemble"], model.positions(split)["ensemble"])


def test_a_non_finite_run_value_stops_the_export_naming_it(data: BarDataModule, tmp_path: Path) -> None:
    """A run value that loading would refuse is not written as null (which would load as 'not recorded')."""
    from foxhunt.export.metadata import ExportError

    model = _model(data, "policy_net")
    model.member("dqn").reward_scale_used = math.nan
    with pytest.raises(ExportError, match=r"metadata.json: members.dqn.run.reward_scale: is not a finite number"):
        export_ensemble(model, data, tmp_path / "export")
    assert not (tmp_path / "export" / "metadata.json").exists()
