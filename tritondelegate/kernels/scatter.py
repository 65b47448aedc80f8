"""Scatter ops, the KV-cache updates: index_put, index_copy, scatter (src and value), scatter_add share
one scatter kernel; slice_scatter, select_scatter and copy are pointwise copies into a strided view.

The scatter kernel is the mirror image of ``index.gather_kernel``, over the coordinates ``o`` of an
iteration shape (up to ``MAX_RANK`` dims after merging contiguous ones):

    dst[ sum_j o_j * S_j  +  sum_k wrap(idx_k[sum_j o_j * T_kj]) * U_k ]  =  src[sum_j o_j * V_j]
                                                                       (+= atomically: ACCUMULATE)

``S`` maps iteration dims that walk a destination dim directly (0 elsewhere), index tensor ``k`` is
seen through broadcasting in iteration coordinates (strides ``T_k``) and its values select along the
destination dim of stride ``U_k`` and size ``N_k``; negative indices wrap once (``i + N_k``). ``src``
is a tensor seen through broadcasting (strides ``V``) or one scalar. An out-of-range index, an error in
PyTorch, writes nothing here rather than memory outside the destination. With ``PAIR`` (two cache
writes, k and v, paired by ``fusion.pair_scatters``) grid axis 1 has two programs: program 1 writes
``dst2`` from ``src2`` (strides ``W``) at the same offsets and indices. Accumulation runs in fp32 or
int64 atomics: fp16/bf16 destinations accumulate in an fp32 copy (bf16 atomics are also missing from
the Triton interpreter).

Functional (the default), a lowering copies ``self`` into a fresh output and scatters into it. A node
marked ``node.meta["td_inplace"]`` (the reinplacing pass: ``self`` is program state nobody reads
afterwards) scatters into ``self``'s own memory instead and its result is ``self``'s ref
(``LaunchBuilder.writes_in_place``).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.fx
import triton
import triton.language as tl

from . import elementwise as ew
from . import sizes as size_fns
from .creation import is_empty
from .index import (MAX_INDICES, _dtype_reason, advanced_layout, broadcast_shape, index_reason, index_walks,
                    indexed_offsets, values_strides, walked_dims)
from .layout import view_of
from ..errors import LoweringError
from ..plan import Arg, Launch
from .refs import FLOAT_DTYPES, MAX_RANK, TRef, collapse, node_value, same_view
from .rows import node_arg

aten = torch.ops.aten
BLOCK = 1024
ACCUMULATE_DTYPES = FLOAT_DTYPES + (torch.int64, torch.int32)
HALF_DTYPES = (torch.float16, torch.bfloat16)  # accumulated in an fp32 copy


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def scatter_kernel(
    dst_ptr, src_ptr, idx0_ptr, idx1_ptr, idx2_ptr, value,
    n, d1, d2, d3, d4,
    ds0, ds1, ds2, ds3, ds4,
    vs0, vs1, vs2, vs3, vs4,
    t00, t01, t02, t03, t04,
    t10, t11, t12, t13, t14,
    t20, t21, t22, t23, t24,
    size0, size1, size2, u0, u1, u2,
    dst2_ptr, src2_ptr, ws0, ws1, ws2, ws3, ws4,
    NUM_INDICES: tl.constexpr, ACCUMULATE: tl.constexpr, SRC_SCALAR: tl.constexpr, BLOCK: tl.constexpr,
    PAIR: tl.constexpr = False,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    i0, i1, i2, i3, i4 = ew.unravel5(offs, d1, d2, d3, d4)
    dst_offs, valid = indexed_offsets(
        idx0_ptr, idx1_ptr, idx2_ptr, i0, i1, i2, i3, i4, ds0, ds1, ds2, ds3, ds4,
        t00, t01, t02, t03, t04, t10, t11, t12, t13, t14, t20, t21, t22, t23, t24,
        size0, size1, size2, u0, u1, u2, mask, NUM_INDICES)
    if PAIR:  # grid axis 1 picks the pair member: program 1 writes dst2 from src2 (strides ws)
        if tl.program_id(1) == 1:
            _scatter_store(dst2_ptr, src2_ptr, value, dst_offs, valid, mask, i0, i1, i2, i3, i4,
                           ws0, ws1, ws2, ws3, ws4, ACCUMULATE, SRC_SCALAR, BLOCK)
        else:
            _scatter_store(dst_ptr, src_ptr, value, dst_offs, valid, mask, i0, i1, i2, i3, i4,
                           vs0, vs1, vs2, vs3, vs4, ACCUMULATE, SRC_SCALAR, BLOCK)
    else:
        _scatter_store(dst_ptr, src_ptr, value, dst_offs, valid, mask, i0, i1, i2, i3, i4,
                       vs0, vs1, vs2, vs3, vs4, ACCUMULATE, SRC_SCALAR, BLOCK)


@triton.jit
def _scatter_store(dst_ptr, src_ptr, value, dst_offs, valid, mask, i0, i1, i2, i3, i4, vs0, vs1, vs2, vs3, vs4,
                   ACCUMULATE: tl.constexpr, SRC_SCALAR: tl.constexpr, BLOCK: tl.constexpr):
    if SRC_SCALAR:
        v = tl.full([BLOCK], value, dtype=dst_ptr.dtype.element_ty)
    else:
        v = tl.load(src_ptr + i0 * vs0 + i1 * vs1 + i2 * vs2 + i3 * vs3 + i4 * vs4, mask=mask, other=0)
        v = v.to(dst_ptr.dtype.element_ty)
    if ACCUMULATE:
        # Launches are ordered by the stream: relaxed ordering suffices between this launch's adds.
        tl.atomic_add(dst_ptr + dst_offs, v, mask=valid, sem="relaxed")
    else:
        tl.store(dst_ptr + dst_offs, v, mask=valid)


# --- host launcher --------------------------------------------------------------------------------
def launch_scatter(b, dst: TRef, src, shape, direct, values, indices, accumulate: bool = False) -> None:
    """For every ``o`` in ``shape``: ``dst[o.S + sum_k wrap(idx_k[o.T_k]) * U_k] = src[o.V]`` (``+=``
    atomically when ``accumulate``). ``direct`` is S and ``values`` is V (one stride per iteration
    dim; ignored when ``src`` is a Python scalar); ``indices`` holds (index TRef, T, N, U) as in
    ``index.launch_gather``."""
    if not 1 <= len(indices) <= MAX_INDICES:
        raise NotImplementedError(f"{len(indices)} index tensors (supported: 1 to {MAX_INDICES})")
    if accumulate and dst.dtype not in (torch.float32, torch.int64, torch.int32):
        raise LoweringError(f"internal error: atomic accumulation into {dst.dtype}")
    scalar = not isinstance(src, TRef)
    stride_sets = [list(direct), [0] * len(shape) if scalar else list(values)]
    stride_sets += [list(t) for _, t, _, _ in indices]
    sizes, strides = collapse(shape, stride_sets)
    if len(sizes) > MAX_RANK:
        raise NotImplementedError(f"scatter over {len(sizes)} non-mergeable dims (at most {MAX_RANK})")
    pad = MAX_RANK - len(sizes)
    sizes = [1] * pad + sizes
    strides = [[0] * pad + s for s in strides]
    direct_strides, value_strides, index_strides = strides[0], strides[1], strides[2:]
    padded = list(indices) + [indices[0]] * (MAX_INDICES - len(indices))  # unused slots, never read
    index_strides = index_strides + [[0] * MAX_RANK] * (MAX_INDICES - len(indices))
    value = (float(src) if dst.dtype.is_floating_point else int(src)) if scalar else 0
    n = math.prod(shape)
    source = dst if scalar else src
    record = b.launch(
        "scatter", (triton.cdiv(n, BLOCK),),
        dst, source, *(p[0] for p in padded), value,
        n, *sizes[1:], *direct_strides, *value_strides, *(s for t in index_strides for s in t),
        *(p[2] for p in padded), *(p[3] for p in padded),
        dst, source, *value_strides,  # the pair slots (PAIR=False): stand-ins, never read
        NUM_INDICES=len(indices), ACCUMULATE=accumulate, SRC_SCALAR=scalar, BLOCK=BLOCK,
    )
    if record is not None and not scalar and not accumulate:
        record.op = ScatterOp(dst, src)


# --- pairs: two cache writes in one launch ---------------------------------------------------------
@dataclass(frozen=True)
class ScatterOp:
    """What a plain scatter launch (a tensor source, no accumulation) writes and reads, for
    ``fusion.pair_scatters``."""

    dst: TRef
    src: TRef


_PARAMS = list(inspect.signature(scatter_kernel.fn).parameters)
_PAIR_SLOTS = _PARAMS.index("dst2_ptr")  # the pair's slots close the runtime arguments
_OWN = [_PARAMS.index(p) for p in ("dst_ptr", "src_ptr", "vs0", "vs1", "vs2", "vs3", "vs4")]  # a member's own


def pair_launch(first: Launch, second: Launch, a: ScatterOp, c: ScatterOp) -> Launch | None:
    """``first`` and ``second`` (scatters computing ``a`` and ``c``) as one PAIR launch (grid axis 1
    picks the member), or None unless they walk the same iteration and indices into destinations
    of one dtype from sources of one dtype: the same grid, constexprs and arguments but for their
    own destination, source and source strides."""
    if (first.kernel != "scatter" or second.kernel != "scatter" or tuple(first.grid) != tuple(second.grid)
            or len(first.grid) != 1 or first.constexprs != second.constexprs
            or first.constexprs.get("PAIR", Arg.of(False)).value
            or a.dst.dtype != c.dst.dtype or a.src.dtype != c.src.dtype or a.dst.buffer == c.dst.buffer):
        return None
    if any(x != y for k, (x, y) in enumerate(zip(first.args[:_PAIR_SLOTS], second.args)) if k not in _OWN):
        return None
    own = [second.args[k] for k in _OWN]
    return Launch("scatter", (first.grid[0], 2), first.args[:_PAIR_SLOTS] + own,
                  {**first.constexprs, "PAIR": Arg.of(True)}, f"{first.op}+{second.op}")


# --- destinations: functional or in place ---------------------------------------------------------
# Functional updates whose first argument is the tensor they update, with a kernel here that can write
# the update in place; their result is otherwise a fresh output (``passes/state.py`` reinplaces them).
UPDATE_OPS = {
    aten.index_put.default, aten.index_copy.default, aten.slice_scatter.default, aten.select_scatter.default,
    aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.copy.default,
}


def _in_place(node) -> bool:
    return bool(node.meta.get("td_inplace", False))


def _spent(b, node) -> bool:
    """Whether ``node``'s ``self`` is a fresh result of this delegate that nothing but ``node`` reads:
    an ``empty`` tensor's or an earlier functional update's (not one in place), in scratch memory,
    with no other reader, not even a view or the delegate's output. Writing into it then loses
    nothing: a tensor filled slice by slice (``slice_scatter`` after ``slice_scatter``) needs no copy
    of itself per step."""
    base = node.args[0]
    return (isinstance(base, torch.fx.Node) and base.op == "call_function" and len(base.users) == 1
            and (base.target in UPDATE_OPS or is_empty(base)) and not _in_place(base)
            and b.is_scratch(b.ref(base)))


def _destination(b, node, copy_self: bool = True) -> TRef:
    """Where ``node``'s update goes, bound as its result: ``self``'s own memory when the node is
    marked in place or ``self`` is spent (:func:`_spent`), else a fresh output, holding a copy of
    ``self`` when ``copy_self`` and ``self`` has contents (not an ``empty`` tensor: a Mixture-of-Experts
    router's inverse order is an ``index_put`` into one)."""
    if _in_place(node) or _spent(b, node):
        dst = b.ref(node.args[0])
        b.writes_in_place(dst)
        b.bind(node, dst)
        return dst
    out = b.out(node)
    if copy_self and not is_empty(node.args[0]):
        ew.launch_pointwise(b, "copy", out, [b.ref(node.args[0])])
    return out


def _apart(b, ref: TRef, dst: TRef) -> TRef:
    """``ref``, or a scratch copy of it when it lives in ``dst``'s buffer (an in-place update must
    not read what it is overwriting in the same launch)."""
    if not isinstance(ref, TRef) or ref.buffer != dst.buffer:
        return ref
    copy = b.alloc(ref.shape, ref.dtype)
    ew.launch_pointwise(b, "copy", copy, [ref])
    return copy


def _scatter_update(b, node, accumulate: bool, scatter) -> None:
    """Run ``scatter(dst)`` (it launches the scatter kernel into ``dst``) on ``node``'s destination.
    fp16/bf16 accumulation goes through an fp32 copy of ``self``, cast back into the destination."""
    if node.meta.get("td_appended") and _in_place(node):  # the attention launch that reads it writes the rows
        _destination(b, node)
        return
    self_ref = b.ref(node.args[0])
    staged = accumulate and self_ref.dtype in HALF_DTYPES
    dst = _destination(b, node, copy_self=not staged)
    if not staged:
        scatter(dst)
        return
    acc = b.alloc(self_ref.shape, torch.float32)
    ew.launch_pointwise(b, "copy", acc, [self_ref])
    scatter(acc)
    ew.launch_pointwise(b, "copy", dst, [acc])


def _copy_into_view(b, node, op, *view_args) -> None:
    """slice_scatter / select_scatter: ``dst`` with the view ``op(dst, *view_args)`` set to ``src``."""
    dst = _destination(b, node)
    target = view_of(b, dst, op, *view_args)
    src = b.ref(node.args[1])
    if not same_view(target, src):  # an in-place copy may already have written it there
        ew.launch_pointwise(b, "copy", target, [_apart(b, src, target)])


# --- lowerings ------------------------------------------------------------------------------------
def index_put(b, node):
    """index_put(self, indices, values, accumulate=False): ``self[indices] = values`` (``+=`` with
    accumulate), indices a list of integer index tensors or None (the whole dim)."""
    accumulate = bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))

    def scatter(dst):
        entries = list(node.args[1])
        dims = [d for d, e in enumerate(entries) if e is not None]
        refs = [_apart(b, b.ref(entries[d]), dst) for d in dims]
        shape, direct, indices = advanced_layout(dst, refs, dims)
        values = _apart(b, b.ref(node.args[2]), dst)
        launch_scatter(b, dst, values, shape, direct, values_strides(values, shape), indices, accumulate)

    _scatter_update(b, node, accumulate, scatter)


