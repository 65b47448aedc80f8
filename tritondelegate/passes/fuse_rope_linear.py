"""The rotary embedding moves into the epilogue of the projection that produces the query and key.

After ``fuse_projections`` a layer computes its query, key and value with one linear, and
``fuse_rotary`` rotates the query and key with one ``rotary_pair`` (tables given, or computed from
angles): two launches, and the query and key written to memory, read back and written again between
them. Here both become one ``tritondelegate::rope_linear`` (``ops.py``): the same GEMM, whose epilogue
rotates the columns of the query and key heads before the store, so the views the graph took of the
projection (the split into q, k, v, the head view, the transpose) read rotated values directly:

    y = linear(x, W[, b])                        y = rope_linear(x, W[perm][, b[perm]], pairs, tables)
    q, k, v = views of y               ->        q, k, v = the same views of y
    q', k' = rotary_pair(q, k, tables)           (q', k' read as q, k)

Rotation mixes column c of a head with column c + D/2, which a GEMM tile only holds together when
the two are neighbours, so the weight's rows (and the bias) are permuted once, at lower time, into
pairs: ``pairs[p] = (column a, column b, table index of a, table index of b)`` says where the GEMM's
output columns 2p and 2p + 1 go and how they rotate (table index -1: a value column, stored as it
is). Which columns form pairs comes from the views themselves (their strides and offsets in ``y``,
from their fake values), so any head layout works: Q, K and V concatenated, heads interleaved
(GPT-NeoX's ``[heads, 3, D]``), rotation over part of a head (a partial rotary factor), grouped-query
attention with fewer key heads.

DeepSeek's rotary of the even and odd columns into halves (``deinterleave``: passes/halves_rotary.py)
is a rotation too: pair j of a head is computed from its columns 2j and 2j + 1 (the weight's rows in
that order) and stored at columns j and j + D/2, where the rotary's result has it. A rotary pair whose
q and k are views of two linears (DeepSeek's ``q_b_proj`` and ``kv_a_proj_with_mqa``) moves into both
epilogues when both can take it.

A rotary node is rewritten when: every tensor it rotates (of a pair over two linears: each of them) is
a chain of views of one linear whose weight (and bias) are constants; the views' rows are the linear's
rows in order (the tables index them by the result's leading indices); the tables do not vary per
head; the rotated columns are disjoint and nothing else reads them (other views of the linear may
read the value columns, or the rotated ones after the rotation only; a norm over the last dim off the
rotated chains, DeepSeek's ``kv_a_layernorm`` of its latent's columns, only the value columns); the
rotation keeps the linear's dtype; the linear's result is 2-D or 3-D with an even, static width. The
permuted weight is folded into one constant by ``lower()`` (the pass
runs only with constant folding); the pairs are a small int32 constant the kernel reads.
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch
import torch.fx

from .. import ops
from ..kernels import sizes, target
from .fold_constants import add_constant, constant_inputs, foldable_nodes
from .rewrite import fake, is_call, new_node, replace_node, tensor_val

aten = torch.ops.aten

# Ops whose result is a view of their (first) input: the rotated tensors are reached from the linear
# through these.
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.permute.default, aten.transpose.int,
         aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor, aten.select.int,
         aten.alias.default, aten.split_with_sizes.default, aten.split.Tensor, operator.getitem}
ROTARIES = {ops.rotary: 1, ops.rotary_angles: 1, ops.rotary_pair: 2, ops.rotary_pair_angles: 2}


def is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in VIEWS


def is_head_norm(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an RMSNorm over the last dim alone (Qwen3's and Gemma3's q_norm and k_norm,
    per head), which the epilogue can compute: a view for the layout, a norm for the values."""
    if not is_call(node, aten.rms_norm.default) or node.kwargs:
        return False
    val = tensor_val(node.args[0])
    shape = node.args[1]
    return val is not None and len(shape) == 1 and shape[0] == val.shape[-1]


