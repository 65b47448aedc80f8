"""A loaded method: arenas allocated and resident constants filled once; calls run instructions.

Calls run host ops through ATen on the CPU, copies through the device allocator, and delegates as
Triton launches on views of the arena, all on the caller's stream. A call allocates no device memory
for planned values and synchronizes only where the host must read device data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from .._device import parse_device
from ..program import ArgKind, InstrKind, Method, ProgramError, Role
from .allocator import AllocatorError, DeviceAllocator
from .delegate import DelegateRunner, _dtype


class InputError(ValueError):
    """A call's inputs do not match the method (names the input)."""


@dataclass
class MethodStats:
    """What the method copied and launched. ``call_*`` describe the last call."""

    load_h2d_bytes: int = 0
    load_copies: int = 0
    call_h2d_bytes: int = 0
    call_d2h_bytes: int = 0
    call_copies: int = 0
    calls: int = 0
    launches_per_call: int = 0
    launches: int = 0  # all calls together
    synchronizations_per_call: int = 0
    graph_replays_per_call: int = 0  # delegates replayed from a captured graph (graphs=True)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _parse_device(device: str) -> tuple[str, int]:
    """A device string read from a program file; a malformed one is the file's fault."""
    try:
        return tuple(parse_device(device))
    except ValueError as exc:
        raise ProgramError(f"bad device {device!r} in the program: {exc}") from exc


def resolve_op(target: str):
    """``"aten::add.Tensor"`` -> ``torch.ops.aten.add.Tensor``."""
    namespace, _, rest = target.partition("::")
    if namespace != "aten":  # programs only ever hold ATen host ops; refuse anything else from a file
        raise ProgramError(f"host op {target!r} is not an ATen operator")
    try:
        name, _, overload = rest.partition(".")
        return getattr(getattr(torch.ops.aten, name), overload or "default")
    except (AttributeError, RuntimeError) as exc:
        raise ProgramError(f"host op {target!r} is not an operator this PyTorch knows") from exc


_SCALAR_DECODERS = {
    ArgKind.NONE: lambda v: None,
    ArgKind.INT: int,
    ArgKind.FLOAT: float,
    ArgKind.BOOL: bool,
    ArgKind.STR: str,
    ArgKind.INT_LIST: list,
    ArgKind.FLOAT_LIST: list,
    ArgKind.BOOL_LIST: list,
    ArgKind.DTYPE: _dtype,
    ArgKind.DEVICE: torch.device,
    ArgKind.MEMORY_FORMAT: lambda v: getattr(torch, v),
    ArgKind.LAYOUT: lambda v: getattr(torch, v),
}


class _HostOp:
    def __init__(self, instr):
        self.op = resolve_op(instr.target)
        self.outputs = instr.outputs
        self.args, self.kwargs = [], {}
        for arg in instr.args:
            if arg.kind == ArgKind.TENSOR:
                value = ("t", arg.value)
            elif arg.kind == ArgKind.TENSOR_LIST:
                value = ("l", list(arg.value))
            else:
                value = ("c", _SCALAR_DECODERS[arg.kind](arg.value))
            if arg.name:
                self.kwargs[arg.name] = value
            else:
                self.args.append(value)

    @staticmethod
    def _get(env, value):
        kind, v = value
        if kind == "t":
            return env[v]
        if kind == "l":
            return [None if i < 0 else env[i] for i in v]
        return v

    def __call__(self, env):
        result = self.op(*[self._get(env, a) for a in self.args],
                         **{k: self._get(env, v) for k, v in self.kwargs.items()})
        if len(self.outputs) == 1:
            env[self.outputs[0]] = result
        else:
            for vid, r in zip(self.outputs, result):
                if vid >= 0:
                    env[vid] = r


