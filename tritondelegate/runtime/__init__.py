"""The runtime: loads program files and runs methods. It shares only the program format and the kernel
registry with the lowering side, and imports nothing of torch.export or the passes."""

from .allocator import CudaAllocator, DeviceAllocator, SimulatedAllocator, allocators_for, register_allocator
from .loader import LoadedProgram, load
from .inputs import InputError
from .method import LoadedMethod, MethodStats

__all__ = [
    "CudaAllocator", "DeviceAllocator", "register_allocator", "SimulatedAllocator", "allocators_for",
    "LoadedProgram", "load", "InputError", "LoadedMethod", "MethodStats",
]
