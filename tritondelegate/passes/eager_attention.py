"""Attention written out ("eager" attention) becomes one attention launch.

transformers models run with ``attn_implementation="eager"`` (GPT-OSS always: its sinks need it), and
models written by hand, compute attention as

    scores = matmul(q, k^T) * scale [+ mask]                  scale: a mul or div, or on q before
    out = matmul(softmax(scores, -1[, dtype]).to(v.dtype), v)

which decomposes into two ``bmm`` (each with its ``expand``/``view`` plumbing), the softmax, casts,
and, for grouped-query attention, a copy of k and of v per layer (``repeat_kv``): six to eight
launches, and the [B, H, Lq, Lk] scores and weights written and read back. It becomes

    scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=...)

which the attention kernel computes in one launch (``position_mask`` then turns a mask built from
positions into ``sdpa_positions``). GPT-OSS's attention sinks, a logit per head that joins each row's
softmax but adds no value,

    logits = cat([scores, sinks.reshape(1, -1, 1, 1).expand(B, -1, Lq, -1)], -1)
    logits = logits - logits.max(-1, keepdim=True).values             (optional)
    out = matmul(softmax(logits, -1)[..., :-1], v)

become ``tritondelegate::sdpa_sinks(q, k, v, mask, sinks, scale, enable_gqa)`` (``ops.py``), the same
kernel with the sink starting each row's running max and sum.

What matches, read from the output back: ``view(bmm(view(expand(p)), view(expand(v))))`` [B, H, Lq,
Ev]; ``p`` through casts between fp32, fp16 and bf16, ``clone`` (dropout in eval) and ``alias``; the
sinks' slice ``[..., :-1]``; ``softmax``, ``_softmax`` (no half_to_float) or ``_safe_softmax`` over
the last dim; for sinks the ``cat`` with a per-head [1, H, 1, 1] tensor expanded and the subtracted
``max``; the mask: ``add`` of a float tensor, or ``where``/``masked_fill`` of a bool condition with
-inf (a bool mask: the condition, its ``logical_not`` when True drops, or ``keep`` for ``~keep``) or
with a finite value at most -1e30 (a float mask ``where(cond, 0, value)``: such a value swallows any
score, so adding it is replacing it; made once per condition); numbers multiplying or dividing the
scores, or q (read by the matmul alone); the scores' ``view(bmm(view(expand(q)), view(expand(kt))))``.
``kt`` is k transposed (a ``permute``/``transpose`` of the last two dims; anything else becomes a
transposed view of it); k and v that are both ``repeat_kv`` of one group size are read un-repeated
with ``enable_gqa=True``.

Refused (the graph left as it is): any intermediate from the scores to the weights read by anything
else (returned attention weights, a score read twice), a softmax over another dim, any other op in
the chain (soft-capping, a mask scaled with the scores), q, k, v and the result of different dtypes,
a fill value above -1e30, and anything the attention kernel would not take (``supported``). A row
whose keys are all masked by -inf gives 0 where eager's softmax gives NaN, as PyTorch's sdpa does;
scores and weights are computed in fp32, without the roundings to fp16/bf16 between the ops.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from .. import ops
from ..kernels import attention, sizes
from ..kernels.rows import node_arg
from .fold_repeat_kv import repeated_kv
from .rewrite import (cast_input, erase_unused, fake, is_call, is_number, new_node, number_operand, replace_node,
                      same_shape, tensor_val)

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SOFTMAXES = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
_SINK_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
               aten.expand.default, aten.alias.default)
FILL_MAX = -1e30  # a finite fill at most this swallows any score it would be added to


def _pass_through(node):
    """The input of ``node`` when it passes values on: a cast between fp32, fp16 and bf16 (the kernel
    computes in fp32), a ``clone`` (dropout in eval) or an ``alias``; else None."""
    if is_call(node, aten.clone.default, aten.alias.default) and len(node.args) == 1:
        fmt = node.kwargs.get("memory_format")
        return node.args[0] if fmt in (None, torch.preserve_format, torch.contiguous_format) else None
    src = cast_input(node)
    return src if src is not None and torch.float64 not in (tensor_val(src).dtype, tensor_val(node).dtype) else None


def _back(node, chain: list):
    """``node`` with pass-throughs stripped; the nodes stripped are appended to ``chain``."""
    while (src := _pass_through(node)) is not None:
        chain.append(node)
        node = src
    return node


def _last_dim(node, i: int, name: str, default=None) -> bool:
    """Whether argument ``i`` of ``node`` names its (first) input's last dim."""
    first = node.args[0][0] if isinstance(node.args[0], (list, tuple)) and node.args[0] else node.args[0]
    dim, val = node_arg(node, i, name, default), tensor_val(first)
    return isinstance(dim, int) and val is not None and val.dim() > 0 and dim % val.dim() == val.dim() - 1


