"""Load-time verification of a method: a program file is untrusted input, so before anything runs the
loader checks that no launch can reach memory outside the views it is given and that the memory plan
is sound. Any violation is a :class:`ProgramError` (a :class:`DelegateError` for a launch) naming the
method, the delegate, the launch, its kernel and the value.

A method is verified when it loads (:func:`verify_method`; a method with bounded dynamic dimensions
at its symbols' upper bounds), and a method with dynamic dimensions again at each size it runs
(:func:`verify_launches` on the method made concrete for that size, once per size, where ``_sized``
specializes it), so every launch is checked with the exact sizes, strides and grid it runs with.

**Memory plan** (:func:`verify_memory`). Every value's byte count is its shape times its dtype's size.
Inputs come from the caller (no arena, no slot); constants on a device and state live in program
slots (resident constants only), never in an arena; intermediates never in a slot. Arena offsets are
aligned (to the arena's alignment and the dtype) and lie in the arena; no two values (or delegate
scratch blocks) whose lifetimes overlap share a byte; no instruction writes a constant, an input or
state (state is written only in place by a delegate or by the method's write-back). Copies, delegate
calls and write-backs join values of matching device, dtype and shape. No arena is larger than what it
holds (a crafted size must not make the loader allocate it).

**Launches** (:func:`verify_launches`). Every kernel a launch names needs a footprint rule
(``footprints.RULES``): a kernel without one is refused, so a new kernel cannot skip verification.
Each plan tensor is a view inside its base (a delegate input, output or scratch block). Per launch:

* the arguments bind to the kernel's parameters: pointers (``*_ptr``) are plan tensors and nothing
  else is; integers fit int64; every constexpr (and launch option) is in the kernel's allowed set:
  block sizes powers of two within the launcher's limits, op and mode names the kernel knows, flags
  booleans; tiles within Triton's 2**20 elements;
* the grid has 1 to 3 positive axes within CUDA's limits (x < 2**31, y and z <= 65535);
* the kernel's rule, its indexing formula written over its masks, gives for each pointer it loads
  or stores the index ranges and strides of the element offsets it reaches (``Access``): the
  largest must lie inside the view the plan passes, the smallest at or above 0. A kernel writes a
  delegate input only when that input is program state (updated in place);
* no hang: each grid axis may not exceed the programs the launch's sizes need, and each size the grid
  or a loop walks (``Footprint.sizes``) may not exceed ``SLACK`` times the largest view the launch
  touches, in elements (or ``SMALL``: a pooling window may exceed a tiny input, many indices may
  address a small tensor). Grids and loops are thus tied to the data they cover: a crafted file
  cannot make the interpreter work much longer than a real program over the same memory would.
"""

from __future__ import annotations

import heapq
import inspect
import math
from bisect import bisect_left, insort
from dataclasses import dataclass

from ..dtypes import parse_dtype
from ..kernels.table import KERNELS
from ..plan import Base, KernelArgKind, Launch, TensorDesc
from ..program import InstrKind, Method, Program, Role, align_up
from ..errors import ProgramError
from ..symbolic import bound
from .delegate import DelegateError
from .footprints import OPTIONS, RULES, Footprint, KernelRule, LaunchArgs, is_int, kernel_parameters
from .sized import specialize

MAX_GRID = (2**31 - 1, 65535, 65535)  # CUDA's limits on grid axes x, y, z
INT64 = 2**63
MAX_TILE = 2**20  # Triton's limit on the elements of one block
SMALL = 4096  # sizes up to this need no view to cover them (a pooling window over a tiny input)
SLACK = 16  # a size may be this many times the largest view (many indices into a small tensor)


# --- launches ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _View:
    extent: int  # elements from the view's first to one past its last
    label: str
    writable: bool  # not a delegate input other than program state


def verify_launches(method: Method) -> None:
    """Every launch of every delegate call of ``method`` (a method without symbols, or one size of
    one): see the module docstring."""
    for instr in method.instructions:
        if instr.kind == InstrKind.DELEGATE:
            _verify_call(method, instr)


