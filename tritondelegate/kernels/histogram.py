"""``histc``: counts of a tensor's elements in equal-width bins over [min, max].

    bin(x) = int((x - min) * bins / (max - min)),  x == max in the last bin, x outside [min, max]
             (NaN included) in none
    out[b] = #{ elements with bin(x) == b }

each step rounded to the input's dtype, as ATen computes it. With min == max the range is the data's
own (and widened by 1 each side when that is one value too), as ``torch.histc`` does. One program
counts BLOCK_B bins over the whole input in BLOCK_N chunks, with no atomics, so the counts need no
zeroed output first and come out the same on every run. Mixture-of-Experts routers count the tokens
each expert takes this way.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import ranking
from .elementwise import unravel5
from .refs import FLOAT_DTYPES, MAX_RANK, TRef, collapse_padded
from .sizes import next_power_of_2, upper

BLOCK_B = 128  # bins per program at most
BLOCK_N = 128  # elements per loop step


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _round(v, like):
    """``v`` rounded to nearest even in ``like``'s dtype, back in fp32 (c10::Half and BFloat16
    arithmetic rounds every step)."""
    return v.to(like.dtype).to(tl.float32)


@triton.jit
def _element(x_ptr, offs, mask, d1, d2, d3, d4, xs0, xs1, xs2, xs3, xs4):
    i0, i1, i2, i3, i4 = unravel5(offs, d1, d2, d3, d4)
    return tl.load(x_ptr + i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3 + i4 * xs4, mask=mask, other=0)


@triton.jit
def _data_range(x_ptr, n, d1, d2, d3, d4, xs0, xs1, xs2, xs3, xs4, BLOCK_N: tl.constexpr):
    """(min, max) of the input, in fp32."""
    lo = tl.full([BLOCK_N], float("inf"), tl.float32)
    hi = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for start in range(0, n, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N).to(tl.int64)
        mask = offs < n
        x = _element(x_ptr, offs, mask, d1, d2, d3, d4, xs0, xs1, xs2, xs3, xs4).to(tl.float32)
        lo = tl.minimum(lo, tl.where(mask, x, float("inf")))
        hi = tl.maximum(hi, tl.where(mask, x, float("-inf")))
    return tl.min(lo, axis=0), tl.max(hi, axis=0)


@triton.jit
def bin_counts(x_ptr, n, d1, d2, d3, d4, xs0, xs1, xs2, xs3, xs4, b, bins, lo, hi, FROM_DATA: tl.constexpr,
               CUMULATIVE: tl.constexpr, CAST: tl.constexpr, BLOCK_N: tl.constexpr):
    """The counts (int32) of the input's elements in bins ``b``, or with CUMULATIVE in bins up to each."""
    if FROM_DATA:  # min == max: the data's range, widened by 1 each side when that is one value
        lo, hi = _data_range(x_ptr, n, d1, d2, d3, d4, xs0, xs1, xs2, xs3, xs4, BLOCK_N)
        same = lo == hi
        lo = tl.where(same, lo - 1.0, lo)
        hi = tl.where(same, hi + 1.0, hi)
    span = tl.zeros([BLOCK_N], dtype=tl.float32) + (hi - lo)
    counts = tl.zeros_like(b)
    for start in range(0, n, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N).to(tl.int64)
        mask = offs < n
        x = _element(x_ptr, offs, mask, d1, d2, d3, d4, xs0, xs1, xs2, xs3, xs4)
        if CAST:
            x = x.to(tl.float32)
        xf = x.to(tl.float32)
        inside = mask & (xf >= lo) & (xf <= hi)
        pos = _round(_round(_round(xf - lo, x) * bins, x) / _round(span, x), x).to(tl.int32)
        pos = tl.minimum(pos, bins - 1)
        if CUMULATIVE:
            hit = inside[:, None] & (pos[:, None] <= b[None, :])
        else:
            hit = inside[:, None] & (pos[:, None] == b[None, :])
        counts += tl.sum(hit.to(tl.int32), axis=0)
    return counts


@triton.jit
def histc_kernel(
    out_ptr, x_ptr,
    n, d1, d2, d3, d4,
    xs0, xs1, xs2, xs3, xs4,
    bins, lo, hi, out_stride,
    FROM_DATA: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
    CUMULATIVE: tl.constexpr = False, CAST: tl.constexpr = False,
):
    # CUMULATIVE: out[b] counts the elements of bins <= b (cumsum of the counts); CAST: the elements
    # are converted to fp32 first (histc of ``x.float()``), so each step rounds in fp32
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    counts = bin_counts(x_ptr, n, d1, d2, d3, d4, xs0, xs1, xs2, xs3, xs4, b, bins, lo, hi, FROM_DATA, CUMULATIVE,
                        CAST, BLOCK_N)
    tl.store(out_ptr + b * out_stride, counts.to(tl.float32).to(out_ptr.dtype.element_ty), mask=b < bins)


