"""A rotary epilogue computes its angles from the positions itself.

A decoder's step computes its rotary angles once, outside the layers, in a launch of its own:
``angles = positions.float()[..., None] * inv_freq`` (the demo's ``KVCacheDecoder``; transformers'
``inv_freq[None, :, None].float() @ position_ids[:, None, :].float()``, a product over one term), read
by every layer's ``tritondelegate::rope_linear`` (``passes/fuse_rope_linear.py``). The epilogue can
multiply the row's position by the pair's inverse frequency itself, in fp32 as eager does (the same
single product: the same angle to the bit), so each such rope_linear reads the positions and the
inverse frequencies instead (``kernels/matmul.py`` ``ROPE="positions"``), and once no node reads the
angles their launch is gone: one launch fewer per call.

A rope_linear node is rewritten when its angles (``cos``, with ``sin`` None) are views (``transpose``,
``permute``, ``unsqueeze``, ``view``, ``reshape``, ``alias``, ``expand``) of ``mul(p, f)`` in float32
(either order), where ``p`` is views of one cast to float32 of an int32 or int64 tensor and ``f`` is
float32, float16 or bfloat16 (a model cast to half precision keeps its positions' cast: the product is
float32, ``f`` widened exactly, as the kernel widens it). The positions are then ``p``'s views replayed on
the integer tensor, and both operands are broadcast to the product's shape and viewed as the angles are: the
kernel reads each at the angle's index (``expand`` strides of 0 where it broadcasts) and multiplies them.
"""

from __future__ import annotations

import torch
import torch.fx

from .. import ops
from .rewrite import erase_unused, fake, is_call, new_node, plain_cast, tensor_val

aten = torch.ops.aten
_VIEWS = (aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.alias.default, aten.expand.default, aten.transpose.int, aten.permute.default)


def _views_of(node: torch.fx.Node) -> tuple[torch.fx.Node, list]:
    """(the node under a chain of views ending at ``node``, the views from it to ``node`` in order)."""
    chain = []
    while is_call(node, *_VIEWS):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _int_positions(p: torch.fx.Node):
    """(the integer tensor, the views from its float32 cast to ``p``) when ``p`` is views of a cast of an
    int32/int64 tensor (views before the cast stay: they view the integers already), else None."""
    cast, views = _views_of(p)
    source = plain_cast(cast)
    val = tensor_val(source) if source is not None else None
    if val is None or val.dtype not in (torch.int32, torch.int64) or tensor_val(cast).dtype != torch.float32:
        return None
    return source, views


def _match(angles: torch.fx.Node):
    """(the product, its views to the angles, the integer tensor, the views from its cast, the
    frequencies) when ``angles`` is views of positions times inverse frequencies, else None."""
    product, outer = _views_of(angles)
    out = tensor_val(product)
    if not is_call(product, aten.mul.Tensor) or out is None or out.dtype != torch.float32 or len(product.args) != 2:
        return None
    for p, f in (product.args, product.args[::-1]):
        fv = tensor_val(f)
        found = _int_positions(p) if isinstance(p, torch.fx.Node) else None
        if found is not None and fv is not None and fv.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return product, outer, found[0], found[1], f
    return None


def _replay(graph: torch.fx.Graph, node: torch.fx.Node, views: list) -> torch.fx.Node:
    for view in views:
        rest = view.args[1:]
        val = fake(lambda t, v=view, r=rest: v.target(t, *r), tensor_val(node))
        node = new_node(graph, view.target, (node, *rest), val, view.meta)
    return node


def _as_angles(graph, node: torch.fx.Node, shape, outer: list, meta: dict, before: torch.fx.Node) -> torch.fx.Node:
    """``node`` broadcast to the product's ``shape``, then viewed as the angles are (-1 keeps a dim's
    own size). A dim of dynamic size it broadcasts along (the inverse frequencies over a dynamic number
    of positions) takes its size from a method input's (``_size_node``; the new nodes go before
    ``before``). Raises ValueError when no input has it."""
    own = tensor_val(node).shape
    pad = len(shape) - len(own)
    own = [None] * pad + list(own)  # dims the broadcast adds in front
    sizes = []
    for have, want in zip(own, shape):
        if have is not None and str(have) == str(want):
            sizes.append(-1)
        elif have is None or (isinstance(have, int) and have == 1):
            sizes.append(want if isinstance(want, int) else _size_node(graph, want, before))
        else:
            raise ValueError(f"broadcasting {have} to {want}")
    val = fake(lambda t: t.expand([s.meta["val"] if isinstance(s, torch.fx.Node) else s for s in sizes]),
               tensor_val(node))
    return _replay(graph, new_node(graph, aten.expand.default, (node, sizes), val, meta), outer)


def _size_node(graph, size, before: torch.fx.Node) -> torch.fx.Node:
    """A node giving the dynamic ``size``: the graph's ``sym_size`` of a method input that has it, when it
    comes before ``before``, or a new one (a size read from a computed tensor would make the host need that
    tensor)."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    for node in graph.nodes:
        if node is before:
            break
        if (is_call(node, aten.sym_size.int) and node.args[0] in inputs
                and str(node.meta.get("val")) == str(size)):
            return node
    for placeholder in inputs:
        val = tensor_val(placeholder)
        for dim, have in enumerate(val.shape if val is not None else ()):
            if str(have) == str(size):
                node = graph.call_function(aten.sym_size.int, (placeholder, dim))
                node.meta["val"] = have
                return node
    raise ValueError(f"no method input has the dynamic size {size}")


def rope_positions(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite every rope_linear whose angles are positions times inverse frequencies to read those.
    Returns one description per rewrite."""
    graph = ep.graph_module.graph
    done, angles_read = [], set()
    for rope in [n for n in graph.nodes if is_call(n, ops.rope_linear)]:
        angles, sin = rope.args[4], rope.args[5]
        found = None if sin is not None else _match(angles)
        if found is None:
            continue
        product, outer, source, inner, freqs = found
        shape, before = tensor_val(product).shape, set(graph.nodes)
        try:
            with graph.inserting_before(rope):
                positions = _as_angles(graph, _replay(graph, source, inner), shape, outer, angles.meta, rope)
                frequencies = _as_angles(graph, freqs, shape, outer, angles.meta, rope)
            fits = tensor_val(positions).shape == tensor_val(angles).shape
        except (RuntimeError, ValueError):  # a view the broadcast operands cannot take
            fits = False
        if not fits:  # left as it is: the views made for it go again
            erase_unused(graph, [n for n in reversed(graph.nodes) if n not in before])
            continue
        rope.args = (*rope.args[:4], positions, frequencies, *rope.args[6:])
        angles_read.add(angles)
        done.append(f"rotary angles in the epilogue: {rope.name} multiplies {source.name} by {freqs.name} "
                    f"itself ({angles.name} not read)")
    if done:
        erase_unused(graph, list(angles_read))
        graph.lint()
        ep.graph_module.recompile()
    return done
