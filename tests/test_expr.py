"""Tests for engine.expr: grammar, canonical printing, int64 semantics, errors and hostile limits."""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine import expr as expr_module
from engine.errors import BundleError
from engine.expr import Expr, ExprBatch, ExprError, evaluate_all, parse_expr

I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def value(text: str | int, **env: int) -> int:
    return parse_expr(text).evaluate(env)


# --- literals, symbols, precedence -------------------------------------------------------------


def test_public_names():
    assert set(expr_module.__all__) == {"Env", "Expr", "ExprBatch", "ExprError", "parse_expr", "evaluate_all"}
    assert issubclass(ExprError, BundleError) and issubclass(ExprError, ValueError)


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("42", 42), ("  7 ", 7), ("007", 7), ("9223372036854775807", I64_MAX),
    ("-9223372036854775808", I64_MIN), ("- 5", -5),
])
def test_literals(text, expected):
    e = parse_expr(text)
    assert e.is_constant and e.constant == expected == e.evaluate({})
    assert e.symbols == frozenset()


def test_int_values_become_constants():
    for v in (0, 5, -5, I64_MAX, I64_MIN):
        e = parse_expr(v)
        assert e.is_constant and e.constant == v and e.evaluate({}) == v
        assert parse_expr(str(e)) == e
    assert parse_expr(6) == parse_expr("2 * 3") == parse_expr("(6)")


@pytest.mark.parametrize("bad", [True, False, 1.0, None, b"1", [1]])
def test_non_int_non_str_refused(bad):
    with pytest.raises(BundleError, match="expected an integer or an expression string") as info:
        parse_expr(bad, member="graph.json", path="shape[0]")
    assert str(info.value).startswith("graph.json @ shape[0]: ")


@pytest.mark.parametrize("v", [2**63, I64_MIN - 1, 10**30])
def test_int_out_of_range_refused(v):
    with pytest.raises(BundleError, match="does not fit in int64"):
        parse_expr(v)


def test_symbols():
    e = parse_expr("batch * seq_len + _x1")
    assert isinstance(e, Expr)
    assert e.symbols == frozenset({"batch", "seq_len", "_x1"})
    assert not e.is_constant and e.constant is None
    assert e.evaluate({"batch": 2, "seq_len": 3, "_x1": 4}) == 10
    assert e.evaluate({"batch": 2, "seq_len": 3, "_x1": 4, "unused": 9}) == 10


@pytest.mark.parametrize("text, expected", [
    ("2 - 3 - 4", -5), ("2 * 3 + 4", 10), ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20),
    ("2 - (3 - 4)", 3), ("24 // 4 // 3", 2), ("24 // (4 // 3)", 24), ("17 % 5 * 2", 4),
    ("2 * 17 % 5", 4), ("-2 * 3", -6), ("--3", 3), ("-(-(3))", 3), ("1 - -1", 2),
])
def test_precedence_and_associativity(text, expected):
    assert value(text) == expected


def test_symbolic_associativity():
    e = parse_expr("a // b * c")
    assert e.source == "a // b * c"
    assert e.evaluate({"a": 7, "b": 2, "c": 3}) == 9  # (7 // 2) * 3, not 7 // 6
    assert parse_expr("a - b - c").evaluate({"a": 2, "b": 3, "c": 4}) == -5
    assert parse_expr("a - (b - c)").evaluate({"a": 2, "b": 3, "c": 4}) == 3


def test_unary_minus_and_floor_semantics():
    env = {"a": 7, "b": 2}
    assert parse_expr("-a // b").evaluate(env) == -4   # (-7) // 2 floors
    assert parse_expr("-(a // b)").evaluate(env) == -3
    assert value("-7 // 2") == -4 and value("7 // -2") == -4 and value("-7 // -2") == 3
    assert value("-7 % 3") == 2 and value("7 % -3") == -2 and value("-7 % -3") == -1
    assert parse_expr("a % b").evaluate({"a": -7, "b": 3}) == 2