def _verify_call(method: Method, instr) -> None:
    plan = method.delegates[instr.delegate].plan
    where = f"method {method.name!r} delegate {instr.delegate} ({instr.name!r})"
    if len(plan.input_nbytes) != len(instr.inputs) or len(plan.output_nbytes) != len(instr.outputs):
        raise DelegateError(f"{where}: its plan takes {len(plan.input_nbytes)} inputs and "
                            f"{len(plan.output_nbytes)} outputs, the call passes {len(instr.inputs)} and "
                            f"{len(instr.outputs)}")
    views = [_view(method, instr, plan.scratch_bytes, desc, f"{where} plan tensor {k}")
             for k, desc in enumerate(plan.tensors)]
    for k, launch in enumerate(plan.launches):
        _verify_launch(f"{where} launch {k} ({launch.kernel!r}, node {launch.op!r})", launch, views)


def _view(method: Method, instr, scratch_bytes: int, desc: TensorDesc, what: str) -> _View:
    """The view ``desc`` over its base, checked to lie inside it."""
    if desc.base == Base.SCRATCH:
        base_bytes, label, writable = scratch_bytes, f"{what} (scratch)", True
    else:
        vids = instr.inputs if desc.base == Base.INPUT else instr.outputs
        if not 0 <= desc.index < len(vids):
            raise DelegateError(f"{what} refers to {desc.base.name.lower()} {desc.index}; the call has {len(vids)}")
        value = method.values[vids[desc.index]]
        base_bytes = value.nbytes
        label = f"{what} ({desc.base.name.lower()} {desc.index}: value {value.name!r})"
        writable = desc.base == Base.OUTPUT or value.role == Role.MUTABLE_BUFFER
    sizes = (desc.byte_offset, *desc.shape, *desc.strides)
    if not all(is_int(v) and v >= 0 for v in sizes) or len(desc.shape) != len(desc.strides):
        raise DelegateError(f"{label}: offset {desc.byte_offset}, shape {list(desc.shape)} and strides "
                            f"{list(desc.strides)} must be integers >= 0, one stride per dim")
    itemsize = _itemsize(desc.dtype, label)
    empty = math.prod(desc.shape) == 0
    extent = 0 if empty else 1 + sum((n - 1) * s for n, s in zip(desc.shape, desc.strides))
    end = desc.byte_offset + extent * itemsize
    if desc.byte_offset % itemsize or end > base_bytes:
        raise DelegateError(f"{label}: view bytes [{desc.byte_offset}, {end}) of dtype {desc.dtype} do not fit "
                            f"its {base_bytes}-byte base (or are not aligned for the dtype)")
    return _View(extent, label, writable)


def _verify_launch(where: str, launch: Launch, views: list) -> None:
    rule, kernel = RULES.get(launch.kernel), KERNELS.get(launch.kernel)
    if rule is None or kernel is None:
        raise DelegateError(f"{where}: this runtime has no kernel {launch.kernel!r} with a footprint rule, "
                            "so the memory its launches touch cannot be checked")
    runtime, defaults = kernel_parameters(kernel)
    ints, tensors = _arguments(where, launch, runtime, len(views))
    constexprs = _constexprs(where, launch, rule, defaults)
    grid = _grid(where, launch.grid)
    footprint = rule.footprint(LaunchArgs(where, ints, constexprs, grid))
    _check_footprint(where, footprint, grid, tensors, views)


def _arguments(where: str, launch: Launch, runtime: list[str], ntensors: int) -> tuple[dict, dict]:
    """(integer arguments, pointer -> plan tensor) by parameter name, after checking each kind."""
    if len(launch.args) != len(runtime):
        raise DelegateError(f"{where}: does not fit the kernel's parameters: {len(launch.args)} runtime "
                            f"arguments for its {len(runtime)} parameters")
    ints, tensors = {}, {}
    for name, arg in zip(runtime, launch.args):
        kind, value, pointer = arg.kind, arg.value, name.endswith("_ptr")
        if kind == KernelArgKind.INT and not pointer and type(value) is int and -INT64 <= value < INT64:
            ints[name] = value
        elif kind == KernelArgKind.TENSOR and pointer and type(value) is int and 0 <= value < ntensors:
            tensors[name] = value
        elif not (kind == KernelArgKind.FLOAT and type(value) in (int, float) or kind == KernelArgKind.BOOL
                  and isinstance(value, bool)) or pointer:
            if pointer != (kind == KernelArgKind.TENSOR):
                raise DelegateError(f"{where}: argument {name!r} is passed as {kind.name}; the kernel takes "
                                    f"{'a tensor' if pointer else 'a scalar'} there")
            raise DelegateError(f"{where}: argument {name!r} ({kind.name.lower()}) has the value {value!r}, "
                                "which the kernel cannot take")
    return ints, tensors


