"""CUDA kernels compile on a machine without a GPU (issue 10, "Must show here, without a GPU").

Every CUDA source the plugin ships goes through the plugin's own ``compile()`` (NVRTC, no driver)
into PTX and into cubins for sm_80 and sm_90. A cubin is an ELF file: this test reads its header
and symbol table itself (``CubinElf`` below, about 40 lines) and checks the magic, the machine
(190, EM_CUDA), the architecture recorded in ``e_flags`` and that every candidate's entry is a
defined function symbol. CUDA bundles (the demo model, the CPU+CUDA offload variant) build and save
here, ``engine inspect`` lists their CUDA binaries, and loading them says why they cannot run.
Nothing here runs a CUDA kernel: that needs a GPU (tests/gpu, ``scripts/gpu-check``).
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import attrs
import pytest

import engine
from engine.errors import DeviceUnavailableError, InputError, KernelError
from engine.testing.reference import REFERENCE_KERNELS, with_macros

pytest.importorskip("engine_cuda", reason="the engine-cuda plugin is not installed (pip install -e plugins/cuda)")
from engine_cuda.compiler import DEFAULT_ARCHS, DEFAULT_PTX, CudaCompiler, nvrtc_unavailable  # noqa: E402
from engine_cuda.reference import MLP_MACROS, SOURCES, fault_kernel  # noqa: E402

if nvrtc_unavailable() is not None:  # pragma: no cover - CI installs the NVRTC wheel
    pytest.skip(f"NVRTC is not usable here: {nvrtc_unavailable()}", allow_module_level=True)

EM_CUDA = 190
SHT_SYMTAB = 2
STT_FUNC = 2


@attrs.frozen
class CubinElf:
    """The parts of a cubin (ELF64, little endian) this test checks."""

    machine: int
    abi_version: int
    flags: int
    functions: frozenset[str]

    @classmethod
    def parse(cls, data: bytes) -> "CubinElf":
        assert data[:4] == b"\x7fELF", f"not an ELF file: {data[:4]!r}"
        assert data[4] == 2 and data[5] == 1, "expected ELFCLASS64, little endian"
        machine, = struct.unpack_from("<H", data, 18)
        shoff, = struct.unpack_from("<Q", data, 40)
        flags, = struct.unpack_from("<I", data, 48)
        shentsize, shnum = struct.unpack_from("<HH", data, 58)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        functions = set()
        for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
            if sh_type != SHT_SYMTAB:
                continue
            str_off = sections[link][4]
            for pos in range(offset, offset + size, entsize):
                st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", data, pos)
                if st_info & 0xF == STT_FUNC and st_shndx != 0:
                    end = data.index(b"\0", str_off + st_name)
                    functions.add(data[str_off + st_name:end].decode())
        return cls(machine, data[8], flags, frozenset(functions))

    @property
    def sm(self) -> int:
        """The SM architecture: e_flags bits 0-7 up to ELF ABI version 7, bits 8-15 from version 8
        (the layout NVRTC uses for sm_100 and later)."""
        return (self.flags >> 8) & 0xFF if self.abi_version >= 8 else self.flags & 0xFF


def _ptx_entries(ptx: str) -> set[str]:
    return set(re.findall(r"^\s*\.visible\s+\.entry\s+(\w+)\s*\(", ptx, re.MULTILINE))


@pytest.fixture(scope="module")
def cuda_backend(registry):
    return registry.backend("cuda")


def _specialised(name: str) -> str:
    return with_macros(SOURCES[name][0], MLP_MACROS.get(name, {}))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_shipped_kernel_compiles_to_cubins_and_ptx(cuda_backend, name):
    source, entries = SOURCES[name]
    payloads = cuda_backend.compile(_specialised(name), "cuda", {"archs": ["sm_80", "sm_90"]})
    assert [(p.format, p.target) for p in payloads] == [("cubin", "sm_90"), ("cubin", "sm_80"), ("ptx", DEFAULT_PTX)]
    for payload in payloads[:2]:
        elf = CubinElf.parse(bytes(payload.data))
        assert elf.machine == EM_CUDA
        assert elf.sm == int(payload.target.removeprefix("sm_"))
        assert set(entries) <= elf.functions, f"{payload.describe()} lacks {set(entries) - elf.functions}"
    ptx = bytes(payloads[2].data).decode("ascii")
    assert re.search(r"^\.version \d+\.\d+$", ptx, re.MULTILINE)
    assert re.search(r"^\.target sm_80$", ptx, re.MULTILINE)
    assert set(entries) <= _ptx_entries(ptx)


def test_reference_kernels_are_the_shipped_sources_with_the_documented_names(cuda_backend):
    refs = cuda_backend.reference_kernels()
    assert set(refs) == set(REFERENCE_KERNELS) - {"fail_code"}
    for name, ref in refs.items():
        assert ref.language == "cuda" and (ref.source, ref.entries) == SOURCES[name]
        assert len(ref.launch["grid"]) == 3 and len(ref.launch["block"]) == 3
    assert fault_kernel().entries == ("fault",)


def test_default_targets_are_newest_cubin_first_then_ptx(cuda_backend):
    payloads = cuda_backend.compile(_specialised("add"), "cuda")
    targets = [p.target for p in payloads]
    assert {"sm_80", "sm_90"} <= set(targets) and set(targets[:-1]) <= set(DEFAULT_ARCHS)
    assert targets[-1] == DEFAULT_PTX and payloads[-1].format == "ptx"
    numbers = [int(t.removeprefix("sm_")) for t in targets[:-1]]
    assert numbers == sorted(numbers, reverse=True)
    for payload in payloads[:-1]:
        assert CubinElf.parse(bytes(payload.data)).sm == int(payload.target.removeprefix("sm_"))


def test_ptx_only_and_cubin_only(cuda_backend):
    (ptx,) = cuda_backend.compile(_specialised("add"), "cuda", {"archs": [], "ptx": "compute_90"})
    assert ptx.format == "ptx" and re.search(r"^\.target sm_90$", bytes(ptx.data).decode(), re.MULTILINE)
    (cubin,) = cuda_backend.compile(_specialised("add"), "cuda", {"archs": [86], "ptx": None})
    assert cubin.target == "sm_86" and CubinElf.parse(bytes(cubin.data)).sm == 86


def test_compile_errors_are_one_line_with_the_whole_log_kept(cuda_backend):
    bad = SOURCES["add"][0] + '\nextern "C" __global__ void broken(float *y) { y[0] = undeclared_name; }\n'
    with pytest.raises(KernelError) as info:
        cuda_backend.compile(bad, "cuda", {"archs": ["sm_80"]})
    message = str(info.value)
    assert "\n" not in message and "undeclared_name" in message and "sm_80" in message
    assert "undeclared_name" in info.value.log and "\n" in info.value.log


@pytest.mark.parametrize("options, match", [
    ({"arch": ["sm_80"]}, r"unknown cuda compile option\(s\) \['arch'\]"),
    ({"archs": ["sm80"]}, r"architecture 'sm80' is not of the form sm_<NN>"),
    ({"archs": ["sm_12345"]}, r"architecture 'sm_12345' is not of the form"),
    ({"archs": ["sm_31"]}, r"cannot compile for sm_31; it supports .*sm_80"),
    ({"ptx": "sm_80"}, r"architecture 'sm_80' is not of the form compute_<NN>"),
    ({"archs": [], "ptx": None}, r"no target"),
    ({"flags": "-O3"}, r"'flags' must be a sequence of strings"),
])
def test_bad_options_are_refused_by_name(cuda_backend, options, match):
    with pytest.raises(InputError, match=match):
        cuda_backend.compile(_specialised("add"), "cuda", options)


def test_results_are_cached_by_content_target_and_nvrtc_version(tmp_path):
    compiler = CudaCompiler(tmp_path)
    first = compiler.compile(_specialised("busy"), {"archs": ["sm_80"]})
    assert compiler.invocations == 2  # the cubin and the PTX
    again = CudaCompiler(tmp_path).compile(_specialised("busy"), {"archs": ["sm_80"]})
    assert [bytes(p.data) for p in again] == [bytes(p.data) for p in first]
    other = CudaCompiler(tmp_path)
    other.compile(_specialised("busy"), {"archs": ["sm_90"]})
    assert other.invocations == 1  # a new architecture is a new key; the PTX is cached
    major, minor = compiler.version()
    assert compiler.describe() == f"NVRTC {major}.{minor}"
    assert len(list((tmp_path / "cuda" / "build").glob("*.cubin"))) == 2


# ---- bundles -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_bundle(tmp_path_factory, registry) -> Path:
    from engine.demo.mlp import build_mlp

    path = tmp_path_factory.mktemp("cuda-mlp") / "mlp-cuda.cgb"
    build_mlp(registry=registry, device="cuda").save(path)
    return path


def test_cuda_demo_bundle_carries_cubins_ptx_and_source(cuda_bundle):
    with zipfile.ZipFile(cuda_bundle) as zf:
        names = zf.namelist()
        metas = [json.loads(zf.read(n)) for n in sorted(names) if re.fullmatch(r"kernels/\d+/meta\.json", n)]
        assert [m["device"] for m in metas] == ["cuda"] * 5
        for task, meta in enumerate(metas):
            for cand in meta["candidates"]:
                formats = [(b["format"], b["target"]) for b in cand["binaries"]]
                assert formats[0][0] == "cubin" and ("cubin", "sm_80") in formats and ("cubin", "sm_90") in formats
                assert formats[-2:] == [("ptx", DEFAULT_PTX), ("cuda-source", "any")]
                assert cand["launch"] and len(cand["launch"]["grid"]) == 3
                for b in cand["binaries"]:
                    data = zf.read(f"kernels/{task}/{b['path']}")
                    if b["format"] == "cubin":
                        elf = CubinElf.parse(data)
                        assert elf.sm == int(b["target"].removeprefix("sm_")) and cand["entry"] in elf.functions
                    elif b["format"] == "ptx":
                        assert cand["entry"] in _ptx_entries(data.decode())
        entries = [c["entry"] for m in metas for c in m["candidates"]]
        assert entries[:2] == ["mm_naive", "mm_tiled"] and "softmax_rows" in entries


def _inspect(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli.main", "inspect", str(path), *args],
                          capture_output=True, text=True, timeout=120)


def test_engine_inspect_lists_the_cuda_kernels(cuda_bundle):
    proc = _inspect(cuda_bundle, "--json")
    doc = json.loads(proc.stdout)
    assert [k["name"] for k in doc["kernels"]] == ["matmul_1", "bias_relu", "matmul_2", "bias_add", "softmax"]
    for kernel in doc["kernels"]:
        for cand in kernel["candidates"]:
            formats = {(b["format"], b["target"]) for b in cand["binaries"]}
            assert {("cubin", "sm_80"), ("cubin", "sm_90"), ("ptx", DEFAULT_PTX), ("cuda-source", "any")} <= formats
    text = _inspect(cuda_bundle)
    assert re.search(r"0\s+matmul_1\s+cuda\s+0\s+mm_naive\s+cubin/sm_\d+", text.stdout), text.stdout


def test_loading_a_cuda_bundle_without_a_gpu_names_the_cause(cuda_bundle, registry):
    avail = registry.backend("cuda").availability()
    if avail.available:
        pytest.skip(f"a CUDA device is available here ({', '.join(avail.device_names)})")
    with pytest.raises(DeviceUnavailableError) as info:
        engine.load_compiled_graph(cuda_bundle, registry=registry)
    assert avail.reason and avail.reason in str(info.value)


def test_host_io_variant_carries_cpu_and_cuda_and_says_why_it_cannot_load(tmp_path, registry):
    from engine.demo.mlp import build_mlp

    path = tmp_path / "mlp-host-io.cgb"
    build_mlp(registry=registry, device="cuda", io_device="cpu").save(path)
    doc = json.loads(_inspect(path, "--json").stdout)
    assert doc["inputs"][0]["device"] == "cpu" and doc["outputs"][0]["device"] == "cpu"
    devices = [k["device"] for k in doc["kernels"]]
    assert devices == ["cuda"] * 6 + ["cpu"]  # the copy in, five CUDA kernels, the copy out
    avail = registry.backend("cuda").availability()
    if not avail.available:
        with pytest.raises(DeviceUnavailableError, match=re.escape(avail.reason)):
            engine.load_compiled_graph(path, registry=registry)


# ---- scripts/gpu-check without a GPU ---------------------------------------------------------------
@pytest.mark.slow
def test_gpu_check_without_a_gpu_reports_every_gpu_test_skipped_with_the_reason(tmp_path, registry):
    avail = registry.backend("cuda").availability()
    if avail.available:
        pytest.skip("a CUDA device is available here: scripts/gpu-check runs for real (not this test's case)")
    script = Path(__file__).resolve().parents[3] / "scripts" / "gpu-check"
    proc = subprocess.run([sys.executable, str(script), "--no-install"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].endswith(f"NO GPU, nothing ran on one: {avail.reason}")
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert report["ok"] is True and report["gpu"]["available"] is False and report["gpu"]["reason"] == avail.reason
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["gpu-tests", "conformance", "benchmark"]
    tests = steps["gpu-tests"]
    assert tests["skipped"] >= 10 and tests["passed"] == tests["failed"] == tests["errors"] == 0
    reasons = set(tests["skip_reasons"].values())  # tests/gpu also has hip cases, skipped with HIP's own reason
    assert f"CUDA is not usable here: {avail.reason}" in reasons
    assert all(r == f"CUDA is not usable here: {avail.reason}" or r.startswith(("HIP is not usable here: ",
               "the engine-hip plugin is not installed")) for r in reasons), reasons
    conformance = steps["conformance"]
    assert conformance["failed"] == conformance["errors"] == 0 and conformance["skipped"] > 0
    assert all(avail.reason in reason for reason in conformance["skip_reasons"].values())
    assert steps["benchmark"]["results"] == {"benchmark": "cuda_overhead", "skipped": True, "reason": avail.reason,
                                             "summary": []}
    assert (tmp_path / "gpu-tests-junit.xml").exists() and (tmp_path / "conformance-junit.xml").exists()


@pytest.mark.slow
def test_gpu_check_onnx_without_a_gpu_reports_every_onnx_gpu_test_skipped_with_the_reason(tmp_path, registry):
    pytest.importorskip("engine_onnx")
    avail = registry.backend("cuda").availability()
    if avail.available:
        pytest.skip("a CUDA device is available here: scripts/gpu-check runs for real (not this test's case)")
    script = Path(__file__).resolve().parents[3] / "scripts" / "gpu-check"
    proc = subprocess.run([sys.executable, str(script), "--no-install", "--onnx"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].endswith(f"NO GPU, nothing ran on one: {avail.reason}")
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    (step,) = report["steps"]
    assert report["ok"] is True and step["name"] == "onnx-gpu"
    assert step["skipped"] >= 100 and step["passed"] == step["failed"] == step["errors"] == 0
    assert {r.split(" (")[0] for r in step["skip_reasons"].values()} == {"no GPU kind of cuda can run kernels here"}
    assert all(avail.reason in r for r in step["skip_reasons"].values())
