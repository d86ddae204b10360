"""``CudaBackend``: NVIDIA GPUs as engine kind ``cuda`` (slot 1, DLPack ``kDLCUDA`` = 2).

A thin adapter over the shared GPU layer (``engine.backend.gpu.GpuBackend``): streams, events,
pooled memory, argument blocks, launches, capture and availability live there, over
``driver.CudaDriver``. What is CUDA's own is here: which binaries load (``kernels``), the code
object each becomes, NVRTC for ``cuda-source`` and ``compile`` (``compiler``, the builder's side),
and the reference kernels in CUDA C. Construction touches no driver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from engine.backend import BinaryPayload, BinaryRefused, CandidateSpec, ReferenceKernel
from engine.backend.gpu import DriverError, GpuBackend
from engine.errors import KernelError, Unsupported
from engine.settings import Settings

from engine_cuda.driver import CudaDriver
from engine_cuda.kernels import cubin_refusal, ptx_image, ptx_refusal

__all__ = ["CudaBackend", "MIN_DRIVER_VERSION", "LANGUAGE", "FORMATS"]

#: CUDA 12.0 (driver R525): stream-ordered pools, graphs and the 12.x cubins all work from here.
#: PTX needs a driver at least as new as the NVRTC that wrote it, checked per binary.
MIN_DRIVER_VERSION = 12000
LANGUAGE = "cuda"
FORMATS = ("cubin", "ptx", "cuda-source")

#: Driver statuses while loading a module that mean "this binary does not fit": selection moves on.
_REFUSALS = {
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": "the driver does not support this PTX version",
    "CUDA_ERROR_INVALID_PTX": "the driver's PTX compiler rejected it",
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "it holds no code for this GPU",
    "CUDA_ERROR_INVALID_IMAGE": "the driver does not accept it as a module image",
    "CUDA_ERROR_JIT_COMPILER_NOT_FOUND": "the driver has no PTX JIT compiler",
    "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC": "it uses device-side synchronisation the driver does not support",
}


class CudaBackend(GpuBackend):
    """Every visible NVIDIA GPU: ``cuda:0``, ``cuda:1``, … in ``CUDA_VISIBLE_DEVICES`` order."""

    kind: ClassVar[str] = "cuda"
    workspace_slot: ClassVar[int] = 1
    api_version: ClassVar[tuple[int, int]] = (2, 0)
    dlpack_device_type: ClassVar[int] = 2  # kDLCUDA
    formats: ClassVar[tuple[str, ...]] = FORMATS
    languages: ClassVar[tuple[str, ...]] = (LANGUAGE,)
    rebuild_hint: ClassVar[str] = ("rebuild the bundle with a cubin for this GPU's architecture, PTX for an "
                                   "older one, or the CUDA source (format 'cuda-source')")
    visible_devices_env: ClassVar[str] = "CUDA_VISIBLE_DEVICES"
    min_driver_version: ClassVar[int] = MIN_DRIVER_VERSION
    #: 0 (the default stream), CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2): not capturable.
    default_streams: ClassVar[frozenset[int]] = frozenset({0, 1, 2})
    dlpack_default_stream: ClassVar[int] = 1  # DLPack: stream=None is CUDA's legacy default stream
    install_hint: ClassVar[str] = "install the NVIDIA driver (it provides libcuda.so.1)"
    upgrade_hint: ClassVar[str] = "upgrade the NVIDIA driver (R525 or newer)"

    def __init__(self, cache_dir: Path | None = None, *, debug: bool = False, stream_sources: Sequence[Any] = (),
                 driver: Any = None, env: Mapping[str, str] | None = None):
        super().__init__(driver if driver is not None else CudaDriver(), debug=debug, stream_sources=stream_sources,
                         env=env)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Settings.from_env().cache_dir
        self._compiler: Any = None

    @property
    def compiler(self) -> Any:
        """The NVRTC compiler (``engine_cuda.compiler.CudaCompiler``), made on first use."""
        if self._compiler is None:
            from engine_cuda.compiler import CudaCompiler

            self._compiler = CudaCompiler(self.cache_dir)
        return self._compiler

    # -- binary selection ------------------------------------------------------------------------
    def loadable(self, binary_format: str, target: str, device_index: int = 0) -> str | None:
        if binary_format not in self.formats:
            return f"format {binary_format!r} is not one of cuda's formats {list(self.formats)}"
        avail = self.availability()
        if not avail.available:
            return f"cuda:{device_index} is not usable: {avail.reason}"
        if not 0 <= device_index < avail.device_count:
            return f"cuda:{device_index} does not exist ({avail.device_count} cuda devices)"
        arch = self.probed().archs[device_index]
        if binary_format == "cubin":
            return cubin_refusal(target, arch)
        if binary_format == "ptx":
            return ptx_refusal(target, arch)
        return None

    def module_image(self, spec: CandidateSpec, binary: BinaryPayload, device_index: int) -> bytes:
        if binary.format == "cubin":
            return bytes(binary.data)
        if binary.format == "ptx":
            return ptx_image(binary, self.driver.version(), self.version_text(self.driver.version()))
        return self._compiled_source(binary, self.arch(device_index))

    def _compiled_source(self, binary: BinaryPayload, arch: tuple[int, int]) -> bytes:
        """A cubin for the device (PTX for the newest architecture NVRTC knows below it otherwise)."""
        try:
            source = bytes(binary.data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BinaryRefused(f"the CUDA source is not UTF-8 text ({exc})") from exc
        compiler = self.compiler
        number = 10 * arch[0] + arch[1]
        try:
            supported = compiler.supported_archs()
            if number in supported:
                return compiler.cubin(source, f"sm_{number}")
            older = [a for a in supported if a <= number]
            if not older:
                raise BinaryRefused(f"{compiler.describe()} cannot compile for sm_{number} or any older architecture")
            ptx = compiler.ptx(source, f"compute_{max(older)}")
        except Unsupported as exc:
            raise BinaryRefused(str(exc)) from exc
        except KernelError as exc:
            if isinstance(exc, BinaryRefused):
                raise
            raise BinaryRefused(str(exc)) from exc
        return ptx_image(BinaryPayload("ptx", f"compute_{max(older)}", binary.path, ptx), self.driver.version(),
                         self.version_text(self.driver.version()))

    def module_refusal(self, error: DriverError) -> str | None:
        why = _REFUSALS.get(error.name)
        return f"{why} ({error})" if why else None

    # -- the compiler role -----------------------------------------------------------------------
    def compile(self, source: str, language: str = LANGUAGE,
                options: Mapping[str, object] | None = None) -> tuple[BinaryPayload, ...]:
        """CUDA C++ to cubins and PTX with NVRTC (no GPU or driver needed): see ``compiler``."""
        if language != LANGUAGE:
            raise Unsupported(f"the cuda backend compiles {LANGUAGE!r} (CUDA C++) sources, not {language!r}")
        return self.compiler.compile(source, options)

    def reference_kernels(self) -> Mapping[str, ReferenceKernel]:
        from engine_cuda.reference import reference_kernels

        return reference_kernels()
