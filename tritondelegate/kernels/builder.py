"""LaunchBuilder: what a kernel's lowering function writes its launches into.

A lowering function ``lower(b, node)`` reads its operands with ``b.ref(arg)`` (a :class:`TRef`: a
strided view with shape, strides and dtype), asks for an output with ``b.out(node)``, and records
launches with ``b.launch(kernel_name, grid, *args, **constexprs)``. View ops record an alias with
``b.alias(node, b.view(...))`` and launch nothing. A lowering that updates an operand in place (a node
marked ``td_inplace``) writes into ``b.ref(self)``, says so with ``b.writes_in_place(ref)`` and binds
the node to that ref.

The builder only records: each launch is a :class:`~.refs.LaunchRecord` that carries what it
computes (``record.op``, set by the lowering that launched it), and :meth:`LaunchBuilder.effects` says
which buffers each launch touches and may write. Passes over the records (``fusion.py``: pointwise
chains, matmul prologues and epilogues) run between the lowering and :meth:`LaunchBuilder.finish`,
which makes the buffers that hold a delegate output that output's slot and packs the rest into the
delegate's scratch block with the same greedy planner the method uses, from lifetimes read off the
final launch list. With ``finish(aliases={})``, an output that is a whole delegate input written in
place gets no buffer of its own: it is recorded as an alias of that input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from ..memory.planner import Interval, greedy_by_size
from ..plan import Arg, Base, DelegatePlan, KernelArgKind, Launch, TensorDesc
from ..program import DEVICE_ALIGNMENT
from . import elementwise, sizes
from ..dtypes import dtype_name
from ..errors import LoweringError
from .refs import LaunchRecord, TRef, contiguous_strides, new_launch
from .sizes import to_plan, upper



@dataclass
class _Buffer:
    base: Base
    index: int
    size: object  # the exact byte count: an int, or a sympy expression over the symbols
    owner: str = ""  # the node whose lowering allocated it: only that node's launches write it
    first: int = -1
    last: int = -1

    @property
    def nbytes(self) -> int:
        """The bytes at the symbols' upper bounds: what the plan reserves."""
        return upper(self.size)


