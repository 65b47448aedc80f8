"""A loaded method: its arenas allocated and its resident constants loaded once (into the program's
segments, shared with the program's other methods); calls run instructions.

Calls run host ops through ATen on the CPU, copies through the device allocator, and delegates as
Triton launches on views of the arena, all on the caller's stream. A call allocates no device memory
for planned values and synchronizes only where the host must read device data.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ..program import ArgKind, InstrKind, Method, ProgramError, Role
from ..symbolic import resolve
from .delegate import DelegateRunner, _dtype
from .memory import ProgramMemory, allocate, parse_program_device
from .sized import specialize
from .verify import verify_launches, verify_method

# A method with dynamic dimensions captures CUDA graphs (``graphs=True``) for the first this many
# distinct sizes it is called with; calls at other sizes run plain (prebound, direct) launches.
MAX_GRAPH_SIZES = 8


RETURN_TYPES = "torch.return_types."  # a tuple node with this context prefix: a torch named tuple (emit.py)


def output_structure(text: str, name: str) -> pytree.TreeSpec:
    """The method's output pytree spec. A tuple node whose context names a ``torch.return_types``
    class (what ``torch.max(x, 1)`` returns, which pytree cannot serialize) becomes that class again."""
    def rebuild(spec):
        if spec.is_leaf():
            return spec
        children = [rebuild(c) for c in spec.children()]
        context = spec.context
        if spec.type is tuple and isinstance(context, str):
            cls = getattr(torch.return_types, context.removeprefix(RETURN_TYPES), None)
            if not context.startswith(RETURN_TYPES) or cls not in torch.return_types.all_return_types:
                raise ProgramError(f"method {name!r}: output structure names an unknown type {context!r}")
            return pytree.TreeSpec(cls, None, children)
        return pytree.TreeSpec(spec.type, context, children)

    return rebuild(pytree.treespec_loads(text))


class InputError(ValueError):
    """A call's inputs do not match the method (names the input)."""


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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def resolve_op(target: str):
    """``"aten::add.Tensor"`` -> ``torch.ops.aten.add.Tensor``; ``"tritondelegate::rotary"`` -> the op
    ``tritondelegate/ops.py`` defines (a fused op left on the host, run by its reference implementation)."""
    namespace, _, rest = target.partition("::")
    if namespace == "tritondelegate":
        from .. import ops

        op = ops.OPS.get(target.removesuffix(".default"))
        if op is None:
            raise ProgramError(f"host op {target!r} is not an operator tritondelegate/ops.py defines")
        return op
    if namespace != "aten":  # programs only hold ATen and tritondelegate host ops; refuse anything else
        raise ProgramError(f"host op {target!r} is not an ATen operator")
    name, _, overload = rest.partition(".")
    overload = overload or "default"
    # Only a name the dispatcher registers is looked up: no attribute of anything else is ever reached.
    registered = f"aten::{name}" + ("" if overload == "default" else f".{overload}")
    if not (_IDENTIFIER.fullmatch(name) and _IDENTIFIER.fullmatch(overload)) or registered not in _dispatcher_ops():
        raise ProgramError(f"host op {target!r} is not an operator this PyTorch knows")
    op = getattr(getattr(torch.ops.aten, name, None), overload, None)
    if not isinstance(op, torch._ops.OpOverload):
        raise ProgramError(f"host op {target!r} is not an operator this PyTorch knows")
    refusal = _refusal(op)
    if refusal:
        raise ProgramError(f"host op {target!r} is not allowed in a program: {refusal}")
    return op


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FILE_ARGUMENT = re.compile(r"file|path|dir")  # a str argument with such a name names a file


@functools.lru_cache(maxsize=None)
def _dispatcher_ops() -> frozenset:
    return frozenset(torch._C._dispatch_get_all_op_names())


def _refusal(op: torch._ops.OpOverload) -> str | None:
    """Why an ATen op may not run from a program file, read from its schema: it takes a file name
    (``from_file``), or it returns nothing and writes none of its arguments, so it exists for an effect
    outside its tensors (printing, process-wide settings)."""
    schema = op._schema
    for arg in schema.arguments:
        if "str" in str(arg.type) and _FILE_ARGUMENT.search(arg.name):
            return f"it takes a file name (argument {arg.name!r})"
    if not schema.returns and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "it returns nothing and writes no tensor: it acts on the process, not on tensors"
    return None


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
    def __init__(self, instr, values):
        self.op = resolve_op(instr.target)
        self.outputs = instr.outputs
        self.dtypes = [_dtype(values[vid].dtype) if vid >= 0 else None for vid in instr.outputs]
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
        results = [result] if len(self.outputs) == 1 else result
        for vid, r, dtype in zip(self.outputs, results, self.dtypes):
            if vid >= 0:  # an ATen kernel that disagrees with its own meta function (fp16 batch norm's
                # running statistics): the program's declared dtype, what every later step expects
                env[vid] = r.to(dtype) if dtype is not None and r.dtype != dtype else r


