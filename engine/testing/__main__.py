"""``python -m engine.testing KIND [pytest args...]`` / ``--backend MODULE:FACTORY`` / ``--rules``.

Runs the conformance suite with pytest and exits with pytest's status; ``--rules`` prints the rule
and capability tables (the ones in docs/conformance.md).
"""

from __future__ import annotations

import sys

USAGE = """usage: python -m engine.testing KIND [pytest args...]
       python -m engine.testing --backend MODULE:FACTORY [pytest args...]
       python -m engine.testing --rules

Runs the engine conformance suite on the installed plugin's KIND, or on the backend FACTORY() returns.
Extra arguments go to pytest (-k, -x, -v, --engine-device-index N, --engine-report PATH, ...)."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "--rules":
        from engine.testing.rules import capabilities_markdown, rules_markdown

        print(rules_markdown())
        print(capabilities_markdown(), end="")
        return 0
    import pytest

    from engine.testing import pytest_args

    if args[0] == "--backend":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        command = pytest_args(backend=args[1], extra=args[2:])
    elif args[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    else:
        command = pytest_args(kind=args[0], extra=args[1:])
    return int(pytest.main(command))


if __name__ == "__main__":
    sys.exit(main())