def _constexprs(where: str, launch: Launch, rule: KernelRule, defaults: dict) -> dict:
    """The launch's constexprs (and the kernel's defaults for those it omits), each in its allowed set."""
    values = {}
    for name, arg in launch.constexprs.items():
        allowed = OPTIONS.get(name) or rule.constexprs.get(name)
        if allowed is None or (name not in OPTIONS and name not in defaults):
            raise DelegateError(f"{where}: {name!r} is not a constexpr or launch option of the kernel")
        if arg.kind == KernelArgKind.TENSOR or not allowed.test(arg.value):
            raise DelegateError(f"{where}: constexpr {name}={arg.value!r} is not allowed (must be {allowed.text})")
        values[name] = arg.value
    for name, default in defaults.items():
        if name not in values:
            if default is inspect.Parameter.empty:
                raise DelegateError(f"{where}: constexpr {name!r} is missing")
            values[name] = default
    for tile in rule.tiles:
        if math.prod(values[n] for n in tile) > MAX_TILE:
            raise DelegateError(f"{where}: block {' x '.join(f'{n}={values[n]}' for n in tile)} has more than "
                                f"{MAX_TILE} elements")
    return values


def _grid(where: str, grid) -> tuple[int, int, int]:
    grid = tuple(grid)
    if not 1 <= len(grid) <= 3 or not all(is_int(g) and 1 <= g <= most for g, most in zip(grid, MAX_GRID)):
        raise DelegateError(f"{where}: grid {list(grid)} must have 1 to 3 axes of 1 to {list(MAX_GRID)} programs")
    return grid + (1,) * (3 - len(grid))


def _check_footprint(where: str, footprint: Footprint, grid: tuple, tensors: dict, views: list) -> None:
    needed = tuple(footprint.grid) + (1,) * (3 - len(footprint.grid))
    for axis, (programs, need) in enumerate(zip(grid, needed)):
        if programs > max(need, 1):
            raise DelegateError(f"{where}: grid axis {axis} has {programs} programs, but the launch's sizes "
                                f"need {max(need, 1)}")
    largest = 0
    for access in footprint.accesses:
        reach = access.reach()
        if reach is None:
            continue
        view = views[tensors[access.param]]
        if reach[0] < 0 or reach[1] >= view.extent:
            raise DelegateError(f"{where}: argument {access.param!r} reaches elements [{reach[0]}, {reach[1]}] of "
                                f"{view.label}, whose view spans {view.extent} elements")
        if access.write and not view.writable:
            raise DelegateError(f"{where}: argument {access.param!r} writes {view.label}, a delegate input that "
                                "is not program state")
        largest = max(largest, view.extent)
    for name, size in footprint.sizes.items():
        if size > max(SMALL, SLACK * largest):
            raise DelegateError(f"{where}: {name} is {size}, more than {SLACK} times the {largest} elements of "
                                f"the largest view the launch touches (or {SMALL})")


# --- the memory plan --------------------------------------------------------------------------------
def verify_method(program: Program, method: Method) -> None:
    """The memory plan and every launch of ``method``; a method with symbols at their upper bounds
    (each size it runs is verified again when it is first called with it)."""
    verify_memory(program, method)
    if method.symbols:
        verify_launches(specialize(method, {s.name: s.max for s in method.symbols}))
    else:
        verify_launches(method)


def verify_memory(program: Program, method: Method) -> None:
    """Sizes, roles, placement and lifetimes of ``method``'s values: see the module docstring."""
    where = f"method {method.name!r}"
    for a, arena in enumerate(method.arenas):
        align = arena.alignment
        if not (is_int(align) and align >= 1 and align & (align - 1) == 0) or arena.nbytes < 0 \
                or arena.device == "cpu":
            raise ProgramError(f"{where} arena {a} on {arena.device} ({arena.nbytes} bytes, alignment {align}): "
                               "an arena is on a device, with a power-of-two alignment")
    for vid, value in enumerate(method.values):
        _check_value(program, method, value, f"{where} value {vid} ({value.name!r})")
    for j, instr in enumerate(method.instructions):
        _check_instruction(method, instr, f"{where} instruction {j} ({instr.name!r})")
    for k, (buffer, new) in enumerate(method.mutated_buffers):
        state, result = method.values[buffer], method.values[new]
        if state.role != Role.MUTABLE_BUFFER or not _alike(state, result):
            raise ProgramError(f"{where} mutated buffer {k}: {state.name!r} is not state, or {result.name!r} "
                               "differs from it in device, dtype or shape")
    _check_lifetimes(method, where)


