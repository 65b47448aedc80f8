"""The method executor: a loaded method's arenas, allocated once (its resident constants live in the
program's segments, shared with the program's other methods), and its calls.

A call checks its inputs (``inputs.py``), then runs the method's steps in order: host ops through ATen
on the CPU (``host_ops.py``), copies through the device allocator, and delegates as Triton launches on
views of the arena (staged through host copies, or replayed from a captured graph), all on the
caller's stream; then writes state back and makes the outputs the caller's. A call allocates no
device memory for planned values and synchronizes only where the host must read device data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ..dtypes import parse_dtype
from ..program import DEVICE_ALIGNMENT, InstrKind, Method, Role
from ..errors import ProgramError
from .delegate import DelegateRunner
from .host_ops import HostOp
from .inputs import InputChecker, output_structure
from .memory import ProgramMemory, allocate
from .sized import specialize
from .verify import verify_launches, verify_method

# A method with dynamic dimensions captures CUDA graphs (``graphs=True``) for the first this many
# distinct sizes it is called with; calls at other sizes run plain (prebound, direct) launches.
MAX_GRAPH_SIZES = 8


@dataclass
class MethodStats:
    """What the method copied and launched. ``call_*`` describe the last call."""

    load_h2d_bytes: int = 0
    load_copies: int = 0
    call_h2d_bytes: int = 0
    call_d2h_bytes: int = 0
    call_d2d_bytes: int = 0  # on-device write-backs of state that was not updated in place
    call_copies: int = 0
    calls: int = 0
    launches_per_call: int = 0
    launches: int = 0  # all calls together
    synchronizations_per_call: int = 0
    graph_replays_per_call: int = 0  # delegates replayed from a captured graph (graphs=True)


class LoadedMethod:
    """Call it like the exported model: ``outputs = method(*args, stream=None)``.

    Calls on methods of one loaded program are serialized (they share its state). The memory it holds
    (arenas, staging buffers) is released when its program is closed (``LoadedProgram.close()``)."""

    def __init__(self, method: Method, memory: ProgramMemory, stream=None,
                 reuse_output_memory: bool = False, graphs: bool = False, direct_launches: bool = True):
        self.name = method.name
        self.graphs = graphs
        self.direct_launches = direct_launches
        self.method = method
        self.stats = MethodStats()
        self.reuse_output_memory = reuse_output_memory
        self._memory = memory
        verify_method(memory.program, method)  # the file is untrusted: its plans, before anything runs
        self._out_spec = output_structure(method.output_spec, method.name)
        devices = {v.device for v in method.values} | {d.device for d in method.delegates} | {a.device for a in method.arenas}
        self._allocators = {d: memory.device(d, f"method {method.name!r}") for d in sorted(devices - {"cpu"})}
        self._inputs = InputChecker(method, self._allocators)
        self._device_bytes: dict[str, int] = {}
        self._held: list[tuple[str, torch.Tensor]] = []  # (device, buffer) of every buffer allocated at load
        # Arenas and scratch are planned for the symbols' upper bounds: every size runs in them.
        self._arenas = [self._alloc(a.device, a.nbytes, a.alignment) for a in method.arenas]
        resident = [v.slot for v in method.values if v.slot >= 0 and v.resident]
        self.stats.load_h2d_bytes, self.stats.load_copies = memory.load(resident, stream)
        self._sizes: dict[tuple, _Sized] = {}  # symbol values -> what a call at that size runs
        if not method.symbols:
            self._sizes[()] = self._prepare(method)
        self.stats.launches_per_call = sum(  # at the upper bounds; after a call, that call's
            len(method.delegates[i.delegate].plan.launches) for i in method.instructions if i.kind == InstrKind.DELEGATE)
        memory.add_method(self)

    def _prepare(self, method: Method) -> "_Sized":
        """The environment and steps of a method without symbols (the method, or one size of it)."""
        memory = self._memory
        env: list = [None] * len(method.values)
        for vid, value in enumerate(method.values):
            if value.slot >= 0:  # a resident constant or state: the program's, shared by its methods
                env[vid] = memory.slot_tensor(value.slot)
            elif value.arena >= 0:
                env[vid] = self._arena_view(value.arena, value.arena_offset, value)
            elif value.role in (Role.CONSTANT, Role.MUTABLE_BUFFER):
                env[vid] = memory.source.constant_tensor(value.constant)
        graphs = self.graphs and len(self._sizes) < MAX_GRAPH_SIZES
        steps = []
        for instr in method.instructions:
            if instr.kind == InstrKind.HOST_OP:
                steps.append((instr.kind, HostOp(instr, method.values)))
            elif instr.kind == InstrKind.DELEGATE:
                steps.append((instr.kind, self._delegate(method, instr, graphs)))
            else:  # a copy: (source, destination)
                steps.append((instr.kind, (instr.inputs[0], instr.outputs[0])))
        launches = sum(len(method.delegates[i.delegate].plan.launches)
                       for i in method.instructions if i.kind == InstrKind.DELEGATE)
        return _Sized(method, env, steps, launches)

    def _sized(self, key: tuple) -> "_Sized":
        sized = self._sizes.get(key)
        if sized is None:  # the first call at this size: evaluate its sizes once
            env = {s.name: v for s, v in zip(self.method.symbols, key)}
            specialized = specialize(self.method, env)
            verify_launches(specialized)  # every launch at exactly this size
            sized = self._sizes[key] = self._prepare(specialized)
        return sized

    def device_bytes(self) -> dict[str, int]:
        """Device memory this method holds itself (arenas, staging buffers), by device."""
        return dict(self._device_bytes)

    def release(self) -> None:
        """Give every buffer allocated at load back to its allocator (``LoadedProgram.close()`` calls
        this, holding the program's lock); the method runs no more calls."""
        for device, buffer in self._held:
            self._allocators[device][0].free(buffer)
        self._held.clear()
        self._arenas.clear()
        self._sizes.clear()  # the steps and environments that view the buffers
        self._device_bytes.clear()

    # -- load helpers ---------------------------------------------------------------------------
    def _alloc(self, device: str, nbytes: int, alignment: int = DEVICE_ALIGNMENT) -> torch.Tensor:
        """A buffer the method holds for its life (released by :meth:`release`)."""
        allocator, index = self._allocators[device]
        buffer = allocate(allocator, nbytes, index, alignment, f"method {self.name!r}")
        self._device_bytes[device] = self._device_bytes.get(device, 0) + nbytes
        self._held.append((device, buffer))
        return buffer

    def _arena_view(self, arena: int, offset: int, value) -> torch.Tensor:
        buffer = self._arenas[arena]
        if offset + value.nbytes > buffer.numel():
            raise ProgramError(f"value {value.name!r} at arena offset {offset} overruns its {buffer.numel()}-byte arena")
        return buffer[offset : offset + value.nbytes].view(parse_dtype(value.dtype)).view(value.shape)

    def _delegate(self, method: Method, instr, graphs: bool) -> "_DelegateStep":
        delegate = method.delegates[instr.delegate]
        allocator, index = self._allocators[delegate.device]
        step = _DelegateStep(instr.inputs, instr.outputs, allocator, index)
        if delegate.stage_inputs:
            scratch = self._alloc(delegate.device, delegate.plan.scratch_bytes)
            step.staging_in = [self._device_tensor(method.values[v], delegate.device) for v in instr.inputs]
            step.staging_out = [self._device_tensor(method.values[v], delegate.device) for v in instr.outputs]
        else:
            scratch = None
            if delegate.plan.scratch_bytes:
                scratch = self._arenas[delegate.scratch_arena][
                    delegate.scratch_offset : delegate.scratch_offset + delegate.plan.scratch_bytes]
            # Fixed addresses for everything it touches: its launches can be captured once.
            step.capturable = graphs and all(
                method.values[v].arena >= 0 or method.values[v].slot >= 0 for v in instr.inputs + instr.outputs)
        step.runner = DelegateRunner(delegate.plan, scratch, simulated=allocator.simulated, null=allocator.null,
                                     direct=not allocator.host_memory and self.direct_launches)
        fixed = lambda vids: [delegate.stage_inputs or method.values[v].arena >= 0  # noqa: E731
                              or method.values[v].slot >= 0 for v in vids]
        step.runner.fixed(fixed(instr.inputs), fixed(instr.outputs))
        return step

    def _device_tensor(self, value, device: str | None = None) -> torch.Tensor:
        buffer = self._alloc(device or value.device, value.nbytes)
        return buffer.view(parse_dtype(value.dtype)).view(value.shape)

    def _call_tensor(self, value) -> torch.Tensor:
        """Fresh device memory for one call's unplanned value (``alloc_graph_input/output=False``): the
        call's, or the caller's once returned; the method does not hold it."""
        allocator, index = self._allocators[value.device]
        buffer = allocate(allocator, value.nbytes, index, DEVICE_ALIGNMENT, f"method {self.name!r}")
        return buffer.view(parse_dtype(value.dtype)).view(value.shape)

    @property
    def input_keywords(self) -> tuple[str, ...]:
        """The inputs the method takes by keyword (it was exported with them as keywords), in order."""
        return self._inputs.keywords

    # -- calls ----------------------------------------------------------------------------------
    def __call__(self, *args, stream=None, **kwargs):
        inputs, key = self._inputs.check(args, kwargs)
        with self._memory.lock:  # one call at a time per loaded program: its state is shared
            self._memory.check_open(f"method {self.name!r}")
            try:
                sized = self._sized(key)
            except _PASS_THROUGH:
                raise
            except Exception as exc:  # the inputs were checked: what fails now is the program's fault
                raise _failure(self.name, f"preparing the size {key}", exc) from exc
            env = list(sized.env)
            for vid, t in zip(self.method.inputs, inputs):
                env[vid] = t
            counts = _Counts()
            pending: set = set()  # devices with d2h copies the host has not waited for
            values = sized.method.values
            for j, (kind, step) in enumerate(sized.steps):
                try:
                    if kind == InstrKind.HOST_OP:
                        self._wait(pending, stream, counts)
                        step(env)
                    elif kind == InstrKind.DELEGATE:
                        for vid in step.outputs:
                            if env[vid] is None and step.staging_out is None:  # alloc_graph_output=False
                                env[vid] = self._call_tensor(values[vid])
                        step(env, stream, counts)
                    else:
                        self._copy(values, kind, step, env, stream, counts, pending)
                except _PASS_THROUGH:
                    raise
                except Exception as exc:
                    raise _failure(self.name, f"instruction {j} ({sized.method.instructions[j].name!r})", exc) from exc
            try:
                outputs = self._finish(values, env, stream, counts, pending)
            except _PASS_THROUGH:
                raise
            except Exception as exc:
                raise _failure(self.name, "writing state and outputs", exc) from exc
            self.stats.launches_per_call = sized.launches
            self._record(counts)
        return pytree.tree_unflatten(outputs, self._out_spec)

    def _wait(self, pending: set, stream, counts: "_Counts") -> None:
        for device in pending:
            allocator, index = self._allocators[device]
            allocator.synchronize(index, allocator.stream(index, stream))
            counts.syncs += 1
        pending.clear()

    def _copy(self, values, kind, step, env, stream, counts: "_Counts", pending: set) -> None:
        src, dst = step
        value = values[dst]
        if kind == InstrKind.COPY_H2D:
            allocator, index = self._allocators[value.device]
            if env[dst] is None:  # not planned (alloc_graph_input=False): fresh memory
                env[dst] = self._call_tensor(value)
            allocator.copy_host_to_device(env[dst], env[src].contiguous(), allocator.stream(index, stream))
            counts.h2d += value.nbytes
        else:  # COPY_D2H
            device = values[src].device
            allocator, index = self._allocators[device]
            env[dst] = torch.empty(value.shape, dtype=parse_dtype(value.dtype), pin_memory=False)
            allocator.copy_device_to_host(env[dst], env[src], allocator.stream(index, stream))
            pending.add(device)
            counts.d2h += value.nbytes
        counts.copies += 1

    def _finish(self, values, env, stream, counts: "_Counts", pending: set) -> list:
        """Write state back (where it was not updated in place) and make the outputs the caller's."""
        outputs = [env[v] for v in self.method.outputs]
        host_writes = any(values[b].device == "cpu" for b, _ in self.method.mutated_buffers)
        if host_writes or any(values[v].device == "cpu" for v in self.method.outputs):
            self._wait(pending, stream, counts)
        for buffer_vid, new_vid in self.method.mutated_buffers:
            device = values[buffer_vid].device
            if device == "cpu":
                env[buffer_vid].copy_(env[new_vid])
            else:  # on the state's own device, after every reader of the old value
                allocator, index = self._allocators[device]
                allocator.copy_device_to_device(env[buffer_vid], env[new_vid], allocator.stream(index, stream))
                counts.d2d += values[buffer_vid].nbytes
        for i, vid in enumerate(self.method.outputs):
            value = values[vid]
            if value.role in (Role.CONSTANT, Role.MUTABLE_BUFFER) or (
                value.arena >= 0 and not self.reuse_output_memory
            ):
                # Never hand out memory that the method owns and will change (arena, state, file).
                outputs[i] = self._fresh_copy(outputs[i], value.device, stream)
        return outputs

    def _record(self, counts: "_Counts") -> None:
        stats = self.stats
        stats.calls += 1
        stats.launches += stats.launches_per_call
        stats.call_h2d_bytes, stats.call_d2h_bytes, stats.call_copies = counts.h2d, counts.d2h, counts.copies
        stats.call_d2d_bytes = counts.d2d
        stats.synchronizations_per_call = counts.syncs
        stats.graph_replays_per_call = counts.replays

    def _fresh_copy(self, tensor: torch.Tensor, device: str, stream) -> torch.Tensor:
        """A copy the caller owns, made on the caller's stream (no synchronization)."""
        if device == "cpu" or self._allocators[device][0].host_memory:
            return tensor.clone()
        allocator, index = self._allocators[device]
        s = allocator.stream(index, stream)
        with torch.cuda.stream(s):
            copy = tensor.clone()
        return copy


# Errors a call passes on as they are: the file's (already a ProgramError) and the machine's (memory).
_PASS_THROUGH = (ProgramError, MemoryError, torch.cuda.OutOfMemoryError)


def _failure(method: str, where: str, exc: Exception) -> ProgramError:
    """A call that fails after its inputs were checked fails by the program's doing (an op given
    arguments it refuses, tensors of the wrong size): a ProgramError naming what failed."""
    return ProgramError(f"method {method!r}: {where} failed with {type(exc).__name__}: {exc} (the inputs were "
                        "valid: the program is inconsistent)")


@dataclass
class _Sized:
    """What calls at one size run: the method made concrete for it (``sized.py``; the method itself
    when it has no symbols), its environment of fixed tensors, and its steps."""

    method: Method
    env: list
    steps: list
    launches: int


@dataclass
class _Counts:
    h2d: int = 0
    d2h: int = 0
    d2d: int = 0
    copies: int = 0
    syncs: int = 0
    replays: int = 0


class _DelegateStep:
    """One delegate call: launches on the caller's stream, staged through host copies when the
    program was lowered without device memory planning, replayed from a captured graph when asked."""

    def __init__(self, inputs: list[int], outputs: list[int], allocator, index: int):
        self.inputs, self.outputs = inputs, outputs
        self.allocator, self.index = allocator, index
        self.runner = None
        self.staging_in = self.staging_out = None
        self.capturable = False
        self._replay = None
        self._warm = False

    def _launch(self, ins, outs, stream, counts) -> None:
        if self._replay is not None:
            self._replay(stream)
            counts.replays += 1
            return
        if self.allocator.host_memory:
            self.runner(ins, outs)
        else:
            with torch.cuda.stream(self.allocator.stream(self.index, stream)):
                self.runner(ins, outs)
        if self.capturable:
            if self._warm:  # the second call: every kernel is compiled, record them
                from .graphs import capture

                self._replay = capture(self.runner, ins, outs, self.allocator, self.index)
            self._warm = True

    def __call__(self, env, stream, counts: _Counts) -> None:
        if self.staging_in is None:
            self._launch([env[v] for v in self.inputs], [env[v] for v in self.outputs], stream, counts)
            return
        allocator, s = self.allocator, self.allocator.stream(self.index, stream)
        for vid, buf in zip(self.inputs, self.staging_in):
            allocator.copy_host_to_device(buf, env[vid].contiguous(), s)
            counts.h2d += buf.numel() * buf.element_size()
            counts.copies += 1
        self._launch(self.staging_in, self.staging_out, stream, counts)
        for vid, buf in zip(self.outputs, self.staging_out):
            env[vid] = torch.empty_like(buf, device="cpu")
            allocator.copy_device_to_host(env[vid], buf, s)
            counts.d2h += buf.numel() * buf.element_size()
            counts.copies += 1
        allocator.synchronize(self.index, s)
        counts.syncs += 1
