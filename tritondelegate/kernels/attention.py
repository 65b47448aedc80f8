"""Scaled dot-product attention (``aten.scaled_dot_product_attention``): one flash-attention launch.

    out[b, h, i, :] = sum_j softmax_j(s[i, j]) v[b, hk, j, :]        hk = h // (Hq / Hkv)  (GQA)
    s[i, j] = scale * <q[b, h, i, :], k[b, hk, j, :]> + bias[b, h, i, j]
    bias = 0 where kept, -inf where a bool mask is False or (is_causal) j > i, else the float mask

``tritondelegate::sdpa_positions`` (``passes/position_mask.py``: a mask ``arange(Lk) <= positions``
that a KV-cache decoder builds per call) is the same kernel with ``MASK="positions"``: the mask pointer
is then the queries' positions (one integer per row, [B, H, Lq] strides), key j is kept when j is at
most the row's position, and key tiles past the block's last position are never read. With a sliding
window (``WINDOW`` > 0: the op's ``window``) key j is also dropped when j <= position - WINDOW, and the
tiles wholly before the block's first position - WINDOW + 1 are never read either: a sliding-window
layer reads at most WINDOW keys (and a tile each side) per row, however long the cache.

``tritondelegate::sdpa_sinks`` (``passes/eager_attention.py``: GPT-OSS's attention sinks) is the same
kernel with ``SINKS``: head h has a sink logit t_h that joins each of its rows' softmax denominators
but adds no value, ``out = sum_j e^(s_j - M) v_j / (e^(t_h - M) + sum_j e^(s_j - M))``. The online
softmax starts from running max t_h (log2 domain) and running sum 1 instead of -inf and 0; split
programs leave it out and ``attention_combine`` counts it once.

Short queries (decode: a few rows per head) take two more forms, chosen by shape at lower time:

* **packed heads** (``PACK``): with grouped-query attention the query heads that share a key head
  share one program, their rows stacked in the block (row r: query r % Lq of head h0 + r // Lq), so
  the block's rows are real queries, not padding up to tl.dot's 16, and each key/value tile is read
  once per key head instead of once per query head;
* **split keys** (``SPLIT``, flash-decoding): when the grid would leave SMs idle (Llama-3-8B's 8 key
  heads at batch 1 on 132 SMs) and the cache is long, grid axis 2 splits the keys into runs of
  ``split_n`` (whole tiles); each program stores its rows' unnormalized accumulator, running max and
  running sum (fp32 partials in the delegate's scratch), and ``attention_combine_kernel`` merges the
  splits: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. A split that keeps no key (past the
  positions of a decode step) stores m = -inf and adds nothing.

``attention_append_kernel`` (``passes/kv_append.py``: a decode step's cache updates, as
flash-attention's ``flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new)``) first writes
the new rows ``k[b, hk, index[t]] = k_new[b, hk, t]`` (and v) into the caches, then runs
``attention_kernel`` over them. A launch has no grid-wide barrier: each program writes the new rows
that fall into its own keys (its split's with SPLIT, else all), then ``tl.debug_barrier()``, then
reads. A row is read only by programs that wrote it; programs of one key head that write the same row
(its query heads when not packed, its other query blocks) write the same bytes.

``tritondelegate::sdpa_softcap`` (``passes/eager_attention.py``: Gemma 2's soft-capped scores) is the
same kernel with ``SOFTCAP``: each scaled score s becomes ``SOFTCAP * tanh(s / SOFTCAP)`` before the mask
is applied (in the log2 domain: the cap times log2(e)).

The keys are walked in BLOCK_N tiles with an online softmax (running max ``m``, running sum ``l``,
fp32 accumulator rescaled by exp(m_old - m_new)); scores live in the log2 domain (log2(e) folded into
``scale``) so every exponential is an ``exp2``. A row whose every key is masked out gives 0, as
PyTorch's safe softmax does. Operands are read through their strides (a ``view + transpose`` needs no
copy; batch/head broadcast is stride 0); the head dims are padded to powers of two and masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import ops as td_ops
from ..errors import LoweringError
from . import sizes, target
from .refs import FLOAT_DTYPES, TRef, broadcast_strides, node_value
from .sizes import next_power_of_2

aten = torch.ops.aten

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535  # CUDA's limit on grid axis 1 (batch * heads)
MAX_PACKED_ROWS = 64  # a key head's query heads share one program while their rows fit this many
SPLIT_MIN_TILES = 4  # key tiles a split of a short-query attention reads at least
MAX_SPLITS = 256  # splits of one row's keys at most (attention_combine reads them in one tile)


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, acc, DOT_UPCAST: tl.constexpr):
    # acc + a @ b in fp32. fp32 operands use IEEE products (no TF32) so fp32 matches eager; the
    # interpreter computes low-precision dots wrongly, so DOT_UPCAST widens the tiles there.
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _attention_tiles(
    acc, l_i, m_i, q, k_base, v_base, mask_rows,
    offs_m, offs_d, offs_dv, sk_n, sk_d, sv_n, sv_d, smask_n,
    Lq, Lk, qk_scale, lo, hi,
    E: tl.constexpr, EV: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    BOUNDARY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0, WINDOW: tl.constexpr = 0,
):
    # Key tiles [lo, hi). BOUNDARY tiles may cross Lk or the causal diagonal and are masked;
    # the others are whole and below the diagonal, so they skip that work.
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        start = tl.cast(start_n, tl.int64)  # the tile's base in int64; offsets inside it in int32
        kt_ptrs = (k_base + start * sk_n) + (offs_n0[None, :] * sk_n + offs_d[:, None] * sk_d)
        v_ptrs = (v_base + start * sv_n) + (offs_n0[:, None] * sv_n + offs_dv[None, :] * sv_d)
        if BOUNDARY:
            kt = tl.load(kt_ptrs, mask=(offs_d[:, None] < E) & (offs_n[None, :] < Lk), other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < Lk) & (offs_dv[None, :] < EV), other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=offs_d[:, None] < E, other=0.0)
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < EV, other=0.0)
        qk = _dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_UPCAST) * qk_scale
        if SOFTCAP > 0:  # s = cap * tanh(s / cap) on the score s = qk / log2(e), kept in the log2 domain
            qk = (SOFTCAP * 1.4426950408889634) * _tanh(qk / (SOFTCAP * 1.4426950408889634))
        if MASK != "none":
            mask_ptrs = (mask_rows + start * smask_n) + offs_n0[None, :] * smask_n
            in_bounds = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
            if MASK == "positions":  # key j kept when j <= the query's position (one per row)
                qpos = tl.load(mask_rows, mask=offs_m[:, None] < Lq, other=-1)
                keep = offs_n[None, :] <= qpos
                if WINDOW > 0:  # and j > position - WINDOW: the last WINDOW keys up to it
                    keep = keep & (offs_n[None, :] > qpos - WINDOW)
                qk = tl.where(keep, qk, float("-inf"))
            elif MASK == "bool":
                keep = tl.load(mask_ptrs, mask=in_bounds, other=0)
                qk = tl.where(keep != 0, qk, float("-inf"))
            else:
                bias = tl.load(mask_ptrs, mask=in_bounds, other=0.0).to(tl.float32)
                # To the log2 domain; finite values below -FLT_MAX / log2(e) (HF's finfo.min) stay
                # finite, so a row masked by them averages v as eager does instead of giving 0.
                qk += tl.where(bias > -2.0e38, bias * 1.4426950408889634, bias)  # LOG2E
        if BOUNDARY:
            valid = offs_n[None, :] < Lk
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASK != "none":
            # No key of the row kept yet: subtract 0, not -inf (which would give NaN).
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, stat_ptr, sink_ptr,
    sq_b, sq_h, sq_m, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    smask_b, smask_h, smask_m, smask_n,
    so_b, so_h, so_m, so_d,
    H, GROUP, Lq, Lk, qk_scale, split_n,
    E: tl.constexpr, EV: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_UPCAST: tl.constexpr, PACK: tl.constexpr = 1, SPLIT: tl.constexpr = False, SINKS: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0, WINDOW: tl.constexpr = 0,
):
    tl.static_assert(PACK == 1 or not CAUSAL, "packed heads take no causal mask")
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // (H // PACK)
    h0 = pid_bh % (H // PACK) * PACK  # the program's first query head; its PACK heads share key head hk
    hk = h0 // GROUP
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # the block's rows: query r (% Lq, of head h0 + r // Lq)
    row_ok = r < PACK * Lq
    if PACK == 1:
        offs_m = r
    else:
        offs_m = r % Lq
    offs_m = tl.where(row_ok, offs_m, Lq)  # the row's query; past the block's rows Lq, which every mask drops
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_rows = _row_ptrs(q_ptr, b, sq_b, h0, sq_h, sq_m, pid_m, Lq, BLOCK_M, PACK)[:, None]
    q = tl.load(q_rows + offs_d[None, :] * sq_d, mask=row_ok[:, None] & (offs_d[None, :] < E), other=0.0)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    mask_rows = _row_ptrs(mask_ptr, b, smask_b, h0, smask_h, smask_m, pid_m, Lq, BLOCK_M, PACK)[:, None]

    if SINKS and not SPLIT:
        # The row's head's sink logit joins its denominator, not its values: the online softmax starts
        # from running max = the sink (log2 domain) and running sum = 2^0 = 1. Split programs leave it
        # to attention_combine, so that it counts once.
        m_i = tl.load(sink_ptr + _row_heads(h0, r, Lq, BLOCK_M, PACK), mask=row_ok, other=0.0).to(tl.float32)
        m_i = m_i * 1.4426950408889634  # LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, whole, hi = _key_range(mask_rows, offs_m, pid_m, Lq, Lk, MASK, CAUSAL, BLOCK_M, BLOCK_N, WINDOW)
    if SPLIT:  # this program's share of the keys: [split * split_n, + split_n), split_n whole tiles
        start = tl.program_id(2) * split_n
        hi = tl.minimum(hi, start + split_n)
        lo = tl.maximum(lo, start)
        whole = tl.maximum(tl.minimum(whole, hi), lo)
    acc, l_i, m_i = _attention_tiles(
        acc, l_i, m_i, q, k_base, v_base, mask_rows,
        offs_m, offs_d, offs_dv, sk_n, sk_d, sv_n, sv_d, smask_n,
        Lq, Lk, qk_scale, lo, whole,
        E, EV, MASK, CAUSAL, False, BLOCK_M, BLOCK_N, DOT_UPCAST, SOFTCAP, WINDOW,
    )
    acc, l_i, m_i = _attention_tiles(
        acc, l_i, m_i, q, k_base, v_base, mask_rows,
        offs_m, offs_d, offs_dv, sk_n, sk_d, sv_n, sv_d, smask_n,
        Lq, Lk, qk_scale, whole, hi,
        E, EV, MASK, CAUSAL, True, BLOCK_M, BLOCK_N, DOT_UPCAST, SOFTCAP, WINDOW,
    )
    d_ok = offs_dv[None, :] < EV
    if SPLIT:
        # Partials of row (b, h_r, query) and this split, for attention_combine_kernel: the unnormalized
        # accumulator, the running max (-inf when no key was kept: l = 0) and the running sum.
        # ((b * H + h) * Lq + query) = (b * H + h0) * Lq + r, as PACK heads' rows are consecutive
        part = ((b * H + h0) * Lq + r) * tl.num_programs(2) + tl.program_id(2)
        tl.store(part_ptr + part[:, None] * EV + offs_dv[None, :], acc, mask=row_ok[:, None] & d_ok)
        tl.store(stat_ptr + part * 2, tl.where(l_i > 0.0, m_i, float("-inf")), mask=row_ok)
        tl.store(stat_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        # A row with no key kept (or no key at all) has l = 0 and acc = 0: it gives 0, as torch does.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = _row_ptrs(out_ptr, b, so_b, h0, so_h, so_m, pid_m, Lq, BLOCK_M, PACK)[:, None]
        tl.store(o_rows + offs_dv[None, :] * so_d, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok)


@triton.jit
def attention_append_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, stat_ptr, sink_ptr,
    sq_b, sq_h, sq_m, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    smask_b, smask_h, smask_m, smask_n,
    so_b, so_h, so_m, so_d,
    H, GROUP, Lq, Lk, qk_scale, split_n,
    kn_ptr, vn_ptr, idx_ptr,
    skn_b, skn_h, skn_t, skn_d,
    svn_b, svn_h, svn_t, svn_d,
    sidx, Lnew,
    E: tl.constexpr, EV: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_UPCAST: tl.constexpr, PACK: tl.constexpr = 1, SPLIT: tl.constexpr = False, SINKS: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0, WINDOW: tl.constexpr = 0,
):
    # k[b, hk, wrap(idx[t]), :] = k_new[b, hk, t, :] and v[..] = v_new[..] for t < Lnew, then attention_kernel
    # over the cache. No grid-wide barrier exists, so each program writes every new row that falls into
    # the keys it may read ([lo, lo + split_n) with SPLIT, else all of them), waits for its own threads,
    # then reads: a key row is read only by programs that wrote it themselves; programs of one key head
    # (other query heads, other query blocks) that write the same row write the same bytes.
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // (H // PACK)
    hk = pid_bh % (H // PACK) * PACK // GROUP
    lo = 0
    hi = Lk
    if SPLIT:
        lo = tl.program_id(2) * split_n
        hi = tl.minimum(Lk, lo + split_n)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for t in range(0, Lnew):
        j = tl.load(idx_ptr + t * sidx).to(tl.int64)
        j = tl.where(j < 0, j + Lk, j)  # a negative index counts from the end, once (as index_put's)
        # a row out of [0, Lk) (an error in eager) is written by no program
        _copy_row(k_ptr + b * sk_b + hk * sk_h + j * sk_n, kn_ptr + b * skn_b + hk * skn_h + t * skn_t,
                  j, lo, hi, offs_d, E, sk_d, skn_d)
        _copy_row(v_ptr + b * sv_b + hk * sv_h + j * sv_n, vn_ptr + b * svn_b + hk * svn_h + t * svn_t,
                  j, lo, hi, offs_dv, EV, sv_d, svn_d)
    tl.debug_barrier()  # the program's own rows are written before any of its threads reads a key tile
    attention_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, stat_ptr, sink_ptr,
        sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        smask_b, smask_h, smask_m, smask_n, so_b, so_h, so_m, so_d,
        H, GROUP, Lq, Lk, qk_scale, split_n,
        E, EV, MASK, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_UPCAST, PACK, SPLIT, SINKS, SOFTCAP, WINDOW,
    )


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0  # as the pointwise kernels' tanh


@triton.jit
def _copy_row(dst_row, src_row, j, lo, hi, offs, n, s_dst, s_src):
    # dst_row[offs] = src_row[offs] (offs < n) when lo <= j < hi: row j of the cache, when it is one of
    # the keys this program reads. j is spread over the lanes: the interpreter takes no scalar in a mask.
    at = j + offs * 0
    ok = (offs < n) & (at >= lo) & (at < hi)
    x = tl.load(src_row + offs * s_src, mask=ok, other=0.0)
    tl.store(dst_row + offs * s_dst, x.to(dst_row.dtype.element_ty), mask=ok)


@triton.jit
def _row_heads(h0, r, Lq, BLOCK_M: tl.constexpr, PACK: tl.constexpr):
    # The query head of each row of the block: h0, or with packed heads h0 + r // Lq.
    if PACK == 1:
        return h0 + tl.zeros([BLOCK_M], dtype=tl.int64)
    else:
        return h0 + r // Lq


@triton.jit
def _row_ptrs(ptr, b, s_b, h0, s_h, s_m, pid_m, Lq, BLOCK_M: tl.constexpr, PACK: tl.constexpr):
    # Where each row of the block starts: query pid_m * BLOCK_M + r of head h0 (PACK == 1), or packed
    # row pid_m * BLOCK_M + r: query (that % Lq) of head h0 + (that // Lq). Bases in int64 (sizes may
    # pass 2^31), offsets inside a block in int32.
    rows = tl.arange(0, BLOCK_M)
    if PACK == 1:
        return (ptr + b * s_b + h0 * s_h + tl.cast(pid_m * BLOCK_M, tl.int64) * s_m) + rows * s_m
    else:
        r = pid_m * BLOCK_M + rows
        return (ptr + b * s_b + h0 * s_h) + ((r // Lq) * s_h + (r % Lq) * s_m)


@triton.jit
def _key_range(mask_rows, offs_m, pid_m, Lq, Lk, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = 0):
    # (lo, whole, hi): the block reads key tiles [lo, hi); those below `whole` need no bounds/causal mask.
    lo = 0
    if CAUSAL:
        # Top-left aligned (key j visible from query i when j <= i): tiles past the diagonal
        # are skipped, tiles wholly below it need no mask.
        whole = tl.minimum(pid_m * BLOCK_M + 1, Lk) // BLOCK_N * BLOCK_N
        hi = tl.minimum((pid_m + 1) * BLOCK_M, Lk)
    elif MASK == "positions":
        # No query of the block sees a key past the block's last position: those tiles are skipped
        # (a decode step over a long cache reads only the keys written so far).
        last = tl.max(tl.load(mask_rows, mask=offs_m[:, None] < Lq, other=-1))
        hi = tl.maximum(tl.minimum(last + 1, Lk), 0).to(tl.int32)
        whole = hi // BLOCK_N * BLOCK_N
        if WINDOW > 0:
            # Nor a key at or before the block's first position - WINDOW: the tiles wholly before it are
            # skipped too (a sliding-window layer reads at most WINDOW keys per row, whatever the cache).
            first = tl.min(tl.load(mask_rows, mask=offs_m[:, None] < Lq, other=Lk))
            lo = (tl.maximum(first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N).to(tl.int32)
    else:
        whole = Lk // BLOCK_N * BLOCK_N
        hi = Lk
    return lo, whole, hi


@triton.jit
def attention_combine_kernel(
    part_ptr, stat_ptr, out_ptr, sink_ptr, so_b, so_h, so_m, so_d, H, Lq, S,
    EV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, SINKS: tl.constexpr = False,
):
    # One query row (b, h, i) = program: out = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp2(m_s - max m).
    # SINKS: head h's sink logit t joins the maximum and adds w_t = exp2(t - max m) to the sum, once.
    row = tl.program_id(0).to(tl.int64)  # (b * H + h) * Lq + i
    i = row % Lq
    h = row // Lq % H
    b = row // Lq // H
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    split = row * S + offs_s
    m = tl.load(stat_ptr + split * 2, mask=offs_s < S, other=float("-inf"))
    l = tl.load(stat_ptr + split * 2 + 1, mask=offs_s < S, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634  # LOG2E
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # a split that kept no key: 0
    acc = tl.load(part_ptr + split[:, None] * EV + offs_d[None, :],
                  mask=(offs_s[:, None] < S) & (offs_d[None, :] < EV), other=0.0)
    acc = tl.sum(acc * w[:, None], 0)
    total = tl.sum(w * l, 0)
    if SINKS:
        total += tl.exp2(sink - m_max)
    out = acc / tl.where(total == 0.0, 1.0, total)  # no key kept in any split: 0, as torch gives
    tl.store(out_ptr + b * so_b + h * so_h + i * so_m + offs_d * so_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < EV)


# --- host launcher --------------------------------------------------------------------------------
def _as_4d(ref: TRef, b) -> TRef:
    """``ref`` with size-1, stride-0 dims prepended up to rank 4 (a view; no copy)."""
    pad = 4 - ref.ndim
    return b.view(ref, (1,) * pad + ref.shape, (0,) * pad + ref.strides)


def _bcast(shape, strides, target) -> tuple[int, ...]:
    """Strides of a 4-d operand seen at ``target``'s size: 0 on broadcast (size-1) dims."""
    return tuple(0 if n == 1 and t != 1 else s for n, s, t in zip(shape, strides, target))


