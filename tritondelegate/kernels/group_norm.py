"""``native_group_norm``: each (sample, group) normalized over its channels and positions, then the
per-channel affine, computed as eager's CPU kernel computes it:

    var, mean = welford(x[n, group g])                       over C / G channels x HxW positions
    rstd      = 1 / sqrt(var + eps)
    scale     = rstd[n, g(c)] * weight[c]                    (rstd without a weight)
    shift     = bias[c] - mean[n, g(c)] * scale[n, c]        (-mean * scale without a bias)
    out       = x * scale[n, c] + shift[n, c]

so an inf or NaN in x, weight or bias gives eager's NaNs. Two launches: the statistics (``reduce``'s
welford over x seen as [N * G, C / G * HxW]), then ``norm_apply`` over x, which computes rstd, scale and
shift of each row (n, c) from the statistics and reads each element of x once, rounding once to the
result's dtype. GroupNorm is wav2vec2's feature extractor's, BiT's and diffusion UNets' norm.

``norm_apply`` serves every norm whose statistics another launch computed (``batch_stats.py``: instance
norm, batch norm in training mode): the rows of its [rows, cols] walk (``rows.py``) are the (n, c) of x
[N, C, *] in row-major order, its columns the positions, and row (n, c) reads the statistics at

    n * sample_stride + c // per             (group norm: G, C / G;  batch norm: 0, 1)

It is a row kernel: ``fuse_rows.py`` gives it the pointwise chain that alone reads its result as an
epilogue (a UNet's GroupNorm -> SiLU is one launch after the statistics) and the one that alone feeds
it as a prologue. Where a 1x1 convolution alone reads its result (or such a chain's), the convolution
computes it instead, tile by tile (``fuse_conv1x1.claim_norms``: BiT's pre-activation GroupNorm and ReLU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import elementwise as ew
from . import reduce as red
from . import rows as rw
from .refs import FLOAT_DTYPES, TRef, node_value, stats_read
from .rows import row_index, row_load, row_store

STATS = torch.float32  # the statistics and the per-channel scale and shift, as eager's opmath
MAX_BLOCK_C = 1024


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def scale_shift(var_ptr, mean_ptr, stat, stat_mask, w_ptr, b_ptr, channel, channel_mask, eps,
                HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """(scale, shift) in fp32 as eager computes them from the statistics at ``stat`` and the weight and
    bias at ``channel`` (broadcast together): ``rstd = 1 / sqrt(var + eps)``, ``scale = rstd * w``,
    ``shift = b - mean * scale`` (``-(mean * scale)`` without a bias). ``fuse_conv1x1`` uses it too."""
    var = tl.load(var_ptr + stat, mask=stat_mask, other=1.0).to(tl.float32)
    mean = tl.load(mean_ptr + stat, mask=stat_mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(var + eps)
    if HAS_W:
        scale = scale * tl.load(w_ptr + channel, mask=channel_mask, other=0.0).to(tl.float32)
    shift = -(scale * mean)
    if HAS_B:
        shift = tl.load(b_ptr + channel, mask=channel_mask, other=0.0).to(tl.float32) - scale * mean
    return scale, shift


@triton.jit
def norm_apply_kernel(
    x_ptr, out_ptr, var_ptr, mean_ptr, w_ptr, b_ptr,
    rows, cols, n1, n2,
    xs0, xs1, xs2, xsc,
    os0, os1, os2, osc,
    channels, per, sample_stride, eps,
    # a fused prologue's and epilogue's operands (rows.chain_args; stand-ins without one)
    p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_scalar, p1_scalar, p2_scalar, p3_scalar,
    p0s0, p0s1, p0s2, p0s3, p1s0, p1s1, p1s2, p1s3, p2s0, p2s1, p2s2, p2s3, p3s0, p3s1, p3s2, p3s3,
    e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e0s3, e1s0, e1s1, e1s2, e1s3, e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
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
    """out[n, c, p] = x[n, c, p] * scale + shift, scale and shift of row (n, c) computed from var and
    mean in fp32 as eager computes them; a [BLOCK_R, BLOCK_C] tile per program, grid (row blocks,
    column blocks)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    ix = row_index(r, n1, n2)
    c = (tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = rmask[:, None] & (c < cols)
    pro = (p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_scalar, p1_scalar, p2_scalar, p3_scalar, p0s0, p0s1, p0s2, p0s3,
           p1s0, p1s1, p1s2, p1s3, p2s0, p2s1, p2s2, p2s3, p3s0, p3s1, p3s2, p3s3)
    epi = (e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar, e0s0, e0s1, e0s2, e0s3,
           e1s0, e1s1, e1s2, e1s3, e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3)
    PRO: tl.constexpr = (PROLOGUE, "", POP0, PARITY0, PSWAP0, PIS_SCALAR0, POP1, PARITY1, PSWAP1, PIS_SCALAR1,
                         POP2, PARITY2, PSWAP2, PIS_SCALAR2, POP3, PARITY3, PSWAP3, PIS_SCALAR3)
    EPI: tl.constexpr = (EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1, EIS_SCALAR1,
                         EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
    x = row_load(x_ptr, ix, c, mask, (xs0, xs1, xs2, xsc), 0.0, pro, PRO, P_ROUND)
    channel = r % channels
    stat = (r // channels) * sample_stride + channel // per
    scale, shift = scale_shift(var_ptr, mean_ptr, stat, rmask, w_ptr, b_ptr, channel, rmask, eps, HAS_W, HAS_B)
    y = x * scale[:, None] + shift[:, None]
    row_store(out_ptr, ix, c, mask, (os0, os1, os2, osc), y, epi, EPI)


# --- host launcher --------------------------------------------------------------------------------
@dataclass(frozen=True)
class NormApply:
    """What a ``norm_apply`` launch computes, for ``fusion.py``: ``out`` from ``x`` [N, C, *] and the
    statistics ``var`` and ``mean`` (contiguous, row (n, c)'s at ``n * sample_stride + c // per``), the
    per-channel ``weight`` and ``bias`` (either None); ``dims`` are the positions' dims (the columns of
    its rows walk). ``fuse_conv1x1.py`` computes it where a 1x1 convolution reads its result."""

    x: TRef
    out: TRef
    dims: tuple[int, ...]
    var: TRef
    mean: TRef
    weight: TRef | None
    bias: TRef | None
    eps: float
    per: int
    sample_stride: int
    channels: object = None  # the rows a sample holds when not x's channels (an instance norm's N * C)

    @property
    def reads(self) -> tuple[TRef, ...]:
        return tuple(t for t in (self.x, self.var, self.mean, self.weight, self.bias) if t is not None)

    def args(self, stand_in: TRef) -> list:
        """var, mean, weight and bias (``stand_in`` where absent), per, sample_stride and eps: the order
        both kernels that apply it take them in."""
        w, b = (stand_in if t is None else t for t in (self.weight, self.bias))
        return [self.var, self.mean, w, b, self.per, self.sample_stride, float(self.eps)]


def launch_apply(b, x: TRef, out: TRef, stats: tuple[TRef, TRef], affine: tuple, eps: float,
                 per: int, sample_stride: int, channels=None) -> None:
    """``out = x * scale + shift`` over x [N, C, *], scale and shift of (n, c) from ``stats`` (var,
    mean: contiguous, at ``n * sample_stride + c // per``) and ``affine`` (weight, bias [C], each
    optional). ``channels``: the kernel's channel count when not C (then the rows are (n, c) of
    [N * C / channels, channels] and every index above reads that way)."""
    dims = tuple(range(2, x.ndim))
    x, plan = rw.lay_out(b, x, dims, [out.strides])
    var, mean = (b.contiguous(t) for t in stats)
    weight, bias = (None if t is None else b.contiguous(t) for t in affine)
    op = NormApply(x, out, dims, var, mean, weight, bias, float(eps), per, sample_stride, channels)
    block_r, block_c = rw.blocks(plan, MAX_BLOCK_C)
    grid = (triton.cdiv(plan.rows, block_r), triton.cdiv(plan.cols, block_c))
    var, mean, w, bi, per, sample_stride, eps = op.args(x)  # stand-ins: HAS_W and HAS_B keep off them
    record = b.launch(
        "norm_apply", grid, x, out, var, mean, w, bi, plan.rows, plan.cols, plan.n1, plan.n2,
        *plan.args(0), *plan.args(1), x.shape[1] if channels is None else channels, per, sample_stride, eps,
        *rw.chain_args((), x), *rw.chain_args((), out),
        HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=rw.num_warps(block_r, block_c))
    if record is not None:
        record.op = op


# --- lowering -------------------------------------------------------------------------------------
def native_group_norm(b, node):
    """native_group_norm(x [N, C, *], weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)."""
    x, weight, bias, _, channels, _, groups, eps = node.args
    x = b.contiguous(b.ref(x))
    weight, bias = (None if t is None else b.ref(t) for t in (weight, bias))
    n, per = x.shape[0], channels // groups
    positions = math.prod(x.shape[2:])
    var, mean = (b.alloc((n * groups,), STATS) for _ in range(2))
    red.launch_reduce(b, b.view(x, (n * groups, per * positions), (per * positions, 1)), [1], var, mean,
                      combine="welford", divisor=per * positions)
    launch_apply(b, x, b.out(node, 0), (var, mean), (weight, bias), eps, per, groups)
    if stats_read(node):
        shifted = b.alloc((n * groups,), STATS)
        ew.launch_pointwise(b, "add", shifted, [var, float(eps)])
        ew.launch_pointwise(b, "rsqrt", b.view(b.out(node, 2), (n * groups,), (1,)), [shifted])
        ew.launch_pointwise(b, "copy", b.out(node, 1), [b.view(mean, (n, groups), (groups, 1))])


def supported(node) -> str | None:
    x = node.args[0].meta.get("val")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return "the input is not a tensor of [N, C, ...]"
    groups = node.args[6]
    if not isinstance(groups, int) or not isinstance(x.shape[1], int) or x.shape[1] % groups:
        return f"{x.shape[1]} channels in {groups} groups"
    tensors = [node_value(a) for a in node.args[:3] if a is not None]
    outs = node.meta.get("val")
    for t in [*tensors, *(outs if isinstance(outs, (tuple, list)) else [outs])]:
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            return f"operand or result {getattr(t, 'dtype', t)} is not a floating-point tensor"
    return None
