"""Writes a :class:`~tritondelegate.program.Program` as a program file (layout: ``header.py``).

The program's structure goes into one flatbuffer (``program.fbs``); the bytes of each in-file
constant go, once, into the aligned data segment after it; constants with ``external >= 0`` go into
safetensors files next to the program file instead, keyed by their fully-qualified name.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import zlib
from collections.abc import Sequence

import flatbuffers
import torch
from safetensors.torch import save_file

from ..plan import Arg, Base, DelegatePlan, Launch, TensorDesc
from ..plan import ArgKind as KArgKind
from ..program import (FORMAT_VERSION, ArgKind, Constant, HostArg, InstrKind, Instruction, Method, Program, Role,
                       SegmentKind, Symbol)
from ..symbolic import Expr
from . import header as hdr
from .generated import program_generated as fb
from .validate import external_name_problem

_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_UINT32 = (0, 2**32 - 1)
_UINT64 = (0, 2**64 - 1)


def save_program(program: Program, constant_data: Sequence[torch.Tensor], path,
                 binary_data: Sequence[bytes] = ()) -> list[str]:
    """Writes ``program`` to ``path`` and its external constants next to it; returns the files written.

    ``constant_data[i]`` holds the bytes of ``program.constants[i]`` (any device; its dtype and shape
    must match the constant). The writer chooses every in-file ``Constant.data_offset`` (the value in
    ``program`` is ignored, and ``program`` is not modified); external constants get ``data_offset`` 0.
    It records each constant's checksum (``header.checksum`` of the bytes written; ignored in ``program``).
    Each name in ``program.external_files`` is a path relative to the program file's directory and is
    written as a safetensors file holding the constants that name it, keyed by ``Constant.name``.
    ``binary_data[i]`` holds the bytes of ``program.binaries[i]`` (kernel binaries), stored after the
    constants in the data segment.
    The program file is written to a temporary name and renamed, so a failed save leaves no
    half-written program behind.
    """
    path = os.fspath(path)
    if program.version != FORMAT_VERSION:
        raise ValueError(f"program version {program.version} cannot be written; this writer writes "
                         f"version {FORMAT_VERSION}")
    if len(constant_data) != len(program.constants):
        raise ValueError(f"{len(constant_data)} constant tensors for {len(program.constants)} constants")
    directory = os.path.dirname(os.path.abspath(path))
    external_paths = [_external_path(directory, name, path) for name in program.external_files]

    if len(binary_data) != len(program.binaries):
        raise ValueError(f"{len(binary_data)} kernel binaries' bytes for {len(program.binaries)} binaries")
    constants, data_size = _layout(program)
    binaries, data_size = _layout_binaries(program, binary_data, data_size)
    host = [_host_bytes(c, t, i) for i, (c, t) in enumerate(zip(program.constants, constant_data))]
    constants = [dataclasses.replace(c, checksum=hdr.checksum(data if c.external < 0 else _resolved(data)))
                 for c, data in zip(constants, host)]
    fb_bytes = _finish(_program_t(program, constants, binaries))
    data_off = hdr.align(hdr.FLATBUFFER_OFFSET + len(fb_bytes), hdr.DATA_SEGMENT_ALIGNMENT)
    head = hdr.pack_header(FORMAT_VERSION, len(fb_bytes), data_off, data_size, zlib.crc32(fb_bytes))

    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(fb_bytes)
            f.write(bytes(data_off - f.tell()))
            for c, data in zip(constants, host):
                if c.external < 0 and c.nbytes:
                    f.write(bytes(data_off + c.data_offset - f.tell()))
                    f.write(memoryview(data.numpy()))
            for b, data in zip(binaries, binary_data):
                f.write(bytes(data_off + b.data_offset - f.tell()))
                f.write(data)
            f.write(bytes(max(0, data_off + data_size - f.tell())))  # alignment of a trailing empty constant
            if f.tell() != data_off + data_size:
                raise RuntimeError(f"internal error: wrote {f.tell()} bytes, laid out {data_off + data_size}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

    for file_index, file_path in enumerate(external_paths):
        tensors, storages = {}, set()
        for c, t in zip(constants, constant_data):
            if c.external == file_index:
                t = _resolved(t)
                # safetensors refuses views and tensors that share storage: copy those only
                if t.untyped_storage().nbytes() != t.nbytes or t.untyped_storage().data_ptr() in storages:
                    t = t.clone()
                if t.nbytes:
                    storages.add(t.untyped_storage().data_ptr())
                tensors[c.name] = t
        os.makedirs(os.path.dirname(file_path), exist_ok=True)
        save_file(tensors, file_path, metadata={"format": "pt"})
    return [path, *external_paths]


def _external_path(directory: str, name: str, program_path: str) -> str:
    problem = external_name_problem(name)
    if problem:
        raise ValueError(f"external file name {name!r} {problem}")
    file_path = os.path.join(directory, name)
    if os.path.abspath(file_path) == os.path.abspath(program_path):
        raise ValueError(f"external file {name!r} is the program file itself")
    return file_path


def _host_bytes(c: Constant, t: torch.Tensor, index: int) -> torch.Tensor:
    """The constant's bytes as a contiguous host uint8 tensor, after checking it matches ``c``."""
    what = f"constant {index} ({c.name!r})"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(t).__name__}")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype != c.dtype or tuple(t.shape) != tuple(c.shape):
        raise ValueError(f"{what} is {c.dtype}{list(c.shape)} but its tensor is {dtype}{list(t.shape)}")
    if t.numel() * t.element_size() != c.nbytes:
        raise ValueError(f"{what} records {c.nbytes} bytes; its tensor has {t.numel() * t.element_size()}")
    if c.external >= 0:
        return t  # written by safetensors
    return _resolved(t).reshape(-1).view(torch.uint8)


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, contiguous, with no lazy conjugate or negative bit: the bytes written."""
    return t.detach().cpu().resolve_conj().resolve_neg().contiguous()


def _layout(program: Program) -> tuple[list[Constant], int]:
    """Copies of the constants with their data-segment offsets, and the data segment's size."""
    n_files = len(program.external_files)
    out, cursor, keys = [], 0, set()
    for i, c in enumerate(program.constants):
        if c.external >= n_files or c.external < -1:
            raise ValueError(f"constant {i} ({c.name!r}) names external file {c.external}; the program "
                             f"has {n_files}")
        if c.external >= 0:
            if (c.external, c.name) in keys:
                raise ValueError(f"two constants named {c.name!r} go to external file "
                                 f"{program.external_files[c.external]!r}, where names are keys")
            keys.add((c.external, c.name))
            out.append(Constant(c.name, c.dtype, tuple(c.shape), c.nbytes, 0, c.external))
            continue
        cursor = hdr.align(cursor, hdr.CONSTANT_ALIGNMENT)
        out.append(Constant(c.name, c.dtype, tuple(c.shape), c.nbytes, cursor, -1))
        cursor += c.nbytes
    return out, cursor


