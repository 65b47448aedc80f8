"""Pointwise ops: unary, binary (with broadcasting and scalar operands) and ``where``, plus casts and
strided copies. One kernel serves them all; the formula is picked at compile time by ``OP``.

    out[i] = OP(a[i], b[i], c[i])      i over out's shape; a, b, c broadcast with stride 0

Operands may be strided views (a transpose, a slice, an expand), so view ops never need a copy before
a pointwise consumer. Floating math runs in fp32 and is cast to the output dtype on store. A scalar
operand may be a size node (``x * x.shape[0]`` with a dynamic dim): an integer argument evaluated per
call; such a launch is not offered to fusion (an epilogue takes constant scalars only).

A second kernel runs a chain of such ops, the ones ``fusion.py`` merges, with the running value in
registers:

    r = OP0(p0[i], p1[i]);  r = OPk(r, p(k+1)[i])  (or OPk(p(k+1)[i], r) when SWAPk, OPk(r) when unary)
    out[i] = r
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dtypes import dtype_name
from . import sizes as size_fns
from .sizes import is_size_node
from .refs import FLOAT_DTYPES, MAX_RANK, TRef, broadcast_strides, collapse_padded

BLOCK = 1024
MAX_CHAIN = 4  # ops in one pointwise_chain launch; operand slots: 2 for the first op, 1 per further op


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _pow(a, b):
    """C's pow: |a| ** b through fp64 exp2/log2 (fp32's lose ~1e-6 of the result), the sign of a (-0.0
    included) for an odd integer b, NaN for a finite negative a and a non-integer b, 1 for b == 0, for
    a == 1 and for a == -1 with an infinite b."""
    mag = tl.exp2(b.to(tl.float64) * tl.log2(tl.abs(a).to(tl.float64))).to(a.dtype)
    is_int = tl.floor(b) == b  # true for +-inf, false for NaN
    odd = is_int & ((tl.abs(b) % 2.0) == 1.0)
    negative = (a < 0) | ((a == 0) & ((1.0 / a) < 0))
    r = tl.where(negative & odd, -mag, mag)
    r = tl.where((a < 0) & (a > float("-inf")) & (is_int == 0), float("nan"), r)
    one = (b == 0.0) | (a == 1.0) | ((a == -1.0) & (tl.abs(b) == float("inf")))
    return tl.where(one, 1.0, r)


@triton.jit
def _nonzero(a, b):
    """b, with an integer 0 divisor replaced by 1 (an error in PyTorch; masked-off lanes load 0)."""
    if not a.dtype.is_floating():
        b = tl.where(b == 0, 1, b)
    return b


@triton.jit
def _remainder(a, b):
    """fmod(a, b) moved to b's sign, as ATen computes it for floats and integers."""
    b = _nonzero(a, b)
    m = a % b  # fmod for floats, C's truncated remainder for integers
    return tl.where((m != 0) & ((m < 0) != (b < 0)), m + b, m)


@triton.jit
def _div_trunc(a, b):
    """a / b rounded towards zero: trunc(a / b) for floats, C's integer division for integers."""
    if a.dtype.is_floating():
        q = a / b
        r = tl.where(q < 0, tl.ceil(q), tl.floor(q))
    else:
        r = a // _nonzero(a, b)
    return r


@triton.jit
def _div_floor(a, b):
    """a / b rounded towards -inf. Floats as ATen's div_floor_floating: (a - fmod(a, b)) / b, one less
    where fmod's sign differs from b's, then floored and rounded back up past .5; a zero keeps the sign
    of a / b, and b == 0 gives IEEE a / b. Integers: C's division, one less where the remainder's sign
    differs from b's."""
    if a.dtype.is_floating():
        mod = a % b
        div = (a - mod) / b
        div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
        floor = tl.floor(div)
        floor = tl.where(div - floor > 0.5, floor + 1.0, floor)
        q = a / b
        negative = (q < 0) | ((q == 0) & ((1.0 / q) < 0))
        r = tl.where(div != 0, floor, tl.where(negative, -0.0, 0.0))
        r = tl.where(b == 0, q, r)
    else:
        b = _nonzero(a, b)
        q = a // b
        m = a % b
        r = tl.where((m != 0) & ((m < 0) != (b < 0)), q - 1, q)
    return r


def round_name(dtype: torch.dtype) -> str:
    """The name :func:`round_as` rounds a value of ``dtype`` by: a 16-bit float's, else "" (nothing to
    round)."""
    return dtype_name(dtype) if dtype in (torch.float16, torch.bfloat16) else ""