def _linear_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The linear ``node`` is a chain of views of (through at most one per-head norm), or None."""
    norms = 0
    while is_view(node) or is_head_norm(node):
        norms += is_head_norm(node)
        node = node.args[0]
    return node if is_call(node, aten.linear.default) and norms <= 1 else None


def _norm_on(node: torch.fx.Node) -> torch.fx.Node | None:
    """The per-head norm on the chain from the linear to ``node``, or None."""
    while is_view(node) or is_head_norm(node):
        if is_head_norm(node):
            return node
        node = node.args[0]
    return None


def _replay(view: torch.fx.Node, base):
    """``view``'s value taken of ``base`` (a fake value), or None when the view does not apply to it."""
    args = torch.fx.node.map_arg(view.args[1:], lambda a: a.meta.get("val"))
    try:
        return fake(lambda v: view.target(v, *args), base)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None


def _view_closure(linear: torch.fx.Node):
    """(the views reachable from ``linear`` with their values replayed on the linear's (an earlier
    rewrite may have left a view's own ``val`` describing another base), (reader, what it reads) for
    every other node that reads the linear or one of them)."""
    vals, readers, stack = {linear: tensor_val(linear)}, [], [linear]
    while stack:
        node = stack.pop()
        for user in node.users:
            if is_head_norm(user) and user.args[0] is node:  # its result sits where its input sat
                vals[user] = vals[node]
                stack.append(user)
            elif is_view(user) and user.args[0] is node and (val := _replay(user, vals[node])) is not None:
                vals[user] = val
                stack.append(user)
            else:  # a reader of the whole of what it reads (a view that cannot replay is one too)
                readers.append((user, node))
    return vals, readers


def _layout(view: torch.Tensor, width: int):
    """How ``view`` (a fake view of a contiguous [..., width] result) sits in that result: (the columns
    it covers, an array over its column dims in order; those dims; its row dims as (dim, stride, size)),
    or None when it is not rows x columns of that result."""
    if not isinstance(view, torch.Tensor):
        return None
    offset = view.storage_offset()
    if not isinstance(offset, int) or offset >= width:
        return None
    cols, col_dims, rows = np.array(offset, dtype=np.int64), [], []
    for dim, (n, st) in enumerate(zip(view.shape, view.stride())):
        if isinstance(n, int) and n == 1:
            continue
        if not isinstance(st, int) or st >= width:  # a row step (over a dynamic size, or whole rows)
            if isinstance(st, int) and st % width:
                return None
            rows.append((dim, st, n))
        elif isinstance(n, int):
            cols = cols[..., None] + st * np.arange(n, dtype=np.int64)
            col_dims.append(dim)
        else:
            return None
    if cols.size and cols.max() >= width:
        return None
    return cols, col_dims, rows


def _row_dims(rows: list, y: torch.Tensor, width: int) -> tuple[int, int] | None:
    """(x's dim for the result's outer leading index, for its inner one; -1 where x has no such dim,
    its size being 1) when x's row dims walk the result's rows in order, else None."""
    lead = list(y.shape[:-1]) if y.dim() == 3 else [1, y.shape[0]]
    found = [-1, -1]
    for dim, st, n in rows:
        inner = sizes.shape([n]) == sizes.shape([lead[1]]) and isinstance(st, int) and st == width
        outer = sizes.shape([n]) == sizes.shape([lead[0]]) and sizes.shape([st]) == sizes.shape([lead[1] * width])
        role = 1 if inner else 0 if outer else None
        if role is None or found[role] != -1:
            return None
        found[role] = dim
    for role, n in enumerate(lead):
        if found[role] == -1 and not (isinstance(n, int) and n == 1):
            return None
    return found[0], found[1]


def _table_dims(x: torch.Tensor, table: torch.Tensor, rows: tuple[int, int], col_dims: list) -> list | None:
    """``cos_dims`` of ``rope_linear``: the table's dims that x's row dims ``rows`` index (-1 where the
    table broadcasts), or None when the table varies along a column dim other than x's last."""
    pad = x.dim() - table.dim()
    for d in col_dims[:-1]:
        if d - pad >= 0 and not (isinstance(table.shape[d - pad], int) and table.shape[d - pad] == 1):
            return None
    out = []
    for d in rows:
        td = d - pad if d >= 0 else -1
        if td < 0 or (isinstance(table.shape[td], int) and table.shape[td] == 1):
            out.append(-1)
        elif sizes.shape([table.shape[td]]) == sizes.shape([x.shape[d]]):
            out.append(td)
        else:
            return None
    return out


