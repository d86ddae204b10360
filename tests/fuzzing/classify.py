"""One case, in the worker: build the bundle, load it, run it, and say what happened.

Outcomes (``Result.cls``):

* ``ok``: loaded and ran (with the seed's outputs when every mutation preserves semantics);
* ``clean``: an ``EngineError`` in one line that names a member (and the JSON path when the
  mutated JSON member is the one blamed), or names the input/device for errors at run time;
* ``native-trust``: a crash, hang, wrong output or memory blow-up after a mutation of what native
  code trusts (kernel binaries, entries, workspace sizes); kept out of the failure count;
* ``FAILURE``: anything else, with ``kind`` saying which: ``exception`` (not an EngineError),
  ``multiline``, ``unnamed``, ``nopath``, ``accepted`` (the spec requires a refusal),
  ``refused-valid``, ``wrong-output``, ``memory``, and (decided by the parent) ``crash``, ``hang``.
"""

from __future__ import annotations

import resource
import tempfile
import traceback
from pathlib import Path
from typing import Any

import attrs
import numpy as np

import engine
from engine.errors import BundleError, DeviceUnavailableError, EngineError, PluginError
from engine.plugins import Registry

from fuzzing.craft import materialise
from fuzzing.mutators import apply_case, describe, expectation, is_native
from fuzzing.seeds import Seed

__all__ = ["Result", "run_case", "MEMORY_GROWTH_LIMIT"]

#: A case that grows the worker's peak memory by more than this is a failure (a zip bomb inflated).
MEMORY_GROWTH_LIMIT = 256 * 2**20
_VALUE_ACTIONS = ("replace", "delete", "expr")
_RAW_SPECS = ("raw", "deep", "bigint", "longlist")


@attrs.define
class Result:
    cls: str  # ok | clean | native-trust | FAILURE | skip
    kind: str = ""
    phase: str = ""
    error_type: str = ""
    message: str = ""
    where: str = ""
    expect: str = ""
    native: bool = False
    restart: bool = False

    def signature(self) -> str:
        """What makes two failures the same bug: kind, exception type and where it was raised."""
        return f"{self.kind}|{self.error_type}|{self.where}"

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _where(exc: BaseException) -> str:
    """The innermost frame in engine code (or the innermost frame at all): ``file:line in function``."""
    frames = traceback.extract_tb(exc.__traceback__)
    inner = [f for f in frames if "/engine/" in f.filename or "engine_cpu" in f.filename] or frames
    if not inner:
        return ""
    f = inner[-1]
    path = f.filename
    for marker in ("/engine/", "/engine_cpu/"):
        if marker in path:
            path = marker.strip("/") + "/" + path.split(marker, 1)[1]
            break
    return f"{path}:{f.lineno} in {f.name}"


