"""Grouped matrix multiplication: the experts of a Mixture-of-Experts layer in one launch.

    out[r] = x[r] @ w[e(r)]      for offs[e-1] <= r < offs[e]   (offs[-1] = 0)
    out[r] = 0                   for offs[E-1] <= r < S

x is [S, K] with its rows sorted by expert, w is [E, K, N], offs [E] (int32 or int64) the cumulative
row counts per expert, out [S, N]. This is ``transformers::grouped_mm_fallback`` (transformers 5's
default ``experts_implementation="grouped_mm"`` exports it in fp32 on the CPU) and
``aten._grouped_mm`` with a 2-D x, a 3-D w and offs (what torch picks in bf16 on a GPU; it leaves the
rows past offs[-1] unwritten, this kernel stores 0 there). Every operand is read in place through its
strides (the experts' weights are a transposed view of the parameter). Products accumulate in fp32
(IEEE, no TF32) and are rounded to out's dtype once. offs must be non-decreasing, as both ops require;
values outside [0, S] are clamped to it, so a bad offs tensor gives wrong rows, never a read or a write
outside the operands. Two modes of the kernel read and store rows through index vectors
(``passes/expert_dispatch.py``): ``ROWS`` reads x's row r at rows[r] // rows_divisor (the tokens'
rows gathered in the loads), ``DEST`` stores row r at out's row dest[r] (put back in token order
by the stores; a fused epilogue then reads its operands at the stored rows).

Two variants, both correct for any offs:

* **Segments** (``PER_ROW=False``): grid axis 0 walks (expert, row tile of that expert's segment) in
  order, BLOCK_M rows of one expert per program, so the tile is one ``tl.dot`` per K step against one
  expert's [BLOCK_K, BLOCK_N] slab. Each program finds its tile from offs in-kernel: the per-expert
  tile counts ``cdiv(end_e - start_e, BLOCK_M)``, their running sum, and the first expert whose sum
  passes the program id. The tail [offs[E-1], S) is one more segment, stored as zeros. Segments of c_e
  rows need sum_e cdiv(c_e, BLOCK_M) <= cdiv(S, BLOCK_M) + E tiles (each segment pads fewer than
  BLOCK_M rows), which is the grid; programs past the last tile store nothing.
* **Rows** (``PER_ROW=True``, a few rows: decode, where S = tokens x experts per token is small):
  each row finds its own expert, ``e(r) = #{e : offs[e] <= r}`` (E: past the last segment, stored as
  0), and gathers its own [BLOCK_K, BLOCK_N] slab of that expert's weight; products are a broadcast
  multiply summed over K on the CUDA cores (as ``matmul``'s GEMV variant), so tiles of 1 to 8 rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import sizes, target
from ..dtypes import dtype_name
from ..ops import CLAMPED_SWIGLU, GROUPED_GLU_ACTS
from .elementwise import _epilogue, epilogue_args, round_as, round_name
from .matmul import QuantWeight, _b_pointers, _dequant, _glu_tile, _rms_tile
from .matmul import choose_config as matmul_config
from .refs import TRef, node_value
from .rows import node_arg

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OFFS_DTYPES = (torch.int32, torch.int64)
MIN_BLOCK = 16  # tl.dot's least tile side
ROW_PRODUCTS = 64 * 32 * 8  # per-row variant: products and gathered weights held per program, each
FP32_TILE = 128 * 64  # segment tiles under fp32: at most 32 accumulator elements per thread over 8 warps


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _bounds(offs_ptr, stride_o, S, E, BLOCK_E: tl.constexpr):
    """Segment e's rows [start_e, end_e) for e <= E (segment E: the tail up to S), clamped to [0, S];
    empty past E. Vectors of BLOCK_E (> E) entries."""
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e.to(tl.int64) * stride_o, mask=e < E, other=0).to(tl.int64)
    ends = tl.where(e < E, tl.minimum(tl.maximum(ends, 0), S), S)
    starts = tl.load(offs_ptr + (e - 1).to(tl.int64) * stride_o, mask=(e >= 1) & (e <= E), other=0).to(tl.int64)
    starts = tl.where(e <= E, tl.minimum(tl.maximum(starts, 0), S), S)
    return e, starts, tl.maximum(ends, starts)


@triton.jit
def _segment_tile(offs_ptr, stride_o, pid, S, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of program ``pid``'s row tile: the segments' tiles in order. The
    expert is E for the tail's tiles and past E for a program with no tile (its rows are empty)."""
    e, starts, ends = _bounds(offs_ptr, stride_o, S, E, BLOCK_E)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    passed = tl.cumsum(tiles, 0) <= pid  # segments wholly before pid's tile
    expert = tl.sum(passed.to(tl.int32), 0)
    tile = pid - tl.sum(tl.where(passed, tiles, 0), 0)
    start = tl.sum(tl.where(e == expert, starts, 0), 0)
    end = tl.sum(tl.where(e == expert, ends, 0), 0)
    return expert, start + tile * BLOCK_M, end


