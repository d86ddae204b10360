"""Messages that say what to do, and an ``engine`` that starts without onnx (issue 24).

Each case runs through the public API or as a real ``engine`` process (``python -m engine``), and
is checked for its exit code, its one line on stderr and the advice in it: the package to install
for ``engine convert``, the ``engine convert`` command for an ``.onnx`` file, how to pass inputs
that came as a dict, as Python lists or in another dtype.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import site
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import engine
from engine.build import GraphBuilder

from cli_support import RELU_ONNX, cli_env, engine_cli, one_error_line

REPO = Path(__file__).resolve().parent.parent
HAS_ENGINE_ONNX = importlib.util.find_spec("engine_onnx") is not None

#: A real ONNX model (Relu over float32[1, 4], opset 13), serialized: no onnx needed to write it.
ADD_C = r"""
#include <stdint.h>
int32_t add(void *const *t, const int64_t *sym, void *ws) {
    const float *a = t[0], *b = t[1]; float *c = t[2];
    for (int64_t i = 0; i < sym[0] * 4; i++) c[i] = a[i] + b[i];
    return 0;
}
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory, mlp_bundle) -> Path:
    root = tmp_path_factory.mktemp("hints")
    shutil.copy(mlp_bundle, root / "mlp.cgb")
    (root / "m.onnx").write_bytes(RELU_ONNX)
    return root


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return cli_env(tmp_path_factory.mktemp("hints-cache"))


# -- 1. engine convert where engine-onnx is not installed ------------------------------------------
def _site_without(tmp: Path, keep: tuple[str, ...]) -> Path:
    """A copy (symlinks) of this interpreter's site-packages with only the ``keep`` engine
    distributions in it: their ``.dist-info``, ``.pth`` and editable finders; the others' are left out."""
    mirror = tmp / "site-packages"
    mirror.mkdir()
    kept = {k.removeprefix("engine").lstrip("_") for k in keep}  # "" (engine itself), "cpu"
    for source in site.getsitepackages():
        for entry in Path(source).iterdir():
            # engine_onnx-0.1.0.dist-info, __editable__.engine_onnx-0.1.0.pth, __editable___engine_onnx_0_1_0_finder.py
            parts = set(re.findall(r"(?:^|[_.])engine_([a-z]+)", entry.name.lower()))
            if parts - kept or (mirror / entry.name).exists():
                continue
            (mirror / entry.name).symlink_to(entry)
    return mirror


def _engine_in(mirror: Path) -> list[str]:
    """The ``engine`` console script's own two lines, on an interpreter whose only site directory is
    ``mirror`` (``-S``: not the real site-packages; ``addsitedir`` runs its ``.pth`` files)."""
    code = (f"import site, sys; site.addsitedir({str(mirror)!r}); from engine.cli.main import main; "
            f"sys.argv[0] = 'engine'; sys.exit(main())")
    return [sys.executable, "-S", "-c", code]


