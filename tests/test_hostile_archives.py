"""Hostile bundles at the container level (issue 12): format_version, text encoding, zip layout,
weights.npz and member names.

Every case is a real file (a zip written with ``zipfile`` or byte by byte, a directory bundle, or
bytes) read through the public API. Each asserts the exception type, that the message is one line,
and that it names the member and JSON path (or the array) at fault.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import json
import os
import struct
import zipfile
import zlib

import numpy as np
import pytest

import engine
import engine.bundle.manifest as manifest_mod
import engine.bundle.npz as npz_mod
from engine.bundle.contents import read_bundle
from engine.bundle.save import write_bundle
from engine.bundle.writer import bundle_to_bytes
from engine.demo.mlp import mlp_weights
from engine.errors import BundleError

MANIFEST = "manifest.json"


# ---- helpers ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def members(mlp_bundle) -> dict[str, bytes]:
    """Every member of the example MLP bundle except the manifest (which writers recompute)."""
    with zipfile.ZipFile(mlp_bundle) as zf:
        return {n: zf.read(n) for n in zf.namelist() if n != MANIFEST}


def manifest_bytes(files: dict[str, bytes], **overrides) -> bytes:
    doc = {"format": "engine.bundle", "format_version": 1, "engine_version": "test",
           "files": {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}}
    doc.update(overrides)
    return json.dumps(doc).encode()


def zip_bundle(files: dict[str, bytes], manifest: bytes | None = None) -> bytes:
    """A stored zip written by zipfile (not the engine's writer), manifest last; listing every file by default."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name), data)
        zf.writestr(zipfile.ZipInfo(MANIFEST), manifest if manifest is not None else manifest_bytes(files))
    return buf.getvalue()


def raw_zip(entries: list[tuple[str, bytes]], *, prefix: bytes = b"", after: dict[str, bytes] | None = None) -> bytes:
    """A stored zip built byte by byte, with offsets that really point at each local header:
    ``prefix`` goes before the first entry, ``after[name]`` right after that entry's data."""
    out, central = bytearray(prefix), []
    for name, data in entries:
        raw, crc, offset = name.encode("utf-8", "surrogatepass"), zlib.crc32(data), len(out)
        flags = 0 if name.isascii() else 0x0800  # bit 11: the name is UTF-8
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, flags, 0, 0, 33, crc, len(data), len(data), len(raw), 0)
        out += raw + data + (after or {}).get(name, b"")
        central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, flags, 0, 0, 33, crc, len(data),
                                   len(data), len(raw), 0, 0, 0, 0, 0, offset) + raw)
    directory, cd_offset = b"".join(central), len(out)
    out += directory + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(central), len(central), len(directory),
                                   cd_offset, 0)
    return bytes(out)


def with_manifest(files: dict[str, bytes]) -> list[tuple[str, bytes]]:
    return [*files.items(), (MANIFEST, manifest_bytes(files))]


def refused(source, member: str | None, path: str | None = None) -> BundleError:
    """read_bundle(source) must raise a one-line BundleError naming ``member`` (and ``path``)."""
    with pytest.raises(BundleError) as ei:
        read_bundle(source)
    err = ei.value
    text = str(err)
    assert "\n" not in text and "\r" not in text and text.isprintable(), text
    assert err.member == member, text
    assert err.path == path, text
    if member is not None:
        shown = member.encode("unicode_escape").decode() if not member.isprintable() else member
        assert text.startswith(f"{shown} @ {path}: " if path else f"{shown}: "), text
    return err


def flag_member(blob: bytes, name: str, flag: int) -> bytes:
    """Set a general-purpose flag bit on ``name`` in both its local and its central header."""
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        info, start_dir = zf.getinfo(name), zf.start_dir
    out = bytearray(blob)
    struct.pack_into("<H", out, info.header_offset + 6, info.flag_bits | flag)
    pos = start_dir
    while True:  # walk the central records to ``name``'s
        nlen, elen, clen = struct.unpack_from("<HHH", out, pos + 28)
        if out[pos + 46:pos + 46 + nlen] == name.encode():
            break
        pos += 46 + nlen + elen + clen
    struct.pack_into("<H", out, pos + 8, info.flag_bits | flag)
    return bytes(out)