def _same(a, b) -> bool:
    """Whether two sizes are equal (dynamic sizes compared as expressions, adding no guard)."""
    return sizes.shape((a,)) == sizes.shape((b,))


def _operand(node):
    """(x, the [B, H, rows, cols] the bmm sees) when ``node``, a bmm operand, is ``view(expand(x),
    [B * H, rows, cols])`` (or without the expand) of a 4-D ``x``; else None."""
    if not is_call(node, *_RESHAPES):
        return None
    x = node.args[0]
    seen = tensor_val(x)
    if is_call(x, aten.expand.default):
        x = x.args[0]
    val, flat = tensor_val(x), tensor_val(node)
    if val is None or seen is None or flat is None or val.dim() != 4 or seen.dim() != 4 or flat.dim() != 3:
        return None
    batched = (seen.shape[0] * seen.shape[1], *seen.shape[2:])
    if not all(_same(a, b) for a, b in zip(flat.shape, batched)):
        return None
    if not all(_same(a, b) or _same(a, 1) for a, b in zip(val.shape, seen.shape)):
        return None
    return x, seen.shape


def _matmul(out):
    """(a, b, bmm, the nodes between bmm and a) when ``out`` is ``matmul(a, b)`` of 4-D tensors as
    decomposed: ``view(bmm(view(expand(a)), view(expand(b))), [B, H, M, N])``; else None."""
    if not is_call(out, *_RESHAPES) or not is_call(out.args[0], aten.bmm.default):
        return None
    bmm, val = out.args[0], tensor_val(out)
    if list(bmm.users) != [out] or val is None or val.dim() != 4:
        return None
    found = [_operand(arg) for arg in bmm.args[:2]]
    if None in found:
        return None
    (a, sa), (b, sb) = found
    b_, h, m, n = val.shape
    if not all(_same(x, y) for x, y in zip((*sa, *sb), (b_, h, m, sa[3], b_, h, sa[3], n))):
        return None
    view = bmm.args[0]
    return a, b, bmm, [view] + ([view.args[0]] if view.args[0] is not a else [])


def _factor(node):
    """(tensor, number) when ``node`` multiplies or divides a tensor by a Python number; else None."""
    found = number_operand(node, aten.mul.Tensor, aten.mul.Scalar)
    if found is None and is_call(node, aten.div.Tensor, aten.div.Scalar) and not node.kwargs:
        if isinstance(node.args[0], torch.fx.Node) and is_number(node.args[1]) and node.args[1] != 0:
            found = (node.args[0], 1.0 / float(node.args[1]))
    return found


def _scores(x, chain: list):
    """(q, kt, scale, the product) when ``x`` is ``matmul(q, kt)`` times numbers (on the product or on
    q); the nodes from ``x`` to the product's bmm are appended to ``chain``."""
    scale = 1.0
    while (found := _factor(x := _back(x, chain))) is not None:
        chain.append(x)
        x, factor = found
        scale *= factor
    mm = _matmul(x)
    if mm is None:
        return None
    q, kt, bmm, _ = mm
    chain += [x, bmm]
    found = _factor(q)
    if found is not None and len(q.users) == 1:  # q * scale read by the matmul alone: the scale joins
        q, factor = found
        scale *= factor
    return q, kt, scale, x