def index_copy(b, node):
    """index_copy(self, dim, index, source): ``self`` with ``self.select(dim, index[i]) =
    source.select(dim, i)``."""

    def scatter(dst):
        idx = _apart(b, b.ref(node.args[2]), dst)
        src = _apart(b, b.ref(node.args[3]), dst)
        if dst.ndim == 0:  # index 0 (or -1) of a size-1 dim
            launch_scatter(b, dst, src, (), [], [], [(idx, [], 1, 0)])
            return
        dim = node.args[1] % dst.ndim
        direct = [0 if j == dim else s for j, s in enumerate(dst.strides)]
        along = [0] * dst.ndim
        along[dim] = idx.strides[0] if idx.ndim else 0
        indices = [(idx, along, dst.shape[dim], dst.strides[dim])]
        launch_scatter(b, dst, src, src.shape, direct, src.strides, indices)

    _scatter_update(b, node, False, scatter)


def _scatter(b, node, accumulate: bool) -> None:
    """scatter(self, dim, index, src or value) and scatter_add: for o over index's shape,
    ``self[o with o_dim := index[o]] = src[o]`` (or the scalar; ``+=`` for scatter_add)."""

    def scatter(dst):
        idx = _apart(b, b.ref(node.args[2]), dst)
        src = node.args[3]
        src = _apart(b, b.ref(src), dst) if hasattr(src, "meta") else src
        values = list(src.strides) if isinstance(src, TRef) else []
        if dst.ndim == 0:
            launch_scatter(b, dst, src, idx.shape, [0] * idx.ndim, values, [(idx, list(idx.strides), 1, 0)],
                           accumulate)
            return
        dim = node.args[1] % dst.ndim
        direct = [0 if j == dim else s for j, s in enumerate(dst.strides)]
        indices = [(idx, list(idx.strides), dst.shape[dim], dst.strides[dim])]
        launch_scatter(b, dst, src, idx.shape, direct, values, indices, accumulate)

    _scatter_update(b, node, accumulate, scatter)


