"""The OpenCL plugin (plugins/opencl, ``engine-opencl``) on a real OpenCL driver.

Everything runs on whatever OpenCL device is installed (PoCL's CPU device in CI, through the
``pocl`` extra): real buffers, real builds, real queues and events. Broken installs are made for
real in subprocesses (an ICD loader that finds no driver, a pyopencl that cannot be imported).
The plugin is registered in a private registry, the way its entry point would register it.
"""

from __future__ import annotations

import ast
import ctypes
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install './plugins/opencl[pocl]')")

import engine  # noqa: E402
import engine_opencl.plugin as opencl_plugin  # noqa: E402
from engine.backend import BinaryPayload, CandidateSpec, LaunchConfig, LaunchDims  # noqa: E402
from engine.build import GraphBuilder  # noqa: E402
from engine.errors import KernelError  # noqa: E402
from engine.expr import parse_expr  # noqa: E402
from engine.plugins import Registry  # noqa: E402
from engine.pointer import BufferPtr  # noqa: E402
from engine.settings import Settings  # noqa: E402

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "engine_opencl"
ALLOWED_ENGINE_MODULES = {"engine", "engine.backend", "engine.backend.contract", "engine.backend.base",
                          "engine.backend.events", "engine.backend.cachefiles", "engine.pointer", "engine.storage",
                          "engine.device", "engine.errors", "engine.settings", "engine.hookspecs"}
#: Symbols and tensor counts of each reference kernel: (inputs, outputs, symbols, workspace).
SIGNATURES = {"add": (2, 1, ("n",), False), "scale_ws": (1, 1, ("n",), True), "busy": (1, 1, ("n", "iters"), False),
              "mlp_matmul": (2, 1, ("batch",), False), "mlp_bias_relu": (2, 1, ("batch",), False),
              "mlp_bias_add": (2, 1, ("batch",), False), "mlp_softmax": (1, 1, ("batch",), True)}


def _registry(cache_dir: Path) -> Registry:
    registry = Registry(Settings(cache_dir=cache_dir), autoload=False)
    registry.register_plugin(opencl_plugin, name="opencl", distribution="engine-opencl")
    return registry


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Registry:
    registry = _registry(tmp_path_factory.mktemp("opencl-cache"))
    avail = registry.backend("opencl").availability()
    if not avail.available:
        pytest.skip(f"no usable OpenCL device: {avail.reason}")
    return registry


@pytest.fixture(scope="module")
def backend(registry):
    return registry.backend("opencl")


def _launch(config: dict) -> LaunchConfig:
    return LaunchConfig(tuple(parse_expr(v) for v in config["grid"]), tuple(parse_expr(v) for v in config["block"]),
                        parse_expr(config.get("shared_memory", 0)))


def _spec(backend, name: str, entry: str | None = None, defines: str = "", binaries=None, launch="ref"):
    ref = backend.reference_kernels()[name]
    n_in, n_out, symbols, ws = SIGNATURES[name]
    if binaries is None:
        binaries = backend.compile(defines + ref.source, ref.language, ref.options)
    config = _launch(ref.launch) if launch == "ref" else launch
    return CandidateSpec(name, 0, entry or ref.entries[0], tuple(binaries), config, n_in, n_out, symbols, ws)


def _upload(backend, array: np.ndarray, stream):
    array = np.ascontiguousarray(array)
    storage = backend.allocate(array.nbytes, 0, stream)
    backend.copy_from_host(storage.ptr, array.ctypes.data, array.nbytes, stream)
    return storage


def _download(backend, ptr, shape, stream, dtype=np.float32) -> np.ndarray:
    out = np.zeros(shape, dtype)
    backend.copy_to_host(out.ctypes.data, ptr, out.nbytes, stream)
    backend.synchronize(0, stream)
    return out