def _itemsize(dtype: str, what: str) -> int:
    try:
        return parse_dtype(dtype).itemsize
    except ValueError:
        raise DelegateError(f"{what} has unknown dtype {dtype!r}") from None


def _alike(a, b) -> bool:
    return (a.device, a.dtype, tuple(a.shape)) == (b.device, b.dtype, tuple(b.shape))


_ROLES = {Role.INPUT: "an input", Role.CONSTANT: "a constant", Role.MUTABLE_BUFFER: "state",
          Role.INTERMEDIATE: "an intermediate"}
_PLACES = {  # role -> (may have an arena, may have a slot): inputs are the caller's, state and resident
    Role.INPUT: (False, False),  # constants live in program slots, never in an arena
    Role.CONSTANT: (False, True),
    Role.MUTABLE_BUFFER: (False, True),
    Role.INTERMEDIATE: (True, False),
}


def _check_value(program: Program, method: Method, v, what: str) -> None:
    itemsize = _itemsize(v.dtype, what)
    shape = bound(tuple(v.shape))
    if not all(is_int(d) and d >= 0 for d in shape) or v.nbytes != math.prod(shape) * itemsize:
        raise ProgramError(f"{what} records {v.nbytes} bytes, but {v.dtype}{list(v.shape)} has "
                           f"{math.prod(shape) * itemsize}")
    arena_ok, slot_ok = _PLACES[Role(v.role)]
    in_slot = v.slot >= 0
    if (v.arena >= 0 and not arena_ok) or (in_slot and not slot_ok) or v.resident != (
            in_slot and v.role == Role.CONSTANT) or (v.role == Role.MUTABLE_BUFFER and not in_slot):
        raise ProgramError(f"{what} is {_ROLES[v.role]} with arena {v.arena}, slot {v.slot} and "
                           f"resident={v.resident} (inputs are the caller's; resident constants and state live "
                           "in program slots; only intermediates in an arena)")
    if v.role == Role.CONSTANT and v.device != "cpu" and not v.resident:
        raise ProgramError(f"{what}: a constant on {v.device} must be resident")
    if in_slot:
        if v.slot >= len(program.slots) or not 0 <= program.slots[v.slot].constant < len(program.constants):
            raise ProgramError(f"{what} refers to slot {v.slot}, which the program does not have")
        slot = program.slots[v.slot]
        constant = program.constants[slot.constant]
        if (constant.dtype, tuple(constant.shape), slot.device, slot.state) != (
                v.dtype, tuple(v.shape), v.device, v.role == Role.MUTABLE_BUFFER):
            raise ProgramError(f"{what} does not match its slot {v.slot} ({slot.name!r})")
    if v.arena >= 0:
        _check_placement(method, v.arena, v.arena_offset, v.nbytes, itemsize, v.device, what)


def _check_placement(method: Method, arena: int, offset: int, nbytes: int, itemsize: int, device: str,
                     what: str) -> None:
    if arena >= len(method.arenas):
        raise ProgramError(f"{what} refers to arena {arena}, but there are {len(method.arenas)}")
    a = method.arenas[arena]
    if a.device != device or offset < 0 or offset % a.alignment or offset % itemsize or offset + nbytes > a.nbytes:
        raise ProgramError(f"{what}: bytes [{offset}, {offset + nbytes}) on {device} do not fit arena {arena} "
                           f"({a.nbytes} bytes on {a.device}, offsets aligned to {a.alignment})")