# ---- 1. format_version ------------------------------------------------------------------------
@pytest.mark.parametrize("version", [
    pytest.param("1" * 5000, id="5000-digits"),  # past Python's int() digit limit: once a bare ValueError
    pytest.param("1." + "0" * 5000, id="5000-digit-minor"),
    pytest.param("\u0661", id="arabic-indic-one"),  # str.isdigit() and int() accept it
    pytest.param("\u00b2", id="superscript-two"),  # isdigit() but not int()
    "1_0", " 1", "+1", "1.", ".1", "1.2.3",
])
def test_format_version_strings_are_ascii_and_bounded(members, version):
    blob = zip_bundle(members, manifest_bytes(members, format_version=version))
    err = refused(blob, MANIFEST, "$.format_version")
    assert "ASCII digits" in str(err) and len(str(err)) < 300


def test_format_version_huge_json_integer(members):
    raw = manifest_bytes(members).replace(b'"format_version": 1', b'"format_version": ' + b"9" * 5000)
    err = refused(zip_bundle(members, raw), MANIFEST, "$.format_version")
    assert "(5000 characters)" in str(err)


def test_manifest_size_beyond_int64(members):
    doc = json.loads(manifest_bytes(members))
    doc["files"]["meta.json"]["size"] = "@SIZE@"
    text = json.dumps(doc).replace('"@SIZE@"', "4" * 30)
    err = refused(zip_bundle(members, text.encode()), MANIFEST, "$.files['meta.json'].size")
    assert "at most 2**63-1" in str(err)


# ---- 2. strict UTF-8 --------------------------------------------------------------------------
@pytest.mark.parametrize("encode, what", [
    (lambda t: t.encode("utf-16"), "byte-order mark"),             # BOM + UTF-16: json.loads(bytes) took it
    (lambda t: t.encode("utf-16-le"), "NUL byte"),                  # no BOM: valid UTF-8 full of NULs
    (lambda t: t.encode("utf-32"), "byte-order mark"),
    (lambda t: codecs.BOM_UTF8 + t.encode(), "byte-order mark (EF BB BF)"),
    (lambda t: t.replace("test", "t\u00e9st").encode("latin-1"), "invalid continuation byte 0xe9 at line 1"),
])
def test_manifest_must_be_utf8(members, encode, what):
    raw = encode(manifest_bytes(members).decode())
    err = refused(zip_bundle(members, raw), MANIFEST)
    assert what in str(err)


@pytest.mark.parametrize("member", ["meta.json", "kernels/0/meta.json", "graph_string.txt", "dispatch_table.txt"])
@pytest.mark.parametrize("encode", [
    lambda t: codecs.BOM_UTF8 + t.encode(),
    lambda t: t.encode("utf-16"),
    lambda t: t.encode("utf-16-le"),
    lambda t: t.encode() + b"\xff",
])
def test_text_members_must_be_utf8(members, member, encode):
    files = dict(members)
    text = files[member].decode() if member in files else "batch\n1 0 0 0 0 0\n"
    files[member] = encode(text)
    refused(bundle_to_bytes(files, engine_version="test"), member)


# ---- 3. zip layout ----------------------------------------------------------------------------
def test_raw_zip_helper_builds_a_valid_bundle(members):
    with read_bundle(raw_zip(with_manifest(members))).archive as archive:
        assert archive.names() == sorted(members)


