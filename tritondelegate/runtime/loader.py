"""``td.load``: open a program file (memory-mapped) and load its methods."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from .. import progress as _progress
from ..constant_methods import decode as decode_constant_methods
from ..dtypes import parse_dtype
from ..program import Program
from ..errors import ProgramError
from .allocator import allocators_for
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
        if tensor.dtype != parse_dtype(constant.dtype) or tuple(tensor.shape) != tuple(constant.shape):
            raise ProgramError(f"constant {constant.name!r} data does not match its declared dtype/shape")
        return tensor


class FileSource:
    """Constants as zero-copy views of the mapped program file or its external weights file."""

    def __init__(self, path: str, data_files: dict[str, str] | None, key: bytes | None = None):
        from ..serialize.reader import load_program

        self._file = load_program(path, key=key)
        self.program = self._file.program
        self._data_files = data_files

    def constant_tensor(self, index: int) -> torch.Tensor:
        return self._file.constant_tensor(index, self._data_files)

    def binary_bytes(self, index: int) -> bytes:
        return self._file.binary_bytes(index)

    def close(self) -> None:
        self._file.close()


class _CountedSource:
    """``source`` that advances a progress bar by each pending constant's bytes once the next one is
    read (the copy of the previous one is then issued) and by the last one's at :meth:`done`."""

    def __init__(self, source, pending: dict[int, int], bar):
        self._source, self._pending, self._bar, self._issued = source, dict(pending), bar, 0

    def constant_tensor(self, index: int) -> torch.Tensor:
        tensor = self._source.constant_tensor(index)
        self._bar.update(self._issued)
        self._issued = self._pending.pop(index, 0)
        return tensor

    def done(self) -> None:
        self._bar.update(self._issued)
        self._issued = 0

    def __getattr__(self, name):
        return getattr(self._source, name)


