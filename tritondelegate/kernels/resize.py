"""Resizing (``F.interpolate``, ``nn.Upsample``): upsample_nearest{1,2,3}d, _upsample_nearest_exact{1,2,3}d,
upsample_linear1d, upsample_bilinear2d, upsample_trilinear3d and upsample_bicubic2d, one launch each.

The input is read through its strides as [N, C, D, H, W] (a 1-D or 2-D resize has size-1 leading spatial
dims, never interpolated); each output element is computed from its own taps. Per interpolated dim, with
input size ``in``, output size ``out`` and output index ``o``, in fp32 as eager's CPU kernels compute it
(ATen's UpSample.h, UpSampleKernel.cpp):

    scale    = (in - 1) / (out - 1), or 0 when out == 1            with align_corners (linear, cubic)
             = 1 / scale_factor                                    else, when a scale factor > 0 is given
             = in / out                                            else
    nearest:        i = min(floor(o * scale), in - 1)
                    (upsample_nearest2d only: i = o when out == in, o // 2 when out == 2 * in)
    nearest-exact:  i = min(floor((o + 0.5) * scale), in - 1)
    linear:         s = scale * o with align_corners, else max(scale * (o + 0.5) - 0.5, 0) (one rounding,
                    a fused multiply-add, as eager's CPU build computes it)
                    i0 = min(floor(s), in - 1), i1 = i0 + (i0 < in - 1), l = clamp(s - i0, 0, 1)
                    (i0 = i1 = o and l = 0 when out == in)
                    out = v(i0) * (1 - l) + v(i1) * l
    cubic (A = -0.75): s as linear but not clamped at 0; i = min(floor(s), in - 1), f = clamp(s - i, 0, 1)
                    taps clamp(i - 1 + k, 0, in - 1) for k < 4, weights
                    w0 = c2(f + 1), w1 = c1(f), w2 = c1(1 - f), w3 = c2(2 - f), where
                    c1(x) = ((A + 2) x - (A + 3)) x^2 + 1 and c2(x) = ((A x - 5A) x + 8A) x - 4A
                    out = sum_k v(tap k) * w_k

where v(i) is the input (nearest) or, for a further interpolated dim, the same combination over the next
dim at index i: the outer dim's weights apply to the inner dims' results, as eager nests them. Every tap is
loaded and weighted, a zero weight included (eager's NaN and inf propagate the same way); values are
accumulated in fp32 and stored in the output's dtype (nearest copies the value itself). Sizes are launch
arguments (symbolic at a dynamic size); the scale is computed from them in the kernel unless a scale
factor sets it (``ratio``).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import elementwise as ew
from .refs import FLOAT_DTYPES, node_value
from .sizes import next_power_of_2

# ATen op name -> (MODE, spatial dims, SHORTCUTS). upsample_nearest2d's CPU kernel alone copies when
# out == in and halves the index when out == 2 * in, whatever the scale factor (1-D and 3-D do not).
OPS = {
    "upsample_nearest1d": ("nearest", 1, False), "upsample_nearest2d": ("nearest", 2, True),
    "upsample_nearest3d": ("nearest", 3, False), "_upsample_nearest_exact1d": ("nearest_exact", 1, False),
    "_upsample_nearest_exact2d": ("nearest_exact", 2, False),
    "_upsample_nearest_exact3d": ("nearest_exact", 3, False),
    "upsample_linear1d": ("linear", 1, False), "upsample_bilinear2d": ("linear", 2, False),
    "upsample_trilinear3d": ("linear", 3, False), "upsample_bicubic2d": ("cubic", 2, False),
}
NEAREST_DTYPES = FLOAT_DTYPES + (torch.uint8,)  # eager's nearest takes uint8 images too
TAPS = {"nearest": 1, "nearest_exact": 1, "linear": 2, "cubic": 4}  # taps per interpolated dim


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _ratio(IN, OUT, scale, ALIGN_CORNERS: tl.constexpr):
    """(in, out, scale) along one dim: the sizes as integer tensors (a size argument equal to 1 is a
    constant once specialized), the scale as ATen's area_pixel_compute_scale, IEEE-rounded; once per
    program, not per element."""
    zero = tl.program_id(0) * 0
    n_in = zero + IN
    n_out = zero + OUT
    if ALIGN_CORNERS:
        ratio = tl.math.div_rn((n_in - 1).to(tl.float32), tl.maximum(n_out - 1, 1).to(tl.float32))
        ratio = tl.where(n_out > 1, ratio, 0.0)
    else:
        ratio = tl.where(scale > 0, scale, tl.math.div_rn(n_in.to(tl.float32), n_out.to(tl.float32)))
    return n_in, n_out, ratio


@triton.jit
def _nearest(dst, IN, OUT, scale, MODE: tl.constexpr, SHORTCUTS: tl.constexpr, ACTIVE: tl.constexpr):
    """The source index along one dim (``dst`` itself along a dim that is not resized)."""
    if ACTIVE:
        n_in, n_out, ratio = _ratio(IN, OUT, scale, False)
        if MODE == "nearest_exact":
            src = tl.floor((dst.to(tl.float32) + 0.5) * ratio)
        else:
            src = tl.floor(dst.to(tl.float32) * ratio)
        src = tl.minimum(tl.maximum(src.to(tl.int64), 0), n_in - 1)
        if SHORTCUTS:
            src = tl.where(n_out == n_in, dst, tl.where(n_out == 2 * n_in, dst // 2, src))
    else:
        src = dst
    return src


@triton.jit
def _source(dst, IN, OUT, scale, ALIGN_CORNERS: tl.constexpr, CUBIC: tl.constexpr):
    """(in, out, floor of the source index clamped to in - 1, its fraction clamped to [0, 1]) along one
    dim."""
    n_in, n_out, ratio = _ratio(IN, OUT, scale, ALIGN_CORNERS)
    if ALIGN_CORNERS:
        src = ratio * dst.to(tl.float32)
    else:
        src = tl.fma(ratio, dst.to(tl.float32) + 0.5, -0.5)  # one rounding: eager's CPU build contracts it
        if not CUBIC:
            src = tl.maximum(src, 0.0)
    i0 = tl.minimum(tl.floor(src).to(tl.int64), n_in - 1)
    frac = tl.minimum(tl.maximum(src - i0.to(tl.float32), 0.0), 1.0)
    return n_in, n_out, i0, frac


@triton.jit
def _taps(dst, IN, OUT, scale, ALIGN_CORNERS: tl.constexpr, MODE: tl.constexpr, ACTIVE: tl.constexpr):
    """(tap indices, tap weights) along one dim, four of each: linear uses the first two, a dim that is
    not resized the first (``dst``, weight 1)."""
    one = tl.full(dst.shape, 1.0, tl.float32)
    zero = one * 0.0
    if not ACTIVE:
        taps, weights = (dst, dst, dst, dst), (one, zero, zero, zero)
    elif MODE == "linear":
        n_in, n_out, i0, frac = _source(dst, IN, OUT, scale, ALIGN_CORNERS, False)
        same = n_out == n_in  # eager copies when the sizes agree: x[o] * 1 + x[o] * 0
        i0 = tl.where(same, dst, i0)
        i1 = tl.where(same, i0, i0 + (i0 < n_in - 1).to(tl.int64))
        frac = tl.where(same, 0.0, frac)
        taps, weights = (i0, i1, i0, i0), (one - frac, frac, zero, zero)
    else:
        n_in, n_out, i, t = _source(dst, IN, OUT, scale, ALIGN_CORNERS, True)
        taps = (tl.minimum(tl.maximum(i - 1, 0), n_in - 1), tl.minimum(tl.maximum(i, 0), n_in - 1),
                tl.minimum(tl.maximum(i + 1, 0), n_in - 1), tl.minimum(tl.maximum(i + 2, 0), n_in - 1))
        weights = (_cubic2(t + 1.0), _cubic1(t), _cubic1(1.0 - t), _cubic2((1.0 - t) + 1.0))
    return taps, weights


@triton.jit
def _cubic1(x):
    return ((-0.75 + 2.0) * x - (-0.75 + 3.0)) * x * x + 1.0


@triton.jit
def _cubic2(x):
    return ((-0.75 * x - 5.0 * -0.75) * x + 8.0 * -0.75) * x - 4.0 * -0.75


@triton.jit
def _row(ptr, taps, weights, stride, mask, MODE: tl.constexpr):
    """sum over one dim's taps of x[tap] * weight, in fp32."""
    acc = tl.load(ptr + taps[0] * stride, mask=mask, other=0.0).to(tl.float32) * weights[0]
    acc += tl.load(ptr + taps[1] * stride, mask=mask, other=0.0).to(tl.float32) * weights[1]
    if MODE == "cubic":
        acc += tl.load(ptr + taps[2] * stride, mask=mask, other=0.0).to(tl.float32) * weights[2]
        acc += tl.load(ptr + taps[3] * stride, mask=mask, other=0.0).to(tl.float32) * weights[3]
    return acc