@pytest.mark.parametrize("extra, conflict", [
    ("meta.json/x", "meta.json/x"),        # a member is also the directory of another
    ("manifest.json/x", "manifest.json/x"),
    ("kernels/0/meta.json/a/b", "kernels/0/meta.json/a/b"),
])
def test_name_that_is_also_a_directory(members, extra, conflict):
    files = {**members, extra: b"x"}
    err = refused(zip_bundle(files), conflict)
    assert "both a file and a directory" in str(err)


def test_directory_entry_named_like_a_member(members):
    files = {**members, "meta.json/": b""}
    err = refused(zip_bundle(files, manifest_bytes(members)), "meta.json")
    assert "'meta.json/'" in str(err)


def test_unsafe_directory_entry_names(members):
    blob = raw_zip([("../", b""), *with_manifest(members)])
    err = refused(blob, "../")
    assert "'..' path component" in str(err)


@pytest.mark.parametrize("junk", [b"X", b"#!/bin/sh\nexit 0\n", b"PK\x03\x04" + bytes(60)],
                         ids=["one-byte", "shebang", "fake-local-header"])
def test_prepended_bytes(members, tmp_path, junk):
    blob = bundle_to_bytes(members, engine_version="test")
    path = tmp_path / "prepended.cgb"
    path.write_bytes(junk + blob)
    err = refused(path, None)
    assert f"{len(junk)} bytes precede the archive" in str(err) and str(path) in str(err)
    refused(junk + blob, None)


def test_prepended_bytes_with_adjusted_offsets(members):
    """A self-extracting style file: the offsets are right, the first member is not at offset 0."""
    err = refused(raw_zip(with_manifest(members), prefix=b"MZ" + bytes(100)), "graph_execution.json")
    assert "102 bytes between the start of the file and its local header" in str(err)


def test_bundle_concatenated_with_itself(members, tmp_path):
    blob = bundle_to_bytes(members, engine_version="test")
    path = tmp_path / "twice.cgb"
    path.write_bytes(blob + blob)
    err = refused(path, None)
    assert f"{len(blob)} bytes precede the archive" in str(err)


def test_appended_bytes(members):
    blob = bundle_to_bytes(members, engine_version="test")
    err = refused(blob + b"trailing garbage", None)
    assert "16 bytes follow the zip end record" in str(err)


def test_bytes_hidden_between_members(members):
    blob = raw_zip(with_manifest(members), after={"meta.json": b"HIDDEN"})
    err = refused(blob, "weights.json")  # the member written after meta.json
    assert "6 bytes between the end of member 'meta.json' and its local header belong to no member" in str(err)


def test_bytes_hidden_before_the_directory(members):
    blob = raw_zip(with_manifest(members), after={MANIFEST: b"HIDDEN!"})
    err = refused(blob, MANIFEST)
    assert "7 bytes between its end and the zip directory" in str(err)


def test_duplicate_names(members):
    entries = with_manifest(members)
    err = refused(raw_zip([("meta.json", members["meta.json"]), *entries]), "meta.json")
    assert "more than once" in str(err)


@pytest.mark.parametrize("flag, what", [
    (0x0008, "data descriptor"),
    (0x0001, "encrypted"),
    (0x0040, "encrypted"),
])
def test_descriptor_and_encryption_flags(members, flag, what):
    blob = flag_member(zip_bundle(members), "meta.json", flag)
    err = refused(blob, "meta.json")
    assert what in str(err)


def test_compressed_member(members):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(zipfile.ZipInfo(name), data, compress_type=zipfile.ZIP_DEFLATED if name == "meta.json" else 0)
        zf.writestr(zipfile.ZipInfo(MANIFEST), manifest_bytes(members))
    err = refused(buf.getvalue(), "meta.json")
    assert "compression method 8" in str(err)


def test_too_many_zip_entries(members, monkeypatch):
    monkeypatch.setattr(manifest_mod, "MAX_MEMBERS", 10)  # entries limit: 2 * 10 + 1
    dirs = {f"d{i}/": b"" for i in range(25)}
    err = refused(zip_bundle({**dirs}, manifest_bytes({})), None)
    assert "26 zip entries, over the limit of 21" in str(err)