def block_sizes(lq: int, lk: int, head_dim: int, dtype: torch.dtype,
                masked: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for an H100-class GPU.

    fp16/bf16: 128 x 64 tiles on 8 warps for heads up to 128 (the FlashAttention-2 / Triton tutorial
    shape, wgmma); 64 x 32 for larger heads so the fp32 accumulator stays in registers. With a mask
    (``masked``) and heads over 64, the mask tile's registers push 128 x 64 to about 600 spilled
    bytes a thread: 128 x 32 there. fp32 runs IEEE FMA dots, whose operands live in registers:
    smaller tiles. Each choice was compiled for sm_90 with triton 3.6 and 3.9
    (``scripts/compile_check.py``): no register spills, or a few dozen bytes (fp32 with a float mask,
    decode with a bool mask). Short sequences (decode, Lq = 1) shrink the tiles, down to the 16 that
    ``tl.dot`` needs. Not yet timed on a GPU.
    """
    if dtype == torch.float32:
        block_m, block_n = 32, (32 if head_dim <= 64 else 16)
        num_warps, num_stages = (4 if head_dim <= 64 else 8), 2
    elif head_dim <= 128:
        block_m, block_n, num_warps, num_stages = 128, (32 if masked and head_dim > 64 else 64), 8, 3
    else:
        block_m, block_n, num_warps, num_stages = 64, 32, 8, 2
    block_m = min(block_m, max(16, next_power_of_2(lq)))
    block_n = min(block_n, max(16, next_power_of_2(lk)))
    if block_m < 64 and dtype != torch.float32:
        num_warps = 4
    return block_m, block_n, num_warps, num_stages


@dataclass(frozen=True)
class Append:
    """New key/value rows the attention launch writes into its caches first (``attention_append``):
    ``k[b, h, index[t]] = k_new[b, h, t]`` (and v), k_new/v_new [B, Hkv, Lnew, E/Ev], index [Lnew]."""

    k_new: TRef
    v_new: TRef
    index: TRef


def _pack(group: int, is_causal: bool, lq) -> int:
    """Query heads per program: a key head's query heads share one program while their rows fit."""
    return group if group > 1 and not is_causal and sizes.upper(lq) * group <= MAX_PACKED_ROWS else 1


def launch_attention(b, out: TRef, q: TRef, k: TRef, v: TRef, mask: TRef | None, is_causal: bool, scale: float,
                     positions: bool = False, sinks: TRef | None = None, append: Append | None = None,
                     softcap: float = 0.0, window: int = 0) -> None:
    """``out = sdpa(q, k, v, mask)``; q [.., Hq, Lq, E], k/v [.., Hkv, Lk, E/Ev], rank 2 to 4.
    ``positions``: ``mask`` is the queries' positions ([.., Lq, 1] integers), the mask
    ``arange(Lk) <= positions`` (and with ``window`` > 0 ``arange(Lk) > positions - window``);
    ``sinks``: a sink logit per query head ([Hq], contiguous);
    ``append``: rows written into k and v (4-d, batch not broadcast) before they are read;
    ``softcap``: the scaled scores s become softcap * tanh(s / softcap) before the mask (0: not)."""
    out4, q4, k4, v4 = (_as_4d(t, b) for t in (out, q, k, v))
    batch, heads, lq, ev = out4.shape
    lk, e = k4.shape[2], q4.shape[3]
    sq = _bcast(q4.shape, q4.strides, (batch, heads, lq, e))
    sk = _bcast(k4.shape, k4.strides, (batch, k4.shape[1], lk, e))
    sv = _bcast(v4.shape, v4.strides, (batch, v4.shape[1], lk, ev))
    group = heads // k4.shape[1]
    if mask is None:
        mask_arg, smask, kind = q4, (0, 0, 0, 0), "none"
    elif positions:  # [.., Lq, 1] positions: one per row, stride 0 along the keys
        mask_arg, smask, kind = mask, broadcast_strides(mask, (batch, heads, lq, 1))[:3] + (0,), "positions"
    else:
        mask_arg, smask = mask, broadcast_strides(mask, (batch, heads, lq, lk))
        kind = "bool" if mask.dtype == torch.bool else "float"
    pack = _pack(group, is_causal, lq)
    block_m, block_n, num_warps, num_stages = block_sizes(pack * lq, lk, max(e, ev), q.dtype, kind in ("bool", "float"))
    split_n = split_keys(batch * heads // pack, pack * lq, lk, block_m, block_n)
    splits = 1 if split_n is None else triton.cdiv(lk, split_n)
    part = stat = q4
    sink_arg = q4 if sinks is None else sinks  # without sinks a stand-in, never read
    if split_n is not None:
        part = b.alloc((batch * heads * lq, splits, ev), torch.float32)
        stat = b.alloc((batch * heads * lq, splits, 2), torch.float32)
    b.launch(
        "attention" if append is None else "attention_append",
        (triton.cdiv(pack * lq, block_m), batch * heads // pack, splits),
        q4, k4, v4, mask_arg, out4, part, stat, sink_arg,
        *sq, *sk, *sv, *smask, *out4.strides,
        heads, group, lq, lk, float(scale) * LOG2E, split_n or 0, *_append_args(append, batch, k4.shape[1], e, ev),
        E=e, EV=ev, MASK=kind, CAUSAL=bool(is_causal),
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, next_power_of_2(e)), BLOCK_DV=max(16, next_power_of_2(ev)),
        DOT_UPCAST=False, PACK=pack, SPLIT=split_n is not None, SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages, **({"SOFTCAP": float(softcap)} if softcap else {}),
        **({"WINDOW": int(window)} if window else {}),
    )
    if split_n is not None:
        b.launch("attention_combine", (batch * heads * lq,), part, stat, out4, sink_arg, *out4.strides, heads, lq,
                 splits, EV=ev, BLOCK_S=next_power_of_2(splits), BLOCK_DV=max(16, next_power_of_2(ev)),
                 SINKS=sinks is not None, num_warps=4)


def _append_args(append: Append | None, batch, kv_heads, e, ev) -> tuple:
    """``attention_append``'s arguments after ``split_n``: the new rows' pointers, their strides seen
    at [B, Hkv, Lnew, E/Ev], the index's stride and Lnew; none for plain ``attention``."""
    if append is None:
        return ()
    lnew = append.index.shape[0] if append.index.ndim else 1
    skn = broadcast_strides(append.k_new, (batch, kv_heads, lnew, e))
    svn = broadcast_strides(append.v_new, (batch, kv_heads, lnew, ev))
    sidx = append.index.strides[0] if append.index.ndim else 0
    return (append.k_new, append.v_new, append.index, *skn, *svn, sidx, lnew)


def one_query_block(node) -> bool:
    """Whether ``node``'s attention launch (sdpa, sdpa_positions, sdpa_sinks or sdpa_softcap of rank 4) has
    one query block per (batch, key head, key split) at the sizes' upper bounds: a decode step. Only then
    does an append of new cache rows ride in the launch (``passes/kv_append.py``): each program writes the
    rows of its keys, and more query blocks would write them again for nothing."""
    p = attention_params(node)
    q, k, v, out = [node_value(p[n]) for n in ("query", "key", "value")] + [node.meta.get("val")]
    if not all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in (q, k, v, out)):
        return False
    masked = p.get("attn_mask") is not None  # a bool or float mask (positions are none)
    lq = sizes.size(out.shape[2])
    pack_lq = _pack(out.shape[1] // k.shape[1], bool(p["is_causal"]), lq) * lq
    block_m = block_sizes(pack_lq, sizes.size(k.shape[2]), max(q.shape[3], v.shape[3]), q.dtype, masked)[0]
    return sizes.upper(pack_lq) <= block_m


def split_keys(programs, rows, lk, block_m: int, block_n: int) -> int | None:
    """Keys per program when a short-query attention splits its keys (flash-decoding), else None.

    A decode step has one row tile per (batch, key head): Llama-3-8B's 8 key heads at batch 1 would
    stream the whole KV cache from 8 of an H100's 132 SMs. When the grid has fewer programs than the
    target has SMs and the keys make at least SPLIT_MIN_TILES tiles per split, they are split until
    there are two programs per SM (as many in flight as keep HBM busy; as for GEMV), each split a
    whole number of key tiles; ``attention_combine`` then merges the splits' partial softmaxes (one
    more launch, reading a few KiB). Sizes at their upper bounds, as every tuning decision."""
    gpu = target.current()
    programs, rows, keys = sizes.upper((programs, rows, lk))
    if not gpu.split_attention or rows > block_m or programs >= gpu.num_sms:
        return None
    tiles = triton.cdiv(keys, block_n)
    splits = min(tiles // SPLIT_MIN_TILES, triton.cdiv(2 * gpu.num_sms, programs), MAX_SPLITS)
    if splits < 2:
        return None
    return triton.cdiv(tiles, splits) * block_n


# --- support check and lowering -------------------------------------------------------------------
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_params(node) -> dict:
    params = dict(_DEFAULTS)
    params.update(zip(_PARAMS, node.args))
    params.update(node.kwargs)
    return params


def supported(node) -> str | None:
    """None when the kernel computes this sdpa node exactly as eager does, else the reason."""
    return _sdpa_refusal(sdpa_params(node), node)


def _sdpa_refusal(p: dict, node) -> str | None:
    q, k, v = (node_value(p[n]) for n in ("query", "key", "value"))
    out = node.meta.get("val")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v, out)):
        return "query, key, value and the result must be tensors"
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"query/key/value dtypes {q.dtype}/{k.dtype}/{v.dtype}: all three must be one of "
                f"{', '.join(map(str, FLOAT_DTYPES))}")
    if p["dropout_p"] != 0:
        return (f"dropout_p={p['dropout_p']} is not supported (the kernel is inference-only); "
                "export the model in eval mode or pass dropout_p=0")
    if not (q.ndim == k.ndim == v.ndim == out.ndim) or not 2 <= q.ndim <= 4:
        return (f"query/key/value of ranks {q.ndim}/{k.ndim}/{v.ndim}: the kernel takes ranks 2 to 4, "
                "all equal")
    e, ev = q.shape[-1], v.shape[-1]
    if k.shape[-1] != e or k.shape[-2] != v.shape[-2]:
        return f"key {tuple(k.shape)} does not match query {tuple(q.shape)} / value {tuple(v.shape)}"
    if max(e, ev) > MAX_HEAD_DIM:
        return f"head dim {max(e, ev)} is larger than {MAX_HEAD_DIM}"
    if q.ndim == 4:
        for name, t in (("query", q), ("key", k), ("value", v)):
            if t.shape[0] not in (1, out.shape[0]):
                return f"{name} batch {t.shape[0]} does not broadcast to {out.shape[0]}"
    hq, hkv = (out.shape[-3], k.shape[-3]) if q.ndim >= 3 else (1, 1)
    if q.ndim >= 3 and q.shape[-3] not in (1, hq):
        return f"query heads {q.shape[-3]} do not broadcast to {hq}"
    if v.ndim >= 3 and v.shape[-3] != hkv:
        return f"key heads {hkv} and value heads {v.shape[-3]} differ"
    if hkv == 0 or hq % hkv or (hkv not in (1, hq) and not p["enable_gqa"]):
        return (f"{hq} query heads over {hkv} key/value heads: needs enable_gqa=True and a "
                "query head count that is a multiple of the key/value head count")
    batch = out.shape[0] if out.ndim == 4 else 1
    if batch * hq > MAX_GRID_Y:
        return f"batch * heads = {batch * hq} is more than the {MAX_GRID_Y} the launch grid allows"
    mask = p["attn_mask"]
    if mask is not None:
        m = node_value(mask)
        if not isinstance(m, torch.Tensor):
            return "attn_mask must be a tensor"
        if m.dtype != torch.bool and m.dtype not in FLOAT_DTYPES:
            return f"attn_mask dtype {m.dtype}: it must be bool (True = attend) or a float dtype (added)"
        target = tuple(out.shape[:-1]) + (k.shape[-2],)
        if m.ndim > len(target) or any(a not in (1, t) for a, t in zip(reversed(m.shape), reversed(target))):
            return f"attn_mask {tuple(m.shape)} does not broadcast to the scores {target}"
        if p["is_causal"]:
            return ("is_causal=True with an attn_mask: PyTorch's backends disagree on it (the math "
                    "path refuses it); fold the causal mask into attn_mask")
    return None


