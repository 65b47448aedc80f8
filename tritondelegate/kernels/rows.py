"""The [rows, cols] view shared by the row-wise kernels (softmax.py, norm.py, reduce.py).

A row-wise op reduces (or normalizes over) a set of dims of its input. Its kernel sees a
[rows, cols] problem: each row is one position of the kept dims, each column one position of the
reduced dims. Rows are walked in row-major order of the kept dims through up to three strided
dims, so a reduction over a middle dim (softmax over dim 1 of [B, C, L]) or over a transposed
input needs no copy; the columns must collapse to one strided dim. When they do not (a
reduction over dims 0 and 2, say), the input is copied once into a contiguous tensor whose dims
are permuted so that the reduced dims come last.

Every program owns a [BLOCK_R, BLOCK_C] tile: many short rows per program when rows are short,
one long row looped over in BLOCK_C chunks when rows are long.

A row kernel (norm.py, softmax.py, reduce.py) may run fused pointwise chains (``fuse_rows.py``,
``fuse_reduce.py``): a prologue computes x from the chain's operands as it loads (:func:`row_load`,
every time the row is read), an epilogue runs on y before the store (:func:`row_store`; a reduction's
y is a [BLOCK_R, 1] tile, one value per row). Both are ``elementwise._epilogue`` on the tile,
each operand addressed by its own [row dims, cols] strides in the rows walk (:func:`chain_args`).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ..dtypes import dtype_name
from ..errors import LoweringError
from .elementwise import _epilogue, round_as
from .refs import TRef, collapse
from .sizes import next_power_of_2, upper

MAX_ROW_DIMS = 3
TILE = 4096  # elements per program tile


# --- device helper --------------------------------------------------------------------------------
@triton.jit
def row_offsets(r, n1, n2, s0, s1, s2):
    """Element offset of row ``r`` (int64) of a [n0, n1, n2] grid of rows with strides s0, s1, s2."""
    i2 = r % n2
    rest = r // n2
    return (rest // n1) * s0 + (rest % n1) * s1 + i2 * s2


@triton.jit
def row_welford(x_row, rmask, c_begin, c_end, sc, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Mean and M2 (sum of squared deviations) of columns [c_begin, c_end) of each row, one pass.

    Each BLOCK_C chunk's own mean and M2 are merged into the running ones (:func:`welford_chunk`)."""
    mean = tl.zeros([BLOCK_R], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_R], dtype=tl.float32)
    n = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(c_begin, c_end, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (c < c_end)[None, :]
        x = tl.load(x_row + c.to(tl.int64)[None, :] * sc, mask=mask, other=0.0).to(tl.float32)
        mean, m2, n = welford_chunk(mean, m2, n, x, mask, tl.minimum(c_end - start, BLOCK_C).to(tl.float32))
    return mean, m2


@triton.jit
def welford_chunk(mean, m2, n, x, mask, nb):
    """The running (mean, M2, n) of each row merged with chunk ``x`` (0 where masked off) of ``nb``
    columns (Chan et al.):
        n = na + nb;  d = mean_b - mean_a;  mean = mean_a + d nb / n;  M2 = M2_a + M2_b + d^2 na nb / n
    which stays accurate where the sum-of-squares formula cancels (a large mean, a small spread)."""
    mean_b = tl.sum(x, axis=1) / nb
    d = tl.where(mask, x - mean_b[:, None], 0.0)
    m2_b = tl.sum(d * d, axis=1)
    total = n + nb
    delta = mean_b - mean
    return mean + delta * (nb / total), m2 + m2_b + delta * delta * (n * (nb / total)), total


@triton.jit
def row_index(r, n1, n2):
    """The coordinates (i0, i1, i2) of rows ``r`` in a [n0, n1, n2] grid of rows, each [BLOCK_R, 1]."""
    i2 = r % n2
    rest = r // n2
    return (rest // n1)[:, None], (rest % n1)[:, None], i2[:, None]


@triton.jit
def _chain(r, mask, ix, c, ops, OPS: tl.constexpr):
    """``elementwise._epilogue`` on the tile ``r``: ``ops`` are the steps' 4 pointers, 4 scalars and
    4 x 4 [i0, i1, i2, column] strides, ``OPS`` (steps, rounding, then op, arity, swap, is-scalar per step)."""
    return _epilogue(r, mask, ix[0], ix[1], ix[2], c, 0, ops[0], ops[1], ops[2], ops[3], ops[4], ops[5], ops[6],
                     ops[7], ops[8], ops[9], ops[10], ops[11], 0, ops[12], ops[13], ops[14], ops[15], 0, ops[16],
                     ops[17], ops[18], ops[19], 0, ops[20], ops[21], ops[22], ops[23], 0, OPS[0], OPS[1], OPS[2],
                     OPS[3], OPS[4], OPS[5], OPS[6], OPS[7], OPS[8], OPS[9], OPS[10], OPS[11], OPS[12],
                     OPS[13], OPS[14], OPS[15], OPS[16], OPS[17])


@triton.jit
def row_load(x_ptr, ix, c, mask, xs, OTHER: tl.constexpr, pro, PRO: tl.constexpr, PRO_ROUND: tl.constexpr):
    """The tile of x at rows ``ix`` and columns ``c`` ([1, BLOCK_C], int64) in fp32, OTHER where masked
    off: loaded through strides ``xs``, or with a prologue (PRO[0] steps) computed from it and the
    prologue's operands, then rounded to PRO_ROUND as eager stores x."""
    x = tl.load(x_ptr + ix[0] * xs[0] + ix[1] * xs[1] + ix[2] * xs[2] + c * xs[3], mask=mask,
                other=OTHER).to(tl.float32)
    if PRO[0] > 0:
        x = round_as(_chain(x, mask, ix, c, pro, PRO), PRO_ROUND)
        x = tl.where(mask, x, OTHER)
    return x


@triton.jit
def row_store(out_ptr, ix, c, mask, os, y, epi, EPI: tl.constexpr):
    """Store the fp32 tile ``y`` through strides ``os`` in out's dtype, after an epilogue (EPI[0] steps,
    starting from y rounded to EPI[1]) when there is one."""
    if EPI[0] > 0:
        y = _chain(y, mask, ix, c, epi, EPI)
    tl.store(out_ptr + ix[0] * os[0] + ix[1] * os[1] + ix[2] * os[2] + c * os[3],
             y.to(out_ptr.dtype.element_ty), mask=mask)


# --- host side ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rows:
    """Sizes and strides are ints, or sympy expressions over the method's symbols (``sizes.py``)."""

    rows: int
    cols: int
    n1: int
    n2: int
    strides: tuple[tuple[int, int, int, int], ...]  # per operand: row strides s0, s1, s2; col stride

    def args(self, operand: int) -> tuple[int, int, int, int]:
        return self.strides[operand]


def normalize_dims(dims, ndim: int) -> list[int]:
    """Sorted, non-negative, de-duplicated reduction dims; ``None`` or ``[]`` means all dims."""
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return list(range(ndim))
    if ndim == 0:
        return []  # a 0-d tensor accepts dim 0 / -1 and reduces nothing
    return sorted({d % ndim for d in dims})


def _plan(shape, reduce_dims, stride_sets) -> Rows | None:
    keep = [d for d in range(len(shape)) if d not in reduce_dims]
    red = [d for d in range(len(shape)) if d in reduce_dims]
    ksizes, kstrides = collapse([shape[d] for d in keep], [[s[d] for d in keep] for s in stride_sets])
    rsizes, rstrides = collapse([shape[d] for d in red], [[s[d] for d in red] for s in stride_sets])
    if len(ksizes) > MAX_ROW_DIMS or len(rsizes) > 1:
        return None
    pad = MAX_ROW_DIMS - len(ksizes)
    ksizes = [1] * pad + ksizes
    rows = ksizes[0] * ksizes[1] * ksizes[2]
    cols = rsizes[0] if rsizes else 1
    strides = tuple(
        tuple([0] * pad + ks) + ((rs[0] if rs else 0),) for ks, rs in zip(kstrides, rstrides)
    )
    return Rows(rows, cols, ksizes[1], ksizes[2], strides)


def lay_out(b, x: TRef, reduce_dims, others=()) -> tuple[TRef, Rows]:
    """The [rows, cols] view of ``x`` reduced over ``reduce_dims`` (normalized dims).

    ``others`` are the strides, over ``x``'s dims, of the other tensors the kernel walks the same
    way (0 on dims they lack). Returns ``x`` (or its permuted contiguous copy) and the row plan,
    whose operand 0 is ``x`` and operands 1.. are ``others``.
    """
    stride_sets = [x.strides] + [tuple(s) for s in others]
    plan = _plan(x.shape, set(reduce_dims), stride_sets)
    if plan is not None:
        return x, plan
    keep = [d for d in range(x.ndim) if d not in reduce_dims]
    perm = keep + [d for d in range(x.ndim) if d in reduce_dims]
    shape = [x.shape[d] for d in perm]
    x = b.contiguous(b.view(x, shape, [x.strides[d] for d in perm]))
    stride_sets = [x.strides] + [[s[d] for d in perm] for s in stride_sets[1:]]
    plan = _plan(shape, set(range(len(keep), len(perm))), stride_sets)
    if plan is None:
        raise LoweringError(f"cannot lay out a reduction over dims {sorted(reduce_dims)} of {x.shape}")
    return x, plan


def blocks(plan: Rows, cap: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): the whole row when it fits ``cap``, else ``cap``-wide chunks; then as many
    rows as fill the tile. Rows that are contiguous with each other while the columns are not (a
    reduction over a leading dim) get a narrow, tall tile so that loads stay coalesced.

    Dynamic sizes are taken at their upper bound (the kernels mask tails), so the blocks serve every
    size of the range; callers choose one pass or a loop with ``upper(plan.cols) <= BLOCK_C``."""
    xs = plan.strides[0]
    block_c = min(next_power_of_2(plan.cols), cap)
    if xs[3] != 1 and xs[2] == 1 and upper(plan.n2) > 1:
        block_c = min(block_c, 32)
    block_r = min(next_power_of_2(plan.rows), max(1, TILE // block_c))
    return block_r, block_c


def num_warps(block_r: int, block_c: int) -> int:
    """8 tile elements a thread from 2048 up: a full 4096 tile then needs about 100 registers a
    thread on sm_90 (200 at 8 warps, which halves the warps an SM can hold)."""
    tile = block_r * block_c
    return 4 if tile <= 1024 else 8 if tile <= 2048 else 16


def node_arg(node, i: int, name: str, default=None):
    """Argument ``i`` of ``node``, passed positionally or as keyword ``name``."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)




# --- fused chains: host side ----------------------------------------------------------------------
CHAIN_STEPS = 4  # the steps of a fused prologue or epilogue (elementwise.MAX_CHAIN)
# kernel parameter names per chain: (pointer prefix, steps constexpr, rounding constexpr, constexpr prefix)
CHAIN_NAMES = {"prologue": ("p", "PROLOGUE", "P_ROUND", "P"), "epilogue": ("e", "EPILOGUE", "ROUND_TO", "E")}


def chain_args(operands, stand_in: TRef) -> list:
    """A row kernel's arguments for a chain whose steps read ``operands``: a pair (TRef, its strides
    (s0, s1, s2, column) in the rows walk), a Python scalar, or None (a unary step, or no step):
    4 pointers (``stand_in`` where no tensor is read), 4 scalars, 4 x 4 strides."""
    ptrs, scalars, strides = [], [], []
    for o in list(operands) + [None] * (CHAIN_STEPS - len(operands)):
        if isinstance(o, tuple):
            ptrs.append(o[0])
            scalars.append(0.0)
            strides.extend(o[1])
        else:
            ptrs.append(stand_in)
            scalars.append(0.0 if o is None else float(o))
            strides.extend((0, 0, 0, 0))
    return ptrs + scalars + strides


def chain_constexprs(kind: str, steps, operands, round_to) -> dict:
    """The constexprs of a ``kind`` ("prologue" or "epilogue") chain of ``steps`` ((op, arity, swap))
    reading ``operands`` (as in :func:`chain_args`); ``round_to`` is the dtype eager stores the
    chain's input (epilogue) or result (prologue) in."""
    _, count, rounding, p = CHAIN_NAMES[kind]
    if not 1 <= len(steps) <= CHAIN_STEPS or len(operands) != len(steps):
        raise LoweringError(f"a row kernel's {kind} has 1 to {CHAIN_STEPS} steps, one operand each")
    constexprs = {count: len(steps), rounding: dtype_name(round_to)}
    for k, ((op, arity, swap), o) in enumerate(zip(steps, operands)):
        constexprs.update({f"{p}OP{k}": op, f"{p}ARITY{k}": arity, f"{p}SWAP{k}": swap,
                           f"{p}IS_SCALAR{k}": o is not None and not isinstance(o, tuple)})
    return constexprs