@pytest.mark.parametrize("text, expected", [
    ("ceil_div(7, 2)", 4), ("ceil_div(8, 2)", 4), ("ceil_div(0, 5)", 0), ("ceil_div(-7, 2)", -3),
    ("ceil_div(7, -2)", -3), ("min(3, -4)", -4), ("max(3, -4)", 3), ("max(min(1, 2), 0)", 1),
    ("ceil_div( 1000 , 128 ) * 128", 1024),
])
def test_functions(text, expected):
    assert value(text) == expected


def test_functions_symbolic():
    e = parse_expr("ceil_div(batch*256,128)")
    assert e.source == "ceil_div(batch * 256, 128)"
    assert [e.evaluate({"batch": b}) for b in (0, 1, 2, 3)] == [0, 2, 4, 6]
    assert parse_expr("max(a, 1) * min(b, 4)").evaluate({"a": 0, "b": 9}) == 4


# --- canonical source ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, canonical", [
    ("batch*512*4", "batch * 512 * 4"),
    ("((batch) * (512)) * 4", "batch * 512 * 4"),
    ("batch * (512 * 4)", "batch * 2048"),           # constant subtrees are folded
    ("a-(b-c)", "a - (b - c)"),
    ("(a-b)-c", "a - b - c"),
    ("a+(b+c)", "a + (b + c)"),                      # no re-association: overflow points differ
    ("a*(b+c)", "a * (b + c)"),
    ("(a*b)+c", "a * b + c"),
    ("a//(b*c)", "a // (b * c)"),
    ("-(a)", "-a"), ("-(a+b)", "-(a + b)"), ("-(a*b)", "-(a * b)"), ("(-a)*b", "-a * b"),
    ("- - a", "--a"), ("a*(-3)", "a * -3"), ("a-(-3)", "a - -3"), ("(-3)*a", "-3 * a"),
    ("-(3)", "-3"), ("min( a ,b )", "min(a, b)"), ("ceil_div(a+1,(b))", "ceil_div(a + 1, b)"),
    ("\t a \n", "a"),
])
def test_canonical_source(text, canonical):
    e = parse_expr(text)
    assert e.source == canonical == str(e)
    assert parse_expr(canonical) == e
    assert repr(e) == f"Expr({canonical!r})"


def test_equality_and_hash_by_source():
    assert parse_expr("a*2") == parse_expr("(a) * 2")
    assert hash(parse_expr("a*2")) == hash(parse_expr("(a) * 2"))
    assert parse_expr("a*2") != parse_expr("2*a")
    assert len({parse_expr("a+1"), parse_expr("a + 1"), parse_expr("1+a")}) == 2


def test_pickle_round_trip():
    e = parse_expr("ceil_div(n, 4) * 4")
    e2 = pickle.loads(pickle.dumps(e))
    assert e2 == e and e2.evaluate({"n": 5}) == 8


# --- evaluation errors --------------------------------------------------------------------------


def test_missing_symbol_names_it():
    e = parse_expr("batch * seq", member="graph.json", path="nodes[2].shape[1]")
    with pytest.raises(ExprError) as info:
        e.evaluate({"batch": 4})
    message = str(info.value)
    assert "'seq'" in message and "'batch * seq'" in message and "not bound" in message
    assert message.startswith("graph.json @ nodes[2].shape[1]: ")
    assert info.value.member == "graph.json" and info.value.path == "nodes[2].shape[1]"


@pytest.mark.parametrize("text, env", [
    ("a * b", {"a": 2**62, "b": 2}), ("a + 1", {"a": I64_MAX}), ("a - 1", {"a": I64_MIN}),
    ("-a", {"a": I64_MIN}), ("a // -1", {"a": I64_MIN}), ("ceil_div(a, -1)", {"a": I64_MIN}),
    ("a * a * a", {"a": 2**22}),
])
def test_overflow_detected(text, env):
    with pytest.raises(ExprError, match="int64 overflow"):
        parse_expr(text).evaluate(env)


