"""Copies into adjacent slices of one buffer run as one launch: the last pass of ``fusion.fuse`` over a
delegate's launch records, once fusion has moved into their producers the copies that a pointwise
chain computes straight into their slice.

``cat([a, b, c], d)`` lowers to one copy launch per part (``layout.cat``), and so does a chain of
updates that fills a fresh tensor slice by slice: DeepSeek's attention key is its per-head part
``slice_scatter``-ed into an empty tensor, then its rotary part, broadcast over the heads, into the
rest (in place: ``scatter._destination``). Consecutive copy launches become one ``cat`` launch
(``layout.cat_kernel``: up to ``MAX_PARTS`` parts, each element read from its own part only) when:

  - each is a plain copy: a ``pointwise`` ``copy`` of one tensor (a fused launch is left alone), of a
    source of its destination's dtype, or floating into floating (the cast eager's copy makes);
  - their destinations are slices of one buffer along one dim that, in some order, each start where
    another ends: the same dtype, rank and strides, the same sizes but along that dim, whose stride
    is static and positive;
  - no source lives in that buffer (one part would read what another writes).

The merged launch takes the last copy's place; no launch lies between the copies it replaces.
"""

from __future__ import annotations

import sympy

from . import elementwise as ew
from . import layout
from . import sizes as size_fns
from .refs import LaunchRecord, TRef, new_launch


def merge_copies(records: list[LaunchRecord], view) -> tuple[list[LaunchRecord], bool]:
    """``records`` with each run of consecutive copies into adjacent slices of one buffer as ``cat``
    launches (``view``: the builder's, to address the slices' union), and whether any was merged."""
    result, run, changed = [], [], False
    for record in [*records, None]:
        copy = _plain_copy(record)
        if copy is not None and run and _same_layout(run[0].op.out, copy.out):
            run.append(record)
            continue
        merged = _cat_records(run, view)
        result.extend(run if merged is None else merged)
        changed |= merged is not None
        run = [record] if copy is not None else []
        if copy is None and record is not None:
            result.append(record)
    return result, changed


def _plain_copy(record: LaunchRecord | None) -> ew.PointwiseOp | None:
    op = None if record is None else record.op
    if (record is None or record.launch.kernel != "pointwise" or not isinstance(op, ew.PointwiseOp)
            or op.op != "copy" or len(op.operands) != 1 or not isinstance(op.operands[0], TRef)):
        return None
    src, out = op.operands[0], op.out
    if src.buffer == out.buffer:
        return None
    if src.dtype != out.dtype and not (src.dtype.is_floating_point and out.dtype.is_floating_point):
        return None
    return op


def _same_layout(a: TRef, b: TRef) -> bool:
    return a.buffer == b.buffer and a.dtype == b.dtype and a.ndim == b.ndim and a.strides == b.strides


def _equal(a, b) -> bool:
    return sympy.expand(size_fns.size(a) - size_fns.size(b)) == 0


def _adjacent_along(outs: list[TRef], dim: int) -> list[int] | None:
    """The order (indices into ``outs``) in which the slices follow each other along ``dim``, or None
    when they do not tile a contiguous range of it."""
    stride = outs[0].strides[dim]
    if not size_fns.is_static(stride) or stride <= 0:
        return None
    for o in outs[1:]:
        if any(not _equal(n, m) for d, (n, m) in enumerate(zip(o.shape, outs[0].shape)) if d != dim):
            return None
    order = [0]
    left = set(range(1, len(outs)))
    while left:  # the slice that starts where the last one ends
        end = outs[order[-1]].offset + outs[order[-1]].shape[dim] * stride
        after = next((k for k in left if _equal(outs[k].offset, end)), None)
        if after is None:
            break
        order.append(after)
        left.discard(after)
    while left:  # and the one that ends where the first one starts
        start = outs[order[0]].offset
        before = next((k for k in left if _equal(outs[k].offset + outs[k].shape[dim] * stride, start)), None)
        if before is None:
            return None
        order.insert(0, before)
        left.discard(before)
    return order


def _cat_records(run: list[LaunchRecord], view) -> list[LaunchRecord] | None:
    """``run`` (consecutive copies into one buffer) as cat launches of at most MAX_PARTS parts each
    (a part left alone stays a copy), or None when they do not merge."""
    if len(run) < 2 or view is None:
        return None
    outs = [r.op.out for r in run]
    for dim in range(outs[0].ndim):
        order = _adjacent_along(outs, dim)
        if order is None:
            continue
        chunks = [order[k:k + layout.MAX_PARTS] for k in range(0, len(order), layout.MAX_PARTS)]
        merged = [_cat_record([run[i] for i in chunk], dim, view) if len(chunk) > 1 else run[chunk[0]]
                  for chunk in chunks]
        return None if any(m is None for m in merged) else merged
    return None


def _cat_record(parts: list[LaunchRecord], dim: int, view) -> LaunchRecord | None:
    first = parts[0].op.out
    shape = list(first.shape)
    shape[dim] = sum((p.op.out.shape[dim] for p in parts[1:]), first.shape[dim])
    out = view(first, shape, first.strides, first.offset)
    found = layout.cat_launch(out, [(p.op.operands[0], p.op.out.shape[dim]) for p in parts], dim)
    if found is None:
        return None
    grid, args, constexprs = found
    return LaunchRecord(new_launch("cat", grid, args, constexprs, "+".join(dict.fromkeys(p.launch.op for p in parts))))