# ----------------------------------------------------------------------------------------------
# Program -> flatbuffer, through the generated object API (the *T classes).


def _int(value, where: str, bounds=_INT64) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):  # numpy/torch ints are fine
        raise TypeError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if not bounds[0] <= value <= bounds[1]:
        raise ValueError(f"{where}: {value} is outside [{bounds[0]}, {bounds[1]}]")
    return value


def _ints(values, where: str, bounds=_INT64) -> list[int]:
    return [_int(v, f"{where}[{i}]", bounds) for i, v in enumerate(values)]


def _size(value, where: str) -> tuple[int, str | None]:
    """An int or :class:`Expr` as the format stores it: its bound, and its text (None when concrete)."""
    if isinstance(value, Expr):
        if not isinstance(value.text, str) or not value.text.strip():
            raise ValueError(f"{where}: a size expression without text: {value!r}")
        return _int(value.bound, f"{where} (bound of {value.text!r})"), value.text
    return _int(value, where), None


def _sizes(values, where: str) -> tuple[list[int], list[str] | None]:
    """Ints or :class:`Expr` s: their bounds, and their texts (None, no vector, when all are concrete)."""
    pairs = [_size(v, f"{where}[{i}]") for i, v in enumerate(values)]
    exprs = [text or "" for _, text in pairs]
    return [n for n, _ in pairs], (exprs if any(exprs) else None)


def _i32(value, where: str) -> int:
    return _int(value, where, _INT32)


def _i32s(values, where: str) -> list[int]:
    return _ints(values, where, _INT32)


