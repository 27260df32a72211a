"""Each member's traded network as an ONNX graph (one file per member), checked against torch and recorded, with its
SHA-256 and its named inputs and outputs, in the export's metadata.json (``serving.onnx``).

The graph is the network a member trades (:func:`~foxhunt.export.traded.traded_network`) in a plain torch form, the
same parameters: the TFT's inference form (:class:`~foxhunt.models.tft_inference.TFTInference`, built from the
``fused=False`` reference path: the fused variable selection is a hand-written autograd Function), Mamba-2's PyTorch
block (its C loops are a ``ctypes`` library) with the window as one chunk of its scan. What each graph computes:

- forecasters: ``x_past`` [batch, L, F], ``x_future`` [batch, H, K] (absent when K is 0), ``symbol`` [batch] int64
  -> ``quantiles`` [batch, H, Q] (the network's ``prediction``, on the training scale);
- DQN: ``window`` [batch, W, F], ``position`` [batch, A] (one-hot held action) -> ``q`` [batch, A];
- PPO, discrete: the same inputs -> ``logits`` [batch, A] (the deterministic policy takes the argmax);
- PPO, continuous: ``window`` [batch, W, F], ``position`` [batch, 1] (the held position) -> ``target`` [batch]
  (tanh of the mean).

Exported by ``torch.onnx.export`` (the dynamo exporter), opset :data:`OPSET`, the batch dimension dynamic. Each graph
is run by ONNX Runtime against the torch network before it is written (:data:`PARITY_ATOL`), and every file is
written atomically, metadata.json last.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from foxhunt.export.metadata import SERVING_FORMATS, ExportError, error_line, metadata_digest, sha256_hex
from foxhunt.export.traded import traded_network
from foxhunt.files import atomic_file
from foxhunt.lit.member import Agent, Member

OPSET = 18
MAX_BATCH = 1 << 20  # rows a call may carry (the graphs have no such limit; torch.export wants a bound to reason with)
PARITY_ATOL = 1e-5  # float graph against torch, absolute, on outputs of order 1 (quantiles are on the training scale)
FLOAT = "onnx"  # serving.onnx in metadata.json: the float graphs
INT8 = "onnx_int8"  # serving.onnx_int8: statically quantised graphs (foxhunt.export.quantise)
assert (FLOAT, INT8) == SERVING_FORMATS


@dataclass
class Graph:
    """What is exported for one member: a torch module returning one tensor, its input and output names, and example
    inputs (batch 2)."""

    module: nn.Module
    inputs: list[str]
    outputs: list[str]
    example: tuple[Tensor, ...]
    kind: str  # forecaster, dqn, ppo_discrete, ppo_continuous


class _Forecast(nn.Module):
    """A forecaster network's quantiles from (x_past, x_future, symbol)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x_past: Tensor, x_future: Tensor, symbol: Tensor) -> Tensor:
        return self.net(x_past, x_future, symbol).prediction


class _ForecastPast(nn.Module):
    """A forecaster network's quantiles without known-future inputs: (x_past, symbol)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x_past: Tensor, symbol: Tensor) -> Tensor:
        return self.net(x_past, None, symbol).prediction


class _TFTInferenceForecast(nn.Module):
    """The TFT's quantiles through its inference form (:class:`~foxhunt.models.tft_inference.TFTInference`: what
    depends on the symbol alone computed once, embeddings composed into the layers): the same function of the same
    parameters in eval mode, about 200 graph nodes against the reference path's 260, with no Einsum."""

    def __init__(self, net: nn.Module) -> None:
        from foxhunt.models.tft_inference import TFTInference

        super().__init__()
        self.net = net
        with torch.no_grad():
            self.form = TFTInference(net)
        rows = MAX_BATCH * (net.lookback + net.horizon)  # the per-variable GRNs in one chunk: the graph takes any batch
        self.form.encoder.rows = self.form.decoder.rows = rows

    def forward(self, x_past: Tensor, x_future: Tensor, symbol: Tensor) -> Tensor:
        return self.form(x_past, x_future, symbol).prediction


class _Deterministic(nn.Module):
    """An ActorCritic's deterministic policy: logits (discrete) or tanh(mean) (continuous)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, window: Tensor, position: Tensor) -> Tensor:
        return self.net.deterministic(window, position)


def plain_copy(net: nn.Module) -> nn.Module:
    """An eval-mode copy of ``net`` on its plain torch path, the same parameters: the TFT's ``fused=False`` reference
    and Mamba-2's PyTorch blocks (``native=False``)."""
    from foxhunt.models.mamba2 import Mamba2Block
    from foxhunt.models.tft import TemporalFusionTransformer

    out = copy.deepcopy(net).cpu().float().eval()
    if isinstance(out, TemporalFusionTransformer):
        out.fused = False
    for module in out.modules():
        if isinstance(module, Mamba2Block):
            module.native = False
    return out


