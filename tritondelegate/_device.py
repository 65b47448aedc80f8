"""Device strings, shared by the lowering side and the runtime.

A device is a (type, index) pair. Strings parse case-insensitively and the index defaults to 0:
``"CUDA"`` and ``"cuda:0"`` are the same device. ``"cpu"`` is the host.
"""

from __future__ import annotations

from typing import NamedTuple

HOST_TYPE = "cpu"
# Device types a delegate may target. The simulated device registers itself for "cuda" too, so that a
# program lowered for CUDA runs unchanged on a machine without a GPU.
DEVICE_TYPES = ("cpu", "cuda")


class Device(NamedTuple):
    type: str
    index: int = 0

    @property
    def is_host(self) -> bool:
        return self.type == HOST_TYPE

    def __str__(self) -> str:
        return self.type if self.is_host else f"{self.type}:{self.index}"


HOST = Device(HOST_TYPE, 0)


def parse_device(spec: "str | Device") -> Device:
    """Parse ``"cuda"``, ``"CUDA:1"``, ``"cpu"`` into a :class:`Device`.

    Raises ``ValueError`` naming the valid device types for an unknown type or a malformed index.
    """
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"device must be a string such as 'cuda:0', got {spec!r}")
    text = spec.strip().lower()
    kind, sep, index_text = text.partition(":")
    if kind not in DEVICE_TYPES:
        raise ValueError(
            f"unknown device type {kind!r} in {spec!r}; valid types are: {', '.join(DEVICE_TYPES)}"
        )
    if not sep:
        return Device(kind, 0)
    if not index_text.isdigit():
        raise ValueError(f"device index in {spec!r} must be a non-negative integer")
    index = int(index_text)
    if kind == HOST_TYPE and index != 0:
        raise ValueError(f"the host device has only index 0, got {spec!r}")
    return Device(kind, index)
