"""A 1x1 convolution computes its input where it reads it: a pass of ``fusion.fuse`` over a delegate's
launch records, after the epilogues, and its kernel.

Two producers write a tensor as wide as a CNN's widest activations only for a 1x1 convolution to read
it back:

  - a depthwise convolution, with its epilogue: MobileNet's inverted residuals (1x1 expand -> 3x3
    depthwise, batch norm, ReLU6 -> 1x1 project), MobileNetV1's separable convolutions, a Conformer's
    convolution module (depthwise conv1d, batch norm, SiLU -> 1x1 conv1d);
  - a pointwise chain: EfficientNet's squeeze-and-excitation scale (``t * sigmoid(...)`` per channel)
    before its 1x1 projection, a pre-activation network's batch norm and ReLU before its 1x1 conv
    (DenseNet's layers, ResNet-v2's bottlenecks).

    D:  t = act(dwconv(x, v) + c)   or   t = h(x, s, ...)      t scratch, read by the 1x1 convolution only
    P:  u = f(conv1x1(t, w) + b)    ->   P':  u = f(sum_k t[:, k] * w[:, k] + b), t computed per tile

P' takes P's place (or that of P's epilogue). It is P's GEMM over (pixels, output channels) with K the
channels of t, and each A tile [BLOCK_M pixels, BLOCK_K channels] is computed where P loaded it: the
depthwise taps (x at each tap's input pixel times the tap's weight, in fp32), its bias, the result
rounded to the depthwise result's dtype as eager stores it; or the tile of the chain's first operand
(broadcast over t as the chain reads it). Then the epilogue of
the depthwise convolution or the chain's steps (``elementwise._epilogue``, each operand addressed over
t's (n, c, h, w): a per-channel scale, a broadcast squeeze-and-excitation vector), in fp32, and the
cast to t's dtype. t is never stored. Each program column of P (BLOCK_N output channels) computes its
own A tiles, so past one column (64 output channels) the taps and steps run once per column: a few
percent of P's multiply-adds, and x's tiles come back from L2.

D merges into P when all of these hold:
  - D is a 2-D (or 1-D: height 1) ``depthwise_conv`` launch, with or without an epilogue; or a
    floating pointwise chain (``fusion._Chain``, compute f32) whose first step reads a tensor (any of
    its operands may broadcast over t), not merged into another launch;
  - P is a 2-D (or 1-D) ``conv2d`` launch of a 1x1 kernel, stride 1, no padding, one group, not
    transposed and not pooling, with or without an epilogue, that reads exactly t as its input;
  - t's buffer is scratch, touched by no launch but D and P, and neither a delegate output nor viewed
    by one;
  - no launch between D and P writes what D reads (D's reads move to P's place).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import triton
import triton.language as tl

from . import conv as cv
from .conv import _dot, _epilogue_args, _epilogue_strides, _ncdhw, _tile_pixels
from .depthwise import DepthwiseOp
from .group_norm import NormApply, scale_shift
from .elementwise import _epilogue
from .refs import TRef, broadcast_strides, new_launch, same_view
from .rows import chain_args, chain_constexprs
from ..dtypes import dtype_name


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _depthwise_tile(x_rows, mask_m, ih0, iw0, k, mask_k, H, W, xs_c, xs_h, xs_w, v_ptr, vs_c, vs_h, vs_w,
                    dil_h, dil_w, V_G, KH: tl.constexpr, KW: tl.constexpr):
    """The depthwise convolution's [BLOCK_M, BLOCK_K] tile in fp32 (no bias): output channels ``k`` (each
    reading input channel k // V_G) at the rows whose tap-0 inputs are (ih0, iw0); taps outside x are
    its zero padding."""
    x_cols = (k // V_G).to(tl.int64) * xs_c
    a = tl.zeros((ih0.shape[0], k.shape[0]), dtype=tl.float32)
    for t in range(KH * KW):  # a loop at run time: a 7x7 window unrolled would be 49 tile loads
        kh, kw = t // KW, t % KW
        ih, iw = ih0 + kh * dil_h, iw0 + kw * dil_w
        real = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        xv = tl.load(x_rows[:, None] + (ih * xs_h + iw * xs_w)[:, None] + x_cols[None, :],
                     mask=real[:, None] & mask_k[None, :], other=0.0)
        vv = tl.load(v_ptr + k * vs_c + kh * vs_h + kw * vs_w, mask=mask_k, other=0.0)
        a += xv.to(tl.float32) * vv.to(tl.float32)[None, :]
    return a


@triton.jit
def _normalized(a, n, k, mask, mask_k, var_ptr, mean_ptr, nw_ptr, nb_ptr, per, sample_stride, eps,
                HAS_NW: tl.constexpr, HAS_NB: tl.constexpr):
    """The tile ``a`` of x (pixels of images ``n``, channels ``k``) normalized as ``group_norm``'s
    ``norm_apply_kernel`` does: x * scale + shift, from the statistics at n * sample_stride + k // per."""
    stat = n[:, None] * sample_stride + (k // per)[None, :]
    scale, shift = scale_shift(var_ptr, mean_ptr, stat, mask, nw_ptr, nb_ptr, k[None, :], mask_k[None, :], eps,
                               HAS_NW, HAS_NB)
    return a * scale + shift


@triton.jit
def conv1x1_kernel(
    x_ptr, v_ptr, c_ptr, w_ptr, bias_ptr, out_ptr,
    M, H, W, OH, OW, K, V_G, COUT,
    xs_n, xs_c, xs_h, xs_w, vs_c, vs_h, vs_w, ws_o, ws_i, os_n, os_c, os_h, os_w,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    # t's epilogue (the A tile's prologue): operands over t's (n, c, h, w)
    p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_scalar, p1_scalar, p2_scalar, p3_scalar,
    p0s0, p0s1, p0s2, p0s3, p1s0, p1s1, p1s2, p1s3, p2s0, p2s1, p2s2, p2s3, p3s0, p3s1, p3s2, p3s3,
    # the 1x1 result's epilogue: operands over the output's (n, c, h, w) (and a fifth, 0)
    e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
    e0s0, e0s1, e0s2, e0s3, e1s0, e1s1, e1s2, e1s3, e2s0, e2s1, e2s2, e2s3, e3s0, e3s1, e3s2, e3s3,
    e0s4, e1s4, e2s4, e3s4,
    # a norm's statistics, weight and bias, its groups and eps (NORM: t is x normalized; else stand-ins)
    var_ptr, mean_ptr, nw_ptr, nb_ptr, n_per, n_sample, n_eps,
    KH: tl.constexpr, KW: tl.constexpr, DEPTHWISE: tl.constexpr, HAS_DW_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    PROLOGUE: tl.constexpr = 0, P_ROUND: tl.constexpr = "",
    POP0: tl.constexpr = "copy", PARITY0: tl.constexpr = 1, PSWAP0: tl.constexpr = False,
    POP1: tl.constexpr = "copy", PARITY1: tl.constexpr = 1, PSWAP1: tl.constexpr = False,
    POP2: tl.constexpr = "copy", PARITY2: tl.constexpr = 1, PSWAP2: tl.constexpr = False,
    POP3: tl.constexpr = "copy", PARITY3: tl.constexpr = 1, PSWAP3: tl.constexpr = False,
    PIS_SCALAR0: tl.constexpr = False, PIS_SCALAR1: tl.constexpr = False,
    PIS_SCALAR2: tl.constexpr = False, PIS_SCALAR3: tl.constexpr = False,
    EPILOGUE: tl.constexpr = 0, ROUND_TO: tl.constexpr = "",
    EOP0: tl.constexpr = "copy", EARITY0: tl.constexpr = 1, ESWAP0: tl.constexpr = False,
    EOP1: tl.constexpr = "copy", EARITY1: tl.constexpr = 1, ESWAP1: tl.constexpr = False,
    EOP2: tl.constexpr = "copy", EARITY2: tl.constexpr = 1, ESWAP2: tl.constexpr = False,
    EOP3: tl.constexpr = "copy", EARITY3: tl.constexpr = 1, ESWAP3: tl.constexpr = False,
    EIS_SCALAR0: tl.constexpr = False, EIS_SCALAR1: tl.constexpr = False,
    EIS_SCALAR2: tl.constexpr = False, EIS_SCALAR3: tl.constexpr = False,
    NORM: tl.constexpr = False, HAS_NW: tl.constexpr = False, HAS_NB: tl.constexpr = False,
):
    # Rows: output pixels (n, oh, ow), t's and the output's alike (a 1x1 conv of stride 1); columns:
    # output channels; K: t's channels. DEPTHWISE: t's tiles from the taps of x; else x is t's chain's
    # first operand, over t's shape (NORM: the input of the norm that wrote it).
    n, _, oh, ow, mask_m = _tile_pixels(tl.program_id(0).to(tl.int64), M, 1, OH, OW, BLOCK_M, False)
    co = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = co < COUT
    x_rows = x_ptr + n * xs_n
    ih0, iw0 = oh * stride_h - pad_h, ow * stride_w - pad_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < K
        if DEPTHWISE:
            a = _depthwise_tile(x_rows, mask_m, ih0, iw0, k, mask_k, H, W, xs_c, xs_h, xs_w, v_ptr, vs_c, vs_h,
                                vs_w, dil_h, dil_w, V_G, KH, KW)
            if HAS_DW_BIAS:
                a += tl.load(c_ptr + k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        else:
            a = tl.load(x_rows[:, None] + (oh * xs_h + ow * xs_w)[:, None] + k.to(tl.int64)[None, :] * xs_c,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            if NORM:
                a = _normalized(a, n, k, mask_m[:, None] & mask_k[None, :], mask_k, var_ptr, mean_ptr, nw_ptr,
                                nb_ptr, n_per, n_sample, n_eps, HAS_NW, HAS_NB)
        if PROLOGUE > 0:  # at t's (n, k, oh, ow)
            a = _epilogue(a, mask_m[:, None] & mask_k[None, :], n[:, None], k[None, :], oh[:, None], ow[:, None], 0,
                          p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_scalar, p1_scalar, p2_scalar, p3_scalar,
                          p0s0, p0s1, p0s2, p0s3, 0, p1s0, p1s1, p1s2, p1s3, 0,
                          p2s0, p2s1, p2s2, p2s3, 0, p3s0, p3s1, p3s2, p3s3, 0,
                          PROLOGUE, P_ROUND, POP0, PARITY0, PSWAP0, PIS_SCALAR0, POP1, PARITY1, PSWAP1, PIS_SCALAR1,
                          POP2, PARITY2, PSWAP2, PIS_SCALAR2, POP3, PARITY3, PSWAP3, PIS_SCALAR3)
        # t as eager stores it, in the dtype P reads; channels past K are 0 (a step may not give 0 there)
        a = tl.where(mask_k[None, :], a, 0.0).to(w_ptr.dtype.element_ty)
        bt = tl.load(w_ptr + co[None, :] * ws_o + k.to(tl.int64)[:, None] * ws_i,
                     mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(acc, a, bt, DOT_UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + co, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if EPILOGUE > 0:
        acc = _epilogue(acc, mask, n[:, None], co[None, :], oh[:, None], ow[:, None], 0,
                        e0_ptr, e1_ptr, e2_ptr, e3_ptr, e0_scalar, e1_scalar, e2_scalar, e3_scalar,
                        e0s0, e0s1, e0s2, e0s3, e0s4, e1s0, e1s1, e1s2, e1s3, e1s4,
                        e2s0, e2s1, e2s2, e2s3, e2s4, e3s0, e3s1, e3s2, e3s3, e3s4,
                        EPILOGUE, ROUND_TO, EOP0, EARITY0, ESWAP0, EIS_SCALAR0, EOP1, EARITY1, ESWAP1, EIS_SCALAR1,
                        EOP2, EARITY2, ESWAP2, EIS_SCALAR2, EOP3, EARITY3, ESWAP3, EIS_SCALAR3)
    out_rows = n * os_n + oh * os_h + ow * os_w
    tl.store(out_ptr + out_rows[:, None] + (co * os_c)[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# --- host side ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conv1x1Op:
    """A 1x1 convolution ``pw`` whose input t is computed where it is read, one ``conv1x1`` launch: from
    ``source``, a depthwise convolution (``depthwise.DepthwiseOp``) or a tensor read over t's dims (a
    (TRef, its strides over t's dims) pair), then
    ``steps`` ((op, arity, swap); () for none) reading ``operands`` (a (TRef, its strides over t's
    dims) pair, a Python scalar, or None where a step is unary). With ``norm``, the tensor source is
    normalized by it first (``group_norm.NormApply``: a GroupNorm's or instance norm's statistics)."""

    pw: cv.ConvOp
    source: DepthwiseOp | tuple
    steps: tuple
    operands: tuple
    norm: NormApply | None = None  # with a tensor source: the norm that reads it (the source is its x)
    kernel = "conv1x1"

    @property
    def c(self) -> TRef:
        return self.pw.c

    @property
    def reads(self) -> tuple[TRef, ...]:
        source = self.source.reads if isinstance(self.source, DepthwiseOp) else (self.source[0],)
        norm = () if self.norm is None else self.norm.reads[1:]
        return source + norm + tuple(o[0] for o in self.operands if isinstance(o, tuple)) + self.pw.reads[1:]

    def launch(self, out: TRef | None = None, steps=(), operands=()) -> tuple[tuple, list, dict]:
        """(grid, arguments, constexprs), as ``conv.ConvOp.launch``: storing into ``out`` (default: pw's
        result) after an epilogue of ``steps`` reading ``operands`` over ``out``'s dims."""
        out = self.pw.c if out is None else out
        pw, dw = self.pw, self.source if isinstance(self.source, DepthwiseOp) else None
        x, x_strides = self.source if dw is None else (dw.x, dw.x.strides)
        (n, _, _, h, w), (xs_n, xs_c, _, xs_h, xs_w) = _ncdhw(pw.x.shape if dw is None else x.shape, x_strides)
        (_, k, _, oh, ow), _ = _ncdhw(pw.x.shape, pw.x.strides)  # t's channels and pixels
        _, (os_n, os_c, _, os_h, os_w) = _ncdhw(out.shape, out.strides)
        (cout, *_), (ws_o, ws_i, *_) = pw.weight.shape, pw.weight.strides
        m = n * oh * ow
        taps = ((1, 1, 1, 1, 1), (0, 0, 0, 0, 0)) if dw is None else _ncdhw(dw.weight.shape, dw.weight.strides)
        (_, _, _, kh, kw), (vs_c, _, _, vs_h, vs_w) = taps
        geometry = (1, 1, 0, 0, 1, 1) if dw is None else (*dw.stride, *dw.padding, *dw.dilation)
        prologue = [(o[0], _epilogue_strides(o[1])[:4]) if isinstance(o, tuple) else o for o in self.operands]
        epilogue, fifth, constexprs = _epilogue_args(out, steps, operands, dtype_name(pw.c.dtype))
        # the dtype the first step reads t's values in
        stored = dw.c.dtype if dw is not None else x.dtype if self.norm is None else self.norm.out.dtype
        if self.steps:
            constexprs.update(chain_constexprs("prologue", self.steps, prologue, stored))
        k_step = cv.FP32_K_STEP if pw.x.dtype.itemsize >= 4 else cv.K_STEP
        block_m, block_n, block_k = cv._block(m, 16, 64), cv._block(cout, 16, 64), cv._block(k, 16, k_step)
        args = [x, out if dw is None else dw.weight, out if dw is None or dw.bias is None else dw.bias, pw.weight,
                pw.bias if pw.bias is not None else out, out,
                m, h, w, oh, ow, k, 1 if dw is None else k // dw.groups, cout, xs_n, xs_c, xs_h, xs_w, vs_c, vs_h,
                vs_w, ws_o, ws_i, os_n, os_c, os_h, os_w, *geometry, *chain_args(prologue, out), *epilogue, *fifth[:4],
                *([out] * 4 + [1, 0, 0.0] if self.norm is None else self.norm.args(out))]
        constexprs.update(KH=kh, KW=kw, DEPTHWISE=dw is not None, HAS_DW_BIAS=dw is not None and dw.bias is not None,
                          HAS_BIAS=pw.bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                          DOT_UPCAST=False, num_warps=8)
        if self.norm is not None:
            constexprs.update(NORM=True, HAS_NW=self.norm.weight is not None, HAS_NB=self.norm.bias is not None)
        return (triton.cdiv(m, block_m), triton.cdiv(cout, block_n)), args, constexprs


def _pointwise(op) -> bool:
    """Whether ``op`` is a 1x1 convolution of stride 1, no padding, one group (a GEMM over pixels)."""
    return (type(op) is cv.ConvOp and not op.transposed and op.pool is None and op.groups == 1
            and op.c.ndim in (3, 4) and op.weight.shape[2:] == (1,) * (op.c.ndim - 2)
            and all(s == 1 for s in op.stride) and all(p == 0 for p in op.padding))


def _depthwise(op) -> bool:
    """Whether ``op`` is a 2-D or 1-D depthwise convolution (``depthwise.DepthwiseOp``)."""
    return isinstance(op, DepthwiseOp) and not op.depth and op.c.ndim in (3, 4)


# --- the pass -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fused:
    """What ``fusion.fuse`` has merged so far: ``epilogues`` maps a consumer's position to its matmul
    launch with the consumer's chain as epilogue, ``sources`` to (the matmul's position, the chain);
    ``taken``: positions whose chain another launch computes (a row kernel's epilogue, a gather's, a
    pooling convolution's); ``merged_away``: positions gone (updated here); ``norms``: a 1x1
    convolution's position -> (its input as a :class:`Conv1x1Op`, the positions it merges), from
    :func:`claim_norms`."""

    epilogues: dict
    sources: dict
    taken: set
    merged_away: set
    norms: dict = field(default_factory=dict)  # :func:`claim_norms`' claims


def merge_conv1x1(launches, matmuls, chains, fused: Fused, touched, writes, keep, users, chain_of, relaunch,
                  unwritten) -> dict:
    """The position of a 1x1 convolution (or of its epilogue) -> the launch that now computes it with its
    input. ``chain_of(op, chain)`` gives (its result, steps, operands) of ``chain`` as ``op``'s epilogue
    (or None), ``relaunch(op, chain, launch)`` relaunches ``op`` with it, ``unwritten(chain, upto,
    writes)`` (as ``fusion._unwritten``) whether a chain's reads may move to ``upto``. Each producer merged is added
    to ``fused.merged_away``."""
    merged = {}
    after = {m: c for c, (m, _) in fused.sources.items()}  # a matmul's position -> its epilogue's
    for q, pw in sorted(matmuls.items()):
        final = after.get(q, q)
        if not _pointwise(pw) or final in fused.merged_away or (final == q and q in fused.merged_away):
            continue
        if q in fused.norms:
            op, producers = fused.norms[q]
        else:
            d = _producer(pw.x, q, keep, users, fused.merged_away | fused.taken)
            op = None if d is None else _input(d, pw, final, matmuls, chains, fused, touched, writes, chain_of,
                                               unwritten)
            producers = (d,)
        if op is None:
            continue
        name = "+".join(_name(i, launches, chains, fused) for i in (*producers, q))
        launch = new_launch(op.kernel, *op.launch(), name)
        if final != q:
            launch = relaunch(op, fused.sources[final][1], launch)
        if launch is not None:
            merged[final] = launch
            fused.merged_away.update(producers)
    return merged


def claim_norms(matmuls, norms, chains, fused: Fused, writes, keep, users, unwritten) -> dict:
    """A 1x1 convolution's position -> (a :class:`Conv1x1Op` computing its input, the positions merged
    into it) where that input is a ``norm_apply``'s result (``group_norm.NormApply``: a GroupNorm's),
    or a pointwise chain's of it (a pre-activation network's ReLU: BiT's bottlenecks), which nothing
    else reads. Claimed before ``fuse_rows`` would give the norm the chain as its epilogue: the
    normalized tensor is then never stored."""
    claims = {}
    after = {m: c for c, (m, _) in fused.sources.items()}
    gone = fused.merged_away | fused.taken | set(fused.epilogues)
    for q, pw in sorted(matmuls.items()):
        final = after.get(q, q)
        if not _pointwise(pw) or final in fused.merged_away or (final == q and q in gone):
            continue
        d = _producer(pw.x, q, keep, users, gone)
        if d is None:
            continue
        r, chain = (d, None) if isinstance(norms.get(d), NormApply) else (None, chains.get(d))
        if chain is not None and chain.compute == "f32" and same_view(pw.x, chain.out):
            first = [k for k, slot in enumerate(chain.slots[:2]) if isinstance(slot, TRef)]
            r = None if not first else _producer(chain.slots[first[0]], d, keep, users, gone)
            if r is None or not isinstance(norms.get(r), NormApply) or not unwritten(chain, final, writes):
                continue
        norm = norms.get(r)
        op = None if norm is None else _normalized_input(pw, norm, chain)
        if op is None or any(t.buffer in writes[p] for t in norm.reads for p in range(r + 1, final)):
            continue
        claims[q] = (op, (r,) if chain is None else (r, d))
    return claims


def _normalized_input(pw, norm: NormApply, chain) -> "Conv1x1Op | None":
    """``pw``'s input computed from ``norm``'s x (then ``chain``'s steps, when there is one), or None
    unless ``norm`` writes its result over pw's input's dims: image n's channel c is row (n, c)."""
    u, t = norm.out, pw.x
    steps, operands = (), ()
    if chain is not None:
        at = [k for k, slot in enumerate(chain.slots) if isinstance(slot, TRef) and slot.buffer == u.buffer]
        if len(at) != 1 or at[0] > 1 or not same_view(chain.slots[at[0]], u) or tuple(u.shape) != tuple(t.shape):
            return None
        steps, others = chain.from_slot(at[0])
        operands = tuple((o, broadcast_strides(o, t.shape)) if isinstance(o, TRef) else o for o in others)
    elif not same_view(u, t):
        return None
    if tuple(norm.x.shape) != tuple(t.shape) or norm.channels is not None:
        return None  # (an instance norm's rows are not the convolution's (image, channel))
    return Conv1x1Op(pw, (norm.x, tuple(norm.x.strides)), tuple(steps), operands, norm)


def _name(i: int, launches, chains, fused: Fused) -> str:
    """The nodes launch ``i`` computes, with the chain or epilogue merged into it."""
    if i in fused.epilogues:
        return fused.epilogues[i].op
    return "+".join(chains[i].names) if i in chains else launches[i].op


def _producer(t: TRef, q: int, keep, users, gone) -> int | None:
    """The one position writing ``t``, read at ``q``, when nothing else touches it and it is not
    ``gone``."""
    writers = users[t.buffer] - {q}
    if t.buffer in keep or len(writers) != 1:
        return None
    (d,) = writers
    return None if d > q or d in gone else d


def _input(d: int, pw, final: int, matmuls, chains, fused: Fused, touched, writes, chain_of, unwritten):
    """A :class:`Conv1x1Op` computing ``pw``'s input as launch ``d`` does (a depthwise convolution, with
    its epilogue; or a pointwise chain), when its reads may move to ``final``; else None."""
    t = pw.x
    if d in fused.sources or _depthwise(matmuls.get(d)):
        m, chain = fused.sources.get(d, (d, None))
        dw = matmuls[m]
        produced = dw.c if chain is None else chain.out
        if not _depthwise(dw) or not same_view(t, produced):
            return None
        walk = (produced, (), ()) if chain is None else chain_of(dw, chain)
        moved = (touched[d] | touched[m]) - {t.buffer, dw.c.buffer}
        if walk is None or walk[0] is not produced or any(moved & writes[p] for p in range(d + 1, final)):
            return None  # (a chain reading dw's result reordered writes t in another order than P reads it)
        return Conv1x1Op(pw, dw, tuple(walk[1]), tuple(walk[2]))
    chain = chains.get(d)
    if chain is None or d in fused.epilogues or chain.compute != "f32" or not same_view(t, chain.out):
        return None
    first = [k for k, s in enumerate(chain.slots[:2]) if isinstance(s, TRef)]
    if not first or not unwritten(chain, final, writes):
        return None
    steps, others = chain.from_slot(first[0])
    shape = t.shape
    operands = [(s, broadcast_strides(s, shape)) if isinstance(s, TRef) else s for s in others]
    source = chain.slots[first[0]]
    return Conv1x1Op(pw, (source, broadcast_strides(source, shape)), tuple(steps), tuple(operands))
