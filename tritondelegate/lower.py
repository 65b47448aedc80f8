"""``lower()``: exported programs -> a program with Triton delegates, ready to save or run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .binaries import check_archs, compile_binaries
from .config import LowerConfig
from .decompose import decompose
from .emit import ConstantTable, LoweringError, NodeInfo, emit_method
from .memory.method_plan import plan_method
from .memory.segments import plan_slots
from .partitioner import Partitioner, TritonPartitioner
from .passes.fold_constants import fold_constants
from .passes.fold_repeat_kv import fold_repeat_kv
from .passes.propagate_device import DeviceReport, PropagateDevicePass
from .passes.state import MethodGraph, StateBuffer, place_state, reinplace
from .passes.verify import verify_method
from .program import InstrKind, Program


@dataclass
class MethodReport:
    nodes: NodeInfo
    device: DeviceReport
    launches: dict[str, int] = field(default_factory=dict)  # delegate tag -> launches per call
    inplace: list[str] = field(default_factory=list)  # state updates that write in place
    folded: list[str] = field(default_factory=list)  # nodes computed once by lower(), now constants


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

    @property
    def method_names(self) -> list[str]:
        return [m.name for m in self.program.methods]

    def save(self, path: str | os.PathLike) -> list[str]:
        """Write the program file (and the external weights file, if any). Returns the paths written."""
        from .serialize.writer import save_program

        path = os.fspath(path)
        if self.program.external_files:
            # Recorded by name, next to the program file: "model.tdp" -> "model.weights.safetensors".
            stem = os.path.splitext(os.path.basename(path))[0]
            self.program.external_files = [f"{stem}.weights.safetensors"]
        return save_program(self.program, self.constant_data, path, binary_data=self.binary_data)

    def load(self, devices="auto"):
        """Run without a file: the same runtime, with constants read from memory."""
        from .runtime.loader import InMemorySource, LoadedProgram

        return LoadedProgram(InMemorySource(self.program, self.constant_data, self.binary_data), devices=devices)

    def summary(self) -> str:
        from .summary import format_summary

        return format_summary(self)

    def __repr__(self) -> str:
        return f"LoweredProgram(methods={self.method_names})"


def lower(
    programs: "torch.export.ExportedProgram | dict[str, torch.export.ExportedProgram]",
    partitioner: Partitioner | None = None,
    config: LowerConfig | None = None,
) -> LoweredProgram:
    """Lower one exported program (method ``"forward"``) or a dict of them by method name.

    Nodes the partitioner claims run in Triton delegates on their device; the rest run on the host
    through ATen. Constants are stored once in the program, whichever methods read them; a buffer
    that any method mutates is program state, shared by every method of a loaded program.
    """
    if isinstance(programs, torch.export.ExportedProgram):
        programs = {"forward": programs}
    if not isinstance(programs, dict) or not programs:
        raise TypeError("lower() takes an ExportedProgram or a non-empty dict of method name -> ExportedProgram")
    partitioner = TritonPartitioner() if partitioner is None else partitioner
    config = LowerConfig() if config is None else config
    check_archs(config.kernel_archs)
    decomposed = {name: _decompose(name, ep, partitioner) for name, ep in programs.items()}
    # Mutations are explicit once functionalized: state is what any decomposed method writes back.
    mutated = {fqn for ep in decomposed.values() for fqn in ep.graph_signature.buffers_to_mutate.values()}
    graphs = [_partition(name, ep, partitioner, config, mutated) for name, ep in decomposed.items()]
    state = place_state(graphs, config.enable_non_cpu_memory_planning)
    constants = ConstantTable()
    methods, reports = [], {}
    for graph in graphs:
        inplace = reinplace(graph, state)
        method, reports[graph.name] = _lower_method(graph, state, constants, config)
        reports[graph.name].inplace = inplace
        reports[graph.name].folded = graph.folded
        methods.append(method)
    program = Program(methods, constants.constants)
    plan_slots(program)
    binary_data = []
    if config.kernel_archs:
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
    _refuse_dynamic_shapes(name, ep)
    ep = decompose(ep, keep=partitioner.ops_to_not_decompose(ep))
    fold_repeat_kv(ep.graph_module)
    return ep


def _refuse_dynamic_shapes(name: str, ep) -> None:
    """Programs run with the shapes they were exported with; a dynamic dimension is refused up front,
    naming it, rather than lowered into a program that only accepts the example's size."""
    for node in ep.graph_module.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if not isinstance(val, torch.Tensor):
            continue
        for dim, size in enumerate(val.shape):
            if isinstance(size, int):
                continue
            bounds = ep.range_constraints.get(size.node.expr)
            upper = getattr(bounds, "upper", None)
            bounded = upper is not None and bool(getattr(upper, "is_Integer", False))  # not sympy's or torch's oo
            how = (f"bounded {bounds.lower}..{upper}" if bounded
                   else "without an upper bound (bound it with torch.export.Dim(..., max=N))")
            raise LoweringError(
                f"method {name!r}: input {node.name!r} dimension {dim} is dynamic ({size}, {how}). tritondelegate "
                "plans memory and launches for static shapes: export with concrete example shapes (no "
                "dynamic_shapes), or export one method per size you need into one program (they share the "
                "weights and the state)."
            )


def _partition(name: str, ep, partitioner: Partitioner, config: LowerConfig, state: set[str]) -> MethodGraph:
    """Fold what depends on no input (never state) and let the partitioner tag the method."""
    device_config = config.device_config(name)
    folded = fold_constants(ep, state) if config.fold_constants else []
    return MethodGraph(name, ep, partitioner.partition(ep), device_config.flag("state_on_device", name), folded)


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
