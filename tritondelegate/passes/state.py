"""Program state: which buffers are state, where each lives, and which updates run in place.

A buffer that any method of a program mutates is *state*: one instance per loaded program, keyed by
its fully-qualified name, shared by every method that reads or writes it (prefill writes a KV cache,
decode reads and extends it). It lives on device D when every node of every method that touches it
(reads the buffer, or produces the value written back to it) is claimed by a delegate on D and
``state_on_device`` is on for each of those methods; otherwise on the host, copied per call (and
reported like a constant).

Reinplacing: ``run_decompositions()`` turns ``cache[:, :, pos] = k`` into a functional update
``new = index_put(cache, [None, None, pos], k)`` plus a write-back of ``new`` into ``cache`` after
the call. When the cache lives on a device and nothing else reads its old value, the update node
is marked ``meta["td_inplace"]``: its kernel writes only the updated region, straight into the
state's slot, and the write-back disappears. Both passes only read the graph and set that mark.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind

from ..errors import LoweringError
from ..kernels.registry import lookup
from ..kernels.scatter import UPDATE_OPS
from ..partitioner import PartitionResult, op_name
from .rewrite import erase_unused, fake, new_node

aten = torch.ops.aten
HOST = "cpu"
INPLACE = "td_inplace"  # node.meta key read by the scatter-family lowerings



@dataclass
class StateBuffer:
    """Where one state buffer lives, and why it is not on a device when it is not."""

    name: str
    device: str = HOST
    reason: str = ""
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()


@dataclass
class MethodGraph:
    """What the state passes read of one method: its decomposed program and the partitioner's tags."""

    name: str
    ep: torch.export.ExportedProgram
    partition: PartitionResult
    state_on_device: bool = True
    folded: list[str] = field(default_factory=list)  # nodes constant folding replaced
    fused: list[str] = field(default_factory=list)  # rewrites into bigger ops (passes/fuse.py)

    def buffer_nodes(self) -> dict[str, torch.fx.Node]:
        return buffer_nodes(self.ep)

    def updates(self) -> dict[str, torch.fx.Node | None]:
        """FQN -> the node whose value the method writes back to that buffer."""
        output = next(n for n in self.ep.graph_module.graph.nodes if n.op == "output")
        out = {}
        for spec, arg in zip(self.ep.graph_signature.output_specs, output.args[0]):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                out[spec.target] = arg if isinstance(arg, torch.fx.Node) else None
        return out

    def device_of(self, node: torch.fx.Node | None) -> str:
        """The device of the delegate that claimed ``node``; the host when none did."""
        tag = self.partition.tags.get(node.name) if node is not None else None
        return self.partition.specs[tag].device if tag is not None else HOST


def buffer_nodes(ep: torch.export.ExportedProgram) -> dict[str, torch.fx.Node]:
    """FQN -> the placeholder of each buffer the program reads."""
    nodes = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    return {spec.target: nodes[spec.arg.name] for spec in ep.graph_signature.input_specs
            if spec.kind == InputKind.BUFFER}


def cast_state_updates(name: str, ep: torch.export.ExportedProgram) -> list[str]:
    """Give every buffer update its buffer's dtype, as eager's write into the buffer does: a bf16 model
    whose rotary code assigns an fp32 ``inv_freq`` (Phi-3's longrope) writes back fp32 into a bf16
    buffer. A ``_to_copy`` to the buffer's dtype is inserted before the output; an update of another
    shape is a LoweringError naming the buffer. Returns one description per cast."""
    graph = ep.graph_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    buffers = buffer_nodes(ep)
    values, done = list(output.args[0]), []
    for k, spec in enumerate(ep.graph_signature.output_specs):
        buffer, value = buffers.get(spec.target), values[k]
        if spec.kind != OutputKind.BUFFER_MUTATION or buffer is None or not isinstance(value, torch.fx.Node):
            continue
        want, got = buffer.meta.get("val"), value.meta.get("val")
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor) or want.dtype == got.dtype:
            continue
        if tuple(want.shape) != tuple(got.shape):
            raise LoweringError(f"method {name!r} writes {got.dtype}{list(got.shape)} into state buffer "
                                f"{spec.target!r}, which is {want.dtype}{list(want.shape)}")
        with graph.inserting_before(output):
            values[k] = new_node(graph, torch.ops.aten._to_copy.default, (value,),
                                 fake(lambda t: t.to(want.dtype), got), value.meta, kwargs={"dtype": want.dtype})
        done.append(f"state {spec.target!r}: its {got.dtype} update cast to the buffer's {want.dtype}")
    if done:
        output.args = (tuple(values),) + tuple(output.args[1:])
        ep.graph_module.recompile()
    return done


def drop_unread_state(methods: dict[str, torch.export.ExportedProgram]) -> dict[str, list[str]]:
    """Drop the write-backs of a buffer whose incoming value no method reads: every method that touches
    it overwrites it first (``copy_(counter, position)``, as transformers' static cache keeps a
    ``cumulative_length`` per layer) or only writes it. What a method writes there is seen by no later
    call, so it is not computed: the update and what only it reads go, and the buffer is no longer
    state. Returns, per method, one description per write-back dropped."""
    writers: dict[str, list[str]] = {}
    for name, ep in methods.items():
        for fqn in ep.graph_signature.buffers_to_mutate.values():
            writers.setdefault(fqn, []).append(name)
    done: dict[str, list[str]] = {name: [] for name in methods}
    for fqn, names in sorted(writers.items()):
        if any(_reads_data(user, node) for ep in methods.values() if (node := buffer_nodes(ep).get(fqn))
               for user in node.users):
            continue
        for name in names:
            done[name].append(_drop_write_back(methods[name], fqn))
    for name in methods:
        if done[name]:
            methods[name].graph_module.recompile()  # once per method, after all its drops
    return done


