"""``grid_sampler_2d`` (``F.grid_sample`` on 4-D inputs): each output pixel reads the input at the point
its grid entry names, computed as eager's CPU kernel computes it. One launch, one program per block of
output elements (n, c, h, w):

    gx, gy = grid[n, h, w, 0], grid[n, h, w, 1]              in [-1, 1] across the input
    x      = (gx + 1) * ((W - 1) / 2)                         align_corners
           = (gx + 1) * (W / 2) - 0.5                         otherwise (and y likewise over H)
    border:      x clipped to [0, W - 1]
    reflection:  x reflected about [0, W - 1] (align_corners) or [-0.5, W - 0.5], then clipped
    bilinear:    out = nw * x[y0, x0] + ne * x[y0, x0 + 1] + sw * x[y0 + 1, x0] + se * x[y0 + 1, x0 + 1]
                 x0 = floor(x), y0 = floor(y); nw = (1 - dy) (1 - dx), ne = (1 - dy) dx, sw = dy (1 - dx),
                 se = dy dx; a corner outside the input reads 0
    nearest:     out = x[round(y), round(x)] (half to even), 0 outside the input

Deformable attention (Deformable DETR, RT-DETR, Grounding DINO, Mask2Former's pixel decoder) samples its
values this way; spatial transformers and optical flow warps too. Bicubic interpolation is refused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import elementwise as ew
from .refs import FLOAT_DTYPES, node_value
from .sizes import next_power_of_2

MODES = {0: "bilinear", 1: "nearest"}  # interpolation_mode as the op takes it (2: bicubic, refused)
PADDINGS = {0: "zeros", 1: "border", 2: "reflection"}
BLOCK = 512


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _reflect(coord, low2, high2):
    """Eager's reflect_coordinates over [low2 / 2, high2 / 2]."""
    lo = low2 / 2
    span = (high2 - low2) / 2
    d = tl.abs(coord - lo)
    extra = d - tl.floor(d / span) * span  # fmod of non-negatives
    flips = tl.floor(d / span)
    odd = (flips - 2 * tl.floor(flips / 2)) != 0
    return tl.where(odd, span - extra + lo, extra + lo)


@triton.jit
def _source(g, size, PADDING: tl.constexpr, ALIGN: tl.constexpr):
    """The input coordinate (fp32) that normalized grid coordinate ``g`` names along a dim of ``size``."""
    sizef = size.to(tl.float32)
    if ALIGN:
        coord = (g + 1) * ((sizef - 1) / 2)
    else:
        coord = (g + 1) * (sizef / 2) - 0.5
    if PADDING == "reflection":
        if ALIGN:
            coord = tl.where(size > 1, _reflect(coord, 0.0, 2 * (sizef - 1)), 0.0)
        else:
            coord = _reflect(coord, -1.0, 2 * sizef - 1)
    if PADDING != "zeros":  # border, and reflection's result: clipped into [0, size - 1]
        coord = tl.minimum(tl.maximum(coord, 0.0), sizef - 1)
    return coord


@triton.jit
def _tap(rows, yi, xi, H, W, xs_h, xs_w, mask):
    """x at integer (yi, xi) (int64), 0 outside the input."""
    inside = mask & (yi >= 0) & (yi < H) & (xi >= 0) & (xi < W)
    return tl.load(rows + yi * xs_h + xi * xs_w, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def grid_sample_kernel(
    x_ptr, grid_ptr, out_ptr,
    total, C, H, W, OH, OW,
    xs_n, xs_c, xs_h, xs_w,
    gs_n, gs_h, gs_w, gs_k,
    os_n, os_c, os_h, os_w,
    MODE: tl.constexpr, PADDING: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    n, _, c, oh, ow = ew.unravel5(offs, 1, C, OH, OW)
    g = grid_ptr + n * gs_n + oh * gs_h + ow * gs_w
    x = _source(tl.load(g, mask=mask, other=0.0).to(tl.float32), W, PADDING, ALIGN)
    y = _source(tl.load(g + gs_k, mask=mask, other=0.0).to(tl.float32), H, PADDING, ALIGN)
    rows = x_ptr + n * xs_n + c * xs_c
    if MODE == "nearest":
        xi = ew._formula(x, x, x, "round", 1)  # half to even, as eager's nearbyint
        yi = ew._formula(y, y, y, "round", 1)
        finite = (xi == xi) & (yi == yi)
        result = _tap(rows, yi.to(tl.int64), xi.to(tl.int64), H, W, xs_h, xs_w, mask & finite)
    else:
        x0, y0 = tl.floor(x), tl.floor(y)
        dx, dy = x - x0, y - y0
        finite = (x0 == x0) & (y0 == y0)
        xi, yi = x0.to(tl.int64), y0.to(tl.int64)
        m = mask & finite
        result = ((1 - dy) * (1 - dx) * _tap(rows, yi, xi, H, W, xs_h, xs_w, m)
                  + (1 - dy) * dx * _tap(rows, yi, xi + 1, H, W, xs_h, xs_w, m)
                  + dy * (1 - dx) * _tap(rows, yi + 1, xi, H, W, xs_h, xs_w, m)
                  + dy * dx * _tap(rows, yi + 1, xi + 1, H, W, xs_h, xs_w, m))
    tl.store(out_ptr + n * os_n + c * os_c + oh * os_h + ow * os_w, result.to(out_ptr.dtype.element_ty), mask=mask)


# --- lowering ---------------------------------------------------------------------------------------
def grid_sampler_2d(b, node):
    """grid_sampler_2d(input [N, C, H, W], grid [N, OH, OW, 2], interpolation_mode, padding_mode,
    align_corners) -> [N, C, OH, OW]"""
    x, grid = b.ref(node.args[0]), b.ref(node.args[1])
    mode, padding, align = node.args[2:5]
    out = b.out(node)
    n, c, h, w = x.shape
    oh, ow = out.shape[2:]
    total = n * c * oh * ow
    block = max(16, min(BLOCK, next_power_of_2(total)))
    b.launch("grid_sample", (triton.cdiv(total, block),), x, grid, out, total, c, h, w, oh, ow,
             *x.strides, *grid.strides, *out.strides,
             MODE=MODES[mode], PADDING=PADDINGS[padding], ALIGN=bool(align), BLOCK=block)


def supported(node) -> str | None:
    x, grid = (node_value(a) for a in node.args[:2])
    mode, padding = node.args[2:4]
    if not isinstance(x, torch.Tensor) or not isinstance(grid, torch.Tensor) or x.dim() != 4:
        return "grid_sampler_2d of a 4-D input and grid only"
    if mode not in MODES:
        return f"interpolation mode {mode} (bicubic) is not supported (bilinear and nearest only)"
    if padding not in PADDINGS:
        return f"padding mode {padding} is not supported"
    for name, t in (("input", x), ("grid", grid), ("output", node.meta.get("val"))):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            return f"{name} dtype {getattr(t, 'dtype', t)} is not supported"
    return None
