"""View and layout ops: strided aliases, with a copy only where no alias exists.

The shape, strides and offset of a view are computed by running the real ATen view op on a meta
tensor with the operand's strides, so every view op agrees with PyTorch by construction. A
``view``/``reshape`` of a layout that cannot be viewed falls back to a contiguous copy first
(``elementwise`` copy kernel). ``cat`` copies each operand into a slice of its output; ``repeat`` copies
its operand, read through zero strides, into its output viewed as (copies, size) per dim.

``cat_kernel`` copies up to ``MAX_PARTS`` parts into adjacent slices of one output in one launch:
``fuse_cat.py`` merges a cat's copies (or an update chain's, ``slice_scatter`` after ``slice_scatter``)
into it once fusion has taken the copies that a producer computes straight into their slice.
"""

from __future__ import annotations

import math
from itertools import accumulate

import torch
import torch.fx
import triton
import triton.language as tl

from . import elementwise as ew
from . import sizes
from .refs import MAX_RANK, TRef, broadcast_strides, collapse, collapse_padded, node_value

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


def unfold(b, node):
    """``x.unfold(dim, size, step)``: windows of ``size`` every ``step`` along ``dim`` as a new last dim,
    a strided view whose windows overlap when step < size (kernels read it through its strides)."""
    _apply(b, node, aten.unfold.default, *node.args[1:])


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


# --- one launch for a concatenation -----------------------------------------------------------------
MAX_PARTS = 4  # parts one cat launch copies


@triton.jit
def _part(ptr, i0, i1, i2, i3, i4, s0, s1, s2, s3, s4, start, mask, DIM: tl.constexpr):
    # The part's element at output index (i0, .., i4): its own index along DIM counts from ``start``.
    if DIM == 0:
        i0 = i0 - start
    elif DIM == 1:
        i1 = i1 - start
    elif DIM == 2:
        i2 = i2 - start
    elif DIM == 3:
        i3 = i3 - start
    else:
        i4 = i4 - start
    return tl.load(ptr + i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3 + i4 * s4, mask=mask, other=0)


@triton.jit
def cat_kernel(
    out_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
    n, d1, d2, d3, d4,
    os0, os1, os2, os3, os4,
    p0s0, p0s1, p0s2, p0s3, p0s4,
    p1s0, p1s1, p1s2, p1s3, p1s4,
    p2s0, p2s1, p2s2, p2s3, p2s4,
    p3s0, p3s1, p3s2, p3s3, p3s4,
    e0, e1, e2,
    DIM: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
):
    # out[..., c, ...] along DIM = part k's [..., c - e(k-1), ...] for e(k-1) <= c < e(k) (e(-1) = 0, the
    # last part to the end), each part cast to out's dtype; a masked-off load reads no memory.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    i0, i1, i2, i3, i4 = ew.unravel5(offs, d1, d2, d3, d4)
    if DIM == 0:
        c = i0
    elif DIM == 1:
        c = i1
    elif DIM == 2:
        c = i2
    elif DIM == 3:
        c = i3
    else:
        c = i4
    ty = out_ptr.dtype.element_ty
    # ends past the last part are the output's size along DIM
    r = _part(p0_ptr, i0, i1, i2, i3, i4, p0s0, p0s1, p0s2, p0s3, p0s4, 0, mask & (c < e0), DIM).to(ty)
    if PARTS >= 2:
        m = mask & (c >= e0) & (c < e1)
        r = tl.where(c >= e0, _part(p1_ptr, i0, i1, i2, i3, i4, p1s0, p1s1, p1s2, p1s3, p1s4, e0, m, DIM).to(ty), r)
    if PARTS >= 3:
        m = mask & (c >= e1) & (c < e2)
        r = tl.where(c >= e1, _part(p2_ptr, i0, i1, i2, i3, i4, p2s0, p2s1, p2s2, p2s3, p2s4, e1, m, DIM).to(ty), r)
    if PARTS >= 4:
        m = mask & (c >= e2)
        r = tl.where(c >= e2, _part(p3_ptr, i0, i1, i2, i3, i4, p3s0, p3s1, p3s2, p3s3, p3s4, e2, m, DIM).to(ty), r)
    tl.store(out_ptr + i0 * os0 + i1 * os1 + i2 * os2 + i3 * os3 + i4 * os4, r, mask=mask)


def _walk_around(shape, stride_sets, dim: int):
    """The dims before ``dim`` and those after it, each collapsed apart (``dim`` stays a dim of its
    own), left-padded to MAX_RANK dims: (sizes, strides per set, the position of ``dim``), or None
    when more than MAX_RANK dims remain."""
    before = collapse(shape[:dim], [s[:dim] for s in stride_sets])
    after = collapse(shape[dim + 1:], [s[dim + 1:] for s in stride_sets])
    sizes_ = before[0] + [shape[dim]] + after[0]
    if len(sizes_) > MAX_RANK:
        return None
    pad = MAX_RANK - len(sizes_)
    strides = [[0] * pad + b + [s[dim]] + a for s, b, a in zip(stride_sets, before[1], after[1])]
    return [1] * pad + sizes_, strides, pad + len(before[0])


def cat_launch(out: TRef, parts: list, dim: int):
    """(grid, args, constexprs) of one ``cat_kernel`` launch writing ``out`` (the union of the parts'
    slices along ``dim``) from ``parts``: (source, its size along ``dim``) in order, each source
    broadcast to its slice. None when the walk needs more than MAX_RANK dims."""
    if not 2 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a cat launch copies 2 to {MAX_PARTS} parts, not {len(parts)}")
    stride_sets = [list(out.strides)]
    for src, size in parts:
        part_shape = list(out.shape)
        part_shape[dim] = size
        stride_sets.append(list(broadcast_strides(src, part_shape)))
    walk = _walk_around(list(out.shape), stride_sets, dim)
    if walk is None:
        return None
    shape, strides, position = walk
    ends = list(accumulate(size for _, size in parts))
    ends = (ends[:-1] + [out.shape[dim]] * MAX_PARTS)[:MAX_PARTS - 1]
    srcs = [src for src, _ in parts] + [out] * (MAX_PARTS - len(parts))  # unused slots: never read
    part_strides = strides[1:] + [[0] * MAX_RANK] * (MAX_PARTS - len(parts))
    n = math.prod(out.shape)
    args = [out, *srcs, n, *shape[1:], *strides[0], *(s for ss in part_strides for s in ss), *ends]
    constexprs = {"DIM": position, "PARTS": len(parts), "BLOCK": ew.BLOCK}
    return (triton.cdiv(n, ew.BLOCK),), args, constexprs