def test_convert_without_engine_onnx_says_which_package_to_install(tmp_path, env):
    """What the demo installs (engine, engine-cpu), nothing else: the interpreter really does not see
    engine-onnx (its metadata and its package), nothing is uninstalled or mocked."""
    mirror = _site_without(tmp_path, ("engine", "engine_cpu"))
    cli = _engine_in(mirror)
    probe = subprocess.run([*cli[:3], f"import site; site.addsitedir({str(mirror)!r}); import importlib.metadata as m, "
                            "importlib.util as u; print(sorted(d.metadata['Name'] for d in m.distributions() "
                            "if d.metadata['Name'].startswith('engine')), u.find_spec('engine_onnx'))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["['engine',", "'engine-cpu']", "None"], probe.stdout + probe.stderr

    proc = subprocess.run([*cli, "convert", "model.onnx", "-o", "model.cgb"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    line = one_error_line(proc, "convert")
    assert "engine-onnx" in line and "not installed" in line and "pip install -e ./frontends/onnx" in line
    assert "invalid choice" not in line and not (tmp_path / "model.cgb").exists()
    # Options first, or --help, meet the same answer rather than argparse's.
    for argv in (["convert", "-o", "x.cgb", "model.onnx"], ["convert", "--help"], ["-v", "convert"]):
        again = subprocess.run([*cli, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert again.returncode == 2, again.stderr
        assert "pip install -e ./frontends/onnx" in again.stderr and "invalid choice" not in again.stderr
    listed = subprocess.run([*cli, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0
    assert re.search(r"convert\s+convert an ONNX model into a bundle \(engine-onnx: not\s+installed\)", listed.stdout)


def test_the_readme_set_up_says_how_to_get_engine_convert():
    readme = (REPO / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert "engine-onnx" in setup and "pip install -e ./frontends/onnx" in setup and "engine convert" in setup


# -- 2. no onnx at start ----------------------------------------------------------------------------
needs_engine_onnx = pytest.mark.skipif(not HAS_ENGINE_ONNX, reason="engine-onnx is not installed "
                                                                   "(pip install -e ./frontends/onnx)")


def _imported(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@needs_engine_onnx
@pytest.mark.parametrize("argv", [["inspect", "--help"], ["--help"], ["inspect", "mlp.cgb"]])
def test_commands_other_than_convert_do_not_import_onnx(work, env, argv):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "engine", *argv], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = _imported(proc.stderr)
    assert not {m for m in modules if m == "onnx" or m.startswith("onnx.")}
    if argv == ["--help"]:  # the entry point was loaded all the same: convert is listed
        assert re.search(r"^\s+convert\s+convert an ONNX model into a bundle \(engine-onnx\)$", proc.stdout,
                         re.MULTILINE)


@needs_engine_onnx
def test_the_parser_loads_the_convert_entry_point_without_onnx():
    code = ("import sys; from engine.cli.main import build_parser; build_parser(); "
            "print('engine_onnx.cli' in sys.modules, 'onnx' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["True", "False"], proc.stderr


@needs_engine_onnx
def test_engine_onnx_names_stay_what_they_were():
    code = ("import sys, engine_onnx; assert 'onnx' not in sys.modules; import engine_onnx.convert as sub; "
            "from engine_onnx.convert import convert_file; import engine_onnx as p; "
            "print(callable(p.convert), p.convert is sub, p.convert_file is convert_file, "
            "'Relu' in p.supported_ops(), 'convert' in dir(p))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["True", "True", "True", "True", "True"], proc.stderr


# -- 3. an .onnx file where a bundle belongs -------------------------------------------------------
def test_loading_an_onnx_file_says_to_convert_it(work):
    with pytest.raises(engine.UnconvertedModelError) as info:
        engine.load_compiled_graph(work / "m.onnx")
    err = info.value
    assert isinstance(err, engine.BundleError)
    assert err.command == f"engine convert {work / 'm.onnx'} -o {work / 'm.cgb'}" and err.model_format == "ONNX"
    assert f"'{err.command}'" in str(err) and "\n" not in str(err)


def test_a_bundle_named_onnx_still_loads(work, tmp_path, registry):
    named = tmp_path / "really-a-bundle.onnx"
    shutil.copy(work / "mlp.cgb", named)
    with engine.load_compiled_graph(named, registry=registry) as graph:
        assert graph.meta.input_names == ("x",)


@pytest.mark.parametrize("argv", [["inspect", "m.onnx"], ["run", "m.onnx", "--random"], ["bench", "m.onnx"],
                                  ["verify", "m.onnx"]])
def test_commands_on_an_onnx_file_say_to_convert_it(work, env, argv):
    proc = engine_cli(work, env, *argv)
    assert proc.returncode == 2
    line = one_error_line(proc, argv[0])
    assert "'engine convert m.onnx -o m.cgb'" in line and "zip" not in line


# -- 4. inputs as other runtimes take them ---------------------------------------------------------
@pytest.fixture(scope="module")
def adder(registry):
    b = GraphBuilder("adder", registry=registry)
    x = b.input("x", "float32", ["n", 4])
    y = b.input("y", "float32", ["n", 4])
    k = b.kernel("add", entries=["add"], source=ADD_C)
    (z,) = b.call(k, [x, y], [("float32", ["n", 4])], symbols=["n"])
    b.output(z, "z")
    return b.build()


@pytest.fixture(scope="module")
def mlp(mlp_bundle, registry):
    with engine.load_compiled_graph(mlp_bundle, registry=registry) as graph:
        yield graph


def _message(graph, inputs) -> str:
    with pytest.raises(engine.InputError) as info:
        graph.run_async(inputs)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_a_dict_of_named_inputs_says_pass_a_list_in_input_order(mlp, adder):
    x = np.ones((2, 64), np.float32)
    assert _message(mlp, {"x": x}) == ("run_async takes a list of arrays in input order, not a dict of named "
                                       "arrays: pass [inputs['x']] (the graph's 1 input: 'x')")
    a = np.ones((2, 4), np.float32)
    for given in ({"x": a, "y": a}, {"y": a, "x": a}, {"x": a}):  # as many keys as inputs, or not
        assert _message(adder, given).endswith(": pass [inputs['x'], inputs['y']] (the graph's 2 inputs: 'x', 'y')")
    (z,) = adder.run_async([given["x"], given["x"]])  # the advice works
    np.testing.assert_array_equal(z.numpy(), 2 * a)


def test_python_lists_say_which_array_to_make(mlp, adder):
    rows = [[0.5] * 64, [0.25] * 64]
    assert _message(mlp, rows) == ("the graph takes 1 input, got 2 (expected: 'x'): the list holds 2 Python "
                                   "lists, not arrays; pass [np.asarray(rows, dtype=np.float32)]")
    assert _message(mlp, [0.5] * 64).endswith("the list holds 64 Python floats, not arrays; "
                                              "pass [np.asarray(values, dtype=np.float32)]")
    assert _message(mlp, [rows]) == ("'x': expected an engine.Tensor, a numpy array or a DLPack tensor, got list; "
                                     "pass np.asarray(value, dtype=np.float32)")
    assert _message(adder, [[[1.0] * 4]]).endswith(
        "pass one array per input, in input order: [np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.float32)]")
    (probs,) = mlp.run_async([np.asarray(rows, dtype=np.float32)])  # the advice works
    assert probs.shape == (2, 10)


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
def test_another_dtype_says_astype(mlp, dtype):
    x = np.ones((2, 64), dtype)
    assert _message(mlp, [x]) == f"'x': expected dtype float32, got numpy {np.dtype(dtype)}; pass x.astype(np.float32)"
    assert mlp.run_async([x.astype(np.float32)])[0].shape == (2, 10)


def test_counts_read_as_english(mlp, adder):
    a = np.ones((1, 4), np.float32)
    assert _message(adder, [a]) == "the graph takes 2 inputs, got 1 (expected: 'x', 'y')"
    assert _message(mlp, [a, a]) == "the graph takes 1 input, got 2 (expected: 'x')"
    assert _message(mlp, np.ones((2, 64), np.float32)).startswith("the graph takes a list of 1 input, got a single")


# -- 5. --input of a file that is not .npy ---------------------------------------------------------
@pytest.mark.parametrize("name, content, expected", [
    ("x.txt", b"1 2 3\n", "not a .npy file"),
    ("m.onnx", RELU_ONNX, "not a .npy file"),
    ("objects.npy", None, "holds Python objects (dtype object)"),
])
def test_an_input_that_is_not_npy_never_suggests_pickle(work, env, tmp_path, name, content, expected):
    path = tmp_path / name
    if content is None:
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    else:
        path.write_bytes(content)
    proc = engine_cli(work, env, "run", "mlp.cgb", "--input", f"x={path}")
    assert proc.returncode == 2
    line = one_error_line(proc, "run")
    assert expected in line and "np.save(path, " in line
    assert "pickle" not in line.lower()


# -- 6. engine demo on a kind that cannot run ------------------------------------------------------
def test_demo_refuses_an_unusable_kind_before_building(tmp_path, env, registry):
    others = [r.kind for r in engine.devices(registry) if r.kind != "cpu"]
    if not others:
        pytest.skip("no device plugin besides the CPU's is installed")
    kind = others[0]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    keep = tmp_path / "keep"
    proc = engine_cli(tmp_path, {**env, "TMPDIR": str(tmp)}, "demo", "--device", kind, "--keep", str(keep),
                      ENGINE_DEVICES="cpu")
    assert proc.returncode == 2
    line = one_error_line(proc, "demo")
    assert f"device kind {kind!r} is not usable here: excluded by ENGINE_DEVICES=cpu" in line
    assert "(usable kinds here: cpu)" in line
    assert "built" not in proc.stdout and not keep.exists() and list(tmp.iterdir()) == []
    unknown = engine_cli(tmp_path, env, "demo", "--device", "tpu")
    assert unknown.returncode == 2
    line = one_error_line(unknown, "demo")
    assert "no plugin provides device kind 'tpu'" in line and re.search(r"usable kinds here: cpu\b", line)


# -- 7. a closed graph ------------------------------------------------------------------------------
def test_running_a_closed_graph_says_it_was_closed(mlp_bundle, registry):
    x = np.ones((2, 64), np.float32)
    with engine.load_compiled_graph(mlp_bundle, registry=registry) as graph:
        graph.run_async([x])
        graph.run_async([x])  # a prepared run on this thread's lane
        done = threading.Event()
        ready = threading.Event()
        seen: list[BaseException] = []

        def other_thread() -> None:
            graph.run_async([x])
            ready.set()
            done.wait(60)
            try:
                graph.run_async([x])
            except BaseException as exc:  # noqa: BLE001 - checked below
                seen.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        ready.wait(60)
    done.set()
    thread.join(60)
    for call in (lambda: graph.run_async([x]), lambda: graph.run_async({"x": x}), lambda: graph(x),
                 lambda: graph.profile([x], repeat=1)):
        with pytest.raises(engine.GraphClosedError, match=r"^this graph was closed \(close\(\), or the end of its "
                                                          r"'with' block\); load the bundle again to run it$"):
            call()
    assert len(seen) == 1 and isinstance(seen[0], engine.GraphClosedError)
    assert isinstance(seen[0], engine.EngineError) and isinstance(seen[0], ValueError)


# -- 8. scripts/demo --keep DIR, relative to where it was run --------------------------------------
def test_scripts_demo_keeps_the_bundle_where_the_person_ran_it(tmp_path, env):
    """The real script and the real ``engine demo``; only its ``pip install`` is skipped (this tree
    is already installed, editable, in the interpreter the stand-in hands everything else to)."""
    stand_in = tmp_path / "python3"
    stand_in.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then exit 0; fi\n'
                        f'exec {sys.executable} "$@"\n')
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)
    caller = tmp_path / "somewhere"
    caller.mkdir()
    name = f"keep-{os.getpid()}"
    try:
        proc = subprocess.run([str(REPO / "scripts" / "demo"), "--keep", name], cwd=caller,
                              env={**env, "PYTHON": str(stand_in), "ENGINE_VENV": "0"}, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "demo passed" in proc.stdout and (caller / name / "mlp.cgb").is_file()
        assert f"engine inspect {name}/mlp.cgb" in proc.stdout  # the hint works from there as printed
    finally:
        stray = REPO / name
        in_the_repository = stray.exists()
        if in_the_repository:
            shutil.rmtree(stray)
    assert not in_the_repository
