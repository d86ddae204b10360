"""The CUDA plugin on a machine without a GPU, and the shared GPU layer it is built on.

What runs for real here: plugin discovery (``engine devices`` in a subprocess), the availability
probe against the real ``cuda.bindings`` with no driver library, building a CUDA bundle with NVRTC
and loading it (which must fail naming the cause), the kernel argument block's bytes as a driver
reads them, the binary-selection rules, and the PTX ISA of real NVRTC output. Tests that use
``gpu_fakes.FakeDriver`` say so in their docstring: they check *control flow only* and are no
evidence that the plugin works on a GPU (that is ``tests/gpu`` and ``scripts/gpu-check``).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from engine.backend import BinaryPayload, BinaryRefused, CandidateSpec, LaunchDims
from engine.backend.gpu import ArgumentBlock, DriverError, GpuBackend, argument_layout, pack_arguments, stream_handle
from engine.errors import DeviceUnavailableError, KernelError, Unsupported
from gpu_abi import expected_parameters, read_kernel_params
from gpu_fakes import FakeDriver

engine_cuda = pytest.importorskip("engine_cuda", reason="engine-cuda is not installed (pip install -e plugins/cuda)")
from engine_cuda.backend import CudaBackend  # noqa: E402
from engine_cuda.kernels import cubin_refusal, ptx_driver_needed, ptx_isa, ptx_refusal  # noqa: E402


def _libcuda_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


no_driver = pytest.mark.skipif(_libcuda_present(), reason="a CUDA driver library is installed here: these tests "
                                                          "check the no-driver behaviour")

SCALE_WS = r"""
#include <stdint.h>
extern "C" __global__ void scale_ws(const float *x, float *y, int64_t n, float *ws) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) { ws[i] = 2.0f * x[i]; y[i] = ws[i] + 1.0f; }
}
"""
LAUNCH = {"grid": ["max(ceil_div(n, 128), 1)", 1, 1], "block": [128, 1, 1]}


def _nvrtc_problem() -> str | None:
    from engine_cuda.compiler import nvrtc_unavailable

    return nvrtc_unavailable()


def _spec(binaries, *, entry="scale_ws", inputs=1, outputs=1, symbols=("n",), workspace=True) -> CandidateSpec:
    return CandidateSpec("scale", 0, entry, tuple(binaries), None, inputs, outputs, tuple(symbols), workspace)


def _fake_backend(tmp_path, **driver_args) -> tuple[CudaBackend, FakeDriver]:
    driver = FakeDriver(**driver_args)
    return CudaBackend(tmp_path, driver=driver, env={}), driver


# -- real: discovery, the probe without a driver, a CUDA bundle -----------------------------------

@no_driver
def test_engine_devices_lists_cuda_unavailable_with_the_cause(tmp_path):
    env = dict(os.environ, ENGINE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "engine", "devices", "--json"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {row["kind"]: row for row in json.loads(out.stdout)["devices"]}
    cuda = rows["cuda"]
    assert cuda["available"] is False
    assert cuda["workspace_slot"] == 1
    assert cuda["distribution"] == "engine-cuda"
    assert "no CUDA driver library: libcuda.so.1 cannot be loaded" in cuda["reason"]
    assert "install the NVIDIA driver" in cuda["reason"]


def test_importing_and_registering_the_plugin_touches_no_driver(tmp_path):
    # cuda-bindings installs a .pth that imports the empty ``cuda`` namespace at start-up; its
    # submodules (the driver and NVRTC bindings) must stay unloaded.
    code = (
        "import sys\n"
        "from engine.plugins import Registry\n"
        "from engine.settings import Settings\n"
        f"r = Registry(Settings.from_env())\n"
        "assert 'cuda' in r.kinds(), r.failures()\n"
        "b = r.backend('cuda')\n"
        "assert (b.kind, b.workspace_slot, b.dlpack_device_type, b.host_accessible) == ('cuda', 1, 2, False)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('cuda.'))\n"
        "print(loaded)\n"
    )
    env = dict(os.environ, ENGINE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@no_driver
def test_the_real_probe_names_the_missing_driver_library(tmp_path):
    backend = CudaBackend(tmp_path)
    avail = backend.availability()
    assert not avail.available and avail.device_count == 0
    assert avail.reason.startswith("no CUDA driver library: libcuda.so.1 cannot be loaded")
    with pytest.raises(DeviceUnavailableError, match="cuda:0 is not usable: no CUDA driver library"):
        backend.current_stream(0)
    assert "cuda:0 is not usable: no CUDA driver library" in backend.loadable("cubin", "sm_90")


@no_driver
def test_loading_a_cuda_bundle_raises_device_unavailable_naming_the_cause(tmp_path):
    problem = _nvrtc_problem()
    if problem:
        pytest.skip(f"NVRTC is needed to build the CUDA bundle: {problem}")
    import engine
    from engine.build import GraphBuilder

    b = GraphBuilder("cuda_scale")
    x = b.input("x", "float32", ["n"], device="cuda")
    k = b.kernel("scale", device="cuda", entries=["scale_ws"], source=SCALE_WS, language="cuda", launch=LAUNCH,
                 options={"archs": ["sm_80"], "ptx": "compute_80"})
    (y,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"], workspace="n * 4")
    b.output(y, "y")
    path = tmp_path / "scale.cgb"
    b.save(path)
    with pytest.raises(DeviceUnavailableError) as info:
        engine.load_compiled_graph(path)
    assert "device kind 'cuda' is not usable here: no CUDA driver library: libcuda.so.1 cannot be loaded" \
        in str(info.value)


def test_nvrtc_ptx_needs_a_driver_of_the_nvrtc_version(tmp_path):
    """Real NVRTC output: its PTX ISA maps back to the NVRTC's own CUDA version, the driver floor
    the loader checks before handing PTX to the driver."""
    problem = _nvrtc_problem()
    if problem:
        pytest.skip(problem)
    from engine_cuda.compiler import CudaCompiler

    compiler = CudaCompiler(tmp_path)
    ptx = compiler.ptx(SCALE_WS, "compute_80")
    isa = ptx_isa(ptx)
    assert isa is not None
    major, minor = compiler.version()
    assert ptx_driver_needed(isa) == 1000 * major + 10 * minor


# -- real: the argument block against the ABI, driver-neutral ---------------------------------------

@pytest.mark.parametrize("has_workspace", [True, False])
def test_argument_block_matches_the_documented_abi_byte_for_byte(has_workspace):
    tensors = [0x7F00_0000_1000, 0x7F00_0000_2000, 0x7F00_0000_3100]  # 2 inputs, 1 output
    symbols = [3, 2**40 + 5, -1]
    workspace = 0x7F00_0001_0000 if has_workspace else None
    block = ArgumentBlock.filled(tensors, symbols, workspace, has_workspace)
    expected = expected_parameters(tensors, symbols, workspace, has_workspace)
    assert len(block) == len(expected) == 6 + int(has_workspace)
    assert read_kernel_params(block.address, [8] * len(expected)) == expected
    assert block.tobytes() == b"".join(expected) == pack_arguments(tensors, symbols, workspace, has_workspace)
    assert [off for _, off, _ in argument_layout(3, 3, has_workspace)] == [8 * i for i in range(len(expected))]

    address = block.address
    block.set_tensor(0, 0x7F00_0000_9000)  # the core patches graph inputs/outputs in place
    assert block.address == address
    assert read_kernel_params(block.address, [8] * len(expected))[0] == (0x7F00_0000_9000).to_bytes(8, "little")
    assert read_kernel_params(block.address, [8] * len(expected))[1:] == expected[1:]


def test_argument_block_null_workspace_and_no_parameters():
    block = ArgumentBlock.filled([0x1000], [], None, True)
    assert read_kernel_params(block.address, [8, 8]) == [(0x1000).to_bytes(8, "little"), bytes(8)]
    empty = ArgumentBlock(0, 0, False)
    assert empty.address == 0 and empty.tobytes() == b""
    with pytest.raises(ValueError, match="holds 1 tensors and 0 symbols, got 2 and 0"):
        ArgumentBlock(1, 0, False).fill([1, 2], [], None)


# -- real: binary selection rules ---------------------------------------------------------------------

@pytest.mark.parametrize(("target", "arch", "reason"), [
    ("sm_90", (9, 0), None),
    ("sm_80", (8, 6), None),
    ("sm_80", (9, 0), "cubin for sm_80, device is sm_90"),
    ("sm_86", (8, 0), "cubin for sm_86, device is sm_80"),
    ("sm_90a", (9, 0), None),
    ("sm_90a", (10, 0), "cubin for sm_90a runs only on sm_90, device is sm_100"),
    ("compute_80", (8, 0), "cubin target 'compute_80' is not of the form sm_<NN>"),
])
def test_cubin_selection(target, arch, reason):
    assert cubin_refusal(target, arch) == reason


@pytest.mark.parametrize(("target", "arch", "reason"), [
    ("compute_80", (9, 0), None),
    ("compute_90", (8, 9), "PTX for compute_90 needs at least sm_90, device is sm_89"),
    ("compute_90a", (12, 0), "PTX for compute_90a runs only on sm_90, device is sm_120"),
    ("sm_80", (9, 0), "ptx target 'sm_80' is not of the form compute_<NN>"),
])
def test_ptx_selection(target, arch, reason):
    assert ptx_refusal(target, arch) == reason


@pytest.mark.parametrize(("isa", "driver"), [((7, 8), 11080), ((8, 0), 12000), ((8, 5), 12050), ((8, 7), 12080),
                                             ((8, 8), 12090), ((9, 0), 13000)])
def test_ptx_isa_to_driver_version(isa, driver):
    text = f"//\n// Generated by NVIDIA NVVM Compiler\n.version {isa[0]}.{isa[1]}\n.target sm_80\n".encode()
    assert ptx_isa(text) == isa
    assert ptx_driver_needed(isa) == driver


def test_stream_handles_from_framework_objects():
    class TorchLike:
        cuda_stream = 0x1234

    class CupyLike:
        ptr = 0x5678

    class CoreLike:
        def __cuda_stream__(self):
            return (0, 0x9ABC)

    assert [stream_handle(s) for s in (7, TorchLike(), CupyLike(), CoreLike())] == [7, 0x1234, 0x5678, 0x9ABC]
    with pytest.raises(TypeError, match="expected a stream"):
        stream_handle("default")


# -- control flow only (fake driver) ------------------------------------------------------------------

@pytest.mark.parametrize(("driver_args", "env", "reason"), [
    ({"missing": "no CUDA driver library: libcuda.so.1 cannot be loaded (test)"}, {},
     "no CUDA driver library: libcuda.so.1 cannot be loaded (test); install the NVIDIA driver"),
    ({"version": 11080}, {}, "the CUDA driver is 11.8; this plugin needs 12.0 or newer: upgrade the NVIDIA driver"),
    ({"devices": ()}, {"CUDA_VISIBLE_DEVICES": ""},
     "no cuda device: CUDA_VISIBLE_DEVICES is set and empty, which hides every device from this process"),
    ({"devices": ()}, {"CUDA_VISIBLE_DEVICES": "7"},
     "no cuda device: no device is visible (CUDA_VISIBLE_DEVICES='7' names no usable device)"),
    ({"devices": ()}, {}, "no cuda device: the CUDA driver reports no device"),
    ({"context_error": "CUDA_ERROR_OUT_OF_MEMORY"}, {},
     "cuda:0: cannot create a context: cuDevicePrimaryCtxRetain failed: CUDA_ERROR_OUT_OF_MEMORY (999)"),
    ({"init_error": "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"}, {},
     "the CUDA driver failed to initialise: cuInit failed: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH (999)"),
])
def test_availability_reasons(tmp_path, driver_args, env, reason):
    """Control flow only (fake driver): each way the probe fails gives its own reason."""
    backend = CudaBackend(tmp_path, driver=FakeDriver(**driver_args), env=env)
    avail = backend.availability()
    assert not avail.available
    assert avail.reason.startswith(reason), avail.reason
    with pytest.raises(DeviceUnavailableError, match="cuda:0 is not usable"):
        backend.allocate(16, 0)


def test_availability_when_it_works(tmp_path):
    """Control flow only (fake driver): count, names and the driver version when usable."""
    backend, _ = _fake_backend(tmp_path, devices=(("GPU A", (8, 0)), ("GPU B", (9, 0))), version=12040)
    avail = backend.availability()
    assert (avail.available, avail.device_count, avail.device_names, avail.driver) == \
        (True, 2, ("GPU A", "GPU B"), "CUDA driver 12.4")


def test_binary_selection_lists_every_refusal(tmp_path):
    """Control flow only (fake driver): the KernelError lists each binary with its reason."""
    backend, _ = _fake_backend(tmp_path, devices=(("Fake H100", (9, 0)),), version=12040,
                               param_counts={"scale_ws": 3})
    ptx88 = b".version 8.8\n.target sm_80\n"
    spec = _spec([BinaryPayload("cubin", "sm_80", "scale.sm_80.cubin", b"\x7fELF"),
                  BinaryPayload("ptx", "compute_100", "scale.compute_100.ptx", ptx88),
                  BinaryPayload("ptx", "compute_80", "scale.compute_80.ptx", ptx88),
                  BinaryPayload("elf-so", "x86_64-linux", "scale.so", b"")])
    with pytest.raises(KernelError) as info:
        backend.load_kernel(spec, 0)
    message = str(info.value)
    assert message.startswith("kernel 'scale' candidate 0 (entry 'scale_ws'): no loadable binary for cuda:0: ")
    assert "scale.sm_80.cubin (cubin, sm_80): cubin for sm_80, device is sm_90" in message
    assert "scale.compute_100.ptx (ptx, compute_100): PTX for compute_100 needs at least sm_100, device is sm_90" \
        in message
    assert ("scale.compute_80.ptx (ptx, compute_80): PTX ISA 8.8 needs a CUDA 12.9 driver or newer, "
            "this driver is 12.4") in message
    assert "scale.so (elf-so, x86_64-linux): format 'elf-so' is not one of cuda's formats" in message
    assert message.endswith("(format 'cuda-source')")


def test_binary_selection_moves_past_a_module_the_driver_refuses(tmp_path):
    """Control flow only (fake driver): a driver refusal is a BinaryRefused naming the status."""
    backend, driver = _fake_backend(tmp_path, module_error="CUDA_ERROR_NO_BINARY_FOR_GPU",
                                    param_counts={"scale_ws": 3})
    spec = _spec([BinaryPayload("cubin", "sm_90", "scale.sm_90.cubin", b"\x7fELF")])
    with pytest.raises(KernelError, match=r"scale.sm_90.cubin \(cubin, sm_90\): it holds no code for this GPU "
                                          r"\(cuModuleLoadData failed: CUDA_ERROR_NO_BINARY_FOR_GPU"):
        backend.load_kernel(spec, 0)
    driver.module_error = None
    missing = _spec([BinaryPayload("cubin", "sm_90", "scale.sm_90.cubin", b"\x7fELF")], entry="other")
    with pytest.raises(KernelError, match="the module has no kernel 'other' \\(CUDA_ERROR_NOT_FOUND\\)"):
        backend.load_kernel(missing, 0)


def test_prepared_launch_hands_the_driver_the_abi_block(tmp_path):
    """Control flow only (fake driver): the prepared launch passes the ABI block, dims and stream;
    set_tensor patches are seen by the next launch; PTX gets its NUL terminator."""
    backend, driver = _fake_backend(tmp_path, param_counts={"scale_ws": 4})
    ptx = b".version 8.0\n.target sm_80\n"
    spec = _spec([BinaryPayload("ptx", "compute_80", "s.ptx", ptx)])
    kernel = backend.load_kernel(spec, 0)
    assert list(driver.modules.values()) == [ptx + b"\0"]
    stream = backend.current_stream(0)
    launch = kernel.prepare([0, 0], [1000], 0xABC00, stream, LaunchDims((8, 1, 1), (128, 1, 1), 64))
    launch.set_tensor(0, 0x1000)
    launch.set_tensor(1, 0x2000)
    assert launch.call() == 0
    launch.set_tensor(1, 0x3000)
    assert launch.call() == 0
    first, second = driver.launches
    assert first["dims"] == (8, 1, 1, 128, 1, 1, 64) and first["stream"] == stream
    assert first["params"] == expected_parameters([0x1000, 0x2000], [1000], 0xABC00, True)
    assert second["params"] == expected_parameters([0x1000, 0x3000], [1000], 0xABC00, True)


def test_launch_failures_name_kernel_candidate_and_status(tmp_path):
    """Control flow only (fake driver): a launch status and (in debug mode) a fault at the check
    after the launch become KernelErrors naming kernel, candidate, device and status."""
    backend, driver = _fake_backend(tmp_path, param_counts={"scale_ws": 3}, launch_status=1)
    kernel = backend.load_kernel(_spec([BinaryPayload("cubin", "sm_90", "s.cubin", b"\x7fELF")]), 0)
    dims = LaunchDims((1, 1, 1), (32, 1, 1), 0)
    with pytest.raises(KernelError, match=r"^kernel 'scale' candidate 0 \(entry 'scale_ws'\) on cuda:0: launch "
                                          r"failed: CUDA_ERROR_INVALID_VALUE \(1\) \(grid=\[1, 1, 1\]"):
        kernel.launch([0x10, 0x20], [4], 0x30, backend.current_stream(0), dims)

    debug = CudaBackend(tmp_path, driver=FakeDriver(param_counts={"scale_ws": 3}, sync_status=700), env={},
                        debug=True)
    kernel = debug.load_kernel(_spec([BinaryPayload("cubin", "sm_90", "s.cubin", b"\x7fELF")]), 0)
    with pytest.raises(KernelError, match="launch failed: CUDA_ERROR_ILLEGAL_ADDRESS \\(700\\)"):
        kernel.launch([0x10, 0x20], [4], 0x30, debug.current_stream(0), dims)


def test_empty_grid_is_not_launched(tmp_path):
    """Control flow only (fake driver): a zero batch gives a zero grid, which is not sent to the driver."""
    backend, driver = _fake_backend(tmp_path, param_counts={"scale_ws": 3})
    kernel = backend.load_kernel(_spec([BinaryPayload("cubin", "sm_90", "s.cubin", b"\x7fELF")]), 0)
    launch = kernel.prepare([0x10, 0x20], [0], 0x30, backend.current_stream(0), LaunchDims((0, 1, 1), (128, 1, 1)))
    assert launch.call() == 0 and driver.launches == []


def test_streams_per_thread_and_the_callers_stream(tmp_path):
    """Control flow only (fake driver): each thread gets its own stream, the same one every time;
    use_stream and a stream source (a framework's current stream) take precedence."""
    framework = {"stream": None}
    driver = FakeDriver()
    backend = CudaBackend(tmp_path, driver=driver, env={}, stream_sources=[lambda index: framework["stream"]])
    main = backend.current_stream(0)
    assert backend.current_stream(0) == main
    seen = []
    thread = threading.Thread(target=lambda: seen.append(backend.current_stream(0)))
    thread.start()
    thread.join()
    assert seen[0] != main
    with backend.use_stream(0x7777):
        assert backend.current_stream(0) == 0x7777
    framework["stream"] = 0x8888
    assert backend.current_stream(0) == 0x8888
    framework["stream"] = None
    assert backend.current_stream(0) == main


def test_memory_is_pooled_and_stream_ordered(tmp_path):
    """Control flow only (fake driver): allocations come from the pool on the given stream and
    are freed on the stream that last used them; copies and memset go on the stream."""
    backend, driver = _fake_backend(tmp_path)
    stream = backend.current_stream(0)
    make = backend.prepare_allocation(4096, 0, stream)
    storage = make()
    assert ("alloc_async", 4096, stream) in driver.calls and storage.stream == stream
    assert sum(1 for c in driver.calls if c[0] == "pool_prepare") == 1
    storage.stream = 0x4242
    storage.close()
    assert driver.freed == [(storage.ptr, 0x4242)]
    zero = backend.allocate(0, 0, stream)
    assert ("alloc_async", 1, stream) in driver.calls and zero.nbytes == 0
    backend.memset(0x100, 0x1FF, 64, stream)
    assert driver.calls[-1] == ("memset8", 0x100, 0xFF, 64, stream)


def test_capture_records_a_graph_and_replays_on_the_callers_stream(tmp_path):
    """Control flow only (fake driver): capture begins and ends on the stream around the run,
    instantiates once, replays on the given stream; the legacy stream 0 is refused."""
    backend, driver = _fake_backend(tmp_path, param_counts={"scale_ws": 3})
    kernel = backend.load_kernel(_spec([BinaryPayload("cubin", "sm_90", "s.cubin", b"\x7fELF")]), 0)
    stream = backend.current_stream(0)
    launch = kernel.prepare([0x10, 0x20], [4], 0x30, stream, LaunchDims((1, 1, 1), (32, 1, 1)))

    def run():
        assert launch.call() == 0

    replay = backend.capture(run, stream=stream, device_index=0)
    assert driver.launches[-1]["captured"] is True
    names = [c[0] for c in driver.calls]
    assert names[-4:] == ["capture_begin", "capture_end", "graph_instantiate", "graph_destroy"]
    replay.replay()
    replay.replay(0x5150)
    assert [c[2] for c in driver.calls if c[0] == "graph_launch"] == [stream, 0x5150]
    replay.close()
    assert driver.calls[-1][0] == "graph_exec_destroy"
    with pytest.raises(Unsupported, match="the default stream \\(0x0\\) cannot be captured"):
        backend.capture(run, stream=0, device_index=0)


def test_dlpack_export_orders_the_consumers_stream_without_a_host_wait(tmp_path):
    """Control flow only (fake driver): ``__dlpack__(stream=s)`` makes stream ``s`` wait for an
    event recorded on the tensor's stream; ``stream=None`` means CUDA's legacy default stream (1);
    ``stream=-1`` orders nothing. No host synchronisation in any case."""
    import engine
    from engine.plugins import Registry
    from engine.settings import Settings

    driver = FakeDriver()
    registry = Registry(Settings.from_env(), autoload=False)
    registry.register_backend(CudaBackend(tmp_path, driver=driver, env={}))
    t = engine.asarray(np.arange(4, dtype=np.float32), device="cuda:0", registry=registry)
    for stream, waited in ((0x77, 0x77), (None, 1)):
        del driver.calls[:]
        t.__dlpack__(stream=stream, max_version=(1, 0))
        waits = [c for c in driver.calls if c[0] == "stream_wait_event"]
        assert [c[1] for c in waits] == [waited]
        assert not [c for c in driver.calls if c[0] in ("event_synchronize", "stream_synchronize",
                                                        "device_synchronize")]
    del driver.calls[:]
    t.__dlpack__(stream=-1, max_version=(1, 0))
    assert not [c for c in driver.calls if c[0] in ("stream_wait_event", "event_synchronize")]


def test_events_time_on_the_stream(tmp_path):
    """Control flow only (fake driver): Backend.time records two events on the stream per sample."""
    backend, driver = _fake_backend(tmp_path)
    stream = backend.current_stream(0)
    samples = backend.time(lambda: None, stream=stream, warmup=0, repeat=3)
    assert samples == [0.5, 0.5, 0.5]
    assert sum(1 for c in driver.calls if c[0] == "event_record" and c[2] == stream) == 6


def test_gpu_backend_is_the_vendor_neutral_base():
    assert issubclass(CudaBackend, GpuBackend)
    assert (GpuBackend.has_streams, GpuBackend.host_accessible) == (True, False)
    with pytest.raises(DriverError, match="^cuX failed: CUDA_ERROR_X \\(5\\)$"):
        raise DriverError("cuX", 5, "CUDA_ERROR_X")


def test_the_core_runs_and_captures_through_the_plugin(tmp_path):
    """Control flow only (fake driver): a CUDA bundle loads through the core's real load path
    (binary selection, weights upload, lanes), runs with fresh pooled outputs whose pointers reach
    the kernel's argument block, and is captured as a CUDA graph replayed on the caller's stream."""
    import engine
    from engine.build import GraphBuilder
    from engine.plugins import Registry
    from engine.settings import Settings

    b = GraphBuilder("cuda_flow")
    x = b.input("x", "float32", ["n"], device="cuda")
    bias = b.weight("b", np.ones(4, np.float32), device="cuda")
    ptx = b".version 8.0\n.target sm_80\n.address_size 64\n"
    k = b.kernel("scale", device="cuda", entries=["scale_ws"], launch=LAUNCH,
                 binaries=[{"format": "ptx", "target": "compute_80", "path": "scale.ptx", "data": ptx}])
    (y,) = b.call(k, [x, bias], [("float32", ["n"])], symbols=["n"], workspace="n * 4")
    b.output(y, "y")
    path = tmp_path / "flow.cgb"
    b.save(path)

    driver = FakeDriver(param_counts={"scale_ws": 5})
    registry = Registry(Settings.from_env(), autoload=False)
    registry.register_backend(CudaBackend(tmp_path, driver=driver, env={}))
    graph = engine.load_compiled_graph(path, registry=registry)
    assert ("copy_htod",) == tuple(c[0] for c in driver.calls if c[0] == "copy_htod")  # the weight, once
    xs = engine.asarray(np.arange(3, dtype=np.float32), device="cuda:0", registry=registry)
    (out,) = graph.run_async([xs])
    launch = driver.launches[-1]
    assert launch["dims"] == (1, 1, 1, 128, 1, 1, 0)
    params = launch["params"]
    assert params[0] == xs.ptr.to_bytes(8, "little") and params[2] == out.ptr.to_bytes(8, "little")
    assert params[3] == (3).to_bytes(8, "little")

    stream = 0x5150
    with registry.backend("cuda").use_stream(stream):
        captured = graph.cuda_graph(xs)
        assert captured.method == "cuda capture"
        captured.replay()
    assert [c for c in driver.calls if c[0] == "capture_begin"] == [("capture_begin", stream)]
    assert [c[2] for c in driver.calls if c[0] == "graph_launch"] == [stream, stream]  # once when captured (outputs filled), once replayed
    captured.close()


# -- control flow only: the real adapter and cuda-bindings over a host-memory libcuda stand-in ----------

STUB_SOURCE = Path(__file__).resolve().parents[3] / "tests" / "gpu_stub" / "libcuda_stub.c"

STUB_SCRIPT = r'''
import ctypes, json, sys, threading
import numpy as np
import engine
from engine.build import GraphBuilder
from engine.plugins import Registry
from engine.settings import Settings

def bundle(path, entry, data=b".version 8.0\n.target sm_80\n.address_size 64\n"):
    b = GraphBuilder("stub_" + entry)
    x = b.input("x", "float32", ["n"], device="cuda")
    k = b.kernel("k_" + entry, device="cuda", entries=[entry],
                 launch={"grid": ["max(ceil_div(n, 128), 1)", 1, 1], "block": [128, 1, 1]},
                 binaries=[{"format": "ptx", "target": "compute_80", "path": "k.ptx", "data": data}])
    (y,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"], workspace="n * 4")
    b.output(y, "y")
    b.save(path)
    return path

registry = Registry(Settings.from_env())
cuda = registry.backend("cuda")
report = {"availability": [cuda.availability().available, cuda.availability().reason,
                           list(cuda.availability().device_names), cuda.availability().driver]}
SCENARIO
print(json.dumps(report))
'''

SCENARIOS = {
    "run": r'''
graph = engine.load_compiled_graph(bundle(sys.argv[1] + "/scale.cgb", "scale_ws"), registry=registry)
for n in (1, 3, 64):
    xs = np.arange(n, dtype=np.float32)
    (out,) = graph.run_async([engine.asarray(xs, device="cuda:0", registry=registry)])
    assert np.array_equal(out.numpy(), 2 * xs + 1), (n, out.numpy())
xs = engine.asarray(np.arange(5, dtype=np.float32), device="cuda:0", registry=registry)
captured = graph.cuda_graph(xs)
report["method"] = captured.method
other = cuda.driver.stream_create()
captured.replay(stream=other)
lib = ctypes.CDLL("libcuda.so.1")
report["replay_stream"] = ctypes.c_void_p.in_dll(lib, "stub_last_stream").value == other
report["replayed"] = captured.outputs[0].numpy().tolist()
report["graph_launches"] = ctypes.c_longlong.in_dll(lib, "stub_graph_launches").value
report["release_threshold"] = ctypes.c_ulonglong.in_dll(lib, "stub_release_threshold").value
results = {}
barrier = threading.Barrier(8)
def work(i):
    xs = np.full(100 + i, float(i), np.float32)
    (out,) = graph.run_async([engine.asarray(xs, device="cuda:0", registry=registry)])
    results[i] = (bool(np.array_equal(out.numpy(), 2 * xs + 1)), cuda.current_stream(0))
    barrier.wait()  # all alive at once: a thread's stream is reused only after the thread ends
threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
report["threads_ok"] = all(ok for ok, _ in results.values())
report["thread_streams"] = len({s for _, s in results.values()})
samples = cuda.time(lambda: graph.run_async([xs]), repeat=3)
report["timing"] = [s >= 0 for s in samples]
buf = cuda.allocate(16, 0)
cuda.memset(buf.ptr, 7, 16)
event = cuda.create_event(0)
event.record()
event.wait(other)
report["event"] = event.query()
host = np.zeros(16, np.uint8)
cuda.copy_to_host(host.ctypes.data, buf.ptr, 16)
cuda.synchronize(0)
report["memset"] = host.tolist()
buf.close()
try:
    cuda.allocate(2**41, 0)
except engine.OutOfMemoryError as exc:
    report["oom"] = str(exc)
''',
    "fault": r'''
graph = engine.load_compiled_graph(bundle(sys.argv[1] + "/fault.cgb", "fault"), registry=registry)
xs = engine.asarray(np.ones(4, np.float32), device="cuda:0", registry=registry)
try:
    (out,) = graph.run_async([xs])
    out.numpy()
except engine.KernelError as exc:
    report["error"] = [type(exc).__name__, str(exc)]
''',
    "bad_image": r'''
try:
    engine.load_compiled_graph(bundle(sys.argv[1] + "/bad.cgb", "scale_ws", b"BADIMAGE .version 8.0"), registry=registry)
except engine.KernelError as exc:
    report["error"] = str(exc)
''',
    "probe": "",
}


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory):
    import shutil

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the libcuda stand-in")
    out = tmp_path_factory.mktemp("libcuda-stub")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out / "libcuda.so.1"), str(STUB_SOURCE), "-ldl"], check=True)
    return out


