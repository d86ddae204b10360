"""Hostile numbers in bundles: every integer read from bundle text is bounded and ASCII (issue 12, part A).

Each test takes the example MLP bundle, replaces one member with a mutated copy (the manifest is
re-hashed by the archive writer, so the mutation reaches the validators rather than the hash check)
and asserts that reading it raises a ``BundleError`` on one bounded line naming the member and the
JSON path. The mutated numbers are spliced into the JSON text, because ``json.dumps`` itself cannot
write an integer of 5,000 digits.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
import pytest

import engine
from engine.bundle.contents import read_bundle
from engine.bundle.jsonread import INT64_MAX, INT64_MIN, MAX_DECIMAL_DIGITS
from engine.bundle.reader import BundleArchive
from engine.bundle.writer import bundle_to_bytes, copy_members
from engine.cli.main import main as cli_main
from engine.errors import BundleError
from engine.expr import MAX_DEPTH, MAX_NODES, MAX_TEXT_CHARS, ExprError, parse_expr

RAW = "__RAW_NUMBER__"
HUGE = "9" * 5000  # past Python's 4,300-digit limit for int(): a bare ValueError before this issue
#: Longest message a test accepts: a limit on what untrusted text can add to a line.
MAX_MESSAGE = 400


def _short(value: object) -> str:
    """A readable test id for a parameter that may be thousands of characters long."""
    text = value if isinstance(value, str) else repr(value)
    return ascii(text) if len(text) <= 24 else f"{ascii(text[:8])}...({len(text)} chars)"


@pytest.fixture(scope="module")
def archive(mlp_bundle):
    with BundleArchive.open(mlp_bundle) as opened:
        yield opened


def _replace(archive: BundleArchive, member: str, data: bytes) -> bytes:
    """The bundle (zip form, in memory) with ``member`` replaced and the manifest re-hashed."""
    return bundle_to_bytes(copy_members(archive, {member: data}), engine_version="0.1.0")


def _splice(archive: BundleArchive, member: str, edit: Callable[[Any], None], raw: str) -> bytes:
    """``member`` after ``edit`` put ``RAW`` somewhere in its JSON, with ``raw`` as that number's text."""
    doc = json.loads(archive.read(member))
    edit(doc)
    text = json.dumps(doc).replace(json.dumps(RAW), raw)
    return _replace(archive, member, text.encode())


def _refused(blob: bytes, member: str, path: str | None) -> str:
    """The one-line message of the BundleError that reading ``blob`` raises, checked for its context."""
    with pytest.raises(BundleError) as info:
        read_bundle(blob).archive.close()
    message = str(info.value)
    assert (info.value.member, info.value.path) == (member, path), message
    assert member in message and (path is None or path in message), message
    assert "\n" not in message and len(message) < MAX_MESSAGE, message
    return message


def _one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message and len(message) < MAX_MESSAGE, message
    return message


def _set(*keys: Any) -> Callable[[Any], None]:
    """An edit that sets doc[k0][k1]... to RAW."""
    def edit(doc: Any) -> None:
        for key in keys[:-1]:
            doc = doc[key]
        doc[keys[-1]] = RAW
    return edit


# -- one bounded integer reader for every JSON number ---------------------------------------------------------

# (member, edit, JSON path): integer fields of every metadata member, and a key no reader knows.
INTEGER_FIELDS = [
    ("meta.json", _set("inputs", 0, "shape", 1), "$.inputs[0].shape[1]"),
    ("meta.json", _set("num_kernels"), "$.num_kernels"),
    ("meta.json", _set("x_future_field"), "$.x_future_field"),  # unknown keys are ignored, huge numbers are not
    ("graph_execution.json", _set("instructions", 0, "task_idx"), "$.instructions[0].task_idx"),
    ("graph_execution.json", _set("tensor_signatures", 1, "shape", 0), "$.tensor_signatures[1].shape[0]"),
    ("graph_execution.json", _set("outputs_index", 0), "$.outputs_index[0]"),
    ("kernels/0/meta.json", _set("workspace"), "$.workspace"),
    ("kernels/1/meta.json", _set("share_map", "0"), "$.share_map['0']"),
    ("kernels/0/meta.json", _set("candidates", 0, "x_note"), "$.candidates[0].x_note"),
    ("weights.json", _set(0, "nbytes"), "$[0].nbytes"),
    ("weights.json", _set(1, "offset"), "$[1].offset"),
    ("weights.json", _set(2, "shape", 0), "$[2].shape[0]"),
]


