"""The in-memory program: pure data that ``lower()`` builds, ``serialize`` writes and reads, and the
runtime executes. The AOT side and the runtime meet here and in the kernel registry only.

A program holds methods and one table of constants shared by all of them, so the bytes of a
constant read by several methods (or read on the host in one and resident on a device in another)
are stored once.

Memory that lives as long as the loaded program, shared by all its methods, is described by
*slots*: each resident constant once per device, and each state buffer (a buffer that some method
mutates, e.g. a KV cache) once. Device slots lie in per-device *segments* (one for constants, one
for state), planned at lower time; method arenas hold only activations and scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from .plan import DelegatePlan

FORMAT_VERSION = 10  # 2: program-level slots and segments (shared constants and state); 3: kernel
# signatures changed (rotary scale, gather epilogue, matmul GEMV, row-kernel chains): older plans would not fit;
# 4: the matmul kernel takes the rotary epilogue's arguments (rope_linear); 5: the attention kernel takes
# split-key partials and packed heads (attention_combine); 6: the grouped_mm kernel takes GLU and epilogue
# arguments (glu_grouped_mm, routing weights), and the rank and histc kernels; 7: the grouped_mm kernel
# reads its rows through an index (rows, rows_div, T) and histc counts cumulatively (cumulative_histc);
# 8: the grouped_mm kernel stores its rows through an index (dest, scattered_grouped_mm), takes an rms
# prologue and a bias per expert; the reduce kernel takes output row strides and row-chain arguments
# 9: the attention and attention_combine kernels take a sink pointer (sink_ptr, SINKS: sdpa_sinks);
# 10: the attention_append (a KV-cache step's rows written by the attention launch) and sort_offsets
# kernels, and the attention kernel's SOFTCAP (sdpa_softcap) and WINDOW (sdpa_positions' window); the
# tritondelegate::rotary ops' deinterleave keyword (a host instruction may carry it; kernel arguments unchanged)

# Where device memory starts: every arena, segment, delegate scratch block and device allocation, and
# every value planned in one. cudaMalloc's own guarantee; a multiple of every itemsize and of the 16
# bytes Triton specializes pointer arguments on, so a plan's byte offsets modulo this decide both.
DEVICE_ALIGNMENT = 256


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


class Role(IntEnum):
    INPUT = 0  # a user input of the method
    CONSTANT = 1  # parameter, non-mutated buffer, lifted tensor constant
    INTERMEDIATE = 2  # produced by an instruction
    MUTABLE_BUFFER = 3  # program state: a buffer some method mutates, one instance per loaded program


@dataclass
class TensorValue:
    name: str  # the graph node name (or constant FQN), for errors and summaries
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple  # ints, or symbolic.Expr for dims that depend on the method's symbols
    device: str  # "cpu" or "cuda:N"
    role: Role
    nbytes: int  # at the symbols' upper bounds: what memory planning reserves
    constant: int = -1  # index into Program.constants when the data comes from a constant
    arena: int = -1  # index into Method.arenas when planned; -1: not planned
    arena_offset: int = 0
    resident: bool = False  # a device constant loaded once into its program-level slot
    slot: int = -1  # index into Program.slots: resident constants and state; -1: none


class HostArgKind(IntEnum):
    """What a host op's argument (:class:`HostArg`) holds (``plan.KernelArgKind`` is a kernel's)."""

    NONE = 0
    TENSOR = 1
    INT = 2
    FLOAT = 3
    BOOL = 4
    STR = 5
    INT_LIST = 6
    FLOAT_LIST = 7
    TENSOR_LIST = 8  # entries may be -1 for None
    DTYPE = 9  # str: torch dtype name
    DEVICE = 10  # str
    MEMORY_FORMAT = 11  # str: torch.contiguous_format etc. without "torch."
    LAYOUT = 12  # str
    BOOL_LIST = 13
    SYM_INT = 14  # symbolic.Expr: a size that depends on the method's symbols
    SYM_INT_LIST = 15  # ints and symbolic.Exprs (e.g. the sizes of a view with a dynamic dim)


@dataclass
class HostArg:
    kind: HostArgKind
    value: object = None  # value id for TENSOR; list of ids for TENSOR_LIST; else the literal
    name: str = ""  # keyword name; "" for positional


class InstrKind(IntEnum):
    HOST_OP = 0  # an ATen op run on the CPU
    DELEGATE = 1  # a delegate call: Method.delegates[delegate]
    COPY_H2D = 2  # inputs[0] (host) -> outputs[0] (device)
    COPY_D2H = 3  # inputs[0] (device) -> outputs[0] (host)
    # 4 is reserved (a device-to-device copy the lowering never emitted); a file that holds it is refused.


@dataclass
class Instruction:
    kind: InstrKind
    inputs: list[int] = field(default_factory=list)  # value ids read
    outputs: list[int] = field(default_factory=list)  # value ids written
    target: str = ""  # HOST_OP: "aten::add.Tensor"
    args: list[HostArg] = field(default_factory=list)  # HOST_OP: positional then keyword args
    delegate: int = -1
    name: str = ""  # the node this instruction came from


@dataclass
class Delegate:
    backend_id: str
    device: str
    plan: DelegatePlan
    scratch_arena: int = -1
    scratch_offset: int = 0
    # enable_non_cpu_memory_planning=False: the delegate takes host tensors and copies them into
    # and out of its own device staging buffers inside the call.
    stage_inputs: bool = False


@dataclass
class Arena:
    device: str
    nbytes: int
    alignment: int
    lower_bound: int


@dataclass
class Symbol:
    """One bounded dynamic dimension of a method (``torch.export.Dim(..., max=N)``): the name size
    expressions use for it (``symbolic.Expr``), its range, and where a call's inputs give its value."""

    name: str  # "s0"
    min: int
    max: int
    input: int  # position in Method.inputs of the input that gives it ...
    dim: int  # ... and its dimension