def _flatbuffer(program: Program, constants: list[Constant]) -> bytes:
    return _finish(_program_t(program, constants))


def _layout_binaries(program: Program, binary_data: Sequence[bytes], cursor: int) -> tuple[list, int]:
    """Copies of the kernel binaries with their data-segment offsets (after ``cursor``), and the end."""
    out = []
    for i, (b, data) in enumerate(zip(program.binaries, binary_data)):
        if not isinstance(data, (bytes, bytearray)) or len(data) != b.nbytes or zlib.crc32(data) != b.checksum:
            raise ValueError(f"kernel binary {i} ({b.kernel!r}, {b.arch}): its bytes do not match its size "
                             "and checksum")
        cursor = hdr.align(cursor, hdr.CONSTANT_ALIGNMENT)
        out.append(dataclasses.replace(b, data_offset=cursor))
        cursor += b.nbytes
    return out, cursor


def _binary_t(b, i: int) -> fb.KernelBinaryT:
    where = f"kernel binary {i} ({b.kernel!r})"
    t = fb.KernelBinaryT()
    for name in ("kernel", "arch", "triton_version", "cache_key", "name", "metadata"):
        setattr(t, "".join(w.capitalize() if j else w for j, w in enumerate(name.split("_"))),
                _str(getattr(b, name), f"{where} {name}"))
    t.dataOffset = _int(b.data_offset, f"{where} data_offset")
    t.nbytes = _int(b.nbytes, f"{where} nbytes")
    t.checksum = _int(b.checksum, f"{where} checksum", _UINT32)
    return t


def _program_t(program: Program, constants: list[Constant], binaries: list | None = None) -> fb.ProgramT:
    p = fb.ProgramT()
    p.binaries = [_binary_t(b, i) for i, b in enumerate(program.binaries if binaries is None else binaries)]
    p.version = _int(program.version, "program version", _UINT32)
    p.methods = [_method(m) for m in program.methods]
    p.constants = [_constant(c, i) for i, c in enumerate(constants)]
    p.externalFiles = [_str(name, f"external file {i}") for i, name in enumerate(program.external_files)]
    p.segments = []
    for i, seg in enumerate(program.segments):
        t = fb.SegmentT()
        t.device = _str(seg.device, f"segment {i} device")
        t.kind = _enum(SegmentKind, seg.kind, f"segment {i} kind")
        t.nbytes = _int(seg.nbytes, f"segment {i} nbytes")
        t.alignment = _int(seg.alignment, f"segment {i} alignment")
        p.segments.append(t)
    p.slots = []
    for i, slot in enumerate(program.slots):
        where = f"slot {i} ({slot.name!r})"
        t = fb.SlotT()
        t.name, t.device = _str(slot.name, where), _str(slot.device, f"{where} device")
        t.constant = _i32(slot.constant, f"{where} constant")
        t.state = _bool(slot.state, f"{where} state")
        t.segment = _i32(slot.segment, f"{where} segment")
        t.offset = _int(slot.offset, f"{where} offset")
        p.slots.append(t)
    return p


def _finish(p: fb.ProgramT) -> bytes:
    builder = flatbuffers.Builder(4096)
    builder.Finish(p.Pack(builder), file_identifier=hdr.FILE_IDENTIFIER)
    return bytes(builder.Output())


def _enum(cls, value, where: str) -> int:
    try:
        return int(cls(value))
    except ValueError:
        raise ValueError(f"{where}: {value!r} is not a {cls.__name__}; valid: "
                         f"{', '.join(m.name for m in cls)}") from None


def _constant(c: Constant, i: int) -> fb.ConstantT:
    where = f"constant {i} ({c.name!r})"
    t = fb.ConstantT()
    t.name, t.dtype = c.name, c.dtype
    t.shape = _ints(c.shape, f"{where} shape")
    t.nbytes = _int(c.nbytes, f"{where} nbytes")
    t.dataOffset = _int(c.data_offset, f"{where} data_offset")
    t.external = _i32(c.external, f"{where} external")
    t.checksum = None if c.checksum is None else _int(c.checksum, f"{where} checksum", _UINT64)
    return t


