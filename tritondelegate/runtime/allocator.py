"""Device allocators, keyed by device type.

A :class:`DeviceAllocator` owns device memory and the copies into and out of it. Buffers are
``torch.uint8`` tensors; copies take typed tensors of equal size. The registry maps a device type
(``"cuda"``) to the allocator a program uses for it; ``td.load(devices=...)`` picks the entries.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch


class AllocatorError(RuntimeError):
    """No allocator for a device type, or a device that cannot be used."""


class DeviceAllocator:
    """Interface of a device memory allocator (one per device type)."""

    device_type: str = ""
    simulated: bool = False
    null: bool = False  # the null device: nothing is copied or launched

    @property
    def host_memory(self) -> bool:
        """Whether this device's memory is host memory (the simulated and null devices)."""
        return self.simulated or self.null

    def allocate(self, nbytes: int, device_index: int, alignment: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` on the device, its start aligned to ``alignment``."""
        raise NotImplementedError

    def free(self, buffer: torch.Tensor) -> None:
        """Give back a buffer :meth:`allocate` returned (``LoadedProgram.close()``); nothing views it
        afterwards."""
        raise NotImplementedError

    def copy_host_to_device(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream``. ``src`` may be released when this returns only if
        the copy has read it by then: true for pageable host memory (CUDA stages it before returning)
        and for torch's pinned tensors (its caching host allocator holds them until the copy is done).
        An allocator with truly asynchronous copies from other memory must keep ``src`` alive itself."""
        raise NotImplementedError

    def copy_device_to_host(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream``; ``dst`` is valid after :meth:`synchronize`."""
        raise NotImplementedError

    def copy_device_to_device(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None:
        """Enqueue ``dst.copy_(src)`` between two tensors of one device on ``stream`` (a state
        write-back)."""
        raise NotImplementedError

    def copy_from_host(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None:
        """Load-time fill of a device region from host bytes (e.g. a view of the mapped file)."""
        self.copy_host_to_device(dst, src, stream)

    def synchronize(self, device_index: int, stream=None) -> None:
        """Wait for ``stream`` (the stream the copies used), not for the whole device."""
        raise NotImplementedError

    def stream(self, device_index: int, stream=None):
        """The stream to use: ``stream`` if given, else the device's current stream."""
        return stream


class CudaAllocator(DeviceAllocator):
    """CUDA memory through torch's caching allocator; copies on the caller's stream."""

    device_type = "cuda"

    def allocate(self, nbytes, device_index, alignment):
        if device_index >= torch.cuda.device_count():
            raise AllocatorError(
                f"program needs cuda:{device_index}, but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        # The caching allocator aligns blocks to 512 bytes, more than any alignment we plan with.
        buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=f"cuda:{device_index}")
        if buffer.data_ptr() % alignment:
            raise AllocatorError(f"cuda:{device_index} buffer is not {alignment}-byte aligned")
        return buffer

    def free(self, buffer):
        pass  # the caching allocator takes the block back when the last tensor viewing it is dropped

    def stream(self, device_index, stream=None):
        return stream if stream is not None else torch.cuda.current_stream(device_index)

    def copy_host_to_device(self, dst, src, stream=None):
        with torch.cuda.stream(self.stream(dst.device.index, stream)):
            dst.copy_(src, non_blocking=True)

    def copy_device_to_host(self, dst, src, stream=None):
        with torch.cuda.stream(self.stream(src.device.index, stream)):
            dst.copy_(src, non_blocking=True)

    def copy_device_to_device(self, dst, src, stream=None):
        with torch.cuda.stream(self.stream(src.device.index, stream)):
            dst.copy_(src, non_blocking=True)

    def synchronize(self, device_index, stream=None):
        self.stream(device_index, stream).synchronize()


@dataclass
class SimulatedStream:
    """A stand-in stream: records what ran on it."""

    name: str = "default"


@dataclass
class SimulatedAllocator(DeviceAllocator):
    """The simulated device: host memory standing in for device memory, with counters.

    It counts allocations and frees, copies (bytes by direction) and synchronizations, and records the
    stream each copy used, so tests can check what a real device would have been asked to do.
    """

    device_type: str = "cuda"
    simulated: bool = True
    allocations: int = 0
    allocated_bytes: int = 0
    freed_bytes: int = 0
    copied_bytes: Counter = field(default_factory=Counter)  # "h2d", "d2h", "d2d", "load" -> bytes
    copies: int = 0
    synchronizations: int = 0
    copy_streams: list = field(default_factory=list)
    default_stream: SimulatedStream = field(default_factory=SimulatedStream)

    def allocate(self, nbytes, device_index, alignment):
        self.allocations += 1
        self.allocated_bytes += nbytes
        raw = torch.empty(max(nbytes, 1) + alignment, dtype=torch.uint8)
        shift = (-raw.data_ptr()) % alignment
        return raw[shift : shift + nbytes]

    @property
    def live_bytes(self) -> int:
        """Bytes allocated and not freed yet."""
        return self.allocated_bytes - self.freed_bytes

    def free(self, buffer):
        self.freed_bytes += buffer.numel()

    def stream(self, device_index, stream=None):
        return stream if stream is not None else self.default_stream

    def _copy(self, kind, dst, src, stream):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise AllocatorError(f"{kind} copy between {tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
        dst.copy_(src)
        self.copies += 1
        self.copied_bytes[kind] += src.numel() * src.element_size()
        self.copy_streams.append(stream if stream is not None else self.default_stream)

    def copy_host_to_device(self, dst, src, stream=None):
        self._copy("h2d", dst, src, stream)

    def copy_device_to_host(self, dst, src, stream=None):
        self._copy("d2h", dst, src, stream)

    def copy_device_to_device(self, dst, src, stream=None):
        self._copy("d2d", dst, src, stream)

    def copy_from_host(self, dst, src, stream=None):
        self._copy("load", dst, src, stream)

    def synchronize(self, device_index, stream=None):
        self.synchronizations += 1


@dataclass
class NullAllocator(SimulatedAllocator):
    """The null device: memory is real (host, zero-filled), copies and launches are counted but not
    done. What is left of a call is the runtime's own host cost, measurable on any machine."""

    simulated: bool = False
    null: bool = True

    def allocate(self, nbytes, device_index, alignment):
        buffer = super().allocate(nbytes, device_index, alignment)
        buffer.zero_()
        return buffer

    def _copy(self, kind, dst, src, stream):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise AllocatorError(f"{kind} copy between {tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
        if kind == "d2h":
            dst.zero_()  # defined contents for the host ops that read it
        self.copies += 1
        self.copied_bytes[kind] += src.numel() * src.element_size()


_REGISTRY: dict[str, DeviceAllocator] = {}


def register_allocator(device_type: str, allocator: DeviceAllocator) -> None:
    """Use ``allocator`` for ``device_type`` in programs loaded with ``devices="auto"`` from now on."""
    if not isinstance(allocator, DeviceAllocator):
        raise TypeError(f"register_allocator needs a DeviceAllocator, got {type(allocator).__name__}")
    _REGISTRY[device_type.lower()] = allocator


def allocators_for(devices) -> dict[str, DeviceAllocator]:
    """The allocators ``td.load(devices=...)`` uses: ``"auto"``, ``"cuda"``, ``"simulated"``, ``"null"``, or a dict
    of device type -> :class:`DeviceAllocator` (an empty dict registers none)."""
    if isinstance(devices, dict):
        for kind, allocator in devices.items():
            if not isinstance(allocator, DeviceAllocator):
                raise TypeError(f"devices[{kind!r}] must be a DeviceAllocator, got {type(allocator).__name__}")
        return dict(devices)
    if devices == "auto":
        chosen = allocators_for("cuda" if torch.cuda.is_available() else "simulated")
        return {**chosen, **_REGISTRY}
    if devices == "cuda":
        if not torch.cuda.is_available():
            raise AllocatorError("devices='cuda' needs CUDA, and torch.cuda.is_available() is False here; "
                                 "use devices='auto' or 'simulated'")
        return {"cuda": CudaAllocator()}
    if devices == "simulated":
        return {"cuda": SimulatedAllocator()}
    if devices == "null":
        return {"cuda": NullAllocator()}
    raise ValueError(f"devices must be 'auto', 'cuda', 'simulated', 'null' or a dict of allocators, got {devices!r}")