@dataclass
class Method:
    name: str
    values: list[TensorValue]
    inputs: list[int]  # user inputs in call order
    outputs: list[int]  # flattened outputs
    input_spec: str  # pytree spec of (args, kwargs), torch.utils._pytree.treespec_dumps
    output_spec: str
    instructions: list[Instruction]
    delegates: list[Delegate]
    arenas: list[Arena]
    mutated_buffers: list[tuple[int, int]] = field(default_factory=list)  # (buffer value, new value)
    # Bounded dynamic dimensions. With any, sizes in values and plans may be ``symbolic.Expr``s
    # (their ``bound`` is the size at every symbol's maximum; memory is planned for it).
    symbols: list[Symbol] = field(default_factory=list)


@dataclass
class Constant:
    name: str  # fully-qualified name, the key in an external weights file
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    data_offset: int = 0  # in the program's data segment
    external: int = -1  # index into Program.external_files; -1: stored in the program file
    # xxh3_64 of the bytes (serialize/header.py: checksum), set by the writer and checked by the reader
    # as the bytes are first read; None: unchecked (a program in memory, a file written before it).
    checksum: int | None = None


class SegmentKind(IntEnum):
    CONSTANTS = 0  # resident constants, loaded from the file once, read-only
    STATE = 1  # state buffers, initialized from the file, updated in place by the methods


@dataclass
class Segment:
    """A region of one device that lives as long as the loaded program."""

    device: str
    kind: SegmentKind
    nbytes: int
    alignment: int


@dataclass
class Slot:
    """Program-level storage of one resident constant (per device) or one state buffer.

    ``constant`` holds the initial bytes. A slot in a segment lives at ``offset`` there; a host
    slot (``segment == -1``, state only) is one host tensor per loaded program.
    """

    name: str  # the constant's or buffer's fully-qualified name
    constant: int
    device: str
    state: bool = False
    segment: int = -1
    offset: int = 0


@dataclass
class KernelBinary:
    """One compiled kernel variant (``LowerConfig(kernel_archs=...)``): the bytes Triton's cache keeps
    for it under ``cache_key``, with the metadata file Triton writes beside them."""

    kernel: str  # registry name of the kernel it was compiled from
    arch: str  # "sm_90"
    triton_version: str
    cache_key: str  # Triton's cache key (the hash ``triton.compile`` computes)
    name: str  # the compiled function's name
    metadata: str  # Triton's metadata JSON for it
    nbytes: int
    checksum: int  # crc32 of the bytes
    data_offset: int = 0  # in the program's data segment


@dataclass
class ConstantMethod:
    """A named value stored with the program (``lower(..., constant_methods=...)``): what a runner needs
    to know about the model without running it, e.g. ``get_max_seq_len``, the KV cache's positions.
    ``value`` is its JSON text (``constant_methods.py`` checks what it may hold)."""

    name: str
    value: str


@dataclass
class Program:
    methods: list[Method]
    constants: list[Constant]
    external_files: list[str] = field(default_factory=list)
    version: int = FORMAT_VERSION
    segments: list[Segment] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    binaries: list[KernelBinary] = field(default_factory=list)
    constant_methods: list[ConstantMethod] = field(default_factory=list)


def value_lifetimes(method: Method) -> tuple[dict[int, int], dict[int, int]]:
    """(first, last) instruction of each value of ``method`` as memory planning counts them: from its
    first write to its last read; a method output lives to the end of the call
    (``len(method.instructions)``)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, instr in enumerate(method.instructions):
        for vid in instr.outputs:
            first.setdefault(vid, i)
            last[vid] = max(last.get(vid, i), i)
        for vid in instr.inputs:
            last[vid] = i
    for vid in method.outputs:
        last[vid] = len(method.instructions)
    return first, last