def _check_instruction(method: Method, instr, what: str) -> None:
    values = method.values
    for vid in instr.outputs:
        if vid >= 0 and values[vid].role != Role.INTERMEDIATE:
            raise ProgramError(f"{what} writes value {vid} ({values[vid].name!r}), {_ROLES[values[vid].role]}: "
                               "only intermediates are written")
    if instr.kind in (InstrKind.COPY_H2D, InstrKind.COPY_D2H):
        src, dst = values[instr.inputs[0]], values[instr.outputs[0]]
        host = {InstrKind.COPY_H2D: (True, False), InstrKind.COPY_D2H: (False, True)}[instr.kind]
        if (src.device == "cpu", dst.device == "cpu") != host or (src.dtype, tuple(src.shape)) != (
                dst.dtype, tuple(dst.shape)):
            raise ProgramError(f"{what}: a {instr.kind.name} copy from {src.name!r} ({src.device}, "
                               f"{src.dtype}{list(src.shape)}) to {dst.name!r} ({dst.device}, "
                               f"{dst.dtype}{list(dst.shape)})")
    elif instr.kind == InstrKind.DELEGATE:
        delegate = method.delegates[instr.delegate]
        device = "cpu" if delegate.stage_inputs else delegate.device
        for vid in instr.inputs + instr.outputs:
            if values[vid].device != device:
                raise ProgramError(f"{what}: delegate {instr.delegate} runs on {delegate.device}, but value "
                                   f"{values[vid].name!r} is on {values[vid].device}")
        if delegate.plan.scratch_bytes and not delegate.stage_inputs:
            _check_placement(method, delegate.scratch_arena, delegate.scratch_offset, delegate.plan.scratch_bytes,
                             1, delegate.device, f"{what}: delegate {instr.delegate} scratch")


def _check_lifetimes(method: Method, where: str) -> None:
    """No two arena blocks whose lifetimes overlap share a byte, and no arena is larger than what it
    holds. Lifetimes are [first write, last use] in instruction order; method outputs and values
    written back into state live to the end of the call; a delegate's scratch for its own call."""
    end = len(method.instructions)
    first, last = {}, {}
    for i, instr in enumerate(method.instructions):
        for vid in instr.outputs:
            first.setdefault(vid, i)
            last[vid] = i
        for vid in instr.inputs:
            last[vid] = i
    for vid in list(method.outputs) + [new for _, new in method.mutated_buffers]:
        last[vid] = end
    blocks: dict[int, list] = {}
    for vid, v in enumerate(method.values):
        if v.arena >= 0:  # a value no instruction writes (never planned) is taken as live throughout
            life = (first[vid], last[vid]) if vid in first else (0, end)
            blocks.setdefault(v.arena, []).append((*life, v.arena_offset, v.nbytes, f"value {vid} ({v.name!r})"))
    for i, instr in enumerate(method.instructions):
        delegate = method.delegates[instr.delegate] if instr.kind == InstrKind.DELEGATE else None
        if delegate is not None and delegate.plan.scratch_bytes and not delegate.stage_inputs:
            blocks.setdefault(delegate.scratch_arena, []).append(
                (i, i, delegate.scratch_offset, delegate.plan.scratch_bytes, f"delegate {instr.delegate} scratch"))
    for arena, items in blocks.items():
        clash = _first_overlap(items)
        if clash:
            raise ProgramError(f"{where} arena {arena}: {clash[0]} and {clash[1]} are live together and share bytes")
    for arena, a in enumerate(method.arenas):
        used = max((off + max(n, 1) for _, _, off, n, _ in blocks.get(arena, ())), default=0)
        if a.nbytes > align_up(used, a.alignment):
            raise ProgramError(f"{where} arena {arena} has {a.nbytes} bytes, more than the {used} its values use")


def _first_overlap(items: list) -> tuple[str, str] | None:
    """Two of ``items`` ((first, last, offset, nbytes, label)) overlapping in time and bytes, or None.
    A sweep over time keeps the live blocks sorted by offset; they are disjoint, so a new block can
    only overlap its neighbours."""
    live: list = []  # (start, end, label), sorted
    ends: list = []  # heap of (last, start, end, label)
    for first, last, start, nbytes, label in sorted(i for i in items if i[3] > 0):
        while ends and ends[0][0] < first:
            _, s, e, lab = heapq.heappop(ends)
            live.pop(bisect_left(live, (s, e, lab)))
        block = (start, start + nbytes, label)
        pos = bisect_left(live, block)
        for other in live[max(pos - 1, 0):pos + 1]:
            if other[0] < block[1] and block[0] < other[1]:
                return other[2], label
        insort(live, block)
        heapq.heappush(ends, (last, *block))
    return None
