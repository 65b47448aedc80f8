"""An RMSNorm written out becomes one ``aten.rms_norm`` (one row kernel instead of three launches).

Llama, Qwen2, Mistral (transformers' ``LlamaRMSNorm``), Gemma and ``tritondelegate.models.RMSNorm``
write the norm over the last dim as, after decomposition::

    xf  = _to_copy(x, dtype=float32)          # absent when x is fp32; may be two equal casts
    sq  = pow(xf, 2)                          # or mul(xf, xf)
    var = mean.dim(sq, [-1], keepdim=True)
    ve  = add(var, eps)                       # eps a Python number
    r   = rsqrt(ve)
    n   = mul(xf, r)
    ... then, in any order, casts (_to_copy to a dtype) and at most one mul by a 1-D weight of size D
        (Llama: cast to x.dtype, then * weight; Gemma: * (1 + weight), then cast)

The chain from ``sq`` up to an end node (``n`` or one of the nodes after it) is replaced by
``rms_norm(x', [D], weight, eps)``, ``x'`` being ``x`` or ``xf``, whichever has the end's dtype
(``aten.rms_norm`` returns its input's dtype), so no cast is added. The kernel computes in fp32 and
rounds once; the chain it replaces may round in between (Llama rounds to x.dtype before the weight):
an end is taken only if every rounding skipped is at least as precise as the result dtype, so the
difference stays within that dtype's tolerance. The longest valid chain is taken: e.g. bf16 ``x``
with an fp32 weight (an fp32 result after a bf16 rounding) fuses up to the cast, exactly, and keeps
the weight's mul.

Not rewritten: a norm over another dim or without keepdim, a non-static last dim, and any norm one
of whose intermediates (variance, rsqrt, normalized x before its cast or weight, ...) is read
elsewhere or is a method output: every value the graph reads stays computed.
"""

from __future__ import annotations

import torch
import torch.fx

from ..kernels.refs import node_value
from .rewrite import cast_input, is_call, is_number, take_provenance

aten = torch.ops.aten

# Mantissa bits: a rounding to a dtype with at least the result's bits may be skipped.
_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def _float_val(node) -> torch.Tensor | None:
    val = node_value(node)
    return val if isinstance(val, torch.Tensor) and val.dtype in _MANTISSA else None


def _same_x(a, b) -> bool:
    """``a`` and ``b`` are the same tensor: the same node, or equal casts of the same node."""
    if a is b:
        return True
    src_a, src_b = cast_input(a), cast_input(b)
    return src_a is not None and src_a is src_b and node_value(a).dtype == node_value(b).dtype


