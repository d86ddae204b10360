"""Which HIP binaries load on which device, and what an AMDGPU code object says it is for.

The rule (bundle format §13): an ``hsaco`` for the device's gfx target, else the source. Precisely:

* ``hsaco`` for ``gfxNNN`` runs only on a ``gfxNNN`` device (AMD code objects are not portable
  between gfx targets, unlike CUDA's minor versions); a target with features
  (``gfx90a:xnack+``) also needs the device's setting of each named feature, and a feature the
  target leaves out runs either way;
* ``hip-source`` is compiled at load with hiprtc for the device's own target
  (``compiler.HipCompiler``, cached by content, target and compiler version).

``code_object_target`` reads an ELF code object the way the loader would (``e_machine`` 224,
``EM_AMDGPU``; the target from the ``NT_AMDGPU_METADATA`` note, else from ``e_flags``), so the
compile tests and ``compile()`` itself can check what hiprtc produced.
"""

from __future__ import annotations

import re
import struct

__all__ = ["EM_AMDGPU", "GFX_MACH", "parse_target", "hsaco_refusal", "code_object_target", "CodeObject"]

EM_AMDGPU = 224
#: ``EF_AMDGPU_MACH`` values (the low byte of ``e_flags``) of the targets this plugin names.
GFX_MACH = {
    0x2C: "gfx900", 0x2F: "gfx906", 0x30: "gfx908", 0x3F: "gfx90a", 0x40: "gfx940", 0x4B: "gfx941",
    0x4C: "gfx942", 0x4F: "gfx950", 0x36: "gfx1030", 0x41: "gfx1100", 0x46: "gfx1101", 0x47: "gfx1102",
    0x48: "gfx1200", 0x4E: "gfx1201",
}
_TARGET = re.compile(r"(gfx[0-9]{2,3}[0-9a-f])((?::[a-z]+[+-])*)")
_NOTE_TARGET = re.compile(rb"amdgcn-amd-amdhsa--(gfx[0-9]{2,3}[0-9a-f](?::[a-z]+[+-])*)")


def parse_target(target: str) -> tuple[str, dict[str, str]] | None:
    """``"gfx90a:xnack+"`` → ``("gfx90a", {"xnack": "+"})``; None when not a gfx target."""
    m = _TARGET.fullmatch(target.strip())
    if m is None:
        return None
    features = {f[:-1]: f[-1] for f in m.group(2).split(":") if f}
    return m.group(1), features


def hsaco_refusal(target: str, device_arch: str) -> str | None:
    """Why an hsaco for ``target`` cannot run on a device whose ``gcnArchName`` is ``device_arch``."""
    wanted = parse_target(target)
    if wanted is None:
        return f"hsaco target {target!r} is not of the form gfx<NNN>[:feature±]"
    have = parse_target(device_arch) or (device_arch.split(":")[0], {})
    if wanted[0] != have[0]:
        return f"hsaco for {wanted[0]}, device is {have[0]}"
    for feature, setting in wanted[1].items():
        if have[1].get(feature, setting) != setting:
            return f"hsaco for {target} needs {feature}{setting}, device is {device_arch}"
    return None


class CodeObject:
    """What an AMDGPU ELF code object declares: ``machine`` (``e_machine``), ``mach`` (the gfx name
    from ``e_flags``, or None for an unknown value) and ``target`` (from its metadata note)."""

    def __init__(self, machine: int, flags: int, note_target: str | None):
        self.machine, self.flags, self.note_target = machine, flags, note_target
        self.mach = GFX_MACH.get(flags & 0xFF)

    @property
    def target(self) -> str | None:
        """The gfx target with features from the note, else the ``e_flags`` machine."""
        return self.note_target or self.mach


def code_object_target(data: bytes) -> CodeObject:
    """Parse an ELF64 little-endian code object's header and notes; ``ValueError`` if not ELF64."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    machine, = struct.unpack_from("<H", data, 18)
    flags, = struct.unpack_from("<I", data, 48)
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    note_target = None
    for i in range(shnum):
        base = shoff + i * shentsize
        if base + 64 > len(data):
            break
        sh_type, = struct.unpack_from("<I", data, base + 4)
        if sh_type != 7:  # SHT_NOTE
            continue
        offset, size = struct.unpack_from("<QQ", data, base + 24)
        m = _NOTE_TARGET.search(data[offset:offset + size])
        if m:
            note_target = m.group(1).decode()
            break
    return CodeObject(machine, flags, note_target)
