"""Sizes that depend on a method's symbols (bounded dynamic dimensions), as the runtime reads them.

A program exported with ``Dim("seq", max=N)`` has one *symbol* per dynamic dimension. Every integer
of the program that depends on symbols (a value's shape, a view's shape, strides and offset, a
launch's grid and size arguments, a host op's size argument) is an :class:`Expr`: a small integer
expression over the symbols, serialized as text (``"64*s0"``, ``"(s0 + 1023)//1024"``) with its
value at the upper bound of every symbol. Memory is planned for that bound.

The runtime evaluates expressions once per distinct set of symbol values (see ``runtime/sized.py``),
with no sympy and nothing of the lowering side: the text is parsed once into a Python expression
restricted to integers, symbol names, ``+ - * // %``, unary minus, ``max`` and ``min``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .errors import ProgramError

_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
_FUNCTIONS = {"max": max, "min": min}


def _check(node: ast.AST, text: str, symbols) -> None:
    """Refuse anything but integer arithmetic over known symbols (the text comes from a file)."""
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Expression, ast.Load, ast.BinOp, ast.UnaryOp, ast.USub, *_BINOPS)):
            continue
        if isinstance(sub, ast.Constant) and type(sub.value) is int:
            continue
        if isinstance(sub, ast.Name) and (sub.id in _FUNCTIONS or symbols is None or sub.id in symbols):
            continue
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in _FUNCTIONS and not sub.keywords:
            continue
        raise ProgramError(f"size expression {text!r} is not integer arithmetic over the method's symbols "
                           f"(found {type(sub).__name__})")


@dataclass(frozen=True)
class Expr:
    """An integer that depends on symbols: its text and its value at every symbol's upper bound."""

    text: str
    bound: int
    _code: object = field(default=None, init=False, repr=False, compare=False, hash=False)

    def compiled(self, symbols=None):
        """The parsed expression; ``symbols``: the names it may use (None: not checked)."""
        if self._code is None:
            try:
                tree = ast.parse(self.text, mode="eval")
            except SyntaxError as exc:
                raise ProgramError(f"size expression {self.text!r} does not parse: {exc.msg}") from None
            _check(tree, self.text, symbols)
            object.__setattr__(self, "_code", compile(tree, "<size>", "eval"))
        return self._code

    def evaluate(self, env: dict[str, int]) -> int:
        try:
            return int(eval(self.compiled(), {"__builtins__": {}, **_FUNCTIONS}, env))  # noqa: S307 (checked above)
        except NameError as exc:
            raise ProgramError(f"size expression {self.text!r} names an unknown symbol: {exc}") from None
        except ZeroDivisionError:
            raise ProgramError(f"size expression {self.text!r} divides by zero at {env}") from None

    def names(self) -> set[str]:
        return {n.id for n in ast.walk(ast.parse(self.text, mode="eval"))
                if isinstance(n, ast.Name) and n.id not in _FUNCTIONS}

    def __str__(self) -> str:
        return self.text


def _each(x, fn):
    """``x`` with ``fn`` applied to every :class:`Expr` in it (also inside tuples and lists)."""
    if isinstance(x, Expr):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_each(v, fn) for v in x)
    return x


def resolve(x, env: dict[str, int]):
    """``x`` with every :class:`Expr` in it evaluated at ``env``."""
    return _each(x, lambda e: e.evaluate(env))


def bound(x):
    """``x`` at every symbol's upper bound (ints pass through; tuples and lists element-wise)."""
    return _each(x, lambda e: e.bound)


def any_symbolic(x) -> bool:
    if isinstance(x, Expr):
        return True
    if isinstance(x, (tuple, list)):
        return any(any_symbolic(v) for v in x)
    return False


def from_text(text: str, bound_value: int, symbols=None):
    """A size as the format stores it (expression text and its bound): an int for a literal, else a
    checked :class:`Expr`."""
    stripped = text.strip()
    if stripped.lstrip("-").isdigit():
        return int(stripped)
    expr = Expr(stripped, int(bound_value))
    expr.compiled(symbols)
    return expr

