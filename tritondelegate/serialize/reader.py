"""Loads a program file: checks it, decodes its :class:`~tritondelegate.program.Program`, and hands
out its constants as zero-copy views of the mapped file (or of the external safetensors files).

The runtime imports this module. It imports nothing of ``torch.export`` or of the AOT side: only the
program dataclasses, the generated flatbuffers code, torch, mmap and safetensors
(tests/test_format.py checks this).

Everything read from a file is checked before use; a bad file raises :class:`ProgramError` naming
the file and what is wrong. Checked at :func:`load_program`: the magic, the version, the header and
flatbuffer checksums, every offset and size of the header against the file's size, the flatbuffer's
identifier and structure (an accessor that fails, a vector longer than the buffer), enum values; then,
in ``validate.py``: dtype names, every index (value ids, constant, arena, delegate, external file,
plan tensor and delegate input/output indices), and that in-file constants lie inside the data
segment, aligned for their dtype, with ``nbytes`` matching dtype and shape; symbolic sizes: each
expression is integer arithmetic over its method's symbols (parsed, never run as arbitrary code), its
recorded bound is its value at the symbols' maxima, and each symbol is its input's dimension; in
``consistency.py``: specs, devices, value sizes, arenas and data flow. Checked when an external
constant is first asked for: the file exists and is a safetensors file, it has the key, the tensor's
dtype and shape. Checked the first time a constant's bytes are handed out: their checksum
(``header.checksum``) against the one the program records, so damaged data, or an external file whose
tensors were swapped or replaced, is an error naming the constant instead of a wrong answer.

Lifetime policy: the file is mapped once, privately (copy-on-write: writing to a tensor handed out
never reaches the file). Each tensor handed out holds the part of the mapping it views (through a
``memoryview``), so it stays valid however long it lives. :meth:`ProgramFile.close` drops the
ProgramFile's own references (the mapping and the open external files); the mapping is unmapped
then, or when the last tensor viewing it is freed. Closing is therefore always safe, and idempotent;
after it, the ProgramFile hands out nothing more. As with any mapping, the file must not be truncated
or rewritten in place while it is loaded (the writer replaces files by renaming, which is safe).
"""

from __future__ import annotations

import mmap
import os
import zlib
from enum import IntEnum

import torch
from safetensors import safe_open

from ..plan import Arg, Base, DelegatePlan, Launch, TensorDesc
from ..plan import ArgKind as KernelArgKind
from ..program import (
    FORMAT_VERSION,
    Arena,
    ArgKind,
    Constant,
    Delegate,
    HostArg,
    InstrKind,
    Instruction,
    KernelBinary,
    Method,
    Program,
    ProgramError,
    Role,
    Segment,
    SegmentKind,
    Slot,
    Symbol,
    TensorValue,
)
from ..symbolic import from_text
from . import header as hdr
from .generated import program_generated as fb
from .validate import DTYPES, check_program

SUPPORTED_VERSIONS = (FORMAT_VERSION,)