def scatter(b, node):
    _scatter(b, node, accumulate=False)


def scatter_add(b, node):
    _scatter(b, node, accumulate=True)


def slice_scatter(b, node):  # slice_scatter(self, src, dim=0, start=None, end=None, step=1)
    _copy_into_view(b, node, aten.slice.Tensor, node_arg(node, 2, "dim", 0), node_arg(node, 3, "start", None),
                    node_arg(node, 4, "end", None), node_arg(node, 5, "step", 1))


def select_scatter(b, node):  # select_scatter(self, src, dim, index)
    _copy_into_view(b, node, aten.select.int, node.args[2], node.args[3])


def copy(b, node):
    """copy(self, src): ``src`` broadcast to ``self``'s shape, cast to its dtype; ``self``'s values
    are not read. In place it is written into ``self``'s memory."""
    dst = _destination(b, node, copy_self=False)
    src = b.ref(node.args[1])
    if not same_view(dst, src):
        ew.launch_pointwise(b, "copy", dst, [_apart(b, src, dst)])


def refused(b, node):
    raise LoweringError(f"node {node.name!r} ({node.target}) has no scatter kernel: {refuse_reduce(node)}")


# --- support checks -------------------------------------------------------------------------------
def _common_reason(node, src_arg, index_args, accumulate: bool) -> str | None:
    out, self_val = node.meta.get("val"), node_value(node.args[0])
    allowed = ACCUMULATE_DTYPES if accumulate else ew.DTYPES
    reason = _dtype_reason(out, "the result", allowed) or _dtype_reason(self_val, "self", allowed)
    if reason:
        return f"accumulating: {reason}" if accumulate else reason
    if src_arg is not None and hasattr(src_arg, "meta"):
        reason = _dtype_reason(node_value(src_arg), "the source", ew.DTYPES)
    elif src_arg is not None and not isinstance(src_arg, (int, float, bool)):
        reason = f"the source {src_arg!r} is neither a tensor nor a number"
    return reason or index_reason(index_args, out)