def test_extremes_that_fit():
    assert parse_expr("a + 1 - 1").evaluate({"a": I64_MIN}) == I64_MIN
    with pytest.raises(ExprError, match="overflow in .a - 1."):  # every intermediate is checked
        parse_expr("a - 1 + 1").evaluate({"a": I64_MIN})
    assert parse_expr("a * -1").evaluate({"a": I64_MAX}) == -I64_MAX
    assert parse_expr("a % -1").evaluate({"a": I64_MIN}) == 0
    assert parse_expr("min(a, b)").evaluate({"a": I64_MIN, "b": I64_MAX}) == I64_MIN


@pytest.mark.parametrize("text", ["a // b", "a % b", "ceil_div(a, b)", "a // (b * 2)"])
def test_zero_division(text):
    with pytest.raises(ExprError, match="division by zero"):
        parse_expr(text).evaluate({"a": 5, "b": 0})


@pytest.mark.parametrize("text, match", [
    ("1 // 0", "division by zero"), ("min(a, 5 % (2 - 2))", "division by zero"),
    ("9223372036854775807 + 1", "int64 overflow"), ("a + 4611686018427387904 * 2", "int64 overflow"),
    ("--9223372036854775808", "int64 overflow"), ("9223372036854775808", "does not fit in int64"),
    ("-9223372036854775809", "does not fit in int64"), ("1" * 30, "does not fit in int64"),
])
def test_constant_errors_at_parse_time(text, match):
    with pytest.raises(BundleError, match=match) as info:
        parse_expr(text, member="m", path="p")
    assert not isinstance(info.value, ExprError)
    assert str(info.value).startswith("m @ p: ")


@pytest.mark.parametrize("bad", [True, 1.5, "3", None, 2**63])
def test_bad_environment_values(bad):
    with pytest.raises(ExprError, match="'n'"):
        parse_expr("n + 1").evaluate({"n": bad})


def test_numpy_integer_environment_values():
    np = pytest.importorskip("numpy")
    assert parse_expr("n * 2").evaluate({"n": np.int64(21)}) == 42
    assert parse_expr("n").evaluate({"n": np.int32(-3)}) == -3


class _Untouchable(Mapping):
    def __getitem__(self, key):
        raise AssertionError("a constant expression read the environment")

    def __iter__(self):
        raise AssertionError("a constant expression read the environment")

    def __len__(self):
        raise AssertionError("a constant expression read the environment")


def test_constant_does_not_read_environment():
    assert parse_expr("ceil_div(1000, 3) * 2").evaluate(_Untouchable()) == 668


def test_evaluate_all():
    exprs = [parse_expr("b"), parse_expr("b * s * 4"), parse_expr(16)]
    assert evaluate_all(exprs, {"b": 2, "s": 3}) == (2, 24, 16)
    assert evaluate_all([], {}) == ()
    with pytest.raises(ExprError, match="'s'"):
        evaluate_all(exprs, {"b": 2})


# --- malformed input ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, column, expected", [
    ("batch*", 7, "expected an integer, a symbol"),
    ("(1", 3, "expected ')'"),
    ("1)", 2, "found ')'"),
    ("__import__('os')", 1, "'__import__' is not a function"),
    ("a.b", 2, "found '.'"),
    ("min(1)", 6, "expected ',' (min takes exactly 2 arguments), found ')'"),
    ("min(1,2,3)", 8, "expected ')' (min takes exactly 2 arguments), found ','"),
    ("1e3", 2, "found 'e3'"),
    ("", 1, "expected an integer, a symbol"),
    ("   ", 4, "expected an integer, a symbol"),
    ("max", 4, "expected '(' after function name 'max'"),
    ("min + 1", 5, "function names are reserved"),
    ("ceil_div", 9, "expected '('"),
    ("a / b", 3, "found '/'"),
    ("a ** 2", 4, "expected an integer, a symbol"),
    ("+1", 1, "found '+'"),
    ("f(x)", 1, "'f' is not a function"),
    ("a b", 3, "found 'b'"),
    ("1.5", 2, "found '.'"),
    ("()", 2, "found ')'"),
    ("min(,1)", 5, "found ','"),
    ("a\u00a0+ 1", 2, "found '\\xa0'"),
    ("\u0661", 1, "found"),                       # non-ASCII digit
])
def test_malformed(text, column, expected):
    with pytest.raises(BundleError) as info:
        parse_expr(text, member="graph.json", path="nodes[0].outputs[0].shape[1]")
    message = str(info.value)
    assert message.startswith("graph.json @ nodes[0].outputs[0].shape[1]: cannot parse expression ")
    assert repr(text) in message
    assert f"at column {column}:" in message
    assert expected in message
    assert info.value.member == "graph.json"


