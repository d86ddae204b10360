"""Kernel loading (binary selection and its errors) and launches: symbols, workspace, prepared
launches re-pointed with ``set_tensor``, failure codes."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from engine.backend import BinaryPayload, CandidateSpec
from engine.errors import KernelError
from engine.testing.checks import check, lacks, values_differ
from engine.testing.reference import MLP_KERNELS, REFERENCE_KERNELS

conformance = pytest.mark.conformance

#: Macros the suite specialises each reference kernel with (the demo model's first layer).
MACROS = {"mlp_matmul": {"K": 64, "N": 128}, "mlp_bias_relu": {"N": 128}, "mlp_bias_add": {"N": 128},
          "mlp_softmax": {"N": 10}}
SENTINEL = np.float32(-12345.5)
TAIL = 16  # elements after each output that a kernel must not touch


def any_reference(kit) -> str:
    refs = kit.references()
    for name in ("add", "scale_ws", "busy", *MLP_KERNELS, "fail_code"):
        if name in refs:
            return name
    lacks("reference.add", f"the {kit.backend.kind} backend's reference_kernels() is empty")


def bogus(fmt: str, path: str) -> BinaryPayload:
    return BinaryPayload(fmt, "conformance-target", path, b"\x00engine.testing: not a real binary\xff")


def output_buffer(memory, n: int):
    """``n`` floats followed by ``TAIL`` floats, all initialised to the sentinel."""
    return memory.upload(np.full(n + TAIL, SENTINEL, np.float32))


def read_output(memory, storage, n: int) -> tuple[np.ndarray, np.ndarray]:
    data = memory.read_array(storage.ptr, np.float32, n + TAIL)
    return data[:n], data[n:]


@conformance("kernel.reference_load")
def test_reference_kernels_load(kit):
    refs = kit.references()
    if not refs:
        lacks("reference.add", f"the {kit.backend.kind} backend's reference_kernels() is empty")
    for name in refs:
        if name not in REFERENCE_KERNELS:
            continue  # reported by kernel.reference_names
        specs = kit.specs(name, **MACROS.get(name, {}))
        for i, spec in enumerate(specs):
            kernel = kit.kernel(name, i, **MACROS.get(name, {}))
            check(kernel.spec == spec, "kernel.reference_load", f"kernel.spec to be the spec {spec.describe()}",
                  repr(kernel.spec))
            check(kernel.binary in spec.binaries, "kernel.reference_load",
                  f"kernel.binary of {spec.describe()} to be one of its binaries", repr(kernel.binary))


@conformance("kernel.skip_unknown_format")
def test_unknown_format_skipped(backend, device_index, kit):
    name = any_reference(kit)
    spec = kit.specs(name, **MACROS.get(name, {}))[0]
    unknown = bogus("conformance-unknown-format", f"{name}.unknown")
    kernel = backend.load_kernel(attrs.evolve(spec, binaries=(unknown, *spec.binaries)), device_index)
    check(kernel.binary is not unknown and kernel.binary in spec.binaries, "kernel.skip_unknown_format",
          f"the unknown-format binary skipped and one of {[b.describe() for b in spec.binaries]} loaded",
          repr(kernel.binary))


@conformance("kernel.no_loadable_binary")
def test_no_loadable_binary(backend, device_index):
    sig = REFERENCE_KERNELS["add"]
    binaries = (bogus("conformance-format-a", "add.first-a"), bogus("conformance-format-b", "add.second-b"))
    spec = CandidateSpec("conformance_unloadable", 0, "add", binaries, None, sig.num_inputs, sig.num_outputs,
                         sig.symbols, False)
    try:
        kernel = backend.load_kernel(spec, device_index)
    except KernelError as exc:
        message = str(exc)
    except Exception as exc:  # noqa: BLE001 - the finding itself
        check(False, "kernel.no_loadable_binary", "a KernelError", f"{type(exc).__name__}: {exc}")
    else:
        check(False, "kernel.no_loadable_binary", "a KernelError", f"a loaded kernel {kernel!r}")
    missing = [w for w in ("conformance_unloadable", "add.first-a", "conformance-format-a", "add.second-b",
                           "conformance-format-b") if w not in message]
    check(not missing, "kernel.no_loadable_binary", "the message to name the kernel and each binary's path and "
          "format", f"{message!r} lacks {missing}")


@conformance("kernel.corrupt_binary")
def test_corrupt_binary(backend, device_index, kit):
    name = any_reference(kit)
    spec = kit.specs(name, **MACROS.get(name, {}))[0]
    good = spec.binaries[0]
    corrupt = BinaryPayload(good.format, good.target, f"corrupt-{good.path}", b"\x00\xffengine.testing corrupt" * 8)
    spec = attrs.evolve(spec, kernel_name=f"conformance_corrupt_{name}", binaries=(corrupt,))
    try:
        kernel = backend.load_kernel(spec, device_index)
    except KernelError as exc:
        check(spec.kernel_name in str(exc), "kernel.corrupt_binary", f"the KernelError to name {spec.describe()}",
              repr(str(exc)))
    except Exception as exc:  # noqa: BLE001 - the finding itself
        check(False, "kernel.corrupt_binary", "a KernelError", f"{type(exc).__name__}: {exc}")
    else:
        check(False, "kernel.corrupt_binary", f"a KernelError for corrupt {good.format} bytes",
              f"a loaded kernel {kernel!r}")


@conformance("launch.symbols")
def test_add(kit, memory):
    kernel = kit.kernel("add")
    rng = np.random.default_rng(5)
    for n in (1, 1000, 4097):
        x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        xs, ys, zs = memory.upload(x), memory.upload(y), output_buffer(memory, n)
        kit.launch(kernel, [xs.ptr, ys.ptr, zs.ptr], [n], None, memory.stream)
        z, tail = read_output(memory, zs, n)
        check(values_differ(x + y, z) is None, "launch.symbols", f"add at n={n} to give x + y",
              lambda: values_differ(x + y, z))
        check(bool(np.all(tail == SENTINEL)), "launch.symbols", f"add at n={n} to leave the bytes after z alone",
              lambda: f"{int(np.sum(tail != SENTINEL))} of {TAIL} floats after z changed")


@conformance("launch.workspace")
def test_scale_ws(kit, memory):
    kernel = kit.kernel("scale_ws")
    n = 4097
    x = np.random.default_rng(6).standard_normal(n).astype(np.float32)
    xs, ys, ws = memory.upload(x), output_buffer(memory, n), output_buffer(memory, n)
    kit.launch(kernel, [xs.ptr, ys.ptr], [n], ws.ptr, memory.stream)
    y, _ = read_output(memory, ys, n)
    w, _ = read_output(memory, ws, n)
    twice = np.float32(2) * x
    check(values_differ(twice, w) is None, "launch.workspace", "the workspace to hold 2 * x",
          lambda: values_differ(twice, w))
    check(values_differ(twice + np.float32(1), y) is None, "launch.workspace", "y = 2 * x + 1",
          lambda: values_differ(twice + np.float32(1), y))


@conformance("launch.prepared_set_tensor")
def test_prepared_set_tensor(kit, memory):
    kernel = kit.kernel("add")
    n = 1000
    rng = np.random.default_rng(7)
    first = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    second = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    a = [memory.upload(v) for v in first] + [output_buffer(memory, n)]
    b = [memory.upload(v) for v in second] + [output_buffer(memory, n)]
    prepared = kit.prepare(kernel, [s.ptr for s in a], [n], None, memory.stream)
    code = prepared.call()
    check(code == 0, "launch.prepared_set_tensor", "call() to return 0", code)
    got_a, _ = read_output(memory, a[2], n)
    check(values_differ(first[0] + first[1], got_a) is None, "launch.prepared_set_tensor",
          "the first call to write x + y", lambda: values_differ(first[0] + first[1], got_a))
    for i, s in enumerate(b):
        prepared.set_tensor(i, s.ptr)
    code = prepared.call()
    check(code == 0, "launch.prepared_set_tensor", "call() after set_tensor to return 0", code)
    got_b, _ = read_output(memory, b[2], n)
    check(values_differ(second[0] + second[1], got_b) is None, "launch.prepared_set_tensor",
          "the call after set_tensor to write the new inputs' sum to the new output",
          lambda: values_differ(second[0] + second[1], got_b))
    again_a, _ = read_output(memory, a[2], n)
    check(values_differ(first[0] + first[1], again_a) is None, "launch.prepared_set_tensor",
          "the old output to be left alone after set_tensor", lambda: values_differ(first[0] + first[1], again_a))


@conformance("launch.failure_code")
def test_failure_code(kit, memory):
    kernel = kit.kernel("fail_code")
    n = 16
    xs, ys = memory.upload(np.ones(n, np.float32)), memory.alloc(n * 4)
    try:
        kit.launch(kernel, [xs.ptr, ys.ptr], [n], None, memory.stream)
    except KernelError as exc:
        check("fail_code" in str(exc), "launch.failure_code", "the KernelError to name kernel 'fail_code'",
              repr(str(exc)))
    else:
        check(False, "launch.failure_code", "launch() of 'fail_code' to raise KernelError", "it returned")
    prepared = kit.prepare(kernel, [xs.ptr, ys.ptr], [n], None, memory.stream)
    code = prepared.call()
    check(code == 7, "launch.failure_code", "a prepared call to return the kernel's code 7", code)
    try:
        prepared.fail(code)
    except KernelError as exc:
        check("fail_code" in str(exc) and "7" in str(exc), "launch.failure_code",
              "fail(7) to raise a KernelError naming the kernel and the code", repr(str(exc)))
    else:
        check(False, "launch.failure_code", "fail(7) to raise KernelError", "it returned")