def _escaped(text: str) -> str:
    """``text`` as engine messages show it: non-printable characters as escapes."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def _names_something(exc: BaseException, message: str, names: set[str], source: str) -> bool:
    """The message says where: a member (as the engine read it), a kernel, or the bundle itself."""
    member = getattr(exc, "member", None)
    if isinstance(member, str) and member.strip() and member in message:
        return True
    if member == "" and message.startswith("'':"):  # an empty member name, shown quoted
        return True
    if isinstance(member, str) and member.strip() and _escaped(member) in message:  # control characters escaped
        return True
    if source in message or "in-memory bundle" in message or "kernel '" in message:
        return True
    return any(n and (n in message or repr(n)[1:-1] in message) for n in names)


def _json_member_blamed(exc: BaseException, applied: list[dict[str, Any]]) -> bool:
    """A single JSON value mutation, blamed on its member without a JSON path.

    Raw tokens (5,000-digit numbers, NaN, deep nesting) fail while parsing, where no path exists
    yet; cases with several mutations may be refused for another one.
    """
    if not isinstance(exc, BundleError) or exc.path or len(applied) != 1:
        return False
    m = applied[0]
    return (m["op"] in ("json", "expr", "manifest_json") and m.get("action") in _VALUE_ACTIONS
            and m.get("spec", {}).get("t") not in _RAW_SPECS and (m.get("member") or "manifest.json") == exc.member)


def _judge_error(exc: BaseException, phase: str, names: set[str], source: str,
                 applied: list[dict[str, Any]]) -> Result:
    message = str(exc)
    base = Result("FAILURE", phase=phase, error_type=type(exc).__name__, message=message[:2000], where=_where(exc))
    if not isinstance(exc, EngineError):
        return attrs.evolve(base, kind="exception")
    if "\n" in message or "\r" in message:
        return attrs.evolve(base, kind="multiline")
    if phase == "load" and not isinstance(exc, (DeviceUnavailableError, PluginError)) \
            and not _names_something(exc, message, names, source):
        return attrs.evolve(base, kind="unnamed")
    if phase == "load" and _json_member_blamed(exc, applied):
        return attrs.evolve(base, kind="nopath")
    return attrs.evolve(base, cls="clean")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _outputs_match(got: list[np.ndarray], expected: list[np.ndarray]) -> bool:
    if len(got) != len(expected):
        return False
    return all(g.shape == e.shape and g.dtype == e.dtype and np.allclose(g, e, rtol=1e-5, atol=1e-6)
               for g, e in zip(got, expected))


def _load_and_run(source: Any, seed: Seed, registry: Registry, names: set[str], source_text: str,
                  applied: list[dict[str, Any]], expect: str) -> Result:
    try:
        graph = engine.load_compiled_graph(source, registry=registry)
    except BaseException as exc:  # noqa: BLE001 - classifying every escape is the point
        result = _judge_error(exc, "load", names, source_text, applied)
        if result.cls == "clean" and expect == "preserve":
            return attrs.evolve(result, cls="FAILURE", kind="refused-valid")
        return result
    try:
        if expect == "refuse":
            return Result("FAILURE", kind="accepted", phase="load", where=describe(applied, "refuse"),
                          message="loaded although the spec refuses it")
        try:
            outputs = [o.numpy() for o in graph.run_async(seed.make_inputs())]
        except BaseException as exc:  # noqa: BLE001
            return _judge_error(exc, "run", names, source_text, applied)
        if expect == "preserve" and not _outputs_match(outputs, seed.expected):
            return Result("FAILURE", kind="wrong-output", phase="run", where=describe(applied),
                          message="outputs differ from the seed's")
        return Result("ok", phase="run")
    finally:
        graph.close()


def run_case(case: dict[str, Any], seeds: dict[str, Seed], registry: Registry, workdir: Path) -> Result:
    """Build, load, run and classify one case (never raises for what the engine does)."""
    seed = seeds[case["seed"]]
    try:
        draft, applied = apply_case(case, seeds)
    except Exception as exc:  # noqa: BLE001 - a fuzzer bug, reported as such
        return Result("skip", kind="fuzzer", error_type=type(exc).__name__, message=str(exc)[:500], where=_where(exc))
    expect, native = expectation(applied), is_native(applied)
    names = set(seed.members) | set(draft.members) | set(draft.specials) | {"manifest.json"}
    before = _peak_rss()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        try:
            source = materialise(draft, Path(tmp))
        except (OSError, ValueError, UnicodeError) as exc:
            return Result("skip", kind="unwritable", error_type=type(exc).__name__, message=str(exc)[:300])
        source_text = source if isinstance(source, str) else "in-memory bundle"
        result = _load_and_run(source, seed, registry, names, source_text, applied, expect)
        del source
    result.expect, result.native = expect, native
    if _peak_rss() - before > MEMORY_GROWTH_LIMIT:
        result = attrs.evolve(result, cls="FAILURE", kind="memory", restart=True,
                              message=f"peak memory grew by {(_peak_rss() - before) >> 20} MiB; was: {result.message}")
    if native and result.cls == "FAILURE" and result.kind in ("wrong-output", "memory"):
        result = attrs.evolve(result, cls="native-trust")
    return result