def load_program(path, data_files: dict[str, str] | None = None) -> "ProgramFile":
    """Maps and checks the program file at ``path``; raises :class:`ProgramError` if it is bad (and
    ``OSError`` if it cannot be opened).

    ``data_files`` maps external file names recorded in the program to paths (default for each: the
    recorded name, relative to the program file's directory); ``constant_*`` calls can override it.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < hdr.HEADER.size:
            raise ProgramError(f"{path}: truncated: {size} bytes, shorter than the {hdr.HEADER.size}-byte "
                               "header of a program file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        program, data_off, data_size = _parse(mm, path)
    except BaseException:
        mm.close()
        raise
    file = ProgramFile(path, program, mm, data_off, data_size, data_files)
    try:
        file.check_binaries()
    except BaseException:
        file.close()
        raise
    return file


class ProgramFile:
    """A loaded program file: ``.program`` and zero-copy host views of its constants' bytes.

    Use it as a context manager, or call :meth:`close`; see the module docstring for what closing
    means for tensors already handed out.
    """

    def __init__(self, path: str, program: Program, mm: mmap.mmap, data_off: int, data_size: int,
                 data_files: dict[str, str] | None):
        self.path = path
        self.program = program
        self._mm: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)
        self._data_off = data_off
        self._data_size = data_size
        self._data_files = dict(data_files or {})
        self._external: dict[str, tuple[object, frozenset[str]]] = {}  # path -> (safe_open, keys)
        self._checked: set = set()  # constants whose bytes matched their checksum: index or (index, path)

    @property
    def data_offset(self) -> int:
        """Where the data segment starts in the file."""
        return self._data_off

    def binary_bytes(self, index: int) -> bytes:
        """The bytes of ``program.binaries[index]`` (checked against its checksum at load)."""
        b = self.program.binaries[index]
        start = self._data_off + b.data_offset
        return bytes(self._mv[start:start + b.nbytes])

    def check_binaries(self) -> None:
        for i, b in enumerate(self.program.binaries):
            if zlib.crc32(self.binary_bytes(i)) != b.checksum:
                raise ProgramError(f"{self.path}: kernel binary {i} ({b.kernel!r}, {b.arch}): its bytes do not "
                                   "match their checksum (the file is damaged)")

    # -- constants --------------------------------------------------------------------------------

    def constant_bytes(self, index: int, data_files: dict[str, str] | None = None) -> torch.Tensor:
        """The bytes of ``program.constants[index]``: a 1-D host uint8 tensor viewing the mapped file."""
        c = self._constant(index)
        if c.external >= 0:
            return self._external_tensor(index, data_files).reshape(-1).view(torch.uint8)
        if c.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        start = self._data_off + c.data_offset
        data = torch.frombuffer(self._mv[start:start + c.nbytes], dtype=torch.uint8)
        self._check_sum(index, index, data, "the program file's data segment")
        return data

    def constant_tensor(self, index: int, data_files: dict[str, str] | None = None) -> torch.Tensor:
        """``program.constants[index]`` with its dtype and shape: a host view, not a copy."""
        c = self._constant(index)
        if c.external >= 0:
            return self._external_tensor(index, data_files)
        dtype = DTYPES[c.dtype]
        if c.nbytes == 0:
            return torch.empty(c.shape, dtype=dtype)
        try:
            return self.constant_bytes(index).view(dtype).reshape(c.shape)
        except RuntimeError as e:  # dtypes torch cannot view bytes as (quantized, sub-byte)
            raise ProgramError(f"{self.path}: constant {index} ({c.name!r}): cannot view its bytes as "
                               f"{c.dtype}: {e}") from e

    def external_path(self, file_index: int, data_files: dict[str, str] | None = None) -> str:
        """Where ``program.external_files[file_index]`` is read from."""
        name = self.program.external_files[file_index]
        mapping = self._data_files if data_files is None else {**self._data_files, **data_files}
        if name in mapping:
            return os.fspath(mapping[name])
        return os.path.join(os.path.dirname(os.path.abspath(self.path)), name)

    # -- lifetime ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Drops this object's mapping and external files; tensors handed out stay valid."""
        if self._mm is None:
            return
        self._external.clear()
        mv, mm = self._mv, self._mm
        self._mv = self._mm = None
        mv.release()  # slices handed out to tensors are separate views: they keep the mapping
        try:
            mm.close()
        except BufferError:
            pass  # tensors still view it: it is unmapped when the last of them is freed

    def __enter__(self) -> "ProgramFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        p = self.program
        state = "closed" if self.closed else "open"
        return (f"ProgramFile({self.path!r}, {len(p.methods)} methods, {len(p.constants)} constants, "
                f"{state})")

    # -- internals --------------------------------------------------------------------------------

    def _constant(self, index: int) -> Constant:
        if self._mm is None:
            raise ValueError(f"{self.path}: the program file is closed")
        if not 0 <= index < len(self.program.constants):
            raise IndexError(f"constant {index} out of range: the program has "
                             f"{len(self.program.constants)} constants")
        return self.program.constants[index]

    def _external_tensor(self, index: int, data_files) -> torch.Tensor:
        c = self.program.constants[index]
        name = self.program.external_files[c.external]
        file_path = self.external_path(c.external, data_files)
        what = f"{file_path}: external data file {name!r} of {self.path}"
        key = f"tensor {c.name!r} (constant {index})"
        handle, keys = self._open_external(file_path, what, key)
        if c.name not in keys:
            raise ProgramError(f"{what} has no {key}; it holds {len(keys)} tensors")
        try:
            t = handle.get_tensor(c.name)
        except Exception as e:  # safetensors reports its errors as a bare Exception subclass
            raise ProgramError(f"{what}: cannot read {key}: {e}") from e
        if t.dtype != DTYPES[c.dtype] or tuple(t.shape) != c.shape:
            raise ProgramError(f"{what}: {key} is {str(t.dtype).removeprefix('torch.')}{list(t.shape)}, "
                               f"but the program expects {c.dtype}{list(c.shape)}")
        if t.numel() * t.element_size() != c.nbytes:  # implied by the above; cheap to be sure
            raise ProgramError(f"{what}: {key} has {t.numel() * t.element_size()} bytes, the program "
                               f"expects {c.nbytes}")
        self._check_sum(index, (index, os.path.abspath(file_path)), t, what)
        return t

    def _check_sum(self, index: int, key, data: torch.Tensor, where: str) -> None:
        """The first time a constant is read (from one file): its bytes against its checksum."""
        c = self.program.constants[index]
        if c.checksum is None or key in self._checked:
            return
        if hdr.checksum(data) != c.checksum:
            raise ProgramError(f"{self.path}: constant {index} ({c.name!r}): its bytes in {where} do not match "
                               "the checksum the program records for them (damaged, or not this program's data)")
        self._checked.add(key)

    def _open_external(self, file_path: str, what: str, key: str):
        cache_key = os.path.abspath(file_path)
        entry = self._external.get(cache_key)
        if entry is None:
            try:
                handle = safe_open(file_path, framework="pt")
                entry = (handle, frozenset(handle.keys()))
            except FileNotFoundError as e:
                raise ProgramError(f"{what} is missing; it holds {key} (pass data_files={{name: path}} "
                                   "to read it from elsewhere)") from e
            except Exception as e:  # truncated, not safetensors, unreadable
                raise ProgramError(f"{what}, which holds {key}, is not a valid safetensors file: {e}") from e
            self._external[cache_key] = entry
        return entry


