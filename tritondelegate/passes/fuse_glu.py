"""A gated MLP's gate and up projections as one GEMM with the gating in its epilogue.

Llama, Qwen2, Mistral and Phi-3 (SwiGLU), Gemma (GeGLU) and T5 v1.1 write their MLP as

    h = act(linear(x, Wg[, bg])) * linear(x, Wu[, bu])          (either operand order)

Two launches read ``x``, and the gate's (or up's) full result is written and read back. As one

    W = stack([Wg, Wu], 1).view(2N, K)                           rows g0, u0, g1, u1, ...
    h = tritondelegate::glu_linear(x, W[, b], act)               act(y[..., 0::2]) * y[..., 1::2]

the matmul kernel computes a tile of ``x @ W.T`` whose columns pair each gate with its up and stores
only ``act(gate) * up`` (half the tile's width): one launch, and no intermediate in memory. The
interleaving is input-independent, so constant folding (which runs next, and without which this pass
does not run) computes ``W`` once at lower time; ``Wg`` and ``Wu`` are dropped then unless something
else reads them.

The pattern matches when both linears read the same ``x`` with constant weights of the same dtype and
shape (``fuse_projections.linear_candidate``), both or neither have a bias, and the gate's result,
the activation's and the up's are read by nothing but the pattern (a result also read elsewhere keeps
the pattern written out).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.export.graph_signature import TensorArgument

from .. import ops
from .fold_constants import constant_inputs
from .fuse_projections import linear_candidate
from .rewrite import fake, is_call, new_node, same_shape, tensor_val

aten = torch.ops.aten


def _act(node) -> str | None:
    """The GLU activation name (``ops.GLU_ACTS``) ``node`` computes on its one tensor input, or None."""
    if is_call(node, aten.silu.default):
        return "silu"
    if is_call(node, aten.relu.default):
        return "relu"
    if is_call(node, aten.gelu.default):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


def _only_read_by(node: torch.fx.Node, reader: torch.fx.Node) -> bool:
    return list(node.users) == [reader]


def _match(mul: torch.fx.Node, constants: set[torch.fx.Node]):
    """(act name, gate linear, activation node, up linear) when ``mul`` is the root of a gated MLP."""
    if not is_call(mul, aten.mul.Tensor) or len(mul.args) != 2 or mul.kwargs:
        return None
    for gated, up in (mul.args, mul.args[::-1]):
        act = _act(gated)
        if act is None or up is gated or not isinstance(up, torch.fx.Node):
            continue  # (the other operand may be a Python scalar)
        gate = gated.args[0]
        g, u = linear_candidate(gate, constants), linear_candidate(up, constants)
        if g is None or u is None or gate is up or g[0] is not u[0] or (g[2] is None) != (u[2] is None):
            continue
        wg, wu = tensor_val(g[1]), tensor_val(u[1])
        if wg.dtype != wu.dtype or tuple(wg.shape) != tuple(wu.shape):
            continue
        if not same_shape(tensor_val(mul), tensor_val(up)):
            continue  # the product broadcasts: not a gated MLP
        if _only_read_by(gate, gated) and _only_read_by(gated, mul) and _only_read_by(up, mul):
            return act, gate, gated, up
    return None


def _interleave(graph, a: torch.fx.Node, b: torch.fx.Node, meta: dict, name: str) -> torch.fx.Node:
    """``stack([a, b], 1)`` viewed with its first two dims merged: rows of ``a`` and ``b`` alternate."""
    av, bv = tensor_val(a), tensor_val(b)
    shape = [2 * av.shape[0], *av.shape[1:]]
    stacked = new_node(graph, aten.stack.default, ([a, b], 1),
                       fake(lambda s, t: aten.stack.default([s, t], 1), av, bv), meta)
    return new_node(graph, aten.view.default, (stacked, shape),
                    fake(lambda t: aten.view.default(t, shape), stacked.meta["val"]), meta, name)


def _fuse(graph: torch.fx.Graph, ep, mul, act: str, gate, gated, up) -> str:
    x, wg, bg = (*gate.args, None)[:3]
    _, wu, bu = (*up.args, None)[:3]
    with graph.inserting_before(mul):  # x and the weights are defined before both linears
        w = _interleave(graph, wg, wu, gate.meta, f"{gate.name}_glu_weight")
        b = None if bg is None else _interleave(graph, bg, bu, gate.meta, f"{gate.name}_glu_bias")
        val = fake(lambda xv, wv, *bv: ops.glu_linear(xv, wv, bv[0] if bv else None, act),
                   tensor_val(x), w.meta["val"], *([] if b is None else [b.meta["val"]]))
        node = new_node(graph, ops.glu_linear, (x, w, b, act), val, mul.meta)
    mul.replace_all_uses_with(node)
    for spec in ep.graph_signature.output_specs:  # a returned result keeps its signature entry
        if isinstance(spec.arg, TensorArgument) and spec.arg.name == mul.name:
            spec.arg = TensorArgument(name=node.name)
    for dead in (mul, gated, gate, up):  # users first
        graph.erase_node(dead)
    return (f"gated MLP {act}({gate.name}) * {up.name} -> {node.name} "
            f"(tritondelegate::glu_linear, one GEMM, N = 2x{tensor_val(wg).shape[0]})")


def fuse_glu(ep: torch.export.ExportedProgram, state: set[str] = frozenset()) -> list[str]:
    """Rewrite every gated MLP of ``ep``'s graph into one ``tritondelegate::glu_linear``, in place.
    ``state``: FQNs of program state, never treated as constants. Returns one description per rewrite;
    relies on constant folding to interleave the weights once."""
    graph = ep.graph_module.graph
    constants = set(constant_inputs(ep, set(state)))
    done = []
    for node in list(graph.nodes):
        found = _match(node, constants)
        if found is not None:
            done.append(_fuse(graph, ep, node, *found))
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done
