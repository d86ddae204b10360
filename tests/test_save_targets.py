"""Saving never destroys what is not a bundle (issue 24, item 1).

A save replaces its target atomically, so whatever is at the target goes. That is wanted for an
older bundle and never for anything else: a directory of the user's files named by mistake, a
document, the ONNX model being converted. Every save path (``GraphBuilder.save``,
``CompiledGraph.save``, ``engine_onnx.convert_file``, ``engine convert``) refuses such a target with
one ``SaveTargetError`` naming it, and the old contents are checked to survive byte for byte; an
explicit overwrite replaces it; an old bundle (zip or directory) is still replaced.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.cli.main import main
from engine.demo.mlp import build_mlp


def _snapshot(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) with its sha256: what must survive a refusal."""
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("do not lose this")
    (d / "sub" / "data.bin").write_bytes(os.urandom(1000))
    return d


@pytest.fixture(scope="module")
def builder(registry):
    return build_mlp(registry=registry)


def _runs(path: Path, registry) -> None:
    graph = engine.load_compiled_graph(path, registry=registry)
    (y,) = graph.run_async([np.ones((2, 64), np.float32)])
    assert y.numpy().shape[0] == 2
    graph.close()


@pytest.mark.parametrize("form", ["zip", "dir"])
def test_builder_save_refuses_a_directory_of_other_files_and_keeps_it(tmp_path, builder, form):
    target = _user_dir(tmp_path)
    before = _snapshot(target)
    with pytest.raises(engine.SaveTargetError) as err:
        builder.save(target, form=form)
    assert err.value.path == str(target)
    assert str(target) in str(err.value) and "notes.txt" in str(err.value)
    assert "overwrite=True" in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, engine.SaveError) and isinstance(err.value, engine.EngineError)
    assert _snapshot(target) == before
    assert sorted(os.listdir(tmp_path)) == ["models"]  # no temporary left beside it


def test_builder_save_refuses_a_file_that_is_not_a_bundle_and_keeps_it(tmp_path, builder):
    target = tmp_path / "report.cgb"
    target.write_bytes(b"a document that happens to end in .cgb\n" * 10)
    before = _snapshot(target)
    with pytest.raises(engine.SaveTargetError, match="is a file that is not a bundle"):
        builder.save(target)
    assert _snapshot(target) == before
    assert sorted(os.listdir(tmp_path)) == ["report.cgb"]


def test_a_directory_bundle_with_a_foreign_file_added_is_no_longer_replaced(tmp_path, builder):
    target = tmp_path / "mlp"
    builder.save(target, form="dir")
    (target / "README.txt").write_text("added by hand")
    before = _snapshot(target)
    with pytest.raises(engine.SaveTargetError, match="README.txt"):
        builder.save(target, form="dir")
    assert _snapshot(target) == before


def test_overwrite_replaces_what_is_there(tmp_path, builder, registry):
    target = _user_dir(tmp_path)
    builder.save(target, overwrite=True)
    assert target.is_file()
    _runs(target, registry)
    other = tmp_path / "notes.txt"
    other.write_text("replace me")
    builder.save(other, form="dir", overwrite=True)
    _runs(other, registry)


@pytest.mark.parametrize("form", ["zip", "dir"])
def test_an_old_bundle_and_an_empty_directory_are_still_replaced(tmp_path, builder, registry, form):
    target = tmp_path / "mlp.cgb"
    builder.save(target, form=form)
    builder.save(target, form=form)  # a bundle: replaced without asking
    builder.save(target, form="dir" if form == "zip" else "zip")  # and across forms
    _runs(target, registry)
    empty = tmp_path / "empty"
    empty.mkdir()
    builder.save(empty, form=form)  # nothing there to lose
    _runs(empty, registry)


def test_compiled_graph_save_refuses_non_bundles_and_resaves_itself(tmp_path, builder, registry):
    src = tmp_path / "mlp.cgb"
    builder.save(src)
    graph = engine.load_compiled_graph(src, registry=registry)
    graph.run_async([np.ones((3, 64), np.float32)])
    target = _user_dir(tmp_path)
    before = _snapshot(target)
    with pytest.raises(engine.SaveTargetError, match="a directory that is not a bundle"):
        graph.save(target)
    assert _snapshot(target) == before
    doc = tmp_path / "doc.txt"
    doc.write_text("keep")
    with pytest.raises(engine.SaveTargetError):
        engine.save_compiled_graph(graph, doc)
    assert doc.read_text() == "keep"
    graph.save(src, save_dispatch_table=True)  # the bundle it was loaded from is a bundle
    graph.close()
    _runs(src, registry)


# ---- the importer: convert_file and `engine convert` -----------------------------------------
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402


@pytest.fixture()
def model_file(tmp_path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = tmp_path / "copy.onnx"
    onnx.save(model, path)
    return path


def test_engine_convert_refuses_to_write_over_the_model_itself(model_file, capsys):
    before = _snapshot(model_file)
    for extra in ([], ["--overwrite"]):  # the model is never replaced: it could not be converted again
        assert main(["convert", str(model_file), "-o", str(model_file), *extra]) == 2
        err = capsys.readouterr().err
        assert "the model being converted" in err and str(model_file) in err and len(err.splitlines()) == 1
        assert _snapshot(model_file) == before
    from engine_onnx.convert import convert_file

    with pytest.raises(engine.SaveTargetError, match="the model being converted"):
        convert_file(model_file, model_file.parent / "." / model_file.name, overwrite=True)
    assert _snapshot(model_file) == before


def test_engine_convert_refuses_a_directory_of_files_unless_overwrite(tmp_path, model_file, capsys):
    target = _user_dir(tmp_path)
    before = _snapshot(target)
    assert main(["convert", str(model_file), "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert str(target) in err and "--overwrite" in err and "notes.txt" in err and len(err.splitlines()) == 1
    assert _snapshot(target) == before
    assert main(["convert", str(model_file), "-o", str(target) + "/"]) == 2  # the directory form too
    assert _snapshot(target) == before
    other = tmp_path / "other.onnx"
    other.write_bytes(model_file.read_bytes())
    assert main(["convert", str(model_file), "-o", str(other)]) == 2
    assert other.read_bytes() == model_file.read_bytes()
    assert main(["convert", str(model_file), "-o", str(target), "--overwrite"]) == 0
    graph = engine.load_compiled_graph(target)
    x = np.array([[-1, 2, -3, 4]], np.float32)
    np.testing.assert_array_equal(graph.run_async([x])[0].numpy(), np.maximum(x, 0))
    graph.close()
    assert main(["convert", str(model_file), "-o", str(target)]) == 0  # now a bundle: replaced
