"""The conformance suite for device plugins: one command tells a vendor whether a backend keeps
the device contract (``engine.backend``, version 2).

Run it against an installed plugin or a backend under development::

    python -m engine.testing KIND [pytest args...]
    python -m engine.testing --backend my_pkg.backend:make_backend [pytest args...]

``engine.testing.rules`` is the table of checked rules (ids such as ``copy.host_roundtrip``),
``engine.testing.reference`` the reference kernels a backend supplies through
``reference_kernels()`` (``REFERENCE_KERNELS``), ``engine.testing.plugin`` the pytest plugin and
``engine.testing/suite`` the tests. ``docs/conformance.md`` is the guide. Importing this package
does not import pytest; the plugin and the suite do.
"""

from pathlib import Path

from engine.testing.reference import MLP_KERNELS, REFERENCE_KERNELS, ReferenceSignature, with_macros
from engine.testing.rules import CAPABILITIES, RULES, Rule, rule

__all__ = ["RULES", "Rule", "rule", "CAPABILITIES", "REFERENCE_KERNELS", "MLP_KERNELS", "ReferenceSignature",
           "with_macros", "suite_dir", "pytest_args"]


def suite_dir() -> str:
    """The directory of the suite's test files (installed with the package)."""
    return str(Path(__file__).with_name("suite"))


def pytest_args(*, kind: str | None = None, backend: str | None = None, extra: list[str] | None = None) -> list[str]:
    """The pytest command line that runs the suite on ``kind`` or on ``backend`` (``MODULE:FACTORY``)."""
    if (kind is None) == (backend is None):
        raise ValueError("give exactly one of kind= or backend=")
    target = ["--engine-kind", kind] if kind is not None else ["--engine-backend", backend]
    # --confcutdir: no conftest.py above the suite (a plugin repository's own, with fixtures of the
    # same names as the suite's, would override them) takes part in the run.
    return [suite_dir(), f"--confcutdir={suite_dir()}", "-p", "engine.testing.plugin", "-p", "no:cacheprovider",
            *target, *(extra or [])]