def _run_stub(stub_dir, tmp_path, scenario, **env):
    script = STUB_SCRIPT.replace("SCENARIO", SCENARIOS[scenario])
    full = dict(os.environ, LD_LIBRARY_PATH=str(stub_dir), ENGINE_CACHE_DIR=str(tmp_path / "cache"),
                ENGINE_DEVICES="cuda,cpu", **env)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=full,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_stub_driver_runs_captures_and_threads(stub_dir, tmp_path):
    """Control flow only (host-memory libcuda stand-in, real cuda-bindings and adapter): graphs run
    at batch 1/3/64 with the right numbers, capture replays on another stream, 8 threads get their
    own streams, the pool keeps freed memory, events time."""
    report = _run_stub(stub_dir, tmp_path, "run")
    assert report["availability"] == [True, None, ["Stub GPU 0"], "CUDA driver 12.8"]
    assert report["method"] == "cuda capture"
    assert report["replay_stream"] is True and report["graph_launches"] == 2  # at capture (outputs filled) and the replay
    assert report["replayed"] == [1.0, 3.0, 5.0, 7.0, 9.0]
    assert report["release_threshold"] == 2**64 - 1
    assert report["threads_ok"] is True and report["thread_streams"] == 8
    assert report["timing"] == [True, True, True]
    assert report["event"] is True and report["memset"] == [7] * 16
    assert report["oom"] == ("cuda:0: cannot allocate 2199023255552 bytes (2.0 TiB): cuMemAllocFromPoolAsync: "
                            "CUDA_ERROR_OUT_OF_MEMORY")


