"""Libraries shipped in wheels that CPU kernels may link: where each is on this machine, found lazily.

A kernel that calls a library (a BLAS routine, say) must find it at load, on a machine other than
the one that built the bundle. Linking it by an absolute path with an ``rpath`` into one machine's
site-packages would not work elsewhere, and the bundle's ``c-source`` fallback is compiled at
load, where nobody passes ``-l`` flags. So a kernel names a library by a **provider name**
(compile option ``link``, and the source line ``// engine-cpu: link NAME``), and a
``LibraryProvider`` says where that library is on the machine at hand:

* at compile time the compiler adds ``-I<include_dir>`` and links the file by its absolute path
  without any ``rpath``/``runpath``, so the kernel's ``DT_NEEDED`` is the library's soname only;
  the cache key holds the library's identity (soname and version), not its path;
* at load the loader reads the kernel's ``DT_NEEDED`` (``engine_cpu.elf``) and, for each soname a
  provider serves, opens the provider's file first; the dynamic loader then resolves the kernel's
  dependency by that already-loaded soname (also when the kernel is opened from memory).

Providers: the ``scipy-openblas32``/``scipy-openblas64`` wheels are built in (their modules'
``get_include_dir()``/``get_lib_dir()``/``get_library()`` convention). Other distributions add
theirs through the entry-point group ``engine_cpu.libraries``: each entry point's object is a
``LibraryProvider`` (``name``, ``sonames``, ``install_hint``, ``locate()``). Entry points are read
once, when a name or soname is not served by the providers known so far (the loader asks them
only after a kernel failed to open, since the scan of every installed distribution is too slow
for every first load), and only their module is imported; a provider's own module (the wheel
with the library) is imported only when a kernel needs it.
"""

from __future__ import annotations

import importlib
import re
import threading
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

import attrs

from engine.backend import CandidateUnavailable
from engine.errors import KernelError
from engine.log import get_logger

from engine_cpu.elf import read_dynamic

__all__ = [
    "ENTRY_POINT_GROUP",
    "LinkedLibrary",
    "LibraryProvider",
    "WheelConventionProvider",
    "LibraryRegistry",
    "LibraryUnavailableError",
    "UnknownLibraryError",
    "BUILTIN_PROVIDERS",
    "link_directives",
]

#: The entry-point group other distributions register library providers in.
ENTRY_POINT_GROUP = "engine_cpu.libraries"

log = get_logger("engine.cpu.libraries")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_DIRECTIVE = re.compile(r"^[ \t]*//[ \t]*engine-cpu:[ \t]*link[ \t]+([^\n]*)$", re.MULTILINE)


@attrs.frozen
class LinkedLibrary:
    """One provider's library as found on this machine.

    ``path`` is where the file is here (used to link and to open it, never recorded in a kernel);
    ``soname`` and ``version`` are its identity (``identity``, part of compile cache keys).
    """

    name: str
    soname: str
    path: Path = attrs.field(converter=Path)
    include_dir: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    version: str = ""

    @property
    def identity(self) -> str:
        return f"{self.name}:{self.soname}:{self.version}"


class LibraryUnavailableError(CandidateUnavailable):
    """A kernel (or a compile) needs a library whose provider cannot locate it on this machine.

    A ``CandidateUnavailable``: a bundle still loads and runs its kernels' other candidates.

    ``library`` is the provider name, ``soname`` the library's soname, ``reason`` why it is not
    available, ``install_hint`` how to get it, ``where`` the kernel candidate and binary (or the
    compile) that needs it.
    """

    def __init__(self, where: str, library: str, soname: str, reason: str, install_hint: str):
        super().__init__(f"{where}: needs the library {library!r} ({soname}), which is not available here "
                         f"({reason}); {install_hint}")
        self.where = where
        self.library = library
        self.soname = soname
        self.reason = reason
        self.install_hint = install_hint


class UnknownLibraryError(KernelError, ValueError):
    """A ``link`` option or directive names no known provider; ``name`` and ``known`` say which."""

    def __init__(self, name: str, known: Iterable[str], where: str = "cpu compile option 'link'"):
        super().__init__(f"{where}: unknown library {name!r}; known libraries: {sorted(known)} "
                         f"(other distributions add theirs in the entry-point group {ENTRY_POINT_GROUP!r})")
        self.name = name
        self.known = tuple(sorted(known))


@runtime_checkable
class LibraryProvider(Protocol):
    """Says where one library is on this machine.

    ``sonames`` lists the sonames the library is linked as (a kernel's ``DT_NEEDED`` entries are
    matched against them without importing anything); ``install_hint`` is what the user should
    do when ``locate`` fails (``"pip install scipy-openblas32"``). ``locate`` raises
    ``ImportError``, ``LookupError`` or ``OSError`` with the reason when the library is not
    installed.
    """

    @property
    def name(self) -> str: ...

    @property
    def sonames(self) -> tuple[str, ...]: ...

    @property
    def install_hint(self) -> str: ...

    def locate(self) -> LinkedLibrary: ...


