"""Consistency checks of a decoded program: every index in range, every size and offset sane, every
dtype name known, every symbolic size an expression over its method's symbols whose recorded bound is
its value at their maxima (sizes are checked at those bounds, which memory is planned for). The reader
runs them on each file it loads, so the runtime can trust the program."""

from __future__ import annotations

import json
import keyword
import os
import re

import torch

from .. import constant_methods
from ..dtypes import DTYPES
from ..plan import Base, DelegatePlan, KernelArgKind
from ..program import Constant, HostArgKind, InstrKind, Instruction, Method, Program, Role, SegmentKind
from ..errors import ProgramError
from ..symbolic import Expr, bound
from .consistency import MethodConsistency, aligned_end, check_alignment, check_device

def external_name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as the name of an external data file, or None. A name is a path
    relative to the program file's directory and inside it: plain names joined by "/", none of them
    empty, "." or "..", with no backslash or NUL (the writer and the reader share this rule)."""
    if (not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name or "\0" in name
            or any(part in ("", ".", "..") for part in name.split("/"))):
        return ("must be a relative path inside the program file's directory: plain names joined by '/', "
                "none of them empty, '.' or '..'")
    return None


def check_program(program: Program, path: str, version: int, data_off: int, data_size: int) -> None:
    """Raises :class:`ProgramError` naming ``path`` and the first inconsistency found.

    ``version`` is the header's; in-file constants must lie in the data segment ``[0, data_size)``,
    which starts at file offset ``data_off``.
    """
    _Checker(program, path, version, data_off, data_size).check()


class _Checker:
    def __init__(self, program: Program, path: str, version: int, data_off: int, data_size: int):
        self.p, self.path, self.version = program, path, version
        self.data_off, self.data_size = data_off, data_size

    def fail(self, what: str):
        raise ProgramError(f"{self.path}: {what}")

    def index(self, i: int, n: int, what: str, of: str, optional: bool = False) -> None:
        if not (-1 if optional else 0) <= i < n:
            self.fail(f"{what} refers to {of} {i}, but there are {n}" + (" (-1: none)" if optional else ""))

    def nonneg(self, x: int, what: str) -> None:
        if x < 0:
            self.fail(f"{what} is negative ({x})")

    def dtype(self, name: str, what: str) -> torch.dtype:
        dtype = DTYPES.get(name)
        if dtype is None:
            self.fail(f"{what} has unknown dtype {name!r}")
        return dtype

    def shape(self, shape: tuple, what: str) -> int:
        """The number of elements of ``shape`` (at the symbols' bounds), after checking its dims."""
        numel = 1
        for d in bound(tuple(shape)):
            if d < 0:
                self.fail(f"{what} has a negative dimension in shape {list(shape)}")
            numel *= d
        return numel

    def check(self) -> None:
        p = self.p
        if p.version != self.version:
            self.fail(f"the program records version {p.version}, the header {self.version}")
        for i, name in enumerate(p.external_files):
            problem = external_name_problem(name)
            if problem:
                self.fail(f"external file {i} ({name!r}) {problem}")
        keys = set()
        for i, c in enumerate(p.constants):
            self.constant(c, i, keys)
        self.slots()
        self.binaries()
        names = set()
        for m in p.methods:
            if m.name in names:
                self.fail(f"two methods are named {m.name!r}")
            names.add(m.name)
            self.method(m)
        self.constant_methods(names)

    def constant(self, c: Constant, i: int, keys: set) -> None:
        what = f"constant {i} ({c.name!r})"
        dtype = self.dtype(c.dtype, what)
        numel = self.shape(c.shape, what)
        if c.nbytes != numel * dtype.itemsize:
            self.fail(f"{what} records {c.nbytes} bytes, but {c.dtype}{list(c.shape)} has "
                      f"{numel * dtype.itemsize}")
        self.index(c.external, len(self.p.external_files), what, "external file", optional=True)
        if c.external >= 0:
            if (c.external, c.name) in keys:
                self.fail(f"{what}: two constants have key {c.name!r} in external file "
                          f"{self.p.external_files[c.external]!r}")
            keys.add((c.external, c.name))
            return
        end = c.data_offset + c.nbytes
        if c.data_offset < 0 or end > self.data_size:
            self.fail(f"{what}: bytes [{c.data_offset}, {end}) lie outside the data segment "
                      f"(size {self.data_size}, at file offset {self.data_off})")
        if c.nbytes and (self.data_off + c.data_offset) % dtype.itemsize:
            self.fail(f"{what}: data offset {c.data_offset} is not aligned for {c.dtype}")

    def slots(self) -> None:
        """Segments and the slots in them: in range, aligned, of the right kind, never overlapping
        (every slot lives as long as the loaded program)."""
        p = self.p
        for i, seg in enumerate(p.segments):
            self.nonneg(seg.nbytes, f"segment {i} nbytes")
            check_device(seg.device, f"segment {i}", self.fail)
            check_alignment(seg.alignment, f"segment {i}", self.fail)
        spans: dict[int, list[tuple[int, int, int]]] = {}
        for i, slot in enumerate(p.slots):
            what = f"slot {i} ({slot.name!r})"
            check_device(slot.device, what, self.fail)
            self.index(slot.constant, len(p.constants), what, "constant")
            if p.constants[slot.constant].name != slot.name:
                self.fail(f"{what} holds constant {slot.constant}, which is named {p.constants[slot.constant].name!r}")
            self.index(slot.segment, len(p.segments), what, "segment", optional=True)
            if slot.segment < 0:
                if not slot.state or slot.device != "cpu":
                    self.fail(f"{what} on {slot.device} lies in no segment; only host state may")
                continue
            seg = p.segments[slot.segment]
            kind = SegmentKind.STATE if slot.state else SegmentKind.CONSTANTS
            if seg.kind != kind or seg.device != slot.device:
                self.fail(f"{what} ({kind.name.lower()} on {slot.device}) lies in segment {slot.segment} "
                          f"({seg.kind.name.lower()} on {seg.device})")
            end = slot.offset + p.constants[slot.constant].nbytes
            if slot.offset < 0 or end > seg.nbytes or slot.offset % seg.alignment:
                self.fail(f"{what}: bytes [{slot.offset}, {end}) do not fit segment {slot.segment} "
                          f"({seg.nbytes} bytes, alignment {seg.alignment})")
            spans.setdefault(slot.segment, []).append((slot.offset, end, i))
        for i, seg in enumerate(p.segments):  # no larger than its slots need: a file cannot over-allocate
            need = aligned_end([max(end, start + 1) for start, end, _ in spans.get(i, ())], seg.alignment)
            if seg.nbytes > need:
                self.fail(f"segment {i} has {seg.nbytes} bytes; its slots need {need}")
        for segment, items in spans.items():
            items.sort()
            for (_, a_end, a), (b_start, _, b) in zip(items, items[1:]):
                if b_start < a_end:
                    self.fail(f"slots {a} and {b} overlap in segment {segment}")

    def constant_methods(self, method_names: set) -> None:
        try:
            values = constant_methods.decode(self.p.constant_methods)
        except ValueError as exc:
            self.fail(str(exc))
        clash = sorted(method_names & set(values))
        if clash:
            self.fail(f"constant method {clash[0]!r} has the name of one of the program's methods")

    def binaries(self) -> None:
        for i, b in enumerate(self.p.binaries):
            what = f"kernel binary {i} ({b.kernel!r}, {b.arch})"
            end = b.data_offset + b.nbytes
            if b.data_offset < 0 or b.nbytes <= 0 or end > self.data_size:
                self.fail(f"{what}: bytes [{b.data_offset}, {end}) lie outside the data segment "
                          f"(size {self.data_size})")
            if not re.fullmatch(r"sm_\d+", b.arch) or not re.fullmatch(r"[0-9a-f]{64}", b.cache_key):
                self.fail(f"{what}: malformed arch {b.arch!r} or cache key {b.cache_key!r}")
            try:
                metadata = json.loads(b.metadata)
            except ValueError:
                metadata = None
            if not isinstance(metadata, dict) or metadata.get("name") != b.name:
                self.fail(f"{what}: its metadata is not Triton's metadata for kernel {b.name!r}")

    def value_slot(self, v, what: str) -> None:
        self.index(v.slot, len(self.p.slots), what, "slot", optional=True)
        if v.slot < 0:
            if v.role == Role.MUTABLE_BUFFER or v.resident:
                self.fail(f"{what} is {'state' if v.role == Role.MUTABLE_BUFFER else 'resident'} but has no slot")
            return
        slot = self.p.slots[v.slot]
        c = self.p.constants[slot.constant]
        if (c.dtype, tuple(c.shape), slot.device) != (v.dtype, tuple(v.shape), v.device):
            self.fail(f"{what} is {v.dtype}{list(v.shape)} on {v.device}, but its slot {v.slot} holds "
                      f"{c.dtype}{list(c.shape)} on {slot.device}")
        if slot.state != (v.role == Role.MUTABLE_BUFFER) or v.arena >= 0:
            self.fail(f"{what} does not fit its slot {v.slot} ({'state' if slot.state else 'constant'})")
        if v.constant != slot.constant:
            self.fail(f"{what} has constant {v.constant}, but its slot {v.slot} holds constant {slot.constant}")

    def method(self, m: Method) -> None:
        where = f"method {m.name!r}"
        nv, nd, na = len(m.values), len(m.delegates), len(m.arenas)
        for a, arena in enumerate(m.arenas):
            for field in ("nbytes", "alignment", "lower_bound"):
                self.nonneg(getattr(arena, field), f"{where} arena {a} {field}")
        for j, v in enumerate(m.values):
            what = f"{where} value {j} ({v.name!r})"
            self.dtype(v.dtype, what)
            self.shape(v.shape, what)
            self.nonneg(v.nbytes, f"{what} nbytes")
            self.index(v.constant, len(self.p.constants), what, "constant", optional=True)
            if v.constant >= 0:
                c = self.p.constants[v.constant]
                if (c.dtype, c.shape) != (v.dtype, v.shape):
                    self.fail(f"{what} is {v.dtype}{list(v.shape)} but its constant {v.constant} "
                              f"({c.name!r}) is {c.dtype}{list(c.shape)}")
                if c.name != v.name:  # names are keys: an index that points elsewhere shows here
                    self.fail(f"{what} refers to constant {v.constant}, which is named {c.name!r}")
            self.value_slot(v, what)
            self.index(v.arena, na, what, "arena", optional=True)
            if v.arena >= 0 and not 0 <= v.arena_offset <= m.arenas[v.arena].nbytes:
                self.fail(f"{what}: offset {v.arena_offset} lies outside arena {v.arena} "
                          f"({m.arenas[v.arena].nbytes} bytes)")
        for j, vid in enumerate(m.inputs):
            self.index(vid, nv, f"{where} input {j}", "value")
        for j, vid in enumerate(m.outputs):
            self.index(vid, nv, f"{where} output {j}", "value")
        self.symbols(m, where)
        self.expressions(m, where)
        for j, (buffer, new) in enumerate(m.mutated_buffers):
            self.index(buffer, nv, f"{where} mutated buffer {j}", "value")
            self.index(new, nv, f"{where} mutated buffer {j}", "value")
        for j, ins in enumerate(m.instructions):
            self.instruction(ins, f"{where} instruction {j} ({ins.name!r})", nv, nd)
        for j, d in enumerate(m.delegates):
            what = f"{where} delegate {j}"
            self.index(d.scratch_arena, na, what, "arena", optional=True)
            self.nonneg(d.scratch_offset, f"{what} scratch_offset")
            self.plan(d.plan, what)
            if d.scratch_arena >= 0 and d.scratch_offset + d.plan.scratch_bytes > m.arenas[d.scratch_arena].nbytes:
                self.fail(f"{what}: scratch [{d.scratch_offset}, {d.scratch_offset + d.plan.scratch_bytes}) "
                          f"lies outside arena {d.scratch_arena} ({m.arenas[d.scratch_arena].nbytes} bytes)")
        MethodConsistency(m, where, self.fail, DTYPES).check()

    def instruction(self, ins: Instruction, what: str, nv: int, nd: int) -> None:
        for k, vid in enumerate(ins.inputs):
            self.index(vid, nv, f"{what} input {k}", "value")
        for k, vid in enumerate(ins.outputs):
            self.index(vid, nv, f"{what} output {k}", "value")
        self.index(ins.delegate, nd, what, "delegate", optional=ins.kind != InstrKind.DELEGATE)
        if ins.kind in (InstrKind.COPY_H2D, InstrKind.COPY_D2H) and (
            len(ins.inputs) != 1 or len(ins.outputs) != 1
        ):
            self.fail(f"{what}: a copy reads {len(ins.inputs)} values and writes {len(ins.outputs)}; "
                      "expected 1 and 1")
        for k, a in enumerate(ins.args):
            w = f"{what} arg {k}"
            if a.kind == HostArgKind.TENSOR:
                self.index(a.value, nv, w, "value")
            elif a.kind == HostArgKind.TENSOR_LIST:
                for e, vid in enumerate(a.value):
                    self.index(vid, nv, f"{w}[{e}]", "value", optional=True)
            elif a.kind == HostArgKind.DTYPE:
                self.dtype(a.value, w)
            elif a.kind == HostArgKind.DEVICE:
                try:
                    torch.device(a.value)
                except (RuntimeError, TypeError):
                    self.fail(f"{w} has unknown device {a.value!r}")
            elif a.kind == HostArgKind.MEMORY_FORMAT and not isinstance(getattr(torch, a.value, None),
                                                                    torch.memory_format):
                self.fail(f"{w} has unknown memory format {a.value!r}")
            elif a.kind == HostArgKind.LAYOUT and not isinstance(getattr(torch, a.value, None), torch.layout):
                self.fail(f"{w} has unknown layout {a.value!r}")

    def plan(self, plan: DelegatePlan, where: str) -> None:
        self.nonneg(plan.scratch_bytes, f"{where} scratch_bytes")
        for k, n in enumerate(plan.input_nbytes):
            self.nonneg(n, f"{where} input_nbytes[{k}]")
        for k, n in enumerate(plan.output_nbytes):
            self.nonneg(n, f"{where} output_nbytes[{k}]")
        bases = {Base.INPUT: len(plan.input_nbytes), Base.OUTPUT: len(plan.output_nbytes), Base.SCRATCH: 1}
        for k, t in enumerate(plan.tensors):
            what = f"{where} tensor {k}"
            self.index(t.index, bases[t.base], what, f"{t.base.name.lower()}")
            self.nonneg(bound(t.byte_offset), f"{what} byte_offset")
            self.dtype(t.dtype, what)
            self.shape(t.shape, what)
            if len(t.strides) != len(t.shape) or any(s < 0 for s in bound(tuple(t.strides))):
                self.fail(f"{what}: strides {list(t.strides)} do not fit shape {list(t.shape)}")
        nt = len(plan.tensors)
        for k, launch in enumerate(plan.launches):
            what = f"{where} launch {k} ({launch.kernel!r})"
            if any(g < 0 for g in bound(tuple(launch.grid))):
                self.fail(f"{what} has a negative grid {list(launch.grid)}")
            for field in ("bytes_read", "bytes_written", "flops"):
                self.nonneg(getattr(launch, field), f"{what} {field}")
            args = [(f"arg {i}", a) for i, a in enumerate(launch.args)]
            args += [(f"constexpr {name!r}", a) for name, a in launch.constexprs.items()]
            for w, a in args:
                if a.kind == KernelArgKind.TENSOR:
                    self.index(a.value, nt, f"{what} {w}", "plan tensor")

    def symbols(self, m: Method, where: str) -> None:
        """Each symbol: a unique name, a range, and an input dimension of exactly that symbol."""
        names = set()
        for k, s in enumerate(m.symbols):
            what = f"{where} symbol {k} ({s.name!r})"
            if not s.name.isidentifier() or keyword.iskeyword(s.name) or s.name in ("max", "min"):
                self.fail(f"{what}: not a valid symbol name (an identifier, not a keyword, max or min)")
            if s.name in names:
                self.fail(f"{what}: two symbols have this name")
            names.add(s.name)
            if not 0 <= s.min <= s.max:
                self.fail(f"{what}: its range {s.min}..{s.max} is not 0 <= min <= max")
            self.index(s.input, len(m.inputs), what, "input")
            shape = m.values[m.inputs[s.input]].shape
            if not 0 <= s.dim < len(shape):
                self.fail(f"{what}: input {s.input} has no dimension {s.dim} (its rank is {len(shape)})")
            size = shape[s.dim]
            if not (isinstance(size, Expr) and size.text == s.name and size.bound == s.max):
                self.fail(f"{what}: input {s.input} dimension {s.dim} is {size}, not the symbol (bound {s.max})")

    def expressions(self, m: Method, where: str) -> None:
        """Every size expression names only the method's symbols, and its bound is its value at
        their maxima (memory is planned, and checked here, for the bounds)."""
        env = {s.name: s.max for s in m.symbols}
        for what, x in _method_sizes(m, where):
            for e in (x if isinstance(x, (tuple, list)) else (x,)):
                if not isinstance(e, Expr):
                    continue
                unknown = sorted(e.names() - env.keys())
                if unknown:
                    self.fail(f"{what}: size expression {e.text!r} names unknown symbols {unknown}")
                try:
                    value = e.evaluate(env)
                except ProgramError as exc:
                    self.fail(f"{what}: {exc}")
                if value != e.bound:
                    self.fail(f"{what}: size expression {e.text!r} is {value} at the symbols' maxima, but its "
                              f"recorded bound is {e.bound}")


def _method_sizes(m: Method, where: str):
    """(what, size or sizes) for every size of ``m`` that may be symbolic."""
    for j, v in enumerate(m.values):
        yield f"{where} value {j} shape", v.shape
    for j, ins in enumerate(m.instructions):
        for k, a in enumerate(ins.args):
            if a.kind in (HostArgKind.SYM_INT, HostArgKind.SYM_INT_LIST):
                yield f"{where} instruction {j} arg {k}", a.value
    for j, d in enumerate(m.delegates):
        w = f"{where} delegate {j}"
        for k, t in enumerate(d.plan.tensors):
            yield f"{w} tensor {k}", (t.byte_offset, *t.shape, *t.strides)
        for k, launch in enumerate(d.plan.launches):
            yield f"{w} launch {k} grid", launch.grid
            args = [*launch.args, *launch.constexprs.values()]
            yield f"{w} launch {k} args", [a.value for a in args if a.kind == KernelArgKind.INT]
