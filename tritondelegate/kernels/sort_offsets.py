"""``tritondelegate::sort_offsets``: a Mixture-of-Experts dispatch's sort of the chosen expert ids and
its offsets per expert, in one launch.

transformers orders the (token, slot) pairs by expert and counts each expert's rows as

    values, indices = sort(ids)                               ranking.py: rank(i) = #{ j : x[j] precedes x[i] }
    offsets = cumsum(histc(values.to(cast), bins, min, max))  histogram.py: out[b] = #{ x : bin(x) <= b }

The counts do not depend on the order, so both read the ids as given. Program p ranks the elements
[p * BLOCK_I, (p + 1) * BLOCK_I) against the whole row (stable: ties in index order, exactly as the
``rank`` kernel) and counts the bins [p * BLOCK_B, (p + 1) * BLOCK_B) (exactly as the ``histc``
kernel's CUMULATIVE form); the grid is the larger of the two needs, so a decode step's few ids and up
to 512 experts are one program. Each part is the other kernel's own helper, so the results are the
two launches' bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import histogram as hist
from . import ranking, sizes
from .refs import TRef
from .sizes import next_power_of_2, upper

BLOCK_I = ranking.BLOCK_I  # elements ranked per program
BLOCK_J = ranking.BLOCK_J  # elements compared against per loop step
TILE = 8192  # [BLOCK_N, BLOCK_B] bin comparisons per loop step: few ids let one program count 512 bins
MAX_BLOCK_B = 512


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def sort_offsets_kernel(
    values_ptr, indices_ptr, offsets_ptr, x_ptr,
    n, xs, vs, ist, bins, lo, hi, os,
    DESCENDING: tl.constexpr, FROM_DATA: tl.constexpr, CAST: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # values[rank(i)] = x[i], indices[rank(i)] = i (sort, stable); offsets[b] = cumsum(histc(x))[b]
    pid = tl.program_id(0)
    if pid * BLOCK_I < n:
        i = pid * BLOCK_I + tl.arange(0, BLOCK_I)  # int32: a row has at most ranking.MAX_LENGTH
        imask = i < n
        xi = tl.load(x_ptr + i.to(tl.int64) * xs, mask=imask, other=0)
        place = ranking.ranks(x_ptr, xs, xi, i, n, DESCENDING, BLOCK_J).to(tl.int64)
        tl.store(values_ptr + place * vs, xi, mask=imask)
        tl.store(indices_ptr + place * ist, i.to(tl.int64), mask=imask)
    if pid * BLOCK_B < bins:
        b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        counts = hist.bin_counts(x_ptr, n, 1, 1, 1, 1, xs, 0, 0, 0, 0, b, bins, lo, hi, FROM_DATA, True, CAST,
                                 BLOCK_N)
        tl.store(offsets_ptr + b * os, counts.to(tl.float32).to(offsets_ptr.dtype.element_ty), mask=b < bins)


# --- host launcher --------------------------------------------------------------------------------
def launch_sort_offsets(b, x: TRef, descending: bool, bins: int, low: float, high: float, cast: bool,
                        values: TRef, indices: TRef, offsets: TRef) -> None:
    """``values``, ``indices`` = the stable sort of the 1-D ``x``; ``offsets`` (``bins``) = the running
    counts of its elements (converted to fp32 first with ``cast``) in ``bins`` bins over [low, high]."""
    n = x.shape[0]
    low, high = (float(torch.tensor(v, dtype=torch.float32 if cast else x.dtype)) for v in (low, high))
    length = next_power_of_2(upper(n))
    block_i, block_j, block_n = min(length, BLOCK_I), min(length, BLOCK_J), min(length, hist.BLOCK_N)
    block_b = min(next_power_of_2(bins), max(hist.BLOCK_B, min(MAX_BLOCK_B, TILE // block_n)))
    block_n = min(block_n, max(1, TILE // block_b))
    grid = (sizes.larger(triton.cdiv(n, block_i), triton.cdiv(bins, block_b)),)
    b.launch("sort_offsets", grid, values, indices, offsets, x, n, x.strides[0], values.strides[0],
             indices.strides[0], bins, low, high, offsets.strides[0], DESCENDING=descending,
             FROM_DATA=low == high, CAST=cast, BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_B=block_b,
             BLOCK_N=block_n, num_warps=4 if max(block_n * block_b, block_i * block_j) <= 4096 else 8)


# --- support check and lowering -------------------------------------------------------------------
def refusal(x, bins, low, high, cast, dtype) -> str | None:
    """Why the kernel cannot take ``sort_offsets`` of ``x``; None when it can: a 1-D row the ranking
    kernel sorts, counts the cumulative histogram takes."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        return "the input is not a 1-D tensor"
    length = upper(x.shape[0])
    if not isinstance(length, int) or length > ranking.MAX_LENGTH:
        return f"{length} elements: the ranking kernel compares every pair, at most {ranking.MAX_LENGTH}"
    if x.dtype not in ranking.DTYPES:
        return f"dtype {x.dtype} is not supported"
    return hist.cumulative_refusal(x, bins, low, high, cast, dtype)


def supported(node) -> str | None:
    """sort_offsets(x, descending, bins, min, max, cast, dtype)."""
    return refusal(node.args[0].meta.get("val"), *node.args[2:7])


def sort_offsets(b, node):
    """``tritondelegate::sort_offsets``: (values, indices, offsets), one launch."""
    x, descending, bins, low, high, cast, _ = node.args
    launch_sort_offsets(b, b.ref(x), bool(descending), int(bins), float(low), float(high), cast is not None,
                        b.out(node, 0), b.out(node, 1), b.out(node, 2))
