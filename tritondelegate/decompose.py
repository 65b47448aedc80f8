"""Decomposition to core ATen, keeping whole the ops that have a fused kernel.

``torch.export`` programs are decomposed with the default table minus the ops in ``keep`` (layer_norm,
scaled_dot_product_attention, linear, ... when the kernel registry has them), so one fused kernel
replaces a chain of small ones. Ops that only check metadata are then dropped: they do no work and
would otherwise be left as host instructions.

Ops that core ATen keeps whole but no kernel claims are decomposed further by ``unclaimed.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

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
    aten.log_sigmoid.default,
    aten.threshold.default,
    # torch's Autograd kernels decompose these two whatever the table says; passes/fuse_activations.py
    # puts them back together
    aten.hardshrink.default,
    aten.softshrink.default,
    aten.softmax.int,
    aten.log_softmax.int,
    aten.embedding.default,
    aten.cdist.default,  # one launch (kernels/distance.py); for p = 2 its own decomposition is 7
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
    freed = set()  # nodes whose only users were such checks (``x.exp().to(x.dtype)`` unused): dead now
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and (node.target in METADATA_ONLY or node in freed):
            freed.update(node.all_input_nodes)
            graph.erase_node(node)
    ep.graph_module.recompile()
    _mutated_parameters_as_buffers(ep)
    return ep


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
