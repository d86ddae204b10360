"""Integer expressions for shapes, workspace sizes and launch dimensions.

A bundle writes a size as a small expression over named symbols (``batch * 512``,
``ceil_div(seq, 128)``). Bundles are untrusted, so the text is parsed by the hand-written
recursive-descent parser below -- never ``eval`` or ``ast`` -- under hard limits on length, nesting
and node count, and every value is checked to fit in a signed 64-bit integer, because these numbers
end up in C structs and GPU launch parameters where a silent wrap-around would be a memory bug.

Grammar (lowest precedence first; operators are left-associative, unary minus binds tighter than
``*`` as in Python; ``//`` and ``%`` floor as in Python)::

    sum     := product (('+' | '-') product)*
    product := unary (('*' | '//' | '%') unary)*
    unary   := '-' unary | primary
    primary := INT | NAME | FUNC '(' sum ',' sum ')' | '(' sum ')'       FUNC: ceil_div, min, max

Shapes are evaluated on every run, so an expression is parsed and constant-folded once and then
compiled into nested closures: evaluation is plain calls and integer operations, and a constant
expression returns its value without touching the environment.

A planner that needs every size of a graph at once uses :class:`ExprBatch`: the trees are merged
into one tape on which a subexpression shared by many sizes (``batch * seq``) is computed once, and
int64 range is checked once at the end; any problem replays the per-expression path, so errors are
exactly those of :meth:`Expr.evaluate`.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn, cast

import attrs
import numpy as np

from engine.errors import BundleError
from engine.numbers import clip, parse_decimal

from engine.compiled import HELPERS  # the compiled tape (``_exprtape.c``) where built and switched on

__all__ = ["Env", "Expr", "ExprBatch", "ExprError", "parse_expr", "evaluate_all"]

Env = Mapping[str, int]

MAX_TEXT_CHARS = 4096
MAX_DEPTH = 64
MAX_NODES = 1024
_MIN, _MAX = -(2**63), 2**63 - 1


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


# Two-argument forms: the builtins parse *args and keywords, which costs about 3x a plain call.
def _min(a: int, b: int) -> int:
    return a if a <= b else b


def _max(a: int, b: int) -> int:
    return a if a >= b else b


_FUNCTIONS: dict[str, Callable[[int, int], int]] = {"ceil_div": _ceil_div, "min": _min, "max": _max}
_BINARY: dict[str, Callable[[int, int], int]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul,
    "//": operator.floordiv, "%": operator.mod, **_FUNCTIONS,
}
_LEVEL = {"+": 1, "-": 1, "*": 2, "//": 2, "%": 2}  # binding strength, for minimal parentheses
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([A-Za-z_][A-Za-z0-9_]*)|(//|[-+*%(),]))", re.ASCII)
_SPACE = re.compile(r"\s*", re.ASCII)


class ExprError(BundleError):
    """An expression could not be evaluated: unbound symbol, int64 overflow, division by zero."""


class _Fail(Exception):
    """Internal: raised inside compiled closures, turned into ExprError naming the expression."""


class _Node:
    """A parsed, constant-folded tree node. ``op`` is "int", "sym", "neg", a binary operator or a
    function name; ``value`` is the integer (for "int") or the symbol name (for "sym")."""

    __slots__ = ("op", "args", "value", "height")

    def __init__(self, op: str, args: tuple[_Node, ...] = (), value: int | str | None = None):
        self.op, self.args, self.value = op, args, value
        self.height: int = 1 + max((a.height for a in args), default=0)


def _level(node: _Node) -> int:
    if node.op == "neg" or (node.op == "int" and node.value < 0):  # type: ignore[operator]
        return 3
    return _LEVEL.get(node.op, 4)


def _format(node: _Node) -> str:
    """Canonical text: spaces around binary operators, parentheses only where meaning needs them."""
    op, args = node.op, node.args
    if op in ("int", "sym"):
        return str(node.value)
    if op == "neg":
        (x,) = args
        return "-" + (f"({_format(x)})" if _level(x) < 3 else _format(x))
    if op in _FUNCTIONS:
        return f"{op}({_format(args[0])}, {_format(args[1])})"
    a, b, level = args[0], args[1], _LEVEL[op]
    left = f"({_format(a)})" if _level(a) < level else _format(a)
    right = f"({_format(b)})" if _level(b) <= level else _format(b)  # left-assoc: a - (b - c)
    return f"{left} {op} {right}"


def _read(name: str) -> Callable[[Env], int]:
    def read(env: Env) -> int:
        try:
            v = env[name]
        except KeyError:
            raise _Fail(f"symbol {name!r} is not bound") from None
        if type(v) is int and _MIN <= v <= _MAX:
            return v
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise _Fail(f"symbol {name!r} is bound to {type(v).__name__} {_show(v)}, not an integer")
        v = operator.index(v)  # numpy integers and friends
        if not _MIN <= v <= _MAX:
            raise _Fail(f"symbol {name!r} = {_show(v)} does not fit in int64")
        return v
    return read


def _compile(node: _Node) -> Callable[[Env], int]:
    """Turn a folded tree into nested closures; only leaves read the environment.

    This is the single place where arithmetic semantics live: constant folding at parse time runs
    the same closures on an empty environment, and ExprBatch runs the same ``_BINARY`` functions
    and replays these closures whenever anything is off.
    """
    if node.op == "int":
        value = node.value
        return lambda env: value  # type: ignore[return-value]
    if node.op == "sym":
        return _read(node.value)  # type: ignore[arg-type]

    def overflow() -> NoReturn:
        raise _Fail(f"int64 overflow in {_quote(_format(node))}")

    if node.op == "neg":
        fx = _compile(node.args[0])

        def neg(env: Env) -> int:
            r = -fx(env)
            return r if r <= _MAX else overflow()
        return neg
    fa, fb = _compile(node.args[0]), _compile(node.args[1])
    fn, b = _BINARY[node.op], node.args[1]
    if b.op == "int" and b.value != 0:  # `x * 4`, `ceil_div(x, 128)`: skip a call, cannot divide by 0
        c = cast(int, b.value)  # an "int" node's value

        def binary_const(env: Env) -> int:
            r = fn(fa(env), c)
            return r if _MIN <= r <= _MAX else overflow()
        return binary_const

    def binary(env: Env) -> int:
        try:
            r = fn(fa(env), fb(env))
        except ZeroDivisionError:
            raise _Fail(f"division by zero in {_quote(_format(node))}") from None
        return r if _MIN <= r <= _MAX else overflow()
    return binary


def _quote(text: str) -> str:
    return repr(text if len(text) <= 120 else text[:100] + "...")


def _show(value: object) -> str:
    """A value for a message, bounded: a symbol bound to ``10**5000`` must not make the message
    itself fail (``str`` of an int past 4300 digits raises ValueError) or run to pages."""
    if type(value) is int and not -10**30 < value < 10**30:
        return f"{'-' if value < 0 else ''}<an integer of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:  # an odd object's repr (a huge numpy integer subclass, say) -- its type will do
        return f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:50] + f"... ({len(text)} characters)"


class _Parser:
    def __init__(self, text: str, member: str | None, path: str | None):
        self.text, self.member, self.path = text, member, path
        self.depth = self.nodes = self.i = 0
        self.tokens: list[tuple[str, str, int]] = []  # (kind, text, position)
        pos = 0
        while m := _TOKEN.match(text, pos):
            group = m.lastindex or 0
            self.tokens.append((("int", "name", "op")[group - 1], m.group(group), m.start(group)))
            pos = m.end()
        end = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        # A stray character becomes a "bad" token that nothing accepts, so the parser reports what
        # it expected there (and '__import__(' gets its better message before reaching the quote).
        self.tokens.append(("bad", text[end], end) if end < len(text) else ("end", "", end))

    def fail(self, message: str, pos: int, prefix: str = "cannot parse expression") -> NoReturn:
        raise BundleError(f"{prefix} {_quote(self.text)} at column {pos + 1}: {message}",
                          member=self.member, path=self.path)

    def expected(self, what: str) -> NoReturn:
        kind, text, pos = self.tokens[self.i]
        self.fail(f"expected {what}" + ("" if kind == "end" else f", found {text!r}"), pos)

    def peek(self) -> str:
        return self.tokens[self.i][1]

    def take(self, token: str, what: str) -> None:
        if self.peek() != token:
            self.expected(what)
        self.i += 1

    def enter(self, pos: int) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(f"nested deeper than {MAX_DEPTH} levels", pos, "expression")

    def make(self, op: str, args: tuple[_Node, ...], pos: int, value: int | str | None = None) -> _Node:
        """Build a node, counting it against the limits and folding it if all args are constant."""
        self.nodes += 1
        if self.nodes > MAX_NODES:
            self.fail(f"more than {MAX_NODES} nodes", pos, "expression")
        node = _Node(op, args, value)
        if args and all(a.op == "int" for a in args):
            try:
                node = _Node("int", (), _compile(node)({}))
            except _Fail as e:
                self.fail(str(e), pos, "expression")
        if node.height > MAX_DEPTH:
            self.fail(f"nested deeper than {MAX_DEPTH} levels", pos, "expression")
        return node

    def parse(self) -> _Node:
        node = self.sum()
        if self.tokens[self.i][0] != "end":
            self.expected("an operator or the end of the expression")
        return node

    def sum(self) -> _Node:
        node = self.product()
        while self.peek() in ("+", "-"):
            op, pos = self.peek(), self.tokens[self.i][2]
            self.i += 1
            node = self.make(op, (node, self.product()), pos)
        return node

    def product(self) -> _Node:
        node = self.unary()
        while self.peek() in ("*", "//", "%"):
            op, pos = self.peek(), self.tokens[self.i][2]
            self.i += 1
            node = self.make(op, (node, self.unary()), pos)
        return node

    def unary(self) -> _Node:
        if self.peek() != "-":
            return self.primary()
        pos = self.tokens[self.i][2]
        self.i += 1
        self.enter(pos)
        kind, digits, at = self.tokens[self.i]
        if kind == "int":  # a negative literal directly, so that -9223372036854775808 is expressible
            self.i += 1
            magnitude = parse_decimal(digits, maximum=-_MIN)
            if magnitude is None:
                self.fail(f"integer literal {clip('-' + digits)} does not fit in int64", at)
            node = self.make("int", (), pos, -magnitude)
        else:
            node = self.make("neg", (self.unary(),), pos)
        self.depth -= 1
        return node

    def primary(self) -> _Node:
        kind, text, pos = self.tokens[self.i]
        if kind == "int":
            self.i += 1
            value = parse_decimal(text)
            if value is None:
                self.fail(f"integer literal {clip(text)} does not fit in int64", pos)
            return self.make("int", (), pos, value)
        if kind == "name":
            self.i += 1
            if text in _FUNCTIONS:
                arity = f" ({text} takes exactly 2 arguments)"
                self.take("(", f"'(' after function name {text!r} (function names are reserved)")
                self.enter(pos)
                a = self.sum()
                self.take(",", "','" + arity)
                b = self.sum()
                self.take(")", "')'" + arity)
                self.depth -= 1
                return self.make(text, (a, b), pos)
            if self.peek() == "(":
                self.fail(f"{text!r} is not a function (the functions are ceil_div, min and max)", pos)
            return self.make("sym", (), pos, text)
        if text == "(":
            self.i += 1
            self.enter(pos)
            node = self.sum()
            self.take(")", "')'")
            self.depth -= 1
            return node
        self.expected("an integer, a symbol, a function call, '(' or '-'")


@attrs.frozen(repr=False)
class Expr:
    """A parsed integer expression. Build it with :func:`parse_expr`; equal iff canonical sources are."""

    source: str
    symbols: frozenset[str] = attrs.field(eq=False)
    _value: int | None = attrs.field(eq=False, alias="value")
    _run: Callable[[Env], int] = attrs.field(eq=False, alias="run")
    _root: _Node = attrs.field(eq=False, alias="root")  # the folded tree, for ExprBatch's tape
    _member: str | None = attrs.field(default=None, eq=False, alias="member")
    _path: str | None = attrs.field(default=None, eq=False, alias="path")

    def evaluate(self, env: Env) -> int:
        """The value under ``env``; raises ExprError naming this expression and the cause."""
        if self._value is not None:
            return self._value
        try:
            return self._run(env)
        except _Fail as e:
            bound = [f"{s}={_show(env[s])}" for s in sorted(self.symbols) if s in env][:8]
            note = f" (with {', '.join(bound)})" if bound else ""
            raise ExprError(f"cannot evaluate {_quote(self.source)}: {e}{note}",
                            member=self._member, path=self._path) from None

    @property
    def is_constant(self) -> bool:
        return self._value is not None

    @property
    def constant(self) -> int | None:
        return self._value

    def __str__(self) -> str:
        return self.source

    def __repr__(self) -> str:
        return f"Expr({self.source!r})"

    def __reduce__(self) -> tuple[Callable[..., Expr], tuple[str]]:
        return parse_expr, (self.source,)  # closures do not pickle; the source is the whole state


def parse_expr(value: str | int, *, member: str | None = None, path: str | None = None) -> Expr:
    """Parse expression text (or take an int as a constant); BundleError with context if malformed."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BundleError(f"expected an integer or an expression string, got {type(value).__name__} "
                          f"{_show(value)}", member=member, path=path)
    if isinstance(value, int):
        if not _MIN <= value <= _MAX:
            raise BundleError(f"integer {_show(value)} does not fit in int64", member=member, path=path)
        return Expr(str(value), frozenset(), value=value, run=lambda env: value, root=_Node("int", (), value),
                    member=member, path=path)
    if len(value) > MAX_TEXT_CHARS:
        raise BundleError(f"expression {_quote(value)} is {len(value)} characters long; the limit is "
                          f"{MAX_TEXT_CHARS}", member=member, path=path)
    root = _Parser(value, member, path).parse()
    source = _format(root)
    if len(source) > MAX_TEXT_CHARS:  # spacing can lengthen it; keep the round trip guaranteed
        raise BundleError(f"expression {_quote(value)} is over {MAX_TEXT_CHARS} characters once "
                          "normalised", member=member, path=path)
    symbols: set[str] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node.op == "sym":
            symbols.add(node.value)  # type: ignore[arg-type]
        stack.extend(node.args)
    constant = cast(int, root.value) if root.op == "int" else None
    return Expr(source, frozenset(symbols), value=constant, run=_compile(root), root=root, member=member,
                path=path)