class LoadedMethod:
    """Call it like the exported model: ``outputs = method(*args, stream=None)``."""

    def __init__(self, method: Method, source, allocators: dict[str, DeviceAllocator], stream=None,
                 reuse_output_memory: bool = False, graphs: bool = False):
        self.name = method.name
        self.graphs = graphs
        self.method = method
        self.stats = MethodStats()
        self.reuse_output_memory = reuse_output_memory
        self._in_spec = pytree.treespec_loads(method.input_spec)
        self._out_spec = pytree.treespec_loads(method.output_spec)
        self._allocators = {}
        devices = {v.device for v in method.values} | {d.device for d in method.delegates} | {a.device for a in method.arenas}
        for device in sorted(devices - {"cpu"}):
            kind, index = _parse_device(device)
            if kind not in allocators:
                raise AllocatorError(
                    f"method {method.name!r} runs on {device}, but no allocator is registered for device type "
                    f"{kind!r}; load with devices='auto', 'cuda' or 'simulated', or pass a DeviceAllocator for {kind!r}"
                )
            self._allocators[device] = (allocators[kind], index)
        self._arenas = [self._alloc(a.device, a.nbytes, a.alignment) for a in method.arenas]
        env: list = [None] * len(method.values)
        self._state: dict[int, torch.Tensor] = {}
        load_streams: dict[str, object] = {}
        for vid, value in enumerate(method.values):
            if value.arena >= 0:
                env[vid] = self._arena_view(value.arena, value.arena_offset, value)
            if value.role == Role.CONSTANT and not value.resident:
                env[vid] = source.constant_tensor(value.constant)
            elif value.role == Role.MUTABLE_BUFFER:
                self._state[vid] = source.constant_tensor(value.constant).clone()
                env[vid] = self._state[vid]
            elif value.resident:
                if value.nbytes:  # empty tensors load without a copy
                    allocator, index = self._allocators[value.device]
                    s = load_streams.setdefault(value.device, allocator.stream(index, stream))
                    allocator.copy_from_host(env[vid], source.constant_tensor(value.constant), s)
                    self.stats.load_h2d_bytes += value.nbytes
                    self.stats.load_copies += 1
        for device, s in load_streams.items():  # once per device, waiting for the copy stream only
            allocator, index = self._allocators[device]
            allocator.synchronize(index, s)
        self._static_env = env
        self._steps = []
        for instr in method.instructions:
            if instr.kind == InstrKind.HOST_OP:
                self._steps.append((instr.kind, _HostOp(instr)))
            elif instr.kind == InstrKind.DELEGATE:
                self._steps.append((instr.kind, self._delegate(method, instr)))
            else:
                self._steps.append((instr.kind, (instr.inputs[0], instr.outputs[0])))
        self.stats.launches_per_call = sum(
            len(method.delegates[i.delegate].plan.launches) for i in method.instructions if i.kind == InstrKind.DELEGATE
        )

    # -- load helpers ---------------------------------------------------------------------------
    def _alloc(self, device: str, nbytes: int, alignment: int = 256) -> torch.Tensor:
        allocator, index = self._allocators[device]
        return allocator.allocate(nbytes, index, alignment)

    def _arena_view(self, arena: int, offset: int, value) -> torch.Tensor:
        buffer = self._arenas[arena]
        if offset + value.nbytes > buffer.numel():
            raise ProgramError(f"value {value.name!r} at arena offset {offset} overruns its {buffer.numel()}-byte arena")
        return buffer[offset : offset + value.nbytes].view(_dtype(value.dtype)).view(value.shape)

    def _delegate(self, method: Method, instr) -> "_DelegateStep":
        delegate = method.delegates[instr.delegate]
        allocator, index = self._allocators[delegate.device]
        step = _DelegateStep(instr.inputs, instr.outputs, allocator, index)
        if delegate.stage_inputs:
            scratch = allocator.allocate(delegate.plan.scratch_bytes, index, 256)
            step.staging_in = [self._device_tensor(method.values[v], delegate.device) for v in instr.inputs]
            step.staging_out = [self._device_tensor(method.values[v], delegate.device) for v in instr.outputs]
        else:
            scratch = None
            if delegate.plan.scratch_bytes:
                scratch = self._arenas[delegate.scratch_arena][
                    delegate.scratch_offset : delegate.scratch_offset + delegate.plan.scratch_bytes]
            # Fixed addresses for everything it touches: its launches can be captured once.
            step.capturable = self.graphs and all(method.values[v].arena >= 0 for v in instr.inputs + instr.outputs)
        step.runner = DelegateRunner(delegate.plan, scratch, simulated=allocator.simulated)
        return step

    def _device_tensor(self, value, device: str | None = None) -> torch.Tensor:
        buffer = self._alloc(device or value.device, value.nbytes)
        return buffer.view(_dtype(value.dtype)).view(value.shape)

    # -- calls ----------------------------------------------------------------------------------
    def _check_inputs(self, args, kwargs) -> list:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise InputError(
                f"method {self.name!r} takes {len(self.method.inputs)} tensor input(s) structured as the "
                f"exported example inputs; got {len(flat)} leaf value(s) with another structure"
            )
        out = []
        for i, (vid, t) in enumerate(zip(self.method.inputs, flat)):
            value = self.method.values[vid]
            where = f"input {i} ({value.name!r}) of method {self.name!r}"
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{where} must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != value.shape:
                raise InputError(f"{where} must have shape {list(value.shape)}, got {list(t.shape)}")
            if t.dtype != _dtype(value.dtype):
                raise InputError(f"{where} must have dtype {value.dtype}, got {str(t.dtype).removeprefix('torch.')}")
            if value.device == "cpu" or self._allocators[value.device][0].simulated:
                if t.device.type != "cpu":
                    raise InputError(f"{where} must be a CPU tensor, got one on {t.device}")
            else:
                kind, index = _parse_device(value.device)
                if t.device != torch.device(kind, index):
                    raise InputError(f"{where} must be on {value.device} (skip_h2d_for_method_inputs), got {t.device}")
            if value.device != "cpu" and not t.is_contiguous():
                raise InputError(f"{where} is read in place on {value.device} and must be contiguous")
            out.append(t)
        return out

    def __call__(self, *args, stream=None, **kwargs):
        inputs = self._check_inputs(args, kwargs)
        env = list(self._static_env)
        for vid, t in zip(self.method.inputs, inputs):
            env[vid] = t
        values = self.method.values
        counts = _Counts()
        pending: set = set()  # devices with d2h copies the host has not waited for
        for kind, step in self._steps:
            if kind == InstrKind.HOST_OP:
                for device in pending:
                    allocator, index = self._allocators[device]
                    allocator.synchronize(index, allocator.stream(index, stream))
                    counts.syncs += 1
                pending.clear()
                step(env)
            elif kind == InstrKind.DELEGATE:
                for vid in step.outputs:
                    if env[vid] is None and step.staging_out is None:  # alloc_graph_output=False
                        env[vid] = self._device_tensor(values[vid])
                step(env, stream, counts)
            else:
                src, dst = step
                value = values[dst]
                if kind == InstrKind.COPY_H2D:
                    allocator, index = self._allocators[value.device]
                    if env[dst] is None:  # not planned (alloc_graph_input=False): fresh memory
                        env[dst] = self._device_tensor(value)
                    allocator.copy_host_to_device(env[dst], env[src].contiguous(), allocator.stream(index, stream))
                    counts.h2d += value.nbytes
                else:
                    device = values[src].device
                    allocator, index = self._allocators[device]
                    env[dst] = torch.empty(value.shape, dtype=_dtype(value.dtype), pin_memory=False)
                    allocator.copy_device_to_host(env[dst], env[src], allocator.stream(index, stream))
                    pending.add(device)
                    counts.d2h += value.nbytes
                counts.copies += 1
        outputs = [env[v] for v in self.method.outputs]
        if any(values[v].device == "cpu" for v in self.method.outputs) or self.method.mutated_buffers:
            for device in pending:
                allocator, index = self._allocators[device]
                allocator.synchronize(index, allocator.stream(index, stream))
                counts.syncs += 1
        for buffer_vid, new_vid in self.method.mutated_buffers:
            self._state[buffer_vid].copy_(env[new_vid])
        for i, vid in enumerate(self.method.outputs):
            value = values[vid]
            if value.role in (Role.CONSTANT, Role.MUTABLE_BUFFER) or (
                value.arena >= 0 and not self.reuse_output_memory
            ):
                # Never hand out memory that the method owns and will change (arena, state, file).
                outputs[i] = self._fresh_copy(outputs[i], value.device, stream)
        stats = self.stats
        stats.calls += 1
        stats.launches += stats.launches_per_call
        stats.call_h2d_bytes, stats.call_d2h_bytes, stats.call_copies = counts.h2d, counts.d2h, counts.copies
        stats.synchronizations_per_call = counts.syncs
        stats.graph_replays_per_call = counts.replays
        return pytree.tree_unflatten(outputs, self._out_spec)

    def _fresh_copy(self, tensor: torch.Tensor, device: str, stream) -> torch.Tensor:
        """A copy the caller owns, made on the caller's stream (no synchronization)."""
        if device == "cpu" or self._allocators[device][0].simulated:
            return tensor.clone()
        allocator, index = self._allocators[device]
        s = allocator.stream(index, stream)
        with torch.cuda.stream(s):
            copy = tensor.clone()
        return copy


@dataclass
class _Counts:
    h2d: int = 0
    d2h: int = 0
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
        if self.allocator.simulated:
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
