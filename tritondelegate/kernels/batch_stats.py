"""Batch norm with the batch's own statistics: ``_native_batch_norm_legit.no_stats`` (what
``nn.InstanceNorm`` exports to, over x seen as [1, N * C, *]) and ``_native_batch_norm_legit_functional``
(a ``BatchNorm`` exported in training mode, or an ``InstanceNorm`` tracking running statistics), computed as
eager's CPU kernel computes it (``_native_batch_norm_legit`` with ``training=False`` takes the running
statistics for mean and var, the rest alike):

    mean      = sum(x[:, c]) / M                               over M = N x HxW, per channel c
    var       = sum((x[:, c] - mean)^2) / M                    (two passes, as eager: an inf in x
    rstd      = 1 / sqrt(var + eps)                             makes the mean inf and the var NaN)
    scale     = rstd[c] * weight[c];  shift = bias[c] - mean[c] * scale[c]
    out       = x * scale[c] + shift[c]

so an inf weight gives eager's NaNs where x * scale and shift are infinities of opposite signs (torch's
decomposition, ``(x - mean) * rstd * weight + bias``, gives an infinity there). The functional form also
returns the running statistics after the update, as eager writes them:

    running_mean' = momentum * mean + (1 - momentum) * running_mean
    running_var'  = momentum * var * M / (M - 1) + (1 - momentum) * running_var

Launches: the two statistics (``reduce``'s sums over x seen as [C, N, HxW], the centering fused into the
second), then ``group_norm.norm_apply`` over x, which computes rstd, scale and shift of each channel from
them; the running statistics' chains when they are read. An instance norm's x, [1, N * C, *] viewed from
[N, C, *], is applied over [N, C, *] when its result is read only through the view back, so that the
chain after the view (an activation) is the apply's epilogue.
"""

from __future__ import annotations

import math
import operator

import torch

from . import elementwise as ew
from . import reduce as red
from . import group_norm as gn
from .group_norm import STATS
from . import sizes as size_fns
from .refs import FLOAT_DTYPES, contiguous_strides, node_value, stats_read


def _args(node):
    """(x, weight, bias, running_mean, running_var, training, momentum, eps) of any of the overloads."""
    if node.target is torch.ops.aten._native_batch_norm_legit.no_stats:
        x, weight, bias, training, momentum, eps = node.args
        return x, weight, bias, None, None, training, momentum, eps
    return node.args


def batch_norm_batch_stats(b, node):
    """The normalized x and the statistics (save_mean, save_rstd, and the updated running ones)."""
    x, weight, bias, running_mean, running_var, training, momentum, eps = _args(node)
    x = b.contiguous(b.ref(x))
    weight, bias = (None if t is None else b.ref(t) for t in (weight, bias))
    n, channels, positions = x.shape[0], x.shape[1], math.prod(x.shape[2:])
    if training:
        var, mean = (b.alloc((channels,), STATS) for _ in range(2))
        _statistics(b, x, mean, var)
    else:  # the running statistics
        mean, var = b.ref(running_mean), b.ref(running_var)
    out, rows = b.out(node, 0), None
    images = _instances(node)
    if images is not None:  # an instance norm's [1, N * C, *], contiguous: applied over [N, C, *] as read
        strides = contiguous_strides(images)
        x, out, rows = b.view(x, images, strides, x.offset), b.view(out, images, strides, out.offset), channels
    gn.launch_apply(b, x, out, (var, mean), (weight, bias), eps, 1, 0, rows)
    if not training:  # save_mean, save_rstd: empty; bound so that a getitem of them still lowers
        b.out(node, 1)
        b.out(node, 2)
    elif stats_read(node):
        shifted = b.alloc((channels,), STATS)
        ew.launch_pointwise(b, "add", shifted, [var, float(eps)])
        ew.launch_pointwise(b, "rsqrt", b.out(node, 2), [shifted])
        ew.launch_pointwise(b, "copy", b.out(node, 1), [mean])
    if len(node.meta["val"]) == 5 and _read(node, {3, 4}):
        _running(b, node, (mean, var), (b.ref(running_mean), b.ref(running_var)), momentum, n * positions)


