"""The engine's exception hierarchy.

Every class an engine distribution raises on purpose, in the style of httpx's error tree; the
module that defines it is named where it is not this one::

    EngineError
     ├── BundleError               (also ValueError)    a bundle is malformed, inconsistent, unsafe, too big
     │    ├── BundleFileError      (also OSError)       the bundle's file or directory cannot be read
     │    │    └── BundleNotFoundError (also FileNotFoundError) nothing at the path
     │    ├── UnconvertedModelError                     a model file (ONNX) given where a bundle belongs
     │    └── ExprError            engine.expr          a size expression cannot be evaluated
     ├── InputError                (also ValueError)    run_async/set_weights got something it cannot use
     │    └── ColumnError          engine.ray.batches   a batch column is missing or cannot feed its input
     ├── GraphClosedError          (also ValueError)    a graph was used after close()
     ├── KernelError               (also RuntimeError)  a kernel failed to load, compile or run
     │    ├── BinaryRefused        engine.backend.base  a binary that looked loadable is not: next
     │    ├── CandidateUnavailable engine.backend.base  a candidate cannot run here: the others still do
     │    │    └── LibraryUnavailableError engine_cpu.libraries  a library a kernel links cannot be located
     │    ├── CompilerError        engine_cpu.compiler  the C compiler rejected a source (log, command)
     │    ├── LinkDirectiveError   engine_cpu.compiler  (also ValueError) a link directive is malformed
     │    ├── UnknownLibraryError  engine_cpu.libraries (also ValueError) a link option names no provider
     │    ├── UnitMarkerError      engine_cpu.units     (also ValueError) unit markers of a C source do not pair up
     │    ├── CudaCompileError     engine_cuda.compiler NVRTC rejected a source (log, options, target)
     │    ├── HipCompileError      engine_hip.compiler  hiprtc rejected a source (log, options, target)
     │    └── DeviceFault          engine.backend.gpu.driver  a kernel faulted on the device (a DriverError too)
     ├── DriverError               engine.backend.gpu.driver  (also RuntimeError) a driver call failed
     │    └── DeviceFault          (above)
     ├── DriverMissing             engine.backend.gpu.driver  (also RuntimeError) no driver library or bindings
     ├── OpenCLError               engine_opencl.memory (also RuntimeError) an OpenCL copy or fill failed
     ├── PluginError               (also RuntimeError)  a device plugin is broken or incompatible
     ├── DeviceUnavailableError    (also RuntimeError)  no usable plugin or device for a kind
     ├── OutOfMemoryError          (also MemoryError)   a device cannot provide memory, or a plan needs too much
     ├── SaveError                 (also OSError)       a bundle could not be written; the old one is unchanged
     │    └── SaveTargetError                           the save target exists and is not a bundle: refused
     ├── Unsupported               (also NotImplementedError) a backend lacks an optional capability
     └── ImportErrorBase           engine_onnx.errors   the ONNX importer refused a model
          ├── ModelLoadError       engine_onnx.errors   not a loadable ONNX model
          │    └── UnsupportedOpsetError engine_onnx.errors  an opset outside the range the importer reads
          └── UnsupportedModelError engine_onnx.errors  every node that cannot be imported (``nodes``)

tests/test_error_tree.py keeps this tree whole: every ``EngineError`` subclass the distributions
define is listed, under each of its engine parents.

Every error carries its context in the message (which member, which input, which kernel, what was
expected) so that a log line alone is enough to act on. Subclasses also inherit the matching built-in
so that generic ``except ValueError`` code keeps working.
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "EngineError",
    "BundleError",
    "BundleFileError",
    "BundleNotFoundError",
    "UnconvertedModelError",
    "InputError",
    "GraphClosedError",
    "KernelError",
    "PluginError",
    "DeviceUnavailableError",
    "OutOfMemoryError",
    "SaveError",
    "SaveTargetError",
    "Unsupported",
]


class EngineError(Exception):
    """Base of every error the engine raises on purpose.

    Every one pickles whole, whatever its ``__init__`` takes: errors cross processes (a process pool,
    Ray tasks, pytest-xdist workers), and the default pickling calls ``cls(*args)`` with the message,
    which a subclass taking other parameters refuses or misreads. An error is rebuilt from its
    message and the attributes it carries (``_rebuild``), without calling ``__init__`` again.
    """

    def __reduce__(self) -> tuple[object, ...]:
        state = dict(self.__dict__)
        if isinstance(self, OSError):  # errno, strerror and filename live in OSError's own slots
            # (only those set: one set to None would change how OSError prints the message)
            slots = {"errno": self.errno, "strerror": self.strerror, "filename": self.filename}
            state.update({name: value for name, value in slots.items() if value is not None})
        return _rebuild, (type(self), self.args, state)


def _rebuild(cls: type[EngineError], args: tuple[object, ...], state: dict[str, object]) -> EngineError:
    """The error ``EngineError.__reduce__`` pickled: its class, message and attributes."""
    # The built-in base whose memory layout the class has: OSError's differs from Exception's.
    new = OSError.__new__ if issubclass(cls, OSError) else Exception.__new__
    error = new(cls, *args)
    error.args = args
    for name, value in state.items():
        setattr(error, name, value)
    return error


class BundleError(EngineError, ValueError):
    """A bundle (or one of its members) is malformed, inconsistent, unsafe or over a limit.

    ``member`` names the bundle member and ``path`` the JSON path inside it, when known; both are
    kept as given. The message (``member @ path: message``) is one line whatever they contain: member
    names, keys and text come from the bundle, so a name with a newline in it would otherwise let a
    bundle forge log lines. Line breaks and other non-printable characters are escaped (``\\n``).
    """

    def __init__(self, message: str, *, member: str | None = None, path: str | None = None):
        where = ""
        if member is not None:
            shown = member or "''"  # an empty name must still read as one
            where = f"{shown}: "
            if path:
                where = f"{shown} @ {path}: "
        elif path:
            where = f"@ {path}: "
        super().__init__(_one_line(where + message))
        self.member = member
        self.path = path


class BundleFileError(BundleError, OSError):
    """The bundle's file or directory cannot be read (missing, a permission, an I/O error).

    Also an ``OSError`` carrying ``errno``, ``strerror`` and ``filename``, so code written for file
    errors (``except OSError``) catches it; the message stays engine's one line.
    """

    def __init__(self, message: str, *, errno: int | None, strerror: str | None, filename: str):
        BundleError.__init__(self, message)
        self.errno = errno
        self.strerror = strerror
        self.filename = filename

    def __str__(self) -> str:
        return BaseException.__str__(self)  # the one-line message, not OSError's "[Errno N] ..."


class BundleNotFoundError(BundleFileError, FileNotFoundError):
    """No bundle at the given path (``except FileNotFoundError`` catches it)."""


class UnconvertedModelError(BundleError):
    """A model file of another format (an ONNX model) was given where a bundle belongs.

    ``filename`` is the path as given, ``model_format`` the model's format (``"ONNX"``) and ``command``
    the command that converts it (``engine convert m.onnx -o m.cgb``), also in the message.
    """

    def __init__(self, message: str, *, filename: str, model_format: str, command: str):
        super().__init__(message)
        self.filename = filename
        self.model_format = model_format
        self.command = command


class InputError(EngineError, ValueError):
    """An input (or weight) handed to the engine does not match what the graph expects."""


class GraphClosedError(EngineError, ValueError):
    """A ``CompiledGraph`` was run after ``close()`` (a ``ValueError``, as for a closed file).

    Its bundle's file handle is gone and its lanes dropped; load the bundle again to run it.
    """


class KernelError(EngineError, RuntimeError):
    """A kernel could not be loaded, compiled or launched, or returned a failure code.

    The message is one line: binary formats, entry names and compiler output come from bundles, so
    their line breaks are escaped (a compiler's full output belongs in an attribute, not the message).
    """

    def __init__(self, message: str, *args: object):
        super().__init__(_one_line(str(message)), *args)


class PluginError(EngineError, RuntimeError):
    """A device plugin failed to import, registered badly, or has an incompatible API version."""


class DeviceUnavailableError(EngineError, RuntimeError):
    """No plugin provides the requested device kind, or it has no usable device."""


class OutOfMemoryError(EngineError, MemoryError):
    """A device could not provide memory the engine needed, or a key's plan needs more than allowed.

    ``nbytes`` is the size that failed, ``device`` where (``"cpu:0"``), ``purpose`` what it was for
    (``"output 0 ('probs') at batch=8"``; ``None`` where only the allocator knew of it) and ``cause``
    the allocator's or the limit's reason. A backend's ``allocate`` cannot know the purpose, so the
    core's allocation sites re-raise with it (``from_error``); a log line then says what to shrink.
    Also a ``MemoryError``, so code that already handles running out of memory keeps working.
    """

    def __init__(self, nbytes: int, device: str, cause: str, purpose: str | None = None):
        self.nbytes = nbytes
        self.device = device
        self.cause = _one_line(cause)
        self.purpose = purpose
        if nbytes >= _HUGE:  # printing it whole could hit Python's limit on integer digits
            size = "more than 2**80 bytes"
        else:
            size = f"{nbytes} bytes" if nbytes < 1024 else f"{nbytes} bytes ({format_size(nbytes)})"
        what = f" for {purpose}" if purpose else ""
        super().__init__(f"{device}: cannot allocate {size}{what}: {self.cause}")

    @classmethod
    def from_error(cls, exc: BaseException, nbytes: int, device: str,
                   purpose: str | None = None) -> "OutOfMemoryError":
        """``exc`` (a ``MemoryError`` or ``OSError`` of an allocator, or an ``OutOfMemoryError``, whose
        own size, device and cause are kept) as an ``OutOfMemoryError`` saying what it was for."""
        if isinstance(exc, OutOfMemoryError):
            return cls(exc.nbytes, exc.device, exc.cause, purpose if purpose is not None else exc.purpose)
        return cls(nbytes, device, str(exc) or f"{type(exc).__name__} (out of memory)", purpose)


def format_size(nbytes: int) -> str:
    """``nbytes`` in binary units, one decimal (``3221225472`` -> ``"3.0 GiB"``), for messages.

    Integer arithmetic throughout: a size too large for a float still formats.
    """
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    k = 0
    while k + 1 < len(units) and nbytes >= 1024 ** (k + 1):
        k += 1
    if k == 0:
        return f"{nbytes} bytes"
    scale = 1024**k
    tenths = (nbytes * 10 + scale // 2) // scale
    return f"{tenths // 10}.{tenths % 10} {units[k]}"


_HUGE = 2**80


def _one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped: messages stay one log line."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


class Unsupported(EngineError, NotImplementedError):
    """The backend does not implement an optional capability."""


class SaveError(EngineError, OSError):
    """A bundle could not be written (no space, a read-only or unwritable directory, ...).

    Raised only before the new bundle took the old one's place, so whatever was at ``path`` is
    unchanged. ``path`` is the target and ``errno`` the operating system's error number, so code that
    catches ``OSError`` keeps working.
    """

    def __init__(self, message: str, *, path: str, errno: int | None = None):
        super().__init__(message)
        self.path = path
        self.errno = errno  # set after init: OSError would otherwise prefix "[Errno n]" to the message


class SaveTargetError(SaveError):
    """A save was refused because its target exists and is not a bundle (a directory of other files,
    a file of another kind, the model being converted): replacing it would destroy data the engine
    did not write. Nothing was written. ``reason`` says what the target is, in words; callers that
    offer an overwrite switch name it in their own message (``overwrite=True``, ``--overwrite``).
    """

    def __init__(self, message: str, *, path: str, reason: str):
        super().__init__(message, path=path, errno=_errno.EEXIST)
        self.reason = reason
