"""Rotary position embedding in one launch: ``tritondelegate::rotary(x, cos, sin)`` (``ops.py``),
which ``passes/fuse_rotary.py`` puts in place of the written-out pattern.

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat((-x[..., h:], x[..., :h]), -1), h = D/2

that is, per position c < h of the last dim:

    out[..., c]     = x[..., c]     * cos[..., c]     - x[..., c + h] * sin[..., c]
    out[..., c + h] = x[..., c + h] * cos[..., c + h] + x[..., c]     * sin[..., c + h]

x is a strided view of any rank up to MAX_RANK (a transposed projection reads in place), cos and sin
broadcast to its shape with stride 0 (``[seq, D]`` or ``[b, 1, seq, D]`` against ``[b, heads, seq, D]``).
The leading dims of all four tensors are collapsed together (``refs.collapse``) into at most
four row dims; one program covers BLOCK_R rows by BLOCK_H positions of the half, loads each x element
once and writes both halves. Math is fp32; the result is cast to the output's dtype.

``tritondelegate::rotary_angles(x, angles, scale, dtype)`` (tables a model computes per call from its
positions, rewritten by ``passes/rotary_tables.py``) is the same kernel with ``ANGLES``: the cos
pointer is then the half-width angles ``a`` [..., D / 2] (broadcast to x's rows like a table), and
each program computes ``cos(a) * scale`` and ``sin(a) * scale`` in fp32, rounded to the tables' dtype
(``ROUND``) as eager stores them, for both halves (``cat((a, a))``: positions c and c + h share an
angle). No table is ever stored.

``tritondelegate::rotary_pair(q, k, cos, sin)`` (a layer's query and key over the same tables, paired
by ``passes/fuse_rotary.py``; ``rotary_pair_angles`` likewise) is the same kernel with ``PAIR``: the row blocks of q, then those of k,
along grid axis 0, each program rotating a block of one of them. k has its own rows and strides (under
grouped-query attention fewer heads than q) and sees cos and sin through its own broadcast strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import sizes
from ..errors import LoweringError
from .elementwise import round_as, round_name
from .refs import FLOAT_DTYPES, TRef, broadcast_strides, collapse, node_value
from .rows import row_offsets
from .sizes import next_power_of_2

MAX_RANK = 5
ROW_DIMS = MAX_RANK - 1
MAX_BLOCK_H = 128
TILE = 1024  # half-row positions per program: 2 * TILE outputs, about 8 fp32 values each in registers


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _row4(r, n1, n2, n3, s0, s1, s2, s3):
    """Element offset of row ``r`` (int64) of a [n0, n1, n2, n3] grid of rows with strides s0..s3:
    ``rows.row_offsets`` with one more inner dim."""
    return row_offsets(r // n3, n1, n2, s0, s1, s2) + (r % n3) * s3


@triton.jit
def _rotate(
    x_ptr, cos_ptr, sin_ptr, out_ptr, block,
    rows, half, n1, n2, n3,
    xs0, xs1, xs2, xs3, xsd,
    cs0, cs1, cs2, cs3, csd,
    ss0, ss1, ss2, ss3, ssd,
    os0, os1, os2, os3, osd, scale, nw_ptr, nws, n_eps,
    ANGLES: tl.constexpr, ROUND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    NORM: tl.constexpr = False,
):
    """Row block ``block`` (and column block ``program_id(1)``) of one tensor's rotation. ``NORM``: each
    row (a head; BLOCK_H covers its half) RMS-normalized first, as ``rms_norm(x, [D], w, n_eps)``."""
    r = block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (r < rows)[:, None] & (c < half)[None, :]
    lo = c[None, :]
    hi = lo + half
    x_row = x_ptr + _row4(r, n1, n2, n3, xs0, xs1, xs2, xs3)[:, None]
    c_row = cos_ptr + _row4(r, n1, n2, n3, cs0, cs1, cs2, cs3)[:, None]
    s_row = sin_ptr + _row4(r, n1, n2, n3, ss0, ss1, ss2, ss3)[:, None]
    o_row = out_ptr + _row4(r, n1, n2, n3, os0, os1, os2, os3)[:, None]
    x1 = tl.load(x_row + lo * xsd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + hi * xsd, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # rounded to x's dtype as the norm's result is stored, times the weight, rounded again
        tx = x_ptr.dtype.element_ty
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * half) + n_eps)[:, None]
        w1 = tl.load(nw_ptr + lo * nws, mask=c[None, :] < half, other=0.0).to(tl.float32)
        w2 = tl.load(nw_ptr + hi * nws, mask=c[None, :] < half, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(tx).to(tl.float32) * w1).to(tx).to(tl.float32)
        x2 = ((x2 * rstd).to(tx).to(tl.float32) * w2).to(tx).to(tl.float32)
    if ANGLES:  # cos_ptr: the angles; positions c and c + h share one
        a = tl.load(c_row + lo * csd, mask=mask, other=0.0).to(tl.float32)
        c1 = round_as(tl.cos(a) * scale, ROUND)  # as eager stores a table of that dtype
        s1 = round_as(tl.sin(a) * scale, ROUND)
        c2 = c1
        s2 = s1
    else:
        c1 = tl.load(c_row + lo * csd, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(c_row + hi * csd, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(s_row + lo * ssd, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(s_row + hi * ssd, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1 + (-x2) * s1
    y2 = x2 * c2 + x1 * s2
    ty = out_ptr.dtype.element_ty
    tl.store(o_row + lo * osd, y1.to(ty), mask=mask)
    tl.store(o_row + hi * osd, y2.to(ty), mask=mask)


@triton.jit
def rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, kx_ptr, kout_ptr,
    rows, half, n1, n2, n3,
    xs0, xs1, xs2, xs3, xsd,
    cs0, cs1, cs2, cs3, csd,
    ss0, ss1, ss2, ss3, ssd,
    os0, os1, os2, os3, osd,
    krows, k1, k2, k3,
    kxs0, kxs1, kxs2, kxs3, kxsd,
    kcs0, kcs1, kcs2, kcs3,
    kss0, kss1, kss2, kss3,
    kos0, kos1, kos2, kos3, kosd, scale,
    nw_ptr, knw_ptr, nws, knws, n_eps,
    PAIR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ANGLES: tl.constexpr = False, ROUND: tl.constexpr = "", NORM: tl.constexpr = False,
):
    """One tensor x, or (PAIR) two tensors x and kx over the same cos and sin: axis 0 of the grid is
    x's row blocks, then kx's. kx has its own rows (its own head count) and strides; its cos and sin
    strides are theirs broadcast to kx's shape, over the same last dim (csd, ssd). ``ANGLES``: cos_ptr
    holds the angles, and the tables are computed (``scale``, rounded to ``ROUND``). ``NORM``: x's and
    kx's rows (heads) are RMS-normalized first, each by its own weight (nw_ptr, knw_ptr), as Qwen3's
    q_norm and k_norm (one column block per row: BLOCK_H covers the half)."""
    pid = tl.program_id(0)
    if PAIR:
        x_blocks = tl.cdiv(rows, BLOCK_R)
        if pid < x_blocks:
            _rotate(x_ptr, cos_ptr, sin_ptr, out_ptr, pid, rows, half, n1, n2, n3,
                    xs0, xs1, xs2, xs3, xsd, cs0, cs1, cs2, cs3, csd, ss0, ss1, ss2, ss3, ssd,
                    os0, os1, os2, os3, osd, scale, nw_ptr, nws, n_eps, ANGLES, ROUND, BLOCK_R, BLOCK_H, NORM)
        else:
            _rotate(kx_ptr, cos_ptr, sin_ptr, kout_ptr, pid - x_blocks, krows, half, k1, k2, k3,
                    kxs0, kxs1, kxs2, kxs3, kxsd, kcs0, kcs1, kcs2, kcs3, csd, kss0, kss1, kss2, kss3, ssd,
                    kos0, kos1, kos2, kos3, kosd, scale, knw_ptr, knws, n_eps, ANGLES, ROUND, BLOCK_R, BLOCK_H,
                    NORM)
    else:
        _rotate(x_ptr, cos_ptr, sin_ptr, out_ptr, pid, rows, half, n1, n2, n3,
                xs0, xs1, xs2, xs3, xsd, cs0, cs1, cs2, cs3, csd, ss0, ss1, ss2, ss3, ssd,
                os0, os1, os2, os3, osd, scale, nw_ptr, nws, n_eps, ANGLES, ROUND, BLOCK_R, BLOCK_H, NORM)


# --- host launcher --------------------------------------------------------------------------------
def _rows(name: str, x: TRef, cos: TRef, sin: TRef, out: TRef, angles: bool = False):
    """(rows, [n1, n2, n3], strides of out, x, cos, sin): the leading dims of the four collapsed
    together into ROW_DIMS row dims; each stride set ends with the last dim's stride. ``angles``: cos
    and sin are the half-width angles, broadcast to the result's shape with its last dim halved."""
    shape = out.shape
    if tuple(x.shape) != tuple(shape):
        raise LoweringError(f"{name}: x {x.shape} does not have the result's shape {shape}")
    if not shape or not sizes.is_static(shape[-1]) or shape[-1] % 2:
        raise LoweringError(f"{name}: the last dim of {shape} is not a static even size")
    table_shape = (*shape[:-1], shape[-1] // 2) if angles else shape
    stride_sets = [out.strides, broadcast_strides(x, shape), broadcast_strides(cos, table_shape),
                   broadcast_strides(sin, table_shape)]
    lead, lead_strides = collapse(shape[:-1], [s[:-1] for s in stride_sets])
    if len(lead) > ROW_DIMS:
        raise LoweringError(f"{name}: {len(lead)} row dims after merging (at most {ROW_DIMS})")
    pad = ROW_DIMS - len(lead)
    lead = [1] * pad + list(lead)
    lead_strides = [[0] * pad + list(s) for s in lead_strides]
    rows = lead[0] * lead[1] * lead[2] * lead[3]
    return rows, lead[1:], [tuple(ls) + (s[-1],) for ls, s in zip(lead_strides, stride_sets)]


def _blocks(half: int, *rows) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_H): a column block over the half, rows to fill a TILE (at the rows' bounds)."""
    block_h = min(next_power_of_2(half), MAX_BLOCK_H)
    block_r = max(1, min(max(next_power_of_2(r) for r in rows), TILE // block_h))
    return block_r, block_h


def _tables(angles: tuple | None) -> tuple[float, dict]:
    """(scale, constexprs) for tables given (None) or computed from angles (``(scale, dtype)``)."""
    if angles is None:
        return 1.0, {}
    scale, dtype = angles
    return float(scale), {"ANGLES": True, "ROUND": round_name(dtype)}


def _norm_args(x: TRef, half: int, weights, eps) -> tuple[list, dict]:
    """(the norm's launch arguments: a weight pointer per tensor, their strides, eps; constexprs) for
    per-head norms with ``weights`` (TRefs, or None: no norm). A row must fit one column block."""
    if weights is None:
        return [x, x, 0, 0, 0.0], {}
    if half > MAX_BLOCK_H:
        raise LoweringError(f"rotary: a per-head norm over {2 * half} columns (at most {2 * MAX_BLOCK_H})")
    w = list(weights) + [weights[0]] * (2 - len(weights))
    return [w[0], w[1], w[0].strides[0], w[1].strides[0], float(eps)], {"NORM": True}


def _pairs_last(b, refs: list[TRef], shape, angles: bool = False, deinterleave: bool = False) -> list[TRef]:
    """``refs`` (x, its tables, the result: each broadcasting to ``shape``) seen as [..., D / 2, 2]: the
    interleaved pairs (2i, 2i + 1) of the last dim become the last dim's halves, so the kernel's
    rotate_half over a last dim of 2 is rotate_every_two over D (a view: no copy). With ``angles``
    the two middle refs are the half-width angles, seen as [..., D / 2, 1]: one angle per pair.
    ``deinterleave``: only x (the first ref) is read in pairs (2i, 2i + 1); the tables and the result
    are rotate_half's, pair i at (i, i + D / 2): [..., D / 2, 2] views with strides (s, D / 2 * s)."""
    split = (*shape[:-1], shape[-1] // 2, 2)
    half = (*shape[:-1], shape[-1] // 2)
    views = []
    for k, ref in enumerate(refs):
        if angles and k in (1, 2):
            strides = broadcast_strides(ref, half)
            views.append(b.view(ref, (*half, 1), (*strides, 0)))
            continue
        strides = broadcast_strides(ref, shape)
        pair = (strides[-1], half[-1] * strides[-1]) if deinterleave and k else (2 * strides[-1], strides[-1])
        views.append(b.view(ref, split, (*strides[:-1], *pair)))
    return views


def launch_rotary(b, x: TRef, cos: TRef, sin: TRef, out: TRef, angles: tuple | None = None,
                  norm: tuple | None = None, interleaved: bool = False, deinterleave: bool = False) -> None:
    """``out = x * cos + rotate_half(x) * sin``; ``out`` has ``x``'s shape, cos and sin broadcast to it.
    ``angles=(scale, dtype)``: cos and sin are both the angles the kernel computes the tables from.
    ``norm=(weight, eps)``: x's rows RMS-normalized first (a per-head norm). ``interleaved``:
    rotate_every_two (no norm); ``deinterleave``: x's pairs (2i, 2i + 1) into rotate_half's (no norm)."""
    if interleaved or deinterleave:
        x, cos, sin, out = _pairs_last(b, [x, cos, sin, out], out.shape, angles is not None, deinterleave)
    rows, inner, (os_, xs, cs, ss) = _rows("rotary", x, cos, sin, out, angles is not None)
    half = out.shape[-1] // 2
    block_r, block_h = _blocks(half, rows)
    scale, flags = _tables(angles)
    nargs, nflags = _norm_args(x, half, None if norm is None else norm[:1], None if norm is None else norm[1])
    b.launch(
        "rotary", (triton.cdiv(rows, block_r), triton.cdiv(half, block_h)),
        x, cos, sin, out, x, out,
        rows, half, *inner, *xs, *cs, *ss, *os_,
        0, 1, 1, 1, *[0] * 18, scale,  # no second tensor
        *nargs, PAIR=False, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4, **flags, **nflags,
    )


def launch_rotary_pair(b, q: TRef, k: TRef, cos: TRef, sin: TRef, q_out: TRef, k_out: TRef,
                       angles: tuple | None = None, norms: tuple | None = None, interleaved: bool = False,
                       deinterleave: bool = False) -> None:
    """``q_out`` and ``k_out``: q and k rotated by the same cos and sin (or angles), in one launch.
    ``norms=(q weight, k weight, eps)``: q's and k's rows RMS-normalized first (per-head norms).
    ``interleaved``: rotate_every_two (no norms); ``deinterleave``: pairs (2i, 2i + 1) into (i, i + D / 2)."""
    if q.shape[-1] != k.shape[-1]:
        raise LoweringError(f"rotary_pair: q {q.shape} and k {k.shape} differ in their last dim")
    kcos, ksin = cos, sin
    if interleaved or deinterleave:  # cos and sin broadcast to each of q and k: views of their own for k
        k, kcos, ksin, k_out = _pairs_last(b, [k, cos, sin, k_out], k_out.shape, angles is not None, deinterleave)
        q, cos, sin, q_out = _pairs_last(b, [q, cos, sin, q_out], q_out.shape, angles is not None, deinterleave)
    rows, inner, (os_, xs, cs, ss) = _rows("rotary_pair", q, cos, sin, q_out, angles is not None)
    krows, kinner, (kos, kxs, kcs, kss) = _rows("rotary_pair", k, kcos, ksin, k_out, angles is not None)
    if (kcs[-1], kss[-1]) != (cs[-1], ss[-1]):
        raise LoweringError("rotary_pair: q's and k's tables differ in their last dim's stride")
    half = q_out.shape[-1] // 2
    block_r, block_h = _blocks(half, rows, krows)
    scale, flags = _tables(angles)
    nargs, nflags = _norm_args(q, half, None if norms is None else norms[:2], None if norms is None else norms[2])
    b.launch(
        "rotary", (triton.cdiv(rows, block_r) + triton.cdiv(krows, block_r), triton.cdiv(half, block_h)),
        q, cos, sin, q_out, k, k_out,
        rows, half, *inner, *xs, *cs, *ss, *os_,
        krows, *kinner, *kxs, *kcs[:-1], *kss[:-1], *kos, scale,
        *nargs, PAIR=True, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4, **flags, **nflags,
    )


# --- support check and lowering -------------------------------------------------------------------
def _refusal(vals) -> str | None:
    """Why the kernel cannot rotate x by cos and sin into out (``vals``: their fake tensors), or None."""
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return "operand or result is not a tensor"
    for v in vals:
        if v.dtype not in FLOAT_DTYPES:
            return f"dtype {v.dtype} is not supported (supported: {', '.join(map(str, FLOAT_DTYPES))})"
    x, cos, sin, out = vals
    if not 1 <= x.dim() <= MAX_RANK:
        return f"x has rank {x.dim()} (supported: 1 to {MAX_RANK})"
    if cos.dim() > x.dim() or sin.dim() > x.dim():
        return "cos or sin has a higher rank than x"
    if sizes.shape(out.shape) != sizes.shape(x.shape):
        return f"the result's shape {tuple(out.shape)} is not x's {tuple(x.shape)} (x itself broadcast)"
    d = sizes.size(x.shape[-1])
    if not sizes.is_static(d) or d % 2:
        return f"the last dim of x ({d}) is not a static even size"
    return None


def _norm_refusal(node, first: int, count: int) -> str | None:
    """Why the kernel cannot apply a rotary node's per-head norms (args ``first`` on), or None."""
    weights = [node_value(w) for w in node.args[first:first + count] if w is not None]
    if not weights:
        return None
    d = sizes.size(node_value(node.args[0]).shape[-1])
    if len(weights) != count or d > 2 * MAX_BLOCK_H:
        return f"per-head norms need a weight for each tensor and at most {2 * MAX_BLOCK_H} columns"
    for w in weights:
        if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype not in FLOAT_DTYPES or sizes.size(w.shape[0]) != d:
            return f"a per-head norm's weight is not a float vector of the last dim's {d}"
    return None


def _interleaved_refusal(node, xs: list, first_norm: int) -> str | None:
    """Why the kernel cannot rotate ``xs``' interleaved pairs (their last dim becomes two; interleaved
    or deinterleave), or None; the node's per-head norms, if any, are its args from ``first_norm`` on."""
    interleaved, deinterleave = (node.kwargs.get(k, False) for k in ("interleaved", "deinterleave"))
    if not (interleaved or deinterleave):
        return None
    if interleaved and deinterleave:
        return "interleaved and deinterleave together"
    if any(isinstance(x, torch.Tensor) and x.dim() >= MAX_RANK for x in xs):
        return f"interleaved pairs of a rank-{MAX_RANK} tensor (at most {MAX_RANK - 1})"
    if (any(a is not None for a in node.args[first_norm:first_norm + len(xs)])
            or node.kwargs.keys() - {"interleaved", "deinterleave", "out_dtype"}):
        return "interleaved pairs take no per-head norm"
    return None


def supported(node) -> str | None:
    return (_refusal([node_value(a) for a in node.args[:3]] + [node.meta.get("val")]) or _norm_refusal(node, 3, 1)
            or _interleaved_refusal(node, [node_value(node.args[0])], 3))


def supported_pair(node) -> str | None:
    q, k, cos, sin = (node_value(a) for a in node.args[:4])
    outs = node.meta.get("val")
    if not isinstance(outs, (tuple, list)) or len(outs) != 2:
        return "the result is not a pair of tensors"
    for name, x, out in (("q", q, outs[0]), ("k", k, outs[1])):
        reason = _refusal([x, cos, sin, out])
        if reason is not None:
            return f"{name}: {reason}"
    if sizes.size(q.shape[-1]) != sizes.size(k.shape[-1]):
        return f"q and k differ in their last dim ({q.shape[-1]} and {k.shape[-1]})"
    return _norm_refusal(node, 4, 2) or _interleaved_refusal(node, [q, k], 4)


def _angles_refusal(x, angles, scale, dtype, out) -> str | None:
    """Why the kernel cannot rotate x by tables computed from ``angles``, or None."""
    if not isinstance(angles, torch.Tensor) or angles.dtype != torch.float32:
        return "the angles are not a float32 tensor"
    if dtype not in FLOAT_DTYPES or not isinstance(scale, (int, float)):
        return f"table dtype {dtype} or scale {scale!r} is not supported"
    if not isinstance(x, torch.Tensor) or angles.dim() > x.dim() or angles.dim() == 0:
        return "the angles' rank is 0 or higher than x's"
    d = sizes.size(x.shape[-1])
    if not sizes.is_static(d) or sizes.size(angles.shape[-1]) != d // 2:
        return f"the angles' last dim ({angles.shape[-1]}) is not half of x's ({x.shape[-1]})"
    return _refusal([x, x, x, out])


def supported_angles(node) -> str | None:
    (x, angles), (scale, dtype) = (node_value(a) for a in node.args[:2]), node.args[2:4]
    return (_angles_refusal(x, angles, scale, dtype, node.meta.get("val")) or _norm_refusal(node, 4, 1)
            or _interleaved_refusal(node, [x], 4))


def supported_pair_angles(node) -> str | None:
    (q, k, angles), (scale, dtype) = (node_value(a) for a in node.args[:3]), node.args[3:5]
    outs = node.meta.get("val")
    if not isinstance(outs, (tuple, list)) or len(outs) != 2:
        return "the result is not a pair of tensors"
    for name, x, out in (("q", q, outs[0]), ("k", k, outs[1])):
        reason = _angles_refusal(x, angles, scale, dtype, out)
        if reason is not None:
            return f"{name}: {reason}"
    return _norm_refusal(node, 5, 2) or _interleaved_refusal(node, [q, k], 5)


def _norms(b, node, first: int, count: int) -> tuple | None:
    """The per-head norms of a rotary node (``passes/head_norm.py``): its ``count`` weights from arg
    ``first`` on, then eps, as (TRef, ..., eps); None without."""
    weights = node.args[first:first + count]
    if len(weights) < count or any(w is None for w in weights):
        return None
    return (*(b.ref(w) for w in weights), float(node.args[first + count]))


def _pairing(node) -> dict:
    """A rotary node's pair layout flags, as the launchers take them."""
    return {k: node.kwargs.get(k, False) for k in ("interleaved", "deinterleave")}


def rotary(b, node):
    """tritondelegate::rotary(x, cos, sin[, norm, norm_eps])"""
    x, cos, sin = (b.ref(a) for a in node.args[:3])
    launch_rotary(b, x, cos, sin, b.out(node), norm=_norms(b, node, 3, 1),
                  **_pairing(node))


def rotary_pair(b, node):
    """tritondelegate::rotary_pair(q, k, cos, sin[, q_norm, k_norm, norm_eps]) -> (q rotated, k rotated)"""
    q, k, cos, sin = (b.ref(a) for a in node.args[:4])
    launch_rotary_pair(b, q, k, cos, sin, b.out(node, 0), b.out(node, 1), norms=_norms(b, node, 4, 2),
                       **_pairing(node))


def rotary_angles(b, node):
    """tritondelegate::rotary_angles(x, angles, scale, dtype[, norm, norm_eps])"""
    x, angles = (b.ref(a) for a in node.args[:2])
    launch_rotary(b, x, angles, angles, b.out(node), angles=tuple(node.args[2:4]), norm=_norms(b, node, 4, 1),
                  **_pairing(node))


def rotary_pair_angles(b, node):
    """tritondelegate::rotary_pair_angles(q, k, angles, scale, dtype[, q_norm, k_norm, norm_eps])"""
    q, k, angles = (b.ref(a) for a in node.args[:3])
    launch_rotary_pair(b, q, k, angles, angles, b.out(node, 0), b.out(node, 1), angles=tuple(node.args[3:5]),
                       norms=_norms(b, node, 5, 2), **_pairing(node))