class LoadedMethod:
    """Call it like the exported model: ``outputs = method(*args, stream=None)``.

    Calls on methods of one loaded program are serialized (they share its state)."""

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
        self._in_spec = pytree.treespec_loads(method.input_spec)
        self._out_spec = output_structure(method.output_spec, method.name)
        devices = {v.device for v in method.values} | {d.device for d in method.delegates} | {a.device for a in method.arenas}
        self._allocators = {d: memory.device(d, f"method {method.name!r}") for d in sorted(devices - {"cpu"})}
        self._device_bytes: dict[str, int] = {}
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
                steps.append((instr.kind, _HostOp(instr, method.values)))
            elif instr.kind == InstrKind.DELEGATE:
                steps.append((instr.kind, self._delegate(method, instr, graphs)))
            else:
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

    # -- load helpers ---------------------------------------------------------------------------
    def _alloc(self, device: str, nbytes: int, alignment: int = 256) -> torch.Tensor:
        allocator, index = self._allocators[device]
        self._device_bytes[device] = self._device_bytes.get(device, 0) + nbytes
        return allocate(allocator, nbytes, index, alignment, f"method {self.name!r}")

    def _arena_view(self, arena: int, offset: int, value) -> torch.Tensor:
        buffer = self._arenas[arena]
        if offset + value.nbytes > buffer.numel():
            raise ProgramError(f"value {value.name!r} at arena offset {offset} overruns its {buffer.numel()}-byte arena")
        return buffer[offset : offset + value.nbytes].view(_dtype(value.dtype)).view(value.shape)

    def _delegate(self, method: Method, instr, graphs: bool) -> "_DelegateStep":
        delegate = method.delegates[instr.delegate]
        allocator, index = self._allocators[delegate.device]
        step = _DelegateStep(instr.inputs, instr.outputs, allocator, index)
        if delegate.stage_inputs:
            scratch = self._alloc(delegate.device, delegate.plan.scratch_bytes, 256)
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
        return buffer.view(_dtype(value.dtype)).view(value.shape)

    # -- calls ----------------------------------------------------------------------------------
    def _check_inputs(self, args, kwargs) -> tuple[list, tuple]:
        """The call's input tensors, checked, and the values of the method's symbols."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise InputError(
                f"method {self.name!r} takes {len(self.method.inputs)} tensor input(s) structured as the "
                f"exported example inputs; got {len(flat)} leaf value(s) with another structure"
            )
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{self._where(i)} must be a tensor, got {type(t).__name__}")
        key = self._bind_symbols(flat)
        env = {s.name: v for s, v in zip(self.method.symbols, key)}
        for i, (vid, t) in enumerate(zip(self.method.inputs, flat)):
            value = self.method.values[vid]
            where = self._where(i)
            shape = resolve(tuple(value.shape), env) if env else tuple(value.shape)
            if tuple(t.shape) != shape:
                raise InputError(f"{where} must have shape {list(shape)}{self._shape_note(value)}, got {list(t.shape)}")
            if t.dtype != _dtype(value.dtype):
                raise InputError(f"{where} must have dtype {value.dtype}, got {str(t.dtype).removeprefix('torch.')}")
            if value.device == "cpu" or self._allocators[value.device][0].host_memory:
                if t.device.type != "cpu":
                    raise InputError(f"{where} must be a CPU tensor, got one on {t.device}")
            else:
                kind, index = parse_program_device(value.device)
                if t.device != torch.device(kind, index):
                    raise InputError(f"{where} must be on {value.device} (skip_h2d_for_method_inputs), got {t.device}")
            if value.device != "cpu" and not t.is_contiguous():
                raise InputError(f"{where} is read in place on {value.device} and must be contiguous")
        return flat, key

    def _where(self, i: int) -> str:
        return f"input {i} ({self.method.values[self.method.inputs[i]].name!r}) of method {self.name!r}"

    def _shape_note(self, value) -> str:
        dims = [str(d) for d in value.shape if not isinstance(d, int)]
        return f" (dims {', '.join(dims)} from the dynamic dimensions)" if dims else ""

    def _bind_symbols(self, flat: list) -> tuple:
        """Each symbol's value from the input dimension it is bound to, checked against its range."""
        key = []
        for symbol in self.method.symbols:
            t = flat[symbol.input]
            where = f"{self._where(symbol.input)} dimension {symbol.dim}"
            if t.dim() <= symbol.dim:
                raise InputError(f"{where} is dynamic, but the input has only {t.dim()} dimension(s)")
            n = int(t.shape[symbol.dim])
            if not symbol.min <= n <= symbol.max:
                raise InputError(f"{where} is {n}, outside its range {symbol.min}..{symbol.max} "
                                 f"(the bound it was exported and planned with)")
            key.append(n)
        return tuple(key)

    def __call__(self, *args, stream=None, **kwargs):
        inputs, key = self._check_inputs(args, kwargs)
        with self._memory.lock:  # one call at a time per loaded program: its state is shared
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
                                env[vid] = self._device_tensor(values[vid])
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
