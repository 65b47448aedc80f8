"""Indexing ops: embedding, index_select, gather and advanced indexing (``index.Tensor``) share one
gather kernel; ``cumsum`` (the inclusive scan the attention-mask code of causal LMs uses) has its own.

Every gather op is the same formula over the output's coordinates ``o`` (up to ``MAX_RANK`` dims after
merging contiguous ones):

    out[o] = src[ sum_j o_j * S_j  +  sum_k wrap(idx_k[sum_j o_j * T_kj]) * U_k ]

``S`` maps output dims that walk a source dim directly (0 elsewhere), index tensor ``k`` is seen
through broadcasting in output coordinates (strides ``T_k``), and its values select along the source
dim of stride ``U_k`` and size ``N_k``; negative indices wrap once (``i + N_k``). An out-of-range index,
an error in PyTorch, reads 0 here rather than memory outside the source.

A gather may run a pointwise chain on its values before the store (``EPILOGUE`` steps, merged by
``fuse_gather.py``: an embedding's ``+ positions`` or ``* normalizer``): from the gathered value rounded
to the gathered tensor's dtype, in fp32, each step reading its operand by its own strides over the
output's coordinates, stored by the chain's result strides (:class:`GatherOp` builds either launch).

    cumsum:  out[r, l] = sum_{m <= l} x[r, m]      rows r over every dim but ``dim``

accumulated in fp32 for floating inputs and int64 otherwise, a block of rows per program, looping over
the scanned dim in chunks with a running carry. ``cummax`` / ``cummin`` (Grounding DINO's text masks)
scan (value, index) pairs the same way with ``tl.associative_scan``: the later element wins ties, and a
NaN wins over any number and over an earlier NaN, as eager's CPU kernel does, which makes the combine a
maximum over (is NaN, value, index) and so associative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import elementwise as ew
from .dequant_rows import launch_dequant_rows
from .matmul import QuantWeight
from .refs import TRef, broadcast_strides, collapse, collapse_padded, contiguous_strides, node_value
from .sizes import SymbolicShapeError, is_static, next_power_of_2
from .sizes import shape as size_shape

MAX_RANK = 5
FLOAT_OR_INT = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)
MAX_INDICES = 3
BLOCK = 1024
INDEX_DTYPES = (torch.int64, torch.int32)


# --- kernels --------------------------------------------------------------------------------------
@triton.jit
def _index_term(idx_ptr, i0, i1, i2, i3, i4, t0, t1, t2, t3, t4, size, stride, mask):
    idx = tl.load(idx_ptr + i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3 + i4 * t4, mask=mask, other=0)
    idx = idx.to(tl.int64)
    idx = tl.where(idx < 0, idx + size, idx)
    return idx * stride, (idx >= 0) & (idx < size)


@triton.jit
def indexed_offsets(
    idx0_ptr, idx1_ptr, idx2_ptr, i0, i1, i2, i3, i4,
    s0, s1, s2, s3, s4,
    t00, t01, t02, t03, t04,
    t10, t11, t12, t13, t14,
    t20, t21, t22, t23, t24,
    size0, size1, size2, u0, u1, u2, mask, NUM_INDICES: tl.constexpr,
):
    """``sum_j o_j * S_j + sum_k wrap(idx_k[o . T_k]) * U_k`` and where every index is in range: the
    address formula gather reads with and scatter writes with."""
    offs = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3 + i4 * s4
    term, valid = _index_term(idx0_ptr, i0, i1, i2, i3, i4, t00, t01, t02, t03, t04, size0, u0, mask)
    offs += term
    valid = valid & mask
    if NUM_INDICES >= 2:
        term, ok = _index_term(idx1_ptr, i0, i1, i2, i3, i4, t10, t11, t12, t13, t14, size1, u1, mask)
        offs += term
        valid = valid & ok
    if NUM_INDICES >= 3:
        term, ok = _index_term(idx2_ptr, i0, i1, i2, i3, i4, t20, t21, t22, t23, t24, size2, u2, mask)
        offs += term
        valid = valid & ok
    return offs, valid


@triton.jit
def _gather_epilogue(r, mask, i0, i1, i2, i3, i4,
                     e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
                     e0s0, e0s1, e0s2, e0s3, e0s4, e1s0, e1s1, e1s2, e1s3, e1s4,
                     e2s0, e2s1, e2s2, e2s3, e2s4, e3s0, e3s1, e3s2, e3s3, e3s4,
                     EPILOGUE: tl.constexpr, ROUND_TO: tl.constexpr,
                     EOP0: tl.constexpr, EARITY0: tl.constexpr, ESWAP0: tl.constexpr, EIS_SCALAR0: tl.constexpr,
                     EOP1: tl.constexpr, EARITY1: tl.constexpr, ESWAP1: tl.constexpr, EIS_SCALAR1: tl.constexpr,
                     EOP2: tl.constexpr, EARITY2: tl.constexpr, ESWAP2: tl.constexpr, EIS_SCALAR2: tl.constexpr,
                     EOP3: tl.constexpr, EARITY3: tl.constexpr, ESWAP3: tl.constexpr, EIS_SCALAR3: tl.constexpr):
    """The gathered values as eager stores them (rounded to ROUND_TO), then EPILOGUE chain steps in fp32,
    operand k at ek_ptr + i0*eks0 + ... + i4*eks4."""
    r = ew.round_as(r.to(tl.float32), ROUND_TO)
    r = ew._chain_step(r, e0_ptr, e0_scalar, i0, i1, i2, i3, i4, e0s0, e0s1, e0s2, e0s3, e0s4, mask,
                       EOP0, EARITY0, ESWAP0, EIS_SCALAR0, "f32")
    if EPILOGUE >= 2:
        r = ew._chain_step(r, e1_ptr, e1_scalar, i0, i1, i2, i3, i4, e1s0, e1s1, e1s2, e1s3, e1s4, mask,
                           EOP1, EARITY1, ESWAP1, EIS_SCALAR1, "f32")
    if EPILOGUE >= 3:
        r = ew._chain_step(r, e2_ptr, e2_scalar, i0, i1, i2, i3, i4, e2s0, e2s1, e2s2, e2s3, e2s4, mask,
                           EOP2, EARITY2, ESWAP2, EIS_SCALAR2, "f32")
    if EPILOGUE >= 4:
        r = ew._chain_step(r, e3_ptr, e3_scalar, i0, i1, i2, i3, i4, e3s0, e3s1, e3s2, e3s3, e3s4, mask,
                           EOP3, EARITY3, ESWAP3, EIS_SCALAR3, "f32")
    return r


@triton.jit
def gather_kernel(
    out_ptr, src_ptr, idx0_ptr, idx1_ptr, idx2_ptr,
    n, d1, d2, d3, d4,
    ss0, ss1, ss2, ss3, ss4,
    t00, t01, t02, t03, t04,
    t10, t11, t12, t13, t14,
    t20, t21, t22, t23, t24,
    size0, size1, size2, u0, u1, u2,
    # with an epilogue: the result's strides and the chain's operands (stand-ins without one)
    os0, os1, os2, os3, os4,
    e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e0s3, e0s4, e1s0, e1s1, e1s2, e1s3, e1s4,
    e2s0, e2s1, e2s2, e2s3, e2s4, e3s0, e3s1, e3s2, e3s3, e3s4,
    NUM_INDICES: tl.constexpr, BLOCK: tl.constexpr,
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1, ESWAP0: tl.constexpr = False, EIS_SCALAR0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1, ESWAP1: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1, ESWAP2: tl.constexpr = False, EIS_SCALAR2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1, ESWAP3: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    i0, i1, i2, i3, i4 = ew.unravel5(offs, d1, d2, d3, d4)
    src_offs, valid = indexed_offsets(
        idx0_ptr, idx1_ptr, idx2_ptr, i0, i1, i2, i3, i4, ss0, ss1, ss2, ss3, ss4,
        t00, t01, t02, t03, t04, t10, t11, t12, t13, t14, t20, t21, t22, t23, t24,
        size0, size1, size2, u0, u1, u2, mask, NUM_INDICES)
    value = tl.load(src_ptr + src_offs, mask=valid, other=0)
    if EPILOGUE == 0:  # the gathered tensor itself, contiguous
        tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        r = _gather_epilogue(
            value, mask, i0, i1, i2, i3, i4, e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar,
            e3_scalar, e0s0, e0s1, e0s2, e0s3, e0s4, e1s0, e1s1, e1s2, e1s3, e1s4,
            e2s0, e2s1, e2s2, e2s3, e2s4, e3s0, e3s1, e3s2, e3s3, e3s4, EPILOGUE, ROUND_TO,
            EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1, EIS_SCALAR1,
            EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
        out_offs = i0 * os0 + i1 * os1 + i2 * os2 + i3 * os3 + i4 * os4
        tl.store(out_ptr + out_offs, r.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scan_coords(r, r1, r2, r3):
    """The four row coordinates (i0, i1, i2, i3) of flat rows ``r`` of a scan over sizes (_, r1, r2, r3)."""
    i3 = r % r3
    rest = r // r3
    i2 = rest % r2
    rest = rest // r2
    return rest // r1, rest % r1, i2, i3


@triton.jit
def cumsum_kernel(
    out_ptr, x_ptr,
    rows, r1, r2, r3,
    xs0, xs1, xs2, xs3,
    os0, os1, os2, os3,
    length, x_stride, out_stride,
    IS_FLOAT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = r < rows
    i0, i1, i2, i3 = _scan_coords(r, r1, r2, r3)
    x_row = i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3
    out_row = i0 * os0 + i1 * os1 + i2 * os2 + i3 * os3
    if IS_FLOAT:
        carry = tl.zeros([BLOCK_R], dtype=tl.float32)
    else:
        carry = tl.zeros([BLOCK_R], dtype=tl.int64)
    last = (tl.arange(0, BLOCK_L) == BLOCK_L - 1)[None, :]
    for start in range(0, length, BLOCK_L):
        cols = start + tl.arange(0, BLOCK_L).to(tl.int64)
        mask = row_mask[:, None] & (cols < length)[None, :]
        x = tl.load(x_ptr + x_row[:, None] + cols[None, :] * x_stride, mask=mask, other=0)
        x = x.to(carry.dtype)
        acc = tl.cumsum(x, axis=1) + carry[:, None]
        tl.store(out_ptr + out_row[:, None] + cols[None, :] * out_stride,
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
        # The next chunk starts from this chunk's last prefix (masked columns added 0), read out of
        # the scan rather than as carry + tl.sum(x): one reduction either way, and triton 3.6's sm_90
        # compiler asserts (OptimizeThreadLocality) on an fp32 carry += tl.sum(...) left unused.
        carry = tl.sum(tl.where(last, acc, 0), axis=1)


@triton.jit
def _later_max(v1, i1, v2, i2):
    """The (value, index) of the pair a cummax keeps: the later one unless the earlier is larger or NaN
    (a later NaN wins)."""
    later = (v2 != v2) | ((v1 == v1) & (v2 >= v1))
    return tl.where(later, v2, v1), tl.where(later, i2, i1)


@triton.jit
def _later_min(v1, i1, v2, i2):
    later = (v2 != v2) | ((v1 == v1) & (v2 <= v1))
    return tl.where(later, v2, v1), tl.where(later, i2, i1)


@triton.jit
def cumextreme_kernel(
    out_ptr, idx_ptr, x_ptr,
    rows, r1, r2, r3,
    xs0, xs1, xs2, xs3,
    os0, os1, os2, os3,
    is0, is1, is2, is3,
    length, x_stride, out_stride, idx_stride,
    IS_MIN: tl.constexpr, IS_FLOAT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = r < rows
    i0, i1, i2, i3 = _scan_coords(r, r1, r2, r3)
    x_row = i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3
    out_row = i0 * os0 + i1 * os1 + i2 * os2 + i3 * os3
    idx_row = i0 * is0 + i1 * is1 + i2 * is2 + i3 * is3
    # the carry starts as element 0 itself, which its own prefix (element 0 again) replaces
    first = tl.load(x_ptr + x_row, mask=row_mask & (r * 0 < length), other=0)  # no element 0 when empty
    if IS_FLOAT:
        carry = first.to(tl.float32)
    else:
        carry = first.to(tl.int64)
    carry_i = tl.zeros([BLOCK_R], dtype=tl.int64)
    last = (tl.arange(0, BLOCK_L) == BLOCK_L - 1)[None, :]
    for start in range(0, length, BLOCK_L):
        cols = start + tl.arange(0, BLOCK_L).to(tl.int64)
        mask = row_mask[:, None] & (cols < length)[None, :]
        x = tl.load(x_ptr + x_row[:, None] + cols[None, :] * x_stride, mask=mask, other=0).to(carry.dtype)
        at = tl.broadcast_to(cols[None, :], [BLOCK_R, BLOCK_L])
        if IS_MIN:  # columns past the end come after every real one: they never change a real prefix
            v, i = tl.associative_scan((x, at), 1, _later_min)
            v, i = _later_min(carry[:, None], carry_i[:, None], v, i)
        else:
            v, i = tl.associative_scan((x, at), 1, _later_max)
            v, i = _later_max(carry[:, None], carry_i[:, None], v, i)
        tl.store(out_ptr + out_row[:, None] + cols[None, :] * out_stride, v.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(idx_ptr + idx_row[:, None] + cols[None, :] * idx_stride, i, mask=mask)
        carry = tl.sum(tl.where(last, v, 0), axis=1).to(carry.dtype)  # the chunk's last prefix
        carry_i = tl.sum(tl.where(last, i, 0), axis=1)


# --- host launchers -------------------------------------------------------------------------------
def broadcast_shape(shapes) -> tuple:
    """The shape ``shapes`` broadcast to, as ``torch.broadcast_shapes``, for sizes that may be sympy
    expressions: a dim takes the size every operand not of size 1 has. Dynamic sizes that differ
    (which export would have tied or refused) raise SymbolicShapeError."""
    shapes = [tuple(shape) for shape in shapes]
    if is_static(shapes):
        return tuple(torch.broadcast_shapes(*shapes))
    rank = max((len(shape) for shape in shapes), default=0)
    result = []
    for d in range(rank):
        own = {shape[d - rank + len(shape)] for shape in shapes if d - rank + len(shape) >= 0}
        own.discard(1)
        if len(own) > 1:
            raise SymbolicShapeError(f"index shapes {shapes} broadcast only if sizes {sorted(map(str, own))} "
                                     "are equal, which their ranges do not decide")
        result.append(own.pop() if own else 1)
    return tuple(result)


@dataclass(frozen=True)
class GatherOp:
    """What one ``gather`` launch computes (its ``LaunchRecord.op``), for fusion (``fuse_gather.py``):
    ``out`` (contiguous) from ``src`` through ``direct`` and ``indices`` (see :func:`launch_gather`)."""

    out: TRef
    src: TRef
    direct: tuple
    indices: tuple  # (index TRef, T, N, U) per index tensor

    @property
    def reads(self) -> list[TRef]:
        return [self.src] + [idx for idx, _, _, _ in self.indices]

    def launch(self, dst: TRef | None = None, steps=(), operands=()):
        """(grid, arguments, constexprs) of this gather, or None when its walk needs more than MAX_RANK
        dims. With ``steps`` ((op, arity, swap), at most ``ew.MAX_CHAIN``) an epilogue runs on the
        gathered values (rounded to ``out``'s dtype) before the store to ``dst`` (over ``out``'s shape,
        any strides): step k reads ``operands[k]``, a TRef (broadcast to ``out``'s shape), a Python
        scalar, or None (a unary step); ``out`` is never stored."""
        dst = self.out if dst is None else dst
        tensors = [o for o in operands if isinstance(o, TRef)]
        stride_sets = ([list(dst.strides), list(self.direct)] + [list(t) for _, t, _, _ in self.indices]
                       + [list(broadcast_strides(o, self.out.shape)) for o in tensors])
        walk = collapse_padded(self.out.shape, stride_sets, MAX_RANK)
        if walk is None:
            return None
        sizes, strides = walk[0], iter(walk[1])
        out_strides, direct_strides = next(strides), next(strides)
        index_strides = [next(strides) for _ in self.indices] + [[0] * MAX_RANK] * (MAX_INDICES - len(self.indices))
        padded = list(self.indices) + [self.indices[0]] * (MAX_INDICES - len(self.indices))  # unused, never read
        ptrs, scalars, operand_strides = [], [], []
        for o in list(operands) + [None] * (ew.MAX_CHAIN - len(operands)):
            ptrs.append(o if isinstance(o, TRef) else dst)  # a stand-in where no tensor is read
            scalars.append(0.0 if o is None or isinstance(o, TRef) else float(o))
            operand_strides.extend(next(strides) if isinstance(o, TRef) else [0] * MAX_RANK)
        args = [dst, self.src, *(p[0] for p in padded), self.out.numel, *sizes[1:], *direct_strides,
                *(s for t in index_strides for s in t), *(p[2] for p in padded), *(p[3] for p in padded),
                *out_strides, *ptrs, *scalars, *operand_strides]
        constexprs = {"NUM_INDICES": len(self.indices), "BLOCK": BLOCK}
        if steps:
            constexprs.update(EPILOGUE=len(steps), ROUND_TO=_round_to(self.out.dtype))
            for k, ((name, arity, swap), o) in enumerate(zip(steps, operands)):
                constexprs.update({f"EOP{k}": name, f"EARITY{k}": arity, f"ESWAP{k}": swap,
                                   f"EIS_SCALAR{k}": o is not None and not isinstance(o, TRef)})
        return (triton.cdiv(self.out.numel, BLOCK),), args, constexprs


def _round_to(dtype: torch.dtype) -> str:
    """The epilogue's rounding of the gathered values: to a 16-bit float; none for others (fp32, or an
    integer source converted to fp32 as a pointwise chain converts its operands)."""
    return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "")


def launch_gather(b, out: TRef, src: TRef, direct, indices) -> None:
    """``out`` (contiguous) from ``src``: ``direct`` holds S (one stride per out dim); ``indices``
    holds (index TRef, T (one stride per out dim), source dim size N, source dim stride U)."""
    if not out.is_contiguous():
        raise ValueError("the gather kernel writes a contiguous output")
    if not 1 <= len(indices) <= MAX_INDICES:
        raise NotImplementedError(f"{len(indices)} index tensors (supported: 1 to {MAX_INDICES})")
    op = GatherOp(out, src, tuple(direct), tuple((i, tuple(t), n, u) for i, t, n, u in indices))
    walk = op.launch()
    if walk is None:
        raise NotImplementedError(f"indexing over more than {MAX_RANK} non-mergeable dims")
    grid, args, constexprs = walk
    record = b.launch("gather", grid, *args, **constexprs)
    if record is not None:
        record.op = op


def _scan_rows(dim: int, *refs: TRef) -> tuple:
    """(rows, the row sizes after the first, each ref's row strides, length, each ref's stride along
    ``dim``, BLOCK_R, BLOCK_L) of a scan along ``dim`` of same-shape ``refs`` (x first)."""
    x = refs[0]
    other = [d for d in range(x.ndim) if d != dim]
    walk = collapse_padded([x.shape[d] for d in other], [[t.strides[d] for d in other] for t in refs], 4)
    if walk is None:
        raise NotImplementedError("a scan over rows of more than 4 non-mergeable dims")
    sizes, row_strides = walk
    length = x.shape[dim] if x.ndim else 1
    rows = math.prod(sizes)
    block_l = min(next_power_of_2(length), 256)
    block_r = max(1, min(next_power_of_2(rows), 1024 // block_l))
    along = [t.strides[dim] if x.ndim else 0 for t in refs]
    return rows, sizes[1:], row_strides, length, along, block_r, block_l


def launch_cumsum(b, out: TRef, x: TRef, dim: int) -> None:
    rows, sizes, (x_strides, out_strides), length, along, block_r, block_l = _scan_rows(dim, x, out)
    b.launch("cumsum", (triton.cdiv(rows, block_r),), out, x, rows, *sizes, *x_strides, *out_strides,
             length, *along, IS_FLOAT=out.dtype.is_floating_point, BLOCK_R=block_r, BLOCK_L=block_l)


def launch_cumextreme(b, out: TRef, indices: TRef, x: TRef, dim: int, is_min: bool) -> None:
    rows, sizes, strides, length, (xs, os_, is_), block_r, block_l = _scan_rows(dim, x, out, indices)
    b.launch("cumextreme", (triton.cdiv(rows, block_r),), out, indices, x, rows, *sizes,
             *(v for walk in strides for v in walk), length, xs, os_, is_, IS_MIN=is_min,
             IS_FLOAT=x.dtype.is_floating_point, BLOCK_R=block_r, BLOCK_L=block_l)


# --- lowerings ------------------------------------------------------------------------------------
def embedding(b, node):  # embedding(weight, indices, padding_idx, ...): out = weight[indices]
    table = b.values(node.args[0])
    if isinstance(table, QuantWeight):  # a quantized table: its rows gathered and dequantized (dequant_rows.py)
        launch_dequant_rows(b, b.out(node), table, b.ref(node.args[1]))
        return
    weight, idx = b.ref(node.args[0]), b.ref(node.args[1])
    out = b.out(node)
    direct = [0] * idx.ndim + [weight.strides[1]]
    launch_gather(b, out, weight, direct, [(idx, list(idx.strides) + [0], weight.shape[0], weight.strides[0])])


def index_select(b, node):  # index_select(src, dim, index): src with dim picked by index
    src, idx = b.ref(node.args[0]), b.ref(node.args[2])
    out = b.out(node)
    dim = node.args[1] % max(src.ndim, 1)
    if src.ndim == 0:  # a 0-d source: index 0 (or -1) of a size-1 dim
        launch_gather(b, out, src, [0] * out.ndim, [(idx, [0] * out.ndim, 1, 0)])
        return
    direct = [0 if j == dim else s for j, s in enumerate(src.strides)]
    along = [0] * out.ndim
    along[dim] = idx.strides[0] if idx.ndim else 0
    launch_gather(b, out, src, direct, [(idx, along, src.shape[dim], src.strides[dim])])


def gather(b, node):  # gather(src, dim, index): out[o] = src[o with o_dim := index[o]]
    src, idx = b.ref(node.args[0]), b.ref(node.args[2])
    out = b.out(node)
    if src.ndim == 0:
        launch_gather(b, out, src, [0] * out.ndim, [(idx, list(idx.strides), 1, 0)])
        return
    dim = node.args[1] % src.ndim
    direct = [0 if j == dim else s for j, s in enumerate(src.strides)]
    launch_gather(b, out, src, direct, [(idx, list(idx.strides), src.shape[dim], src.strides[dim])])


def advanced_layout(src, refs, dims):
    """PyTorch's advanced-indexing layout over ``src`` (a TRef, or anything with ``shape``, ``strides``
    and ``ndim``): the index tensors ``refs`` (on ``dims`` of ``src``) broadcast to a shape B, which
    replaces the indexed dims in place when they are adjacent and comes first otherwise. Returns
    (iteration shape, S (src's stride per iteration dim), [(index, T, N, U)] as ``launch_gather`` takes)."""
    bshape = broadcast_shape(r.shape for r in refs)
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    rest = [d for d in range(src.ndim) if d not in dims]
    before = [d for d in rest if d < dims[0]] if adjacent else []
    after = [d for d in rest if d not in before]
    shape = tuple(src.shape[d] for d in before) + bshape + tuple(src.shape[d] for d in after)
    direct = [src.strides[d] for d in before] + [0] * len(bshape) + [src.strides[d] for d in after]
    pad_before, pad_after = [0] * len(before), [0] * len(after)
    indices = [
        (r, pad_before + list(broadcast_strides(r, bshape)) + pad_after, src.shape[d], src.strides[d])
        for r, d in zip(refs, dims)
    ]
    return shape, direct, indices


def index(b, node):
    """index.Tensor(src, [idx or None, ...]): PyTorch advanced indexing with integer index tensors
    (:func:`advanced_layout`). A source whose strides leave more than MAX_RANK dims to walk is read
    through a contiguous copy (``index_reason`` admits the node when either walk fits)."""
    src = b.ref(node.args[0])
    entries = list(node.args[1]) + [None] * (src.ndim - len(node.args[1]))
    dims = [d for d, e in enumerate(entries) if e is not None]
    refs = [b.ref(entries[d]) for d in dims]
    out = b.out(node)
    for source in (src, None):
        source = source or b.contiguous(src)
        shape, direct, indices = advanced_layout(source, refs, dims)
        if shape != out.shape:
            raise ValueError(f"computed index result shape {shape} differs from the traced {out.shape}")
        if walk_rank(shape, [contiguous_strides(shape), direct] + [t for _, t, _, _ in indices]) <= MAX_RANK:
            break
    launch_gather(b, out, source, direct, indices)


def walk_rank(shape, stride_sets) -> int:
    """The dims a kernel walks over ``shape`` after merging those every stride set walks contiguously."""
    return len(collapse(shape, stride_sets)[0])


def cumsum(b, node):  # cumsum(x, dim, dtype=None)
    x = b.ref(node.args[0])
    out = b.out(node)
    launch_cumsum(b, out, x, node.args[1] % max(x.ndim, 1))


def cumextreme(is_min: bool):
    """cummax / cummin(x, dim) -> (values, indices)."""

    def lower(b, node):
        x = b.ref(node.args[0])
        launch_cumextreme(b, b.out(node, 0), b.out(node, 1), x, node.args[1] % max(x.ndim, 1), is_min)

    return lower


# --- support checks -------------------------------------------------------------------------------
def _dtype_reason(val, what: str, allowed) -> str | None:
    if not isinstance(val, torch.Tensor):
        return f"{what} is not a tensor"
    if val.dtype not in allowed:
        return f"{what} has dtype {val.dtype} (supported: {', '.join(map(str, allowed))})"
    return None


def _supported_gather_op(node, src_arg, index_args, layouts=()) -> str | None:
    out = node.meta.get("val")
    reason = _dtype_reason(out, "the result", ew.DTYPES) or _dtype_reason(node_value(src_arg), "the source", ew.DTYPES)
    return reason or index_reason(index_args, out, layouts)


def index_reason(index_args, out, layouts=()) -> str | None:
    """Why the indices or the result of an indexing op (gather or scatter) cannot be lowered, or None.
    ``layouts``: (iteration shape, stride sets) walks of which the kernel may take any; the result
    fits when one merges to at most MAX_RANK dims. Without them, every dim of the result of a size
    other than 1 counts."""
    for arg in index_args:
        reason = _dtype_reason(node_value(arg), "an index", INDEX_DTYPES)
        if reason:
            return reason
    walked = walked_dims(layouts, out.shape)
    if walked > MAX_RANK:
        return f"result has {walked} dims of size other than 1 that do not merge (at most {MAX_RANK})"
    return None


def walked_dims(layouts, shape) -> int:
    """The fewest dims any of ``layouts`` ((iteration shape, stride sets)) walks after merging; without
    layouts, the dims of ``shape`` of a size other than 1 (size-1 dims are dropped)."""
    walked = min((walk_rank(s, sets) for s, sets in layouts), default=None)
    return sum(1 for n in shape if not (isinstance(n, int) and n == 1)) if walked is None else walked


def meta_view(val) -> TRef | None:
    """A fake tensor's shape and strides (ints or sympy expressions) as a TRef of no buffer, or None."""
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return TRef(0, 0, val.dtype, size_shape(val.shape), size_shape(val.stride()), 0)
    except SymbolicShapeError:
        return None


def index_walks(src_val, index_vals, dims, values_val=None) -> list:
    """The walks (iteration shape, stride sets) of an advanced indexing of ``src_val`` by ``index_vals``
    (on ``dims``) as the lowering takes them: through the source's strides, then a contiguous copy's;
    the result (contiguous; or ``values_val`` broadcast, for index_put) walked with them. Empty when
    a size or stride is not one the plan can express."""
    views = [meta_view(v) for v in (src_val, *index_vals)]
    values = None if values_val is None else meta_view(values_val)
    if any(v is None for v in views) or (values_val is not None and values is None):
        return []
    walks = []
    src, refs = views[0], views[1:]
    for strides in (src.strides, contiguous_strides(src.shape)):
        shape, direct, indices = advanced_layout(TRef(0, 0, src.dtype, src.shape, strides, 0), refs, dims)
        first = contiguous_strides(shape) if values is None else values_strides(values, shape)
        walks.append((shape, [first, direct] + [t for _, t, _, _ in indices]))
    return walks


def values_strides(values: TRef, shape) -> tuple:
    """``values`` broadcast to ``shape``, leading size-1 dims beyond its rank dropped (index_put's rule)."""
    extra = values.ndim - len(shape)
    if extra > 0:
        values = TRef(values.index, values.buffer, values.dtype, values.shape[extra:], values.strides[extra:],
                      values.offset)
    return broadcast_strides(values, shape)


def supported_embedding(node) -> str | None:
    weight = node_value(node.args[0])
    if isinstance(weight, torch.Tensor) and weight.ndim != 2:
        return f"embedding weight has {weight.ndim} dims, expected 2"
    return _supported_gather_op(node, node.args[0], [node.args[1]])


def supported_index_select(node) -> str | None:
    idx = node_value(node.args[2])
    if isinstance(idx, torch.Tensor) and idx.ndim > 1:
        return f"index_select index has {idx.ndim} dims, expected at most 1"
    return _supported_gather_op(node, node.args[0], [node.args[2]])


def supported_gather(node) -> str | None:
    return _supported_gather_op(node, node.args[0], [node.args[2]])


def supported_index(node) -> str | None:
    entries = [e for e in node.args[1] if e is not None]
    if not entries:
        return "index.Tensor without any index tensor"
    for e in entries:
        val = node_value(e)
        if isinstance(val, torch.Tensor) and val.dtype in (torch.bool, torch.uint8):
            return "boolean mask indexing gives a data-dependent shape; only integer index tensors are supported"
    if len(entries) > MAX_INDICES:
        return f"{len(entries)} index tensors (at most {MAX_INDICES})"
    dims = [d for d, e in enumerate(node.args[1]) if e is not None]
    walks = index_walks(node_value(node.args[0]), [node_value(e) for e in entries], dims)
    return _supported_gather_op(node, node.args[0], entries, walks)


def supported_cumextreme(node) -> str | None:
    x = node_value(node.args[0])
    reason = _dtype_reason(x, "the input", FLOAT_OR_INT)
    if reason:
        return reason
    return f"input has {x.ndim} dims (at most 5)" if x.ndim > 5 else None


def supported_cumsum(node) -> str | None:
    out, x = node.meta.get("val"), node_value(node.args[0])
    reason = _dtype_reason(out, "the result", ew.DTYPES) or _dtype_reason(x, "the input", ew.DTYPES)
    if reason:
        return reason
    if out.dtype == torch.bool:
        return "cumsum into torch.bool is not supported"
    if x.ndim > 5:
        return f"input has {x.ndim} dims (at most 5)"
    return None
