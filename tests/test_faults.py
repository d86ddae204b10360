"""Faults with real processes and real file systems (issue 12): killed saves, full disks, read-only
directories, concurrent cold caches and planted cache entries.

Every test asserts the bytes of what was there before and the directory listing afterwards. The
file-system tests mount a small tmpfs (root or CAP_SYS_ADMIN); where that is refused they skip
with the reason, and the full-disk save is also shown with ``RLIMIT_FSIZE``, which needs no
privilege.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import engine
from engine.build import GraphBuilder
from engine import safefiles
from engine.bundle import save as save_mod
from engine.bundle import writer as writer_mod
from engine.bundle.contents import read_bundle
from engine.errors import EngineError, KernelError, SaveError

from support import make_registry

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs POSIX processes and file systems")

# The modules through which a save changes the disk: every line they execute is a point to kill it
# at. The manifest and reader modules a save also runs through (naming rules, opening the old target
# to check it is a bundle) only read, so a kill inside them leaves the disk as a kill at the next of
# these lines does; tracing them too made the test several times slower and no stronger.
SAVE_SOURCES = frozenset(m.__file__ for m in (writer_mod, save_mod, safefiles))
TEMPORARY = re.compile(r"\.b\.cgb\.tmp-[0-9a-f]{16}")  # the documented name of a save's temporary

ADD_W = r"""
#include <stdint.h>
int32_t add_w(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0], *w = t[1]; float *y = t[2];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] + w[0] + OFFSET;
    return 0;
}
"""
SCALE2 = r"""
#include <stdint.h>
int32_t scale2(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = 2.0f * x[i];
    return 0;
}
"""
SUB1 = r"""
#include <stdint.h>
int32_t sub1(void *const *t, const int64_t *sym, void *ws) {
    const float *x = t[0]; float *y = t[1];
    for (int64_t i = 0; i < sym[0]; i++) y[i] = x[i] - 1.0f;
    return 0;
}
"""


# ---- bundles, snapshots and processes ---------------------------------------------------------
def small_graph(registry, w0: float = 1.0, *, weight_floats: int = 4, source_only: bool = False,
                offset: float = 0.0) -> GraphBuilder:
    """``y = x + w[0] + offset`` (compiled: elf-so plus source; each offset is another object);
    ``source_only`` adds ``2*y - 1`` as two kernels shipped only as C source, so loading them goes
    through the build cache."""
    b = GraphBuilder("faults", registry=registry)
    x = b.input("x", "float32", ["n"])
    w = b.weight("w", np.full(weight_floats, w0, np.float32))
    add = b.kernel("add_w", entries=["add_w"], source=f"#define OFFSET {offset!r}f\n{ADD_W}")
    (y,) = b.call(add, [x, w], [("float32", ["n"])], symbols=["n"])
    if source_only:
        for name, src in (("scale2", SCALE2), ("sub1", SUB1)):
            k = b.kernel(name, entries=[name], binaries=[{"format": "c-source", "target": "any",
                                                          "path": f"{name}.c", "data": src.encode()}])
            (y,) = b.call(k, [y], [("float32", ["n"])], symbols=["n"])
    b.output(y, "y")
    return b


def expected(x: np.ndarray, w0: float, source_only: bool = False, offset: float = 0.0) -> np.ndarray:
    y = x + np.float32(w0) + np.float32(offset)
    return 2 * y - 1 if source_only else y


def snapshot(path: Path) -> bytes | dict[str, bytes]:
    """A bundle's bytes: the file's, or every file of the directory tree by relative path."""
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    return path.read_bytes()


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def tree(directory: Path) -> dict[str, bytes | None]:
    """Every entry under ``directory`` (files with their bytes, directories as None)."""
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(directory.rglob("*"))}


def run_bundle(path: Path, cache: Path, w0: float, source_only: bool = False, offset: float = 0.0) -> None:
    """Load ``path`` with ``cache`` as the cache directory in this process and check one run."""
    x = np.arange(8, dtype=np.float32)
    graph = engine.load_compiled_graph(path, registry=make_registry(cache))
    try:
        (y,) = graph.run_async([x])
        np.testing.assert_array_equal(y.numpy(), expected(x, w0, source_only, offset))
    finally:
        graph.close()


LOAD_SCRIPT = textwrap.dedent(r"""
    import os, sys, time
    import numpy as np
    import engine
    bundle, go = sys.argv[1], sys.argv[2]
    while go != "-" and not os.path.exists(go):
        time.sleep(0.001)
    graph = engine.load_compiled_graph(bundle)
    (y,) = graph.run_async([np.arange(8, dtype=np.float32)])
    print(" ".join(repr(float(v)) for v in y.numpy()))
