"""Int8 members with static scales: ONNX Runtime's static quantisation of each float graph, calibrated on the training
split only, and how far what the quantised export trades moves from the float export's trading.

Static, never dynamic: ONNX Runtime's dynamic quantisation computes each activation's scale from the batch it is
called on, so a bar's output depends on which other symbols share its call (onnxruntime issue 10111) and the back-test
no longer predicts live trading. ``quantize_static`` fixes every scale once, from calibration inputs: weights int8 per
output channel, activations uint8 with their ranges (MinMax) over the calibration set, in QDQ form; the weight layers
(MatMul, Gemm and Conv nodes with a weight operand, :func:`weight_layers`) are quantised, the rest (norms, LSTM,
attention's scores and softmax, the SSD scan's products) stays float.

The calibration set is the training split rebuilt from the export's recorded fit config
(:func:`~foxhunt.export.splits.recorded_training_split`): never a validation or test bar. From it, up to ``rows``
decision bars evenly spread: a forecaster's windows at those bars, exactly as its ``forecast`` batches them; an
agent's window under every held position (what ``greedy_table`` evaluates), or for a continuous policy under the
position its float policy held coming in.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from foxhunt.data.market import MarketSplit
from foxhunt.export.metadata import ExportError, error_line, serving_bytes, sha256_hex
from foxhunt.export.onnx import FLOAT, INT8, member_graph, record_serving, run_session, signature
from foxhunt.files import atomic_file
from foxhunt.lit.member import Agent, Member

CALIBRATION_ROWS = 4096
BATCH = 256  # calibration rows per ONNX Runtime call


def _spread(rows: Tensor, n: int) -> Tensor:
    """At most ``n`` of ``rows``, evenly spread over them (deterministic)."""
    if rows.numel() <= n:
        return rows
    return rows[torch.linspace(0, rows.numel() - 1, n).round().long()]


def calibration_inputs(model: Any, name: str, split: MarketSplit, rows: int = CALIBRATION_ROWS) -> list[tuple]:
    """Batches of the inputs member ``name``'s traded network sees on ``split`` at up to ``rows`` of its decision
    bars (see the module docstring), in the order of its graph's inputs."""
    from foxhunt.data.windows import WindowBatches

    member: Member = model.member(name)
    out: list[tuple] = []
    if isinstance(member, Agent):
        inputs = model.stacked(split) if model.hparams.combine == "stack" else split
        market = member.market_tensors(inputs)
        bars = _spread(torch.nonzero(market.decision).squeeze(1), rows)
        if getattr(member, "continuous", False):
            held = member.policy_positions(inputs)[0].float()
            before = torch.where(market.reset_mask[bars], 0.0, held[(bars - 1).clamp_min(0)])
            for i in range(0, bars.numel(), BATCH):
                out.append((market.windows(bars[i : i + BATCH]), before[i : i + BATCH].unsqueeze(1)))
            return out
        n_act = market.n_actions
        ids = torch.arange(n_act)
        per = max(1, BATCH // n_act)
        for i in range(0, bars.numel(), per):
            b = bars[i : i + per]
            out.append((market.windows(b).repeat_interleave(n_act, 0), market.position_features(ids.repeat(b.numel()))))
        return out
    spec = member.spec  # type: ignore[attr-defined]
    batches = WindowBatches(split, spec.lookback, spec.horizon, batch_size=BATCH, known_future=list(spec.known_future))
    batches.keep(_spread(batches.starts, rows))
    lookback = int(getattr(member, "lookback", spec.lookback))
    for batch in batches:
        x_past = batch["x_past"][:, -lookback:]
        out.append((x_past, batch["x_future"], batch["symbol"]) if spec.known_future else (x_past, batch["symbol"]))
    return out


WEIGHT_OPS = ("MatMul", "Gemm", "Conv")


def weight_layers(model: Any) -> list[str]:
    """The names of the graph's MatMul, Gemm and Conv nodes that multiply by a weight (an initializer): the layers
    quantised. Products of two activations (attention's scores, the SSD's C·B and decay products) stay float, where
    a static scale would round the small terms a forecast's sign rests on."""
    weights = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type in WEIGHT_OPS and any(i in weights for i in n.input[1:2])]


class _Reader:
    """ONNX Runtime's CalibrationDataReader protocol over prepared batches (``get_next`` then None)."""

    def __init__(self, names: list[str], batches: list[tuple]) -> None:
        self.feeds = iter([{n: t.detach().cpu().contiguous().numpy() for n, t in zip(names, b, strict=True)}
                           for b in batches])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


