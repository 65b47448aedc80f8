"""``lower()``: exported programs -> a program with Triton delegates, ready to save or run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind

from . import constant_methods as constant_methods_module
from . import progress as progress_module
from .binaries import check_archs, compile_binaries
from .config import LowerConfig
from .decompose import decompose
from .emit import ConstantTable, NodeInfo, emit_method
from .errors import LoweringError
from .kernels.sizes import is_size_node, symbol_ranges
from .kernels.target import DEFAULT as DEFAULT_TARGET
from .kernels.target import resolve as resolve_target
from .kernels.target import using as using_target
from .memory.method_plan import plan_method
from .memory.segments import plan_slots
from .partitioner import Partitioner, TritonPartitioner
from .passes.fold_constants import fold_constants, remembered_checks
from .passes.fold_repeat_kv import fold_repeat_kv
from .passes.kv_append import kv_append
from .passes.fuse import fuse_patterns
from .passes.propagate_device import DeviceReport, PropagateDevicePass
from .passes.state import (MethodGraph, StateBuffer, cast_state_updates, drop_unread_state, place_state,
                           reinplace)
from .passes.verify import verify_method
from .program import InstrKind, Program, Symbol
from .unclaimed import decompose_unclaimed


@dataclass
class MethodReport:
    nodes: NodeInfo
    device: DeviceReport
    launches: dict[str, int] = field(default_factory=dict)  # delegate tag -> launches per call
    inplace: list[str] = field(default_factory=list)  # state updates that write in place
    folded: list[str] = field(default_factory=list)  # nodes computed once by lower(), now constants
    fused: list[str] = field(default_factory=list)  # graph rewrites into bigger ops (passes/fuse.py)


class LoweredProgram:
    """The result of :func:`lower`: save it with :meth:`save`, read :meth:`summary`, or run it in
    memory with :meth:`load`."""

    def __init__(self, program: Program, constant_data: list[torch.Tensor], reports: dict[str, MethodReport],
                 state: dict[str, StateBuffer] | None = None, binary_data: list[bytes] | None = None):
        self.program = program
        self.constant_data = constant_data
        self.binary_data = binary_data or []  # the bytes of program.binaries
        self.reports = reports
        self.state = state or {}  # FQN -> where the state buffer lives and why
        self.target = DEFAULT_TARGET  # the GPU whose SMs and shared memory chose the launch configurations

    @property
    def method_names(self) -> list[str]:
        return [m.name for m in self.program.methods]

    @property
    def constant_methods(self) -> dict:
        """The values given to ``lower(..., constant_methods=...)``, by name."""
        return constant_methods_module.decode(self.program.constant_methods)

    def save(self, path: str | os.PathLike, key: bytes | None = None) -> list[str]:
        """Write the program file (and the external weights file, if any). Returns the paths written.

        ``key`` (16 or more secret bytes) signs the program: ``td.load(path, key=key)`` then refuses any
        file that was changed after this save (its structure, constants or kernel binaries), and a
        loader without the key refuses it too."""
        from .serialize.writer import save_program

        path = os.fspath(path)
        if self.program.external_files:
            # Recorded by name, next to the program file: "model.tdp" -> "model.weights.safetensors".
            stem = os.path.splitext(os.path.basename(path))[0]
            self.program.external_files = [f"{stem}.weights.safetensors"]
        return save_program(self.program, self.constant_data, path, binary_data=self.binary_data, key=key)

    def load(self, devices="auto", progress: bool | None = None):
        """Run without a file: the same runtime, with constants read from memory (``progress``: as
        ``td.load``'s)."""
        from .runtime.loader import InMemorySource, LoadedProgram

        return LoadedProgram(InMemorySource(self.program, self.constant_data, self.binary_data), devices=devices,
                             progress=progress)

    def summary(self, verbose: bool = False) -> str:
        """What runs where: a table of the methods, then each one's details, grouped (the largest items
        of each kind, then one line for the rest); ``verbose=True`` lists every item."""
        from .summary import format_summary

        return format_summary(self, verbose=verbose)

    def __repr__(self) -> str:
        return f"LoweredProgram(methods={self.method_names})"


def lower(
    programs: "torch.export.ExportedProgram | dict[str, torch.export.ExportedProgram]",
    partitioner: Partitioner | None = None,
    config: LowerConfig | None = None,
    progress: bool | None = None,
    constant_methods: dict | None = None,
) -> LoweredProgram:
    """Lower one exported program (method ``"forward"``) or a dict of them by method name.

    Nodes the partitioner claims run in Triton delegates on their device; the rest run on the host
    through ATen. Constants are stored once in the program, whichever methods read them; a buffer
    that any method mutates is program state, shared by every method of a loaded program.

    ``progress``: a bar on stderr over the lowering's steps; None (auto) shows it when stderr is a
    terminal and lowering runs longer than ``progress.LOWER_DELAY_S``; True always, False never.

    ``constant_methods``: named values stored with the program (``constant_methods.py``), e.g.
    ``{"get_max_seq_len": 128}`` for a generation runner; the loaded program's ``constant_methods``.
    """
    if isinstance(programs, torch.export.ExportedProgram):
        programs = {"forward": programs}
    if not isinstance(programs, dict) or not programs:
        raise TypeError("lower() takes an ExportedProgram or a non-empty dict of method name -> ExportedProgram")
    partitioner = TritonPartitioner() if partitioner is None else partitioner
    config = LowerConfig() if config is None else config
    check_archs(config.kernel_archs)
    stored = constant_methods_module.encode(constant_methods, programs)
    steps = 3 * len(programs) + 1 + bool(config.kernel_archs)  # per method: decompose, partition, lower
    gpu = resolve_target(config.target)
    with progress_module.bar("lowering", steps, progress, unit="step", delay=progress_module.LOWER_DELAY_S) as bar, \
            using_target(gpu):
        lowered = _lower(programs, partitioner, config, bar)
    lowered.target = gpu
    lowered.program.constant_methods = stored
    return lowered


def _lower(programs: dict, partitioner: Partitioner, config: LowerConfig, bar) -> LoweredProgram:
    """:func:`lower` after its checks; ``bar.step(label)`` marks each step (``progress.bar``)."""
    decomposed = {}
    for name, ep in programs.items():
        bar.step(f"decompose {name}")
        decomposed[name] = _decompose(name, ep, partitioner)
    symbols = {name: _symbols(name, ep) for name, ep in decomposed.items()}
    dropped = drop_unread_state(decomposed)
    # Mutations are explicit once functionalized: state is what any decomposed method writes back.
    mutated = {fqn for ep in decomposed.values() for fqn in ep.graph_signature.buffers_to_mutate.values()}
    graphs = []
    with remembered_checks():  # a weight's quantized form is checked once, whichever methods read it
        for name, ep in decomposed.items():
            bar.step(f"partition {name}")
            with symbol_ranges(*symbols[name][1:]):  # sizes over the method's symbols are decided for their range
                graphs.append(_partition(name, ep, partitioner, config, mutated))
            graphs[-1].fused[:0] = dropped[name]
    state = place_state(graphs, config.enable_non_cpu_memory_planning)
    constants = ConstantTable()
    methods, reports = [], {}
    for graph in graphs:
        bar.step(f"lower {graph.name}")
        inplace = reinplace(graph, state)
        with symbol_ranges(*symbols[graph.name][1:]):
            graph.fused += kv_append(graph)  # after reinplace: it reads the in-place marks
            method, reports[graph.name] = _lower_method(graph, state, constants, config)
        method.symbols = symbols[graph.name][0]
        reports[graph.name].inplace = inplace
        reports[graph.name].folded = graph.folded
        reports[graph.name].fused = graph.fused
        methods.append(method)
    program = Program(methods, constants.constants)
    bar.step("plan memory")
    plan_slots(program)
    binary_data = []
    if config.kernel_archs:
        bar.step(f"compile kernels for {', '.join(config.kernel_archs)}")
        compiled = compile_binaries(program, config.kernel_archs)
        program.binaries, binary_data = compiled.binaries, compiled.data
    external = [i for i, c in enumerate(program.constants) if config.is_external(c.name)]
    if external:
        program.external_files = ["weights.safetensors"]
        for i in external:
            program.constants[i].external = 0
    return LoweredProgram(program, constants.data, reports, state, binary_data)


def _decompose(name: str, ep, partitioner: Partitioner) -> torch.export.ExportedProgram:
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(f"method {name!r}: expected an ExportedProgram, got {type(ep).__name__}")
    keep = partitioner.ops_to_not_decompose(ep)
    ep = decompose(ep, keep=keep)
    with symbol_ranges(*_symbols(name, ep)[1:]):  # what the partitioner claims at the method's sizes
        ep = decompose_unclaimed(ep, partitioner.claims, keep)
    cast_state_updates(name, ep)
    fold_repeat_kv(ep.graph_module)
    _detach_size_nodes(ep.graph_module)
    return ep


def _refuse_data_dependent(name: str, ep) -> None:
    """A node whose result's size depends on tensor data (``x[mask]``, ``nonzero``: an unbacked
    symbol) cannot get memory planned before the call: refused, naming the node."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in ep.graph_module.graph.nodes:
        vals = node.meta.get("val")
        for val in vals if isinstance(vals, (tuple, list)) else (vals,):
            found = free_unbacked_symbols(val) if isinstance(val, torch.Tensor) else set()
            if found:
                raise LoweringError(
                    f"method {name!r}: the size of {node.name!r} ({node.target}) depends on tensor data "
                    f"({tuple(val.shape)}, {', '.join(sorted(map(str, found)))} known only when it runs); "
                    "tritondelegate plans memory from input sizes before a call, so it cannot lower it")


def _symbols(name: str, ep) -> tuple[list[Symbol], dict, object]:
    """The method's bounded dynamic dimensions, each bound to the first user input dimension that is
    exactly that symbol, ``{sympy symbol: (min, max)}``, and the fake mode of its dynamic inputs. A
    dimension without a finite maximum is refused, naming the input and dimension and how to bound it."""
    user_inputs = [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    placeholders = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    symbols, ranges, fake_mode = [], {}, None
    for position, input_name in enumerate(user_inputs):
        val = placeholders[input_name].meta.get("val")
        for dim, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, int):
                continue
            fake_mode = getattr(val, "fake_mode", None)
            expr = size.node.expr
            for symbol in expr.free_symbols:
                bounds = ep.range_constraints.get(symbol)
                upper = getattr(bounds, "upper", None)
                if upper is None or not bool(getattr(upper, "is_Integer", False)):  # sympy's or torch's oo
                    raise LoweringError(
                        f"method {name!r}: input {input_name!r} dimension {dim} is dynamic ({size}) without an "
                        "upper bound. tritondelegate plans memory for the largest size: bound it with "
                        "torch.export.Dim(..., max=N) in dynamic_shapes.")
                ranges[symbol] = (int(bounds.lower), int(upper))
            if expr.is_Symbol and expr.name not in {s.name for s in symbols}:
                lo, hi = ranges[expr]
                symbols.append(Symbol(expr.name, lo, hi, position, dim))
    _refuse_data_dependent(name, ep)
    unbound = sorted(str(s) for s in ranges if s.name not in {sym.name for sym in symbols})
    if unbound:
        raise LoweringError(
            f"method {name!r}: symbols {unbound} appear only inside expressions of input sizes; each "
            "dynamic dimension must be exactly one input dimension somewhere (no derived-only Dims)")
    return symbols, ranges, fake_mode


def _detach_size_nodes(gm: torch.fx.GraphModule) -> None:
    """Size nodes (``sym_size``, arithmetic on SymInts) keep their value (``meta["val"]``, an
    expression over the symbols) but lose their arguments: the runtime evaluates sizes from the
    symbols, so they read no tensor and tie no delegate to a host node."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_size_node(node):
            node.args, node.kwargs = (), {}
            node.target = symbolic_size


def symbolic_size():
    """The target of a detached size node (never called: see ``_detach_size_nodes``)."""
    raise RuntimeError("a size node is evaluated from the method's symbols, not called")


def _partition(name: str, ep, partitioner: Partitioner, config: LowerConfig, state: set[str]) -> MethodGraph:
    """Fold what depends on no input (never state) and let the partitioner tag the method."""
    device_config = config.device_config(name)
    fused = fuse_patterns(ep, state, config.fold_constants)
    folded = fold_constants(ep, state) if config.fold_constants else []
    return MethodGraph(name, ep, partitioner.partition(ep), device_config.flag("state_on_device", name), folded,
                       fused)


def _lower_method(graph: MethodGraph, state: dict, constants: ConstantTable, config: LowerConfig):
    """Emit one partitioned method, place its values and copies, plan its arena."""
    name = graph.name
    method, nodes = emit_method(name, graph.ep, graph.partition, constants, state)
    device_pass = PropagateDevicePass(config.device_config(name), config.enable_non_cpu_memory_planning, state)
    try:
        device_pass(method)
    except (LoweringError, ValueError, TypeError):
        raise
    except Exception as exc:  # a bug in the pass: say which pass
        raise LoweringError(f"{device_pass.name} failed on method {name!r}: {exc}") from exc
    plan_method(method, config.alloc_graph_input, config.alloc_graph_output)
    verify_method(method)
    report = MethodReport(
        nodes, device_pass.report,
        {i.name: len(method.delegates[i.delegate].plan.launches)
         for i in method.instructions if i.kind == InstrKind.DELEGATE},
    )
    return method, report
