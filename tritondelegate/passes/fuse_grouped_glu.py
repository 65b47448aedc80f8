"""A Mixture-of-Experts layer's gate and up experts with their gating in the grouped GEMM's epilogue.

transformers runs every expert's gated MLP over the tokens sorted by expert as

    y = grouped_mm(x, W, offs)          W [E, K, 2N]: each expert's gate and up columns side by side
    gate, up = y.chunk(2, -1)
    h = act(gate) * up

(Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, PhiMoE, GraniteMoE: ``transformers::grouped_mm_fallback``
or ``aten._grouped_mm``). ``y``, twice as wide as ``h``, is written and read back, and the gating costs
a launch. As

    W' = stack([W[..., :N], W[..., N:]], -1).view(E, K, 2N)      columns g0, u0, g1, u1, ...
    h = tritondelegate::glu_grouped_mm(x, W', offs, act)

the grouped GEMM's tile pairs each gate column with its up column and stores only ``act(gate) * up``.
``W'`` depends on constants alone: constant folding (which runs next, and without which this pass does
not run) computes it once at lower time, and ``W`` is dropped unless something else reads it.

The pattern matches (``fuse_glu.split_halves``) when the grouped GEMM's result is split in halves along
its last dim and read by nothing else, either half is the gate, the gate, the activation and the up
half are read by nothing but the pattern, and the weight is computed from constants only.
"""

from __future__ import annotations

import torch
import torch.fx

from .. import ops
from ..kernels import grouped_mm as gmm
from ..kernels.registry import external_name
from .fold_constants import constant_inputs, foldable_nodes
from .fuse_glu import glu_act, interleave, only_read_by, span, split_halves
from .rewrite import fake, is_call, new_node, replace_node, rewrite_matches, same_shape, tensor_val

aten = torch.ops.aten
FALLBACK = "transformers::grouped_mm_fallback.default"


def _grouped(node: torch.fx.Node, foldable: set) -> tuple | None:
    """(x, weight, offs) of a grouped GEMM the kernel takes, its weight computed from constants only."""
    if not (is_call(node, aten._grouped_mm.default) or external_name(getattr(node, "target", None)) == FALLBACK):
        return None
    if gmm.supported(node) is not None:
        return None
    x, w, offs, _ = gmm.operands(node)
    return (x, w, offs) if w in foldable else None


def _match(mul: torch.fx.Node, foldable: set):
    """(act, the grouped GEMM's (x, weight, offs), index of the gate's half, gate, activation, up) when
    ``mul`` is the root of the pattern; else None."""
    if not is_call(mul, aten.mul.Tensor) or len(mul.args) != 2 or mul.kwargs:
        return None
    for gated, up in (mul.args, mul.args[::-1]):
        act = glu_act(gated)
        if act is None or up is gated or not isinstance(up, torch.fx.Node):
            continue
        gate = gated.args[0]
        halves = split_halves(gate, up)
        if halves is None or not same_shape(tensor_val(mul), tensor_val(up)):
            continue
        operands = _grouped(halves[0], foldable)
        if operands is not None and only_read_by(gate, gated) and only_read_by(gated, mul) and only_read_by(up, mul):
            return act, operands, halves[1], gate, gated, up
    return None


def _interleaved(graph, w: torch.fx.Node, gate_first: bool, meta: dict, name: str) -> torch.fx.Node:
    """``w`` [E, K, 2N] with its two column halves interleaved, the gate's first."""
    n = tensor_val(w).shape[2] // 2
    gate, up = (span(graph, w, 2, start, start + n, meta) for start in ((0, n) if gate_first else (n, 0)))
    return interleave(graph, gate, up, 2, meta, name)


def _fuse(graph: torch.fx.Graph, ep, mul, act: str, operands, index: int, gate, gated, up) -> str:
    x, w, offs = operands
    split = gate.args[0]
    grouped = split.args[0]
    with graph.inserting_before(mul):
        weight = _interleaved(graph, w, index == 0, grouped.meta, f"{grouped.name}_glu_weight")
        val = fake(lambda xv, wv, ov: ops.glu_grouped_mm(xv, wv, ov, act), tensor_val(x), weight.meta["val"],
                   tensor_val(offs))
        node = new_node(graph, ops.glu_grouped_mm, (x, weight, offs, act), val, mul.meta)
    replace_node(ep, mul, node)
    for old in (mul, gated, gate, up, split, grouped):  # users first
        graph.erase_node(old)
    return (f"grouped gated MLP {act}({gate.name}) * {up.name} -> {node.name} "
            f"(tritondelegate::glu_grouped_mm, one grouped GEMM, N = 2x{tensor_val(node).shape[1]})")


def fuse_grouped_glu(ep: torch.export.ExportedProgram, state: set[str] = frozenset()) -> list[str]:
    """Rewrite every grouped gated MLP of ``ep``'s graph into ``tritondelegate::glu_grouped_mm``, in
    place. ``state``: FQNs of program state, never treated as constants. Returns one description per
    rewrite; relies on constant folding to interleave the weights once."""
    foldable = foldable_nodes(ep.graph_module.graph, constant_inputs(ep, set(state)))
    return rewrite_matches(ep, lambda node: _match(node, foldable), _fuse)
