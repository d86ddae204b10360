"""One module per ``engine`` subcommand.

Each module defines ``register(sub, common)``, which adds its parser (with examples in its
``--help``) and sets ``func`` to its ``run(args) -> int``. Modules import the engine's heavy parts
inside ``run`` so that ``engine --help`` stays quick.
"""

from __future__ import annotations

import argparse
import textwrap

__all__ = ["COMMANDS", "add_command"]

#: In the order ``engine --help`` lists them.
COMMANDS = ("demo", "devices", "inspect", "verify", "run", "bench", "tune", "profile", "trace", "cache")


def add_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str, *, help: str,
                description: str, examples: str, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """A subparser whose ``--help`` ends with an ``examples:`` block (kept as written)."""
    return sub.add_parser(name, help=help, description=textwrap.fill(description, 88),
                          epilog="examples:\n" + examples.strip("\n"), parents=parents,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
