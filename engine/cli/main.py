"""``engine``: command-line entry point.

Exit codes: 0 success, 1 a failed check or run, 2 bad usage. Tracebacks only with ``--debug``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from engine.errors import EngineError

__all__ = ["main"]


def _devices(args: argparse.Namespace) -> int:
    from engine.plugins import default_registry

    rows = default_registry().devices()
    if not rows:
        print("no device plugins installed; install 'engine-cpu' for the CPU")
        return 1
    print(f"{'kind':<8} {'available':<9} {'count':<5} {'slot':<4} {'api':<5} {'plugin':<22} detail")
    for r in rows:
        plugin = f"{r.distribution or '?'} {r.version or ''}".strip()
        api = f"{r.api_version[0]}.{r.api_version[1]}" if r.api_version else "-"
        detail = r.reason or ", ".join(r.device_names)
        print(f"{r.kind:<8} {'yes' if r.available else 'no':<9} {r.device_count:<5} "
              f"{'-' if r.workspace_slot is None else r.workspace_slot:<4} {api:<5} {plugin:<22} {detail}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from engine.cli.demo import run_demo

    return run_demo(keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine",
        description="Run compiled graphs (bundles) on CPU, CUDA, HIP and third-party devices.",
        epilog="examples:\n  engine demo          build, save, load and run the example MLP on the CPU\n"
               "  engine devices       list device kinds and their plugins",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="build, save, load and run the example MLP classifier on the CPU")
    demo.add_argument("--keep", metavar="DIR", help="write the demo bundle into DIR and keep it")
    demo.set_defaults(func=_demo)
    devices = sub.add_parser("devices", help="list device kinds, their plugins and availability")
    devices.set_defaults(func=_devices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except EngineError as exc:
        if args.debug:
            raise
        print(f"engine {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
