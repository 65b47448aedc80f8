"""``native_group_norm``: each (sample, group) normalized over its channels and positions, then the
per-channel affine, computed as eager's CPU kernel computes it:

    var, mean = welford(x[n, group g])                       over C / G channels x HxW positions
    rstd      = 1 / sqrt(var + eps)
    scale     = rstd[n, g(c)] * weight[c]                    (rstd without a weight)
    shift     = bias[c] - mean[n, g(c)] * scale[n, c]        (-mean * scale without a bias)
    out       = x * scale[n, c] + shift[n, c]

so an inf or NaN in x, weight or bias gives eager's NaNs. Four launches: the statistics (``reduce``'s
welford over x seen as [N * G, C / G * HxW]), rstd with the scale and then the shift (chains over
[N, C]: tiny), and one chain over x that reads each element once and rounds once to the result's dtype. GroupNorm is
wav2vec2's feature extractor's, BiT's and diffusion UNets' norm.
"""

from __future__ import annotations

import math

import torch

from . import elementwise as ew
from . import reduce as red
from .refs import FLOAT_DTYPES, node_value, stats_read

STATS = torch.float32  # the statistics and the per-channel scale and shift, as eager's opmath


def native_group_norm(b, node):
    """native_group_norm(x [N, C, *], weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)."""
    x, weight, bias, _, channels, _, groups, eps = node.args
    x = b.contiguous(b.ref(x))
    weight, bias = (None if t is None else b.ref(t) for t in (weight, bias))
    n, per = x.shape[0], channels // groups
    positions = math.prod(x.shape[2:])
    # [N, G, 1]: they broadcast over [N, G, C / G] as right-aligned operands, so their chains fuse
    var, mean, rstd, shifted = (b.alloc((n, groups, 1), STATS) for _ in range(4))
    red.launch_reduce(b, b.view(x, (n * groups, per * positions), (per * positions, 1)), [1],
                      b.view(var, (n * groups,), (1,)), b.view(mean, (n * groups,), (1,)), combine="welford",
                      divisor=per * positions)
    ew.launch_pointwise(b, "add", shifted, [var, float(eps)])
    ew.launch_pointwise(b, "rsqrt", rstd, [shifted])
    scale, shift = scale_shift(b, rstd, mean, weight, bias, n, groups, per)
    grid = (n, groups, per, positions)  # x and out seen as [N, G, C / G, HxW]
    flat = (groups * per * positions, per * positions, positions, 1)
    scaled = b.alloc(grid, STATS)
    ew.launch_pointwise(b, "mul", scaled, [b.view(x, grid, flat), _per_channel(b, scale, grid)])
    ew.launch_pointwise(b, "add", b.view(b.out(node, 0), grid, flat), [scaled, _per_channel(b, shift, grid)])
    if stats_read(node):
        ew.launch_pointwise(b, "copy", b.out(node, 1), [b.view(mean, (n, groups), (groups, 1))])
        ew.launch_pointwise(b, "copy", b.out(node, 2), [b.view(rstd, (n, groups), (groups, 1))])


def scale_shift(b, rstd, mean, weight, bias, n: int, groups: int, per: int):
    """(scale, shift) [N, G, C / G] in fp32 (scratch, or a broadcast view of rstd without a weight);
    rstd and mean are [N, G, 1]."""
    shape = (n, groups, per)
    if weight is None:
        scale = b.view(rstd, shape, (groups, 1, 0))
    else:
        scale = b.alloc(shape, STATS)
        ew.launch_pointwise(b, "mul", scale, [rstd, _channel(b, weight, shape)])
    product = b.alloc(shape, STATS)
    ew.launch_pointwise(b, "mul", product, [scale, mean])
    shift = b.alloc(shape, STATS)
    if bias is None:
        ew.launch_pointwise(b, "neg", shift, [product])
    else:
        ew.launch_pointwise(b, "sub", shift, [_channel(b, bias, shape), product])
    return scale, shift


def _channel(b, t, shape):
    """A per-channel [C] tensor seen over [N, G, C / G]."""
    return b.view(t, shape, (0, shape[2] * t.strides[0], t.strides[0]))


def _per_channel(b, t, grid):
    """[N, G, C / G] per-channel values seen over [N, G, C / G, HxW]."""
    return b.view(t, grid, (*t.strides, 0))


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
