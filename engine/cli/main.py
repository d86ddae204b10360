"""``engine``: command-line entry point.

Exit codes (docs/cli.md): 0 success; 1 a failed check or run (hash mismatch, damaged bundle, kernel
or plugin failure); 2 bad usage (unknown option, missing file, not a bundle, unknown symbol,
malformed --input, a device this machine or the bundle does not have); 130 interrupted. Errors are
one line on stderr; tracebacks only with ``--debug``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING, Sequence

from engine.cli.args import CheckFailed, UsageError
from engine.cli.commands import COMMANDS
from engine.cli.contributed import register_contributed
from engine.cli.render import one_line

if TYPE_CHECKING:
    from engine.plugins import Registry

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

EXAMPLES = """examples:
  engine demo                                     build and run the example MLP (start here)
  engine devices                                  device kinds, plugins, availability
  engine inspect mlp.cgb                          what a bundle holds; can this machine run it?
  engine verify mlp.cgb                           check every member's sha256, weights included
  engine run mlp.cgb --random --symbol batch=8    run once on random inputs
  engine bench mlp.cgb --symbol batch=1,8,64      latency and throughput per key
  engine tune mlp.cgb --symbol batch=1..64 --save tune ahead of time, keep the table in the bundle
  engine profile mlp.cgb --random --symbol batch=8
  engine trace mlp.cgb --random --symbol batch=8 -o trace.json

'engine COMMAND --help' shows each command's options and examples.
exit codes: 0 success, 1 a failed check or run, 2 bad usage."""


def _seed(text: str) -> int:
    """``--seed``: a non-negative integer (numpy's generators take no other), refused as bad usage."""
    value = text.strip()
    if not (value.isascii() and value.isdigit() and len(value) <= 19):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a non-negative integer such as 0 or 42")
    return int(value)


def _common_parents() -> dict[str, argparse.ArgumentParser]:
    debug = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: the option may come before or after the command without one overriding the other.
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks on errors")
    json_opt = argparse.ArgumentParser(add_help=False)
    json_opt.add_argument("--json", action="store_true", help="print the results as JSON (for scripts)")
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", metavar="DEVICE",
                        help="device to run on, e.g. cuda:1 (default: index 0 of each kind the bundle uses)")
    inputs = argparse.ArgumentParser(add_help=False)
    group = inputs.add_argument_group("inputs")
    group.add_argument("-i", "--input", action="append", metavar="NAME=FILE",
                       help="an input from a .npy file (repeat per input; FILE alone for a one-input graph)")
    group.add_argument("--random", action="store_true", help="random data for every input not given by --input")
    group.add_argument("-s", "--symbol", action="append", metavar="NAME=VALUE",
                       help="a symbol's value for --random inputs, e.g. batch=8 (repeat per symbol)")
    group.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs (default 0)")
    return {"debug": debug, "json": json_opt, "device": device, "inputs": inputs}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error raises instead of exiting, so main() reports it in one place."""

    def error(self, message: str):  # type: ignore[override]
        raise _ArgparseError(self, message)


class _ArgparseError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.parser = parser


class _VersionAction(argparse.Action):
    """``--version``: the plugins are looked up only when it is asked for (not at every parse)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from engine.cli.version import version_text

        print(version_text(getattr(namespace, "registry", None)))
        parser.exit()


def build_parser(*, registry: "Registry | None" = None) -> argparse.ArgumentParser:
    """The parser of every command; ``registry`` is the one ``--version`` lists (default: discovery)."""
    parser = _Parser(
        prog="engine",
        description="Inspect, verify, run, benchmark and tune compiled graphs (bundles) on CPU, CUDA, HIP and "
                    "third-party devices.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("-v", "--verbose", action="count", default=0, dest="log_verbosity",
                        help="show the engine's log on stderr (plugins, tuning, cache, workspaces); -vv for detail")
    parser.add_argument("--version", action=_VersionAction,
                        help="show the versions of engine, its plugins (with their plugin API), Python and the "
                             "platform, and exit")
    parser.set_defaults(registry=registry)  # seen by --version while parsing
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    common = _common_parents()
    for name in COMMANDS:
        importlib.import_module(f"engine.cli.commands.{name}").register(sub, common)
    register_contributed(sub, common, COMMANDS)  # engine-onnx's convert, or a stand-in saying how to get it
    return parser


def main(argv: Sequence[str] | None = None, *, registry: "Registry | None" = None) -> int:
    """Run the command line; returns the exit code. ``registry`` replaces the default plugin registry
    (for embedding and tests)."""
    parser = build_parser(registry=registry)
    try:
        args = parser.parse_args(argv)
    except _ArgparseError as exc:
        # One line, like every other error; the usage is one --help away.
        print(f"{exc.parser.prog}: error: {one_line(exc)} (see '{exc.parser.prog} --help')", file=sys.stderr)
        return EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    debug = getattr(args, "debug", False)
    from engine.log import enable_stderr

    enable_stderr(args.log_verbosity)
    args.registry = registry
    from engine.errors import EngineError

    try:
        return args.func(args)
    except (UsageError, CheckFailed) as exc:
        if debug:
            raise
        _report(args.command, exc)
        return exc.exit_code
    except EngineError as exc:
        if debug:
            raise
        _report(args.command, exc)
        return EXIT_FAILED
    except BrokenPipeError:  # e.g. `engine inspect x.cgb --json | head`: the reader left, nothing to report
        _silence_stdout()
        return EXIT_FAILED
    except OSError as exc:  # writing an output file, a disk full, ...
        if debug:
            raise
        _report(args.command, exc.strerror and f"{exc.filename or ''}: {exc.strerror}".lstrip(": ") or exc)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"engine {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the CLI's promise: one line, no traceback without --debug
        if debug:
            raise
        _report(args.command, f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)")
        return EXIT_FAILED


def _silence_stdout() -> None:
    """Point stdout at devnull so that the interpreter's final flush does not fail again (Python docs)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (embedded use): nothing to protect
        pass


def _report(command: str, exc: object) -> None:
    print(f"engine {command}: error: {one_line(exc)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
