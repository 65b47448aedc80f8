"""Padding: constant_pad_nd, reflection_pad{1,2,3}d and replication_pad{1,2,3}d, one kernel for all.

For each output element, per dim k with input size n_k and padding lo_k before it (negative: cropped),
j_k = i_k - lo_k is mapped back into the input by MODE:

    constant:  out[i] = x[j] if every 0 <= j_k < n_k, else value
    reflect:   j_k -> (n_k - 1) - |(n_k - 1) - |j_k||        (mirror without repeating the edge)
    replicate: j_k -> min(max(j_k, 0), n_k - 1)

The input is read through its strides (a transpose or a slice needs no copy); the output is
contiguous, walked in up to MAX_RANK dims. Sizes and paddings may depend on the method's symbols.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import triton
import triton.language as tl

from . import elementwise as ew
from .elementwise import unravel5
from . import sizes
from .refs import MAX_RANK, TRef

BLOCK = 1024
MODES = {"constant_pad_nd": "constant", "reflection_pad1d": "reflect", "reflection_pad2d": "reflect",
         "reflection_pad3d": "reflect", "replication_pad1d": "replicate", "replication_pad2d": "replicate",
         "replication_pad3d": "replicate"}


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _source(i, lo, n, MODE: tl.constexpr):
    """(input index, inside) along one dim; reflect and replicate clamp into [0, n) so that no index
    leaves the input whatever the sizes."""
    j = i - lo
    if MODE == "constant":
        inside = (j >= 0) & (j < n)
    else:
        if MODE == "reflect":
            j = (n - 1) - tl.abs((n - 1) - tl.abs(j))
        j = tl.minimum(tl.maximum(j, 0), n - 1)
        inside = j < n  # false only when n == 0
    return j, inside


@triton.jit
def pad_kernel(
    out_ptr, x_ptr, value,
    total, d1, d2, d3, d4,
    n0, n1, n2, n3, n4,
    lo0, lo1, lo2, lo3, lo4,
    s0, s1, s2, s3, s4,
    MODE: tl.constexpr, BLOCK: tl.constexpr,
):
    # out[i] = x[source(i)] (or value outside x, MODE constant); i over the contiguous output
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    i0, i1, i2, i3, i4 = unravel5(offs, d1, d2, d3, d4)
    j0, in0 = _source(i0, lo0, n0, MODE)
    j1, in1 = _source(i1, lo1, n1, MODE)
    j2, in2 = _source(i2, lo2, n2, MODE)
    j3, in3 = _source(i3, lo3, n3, MODE)
    j4, in4 = _source(i4, lo4, n4, MODE)
    inside = in0 & in1 & in2 & in3 & in4
    v = tl.load(x_ptr + j0 * s0 + j1 * s1 + j2 * s2 + j3 * s3 + j4 * s4, mask=mask & inside, other=0)
    if MODE == "constant":
        v = tl.where(inside, v, value)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZeroPad:
    """What a ``pad`` launch of zeros around ``x`` computes, for ``fuse_pad.py``: ``out`` (contiguous) is
    ``x`` with ``before[k]`` zeros before dim k (static, >= 0) and the rest of ``out``'s size after."""

    x: TRef
    out: TRef
    before: tuple


def launch_pad(b, x, out, before, mode: str, value=0) -> None:
    """``out`` (contiguous) = ``x`` padded by ``before[k]`` elements before dim k (negative: cropped)
    and by whatever is left of ``out``'s size after it. A constant pad of zeros that crops nothing
    records what it computes (:class:`ZeroPad`): a convolution may read ``x`` itself instead."""
    pad = MAX_RANK - x.ndim
    n = [1] * pad + list(x.shape)
    lo = [0] * pad + list(before)
    strides = [0] * pad + list(x.strides)
    dims = [1] * pad + list(out.shape)
    value = float(value) if out.dtype.is_floating_point else int(value)
    total = math.prod(out.shape)
    record = b.launch("pad", (triton.cdiv(total, BLOCK),), out, x, value, total, *dims[1:], *n, *lo, *strides,
                      MODE=mode, BLOCK=BLOCK)
    if record is not None and mode == "constant" and value == 0 and all(
            sizes.is_static(k) and k >= 0 for k in (*before, *x.shape, *out.shape)):
        record.op = ZeroPad(x, out, tuple(before))


def _before(b, node, ndim: int) -> list:
    """The padding before each of ``ndim`` dims from a pad list (last dim first: lo, hi, lo, hi, ...)."""
    padding = b.sizes(node.args[1])
    before = [0] * ndim
    for k in range(len(padding) // 2):
        before[ndim - 1 - k] = padding[2 * k]
    return before


def pad(b, node):
    """constant_pad_nd(x, pad, value=0), reflection_pad*d(x, padding), replication_pad*d(x, padding)."""
    x = b.ref(node.args[0])
    mode = MODES[node.target._opname]
    value = (node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)) if mode == "constant" else 0
    launch_pad(b, x, b.out(node), _before(b, node, x.ndim), mode, value)


def supported(node) -> str | None:
    reason = ew.supported(node)
    if reason:
        return reason
    if node.meta["val"].dim() > MAX_RANK:
        return f"padding a tensor of more than {MAX_RANK} dims"
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if hasattr(value, "meta"):
        return "the pad value is computed at run time"
    return None
