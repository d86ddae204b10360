"""``engine.safefiles``, the one layer every engine writer uses: real files, real processes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from engine import safefiles

posix_only = pytest.mark.skipif(not safefiles.FLOCK, reason="flock semantics (POSIX)")


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path) -> None:
    target = tmp_path / "sub" / "table.txt"
    safefiles.atomic_write(target, "old\n")
    safefiles.atomic_write(target, b"new bytes")
    assert target.read_bytes() == b"new bytes"
    assert sorted(p.name for p in target.parent.iterdir()) == ["table.txt"]


def test_atomic_write_private_is_readable_by_its_owner_only(tmp_path) -> None:
    target = tmp_path / "secret.bin"
    safefiles.atomic_write(target, memoryview(b"\x00\x01"), private=True)
    if os.name == "posix":
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_bytes() == b"\x00\x01"


def test_a_failed_publish_keeps_the_target_and_removes_the_temporary(tmp_path) -> None:
    target = tmp_path / "bundle"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(OSError):  # a file cannot be renamed over a non-empty directory
        safefiles.atomic_write(target, b"data")
    assert (target / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


HOLDER = textwrap.dedent(r"""
    import sys, time
    from engine import safefiles
    with safefiles.file_lock(sys.argv[1]) as held:
        assert held
        print("held", flush=True)
        time.sleep(600)
""")


@posix_only
def test_file_lock_excludes_another_process_until_its_holder_dies(tmp_path) -> None:
    lock = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with safefiles.file_lock(lock, wait=False) as held:
            assert held is False
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        with safefiles.file_lock(lock, wait=False) as held:  # the kernel dropped the dead holder's lock
            assert held is True
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert lock.exists()  # lock files are never removed


@posix_only
def test_file_lock_excludes_another_thread_of_the_same_process(tmp_path) -> None:
    import threading

    lock = tmp_path / "t.lock"
    seen = []

    def try_lock() -> None:
        with safefiles.file_lock(lock, wait=False) as held:
            seen.append(held)

    with safefiles.file_lock(lock):
        worker = threading.Thread(target=try_lock)
        worker.start()
        worker.join(timeout=60)
    assert seen == [False]


def test_remove_abandoned_removes_only_that_targets_temporaries(tmp_path) -> None:
    target = tmp_path / "rows.txt"
    stranded = safefiles.temporary_name(target)
    stranded.write_text("half")
    other = safefiles.temporary_name(tmp_path / "other.txt")
    other.write_text("someone else's")
    (tmp_path / ".rows.txt.tmp-nothex").write_text("not ours")
    assert safefiles.abandoned_temporaries(target) == [stranded]
    assert safefiles.remove_abandoned(target) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.name, ".rows.txt.tmp-nothex"])


def test_fsync_dir_of_a_missing_directory_is_a_no_op(tmp_path) -> None:
    safefiles.fsync_dir(tmp_path / "missing")
    safefiles.fsync_dir(tmp_path)
