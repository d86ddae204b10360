"""The HIP plugin on a machine without an AMD GPU (issue 11).

What runs for real here: plugin discovery (``engine devices`` and ``engine demo --device hip`` in
subprocesses), the availability probe against whatever this machine has (no hip-python, no ROCm
runtime library, or Debian's ROCm 5.2 runtime, which is older than the plugin needs: each gives
its own reason), loading a HIP bundle (which must fail naming that reason), the hsaco selection
rules, and hiprtc compiling a ``hip-source`` binary at load for the device's own target. Tests that
use ``gpu_fakes.FakeDriver`` say "control flow only" in their docstring: they are no evidence that
the plugin works on a GPU (that is ``tests/gpu`` and ``scripts/gpu-check`` on an AMD GPU, which no
session has had).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from engine.backend import BinaryPayload, CandidateSpec, LaunchDims
from engine.errors import DeviceUnavailableError, KernelError
from gpu_abi import expected_parameters
from gpu_fakes import FakeDriver

pytest.importorskip("engine_hip", reason="the engine-hip plugin is not installed (pip install -e plugins/hip)")
from engine_hip.backend import HipBackend  # noqa: E402
from engine_hip.kernels import hsaco_refusal  # noqa: E402
from engine_hip.reference import SOURCES  # noqa: E402
from engine.backend.gpu.settings import GpuPluginSettings  # noqa: E402
from engine_hip.plugin import DEFAULT_STREAM_SOURCES  # noqa: E402
from engine_hip.streams import SOURCES as STREAM_SOURCES  # noqa: E402

SCALE_WS = SOURCES["scale_ws"][0]

LAUNCH = {"grid": ["max(ceil_div(n, 128), 1)", 1, 1], "block": [128, 1, 1]}
#: The reasons this plugin gives on a machine without a usable AMD GPU (docs/hip.md §2).
NO_GPU_REASON = re.compile(r"the hip-python package cannot be imported|no ROCm runtime library: libamdhip64\.so "
                           r"cannot be loaded|the HIP runtime is \d+\.\d+; this plugin needs 6\.0 or newer|"
                           r"no hip device: |hip-python \d+\.x is installed but the ROCm runtime is")


class HipFakeDriver(FakeDriver):
    """``FakeDriver`` speaking HIP: the runtime's name, HIP_VERSION encoding and gfx names."""

    name = "HIP runtime"

    def __init__(self, *, archs: tuple[str, ...] = ("gfx942:sramecc+:xnack-",), version: int = 60_443_483,
                 mismatch: str | None = None, **kwargs):
        kwargs.setdefault("devices", tuple((f"Fake MI{i}", (9, 4)) for i in range(len(archs))))
        super().__init__(version=version, **kwargs)
        self.archs, self.mismatch = archs, mismatch

    def arch_name(self, index: int) -> str:
        return self.archs[index]

    def version_mismatch(self, version: int) -> str | None:
        return self.mismatch


def _spec(binaries, *, entry="scale_ws", inputs=1, outputs=1, symbols=("n",), workspace=True) -> CandidateSpec:
    return CandidateSpec("scale", 0, entry, tuple(binaries), None, inputs, outputs, tuple(symbols), workspace)


def _real_reason(tmp_path) -> str:
    avail = HipBackend(tmp_path).availability()
    if avail.available:
        pytest.skip(f"a usable AMD GPU is here ({avail.device_names}): these tests check the no-GPU behaviour")
    return str(avail.reason)


# -- real: discovery, the probe on this machine, a HIP bundle ----------------------------------------

