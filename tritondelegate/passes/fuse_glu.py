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

Phi-3 (and models that store gate and up as one ``gate_up_proj``) write the two projections as one
linear split in halves along its last dim (``y.chunk(2, -1)``: ``split_with_sizes`` and two
``getitem``); the gate is either half. Then ``Wg`` and ``Wu`` are the two halves of the weight's rows
(and of the bias), sliced and interleaved once by constant folding in the same way.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import ops
from .fold_constants import constant_inputs
from .fuse_projections import linear_candidate
from ..kernels.rows import node_arg
from .rewrite import fake, is_call, new_node, replace_node, rewrite_matches, same_shape, tensor_val

aten = torch.ops.aten


def glu_act(node) -> str | None:
    """The GLU activation name (``ops.GLU_ACTS``) ``node`` computes on its one tensor input, or None."""
    if is_call(node, aten.silu.default):
        return "silu"
    if is_call(node, aten.relu.default):
        return "relu"
    if is_call(node, aten.gelu.default):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


def only_read_by(node: torch.fx.Node, reader: torch.fx.Node) -> bool:
    return list(node.users) == [reader]


def split_halves(gate: torch.fx.Node, up: torch.fx.Node):
    """(the split tensor, index of the gate's half) when ``gate`` and ``up`` are the two halves of one
    result split along its last dim (``chunk(2, -1)``), the split read by nothing else; else None."""
    if not (is_call(gate, operator.getitem) and is_call(up, operator.getitem)) or gate.args[0] is not up.args[0]:
        return None
    split, index = gate.args[0], gate.args[1]
    if not is_call(split, aten.split_with_sizes.default, aten.split.Tensor) or {index, up.args[1]} != {0, 1}:
        return None
    source, val = split.args[0], tensor_val(split.args[0])
    if val is None or val.dim() == 0 or not isinstance(val.shape[-1], int) or val.shape[-1] % 2:
        return None
    half, dim, parts = val.shape[-1] // 2, node_arg(split, 2, "dim", 0), split.args[1]
    if dim % val.dim() != val.dim() - 1 or parts not in (half, [half, half]) or len(split.users) != 2:
        return None
    if list(source.users) != [split]:
        return None
    return source, index


def _halves(gate: torch.fx.Node, up: torch.fx.Node, constants: set[torch.fx.Node]):
    """(linear, index of the gate's half) when ``gate`` and ``up`` are the two halves of one linear's
    result (:func:`split_halves`); else None."""
    halves = split_halves(gate, up)
    if halves is None or linear_candidate(halves[0], constants) is None:
        return None
    return halves


def _match(mul: torch.fx.Node, constants: set[torch.fx.Node]):
    """(act name, gate linear, activation node, up linear) when ``mul`` is the root of a gated MLP;
    for one linear split in halves, (act name, gate half, activation node, up half)."""
    if not is_call(mul, aten.mul.Tensor) or len(mul.args) != 2 or mul.kwargs:
        return None
    for gated, up in (mul.args, mul.args[::-1]):
        act = glu_act(gated)
        if act is None or up is gated or not isinstance(up, torch.fx.Node):
            continue  # (the other operand may be a Python scalar)
        gate = gated.args[0]
        halves = _halves(gate, up, constants)
        if halves is not None and same_shape(tensor_val(mul), tensor_val(up)):
            if only_read_by(gate, gated) and only_read_by(gated, mul) and only_read_by(up, mul):
                return act, gate, gated, up
        g, u = linear_candidate(gate, constants), linear_candidate(up, constants)
        if g is None or u is None or gate is up or g[0] is not u[0] or (g[2] is None) != (u[2] is None):
            continue
        wg, wu = tensor_val(g[1]), tensor_val(u[1])
        if wg.dtype != wu.dtype or tuple(wg.shape) != tuple(wu.shape):
            continue
        if not same_shape(tensor_val(mul), tensor_val(up)):
            continue  # the product broadcasts: not a gated MLP
        if only_read_by(gate, gated) and only_read_by(gated, mul) and only_read_by(up, mul):
            return act, gate, gated, up
    return None


