"""Running out of memory: ``OutOfMemoryError`` with size, device and purpose, and the planned-memory limit.

Issue 12: a workspace expression of ``batch * 10**12`` or a 3 GiB output under a memory limit
escaped ``run_async`` as a builtin ``MemoryError`` without size or device. Now every allocation
failure is an ``OutOfMemoryError`` (an ``EngineError`` and a ``MemoryError``) saying how many
bytes, on which device, for what (which output, which workspace, at which key), in one line; a key
whose plan needs more than ``ENGINE_MAX_PLANNED_BYTES`` (default: the machine's physical memory
for host kinds, 2**48 bytes for device memory) is refused when it is planned, before anything is
allocated; and a graph that failed a run still runs at a smaller key.

The graph used here has one kernel (two identical candidates, so that ``tune`` has work) that
writes ``probs[0] = x[0] + 1``; its output and workspace sizes grow with the square of two symbols,
so that absurd sizes need only small inputs: ``probs`` is ``batch * batch * 3`` MiB (3 GiB at
batch=32), the workspace ``scratch * scratch * 3`` MiB.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import engine
from engine import EngineError, InputError, OutOfMemoryError
from engine.backend import BackendBase
from engine.build import GraphBuilder
from engine.plugins import Registry
from engine.settings import Settings
from engine_cpu.backend import CpuBackend

MiB = 2**20
LIMIT_ENV = "ENGINE_MAX_PLANNED_BYTES"

SOURCE = r"""
#include <stdint.h>
/* probs[0] = x[0] + 1; the output and the workspace are only sized, never filled. */
int32_t first_plus_one(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[2];
    y[0] = x[0] + 1.0f;
    return 0;
}
int32_t first_plus_one_again(void *const *t, const int64_t *sym, void *ws) {
    return first_plus_one(t, sym, ws);
}
"""


def build_graph(registry: Registry, path: Path, *, device: str = "cpu",
                output: str = "batch * batch * 786432", workspace: str = "scratch * scratch * 3145728") -> Path:
    """The test graph (see the module docstring) saved at ``path``."""
    b = GraphBuilder("oom", registry=registry)
    x = b.input("x", "float32", ["batch"], device=device)
    s = b.input("s", "uint8", ["scratch"], device=device)
    kernel = b.kernel("first_plus_one", device=device, entries=["first_plus_one", "first_plus_one_again"],
                      source=SOURCE)
    (y,) = b.call(kernel, [x, s], [("float32", [output])], symbols=["batch", "scratch"], workspace=workspace)
    b.output(y, "probs")
    b.save(path)
    return path


def inputs(batch: int = 1, scratch: int = 1) -> list[np.ndarray]:
    return [np.full(batch, 41.0, np.float32), np.zeros(scratch, np.uint8)]


def first_value(graph: engine.CompiledGraph, batch: int = 1, scratch: int = 1) -> float:
    (probs,) = graph.run_async(inputs(batch, scratch))
    return float(probs.numpy()[0])


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "\r" not in text, text
    return text


class RecordingCpu(CpuBackend):
    """The CPU plugin with every allocation recorded and ``refuse(nbytes)`` ones failing as a driver
    would (a ``MemoryError`` whose message has a line break), output buffers included: its fast
    path factories go through ``allocate`` like any other plugin's."""

    def __init__(self, cache_dir: Path):
        super().__init__(cache_dir)
        self.sizes: list[int] = []
        self.refuse: Callable[[int], bool] = lambda nbytes: False
        self.cap: int | None = None  # the largest single allocation: larger workspaces come in segments

    def max_allocation(self, device_index=0):
        return self.cap

    def _allocate(self, nbytes, device_index, stream):
        self.sizes.append(nbytes)
        if self.refuse(nbytes):
            raise MemoryError(f"simulated driver refusal of {nbytes} bytes\nsecond line")
        return super()._allocate(nbytes, device_index, stream)

    def prepare_allocation(self, nbytes, device_index=0, stream=None):
        return BackendBase.prepare_allocation(self, nbytes, device_index, stream)


@pytest.fixture
def recording(session_cache) -> tuple[Registry, RecordingCpu]:
    registry = Registry(Settings(cache_dir=session_cache), autoload=False)
    backend = RecordingCpu(session_cache)
    registry.register_backend(backend, distribution="tests")
    return registry, backend