def _seq_major(node) -> bool:
    """Whether every user swaps the head and sequence dims (``out.transpose(1, 2)`` before the
    output projection): then the result is stored as [B, Lq, H, Ev] and that transpose and the
    reshape after it are free views, as with FlashAttention's output layout."""
    shape = tuple(node.meta["val"].shape)

    def swaps(user):
        if user.target == aten.permute.default:
            return [d % 4 for d in user.args[1]] == [0, 2, 1, 3]
        if user.target == aten.transpose.int:
            return {d % 4 for d in user.args[1:3]} == {1, 2}
        if user.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                           aten.alias.default):
            # A same-shape view (HF's sdpa wrapper leaves one) passes the layout on.
            val = user.meta.get("val")
            return isinstance(val, torch.Tensor) and tuple(val.shape) == shape and all_swap(user)
        return False

    def all_swap(n):
        return bool(n.users) and all(swaps(u) for u in n.users)

    return len(shape) == 4 and all_swap(node)


def sdpa(b, node):
    p = sdpa_params(node)
    _launch_sdpa(b, node, p, b.ref(p["attn_mask"]) if p["attn_mask"] is not None else None)


def _launch_sdpa(b, node, p: dict, mask: TRef | None, positions: bool = False, sinks: TRef | None = None,
                 softcap: float = 0.0, window: int = 0) -> None:
    q, k, v = (b.ref(p[n]) for n in ("query", "key", "value"))
    scale = p["scale"] if p["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    val = node.meta["val"]
    if _seq_major(node):
        n, h, l, e = val.shape
        out = b.view(b.alloc((n, l, h, e), val.dtype), val.shape, (l * h * e, e, h * e, 1), 0)
        b.bind(node, out)
    else:
        out = b.out(node)
    append = _append(b, p) if node.meta.get(APPEND) else None
    launch_attention(b, out, q, k, v, mask, bool(p["is_causal"]), scale, positions, sinks, append, softcap, window)


# --- new cache rows written by the attention launch (passes/kv_append.py) -------------------------------
APPEND = "td_kv_append"  # node.meta key of an attention whose key and value are cache updates it writes
APPENDED = "td_appended"  # node.meta key of such an update: its lowering binds the cache, launches nothing


def update_rows(update) -> tuple | None:
    """(cache, rows, index) of ``update`` when it is ``index_put(cache, [None, None, index], rows)``, a
    write of rows along dim 2 (a 4-d cache's sequence dim; ``index_copy_(2, index, rows)`` decomposes
    to it), else None."""
    if update.target is aten.index_put.default and len(update.args) == 3 and not update.kwargs.get("accumulate"):
        entries = list(update.args[1])
        if len(entries) == 3 and entries[0] is None and entries[1] is None and entries[2] is not None:
            return update.args[0], update.args[2], entries[2]
    return None


def _append(b, p: dict) -> Append:
    """The rows of the key and value updates (marked APPENDED, so no launch wrote them yet)."""
    (k_cache, k_new, index), (v_cache, v_new, v_index) = (update_rows(p[n]) for n in ("key", "value"))
    caches = {b.ref(k_cache).buffer, b.ref(v_cache).buffer}
    if v_index is not index:
        raise LoweringError("internal error: an attention's appended key and value rows have two indices")
    k_new, v_new, index = b.ref(k_new), b.ref(v_new), b.ref(index)
    if len(caches) != 2 or k_new.buffer in caches or v_new.buffer in caches or index.buffer in caches:
        raise LoweringError("internal error: an attention's appended rows overlap its caches")
    for cache in (p["key"], p["value"]):
        b.writes_in_place(b.ref(cache))
    return Append(k_new, v_new, index)


# --- tritondelegate::sdpa_positions ----------------------------------------------------------------
_POSITIONS_PARAMS = ("query", "key", "value", "positions", "scale", "enable_gqa", "window", "softcap", "sinks")
_CUSTOM_DEFAULTS = {"window": 0, "softcap": 0.0, "sinks": None}  # the custom attention ops' optional parameters


def supported_positions(node) -> str | None:
    """sdpa's support check, with the positions (integers broadcasting to [.., Lq, 1]) for the mask, a
    window of at least 0 keys (0: none), and a soft-cap or sinks as sdpa_softcap's or sdpa_sinks'."""
    p = attention_params(node)
    positions, q, out = node_value(p["positions"]), node_value(p["query"]), node.meta.get("val")
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int64, torch.int32):
        return "positions must be an int64 or int32 tensor"
    if not isinstance(out, torch.Tensor) or not isinstance(q, torch.Tensor):
        return "query and the result must be tensors"
    rows = tuple(out.shape[:-1]) + (1,)
    if positions.ndim > len(rows) or any(a not in (1, t) for a, t in zip(reversed(positions.shape), reversed(rows))):
        return f"positions {tuple(positions.shape)} do not broadcast to the queries {rows}"
    window, cap = p["window"], p["softcap"]
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        return f"window {window!r}: a number of keys, 0 or more (0: no window), expected"
    if not isinstance(cap, (int, float)) or not 0 <= cap < math.inf:
        return f"softcap {cap!r}: a finite number of at least 0 (0: no cap) expected"
    if p["sinks"] is not None:
        return "sinks and a softcap together are not supported" if cap else _sinks_refusal(p, node)
    return _sdpa_refusal(p, node)


