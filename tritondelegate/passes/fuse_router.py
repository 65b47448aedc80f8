"""A Mixture-of-Experts router's softmax, top-k and renormalization as one ``tritondelegate::router_topk``.

transformers' routers choose each token's experts as

    p = softmax(logits, -1 [, dtype])            Mixtral, Qwen2/3-MoE, OLMoE, PhiMoE, ...
    v, i = topk(p, k)
    v = v / v.sum(-1, keepdim=True)              (when they renormalize: norm_topk_prob)
    v = v.to(dtype)                              (optional)

or, taking the top k of the logits first (GPT-OSS, GraniteMoE, JetMoe),

    v, i = topk(logits, k);  v = softmax(v, -1 [, dtype]) [.to(dtype)]

two to five launches over a row of E logits. As ``router_topk(logits, k, softmax_first, renormalize,
dtype, out_dtype)`` one program per row does all of it in registers (``kernels/router.py``). A cast of
the logits to fp32 read only by the softmax runs in the kernel's loads (``dtype``).

The pattern matches when each intermediate is read by nothing but the next step (the probabilities by
the top-k; the values by the sum and the division; the sum by the division; the value before a cast
by the cast), the top-k is the largest k along the last dim, k a constant, and the kernel takes the row
(``router.refusal``: at most ``router.MAX_EXPERTS`` logits).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import ops
from ..kernels import router
from ..kernels.rows import node_arg
from .fuse_glu import only_read_by
from .rewrite import (erase_unused, fake, is_call, new_node, number_operand, plain_cast, replace_node,
                      rewrite_matches, static_int, tensor_val)
from .rotary_tables import scale_operand

aten = torch.ops.aten
SOFTMAXES = (aten.softmax.int, aten._softmax.default)


def _last_dim(node, at: int, default=-1) -> bool:
    dim, val = node_arg(node, at, "dim", default), tensor_val(node.args[0])
    return val is not None and isinstance(dim, int) and dim % max(val.dim(), 1) == val.dim() - 1


def _softmax_input(node) -> torch.fx.Node | None:
    """x of ``softmax(x, -1)`` (either overload); None for anything else."""
    return node.args[0] if is_call(node, *SOFTMAXES) and _last_dim(node, 1) else None


def _outputs(topk) -> tuple | None:
    """(values, indices) getitems of a top-k (either may be None); None if it is read otherwise."""
    found = {0: None, 1: None}
    for user in topk.users:
        if not is_call(user, operator.getitem) or found.get(user.args[1], 1) is not None:
            return None
        found[user.args[1]] = user
    return found[0], found[1]


def _largest_k(topk) -> int | None:
    """k of a ``topk`` of the largest k along the last dim, when k is a constant; else None."""
    if not is_call(topk, aten.topk.default) or not node_arg(topk, 3, "largest", True) or not _last_dim(topk, 2):
        return None
    return static_int(topk.args[1])


def _renormalized(values) -> torch.fx.Node | None:
    """``values / values.sum(-1, keepdim=True)`` when that is all that reads ``values``; else None."""
    users = list(values.users)
    if len(users) != 2:
        return None
    total = next((u for u in users if is_call(u, aten.sum.dim_IntList)), None)
    div = next((u for u in users if is_call(u, aten.div.Tensor)), None)
    if total is None or div is None or div.args != (values, total) or not only_read_by(total, div):
        return None
    dims, keepdim = node_arg(total, 1, "dim"), node_arg(total, 2, "keepdim", False)
    ndim = tensor_val(values).dim()
    if total.kwargs.get("dtype") is not None or not keepdim or list(dims or []) not in ([-1], [ndim - 1]):
        return None
    return div


def _cast_after(node) -> tuple:
    """(what stands for ``node``'s result, out_dtype): a float cast that alone reads it, folded."""
    users = list(node.users)
    if len(users) == 1 and plain_cast(users[0]) is node and tensor_val(users[0]).dtype.is_floating_point:
        return users[0], tensor_val(users[0]).dtype
    return node, None


def _match(topk) -> tuple | None:
    """(x, k, softmax_first, renormalize, dtype, out_dtype, what the values stand for, indices)."""
    k = _largest_k(topk)
    outputs = _outputs(topk) if k is not None else None
    if outputs is None or outputs[0] is None:
        return None
    values, indices = outputs
    if router.refusal(tensor_val(topk.args[0]), k) is not None:
        return None
    x = _softmax_input(topk.args[0])
    if x is not None and only_read_by(topk.args[0], topk):  # softmax first
        dtype = tensor_val(topk.args[0]).dtype
        src = plain_cast(x)
        if src is not None and dtype == torch.float32 and only_read_by(x, topk.args[0]):
            x = src  # the fp32 cast of the logits in the kernel's loads
        div = _renormalized(values)
        result, out_dtype = _cast_after(values if div is None else div)
        return x, k, True, div is not None, dtype, out_dtype, result, indices
    users = list(values.users)
    if len(users) == 1 and _softmax_input(users[0]) is values:  # top-k first
        result, out_dtype = _cast_after(users[0])
        x = topk.args[0]
        return x, k, False, False, tensor_val(users[0]).dtype, out_dtype, result, indices
    return None


def _place(graph, ep, before, target, args: tuple, result, indices) -> torch.fx.Node:
    """A node of ``target`` (a router op: (values, indices)) on ``args`` before ``before``, its two
    results in place of ``result`` and ``indices`` (None: not read), what they replace erased."""
    vals = torch.fx.map_arg(args, lambda n: n.meta["val"])
    val = fake(lambda *_: target(*vals), *(tensor_val(a) for a in args if isinstance(a, torch.fx.Node)))
    with graph.inserting_before(before):
        node = new_node(graph, target, args, val, before.meta)
        picks = [new_node(graph, operator.getitem, (node, j), val[j], before.meta) for j in (0, 1)]
    replaced = [(old, new) for old, new in ((result, picks[0]), (indices, picks[1])) if old is not None]
    for old, new in replaced:
        replace_node(ep, old, new)
    erase_unused(graph, [old for old, _ in replaced] + [picks[1]])  # the indices' pick when unread
    return node


def _fuse(graph, ep, topk, x, k, softmax_first, renormalize, dtype, out_dtype, result, indices) -> str:
    node = _place(graph, ep, topk, ops.router_topk, (x, k, softmax_first, renormalize, dtype, out_dtype),
                  result, indices)
    steps = ("softmax, top-k" if softmax_first else "top-k, softmax") + (", renormalize" if renormalize else "")
    return f"router top-k: {steps} of {x.name} -> {node.name} (tritondelegate::router_topk, one launch)"


# --- group-limited routers (DeepSeek-V3 and its copies: Dots1, GLM-4.5 MoE, Solar-Open, Mistral 4) ---------
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _through(node, *targets):
    """``node``'s first argument when ``node`` calls one of ``targets``, else None."""
    return node.args[0] if is_call(node, *targets) else None


def _item(node, index: int):
    """The tuple node that ``node`` takes element ``index`` of (``getitem``), else None."""
    return node.args[0] if is_call(node, operator.getitem) and node.args[1] == index else None


def _group_scores(gs) -> tuple | None:
    """(c, n_group) when ``gs`` is ``view(c, [-1, G, E / G]).topk(2)[0].sum(-1)``."""
    top2 = _through(gs, aten.sum.dim_IntList)
    if top2 is None or list(node_arg(gs, 1, "dim") or []) != [-1] or node_arg(gs, 2, "keepdim", False):
        return None
    topk = _item(top2, 0)
    if topk is None or _largest_k(topk) != 2:
        return None
    view = topk.args[0]
    c = _through(view, *_RESHAPES)
    shape = tensor_val(view).shape if c is not None else ()
    return (c, shape[1]) if len(shape) == 3 and isinstance(shape[1], int) else None


def _group_mask(mask) -> tuple | None:
    """(c, n_group, topk_group) when ``mask`` is True outside the chosen groups: ``~(zeros.scatter(1,
    topk(gs, topk_group)[1], 1)[..., None].expand(...).reshape(T, E).bool())``."""
    flag = _through(mask, aten.bitwise_not.default, aten.logical_not.default)
    flat = _through(flag, aten._to_copy.default) if flag is not None and tensor_val(flag).dtype == torch.bool else None
    wide = _through(flat, *_RESHAPES)
    wide = _through(wide, aten.clone.default) or wide
    groups = _through(_through(wide, aten.expand.default), aten.unsqueeze.default)
    if not is_call(groups, aten.scatter.value) or groups.args[1] != 1 or groups.args[3] != 1:
        return None
    zeros, picked = groups.args[0], groups.args[2]
    if not is_call(zeros, aten.full_like.default) or zeros.args[1] != 0:
        return None
    chooser = _item(picked, 1)
    topk_group = _largest_k(chooser) if chooser is not None else None
    found = _group_scores(chooser.args[0]) if topk_group is not None else None
    return None if found is None or chooser.args[0] is not zeros.args[0] else (*found, topk_group)


def _weights(gathered) -> tuple:
    """(result node, renormalize, eps, scale): ``w / (w.sum(-1, keepdim=True) + eps)`` and ``* scale``
    after the gathered weights, where they are there and read by nothing else."""
    node, renormalize, eps, scale = gathered, False, 0.0, 1.0
    users = list(gathered.users)
    total = next((u for u in users if is_call(u, aten.sum.dim_IntList)), None)
    if len(users) == 2 and total is not None and node_arg(total, 2, "keepdim", False) and len(total.users) == 1:
        shifted = next(iter(total.users))
        found = number_operand(shifted, aten.add.Tensor, aten.add.Scalar)
        ok = found is not None and found[0] is total and len(shifted.users) == 1
        div = next(iter(shifted.users)) if ok else None
        if div is not None and is_call(div, aten.div.Tensor) and div.args == (gathered, shifted) and div in users:
            node, renormalize, eps = div, True, found[1]
    if len(node.users) == 1 and (found := scale_operand(next(iter(node.users)))) is not None and found[0] is node:
        node, scale = next(iter(node.users)), found[1]
    return node, renormalize, eps, scale


def _match_group(gathered) -> tuple | None:
    """(scores, bias, n_group, topk_group, k, indices, result, renormalize, eps, scale)."""
    if not is_call(gathered, aten.gather.default) or gathered.args[1] not in (1, -1) or len(gathered.args) > 3:
        return None
    scores, indices = gathered.args[0], gathered.args[2]
    topk = _item(indices, 1)
    k = _largest_k(topk) if topk is not None else None
    masked = topk.args[0] if k is not None else None
    if not is_call(masked, aten.where.self) or masked.args[1] is None:
        return None
    mask, fill, c = masked.args
    fill_val = fill.args[0] if is_call(fill, aten.scalar_tensor.default) else fill
    found = _group_mask(mask) if fill_val == float("-inf") else None
    if found is None or found[0] is not c or not is_call(c, aten.add.Tensor) or scores not in c.args:
        return None
    bias = c.args[1] if c.args[0] is scores else c.args[0]
    if router.group_refusal(tensor_val(scores), tensor_val(bias), found[1], found[2], k) is not None:
        return None
    return (scores, bias, found[1], found[2], k, indices, *_weights(gathered))


def _fuse_group(graph, ep, gathered, scores, bias, n_group, topk_group, k, indices, result, renormalize, eps,
                scale) -> str:
    node = _place(graph, ep, gathered, ops.group_router,
                  (scores, bias, n_group, topk_group, k, renormalize, eps, scale), result, indices)
    return (f"router top-k: group-limited ({n_group} groups, top {topk_group}, top {k}) of {scores.name} -> "
            f"{node.name} (tritondelegate::group_router, one launch)")


def fuse_router(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite every router top-k of ``ep``'s graph into ``tritondelegate::router_topk``, in place;
    one description per rewrite."""
    return rewrite_matches(ep, _match, _fuse) + rewrite_matches(ep, _match_group, _fuse_group)