def supported_index_put(node) -> str | None:
    entries = list(node.args[1])
    tensors = [e for e in entries if e is not None]
    if not tensors:
        return "index_put without any index tensor"
    for e in tensors:
        val = node_value(e)
        if isinstance(val, torch.Tensor) and val.dtype in (torch.bool, torch.uint8):
            return ("boolean mask indices select a data-dependent set of positions; only integer index "
                    "tensors are supported (use torch.where(mask, values, x) instead)")
    if len(tensors) > MAX_INDICES:
        return f"{len(tensors)} index tensors (at most {MAX_INDICES})"
    accumulate = bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))
    reason = _common_reason(node, node.args[2], tensors, accumulate)
    if reason:
        return reason
    self_val, values = node_value(node.args[0]), node_value(node.args[2])
    # sizes as ints or sympy expressions: comparing SymInts here would add guards to the program
    shapes = [size_fns.shape(node_value(e).shape) for e in tensors]
    try:
        bshape = broadcast_shape(shapes)
    except (RuntimeError, ValueError, size_fns.SymbolicShapeError):
        return f"index tensors of shapes {[tuple(s) for s in shapes]} do not broadcast together"
    rank = self_val.ndim - len(tensors) + len(bshape)
    indexed = [d for d, t in enumerate(node.args[1]) if t is not None]
    kept = [n for d, n in enumerate(size_fns.shape(self_val.shape)) if d not in indexed]
    walked = walked_dims(index_walks(self_val, [node_value(e) for e in tensors], indexed, values), (*kept, *bshape))
    if walked > MAX_RANK:
        return f"the indexing result has {walked} dims of size other than 1 that do not merge (at most {MAX_RANK})"
    leading = size_fns.shape(values.shape[: max(values.ndim - rank, 0)])
    if any(s != 1 for s in leading):
        return f"values of shape {tuple(values.shape)} do not broadcast to the {rank}-dim indexing result"
    return None


