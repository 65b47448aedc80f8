"""Depthwise convolution (``groups == C_in``: one input channel per group, ``Og = C_out / groups`` output
channels each; 1-D, 2-D and 3-D, not transposed) as a direct convolution:

    out[n, co, od, oh, ow] = bias[co] + sum_{kd, kh, kw} x[n, co // Og, od*sd - pd + kd*dd, ...] * w[co, 0, kd, kh, kw]

MobileNet's and EfficientNet's inverted residuals, ConvNeXt's 7x7 and the causal conv1d of Mamba-style
and gated-delta-net language models (kernel 4 over thousands of channels) are depthwise. As an implicit
GEMM (``conv.py``) each group is a [pixels, Og] x [KD*KH*KW, Og] product: one output channel and a
handful of taps padded to tl.dot's 16 x 16 x 16 minimum, one program column per channel. Here each
program takes a [BLOCK_N output channels, BLOCK_M pixels] tile across all groups and walks the taps
with one multiply-add per tap and element in fp32: no padded dot, and one launch of a few programs
where a decode step (one pixel) had one program per channel.

Every operand is addressed by its strides (a channels-last input needs no copy); taps outside the input
are the zero padding (masked loads). The epilogue (``fusion.py``: an activation, a residual add) is the
convolution kernel's, over the same five output indices, so :class:`DepthwiseOp` relaunches with one
exactly as ``conv.ConvOp`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import triton
import triton.language as tl

from . import conv
from .conv import _coords, _epilogue_args, _ncdhw
from .elementwise import _epilogue

# Elements of the [BLOCK_N, BLOCK_M] accumulator at most: 8 per thread over 8 warps. With each thread's
# per-pixel and per-channel int64 coordinates, 80-100 registers on sm_90 (scripts/compile_check.py);
# 4096 took 155-165, 3 times the registers for 2 times the tile.
TILE = 2048


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def depthwise_conv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, H, W, OH, OW, COUT, COUT_G, TAPS,
    xs_n, xs_c, xs_h, xs_w, ws_o, ws_h, ws_w, os_n, os_c, os_h, os_w,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    e0_ptr, e1_ptr, e2_ptr, e3_ptr,  # the epilogue's operands, as conv.conv2d_kernel takes them
    e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e0s3, e1s0, e1s1, e1s2, e1s3,
    e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3,
    D, OD, xs_d, ws_d, os_d, stride_d, pad_d, dil_d, e0s4, e1s4, e2s4, e3s4,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEPTH: tl.constexpr = False,
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1, ESWAP0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1, ESWAP1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1, ESWAP2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1, ESWAP3: tl.constexpr = False,
    EIS_SCALAR0: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EIS_SCALAR2: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False,
):
    # The tile is [BLOCK_N channels, BLOCK_M pixels]: pixels last, so that threads spread over them (x and
    # out are contiguous along a row's pixels in NCHW) and each thread holds few of the per-pixel int64
    # coordinates ([BLOCK_M] vectors; pixels first, each thread held 16 of each and used 255 registers).
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    n, od, oh, ow = _coords(offs_m, OD, OH, OW, DEPTH)
    co = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = co < COUT
    x_pixels, x_channels = n * xs_n, (co // COUT_G) * xs_c  # x's offsets: per pixel, per channel
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(TAPS):  # tap (kd, kh, kw); TAPS = KD * KH * KW, at run time: a loop, not unrolled
        kh = (t // KW) % KH
        kw = t % KW
        ih = oh * stride_h - pad_h + kh * dil_h
        iw = ow * stride_w - pad_w + kw * dil_w
        real = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        offs = x_pixels + ih * xs_h + iw * xs_w
        w_offs = kh * ws_h + kw * ws_w
        if DEPTH:
            kd = t // (KH * KW)
            i_d = od * stride_d - pad_d + kd * dil_d
            real = real & (i_d >= 0) & (i_d < D)
            offs += i_d * xs_d
            w_offs += kd * ws_d
        xv = tl.load(x_ptr + x_channels[:, None] + offs[None, :], mask=mask_n[:, None] & real[None, :], other=0.0)
        wv = tl.load(w_ptr + co * ws_o + w_offs, mask=mask_n, other=0.0)
        acc += wv.to(tl.float32)[:, None] * xv.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + co, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    mask = mask_n[:, None] & mask_m[None, :]
    if EPILOGUE > 0:  # operands addressed by their strides over the output's dims
        i2, i3, i4 = oh[None, :], ow[None, :], 0
        if DEPTH:
            i2, i3, i4 = od[None, :], oh[None, :], ow[None, :]
        acc = _epilogue(acc, mask, n[None, :], co[:, None], i2, i3, i4,
                        e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
                        e0s0, e0s1, e0s2, e0s3, e0s4, e1s0, e1s1, e1s2, e1s3, e1s4,
                        e2s0, e2s1, e2s2, e2s3, e2s4, e3s0, e3s1, e3s2, e3s3, e3s4,
                        EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1, EIS_SCALAR1,
                        EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
    out_pixels = n * os_n + oh * os_h + ow * os_w
    if DEPTH:
        out_pixels += od * os_d
    tl.store(out_ptr + (co * os_c)[:, None] + out_pixels[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------------
def convolution(b, node):
    """``aten.convolution``: a depthwise one launches this kernel, any other ``conv.conv2d_kernel``."""
    conv.convolution(b, node, refine=_refine)


def _refine(op: conv.ConvOp) -> conv.ConvOp:
    """``op`` as a :class:`DepthwiseOp` when it has one input channel per group and is not transposed."""
    if op.transposed or op.x.shape[1] != op.groups:
        return op
    return DepthwiseOp(**{f.name: getattr(op, f.name) for f in fields(op)})


@dataclass(frozen=True)
class DepthwiseOp(conv.ConvOp):
    """A ``conv.ConvOp`` with one input channel per group, launched as ``depthwise_conv``."""

    kernel = "depthwise_conv"

    def launch(self, out=None, steps=(), operands=()) -> tuple[tuple, list, dict]:
        """(grid, arguments, constexprs), as ``conv.ConvOp.launch``."""
        out = self.c if out is None else out
        (n, _, d, h, w), (xs_n, xs_c, xs_d, xs_h, xs_w) = _ncdhw(self.x.shape, self.x.strides)
        (_, cout, od, oh, ow), (os_n, os_c, os_d, os_h, os_w) = _ncdhw(out.shape, out.strides)
        (_, _, kd, kh, kw), (ws_o, _, ws_d, ws_h, ws_w) = _ncdhw(self.weight.shape, self.weight.strides)
        m = n * od * oh * ow
        # Pixels first: x and out are contiguous along them (NCHW); a decode step's one pixel takes a
        # column of channels.
        block_m = conv._block(m, 1, 128)
        block_n = conv._block(cout, 16, min(256, TILE // block_m))
        grid = (triton.cdiv(m, block_m), triton.cdiv(cout, block_n))
        epilogue, fifth, constexprs = _epilogue_args(out, steps, operands, conv.dtype_name(self.c.dtype))
        lead = 3 - len(self.stride)  # (d, h, w): a 2-D convolution walks a depth of 1 with no padding
        (sd, *s_hw), (pd, *p_hw), (dd, *d_hw) = ((fill,) * lead + tuple(v) for fill, v in (
            (1, self.stride), (0, self.padding), (1, self.dilation)))
        args = [self.x, self.weight, self.bias if self.bias is not None else out, out,
                m, h, w, oh, ow, cout, cout // self.groups, kd * kh * kw, xs_n, xs_c, xs_h, xs_w, ws_o, ws_h, ws_w,
                os_n, os_c, os_h, os_w, *s_hw, *p_hw, *d_hw, *epilogue,
                d, od, xs_d, ws_d, os_d, sd, pd, dd, *fifth]
        # One stage: pipelining the tap loop would hold several [BLOCK_M, BLOCK_N] tiles in flight, and
        # each tap's loads are independent of the last one's multiply-adds anyway.
        constexprs.update(KD=kd, KH=kh, KW=kw, HAS_BIAS=self.bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                          num_warps=8, num_stages=1)
        if self.depth:
            constexprs["DEPTH"] = True
        return grid, args, constexprs
