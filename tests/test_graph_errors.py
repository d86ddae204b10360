"""Bad input gets a specific EngineError naming what is wrong, and loses nothing (issue 2)."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.build import GraphBuilder

ADD_C = r"""
#include <stdint.h>
int32_t add(void *const *t, const int64_t *sym, void *ws) {
    const float *a = t[0], *b = t[1]; float *c = t[2];
    for (int64_t i = 0; i < sym[0] * 4; i++) c[i] = a[i] + b[i];
    return 0;
}
int32_t fails_when_big(void *const *t, const int64_t *sym, void *ws) {
    if (sym[0] > 5) return 42;
    return add(t, sym, ws);
}
"""


def _adder(registry, device="cpu", entry="add") -> GraphBuilder:
    b = GraphBuilder("adder", registry=registry)
    x = b.input("x", "float32", ["n", 4], device=device)
    y = b.input("y", "float32", ["n", 4], device=device)
    k = b.kernel("add", entries=[entry], source=ADD_C, device=device)
    (z,) = b.call(k, [x, y], [("float32", ["n", 4])], symbols=["n"])
    b.output(z, "z")
    return b


@pytest.fixture(scope="module")
def adder_path(tmp_path_factory, registry) -> Path:
    path = tmp_path_factory.mktemp("adder") / "adder.cgb"
    _adder(registry).save(path)
    return path


@pytest.fixture()
def adder(adder_path, registry):
    return engine.load_compiled_graph(adder_path, registry=registry)


def test_wrong_input_count(adder):
    with pytest.raises(engine.InputError, match=r"takes 2 inputs, got 1 \(expected: 'x', 'y'\)"):
        adder.run_async([np.zeros((1, 4), np.float32)])


def test_a_single_array_instead_of_a_list_is_named(adder):
    x = np.ones((3, 4), np.float32)
    with pytest.raises(engine.InputError) as info:  # not "takes 2 inputs, got 3" (its rows)
        adder.run_async(x)
    assert str(info.value) == "the graph takes a list of 2 inputs, got a single ndarray: pass [x] (expected: 'x', 'y')"


def test_a_tensor_its_producer_refuses_to_share_is_an_input_error(adder):
    torch = pytest.importorskip("torch", reason="torch is not installed (the torch-tests extra)")
    x = torch.ones((3, 4), requires_grad=True)
    with pytest.raises(engine.InputError) as info:  # not torch's BufferError
        adder.run_async([x, x])
    assert str(info.value) == ("'x': torch.Tensor refused to share its memory through DLPack: Can't export "
                               "tensors that require gradient, use tensor.detach()")
    (y,) = adder.run_async([x.detach(), x.detach()])  # the advice works
    np.testing.assert_array_equal(y.numpy(), np.full((3, 4), 2, np.float32))


def test_wrong_input_shape(adder):
    with pytest.raises(engine.InputError, match=r"'y': dimension 1 must be 4, got 5"):
        adder.run_async([np.zeros((2, 4), np.float32), np.zeros((2, 5), np.float32)])
    with pytest.raises(engine.InputError, match=r"'x': expected 2 dimensions, got shape \[8\]"):
        adder.run_async([np.zeros(8, np.float32), np.zeros((2, 4), np.float32)])


def test_wrong_input_dtype(adder):
    with pytest.raises(engine.InputError, match=r"'y': expected dtype float32, got numpy float64"):
        adder.run_async([np.zeros((2, 4), np.float32), np.zeros((2, 4))])


def test_wrong_input_device(adder, registry2):
    on_other = engine.asarray(np.zeros((2, 4), np.float32), device="hostdev", registry=registry2)
    with pytest.raises(engine.InputError, match=r"'x': expected a tensor on cpu, got one on hostdev"):
        adder.run_async([on_other, np.zeros((2, 4), np.float32)])


def test_inconsistent_symbols(adder):
    with pytest.raises(engine.InputError,
                       match=r"inconsistent symbol 'n': 'x' dimension 0 gives n=2 but 'y' dimension 0 gives n=3"):
        adder.run_async([np.zeros((2, 4), np.float32), np.zeros((3, 4), np.float32)])


def test_non_contiguous_and_foreign_objects(adder):
    with pytest.raises(engine.InputError, match="not C-contiguous"):
        adder.run_async([np.zeros((4, 2), np.float32).T, np.zeros((2, 4), np.float32)])
    with pytest.raises(engine.InputError, match="expected an engine.Tensor, a numpy array or a DLPack tensor, got list"):
        adder.run_async([[[0.0] * 4], np.zeros((1, 4), np.float32)])


def test_kernel_returning_nonzero(tmp_path, registry):
    graph = _adder(registry, entry="fails_when_big").build()
    ok = graph.run_async([np.ones((2, 4), np.float32), np.ones((2, 4), np.float32)])[0]
    np.testing.assert_array_equal(ok.numpy(), 2)
    big = [np.ones((8, 4), np.float32)] * 2
    for _ in range(3):  # slow path, then the prepared fast path, then again
        with pytest.raises(engine.KernelError, match=r"kernel 'add' candidate 0 \(entry 'fails_when_big'\).*code 42"):
            graph.run_async(big)
    assert graph.run_async([np.ones((2, 4), np.float32)] * 2)[0].numpy().sum() == 16  # still usable


# --- hostile or damaged bundles ------------------------------------------------------------------

def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _write_zip(path: Path, members: dict[str, bytes], *, manifest_edit=None) -> Path:
    """A zip with a manifest that vouches for every member (so only the tested defect remains)."""
    files = {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in members.items()
             if n != "manifest.json"}
    manifest = {"format": "engine.bundle", "format_version": 1, "engine_version": "test", "files": files}
    if manifest_edit:
        manifest_edit(manifest)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, d in members.items():
            if n != "manifest.json":
                z.writestr(n, d)
        z.writestr("manifest.json", json.dumps(manifest))
    return path


def test_truncated_bundle(tmp_path, adder_path, registry):
    data = adder_path.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 10):
        bad = tmp_path / f"cut{cut}.cgb"
        bad.write_bytes(data[:cut])
        with pytest.raises(engine.BundleError, match="bundle"):
            engine.load_compiled_graph(bad, registry=registry)


def test_flipped_byte_in_kernel_binary(tmp_path, adder_path, registry):
    data = bytearray(adder_path.read_bytes())
    with zipfile.ZipFile(adder_path) as z:
        info = z.getinfo("kernels/0/add.so")
    header = data[info.header_offset:info.header_offset + 30]
    start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    data[start + 100] ^= 0xFF
    bad = tmp_path / "flipped.cgb"
    bad.write_bytes(bytes(data))
    with pytest.raises(engine.BundleError, match=r"kernels/0/add.so.*sha256 mismatch"):
        engine.load_compiled_graph(bad, registry=registry)


@pytest.mark.parametrize("name", ["../evil.so", "/abs/evil.so", "kernels/0/../../evil.so"])
def test_member_escaping_the_bundle(tmp_path, adder_path, registry, name):
    members = _members(adder_path)
    members[name] = b"\x7fELF"
    bad = _write_zip(tmp_path / "escape.cgb", members)
    with pytest.raises(engine.BundleError) as info:
        engine.load_compiled_graph(bad, registry=registry)
    assert name in str(info.value) or name.lstrip("/") in str(info.value)


def test_unknown_format_version(tmp_path, adder_path, registry):
    bad = _write_zip(tmp_path / "v2.cgb", _members(adder_path),
                     manifest_edit=lambda m: m.update(format_version=2))
    with pytest.raises(engine.BundleError, match="format_version 2 is newer than this engine supports"):
        engine.load_compiled_graph(bad, registry=registry)


def test_malformed_metadata_names_member_and_path(tmp_path, adder_path, registry):
    members = _members(adder_path)
    meta = json.loads(members["kernels/0/meta.json"])
    meta["candidates"][0]["binaries"][0]["format"] = 3
    members["kernels/0/meta.json"] = json.dumps(meta).encode()
    bad = _write_zip(tmp_path / "meta.cgb", members)
    with pytest.raises(engine.BundleError,
                       match=r"kernels/0/meta.json @ \$.candidates\[0\].binaries\[0\].format: expected a string, got 3"):
        engine.load_compiled_graph(bad, registry=registry)


def test_bad_expression_names_where(tmp_path, adder_path, registry):
    members = _members(adder_path)
    ex = json.loads(members["graph_execution.json"])
    ex["tensor_signatures"][2]["shape"][0] = "n*(4"
    members["graph_execution.json"] = json.dumps(ex).encode()
    bad = _write_zip(tmp_path / "expr.cgb", members)
    with pytest.raises(engine.BundleError, match=r"graph_execution.json @ \$.tensor_signatures\[2\].shape\[0\]"):
        engine.load_compiled_graph(bad, registry=registry)


def test_index_out_of_range(tmp_path, adder_path, registry):
    members = _members(adder_path)
    ex = json.loads(members["graph_execution.json"])
    ex["instructions"][0]["inputs"][1] = 99
    members["graph_execution.json"] = json.dumps(ex).encode()
    bad = _write_zip(tmp_path / "range.cgb", members)
    with pytest.raises(engine.BundleError, match=r"\$.instructions\[0\].inputs\[1\]: tensor 99 is out of range"):
        engine.load_compiled_graph(bad, registry=registry)


def test_early_free_is_refused(tmp_path, registry):
    b = GraphBuilder("chain", registry=registry)
    x = b.input("x", "float32", ["n", 4])
    k = b.kernel("add", entries=["add"], source=ADD_C)
    (y,) = b.call(k, [x, x], [("float32", ["n", 4])], symbols=["n"])
    (z,) = b.call(k, [y, y], [("float32", ["n", 4])], symbols=["n"])
    b.output(z)
    good = tmp_path / "good.cgb"
    b.save(good)
    members = _members(good)
    ex = json.loads(members["graph_execution.json"])
    ex["instructions"][1]["free"].remove(1)
    ex["instructions"][0]["free"] = [1]  # tensor 1 (y) is still read by instruction 1
    members["graph_execution.json"] = json.dumps(ex).encode()
    bad = _write_zip(tmp_path / "free.cgb", members)
    with pytest.raises(engine.BundleError, match="frees tensor 1 at instruction 0 but instruction 1 still uses it"):
        engine.load_compiled_graph(bad, registry=registry)


def test_kernel_kind_with_no_plugin(tmp_path, registry, registry2):
    path = tmp_path / "hostdev.cgb"
    _adder(registry2, device="hostdev").save(path)
    assert engine.load_compiled_graph(path, registry=registry2).run_async(
        [engine.asarray(np.ones((1, 4), np.float32), device="hostdev", registry=registry2)] * 2)[0].numpy().sum() == 8
    with pytest.raises(engine.DeviceUnavailableError, match="no plugin provides device kind 'hostdev'"):
        engine.load_compiled_graph(path, registry=registry)


def test_missing_first_party_plugin_names_distribution(tmp_path, adder_path):
    from engine.plugins import Registry
    from engine.settings import Settings

    empty = Registry(Settings(cache_dir=tmp_path), autoload=False)
    with pytest.raises(engine.DeviceUnavailableError, match="install the 'engine-cpu' distribution"):
        engine.load_compiled_graph(adder_path, registry=empty)


def test_failed_save_leaves_old_file_and_no_temp_files(tmp_path, adder, monkeypatch):
    target = tmp_path / "out.cgb"
    adder.save(target)
    before = target.read_bytes()

    from engine.runtime import compiled_graph

    real = compiled_graph.write_bundle

    def exploding(path, members, **kw):
        members = dict(members)
        members["graph_string.txt"] = _exploding_chunks()
        return real(path, members, **kw)

    monkeypatch.setattr(compiled_graph, "write_bundle", exploding)
    with pytest.raises(RuntimeError, match="disk on fire"):
        adder.save(target)
    assert target.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["out.cgb"]


def _exploding_chunks():
    """Chunks of a member that fail after the writer has started on it."""
    yield b"start"
    raise RuntimeError("disk on fire")


def test_entry_code_mistakes_are_named(registry):
    b = GraphBuilder("entries", registry=registry)
    with pytest.raises(engine.InputError, match=r"entry_code names \['typo'\], which are not among its entries "
                                                r"\['add', 'fails_when_big'\]"):
        b.kernel("k", entries=["add", "fails_when_big"], source=ADD_C, entry_code={"typo": (ADD_C, None)})
    with pytest.raises(engine.InputError, match=r"entries \['fails_when_big'\] have no code: give source= or an "
                                                r"entry_code for each"):
        b.kernel("k", entries=["add", "fails_when_big"], entry_code={"add": (ADD_C, None)})
    with pytest.raises(engine.InputError, match="give either source= \\(and/or entry_code=\\) or binaries="):
        b.kernel("k", entries=["add"], entry_code={"add": (ADD_C, None)},
                 binaries=[{"format": "elf", "target": "x86_64", "path": "k.so", "data": b""}])


def test_an_entry_with_code_of_its_own_runs_from_its_own_binary(tmp_path, registry):
    # Candidate 1 comes from a second source whose `add` doubles: forcing each index through the
    # dispatch table shows each candidate ran its own code.
    twice = ("#include <stdint.h>\n"
             "int32_t add_twice(void *const *t, const int64_t *sym, void *ws) {\n"
             "    const float *a = t[0], *b = t[1]; float *c = t[2];\n"
             "    for (int64_t i = 0; i < sym[0] * 4; i++) c[i] = 2.0f * (a[i] + b[i]);\n"
             "    return 0;\n}\n")
    b = GraphBuilder("entries", registry=registry)
    x = b.input("x", "float32", ["n", 4])
    k = b.kernel("add", entries=["add", "add_twice"], source=ADD_C, entry_code={"add_twice": (twice, None)})
    (z,) = b.call(k, [x, x], [("float32", ["n", 4])], symbols=["n"])
    b.output(z)
    path = tmp_path / "entries.cgb"
    b.save(path)
    graph = engine.load_compiled_graph(path, registry=registry)
    xs = np.arange(8, dtype=np.float32).reshape(2, 4)
    graph.dispatch_table.record((2,), (0,))
    np.testing.assert_array_equal(graph.run_async([xs])[0].numpy(), xs + xs)
    xs3 = np.ones((3, 4), np.float32)
    graph.dispatch_table.record((3,), (1,))
    np.testing.assert_array_equal(graph.run_async([xs3])[0].numpy(), 2 * (xs3 + xs3))
    # A row recorded for a key that has already run replaces the choice its prepared run was built
    # with: the next run (fast path included) uses the new candidate.
    graph.dispatch_table.record((2,), (1,))
    for _ in range(2):
        np.testing.assert_array_equal(graph.run_async([xs])[0].numpy(), 2 * (xs + xs))
    # Under the "first" policy a key without a row runs candidate 0; a row recorded later wins.
    graph.dispatch_policy = "first"
    xs5 = np.ones((5, 4), np.float32)
    np.testing.assert_array_equal(graph.run_async([xs5])[0].numpy(), xs5 + xs5)
    graph.dispatch_table.record((5,), (1,))
    np.testing.assert_array_equal(graph.run_async([xs5])[0].numpy(), 2 * (xs5 + xs5))