# -------------------------------------------------------------------------------------------------
# The header and the flatbuffer.


def _parse(mm: mmap.mmap, path: str) -> tuple[Program, int, int]:
    size = len(mm)

    def bad(what: str) -> ProgramError:
        return ProgramError(f"{path}: {what}")

    head = mm[: hdr.HEADER.size]
    (magic, version, header_size, fb_off, fb_size, data_off, data_size, file_size, fb_crc,
     head_crc) = hdr.HEADER.unpack(head)
    if magic != hdr.MAGIC:
        raise bad(f"not a tritondelegate program file: it starts with {magic!r}, not {hdr.MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        raise bad(f"format version {version} is not supported; this reader reads version(s) "
                  f"{', '.join(map(str, SUPPORTED_VERSIONS))}; lower the model again with this tritondelegate")
    if header_size != hdr.HEADER.size:
        raise bad(f"header size {header_size}, expected {hdr.HEADER.size} for version {version}")
    if zlib.crc32(head[:-4]) != head_crc:
        raise bad("header checksum mismatch: the header (bytes [0, 64)) is corrupt")
    if file_size != size:
        if size < file_size:
            raise bad(f"truncated: the header records {file_size} bytes, the file has {size}")
        raise bad(f"{size - file_size} unexpected bytes after the recorded end of the file ({file_size})")
    if fb_off < header_size or fb_off + fb_size > size:
        raise bad(f"flatbuffer [{fb_off}, {fb_off + fb_size}) lies outside the file's {size} bytes "
                  f"after the header")
    if data_off < fb_off + fb_size or data_off + data_size > size:
        raise bad(f"data segment [{data_off}, {data_off + data_size}) does not lie between the end of "
                  f"the flatbuffer ({fb_off + fb_size}) and the end of the file ({size})")
    if data_off % hdr.DATA_SEGMENT_ALIGNMENT:
        raise bad(f"data segment offset {data_off} is not a multiple of {hdr.DATA_SEGMENT_ALIGNMENT}")
    buf = bytes(mm[fb_off : fb_off + fb_size])
    if zlib.crc32(buf) != fb_crc:
        raise bad(f"flatbuffer checksum mismatch: bytes [{fb_off}, {fb_off + fb_size}) are corrupt")
    if fb_size < 8 or not fb.Program.ProgramBufferHasIdentifier(buf, 0):
        raise bad(f"the flatbuffer at {fb_off} does not carry the identifier {hdr.FILE_IDENTIFIER!r}")
    try:
        program = _Decoder(buf, path).program()
    except ProgramError:
        raise
    except Exception as e:  # the generated accessors fail in many ways on a malformed buffer
        raise bad(f"the flatbuffer at {fb_off} does not parse ({type(e).__name__}: {e})") from e
    check_program(program, path, version, data_off, data_size)
    return program, data_off, data_size


