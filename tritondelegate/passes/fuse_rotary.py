"""Rotary embeddings written out become one ``tritondelegate::rotary(x, cos, sin)`` (``ops.py``).

Llama, Qwen2, Mistral and Gemma (transformers) and ``models.Attention.project`` write

    x * cos + rotate_half(x) * sin,   rotate_half(x) = cat((-x[..., h:], x[..., :h]), dim=-1), h = D/2

which decomposes to

    lo  = slice(x, -1, 0, h)            hi = slice(x, -1, h, end)       n = neg(hi)
    r   = cat([n, lo], -1)              a = mul(x, cos)                  b = mul(r, sin)
    out = add(a, b)

four launches per tensor (the neg and the cat's copies, the two multiplies, the add; fusion merges
no more since the cat is not pointwise). GPT-J, CodeGen and Cohere rotate the pairs (2i, 2i + 1):

    r = view(cat([unsqueeze(neg(x[..., 1::2]), -1), unsqueeze(x[..., 0::2], -1)], -1), x.shape)

(``stack((-x2, x1), -1).flatten(-2)``), which becomes ``rotary(x, cos, sin, interleaved=True)``.
``kernels/rotary.py`` runs the op in one launch that reads x once. Multiplies and the add match with their operands in either order; the dims may be written
as -1 or D - 1, the slice bounds as any values that clamp to [0, h) and [h, D); the x that is
multiplied and the x that is rotated may be two equal views (a transpose written twice). A pattern is
rewritten only when its intermediates have no other users (a ``cat`` the graph also returns stays).
The new node takes the add's metadata (its ``val`` is exactly what the op's fake implementation
computes), so symbolic shapes (a dynamic sequence length) carry over unchanged.

Then a layer's query and key, rotated by the same cos and sin, become one
``tritondelegate::rotary_pair(q, k, cos, sin)`` (one launch instead of two) and a ``getitem`` of each
result: two rotary nodes pair when their cos and sin are the same nodes (or equal views), their last
dims are equal, neither reads the other's result, and one place in the graph order can hold the pair
(after both inputs, before every user of either result). Nodes pair greedily in graph order, each with
the first later one that fits.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..kernels.refs import FLOAT_DTYPES
from ..kernels.rows import node_arg
from ..ops import rotary as rotary_op
from ..ops import rotary_angles as rotary_angles_op
from ..ops import rotary_pair as rotary_pair_op
from ..ops import rotary_pair_angles as rotary_pair_angles_op
from .rewrite import cast_input, is_call, new_node, replace_node, same_shape, slice_bounds, static_int, tensor_val
from .rotary_tables import rotary_tables

# A single rotary (tables given, or computed from angles: ``rotary_tables.py``) -> its paired form.
PAIRS = {rotary_op: rotary_pair_op, rotary_angles_op: rotary_pair_angles_op}

aten = torch.ops.aten


def _slice_of(node, x: torch.fx.Node | None = None):
    """(source, start, end) of ``node`` = ``slice(source, last dim, start, end, 1)`` (of ``x`` when
    given), bounds clamped to [0, D]; None when it is not such a slice."""
    found = slice_bounds(node)
    if found is None or (x is not None and found[0] is not x):
        return None
    source, dim, start, end, step = found
    return (source, start, end) if dim == tensor_val(source).dim() - 1 and step == 1 else None


def _rotate_half(node):
    """(x, [cat, neg, slice_hi, slice_lo]) when ``node`` is ``cat((-x[..., h:], x[..., :h]), -1)``."""
    if not is_call(node, aten.cat.default):
        return None
    parts = node.args[0]
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    neg, lo = parts
    if not is_call(neg, aten.neg.default):
        return None
    hi = _slice_of(neg.args[0])
    if hi is None:
        return None
    x, hi_start, hi_end = hi
    val = tensor_val(x)
    d = val.shape[-1]
    if d % 2 or d == 0 or (hi_start, hi_end) != (d // 2, d):
        return None
    low = _slice_of(lo, x)
    if low is None or low[1:] != (0, d // 2):
        return None
    dim = static_int(node_arg(node, 1, "dim", 0))
    if dim is None or dim % val.dim() != val.dim() - 1:
        return None
    return x, [node, neg, neg.args[0], lo]


def _step_slice(node, start: int):
    """The source of ``node`` = ``source[..., start::2]`` (a slice of the last dim to its end), or None."""
    found = slice_bounds(node)
    if found is None:
        return None
    source, dim, begin, end, step = found
    val = tensor_val(source)
    return source if (dim, begin, end, step) == (val.dim() - 1, start, val.shape[-1], 2) else None


def _rotate_every_two(node):
    """(x, [view, cat, unsqueeze, neg, odd, unsqueeze, even]) when ``node`` is GPT-J's
    ``stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)``, as export writes it: a cat of the two
    slices unsqueezed last, viewed back to x's shape."""
    if not is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    cat = node.args[0]
    if not is_call(cat, aten.cat.default) or len(cat.args[0]) != 2 or len(cat.users) != 1:
        return None
    rank = tensor_val(cat).dim()
    parts = []
    for part in cat.args[0]:
        if not is_call(part, aten.unsqueeze.default) or part.args[1] % rank != rank - 1:
            return None
        parts.append(part)
    neg, dim = parts[0].args[0], static_int(node_arg(cat, 1, "dim", 0))
    if not is_call(neg, aten.neg.default) or dim is None or dim % rank != rank - 1:
        return None
    x = _step_slice(neg.args[0], 1)
    even = _step_slice(parts[1].args[0], 0)
    if x is None or even is None or not _same(even, x):
        return None
    val, d = tensor_val(x), tensor_val(x).shape[-1]
    if d % 2 or d == 0 or not same_shape(tensor_val(node), val):
        return None
    return x, [node, cat, parts[0], neg, neg.args[0], parts[1], parts[1].args[0]]