@pytest.fixture
def bundle(tmp_path, registry) -> Path:
    return build_graph(registry, tmp_path / "oom.cgb")


@pytest.fixture(autouse=True)
def no_limit_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(LIMIT_ENV, raising=False)


# -- the error ---------------------------------------------------------------------------------------
def test_the_error_is_an_engine_error_and_a_memory_error_with_its_context_as_attributes() -> None:
    exc = OutOfMemoryError(3 * 2**30, "cpu:0", "no memory\nleft", "output 0 ('probs') at batch=32")
    assert isinstance(exc, EngineError) and isinstance(exc, MemoryError)
    assert engine.OutOfMemoryError is OutOfMemoryError
    assert (exc.nbytes, exc.device, exc.purpose) == (3 * 2**30, "cpu:0", "output 0 ('probs') at batch=32")
    assert one_line(exc) == ("cpu:0: cannot allocate 3221225472 bytes (3.0 GiB) for output 0 ('probs') at "
                             "batch=32: no memory\\nleft")
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is OutOfMemoryError and str(again) == str(exc) and again.nbytes == exc.nbytes


def test_a_size_no_device_can_provide_is_out_of_memory_not_a_value_error(registry) -> None:
    backend = registry.backend("cpu")
    with pytest.raises(OutOfMemoryError) as info:
        backend.allocate(2**62 + 1)
    assert info.value.device == "cpu:0" and "4611686018427387905 bytes" in one_line(info.value)
    with pytest.raises(OutOfMemoryError) as info:
        engine.empty((10**10, 10**10), "float32", registry=registry)
    assert "engine.empty([10000000000, 10000000000], float32)" in one_line(info.value)
    with pytest.raises(OutOfMemoryError, match="more than 2\\*\\*80 bytes"):
        engine.empty((10**5000,), "float32", registry=registry)  # too long for str(): not printed


# -- the planned-memory limit ------------------------------------------------------------------------
def test_a_huge_workspace_is_refused_when_the_key_is_planned_before_anything_is_allocated(tmp_path, recording):
    registry, backend = recording
    path = build_graph(registry, tmp_path / "ws.cgb", workspace="(scratch - 1) * 1000000000000")
    graph = engine.load_compiled_graph(path, registry=registry)
    assert first_value(graph) == 42.0
    before = len(backend.sizes)
    with pytest.raises(OutOfMemoryError) as info:
        graph.run_async(inputs(scratch=4097))  # 4096 * 10**12 bytes: more than any machine's memory
    assert backend.sizes[before:] == []  # refused before anything was allocated for the key
    exc = info.value
    text = one_line(exc)
    assert exc.device == "cpu:0" and exc.nbytes >= 4096 * 10**12
    assert text.startswith(f"cpu:0: cannot allocate {exc.nbytes} bytes (")
    assert "for the plan at batch=1, scratch=4097 (its cpu workspace 3.6 PiB + 1 output buffer 3.0 MiB)" in text
    assert "over the planned-memory limit of " in text and "the machine's physical memory" in text
    assert first_value(graph) == 42.0  # nothing lost: the small key still runs


def test_huge_outputs_are_refused_when_the_key_is_planned(bundle, registry) -> None:
    graph = engine.load_compiled_graph(bundle, registry=registry)
    with pytest.raises(OutOfMemoryError) as info:
        graph.run_async(inputs(batch=2**14))  # 3 * 2**48 bytes of probs
    text = one_line(info.value)
    assert info.value.nbytes == 3 * 2**48 + 3 * MiB and info.value.device == "cpu:0"
    assert "for the plan at batch=16384, scratch=1 (its cpu workspace 3.0 MiB + 1 output buffer 768.0 TiB)" in text
    assert first_value(graph) == 42.0


def test_the_environment_sets_the_limit_and_smaller_keys_still_run(bundle, registry, monkeypatch) -> None:
    monkeypatch.setenv(LIMIT_ENV, str(16 * MiB))
    graph = engine.load_compiled_graph(bundle, registry=registry)
    assert first_value(graph, batch=2) == 42.0  # 12 MiB of probs + 3 MiB of workspace: within
    with pytest.raises(OutOfMemoryError) as info:
        graph.run_async(inputs(batch=3))  # 27 MiB of probs
    text = one_line(info.value)
    assert info.value.nbytes == 30 * MiB
    assert f"over the planned-memory limit of 16.0 MiB ({16 * MiB} bytes, set by {LIMIT_ENV})" in text
    assert "at batch=3, scratch=1" in text
    assert first_value(graph, batch=2) == 42.0


