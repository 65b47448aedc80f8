"""``td.load``: open a program file (memory-mapped) and load its methods."""

from __future__ import annotations

import os

import torch

from ..program import Program, ProgramError
from .allocator import allocators_for
from .delegate import _dtype
from .memory import ProgramMemory
from .method import LoadedMethod


class InMemorySource:
    """Constants straight from a lowered program in memory (no file)."""

    def __init__(self, program: Program, constant_data: list[torch.Tensor], binary_data: list[bytes] = ()):
        self.program = program
        self._data = constant_data
        self._binaries = list(binary_data)

    def binary_bytes(self, index: int) -> bytes:
        return self._binaries[index]

    def constant_tensor(self, index: int) -> torch.Tensor:
        constant = self.program.constants[index]
        tensor = self._data[index]
        if tensor.dtype != _dtype(constant.dtype) or tuple(tensor.shape) != tuple(constant.shape):
            raise ProgramError(f"constant {constant.name!r} data does not match its declared dtype/shape")
        return tensor


class FileSource:
    """Constants as zero-copy views of the mapped program file or its external weights file."""

    def __init__(self, path: str, data_files: dict[str, str] | None):
        from ..serialize.reader import load_program

        self._file = load_program(path)
        self.program = self._file.program
        self._data_files = data_files

    def constant_tensor(self, index: int) -> torch.Tensor:
        return self._file.constant_tensor(index, self._data_files)

    def binary_bytes(self, index: int) -> bytes:
        return self._file.binary_bytes(index)

    def close(self) -> None:
        self._file.close()


class LoadedProgram:
    """A program ready to run: ``load_method(name)`` gives a callable method.

    Everything that lives as long as the program is held once per load and shared by its methods:
    each resident constant (one device copy, whichever methods read it) and each state buffer (a
    buffer that some method mutates, e.g. a KV cache). Two loads of one file are independent. Calls
    on the methods of one load are serialized by a lock, since they share its state.
    """

    def __init__(self, source, devices="auto"):
        self._source = source
        self.program: Program = source.program
        self.allocators = allocators_for(devices)
        self._memory = ProgramMemory(self.program, source, self.allocators)
        self._binaries_installed: set[str] = set()

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes this load holds per device: ``{device: {"constants", "state", "arenas", "total"}}``
        (``arenas``: the arenas of the methods loaded so far, summed)."""
        return self._memory.report()

    def reset_state(self, stream=None) -> None:
        """Every state buffer (e.g. a KV cache) back to its initial value from the file."""
        self._memory.reset_state(stream)

    def _install_binaries(self, method) -> None:
        """Once per program and device: the kernel binaries for the device's arch into Triton's cache."""
        for device in sorted({d.device for d in method.delegates}):
            allocator, index = self._memory.device(device, f"method {method.name!r}")
            if allocator.host_memory or (device in self._binaries_installed) or not self.program.binaries:
                continue
            from .binaries import install_for_device

            install_for_device(self.program, self._source.binary_bytes, index)
            self._binaries_installed.add(device)

    @property
    def state_names(self) -> list[str]:
        """The fully-qualified names of the program's state buffers."""
        return [slot.name for slot in self.program.slots if slot.state]

    @property
    def method_names(self) -> list[str]:
        return [m.name for m in self.program.methods]

    @property
    def device(self) -> str:
        """``"cuda"``, ``"simulated"`` or ``"null"``: what the program's CUDA delegates run on."""
        allocator = self.allocators.get("cuda")
        if allocator is not None and allocator.null:
            return "null"
        return "simulated" if allocator is None or allocator.simulated else "cuda"

    def load_method(self, name: str = "forward", stream=None, reuse_output_memory: bool = False,
                    graphs: bool = False) -> LoadedMethod:
        """Allocate the method's arenas once and load its resident constants on ``stream``.

        With ``reuse_output_memory=True`` device outputs are returned as views of the method's arena:
        no allocation per call, but each call overwrites what the previous one returned. By default
        they are fresh tensors.

        With ``graphs=True`` each delegate whose tensors all live in the arena is recorded once (on its
        second call) and replayed as one CUDA graph from then on: one launch instead of one per
        kernel. Delegates that read caller-provided device inputs run their launches directly.
        """
        for method in self.program.methods:
            if method.name == name:
                with self._memory.lock:
                    self._install_binaries(method)
                    return LoadedMethod(method, self._memory, stream, reuse_output_memory, graphs)
        raise KeyError(f"no method {name!r} in this program; methods: {', '.join(self.method_names)}")


def load(path: str | os.PathLike, *, data_files: dict[str, str] | None = None, devices="auto") -> LoadedProgram:
    """Open a program file written by ``LoweredProgram.save``.

    ``data_files`` maps an external weights file name recorded in the program to its path (default:
    that name next to the program file). ``devices``: ``"auto"`` (CUDA when available, else the
    simulated device), ``"cuda"``, ``"simulated"``, ``"null"`` (memory allocated on the host, copies and
    launches counted but not done: the runtime's own host cost), or a dict of device type -> DeviceAllocator.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ProgramError(f"program file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ProgramError(f"program path {path!r} is not a file")
    return LoadedProgram(FileSource(path, data_files), devices=devices)