def supported_index_copy(node) -> str | None:
    self_val, idx, src = node_value(node.args[0]), node_value(node.args[2]), node_value(node.args[3])
    reason = _common_reason(node, node.args[3], [node.args[2]], False)
    if reason:
        return reason
    if idx.ndim > 1:
        return f"index_copy index has {idx.ndim} dims, expected at most 1"
    if src.ndim != self_val.ndim:
        return f"index_copy source has {src.ndim} dims, self {self_val.ndim}"
    return None


def _supported_scatter(node, accumulate: bool) -> str | None:
    reason = _common_reason(node, node.args[3], [node.args[2]], accumulate)
    if reason:
        return reason
    self_val, idx, src = node_value(node.args[0]), node_value(node.args[2]), node_value(node.args[3])
    if idx.ndim != self_val.ndim:
        return f"scatter index has {idx.ndim} dims, self {self_val.ndim}"
    if isinstance(src, torch.Tensor) and src.ndim != idx.ndim:
        return f"scatter source has {src.ndim} dims, index {idx.ndim}"
    return None


def supported_scatter(node) -> str | None:  # scatter.src and scatter.value
    return _supported_scatter(node, accumulate=False)


def supported_scatter_add(node) -> str | None:
    return _supported_scatter(node, accumulate=True)


def supported_copy_into(node) -> str | None:
    """slice_scatter, select_scatter, copy: pointwise copies (elementwise dtypes and rank). Their
    dim, start, end and index may be size nodes (a dynamic slice)."""
    for what, val in (("the result", node.meta.get("val")), ("self", node_value(node.args[0])),
                      ("the source", node_value(node.args[1]))):
        reason = _dtype_reason(val, what, ew.DTYPES)
        if reason:
            return reason
    if node.meta["val"].ndim > MAX_RANK:
        return f"result has {node.meta['val'].ndim} dims (at most {MAX_RANK})"
    return None


def refuse_reduce(node) -> str:
    """scatter(..., reduce=) and scatter_reduce: refused."""
    how = node.kwargs.get("reduce", node.args[4] if len(node.args) > 4 else "?")
    return (f"scatter with reduce={how!r} is not supported; scatter_add (index_add, index_put with "
            f"accumulate=True) covers sums")
