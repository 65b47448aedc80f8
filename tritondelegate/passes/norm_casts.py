"""A norm computed in fp32 on a low-precision row and cast straight back is that norm of the row:
``layer_norm(x.float()).to(x.dtype)`` becomes ``layer_norm(x)`` (``rms_norm`` likewise).

OLMo, OLMo2, Cohere and T5 in fp16/bf16 normalize in fp32 (``x.to(float32)``, the norm, ``.to(x.dtype)``):
three launches in place of one (the casts fuse into the norm's launch, but a norm whose result is cast
is no longer one that only matmuls read, so it stays out of the projection's prologue). The norm
kernels compute in fp32 whatever the input's dtype and round their result once, to their output's
dtype: exactly the fp32 norm rounded by the cast.

Rewritten when: ``x`` (fp16/bf16) is cast to fp32 and only the norm reads that cast; the norm's weight
and bias are absent, or are fp32 casts of tensors of ``x``'s dtype (used uncast: the kernel applies them
in fp32, as the cast would), over the last dim; the norm's only user is a cast back to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.fx

from .rewrite import cast_input, is_call, new_node, tensor_val

aten = torch.ops.aten
LOW = (torch.float16, torch.bfloat16)
# norm -> (index of its weight, of its bias (None: it has none))
NORMS = {aten.layer_norm.default: (2, 3), aten.rms_norm.default: (2, None)}


def _cast(node, dtype: torch.dtype) -> torch.fx.Node | None:
    """The input of ``node`` = a plain cast of it to ``dtype`` (``rewrite.cast_input``), else None."""
    source = cast_input(node)
    return source if source is not None and node.kwargs["dtype"] == dtype else None


def _low_operand(arg, dtype: torch.dtype):
    """(ok, the operand to use) for a norm's weight or bias: absent, or an fp32 cast of a ``dtype``
    tensor (that tensor)."""
    if arg is None:
        return True, None
    source = _cast(arg, torch.float32)
    val = tensor_val(source) if source is not None else None
    return (val is not None and val.dtype == dtype and len(arg.users) == 1), source


def _plan(norm: torch.fx.Node):
    """(x, weight, bias, the cast back) when ``norm`` is rewritable, else None."""
    up = norm.args[0]
    x = _cast(up, torch.float32)
    val = tensor_val(x) if x is not None else None
    if val is None or val.dtype not in LOW or len(up.users) != 1 or len(norm.users) != 1:
        return None
    down = next(iter(norm.users))
    if _cast(down, val.dtype) is not norm:
        return None
    w_at, b_at = NORMS[norm.target]
    args = list(norm.args) + [None] * 4
    (w_ok, weight), (b_ok, bias) = _low_operand(args[w_at], val.dtype), _low_operand(
        args[b_at] if b_at is not None else None, val.dtype)
    return (x, weight, bias, down) if w_ok and b_ok else None


def norm_casts(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite each fp32 norm of a low-precision row cast straight back; one description per rewrite."""
    graph = ep.graph_module.graph
    done = []
    for norm in [n for n in graph.nodes if is_call(n, *NORMS) and not n.kwargs]:
        found = _plan(norm)
        if found is None:
            continue
        x, weight, bias, down = found
        w_at, b_at = NORMS[norm.target]
        args = list(norm.args)
        args[0] = x
        if len(args) > w_at:
            args[w_at] = weight
        if b_at is not None and len(args) > b_at:
            args[b_at] = bias
        with graph.inserting_before(down):
            new = new_node(graph, norm.target, tuple(args), down.meta["val"], norm.meta)
        down.replace_all_uses_with(new)
        old = [down, norm, norm.args[0]] + [a for a in norm.args[1:] if isinstance(a, torch.fx.Node) and a is not x]
        for node in old:
            if not node.users:
                graph.erase_node(node)
        done.append(f"{norm.name} of {x.name} in {tensor_val(x).dtype}: its fp32 casts dropped -> {new.name} "
                    "(the kernel computes in fp32)")
    return done
