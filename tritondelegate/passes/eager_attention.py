"""Attention written out ("eager" attention) becomes one attention launch.

transformers models run with ``attn_implementation="eager"`` (GPT-OSS always: its sinks need it), and
models written by hand, compute attention as

    scores = matmul(q, k^T) * scale [+ mask] [+ bias ...]     scale: a mul or div, or on q before
    scores = scores.masked_fill(~keep, -inf)                  (optional, as many as written)
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
kernel with the sink starting each row's running max and sum. Gemma 2's soft-capped scores,
``tanh(scores / cap) * cap`` after the scale and before the mask, become
``tritondelegate::sdpa_softcap(q, k, v, mask, cap, scale, enable_gqa)``, the kernel's ``SOFTCAP``
(only numbers multiply the scores before the cap, none after it, and no sinks).

What matches, read from the output back: ``view(bmm(view(expand(p)), view(expand(v))))`` [B, H, Lq,
Ev]; ``p`` through casts between fp32, fp16 and bf16, ``clone`` (dropout in eval), ``alias`` and
reshapes back to the shape they started from; the sinks' slice ``[..., :-1]``; ``softmax``,
``_softmax`` (no half_to_float) or ``_safe_softmax`` over the last dim; for sinks the ``cat`` with a
per-head [1, H, 1, 1] tensor expanded and the subtracted ``max``; then the scores, any number of
steps over the product in any order (``score_mask``): numbers multiplying or dividing; float tensors
added (T5's and MPNet's position bias and padding mask, ALiBi), each broadcasting to [B, H, Lq, Lk]
without making the scores bigger; ``where``/``masked_fill`` of a bool condition with -inf or with a
finite value at most -1e30 (a constant too: GPT-Neo's ``torch.tensor(finfo.min)``; such a value
swallows any score, so adding it is replacing it). The product: numbers on q (read by the matmul
alone) join the scale; ``view(bmm(view(expand(q)), view(expand(kt))))``, or a ``baddbmm(term, q, kt,
beta, alpha)`` (BLOOM's ALiBi: beta * term is a step, alpha the scale; a [B * H, M, N] term viewed as
[B, H, M, N]); the operands' ``expand`` may be copied (``clone``) before its view; ``kt`` is k
transposed (a ``permute``/``transpose`` of the last two dims, or of the [B * H, Lk, E] view's; anything
else becomes a transposed view of it); k and v that are both ``repeat_kv`` of one group size are read
un-repeated with ``enable_gqa=True``; q and k cast from v's 16-bit dtype to fp32 (GPT-Neo) are read
uncast (the kernel's products of 16-bit values are exact in fp32). ``score_mask`` turns the steps into
the sdpa's mask: none, the one tensor added, the bool condition, or the steps replayed in fp32 on 0,
made once per distinct list of steps and read by every layer with the same terms.

Refused (the graph left as it is): any intermediate from the scores to the weights read by anything
else (returned attention weights, a score read twice), a softmax over another dim, any other op in
the chain (a soft-cap after a mask, a tensor multiplying the scores, a number added), a number at most 0
multiplying masked scores, q, k, v and the result of different dtypes, a fill value above -1e30, and
anything the attention kernel would not take (``supported``). A row whose keys are all masked by -inf
gives 0 where eager's softmax gives NaN, as PyTorch's sdpa does; scores and weights are computed in
fp32, without the roundings to fp16/bf16 between the ops.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from .. import ops
from ..kernels import attention, sizes
from ..kernels.rows import node_arg
from . import score_mask
from .fold_constants import constant_inputs
from .fold_repeat_kv import repeated_kv
from .rewrite import (cast_input, erase_unused, fake, is_call, is_number, new_node, number_operand, replace_node,
                      same_shape, tensor_val)

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SOFTMAXES = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
_SINK_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
               aten.expand.default, aten.alias.default)
FILL_MAX = -1e30  # a finite fill at most this swallows any score it would be added to
_TERM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_STEPS = 12  # steps between the product and the softmax followed at most


def _pass_through(node):
    """The input of ``node`` when it passes values on: a cast between fp32, fp16 and bf16 (the kernel
    computes in fp32), a ``clone`` (dropout in eval), an ``alias`` or a reshape to the shape it had
    already; else None."""
    if is_call(node, aten.clone.default, aten.alias.default) and len(node.args) == 1:
        fmt = node.kwargs.get("memory_format")
        return node.args[0] if fmt in (None, torch.preserve_format, torch.contiguous_format) else None
    if is_call(node, *_RESHAPES) and isinstance(node.args[0], torch.fx.Node):
        val, src = tensor_val(node), tensor_val(node.args[0])
        return node.args[0] if val is not None and src is not None and same_shape(val, src) else None
    src = cast_input(node)
    return src if src is not None and torch.float64 not in (tensor_val(src).dtype, tensor_val(node).dtype) else None


def _back(node, chain: list):
    """``node`` with pass-throughs stripped, and a round trip of reshapes back to its own shape
    (Falcon's ``view(view(scores, [B * H, Lq, Lk]), [B, H, Lq, Lk])``); the nodes stripped are appended
    to ``chain``."""
    while True:
        if (src := _pass_through(node)) is not None:
            chain.append(node)
            node = src
            continue
        trip, x = [node], node.args[0] if is_call(node, *_RESHAPES) else None
        while is_call(x, *_RESHAPES) and tensor_val(x) is not None and not same_shape(tensor_val(x), tensor_val(node)):
            trip.append(x)
            x = x.args[0]
        if len(trip) < 2 or not isinstance(x, torch.fx.Node) or tensor_val(x) is None:
            return node
        if not same_shape(tensor_val(x), tensor_val(node)):
            return node
        chain += trip
        node = x


def _last_dim(node, i: int, name: str, default=None) -> bool:
    """Whether argument ``i`` of ``node`` names its (first) input's last dim."""
    first = node.args[0][0] if isinstance(node.args[0], (list, tuple)) and node.args[0] else node.args[0]
    dim, val = node_arg(node, i, name, default), tensor_val(first)
    return isinstance(dim, int) and val is not None and val.dim() > 0 and dim % val.dim() == val.dim() - 1


def _same(a, b) -> bool:
    """Whether two sizes are equal (dynamic sizes compared as expressions, adding no guard)."""
    return sizes.shape((a,)) == sizes.shape((b,))


def _swapped(node):
    """The 3-D input of ``node`` when ``node`` swaps its last two dims (a ``permute``/``transpose``)."""
    if is_call(node, aten.permute.default) and [d % 3 for d in node.args[1]] == [0, 2, 1]:
        return node.args[0]
    if is_call(node, aten.transpose.int) and sorted(d % 3 for d in node.args[1:3]) == [1, 2]:
        return node.args[0]
    return None


def _operand(node, swap: bool = False):
    """(x, the [B, H, rows, cols] the bmm sees, transposed) when ``node``, a bmm operand, is
    ``view(expand(x), [B * H, rows, cols])`` (or without the expand, or with a ``clone`` of the expand)
    of a 4-D ``x``, or (``swap``:
    transposed) that view's last two dims swapped (BLOOM's ``k.view(B * H, Lk, E).transpose(1, 2)``);
    else None."""
    inner = _swapped(node) if swap else None
    node = inner if inner is not None and tensor_val(inner) is not None and tensor_val(inner).dim() == 3 else node
    if not is_call(node, *_RESHAPES):
        return None
    x = node.args[0]
    if is_call(x, aten.clone.default) and x.kwargs.get("memory_format") in (None, torch.contiguous_format):
        x = x.args[0]  # the copy a view of the expand needed
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
    shape = seen.shape if inner is None else (*seen.shape[:2], seen.shape[3], seen.shape[2])
    return x, shape, inner is not None


def _matmul(out, scores: bool = False):
    """(a, b, bmm, the nodes between bmm and a, whether b is transposed, the added (term, beta, alpha)
    or None) when ``out`` is ``matmul(a, b)`` of 4-D tensors as decomposed: ``view(bmm(view(expand(a)),
    view(expand(b))), [B, H, M, N])``; with ``scores``, b may be a transposed view and the bmm a
    ``baddbmm(term, ., ., beta, alpha)``; else None."""
    mms = (aten.bmm.default, aten.baddbmm.default) if scores else (aten.bmm.default,)
    if not is_call(out, *_RESHAPES) or not is_call(out.args[0], *mms):
        return None
    bmm, val = out.args[0], tensor_val(out)
    if list(bmm.users) != [out] or val is None or val.dim() != 4:
        return None
    term = None
    if bmm.target is aten.baddbmm.default:
        term = (bmm.args[0], bmm.kwargs.get("beta", 1), bmm.kwargs.get("alpha", 1))
        if len(bmm.args) != 3 or not isinstance(term[0], torch.fx.Node) or not all(map(is_number, term[1:])):
            return None
    first, second = bmm.args[-2:]
    found = [_operand(first), _operand(second, swap=scores)]
    if None in found or found[0][2]:
        return None
    (a, sa, _), (b, sb, b_is_k) = found
    b_, h, m, n = val.shape
    if not all(_same(x, y) for x, y in zip((*sa, *sb), (b_, h, m, sa[3], b_, h, sa[3], n))):
        return None
    view = first
    return a, b, bmm, [view] + ([view.args[0]] if view.args[0] is not a else []), b_is_k, term


def _factor(node):
    """(tensor, number) when ``node`` multiplies or divides a tensor by a Python number; else None."""
    found = number_operand(node, aten.mul.Tensor, aten.mul.Scalar)
    if found is None and is_call(node, aten.div.Tensor, aten.div.Scalar) and not node.kwargs:
        if isinstance(node.args[0], torch.fx.Node) and is_number(node.args[1]) and node.args[1] != 0:
            found = (node.args[0], 1.0 / float(node.args[1]))
    return found


def _product(x, chain: list):
    """(q, k or kt, whether it is k, the scale, the steps of a ``baddbmm``) when ``x`` is the product
    ``matmul(q, kt)`` (a number on q, read by the matmul alone, joins the scale); the product's bmm and
    plumbing are appended to ``chain``."""
    mm = _matmul(x, scores=True)
    if mm is None:
        return None
    q, kt, bmm, _, is_k, term = mm
    chain += [x, bmm]
    scale, steps = 1.0, []
    if term is not None:
        t, beta, alpha = term
        scale = float(alpha)
        shape = _batched_view(t, tensor_val(x))
        if beta != 0 and shape is None:
            return None
        steps = [("add", t, float(beta), None if shape is True else shape)] if beta != 0 else []
    found = _factor(q)
    if found is not None and len(q.users) == 1:  # q * scale read by the matmul alone: the scale joins
        q, factor = found
        scale *= factor
    return q, kt, is_k, scale, steps


def _batched_view(term, product):
    """The shape (True: none needed) to view a ``baddbmm``'s term [X, M, N] in to add it to the product
    [B, H, Lq, Lk]: none when X is 1 (or the term has fewer dims: it broadcasts as it is), [-1, H, M, N]
    when X is B * H and M, N are static; else None."""
    val = tensor_val(term)
    if val is None or val.dim() > 3:
        return None
    if val.dim() < 3 or _same(val.shape[0], 1):
        return True
    heads, rest = product.shape[1], list(val.shape[1:])
    if not _same(val.shape[0], product.shape[0] * heads) or not sizes.is_static(sizes.shape([heads, *rest])):
        return None
    return (-1, int(heads), *(int(d) for d in rest))


def fill_value(node, consts: dict) -> float | None:
    """The value of a 0-d fill: a Python number, ``scalar_tensor(v)``, ``full([], v)`` or a 0-d constant
    (GPT-Neo's ``torch.tensor(finfo.min)``, through a ``clone``); else None."""
    if is_number(node):
        return float(node)
    if is_call(node, aten.scalar_tensor.default) and is_number(node.args[0]):
        return float(node.args[0])
    if is_call(node, aten.full.default) and list(node.args[0]) == [] and is_number(node.args[1]):
        return float(node.args[1])
    while is_call(node, aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default):
        node = node.args[0]
    value = consts.get(node)
    if value is not None and value.dim() == 0 and value.dtype.is_floating_point:
        return float(value)
    return None


def _fills(x, consts: dict) -> list:
    """The ways ``x`` may be scores masked by a bool condition: [(("where", cond, keep, fill), scores)],
    keep: True attends; fill -inf or a finite value at most :data:`FILL_MAX`."""
    if is_call(x, aten.where.self):
        cond, a, b = x.args[:3]
        candidates = ((a, b, True), (b, a, False))
    elif is_call(x, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        scores, cond, value = x.args[:3]
        candidates = ((scores, value, False),)
    else:
        return []
    cval, found = tensor_val(cond), []
    for scores, value, keep in candidates:
        fill = fill_value(value, consts)
        if fill is None or cval is None or cval.dtype != torch.bool or not isinstance(scores, torch.fx.Node):
            continue
        if fill == -math.inf or (math.isfinite(fill) and fill <= FILL_MAX):
            found.append((("where", cond, keep, fill), scores))
    return found


def _terms(x) -> list:
    """The ways ``x`` may be scores plus a float tensor: [(("add", term, 1.0, None), scores)]."""
    if not is_call(x, aten.add.Tensor) or x.kwargs.get("alpha", 1) != 1 or len(x.args) != 2:
        return []
    found = []
    for scores, term in (x.args, x.args[::-1]):
        val = tensor_val(term) if isinstance(term, torch.fx.Node) else None
        if val is not None and val.dtype in _TERM_DTYPES and isinstance(scores, torch.fx.Node):
            found.append((("add", term, 1.0, None), scores))
    return found


def _scores(x, consts: dict, depth: int = 0):
    """(q, k or kt, whether it is k, the scale, the steps innermost first, the nodes from ``x`` to the
    product's bmm) when ``x`` is the scaled product followed by steps (``score_mask``): numbers
    multiplying or dividing, float tensors added, bool conditions with a fill; else None. An add may
    read the scores on either side: the first reading that finds the product is taken."""
    if depth > _MAX_STEPS:
        return None
    nodes: list = []
    x = _back(x, nodes)
    capped = _softcap(x)
    if capped is not None:  # cap * tanh(y / cap): its tanh and divide join the nodes
        sub = _scores(capped[1], consts, depth + 1)
        if sub is not None:
            *product, steps, below = sub
            return (*product, steps + [("softcap", capped[0])], nodes + [x, *capped[2]] + below)
    found = _factor(x)
    options = ([(("mul", found[1]), found[0])] if found is not None else []) + _terms(x) + _fills(x, consts)
    for step, inner in options:
        sub = _scores(inner, consts, depth + 1)
        if sub is not None:
            *product, steps, below = sub
            return (*product, steps + [step], nodes + [x] + below)
    found = _product(x, nodes)
    if found is None:
        return None
    *product, steps = found
    return (*product, steps, nodes)


def _softcap(x):
    """(cap, y, [the tanh, the divide]) when ``x`` is Gemma 2's soft-cap ``tanh(y / cap) * cap`` (or
    ``tanh(y * (1 / cap)) * cap``), cap a number above 0; else None."""
    outer = _factor(x)
    if outer is None or not is_call(outer[0], aten.tanh.default) or not outer[1] > 0:
        return None
    inner = _factor(outer[0].args[0])
    if inner is None or not math.isclose(inner[1] * outer[1], 1.0, rel_tol=1e-12):
        return None
    return outer[1], inner[0], [outer[0], outer[0].args[0]]


def _capped(steps):
    """(the scale of the muls before a soft-cap, the cap, the steps after it) for steps holding one
    soft-cap with only muls before it and none after it (the kernel caps the scaled product, then
    masks); (1, 0, steps) without one; None otherwise."""
    at = [i for i, step in enumerate(steps) if step[0] == "softcap"]
    if not at:
        return 1.0, 0.0, steps
    before, after = steps[:at[0]], steps[at[0] + 1:]
    if len(at) > 1 or any(step[0] != "mul" for step in before) or any(step[0] == "mul" for step in after):
        return None
    return math.prod(step[1] for step in before), steps[at[0]][1], after


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


def _match(out, consts: dict):
    """What the rewrite needs when ``out`` is the output of attention written out, else None."""
    mm = _matmul(out)
    if mm is None:
        return None
    probs, v, bmm, plumbing, _, _ = mm
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
    found = _scores(x, consts)
    if found is None:
        return None
    q, kt, is_k, scale, steps, nodes = found
    capped = _capped(steps)
    if capped is None or (capped[1] and sinks is not None):
        return None
    factor, softcap, steps = capped
    scale *= factor * math.prod(step[1] for step in steps if step[0] == "mul")  # they multiply the product too
    product = nodes[-2]  # the product's view, before its bmm
    nodes = chain + nodes
    if not _closed(nodes, out) or not _fits(steps, tensor_val(product)):
        return None
    # no broadcast the sdpa would not make: q, the scores and the weights at the result's [B, H, Lq]
    b, h, lq, _ = tensor_val(out).shape
    shapes = (tensor_val(q).shape[:3], tensor_val(product).shape, tensor_val(probs).shape[:3])
    if not all(_same(a, w) for a, w in zip((*shapes[0], *shapes[1][:3], *shapes[2]), (b, h, lq) * 3)):
        return None
    if not same_shape(tensor_val(product), tensor_val(probs)):
        return None
    return q, kt, is_k, v, scale, steps, sinks, softcap, nodes


def _fits(steps, product) -> bool:
    """Whether every term and condition of ``steps`` broadcasts to the product's shape without making
    it bigger, and no number at most 0 multiplies a fill (which would make -inf +inf)."""
    masked = False
    for step in steps:
        if step[0] == "mul":
            if masked and not step[1] > 0:
                return False
            continue
        masked = masked or step[0] == "where"
        val = tensor_val(step[1])
        shape = step[3] if step[0] == "add" and step[3] is not None else (val.shape if val is not None else None)
        if shape is None or len(shape) > 4:
            return False
        shape = [1] * (4 - len(shape)) + list(shape)
        pairs = enumerate(zip(shape, product.shape))
        if not all(_same(s, 1) or _same(s, p) or (i == 0 and _same(s, -1)) for i, (s, p) in pairs):
            return False
        if step[0] == "add" and not math.isfinite(step[2]):
            return False
    return True


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


def _unwidened(q, k, v):
    """(q, k) read in v's 16-bit dtype when both are exact casts of it to fp32 (GPT-Neo computes the
    scores of bf16 q and k in fp32): the kernel's products of 16-bit values are exact in fp32 too."""
    vv = tensor_val(v)
    srcs = [cast_input(x) for x in (q, k)]
    if None in srcs or vv.dtype == torch.float32 or tensor_val(q).dtype != torch.float32:
        return q, k
    if all(tensor_val(src).dtype == vv.dtype for src in srcs) and tensor_val(k).dtype == torch.float32:
        return tuple(srcs)
    return q, k


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


def _undo(graph, created: list, shared: dict) -> None:
    """Erase the nodes a refused rewrite made (newest first), and forget the shared masks among them."""
    for node in reversed(created):
        if not node.users:
            graph.erase_node(node)
    for key in [key for key, node in shared.items() if node in created]:
        del shared[key]


def _rewrite(graph, ep, out, q, kt, is_k, v, scale, steps, sinks, softcap, chain, shared: dict) -> str | None:
    created: list = []
    with graph.inserting_before(out):
        k = kt if is_k else _untransposed(graph, kt, out.meta, created)
        rk, rv = repeated_kv(k), repeated_kv(v)
        gqa = rk is not None and rv is not None and rk[1] == rv[1] > 1
        if gqa:
            k, v = rk[0], rv[0]
        q, k = _unwidened(q, k, v)
        if sinks is not None:
            sinks = _per_head(graph, sinks, out.meta, created)
    attn_mask = score_mask.mask_node(graph, steps, shared, out.meta, created)
    with graph.inserting_before(out):
        if softcap:
            new = new_node(graph, ops.sdpa_softcap, (q, k, v, attn_mask, softcap, scale, gqa), out.meta["val"],
                           out.meta)
        elif sinks is None:
            new = new_node(graph, aten.scaled_dot_product_attention.default, (q, k, v, attn_mask), out.meta["val"],
                           out.meta, kwargs={"scale": scale, "enable_gqa": gqa})
        else:
            new = new_node(graph, ops.sdpa_sinks, (q, k, v, attn_mask, sinks, scale, gqa), out.meta["val"], out.meta)
    created.append(new)
    check = (attention.supported_softcap if softcap else attention.supported if sinks is None
             else attention.supported_sinks)
    if check(new) is not None:
        _undo(graph, created, shared)
        return None
    replace_node(ep, out, new)
    graph.erase_node(out)
    erase_unused(graph, chain + score_mask.inputs(steps))
    what = ("tritondelegate::sdpa_softcap" if softcap else "tritondelegate::sdpa_sinks" if sinks is not None
            else "aten.scaled_dot_product_attention")
    mask = score_mask.describe(steps)
    extras = ([mask] if mask is not None else []) + (["enable_gqa"] if gqa else [])
    return (f"eager attention of {q.name} -> {new.name} ({what}, scale {scale:.6g}"
            + "".join(f", {e}" for e in extras) + ")")


def eager_attention(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite every attention written out in ``ep``'s graph into one sdpa (or ``sdpa_sinks``) node;
    one description per rewrite."""
    graph = ep.graph_module.graph
    consts = {node: value for node, value in constant_inputs(ep, set()).items() if value.dim() == 0}
    shared: dict = {}
    done = []
    for node in list(graph.nodes):
        if getattr(node, "_erased", False):
            continue
        found = _match(node, consts)
        if found is not None and (text := _rewrite(graph, ep, node, *found, shared)) is not None:
            done.append(text)
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done
