"""2-D convolution (``aten.convolution.default``, NCHW, what ``nn.Conv2d`` exports to) as an
implicit GEMM. For each group g, with Cg = C_in / groups input and Og = C_out / groups output channels:

    out[n, g*Og + o, oh, ow] = bias[g*Og + o] + sum_k A[m, k] * B[k, o]
        m = (n, oh, ow)                       M = N * OH * OW
        k = (ci, kh, kw)                      K = Cg * KH * KW   (the weight's own layout)
        A[m, k] = x[n, g*Cg + ci, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw]   (0 in the padding)
        B[k, o] = weight[g*Og + o, ci, kh, kw]

An epilogue (``fusion.py`` folds the pointwise chain that alone reads the result into it, as for
matmuls: an activation, a residual add) runs on the tile before the store, with the steps of
``elementwise._epilogue``: each operand Ek is addressed by its own (n, c, h, w) strides (0 where it
broadcasts) or is a scalar; the result goes to the chain's output, and the convolution's own result
is never stored.

A is never materialized: each program gathers its [BLOCK_M, BLOCK_K] tile of A straight from x with
masked loads (the mask is the zero padding), so x, weight and out may have any strides (a permuted
NHWC input needs no copy). K runs over (ci, kh, kw) flattened, which keeps the tile dense when Cg is
small (a 3-channel stem, a depthwise conv); a depthwise conv still pays for a 16-wide dot on one
output channel per group (tl.dot needs every dimension >= 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import elementwise as ew
from .elementwise import _epilogue
from ..dtypes import dtype_name
from .refs import TRef, node_value
from .sizes import next_power_of_2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The K step (at most; less when C_in * KH * KW is smaller). fp32 takes 16: its IEEE dots run on the FMA
# units, and a K step of 32 next to the gathered A tile's int64 index math spilled on sm_90
# (scripts/compile_check.py, 8 warps): 64x32 3x3 with a ReLU epilogue 255 registers and 32 bytes of
# stack (106 registers and none at 16), 64x64 1x1 255 and 16 bytes (188 and none at 16). fp16/bf16
# (tensor-core dots, 206 registers at most for 64x32x32) keep 32.
K_STEP = 32
FP32_K_STEP = 16


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def conv2d_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, H, W, OH, OW, CIN_G, COUT_G,
    xs_n, xs_c, xs_h, xs_w,
    ws_o, ws_i, ws_h, ws_w,
    os_n, os_c, os_h, os_w,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    # epilogue operands per step k < EPILOGUE: pointer, scalar, (n, c, h, w) strides (else stand-ins)
    e0_ptr, e1_ptr, e2_ptr, e3_ptr,
    e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e0s3, e1s0, e1s1, e1s2, e1s3,
    e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3,
    KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_UPCAST: tl.constexpr,
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1, ESWAP0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1, ESWAP1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1, ESWAP2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1, ESWAP3: tl.constexpr = False,
    EIS_SCALAR0: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EIS_SCALAR2: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)

    # Rows: output pixels (n, oh, ow). Columns: output channels of group g.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    ow = offs_m % OW
    rest = offs_m // OW
    oh = rest % OH
    n = rest // OH
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    x_rows = x_ptr + n * xs_n + g * CIN_G * xs_c  # [BLOCK_M] pointers

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < COUT_G
    co = g * COUT_G + offs_n  # int64: absolute output channel
    w_cols = w_ptr + co * ws_o  # [BLOCK_N] pointers

    K = CIN_G * KH * KW
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        ci = (offs_k // (KH * KW)).to(tl.int64)
        kh = (offs_k // KW) % KH
        kw = offs_k % KW
        ih = ih0[:, None] + (kh * dil_h)[None, :]
        iw = iw0[:, None] + (kw * dil_w)[None, :]
        a_mask = (mask_m[:, None] & mask_k[None, :]
                  & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))
        a = tl.load(x_rows[:, None] + ci[None, :] * xs_c + ih * xs_h + iw * xs_w, mask=a_mask, other=0.0)
        w_offs = ci * ws_i + kh * ws_h + kw * ws_w
        bt = tl.load(w_cols[None, :] + w_offs[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_UPCAST:  # the Triton interpreter computes low-precision dots wrongly
            acc = tl.dot(a.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
        elif a.dtype == tl.float32:  # "ieee": full fp32 products, as eager computes them (no TF32)
            acc = tl.dot(a, bt, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, bt, acc)

    if HAS_BIAS:
        bias = tl.load(bias_ptr + co, mask=mask_n, other=0.0).to(tl.float32)
        acc += bias[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if EPILOGUE > 0:  # operands addressed by (n, c, h, w) strides
        acc = _epilogue(acc, mask, n[:, None], co[None, :], oh[:, None], ow[:, None],
                        e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
                        e0s0, e0s1, e0s2, e0s3, e1s0, e1s1, e1s2, e1s3, e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3,
                        EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1, EIS_SCALAR1,
                        EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
    out_offs = (n * os_n + oh * os_h + ow * os_w)[:, None] + (co * os_c)[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------------
def _block(size, lo: int, hi: int) -> int:
    """A power-of-two block in [lo, hi] covering ``size`` (at its upper bound when it is dynamic)."""
    return max(lo, min(hi, next_power_of_2(size)))


def _nchw(shape, strides) -> tuple[tuple, tuple]:
    """(shape, strides) of an operand as NCHW: a 1-D convolution's [N, C, L] as [N, C, 1, L]."""
    if len(shape) == 3:
        shape = (shape[0], shape[1], 1, shape[2])
    return tuple(shape), _nchw_strides(strides)