""")


def load_in_processes(bundle: Path, cache: Path, count: int) -> list[np.ndarray]:
    """Load and run ``bundle`` in ``count`` fresh processes released together; their outputs."""
    go = cache.parent / f"go-{cache.name}"
    env = dict(os.environ, ENGINE_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT, str(bundle), str(go) if count > 1 else "-"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(count)]
    time.sleep(0.5)  # not a threshold: only gives every process time to import before the start
    go.touch()
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        go.unlink()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    return [np.array([float(v) for v in out.split()], np.float32) for out, _ in results]


# ---- 1. saves killed with SIGKILL -------------------------------------------------------------
def save_and_die_at(line: int, save: Callable[[], None]) -> None:
    """Run ``save``, SIGKILLing this process when it reaches the ``line``-th line it executes in the
    modules that write (``SAVE_SOURCES``: every point between two statements that can change the disk)."""
    seen = 0

    def tracer(frame, event, arg):
        nonlocal seen
        if frame.f_code.co_filename not in SAVE_SOURCES:
            return None
        if event == "line":
            seen += 1
            if seen == line:
                os.kill(os.getpid(), signal.SIGKILL)
        return tracer

    sys.settrace(tracer)
    save()


def in_child(body: Callable[[], None], *, kill_after: float | None = None) -> bool:
    """Run ``body`` in a forked child; True if it died of SIGKILL, False if it returned."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            body()
        except BaseException:
            code = 3
        os._exit(code)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, "the save failed in the child"
    return False


def check_after_kill(tmp_path: Path, target: Path, old, new) -> str:
    """The bundle is the old one or the new one, whole; anything else is a recognisable temporary."""
    state = snapshot(target)
    assert state in (old, new)
    extra = [n for n in listing(tmp_path) if n != target.name]
    assert all(TEMPORARY.fullmatch(n) for n in extra), extra
    assert len(extra) <= 2, extra  # each save removes what the previous killed one left
    return "old" if state == old else "new"


def saver(target: Path, members: dict, form: str) -> Callable[[], None]:
    """Saving ``members`` to ``target``; the members are compiled already, so a child only saves."""
    return lambda: save_mod.write_bundle(target, members, engine_version="faults", form=form)


def kill_at_every_line(target: str, form: str, cache: str) -> dict:
    """Save a new bundle over an old one, SIGKILLed at every line the writer executes, one child
    per line, until a save completes; each kill starts from the old bundle.

    Returns, for each kill, which bundle ``target`` then held (``old``, ``new`` or ``other``) and
    the other entries of its directory; then whether the old and new bundles differ, and the
    directory and bundle after one more save of the old bundle (which removes what kills left).
    Run in a fresh process (``KILL_SCRIPT``): see the test."""
    path = Path(target)
    registry = make_registry(Path(cache))
    save_old = saver(path, small_graph(registry, 1.0).members(), form)
    save_new = saver(path, small_graph(registry, 2.0).members(), form)
    save_new()
    new = snapshot(path)
    save_old()
    old = snapshot(path)
    kills, line = [], 0
    while True:
        line += 1
        if not in_child(lambda: save_and_die_at(line, save_new)):
            break  # the save ran to the end without reaching that line
        state = snapshot(path)
        kills.append(["old" if state == old else "new" if state == new else "other",
                      [n for n in listing(path.parent) if n != path.name]])
        if kills[-1][0] == "new":
            save_old()
    save_old()
    return {"kills": kills, "differ": old != new, "listing": listing(path.parent), "old": snapshot(path) == old}


KILL_SCRIPT = "import json, sys, test_faults; print(json.dumps(test_faults.kill_at_every_line(*sys.argv[1:])))"