def _fill(node) -> float | None:
    """The value of a 0-d fill: a Python number, ``scalar_tensor(v)`` or ``full([], v)``; else None."""
    if is_number(node):
        return float(node)
    if is_call(node, aten.scalar_tensor.default) and is_number(node.args[0]):
        return float(node.args[0])
    if is_call(node, aten.full.default) and list(node.args[0]) == [] and is_number(node.args[1]):
        return float(node.args[1])
    return None


def _fills(x) -> list:
    """The ways ``x`` may be scores masked by a bool condition: [(mask, scores)], mask ("keep", cond)
    (True attends), ("drop", cond) (True masks) or ("fill", cond, keep, value) (a finite value)."""
    if is_call(x, aten.where.self):
        cond, a, b = x.args[:3]
        candidates = ((a, b, True), (b, a, False))
    elif is_call(x, aten.masked_fill.Scalar):
        scores, cond, value = x.args[:3]
        candidates = ((scores, value, False),)
    else:
        return []
    cval, found = tensor_val(cond), []
    for scores, value, keep in candidates:
        fill = _fill(value)
        if fill is None or cval is None or cval.dtype != torch.bool or not isinstance(scores, torch.fx.Node):
            continue
        if fill == -math.inf:
            found.append((("keep" if keep else "drop", cond), scores))
        elif math.isfinite(fill) and fill <= FILL_MAX:
            found.append((("fill", cond, keep, fill), scores))
    return found


def _masks(x) -> list:
    """Each way ``x`` may be masked scores, unmasked first: [(mask or None, scores)]; a float mask is
    ("float", tensor), a bool condition as :func:`_fills` gives it."""
    found = [(None, x)]
    if is_call(x, aten.add.Tensor) and x.kwargs.get("alpha", 1) == 1 and len(x.args) == 2:
        for scores, mask in (x.args, x.args[::-1]):
            val = tensor_val(mask) if isinstance(mask, torch.fx.Node) else None
            if val is not None and val.dtype.is_floating_point and isinstance(scores, torch.fx.Node):
                found.append((("float", mask), scores))
    return found + _fills(x)


def _sinks(x, chain: list):
    """(the [1, H, 1, 1] sinks, the scores) when ``x`` is ``cat([scores, sinks expanded], -1)``, its
    maximum subtracted or not; the nodes from ``x`` to the cat are appended to ``chain``."""
    cat = x
    if is_call(x, aten.sub.Tensor) and not x.kwargs and isinstance(x.args[1], torch.fx.Node):
        cat, top = x.args
        values = top.args[0] if is_call(top, operator.getitem) and top.args[1] == 0 else None
        if not is_call(values, aten.max.dim) or values.args[0] is not cat or not _last_dim(values, 1, "dim"):
            return None
        if not node_arg(values, 2, "keepdim", False):
            return None
        chain += [x, top, values]
    if not is_call(cat, aten.cat.default) or len(cat.args[0]) != 2 or not _last_dim(cat, 1, "dim", 0):
        return None
    chain.append(cat)
    scores, column = cat.args[0]
    sinks = column
    while is_call(sinks, aten.expand.default):
        sinks = sinks.args[0]
    val, sval = tensor_val(sinks), tensor_val(scores)
    if val is None or sval is None or sval.dim() != 4 or val.dim() != 4:
        return None
    if not all(_same(a, b) for a, b in zip(val.shape, (1, sval.shape[1], 1, 1))):
        return None
    return sinks, scores


def _drops_last(node) -> bool:
    """Whether ``node`` is ``x[..., :-1]`` (a slice of x's last dim from 0 to its size - 1)."""
    if not is_call(node, aten.slice.Tensor) or not _last_dim(node, 1, "dim", 0):
        return False
    start, end, step = node_arg(node, 2, "start"), node_arg(node, 3, "end"), node_arg(node, 4, "step", 1)
    size = tensor_val(node.args[0]).shape[-1]  # _last_dim saw its value
    return start in (None, 0) and step == 1 and (end == -1 or (isinstance(size, int) and end == size - 1))


