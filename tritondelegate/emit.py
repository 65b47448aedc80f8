"""Emit a method: a partitioned, fused graph -> :class:`program.Method` (all values on the host).

Each tag's nodes are fused into one ``call_module`` with torch.fx's ``fuse_by_partitions``;
constants stay outside as method-level inputs of the delegate. Host nodes become ATen
instructions with their arguments encoded as :class:`HostArg`. Device placement and copies come
later, from the device propagation pass.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from .backend import build_plan
from .kernels.builder import dtype_name
from .kernels.registry import lookup
from .partitioner import PartitionResult, op_name
from .program import (
    ArgKind,
    Constant,
    Delegate,
    HostArg,
    Instruction,
    InstrKind,
    Method,
    Role,
    TensorValue,
)


class LoweringError(ValueError):
    """The program cannot be lowered as asked (names the node or tag)."""


@dataclass
class ConstantTable:
    """Constants of all methods; one entry per distinct tensor, whoever reads it."""

    constants: list[Constant] = field(default_factory=list)
    data: list[torch.Tensor] = field(default_factory=list)
    _by_name: dict[str, list[int]] = field(default_factory=dict)

    def add(self, name: str, tensor: torch.Tensor, snapshot: bool = False) -> int:
        """The index of ``tensor``'s entry. ``snapshot``: store a copy, not the caller's tensor (state
        buffers: the model keeps writing its own, the program keeps the value it was lowered with)."""
        tensor = tensor.detach()
        for index in self._by_name.get(name, []):
            other = self.data[index]
            if other.dtype == tensor.dtype and other.shape == tensor.shape and (
                other.data_ptr() == tensor.data_ptr() or torch.equal(other, tensor)
            ):
                return index
        stored_name = name if name not in self._by_name else f"{name}#{len(self._by_name[name])}"
        self._by_name.setdefault(name, []).append(len(self.constants))
        contiguous = tensor.contiguous().cpu()
        if snapshot and contiguous.data_ptr() == tensor.data_ptr():
            contiguous = contiguous.clone()
        self.constants.append(
            Constant(stored_name, dtype_name(tensor.dtype), tuple(tensor.shape),
                     contiguous.numel() * contiguous.element_size())
        )
        self.data.append(contiguous)
        return len(self.constants) - 1


@dataclass
class NodeInfo:
    """What the summary reports about a method's nodes."""

    total: int = 0
    views: int = 0
    delegated: int = 0
    host: list[tuple[str, str, str]] = field(default_factory=list)  # (node, op, reason)


def _tensor_value(name, val, role, constant=-1) -> TensorValue:
    if not isinstance(val, torch.Tensor):
        raise LoweringError(f"value {name!r} is a {type(val).__name__}; only tensor values are supported")
    shape = tuple(int(s) for s in val.shape)
    nbytes = val.numel() * val.element_size()
    return TensorValue(name, dtype_name(val.dtype), shape, "cpu", role, nbytes, constant=constant)


def _fuse(ep: torch.export.ExportedProgram, result: PartitionResult) -> torch.fx.GraphModule:
    gm = ep.graph_module
    by_name = {n.name: n for n in gm.graph.nodes}
    groups: dict[str, dict] = {}
    for name, tag in result.tags.items():
        node = by_name.get(name)
        if node is None or node.op != "call_function":
            raise LoweringError(f"partitioner tagged {name!r}, which is not an operator node of the graph")
        if tag not in result.specs:
            raise LoweringError(f"partitioner tag {tag!r} (node {name!r}) has no DelegationSpec")
        groups.setdefault(tag, {})[node] = None
    tags = list(groups)
    try:
        gm = fuse_by_partitions(gm, [groups[t] for t in tags], prefix="delegate_", always_return_tuple=True)
    except Exception as exc:
        raise LoweringError(f"cannot fuse the partitioner's tags into delegates (a cycle between tags?): {exc}") from exc
    gm._td_tags = {f"delegate_{i}": t for i, t in enumerate(tags)}
    return gm