# ---- 4. weights.npz ---------------------------------------------------------------------------
WEIGHT_SHAPES = [("w1", (64, 128)), ("b1", (128,)), ("w2", (128, 10)), ("b2", (10,))]  # weights_index order


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def npz_of(arrays: dict[str, bytes], compress: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compress) as zf:
        for name, data in arrays.items():
            zf.writestr(name, data)
    return buf.getvalue()


def good_arrays() -> dict[str, bytes]:
    w = mlp_weights()
    return {f"arr_{i}.npy": npy(w[name]) for i, (name, _) in enumerate(WEIGHT_SHAPES)}


def npz_bundle(members: dict[str, bytes], npz: bytes) -> bytes:
    files = {n: d for n, d in members.items() if n not in ("weights.bin", "weights.json")}
    files["weights.npz"] = npz
    return bundle_to_bytes(files, engine_version="reference")


@pytest.mark.parametrize("compress", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_valid_npz_is_read(members, mlp_bundle, registry, compress):
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    (expected,) = engine.load_compiled_graph(mlp_bundle, registry=registry).run_async([x])
    graph = engine.load_compiled_graph(npz_bundle(members, npz_of(good_arrays(), compress)), registry=registry)
    (got,) = graph.run_async([x])
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_plain_npy_named_npz(members):
    err = refused(npz_bundle(members, npy(mlp_weights()["w1"])), "weights.npz")
    assert "single .npy array" in str(err)


def test_not_a_zip_at_all(members):
    err = refused(npz_bundle(members, b"certainly not a zip"), "weights.npz")
    assert "not an .npz (zip) archive" in str(err)


def npy_header(shape: tuple, descr: str = "<f4") -> bytes:
    """An .npy (1.0) header declaring ``shape``, without data."""
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header


def huge_header(shape: tuple) -> bytes:
    """A header declaring ``shape`` followed by only 16 bytes of data."""
    return npy_header(shape) + bytes(16)


def test_header_declaring_4_tib_is_refused_before_allocating(members):
    arrays = good_arrays()
    arrays["arr_2.npy"] = huge_header((2**40,))
    err = refused(npz_bundle(members, npz_of(arrays)), "weights.npz", "arr_2")
    assert "float32[1099511627776], but tensor" in str(err) and "[128, 10]" in str(err)


def test_header_size_must_match_the_member(members):
    arrays = good_arrays()
    arrays["arr_3.npy"] = arrays["arr_3.npy"][:-4]  # b2: float32[10] with 36 data bytes
    err = refused(npz_bundle(members, npz_of(arrays)), "weights.npz", "arr_3")
    assert "(40 bytes) but the member holds 36 bytes" in str(err)


def test_deflate_bomb_is_refused_before_inflating(members):
    """8 MiB of zeros deflate to ~8 KiB: refused from the zip directory's sizes, nothing inflated."""
    arrays = good_arrays()
    del arrays["arr_1.npy"]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in arrays.items():
            zf.writestr(name, data)
        with zf.open("arr_1.npy", "w") as f:
            f.write(npy_header((2 * 2**20,)))
            f.write(bytes(8 * 2**20))
    err = refused(npz_bundle(members, buf.getvalue()), "weights.npz", "arr_1")
    assert "more than 100 times (a decompression bomb?)" in str(err)


def test_extra_array_is_refused(members):
    arrays = {**good_arrays(), "arr_4.npy": npy(np.zeros(3, np.float32))}
    err = refused(npz_bundle(members, npz_of(arrays)), "weights.npz")
    assert "'arr_4.npy'; expected only arrays arr_0" in str(err)


def test_inflated_total_limit(members, monkeypatch):
    monkeypatch.setattr(npz_mod, "MAX_NPZ_INFLATED_BYTES", 35_000)
    err = refused(npz_bundle(members, npz_of(good_arrays())), "weights.npz", "arr_2")
    assert "arrays arr_0 ... arr_2 inflate to" in str(err) and "over the 35000-byte limit" in str(err)


@pytest.mark.parametrize("mutate, path, what", [
    (lambda a: a.pop("arr_3.npy"), "arr_3", "is missing"),
    (lambda a: a.update({"arr_1.npy": npy(np.zeros(128, np.float64))}), "arr_1", "is float64[128], but tensor"),
    (lambda a: a.update({"arr_1.npy": npy(np.array([None] * 128, object))}), "arr_1", "Python objects"),
    (lambda a: a.update({"arr_1.npy": b"\x93NUMPY\x01\x00\x05\x00{bad}"}), "arr_1", "no valid .npy header"),
    (lambda a: a.update({"arr_1.npy": b"\x93NUMPY\x03\x00" + bytes(8)}), "arr_1", "format version 3.0"),
    (lambda a: a.update({"arr_1.npy": huge_header((-128,))}), "arr_1", "non-negative dimensions"),
    (lambda a: a.update({"arr_1.npy": huge_header((True,))}), "arr_1", "non-negative dimensions"),
])
def test_npz_member_checks(members, mutate, path, what):
    arrays = good_arrays()
    mutate(arrays)
    err = refused(npz_bundle(members, npz_of(arrays)), "weights.npz", path)
    assert what in str(err)


def test_npz_crc_mismatch(members):
    blob = bytearray(npz_of(good_arrays()))
    pos = blob.find(npy(mlp_weights()["b2"])[-40:])
    blob[pos] ^= 0xFF  # data changed, CRC not: the manifest hash is recomputed, zipfile's CRC catches it
    err = refused(npz_bundle(members, bytes(blob)), "weights.npz", "arr_3")
    assert "cannot be inflated" in str(err) and "CRC" in str(err)


# ---- 5. names in messages ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["evil\nname", "evil\rname", "a\u2028b", "tab\there", "bell\x07", "del\x7f",
                                  "c1\x85x"])