@pytest.mark.slow
@pytest.mark.parametrize("form", ["zip", "dir"])
def test_save_killed_at_every_point_keeps_the_old_bundle(tmp_path, session_cache, form):
    """SIGKILL at every line the writer executes, one child per line, until a save completes.

    Lines are a superset of the points that matter (each ``os.open``, write, ``fsync``, rename,
    exchange and removal is its own line); kills inside one call are the random-moment test's job.
    The children fork from a fresh process that has loaded only the engine: forked from a test
    worker that has loaded the importer, ONNX Runtime and Ray, each costs several times more.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "b.cgb"), form, str(session_cache)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["differ"]
    states = [state for state, _ in result["kills"]]
    assert "other" not in states, "a kill left something at the target that is neither bundle whole"
    for _, extra in result["kills"]:
        assert all(TEMPORARY.fullmatch(n) for n in extra), extra
        assert len(extra) <= 2, extra  # each save removes what the previous killed one left
    # Killed before the atomic swap: the old bundle; after it: the new one. Never anything else.
    swapped = states.index("new")
    assert swapped > 0 and set(states[:swapped]) == {"old"} and set(states[swapped:]) == {"new"}
    assert len(states) > 100
    assert result["listing"] == ["b.cgb"] and result["old"]  # the next save removed every abandoned temporary
    run_bundle(tmp_path / "b.cgb", tmp_path.parent / f"{tmp_path.name}-cache", 1.0)


@pytest.mark.parametrize("form", ["zip", "dir"])
def test_save_killed_at_random_moments_keeps_the_old_bundle(tmp_path, registry, form):
    target = tmp_path / "b.cgb"
    save_old = saver(target, small_graph(registry, 1.0).members(), form)
    save_new = saver(target, small_graph(registry, 2.0, weight_floats=4 << 20).members(), form)  # 16 MiB
    started = time.perf_counter()
    in_child(save_new)
    duration = time.perf_counter() - started  # only to spread the kills over a save, not a threshold
    new = snapshot(target)
    save_old()
    old = snapshot(target)
    rng = random.Random(12)
    for _ in range(20):
        in_child(save_new, kill_after=rng.uniform(0, duration * 1.2))
        if check_after_kill(tmp_path, target, old, new) == "new":
            save_old()
    save_old()
    assert listing(tmp_path) == ["b.cgb"] and snapshot(target) == old


@pytest.mark.parametrize("form", ["zip", "dir"])
def test_a_running_saves_temporary_is_never_removed(tmp_path, registry, form):
    """Cleaning takes only temporaries whose save is dead: a stopped (live) save keeps its own."""
    target = tmp_path / "b.cgb"
    save_old = saver(target, small_graph(registry, 1.0).members(), form)
    save_new = saver(target, small_graph(registry, 2.0).members(), form)
    save_old()
    old = snapshot(target)

    def stop_before_swap(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_swap_in" and frame.f_code.co_filename == save_mod.__file__:
            os.kill(os.getpid(), signal.SIGSTOP)
        return None

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        sys.settrace(stop_before_swap)
        code = 0
        try:
            save_new()
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status)
    (pending,) = [n for n in listing(tmp_path) if n != "b.cgb"]
    assert TEMPORARY.fullmatch(pending)
    save_old()  # another save meanwhile: its cleaning must leave the live temporary alone
    assert listing(tmp_path) == sorted(["b.cgb", pending]) and snapshot(target) == old
    os.kill(pid, signal.SIGCONT)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert listing(tmp_path) == ["b.cgb"] and snapshot(target) != old  # the stopped save finished


def test_save_into_a_missing_directory_is_a_save_error(tmp_path, registry):
    target = tmp_path / "missing" / "b.cgb"
    with pytest.raises(SaveError) as info:
        small_graph(registry).save(target)
    assert info.value.errno == errno.ENOENT
    assert_one_line_naming(info.value, repr(str(target)), "directory does not exist")
    assert listing(tmp_path) == []


def test_killed_portable_directory_swap_is_restored_by_the_next_save(tmp_path, registry, monkeypatch):
    """Without ``renameat2`` the directory swap is two renames; a kill between them leaves the old
    tree at ``.<name>.old-<tag>``, and the next save renames it back before anything else."""
    target = tmp_path / "b.cgb"
    save_old = saver(target, small_graph(registry, 1.0).members(), "dir")
    save_new = saver(target, small_graph(registry, 2.0).members(), "dir")
    save_old()
    old = snapshot(target)
    monkeypatch.setattr(save_mod, "_exchange", lambda a, b: False)  # as on a platform without it
    real_rename = os.rename

    def die_between_renames() -> None:
        def rename(src, dst):
            if Path(dst) == target:  # the old tree is aside, the new one not yet in
                os.kill(os.getpid(), signal.SIGKILL)
            return real_rename(src, dst)

        os.rename = rename
        save_new()

    assert in_child(die_between_renames)
    (aside,) = [n for n in listing(tmp_path) if ".old-" in n]
    assert snapshot(tmp_path / aside) == old and "b.cgb" not in listing(tmp_path)

    def failing_producer():
        raise RuntimeError("producer failed")
        yield b""

    with pytest.raises(RuntimeError, match="producer failed"):  # the next save, failing after its cleaning
        save_mod.write_bundle(target, {"a": failing_producer()}, engine_version="faults", form="dir")
    assert listing(tmp_path) == ["b.cgb"] and snapshot(target) == old


TUNE_SCRIPT = textwrap.dedent(r"""
    import os, signal, sys
    import engine
    bundle, die = sys.argv[1], sys.argv[2] == "die"
    real_replace = os.replace

    def replace(src, dst):  # SIGKILL at the rename that would publish the dispatch cache
        if die and os.sep + "dispatch" + os.sep in os.fspath(dst):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)

    os.replace = replace
    engine.load_compiled_graph(bundle).tune(batch=[1, 2, 3])
