"""The attention mask that stands for what eager attention does to its scores besides scaling them
(``eager_attention`` matches the scores, this module builds the sdpa's ``attn_mask``).

``eager_attention`` reads the scores as the scaled product ``alpha * (q @ k^T)`` followed by steps,
innermost first:

    ("mul", c)                    the scores so far times the number c
    ("add", term, coef, shape)    plus coef * term, a float tensor that broadcasts to [B, H, Lq, Lk]
                                  (shape: the 4-D view of a ``baddbmm``'s 3-D term, else None)
    ("where", cond, keep, fill)   where(cond, scores, fill) when keep, else where(cond, fill, scores),
                                  cond bool, fill -inf or a finite value at most -1e30

Every step is linear in the product or replaces it by a value that swallows any score, so the scores
are ``scale * (q @ k^T) + mask`` with ``mask`` the steps replayed on 0 instead of the product and
``scale`` alpha times every number the product was multiplied by. The mask is

* nothing, when no step adds or masks;
* the term itself, for one term added as it is (a transformers eager mask): no new node;
* the condition (or its ``logical_not``, made once per condition), for one bool mask with -inf;
* else the steps replayed in fp32 (``_to_copy`` of the first term, then ``add``, ``mul`` and ``where``
  of fp32 0-d fills): made once per distinct list of steps, right after the last node it reads, so
  that every layer that adds the same terms (T5's position bias and padding mask, BLOOM's ALiBi and
  causal mask) reads one mask computed once per call.

Numerics: the kernel adds the mask to the fp32 scores in fp32; replaying the steps in fp32 adds the
terms with one rounding each in fp32 where eager rounds every partial sum to a 16-bit dtype, so the
result is at least as close to the fp32 reference as eager's (a fill replaces a value as eager's does:
adding -1e30 or less to a score leaves the fill).
"""

from __future__ import annotations

import math

import torch
import torch.fx

from .rewrite import fake, is_call, new_node, tensor_val

aten = torch.ops.aten


def effective(steps) -> tuple:
    """``steps`` without the muls before the first add or where (they scale the product alone)."""
    i = next((i for i, step in enumerate(steps) if step[0] != "mul"), len(steps))
    return tuple(steps[i:])


def describe(steps) -> str | None:
    """What the mask of ``steps`` is, for the rewrite's description; None without one."""
    steps = effective(steps)
    if not steps:
        return None
    if len(steps) == 1:
        if steps[0][0] == "add":
            return "float mask" if steps[0][2] == 1 and steps[0][3] is None else "1 term"
        return "bool mask" if steps[0][3] == -math.inf else "fill mask"
    terms = sum(step[0] == "add" for step in steps)
    conds = sum(step[0] == "where" for step in steps)
    parts = ([f"{terms} term{'s' * (terms != 1)}"] if terms else []) + \
        ([f"{conds} condition{'s' * (conds != 1)}"] if conds else [])
    return " and ".join(parts)


def inputs(steps) -> list:
    """The nodes ``steps`` read: their terms and conditions."""
    return [step[1] for step in steps if step[0] != "mul"]


def mask_node(graph: torch.fx.Graph, steps, shared: dict, meta: dict, created: list):
    """The sdpa mask for ``steps`` (see the module's docstring); new nodes are appended to ``created``
    and recorded in ``shared`` by their steps, so that every attention with the same steps reads one."""
    steps = effective(steps)
    if not steps:
        return None
    if len(steps) == 1 and steps[0][0] == "add" and steps[0][2] == 1 and steps[0][3] is None:
        return steps[0][1]
    bool_mask = len(steps) == 1 and steps[0][0] == "where" and steps[0][3] == -math.inf
    if bool_mask:
        _, cond, keep, _ = steps[0]
        if keep:
            return cond
        if is_call(cond, aten.logical_not.default, aten.bitwise_not.default):
            return cond.args[0]  # masked_fill(~keep, -inf): keep
    if steps in shared:
        return shared[steps]
    with graph.inserting_before(_after(graph, inputs(steps)).next):
        if bool_mask:
            node = _call(graph, aten.logical_not.default, (steps[0][1],), meta, created)
        else:
            node = _replay(graph, steps, meta, created)
    shared[steps] = node
    return node


def _after(graph: torch.fx.Graph, nodes: list) -> torch.fx.Node:
    """The last of ``nodes`` in the graph (the last placeholder when that is a placeholder)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    last = max(nodes, key=order.__getitem__)
    if last.op == "placeholder":
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    return last


def _call(graph, target, args: tuple, meta: dict, created: list, **kwargs) -> torch.fx.Node:
    """A new node ``target(*args, **kwargs)``, its value computed on the fake values of its inputs."""
    vals = [tensor_val(a) if isinstance(a, torch.fx.Node) else a for a in args]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    val = fake(lambda *_: target(*vals, **kwargs), *tensors)
    node = new_node(graph, target, args, val, meta, kwargs=kwargs)
    created.append(node)
    return node


def _full(graph, value: float, like: torch.fx.Node, meta: dict, created: list) -> torch.fx.Node:
    """A 0-d fp32 tensor holding ``value``, on ``like``'s device."""
    device = tensor_val(like).device
    val = fake(lambda t: torch.full([], value, dtype=torch.float32, device=t.device), tensor_val(like))
    node = new_node(graph, aten.full.default, ([], value), val, meta, kwargs={"dtype": torch.float32, "device": device})
    created.append(node)
    return node


def _term(graph, step, first: bool, meta: dict, created: list) -> torch.fx.Node:
    """coef * term of an add step, viewed in 4-D; in fp32 when it is the first (fp32 from then on)."""
    _, term, coef, shape = step
    if shape is not None:
        term = _call(graph, aten.view.default, (term, list(shape)), meta, created)
    if first and tensor_val(term).dtype != torch.float32:
        term = _call(graph, aten._to_copy.default, (term,), meta, created, dtype=torch.float32)
    if coef != 1:
        term = _call(graph, aten.mul.Tensor, (term, coef), meta, created)
    return term


def _replay(graph, steps, meta: dict, created: list) -> torch.fx.Node:
    """``steps`` computed on 0 in fp32: the float mask that adds to the scaled product."""
    acc = None
    for step in steps:
        if step[0] == "mul":
            acc = _call(graph, aten.mul.Tensor, (acc, step[1]), meta, created)
        elif step[0] == "add":
            term = _term(graph, step, acc is None, meta, created)
            acc = term if acc is None else _call(graph, aten.add.Tensor, (acc, term), meta, created)
        else:
            _, cond, keep, fill = step
            base = acc if acc is not None else _full(graph, 0.0, cond, meta, created)
            value = _full(graph, fill, cond, meta, created)
            acc = _call(graph, aten.where.self, (cond, base, value) if keep else (cond, value, base), meta, created)
    return acc
