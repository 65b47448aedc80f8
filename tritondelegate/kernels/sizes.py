"""Sizes at lower time: Python ints, or sympy expressions over a method's bounded symbols.

A program exported with ``torch.export.Dim(..., max=N)`` carries FakeTensors whose dynamic sizes are
``torch.SymInt``s; their sympy expressions (over symbols such as ``s0``) flow through the launch
builder as sizes, strides, offsets, grids and size arguments. Arithmetic stays symbolic; a branch
that cannot be decided for every size in the range raises (sympy refuses the truth value of an
undecided relation), so a lowering never silently specializes to the example's size.

Decisions that only tune speed (block sizes, one pass or two) are taken with :func:`upper`: the size
at every symbol's upper bound, valid for the whole range because kernels mask their tails. Memory is
planned with :func:`upper` too. :func:`to_plan` turns an expression into the runtime's
``symbolic.Expr`` (text plus its value at the bound).
"""

from __future__ import annotations

import contextlib
import contextvars
import fractions
import functools

import sympy
import torch
import torch.fx

from ..symbolic import Expr

_RANGES: contextvars.ContextVar[dict] = contextvars.ContextVar("td_symbol_ranges", default={})
_FAKE_MODE: contextvars.ContextVar = contextvars.ContextVar("td_fake_mode", default=None)


class SymbolicShapeError(NotImplementedError):
    """A lowering needs a size that depends on a symbol to be known (names what)."""


@contextlib.contextmanager
def symbol_ranges(ranges: dict, fake_mode=None):
    """Make ``{sympy.Symbol: (min, max)}`` the ranges :func:`upper` uses while lowering a method, and
    ``fake_mode`` (the exported program's, whose shape environment knows the symbols) the one
    :func:`tensor_like` runs symbolic view ops in."""
    tokens = _RANGES.set(dict(ranges)), _FAKE_MODE.set(fake_mode)
    try:
        yield
    finally:
        _RANGES.reset(tokens[0])
        _FAKE_MODE.reset(tokens[1])


def size(x):
    """An int when ``x`` is a constant size, else its sympy expression (``x``: int, SymInt, sympy)."""
    if isinstance(x, torch.SymInt):
        x = x.node.expr
    if isinstance(x, sympy.Basic):
        if x.is_Integer:
            return int(x)
        if x.is_number:
            raise SymbolicShapeError(f"size {x} is not an integer")
        fixed = _constant_over_ranges(x, tuple(_RANGES.get().items()))
        return x if fixed is None else fixed
    if isinstance(x, bool):
        raise TypeError(f"expected a size, got {x!r}")
    return int(x)


@functools.lru_cache(maxsize=4096)
def _constant_over_ranges(x: sympy.Basic, ranges: tuple) -> int | None:
    """The value of ``x`` when it takes one value over the symbols' ranges (``1 - Max(0, 1 - s)`` for
    s >= 1: a slice's size that is 1 wherever the program runs), else None. A size-1 dim must read as
    1, or broadcasting would walk it with its stride."""
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    known = dict(ranges)
    if not x.free_symbols or not all(s in known for s in x.free_symbols):
        return None
    try:
        bound = bound_sympy(x, {s: ValueRanges(*known[s]) for s in x.free_symbols})
    except Exception:  # an expression the range analysis does not take: leave it symbolic
        return None
    if bound.lower == bound.upper and getattr(bound.lower, "is_Integer", False):
        return int(bound.lower)
    return None


def is_size_node(arg) -> bool:
    """Whether ``arg`` is an fx node whose value is a SymInt: a size the program computes from its
    dynamic dimensions (``sym_size``, arithmetic on it; in a delegate's subgraph, a placeholder)."""
    return isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), torch.SymInt)


def shape(values) -> tuple:
    return tuple(size(v) for v in values)


def is_static(x) -> bool:
    if isinstance(x, (tuple, list)):
        return all(is_static(v) for v in x)
    return not isinstance(x, (sympy.Basic, torch.SymInt))


def larger(*sizes):
    """The largest of ``sizes``, any of them symbolic (then a ``Max`` expression)."""
    return max(sizes) if is_static(sizes) else sympy.Max(*sizes)


def upper(x) -> int:
    """``x`` at every symbol's upper bound (ints pass through; tuples and lists element-wise)."""
    if isinstance(x, (tuple, list)):
        return type(x)(upper(v) for v in x)
    x = size(x)
    if isinstance(x, int):
        return x
    ranges = _RANGES.get()
    missing = [s for s in x.free_symbols if s not in ranges]
    if missing:
        raise SymbolicShapeError(f"size {x} uses symbols {missing} without a known range")
    return int(x.subs({s: ranges[s][1] for s in x.free_symbols}))