class LaunchBuilder:
    def __init__(self, inputs: list[torch.fx.Node], outputs: list[torch.fx.Node]):
        self._buffers: list[_Buffer] = []
        self._refs: list[TRef] = []
        self.records: list[LaunchRecord] = []  # every launch so far, in order, with what it computes
        self._values: dict[torch.fx.Node, object] = {}
        self._outputs = outputs
        # node name -> buffers its launches write although it did not allocate them (writes_in_place)
        self._in_place: dict[str, set[int]] = {}
        self.current: torch.fx.Node | None = None
        self._inputs: list[TRef] = []
        position = 0
        for node in inputs:
            val = node.meta["val"]
            if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
                self._values[node] = sizes.size(val)  # a size the delegate computes with, not a tensor
                continue
            shape = sizes.shape(val.shape)
            buf = self._new_buffer(Base.INPUT, position, math.prod(shape) * val.element_size())
            self._values[node] = self._desc(buf, val.dtype, shape, contiguous_strides(shape), 0)
            self._inputs.append(self._values[node])
            position += 1

    # -- values -------------------------------------------------------------------------------
    def ref(self, arg) -> TRef:
        """The tensor an fx argument refers to."""
        value = self._values.get(arg) if isinstance(arg, torch.fx.Node) else None
        if not isinstance(value, TRef):
            raise LoweringError(f"{self._where()}: argument {arg!r} is not a tensor lowered in this delegate")
        return value

    def values(self, arg):
        """A node's lowered value: a TRef, or a tuple of them for multi-output nodes."""
        return self._values[arg]

    def size(self, arg):
        """An integer argument of a node (a literal, or a SymInt-valued node such as ``sym_size``) as a
        size: an int, or a sympy expression over the method's symbols."""
        if isinstance(arg, torch.fx.Node):
            if arg in self._values and not isinstance(self._values[arg], (TRef, tuple)):
                return self._values[arg]
            return sizes.size(arg.meta["val"])
        return sizes.size(arg)

    def sizes(self, args) -> tuple:
        """A list argument of sizes (see :meth:`size`)."""
        return tuple(self.size(a) for a in args)

    def bind(self, node: torch.fx.Node, value) -> None:
        """Record ``value`` (a TRef or a tuple of TRefs) as ``node``'s result."""
        self._values[node] = value

    def alias(self, node: torch.fx.Node, ref: TRef) -> None:
        self.bind(node, ref)

    def is_scratch(self, ref: TRef) -> bool:
        """Whether ``ref`` views a temporary of this delegate (not an input: only inputs are ever
        written in place, by :meth:`writes_in_place`)."""
        return self._buffers[ref.buffer].base == Base.SCRATCH

    def writes_in_place(self, ref: TRef) -> None:
        """Declare that the current node's launches write ``ref``'s buffer, which the node did not
        allocate (an in-place update of a delegate input or of another node's result).

        Fusion then never moves a read of that buffer across those launches, and ``finish`` may
        alias a delegate output to the input the node updated."""
        if self.current is None:
            raise LoweringError("writes_in_place called outside a node's lowering")
        self._in_place.setdefault(self.current.name, set()).add(ref.buffer)

    # -- tensors ------------------------------------------------------------------------------
    def alloc(self, shape, dtype: torch.dtype) -> TRef:
        """A fresh contiguous temporary."""
        shape = sizes.shape(shape)
        buf = self._new_buffer(Base.SCRATCH, 0, math.prod(shape) * dtype.itemsize)
        return self._desc(buf, dtype, shape, contiguous_strides(shape), 0)

    def out(self, node: torch.fx.Node, index: int | None = None) -> TRef:
        """A fresh contiguous tensor for ``node``'s result (element ``index`` of a tuple result),
        bound to the node."""
        val = node.meta["val"] if index is None else node.meta["val"][index]
        ref = self.alloc(val.shape, val.dtype)
        if index is None:
            self.bind(node, ref)
        else:
            current = list(self._values.get(node, ())) or [None] * len(node.meta["val"])
            current[index] = ref
            self.bind(node, tuple(current))
        return ref

    def view(self, ref: TRef, shape, strides, offset: int | None = None, dtype=None) -> TRef:
        """An alias of ``ref``'s buffer with other shape/strides (``offset`` in elements, absolute)."""
        return self._desc(
            ref.buffer,
            ref.dtype if dtype is None else dtype,
            sizes.shape(shape),
            sizes.shape(strides),
            ref.offset if offset is None else sizes.size(offset),
        )

    def contiguous(self, ref: TRef) -> TRef:
        """``ref`` itself when contiguous, else a contiguous copy."""
        if ref.is_contiguous():
            return ref
        out = self.alloc(ref.shape, ref.dtype)
        elementwise.launch_pointwise(self, "copy", out, [ref])
        return out

    # -- launches -----------------------------------------------------------------------------
    def launch(self, kernel: str, grid, *args, **constexprs) -> LaunchRecord | None:
        """Record a launch; returns its record (the lowering may set ``record.op`` to what it
        computes, for fusion), or None when the grid is empty (nothing to do)."""
        grid = sizes.shape(grid)
        if any(sizes.is_static(g) and g <= 0 for g in grid):
            return None  # nothing to do: an empty tensor (a symbolic grid is checked per call)
        op = self.current.name if self.current is not None else ""
        self.records.append(LaunchRecord(new_launch(kernel, grid, args, constexprs, op)))
        return self.records[-1]

    def effects(self) -> tuple[list[set[int]], list[set[int]], set[int]]:
        """``(touched, writes, keep)`` for passes over :attr:`records`: the buffers each launch
        passes, those it may write (a pointwise launch its output; any other kernel the buffers its
        own node allocated and those the node declared with :meth:`writes_in_place`), and the
        buffers no pass may remove (delegate inputs and outputs, and what a delegate output views)."""
        touched = [self._touched(r.launch) for r in self.records]
        writes = [
            {r.op.out.buffer} if r.launch.kernel == "pointwise" and r.op is not None
            else {buf for buf in bufs if self._buffers[buf].owner == r.launch.op and r.launch.op}
            | (self._in_place.get(r.launch.op, set()) & bufs)
            for r, bufs in zip(self.records, touched)
        ]
        keep = {self.ref(node).buffer for node in self._outputs}
        keep |= {i for i, buf in enumerate(self._buffers) if buf.base != Base.SCRATCH}
        return touched, writes, keep

    # -- finishing ----------------------------------------------------------------------------
    def finish(self, aliases: dict[int, int] | None = None) -> DelegatePlan:
        """The delegate's launch plan.

        ``aliases``: when a dict, each delegate output that is exactly a delegate input this delegate
        wrote in place (offset 0, contiguous, same numel and dtype) gets no output buffer and no copy:
        ``aliases[output_position] = input_position`` is recorded instead, and the remaining outputs
        are numbered consecutively in the plan. When None, every output gets its own buffer."""
        self._place_outputs(aliases)
        self._lifetimes()
        scratch = [b for b in self._buffers if b.base == Base.SCRATCH and b.first >= 0]
        offsets, scratch_bytes = greedy_by_size(
            [Interval(b.nbytes, b.first, b.last) for b in scratch], DEVICE_ALIGNMENT
        )
        scratch_offset = {id(b): o for b, o in zip(scratch, offsets)}
        # Only the views some launch reads or writes go into the plan (fusion and aliasing leave others).
        launches = [r.launch for r in self.records]
        used = sorted({a.value for launch in launches for a in launch.args if a.kind == KernelArgKind.TENSOR})
        renumber = {old: new for new, old in enumerate(used)}
        for launch in launches:
            launch.args = [Arg(KernelArgKind.TENSOR, renumber[a.value]) if a.kind == KernelArgKind.TENSOR else a
                           for a in launch.args]
        descs = []
        for ref in (self._refs[i] for i in used):
            buf = self._buffers[ref.buffer]
            descs.append(
                TensorDesc(
                    base=buf.base,
                    index=buf.index,
                    byte_offset=to_plan(scratch_offset.get(id(buf), 0) + ref.offset * ref.dtype.itemsize),
                    dtype=dtype_name(ref.dtype),
                    shape=to_plan(ref.shape),
                    strides=to_plan(ref.strides),
                )
            )
        return DelegatePlan(
            tensors=descs,
            launches=launches,
            scratch_bytes=scratch_bytes,
            input_nbytes=[b.nbytes for b in self._buffers if b.base == Base.INPUT],
            output_nbytes=[b.nbytes for b in sorted(
                (b for b in self._buffers if b.base == Base.OUTPUT), key=lambda b: b.index)],
        )

    # -- internals ----------------------------------------------------------------------------
    def _place_outputs(self, aliases: dict[int, int] | None) -> None:
        """Give each delegate output its OUTPUT slot: the scratch buffer holding it when it fills
        that buffer alone, else a copy; or, with ``aliases``, the input it updated in place."""
        taken: set[int] = set()
        position = 0  # OUTPUT index: aliased outputs take none
        for i, node in enumerate(self._outputs):
            ref = self.ref(node)
            if aliases is not None:
                source = self._updated_input(ref)
                if source is not None:
                    aliases[i] = source
                    continue
            buf = self._buffers[ref.buffer]
            own = (
                buf.base == Base.SCRATCH
                and ref.buffer not in taken
                and ref.offset == 0
                and ref.is_contiguous()
                and buf.size == ref.numel * ref.dtype.itemsize
            )
            if own:
                buf.base, buf.index = Base.OUTPUT, position
                taken.add(ref.buffer)
            else:
                val = node.meta["val"]
                out_buf = self._new_buffer(Base.OUTPUT, position, ref.numel * val.element_size())
                out = self._desc(out_buf, ref.dtype, ref.shape, contiguous_strides(ref.shape), 0)
                elementwise.launch_pointwise(self, "copy", out, [ref])
            position += 1

    def _updated_input(self, ref: TRef) -> int | None:
        """The input position ``ref`` covers whole, when some node wrote that input in place."""
        buf = self._buffers[ref.buffer]
        if buf.base != Base.INPUT or not any(ref.buffer in bufs for bufs in self._in_place.values()):
            return None
        whole = self._inputs[buf.index]
        if ref.offset == 0 and ref.is_contiguous() and ref.numel == whole.numel and ref.dtype == whole.dtype:
            return buf.index
        return None

    def _where(self) -> str:
        return f"node {self.current.name!r}" if self.current is not None else "delegate"

    def _new_buffer(self, base: Base, index: int, nbytes) -> int:
        owner = self.current.name if self.current is not None else ""
        self._buffers.append(_Buffer(base, index, nbytes, owner if base != Base.INPUT else ""))
        return len(self._buffers) - 1

    def _desc(self, buffer: int, dtype, shape, strides, offset) -> TRef:
        ref = TRef(len(self._refs), buffer, dtype, shape, strides, offset)
        self._refs.append(ref)
        return ref

    def _touched(self, launch: Launch) -> set[int]:
        return {self._refs[a.value].buffer for a in launch.args if a.kind == KernelArgKind.TENSOR}

    def _lifetimes(self) -> None:
        """First and last launch touching each buffer, from the final launch list."""
        for buf in self._buffers:
            buf.first = buf.last = -1
        for position, record in enumerate(self.records):
            for index in self._touched(record.launch):
                buf = self._buffers[index]
                buf.first = position if buf.first < 0 else buf.first
                buf.last = position