def _x_pairs(x: torch.Tensor, layout, y: torch.Tensor, width: int, tables: list, angles: bool,
             interleaved: bool = False, deinterleave: bool = False):
    """(the rotated pairs (column a, column b, index a, index b, source of a, source of b) of one rotated
    tensor, its cos_dims), or None. A head's pairs are its columns (j, j + D/2), or (2j, 2j + 1) when
    ``interleaved``, each computed from its own column; with ``deinterleave`` pair j is computed from
    columns (2j, 2j + 1) and stored at (j, j + D/2), where the rotary's result has it."""
    cols, col_dims, rows = layout
    e = x.shape[-1]
    if not col_dims or col_dims[-1] != x.dim() - 1 or not isinstance(e, int) or e % 2:
        return None
    rows = _row_dims(rows, y, width)
    if rows is None:
        return None
    dims = [_table_dims(x, t, rows, col_dims) for t in tables]
    want = e // 2 if angles else e
    if None in dims or any(d != dims[0] for d in dims) or any(t.shape[-1] != want for t in tables):
        return None
    half = e // 2
    heads = cols.reshape(-1, e)
    if interleaved:  # a pair's angle is j; its tables' columns are 2j and 2j + 1
        pairs = [(int(h[2 * j]), int(h[2 * j + 1]), j if angles else 2 * j, j if angles else 2 * j + 1)
                 for h in heads for j in range(half)]
    else:
        pairs = [(int(h[j]), int(h[j + half]), j, j if angles else j + half) for h in heads for j in range(half)]
    if deinterleave:
        sources = [(int(h[2 * j]), int(h[2 * j + 1])) for h in heads for j in range(half)]
    else:
        sources = [p[:2] for p in pairs]
    return [p + s for p, s in zip(pairs, sources)], dims[0]


def _constant_weights(linear: torch.fx.Node, foldable: set) -> bool:
    """Whether the linear's weight (2-D, its input's dtype) and bias are constants, or computed from
    them (``fuse_projections``' concatenation): in ``foldable`` (``fold_constants.foldable_nodes``)."""
    x, w, bias = (*linear.args, None)[:3]
    xv, wv = tensor_val(x), tensor_val(w)
    return (xv is not None and wv is not None and wv.dim() == 2 and wv.dtype == xv.dtype and not linear.kwargs
            and w in foldable and (bias is None or bias in foldable))


def _tables_of(rotary: torch.fx.Node) -> tuple:
    """(tables, scale, dtype, angles) of a rotary node: [cos, sin], 1.0, None, False when given, or
    [angles], its scale and rounding dtype, True."""
    rest = rotary.args[ROTARIES[rotary.target]:]
    if rotary.target in (ops.rotary_angles, ops.rotary_pair_angles):
        return [rest[0]], rest[1], rest[2], True
    return [rest[0], rest[1]], 1.0, None, False