def _statistics(b, x, mean, var) -> None:
    """mean and var ([C], fp32) of x [N, C, *] per channel: its sum over N x HxW, then the sum
    of the squared differences from the mean."""
    n, channels, positions = x.shape[0], x.shape[1], math.prod(x.shape[2:])
    shape, flat = (channels, n, positions), (positions, channels * positions, 1)
    red.launch_reduce(b, b.view(x, shape, flat), [1, 2], b.view(mean, (channels,), (1,)), combine="sum",
                      finish="div", divisor=n * positions)
    centered = b.alloc(shape, STATS)
    ew.launch_pointwise(b, "sub", centered, [b.view(x, shape, flat), b.view(mean, shape, (1, 0, 0))])
    red.launch_reduce(b, centered, [1, 2], b.view(var, (channels,), (1,)), map_="sq", combine="sum",
                      finish="div", divisor=n * positions)


def _instances(node) -> tuple | None:
    """[N, C, *] when ``node`` normalizes x [1, N * C, *] viewed from a contiguous [N, C, *] (how
    ``nn.InstanceNorm`` exports) and its result is read only through the view back: the apply then walks
    [N, C, *], so the chain after the view (an activation) is its epilogue."""
    view = node.args[0]
    if node.target is not torch.ops.aten._native_batch_norm_legit.no_stats or not _is_view(view):
        return None
    source, x = node_value(view.args[0]), node_value(view)
    if not isinstance(source, torch.Tensor) or source.dim() != x.dim():
        return None
    shape, flat = size_fns.shape(source.shape), size_fns.shape(x.shape)  # ints or sympy: no guards
    if flat[0] != 1 or shape[0] * shape[1] != flat[1] or shape[2:] != flat[2:]:
        return None
    users = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    readers = [r for u in users for r in u.users]
    if not readers or not all(_is_view(r) and size_fns.shape(node_value(r).shape) == shape for r in readers):
        return None
    return shape


def _is_view(node) -> bool:
    return hasattr(node, "target") and node.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default)


def _read(node, indices: set) -> bool:
    """Whether results ``indices`` of ``node`` are read (by a getitem, or by a reader of the tuple)."""
    return any(u.target is not operator.getitem or u.args[1] in indices for u in node.users)


def _running(b, node, stats, running, momentum: float, count: int) -> None:
    """Results 3 and 4: the running mean and var after this batch's update."""
    mean, var = stats
    unbiased = b.alloc(var.shape, STATS)
    ew.launch_pointwise(b, "mul", unbiased, [var, count / (count - 1) if count > 1 else math.inf])
    for index, (batch, old) in enumerate(((mean, running[0]), (unbiased, running[1])), start=3):
        new, kept = b.alloc(batch.shape, STATS), b.alloc(batch.shape, STATS)
        ew.launch_pointwise(b, "mul", new, [batch, float(momentum)])
        ew.launch_pointwise(b, "mul", kept, [old, 1.0 - float(momentum)])
        ew.launch_pointwise(b, "add", b.out(node, index), [new, kept])


def supported(node) -> str | None:
    x, weight, bias, running_mean, running_var, training, _, _ = _args(node)
    if not training and running_mean is None:
        return "batch norm with training=False and no running statistics"
    if training and node.target is torch.ops.aten._native_batch_norm_legit.default:
        return "batch norm updating its running statistics in place (a functional program has no such node)"
    value = node_value(x)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return "the input is not a tensor of [N, C, ...]"
    tensors = [node_value(a) for a in (x, weight, bias, running_mean, running_var) if a is not None]
    outs = node.meta.get("val")
    for t in [*tensors, *(outs if isinstance(outs, (tuple, list)) else [outs])]:
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            return f"operand or result {getattr(t, 'dtype', t)} is not a floating-point tensor"
    return None