@pytest.mark.parametrize("value", ["12G", "0", "-5", "1_000", "\u0663", "1e9", str(2**62 + 1)])
def test_a_malformed_limit_is_refused_by_name(bundle, registry, monkeypatch, value) -> None:
    monkeypatch.setenv(LIMIT_ENV, value)
    graph = engine.load_compiled_graph(bundle, registry=registry)
    with pytest.raises(InputError) as info:
        graph.run_async(inputs())
    assert one_line(info.value).startswith(f"{LIMIT_ENV}={value!r}: expected a number of bytes")


def test_device_memory_is_limited_to_2_to_the_48_by_default(tmp_path, registry2) -> None:
    path = build_graph(registry2, tmp_path / "dev.cgb", device="hostdev")
    graph = engine.load_compiled_graph(path, registry=registry2)

    def run(scratch: int) -> None:
        graph.run_async([engine.asarray(a, device="hostdev", registry=registry2) for a in inputs(scratch=scratch)])

    run(1)
    with pytest.raises(OutOfMemoryError) as info:
        run(2**13)  # 3 * 2**46 bytes of workspace: below 2**48
    assert "planned-memory limit" not in str(info.value)  # the allocator refused it, not the plan
    with pytest.raises(OutOfMemoryError) as info:
        run(2**14)  # 3 * 2**48 bytes
    text = one_line(info.value)
    assert info.value.device == "hostdev:0"
    assert f"over the planned-memory limit of 256.0 TiB ({2**48} bytes, the default for device memory" in text
    run(1)


# -- allocation failures, with what the memory was for -------------------------------------------------
def test_a_workspace_the_device_refuses_names_the_workspace_and_the_key(tmp_path, recording) -> None:
    registry, backend = recording
    graph = engine.load_compiled_graph(build_graph(registry, tmp_path / "g.cgb"), registry=registry)
    assert first_value(graph) == 42.0
    backend.refuse = lambda nbytes: nbytes > 100 * MiB
    with pytest.raises(OutOfMemoryError) as info:
        graph.run_async(inputs(scratch=8))  # 192 MiB of workspace
    assert one_line(info.value) == (f"cpu:0: cannot allocate {192 * MiB} bytes (192.0 MiB) for the cpu workspace at "
                                    f"batch=1, scratch=8: simulated driver refusal of {192 * MiB} bytes\\nsecond line")
    assert isinstance(info.value.__cause__, OutOfMemoryError)  # the backend's, without the purpose
    assert first_value(graph) == 42.0


def test_a_workspace_segment_the_device_refuses_names_the_segment(tmp_path, recording) -> None:
    """A device whose largest allocation is 4 MiB gets a 6 MiB workspace (an intermediate and a
    kernel's scratch, 3 MiB each) in two segments; the second one fails."""
    registry, backend = recording
    backend.cap = 4 * MiB
    b = GraphBuilder("segments", registry=registry)
    x, s = b.input("x", "float32", ["batch"]), b.input("s", "uint8", ["scratch"])
    kernel = b.kernel("first_plus_one", entries=["first_plus_one"], source=SOURCE)
    (h,) = b.call(kernel, [x, s], [("float32", ["batch * 786432"])], symbols=["batch", "scratch"])
    (y,) = b.call(kernel, [h, s], [("float32", ["batch"])], symbols=["batch", "scratch"],
                  workspace="scratch * 3145728")
    b.output(y, "probs")
    b.save(tmp_path / "segments.cgb")
    graph = engine.load_compiled_graph(tmp_path / "segments.cgb", registry=registry)
    before = len(backend.sizes)
    backend.refuse = lambda nbytes: len(backend.sizes) - before == 2  # the run's second allocation
    with pytest.raises(OutOfMemoryError) as info:
        graph.run_async(inputs())
    exc = info.value
    assert exc.purpose.startswith("the cpu workspace at batch=1, scratch=1 (segment 2 of 2, ")
    assert exc.nbytes == backend.sizes[before + 1] and exc.device == "cpu:0"
    one_line(exc)
    backend.refuse = lambda nbytes: False
    assert first_value(graph) == 43.0


