"""The conformance rules: one table that the suite, the docs and the project's tests all read.

Every check of ``engine.testing`` is named by a rule id (``copy.host_roundtrip``). A suite test
declares the rules it checks with ``@pytest.mark.conformance(...)``, every assertion message starts
with ``rule <id>:``, and ``docs/conformance.md`` shows this table (``python -m engine.testing
--rules`` prints it). A vendor who sees a failure looks the id up here or there.

``capability`` names what a backend must offer for the rule to apply; without it the test is
skipped with ``capability <name>: <why>`` (``CAPABILITIES`` says what each name means). Rules
with capability ``None`` apply to every registered backend, even an unavailable one.
"""

from __future__ import annotations

from typing import Mapping

import attrs

__all__ = ["Rule", "RULES", "CAPABILITIES", "rule", "rules_markdown", "capabilities_markdown"]


@attrs.frozen
class Rule:
    """One checked property of a backend."""

    id: str
    checks: str
    capability: str | None = "device"


#: What each capability name in skip messages and in ``Rule.capability`` means.
CAPABILITIES: Mapping[str, str] = {
    "device": "availability() says the kind is available with at least one device (the device index "
              "the suite runs on must exist)",
    "compile": "compile(source, language, options) builds the backend's own reference kernels "
               "(it does not raise Unsupported)",
    "reference.add": "reference_kernels() has 'add'",
    "reference.scale_ws": "reference_kernels() has 'scale_ws'",
    "reference.busy": "reference_kernels() has 'busy'",
    "reference.fail_code": "reference_kernels() has 'fail_code' (kernels that return a code)",
    "reference.mlp": "reference_kernels() has every `mlp_*` kernel of the demo model",
    "second_stream": "a second thread's current_stream() differs from the first thread's",
    "fuse": "fuse() returns a FusedLaunch for launches of this backend (not None)",
    "capture": "capture() records a run (does not raise Unsupported)",
    "dlpack": "engine tensors of this kind export through `__dlpack__` (`export_pointer` accepts the "
              "backend's pointers)",
}

