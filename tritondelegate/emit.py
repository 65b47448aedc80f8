"""Emit a method: a partitioned, fused graph -> :class:`program.Method` (all values on the host).

Each tag's nodes are fused into one ``call_module`` with torch.fx's ``fuse_by_partitions``;
constants stay outside as method-level inputs of the delegate. Host nodes become ATen
instructions with their arguments encoded as :class:`HostArg`. Device placement and copies come
later, from the device propagation pass.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from .backend import build_plan
from .dtypes import dtype_name
from .errors import LoweringError
from .kernels import sizes
from .kernels.sizes import is_size_node
from .kernels.registry import lookup
from .partitioner import PartitionResult, op_name
from .runtime.host_ops import HOST_NAMESPACES
from .runtime.inputs import RETURN_TYPES
from .symbolic import Expr
from .program import (
    HostArgKind,
    Constant,
    Delegate,
    HostArg,
    Instruction,
    InstrKind,
    Method,
    Role,
    TensorValue,
)


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
    """``val``'s value; a dynamic dim is a ``symbolic.Expr``, and ``nbytes`` is at the symbols' bounds."""
    if not isinstance(val, torch.Tensor):
        raise LoweringError(f"value {name!r} is a {type(val).__name__}; only tensor values are supported")
    shape = sizes.shape(val.shape)
    nbytes = sizes.upper(val.numel()) * val.element_size()
    return TensorValue(name, dtype_name(val.dtype), sizes.to_plan(shape), "cpu", role, nbytes, constant=constant)


@dataclass(frozen=True)
class _Size:
    expr: object  # a sympy expression over the method's symbols


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


def count_nodes(ep: torch.export.ExportedProgram, result: PartitionResult) -> NodeInfo:
    """What the summary reports about the method's nodes: compute and view nodes, delegated or why not."""
    info = NodeInfo()
    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem and not is_size_node(node):
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
    return info


def emit_method(name: str, ep: torch.export.ExportedProgram, result: PartitionResult,
                constants: ConstantTable, state_buffers: "set[str] | dict" = frozenset()) -> tuple[Method, NodeInfo]:
    """``state_buffers``: the FQNs of the program's state buffers (mutated by any method); in this method they
    are state values even where it only reads them."""
    info = count_nodes(ep, result)
    gm = _fuse(ep, result)
    emitter = _Emitter(ep, result, constants, state_buffers, gm._td_tags)
    for node in gm.graph.nodes:
        emitter.visit(gm, node)
    method = Method(
        name=name,
        values=emitter.values,
        inputs=emitter.user_inputs,
        outputs=emitter.user_outputs,
        input_spec=pytree.treespec_dumps(ep.call_spec.in_spec),
        output_spec=pytree.treespec_dumps(_serializable(ep.call_spec.out_spec)),
        instructions=emitter.instructions,
        delegates=emitter.delegates,
        arenas=[],
        mutated_buffers=emitter.mutations,
    )
    return method, info