# --- host launcher and lowering -------------------------------------------------------------------
def launch_histc(b, out: TRef, x: TRef, bins: int, low: float, high: float, cumulative: bool = False,
                 cast: bool = False) -> None:
    """``out`` (``bins`` elements) = the counts of ``x``'s elements in ``bins`` bins over [low, high]
    (the data's range when low == high); ``cumulative``: their running sums; ``cast``: of ``x``
    converted to fp32."""
    walk = collapse_padded(x.shape, [x.strides], MAX_RANK)
    if walk is None:
        raise NotImplementedError(f"histc over more than {MAX_RANK} non-mergeable dims")
    sizes, (strides,) = walk
    # the edges as the input's dtype holds them (ATen converts min and max to it)
    low, high = (float(torch.tensor(v, dtype=torch.float32 if cast else x.dtype)) for v in (low, high))
    block_b = min(next_power_of_2(bins), BLOCK_B)
    block_n = min(next_power_of_2(upper(math.prod(x.shape))), BLOCK_N)
    b.launch("histc", (triton.cdiv(bins, block_b),), out, x, math.prod(x.shape), *sizes[1:], *strides,
             bins, low, high, out.strides[0], FROM_DATA=low == high, BLOCK_B=block_b, BLOCK_N=block_n,
             CUMULATIVE=cumulative, CAST=cast)


def _arguments(node) -> list:
    """histc's (bins, min, max), defaults filled in."""
    return [node.args[k] if len(node.args) > k else node.kwargs.get(name, default)
            for k, name, default in ((1, "bins", 100), (2, "min", 0), (3, "max", 0))]


def supported(node) -> str | None:
    x = node.args[0].meta.get("val")
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        return f"input dtype {getattr(x, 'dtype', None)} is not floating point (histc counts floats)"
    return _arguments_refusal(*_arguments(node))


def _arguments_refusal(bins, low, high, bin_types=(int, float)) -> str | None:
    """Why histc's bins, min and max cannot be taken: not constants, or not a finite, ordered range."""
    if not isinstance(bins, bin_types) or not all(isinstance(a, (int, float)) for a in (low, high)):
        return f"bins, min and max {[bins, low, high]} are not constants"
    if low > high or any(math.isinf(a) or math.isnan(a) for a in (low, high)):
        return f"the range [{low}, {high}] is not finite and ordered"
    return None


def histc(b, node):
    """histc(x, bins=100, min=0, max=0)."""
    args = _arguments(node)
    launch_histc(b, b.out(node), b.ref(node.args[0]), int(args[0]), float(args[1]), float(args[2]))


# Counts are exact integers; as fp32 running sums they stay exact below 2^24 elements.
EXACT_COUNT = 1 << 24
CAST_DTYPES = ranking.DTYPES


def supported_cumulative(node) -> str | None:
    """cumulative_histc(x, bins, min, max, cast, dtype): histc's checks on x (cast to fp32 first)."""
    return cumulative_refusal(node.args[0].meta.get("val"), *node.args[1:])


def cumulative_refusal(x, bins, low, high, cast, dtype) -> str | None:
    """Why the kernel cannot take ``cumsum(histc(x.to(cast), bins, low, high), 0, dtype=dtype)``;
    None when it can."""
    reason = _arguments_refusal(bins, low, high, int)
    if reason is not None:
        return reason
    if not isinstance(x, torch.Tensor):
        return "the input is not a tensor"
    if cast not in (None, torch.float32):
        return f"a cast to {cast} first is not supported (only to torch.float32)"
    if cast is None and x.dtype not in (torch.float32, torch.float64):
        return f"input dtype {x.dtype}: running sums of its counts are exact in fp32 and fp64 only"
    if cast is not None and x.dtype not in CAST_DTYPES:
        return f"input dtype {x.dtype} is not supported"
    if dtype not in (torch.int32, torch.int64, torch.float32, torch.float64):
        return f"result dtype {dtype} is not supported"
    n = upper(math.prod(x.shape))
    if not isinstance(n, int) or n >= EXACT_COUNT:
        return f"{n} elements: running counts are exact below {EXACT_COUNT}"
    return None


def cumulative_histc(b, node):
    """``tritondelegate::cumulative_histc``: the counts' running sums, one launch."""
    x, bins, low, high, cast, _ = node.args
    launch_histc(b, b.out(node), b.ref(x), int(bins), float(low), float(high), cumulative=True,
                 cast=cast is not None)
