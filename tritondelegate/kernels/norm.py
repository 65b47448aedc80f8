"""LayerNorm and RMSNorm over the trailing ``normalized_shape`` dims, weight and bias optional.

    layer_norm: mean = sum_c x_c / N     rstd = 1 / sqrt(sum_c (x_c - mean)^2 / N + eps)
                y_c = (x_c - mean) * rstd * w_c + b_c
    rms_norm:   rstd = 1 / sqrt(sum_c x_c^2 / N + eps)            y_c = x_c * rstd * w_c

One program normalizes BLOCK_R rows of the [rows, cols] view of ``rows.py``. A row that fits one
BLOCK_C chunk is loaded once and normalized in registers; a longer row is read twice: once for its
statistics (Welford chunks for layer_norm, a sum of squares for rms_norm), once to normalize. Math is
fp32. ``native_layer_norm`` also stores mean and rstd (one per row) when its graph reads them.

``fuse_rows.py`` may give a launch a pointwise prologue (x computed from a chain's operands on every
read of x) and an epilogue (a chain run on y before the store), off by default (``rows.row_load``,
``rows.row_store``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import rows as rw
from .refs import FLOAT_DTYPES, TRef, stats_read
from .rows import row_index, row_load, row_store, welford_chunk
from .sizes import upper

MAX_BLOCK_C = 4096


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def norm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr,
    rows, cols, n1, n2,
    xs0, xs1, xs2, xsc,
    os0, os1, os2, osc,
    eps,
    # a fused prologue's and epilogue's operands (rows.chain_args; stand-ins without one)
    p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_scalar, p1_scalar, p2_scalar, p3_scalar,
    p0s0, p0s1, p0s2, p0s3, p1s0, p1s1, p1s2, p1s3, p2s0, p2s1, p2s2, p2s3, p3s0, p3s1, p3s2, p3s3,
    e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e0s3, e1s0, e1s1, e1s2, e1s3, e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr,
    ONE_PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
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
        cmask = cc < cols
        mask = rmask[:, None] & cmask[None, :]
        c64 = cc.to(tl.int64)
        x = row_load(x_ptr, ix, c64[None, :], mask, xs, 0.0, pro, PRO, P_ROUND)
        if RMS:
            mean = tl.zeros([BLOCK_R], dtype=tl.float32)
            d = x
        else:
            mean = tl.sum(x, axis=1) / cols
            d = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(d * d, axis=1) / cols + eps)
        y = _affine(d * rstd[:, None], w_ptr, b_ptr, c64, cmask, HAS_W, HAS_B)
        row_store(out_ptr, ix, c64[None, :], mask, os, y, epi, EPI)
    else:
        mean = tl.zeros([BLOCK_R], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_R], dtype=tl.float32)
        n = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for start in range(0, cols, BLOCK_C):  # statistics: a sum of squares, or Welford chunks
            c = start + cc
            mask = rmask[:, None] & (c < cols)[None, :]
            x = row_load(x_ptr, ix, c.to(tl.int64)[None, :], mask, xs, 0.0, pro, PRO, P_ROUND)
            if RMS:
                acc += x * x
            else:
                mean, m2, n = welford_chunk(mean, m2, n, x, mask, tl.minimum(cols - start, BLOCK_C).to(tl.float32))
        if RMS:
            m2 = tl.sum(acc, axis=1)
        rstd = tl.rsqrt(m2 / cols + eps)
        for start in range(0, cols, BLOCK_C):
            c = start + cc
            cmask = c < cols
            mask = rmask[:, None] & cmask[None, :]
            c64 = c.to(tl.int64)
            x = row_load(x_ptr, ix, c64[None, :], mask, xs, 0.0, pro, PRO, P_ROUND)
            y = _affine((x - mean[:, None]) * rstd[:, None], w_ptr, b_ptr, c64, cmask, HAS_W, HAS_B)
            row_store(out_ptr, ix, c64[None, :], mask, os, y, epi, EPI)
    if STATS:
        tl.store(mean_ptr + r, mean.to(mean_ptr.dtype.element_ty), mask=rmask)
        tl.store(rstd_ptr + r, rstd.to(rstd_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _affine(y, w_ptr, b_ptr, c64, cmask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """y * w + b over columns ``c64``, each factor when present."""
    if HAS_W:
        y = y * tl.load(w_ptr + c64, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + c64, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return y


# --- host launcher --------------------------------------------------------------------------------
def launch_norm(b, x: TRef, normalized_ndim: int, weight: TRef | None, bias: TRef | None, eps: float,
                out: TRef, mean: TRef | None = None, rstd: TRef | None = None, rms: bool = False) -> int | None:
    """Normalize ``x`` over its last ``normalized_ndim`` dims into ``out``; ``mean``/``rstd`` (one
    per row, contiguous) are stored when given. Returns the launch's record (None: nothing to do)."""
    dims = list(range(x.ndim - normalized_ndim, x.ndim))
    x, plan = rw.lay_out(b, x, dims, [out.strides])
    if plan.cols == 0:
        return None
    # weight and bias are indexed by the row-major position in normalized_shape
    weight = b.contiguous(weight) if weight is not None else None
    bias = b.contiguous(bias) if bias is not None else None
    block_r, block_c = rw.blocks(plan, MAX_BLOCK_C)
    stats = mean is not None and rstd is not None
    # an absent operand's pointer is x or out: HAS_W, HAS_B and STATS keep the kernel off it
    w, bi = (x if t is None else t for t in (weight, bias))
    mean, rstd = (mean, rstd) if stats else (out, out)
    return b.launch(
        "norm", (triton.cdiv(plan.rows, block_r),),
        x, w, bi, out, mean, rstd,
        plan.rows, plan.cols, plan.n1, plan.n2, *plan.args(0), *plan.args(1), float(eps),
        *rw.chain_args((), x), *rw.chain_args((), out),
        RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None, STATS=stats,
        ONE_PASS=upper(plan.cols) <= block_c, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=rw.num_warps(block_r, block_c),
    )


