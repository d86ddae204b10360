"""Commands other distributions contribute to ``engine`` (entry points in group ``engine.commands``).

Each entry point names a module with the same ``register(sub, common)`` as the built-in commands;
``engine-onnx`` adds ``convert``. They are loaded to list them in ``engine --help``, so for every
command: a contributing package must keep that module's import light (``engine_onnx`` imports onnx
only when ``convert`` runs). A command the engine knows of but whose package is missing (the demo
installs only engine and engine-cpu) is still listed, and running it says which package to install
and how, instead of argparse's "invalid choice".

``--json`` is on every command but ``demo`` (docs/cli.md): a contributed command takes
``common["json"]`` and prints its own document (``engine.cli.render.emit_json``), as ``convert`` does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NamedTuple

from engine.cli.args import UsageError

__all__ = ["KnownCommand", "KNOWN_COMMANDS", "MissingCommand", "register_contributed", "missing_message"]


class KnownCommand(NamedTuple):
    """A contributed command the engine knows the source of."""

    name: str
    distribution: str
    #: Where the distribution's source lives in a checkout of this repository.
    checkout: str
    help: str


#: The first-party contributed commands, for the "install X" message when their package is absent.
KNOWN_COMMANDS = {
    "convert": KnownCommand("convert", "engine-onnx", "./frontends/onnx", "convert an ONNX model into a bundle"),
}


class MissingCommand(UsageError):
    """A known contributed command whose package is not installed, or failed to load (exit code 2).

    ``command`` is the command's name, ``distribution`` the package that provides it and ``cause``
    why it could not be loaded (``None``: the package is not installed).
    """

    def __init__(self, known: KnownCommand, cause: str | None = None):
        super().__init__(missing_message(known, cause))
        self.command = known.name
        self.distribution = known.distribution
        self.cause = cause


def missing_message(known: KnownCommand, cause: str | None = None) -> str:
    """What to do when ``known`` is not available: the package, and how to install it."""
    how = (f"into the Python that runs engine ({sys.executable}); from a checkout of engine: "
           f"pip install -e {known.checkout}")
    if cause is None:
        return (f"'engine {known.name}' comes from the {known.distribution} package, which is not installed: "
                f"install {known.distribution} {how}")
    return (f"'engine {known.name}' from {known.distribution} could not be loaded ({cause}): reinstall "
            f"{known.distribution} {how}")


def register_contributed(sub: "argparse._SubParsersAction[Any]",
                         common: dict[str, argparse.ArgumentParser], builtin: tuple[str, ...]) -> None:
    """Add every contributed command's parser after the built-in ones, then a stand-in for each
    known command that is missing. A broken contributed command is left out (with a warning on
    stderr) rather than breaking the whole CLI."""
    from importlib.metadata import entry_points

    registered: set[str] = set()
    failed: dict[str, str] = {}
    for ep in entry_points(group="engine.commands"):
        if ep.name in builtin or ep.name in registered:
            continue
        try:
            ep.load().register(sub, common)
        except Exception as exc:  # noqa: BLE001 - one bad plugin must not take `engine --help` down
            failed[ep.name] = f"{type(exc).__name__}: {exc}"
            print(f"engine: warning: command {ep.name!r} from {ep.value} is unavailable: {exc}", file=sys.stderr)
            continue
        registered.add(ep.name)
    for name, known in KNOWN_COMMANDS.items():
        if name not in registered and name not in builtin:
            _add_stand_in(sub, known, failed.get(name))


def _add_stand_in(sub: "argparse._SubParsersAction[Any]", known: KnownCommand,
                  cause: str | None) -> None:
    """``engine NAME ...`` (any arguments, ``--help`` included) raises ``MissingCommand``."""
    state = "not installed" if cause is None else "failed to load"
    # No prefix characters a person types: every argument, options and --help too, is taken as given
    # and the command reports the missing package whatever follows it.
    parser = sub.add_parser(known.name, help=f"{known.help} ({known.distribution}: {state})", add_help=False,
                            prefix_chars="\0")
    parser.add_argument("arguments", nargs="*")

    def run(args: argparse.Namespace) -> int:
        raise MissingCommand(known, cause)

    parser.set_defaults(func=run)
