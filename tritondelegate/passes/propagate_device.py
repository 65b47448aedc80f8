"""PropagateDevicePass: where each value lives, and the copies between host and devices.

Rules (DESIGN.md, "Device propagation"):

* A delegate reads values on its own device. A host value it reads gets one h2d copy per device
  (shared by every delegate on that device); a device value a host op or the method output reads gets
  one d2h copy. A value already on the delegate's device is read directly, so same-device bounces
  ``h2d(d2h(x))`` never appear; a value on another device goes through the host (the cross-device
  bounce stays).
* ``skip_h2d_for_method_inputs``: inputs that only delegates on one device read arrive on that device.
* ``skip_d2h_for_method_outputs``: delegate outputs that only the method output reads are returned
  on their device.
* ``skip_h2d_for_constants``: constants that only delegates on one device read become resident.
* Program state goes where ``passes/state.py`` placed it (program-wide): on a device, delegates there
  read and update it in place; a host op that reads it gets a d2h copy. On the host, delegates read it
  through an h2d copy and their new value is copied back.
* Every constant and state buffer still copied per call yields a message (warning, or error when
  asked for).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..config import PerCallCopyError, PerCallCopyWarning, PropagateDeviceConfig
from ..program import HostArgKind, Instruction, InstrKind, Method, Role, TensorValue

HOST = "cpu"


@dataclass
class Copy:
    """A per-call copy, for the summary."""

    value: str
    direction: str  # "h2d" or "d2h"
    device: str
    nbytes: int
    reason: str


@dataclass
class DeviceReport:
    copies: list[Copy] = field(default_factory=list)
    resident: list[tuple[str, str, int]] = field(default_factory=list)  # (constant, device, bytes)
    messages: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Reader:
    kind: str  # "delegate", "host", "output", "mutation"
    device: str
    name: str
    target: str = ""

    def describe(self) -> str:
        if self.kind == "delegate":
            return f"delegate {self.name!r} on {self.device}"
        if self.kind == "host":
            return f"host op {self.name!r} ({self.target})"
        return "the method returns it" if self.kind == "output" else "a buffer mutation reads it"


def _readers(method: Method) -> dict[int, list[_Reader]]:
    readers: dict[int, list[_Reader]] = {}
    for instr in method.instructions:
        if instr.kind == InstrKind.DELEGATE:
            reader = _Reader("delegate", method.delegates[instr.delegate].device, instr.name)
        else:
            reader = _Reader("host", HOST, instr.name, instr.target)
        for vid in instr.inputs:
            readers.setdefault(vid, []).append(reader)
    for vid in method.outputs:
        readers.setdefault(vid, []).append(_Reader("output", HOST, "output"))
    for _, vid in method.mutated_buffers:
        readers.setdefault(vid, []).append(_Reader("mutation", HOST, "mutation"))
    return readers


def _single_device(readers: list[_Reader]) -> str | None:
    """The device when every reader is a delegate on that one device, else None."""
    devices = {r.device for r in readers}
    if readers and all(r.kind == "delegate" for r in readers) and len(devices) == 1:
        return devices.pop()
    return None


class PropagateDevicePass:
    """Place values and insert copies in one method. ``__call__`` returns whether it changed it."""

    name = "PropagateDevicePass"

    def __init__(self, config: PropagateDeviceConfig, plan_device_memory: bool = True, state: dict | None = None):
        self.config = config
        self.plan_device_memory = plan_device_memory
        self.state = state or {}  # FQN -> passes.state.StateBuffer
        self.report = DeviceReport()

    def __call__(self, method: Method) -> bool:
        for value in method.values:
            if value.role == Role.MUTABLE_BUFFER and value.name in self.state:
                value.device = self.state[value.name].device
        if not method.delegates:
            return False
        if not self.plan_device_memory:
            return self._stage_inside_delegates(method)
        flag = lambda name: self.config.flag(name, method.name)  # noqa: E731
        readers = _readers(method)
        values = method.values
        for instr in method.instructions:
            if instr.kind == InstrKind.DELEGATE:
                for vid in instr.outputs:
                    values[vid].device = method.delegates[instr.delegate].device
        for vid, value in enumerate(values):
            device = _single_device(readers.get(vid, []))
            if device is None:
                continue
            if value.role == Role.INPUT and flag("skip_h2d_for_method_inputs"):
                value.device = device
            elif value.role == Role.CONSTANT and flag("skip_h2d_for_constants"):
                value.device, value.resident = device, True
                self.report.resident.append((value.name, device, value.nbytes))
        self._insert_copies(method, readers, flag("skip_d2h_for_method_outputs"))
        self._warn(method, readers, flag("skip_h2d_for_constants"))
        return True

    # -- copies ---------------------------------------------------------------------------------
    def _insert_copies(self, method: Method, readers, skip_d2h_outputs: bool) -> None:
        values = method.values
        copies: dict[tuple[int, str], int] = {}
        out: list[Instruction] = []

        def on(vid: int, device: str, reason_reader: str) -> int:
            """``vid`` as seen on ``device``, copying (once per value and device) when needed."""
            if values[vid].device == device:
                return vid
            key = (vid, device)
            if key in copies:
                return copies[key]
            src = vid
            if values[vid].device != HOST and device != HOST:
                src = on(vid, HOST, reason_reader)  # cross-device: through the host
            v = values[src]
            copy = TensorValue(f"{values[vid].name}@{device}", v.dtype, v.shape, device, Role.INTERMEDIATE, v.nbytes)
            values.append(copy)
            copies[key] = len(values) - 1
            kind = InstrKind.COPY_D2H if device == HOST else InstrKind.COPY_H2D
            out.append(Instruction(kind, inputs=[src], outputs=[copies[key]], name=copy.name))
            self.report.copies.append(Copy(
                values[vid].name, "d2h" if device == HOST else "h2d",
                values[src].device if device == HOST else device, v.nbytes, reason_reader,
            ))
            return copies[key]

        for instr in method.instructions:
            if instr.kind == InstrKind.DELEGATE:
                device = method.delegates[instr.delegate].device
                instr.inputs = [on(v, device, f"read by delegate {instr.name!r}") for v in instr.inputs]
            else:
                mapping = {v: on(v, HOST, f"read by host op {instr.name!r}") for v in instr.inputs}
                instr.inputs = [mapping[v] for v in instr.inputs]
                for arg in instr.args:
                    if arg.kind == HostArgKind.TENSOR:
                        arg.value = mapping[arg.value]
                    elif arg.kind == HostArgKind.TENSOR_LIST:
                        arg.value = [mapping.get(v, v) for v in arg.value]
            out.append(instr)
        for i, vid in enumerate(method.outputs):
            value = values[vid]
            if value.device == HOST:
                continue
            only_output = all(r.kind == "output" for r in readers.get(vid, []))
            if skip_d2h_outputs and only_output and (vid, HOST) not in copies:
                continue
            method.outputs[i] = on(vid, HOST, "the method returns it")
        method.mutated_buffers = [(b, on(v, values[b].device, f"it updates state buffer {values[b].name!r}"))
                                  for b, v in method.mutated_buffers]
        method.instructions = out

    def _stage_inside_delegates(self, method: Method) -> bool:
        """enable_non_cpu_memory_planning=False: delegates copy host inputs in and out per call."""
        for delegate in method.delegates:
            delegate.stage_inputs = True
        for instr in method.instructions:
            if instr.kind != InstrKind.DELEGATE:
                continue
            device = method.delegates[instr.delegate].device
            for vid in instr.inputs:
                value = method.values[vid]
                self.report.copies.append(Copy(value.name, "h2d", device, value.nbytes,
                                               f"staged inside delegate {instr.name!r}"))
                if value.role == Role.CONSTANT:
                    self.report.messages.append(
                        f"constant {value.name!r} ({value.nbytes} bytes) is copied to {device} on every "
                        f"call: delegate {instr.name!r} stages its inputs itself because "
                        "LowerConfig(enable_non_cpu_memory_planning=False)."
                    )
            for vid in instr.outputs:
                value = method.values[vid]
                self.report.copies.append(Copy(value.name, "d2h", device, value.nbytes,
                                               f"staged inside delegate {instr.name!r}"))
        self._emit_messages()
        return True

    # -- warnings -------------------------------------------------------------------------------
    def _warn(self, method: Method, readers, skip_constants: bool) -> None:
        values = method.values
        for instr in method.instructions:
            if instr.kind != InstrKind.COPY_H2D:
                continue
            src = values[instr.inputs[0]]
            if src.role != Role.CONSTANT:
                continue
            device = values[instr.outputs[0]].device
            own = [r for r in readers.get(instr.inputs[0], [])]
            others = [r for r in own if not (r.kind == "delegate" and r.device == device)]
            if others:
                reason = "; ".join(dict.fromkeys(r.describe() for r in others))
                reason = f"it is also read elsewhere: {reason}"
            else:
                reason = "only delegates on this device read it, but skip_h2d_for_constants is off"
            message = f"constant {src.name!r} ({src.nbytes} bytes) is copied to {device} on every call: {reason}."
            if _single_device(own) is not None and not skip_constants:
                message += (
                    f" Set PropagateDeviceConfig(skip_h2d_for_constants=True) to keep it resident on "
                    f"{device}, loaded once."
                )
            self.report.messages.append(f"method {method.name!r}: {message}")
        self._warn_state(method)
        self._emit_messages()

    def _warn_state(self, method: Method) -> None:
        """One message per state buffer that crosses the bus in this method, with the reason."""
        values, crossing = method.values, {}
        written = {new: buffer for buffer, new in method.mutated_buffers}
        for instr in method.instructions:
            if instr.kind not in (InstrKind.COPY_H2D, InstrKind.COPY_D2H):
                continue
            src = instr.inputs[0]
            # the state itself, or its new value on the way to the state (or from a host update)
            buffer = src if values[src].role == Role.MUTABLE_BUFFER else written.get(
                instr.outputs[0], written.get(src))
            if buffer is not None:
                crossing.setdefault(buffer, []).append(instr)
        for buffer, copies in crossing.items():
            value = values[buffer]
            info = self.state.get(value.name)
            directions = {"h2d" if c.kind == InstrKind.COPY_H2D else "d2h" for c in copies}
            route = "to the device and back" if len(directions) == 2 else (
                "to the device" if directions == {"h2d"} else "to the host")
            if info is not None and info.device == HOST:
                reason = f"it stays on the host because {info.reason}"
                if "state_on_device=False" not in info.reason:
                    reason += " (only state that delegates of one device alone touch stays on the device)"
            else:
                reasons = dict.fromkeys(c.reason for c in self.report.copies if c.value == value.name)
                reason = "; ".join(reasons) or "it is read off the device"
            self.report.messages.append(
                f"method {method.name!r}: state buffer {value.name!r} ({value.nbytes} bytes) is copied "
                f"{route} on every call: {reason}."
            )

    def _emit_messages(self) -> None:
        if not self.report.messages:
            return
        if self.config.error_on_per_call_copies:
            raise PerCallCopyError("\n".join(self.report.messages))
        for message in self.report.messages:
            warnings.warn(message, PerCallCopyWarning, stacklevel=4)