def member_graph(member: Member, plain: bool = True) -> Graph | None:
    """The graph of the network ``member`` trades (None when it holds flat: it trades nothing); ``plain=False``: around
    the network itself, as the back-test runs it (the reference the exported graph is held against)."""
    from foxhunt.models.actor_critic import ActorCritic
    from foxhunt.models.qnet import QNetwork

    _, net = traded_network(member)
    if net is None:
        return None
    plain_net = plain_copy(net) if plain else net.eval()
    gen = torch.Generator().manual_seed(0)
    if isinstance(member, Agent):
        window = torch.randn(2, int(plain_net.window), int(plain_net.n_features), generator=gen)
        if isinstance(plain_net, QNetwork):
            n_pos, kind, module, out = int(plain_net.position_eye.shape[0]), "dqn", plain_net, "q"
        elif isinstance(plain_net, ActorCritic):
            n_pos, module = int(plain_net.n_position_features), _Deterministic(plain_net)
            kind, out = ("ppo_continuous", "target") if plain_net.continuous else ("ppo_discrete", "logits")
        else:
            raise ExportError(f"{type(member).__name__}: no ONNX graph for a {type(plain_net).__name__} network")
        position = torch.zeros(2, n_pos)
        if kind == "ppo_continuous":
            position[:, 0] = torch.tensor([-0.5, 0.25])
        else:
            position[0, 0] = position[1, n_pos - 1] = 1.0
        return Graph(module, ["window", "position"], [out], (window, position), kind)
    spec = member.spec  # type: ignore[attr-defined]
    lookback = int(getattr(member, "lookback", spec.lookback))  # Mamba-2 may read fewer past rows than the data has
    if plain:
        from foxhunt.models.mamba2 import Mamba2Block

        for module in plain_net.modules():  # the window's L + H steps as one chunk: the scan's quadratic form alone,
            if isinstance(module, Mamba2Block):  # no state passed between chunks (outputs do not depend on the chunk)
                module.chunk_size = max(int(module.chunk_size), lookback + int(spec.horizon))
    x_past = torch.randn(2, lookback, spec.n_features, generator=gen)
    symbol = torch.tensor([0, len(spec.symbols) - 1], dtype=torch.int64)
    k = len(spec.known_future)
    if k:
        x_future = torch.randn(2, spec.horizon, k, generator=gen)
        from foxhunt.models.tft import TemporalFusionTransformer

        tft = plain and isinstance(plain_net, TemporalFusionTransformer)
        module = _TFTInferenceForecast(plain_net) if tft else _Forecast(plain_net)
        return Graph(module, ["x_past", "x_future", "symbol"], ["quantiles"], (x_past, x_future, symbol), "forecaster")
    return Graph(_ForecastPast(plain_net), ["x_past", "symbol"], ["quantiles"], (x_past, symbol), "forecaster")


@contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporter's progress lines and warnings (torchvision absent, deprecations) kept off the user's terminal."""
    names = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript", "torch._export")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_graph(graph: Graph, where: str) -> bytes:
    """The serialised ONNX model of ``graph`` (opset :data:`OPSET`, dynamic batch): ExportError naming ``where`` when
    the exporter fails."""
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    shapes = {name: {0: batch} for name in graph.inputs}
    try:
        with quiet_exporter(), torch.no_grad():
            program = torch.onnx.export(graph.module, graph.example, input_names=graph.inputs,
                                        output_names=graph.outputs, opset_version=OPSET, dynamo=True,
                                        dynamic_shapes=shapes, verbose=False)
    except Exception as e:  # the exporter's failures come as many types; one line naming the member
        raise ExportError(f"{where}: torch.onnx.export failed ({error_line(e)[:300]})") from e
    return program.model_proto.SerializeToString()


def fixed_batch(blob: bytes, rows: int) -> bytes:
    """The serialised model with its dynamic batch axis fixed to ``rows``: static shapes let ONNX Runtime fold the
    Shape/Gather/Reshape chains the dynamic graph computes per call (TFT at batch 1: 192 -> 183 nodes, ~5% faster)."""
    import onnx

    model = onnx.load_from_string(blob)
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if len(dims) and dims[0].HasField("dim_param"):
            dims[0].ClearField("dim_param")
            dims[0].dim_value = rows
    del model.graph.value_info[:]  # inferred again from the fixed inputs
    return model.SerializeToString()


def ort_session(blob: bytes, batch: int | None = None) -> Any:
    """An ONNX Runtime session of a serialised model on one CPU thread (sequential, every graph optimisation); with
    ``batch``, of the model fixed to that many rows (:func:`fixed_batch`)."""
    import onnxruntime as ort

    blob = blob if batch is None else fixed_batch(blob, batch)

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])


def run_session(session: Any, names: list[str], tensors: tuple[Tensor, ...]) -> Tensor:
    """The session's first output on ``tensors`` (fed under ``names``: float32, or int64 for ``symbol``)."""
    feed = {n: t.detach().cpu().contiguous().numpy() for n, t in zip(names, tensors, strict=True)}
    return torch.from_numpy(session.run(None, feed)[0])