@pytest.mark.parametrize("raw", [HUGE, "9" * 20, str(INT64_MAX + 1), str(INT64_MIN - 1), "-" + HUGE],
                         ids=["5000 digits", "20 digits", "2**63", "-2**63-1", "-5000 digits"])
@pytest.mark.parametrize("member,edit,path", INTEGER_FIELDS, ids=[f"{m} {p}" for m, _, p in INTEGER_FIELDS])
def test_integers_outside_int64_are_refused_by_the_json_reader(archive, member, edit, path, raw):
    message = _refused(_splice(archive, member, edit, raw), member, path)
    assert "is out of range" in message and "[-2**63, 2**63-1]" in message
    assert raw[:40] in message and (len(raw) < 40 or f"({len(raw)} characters)" in message)


def test_the_int64_bounds_themselves_are_read(archive):
    for raw in (str(INT64_MAX), str(INT64_MIN)):
        read_bundle(_splice(archive, "meta.json", _set("x_future_field"), raw)).archive.close()


def test_a_5000_digit_shape_entry_is_a_bundle_error_through_the_public_loader(archive, registry):
    blob = _splice(archive, "meta.json", _set("inputs", 0, "shape", 1), HUGE)
    with pytest.raises(BundleError, match=r"meta\.json @ \$\.inputs\[0\]\.shape\[1\]: integer '9{40}'\.\.\. "
                                          r"\(5000 characters\) is out of range"):
        engine.load_compiled_graph(blob, registry=registry)


def test_the_cli_reports_a_5000_digit_number_on_one_line(archive, registry, tmp_path, capsys):
    path = tmp_path / "huge.cgb"
    path.write_bytes(_splice(archive, "graph_execution.json", _set("instructions", 0, "task_idx"), HUGE))
    assert cli_main(["inspect", str(path)], registry=registry) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and len(err) < MAX_MESSAGE, err
    assert "graph_execution.json @ $.instructions[0].task_idx" in err and "out of range" in err


@pytest.mark.parametrize("raw,expected", [
    ("1e400", "number '1e400' is out of the range of a double"),
    ("-1e400", "is out of the range of a double"),
    ("64.0", "expected an integer or an expression string, got float"),
])
def test_floats_where_sizes_are_expected(archive, raw, expected):
    message = _refused(_splice(archive, "meta.json", _set("inputs", 0, "shape", 1), raw), "meta.json",
                       "$.inputs[0].shape[1]")
    assert expected in message


def test_a_float_index_is_refused_with_its_path(archive):
    message = _refused(_splice(archive, "graph_execution.json", _set("instructions", 0, "task_idx"), "0.0"),
                       "graph_execution.json", "$.instructions[0].task_idx")
    assert "expected an integer, got 0.0" in message


# -- ASCII-only digits: share_map keys ------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["\u00b2", "\uff10", "\u0660", "1_0", "+0", "-0", " 0", "0 ", "0x0", "", "9" * 20,
                                 str(INT64_MAX + 1), HUGE], ids=_short)
def test_share_map_keys_must_be_plain_ascii_decimals(archive, key):
    member = "meta.json"
    doc = json.loads(archive.read(member))
    doc["share_map"] = {key: 0}
    blob = _replace(archive, member, json.dumps(doc).encode())
    with pytest.raises(BundleError) as info:
        read_bundle(blob).archive.close()
    message = _one_line(info.value)
    assert info.value.member == member and info.value.path.startswith("$.share_map[")
    assert f"expected 1 to {MAX_DECIMAL_DIGITS} ASCII digits" in message