def interleave(graph, a: torch.fx.Node, b: torch.fx.Node, dim: int, meta: dict, name: str) -> torch.fx.Node:
    """``stack([a, b], dim + 1)`` viewed with dims ``dim`` and ``dim + 1`` merged: the entries of ``a``
    and ``b`` alternate along ``dim`` (rows for 0)."""
    av, bv = tensor_val(a), tensor_val(b)
    shape = [*av.shape[:dim], 2 * av.shape[dim], *av.shape[dim + 1:]]
    stacked = new_node(graph, aten.stack.default, ([a, b], dim + 1),
                       fake(lambda s, t: aten.stack.default([s, t], dim + 1), av, bv), meta)
    return new_node(graph, aten.view.default, (stacked, shape),
                    fake(lambda t: aten.view.default(t, shape), stacked.meta["val"]), meta, name)


def span(graph, t: torch.fx.Node, dim: int, start: int, end: int, meta: dict) -> torch.fx.Node:
    """Entries [start, end) of ``t`` along ``dim`` (a slice node)."""
    return new_node(graph, aten.slice.Tensor, (t, dim, start, end),
                    fake(lambda v: aten.slice.Tensor(v, dim, start, end), tensor_val(t)), meta)


def _split_weights(graph, gate: torch.fx.Node, mul: torch.fx.Node):
    """(x, wg, bg, wu, bu, dead nodes) for a gate and an up that are halves of one linear."""
    split = gate.args[0]
    linear, index = split.args[0], gate.args[1]
    x, w, b = (*linear.args, None)[:3]
    n = tensor_val(w).shape[0] // 2
    spans = ((0, n), (n, 2 * n)) if index == 0 else ((n, 2 * n), (0, n))
    with graph.inserting_before(mul):
        wg, wu = (span(graph, w, 0, *rows, linear.meta) for rows in spans)
        bg, bu = (None, None) if b is None else (span(graph, b, 0, *rows, linear.meta) for rows in spans)
    return x, wg, bg, wu, bu, [split, linear]


def _fuse(graph: torch.fx.Graph, ep, mul, act: str, gate, gated, up) -> str:
    if is_call(gate, operator.getitem):  # halves of one linear
        x, wg, bg, wu, bu, dead = _split_weights(graph, gate, mul)
    else:
        x, wg, bg = (*gate.args, None)[:3]
        _, wu, bu = (*up.args, None)[:3]
        dead = []
    with graph.inserting_before(mul):  # x and the weights are defined before both linears
        w = interleave(graph, wg, wu, 0, gate.meta, f"{gate.name}_glu_weight")
        b = None if bg is None else interleave(graph, bg, bu, 0, gate.meta, f"{gate.name}_glu_bias")
        val = fake(lambda xv, wv, *bv: ops.glu_linear(xv, wv, bv[0] if bv else None, act),
                   tensor_val(x), w.meta["val"], *([] if b is None else [b.meta["val"]]))
        node = new_node(graph, ops.glu_linear, (x, w, b, act), val, mul.meta)
    replace_node(ep, mul, node)
    for old in (mul, gated, gate, up, *dead):  # users first
        graph.erase_node(old)
    return (f"gated MLP {act}({gate.name}) * {up.name} -> {node.name} "
            f"(tritondelegate::glu_linear, one GEMM, N = 2x{tensor_val(wg).shape[0]})")


def fuse_glu(ep: torch.export.ExportedProgram, state: set[str] = frozenset()) -> list[str]:
    """Rewrite every gated MLP of ``ep``'s graph into one ``tritondelegate::glu_linear``, in place.
    ``state``: FQNs of program state, never treated as constants. Returns one description per rewrite;
    relies on constant folding to interleave the weights once."""
    constants = set(constant_inputs(ep, set(state)))
    return rewrite_matches(ep, lambda node: _match(node, constants), _fuse)