class LoadedProgram:
    """A program ready to run: ``load_method(name)`` gives a callable method.

    Everything that lives as long as the program is held once per load and shared by its methods:
    each resident constant (one device copy, whichever methods read it) and each state buffer (a
    buffer that some method mutates, e.g. a KV cache). Two loads of one file are independent. Calls
    on the methods of one load are serialized by a lock, since they share its state.

    :meth:`close` (or leaving a ``with td.load(path) as program:`` block) gives the program's device
    memory back to its allocators and unmaps its file; its methods then refuse calls.
    """

    def __init__(self, source, devices="auto", progress: bool | None = None):
        self._source = source
        self.program: Program = source.program
        self.progress = progress  # the default of load_method(progress=...)
        self.allocators = allocators_for(devices)
        self._memory = ProgramMemory(self.program, source, self.allocators)
        self._binaries_installed: set[str] = set()

    @property
    def lock(self):
        """The program's lock (reentrant): every call of its methods, ``load_method`` and
        ``reset_state`` hold it, so they run one at a time."""
        return self._memory.lock

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes this load holds per device: ``{device: {"constants", "state", "arenas", "total"}}``
        (``arenas``: the arenas of the methods loaded so far, summed)."""
        return self._memory.report()

    def reset_state(self, stream=None) -> None:
        """Every state buffer (e.g. a KV cache) back to its initial value from the file."""
        self._memory.reset_state(stream)

    def close(self) -> None:
        """Free what this load holds, through each device's allocator: the constants and state segments
        and the arenas of its loaded methods; then unmap the program file. Tensors a call returned stay
        valid. Calls, ``load_method`` and ``reset_state`` afterwards raise an error saying it is closed."""
        with self._memory.lock:
            self._memory.close()
            close_source = getattr(self._source, "close", None)
            if close_source is not None:
                close_source()

    @property
    def closed(self) -> bool:
        return self._memory.closed

    def __enter__(self) -> "LoadedProgram":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _install_binaries(self, method) -> None:
        """Once per program and device: the kernel binaries for the device's arch into Triton's cache."""
        for device in sorted({d.device for d in method.delegates}):
            allocator, index = self._memory.device(device, f"method {method.name!r}")
            if allocator.host_memory or (device in self._binaries_installed) or not self.program.binaries:
                continue
            from .binaries import install_for_device

            install_for_device(self.program, self._source.binary_bytes, index)
            self._binaries_installed.add(device)

    @contextmanager
    def _load_progress(self, method, progress: bool | None):
        """While ``method`` loads: a bar over the bytes it copies from the program to a device first
        (resident constants not loaded yet, state of a segment not allocated yet)."""
        memory, pending = self._memory, {}
        for index in sorted({v.slot for v in method.values if v.slot >= 0}):
            slot = self.program.slots[index]
            if slot.segment < 0:
                continue  # host state: no copy to a device
            first = memory._segments[slot.segment] is None if slot.state else index not in memory._loaded
            if first:
                pending[slot.constant] = pending.get(slot.constant, 0) + self.program.constants[slot.constant].nbytes
        total = sum(pending.values())
        with _progress.bar(f"loading {method.name!r}", total, progress, large=total > _progress.LOAD_BYTES,
                           unit="B") as bar:
            if not bar.shown:
                yield
                return
            source = memory.source
            memory.source = counted = _CountedSource(source, pending, bar)
            try:
                yield
            finally:
                memory.source = source
                counted.done()

    @property
    def state_names(self) -> list[str]:
        """The fully-qualified names of the program's state buffers."""
        return [slot.name for slot in self.program.slots if slot.state]

    @property
    def method_names(self) -> list[str]:
        return [m.name for m in self.program.methods]

    @property
    def constant_methods(self) -> dict:
        """The values stored with the program (``lower(..., constant_methods=...)``), by name, e.g.
        ``get_max_seq_len``; empty when it has none."""
        return decode_constant_methods(self.program.constant_methods)

    @property
    def device(self) -> str:
        """``"cuda"``, ``"simulated"`` or ``"null"``: what the program's CUDA delegates run on."""
        allocator = self.allocators.get("cuda")
        if allocator is not None and allocator.null:
            return "null"
        return "simulated" if allocator is None or allocator.simulated else "cuda"

    def load_method(self, name: str = "forward", stream=None, reuse_output_memory: bool = False,
                    graphs: bool = False, progress: bool | None = None) -> LoadedMethod:
        """Allocate the method's arenas once and load its resident constants on ``stream``.

        With ``reuse_output_memory=True`` device outputs are returned as views of the method's arena:
        no allocation per call, but each call overwrites what the previous one returned. By default
        they are fresh tensors.

        With ``graphs=True`` each delegate whose tensors all live in the arena is recorded once (on its
        second call) and replayed as one CUDA graph from then on: one launch instead of one per
        kernel. Delegates that read caller-provided device inputs run their launches directly.

        ``progress``: a bar on stderr while the constants load; None (default: the ``td.load`` setting,
        else auto) shows one when stderr is a terminal and more than ``progress.LOAD_BYTES`` load.
        """
        progress = self.progress if progress is None else progress
        for method in self.program.methods:
            if method.name == name:
                with self._memory.lock:
                    self._memory.check_open(f"load_method({name!r})")
                    self._install_binaries(method)
                    with self._load_progress(method, progress):
                        return LoadedMethod(method, self._memory, stream, reuse_output_memory, graphs)
        raise KeyError(f"no method {name!r} in this program; methods: {', '.join(self.method_names)}")


def load(path: str | os.PathLike, *, data_files: dict[str, str] | None = None, devices="auto",
         progress: bool | None = None, key: bytes | None = None) -> LoadedProgram:
    """Open a program file written by ``LoweredProgram.save``.

    ``data_files`` maps an external weights file name recorded in the program to its path (default:
    that name next to the program file). ``devices``: ``"auto"`` (CUDA when available, else the
    simulated device), ``"cuda"``, ``"simulated"``, ``"null"`` (memory allocated on the host, copies and
    launches counted but not done: the runtime's own host cost), or a dict of device type -> DeviceAllocator.
    ``progress``: the default of ``load_method(progress=...)``: True shows a bar on stderr while
    constants load, False never; None (auto) when stderr is a terminal and the load is large.
    ``key``: the secret bytes a signed program was saved with (``LoweredProgram.save(path, key=...)``);
    a signed program loads only with it, unchanged, and an unsigned one is refused when a key is given.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ProgramError(f"program file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ProgramError(f"program path {path!r} is not a file")
    return LoadedProgram(FileSource(path, data_files, key), devices=devices, progress=progress)