def signature(blob: bytes) -> dict[str, list[dict[str, Any]]]:
    """The model's named inputs and outputs with their shapes (``"batch"`` for the dynamic axis) and dtypes."""
    import onnx

    model = onnx.load_from_string(blob)

    def entry(v: Any) -> dict[str, Any]:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]
        return {"name": v.name, "shape": ["batch" if i == 0 else d for i, d in enumerate(dims)],
                "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name}

    return {"inputs": [entry(v) for v in model.graph.input], "outputs": [entry(v) for v in model.graph.output]}


def parity_inputs(graph: Graph, n: int = 7) -> tuple[Tensor, ...]:
    """``n`` rows of inputs like the example's (another batch size than the export saw)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for name, t in zip(graph.inputs, graph.example, strict=True):
        if name == "symbol":
            out.append(torch.randint(0, int(t.max()) + 1, (n,), generator=gen))
        elif name == "position":
            out.append(t[torch.arange(n) % t.shape[0]].clone())
        else:
            out.append(torch.randn(n, *t.shape[1:], generator=gen))
    return tuple(out)


def check_parity(blob: bytes, graph: Graph, reference: nn.Module | None, where: str,
                 atol: float = PARITY_ATOL) -> float:
    """Largest absolute difference of the ONNX graph from the torch graph module at batch 1 and 7 (``reference``:
    another module to hold it against); ExportError naming ``where`` beyond ``atol``."""
    session = ort_session(blob)
    module = graph.module if reference is None else reference
    worst = 0.0
    for batch in (parity_inputs(graph, 1), parity_inputs(graph, 7)):
        with torch.no_grad():
            want = module(*batch)
        got = run_session(session, graph.inputs, batch)
        if got.shape != want.shape:
            raise ExportError(f"{where}: the ONNX graph returns shape {tuple(got.shape)}, torch {tuple(want.shape)}")
        worst = max(worst, float((got - want).abs().max()))
    if not worst <= atol:
        raise ExportError(f"{where}: the ONNX graph differs from torch by {worst:.3g} (more than {atol:g})")
    return worst


def write_onnx(root: str | Path) -> dict[str, Any]:
    """Write ``<member>.onnx`` for every member of the export at ``root`` that trades a network, each checked
    against torch, and record them in metadata.json's ``serving.onnx``; returns that record."""
    import onnx
    import onnxruntime

    from foxhunt.export.load import load

    root = Path(root)
    root = root.parent if root.is_file() else root
    loaded = load(root)
    members: dict[str, Any] = {}
    for name in loaded.model.member_names:
        member = loaded.model.member(name)
        graph = member_graph(member)
        if graph is None:
            continue
        where = f"{root}: member {name!r}"
        blob = export_graph(graph, where)
        worst = check_parity(blob, graph, member_graph(member, plain=False).module, where)  # type: ignore[union-attr]
        file = f"{name}.onnx"
        with atomic_file(root / file) as tmp:
            tmp.write_bytes(blob)
        members[name] = {"file": file, "sha256": sha256_hex(blob), "kind": graph.kind, **signature(blob),
                         "max_abs_diff_vs_torch": worst}
    record = {"opset": OPSET, "exporter": f"torch.onnx.export (dynamo) {torch.__version__}, onnx {onnx.__version__}",
              "checked_with": f"onnxruntime {onnxruntime.__version__}", "members": members}
    record_serving(root, FLOAT, record)
    return record


def record_serving(root: Path, key: str, record: dict[str, Any]) -> dict[str, Any]:
    """metadata.json with ``serving.<key>`` set to ``record`` (its digest recomputed), written atomically; the metadata
    is read and verified first, so a changed export is refused rather than vouched for."""
    from foxhunt.export.metadata import check_metadata

    path = root / "metadata.json"
    meta = json.loads(path.read_text())
    check_metadata(meta, path)
    if key == INT8 and FLOAT not in (meta.get("serving") or {}):
        raise ExportError(f"{path}: serving.{INT8} needs serving.{FLOAT} (write the float graphs first)")
    serving = dict(meta.get("serving") or {})
    serving[key] = record
    if key == FLOAT:
        serving.pop(INT8, None)  # quantised from the former float graphs: no longer vouched for
    meta["serving"] = serving
    meta["metadata_sha256"] = metadata_digest(meta)
    check_metadata(meta, path)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(meta, indent=2, allow_nan=False))
    return meta
