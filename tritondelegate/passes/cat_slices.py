"""A concatenation of adjacent slices of one tensor is a slice of that tensor: ``cat([x[..., a:b],
x[..., b:c]], -1)`` is ``x[..., a:c]``, a view, where the cat is a copy launch per part.

A partial rotary (Phi, GPT-NeoX, StableLM, GPT-J, CodeGen) rotates ``q[..., :r]`` and returns
``cat((q_rot, q[..., r:]), -1)``. Once ``fuse_rope_linear`` has moved the rotation into the Q/K/V
projection's epilogue, ``q_rot`` is the projection's own columns, rotated in place: the cat reassembles
a tensor that already sits in memory as it is, at the cost of four copy launches per layer (q and k,
each part). Here it becomes ``slice(x, dim, a, c)`` (``x`` itself when that is all of it).

A cat is rewritten when: its parts are ``slice(x, dim, start, end)`` (step 1, static bounds) or parts of
a ``split`` of one node ``x`` along the cat's own dim (DeepSeek's ``cat((q_pass, q_rot))`` once both are
the projection's own columns), in order, each starting where the one before ends; ``x`` reaches
(through views) a tensor the graph computes, not an input or a buffer, and that no op writes in place
(after the cat a write would change the view, not the copy); the cat is not a method output; and
when a ``view`` reads the cat, the slice is contiguous as the cat's result is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..kernels.rows import node_arg
from .fuse_rope_linear import is_view
from .rewrite import fake, is_call, new_node, slice_bounds, tensor_val

aten = torch.ops.aten
_NEEDS_CONTIGUOUS = (aten.view.default, aten._unsafe_view.default)


def _bounds(part: torch.fx.Node, dim: int):
    """(source, start, end) of ``part`` = ``slice(source, dim, start, end, 1)`` with static bounds
    clamped to the source's static size along ``dim``, or a part of ``split(source, sizes, dim)``; else
    None."""
    found = slice_bounds(part) or _split_bounds(part)
    if found is None or found[1] != dim or found[4] != 1:
        return None
    return found[0], found[2], found[3]


def _split_bounds(part: torch.fx.Node):
    """(source, dim, start, end, 1) when ``part`` is part ``i`` of ``split_with_sizes(source, sizes,
    dim)`` or ``split(source, size, dim)`` with static sizes, else None."""
    if part.op != "call_function" or part.target is not operator.getitem:
        return None
    split, i = part.args
    if not is_call(split, aten.split_with_sizes.default, aten.split.Tensor):
        return None
    val, dim = tensor_val(split.args[0]), node_arg(split, 2, "dim", 0)
    if val is None or not isinstance(dim, int) or not isinstance(val.shape[dim], int):
        return None
    dim %= val.dim()
    sizes = split.args[1]
    if is_call(split, aten.split.Tensor) and isinstance(sizes, int) and sizes > 0:
        sizes = [min(sizes, val.shape[dim] - k) for k in range(0, val.shape[dim], sizes)]
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(n, int) for n in sizes) or not 0 <= i < len(sizes):
        return None
    start = sum(sizes[:i])
    return split.args[0], dim, start, start + sizes[i], 1


def _root(node: torch.fx.Node) -> torch.fx.Node:
    while is_view(node):
        node = node.args[0]
    return node


def _written_in_place(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The tensors (view roots) some op of the graph mutates."""
    written = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is not None and schema.is_mutable and node.args and isinstance(node.args[0], torch.fx.Node):
            written.add(_root(node.args[0]))
    return written


def _slice_of_parts(cat: torch.fx.Node, written: set, returned: set):
    """(source, dim, start, end) when ``cat`` may become ``slice(source, dim, start, end)``, else None."""
    parts, out = cat.args[0], tensor_val(cat)
    if out is None or cat.name in returned or not isinstance(parts, (list, tuple)) or len(parts) < 2:
        return None
    dim = node_arg(cat, 1, "dim", 0)
    if not isinstance(dim, int):
        return None
    dim %= out.dim()
    found = [_bounds(p, dim) for p in parts]
    if None in found or any(f[0] is not found[0][0] for f in found):
        return None
    if any(a[2] != b[1] for a, b in zip(found, found[1:])) or any(s >= e for _, s, e in found):
        return None
    source = found[0][0]
    root = _root(source)
    if root.op != "call_function" or root in written or tensor_val(source).dtype != out.dtype:
        return None
    if any(is_call(user, *_NEEDS_CONTIGUOUS) for user in cat.users) and not _contiguous(source, dim, found):
        return None  # a view op that reads the cat needs its contiguous layout
    return source, dim, found[0][1], found[-1][2]


def _contiguous(source: torch.fx.Node, dim: int, found: list) -> bool:
    val = tensor_val(source)
    part = fake(lambda t: aten.slice.Tensor(t, dim, found[0][1], found[-1][2]), val)
    return part.is_contiguous()


def cat_slices(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite every cat of adjacent slices of one tensor into the slice they tile (or the tensor).
    Returns one description per rewrite."""
    graph = ep.graph_module.graph
    returned = {getattr(spec.arg, "name", None) for spec in ep.graph_signature.output_specs}
    written = _written_in_place(graph)
    done = []
    for cat in [n for n in graph.nodes if is_call(n, aten.cat.default)]:
        found = _slice_of_parts(cat, written, returned)
        if found is None:
            continue
        source, dim, start, end = found
        parts = list(cat.args[0])
        if (start, end) == (0, tensor_val(source).shape[dim]):
            new = source
        else:
            with graph.inserting_before(cat):
                val = fake(lambda t: aten.slice.Tensor(t, dim, start, end), tensor_val(source))
                new = new_node(graph, aten.slice.Tensor, (source, dim, start, end), val, cat.meta)
        cat.replace_all_uses_with(new)
        graph.erase_node(cat)
        for part in parts:
            if not part.users:
                graph.erase_node(part)
        done.append(f"cat of adjacent slices of {source.name} -> {new.name} (a view: {len(parts)} copies -> 0)")
    return done
