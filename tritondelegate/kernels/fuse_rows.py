"""Row kernels with their pointwise neighbours: a pass of ``fusion.fuse`` over a delegate's launch
records, after pointwise chains and matmul epilogues are merged.

A norm, softmax or norm-apply launch (``norm.RowNorm``, ``softmax.RowSoftmax``, ``group_norm.NormApply``:
a GroupNorm's, instance norm's or training batch norm's normalization) takes the pointwise chain
(``fusion._Chain``) that alone feeds it as a prologue, and the chain that alone reads its result as an
epilogue (``rows.row_load``, ``rows.row_store``):

    P:  t = f(a, b)                  t scratch, written by P, read only by N, as N's x
    N:  u = norm(t)          ->  N':  v = g(norm(f(a, b)), c)     one launch at C's place
    C:  v = g(u, c)                  u scratch, written by N, read only by C, as C's running value

A prologue recomputes x from the chain's operands wherever the kernel reads x (twice when a row is
longer than one BLOCK_C chunk), then rounds it to t's dtype as eager stores t. An epilogue starts
from the result rounded to u's dtype (as in a GEMM epilogue) and stores C's result; u is never
stored. BERT's embedding sums into LayerNorm, a residual add into a norm, a norm's or softmax's
trailing cast (``.to(dtype)``, a dropout's clone in eval) fold this way.

A chain P merges into N when all of these hold:
  - N reads t through exactly t's view, whole (x and t have the same shape, strides and offset);
  - t's buffer is scratch (not in ``keep``), touched by no launch but P and N;
  - the chain is floating (``compute`` f32), its first operand a tensor (it stands where x was);
  - no launch between P's first read of an operand and N writes it (``fusion._unwritten``).
A chain C takes N as its epilogue when:
  - C reads u once, as the first op's operand, through exactly u's view, over u's own shape (no
    broadcast of u); u's buffer is scratch, touched by no launch but N and C;
  - the chain is floating; C's result is none of N's inputs;
  - no launch between N and C writes what N reads, or touches what N writes besides u (N moves).
Both need every tensor operand, x and the result to walk the rows view together (``rows._plan`` over
all their strides: three row dims, one column dim), else no merge. The kernels take a chain of at most
``rows.CHAIN_STEPS`` steps each way, as ``elementwise.MAX_CHAIN`` allows.

A one-pass float reduction (``reduce.RowReduce``) is offered its chains by the same rules, in the same
pass; its launch is built by ``fuse_reduce.reduce_launch`` (``merge_rows``' ``builders``), since its
result has no column dim.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

from ..plan import Arg, Launch
from . import group_norm as gn
from . import norm as nm
from . import rows as rw
from . import softmax as sm
from .refs import TRef, broadcast_strides, plan_arg

KERNELS = {"norm": nm.norm_kernel, "softmax": sm.softmax_kernel, "norm_apply": gn.norm_apply_kernel}


def merge_rows(launches, rows, chains, touched, writes, keep, users, unwritten, merged_away, taken,
               builders=None) -> dict[int, Launch]:
    """Position -> the row launch (with a prologue and/or epilogue) that now stands there.

    ``rows`` maps positions to row ops, ``chains`` to the chains computed there (``fusion._Chain``);
    positions in ``merged_away`` or ``taken`` (replaced by a GEMM epilogue) are not offered. Merged
    positions are added to ``merged_away``; ``touched``, ``writes`` and ``users`` follow the moves.
    ``unwritten`` is ``fusion._unwritten``. ``builders`` maps a kernel name to the function that
    relaunches it with its chains, like :func:`_row_launch` (the norm's and softmax's, the default):
    ``fuse_reduce.reduce_launch`` for reductions."""
    fused: dict[int, Launch] = {}
    for n, op in sorted(rows.items()):
        build = (builders or {}).get(launches[n].kernel, _row_launch)
        if n in merged_away or n in taken:
            continue
        def out(c, fused=fused):  # a position no longer offered
            return c in merged_away or c in taken or c in fused

        p = _prologue_at(n, op, chains, users, keep, writes, unwritten, out)
        c = _epilogue_at(n, op, chains, users, keep, touched, writes, out, p)
        for pro, epi in ((p, c), (None, c), (p, None)):
            launch = None if pro is None and epi is None else build(
                launches[n], op, chains.get(pro), chains.get(epi))
            if launch is not None:
                break
        else:
            continue
        if pro is not None:
            _move(pro, n, chains[pro].out.buffer, touched, writes, users)
            merged_away.add(pro)
        if epi is not None:
            _move(n, epi, op.out.buffer, touched, writes, users)
            merged_away.add(n)
        fused[n if epi is None else epi] = launch
    return fused


def _dims_of(view: TRef, t: TRef) -> list | None:
    """For each dim of ``view``, the dim of ``t`` it walks (None where its size is 1), when ``view``
    reads every element of ``t`` once with ``t``'s dims permuted (``t`` itself, or a permute of it);
    else None."""
    if (view.buffer, view.offset, view.dtype) != (t.buffer, t.offset, t.dtype) or view.numel != t.numel:
        return None
    free = [e for e in range(t.ndim) if t.shape[e] != 1]
    dims = []
    for size, stride in zip(view.shape, view.strides):
        e = None if size == 1 else next(
            (e for e in free if (t.shape[e], t.strides[e]) == (size, stride)), -1)
        if e == -1:
            return None
        if e is not None:
            free.remove(e)
        dims.append(e)
    return None if free else dims


def _prologue_at(n, op, chains, users, keep, writes, unwritten, out) -> int | None:
    """The position of the chain that may run as ``op``'s prologue, or None."""
    x = op.x
    for p, chain in chains.items():
        t = chain.out
        if p >= n or out(p) or t.buffer != x.buffer:
            continue
        if (_dims_of(x, t) is not None and t.buffer not in keep and users[t.buffer] == {p, n}
                and chain.compute == "f32" and isinstance(chain.slots[0], TRef)
                and not any(isinstance(s, TRef) and s.buffer in writes[n] for s in chain.slots)
                and unwritten(chain, n, writes)):
            return p
    return None