def test_documented_message_example():
    with pytest.raises(BundleError) as info:
        parse_expr("batch*(4")
    assert str(info.value) == "cannot parse expression 'batch*(4' at column 9: expected ')'"


# --- limits (hostile bundles) -------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "(" * 100 + "1" + ")" * 100,
    "(" * 10000 + "1" + ")" * 10000,   # too long, caught before parsing
    "-" * 100 + "a",
    "-(" * 60 + "a" + ")" * 60,
    "min(" * 65 + "a" + ", 1)" * 65,
    "a" + " + a" * 70,                  # a left-leaning chain 71 operators deep
    "a" + "+a" * 1100,                 # too many nodes / too deep
    "1+" * 2000 + "1",
    "x" * 4097,
    " " * 4097,
])
def test_limits_raise_bundle_error_not_recursion(text):
    with pytest.raises(BundleError) as info:
        parse_expr(text, member="m", path="p")
    assert str(info.value).startswith("m @ p: ")
    assert len(str(info.value)) < 400  # hostile text is not echoed in full


def test_within_limits():
    assert value("(" * 64 + "1" + ")" * 64) == 1
    assert value("-" * 63 + "1") == -1
    assert parse_expr("a" + " + a" * 63).evaluate({"a": 1}) == 64
    assert value("1+" * 400 + "1") == 401  # folds as it goes, so it never gets deep
    assert len(parse_expr("x" * 4096).source) == 4096


def test_node_limit():
    # Balanced sums of distinct symbols stay shallow, so only the node count trips.
    def balanced(lo: int, hi: int) -> str:
        if lo == hi:
            return f"s{lo}"
        mid = (lo + hi) // 2
        return f"({balanced(lo, mid)}+{balanced(mid + 1, hi)})"

    ok = parse_expr(balanced(0, 300))
    assert ok.evaluate({f"s{i}": 1 for i in range(301)}) == 301
    text = balanced(0, 520)
    assert len(text) <= 4096
    with pytest.raises(BundleError, match="more than 1024 nodes"):
        parse_expr(text)


def test_no_eval_in_module():
    source = Path(expr_module.__file__).read_text()
    assert not re.search(r"\b(eval|exec)\(", source)
    assert not re.search(r"^\s*(import ast|from ast)", source, re.M)


# --- property tests against a reference evaluator ------------------------------------------------

SYMBOLS = ["a", "b", "n_1", "_c"]
BINARY = ["+", "-", "*", "//", "%"]
FUNCS = ["ceil_div", "min", "max"]


class RefOverflow(Exception):
    pass