@triton.jit
def _plane(ptr, h, xs_h, w, xs_w, mask, MODE: tl.constexpr, ACTIVE: tl.constexpr):
    """The W taps (``w``: indices, weights) of each H tap (``h``), combined by the H weights; the H tap
    ``h[0][0]`` alone along a dim that is not resized."""
    acc = _row(ptr + h[0][0] * xs_h, w[0], w[1], xs_w, mask, MODE)
    if ACTIVE:
        acc = acc * h[1][0] + _row(ptr + h[0][1] * xs_h, w[0], w[1], xs_w, mask, MODE) * h[1][1]
        if MODE == "cubic":
            acc += _row(ptr + h[0][2] * xs_h, w[0], w[1], xs_w, mask, MODE) * h[1][2]
            acc += _row(ptr + h[0][3] * xs_h, w[0], w[1], xs_w, mask, MODE) * h[1][3]
    return acc


@triton.jit
def resize_kernel(
    x_ptr, out_ptr,
    total, C, D, H, W, OD, OH, OW,
    xs_n, xs_c, xs_d, xs_h, xs_w,
    os_n, os_c, os_d, os_h, os_w,
    scale_d, scale_h, scale_w,
    MODE: tl.constexpr, DIMS: tl.constexpr, ALIGN_CORNERS: tl.constexpr, SHORTCUTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # out[n, c, od, oh, ow] = the taps of x[n, c] around each dim's source index (module docstring)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    n, c, od, oh, ow = ew.unravel5(offs, C, OD, OH, OW)
    base = x_ptr + n * xs_n + c * xs_c
    if MODE == "nearest" or MODE == "nearest_exact":
        d = _nearest(od, D, OD, scale_d, MODE, SHORTCUTS, DIMS >= 3)
        h = _nearest(oh, H, OH, scale_h, MODE, SHORTCUTS, DIMS >= 2)
        w = _nearest(ow, W, OW, scale_w, MODE, SHORTCUTS, True)
        value = tl.load(base + d * xs_d + h * xs_h + w * xs_w, mask=mask, other=0)
    else:
        d = _taps(od, D, OD, scale_d, ALIGN_CORNERS, MODE, DIMS >= 3)
        h = _taps(oh, H, OH, scale_h, ALIGN_CORNERS, MODE, DIMS >= 2)
        w = _taps(ow, W, OW, scale_w, ALIGN_CORNERS, MODE, True)
        value = _plane(base + d[0][0] * xs_d, h, xs_h, w, xs_w, mask, MODE, DIMS >= 2)
        if DIMS == 3:  # trilinear: the second D tap (cubic is 2-D only)
            value = value * d[1][0] + _plane(base + d[0][1] * xs_d, h, xs_h, w, xs_w, mask, MODE, True) * d[1][1]
    tl.store(out_ptr + n * os_n + c * os_c + od * os_d + oh * os_h + ow * os_w,
             value.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------------
def _ncdhw(ref):
    """(sizes, strides) of an (N, C, *spatial) TRef as [N, C, D, H, W]: size-1 leading spatial dims."""
    pad = 5 - ref.ndim
    return (*ref.shape[:2], *(1,) * pad, *ref.shape[2:]), (*ref.strides[:2], *(0,) * pad, *ref.strides[2:])


def launch_resize(b, mode: str, out, x, ratios, align_corners: bool = False, shortcuts: bool = False) -> None:
    """``out`` (N, C, *spatial) = x resized by ``mode``; ``ratios``: per spatial dim, the fp32 1 / scale
    factor the kernel uses, or 0.0 to use in / out (the sizes may be symbolic)."""
    dims = x.ndim - 2
    (_, c, *size_in), xs = _ncdhw(x)
    (_, _, *size_out), os_ = _ncdhw(out)
    scales = (0.0,) * (3 - dims) + tuple(ratios)
    total = out.numel
    block = max(16, min(next_power_of_2(total), _block(mode, dims)))
    b.launch(
        "resize", (triton.cdiv(total, block),),
        x, out, total, c, *size_in, *size_out, *xs, *os_, *scales,
        MODE=mode, DIMS=dims, ALIGN_CORNERS=bool(align_corners), SHORTCUTS=bool(shortcuts), BLOCK=block,
        num_warps=4,
    )


def _block(mode: str, dims: int) -> int:
    """Output elements per program: 4 per thread of 4 warps for nearest, 2 for (bi)linear, 1 for the 8
    taps of trilinear and the 16 of bicubic (sm_90: more spill registers)."""
    taps = TAPS[mode] ** dims
    return 128 * (4 if taps == 1 else 2 if taps <= 4 else 1)


def ratio(scale, align_corners: bool) -> float:
    """The kernel's ``scale_*`` argument: ATen's fp32 ``1 / scale_factor`` (exact as a Python float), or
    0.0 for in / out (no scale factor, or one <= 0) and for align_corners (which ignores it)."""
    if align_corners or scale is None or scale <= 0:
        return 0.0
    return float(np.float32(1.0 / scale))


# --- support checks and lowerings -----------------------------------------------------------------
def _arguments(node) -> dict:
    """The node's arguments by schema name (``.vec``: output_size, [align_corners,] scale_factors;
    ``.default``: output_size, [align_corners,] scales / scales_h, scales_w / scales_d, ...)."""
    names = [a.name for a in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _scales(node, dims: int) -> list:
    """Each spatial dim's scale factor (None where there is none) of either overload."""
    names = [arg.name for arg in node.target._schema.arguments]
    a = _arguments(node)
    if "scale_factors" in names:
        return list(a.get("scale_factors") or [None] * dims)
    return [a.get(name) for name in names if name.startswith("scales")]


def supported(node) -> str | None:
    """None, or why the kernel refuses the node: an input that is not (N, C, *spatial) in a dtype eager
    resizes in this mode, or scale factors and align_corners that are not constants."""
    mode, dims, _ = OPS[node.target._opname]
    x = node_value(node.args[0])
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() != dims + 2:
        return f"input of rank {x.dim()} is not supported (a {dims}-D resize takes (N, C, {dims} spatial dims))"
    allowed = NEAREST_DTYPES if mode.startswith("nearest") else FLOAT_DTYPES
    if x.dtype not in allowed:
        return f"dtype {x.dtype} is not supported (supported: {', '.join(map(str, allowed))})"
    scales = _scales(node, dims)
    if len(scales) != dims or not all(s is None or isinstance(s, (int, float)) for s in scales):
        return f"scale factors {scales} are not {dims} constants (or None)"
    if not isinstance(_arguments(node).get("align_corners", False), bool):
        return "align_corners is not a constant"
    return None


def resize(b, node):
    """Every resize op of ``OPS``, in any of its overloads; the output size is the node's."""
    mode, dims, shortcuts = OPS[node.target._opname]
    align = bool(_arguments(node).get("align_corners", False))  # nearest takes none
    ratios = [ratio(s, align) for s in _scales(node, dims)]
    launch_resize(b, mode, b.out(node), b.ref(node.args[0]), ratios, align, shortcuts)
