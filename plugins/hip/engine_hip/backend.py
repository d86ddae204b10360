"""``HipBackend``: AMD GPUs as engine kind ``hip`` (slot 2, DLPack ``kDLROCM`` = 10).

A thin adapter over the shared GPU layer (``engine.backend.gpu.GpuBackend``): streams, events,
pooled memory, argument blocks, launches, capture and availability live there, over
``driver.HipDriver``. What is HIP's own is here: the availability checks the shared probe does not
know (hip-python's major against the runtime's, the device's gfx target), which binaries load
(``kernels.hsaco_refusal``), hiprtc for ``hip-source`` and ``compile`` (``compiler``), and the
reference kernels in HIP C. Construction touches no runtime. Untested on an AMD GPU (docs/hip.md).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from engine.backend import BinaryPayload, BinaryRefused, CandidateSpec, ReferenceKernel
from engine.backend.contract import Availability
from engine.backend.gpu import DriverError, GpuBackend, Probe
from engine.errors import KernelError, Unsupported
from engine.settings import Settings

from engine_hip.driver import HipDriver, hip_version_text
from engine_hip.kernels import hsaco_refusal

__all__ = ["HipBackend", "MIN_RUNTIME_VERSION", "LANGUAGE", "FORMATS", "SUPPORTED_ARCHS"]

#: ROCm 6.0: the device-properties layout hip-python 6.x/7.x bind, stream-ordered pools and graphs.
MIN_RUNTIME_VERSION = 60_000_000
LANGUAGE = "hip"
FORMATS = ("hsaco", "hip-source")
#: gfx targets ROCm 6/7 supports: CDNA (gfx908, gfx90a, gfx94x, gfx950) and RDNA 2/3/4
#: (gfx103x, gfx110x, gfx115x, gfx120x). Older GCN parts (gfx8xx, gfx900/906) are refused.
SUPPORTED_ARCHS = re.compile(r"gfx(908|90a|94[0-2]|950|103[0-6]|110[0-3]|115[0-3]|120[01])")

#: Runtime statuses while loading a module that mean "this binary does not fit": selection moves on.
_REFUSALS = {
    "hipErrorInvalidImage": "the runtime does not accept it as a code object",
    "hipErrorNoBinaryForGpu": "it holds no code for this GPU",
    "hipErrorInvalidKernelFile": "the runtime cannot read it as a code object",
    "hipErrorSharedObjectInitFailed": "the runtime could not initialise the code object",
}


class HipBackend(GpuBackend):
    """Every visible AMD GPU: ``hip:0``, ``hip:1``, … in ``HIP_VISIBLE_DEVICES`` order."""

    kind: ClassVar[str] = "hip"
    workspace_slot: ClassVar[int] = 2
    api_version: ClassVar[tuple[int, int]] = (2, 0)
    dlpack_device_type: ClassVar[int] = 10  # kDLROCM
    formats: ClassVar[tuple[str, ...]] = FORMATS
    languages: ClassVar[tuple[str, ...]] = (LANGUAGE,)
    rebuild_hint: ClassVar[str] = ("rebuild the bundle with an hsaco for this GPU's gfx target (compile option "
                                   "'targets') or ship the HIP source (format 'hip-source')")
    visible_devices_env: ClassVar[str] = "HIP_VISIBLE_DEVICES"
    min_driver_version: ClassVar[int] = MIN_RUNTIME_VERSION
    #: 0 (the null stream) and hipStreamPerThread (2): not capturable.
    default_streams: ClassVar[frozenset[int]] = frozenset({0, 2})
    dlpack_default_stream: ClassVar[int] = 0  # DLPack on ROCm: stream=None/0 is the null stream
    install_hint: ClassVar[str] = ("install ROCm 6.0 or newer (it provides libamdhip64.so) and the amdgpu kernel "
                                   "driver")
    upgrade_hint: ClassVar[str] = "upgrade ROCm to 6.0 or newer"

    def __init__(self, cache_dir: Path | None = None, *, debug: bool = False, stream_sources: Sequence[Any] = (),
                 driver: Any = None, env: Mapping[str, str] | None = None):
        super().__init__(driver if driver is not None else HipDriver(), debug=debug, stream_sources=stream_sources,
                         env=env)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Settings.from_env().cache_dir
        self._compiler: Any = None
        self._checked: Probe | None = None
        self._check_lock = threading.Lock()

    @property
    def compiler(self) -> Any:
        """The hiprtc compiler (``engine_hip.compiler.HipCompiler``), made on first use."""
        if self._compiler is None:
            from engine_hip.compiler import HipCompiler

            self._compiler = HipCompiler(self.cache_dir)
        return self._compiler

    # -- availability --------------------------------------------------------------------------
    def version_text(self, version: int) -> str:
        return hip_version_text(version)

    def probed(self) -> Probe:
        """The shared probe, then HIP's own checks: hip-python's major against the runtime's, and
        every device's gfx target against ``SUPPORTED_ARCHS``."""
        found = super().probed()
        if self._checked is None:
            with self._check_lock:
                if self._checked is None:
                    self._checked = self._hip_checks(found)
        return self._checked

    def _hip_checks(self, found: Probe) -> Probe:
        avail = found.availability
        if not avail.available:
            return found
        mismatch = getattr(self.driver, "version_mismatch", None)
        problem = mismatch(self.driver.version()) if mismatch is not None else None
        if problem is not None:
            return Probe(Availability(False, reason=problem, driver=avail.driver))
        for index in range(avail.device_count):
            try:
                arch = self.arch_name(index, checked=False)
            except DriverError as exc:
                return Probe(Availability(False, avail.device_count, avail.device_names, driver=avail.driver,
                                          reason=f"hip:{index}: cannot read its gfx target: {exc}"))
            if not SUPPORTED_ARCHS.fullmatch(arch.split(":")[0]):
                return Probe(Availability(False, avail.device_count, avail.device_names, driver=avail.driver,
                                          reason=f"hip:{index} is {arch.split(':')[0]}, which ROCm 6/7 and this "
                                                 f"plugin do not support (supported: gfx908, gfx90a, gfx940-942, "
                                                 f"gfx950, gfx1030-1036, gfx1100-1103, gfx1150-1153, gfx1200/1201)"))
        return found

    def arch_name(self, index: int, *, checked: bool = True) -> str:
        """Device ``index``'s gfx target with features (``gfx942:sramecc+:xnack-``)."""
        if checked:
            self.ready(index)
        return str(self.driver.arch_name(index))  # HipDriver's, beyond the shared Driver Protocol

    # -- binary selection ------------------------------------------------------------------------
    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        if binary_format not in self.formats:
            return f"format {binary_format!r} is not one of hip's formats {list(self.formats)}"
        avail = self.availability()
        if not avail.available:
            return f"hip:{device_index} is not usable: {avail.reason}"
        if not 0 <= device_index < avail.device_count:
            return f"hip:{device_index} does not exist ({avail.device_count} hip devices)"
        if binary_format == "hsaco":
            return hsaco_refusal(target, self.arch_name(device_index))
        return None

    def module_image(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> bytes:
        if binary.format == "hsaco":
            return bytes(binary.data)
        return self._compiled_source(binary, self.arch_name(device_index))

    def _compiled_source(self, binary: BinaryPayload, arch: str) -> bytes:
        """An hsaco for the device's own target (with its features), from hiprtc or the cache."""
        try:
            source = bytes(binary.data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BinaryRefused(f"the HIP source is not UTF-8 text ({exc})") from exc
        try:
            return self.compiler.hsaco(source, arch)
        except BinaryRefused:
            raise
        except (Unsupported, KernelError) as exc:
            raise BinaryRefused(str(exc)) from exc

    def module_refusal(self, error: DriverError) -> str | None:
        why = _REFUSALS.get(error.name)
        return f"{why} ({error})" if why else None

    # -- the compiler role -----------------------------------------------------------------------
    def compile(self, source: str, language: str = LANGUAGE,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        """HIP C++ to one hsaco per gfx target with hiprtc (no GPU needed): see ``compiler``."""
        if language != LANGUAGE:
            raise Unsupported(f"the hip backend compiles {LANGUAGE!r} (HIP C++) sources, not {language!r}")
        return self.compiler.compile(source, options)

    def reference_kernels(self) -> Mapping[str, ReferenceKernel]:
        from engine_hip.reference import reference_kernels

        return reference_kernels()
