"""``sort`` and ``topk`` along one dim: one ranking kernel for both.

Each element's place in the sorted row is the number of elements that come before it:

    rank(i) = #{ j : x[j] precedes x[i] }          precedes: smaller (larger when descending), or
                                                   equal with a smaller index j < i
    values[rank(i)] = x[i],  indices[rank(i)] = i   for rank(i) < k  (k = the row's length for sort)

so the order is stable (equal values keep their order, as ``sort(stable=True)``), NaN sorts as the
largest value (first when descending, last when ascending; NaNs keep their order among themselves),
and ``topk(largest=...)`` is the first k of the descending (ascending) order, sorted. The counting is
quadratic in the row's length but has no data-dependent control flow, needs no scratch and spreads
over the grid: a [rows, cdiv(length, BLOCK_I)] grid of programs each ranks BLOCK_I elements against
the whole row in BLOCK_J chunks. It serves the short rows that decoders sort on the device: a
Mixture-of-Experts router's top-k over its experts and the sort of the chosen expert ids (tokens x k).
Rows longer than ``MAX_LENGTH`` stay on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .refs import FLOAT_DTYPES, TRef
from .rows import lay_out, node_arg, normalize_dims, row_offsets
from .sizes import next_power_of_2, upper

MAX_LENGTH = 1 << 16  # elements per sorted row: a row costs length^2 comparisons
BLOCK_I = 64  # elements ranked per program
BLOCK_J = 128  # elements compared against per loop step (a [BLOCK_I, BLOCK_J] tile of comparisons)
DTYPES = FLOAT_DTYPES + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _precedes(a, ia, b, ib, DESCENDING: tl.constexpr):
    """Whether (a, ia) comes before (b, ib): by value, NaN the largest, then by index."""
    a_nan = a != a
    b_nan = b != b
    if DESCENDING:
        before = (a > b) | (a_nan & (b_nan == 0))
    else:
        before = (a < b) | (b_nan & (a_nan == 0))
    same = (a == b) | (a_nan & b_nan)
    return before | (same & (ia < ib))


@triton.jit
def _key(x):
    """What is compared: floats in fp32 (exact for fp16 and bf16), integers as they are."""
    if x.dtype.is_floating():
        x = x.to(tl.float32)
    return x


@triton.jit
def ranks(x_row, xs, xi, i, length, DESCENDING: tl.constexpr, BLOCK_J: tl.constexpr):
    """rank(i) of the elements ``xi`` at positions ``i`` (int32) of the row at ``x_row`` (``length``
    elements, stride ``xs``): how many of the row's elements precede each."""
    ki = _key(xi)
    rank = tl.zeros_like(i)
    for start in range(0, length, BLOCK_J):
        j = start + tl.arange(0, BLOCK_J)
        jmask = j < length
        kj = _key(tl.load(x_row + j.to(tl.int64) * xs, mask=jmask, other=0))
        before = _precedes(kj[None, :], j[None, :], ki[:, None], i[:, None], DESCENDING) & jmask[None, :]
        rank += tl.sum(before.to(tl.int32), axis=1)
    return rank


@triton.jit
def rank_kernel(
    values_ptr, indices_ptr, x_ptr,
    rows, n1, n2, length, k,
    xs0, xs1, xs2, xs3,
    vs0, vs1, vs2, vs3,
    is0, is1, is2, is3,
    DESCENDING: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # int32: a row has at most MAX_LENGTH
    x_row = x_ptr + row_offsets(row, n1, n2, xs0, xs1, xs2)
    imask = i < tl.where(row < rows, length, 0)
    xi = tl.load(x_row + i.to(tl.int64) * xs3, mask=imask, other=0)
    rank = ranks(x_row, xs3, xi, i, length, DESCENDING, BLOCK_J)
    keep = imask & (rank < k)
    place = rank.to(tl.int64)
    tl.store(values_ptr + row_offsets(row, n1, n2, vs0, vs1, vs2) + place * vs3, xi, mask=keep)
    tl.store(indices_ptr + row_offsets(row, n1, n2, is0, is1, is2) + place * is3, i.to(tl.int64), mask=keep)


# --- host launcher --------------------------------------------------------------------------------
def launch_rank(b, x: TRef, dim: int, k, values: TRef, indices: TRef, descending: bool) -> None:
    """The first ``k`` of ``x``'s elements along ``dim`` in sorted order (descending or ascending):
    their values into ``values`` and their positions into ``indices`` (``k`` along ``dim``)."""
    if x.ndim == 0:  # a 0-d tensor sorts to itself at index 0
        x, values, indices = (b.view(t, (1,), (1,)) for t in (x, values, indices))
        dim = 0
    x, plan = lay_out(b, x, [dim], (values.strides, indices.strides))
    xs, vs, ist = plan.strides
    block_i = min(next_power_of_2(upper(plan.cols)), BLOCK_I)
    block_j = min(next_power_of_2(upper(plan.cols)), BLOCK_J)
    b.launch("rank", (plan.rows, triton.cdiv(plan.cols, block_i)),
             values, indices, x, plan.rows, plan.n1, plan.n2, plan.cols, k, *xs, *vs, *ist,
             DESCENDING=descending, BLOCK_I=block_i, BLOCK_J=block_j, num_warps=4 if block_i * block_j <= 4096 else 8)


# --- support checks and lowerings -----------------------------------------------------------------
def supported(node) -> str | None:
    x = node.args[0].meta.get("val")
    if not isinstance(x, torch.Tensor):
        return "the input is not a tensor"
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} is not supported (supported: {', '.join(map(str, DTYPES))})"
    dim = _dim(node)
    length = upper(x.shape[dim]) if x.ndim else 1
    if not isinstance(length, int) or length > MAX_LENGTH:
        return (f"rows of {length} elements along dim {dim}: the ranking kernel compares every pair, "
                f"so rows stay on the host beyond {MAX_LENGTH}")
    return None


def _dim(node) -> int:
    """The sorted dim, non-negative (0 for a 0-d input)."""
    if node.target is torch.ops.aten.topk.default:
        dim = node_arg(node, 2, "dim", -1)
    elif node.target is torch.ops.aten.sort.default:
        dim = node_arg(node, 1, "dim", -1)
    else:  # sort.stable: keyword arguments only
        dim = node.kwargs.get("dim", -1)
    ndim = node.args[0].meta["val"].ndim
    return normalize_dims(dim, ndim)[0] if ndim else 0


def sort(b, node):
    """sort(x, dim=-1, descending=False) and sort.stable(x, *, stable, dim=-1, descending=False):
    stable either way."""
    x = b.ref(node.args[0])
    if node.target is torch.ops.aten.sort.stable:
        descending = node.kwargs.get("descending", False)
    else:
        descending = node_arg(node, 2, "descending", False)
    dim = _dim(node)
    launch_rank(b, x, dim, x.shape[dim] if x.ndim else 1, b.out(node, 0), b.out(node, 1), bool(descending))


def topk(b, node):
    """topk(x, k, dim=-1, largest=True, sorted=True): always sorted; ties keep index order."""
    x = b.ref(node.args[0])
    largest = node_arg(node, 3, "largest", True)
    launch_rank(b, x, _dim(node), b.size(node.args[1]), b.out(node, 0), b.out(node, 1), bool(largest))
