"""Nodes that compute nothing new: identity copies and repeated computations, removed from the
decomposed graph before the other rewrites (each would be a launch per call).

* ``aten.copy(dst, src)`` in a functional graph is ``src`` cast and broadcast to ``dst``'s shape and
  dtype; when ``src`` already has both, it is ``src`` itself. transformers' static cache writes its
  position counter this way (``cumulative_length.copy_(cache_position[0])``), once per layer.
* ``aten.cat`` of one tensor and empty ones is that tensor, when it has the result's shape and dtype
  (a view of it that its strides do not allow is lowered over a copy, as any such view). Phi-3 applies its rotary to ``q[..., :rotary_dim]`` and
  concatenates the rest, empty when the rotary covers the whole head.
* Common subexpressions: two calls of one op on the same arguments give the same value, so the second
  is replaced by the first. transformers' static cache recomputes ``arange(T) + position`` for the
  mask, the rotary positions and every layer's cache write; one decoder layer's key positions equal
  the next one's. Nodes are visited in graph order, so a repeat of a repeat merges too.

Only deterministic, side-effect-free calls merge (not ``is_impure``, not seeded random ops); size
nodes and placeholders are left alone. A node the program returns or writes back to a buffer is
kept (a copy or cat too): the signature names each output by its node, and two buffers written from one node would
share one entry (transformers writes each layer's position counter so, from equal values). ``torch.fx``'s own ``CSEPass``
rebuilds the graph module with new node names, which would detach an exported program's signature,
hence this in-place pass.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.export.graph_signature import TensorArgument

from .rewrite import erase_unused, is_call, same_shape, tensor_val

aten = torch.ops.aten


def _replace(ep: torch.export.ExportedProgram, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """``new`` in place of ``old``; what only ``old`` read goes too (an identity copy's destination
    view, which would otherwise still count as a reader of its base)."""
    inputs = old.all_input_nodes
    old.replace_all_uses_with(new)
    ep.graph_module.graph.erase_node(old)
    erase_unused(ep.graph_module.graph, inputs)


def _identity_copy(node: torch.fx.Node) -> torch.fx.Node | None:
    """``src`` when ``node`` is ``aten.copy(dst, src)`` with src of dst's shape, dtype and device."""
    if not is_call(node, aten.copy.default) or node.kwargs.get("non_blocking") or len(node.args) != 2:
        return None
    dst, src = (tensor_val(a) for a in node.args)
    if dst is None or src is None or (dst.dtype, dst.device) != (src.dtype, src.device):
        return None
    return node.args[1] if same_shape(dst, src) else None


def _only_part(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one non-empty part of ``node`` = ``aten.cat(parts)`` when the others are empty and it is
    the result already (shape and dtype), else None."""
    if not is_call(node, aten.cat.default) or not isinstance(node.args[0], (list, tuple)):
        return None
    out, parts = tensor_val(node), [p for p in node.args[0] if tensor_val(p) is None or tensor_val(p).numel() != 0]
    if out is None or len(parts) != 1 or not isinstance(parts[0], torch.fx.Node):
        return None
    part = tensor_val(parts[0])
    if part is None or part.dtype != out.dtype or not same_shape(part, out):
        return None
    return parts[0]


def _mergeable(node: torch.fx.Node) -> bool:
    """A deterministic, side-effect-free op call with a tensor value (size nodes stay apart)."""
    if node.op != "call_function" or node.is_impure() or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return torch.Tag.nondeterministic_seeded not in node.target.tags and tensor_val(node) is not None


def _key(node: torch.fx.Node) -> str:
    """The call as text: the op and its arguments, node arguments by name (unique in a graph)."""
    return repr((node.target, node.args, sorted(node.kwargs.items())))


def dedupe(ep: torch.export.ExportedProgram) -> list[str]:
    """Remove identity copies, one-part cats and repeated computations from ``ep``'s graph; one
    description per removal (the caller recompiles the graph module)."""
    graph = ep.graph_module.graph
    outputs = {spec.arg.name for spec in ep.graph_signature.output_specs if isinstance(spec.arg, TensorArgument)}
    done = []
    for node in list(graph.nodes):
        src = None if node.name in outputs else _identity_copy(node) or _only_part(node)
        if src is not None:
            kind = "identity copy" if is_call(node, aten.copy.default) else "one-part cat"
            done.append(f"{kind}: {node.name} -> {src.name} (removed)")
            _replace(ep, node, src)
    seen: dict[str, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if not _mergeable(node) or node.name in outputs:
            continue
        first = seen.setdefault(_key(node), node)
        if first is not node:
            done.append(f"repeated computation: {node.name} -> {first.name} (merged)")
            _replace(ep, node, first)
    return done
