"""Tests for the bundle v1 byte container (zip, directory, in-memory): engine.bundle.manifest, reader,
writer and save, and the engine.bundle.archive facade that re-exports them."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import subprocess
import threading
import zipfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.bundle.manifest as manifest_mod
import engine.bundle.save as save_mod
import engine.bundle.writer as writer_mod
from engine.bundle.manifest import FORMAT_NAME, FORMAT_VERSION, MAX_MANIFEST_BYTES, MAX_MEMBERS, Manifest, ManifestEntry
from engine.bundle.reader import MAX_METADATA_BYTES, BundleArchive
from engine.bundle.save import write_bundle
from engine.bundle.writer import WEIGHTS_ALIGNMENT, bundle_to_bytes, copy_members
from engine.errors import BundleError

LOCAL_SIG = 0x04034B50
WEIGHTS = np.arange(3000, dtype=np.float32)


def sample_members(dispatch: bytes = b"op0 -> kernel_a\n") -> dict:
    return {
        "graph.json": b'{"nodes": []}',
        "kernels/a.ptx": b"// ptx\n" * 50,
        "empty.txt": b"",
        "dispatch_table.txt": dispatch,
        "donn\u00e9es/\u00e9.json": "{}".encode(),
        "weights.bin": [b"\x00" * 64, WEIGHTS, memoryview(b"tail")],
    }


def member_bytes(data) -> bytes:
    if isinstance(data, list):
        return b"".join(bytes(memoryview(c).cast("B")) for c in data)
    return bytes(memoryview(data).cast("B"))


def local_data_offset(blob: bytes, header_offset: int) -> int:
    """Independent local-header parse: 30 + name length + extra length."""
    sig, *_rest, nlen, elen = struct.unpack_from("<IHHHHHIIIHH", blob, header_offset)
    assert sig == LOCAL_SIG
    return header_offset + 30 + nlen + elen


def open_form(tmp_path, form: str, members=None) -> BundleArchive:
    members = sample_members() if members is None else members
    if form == "memory":
        return BundleArchive.open(bundle_to_bytes(members, engine_version="1.0"))
    target = tmp_path / ("b.cgb" if form == "zip" else "bdir")
    write_bundle(target, members, engine_version="1.0", form=form)
    return BundleArchive.open(target)


def craft_zip(path, entries, manifest_files=None, *, manifest_doc=None, compress=None):
    """Write a zip with zipfile directly (bypassing our writer) to build hostile bundles.

    ``entries``: list of (name, data). By default the manifest lists every entry.
    """
    if manifest_doc is None:
        if manifest_files is None:
            manifest_files = {n: d for n, d in entries}
        manifest_doc = {
            "format": FORMAT_NAME,
            "format_version": 1,
            "engine_version": "1.0",
            "files": {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                      for n, d in manifest_files.items()},
        }
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries:
            info = zipfile.ZipInfo(name)
            info.compress_type = (compress or {}).get(name, zipfile.ZIP_STORED)
            zf.writestr(info, data)
        zf.writestr(zipfile.ZipInfo("manifest.json"), json.dumps(manifest_doc))
    return path


def tree_snapshot(root) -> dict:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["zip", "dir", "memory"])
def test_round_trip(tmp_path, form):
    members = sample_members()
    expected_manifest = Manifest.from_json(
        BundleArchive.open(bundle_to_bytes(members, engine_version="1.0")).manifest.to_json())
    with open_form(tmp_path, form) as a:
        assert a.form == form
        assert a.names() == sorted(members)
        assert "graph.json" in a and "nope" not in a and "manifest.json" not in a
        for name, data in members.items():
            assert a.read(name) == member_bytes(data)
            assert bytes(a.map(name)) == member_bytes(data)
            assert a.manifest.files[name] == ManifestEntry(
                len(member_bytes(data)), hashlib.sha256(member_bytes(data)).hexdigest())
        assert a.manifest == expected_manifest
        assert a.identity == a.manifest.identity
        assert a.manifest.format_version == (FORMAT_VERSION, 0)
        assert a.manifest.engine_version == "1.0"
        assert a.verify() == []
        assert a.verify(["graph.json"]) == []
        assert (a.path is None) == (form == "memory")
        assert (a.data_offset("weights.bin") is None) == (form != "zip")


def test_write_returns_manifest_and_is_deterministic(tmp_path):
    members = sample_members()
    m = write_bundle(tmp_path / "b.cgb", members, engine_version="1.0")
    blob = (tmp_path / "b.cgb").read_bytes()
    assert blob == bundle_to_bytes(members, engine_version="1.0")
    with BundleArchive.open(tmp_path / "b.cgb") as a:
        assert a.manifest == m
    with zipfile.ZipFile(tmp_path / "b.cgb") as zf:
        infos = zf.infolist()
        assert zf.testzip() is None
        # sorted metadata first, weights.bin last before the manifest, manifest last
        assert [i.filename for i in infos] == sorted(n for n in members if n != "weights.bin") + [
            "weights.bin", "manifest.json"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
        assert json.loads(zf.read("manifest.json"))["format"] == FORMAT_NAME


@pytest.mark.parametrize("source", [bytes, bytearray, memoryview])
def test_open_memory_accepts_bytes_like(source):
    blob = bundle_to_bytes(sample_members(), engine_version="1.0")
    with BundleArchive.open(source(blob)) as a:
        assert a.form == "memory" and a.verify() == []
        assert a.read("graph.json") == b'{"nodes": []}'


def test_numpy_array_as_member_and_zip_directory_entries(tmp_path):
    write_bundle(tmp_path / "n.cgb", {"weights.bin": WEIGHTS.reshape(30, 100)}, engine_version="x")
    with BundleArchive.open(tmp_path / "n.cgb") as a:
        assert np.array_equal(np.frombuffer(a.map("weights.bin"), np.float32), WEIGHTS)
    path = tmp_path / "d.cgb"
    with zipfile.ZipFile(path, "w") as zf:  # a zip made by other tools may carry directory entries
        zf.writestr(zipfile.ZipInfo("kernels/"), b"")
        zf.writestr(zipfile.ZipInfo("kernels/a"), b"A")
        doc = {"format": FORMAT_NAME, "format_version": 1, "engine_version": "1",
               "files": {"kernels/a": {"size": 1, "sha256": hashlib.sha256(b"A").hexdigest()}}}
        zf.writestr(zipfile.ZipInfo("manifest.json"), json.dumps(doc))
    with BundleArchive.open(path) as a:
        assert a.names() == ["kernels/a"] and a.read("kernels/a") == b"A"


# ---- weights alignment ------------------------------------------------------------------------
def check_alignment(blob: bytes, weights: bytes) -> None:
    with zipfile.ZipFile(__import__("io").BytesIO(blob)) as zf:
        info = zf.getinfo("weights.bin")
        assert zf.read("weights.bin") == weights
        assert zf.testzip() is None
    off = local_data_offset(blob, info.header_offset)
    assert off % WEIGHTS_ALIGNMENT == 0
    assert blob[off:off + len(weights)] == weights
    # the padding is a zipalign-style 0xD935 extra record: id, length, u16 alignment, zeros
    nlen, elen = struct.unpack_from("<HH", blob, info.header_offset + 26)
    extra = blob[info.header_offset + 30 + nlen:info.header_offset + 30 + nlen + elen]
    records, pos = {}, 0
    while pos < len(extra):
        hid, length = struct.unpack_from("<HH", extra, pos)
        records[hid] = extra[pos + 4:pos + 4 + length]
        pos += 4 + length
    assert pos == len(extra)
    pad = records[0xD935]
    assert struct.unpack_from("<H", pad)[0] == WEIGHTS_ALIGNMENT and set(pad[2:]) <= {0}
    with BundleArchive.open(blob) as a:
        assert bytes(a.map("weights.bin")) == weights


@pytest.mark.parametrize("names_sizes, wsize", [
    ({}, 1),
    ({"a": 0}, 4096),
    ({"graph.json": 4096 - 30 - 11 - 6}, 10),  # data would land exactly on a boundary without padding
    ({"x" * 200: 4000, "k/" + "y" * 50: 1}, 8193),
    ({f"m{i}": i * 37 for i in range(40)}, 0),
    ({"zzz_after_weights_alphabetically": 5000}, 123),
])
def test_weights_offset_aligned(tmp_path, names_sizes, wsize):
    members = {n: bytes([i % 251]) * s for i, (n, s) in enumerate(names_sizes.items())}
    weights = os.urandom(wsize)
    members["weights.bin"] = weights
    write_bundle(tmp_path / "w.cgb", members, engine_version="1")
    blob = (tmp_path / "w.cgb").read_bytes()
    check_alignment(blob, weights)
    with BundleArchive.open(tmp_path / "w.cgb") as a:
        with zipfile.ZipFile(tmp_path / "w.cgb") as zf:
            expected = local_data_offset(blob, zf.getinfo("weights.bin").header_offset)
        assert a.data_offset("weights.bin") == expected
        for name in a.names():
            with zipfile.ZipFile(tmp_path / "w.cgb") as zf:
                assert local_data_offset(blob, zf.getinfo(name).header_offset) == a.data_offset(name)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.text("abcdefghij/_.-", min_size=1, max_size=40), st.integers(0, 6000), max_size=8),
    st.integers(0, 9000),
)
def test_weights_alignment_property(names_sizes, wsize):
    members = {n: b"q" * s for n, s in names_sizes.items()
               if manifest_mod.name_problem(n) is None and n != "manifest.json"}
    members = {n: d for n, d in members.items()
               if not any(o.startswith(n + "/") for o in members)}  # no file/dir conflicts
    weights = bytes(range(256)) * (wsize // 256) + b"w" * (wsize % 256)
    members["weights.bin"] = weights
    blob = bundle_to_bytes(members, engine_version="1")
    check_alignment(blob, weights)


@pytest.mark.skipif(shutil.which("unzip") is None, reason="unzip not installed")
def test_unzip_accepts_bundle(tmp_path):
    write_bundle(tmp_path / "b.cgb", sample_members(), engine_version="1.0")
    r = subprocess.run(["unzip", "-t", str(tmp_path / "b.cgb")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_zip64_records(tmp_path, monkeypatch):
    """Members/offsets past 4 GiB use zip64 records; exercised by lowering the threshold."""
    monkeypatch.setattr(writer_mod, "_ZIP64_LIMIT", 100)
    members = {"big.bin": b"B" * 300, "small": b"s", "weights.bin": os.urandom(5000)}
    write_bundle(tmp_path / "z.cgb", members, engine_version="1")
    blob = (tmp_path / "z.cgb").read_bytes()
    assert b"PK\x06\x06" in blob and b"PK\x06\x07" in blob  # zip64 end records
    check_alignment(blob, members["weights.bin"])
    with zipfile.ZipFile(tmp_path / "z.cgb") as zf:
        assert zf.read("big.bin") == members["big.bin"]
    with BundleArchive.open(tmp_path / "z.cgb") as a:
        assert a.verify() == [] and a.read("big.bin") == members["big.bin"]
    if shutil.which("unzip"):
        r = subprocess.run(["unzip", "-t", str(tmp_path / "z.cgb")], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


# ---- map() ------------------------------------------------------------------------------------
def test_map_is_zero_copy_mmap(tmp_path):
    write_bundle(tmp_path / "b.cgb", sample_members(), engine_version="1.0")
    a = BundleArchive.open(tmp_path / "b.cgb")
    view = a.map("weights.bin")
    assert isinstance(view.obj, mmap.mmap) and view.readonly
    arr = np.frombuffer(view, dtype=np.uint8)
    whole = np.frombuffer(view.obj, dtype=np.uint8)
    assert arr.ctypes.data - whole.ctypes.data == a.data_offset("weights.bin")
    assert np.shares_memory(arr, np.frombuffer(a.map("weights.bin"), dtype=np.uint8))
    weights = np.frombuffer(view, dtype=np.float32, offset=64, count=WEIGHTS.size)
    assert np.array_equal(weights, WEIGHTS)
    assert len(a.map("empty.txt")) == 0
    a.close()
    a.close()  # safe twice
    assert np.array_equal(weights, WEIGHTS)  # views handed out survive close()
    assert bytes(view[-4:]) == b"tail"
    with pytest.raises(ValueError):
        a.read("graph.json")


def test_map_dir_and_memory_forms(tmp_path):
    with open_form(tmp_path, "dir") as a:
        v = a.map("weights.bin")
        assert isinstance(v.obj, mmap.mmap) and v.readonly
    assert bytes(v[-4:]) == b"tail"
    blob = bundle_to_bytes(sample_members(), engine_version="1.0")
    with BundleArchive.open(blob) as a:
        v = a.map("weights.bin")
        assert v.readonly and v.obj is blob
        assert np.shares_memory(np.frombuffer(v, np.uint8), np.frombuffer(blob, np.uint8))


# ---- identity ---------------------------------------------------------------------------------
def test_identity_ignores_only_dispatch_table():
    def ident(members, ev="1.0"):
        return BundleArchive.open(bundle_to_bytes(members, engine_version=ev)).identity

    base = ident(sample_members(b"one"))
    assert ident(sample_members(b"two, longer")) == base
    no_dispatch = {k: v for k, v in sample_members().items() if k != "dispatch_table.txt"}
    assert ident(no_dispatch) == base
    assert ident(sample_members(b"one"), ev="2.0") == base  # identity is about content only
    changed = sample_members(b"one")
    changed["graph.json"] = b'{"nodes": [1]}'
    assert ident(changed) != base
    renamed = sample_members(b"one")
    renamed["graph2.json"] = renamed.pop("graph.json")
    assert ident(renamed) != base
    # the documented definition, recomputed independently
    m = BundleArchive.open(bundle_to_bytes(sample_members(), engine_version="1")).manifest
    entries = {n: {"size": e.size, "sha256": e.sha256} for n, e in m.files.items() if n != "dispatch_table.txt"}
    canon = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert m.identity == hashlib.sha256(canon).hexdigest()


# ---- refusals: container ----------------------------------------------------------------------
def test_truncated_bundles_refused(tmp_path):
    write_bundle(tmp_path / "b.cgb", sample_members(), engine_version="1.0")
    blob = (tmp_path / "b.cgb").read_bytes()
    with zipfile.ZipFile(tmp_path / "b.cgb") as zf:
        start_dir = zf.start_dir
    with BundleArchive.open(tmp_path / "b.cgb") as a:
        w_off = a.data_offset("weights.bin")
    cuts = [0, 2, 10, 29, 100, w_off + 100, start_dir - 1, start_dir + 10, len(blob) - 30, len(blob) - 10,
            len(blob) - 1]
    for cut in cuts:
        p = tmp_path / f"cut{cut}.cgb"
        p.write_bytes(blob[:cut])
        with pytest.raises(BundleError, match=r"truncated bundle|not a bundle") as ei:
            BundleArchive.open(p)
        assert isinstance(ei.value, ValueError)
        with pytest.raises(BundleError, match=r"truncated bundle|not a bundle"):
            BundleArchive.open(blob[:cut])
    (tmp_path / "mid.cgb").write_bytes(blob[:w_off + 100])
    with pytest.raises(BundleError, match="truncated bundle"):
        BundleArchive.open(tmp_path / "mid.cgb")


def test_not_a_zip_refused(tmp_path):
    p = tmp_path / "x.cgb"
    p.write_bytes(b"hello, I am a text file\n" * 100)
    with pytest.raises(BundleError, match="not a bundle"):
        BundleArchive.open(p)
    with pytest.raises(BundleError, match="not a bundle"):
        BundleArchive.open(b"")
    with pytest.raises(BundleError, match="not a bundle"):
        BundleArchive.open(tmp_path / "does-not-exist.cgb")
    plain = tmp_path / "plain.zip"
    with zipfile.ZipFile(plain, "w") as zf:
        zf.writestr("readme.txt", "hi")
    with pytest.raises(BundleError, match="manifest.json") as ei:
        BundleArchive.open(plain)
    assert ei.value.member == "manifest.json"


@pytest.mark.parametrize("form", ["zip", "dir", "memory"])
@pytest.mark.parametrize("victim", ["graph.json", "weights.bin"])
def test_flipped_byte_detected(tmp_path, form, victim):
    members = sample_members()
    if form == "zip":
        write_bundle(tmp_path / "b.cgb", members, engine_version="1")
        with BundleArchive.open(tmp_path / "b.cgb") as a:
            off = a.data_offset(victim)
        blob = bytearray((tmp_path / "b.cgb").read_bytes())
        blob[off + 5] ^= 0xFF
        (tmp_path / "b.cgb").write_bytes(blob)
        source = tmp_path / "b.cgb"
    elif form == "dir":
        write_bundle(tmp_path / "d", members, engine_version="1", form="dir")
        path = tmp_path / "d" / victim
        data = bytearray(path.read_bytes())
        data[5] ^= 0xFF
        path.write_bytes(data)
        source = tmp_path / "d"
    else:
        blob = bytearray(bundle_to_bytes(members, engine_version="1"))
        start = blob.find(member_bytes(members[victim]))
        blob[start + 5] ^= 0xFF
        source = bytes(blob)
    with BundleArchive.open(source) as a:
        with pytest.raises(BundleError, match="sha256 mismatch: the member is corrupted or was modified") as ei:
            a.read(victim)
        assert ei.value.member == victim and str(ei.value).startswith(victim)
        assert a.verify() == [victim]
        assert a.verify([n for n in a.names() if n != victim]) == []
        assert len(a.map(victim)) == len(member_bytes(members[victim]))  # map() does not hash


def test_unlisted_and_missing_members_refused(tmp_path):
    p = craft_zip(tmp_path / "u.cgb", [("a", b"A"), ("sneaky.sh", b"rm -rf /")],
                  manifest_files={"a": b"A"})
    with pytest.raises(BundleError, match="not listed in manifest.json") as ei:
        BundleArchive.open(p)
    assert ei.value.member == "sneaky.sh"
    p = craft_zip(tmp_path / "m.cgb", [("a", b"A")], manifest_files={"a": b"A", "b/c": b"C"})
    with pytest.raises(BundleError, match="missing from the bundle") as ei:
        BundleArchive.open(p)
    assert ei.value.member == "b/c"
    # directory form: an extra file, then a deleted one
    write_bundle(tmp_path / "d", sample_members(), engine_version="1", form="dir")
    (tmp_path / "d" / "kernels" / "extra.ptx").write_bytes(b"?")
    with pytest.raises(BundleError, match="not listed") as ei:
        BundleArchive.open(tmp_path / "d")
    assert ei.value.member == "kernels/extra.ptx"
    os.unlink(tmp_path / "d" / "kernels" / "extra.ptx")
    os.unlink(tmp_path / "d" / "graph.json")
    with pytest.raises(BundleError, match="missing") as ei:
        BundleArchive.open(tmp_path / "d")
    assert ei.value.member == "graph.json"


def test_size_mismatch_with_manifest_refused(tmp_path):
    doc = {"format": FORMAT_NAME, "format_version": 1, "engine_version": "1",
           "files": {"a": {"size": 2, "sha256": hashlib.sha256(b"A").hexdigest()}}}
    p = craft_zip(tmp_path / "s.cgb", [("a", b"A")], manifest_doc=doc)
    with pytest.raises(BundleError, match="manifest.json says 2") as ei:
        BundleArchive.open(p)
    assert ei.value.member == "a"


@pytest.mark.parametrize("bad", ["../evil", "/abs", "a/../../b", "a\\b", "C:/x", "a//b", "./a", "a/", "x/./y"])
def test_unsafe_names_in_zip_refused(tmp_path, bad):
    p = craft_zip(tmp_path / "n.cgb", [("ok", b"1"), (bad, b"2")], manifest_files={"ok": b"1"})
    if bad.endswith("/"):  # a directory entry: ignored, and it carries no data
        with BundleArchive.open(p) as a:
            assert a.names() == ["ok"]
        return
    with pytest.raises(BundleError) as ei:
        BundleArchive.open(p)
    assert ei.value.member == bad and repr(bad) in str(ei.value)
    # listed in the manifest instead: refused while parsing the manifest, with the JSON path
    p2 = craft_zip(tmp_path / "n2.cgb", [("ok", b"1")], manifest_files={"ok": b"1", bad: b"2"})
    with pytest.raises(BundleError) as ei:
        BundleArchive.open(p2)
    assert ei.value.member == "manifest.json" and ei.value.path == f"$.files[{bad!r}]"


def test_nul_in_name_refused(tmp_path):
    p = craft_zip(tmp_path / "nul.cgb", [("ok", b"1"), ("evilXname", b"2")], manifest_files={"ok": b"1"})
    p.write_bytes(p.read_bytes().replace(b"evilXname", b"evil\x00name"))
    with pytest.raises(BundleError, match="NUL") as ei:
        BundleArchive.open(p)
    assert ei.value.member == "evil\x00name"


def test_dir_form_refuses_escaping_symlinks_and_special_files(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"secret")
    d = tmp_path / "d"
    write_bundle(d, {"graph.json": b"{}", "alias.json": b"{}"}, engine_version="1", form="dir")
    # a symlink inside the tree to a regular file inside the tree is fine
    os.unlink(d / "alias.json")
    os.symlink("graph.json", d / "alias.json")
    with BundleArchive.open(d) as a:
        assert a.read("alias.json") == b"{}"
    for link_target in [str(outside), "../outside.txt"]:
        os.symlink(link_target, d / "link")
        with pytest.raises(BundleError, match="outside the bundle directory") as ei:
            BundleArchive.open(d)
        assert ei.value.member == "link"
        os.unlink(d / "link")
    os.symlink(str(tmp_path), d / "dirlink")
    with pytest.raises(BundleError, match="outside") as ei:
        BundleArchive.open(d)
    os.unlink(d / "dirlink")
    os.symlink("kernels_dir", d / "subdir_link")
    os.mkdir(d / "kernels_dir")
    with pytest.raises(BundleError, match="not a regular file") as ei:
        BundleArchive.open(d)
    assert ei.value.member == "subdir_link"
    os.unlink(d / "subdir_link")
    os.rmdir(d / "kernels_dir")
    os.symlink("nowhere", d / "dangling")
    with pytest.raises(BundleError, match="dangling") as ei:
        BundleArchive.open(d)
    os.unlink(d / "dangling")
    if hasattr(os, "mkfifo"):
        os.mkfifo(d / "fifo")
        with pytest.raises(BundleError, match="not a regular file") as ei:
            BundleArchive.open(d)
        assert ei.value.member == "fifo"
        os.unlink(d / "fifo")
    (d / "a\\b").write_bytes(b"x")
    with pytest.raises(BundleError, match="backslash") as ei:
        BundleArchive.open(d)
    assert ei.value.member == "a\\b"


def test_compressed_member_refused(tmp_path):
    p = craft_zip(tmp_path / "c.cgb", [("graph.json", b"{}" * 100)],
                  compress={"graph.json": zipfile.ZIP_DEFLATED})
    with pytest.raises(BundleError, match="compression method 8") as ei:
        BundleArchive.open(p)
    assert ei.value.member == "graph.json"


def test_inconsistent_zip_directory_refused(tmp_path):
    write_bundle(tmp_path / "b.cgb", {"graph.json": b"{}" * 10, "other": b"o"}, engine_version="1")
    blob = (tmp_path / "b.cgb").read_bytes()
    with zipfile.ZipFile(tmp_path / "b.cgb") as zf:
        hoff = zf.getinfo("graph.json").header_offset
        central = zf.start_dir
    # local name differs from the central directory's
    bad = bytearray(blob)
    bad[hoff + 30:hoff + 30 + 10] = b"graph.jsoX"
    with pytest.raises(BundleError, match="local header names") as ei:
        BundleArchive.open(bytes(bad))
    assert ei.value.member == "graph.json"
    # local size differs from the central directory's
    bad = bytearray(blob)
    struct.pack_into("<II", bad, hoff + 18, 19, 19)
    with pytest.raises(BundleError, match="local header says 19") as ei:
        BundleArchive.open(bytes(bad))
    # local method differs from the central directory's
    bad = bytearray(blob)
    struct.pack_into("<H", bad, hoff + 8, zipfile.ZIP_DEFLATED)
    with pytest.raises(BundleError, match="compression method 8") as ei:
        BundleArchive.open(bytes(bad))
    assert ei.value.member == "graph.json"
    cd = blob.find(b"PK\x01\x02", central)
    assert blob[cd + 46:cd + 56] == b"graph.json"  # first central record (sorted order)
    # sizes (in both headers) that run the data into the next member, or past the directory
    for size, match in [(25, "overlaps member 'graph.json'"), (10**6, "past the start of the zip directory")]:
        bad = bytearray(blob)
        struct.pack_into("<II", bad, hoff + 18, size, size)
        struct.pack_into("<II", bad, cd + 20, size, size)
        with pytest.raises(BundleError, match=match):
            BundleArchive.open(bytes(bad))
    # local header offset pointing at garbage
    bad = bytearray(blob)
    struct.pack_into("<I", bad, cd + 42, hoff + 3)
    with pytest.raises(BundleError, match="not a local file header"):
        BundleArchive.open(bytes(bad))


def test_duplicate_entries_refused(tmp_path):
    p = tmp_path / "dup.cgb"
    with pytest.warns(UserWarning):
        craft_zip(p, [("a", b"1"), ("a", b"1")], manifest_files={"a": b"1"})
    with pytest.raises(BundleError, match="more than once") as ei:
        BundleArchive.open(p)
    assert ei.value.member == "a"


# ---- refusals: manifest -----------------------------------------------------------------------
def good_doc() -> dict:
    return {"format": FORMAT_NAME, "format_version": 1, "engine_version": "1.0",
            "files": {"a": {"size": 1, "sha256": hashlib.sha256(b"A").hexdigest()}}}


@pytest.mark.parametrize("raw", [2, "2", "2.0", "7.1"])
def test_newer_format_version_refused_with_upgrade_message(tmp_path, raw):
    doc = good_doc()
    doc["format_version"] = raw
    doc["files"] = {"future_thing": "unknown shape"}  # the version is checked before the shape
    p = craft_zip(tmp_path / "v.cgb", [("a", b"A")], manifest_doc=doc)
    with pytest.raises(BundleError) as ei:
        BundleArchive.open(p)
    assert f"bundle format_version {raw} is newer than this engine supports (1): upgrade engine" in str(ei.value)


@pytest.mark.parametrize("raw, expected", [(1, (1, 0)), ("1", (1, 0)), ("1.3", (1, 3))])
def test_minor_versions_accepted(tmp_path, raw, expected):
    doc = good_doc()
    doc["format_version"] = raw
    doc["new_minor_field"] = {"ignored": True}
    with BundleArchive.open(craft_zip(tmp_path / "v.cgb", [("a", b"A")], manifest_doc=doc)) as a:
        assert a.manifest.format_version == expected
        assert a.read("a") == b"A"
    assert Manifest.from_json(a.manifest.to_json()) == a.manifest


def _mutate(doc, path, value):
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


@pytest.mark.parametrize("mutation, path", [
    ((("files", "a", "sha256"), "xyz"), "$.files['a'].sha256"),
    ((("files", "a", "sha256"), "A" * 64), "$.files['a'].sha256"),
    ((("files", "a", "size"), -1), "$.files['a'].size"),
    ((("files", "a", "size"), "1"), "$.files['a'].size"),
    ((("files", "a", "size"), True), "$.files['a'].size"),
    ((("files", "a"), [1, "x"]), "$.files['a']"),
    ((("files",), ["a"]), "$.files"),
    ((("files", "../x"), {"size": 1, "sha256": "0" * 64}), "$.files['../x']"),
    ((("files", "manifest.json"), {"size": 1, "sha256": "0" * 64}), "$.files['manifest.json']"),
    ((("engine_version",), 3), "$.engine_version"),
    ((("format",), "other.format"), "$.format"),
    ((("format_version",), "one"), "$.format_version"),
    ((("format_version",), 0), "$.format_version"),
])
def test_bad_manifest_shape_names_json_path(tmp_path, mutation, path):
    doc = _mutate(good_doc(), *mutation)
    with pytest.raises(BundleError) as ei:
        Manifest.from_json(json.dumps(doc).encode())
    assert ei.value.member == "manifest.json" and ei.value.path == path
    assert str(ei.value).startswith(f"manifest.json @ {path}: ")
    p = craft_zip(tmp_path / "m.cgb", [("a", b"A")], manifest_doc=doc)
    with pytest.raises(BundleError, match=r"manifest\.json @ "):
        BundleArchive.open(p)


@pytest.mark.parametrize("raw, match", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", r"@ \$: must be a JSON object"),
    (b'{"format": "engine.bundle", "format": "engine.bundle"}', "duplicate key"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
])
def test_manifest_not_json(raw, match):
    with pytest.raises(BundleError, match=match) as ei:
        Manifest.from_json(raw)
    assert ei.value.member == "manifest.json"


# ---- limits -----------------------------------------------------------------------------------
def test_documented_limits():
    assert (MAX_MEMBERS, MAX_MANIFEST_BYTES, MAX_METADATA_BYTES, WEIGHTS_ALIGNMENT) == (
        10_000, 16 * 2**20, 64 * 2**20, 4096)


def test_archive_facade_reexports_the_owners_names():
    """engine.bundle.archive, once the whole container, still exports what it did (code outside the
    repository imports from it), as the very objects of the modules that own them."""
    import engine.bundle.archive as facade
    import engine.bundle.reader as reader_mod
    import engine.bundle.zipformat as zipformat_mod

    assert sorted(facade.__all__) == sorted([
        "ZIP_MAGIC", "FORMAT_NAME", "FORMAT_VERSION", "MAX_MEMBERS", "MAX_MANIFEST_BYTES", "MAX_METADATA_BYTES",
        "WEIGHTS_ALIGNMENT", "MemberData", "ManifestEntry", "Manifest", "BundleArchive", "write_bundle",
        "check_save_target", "bundle_to_bytes", "copy_members"])
    owners = (manifest_mod, reader_mod, writer_mod, save_mod, zipformat_mod)
    for name in facade.__all__:
        (owner,) = [m for m in owners if name in m.__all__]
        assert getattr(facade, name) is getattr(owner, name), name


def test_too_many_members(tmp_path, monkeypatch):
    members = {f"m{i}": b"x" for i in range(4)}
    write_bundle(tmp_path / "b.cgb", members, engine_version="1")
    write_bundle(tmp_path / "d", members, engine_version="1", form="dir")
    monkeypatch.setattr(manifest_mod, "MAX_MEMBERS", 3)
    for source in [tmp_path / "b.cgb", tmp_path / "d", (tmp_path / "b.cgb").read_bytes()]:
        with pytest.raises(BundleError, match="limit|over"):
            BundleArchive.open(source)
    with pytest.raises(BundleError, match="too many members"):
        write_bundle(tmp_path / "c.cgb", members, engine_version="1")
    assert not (tmp_path / "c.cgb").exists()


def test_manifest_and_metadata_size_limits(tmp_path, monkeypatch):
    write_bundle(tmp_path / "b.cgb", sample_members(), engine_version="1")
    with BundleArchive.open(tmp_path / "b.cgb") as a:
        with pytest.raises(BundleError, match="over the 100-byte limit") as ei:
            a.read("weights.bin", max_size=100)
        assert ei.value.member == "weights.bin"
        assert a.read("graph.json", max_size=13) == b'{"nodes": []}'
    write_bundle(tmp_path / "d", sample_members(), engine_version="1", form="dir")
    manifest_json = (tmp_path / "d" / "manifest.json").read_bytes()
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 200)
    for source in [tmp_path / "b.cgb", tmp_path / "d"]:
        with pytest.raises(BundleError, match="manifest.json: .*200-byte limit"):
            BundleArchive.open(source)
    with pytest.raises(BundleError, match="manifest.json: .*200-byte limit"):
        Manifest.from_json(manifest_json)
    shutil.rmtree(tmp_path / "d")
    with pytest.raises(BundleError, match="manifest.json: .*200-byte limit"):
        write_bundle(tmp_path / "c.cgb", sample_members(), engine_version="1")
    assert sorted(os.listdir(tmp_path)) == ["b.cgb"]


# ---- writer refusals --------------------------------------------------------------------------
@pytest.mark.parametrize("members, exc, match", [
    ({"manifest.json": b"{}"}, BundleError, "written by the bundle writer"),
    ({"../x": b""}, BundleError, "'..'"),
    ({"a": b"", "a/b": b""}, BundleError, "conflicts with member 'a'"),
    ({"manifest.json/x": b""}, BundleError, "conflicts"),
    ({"a": "text, not bytes"}, TypeError, "bytes-like"),
    ({"a": [b"ok", "str chunk"]}, TypeError, "bytes-like"),
    ({"a": 5}, TypeError, "bytes-like"),
])
@pytest.mark.parametrize("form", ["zip", "dir"])
def test_writer_refusals(tmp_path, members, exc, match, form):
    with pytest.raises(exc, match=match):
        write_bundle(tmp_path / "out", members, engine_version="1", form=form)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError):
        write_bundle(tmp_path / "out", {}, engine_version="1", form="tar")


# ---- atomic saves -----------------------------------------------------------------------------
class Boom(RuntimeError):
    pass


class ExplodingChunks(Sequence):
    """A chunk sequence that fails partway through iteration (e.g. a producer hitting an error)."""

    def __init__(self, good: int, exc=Boom):
        self.good, self.exc = good, exc

    def __len__(self):
        return self.good + 1

    def __getitem__(self, i):
        if i < self.good:
            return b"\x07" * 100_000
        raise self.exc("producer failed")


class Interrupt(BaseException):
    pass


@pytest.mark.parametrize("exc", [Boom, Interrupt])
def test_atomic_zip_save(tmp_path, exc):
    target = tmp_path / "b.cgb"
    write_bundle(target, sample_members(), engine_version="1")
    before = target.read_bytes()
    bad = dict(sample_members(), **{"weights.bin": ExplodingChunks(5, exc)})
    with pytest.raises(exc):
        write_bundle(target, bad, engine_version="2")
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["b.cgb"]
    bad = dict(sample_members(), **{"kernels/a.ptx": ExplodingChunks(1, exc)})
    with pytest.raises(exc):
        write_bundle(tmp_path / "new.cgb", bad, engine_version="2")
    assert os.listdir(tmp_path) == ["b.cgb"]
    # and a successful save replaces it, leaving nothing else behind
    write_bundle(target, {"graph.json": b"v2"}, engine_version="2")
    assert os.listdir(tmp_path) == ["b.cgb"]
    with BundleArchive.open(target) as a:
        assert a.read("graph.json") == b"v2"


@pytest.mark.parametrize("exc", [Boom, Interrupt])
def test_atomic_dir_save(tmp_path, exc):
    target = tmp_path / "d"
    write_bundle(target, sample_members(), engine_version="1", form="dir")
    before = tree_snapshot(target)
    for victim in ["weights.bin", "kernels/a.ptx"]:
        bad = dict(sample_members(), **{victim: ExplodingChunks(3, exc)})
        with pytest.raises(exc):
            write_bundle(target, bad, engine_version="2", form="dir")
        assert tree_snapshot(target) == before
        assert os.listdir(tmp_path) == ["d"]
    write_bundle(target, {"graph.json": b"v2"}, engine_version="2", form="dir")
    assert os.listdir(tmp_path) == ["d"]
    assert tree_snapshot(target) .keys() == {"graph.json", "manifest.json"}


def test_replacing_across_forms(tmp_path):
    target = tmp_path / "b.cgb"
    write_bundle(target, {"a": b"zip"}, engine_version="1")
    write_bundle(target, {"a": b"dir"}, engine_version="1", form="dir")
    assert target.is_dir()
    with BundleArchive.open(target) as a:
        assert a.form == "dir" and a.read("a") == b"dir"
    write_bundle(target, {"a": b"zip again"}, engine_version="1")
    assert target.is_file() and os.listdir(tmp_path) == ["b.cgb"]
    with BundleArchive.open(target) as a:
        assert a.form == "zip" and a.read("a") == b"zip again"


@pytest.mark.parametrize("form", ["zip", "dir"])
def test_copy_members_resave_in_place(tmp_path, form):
    target = tmp_path / "b"
    write_bundle(target, sample_members(b"old dispatch"), engine_version="1", form=form)
    a = BundleArchive.open(target)
    old_identity = a.identity
    old_weights = a.map("weights.bin")
    members = copy_members(a, {"dispatch_table.txt": b"new dispatch", "empty.txt": None})
    assert isinstance(members["weights.bin"], memoryview) and isinstance(members["weights.bin"].obj, mmap.mmap)
    assert "manifest.json" not in members and "empty.txt" not in members
    write_bundle(target, members, engine_version="1", form=form)  # while `a` is still open
    assert bytes(old_weights[-4:]) == b"tail"
    a.close()
    with BundleArchive.open(target) as b:
        assert b.read("dispatch_table.txt") == b"new dispatch"
        assert "empty.txt" not in b
        assert b.verify() == []
        assert b.read("weights.bin") == member_bytes(sample_members()["weights.bin"])
        with_empty = copy_members(b, {"empty.txt": b""})
    assert BundleArchive.open(bundle_to_bytes(with_empty, engine_version="1")).identity == old_identity


# ---- misc API ---------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["zip", "dir", "memory"])
def test_unknown_member_and_closed(tmp_path, form):
    a = open_form(tmp_path, form)
    with pytest.raises(BundleError, match="no such member") as ei:
        a.read("nope.json")
    assert ei.value.member == "nope.json"
    with pytest.raises(BundleError):
        a.map("nope.json")
    with pytest.raises(BundleError):
        a.verify(["nope.json"])
    assert "BundleArchive" in repr(a)
    a.close()
    a.close()
    with pytest.raises(ValueError, match="closed"):
        a.map("graph.json")


@pytest.mark.parametrize("form", ["zip", "dir", "memory"])
def test_concurrent_reads(tmp_path, form):
    members = sample_members()
    expected = {n: member_bytes(d) for n, d in members.items()}
    with open_form(tmp_path, form, members) as a:
        barrier = threading.Barrier(8)

        def worker(seed):
            barrier.wait()
            names = sorted(expected)
            for i in range(40):
                name = names[(seed + i) % len(names)]
                assert a.read(name) == expected[name]
                assert bytes(a.map(name)) == expected[name]
            assert a.verify() == []
            return True

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(worker, range(8)))


def test_dir_form_member_vanishing_after_open(tmp_path):
    write_bundle(tmp_path / "d", sample_members(), engine_version="1", form="dir")
    with BundleArchive.open(tmp_path / "d") as a:
        os.unlink(tmp_path / "d" / "graph.json")
        with pytest.raises(BundleError, match="cannot be read") as ei:
            a.read("graph.json")
        assert ei.value.member == "graph.json"
        with pytest.raises(BundleError, match="cannot be mapped"):
            a.map("graph.json")
        assert a.verify() == ["graph.json"]
    shutil.rmtree(tmp_path / "d" / "kernels")
    os.unlink(tmp_path / "d" / "manifest.json")
    with pytest.raises(BundleError, match="not an engine bundle") as ei:
        BundleArchive.open(tmp_path / "d")
    assert ei.value.member == "manifest.json"


def test_manifest_member_count_limit(monkeypatch):
    doc = good_doc()
    doc["files"].update({f"m{i}": {"size": 0, "sha256": "0" * 64} for i in range(3)})
    monkeypatch.setattr(manifest_mod, "MAX_MEMBERS", 3)
    with pytest.raises(BundleError, match="over the limit of 3") as ei:
        Manifest.from_json(json.dumps(doc))
    assert ei.value.path == "$.files"


def test_writer_argument_types(tmp_path):
    with pytest.raises(TypeError, match="C-contiguous"):
        bundle_to_bytes({"w": np.arange(10)[::2]}, engine_version="1")
    with pytest.raises(TypeError, match="engine_version"):
        bundle_to_bytes({"a": b""}, engine_version=1)
    with pytest.raises(TypeError, match="mapping"):
        bundle_to_bytes([("a", b"")], engine_version="1")
    with pytest.raises(ValueError):
        ManifestEntry(-1, "0" * 64)
    with pytest.raises(ValueError):
        ManifestEntry(1, "ABC")


def test_dir_swap_failure_restores_old_tree(tmp_path, monkeypatch):
    target = tmp_path / "d"
    write_bundle(target, sample_members(), engine_version="1", form="dir")
    before = tree_snapshot(target)
    real_rename, calls = os.rename, []

    def flaky_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old tree moved aside; moving the new one in fails
            raise OSError("injected rename failure")
        return real_rename(src, dst)

    monkeypatch.setattr(save_mod, "_exchange", lambda a, b: False)  # the portable two-rename swap
    monkeypatch.setattr(os, "rename", flaky_rename)
    with pytest.raises(OSError, match="injected"):
        write_bundle(target, {"graph.json": b"v2"}, engine_version="2", form="dir")
    monkeypatch.undo()
    assert tree_snapshot(target) == before
    assert os.listdir(tmp_path) == ["d"]


def test_local_header_offset_outside_archive(tmp_path):
    write_bundle(tmp_path / "b.cgb", {"graph.json": b"{}", "other": b"o"}, engine_version="1")
    blob = bytearray((tmp_path / "b.cgb").read_bytes())
    with zipfile.ZipFile(tmp_path / "b.cgb") as zf:
        cd = blob.find(b"PK\x01\x02", zf.start_dir)
    struct.pack_into("<I", blob, cd + 42, len(blob) - 10)
    with pytest.raises(BundleError, match="outside the archive") as ei:
        BundleArchive.open(bytes(blob))
    assert ei.value.member == "graph.json"
