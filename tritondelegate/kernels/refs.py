"""The leaf of the kernel package: what kernel lowerings, the launch builder and passes over launches
share. :class:`TRef` (a strided view of a buffer), strides and their broadcasting and collapsing,
dtype names, the lowering error, and launch records (a plan launch built from lowering-time values,
with what it computes). Imports go one way: this <- the kernel families <- fusion <- the builder's
user (``backend.py``); nothing circles."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from ..plan import Arg, KernelArgKind, Launch
from . import sizes
from .sizes import to_plan


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_RANK = 5  # dims a strided kernel walks (pointwise, index, scatter, pad); collapse() merges the rest


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size if not sizes.is_static(size) else max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TRef:
    """A tensor as kernels see it: a strided view of a buffer."""

    index: int  # TensorDesc index in the plan
    buffer: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int  # element offset into the buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        expected = contiguous_strides(self.shape)
        return all(s == e for s, e, n in zip(self.strides, expected, self.shape) if n != 1)


def same_view(a: TRef, c: TRef) -> bool:
    """Whether ``a`` and ``c`` are the same elements of the same buffer, in the same order."""
    return (
        a.buffer == c.buffer and a.offset == c.offset and a.dtype == c.dtype and a.shape == c.shape
        and all(s == t for s, t, n in zip(a.strides, c.strides, a.shape) if n != 1)
    )


@dataclass
class LaunchRecord:
    """A recorded launch and what it computes, for passes over a delegate's launches (``fusion.py``):
    an ``elementwise.PointwiseOp``, ``matmul.MatmulOp``, ``conv.ConvOp``, ``norm.RowNorm``,
    ``scatter.ScatterOp``, ``index.GatherOp`` or ``pad.ZeroPad``; None when no pass may rewrite it. The plan
    keeps only the launch."""

    launch: Launch
    op: object = None


def new_launch(kernel: str, grid, args, constexprs: dict, op: str) -> Launch:
    """A plan launch from lowering-time values: TRefs become tensor arguments, sizes that depend on
    the symbols become ``symbolic.Expr``s."""
    return Launch(kernel=kernel, grid=to_plan(sizes.shape(grid)), args=[plan_arg(a) for a in args],
                  constexprs={k: Arg.of(v) for k, v in constexprs.items()}, op=op)


def plan_arg(value) -> Arg:
    """A launch argument as the plan stores it."""
    if isinstance(value, TRef):
        return Arg(KernelArgKind.TENSOR, value.index)
    if not sizes.is_static(value):
        return Arg(KernelArgKind.INT, to_plan(value))
    return Arg.of(value)


def broadcast_strides(ref: TRef, shape) -> tuple[int, ...]:
    """``ref``'s strides seen through broadcasting to ``shape`` (0 on broadcast dims)."""
    pad = len(shape) - ref.ndim
    strides = []
    for d, size in enumerate(shape):
        if d < pad:
            strides.append(0)
        else:
            own = ref.shape[d - pad]
            strides.append(0 if own == 1 and size != 1 else ref.strides[d - pad])
    return tuple(strides)


def collapse_padded(shape, stride_sets, rank: int):
    """:func:`collapse`, then left-padded to ``rank`` dims (size 1, stride 0) for a kernel that walks
    exactly ``rank`` dims: (sizes, strides per set), or None when more than ``rank`` dims remain."""
    sizes, strides = collapse(shape, stride_sets)
    if len(sizes) > rank:
        return None
    pad = rank - len(sizes)
    return [1] * pad + sizes, [[0] * pad + s for s in strides]


def collapse(shape, stride_sets):
    """Merge adjacent dims that every operand walks contiguously; drop size-1 dims."""
    dims = [(size, [s[d] for s in stride_sets]) for d, size in enumerate(shape) if size != 1]
    merged: list[tuple[int, list[int]]] = []
    for size, strides in dims:
        if merged:
            psize, pstrides = merged[-1]
            if all(ps == s * size for ps, s in zip(pstrides, strides)):
                merged[-1] = (psize * size, strides)
                continue
        merged.append((size, strides))
    return [m[0] for m in merged], [[m[1][k] for m in merged] for k in range(len(stride_sets))]


def node_value(arg):
    """What an fx node argument holds at lowering time (its ``meta["val"]``: a FakeTensor, a SymInt, a
    tuple of them), or None when ``arg`` is not a node (a literal such as a Python scalar or None)."""
    return arg.meta.get("val") if hasattr(arg, "meta") else None


def stats_read(node) -> bool:
    """Whether a norm node's statistics (results 1 and 2: mean and rstd) are read: by a ``getitem`` of
    them, or by a reader that takes the whole tuple."""
    read = {u.args[1] for u in node.users if u.target is operator.getitem}
    return bool(read & {1, 2}) or any(u.target is not operator.getitem for u in node.users)
