"""What a loaded program holds for all of its methods: per device, a constants segment and a state
segment; host state; and (for ``memory()``) the arenas of its loaded methods.

Segments are allocated on first use, by the first method that runs on their device. A constant is
copied into its slot the first time a method that reads it loads, so loading a second method copies
no constant that is already there. State is filled from the file when its segment is allocated and
then only changed by the methods (in place) or by :meth:`ProgramMemory.reset_state`. :meth:`ProgramMemory.close`
gives every segment and every loaded method's arenas back to their allocators.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .._device import parse_device
from ..dtypes import parse_dtype
from ..program import Program, SegmentKind
from ..errors import ProgramError
from .allocator import AllocatorError, DeviceAllocator


def parse_program_device(device: str) -> tuple[str, int]:
    """A device string read from a program file; a malformed one is the file's fault."""
    try:
        return tuple(parse_device(device))
    except ValueError as exc:
        raise ProgramError(f"bad device {device!r} in the program: {exc}") from exc


def allocate(allocator: DeviceAllocator, nbytes: int, device_index: int, alignment: int, who: str) -> torch.Tensor:
    """``allocator.allocate``; a size the device cannot hold is a ProgramError naming who asked for it."""
    try:
        return allocator.allocate(nbytes, device_index, alignment)
    except AllocatorError:
        raise
    except (RuntimeError, MemoryError) as exc:
        raise ProgramError(f"{who} needs {nbytes} bytes on {allocator.device_type}:{device_index}, which cannot be "
                           f"allocated ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc


class ProgramMemory:
    def __init__(self, program: Program, source, allocators: dict[str, DeviceAllocator]):
        self.program, self.source, self.allocators = program, source, allocators
        # Calls on one loaded program are serialized: they share its state (and its lazily filled memory).
        self.lock = threading.RLock()
        self._segments: list[torch.Tensor | None] = [None] * len(program.segments)
        self._host_state: dict[int, torch.Tensor] = {}
        self._loaded: set[int] = set()  # constant slots already copied to their device
        self._methods: weakref.WeakSet = weakref.WeakSet()  # loaded methods, for their arenas
        self.closed = False

    # -- devices --------------------------------------------------------------------------------
    def device(self, device: str, who: str = "this program") -> tuple[DeviceAllocator, int]:
        kind, index = parse_program_device(device)
        if kind not in self.allocators:
            raise AllocatorError(
                f"{who} runs on {device}, but no allocator is registered for device type {kind!r}; load "
                f"with devices='auto', 'cuda', 'simulated' or 'null', or pass a DeviceAllocator for {kind!r}"
            )
        return self.allocators[kind], index

    # -- slots ----------------------------------------------------------------------------------
    def slot_tensor(self, index: int) -> torch.Tensor:
        """The tensor of slot ``index``: a view of its segment, or the host state tensor. Allocates
        the segment on first use (state segments are filled then); constants are filled by :meth:`load`."""
        slot = self.program.slots[index]
        constant = self.program.constants[slot.constant]
        if slot.segment < 0:
            if index not in self._host_state:
                self._host_state[index] = self.source.constant_tensor(slot.constant).clone()
            return self._host_state[index]
        buffer = self._segment(slot.segment)
        end = slot.offset + constant.nbytes
        if end > buffer.numel():
            raise ProgramError(f"slot {slot.name!r} [{slot.offset}, {end}) overruns its {buffer.numel()}-byte segment")
        return buffer[slot.offset:end].view(parse_dtype(constant.dtype)).view(tuple(constant.shape))

    def load(self, slots, stream=None) -> tuple[int, int]:
        """Copy the constants of ``slots`` not loaded yet into their device slots; synchronize once per
        device. Returns (bytes, copies)."""
        nbytes = copies = 0
        streams: dict[str, tuple] = {}
        for index in sorted(set(slots)):
            slot = self.program.slots[index]
            view = self.slot_tensor(index)  # allocates (and fills state) on first use
            if slot.state or index in self._loaded:
                continue
            self._loaded.add(index)
            if view.numel():  # empty tensors load without a copy
                allocator, device_index = self.device(slot.device)
                s = streams.setdefault(slot.device, (allocator, device_index, allocator.stream(device_index, stream)))[2]
                allocator.copy_from_host(view, self.source.constant_tensor(slot.constant), s)
                nbytes += view.numel() * view.element_size()
                copies += 1
        for allocator, device_index, s in streams.values():  # waiting for the copy stream only
            allocator.synchronize(device_index, s)
        return nbytes, copies

    def _segment(self, index: int) -> torch.Tensor:
        if self._segments[index] is None:
            seg = self.program.segments[index]
            allocator, device_index = self.device(seg.device)
            self._segments[index] = allocate(allocator, seg.nbytes, device_index, seg.alignment, f"segment {index}")
            if seg.kind == SegmentKind.STATE:
                self._fill_state(index, None)
        return self._segments[index]

    def _fill_state(self, segment: int, stream) -> None:
        seg = self.program.segments[segment]
        allocator, device_index = self.device(seg.device)
        s = allocator.stream(device_index, stream)
        for index, slot in enumerate(self.program.slots):
            if slot.state and slot.segment == segment:
                view = self.slot_tensor(index)
                if view.numel():
                    allocator.copy_from_host(view, self.source.constant_tensor(slot.constant), s)
        allocator.synchronize(device_index, s)

    # -- state ----------------------------------------------------------------------------------
    def reset_state(self, stream=None) -> None:
        with self.lock:
            self.check_open("reset_state")
            for index, tensor in self._host_state.items():
                tensor.copy_(self.source.constant_tensor(self.program.slots[index].constant))
            for segment, buffer in enumerate(self._segments):
                if buffer is not None and self.program.segments[segment].kind == SegmentKind.STATE:
                    self._fill_state(segment, stream)

    # -- release --------------------------------------------------------------------------------
    def check_open(self, who: str) -> None:
        """Refuse to run anything once the program is closed."""
        if self.closed:
            raise RuntimeError(f"{who}: its program was closed (LoadedProgram.close() gave its device memory "
                               "back); load the program again to run it")

    def close(self) -> None:
        """Free the segments, the host state and the arenas of every method still loaded; idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for method in list(self._methods):
                method.release()
            self._methods = weakref.WeakSet()
            for index, buffer in enumerate(self._segments):
                if buffer is not None:
                    allocator, _ = self.device(self.program.segments[index].device)
                    allocator.free(buffer)
            self._segments = [None] * len(self._segments)
            self._host_state.clear()
            self._loaded.clear()

    # -- accounting -----------------------------------------------------------------------------
    def add_method(self, method) -> None:
        self._methods.add(method)

    def report(self) -> dict[str, dict[str, int]]:
        """{device: {"constants", "state", "arenas", "total"}} in bytes, for what this load holds now."""
        out: dict[str, dict[str, int]] = {}

        def entry(device):
            return out.setdefault(device, {"constants": 0, "state": 0, "arenas": 0, "total": 0})

        for index, seg in enumerate(self.program.segments):
            if self._segments[index] is not None:
                entry(seg.device)["constants" if seg.kind == SegmentKind.CONSTANTS else "state"] += seg.nbytes
        for tensor in self._host_state.values():
            entry("cpu")["state"] += tensor.numel() * tensor.element_size()
        for method in list(self._methods):
            for device, nbytes in method.device_bytes().items():
                entry(device)["arenas"] += nbytes
        for figures in out.values():
            figures["total"] = figures["constants"] + figures["state"] + figures["arenas"]
        return out