def sdpa_positions(b, node):
    p = attention_params(node)
    sinks = b.contiguous(b.ref(p["sinks"])) if p["sinks"] is not None else None
    _launch_sdpa(b, node, p, b.ref(p["positions"]), positions=True, sinks=sinks, softcap=float(p["softcap"]),
                 window=int(p["window"]))


# --- tritondelegate::sdpa_sinks ---------------------------------------------------------------------
_SINKS_PARAMS = ("query", "key", "value", "attn_mask", "sinks", "scale", "enable_gqa")


def supported_sinks(node) -> str | None:
    """sdpa's support check, and one float sink logit per query head ([Hq])."""
    return _sinks_refusal(attention_params(node), node)


def _sinks_refusal(p: dict, node) -> str | None:
    sinks, out = node_value(p["sinks"]), node.meta.get("val")
    if not isinstance(sinks, torch.Tensor) or sinks.dtype not in FLOAT_DTYPES:
        return f"sinks must be a tensor of one of {', '.join(map(str, FLOAT_DTYPES))}"
    if not isinstance(out, torch.Tensor) or out.ndim < 3:
        return "sinks need query heads: query, key and value of rank 3 or 4"
    if sinks.ndim != 1 or sizes.shape(sinks.shape) != sizes.shape(out.shape[-3:-2]):
        return f"sinks {tuple(sinks.shape)}: one per query head ({out.shape[-3]}) expected"
    return _sdpa_refusal(p, node)