@triton.jit
def round_as(v, ROUND: tl.constexpr):
    """``v`` (fp32) rounded to the 16-bit float ROUND names and back to fp32, as eager stores a value of
    that dtype; "" (or any other name): ``v`` as it is."""
    if ROUND == "float16":
        v = v.to(tl.float16).to(tl.float32)
    elif ROUND == "bfloat16":
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def _log1p(a):
    """log(1 + a) without losing a small a: log(u) * a / (u - 1), u = 1 + a rounded."""
    u = 1.0 + a
    r = tl.where(u == 1.0, a, tl.log(u) * (a / (u - 1.0)))
    return tl.where(u == float("inf"), u, r)


@triton.jit
def _expm1(a):
    """exp(a) - 1 without losing a small a: (u - 1) * a / log(u), u = exp(a)."""
    u = tl.exp(a)
    r = tl.where(u == 1.0, a, (u - 1.0) * (a / tl.log(u)))
    r = tl.where(u - 1.0 == -1.0, -1.0, r)
    return tl.where(u == float("inf"), u, r)


@triton.jit
def _formula(a, b, c, OP: tl.constexpr, ALPHA: tl.constexpr):
    """One pointwise op on a (and b, c): the ops of one operand here, the rest in _binary_formula."""
    if OP == "copy":
        r = a
    elif OP == "neg":
        r = -a
    elif OP == "exp":
        r = tl.exp(a)
    elif OP == "log":
        r = tl.log(a)
    elif OP == "log1p":
        r = _log1p(a)
    elif OP == "expm1":
        r = _expm1(a)
    elif OP == "sqrt":
        r = tl.sqrt(a)
    elif OP == "floor":
        r = tl.floor(a)
    elif OP == "ceil":
        r = tl.ceil(a)
    elif OP == "trunc":
        r = tl.where(a < 0, tl.ceil(a), tl.floor(a))
    elif OP == "round":  # half to even, as torch.round
        f = tl.floor(a)
        d = a - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
        r = tl.where(r == 0.0, a * 0.0, r)  # a zero keeps the sign: round(-0.4) = -0.0
    elif OP == "rsqrt":
        r = tl.rsqrt(a)
    elif OP == "reciprocal":
        r = 1.0 / a
    elif OP == "abs":
        r = tl.abs(a)
    elif OP == "sign":  # (0 < a) - (a < 0): 0 for NaN and both zeros, as ATen
        r = (a > 0).to(a.dtype) - (a < 0).to(a.dtype)
    elif OP == "sigmoid":
        r = tl.sigmoid(a)
    elif OP == "silu":
        r = a * tl.sigmoid(a)
    elif OP == "relu":  # NaN kept, as everywhere below
        r = tl.maximum(a, 0, propagate_nan=tl.PropagateNan.ALL)
    elif OP == "tanh":
        r = _tanh(a)
    elif OP == "gelu":  # 0.5 x (1 + erf(x / sqrt 2))
        r = 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476))
    elif OP == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        r = 0.5 * a * (1.0 + _tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)))
    elif OP == "mish":  # x tanh(log(1 + e^x))
        r = a * _tanh(_log1p(tl.exp(a)))
    elif OP == "hardswish":  # x min(max(x + 3, 0), 6) / 6
        r = a * tl.minimum(tl.maximum(a + 3.0, 0.0, propagate_nan=tl.PropagateNan.ALL), 6.0,
                           propagate_nan=tl.PropagateNan.ALL) / 6.0
    elif OP == "softsign":  # x / (1 + |x|)
        r = a / (1.0 + tl.abs(a))
    elif OP == "tanhshrink":  # x - tanh(x)
        r = a - _tanh(a)
    elif OP == "logsigmoid":  # min(x, 0) - log(1 + e^-|x|): no overflow for any x
        r = tl.minimum(a, 0.0, propagate_nan=tl.PropagateNan.ALL) - _log1p(tl.exp(-tl.abs(a)))
    elif OP == "erf":
        r = tl.erf(a)
    elif OP == "cos":
        r = tl.cos(a)
    elif OP == "sin":
        r = tl.sin(a)
    elif OP == "logical_not":
        r = a == 0
    elif OP == "bitwise_not":  # integers and bools (logical not)
        r = ~a
    elif OP == "isinf":
        r = (a == float("inf")) | (a == float("-inf"))
    elif OP == "isnan":
        r = a != a
    else:
        r = _binary_formula(a, b, c, OP, ALPHA)
    return r


