"""Consistency of one method beyond its indices (``validate.py`` checks those first): its pytree specs,
device strings, value sizes, arenas, and data flow (each instruction reads values that exist by then,
on the device it runs on, and writes only the method's intermediate values; copies keep dtype and
shape; delegates get as many inputs and outputs as their plans take). A file that breaks any of them
raises :class:`ProgramError` at load, instead of failing inside a call with another exception or
blaming the caller's inputs for it."""

from __future__ import annotations

import math

import torch.utils._pytree as pytree

from .._device import parse_device
from ..program import HostArgKind, InstrKind, Method, Role, align_up
from ..symbolic import bound

# The largest alignment an arena or segment may ask for (a device needs at most a page): a file must not
# make the loader over-allocate through it.
MAX_ALIGNMENT = 1 << 16


def check_device(device: str, what: str, fail) -> None:
    """``device`` is a canonical device string (``"cpu"``, ``"cuda:0"``): the runtime compares them as text."""
    try:
        ok = str(parse_device(device)) == device
    except ValueError:
        ok = False
    if not ok:
        fail(f"{what} has device {device!r}, not a device such as 'cpu' or 'cuda:0'")


def check_alignment(alignment: int, what: str, fail) -> None:
    if not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        fail(f"{what} has alignment {alignment}, not a power of two up to {MAX_ALIGNMENT}")


def aligned_end(ends, alignment: int) -> int:
    """The most bytes a region needs for its users' ``ends`` (each user takes at least one byte)."""
    end = max(ends, default=0)
    return align_up(end, alignment)


