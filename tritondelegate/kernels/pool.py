"""Pooling over (N,) C, [D,] H, W: max pooling (with its indices), average pooling, adaptive average
and adaptive max pooling (with its indices), 2-D and 3-D. One kernel serves them all; each program
reduces a [BLOCK_M output pixels, BLOCK_K window taps] tile. (``AdaptiveAvgPool2d((1, 1))`` and its
3-D kin export to ``mean.dim`` over the spatial dims, which ``reduce.py`` owns.) Written for 2-D; a 3-D
pooling adds the depth (od, kd) to each formula, under the kernel's DEPTH constexpr: without it no depth
term is computed, so 2-D pooling compiles to the instructions (and registers: scripts/compile_check.py)
it had before 3-D pooling existed.

    max:           out[n,c,oh,ow] = max over taps (kh, kw) of x[n, c, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw]
                   idx[n,c,oh,ow] = ih * W + iw of that tap ((id * H + ih) * W + iw in 3-D): the first
                                    maximum in (kd, kh, kw) order, or the last NaN when there is one
                                    (eager's rule); padding never wins
    avg:           out = sum over the taps inside the image / divisor, where the divisor is
                   divisor_override, or the window clipped to the padded image (count_include_pad),
                   or the number of taps inside the image
    adaptive_avg:  rows [floor(oh*H/OH), ceil((oh+1)*H/OH)) x cols [floor(ow*W/OW), ceil((ow+1)*W/OW)),
                   averaged; KH x KW is the largest such window, smaller windows are masked
    adaptive_max:  the same windows, their maximum and its index as for max

``nn.LocalResponseNorm`` exports to an ``avg_pool3d`` of window (size, 1, 1) over its squared input
padded and viewed as [N, 1, C, H, W]: a 3-D average pooling like any other.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import sizes
from .refs import TRef, node_value
from .sizes import next_power_of_2, upper

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NO_TAP = tl.constexpr(2**30)  # larger than any tap number


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _window(o, size, out_size, stride, pad, dil, K: tl.constexpr, ADAPTIVE: tl.constexpr):
    """[start, end) of the window of output coordinates ``o`` along one dim: adaptive,
    [floor(o * size / out), ceil((o + 1) * size / out)); else from o * stride - pad (negative in the
    padding) to its last tap, clipped to the input's end."""
    if ADAPTIVE:
        start = (o * size) // out_size
        end = ((o + 1) * size + out_size - 1) // out_size
    else:
        start = o * stride - pad
        end = tl.minimum(start + (K - 1) * dil + 1, size)
    return start, end


@triton.jit
def _extent(start, end, size, pad, K: tl.constexpr, MODE: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr):
    """An average pooling's divisor along one dim: the adaptive window's length, or the window clipped
    to the padded input (count_include_pad), or its taps inside the input."""
    if MODE == "adaptive_avg":
        extent = end - start
    elif COUNT_INCLUDE_PAD:
        extent = tl.minimum(start + K, size + pad) - start
    else:
        extent = end - tl.maximum(start, 0)
    return extent