def _drop_write_back(ep: torch.export.ExportedProgram, fqn: str) -> str:
    graph = ep.graph_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    specs, values = ep.graph_signature.output_specs, list(output.args[0])
    k = next(i for i, spec in enumerate(specs) if spec.kind == OutputKind.BUFFER_MUTATION and spec.target == fqn)
    value = values.pop(k)
    del specs[k]
    output.args = (tuple(values),) + tuple(output.args[1:])
    if isinstance(value, torch.fx.Node):
        erase_unused(graph, [value])
    what = value.name if isinstance(value, torch.fx.Node) else repr(value)
    return f"state {fqn!r} is never read, only overwritten: its update ({what}) is not computed"


def state_names(graphs: list[MethodGraph]) -> set[str]:
    return {fqn for g in graphs for fqn in g.ep.graph_signature.buffers_to_mutate.values()}


def place_state(graphs: list[MethodGraph], plan_device_memory: bool = True) -> dict[str, StateBuffer]:
    """One :class:`StateBuffer` per state FQN, placed on a device where possible."""
    state = {fqn: StateBuffer(fqn) for fqn in sorted(state_names(graphs))}
    devices: dict[str, set[str]] = {fqn: set() for fqn in state}
    for g in graphs:
        buffers, updates = g.buffer_nodes(), g.updates()
        for fqn, info in state.items():
            node = buffers.get(fqn)
            if node is None:
                continue
            _check_same_tensor(info, node, g.name)
            # Returning the buffer is a copy off the device, not a reason to keep it on the host.
            touching = [u for u in node.users if u.op != "output"] + ([updates[fqn]] if fqn in updates else [])
            for user in touching:
                device = g.device_of(user)
                devices[fqn].add(device)
                if device == HOST and not info.reason:
                    what = f"host op {user.name!r} ({op_name(user.target)})" if user is not None and \
                        user.op == "call_function" else "a value computed outside any delegate"
                    info.reason = f"{what} in method {g.name!r} touches it"
            if touching and not g.state_on_device and not info.reason:
                info.reason = f"PropagateDeviceConfig(state_on_device=False) for method {g.name!r}"
    for fqn, info in state.items():
        on = devices[fqn] - {HOST}
        if not plan_device_memory and not info.reason:
            info.reason = "LowerConfig(enable_non_cpu_memory_planning=False)"
        if len(on) > 1 and not info.reason:
            info.reason = f"delegates on several devices touch it ({', '.join(sorted(on))})"
        if not info.reason and len(on) == 1:
            info.device = on.pop()
        elif not info.reason:
            info.reason = "no delegate touches it"
    return state


def _check_same_tensor(info: StateBuffer, node: torch.fx.Node, method: str) -> None:
    val = node.meta.get("val")
    shape = tuple(int(s) for s in val.shape)
    if info.dtype is None:
        info.dtype, info.shape = val.dtype, shape
    elif (info.dtype, info.shape) != (val.dtype, shape):
        raise LoweringError(
            f"state buffer {info.name!r} is {info.dtype}{list(info.shape)} in one method but "
            f"{val.dtype}{list(shape)} in method {method!r}; every method must see one buffer"
        )


def reinplace(graph: MethodGraph, state: dict[str, StateBuffer]) -> list[str]:
    """Mark the functional updates of device state that can write in place; returns their names."""
    buffers, done = graph.buffer_nodes(), []
    for fqn, update in graph.updates().items():
        buffer = buffers.get(fqn)
        if state[fqn].device == HOST or update is None or update.op != "call_function":
            continue
        if update.target not in UPDATE_OPS or not update.args or update.args[0] is not buffer:
            continue
        if buffer in _flat_nodes(update.args[1:]) or buffer in _flat_nodes(update.kwargs.values()):
            continue  # reads the old value through another argument too
        if any(_reads_data(user, buffer) for user in buffer.users if user is not update):
            continue  # someone reads the old value: writing in place would change what they see
        update.meta[INPLACE] = True
        done.append(update.name)
    return done


def _flat_nodes(args) -> set[torch.fx.Node]:
    out = set()
    torch.fx.map_arg(tuple(args), lambda n: out.add(n))
    return out


def _reads_data(user: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether ``user`` reads the values of ``source``. ``copy(dst, src)`` takes only the shape and
    dtype of ``dst``, so a view of ``source`` that only feeds copies as their destination reads nothing."""
    if user.op != "call_function":
        return True
    if user.target is aten.copy.default:
        return source in _flat_nodes(user.args[1:]) or source in _flat_nodes(user.kwargs.values())
    spec = lookup(user.target)
    if spec is not None and spec.is_view:
        return any(_reads_data(u, user) for u in user.users)
    return True
