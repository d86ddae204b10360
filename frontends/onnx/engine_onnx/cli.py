"""``engine convert MODEL.onnx -o MODEL.cgb``: the importer as an ``engine`` subcommand.

Registered through the ``engine.commands`` entry point, so the core CLI does not depend on onnx:
this module imports nothing heavy until the command runs.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

EXAMPLES = """
  engine convert model.onnx -o model.cgb                  convert (weights, kernels, one bundle)
  engine convert model.onnx -o model.cgb --symbol batch   the leading dimension of every input becomes 'batch'
  engine convert model.onnx -o model_dir/                 write the directory form
  engine convert model.onnx -o out --overwrite            replace 'out' even if it is not a bundle
  engine convert model.onnx -o model.cgb --device cuda    kernels for CUDA GPUs (inputs and outputs there too)
  engine convert model.onnx -o model.cgb --device opencl --io-device cpu
                                                          OpenCL kernels, host arrays in and out
  engine bench model.cgb --symbol batch=1,8               then benchmark the result
"""


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    from engine.cli.commands import add_command

    p = add_command(sub, "convert", help="convert an ONNX model into a bundle (engine-onnx)",
                    description="Import an ONNX model (operators as defined from opset 9 on; older opsets "
                                "through ONNX's version converter): fold constants, infer shapes, turn dynamic "
                                "dimensions into symbols (pinning one the model holds at a single value) and "
                                "generate kernels for one device kind (C for the CPU plugin, with several "
                                "candidates for MatMul, Gemm and Conv; or CUDA / OpenCL kernels), then save one "
                                "bundle. Unsupported nodes are all listed in one error and no "
                                "bundle is written.",
                    examples=EXAMPLES, parents=[common["debug"], common["json"]])
    p.add_argument("model", metavar="MODEL", help="an .onnx file")
    p.add_argument("-o", "--output", required=True, metavar="BUNDLE",
                   help="the bundle to write (.cgb; a path ending in / writes the directory form)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace BUNDLE even when it exists and is not a bundle (a directory of other files, "
                        "another file); without it such a target is refused and kept. An existing bundle is "
                        "always replaced, atomically")
    p.add_argument("--symbol", metavar="NAME", help="make the leading dimension of every input a symbol NAME")
    p.add_argument("--device", default="cpu", metavar="KIND",
                   help="the device kind the kernels are generated for: cpu (default), cuda or opencl (fewer "
                        "operators have GPU kernels: docs/onnx.md)")
    p.add_argument("--io-device", metavar="KIND",
                   help="keep the graph's inputs and outputs on this kind instead (e.g. cpu: host arrays in and "
                        "out of a GPU model, copied by the engine)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.cli.args import UsageError
    from engine.cli.progress import Progress

    from engine_onnx.gpu import GPU_KINDS

    known = ["cpu", *GPU_KINDS]
    if args.device not in known:
        several = "," in args.device
        raise UsageError(f"--device {args.device!r}: expected one device kind, one of {', '.join(known)}"
                         + ("; a bundle holds one kind's kernels: convert once per kind" if several else ""))
    if args.io_device is not None and args.io_device not in known:
        raise UsageError(f"--io-device {args.io_device!r}: expected one device kind, one of {', '.join(known)}")
    if not Path(args.model).is_file():
        raise UsageError(f"{args.model}: no such file; expected an .onnx model")
    from engine.errors import SaveTargetError

    from engine_onnx.convert import MODEL_ITSELF, check_output, convert
    from engine_onnx.errors import SymbolPinnedWarning

    try:
        check_output(args.model, args.output, overwrite=args.overwrite)
    except SaveTargetError as exc:
        hint = "" if exc.reason == MODEL_ITSELF else ", or pass --overwrite to replace it"
        raise UsageError(f"-o {args.output}: refusing to write there: it is {exc.reason}; nothing was written "
                         f"(choose another path{hint})") from None
    start = time.perf_counter()
    bar: Progress | None = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(total, "compiling kernels")
            bar.__enter__()
        bar.advance(done - bar.done)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SymbolPinnedWarning)
            builder = convert(args.model, batch_symbol=args.symbol, registry=args.registry, progress=progress,
                              device=args.device, io_device=args.io_device)
        pins = [w.message.pin for w in caught if isinstance(w.message, SymbolPinnedWarning)]
        for w in caught:
            if not isinstance(w.message, SymbolPinnedWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        form = "dir" if args.output.endswith("/") else "zip"
        builder.save(Path(args.output), form=form, overwrite=args.overwrite)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    seconds = time.perf_counter() - start
    if args.json:
        from engine.cli.render import emit_json

        emit_json({"model": args.model, "output": args.output, "device": args.device, "io_device": args.io_device,
                   "symbol": args.symbol, "form": form, "seconds": seconds,
                   "pins": [{"symbol": p.symbol, "value": p.value, "node": p.node, "op_type": p.op_type,
                             "reason": p.reason} for p in pins]})
    else:
        for pin in pins:
            print(f"note: {pin.describe()}; the bundle takes {pin.symbol} = {pin.value} only", file=sys.stderr)
        print(f"wrote {args.output} in {seconds:.1f} s")
    return 0
