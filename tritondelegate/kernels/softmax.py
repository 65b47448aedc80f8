"""Softmax and log-softmax along any one dim, on the [rows, cols] view of ``rows.py``.

    m = max_c x_c        s = sum_c exp(x_c - m)
    softmax:     y_c = exp(x_c - m) / s
    log_softmax: y_c = x_c - m - log(s)

A row that fits one BLOCK_C chunk is loaded once and normalized in registers. A longer row takes two
passes: the first keeps a running max and a running sum rescaled whenever the max grows (online
softmax, s <- s exp(m_old - m_new) + sum exp(x - m_new)), the second writes y. Math is fp32; the
result is cast to the output dtype (fp32 for ``half_to_float`` or a ``dtype`` argument).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import rows as rw
from .refs import FLOAT_DTYPES, TRef
from .rows import row_offsets
from .sizes import upper

MAX_BLOCK_C = 4096


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def softmax_kernel(
    x_ptr, out_ptr,
    rows, cols, n1, n2,
    xs0, xs1, xs2, xsc,
    os0, os1, os2, osc,
    LOG: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    x_row = x_ptr + row_offsets(r, n1, n2, xs0, xs1, xs2)[:, None]
    out_row = out_ptr + row_offsets(r, n1, n2, os0, os1, os2)[:, None]
    cc = tl.arange(0, BLOCK_C)
    if ONE_PASS:
        mask = rmask[:, None] & (cc < cols)[None, :]
        c64 = cc.to(tl.int64)[None, :]
        x = tl.load(x_row + c64 * xsc, mask=mask, other=float("-inf")).to(tl.float32)
        z = x - tl.max(x, axis=1)[:, None]
        e = tl.exp(z)
        s = tl.sum(e, axis=1)[:, None]
        if LOG:
            y = z - tl.log(s)
        else:
            y = e / s
        tl.store(out_row + c64 * osc, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, cols, BLOCK_C):
            c = start + cc
            mask = rmask[:, None] & (c < cols)[None, :]
            x = tl.load(x_row + c.to(tl.int64)[None, :] * xsc, mask=mask, other=float("-inf")).to(tl.float32)
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
            x = tl.load(x_row + c64 * xsc, mask=mask, other=float("-inf")).to(tl.float32)
            if LOG:
                y = x - bias[:, None]
            else:
                y = tl.exp(x - m[:, None]) * inv[:, None]
            tl.store(out_row + c64 * osc, y.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------------
def launch_softmax(b, x: TRef, dim: int, out: TRef, log: bool) -> None:
    dim = dim % x.ndim if x.ndim else 0
    dims = [dim] if x.ndim else []
    x, plan = rw.lay_out(b, x, dims, [out.strides])
    if plan.cols == 0:
        return
    block_r, block_c = rw.blocks(plan, MAX_BLOCK_C)
    b.launch(
        "softmax", (triton.cdiv(plan.rows, block_r),),
        x, out, plan.rows, plan.cols, plan.n1, plan.n2, *plan.args(0), *plan.args(1),
        LOG=log, ONE_PASS=upper(plan.cols) <= block_c, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=rw.num_warps(block_r, block_c),
    )


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