def _plan(group: list, foldable: set, linear: torch.fx.Node | None = None) -> dict | None:
    """What rewriting the rotary nodes ``group`` (one linear's, over the same tables) into their
    linear takes, or None when it may not be (``foldable``: what constant folding computes). With
    ``linear``, only the tensors they rotate that are views of it (a pair whose q and k are two
    projections' results: DeepSeek's q_b_proj and kv_a_proj_with_mqa)."""
    xs = [x for rotary in group for x in rotary.args[:ROTARIES[rotary.target]]
          if linear is None or _linear_of(x) is linear]
    linear = _linear_of(xs[0]) if xs else None
    if linear is None or any(_linear_of(x) is not linear for x in xs) or not _constant_weights(linear, foldable):
        return None
    y = tensor_val(linear)
    width = y.shape[-1]
    outs = [o for rotary in group for o in torch.utils._pytree.tree_leaves(rotary.meta.get("val"))]
    if (y.dim() not in (2, 3) or not isinstance(width, int) or width % 2
            or any(not isinstance(o, torch.Tensor) or o.dtype != y.dtype for o in outs)):
        return None
    tables, scale, dtype, angles = _tables_of(group[0])
    interleaved = group[0].kwargs.get("interleaved", False)
    deinterleave = group[0].kwargs.get("deinterleave", False)
    if any(rotary.kwargs != group[0].kwargs for rotary in group) or "out_dtype" in group[0].kwargs:
        return None  # fp32 rotary math cast back (out_dtype): the epilogue computes as the linear's dtype does
    table_vals = [tensor_val(t) for t in tables]
    if None in table_vals or any(tv.shape != table_vals[0].shape for tv in table_vals):
        return None
    vals, readers = _view_closure(linear)
    normed, plain, cos_dims, norms = [], [], None, {}
    for x in xs:
        layout = _layout(vals[x], width)
        found = None if layout is None else _x_pairs(vals[x], layout, y, width, table_vals, angles, interleaved,
                                                     deinterleave)
        if found is None or (cos_dims is not None and found[1] != cos_dims):
            return None
        cos_dims = found[1]
        norm = _norm_on(x)
        if norm is not None:
            if (interleaved or deinterleave or not _norm_fits(norm, x, vals, width, foldable)
                    or not _fills_gpu(y, tensor_val(x).shape[-1])):
                return None
            norms[norm] = x
        (normed if norm is not None else plain).append((norm, found[0]))
    if len({norm_eps(n, y.dtype) for n in norms}) > 1:
        return None  # norms that differ in eps
    rotated = [p for _, found in normed + plain for p in found]
    taken = [c for p in rotated for c in p[:2]]
    if len(set(taken)) != len(taken) or not _others_clear(readers, vals, group, xs, set(taken), width):
        return None
    off_chains = [(n, n.args[0]) for n in vals if is_head_norm(n) and n not in norms]  # each reads its input
    if not _others_clear(off_chains, vals, (), (), set(taken), width):
        return None  # a norm of rotated columns off the rotated chains
    rest_cols = sorted(set(range(width)) - set(taken))
    pairs = rotated + [(a, b, -1, -1, a, b) for a, b in zip(rest_cols[0::2], rest_cols[1::2])]
    half = tensor_val(xs[0]).shape[-1] // 2
    norm_cols = [((*norm.args, None)[2], i % half) for norm, found in normed for i in range(len(found))]
    return dict(linear=linear, tables=tables, scale=float(scale), dtype=dtype, cos_dims=cos_dims,
                pairs=[p[:4] for p in pairs], sources=[c for p in pairs for c in p[4:]], norms=list(norms),
                norm_cols=norm_cols, eps=norm_eps(next(iter(norms)), y.dtype) if norms else 0.0, half=half)


def norm_eps(norm: torch.fx.Node, dtype: torch.dtype) -> float:
    eps = norm.args[3] if len(norm.args) > 3 else None
    return float(torch.finfo(dtype).eps if eps is None else eps)