def test_a_share_map_index_written_twice_is_refused(archive):
    member = "kernels/1/meta.json"  # bias_relu writes output 0 over input 0: {"0": 0}
    doc = json.loads(archive.read(member))
    doc["share_map"]["00"] = 0
    message = _refused(_replace(archive, member, json.dumps(doc).encode()), member, "$.share_map['00']")
    assert "repeats index 0 (also written '0')" in message


# -- ASCII-only digits: dispatch_table.txt --------------------------------------------------------------------

ROW_TAIL = " 0 0 0 0 0"  # the MLP's five tasks, each at candidate 0


BAD_FIELDS = [  # (field, what the message says)
    ("1_0", "non-integer field: field 1 (symbol value) is '1_0'"),
    ("+1", "non-integer field: field 1 (symbol value) is '+1'"),
    ("\uff11", "non-integer field: field 1 (symbol value) is '\uff11'"),
    ("\u0663", "non-integer field"),
    ("1\u00a0", "non-integer field"),  # a no-break space is not a separator
    ("1\x0b", "non-integer field"),
    ("0x1", "non-integer field"),
    ("1e3", "non-integer field"),
    ("-1", "negative symbol value '-1' in field 1"),
    ("9" * 20, "is out of range: at most 19 digits and below 2**63"),
    (str(INT64_MAX + 1), "is out of range"),
    (HUGE, "(5000 characters) is out of range"),
]


@pytest.mark.parametrize("field,expected", BAD_FIELDS, ids=[_short(f) for f, _ in BAD_FIELDS])
def test_dispatch_rows_take_plain_ascii_decimals_only(archive, field, expected):
    blob = _replace(archive, "dispatch_table.txt", f"batch\n{field}{ROW_TAIL}\n".encode())
    message = _refused(blob, "dispatch_table.txt", None)
    assert message.startswith("dispatch_table.txt: line 2") and expected in message


def test_a_candidate_index_gets_the_same_rules(archive):
    blob = _replace(archive, "dispatch_table.txt", b"batch\n4 0 0 0 0 1_0\n")
    assert "field 6 (candidate index) is '1_0'" in _refused(blob, "dispatch_table.txt", None)


def test_dispatch_rows_accept_spaces_tabs_and_crlf(archive):
    blob = _replace(archive, "dispatch_table.txt", f"batch\r\n7\t0  0 0 0 0\r\n\r\n{INT64_MAX}{ROW_TAIL}\n".encode())
    contents = read_bundle(blob)
    try:
        assert contents.dispatch_rows == {(7,): (0,) * 5, (INT64_MAX,): (0,) * 5}
    finally:
        contents.archive.close()


# -- expressions ----------------------------------------------------------------------------------------------

WORKSPACE = ("kernels/4/meta.json", "$.workspace")  # softmax: "batch * 4", symbols ["batch"]


def _workspace(archive: BundleArchive, value: Any) -> bytes:
    member = WORKSPACE[0]
    doc = json.loads(archive.read(member))
    doc["workspace"] = value
    return _replace(archive, member, json.dumps(doc).encode())


