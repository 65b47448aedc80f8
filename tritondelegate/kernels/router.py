"""A Mixture-of-Experts router's top-k in one launch: softmax, top-k and renormalization of one row.

    softmax first (Mixtral, Qwen-MoE, OLMoE):  p = softmax(x);  v, i = topk(p, k);  v / sum(v) (renormalize)
    top-k first (GPT-OSS, GraniteMoE):         v, i = topk(x, k);  softmax(v)

(``tritondelegate::router_topk``, ``passes/fuse_router.py``): four launches (softmax, rank, sum,
divide) or two become one. One program holds a whole row of E logits (E <= MAX_EXPERTS): it computes
the softmax (fp32; the probabilities rounded to the softmax's dtype, as eager stores them), ranks
each element against the row in BLOCK_J chunks as ``ranking.py`` does (stable, NaN the largest, ties
by index), and stores the k kept values, renormalized in the same registers, in rank order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dtypes import dtype_name
from .histogram import _round
from .ranking import _precedes
from .refs import FLOAT_DTYPES, TRef
from .rows import lay_out, row_offsets
from .sizes import next_power_of_2, upper

MAX_EXPERTS = 1024  # logits per row: one program holds the row
TILE = 4096  # rank comparisons per loop step: [BLOCK_E, BLOCK_J]


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _rounded(v, ROUND: tl.constexpr):
    """``v`` (fp32) rounded to ROUND's dtype ("" for fp32: as it is)."""
    if ROUND == "float16":
        v = _round(v, tl.zeros([1], tl.float16))
    elif ROUND == "bfloat16":
        v = _round(v, tl.zeros([1], tl.bfloat16))
    return v


@triton.jit
def _key(x_row, j, jmask, xs, m, s, SOFTMAX_FIRST: tl.constexpr, ROUND: tl.constexpr):
    """What is ranked at positions ``j``: the rounded probability, or the logit itself."""
    x = tl.load(x_row + j.to(tl.int64) * xs, mask=jmask, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:
        x = _rounded(tl.exp(x - m) / s, ROUND)
    return x


@triton.jit
def router_kernel(
    values_ptr, indices_ptr, x_ptr,
    rows, n1, n2, length, k,
    xs0, xs1, xs2, xs3,
    vs0, vs1, vs2, vs3,
    is0, is1, is2, is3,
    SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr, ROUND: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row_offsets(row, n1, n2, xs0, xs1, xs2)
    i = tl.arange(0, BLOCK_E)
    imask = i < tl.where(row < rows, length, 0)
    x = tl.load(x_row + i.to(tl.int64) * xs3, mask=imask, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.where(imask, tl.exp(x - m), 0.0), 0)
    key = _key(x_row, i, imask, xs3, m, s, SOFTMAX_FIRST, ROUND)
    rank = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, length, BLOCK_J):
        j = start + tl.arange(0, BLOCK_J)
        jmask = j < tl.where(row < rows, length, 0)
        kj = _key(x_row, j, jmask, xs3, m, s, SOFTMAX_FIRST, ROUND)
        before = _precedes(kj[None, :], j[None, :], key[:, None], i[:, None], True) & jmask[None, :]
        rank += tl.sum(before.to(tl.int32), axis=1)
    keep = imask & (rank < k)
    if SOFTMAX_FIRST:
        v = key
        if RENORMALIZE:  # each step rounded as eager rounds the sum and the quotient
            v = _rounded(v / _rounded(tl.sum(tl.where(keep, v, 0.0), 0), ROUND), ROUND)
    else:  # the kept logits' softmax: their max is the row's
        e = tl.where(keep, tl.exp(key - m), 0.0)
        v = _rounded(e / tl.sum(e, 0), ROUND)
    place = rank.to(tl.int64)
    tl.store(values_ptr + row_offsets(row, n1, n2, vs0, vs1, vs2) + place * vs3,
             v.to(values_ptr.dtype.element_ty), mask=keep)
    tl.store(indices_ptr + row_offsets(row, n1, n2, is0, is1, is2) + place * is3, i.to(tl.int64), mask=keep)


# --- host launcher and lowering -------------------------------------------------------------------
def launch_router(b, x: TRef, k, values: TRef, indices: TRef, softmax_first: bool, renormalize: bool,
                  softmax_dtype: torch.dtype) -> None:
    """The top ``k`` of each last-dim row of ``x`` as ``router_topk`` defines them, into ``values``
    and ``indices``; ``softmax_dtype`` is the dtype the probabilities are rounded to."""
    x, plan = lay_out(b, x, [x.ndim - 1], (values.strides, indices.strides))
    xs, vs, ist = plan.strides
    block_e = next_power_of_2(upper(plan.cols))
    block_j = max(1, min(block_e, TILE // block_e))
    rounding = dtype_name(softmax_dtype) if softmax_dtype in (torch.float16, torch.bfloat16) else ""
    b.launch("router", (plan.rows,), values, indices, x, plan.rows, plan.n1, plan.n2, plan.cols, k, *xs, *vs, *ist,
             SOFTMAX_FIRST=softmax_first, RENORMALIZE=renormalize, ROUND=rounding, BLOCK_E=block_e,
             BLOCK_J=block_j, num_warps=4 if block_e <= 256 else 8)


def refusal(x, k) -> str | None:
    """Why the kernel cannot take the rows of ``x`` (top ``k`` along the last dim); None when it can."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        return "the logits are not a tensor with a last dim"
    if x.dtype not in FLOAT_DTYPES:
        return f"logits dtype {x.dtype} is not floating point"
    length = upper(x.shape[-1])
    if not isinstance(length, int) or length > MAX_EXPERTS:
        return f"rows of {length} logits: one program holds a row of at most {MAX_EXPERTS}"
    if not isinstance(upper(k), int) or upper(k) > length:
        return f"k = {k} is not a size within the row"
    return None


def supported(node) -> str | None:
    x, k = node.args[0].meta.get("val"), node.args[1]
    return refusal(x, k)


def router_topk(b, node):
    """``tritondelegate::router_topk(x, k, softmax_first, renormalize, dtype, out_dtype)``."""
    x, k, softmax_first, renormalize, dtype = node.args[:5]
    xr = b.ref(x)
    launch_router(b, xr, b.size(k), b.out(node, 0), b.out(node, 1), bool(softmax_first), bool(renormalize),
                  dtype or xr.dtype)