@triton.jit
def _max_taps(v, valid, kk, best, best_k, nan_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The running maximum (best), its tap (best_k) and the last NaN's tap (nan_k, -1 for none) of each
    row after the chunk of taps ``kk`` whose values are ``v`` (``valid`` where inside the window)."""
    taps = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32) + kk[None, :]
    is_nan = v != v
    ordinary = valid & ~is_nan
    chunk_max = tl.max(tl.where(ordinary, v, float("-inf")), axis=1)
    chunk_k = tl.min(tl.where(ordinary & (v == chunk_max[:, None]), taps, _NO_TAP), axis=1)
    # Chunks come in tap order: a later chunk wins only with a strictly larger value (or when nothing
    # was found yet, e.g. a window of -inf).
    take = (chunk_max > best) | ((chunk_max == best) & (chunk_k < best_k))
    best = tl.where(take, chunk_max, best)
    best_k = tl.where(take, chunk_k, best_k)
    nan_k = tl.maximum(nan_k, tl.max(tl.where(valid & is_nan, taps, -1), axis=1))
    return best, best_k, nan_k


@triton.jit
def pool2d_kernel(
    x_ptr, out_ptr, idx_ptr,
    total, C, H, W, OH, OW,
    xs_n, xs_c, xs_h, xs_w,
    os_n, os_c, os_h, os_w,
    is_n, is_c, is_h, is_w,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, divisor,
    # the depth's (3-D only), last: a 2-D launch's arguments keep their places (and its code its registers)
    D, OD, xs_d, os_d, is_d, stride_d, pad_d, dil_d,
    MODE: tl.constexpr, KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr, WRITE_INDICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DEPTH: tl.constexpr = False,  # 3-D: x and out have a depth (D, OD); else every depth term is absent
):
    adaptive = MODE == "adaptive_avg" or MODE == "adaptive_max"  # a constexpr
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < total
    ow = offs % OW
    rest = offs // OW
    oh = rest % OH
    rest = rest // OH
    if DEPTH:
        od = rest % OD
        rest = rest // OD
        ds, de = _window(od, D, OD, stride_d, pad_d, dil_d, KD, adaptive)
    c = rest % C
    n = rest // C
    hs, he = _window(oh, H, OH, stride_h, pad_h, dil_h, KH, adaptive)
    ws, we = _window(ow, W, OW, stride_w, pad_w, dil_w, KW, adaptive)
    rows = x_ptr + n * xs_n + c * xs_c

    best, best_k = tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.full((BLOCK_M,), _NO_TAP, tl.int32)
    nan_k = tl.full((BLOCK_M,), -1, tl.int32)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, KD * KH * KW, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)  # tap (kd, kh, kw), kw fastest
        kh = kk // KW
        kw = kk % KW
        if DEPTH:
            kh = kh % KH
        ih = hs[:, None] + (kh * dil_h)[None, :]
        iw = ws[:, None] + (kw * dil_w)[None, :]
        valid = (mask[:, None] & (kk < KD * KH * KW)[None, :] & (ih >= 0) & (iw >= 0)
                 & (ih < he[:, None]) & (iw < we[:, None]))
        ptrs = rows[:, None] + ih * xs_h + iw * xs_w
        if DEPTH:
            i_d = ds[:, None] + (kk // (KH * KW) * dil_d)[None, :]
            valid = valid & (i_d >= 0) & (i_d < de[:, None])
            ptrs += i_d * xs_d
        v = tl.load(ptrs, mask=valid, other=0.0).to(tl.float32)
        if MODE == "max" or MODE == "adaptive_max":
            best, best_k, nan_k = _max_taps(v, valid, kk, best, best_k, nan_k, BLOCK_M, BLOCK_K)
        else:
            acc += tl.sum(tl.where(valid, v, 0.0), axis=1)

    out_offs = n * os_n + c * os_c + oh * os_h + ow * os_w
    if DEPTH:
        out_offs += od * os_d
    if MODE == "max" or MODE == "adaptive_max":
        result = tl.where(nan_k >= 0, float("nan"), best)
        if WRITE_INDICES:
            k = tl.where(nan_k >= 0, nan_k, best_k)
            idx_offs = n * is_n + c * is_c + oh * is_h + ow * is_w
            if DEPTH:  # (id * H + ih) * W + iw
                index = ((ds + (k // (KH * KW)) * dil_d) * H + hs + (k // KW % KH) * dil_h) * W + ws + (k % KW) * dil_w
                idx_offs += od * is_d
            else:
                index = (hs + (k // KW) * dil_h) * W + ws + (k % KW) * dil_w
            tl.store(idx_ptr + idx_offs, index, mask=mask)
    else:
        if DIVISOR_OVERRIDE:
            count = tl.zeros((BLOCK_M,), dtype=tl.int64) + divisor
        else:
            count = (_extent(hs, he, H, pad_h, KH, MODE, COUNT_INCLUDE_PAD)
                     * _extent(ws, we, W, pad_w, KW, MODE, COUNT_INCLUDE_PAD))
            if DEPTH:
                count *= _extent(ds, de, D, pad_d, KD, MODE, COUNT_INCLUDE_PAD)
        result = acc / count.to(tl.float32)
    tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Pooling:
    """A 2-D max pooling that writes no indices, or a 2-D average pooling, of dilation 1 (the op of its
    launch record): a convolution whose result only it reads stores the pooling instead (``fuse_pool.py``)."""

    x: TRef
    out: TRef
    kernel: tuple  # (KH, KW)
    stride: tuple
    padding: tuple
    mode: str = "max"  # or "avg"
    count_include_pad: bool = True  # avg: the divisor counts the window's taps in the padding
    divisor: int = 0  # avg: divisor_override (0: none)


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


def _clamped(k, size, out_size, pad, dil):
    """A window of ``k`` taps along a dim of ``size`` (padded by ``pad`` each side) with one output: its
    taps past the padded input reach nothing, so ``min(k, size + 2 * pad)`` takes the same taps and
    (counting from the window's start, clipped to the padded input, as eager's divisor does) the same
    divisor. EfficientNet's pooler is ``AvgPool2d(1280, ceil_mode=True)`` over a 7 x 7 map: 49 taps, not
    1280 x 1280. Dynamic sizes, dilated windows and more outputs keep ``k``."""
    if dil != 1 or not sizes.is_static((size, out_size)) or out_size != 1:
        return k
    return max(1, min(k, size + 2 * pad))


def _dhw(v, fill) -> tuple:
    """Per spatial dim (h, w) or (d, h, w) values as (d, h, w): a 2-D pooling's depth is ``fill``."""
    return (fill,) * (3 - len(v)) + tuple(v)


def launch_pool2d(b, mode: str, out, x, kernel=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                  indices=None, count_include_pad=True, divisor_override=None) -> None:
    """``out`` (N, C, OH, OW) = pool(x (N, C, H, W)), or 3-D over (N, C, D, H, W) with ``kernel``,
    ``stride``, ``padding`` and ``dilation`` given for (d, h, w); ``indices`` an int64 TRef like ``out``
    (max modes only). For the adaptive modes, ``kernel`` is ignored and the windows follow from the
    shapes."""
    depth = x.ndim == 5
    n, c, *size = x.shape
    out_size = out.shape[2:]
    adaptive = mode.startswith("adaptive")
    if adaptive:
        kernel = tuple(_adaptive_window(s, o) for s, o in zip(size, out_size))
    else:
        kernel = tuple(_clamped(*dims) for dims in zip(kernel, size, out_size, padding, dilation))
    (d, h, w), (od, oh, ow), (kd, kh, kw) = _dhw(size, 1), _dhw(out_size, 1), _dhw(kernel, 1)
    total = n * c * od * oh * ow
    # Register spills on sm_90 (scripts/compile_check.py) set the tiles: adaptive windows keep [16, 64]
    # taps a tile (their per-row ends over [32, 128] spilled 32 bytes (adaptive_avg) and 104 (adaptive_max),
    # a 20 x 20 window); 4 warps over [256, 16] max taps spilled. 3-D pooling (the depth's coordinates and
    # window besides) takes 128 rows at most and 8 warps past 1024 taps: at 2-D's tiles it spilled 696 bytes
    # ([256, 16] k1x3x3 max taps, 8 warps) and 32 ([256, 8] k2 average ones, 4 warps).
    block_k = max(2, min(next_power_of_2(kd * kh * kw), 64 if adaptive else 128))
    block_m = max(16, min(next_power_of_2(total), (1024 if adaptive else 4096) // block_k, 128 if depth else 256))
    warps = 8 if block_m * block_k > (1024 if depth else 2048) else 4
    strides = [_ncdhw_strides(t.strides) for t in (x, out)]  # (n, c, d, h, w) each
    strides.append(_ncdhw_strides(indices.strides) if indices is not None else (0,) * 5)
    (sd, *s_hw), (pd, *p_hw), (dd, *d_hw) = _dhw(stride, 1), _dhw(padding, 0), _dhw(dilation, 1)
    record_args = [x, out, indices if indices is not None else out,  # out stands in for unused indices
                   total, c, h, w, oh, ow, *(s[k] for s in strides for k in (0, 1, 3, 4)),
                   *s_hw, *p_hw, *d_hw, int(divisor_override or 0),
                   d, od, *(s[2] for s in strides), sd, pd, dd]  # the depth's, last
    depth_constexpr = {"DEPTH": True} if depth else {}  # a 2-D launch keeps the kernel's default
    record = b.launch(
        "pool2d", (triton.cdiv(total, block_m),), *record_args,
        MODE=mode, KD=kd, KH=kh, KW=kw, COUNT_INCLUDE_PAD=bool(count_include_pad),
        DIVISOR_OVERRIDE=bool(divisor_override), WRITE_INDICES=indices is not None,
        BLOCK_M=block_m, BLOCK_K=block_k, **depth_constexpr, num_warps=warps,
    )
    if record is not None and mode in ("max", "avg") and indices is None and not depth and tuple(dilation) == (1, 1):
        record.op = Pooling(x, out, (kh, kw), tuple(s_hw), tuple(p_hw), mode, bool(count_include_pad),
                            int(divisor_override or 0))


def _ncdhw_strides(strides) -> tuple:
    """Strides over [N, C, H, W] as over [N, C, 1, H, W] (5-D strides unchanged)."""
    return tuple(strides) if len(strides) == 5 else (strides[0], strides[1], 0, *strides[2:])


# --- support checks and lowerings -----------------------------------------------------------------
def _per_dim(v, default, dims: int) -> tuple:
    """A kernel size, stride, padding or dilation list with one entry per spatial dim (one entry given:
    all of them; none: ``default``)."""
    v = list(v) if v not in (None, []) else list(default)
    return tuple(v * dims) if len(v) == 1 else tuple(v)


def _batched(b, ref, dims: int):
    """An unbatched (C, [D,] H, W) tensor as (1, C, [D,] H, W)."""
    if ref is None or ref.ndim == dims + 2:
        return ref
    return b.view(ref, (1, *ref.shape), (0, *ref.strides))


def _supported(node, dims: int) -> str | None:
    x = node_value(node.args[0])
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() not in (dims + 1, dims + 2):
        names = "C, H, W" if dims == 2 else "C, D, H, W"
        return f"input of rank {x.dim()} is not supported ({dims}-D pooling of (N,) {names} only)"
    if x.dtype not in FLOAT_DTYPES:
        return f"dtype {x.dtype} is not supported (supported: {', '.join(map(str, FLOAT_DTYPES))})"
    return None


def supported(node) -> str | None:
    """A 2-D pooling."""
    return _supported(node, 2)


def supported_3d(node) -> str | None:
    """A 3-D pooling."""
    return _supported(node, 3)


def _wants_indices(node) -> bool:
    return any(u.target is operator.getitem and u.args[1] == 1 for u in node.users)


def _max_pool(b, node, dims: int):
    """max_pool{2,3}d_with_indices(input, kernel_size, stride=[], padding=0, dilation=1, ceil_mode=False)
    -> (out, indices). ceil_mode only changes the output shape, which the node already carries."""
    names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
    a = {**dict(zip(names, node.args)), **node.kwargs}
    kernel = _per_dim(a["kernel_size"], None, dims)
    indices = _batched(b, b.out(node, 1), dims) if _wants_indices(node) else None
    launch_pool2d(b, "max", _batched(b, b.out(node, 0), dims), _batched(b, b.ref(a["input"]), dims), kernel,
                  _per_dim(a.get("stride"), kernel, dims), _per_dim(a.get("padding"), (0,), dims),
                  _per_dim(a.get("dilation"), (1,), dims), indices=indices)


def _avg_pool(b, node, dims: int):
    """avg_pool{2,3}d(input, kernel_size, stride=[], padding=0, ceil_mode=False, count_include_pad=True,
    divisor_override=None)"""
    names = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
             "divisor_override")
    a = {**dict(zip(names, node.args)), **node.kwargs}
    kernel = _per_dim(a["kernel_size"], None, dims)
    launch_pool2d(
        b, "avg", _batched(b, b.out(node), dims), _batched(b, b.ref(a["input"]), dims),
        kernel, _per_dim(a.get("stride"), kernel, dims), _per_dim(a.get("padding"), (0,), dims), (1,) * dims,
        count_include_pad=a.get("count_include_pad", True), divisor_override=a.get("divisor_override"),
    )


def _adaptive_avg_pool(b, node, dims: int):
    """_adaptive_avg_pool{2,3}d(input, output_size)"""
    launch_pool2d(b, "adaptive_avg", _batched(b, b.out(node), dims), _batched(b, b.ref(node.args[0]), dims))


def _adaptive_max_pool(b, node, dims: int):
    """adaptive_max_pool{2,3}d(input, output_size) -> (out, indices)"""
    indices = _batched(b, b.out(node, 1), dims) if _wants_indices(node) else None
    launch_pool2d(b, "adaptive_max", _batched(b, b.out(node, 0), dims), _batched(b, b.ref(node.args[0]), dims),
                  indices=indices)


def max_pool2d_with_indices(b, node):
    _max_pool(b, node, 2)


def max_pool3d_with_indices(b, node):
    _max_pool(b, node, 3)


def avg_pool2d(b, node):
    _avg_pool(b, node, 2)


def avg_pool3d(b, node):
    _avg_pool(b, node, 3)


def adaptive_avg_pool2d(b, node):
    _adaptive_avg_pool(b, node, 2)


def adaptive_avg_pool3d(b, node):
    _adaptive_avg_pool(b, node, 3)


def adaptive_max_pool2d(b, node):
    _adaptive_max_pool(b, node, 2)


def adaptive_max_pool3d(b, node):
    _adaptive_max_pool(b, node, 3)