class MethodConsistency:
    def __init__(self, m: Method, where: str, fail, dtypes: dict):
        self.m, self.where, self.fail, self.dtypes = m, where, fail, dtypes

    def check(self) -> None:
        self.specs()
        self.values()
        self.arenas()
        self.flow()

    def specs(self) -> None:
        m = self.m
        for what, text, leaves in (("input", m.input_spec, len(m.inputs)), ("output", m.output_spec, len(m.outputs))):
            try:
                spec = pytree.treespec_loads(text)
            except Exception as e:  # json, unknown types, malformed entries: all the file's fault
                self.fail(f"{self.where} {what} spec does not parse ({type(e).__name__}: {e})")
            if spec.num_leaves != leaves:
                self.fail(f"{self.where} {what} spec has {spec.num_leaves} leaves for {leaves} {what}s")
            if what == "input" and [c.type for c in [spec, *spec.children()]] != [tuple, tuple, dict]:
                self.fail(f"{self.where} input spec is not (args, kwargs)")

    def values(self) -> None:
        m, where = self.m, self.where
        if len(set(m.inputs)) != len(m.inputs):
            self.fail(f"{where} lists an input value twice")
        inputs = set(m.inputs)
        for j, v in enumerate(m.values):
            what = f"{where} value {j} ({v.name!r})"
            check_device(v.device, what, self.fail)
            itemsize = self.dtypes[v.dtype].itemsize
            if v.nbytes != math.prod(bound(tuple(v.shape))) * itemsize:
                self.fail(f"{what} records {v.nbytes} bytes, but {v.dtype}{list(v.shape)} has "
                          f"{math.prod(bound(tuple(v.shape))) * itemsize}")
            if (v.role == Role.INPUT) != (j in inputs):
                self.fail(f"{what} has role {v.role.name} but is {'' if j in inputs else 'not '}a method input")
            if v.role == Role.CONSTANT and v.slot < 0 and v.constant < 0:
                self.fail(f"{what} is a constant without data (no constant, no slot)")
            if v.arena >= 0:
                arena = m.arenas[v.arena]
                if arena.device != v.device or v.arena_offset % itemsize or v.arena_offset + v.nbytes > arena.nbytes:
                    self.fail(f"{what} on {v.device} at offset {v.arena_offset} ({v.nbytes} bytes) does not fit "
                              f"arena {v.arena} on {arena.device} ({arena.nbytes} bytes)")

    def arenas(self) -> None:
        m = self.m
        for a, arena in enumerate(m.arenas):
            what = f"{self.where} arena {a}"
            check_device(arena.device, what, self.fail)
            check_alignment(arena.alignment, what, self.fail)
            ends = [v.arena_offset + max(v.nbytes, 1) for v in m.values if v.arena == a]
            ends += [d.scratch_offset + max(d.plan.scratch_bytes, 1) for d in m.delegates if d.scratch_arena == a]
            if arena.nbytes > aligned_end(ends, arena.alignment):
                self.fail(f"{what} has {arena.nbytes} bytes; what lies in it needs "
                          f"{aligned_end(ends, arena.alignment)}")
        for k, d in enumerate(m.delegates):
            what = f"{self.where} delegate {k}"
            check_device(d.device, what, self.fail)
            if d.device == "cpu":
                self.fail(f"{what} runs on the host; delegates run on a device")
            if d.scratch_arena >= 0 and m.arenas[d.scratch_arena].device != d.device:
                self.fail(f"{what} on {d.device} has its scratch in arena {d.scratch_arena} on "
                          f"{m.arenas[d.scratch_arena].device}")
            if d.plan.scratch_bytes and d.scratch_arena < 0 and not d.stage_inputs:
                self.fail(f"{what} needs {d.plan.scratch_bytes} scratch bytes but has no scratch arena")

    def flow(self) -> None:
        """Instructions in order: what each reads exists by then, and what it writes is the method's."""
        m, values = self.m, self.m.values
        ready = {j for j, v in enumerate(values) if v.role != Role.INTERMEDIATE}  # written only by instructions
        for j, ins in enumerate(m.instructions):
            what = f"{self.where} instruction {j} ({ins.name!r})"
            reads = list(ins.inputs)
            for a in ins.args:
                if a.kind == HostArgKind.TENSOR:
                    reads.append(a.value)
                elif a.kind == HostArgKind.TENSOR_LIST:
                    reads += [v for v in a.value if v >= 0]
            for vid in reads:
                if vid not in ready:
                    self.fail(f"{what} reads value {vid} ({values[vid].name!r}) before anything writes it")
            for vid in ins.outputs:
                if values[vid].role != Role.INTERMEDIATE:
                    self.fail(f"{what} writes value {vid} ({values[vid].name!r}), a {values[vid].role.name.lower()}")
            if ins.kind == InstrKind.DELEGATE:
                self.delegate_call(ins, what)
            elif ins.kind != InstrKind.HOST_OP:
                self.copy(ins, what)
            ready.update(ins.outputs)
        for k, vid in enumerate(m.outputs):
            if vid not in ready:
                self.fail(f"{self.where} output {k} is value {vid} ({values[vid].name!r}), which nothing writes")
        for k, (buffer, new) in enumerate(m.mutated_buffers):
            b, n = values[buffer], values[new]
            if b.role != Role.MUTABLE_BUFFER or new not in ready or (b.dtype, b.shape, b.device) != (n.dtype, n.shape, n.device):
                self.fail(f"{self.where} mutated buffer {k}: value {new} ({n.name!r}, {n.dtype}{list(n.shape)} on "
                          f"{n.device}) cannot be written back to state {buffer} ({b.name!r}, {b.role.name.lower()} "
                          f"{b.dtype}{list(b.shape)} on {b.device})")

    def copy(self, ins, what: str) -> None:
        src, dst = self.m.values[ins.inputs[0]], self.m.values[ins.outputs[0]]
        host = {InstrKind.COPY_H2D: (True, False), InstrKind.COPY_D2H: (False, True)}
        if ((src.device == "cpu", dst.device == "cpu") != host[ins.kind]
                or (src.dtype, tuple(src.shape)) != (dst.dtype, tuple(dst.shape))):
            self.fail(f"{what}: a {ins.kind.name} copy from {src.dtype}{list(src.shape)} on {src.device} to "
                      f"{dst.dtype}{list(dst.shape)} on {dst.device}")

    def delegate_call(self, ins, what: str) -> None:
        d = self.m.delegates[ins.delegate]
        plan = d.plan
        if len(ins.inputs) != len(plan.input_nbytes) or len(ins.outputs) != len(plan.output_nbytes):
            self.fail(f"{what} passes {len(ins.inputs)} inputs and {len(ins.outputs)} outputs to delegate "
                      f"{ins.delegate}, whose plan takes {len(plan.input_nbytes)} and {len(plan.output_nbytes)}")
        device = "cpu" if d.stage_inputs else d.device
        for kind, vids, sizes in (("input", ins.inputs, plan.input_nbytes), ("output", ins.outputs, plan.output_nbytes)):
            for k, (vid, nbytes) in enumerate(zip(vids, sizes)):
                v = self.m.values[vid]
                if v.device != device or v.nbytes != nbytes:
                    self.fail(f"{what}: delegate {kind} {k} is {v.name!r} ({v.nbytes} bytes on {v.device}); its plan "
                              f"takes {nbytes} bytes on {device}")
