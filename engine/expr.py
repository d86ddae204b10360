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
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

import attrs

from engine.errors import BundleError

__all__ = ["Env", "Expr", "ExprError", "parse_expr", "evaluate_all"]

Env = Mapping[str, int]

MAX_TEXT_CHARS = 4096
MAX_DEPTH = 64
MAX_NODES = 1024
_MIN, _MAX = -(2**63), 2**63 - 1

_FUNCTIONS: dict[str, Callable[[int, int], int]] = {
    "ceil_div": lambda a, b: -((-a) // b),
    "min": min,
    "max": max,
}
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
        self.height = 1 + max((a.height for a in args), default=0)


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
            raise _Fail(f"symbol {name!r} is bound to {type(v).__name__} {v!r}, not an integer")
        v = operator.index(v)  # numpy integers and friends
        if not _MIN <= v <= _MAX:
            raise _Fail(f"symbol {name!r} = {v} does not fit in int64")
        return v
    return read


def _compile(node: _Node) -> Callable[[Env], int]:
    """Turn a folded tree into nested closures; only leaves read the environment.

    This is the single place where arithmetic semantics live: constant folding at parse time runs
    the same closures on an empty environment.
    """
    if node.op == "int":
        value = node.value
        return lambda env: value  # type: ignore[return-value]
    if node.op == "sym":
        return _read(node.value)  # type: ignore[arg-type]

    def overflow() -> NoReturn:
        raise _Fail(f"int64 overflow in {_format(node)!r}")

    if node.op == "neg":
        fx = _compile(node.args[0])

        def neg(env: Env) -> int:
            r = -fx(env)
            return r if r <= _MAX else overflow()
        return neg
    fa, fb = _compile(node.args[0]), _compile(node.args[1])
    fn, b = _BINARY[node.op], node.args[1]
    if b.op == "int" and b.value != 0:  # `x * 4`, `ceil_div(x, 128)`: skip a call, cannot divide by 0
        c = b.value

        def binary_const(env: Env) -> int:
            r = fn(fa(env), c)
            return r if _MIN <= r <= _MAX else overflow()
        return binary_const

    def binary(env: Env) -> int:
        try:
            r = fn(fa(env), fb(env))
        except ZeroDivisionError:
            raise _Fail(f"division by zero in {_format(node)!r}") from None
        return r if _MIN <= r <= _MAX else overflow()
    return binary


def _quote(text: str) -> str:
    return repr(text if len(text) <= 120 else text[:100] + "...")


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
            value = -int(digits) if len(digits) <= 20 else _MIN - 1
            if value < _MIN:
                self.fail(f"integer literal -{digits} does not fit in int64", at)
            node = self.make("int", (), pos, value)
        else:
            node = self.make("neg", (self.unary(),), pos)
        self.depth -= 1
        return node

    def primary(self) -> _Node:
        kind, text, pos = self.tokens[self.i]
        if kind == "int":
            self.i += 1
            if len(text) > 20 or int(text) > _MAX:
                self.fail(f"integer literal {text} does not fit in int64", pos)
            return self.make("int", (), pos, int(text))
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
    _member: str | None = attrs.field(default=None, eq=False, alias="member")
    _path: str | None = attrs.field(default=None, eq=False, alias="path")

    def evaluate(self, env: Env) -> int:
        """The value under ``env``; raises ExprError naming this expression and the cause."""
        if self._value is not None:
            return self._value
        try:
            return self._run(env)
        except _Fail as e:
            bound = [f"{s}={env[s]!r}" for s in sorted(self.symbols) if s in env][:8]
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
                          f"{value!r}", member=member, path=path)
    if isinstance(value, int):
        if not _MIN <= value <= _MAX:
            raise BundleError(f"integer {value} does not fit in int64", member=member, path=path)
        return Expr(str(value), frozenset(), value=value, run=lambda env: value, member=member, path=path)
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
    constant = root.value if root.op == "int" else None
    return Expr(source, frozenset(symbols), value=constant, run=_compile(root), member=member, path=path)


def evaluate_all(exprs: Sequence[Expr], env: Env) -> tuple[int, ...]:
    """Evaluate several expressions (a shape, a grid) under one environment."""
    return tuple([e.evaluate(env) for e in exprs])
