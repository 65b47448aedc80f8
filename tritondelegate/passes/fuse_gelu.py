"""A tanh-approximated GELU written out becomes one ``aten.gelu(x, approximate="tanh")``.

GPT-2's ``NewGELUActivation`` (and GPT-J, CodeGen, ... ) computes, after decomposition::

    half = mul(x, 0.5)                     # or, at the end, mul(mul(x, g), 0.5)
    cube = pow(x, 3)                       # or mul(mul(x, x), x)
    c    = mul(cube, 0.044715)
    d    = add(x, c)
    e    = mul(d, sqrt(2 / pi))
    t    = tanh(e)
    g    = add(t, 1.0)
    y    = mul(half, g)

Eight launches' worth of pointwise ops that read ``x`` three times: the chain fusion cannot make one
launch of them (a chain is linear), nor run them in the epilogue of the matmul that produced ``x``
(its result has three readers). ``aten.gelu`` is one unary op, so it fuses into that epilogue.
``aten.gelu`` computes in fp32 (the chain rounds each step to x's dtype), so the result is as exact
or more. Operands of the commutative ops may come in either order; constants must match to 1e-6.
Not rewritten when an intermediate has a reader outside the pattern.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from .rewrite import is_call, take_provenance

aten = torch.ops.aten

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
def _operands(node) -> tuple:
    """A binary op's two operands (``other`` of ``add`` taken with alpha 1 only)."""
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return ()
    return tuple(node.args)


def _split(node, constant: float):
    """For ``op(a, k)`` or ``op(k, a)`` with the number ``k`` close to ``constant``: ``a``, else None."""
    ops = _operands(node)
    if len(ops) != 2:
        return None
    for a, k in (ops, ops[::-1]):
        if isinstance(k, (int, float)) and not isinstance(k, bool) and math.isclose(k, constant, rel_tol=1e-6):
            return a
    return None


def _is_cube_of(node, x) -> bool:
    if is_call(node, aten.pow.Tensor_Scalar) and node.args[0] is x and node.args[1] in (3, 3.0):
        return True
    if is_call(node, aten.mul.Tensor):  # x * x * x
        a, b = _operands(node) or (None, None)
        square = a if b is x else b if a is x else None
        return is_call(square, aten.mul.Tensor) and _operands(square) == (x, x)
    return False


def _inner(t) -> torch.fx.Node | None:
    """``x`` when ``t = tanh(sqrt(2/pi) * (x + 0.044715 * x^3))``."""
    e = t.args[0]
    d = _split(e, _SQRT_2_OVER_PI) if is_call(e, aten.mul.Tensor) else None
    if not is_call(d, aten.add.Tensor):
        return None
    a, b = _operands(d) or (None, None)
    for x, c in ((a, b), (b, a)):
        cube = _split(c, 0.044715) if is_call(c, aten.mul.Tensor) else None
        if isinstance(x, torch.fx.Node) and _is_cube_of(cube, x):
            return x
    return None


def _outer(g, x) -> tuple[torch.fx.Node, list] | None:
    """The pattern's end ``y`` and its other intermediates, when ``g = 1 + t`` is scaled by ``0.5 * x``."""
    if len(g.users) != 1:
        return None
    (y,) = g.users
    if not is_call(y, aten.mul.Tensor):
        return None
    other = next((a for a in _operands(y) if a is not g), None)
    if is_call(other, aten.mul.Tensor) and _split(other, 0.5) is x:  # (0.5 * x) * g
        return y, [other]
    if other is x and len(y.users) == 1:  # (x * g) * 0.5
        (end,) = y.users
        if is_call(end, aten.mul.Tensor) and _split(end, 0.5) is y:
            return end, [y]
    return None


def _match(t: torch.fx.Node):
    """(x, y, the nodes between them) for a GELU whose tanh is ``t``; None when it is not one."""
    x = _inner(t)
    if x is None or len(t.users) != 1:
        return None
    (g,) = t.users
    if not (is_call(g, aten.add.Tensor) and _split(g, 1.0) is t):
        return None
    outer = _outer(g, x)
    if outer is None:
        return None
    y, extra = outer
    e = t.args[0]
    d = next(a for a in e.args if isinstance(a, torch.fx.Node))
    c = next(a for a in d.args if a is not x)
    cube = next(a for a in c.args if isinstance(a, torch.fx.Node))
    inner = [cube, c, d, e, t, g] + extra + ([cube.args[0]] if cube.args[0] is not x else [])
    allowed = set(inner) | {y}
    if any(u not in allowed for n in inner for u in n.users):
        return None  # an intermediate read outside the pattern: keep it computed
    return x, y, inner


def fuse_gelu(ep: torch.export.ExportedProgram, *_args) -> list[str]:
    """Rewrite every written-out tanh GELU of ``ep`` in place; returns a description of each."""
    graph = ep.graph_module.graph
    done = []
    for t in [n for n in graph.nodes if is_call(n, aten.tanh.default)]:
        found = _match(t)
        if found is None:
            continue
        x, y, inner = found
        with graph.inserting_before(y):
            gelu = graph.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
        gelu.meta["val"] = y.meta.get("val")
        take_provenance(gelu, y.meta)
        y.replace_all_uses_with(gelu)
        done.append(f"gelu(tanh): {gelu.name} ({', '.join(n.name for n in inner + [y])})")
    if done:
        graph.eliminate_dead_code()
        graph.lint()
    return done
