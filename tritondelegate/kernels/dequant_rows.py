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
from ..dtypes import dtype_name
from .elementwise import _epilogue, epilogue_args
from .matmul import QuantWeight, _dequant
from .refs import TRef

BLOCK_ELEMENTS = 2048  # rows x columns per program (at 4096 a 4-bit prefill's launch spilled 48 B of stack on sm_90)


@triton.jit
def dequant_rows_kernel(
    out_ptr, q_ptr, idx_ptr, R, D, V, stride_qv, stride_qd, stride_i,
    qz_ptr, qs_ptr, stride_zv, stride_zg, q_group,  # the zero and scale tables [V, D / q_group] (QuantWeight.args)
    # epilogue operands per step k < EPILOGUE: pointer, scalar, (row, column) strides (else stand-ins)
    e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e1s0, e1s1, e2s0, e2s1, e3s0, e3s1,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
    QSUB_ROUND: tl.constexpr = "", QMUL_ROUND: tl.constexpr = "", QBITS: tl.constexpr = 8, QZERO: tl.constexpr = 0,
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1, ESWAP0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1, ESWAP1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1, ESWAP2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1, ESWAP3: tl.constexpr = False,
    EIS_SCALAR0: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EIS_SCALAR2: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False,
):
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
                 QBITS, QZERO)
    w = tl.where(mask, w, 0.0)
    stored = mask_r[:, None] & mask_d[None, :]
    if EPILOGUE > 0:  # a chain that reads the rows (Gemma's scale, GPT-2's position rows), operands by (row, column)
        w = _epilogue(w, stored, rows[:, None], cols[None, :], 0, 0, 0,
                      e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
                      e0s0, e0s1, 0, 0, 0, e1s0, e1s1, 0, 0, 0, e2s0, e2s1, 0, 0, 0, e3s0, e3s1, 0, 0, 0,
                      EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1, EIS_SCALAR1,
                      EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=stored)


@dataclass(frozen=True)
class DequantRowsOp:
    """One ``dequant_rows`` launch: ``out`` [*idx.shape, D] (contiguous) from the quantized table. Its
    launch record carries it so that ``fusion.py`` can relaunch it with an epilogue, as a GEMM's."""

    out: TRef
    table: QuantWeight
    idx: TRef

    @property
    def c(self) -> TRef:  # the result (fusion.py's name for it)
        return self.out

    @property
    def reads(self) -> tuple[TRef, ...]:
        return (self.table.q, *self.table.tables, self.idx)

    def launch(self, out: TRef | None = None, steps=(), operands=()) -> tuple[tuple, list, dict] | None:
        """(grid, arguments, constexprs): storing into ``out`` (contiguous; default: the result) after an
        epilogue of ``steps`` ((op, arity, swap)) reading ``operands`` (a (TRef, its strides over out's
        shape) pair, a Python scalar, or None); None when an operand's leading dims do not merge into rows."""
        out = self.out if out is None else out
        rows = [(o[0], _row_strides(out.shape, o[1])) if isinstance(o, tuple) else o for o in operands]
        if not out.is_contiguous() or any(isinstance(o, tuple) and o[1] is None for o in rows):
            return None
        epilogue, chain = epilogue_args(out, steps, rows, 2, dtype_name(self.out.dtype))
        q, table = self.table.q, self.table
        V, D = q.shape[0], self.out.shape[-1]
        R = math.prod(self.idx.shape)
        block_d = min(sizes.next_power_of_2(D), 1024)
        block_r = max(1, min(sizes.next_power_of_2(R), BLOCK_ELEMENTS // block_d))
        idx_stride = self.idx.strides[-1] if self.idx.ndim else 0
        args = [out, q, self.idx, R, D, V, *q.strides, idx_stride, *table.args(D), *epilogue]
        constexprs = dict(BLOCK_R=block_r, BLOCK_D=block_d, **table.constexprs(), **chain)
        return (triton.cdiv(R, block_r), triton.cdiv(D, block_d)), args, constexprs


def _row_strides(shape, strides) -> tuple | None:
    """An operand's (row, column) strides over [*lead, D] with the lead dims merged into rows, or None
    when its strides do not merge them."""
    lead = [(n, s) for n, s in zip(shape[:-1], strides[:-1]) if n != 1]
    for (_, outer), (n, inner) in zip(lead, lead[1:]):
        if outer != inner * n:
            return None
    return (lead[-1][1] if lead else 0, strides[-1])


def launch_dequant_rows(b, out: TRef, table: QuantWeight, idx: TRef) -> None:
    """``out = table[idx]`` dequantized; the indices are read through their last stride, so they must be
    1-D or contiguous (a view the builder made contiguous otherwise)."""
    if idx.ndim > 1 and not idx.is_contiguous():
        idx = b.contiguous(idx)
    op = DequantRowsOp(out, table, idx)
    grid, args, constexprs = op.launch()
    record = b.launch("dequant_rows", grid, *args, **constexprs)
    if record is not None:
        record.op = op  # fusion may give it an epilogue
