"""Pointwise chain fusion: a pass over a delegate's launch list, run by ``LaunchBuilder.finish``.

    P:  t = f(a, b)                      t a scratch buffer only P writes and only C reads
    C:  u = g(t, c)          ->    C':  u = g(f(a, b), c)      one launch at C's place, t never stored

Repeated, this turns Llama's RMSNorm tail ``add(mean, eps) -> rsqrt -> mul(x, .) -> mul(., weight)``
into one ``pointwise_chain`` launch (``elementwise.pointwise_chain_kernel``) that keeps the running
value in registers. Moving P's work to C's place moves its reads of its operands later: the graph is
functional except for in-place updates (``LaunchBuilder.writes_in_place``: a KV-cache write into a
delegate input), so P is merged only when no launch between P and C may write one of its operands.

P merges into C when all of these hold:
  - both are ``pointwise`` launches of one or two operands (``where``, ``clamp`` and ops with
    ``alpha != 1`` are left alone) with the same compute type;
  - C reads t through exactly the desc P wrote (no view), once. C may broadcast t (RMSNorm's
    ``rsqrt`` is [..., 1], its consumer [..., D]): P's ops then run once per element of C's output
    instead of t's, a few ALU ops more per element in a memory-bound kernel, for a launch and a
    store and load of t fewer;
  - t's buffer is scratch, touched by no launch but P and C, and neither a delegate output nor viewed
    by one;
  - no launch between P (or the first op of P's chain) and C may write an operand of P's chain;
  - the chain stays exact enough: in a floating chain every intermediate and the result are floating
    (eager rounds intermediates to their dtype, the chain keeps fp32: more accurate, never less); in an
    integer or bool chain every intermediate has the compute dtype itself (int64, bool), so no
    wrap-around or truncation is skipped;
  - the chain has at most ``MAX_CHAIN`` ops and its operands walk together in ``MAX_RANK`` dims.

A ``copy`` consumer (a cast, e.g. RMSNorm's ``.to(x.dtype)``) adds no op: the chain's store casts to
its dtype. A chain is linear (one running value): launches are visited in order, and of a consumer's
operands the first whose producer qualifies is merged.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..plan import Arg, ArgKind, Launch
from . import elementwise as ew
from .builder import TRef

# r may stand on either side of these: no SWAP flag, fewer kernel variants
COMMUTATIVE = {"add", "mul", "eq", "ne", "logical_and", "logical_or", "bitwise_and", "bitwise_or"}


@dataclass
class FusionResult:
    launches: list[Launch]
    changed: bool


@dataclass
class _Chain:
    """The ops one launch computes: step 0 reads slots 0 and 1, step k > 0 reads slot k + 1."""

    out: TRef
    compute: str
    steps: list[tuple[str, int, bool]]  # (op, arity, swap)
    slots: list  # TRef, Python scalar, or None (the step is unary)
    read_at: list[int]  # the launch position that first read each slot
    names: list[str] = field(default_factory=list)  # the nodes, for the launch's ``op``

    @staticmethod
    def of(spec, name: str, position: int) -> "_Chain | None":
        arity = len(spec.operands)
        if arity not in (1, 2) or spec.alpha != 1:
            return None
        slots = list(spec.operands) + [None] * (2 - arity)
        return _Chain(spec.out, spec.compute, [(spec.op, arity, False)], slots, [position] * 2, [name])


def _exact_intermediate(producer: _Chain, consumer) -> bool:
    """Whether keeping ``producer``'s result in registers (unrounded) may only make the result more
    accurate, never change it otherwise (a comparison feeding arithmetic, an int32 that wraps)."""
    if producer.compute == "f32":
        return producer.out.dtype.is_floating_point and consumer.out.dtype.is_floating_point
    return producer.out.dtype == {"i64": torch.int64, "i1": torch.bool}[producer.compute]


def _merge(producer: _Chain, consumer, k: int, position: int, name: str) -> _Chain | None:
    """``producer``'s chain followed by ``consumer`` (a PointwiseOp reading it as operand ``k``), or
    None when they may not merge."""
    t = producer.out
    arity = len(consumer.operands)
    cast_only = consumer.op == "copy" and arity == 1
    if (
        arity not in (1, 2) or consumer.alpha != 1
        or consumer.compute != producer.compute
        or (len(producer.steps) >= ew.MAX_CHAIN and not cast_only)
        or not _broadcasts(t.shape, consumer.out.shape)
        or consumer.out.buffer == t.buffer
        or any(isinstance(o, TRef) and o.buffer == t.buffer for i, o in enumerate(consumer.operands) if i != k)
        or any(isinstance(s, TRef) and s.buffer == t.buffer for s in producer.slots)
        or not _exact_intermediate(producer, consumer)
    ):
        return None
    if cast_only:
        steps, slots, read_at = producer.steps, producer.slots, producer.read_at
    else:
        swap = arity == 2 and k == 1 and consumer.op not in COMMUTATIVE
        steps = producer.steps + [(consumer.op, arity, swap)]
        slots = producer.slots + [consumer.operands[1 - k] if arity == 2 else None]
        read_at = producer.read_at + [position]
    chain = _Chain(consumer.out, producer.compute, steps, slots, read_at, producer.names + [name])
    if ew.chain_launch(chain.out, chain.steps, chain.slots, chain.compute) is None:
        return None  # too many dims once all operands walk together
    return chain


def _broadcasts(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (the producer's operands then broadcast too)."""
    pad = len(target) - len(shape)
    return pad >= 0 and all(n in (1, m) for n, m in zip(shape, target[pad:]))


