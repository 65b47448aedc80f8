"""Footprint rules: for each kernel of the runtime's table (``kernels/registry.py``), the memory its
launches reach, written from the kernel's own indexing formula over its masks, and the constexprs it
allows. ``verify.py`` checks every launch of a program against them.

A rule reads a launch's integer arguments, constexprs and grid (:class:`LaunchArgs`) and returns a
:class:`Footprint`: for each pointer the kernel loads or stores, the index ranges and strides of the
element offsets it reaches (:class:`Access`), the programs per grid axis the launch's sizes need, and
the sizes its grid and loops walk. Ranges are per coordinate (a box): where a kernel's masks tie
coordinates together the box holds the reachable offsets, never fewer.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass, replace
from typing import Callable

from ..kernels import elementwise
from ..ops import GLU_ACTS, GROUPED_GLU_ACTS
from .delegate import DelegateError, _is_constexpr

DTYPE_NAMES = ("", "float32", "float16", "bfloat16")  # the rounding targets of GEMM epilogues


# --- what a launch reaches --------------------------------------------------------------------------
@dataclass(frozen=True)
class Access:
    """The element offsets a kernel reaches through pointer ``param``: ``sum_k i_k * stride_k`` with
    each ``i_k`` in ``[0, count_k)``; none at all when some count is 0 or less (a masked-off range)."""

    param: str
    terms: tuple  # ((count, stride), ...)
    write: bool = False

    def reach(self) -> tuple[int, int] | None:
        """(smallest, largest) offset, or None when the kernel reaches nothing through ``param``."""
        if any(n <= 0 for n, _ in self.terms):
            return None
        return (sum((n - 1) * min(s, 0) for n, s in self.terms),
                sum((n - 1) * max(s, 0) for n, s in self.terms))


@dataclass
class Footprint:
    accesses: list  # Access per pointer the launch loads or stores
    grid: tuple  # the most programs per grid axis the launch's sizes need
    sizes: dict  # name -> index points the grid covers, or a loop's length


class LaunchArgs:
    """A launch's integer arguments, constexprs and grid, as a footprint rule reads them."""

    def __init__(self, where: str, ints: dict, constexprs: dict, grid: tuple):
        self.where, self._ints, self.c, self.grid = where, ints, constexprs, grid

    def i(self, name: str) -> int:
        value = self._ints.get(name)
        if value is None:
            raise DelegateError(f"{self.where}: argument {name!r} must be an integer")
        return value

    def ints(self, prefix: str, count: int) -> list[int]:
        return [self.i(f"{prefix}{k}") for k in range(count)]

    def d(self, *names: str) -> list[int]:
        """Integers the kernel divides by: each must be at least 1."""
        values = [self.i(n) for n in names]
        for name, v in zip(names, values):
            if v < 1:
                raise DelegateError(f"{self.where}: argument {name!r} is {v}; the kernel divides by it, "
                                    "so it must be at least 1")
        return values


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unravel(n: int, inner) -> list[int]:
    """How many values each coordinate takes when flat indices ``[0, n)`` are split row-major over
    sizes (lead, *inner): ``[lead count, *inner counts]``."""
    if n <= 0:
        return [0] * (len(inner) + 1)
    counts, below = [], 1
    for d in reversed(inner):
        counts.append(min(d, (n - 1) // below + 1))
        below *= d
    return [(n - 1) // below + 1] + counts[::-1]


def _walk(counts, strides) -> tuple:
    return tuple(zip(counts, strides))


# --- footprint rules, one per kernel: the kernel's indexing formula over its masks -------------------
def _pointwise(x: LaunchArgs) -> Footprint:
    n = x.i("n")
    idx = _unravel(n, x.d("d1", "d2", "d3", "d4"))
    acc = [Access("out_ptr", _walk(idx, x.ints("os", 5)), write=True)]
    for k, name in enumerate("abc"):
        if k < x.c["NARGS"] and not x.c[f"{name.upper()}_SCALAR"]:
            acc.append(Access(f"{name}_ptr", _walk(idx, x.ints(f"{name}s", 5))))
    return Footprint(acc, (_cdiv(n, x.c["BLOCK"]),), {"n": n})


def _pointwise_chain(x: LaunchArgs) -> Footprint:
    n = x.i("n")
    idx = _unravel(n, x.d("d1", "d2", "d3", "d4"))
    acc = [Access("out_ptr", _walk(idx, x.ints("os", 5)), write=True)]
    # slot 0 is the first op's left operand; slot k + 1 the operand of op k, when op k runs and is binary
    loads = [True] + [k < x.c["NOPS"] and x.c[f"ARITY{k}"] != 1 for k in range(4)]
    for k, load in enumerate(loads):
        if load and not x.c[f"IS_SCALAR{k}"]:
            acc.append(Access(f"p{k}_ptr", _walk(idx, x.ints(f"p{k}s", 5))))
    return Footprint(acc, (_cdiv(n, x.c["BLOCK"]),), {"n": n})


def _cat(x: LaunchArgs) -> Footprint:
    n = x.i("n")
    idx = _unravel(n, x.d("d1", "d2", "d3", "d4"))
    acc = [Access("out_ptr", _walk(idx, x.ints("os", 5)), write=True)]
    # part k: output indices c along DIM in [e(k-1), e(k)) (from 0; the last to the end), read at c - e(k-1)
    dim, parts, ends = x.c["DIM"], x.c["PARTS"], x.ints("e", 3)
    for k in range(parts):
        start = 0 if k == 0 else ends[k - 1]
        end = idx[dim] if k == 3 else min(ends[k], idx[dim])
        counts = list(idx)
        counts[dim] = end - start
        acc.append(Access(f"p{k}_ptr", _walk(counts, x.ints(f"p{k}s", 5))))
    return Footprint(acc, (_cdiv(n, x.c["BLOCK"]),), {"n": n})


def _epilogue(x: LaunchArgs, index: tuple, strides: int, p: str = "e") -> list[Access]:
    """The operands a GEMM epilogue (``elementwise._epilogue``) loads: step k < EPILOGUE, binary,
    with a tensor operand addressed by its own strides over ``index`` (counts). ``p`` "p": those of a
    prologue run by the same function (PROLOGUE steps, operands p<k>)."""
    count, c = {"e": "EPILOGUE", "p": "PROLOGUE"}[p], p.upper()
    return [Access(f"{p}{k}_ptr", _walk(index, x.ints(f"{p}{k}s", strides)))
            for k in range(4)
            if k < x.c[count] and x.c[f"{c}ARITY{k}"] != 1 and not x.c[f"{c}IS_SCALAR{k}"]]


def _rope(x: LaunchArgs, rows: int, N: int) -> list[Access]:
    """A rotary epilogue (``matmul._rope_store``) reads the [N / 2, 4] column pairs, and its tables at
    row t's (t // r_inner, t % r_inner) and at indices the kernel masks to [0, r_width); the columns it
    stores at are masked to [0, N), C's box."""
    if not x.c["ROPE"]:
        return []
    (inner,) = x.d("r_inner")
    width = x.i("r_width")
    coords = (_cdiv(rows, inner), min(inner, rows), width)
    acc = [Access("r_ptr", ((N // 2, 4), (4, 1))), Access("rc_ptr", _walk(coords, x.ints("rc", 2) + [x.i("rcj")]))]
    if x.c["ROPE"] in ("tables", "positions"):  # positions: the inverse frequencies, at the same indices
        acc.append(Access("rs_ptr", _walk(coords, x.ints("rs", 2) + [x.i("rsj")])))
    if x.c["NORM_E"]:  # the per-head norm's weights, 2 per pair below rn_pairs (and below N / 2)
        acc.append(Access("rn_ptr", ((min(x.i("rn_pairs"), N // 2), 2), (2, 1))))
    return acc


def _matmul(x: LaunchArgs) -> Footprint:
    M, N = x.d("M", "N")
    K, Z = x.i("K"), x.grid[1]  # the batch is grid axis 1, unmasked
    n_out = N // 2 if x.c["GLU"] else N  # a gated linear unit halves the stored columns
    s = {name: x.i(name) for name in ("stride_az", "stride_am", "stride_ak", "stride_bz", "stride_bk",
                                      "stride_bn", "stride_cz", "stride_cm", "stride_cn")}
    acc = [Access("a_ptr", ((Z, s["stride_az"]), (M, s["stride_am"]), (K, s["stride_ak"]))),
           Access("b_ptr", ((Z, s["stride_bz"]), (_cdiv(K, 2 if x.c["QBITS"] == 4 else 1), s["stride_bk"]),
                            (N, s["stride_bn"]))),  # (a 4-bit B: two K rows per byte)
           Access("c_ptr", ((Z, s["stride_cz"]), (M, s["stride_cm"]), (n_out, s["stride_cn"])), write=True)]
    if x.c["HAS_BIAS"]:
        acc.append(Access("x_ptr", ((Z, x.i("stride_xz")), (M, x.i("stride_xm")), (N, x.i("stride_xn")))))
    # a norm prologue reads A's rows (as a_ptr) and its weight and bias over K
    if x.c["PROLOGUE"] in ("rms", "layer") and x.c["HAS_PW"]:
        acc.append(Access("p_ptr", ((K, x.i("stride_pk")),)))
    if x.c["PROLOGUE"] == "layer" and x.c["HAS_PB"]:
        acc.append(Access("pb_ptr", ((K, x.i("stride_pk")),)))
    acc += _epilogue(x, (Z, M, n_out), 3) + _rope(x, Z * M, N)
    if x.c["QUANT"] not in ("", "none"):  # a quantized B's tables: group k * BLOCK_K // q_group of each column
        box = ((Z, x.i("stride_qz")), (N, x.i("stride_qn")), (_cdiv(K, max(x.i("q_group"), 1)), x.i("stride_qg")))
        acc += [Access(p, box) for p, part in (("qz_ptr", "zero"), ("qs_ptr", "scale")) if part in x.c["QUANT"]]
    grid = (_cdiv(M, x.c["BLOCK_M"]) * _cdiv(N, x.c["BLOCK_N"]), Z)
    return Footprint(acc, grid, {"batch x M x N stored": Z * M * n_out, "K": K})


def _grouped_mm(x: LaunchArgs) -> Footprint:
    """Rows and experts come from offs clamped to [0, S] and [0, E): the box of every operand. Segment
    tiles need cdiv(S, BLOCK_M) + E programs on axis 0 (grouped_mm.py), per-row tiles cdiv(S, BLOCK_M).
    With GLU the output has half the weight's N columns; with ROWS x has T rows, read through rows;
    with DEST the S rows are stored through dest; HAS_BIAS reads a bias row per expert. A quantized w
    (QUANT) is its integers (two K rows per byte with 4 bits) and its tables, group k * BLOCK_K //
    q_group of each expert's column."""
    S, K, T = x.i("S"), x.i("K"), x.i("T")
    N, E = x.d("N", "E")
    n_out = N // 2 if x.c["GLU"] else N
    w_rows = _cdiv(K, 2 if x.c["QBITS"] == 4 else 1)
    acc = [Access("x_ptr", ((T, x.i("stride_xs")), (K, x.i("stride_xk")))),
           Access("w_ptr", ((E, x.i("stride_we")), (w_rows, x.i("stride_wk")), (N, x.i("stride_wn")))),
           Access("offs_ptr", ((E, x.i("stride_o")),)),
           Access("out_ptr", ((S, x.i("stride_os")), (n_out, x.i("stride_on"))), write=True)]
    if x.c["ROWS"]:  # x's rows at rows[r] // rows_div, clamped to [0, T)
        acc.append(Access("rows_ptr", ((S, x.i("stride_r")),)))
    if x.c["DEST"]:  # out's rows at dest[r]; one outside [0, S) is not stored
        acc.append(Access("dest_ptr", ((S, x.i("stride_d")),)))
    if x.c["HAS_PW"]:  # the rms prologue's norm weight, over K
        acc.append(Access("p_ptr", ((K, x.i("stride_pk")),)))
    if x.c["HAS_BIAS"]:  # the experts' biases, a row per expert
        acc.append(Access("bias_ptr", ((E, x.i("stride_be")), (N, x.i("stride_bn")))))
    if x.c["QUANT"] not in ("", "none"):
        box = ((E, x.i("stride_qe")), (N, x.i("stride_qn")), (_cdiv(K, max(x.i("q_group"), 1)), x.i("stride_qg")))
        acc += [Access(p, box) for p, part in (("qz_ptr", "zero"), ("qs_ptr", "scale")) if part in x.c["QUANT"]]
    acc += _epilogue(x, (S, n_out), 2)
    tiles = _cdiv(S, x.c["BLOCK_M"]) + (0 if x.c["PER_ROW"] else E)
    return Footprint(acc, (tiles, _cdiv(N, x.c["BLOCK_N"])), {"S x N stored": S * n_out, "K": K, "E": E})


def _conv_pixels(x: LaunchArgs, M: int) -> tuple:
    """(DEPTH, the input depth, the counts of (n, od, oh, ow)) of a convolution launch's M output pixels;
    without DEPTH the depths are 1 (D and OD never read)."""
    if x.c["DEPTH"]:
        return True, x.i("D"), _unravel(M, x.d("OD", "OH", "OW"))
    n, oh, ow = _unravel(M, x.d("OH", "OW"))
    return False, 1, (n, 1, oh, ow)


def _conv2d(x: LaunchArgs) -> Footprint:
    """Input coordinates are masked to [0, D) x [0, H) x [0, W) (a transposed conv's too: its exact taps
    only); group g's weight rows start at g * ws_g and its output channels at g * COUT_G, so the weight box
    is the same formula for both layouts ([C_out, Cg, KD, KH, KW], or transposed [C_in, Og, KD, KH, KW]).
    Without DEPTH (2-D) the kernel computes no depth term: rows are (n, oh, ow), and the depth counts are 1
    (D and OD never read, the depth strides reach nothing)."""
    M, H, W, cin, cout = (x.i(name) for name in ("M", "H", "W", "CIN_G", "COUT_G"))
    pool = _conv_pool(x, M)
    if pool is None:
        depth, D, (n, od, oh, ow) = _conv_pixels(x, M)
    else:  # rows: pooled pixels; the taps' pixels: the convolution's output
        depth, D, (n, od, oh, ow) = False, 1, (pool[0], 1, x.i("OH"), x.i("OW"))
    groups, KD, KH, KW = x.grid[2], x.c["KD"], x.c["KH"], x.c["KW"]
    co = groups * cout  # output channels: group g's are g * COUT_G + [0, COUT_G)
    k_loop = cin * KD * KH * KW
    programs = _cdiv(M, x.c["BLOCK_M"])
    if x.c["PHASED"]:  # programs (tile, phase): tiles of the largest phase's rows (n, od, oh, ow), masked to
        # the same box; its taps kh = (oh + pad_h) % stride_h + th * stride_h < KH are in [0, KH) when pad_h >= 0
        dims = ("d", "h", "w") if depth else ("h", "w")
        strides = [1] * (3 - len(dims)) + x.d(*(f"stride_{d}" for d in dims))
        for name in (f"pad_{d}" for d in dims):
            if x.i(name) < 0:
                raise DelegateError(f"{x.where}: argument {name!r} is {x.i(name)}; a PHASED convolution's padding "
                                    "is at least 0")
        phase_rows = n * _cdiv(od, strides[0]) * _cdiv(oh, strides[1]) * _cdiv(ow, strides[2])
        programs = strides[0] * strides[1] * strides[2] * _cdiv(phase_rows, x.c["BLOCK_M"])
    acc = [
        Access("x_ptr", ((n, x.i("xs_n")), (groups * cin, x.i("xs_c")), (D, x.i("xs_d")), (H, x.i("xs_h")),
                         (W, x.i("xs_w")))),
        Access("w_ptr", ((groups, x.i("ws_g")), (cout, x.i("ws_o")), (cin, x.i("ws_i")), (KD, x.i("ws_d")),
                         (KH, x.i("ws_h")), (KW, x.i("ws_w")))),
        Access("out_ptr", ((n, x.i("os_n")), (co, x.i("os_c")), (od, x.i("os_d")),
                           *zip(pool[1:] if pool else (oh, ow), (x.i("os_h"), x.i("os_w")))), write=True),
    ]
    if x.c["HAS_BIAS"]:
        acc.append(Access("bias_ptr", ((co, 1),)))
    # epilogue operands: strides over (n, c, d, h, w) with DEPTH, else over (n, c, h, w) and a 0
    acc += _epilogue(x, (n, co, od, oh, ow) if depth else (n, co, oh, ow, 1), 5)
    grid = (programs, _cdiv(cout, x.c["BLOCK_N"]), groups)
    sizes = {"output elements": max(M, 0) * max(co, 0), "K": k_loop}
    if x.c["PHASED"]:  # every phase walks the largest phase's tiles: a stride past the output's size adds empty ones
        sizes["rows of the phases' tiles"] = programs * x.c["BLOCK_M"]
    return Footprint(acc, grid, sizes)


def _conv_pool(x: LaunchArgs, M: int) -> list[int] | None:
    """A pooling convolution's (POOL_KH > 0) counts of its M rows, the pooled pixels (n, ph, pw); its
    taps' pixels are masked to the convolution's (OH, OW), where its epilogue reads. None without."""
    if not x.c["POOL_KH"] and not x.c["POOL_KW"]:
        return None
    if not (x.c["POOL_KH"] and x.c["POOL_KW"]) or x.c["PHASED"] or x.c["DEPTH"]:
        raise DelegateError(f"{x.where}: a pooling convolution (POOL_KH {x.c['POOL_KH']}, POOL_KW "
                            f"{x.c['POOL_KW']}) takes both window sizes, and is neither PHASED nor DEPTH")
    return _unravel(M, x.d("POH", "POW"))


def _depthwise_conv(x: LaunchArgs) -> Footprint:
    """Output channel co reads input channel co // COUT_G and weight row co; input coordinates are masked
    to [0, D) x [0, H) x [0, W); without DEPTH the depth counts are 1, as for ``conv2d``."""
    M, H, W, cout, cout_g = (x.i(name) for name in ("M", "H", "W", "COUT", "COUT_G"))
    depth, D, (n, od, oh, ow) = _conv_pixels(x, M)
    cin = _cdiv(cout, max(cout_g, 1))
    acc = [
        Access("x_ptr", ((n, x.i("xs_n")), (cin, x.i("xs_c")), (D, x.i("xs_d")), (H, x.i("xs_h")),
                         (W, x.i("xs_w")))),
        Access("w_ptr", ((cout, x.i("ws_o")), (x.c["KD"], x.i("ws_d")), (x.c["KH"], x.i("ws_h")),
                         (x.c["KW"], x.i("ws_w")))),
        Access("out_ptr", ((n, x.i("os_n")), (cout, x.i("os_c")), (od, x.i("os_d")), (oh, x.i("os_h")),
                           (ow, x.i("os_w"))), write=True),
    ]
    if x.c["HAS_BIAS"]:
        acc.append(Access("bias_ptr", ((cout, 1),)))
    acc += _epilogue(x, (n, cout, od, oh, ow) if depth else (n, cout, oh, ow, 1), 5)
    grid = (_cdiv(M, x.c["BLOCK_M"]), _cdiv(cout, x.c["BLOCK_N"]))
    return Footprint(acc, grid, {"output elements": max(M, 0) * max(cout, 0), "COUT_G": cout_g})


def _conv1x1(x: LaunchArgs) -> Footprint:
    """A 1x1 convolution whose input t, K channels at M pixels (n, oh, ow), is computed where it is read.
    DEPTHWISE: from a depthwise convolution, t's channel k reading x's channel k // V_G at input
    coordinates masked to [0, H) x [0, W), and weight row k; else x is t's shape itself (H, W: OH, OW,
    V_G 1). The prologue's operands are addressed over t's (n, k, oh, ow) as the epilogue's are over the
    output's (n, co, oh, ow). NORM: x is normalized first, by statistics per (image, group of n_per
    channels) and a weight and bias per channel."""
    M, H, W, K, cout = (x.i(name) for name in ("M", "H", "W", "K", "COUT"))
    (v_g,) = x.d("V_G")
    n, oh, ow = _unravel(M, x.d("OH", "OW"))
    acc = [
        Access("x_ptr", ((n, x.i("xs_n")), (_cdiv(K, v_g), x.i("xs_c")), (H, x.i("xs_h")), (W, x.i("xs_w")))),
        Access("w_ptr", ((cout, x.i("ws_o")), (K, x.i("ws_i")))),
        Access("out_ptr", ((n, x.i("os_n")), (cout, x.i("os_c")), (oh, x.i("os_h")), (ow, x.i("os_w"))),
               write=True),
    ]
    if x.c["DEPTHWISE"]:
        acc.append(Access("v_ptr", ((K, x.i("vs_c")), (x.c["KH"], x.i("vs_h")), (x.c["KW"], x.i("vs_w")))))
    if x.c["DEPTHWISE"] and x.c["HAS_DW_BIAS"]:
        acc.append(Access("c_ptr", ((K, 1),)))
    if x.c["HAS_BIAS"]:
        acc.append(Access("bias_ptr", ((cout, 1),)))
    if x.c["NORM"]:  # image n's channel k reads the statistics at n * n_sample + k // n_per
        acc += _norm_stats(x, n, K, x.i("n_per"), "n_sample", ("var_ptr", "mean_ptr", "nw_ptr", "nb_ptr"),
                           ("HAS_NW", "HAS_NB"))
    acc += _epilogue(x, (n, K, oh, ow), 4, "p") + _epilogue(x, (n, cout, oh, ow, 1), 5)
    grid = (_cdiv(M, x.c["BLOCK_M"]), _cdiv(cout, x.c["BLOCK_N"]))
    return Footprint(acc, grid, {"output elements": max(M, 0) * max(cout, 0), "K": K, "V_G": v_g})


def _attention(x: LaunchArgs) -> Footprint:
    H, group, pack = x.d("H", "GROUP") + [x.c["PACK"]]
    if H % pack:
        raise DelegateError(f"{x.where}: PACK={pack} query heads per program must divide the {H} heads")
    Lq, Lk, bh, splits = x.i("Lq"), x.i("Lk"), x.grid[1], x.grid[2]  # grid axis 1: batch * heads / PACK
    b, h = (bh - 1) // (H // pack) + 1, min(H, bh * pack)
    hk = (h - 1) // group + 1
    E, EV = x.c["E"], x.c["EV"]
    acc = [
        Access("q_ptr", _walk((b, h, Lq, E), (x.i("sq_b"), x.i("sq_h"), x.i("sq_m"), x.i("sq_d")))),
        Access("k_ptr", _walk((b, hk, Lk, E), (x.i("sk_b"), x.i("sk_h"), x.i("sk_n"), x.i("sk_d")))),
        Access("v_ptr", _walk((b, hk, Lk, EV), (x.i("sv_b"), x.i("sv_h"), x.i("sv_n"), x.i("sv_d")))),
    ]
    if x.c["SPLIT"]:  # partials [(b * H + h) * Lq + i, split, EV] and [.., split, 2]
        rows = ((b, H * Lq * splits), (h, Lq * splits), (Lq, splits), (splits, 1))
        acc += [Access("part_ptr", tuple((n, s * EV) for n, s in rows) + ((EV, 1),), write=True),
                Access("stat_ptr", tuple((n, s * 2) for n, s in rows) + ((2, 1),), write=True)]
    else:
        acc.append(Access("out_ptr", _walk((b, h, Lq, EV), (x.i("so_b"), x.i("so_h"), x.i("so_m"), x.i("so_d"))),
                          write=True))
    if x.c["MASK"] != "none":
        acc.append(Access("mask_ptr", _walk((b, h, Lq, Lk), (x.i("smask_b"), x.i("smask_h"), x.i("smask_m"),
                                                              x.i("smask_n")))))
    if x.c["SINKS"] and not x.c["SPLIT"]:  # one sink logit per query head, contiguous; split: the combine's
        acc.append(Access("sink_ptr", ((h, 1),)))
    need_splits = _cdiv(Lk, x.d("split_n")[0]) if x.c["SPLIT"] else 1
    grid = (_cdiv(pack * Lq, x.c["BLOCK_M"]), bh, need_splits)
    return Footprint(acc, grid, {"batch x heads x queries": bh * pack * max(Lq, 0), "keys": Lk})


def _attention_append(x: LaunchArgs) -> Footprint:
    """``_attention``, and the rows it writes first: new rows [b, hk, Lnew] read through their strides,
    each written at a row of the cache (k, v) that its index names, masked to [0, Lk)."""
    fp = _attention(x)
    H, group, pack, Lnew = x.i("H"), x.i("GROUP"), x.c["PACK"], x.i("Lnew")
    b, h = (x.grid[1] - 1) // (H // pack) + 1, min(H, x.grid[1] * pack)
    hk = (h - 1) // group + 1
    E, EV, Lk = x.c["E"], x.c["EV"], x.i("Lk")
    fp.accesses += [
        Access("k_ptr", _walk((b, hk, Lk, E), (x.i("sk_b"), x.i("sk_h"), x.i("sk_n"), x.i("sk_d"))), write=True),
        Access("v_ptr", _walk((b, hk, Lk, EV), (x.i("sv_b"), x.i("sv_h"), x.i("sv_n"), x.i("sv_d"))), write=True),
        Access("kn_ptr", _walk((b, hk, Lnew, E), (x.i("skn_b"), x.i("skn_h"), x.i("skn_t"), x.i("skn_d")))),
        Access("vn_ptr", _walk((b, hk, Lnew, EV), (x.i("svn_b"), x.i("svn_h"), x.i("svn_t"), x.i("svn_d")))),
        Access("idx_ptr", ((Lnew, x.i("sidx")),)),
    ]
    fp.sizes["new rows"] = Lnew
    return fp


def _attention_combine(x: LaunchArgs) -> Footprint:
    H, Lq, S = x.d("H", "Lq", "S")
    rows, EV = x.grid[0], x.c["EV"]  # program = query row (b * H + h) * Lq + i
    if S > x.c["BLOCK_S"]:
        raise DelegateError(f"{x.where}: S={S} splits do not fit BLOCK_S={x.c['BLOCK_S']}")
    b, h, i = _unravel(rows, (H, Lq))
    acc = [Access("part_ptr", ((rows, S * EV), (S, EV), (EV, 1))),
           Access("stat_ptr", ((rows, S * 2), (S, 2), (2, 1))),
           Access("out_ptr", _walk((b, h, i, EV), (x.i("so_b"), x.i("so_h"), x.i("so_m"), x.i("so_d"))), write=True)]
    if x.c["SINKS"]:  # one sink logit per head, contiguous
        acc.append(Access("sink_ptr", ((h, 1),)))
    return Footprint(acc, (rows,), {"rows": rows, "splits": S})


def _rows(x: LaunchArgs, strides: list[int]) -> tuple:
    """``rows.row_offsets`` over rows [0, rows): (count, stride) of its three row coordinates."""
    return _walk(_unravel(x.i("rows"), x.d("n1", "n2")), strides)


def _reduce(x: LaunchArgs) -> Footprint:
    rows, cols, split_cols = x.i("rows"), x.i("cols"), x.d("split_cols")[0]
    splits = x.grid[1]  # out[r * splits + split]
    acc = [Access("x_ptr", _rows(x, x.ints("s", 3)) + ((cols, x.i("sc")),))] + _row_chains(x, cols, 1)
    if x.c["EPILOGUE"]:  # out at its row strides, each row's value in column 0 of the epilogue's walk
        if splits != 1:
            raise DelegateError(f"{x.where}: a reduction with an epilogue is one launch, not {splits} splits")
        acc.append(Access("out_ptr", _rows(x, x.ints("os", 3)), write=True))
    else:
        acc.append(Access("out_ptr", ((rows, splits), (splits, 1)), write=True))
    if x.c["COMBINE"] in ("welford", "argmax", "argmin"):
        acc.append(Access("out2_ptr", ((rows, splits), (splits, 1)), write=True))
    grid = (_cdiv(rows, x.c["BLOCK_R"]), _cdiv(cols, split_cols))
    return Footprint(acc, grid, {"rows x splits": max(rows, 0) * splits, "cols": cols})


def _row_chains(x: LaunchArgs, cols: int, epi_cols: int) -> list[Access]:
    """A row kernel's fused prologue's and epilogue's operands (rows.row_load, rows.row_store): step
    k < PROLOGUE (EPILOGUE), binary, a tensor, walked by its own row strides and column stride like x
    over ``cols`` columns (the epilogue's over ``epi_cols``: a reduction's result has one column)."""
    acc = []
    for p, count, n in (("p", "PROLOGUE", cols), ("e", "EPILOGUE", epi_cols)):
        acc += [Access(f"{p}{k}_ptr", _rows(x, x.ints(f"{p}{k}s", 3)) + ((n, x.i(f"{p}{k}s3")),))
                for k in range(4) if k < x.c[count] and x.c[f"{p.upper()}ARITY{k}"] != 1
                and not x.c[f"{p.upper()}IS_SCALAR{k}"]]
    return acc


def _softmax(x: LaunchArgs) -> Footprint:
    cols = x.i("cols")
    acc = [Access("x_ptr", _rows(x, x.ints("xs", 3)) + ((cols, x.i("xsc")),)),
           Access("out_ptr", _rows(x, x.ints("os", 3)) + ((cols, x.i("osc")),), write=True)]
    acc += _row_chains(x, cols, cols)
    return Footprint(acc, (_cdiv(x.i("rows"), x.c["BLOCK_R"]),), {"rows": x.i("rows"), "cols": cols})


def _norm(x: LaunchArgs) -> Footprint:
    footprint = _softmax(x)
    rows, cols = x.i("rows"), x.i("cols")
    for param, flag in (("w_ptr", "HAS_W"), ("b_ptr", "HAS_B")):
        if x.c[flag]:
            footprint.accesses.append(Access(param, ((cols, 1),)))
    if x.c["STATS"]:
        footprint.accesses += [Access("mean_ptr", ((rows, 1),), write=True),
                               Access("rstd_ptr", ((rows, 1),), write=True)]
    return footprint


def _norm_apply(x: LaunchArgs) -> Footprint:
    """``group_norm.norm_apply_kernel``: x, out and the chains over the rows walk (a softmax's); row
    r = (n, c) reads the statistics at n * sample_stride + c // per and the weight and bias at c; grid
    (row blocks, column blocks)."""
    footprint, rows, channels = _softmax(x), x.i("rows"), x.i("channels")
    if channels < 1:
        raise DelegateError(f"{x.where}: a norm over {channels} channels")
    samples, seen = _unravel(rows, [channels])
    footprint.accesses.extend(_norm_stats(x, samples, seen, x.i("per"), "sample_stride",
                                          ("var_ptr", "mean_ptr", "w_ptr", "b_ptr"), ("HAS_W", "HAS_B")))
    grid = (_cdiv(rows, x.c["BLOCK_R"]), _cdiv(x.i("cols"), x.c["BLOCK_C"]))
    return replace(footprint, grid=grid)


def _norm_stats(x: LaunchArgs, samples: int, channels: int, per: int, sample_stride: str, pointers, flags
                ) -> list[Access]:
    """A norm's statistics (var, mean) read at n * sample_stride + c // per over ``samples`` x
    ``channels`` (n, c), and its weight and bias (when their ``flags`` are set) at c: ``norm_apply``'s
    and ``conv1x1``'s with NORM."""
    if per < 1:
        raise DelegateError(f"{x.where}: a norm's groups of {per} channels")
    var, mean, weight, bias = pointers
    acc = [Access(p, ((samples, x.i(sample_stride)), (_cdiv(channels, per), 1))) for p in (var, mean)]
    return acc + [Access(p, ((channels, 1),)) for p, flag in zip((weight, bias), flags) if x.c[flag]]


# Per tensor of a rotary launch: its rows, row dims, and (pointer, row strides' prefix, last dim's
# stride, written) per pointer. kx (with PAIR) reads cos and sin through its own row strides. With
# ANGLES, cos and sin are the angles: half a row each.
_ROTARY = (("rows", ("n1", "n2", "n3"), (("x_ptr", "xs", "xsd", False), ("cos_ptr", "cs", "csd", False),
                                         ("sin_ptr", "ss", "ssd", False), ("out_ptr", "os", "osd", True))),
           ("krows", ("k1", "k2", "k3"), (("kx_ptr", "kxs", "kxsd", False), ("cos_ptr", "kcs", "csd", False),
                                          ("sin_ptr", "kss", "ssd", False), ("kout_ptr", "kos", "kosd", True))))


def _rotary_width(x: LaunchArgs, param: str, half: int) -> int:
    return half if x.c["ANGLES"] and param in ("cos_ptr", "sin_ptr") else 2 * half


def _rotary(x: LaunchArgs) -> Footprint:
    half = x.i("half")
    acc, programs, points = [], 0, 0
    for rows_name, dims, pointers in _ROTARY[:2 if x.c["PAIR"] else 1]:  # x's row blocks, then kx's
        rows = x.i(rows_name)
        r = _unravel(rows, x.d(*dims))
        acc += [Access(param, _walk(r, x.ints(prefix, 4)) + ((_rotary_width(x, param, half), x.i(last)),),
                       write=write) for param, prefix, last, write in pointers]
        programs += _cdiv(rows, x.c["BLOCK_R"])
        points += max(rows, 0) * max(half, 0)
    if x.c["NORM"]:  # per-head norms: a weight of 2 * half per tensor (kx's only with PAIR)
        acc += [Access(p, ((2 * half, x.i(s)),)) for p, s in (("nw_ptr", "nws"), ("knw_ptr", "knws"))[:1 + x.c["PAIR"]]]
    return Footprint(acc, (programs, _cdiv(half, x.c["BLOCK_H"])), {"rows x half": points})


def _indexed(x: LaunchArgs, base: str, direct: str, write: bool) -> list[Access]:
    """The gather/scatter address ``sum_j o_j S_j + sum_k idx_k[o . T_k] U_k`` (``index.indexed_offsets``):
    the pointer it addresses (masked to indices in [0, size_k)) and the index tensors it reads."""
    n = x.i("n")
    idx = _unravel(n, x.d("d1", "d2", "d3", "d4"))
    used = range(x.c["NUM_INDICES"])
    terms = _walk(idx, x.ints(direct, 5)) + tuple((x.i(f"size{k}"), x.i(f"u{k}")) for k in used)
    return [Access(base, terms, write=write)] + [Access(f"idx{k}_ptr", _walk(idx, x.ints(f"t{k}", 5))) for k in used]


def _gather(x: LaunchArgs) -> Footprint:
    """Without an epilogue out is contiguous; with one (``index._gather_epilogue``) out and the chain's
    operands are walked by their own strides."""
    n = x.i("n")
    if x.c["EPILOGUE"]:
        idx = _unravel(n, x.d("d1", "d2", "d3", "d4"))
        acc = [Access("out_ptr", _walk(idx, x.ints("os", 5)), write=True)] + _epilogue(x, idx, 5)
    else:
        acc = [Access("out_ptr", ((n, 1),), write=True)]
    acc += _indexed(x, "src_ptr", "ss", write=False)
    return Footprint(acc, (_cdiv(n, x.c["BLOCK"]),), {"n": n})


def _dequant_rows(x: LaunchArgs) -> Footprint:
    """A quantized table's rows at indices masked to [0, V), every column (two per byte with 4 bits), and
    their groups of the zero and scale tables; out [R, D] contiguous; an epilogue's operands by (row,
    column)."""
    R, D, V = x.i("R"), x.i("D"), x.i("V")
    acc = [Access("out_ptr", ((R, D), (D, 1)), write=True), Access("idx_ptr", ((R, x.i("stride_i")),)),
           Access("q_ptr", ((V, x.i("stride_qv")), (_cdiv(D, 2 if x.c["QBITS"] == 4 else 1), x.i("stride_qd"))))]
    if x.c["QUANT"] not in ("", "none"):
        box = ((V, x.i("stride_zv")), (_cdiv(D, max(x.i("q_group"), 1)), x.i("stride_zg")))
        acc += [Access(p, box) for p, part in (("qz_ptr", "zero"), ("qs_ptr", "scale")) if part in x.c["QUANT"]]
    acc += _epilogue(x, (R, D), 2)
    return Footprint(acc, (_cdiv(R, x.c["BLOCK_R"]), _cdiv(D, x.c["BLOCK_D"])), {"R x D stored": R * D})


def _scatter(x: LaunchArgs) -> Footprint:
    """With PAIR, grid axis 1's program 1 writes dst2 from src2 (strides ws) at dst's offsets."""
    n = x.i("n")
    pairs = (("dst_ptr", "src_ptr", "vs"), ("dst2_ptr", "src2_ptr", "ws"))[:2 if x.c["PAIR"] else 1]
    acc = []
    for dst, src, strides in pairs:
        acc += _indexed(x, dst, "ds", write=True)
        if not x.c["SRC_SCALAR"]:
            acc.append(Access(src, _walk(_unravel(n, x.d("d1", "d2", "d3", "d4")), x.ints(strides, 5))))
    return Footprint(acc, (_cdiv(n, x.c["BLOCK"]), len(pairs)), {"n": n * len(pairs)})


def _scan(x: LaunchArgs, *operands: tuple) -> Footprint:
    """A scan kernel's (cumsum, cumextreme) rows and their ``length`` columns, for each (pointer, prefix of
    its four row strides, its stride along the scan, written)."""
    rows, length = x.i("rows"), x.i("length")
    r = _unravel(rows, x.d("r1", "r2", "r3"))
    acc = [Access(ptr, _walk(r, x.ints(prefix, 4)) + ((length, x.i(along)),), write=write)
           for ptr, prefix, along, write in operands]
    return Footprint(acc, (_cdiv(rows, x.c["BLOCK_R"]),), {"rows": rows, "length": length})


def _cumsum(x: LaunchArgs) -> Footprint:
    return _scan(x, ("x_ptr", "xs", "x_stride", False), ("out_ptr", "os", "out_stride", True))


def _cumextreme(x: LaunchArgs) -> Footprint:
    return _scan(x, ("x_ptr", "xs", "x_stride", False), ("out_ptr", "os", "out_stride", True),
                 ("idx_ptr", "is", "idx_stride", True))


def _cdist(x: LaunchArgs) -> Footprint:
    """Rows of x1 masked to [0, P), of x2 to [0, R), columns to [0, M); the batch is grid axis 2, unmasked,
    split as (z // Z1, z % Z1)."""
    P, R, M, Z = x.i("P"), x.i("R"), x.i("M"), x.grid[2]
    z = _unravel(Z, x.d("Z1"))
    acc = [Access("a_ptr", _walk(z, x.ints("as_z", 2)) + ((P, x.i("as_i")), (M, x.i("as_k")))),
           Access("b_ptr", _walk(z, x.ints("bs_z", 2)) + ((R, x.i("bs_j")), (M, x.i("bs_k")))),
           Access("out_ptr", _walk(z, x.ints("os_z", 2)) + ((P, x.i("os_i")), (R, x.i("os_j"))), write=True)]
    grid = (_cdiv(P, x.c["BLOCK_M"]), _cdiv(R, x.c["BLOCK_N"]), Z)
    return Footprint(acc, grid, {"batch x P x R": Z * max(P, 0) * max(R, 0), "M": M})


def _embedding_bag(x: LaunchArgs) -> Footprint:
    """Program (bag, column block); indices are masked to [0, num_embeddings), entries to [0, n_indices);
    a bag reads offsets[bag] and, below n_offsets, offsets[bag + 1]."""
    bags, n, n_offsets, rows, D = (x.i(k) for k in ("n_bags", "n_indices", "n_offsets", "num_embeddings", "D"))
    acc = [Access("w_ptr", ((rows, x.i("ws_n")), (D, x.i("ws_d")))), Access("idx_ptr", ((n, x.i("is_t")),)),
           Access("offs_ptr", ((max(bags, min(bags + 1, n_offsets)), x.i("os_o")),)),
           Access("out_ptr", ((bags, x.i("out_b")), (D, x.i("out_d"))), write=True)]
    if x.c["HAS_PSW"]:
        acc.append(Access("psw_ptr", ((n, x.i("ps_t")),)))
    return Footprint(acc, (bags, _cdiv(D, x.c["BLOCK_D"])), {"bags x D": bags * max(D, 0), "indices": n})


def _ranked_rows(x: LaunchArgs) -> tuple[list, int, int]:
    """(accesses, rows, length) of a ranking launch: rows over (n0, n1, n2) of x read whole, the first
    min(k, length) ranks of each stored into values and indices (ranking.py, router.py)."""
    rows, length, k = x.i("rows"), x.i("length"), x.i("k")
    r = _unravel(rows, x.d("n1", "n2"))
    kept = min(k, length)
    acc = [Access("x_ptr", _walk(r, x.ints("xs", 3)) + ((length, x.i("xs3")),)),
           Access("values_ptr", _walk(r, x.ints("vs", 3)) + ((kept, x.i("vs3")),), write=True),
           Access("indices_ptr", _walk(r, x.ints("is", 3)) + ((kept, x.i("is3")),), write=True)]
    return acc, rows, length


def _rank(x: LaunchArgs) -> Footprint:
    """Program (row, block)."""
    acc, rows, length = _ranked_rows(x)
    return Footprint(acc, (rows, _cdiv(length, x.c["BLOCK_I"])), {"rows x length": rows * length,
                                                                  "length": length})


def _router(x: LaunchArgs) -> Footprint:
    """One program per row."""
    acc, rows, length = _ranked_rows(x)
    return Footprint(acc, (rows,), {"rows x length": rows * length, "length": length})


def _group_router(x: LaunchArgs) -> Footprint:
    """One program per row of scores [rows, length]; the bias [length]; k of each row stored."""
    rows, length, k = x.i("rows"), x.i("length"), x.i("k")
    kept = min(k, length)
    acc = [Access("s_ptr", ((rows, x.i("ss0")), (length, x.i("ss1")))), Access("b_ptr", ((length, x.i("bs")),)),
           Access("values_ptr", ((rows, x.i("vs0")), (kept, x.i("vs1"))), write=True),
           Access("indices_ptr", ((rows, x.i("is0")), (kept, x.i("is1"))), write=True)]
    return Footprint(acc, (rows,), {"rows x length": rows * length, "length": length})


def _histc(x: LaunchArgs) -> Footprint:
    n, bins = x.i("n"), x.i("bins")
    idx = _unravel(n, x.d("d1", "d2", "d3", "d4"))
    acc = [Access("x_ptr", _walk(idx, x.ints("xs", 5))),
           Access("out_ptr", ((bins, x.i("out_stride")),), write=True)]
    return Footprint(acc, (_cdiv(bins, x.c["BLOCK_B"]),), {"bins": bins, "elements": n})


def _sort_offsets(x: LaunchArgs) -> Footprint:
    """Program p ranks elements from p * BLOCK_I and counts bins from p * BLOCK_B of the 1-D x."""
    n, bins = x.i("n"), x.i("bins")
    acc = [Access("x_ptr", ((n, x.i("xs")),)), Access("values_ptr", ((n, x.i("vs")),), write=True),
           Access("indices_ptr", ((n, x.i("ist")),), write=True),
           Access("offsets_ptr", ((bins, x.i("os")),), write=True)]
    grid = (max(_cdiv(n, x.c["BLOCK_I"]), _cdiv(bins, x.c["BLOCK_B"])),)
    return Footprint(acc, grid, {"length": n, "bins": bins})


def _pool2d(x: LaunchArgs) -> Footprint:
    """Input coordinates are masked to [0, D) x [0, H) x [0, W) (adaptive windows end at D, H and W too).
    Without DEPTH (2-D) no depth term is computed: the depth counts are 1."""
    total, H, W = x.i("total"), x.i("H"), x.i("W")
    if x.c["DEPTH"]:
        D = x.i("D")
        n, c, od, oh, ow = _unravel(total, x.d("C", "OD", "OH", "OW"))
    else:
        D, od = 1, 1
        n, c, oh, ow = _unravel(total, x.d("C", "OH", "OW"))
    coords = (n, c, od, oh, ow)
    acc = [Access("x_ptr", _walk((n, c, D, H, W), [x.i(f"xs_{k}") for k in "ncdhw"])),
           Access("out_ptr", _walk(coords, [x.i(f"os_{k}") for k in "ncdhw"]), write=True)]
    if x.c["MODE"] in ("max", "adaptive_max") and x.c["WRITE_INDICES"]:
        acc.append(Access("idx_ptr", _walk(coords, [x.i(f"is_{k}") for k in "ncdhw"]), write=True))
    window = x.c["KD"] * x.c["KH"] * x.c["KW"]
    return Footprint(acc, (_cdiv(total, x.c["BLOCK_M"]),), {"total": total, "window": window})


def _grid_sample(x: LaunchArgs) -> Footprint:
    total, H, W = x.i("total"), x.i("H"), x.i("W")
    n, c, oh, ow = _unravel(total, x.d("C", "OH", "OW"))
    # the taps are masked to [0, H) x [0, W); the grid's two coordinates sit gs_k apart
    acc = [Access("x_ptr", ((n, x.i("xs_n")), (c, x.i("xs_c")), (H, x.i("xs_h")), (W, x.i("xs_w")))),
           Access("grid_ptr", ((n, x.i("gs_n")), (oh, x.i("gs_h")), (ow, x.i("gs_w")), (2, x.i("gs_k")))),
           Access("out_ptr", _walk((n, c, oh, ow), (x.i("os_n"), x.i("os_c"), x.i("os_h"), x.i("os_w"))),
                  write=True)]
    return Footprint(acc, (_cdiv(total, x.c["BLOCK"]),), {"total": total})


def _resize(x: LaunchArgs) -> Footprint:
    """Along each of the last DIMS spatial dims the source index is clamped into [0, in - 1] (each input
    size must be at least 1); a leading dim that is not resized is read at the output's index."""
    total = x.i("total")
    n, c, *walked = _unravel(total, x.d("C", "OD", "OH", "OW"))
    size_in = [x.i(name) for name in ("D", "H", "W")]
    for name, v in zip("DHW", size_in):
        if v < 1:
            raise DelegateError(f"{x.where}: argument {name!r} is {v}; the kernel clamps source indices to "
                                f"[0, {name} - 1], so it must be at least 1")
    read = [o if k < 3 - x.c["DIMS"] else v for k, (o, v) in enumerate(zip(walked, size_in))]
    acc = [Access("x_ptr", _walk((n, c, *read), [x.i(f"xs_{k}") for k in "ncdhw"])),
           Access("out_ptr", _walk((n, c, *walked), [x.i(f"os_{k}") for k in "ncdhw"]), write=True)]
    return Footprint(acc, (_cdiv(total, x.c["BLOCK"]),), {"total": total})


def _batch_norm(x: LaunchArgs) -> Footprint:
    numel = x.i("numel")
    n, c, s = _unravel(numel, x.d("C", "S"))
    acc = [Access("x_ptr", _walk((n, c, s), (x.i("xs_n"), x.i("xs_c"), x.i("xs_s")))),
           Access("mean_ptr", ((c, 1),)), Access("var_ptr", ((c, 1),)),
           Access("out_ptr", _walk((n, c, s), (x.i("os_n"), x.i("os_c"), x.i("os_s"))), write=True)]
    for param, flag in (("weight_ptr", "HAS_WEIGHT"), ("bias_ptr", "HAS_BIAS")):
        if x.c[flag]:
            acc.append(Access(param, ((c, 1),)))
    return Footprint(acc, (_cdiv(numel, x.c["BLOCK"]),), {"numel": numel})


def _arange(x: LaunchArgs) -> Footprint:
    n = x.i("n")
    return Footprint([Access("out_ptr", ((n, 1),), write=True)], (_cdiv(n, x.c["BLOCK"]),), {"n": n})


def _pad(x: LaunchArgs) -> Footprint:
    # each input index is clamped (reflect, replicate) or masked (constant) into [0, n_k); the term
    # (total, 0) reaches nothing itself but leaves no access when there are no elements
    total = x.i("total")
    x.d("d1", "d2", "d3", "d4")
    acc = [Access("out_ptr", ((total, 1),), write=True),
           Access("x_ptr", _walk(x.ints("n", 5), x.ints("s", 5)) + ((total, 0),))]
    return Footprint(acc, (_cdiv(total, x.c["BLOCK"]),), {"total": total})


# --- allowed constexprs -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Allowed:
    test: Callable[[object], bool]
    text: str


def is_int(v) -> bool:
    return type(v) is int


FLAG = Allowed(lambda v: isinstance(v, bool), "True or False")
NUMBER = Allowed(lambda v: type(v) in (int, float), "a number")


def pow2(lo: int, hi: int) -> Allowed:
    return Allowed(lambda v: is_int(v) and lo <= v <= hi and v & (v - 1) == 0, f"a power of two in [{lo}, {hi}]")


def in_range(lo: int, hi: int) -> Allowed:
    return Allowed(lambda v: is_int(v) and lo <= v <= hi, f"an integer in [{lo}, {hi}]")


def one_of(*values) -> Allowed:
    return Allowed(lambda v: type(v) in (int, str) and v in values, f"one of {', '.join(map(repr, values))}")


# The ops the pointwise formula knows (``elementwise._formula`` and ``_binary_formula``, read from their
# source so that the two never drift apart); an unknown one would fail the kernel's compile.
POINTWISE_OPS = one_of(*sorted({op for f in (elementwise._formula, elementwise._binary_formula)
                                for op in re.findall(r'OP == "(\w+)"', inspect.getsource(f.fn))}))
OPTIONS = {"num_warps": pow2(1, 32), "num_stages": in_range(1, 8)}  # launch options the launchers use
BLOCK = pow2(16, 8192)  # the 1-D kernels' block


def _epilogue_constexprs(count: str = "EPILOGUE", rounding: str = "ROUND_TO", p: str = "E") -> dict:
    spec = {count: in_range(0, 4), rounding: one_of(*DTYPE_NAMES)}
    for k in range(4):
        spec.update({f"{p}OP{k}": POINTWISE_OPS, f"{p}ARITY{k}": one_of(1, 2), f"{p}SWAP{k}": FLAG,
                     f"{p}IS_SCALAR{k}": FLAG})
    return spec


# a row kernel's fused prologue and epilogue (rows.CHAIN_NAMES)
_ROW_CHAINS = {**_epilogue_constexprs("PROLOGUE", "P_ROUND", "P"), **_epilogue_constexprs()}


def _chain_constexprs() -> dict:
    spec = {"OP0": POINTWISE_OPS, "ARITY0": one_of(1, 2), "NOPS": in_range(1, 4),
            "CT": one_of("f32", "i64", "i1"), "BLOCK": BLOCK}
    for k in range(1, 4):
        spec.update({f"OP{k}": POINTWISE_OPS, f"ARITY{k}": one_of(1, 2), f"SWAP{k}": FLAG})
    spec.update({f"IS_SCALAR{k}": FLAG for k in range(5)})
    return spec


@dataclass(frozen=True)
class KernelRule:
    footprint: Callable[[LaunchArgs], Footprint]
    constexprs: dict  # name -> Allowed, for every constexpr parameter of the kernel
    tiles: tuple = ()  # groups of block constexprs whose product is one block's elements


_GEMM = {"BLOCK_M": pow2(16, 256), "BLOCK_N": pow2(16, 256), "BLOCK_K": pow2(16, 256), "DOT_UPCAST": FLAG}
_GEMM_TILES = (("BLOCK_M", "BLOCK_N"), ("BLOCK_M", "BLOCK_K"), ("BLOCK_K", "BLOCK_N"))
_QUANT_CONSTEXPRS = {  # a weight-only quantized weight's (matmul, grouped_mm, dequant_rows)
    "QUANT": one_of("", "none", "zero", "scale", "zero_scale"), "QSUB_ROUND": one_of("", "float16", "bfloat16"),
    "QMUL_ROUND": one_of("", "float16", "bfloat16"), "QBITS": one_of(4, 8), "QZERO": in_range(-32768, 32768)}
_ROWS = {"BLOCK_R": pow2(1, 4096), "BLOCK_C": pow2(1, 8192)}

_ATTENTION = {  # attention's constexprs (attention_append's too)
    "E": in_range(0, 512), "EV": in_range(0, 512), "MASK": one_of("none", "bool", "float", "positions"), "CAUSAL": FLAG,
    "BLOCK_M": pow2(16, 256), "BLOCK_N": pow2(16, 256), "BLOCK_D": pow2(16, 512), "BLOCK_DV": pow2(16, 512),
    "DOT_UPCAST": FLAG, "PACK": in_range(1, 256), "SPLIT": FLAG, "SINKS": FLAG, "SOFTCAP": NUMBER,
    "WINDOW": in_range(0, 2 ** 31 - 1)}
_ATTENTION_TILES = (("BLOCK_M", "BLOCK_N"), ("BLOCK_M", "BLOCK_D"), ("BLOCK_M", "BLOCK_DV"), ("BLOCK_N", "BLOCK_D"),
                    ("BLOCK_N", "BLOCK_DV"))

RULES: dict[str, KernelRule] = {
    "pointwise": KernelRule(_pointwise, {
        "OP": POINTWISE_OPS, "ALPHA": NUMBER, "NARGS": in_range(1, 3), "A_SCALAR": FLAG, "B_SCALAR": FLAG,
        "C_SCALAR": FLAG, "CT": one_of("f32", "i64", "i1"), "BLOCK": BLOCK}),
    "pointwise_chain": KernelRule(_pointwise_chain, _chain_constexprs()),
    "cat": KernelRule(_cat, {"DIM": in_range(0, 4), "PARTS": in_range(2, 4), "BLOCK": BLOCK}),
    "arange": KernelRule(_arange, {"IS_FLOAT": FLAG, "BLOCK": BLOCK}),
    "pad": KernelRule(_pad, {"MODE": one_of("constant", "reflect", "replicate"), "BLOCK": BLOCK}),
    "gather": KernelRule(_gather, {"NUM_INDICES": in_range(1, 3), "BLOCK": BLOCK, **_epilogue_constexprs()}),
    "dequant_rows": KernelRule(_dequant_rows, {"BLOCK_R": pow2(1, 4096), "BLOCK_D": pow2(1, 1024), **_QUANT_CONSTEXPRS,
                                               **_epilogue_constexprs()},
                               (("BLOCK_R", "BLOCK_D"),)),
    "cumextreme": KernelRule(_cumextreme, {"IS_MIN": FLAG, "IS_FLOAT": FLAG, "BLOCK_R": pow2(1, 4096),
                                           "BLOCK_L": pow2(1, 4096)}, (("BLOCK_R", "BLOCK_L"),)),
    "cumsum": KernelRule(_cumsum, {"IS_FLOAT": FLAG, "BLOCK_R": pow2(1, 4096), "BLOCK_L": pow2(1, 4096)},
                         (("BLOCK_R", "BLOCK_L"),)),
    "embedding_bag": KernelRule(_embedding_bag, {"MODE": one_of("sum", "mean", "max"), "HAS_PSW": FLAG,
                                                 "BLOCK_T": pow2(1, 1024), "BLOCK_D": pow2(1, 4096)},
                                (("BLOCK_T", "BLOCK_D"),)),
    "cdist": KernelRule(_cdist, {"NORM": one_of("two", "one", "inf", "zero", "p"), "BLOCK_M": pow2(1, 256),
                                 "BLOCK_N": pow2(1, 256), "BLOCK_K": pow2(1, 64)},
                        (("BLOCK_M", "BLOCK_N", "BLOCK_K"),)),
    "rank": KernelRule(_rank, {"DESCENDING": FLAG, "BLOCK_I": pow2(1, 4096), "BLOCK_J": pow2(1, 4096)},
                       (("BLOCK_I", "BLOCK_J"),)),
    "router": KernelRule(_router, {"SOFTMAX_FIRST": FLAG, "RENORMALIZE": FLAG,
                                   "ROUND": one_of("", "float16", "bfloat16"),
                                   "BLOCK_E": pow2(1, 1024), "BLOCK_J": pow2(1, 4096)}, (("BLOCK_E", "BLOCK_J"),)),
    "group_router": KernelRule(_group_router, {
        "RENORMALIZE": FLAG, "BLOCK_E": pow2(1, 1024), "BLOCK_G": pow2(1, 64), "BLOCK_EG": pow2(1, 1024),
        "BLOCK_J": pow2(1, 4096)}, (("BLOCK_E", "BLOCK_J"), ("BLOCK_E", "BLOCK_G"), ("BLOCK_G", "BLOCK_EG"))),
    "histc": KernelRule(_histc, {"FROM_DATA": FLAG, "CUMULATIVE": FLAG, "CAST": FLAG,
                                 "BLOCK_B": pow2(1, 4096), "BLOCK_N": pow2(1, 4096)},
                        (("BLOCK_N", "BLOCK_B"),)),
    "sort_offsets": KernelRule(_sort_offsets, {
        "DESCENDING": FLAG, "FROM_DATA": FLAG, "CAST": FLAG, "BLOCK_I": pow2(1, 4096), "BLOCK_J": pow2(1, 4096),
        "BLOCK_B": pow2(1, 4096), "BLOCK_N": pow2(1, 4096)}, (("BLOCK_I", "BLOCK_J"), ("BLOCK_N", "BLOCK_B"))),
    "scatter": KernelRule(_scatter, {"NUM_INDICES": in_range(1, 3), "ACCUMULATE": FLAG, "SRC_SCALAR": FLAG,
                                     "BLOCK": BLOCK, "PAIR": FLAG}),
    "matmul": KernelRule(_matmul, {
        **_GEMM, "HAS_BIAS": FLAG, "GROUP_M": in_range(1, 64), **_epilogue_constexprs(),
        "PROLOGUE": one_of("", "rms", "layer"), "HAS_PW": FLAG, "HAS_PB": FLAG,
        "GLU": one_of("", *sorted(GLU_ACTS)), "GLU_ROUND": one_of(*DTYPE_NAMES),
        # GEMV (no tl.dot) takes tiles of 1 to 8 rows and 8 columns; the accesses are the same
        "GEMV": FLAG, "BLOCK_M": pow2(1, 256), "BLOCK_N": pow2(8, 256),
        "ROPE": one_of("", "angles", "tables", "positions"), "ROPE_ROUND": one_of("", "float16", "bfloat16"),
        "NORM_E": one_of(0, *(2 ** k for k in range(1, 10))),
        **_QUANT_CONSTEXPRS}, _GEMM_TILES),
    "grouped_mm": KernelRule(_grouped_mm, {
        "BLOCK_M": pow2(1, 256), "BLOCK_N": pow2(8, 256), "BLOCK_K": pow2(16, 256), "BLOCK_E": pow2(2, 8192),
        "PER_ROW": FLAG, "DOT_UPCAST": FLAG, "GLU": one_of("", *sorted(GROUPED_GLU_ACTS)),
        "GLU_ALPHA": NUMBER, "GLU_LIMIT": NUMBER,
        "GLU_ROUND": one_of(*DTYPE_NAMES), "ROWS": FLAG, "DEST": FLAG,
        "PROLOGUE": one_of("", "rms"), "HAS_PW": FLAG, "HAS_BIAS": FLAG, **_epilogue_constexprs(), **_QUANT_CONSTEXPRS},
        _GEMM_TILES + (("BLOCK_M", "BLOCK_K", "BLOCK_N"), ("BLOCK_M", "BLOCK_E"))),
    "conv2d": KernelRule(_conv2d, {**_GEMM, "KD": in_range(1, 4096), "KH": in_range(1, 4096), "KW": in_range(1, 4096),
                                   "HAS_BIAS": FLAG, "TRANSPOSED": FLAG, "DEPTH": FLAG, "PHASED": FLAG,
                                   "POOL_KH": in_range(0, 64), "POOL_KW": in_range(0, 64), "POOL": one_of("max", "avg"),
                                   "POOL_COUNT_PAD": FLAG, **_epilogue_constexprs()},
                         _GEMM_TILES),
    "depthwise_conv": KernelRule(_depthwise_conv, {
        "BLOCK_M": pow2(1, 4096), "BLOCK_N": pow2(16, 256), "KD": in_range(1, 4096), "KH": in_range(1, 4096),
        "KW": in_range(1, 4096), "HAS_BIAS": FLAG, "DEPTH": FLAG, **_epilogue_constexprs()}, (("BLOCK_M", "BLOCK_N"),)),
    "conv1x1": KernelRule(_conv1x1, {
        **_GEMM, "KH": in_range(1, 4096), "KW": in_range(1, 4096), "DEPTHWISE": FLAG, "HAS_DW_BIAS": FLAG,
        "HAS_BIAS": FLAG, "NORM": FLAG, "HAS_NW": FLAG, "HAS_NB": FLAG,
        **_epilogue_constexprs("PROLOGUE", "P_ROUND", "P"), **_epilogue_constexprs()}, _GEMM_TILES),
    "pool2d": KernelRule(_pool2d, {
        "MODE": one_of("max", "avg", "adaptive_avg", "adaptive_max"), "KD": in_range(1, 4096),
        "KH": in_range(1, 4096), "KW": in_range(1, 4096), "COUNT_INCLUDE_PAD": FLAG, "DIVISOR_OVERRIDE": FLAG,
        "WRITE_INDICES": FLAG, "BLOCK_M": pow2(1, 4096), "BLOCK_K": pow2(1, 4096), "DEPTH": FLAG},
        (("BLOCK_M", "BLOCK_K"),)),
    "resize": KernelRule(_resize, {
        "MODE": one_of("nearest", "nearest_exact", "linear", "cubic"), "DIMS": in_range(1, 3),
        "ALIGN_CORNERS": FLAG, "SHORTCUTS": FLAG, "BLOCK": BLOCK}),
    "batch_norm": KernelRule(_batch_norm, {"HAS_WEIGHT": FLAG, "HAS_BIAS": FLAG, "BLOCK": BLOCK}),
    "grid_sample": KernelRule(_grid_sample, {"MODE": one_of("bilinear", "nearest"),
                                             "PADDING": one_of("zeros", "border", "reflection"), "ALIGN": FLAG,
                                             "BLOCK": BLOCK}),
    "attention": KernelRule(_attention, _ATTENTION, _ATTENTION_TILES),
    "attention_append": KernelRule(_attention_append, _ATTENTION, _ATTENTION_TILES),
    "attention_combine": KernelRule(_attention_combine, {
        "EV": in_range(1, 512), "BLOCK_S": pow2(1, 256), "BLOCK_DV": pow2(16, 512), "SINKS": FLAG},
        (("BLOCK_S", "BLOCK_DV"),)),
    "softmax": KernelRule(_softmax, {"LOG": FLAG, "ONE_PASS": FLAG, **_ROWS, **_ROW_CHAINS}, (("BLOCK_R", "BLOCK_C"),)),
    "norm": KernelRule(_norm, {"RMS": FLAG, "HAS_W": FLAG, "HAS_B": FLAG, "STATS": FLAG, "ONE_PASS": FLAG,
                               **_ROWS, **_ROW_CHAINS}, (("BLOCK_R", "BLOCK_C"),)),
    "norm_apply": KernelRule(_norm_apply, {"HAS_W": FLAG, "HAS_B": FLAG, **_ROWS, **_ROW_CHAINS},
                             (("BLOCK_R", "BLOCK_C"),)),
    "reduce": KernelRule(_reduce, {
        "MAP": one_of("id", "sq", "abs"), "FINISH": one_of("none", "div", "sqrt"), "INT_ACC": FLAG,
        "COMBINE": one_of("sum", "prod", "max", "min", "argmax", "argmin", "welford"), **_ROWS, **_ROW_CHAINS},
        (("BLOCK_R", "BLOCK_C"),)),
    "rotary": KernelRule(_rotary, {"PAIR": FLAG, "BLOCK_R": pow2(1, 4096), "BLOCK_H": pow2(1, 4096), "NORM": FLAG,
                                   "ANGLES": FLAG, "ROUND": one_of("", "float16", "bfloat16")},
                         (("BLOCK_R", "BLOCK_H"),)),
}


@functools.lru_cache(maxsize=None)
def kernel_parameters(kernel) -> tuple[list[str], dict[str, object]]:
    """A kernel's runtime parameter names, and its constexpr parameters with their defaults
    (``inspect.Parameter.empty`` where there is none)."""
    params = inspect.signature(kernel.fn).parameters.values()
    runtime = [p.name for p in params if not _is_constexpr(p)]
    return runtime, {p.name: p.default for p in params if _is_constexpr(p)}