""")


def test_tuning_killed_while_writing_the_dispatch_cache_leaves_nothing_behind(tmp_path, registry):
    """The dispatch cache's temporary, stranded by a kill, is removed by the next writer."""
    from engine.demo.mlp import build_mlp

    bundle, cache = tmp_path / "mlp.cgb", tmp_path / "cache"
    build_mlp(registry=registry).save(bundle)
    env = dict(os.environ, ENGINE_CACHE_DIR=str(cache))
    killed = subprocess.run([sys.executable, "-c", TUNE_SCRIPT, str(bundle), "die"], env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    dispatch = cache / "dispatch"
    stranded = [n for n in listing(dispatch) if ".txt.tmp-" in n]
    assert len(stranded) == 1 and not [n for n in listing(dispatch) if n.endswith(".txt")]
    done = subprocess.run([sys.executable, "-c", TUNE_SCRIPT, str(bundle), "live"], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    (table,) = [n for n in listing(dispatch) if n.endswith(".txt")]
    assert listing(dispatch) == [table, table + ".lock"]


# ---- small file systems -----------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    """``mount(kib)``: a fresh tmpfs of that size under ``tmp_path`` (skips where mounting is refused)."""
    mounted: list[Path] = []

    def mount(kib: int, name: str = "fs") -> Path:
        where = tmp_path / name
        where.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command: cannot make a size-limited or read-only file system")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def remount_read_only(where: Path) -> None:
    proc = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {proc.stderr.strip()}")


def fill(where: Path) -> None:
    """Write a ballast file until the file system is full."""
    with open(where / "ballast", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def assert_one_line_naming(exc: BaseException, *words: str) -> None:
    message = str(exc)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


# ---- 2. full disk -----------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["zip", "dir"])
def test_save_to_a_full_disk_raises_and_keeps_the_old_bundle(small_fs, registry, form):
    fs = small_fs(512)
    target = fs / "b.cgb"
    small_graph(registry, 1.0).save(target, form=form)
    before, names = snapshot(target), listing(fs)
    with pytest.raises(SaveError) as info:
        small_graph(registry, 2.0, weight_floats=1 << 18).save(target, form=form)  # 1 MiB of weights
    assert isinstance(info.value, EngineError) and info.value.errno == errno.ENOSPC
    assert_one_line_naming(info.value, repr(str(target)), "no space")
    assert snapshot(target) == before and listing(fs) == names == ["b.cgb"]
    run_bundle(target, fs.parent / "cache", 1.0)


@pytest.mark.parametrize("form", ["zip", "dir"])
def test_save_over_the_file_size_limit_raises_and_keeps_the_old_bundle(tmp_path, registry, form):
    """The same without privileges: RLIMIT_FSIZE in a child makes writes past the limit fail."""
    target = tmp_path / "b.cgb"
    small_graph(registry, 1.0).save(target, form=form)
    before = snapshot(target)
    members = small_graph(registry, 2.0, weight_floats=1 << 18).members()
    report = tmp_path.parent / f"{tmp_path.name}-report.txt"

    def save_limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
        try:
            save_mod.write_bundle(target, members, engine_version="faults", form=form)
        except SaveError as exc:
            report.write_text(f"{exc.errno}\t{exc}")

    assert not in_child(save_limited)
    code, message = report.read_text().split("\t")
    assert int(code) == errno.EFBIG
    assert "\n" not in message and repr(str(target)) in message and "no space" in message
    assert snapshot(target) == before and listing(tmp_path) == ["b.cgb"]


def test_kernel_cache_on_a_full_disk_errors_clearly_and_loses_nothing(small_fs, registry, tmp_path):
    warm, cold = tmp_path / "warm.cgb", tmp_path / "cold.cgb"
    small_graph(registry, 1.0).save(warm)
    small_graph(registry, 3.0, source_only=True).save(cold)
    cache = small_fs(1024)
    run_bundle(warm, cache, 1.0)
    cached = tree(cache)
    fill(cache)
    with pytest.raises(KernelError) as info:
        run_bundle(cold, cache, 3.0, source_only=True)
    assert_one_line_naming(info.value, str(cache), "No space left on device")
    after = tree(cache)
    assert after.pop("ballast") is not None
    assert {name: after.get(name) for name in cached} == cached  # nothing lost or changed
    added = {name: data for name, data in after.items() if name not in cached}
    assert all(data is None or (data == b"" and name.endswith(".lock")) for name, data in added.items()), added
    full = tree(cache)
    run_bundle(warm, cache, 1.0)  # what was cached still loads from the full disk
    assert tree(cache) == full


# ---- 3. read-only directories -----------------------------------------------------------------
@pytest.mark.parametrize("form", ["zip", "dir"])
def test_save_to_a_read_only_file_system_raises_and_changes_nothing(small_fs, registry, form):
    fs = small_fs(1024)
    target = fs / "b.cgb"
    small_graph(registry, 1.0).save(target, form=form)
    before = snapshot(target)
    remount_read_only(fs)
    for name in ("b.cgb", "new.cgb"):
        with pytest.raises(SaveError) as info:
            small_graph(registry, 2.0).save(fs / name, form=form)
        assert info.value.errno == errno.EROFS
        assert_one_line_naming(info.value, repr(str(fs / name)), "read-only")
    assert snapshot(target) == before and listing(fs) == ["b.cgb"]


def test_read_only_kernel_cache_serves_what_it_holds(small_fs, registry, tmp_path):
    """Kernels already cached load from a read-only cache; others load from memory (shared objects)
    or compile into a private temporary directory (sources), and nothing is written."""
    warm, cold = tmp_path / "warm.cgb", tmp_path / "cold.cgb"
    small_graph(registry, 1.0, source_only=True).save(warm)
    small_graph(registry, 5.0, offset=0.5).save(cold)  # another object, not in the cache
    cache = small_fs(1024)
    run_bundle(warm, cache, 1.0, source_only=True)
    cached = tree(cache)
    remount_read_only(cache)
    run_bundle(warm, cache, 1.0, source_only=True)
    (out,) = load_in_processes(warm, cache, 1)  # a fresh process: nothing memoized
    np.testing.assert_array_equal(out, expected(np.arange(8, dtype=np.float32), 1.0, True))
    run_bundle(cold, cache, 5.0, offset=0.5)
    assert tree(cache) == cached


# ---- 4. eight processes, one cold cache -------------------------------------------------------
def test_eight_processes_with_a_cold_cache_leave_one_entry_per_kernel(tmp_path, registry):
    bundle = tmp_path / "b.cgb"
    small_graph(registry, 1.0, source_only=True).save(bundle)
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    want = expected(np.arange(8, dtype=np.float32), 1.0, True)
    for cache, count in ((alone, 1), (shared, 8)):
        for out in load_in_processes(bundle, cache, count):
            np.testing.assert_array_equal(out, want)
    # Eight racing processes leave exactly what one leaves: one entry per kernel, no temporaries.
    assert tree(shared).keys() == tree(alone).keys()
    assert not [p for p in shared.rglob("*") if "tmp" in p.name]
    secret_made = {name for name in tree(shared) if "/.auth/" in name}  # per-cache secret and tags
    assert {n: d for n, d in tree(shared).items() if n not in secret_made} == \
        {n: d for n, d in tree(alone).items() if n not in secret_made}
    assert not (shared / "cpu" / "so").exists()  # shipped shared objects load from memory: none extracted
    build = shared / "cpu" / "build"
    keys = sorted(n[:-3] for n in listing(build) if n.endswith(".so"))
    assert len(keys) >= 2  # scale2 and sub1 at least; each built once: <key>.so, hash, lock, tag
    assert listing(build) == sorted([".auth"] + [f".{k}.lock" for k in keys] + [f"{k}.so" for k in keys]
                                    + [f"{k}.so.sha256" for k in keys])
    assert listing(build / ".auth") == sorted(["secret"] + [f"{k}.so" for k in keys])


# ---- 5. planted cache entries -----------------------------------------------------------------
PLANTED = r"""
#include <stdio.h>
#include <stdint.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
int32_t add_w(void *const *t, const int64_t *sym, void *ws) { return 0; }
int32_t scale2(void *const *t, const int64_t *sym, void *ws) { return 0; }
int32_t sub1(void *const *t, const int64_t *sym, void *ws) { return 0; }
"""


@pytest.fixture
def planted_object(tmp_path) -> tuple[bytes, Path]:
    """A shared object whose constructor writes a marker file, and the marker's path."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the planted object")
    marker = tmp_path / "MARKER"
    src, out = tmp_path / "planted.c", tmp_path / "planted.so"
    src.write_text(PLANTED)
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(out)], check=True)
    return out.read_bytes(), marker


def test_planted_content_store_object_is_replaced_not_executed(tmp_path, registry, planted_object):
    evil, marker = planted_object
    bundle, cache = tmp_path / "b.cgb", tmp_path / "cache"
    small_graph(registry, 1.0).save(bundle)
    genuine = read_bundle(bundle).archive.read("kernels/0/add_w.so")
    planted = cache / "cpu" / "so" / (hashlib.sha256(genuine).hexdigest() + ".so")  # same name, other bytes
    planted.parent.mkdir(parents=True)
    planted.write_bytes(evil)
    (out,) = load_in_processes(bundle, cache, 1)
    np.testing.assert_array_equal(out, expected(np.arange(8, dtype=np.float32), 1.0))
    assert not marker.exists()
    # Kernels load from memory (the bundle's bytes): the planted file is never opened, nor needed.
    assert planted.read_bytes() == evil and listing(planted.parent) == [planted.name]


@pytest.mark.parametrize("side_file", ["missing", "matching", "another entry's"])
def test_planted_build_cache_entry_is_replaced_not_executed(tmp_path, registry, planted_object, side_file):
    evil, marker = planted_object
    bundle, cache = tmp_path / "b.cgb", tmp_path / "cache"
    small_graph(registry, 1.0, source_only=True).save(bundle)
    load_in_processes(bundle, cache, 1)  # builds the two sources into the cache
    build = cache / "cpu" / "build"
    keys = sorted(n[:-3] for n in listing(build) if n.endswith(".so"))
    genuine = {k: (build / f"{k}.so").read_bytes() for k in keys}
    before = tree(cache)
    for i, key in enumerate(keys):  # same names, other bytes
        so, sha = build / f"{key}.so", build / f"{key}.so.sha256"
        if side_file == "another entry's":  # a whole valid entry of the other key, tag included
            other = keys[1 - i]
            so.write_bytes(genuine[other])
            sha.write_text(hashlib.sha256(genuine[other]).hexdigest())
            (build / ".auth" / f"{key}.so").write_bytes(before[f"cpu/build/.auth/{other}.so"])
            continue
        so.write_bytes(evil)
        if side_file == "missing":
            sha.unlink()
        else:
            sha.write_text(hashlib.sha256(evil).hexdigest())
    (out,) = load_in_processes(bundle, cache, 1)
    np.testing.assert_array_equal(out, expected(np.arange(8, dtype=np.float32), 1.0, True))
    assert not marker.exists()
    assert tree(cache) == before  # every planted entry rebuilt and replaced; nothing else added