def _text(e) -> str:
    """Python integer-expression text for a sympy size expression (see ``symbolic.Expr``). Every
    compound part is parenthesized: ``2*floor(x/32)`` must not read as ``(2*x)//32``."""
    from torch.utils._sympy.functions import CeilDiv, FloorDiv, Max, Min, Mod, PythonMod, TruncToInt

    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return e.name
    if e.is_Add:
        return "(" + " + ".join(_text(a) for a in e.args) + ")"
    if e.is_Mul:
        num, den = sympy.fraction(e)
        if den != 1:
            raise SymbolicShapeError(f"size {e} is not an integer expression")
        return "*".join(_text(a) for a in e.args)
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        return "*".join([_text(e.base)] * int(e.exp))
    if isinstance(e, sympy.floor):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        return f"(({_text(sympy.expand(num))})//({_text(den)}))"
    if isinstance(e, sympy.ceiling):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        return f"(-((-{_text(sympy.expand(num))})//({_text(den)})))"
    if isinstance(e, FloorDiv):
        return f"(({_text(e.args[0])})//({_text(e.args[1])}))"
    if isinstance(e, CeilDiv):
        return f"(-((-{_text(e.args[0])})//({_text(e.args[1])})))"
    if isinstance(e, (sympy.Mod, Mod, PythonMod)):
        return f"(({_text(e.args[0])})%({_text(e.args[1])}))"
    if isinstance(e, (sympy.Max, sympy.Min, Max, Min)):  # sympy's, and torch's own (export's symbolic sizes)
        name = "max" if isinstance(e, (sympy.Max, Max)) else "min"
        return f"{name}({', '.join(_text(a) for a in e.args)})"
    if isinstance(e, TruncToInt):
        return _scaled(e)
    raise SymbolicShapeError(f"size {e} ({type(e).__name__}) has no runtime form")


def _scaled(e) -> str:
    """``TruncToInt(c * ToFloat(n))``: the size ``F.interpolate`` computes from a scale factor ``c`` at a
    dynamic size ``n`` (``int(n * c)`` in double), as ``(p*n)//q`` where c = p / q exactly (q a power of
    two). The two agree wherever the double product is exact: when p and n's largest value fit in 53 bits
    together (1.5 or 0.75 at any size; not 1/3 or 1.1, whose products round)."""
    from torch.utils._sympy.functions import ToFloat

    factors = e.args[0].args if e.args[0].is_Mul else ()
    scale = [f for f in factors if f.is_Float]
    sized = [f.args[0] for f in factors if isinstance(f, ToFloat)]
    if len(factors) != 2 or len(scale) != 1 or len(sized) != 1:
        raise SymbolicShapeError(f"size {e} ({type(e).__name__}) has no runtime form")
    c = fractions.Fraction(float(scale[0]))
    if c <= 0 or c.numerator.bit_length() + upper(sized[0]).bit_length() > 53:
        raise SymbolicShapeError(f"size {e}: the scale {float(scale[0])!r} times the size rounds in double, "
                                 "so it has no exact integer form")
    return f"(({c.numerator}*{_text(sized[0])})//({c.denominator}))"


def to_plan(x):
    """A lowering-time size as the plan stores it: an int, or a ``symbolic.Expr``."""
    if isinstance(x, (tuple, list)):
        return type(x)(to_plan(v) for v in x)
    x = size(x)
    if isinstance(x, int):
        return x
    expr = Expr(_text(x), upper(x))
    # The text must compute what sympy computes: check it at both ends of every range.
    ranges = _RANGES.get()
    for end in (0, 1):
        env = {s: ranges[s][end] for s in x.free_symbols}
        if expr.evaluate({s.name: v for s, v in env.items()}) != int(x.subs(env)):
            raise SymbolicShapeError(f"size {x} printed as {expr.text!r} evaluates differently at {env}")
    return expr


def next_power_of_2(x) -> int:
    """The smallest power of two >= ``x`` at its upper bound: a block size that covers the whole range."""
    n = upper(x)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@contextlib.contextmanager
def tensor_like(shape, strides, offset, dtype, symbolic_args: bool = False):
    """A tensor with no data and this layout, in which ATen view ops compute a view's shape, strides
    and offset as PyTorch does: a meta tensor for static sizes, else a fake tensor of the exported
    program's shape environment (its sizes are SymInts; read results back with :func:`size`).
    ``symbolic_args``: the op will take SymInt arguments (a fake tensor even for a static layout).

    A view op whose result the symbols' ranges do not decide would add a guard or a replacement (a
    silent specialization to the example's size): that raises :class:`SymbolicShapeError` instead."""
    if is_static((shape, strides, offset)) and not symbolic_args:
        extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides) if n > 0)
        base = torch.empty(max(extent, 1), dtype=dtype, device="meta")
        yield base.as_strided(shape, strides, offset)
        return
    mode = _FAKE_MODE.get()
    if mode is None or mode.shape_env is None:
        raise SymbolicShapeError("a symbolic view outside a method's lowering")
    env = mode.shape_env
    sym = lambda e: e if isinstance(e, int) else env.create_symintnode(e, hint=None)  # noqa: E731
    guards, replacements = len(env.guards), dict(env.replacements)
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides) if not is_static(n) or n > 0)
    with mode:
        base = torch.empty_strided((sym(extent),), (1,), dtype=dtype)
        yield base.as_strided([sym(n) for n in shape], [sym(s) for s in strides], sym(offset))
    if len(env.guards) > guards or env.replacements != replacements:
        added = [str(g.expr) for g in env.guards[guards:]]
        added += [f"{k} = {v}" for k, v in env.replacements.items() if replacements.get(k) != v]
        del env.guards[guards:]  # leave the exported program's shape environment as it was
        env.replacements.clear()
        env.replacements.update(replacements)
        raise SymbolicShapeError(f"the result depends on a size its range does not decide ({added[0]})")


def fake_sizes(values) -> list:
    """Sizes to pass to an ATen op inside :func:`tensor_like`: SymInts of the shape environment for
    symbolic ones."""
    if is_static(tuple(values)):
        return [int(v) for v in values]
    env = _FAKE_MODE.get().shape_env
    return [v if isinstance(v, int) else env.create_symintnode(v, hint=None) for v in map(size, values)]