BAD_EXPRESSIONS = [  # (workspace expression, what the message says)
    ("(" * (MAX_DEPTH + 1) + "batch" + ")" * (MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH} levels"),
    ("-" * (MAX_DEPTH + 1) + "batch", f"nested deeper than {MAX_DEPTH} levels"),
    ("min(" * (MAX_DEPTH + 1) + "batch" + ", 1)" * (MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH} levels"),
    ("batch + (" + "+".join(["1"] * (MAX_NODES // 2 + 8)) + ")", f"more than {MAX_NODES} nodes"),  # folds: shallow
    ("batch" + " " * MAX_TEXT_CHARS, f"the limit is {MAX_TEXT_CHARS}"),
    ("batch * " + "9" * 20, "integer literal '99999999999999999999' does not fit in int64"),
    ("batch * " + "9" * 3000, "(3000 characters) does not fit in int64"),
    ("batch - 9223372036854775809", "does not fit in int64"),
    ("batch * (9223372036854775807 + 1)", "int64 overflow"),
    ("batch * \uff14", "cannot parse expression"),
    ("batch * 1_0", "cannot parse expression"),
]


@pytest.mark.parametrize("text,expected", BAD_EXPRESSIONS, ids=[_short(t) for t, _ in BAD_EXPRESSIONS])
def test_expression_limits(archive, text, expected):
    message = _refused(_workspace(archive, text), *WORKSPACE)
    assert expected in message


def test_the_smallest_int64_literal_is_an_expression_constant():
    assert parse_expr("-9223372036854775808").constant == INT64_MIN
    assert parse_expr(str(INT64_MAX)).constant == INT64_MAX


def test_an_expression_bound_to_a_huge_value_fails_on_one_short_line():
    with pytest.raises(ExprError, match=r"symbol 'n' = <an integer of 16610 bits> does not fit in int64") as info:
        parse_expr("n * 2", member="m.json", path="$.x").evaluate({"n": 10**5000})
    _one_line(info.value)


# -- sizes: products of untrusted numbers in checks and messages ----------------------------------------------

def test_a_weight_whose_size_overflows_int64_is_refused_without_printing_the_product(archive):
    member = "weights.json"
    doc = json.loads(archive.read(member))
    doc[0]["shape"] = [INT64_MAX, INT64_MAX, INT64_MAX]
    message = _refused(_replace(archive, member, json.dumps(doc).encode()), member, "$[0].nbytes")
    assert "(more than 2**63-1 bytes)" in message


def test_a_constant_tensor_over_2_62_bytes_is_the_bundles_fault(archive):
    member = "graph_execution.json"
    doc = json.loads(archive.read(member))
    doc["tensor_signatures"][1]["shape"] = [2**31, 2**31]  # float32: 2**64 bytes
    message = _refused(_replace(archive, member, json.dumps(doc).encode()), member, "$.tensor_signatures[1].shape")
    assert "needs more than 2**62 bytes" in message


@pytest.mark.parametrize("value,expected", [(-8, "expected a non-negative size, got -8"),
                                            ("-8", "expected a non-negative size, got -8"),
                                            (2**62 + 1, "over the limit of 2**62")])
def test_constant_workspaces_are_checked_at_load(archive, value, expected):
    assert expected in _refused(_workspace(archive, value), *WORKSPACE)


def test_a_negative_constant_shape_entry_is_refused(archive):
    member = "meta.json"
    doc = json.loads(archive.read(member))
    doc["inputs"][0]["shape"][1] = -64
    assert "expected a non-negative size, got -64" in _refused(
        _replace(archive, member, json.dumps(doc).encode()), member, "$.inputs[0].shape[1]")


# -- symbol values at run time --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [INT64_MAX + 1, 10**30, 10**5000], ids=["2**63", "10**30", "10**5000"])
def test_symbol_values_outside_int64_fail_cleanly_at_run_time(mlp_bundle, registry, value):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    with pytest.raises(engine.EngineError) as info:
        graph.memory_report(batch=value)
    assert isinstance(info.value, engine.InputError)
    assert "'batch'" in _one_line(info.value) and "out of range" in str(info.value)


def test_sizes_over_the_limit_at_a_key_are_an_input_error(mlp_bundle, registry):
    graph = engine.load_compiled_graph(mlp_bundle, registry=registry)
    with pytest.raises(engine.InputError) as info:
        graph.memory_report(batch=2**58)  # batch * 64 float32 is 2**66 bytes; every expression fits in int64
    assert "batch" in _one_line(info.value)
    assert np.isfinite(graph.run_async([np.zeros((2, 64), np.float32)])[0].numpy()).all()  # still usable