def ref_eval(tree, env) -> int:
    """Straightforward reference: Python ints, every intermediate checked against int64."""
    kind = tree[0]
    if kind == "int":
        r = tree[1]
    elif kind == "sym":
        r = env[tree[1]]
    elif kind == "neg":
        r = -ref_eval(tree[1], env)
    else:
        x, y = ref_eval(tree[1], env), ref_eval(tree[2], env)
        if kind in ("//", "%", "ceil_div") and y == 0:
            raise ZeroDivisionError
        r = {"+": lambda: x + y, "-": lambda: x - y, "*": lambda: x * y, "//": lambda: x // y,
             "%": lambda: x % y, "ceil_div": lambda: -((-x) // y), "min": lambda: min(x, y),
             "max": lambda: max(x, y)}[kind]()
    if not I64_MIN <= r <= I64_MAX:
        raise RefOverflow
    return r


def render(tree) -> str:
    """Over-parenthesised text, so the parser's precedence is not what is being trusted."""
    kind = tree[0]
    if kind in ("int", "sym"):
        return str(tree[1])
    if kind == "neg":
        return f"-({render(tree[1])})"
    if kind in FUNCS:
        return f"{kind}( {render(tree[1])} ,{render(tree[2])})"
    return f"({render(tree[1])}){kind}( {render(tree[2])} )"


def height(tree) -> int:
    return 1 if tree[0] in ("int", "sym") else 1 + max(height(t) for t in tree[1:])


ints = st.one_of(st.integers(0, 9), st.integers(0, I64_MAX), st.sampled_from([2**31, 2**32, I64_MAX]))
leaves = st.tuples(st.integers(0, 2), ints, st.sampled_from(SYMBOLS)).map(  # 2 in 3 are symbols
    lambda t: ("int", t[1]) if t[0] == 0 else ("sym", t[2]))
trees = st.recursive(
    leaves,
    # One sampled operator rather than one_of(neg, binary): hypothesis favours one_of's first branch.
    lambda kids: st.tuples(st.sampled_from(["neg"] + BINARY + FUNCS), kids, kids).map(
        lambda t: t[:2] if t[0] == "neg" else t),
    max_leaves=14,
)
env_values = st.one_of(st.integers(-9, 9), st.integers(I64_MIN, I64_MAX),
                       st.sampled_from([I64_MIN, I64_MAX, 2**31, -(2**32)]))
envs = st.fixed_dictionaries({s: env_values for s in SYMBOLS})


@settings(max_examples=400, deadline=None)
@given(trees, envs)
def test_matches_reference_and_round_trips(tree, env):
    assume(height(tree) <= 25)
    text = render(tree)
    try:
        expected = ref_eval(tree, env)
    except (RefOverflow, ZeroDivisionError):
        expected = None
    try:
        e = parse_expr(text)
    except BundleError as err:
        # Only a constant subtree may fail at parse time, and then the reference fails too.
        assert not isinstance(err, ExprError)
        assert expected is None, f"{text} refused: {err}"
        return
    again = parse_expr(e.source)
    assert again == e and again.source == e.source and again.symbols == e.symbols
    assert e.symbols <= set(SYMBOLS)
    if expected is None:
        with pytest.raises(ExprError):
            e.evaluate(env)
        with pytest.raises(ExprError):
            again.evaluate(env)
    else:
        assert e.evaluate(env) == expected == again.evaluate(env)
        if e.is_constant:
            assert e.constant == expected


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab01 +-*/%(),minaxceil_d.\t", max_size=40))
def test_arbitrary_text_parses_or_raises_bundle_error(text):
    try:
        e = parse_expr(text)
    except BundleError as err:
        assert "column" in str(err) or "expression" in str(err)
        return
    assert parse_expr(e.source) == e
    try:
        e.evaluate(dict.fromkeys(e.symbols, 3))
    except ExprError:
        pass


def paren_pairs(source: str):
    stack, pairs = [], []
    for i, ch in enumerate(source):
        if ch == "(":
            stack.append(i)
        elif ch == ")":
            pairs.append((stack.pop(), i))
    return pairs


@settings(max_examples=300, deadline=None)
@given(trees)
def test_canonical_parentheses_are_minimal(tree):
    assume(height(tree) <= 25)
    try:
        e = parse_expr(render(tree))
    except BundleError:
        return
    for open_, close in paren_pairs(e.source):
        if open_ and (e.source[open_ - 1].isalnum() or e.source[open_ - 1] == "_"):
            continue  # a function call's parentheses
        stripped = e.source[:open_] + e.source[open_ + 1:close] + e.source[close + 1:]
        try:
            assert parse_expr(stripped) != e, f"redundant parentheses in {e.source!r}"
        except BundleError:
            pass


# --- ExprBatch: the same answers and errors as the per-expression loop ----------------------------


def loop_outcome(exprs, symbols, values):
    """What ``[e.evaluate(env) for e in exprs]`` gives: ("ok", values) or ("error", message, where)."""
    env = dict(zip(symbols, values))
    try:
        return ("ok", [e.evaluate(env) for e in exprs])
    except ExprError as err:
        return ("error", str(err), (err.member, err.path))


def batch_outcome(exprs, symbols, values):
    """The batch's outcome, the same through ``evaluate``, ``evaluate_array`` and the Python tape
    (without the compiled one: what an install without a C compiler runs)."""
    outcomes = []
    for how in ("evaluate", "evaluate_array", "python tape"):
        batch = ExprBatch(exprs, symbols)
        if how == "python tape":
            batch._codes = None
        try:
            if how == "evaluate_array":
                array = batch.evaluate_array(values)
                assert array.dtype == np.int64
                result = array.tolist()
            else:
                result = batch.evaluate(values)
        except ExprError as err:
            outcomes.append(("error", str(err), (err.member, err.path)))
            continue
        assert type(result) is list and all(type(v) is int for v in result)
        outcomes.append(("ok", result))
    assert outcomes[0] == outcomes[1] == outcomes[2], outcomes
    return outcomes[0]


def assert_like_loop(exprs, symbols, values):
    expected = loop_outcome(exprs, symbols, values)
    assert batch_outcome(exprs, symbols, values) == expected
    return expected


@st.composite
def batches(draw):
    """Random trees plus combinations of them, so that subtrees are shared across the batch."""
    base = draw(st.lists(trees, min_size=1, max_size=4))
    combined = [
        (op, base[i], base[j]) if op != "neg" else ("neg", base[i])
        for op, i, j in draw(st.lists(st.tuples(st.sampled_from(["neg"] + BINARY + FUNCS),
                                                st.integers(0, len(base) - 1),
                                                st.integers(0, len(base) - 1)), max_size=6))
    ]
    exprs = []
    for k, tree in enumerate(base + combined):
        if height(tree) > 25:
            continue
        try:
            exprs.append(parse_expr(render(tree), member="graph.json", path=f"sizes[{k}]"))
        except BundleError:
            pass  # a constant subtree failed at parse time; nothing to evaluate
    return draw(st.permutations(exprs))


@settings(max_examples=500, deadline=None)
@given(batches(), st.permutations(SYMBOLS), st.integers(0, 9), st.data())
def test_batch_matches_the_per_expression_loop(exprs, symbols, drop, data):
    if drop == 0:
        symbols = symbols[:-1]  # now and then a symbol is unbound
    values = data.draw(st.lists(env_values, min_size=len(symbols), max_size=len(symbols)))
    assert_like_loop(exprs, symbols, values)


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from([0, 1, -1, 2, I64_MAX, I64_MIN, 2**31, 2**32 + 1, -(2**62)]))
def test_batch_matches_the_loop_at_edge_values(exprs, edge):
    for values in ([edge] * 4, [edge, 1, 0, -1], [3, edge, edge, 7]):
        assert_like_loop(exprs, SYMBOLS, values)