class _Decoder:
    """Flatbuffer accessors -> program dataclasses.

    The generated Python code does not verify buffers, so this bounds the work: every element of a
    vector of tables or strings costs at least one byte of the buffer, and the total count may not
    exceed the buffer's size (a corrupt length cannot make the loader loop for long). Scalar vectors
    are read through numpy, which checks their extent exactly.
    """

    def __init__(self, buf: bytes, path: str):
        self.path = path
        self.budget = len(buf)
        self.buf = buf
        self.names: frozenset[str] = frozenset()  # the symbols of the method being decoded

    def entries(self, n: int, what: str) -> range:
        self.budget -= n
        if self.budget < 0:
            raise ProgramError(f"{self.path}: the flatbuffer is corrupt: {what} claims {n} entries, more "
                               "than it can hold")
        return range(n)

    def enum(self, cls: type[IntEnum], value: int, what: str):
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(f"{m.value} ({m.name})" for m in cls)
            raise ProgramError(f"{self.path}: {what} has {cls.__name__} value {value}; valid: {valid}") from None

    @staticmethod
    def text(b) -> str:
        return b.decode("utf-8") if b else ""

    @staticmethod
    def nums(array) -> list:
        return [] if isinstance(array, int) else array.tolist()  # the accessor returns 0 when absent

    def size(self, bound: int, text, where: str):
        """A size that may be symbolic: ``bound`` when ``text`` is empty, else its checked ``Expr``."""
        text = self.text(text)
        if not text:
            return bound
        try:
            value = from_text(text, bound, self.names)
        except ProgramError as e:
            raise ProgramError(f"{self.path}: {where}: {e}") from None
        if isinstance(value, int) and value != bound:
            raise ProgramError(f"{self.path}: {where}: the literal size {text!r} differs from its bound {bound}")
        return value

    def sizes(self, bounds: list, n_exprs: int, expr, where: str) -> list:
        """Sizes that may be symbolic: ``bounds``, with the texts ``expr(i)`` (none: all concrete)."""
        if n_exprs == 0:
            return bounds
        if n_exprs != len(bounds):
            raise ProgramError(f"{self.path}: {where} has {n_exprs} size expressions for {len(bounds)} sizes")
        return [self.size(b, expr(i), f"{where}[{i}]") for i, b in zip(self.entries(n_exprs, where), bounds)]

    def program(self) -> Program:
        p = fb.Program.GetRootAs(self.buf, 0)
        return Program(
            methods=[self.method(p.Methods(i), i) for i in self.entries(p.MethodsLength(), "methods")],
            constants=[self.constant(p.Constants(i), i) for i in self.entries(p.ConstantsLength(), "constants")],
            external_files=[self.text(p.ExternalFiles(i))
                            for i in self.entries(p.ExternalFilesLength(), "external_files")],
            version=p.Version(),
            segments=[self.segment(p.Segments(i), i) for i in self.entries(p.SegmentsLength(), "segments")],
            slots=[self.slot(p.Slots(i)) for i in self.entries(p.SlotsLength(), "slots")],
            binaries=[self.binary(p.Binaries(i)) for i in self.entries(p.BinariesLength(), "binaries")],
        )

    def binary(self, b) -> KernelBinary:
        t = self.text
        return KernelBinary(kernel=t(b.Kernel()), arch=t(b.Arch()), triton_version=t(b.TritonVersion()),
                            cache_key=t(b.CacheKey()), name=t(b.Name()), metadata=t(b.Metadata()),
                            nbytes=b.Nbytes(), checksum=b.Checksum(), data_offset=b.DataOffset())

    def segment(self, s, i: int) -> Segment:
        kind = self.enum(SegmentKind, s.Kind(), f"segment {i}")
        return Segment(self.text(s.Device()), kind, s.Nbytes(), s.Alignment())

    def slot(self, s) -> Slot:
        return Slot(self.text(s.Name()), s.Constant(), self.text(s.Device()), s.State(), s.Segment(), s.Offset())

    def constant(self, c, i: int) -> Constant:
        return Constant(self.text(c.Name()), self.text(c.Dtype()), tuple(self.nums(c.ShapeAsNumpy())),
                        c.Nbytes(), c.DataOffset(), c.External(), c.Checksum())

    def method(self, m, i: int) -> Method:
        where = f"method {i}"
        symbols = [self.symbol(m.Symbols(j)) for j in self.entries(m.SymbolsLength(), f"{where} symbols")]
        self.names = frozenset(s.name for s in symbols)
        return Method(
            name=self.text(m.Name()),
            values=[self.value(m.Values(j), f"{where} value {j}")
                    for j in self.entries(m.ValuesLength(), f"{where} values")],
            inputs=self.nums(m.InputsAsNumpy()),
            outputs=self.nums(m.OutputsAsNumpy()),
            input_spec=self.text(m.InputSpec()),
            output_spec=self.text(m.OutputSpec()),
            instructions=[self.instruction(m.Instructions(j), f"{where} instruction {j}")
                          for j in self.entries(m.InstructionsLength(), f"{where} instructions")],
            delegates=[self.delegate(m.Delegates(j), f"{where} delegate {j}")
                       for j in self.entries(m.DelegatesLength(), f"{where} delegates")],
            arenas=[self.arena(m.Arenas(j)) for j in self.entries(m.ArenasLength(), f"{where} arenas")],
            mutated_buffers=[(b.Buffer(), b.Value()) for b in
                             (m.MutatedBuffers(j)
                              for j in self.entries(m.MutatedBuffersLength(), f"{where} mutated_buffers"))],
            symbols=symbols,
        )

    def symbol(self, s) -> Symbol:
        return Symbol(self.text(s.Name()), s.Min(), s.Max(), s.Input(), s.Dim())

    def value(self, v, where: str) -> TensorValue:
        return TensorValue(
            name=self.text(v.Name()),
            dtype=self.text(v.Dtype()),
            shape=tuple(self.sizes(self.nums(v.ShapeAsNumpy()), v.ShapeExprsLength(), v.ShapeExprs,
                                   f"{where} shape")),
            device=self.text(v.Device()),
            role=self.enum(Role, v.Role(), where),
            nbytes=v.Nbytes(),
            constant=v.Constant(),
            arena=v.Arena(),
            arena_offset=v.ArenaOffset(),
            resident=v.Resident(),
            slot=v.Slot(),
        )

    def instruction(self, ins, where: str) -> Instruction:
        return Instruction(
            kind=self.enum(InstrKind, ins.Kind(), where),
            inputs=self.nums(ins.InputsAsNumpy()),
            outputs=self.nums(ins.OutputsAsNumpy()),
            target=self.text(ins.Target()),
            args=[self.host_arg(ins.Args(k), f"{where} arg {k}")
                  for k in self.entries(ins.ArgsLength(), f"{where} args")],
            delegate=ins.Delegate(),
            name=self.text(ins.Name()),
        )

    def host_arg(self, a, where: str) -> HostArg:
        kind = self.enum(ArgKind, a.Kind(), where)
        if kind == ArgKind.NONE:
            value = None
        elif kind in (ArgKind.TENSOR, ArgKind.INT):
            value = a.Ival()
        elif kind == ArgKind.FLOAT:
            value = a.Fval()
        elif kind == ArgKind.BOOL:
            value = a.Bval()
        elif kind in (ArgKind.STR, ArgKind.DTYPE, ArgKind.DEVICE, ArgKind.MEMORY_FORMAT, ArgKind.LAYOUT):
            value = self.text(a.Sval())
        elif kind == ArgKind.INT_LIST:
            value = self.nums(a.IlistAsNumpy())
        elif kind == ArgKind.FLOAT_LIST:
            value = self.nums(a.FlistAsNumpy())
        elif kind == ArgKind.BOOL_LIST:
            value = self.nums(a.BlistAsNumpy())
        elif kind == ArgKind.TENSOR_LIST:
            value = self.nums(a.TlistAsNumpy())
        elif kind == ArgKind.SYM_INT:
            value = self.size(a.Ival(), a.Sexpr(), where)
        elif kind == ArgKind.SYM_INT_LIST:
            value = self.sizes(self.nums(a.IlistAsNumpy()), a.SlistExprsLength(), a.SlistExprs, where)
        else:  # a new ArgKind member without a case here
            raise RuntimeError(f"internal error: no decoding for {kind!r}")
        return HostArg(kind, value, self.text(a.Name()))

    def delegate(self, d, where: str) -> Delegate:
        p = d.Plan()
        if p is None:
            raise ProgramError(f"{self.path}: {where} has no launch plan")
        return Delegate(
            backend_id=self.text(d.BackendId()),
            device=self.text(d.Device()),
            plan=self.plan(p, where),
            scratch_arena=d.ScratchArena(),
            scratch_offset=d.ScratchOffset(),
            stage_inputs=d.StageInputs(),
        )

    def arena(self, a) -> Arena:
        return Arena(self.text(a.Device()), a.Nbytes(), a.Alignment(), a.LowerBound())

    def plan(self, p, where: str) -> DelegatePlan:
        return DelegatePlan(
            tensors=[self.tensor_desc(p.Tensors(k), f"{where} tensor {k}")
                     for k in self.entries(p.TensorsLength(), f"{where} tensors")],
            launches=[self.launch(p.Launches(k), f"{where} launch {k}")
                      for k in self.entries(p.LaunchesLength(), f"{where} launches")],
            scratch_bytes=p.ScratchBytes(),
            input_nbytes=self.nums(p.InputNbytesAsNumpy()),
            output_nbytes=self.nums(p.OutputNbytesAsNumpy()),
        )

    def tensor_desc(self, t, where: str) -> TensorDesc:
        return TensorDesc(
            base=self.enum(Base, t.Base(), where),
            index=t.Index(),
            byte_offset=self.size(t.ByteOffset(), t.ByteOffsetExpr(), f"{where} byte_offset"),
            dtype=self.text(t.Dtype()),
            shape=tuple(self.sizes(self.nums(t.ShapeAsNumpy()), t.ShapeExprsLength(), t.ShapeExprs,
                                   f"{where} shape")),
            strides=tuple(self.sizes(self.nums(t.StridesAsNumpy()), t.StridesExprsLength(), t.StridesExprs,
                                     f"{where} strides")),
        )

    def launch(self, launch, where: str) -> Launch:
        constexprs = {}
        for k in self.entries(launch.ConstexprsLength(), f"{where} constexprs"):
            entry = launch.Constexprs(k)
            arg = entry.Arg()
            if arg is None:
                raise ProgramError(f"{self.path}: {where} constexpr {k} has no value")
            constexprs[self.text(entry.Name())] = self.kernel_arg(arg, f"{where} constexpr {k}")
        return Launch(
            kernel=self.text(launch.Kernel()),
            grid=tuple(self.sizes(self.nums(launch.GridAsNumpy()), launch.GridExprsLength(), launch.GridExprs,
                                  f"{where} grid")),
            args=[self.kernel_arg(launch.Args(k), f"{where} arg {k}")
                  for k in self.entries(launch.ArgsLength(), f"{where} args")],
            constexprs=constexprs,
            op=self.text(launch.Op()),
            bytes_read=launch.BytesRead(),
            bytes_written=launch.BytesWritten(),
            flops=launch.Flops(),
        )

    def kernel_arg(self, a, where: str) -> Arg:
        kind = self.enum(KernelArgKind, a.Kind(), where)
        if kind == KernelArgKind.TENSOR:
            return Arg(kind, a.Ival())
        if kind == KernelArgKind.INT:
            return Arg(kind, self.size(a.Ival(), a.Iexpr(), where))
        if kind == KernelArgKind.FLOAT:
            return Arg(kind, a.Fval())
        if kind == KernelArgKind.BOOL:
            return Arg(kind, a.Bval())
        if kind == KernelArgKind.STR:
            return Arg(kind, self.text(a.Sval()))
        raise RuntimeError(f"internal error: no decoding for {kind!r}")
