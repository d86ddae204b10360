"""The pytest plugin of the conformance suite: which backend to test, and the fixtures tests use.

Load it with ``-p engine.testing.plugin`` (``python -m engine.testing`` does) and name the backend:

* ``--engine-kind KIND``: the installed plugin's backend, from the default registry (entry points,
  ``ENGINE_CACHE_DIR`` and the rest of the environment apply as in any program);
* ``--engine-backend MODULE:FACTORY``: ``FACTORY()`` returns a ``BackendBase``; it is registered in
  a private ``Registry(Settings(cache_dir=<tmp>), autoload=False)`` together with the installed
  plugin of the ``cpu`` kind, found by its entry point, when there is one (graph tests may need host
  kinds). Handy for a backend under development, and for testing the suite itself on deliberately
  broken backends;
* ``--engine-device-index N`` (default 0); ``--engine-report PATH`` writes per-rule results as JSON.

Fixtures: ``registry``, ``backend`` (available, else every test that needs a device is skipped
with the availability reason), ``declared_backend`` (registered, maybe unavailable),
``device_index``, ``stream`` (the calling thread's ``current_stream``), ``memory``
(``DeviceMemory`` on that stream) and ``kit`` (``ReferenceKit``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Generator, Iterator

import attrs
import pytest

from engine.backend import BackendBase
from engine.plugins import Registry, default_registry
from engine.settings import Settings
from engine.testing.buffers import DeviceMemory
from engine.testing.checks import fail, lacks
from engine.testing.kernels import ReferenceKit
from engine.testing.report import RunReport, TestResult
from engine.testing.rules import rule

__all__ = ["Target", "load_factory"]

SUITE_DIR = Path(__file__).with_name("suite")
MARKER = "conformance"
_REPORT = pytest.StashKey[RunReport]()
_FACTORY = pytest.StashKey[Any]()
#: Suite modules in the order they run: declared data, memory, streams, kernels, then the runtime.
STAGES = ("test_declared", "test_memory", "test_streams", "test_kernels", "test_fusion_capture", "test_isolation",
          "test_graphs")


@attrs.define
class Target:
    """The backend under test: how it was named, its registry, and why it could not be registered."""

    description: str
    kind: str | None
    device_index: int
    registry: Registry
    problem: str | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine", "engine conformance suite (engine.testing)")
    group.addoption("--engine-kind", metavar="KIND", help="test the installed plugin's backend of this kind")
    group.addoption("--engine-backend", metavar="MODULE:FACTORY",
                    help="test FACTORY() from MODULE (a zero-argument callable returning a BackendBase)")
    group.addoption("--engine-device-index", metavar="N", type=int, default=0, help="device index (default 0)")
    group.addoption("--engine-report", metavar="PATH", help="write per-rule results as JSON to PATH")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(*rule_ids): the conformance rules a test checks "
                                       "(engine.testing.rules)")
    if config.option.help or config.option.version:
        return
    kind, factory = config.getoption("--engine-kind"), config.getoption("--engine-backend")
    if (kind is None) == (factory is None):
        raise pytest.UsageError("engine.testing: give exactly one of --engine-kind KIND or "
                                "--engine-backend MODULE:FACTORY")
    if factory is not None:
        config.stash[_FACTORY] = load_factory(factory)  # a bad MODULE:FACTORY is a usage error, up front
    target = {"kind": kind, "backend": factory, "device_index": config.getoption("--engine-device-index")}
    config.stash[_REPORT] = RunReport(target)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Suite tests run from the simplest layer up (a crash in a graph run then comes after the
    backend-level findings that explain it), and every one must name known rules: a typo would
    silently drop a rule from the report."""
    items.sort(key=_stage)
    for item in items:
        marker = item.get_closest_marker(MARKER)
        if marker is None:
            if Path(str(item.path)).parent == SUITE_DIR:
                raise pytest.UsageError(f"{item.nodeid}: suite tests must declare their rules with "
                                        f"@pytest.mark.{MARKER}(...)")
            continue
        for rule_id in marker.args:
            try:
                rule(rule_id)
            except KeyError as exc:
                raise pytest.UsageError(f"{item.nodeid}: {exc.args[0]}") from None


def _stage(item: pytest.Item) -> int:
    path = Path(str(item.path))
    if path.parent != SUITE_DIR or path.stem not in STAGES:
        return len(STAGES)
    return STAGES.index(path.stem)