@pytest.mark.parametrize("path", ["fast", "interpreted"])
def test_an_output_the_device_refuses_names_the_output_and_the_key(tmp_path, recording, path) -> None:
    """``fast``: prepared runs, whose output factories come from ``prepare_allocation``; ``interpreted``:
    the tuning run of a new key (and runs with hooks), which allocate outputs themselves."""
    registry, backend = recording
    bundle = build_graph(registry, tmp_path / "g.cgb")
    graph = engine.load_compiled_graph(bundle, registry=registry, dispatch_policy="first" if path == "fast" else "tune")
    assert first_value(graph) == 42.0
    backend.refuse = lambda nbytes: nbytes > 100 * MiB
    for _ in range(2):  # fast: the first run at a key prepares it, the second takes the prepared path
        with pytest.raises(OutOfMemoryError) as info:
            graph.run_async(inputs(batch=8))
        assert one_line(info.value).startswith(f"cpu:0: cannot allocate {192 * MiB} bytes (192.0 MiB) for output 0 "
                                               f"('probs') at batch=8, scratch=1: simulated driver refusal")
        assert info.value.purpose == "output 0 ('probs') at batch=8, scratch=1"
    assert graph.run_stats().fast_runs == (1 if path == "fast" else 0)
    assert first_value(graph) == 42.0


def test_tuning_inputs_the_device_refuses_name_the_input(tmp_path, recording) -> None:
    registry, backend = recording
    graph = engine.load_compiled_graph(build_graph(registry, tmp_path / "g.cgb"), registry=registry)
    backend.refuse = lambda nbytes: nbytes == 4 * 5  # only x at batch=5 has 20 bytes
    with pytest.raises(OutOfMemoryError) as info:
        graph.tune(batch=5, scratch=1)
    assert info.value.purpose == "input 0 ('x') (zero-filled, to tune) at batch=5, scratch=1"
    assert one_line(info.value).startswith("cpu:0: cannot allocate 20 bytes for input 0 ('x')")
    backend.refuse = lambda nbytes: False
    assert graph.tune(batch=5, scratch=1)


def test_capture_buffers_the_device_refuses_name_the_buffer(tmp_path, recording) -> None:
    registry, backend = recording
    graph = engine.load_compiled_graph(build_graph(registry, tmp_path / "g.cgb"), registry=registry)
    assert first_value(graph, batch=3) == 42.0
    backend.refuse = lambda nbytes: nbytes == 4 * 3  # the capture's copy of x; a run allocates no input
    with pytest.raises(OutOfMemoryError) as info:
        graph.capture(*inputs(batch=3))
    assert info.value.purpose == "a capture's copy of input 0 ('x') at batch=3, scratch=1"
    # Its output buffer; the run that capture() makes first is refused too, unless it reuses the output
    # pooled by the run above (the native run path: engine.runtime.native), and then the capture's is.
    backend.refuse = lambda nbytes: nbytes == 27 * MiB
    with pytest.raises(OutOfMemoryError,
                       match=r"for (a capture's )?output 0 \('probs'\) at batch=3, scratch=1: simulated"):
        graph.capture(*inputs(batch=3))
    backend.refuse = lambda nbytes: False
    with graph.capture(*inputs(batch=3)) as captured:
        captured.replay()
        assert float(captured.outputs[0].numpy()[0]) == 42.0


def test_engine_empty_names_its_shape_and_dtype(recording) -> None:
    registry, backend = recording
    backend.refuse = lambda nbytes: nbytes > MiB
    with pytest.raises(OutOfMemoryError) as info:
        engine.empty((1024, 1024), "float32", registry=registry)
    assert info.value.purpose == "engine.empty([1024, 1024], float32)"
    assert one_line(info.value).startswith("cpu:0: cannot allocate 4194304 bytes (4.0 MiB) for engine.empty(")


