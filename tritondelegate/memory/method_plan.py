"""Device-aware memory planning of one method: one arena per device, host values never planned.

Lifetimes are [defining instruction, last reading instruction]; a delegate's scratch block lives for
its own call; device outputs live to the end of the call. Caller-provided device inputs
(``skip_h2d_for_method_inputs``) are never planned, and neither are resident constants and state:
they live in the program's segments (``segments.py``), shared by every method.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..program import DEVICE_ALIGNMENT, Arena, InstrKind, Method, Role, value_lifetimes
from .planner import Interval, greedy_by_size, lower_bound


@dataclass
class _Slot:
    interval: Interval
    value: int = -1  # value id, or -1 for a delegate's scratch
    delegate: int = -1


def plan_method(method: Method, alloc_graph_input: bool = True, alloc_graph_output: bool = True) -> None:
    """Set ``arena``/``arena_offset`` on planned values and delegate scratch; fill ``method.arenas``."""
    first, last = value_lifetimes(method)

    slots: dict[str, list[_Slot]] = {}
    for vid, value in enumerate(method.values):
        if value.device == "cpu":
            continue
        if value.role in (Role.INPUT, Role.MUTABLE_BUFFER) or value.resident:
            continue  # from the caller, used in place; or in a program segment
        if vid in first:
            interval = Interval(value.nbytes, first[vid], last.get(vid, first[vid]))
        else:
            continue
        is_input_copy = any(
            instr.kind == InstrKind.COPY_H2D and vid in instr.outputs
            and method.values[instr.inputs[0]].role == Role.INPUT
            for instr in method.instructions
        )
        if is_input_copy and not alloc_graph_input:
            continue
        if vid in method.outputs and not alloc_graph_output:
            continue
        slots.setdefault(value.device, []).append(_Slot(interval, value=vid))
    for i, instr in enumerate(method.instructions):
        if instr.kind == InstrKind.DELEGATE:
            delegate = method.delegates[instr.delegate]
            if delegate.plan.scratch_bytes and not delegate.stage_inputs:
                slots.setdefault(delegate.device, []).append(
                    _Slot(Interval(delegate.plan.scratch_bytes, i, i), delegate=instr.delegate))

    method.arenas = []
    for device in sorted(slots):
        alignment = DEVICE_ALIGNMENT
        intervals = [s.interval for s in slots[device]]
        offsets, total = greedy_by_size(intervals, alignment)
        index = len(method.arenas)
        method.arenas.append(Arena(device, total, alignment, lower_bound(intervals, alignment)))
        for slot, offset in zip(slots[device], offsets):
            if slot.value >= 0:
                method.values[slot.value].arena = index
                method.values[slot.value].arena_offset = offset
            else:
                method.delegates[slot.delegate].scratch_arena = index
                method.delegates[slot.delegate].scratch_offset = offset
