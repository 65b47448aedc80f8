"""Ops that no kernel claims, decomposed further where torch decomposes them into claimed ops.

Core ATen keeps some ops whole that no kernel claims (``elu`` before it had one, ``flip``, ``repeat`` over
more dims than its kernel walks, a training-mode ``native_batch_norm`` form, ``_trilinear``, ...). When
the partitioner says what it claims (``Partitioner.claims(node)``), each such op whose decomposition
(torch's, or ``_flip``'s and ``_trilinear``'s here) leaves no unclaimed node is decomposed, and runs on
the device instead of the host. One whose decomposition would still leave something on the host stays
whole: one host op, not several with copies between them and the device. The same holds for a node of a claimed op that its kernel
refuses (an unsupported argument) when torch decomposes the op.

Each candidate is first tried alone, on a program of its one node (cheap: the method is not retraced
per candidate). The chosen ones are then decomposed in the method at once, and the result is kept only
if it has no more unclaimed nodes of any op and no fewer claimed ones (retracing may also decompose a
claimed node: a functional batch norm retraces through the in-place one); otherwise each chosen op
is tried on the whole method in turn.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import torch
import torch.fx
import torch.utils._pytree as pytree

from .decompose import METADATA_ONLY, _registered, _table, default_keep

aten = torch.ops.aten


def _flip(x: torch.Tensor, dims) -> torch.Tensor:
    """``flip`` as one ``index_select`` per flipped dim by a reversed ``arange`` (folded to a constant at a
    static size); torch's own decomposition is a ``prims.rev``, which no kernel claims."""
    for d in dims:
        d = d % x.dim()
        x = aten.index_select(x, d, torch.arange(x.shape[d] - 1, -1, -1, device=x.device))
    return x


def _trilinear(i1: torch.Tensor, i2: torch.Tensor, i3: torch.Tensor, expand1, expand2, expand3, sumdim,
               unroll_dim: int = 1) -> torch.Tensor:
    """``_trilinear`` (``nn.Bilinear``'s op: ``y[b, o] = sum_ij x1[b, i] W[o, i, j] x2[b, j]``) as one
    einsum over its dims: input k lacks the dims ``expand_k``, the product is summed over ``sumdim``,
    which the result drops. torch has no decomposition for it; its einsum contracts the inputs pairwise
    with ``bmm`` (for Bilinear ``x1 @ W`` reshaped, then a batched product with x2), the weight's
    permutation folded to a constant. ``unroll_dim`` only chooses how ATen loops."""
    total = i1.dim() + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:total]

    def spec(dims):
        dims = {d % total for d in dims}
        return "".join(c for d, c in enumerate(letters) if d not in dims)

    return torch.einsum(f"{spec(expand1)},{spec(expand2)},{spec(expand3)}->{spec(sumdim)}", i1, i2, i3)


# Decompositions tried: torch's, with flip's replaced and trilinear's added, but for the ops that passes/
# rewrite whole before partitioning (eager attention's softmax, an eval batch norm folded into its
# convolution, complex rotary's polar).
FALLBACK = {op: fn for op, fn in {**torch._decomp.decomposition_table, aten.flip.default: _flip,
                                   aten._trilinear.default: _trilinear}.items()
            if op not in (aten._safe_softmax.default, aten.native_batch_norm.default, aten.polar.default)}


def _census(ep: torch.export.ExportedProgram, claims: Callable) -> tuple[Counter, Counter]:
    """How many tensor-valued nodes of each op ``ep`` has that the partitioner does not claim, and that
    it claims."""
    unclaimed, claimed = Counter(), Counter()
    for node in ep.graph_module.graph.nodes:
        vals = node.meta.get("val")
        tensors = any(isinstance(v, torch.Tensor) for v in (vals if isinstance(vals, (tuple, list)) else [vals]))
        if (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and tensors
                and node.target not in METADATA_ONLY):
            (claimed if claims(node) else unclaimed)[node.target] += 1
    return unclaimed, claimed


class _One(torch.nn.Module):
    """One call of ``op`` with ``args`` and ``kwargs`` whose tensors are the forward's arguments."""

    def __init__(self, op, args, kwargs):
        super().__init__()
        self.op = op
        self.leaves, self.spec = pytree.tree_flatten((args, kwargs))

    def forward(self, *tensors):
        it = iter(tensors)
        args, kwargs = pytree.tree_unflatten([next(it) if isinstance(v, torch.Tensor) else v
                                              for v in self.leaves], self.spec)
        return self.op(*args, **kwargs)


def _zeros(value):
    """Zeros of a fake tensor's size (a dynamic size at its hint) and dtype."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = [s if isinstance(s, int) else s.node.hint for s in value.shape]
    return torch.zeros(shape, dtype=value.dtype)


def _alone_ok(node: torch.fx.Node, table: dict, claims: Callable) -> bool:
    """Whether ``node``'s op, decomposed in a program of that node alone, leaves only claimed nodes."""
    args, kwargs = pytree.tree_map(lambda a: _zeros(a.meta.get("val")) if isinstance(a, torch.fx.Node) else a,
                                   (node.args, node.kwargs))
    try:
        one = _One(node.target, args, kwargs)
        ep = torch.export.export(one, tuple(v for v in one.leaves if isinstance(v, torch.Tensor)))
        unclaimed, _ = _census(ep.run_decompositions({**table, node.target: FALLBACK[node.target]}), claims)
    except Exception:  # noqa: BLE001 - the op does not export or decompose alone: it stays whole
        return False
    return not unclaimed


def _better(ep, before: tuple[Counter, Counter], claims: Callable, ops) -> bool:
    """Whether ``ep`` lost every node of ``ops``, gained no unclaimed node and lost no claimed one."""
    (unclaimed, claimed), (left, kept) = before, _census(ep, claims)
    gone = Counter({op: unclaimed[op] for op in ops})
    return (not any(left[op] for op in ops) and left <= unclaimed - gone
            and all(kept[t] >= n for t, n in claimed.items()))


def decompose_unclaimed(ep: torch.export.ExportedProgram, claims: Callable,
                        keep: Iterable | None = None) -> torch.export.ExportedProgram:
    """``ep`` (decomposed with ``keep``) with the ops of nodes the partitioner does not claim (``claims``:
    node -> bool, sizes over the method's symbols decided for their range) decomposed as the module
    docstring says."""
    table = _table(frozenset(default_keep() if keep is None else keep), *_registered())
    before = _census(ep, claims)
    first = {}
    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function" and node.target in before[0] and node.target in FALLBACK:
            first.setdefault(node.target, node)
    chosen = [op for op, node in sorted(first.items(), key=lambda item: str(item[0]))
              if _alone_ok(node, table, claims)]
    whole = _decomposed(ep, table, chosen)
    if whole is None or _better(whole, before, claims, chosen):
        return whole or ep
    kept = [op for op in chosen if (one := _decomposed(ep, table, [op])) and _better(one, before, claims, [op])]
    return _decomposed(ep, table, kept) or ep


def _decomposed(ep: torch.export.ExportedProgram, table: dict, ops):
    """``ep`` with ``ops`` decomposed too; None when there are none or the retrace fails."""
    if not ops:
        return None
    try:
        return ep.run_decompositions({**table, **{op: FALLBACK[op] for op in ops}})
    except Exception:  # noqa: BLE001 - torch's tracing of a decomposition failed: those ops stay whole
        return None