def _method(m: Method) -> fb.MethodT:
    where = f"method {m.name!r}"
    t = fb.MethodT()
    t.name, t.inputSpec, t.outputSpec = m.name, m.input_spec, m.output_spec
    t.values = []
    for i, v in enumerate(m.values):
        w = f"{where} value {i} ({v.name!r})"
        tv = fb.TensorValueT()
        tv.name, tv.dtype, tv.device = v.name, v.dtype, v.device
        tv.shape, tv.shapeExprs = _sizes(v.shape, f"{w} shape")
        tv.role = _enum(Role, v.role, f"{w} role")
        tv.nbytes = _int(v.nbytes, f"{w} nbytes")
        tv.constant = _i32(v.constant, f"{w} constant")
        tv.arena = _i32(v.arena, f"{w} arena")
        tv.arenaOffset = _int(v.arena_offset, f"{w} arena_offset")
        tv.resident = bool(v.resident)
        tv.slot = _i32(v.slot, f"{w} slot")
        t.values.append(tv)
    t.inputs = _i32s(m.inputs, f"{where} inputs")
    t.outputs = _i32s(m.outputs, f"{where} outputs")
    t.instructions = [_instruction(ins, f"{where} instruction {i} ({ins.name!r})")
                      for i, ins in enumerate(m.instructions)]
    t.delegates = []
    for i, d in enumerate(m.delegates):
        w = f"{where} delegate {i}"
        td = fb.DelegateT()
        td.backendId, td.device = d.backend_id, d.device
        td.plan = _plan(d.plan, w)
        td.scratchArena = _i32(d.scratch_arena, f"{w} scratch_arena")
        td.scratchOffset = _int(d.scratch_offset, f"{w} scratch_offset")
        td.stageInputs = bool(d.stage_inputs)
        t.delegates.append(td)
    t.arenas = []
    for i, a in enumerate(m.arenas):
        ta = fb.ArenaT()
        ta.device = a.device
        ta.nbytes = _int(a.nbytes, f"{where} arena {i} nbytes")
        ta.alignment = _int(a.alignment, f"{where} arena {i} alignment")
        ta.lowerBound = _int(a.lower_bound, f"{where} arena {i} lower_bound")
        t.arenas.append(ta)
    t.mutatedBuffers = []
    for i, (buffer, value) in enumerate(m.mutated_buffers):
        tm = fb.MutatedBufferT()
        tm.buffer = _i32(buffer, f"{where} mutated_buffers[{i}]")
        tm.value = _i32(value, f"{where} mutated_buffers[{i}]")
        t.mutatedBuffers.append(tm)
    t.symbols = [_symbol(s, f"{where} symbol {i}") for i, s in enumerate(m.symbols)] or None
    return t


def _symbol(s: Symbol, where: str) -> fb.SymbolT:
    t = fb.SymbolT()
    t.name = _str(s.name, f"{where} name")
    t.min, t.max = _int(s.min, f"{where} min"), _int(s.max, f"{where} max")
    t.input, t.dim = _i32(s.input, f"{where} input"), _i32(s.dim, f"{where} dim")
    return t


def _instruction(ins: Instruction, where: str) -> fb.InstructionT:
    t = fb.InstructionT()
    t.kind = _enum(InstrKind, ins.kind, f"{where} kind")
    t.inputs = _i32s(ins.inputs, f"{where} inputs")
    t.outputs = _i32s(ins.outputs, f"{where} outputs")
    t.target, t.name = ins.target, ins.name
    t.args = [_host_arg(a, f"{where} arg {i}") for i, a in enumerate(ins.args)]
    t.delegate = _i32(ins.delegate, f"{where} delegate")
    return t


