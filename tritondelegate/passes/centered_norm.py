"""An RMSNorm of a centered row is a LayerNorm: ``rms_norm(x - mean(x, -1, keepdim), [D], w, eps)``
becomes ``layer_norm(x, [D], w, None, eps)``.

Cohere writes its LayerNorm (no bias) out, in fp32: ``mean``, ``x - mean``, then the variance,
rsqrt and products of an RMSNorm, which ``fuse_rms_norm`` makes an ``aten.rms_norm`` of the centered
row; the mean and the subtraction stay two launches of their own per norm (four per layer). As a
``layer_norm`` the whole norm is one row kernel, or the prologue of the projections that read it.

Rewritten when: the subtracted value is ``mean.dim(x, [-1] or [D - 1], keepdim=True)`` of the same
``x`` (default alpha), the norm is over the last dim alone, the mean is read only by the subtraction
and the subtraction only by the norm, and neither is a method output.
"""

from __future__ import annotations

import torch
import torch.fx

from .rewrite import is_call, new_node, tensor_val

aten = torch.ops.aten


def _centered(norm: torch.fx.Node, returned: set):
    """(x, [sub, mean]) when ``norm``'s input is ``x - mean(x, -1, keepdim=True)`` that only it reads."""
    sub = norm.args[0]
    if not is_call(sub, aten.sub.Tensor) or sub.kwargs or len(sub.users) != 1 or len(sub.args) != 2:
        return None
    x, mean = sub.args
    if not is_call(mean, aten.mean.dim) or mean.args[0] is not x or len(mean.users) != 1 or mean.kwargs:
        return None
    val = tensor_val(x)
    dims, keepdim = (list(mean.args[1:]) + [False])[:2]
    if val is None or keepdim is not True or len(dims) != 1 or dims[0] % val.dim() != val.dim() - 1:
        return None
    if {sub.name, mean.name} & returned or tensor_val(sub).dtype != val.dtype:
        return None
    return x, [sub, mean]


def centered_norm(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite each RMSNorm of a centered row into a LayerNorm; one description per rewrite."""
    graph = ep.graph_module.graph
    returned = {getattr(spec.arg, "name", None) for spec in ep.graph_signature.output_specs}
    done = []
    for norm in [n for n in graph.nodes if is_call(n, aten.rms_norm.default) and not n.kwargs]:
        found = _centered(norm, returned)
        shape = norm.args[1]
        if found is None or len(shape) != 1:
            continue
        (x, dead), weight, eps = found, (list(norm.args[2:]) + [None])[0], (list(norm.args[3:]) + [None])[0]
        if eps is None:
            eps = torch.finfo(tensor_val(x).dtype).eps  # rms_norm's default, which layer_norm lacks
        with graph.inserting_before(norm):
            new = new_node(graph, aten.layer_norm.default, (x, list(shape), weight, None, float(eps)),
                           norm.meta["val"], norm.meta)
        norm.replace_all_uses_with(new)
        for node in [norm, *dead]:
            graph.erase_node(node)
        done.append(f"centered RMSNorm {norm.name} -> {new.name} (aten.layer_norm, 3 launches -> 1)")
    return done