# Views that export may repeat for each use (``k.transpose(1, 2)`` written twice): equal when their
# targets and arguments are.
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
          aten.transpose.int, aten.t.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.alias.default}


def _same(a, b, depth: int = 4) -> bool:
    """Whether ``a`` and ``b`` are one tensor: the same node, or the same view of one tensor."""
    if a is b:
        return True
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or depth == 0:
        return False
    if a.op != "call_function" or a.target not in _VIEWS or a.target != b.target or a.kwargs != b.kwargs:
        return False
    if len(a.args) != len(b.args):
        return False
    return _same(a.args[0], b.args[0], depth - 1) and a.args[1:] == b.args[1:]


def _dead_views(node) -> list[torch.fx.Node]:
    """``node`` and the views under it that only it reads, once the pattern is gone (it has no users)."""
    dead = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        users = set(node.users) - set(dead)
        if users:
            break
        dead.append(node)
        node = node.args[0]
    return dead


def _operands(node):
    """Both operand orders of a binary node whose operands are tensor nodes."""
    a, b = node.args[:2]
    if tensor_val(a) is None or tensor_val(b) is None:
        return []
    return [(a, b), (b, a)]


def _match(add: torch.fx.Node):
    """(x, cos, sin, intermediates, interleaved) when ``add`` is the root of a rotary embedding
    (``interleaved``: its pairs are (2i, 2i + 1), rotate_every_two)."""
    if not is_call(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    for m_cos, m_sin in _operands(add):
        if not (is_call(m_cos, aten.mul.Tensor) and is_call(m_sin, aten.mul.Tensor)) or m_cos is m_sin:
            continue
        for rot, sin in _operands(m_sin):
            half, interleaved = _rotate_half(rot), False
            if half is None:
                half, interleaved = _rotate_every_two(rot), True
            if half is None:
                continue
            x, nodes = half
            for x_, cos in _operands(m_cos):
                if not _same(x_, x):
                    continue
                return x_, cos, sin, [m_cos, m_sin, *nodes], interleaved
    return None


def _only_inside(intermediates: list[torch.fx.Node], add: torch.fx.Node) -> bool:
    """Whether every intermediate is read only by the pattern's own nodes (once)."""
    inside = set(intermediates) | {add}
    return all(len(n.users) == 1 and next(iter(n.users)) in inside for n in intermediates)


def _rewrite_singles(ep: torch.export.ExportedProgram) -> list[str]:
    graph = ep.graph_module.graph
    done = []
    for add in list(graph.nodes):
        found = _match(add)
        if found is None:
            continue
        x, cos, sin, intermediates, interleaved = found
        source = intermediates[-1].args[0]  # what rotate_half read: x, or an equal view of its own
        out = tensor_val(add)
        if out is None or not same_shape(out, tensor_val(x)) or not _only_inside(intermediates, add):
            continue  # x itself broadcast (cos/sin larger than x), or an intermediate read elsewhere
        with graph.inserting_before(add):
            node = graph.call_function(rotary_op, (x, cos, sin), {"interleaved": True} if interleaved else {})
        node.meta.update(add.meta)  # val: exactly the pattern's result (shape, dtype, strides)
        replace_node(ep, add, node)
        for dead in [add, *intermediates]:  # users first
            graph.erase_node(dead)
        if source is not x:
            for dead in _dead_views(source):
                graph.erase_node(dead)
        done.append(f"rotary embedding of {x.name} -> {node.name} (tritondelegate::rotary"
                    f"{', interleaved' if interleaved else ''}, {len(intermediates) + 1} nodes -> 1)")
    return done


# --- pairs ----------------------------------------------------------------------------------------
def _reads(node: torch.fx.Node, on: torch.fx.Node, order: dict) -> bool:
    """Whether ``node`` reads ``on``'s result, directly or through other nodes (``on`` comes first)."""
    stack, seen = [node], {node}
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg is on:
                return True
            if order[arg] > order[on] and arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return False


def _place(a: torch.fx.Node, b: torch.fx.Node, order: dict) -> torch.fx.Node | None:
    """The node to insert a's and b's pair before (a comes first): a, when b's inputs all come before
    it; b, when every user of a comes after b; None when neither holds."""
    if all(order[arg] < order[a] for arg in b.all_input_nodes):
        return a
    if all(order[user] > order[b] for user in a.users):
        return b
    return None


def _shares_tables(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether rotary nodes ``a`` and ``b`` are of one kind, read the same tables (cos and sin, or
    angles, scale and dtype) and have equal (static) last dims."""
    va, vb = tensor_val(a.args[0]), tensor_val(b.args[0])
    if a.target is not b.target or a.kwargs != b.kwargs or va is None or vb is None or va.dim() == 0 or vb.dim() == 0:
        return False
    if not all(_same(x, y) if isinstance(x, torch.fx.Node) else x == y for x, y in zip(a.args[1:], b.args[1:])):
        return False
    return isinstance(va.shape[-1], int) and va.shape[-1] == vb.shape[-1]


def _pair(ep: torch.export.ExportedProgram, a: torch.fx.Node, b: torch.fx.Node, before: torch.fx.Node) -> str:
    graph = ep.graph_module.graph
    q, tables = a.args[0], a.args[1:]
    k, b_tables = b.args[0], b.args[1:]
    vals = (a.meta["val"], b.meta["val"])  # exactly what the pair's fake implementation computes
    with graph.inserting_before(before):
        pair = new_node(graph, PAIRS[a.target], (q, k, *tables), vals, a.meta, kwargs=a.kwargs)
        outs = [new_node(graph, operator.getitem, (pair, i), vals[i], old.meta) for i, old in enumerate((a, b))]
    for old, new in zip((a, b), outs):
        replace_node(ep, old, new)
        graph.erase_node(old)
    for view in b_tables:  # b's tables, when equal views of a's of their own
        if isinstance(view, torch.fx.Node) and view not in tables:
            for dead in _dead_views(view):
                graph.erase_node(dead)
    return f"rotary pair: {a.name} and {b.name} -> {pair.name} ({PAIRS[a.target].name()}, 2 launches -> 1)"


def pair_rotaries(ep: torch.export.ExportedProgram) -> list[str]:
    """Pair the ``tritondelegate::rotary`` nodes of ``ep``'s graph that share cos and sin into
    ``tritondelegate::rotary_pair`` nodes. Returns one description per pair. Each node looks for a
    partner among the later ones up to the first that shares its tables and reads its result (the next
    layer's, in a decoder): the search stays linear in the layers."""
    graph = ep.graph_module.graph
    rotaries = [n for n in graph.nodes if is_call(n, *PAIRS)]
    paired: set[torch.fx.Node] = set()
    done = []
    order = {n: j for j, n in enumerate(graph.nodes)}
    for i, a in enumerate(rotaries):
        if a in paired:
            continue
        for b in rotaries[i + 1:]:
            if b in paired or not _shares_tables(a, b):
                continue
            if _reads(b, a, order):
                break
            at = _place(a, b, order)
            if at is not None:
                done.append(_pair(ep, a, b, at))
                paired.add(b)
                order = {n: j for j, n in enumerate(graph.nodes)}  # the graph changed
                break
    return done


def absorb_casts(ep: torch.export.ExportedProgram) -> list[str]:
    """A rotary whose only reader casts it to a float dtype (OLMo and Cohere rotate in fp32 tables, then
    cast back to the model's dtype) stores that dtype itself: ``rotary(..., out_dtype=d)``, the cast's
    launch gone (the kernel computes in fp32 and rounds once, to its result's dtype)."""
    graph = ep.graph_module.graph
    done = []
    for node in [n for n in graph.nodes if is_call(n, rotary_op) and "out_dtype" not in n.kwargs]:
        cast = next(iter(node.users)) if len(node.users) == 1 else None
        if cast_input(cast) is not node or cast.kwargs["dtype"] not in FLOAT_DTYPES:
            continue
        node.kwargs = {**node.kwargs, "out_dtype": cast.kwargs["dtype"]}
        node.meta["val"] = cast.meta["val"]
        replace_node(ep, cast, node)
        graph.erase_node(cast)
        done.append(f"rotary {node.name}: the cast of its result to {node.kwargs['out_dtype']} in its launch")
    return done


def fuse_rotary(ep: torch.export.ExportedProgram, fold: bool = True) -> list[str]:
    """Rewrite every rotary embedding of ``ep``'s graph into one ``tritondelegate::rotary`` node, those
    whose tables come from angles computed per call into ``tritondelegate::rotary_angles``
    (``rotary_tables.py``; ``fold``: constant folding runs next), then pair those that share their
    tables (:func:`pair_rotaries`), a cast of the result taken into the op (:func:`absorb_casts`).
    Returns one description per rewrite
    (the caller recompiles the graph module)."""
    return _rewrite_singles(ep) + absorb_casts(ep) + rotary_tables(ep, fold) + pair_rotaries(ep)
