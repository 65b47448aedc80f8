"""``cdist`` and ``_cdist_forward`` (``torch.cdist``): the p-norm distance between every row of x1 and
every row of x2, one launch.

    out[z, i, j] = (sum_k |x1[z, i, k] - x2[z, j, k]|^p)^(1 / p)      x1 [*Z, P, M], x2 [*Z, R, M], out [*Z, P, R]

    p = 2     sqrt(sum d^2)             p = 1    sum |d|
    p = inf   max |d| (a NaN d skipped, as eager's CPU kernel does)
    p = 0     the number of k where d != 0 (a NaN d gives NaN, as eager)
    other p > 0 through exp2(p log2 |d|) and back, in fp32

A program computes a BLOCK_M x BLOCK_N tile of one batch entry (grid axis 2), BLOCK_K columns of both
at a time, with the differences themselves in fp32: the direct form, as eager computes p != 2 and p = 2
for up to 25 rows a side. For p = 2 over more rows (or with ``compute_mode="use_mm_for_euclid_dist"``)
eager takes the matmul form sqrt(max(|a|^2 + |b|^2 - 2 a.b, 0)) instead, whose cancellation errs by
about sqrt(eps) |a| on near-coincident rows (0.01 on the diagonal of cdist(x, x) for |x| ~ 30) and
which gives NaN for an infinite input (inf * 0 in the product); this kernel gives 0 and inf there and
agrees with eager elsewhere within rounding, whatever ``compute_mode`` says. That form is written in
``cdist`` itself, not in ``_cdist_forward``, so ``cdist`` is kept whole (``decompose.py``): decomposed,
it is 7 launches.

Batch dims broadcast (stride 0) and are walked as two (z0, z1) on grid axis 2; inputs whose batch dims
do not merge into two are copied out first. Eager has no fp16/bf16 cdist; here those compute in fp32
and round once.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from .elementwise import launch_pointwise
from .refs import FLOAT_DTYPES, broadcast_strides, collapse_padded, node_value
from .sizes import next_power_of_2

BLOCK = 32  # rows of x1 (and of x2) per program at most
BLOCK_K = 8  # columns per step


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def cdist_kernel(
    out_ptr, a_ptr, b_ptr,
    P, R, M, p, Z1,
    as_z0, as_z1, as_i, as_k, bs_z0, bs_z1, bs_j, bs_k, os_z0, os_z1, os_i, os_j,
    NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # NORM: "two", "one", "inf", "zero" or "p" (any other p > 0, the runtime argument p)
    z = tl.program_id(2).to(tl.int64)
    z0, z1 = z // Z1, z % Z1
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + z0 * as_z0 + z1 * as_z1 + i.to(tl.int64)[:, None] * as_i
    b_rows = b_ptr + z0 * bs_z0 + z1 * bs_z1 + j.to(tl.int64)[:, None] * bs_j
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + k[None, :] * as_k, mask=(i[:, None] < P) & (k[None, :] < M), other=0).to(tl.float32)
        b = tl.load(b_rows + k[None, :] * bs_k, mask=(j[:, None] < R) & (k[None, :] < M), other=0).to(tl.float32)
        d = tl.abs(a[:, None, :] - b[None, :, :])  # [BLOCK_M, BLOCK_N, BLOCK_K]; masked columns give 0
        if NORM == "two":
            acc += tl.sum(d * d, axis=2)
        elif NORM == "one":
            acc += tl.sum(d, axis=2)
        elif NORM == "inf":
            top = tl.max(tl.where(d == d, d, 0.0), axis=2)
            acc = tl.where(top > acc, top, acc)
        elif NORM == "zero":
            acc += tl.sum(tl.minimum(tl.ceil(d), 1.0, propagate_nan=tl.PropagateNan.ALL), axis=2)
        else:
            acc += tl.sum(tl.exp2(p * tl.log2(d)), axis=2)
    if NORM == "two":
        acc = tl.sqrt(acc)
    elif NORM == "p":
        acc = tl.exp2(tl.log2(acc) / p)
    out = out_ptr + z0 * os_z0 + z1 * os_z1 + i.to(tl.int64)[:, None] * os_i + j[None, :] * os_j
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(i[:, None] < P) & (j[None, :] < R))


# --- lowering ---------------------------------------------------------------------------------------
NORMS = {2.0: "two", 1.0: "one", math.inf: "inf", 0.0: "zero"}


def _batch_walk(x1, x2, out):
    """((Z0, Z1), x1's, x2's and out's strides over them): the batch dims walked as two (x1 and x2
    broadcast to out's), or None when they do not merge into two."""
    batch = out.shape[:-2]
    strides = [broadcast_strides(replace(x, shape=x.shape[:-2], strides=x.strides[:-2]), batch) for x in (x1, x2)]
    walk = collapse_padded(batch, [*strides, out.strides[:-2]], 2)
    return None if walk is None else (walk[0], *walk[1])


def _p(node) -> float:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("p", 2.0)


def cdist(b, node):
    """cdist / _cdist_forward(x1 [*, P, M], x2 [*, R, M], p=2, compute_mode=None) -> [*, P, R]"""
    x1, x2, p = b.ref(node.args[0]), b.ref(node.args[1]), float(_p(node))
    out = b.out(node)
    walk = _batch_walk(x1, x2, out)
    if walk is None:  # batch dims that do not merge: both inputs copied out over the output's batch
        x1, x2 = (_expanded(b, x, out.shape[:-2]) for x in (x1, x2))
        walk = _batch_walk(x1, x2, out)
    (z0, z1), s1, s2, so = walk
    P, R, M = x1.shape[-2], x2.shape[-2], x1.shape[-1]
    block_m, block_n = (max(16, min(BLOCK, next_power_of_2(n))) for n in (P, R))
    b.launch("cdist", (triton.cdiv(P, block_m), triton.cdiv(R, block_n), z0 * z1), out, x1, x2,
             P, R, M, p if p not in NORMS else 1.0, z1, *s1, *x1.strides[-2:], *s2, *x2.strides[-2:], *so,
             *out.strides[-2:], NORM=NORMS.get(p, "p"), BLOCK_M=block_m, BLOCK_N=block_n,
             BLOCK_K=max(2, min(BLOCK_K, next_power_of_2(M))))


def _expanded(b, x, batch):
    """A contiguous copy of ``x`` broadcast over ``batch``."""
    shape = (*batch, *x.shape[-2:])
    copy = b.alloc(shape, x.dtype)
    launch_pointwise(b, "copy", copy, [b.view(x, shape, broadcast_strides(x, shape))])
    return copy


def supported(node) -> str | None:
    x1, x2, out = node_value(node.args[0]), node_value(node.args[1]), node.meta.get("val")
    for name, t in (("x1", x1), ("x2", x2), ("output", out)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            return f"{name} dtype {getattr(t, 'dtype', t)} is not supported"
    p = _p(node)
    if not isinstance(p, (int, float)) or math.isnan(p) or p < 0:
        return f"p = {p} is not a number >= 0"
    return None