def _unwritten(chain: _Chain, upto: int, writes: list[set[int]]) -> bool:
    """Whether no launch between an operand's first read and ``upto`` may write it: only then may the
    chain's reads move to ``upto`` (an in-place update in between would change what they see)."""
    for slot, first in zip(chain.slots, chain.read_at):
        if isinstance(slot, TRef) and any(slot.buffer in writes[p] for p in range(first + 1, upto)):
            return False
    return True


def _launch(chain: _Chain) -> Launch:
    grid, args, constexprs = ew.chain_launch(chain.out, chain.steps, chain.slots, chain.compute)
    return Launch(
        kernel="pointwise_chain",
        grid=grid,
        args=[Arg(ArgKind.TENSOR, a.index) if isinstance(a, TRef) else Arg.of(a) for a in args],
        constexprs={k: Arg.of(v) for k, v in constexprs.items()},
        op="+".join(chain.names),
    )


def fuse_pointwise_chains(
    launches: list[Launch], pointwise: dict, touched: list[set[int]], writes: list[set[int]], keep: set[int]
) -> FusionResult:
    """Merge pointwise producers into their consumers.

    ``pointwise`` maps a launch position to its ``elementwise.PointwiseOp``; ``touched[i]`` and
    ``writes[i]`` are the buffers launch ``i`` passes and may write; buffers in ``keep`` (delegate
    inputs and outputs) are never fused away. Launches keep their order; a fused chain takes its last
    op's place.
    """
    users: dict[int, set[int]] = defaultdict(set)
    for position, buffers in enumerate(touched):
        for buf in buffers:
            users[buf].add(position)
    touched = [set(t) for t in touched]
    chains = {pos: c for pos, spec in pointwise.items() if (c := _Chain.of(spec, launches[pos].op, pos))}
    producer = {chain.out.buffer: pos for pos, chain in chains.items()}
    merged_away: set[int] = set()
    for c in sorted(chains):
        consumer = pointwise[c]
        for k, operand in enumerate(consumer.operands):
            p = producer.get(operand.buffer) if isinstance(operand, TRef) else None
            if p is None or p >= c or p in merged_away:
                continue
            t = chains[p].out
            if t.buffer in keep or users[t.buffer] != {p, c} or operand.index != t.index:
                continue
            if not _unwritten(chains[p], c, writes):
                continue
            chain = _merge(chains[p], consumer, k, c, launches[c].op)
            if chain is None:
                continue
            chains[c] = chain
            merged_away.add(p)
            for buf in touched[p]:
                users[buf].discard(p)
                users[buf].add(c)
            users[t.buffer] = set()
            touched[c] |= touched[p] - {t.buffer}
            break
    if not merged_away:
        return FusionResult(launches, False)
    fused = [
        _launch(chains[i]) if i in chains and len(chains[i].names) > 1 else launch
        for i, launch in enumerate(launches)
        if i not in merged_away
    ]
    return FusionResult(fused, True)