def quantise_graph(blob: bytes, names: list[str], batches: list[tuple]) -> bytes:
    """``quantize_static`` of a float graph with ``batches`` as its calibration set (QDQ; int8 weights per channel,
    uint8 activations with MinMax ranges; the weight layers only)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(_Reader, CalibrationDataReader):
        pass

    root_logger = logging.getLogger()  # the quantiser's advice to pre-process goes to the root logger
    level = root_logger.level
    root_logger.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="foxhunt_int8_") as tmp:
            out = Path(tmp) / "int8.onnx"
            model = onnx.load_from_string(blob)
            quantize_static(model, out, Reader(names, batches), quant_format=QuantFormat.QDQ,
                            op_types_to_quantize=list(WEIGHT_OPS), nodes_to_quantize=weight_layers(model),
                            per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax)
            return out.read_bytes()
    finally:
        root_logger.setLevel(level)


def write_int8(root: str | Path, rows: int = CALIBRATION_ROWS, split: MarketSplit | None = None) -> dict[str, Any]:
    """Write ``<member>.int8.onnx`` beside each float graph of the export at ``root`` (``serving.onnx``), calibrated on
    ``split`` (default: the training split the export's fit config rebuilds), and record them as
    ``serving.onnx_int8``; returns that record."""
    import onnxruntime

    from foxhunt.export.load import load
    from foxhunt.export.onnx import ort_session
    from foxhunt.export.splits import recorded_training_split

    root = Path(root)
    root = root.parent if root.is_file() else root
    loaded = load(root)
    meta = loaded.metadata
    if FLOAT not in (meta.get("serving") or {}):
        raise ExportError(f"{root / 'metadata.json'}: serving.{FLOAT}: is missing (python -m foxhunt.export --onnx "
                          f"{root} writes the float graphs the int8 ones are quantised from)")
    split = recorded_training_split(loaded, str(root)) if split is None else split
    members: dict[str, Any] = {}
    used: dict[str, int] = {}
    for name, entry in meta["serving"][FLOAT]["members"].items():
        member = loaded.model.member(name)
        graph = member_graph(member, plain=False)
        if graph is None:
            continue
        batches = calibration_inputs(loaded.model, name, split, rows)
        if not batches:
            raise ExportError(f"{root}: member {name!r}: the training split has no decision bar to calibrate on")
        blob = serving_bytes(root, meta, FLOAT, name)
        try:
            int8 = quantise_graph(blob, graph.inputs, batches)
        except Exception as e:  # ONNX Runtime's quantiser raises many types; one line naming the member
            raise ExportError(f"{root}: member {name!r}: static quantisation failed ({error_line(e)[:300]})") from None
        session = ort_session(int8)
        with torch.no_grad():
            worst = max(float((run_session(session, graph.inputs, b) - graph.module(*b)).abs().max()) for b in batches)
        file = f"{name}.int8.onnx"
        with atomic_file(root / file) as tmp:
            tmp.write_bytes(int8)
        members[name] = {"file": file, "sha256": sha256_hex(int8), "kind": entry["kind"], **signature(int8),
                         "max_abs_diff_vs_torch": worst}
        used[name] = sum(int(b[0].shape[0]) for b in batches)
    ts = split.timestamps
    record = {
        "opset": int(meta["serving"][FLOAT]["opset"]),
        "exporter": meta["serving"][FLOAT]["exporter"],
        "checked_with": f"onnxruntime {onnxruntime.__version__}",
        "quantisation": {
            "method": "onnxruntime.quantization.quantize_static: QDQ, int8 weights per output channel, uint8 "
                      "activations with static MinMax ranges, the MatMul/Gemm/Conv nodes with a weight operand",
            "calibration": {"split": split.name, "max_decision_bars": int(rows), "inputs_per_member": used,
                            "first_ns": int(ts.min()) if ts.numel() else None,
                            "last_ns": int(ts.max()) if ts.numel() else None},
        },
        "members": members,
    }
    record_serving(root, INT8, record)
    return record


def served_vs_float(reference: dict[str, Tensor], served: dict[str, Tensor], split: MarketSplit, cost_bps: float,
                    bars_per_year: float | None = None) -> dict[str, dict[str, float]]:
    """Per policy, what a served model trades against the float model on the same split: the share of decision bars
    whose position differs, and the after-cost Sharpe change (served minus float, annualised) with its HAC standard
    error (Ledoit & Wolf's paired test, :func:`~foxhunt.evaluation.sharpe_difference.sharpe_difference_test`; NaN
    when the two trade identically: nothing to test)."""
    from foxhunt.evaluation.backtest import policy_pnl, split_bars_per_year
    from foxhunt.evaluation.sharpe_difference import sharpe_difference_test

    bpy = split_bars_per_year(split, bars_per_year)
    decision = split.valid
    n = max(int(decision.sum()), 1)
    out: dict[str, dict[str, float]] = {}
    for who, ref in reference.items():
        if who not in served or who in ("buy_and_hold", "oracle"):
            continue
        mine = served[who]
        changed = int(((mine != ref) & decision).sum())
        test = sharpe_difference_test(policy_pnl(mine, split, cost_bps), policy_pnl(ref, split, cost_bps), bpy,
                                      n_boot=199)
        same = changed == 0 and bool(torch.equal(mine[decision], ref[decision]))
        out[who] = {"changed_bars": float(changed), "changed_share": changed / n,
                    "sharpe_change": 0.0 if same else test.difference, "sharpe_change_se": test.se,
                    "max_abs_position_change": float((mine - ref)[decision].abs().max()) if changed else 0.0}
    return out


def format_served_vs_float(rows: dict[str, dict[str, float]], backend: str) -> str:
    """The comparison as a table: one line per policy."""
    lines = [f"what {backend} trades against the float (torch) export, on the same bars:",
             f"{'policy':<14}{'changed bars':>14}{'share':>10}{'Sharpe change':>16}{'its SE':>10}{'z':>8}"]
    for who, r in rows.items():
        se = r["sharpe_change_se"]
        z = r["sharpe_change"] / se if se == se and se > 0 else float("nan")
        lines.append(f"{who:<14}{int(r['changed_bars']):>14,}{r['changed_share']:>10.2%}{r['sharpe_change']:>16.3f}"
                     f"{se:>10.3f}{z:>8.2f}")
    return "\n".join(lines)