def _sole_user(node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _other(node, operand) -> object:
    a, b = node.args[:2]
    return b if a is operand else a


def _weight_ok(weight, d: int) -> bool:
    val = _float_val(weight)
    return val is not None and val.ndim == 1 and isinstance(val.shape[0], int) and val.shape[0] == d


def _binary(node, target) -> bool:
    """A ``target`` node with two positional operands and default alpha."""
    return (is_call(node, target) and len(node.args) == 2
            and all(k == "alpha" and v == 1 for k, v in node.kwargs.items()))


class _Match:
    def __init__(self, xf, square, mean, add, rsqrt, normed, x_in_mul, eps):
        self.xf, self.x_in_mul = xf, x_in_mul
        self.stats = [square, mean, add, rsqrt]
        self.eps = eps
        self.chain = [normed]  # normed, then casts and the weight's mul
        self.weight_at = None  # index in chain of the weight's mul
        self.weight = None


def _match(square) -> _Match | None:
    """The norm whose square is ``square`` (a pow or mul node), or None."""
    if is_call(square, aten.pow.Tensor_Scalar):
        if len(square.args) != 2 or square.kwargs or not is_number(square.args[1]) or square.args[1] != 2:
            return None
        xf = square.args[0]
    elif _binary(square, aten.mul.Tensor) and square.args[0] is square.args[1]:
        xf = square.args[0]
    else:
        return None
    xval = _float_val(xf)
    if xval is None or xval.ndim < 1 or not isinstance(xval.shape[-1], int):
        return None
    ndim = xval.ndim
    mean = _sole_user(square)
    if not is_call(mean, aten.mean.dim) or mean.args[0] is not square or mean.kwargs.get("dtype") is not None:
        return None
    dims, keepdim = mean.args[1], mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or dims[0] not in (-1, ndim - 1) or keepdim is not True:
        return None
    add = _sole_user(mean)
    if not (_binary(add, aten.add.Tensor) or _binary(add, aten.add.Scalar)) or add.args[0] is not mean:
        return None
    eps = add.args[1]
    if not is_number(eps):
        return None
    rsqrt = _sole_user(add)
    if not is_call(rsqrt, aten.rsqrt.default) or rsqrt.args[0] is not add:
        return None
    normed = _sole_user(rsqrt)
    if not _binary(normed, aten.mul.Tensor) or rsqrt not in normed.args[:2] or normed.args[0] is normed.args[1]:
        return None
    x_in_mul = _other(normed, rsqrt)
    if not isinstance(x_in_mul, torch.fx.Node) or not _same_x(xf, x_in_mul) or _float_val(normed) is None:
        return None
    match = _Match(xf, square, mean, add, rsqrt, normed, x_in_mul, float(eps))
    # casts and at most one weight after the normalized x, while each node has one reader
    d = xval.shape[-1]
    node = normed
    while True:
        users = list(node.users)
        extends = [u for u in users if _extends(match, node, u, d)]
        if extends and len(users) > 1:
            return None  # an intermediate read elsewhere (or returned): this norm is left alone
        if not extends or len(users) != 1:
            return match
        user = users[0]
        if cast_input(user) is not node:
            match.weight, match.weight_at = _other(user, node), len(match.chain)
        match.chain.append(user)
        node = user


def _extends(match: _Match, node, user, d: int) -> bool:
    """Whether ``user`` continues the norm after ``node``: a cast, or the (first) weight's mul."""
    if cast_input(user) is node:
        return True
    return (match.weight is None and _binary(user, aten.mul.Tensor) and node in user.args[:2]
            and user.args[0] is not user.args[1] and _weight_ok(_other(user, node), d)
            and _float_val(user) is not None)


def _fake_rms_norm(x, d, weight, eps):
    """The value of ``rms_norm(x, [d], weight, eps)`` computed on the inputs' fake tensors."""
    vals = [node_value(x)] + ([node_value(weight)] if weight is not None else [])
    mode = torch._guards.detect_fake_mode(vals)
    if mode is None:
        return None
    with mode:
        return aten.rms_norm.default(vals[0], [d], vals[-1] if weight is not None else None, eps)


def _plan(match: _Match):
    """(end index in chain, x', weight, value) for the longest chain that can be fused, or None."""
    d = node_value(match.xf).shape[-1]
    x_root = cast_input(match.xf)
    for end in range(len(match.chain) - 1, -1, -1):
        result = node_value(match.chain[end]).dtype
        weight = match.weight if match.weight_at is not None and match.weight_at <= end else None
        skipped = [node_value(n).dtype for n in match.stats + match.chain[:end]]
        for x in ([x_root] if x_root is not None else []) + [match.xf]:
            xval = _float_val(x)
            if xval is None or xval.dtype != result:
                continue
            rounded = skipped + ([node_value(match.xf).dtype] if x is not match.xf else [])
            if any(_MANTISSA[dt] < _MANTISSA[result] for dt in rounded):
                continue
            try:
                value = _fake_rms_norm(x, d, weight, match.eps)
            except Exception:  # noqa: BLE001 - an op the fake mode refuses is not fused
                value = None
            if value is None or value.dtype != result or value.ndim != xval.ndim:
                continue
            return end, x, weight, value
    return None


def fuse_rms_norm(ep: torch.export.ExportedProgram, *_args) -> list[str]:
    """Rewrite in place; returns one description per norm fused."""
    graph = ep.graph_module.graph
    squares = [n for n in graph.nodes if is_call(n, aten.pow.Tensor_Scalar, aten.mul.Tensor)]
    done = []
    for square in squares:
        match = _match(square)
        if match is None:
            continue
        plan = _plan(match)
        if plan is None:
            continue
        end, x, weight, value = plan
        last = match.chain[end]
        d = node_value(match.xf).shape[-1]
        with graph.inserting_before(last):
            fused = graph.call_function(aten.rms_norm.default, (x, [d], weight, match.eps))
        fused.meta["val"] = value
        take_provenance(fused, last.meta)
        last.replace_all_uses_with(fused)
        replaced = match.stats + match.chain[:end + 1]
        done.append(f"rms_norm: {last.name} ({', '.join(n.name for n in replaced)})")
    if done:
        graph.eliminate_dead_code()
        graph.lint()
        ep.graph_module.recompile()
    return done
