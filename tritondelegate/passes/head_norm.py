"""Per-head norms move into the rotary launch that reads them.

Qwen3 and Gemma3 RMS-normalize each head of the query and key before the rotary embedding:

    q = rms_norm(view(q_proj(x), [b, s, heads, D]), [D], w_q, eps).transpose(1, 2)
    q, k = rotary_pair(q, k, tables)

two norm launches (q's and k's) and the rotary's. Where ``fuse_rope_linear`` could not take all three
into the projection's epilogue (its tiles of whole heads would leave the GPU idle at decode), this
pass gives the norms to the rotary op (``ops.py``: its optional ``norm`` arguments): the rotary
kernel normalizes each row (a head) before it rotates it, in the same launch. The views between the
norm and the rotary then read the norm's input (a norm keeps the shape, so the views are the same).

A norm is taken when it normalizes the last dim alone, that dim is the rotary's (the views keep it
last and whole), its result has no other reader, it has a weight, and for a pair both q and k have
one, with the same eps.
"""

from __future__ import annotations

import torch
import torch.fx

from .. import ops
from .fuse_rope_linear import ROTARIES, is_head_norm, is_view, norm_eps
from .rewrite import tensor_val

aten = torch.ops.aten


def _norm_under(x: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the per-head norm that ``x`` is a chain of views of, the chain from it to x), or None."""
    chain = []
    node = x
    while is_view(node) and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    if not is_head_norm(node) or len(node.users) != 1 or len(node.args) < 3 or node.args[2] is None:
        return None
    xv, nv = tensor_val(x), tensor_val(node)
    if xv is None or nv is None or xv.shape[-1] != nv.shape[-1] or xv.stride()[-1] != 1:
        return None  # the views moved the normalized dim away from last
    return node, chain


def _take(rotary: torch.fx.Node) -> str | None:
    n_x = ROTARIES[rotary.target]
    base = n_x + (3 if rotary.target in (ops.rotary_angles, ops.rotary_pair_angles) else 2)
    if len(rotary.args) > base or rotary.kwargs.get("interleaved", False) or rotary.kwargs.get("deinterleave", False):
        return None  # norms given already, or interleaved pairs (the kernel normalizes rows of pairs)
    found = [_norm_under(x) for x in rotary.args[:n_x]]
    if None in found or tensor_val(rotary.args[0]).shape[-1] > 256:
        return None  # a tensor without a norm, or heads wider than one column block of the kernel
    eps = {norm_eps(norm, tensor_val(norm).dtype) for norm, _ in found}
    if len(eps) != 1:
        return None
    args = list(rotary.args)
    for k, (norm, chain) in enumerate(found):
        if chain:
            chain[-1].replace_input_with(norm, norm.args[0])  # the views now read the norm's input
        else:
            args[k] = norm.args[0]
    rotary.args = (*args, *(norm.args[2] for norm, _ in found), eps.pop())
    graph = rotary.graph
    for norm, _ in found:
        graph.erase_node(norm)
    return (f"per-head norm in the rotary: {', '.join(norm.name for norm, _ in found)} -> {rotary.name} "
            f"({len(found) + 1} launches -> 1)")


def head_norm(ep: torch.export.ExportedProgram) -> list[str]:
    """Give every per-head norm that alone feeds a rotary node's input to that node, in place. Returns
    one description per rotary node that took its norms."""
    graph = ep.graph_module.graph
    done = [d for d in (_take(n) for n in list(graph.nodes) if n.op == "call_function" and n.target in ROTARIES) if d]
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done
