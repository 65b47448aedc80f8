"""Fold grouped-query attention's ``repeat_kv`` into ``scaled_dot_product_attention(enable_gqa=True)``.

Llama-style models repeat each key/value head for its group of query heads before attention:

    view(clone(expand(unsqueeze(k, 2), [b, kv, rep, s, d])), [b, kv * rep, s, d])

which costs a copy of k and of v per layer (with one key/value head, multi-query attention: Gemma-2B,
Gemma 3 1B, Falcon-7B, the view needs no copy and there is no ``clone``). The attention kernel reads
head ``h`` of a GQA call from kv head ``h // rep`` directly, so the pass hands it ``k`` and ``v``
themselves. It runs on the exported graph before partitioning and changes no result: ``enable_gqa`` is
defined as that repetition.
"""

from __future__ import annotations

import torch
import torch.fx

from .rewrite import tensor_val

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _shape(node) -> tuple[int, ...] | None:
    val = tensor_val(node)
    return None if val is None else tuple(val.shape)


def repeated_kv(node) -> tuple[torch.fx.Node, int, list[torch.fx.Node]] | None:
    """(the un-repeated tensor, the repeat count, the chain's nodes) when ``node`` is repeat_kv."""
    chain = [node]
    if not (isinstance(node, torch.fx.Node) and node.target in _VIEWS):
        return None
    expand = node.args[0]
    if isinstance(expand, torch.fx.Node) and expand.target == aten.clone.default:
        chain.append(expand)
        expand = expand.args[0]  # one key/value head (multi-query) repeats as a view: no clone
    if not (isinstance(expand, torch.fx.Node) and expand.target == aten.expand.default):
        return None
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, torch.fx.Node) and unsqueeze.target == aten.unsqueeze.default
            and unsqueeze.args[1] == 2):
        return None
    chain += [expand, unsqueeze]
    source = unsqueeze.args[0]
    src, out, expanded = _shape(source), _shape(node), _shape(expand)
    if src is None or out is None or expanded is None or len(src) != 4 or len(expanded) != 5:
        return None
    b, kv, s, d = src
    rep = expanded[2]
    if expanded != (b, kv, rep, s, d) or out != (b, kv * rep, s, d):
        return None
    return source, rep, chain


def fold_repeat_kv(gm: torch.fx.GraphModule) -> bool:
    """Rewrite every sdpa whose key and value are both repeat_kv of the same group size. Returns
    whether the graph changed."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.scaled_dot_product_attention.default:
            continue
        if node.kwargs.get("enable_gqa", False) or len(node.args) < 3:
            continue
        key, value = repeated_kv(node.args[1]), repeated_kv(node.args[2])
        if key is None or value is None or key[1] != value[1] or key[1] <= 1:
            continue
        node.args = (node.args[0], key[0], value[0], *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for chain in (key[2], value[2]):
            for dead in chain:  # outermost first: each becomes unused once its user is gone
                if not dead.users:
                    gm.graph.erase_node(dead)
        changed = True
    if changed:
        gm.recompile()
    return changed
