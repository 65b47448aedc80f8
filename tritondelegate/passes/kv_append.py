"""A decode step's new key/value rows written into the KV cache by the attention launch that reads it.

A static-cache decoder writes its new rows into the cache, then attends over the whole cache:

    k_all = index_put(k_cache, [None, None, index], k_new)      (index_copy_(2, index, k_new) decomposed)
    v_all = index_put(v_cache, [None, None, index], v_new)
    out = sdpa_positions(q, k_all, v_all, positions, ...)       (or sdpa, sdpa_sinks, sdpa_softcap)

With the updates in place (``state.reinplace``: ``td_inplace``) that is one scatter launch (k and v
paired) and one attention launch per layer. This pass marks the attention ``td_kv_append`` and the two
updates ``td_appended``: the updates then launch nothing (their lowering binds the cache, in place) and
the attention launch writes the rows (``attention.attention_append_kernel``, as flash-attention's
``flash_attn_with_kvcache(..., k=k_new, v=v_new)`` appends inside its kernel): one launch per layer less.

A launch has no grid-wide barrier, so no program may read a row that another program is still writing.
Each program writes every new row that falls into the keys it may read (its split's run of keys with
flash-decoding, else all of them), waits for its own threads, then reads: a row is read only by the
programs that wrote it, and the programs of one key head that write the same row (its query heads
when they are not packed into one program, its other query blocks) write the same bytes.

An attention is marked when all of these hold:

* its key and value are two updates marked in place, each ``index_put(cache, [None, None, index], rows)``
  (no accumulation) of a 4-d cache [B, Hkv, S, E] along its sequence dim, at one
  index node (1-d integers, [Lnew]), with rows of the cache's dtype broadcasting to [B, Hkv, Lnew, E]
  and B the attention's batch;
* each update's result is read by the attention, as its key (value) and nowhere else, and otherwise
  only by the method's output (the write-back);
* the three nodes are in one delegate;
* the attention launch has one query block per (batch, key head, key split) at the sizes' upper
  bounds (``attention.one_query_block``: a decode step, or a prompt of one token). A prefill keeps
  its scatter: each of its query blocks would write the rows again.

Anything else is left as it is. The graph itself is not changed: only the marks are set.
"""

from __future__ import annotations

import torch
import torch.fx

from .. import ops as td_ops
from ..kernels import attention as attn
from ..kernels import sizes
from .rewrite import is_call, tensor_val
from .state import INPLACE, MethodGraph

aten = torch.ops.aten
ATTENTIONS = (aten.scaled_dot_product_attention.default, td_ops.sdpa_positions, td_ops.sdpa_sinks, td_ops.sdpa_softcap)


def kv_append(graph: MethodGraph) -> list[str]:
    """Mark each attention whose cache updates it can write (see the module's docstring); returns one
    description per attention marked."""
    done = []
    for node in graph.ep.graph_module.graph.nodes:
        if not is_call(node, *ATTENTIONS):
            continue
        updates = _updates(node, graph.partition.tags)
        if updates is None or not attn.one_query_block(node):
            continue
        node.meta[attn.APPEND] = True
        for update in updates:
            update.meta[attn.APPENDED] = True
        done.append(f"KV-cache append: {updates[0].name} and {updates[1].name} written by the launch of "
                    f"{node.name} (attention_append)")
    return done


def _updates(node: torch.fx.Node, tags: dict) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """The key and value updates of attention ``node`` when it may write them, else None."""
    args = node.args[:3]
    key, value = args[1], args[2]
    if not all(isinstance(a, torch.fx.Node) for a in args) or len({*args}) != 3:
        return None
    rows = [_rows(u, node) for u in (key, value)]
    if rows[0] is None or rows[1] is None or rows[0][2] is not rows[1][2]:
        return None
    if tags.get(node.name) is None or {tags.get(key.name), tags.get(value.name)} != {tags[node.name]}:
        return None
    others: set[torch.fx.Node] = set()
    torch.fx.map_arg((node.args[3:], node.kwargs), others.add)
    if key in others or value in others:  # read otherwise too (a mask of the cache): its old rows
        return None
    return key, value


def _rows(update: torch.fx.Node, attention: torch.fx.Node):
    """(cache, rows, index) of ``update`` when it is a row update the attention launch can write."""
    if update.op != "call_function" or not update.meta.get(INPLACE):
        return None
    found = attn.update_rows(update)
    if found is None or any(u is not attention and u.op != "output" for u in update.users):
        return None
    cache, rows, index = (tensor_val(n) for n in found)
    out = tensor_val(attention)
    if any(t is None for t in (cache, rows, index, out)) or cache.ndim != 4 or index.ndim != 1:
        return None
    if index.dtype not in (torch.int64, torch.int32) or rows.dtype != cache.dtype:
        return None
    b, h, _, e = sizes.shape(cache.shape)
    target = (b, h, sizes.size(index.shape[0]), e)
    given = sizes.shape(rows.shape)
    if len(given) > 4 or any(n not in (1, t) for n, t in zip(reversed(given), reversed(target))):
        return None  # rows broadcast to [B, Hkv, Lnew, E] (a batch of one may come as [Hkv, Lnew, E])
    return found if sizes.size(out.shape[0]) == b else None
