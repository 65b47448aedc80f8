"""Reductions over any set of dims: sum, mean, prod, amax/amin, max/min (all dims, or one dim with
indices), argmax/argmin, var/var_mean, and the vector norms.

One kernel serves them all on the [rows, cols] view of ``rows.py``; the formula is picked at compile
time by three constexprs, each value stage applied to every column c of a row:

    v_c = MAP(x_c)                     id | sq: x^2 | abs: |x|
    a   = COMBINE over c of v_c        sum | prod | max | min | argmax | argmin | welford
    out = FINISH(a)                    none | div: a / divisor | sqrt: sqrt(a)

``welford`` writes M2 / divisor (the variance; divisor = N - correction) to ``out`` and the mean to
``out2``; ``argmax``/``argmin`` write the extreme value to ``out`` and its first column index to
``out2``. NaN wins every max/min/arg comparison, as in PyTorch. Accumulation is fp32 (int64 for
integer sum/prod) in a [BLOCK_R, BLOCK_C] tile, reduced across the tile once at the end.

Few, long rows (a full reduction) split their columns over ``SPLIT`` programs that write fp32
partials, which a second launch of the same kernel reduces (sum, prod, max and min only).

A one-pass sum, prod, max or min of floats (its record carries a :class:`RowReduce`) may take fused
pointwise chains (``fuse_reduce.py``): a prologue computes x from the chain's operands as it loads
(``rows.row_load``), an epilogue runs on each row's result before the store, which then goes through
the result's row strides ``os0..os2`` (``rows.row_store`` on a [BLOCK_R, 1] tile); off by default.

With dynamic sizes (``sizes.py``) the blocks and the choice to split are made at the symbols' upper
bounds (the kernel masks every tail), and the split count, grids and sizes stay symbolic. A divisor
that depends on the symbols (a mean or a variance over a dynamic dim) is passed as an integer that
the kernel converts to fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch
import triton
import triton.language as tl

from . import elementwise as ew
from . import rows as rw
from . import sizes
from .refs import FLOAT_DTYPES, TRef, node_value
from .rows import row_index, row_load, row_offsets, row_store, row_welford
from .sizes import upper

MAX_BLOCK_C = 1024
MIN_PROGRAMS = 64  # fewer row programs than this: split long rows over programs
SPLIT_MIN_COLS = 16384
SPLIT_BLOCKS = 4  # BLOCK_C chunks per split program
MAX_SPLIT = 1024
INT_BIG = 2147483647
INT64_MAX = tl.constexpr(9223372036854775807)  # a jit function reads only constexpr globals


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _fold(x_row, rmask, c_begin, c_end, sc, MAP: tl.constexpr, COMBINE: tl.constexpr,
          INT_ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
          x_ptr, ix, xs, pro, PRO: tl.constexpr, P_ROUND: tl.constexpr):
    """COMBINE over columns [c_begin, c_end) of MAP(x) per row; with a prologue (PRO[0] steps, floats
    only) x is computed from the chain's operands at rows ``ix`` through strides ``xs`` (rows.row_load)."""
    if INT_ACC:
        acc_ty = tl.int64
    else:
        acc_ty = tl.float32
    # float identities for float accumulators: an int 1 becomes raw bits when the interpreter
    # casts it to a bf16 load's `other`
    if COMBINE == "sum":
        if INT_ACC:
            init = 0
        else:
            init = 0.0
    elif COMBINE == "prod":
        if INT_ACC:
            init = 1
        else:
            init = 1.0
    elif COMBINE == "max":
        if INT_ACC:
            init = -9223372036854775808
        else:
            init = float("-inf")
    else:
        if INT_ACC:
            init = 9223372036854775807
        else:
            init = float("inf")
    acc = tl.full([BLOCK_R, BLOCK_C], init, dtype=acc_ty)
    for start in range(c_begin, c_end, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (c < c_end)[None, :]
        if PRO[0] > 0:
            v = tl.where(mask, row_load(x_ptr, ix, c.to(tl.int64)[None, :], mask, xs, 0.0, pro, PRO, P_ROUND), init)
        else:
            v = tl.load(x_row + c.to(tl.int64)[None, :] * sc, mask=mask, other=init).to(acc_ty)
        if MAP == "sq":
            v = tl.where(mask, v * v, init)
        elif MAP == "abs":
            v = tl.where(mask, tl.abs(v), init)
        if COMBINE == "sum":
            acc += v
        elif COMBINE == "prod":
            acc *= v
        elif INT_ACC:  # integers: no NaN to carry
            if COMBINE == "max":
                acc = tl.maximum(acc, v)
            else:
                acc = tl.minimum(acc, v)
        elif COMBINE == "max":
            acc = tl.maximum(acc, v, propagate_nan=tl.PropagateNan.ALL)
        else:
            acc = tl.minimum(acc, v, propagate_nan=tl.PropagateNan.ALL)
    if COMBINE == "sum":
        res = tl.sum(acc, axis=1)
    elif COMBINE == "prod":
        res = tl.reduce(acc, 1, _mul)
    elif INT_ACC:
        if COMBINE == "max":
            res = tl.max(acc, axis=1)
        else:
            res = tl.min(acc, axis=1)
    else:
        isnan = acc != acc
        clean = tl.where(isnan, init, acc)
        if COMBINE == "max":
            res = tl.max(clean, axis=1)
        else:
            res = tl.min(clean, axis=1)
        res = tl.where(tl.max(isnan.to(tl.int32), axis=1) > 0, float("nan"), res)
    return res


@triton.jit
def _arg_extreme(x_row, rmask, c_begin, c_end, sc, IS_MIN: tl.constexpr, INT_ACC: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(value, first index) of each row's max (min); floats compared in fp32, NaN winning; integers
    (``INT_ACC``) in int64, exactly."""
    if INT_ACC:
        acc_ty = tl.int64
        if IS_MIN:
            worst = INT64_MAX
        else:
            worst = -INT64_MAX - 1
    else:
        acc_ty = tl.float32
        if IS_MIN:
            worst = float("inf")
        else:
            worst = float("-inf")
    acc = tl.full([BLOCK_R, BLOCK_C], worst, dtype=acc_ty)
    idx = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    for start in range(c_begin, c_end, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (c < c_end)[None, :]
        if INT_ACC:  # a masked lane never wins (below): any value will do, one of x's dtype
            v = tl.load(x_row + c.to(tl.int64)[None, :] * sc, mask=mask, other=0).to(acc_ty)
        else:
            v = tl.load(x_row + c.to(tl.int64)[None, :] * sc, mask=mask, other=worst).to(acc_ty)
        if IS_MIN:
            better = v < acc
        else:
            better = v > acc
        # strict comparisons keep each lane's first occurrence; the first NaN beats everything; a masked
        # lane (worst) never wins, and an all-worst row keeps index 0 below
        if not INT_ACC:
            better = better | ((v != v) & (acc == acc))
        better = better & mask
        acc = tl.where(better, v, acc)
        idx = tl.where(better, c[None, :], idx)
    if INT_ACC:
        if IS_MIN:
            value = tl.min(acc, axis=1)
        else:
            value = tl.max(acc, axis=1)
        index = tl.min(tl.where(acc == value[:, None], idx, 2147483647), axis=1)
    else:
        isnan = acc != acc
        any_nan = tl.max(isnan.to(tl.int32), axis=1) > 0
        clean = tl.where(isnan, worst, acc)
        if IS_MIN:
            best = tl.min(clean, axis=1)
        else:
            best = tl.max(clean, axis=1)
        pick = tl.where(any_nan[:, None], isnan, clean == best[:, None])
        index = tl.min(tl.where(pick, idx, 2147483647), axis=1)
        value = tl.where(any_nan, float("nan"), best)
    return value, index


@triton.jit
def reduce_kernel(
    x_ptr, out_ptr, out2_ptr,
    rows, cols, split_cols, n1, n2, s0, s1, s2, sc, divisor,
    os0, os1, os2,  # the result's row strides: read only with an epilogue (else rows are contiguous)
    # a fused prologue's and epilogue's operands (rows.chain_args; stand-ins without one)
    p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_scalar, p1_scalar, p2_scalar, p3_scalar,
    p0s0, p0s1, p0s2, p0s3, p1s0, p1s1, p1s2, p1s3, p2s0, p2s1, p2s2, p2s3, p3s0, p3s1, p3s2, p3s3,
    e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e0s3, e1s0, e1s1, e1s2, e1s3, e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3,
    MAP: tl.constexpr, COMBINE: tl.constexpr, FINISH: tl.constexpr, INT_ACC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    PROLOGUE: tl.constexpr = 0, P_ROUND: tl.constexpr = "",
    POP0: tl.constexpr = "copy", PARITY0: tl.constexpr = 1,
    PSWAP0: tl.constexpr = False, PIS_SCALAR0: tl.constexpr = False,
    POP1: tl.constexpr = "copy", PARITY1: tl.constexpr = 1,
    PSWAP1: tl.constexpr = False, PIS_SCALAR1: tl.constexpr = False,
    POP2: tl.constexpr = "copy", PARITY2: tl.constexpr = 1,
    PSWAP2: tl.constexpr = False, PIS_SCALAR2: tl.constexpr = False,
    POP3: tl.constexpr = "copy", PARITY3: tl.constexpr = 1,
    PSWAP3: tl.constexpr = False, PIS_SCALAR3: tl.constexpr = False,
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1,
    ESWAP0: tl.constexpr = False, EIS_SCALAR0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1,
    ESWAP1: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1,
    ESWAP2: tl.constexpr = False, EIS_SCALAR2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1,
    ESWAP3: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    x_row = x_ptr + row_offsets(r, n1, n2, s0, s1, s2)[:, None]
    split = tl.program_id(1)
    c_begin = split * split_cols
    c_end = tl.minimum(c_begin + split_cols, cols)
    out_off = r * tl.num_programs(1) + split
    if COMBINE == "welford":
        mean, m2 = row_welford(x_row, rmask, c_begin, c_end, sc, BLOCK_R, BLOCK_C)
        # the mean of no values is 0 / 0; with an inf or NaN in the row (M2 NaN) eager's running update
        # makes the mean NaN too (it keeps inf only when the row's one inf is its last value)
        mean = tl.where((c_end > c_begin) & (m2 == m2), mean, float("nan"))
        tl.store(out_ptr + out_off, (m2 / divisor).to(out_ptr.dtype.element_ty), mask=rmask)
        tl.store(out2_ptr + out_off, mean.to(out2_ptr.dtype.element_ty), mask=rmask)
    elif COMBINE == "argmax" or COMBINE == "argmin":
        value, index = _arg_extreme(x_row, rmask, c_begin, c_end, sc, COMBINE == "argmin", INT_ACC, BLOCK_R, BLOCK_C)
        tl.store(out_ptr + out_off, value.to(out_ptr.dtype.element_ty), mask=rmask)
        tl.store(out2_ptr + out_off, index.to(out2_ptr.dtype.element_ty), mask=rmask)
    else:
        ix = row_index(r, n1, n2)
        pro = (p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_scalar, p1_scalar, p2_scalar, p3_scalar, p0s0, p0s1, p0s2, p0s3,
               p1s0, p1s1, p1s2, p1s3, p2s0, p2s1, p2s2, p2s3, p3s0, p3s1, p3s2, p3s3)
        PRO: tl.constexpr = (PROLOGUE, "", POP0, PARITY0, PSWAP0, PIS_SCALAR0, POP1, PARITY1, PSWAP1, PIS_SCALAR1,
                             POP2, PARITY2, PSWAP2, PIS_SCALAR2, POP3, PARITY3, PSWAP3, PIS_SCALAR3)
        res = _fold(x_row, rmask, c_begin, c_end, sc, MAP, COMBINE, INT_ACC, BLOCK_R, BLOCK_C,
                    x_ptr, ix, (s0, s1, s2, sc), pro, PRO, P_ROUND)
        if FINISH == "div":
            res = res / divisor
        elif FINISH == "sqrt":
            res = tl.sqrt(res)
        if EPILOGUE > 0:  # each row's value is a [1]-column tile of the rows walk: out[r] at its row strides
            epi = (e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar, e0s0, e0s1, e0s2,
                   e0s3, e1s0, e1s1, e1s2, e1s3, e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3)
            EPI: tl.constexpr = (EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1,
                                 EIS_SCALAR1, EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
            row_store(out_ptr, ix, tl.zeros([1, 1], dtype=tl.int64), rmask[:, None], (os0, os1, os2, 0),
                      res[:, None], epi, EPI)
        else:
            tl.store(out_ptr + out_off, res.to(out_ptr.dtype.element_ty), mask=rmask)


# --- host launcher --------------------------------------------------------------------------------
SPLITTABLE = ("sum", "prod", "max", "min")


def _divisor_arg(divisor):
    """The kernel's ``divisor``: a float, or an integer size expression when it depends on the symbols
    (the kernel divides in fp32 either way)."""
    return float(divisor) if sizes.is_static(divisor) else sizes.size(divisor)


def _args(x, out, out2, plan: rw.Rows, split_cols, divisor, out_strides=(0, 0, 0), pro=None, epi=None) -> list:
    """The kernel's runtime arguments; ``pro`` and ``epi``: a fused chain's (``rows.chain_args``)."""
    return [x, out, out2, plan.rows, plan.cols, split_cols, plan.n1, plan.n2, *plan.args(0), _divisor_arg(divisor),
            *out_strides, *(pro or rw.chain_args((), x)), *(epi or rw.chain_args((), out))]


def _launch(b, grid, x, out, out2, plan: rw.Rows, split_cols, divisor, blocks, **formula):
    block_r, block_c = blocks
    return b.launch("reduce", grid, *_args(x, out, out2, plan, split_cols, divisor), BLOCK_R=block_r,
                    BLOCK_C=block_c, num_warps=rw.num_warps(block_r, block_c), **formula)


def launch_reduce(b, x: TRef, dims, out: TRef, out2: TRef | None = None, *, map_="id", combine="sum",
                  finish="none", divisor=1.0) -> None:
    """Reduce ``x`` over ``dims`` (normalized) into the contiguous ``out`` (and ``out2``), rows in
    row-major order of the kept dims, so ``keepdim`` does not matter here. ``divisor``: a float, or
    an integer size (possibly symbolic). A one-pass sum, prod, max or min of floats into a float
    ``out`` records a :class:`RowReduce`, for ``fuse_reduce.py``."""
    int_acc = not x.dtype.is_floating_point and combine in ("sum", "prod", "max", "min", "argmax", "argmin")
    laid_out, plan = rw.lay_out(b, x, dims)
    if laid_out is not x:  # a contiguous copy, its dims permuted: the kept dims first
        dims = list(range(x.ndim - len(dims), x.ndim))
    x = laid_out
    blocks = _spread(plan, rw.blocks(plan, MAX_BLOCK_C))
    programs = triton.cdiv(plan.rows, blocks[0])
    # one pass or a split: a speed decision, taken for the largest sizes of a dynamic range
    max_cols = upper(plan.cols)
    if combine not in SPLITTABLE or upper(programs) >= MIN_PROGRAMS or max_cols < SPLIT_MIN_COLS:
        record = _launch(b, (programs, 1), x, out, out if out2 is None else out2, plan, sizes.larger(1, plan.cols),
                         divisor, blocks, MAP=map_, COMBINE=combine, FINISH=finish, INT_ACC=int_acc)
        if (record is not None and combine in SPLITTABLE and not int_acc and out2 is None and x.ndim
                and out.dtype in FLOAT_DTYPES):
            record.op = RowReduce(x, out, tuple(dims), map_, combine, finish, divisor)
        return
    # few long rows: SPLIT programs a row write partials, then one more launch reduces those
    split_cols = SPLIT_BLOCKS * blocks[1]
    if triton.cdiv(max_cols, split_cols) > MAX_SPLIT:
        split_cols = triton.cdiv(triton.cdiv(max_cols, MAX_SPLIT), blocks[1]) * blocks[1]
    split = triton.cdiv(plan.cols, split_cols)
    partial = b.alloc((plan.rows, split), torch.int64 if int_acc else torch.float32)
    _launch(b, (programs, split), x, partial, partial, plan, split_cols, 1.0, blocks,
            MAP=map_, COMBINE=combine, FINISH="none", INT_ACC=int_acc)
    plan = rw.Rows(plan.rows, split, 1, plan.rows, ((0, 0, split, 1),))
    blocks = rw.blocks(plan, MAX_BLOCK_C)
    _launch(b, (triton.cdiv(plan.rows, blocks[0]), 1), partial, out, out, plan, split, divisor, blocks,
            MAP="id", COMBINE=combine, FINISH=finish, INT_ACC=int_acc)


def _spread(plan: rw.Rows, blocks: tuple[int, int]) -> tuple[int, int]:
    """Fewer rows a program where the rows would fill fewer than MIN_PROGRAMS programs, so that few
    long rows (a GroupNorm's 32 groups of a UNet's 40960 values) are read by one program each rather
    than 4 rows by one program (at the largest rows of a dynamic range). Rows contiguous with each
    other keep 32 a program, so that their loads stay coalesced."""
    block_r, block_c = blocks
    rows, xs = upper(plan.rows), plan.strides[0]
    least = 32 if xs[3] != 1 and xs[2] == 1 else 1
    while block_r > least and triton.cdiv(rows, block_r) < MIN_PROGRAMS:
        block_r //= 2
    return block_r, block_c


@dataclass(frozen=True)
class RowReduce:
    """What a one-pass float sum, prod, max or min launch computes, for fusion (``fuse_reduce.py``):
    ``out`` (contiguous, rows in row-major order of the kept dims) from ``x`` (the kernel's input)
    over ``dims``, with the launch's formula."""

    x: TRef
    out: TRef
    dims: tuple[int, ...]
    map_: str
    combine: str
    finish: str
    divisor: object

    @property
    def reads(self) -> tuple[TRef, ...]:
        return (self.x,)

    def launch(self, src: TRef, dst: TRef, plan: rw.Rows, out_strides, pro, epi, chain_constexprs: dict):
        """(grid, args, constexprs) of a one-pass launch over ``plan`` reading ``src`` (x, or a prologue's
        first operand) and storing ``dst`` (through ``out_strides`` when there is an epilogue), with
        the chains' arguments ``pro`` and ``epi`` (``rows.chain_args``, None without) and constexprs."""
        block_r, block_c = rw.blocks(plan, MAX_BLOCK_C)
        args = _args(src, dst, dst, plan, sizes.larger(1, plan.cols), self.divisor, out_strides, pro, epi)
        constexprs = dict(MAP=self.map_, COMBINE=self.combine, FINISH=self.finish, INT_ACC=False,
                          BLOCK_R=block_r, BLOCK_C=block_c, num_warps=rw.num_warps(block_r, block_c),
                          **chain_constexprs)
        return (triton.cdiv(plan.rows, block_r), 1), args, constexprs


# --- support checks -------------------------------------------------------------------------------
INT_DTYPES = (torch.int64, torch.int32, torch.bool)
NORM_ORDS = {1: ("abs", "sum", "none"), 2: ("sq", "sum", "sqrt"),
             math.inf: ("abs", "max", "none"), -math.inf: ("abs", "min", "none")}


def _check(node, in_dtypes, out_dtypes) -> str | None:
    x = node_value(node.args[0])
    if not isinstance(x, torch.Tensor):
        return "operand is not a tensor"
    outs = node.meta.get("val")
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if x.dtype not in in_dtypes:
        return f"input dtype {x.dtype} is not supported (supported: {', '.join(map(str, in_dtypes))})"
    out = outs[0]
    if out.dtype not in out_dtypes:
        return f"result dtype {out.dtype} is not supported (supported: {', '.join(map(str, out_dtypes))})"
    return None


def supported_sum(node) -> str | None:
    """sum / prod: floating inputs, or integer and bool inputs summed in int64."""
    return _check(node, FLOAT_DTYPES + INT_DTYPES, FLOAT_DTYPES + (torch.int64,))


def supported_float(node) -> str | None:
    return _check(node, FLOAT_DTYPES, FLOAT_DTYPES + (torch.int64,))


def supported_extreme(node) -> str | None:
    """amax / amin / max / min of all elements, and argmax / argmin / max.dim / min.dim: floating inputs,
    or int64 / int32 compared in int64 (Phi-3 longrope's ``max(position_ids)``, CLIP's text pooling by
    ``input_ids.int().argmax(-1)``)."""
    return _check(node, FLOAT_DTYPES + (torch.int64, torch.int32), FLOAT_DTYPES + (torch.int64, torch.int32))


def supported_logical(node) -> str | None:
    """any / all: of floating, int64, int32 or bool inputs, a bool result."""
    return _check(node, FLOAT_DTYPES + INT_DTYPES, (torch.bool,))


def supported_norm(node) -> str | None:
    ord_ = rw.node_arg(node, 1, "ord", 2)
    if ord_ not in NORM_ORDS:
        return f"vector norm of order {ord_!r} is not supported (supported: 1, 2, inf, -inf)"
    return supported_float(node)


# --- lowerings ------------------------------------------------------------------------------------
def _count(x: TRef, dims):
    """The number of elements reduced: an int, or a sympy expression over the symbols."""
    return sizes.size(math.prod((x.shape[d] for d in dims), start=1))


def _sum_like(combine, finish="none"):
    """sum.dim_IntList / mean.dim / sum.default / mean.default, and prod (dim, keepdim, *, dtype)."""

    def lower(b, node):
        x = b.ref(node.args[0])
        if node.target in (torch.ops.aten.sum.default, torch.ops.aten.mean.default,
                           torch.ops.aten.prod.default):
            dims = rw.normalize_dims(None, x.ndim)
        else:
            dims = rw.normalize_dims(rw.node_arg(node, 1, "dim"), x.ndim)
        launch_reduce(b, x, dims, b.out(node), combine=combine, finish=finish,
                      divisor=_count(x, dims))

    return lower


def extreme(combine):
    """amax / amin (dim=[], keepdim) and max.default / min.default."""

    def lower(b, node):
        x = b.ref(node.args[0])
        dims = rw.normalize_dims(rw.node_arg(node, 1, "dim"), x.ndim)
        launch_reduce(b, x, dims, b.out(node), combine=combine)

    return lower


def logical(combine):
    """any / all (dim=None, an int or a list of them, keepdim): the sum ("any") or product ("all") of
    ``x != 0`` in the integer accumulator, stored as a bool (!= 0): no element gives False for any, True
    for all, as their identities 0 and 1 do."""

    def lower(b, node):
        x = b.ref(node.args[0])
        dims = rw.normalize_dims(None if node.target._overloadname == "default" else rw.node_arg(node, 1, "dim"),
                                 x.ndim)
        if x.dtype != torch.bool:
            nonzero = b.alloc(x.shape, torch.bool)
            ew.launch_pointwise(b, "ne", nonzero, [x, 0])
            x = nonzero
        launch_reduce(b, x, dims, b.out(node), combine=combine)

    return lower


def extreme_dim(combine):
    """max.dim / min.dim: (values, first indices) along one dim."""

    def lower(b, node):
        x = b.ref(node.args[0])
        dims = rw.normalize_dims(node.args[1], x.ndim)
        launch_reduce(b, x, dims, b.out(node, 0), b.out(node, 1), combine=combine)

    return lower


def arg_extreme(combine):
    """argmax / argmin (dim=None flattens, keepdim)."""

    def lower(b, node):
        x = b.ref(node.args[0])
        dims = rw.normalize_dims(rw.node_arg(node, 1, "dim"), x.ndim)
        out = b.out(node)
        values = b.alloc(out.shape, torch.float32)  # written, never read
        launch_reduce(b, x, dims, values, out, combine=combine)

    return lower


def _var_divisor(node, x: TRef, dims):
    """max(N - correction, 0): a float, or an integer expression when N depends on the symbols."""
    correction = node.kwargs.get("correction")
    correction = 1 if correction is None else correction
    count = _count(x, dims)
    if sizes.is_static(count):
        return float(max(count - correction, 0))
    if float(correction) != int(correction):
        raise sizes.SymbolicShapeError(
            f"a variance with the non-integer correction {correction!r} over a dynamic count {count} "
            "(the divisor of a dynamic count must be an integer size)")
    # unevaluated: sympy's symbols are positive, but a dynamic size may be 0 (an empty batch)
    return sympy.Max(count - int(correction), 0, evaluate=False)


def var(b, node):
    """var.correction(x, dim=None, *, correction=1, keepdim=False) = M2 / max(N - correction, 0)"""
    x = b.ref(node.args[0])
    dims = rw.normalize_dims(rw.node_arg(node, 1, "dim"), x.ndim)
    out = b.out(node)
    mean = b.alloc(out.shape, torch.float32)  # written, never read
    launch_reduce(b, x, dims, out, mean, combine="welford", divisor=_var_divisor(node, x, dims))


def var_mean(b, node):
    x = b.ref(node.args[0])
    dims = rw.normalize_dims(rw.node_arg(node, 1, "dim"), x.ndim)
    launch_reduce(b, x, dims, b.out(node, 0), b.out(node, 1), combine="welford",
                  divisor=_var_divisor(node, x, dims))


def vector_norm(b, node):
    """linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None) for ord 1, 2, +-inf."""
    x = b.ref(node.args[0])
    map_, combine, finish = NORM_ORDS[rw.node_arg(node, 1, "ord", 2)]
    dims = rw.normalize_dims(rw.node_arg(node, 2, "dim"), x.ndim)
    launch_reduce(b, x, dims, b.out(node), map_=map_, combine=combine, finish=finish)


sum_ = _sum_like("sum")
mean = _sum_like("sum", "div")
prod = _sum_like("prod")
