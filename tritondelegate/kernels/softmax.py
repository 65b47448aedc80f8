"""Softmax and log-softmax along any one dim, on the [rows, cols] view of ``rows.py``.

    m = max_c x_c        s = sum_c exp(x_c - m)
    softmax:     y_c = exp(x_c - m) / s
    log_softmax: y_c = x_c - m - log(s)

A row that fits one BLOCK_C chunk is loaded once and normalized in registers. A longer row takes two
passes: the first keeps a running max and a running sum rescaled whenever the max grows (online
softmax, s <- s exp(m_old - m_new) + sum exp(x - m_new)), the second writes y. Math is fp32; the
result is cast to the output dtype (fp32 for ``half_to_float`` or a ``dtype`` argument). A launch may
take a pointwise prologue and epilogue (``fuse_rows.py``), as a norm does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import rows as rw
from .refs import FLOAT_DTYPES, TRef
from .rows import row_index, row_load, row_store
from .sizes import upper

MAX_BLOCK_C = 4096


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def softmax_kernel(
    x_ptr, out_ptr,
    rows, cols, n1, n2,
    xs0, xs1, xs2, xsc,
    os0, os1, os2, osc,
    # a fused prologue's and epilogue's operands (rows.chain_args; stand-ins without one)
    p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_scalar, p1_scalar, p2_scalar, p3_scalar,
    p0s0, p0s1, p0s2, p0s3, p1s0, p1s1, p1s2, p1s3, p2s0, p2s1, p2s2, p2s3, p3s0, p3s1, p3s2, p3s3,
    e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e0s3, e1s0, e1s1, e1s2, e1s3, e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3,
    LOG: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    PROLOGUE: tl.constexpr = 0, P_ROUND: tl.constexpr = "",
    POP0: tl.constexpr = "copy", PARITY0: tl.constexpr = 1, PSWAP0: tl.constexpr = False, PIS_SCALAR0: tl.constexpr = False,
    POP1: tl.constexpr = "copy", PARITY1: tl.constexpr = 1, PSWAP1: tl.constexpr = False, PIS_SCALAR1: tl.constexpr = False,
    POP2: tl.constexpr = "copy", PARITY2: tl.constexpr = 1, PSWAP2: tl.constexpr = False, PIS_SCALAR2: tl.constexpr = False,
    POP3: tl.constexpr = "copy", PARITY3: tl.constexpr = 1, PSWAP3: tl.constexpr = False, PIS_SCALAR3: tl.constexpr = False,
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1, ESWAP0: tl.constexpr = False, EIS_SCALAR0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1, ESWAP1: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1, ESWAP2: tl.constexpr = False, EIS_SCALAR2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1, ESWAP3: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    ix = row_index(r, n1, n2)
    xs, os = (xs0, xs1, xs2, xsc), (os0, os1, os2, osc)
    pro = (p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_scalar, p1_scalar, p2_scalar, p3_scalar, p0s0, p0s1, p0s2, p0s3,
           p1s0, p1s1, p1s2, p1s3, p2s0, p2s1, p2s2, p2s3, p3s0, p3s1, p3s2, p3s3)
    epi = (e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar, e0s0, e0s1, e0s2, e0s3,
           e1s0, e1s1, e1s2, e1s3, e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3)
    PRO: tl.constexpr = (PROLOGUE, "", POP0, PARITY0, PSWAP0, PIS_SCALAR0, POP1, PARITY1, PSWAP1, PIS_SCALAR1,
                         POP2, PARITY2, PSWAP2, PIS_SCALAR2, POP3, PARITY3, PSWAP3, PIS_SCALAR3)
    EPI: tl.constexpr = (EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1, EIS_SCALAR1,
                         EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
    cc = tl.arange(0, BLOCK_C)
    if ONE_PASS:
        mask = rmask[:, None] & (cc < cols)[None, :]
        c64 = cc.to(tl.int64)[None, :]
        x = row_load(x_ptr, ix, c64, mask, xs, float("-inf"), pro, PRO, P_ROUND)
        z = x - tl.max(x, axis=1)[:, None]
        e = tl.exp(z)
        s = tl.sum(e, axis=1)[:, None]
        if LOG:
            y = z - tl.log(s)
        else:
            y = e / s
        row_store(out_ptr, ix, c64, mask, os, y, epi, EPI)
    else:
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, cols, BLOCK_C):
            c = start + cc
            mask = rmask[:, None] & (c < cols)[None, :]
            x = row_load(x_ptr, ix, c.to(tl.int64)[None, :], mask, xs, float("-inf"), pro, PRO, P_ROUND)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            # while a row has seen only -inf, shift by 0 so that exp(-inf - -inf) never makes a NaN
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
            m = m_new
        if LOG:
            bias = m + tl.log(s)
        else:
            inv = 1.0 / s
        for start in range(0, cols, BLOCK_C):
            c = start + cc
            mask = rmask[:, None] & (c < cols)[None, :]
            c64 = c.to(tl.int64)[None, :]
            x = row_load(x_ptr, ix, c64, mask, xs, float("-inf"), pro, PRO, P_ROUND)
            if LOG:
                y = x - bias[:, None]
            else:
                y = tl.exp(x - m[:, None]) * inv[:, None]
            row_store(out_ptr, ix, c64, mask, os, y, epi, EPI)


# --- host launcher --------------------------------------------------------------------------------
def launch_softmax(b, x: TRef, dim: int, out: TRef, log: bool) -> None:
    dim = dim % x.ndim if x.ndim else 0
    dims = [dim] if x.ndim else []
    x, plan = rw.lay_out(b, x, dims, [out.strides])
    if plan.cols == 0:
        return
    block_r, block_c = rw.blocks(plan, MAX_BLOCK_C)
    record = b.launch(
        "softmax", (triton.cdiv(plan.rows, block_r),),
        x, out, plan.rows, plan.cols, plan.n1, plan.n2, *plan.args(0), *plan.args(1),
        *rw.chain_args((), x), *rw.chain_args((), out),
        LOG=log, ONE_PASS=upper(plan.cols) <= block_c, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=rw.num_warps(block_r, block_c),
    )
    if record is not None and x.ndim:
        record.op = RowSoftmax(x, out, tuple(dims))


# --- support check --------------------------------------------------------------------------------
def supported(node) -> str | None:
    x = getattr(node.args[0], "meta", {}).get("val")
    out = node.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return "operand or result is not a tensor"
    for what, v in (("input", x), ("result", out)):
        if v.dtype not in FLOAT_DTYPES:
            return f"{what} dtype {v.dtype} is not supported (supported: {', '.join(map(str, FLOAT_DTYPES))})"
    return None


# --- lowerings ------------------------------------------------------------------------------------
def softmax(log: bool):
    """_softmax(x, dim, half_to_float), softmax.int(x, dim, dtype=None), and the log variants; the
    result dtype (fp32 for half_to_float, or ``dtype``) comes from the node."""

    def lower(b, node):
        launch_softmax(b, b.ref(node.args[0]), node.args[1], b.out(node), log)

    return lower


@dataclass(frozen=True)
class RowSoftmax:
    """What a softmax launch computes: ``out`` from ``x`` over ``dims``, for ``fusion.py``."""

    x: TRef
    out: TRef
    dims: tuple[int, ...]

    @property
    def reads(self) -> tuple[TRef, ...]:
        return (self.x,)
