"""2-D pooling over (N,) C, H, W: max pooling (with its indices), average pooling, adaptive average
and adaptive max pooling (with its indices). One kernel serves them all; each program reduces a [BLOCK_M output pixels, BLOCK_K window taps]
tile. (``AdaptiveAvgPool2d((1, 1))`` exports to ``mean.dim`` over H and W, which ``reduce.py`` owns.)

    max:           out[n,c,oh,ow] = max over taps (kh, kw) of x[n, c, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw]
                   idx[n,c,oh,ow] = ih * W + iw of that tap: the first maximum in (kh, kw) order, or the
                                    last NaN when there is one (eager's rule); padding never wins
    avg:           out = sum over the taps inside the image / divisor, where the divisor is
                   divisor_override, or the window clipped to the padded image (count_include_pad),
                   or the number of taps inside the image
    adaptive_avg:  rows [floor(oh*H/OH), ceil((oh+1)*H/OH)) x cols [floor(ow*W/OW), ceil((ow+1)*W/OW)),
                   averaged; KH x KW is the largest such window, smaller windows are masked
    adaptive_max:  the same windows, their maximum and its index as for max
"""

from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

from . import sizes
from .refs import node_value
from .sizes import next_power_of_2, upper

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NO_TAP = tl.constexpr(2**30)  # larger than any tap number


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def pool2d_kernel(
    x_ptr, out_ptr, idx_ptr,
    total, C, H, W, OH, OW,
    xs_n, xs_c, xs_h, xs_w,
    os_n, os_c, os_h, os_w,
    is_n, is_c, is_h, is_w,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, divisor,
    MODE: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr, WRITE_INDICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < total
    ow = offs % OW
    rest = offs // OW
    oh = rest % OH
    rest = rest // OH
    c = rest % C
    n = rest // C
    if MODE == "adaptive_avg" or MODE == "adaptive_max":
        hs = (oh * H) // OH
        he = ((oh + 1) * H + OH - 1) // OH
        ws = (ow * W) // OW
        we = ((ow + 1) * W + OW - 1) // OW
    else:
        hs = oh * stride_h - pad_h
        ws = ow * stride_w - pad_w
        he = tl.minimum(hs + (KH - 1) * dil_h + 1, H)
        we = tl.minimum(ws + (KW - 1) * dil_w + 1, W)
    rows = x_ptr + n * xs_n + c * xs_c

    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    best_k = tl.full((BLOCK_M,), _NO_TAP, tl.int32)
    nan_k = tl.full((BLOCK_M,), -1, tl.int32)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, KH * KW, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kh = kk // KW
        kw = kk % KW
        ih = hs[:, None] + (kh * dil_h)[None, :]
        iw = ws[:, None] + (kw * dil_w)[None, :]
        valid = (mask[:, None] & (kk < KH * KW)[None, :] & (ih >= 0) & (iw >= 0)
                 & (ih < he[:, None]) & (iw < we[:, None]))
        v = tl.load(rows[:, None] + ih * xs_h + iw * xs_w, mask=valid, other=0.0).to(tl.float32)
        if MODE == "max" or MODE == "adaptive_max":
            taps = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32) + kk[None, :]
            is_nan = v != v
            ordinary = valid & ~is_nan
            chunk_max = tl.max(tl.where(ordinary, v, float("-inf")), axis=1)
            chunk_k = tl.min(tl.where(ordinary & (v == chunk_max[:, None]), taps, _NO_TAP), axis=1)
            # Chunks come in tap order: a later chunk wins only with a strictly larger value (or when
            # nothing was found yet, e.g. a window of -inf).
            take = (chunk_max > best) | ((chunk_max == best) & (chunk_k < best_k))
            best = tl.where(take, chunk_max, best)
            best_k = tl.where(take, chunk_k, best_k)
            nan_k = tl.maximum(nan_k, tl.max(tl.where(valid & is_nan, taps, -1), axis=1))
        else:
            acc += tl.sum(tl.where(valid, v, 0.0), axis=1)

    out_offs = n * os_n + c * os_c + oh * os_h + ow * os_w
    if MODE == "max" or MODE == "adaptive_max":
        result = tl.where(nan_k >= 0, float("nan"), best)
        if WRITE_INDICES:
            k = tl.where(nan_k >= 0, nan_k, best_k)
            index = (hs + (k // KW) * dil_h) * W + ws + (k % KW) * dil_w
            tl.store(idx_ptr + n * is_n + c * is_c + oh * is_h + ow * is_w, index, mask=mask)
    else:
        if DIVISOR_OVERRIDE:
            count = tl.zeros((BLOCK_M,), dtype=tl.int64) + divisor
        elif MODE == "adaptive_avg":
            count = (he - hs) * (we - ws)
        elif COUNT_INCLUDE_PAD:
            count = ((tl.minimum(hs + KH, H + pad_h) - hs) * (tl.minimum(ws + KW, W + pad_w) - ws))
        else:
            count = (he - tl.maximum(hs, 0)) * (we - tl.maximum(ws, 0))
        result = acc / count.to(tl.float32)
    tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------------
def _adaptive_window(size, out_size) -> int:
    """The largest adaptive window: max over o of ceil((o+1) * size / out) - floor(o * size / out).

    With a dynamic size, a bound on it for every size in the range (the kernel masks taps past each
    window's end): a window spans at most ceil(size / out) + 1 rows, and never more than ``size``."""
    if sizes.is_static((size, out_size)):
        return max(-(-(o + 1) * size // out_size) - o * size // out_size for o in range(out_size))
    most = upper(size)
    if not sizes.is_static(out_size):
        return max(most, 1)  # out >= 1
    return max(1, min(most, -(-most // out_size) + 1))


def launch_pool2d(b, mode: str, out, x, kernel=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                  indices=None, count_include_pad=True, divisor_override=None) -> None:
    """``out`` (N, C, OH, OW) = pool(x (N, C, H, W)); ``indices`` an int64 TRef like ``out`` (max modes
    only). For the adaptive modes, ``kernel`` is ignored and the windows follow from the shapes."""
    n, c, h, w = x.shape
    oh, ow = out.shape[2:]
    if mode.startswith("adaptive"):
        kernel = (_adaptive_window(h, oh), _adaptive_window(w, ow))
    kh, kw = kernel
    total = n * c * oh * ow
    # adaptive windows keep [16, 64] taps a tile: their per-row ends over [32, 128] spilled 32 bytes
    # (adaptive_avg) and 104 (adaptive_max) on sm_90 (scripts/compile_check.py, a 20 x 20 window)
    adaptive = mode.startswith("adaptive")
    block_k = max(2, min(next_power_of_2(kh * kw), 64 if adaptive else 128))
    block_m = max(16, min(next_power_of_2(total), (1024 if adaptive else 4096) // block_k, 256))
    b.launch(
        "pool2d", (triton.cdiv(total, block_m),),
        x, out, indices if indices is not None else out,  # out stands in for unused indices: never written
        total, c, h, w, oh, ow,
        *x.strides, *out.strides, *(indices.strides if indices is not None else (0, 0, 0, 0)),
        *stride, *padding, *dilation, int(divisor_override or 0),
        MODE=mode, KH=kh, KW=kw, COUNT_INCLUDE_PAD=bool(count_include_pad),
        DIVISOR_OVERRIDE=bool(divisor_override), WRITE_INDICES=indices is not None,
        BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=8 if block_m * block_k > 2048 else 4,  # 4 warps over [256, 16] max taps spilled (sm_90)
    )


# --- support checks and lowerings -----------------------------------------------------------------
def _pair(v, default):
    v = list(v) if v not in (None, []) else list(default)
    return (v[0], v[0]) if len(v) == 1 else tuple(v)


def _nchw(b, ref):
    """An unbatched (C, H, W) tensor as (1, C, H, W)."""
    return ref if ref is None or ref.ndim == 4 else b.view(ref, (1, *ref.shape), (0, *ref.strides))


def supported(node) -> str | None:
    x = node_value(node.args[0])
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() not in (3, 4):
        return f"input of rank {x.dim()} is not supported (2-D pooling of (N,) C, H, W only)"
    if x.dtype not in FLOAT_DTYPES:
        return f"dtype {x.dtype} is not supported (supported: {', '.join(map(str, FLOAT_DTYPES))})"
    return None


def max_pool2d_with_indices(b, node):
    """(input, kernel_size, stride=[], padding=0, dilation=1, ceil_mode=False) -> (out, indices).
    ceil_mode only changes the output shape, which the node already carries."""
    names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
    a = {**dict(zip(names, node.args)), **node.kwargs}
    kernel = _pair(a["kernel_size"], None)
    x = _nchw(b, b.ref(a["input"]))
    out = _nchw(b, b.out(node, 0))
    wants_indices = any(u.target is operator.getitem and u.args[1] == 1 for u in node.users)
    indices = _nchw(b, b.out(node, 1)) if wants_indices else None
    launch_pool2d(b, "max", out, x, kernel, _pair(a.get("stride"), kernel), _pair(a.get("padding"), (0,)),
                  _pair(a.get("dilation"), (1,)), indices=indices)


def avg_pool2d(b, node):
    """(input, kernel_size, stride=[], padding=0, ceil_mode=False, count_include_pad=True,
    divisor_override=None)"""
    names = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
             "divisor_override")
    a = {**dict(zip(names, node.args)), **node.kwargs}
    kernel = _pair(a["kernel_size"], None)
    launch_pool2d(
        b, "avg", _nchw(b, b.out(node)), _nchw(b, b.ref(a["input"])),
        kernel, _pair(a.get("stride"), kernel), _pair(a.get("padding"), (0,)), (1, 1),
        count_include_pad=a.get("count_include_pad", True), divisor_override=a.get("divisor_override"),
    )


def adaptive_avg_pool2d(b, node):
    launch_pool2d(b, "adaptive_avg", _nchw(b, b.out(node)), _nchw(b, b.ref(node.args[0])))


def adaptive_max_pool2d(b, node):
    """(input, output_size) -> (out, indices)"""
    wants_indices = any(u.target is operator.getitem and u.args[1] == 1 for u in node.users)
    indices = _nchw(b, b.out(node, 1)) if wants_indices else None
    launch_pool2d(b, "adaptive_max", _nchw(b, b.out(node, 0)), _nchw(b, b.ref(node.args[0])), indices=indices)

