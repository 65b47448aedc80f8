"""Activations written out as x times a function of x (or over x twice) become one pointwise op.

A chain of pointwise ops is linear (one running value, each step's other operand a tensor in memory
or a number), so ``x * g(x)`` needs ``x`` twice: fused into the epilogue of the linear that produced
x it cannot be (x is never stored), and on its own it is two launches. Each of these becomes one op,
which runs in that epilogue (after decomposition; operands of ``mul`` and ``add`` in either order):

    mul(x, sigmoid(x))                                   -> aten.silu(x)             swish
    mul(x, sigmoid(mul(x, c)))                           -> sigmoid_gate(x, c)       CLIP's quick GELU
    mul(mul(x, 0.5), add(erf(mul(x, 1/sqrt 2)), 1))      -> aten.gelu(x)             GELU written out
        (or erf(div(x, sqrt 2)), or mul(mul(x, add(...)), 0.5))
    div(mul(x, hardtanh(add(x, 3), 0, 6)), 6)            -> aten.hardswish(x)        (relu6 is hardtanh)
    div(x, add(abs(x), 1))                               -> softsign(x)              F.softsign
    sub(x, tanh(x))                                      -> tanhshrink(x)            F.tanhshrink
    where(le(abs(x), l), 0, x)                           -> aten.hardshrink(x, l)
    where(gt(abs(x), l), sub(x, mul(sign(x), l)), mul(x, 0))  -> aten.softshrink(x, l)

The last two are torch's own decompositions of hardshrink and softshrink: an Autograd kernel of torch's
decomposes them while the program is decomposed, whatever table it is given, so they arrive written out
(three and five launches) and become the ops again here.

Not rewritten when an intermediate has a reader outside the pattern, but for the ``abs(x)`` or
``tanh(x)`` a pattern starts from (and hardshrink's 0): cheap, and shared between patterns once
``dedupe`` merged them (softsign, hardshrink and softshrink of one x read one ``abs(x)``), it then
stays for its other readers. The tanh GELU written out is ``fuse_gelu``'s.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from .. import ops as td_ops
from .fuse_gelu import _operands, _split
from .rewrite import is_call, take_provenance

aten = torch.ops.aten


def _only_reader(node, reader) -> bool:
    return isinstance(node, torch.fx.Node) and set(node.users) == {reader}


def _sigmoid_gate(y):
    """(replacement target, args, the intermediates) for ``y = x * sigmoid(c * x)``."""
    for x, s in (_operands(y), _operands(y)[::-1]) if len(_operands(y)) == 2 else ():
        if not (is_call(s, aten.sigmoid.default) and _only_reader(s, y) and isinstance(x, torch.fx.Node)):
            continue
        inner = s.args[0]
        if inner is x:
            return aten.silu.default, (x,), [s]
        if is_call(inner, aten.mul.Tensor) and _only_reader(inner, s):
            a, b = _operands(inner) or (None, None)
            scale = b if a is x else a if b is x else None
            if isinstance(scale, (int, float)) and not isinstance(scale, bool):
                return td_ops.sigmoid_gate, (x, float(scale)), [s, inner]
    return None


def _erf_of(node, x) -> bool:
    """Whether ``node = erf(x / sqrt 2)`` (a mul by 1 / sqrt 2 or a div by sqrt 2)."""
    if not is_call(node, aten.erf.default):
        return False
    arg = node.args[0]
    if is_call(arg, aten.mul.Tensor):
        return _split(arg, 1 / math.sqrt(2)) is x
    return is_call(arg, aten.div.Tensor) and arg.args[0] is x and isinstance(arg.args[1], float) \
        and math.isclose(arg.args[1], math.sqrt(2), rel_tol=1e-6)


def _gelu(y):
    """``aten.gelu`` for ``y = (0.5 * x) * (1 + erf(x / sqrt 2))`` or ``(x * (1 + erf(...))) * 0.5``."""
    ops = _operands(y)
    if len(ops) != 2:
        return None
    for half, g in (ops, ops[::-1]):
        if not (is_call(g, aten.add.Tensor) and _only_reader(g, y)):
            continue
        e = _split(g, 1.0)
        x = _split(half, 0.5) if is_call(half, aten.mul.Tensor) and _only_reader(half, y) else None
        if x is not None and _only_reader(e, g) and _erf_of(e, x) and _only_reader(e.args[0], e):
            return aten.gelu.default, (x,), [half, g, e, e.args[0]]
    return None


def _hardswish(y):
    """``aten.hardswish`` for ``y = (x * hardtanh(x + 3, 0, 6)) / 6``."""
    if not (is_call(y, aten.div.Tensor) and y.args[1] in (6, 6.0) and is_call(y.args[0], aten.mul.Tensor)):
        return None
    product = y.args[0]
    ops = _operands(product)
    for x, h in (ops, ops[::-1]) if len(ops) == 2 and _only_reader(product, y) else ():
        if is_call(h, aten.hardtanh.default) and _only_reader(h, product) and tuple(h.args[1:]) in ((0, 6), (0.0, 6.0)):
            shifted = h.args[0]
            if is_call(shifted, aten.add.Tensor) and _only_reader(shifted, h) and _split(shifted, 3.0) is x:
                return aten.hardswish.default, (x,), [product, h, shifted]
    return None


def _floating_like(y, x) -> bool:
    """Whether ``y`` and ``x`` are floating tensors of one dtype (``abs`` and ``tanh`` of an integer x
    would not compute what the op does)."""
    yv, xv = (n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (y, x))
    return isinstance(yv, torch.Tensor) and isinstance(xv, torch.Tensor) and yv.dtype.is_floating_point \
        and yv.dtype == xv.dtype


def _softsign(y):
    """``tritondelegate::softsign`` for ``y = x / (|x| + 1)``."""
    if len(y.args) != 2 or y.kwargs:
        return None
    x, d = y.args
    if is_call(d, aten.add.Tensor) and _only_reader(d, y) and _floating_like(y, x):
        a = _split(d, 1.0)  # abs(x) may have other readers (as in _shrink_condition)
        if is_call(a, aten.abs.default) and a.args[0] is x:
            return td_ops.softsign, (x,), [d, a]
    return None


def _tanhshrink(y):
    """``tritondelegate::tanhshrink`` for ``y = x - tanh(x)``."""
    ops = _operands(y)  # tanh(x) may have other readers: it then stays
    if len(ops) == 2 and is_call(ops[1], aten.tanh.default) and ops[1].args[0] is ops[0] \
            and _floating_like(y, ops[0]):
        return td_ops.tanhshrink, (ops[0],), [ops[1]]
    return None


def _shrink_condition(cond, y, compare):
    """(x, l) when ``cond = compare(abs(x), l)``, a number l, read by ``y`` alone; else None. ``abs(x)``
    may have other readers (dedupe merges hardshrink's and softshrink's of one x): it then stays."""
    if not (is_call(cond, compare) and _only_reader(cond, y) and len(cond.args) == 2):
        return None
    a, lambd = cond.args
    if is_call(a, aten.abs.default) and isinstance(lambd, (int, float)) and not isinstance(lambd, bool):
        return a.args[0], lambd
    return None


def _hardshrink(y):
    """``aten.hardshrink`` for ``y = where(abs(x) <= l, 0, x)``."""
    cond, zero, x = y.args
    found = _shrink_condition(cond, y, aten.le.Scalar)
    if found is None or found[0] is not x or not _floating_like(y, x):
        return None
    if is_call(zero, aten.scalar_tensor.default) and zero.args[0] == 0:  # a constant others may share
        return aten.hardshrink.default, (x, found[1]), [cond, cond.args[0]]
    return None


def _softshrink(y):
    """``aten.softshrink`` for ``y = where(abs(x) > l, x - sign(x) * l, x * 0)``."""
    cond, shrunk, zero = y.args
    found = _shrink_condition(cond, y, aten.gt.Scalar)
    if found is None or not _floating_like(y, found[0]):
        return None
    x, lambd = found
    if not (is_call(zero, aten.mul.Tensor) and _only_reader(zero, y) and _split(zero, 0.0) is x):
        return None
    if not (is_call(shrunk, aten.sub.Tensor) and _only_reader(shrunk, y) and _operands(shrunk)[:1] == (x,)):
        return None
    step = shrunk.args[1]
    sign = _split(step, lambd) if is_call(step, aten.mul.Tensor) and _only_reader(step, shrunk) else None
    if is_call(sign, aten.sign.default) and _only_reader(sign, step) and sign.args[0] is x:
        return aten.softshrink.default, (x, lambd), [cond, cond.args[0], shrunk, step, sign, zero]
    return None


def fuse_activations(ep: torch.export.ExportedProgram, *_args) -> list[str]:
    """Rewrite every written-out activation the module docstring lists in ``ep``, in place."""
    graph = ep.graph_module.graph
    done = []
    for y in [n for n in graph.nodes if is_call(n, aten.mul.Tensor, aten.div.Tensor, aten.sub.Tensor,
                                                   aten.where.self)]:
        if not y.users:  # an intermediate of a pattern already rewritten
            continue
        if is_call(y, aten.mul.Tensor):
            found = _sigmoid_gate(y) or _gelu(y)
        elif is_call(y, aten.div.Tensor):
            found = _hardswish(y) or _softsign(y)
        elif is_call(y, aten.sub.Tensor):
            found = _tanhshrink(y)
        else:
            found = _hardshrink(y) or _softshrink(y)
        if found is None:
            continue
        target, args, inner = found
        with graph.inserting_before(y):
            fused = graph.call_function(target, args)
        fused.meta["val"] = y.meta.get("val")
        take_provenance(fused, y.meta)
        y.replace_all_uses_with(fused)
        done.append(f"{target.__name__}: {fused.name} ({', '.join(n.name for n in inner + [y])})")
    if done:
        graph.eliminate_dead_code()
        graph.lint()
    return done
