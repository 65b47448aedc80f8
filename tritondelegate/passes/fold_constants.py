"""Constant folding at lower time: subgraphs that depend on no method input run once, in ``lower()``.

Causal masks built from ``arange`` and comparisons, rotary cos/sin tables, position ids and products
of ``inv_freq`` for a static shape are the same on every call; today they would cost launches on
every call. This pass evaluates each maximal input-independent subgraph on the CPU with the real
constant values and replaces the nodes other work reads by new lifted constants (resident like any
other constant). It runs on the decomposed graph before partitioning.

Not folded: anything that reads a method input or program state (state changes between calls),
random or side-effecting ops, ``empty`` tensors (undefined contents: nothing to store), subgraphs of
views only (a view of a weight costs nothing at run time, and folding it would store a copy), and
results larger than ``max(inputs read, 1 MiB)`` (a big mask computed from two ``arange`` is cheaper
to compute than to hold and load).
"""

from __future__ import annotations

import contextlib
import contextvars
import operator

import torch
import torch.fx
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from ..kernels.creation import EMPTY_OPS
from ..kernels.registry import lookup
from ..ops import QUANT_DTYPES
from . import quant_weights
from .quant_weights import QUANTIZED

MAX_GROWTH_BYTES = 1 << 20
FOLDED_PREFIX = "_folded_constant"


def _nbytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def constant_inputs(ep, state: set[str]) -> dict[torch.fx.Node, torch.Tensor]:
    """Placeholder node -> its value, for parameters, buffers that are not state (``state``, nor
    mutated by this program), lifted constants."""
    values = {**ep.state_dict, **ep.constants}
    nodes = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    state = set(state) | set(ep.graph_signature.buffers_to_mutate.values())
    out = {}
    for spec in ep.graph_signature.input_specs:
        kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
        if spec.kind in kinds and spec.target not in state and spec.target in values:
            out[nodes[spec.arg.name]] = values[spec.target]
    return out