def emit_method(name: str, ep: torch.export.ExportedProgram, result: PartitionResult,
                constants: ConstantTable, state_buffers: "set[str] | dict" = frozenset()) -> tuple[Method, NodeInfo]:
    """``state_buffers``: the FQNs of the program's state buffers (mutated by any method); in this method they
    are state values even where it only reads them."""
    info = NodeInfo()
    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            spec = lookup(node.target)
            if spec is not None and spec.is_view:
                info.views += 1
            else:
                info.total += 1
            if node.name in result.tags:
                info.delegated += 0 if spec is not None and spec.is_view else 1
            else:
                reason = result.refused.get(node.name, "the partitioner did not claim it")
                info.host.append((node.name, op_name(node.target), reason))
    gm = _fuse(ep, result)
    sig = ep.graph_signature
    state = {**ep.state_dict, **ep.constants}
    input_kinds = {spec.arg.name: spec for spec in sig.input_specs}

    values: list[TensorValue] = []
    env: dict[torch.fx.Node, object] = {}  # node -> value id, or tuple of ids
    instructions: list[Instruction] = []
    delegates: list[Delegate] = []
    user_inputs: list[int] = []
    buffer_values: dict[str, int] = {}

    def new_value(v: TensorValue) -> int:
        values.append(v)
        return len(values) - 1

    def encode(arg, kwname="") -> HostArg:
        if isinstance(arg, torch.fx.Node):
            vid = env[arg]
            if not isinstance(vid, int):
                raise LoweringError(f"argument {arg.name!r} is not a single tensor")
            return HostArg(ArgKind.TENSOR, vid, kwname)
        if arg is None:
            return HostArg(ArgKind.NONE, None, kwname)
        if isinstance(arg, bool):
            return HostArg(ArgKind.BOOL, arg, kwname)
        if isinstance(arg, int):
            return HostArg(ArgKind.INT, arg, kwname)
        if isinstance(arg, float):
            return HostArg(ArgKind.FLOAT, arg, kwname)
        if isinstance(arg, str):
            return HostArg(ArgKind.STR, arg, kwname)
        if isinstance(arg, torch.dtype):
            return HostArg(ArgKind.DTYPE, dtype_name(arg), kwname)
        if isinstance(arg, torch.device):
            return HostArg(ArgKind.DEVICE, str(arg), kwname)
        if isinstance(arg, torch.memory_format):
            return HostArg(ArgKind.MEMORY_FORMAT, str(arg).removeprefix("torch."), kwname)
        if isinstance(arg, torch.layout):
            return HostArg(ArgKind.LAYOUT, str(arg).removeprefix("torch."), kwname)
        if isinstance(arg, (list, tuple)):
            items = list(arg)
            if any(isinstance(a, torch.fx.Node) for a in items):
                return HostArg(ArgKind.TENSOR_LIST, [-1 if a is None else encode(a).value for a in items], kwname)
            if all(isinstance(a, bool) for a in items) and items:
                return HostArg(ArgKind.BOOL_LIST, items, kwname)
            if all(isinstance(a, int) and not isinstance(a, bool) for a in items):
                return HostArg(ArgKind.INT_LIST, items, kwname)
            if all(isinstance(a, (int, float)) for a in items):
                return HostArg(ArgKind.FLOAT_LIST, [float(a) for a in items], kwname)
        raise LoweringError(f"cannot encode argument {arg!r} of a host op")

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = input_kinds[node.name]
            val = node.meta.get("val")
            if spec.kind == InputKind.USER_INPUT:
                vid = new_value(_tensor_value(node.name, val, Role.INPUT))
                user_inputs.append(vid)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                tensor = state[spec.target]
                index = constants.add(spec.target, tensor, snapshot=spec.target in state_buffers)
                role = Role.MUTABLE_BUFFER if spec.target in state_buffers else Role.CONSTANT
                vid = new_value(_tensor_value(spec.target, tensor, role, constant=index))
                if role == Role.MUTABLE_BUFFER:
                    buffer_values[spec.target] = vid
            else:
                raise LoweringError(f"input {node.name!r} of kind {spec.kind.name} is not supported")
            env[node] = vid
        elif node.op == "call_module":
            sub = gm.get_submodule(node.target)
            tag = gm._td_tags[node.target]
            spec = result.specs[tag]
            sub_inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
            for outer, inner in zip(node.args, sub_inputs):
                inner.meta.setdefault("val", outer.meta["val"])
            sub_nodes = [n for n in sub.graph.nodes if n.op == "call_function"]
            sub_outputs = list(next(n for n in sub.graph.nodes if n.op == "output").args[0])
            aliases: dict[int, int] = {}  # output -> the input it updated in place (state)
            plan = build_plan(sub_nodes, sub_inputs, sub_outputs, aliases=aliases)
            results = [
                env[node.args[aliases[i]]] if i in aliases
                else new_value(_tensor_value(f"{tag}.out{i}", o.meta["val"], Role.INTERMEDIATE))
                for i, o in enumerate(sub_outputs)
            ]
            delegates.append(Delegate(spec.backend_id, spec.device, plan))
            instructions.append(Instruction(
                InstrKind.DELEGATE, inputs=[env[a] for a in node.args],
                outputs=[v for i, v in enumerate(results) if i not in aliases],
                delegate=len(delegates) - 1, name=tag,
            ))
            env[node] = tuple(results)
        elif node.op == "call_function":
            if node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
                continue
            if not isinstance(node.target, torch._ops.OpOverload):
                raise LoweringError(f"node {node.name!r} calls {node.target}, which is not an ATen operator")
            val = node.meta.get("val")
            if isinstance(val, (tuple, list)):
                outs = tuple(
                    new_value(_tensor_value(f"{node.name}.{i}", v, Role.INTERMEDIATE)) if isinstance(v, torch.Tensor) else -1
                    for i, v in enumerate(val)
                )
                env[node] = outs
                out_list = list(outs)
            else:
                vid = new_value(_tensor_value(node.name, val, Role.INTERMEDIATE))
                env[node] = vid
                out_list = [vid]
            args = [encode(a) for a in node.args] + [encode(v, k) for k, v in node.kwargs.items()]
            reads = sorted({a.value for a in args if a.kind == ArgKind.TENSOR}
                           | {v for a in args if a.kind == ArgKind.TENSOR_LIST for v in a.value if v >= 0})
            instructions.append(Instruction(
                InstrKind.HOST_OP, inputs=reads, outputs=out_list, target=node.target.name(),
                args=args, name=node.name,
            ))
        elif node.op == "output":
            flat = list(node.args[0])
            user_outputs, mutations = [], []
            for out_spec, arg in zip(sig.output_specs, flat):
                vid = env[arg] if isinstance(arg, torch.fx.Node) else None
                if not isinstance(vid, int):
                    raise LoweringError(f"method output {arg!r} is not a tensor; only tensor outputs are supported")
                if out_spec.kind == OutputKind.USER_OUTPUT:
                    user_outputs.append(vid)
                elif out_spec.kind == OutputKind.BUFFER_MUTATION:
                    if vid != buffer_values[out_spec.target]:  # else updated in place: nothing to write back
                        mutations.append((buffer_values[out_spec.target], vid))
                else:
                    raise LoweringError(f"output kind {out_spec.kind.name} is not supported")
    method = Method(
        name=name,
        values=values,
        inputs=user_inputs,
        outputs=user_outputs,
        input_spec=pytree.treespec_dumps(ep.call_spec.in_spec),
        output_spec=pytree.treespec_dumps(ep.call_spec.out_spec),
        instructions=instructions,
        delegates=delegates,
        arenas=[],
        mutated_buffers=mutations,
    )
    return method, info