def test_batch_basic_and_shared_subexpressions():
    texts = ["a * b", "a * b * 4", "(a * b) // 2", "b * a + 1", "-(a * b)", "-(a * b) * 2"]
    exprs = [parse_expr(t) for t in texts]
    batch = ExprBatch(exprs, ["a", "b"])
    assert batch.symbols == ("a", "b")
    assert batch.evaluate([3, 5]) == [15, 60, 7, 16, -15, -30]
    nodes = sum(1 for t in texts for node in re.findall(r"\*|//|\+|-", t))
    assert nodes == 12
    # a * b once (b * a is the same product), then one step for each thing built on it.
    assert batch.steps == 6 < nodes
    assert "6 steps" in repr(batch)


def test_batch_duplicates_and_input_kinds():
    e = parse_expr("ceil_div(n, 128) * m")
    batch = ExprBatch([e, e, parse_expr("ceil_div(n,128)*m"), parse_expr("m")], ("n", "m"))
    assert batch.steps == 2
    assert batch.evaluate([1000, 3]) == [24, 24, 24, 3]
    assert batch.evaluate((1000, 3)) == [24, 24, 24, 3]
    assert batch.evaluate(iter([1000, 3])) == [24, 24, 24, 3]  # type: ignore[arg-type]


def test_batch_constants_and_empty():
    consts = [parse_expr(5), parse_expr("2 * 3"), parse_expr(-7), parse_expr(I64_MIN), parse_expr(0)]
    assert ExprBatch(consts, []).evaluate([]) == [5, 6, -7, I64_MIN, 0]
    assert ExprBatch(consts, []).steps == 0
    assert ExprBatch(consts + [parse_expr("a + 5")], ["a"]).evaluate([1]) == [5, 6, -7, I64_MIN, 0, 6]
    assert ExprBatch([], []).evaluate([]) == []
    assert ExprBatch([], ["a", "b"]).evaluate([1, 2]) == []
    assert ExprBatch([parse_expr("a")], ["a"]).evaluate([I64_MIN]) == [I64_MIN]  # one output
    assert ExprBatch([parse_expr(9)], ["a"]).evaluate([]) == [9]  # constants read nothing