# --- support check --------------------------------------------------------------------------------
def supported(node) -> str | None:
    tensors = [a.meta.get("val") for a in node.args if hasattr(a, "meta")]
    outs = node.meta.get("val")
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if not all(isinstance(t, torch.Tensor) for t in tensors + outs):
        return "operand or result is not a tensor"
    for t in tensors + outs:
        if t.dtype not in FLOAT_DTYPES:
            return f"dtype {t.dtype} is not supported (supported: {', '.join(map(str, FLOAT_DTYPES))})"
    return None


# --- lowerings ------------------------------------------------------------------------------------
def _opt(b, arg):
    return b.ref(arg) if arg is not None else None


def _record(record, kind: str, x, normalized_ndim: int, weight, bias, eps, out, stats: bool = False) -> None:
    """Keep what the launch computes for ``fusion.py``: a matmul that reads its result may take a norm
    over the last dim without statistics as a prologue; pointwise neighbours may fuse into any
    (``fuse_rows.py``)."""
    if record is not None:
        record.op = RowNorm(kind, x, weight, bias, float(eps), out, normalized_ndim, stats)


def _contiguous(b, t):
    return b.contiguous(t) if t is not None else None


def layer_norm(b, node):
    """layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True)"""
    x, out, ndim = b.ref(node.args[0]), b.out(node), len(node.args[1])
    weight = _contiguous(b, _opt(b, rw.node_arg(node, 2, "weight")))
    bias = _contiguous(b, _opt(b, rw.node_arg(node, 3, "bias")))
    eps = rw.node_arg(node, 4, "eps", 1e-5)
    _record(launch_norm(b, x, ndim, weight, bias, eps, out), "layer", x, ndim, weight, bias, eps, out)


def native_layer_norm(b, node):
    """native_layer_norm(x, normalized_shape, weight, bias, eps) -> (out, mean, rstd); mean and rstd
    are computed only when a later node reads them."""
    stats = stats_read(node)
    x, out, ndim, eps = b.ref(node.args[0]), b.out(node, 0), len(node.args[1]), node.args[4]
    mean, rstd = (b.out(node, 1), b.out(node, 2)) if stats else (None, None)
    weight, bias = (_contiguous(b, _opt(b, node.args[i])) for i in (2, 3))
    record = launch_norm(b, x, ndim, weight, bias, eps, out, mean, rstd)
    _record(record, "layer", x, ndim, weight, bias, eps, out, stats)


def rms_norm(b, node):
    """rms_norm(x, normalized_shape, weight=None, eps=None); eps None is fp32's machine epsilon,
    as in PyTorch (its math runs in fp32 for fp16/bf16 inputs too)."""
    eps = rw.node_arg(node, 3, "eps")
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    weight = _contiguous(b, _opt(b, rw.node_arg(node, 2, "weight")))
    x, out, ndim = b.ref(node.args[0]), b.out(node), len(node.args[1])
    _record(launch_norm(b, x, ndim, weight, None, eps, out, rms=True), "rms", x, ndim, weight, None, eps, out)


@dataclass(frozen=True)
class RowNorm:
    """What a norm launch computes (``kind`` "rms" or "layer") over the last ``ndim`` dims, storing
    mean and rstd too when ``stats``, for ``fusion.py``."""

    kind: str
    x: TRef
    weight: TRef | None
    bias: TRef | None
    eps: float
    out: TRef
    ndim: int = 1
    stats: bool = False

    @property
    def matmul_prologue(self) -> bool:
        """Whether a matmul may compute it as its prologue: over the last dim, without statistics."""
        return self.ndim == 1 and not self.stats

    @property
    def dims(self) -> tuple[int, ...]:
        """The normalized dims of x."""
        return tuple(range(self.x.ndim - self.ndim, self.x.ndim))

    @property
    def reads(self) -> tuple[TRef, ...]:
        return tuple(t for t in (self.x, self.weight, self.bias) if t is not None)