@triton.jit
def _binary_formula(a, b, c, OP: tl.constexpr, ALPHA: tl.constexpr):
    """:func:`_formula` of the ops of two or three operands."""
    if OP == "add":  # a + alpha * b
        if ALPHA == 1:
            r = a + b
        else:
            r = a + ALPHA * b
    elif OP == "sub":  # a - alpha * b
        if ALPHA == 1:
            r = a - b
        else:
            r = a - ALPHA * b
    elif OP == "mul":
        r = a * b
    elif OP == "div":
        r = a / b
    elif OP == "div_floor":
        r = _div_floor(a, b)
    elif OP == "div_trunc":
        r = _div_trunc(a, b)
    elif OP == "remainder":  # Python's %: the sign of b
        r = _remainder(a, b)
    elif OP == "fmod":  # C's fmod: the sign of a
        r = a % _nonzero(a, b)
    elif OP == "pow":  # a ** b, b a scalar or tensor
        r = _pow(a, b)
    elif OP == "maximum":
        r = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    elif OP == "minimum":
        r = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
    elif OP == "eq":
        r = a == b
    elif OP == "ne":
        r = a != b
    elif OP == "lt":
        r = a < b
    elif OP == "le":
        r = a <= b
    elif OP == "gt":
        r = a > b
    elif OP == "ge":
        r = a >= b
    elif OP == "logical_and":
        r = (a != 0) & (b != 0)
    elif OP == "logical_or":
        r = (a != 0) | (b != 0)
    elif OP == "bitwise_and":
        r = a & b
    elif OP == "bitwise_or":
        r = a | b
    elif OP == "bitwise_xor":
        r = a ^ b
    elif OP == "leaky_relu":  # a > 0 ? a : a * b (PReLU's b is a per-channel tensor); NaN kept
        r = tl.where(a > 0, a, a * b)
    elif OP == "elu":  # a > 0 ? a : b * (e^a - 1), b = alpha
        r = tl.where(a > 0, a, b * _expm1(a))
    elif OP == "celu":  # a > 0 ? a : b * (e^(a / b) - 1), b = alpha
        r = tl.where(a > 0, a, b * _expm1(a / b))
    elif OP == "sigmoid_gate":  # a * sigmoid(a * b): swish (b = 1), CLIP's quick GELU (b = 1.702)
        r = a * tl.sigmoid(a * b)
    elif OP == "softplus":  # a > b ? a : log(1 + e^a), b = the threshold
        r = tl.where(a > b, a, _log1p(tl.exp(a)))
    elif OP == "hardshrink":  # -b <= a <= b ? 0 : a, b = lambda
        r = tl.where((a >= -b) & (a <= b), 0.0, a)
    elif OP == "softshrink":  # a > b ? a - b : a < -b ? a + b : a * 0 (-0.0 or NaN kept), b = lambda
        r = tl.where(a > b, a - b, tl.where(a < -b, a + b, a * 0.0))
    elif OP == "threshold_mark":  # a <= b ? -inf : a: threshold's first step (activations.py)
        r = tl.where(a <= b, float("-inf"), a)
    elif OP == "threshold_fill":  # a == -inf ? b : a: its second, b = the value
        r = tl.where(a == float("-inf"), b, a)
    elif OP == "clamp":  # min(max(a, b), c); a NaN in a or a bound gives NaN
        r = tl.minimum(tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL), c, propagate_nan=tl.PropagateNan.ALL)
    elif OP == "where":  # a ? b : c
        r = tl.where(a != 0, b, c)
    else:
        tl.static_assert(False, "unknown pointwise op")
    return r


@triton.jit
def unravel5(offs, d1, d2, d3, d4):
    """Flat row-major offsets -> 5-d indices, for sizes (any, d1, d2, d3, d4)."""
    i4 = offs % d4
    rest = offs // d4
    i3 = rest % d3
    rest = rest // d3
    i2 = rest % d2
    rest = rest // d2
    return rest // d1, rest % d1, i2, i3, i4


@triton.jit
def _operand(ptr, scalar, i0, i1, i2, i3, i4, s0, s1, s2, s3, s4, mask,
             IS_SCALAR: tl.constexpr, CT: tl.constexpr):
    if IS_SCALAR:  # a tile of the scalar, shaped like the mask (i0 may be a scalar: a matmul's batch)
        v = tl.zeros(mask.shape, dtype=tl.int1) | True
        v = tl.where(v, scalar, scalar)
    else:
        v = tl.load(ptr + i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3 + i4 * s4, mask=mask, other=0)
    if CT == "f32":
        v = v.to(tl.float32)
    elif CT == "i64":
        v = v.to(tl.int64)
    return v