def _host_arg(a: HostArg, where: str) -> fb.HostArgT:
    t = fb.HostArgT()
    kind = ArgKind(_enum(ArgKind, a.kind, f"{where} kind"))
    t.kind, t.name = int(kind), _str(a.name, f"{where} name")
    v = a.value
    if kind == ArgKind.NONE:
        if v is not None:
            raise ValueError(f"{where}: a NONE argument holds {v!r}")
    elif kind in (ArgKind.TENSOR, ArgKind.INT):
        t.ival = _int(v, where)
    elif kind == ArgKind.FLOAT:
        t.fval = _float(v, where)
    elif kind == ArgKind.BOOL:
        t.bval = _bool(v, where)
    elif kind in (ArgKind.STR, ArgKind.DTYPE, ArgKind.DEVICE, ArgKind.MEMORY_FORMAT, ArgKind.LAYOUT):
        t.sval = _str(v, where)
    elif kind == ArgKind.INT_LIST:
        t.ilist = _ints(_list(v, where), where)
    elif kind == ArgKind.FLOAT_LIST:
        t.flist = [_float(x, f"{where}[{i}]") for i, x in enumerate(_list(v, where))]
    elif kind == ArgKind.BOOL_LIST:
        t.blist = [_bool(x, f"{where}[{i}]") for i, x in enumerate(_list(v, where))]
    elif kind == ArgKind.TENSOR_LIST:
        t.tlist = _i32s(_list(v, where), where)
    elif kind == ArgKind.SYM_INT:
        t.ival, t.sexpr = _size(v, where)
    elif kind == ArgKind.SYM_INT_LIST:
        t.ilist, t.slistExprs = _sizes(_list(v, where), where)
    else:  # a new ArgKind member without a case here
        raise RuntimeError(f"internal error: {where}: no encoding for {kind!r}")
    return t


def _plan(plan: DelegatePlan, where: str) -> fb.DelegatePlanT:
    t = fb.DelegatePlanT()
    t.tensors = [_tensor_desc(d, f"{where} tensor {i}") for i, d in enumerate(plan.tensors)]
    t.launches = [_launch(l, f"{where} launch {i} ({l.kernel!r})") for i, l in enumerate(plan.launches)]
    t.scratchBytes = _int(plan.scratch_bytes, f"{where} scratch_bytes")
    t.inputNbytes = _ints(plan.input_nbytes, f"{where} input_nbytes")
    t.outputNbytes = _ints(plan.output_nbytes, f"{where} output_nbytes")
    return t


def _tensor_desc(d: TensorDesc, where: str) -> fb.TensorDescT:
    t = fb.TensorDescT()
    t.base = _enum(Base, d.base, f"{where} base")
    t.index = _i32(d.index, f"{where} index")
    t.byteOffset, t.byteOffsetExpr = _size(d.byte_offset, f"{where} byte_offset")
    t.dtype = d.dtype
    t.shape, t.shapeExprs = _sizes(d.shape, f"{where} shape")
    t.strides, t.stridesExprs = _sizes(d.strides, f"{where} strides")
    return t


def _launch(launch: Launch, where: str) -> fb.LaunchT:
    t = fb.LaunchT()
    t.kernel, t.op = launch.kernel, launch.op
    t.grid, t.gridExprs = _sizes(launch.grid, f"{where} grid")
    t.args = [_kernel_arg(a, f"{where} arg {i}") for i, a in enumerate(launch.args)]
    t.bytesRead = _int(launch.bytes_read, f"{where} bytes_read")
    t.bytesWritten = _int(launch.bytes_written, f"{where} bytes_written")
    t.flops = _int(launch.flops, f"{where} flops")
    t.constexprs = []
    for name, a in launch.constexprs.items():
        n = fb.NamedArgT()
        n.name, n.arg = name, _kernel_arg(a, f"{where} constexpr {name!r}")
        t.constexprs.append(n)
    return t


def _kernel_arg(a: Arg, where: str) -> fb.ArgT:
    t = fb.ArgT()
    kind = KArgKind(_enum(KArgKind, a.kind, f"{where} kind"))
    t.kind = int(kind)
    if kind == KArgKind.TENSOR:
        t.ival = _int(a.value, where)
    elif kind == KArgKind.INT:
        t.ival, t.iexpr = _size(a.value, where)
    elif kind == KArgKind.FLOAT:
        t.fval = _float(a.value, where)
    elif kind == KArgKind.BOOL:
        t.bval = _bool(a.value, where)
    elif kind == KArgKind.STR:
        t.sval = _str(a.value, where)
    else:
        raise RuntimeError(f"internal error: {where}: no encoding for {kind!r}")
    return t


def _float(value, where: str) -> float:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{where}: expected a float, got {type(value).__name__} {value!r}")
    return float(value)


def _bool(value, where: str) -> bool:
    if isinstance(value, bool) or (hasattr(value, "__index__") and operator.index(value) in (0, 1)):
        return bool(value)
    raise TypeError(f"{where}: expected a bool, got {type(value).__name__} {value!r}")


def _str(value, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where}: expected a str, got {type(value).__name__} {value!r}")
    return value


def _list(value, where: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
    return list(value)