def test_stub_driver_fault_is_a_kernel_error(stub_dir, tmp_path):
    """Control flow only (stand-in driver): a fault surfaces at the next wait as a KernelError
    (DeviceFault) naming the status; in debug mode the launch of the faulting kernel reports it."""
    report = _run_stub(stub_dir, tmp_path, "fault")
    kind, message = report["error"]
    assert kind == "DeviceFault" and "CUDA_ERROR_ILLEGAL_ADDRESS (700): a kernel queued earlier faulted" in message
    assert "set ENGINE_CUDA_SYNC=1" in message
    debug = _run_stub(stub_dir, tmp_path, "fault", ENGINE_CUDA_SYNC="1")
    kind, message = debug["error"]
    assert kind == "KernelError"
    assert message.startswith("kernel 'k_fault' candidate 0 (entry 'fault') on cuda:0: launch failed: "
                              "CUDA_ERROR_ILLEGAL_ADDRESS (700)")


def test_stub_driver_refused_module_is_listed(stub_dir, tmp_path):
    """Control flow only (stand-in driver): a driver refusal of a module names the CUresult."""
    report = _run_stub(stub_dir, tmp_path, "bad_image")
    assert ("k.ptx (ptx, compute_80): the driver's PTX compiler rejected it (cuModuleLoadData failed: "
            "CUDA_ERROR_INVALID_PTX (218))") in report["error"]