def _nchw_strides(strides) -> tuple:
    """Strides over [N, C, L] as over [N, C, 1, L] (4-D strides unchanged)."""
    return (strides[0], strides[1], 0, strides[2]) if len(strides) == 3 else tuple(strides)


@dataclass(frozen=True)
class ConvOp:
    """One ``conv2d`` launch; its launch record carries it (``LaunchRecord.op``, as a matmul's does) so that
    ``fusion.py`` can relaunch it with an epilogue (:meth:`epilogue_launch`)."""

    x: TRef
    weight: TRef
    bias: TRef | None
    c: TRef  # the result
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int

    @property
    def reads(self) -> tuple[TRef, ...]:
        return (self.x, self.weight) + ((self.bias,) if self.bias is not None else ())

    def launch(self, out: TRef | None = None, steps=(), operands=()) -> tuple[tuple, list, dict]:
        """(grid, arguments, constexprs): storing into ``out`` (default: the result) after an epilogue
        of ``steps`` ((op, arity, swap)) reading ``operands`` (a (TRef, its (n, c, h, w) strides) pair,
        a Python scalar, or None where the step is unary). 1-D operands ([N, C, L], strides (n, c, l))
        run as NCHW of height 1."""
        out = self.c if out is None else out
        x, weight = self.x, self.weight
        (n, _, h, w), x_strides = _nchw(x.shape, x.strides)
        (c_out, cin_g, kh, kw), w_strides = _nchw(weight.shape, weight.strides)
        (_, _, oh, ow), out_strides = _nchw(out.shape, out.strides)
        cout_g, m = c_out // self.groups, n * oh * ow
        block_m, block_n = _block(m, 16, 64), _block(cout_g, 16, 64)
        block_k = _block(cin_g * kh * kw, 16, FP32_K_STEP if x.dtype.itemsize >= 4 else K_STEP)
        grid = (triton.cdiv(m, block_m), triton.cdiv(cout_g, block_n), self.groups)
        operands = [(o[0], _nchw_strides(o[1])) if isinstance(o, tuple) else o for o in operands]
        epilogue, constexprs = ew.epilogue_args(out, steps, operands, 4, dtype_name(self.c.dtype))
        args = [x, weight, self.bias if self.bias is not None else out, out,  # out stands in for a missing bias
                m, h, w, oh, ow, cin_g, cout_g, *x_strides, *w_strides, *out_strides,
                *self.stride, *self.padding, *self.dilation, *epilogue]
        # 8 warps: the gathered A tile's int64 addresses and masks ([BLOCK_M, BLOCK_K] each) next to the
        # accumulator spill at 4 warps on sm_90 (scripts/compile_check.py); spread over 256 threads they fit.
        constexprs.update(KH=kh, KW=kw, HAS_BIAS=self.bias is not None,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_UPCAST=False, num_warps=8)
        return grid, args, constexprs


def launch_conv2d(b, out, x, weight, bias, stride, padding, dilation, groups: int) -> None:
    """``out = conv2d(x, weight, bias)``; every operand a 4-D NCHW TRef, or all 3-D NCL (a 1-D
    convolution, stride, padding and dilation given for (1, L)); bias 1-D or None."""
    op = ConvOp(x, weight, bias, out, tuple(stride), tuple(padding), tuple(dilation), groups)
    grid, args, constexprs = op.launch()
    record = b.launch("conv2d", grid, *args, **constexprs)
    if record is not None:
        record.op = op  # fusion may give it an epilogue


# --- support check and lowering -------------------------------------------------------------------
def _args(node):
    """convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)"""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding",
             "groups")
    return {**dict(zip(names, node.args)), **node.kwargs}


def _pair(v):
    v = list(v)
    return (v[0], v[0]) if len(v) == 1 else tuple(v)


def supported(node) -> str | None:
    a = _args(node)
    if a.get("transposed"):
        return "transposed convolution is not supported"
    x, weight, bias = (node_value(t) for t in (a["input"], a["weight"], a.get("bias")))
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "input or weight is not a tensor"
    if weight.dim() not in (3, 4):
        return f"{weight.dim() - 2}-D convolution is not supported (1-D and 2-D only)"
    if x.dim() != weight.dim():
        return f"convolution input of rank {x.dim()} with a {weight.dim()}-D weight (NCL or NCHW, batched)"
    for name, t in (("input", x), ("weight", weight), ("bias", bias), ("output", node.meta.get("val"))):
        if t is None and name == "bias" and a.get("bias") is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dtype not in FLOAT_DTYPES:
            return (f"{name} dtype {t.dtype} is not supported "
                    f"(supported: {', '.join(map(str, FLOAT_DTYPES))})")
    if weight.dtype != x.dtype:
        return f"input dtype {x.dtype} and weight dtype {weight.dtype} differ"
    return None


def convolution(b, node):
    """2-D convolution, and 1-D (Whisper's, wav2vec's front ends) as 2-D over a height of 1."""
    a = _args(node)
    bias = a.get("bias")
    out, x, weight = b.out(node), b.ref(a["input"]), b.ref(a["weight"])
    stride, padding, dilation = _pair(a["stride"]), _pair(a["padding"]), _pair(a["dilation"])
    if weight.ndim == 3:  # a 2-D convolution of height 1 (ConvOp walks [N, C, L] as [N, C, 1, L])
        stride, padding, dilation = (1, stride[0]), (0, padding[0]), (1, dilation[0])
    launch_conv2d(b, out, x, weight, b.ref(bias) if bias is not None else None, stride, padding, dilation,
                  int(a["groups"]))
