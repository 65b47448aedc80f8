"""Partitioners: which nodes of an exported program run in which delegate, on which device.

A partitioner only *tags*: :meth:`Partitioner.partition` returns a :class:`PartitionResult` mapping
node names to tags, a :class:`DelegationSpec` per tag, and a readable reason for every node it
refused. It never rewrites the graph; ``lower()`` fuses each tag into a delegate call.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from ._device import parse_device
from .backend import BACKEND_ID, symbolic_refusal
from .kernels import registry, sizes


@dataclass(frozen=True)
class DelegationSpec:
    """Where a tag's nodes run: a backend id, a device such as ``"cuda:0"``, and backend options."""

    backend_id: str
    device: str = "cuda:0"
    options: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "device", str(parse_device(self.device)))


@dataclass
class PartitionResult:
    tags: dict[str, str]  # node name -> tag
    specs: dict[str, DelegationSpec]  # tag -> spec
    refused: dict[str, str] = field(default_factory=dict)  # node name -> reason it stays on the host


class Partitioner:
    """Base class of partitioners. Subclass it and implement :meth:`partition`."""

    def ops_to_not_decompose(self, exported_program: torch.export.ExportedProgram) -> list:
        """ATen ops to keep whole through decomposition (because a fused kernel exists for them)."""
        return []

    def claims(self, node: torch.fx.Node) -> bool:
        """Whether this partitioner would claim ``node`` (a call of an ATen overload in a decomposed
        program): an op it does not claim is decomposed further where torch decomposes it into nodes it
        claims. By default nothing is decomposed beyond core ATen."""
        return True

    def partition(self, exported_program: torch.export.ExportedProgram) -> PartitionResult:
        raise NotImplementedError


def op_name(target) -> str:
    """``aten.mm.default`` for an overload; the plain name otherwise."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _resolve_ops(ops: Iterable) -> set:
    """Turn overloads and names (``"aten.mm"``, ``"aten.mm.default"``) into a set of overloads."""
    known = {op_name(op): op for op in registry.OPS}
    chosen = set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            op = op_name(op.default).rsplit(".", 1)[0]
        if isinstance(op, torch._ops.OpOverload):
            if registry.lookup(op) is None:
                raise ValueError(f"{op_name(op)} has no Triton kernel in this version of tritondelegate")
            chosen.add(op)
            continue
        name = str(op).removeprefix("torch.ops.")
        matches = {o for n, o in known.items() if n == name or n.rsplit(".", 1)[0] == name}
        if not matches:
            raise ValueError(
                f"ops= names {op!r}, which has no Triton kernel; ops with kernels include: "
                + ", ".join(sorted({n.rsplit('.', 1)[0] for n in known}))
            )
        chosen |= matches
    return chosen


def _symbolic(node: torch.fx.Node) -> bool:
    """Whether a tensor the node reads or produces has a size that depends on the method's symbols."""
    vals = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    vals = [v for x in vals for v in (x if isinstance(x, (tuple, list)) else [x])]
    return any(isinstance(v, torch.Tensor) and not sizes.is_static(tuple(v.shape)) for v in vals)


class _TritonSupport(OperatorSupportBase):
    def __init__(self, allowed: set | None):
        self.allowed = allowed
        self.refused: dict[str, str] = {}

    def reason(self, node: torch.fx.Node) -> str | None:
        if node.target is operator.getitem:
            parent = node.args[0]
            return None if parent.op == "call_function" and self.reason(parent) is None else "its producer runs on the host"
        spec = registry.lookup(node.target)
        if spec is None:
            return f"no Triton kernel for {op_name(node.target)}"
        if self.allowed is not None and node.target not in self.allowed:
            return f"{op_name(node.target)} is not in the partitioner's ops="
        val = node.meta.get("val")
        if val is None:
            return "the node has no shape/dtype metadata"
        reason = spec.support(node)
        if reason is None and _symbolic(node):
            reason = symbolic_refusal(node)
        return reason

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        reason = self.reason(node)
        if reason is not None:
            self.refused[node.name] = reason
        return reason is None


class TritonPartitioner(Partitioner):
    """Claims every node whose op has a Triton kernel that supports it, grouped without cycles.

    ``device``: where the delegates run, e.g. ``"cuda:0"`` (case-insensitive; the index defaults to 0).
    ``ops``: optionally limit the ops it may claim (overloads, or names like ``"aten.mm"``).
    """

    def __init__(self, device: str = "cuda:0", ops: Iterable | None = None):
        self.device = str(parse_device(device))
        if parse_device(device).is_host:
            raise ValueError("TritonPartitioner needs a device such as 'cuda:0', not the host")
        self.ops = None if ops is None else _resolve_ops(ops)

    def ops_to_not_decompose(self, exported_program) -> list:
        from .decompose import default_keep

        keep = default_keep()
        return keep if self.ops is None else [op for op in keep if op in self.ops]

    def claims(self, node: torch.fx.Node) -> bool:
        return _TritonSupport(self.ops).reason(node) is None

    def partition(self, exported_program) -> PartitionResult:
        gm = copy.deepcopy(exported_program.graph_module)
        support = _TritonSupport(self.ops)
        partitions = CapabilityBasedPartitioner(
            gm, support, allows_single_node_partition=True
        ).propose_partitions()
        tags, specs = {}, {}
        spec = DelegationSpec(BACKEND_ID, self.device)
        for i, partition in enumerate(sorted(partitions, key=lambda p: min(_order(gm, n) for n in p.nodes))):
            tag = f"triton_{i}"
            specs[tag] = spec
            for node in partition.nodes:
                tags[node.name] = tag
        refused = {
            n.name: support.refused.get(n.name) or support.reason(n) or "grouping left it out"
            for n in gm.graph.nodes
            if n.op == "call_function" and n.name not in tags
        }
        return PartitionResult(tags, specs, refused)


def _order(gm, node) -> int:
    if not hasattr(gm, "_td_order"):
        gm._td_order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return gm._td_order[node]