def _fills_gpu(y: torch.Tensor, head: int) -> bool:
    """Whether tiles of whole heads (the per-head norm's) still give every SM of the target a program:
    at decode (a few rows, one row tile) a projection has only as many heads as tiles, e.g. 48 for
    Qwen3-8B's q, k and v on an H100's 132 SMs, which would stream its weight at a third of the
    bandwidth; the norms then stay two launches of their own and the rotary with them."""
    rows = sizes.upper(math.prod(y.shape[:-1]))
    gpu = target.current()
    row_tiles = 1 if rows <= gpu.gemv_rows else -(-rows // 64)
    return row_tiles * (y.shape[-1] // head) >= gpu.num_sms


def _norm_fits(norm: torch.fx.Node, x: torch.fx.Node, vals: dict, width: int, foldable: set) -> bool:
    """Whether the epilogue can compute the per-head norm on x's chain: x rotates whole heads of the
    norm (the same columns), of a power-of-two size, with a constant weight (or none)."""
    e = tensor_val(x).shape[-1]
    weight = norm.args[2] if len(norm.args) > 2 else None
    if e & (e - 1) or (weight is not None and weight not in foldable):
        return False
    before, after = _layout(vals[norm.args[0]], width), _layout(vals[x], width)
    return before is not None and set(before[0].reshape(-1).tolist()) == set(after[0].reshape(-1).tolist())


def _others_clear(readers, vals, group, xs, taken: set, width: int) -> bool:
    """Whether nothing but the rotary nodes ``group`` read a rotated column of the linear."""
    for reader, read in readers:
        if reader in group and read in xs:
            continue
        layout = _layout(vals[read], width)
        if layout is None or taken & set(layout[0].reshape(-1).tolist()):
            return False
    return True


def _placement(graph: torch.fx.Graph, linear: torch.fx.Node, inputs: list):
    """(the node after which the fused node may stand: the last of ``linear`` and ``inputs``; the
    nodes between that read the linear's result and must move after the fused node), or None when a
    table is itself computed from the linear's result."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max([linear, *inputs], key=lambda n: order.get(n, -1))
    reaches, moved = {linear}, []
    for n in graph.nodes:
        if order[linear] < order[n] < order[anchor] and any(a in reaches for a in n.all_input_nodes):
            if n in inputs:
                return None
            reaches.add(n)
            moved.append(n)
    return anchor, moved


def _norm_weights(ep, plan: dict, dtype: torch.dtype, meta: dict) -> torch.fx.Node | None:
    """The per-head norms' weights for the normed pairs, (a, b) each, in the pairs' order: one
    ``index_select`` of the weights concatenated (ones for a norm without one), folded by ``lower()``."""
    if not plan["norm_cols"]:
        return None
    graph, half = ep.graph_module.graph, plan["half"]
    sources, offsets, index = [], {}, []
    for weight, j in plan["norm_cols"]:
        if weight not in offsets:
            offsets[weight] = sum(tensor_val(w).shape[0] if w is not None else 2 * half for w in sources)
            sources.append(weight)
        index += [offsets[weight] + j, offsets[weight] + j + half]
    nodes = [w if w is not None else add_constant(ep, torch.ones(2 * half, dtype=dtype), "_rope_norm_ones")
             for w in sources]
    order = add_constant(ep, torch.tensor(index, dtype=torch.int64), "_rope_norm_order")
    vals = [tensor_val(n) for n in nodes]
    cat = new_node(graph, aten.cat.default, (nodes, 0), fake(lambda *t: aten.cat.default(list(t), 0), *vals), meta)
    return new_node(graph, aten.index_select.default, (cat, 0, order),
                    fake(lambda t, i: aten.index_select.default(t, 0, i), cat.meta["val"], order.meta["val"]), meta)


def _rewrite_linear(ep, plan: dict) -> torch.fx.Node:
    """The plan's linear replaced by its ``rope_linear`` (placed by :func:`_placement`, checked first)."""
    graph = ep.graph_module.graph
    linear = plan["linear"]
    at, moved = _placement(graph, linear, _inputs(plan))
    x, w, bias = (*linear.args, None)[:3]
    perm = torch.tensor(plan["sources"], dtype=torch.int64)  # GEMM column 2p + i computes source i of pair p
    perm_node = add_constant(ep, perm, "_rope_order")
    pairs_node = add_constant(ep, torch.tensor(plan["pairs"], dtype=torch.int32), "_rope_pairs")
    select = lambda t, i: aten.index_select.default(t, 0, i)  # noqa: E731
    with graph.inserting_before(at.next):  # in this order, right after the last input
        w2 = new_node(graph, aten.index_select.default, (w, 0, perm_node),
                      fake(select, tensor_val(w), perm_node.meta["val"]), linear.meta, f"{linear.name}_rope_weight")
        b2 = None if bias is None else new_node(graph, aten.index_select.default, (bias, 0, perm_node),
                                                fake(select, tensor_val(bias), perm_node.meta["val"]), linear.meta)
        tables = plan["tables"] + [None] * (2 - len(plan["tables"]))
        norm_w = _norm_weights(ep, plan, tensor_val(linear).dtype, linear.meta)
        node = new_node(graph, ops.rope_linear, (x, w2, b2, pairs_node, *tables, plan["cos_dims"], plan["scale"],
                                                 plan["dtype"], norm_w, 2 * plan["half"] if norm_w else 0,
                                                 plan["eps"]), linear.meta["val"], linear.meta)
    last = node
    for n in moved:  # what read the linear before the tables were computed, after the fused node
        last.append(n)
        last = n
    linear.replace_all_uses_with(node)
    graph.erase_node(linear)
    for norm in plan["norms"]:  # computed in the epilogue: its readers read its input's views
        norm.replace_all_uses_with(norm.args[0])
        graph.erase_node(norm)
    return node


def _inputs(plan: dict) -> list:
    weights = [w for w, _ in plan["norm_cols"]]  # a norm's weight may be computed (Gemma's 1 + w)
    return [t for t in plan["tables"] + weights if isinstance(t, torch.fx.Node)]


def _rewrite(ep, group: list, plans: list) -> str | None:
    """The rotary nodes ``group`` computed in the epilogues of the linears of ``plans`` (one, or two:
    a pair's q and k from two projections); they read the rotated views of the linears' results."""
    graph = ep.graph_module.graph
    if any(_placement(graph, plan["linear"], _inputs(plan)) is None for plan in plans):
        return None  # a table computed from a linear's result
    nodes = [_rewrite_linear(ep, plan) for plan in plans]
    names = [rotary.name for rotary in group]
    for rotary in group:
        xs = rotary.args[:ROTARIES[rotary.target]]
        getitems = [u for u in rotary.users if is_call(u, operator.getitem)]
        for old, new in [(g, xs[g.args[1]]) for g in getitems] or [(rotary, xs[0])]:
            replace_node(ep, old, new)  # a returned result: the method returns the rotated view
            if old is not rotary:
                graph.erase_node(old)
        graph.erase_node(rotary)
    rotated = sum(p[2] >= 0 for plan in plans for p in plan["pairs"]) * 2
    columns = sum(len(plan["pairs"]) * 2 for plan in plans)
    return (f"rotary in the epilogue: {', '.join(names)} -> {', '.join(n.name for n in nodes)} "
            f"(tritondelegate::rope_linear, {rotated} of {columns} columns rotated, "
            f"{len(group) + len(nodes)} launches -> {len(nodes)})")


def _two_linears(rotary: torch.fx.Node) -> list | None:
    """The two linears a rotary pair's q and k are views of, when they differ, else None."""
    if ROTARIES[rotary.target] != 2:
        return None
    linears = [_linear_of(x) for x in rotary.args[:2]]
    return linears if None not in linears and linears[0] is not linears[1] else None


def fuse_rope_linear(ep: torch.export.ExportedProgram, state: set[str] = frozenset()) -> list[str]:
    """Move every rotary whose inputs are views of one projection into that projection's epilogue, in
    place (a pair whose q and k are views of two projections into both epilogues). ``state``: FQNs of
    program state, never treated as constants. Relies on constant folding to permute the weights once.
    Returns one description per rewrite."""
    graph = ep.graph_module.graph
    foldable = foldable_nodes(graph, constant_inputs(ep, set(state)))
    groups: dict[tuple, list] = {}
    split = []
    for rotary in [n for n in graph.nodes if n.op == "call_function" and n.target in ROTARIES]:
        if _two_linears(rotary):
            split.append(rotary)
            continue
        tables, scale, dtype, angles = _tables_of(rotary)
        groups.setdefault((_linear_of(rotary.args[0]), *tables, scale, dtype, angles), []).append(rotary)
    done = []
    for (linear, *_), group in groups.items():
        plan = None if linear is None else _plan(group, foldable)
        described = None if plan is None else _rewrite(ep, group, [plan])
        if described:
            done.append(described)
    for rotary in split:
        plans = [_plan([rotary], foldable, linear) for linear in _two_linears(rotary)]
        described = None if None in plans else _rewrite(ep, [rotary], plans)
        if described:
            done.append(described)
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done