def _epilogue_at(n, op, chains, users, keep, touched, writes, out, p) -> int | None:
    """The position of the chain that may take ``op`` (at ``n``) as its epilogue, or None."""
    t = op.out
    readers = users[t.buffer] - {n}
    if t.buffer in keep or len(readers) != 1:
        return None
    (c,) = readers
    chain = chains.get(c)
    if chain is None or c < n or out(c) or chain.compute != "f32":
        return None
    at = [k for k, s in enumerate(chain.slots) if isinstance(s, TRef) and s.buffer == t.buffer]
    if (len(at) != 1 or at[0] > 1 or _dims_of(chain.slots[at[0]], t) is None
            or tuple(chain.out.shape) != tuple(chain.slots[at[0]].shape)):
        return None
    reads = {r.buffer for r in op.reads}
    if p is not None:
        reads |= {s.buffer for s in chains[p].slots if isinstance(s, TRef)}
    if chain.out.buffer in reads:
        return None
    moved_writes = writes[n] - {t.buffer}
    if any(writes[q] & (reads | touched[n] - {t.buffer}) or touched[q] & moved_writes for q in range(n + 1, c)):
        return None  # the row launch may not move past this launch
    return c


def _move(src: int, dst: int, gone: int, touched, writes, users) -> None:
    """Launch ``src``'s work moves into launch ``dst``; buffer ``gone`` is no longer stored."""
    touched[dst] |= touched[src] - {gone}
    writes[dst] |= writes[src] - {gone}
    for buf in touched[src]:
        users[buf].discard(src)
        users[buf].add(dst)
    users[gone] = set()


