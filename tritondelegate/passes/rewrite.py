"""What the graph rewrites of ``passes/fuse*.py`` share: node tests, values computed on fake tensors,
and the provenance a new node takes from the node it stands for."""

from __future__ import annotations

import numbers
import sys

import torch
import torch.fx
from torch.export.graph_signature import TensorArgument

from ..kernels import sizes
from ..kernels.refs import node_value
from ..kernels.rows import node_arg

# The metadata a new node inherits (what stack traces and module paths point to).
PROVENANCE = ("stack_trace", "nn_module_stack", "source_fn_stack")


def is_call(node, *targets) -> bool:
    """Whether ``node`` is an fx node calling one of ``targets``."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def tensor_val(node) -> torch.Tensor | None:
    """``node``'s ``meta["val"]`` when it is a tensor (a FakeTensor), else None."""
    val = node_value(node)
    return val if isinstance(val, torch.Tensor) else None


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (fake) tensors have the same shape, dynamic sizes compared as expressions (never
    through a SymInt comparison, which would add a guard to the shape environment)."""
    return a.dim() == b.dim() and sizes.shape(a.shape) == sizes.shape(b.shape)


def is_number(v) -> bool:
    """Whether ``v`` is a Python number (a scalar argument), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def number_operand(node, *targets) -> tuple | None:
    """(tensor operand, number) when ``node`` calls one of ``targets`` (a commutative op: ``mul``,
    ``add``) on a tensor and a Python number, either way round, with no keyword arguments; else None."""
    if not is_call(node, *targets) or node.kwargs:
        return None
    a, b = node.args[:2]
    if isinstance(a, torch.fx.Node) and is_number(b):
        return a, float(b)
    if isinstance(b, torch.fx.Node) and is_number(a):
        return b, float(a)
    return None


def static_int(v) -> int | None:
    """``v`` when it is a Python int (not a bool, not a symbolic size), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def slice_bounds(node):
    """(source, dim, start, end, step) when ``node`` is ``aten.slice(source, dim, start, end, step)``
    with static arguments along a dim of static size: ``dim`` normalized, ``start`` and ``end``
    clamped to [0, size] as ATen clamps them; None otherwise."""
    if not is_call(node, torch.ops.aten.slice.Tensor):
        return None
    source = node.args[0]
    val = tensor_val(source)
    dim = static_int(node_arg(node, 1, "dim", 0))
    if val is None or val.dim() == 0 or dim is None:
        return None
    dim %= val.dim()
    size = val.shape[dim]
    start, end = node_arg(node, 2, "start"), node_arg(node, 3, "end")
    start = 0 if start is None else static_int(start)
    end = sys.maxsize if end is None else static_int(end)
    step = static_int(node_arg(node, 4, "step", 1))
    if not isinstance(size, int) or start is None or end is None or step is None:
        return None
    start, end = (min(max(v + size if v < 0 else v, 0), size) for v in (start, end))
    return source, dim, start, end, step


CAST_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def cast_input(node) -> torch.fx.Node | None:
    """The input of ``node`` when it is a plain dtype cast between :data:`CAST_FLOATS` (``_to_copy``
    that keeps layout, device and memory format), else None."""
    src = plain_cast(node)
    if src is None or tensor_val(src).dtype not in CAST_FLOATS or tensor_val(node).dtype not in CAST_FLOATS:
        return None
    return src


def plain_cast(node) -> torch.fx.Node | None:
    """The input of ``node`` when it is a plain dtype cast (``_to_copy`` to a dtype that keeps layout,
    device and memory format), between any dtypes; else None."""
    if not is_call(node, torch.ops.aten._to_copy.default) or len(node.args) != 1 or "dtype" not in node.kwargs:
        return None
    src = node.args[0]
    src_val = tensor_val(src)
    if src_val is None or tensor_val(node) is None:
        return None
    for key, value in node.kwargs.items():
        if key == "dtype":
            continue
        if key == "layout" and value in (None, torch.strided):
            continue
        if key == "device" and (value is None or torch.device(value) == src_val.device):
            continue
        if key == "memory_format" and value in (None, torch.preserve_format):
            continue
        if key == "non_blocking" and not value:
            continue
        return None
    return src


def fake(fn, *vals):
    """``fn(*vals)`` on FakeTensors, under their fake mode (symbolic sizes stay symbolic)."""
    mode = getattr(vals[0], "fake_mode", None) or torch._guards.detect_fake_mode(list(vals))
    if mode is None:
        return fn(*vals)
    with mode:
        return fn(*vals)


def take_provenance(node: torch.fx.Node, meta: dict) -> torch.fx.Node:
    """Copy the :data:`PROVENANCE` entries of ``meta`` (the replaced node's) into ``node``'s."""
    for key in PROVENANCE:
        if key in meta:
            node.meta[key] = meta[key]
    return node


def new_node(graph: torch.fx.Graph, target, args: tuple, val, meta: dict, name: str | None = None,
             kwargs: dict | None = None) -> torch.fx.Node:
    """A call_function node with value ``val`` and the provenance in ``meta``."""
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name)
    node.meta["val"] = val
    return take_provenance(node, meta)


def replay_views(graph: torch.fx.Graph, views, source: torch.fx.Node, meta: dict) -> torch.fx.Node:
    """``views`` (view nodes, outermost last) replayed on ``source`` with their own arguments: the views
    a rotary's tables took, taken by the angles they come from (complex and halves rotaries)."""
    for view in views:
        args = (source, *view.args[1:])
        val = fake(lambda v, view=view, rest=view.args[1:]: view.target(v, *rest), tensor_val(source))
        source = new_node(graph, view.target, args, val, meta)
    return source


def retarget_outputs(ep: torch.export.ExportedProgram, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """A returned result keeps its signature entry when ``new`` takes ``old``'s place."""
    for spec in ep.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name == old.name:
            spec.arg = TensorArgument(name=new.name)


def replace_node(ep: torch.export.ExportedProgram, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """``new`` in ``old``'s place for every reader, a returned result's signature entry included."""
    old.replace_all_uses_with(new)
    retarget_outputs(ep, old, new)


def erase_unused(graph: torch.fx.Graph, roots) -> None:
    """Erase each of ``roots`` that nothing reads any more, and then what only they read, as far as it
    goes (pure calls only: placeholders and impure calls stay)."""
    stack, erased = list(roots), set()
    while stack:
        node = stack.pop()
        if node in erased or node.op != "call_function" or node.users or node.is_impure():
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)


def rewrite_matches(ep: torch.export.ExportedProgram, match, rewrite) -> list[str]:
    """``rewrite(graph, ep, node, *found)`` for every node of ``ep``'s graph (a snapshot, in order) where
    ``match(node)`` finds something (a tuple; None: no match); the graph is linted and recompiled when
    anything was rewritten. Returns each rewrite's description."""
    graph = ep.graph_module.graph
    done = []
    for node in list(graph.nodes):
        found = match(node)
        if found is not None:
            done.append(rewrite(graph, ep, node, *found))
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done
