"""Decomposition to core ATen, keeping whole the ops that have a fused kernel.

``torch.export`` programs are decomposed with the default table minus the ops in ``keep`` (layer_norm,
scaled_dot_product_attention, linear, ... when the kernel registry has them), so one fused kernel
replaces a chain of small ones. Ops that only check metadata are then dropped: they do no work and
would otherwise be left as host instructions.

Core ATen keeps some ops whole that no kernel claims (``elu``, ``flip``, ``adaptive_max_pool2d``,
``grid_sampler_2d``, ...). When the partitioner says
which ops it claims, each such op that torch can decompose into claimed ops only is decomposed further
(``decompose_unclaimed``): it then runs on the device instead of the host. One whose decomposition
still leaves something unclaimed stays whole (one host op, not several). The same holds for a node of
a claimed op that its kernel refuses (an unsupported argument) when torch decomposes the op.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch.export.graph_signature import InputKind, OutputKind

aten = torch.ops.aten

# Ops worth keeping whole when a kernel exists for them.
KEEP_CANDIDATES = (
    aten.linear.default,
    aten.baddbmm.default,
    aten.layer_norm.default,
    aten.rms_norm.default,
    aten.scaled_dot_product_attention.default,
    aten.silu.default,
    aten.gelu.default,
    aten.celu.default,
    aten.softplus.default,
    aten.mish.default,
    aten.hardswish.default,
    aten.prelu.default,
    aten.softmax.int,
    aten.log_softmax.int,
    aten.embedding.default,
    aten.conv2d.default,
    aten.batch_norm.default,
    aten.reflection_pad1d.default,
    aten.reflection_pad2d.default,
    aten.reflection_pad3d.default,
    aten.replication_pad1d.default,
    aten.replication_pad2d.default,
    aten.replication_pad3d.default,
    # resizing, one launch each (kernels/resize.py) where the default table would gather and lerp
    aten.upsample_nearest1d.vec,
    aten.upsample_nearest1d.default,
    aten.upsample_nearest2d.vec,
    aten.upsample_nearest2d.default,
    aten.upsample_nearest3d.vec,
    aten.upsample_nearest3d.default,
    aten._upsample_nearest_exact1d.vec,
    aten._upsample_nearest_exact1d.default,
    aten._upsample_nearest_exact2d.vec,
    aten._upsample_nearest_exact2d.default,
    aten._upsample_nearest_exact3d.vec,
    aten._upsample_nearest_exact3d.default,
    aten.upsample_linear1d.vec,
    aten.upsample_linear1d.default,
    aten.upsample_bilinear2d.vec,
    aten.upsample_bilinear2d.default,
    aten.upsample_trilinear3d.vec,
    aten.upsample_trilinear3d.default,
    aten.upsample_bicubic2d.vec,
    aten.upsample_bicubic2d.default,
)

METADATA_ONLY = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_async.default,
    aten._assert_async.msg,
}


def default_keep() -> list:
    from .kernels.registry import OPS

    return [op for op in KEEP_CANDIDATES if op in OPS]


def decompose(ep: torch.export.ExportedProgram, keep: Iterable | None = None) -> torch.export.ExportedProgram:
    """``ep`` in core ATen but for ``keep``."""
    keep = frozenset(default_keep() if keep is None else keep)
    ep = ep.run_decompositions(_table(keep, *_registered()))
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in METADATA_ONLY and not node.users:
            graph.erase_node(node)
    ep.graph_module.recompile()
    _mutated_parameters_as_buffers(ep)
    return ep


def _flip(x: torch.Tensor, dims) -> torch.Tensor:
    """``flip`` as one ``index_select`` per flipped dim by a reversed ``arange`` (folded to a constant at a
    static size); torch's own decomposition is a ``prims.rev``, which no kernel claims."""
    for d in dims:
        d = d % x.dim()
        x = aten.index_select(x, d, torch.arange(x.shape[d] - 1, -1, -1, device=x.device))
    return x