def _row_launch(launch: Launch, op, pro, epi) -> Launch | None:
    """``launch`` (computing ``op``) relaunched with chain ``pro`` as its prologue and ``epi`` as its
    epilogue (either may be None), or None when their operands do not walk the rows view together."""
    x, u = op.x, op.out
    src, pro_ops = (pro.slots[0], list(pro.slots[1:])) if pro else (x, [])
    dst, (epi_steps, epi_ops) = (epi.out, _epilogue_steps(epi, u)) if epi else (u, ([], []))
    # every tensor the launch walks, with its strides over x's dims: x (or the prologue's first operand),
    # the result (or the epilogue's), then the chains' operands
    walks = [_over_x(src, pro, x, None), _over_x(dst, None, u, epi)]
    walks += [_over_x(o, pro, x, None) if isinstance(o, TRef) else None for o in pro_ops]
    walks += [_over_x(o, None, u, epi) if isinstance(o, TRef) else None for o in epi_ops]
    plan = rw._plan(x.shape, set(op.dims), [w for w in walks if w is not None])
    if plan is None:
        return None
    found = iter(plan.strides)
    strides = [next(found) if w is not None else None for w in walks]  # (s0, s1, s2, column) per tensor
    pro_walked = [(o, s) if s is not None else o for o, s in zip(pro_ops, strides[2:2 + len(pro_ops)])]
    epi_walked = [(o, s) if s is not None else o for o, s in zip(epi_ops, strides[2 + len(pro_ops):])]
    names = {"x_ptr": src, "out_ptr": dst, "rows": plan.rows, "cols": plan.cols, "n1": plan.n1, "n2": plan.n2,
             **dict(zip(("xs0", "xs1", "xs2", "xsc"), strides[0])),
             **dict(zip(("os0", "os1", "os2", "osc"), strides[1]))}
    constexprs = {}
    for kind, chain, steps, operands, stand_in, round_to in (
            ("prologue", pro, pro.steps if pro else [], pro_walked, src, pro.out.dtype if pro else None),
            ("epilogue", epi, epi_steps, epi_walked, dst, u.dtype)):
        if chain is not None:
            names.update(zip(_chain_params(kind), rw.chain_args(operands, stand_in)))
            constexprs.update(rw.chain_constexprs(kind, steps, operands, round_to))
    title = "+".join((pro.names if pro else []) + [launch.op] + (epi.names if epi else []))
    return _relaunch(launch, names, constexprs, title)


def _over_x(o: TRef, pro, x: TRef, epi) -> list:
    """The strides, over x's dims, of ``o``: x or the result themselves (no chain), an operand of the
    prologue ``pro`` (read over its result, which x views), or of the epilogue ``epi`` (read over its
    view of the result ``u``; ``x`` is then u)."""
    if pro is None and epi is None:
        return list(o.strides)
    if pro is not None:
        own = broadcast_strides(o, pro.out.shape)
        return [0 if e is None else own[e] for e in _dims_of(x, pro.out)]
    view = next(s for s in epi.slots[:2] if isinstance(s, TRef) and s.buffer == x.buffer)
    own = broadcast_strides(o, view.shape)
    at = {e: d for d, e in enumerate(_dims_of(view, x)) if e is not None}
    return [own[at[e]] if e in at else 0 for e in range(x.ndim)]


def _epilogue_steps(chain, t: TRef):
    """The steps and operands of ``chain`` run from ``t`` (one of its first two slots) as the running value."""
    return chain.from_slot(next(k for k, s in enumerate(chain.slots[:2]) if isinstance(s, TRef) and s.buffer == t.buffer))


def _chain_params(kind: str) -> list[str]:
    """The names of a chain's runtime parameters, in ``rows.chain_args`` order."""
    p = rw.CHAIN_NAMES[kind][0]
    steps = range(rw.CHAIN_STEPS)
    return ([f"{p}{k}_ptr" for k in steps] + [f"{p}{k}_scalar" for k in steps]
            + [f"{p}{k}s{j}" for k in steps for j in range(4)])


def _relaunch(launch: Launch, values: dict, constexprs: dict, title: str) -> Launch:
    """``launch`` with the runtime arguments named in ``values`` and ``constexprs`` replaced."""
    params = [p.name for p in inspect.signature(KERNELS[launch.kernel].fn).parameters.values()
              if "constexpr" not in str(p.annotation)]
    args = list(launch.args)
    for name, value in values.items():
        args[params.index(name)] = plan_arg(value)
    return replace(launch, args=args, constexprs={**launch.constexprs, **{k: Arg.of(v) for k, v in constexprs.items()}},
                   op=title)
