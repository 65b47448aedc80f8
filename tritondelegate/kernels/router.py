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

from .elementwise import round_as, round_name
from .ranking import _precedes
from .refs import FLOAT_DTYPES, TRef
from .rows import lay_out, row_offsets
from .sizes import next_power_of_2, upper

MAX_EXPERTS = 1024  # logits per row: one program holds the row
TILE = 4096  # rank comparisons per loop step: [BLOCK_E, BLOCK_J]


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _key(x_row, j, jmask, xs, m, s, SOFTMAX_FIRST: tl.constexpr, ROUND: tl.constexpr):
    """What is ranked at positions ``j``: the rounded probability, or the logit itself."""
    x = tl.load(x_row + j.to(tl.int64) * xs, mask=jmask, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:
        x = round_as(tl.exp(x - m) / s, ROUND)
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
            v = round_as(v / round_as(tl.sum(tl.where(keep, v, 0.0), 0), ROUND), ROUND)
    else:  # the kept logits' softmax: their max is the row's
        e = tl.where(keep, tl.exp(key - m), 0.0)
        v = round_as(e / tl.sum(e, 0), ROUND)
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
    rounding = round_name(softmax_dtype)
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


# --- group-limited routers (DeepSeek-V3) ----------------------------------------------------------
@triton.jit
def _group_key(s_row, b_ptr, e, emask, ss, bs, chosen, g_ids, EG, BLOCK_G: tl.constexpr):
    """c = scores + bias at experts ``e``, -inf outside the chosen groups (``chosen`` over ``g_ids``)."""
    s = tl.load(s_row + e.to(tl.int64) * ss, mask=emask, other=0.0).to(tl.float32)
    c = s + tl.load(b_ptr + e.to(tl.int64) * bs, mask=emask, other=0.0).to(tl.float32)
    picked = tl.sum(tl.where(g_ids[None, :] == (e // EG)[:, None], chosen[None, :], 0), axis=1) > 0
    return tl.where(picked & emask, c, float("-inf")), s


@triton.jit
def group_router_kernel(
    values_ptr, indices_ptr, s_ptr, b_ptr,
    rows, length, k, EG, n_group, topk_group, eps, scale,
    ss0, ss1, bs, vs0, vs1, is0, is1,
    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    live = row < rows
    s_row = s_ptr + row * ss0
    # each group's score: the sum of its two largest c = scores + bias
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_EG)
    gmask = g < tl.where(live, n_group, 0)
    tile_mask = gmask[:, None] & (j[None, :] < EG)
    at = g[:, None] * EG + j[None, :]
    c = (tl.load(s_row + at.to(tl.int64) * ss1, mask=tile_mask, other=0.0).to(tl.float32)
         + tl.load(b_ptr + at.to(tl.int64) * bs, mask=tile_mask, other=0.0).to(tl.float32))
    c = tl.where(tile_mask, c, float("-inf"))
    top = tl.max(c, axis=1)
    first = tl.min(tl.where(c == top[:, None], j[None, :], BLOCK_EG), axis=1)
    second = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), c), axis=1)
    gs = tl.where(gmask, top + second, float("-inf"))
    # the topk_group best groups (ties by index)
    before = _precedes(gs[None, :], g[None, :], gs[:, None], g[:, None], True) & gmask[None, :]
    chosen = (tl.sum(before.to(tl.int32), axis=1) < topk_group) & gmask
    chosen = chosen.to(tl.int32)
    # the k best experts of the chosen groups, ranked as ranking.py ranks
    e = tl.arange(0, BLOCK_E)
    emask = e < tl.where(live, length, 0)
    key, s = _group_key(s_row, b_ptr, e, emask, ss1, bs, chosen, g, EG, BLOCK_G)
    rank = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, length, BLOCK_J):
        jj = start + tl.arange(0, BLOCK_J)
        jmask = jj < tl.where(live, length, 0)
        kj, _ = _group_key(s_row, b_ptr, jj, jmask, ss1, bs, chosen, g, EG, BLOCK_G)
        ahead = _precedes(kj[None, :], jj[None, :], key[:, None], e[:, None], True) & jmask[None, :]
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    keep = emask & (rank < k)
    w = s
    if RENORMALIZE:
        w = w / (tl.sum(tl.where(keep, s, 0.0), 0) + eps)
    w = w * scale
    place = rank.to(tl.int64)
    tl.store(values_ptr + row * vs0 + place * vs1, w.to(values_ptr.dtype.element_ty), mask=keep)
    tl.store(indices_ptr + row * is0 + place * is1, e.to(tl.int64), mask=keep)


def launch_group_router(b, scores: TRef, bias: TRef, n_group: int, topk_group: int, k: int, renormalize: bool,
                        eps: float, scale: float, values: TRef, indices: TRef) -> None:
    """``group_router`` over the rows of ``scores`` [T, E]: one program per row."""
    rows, length = scores.shape
    eg = length // n_group
    block_e = next_power_of_2(length)
    block_g = next_power_of_2(n_group)
    b.launch("group_router", (rows,), values, indices, scores, bias, rows, length, k, eg, n_group, topk_group,
             float(eps), float(scale), *scores.strides, bias.strides[0], *values.strides, *indices.strides,
             RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_G=block_g, BLOCK_EG=next_power_of_2(eg),
             BLOCK_J=max(1, min(block_e, TILE // block_e)), num_warps=4 if block_e <= 256 else 8)


MAX_GROUPS = 64


def group_refusal(scores, bias, n_group, topk_group, k) -> str | None:
    """Why the kernel cannot take this group-limited routing; None when it can."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not isinstance(bias, torch.Tensor):
        return "the scores are not a [tokens, experts] tensor with a bias"
    if scores.dtype != torch.float32 or bias.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return (f"scores {scores.dtype} and bias {bias.dtype}: the kernel takes fp32 scores (as the model computes "
                "them) and a float bias (added in fp32, as the fp32 scores promote it)")
    length = scores.shape[1]
    if not isinstance(length, int) or length > MAX_EXPERTS or bias.shape != (length,):
        return f"rows of {length} experts: one program holds a row of at most {MAX_EXPERTS}, and a bias each"
    if not all(isinstance(v, int) for v in (n_group, topk_group, k)) or n_group > MAX_GROUPS:
        return f"{n_group} groups: constants up to {MAX_GROUPS} are taken"
    if length % n_group or not 1 <= topk_group <= n_group or not 1 <= k <= length or length // n_group < 2:
        return f"{length} experts in {n_group} groups, top {topk_group} groups, top {k}: not a group-limited top-k"
    return None


def supported_group(node) -> str | None:
    scores, bias = (a.meta.get("val") for a in node.args[:2])
    return group_refusal(scores, bias, *node.args[2:5])


def group_router(b, node):
    """``tritondelegate::group_router(scores, bias, n_group, topk_group, k, renormalize, eps, scale)``."""
    scores, bias, n_group, topk_group, k, renormalize, eps, scale = node.args
    launch_group_router(b, b.ref(scores), b.ref(bias), n_group, topk_group, k, bool(renormalize), eps, scale,
                        b.out(node, 0), b.out(node, 1))
