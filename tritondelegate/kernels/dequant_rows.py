"""An embedding table kept weight-only quantized: the looked-up rows gathered and dequantized in one launch.

    out[r, d] = dequant(q[idx[r], d])      r < R (the indices, flattened), d < D

``q`` is the table's integers [V, D] (int8 or uint8, or two 4-bit values per byte, [V, D / 2]), with
its zero and scale tables [V, D / G] (``tritondelegate::dequant_weight``, ``passes/quant_weights.py``);
each value is dequantized as the matmul kernel dequantizes a weight tile (``matmul._dequant``: the
model's own arithmetic and rounding), so the rows are the float table's bit for bit. An index outside
[0, V) (eager raises) gives a row of zeros, never a read outside the table. A tied model's table and its
LM head read the same integers: the LM head as a quantized linear, the lookups here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import triton
import triton.language as tl

from . import sizes
from .matmul import QuantWeight, _dequant
from .refs import TRef

BLOCK_ELEMENTS = 2048  # rows x columns per program (at 4096 a 4-bit prefill's launch spilled 48 B of stack on sm_90)


@triton.jit
def dequant_rows_kernel(out_ptr, q_ptr, qz_ptr, qs_ptr, idx_ptr, R, D, V, stride_qv, stride_qd,
                        stride_zv, stride_zg, q_group, stride_i,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                        QSUB_ROUND: tl.constexpr = "", QMUL_ROUND: tl.constexpr = "", QBITS: tl.constexpr = 8):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_r = rows < R
    mask_d = cols < D
    v = tl.load(idx_ptr + rows * stride_i, mask=mask_r, other=0).to(tl.int64)
    live = mask_r & (v >= 0) & (v < V)
    mask = live[:, None] & mask_d[None, :]
    if QBITS == 4:  # two columns per byte, the even one in the low nibble
        q = tl.load(q_ptr + v[:, None] * stride_qv + (cols // 2)[None, :] * stride_qd, mask=mask, other=0)
    else:
        q = tl.load(q_ptr + v[:, None] * stride_qv + cols[None, :] * stride_qd, mask=mask, other=0)
    at = v[:, None] * stride_zv + (cols // q_group)[None, :] * stride_zg
    w = _dequant(q, ((cols % 2) * 4).to(tl.int32)[None, :], at, mask, qz_ptr, qs_ptr, QUANT, QSUB_ROUND, QMUL_ROUND,
                 QBITS)
    w = tl.where(mask, w, 0.0)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_d[None, :])


@dataclass(frozen=True)
class DequantRowsOp:
    """One ``dequant_rows`` launch: ``out`` [*idx.shape, D] (contiguous) from the quantized table."""

    out: TRef
    table: QuantWeight
    idx: TRef

    def launch(self) -> tuple[tuple, list, dict]:
        q, table = self.table.q, self.table
        V, D = q.shape[0], self.out.shape[-1]
        R = math.prod(self.idx.shape)
        block_d = min(sizes.next_power_of_2(D), 1024)
        block_r = max(1, min(sizes.next_power_of_2(R), BLOCK_ELEMENTS // block_d))
        first = table.tables[0] if table.tables else q
        strides = first.strides if table.tables else (0, 0)
        idx_stride = self.idx.strides[-1] if self.idx.ndim else 0
        args = [self.out, q, table.zero or first, table.scale or first, self.idx, R, D, V, *q.strides, *strides,
                table.group(D), idx_stride]
        constexprs = dict(BLOCK_R=block_r, BLOCK_D=block_d, **table.constexprs())
        return (triton.cdiv(R, block_r), triton.cdiv(D, block_d)), args, constexprs


def launch_dequant_rows(b, out: TRef, table: QuantWeight, idx: TRef) -> None:
    """``out = table[idx]`` dequantized; the indices are read through their last stride, so they must be
    1-D or contiguous (a view the builder made contiguous otherwise)."""
    if idx.ndim > 1 and not idx.is_contiguous():
        idx = b.contiguous(idx)
    grid, args, constexprs = DequantRowsOp(out, table, idx).launch()
    b.launch("dequant_rows", grid, *args, **constexprs)