RULES: tuple[Rule, ...] = (
    # -- registration and declared data ------------------------------------------------------------
    Rule("plugin.registered", "the kind is in the registry: its plugin loaded and the registry accepted the "
         "backend (kind, workspace slot, API major); a refusal is shown with the registry's cause", None),
    Rule("attributes.kind", "kind is a lowercase identifier (`[a-z][a-z0-9_]*`)", None),
    Rule("attributes.workspace_slot", "workspace_slot is an int: the reserved slot of a first-party kind "
         "(engine.plugins.RESERVED_SLOTS), else >= 3 and not reserved", None),
    Rule("attributes.api_version", "api_version is a tuple of two ints whose major is the engine's (2)", None),
    Rule("attributes.formats", "formats is a non-empty tuple of non-empty strings; languages a tuple of "
         "non-empty strings", None),
    Rule("attributes.alignment", "alignment is an int and a power of two", None),
    Rule("attributes.flags", "host_accessible and has_streams are bools, dlpack_device_type an int >= 0", None),
    Rule("availability.report", "availability() returns an Availability without raising: available with "
         "device_count >= 1 and one non-empty name per device, or unavailable with a reason; device_count() "
         "agrees", None),
    Rule("availability.device", "device(i) is Device(kind, i) for every device index"),
    Rule("kernel.reference_names", "reference_kernels() maps documented names to ReferenceKernel objects with "
         "at least one entry, a language in `languages` and a launch dict or None", None),
    # -- memory --------------------------------------------------------------------------------------
    Rule("allocation.sizes", "allocate(n) for n = 0, 1, 4097 and 64 MiB returns a Storage of n bytes on "
         "Device(kind, index)"),
    Rule("allocation.alignment", "every allocation's pointer is aligned: int pointers ptr % alignment == 0, "
         "BufferPtr offset % alignment == 0"),
    Rule("allocation.distinct", "live allocations never overlap"),
    Rule("allocation.extent", "the first and last byte of every allocation (64 MiB included) can be written "
         "and read back"),
    Rule("allocation.host_view", "host_accessible backends give int pointers and a host_view of nbytes bytes "
         "over the same memory; other backends give no host_view"),
    Rule("allocation.prepared", "prepare_allocation(n) returns a factory of fresh, distinct, aligned "
         "n-byte storages"),
    Rule("allocation.release", "Storage.close() releases once (a second close is harmless) and memory can be "
         "allocated again afterwards"),
    Rule("allocation.max", "max_allocation(index) is None or a positive int"),
    Rule("pointer.arithmetic", "ptr + n is a pointer of the same kind, (ptr + a) + b == ptr + (a + b), "
         "ptr + 0 == ptr, and bytes written through ptr + k are read back at offset k of ptr"),
    Rule("copy.host_roundtrip", "host -> device -> host at device offsets 0, 1, 3, 7 and sizes 1, 13, 4099 "
         "gives back exactly the bytes written"),
    Rule("copy.host_to_device_bounds", "copy_from_host writes exactly its range: device bytes before and "
         "after it are untouched"),
    Rule("copy.device_to_host_bounds", "copy_to_host writes exactly its range: host bytes before and after "
         "it are untouched"),
    Rule("copy.device_to_device", "copy_device between odd source and destination offsets (1, 3, 7) and "
         "sizes (1, 13, 4099) copies exactly, neighbours untouched"),
    Rule("copy.zero_bytes", "copies and memset of 0 bytes change nothing"),
    Rule("memset.value", "memset(ptr + offset, value, n) sets exactly n bytes to value (0, 0xA5, 0xFF) at odd "
         "offsets and sizes, neighbours untouched"),
    # -- streams, events, timing ---------------------------------------------------------------------
    Rule("stream.current", "current_stream(index) is hashable and equal on two calls in one thread"),
    Rule("stream.synchronize", "after synchronize(index, stream) and synchronize(index) the queued work is "
         "done (a 64 MiB copy's result is visible)"),
    Rule("event.unrecorded", "an event never recorded counts as complete: query() is True, synchronize() "
         "returns"),
    Rule("event.completes", "after record(stream) and synchronize(), query() is True and the work queued "
         "before the record is done"),
    Rule("event.orders_streams", "work queued on a second stream after wait(event) sees the work recorded on "
         "the first stream", "second_stream"),
    Rule("event.elapsed", "elapsed_ms between two recorded, completed events is finite and >= 0"),
    Rule("timing.samples", "time(run_busy, stream=...) returns `repeat` samples, all finite and > 0",
         "reference.busy"),
    # -- kernels -------------------------------------------------------------------------------------
    Rule("kernel.reference_load", "every reference kernel compiles and every entry loads: kernel.spec is the "
         "spec and kernel.binary one of its binaries", "compile"),
    Rule("kernel.skip_unknown_format", "a binary of an unknown format listed before a good one is skipped; "
         "the good one is loaded", "compile"),
    Rule("kernel.no_loadable_binary", "a candidate with only unusable binaries raises KernelError naming the "
         "kernel and listing each binary (path, format) with a reason"),
    Rule("kernel.corrupt_binary", "corrupt bytes in one of the backend's own formats raise KernelError naming "
         "the kernel (never another exception or a crash)", "compile"),
    Rule("launch.symbols", "'add' launched at n = 1, 1000, 4097 computes x + y exactly, bytes after n "
         "untouched", "reference.add"),
    Rule("launch.workspace", "'scale_ws' receives its workspace: ws = 2x and y = 2x + 1",
         "reference.scale_ws"),
    Rule("launch.prepared_set_tensor", "a prepared launch called, then re-pointed with set_tensor to new "
         "buffers and called again, reads and writes the new buffers", "reference.add"),
    Rule("launch.failure_code", "'fail_code' makes launch() raise KernelError naming the kernel; a prepared "
         "call returns the code and fail(code) raises KernelError", "reference.fail_code"),
    Rule("fusion.equals_eager", "a FusedLaunch of prepared launches returns 0 and gives the results of "
         "calling them one by one", "fuse"),
    Rule("fusion.failure_position", "a FusedLaunch whose second launch fails returns 2 and code() gives that "
         "launch's code", "fuse"),
    Rule("capture.replay", "a captured run, replayed after new inputs are written to its static buffers, "
         "gives the eager results", "capture"),
    Rule("isolation.threads", "8 threads, each on its own current_stream with its own buffers and workspace, "
         "running 'scale_ws' and 'add' many times, all get correct results", "reference.scale_ws"),
    # -- graphs, tensors -----------------------------------------------------------------------------
    Rule("graph.demo_model", "the demo MLP built from the `mlp_*` reference kernels with GraphBuilder, "
         "loaded with load_compiled_graph, equals engine.demo.mlp.reference_mlp at batch 1, 3 and 64 "
         "(rtol 1e-4, atol 1e-5)", "reference.mlp"),
    Rule("graph.threads", "the demo graph run from 8 threads at once gives every thread its own correct "
         "result", "reference.mlp"),
    Rule("graph.capture", "graph.capture(x) replayed on new inputs equals run_async on them", "reference.mlp"),
    Rule("dlpack.roundtrip", "an engine tensor of this kind exported with `__dlpack__` and imported with "
         "`engine.from_dlpack` is on the same device with the same bytes", "dlpack"),
)

_BY_ID = {r.id: r for r in RULES}


def rule(rule_id: str) -> Rule:
    """The rule with this id; ``KeyError`` naming the known ids otherwise."""
    try:
        return _BY_ID[rule_id]
    except KeyError:
        raise KeyError(f"unknown conformance rule {rule_id!r}; known rules: {', '.join(_BY_ID)}") from None


def rules_markdown() -> str:
    """The rule table as Markdown (what ``docs/conformance.md`` shows)."""
    lines = ["| rule | what it checks | capability needed |", "|---|---|---|"]
    for r in RULES:
        cap = f"`{r.capability}`" if r.capability else "none (every registered backend)"
        lines.append(f"| `{r.id}` | {r.checks} | {cap} |")
    return "\n".join(lines) + "\n"


def capabilities_markdown() -> str:
    """The capability table as Markdown."""
    lines = ["| capability | the backend offers it when |", "|---|---|"]
    lines += [f"| `{name}` | {what} |" for name, what in CAPABILITIES.items()]
    return "\n".join(lines) + "\n"
