"""Rotary tables computed per call become part of the rotary launch: ``tritondelegate::rotary(x, cos,
sin)`` whose cos and sin a model builds from its input positions becomes
``tritondelegate::rotary_angles(x, angles, scale, dtype)`` (``ops.py``), and the kernel computes the
tables from the angles inline.

A decoder with a KV cache takes its positions as an input, so its tables cannot be folded at lower
time. Llama-style models (the demo's ``KVCacheDecoder``, transformers' rotary embedding) write

    angles = positions.float()[..., None] * inv_freq      [..., D / 2]   (any computation)
    emb    = cat((angles, angles), -1)                     [..., D]
    cos    = (emb.cos() * scale).to(dtype)                 scale: transformers' attention_scaling
    sin    = (emb.sin() * scale).to(dtype)

and views of cos and sin (``unsqueeze(1)`` to broadcast over the heads). That is four to six launches
per call (the cast and product fuse, the cat's two copies, the two tables), each on a few hundred
bytes: on a decode step, pure launch latency. The rewrite keeps the angles' own computation (one
launch per call, shared by every layer) and drops the cat, the tables and their launches: the rotary
kernel reads one angle per position of the half and computes ``cos`` and ``sin`` in fp32, scales and
rounds them to ``dtype`` as eager does, then rotates, so its result is eager's.

A rotary node is rewritten when both tables are, from the top: views that leave the last dim alone
(``unsqueeze``, ``view``/``reshape`` keeping the last size, ``expand``, ``alias``); at most one cast
(``_to_copy`` to a dtype); multiplications by Python numbers (their product is the scale: equal for
cos and sin); ``cos`` or ``sin`` of one ``cat((a, a), -1)`` of a float32 ``a`` (of one
``repeat_interleave(a, 2, -1)`` for a rotary of interleaved pairs: Cohere's); and the two view
chains are the same ops with the same arguments. The angles then take those views, with the last
size halved. Tables that other nodes also read stay in the graph for them; once no node reads them,
they are removed. Angles that depend on no method input nor state (a forward over a static length)
are left to constant folding, which stores the tables themselves once (``fold=False``: rewritten too).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from ..kernels.rows import node_arg
from ..ops import rotary as rotary_op
from ..ops import rotary_angles as rotary_angles_op
from .rewrite import erase_unused, fake, is_call, new_node, number_operand, slice_bounds, tensor_val

aten = torch.ops.aten

# Views that keep the last dim (checked per call by ``_half_view``), replayed on the angles.
_VIEWS = {aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.expand.default, aten.alias.default}
_SCALES = {aten.mul.Tensor, aten.mul.Scalar}


def _half_view(node: torch.fx.Node, width: int):
    """The arguments after the source for ``node`` replayed on the half-width angles, or None when the
    view touches the last dim (of size ``width``)."""
    rest = list(node.args[1:])
    if node.target in (aten.unsqueeze.default, aten.alias.default):
        out = tensor_val(node)
        if node.target is aten.unsqueeze.default and rest[0] % out.dim() == out.dim() - 1:
            return None  # the new dim would be last
        return tuple(rest)
    sizes = list(rest[0])
    if not sizes or sizes[-1] not in (width, -1):
        return None
    return (sizes[:-1] + [width // 2 if sizes[-1] == width else -1],) + tuple(rest[1:])


def scale_operand(node: torch.fx.Node):
    """(tensor operand, number) of ``tensor * number``, else None."""
    return number_operand(node, *_SCALES)


def trig_table(node):
    """(views [node], cast dtype or None, scale, trig target, cat node) when ``node`` is a table as the
    module docstring describes, else None."""
    views, cast, scale = [], None, 1.0
    while is_call(node, *_VIEWS):
        views.append(node)
        node = node.args[0]
    if is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"} and len(node.args) == 1:
        cast, node = node.kwargs.get("dtype"), node.args[0]
    while (found := scale_operand(node)) is not None:
        node, factor = found
        scale *= factor
    if not is_call(node, aten.cos.default, aten.sin.default):
        return None
    emb, val = node.args[0], tensor_val(node)
    if val is None or val.dtype != torch.float32:
        return None
    return views[::-1], cast or val.dtype, scale, node.target, emb


def _float_angles(a) -> bool:
    val = tensor_val(a)
    return val is not None and val.dtype == torch.float32 and val.dim() > 0 and isinstance(val.shape[-1], int)


def _interleaved_angles(emb: torch.fx.Node) -> torch.fx.Node | None:
    """``a`` of ``repeat_interleave(a, 2, -1)`` as export writes it (``view(clone(expand(a[..., None],
    [..., D / 2, 2])), [..., D])``), else None."""
    if not is_call(emb, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    clone = emb.args[0]
    expand = clone.args[0] if is_call(clone, aten.clone.default) else None
    if not is_call(expand, aten.expand.default) or not is_call(expand.args[0], aten.unsqueeze.default):
        return None
    a, dim = expand.args[0].args[:2]
    val, out = tensor_val(a), tensor_val(expand)
    if not _float_angles(a) or dim % (val.dim() + 1) != val.dim() or out.shape[-1] != 2:
        return None
    return a if tuple(out.shape[:-1]) == tuple(val.shape) and tensor_val(emb).shape[-1] == 2 * val.shape[-1] else None


def _angles_of(emb: torch.fx.Node) -> tuple[torch.fx.Node, bool] | None:
    """(``a``, False) of ``cat((a, a), -1)`` or (``a``, True) of ``repeat_interleave(a, 2, -1)``, with
    ``a`` float32 of a static last dim, else None."""
    interleaved = _interleaved_angles(emb)
    if interleaved is not None:
        return interleaved, True
    if not is_call(emb, aten.cat.default):
        return None
    parts = emb.args[0]
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or parts[0] is not parts[1]:
        return None
    a, dim = parts[0], node_arg(emb, 1, "dim", 0)
    if not _float_angles(a):
        return None
    return (a, False) if isinstance(dim, int) and dim % tensor_val(a).dim() == tensor_val(a).dim() - 1 else None


def _same_views(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.target == y.target and x.args[1:] == y.args[1:] for x, y in zip(a, b))


def _match(node: torch.fx.Node):
    """(angles, views, scale, dtype) when ``node`` is a rotary whose cos and sin come from angles, in
    its own pairing (cat for rotate_half, repeat_interleave for interleaved pairs)."""
    cos, sin = (trig_table(t) for t in node.args[1:3])
    if cos is None or sin is None or (cos[3], sin[3]) != (aten.cos.default, aten.sin.default):
        return None
    (views, dtype, scale, _, emb), (sin_views, sin_dtype, sin_scale, _, sin_emb) = cos, sin
    angles = _angles_of(emb)
    if (angles is None or angles[1] != node.kwargs.get("interleaved", False)
            or sin_emb is not emb and _angles_of(sin_emb) != angles
            or (dtype, scale) != (sin_dtype, sin_scale) or not _same_views(views, sin_views)):
        return None
    return angles[0], views, scale, dtype


def whole_table(half: torch.fx.Node) -> tuple[list, torch.fx.Node] | None:
    """(views, table) when ``half`` is ``table[..., :D / 2]`` through ``views`` (``unsqueeze``, ``alias``:
    none touches the last dim) and ``table`` is a rotate_half table of width D (``trig(cat((a, a), -1))``
    as :func:`trig_table` reads it): ``cat((half, half), -1)`` is then ``table`` through the views."""
    views = []
    while is_call(half, aten.unsqueeze.default, aten.alias.default):
        views.append(half)
        half = half.args[0]
    bounds = slice_bounds(half)
    if bounds is None:
        return None
    table, dim, start, end, step = bounds
    val, found = tensor_val(table), trig_table(table)
    if found is None or dim != val.dim() - 1 or (start, step) != (0, 1) or 2 * end != val.shape[-1]:
        return None
    if any(v.target is aten.unsqueeze.default and v.args[1] % tensor_val(v).dim() == tensor_val(v).dim() - 1
           for v in views):
        return None  # the new dim would be last
    angles = _angles_of(found[4])
    return (views[::-1], table) if angles is not None and not angles[1] else None


def _replay(graph: torch.fx.Graph, angles: torch.fx.Node, views: list, before: torch.fx.Node):
    """``angles`` through ``views`` (with the last size halved), inserted before ``before``; None when
    a view touches the last dim."""
    width = tensor_val(angles).shape[-1] * 2
    node = angles
    for view in views:
        rest = _half_view(view, width)
        if rest is None:
            return None
        with graph.inserting_before(before):
            vals = torch.fx.node.map_arg(rest, lambda n: n.meta["val"])
            node = new_node(graph, view.target, (node, *rest), fake(view.target, tensor_val(node), *vals),
                            view.meta)
    return node


def per_call(ep: torch.export.ExportedProgram, node: torch.fx.Node) -> bool:
    """Whether ``node`` reads a method input or state (its value changes between calls)."""
    varying = {spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT
               or spec.target in ep.graph_signature.buffers_to_mutate.values()}
    stack, seen = [node], {node}
    while stack:
        current = stack.pop()
        if current.op == "placeholder" and current.name in varying:
            return True
        for arg in current.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return False


def rotary_tables(ep: torch.export.ExportedProgram, fold: bool = True) -> list[str]:
    """Rewrite each ``tritondelegate::rotary`` of ``ep``'s graph whose tables come from angles into
    ``tritondelegate::rotary_angles``; returns one description per rewrite. ``fold``: constant folding
    runs next (input-independent angles are left to it)."""
    graph = ep.graph_module.graph
    done = []
    for node in [n for n in graph.nodes if is_call(n, rotary_op)]:
        found = _match(node)
        if found is None or (fold and not per_call(ep, found[0])):
            continue
        angles, views, scale, dtype = found
        replayed = _replay(graph, angles, views, node)
        if replayed is None:
            continue
        x, tables = node.args[0], node.args[1:3]
        with graph.inserting_before(node):
            new = new_node(graph, rotary_angles_op, (x, replayed, scale, dtype), node.meta["val"], node.meta,
                           kwargs=node.kwargs)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        erase_unused(graph, list(tables))
        done.append(f"rotary tables of {x.name} computed in its kernel from {angles.name} -> {new.name} "
                    f"(tritondelegate::rotary_angles)")
    return done