def evaluate_all(exprs: Sequence[Expr], env: Env) -> tuple[int, ...]:
    """Evaluate several expressions (a shape, a grid) under one environment."""
    return tuple([e.evaluate(env) for e in exprs])


_INT_ONLY = frozenset({int})
#: Opcodes of the compiled tape by operator (``_exprtape.c``).
_OPCODE = {"+": "ADD", "-": "SUB", "*": "MUL", "//": "FLOORDIV", "%": "MOD", "ceil_div": "CEIL_DIV", "min": "MIN",
           "max": "MAX"}
#: Below this many steps the Python tape is as fast as the compiled one's array handling.
_NATIVE_MIN_STEPS = 24
_COMMUTATIVE = frozenset({"+", "*", "min", "max"})


class ExprBatch:
    """Many expressions evaluated together, each shared subexpression once.

    Planning a new dispatch key needs every size of a graph, and those sizes overlap heavily
    (``a * b`` inside ``a * b * 4`` and ``a * b // 2``). Instead of walking each tree and checking
    each intermediate, the trees are merged into one tape of ``(function, slot, slot)`` steps over a
    value list seeded with the symbol values and the constants; structurally equal subexpressions
    (commutative operands in either order) share one slot. Python integers do not wrap, so checking
    int64 range of every value once after the tape has run is exact. The tape only handles the
    common, clean case: on anything unusual -- a value that is not a plain int, an intermediate out
    of range, a division by zero, a symbol missing from ``symbols`` -- evaluation replays
    ``Expr.evaluate`` per expression, so results and errors are exactly those of that loop.

    Values out of int64 range are not caught on the tape before they are used, but they stay
    bounded: every slot holds the value of a subtree of one expression, trees are limited to
    ``MAX_NODES`` nodes and constants to int64, so with int64 inputs no value grows past about
    32,000 bits before the final check. A hostile bundle can make a failing key cost a few
    milliseconds more than the loop, which stops at the first overflow; a clean key never pays.
    """

    __slots__ = ("symbols", "_exprs", "_nsym", "_seed", "_tape", "_out", "_pick", "_complete", "_codes", "_evaluate",
                 "_start", "_out_index")

    symbols: tuple[str, ...]

    def __init__(self, exprs: Sequence[Expr], symbols: Sequence[str]):
        self.symbols = tuple(symbols)
        self._exprs = tuple(exprs)
        self._nsym = len(self.symbols)
        # Later duplicates win, as in dict(zip(symbols, values)), which is what the fallback uses.
        sym_slot = {name: i for i, name in enumerate(self.symbols)}
        # Constants sit between the symbols and the computed values, so they are collected first.
        constants: dict[int, int] = {}
        self._complete = True
        stack = [e._root for e in self._exprs]
        while stack:
            node = stack.pop()
            if node.op == "int":
                constants.setdefault(node.value, len(constants))  # type: ignore[arg-type]
            elif node.op == "neg":
                constants.setdefault(0, len(constants))  # -x runs as 0 - x: same value, one loop shape
            elif node.op == "sym" and node.value not in sym_slot:
                self._complete = False  # evaluating it always raises; the fallback names the symbol
            stack.extend(node.args)
        self._seed = list(constants)
        first_step = self._nsym + len(constants)
        const_slot = {c: self._nsym + k for c, k in constants.items()}
        tape: list[tuple[Callable[[int, int], int], int, int]] = []
        step_slot: dict[tuple[str, int, int], int] = {}

        def slot(node: _Node) -> int:
            op = node.op
            if op == "int":
                return const_slot[node.value]  # type: ignore[index]
            if op == "sym":
                return sym_slot[node.value]  # type: ignore[index]
            if op == "neg":
                key = ("-", const_slot[0], slot(node.args[0]))
            else:
                a, b = slot(node.args[0]), slot(node.args[1])
                key = (op, b, a) if op in _COMMUTATIVE and b < a else (op, a, b)
            k = step_slot.get(key)
            if k is None:
                k = step_slot[key] = first_step + len(tape)
                tape.append((_BINARY[key[0]], key[1], key[2]))
                names.append(key[0])
            return k

        names: list[str] = []
        self._out = [slot(e._root) for e in self._exprs] if self._complete else []
        self._tape = tuple(tape)
        # itemgetter gathers the results in one call, but returns a bare value for a single index.
        self._pick = operator.itemgetter(*self._out) if len(self._out) > 1 else None
        # The same tape as int64 arrays for the compiled evaluator: opcodes, operand slots, and the
        # value array's first slots (symbols as zeros, then the constants) to start each run from.
        self._codes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        tape_module = HELPERS.expr_tape
        self._evaluate = tape_module.evaluate if tape_module is not None else None
        if tape_module is not None and self._complete:
            self._codes = (np.array([getattr(tape_module, _OPCODE[name]) for name in names], np.int64),
                           np.array([a for _, a, _ in tape], np.int64), np.array([b for _, _, b in tape], np.int64))
            self._start = np.array([0] * self._nsym + self._seed, np.int64)
            self._out_index = np.array(self._out, np.int64)

    @property
    def compiled(self) -> bool:
        """Whether evaluations run the compiled tape (``engine.compiled``; where it returns no answer,
        as past int64, the Python tape decides)."""
        return self._codes is not None

    @property
    def steps(self) -> int:
        """Operations the tape runs per evaluation: one per distinct non-leaf subexpression."""
        return len(self._tape)

    def evaluate(self, values: Sequence[int]) -> list[int]:
        """Values of all exprs, in order, with symbols[i] = values[i]."""
        if type(values) is not list and type(values) is not tuple:
            values = list(values)
        if self._codes is not None and len(self._tape) >= _NATIVE_MIN_STEPS:
            native = self._run_native(values)
            if native is not None:
                return native.tolist()
        if {*map(type, values)} <= _INT_ONLY:
            result = self._run(values)
        else:
            result = self._run_converted(values)
        return self._fallback(values) if result is None else result

    def evaluate_array(self, values: Sequence[int]) -> np.ndarray:
        """``evaluate`` as an int64 array (a new one per call): what the memory planner computes with."""
        if type(values) is not list and type(values) is not tuple:
            values = list(values)
        if self._codes is not None:
            result = self._run_native(values)
            if result is not None:
                return result
        return np.array(self.evaluate(values), np.int64)

    def _run_native(self, values: Sequence[int]) -> np.ndarray | None:
        """The compiled tape on plain ints; None where the Python paths must decide."""
        if len(values) != self._nsym:
            return None  # the Python paths handle wrong counts exactly
        out = np.empty(len(self._out_index), np.int64)
        ops, left, right = self._codes  # type: ignore[misc]
        run = self._evaluate
        if run is None or not run(ops, left, right, self._start, values, self._out_index, out):
            return None  # not plain ints in int64, an intermediate outside int64 or a division by zero:
            #              the Python paths decide (numpy integers) and raise the precise error
        return out

    def _run(self, values: Sequence[int]) -> list[int] | None:
        """The tape on plain ints; None where the per-expression path must decide."""
        if len(values) != self._nsym or not self._complete:
            return None
        v = [*values, *self._seed]
        push = v.append
        try:
            for fn, a, b in self._tape:
                push(fn(v[a], v[b]))
        except ZeroDivisionError:
            return None
        if v and (max(v) > _MAX or min(v) < _MIN):  # inputs and every intermediate at once
            return None
        return list(self._pick(v)) if self._pick is not None else [v[k] for k in self._out]

    def _run_converted(self, values: Sequence[object]) -> list[int] | None:
        """numpy integers and other ``__index__`` types are read as ``Expr.evaluate`` reads them."""
        ints: list[int] = []
        for x in values:
            if type(x) is not int:
                if isinstance(x, bool) or not hasattr(x, "__index__"):
                    return None
                try:
                    x = operator.index(x)
                except Exception:  # whatever an odd __index__ raises, the loop raises it too
                    return None
            ints.append(x)  # type: ignore[arg-type]
        return self._run(ints)

    def _fallback(self, values: Sequence[object]) -> list[int]:
        env = dict(zip(self.symbols, values))
        return [e.evaluate(env) for e in self._exprs]  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[type[ExprBatch], tuple[tuple[Expr, ...], tuple[str, ...]]]:
        return ExprBatch, (self._exprs, self.symbols)  # the tape holds functions; rebuild it

    def __repr__(self) -> str:
        return f"ExprBatch({len(self._exprs)} exprs over {self._nsym} symbols, {self.steps} steps)"
