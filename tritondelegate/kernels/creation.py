"""Creation ops: tensors made from scalars, with no tensor operand read.

    full / full_like / fill / scalar_tensor:  out[i] = value         (the pointwise kernel, a scalar copy)
    arange:                                   out[i] = start + i * step
    empty / empty_permuted:                   a fresh output, no launch

Sizes, values and dtypes come from the node. A size may be dynamic (``torch.arange(x.shape[1])``,
``torch.zeros(x.shape[0], 4)``): the output's shape, and so the launch's grid and length, are then
expressions over the method's symbols. ``arange``'s start and step and a fill value may be size
nodes too (position ids ``arange(past, past + seq)``, ``torch.full((b,), x.shape[1])``): they are
passed as integer arguments. ``full`` and friends reuse the pointwise kernel with a scalar operand;
only ``arange`` needs a kernel of its own, because its value depends on the element's index.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from . import elementwise as ew
from . import layout
from . import sizes
from .sizes import is_size_node

BLOCK = 1024


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def arange_kernel(out_ptr, n, start, step, IS_FLOAT: tl.constexpr, BLOCK: tl.constexpr):
    # out[i] = start + i * step; fp32 math for floating outputs, int64 for integer outputs
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if IS_FLOAT:
        value = start + offs.to(tl.float32) * step
    else:
        value = start + offs * step
    tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launchers -------------------------------------------------------------------------------
def launch_fill(b, out, value) -> None:
    """``out[...] = value`` (a Python scalar), through the pointwise kernel."""
    ew.launch_pointwise(b, "copy", out, [value])


def _number(value, is_float: bool):
    """A Python number as the kernel takes it, or an integer size expression (a dynamic start or step,
    which the kernel converts to fp32 for a floating output)."""
    if not sizes.is_static(value):
        return sizes.size(value)
    return float(value) if is_float else int(value)


def launch_arange(b, out, start, step) -> None:
    """``out[i] = start + i * step``; ``start`` and ``step`` Python numbers or integer sizes."""
    is_float = out.dtype.is_floating_point
    b.launch("arange", (triton.cdiv(out.numel, BLOCK),), out, out.numel, _number(start, is_float),
             _number(step, is_float), IS_FLOAT=is_float, BLOCK=BLOCK)


# --- lowerings ------------------------------------------------------------------------------------
def _arange_args(node) -> tuple[object, object]:
    """(start, step) of any arange overload; the length comes from the node's result."""
    if node.target == torch.ops.aten.arange.default:
        return 0, 1
    start = node.args[0]
    step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
    return start, step


def arange(b, node):
    start, step = _arange_args(node)
    launch_arange(b, b.out(node), b.size(start) if is_size_node(start) else start,
                  b.size(step) if is_size_node(step) else step)


def full(b, node):  # full(size, value) / scalar_tensor(value)
    value = node.args[1] if node.target == torch.ops.aten.full.default else node.args[0]
    launch_fill(b, b.out(node), b.size(value) if is_size_node(value) else value)


def full_like(b, node):  # full_like(x, value) / fill.Scalar(x, value): x's shape, not its data
    value = node.args[1]
    launch_fill(b, b.out(node), b.size(value) if is_size_node(value) else value)


# Ops whose result's contents are undefined: nothing to compute, to fold or to copy.
EMPTY_OPS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_permuted.default,
             torch.ops.aten.empty_like.default, torch.ops.aten.empty_strided.default,
             torch.ops.aten.new_empty.default)


def is_empty(arg) -> bool:
    """Whether fx argument ``arg`` is the result of an ``empty`` op (undefined contents)."""
    return isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target in EMPTY_OPS


def empty(b, node):
    """The contents of an empty tensor are undefined: a fresh output is all it takes."""
    b.out(node)


# --- support checks -------------------------------------------------------------------------------
ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


def _scalar_args(node) -> list:
    if node.target in (torch.ops.aten.full.default, torch.ops.aten.full_like.default,
                       torch.ops.aten.fill.Scalar):
        return [node.args[1]]
    if node.target == torch.ops.aten.scalar_tensor.default:
        return [node.args[0]]
    if node.target in ARANGES:
        return [a for a in _arange_args(node)]
    return []


def supported(node) -> str | None:
    reason = layout.supported(node)
    if reason:
        return reason
    for arg in _scalar_args(node):
        if is_size_node(arg):
            continue  # an integer value, start or step that depends on the dynamic sizes
        if not isinstance(arg, numbers.Number):
            return (f"value {arg!r} is neither a constant number nor an integer size (other dynamic "
                    "values are not supported)")
    return None


def supported_arange(node) -> str | None:
    reason = supported(node)
    if reason:
        return reason
    start, step = _arange_args(node)
    dtype = node.meta["val"].dtype
    if dtype == torch.bool:
        return "arange with dtype torch.bool is not supported"
    integral = all(isinstance(a, numbers.Integral) or is_size_node(a) for a in (start, step))
    if not dtype.is_floating_point and not integral:
        return f"integer arange ({dtype}) with non-integer start {start!r} or step {step!r}"
    return None