def sdpa_sinks(b, node):
    p = attention_params(node)
    mask = b.ref(p["attn_mask"]) if p["attn_mask"] is not None else None
    _launch_sdpa(b, node, p, mask, sinks=b.contiguous(b.ref(p["sinks"])))


# --- tritondelegate::sdpa_softcap -------------------------------------------------------------------
_SOFTCAP_PARAMS = ("query", "key", "value", "attn_mask", "softcap", "scale", "enable_gqa")


def supported_softcap(node) -> str | None:
    """sdpa's support check, and a finite soft-cap above 0."""
    p = attention_params(node)
    cap = p["softcap"]
    if not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
        return f"softcap {cap!r}: a finite number above 0 expected"
    return _sdpa_refusal(p, node)


def sdpa_softcap(b, node):
    p = attention_params(node)
    mask = b.ref(p["attn_mask"]) if p["attn_mask"] is not None else None
    _launch_sdpa(b, node, p, mask, softcap=float(p["softcap"]))


def attention_params(node) -> dict:
    """The parameters of an attention node by name (``sdpa_params``'s names, and each custom op's own):
    sdpa, sdpa_positions, sdpa_sinks or sdpa_softcap."""
    names = {td_ops.sdpa_positions: _POSITIONS_PARAMS, td_ops.sdpa_sinks: _SINKS_PARAMS,
             td_ops.sdpa_softcap: _SOFTCAP_PARAMS}.get(node.target)
    if names is None:
        return sdpa_params(node)
    return {**_DEFAULTS, **_CUSTOM_DEFAULTS, **dict(zip(names, node.args)), **node.kwargs}
