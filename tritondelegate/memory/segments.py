"""Program-level memory: the slots of resident constants and state, and the segments holding them.

Every slot lives as long as the loaded program, so a segment is a plain aligned concatenation: each
resident constant once per device whichever methods read it, each state buffer once. Host state gets
a slot without a segment (one host tensor per loaded program).
"""

from __future__ import annotations

from ..program import DEVICE_ALIGNMENT, Program, Role, Segment, SegmentKind, Slot, align_up


def plan_slots(program: Program) -> None:
    """Give every resident constant and state value of every method its slot; fill
    ``program.slots`` and ``program.segments``."""
    program.slots, program.segments = [], []
    by_key: dict[tuple, int] = {}
    for method in program.methods:
        for value in method.values:
            if value.role == Role.MUTABLE_BUFFER:
                key = ("state", value.name)
            elif value.resident:
                key = ("constant", value.constant, value.device)
            else:
                continue
            if key not in by_key:
                by_key[key] = len(program.slots)
                program.slots.append(Slot(value.name, value.constant, value.device, state=key[0] == "state"))
            value.slot = by_key[key]
            value.constant = program.slots[value.slot].constant  # state: one initial value, whoever reads it
    segments: dict[tuple[str, SegmentKind], int] = {}
    for slot in program.slots:
        if slot.device == "cpu":
            continue
        kind = SegmentKind.STATE if slot.state else SegmentKind.CONSTANTS
        if (slot.device, kind) not in segments:
            segments[(slot.device, kind)] = len(program.segments)
            program.segments.append(Segment(slot.device, kind, 0, DEVICE_ALIGNMENT))
        slot.segment = segments[(slot.device, kind)]
        segment = program.segments[slot.segment]
        slot.offset = segment.nbytes
        segment.nbytes = align_up(segment.nbytes + program.constants[slot.constant].nbytes, segment.alignment)
