"""Reading a shared object's dynamic section: the libraries it needs, its soname, its search paths.

The loader uses this to see, before ``dlopen``, which libraries a kernel links (``DT_NEEDED``), so
that a library shipped in a wheel can be opened first by its absolute path; glibc then resolves
the kernel's ``DT_NEEDED`` entry by the soname of the library already loaded, and no search path
(``DT_RPATH``/``DT_RUNPATH``, which would point into one machine's site-packages) is needed.

Only what that needs is read: the ``PT_DYNAMIC`` segment, and the string table it points to
(located through the ``PT_LOAD`` segment that maps its address). The caller has already checked
the header and the segments' extents (``host.check_elf_header``); a malformed dynamic section is
still refused here with a ``KernelError`` rather than an ``IndexError``.
"""

from __future__ import annotations

import struct

import attrs

from engine.errors import KernelError

__all__ = ["DynamicInfo", "read_dynamic"]

_PT_LOAD = 1
_PT_DYNAMIC = 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ, _DT_SONAME, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 10, 14, 15, 29


@attrs.frozen
class DynamicInfo:
    """What a shared object's dynamic section says about linking."""

    needed: tuple[str, ...] = ()
    soname: str | None = None
    rpath: str | None = None
    runpath: str | None = None


def read_dynamic(data: bytes | memoryview, where: str = "shared object") -> DynamicInfo:
    """The ``DT_NEEDED``, ``DT_SONAME``, ``DT_RPATH`` and ``DT_RUNPATH`` entries of an ELF file."""
    data = bytes(data) if isinstance(data, memoryview) else data
    try:
        return _read(data)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
        raise KernelError(f"{where}: cannot read the ELF dynamic section ({exc}); "
                          "the binary is truncated or corrupt") from exc


def _read(data: bytes) -> DynamicInfo:
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    wide = data[4] == 2
    endian = "<" if data[5] == 1 else ">"
    if wide:
        e_phoff, = struct.unpack_from(endian + "Q", data, 32)
        e_phentsize, e_phnum = struct.unpack_from(endian + "HH", data, 54)
        ph_format, dyn_format = endian + "IIQQQQQQ", endian + "qQ"
    else:
        e_phoff, = struct.unpack_from(endian + "I", data, 28)
        e_phentsize, e_phnum = struct.unpack_from(endian + "HH", data, 42)
        ph_format, dyn_format = endian + "IIIIIIII", endian + "iI"
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None  # (offset, filesz)
    for i in range(e_phnum):
        entry = struct.unpack_from(ph_format, data, e_phoff + i * e_phentsize)
        # ELF64: type, flags, offset, vaddr, paddr, filesz, ...; ELF32: type, offset, vaddr, paddr, filesz, ...
        p_type = entry[0]
        offset, vaddr, filesz = (entry[2], entry[3], entry[5]) if wide else (entry[1], entry[2], entry[4])
        if p_type == _PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (offset, filesz)
    if dynamic is None:
        return DynamicInfo()
    entries: list[tuple[int, int]] = []
    size = struct.calcsize(dyn_format)
    start, length = dynamic
    for pos in range(start, start + length - size + 1, size):
        tag, value = struct.unpack_from(dyn_format, data, pos)
        if tag == _DT_NULL:
            break
        entries.append((tag, value))
    strtab = next((v for t, v in entries if t == _DT_STRTAB), None)
    if strtab is None:
        return DynamicInfo()
    table_offset = _file_offset(strtab, loads)
    table_size = next((v for t, v in entries if t == _DT_STRSZ), len(data) - table_offset)
    table = data[table_offset:table_offset + table_size]

    def string(index: int) -> str:
        end = table.index(b"\0", index)
        return table[index:end].decode("utf-8")

    def first(tag: int) -> str | None:
        return next((string(v) for t, v in entries if t == tag), None)

    return DynamicInfo(needed=tuple(string(v) for t, v in entries if t == _DT_NEEDED), soname=first(_DT_SONAME),
                       rpath=first(_DT_RPATH), runpath=first(_DT_RUNPATH))


def _file_offset(address: int, loads: list[tuple[int, int, int]]) -> int:
    for vaddr, offset, filesz in loads:
        if vaddr <= address < vaddr + filesz:
            return offset + (address - vaddr)
    raise ValueError(f"address {address:#x} is in no loadable segment")