def test_batch_unbound_symbol():
    exprs = [parse_expr("a * 2"), parse_expr("a * b", member="graph.json", path="sizes[1]")]
    kind, message, where = assert_like_loop(exprs, ["a"], [3])
    assert kind == "error" and "'b' is not bound" in message and where == ("graph.json", "sizes[1]")
    assert assert_like_loop(exprs, ["a", "b"], [3])[0] == "error"  # fewer values than symbols
    assert assert_like_loop(exprs, ["a", "b"], [3, 4, 5]) == ("ok", [6, 12])  # extras ignored, as zip does
    assert assert_like_loop(exprs, ["b", "a", "b"], [1, 3, 4]) == ("ok", [6, 12])  # later duplicate wins


@pytest.mark.parametrize("bad", [True, False, 1.0, 2.5, "3", None, 2**63, I64_MIN - 1, 10**40])
def test_batch_bad_values(bad):
    exprs = [parse_expr("a + 1"), parse_expr("n * 2", member="m", path="p")]
    kind, message, where = assert_like_loop(exprs, ["a", "n"], [1, bad])
    assert kind == "error" and "'n'" in message and where == ("m", "p")
    # A bad value for a symbol that no expression reads is not an error, in either.
    assert assert_like_loop(exprs[:1], ["a", "n"], [1, bad]) == ("ok", [2])


def test_batch_numpy_integers():
    np = pytest.importorskip("numpy")
    exprs = [parse_expr("n * 2"), parse_expr("ceil_div(n, m) * m"), parse_expr("-m")]
    for values in ([np.int64(21), np.int32(-4)], np.array([21, 4], np.int64), [21, np.uint8(4)]):
        assert assert_like_loop(exprs, ["n", "m"], values)[0] == "ok"
    assert ExprBatch(exprs, ["n", "m"]).evaluate([np.int64(21), np.int64(4)]) == [42, 24, -4]
    kind, message, _ = assert_like_loop(exprs, ["n", "m"], [np.uint64(2**64 - 1), 1])
    assert kind == "error" and "does not fit in int64" in message
    assert assert_like_loop(exprs, ["n", "m"], [np.float64(2.0), 1])[0] == "error"
    assert assert_like_loop(exprs, ["n", "m"], [np.bool_(True), 1])[0] == "error"


@pytest.mark.parametrize("texts, values", [
    (["a // b"], [5, 0]),
    (["a % b"], [5, 0]),
    (["ceil_div(a, b)"], [5, 0]),
    (["a + 1", "a // (b - b)", "a * 2"], [5, 3]),  # a zero made of symbols, in the middle
    (["a // b", "a // (b * 2)"], [5, 0]),
])
def test_batch_division_by_zero(texts, values):
    exprs = [parse_expr(t) for t in texts]
    kind, message, _ = assert_like_loop(exprs, ["a", "b"], values)
    assert kind == "error" and "division by zero" in message