def test_an_os_error_from_the_plugin_is_out_of_memory_too(recording) -> None:
    registry, backend = recording

    def refuse(nbytes: int) -> bool:
        raise OSError(12, "Cannot allocate memory")

    backend.refuse = refuse
    with pytest.raises(OutOfMemoryError) as info:
        backend.allocate(64)
    assert one_line(info.value) == "cpu:0: cannot allocate 64 bytes: [Errno 12] Cannot allocate memory"


def test_the_cpu_fast_path_reports_numpy_running_out_with_the_output(bundle, registry, monkeypatch) -> None:
    """The CPU plugin's fast-path factory allocates from numpy directly; 768 TiB cannot be mapped in
    any process, whatever the overcommit setting."""
    monkeypatch.setenv(LIMIT_ENV, str(2**62))
    graph = engine.load_compiled_graph(bundle, registry=registry, dispatch_policy="first")
    assert first_value(graph) == 42.0
    for _ in range(2):  # prepared on the first run, the fast path on the second
        with pytest.raises(OutOfMemoryError) as info:
            graph.run_async(inputs(batch=2**14))
        exc = info.value
        assert (exc.nbytes, exc.device) == (3 * 2**48, "cpu:0")
        assert exc.purpose == "output 0 ('probs') at batch=16384, scratch=1"
        assert one_line(exc).startswith(f"cpu:0: cannot allocate {3 * 2**48} bytes (768.0 TiB) for output 0 ('probs') "
                                        f"at batch=16384, scratch=1: ")
    assert graph.run_stats().fast_runs == 1
    with pytest.raises(OutOfMemoryError, match=r"for the cpu workspace at batch=1, scratch=16384: "):
        graph.run_async(inputs(scratch=2**14))
    assert first_value(graph) == 42.0


# -- a real memory limit -----------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import engine

    def inputs(batch, scratch):
        return [np.full(batch, 41.0, np.float32), np.zeros(scratch, np.uint8)]

    graph = engine.load_compiled_graph(sys.argv[1], dispatch_policy=sys.argv[2])
    print(json.dumps({"small": float(graph.run_async(inputs(1, 1))[0].numpy()[0])}), flush=True)
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    limit = mapped + 2**30  # one GiB more than this process maps now
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    for batch, scratch in ((32, 1), (32, 1), (1, 32)):  # a 3 GiB output (twice), a 3 GiB workspace
        try:
            graph.run_async(inputs(batch, scratch))
        except engine.OutOfMemoryError as exc:
            print(json.dumps({"error": str(exc), "nbytes": exc.nbytes, "device": exc.device,
                              "purpose": exc.purpose}), flush=True)
    print(json.dumps({"small": float(graph.run_async(inputs(1, 1))[0].numpy()[0])}), flush=True)
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc to size the limit")
@pytest.mark.parametrize("policy", ["first", "tune"])
def test_a_real_address_space_limit_gives_out_of_memory_errors_and_loses_nothing(bundle, session_cache,
                                                                                 policy) -> None:
    """A child process under ``RLIMIT_AS`` asks for a 3 GiB output and a 3 GiB workspace. ``first``:
    the output comes from the CPU plugin's fast-path factory (prepared, then the fast path);
    ``tune``: from the tuning run's own allocation."""
    env = {**os.environ, "ENGINE_CACHE_DIR": str(session_cache), "ENGINE_CPU_NUM_THREADS": "1"}
    env.pop(LIMIT_ENV, None)
    child = subprocess.run([sys.executable, "-c", CHILD, str(bundle), policy], capture_output=True, text=True,
                           env=env, timeout=300)
    assert child.returncode == 0 and child.stderr == "", child.stderr
    lines = [json.loads(line) for line in child.stdout.splitlines()]
    assert [line.get("small") for line in (lines[0], lines[-1])] == [42.0, 42.0]
    failures = lines[1:-1]
    assert len(failures) == 3, lines
    for failure, purpose in zip(failures, ["output 0 ('probs') at batch=32, scratch=1"] * 2
                                + ["the cpu workspace at batch=1, scratch=32"]):
        assert failure["nbytes"] == 3 * 2**30 and failure["device"] == "cpu:0" and failure["purpose"] == purpose
        assert failure["error"].startswith(f"cpu:0: cannot allocate 3221225472 bytes (3.0 GiB) for {purpose}: ")
        assert "\n" not in failure["error"]
