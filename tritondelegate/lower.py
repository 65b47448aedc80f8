"""``lower()``: exported programs -> a program with Triton delegates, ready to save or run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .config import LowerConfig
from .decompose import decompose
from .emit import ConstantTable, LoweringError, NodeInfo, emit_method
from .memory.method_plan import plan_method
from .partitioner import Partitioner, TritonPartitioner
from .passes.fold_repeat_kv import fold_repeat_kv
from .passes.propagate_device import DeviceReport, PropagateDevicePass
from .passes.verify import verify_method
from .program import InstrKind, Program


@dataclass
class MethodReport:
    nodes: NodeInfo
    device: DeviceReport
    launches: dict[str, int] = field(default_factory=dict)  # delegate tag -> launches per call


class LoweredProgram:
    """The result of :func:`lower`: save it with :meth:`save`, read :meth:`summary`, or run it in
    memory with :meth:`load`."""

    def __init__(self, program: Program, constant_data: list[torch.Tensor], reports: dict[str, MethodReport]):
        self.program = program
        self.constant_data = constant_data
        self.reports = reports

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
        return save_program(self.program, self.constant_data, path)

    def load(self, devices="auto"):
        """Run without a file: the same runtime, with constants read from memory."""
        from .runtime.loader import InMemorySource, LoadedProgram

        return LoadedProgram(InMemorySource(self.program, self.constant_data), devices=devices)

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
    through ATen. Constants are stored once in the program, whichever methods read them.
    """
    if isinstance(programs, torch.export.ExportedProgram):
        programs = {"forward": programs}
    if not isinstance(programs, dict) or not programs:
        raise TypeError("lower() takes an ExportedProgram or a non-empty dict of method name -> ExportedProgram")
    partitioner = TritonPartitioner() if partitioner is None else partitioner
    config = LowerConfig() if config is None else config
    constants = ConstantTable()
    methods, reports = [], {}
    for name, ep in programs.items():
        if not isinstance(ep, torch.export.ExportedProgram):
            raise TypeError(f"method {name!r}: expected an ExportedProgram, got {type(ep).__name__}")
        device_config = config.device_config(name)
        ep = decompose(ep, keep=partitioner.ops_to_not_decompose(ep))
        fold_repeat_kv(ep.graph_module)
        result = partitioner.partition(ep)
        method, nodes = emit_method(name, ep, result, constants)
        device_pass = PropagateDevicePass(device_config, config.enable_non_cpu_memory_planning)
        try:
            device_pass(method)
        except (LoweringError, ValueError, TypeError):
            raise
        except Exception as exc:  # a bug in the pass: say which pass
            raise LoweringError(f"{device_pass.name} failed on method {name!r}: {exc}") from exc
        plan_method(method, config.alloc_graph_input, config.alloc_graph_output)
        verify_method(method)
        methods.append(method)
        reports[name] = MethodReport(
            nodes, device_pass.report,
            {i.name: len(method.delegates[i.delegate].plan.launches)
             for i in method.instructions if i.kind == InstrKind.DELEGATE},
        )
    program = Program(methods, constants.constants)
    external = [i for i, c in enumerate(program.constants) if config.is_external(c.name)]
    if external:
        program.external_files = ["weights.safetensors"]
        for i in external:
            program.constants[i].external = 0
    return LoweredProgram(program, constants.data, reports)
