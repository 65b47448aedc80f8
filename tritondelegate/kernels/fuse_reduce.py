"""Reductions with their pointwise neighbours: the launches of ``fuse_rows.merge_rows`` for a reduce
launch (``reduce.RowReduce``: a one-pass float sum, prod, max or min), which takes the pointwise chain
(``fusion._Chain``) that alone feeds it as a prologue and the chain that alone reads its result as an
epilogue, under the same conditions as a norm or softmax (``fuse_rows.py``):

    P:  t = f(a, b)                  t scratch, written by P, read only by R, as R's x
    R:  u = reduce(t)        ->  R':  v = g(reduce(f(a, b)), c)    one launch at C's place
    C:  v = g(u, c)                  u scratch, written by R, read only by C, as C's running value

A Mixture-of-Experts layer's tail ``residual + y.view(T, k, H).sum(1)``, ``x.mean(-1) * scale``, a
reduction's trailing cast, ``(a * b).sum(-1)`` and ``x.float().pow(2).sum(-1)`` fold this way.

What differs from a row kernel is the result: ``u`` has no column dim (``u[r]`` reduces the columns
of row ``r``, rows in row-major order of the kept dims). So
  - the prologue is recomputed per element of x as the kernel reads it, once (``rows.row_load``),
    then rounded to t's dtype as eager stores t; the masked-off columns take the reduction's identity;
  - the epilogue runs once per row, on the reduced value rounded to u's dtype (eager stores u so),
    and stores C's result through its own row strides (``rows.row_store`` on a [BLOCK_R, 1] tile);
    its operands and result are addressed per output row: each of their dims is one of u's, which is
    one kept dim of x (u's sizes other than 1 are x's kept sizes, in order), and their stride over
    the reduced dims is 0.
Every tensor the launch walks (the prologue's first operand in x's place, the epilogue's result, both
chains' operands) must collapse with x's walk into three row dims and one column dim (``rows._plan``),
else no merge. The launch's blocks are chosen again for the new walk.

Refused (no merge, the launches stay as they are): a reduction split over programs (few long rows:
its partials are not the result), welford (var, var_mean) and arg reductions (two results), integer
accumulators and integer or bool results, a prologue whose result is not floating, and every case
``fuse_rows`` refuses (a value read twice or kept as an output, a broadcast of u, an in-place update
in between, a chain that is not fp32 compute).
"""

from __future__ import annotations

from ..plan import Launch
from . import rows as rw
from .fuse_rows import _dims_of, _epilogue_steps, _over_x
from .refs import TRef, broadcast_strides, new_launch


def reduce_launch(launch: Launch, op, pro, epi) -> Launch | None:
    """``launch`` (computing ``op``, a ``reduce.RowReduce``) relaunched with chain ``pro`` as its
    prologue and ``epi`` as its epilogue (either may be None), or None when they may not fold."""
    x, u = op.x, op.out
    if pro is not None and not pro.out.dtype.is_floating_point:
        return None
    kept = _kept_dims(x, op.dims, u) if epi else {}
    if kept is None:
        return None
    src, pro_ops = (pro.slots[0], list(pro.slots[1:])) if pro else (x, [])
    dst, (epi_steps, epi_ops) = (epi.out, _epilogue_steps(epi, u)) if epi else (u, ([], []))
    # every tensor the launch walks, with its strides over x's dims: x (or the prologue's first
    # operand), the epilogue's result, then the chains' operands
    walks = [_over_x(src, pro, x, None)] + ([_per_row(dst, epi, u, x, kept)] if epi else [])
    walks += [_over_x(o, pro, x, None) if isinstance(o, TRef) else None for o in pro_ops]
    walks += [_per_row(o, epi, u, x, kept) if isinstance(o, TRef) else None for o in epi_ops]
    walked = rw._plan(x.shape, set(op.dims), [w for w in walks if w is not None])
    if walked is None:
        return None
    found = iter(walked.strides)
    strides = [next(found) if w is not None else None for w in walks]  # (s0, s1, s2, column) per tensor
    plan = rw.Rows(walked.rows, walked.cols, walked.n1, walked.n2, walked.strides[:1])  # operand 0: x
    out_strides = strides[1][:3] if epi else (0, 0, 0)
    operands = strides[1 + bool(epi):]
    pro_walked = [(o, s) if s is not None else o for o, s in zip(pro_ops, operands[:len(pro_ops)])]
    epi_walked = [(o, s) if s is not None else o for o, s in zip(epi_ops, operands[len(pro_ops):])]
    constexprs = {}
    if pro is not None:
        constexprs.update(rw.chain_constexprs("prologue", pro.steps, pro_walked, pro.out.dtype))
    if epi is not None:
        constexprs.update(rw.chain_constexprs("epilogue", epi_steps, epi_walked, u.dtype))
    grid, args, constexprs = op.launch(
        src, dst, plan, out_strides, rw.chain_args(pro_walked, src) if pro else None,
        rw.chain_args(epi_walked, dst) if epi else None, constexprs)
    title = "+".join((pro.names if pro else []) + [launch.op] + (epi.names if epi else []))
    return new_launch(launch.kernel, grid, args, constexprs, title)


def _kept_dims(x: TRef, dims, u: TRef) -> dict[int, int] | None:
    """Each kept dim of x (of size other than 1) -> the dim of u it is, when u's sizes other than 1 are
    x's kept sizes in order (u's elements are the rows in row-major order of the kept dims); else None."""
    kept = [d for d in range(x.ndim) if d not in dims and x.shape[d] != 1]
    own = [e for e in range(u.ndim) if u.shape[e] != 1]
    if [x.shape[d] for d in kept] != [u.shape[e] for e in own]:
        return None
    return dict(zip(kept, own))


def _per_row(o: TRef, epi, u: TRef, x: TRef, kept: dict[int, int]) -> list:
    """The strides, over x's dims, of ``o`` (the epilogue's result or an operand, read over its view of
    u's shape): its stride along the dim of u each kept dim of x is, 0 along the reduced dims."""
    view = next(s for s in epi.slots[:2] if isinstance(s, TRef) and s.buffer == u.buffer)
    own = broadcast_strides(o, view.shape)
    at = {e: d for d, e in enumerate(_dims_of(view, u)) if e is not None}  # u's dim -> the view's
    return [own[at[kept[d]]] if d in kept and kept[d] in at else 0 for d in range(x.ndim)]
