"""A Mixture-of-Experts layer's dispatch in fewer launches: the bookkeeping around its grouped GEMMs.

transformers sends each token to its k experts (``grouped_mm_experts_forward``) as

    ids, perm = sort(top_k_index.view(-1))                    the (token, slot) pairs by expert
    x_g = hidden[perm // k]                                   (1) each pair's token row, gathered
    offs = cumsum(histc(ids.float(), E, 0, E - 1), 0, dtype)  (2) rows per expert, running sums
    y = grouped_mm(x_g, W, offs) ...                          the experts
    inv = empty_like(perm); inv[perm] = arange(S)             (3) the inverse order,
    y = y[inv]                                                    and the rows put back by it

six launches besides the GEMMs. Three rewrites make them two, and a fourth (7. below) one:

1. **Rows read in place**: a grouped GEMM (``glu_grouped_mm``, ``grouped_mm_fallback``,
   ``aten._grouped_mm``) whose input is ``index(hidden, [i])`` read by nothing else reads ``hidden``
   through ``i`` in its loads (``rows``), and when ``i = floor_divide(perm, k)`` (read by nothing else)
   through ``perm`` and k (``rows_divisor``): ``glu_grouped_mm(..., rows=perm, rows_divisor=k)`` or
   ``tritondelegate::gathered_grouped_mm``. The gathered rows are never written.
2. **Offsets in one launch**: ``cumsum(histc(x), 0)``, the counts read by nothing else, becomes
   ``tritondelegate::cumulative_histc`` (each program counts the elements of bins up to its own),
   and a plain cast of x to fp32 read only by the histc runs in its loads (``cast``). Only where the
   kernel takes it: counts below 2^24, so that fp32 running sums are exact, as eager's are.
3. **Unsort as a scatter**: ``y[inv]`` with ``inv = index_put(empty, [perm], arange(S))`` and
   ``perm`` the indices of a 1-D ``sort`` (a permutation of 0..S-1, so inv is its inverse) is
   ``index_put(empty_like(y), [perm], y)``: row r of y goes to row perm[r], one launch instead of two.

Then the down GEMM stores its rows in token order (4.), the experts' biases are read in the GEMMs (5.),
GPT-OSS's gating runs in gate/up's tile (6.), and last (the others match the sort itself):

7. **Order and offsets in one launch**: ``cumulative_histc`` of a 1-D ``sort``'s values, and the sort,
   become ``tritondelegate::sort_offsets`` (values, indices, offsets): one kernel ranks the ids as the
   sort's kernel does and counts them as the histogram's does (the counts do not depend on the order),
   so the results are the two launches'. Only where the kernel takes both (``kernels/sort_offsets.py``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import ops
from ..ops import CLAMPED_SWIGLU
from ..kernels import grouped_mm as gmm
from ..kernels import histogram as hist
from ..kernels import sizes
from ..kernels import sort_offsets as so
from ..kernels.creation import is_empty
from ..kernels.registry import external_name
from ..kernels.rows import node_arg
from .fuse_glu import only_read_by
from .fuse_grouped_glu import FALLBACK
from .rewrite import (erase_unused, fake, is_call, is_number, new_node, number_operand, plain_cast, replace_node,
                      rewrite_matches, same_shape, slice_bounds, static_int, tensor_val)

aten = torch.ops.aten
INDEX_DTYPES = (torch.int64, torch.int32)


# --- 1. a grouped GEMM reads its rows through the token order ------------------------------------
def _gathered(x) -> tuple | None:
    """(hidden, rows, divisor) when ``x`` is ``index(hidden, [rows // divisor])`` (divisor 1: rows
    as they are) over a 2-D ``hidden``; else None."""
    if not is_call(x, aten.index.Tensor) or len(x.args) != 2 or len(x.args[1]) != 1:
        return None
    hidden, (i,) = x.args
    if tensor_val(hidden) is None or tensor_val(hidden).dim() != 2:
        return None
    if tensor_val(i) is None or tensor_val(i).dim() != 1 or tensor_val(i).dtype not in INDEX_DTYPES:
        return None
    divided = _floor_divided(i)
    return (hidden, *divided) if divided is not None and only_read_by(i, x) else (hidden, i, 1)


def _floor_divided(i) -> tuple | None:
    """(rows, divisor) when ``i`` is ``div(rows, divisor, rounding_mode="floor")`` by a positive int."""
    if not is_call(i, aten.div.Tensor_mode, aten.div.Scalar_mode) or node_arg(i, 2, "rounding_mode") != "floor":
        return None
    rows, divisor = i.args[0], static_int(i.args[1])
    if divisor is None or divisor < 1 or tensor_val(rows) is None or tensor_val(rows).dtype not in INDEX_DTYPES:
        return None
    return rows, divisor


def _grouped_input(node) -> torch.fx.Node | None:
    """The input of a grouped GEMM the kernel takes with its rows gathered; else None."""
    if is_call(node, ops.glu_grouped_mm):
        given = len(node.args) > 4 or node.kwargs
        return None if given or gmm.supported_glu(node) is not None else node.args[0]
    if is_call(node, aten._grouped_mm.default) or external_name(getattr(node, "target", None)) == FALLBACK:
        return gmm.operands(node)[0] if gmm.supported(node) is None else None
    return None


def _match_rows(node) -> tuple | None:
    x = _grouped_input(node)
    if x is None or not only_read_by(x, node):
        return None
    found = _gathered(x)
    return None if found is None else (x, *found)


def _read_rows(graph, ep, node, x, hidden, rows, divisor) -> str:
    if is_call(node, ops.glu_grouped_mm):
        target, kind = ops.glu_grouped_mm, "glu_grouped_mm"
        args = (hidden, *node.args[1:4], rows, divisor)
    else:
        target, kind = ops.gathered_grouped_mm, "gathered_grouped_mm"
        args = (hidden, rows, divisor, *gmm.operands(node)[1:3])
    with graph.inserting_before(node):
        val = fake(target, *(tensor_val(a) if isinstance(a, torch.fx.Node) else a for a in args))
        new = new_node(graph, target, args, val, node.meta)
    replace_node(ep, node, new)
    graph.erase_node(node)
    erase_unused(graph, [x])
    source = f"{rows.name} // {divisor}" if divisor != 1 else rows.name
    return (f"expert rows read in place: {hidden.name} at {source} -> {new.name} "
            f"(tritondelegate::{kind}, no gathered copy)")


# --- 2. the offsets per expert in one launch ------------------------------------------------------
def _match_offsets(node) -> tuple | None:
    if not is_call(node, aten.cumsum.default) or node_arg(node, 1, "dim") not in (0, -1):
        return None
    counts = node.args[0]
    if not is_call(counts, aten.histc.default) or not only_read_by(counts, node) or tensor_val(counts).dim() != 1:
        return None
    bins, low, high = hist._arguments(counts)
    x, cast = counts.args[0], None
    src = plain_cast(x)
    if src is not None and tensor_val(x).dtype == torch.float32 and only_read_by(x, counts):
        x, cast = src, torch.float32
    dtype = tensor_val(node).dtype
    if hist.cumulative_refusal(tensor_val(x), bins, low, high, cast, dtype) is not None:
        return None
    return counts, x, (bins, float(low), float(high), cast, dtype)


def _offsets(graph, ep, node, counts, x, args) -> str:
    with graph.inserting_before(node):
        val = fake(lambda v: ops.cumulative_histc(v, *args), tensor_val(x))
        new = new_node(graph, ops.cumulative_histc, (x, *args), val, node.meta)
    replace_node(ep, node, new)
    graph.erase_node(node)
    erase_unused(graph, [counts])
    cast = ", its fp32 cast in the loads" if args[3] is not None else ""
    return (f"expert offsets in one launch: {node.name} = cumsum({counts.name}){cast} -> {new.name} "
            f"(tritondelegate::cumulative_histc)")


# --- 3. the rows put back in token order by one scatter -------------------------------------------
def _sort_indices(perm) -> bool:
    """Whether ``perm`` is the indices result of a ``sort`` of a 1-D tensor (a permutation)."""
    if not is_call(perm, operator.getitem) or perm.args[1] != 1:
        return False
    sort = perm.args[0]
    if not is_call(sort, aten.sort.default, aten.sort.stable):
        return False
    return tensor_val(sort.args[0]) is not None and tensor_val(sort.args[0]).dim() == 1


def _counting(ar, n) -> bool:
    """Whether ``ar`` is ``arange(n)`` (0, 1, ..., n - 1) for the length ``n`` of a 1-D tensor."""
    if is_call(ar, aten.arange.default):
        start, step = 0, 1
    elif is_call(ar, aten.arange.start, aten.arange.start_step):
        start, step = ar.args[0], (ar.args[2] if len(ar.args) > 2 else 1)
    else:
        return False
    val = tensor_val(ar)
    return start == 0 and step == 1 and val.dim() == 1 and sizes.shape(val.shape) == sizes.shape((n,))


def _match_unsort(node) -> tuple | None:
    if not is_call(node, aten.index.Tensor) or len(node.args) != 2 or len(node.args[1]) != 1:
        return None
    y, (inv,) = node.args
    if not is_call(inv, aten.index_put.default) or node_arg(inv, 3, "accumulate", False):
        return None
    dest, indices, values = inv.args[:3]
    if not is_empty(dest) or len(indices) != 1 or not _sort_indices(indices[0]):
        return None
    perm = indices[0]
    n = tensor_val(perm).shape[0]
    if not _counting(values, n) or tensor_val(y) is None or tensor_val(y).dim() < 1:
        return None
    if sizes.shape(tensor_val(y).shape[:1]) != sizes.shape((n,)):
        return None
    return y, inv, perm


def _unsort(graph, ep, node, y, inv, perm) -> str:
    with graph.inserting_before(node):
        dest = new_node(graph, aten.empty_like.default, (y,), fake(torch.empty_like, tensor_val(y)), node.meta)
        val = fake(lambda d, p, v: aten.index_put(d, [p], v), tensor_val(dest), tensor_val(perm), tensor_val(y))
        new = new_node(graph, aten.index_put.default, (dest, [perm], y), val, node.meta)
    replace_node(ep, node, new)
    graph.erase_node(node)
    erase_unused(graph, [inv])
    return f"expert unsort as one scatter: {y.name} rows to {perm.name} -> {new.name} (no inverse order)"


# --- 4. the experts' rows stored in token order -----------------------------------------------------
CHAIN_DEPTH = 4  # pointwise ops between the grouped GEMM and the scatter (the kernel's epilogue steps)


def _sort_of(node, item: int):
    """The ``sort`` node whose result ``item`` (0: values, 1: indices) ``node`` is; else None."""
    ok = is_call(node, operator.getitem) and node.args[1] == item and is_call(node.args[0], aten.sort.default,
                                                                               aten.sort.stable)
    return node.args[0] if ok else None


def _rows_of(node):
    """The first size of ``node``'s value (None without one)."""
    val = tensor_val(node)
    return None if val is None or val.dim() == 0 else sizes.shape(val.shape[:1])


def _token_order(o, perm, rows) -> tuple | None:
    """How the rewrite reads operand ``o`` of a pointwise op over the experts' rows once the rows are
    in token order: (source, views) with the views (``unsqueeze``, ``view``, ``reshape``, a cast; each
    keeps row r at row r) replayed over the source, outermost last; None when it cannot. A number, or
    a tensor the same for every row, stays as it is; ``w[perm]`` (the routing weights gathered into the
    experts' order) is ``w``; ``b[ids]`` with ids the sort's values is ``b[keys]`` (``("keys", b, keys)``:
    ids[r] = keys[perm[r]])."""
    if is_number(o):
        return o, []
    val = tensor_val(o)
    if val is None or val.dim() > 2:
        return None
    if val.dim() < 2 or _rows_of(o) == sizes.shape((1,)):
        return o, []  # broadcast over the rows
    views = []
    while _rows_of(o) == rows:
        if is_call(o, aten.index.Tensor) and len(o.args[1]) == 1:
            (i,) = o.args[1]
            if i is perm and _rows_of(o.args[0]) == rows:
                return o.args[0], views[::-1]
            sort = _sort_of(i, 0)
            if sort is not None and sort is _sort_of(perm, 1):
                return ("keys", o.args[0], sort.args[0], o), views[::-1]
        if not (is_call(o, aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._to_copy.default)
                and isinstance(o.args[0], torch.fx.Node)):
            return None
        views.append(o)
        o = o.args[0]
    return None


def _chain_to(v, readers, depth) -> list | None:
    """[gemm, op, ..., v]: ``v`` is a grouped GEMM, or a pointwise op on a chain from one, each read
    only by the next (``v`` only by ``readers``); else None."""
    if not isinstance(v, torch.fx.Node) or not set(v.users) <= set(readers):
        return None
    if is_call(v, ops.gathered_grouped_mm) or _grouped_input(v) is not None and not is_call(v, ops.glu_grouped_mm):
        return [v]
    if depth == 0 or v.op != "call_function" or torch.Tag.pointwise not in getattr(v.target, "tags", ()):
        return None
    for a in v.args:
        found = _chain_to(a, [v], depth - 1)
        if found is not None:
            return found + [v]
    return None


def _match_scatter(node) -> tuple | None:
    if not is_call(node, aten.index_put.default) or node_arg(node, 3, "accumulate", False):
        return None
    dest, indices, v = node.args[:3]
    if not is_empty(dest) or len(indices) != 1 or _sort_of(indices[0], 1) is None:
        return None
    perm = indices[0]
    chain = _chain_to(v, [node, dest], CHAIN_DEPTH)  # dest: empty_like(v) reads v's shape only
    if chain is None or tensor_val(chain[0]).dim() != 2:
        return None
    gemm, rows = chain[0], _rows_of(chain[0])
    operands = {}
    for op in chain[1:]:
        if not same_shape(tensor_val(op), tensor_val(gemm)):
            return None  # the op must stay elementwise over the GEMM's rows
        for a in op.args:
            if a not in chain and a not in operands:
                operands[a] = _token_order(a, perm, rows)
                if operands[a] is None:
                    return None
    return perm, chain, operands


def _replayed(graph, how: tuple):
    """The operand a :func:`_token_order` recipe describes, its nodes made before the graph's cursor."""
    source, views = how
    if isinstance(source, tuple):  # b[ids] read as b[keys]
        _, table, keys, like = source
        source = new_node(graph, aten.index.Tensor, (table, [keys]), like.meta["val"], like.meta)
    for view in views:
        source = new_node(graph, view.target, (source, *view.args[1:]), view.meta["val"], view.meta,
                          kwargs=dict(view.kwargs))
    return source


def _scatter_rows(graph, ep, node, perm, chain, operands) -> str:
    gemm = chain[0]
    if is_call(gemm, ops.gathered_grouped_mm):
        x, rows, divisor, w, offs = gemm.args
        args = (x, w, offs, perm, rows, divisor)
    else:
        args = (*gmm.operands(gemm)[:3], perm)
    with graph.inserting_before(node):
        new = {gemm: new_node(graph, ops.scattered_grouped_mm, args, gemm.meta["val"], gemm.meta)}
        for a, how in operands.items():
            new[a] = _replayed(graph, how) if isinstance(a, torch.fx.Node) else a
        for op in chain[1:]:
            args = tuple(new[a] if isinstance(a, torch.fx.Node) else a for a in op.args)
            new[op] = new_node(graph, op.target, args, op.meta["val"], op.meta, kwargs=dict(op.kwargs))
    last, empty = new[chain[-1]], node.args[0]
    replace_node(ep, node, last)
    graph.erase_node(node)
    erase_unused(graph, [empty, chain[-1], *(a for a in operands if isinstance(a, torch.fx.Node))])
    steps = "".join(f", {op.target.__name__.split('.')[0]}" for op in chain[1:])
    return (f"expert rows stored in token order: {gemm.name}{steps} -> {last.name} "
            f"(tritondelegate::scattered_grouped_mm at {perm.name}, no scatter)")


# --- 5. the experts' biases in the GEMM ------------------------------------------------------------
BIAS_AT = {ops.gathered_grouped_mm: 5, ops.scattered_grouped_mm: 6}  # the ``bias`` argument's position


def _counted_ids(node) -> torch.fx.Node | None:
    """The ids whose per-expert offsets ``node`` (a grouped GEMM's offs) counts: ``cumulative_histc(ids,
    E, 0, E - 1)`` (integer ids e in [0, E) fall in bin e); else None."""
    if not is_call(node, ops.cumulative_histc):
        return None
    ids, bins, low, high = node.args[:4]
    return ids if (low, high) == (0.0, float(bins - 1)) else None


def _expert_ids(gemm) -> tuple | None:
    """(the ids of each row's expert as the GEMM orders its rows, E): the sorted ids its offs count, or
    for a GEMM storing rows in token order, the keys that sort put in expert order."""
    offs = gemm.args[4] if is_call(gemm, ops.gathered_grouped_mm) else gemm.args[2]
    ids = _counted_ids(offs)
    if ids is None or _sort_of(ids, 0) is None:
        return None
    if is_call(gemm, ops.scattered_grouped_mm):
        sort = _sort_of(gemm.args[3], 1)
        return (sort.args[0], offs.args[1]) if sort is _sort_of(ids, 0) else None
    return ids, offs.args[1]


def _match_bias(node) -> tuple | None:
    if not is_call(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    for gemm, b in (node.args, node.args[::-1]):
        if not is_call(gemm, *BIAS_AT) or node_arg(gemm, BIAS_AT[gemm.target], "bias") is not None:
            continue
        if not only_read_by(gemm, node) or not is_call(b, aten.index.Tensor) or len(b.args[1]) != 1:
            continue
        found, (table, (ids,)) = _expert_ids(gemm), b.args
        val, weight = tensor_val(table), tensor_val(gemm.args[3] if gemm.target is ops.gathered_grouped_mm
                                                    else gemm.args[1])
        if found is None or ids is not found[0] or val is None or val.dim() != 2 or val.dtype != weight.dtype:
            continue
        if sizes.shape(val.shape) == sizes.shape((found[1], weight.shape[2])) and same_shape(tensor_val(b),
                                                                                           tensor_val(gemm)):
            return gemm, table
    return None


def _biased(graph, ep, node, gemm, table) -> str:
    with graph.inserting_before(node):
        new = new_node(graph, gemm.target, gemm.args, tensor_val(node), gemm.meta, kwargs={**gemm.kwargs,
                                                                                          "bias": table})
    operands = list(node.args)
    replace_node(ep, node, new)
    graph.erase_node(node)
    erase_unused(graph, operands)
    return f"experts' biases in the GEMM: {gemm.name} + {table.name}[ids] -> {new.name} (no gathered biases)"


# --- 6. GPT-OSS's gating in the gate/up GEMM --------------------------------------------------------
def _strided_half(node, start: int):
    """The source of ``node`` = ``y[:, start::2]`` (the last of two dims), else None."""
    found = slice_bounds(node)
    if found is None or tensor_val(found[0]).dim() != 2 or found[1] != 1:
        return None
    source, _, first, end, step = found
    return source if (first, step, end) == (start, 2, tensor_val(source).shape[1]) else None


def _clamp(node, symmetric: bool, readers: int):
    """(input, limit) of ``clamp(x, max=limit)``, or with ``symmetric`` of ``clamp(x, -limit, limit)``,
    read by ``readers`` nodes; else None."""
    if not is_call(node, aten.clamp.default) or len(node.users) != readers or node.kwargs:
        return None
    lo, hi = (list(node.args[1:]) + [None, None])[:2]
    if not is_number(hi) or (lo != -hi if symmetric else lo is not None):
        return None
    return node.args[0], float(hi)


def _gated(glu) -> tuple | None:
    """(g's clamp, alpha) of ``g * sigmoid(g * alpha)`` (or its ``sigmoid_gate``, passes/fuse_activations.py),
    else None."""
    if is_call(glu, ops.sigmoid_gate):
        return glu.args[0], glu.args[1]
    for g, sig in (glu.args, glu.args[::-1]):
        if is_call(sig, aten.sigmoid.default) and only_read_by(sig, glu):
            found = number_operand(sig.args[0], aten.mul.Tensor)
            if found is not None and found[0] is g and only_read_by(sig.args[0], sig):
                return g, found[1]
    return None


def _match_clamped_glu(out) -> tuple | None:
    if not is_call(out, aten.mul.Tensor) or len(out.args) != 2:
        return None
    for up1, glu in (out.args, out.args[::-1]):
        plus = number_operand(up1, aten.add.Tensor)
        if plus is None or plus[1] != 1 or not is_call(glu, aten.mul.Tensor, ops.sigmoid_gate):
            continue
        gated = _gated(glu) if only_read_by(glu, out) else None
        if gated is None or not only_read_by(up1, out):
            continue
        readers = 1 if is_call(glu, ops.sigmoid_gate) else 2  # g * sigmoid(g * alpha) reads g twice
        (g, alpha), u, g_in = gated, _clamp(plus[0], True, 1), _clamp(gated[0], False, readers)
        if u is None or g_in is None or u[1] != g_in[1]:
            continue
        if not (only_read_by(g_in[0], g) and only_read_by(u[0], plus[0])):
            continue
        y = _strided_half(g_in[0], 0)
        if y is not None and y is _strided_half(u[0], 1) and is_call(y, ops.gathered_grouped_mm) and len(y.users) == 2:
            return y, alpha, g_in[1]
    return None


def _clamped_glu(graph, ep, out, y, alpha, limit) -> str:
    x, rows, divisor, w, offs = y.args[:5]
    args = (x, w, offs, CLAMPED_SWIGLU, rows, divisor, node_arg(y, 5, "bias"), alpha, limit)
    with graph.inserting_before(out):
        new = new_node(graph, ops.glu_grouped_mm, args, tensor_val(out), out.meta)
    operands = list(out.args)
    replace_node(ep, out, new)
    graph.erase_node(out)
    erase_unused(graph, operands)
    return (f"GPT-OSS's gating in the experts' GEMM: {y.name} clamped, (up + 1) * gate * sigmoid({alpha:g} * gate) "
            f"-> {new.name} (tritondelegate::glu_grouped_mm, {CLAMPED_SWIGLU})")


# --- 7. the sort and the offsets in one launch ------------------------------------------------------
def _match_sort_offsets(node) -> tuple | None:
    """(sort, args of sort_offsets) when ``node`` is ``cumulative_histc`` of a 1-D sort's values."""
    if not is_call(node, ops.cumulative_histc):
        return None
    sort = _sort_of(node.args[0], 0)
    if sort is None:
        return None
    x = sort.args[0]
    if sort.target is aten.sort.stable:
        descending = sort.kwargs.get("descending", False)
    else:
        descending = node_arg(sort, 2, "descending", False)
    args = (x, bool(descending), *node.args[1:6])
    return None if so.refusal(tensor_val(x), *args[2:]) is not None else (sort, args)


def _sort_offsets(graph, ep, node, sort, args) -> str:
    picks = {item: [u for u in sort.users if is_call(u, operator.getitem) and u.args[1] == item] for item in (0, 1)}
    with graph.inserting_before(sort):
        val = fake(lambda v: ops.sort_offsets(v, *args[1:]), tensor_val(args[0]))
        new = new_node(graph, ops.sort_offsets, args, val, sort.meta)
        results = [new_node(graph, operator.getitem, (new, j), val[j], meta.meta)
                   for j, meta in ((0, sort), (1, sort), (2, node))]
    for old, fresh in [*((p, results[j]) for j in (0, 1) for p in picks[j]), (node, results[2])]:
        replace_node(ep, old, fresh)
    graph.erase_node(node)
    erase_unused(graph, [*picks[0], *picks[1], *results])
    return (f"expert order and offsets in one launch: {sort.name} and {node.name} -> {new.name} "
            f"(tritondelegate::sort_offsets)")


def expert_dispatch(ep: torch.export.ExportedProgram) -> list[str]:
    """The seven rewrites over ``ep``'s graph, in place; one description per rewrite."""
    return (rewrite_matches(ep, _match_rows, _read_rows) + rewrite_matches(ep, _match_offsets, _offsets)
            + rewrite_matches(ep, _match_unsort, _unsort) + rewrite_matches(ep, _match_scatter, _scatter_rows)
            + rewrite_matches(ep, _match_bias, _biased) + rewrite_matches(ep, _match_clamped_glu, _clamped_glu)
            + rewrite_matches(ep, _match_sort_offsets, _sort_offsets))
