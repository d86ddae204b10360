"""Registration, declared attributes and availability: what the registry and ``engine devices`` read."""

from __future__ import annotations

import pytest

from engine.backend import API_VERSION, Availability, ReferenceKernel
from engine.device import KIND_PATTERN, Device
from engine.plugins import RESERVED_SLOTS, devices
from engine.testing.checks import check
from engine.testing.reference import REFERENCE_KERNELS

conformance = pytest.mark.conformance


@conformance("plugin.registered")
def test_registered(registry, declared_backend):
    kind = declared_backend.kind
    rows = [row for row in devices(registry) if row.kind == kind]
    check(len(rows) == 1, "plugin.registered", f"one engine.devices() row for kind {kind!r}",
          lambda: "; ".join(f"{row.distribution}: {row.reason}" for row in rows) or "none")
    row = rows[0]
    check((row.api_version, row.workspace_slot) == (declared_backend.api_version, declared_backend.workspace_slot),
          "plugin.registered", f"the row to show api {declared_backend.api_version} and slot "
          f"{declared_backend.workspace_slot}", f"api {row.api_version}, slot {row.workspace_slot}")


@conformance("attributes.kind")
def test_kind(declared_backend):
    kind = declared_backend.kind
    check(isinstance(kind, str) and KIND_PATTERN.match(kind), "attributes.kind",
          "a lowercase identifier matching [a-z][a-z0-9_]*", repr(kind))


@conformance("attributes.workspace_slot")
def test_workspace_slot(declared_backend):
    kind, slot = declared_backend.kind, declared_backend.workspace_slot
    check(isinstance(slot, int) and not isinstance(slot, bool), "attributes.workspace_slot", "an int", repr(slot))
    reserved = RESERVED_SLOTS.get(kind)
    if reserved is not None:
        check(slot == reserved, "attributes.workspace_slot", f"the reserved slot {reserved} of kind {kind!r}", slot)
    else:
        check(slot >= 3 and slot not in RESERVED_SLOTS.values(), "attributes.workspace_slot",
              f"a third-party slot >= 3 outside the reserved ones {dict(RESERVED_SLOTS)}", slot)


@conformance("attributes.api_version")
def test_api_version(declared_backend):
    version = declared_backend.api_version
    check(isinstance(version, tuple) and len(version) == 2 and all(type(v) is int for v in version),
          "attributes.api_version", "a tuple of two ints", repr(version))
    check(version[0] == API_VERSION[0], "attributes.api_version", f"major version {API_VERSION[0]}", repr(version))


@conformance("attributes.formats")
def test_formats_and_languages(declared_backend):
    formats, languages = declared_backend.formats, declared_backend.languages
    check(isinstance(formats, tuple) and formats and all(isinstance(f, str) and f for f in formats),
          "attributes.formats", "formats to be a non-empty tuple of non-empty strings", repr(formats))
    check(isinstance(languages, tuple) and all(isinstance(lang, str) and lang for lang in languages),
          "attributes.formats", "languages to be a tuple of non-empty strings", repr(languages))


@conformance("attributes.alignment")
def test_alignment(declared_backend):
    a = declared_backend.alignment
    check(type(a) is int and a >= 1 and a & (a - 1) == 0, "attributes.alignment", "a power of two", repr(a))


@conformance("attributes.flags")
def test_flags(declared_backend):
    b = declared_backend
    for name in ("host_accessible", "has_streams"):
        value = getattr(b, name)
        check(type(value) is bool, "attributes.flags", f"{name} to be a bool", repr(value))
    code = b.dlpack_device_type
    check(type(code) is int and code >= 0, "attributes.flags", "dlpack_device_type to be an int >= 0", repr(code))


@conformance("availability.report")
def test_availability(declared_backend):
    try:
        avail = declared_backend.availability()
    except Exception as exc:  # noqa: BLE001 - the finding itself
        check(False, "availability.report", "availability() to return, not raise", f"{type(exc).__name__}: {exc}")
    check(isinstance(avail, Availability), "availability.report", "an engine.backend.Availability",
          type(avail).__name__)
    if avail.available:
        check(type(avail.device_count) is int and avail.device_count >= 1, "availability.report",
              "device_count >= 1 when available", avail.device_count)
        names = avail.device_names
        check(len(names) == avail.device_count and all(isinstance(n, str) and n for n in names),
              "availability.report", f"{avail.device_count} non-empty device names", repr(names))
    else:
        check(isinstance(avail.reason, str) and avail.reason.strip(), "availability.report",
              "a reason a user can act on when unavailable", repr(avail.reason))
    count = declared_backend.device_count()
    check(count == avail.device_count, "availability.report",
          f"device_count() == availability().device_count ({avail.device_count})", count)


@conformance("availability.device")
def test_device_names(backend):
    for i in range(backend.device_count()):
        dev = backend.device(i)
        check(dev == Device(backend.kind, i), "availability.device", f"device({i}) == Device({backend.kind!r}, {i})",
              repr(dev))


@conformance("kernel.reference_names")
def test_reference_kernel_table(declared_backend):
    try:
        refs = dict(declared_backend.reference_kernels())
    except Exception as exc:  # noqa: BLE001 - the finding itself
        check(False, "kernel.reference_names", "reference_kernels() to return a mapping",
              f"{type(exc).__name__}: {exc}")
    unknown = sorted(set(refs) - set(REFERENCE_KERNELS))
    check(not unknown, "kernel.reference_names", f"names among {sorted(REFERENCE_KERNELS)}", unknown)
    for name, ref in refs.items():
        check(isinstance(ref, ReferenceKernel), "kernel.reference_names", f"{name!r} to be a ReferenceKernel",
              type(ref).__name__)
        check(ref.entries and all(isinstance(e, str) and e for e in ref.entries), "kernel.reference_names",
              f"{name!r} to list at least one entry", repr(ref.entries))
        check(ref.language in declared_backend.languages, "kernel.reference_names",
              f"{name!r}'s language to be one of languages {declared_backend.languages}", repr(ref.language))
        launch = ref.launch
        check(launch is None or ("grid" in launch and "block" in launch and len(launch["grid"]) == 3
                                 and len(launch["block"]) == 3), "kernel.reference_names",
              f"{name!r}'s launch to be None or a dict with 3 grid and 3 block expressions", repr(launch))
