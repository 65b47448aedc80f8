"""The one registry table: ATen overload -> how to check and lower it, and kernel name -> Triton kernel.

``OPS`` is what the partitioner consults (``support(node)`` returns ``None`` or a refusal reason) and
what the backend calls (``lower(builder, node)``). ``KERNELS`` is what the runtime launches; launch
plans name kernels by these keys. Both tables are written out here on purpose: grep for an op, find
its entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import elementwise as ew
from . import layout

aten = torch.ops.aten


@dataclass(frozen=True)
class OpSpec:
    lower: Callable  # (LaunchBuilder, fx.Node) -> None
    support: Callable = ew.supported  # (fx.Node) -> reason | None
    is_view: bool = False  # launches nothing: the result aliases an operand


def _view(lower, support=layout.supported) -> OpSpec:
    return OpSpec(lower, support, is_view=True)


OPS: dict[object, OpSpec] = {
    # pointwise: elementwise.py
    aten.add.Tensor: OpSpec(ew.binary("add")),
    aten.add.Scalar: OpSpec(ew.binary("add")),
    aten.sub.Tensor: OpSpec(ew.binary("sub")),
    aten.sub.Scalar: OpSpec(ew.binary("sub")),
    aten.rsub.Scalar: OpSpec(ew.rsub),
    aten.rsub.Tensor: OpSpec(ew.rsub),
    aten.mul.Tensor: OpSpec(ew.binary("mul")),
    aten.mul.Scalar: OpSpec(ew.binary("mul")),
    aten.div.Tensor: OpSpec(ew.binary("div")),
    aten.div.Scalar: OpSpec(ew.binary("div")),
    aten.pow.Tensor_Scalar: OpSpec(ew.binary("pow"), ew.supported_float),
    aten.pow.Tensor_Tensor: OpSpec(ew.binary("pow"), ew.supported_float),
    aten.pow.Scalar: OpSpec(ew.pow_scalar_base, ew.supported_float),
    aten.maximum.default: OpSpec(ew.binary("maximum")),
    aten.minimum.default: OpSpec(ew.binary("minimum")),
    aten.eq.Tensor: OpSpec(ew.binary("eq")),
    aten.eq.Scalar: OpSpec(ew.binary("eq")),
    aten.ne.Tensor: OpSpec(ew.binary("ne")),
    aten.ne.Scalar: OpSpec(ew.binary("ne")),
    aten.lt.Tensor: OpSpec(ew.binary("lt")),
    aten.lt.Scalar: OpSpec(ew.binary("lt")),
    aten.le.Tensor: OpSpec(ew.binary("le")),
    aten.le.Scalar: OpSpec(ew.binary("le")),
    aten.gt.Tensor: OpSpec(ew.binary("gt")),
    aten.gt.Scalar: OpSpec(ew.binary("gt")),
    aten.ge.Tensor: OpSpec(ew.binary("ge")),
    aten.ge.Scalar: OpSpec(ew.binary("ge")),
    aten.logical_and.default: OpSpec(ew.binary("logical_and")),
    aten.logical_or.default: OpSpec(ew.binary("logical_or")),
    aten.bitwise_and.Tensor: OpSpec(ew.binary("bitwise_and")),
    aten.bitwise_or.Tensor: OpSpec(ew.binary("bitwise_or")),
    aten.neg.default: OpSpec(ew.unary("neg")),
    aten.exp.default: OpSpec(ew.unary("exp"), ew.supported_float),
    aten.log.default: OpSpec(ew.unary("log"), ew.supported_float),
    aten.sqrt.default: OpSpec(ew.unary("sqrt"), ew.supported_float),
    aten.rsqrt.default: OpSpec(ew.unary("rsqrt"), ew.supported_float),
    aten.reciprocal.default: OpSpec(ew.unary("reciprocal"), ew.supported_float),
    aten.abs.default: OpSpec(ew.unary("abs")),
    aten.sigmoid.default: OpSpec(ew.unary("sigmoid"), ew.supported_float),
    aten.silu.default: OpSpec(ew.unary("silu"), ew.supported_float),
    aten.relu.default: OpSpec(ew.unary("relu")),
    aten.tanh.default: OpSpec(ew.unary("tanh"), ew.supported_float),
    aten.cos.default: OpSpec(ew.unary("cos"), ew.supported_float),
    aten.sin.default: OpSpec(ew.unary("sin"), ew.supported_float),
    aten.logical_not.default: OpSpec(ew.unary("logical_not")),
    aten.gelu.default: OpSpec(ew.gelu, ew.supported_float),
    aten.where.self: OpSpec(ew.where),
    aten.clone.default: OpSpec(ew.copy),
    aten._to_copy.default: OpSpec(ew.copy, ew.supported_copy),
    # views and layout: layout.py
    aten.view.default: _view(layout.view),
    aten._unsafe_view.default: _view(layout.view),
    aten.reshape.default: _view(layout.view),
    aten.alias.default: _view(layout.alias),
    aten.permute.default: _view(layout.permute),
    aten.transpose.int: _view(layout.transpose),
    aten.t.default: _view(layout.t),
    aten.expand.default: _view(layout.expand),
    aten.slice.Tensor: _view(layout.slice_),
    aten.select.int: _view(layout.select),
    aten.unsqueeze.default: _view(layout.unsqueeze),
    aten.squeeze.dim: _view(layout.squeeze),
    aten.squeeze.dims: _view(layout.squeeze),
    aten.squeeze.default: _view(layout.squeeze),
    aten.cat.default: OpSpec(layout.cat, layout.supported_cat),
}

KERNELS: dict[str, object] = {
    "pointwise": ew.pointwise_kernel,
}


def lookup(target) -> OpSpec | None:
    return OPS.get(target)
