"""Verifier run after the passes: every value defined before use and read on the right device."""

from __future__ import annotations

from ..program import InstrKind, Method, Role


class VerificationError(RuntimeError):
    """An internal invariant of a lowered method does not hold (a bug in a pass)."""


def verify_method(method: Method) -> None:
    values = method.values
    defined = {i for i, v in enumerate(values) if v.role != Role.INTERMEDIATE}

    def fail(msg):
        raise VerificationError(f"method {method.name!r}: {msg}")

    for instr in method.instructions:
        for vid in instr.inputs:
            if vid not in defined:
                fail(f"instruction {instr.name!r} reads {values[vid].name!r} before it is defined")
        if instr.kind == InstrKind.DELEGATE:
            delegate = method.delegates[instr.delegate]
            want = "cpu" if delegate.stage_inputs else delegate.device
            for vid in instr.inputs + instr.outputs:
                if values[vid].device != want:
                    fail(f"delegate {instr.name!r} on {want} touches {values[vid].name!r} on {values[vid].device}")
        elif instr.kind == InstrKind.HOST_OP:
            for vid in instr.inputs + instr.outputs:
                if vid >= 0 and values[vid].device != "cpu":
                    fail(f"host op {instr.name!r} touches {values[vid].name!r} on {values[vid].device}")
        else:
            src, dst = values[instr.inputs[0]], values[instr.outputs[0]]
            host_side = src if instr.kind == InstrKind.COPY_H2D else dst
            if host_side.device != "cpu" or src.device == dst.device:
                fail(f"copy {instr.name!r} goes from {src.device} to {dst.device}")
        defined.update(v for v in instr.outputs if v >= 0)
    for vid in method.outputs:
        if vid not in defined:
            fail(f"output {values[vid].name!r} is never defined")
    for vid, value in enumerate(values):
        if value.resident and (value.role != Role.CONSTANT or value.device == "cpu" or value.arena >= 0):
            fail(f"resident value {value.name!r} must be a device constant outside the arena")
        if value.role == Role.MUTABLE_BUFFER and value.arena >= 0:
            fail(f"state value {value.name!r} lies in a method arena")
