"""Facts about the machine we run on: its target name, its CPU's name, and whether an ELF fits it.

Bundles name CPU binaries by a target string such as ``"x86_64-linux"``; this module is the one
place that spells the local one, so the loader's refusals and the compiler's payloads agree.
"""

from __future__ import annotations

import os
import platform
import struct
import sys

from engine.errors import KernelError

__all__ = ["host_target", "cpu_description", "check_elf_header", "ELF_MACHINES"]

# platform.machine() spells the same ISA differently per OS (Windows/BSD "amd64", macOS "arm64").
_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "i686": "i386", "i586": "i386"}

#: ELF ``e_machine`` values for the ISAs we can name (from the System V ABI / elf.h).
ELF_MACHINES = {
    3: "i386",
    20: "ppc",
    21: "ppc64le",  # EM_PPC64; the byte order is checked separately
    22: "s390x",
    40: "arm",
    62: "x86_64",
    183: "aarch64",
    243: "riscv64",
    258: "loongarch64",
}

_ELF_MAGIC = b"\x7fELF"
_ET_DYN = 3
_PT_LOAD = 1
_PT_DYNAMIC = 2


def _normalised_machine(machine: str | None = None) -> str:
    name = (machine if machine is not None else platform.machine()).lower()
    return _MACHINE_ALIASES.get(name, name)


def _os_name() -> str:
    if sys.platform.startswith("linux"):
        return "linux"
    if sys.platform == "win32":
        return "windows"
    return sys.platform


def host_target() -> str:
    """This machine's CPU target, e.g. ``"x86_64-linux"`` or ``"aarch64-linux"``."""
    return f"{_normalised_machine()}-{_os_name()}"


def cpu_description() -> str:
    """A human-readable CPU name with its logical core count, for ``engine devices``."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                # x86 says "model name"; some ARM kernels only give "Hardware" or "CPU part".
                if key.strip() in ("model name", "Hardware", "cpu model") and value.strip():
                    model = value.strip()
                    break
    except OSError:
        pass
    if not model:
        model = platform.processor() or _normalised_machine()
    count = os.cpu_count() or 1
    return f"{model} ({count} cores)"


def _pointer_class() -> int:
    return 2 if struct.calcsize("P") == 8 else 1  # ELFCLASS64 / ELFCLASS32


def check_elf_header(data: bytes | memoryview, where: str) -> None:
    """Raise ``KernelError`` unless ``data`` starts like a shared object this process can load.

    dlopen on a foreign or truncated file fails with a terse message (or, for a hostile file,
    worse); checking magic, class, byte order, type and machine first gives an error that says
    which binary is wrong and how.
    """
    header = bytes(data[:64])
    if len(header) < 64 or header[:4] != _ELF_MAGIC:
        raise KernelError(f"{where}: not an ELF shared object (bad magic {header[:4]!r}, "
                          f"{len(data)} bytes); the bundle's binary is corrupt or mislabelled")
    elf_class, elf_data = header[4], header[5]
    if elf_class != _pointer_class():
        bits = {1: "32-bit", 2: "64-bit"}.get(elf_class, f"class {elf_class}")
        raise KernelError(f"{where}: a {bits} ELF cannot be loaded by this "
                          f"{8 * struct.calcsize('P')}-bit process")
    order = {1: "little", 2: "big"}.get(elf_data)
    if order != sys.byteorder:
        raise KernelError(f"{where}: ELF byte order is {order or elf_data!r}, "
                          f"this machine is {sys.byteorder}-endian")
    fmt = "<HH" if order == "little" else ">HH"
    e_type, e_machine = struct.unpack_from(fmt, header, 16)
    if e_type != _ET_DYN:
        raise KernelError(f"{where}: ELF type {e_type} is not a shared object (ET_DYN); "
                          "compile the kernel with -shared -fPIC")
    machine = ELF_MACHINES.get(e_machine, f"machine {e_machine}")
    if machine == "ppc64le" and order == "big":
        machine = "ppc64"
    if machine != _normalised_machine():
        raise KernelError(f"{where}: ELF is built for {machine}, this machine is {host_target()}; "
                          "rebuild the bundle or ship a c-source binary")
    _check_extents(data, header, elf_class, "<" if order == "little" else ">", where)


def _check_extents(data: bytes | memoryview, header: bytes, elf_class: int, endian: str, where: str) -> None:
    """Refuse a truncated ELF before dlopen maps it.

    dlopen maps segments straight from the file; a segment that runs past the end of a truncated
    file is mapped anyway and the first touch of it kills the process with SIGBUS. Checking that
    the header tables and every loadable segment lie inside the bytes turns that into an error.
    """
    wide = elf_class == 2
    fields = struct.unpack_from(endian + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH"), header, 16)
    e_phoff, e_shoff = fields[4], fields[5]
    e_phentsize, e_phnum, e_shentsize, e_shnum = fields[8], fields[9], fields[10], fields[11]
    size = len(data)
    ph_format = endian + ("IIQQQQQQ" if wide else "IIIIIIII")
    if e_phnum == 0 or e_phentsize < struct.calcsize(ph_format) or e_phoff + e_phnum * e_phentsize > size:
        raise KernelError(f"{where}: ELF program headers are missing or lie past the end of the "
                          f"{size}-byte file; the binary is truncated or corrupt")
    if e_shnum and e_shoff + e_shnum * e_shentsize > size:
        raise KernelError(f"{where}: ELF section headers lie past the end of the {size}-byte file; "
                          "the binary is truncated or corrupt")
    table = bytes(data[e_phoff:e_phoff + e_phnum * e_phentsize])
    types = set()
    for i in range(e_phnum):
        entry = struct.unpack_from(ph_format, table, i * e_phentsize)
        p_type = entry[0]
        # ELF64: type, flags, offset, vaddr, paddr, filesz, ...; ELF32: type, offset, vaddr, paddr, filesz, ...
        p_offset, p_filesz = (entry[2], entry[5]) if wide else (entry[1], entry[4])
        types.add(p_type)
        if p_type == _PT_LOAD and p_offset + p_filesz > size:
            raise KernelError(f"{where}: ELF segment {i} needs bytes {p_offset}..{p_offset + p_filesz} "
                              f"but the file has {size}; the binary is truncated or corrupt")
    if _PT_LOAD not in types or _PT_DYNAMIC not in types:
        raise KernelError(f"{where}: ELF has no loadable dynamic segments; not a shared object")