def _run(backend, spec, inputs, out_shapes, symbols, workspace_bytes=0):
    stream = backend.current_stream(0)
    kernel = backend.load_kernel(spec, 0)
    ins = [_upload(backend, a, stream) for a in inputs]
    outs = [backend.allocate(int(np.prod(s)) * 4, 0, stream) for s in out_shapes]
    ws = backend.allocate(workspace_bytes, 0, stream) if workspace_bytes else None
    dims = spec.launch.evaluate(spec.symbols, symbols)
    kernel.launch([s.ptr for s in ins + outs], symbols, ws.ptr if ws else None, stream, dims)
    return [_download(backend, o.ptr, s, stream) for o, s in zip(outs, out_shapes)]


# -- declared data and availability ----------------------------------------------------------------

def test_devices_lists_opencl_with_platform_device_and_driver(registry, backend) -> None:
    row = {r.kind: r for r in engine.devices(registry)}["opencl"]
    assert row.available and row.device_count >= 1 and row.workspace_slot == 3 and row.api_version == (2, 0)
    assert all(" / " in name for name in row.device_names)  # "platform / device"
    assert "driver" in row.driver
    assert backend.dlpack_device_type == 4 and not backend.host_accessible and not backend.has_streams
    assert backend.alignment >= 128


def test_engine_devices_and_engine_demo_on_opencl_from_the_command_line(tmp_path) -> None:
    """The installed plugin, found through its entry point, as a user meets it."""
    env = {**os.environ, "ENGINE_CACHE_DIR": str(tmp_path / "cache")}
    devices = subprocess.run([sys.executable, "-m", "engine.cli.main", "devices"], capture_output=True, text=True,
                             env=env, timeout=300)
    assert devices.returncode == 0, devices.stderr
    lines = devices.stdout.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("opencl ")]
    row = lines[at]
    # The devices column goes on on indented lines when the row is wider than 80 columns (issue 24).
    entry = " ".join([row, *itertools.takewhile(lambda line: line.startswith("    "), lines[at + 1:])])
    assert row.split()[:5] == ["opencl", "yes", row.split()[2], "3", "2.0"] and "driver" in entry
    demo = subprocess.run([sys.executable, "-m", "engine.cli.main", "demo", "--device", "opencl"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "on opencl:0" in demo.stdout and demo.stdout.count(" ok ") == 3 and "demo passed" in demo.stdout


def test_device_filter_matching_nothing_is_an_unavailable_kind(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(opencl_plugin.DEVICES_ENV, "no-such-opencl-device")
    row = {r.kind: r for r in engine.devices(_registry(tmp_path))}["opencl"]
    assert not row.available
    assert "ENGINE_OPENCL_DEVICES='no-such-opencl-device' matches none of" in row.reason


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def test_a_broken_opencl_install_shows_as_an_unavailable_kind_with_its_reason(tmp_path) -> None:
    empty = tmp_path / "no-icds"
    empty.mkdir()
    # pyopencl's wheels ship an ICD loader that also reads $PYOPENCL_HOME/.libs, where the pocl
    # wheel puts its ICD, and pyopencl sets that variable when imported: point it at an empty
    # directory afterwards (the loader reads it at the first OpenCL call), and OCL_ICD_VENDORS too.
    result = _python(f"""
        import json, os, sys
        import pyopencl
        os.environ["PYOPENCL_HOME"] = {str(empty)!r}
        import engine
        from engine.cli.main import main
        row = {{r.kind: r for r in engine.devices()}}["opencl"]
        print(json.dumps([row.available, row.reason]))
        sys.exit(main(["devices"]))
        """, {"OCL_ICD_VENDORS": str(empty), "ENGINE_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    available, reason = json.loads(result.stdout.splitlines()[0])
    assert not available
    assert "no OpenCL platform" in reason and "-1001" in reason and "engine-opencl[pocl]" in reason
    table_row = next(line for line in result.stdout.splitlines() if line.startswith("opencl "))
    assert " no " in table_row and "no OpenCL platform" in table_row


def test_without_pyopencl_the_kind_says_what_to_install(tmp_path) -> None:
    result = _python("""
        import json, sys
        sys.modules["pyopencl"] = None  # what an environment without pyopencl sees: ImportError
        import engine
        row = {r.kind: r for r in engine.devices()}["opencl"]
        print(json.dumps([row.available, row.reason]))
        """, {"ENGINE_CACHE_DIR": str(tmp_path)})
    available, reason = json.loads(result.stdout.splitlines()[-1])
    assert not available and "pip install 'engine-opencl[pocl]'" in reason


def test_importing_the_plugin_does_not_touch_the_driver() -> None:
    result = _python("""
        import sys
        import engine_opencl, engine_opencl.plugin, engine_opencl.backend, engine_opencl.reference
        engine_opencl.plugin.engine_backends(__import__("engine.settings").settings.Settings())
        print("pyopencl" in sys.modules)
        """, {})
    assert result.stdout.strip() == "False", result.stderr


def test_the_plugin_uses_only_the_public_contract() -> None:
    problems = []
    for path in sorted(PLUGIN_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        engine_aliases = set()
        for node in ast.walk(tree):
            modules: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.Import):
                modules = [(a.name, []) for a in node.names]
                engine_aliases |= {(a.asname or a.name).split(".")[0] for a in node.names
                                   if a.name.startswith("engine")}
            elif isinstance(node, ast.ImportFrom):
                modules = [(node.module or "", [a.name for a in node.names])]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in engine_aliases and (node.attr.startswith("_") or node.attr == "runtime")):
                problems.append(f"{path.name}:{node.lineno}: engine.{node.attr}")
            for module, names in modules:
                top = module.split(".")[0]
                if top == "engine_cpu" or module.startswith("engine.runtime"):
                    problems.append(f"{path.name}:{node.lineno}: imports {module}")
                elif top == "engine" and module not in ALLOWED_ENGINE_MODULES:
                    problems.append(f"{path.name}:{node.lineno}: imports {module}, not part of the plugin contract")
                if top in ("engine", "engine_opencl") and any(p.startswith("_") for p in module.split(".") + names):
                    problems.append(f"{path.name}:{node.lineno}: imports a private name from {module}")
    assert not problems, problems


# -- memory ------------------------------------------------------------------------------------------

def test_allocations_zero_odd_and_large(backend) -> None:
    stream = backend.current_stream(0)
    empty = backend.allocate(0, 0, stream)
    assert empty.nbytes == 0 and isinstance(empty.ptr, BufferPtr) and empty.host_view is None
    backend.copy_from_host(empty.ptr, 0, 0, stream)  # zero-byte copies are no-ops, even at NULL
    odd = _upload(backend, np.arange(7, dtype=np.uint8), stream)
    np.testing.assert_array_equal(_download(backend, odd.ptr, 7, stream, np.uint8), np.arange(7))
    size = 64 << 20
    large = backend.allocate(size, 0, stream)
    tail = np.arange(4096, dtype=np.uint8)
    backend.copy_from_host(large.ptr + (size - tail.size), tail.ctypes.data, tail.size, stream)
    np.testing.assert_array_equal(_download(backend, large.ptr + (size - tail.size), tail.size, stream, np.uint8), tail)
    for storage in (empty, odd, large):
        storage.close()
    assert backend.max_allocation(0) >= size


def test_max_allocation_follows_the_env_override_and_bounds_allocate(tmp_path, monkeypatch, backend) -> None:
    monkeypatch.setenv(opencl_plugin.MAX_ALLOC_ENV, str(1 << 20))
    capped = _registry(tmp_path).backend("opencl")
    assert capped.max_allocation(0) == 1 << 20
    capped.allocate(1 << 20, 0, capped.current_stream(0)).close()
    with pytest.raises(MemoryError, match=r"opencl:0: cannot allocate 1048577 bytes .*largest single allocation"):
        capped.allocate((1 << 20) + 1, 0, capped.current_stream(0))


def test_copies_and_memset_at_odd_offsets(backend) -> None:
    stream = backend.current_stream(0)
    model_a = np.zeros(1000, np.uint8)
    model_b = np.zeros(1000, np.uint8)
    a = _upload(backend, model_a, stream)
    b = _upload(backend, model_b, stream)
    data = np.random.default_rng(1).integers(0, 256, 101, dtype=np.uint8)
    backend.copy_from_host(a.ptr + 3, data.ctypes.data, 101, stream)
    model_a[3:104] = data
    backend.copy_device(b.ptr + 11, a.ptr + 5, 77, stream)
    model_b[11:88] = model_a[5:82]
    backend.memset(a.ptr + 13, 0xAB, 29, stream)
    model_a[13:42] = 0xAB
    backend.copy_device(a.ptr + 501, a.ptr + 1, 99, stream)  # same buffer, disjoint regions
    model_a[501:600] = model_a[1:100]
    np.testing.assert_array_equal(_download(backend, a.ptr, 1000, stream, np.uint8), model_a)
    np.testing.assert_array_equal(_download(backend, b.ptr, 1000, stream, np.uint8), model_b)
    part = np.zeros(33, np.uint8)
    backend.copy_to_host(part.ctypes.data, a.ptr + 7, 33, stream)
    backend.synchronize(0, stream)
    np.testing.assert_array_equal(part, model_a[7:40])


# -- events and timing -------------------------------------------------------------------------------

def _other_threads_queue(backend):
    from support import run_in_threads

    got = []
    run_in_threads(lambda i: got.append(backend.current_stream(0)), 1)
    return got[0]


def test_events_order_work_across_queues_and_time_it(backend) -> None:
    mine, other = backend.current_stream(0), _other_threads_queue(backend)
    assert mine != other and backend.current_stream(0) is mine
    n, iters = 4096, 20000
    x = np.arange(n, dtype=np.float32)
    kernel = backend.load_kernel(_spec(backend, "busy"), 0)
    src, dst = _upload(backend, x, mine), backend.allocate(n * 4, 0, mine)
    start, end, never = (backend.create_event(0) for _ in range(3))
    assert never.query()  # never recorded: complete
    start.record(mine)
    kernel.launch([src.ptr, dst.ptr], [n, iters], None, mine, LaunchDims((n // 64, 1, 1), (64, 1, 1)))
    end.record(mine)
    end.wait(other)  # the read below, on another queue, runs after the kernel
    out = np.zeros(n, np.float32)
    backend.copy_to_host(out.ctypes.data, dst.ptr, out.nbytes, other)
    backend.synchronize(0, other)
    np.testing.assert_array_equal(out, x + iters)
    end.synchronize()
    assert end.query() and start.query()
    assert start.elapsed_ms(end) > 0


def test_time_gives_positive_device_times(backend) -> None:
    stream = backend.current_stream(0)
    n = 1024
    kernel = backend.load_kernel(_spec(backend, "busy"), 0)
    src, dst = backend.allocate(n * 4, 0, stream), backend.allocate(n * 4, 0, stream)
    launch = kernel.prepare([src.ptr, dst.ptr], [n, 1000], None, stream, LaunchDims((n // 64, 1, 1), (64, 1, 1)))
    samples = backend.time(launch.call, stream=stream, repeat=3)
    assert len(samples) == 3 and all(0 < s < 60_000 for s in samples)


# -- programs and kernels ----------------------------------------------------------------------------

def test_reference_kernels_match_numpy(backend) -> None:
    rng = np.random.default_rng(3)
    n = 203
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    np.testing.assert_array_equal(_run(backend, _spec(backend, "add"), [x, y], [(n,)], [n])[0], x + y)
    np.testing.assert_array_equal(_run(backend, _spec(backend, "scale_ws"), [x], [(n,)], [n], n * 4)[0], 2 * x + 1)
    np.testing.assert_array_equal(_run(backend, _spec(backend, "busy"), [x], [(n,)], [n, 3])[0], x + 1 + 1 + 1)
    assert "fail_code" not in backend.reference_kernels()
    batch, k, m = 5, 64, 128
    dims = f"#define K {k}\n#define N {m}\n"
    a, w = rng.standard_normal((batch, k)).astype(np.float32), rng.standard_normal((k, m)).astype(np.float32)
    for entry in backend.reference_kernels()["mlp_matmul"].entries:
        (c,) = _run(backend, _spec(backend, "mlp_matmul", entry, dims), [a, w], [(batch, m)], [batch])
        np.testing.assert_allclose(c, a @ w, rtol=1e-4, atol=1e-4)
    h, bias = rng.standard_normal((batch, m)).astype(np.float32), rng.standard_normal(m).astype(np.float32)
    (r,) = _run(backend, _spec(backend, "mlp_bias_add", defines=dims), [h, bias], [(batch, m)], [batch])
    np.testing.assert_array_equal(r, h + bias)
    (p,) = _run(backend, _spec(backend, "mlp_softmax", defines=dims), [h], [(batch, m)], [batch], batch * 4)
    e = np.exp(h.astype(np.float64) - h.max(axis=1, keepdims=True))
    np.testing.assert_allclose(p, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_in_place_kernel_on_a_sub_buffer(backend) -> None:
    """bias_relu over x in place, with x at an aligned non-zero offset (passed as a sub-buffer)."""
    stream = backend.current_stream(0)
    batch, m = 3, 16
    rng = np.random.default_rng(4)
    h, bias = rng.standard_normal((batch, m)).astype(np.float32), rng.standard_normal(m).astype(np.float32)
    kernel = backend.load_kernel(_spec(backend, "mlp_bias_relu", defines=f"#define N {m}\n"), 0)
    arena = backend.allocate(backend.alignment * 2 + h.nbytes, 0, stream)
    x = arena.ptr + backend.alignment * 2
    backend.copy_from_host(x, h.ctypes.data, h.nbytes, stream)
    b = _upload(backend, bias, stream)
    kernel.launch([x, b.ptr, x], [batch], None, stream, LaunchDims((batch, 1, 1), (64, 1, 1)))
    np.testing.assert_array_equal(_download(backend, x, (batch, m), stream), np.maximum(h + bias, 0))


def test_a_prepared_launch_follows_set_tensor_and_refuses_misaligned_offsets(backend) -> None:
    stream = backend.current_stream(0)
    n = 100
    x = np.arange(n, dtype=np.float32)
    kernel = backend.load_kernel(_spec(backend, "add"), 0)
    a = _upload(backend, x, stream)
    z1, z2 = (_upload(backend, np.zeros(n, np.float32), stream) for _ in range(2))
    launch = kernel.prepare([a.ptr, a.ptr, z1.ptr], [n], None, stream, LaunchDims((2, 1, 1), (64, 1, 1)))
    launch.set_tensor(2, z2.ptr)
    assert launch.call() == 0
    np.testing.assert_array_equal(_download(backend, z2.ptr, n, stream), 2 * x)
    np.testing.assert_array_equal(_download(backend, z1.ptr, n, stream), np.zeros(n))
    wide = backend.allocate(backend.alignment + n * 4, 0, stream)
    launch.set_tensor(2, wide.ptr + backend.alignment)
    assert launch.call() == 0
    np.testing.assert_array_equal(_download(backend, wide.ptr + backend.alignment, n, stream), 2 * x)
    with pytest.raises(KernelError, match=r"kernel 'add' candidate 0 .*tensor argument 2.*offset 4.*MEM_BASE_ADDR"):
        launch.set_tensor(2, wide.ptr + 4)


def test_a_launch_the_driver_refuses_fails_with_kernel_device_and_message(backend) -> None:
    stream = backend.current_stream(0)
    kernel = backend.load_kernel(_spec(backend, "add"), 0)
    buf = backend.allocate(4096, 0, stream)
    too_big = LaunchDims((1, 1, 1), (1 << 20, 1, 1))  # more work-items per group than any device allows
    launch = kernel.prepare([buf.ptr] * 3, [1], None, stream, too_big)
    code = launch.call()
    assert code != 0
    with pytest.raises(KernelError, match=r"kernel 'add' candidate 0 \(entry 'add'\) on opencl:0 \(.*\): launch failed "
                                          r"with OpenCL error -\d+: .*WORK_GROUP_SIZE"):
        launch.fail(code)


def test_binary_selection_skips_a_bad_binary_for_a_good_one(backend) -> None:
    good = backend.compile(backend.reference_kernels()["add"].source, "opencl", {"name": "add"})
    bad_source = BinaryPayload("opencl-source", "opencl-c-1.2", "bad.cl",
                               b"__kernel void add(__global float *x) { x[0] = nope; }")
    foreign = BinaryPayload("cubin", "sm_90", "add.cubin", b"\x7fELF")
    kernel = backend.load_kernel(_spec(backend, "add", binaries=(foreign, bad_source, *good)), 0)
    assert kernel.binary.path == "add.cl"
    with pytest.raises(KernelError) as info:
        backend.load_kernel(_spec(backend, "add", binaries=(foreign, bad_source)), 0)
    message = str(info.value)
    assert "add.cubin (cubin, sm_90): format 'cubin' is not 'opencl-source'" in message
    assert "bad.cl (opencl-source, opencl-c-1.2): the OpenCL C source does not build" in message and "nope" in message


def test_a_source_that_does_not_build_fails_at_compile_with_the_build_log(backend) -> None:
    with pytest.raises(KernelError, match=r"(?s)does not build for opencl:0 .*undeclared_thing"):
        backend.compile("__kernel void k(__global float *x) { x[0] = undeclared_thing; }", "opencl")
    with pytest.raises(KernelError, match=r"unknown opencl compile option\(s\) \['flags'\]"):
        backend.compile(backend.reference_kernels()["add"].source, "opencl", {"flags": ["-O3"]})


def test_build_options_travel_in_the_payload(backend) -> None:
    source = "__kernel void k(__global float *x, long n) { x[0] = SCALE; }"
    (payload,) = backend.compile(source, "opencl", {"build_options": ["-DSCALE=3.0f"], "name": "k"})
    spec = CandidateSpec("k", 0, "k", (payload,), _launch({"grid": [1, 1, 1], "block": [1, 1, 1]}), 0, 1, ("n",), False)
    stream = backend.current_stream(0)
    out = backend.allocate(4, 0, stream)
    backend.load_kernel(spec, 0).launch([out.ptr], [1], None, stream, LaunchDims((1, 1, 1), (1, 1, 1)))
    assert _download(backend, out.ptr, 1, stream)[0] == 3.0


def test_candidates_must_match_the_abi_and_have_a_launch_configuration(backend) -> None:
    with pytest.raises(KernelError, match=r"kernel 'add' candidate 0 .*has no launch configuration"):
        backend.load_kernel(_spec(backend, "add", launch=None), 0)
    ref = backend.reference_kernels()["add"]
    spec = CandidateSpec("add", 0, "add", backend.compile(ref.source, "opencl"), _launch(ref.launch), 2, 1, ("n",),
                         True)
    with pytest.raises(KernelError, match=r"takes 4 arguments, the opencl ABI passes 5 .*\+ workspace"):
        backend.load_kernel(spec, 0)
    int_symbol = backend.compile("__kernel void k(__global float *x, int n) { x[0] = n; }", "opencl")
    spec = CandidateSpec("k", 0, "k", int_symbol, _launch({"grid": [1, 1, 1], "block": [1, 1, 1]}), 0, 1, ("n",), False)
    stream = backend.current_stream(0)
    with pytest.raises(KernelError, match=r"cannot set argument 1 \(symbol 'n'\): .*INVALID_ARG_SIZE"):
        backend.load_kernel(spec, 0).prepare([backend.allocate(4, 0, stream).ptr], [1], None, stream,
                                             LaunchDims((1, 1, 1), (1, 1, 1)))


def test_programs_are_cached_on_disk_by_content(tmp_path, backend) -> None:
    fresh = _registry(tmp_path).backend("opencl")
    fresh.load_kernel(_spec(fresh, "scale_ws"), 0)
    cached = sorted(p.name for p in (tmp_path / "opencl").glob("*.bin*"))
    assert len(cached) == 2 and cached[1] == cached[0] + ".sha256"
    again = _registry(tmp_path).backend("opencl")  # a new process would start like this
    n = 10
    x = np.arange(n, dtype=np.float32)
    np.testing.assert_array_equal(_run(again, _spec(again, "scale_ws"), [x], [(n,)], [n], n * 4)[0], 2 * x + 1)


def test_threads_each_get_their_own_queue_and_correct_results(backend) -> None:
    from support import run_in_threads

    kernel = backend.load_kernel(_spec(backend, "scale_ws"), 0)
    queues, results = [None] * 8, [None] * 8

    def work(i: int) -> None:
        stream = backend.current_stream(0)
        n = 1000 + 37 * i
        x = np.arange(n, dtype=np.float32) * (i + 1)
        src, dst, ws = (_upload(backend, x, stream), backend.allocate(n * 4, 0, stream),
                        backend.allocate(n * 4, 0, stream))
        for _ in range(5):
            kernel.launch([src.ptr, dst.ptr], [n], ws.ptr, stream, LaunchDims((-(-n // 64), 1, 1), (64, 1, 1)))
        queues[i] = stream
        results[i] = np.array_equal(_download(backend, dst.ptr, n, stream), 2 * x + 1)

    run_in_threads(work, 8)
    assert all(results)
    assert len({id(q) for q in queues}) == 8


# -- graphs ------------------------------------------------------------------------------------------

def _kernel(builder: GraphBuilder, backend, name: str, defines: str = ""):
    ref = backend.reference_kernels()[name]
    return builder.kernel(name, device="opencl", entries=list(ref.entries), source=defines + ref.source,
                          language=ref.language, launch=ref.launch)


def test_a_graph_of_reference_kernels_runs_on_opencl(tmp_path, registry, backend) -> None:
    b = GraphBuilder("opencl_chain", registry=registry)
    x = b.input("x", "float32", ["n"], device="opencl")
    y = b.input("y", "float32", ["n"], device="opencl")
    (z,) = b.call(_kernel(b, backend, "add"), [x, y], [("float32", ["n"])], symbols=["n"])
    (w,) = b.call(_kernel(b, backend, "scale_ws"), [z], [("float32", ["n"])], symbols=["n"], workspace="n * 4")
    (v,) = b.call(_kernel(b, backend, "add"), [w, x], [("float32", ["n"])], symbols=["n"])
    b.output(v, "v")
    b.save(tmp_path / "chain.cgb")
    graph = engine.load_compiled_graph(tmp_path / "chain.cgb", registry=registry)
    rng = np.random.default_rng(5)
    for n in (1, 63, 64, 1000, 4099):
        xs, ys = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        (out,) = graph.run_async([engine.asarray(xs, device="opencl", registry=registry),
                                  engine.asarray(ys, device="opencl", registry=registry)])
        assert out.device == "opencl:0"
        np.testing.assert_allclose(out.numpy(), 2 * (xs + ys) + 1 + xs, rtol=1e-6, atol=1e-6)


def test_the_mlp_runs_on_opencl(tmp_path, registry, backend) -> None:
    from engine.demo.mlp import mlp_weights, reference_mlp

    weights = mlp_weights()
    d_in, hidden, classes = 64, 128, 10
    b = GraphBuilder("mlp_opencl", registry=registry)
    x = b.input("x", "float32", ["batch", d_in], device="opencl")
    w1, b1, w2, b2 = (b.weight(k, weights[k], device="opencl") for k in ("w1", "b1", "w2", "b2"))
    mm1 = _kernel(b, backend, "mlp_matmul", f"#define K {d_in}\n#define N {hidden}\n")
    mm2 = _kernel(b, backend, "mlp_matmul", f"#define K {hidden}\n#define N {classes}\n")
    (h,) = b.call(mm1, [x, w1], [("float32", ["batch", hidden])], symbols=["batch"])
    (h,) = b.call(_kernel(b, backend, "mlp_bias_relu", f"#define N {hidden}\n"), [h, b1],
                  [("float32", ["batch", hidden])], symbols=["batch"], share_map={0: 0})
    (z,) = b.call(mm2, [h, w2], [("float32", ["batch", classes])], symbols=["batch"])
    (z,) = b.call(_kernel(b, backend, "mlp_bias_add", f"#define N {classes}\n"), [z, b2],
                  [("float32", ["batch", classes])], symbols=["batch"], share_map={0: 0})
    (p,) = b.call(_kernel(b, backend, "mlp_softmax", f"#define N {classes}\n"), [z],
                  [("float32", ["batch", classes])], symbols=["batch"], workspace="batch * 4")
    b.output(p, "probs")
    b.save(tmp_path / "mlp.cgb")
    graph = engine.load_compiled_graph(tmp_path / "mlp.cgb", registry=registry)
    rng = np.random.default_rng(6)
    for batch in (1, 7, 64):
        xs = rng.standard_normal((batch, d_in)).astype(np.float32)
        (out,) = graph.run_async([engine.asarray(xs, device="opencl", registry=registry)])
        np.testing.assert_allclose(out.numpy(), reference_mlp(xs, weights), rtol=1e-4, atol=1e-5)


def test_host_addresses_are_wrapped_not_copied(backend) -> None:
    """copy_to_host writes straight into the host memory at the given address (ctypes, no staging)."""
    stream = backend.current_stream(0)
    src = _upload(backend, np.arange(16, dtype=np.uint8), stream)
    raw = (ctypes.c_uint8 * 16)()
    backend.copy_to_host(ctypes.addressof(raw) + 5, src.ptr + 2, 6, stream)
    backend.synchronize(0, stream)
    assert list(raw) == [0] * 5 + [2, 3, 4, 5, 6, 7] + [0] * 5


def test_tensors_round_trip_through_dlpack_as_cl_mem_handles(registry) -> None:
    x = np.arange(6, dtype=np.float32)
    tensor = engine.asarray(x, device="opencl", registry=registry)
    assert tensor.__dlpack_device__() == (4, 0)  # kDLOpenCL
    back = engine.from_dlpack(tensor, registry=registry)
    assert back.device == "opencl:0" and back.storage.ptr.buffer.int_ptr == tensor.storage.ptr.buffer.int_ptr
    np.testing.assert_array_equal(back.numpy(registry=registry), x)


def test_a_one_kernel_graph_with_no_workspace_runs_on_opencl(registry) -> None:
    """Inputs and outputs only: nothing tells the core the kind's pointer type before the first run."""
    add = registry.backend("opencl").reference_kernels()["add"]
    b = GraphBuilder("one_kernel", registry=registry)
    x = b.input("x", "float32", ["n"], device="opencl")
    y = b.input("y", "float32", ["n"], device="opencl")
    k = b.kernel("add", device="opencl", entries=list(add.entries), source=add.source, language=add.language,
                 launch=add.launch)
    (z,) = b.call(k, [x, y], [("float32", ["n"])], symbols=["n"])
    b.output(z)
    graph = b.build()
    xs, ys = np.arange(100, dtype=np.float32), np.ones(100, np.float32)
    xd, yd = (engine.asarray(a, device="opencl", registry=registry) for a in (xs, ys))
    for _ in range(3):  # slow path, prepared, fast path with the same input pointers
        (z,) = graph.run_async([xd, yd])
        np.testing.assert_array_equal(z.numpy(), xs + 1)
    yd2 = engine.asarray(np.full(100, 2, np.float32), device="opencl", registry=registry)
    (z,) = graph.run_async([xd, yd2])  # a new input pointer is bound
    np.testing.assert_array_equal(z.numpy(), xs + 2)
