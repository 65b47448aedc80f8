"""Horizontal fusion of projections: linears that read the same input become one GEMM.

Attention's Q/K/V projections and a SwiGLU MLP's gate/up read one tensor ``x`` with constant
weights. Each is a launch that reads ``x`` again; one linear over the weights concatenated along the
output dim does the same work in one launch:

    q = linear(x, Wq[, bq])                 W = cat([Wq, Wk, Wv], 0)      (b = cat([bq, bk, bv]))
    k = linear(x, Wk[, bk])       ->        y = linear(x, W[, b])
    v = linear(x, Wv[, bv])                 q, k, v = split_with_sizes(y, [Nq, Nk, Nv], -1)

``q``, ``k``, ``v`` are then strided views of ``y`` (slices along its last dim, aliases at run time).
The ``cat`` of the weights depends on no method input, so constant folding (which runs next, and
without which this pass does not run) computes it once at lower time and stores only ``W``; an
original weight that nothing else reads is dropped then. One read elsewhere too (tied weights) is
kept, and stored next to ``W``.

A linear joins a group when its weight is a constant placeholder (parameter, buffer or lifted
constant that is not program state) of two dims, and its bias is absent or such a constant too; a
group shares ``x``, the weights' dtype and in-features, and whether there is a bias. A weight that
appears twice in a group (the same projection computed twice) is fused once only. A gated MLP's gate
and up projections are ``fuse_glu.py``'s (it runs first); other projections whose results one node
combines directly are left apart: see ``_combined``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .fold_constants import constant_inputs
from .rewrite import fake, new_node, same_shape, tensor_val

aten = torch.ops.aten

def linear_candidate(node: torch.fx.Node, constants: set[torch.fx.Node]):
    """(x, weight, bias or None) when ``node`` is a linear that may join a group, else None."""
    if node.op != "call_function" or node.target != aten.linear.default or node.kwargs:
        return None
    x, weight, bias = (*node.args, None)[:3]
    if not isinstance(x, torch.fx.Node) or weight not in constants:
        return None
    if bias is not None and bias not in constants:
        return None
    xv, wv, yv = tensor_val(x), tensor_val(weight), tensor_val(node)
    if xv is None or wv is None or yv is None or wv.ndim != 2 or xv.ndim < 1:
        return None
    if bias is not None:
        bv = tensor_val(bias)
        if bv is None or bv.ndim != 1 or bv.dtype != wv.dtype or bv.shape[0] != wv.shape[0]:
            return None
    if wv.dtype != xv.dtype or not isinstance(wv.shape[0], int) or not isinstance(wv.shape[1], int):
        return None
    return x, weight, bias


def _groups(graph: torch.fx.Graph, constants: set[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Linears by (x, dtype, in-features, has bias), in graph order; only groups of two or more."""
    groups: dict[tuple, list[torch.fx.Node]] = {}
    seen: dict[tuple, set] = {}
    for node in graph.nodes:
        found = linear_candidate(node, constants)
        if found is None:
            continue
        x, weight, bias = found
        wv = tensor_val(weight)
        key = (x, wv.dtype, wv.shape[1], bias is not None)
        if (weight, bias) in seen.setdefault(key, set()):
            continue  # the same projection twice: concatenating it would store the weight twice
        seen[key].add((weight, bias))
        groups.setdefault(key, []).append(node)
    return [g for g in groups.values() if len(g) >= 2 and _independent(g) and not _combined(g)]


def _combined(group: list[torch.fx.Node]) -> bool:
    """Whether one node combines two of the group's results, each reached directly or through
    single-input ops of the same shape (SwiGLU's ``silu(gate) * up``). Unfused, that product already
    runs in the epilogue of one of the two GEMMs (two launches, the intermediate never stored); fused,
    it would read two slices of the wide result in a launch of its own (two launches again, and the
    wide result written and read back): not worth it."""
    readers = [_elementwise_readers(n) for n in group]
    return any(readers[i] & readers[j] for i in range(len(group)) for j in range(i + 1, len(group)))


def _elementwise_readers(node: torch.fx.Node, depth: int = 4) -> set[torch.fx.Node]:
    """The nodes that read ``node``'s result, directly or through up to ``depth`` single-input ops
    that keep its shape (casts, activations); not the graph's output."""
    found, frontier = set(), [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for user in n.users:
                if user.op == "output" or user in found:
                    continue
                found.add(user)
                val, own = user.meta.get("val"), n.meta.get("val")
                if (len(user.all_input_nodes) == 1 and isinstance(val, torch.Tensor)
                        and isinstance(own, torch.Tensor) and same_shape(val, own)):
                    nxt.append(user)
        frontier = nxt
    return found


def _independent(group: list[torch.fx.Node]) -> bool:
    """No linear of the group reads another's output, directly or not. (Their operands are ``x`` and
    placeholders, so this holds by construction; checked to keep the rewrite safe if that changes.)"""
    members = set(group)
    seen, stack = set(), [a for n in group for a in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n in members:
            return False
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return True


def _fuse(graph: torch.fx.Graph, group: list[torch.fx.Node]) -> str:
    first = group[0]
    x = first.args[0]
    weights = [n.args[1] for n in group]
    biases = [n.args[2] for n in group] if len(first.args) > 2 and first.args[2] is not None else None
    sizes = [tensor_val(w).shape[0] for w in weights]
    xv = tensor_val(x)
    meta = first.meta
    # Before the first linear: its inputs (x and constants) are defined there, and every user of any
    # linear of the group comes after it (a user of the first may sit before a later linear).
    with graph.inserting_before(first):
        wvals = [tensor_val(w) for w in weights]
        cat = lambda *t: aten.cat.default(list(t), 0)  # noqa: E731
        # Named for the summary's list of what constant folding computed once.
        w = new_node(graph, aten.cat.default, (weights, 0), fake(cat, *wvals), meta, f"{first.name}_fused_weight")
        b = None
        if biases is not None:
            bvals = [tensor_val(n) for n in biases]
            b = new_node(graph, aten.cat.default, (biases, 0), fake(cat, *bvals), meta, f"{first.name}_fused_bias")
        if b is None:
            yval = fake(aten.linear.default, xv, w.meta["val"])
            y = new_node(graph, aten.linear.default, (x, w), yval, meta)
        else:
            yval = fake(aten.linear.default, xv, w.meta["val"], b.meta["val"])
            y = new_node(graph, aten.linear.default, (x, w, b), yval, meta)
        parts_val = fake(lambda t: aten.split_with_sizes.default(t, sizes, -1), yval)
        parts = new_node(graph, aten.split_with_sizes.default, (y, sizes, -1), tuple(parts_val), meta)
        outs = [new_node(graph, operator.getitem, (parts, i), parts_val[i], meta) for i in range(len(group))]
    names = [n.name for n in group]
    for old, new in zip(group, outs):
        old.replace_all_uses_with(new)
        graph.erase_node(old)
    return f"linear x{len(group)} -> one GEMM: {', '.join(names)} (N = {'+'.join(map(str, sizes))})"


def fuse_projections(ep: torch.export.ExportedProgram, state: set[str] = frozenset()) -> list[str]:
    """Fuse every group of linears that read the same input with constant weights, in place.
    ``state``: FQNs of program state (mutable buffers), never treated as constants. Returns one
    description per fused group. Relies on constant folding to concatenate the weights once."""
    graph = ep.graph_module.graph
    constants = set(constant_inputs(ep, set(state)))
    done = [_fuse(graph, group) for group in _groups(graph, constants)]
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done