@attrs.frozen
class WheelConventionProvider:
    """A library shipped in a wheel whose module has ``get_include_dir()``, ``get_lib_dir()`` and
    ``get_library()`` (the scipy-openblas wheels' convention); its version is the distribution's."""

    name: str
    module: str
    distribution: str
    sonames: tuple[str, ...]
    install_hint: str = ""

    def locate(self) -> LinkedLibrary:
        mod = importlib.import_module(self.module)  # ImportError when the wheel is not installed
        lib_dir = Path(mod.get_lib_dir())
        stem = mod.get_library()
        candidates = sorted(lib_dir.glob(f"lib{stem}.so*")) or sorted(lib_dir.glob(f"lib{stem}.dylib"))
        if not candidates:
            raise LookupError(f"{self.module}.get_lib_dir() ({lib_dir}) holds no lib{stem}.so")
        path = candidates[0]
        soname = read_dynamic(path.read_bytes(), str(path)).soname or path.name
        version = str(getattr(mod, "__version__", "") or "")
        if not version:
            from importlib.metadata import PackageNotFoundError, version as dist_version
            try:
                version = dist_version(self.distribution)
            except PackageNotFoundError:
                version = ""
        return LinkedLibrary(self.name, soname, path, Path(mod.get_include_dir()), version)


#: Providers known without any entry point.
BUILTIN_PROVIDERS: tuple[LibraryProvider, ...] = (
    WheelConventionProvider("scipy_openblas32", "scipy_openblas32", "scipy-openblas32",
                            ("libscipy_openblas.so",), "pip install scipy-openblas32"),
    WheelConventionProvider("scipy_openblas64", "scipy_openblas64", "scipy-openblas64",
                            ("libscipy_openblas64_.so",), "pip install scipy-openblas64"),
)


def link_directives(source: str) -> tuple[str, ...]:
    """The library names of a source's ``// engine-cpu: link NAME[, NAME…]`` lines, in order."""
    names: list[str] = []
    for match in _DIRECTIVE.finditer(source):
        for name in re.split(r"[\s,]+", match.group(1).strip()):
            if name and name not in names:
                names.append(name)
    return tuple(names)


class LibraryRegistry:
    """Providers by name (built-ins, then entry points, then ``register``) and the libraries they
    located, each located once per registry (a failed lookup is retried: the wheel may be
    installed meanwhile)."""

    def __init__(self, providers: Iterable[LibraryProvider] = BUILTIN_PROVIDERS, *, entry_points: bool = True):
        self._providers: dict[str, LibraryProvider] = {}
        self._located: dict[str, LinkedLibrary] = {}
        self._lock = threading.RLock()
        self._entry_points_read = not entry_points
        for provider in providers:
            self.register(provider)

    def register(self, provider: LibraryProvider, *, replace: bool = False) -> None:
        """Add a provider (``replace=True`` lets it take over a name already registered)."""
        if not isinstance(provider, LibraryProvider):
            raise TypeError(f"a library provider needs name, sonames, install_hint and locate(); got {provider!r}")
        if not _NAME.fullmatch(provider.name):
            raise ValueError(f"library provider name {provider.name!r} is not a plain name")
        with self._lock:
            if provider.name in self._providers and not replace:
                raise ValueError(f"a library provider named {provider.name!r} is already registered")
            self._providers[provider.name] = provider
            self._located.pop(provider.name, None)

    def _read_entry_points(self) -> None:
        with self._lock:
            if self._entry_points_read:
                return
            self._entry_points_read = True
            from importlib.metadata import entry_points  # lazy: only when a library is looked up

            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    provider = ep.load()
                    if provider.name in self._providers:
                        log.warning("library provider %r from entry point %s is ignored: the name is taken",
                                    provider.name, ep.value)
                        continue
                    self.register(provider)
                except Exception as exc:  # one broken distribution must not hide the others
                    log.warning("library provider entry point %s = %s cannot be used: %s: %s",
                                ep.name, ep.value, type(exc).__name__, exc)

    def names(self) -> tuple[str, ...]:
        self._read_entry_points()
        return tuple(sorted(self._providers))

    def provider(self, name: str, where: str = "cpu compile option 'link'") -> LibraryProvider:
        """The provider called ``name``; ``UnknownLibraryError`` listing the known ones otherwise."""
        if name not in self._providers:
            self._read_entry_points()
        try:
            return self._providers[name]
        except KeyError:
            raise UnknownLibraryError(name, tuple(self._providers), where) from None

    def provider_for_soname(self, soname: str, *, discover: bool = True) -> LibraryProvider | None:
        """The provider serving ``soname`` (a kernel's ``DT_NEEDED`` entry), or None. ``discover=False``
        asks only the providers known so far (the entry points are not read for it)."""
        if discover:
            self._read_entry_points()
        return next((p for p in self._providers.values() if soname in p.sonames), None)

    def locate(self, name: str, where: str) -> LinkedLibrary:
        """Library ``name`` on this machine; ``LibraryUnavailableError`` naming ``where`` when absent."""
        provider = self.provider(name, where)
        with self._lock:
            found = self._located.get(name)
            if found is not None:
                return found
            try:
                found = provider.locate()
            except (ImportError, LookupError, OSError) as exc:
                soname = provider.sonames[0] if provider.sonames else name
                raise LibraryUnavailableError(where, name, soname, f"{type(exc).__name__}: {exc}",
                                              provider.install_hint) from exc
            self._located[name] = found
            return found
