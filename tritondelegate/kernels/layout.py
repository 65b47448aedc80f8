"""View and layout ops: strided aliases, with a copy only where no alias exists.

The shape, strides and offset of a view are computed by running the real ATen view op on a meta
tensor with the operand's strides, so every view op agrees with PyTorch by construction. A
``view``/``reshape`` of a layout that cannot be viewed falls back to a contiguous copy first
(``elementwise`` copy kernel). ``cat`` copies each operand into a slice of its output.
"""

from __future__ import annotations

import torch

import torch.fx

from . import elementwise as ew
from . import sizes
from .refs import TRef, node_value

aten = torch.ops.aten


def view_of(b, src: TRef, op, *args) -> TRef:
    """The view ``op(src, *args)`` (an ATen view op), its shape, strides and offset computed by ATen,
    symbolically for dynamic sizes. Size nodes among ``args`` (``sym_size`` and arithmetic on it)
    stand for their SymInts. Raises RuntimeError/ValueError when ``src``'s layout has no such view."""
    args = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    symbolic = any(isinstance(a, torch.SymInt) for a in torch.utils._pytree.tree_leaves(args))
    with sizes.tensor_like(src.shape, src.strides, src.offset, src.dtype, symbolic) as t:
        result = op(t, *args)
        shape, strides, offset = result.shape, result.stride(), result.storage_offset()
    return b.view(src, shape, strides, offset)


def _apply(b, node, op, *args) -> None:
    src = b.ref(node.args[0])
    try:
        view = view_of(b, src, op, *args)
    except (RuntimeError, ValueError):
        # Not viewable with these strides (a view of a transpose, say): view a contiguous copy.
        view = view_of(b, b.contiguous(src), op, *args)
    b.alias(node, view)


def view(b, node):
    _apply(b, node, aten.view.default, node.args[1])


def alias(b, node):
    b.alias(node, b.ref(node.args[0]))


def permute(b, node):
    _apply(b, node, aten.permute.default, node.args[1])


def transpose(b, node):
    _apply(b, node, aten.transpose.int, *node.args[1:])


def t(b, node):
    _apply(b, node, aten.t.default)


def expand(b, node):
    _apply(b, node, aten.expand.default, node.args[1])


def slice_(b, node):
    _apply(b, node, aten.slice.Tensor, *node.args[1:])


def select(b, node):
    _apply(b, node, aten.select.int, *node.args[1:])


def unsqueeze(b, node):
    _apply(b, node, aten.unsqueeze.default, node.args[1])


def squeeze(b, node):
    _apply(b, node, node.target, *node.args[1:])


def supported(node) -> str | None:
    """None when the result is a tensor of a supported dtype (operands are not looked at)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "result is not a tensor"
    if val.dtype not in ew.DTYPES:
        return f"dtype {val.dtype} is not supported (supported: {', '.join(map(str, ew.DTYPES))})"
    return None


def cat(b, node):
    """out[..., k0:k1, ...] = input_k for each operand, along ``dim``."""
    out = b.out(node)
    dim = node.args[1] if len(node.args) > 1 else 0
    dim = dim % out.ndim
    start = 0
    for arg in node.args[0]:
        src = b.ref(arg)
        if src.numel == 0 and src.ndim == 1:
            continue  # legacy empty operand of cat
        size = src.shape[dim]
        shape = list(out.shape)
        shape[dim] = size
        dst = b.view(out, shape, out.strides, out.offset + start * out.strides[dim])
        ew.launch_pointwise(b, "copy", dst, [src])
        start += size


def supported_cat(node) -> str | None:
    reason = supported(node)
    if reason:
        return reason
    for arg in node.args[0]:
        if not isinstance(node_value(arg), torch.Tensor):
            return "an operand of cat is not a tensor"
    return None


def split_with_sizes(b, node):
    """split_with_sizes(x, sizes, dim): a tuple of slices of x along dim, all aliases."""
    src = b.ref(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % src.ndim
    parts, start = [], 0
    for size in node.args[1]:
        shape = list(src.shape)
        shape[dim] = size
        parts.append(b.view(src, shape, src.strides, src.offset + start * src.strides[dim]))
        start += size
    b.bind(node, tuple(parts))


def supported_split(node) -> str | None:
    vals = node.meta.get("val")
    if not isinstance(vals, (list, tuple)) or not all(isinstance(v, torch.Tensor) for v in vals):
        return "result is not a list of tensors"
    if vals and vals[0].dtype not in ew.DTYPES:
        return f"dtype {vals[0].dtype} is not supported"
    return None
