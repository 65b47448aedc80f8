"""Pointwise chain fusion: a pass over a delegate's launch records (``refs.LaunchRecord``), run by
``backend.build_plan`` between lowering the nodes and ``LaunchBuilder.finish``.

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
  - C reads t once, through exactly the desc P wrote or through a reshape of it (t contiguous, the
    view contiguous over the same elements: ``x.float()[:, None]``; P's operands are then viewed in
    the reshape's shape, when PyTorch could view them so). C may broadcast t (RMSNorm's
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

Then matmul epilogues: a chain whose running value starts from a matmul's result runs in that
matmul's kernel, on the accumulator tile before the store (``matmul.epilogue_launch``):

    M:  t = A @ B (+ bias)               t a scratch buffer only M writes and only C reads
    C:  u = h(t, c, d)       ->    M':  u = h(A @ B (+ bias), c, d)     one launch at C's place

This folds a linear's activation, ``silu(gate) * up``, a scale or mask on attention scores, a
residual add and a cast into the GEMM. M merges into C when all of these hold:
  - M is the whole product in one launch; C is a pointwise launch or chain in fp32 compute;
  - t's buffer is scratch, touched by no launch but M and C, and neither a delegate output nor
    viewed by one;
  - C's chain reads t once, as the first op's operand (the running value starts from t: step 0 is
    then ``r = OP0(r, other)``, swapped when t was the right operand of a non-commutative op);
  - C reads t elementwise, without broadcasting: its view of t is t's elements in some order, so each
    element of C's result maps to one element (z, m, n) of the product; every other operand and C's
    result are then addressed by [Z, M, N] strides (a reshape of theirs that PyTorch could view), else
    no merge. A transpose of t (``(q @ k).transpose(1, 2).contiguous()``) maps too: the product is
    stored in the consumer's layout;
  - no launch between M and C may write A, B or the bias (M's reads move to C's place, as P's do).

Before both, matmul prologues: an ``rms_norm`` or ``layer_norm`` whose result only matmuls read, as their A operand,
runs inside each of them (``matmul``'s ``PROLOGUE="rms"``), so the normalized rows are never stored:

    N:  t = rms_norm(x, w, eps)          t a scratch buffer only N writes and only matmuls read
    M:  u = t @ B (+ bias)   ->    M':  u = rstd(x) * ((x * w) @ B) (+ bias)   at M's place

when t is contiguous with x's shape (x may be strided: a norm of some columns of a projection, as
DeepSeek's ``kv_a_layernorm`` of its latent's slice, reads them in place), each matmul reads t whole as
[Z, M, K] with K the normalized dim, and no launch between N and M writes x or w. A grouped GEMM
(``grouped_mm``: a Mixture-of-Experts layer's experts, reading the token rows through their expert
order; x contiguous) is such a
reader of an RMSNorm too: each row's sum of squares accumulates over the same K loop, so the norm in
front of a MoE layer (read by its router's linear, its experts, its shared experts) is no launch.
Every such matmul recomputes the row sums of squares it needs while streaming x (a few ALU ops per A
element; x is read once per N tile either way). A ``layer_norm`` (weight and bias optional) folds the
same way (``PROLOGUE="layer"``): each matmul first reads its block's rows of x for their mean and
variance, then normalizes A's tiles as it streams them.

The chain starts from t rounded to its dtype (eager stores it so), then keeps fp32 as chains do.
In ``silu(gate(x)) * up(x)`` the chain ``silu, mul`` reads gate's result first: gate's matmul moves
after up's and reads up's result in its epilogue.

Then row kernels with their neighbours (``fuse_rows.py``): a norm, softmax or one-pass float reduction
(``fuse_reduce.py``: a Mixture-of-Experts tail ``residual + y.view(T, k, H).sum(1)``) takes the chain
that alone feeds it as a prologue and the chain that alone reads its result as an epilogue; then a
gather (``fuse_gather.py``) takes the chain that alone reads its result as an epilogue (an embedding's
add or scale); a convolution takes the max or average pooling that alone reads its result
(``fuse_pool.py``), and a 1x1 convolution computes its input where it reads it, from the taps of the
depthwise convolution (with its epilogue) or the pointwise chain that wrote it for it alone
(``fuse_conv1x1.py``: MobileNet's inverted residuals, a squeeze-and-excitation scale, a pre-activation
batch norm and ReLU). Last, consecutive plain copies into adjacent slices of one buffer (a cat's parts)
become one ``cat`` launch (``fuse_cat.py``).

First of all, zero padding that only convolutions read becomes their own padding (``fuse_pad.py``),
and scatter pairs (:func:`pair_scatters`): a layer's k and v cache writes, two scatter launches
with the same grid, constexprs, indices and iteration that differ only in their destination, source
and source strides, run as one ``PAIR`` launch (``scatter.pair_launch``; grid axis 1 picks the
member) at the second's place, when neither touches what the other writes and no launch between
them touches what the first writes or writes what it touches.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch

from ..plan import Launch
from . import conv as cv
from . import depthwise as dw
from . import grouped_mm as gmm
from . import dequant_rows as dq
from . import elementwise as ew
from . import fuse_cat, fuse_conv1x1, fuse_gather, fuse_pad, fuse_pool, fuse_reduce, fuse_rows
from . import sizes as size_fns
from . import matmul as mm
from . import scatter as sc
from .refs import LaunchRecord, TRef, broadcast_strides, new_launch

# r may stand on either side of these: no SWAP flag, fewer kernel variants
COMMUTATIVE = {"add", "mul", "eq", "ne", "logical_and", "logical_or", "bitwise_and", "bitwise_or"}


@dataclass
class FusionResult:
    records: list[LaunchRecord]
    changed: bool

    @property
    def launches(self) -> list[Launch]:
        return [r.launch for r in self.records]


@dataclass
class _Chain:
    """The ops one launch computes: step 0 reads slots 0 and 1, step k > 0 reads slot k + 1."""

    out: TRef
    compute: str
    steps: list[tuple[str, int, bool]]  # (op, arity, swap)
    slots: list  # TRef, Python scalar, or None (the step is unary)
    read_at: list[int]  # the launch position that first read each slot
    names: list[str] = field(default_factory=list)  # the nodes, for the launch's ``op``

    def from_slot(self, k: int) -> tuple[list, list]:
        """(steps, operands) of this chain rerun from slot ``k`` (0 or 1, an operand of its first
        step) as the running value, as an epilogue that starts from a kernel's result: step 0 then
        reads the other slot, swapped when ``k`` is 1 and its op is not commutative."""
        (op0, arity0, _), rest = self.steps[0], self.steps[1:]
        steps = [(op0, arity0, k == 1 and op0 not in COMMUTATIVE)] + list(rest)
        return steps, [self.slots[1 - k]] + list(self.slots[2:])

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
    return new_launch("pointwise_chain", grid, args, constexprs, "+".join(chain.names))


def fuse(records: list[LaunchRecord], touched: list[set[int]], writes: list[set[int]], keep: set[int],
         view=None) -> FusionResult:
    """Pair scatters, merge rms and layer norms into the matmuls that read them, pointwise producers into
    their consumers, then chains into matmul epilogues; last, copies into adjacent slices of one
    buffer into one launch (``fuse_cat.py``; only with ``view``).

    ``records`` are a delegate's launches with what each computes (``LaunchRecord.op``: an
    ``elementwise.PointwiseOp`` for a ``pointwise`` launch, a ``matmul.MatmulOp``, ``conv.ConvOp`` or
    ``grouped_mm.GroupedOp`` for a ``matmul``, ``conv2d`` or ``grouped_mm`` launch, a
    ``dequant_rows.DequantRowsOp`` for a ``dequant_rows`` launch, a ``norm.RowNorm``,
    ``softmax.RowSoftmax``, ``reduce.RowReduce`` or ``group_norm.NormApply`` for a ``norm``, ``softmax``,
    one-pass ``reduce`` or ``norm_apply`` launch, a
    ``scatter.ScatterOp`` for a plain ``scatter`` launch, an ``index.GatherOp`` for a ``gather``;
    None: left alone). ``touched[i]`` and ``writes[i]`` are the buffers launch ``i`` passes and may
    write (``LaunchBuilder.effects``); buffers in ``keep`` (delegate inputs and outputs) are never fused
    away; ``view`` is the builder's ``view``, to address a norm's input as its matmuls' A. Launches keep
    their order; a fused chain, or a matmul with its epilogue, takes its last op's place. A record
    made by fusion carries no op: nothing fuses twice.
    """
    records, touched, writes, paired = pair_scatters(records, touched, writes)
    records, touched, writes, padded = fuse_pad.merge_pads(records, touched, writes, keep)
    launches = [r.launch for r in records]
    ops = {kind: {i: r.op for i, r in enumerate(records) if r.op is not None and r.launch.kernel in kernels}
           for kind, kernels in (("pointwise", {"pointwise"}),
                                 ("matmul", {"matmul", "conv2d", "depthwise_conv", "grouped_mm", "dequant_rows"}),
                                 ("norm", {"norm"}), ("rows", {"norm", "softmax", "reduce", "norm_apply"}),
                                 ("gather", {"gather"}), ("pool", {"pool2d"}))}
    users: dict[int, set[int]] = defaultdict(set)
    for position, buffers in enumerate(touched):
        for buf in buffers:
            users[buf].add(position)
    matmuls = dict(ops["matmul"])
    prologued = _merge_prologues(launches, ops["norm"], matmuls, writes, keep, users, view)
    touched = [set(t) for t in touched]
    chains, merged_away = _merge_chains(launches, ops["pointwise"], touched, writes, keep, users, view)
    merged_away |= prologued
    sources: dict[int, tuple] = {}  # an epilogue's position -> (its matmul's, the chain)
    epilogues = _merge_epilogues(launches, chains, matmuls, writes, keep, users, merged_away, sources, view)
    writes = [set(w) for w in writes]  # updated as row launches move
    norms = fuse_conv1x1.claim_norms(matmuls, ops["rows"], chains, fuse_conv1x1.Fused(epilogues, sources, set(),
                                     merged_away), writes, keep, users, _unwritten)
    claimed = {p for _, producers in norms.values() for p in producers}
    rows = fuse_rows.merge_rows(launches, ops["rows"], chains, touched, writes, keep, users,
                                _unwritten, merged_away, set(epilogues) | claimed, {"reduce": fuse_reduce.reduce_launch})
    gathers = fuse_gather.merge_gathers(launches, ops["gather"], chains, writes, keep, users, merged_away,
                                        set(epilogues) | set(rows))
    pools = fuse_pool.merge_pools(launches, ops["pool"], matmuls, sources, touched, writes, keep, users,
                                  merged_away, _whole_result_epilogue_launch)
    so_far = fuse_conv1x1.Fused(epilogues, sources, set(rows) | set(gathers) | set(pools), merged_away, norms)
    inputs = fuse_conv1x1.merge_conv1x1(launches, matmuls, chains, so_far, touched, writes, keep, users,
                                        _whole_result_chain, _whole_result_epilogue_launch, _unwritten)
    if not merged_away:
        records, cats = fuse_cat.merge_copies(records, view)
        return FusionResult(records, paired or padded or cats)
    fused = [
        LaunchRecord(inputs[i]) if i in inputs
        else LaunchRecord(pools[i]) if i in pools
        else LaunchRecord(rows[i]) if i in rows
        else LaunchRecord(gathers[i]) if i in gathers
        else LaunchRecord(epilogues[i]) if i in epilogues
        else LaunchRecord(_launch(chains[i])) if i in chains and len(chains[i].names) > 1
        else record if launches[i] is record.launch
        else LaunchRecord(launches[i])
        for i, record in enumerate(records)
        if i not in merged_away
    ]
    return FusionResult(fuse_cat.merge_copies(fused, view)[0], True)


def pair_scatters(records: list[LaunchRecord], touched: list[set[int]], writes: list[set[int]]
                  ) -> tuple[list[LaunchRecord], list[set[int]], list[set[int]], bool]:
    """Merge pairs of scatter launches into one PAIR launch (``scatter.pair_launch``: a layer's k and v
    cache writes), at the second's place. A scatter pairs with the first later scatter that fits when
    neither touches what the other writes and no launch between them touches what the first writes or
    writes what it touches (its work moves to the second's place). Returns the records, their
    ``touched`` and ``writes``, and whether any pair was merged."""
    records, touched, writes = list(records), [set(t) for t in touched], [set(w) for w in writes]
    gone: set[int] = set()
    for a, first in enumerate(records):
        if not isinstance(first.op, sc.ScatterOp) or a in gone:
            continue
        for c in range(a + 1, len(records)):
            second = records[c]
            if c not in gone and isinstance(second.op, sc.ScatterOp) and not (
                    writes[a] & touched[c] or writes[c] & touched[a]):
                launch = sc.pair_launch(first.launch, second.launch, first.op, second.op)
                if launch is not None:
                    records[c] = LaunchRecord(launch)
                    touched[c] |= touched[a]
                    writes[c] |= writes[a]
                    gone.add(a)
                    break
            if writes[c] & touched[a] or touched[c] & writes[a]:
                break  # the first's work may not move past this launch
    keep = [i for i in range(len(records)) if i not in gone]
    return [records[i] for i in keep], [touched[i] for i in keep], [writes[i] for i in keep], bool(gone)


def fuse_pointwise_chains(records: list[LaunchRecord], touched: list[set[int]], writes: list[set[int]],
                          keep: set[int]) -> FusionResult:
    """:func:`fuse` without matmul prologues and epilogues."""
    pointwise = [r if r.launch.kernel == "pointwise" else LaunchRecord(r.launch) for r in records]
    result = fuse(pointwise, touched, writes, keep)
    return result if result.changed else FusionResult(records, False)


def _reshaped(chain: _Chain, operand: TRef, view) -> _Chain | None:
    """``chain`` seen through ``operand``, a view of its contiguous result that reads each element once:
    a reshape (``x.float()[:, None]``: the same elements in the same order, another shape) or a
    permutation of one (ConvNeXt's ``x.permute(0, 3, 1, 2)`` before its residual add): its result and
    operands viewed in that shape and order, or None when ``operand`` is no such view or an operand has
    no such view."""
    t = chain.out
    if (view is None or operand.buffer != t.buffer or operand.offset != t.offset or operand.dtype != t.dtype
            or not t.is_contiguous() or operand.numel != t.numel):
        return None
    dims = _product_order(operand, operand.shape, t)  # operand's dims in t's order
    if dims is None:
        return None
    slots = []
    for slot in chain.slots:
        if isinstance(slot, TRef):
            strides = _walked_strides(t.shape, broadcast_strides(slot, t.shape), operand.shape, dims)
            if strides is None:
                return None
            slot = view(slot, operand.shape, strides, slot.offset)
        slots.append(slot)
    return replace(chain, out=operand, slots=slots)


def _walked_strides(shape, strides, target, dims) -> tuple[int, ...] | None:
    """The strides over ``target`` of a tensor over ``shape`` (``strides``) read as a view of ``target``
    whose dims ``dims`` (outermost first; the others of size 1) walk ``shape`` in its own order; None
    when no view of that shape exists."""
    walked = _product_strides(shape, strides, range(len(shape)), [target[d] for d in dims])
    if walked is None:
        return None
    result = [0] * len(target)
    for d, s in zip(dims, walked):
        result[d] = s
    return tuple(result)


def _merge_chains(launches, pointwise, touched, writes, keep, users, view=None
                  ) -> tuple[dict[int, _Chain], set[int]]:
    """(position -> the chain that launch computes, positions merged into a later chain); ``touched``
    and ``users`` are updated as producers move to their consumers. With the builder's ``view``, a
    consumer may read the producer's result through a reshape (:func:`_reshaped`)."""
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
            if t.buffer in keep or users[t.buffer] != {p, c} or not _unwritten(chains[p], c, writes):
                continue
            produced = chains[p] if operand.index == t.index else _reshaped(chains[p], operand, view)
            chain = _merge(produced, consumer, k, c, launches[c].op) if produced is not None else None
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
    return chains, merged_away


# --- matmul prologues -----------------------------------------------------------------------------
def _merge_prologues(launches, norms, matmuls, writes, keep, users, view) -> set[int]:
    """Fold each norm that only matmuls read into them (``launches``/``matmuls`` updated in place);
    returns the norm positions merged away."""
    merged = set()
    for n, norm in sorted(norms.items()):
        t, x = norm.out, norm.x
        readers = users[t.buffer] - {n}
        if (t.buffer in keep or not readers or not norm.matmul_prologue
                or not all(isinstance(matmuls.get(r), (mm.MatmulOp, gmm.GroupedOp)) and r > n for r in readers)
                or not (t.is_contiguous() and tuple(x.shape) == tuple(t.shape) and x.dtype == t.dtype)):
            continue
        ops = {r: _prologue_op(matmuls[r], norm, view) for r in readers}
        reads = [x] + [t for t in (norm.weight, norm.bias) if t is not None]
        if any(op is None for op in ops.values()) or any(
                r.buffer in writes[p] for r in reads for p in range(n + 1, max(ops))):
            continue
        for r, op in ops.items():
            matmuls[r] = op
            grid, args, constexprs = op.launch() if isinstance(op, gmm.GroupedOp) else (
                op.grid(), op.args(), op.constexprs())
            launches[r] = new_launch(launches[r].kernel, grid, args, constexprs, f"{launches[n].op}+{launches[r].op}")
            for ref in reads:
                users[ref.buffer].add(r)
        for buffers in users.values():
            buffers.discard(n)
        users[t.buffer] = set()
        merged.add(n)
    return merged


def _prologue_op(op, norm, view):
    """``op`` reading ``norm``'s input through a norm prologue, or None when its A is not the norm's
    result read whole, row by row over the normalized dim."""
    if isinstance(op, gmm.GroupedOp):
        return _grouped_prologue_op(op, norm, view)
    t, a = norm.out, op.a
    width = t.shape[-1]
    if (a.buffer != t.buffer or op.prologue is not None or op.bmat.buffer == t.buffer
            or (op.has_bias and op.x.buffer == t.buffer) or a.offset != t.offset
            or a.shape[2] != width or not a.is_contiguous() or a.numel != t.numel):
        return None  # (a contiguous [Z, M, K] view of all of contiguous t: row z*M + m of t is A[z, m])
    # x itself may be strided (a norm of a slice of a projection's columns): A reads x's rows in place;
    # a contiguous x is read as A is, t's layout. A permuted x whose rows step by image (ConvNeXt's
    # NCHW result seen as NHWC, at a batch of images) is read as one product per image.
    if norm.x.is_contiguous():
        return replace(op, a=view(norm.x, a.shape, a.strides, norm.x.offset),
                       prologue=(norm.kind, norm.weight, norm.bias, norm.eps))
    dims = range(len(t.shape))
    strides = _product_strides(t.shape, norm.x.strides, dims, a.shape)
    split = None
    if strides is None and len(t.shape) > 2:
        split = mm.batch_split(op, t.shape[0])
        target = None if split is None else (*split, a.shape[2])
        strides = None if split is None else _product_strides(t.shape, norm.x.strides, dims, target)
    if strides is None:
        return None
    if split is not None:
        op = mm.rebatched(op, split, view)
    return replace(op, a=view(norm.x, op.a.shape, strides, norm.x.offset),
                   prologue=(norm.kind, norm.weight, norm.bias, norm.eps))


def _grouped_prologue_op(op: gmm.GroupedOp, norm, view) -> "gmm.GroupedOp | None":
    """A grouped GEMM (a Mixture-of-Experts layer's experts, reading the token rows in place through
    their order) with an RMSNorm prologue: x is the norm's result, whole, [tokens, width]."""
    t, x = norm.out, op.x
    if (norm.kind != "rms" or norm.bias is not None or op.prologue is not None or not norm.x.is_contiguous()
            or x.buffer != t.buffer
            or x.offset != t.offset or x.shape[1] != t.shape[-1] or not x.is_contiguous() or x.numel != t.numel
            or any(r.buffer == t.buffer for r in op.reads if r is not x)):
        return None
    return replace(op, x=view(norm.x, x.shape, x.strides, norm.x.offset), prologue=("rms", norm.weight, None, norm.eps))


# --- matmul epilogues -----------------------------------------------------------------------------
def _merge_epilogues(launches, chains, matmuls, writes, keep, users, merged_away, sources, view=None
                     ) -> dict[int, Launch]:
    """Consumer position -> the matmul launch that now computes its chain; each matmul merged is added
    to ``merged_away``, and ``sources`` maps the consumer to (the matmul's position, the chain)."""
    epilogues: dict[int, Launch] = {}
    for m, op in sorted(matmuls.items()):
        t = op.c
        readers = users[t.buffer] - {m}
        if t.buffer in keep or len(readers) != 1:
            continue
        (c,) = readers
        if c < m or c not in chains or c in merged_away or c in epilogues:
            continue
        if any(r.buffer in writes[p] for r in op.reads for p in range(m + 1, c)):
            continue  # an in-place update between M and C: M's reads may not move to C
        launch = _epilogue_launch(op, chains[c], launches[m], view)
        if launch is not None:
            epilogues[c] = launch
            sources[c] = (m, chains[c])
            merged_away.add(m)
    return epilogues


def _whole_result_chain(op, chain: _Chain) -> tuple[TRef, list, list] | None:
    """(the chain's result as written over the result's dims, steps, operands) of ``chain`` as the
    epilogue of ``op`` (a ``conv.ConvOp``, ``grouped_mm.GroupedOp``, ``dequant_rows.DequantRowsOp`` or
    ``fuse_conv1x1.Conv1x1Op``; each operand a (TRef, its strides over the result's dims) pair, a scalar
    or None), or None unless the chain starts from the whole result, read as itself over the result's
    own shape, or (a convolution's contiguous result) through a permutation or reshape that reads each
    element once: Segformer's and PVT's ``dwconv(x).flatten(2).transpose(1, 2)`` before their GELU."""
    t = op.c
    at = [k for k, s in enumerate(chain.slots) if isinstance(s, TRef) and s.buffer == t.buffer]
    if (chain.compute != "f32" or len(chain.steps) > ew.MAX_CHAIN or len(at) != 1 or at[0] > 1
            or any(r.buffer == chain.out.buffer for r in op.reads)):
        return None
    k = at[0]
    view, shape = chain.slots[k], chain.out.shape
    steps, others = chain.from_slot(k)
    if (view.shape, view.strides, view.offset) == (t.shape, t.strides, t.offset) and tuple(shape) == tuple(t.shape):
        return chain.out, steps, [(s, broadcast_strides(s, shape)) if isinstance(s, TRef) else s for s in others]
    if type(op) not in (cv.ConvOp, dw.DepthwiseOp) or t.offset != 0 or not t.is_contiguous():
        return None
    dims = _product_order(view, shape, t)  # the chain's dims in t's order
    if dims is None:
        return None
    over_t = lambda ref: _product_strides(shape, broadcast_strides(ref, shape), dims, t.shape)  # noqa: E731
    operands = [(s, over_t(s)) if isinstance(s, TRef) else s for s in others]
    out = over_t(chain.out)
    if out is None or any(isinstance(o, tuple) and o[1] is None for o in operands):
        return None
    return replace(chain.out, shape=tuple(t.shape), strides=tuple(out)), steps, operands


def _whole_result_epilogue_launch(op, chain: _Chain, launch: Launch) -> Launch | None:
    """``launch`` (computing ``op``, as :func:`_whole_result_chain` takes) relaunched with ``chain`` as its
    epilogue, or None."""
    walk = _whole_result_chain(op, chain)
    launched = None if walk is None else op.launch(*walk)
    if launched is None:
        return None
    grid, args, constexprs = launched
    return new_launch(launch.kernel, grid, args, constexprs, "+".join([launch.op] + chain.names))


def _epilogue_launch(op, chain: _Chain, matmul: Launch, view=None) -> Launch | None:
    """``matmul`` (computing ``op``) relaunched with ``chain`` as its epilogue, or None when the chain
    does not start from the product or cannot be addressed in the product's [Z, M, N] walk. With the
    builder's ``view``, a product of one batch may become one product per step of the chain's
    outermost dim (``matmul.batch_split``): ConvNeXt's ``x + (gamma * y).permute(0, 3, 1, 2)`` at a
    batch of images, x NCHW and y's rows NHWC."""
    if isinstance(op, (cv.ConvOp, gmm.GroupedOp, dq.DequantRowsOp)):
        return _whole_result_epilogue_launch(op, chain, matmul)
    t = op.c
    at = [k for k, s in enumerate(chain.slots) if isinstance(s, TRef) and s.buffer == t.buffer]
    if (
        chain.compute != "f32" or len(chain.steps) > mm.EPILOGUE_STEPS
        or len(at) != 1 or at[0] > 1
        or t.offset != 0 or not t.is_contiguous()
        or any(r.buffer == chain.out.buffer for r in op.reads)
    ):
        return None
    k = at[0]
    shape = chain.out.shape
    dims = _product_order(chain.slots[k], shape, t)
    if dims is None:
        return None
    steps, others = chain.from_slot(k)
    walk = _epilogue_walk(shape, dims, t.shape, others, chain.out)
    split = None
    if walk is None and view is not None and len(dims) > 2:  # one product per step of the outermost dim
        split = mm.batch_split(op, shape[dims[0]])
        walk = None if split is None else _epilogue_walk(shape, dims, (*split, t.shape[2]), others, chain.out)
    if walk is None:
        return None
    operands, out_strides = walk
    if split is not None:
        op = mm.rebatched(op, split, view)
    grid, args, constexprs = mm.epilogue_launch(op, chain.out, out_strides, steps, operands)
    return new_launch(matmul.kernel, grid, args, constexprs, "+".join([matmul.op] + chain.names))


def _epilogue_walk(shape, dims, target, others, out: TRef) -> tuple[list, tuple] | None:
    """(operands, the result's strides) of an epilogue over the product's ``target`` [Z, M, N]: each tensor
    operand of ``others`` paired with its strides there (read over the chain's ``shape``, walked in
    ``dims`` order), or None when one cannot be addressed there."""
    operands = []
    for slot in others:
        if isinstance(slot, TRef):
            strides = _product_strides(shape, broadcast_strides(slot, shape), dims, target)
            if strides is None:
                return None
            slot = (slot, strides)
        operands.append(slot)
    out_strides = _product_strides(shape, out.strides, dims, target)
    return None if out_strides is None else (operands, out_strides)


def _product_order(view: TRef, shape, t: TRef) -> list[int] | None:
    """The dims of ``shape`` (size > 1), outermost first, in the order in which ``view`` (read over
    ``shape``) walks the contiguous product ``t``; None unless ``view`` reads every element of ``t``
    exactly once."""
    if view.dtype != t.dtype or view.offset != t.offset:
        return None
    strides = broadcast_strides(view, shape)
    # Ordered by the strides at the symbols' bounds; the check below holds symbolically or fails.
    dims = sorted((d for d, n in enumerate(shape) if n != 1), key=lambda d: -size_fns.upper(strides[d]))
    expected = 1
    for d in reversed(dims):
        if strides[d] != expected:
            return None
        expected *= shape[d]
    return dims if expected == t.numel else None


def _product_strides(shape, strides, dims, target) -> tuple[int, ...] | None:
    """``strides`` (a tensor read or written over ``shape``) as strides over the product's ``target``
    [Z, M, N], its dims walked in ``dims`` order; None when no view of that shape exists (the reshape
    PyTorch's ``view`` refuses)."""
    try:
        with size_fns.tensor_like([shape[d] for d in dims], [strides[d] for d in dims], 0, torch.float32) as t:
            return size_fns.shape(t.view(size_fns.fake_sizes(target)).stride())
    except (RuntimeError, ValueError):
        return None