def _foldable_op(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target in EMPTY_OPS:
        return False  # (an empty tensor's contents are undefined: nothing to compute once or to store)
    schema = target._schema
    if schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags and not target.name().startswith("aten::rand")


def foldable_nodes(graph: torch.fx.Graph, constants: dict) -> set[torch.fx.Node]:
    """The constants and every node computed from them alone by deterministic, non-mutating ops: what
    constant folding can compute once."""
    foldable: set[torch.fx.Node] = set(constants)
    for node in graph.nodes:
        if node.op == "call_function" and (_foldable_op(node) or node.target is operator.getitem):
            if all(arg in foldable for arg in node.all_input_nodes):
                foldable.add(node)
    return foldable


def _is_view_only(node: torch.fx.Node, constants: dict) -> bool:
    """Whether ``node`` is a placeholder or views of one and nothing else."""
    while node not in constants:
        spec = lookup(node.target) if node.op == "call_function" else None
        if spec is None or not spec.is_view or len(node.all_input_nodes) != 1:
            return False
        node = node.all_input_nodes[0]
    return True


def fold_constants(ep: torch.export.ExportedProgram, state: set[str] = frozenset()) -> list[str]:
    """Fold in place; returns the names of the nodes replaced by constants."""
    graph = ep.graph_module.graph
    constants = constant_inputs(ep, set(state))
    foldable = foldable_nodes(graph, constants)
    frontier = [
        n for n in graph.nodes
        if n in foldable and n not in constants and isinstance(n.meta.get("val"), torch.Tensor)
        and any(u not in foldable for u in n.users) and not _is_view_only(n, constants)
    ]
    if not frontier and not any(QUANTIZED in n.meta for n in constants):
        return []
    values = _Values(constants, foldable)
    quantized = quant_weights.evaluate(graph, constants, foldable, values)
    kept = [node for node in constants if _dequantize_in_kernels(ep, node, quantized)]
    folded = []
    pending, seen = list(frontier), set(frontier)
    while pending:
        node = pending.pop(0)
        if _dequantize_in_kernels(ep, node, quantized):
            folded.append(node.name)
            continue
        value = values[node]
        read = sum(_nbytes(constants[p]) for p in _placeholders_under(node, constants))
        if _nbytes(value) > max(read, MAX_GROWTH_BYTES):
            # too big to store (a mask repeated over heads, a table broadcast over the batch): fold what
            # it is computed from instead, and keep only its last steps at run time
            more = [a for a in node.all_input_nodes if a in foldable and a not in constants and a not in seen
                    and isinstance(a.meta.get("val"), torch.Tensor) and not _is_view_only(a, constants)]
            seen.update(more)
            pending.extend(more)
            continue
        value = value.contiguous()
        # a later frontier node computed from this one now reads the new constant: its value is known
        values[_replace_with_constant(ep, node, value)] = value
        folded.append(node.name)
    if folded or kept:
        _drop_dead(ep)
    _materialize_quantized(ep)
    return folded


def quantize_weights(ep: torch.export.ExportedProgram, state: set[str] = frozenset()) -> list[str]:
    """Step 1 of ``quant_weights.py``: each subgraph that dequantizes an integer constant into a
    weight becomes a float constant of the same value, tagged with its quantized parts."""
    graph = ep.graph_module.graph
    constants = constant_inputs(ep, set(state))
    if not any(v.dtype in QUANT_DTYPES for v in constants.values()):
        return []
    foldable = foldable_nodes(graph, constants)
    quantized = quant_weights.evaluate(graph, constants, foldable, _Values(constants, foldable))
    done, keys = [], {}
    for node, value in quantized.items():
        if node in constants or len(value.shape) not in (2, 3) or all(u in quantized for u in node.users):
            continue
        if not quant_weights.from_op(node) and not _exact_once(value, node, constants, foldable, keys):
            continue
        # The float weight is not held: a stand-in without storage, until something needs its values
        # (a reader that is not a matmul: :func:`_materialize_quantized`).
        stand_in = torch.zeros((), dtype=value.dtype).expand(value.shape)
        placeholder = quant_weights.tagged(add_constant(ep, stand_in, quant_weights.PREFIX), value)
        placeholder.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(placeholder)
        done.append(f"{node.name} (a weight {list(value.shape)} from {value.bits}-bit integers: kept as those "
                    "where only matmuls read it)")
    if done:
        _drop_dead(ep)
    return done


_CHECKED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("quantized_checks", default=None)


@contextlib.contextmanager
def remembered_checks():
    """Within it, a quantized weight's exactness check runs once for every method whose subgraph is
    the same ops on the same constants (prefill and decode dequantize every weight alike)."""
    token = _CHECKED.set({})
    try:
        yield
    finally:
        _CHECKED.reset(token)


def _exact_once(value, node, constants: dict, foldable: set, keys: dict) -> bool:
    """``quant_weights.exact`` of ``value`` against the subgraph's own value at ``node``, computed
    alone (its intermediates freed after the check), or its earlier result for the same subgraph."""
    checked = _CHECKED.get()
    if checked is None:
        return quant_weights.exact(value, _Values(constants, foldable)[node])
    key = _subgraph_key(node, constants, keys)
    if key not in checked:
        # the constants are kept with the result: their addresses in the key stay theirs
        checked[key] = (quant_weights.exact(value, _Values(constants, foldable)[node]),
                        [constants[n] for n in _placeholders_under(node, constants)])
    return checked[key][0]


def _subgraph_key(node, constants: dict, keys: dict):
    """What ``node`` computes from constants, as a hashable value: its op and arguments, each
    constant by its memory and layout (two methods' constants of the same module share it)."""
    if node in keys:
        return keys[node]
    if node in constants:
        t = constants[node]
        key = ("constant", t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
    else:
        args = torch.fx.map_arg((node.args, dict(sorted(node.kwargs.items()))),
                                lambda m: _subgraph_key(m, constants, keys))
        key = (str(node.target), repr(args))
    keys[node] = key
    return key


def _dequantize_in_kernels(ep, node: torch.fx.Node, quantized: dict) -> bool:
    """Step 2 of ``quant_weights.py``: when ``node`` (a tagged constant, or row ops on such: values
    checked at step 1, and rearranging rows changes none) is a quantized weight that only matmuls
    read, ``dequant_weight`` over its parts, stored as new constants, in its place. Whether it was."""
    if node not in quantized or not quant_weights.reads_as_weight(node, quantized[node]):
        return False
    value, zero = quant_weights.constant_zero(quant_weights.narrowed(quantized[node]))
    parts = [None if t is None else add_constant(ep, t.contiguous(), quant_weights.PREFIX)
             for t in (value.q, value.zero, value.scale)]
    quant_weights.dequant_node(ep.graph_module.graph, node, value, parts, zero)
    return True


class _Values(dict):
    """The values of foldable nodes, each computed when first asked for, with what it reads (and no
    more); a quantized weight's tagged constant (``quant_weights.py``) gives its dequantized value."""

    def __init__(self, constants: dict, foldable: set):
        super().__init__((n, v) for n, v in constants.items() if QUANTIZED not in n.meta)
        self.foldable = foldable

    def __missing__(self, node):
        if node not in self.foldable:
            raise KeyError(node)
        order, stack = [], [(node, False)]
        while stack:  # the missing inputs first (an iterative post-order walk)
            n, ready = stack.pop()
            if dict.__contains__(self, n) or n in order:
                continue
            if ready or QUANTIZED in n.meta:
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((m, False) for m in n.all_input_nodes if not dict.__contains__(self, m))
        for n in order:
            if QUANTIZED in n.meta:
                self[n] = n.meta[QUANTIZED].dequantize()
                continue
            args, kwargs = torch.fx.map_arg((n.args, n.kwargs), lambda m: self[m])
            with torch.no_grad():
                self[n] = n.target(*args, **kwargs)
        return dict.__getitem__(self, node)

    def get(self, node, default=None):
        try:
            return self[node]
        except KeyError:
            return default


def _materialize_quantized(ep) -> None:
    """A quantized weight's constant that something still reads (not only kernels that dequantize: a
    ``bmm``) holds its dequantized values from here on, as plain folding would have stored it."""
    for node in ep.graph_module.graph.nodes:
        if node.op == "placeholder" and QUANTIZED in node.meta and node.users and node.name in ep.constants:
            ep.constants[node.name] = node.meta[QUANTIZED].dequantize().contiguous()


def _placeholders_under(node: torch.fx.Node, constants: dict) -> set[torch.fx.Node]:
    seen, stack, found = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in constants:
            found.add(n)
        stack.extend(n.all_input_nodes)
    return found


def add_constant(ep, value: torch.Tensor, prefix: str = FOLDED_PREFIX) -> torch.fx.Node:
    """A new constant input of ``ep`` holding ``value`` (its placeholder, named ``prefix_N``, among the
    other constants: before the first user input)."""
    graph = ep.graph_module.graph
    index = sum(1 for n in graph.nodes if n.op == "placeholder" and n.name.startswith(prefix))
    name = f"{prefix}_{index}"
    while name in ep.constants:
        index += 1
        name = f"{prefix}_{index}"
    specs = list(ep.graph_signature.input_specs)
    first_user_input = next((i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT), len(specs))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if first_user_input < len(placeholders):
        where = graph.inserting_before(placeholders[first_user_input])
    elif placeholders:
        where = graph.inserting_after(placeholders[-1])
    else:  # a method without inputs (``torch.arange(5) * 2``): the graph's first node
        where = graph.inserting_before(next(iter(graph.nodes)))
    with where:
        placeholder = graph.placeholder(name)
    mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in placeholders])
    placeholder.meta["val"] = mode.from_tensor(value, static_shapes=True) if mode is not None else value
    specs.insert(first_user_input, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name), name))
    ep.graph_signature.input_specs[:] = specs
    ep.constants[name] = value
    return placeholder


def _replace_with_constant(ep, node: torch.fx.Node, value: torch.Tensor) -> torch.fx.Node:
    """The constant placeholder of ``value`` that now stands for ``node`` everywhere."""
    placeholder = add_constant(ep, value)
    placeholder.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(placeholder)
    return placeholder


def _drop_dead(ep) -> None:
    """Remove the nodes no one reads any more, and constant placeholders left without readers
    (a mutated buffer stays: the method writes it back)."""
    graph = ep.graph_module.graph
    graph.eliminate_dead_code()
    mutated = set(ep.graph_signature.buffers_to_mutate.values())
    kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    specs = ep.graph_signature.input_specs
    drop = [s for s in specs if s.kind in kinds and s.target not in mutated and not placeholders[s.arg.name].users]
    for spec in drop:
        graph.erase_node(placeholders[spec.arg.name])
    specs[:] = [s for s in specs if s not in drop]
    ep.graph_module.recompile()