@triton.jit
def pointwise_kernel(
    out_ptr, a_ptr, b_ptr, c_ptr,
    a_scalar, b_scalar, c_scalar,
    n, d1, d2, d3, d4,
    os0, os1, os2, os3, os4,
    as0, as1, as2, as3, as4,
    bs0, bs1, bs2, bs3, bs4,
    cs0, cs1, cs2, cs3, cs4,
    OP: tl.constexpr, ALPHA: tl.constexpr, NARGS: tl.constexpr,
    A_SCALAR: tl.constexpr, B_SCALAR: tl.constexpr, C_SCALAR: tl.constexpr,
    CT: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    i0, i1, i2, i3, i4 = unravel5(offs, d1, d2, d3, d4)
    a = _operand(a_ptr, a_scalar, i0, i1, i2, i3, i4, as0, as1, as2, as3, as4, mask, A_SCALAR, CT)
    b = a
    c = a
    if NARGS >= 2:
        b = _operand(b_ptr, b_scalar, i0, i1, i2, i3, i4, bs0, bs1, bs2, bs3, bs4, mask, B_SCALAR, CT)
    if NARGS >= 3:
        c = _operand(c_ptr, c_scalar, i0, i1, i2, i3, i4, cs0, cs1, cs2, cs3, cs4, mask, C_SCALAR, CT)
    r = _formula(a, b, c, OP, ALPHA)
    out_offs = i0 * os0 + i1 * os1 + i2 * os2 + i3 * os3 + i4 * os4
    tl.store(out_ptr + out_offs, r.to(out_ptr.dtype.element_ty), mask=mask)


# One step of a chain, also a matmul epilogue's (matmul.py): r = OP(r, p[i]), OP(p[i], r) or OP(r).
@triton.jit
def _chain_step(r, ptr, scalar, i0, i1, i2, i3, i4, s0, s1, s2, s3, s4, mask,
                OP: tl.constexpr, ARITY: tl.constexpr, SWAP: tl.constexpr, IS_SCALAR: tl.constexpr,
                CT: tl.constexpr):
    if ARITY == 1:
        r = _formula(r, r, r, OP, 1)
    else:
        v = _operand(ptr, scalar, i0, i1, i2, i3, i4, s0, s1, s2, s3, s4, mask, IS_SCALAR, CT)
        if SWAP:
            r = _formula(v, r, r, OP, 1)
        else:
            r = _formula(r, v, v, OP, 1)
    return r


# The epilogue of a GEMM-like kernel (matmul.py, conv.py) on its fp32 tile ``acc``: start from the
# result as eager stores it (rounded to ROUND_TO), then up to four chain steps in fp32. Operand k is
# addressed as ek_ptr + i0*eks0 + i1*eks1 + i2*eks2 + i3*eks3 + i4*eks4 (index tensors broadcast to the
# tile; a kernel that walks fewer dims passes literal zeros, which fold away).
@triton.jit
def _epilogue(acc, mask, i0, i1, i2, i3, i4,
              e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
              e0s0, e0s1, e0s2, e0s3, e0s4, e1s0, e1s1, e1s2, e1s3, e1s4,
              e2s0, e2s1, e2s2, e2s3, e2s4, e3s0, e3s1, e3s2, e3s3, e3s4,
              EPILOGUE: tl.constexpr, ROUND_TO: tl.constexpr,
              EOP0: tl.constexpr, EARITY0: tl.constexpr, ESWAP0: tl.constexpr, EIS_SCALAR0: tl.constexpr,
              EOP1: tl.constexpr, EARITY1: tl.constexpr, ESWAP1: tl.constexpr, EIS_SCALAR1: tl.constexpr,
              EOP2: tl.constexpr, EARITY2: tl.constexpr, ESWAP2: tl.constexpr, EIS_SCALAR2: tl.constexpr,
              EOP3: tl.constexpr, EARITY3: tl.constexpr, ESWAP3: tl.constexpr, EIS_SCALAR3: tl.constexpr):
    acc = round_as(acc, ROUND_TO)
    acc = _chain_step(acc, e0_ptr, e0_scalar, i0, i1, i2, i3, i4, e0s0, e0s1, e0s2, e0s3, e0s4, mask,
                      EOP0, EARITY0, ESWAP0, EIS_SCALAR0, "f32")
    if EPILOGUE >= 2:
        acc = _chain_step(acc, e1_ptr, e1_scalar, i0, i1, i2, i3, i4, e1s0, e1s1, e1s2, e1s3, e1s4, mask,
                          EOP1, EARITY1, ESWAP1, EIS_SCALAR1, "f32")
    if EPILOGUE >= 3:
        acc = _chain_step(acc, e2_ptr, e2_scalar, i0, i1, i2, i3, i4, e2s0, e2s1, e2s2, e2s3, e2s4, mask,
                          EOP2, EARITY2, ESWAP2, EIS_SCALAR2, "f32")
    if EPILOGUE >= 4:
        acc = _chain_step(acc, e3_ptr, e3_scalar, i0, i1, i2, i3, i4, e3s0, e3s1, e3s2, e3s3, e3s4, mask,
                          EOP3, EARITY3, ESWAP3, EIS_SCALAR3, "f32")
    return acc


# r = OP0(p0, p1); then per step k: r = OPk(r, p(k+1)), OPk(p(k+1), r) when SWAPk, OPk(r) when unary
@triton.jit
def pointwise_chain_kernel(
    out_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, p4_ptr,
    p0_scalar, p1_scalar, p2_scalar, p3_scalar, p4_scalar,
    n, d1, d2, d3, d4,
    os0, os1, os2, os3, os4,
    p0s0, p0s1, p0s2, p0s3, p0s4,
    p1s0, p1s1, p1s2, p1s3, p1s4,
    p2s0, p2s1, p2s2, p2s3, p2s4,
    p3s0, p3s1, p3s2, p3s3, p3s4,
    p4s0, p4s1, p4s2, p4s3, p4s4,
    OP0: tl.constexpr, ARITY0: tl.constexpr,
    OP1: tl.constexpr, ARITY1: tl.constexpr, SWAP1: tl.constexpr,
    OP2: tl.constexpr, ARITY2: tl.constexpr, SWAP2: tl.constexpr,
    OP3: tl.constexpr, ARITY3: tl.constexpr, SWAP3: tl.constexpr,
    NOPS: tl.constexpr,
    IS_SCALAR0: tl.constexpr, IS_SCALAR1: tl.constexpr, IS_SCALAR2: tl.constexpr,
    IS_SCALAR3: tl.constexpr, IS_SCALAR4: tl.constexpr,
    CT: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    i0, i1, i2, i3, i4 = unravel5(offs, d1, d2, d3, d4)
    a = _operand(p0_ptr, p0_scalar, i0, i1, i2, i3, i4, p0s0, p0s1, p0s2, p0s3, p0s4, mask, IS_SCALAR0, CT)
    r = _chain_step(a, p1_ptr, p1_scalar, i0, i1, i2, i3, i4, p1s0, p1s1, p1s2, p1s3, p1s4, mask,
                    OP0, ARITY0, False, IS_SCALAR1, CT)
    if NOPS >= 2:
        r = _chain_step(r, p2_ptr, p2_scalar, i0, i1, i2, i3, i4, p2s0, p2s1, p2s2, p2s3, p2s4, mask,
                        OP1, ARITY1, SWAP1, IS_SCALAR2, CT)
    if NOPS >= 3:
        r = _chain_step(r, p3_ptr, p3_scalar, i0, i1, i2, i3, i4, p3s0, p3s1, p3s2, p3s3, p3s4, mask,
                        OP2, ARITY2, SWAP2, IS_SCALAR3, CT)
    if NOPS >= 4:
        r = _chain_step(r, p4_ptr, p4_scalar, i0, i1, i2, i3, i4, p4s0, p4s1, p4s2, p4s3, p4s4, mask,
                        OP3, ARITY3, SWAP3, IS_SCALAR4, CT)
    out_offs = i0 * os0 + i1 * os1 + i2 * os2 + i3 * os3 + i4 * os4
    tl.store(out_ptr + out_offs, r.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------------
def compute_type(dtypes) -> str:
    if any(d.is_floating_point for d in dtypes):
        return "f32"
    if all(d == torch.bool for d in dtypes):
        return "i1"
    return "i64"


@dataclass(frozen=True)
class PointwiseOp:
    """What one ``pointwise`` launch computes (its ``LaunchRecord.op``), for ``fusion.py``."""

    op: str
    out: TRef
    operands: tuple  # TRef or Python scalar
    alpha: object
    compute: str


def _operand_args(out: TRef, operands, compute: str):
    """Kernel arguments for ``out`` and ``operands`` (TRef, Python scalar, or None for an unused slot)
    walked together over ``out``'s shape: (n, sizes d1..d4, out strides, pointers, scalars, operand
    strides, is-scalar flags), or None when the walk needs more than MAX_RANK dims."""
    shape = out.shape
    tensors = [o for o in operands if isinstance(o, TRef)]
    stride_sets = [out.strides] + [broadcast_strides(t, shape) for t in tensors]
    walk = collapse_padded(shape, stride_sets, MAX_RANK)
    if walk is None:
        return None
    sizes, strides = walk
    out_strides, tensor_strides = strides[0], iter(strides[1:])
    ptrs, scalars, operand_strides, flags = [], [], [], []
    for o in operands:
        if isinstance(o, TRef):
            ptrs.append(o)
            scalars.append(0)
            operand_strides.extend(next(tensor_strides))
            flags.append(False)
        else:
            ptrs.append(out)  # never read: the operand is a scalar, or the slot is unused
            if o is not None and not size_fns.is_static(o):
                scalars.append(size_fns.size(o))  # an integer size, converted to CT in the kernel
            else:
                scalars.append(0 if o is None else float(o) if compute == "f32" else int(o))
            operand_strides.extend([0] * MAX_RANK)
            flags.append(o is not None)
    return math.prod(shape), sizes[1:], out_strides, ptrs, scalars, operand_strides, flags


def launch_pointwise(b, op: str, out: TRef, operands, alpha=1, compute: str | None = None) -> None:
    """Launch ``out = op(*operands)``; each operand a TRef or a Python scalar."""
    if compute is None:
        dtypes = [o.dtype for o in operands if isinstance(o, TRef)] + [out.dtype] * (op in {"copy"})
        if any(isinstance(o, float) for o in operands):
            dtypes.append(torch.float32)
        if op in {"div", "pow", "exp", "expm1", "log", "log1p", "sqrt", "rsqrt", "sigmoid", "silu", "tanh", "gelu",
                  "gelu_tanh", "cos", "sin", "reciprocal", "mish", "hardswish", "leaky_relu", "elu", "celu",
                  "softplus", "sigmoid_gate", "erf", "softsign", "tanhshrink", "logsigmoid", "hardshrink",
                  "softshrink", "threshold_mark", "threshold_fill"}:
            dtypes.append(torch.float32)
        if op == "where":
            dtypes = dtypes[1:] if len(dtypes) > 1 else dtypes
        compute = compute_type(dtypes)
    record = _launch_walk(b, op, out, operands, alpha, compute)
    if record is not None and size_fns.is_static([o for o in operands if not isinstance(o, TRef)]):
        record.op = PointwiseOp(op, out, tuple(operands), alpha, compute)


MAX_PEELED = 256  # launches one pointwise op may split into


def _launch_walk(b, op: str, out: TRef, operands, alpha, compute: str, budget: int = MAX_PEELED):
    """One ``pointwise`` launch of ``out = op(*operands)`` (its record), or, when the walk needs more
    dims than a launch takes, the launches of :func:`_peeled` (None: no record to fuse)."""
    walk = _operand_args(out, list(operands) + [0] * (3 - len(operands)), compute)
    if walk is None:
        _peeled(b, op, out, operands, alpha, compute, budget)
        return None
    n, sizes, out_strides, ptrs, scalars, strides, flags = walk
    return b.launch(
        "pointwise", (triton.cdiv(n, BLOCK),),
        out, *ptrs, *scalars,
        n, *sizes, *out_strides, *strides,
        OP=op, ALPHA=alpha, NARGS=len(operands), A_SCALAR=flags[0], B_SCALAR=flags[1], C_SCALAR=flags[2],
        CT=compute, BLOCK=BLOCK,
    )


def _peeled(b, op: str, out: TRef, operands, alpha, compute: str, budget: int) -> None:
    """``out = op(*operands)`` over more dims than one launch walks (a 6-D permuted copy: Hiera's
    unrolling): one launch per index of the outermost static dim of size > 1 (a dynamic batch stays
    walked), each over the rest, split again as needed, at most ``budget`` launches in all."""
    shape = out.shape
    dim = next((d for d, n in enumerate(shape) if size_fns.is_static(n) and n > 1), None)
    if dim is None or shape[dim] > budget:
        raise NotImplementedError(f"pointwise op over more than {MAX_RANK} non-mergeable dims of {shape}")
    rest = tuple(shape[:dim]) + tuple(shape[dim + 1:])

    def part(ref, i):
        strides = broadcast_strides(ref, shape)
        return b.view(ref, rest, strides[:dim] + strides[dim + 1:], ref.offset + i * strides[dim])

    for i in range(shape[dim]):  # a part's record is not offered to fusion: it writes part of out
        _launch_walk(b, op, part(out, i), [part(o, i) if isinstance(o, TRef) else o for o in operands], alpha,
                     compute, budget // shape[dim])


def epilogue_args(out: TRef, steps, operands, dims: int, round_to: str) -> tuple[list, dict]:
    """A GEMM-like kernel's epilogue arguments (``_epilogue``; conv.py, grouped_mm.py): the operands'
    pointers, scalars and strides over ``dims`` output coordinates (``out`` stands in for a scalar or
    absent operand, never read), and the constexprs of ``steps`` ((op, arity, swap)), none without
    steps. Each operand is a (TRef, its strides) pair, a Python scalar, or None where the step is unary."""
    ptrs, scalars, strides = [], [], []
    for operand in list(operands) + [None] * (MAX_CHAIN - len(operands)):
        tensor = isinstance(operand, tuple)
        ptrs.append(operand[0] if tensor else out)
        scalars.append(0.0 if tensor or operand is None else float(operand))
        strides.extend(operand[1] if tensor else (0,) * dims)
    constexprs = {}
    if steps:
        padded = list(zip(steps, operands)) + [(("copy", 1, False), None)] * (MAX_CHAIN - len(steps))
        for k, ((name, arity, swap), operand) in enumerate(padded):
            constexprs.update({f"EOP{k}": name, f"EARITY{k}": arity, f"ESWAP{k}": swap,
                               f"EIS_SCALAR{k}": operand is not None and not isinstance(operand, tuple)})
        constexprs.update(EPILOGUE=len(steps), ROUND_TO=round_to)
    return ptrs + scalars + strides, constexprs


def chain_launch(out: TRef, steps, slots, compute: str):
    """The arguments of a ``pointwise_chain`` launch: (grid, args, constexprs), or None when its
    operands cannot be walked in MAX_RANK dims.

    ``steps`` are (op, arity, swap) with 1 <= len(steps) <= MAX_CHAIN; ``slots`` has len(steps) + 1
    entries: the first op's two operands, then one per further op (None where the op is unary)."""
    walk = _operand_args(out, list(slots) + [None] * (MAX_CHAIN + 1 - len(slots)), compute)
    if walk is None:
        return None
    n, sizes, out_strides, ptrs, scalars, strides, flags = walk
    padded = list(steps) + [("copy", 1, False)] * (MAX_CHAIN - len(steps))
    constexprs = {"OP0": padded[0][0], "ARITY0": padded[0][1]}
    for i, (op, arity, swap) in enumerate(padded[1:], start=1):
        constexprs.update({f"OP{i}": op, f"ARITY{i}": arity, f"SWAP{i}": swap})
    constexprs["NOPS"] = len(steps)
    constexprs.update({f"IS_SCALAR{k}": flag for k, flag in enumerate(flags)})
    constexprs.update(CT=compute, BLOCK=BLOCK)
    args = [out, *ptrs, *scalars, n, *sizes, *out_strides, *strides]
    return (triton.cdiv(n, BLOCK),), args, constexprs


# --- support checks and lowerings -----------------------------------------------------------------
DTYPES = FLOAT_DTYPES + (torch.int64, torch.int32, torch.bool)


def _tensor_args(node):
    return [a for a in node.args if hasattr(a, "meta") and not is_size_node(a)]


def supported(node) -> str | None:
    """None when every tensor in and out has a supported dtype, else the reason. Size nodes may
    stand for scalar operands."""
    vals = [node.meta.get("val")] + [a.meta.get("val") for a in _tensor_args(node)]
    for v in vals:
        if not isinstance(v, torch.Tensor):
            if isinstance(v, (torch.SymFloat, torch.SymBool)):
                return f"a {type(v).__name__} operand (a non-integer value computed from dynamic sizes)"
            return "output or operand is not a tensor"
        if v.dtype not in DTYPES:
            return f"dtype {v.dtype} is not supported (supported: {', '.join(map(str, DTYPES))})"
    return None


def supported_float(node) -> str | None:
    reason = supported(node)
    if reason is None and node.meta["val"].dtype not in FLOAT_DTYPES:
        return f"output dtype {node.meta['val'].dtype} is not floating point"
    return reason


def operand(b, arg):
    """A node argument as a pointwise operand: a TRef, a Python scalar, or a size (a size node)."""
    if is_size_node(arg):
        return b.size(arg)
    return b.ref(arg) if hasattr(arg, "meta") else arg


def _operands(b, node, count):
    return [operand(b, a) for a in node.args[:count]]


def unary(op):
    def lower(b, node):
        launch_pointwise(b, op, b.out(node), _operands(b, node, 1))

    return lower


def binary(op):
    def lower(b, node):
        alpha = node.kwargs.get("alpha", 1)
        launch_pointwise(b, op, b.out(node), _operands(b, node, 2), alpha=alpha)

    return lower


def div_mode(b, node):
    """div.Tensor_mode / div.Scalar_mode(a, b, *, rounding_mode): true, floor or trunc division."""
    op = {None: "div", "floor": "div_floor", "trunc": "div_trunc"}[node.kwargs.get("rounding_mode")]
    launch_pointwise(b, op, b.out(node), _operands(b, node, 2))


def supported_div_mode(node) -> str | None:
    mode = node.kwargs.get("rounding_mode")
    if mode not in (None, "floor", "trunc"):
        return f"rounding_mode {mode!r} is not one of None, 'floor', 'trunc'"
    return supported_numeric(node)


def supported_integer(node) -> str | None:
    """:func:`supported`, for integer and bool tensors only (bitwise ops)."""
    reason = supported(node)
    if reason is None and any(a.meta["val"].dtype.is_floating_point for a in [node] + _tensor_args(node)):
        return "a floating-point tensor (bitwise ops take integers and bools)"
    return reason


def supported_numeric(node) -> str | None:
    """:func:`supported`, and no bool tensor (integer division and remainders of bools are errors)."""
    reason = supported(node)
    if reason is None and any(a.meta["val"].dtype == torch.bool for a in _tensor_args(node)):
        return "a bool operand (division and remainders take numbers)"
    return reason


def rsub(b, node):  # rsub(a, b, alpha) = b - alpha * a
    x, y = _operands(b, node, 2)
    launch_pointwise(b, "sub", b.out(node), [y, x], alpha=node.kwargs.get("alpha", 1))


def pow_scalar_base(b, node):  # pow(scalar, tensor)
    base = operand(b, node.args[0])
    launch_pointwise(b, "pow", b.out(node), [float(base) if size_fns.is_static(base) else base,
                                             b.ref(node.args[1])])


def where(b, node):
    launch_pointwise(b, "where", b.out(node), _operands(b, node, 3))


def _clamp(b, node, x: TRef, low, high) -> None:
    """out = minimum(maximum(x, low), high), each step NaN-propagating and skipped when its bound is
    None: two launches that fusion merges into one chain (or into a GEMM's epilogue)."""
    out = b.out(node)
    steps = [(op, bound) for op, bound in (("maximum", low), ("minimum", high)) if bound is not None]
    if not steps:
        launch_pointwise(b, "copy", out, [x])
        return
    value = x
    for k, (op, bound) in enumerate(steps):
        dst = out if k == len(steps) - 1 else b.alloc(out.shape, out.dtype)
        launch_pointwise(b, op, dst, [value, operand(b, bound)])
        value = dst


def clamp(b, node):
    """clamp(x, min=None, max=None), clamp_min, clamp_max; bounds are scalars or tensors."""
    names = {"clamp_min": ("min",), "clamp_max": ("max",)}.get(node.target._opname, ("min", "max"))
    bounds = dict(zip(names, node.args[1:]))
    bounds.update({k: v for k, v in node.kwargs.items() if k in ("min", "max")})
    _clamp(b, node, b.ref(node.args[0]), bounds.get("min"), bounds.get("max"))


def hardtanh(b, node):
    """hardtanh(x, min_val=-1, max_val=1) (ReLU6 is hardtanh(x, 0, 6)): a clamp."""
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", 1.0)
    _clamp(b, node, b.ref(node.args[0]), low, high)


def gelu(b, node):
    op = "gelu_tanh" if node.kwargs.get("approximate", "none") == "tanh" else "gelu"
    launch_pointwise(b, op, b.out(node), [b.ref(node.args[0])])


def copy(b, node):
    """clone / _to_copy / to: a cast and copy into a fresh contiguous tensor. A ``clone`` of a
    contiguous temporary of this delegate is that temporary: no launch (``.contiguous()`` of an
    attention output the kernel already stored in that layout). Nothing can tell them apart: the graph
    is functional, and in-place updates write delegate inputs only."""
    src = b.ref(node.args[0])
    val = node.meta.get("val")
    if (node.target is torch.ops.aten.clone.default and isinstance(val, torch.Tensor) and val.is_contiguous()
            and b.is_scratch(src) and src.is_contiguous() and src.dtype == val.dtype):
        b.alias(node, src)
        return
    launch_pointwise(b, "copy", b.out(node), [src])


def supported_copy(node) -> str | None:
    reason = supported(node)
    if reason:
        return reason
    device = node.kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return f"copies to device {device} stay on the host"
    return None
