"""The launch plan of a delegate: pure data, written by the backend and read by the runtime.

A delegate is a subgraph of ATen nodes turned into a list of Triton launches. Every tensor a launch
touches is a :class:`TensorDesc`: a strided view of one of the delegate's inputs, outputs, or its scratch
block (temporaries that live only for the delegate's call). The runtime builds each view once and
launches ``KERNELS[launch.kernel][grid](*args, **constexprs)``.

In a method with bounded dynamic dimensions, any integer below that depends on them (a view's shape,
strides and offset, a grid, an INT argument) is a ``symbolic.Expr``; the runtime evaluates them once
per distinct size. Byte counts (scratch, input and output sizes) are at the symbols' upper bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from .symbolic import Expr


class Base(IntEnum):
    INPUT = 0
    OUTPUT = 1
    SCRATCH = 2


@dataclass
class TensorDesc:
    base: Base
    index: int  # input/output position; 0 for scratch
    byte_offset: object  # int or Expr: from the start of the base storage
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: tuple  # ints or Exprs
    strides: tuple  # ints or Exprs, in elements


class KernelArgKind(IntEnum):
    """What a kernel launch's argument (:class:`Arg`) holds (``program.HostArgKind`` is a host op's)."""

    TENSOR = 0
    INT = 1
    FLOAT = 2
    BOOL = 3
    STR = 4


@dataclass
class Arg:
    kind: KernelArgKind
    value: object  # tensor index for TENSOR, else the scalar

    @staticmethod
    def of(value) -> "Arg":
        if isinstance(value, bool):
            return Arg(KernelArgKind.BOOL, value)
        if isinstance(value, (int, Expr)):
            return Arg(KernelArgKind.INT, value)
        if isinstance(value, float):
            return Arg(KernelArgKind.FLOAT, value)
        if isinstance(value, str):
            return Arg(KernelArgKind.STR, value)
        raise TypeError(f"cannot pass {type(value).__name__} {value!r} to a kernel")


@dataclass
class Launch:
    kernel: str
    grid: tuple  # ints or Exprs
    args: list[Arg]
    constexprs: dict[str, Arg] = field(default_factory=dict)
    op: str = ""  # the ATen node this launch came from, for stats and errors
    # The traffic model (kernels/traffic.py, filled in by ``traffic.annotate``): the bytes this launch
    # must read and write, each tensor view counted by the distinct bytes it spans, and its FLOPs.
    bytes_read: int = 0
    bytes_written: int = 0
    flops: int = 0


@dataclass
class DelegatePlan:
    tensors: list[TensorDesc]
    launches: list[Launch]
    scratch_bytes: int
    input_nbytes: list[int]
    output_nbytes: list[int]
