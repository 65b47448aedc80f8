"""Gathers with a pointwise epilogue: a pass of ``fusion.fuse`` over a delegate's launch records, after
pointwise chains, matmul epilogues and row kernels are merged.

A gather launch (``index.GatherOp``: embedding, index_select, gather, advanced indexing) takes the
pointwise chain (``fusion._Chain``) that alone reads its result, as its epilogue (``index.gather_kernel``
with ``EPILOGUE`` steps):

    G:  t = src[indices]             t scratch, written by G, read only by C, as C's running value
    C:  u = h(t, c, d)       ->  G':  u = h(src[indices], c, d)      one launch at C's place

GPT-2's ``wte(ids) + wpe(positions)`` (the position rows constant-folded) and Gemma's
``embedding(ids) * normalizer`` fold this way. The epilogue starts from the gathered value rounded to
t's dtype (eager stores t so), computes in fp32 and casts at the store to C's result.

G merges into C when all of these hold:
  - C reads t once, as the first op's operand, through exactly t's view, over t's own shape (no
    broadcast of t, no reshape): each element of C's result is one gathered element;
  - t's buffer is scratch (not in ``keep``), touched by no launch but G and C;
  - the chain is floating (``compute`` f32) and its result is none of G's inputs;
  - no launch between G and C writes what G reads (its source and index tensors: G's reads move to
    C's place);
  - G's walk, recomputed with the chain's operands' and result's strides collapsed together with the
    source's and the indices', fits in ``index.MAX_RANK`` dims.
"""

from __future__ import annotations

from ..plan import Launch
from .refs import TRef, new_launch


def merge_gathers(launches, gathers, chains, writes, keep, users, merged_away, taken) -> dict[int, Launch]:
    """Consumer position -> the gather launch that now computes its chain. ``gathers`` maps positions
    to ``index.GatherOp``s, ``chains`` to the chains computed there (``fusion._Chain``); positions in
    ``merged_away`` or ``taken`` (replaced by another fused launch) are not offered. Each gather merged
    is added to ``merged_away``."""
    fused: dict[int, Launch] = {}
    for g, op in sorted(gathers.items()):
        if g in merged_away:
            continue
        c = _consumer(g, op, chains, writes, keep, users)
        if c is None or c in merged_away or c in taken or c in fused:
            continue
        launch = _gather_launch(op, chains[c], launches[g])
        if launch is not None:
            fused[c] = launch
            merged_away.add(g)
    return fused


def _consumer(g: int, op, chains, writes, keep, users) -> int | None:
    """The position of the one chain that reads ``op``'s result (at ``g``) and may take the gather, or
    None."""
    t = op.out
    readers = users[t.buffer] - {g}
    if t.buffer in keep or len(readers) != 1:
        return None
    (c,) = readers
    chain = chains.get(c)
    if chain is None or c < g or chain.compute != "f32":
        return None
    if any(r.buffer == chain.out.buffer for r in op.reads):
        return None
    if any(r.buffer in writes[p] for r in op.reads for p in range(g + 1, c)):
        return None  # an in-place update between G and C: G's reads may not move to C
    return c


def _gather_launch(op, chain, gather: Launch) -> Launch | None:
    """``gather`` (computing ``op``) relaunched with ``chain`` as its epilogue, or None unless the chain
    starts from the whole gathered tensor, read as itself, and the walk fits."""
    t = op.out
    at = [k for k, s in enumerate(chain.slots) if isinstance(s, TRef) and s.buffer == t.buffer]
    if len(at) != 1 or at[0] > 1:
        return None
    k = at[0]
    view = chain.slots[k]
    if ((view.shape, view.strides, view.offset, view.dtype) != (t.shape, t.strides, t.offset, t.dtype)
            or tuple(chain.out.shape) != tuple(t.shape)):
        return None  # a reshape of t, or a chain that broadcasts t
    walk = op.launch(chain.out, *chain.from_slot(k))
    if walk is None:
        return None
    grid, args, constexprs = walk
    return new_launch(gather.kernel, grid, args, constexprs, "+".join([gather.op] + chain.names))