def _serializable(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """``spec`` with every named tuple as a plain tuple, which pytree can serialize: a
    ``torch.return_types`` one (``torch.max(x, 1)``) keeps its class name as the tuple's context, and
    the runtime rebuilds it (``runtime.inputs.output_structure``); a user's named tuple is returned
    as a tuple."""
    if spec.is_leaf():
        return spec
    children = [_serializable(c) for c in spec.children()]
    if pytree.is_structseq_class(spec.type) or pytree.is_namedtuple_class(spec.type):
        named = spec.type in torch.return_types.all_return_types
        return pytree.TreeSpec(tuple, f"{RETURN_TYPES}{spec.type.__name__}" if named else None, children)
    return pytree.TreeSpec(spec.type, spec.context, children)


class _Emitter:
    """Walks the fused graph once: placeholders become inputs, constants and state; delegate calls
    become launch plans; other ATen nodes become host instructions; the output node names the
    method's outputs and its state write-backs."""

    def __init__(self, ep, result: PartitionResult, constants: ConstantTable, state_buffers, tags: dict):
        self.ep, self.result, self.constants, self.state_buffers, self.tags = ep, result, constants, state_buffers, tags
        self.state_dict = {**ep.state_dict, **ep.constants}
        # By position: fusing may rename a placeholder (one named like a builtin, e.g. "input").
        self.input_specs = iter(ep.graph_signature.input_specs)
        self.values: list[TensorValue] = []
        self.env: dict[torch.fx.Node, object] = {}  # node -> value id, or tuple of ids
        self.instructions: list[Instruction] = []
        self.delegates: list[Delegate] = []
        self.user_inputs: list[int] = []
        self.user_outputs: list[int] = []
        self.mutations: list[tuple[int, int]] = []
        self.buffer_values: dict[str, int] = {}

    def new_value(self, v: TensorValue) -> int:
        self.values.append(v)
        return len(self.values) - 1

    def visit(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        if node.op == "placeholder":
            self.placeholder(node)
        elif node.op == "call_module":
            self.delegate(gm, node)
        elif node.op == "call_function" and node.target is operator.getitem:
            self.env[node] = self.env[node.args[0]][node.args[1]]
        elif is_size_node(node):  # no instruction: the runtime evaluates it wherever an op takes it
            self.env[node] = _Size(sizes.size(node.meta["val"]))
        elif node.op == "call_function":
            self.host_op(node)
        elif node.op == "output":
            self.output(node)

    def placeholder(self, node: torch.fx.Node) -> None:
        spec = next(self.input_specs)
        if spec.kind == InputKind.USER_INPUT:
            # the signature's name: fusing renames a placeholder named like a builtin ("input" -> "input_1")
            vid = self.new_value(_tensor_value(spec.arg.name, node.meta.get("val"), Role.INPUT))
            self.user_inputs.append(vid)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            tensor = self.state_dict[spec.target]
            is_state = spec.target in self.state_buffers
            index = self.constants.add(spec.target, tensor, snapshot=is_state)
            role = Role.MUTABLE_BUFFER if is_state else Role.CONSTANT
            name = self.constants.constants[index].name  # spec.target, or "target#k" for a different tensor
            vid = self.new_value(_tensor_value(name, tensor, role, constant=index))
            if is_state:
                self.buffer_values[spec.target] = vid
        else:
            raise LoweringError(f"input {node.name!r} of kind {spec.kind.name} is not supported")
        self.env[node] = vid

    def delegate(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        sub = gm.get_submodule(node.target)
        tag = self.tags[node.target]
        spec = self.result.specs[tag]
        sub_inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for outer, inner in zip(node.args, sub_inputs):
            inner.meta.setdefault("val", outer.meta["val"])
        sub_nodes = [n for n in sub.graph.nodes if n.op == "call_function"]
        sub_outputs = list(next(n for n in sub.graph.nodes if n.op == "output").args[0])
        aliases: dict[int, int] = {}  # output -> the input it updated in place (state)
        plan = build_plan(sub_nodes, sub_inputs, sub_outputs, aliases=aliases)
        tensors = [a for a in node.args if not isinstance(self.env[a], _Size)]  # the plan's inputs
        results = [
            self.env[tensors[aliases[i]]] if i in aliases
            else self.new_value(_tensor_value(f"{tag}.out{i}", o.meta["val"], Role.INTERMEDIATE))
            for i, o in enumerate(sub_outputs)
        ]
        self.delegates.append(Delegate(spec.backend_id, spec.device, plan))
        self.instructions.append(Instruction(
            InstrKind.DELEGATE, inputs=[self.env[a] for a in tensors],
            outputs=[v for i, v in enumerate(results) if i not in aliases],
            delegate=len(self.delegates) - 1, name=tag,
        ))
        self.env[node] = tuple(results)

    def host_op(self, node: torch.fx.Node) -> None:
        if not isinstance(node.target, torch._ops.OpOverload):
            raise LoweringError(f"node {node.name!r} calls {node.target}, which is not an ATen operator")
        if node.target.namespace not in HOST_NAMESPACES:  # the runtime could not run it: refuse it now
            reason = self.result.refused.get(node.name, "the partitioner did not claim it")
            raise LoweringError(
                f"op '{node.target.name()}' (node {node.name!r}) is not an ATen operator and no delegate claims it "
                f"({reason}); a program runs only ATen and tritondelegate ops on the host. Export the model "
                "without it, or lower it with a partitioner that delegates it")
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            outs = tuple(
                self.new_value(_tensor_value(f"{node.name}.{i}", v, Role.INTERMEDIATE))
                if isinstance(v, torch.Tensor) else -1
                for i, v in enumerate(val)
            )
            self.env[node] = outs
            out_list = list(outs)
        else:
            vid = self.new_value(_tensor_value(node.name, val, Role.INTERMEDIATE))
            self.env[node] = vid
            out_list = [vid]
        args = [self.encode(a) for a in node.args] + [self.encode(v, k) for k, v in node.kwargs.items()]
        reads = sorted({a.value for a in args if a.kind == HostArgKind.TENSOR}
                       | {v for a in args if a.kind == HostArgKind.TENSOR_LIST for v in a.value if v >= 0})
        self.instructions.append(Instruction(
            InstrKind.HOST_OP, inputs=reads, outputs=out_list, target=node.target.name(), args=args, name=node.name,
        ))

    def output(self, node: torch.fx.Node) -> None:
        for out_spec, arg in zip(self.ep.graph_signature.output_specs, list(node.args[0])):
            vid = self.env[arg] if isinstance(arg, torch.fx.Node) else None
            if not isinstance(vid, int):
                raise LoweringError(f"method output {arg!r} is not a tensor; only tensor outputs are supported")
            if out_spec.kind == OutputKind.USER_OUTPUT:
                self.user_outputs.append(vid)
            elif out_spec.kind == OutputKind.BUFFER_MUTATION:
                if vid != self.buffer_values[out_spec.target]:  # else updated in place: nothing to write back
                    self.mutations.append((self.buffer_values[out_spec.target], vid))
            elif out_spec.kind == OutputKind.USER_INPUT_MUTATION:
                warnings.warn(
                    f"the method writes into its input {out_spec.target!r} in place ({arg.name}, "
                    "e.g. embedding(max_norm=...) or a training-mode batch norm's running statistics): the lowered "
                    "method computes with the new value but never writes to the caller's tensors", stacklevel=4)
            else:
                raise LoweringError(f"output kind {out_spec.kind.name} is not supported")

    def encode(self, arg, kwname="") -> HostArg:
        """One argument of a host op as a :class:`HostArg`."""
        if isinstance(arg, torch.fx.Node):
            vid = self.env[arg]
            if isinstance(vid, _Size):
                return self._encode_size(vid.expr, kwname)
            if not isinstance(vid, int):
                raise LoweringError(f"argument {arg.name!r} is not a single tensor")
            return HostArg(HostArgKind.TENSOR, vid, kwname)
        if isinstance(arg, (list, tuple)):
            return self._encode_list(list(arg), kwname)
        for kinds, kind, convert in _SCALAR_ENCODINGS:
            if isinstance(arg, kinds):
                return HostArg(kind, convert(arg), kwname)
        raise LoweringError(f"cannot encode argument {arg!r} of a host op")

    def _encode_size(self, expr, kwname: str) -> HostArg:
        value = sizes.to_plan(expr)
        return HostArg(HostArgKind.INT if isinstance(value, int) else HostArgKind.SYM_INT, value, kwname)

    def _encode_list(self, items: list, kwname: str) -> HostArg:
        if any(isinstance(a, torch.fx.Node) and isinstance(self.env[a], _Size) for a in items):
            values = [sizes.to_plan(self.env[a].expr) if isinstance(a, torch.fx.Node) else a for a in items]
            if not all(isinstance(v, (int, Expr)) for v in values):
                raise LoweringError(f"cannot encode argument {items!r} of a host op")
            return HostArg(HostArgKind.SYM_INT_LIST, values, kwname)
        if any(isinstance(a, torch.fx.Node) for a in items):
            return HostArg(HostArgKind.TENSOR_LIST, [-1 if a is None else self.encode(a).value for a in items], kwname)
        if all(isinstance(a, bool) for a in items) and items:
            return HostArg(HostArgKind.BOOL_LIST, items, kwname)
        if all(isinstance(a, int) and not isinstance(a, bool) for a in items):
            return HostArg(HostArgKind.INT_LIST, items, kwname)
        if all(isinstance(a, (int, float)) for a in items):
            return HostArg(HostArgKind.FLOAT_LIST, [float(a) for a in items], kwname)
        raise LoweringError(f"cannot encode argument {items!r} of a host op")


_STRIP = lambda v: str(v).removeprefix("torch.")  # noqa: E731
# (python types, kind, how the value is stored), in order: bool before int, None first.
_SCALAR_ENCODINGS = (
    (type(None), HostArgKind.NONE, lambda v: None),
    (bool, HostArgKind.BOOL, bool),
    (int, HostArgKind.INT, int),
    (float, HostArgKind.FLOAT, float),
    (str, HostArgKind.STR, str),
    (torch.dtype, HostArgKind.DTYPE, dtype_name),
    (torch.device, HostArgKind.DEVICE, str),
    (torch.memory_format, HostArgKind.MEMORY_FORMAT, _STRIP),
    (torch.layout, HostArgKind.LAYOUT, _STRIP),
)
