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

A sliding-window layer's mask (transformers' static cache: Gemma 2 and 3, GPT-OSS, Mistral and Qwen2
with a window) is that comparison and a lower bound, ``and``-ed (``bitwise_and``, all-True fills left out):

    mask = full([], True) & (key_index > positions - window) & (key_index <= positions)

with ``window`` an integer of at least 1 and the same ``positions`` node in both (``lt`` written the other
way round too); it becomes ``sdpa_positions(..., window=window)``. The attention may be
``tritondelegate::sdpa_softcap`` (Gemma 2's eager attention, its ``softcap`` kept) or
``tritondelegate::sdpa_sinks`` (GPT-OSS's, its ``sinks`` kept) as well as an sdpa.

The float mask transformers builds for eager attention, ``where(key_index <= positions, 0, finfo.min)``
(an sdpa's once ``eager_attention`` rewrote it), is that bool mask too: 0 where it keeps, and a value
at most -1e30 (or -inf) where it masks, which swallows any score. The two differ only in a row that
keeps no key (a position below 0, which no cache has): eager's softmax spreads it evenly over the
masked keys where the kernel gives 0.
"""

from __future__ import annotations

import torch
import torch.fx

from ..kernels.attention import attention_params
from ..ops import sdpa_positions, sdpa_sinks, sdpa_softcap
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
    """(positions, window) when ``sdpa``'s mask is ``key_index <= positions`` (window 0), or that and
    ``key_index > positions - window``; else None."""
    p = attention_params(sdpa)
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
    bounds = [_bound(term, key.shape[-2], constants) for term in _conjuncts(compare, constants)]
    uppers = [b[1] for b in bounds if b is not None and b[0] == "upper"]
    lowers = [b[1:] for b in bounds if b is not None and b[0] == "lower"]
    if None in bounds or len(uppers) != 1 or len(lowers) > 1 or any(pos is not uppers[0] for pos, _ in lowers):
        return None
    return uppers[0], (lowers[0][1] if lowers else 0)


def _conjuncts(node, constants: dict) -> list:
    """The terms of ``a & b & ..`` (``bitwise_and``/``logical_and`` of bool masks), all-True fills left out."""
    if is_call(node, aten.bitwise_and.Tensor, aten.logical_and.default):
        return [t for arg in node.args[:2] for t in _conjuncts(_strip(arg, _PASS_THROUGH), constants)]
    return [] if _all_true(node, constants) else [node]


def _all_true(node, constants: dict) -> bool:
    """Whether ``node`` is a bool tensor that is True everywhere (``full([], True)``, a constant)."""
    val = tensor_val(node)
    if val is None or val.dtype != torch.bool:
        return False
    if is_call(node, aten.full.default) and node.args[1] is True:
        return True
    value = constants.get(node)
    return value is not None and bool(value.all())


def _bound(term, length: int, constants: dict):
    """("upper", positions) for ``key_index <= positions``, ("lower", positions, window) for ``key_index >
    positions - window`` (window >= 1), with positions integers of size 1 in the last dim; else None."""
    if is_call(term, aten.le.Tensor, aten.gt.Tensor):
        index, bound = term.args[:2]
    elif is_call(term, aten.ge.Tensor, aten.lt.Tensor):
        bound, index = term.args[:2]
    else:
        return None
    if not _key_index(index, length, constants):
        return None
    if term.target in (aten.le.Tensor, aten.ge.Tensor):
        return ("upper", bound) if _is_positions(bound) else None
    if not is_call(bound, aten.sub.Tensor) or bound.kwargs.get("alpha", 1) != 1:
        return None
    positions, window = bound.args[:2]
    if type(window) is not int or window < 1 or not _is_positions(positions):
        return None
    return "lower", positions, window


def _is_positions(node) -> bool:
    val = tensor_val(node)
    return val is not None and val.dtype in (torch.int64, torch.int32) and val.dim() > 0 and val.shape[-1] == 1


_ATTENTIONS = (aten.scaled_dot_product_attention.default, sdpa_softcap, sdpa_sinks)


def position_mask(ep: torch.export.ExportedProgram) -> list[str]:
    """Rewrite each attention (sdpa, ``sdpa_softcap``, ``sdpa_sinks``) whose mask is built from positions
    into ``tritondelegate::sdpa_positions``; returns one description per rewrite."""
    graph = ep.graph_module.graph
    constants = constant_inputs(ep, set())
    done = []
    for node in [n for n in graph.nodes if is_call(n, *_ATTENTIONS)]:
        found = _positions(node, constants)
        if found is None:
            continue
        positions, window = found
        p = attention_params(node)
        args = (p["query"], p["key"], p["value"], positions, p["scale"], bool(p["enable_gqa"]))
        kwargs = {"window": window} if window else {}
        if p.get("softcap"):  # sdpa_softcap's cap
            kwargs["softcap"] = p["softcap"]
        if p.get("sinks") is not None:  # sdpa_sinks' logits
            kwargs["sinks"] = p["sinks"]
        with graph.inserting_before(node):
            new = new_node(graph, sdpa_positions, args, node.meta["val"], node.meta, kwargs=kwargs)
        mask = p["attn_mask"]
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        erase_unused(graph, [mask])
        what = "".join(f", {k} {v.name if isinstance(v, torch.fx.Node) else v}" for k, v in kwargs.items())
        done.append(f"mask of {new.name} computed in its kernel from {positions.name}{what} "
                    f"(tritondelegate::sdpa_positions)")
    return done