# Decompositions tried for ops no kernel claims: torch's, with flip's replaced, but for the ops that
# passes/ rewrite whole before partitioning (eager attention's softmax, an eval batch norm folded into
# its convolution, complex rotary's polar).
FALLBACK = {op: fn for op, fn in {**torch._decomp.decomposition_table, aten.flip.default: _flip}.items()
            if op not in (aten._safe_softmax.default, aten.native_batch_norm.default, aten.polar.default)}


def _census(ep: torch.export.ExportedProgram, claims: Callable) -> tuple[Counter, Counter]:
    """How many tensor-valued nodes of each op ``ep`` has that the partitioner does not claim, and that
    it claims."""
    unclaimed, claimed = Counter(), Counter()
    for node in ep.graph_module.graph.nodes:
        vals = node.meta.get("val")
        tensors = any(isinstance(v, torch.Tensor) for v in (vals if isinstance(vals, (tuple, list)) else [vals]))
        if (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and tensors
                and node.target not in METADATA_ONLY):
            (claimed if claims(node) else unclaimed)[node.target] += 1
    return unclaimed, claimed


def decompose_unclaimed(ep: torch.export.ExportedProgram, claims: Callable,
                        keep: Iterable | None = None) -> torch.export.ExportedProgram:
    """``ep`` (decomposed with ``keep``) with each op of nodes the partitioner does not claim (``claims``:
    node -> bool; sizes over the method's symbols decided for their range, as the partitioner decides
    them) decomposed where that leaves fewer unclaimed nodes and keeps every claimed one. Each op is
    tried on its own; it stays whole when its decomposition adds an unclaimed node of any op (one host
    op rather than several, with copies between them and the device), when retracing with it decomposes
    a claimed node too (a functional batch norm retraces through the in-place one), or when it does not
    retrace."""
    table = _table(frozenset(default_keep() if keep is None else keep), *_registered())
    unclaimed, claimed = _census(ep, claims)
    chosen = {}
    for op in sorted((op for op in unclaimed if op in FALLBACK), key=str):
        try:
            left, kept = _census(ep.run_decompositions({**table, op: FALLBACK[op]}), claims)
        except Exception:  # noqa: BLE001 - torch's tracing of that decomposition failed: the op stays whole
            continue
        if (left[op] == 0 and left <= unclaimed - Counter({op: unclaimed[op]})
                and all(kept[t] >= n for t, n in claimed.items())):
            chosen[op] = FALLBACK[op]
    return ep.run_decompositions({**table, **chosen}) if chosen else ep


def _registered() -> tuple:
    """What the default table is built from: the operators with a CompositeImplicitAutograd kernel (custom
    ops registered since count) and the number of Python decompositions."""
    cia = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    return tuple(cia), len(torch._decomp.decomposition_table)


@functools.lru_cache(maxsize=8)
def _table(keep: frozenset, cia: tuple, python_decompositions: int) -> dict:
    """The default decomposition table without ``keep``, built once per set of registered operators.

    ``torch.export.default_decompositions()`` materializes every CompositeImplicitAutograd operator of
    every namespace when read; building it for each program was a sixth of a small model's lowering.
    ``run_decompositions`` copies the table it is given, so the cached one is never changed."""
    table = dict(torch.export.default_decompositions().materialize())
    for op in keep:
        table.pop(op, None)
    return table


def _mutated_parameters_as_buffers(ep: torch.export.ExportedProgram) -> None:
    """A parameter the program writes (``embedding(max_norm=...)`` renormalizes its weight in place)
    is program state, like a mutated buffer: its input and write-back are relabelled as a buffer's."""
    signature = ep.graph_signature
    mutated = {spec.target for spec in signature.output_specs if spec.kind == OutputKind.PARAMETER_MUTATION}
    if not mutated:
        return
    for spec in signature.input_specs:
        if spec.kind == InputKind.PARAMETER and spec.target in mutated:
            spec.kind, spec.persistent = InputKind.BUFFER, True
    for spec in signature.output_specs:
        if spec.kind == OutputKind.PARAMETER_MUTATION:
            spec.kind = OutputKind.BUFFER_MUTATION
