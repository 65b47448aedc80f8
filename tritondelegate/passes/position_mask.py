"""A mask built per call from positions becomes part of the attention launch: ``scaled_dot_product_
attention(q, k, v, attn_mask=key_index <= positions)`` becomes ``tritondelegate::sdpa_positions(q, k,
v, positions, scale, enable_gqa)`` (``ops.py``), and the kernel compares indices instead of reading a
mask (``MASK="positions"``), skipping the key tiles past the last position.

A decoder with a KV cache attends over its whole cache, keys 0 .. max_seq_len - 1, and masks out
those past each query's position. The demo's ``KVCacheDecoder`` and transformers' static cache
write that mask as

    mask = key_positions[None, :] <= input_pos[:, None]         [T, S]   (key_positions = arange(S))
    mask = (arange(S) + 0)[None, None, None, :] <= positions[:, None, :, None]  (then expanded)

one launch per call whose result every layer reads, [T, S] bytes each time. The rewrite applies when
the mask, through ``expand`` or ``alias``, is ``le(key_index, positions)`` (or ``ge(positions,
key_index)``) with

* ``key_index`` a view of ``arange(S)`` (``arange(0, S, 1)``, plus 0 or not) or of a constant buffer
  holding ``arange(S)``, varying along the last dim only, S the keys' length;
* ``positions`` integers of size 1 in the last dim (one position per query row);

and the attention takes no dropout and no ``is_causal``. ``positions`` then broadcasts to the queries'
rows as the mask broadcast to the scores. Nodes only the mask read are removed.

The float mask transformers builds for eager attention, ``where(key_index <= positions, 0, finfo.min)``
(an sdpa's once ``eager_attention`` rewrote it), is that bool mask too: 0 where it keeps, and a value
at most -1e30 (or -inf) where it masks, which swallows any score. The two differ only in a row that
keeps no key (a position below 0, which no cache has): eager's softmax spreads it evenly over the
masked keys where the kernel gives 0.
"""

from __future__ import annotations

import torch
import torch.fx

from ..kernels.attention import sdpa_params
from ..ops import sdpa_positions
from .eager_attention import FILL_MAX, fill_value
from .fold_constants import constant_inputs
from .rewrite import cast_input, erase_unused, is_call, new_node, tensor_val

aten = torch.ops.aten

_PASS_THROUGH = {aten.expand.default, aten.alias.default}
_INDEX_VIEWS = {aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                aten.expand.default, aten.alias.default}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}


def _strip(node, views):
    while is_call(node, *views):
        node = node.args[0]
    return node


def _is_arange(node, length: int, constants: dict) -> bool:
    """Whether ``node``'s value is ``arange(length)`` (integers)."""
    if is_call(node, aten.add.Tensor) and node.args[1] == 0 and node.kwargs.get("alpha", 1) == 1:
        node = node.args[0]
    val = tensor_val(node)
    if val is None or val.dtype not in (torch.int64, torch.int32) or tuple(val.shape) != (length,):
        return False
    if is_call(node, *_ARANGES):
        args = ([0] if node.target is aten.arange.default else []) + list(node.args) + [1]
        return tuple(args[:3]) == (0, length, 1)
    value = constants.get(node)
    return value is not None and torch.equal(value, torch.arange(length, dtype=value.dtype))


def _key_index(node, length: int, constants: dict) -> bool:
    """Whether ``node`` is a view of ``arange(length)`` varying along its last dim only."""
    val = tensor_val(node)
    if val is None or val.dim() == 0 or val.shape[-1] != length or any(s != 1 for s in val.shape[:-1]):
        return False
    return _is_arange(_strip(node, _INDEX_VIEWS), length, constants)


def _positions(sdpa: torch.fx.Node, constants: dict):
    """The positions node when ``sdpa``'s mask is ``key_index <= positions``, else None."""
    p = sdpa_params(sdpa)
    mask, key = p["attn_mask"], tensor_val(p["key"])
    if mask is None or p["dropout_p"] != 0 or p["is_causal"] or key is None or not isinstance(key.shape[-2], int):
        return None
    compare = _strip(mask, _PASS_THROUGH)
    while cast_input(compare) is not None:  # a float cast keeps 0 and a fill at most -1e30 (or -inf)
        compare = _strip(cast_input(compare), _PASS_THROUGH)
    if is_call(compare, aten.where.self) and fill_value(compare.args[1], constants) == 0:
        fill = fill_value(compare.args[2], constants)
        if fill is None or not fill <= FILL_MAX:
            return None
        compare = _strip(compare.args[0], _PASS_THROUGH)  # where(keep, 0, min): the bool mask keep
    if is_call(compare, aten.le.Tensor):
        index, positions = compare.args[:2]
    elif is_call(compare, aten.ge.Tensor):
        positions, index = compare.args[:2]
    else:
        return None
    val = tensor_val(positions)
    if val is None or val.dtype not in (torch.int64, torch.int32) or val.dim() == 0 or val.shape[-1] != 1:
        return None
    return positions if _key_index(index, key.shape[-2], constants) else None


def position_mask(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite each attention whose mask is built from positions into
    ``tritondelegate::sdpa_positions``; returns one description per rewrite."""
    graph = ep.graph_module.graph
    constants = constant_inputs(ep, set())
    done = []
    for node in [n for n in graph.nodes if is_call(n, aten.scaled_dot_product_attention.default)]:
        positions = _positions(node, constants)
        if positions is None:
            continue
        p = sdpa_params(node)
        args = (p["query"], p["key"], p["value"], positions, p["scale"], bool(p["enable_gqa"]))
        with graph.inserting_before(node):
            new = new_node(graph, sdpa_positions, args, node.meta["val"], node.meta)
        mask = p["attn_mask"]
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        erase_unused(graph, [mask])
        done.append(f"mask of {new.name} computed in its kernel from {positions.name} "
                    f"(tritondelegate::sdpa_positions)")
    return done
