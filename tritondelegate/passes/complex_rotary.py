"""Rotary embeddings written with complex numbers become ``tritondelegate::rotary_angles`` (no complex
tensor left for the host).

Llama 4 and DeepSeek-V2 rotate their queries and keys as

    c = polar(ones_like(a), a) [* s]                       a: the angles [..., D / 2], s: a scale
    z = view_as_complex(x.float().view(..., D / 2, 2))     consecutive pairs (x[2i], x[2i + 1])
    y = view_as_real(z * c[views]).flatten(-2)

which is the rotary of interleaved pairs: y[2i] = x[2i] cos - x[2i + 1] sin, y[2i + 1] = x[2i + 1] cos +
x[2i] sin, with cos and sin of a times s. No kernel takes complex tensors, so these ran on the host.
As

    y = rotary_angles(x.view(..., D), a[views], s, float32, interleaved=True).view(..., D / 2, 2)

the kernel computes the tables from the angles inline, in fp32 as ``polar`` does, and the rotary passes
that follow pair q's with k's and move them into the projection's epilogue as for any other rotary.

The pattern matches when the product is read only by ``view_as_real`` and the complex view only by the
product; ``c`` is views (``unsqueeze``, ``view``/``reshape``, ``expand``, ``alias``, ``slice``,
``select``) of ``polar`` with a magnitude of ones, times Python numbers; the pairs and angles are
float32; and the pairs' [..., D] form is known (a ``view`` of them, or static sizes).
"""

from __future__ import annotations

import torch
import torch.fx

from .. import ops
from .fuse_glu import only_read_by
from .rewrite import erase_unused, fake, is_call, new_node, replace_node, replay_views, rewrite_matches, tensor_val
from .rotary_tables import scale_operand

aten = torch.ops.aten
_VIEWS = (aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.expand.default, aten.alias.default, aten.slice.Tensor, aten.select.int)
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _ones(node) -> bool:
    """Whether ``node`` is a tensor of ones (``ones_like``, ``full_like(·, 1)``, ``full(·, 1)``)."""
    if is_call(node, aten.ones_like.default, aten.ones.default):
        return True
    return is_call(node, aten.full_like.default, aten.full.default) and node.args[1] == 1


def _polar(c) -> tuple | None:
    """(views, outermost last; angles; scale) when ``c`` is views of ``polar(ones, angles) * scale``."""
    views = []
    while is_call(c, *_VIEWS):
        views.append(c)
        c = c.args[0]
    scale = 1.0
    while (found := scale_operand(c)) is not None:
        c, factor = found
        scale *= factor
    if not is_call(c, aten.polar.default) or not _ones(c.args[0]):
        return None
    angles = c.args[1]
    val = tensor_val(angles)
    return (views[::-1], angles, scale) if val is not None and val.dtype == torch.float32 else None


def _pair_sizes(pairs) -> tuple | None:
    """(the [..., D] sizes of ``pairs`` [..., D / 2, 2], the pairs' own sizes): from the ``view`` that
    made them (dynamic sizes kept as the graph gives them), else from static sizes; else None."""
    if is_call(pairs, *_RESHAPES) and isinstance(pairs.args[1], (list, tuple)) and len(pairs.args[1]) >= 2:
        size = list(pairs.args[1])
        half = size[-2]
        if isinstance(half, int) and half > 0:
            return size[:-2] + [2 * half], size
        if half == -1 and -1 not in size[:-2]:
            return size[:-2] + [-1], size
    shape = tensor_val(pairs).shape
    if all(isinstance(s, int) for s in shape):
        return list(shape[:-2]) + [2 * shape[-2]], list(shape)
    return None


def _match(real) -> tuple | None:
    if not is_call(real, aten.view_as_real.default):
        return None
    prod = real.args[0]
    if not is_call(prod, aten.mul.Tensor) or not only_read_by(prod, real):
        return None
    for z, c in (prod.args, prod.args[::-1]):
        if not is_call(z, aten.view_as_complex.default) or not only_read_by(z, prod):
            continue
        polar = _polar(c)
        pairs = z.args[0]
        val = tensor_val(pairs)
        if polar is None or val is None or val.dtype != torch.float32 or val.shape[-1] != 2:
            continue
        sizes = _pair_sizes(pairs)
        if sizes is not None:
            return (prod, pairs, *sizes, *polar)
    return None


def _rewrite(graph, ep, real, prod, pairs, flat, own, views, angles, scale, replayed: dict) -> str:
    """``replayed``: the angles' views made so far, by the complex views they replay (q and k share
    theirs, so that the rotary passes pair them)."""
    key = (angles, repr([(v.target, v.args[1:]) for v in views]))
    with graph.inserting_after(pairs):  # early, so that q's rotary and k's can pair
        x = new_node(graph, aten.view.default, (pairs, flat), fake(lambda v: v.reshape(_static(v, flat)),
                                                                   tensor_val(pairs)), real.meta)
    with graph.inserting_before(real):
        if key not in replayed:
            with graph.inserting_after(views[-1] if views else angles):
                replayed[key] = replay_views(graph, views, angles, real.meta)
        a = replayed[key]
        kwargs = {"interleaved": True}
        val = fake(lambda xv, av: ops.rotary_angles(xv, av, scale, torch.float32, interleaved=True),
                   tensor_val(x), tensor_val(a))
        rot = new_node(graph, ops.rotary_angles, (x, a, scale, torch.float32), val, real.meta, kwargs=kwargs)
        out = new_node(graph, aten.view.default, (rot, own), tensor_val(real), real.meta)
    replace_node(ep, real, out)
    graph.erase_node(real)
    erase_unused(graph, [prod])
    return (f"complex rotary: view_as_real(view_as_complex({pairs.name}) * polar) -> {rot.name} "
            "(tritondelegate::rotary_angles, interleaved pairs)")


def _static(v: torch.Tensor, sizes) -> list:
    """``sizes`` with graph nodes (dynamic sizes) replaced by ``v``'s own sizes at their places."""
    return [v.shape[i] if isinstance(s, torch.fx.Node) else s for i, s in enumerate(sizes)]


def complex_rotary(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite every complex-number rotary of ``ep``'s graph, in place; one description per rewrite."""
    replayed: dict = {}
    return rewrite_matches(ep, _match, lambda *found: _rewrite(*found, replayed))
