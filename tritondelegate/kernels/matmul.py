"""Matrix multiplication: ``mm``, ``addmm``, ``bmm``, ``baddbmm`` and ``linear``, one tiled kernel.

    C[z] = alpha * (A[z] @ B[z]) + beta * X[z]       z over the batch (grid axis 1)

A is [M, K], B is [K, N], C is [M, N] per batch entry; X (the bias) broadcasts to C with stride 0.
Every operand is addressed through explicit strides, so a transposed or permuted operand (``w.t()``,
the weight of ``linear``, ``b.permute(0, 2, 1)``) is read in place, never copied. Products accumulate
in fp32; fp32 operands are multiplied in IEEE fp32 (no TF32), as torch eager does by default.

An epilogue (``fusion.py`` folds the pointwise chain that alone reads C into it) runs on the tile
before the store, with the steps of ``elementwise.pointwise_chain_kernel`` (``elementwise._epilogue``):

    r = round(C[z])   to C's own dtype, as eager stores it
    r = OPk(r, Ek[z]) (or OPk(Ek[z], r) when ESWAPk, OPk(r) when unary)     k < EPILOGUE
    C'[z] = r         C' the chain's result, with its own strides and dtype; C is never stored

Each Ek is a tensor addressed by its own [Z, M, N] strides (0 where it broadcasts) or a scalar.

A prologue (``PROLOGUE="rms"``, ``fusion.py`` folds an ``rms_norm`` that only matmuls read into each
of them) normalizes A's rows on the way in: A is then the norm's input x, each K tile is scaled by the
norm weight before the product, the row's sum of squares accumulates over the same K loop (the norm
runs over exactly K), and the product is scaled by ``rsqrt(sum / K + eps)`` before the bias and the
epilogue, since ``(x * r * w) @ B == r * ((x * w) @ B)`` row by row. The normalized A is never stored.
``PROLOGUE="layer"`` (a ``layer_norm``) first walks the block's rows of x twice over K for their mean
and variance (as the norm kernel does, in fp32), then normalizes each A tile in the K loop:
``(x - mean) * rstd * w + b``, rounded to A's dtype as eager stores the norm's result.

A gated linear unit (``GLU`` = an activation name; ``tritondelegate::glu_linear``, whose weight rows
interleave gate and up) pairs the tile's columns after the bias: with B's columns g0, u0, g1, u1, ...
the tile becomes ``act(g) * u`` (g and u rounded to C's dtype first, as eager stores the two linears'
results), half as wide, and C is [M, N / 2]; any epilogue then runs on that.

A weight-only quantized B (``QUANT``; ``tritondelegate::dequant_weight``, ``passes/quant_weights.py``)
is read as its int8 or uint8 ``q``: each K tile is dequantized as it is loaded, ``(q - zero) * scale``
with the zero and scale of the tile's group per column (tables [N, K / G]; the K step divides G), in
fp32 rounded as the model rounds, then to A's dtype for the product. The float weight is never stored:
a decode step streams a byte per weight element.

Skinny products (``GEMV``; decode, where every projection of a batch-1 step has M = 1) take the same
kernel with tl.dot replaced by a broadcast multiply and a sum over K on the CUDA cores, so a tile may
be 1, 2, 4 or 8 rows (tl.dot's tensor-core tile is 16 rows: 15 of 16 would be padding at M = 1) and
as few as 8 columns. ``choose_config`` picks it by shape when the plan is built (M <= 8 at its upper bound); the
prologues, the bias, GLU and the epilogue run unchanged on the smaller tile. Each program then streams
a [BLOCK_N, BLOCK_K] slab of the weight, rows of 256 (2-byte dtypes) or 128 (fp32) elements, 512 bytes,
and reads the weight once in all; columns narrow to 8 until the grid has two programs per SM.

There is no split-K. With 8 columns per program an N of 2 * SMs * 8 or more (2112 on an H100's 132
SMs) already gives two programs per SM, and that covers the projections of a decode step (qkv, the
gated MLP, the down projection of any model of hidden size >= 2k); a split-K reduction across programs
needs either a second launch (the very cost decode suffers from) or zeroed semaphores and atomics in
the plan. Left under-filled: N < 2112 at batch 1, e.g. N = 2048 gets 256 programs (1.9 per SM), N =
1024 128 (4 of 132 SMs idle), N = 512 64; such products are small (N = 2048, K = 4096 in bf16: 16 MiB,
5 us at full bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy
import torch
import triton
import triton.language as tl

from ..ops import GLU_ACTS
from . import sizes, target
from . import elementwise as ew
from .elementwise import MAX_CHAIN, _epilogue, _formula, round_as, round_name
from ..dtypes import dtype_name
from ..errors import LoweringError
from .refs import TRef, broadcast_strides, collapse, node_value
from .rows import node_arg

# CUDA caps grid axis 1 (the batch axis here) at 65535 programs; larger batches launch in chunks.
MAX_GRID_Y = 65535
# The kernel's epilogue slots (EOP0..EOP3): as many as a pointwise chain has ops.
EPILOGUE_STEPS = MAX_CHAIN


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _rms_tile(a, sumsq, p_ptr, stride_pk, k0, offs_k, k_left, HAS_PW: tl.constexpr):
    """One K tile of the rms prologue: its squares added to the row sums, the tile scaled by the norm
    weight (in fp32, back to A's dtype for the product)."""
    a32 = a.to(tl.float32)
    sumsq += tl.sum(a32 * a32, axis=1)
    if HAS_PW:
        w = tl.load(p_ptr + (k0 + offs_k) * stride_pk, mask=offs_k < k_left, other=0.0)
        a32 = a32 * w.to(tl.float32)[None, :]
    return a32.to(a.dtype), sumsq


@triton.jit
def _row_stats(a_ptr, offs_m, stride_am, stride_ak, M, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Mean and 1 / std (biased variance) over K of rows ``offs_m`` of A, in fp32."""
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    rows = a_ptr + offs_m[:, None] * stride_am
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = (offs_m[:, None] < M) & (k0 + offs_k[None, :] < K)
        total += tl.sum(tl.load(rows + (k0 + offs_k[None, :]) * stride_ak, mask=mask, other=0.0).to(tl.float32), 1)
    mean = total / K
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = (offs_m[:, None] < M) & (k0 + offs_k[None, :] < K)
        x = tl.load(rows + (k0 + offs_k[None, :]) * stride_ak, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean[:, None], 0.0)
        sq += tl.sum(d * d, 1)
    return mean, tl.rsqrt(sq / K + eps)


@triton.jit
def _layer_tile(a, mean, rstd, p_ptr, pb_ptr, stride_pk, k0, offs_k, k_left,
                HAS_PW: tl.constexpr, HAS_PB: tl.constexpr):
    """One K tile of the layer-norm prologue: ``(x - mean) * rstd * w + b`` in fp32, back to A's dtype;
    0 past K (the product must not see the norm of padding)."""
    inside = offs_k < k_left
    y = (a.to(tl.float32) - mean[:, None]) * rstd[:, None]
    if HAS_PW:
        y = y * tl.load(p_ptr + (k0 + offs_k) * stride_pk, mask=inside, other=0.0).to(tl.float32)[None, :]
    if HAS_PB:
        y = y + tl.load(pb_ptr + (k0 + offs_k) * stride_pk, mask=inside, other=0.0).to(tl.float32)[None, :]
    return tl.where(inside[None, :], y, 0.0).to(a.dtype)


@triton.jit
def _b_pointers(b_ptr, offs_k, offs_n, stride_bk, stride_bn, BLOCK_K: tl.constexpr, QBITS: tl.constexpr):
    """B's first K tile's addresses and the step to the next (a 4-bit B holds two K rows per byte)."""
    if QBITS == 4:
        b_ptrs = b_ptr + (offs_k // 2)[:, None] * stride_bk + offs_n[None, :] * stride_bn
        step_b = tl.full((), BLOCK_K // 2, tl.int64) * stride_bk
    else:
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        step_b = tl.full((), BLOCK_K, tl.int64) * stride_bk
    return b_ptrs, step_b


@triton.jit
def _dequant(b, shift, at, mask, z_ptr, s_ptr, QUANT: tl.constexpr, SUB_ROUND: tl.constexpr,
             MUL_ROUND: tl.constexpr, QBITS: tl.constexpr, QZERO: tl.constexpr):
    """Loaded integers ``b`` of a weight-only quantized weight as ``ops.dequant_weight_reference``
    computes them: ``(q - zero) * scale`` in fp32, rounded to each step's dtype, zero and scale loaded
    at offsets ``at`` (under ``mask``). With 4 bits, b holds bytes and each value is the nibble at
    bit ``shift`` (0 or 4). ``QZERO``: without a zero table, the zero point of every group."""
    if QBITS == 4:
        b = (b.to(tl.int32) >> shift) & 15
    t = b.to(tl.float32)
    if QUANT == "zero" or QUANT == "zero_scale":
        t = round_as(t - tl.load(z_ptr + at, mask=mask, other=0.0).to(tl.float32), SUB_ROUND)
    elif QZERO != 0:
        t = round_as(t - QZERO, SUB_ROUND)
    t = round_as(t, MUL_ROUND)
    if QUANT == "scale" or QUANT == "zero_scale":
        t = round_as(t * tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32), MUL_ROUND)
    return t


@triton.jit
def _dequant_tile(b, offs_k, offs_n, mask_n, z_ptr, s_ptr, group, stride_qn, stride_qg, QUANT: tl.constexpr,
                  SUB_ROUND: tl.constexpr, MUL_ROUND: tl.constexpr, QBITS: tl.constexpr, QZERO: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of a quantized B (:func:`_dequant`), with the zero and scale of the
    tile's ``group`` per column (the tile's K rows share one). With 4 bits, K row r is the loaded
    byte's low nibble when r is even, its high one when odd."""
    return _dequant(b, ((offs_k[:, None] % 2) * 4).to(tl.int32), group * stride_qg + offs_n[None, :] * stride_qn,
                    mask_n, z_ptr, s_ptr, QUANT, SUB_ROUND, MUL_ROUND, QBITS, QZERO)


@triton.jit
def _product(acc, a, b, GEMV: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``acc + a @ b`` for one K step, in fp32."""
    if GEMV:  # a few rows: products on the CUDA cores, in fp32, summed over the K step
        acc += tl.sum(a[:, :, None].to(tl.float32) * b[None, :, :].to(tl.float32), axis=1)
    else:
        if DOT_UPCAST:  # the interpreter's low-precision dot is wrong; the runtime sets this there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # "ieee" only affects fp32 operands (no TF32); fp16/bf16 ignore it.
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _swizzle(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid``. GROUP_M swizzle: consecutive programs walk GROUP_M row
    tiles down one column of tiles, so the B tiles they share are still in L2 when the next program of
    the group reads them."""
    num_pid_in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_pid_m, GROUP_M)
    return first_pid_m + (pid % num_pid_in_group) % group_size_m, (pid % num_pid_in_group) // group_size_m


@triton.jit
def _glu_tile(acc, pid_n, mask_m, N, ACT: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """``act(g) * u`` of a tile whose columns alternate g, u: [BLOCK_M, BLOCK_N / 2] in fp32, with its
    output columns and mask."""
    offs_n = pid_n.to(tl.int64) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    g = round_as(g, ROUND)
    u = round_as(u, ROUND)
    return _formula(g, g, g, ACT, 1) * u, offs_n, mask_m & (offs_n[None, :] < N // 2)


@triton.jit
def _head_norm(a, b, p, rn_ptr, rn_pairs, rn_eps, ty, NORM_E: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Pairs (a, b) [BLOCK_M, BLOCK_N / 2] with those below ``rn_pairs`` RMS-normalized per head of
    NORM_E columns as ``rms_norm`` computes it: x * rsqrt(mean(x^2) + eps) rounded to ``ty``, times the
    weight, rounded again."""
    a3 = tl.reshape(a, (BLOCK_M, BLOCK_N // NORM_E, NORM_E // 2))
    b3 = tl.reshape(b, (BLOCK_M, BLOCK_N // NORM_E, NORM_E // 2))
    rstd = tl.rsqrt((tl.sum(a3 * a3, 2) + tl.sum(b3 * b3, 2)) / NORM_E + rn_eps)[:, :, None]
    normed = p < rn_pairs
    wa = tl.load(rn_ptr + p * 2, mask=normed, other=1.0).to(tl.float32)
    wb = tl.load(rn_ptr + p * 2 + 1, mask=normed, other=1.0).to(tl.float32)
    na = tl.reshape(a3 * rstd, (BLOCK_M, BLOCK_N // 2)).to(ty).to(tl.float32) * wa[None, :]
    nb = tl.reshape(b3 * rstd, (BLOCK_M, BLOCK_N // 2)).to(ty).to(tl.float32) * wb[None, :]
    return (tl.where(normed[None, :], na.to(ty).to(tl.float32), a),
            tl.where(normed[None, :], nb.to(ty).to(tl.float32), b))


@triton.jit
def _rope_store(acc, z, offs_m, pid_n, M, N, c_ptr, stride_cz, stride_cm, stride_cn,
                r_ptr, rc_ptr, rs_ptr, r_inner, r_width, rc0, rc1, rcj, rs0, rs1, rsj, r_scale, rn_ptr, rn_pairs, rn_eps,
                ROPE: tl.constexpr, ROPE_ROUND: tl.constexpr, NORM_E: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Store a tile whose column pairs (2p, 2p + 1) go to columns (pairs[p, 0], pairs[p, 1]) of C,
    rotated as ``rotary`` rotates (c, c + D/2) when pairs[p, 2] >= 0 (``tritondelegate::rope_linear``).
    Row m of batch z is the result's row t = z * M + m, at table rows (t // r_inner, t % r_inner).
    Columns outside [0, N) and table indices outside [0, r_width) are masked off (the pairs are data).
    ``NORM_E``: the first ``rn_pairs`` pairs are heads of NORM_E columns (NORM_E / 2 pairs each, whole
    heads per tile), RMS-normalized per head first, their weights at rn_ptr (2 per pair)."""
    p = pid_n.to(tl.int64) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    in_n = p < N // 2
    col_a = tl.load(r_ptr + p * 4, mask=in_n, other=0).to(tl.int64)
    col_b = tl.load(r_ptr + p * 4 + 1, mask=in_n, other=0).to(tl.int64)
    j_a = tl.load(r_ptr + p * 4 + 2, mask=in_n, other=-1).to(tl.int64)
    j_b = tl.load(r_ptr + p * 4 + 3, mask=in_n, other=-1).to(tl.int64)
    ty = c_ptr.dtype.element_ty
    a, b = tl.split(tl.reshape(acc.to(ty).to(tl.float32), (BLOCK_M, BLOCK_N // 2, 2)))  # stored as eager stores y
    if NORM_E > 0:
        a, b = _head_norm(a, b, p, rn_ptr, tl.minimum(rn_pairs, N // 2), rn_eps, ty, NORM_E, BLOCK_M, BLOCK_N)
    t = z * M + offs_m
    in_m = offs_m < M
    rotated = (j_a >= 0)[None, :]
    load = in_m[:, None] & in_n[None, :] & rotated & (j_a < r_width)[None, :] & (j_b >= 0)[None, :] & (j_b < r_width)[None, :]
    c_row = (t // r_inner) * rc0 + (t % r_inner) * rc1
    if ROPE == "angles" or ROPE == "positions":  # one angle per pair; the tables as the model rounds them
        angle = tl.load(rc_ptr + c_row[:, None] + j_a[None, :] * rcj, mask=load, other=0.0).to(tl.float32)
        if ROPE == "positions":  # the position (cos) times the inverse frequency (sin) at (row, pair), in fp32
            s_row = (t // r_inner) * rs0 + (t % r_inner) * rs1
            angle = angle * tl.load(rs_ptr + s_row[:, None] + j_a[None, :] * rsj, mask=load, other=0.0).to(tl.float32)
        c1 = round_as(tl.cos(angle) * r_scale, ROPE_ROUND)
        s1 = round_as(tl.sin(angle) * r_scale, ROPE_ROUND)
        c2 = c1
        s2 = s1
    else:
        s_row = (t // r_inner) * rs0 + (t % r_inner) * rs1
        c1 = tl.load(rc_ptr + c_row[:, None] + j_a[None, :] * rcj, mask=load, other=0.0).to(tl.float32)
        c2 = tl.load(rc_ptr + c_row[:, None] + j_b[None, :] * rcj, mask=load, other=0.0).to(tl.float32)
        s1 = tl.load(rs_ptr + s_row[:, None] + j_a[None, :] * rsj, mask=load, other=0.0).to(tl.float32)
        s2 = tl.load(rs_ptr + s_row[:, None] + j_b[None, :] * rsj, mask=load, other=0.0).to(tl.float32)
    ya = tl.where(rotated, a * c1 + (-b) * s1, a)
    yb = tl.where(rotated, b * c2 + a * s2, b)
    row = c_ptr + z * stride_cz + offs_m[:, None] * stride_cm
    mask = in_m[:, None] & in_n[None, :]
    tl.store(row + col_a[None, :] * stride_cn, ya.to(ty), mask=mask & ((col_a >= 0) & (col_a < N))[None, :])
    tl.store(row + col_b[None, :] * stride_cn, yb.to(ty), mask=mask & ((col_b >= 0) & (col_b < N))[None, :])


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, x_ptr,
    M, N, K, alpha, beta,
    stride_az, stride_am, stride_ak, stride_bz, stride_bk, stride_bn,
    stride_cz, stride_cm, stride_cn, stride_xz, stride_xm, stride_xn,
    # epilogue operands per step k < EPILOGUE: pointer, scalar, [Z, M, N] strides (else stand-ins)
    e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e1s0, e1s1, e1s2, e2s0, e2s1, e2s2, e3s0, e3s1, e3s2,
    # the norm prologue: its weight and bias (stand-ins without), their stride, the norm's eps
    p_ptr, pb_ptr, stride_pk, p_eps,
    # the rotary epilogue (ROPE, ``_rope_store``: its arguments in order; stand-ins without)
    r_ptr, rc_ptr, rs_ptr, r_inner, r_width, rc0, rc1, rcj, rs0, rs1, rsj, r_scale, rn_ptr, rn_pairs, rn_eps,
    qz_ptr, qs_ptr, stride_qz, stride_qn, stride_qg, q_group,  # a quantized B's tables [Z, N, K / q_group]
    HAS_BIAS: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1, ESWAP0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1, ESWAP1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1, ESWAP2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1, ESWAP3: tl.constexpr = False,
    EIS_SCALAR0: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EIS_SCALAR2: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False,
    PROLOGUE: tl.constexpr = "", HAS_PW: tl.constexpr = False, HAS_PB: tl.constexpr = False,
    GLU: tl.constexpr = "", GLU_ROUND: tl.constexpr = "", GEMV: tl.constexpr = False,
    ROPE: tl.constexpr = "", ROPE_ROUND: tl.constexpr = "", NORM_E: tl.constexpr = 0,
    QUANT: tl.constexpr = "", QSUB_ROUND: tl.constexpr = "", QMUL_ROUND: tl.constexpr = "", QBITS: tl.constexpr = 8,
    QZERO: tl.constexpr = 0,
):
    # C[z] = alpha * (A[z] @ B[z]) + beta * X[z]   (X only when HAS_BIAS); then the epilogue, if any
    z = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _swizzle(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # int64 offsets: a batch or a row stride times an index can pass 2^31 elements.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N
    a_ptrs = a_ptr + z * stride_az + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    step_a = tl.full((), BLOCK_K, tl.int64) * stride_ak
    b_ptrs, step_b = _b_pointers(b_ptr + z * stride_bz, offs_k, offs_n, stride_bk, stride_bn, BLOCK_K, QBITS)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    qz_ptr, qs_ptr = qz_ptr + z * stride_qz, qs_ptr + z * stride_qz  # a quantized B's tables of this batch
    if PROLOGUE == "layer":
        mean, rstd = _row_stats(a_ptr + z * stride_az, offs_m, stride_am, stride_ak, M, K, p_eps, BLOCK_M, BLOCK_K)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n, other=0.0)
        if PROLOGUE == "rms":
            a, sumsq = _rms_tile(a, sumsq, p_ptr, stride_pk, k * BLOCK_K, offs_k, k_left, HAS_PW)
        elif PROLOGUE == "layer":
            a = _layer_tile(a, mean, rstd, p_ptr, pb_ptr, stride_pk, k * BLOCK_K, offs_k, k_left, HAS_PW, HAS_PB)
        if QUANT != "":  # BLOCK_K divides q_group: one group per tile ("none": q converted only)
            b = _dequant_tile(b, offs_k, offs_n, mask_n, qz_ptr, qs_ptr, (k * BLOCK_K) // q_group, stride_qn,
                              stride_qg, QUANT, QSUB_ROUND, QMUL_ROUND, QBITS, QZERO).to(a.dtype)
        acc = _product(acc, a, b, GEMV, DOT_UPCAST)
        a_ptrs += step_a
        b_ptrs += step_b

    if PROLOGUE == "rms":
        acc = acc * tl.rsqrt(sumsq / K + p_eps)[:, None]
    acc = acc * alpha
    mask = mask_m & mask_n
    if HAS_BIAS:
        x_ptrs = x_ptr + z * stride_xz + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
        acc += beta * tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if GLU != "":  # columns (gate, up) pair up: the tile, its columns and C are half as wide
        acc, offs_n, mask = _glu_tile(acc, pid_n, mask_m, N, GLU, GLU_ROUND, BLOCK_M, BLOCK_N)
    if EPILOGUE > 0:  # operands addressed by (z, row, column) strides
        acc = _epilogue(acc, mask, z, offs_m[:, None], offs_n[None, :], 0, 0,
                        e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
                        e0s0, e0s1, e0s2, 0, 0, e1s0, e1s1, e1s2, 0, 0, e2s0, e2s1, e2s2, 0, 0, e3s0, e3s1, e3s2, 0, 0,
                        EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1, EIS_SCALAR1,
                        EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
    if ROPE != "":
        _rope_store(acc, z, offs_m, pid_n, M, N, c_ptr, stride_cz, stride_cm, stride_cn,
                    r_ptr, rc_ptr, rs_ptr, r_inner, r_width, rc0, rc1, rcj, rs0, rs1, rsj, r_scale,
                    rn_ptr, rn_pairs, rn_eps, ROPE, ROPE_ROUND, NORM_E, BLOCK_M, BLOCK_N)
    else:
        c_ptrs = c_ptr + z * stride_cz + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------------
# The configuration is chosen when the plan is built, from the problem size and the GPU the program is
# lowered for (``target.py``: its SM count and shared memory; H100 by default); the interpreter ignores
# num_warps/num_stages.
MIN_BLOCK = 16  # tl.dot needs M, N, K >= 16 per tile
# GEMV: products of at most this many rows skip tl.dot (see choose_config); its tiles are at least
# GEMV_MIN_N columns wide, and hold at most GEMV_PRODUCTS fp32 products per warp (64 per thread).
GEMV_MAX_M = target.GEMV_MAX_ROWS  # (a target may lower it: ``Target.gemv_rows``)
GEMV_MIN_N = 8
GEMV_PRODUCTS = 64 * 32
GEMV_MIN_PROGRAM_BYTES = 16 * 1024  # the least weight a GEMV program streams once the grid is narrowed


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    gemv: bool = False  # the K step is a broadcast product summed on the CUDA cores, not tl.dot


def _tile(size, cap: int) -> int:
    return min(cap, max(MIN_BLOCK, sizes.next_power_of_2(size)))


def choose_config(batch: int, M: int, N: int, K: int, dtype: torch.dtype) -> Config:
    """Block sizes and launch meta for a [batch x M x N x K] problem.

    Large problems get 128x128 output tiles (the tensor cores' sweet spot on Hopper) with a K step
    of 32 (fp32) or 64 (fp16/bf16), i.e. 32 KiB of A and B per pipeline stage. Small dimensions get a
    tile just big enough (16 minimum for ``tl.dot``). When that leaves fewer tiles than the target
    has SMs, the larger tile side is halved (not below 32) so the whole GPU has work: decode-shaped
    GEMMs with M > 8 then spread over N. The pipeline holds 2 to 4 stages, as many as the target's
    shared memory allows. M <= 8 (the target's ``gemv_rows``) takes the GEMV variant (:func:`_gemv_config`).
    """
    gpu = target.current()
    itemsize = torch.empty((), dtype=dtype).element_size()
    batch, M, N, K = sizes.upper((batch, M, N, K))  # tuned for the largest size a dynamic dim takes
    if M <= gpu.gemv_rows:
        return _gemv_config(batch, M, N, K, itemsize, gpu)
    block_m = _tile(M, 128)
    block_n = _tile(N, 128)
    block_k = _tile(K, 32 if itemsize >= 4 else 64)
    while batch * triton.cdiv(M, block_m) * triton.cdiv(N, block_n) < gpu.num_sms and max(block_m, block_n) > 32:
        if block_m >= block_n:
            block_m //= 2
        else:
            block_n //= 2
    stage_bytes = (block_m + block_n) * block_k * itemsize
    num_stages = max(2, min(4, gpu.pipeline_budget // stage_bytes))
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    return Config(block_m, block_n, block_k, group_m=8, num_warps=num_warps, num_stages=num_stages)


def _gemv_config(batch: int, M: int, N: int, K: int, itemsize: int, gpu: target.Target) -> Config:
    """The GEMV variant's tiles for M <= GEMV_MAX_M rows (upper bounds).

    A tile has M's rows rounded up to a power of two (1 to 8), so none or few are padding. Its K step
    reads 512 bytes of each weight row (256 elements of fp16/bf16, 128 of fp32): the weight streams
    at full width, once. The program multiplies BLOCK_M x BLOCK_K x BLOCK_N products in registers, at
    most 64 per thread over 8 warps (32 under fp32, whose B tile takes a register per element too); it
    starts as wide in N as that allows and halves (to 8 columns, even for GLU's pairs) until the grid
    has two programs per SM, enough in flight to keep HBM busy, as long as each program still streams
    GEMV_MIN_PROGRAM_BYTES of the weight: a smaller product is bound by its latency (its K loop), which
    narrower tiles do not shorten. 4 warps when half the registers do.

    Why 8 rows: below 16, tl.dot's tile is mostly padding (half of it at 8 rows); a skinny product is
    bound by the weight's bytes, and CUDA-core FMAs keep up with them while M is small (2M FLOP per
    weight element: 8 FLOP per byte of bf16 at 8 rows, against an H100's 67 fp32 TFLOP/s over 3.35
    TB/s, ~20); and the 64-products-per-thread bound still fits a full 512-byte K step at 8 columns
    with 8 rows, not with 16 (which tl.dot's tile serves with no padding)."""
    block_m = sizes.next_power_of_2(max(M, 1))
    block_k = min(512 // itemsize, max(MIN_BLOCK, sizes.next_power_of_2(K)))  # 512 bytes of a row
    # registers per program: the products, and under fp32 as many again for B's tile (at one row)
    cost = block_m * block_k * (2 if itemsize >= 4 else 1)
    block_n = max(GEMV_MIN_N, min(sizes.next_power_of_2(N), 128, GEMV_PRODUCTS * 8 // cost))
    while (batch * triton.cdiv(N, block_n) < 2 * gpu.num_sms and block_n > GEMV_MIN_N
           and block_n // 2 * K * itemsize >= GEMV_MIN_PROGRAM_BYTES):
        block_n //= 2
    num_warps = 4 if cost * block_n <= GEMV_PRODUCTS * 4 else 8
    stage_bytes = (block_m + block_n) * block_k * itemsize
    num_stages = max(2, min(4, gpu.pipeline_budget // stage_bytes))
    return Config(block_m, block_n, block_k, group_m=8, num_warps=num_warps, num_stages=num_stages, gemv=True)


@dataclass(frozen=True)
class Rope:
    """The rotary epilogue of a ``rope_linear`` launch (see :func:`_rope_store`): the column pairs
    [N / 2, 4], the cos table (or the angles) and the sin table (None with angles), each table's
    strides over (outer row, inner row, index), the rows' inner count, and the tables' scale and
    rounding (angles only)."""

    pairs: TRef
    cos: TRef
    sin: TRef | None
    cos_strides: tuple
    sin_strides: tuple
    inner: object  # int, or a size expression
    scale: float = 1.0
    round: str = ""
    norm: TRef | None = None  # per-head RMSNorm weights (2 per normed pair; ``_head_norm``)
    norm_dim: int = 0  # its head size (NORM_E)
    norm_eps: float = 0.0

    @property
    def mode(self) -> str:
        """"tables" (cos and sin given), "angles" (cos holds the angles, sin None) or "positions" (cos
        holds integer positions, sin inverse frequencies: the angles are their product)."""
        if self.sin is None:
            return "angles"
        return "tables" if self.cos.dtype.is_floating_point else "positions"

    @property
    def reads(self) -> tuple[TRef, ...]:
        return tuple(t for t in (self.pairs, self.cos, self.sin, self.norm) if t is not None)

    def args(self) -> list:
        sin = self.cos if self.sin is None else self.sin
        norm = [self.cos, 0, 0.0] if self.norm is None else [self.norm, self.norm.shape[0] // 2, self.norm_eps]
        return [self.pairs, self.cos, sin, self.inner, self.cos.shape[-1], *self.cos_strides, *self.sin_strides,
                self.scale, *norm]

    @staticmethod
    def stand_in(t: TRef) -> list:
        """The rotary arguments of a launch without it: ``t`` for every pointer, never read."""
        return [t, t, t, 1, 0, 0, 0, 0, 0, 0, 0, 1.0, t, 0, 0.0]


@dataclass(frozen=True)
class QuantWeight:
    """A ``tritondelegate::dequant_weight`` node's lowered value: its parts, which only the matmuls that
    take it as their weight read (no launch of its own)."""

    q: TRef  # [N, K] int8 or uint8 ([E, N, K]: a grouped GEMM's experts)
    zero: TRef | None  # [N, T] ([E, N, T]): a group of K / T columns per entry
    scale: TRef | None
    sub_round: str  # the dtype names the steps round to ("" for fp32)
    mul_round: str
    bits: int = 8  # 4: q is uint8 [N, K / 2], two columns per byte
    zero_point: int = 0  # without a zero table, every group's (QZERO)

    @property
    def tables(self) -> tuple[TRef, ...]:
        return tuple(t for t in (self.zero, self.scale) if t is not None)

    def group(self, k: int) -> int:
        """Columns per group (a power of two >= 16, or all of K)."""
        return k // self.tables[0].shape[-1] if self.tables else k

    def step_limit(self, k: int) -> int | None:
        """The most columns a kernel's K step may take, so that it lies in one group (None: one group
        per row, any step)."""
        group = self.group(k)
        return group if group < k else None

    def args(self, k: int) -> list:
        """A kernel's ``qz_ptr, qs_ptr``, the tables' strides (one per dim of q: zeros without tables,
        q standing in for the pointers, never read) and ``q_group``."""
        first = self.tables[0] if self.tables else self.q
        strides = first.strides if self.tables else (0,) * self.q.ndim
        return [self.zero or first, self.scale or first, *strides, self.group(k)]

    def batched_args(self, k: int) -> list:
        """:meth:`args` with a batch stride first (the matmul kernel's ``stride_qz``): 0 for a 2-D q, one
        weight for every batch; a 3-D q's [Z, N, K] (``bmm``'s B: a batch of weights)."""
        args = self.args(k)
        return args if self.q.ndim == 3 else [*args[:2], 0, *args[2:]]

    def constexprs(self) -> dict:
        mode = "_".join(name for name, t in (("zero", self.zero), ("scale", self.scale)) if t is not None)
        bits = {} if self.bits == 8 else dict(QBITS=self.bits)
        zero = dict(QZERO=self.zero_point) if self.zero_point else {}
        return dict(QUANT=mode or "none", QSUB_ROUND=self.sub_round, QMUL_ROUND=self.mul_round, **bits, **zero)


@dataclass(frozen=True)
class MatmulOp:
    """One ``matmul`` launch: ``c = alpha * (a @ bmat) + beta * bias``, all views [Z, M, ...].

    Its launch record carries it (``LaunchRecord.op``) for each matmul done in one launch, so that
    ``fusion.py`` can relaunch it with an epilogue (:func:`epilogue_launch`)."""

    a: TRef
    bmat: TRef
    c: TRef
    x: TRef  # the bias; without one (or with beta = 0) a stand-in for it, never read
    has_bias: bool
    alpha: float
    beta: float
    cfg: Config
    # A norm folded into A (``fusion.py``): (kind "rms" or "layer", weight or None, bias or None, eps);
    # ``a`` is then the norm's input.
    prologue: tuple | None = None
    # A gated linear unit's activation (``glu_linear``): B's columns alternate gate, up; C is [Z, M, N / 2].
    glu: str = ""
    # The rotary epilogue (``rope_linear``): C's column pairs stored where ``pairs`` says, rotated.
    rope: "Rope | None" = None
    # A weight-only quantized B (``bmat`` is then its integers): dequantized tile by tile.
    quant: "QuantWeight | None" = None

    @property
    def n(self):
        """The product's N: B's columns (C's, or twice C's under a gated linear unit)."""
        return self.bmat.shape[2]

    @property
    def reads(self) -> tuple[TRef, ...]:
        norm = tuple(t for t in (self.prologue or (None,) * 4)[1:3] if t is not None)
        rope = () if self.rope is None else self.rope.reads
        quant = () if self.quant is None else self.quant.tables
        return (self.a, self.bmat) + ((self.x,) if self.has_bias else ()) + norm + rope + quant

    def args(self, c: TRef | None = None, c_strides=None, operands=()) -> list:
        """The launch's positional arguments; with ``c``, storing into ``c`` (with ``c_strides``) after
        an epilogue reading ``operands`` (see :func:`epilogue_launch`)."""
        x = self.x if self.has_bias or c is None else c  # the stand-in must not keep C alive
        c = self.c if c is None else c
        c_strides = c.strides if c_strides is None else tuple(c_strides)
        x_strides = self.x.strides if self.has_bias else (0, 0, 0)
        _, M, K = self.a.shape
        N = self.n
        epilogue, _ = ew.epilogue_args(c, (), operands, 3, "")  # operands: (tensor, its [Z, M, N] strides)
        _, weight, bias, eps = self.prologue if self.prologue is not None else ("", None, None, 0.0)
        given = weight if weight is not None else bias
        prologue = [self.a if weight is None else weight, self.a if bias is None else bias,
                    0 if given is None else given.strides[0], float(eps)]
        rope = Rope.stand_in(self.a) if self.rope is None else self.rope.args()
        quant = [self.a, self.a, 0, 0, 0, 1] if self.quant is None else self.quant.batched_args(K)
        return [self.a, self.bmat, c, x, M, N, K, self.alpha, self.beta,
                *self.a.strides, *self.bmat.strides, *c_strides, *x_strides, *epilogue,
                *prologue, *rope, *quant]

    @property
    def tiles(self) -> Config:
        """The configuration launched: ``cfg`` within :func:`fused_config`'s limit when the launch
        normalizes A (a prologue, which ``fusion.py`` adds after ``cfg`` was chosen) or pairs gate and
        up columns (GLU). A rotary launch keeps ``cfg``: its tiles hold whole heads (``_rope_config``)
        and were sized for its epilogue already."""
        fused = (self.prologue is not None or bool(self.glu)) and self.rope is None
        cfg = fused_config(self.cfg, self.a.dtype, fused)
        limit = None if self.quant is None else self.quant.step_limit(self.a.shape[2])
        if limit is not None:  # a group per K step
            cfg = replace(cfg, block_k=min(cfg.block_k, limit))
        return cfg

    def grid(self) -> tuple[int, int]:
        cfg = self.tiles
        return (triton.cdiv(self.a.shape[1], cfg.block_m) * triton.cdiv(self.n, cfg.block_n), self.a.shape[0])

    def constexprs(self) -> dict:
        cfg = self.tiles
        prologue = {} if self.prologue is None else dict(
            PROLOGUE=self.prologue[0], HAS_PW=self.prologue[1] is not None, HAS_PB=self.prologue[2] is not None)
        if self.glu:
            prologue.update(GLU=self.glu, GLU_ROUND=dtype_name(self.c.dtype))
        if cfg.gemv:  # only then, so that the plans and kernel variants of larger products stay as they were
            prologue.update(GEMV=True)
        if self.rope is not None:
            prologue.update(ROPE=self.rope.mode, ROPE_ROUND=self.rope.round)
            if self.rope.norm is not None:
                prologue.update(NORM_E=self.rope.norm_dim)
        if self.quant is not None:
            prologue.update(self.quant.constexprs())
        return dict(HAS_BIAS=self.has_bias, DOT_UPCAST=False,
                    BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **prologue)


def launch_matmul(b, a: TRef, bmat: TRef, c: TRef, bias: TRef | None = None,
                  alpha: float = 1.0, beta: float = 1.0, glu: str = "", rope: Rope | None = None,
                  quant: "QuantWeight | None" = None) -> None:
    """Launch ``c = alpha * (a @ bmat) + beta * bias``. ``a`` [Z, M, K], ``bmat`` [Z, K, N] and
    ``c`` [Z, M, N] are 3-D views (stride 0 on a broadcast batch); ``bias`` is a view broadcast to
    ``[Z, M, N]``, or None. With ``glu`` (an activation name), ``c`` is [Z, M, N / 2]: the gated
    linear unit of B's alternating gate and up columns. With ``rope``, C's column pairs are stored
    rotated where it says (``rope_linear``; one launch: the rows it indexes are the whole result's).
    With ``quant``, ``bmat`` views its integers (``tritondelegate::dequant_weight``)."""
    batch, M, K = a.shape
    N = bmat.shape[2]
    cfg = choose_config(batch, M, N, K, a.dtype)
    if rope is not None:  # the rotation holds the two halves, two or four table tiles and their addresses
        cfg = _rope_config(epilogue_config(cfg, a.dtype, 4), rope.norm_dim, a.dtype)
    has_bias = bias is not None and beta != 0  # beta = 0 ignores the bias, NaNs included (as torch)
    x = bias if has_bias else c  # never read without a bias
    chunks = _batch_chunks(batch)
    if rope is not None and len(chunks) > 1:
        raise LoweringError(f"a rotary epilogue over a batch of {batch} products needs one launch; "
                            f"a launch holds {MAX_GRID_Y}")
    for start, count in chunks:
        views = [_batch_slice(b, t, start, count) for t in (a, bmat, c, x)]
        op = MatmulOp(*views, has_bias, float(alpha), float(beta), cfg, glu=glu, rope=rope, quant=quant)
        record = b.launch("matmul", op.grid(), *op.args(), **op.constexprs())
        if record is not None and count == batch:  # a product split over launches takes no epilogue
            record.op = op


def epilogue_config(cfg: Config, dtype: torch.dtype, tiles: int) -> Config:
    """``cfg`` for a launch whose epilogue reads ``tiles`` tensor tiles (its operands and the bias).

    The epilogue holds an operand tile and its 64-bit addresses in registers next to the accumulator.
    At 64 accumulator elements per thread (128x128 over 8 warps), fp16/bf16 launches have room for
    two such tiles; fp32 ones (IEEE fp32 dots run on the FMA units, ~250 registers already) for none.
    Otherwise the launch takes 8 warps and at most 32 elements per thread (128x64): with four operand
    tiles and the bias, no spills on sm_90 (``scripts/compile_check.py``). GEMV tiles (1024 elements at
    most) are far below either limit and pass unchanged."""
    return _fit(cfg, 64 if dtype.itemsize < 4 and tiles <= 2 else 32)


def fused_config(cfg: Config, dtype: torch.dtype, fused: bool) -> Config:
    """``cfg`` for a launch with a norm prologue or a gated linear unit (``fused``): under fp32, at most
    32 accumulator elements per thread (8 warps, then the larger tile side halved: 128x128 -> 128x64
    over 8 warps, 64x128 over 4 warps -> the same tile over 8), as :func:`epilogue_config` keeps fp32.

    IEEE fp32 dots run on the FMA units, and a plain fp32 GEMM at 64 elements per thread already takes
    ~240 of the 255 registers on sm_90; the prologue's norm weight tile and row sums or the GLU's
    paired columns take the rest (250, 254 at 128x128 over 8 warps), and both together spill.
    Measured (``scripts/compile_check.py``, an RMSNorm prologue and a SiLU GLU, K step 32): 64x128
    over 4 warps 255 registers and 24 bytes of stack, over 8 warps 198 and none; 128x128 over 8 warps
    255 and 24 bytes, 128x64 over 8 warps 196 and none (182 with a LayerNorm prologue). fp16/bf16
    tiles (tensor-core dots, 155 registers for the same launch) and GEMV tiles (1024 elements at most)
    pass unchanged."""
    if not fused or dtype.itemsize < 4 or cfg.gemv:
        return cfg
    return _fit(cfg, 32)


def _fit(cfg: Config, limit: int) -> Config:
    """``cfg`` with at most ``limit`` accumulator elements per thread: 8 warps if it has more, then
    the larger tile side halved until it fits."""
    block_m, block_n, warps = cfg.block_m, cfg.block_n, cfg.num_warps
    if block_m * block_n > limit * 32 * warps:
        warps = max(warps, 8)
    while block_m * block_n > limit * 32 * warps:
        if block_n >= block_m:
            block_n //= 2
        else:
            block_m //= 2
    return replace(cfg, block_m=block_m, block_n=block_n, num_warps=warps)


def _rope_config(cfg: Config, norm_dim: int, dtype: torch.dtype) -> Config:
    """``cfg`` with tiles of whole heads when a per-head norm runs in the rotary epilogue: at least
    ``norm_dim`` columns (a power of two, so a tile holds whole heads), rows halved to stay within
    the epilogue's 32 accumulator elements per thread (tl.dot keeps 16), a GEMV's K step shortened to
    keep its products per thread."""
    if norm_dim <= cfg.block_n:
        return cfg
    block_m, block_k = cfg.block_m, cfg.block_k
    while block_m * norm_dim > 32 * 32 * cfg.num_warps and block_m > (1 if cfg.gemv else MIN_BLOCK):
        block_m //= 2
    if cfg.gemv:
        cost = 2 if dtype.itemsize >= 4 else 1
        while block_m * block_k * norm_dim * cost > GEMV_PRODUCTS * cfg.num_warps and block_k > MIN_BLOCK:
            block_k //= 2
    return replace(cfg, block_m=block_m, block_n=norm_dim, block_k=block_k)


def epilogue_launch(op: MatmulOp, out: TRef, out_strides, steps, operands) -> tuple[tuple, list, dict]:
    """(grid, arguments, constexprs) of ``op``'s launch with an epilogue: starting from C rounded to
    its dtype, ``steps`` ((op, arity, swap), at most EPILOGUE_STEPS) each read ``operands[k]``: a pair
    (TRef, its [Z, M, N] strides), a Python scalar, or None where the step is unary; the result goes to
    ``out`` with ``out_strides`` ([Z, M, N]), in ``out``'s dtype, and C is never stored. The tiles
    may shrink (:func:`epilogue_config`), so the grid may change."""
    if not 1 <= len(steps) <= EPILOGUE_STEPS or len(operands) != len(steps):
        raise LoweringError(f"an epilogue has 1 to {EPILOGUE_STEPS} steps, one operand each")
    tiles = op.has_bias + sum(isinstance(o, tuple) for o in operands)
    op = replace(op, cfg=epilogue_config(op.cfg, op.a.dtype, tiles))
    constexprs = {**op.constexprs(), **ew.epilogue_args(out, steps, operands, 3, dtype_name(op.c.dtype))[1]}
    return op.grid(), op.args(out, out_strides, operands), constexprs


def batch_split(op: MatmulOp, z) -> tuple | None:
    """(z, rows): ``op``'s one product (Z = 1) of M rows as ``z`` products of ``rows = M / z`` rows each,
    or None when it has a batch already, a rotary epilogue (its tables are indexed by row), or M is not
    a multiple of z. ConvNeXt's linears at a batch of images: each image's rows are a run of A and of C,
    while a residual or a norm's input in NCHW steps by image between them."""
    batch, m, _ = op.a.shape
    quant_batch = op.quant is not None and op.quant.q.ndim == 3  # tables of one weight per batch
    if batch != 1 or op.rope is not None or quant_batch or (sizes.is_static(z) and z <= 1):
        return None
    if sizes.is_static(m) and sizes.is_static(z):
        return (z, m // z) if m % z == 0 else None
    rows = sympy.simplify(sympy.sympify(m) / z)
    return (z, rows) if rows.is_integer and not rows.free_symbols & sympy.sympify(z).free_symbols else None


def rebatched(op: MatmulOp, split: tuple, view) -> MatmulOp:
    """``op`` as the products of :func:`batch_split`'s ``split``: A's, C's and the bias's rows in ``z``
    runs of ``rows`` (the builder's ``view`` makes the views), B and a quantized B's tables shared."""
    z, rows = split

    def runs(t: TRef) -> TRef:
        return view(t, (z, rows, t.shape[2]), (rows * t.strides[1], t.strides[1], t.strides[2]), t.offset)

    bmat = view(op.bmat, (z, *op.bmat.shape[1:]), (0, *op.bmat.strides[1:]), op.bmat.offset)
    return replace(op, a=runs(op.a), bmat=bmat, c=runs(op.c), x=runs(op.x) if op.has_bias else op.x)


def _batch_chunks(batch) -> list[tuple[int, object]]:
    """(start, count) of each launch over the batch: the grid's second axis holds MAX_GRID_Y at most."""
    if not sizes.is_static(batch):
        if sizes.upper(batch) > MAX_GRID_Y:
            raise sizes.SymbolicShapeError(f"a dynamic batch of up to {sizes.upper(batch)} matrix products "
                                           f"exceeds one launch's {MAX_GRID_Y}")
        return [(0, batch)]
    return [(start, min(MAX_GRID_Y, batch - start)) for start in range(0, max(batch, 1), MAX_GRID_Y)]


def _batch_slice(b, t: TRef, start: int, count) -> TRef:
    if start == 0 and count == t.shape[0]:
        return t
    return b.view(t, (count, *t.shape[1:]), t.strides, t.offset + start * t.strides[0])


def _batched(b, t: TRef, batch: int = 1) -> TRef:
    """A 2-D operand as a [batch, rows, cols] view with batch stride 0."""
    return b.view(t, (batch, *t.shape), (0, *t.strides))


def _bias(b, bias: TRef, shape) -> TRef:
    """``bias`` broadcast to the 3-D output ``shape``."""
    return b.view(bias, shape, broadcast_strides(bias, shape))


# --- support checks -------------------------------------------------------------------------------
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Operand ranks per op, None for an optional operand of any rank up to the output's.
_RANKS = {
    "mm": (2, 2),
    "bmm": (3, 3),
    "addmm": (None, 2, 2),
    "baddbmm": (None, 3, 3),
}


def _check(node, tensors) -> str | None:
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return "result is not a tensor"
    for name, v in tensors + [("result", out)]:
        if not isinstance(v, torch.Tensor):
            return f"{name} is not a tensor"
        if v.dtype not in DTYPES:
            return (f"{name} has dtype {v.dtype}; matmul supports "
                    f"{', '.join(str(d) for d in DTYPES)}")
        if v.dtype != out.dtype:
            return f"mixed dtypes: {name} is {v.dtype} but the result is {out.dtype}"
    return None


def supported(node) -> str | None:
    """mm/bmm/addmm/baddbmm: None, or why the node is refused."""
    op = node.target.__name__.split(".")[0]
    ranks = _RANKS[op]
    names = ("input", "mat1", "mat2") if len(ranks) == 3 else ("mat1", "mat2")
    tensors = [(n, node_value(a)) for n, a in zip(names, node.args)]
    reason = _check(node, tensors)
    if reason:
        return reason
    out_rank = 3 if op in ("bmm", "baddbmm") else 2
    for (name, v), rank in zip(tensors, ranks):
        if rank is not None and v.dim() != rank:
            return f"{name} is {v.dim()}-D; {op} needs {rank}-D operands"
        if rank is None and v.dim() > out_rank:
            return f"{name} is {v.dim()}-D; it must broadcast to the {out_rank}-D result"
    return None


def supported_linear(node) -> str | None:
    """linear(x [..., K], weight [N, K], bias [N] | None): None, or why the node is refused."""
    names = ("input", "weight", "bias")
    tensors = [(n, node_value(a)) for n, a in zip(names, node.args) if a is not None]
    reason = _check(node, tensors)
    if reason:
        return reason
    vals = dict(tensors)
    if vals["input"].dim() < 1:
        return "input is 0-D; linear needs at least 1-D input"
    if vals["weight"].dim() != 2:
        return f"weight is {vals['weight'].dim()}-D; linear needs a 2-D weight"
    if "bias" in vals and vals["bias"].dim() > 1:
        return f"bias is {vals['bias'].dim()}-D; linear needs a 1-D bias"
    return None


# --- lowerings ------------------------------------------------------------------------------------
def _quantized_b(b, q: TRef) -> TRef:
    """A transposed quantized weight's integers q [N, K] or [Z, N, K] (K / 2 bytes with 4 bits) as a
    matmul's B [1 or Z, K, N], in place."""
    z, stride_z = (q.shape[0], q.strides[0]) if q.ndim == 3 else (1, 0)
    return b.view(q, (z, q.shape[-1], q.shape[-2]), (stride_z, q.strides[-1], q.strides[-2]))


def _b_operand(b, arg) -> tuple[TRef, "QuantWeight | None"]:
    """``mm``'s B as a [1, K, N] view, and its quantized parts when it is a ``dequant_weight``
    (transposed: B is W.t(), read from q [N, K] in place)."""
    value = b.values(arg)
    if not isinstance(value, QuantWeight):
        return _batched(b, b.ref(arg)), None
    return _quantized_b(b, value.q), value


def mm(b, node):
    a, (m, quant) = b.ref(node.args[0]), _b_operand(b, node.args[1])
    c = b.out(node)
    launch_matmul(b, _batched(b, a), m, _batched(b, c), quant=quant)


def addmm(b, node):
    bias, a, (m, quant) = b.ref(node.args[0]), b.ref(node.args[1]), _b_operand(b, node.args[2])
    c = _batched(b, b.out(node))
    launch_matmul(b, _batched(b, a), m, c, _bias(b, bias, c.shape),
                  alpha=node.kwargs.get("alpha", 1), beta=node.kwargs.get("beta", 1), quant=quant)


def bmm(b, node):
    """``bmm(a [Z, M, K], m [Z, K, N])``; a quantized m (``dequant_weight`` [Z, N, K], transposed: a batch
    of weights, as Llama 4's experts) read from its integers in place."""
    value = b.values(node.args[1])
    if not isinstance(value, QuantWeight):
        launch_matmul(b, b.ref(node.args[0]), b.ref(node.args[1]), b.out(node))
        return
    launch_matmul(b, b.ref(node.args[0]), _quantized_b(b, value.q), b.out(node), quant=value)


def baddbmm(b, node):
    bias, a, m = (b.ref(x) for x in node.args[:3])
    c = b.out(node)
    launch_matmul(b, a, m, c, _bias(b, bias, c.shape),
                  alpha=node.kwargs.get("alpha", 1), beta=node.kwargs.get("beta", 1))


def linear(b, node, glu: str = "", rope=None):
    """out[..., N] = x[..., K] @ weight[N, K].T + bias: the leading dims of x become M (merged in
    place when their strides allow, else a batch axis), the weight is read transposed in place.
    With ``glu``, out is [..., N / 2] (``glu_linear``); ``rope(b, out)`` makes the rotary epilogue
    (``rope_linear``)."""
    x, w = b.ref(node.args[0]), b.values(node.args[1])
    quant = w if isinstance(w, QuantWeight) else None
    w = b.ref(node.args[1]) if quant is None else quant.q
    bias = b.ref(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
    out = b.out(node)
    K, N = x.shape[-1], w.shape[0]  # (a 4-bit weight holds K / 2 bytes per row)
    rows = _rows(x.shape[:-1], x.strides[:-1])
    if rows is None:  # three or more leading dims no stride can merge: make x contiguous
        x = b.contiguous(x)
        rows = _rows(x.shape[:-1], x.strides[:-1])
    (batch, M), (sz, sm) = rows
    a = b.view(x, (batch, M, K), (sz, sm, x.strides[-1]))
    wt = b.view(w, (batch, w.shape[1], N), (0, w.strides[1], w.strides[0]))
    n_out = out.shape[-1]  # N, or N / 2 under a gated linear unit
    c = b.view(out, (batch, M, n_out), (M * n_out, n_out, 1))  # out is contiguous: [batch, M, N]
    launch_matmul(b, a, wt, c, None if bias is None else _bias(b, bias, (batch, M, N)), glu=glu,
                  rope=None if rope is None else rope(b, out), quant=quant)


def dequant_weight(b, node):
    """``tritondelegate::dequant_weight(q, zero, scale, sub_dtype, mul_dtype, dtype, ...)``: no launch; the
    linears and grouped GEMMs that read it as their weight (all its readers:
    ``quant_readers.supported_dequant``) read its parts."""
    q, zero, scale = (None if a is None else b.ref(a) for a in node.args[:3])
    sub_dtype, mul_dtype = node.args[3], node.args[4]
    b.bind(node, QuantWeight(q, zero, scale, round_name(sub_dtype), round_name(mul_dtype), dequant_flags(node)[0],
                             node_arg(node, 8, "zero_point", 0)))


def dequant_flags(node) -> tuple[int, bool]:
    """A ``dequant_weight`` node's ``bits`` and ``transposed``."""
    return node_arg(node, 6, "bits", 8), node_arg(node, 7, "transposed", False)


def group_refusal(k: int, width: int) -> str | None:
    """Why the kernel cannot walk ``width`` groups over ``k`` columns (None: it can): whole rows, or a
    power of two of at least MIN_BLOCK columns, so that each K step lies in one group."""
    group = k // width
    if width > 1 and (group < MIN_BLOCK or group & (group - 1)):
        return f"groups of {group} columns: the kernel takes a power of two of at least {MIN_BLOCK}"
    return None


def glu_linear(b, node):
    """``tritondelegate::glu_linear(x, weight, bias, act)``: ``linear`` with the gated linear unit
    of the weight's interleaved gate and up rows in the kernel (C is half as wide)."""
    linear(b, node, glu=node.args[3])


def rope_linear(b, node):
    """``tritondelegate::rope_linear(x, weight, bias, pairs, cos, sin, cos_dims, scale, dtype)``:
    ``linear`` over the permuted weight, its column pairs stored rotated (``_rope_store``)."""
    pairs, cos = b.ref(node.args[3]), b.ref(node.args[4])
    sin = b.ref(node.args[5]) if node.args[5] is not None else None
    cos_dims, scale, dtype = node.args[6], node.args[7], node.args[8]
    if pairs.strides != (4, 1):
        raise LoweringError(f"rope_linear: the column pairs must be a contiguous [N / 2, 4] table, got strides "
                            f"{pairs.strides}")

    def strides(t: TRef) -> tuple:
        return (*(t.strides[d] if d >= 0 else 0 for d in cos_dims), t.strides[-1])

    norm = b.ref(node.args[9]) if len(node.args) > 9 and node.args[9] is not None else None
    norm_dim, norm_eps = (node.args[10], node.args[11]) if norm is not None else (0, 0.0)

    def make(b, out: TRef) -> Rope:
        rounding = round_name(dtype)
        return Rope(pairs, cos, sin, strides(cos), strides(cos if sin is None else sin),
                    out.shape[-2] if len(out.shape) >= 2 else 1, float(scale), rounding, norm, norm_dim,
                    float(norm_eps))

    linear(b, node, rope=make)


def supported_rope(node) -> str | None:
    """rope_linear(x [..., K], weight [N, K], bias, pairs [N / 2, 4], cos, sin, cos_dims, scale, dtype):
    None, or why it is refused."""
    reason = supported_linear(node)
    if reason:
        return reason
    rows = node_value(node.args[1]).shape[0]
    pairs, cos = node_value(node.args[3]), node_value(node.args[4])
    sin = node_value(node.args[5]) if node.args[5] is not None else None
    if not isinstance(rows, int) or rows % 2 or tuple(pairs.shape) != (rows // 2, 4) or pairs.dtype != torch.int32:
        return f"pairs {tuple(pairs.shape)} {pairs.dtype} do not pair the weight's {rows} rows"
    if sin is not None and not cos.dtype.is_floating_point:
        if cos.dtype not in (torch.int32, torch.int64) or sin.dtype not in DTYPES or cos.shape != sin.shape:
            return (f"positions {tuple(cos.shape)} {cos.dtype} and inverse frequencies {tuple(sin.shape)} {sin.dtype}: "
                    "the epilogue takes int positions and float frequencies, both as the angles' shape")
    else:
        for name, t in (("cos", cos), ("sin", sin)):
            if t is not None and t.dtype not in DTYPES:
                return f"{name} has dtype {t.dtype}; the rotary epilogue reads {', '.join(map(str, DTYPES))}"
    out = node.meta.get("val")
    if out.dim() not in (2, 3):
        return f"the result is {out.dim()}-D; the rotary epilogue indexes 2-D or 3-D results"
    norm_dim = node.args[10] if len(node.args) > 10 and node.args[9] is not None else 0
    if norm_dim and (norm_dim & (norm_dim - 1) or not 2 <= norm_dim <= 512):
        return f"a per-head norm over {norm_dim} columns; the epilogue normalizes powers of two up to 512"
    return None


def supported_glu(node) -> str | None:
    """glu_linear(x [..., K], weight [2N, K], bias [2N] | None, act): None, or why it is refused."""
    reason = supported_linear(node)
    if reason:
        return reason
    if node.args[3] not in GLU_ACTS:
        return f"act {node.args[3]!r} is not one of {', '.join(sorted(GLU_ACTS))}"
    rows = node_value(node.args[1]).shape[0]
    if not isinstance(rows, int) or rows % 2:
        return f"the weight has {rows} rows; a gated linear unit needs an even, static count"
    return None


def _rows(shape, strides):
    """Leading dims as ((batch, M), (batch stride, row stride)), or None if they need 3 axes."""
    sizes, (merged,) = collapse(shape, [strides])
    if len(sizes) > 2:
        return None
    sizes = [1] * (2 - len(sizes)) + sizes
    merged = [0] * (2 - len(merged)) + merged
    return (sizes[0], sizes[1]), (merged[0], merged[1])
