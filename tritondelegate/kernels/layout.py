"""View and layout ops: strided aliases, with a copy only where no alias exists.

The shape, strides and offset of a view are computed by running the real ATen view op on a meta
tensor with the operand's strides, so every view op agrees with PyTorch by construction. A
``view``/``reshape`` of a layout that cannot be viewed falls back to a contiguous copy first
(``elementwise`` copy kernel). ``cat`` copies each operand into a slice of its output; ``repeat`` copies
its operand, read through zero strides, into its output viewed as (copies, size) per dim.
"""

from __future__ import annotations

import math

import torch

import torch.fx

from . import elementwise as ew
from . import sizes
from .refs import MAX_RANK, TRef, collapse_padded, node_value

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


def repeat(b, node):
    """repeat(x, repeats): out viewed as [r0, s0, r1, s1, ...] (s the sizes of x, left-padded with 1s to
    len(repeats)) is one copy of x read with stride 0 along each r; when that walk has more dims than
    a copy takes, one copy per repeated dim, each into scratch but the last."""
    x = b.ref(node.args[0])
    reps = b.sizes(node.args[1])
    out = b.out(node)
    pad = len(reps) - x.ndim
    src = b.view(x, [1] * pad + list(x.shape), [0] * pad + list(x.strides))
    if collapse_padded(*_repeated(src, out, reps, range(len(reps))), MAX_RANK) is not None:
        _copy_repeated(b, src, out, reps, range(len(reps)))
        return
    dims = [d for d, r in enumerate(reps) if r != 1]
    base = src.shape
    for n, d in enumerate(dims):
        shape = [reps[k] * base[k] if k in dims[:n + 1] else base[k] for k in range(len(reps))]
        dst = out if n == len(dims) - 1 else b.alloc(shape, out.dtype)
        _copy_repeated(b, src, dst, reps, [d])
        src = dst


def _repeated(src: TRef, dst: TRef, reps, dims) -> tuple:
    """(shape, [dst strides, src strides]) of ``dst`` viewed as (copies, size) along ``dims`` of ``src``."""
    shape, dst_strides, src_strides = [], [], []
    for k, (n, s, o) in enumerate(zip(src.shape, src.strides, dst.strides)):
        r = reps[k] if k in dims else 1
        shape += [r, n]
        dst_strides += [n * o, o]
        src_strides += [0, s]
    return shape, [dst_strides, src_strides]


def _copy_repeated(b, src: TRef, dst: TRef, reps, dims) -> None:
    shape, (dst_strides, src_strides) = _repeated(src, dst, reps, dims)
    ew.launch_pointwise(b, "copy", b.view(dst, shape, dst_strides), [b.view(src, shape, src_strides)])


def supported_repeat(node) -> str | None:
    if len(node.args[1]) > MAX_RANK - 1:
        return f"repeats over {len(node.args[1])} dims: a copy walks at most {MAX_RANK - 1} repeated dims"
    return supported(node)


def _strided_args(node) -> tuple:
    """(size, stride, storage_offset or None) of ``as_strided``, positional or by keyword."""
    return tuple(node.args[k] if len(node.args) > k else node.kwargs.get(name)
                 for k, name in ((1, "size"), (2, "stride"), (3, "storage_offset")))


def as_strided(b, node):
    """as_strided(x, size, stride, storage_offset=None) of a contiguous x, within its own elements
    (``supported_strided``): a view of x's contiguous buffer (adaptive pooling's restride of its
    [N, C, 1, 1] mean)."""
    x = b.contiguous(b.ref(node.args[0]))
    size, stride, offset = _strided_args(node)
    own = node.args[0].meta["val"].storage_offset()
    start = x.offset + (0 if offset is None else offset - own)
    b.bind(node, b.view(x, b.sizes(size), b.sizes(stride), start))


def _restride(x, size, stride, offset) -> bool:
    """Whether ``as_strided`` only changes the strides of x's size-1 dims (its elements stay put):
    adaptive pooling's restride of its [N, C, 1, 1] mean, with a dynamic N too."""
    size, stride = ([node_value(v) if isinstance(v, torch.fx.Node) else v for v in vs] for vs in (size, stride))
    if len(size) != x.dim() or len(stride) != x.dim():
        return False
    same = sizes.shape(size) == sizes.shape(x.shape) and offset in (None, x.storage_offset())
    return same and all(sizes.size(n) == 1 or sizes.size(s) == sizes.size(t)
                        for n, s, t in zip(size, stride, x.stride()))


def supported_strided(node) -> str | None:
    x = node_value(node.args[0])
    size, stride, offset = _strided_args(node)
    if isinstance(x, torch.Tensor) and x.is_contiguous() and _restride(x, size, stride, offset):
        return supported(node)
    if not isinstance(x, torch.Tensor) or not sizes.is_static(list(x.shape)) or not x.is_contiguous():
        return "as_strided of a tensor that is not contiguous with static sizes"
    if not all(isinstance(v, int) for v in (*size, *stride)) or not isinstance(offset, (int, type(None))):
        return "as_strided with dynamic sizes or strides"
    start = 0 if offset is None else offset - x.storage_offset()
    reach = start + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
    if start < 0 or min(stride, default=0) < 0 or (math.prod(size) and reach >= x.numel()):
        return f"as_strided reaches outside its operand's {x.numel()} elements"
    return supported(node)
