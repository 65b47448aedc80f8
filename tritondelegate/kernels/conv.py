"""Convolution (``aten.convolution.default``, N C [D] H W, what ``nn.Conv2d``, ``nn.Conv3d`` and their
transposes export to; 1-D ones run as 2-D over a height of 1) as an implicit GEMM. For each group g, with
Cg = C_in / groups input and Og = C_out / groups output channels:

    out[n, g*Og + o, od, oh, ow] = bias[g*Og + o] + sum_k A[m, k] * B[k, o]
        m = (n, od, oh, ow)                   M = N * OD * OH * OW
        k = (ci, kd, kh, kw)                  K = Cg * KD * KH * KW   (the weight's own layout)
        A[m, k] = x[n, g*Cg + ci, od*sd - pd + kd*dd, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw]  (0 in the padding)
        B[k, o] = weight[g*Og + o, ci, kd, kh, kw]                  (weight [C_out, Cg, KD, KH, KW])

A 2-D convolution is the same without the depth (od, kd): the kernel's DEPTH constexpr is False, KD is 1
and no depth term is computed at all, so 2-D and 1-D convolutions compile to the instructions (and, their
arguments in the same places, the registers: scripts/compile_check.py) they had before 3-D ones existed.
(Their PTX is still that; since the K walk moved into helpers, whose line info ptxas reads, one of
compile_check's 2-D variants gets 42 registers where it had 46.)
A 3-D one of kernel depth 1 (a (1, 3, 3) "pseudo-3-D" conv) still walks od (DEPTH).

A transposed convolution (``transposed=True``: the gradient of a convolution with respect to its input)
scatters each input pixel over a KD x KH x KW window of the output, which read from the output's side is
the same sum over other taps:

        A[m, k] = x[n, g*Cg + ci, id, ih, iw]   where ih = (oh + ph - kh*dh) / sh is an integer in [0, H)
                                                (and id, iw likewise; 0 elsewhere)
        B[k, o] = weight[g*Cg + ci, o, kd, kh, kw]                  (weight [C_in, Og, KD, KH, KW])

``output_padding`` only adds rows and columns to the output's size (taken from the output tensor). The
weight is addressed per group through ``ws_g`` (Og * its dim-0 stride, or for a transposed one Cg * its
dim-0 stride) so one formula reads both layouts: w_ptr + g*ws_g + o*ws_o + ci*ws_i + kd*ws_d + kh*ws_h
+ kw*ws_w.

Of dilation 1 on every dim (nearly every model's: a UNet's, a VAE decoder's or a DCGAN's upsampling, a
vocoder's), the kernel walks only the exact taps, by stride phase (PHASED, ``_phase_rows`` and
``_phase_walk``). The output pixels with oh = oh0 + j*sh, oh0 < sh (likewise d and w) form a phase: they
share the residue rh = (oh0 + ph) % sh, so their exact taps are the same, kh = rh + th*sh < KH for th <
cdiv(KH - rh, sh), read at ih = (oh + ph) // sh - th. A program takes BLOCK_M pixels of one phase (grid
axis 0: tile * phases + phase, phases = sd*sh*sw, tiles of the largest phase's cdiv(OD, sd) *
cdiv(OH, sh) * cdiv(OW, sw) pixels per image; a smaller phase's rows past its end are masked) and walks
per tap of its phase its Cg input channels: K = Cg * (its taps), a dense GEMM with nothing masked but the
input's bounds, where walking every tap did sd*sh*sw times the multiply-adds that contribute (a DCGAN k4
s2 layer or a UNet k2 s2 one 4x, a 3-D k2 s2 one 8x, a HiFi-GAN k16 s8 one 8x). A phase with no taps
(KH < sh) walks none: its outputs get the bias (and the epilogue) only. A tap whose input falls outside
x (ih < 0 or >= H: outputs at the borders) is still walked, masked: a 0 times its weight. So a
non-finite weight (inf, NaN) still gives NaN at those border outputs, where eager (whose col2im adds
only the products of real input pixels) stays finite; every other output adds exactly the products
eager adds (an inf weight in a tap whose inputs all exist gives inf where eager's does and leaves the
other phases finite), and non-finite inputs propagate as in eager. The phase's pixels lie sw apart in
the output: its stores are strided (and a transposed 3-D program takes at most 32 rows:
``ConvOp._blocks``).

A dilated transposed convolution (rare) walks every tap and masks those that are not exact, sd*sh*sw
times the multiply-adds that contribute; a masked tap multiplies a 0 by its weight, so there a
non-finite weight gives NaN at every output where its tap is not real. The exactness test needs no
division of negatives: with t = oh + ph >= 0 and d = kh*dh >= 0, t - d is a multiple of sh exactly when
t % sh == d % sh, and then ih = t // sh - d // sh (``_rows`` and ``_taps``).

An epilogue (``fusion.py`` folds the pointwise chain that alone reads the result into it, as for
matmuls: an activation, a residual add) runs on the tile before the store, with the steps of
``elementwise._epilogue``: each operand Ek is addressed by its own strides over the output's dims
((n, c, h, w), or (n, c, d, h, w); 0 where it broadcasts) or is a scalar; the result goes to the chain's
output, and the convolution's own result is never stored.

A 2-D convolution may store a max or average pooling of its result instead (``fuse_pool.py``; POOL_KH,
POOL_KW > 0, neither PHASED nor DEPTH): its rows are then the pooled pixels (n, ph, pw), and for each tap
(th, tw) of their windows it computes, with bias and epilogue, the output pixels (ph * pool_sh - pool_ph +
th, pw * pool_sw - pool_pw + tw), taking the running maximum (NaN wins) or sum of those inside the output
(``_pool_into``). A pixel shared by overlapping windows is computed once per window; the full-size result
is never stored.

A is never materialized: each program gathers its [BLOCK_M, BLOCK_K] tile of A straight from x with
masked loads (the mask is the zero padding), so x, weight and out may have any strides (a permuted
NHWC input needs no copy). K runs over (ci, kd, kh, kw) flattened, which keeps the tile dense when Cg is
small (a 3-channel stem or tubelet embedding). A convolution with one input channel per group (a
depthwise one) launches ``depthwise.py``'s direct convolution instead (:class:`ConvOp` ``kernel``): here
it would pay for a 16-wide dot per output channel (tl.dot needs every dimension >= 16). A PHASED one
steps over Cg per tap instead (the row part of an address is the program's, the tap's a scalar), so a
Cg below BLOCK_K leaves part of the tile empty (transposed convolutions with so few input channels per
group are rare).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import elementwise as ew
from .elementwise import _epilogue
from .pool import Pooling
from ..dtypes import dtype_name
from .refs import TRef, node_value
from .sizes import next_power_of_2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The K step (at most; less when C_in * KD * KH * KW is smaller). fp32 takes 16: its IEEE dots run on the
# FMA units, and a K step of 32 next to the gathered A tile's int64 index math spilled on sm_90
# (scripts/compile_check.py, 8 warps): 64x32 3x3 with a ReLU epilogue 255 registers and 32 bytes of
# stack (106 registers and none at 16), 64x64 1x1 255 and 16 bytes (188 and none at 16). fp16/bf16
# (tensor-core dots, 206 registers at most for 64x32x32) keep 32.
K_STEP = 32
FP32_K_STEP = 16


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _rows(o, stride, pad, TRANSPOSED: tl.constexpr):
    """Per output coordinate ``o`` [BLOCK_M], what its taps share: the input coordinate of tap 0 (and of
    a transposed conv, the residue mod stride that its exact taps share; o + pad >= 0, so // and % see no
    negatives)."""
    if TRANSPOSED:
        base, residue = (o + pad) // stride, (o + pad) % stride
    else:
        base, residue = o * stride - pad, 0  # every tap is exact: no residue to compare
    return base, residue


@triton.jit
def _taps(base, residue, tap, size, stride, TRANSPOSED: tl.constexpr):
    """The input coordinates that rows of ``_rows`` read at tap offsets ``tap`` (k * dil >= 0, [BLOCK_K]),
    [BLOCK_M, BLOCK_K], and where they are real: in [0, size), and for a transposed conv exact
    ((o + pad - tap) / stride, an integer when tap % stride is the row's residue)."""
    if TRANSPOSED:
        i = base[:, None] - (tap // stride)[None, :]
        real = (residue[:, None] == (tap % stride)[None, :]) & (i >= 0) & (i < size)
    else:
        i = base[:, None] + tap[None, :]
        real = (i >= 0) & (i < size)
    return i, real


@triton.jit
def _coords(offs_m, OD, OH, OW, DEPTH: tl.constexpr):
    """(n, od, oh, ow) of flat output pixels m = ((n * OD + od) * OH + oh) * OW + ow; without DEPTH
    m = (n * OH + oh) * OW + ow and od is 0 (a constant: terms in it vanish)."""
    ow = offs_m % OW
    rest = offs_m // OW
    oh = rest % OH
    n = rest // OH
    od = 0
    if DEPTH:
        od = n % OD
        n = n // OD
    return n, od, oh, ow


@triton.jit
def _phase_rows(pid, M, OD, OH, OW, sd, sh, sw, BLOCK_M: tl.constexpr, DEPTH: tl.constexpr):
    """The rows of a PHASED program ``pid`` = tile * phases + phase (phases = sd * sh * sw): phase p's
    outputs start at (od0, oh0, ow0) < (sd, sh, sw) (p = (od0 * sh + oh0) * sw + ow0) and step by the
    stride; flat j = ((n * ODP + jd) * OHP + jh) * OWP + jw over the largest phase's counts (ODP, OHP,
    OWP) = cdiv((OD, OH, OW), stride), tile ``tile`` of them. Returns (n, od, oh, ow, mask: the real
    output pixels among them, (od0, oh0, ow0))."""
    phases = sh * sw
    if DEPTH:
        phases *= sd
    p = (pid % phases).to(tl.int32)  # scalars of the phase in int32 (its loops: int32 induction variables)
    n, jd, jh, jw = _coords((pid // phases) * BLOCK_M + tl.arange(0, BLOCK_M),
                            (OD + sd - 1) // sd, (OH + sh - 1) // sh, (OW + sw - 1) // sw, DEPTH)
    od0, oh0, ow0 = p // (sw * sh), (p // sw) % sh, p % sw  # od0 0 without DEPTH (p < sh * sw)
    oh, ow = oh0 + jh * sh, ow0 + jw * sw
    if DEPTH:
        od = od0 + jd * sd
        mask = (n < M // (OD * OH * OW)) & (od < OD) & (oh < OH) & (ow < OW)
    else:
        od = 0
        mask = (n < M // (OH * OW)) & (oh < OH) & (ow < OW)
    return n, od, oh, ow, mask, od0, oh0, ow0


@triton.jit
def _phase_walk(acc, x_rows, mask_m, w_cols, mask_n, od, oh, ow, od0, oh0, ow0, D, H, W, CIN_G,
                xs_c, xs_d, xs_h, xs_w, ws_i, ws_d, ws_h, ws_w, sd, sh, sw, pd, ph, pw,
                KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, BLOCK_K: tl.constexpr,
                DEPTH: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """acc + the K walk of a PHASED program's rows, which share their phase (first row (od0, oh0, ow0),
    residues (rd, rh, rw) = ((od0, oh0, ow0) + pad) % stride): its taps (kd, kh, kw) = (rd + td*sd,
    rh + th*sh, rw + tw*sw) < (KD, KH, KW) (none: acc as it is), each read at ih = (oh + ph) // sh - th
    (likewise d, w; masked outside the input), and per tap its Cg input channels in steps of BLOCK_K."""
    rh, rw = (oh0 + ph) % sh, (ow0 + pw) % sw
    taps_h, taps_w = (KH + sh - 1 - rh) // sh, (KW + sw - 1 - rw) // sw  # cdiv(KH - rh, sh), rh < sh
    # the rows' tap-0 inputs, int32 (a masked row's ih0 -1: no tap real), and x at them ([BLOCK_M] pointers)
    ih0 = tl.where(mask_m, (oh + ph) // sh, -1).to(tl.int32)
    iw0 = ((ow + pw) // sw).to(tl.int32)
    rows = x_rows + ih0.to(tl.int64) * xs_h + iw0.to(tl.int64) * xs_w
    taps = taps_h * taps_w
    if DEPTH:
        rd = (od0 + pd) % sd
        taps_d, id0 = (KD + sd - 1 - rd) // sd, ((od + pd) // sd).to(tl.int32)
        taps *= taps_d
        rows += id0.to(tl.int64) * xs_d
    steps = (CIN_G + BLOCK_K - 1) // BLOCK_K  # channel steps per tap
    for i in range(0, taps * steps):  # i = t * steps + channel step, t = (td * taps_h + th) * taps_w + tw
        t = i // steps
        th, tw = (t // taps_w) % taps_h, t % taps_w
        real = (ih0 >= th) & (ih0 - th < H) & (iw0 >= tw) & (iw0 - tw < W)
        x_tap = th.to(tl.int64) * xs_h + tw.to(tl.int64) * xs_w  # x at the tap: rows - x_tap
        w_tap = (rh + th * sh).to(tl.int64) * ws_h + (rw + tw * sw).to(tl.int64) * ws_w
        if DEPTH:
            td = t // (taps_w * taps_h)
            real = real & (id0 >= td) & (id0 - td < D)
            x_tap += td.to(tl.int64) * xs_d
            w_tap += (rd + td * sd).to(tl.int64) * ws_d
        ci = (i - t * steps) * BLOCK_K + tl.arange(0, BLOCK_K)
        c_real = ci < CIN_G
        ci = ci.to(tl.int64)
        a = tl.load(rows[:, None] + (ci * xs_c - x_tap)[None, :], mask=real[:, None] & c_real[None, :], other=0.0)
        bt = tl.load(w_cols[None, :] + (ci * ws_i + w_tap)[:, None], mask=c_real[:, None] & mask_n[None, :],
                     other=0.0)
        acc = _dot(acc, a, bt, DOT_UPCAST)
    return acc


@triton.jit
def _tile_pixels(pid, M, OD, OH, OW, BLOCK_M: tl.constexpr, DEPTH: tl.constexpr):
    """The rows of program ``pid`` (not PHASED): flat output pixels [pid * BLOCK_M, + BLOCK_M) < M, as
    (n, od, oh, ow) (``_coords``) and their mask."""
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    n, od, oh, ow = _coords(offs_m, OD, OH, OW, DEPTH)
    return n, od, oh, ow, offs_m < M


@triton.jit
def _columns(pid_n, g, COUT_G, w_ptr, ws_g, ws_o, BLOCK_N: tl.constexpr):
    """The columns of program (pid_n, group g): their mask (< COUT_G), absolute output channels (int64)
    and weight pointers ([BLOCK_N])."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_n < COUT_G, g * COUT_G + offs_n, w_ptr + g * ws_g + offs_n.to(tl.int64) * ws_o


@triton.jit
def _pool_tap(ph, pw, t, mask_m, OH, OW, pool_sh, pool_sw, pool_ph, pool_pw, POOL_KW: tl.constexpr):
    """The convolution's output pixels (oh, ow) that tap ``t`` (th * POOL_KW + tw) of the pooling windows of
    pooled pixels (ph, pw) reads, and which of them are real (inside the convolution's output:
    a window's padding never wins)."""
    oh = ph * pool_sh - pool_ph + t // POOL_KW
    ow = pw * pool_sw - pool_pw + t % POOL_KW
    return oh, ow, mask_m & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)


@triton.jit
def _pool_into(best, acc, real, POOL_KH: tl.constexpr, POOL: tl.constexpr):
    """A pooling window's running value after a tap's pixels of value ``acc``, those inside the output
    ``real`` (without pooling, POOL_KH 0: ``acc`` itself). "max": the maximum, a NaN staying once seen
    (eager's max pooling propagates it), the padding never winning. "avg": the sum of the real taps."""
    if POOL_KH == 0:
        best = acc
    elif POOL == "max":
        v = tl.where(real[:, None], acc, float("-inf"))
        best = tl.where((v > best) | (v != v), v, best)
    else:
        best += tl.where(real[:, None], acc, 0.0)
    return best


@triton.jit
def _gather(x_rows, mask_m, offs_k, K, id0, d_res, ih0, h_res, iw0, w_res, D, H, W,
            xs_c, xs_d, xs_h, xs_w, ws_i, ws_d, ws_h, ws_w, sd, sh, sw, dil_d, dil_h, dil_w,
            KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, TRANSPOSED: tl.constexpr, DEPTH: tl.constexpr):
    """Step ``offs_k`` of the K walk over k = (ci, kd, kh, kw), (Cg, KD, KH, KW): the A tile [BLOCK_M,
    BLOCK_K] gathered from x at the rows' taps (``_rows``' tap-0 inputs and residues; 0 where a tap is not
    real), and the taps' weight offsets (from group g's output channel 0) and mask [BLOCK_K]."""
    mask_k = offs_k < K
    ci = (offs_k // (KD * KH * KW)).to(tl.int64)
    kh = (offs_k // KW) % KH
    kw = offs_k % KW
    ih, h_real = _taps(ih0, h_res, kh * dil_h, H, sh, TRANSPOSED)
    iw, w_real = _taps(iw0, w_res, kw * dil_w, W, sw, TRANSPOSED)
    a_mask = mask_m[:, None] & mask_k[None, :] & h_real & w_real
    a_ptrs = x_rows[:, None] + ci[None, :] * xs_c + ih * xs_h + iw * xs_w
    if DEPTH:  # tap kd of k = (ci, kd, kh, kw)
        kd = (offs_k // (KH * KW)) % KD
        i_d, d_real = _taps(id0, d_res, kd * dil_d, D, sd, TRANSPOSED)
        a_mask = a_mask & d_real
        a_ptrs += i_d * xs_d
    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    w_offs = ci * ws_i + kh * ws_h + kw * ws_w
    if DEPTH:
        w_offs += kd * ws_d
    return a, w_offs, mask_k


@triton.jit
def _window_extent(p, stride, pad, size, K: tl.constexpr, POOL_COUNT_PAD: tl.constexpr):
    """Along one dim, the taps of pooled pixels ``p``'s windows that an average counts: those in the
    window clipped to the padded output (POOL_COUNT_PAD: eager's count_include_pad), or to the output."""
    start = p * stride - pad
    if POOL_COUNT_PAD:
        return tl.minimum(start + K, size + pad) - start
    return tl.minimum(start + K, size) - tl.maximum(start, 0)


@triton.jit
def _pooled(result, ph, pw, OH, OW, pool_sh, pool_sw, pool_ph, pool_pw, pool_div, POOL_KH: tl.constexpr,
            POOL_KW: tl.constexpr, POOL: tl.constexpr, POOL_COUNT_PAD: tl.constexpr):
    """A pooling's value: the maximum as it is; a sum divided by divisor_override (``pool_div`` > 0) or
    by the window's taps that eager counts (at least 1 in a real row)."""
    if POOL == "avg":
        count = (_window_extent(ph, pool_sh, pool_ph, OH, POOL_KH, POOL_COUNT_PAD)
                 * _window_extent(pw, pool_sw, pool_pw, OW, POOL_KW, POOL_COUNT_PAD))
        divisor = tl.where(pool_div > 0, pool_div, tl.maximum(count, 1)).to(tl.float32)
        result = result / divisor[:, None]
    return result


@triton.jit
def _epilogue_index(od, oh, ow, DEPTH: tl.constexpr):
    """The third to fifth indices of an epilogue operand over the output's dims: (h, w, 0) in 2-D (the
    fifth's 0 strides fold away), (d, h, w) in 3-D."""
    i2, i3, i4 = oh[:, None], ow[:, None], 0
    if DEPTH:
        i2, i3, i4 = od[:, None], oh[:, None], ow[:, None]
    return i2, i3, i4


@triton.jit
def _walk(acc, x_rows, mask_m, w_cols, mask_n, od, oh, ow, D, H, W, CIN_G,
          xs_c, xs_d, xs_h, xs_w, ws_i, ws_d, ws_h, ws_w, sd, sh, sw, pd, ph, pw, dil_d, dil_h, dil_w,
          KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSED: tl.constexpr,
          DEPTH: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """acc + the K walk of a program (not PHASED) over output pixels (od, oh, ow): K = Cg * KD * KH * KW in
    steps of BLOCK_K (``_gather``), from what each row's taps share (``_rows``)."""
    id0, d_res = oh, oh  # without DEPTH: stand-ins for the absent depth, never read
    if DEPTH:
        id0, d_res = _rows(od, sd, pd, TRANSPOSED)
    ih0, h_res = _rows(oh, sh, ph, TRANSPOSED)
    iw0, w_res = _rows(ow, sw, pw, TRANSPOSED)
    K = CIN_G * KD * KH * KW
    for k0 in range(0, K, BLOCK_K):
        a, w_offs, mask_k = _gather(x_rows, mask_m, k0 + tl.arange(0, BLOCK_K), K, id0, d_res, ih0, h_res, iw0,
                                    w_res, D, H, W, xs_c, xs_d, xs_h, xs_w, ws_i, ws_d, ws_h, ws_w, sd, sh, sw,
                                    dil_d, dil_h, dil_w, KD, KH, KW, TRANSPOSED, DEPTH)
        bt = tl.load(w_cols[None, :] + w_offs[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(acc, a, bt, DOT_UPCAST)
    return acc


@triton.jit
def _dot(acc, a, bt, DOT_UPCAST: tl.constexpr):
    """acc + a @ bt in fp32."""
    if DOT_UPCAST:  # the Triton interpreter computes low-precision dots wrongly
        acc = tl.dot(a.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
    elif a.dtype == tl.float32:  # "ieee": full fp32 products, as eager computes them (no TF32)
        acc = tl.dot(a, bt, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, bt, acc)
    return acc


@triton.jit
def conv2d_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, H, W, OH, OW, CIN_G, COUT_G,
    xs_n, xs_c, xs_h, xs_w,
    ws_g, ws_o, ws_i, ws_h, ws_w,
    os_n, os_c, os_h, os_w,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    # epilogue operands per step k < EPILOGUE: pointer, scalar, strides over the output's (n, c, h, w) or
    # (n, c, d, h, w) (else stand-ins): eks0..eks3 here, eks4 last with the depth's arguments, so that a
    # 2-D launch's arguments keep the places (and its code the registers) they had before 3-D existed
    e0_ptr, e1_ptr, e2_ptr, e3_ptr,
    e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e0s3, e1s0, e1s1, e1s2, e1s3,
    e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3,
    D, OD, xs_d, ws_d, os_d, stride_d, pad_d, dil_d, e0s4, e1s4, e2s4, e3s4,
    # a pooling of the result (POOL_KH > 0): the pooled size, the window's stride and padding, an average's
    # divisor_override (0: none)
    POH, POW, pool_sh, pool_sw, pool_ph, pool_pw, pool_div,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr, TRANSPOSED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_UPCAST: tl.constexpr,
    DEPTH: tl.constexpr = False,  # 3-D: x and out have a depth (D, OD); else every depth term is absent
    PHASED: tl.constexpr = False,  # transposed, dilation 1: by stride phase (the module docstring)
    POOL_KH: tl.constexpr = 0, POOL_KW: tl.constexpr = 0,  # the pooling's window (0: none)
    POOL: tl.constexpr = "max", POOL_COUNT_PAD: tl.constexpr = False,  # "max" or "avg" (_pool_into)
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1, ESWAP0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1, ESWAP1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1, ESWAP2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1, ESWAP3: tl.constexpr = False,
    EIS_SCALAR0: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EIS_SCALAR2: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)

    # Rows: output pixels (n, [od,] oh, ow), PHASED those of one phase, POOL pooled pixels (n, 0, ph, pw)
    # whose windows' taps are walked in turn. Columns: output channels of group g.
    if PHASED:
        n, od, oh, ow, mask_m, od0, oh0, ow0 = _phase_rows(pid_m, M, OD, OH, OW, stride_d, stride_h, stride_w,
                                                           BLOCK_M, DEPTH)
    elif POOL_KH > 0:
        n, od, ph, pw, mask_m = _tile_pixels(pid_m, M, 1, POH, POW, BLOCK_M, False)
    else:
        n, od, oh, ow, mask_m = _tile_pixels(pid_m, M, OD, OH, OW, BLOCK_M, DEPTH)
    x_rows = x_ptr + n * xs_n + g * CIN_G * xs_c  # [BLOCK_M] pointers
    mask_n, co, w_cols = _columns(pid_n, g, COUT_G, w_ptr, ws_g, ws_o, BLOCK_N)

    result = tl.full((BLOCK_M, BLOCK_N), float("-inf") if POOL == "max" else 0.0, tl.float32)
    for t in range(0, max(POOL_KH * POOL_KW, 1)):  # one trip without POOL (the compiler drops the loop)
        real = mask_m
        if POOL_KH > 0:
            oh, ow, real = _pool_tap(ph, pw, t, mask_m, OH, OW, pool_sh, pool_sw, pool_ph, pool_pw, POOL_KW)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PHASED:
            acc = _phase_walk(acc, x_rows, mask_m, w_cols, mask_n, od, oh, ow, od0, oh0, ow0, D, H, W, CIN_G,
                              xs_c, xs_d, xs_h, xs_w, ws_i, ws_d, ws_h, ws_w, stride_d, stride_h, stride_w,
                              pad_d, pad_h, pad_w, KD, KH, KW, BLOCK_K, DEPTH, DOT_UPCAST)
        else:
            acc = _walk(acc, x_rows, real, w_cols, mask_n, od, oh, ow, D, H, W, CIN_G, xs_c, xs_d, xs_h, xs_w,
                        ws_i, ws_d, ws_h, ws_w, stride_d, stride_h, stride_w, pad_d, pad_h, pad_w, dil_d, dil_h,
                        dil_w, KD, KH, KW, BLOCK_K, TRANSPOSED, DEPTH, DOT_UPCAST)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + co, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE > 0:  # operands addressed by their strides over the output's dims
            i2, i3, i4 = _epilogue_index(od, oh, ow, DEPTH)
            acc = _epilogue(acc, real[:, None] & mask_n[None, :], n[:, None], co[None, :], i2, i3, i4,
                            e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
                            e0s0, e0s1, e0s2, e0s3, e0s4, e1s0, e1s1, e1s2, e1s3, e1s4,
                            e2s0, e2s1, e2s2, e2s3, e2s4, e3s0, e3s1, e3s2, e3s3, e3s4,
                            EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1,
                            EIS_SCALAR1, EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
        result = _pool_into(result, acc, real, POOL_KH, POOL)
    if POOL_KH > 0:  # the store's pixels: the pooled ones; an average divided by its divisor
        oh, ow = ph, pw
        result = _pooled(result, ph, pw, OH, OW, pool_sh, pool_sw, pool_ph, pool_pw, pool_div, POOL_KH, POOL_KW,
                         POOL, POOL_COUNT_PAD)
    out_rows = n * os_n + oh * os_h + ow * os_w + (od * os_d if DEPTH else 0)
    tl.store(out_ptr + out_rows[:, None] + (co * os_c)[None, :], result.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


# --- host launcher --------------------------------------------------------------------------------
def _block(size, lo: int, hi: int) -> int:
    """A power-of-two block in [lo, hi] covering ``size`` (at its upper bound when it is dynamic)."""
    return max(lo, min(hi, next_power_of_2(size)))


def _ncdhw(shape, strides) -> tuple[tuple, tuple]:
    """(shape, strides) of an operand as [N, C, D, H, W]: a 2-D convolution's NCHW at a depth of 1, a 1-D
    one's NCL at a depth and height of 1 (stride 0 along the added dims)."""
    missing = 5 - len(shape)
    return (*shape[:2], *(1,) * missing, *shape[2:]), (*strides[:2], *(0,) * missing, *strides[2:])


def _epilogue_strides(strides) -> tuple:
    """An epilogue operand's strides over the output's dims as the kernel's five epilogue indices take
    them: (n, c, d, h, w) for a 3-D convolution, (n, c, h, w, 0) for a 2-D one, (n, c, 0, l, 0) for a
    1-D one (a 2-D one of height 1)."""
    if len(strides) == 5:
        return tuple(strides)
    if len(strides) == 3:
        strides = (strides[0], strides[1], 0, strides[2])
    return (*strides, 0)


def _epilogue_args(out: TRef, steps, operands, round_to: str) -> tuple[list, list, dict]:
    """``elementwise.epilogue_args`` over the kernel's first four epilogue indices, the operands' strides
    over the fifth (``_epilogue_strides``; 0 for a scalar or absent operand), and the constexprs."""
    walks = [(o[0], _epilogue_strides(o[1])) if isinstance(o, tuple) else o for o in operands]
    args, constexprs = ew.epilogue_args(out, steps, [(o[0], o[1][:4]) if isinstance(o, tuple) else o
                                                     for o in walks], 4, round_to)
    fifth = [o[1][4] if isinstance(o, tuple) else 0 for o in walks]
    return args, fifth + [0] * (ew.MAX_CHAIN - len(walks)), constexprs


@dataclass(frozen=True)
class ConvOp:
    """One ``conv2d`` launch; its launch record carries it (``LaunchRecord.op``, as a matmul's does) so that
    ``fusion.py`` can relaunch it with an epilogue (:meth:`launch`). ``stride``, ``padding`` and
    ``dilation`` have one entry per spatial dim the kernel walks: (d, h, w) for a 3-D convolution, (h, w)
    for a 2-D one and a 1-D one (height 1: (1, s), (0, p), (1, d))."""

    x: TRef
    weight: TRef
    bias: TRef | None
    c: TRef  # the result
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int
    transposed: bool = False  # weight [C_in, C_out / groups, (KD,) KH, KW]; the module docstring's second form
    pool: Pooling | None = None  # a pooling of the result (after the epilogue), stored instead of it
    kernel = "conv2d"  # the kernel its launch runs (a subclass's own: ``depthwise.DepthwiseOp``)

    @property
    def reads(self) -> tuple[TRef, ...]:
        return (self.x, self.weight) + ((self.bias,) if self.bias is not None else ())

    @property
    def phased(self) -> bool:
        """Whether the kernel walks it by stride phase (PHASED): a transposed convolution of dilation 1."""
        return self.transposed and all(d == 1 for d in self.dilation)

    @property
    def depth(self) -> bool:
        """Whether the operands have a depth dim (a 3-D convolution: the kernel's DEPTH)."""
        return len(self.stride) == 3

    def launch(self, out: TRef | None = None, steps=(), operands=()) -> tuple[tuple, list, dict]:
        """(grid, arguments, constexprs): storing into ``out`` (default: the result) after an epilogue
        of ``steps`` ((op, arity, swap)) reading ``operands`` (a (TRef, its strides over ``out``'s dims)
        pair, a Python scalar, or None where the step is unary). Every operand is walked as
        [N, C, D, H, W] (``_ncdhw``: 1-D and 2-D ones at a depth of 1). With ``pool`` the launch stores
        the pooling's result, ``pool.out``, and its rows are the pooled pixels."""
        out = self.c if out is None else out
        x, weight = self.x, self.weight
        (n, _, d, h, w), (xs_n, xs_c, xs_d, xs_h, xs_w) = _ncdhw(x.shape, x.strides)
        stored = out if self.pool is None else self.pool.out
        (_, _, od, oh, ow), _ = _ncdhw(out.shape, out.strides)
        (_, _, _, poh, pow_), (os_n, os_c, os_d, os_h, os_w) = _ncdhw(stored.shape, stored.strides)
        (_, _, kd, kh, kw), _ = _ncdhw(weight.shape, weight.strides)
        cin_g, cout_g, (ws_g, ws_o, ws_i, ws_d, ws_h, ws_w) = self._weight_walk()
        m = n * od * oh * ow
        lead = 3 - len(self.stride)  # (d, h, w): a 2-D convolution walks a depth of 1 with no padding
        (sd, *s_hw), (pd, *p_hw), (dd, *d_hw) = ((fill,) * lead + tuple(v) for fill, v in (
            (1, self.stride), (0, self.padding), (1, self.dilation)))
        epilogue, fifth, constexprs = _epilogue_args(stored, steps, operands, dtype_name(self.c.dtype))
        if self.phased:  # programs (tile, phase) on axis 0, tiles of the largest phase's rows; K per tap: Cg
            rows = n * math.prod(triton.cdiv(o, s) for o, s in zip((od, oh, ow), (sd, *s_hw)))
            block_m, block_n, block_k = self._blocks(rows, cout_g, cin_g)
            grid = (sd * math.prod(s_hw) * triton.cdiv(rows, block_m), triton.cdiv(cout_g, block_n), self.groups)
            constexprs["PHASED"] = True
        else:
            if self.pool is not None:  # rows: the pooled pixels, each walking its window's taps in turn
                m = n * poh * pow_
                constexprs.update(POOL_KH=self.pool.kernel[0], POOL_KW=self.pool.kernel[1], POOL=self.pool.mode,
                                  POOL_COUNT_PAD=self.pool.count_include_pad)
            block_m, block_n, block_k = self._blocks(m, cout_g, cin_g * kd * kh * kw)
            grid = (triton.cdiv(m, block_m), triton.cdiv(cout_g, block_n), self.groups)
        window = (1, 1, 0, 0, 0)  # the pooling's strides, padding and divisor (stand-ins without one)
        if self.pool is not None:
            window = (*self.pool.stride, *self.pool.padding, self.pool.divisor)
        args = [x, weight, self.bias if self.bias is not None else stored, stored,  # a stand-in for no bias
                m, h, w, oh, ow, cin_g, cout_g, xs_n, xs_c, xs_h, xs_w, ws_g, ws_o, ws_i, ws_h, ws_w,
                os_n, os_c, os_h, os_w, *s_hw, *p_hw, *d_hw, *epilogue,
                d, od, xs_d, ws_d, os_d, sd, pd, dd, *fifth,  # the depth's (see the kernel)
                poh, pow_, *window]  # the pooling's, last
        # 8 warps: the gathered A tile's int64 addresses and masks ([BLOCK_M, BLOCK_K] each) next to the
        # accumulator spill at 4 warps on sm_90 (scripts/compile_check.py); spread over 256 threads they fit.
        constexprs.update(KD=kd, KH=kh, KW=kw, HAS_BIAS=self.bias is not None, TRANSPOSED=self.transposed,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_UPCAST=False, num_warps=8)
        if self.depth:
            constexprs["DEPTH"] = True
        return grid, args, constexprs

    def _blocks(self, m, cout_g, k) -> tuple[int, int, int]:
        """(BLOCK_M, BLOCK_N, BLOCK_K) for M rows, Og columns and a K walk of k (Cg * KD * KH * KW; PHASED
        Cg per tap). A transposed 3-D one takes at most 32 rows: at 64 rows it spilled on sm_90
        (compile_check.py: PHASED, a 128 -> 64 channel k2 s2 one at 64 x 64, 255 registers and 8 to 48 bytes
        of stack, its rows' coordinates held per thread across the K walk in the strided store's layout;
        146 to 162 registers at 32 x 64. Dilated (64 -> 32 channels, k3 s(1, 2, 2) d(1, 2, 2), fp16): 255
        and 8 bytes at 64 x 32, 164 at 32 x 32)."""
        k_step = FP32_K_STEP if self.x.dtype.itemsize >= 4 else K_STEP
        rows = 32 if (self.transposed and self.depth) or self.pool is not None else 64
        return _block(m, 16, rows), _block(cout_g, 16, 64), _block(k, 16, k_step)

    def _weight_walk(self) -> tuple:
        """(Cg, Og, the weight's strides (ws_g, ws_o, ws_i, ws_d, ws_h, ws_w)): ws_g steps from group to
        group, ws_o over a group's output channels, ws_i over its input channels."""
        (w0, w1, _, _, _), (s0, s1, *taps) = _ncdhw(self.weight.shape, self.weight.strides)
        if self.transposed:  # [C_in, Og, (KD,) KH, KW]: group g's input channels are rows g*Cg + ci
            cin_g = w0 // self.groups
            return cin_g, w1, (cin_g * s0, s1, s0, *taps)
        cout_g = w0 // self.groups  # [C_out, Cg, (KD,) KH, KW]: group g's output channels are rows g*Og + o
        return w1, cout_g, (cout_g * s0, s0, s1, *taps)


def launch_conv2d(b, out, x, weight, bias, stride, padding, dilation, groups: int, transposed: bool = False,
                  refine=None) -> None:
    """``out = conv(x, weight, bias)`` (transposed when ``transposed``); every operand a 5-D NCDHW TRef
    (stride, padding and dilation given for (d, h, w)), a 4-D NCHW one (given for (h, w)), or all 3-D NCL
    (a 1-D convolution, given for (1, L)); bias 1-D or None. ``refine(op)`` may replace the ConvOp by a
    subclass launching another kernel (``depthwise.py``)."""
    op = ConvOp(x, weight, bias, out, tuple(stride), tuple(padding), tuple(dilation), groups, transposed)
    if refine is not None:
        op = refine(op)
    grid, args, constexprs = op.launch()
    record = b.launch(op.kernel, grid, *args, **constexprs)
    if record is not None:
        record.op = op  # fusion may give it an epilogue


# --- support check and lowering -------------------------------------------------------------------
def _args(node):
    """convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)"""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding",
             "groups")
    return {**dict(zip(names, node.args)), **node.kwargs}


def _per_dim(v, dims: int) -> tuple:
    """A stride, padding or dilation list with one entry per spatial dim (one entry given: all of them)."""
    v = list(v)
    return tuple(v * dims) if len(v) == 1 else tuple(v)


def supported(node) -> str | None:
    a = _args(node)
    x, weight, bias = (node_value(t) for t in (a["input"], a["weight"], a.get("bias")))
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "input or weight is not a tensor"
    if weight.dim() not in (3, 4, 5):
        kind = "transposed convolution" if a.get("transposed") else "convolution"
        return f"{weight.dim() - 2}-D {kind} is not supported (1-D, 2-D and 3-D only)"
    if x.dim() != weight.dim():
        return (f"convolution input of rank {x.dim()} with a {weight.dim()}-D weight "
                "(NCL, NCHW or NCDHW, batched)")
    for name, t in (("input", x), ("weight", weight), ("bias", bias), ("output", node.meta.get("val"))):
        if t is None and name == "bias" and a.get("bias") is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dtype not in FLOAT_DTYPES:
            return (f"{name} dtype {t.dtype} is not supported "
                    f"(supported: {', '.join(map(str, FLOAT_DTYPES))})")
    if weight.dtype != x.dtype:
        return f"input dtype {x.dtype} and weight dtype {weight.dtype} differ"
    return None


def convolution(b, node, refine=None):
    """2-D and 3-D convolutions (a video model's tubelet embedding, a 3-D UNet's or video VAE's), and 1-D
    ones (Whisper's, wav2vec's front ends) as 2-D over a height of 1; any of them transposed (a UNet's or
    a VAE decoder's upsampling, a vocoder's), its ``output_padding`` already in the output's size."""
    a = _args(node)
    bias = a.get("bias")
    out, x, weight = b.out(node), b.ref(a["input"]), b.ref(a["weight"])
    dims = weight.ndim - 2
    stride, padding, dilation = (_per_dim(a[k], dims) for k in ("stride", "padding", "dilation"))
    if dims == 1:  # a 2-D convolution of height 1 (ConvOp walks [N, C, L] as [N, C, 1, 1, L])
        stride, padding, dilation = (1, stride[0]), (0, padding[0]), (1, dilation[0])
    launch_conv2d(b, out, x, weight, b.ref(bias) if bias is not None else None, stride, padding, dilation,
                  int(a["groups"]), bool(a.get("transposed")), refine)