def _probs(p, chain: list):
    """(the softmax's input, whether the sinks' column is dropped after it) when ``p`` is the
    attention weights: (the sink column dropped from) a softmax over the last dim, through
    pass-throughs; else None."""
    p = _back(p, chain)
    sliced = _drops_last(p)
    if sliced:
        chain.append(p)
        p = p.args[0]
    if not is_call(p, *_SOFTMAXES) or not _last_dim(p, 1, "dim"):
        return None
    if p.target is aten._softmax.default and p.args[2]:  # half_to_float
        return None
    chain.append(p)
    return _back(p.args[0], chain), sliced


def _match(out):
    """What the rewrite needs when ``out`` is the output of attention written out, else None."""
    mm = _matmul(out)
    if mm is None:
        return None
    probs, v, bmm, plumbing = mm
    chain = [bmm, *plumbing]
    found = _probs(probs, chain)
    if found is None:
        return None
    x, sliced = found
    sinks = None
    if sliced:
        found = _sinks(x, chain)
        if found is None:
            return None
        sinks, x = found
        x = _back(x, chain)
    for mask, inner in _masks(x):
        nodes = chain + ([x] if mask is not None else [])
        found = _scores(inner, nodes)
        if found is None or not _closed(nodes, out):
            continue
        q, kt, scale, scores = found
        # no broadcast the sdpa would not make: q, the scores and the weights at the result's [B, H, Lq]
        b, h, lq, _ = tensor_val(out).shape
        shapes = (tensor_val(q).shape[:3], tensor_val(scores).shape, tensor_val(probs).shape[:3])
        if all(_same(a, w) for a, w in zip((*shapes[0], *shapes[1][:3], *shapes[2]), (b, h, lq) * 3)):
            if same_shape(tensor_val(scores), tensor_val(probs)):
                return q, kt, v, scale, mask, sinks, nodes
    return None


def _closed(chain: list, out) -> bool:
    """Whether every node of ``chain`` is read by ``chain`` and ``out`` alone (none returned, none read
    by anything else)."""
    members = set(chain) | {out}
    return all(set(node.users) <= members for node in chain)


def _untransposed(graph, kt, meta, created: list):
    """k from ``kt`` [B, H, E, Lk], its transpose: the view ``kt`` was taken of, or a new view."""
    src, perm = kt, [0, 1, 3, 2]
    if is_call(kt, aten.permute.default):
        src, perm = kt.args[0], [d % 4 for d in kt.args[1]]
        perm[2], perm[3] = perm[3], perm[2]
    elif is_call(kt, aten.transpose.int) and sorted(d % 4 for d in kt.args[1:3]) == [2, 3]:
        return kt.args[0]
    if perm == [0, 1, 2, 3]:
        return src
    node = new_node(graph, aten.permute.default, (src, perm), fake(lambda t: t.permute(perm), tensor_val(src)), meta)
    created.append(node)
    return node


def _per_head(graph, sinks, meta, created: list):
    """The [H] tensor of the [1, H, 1, 1] ``sinks``: the one it is a view of, or a new view."""
    node, heads = sinks, tensor_val(sinks).shape[1]
    while tensor_val(node).dim() != 1 and is_call(node, *_SINK_VIEWS) and tensor_val(node.args[0]) is not None:
        node = node.args[0]
    if tensor_val(node).dim() == 1 and _same(tensor_val(node).shape[0], heads):
        return node
    node = new_node(graph, aten.view.default, (sinks, [heads]), fake(lambda t: t.view(heads), tensor_val(sinks)), meta)
    created.append(node)
    return node