@pytest.mark.parametrize("texts, values", [
    (["a * b // b"], [2**62, 4]),                 # 2**64 on the way, 2**62 at the end
    (["a + a - a"], [2**62, 0]),
    (["a - 1 + 1"], [I64_MIN, 0]),
    (["min(a * b, 1)"], [2**40, 2**40]),
    (["-a % 7"], [I64_MIN, 0]),
    (["a // -1"], [I64_MIN, 0]),
    (["ceil_div(a, -1)"], [I64_MIN, 0]),
    (["b", "a * a * a // (a * a)", "a"], [2**22, 1]),  # the error is the second expression's
])
def test_batch_intermediate_overflow_raises_like_the_loop(texts, values):
    exprs = [parse_expr(t) for t in texts]
    kind, message, _ = assert_like_loop(exprs, ["a", "b"], values)
    assert kind == "error" and "int64 overflow" in message


def test_batch_extremes_that_fit():
    exprs = [parse_expr(t) for t in ["ceil_div(a, 2)", "a % -1", "a + 1 - 1", "min(a, b)", "max(a, b)",
                                     "-b", "b * -1", "a // b", "ceil_div(a, b)"]]
    assert assert_like_loop(exprs, ["a", "b"], [I64_MIN, I64_MAX]) == (
        "ok", [-(2**62), 0, I64_MIN, I64_MIN, I64_MAX, -I64_MAX, -I64_MAX, -2, -1])


def test_batch_pickles():
    batch = ExprBatch([parse_expr("a * b + 1"), parse_expr(3)], ["a", "b"])
    again = pickle.loads(pickle.dumps(batch))
    assert again.symbols == ("a", "b") and again.steps == batch.steps == 2
    assert again.evaluate([2, 3]) == [7, 3]


def test_the_compiled_tape_is_built_and_used():
    """``./scripts/test`` sets ENGINE_REQUIRE_NATIVE=1: there the compiled tape must exist."""
    from engine.compiled import HELPERS, python_passes

    if HELPERS.expr_tape is None:
        if os.environ.get("ENGINE_REQUIRE_NATIVE") == "1":
            pytest.fail("engine._exprtape was not built (ENGINE_REQUIRE_NATIVE=1)")
        pytest.skip("engine._exprtape was not built (no C compiler at install)")
    texts = [f"a * {k} + b // {k + 1} - ceil_div(a, {k + 2}) % (b + {k})" for k in range(10)]
    batch = ExprBatch([parse_expr(t) for t in texts], ["a", "b"])
    assert batch.compiled and batch.steps >= 24
    want = [a * k + b // (k + 1) - -(-a // (k + 2)) % (b + k) for a, b in [(1000, 7)] for k in range(10)]
    assert batch.evaluate([1000, 7]) == want == batch.evaluate_array([1000, 7]).tolist()
    with python_passes():  # the Python tape, as an install without a C compiler runs it
        python = ExprBatch([parse_expr(t) for t in texts], ["a", "b"])
    assert not python.compiled and python.evaluate([1000, 7]) == want == python.evaluate_array([1000, 7]).tolist()
    z1, out = np.zeros(1, np.int64), np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="tape step 0 is malformed"):  # an unknown opcode
        HELPERS.expr_tape.evaluate(np.array([99], np.int64), z1, z1, z1, [], z1, out)
    with pytest.raises(ValueError, match="tape step 0 is malformed"):  # an operand from a later slot
        HELPERS.expr_tape.evaluate(np.array([0], np.int64), np.array([1], np.int64), z1, z1, [], z1, out)
    with pytest.raises(ValueError, match="picks\\[0\\] is not a slot"):
        HELPERS.expr_tape.evaluate(z1, z1, z1, z1, [], np.array([7], np.int64), out)
    with pytest.raises(ValueError, match="inconsistent lengths"):  # more values than leading slots
        HELPERS.expr_tape.evaluate(z1, z1, z1, z1, [1, 2], z1, out)
    assert not HELPERS.expr_tape.evaluate(z1, z1, z1, z1, [2**63], z1, out)  # not in int64: Python decides
    assert not HELPERS.expr_tape.evaluate(z1, z1, z1, z1, [True], z1, out)  # not a plain int: Python decides
    assert HELPERS.expr_tape.evaluate(z1, z1, z1, z1, [21], np.array([1], np.int64), out)
    assert out.tolist() == [42]  # slot 0 = the symbol, 21; step 0 (ADD, slots 0 and 0) writes slot 1