@pytest.mark.parametrize(("env", "reason"), [
    ({"STUB_CUDA_VERSION": "11080"}, "the CUDA driver is 11.8; this plugin needs 12.0 or newer"),
    ({"STUB_CUDA_INIT": "100", "CUDA_VISIBLE_DEVICES": ""},
     "no cuda device: CUDA_VISIBLE_DEVICES is set and empty, which hides every device from this process"),
    ({"STUB_CUDA_DEVICES": "0"}, "no cuda device: the CUDA driver reports no device"),
    ({"STUB_CUDA_CTX_ERROR": "304"},
     "cuda:0: cannot create a context: cuDevicePrimaryCtxRetain failed: CUDA_ERROR_OPERATING_SYSTEM (304)"),
])
def test_stub_driver_availability_reasons(stub_dir, tmp_path, env, reason):
    """Control flow only (stand-in driver): the real adapter turns each driver answer into its reason."""
    available, message, _, _ = _run_stub(stub_dir, tmp_path, "probe", **env)["availability"]
    assert available is False and message.startswith(reason), message


def test_stream_sources_follow_only_initialised_frameworks():
    """Real torch (a CPU build here): the torch source passes (None) without initialising CUDA."""
    from engine.backend.gpu.settings import GpuPluginSettings
    from engine_cuda.plugin import DEFAULT_STREAM_SOURCES
    from engine_cuda.streams import SOURCES, torch_stream

    def sources(names):
        return GpuPluginSettings.from_env("cuda", SOURCES, DEFAULT_STREAM_SOURCES,
                                          {"ENGINE_CUDA_STREAM_SOURCES": names}).stream_sources

    torch = pytest.importorskip("torch")
    assert torch_stream(0) is None
    assert not torch.cuda.is_initialized()
    assert len(sources("torch, cupy")) == 2 and sources("") == ()
    with pytest.raises(ValueError, match="ENGINE_CUDA_STREAM_SOURCES='jax': unknown source\\(s\\) \\['jax'\\]"):
        sources("jax")


def test_an_invalid_setting_makes_the_plugin_fail_to_register_with_the_cause(tmp_path):
    env = dict(os.environ, ENGINE_CACHE_DIR=str(tmp_path), ENGINE_CUDA_SYNC="maybe")
    out = subprocess.run([sys.executable, "-m", "engine", "devices", "--json"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [row for row in json.loads(out.stdout)["devices"] if row["kind"] == "cuda"]
    assert len(rows) == 1 and rows[0]["available"] is False
    assert "ValueError: ENGINE_CUDA_SYNC='maybe': expected 0 or 1" in rows[0]["reason"]
