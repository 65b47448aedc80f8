"""Rotary embeddings written over the two halves of x become ``tritondelegate::rotary``.

GPT-OSS (transformers' ``_apply_rotary_emb``) rotates its queries and keys as

    x1, x2 = chunk(x, 2, -1)                              (or x[..., :h], x[..., h:]), h = D / 2
    y = cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)       c, s: [..., h] tables

which is ``x * cat(c, c) + rotate_half(x) * cat(s, s)``: the rotary of ``ops.py`` with tables of the
whole width. Written out it is eight launches per tensor (four products, the sub and the add, the
cat's two copies) on a decode step. As a rotary it takes the way every other rotary takes: paired
with the layer's other rotary (q with k), into the Q/K/V projection's epilogue (``fuse_rope_linear``).

When the half tables are computed per call from angles, ``c = (cos(a) * scale).to(dtype)`` and ``s``
likewise (views of them, as ``unsqueeze(1)`` over the heads), the result is
``rotary_angles(x, a[views], scale, dtype)``, whose kernel computes the tables inline from the
half-width angles exactly so (``rotary_tables.py``). Other tables (given, or depending on no input, for
constant folding to store) become ``rotary(x, cat((c, c), -1), cat((s, s), -1))``.

The pattern matches with the products' and the add's operands in either order, the halves as the two
results of one ``split``/``split_with_sizes`` of x into equal halves or as two slices of it, along the
last dim; and only when every intermediate is read by the pattern alone.

DeepSeek-V3 (``apply_rotary_pos_emb_interleave``) writes the same with x's even and odd columns,
``x1, x2 = x[..., 0::2], x[..., 1::2]``: the rotary of x's interleaved pairs (2i, 2i + 1), stored as
rotate_half's halves (i, i + D / 2). That is ``rotary(x, ..., deinterleave=True)``: the kernel reads the
pairs in place and writes the halves (no copy of x), with rotate_half's tables. When its half tables
are the first half of a table ``trig(cat((a, a)))`` (``cos[..., :D / 2]``), the whole table is that
table itself.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import ops
from .fuse_glu import only_read_by
from .rewrite import (erase_unused, fake, is_call, new_node, replace_node, replay_views, rewrite_matches,
                      slice_bounds, tensor_val)
from .rotary_tables import per_call, trig_table, whole_table

aten = torch.ops.aten
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)


def _halves(x1, x2):
    """(x, False) when ``x1`` and ``x2`` are x's first and second halves along its last dim, (x, True)
    when they are its even and odd columns, else None."""
    if is_call(x1, operator.getitem) and is_call(x2, operator.getitem) and x1.args[0] is x2.args[0]:
        split = x1.args[0]
        if not is_call(split, *_SPLITS) or (x1.args[1], x2.args[1]) != (0, 1) or len(split.users) != 2:
            return None
        x = split.args[0]
        val, dim = tensor_val(x), split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if val is None or dim % val.dim() != val.dim() - 1 or len(split.meta.get("val") or ()) != 2:
            return None
        return (x, False) if tuple(tensor_val(x1).shape) == tuple(tensor_val(x2).shape) else None
    lo, hi = slice_bounds(x1), slice_bounds(x2)
    if lo is None or hi is None or lo[0] is not hi[0]:
        return None
    x, width = lo[0], tensor_val(lo[0]).shape[-1]
    if lo[1] != tensor_val(x).dim() - 1 or hi[1] != lo[1] or not isinstance(width, int) or width % 2:
        return None
    if (lo[2:], hi[2:]) == ((0, width // 2, 1), (width // 2, width, 1)):
        return x, False
    return (x, True) if (lo[2:], hi[2:]) == ((0, width, 2), (1, width, 2)) else None


def _product(node, reader) -> tuple | None:
    """The two operands of ``node`` = ``mul(a, b)`` read only by ``reader``, else None."""
    if not is_call(node, aten.mul.Tensor) or not only_read_by(node, reader):
        return None
    return tuple(node.args[:2])


def _match(cat) -> tuple | None:
    if not is_call(cat, aten.cat.default) or len(cat.args[0]) != 2:
        return None
    first, second = cat.args[0]
    val = tensor_val(cat)
    if val is None or (cat.args[1] if len(cat.args) > 1 else 0) % val.dim() != val.dim() - 1:
        return None
    if not is_call(first, aten.sub.Tensor) or len(first.args) != 2 or not is_call(second, aten.add.Tensor):
        return None
    if len(second.args) != 2 or first.kwargs or second.kwargs or not (only_read_by(first, cat)
                                                                      and only_read_by(second, cat)):
        return None
    products = [_product(p, first) for p in first.args] + [_product(p, second) for p in second.args]
    if any(p is None for p in products):
        return None
    (a, b), (e, f) = products[:2], products[2:]
    for x1, c in (a, a[::-1]):
        for x2, s in (b, b[::-1]):
            x = _halves(x1, x2)
            if x is not None and {frozenset((x2, c)), frozenset((x1, s))} == {frozenset(e), frozenset(f)}:
                return x[0], c, s, x[1]
    return None


def _angles(c, s) -> tuple | None:
    """(angles, views, scale, dtype) when the half tables are ``(cos(a) * scale).to(dtype)`` and its sin
    through the same views, else None."""
    found = [trig_table(t) for t in (c, s)]
    if any(t is None for t in found):
        return None
    (views, dtype, scale, trig, a), (s_views, s_dtype, s_scale, s_trig, s_a) = found
    same = [(v.target, v.args[1:]) for v in views] == [(v.target, v.args[1:]) for v in s_views]
    if (trig, s_trig) != (aten.cos.default, aten.sin.default) or a is not s_a or not same:
        return None
    return (a, views, scale, dtype) if (scale, dtype) == (s_scale, s_dtype) else None


def _whole(graph, half, meta):
    """``cat((half, half), -1)``: the table of the whole width (views of the table ``half`` is the first
    half of, when it is one)."""
    found = whole_table(half)
    if found is not None:
        return replay_views(graph, found[0], found[1], meta)
    for user in half.users:  # made for an earlier rotary (q's, for k): the same table, so they pair
        if is_call(user, aten.cat.default) and user.args == ([half, half], -1):
            return user
    val = fake(lambda t: torch.cat((t, t), -1), tensor_val(half))
    return new_node(graph, aten.cat.default, ([half, half], -1), val, meta)


def _rewrite(graph, ep, cat, x, c, s, deinterleave: bool, fold: bool) -> str:
    angles = _angles(c, s)
    if angles is not None and fold and not per_call(ep, angles[0]):
        angles = None  # tables of no input: constant folding stores them once
    kwargs = {"deinterleave": True} if deinterleave else {}
    with graph.inserting_before(cat):
        if angles is not None:
            a, views, scale, dtype = angles
            args = (x, replay_views(graph, views, a, cat.meta), scale, dtype)
            new = new_node(graph, ops.rotary_angles, args, cat.meta["val"], cat.meta, kwargs=kwargs)
        else:
            new = new_node(graph, ops.rotary, (x, _whole(graph, c, cat.meta), _whole(graph, s, cat.meta)),
                           cat.meta["val"], cat.meta, kwargs=kwargs)
    parts = list(cat.args[0])
    replace_node(ep, cat, new)
    graph.erase_node(cat)
    erase_unused(graph, parts)
    kind = "tritondelegate::rotary_angles, tables from its angles" if angles is not None else "tritondelegate::rotary"
    pairs = "the even and odd columns" if deinterleave else "the halves"
    return f"rotary of {pairs} of {x.name} -> {new.name} ({kind})"


def halves_rotary(ep: torch.export.ExportedProgram, fold: bool = True) -> list[str]:
    """Rewrite every rotary of the two halves of ``ep``'s graph, in place; one description per rewrite.
    ``fold``: constant folding runs next (tables of no input are left to it)."""
    return rewrite_matches(ep, _match, lambda graph, ep, cat, *found: _rewrite(graph, ep, cat, *found, fold))