@triton.jit
def _segment_product(x_ptr, w_ptr, rows, mask_m, offs_n, mask_n, expert, K, E,
                     stride_xs, stride_xk, stride_we, stride_wk, stride_wn, p_ptr, stride_pk,
                     qz_ptr, qs_ptr, stride_qe, stride_qn, stride_qg, q_group,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_UPCAST: tl.constexpr,
                     RMS: tl.constexpr, HAS_PW: tl.constexpr, QUANT: tl.constexpr, QSUB_ROUND: tl.constexpr,
                     QMUL_ROUND: tl.constexpr, QBITS: tl.constexpr, QZERO: tl.constexpr):
    """(x[rows] @ w[expert] for rows of one expert, in fp32, 0 for the tail and empty tiles: no K steps;
    the rows' sums of squares with RMS, x's tiles then scaled by the norm weight, as ``matmul._rms_tile``;
    with QUANT the expert's tile dequantized as it is loaded, as ``matmul``'s)."""
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xs + offs_k[None, :] * stride_xk
    e = tl.minimum(expert, E - 1).to(tl.int64)
    w_ptrs, step_w = _b_pointers(w_ptr + e * stride_we, offs_k, offs_n, stride_wk, stride_wn, BLOCK_K, QBITS)
    step = tl.full((), BLOCK_K, tl.int64)  # int64: a K step times a stride can pass 2^31
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    steps = tl.where(expert < E, tl.cdiv(K, BLOCK_K), 0)
    for k in range(0, steps):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if RMS:
            a, sumsq = _rms_tile(a, sumsq, p_ptr, stride_pk, k * BLOCK_K, offs_k, k_left, HAS_PW)
        if QUANT != "":  # BLOCK_K divides q_group: one group per tile
            b = _dequant(b, ((offs_k[:, None] % 2) * 4).to(tl.int32),
                         e * stride_qe + ((k * BLOCK_K) // q_group) * stride_qg + offs_n[None, :] * stride_qn,
                         mask_n[None, :], qz_ptr, qs_ptr, QUANT, QSUB_ROUND, QMUL_ROUND, QBITS, QZERO).to(a.dtype)
        if DOT_UPCAST:  # the interpreter's low-precision dot is wrong; the runtime sets this there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        x_ptrs += step * stride_xk
        w_ptrs += step_w
    return acc, sumsq


@triton.jit
def _row_product(x_ptr, w_ptr, offs_ptr, stride_o, rows, x_rows, mask_m, offs_n, mask_n, S, K, E,
                 stride_xs, stride_xk, stride_we, stride_wk, stride_wn, p_ptr, stride_pk,
                 qz_ptr, qs_ptr, stride_qe, stride_qn, stride_qg, q_group,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 RMS: tl.constexpr, HAS_PW: tl.constexpr, QUANT: tl.constexpr, QSUB_ROUND: tl.constexpr,
                 QMUL_ROUND: tl.constexpr, QBITS: tl.constexpr, QZERO: tl.constexpr):
    """(x[x_rows[r]] @ w[e(r)] row by row, in fp32, 0 for rows past the last segment; the rows' sums of
    squares with RMS, as ``_segment_product``; each row's expert, E past the last segment; with QUANT
    each row's slab dequantized as it is loaded)."""
    e, starts, ends = _bounds(offs_ptr, stride_o, S, E, BLOCK_E)
    ended = (ends[None, :] <= rows[:, None]) & (e[None, :] < E)  # segments that end at or before row r
    expert = tl.sum(ended.to(tl.int32), 1)
    live = mask_m & (expert < E)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xs + offs_k[None, :] * stride_xk
    experts = tl.minimum(expert, E - 1).to(tl.int64)[:, None, None]
    w_ptrs, step_w = _b_pointers(w_ptr + experts * stride_we, offs_k, offs_n, stride_wk, stride_wn, BLOCK_K, QBITS)
    step = tl.full((), BLOCK_K, tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        inside = offs_k < K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=live[:, None] & inside[None, :], other=0.0)
        if RMS:
            a, sumsq = _rms_tile(a, sumsq, p_ptr, stride_pk, k * BLOCK_K, offs_k, K - k * BLOCK_K, HAS_PW)
        b = tl.load(w_ptrs, mask=live[:, None, None] & inside[None, :, None] & mask_n[None, None, :], other=0.0)
        if QUANT != "":
            b = _dequant(b, ((offs_k[None, :, None] % 2) * 4).to(tl.int32),
                         experts * stride_qe + ((k * BLOCK_K) // q_group) * stride_qg + offs_n[None, None, :] * stride_qn,
                         live[:, None, None] & mask_n[None, None, :], qz_ptr, qs_ptr, QUANT, QSUB_ROUND, QMUL_ROUND,
                         QBITS, QZERO).to(a.dtype)
        acc += tl.sum(a[:, :, None].to(tl.float32) * b.to(tl.float32), axis=1)
        x_ptrs += step * stride_xk
        w_ptrs += step_w
    return acc, sumsq, expert


@triton.jit
def _clamped_glu_tile(acc, pid_n, mask_m, N, ROUND: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """GPT-OSS's gating of a tile whose columns alternate g, u (``ops.glu_halves``, "clamped_swiglu"):
    g = min(g, LIMIT), u = clamp(u, -LIMIT, LIMIT), (u + 1) * g * sigmoid(ALPHA * g), g and u rounded
    to ROUND first; [BLOCK_M, BLOCK_N / 2] in fp32, with its output columns and mask."""
    offs_n = pid_n.to(tl.int64) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    g = tl.minimum(round_as(g, ROUND), LIMIT)
    u = tl.minimum(tl.maximum(round_as(u, ROUND), -LIMIT), LIMIT)
    return (u + 1.0) * (g * tl.sigmoid(g * ALPHA)), offs_n, mask_m & (offs_n[None, :] < N // 2)


@triton.jit
def _expert_bias(bias_ptr, experts, mask_m, offs_n, mask_n, E, stride_be, stride_bn):
    """Each row's expert's bias row [BLOCK_M, BLOCK_N] in fp32; 0 for rows past the last segment."""
    live = mask_m & (experts < E)
    ptrs = bias_ptr + experts.to(tl.int64)[:, None] * stride_be + offs_n[None, :] * stride_bn
    return tl.load(ptrs, mask=live[:, None] & mask_n[None, :], other=0.0).to(tl.float32)


@triton.jit
def _x_rows(rows_ptr, stride_r, rows, mask_m, T, rows_div, ROWS: tl.constexpr):
    """The rows of x that output rows ``rows`` read: themselves, or with ROWS floor(rows[r] / rows_div)
    (negative: from the end, as indexing counts), clamped to [0, T)."""
    if ROWS:
        src = tl.load(rows_ptr + rows * stride_r, mask=mask_m, other=0).to(tl.int64)
        q = src // rows_div
        q = tl.where(src - q * rows_div < 0, q - 1, q)  # floor, where integer division truncates
        q = tl.where(q < 0, q + T, q)
        x_rows = tl.minimum(tl.maximum(q, 0), T - 1)
    else:
        x_rows = rows
    return x_rows


@triton.jit
def _out_rows(dest_ptr, stride_d, rows, mask_m, S, DEST: tl.constexpr):
    """(the rows of out that rows ``rows`` are stored at, their mask): themselves, or with DEST dest[r]
    (negative: from the end, as indexing counts; a row outside [0, S) is not stored)."""
    if DEST:
        d = tl.load(dest_ptr + rows * stride_d, mask=mask_m, other=0).to(tl.int64)
        d = tl.where(d < 0, d + S, d)
        return d, mask_m & (d >= 0) & (d < S)
    else:
        return rows, mask_m


@triton.jit
def grouped_mm_kernel(
    x_ptr, w_ptr, offs_ptr, out_ptr, rows_ptr, dest_ptr, p_ptr, bias_ptr,
    S, N, K, E, T, rows_div,
    stride_xs, stride_xk, stride_we, stride_wk, stride_wn, stride_o, stride_os, stride_on, stride_r, stride_d,
    stride_pk, p_eps,  # the rms prologue's norm weight (x without one) and eps
    stride_be, stride_bn,  # the experts' biases [E, N] (x without them)
    qz_ptr, qs_ptr, stride_qe, stride_qn, stride_qg, q_group,  # a quantized w's zero and scale tables [E, N, T]
    # epilogue operands per step k < EPILOGUE: pointer, scalar, (row, column) strides (else stand-ins)
    e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e1s0, e1s1, e2s0, e2s1, e3s0, e3s1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    PER_ROW: tl.constexpr, DOT_UPCAST: tl.constexpr, GLU: tl.constexpr = "", GLU_ROUND: tl.constexpr = "",
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1, ESWAP0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1, ESWAP1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1, ESWAP2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1, ESWAP3: tl.constexpr = False,
    EIS_SCALAR0: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EIS_SCALAR2: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False, ROWS: tl.constexpr = False,
    DEST: tl.constexpr = False, PROLOGUE: tl.constexpr = "", HAS_PW: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False, GLU_ALPHA: tl.constexpr = 1.0, GLU_LIMIT: tl.constexpr = 0.0,
    QUANT: tl.constexpr = "", QSUB_ROUND: tl.constexpr = "", QMUL_ROUND: tl.constexpr = "", QBITS: tl.constexpr = 8,
    QZERO: tl.constexpr = 0,
):
    # out[r] = x[r] @ w[e(r)], offs[e-1] <= r < offs[e]; 0 past offs[E-1]. GLU: w's N columns alternate
    # gate and up, and out[r] (N / 2 columns) = GLU(gate) * up, each rounded to GLU_ROUND first. ROWS:
    # x (T rows) is read at rows[r] // rows_div in place of r (the experts' inputs gathered in the load).
    # DEST: row r is stored at dest[r] (the rows put back in token order); the epilogue reads its
    # operands at the rows it stores, as a pointwise op over out would
    pid_n = tl.program_id(1)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if PER_ROW:
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < S
        x_rows = _x_rows(rows_ptr, stride_r, rows, mask_m, T, rows_div, ROWS)
        acc, sumsq, experts = _row_product(x_ptr, w_ptr, offs_ptr, stride_o, rows, x_rows, mask_m, offs_n, mask_n,
                                           S, K, E, stride_xs, stride_xk, stride_we, stride_wk, stride_wn, p_ptr,
                                           stride_pk, qz_ptr, qs_ptr, stride_qe, stride_qn, stride_qg, q_group,
                                           BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, PROLOGUE == "rms", HAS_PW,
                                           QUANT, QSUB_ROUND, QMUL_ROUND, QBITS, QZERO)
    else:
        expert, first, end = _segment_tile(offs_ptr, stride_o, tl.program_id(0), S, E, BLOCK_M, BLOCK_E)
        rows = first + tl.arange(0, BLOCK_M)
        mask_m = (rows >= 0) & (rows < end)
        x_rows = _x_rows(rows_ptr, stride_r, rows, mask_m, T, rows_div, ROWS)
        acc, sumsq = _segment_product(x_ptr, w_ptr, x_rows, mask_m, offs_n, mask_n, expert, K, E,
                                      stride_xs, stride_xk, stride_we, stride_wk, stride_wn, p_ptr, stride_pk,
                                      qz_ptr, qs_ptr, stride_qe, stride_qn, stride_qg, q_group,
                                      BLOCK_M, BLOCK_N, BLOCK_K, DOT_UPCAST, PROLOGUE == "rms", HAS_PW,
                                      QUANT, QSUB_ROUND, QMUL_ROUND, QBITS, QZERO)
        experts = tl.zeros([BLOCK_M], dtype=tl.int32) + expert
    if PROLOGUE == "rms":  # (x * r * w) @ W == r * ((x * w) @ W) row by row
        acc = acc * tl.rsqrt(sumsq / K + p_eps)[:, None]
    if HAS_BIAS:  # each row's expert's bias, before the gating
        acc += _expert_bias(bias_ptr, experts, mask_m, offs_n, mask_n, E, stride_be, stride_bn)
    rows, mask_m = _out_rows(dest_ptr, stride_d, rows, mask_m, S, DEST)
    if GLU == "clamped_swiglu":  # GPT-OSS's (ops.CLAMPED_SWIGLU)
        acc, offs_n, mask = _clamped_glu_tile(acc, pid_n, mask_m[:, None], N, GLU_ROUND, GLU_ALPHA, GLU_LIMIT,
                                              BLOCK_M, BLOCK_N)
    elif GLU != "":
        acc, offs_n, mask = _glu_tile(acc, pid_n, mask_m[:, None], N, GLU, GLU_ROUND, BLOCK_M, BLOCK_N)
    else:
        mask = mask_m[:, None] & mask_n[None, :]
    if EPILOGUE > 0:  # a chain that reads the result (a MoE router's weights), operands by (row, column)
        acc = _epilogue(acc, mask, rows[:, None], offs_n[None, :], 0, 0, 0,
                        e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
                        e0s0, e0s1, 0, 0, 0, e1s0, e1s1, 0, 0, 0, e2s0, e2s1, 0, 0, 0, e3s0, e3s1, 0, 0, 0,
                        EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1, EIS_SCALAR1,
                        EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
    tl.store(out_ptr + rows[:, None] * stride_os + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=mask)


# --- host launcher --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    per_row: bool


def choose_config(S, E: int, N, K, dtype: torch.dtype, prologue: bool = False, group: int | None = None) -> Config:
    """Tiles for S rows over E experts (upper bounds of dynamic sizes).

    At most the target's GEMV rows (8 on an H100), the per-row variant: the rows rounded up to a power
    of two, a K step of 512 bytes of a weight row, and columns (8 to 128) so that the products and the
    gathered weights stay within ROW_PRODUCTS each. Otherwise segment tiles as ``matmul`` chooses them
    for E products of the rows an even split gives each expert (16 rows at least, for ``tl.dot``), at
    most FP32_TILE elements under fp32 (a 128x128 fp32 tile spills registers on sm_90). With an rms
    ``prologue`` under fp32 (x's tiles rescaled in registers on their way to the dot), half that over 8
    warps: on sm_90 a 64x128 gate/up tile took all 255 registers at 4 warps, 64x64 at 4 warps 254,
    64x64 at 8 warps 127 (``scripts/compile_check.py --case moe_experts``). A quantized weight scaled by
    ``group``s of K columns (a power of two) takes K steps of at most one group."""
    cfg = _config(S, E, N, K, dtype, prologue)
    return cfg if group is None else replace(cfg, block_k=min(cfg.block_k, group))


def _config(S, E: int, N, K, dtype: torch.dtype, prologue: bool) -> Config:
    gpu = target.current()
    S, N, K = sizes.upper((S, N, K))
    itemsize = dtype.itemsize
    if S <= gpu.gemv_rows:
        block_m = sizes.next_power_of_2(max(S, 1))
        block_k = min(512 // itemsize, max(MIN_BLOCK, sizes.next_power_of_2(K)))
        block_n = max(8, min(sizes.next_power_of_2(max(N, 1)), 128, ROW_PRODUCTS // (block_m * block_k)))
        return Config(block_m, block_n, block_k, num_warps=4 if block_m * block_k * block_n <= 8192 else 8,
                      num_stages=2, per_row=True)
    rows = max(-(-S // max(E, 1)), gpu.gemv_rows + 1, MIN_BLOCK)
    cfg = matmul_config(E, rows, N, K, dtype)
    block_m, block_n = cfg.block_m, cfg.block_n
    while itemsize >= 4 and block_m * block_n > FP32_TILE // (2 if prologue else 1):  # IEEE fp32: 128x128 spills
        block_m, block_n = (block_m, block_n // 2) if block_n >= block_m else (block_m // 2, block_n)
    warps = 8 if prologue and itemsize >= 4 else cfg.num_warps
    return Config(block_m, block_n, cfg.block_k, warps, cfg.num_stages, per_row=False)


@dataclass(frozen=True)
class GroupedOp:
    """One ``grouped_mm`` launch; its launch record carries it (``LaunchRecord.op``) so that
    ``fusion.py`` can relaunch it with an epilogue, as a matmul's or a convolution's."""

    x: TRef
    w: TRef
    offs: TRef
    c: TRef  # the result
    glu: str = ""
    rows: TRef | None = None  # x read at rows[r] // rows_divisor (else at r)
    rows_divisor: int = 1
    dest: TRef | None = None  # row r stored at dest[r] (else at r)
    prologue: tuple | None = None  # ("rms", weight or None, None, eps): x is an RMSNorm's input (fusion.py)
    bias: TRef | None = None  # [E, N]: row r's expert's row added (before the gating)
    glu_args: tuple = ()  # (alpha, limit) of a "clamped_swiglu" gating
    quant: QuantWeight | None = None  # w is its q [E, K, N] viewed (bytes), dequantized in the loads

    @property
    def reads(self) -> tuple[TRef, ...]:
        norm = () if self.prologue is None or self.prologue[1] is None else (self.prologue[1],)
        tables = () if self.quant is None else self.quant.tables
        return (self.x, self.w, self.offs) + tuple(t for t in (self.rows, self.dest, self.bias) if t is not None) + norm + tables

    def _quant_args(self, k: int) -> tuple[list, dict]:
        """The kernel's ``qz_ptr, qs_ptr, stride_qe, stride_qn, stride_qg, q_group`` and constexprs."""
        if self.quant is None:
            return [self.x, self.x, 0, 0, 0, 1], {}
        return self.quant.args(k), self.quant.constexprs()

    def launch(self, out: TRef | None = None, steps=(), operands=()) -> tuple[tuple, list, dict]:
        """(grid, arguments, constexprs): storing into ``out`` (default: the result) after an epilogue
        of ``steps`` ((op, arity, swap)) reading ``operands`` (a (TRef, its (row, column) strides) pair,
        a Python scalar, or None where the step is unary)."""
        out = self.c if out is None else out
        x, w, gather, dest = self.x, self.w, self.rows, self.dest
        T, K = x.shape
        S = T if gather is None else gather.shape[0]
        E, _, N = w.shape
        quant, quant_constexprs = self._quant_args(K)
        cfg = choose_config(S, E, N, K, x.dtype, self.prologue is not None,
                            None if self.quant is None else self.quant.step_limit(K))
        rows = triton.cdiv(S, cfg.block_m) if cfg.per_row else triton.cdiv(S, cfg.block_m) + E
        rounding = round_name(x.dtype) if self.glu else ""
        epilogue, constexprs = epilogue_args(out, steps, operands, 2, dtype_name(self.c.dtype))
        kind, norm_w, _, eps = self.prologue or ("", None, None, 0.0)
        bias = self.bias
        args = [x, w, self.offs, out, x if gather is None else gather, x if dest is None else dest,
                x if norm_w is None else norm_w, x if bias is None else bias, S, N, K, E, T, self.rows_divisor,
                *x.strides, *w.strides, self.offs.strides[0], *out.strides, 1 if gather is None else gather.strides[0],
                1 if dest is None else dest.strides[0], 0 if norm_w is None else norm_w.strides[0], float(eps),
                *((0, 0) if bias is None else bias.strides), *quant, *epilogue]
        if kind:
            constexprs.update(PROLOGUE=kind, HAS_PW=norm_w is not None)
        if bias is not None:
            constexprs.update(HAS_BIAS=True)
        constexprs.update(quant_constexprs)
        if self.glu_args:
            constexprs.update(GLU_ALPHA=float(self.glu_args[0]), GLU_LIMIT=float(self.glu_args[1]))
        constexprs.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          BLOCK_E=sizes.next_power_of_2(sizes.upper(E) + 1), PER_ROW=cfg.per_row, DOT_UPCAST=False,
                          GLU=self.glu, GLU_ROUND=rounding, ROWS=gather is not None, DEST=dest is not None,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return (rows, triton.cdiv(N, cfg.block_n)), args, constexprs


def launch_grouped_mm(b, x: TRef, w: TRef, offs: TRef, out: TRef, glu: str = "", rows: TRef | None = None,
                      rows_divisor: int = 1, dest: TRef | None = None, bias: TRef | None = None,
                      glu_args: tuple = (), quant: QuantWeight | None = None) -> None:
    """``out = x [S, K] @ w [E, K, N]`` grouped by offs: one launch; with ``glu`` (an activation of
    ``ops.GROUPED_GLU_ACTS``) w's columns alternate gate and up, and out holds act(gate) * up (N / 2 columns);
    with ``rows`` [S], x [T, K] is read at floor(rows[r] / rows_divisor) for row r; with ``dest`` [S],
    row r is stored at out's row dest[r]; with ``bias`` [E, N], each row adds its expert's row;
    ``glu_args``: the (alpha, limit) of a "clamped_swiglu" gating; with ``quant``, w is its q viewed
    [E, K, N] (:func:`_weight`)."""
    op = GroupedOp(x, w, offs, out, glu, rows, rows_divisor, dest, bias=bias, glu_args=glu_args, quant=quant)
    grid, args, constexprs = op.launch()
    record = b.launch("grouped_mm", grid, *args, **constexprs)
    if record is not None:
        record.op = op  # fusion may give it an epilogue


def _weight(b, arg) -> tuple[TRef, QuantWeight | None]:
    """A grouped GEMM's weight [E, K, N], and its quantized parts when it is a ``dequant_weight``
    (transposed: read from q [E, N, K] in place, K / 2 bytes per row with 4 bits)."""
    value = b.values(arg)
    if not isinstance(value, QuantWeight):
        return b.ref(arg), None
    q = value.q
    return b.view(q, (q.shape[0], q.shape[2], q.shape[1]), (q.strides[0], q.strides[2], q.strides[1])), value


def grouped_mm(b, node):
    """``out = grouped_mm(x [S, K], w [E, K, N], offs [E])``: one launch."""
    x, w, offs = operands(node)[:3]
    w, quant = _weight(b, w)
    launch_grouped_mm(b, b.ref(x), w, b.ref(offs), b.out(node), quant=quant)


def glu_grouped_mm(b, node):
    """``tritondelegate::glu_grouped_mm(x, weight, offs, act, rows=None, rows_divisor=1)``: the gating in
    the kernel's epilogue, x's rows gathered in its loads."""
    (w, quant), rows, divisor = _weight(b, node.args[1]), *_rows(node)
    act = node.args[3]
    glu_args = (node_arg(node, 7, "alpha", 1.0), node_arg(node, 8, "limit", 0.0)) if act == CLAMPED_SWIGLU else ()
    launch_grouped_mm(b, b.ref(node.args[0]), w, b.ref(node.args[2]), b.out(node), glu=act,
                      rows=None if rows is None else b.ref(rows), rows_divisor=divisor, bias=_bias(b, node, 6),
                      glu_args=glu_args, quant=quant)


def gathered_grouped_mm(b, node):
    """``tritondelegate::gathered_grouped_mm(x, rows, rows_divisor, weight, offs)``."""
    x, rows, divisor, w, offs = node.args[:5]
    w, quant = _weight(b, w)
    launch_grouped_mm(b, b.ref(x), w, b.ref(offs), b.out(node), rows=b.ref(rows), rows_divisor=divisor,
                      bias=_bias(b, node, 5), quant=quant)


def scattered_grouped_mm(b, node):
    """``tritondelegate::scattered_grouped_mm(x, weight, offs, dest, rows=None, rows_divisor=1)``: the
    rows stored in token order, x's rows gathered in the loads."""
    (w, quant), rows, divisor = _weight(b, node.args[1]), *_rows(node)
    launch_grouped_mm(b, b.ref(node.args[0]), w, b.ref(node.args[2]), b.out(node),
                      rows=None if rows is None else b.ref(rows), rows_divisor=divisor, dest=b.ref(node.args[3]),
                      bias=_bias(b, node, 6), quant=quant)


def _bias(b, node, at: int) -> TRef | None:
    """The experts' biases of a tritondelegate grouped GEMM node (argument ``at``, or ``bias=``)."""
    bias = node_arg(node, at, "bias")
    return None if bias is None else b.ref(bias)


def _rows(node) -> tuple:
    """(rows, rows_divisor) of a glu_grouped_mm or scattered_grouped_mm node, positional or by keyword."""
    return node_arg(node, 4, "rows"), node_arg(node, 5, "rows_divisor", 1)


# --- support check --------------------------------------------------------------------------------
def supported(node) -> str | None:
    """``transformers::grouped_mm_fallback(input, weight, offs)`` and ``aten._grouped_mm(self, mat2,
    offs, bias=None, out_dtype=None)`` with a 2-D input, a 3-D weight and offs: None, or why not."""
    return _supported(*(node_value(a) for a in operands(node)), node.meta.get("val"))


def _supported(x, w, offs, bias, out, rows=None, divisor=1) -> str | None:
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32):
            return "rows must be a 1-D int64 or int32 tensor"
        if not isinstance(divisor, int) or divisor < 1:
            return f"rows_divisor {divisor!r} is not a positive int"
    if bias is not None:
        return "a bias is not supported; only input [S, K] @ weight[E, K, N] grouped by offs"
    for name, v in (("input", x), ("weight", w), ("result", out)):
        if not isinstance(v, torch.Tensor):
            return f"{name} is not a tensor"
    ranks = (x.dim(), w.dim(), offs.dim() if isinstance(offs, torch.Tensor) else None)
    if ranks != (2, 3, 1):
        given = "no offs" if ranks[2] is None else f"{ranks[2]}-D offs"
        return (f"input is {x.dim()}-D, weight {w.dim()}-D, {given}; grouped_mm takes a 2-D input [S, K], "
                "a 3-D weight [E, K, N] and 1-D offs [E]")
    if x.dtype not in DTYPES:
        return f"input has dtype {x.dtype}; grouped_mm supports {', '.join(str(d) for d in DTYPES)}"
    if w.dtype != x.dtype or out.dtype != x.dtype:
        return f"mixed dtypes: input {x.dtype}, weight {w.dtype}, result {out.dtype}"
    if offs.dtype not in OFFS_DTYPES:
        return f"offs has dtype {offs.dtype}; it must be torch.int32 or torch.int64"
    if not sizes.is_static(w.shape[0]) or w.shape[0] < 1 or offs.shape[0] != w.shape[0]:
        return f"offs has {offs.shape[0]} entries for {w.shape[0]} experts; one per expert, a static count"
    if x.shape[1] != w.shape[1]:
        return f"input has {x.shape[1]} columns but each expert's weight {w.shape[1]} rows"
    return None


def supported_glu(node) -> str | None:
    """glu_grouped_mm(x [S, K], weight [E, K, 2N], offs [E], act): as grouped_mm, and a known act."""
    if node.args[3] not in GROUPED_GLU_ACTS:
        return f"act {node.args[3]!r} is not one of {', '.join(sorted(GROUPED_GLU_ACTS))}"
    w = node_value(node.args[1])
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or not isinstance(w.shape[2], int) or w.shape[2] % 2:
        return "the weight is not [E, K, 2N] with a static, even N"
    rows, divisor = _rows(node)
    return _biased(node, 6, w) or _supported(node_value(node.args[0]), w, node_value(node.args[2]), None,
                                             node.meta.get("val"), node_value(rows), divisor)


def supported_gathered(node) -> str | None:
    """gathered_grouped_mm(x [T, K], rows [S], rows_divisor, weight [E, K, N], offs [E])."""
    x, rows, divisor, w, offs = node.args[:5]
    return _biased(node, 5, node_value(w)) or _supported(*(node_value(a) for a in (x, w, offs)), None,
                                                          node.meta.get("val"), node_value(rows), divisor)


def supported_scattered(node) -> str | None:
    """scattered_grouped_mm(x, weight [E, K, N], offs [E], dest [S], rows=None, rows_divisor=1)."""
    x, w, offs, dest = (node_value(a) for a in node.args[:4])
    rows, divisor = _rows(node)
    rows = node_value(rows)
    if not isinstance(dest, torch.Tensor) or dest.dim() != 1 or dest.dtype not in (torch.int64, torch.int32):
        return "dest must be a 1-D int64 or int32 tensor"
    count = x.shape[0] if rows is None else getattr(rows, "shape", (None,))[0]
    if sizes.shape((dest.shape[0],)) != sizes.shape((count,)):
        return f"dest has {dest.shape[0]} entries for {count} rows; one per row"
    return _biased(node, 6, w) or _supported(x, w, offs, None, node.meta.get("val"), rows, divisor)


def _biased(node, at: int, w) -> str | None:
    """Why the experts' biases (argument ``at`` or ``bias=``, optional) do not fit weight ``w``; None if they do."""
    bias = node_value(node_arg(node, at, "bias"))
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not isinstance(w, torch.Tensor) or bias.dim() != 2:
        return "the experts' bias must be a 2-D tensor [E, N]"
    if sizes.shape(bias.shape) != sizes.shape((w.shape[0], w.shape[2])) or bias.dtype != w.dtype:
        return f"the experts' bias is {bias.dtype}{list(bias.shape)}; it must be {w.dtype}[E, N] as the weight"
    return None


def operands(node) -> tuple:
    """(input, weight, offs, bias) fx arguments of either op, positional or by keyword; None if absent
    (``aten._grouped_mm`` names them self, mat2, offs, bias)."""
    names = ("input", "weight", "offs", "bias") if node.target.namespace != "aten" else ("self", "mat2", "offs", "bias")
    given = dict(zip(names, node.args))
    given.update({k: v for k, v in node.kwargs.items() if k in names})
    return tuple(given.get(n) for n in names)