def test_control_characters_in_zip_names(members, name):
    err = refused(raw_zip([(name, b"x"), *with_manifest(members)]), name)
    assert "member name contains" in str(err)


def test_control_characters_in_manifest_listing(members):
    files = {**members, "forged\nINFO all good": b"x"}
    raw = manifest_bytes(files)
    err = refused(zip_bundle(members, raw), MANIFEST, "$.files['forged\\nINFO all good']")
    assert "\\n" in str(err)


def test_control_characters_in_directory_bundle(members, tmp_path):
    target = tmp_path / "bundle"
    write_bundle(target, members, engine_version="test", form="dir")
    (target / "kernels" / "x\ny").write_bytes(b"x")
    err = refused(target, "kernels/x\ny")
    assert "kernels/x\\ny" in str(err)


def test_non_utf8_file_name_in_directory_bundle(members, tmp_path):
    target = tmp_path / "bundle"
    write_bundle(target, members, engine_version="test", form="dir")
    try:
        fd = os.open(os.path.join(os.fsencode(target), b"bad\xffname"), os.O_CREAT | os.O_WRONLY, 0o644)
    except OSError:
        pytest.skip("the file system refuses non-UTF-8 names")
    os.close(fd)
    err = refused(target, "bad\udcffname")
    assert "lone surrogate" in str(err) and "bad\\udcffname" in str(err)


def test_unlisted_member_with_odd_but_printable_name_is_escaped_in_messages(members):
    """A name that is allowed (format characters such as U+202E) still prints escaped."""
    name = "kernels/\u202egpj.exe"
    err = refused(raw_zip([(name, b"x"), *with_manifest(members)]), name)
    assert "\\u202e" in str(err) and "not listed in manifest.json" in str(err)