def test_engine_devices_lists_hip_unavailable_with_the_cause(tmp_path):
    reason = _real_reason(tmp_path)
    env = dict(os.environ, ENGINE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "engine", "devices", "--json"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {row["kind"]: row for row in json.loads(out.stdout)["devices"]}
    hip = rows["hip"]
    assert (hip["available"], hip["workspace_slot"], hip["distribution"]) == (False, 2, "engine-hip")
    assert hip["reason"] == reason
    assert NO_GPU_REASON.search(reason), reason


def test_importing_and_registering_the_plugin_touches_no_runtime(tmp_path):
    code = (
        "import sys\n"
        "from engine.plugins import Registry\n"
        "from engine.settings import Settings\n"
        "r = Registry(Settings.from_env())\n"
        "assert 'hip' in r.kinds(), r.failures()\n"
        "b = r.backend('hip')\n"
        "assert (b.kind, b.workspace_slot, b.dlpack_device_type, b.host_accessible) == ('hip', 2, 10, False)\n"
        "assert b.dlpack_stream(None) == 0 and b.formats == ('hsaco', 'hip-source')\n"
        "print(sorted(m for m in sys.modules if m == 'hip' or m.startswith('hip.')))\n"
    )
    env = dict(os.environ, ENGINE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_real_probe_gives_an_actionable_reason(tmp_path):
    backend = HipBackend(tmp_path)
    reason = _real_reason(tmp_path)
    assert NO_GPU_REASON.search(reason), reason
    assert re.search(r"pip install|install ROCm|upgrade ROCm|HIP_VISIBLE_DEVICES|reports no device", reason), reason
    with pytest.raises(DeviceUnavailableError, match="hip:0 is not usable: "):
        backend.current_stream(0)
    assert backend.loadable("hsaco", "gfx942").startswith("hip:0 is not usable: ")


def test_loading_a_hip_bundle_raises_device_unavailable_naming_the_cause(tmp_path):
    import engine
    from engine.build import GraphBuilder

    reason = _real_reason(tmp_path)
    b = GraphBuilder("hip_scale")
    x = b.input("x", "float32", ["n"], device="hip")
    k = b.kernel("scale", device="hip", entries=["scale_ws"], launch=LAUNCH,
                 binaries=[{"format": "hip-source", "target": "any", "path": "scale.hip", "data": SCALE_WS.encode()}])
    (y,) = b.call(k, [x], [("float32", ["n"])], symbols=["n"], workspace="n * 4")
    b.output(y, "y")
    path = tmp_path / "scale.cgb"
    b.save(path)
    with pytest.raises(DeviceUnavailableError) as info:
        engine.load_compiled_graph(path, device="hip")
    assert f"device kind 'hip' is not usable here: {reason}" in str(info.value)


def test_engine_demo_on_hip_fails_with_the_reason(tmp_path):
    """``engine demo --device hip`` builds the model from the plugin's HIP kernels (where hiprtc is
    installed) and then fails to load it with the unavailability reason; without hiprtc it fails
    at the build, saying hiprtc is missing. Either way: exit status non-zero, one clear cause."""
    reason = _real_reason(tmp_path)
    env = dict(os.environ, ENGINE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "engine", "demo", "--device", "hip"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "Traceback" not in text
    assert reason in text or "cannot compile hip sources here: no hiprtc library" in text, text[-2000:]


# -- real: the hsaco selection rule ------------------------------------------------------------------

@pytest.mark.parametrize(("target", "device", "reason"), [
    ("gfx942", "gfx942:sramecc+:xnack-", None),
    ("gfx90a", "gfx942:sramecc+:xnack-", "hsaco for gfx90a, device is gfx942"),
    ("gfx1100", "gfx1101", "hsaco for gfx1100, device is gfx1101"),
    ("gfx90a:xnack+", "gfx90a:sramecc+:xnack-", "hsaco for gfx90a:xnack+ needs xnack+, device is "
                                                 "gfx90a:sramecc+:xnack-"),
    ("gfx90a:xnack-", "gfx90a:sramecc+:xnack-", None),
    ("gfx90a:sramecc+", "gfx90a", None),
    ("sm_90", "gfx942", "hsaco target 'sm_90' is not of the form gfx<NNN>[:feature±]"),
])
def test_hsaco_selection(target, device, reason):
    assert hsaco_refusal(target, device) == reason


def test_stream_sources_follow_only_a_rocm_torch():
    def settings(**env):
        return GpuPluginSettings.from_env("hip", STREAM_SOURCES, DEFAULT_STREAM_SOURCES, env)

    (torch_source,) = settings().stream_sources
    assert settings(ENGINE_HIP_STREAM_SOURCES="").stream_sources == ()
    if "torch" in sys.modules and getattr(sys.modules["torch"].version, "hip", None) is None:
        assert torch_source(0) is None  # a CUDA or CPU build of torch is never followed
    with pytest.raises(ValueError, match=r"ENGINE_HIP_STREAM_SOURCES='cupy': unknown source\(s\) \['cupy'\]"):
        settings(ENGINE_HIP_STREAM_SOURCES="cupy")
    with pytest.raises(ValueError, match=r"ENGINE_HIP_SYNC='maybe': expected 0 or 1"):
        settings(ENGINE_HIP_SYNC="maybe")
    assert settings(ENGINE_HIP_SYNC="1").debug


def test_an_invalid_setting_makes_the_plugin_fail_to_register_with_the_cause(tmp_path):
    env = dict(os.environ, ENGINE_CACHE_DIR=str(tmp_path), ENGINE_HIP_SYNC="maybe")
    out = subprocess.run([sys.executable, "-m", "engine", "devices", "--json"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [row for row in json.loads(out.stdout)["devices"] if row["kind"] == "hip"]
    assert len(rows) == 1 and rows[0]["available"] is False
    assert "ValueError: ENGINE_HIP_SYNC='maybe': expected 0 or 1" in rows[0]["reason"]


# -- control flow only (fake driver) ------------------------------------------------------------------

@pytest.mark.parametrize(("driver_args", "env", "reason"), [
    ({"missing": "no ROCm runtime library: libamdhip64.so cannot be loaded (test)"}, {},
     "no ROCm runtime library: libamdhip64.so cannot be loaded (test); install ROCm 6.0 or newer"),
    ({"version": 50_221_153}, {}, "the HIP runtime is 5.2; this plugin needs 6.0 or newer: upgrade ROCm"),
    ({"archs": (), "devices": ()}, {"HIP_VISIBLE_DEVICES": ""},
     "no hip device: HIP_VISIBLE_DEVICES is set and empty, which hides every device from this process"),
    ({"archs": (), "devices": ()}, {}, "no hip device: the HIP runtime reports no device"),
    ({"archs": ("gfx803",)}, {}, "hip:0 is gfx803, which ROCm 6/7 and this plugin do not support"),
    ({"mismatch": "hip-python 7.x is installed but the ROCm runtime is 6.4: pip install 'hip-python>=6,<7'"}, {},
     "hip-python 7.x is installed but the ROCm runtime is 6.4"),
])
def test_availability_reasons(tmp_path, driver_args, env, reason):
    """Control flow only (fake driver): each way the probe fails gives its own reason."""
    backend = HipBackend(tmp_path, driver=HipFakeDriver(**driver_args), env=env)
    avail = backend.availability()
    assert not avail.available
    assert avail.reason.startswith(reason), avail.reason
    with pytest.raises(DeviceUnavailableError, match="hip:0 is not usable"):
        backend.allocate(16, 0)


def test_availability_when_it_works(tmp_path):
    """Control flow only (fake driver): count, names with the gfx target, and the runtime version."""
    driver = HipFakeDriver(archs=("gfx90a:sramecc+:xnack-", "gfx1100"),
                           devices=(("MI210 (gfx90a:sramecc+:xnack-)", (9, 0)), ("RX 7900 (gfx1100)", (11, 0))))
    avail = HipBackend(tmp_path, driver=driver, env={}).availability()
    assert (avail.available, avail.device_count, avail.driver) == (True, 2, "HIP runtime 6.4")
    assert avail.device_names == ("MI210 (gfx90a:sramecc+:xnack-)", "RX 7900 (gfx1100)")


def test_binary_selection_lists_every_refusal(tmp_path):
    """Control flow only (fake driver): the KernelError lists each binary with its reason."""
    backend = HipBackend(tmp_path, driver=HipFakeDriver(param_counts={"scale_ws": 3}), env={})
    spec = _spec([BinaryPayload("hsaco", "gfx90a", "scale.gfx90a.hsaco", b"\x7fELF"),
                  BinaryPayload("hsaco", "gfx1100", "scale.gfx1100.hsaco", b"\x7fELF"),
                  BinaryPayload("cubin", "sm_90", "scale.sm_90.cubin", b"\x7fELF")])
    with pytest.raises(KernelError) as info:
        backend.load_kernel(spec, 0)
    message = str(info.value)
    assert message.startswith("kernel 'scale' candidate 0 (entry 'scale_ws'): no loadable binary for hip:0: ")
    assert "scale.gfx90a.hsaco (hsaco, gfx90a): hsaco for gfx90a, device is gfx942" in message
    assert "scale.gfx1100.hsaco (hsaco, gfx1100): hsaco for gfx1100, device is gfx942" in message
    assert "scale.sm_90.cubin (cubin, sm_90): format 'cubin' is not one of hip's formats" in message
    assert message.endswith("(format 'hip-source')")


def test_a_module_the_runtime_refuses_moves_selection_on(tmp_path):
    """Control flow only (fake driver): a runtime refusal is a BinaryRefused naming the status."""
    driver = HipFakeDriver(module_error="hipErrorNoBinaryForGpu", param_counts={"scale_ws": 3})
    backend = HipBackend(tmp_path, driver=driver, env={})
    spec = _spec([BinaryPayload("hsaco", "gfx942", "scale.gfx942.hsaco", b"\x7fELF")])
    with pytest.raises(KernelError, match=r"scale.gfx942.hsaco \(hsaco, gfx942\): it holds no code for this GPU "
                                          r"\(cuModuleLoadData failed: hipErrorNoBinaryForGpu"):
        backend.load_kernel(spec, 0)


@pytest.mark.parametrize("has_workspace", [True, False])
def test_argument_block_matches_the_documented_abi_byte_for_byte(tmp_path, has_workspace):
    """Control flow only (fake driver) for the launch; the bytes are real: the fake reads the
    ``void **`` array the HIP plugin hands ``hipModuleLaunchKernel`` the way the runtime does, and
    they must equal the ABI as ``tests/gpu_abi.py`` writes it out (the module the CUDA test uses)."""
    count = 3 + int(has_workspace)
    backend = HipBackend(tmp_path, driver=(driver := HipFakeDriver(param_counts={"scale_ws": count})), env={})
    kernel = backend.load_kernel(_spec([BinaryPayload("hsaco", "gfx942", "s.hsaco", b"\x7fELF")],
                                       workspace=has_workspace), 0)
    stream = backend.current_stream(0)
    workspace = 0x7F00_0001_0000 if has_workspace else None
    launch = kernel.prepare([0, 0], [2**40 + 5], workspace or 0, stream, LaunchDims((8, 1, 1), (128, 1, 1), 64))
    launch.set_tensor(0, 0x7F00_0000_1000)
    launch.set_tensor(1, 0x7F00_0000_2000)
    assert launch.call() == 0
    (sent,) = driver.launches
    assert sent["dims"] == (8, 1, 1, 128, 1, 1, 64) and sent["stream"] == stream
    assert sent["params"] == expected_parameters([0x7F00_0000_1000, 0x7F00_0000_2000], [2**40 + 5], workspace,
                                                 has_workspace)


def test_hip_source_is_compiled_at_load_for_the_devices_own_target(tmp_path):
    """Control flow only for the runtime (fake driver); the compile is real: the module image the
    plugin hands ``hipModuleLoadData`` for a ``hip-source`` binary is hiprtc's code object for the
    device's gfx target (with its features), compiled once and then served from the cache."""
    from engine_hip.compiler import hiprtc_unavailable
    from engine_hip.kernels import EM_AMDGPU, code_object_target

    problem = hiprtc_unavailable()
    if problem:
        pytest.skip(problem)
    driver = HipFakeDriver(archs=("gfx90a:sramecc+:xnack-",), param_counts={"scale_ws": 4})
    backend = HipBackend(tmp_path, driver=driver, env={})
    if backend.compiler.target_problem("gfx90a") is not None:
        pytest.skip(backend.compiler.target_problem("gfx90a"))
    spec = _spec([BinaryPayload("hip-source", "any", "scale.hip", SCALE_WS.encode())])
    kernel = backend.load_kernel(spec, 0)  # held: the module is unloaded with its last kernel
    (image,) = driver.modules.values()
    obj = code_object_target(image)
    assert obj.machine == EM_AMDGPU and obj.mach == "gfx90a"
    again = HipBackend(tmp_path, driver=HipFakeDriver(archs=("gfx90a:sramecc+:xnack-",),
                                                      param_counts={"scale_ws": 4}), env={})
    again.load_kernel(spec, 0)
    assert again.compiler.invocations == 0  # the build cache answered
    assert kernel is not None


def test_the_core_runs_and_captures_through_the_plugin(tmp_path):
    """Control flow only (fake driver): a HIP bundle loads through the core's real load path, runs
    with pooled outputs whose pointers reach the argument block, and is captured as a HIP graph
    replayed on the caller's stream."""
    import engine
    from engine.build import GraphBuilder
    from engine.plugins import Registry
    from engine.settings import Settings

    b = GraphBuilder("hip_flow")
    x = b.input("x", "float32", ["n"], device="hip")
    bias = b.weight("b", np.ones(4, np.float32), device="hip")
    k = b.kernel("scale", device="hip", entries=["scale_ws"], launch=LAUNCH,
                 binaries=[{"format": "hsaco", "target": "gfx942", "path": "scale.hsaco", "data": b"\x7fELF"}])
    (y,) = b.call(k, [x, bias], [("float32", ["n"])], symbols=["n"], workspace="n * 4")
    b.output(y, "y")
    path = tmp_path / "flow.cgb"
    b.save(path)

    driver = HipFakeDriver(param_counts={"scale_ws": 5})
    registry = Registry(Settings.from_env(), autoload=False)
    registry.register_backend(HipBackend(tmp_path, driver=driver, env={}))
    graph = engine.load_compiled_graph(path, registry=registry)
    xs = engine.asarray(np.arange(3, dtype=np.float32), device="hip:0", registry=registry)
    (out,) = graph.run_async([xs])
    params = driver.launches[-1]["params"]
    assert params[0] == xs.ptr.to_bytes(8, "little") and params[2] == out.ptr.to_bytes(8, "little")
    assert params[3] == (3).to_bytes(8, "little")
    stream = 0x5150
    with registry.backend("hip").use_stream(stream):
        captured = graph.capture(xs)
        captured.replay()
    assert [c for c in driver.calls if c[0] == "capture_begin"] == [("capture_begin", stream)]
    replays = [c[2] for c in driver.calls if c[0] == "graph_launch"]
    assert replays and set(replays) == {stream}  # every replay on the caller's stream
    captured.close()


# -- real: the adapter through the real hip-python against a real (old, GPU-less) ROCm runtime --------

ADAPTER_SCRIPT = """
import json
from engine.backend.gpu import DriverError
from engine_hip.driver import HipDriver
d = HipDriver()
d.load()
out = {"version": d.version(), "count": d.device_count(), "calls": {}}
calls = [("stream_create", ()), ("stream_synchronize", (0,)), ("stream_is_capturing", (0,)),
         ("device_synchronize", ()), ("event_create", ()), ("pool_prepare", (0,)), ("alloc_async", (256, 0, 0)),
         ("memset8", (0, 0, 16, 0)), ("copy_dtod", (0, 0, 16, 0)), ("module_load", (b"\\x7fELF" + bytes(60),)),
         ("module_function", (0, "k")), ("capture_begin", (0,)), ("capture_end", (0,)), ("graph_instantiate", (0,)),
         ("activate", (0,))]
for name, args in calls:
    try:
        getattr(d, name)(*args)
        out["calls"][name] = "ok"
    except DriverError as exc:
        out["calls"][name] = exc.name
out["launch"] = d.launcher(0, (1, 1, 1, 1, 1, 1, 0), 0, 0)()
out["graph_launch"] = d.graph_launcher(0)(0)
print(json.dumps(out))
"""


def test_the_adapter_drives_the_real_bindings_against_a_rocm_runtime_without_a_gpu(tmp_path):
    """Real hip-python calling Debian's real ROCm 5.2 ``libamdhip64.so.5`` on a machine without a GPU:
    every adapter call's arguments are accepted by the bindings (ints for handles and the parameter
    array) and the runtime's status comes back as a ``DriverError`` with the ``hipError_t`` name, and
    the launch closures return the status as an int. No device exists, so this checks types and
    error paths, not a GPU. (ROCm 5.2 is older than the plugin supports: availability refuses it.)"""
    pytest.importorskip("hip", reason="hip-python is not installed")
    runtime = "/usr/lib/x86_64-linux-gnu/libamdhip64.so.5"
    if not os.path.exists(runtime):
        pytest.skip(f"no ROCm 5 runtime at {runtime} (Debian: apt-get install libamdhip64-5)")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libamdhip64.so").symlink_to(runtime)  # hip-python opens the unversioned name
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path / "lib"), ENGINE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", ADAPTER_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["version"] // 10_000_000 == 5 and report["count"] == 0
    assert set(report["calls"].values()) == {"hipErrorInvalidDevice"}, report["calls"]
    assert report["launch"] == report["graph_launch"] == 101  # hipErrorInvalidDevice, as an int
