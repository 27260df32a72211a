"""`python -m foxhunt.export --onnx EXPORT [--int8]`: each member's traded network as ONNX (and int8) beside the export.

``--onnx`` writes ``<member>.onnx`` (opset 18, dynamic batch), each checked against torch within 1e-5, and records the
files, their SHA-256 and named inputs and outputs in metadata.json (``serving.onnx``). ``--int8`` then writes
``<member>.int8.onnx``: ONNX Runtime's static quantisation, calibrated on the training split the export's fit config
rebuilds (``serving.onnx_int8``). ``python -m foxhunt.backtest --backend`` and ``python -m foxhunt.live --backend``
trade them. docs/SERVING.md has the details.
"""

from __future__ import annotations

import sys

from foxhunt.cli_errors import ArgumentParser, run_command


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m foxhunt.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--onnx", required=True, metavar="EXPORT", help="export directory (or its metadata.json)")
    parser.add_argument("--int8", action="store_true",
                        help="also write statically quantised int8 graphs, calibrated on the training split")
    parser.add_argument("--calibration-rows", type=int, default=None,
                        help="most training decision bars a member is calibrated on (default 4096)")
    parser.add_argument("--debug", action="store_true", help="a traceback for errors too")
    args = parser.parse_args(argv)
    if args.calibration_rows is not None and args.calibration_rows < 1:
        parser.error(f"--calibration-rows must be >= 1, got {args.calibration_rows}")
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        parser.error(f"--onnx needs onnx, onnxruntime and onnxscript ({e.name} is missing): pip install -e '.[serve]'")
    from foxhunt.export.onnx import write_onnx

    record = write_onnx(args.onnx)
    for graph in record["members"].values():
        ins = ", ".join(f"{p['name']} {p['shape']}" for p in graph["inputs"])
        diff = graph["max_abs_diff_vs_torch"]
        print(f"{graph['file']}: {graph['kind']}, inputs {ins}; max |ONNX - torch| {diff:.2g}")
    if args.int8:
        from foxhunt.export.quantise import CALIBRATION_ROWS, write_int8

        q = write_int8(args.onnx, rows=args.calibration_rows or CALIBRATION_ROWS)
        cal = q["quantisation"]["calibration"]
        for name, graph in q["members"].items():
            print(f"{graph['file']}: static int8, calibrated on {cal['inputs_per_member'][name]:,} inputs of split "
                  f"{cal['split']!r}; max |int8 - torch| {graph['max_abs_diff_vs_torch']:.2g}")
    print(f"recorded in {args.onnx}/metadata.json (serving)")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