def pytest_report_header(config: pytest.Config) -> list[str]:
    kind, factory = config.getoption("--engine-kind"), config.getoption("--engine-backend")
    what = f"kind {kind!r} (installed plugin)" if kind else f"backend {factory}"
    return [f"engine conformance: {what}, device index {config.getoption('--engine-device-index')}"]


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Iterator[None]:
    """An exception from the backend fails the test's rule with the same message shape as a check
    (``rule <id>: expected ...; saw ...``), so every failure in the report names its rule."""
    try:
        return (yield)
    except AssertionError:
        raise
    except Exception as exc:  # skips and pytest.fail are BaseExceptions: they pass through
        marker = pyfuncitem.get_closest_marker(MARKER)
        if marker is None or not marker.args:
            raise
        raise AssertionError(f"rule {marker.args[0]}: expected no exception from the backend; saw "
                             f"{type(exc).__name__}: {exc}") from exc


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    run = item.config.stash.get(_REPORT, None)
    if run is not None:
        run.running = item.nodeid
        _save(item.config, run)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker(MARKER)
    run = item.config.stash.get(_REPORT, None)
    if run is None:
        return
    if marker is not None and (report.when == "call" or (report.when == "setup" and not report.passed)):
        run.add(TestResult(report.nodeid, report.outcome, tuple(marker.args), _message(report)))
    if report.when == "teardown":
        run.running = None
        _save(item.config, run)


def _save(config: pytest.Config, run: RunReport) -> None:
    path = config.getoption("--engine-report")
    if path:
        run.write(Path(path))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    report = config.stash.get(_REPORT, None)
    if report is None or not report.results:
        return
    terminalreporter.section("engine conformance: rules")
    for line in report.summary_lines():
        terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session) -> None:
    report = session.config.stash.get(_REPORT, None)
    if report is not None:
        report.running = None
        _save(session.config, report)


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    return str(report.longrepr or "")


# -- the backend under test ------------------------------------------------------------------------
def load_factory(spec: str) -> Any:
    """``MODULE:FACTORY`` to the callable; ``pytest.UsageError`` saying what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(f"--engine-backend {spec!r}: expected MODULE:FACTORY, e.g. my_plugin.backend:make")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise pytest.UsageError(f"--engine-backend {spec!r}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise pytest.UsageError(f"--engine-backend {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def _private_registry(spec: str, factory: Any, cache_dir: Path, device_index: int) -> Target:
    registry = Registry(Settings(cache_dir=cache_dir), autoload=False)
    try:
        backend = factory()
    except Exception as exc:  # noqa: BLE001 - the backend's own failure, reported as a rule
        return Target(f"backend {spec}", None, device_index, registry,
                      f"{spec}() raised {type(exc).__name__}: {exc}")
    registry.register_backend(backend, distribution=spec)
    kind = getattr(backend, "kind", None)
    if kind != "cpu":
        # Whatever installed distribution provides the host kind, through its entry point; when none
        # is installed, graphs of this kind alone still run.
        registry.load_entry_point("cpu")
    return Target(f"backend {spec}", kind if isinstance(kind, str) else None, device_index, registry)


@pytest.fixture(scope="session")
def conformance_target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Target:
    config = request.config
    index = config.getoption("--engine-device-index")
    kind = config.getoption("--engine-kind")
    if kind is not None:
        return Target(f"kind {kind!r}", kind, index, default_registry())
    return _private_registry(config.getoption("--engine-backend"), config.stash[_FACTORY],
                             tmp_path_factory.mktemp("engine-cache"), index)


@pytest.fixture(scope="session")
def registry(conformance_target: Target) -> Registry:
    return conformance_target.registry


@pytest.fixture(scope="session")
def device_index(conformance_target: Target) -> int:
    return conformance_target.device_index


@pytest.fixture(scope="session")
def declared_backend(conformance_target: Target) -> BackendBase:
    """The backend as registered (maybe unavailable); fails ``plugin.registered`` if it is not."""
    target = conformance_target
    if target.problem is not None:
        fail("plugin.registered", f"{target.description} to build a backend", target.problem)
    if target.kind is None:
        fail("plugin.registered", f"{target.description} to declare a kind", "no kind attribute")
    try:
        return target.registry.backend(target.kind)
    except Exception as exc:  # noqa: BLE001 - the registry's refusal is the finding
        fail("plugin.registered", f"kind {target.kind!r} registered without error", f"{type(exc).__name__}: {exc}")


@pytest.fixture(scope="session")
def backend(declared_backend: BackendBase, device_index: int) -> BackendBase:
    """The backend, available with device ``device_index``; otherwise the test is skipped."""
    try:
        avail = declared_backend.availability()
    except Exception as exc:  # noqa: BLE001 - availability.report fails separately
        lacks("device", f"availability() raised {type(exc).__name__}: {exc}")
    if not avail.available:
        lacks("device", f"kind {declared_backend.kind!r} is not available here: {avail.reason}")
    if not 0 <= device_index < avail.device_count:
        lacks("device", f"device index {device_index} does not exist ({avail.device_count} devices)")
    return declared_backend


@pytest.fixture
def stream(backend: BackendBase, device_index: int) -> Any:
    return backend.current_stream(device_index)


@pytest.fixture
def memory(backend: BackendBase, device_index: int, stream: Any) -> Iterator[DeviceMemory]:
    mem = DeviceMemory(backend, device_index, stream)
    yield mem
    mem.close()


@pytest.fixture(scope="session")
def kit(backend: BackendBase, device_index: int) -> ReferenceKit:
    return ReferenceKit(backend, device_index)
