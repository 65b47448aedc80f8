"""Activations with parameters, each one pointwise op (``elementwise._formula``) so that it joins a chain
or a GEMM's or convolution's epilogue like ReLU or GELU does. Decomposed, each is a ``where`` of
branches of x (``x > 0 ? x : slope * x``) that no chain of one running value can take: 3 to 5 launches
after a linear instead of none.

    leaky_relu(x, slope)                  x > 0 ? x : x * slope
    prelu(x, weight)                      the same, weight per channel (dim 1; one value for all)
    elu(x, alpha, scale, input_scale)     scale * (x > 0 ? x : alpha * (e^(x * input_scale) - 1))
    celu(x, alpha)                        x > 0 ? x : alpha * (e^(x / alpha) - 1)
    selu(x)                               elu with SELU's alpha and scale (torch decomposes it so)
    softplus(x, beta, threshold)          x * beta > threshold ? x : log(1 + e^(x * beta)) / beta
    mish(x)                               x * tanh(log(1 + e^x))
    hardswish(x)                          x * min(max(x + 3, 0), 6) / 6
    tritondelegate::sigmoid_gate(x, c)    x * sigmoid(c * x): swish written out, CLIP's quick GELU
                                          (``passes/fuse_activations.py`` puts it in place of the pattern)
    tritondelegate::softsign(x)           x / (1 + |x|)        (F.softsign and F.tanhshrink are written
    tritondelegate::tanhshrink(x)         x - tanh(x)           out; the same pass makes them one op)
    log_sigmoid(x)                        min(x, 0) - log(1 + e^-|x|)   (no overflow for any x)
    hardshrink(x, lambd)                  -lambd <= x <= lambd ? 0 : x  (lambd rounded to x's dtype, as
                                          eager compares)
    softshrink(x, lambd)                  x > lambd ? x - lambd : x < -lambd ? x + lambd : x * 0
    threshold(x, th, value)               x <= th ? value : x

``threshold`` has two numbers, and a step of a chain or an epilogue takes one: it runs as two steps
through -inf, ``x <= th ? -inf : x`` then ``-inf -> value`` (no x above th is -inf), which fusion merges
into one launch or into the epilogue before them; a NaN th (nothing compares below it) is a copy.

An ``elu`` with ``input_scale`` other than 1 and a ``softplus`` with ``beta`` other than 1 run as a chain
of up to three steps (the scale, the op, the scale back), whose rounding of x on the positive side may
differ from eager's by an ulp.
"""

from __future__ import annotations

import math

import torch

from .elementwise import launch_pointwise, supported_float
from .refs import node_value


def _arg(node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _scaled(b, node, op: str, param: float, scale: float, back: float) -> None:
    """``out = back * op(scale * x, param)``, each factor a step only when it is not 1."""
    x = b.ref(node.args[0])
    out = b.out(node)
    if scale != 1:
        scaled = b.alloc(x.shape, out.dtype)
        launch_pointwise(b, "mul", scaled, [x, float(scale)])
        x = scaled
    result = out if back == 1 else b.alloc(out.shape, out.dtype)
    launch_pointwise(b, op, result, [x, float(param)])
    if back != 1:
        launch_pointwise(b, "mul", out, [result, float(back)])


def leaky_relu(b, node):
    launch_pointwise(b, "leaky_relu", b.out(node), [b.ref(node.args[0]), float(_arg(node, 1, "negative_slope", 0.01))])


def elu(b, node):
    alpha, scale = float(_arg(node, 1, "alpha", 1.0)), float(_arg(node, 2, "scale", 1.0))
    input_scale = float(_arg(node, 3, "input_scale", 1.0))
    # scale * (x > 0 ? x : alpha (e^(i x) - 1)) = (scale / i) * elu(i x, alpha i) for i > 0
    _scaled(b, node, "elu", alpha * input_scale, input_scale, scale / input_scale)


def celu(b, node):
    launch_pointwise(b, "celu", b.out(node), [b.ref(node.args[0]), float(_arg(node, 1, "alpha", 1.0))])


def softplus(b, node):
    beta, threshold = float(_arg(node, 1, "beta", 1.0)), float(_arg(node, 2, "threshold", 20.0))
    _scaled(b, node, "softplus", threshold, beta, 1.0 / beta)


def unary(op: str):
    def lower(b, node):
        launch_pointwise(b, op, b.out(node), [b.ref(node.args[0])])

    return lower


def sigmoid_gate(b, node):
    launch_pointwise(b, "sigmoid_gate", b.out(node), [b.ref(node.args[0]), float(node.args[1])])


def hardshrink(b, node):
    x = b.ref(node.args[0])
    lambd = float(torch.tensor(float(_arg(node, 1, "lambd", 0.5)), dtype=x.dtype))  # as eager compares
    launch_pointwise(b, "hardshrink", b.out(node), [x, lambd])


def softshrink(b, node):
    launch_pointwise(b, "softshrink", b.out(node), [b.ref(node.args[0]), float(_arg(node, 1, "lambd", 0.5))])


def threshold(b, node):
    """threshold(x, th, value): two steps through -inf (the module docstring says why)."""
    x, th, value = b.ref(node.args[0]), float(node.args[1]), float(node.args[2])
    out = b.out(node)
    if math.isnan(th):
        launch_pointwise(b, "copy", out, [x])
        return
    marked = b.alloc(out.shape, out.dtype)
    launch_pointwise(b, "threshold_mark", marked, [x, th])
    launch_pointwise(b, "threshold_fill", out, [marked, value])


def prelu(b, node):
    """prelu(x, weight): weight [C] over x's dim 1 (or one value over all of x)."""
    x, weight = b.ref(node.args[0]), b.ref(node.args[1])
    strides = [0] * x.ndim
    if weight.shape[0] != 1 and x.ndim >= 2:
        strides[1] = weight.strides[0]
    launch_pointwise(b, "leaky_relu", b.out(node), [x, b.view(weight, x.shape, tuple(strides))])


def supported_elu(node) -> str | None:
    if float(_arg(node, 3, "input_scale", 1.0)) <= 0:
        return "elu with input_scale <= 0"
    return supported_float(node)


def supported_softplus(node) -> str | None:
    if float(_arg(node, 1, "beta", 1.0)) <= 0:
        return "softplus with beta <= 0"
    return supported_float(node)


def supported_prelu(node) -> str | None:
    x, weight = (node_value(a) for a in node.args[:2])
    if weight is None or weight.dim() != 1 or (weight.shape[0] != 1 and (x.dim() < 2 or x.shape[1] != weight.shape[0])):
        return "prelu's weight is neither one value nor one per channel (dim 1)"
    return supported_float(node)
