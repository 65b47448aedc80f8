"""A Mixture-of-Experts layer's dispatch in fewer launches: the bookkeeping around its grouped GEMMs.

transformers sends each token to its k experts (``grouped_mm_experts_forward``) as

    ids, perm = sort(top_k_index.view(-1))                    the (token, slot) pairs by expert
    x_g = hidden[perm // k]                                   (1) each pair's token row, gathered
    offs = cumsum(histc(ids.float(), E, 0, E - 1), 0, dtype)  (2) rows per expert, running sums
    y = grouped_mm(x_g, W, offs) ...                          the experts
    inv = empty_like(perm); inv[perm] = arange(S)             (3) the inverse order,
    y = y[inv]                                                    and the rows put back by it

six launches besides the GEMMs. Three rewrites make them two:

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
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import ops
from ..kernels import grouped_mm as gmm
from ..kernels import histogram as hist
from ..kernels import sizes
from ..kernels.creation import is_empty
from ..kernels.registry import external_name
from ..kernels.rows import node_arg
from .fuse_glu import only_read_by
from .fuse_grouped_glu import FALLBACK
from .rewrite import (erase_unused, fake, is_call, new_node, plain_cast, replace_node, rewrite_matches,
                      static_int, tensor_val)

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


def expert_dispatch(ep: torch.export.ExportedProgram) -> list[str]:
    """The three rewrites over ``ep``'s graph, in place; one description per rewrite."""
    return (rewrite_matches(ep, _match_rows, _read_rows) + rewrite_matches(ep, _match_offsets, _offsets)
            + rewrite_matches(ep, _match_unsort, _unsort))