def _mask_node(graph, mask, shared: dict, meta, created: list):
    """The sdpa mask for ``mask`` (as :func:`_masks` gives it): the float mask or the bool condition
    itself, else a new ``logical_not`` or float ``where`` of the condition, made once per condition
    (``shared``) right after it, so that every layer reads the same."""
    if mask is None or mask[0] in ("float", "keep"):
        return None if mask is None else mask[1]
    cond = mask[1]
    if mask[0] == "drop" and is_call(cond, aten.logical_not.default, aten.bitwise_not.default):
        return cond.args[0]  # masked_fill(~keep, -inf): keep
    if mask in shared:
        return shared[mask]
    point = cond
    if cond.op == "placeholder":
        point = [n for n in graph.nodes if n.op == "placeholder"][-1]
    cval = tensor_val(cond)
    with graph.inserting_before(point.next):
        if mask[0] == "drop":
            node = new_node(graph, aten.logical_not.default, (cond,), fake(torch.logical_not, cval), meta)
            created.append(node)
        else:
            _, _, keep, fill = mask
            consts = []
            for value in ((0.0, fill) if keep else (fill, 0.0)):
                val = fake(lambda c, x=value: torch.full([], x, dtype=torch.float32, device=c.device), cval)
                consts.append(new_node(graph, aten.full.default, ([], value), val, meta,
                                       kwargs={"dtype": torch.float32, "device": cval.device}))
            val = fake(lambda c, a, b: torch.where(c, a, b), cval, *(tensor_val(n) for n in consts))
            node = new_node(graph, aten.where.self, (cond, *consts), val, meta)
            created += [*consts, node]
    shared[mask] = node
    return node


def _undo(graph, created: list, shared: dict) -> None:
    """Erase the nodes a refused rewrite made (newest first), and forget the shared masks among them."""
    for node in reversed(created):
        if not node.users:
            graph.erase_node(node)
    for key in [key for key, node in shared.items() if node in created]:
        del shared[key]


def _rewrite(graph, ep, out, q, kt, v, scale, mask, sinks, chain, shared: dict) -> str | None:
    created: list = []
    with graph.inserting_before(out):
        k = _untransposed(graph, kt, out.meta, created)
        rk, rv = repeated_kv(k), repeated_kv(v)
        gqa = rk is not None and rv is not None and rk[1] == rv[1] > 1
        if gqa:
            k, v = rk[0], rv[0]
        if sinks is not None:
            sinks = _per_head(graph, sinks, out.meta, created)
    attn_mask = _mask_node(graph, mask, shared, out.meta, created)
    with graph.inserting_before(out):
        if sinks is None:
            new = new_node(graph, aten.scaled_dot_product_attention.default, (q, k, v, attn_mask), out.meta["val"],
                           out.meta, kwargs={"scale": scale, "enable_gqa": gqa})
        else:
            new = new_node(graph, ops.sdpa_sinks, (q, k, v, attn_mask, sinks, scale, gqa), out.meta["val"], out.meta)
    created.append(new)
    if (attention.supported if sinks is None else attention.supported_sinks)(new) is not None:
        _undo(graph, created, shared)
        return None
    replace_node(ep, out, new)
    graph.erase_node(out)
    erase_unused(graph, chain + ([mask[1]] if mask is not None else []))
    what = "tritondelegate::sdpa_sinks" if sinks is not None else "aten.scaled_dot_product_attention"
    kinds = {"float": "float mask", "keep": "bool mask", "drop": "bool mask", "fill": "fill mask"}
    extras = ([kinds[mask[0]]] if mask is not None else []) + (["enable_gqa"] if gqa else [])
    return (f"eager attention of {q.name} -> {new.name} ({what}, scale {scale:.6g}"
            + "".join(f", {e}" for e in extras) + ")")


def eager_attention(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite every attention written out in ``ep``'s graph into one sdpa (or ``sdpa_sinks``) node;
    one description per rewrite."""
    graph = ep.graph_module.graph
    shared: dict = {}
    done = []
    for node in list(graph.nodes):
        if getattr(node, "_erased", False):
            continue
        found = _match(node)
        if found is not None and (text := _rewrite(graph, ep, node, *found, shared)) is not None:
            done.append(text)
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done
