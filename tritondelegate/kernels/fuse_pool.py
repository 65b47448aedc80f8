"""A max or average pooling of a convolution's result runs in the convolution's launch: a pass of
``fusion.fuse`` over a delegate's launch records, after the epilogues.

A CNN's stem (ResNet's, DenseNet's, GoogLeNet's: conv -> batch norm -> ReLU -> 3x3 max pool of stride 2),
every VGG-style stage (conv -> ReLU -> 2x2 max pool) and a DenseNet transition (1x1 conv -> 2x2 average
pool) write the convolution's full-size result only for the pooling to read it back and keep a quarter
of it:

    C:  t = act(conv(x, w) + b)            t scratch, read by the pooling only (its epilogue: fusion.py)
    P:  u = max_pool(t, k, s, p)    ->     C':  u = max over each window of act(conv(x, w) + b)

C' takes P's place. Its rows are the pooled pixels; for each tap of a window it computes the convolution
and its epilogue at that output pixel (``conv.conv2d_kernel``'s POOL_KH, POOL_KW) and keeps the running
maximum or sum, so t is never stored. Overlapping windows (k 3, s 2) compute some pixels more than once:
(k / s)^2 = 2.25 times the stem's multiply-adds, for a store and a load of a tensor 4 times the
pooling's size fewer (the stem is memory-bound at its 64 channels). Windows that do not overlap (VGG's
and DenseNet's k 2, s 2) compute each pixel once.

The values are eager's: the maximum of the epilogue's fp32 results is rounded once at the store, and
rounding to a float type keeps order, so it is the maximum of the rounded values; a NaN in a window
wins, as eager's max pooling propagates it; taps in the window's padding never win. An average sums the
fp32 values (eager sums the rounded ones: in fp16 and bf16 the two differ by rounding) and divides by
eager's divisor: ``divisor_override``, or the window clipped to the padded input
(``count_include_pad``), or its taps inside the input.

P merges when all of these hold:
  - P is a 2-D max pooling that writes no indices, or a 2-D average pooling, of dilation 1
    (``pool.Pooling``), of at most ``MAX_TAPS`` taps;
  - C is a 2-D ``conv2d`` launch (not transposed, not depthwise, no pooling yet), with or without an
    epilogue, that writes exactly P's input;
  - t's buffer is scratch, touched by no launch but C and P, and neither a delegate output nor viewed
    by one;
  - no launch between C and P writes what C reads (C's reads move to P's place).
"""

from __future__ import annotations

from dataclasses import replace

from . import conv as cv
from .refs import new_launch, same_view


def merge_pools(launches, pools, convs, sources, touched, writes, keep, users, merged_away, relaunch) -> dict:
    """Pooling position -> the convolution launch that now computes it. ``pools`` maps positions to
    ``pool.Pooling``; ``convs`` positions to their matmul-like ops (``conv.ConvOp`` among them);
    ``sources`` an epilogue's position to (the position of its convolution, its chain); ``relaunch(op,
    chain, launch)`` relaunches a convolution with a chain as its epilogue (or None). Each producer merged
    is added to ``merged_away``."""
    merged = {}
    for p, window in sorted(pools.items()):
        t = window.x
        (q, *more) = sorted(users[t.buffer] - {p}) or (None,)
        if t.buffer in keep or q is None or more or q > p:
            continue
        chain, m = None, q
        if q in sources:
            m, chain = sources[q]
            if not same_view(t, chain.out):
                continue
        elif q in merged_away or q not in convs or not same_view(t, convs[q].c):
            continue
        op = convs[m]
        moved = (touched[q] | touched[m]) - {t.buffer, op.c.buffer}
        if not _poolable(op, window) or any(moved & writes[k] for k in range(q + 1, p)):
            continue
        pooled = replace(op, pool=window)
        if chain is None:
            grid, args, constexprs = pooled.launch()
            launch = new_launch(op.kernel, grid, args, constexprs, launches[q].op)
        else:
            launch = relaunch(pooled, chain, launches[m])
        if launch is not None:
            merged[p] = replace(launch, op=f"{launch.op}+{launches[p].op}")
            merged_away.add(q)
    return merged


# The largest window merged. Each tap is a whole K walk of the program's rows, one after another: a
# stem's 3 x 3 or a VGG stage's 2 x 2 pays for a store and a load of the full-size result, but a global
# pooling (EfficientNet's 7 x 7 over its last map: one pooled pixel per image) would run the whole map's
# convolution in one program row per image, where the convolution alone spreads it over many.
MAX_TAPS = 16


def _poolable(op, window) -> bool:
    """Whether ``op`` is a plain 2-D convolution the conv2d kernel can pool with ``window``."""
    return (type(op) is cv.ConvOp and not op.transposed and op.pool is None and op.c.ndim == 4
            and window.kernel[0] * window.kernel[1] <= MAX_TAPS)
