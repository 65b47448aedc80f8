"""What kernel lowerings share with the launch builder: :class:`TRef` (a strided view of a buffer),
the lowering error, and plan launches built from lowering-time values. The builder (``builder.py``)
and fusion (``fusion.py``) import the kernel families, which import only this, so nothing circles."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..plan import Arg, ArgKind, Launch
from . import sizes
from .sizes import to_plan


class LoweringError(RuntimeError):
    """A node passed its support check but could not be lowered (names the node)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def new_launch(kernel: str, grid, args, constexprs: dict, op: str) -> Launch:
    """A plan launch from lowering-time values: TRefs become tensor arguments, sizes that depend on
    the symbols become ``symbolic.Expr``s."""
    return Launch(kernel=kernel, grid=to_plan(sizes.shape(grid)), args=[plan_arg(a) for a in args],
                  constexprs={k: Arg.of(v) for k, v in constexprs.items()}, op=op)


def plan_arg(value) -> Arg:
    """A launch argument as the plan stores it."""
    if isinstance(value, TRef):
        return Arg(ArgKind.TENSOR, value.index)
    if not sizes.is_static(value):
        return Arg(ArgKind.INT, to_plan(value))
    return Arg.of(value)
