"""The traffic model: the bytes each launch must read and write, and its FLOPs; per method, their sum
next to a lower bound. Our CPU-side proxy for GPU time (DESIGN.md, "Kernels").

Per launch (:func:`annotate`, run by ``backend.build_plan`` on every plan it returns):

    bytes_read    = sum over the buffers the launch reads    of the distinct bytes its views there span
    bytes_written = sum over the buffers the launch writes   of the distinct bytes its views there span
    flops         = the kernel's formula in ``TRAFFIC`` below

A view's bytes are the distinct addresses it spans: a broadcast (stride 0) dim adds nothing, a
transposed view counts once, a strided slice counts its elements, not the gaps between them. Views of
one buffer that one launch reads (or writes) are merged first, so ``x * x``, or ``q``, ``k`` and ``v``
sliced out of one projection, count each byte once. A pointer the kernel reaches only through index
values (a gather's source, a scatter's destination) counts at most the elements the launch walks.
Reads and writes are counted apart: an in-place update reads and writes its bytes. Every launch is
modelled as if it read each byte once (ideal caches), and sector granularity is ignored.

Which pointer parameters a kernel reads and writes, and when, is written out per kernel in the one
table ``TRAFFIC``, next to its FLOP formula; every entry of ``table.KERNELS`` needs one (a new or
fused kernel only adds its row). Parameters are named as in the ``@triton.jit`` signature; launch
arguments are matched to them by position, constexprs by name.

Per method (:func:`method_traffic`): the launches' sums, and the lower bound: every constant, method
input and state buffer that a delegate reads, read once, and every delegate result that is a method
output or state, written once (a value the launches touch only in part, through indices, counts
no more than they touch: an embedding table's gathered rows, a KV-cache slot update).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..dtypes import parse_dtype
from ..plan import Base, DelegatePlan, Launch, TensorDesc
from ..program import InstrKind, Method, Role
from ..symbolic import any_symbolic, bound
from .table import KERNELS

Args = dict  # parameter name -> value (an int tensor index for pointers), plus "grid"


# --- the table --------------------------------------------------------------------------------------
def _always(a: Args) -> bool:
    return True


@dataclass(frozen=True)
class Access:
    """A pointer parameter a kernel reads or writes."""

    param: str
    when: Callable[[Args], bool] = _always  # touched only when this holds (else a stand-in pointer)
    # reached through index values, or a window of it: at most this many elements (None: the whole view)
    at_most: Callable[[Args], int | None] | None = None


@dataclass(frozen=True)
class KernelTraffic:
    reads: tuple[Access, ...]
    writes: tuple[Access, ...]
    flops: Callable[[Args], int]


def _flag(name: str) -> Callable[[Args], bool]:
    return lambda a: bool(a[name])


def _not(name: str) -> Callable[[Args], bool]:
    return lambda a: not a[name]


# FLOPs per element of the pointwise formulas (elementwise._formula); 1 where not listed. A copy or a
# cast is 0; a transcendental counts as one op.
POINTWISE_FLOPS = {
    "copy": 0, "sigmoid": 3, "silu": 4, "tanh": 4, "gelu": 5, "gelu_tanh": 9, "pow": 4, "clamp": 2,
    "logical_and": 2, "logical_or": 2, "div_floor": 6, "div_trunc": 2, "remainder": 3, "log1p": 4, "expm1": 4,
    "mish": 10, "hardswish": 5, "leaky_relu": 2, "elu": 6, "celu": 7, "softplus": 6, "sigmoid_gate": 5, "erf": 4,
    "softsign": 3, "tanhshrink": 5, "logsigmoid": 6, "hardshrink": 3, "softshrink": 4, "threshold_mark": 2,
    "threshold_fill": 2,
}


def _pointwise_op_flops(op: str, alpha=1) -> int:
    extra = 1 if op in ("add", "sub") and alpha != 1 else 0  # a + alpha * b
    return POINTWISE_FLOPS.get(op, 1) + extra


def _steps_flops(a: Args, p: str = "E") -> int:
    """FLOPs per element of a fused chain's steps: the epilogue's (``p`` "E") or the prologue's ("P")."""
    count = {"P": "PROLOGUE", "E": "EPILOGUE"}[p]
    return sum(_pointwise_op_flops(a[f"{p}OP{k}"]) for k in range(a.get(count) or 0))


def _pointwise_operand(slot: int, scalar: str) -> Callable[[Args], bool]:
    """Operand ``slot`` (0: a, 1: b, 2: c) of a ``pointwise`` launch is read when it is used and is
    not a scalar; otherwise its pointer is a stand-in (the output)."""
    return lambda a: a["NARGS"] > slot and not a[scalar]


def _chain_operand(slot: int) -> Callable[[Args], bool]:
    """Slot 0 of a ``pointwise_chain`` is always read; slot 1 when op 0 is binary; slot k + 1 when op
    k < NOPS is binary; never a scalar slot (elementwise.pointwise_chain_kernel)."""
    def used(a: Args) -> bool:
        if a[f"IS_SCALAR{slot}"]:
            return False
        if slot == 0:
            return True
        step = slot - 1
        return step < a["NOPS"] and a[f"ARITY{step}"] == 2
    return used


def _chain_flops(a: Args) -> int:
    return a["n"] * sum(_pointwise_op_flops(a[f"OP{k}"]) for k in range(a["NOPS"]))


def _epilogue_operand(k: int) -> Callable[[Args], bool]:
    """Operand of epilogue step k of a ``matmul``, ``conv2d`` or ``gather`` launch: read when the step
    runs, is binary and its operand is not a scalar (matmul.matmul_kernel, index.gather_kernel)."""
    return lambda a: (a.get("EPILOGUE") or 0) > k and a[f"EARITY{k}"] == 2 and not a[f"EIS_SCALAR{k}"]


def _stored(a: Args, k: int) -> int:
    """The bytes a quantized row of ``k`` values holds: one per value, half of one with 4 bits."""
    return -(-k // (2 if a["QBITS"] == 4 else 1))


def _groups(a: Args, k: int) -> int:
    """The zero or scale entries of a quantized row of ``k`` values: one per group of ``q_group``."""
    return -(-k // max(a["q_group"], 1))


def _table_rows(a: Args) -> int:
    """A quantized embedding table's zero or scale entries of the R rows looked up."""
    return a["R"] * _groups(a, a["D"])


def _expert_tables(a: Args) -> int:
    """A quantized grouped GEMM's zero or scale table: N rows of groups per expert with rows."""
    return min(a["E"], a["S"]) * a["N"] * _groups(a, a["K"])


def _matmul_flops(a: Args) -> int:
    # C[z] = alpha * (A[z] @ B[z]) + beta * X[z]: 2MNK per batch entry, plus the epilogue's ops per
    # element of C (alpha, the bias, then the fused pointwise steps)
    z = a["grid"][1]
    epilogue = (a["alpha"] != 1) + (1 + (a["beta"] != 1) if a["HAS_BIAS"] else 0)
    epilogue += _steps_flops(a, "E")
    return z * (2 * a["M"] * a["N"] * a["K"] + epilogue * a["M"] * a["N"])


def _phase_taps(out: int, stride: int, pad: int, k: int) -> int:
    """Along one dim of a PHASED transposed conv: the (output row, tap) pairs its programs walk, summed over
    the phases o0 < stride: cdiv(out - o0, stride) rows, each walking the cdiv(k - (o0 + pad) % stride,
    stride) taps of its residue."""
    return sum(max(0, -(-(out - o0) // stride)) * max(0, -(-(k - (o0 + pad) % stride) // stride))
               for o0 in range(stride))


def _conv_flops(a: Args) -> int:
    # implicit GEMM per group: M = N*OD*OH*OW rows, COUT_G columns, K = CIN_G*KD*KH*KW taps walked per row
    # (a pooling one: M pooled rows, each computing the POOL_KH*POOL_KW pixels of its window);
    # groups = grid axis 2 (a 2-D launch: KD = 1). A dilated transposed one walks every tap too, masking
    # those that are not exact (stride_d*stride_h*stride_w times the useful ones); one by stride phase
    # (PHASED) walks each row's exact taps only, CIN_G per tap: N * CIN_G * the product over dims of
    # _phase_taps (taps whose input lies outside x, at the borders, are walked and masked)
    cout = a["COUT_G"] * a["grid"][2]
    pixels = a["M"] * max(a.get("POOL_KH", 0) * a.get("POOL_KW", 0), 1)  # pooling: each row's window's taps
    bias = pixels * cout if a["HAS_BIAS"] else 0
    if not a.get("PHASED"):
        return 2 * pixels * cout * a["CIN_G"] * a["KD"] * a["KH"] * a["KW"] + bias
    dims = ("d", "h", "w") if a.get("DEPTH") else ("h", "w")
    sizes = {"d": a["OD"], "h": a["OH"], "w": a["OW"]}
    batch = a["M"] // max(math.prod(sizes[d] for d in dims), 1)
    pairs = math.prod(_phase_taps(sizes[d], a[f"stride_{d}"], a[f"pad_{d}"], a[f"K{d.upper()}"]) for d in dims)
    return 2 * batch * pairs * cout * a["CIN_G"] + bias


def _causal_pairs(lq: int, lk: int) -> int:
    """(query, key) pairs with key j <= query i (top-left aligned), as the kernel visits them."""
    full = min(lq, lk)
    return full * (full + 1) // 2 + (lq - full) * lk


def _window_keys(a: Args) -> int:
    """Keys a launch reads per (batch, key head): all ``Lk``, or with a sliding window (``WINDOW``) those
    from a tile before the first query's position - WINDOW + 1 to the last's, the queries' positions taken
    consecutive (a decode step's one position, or a prompt's ``cache_position``)."""
    if not a.get("WINDOW") or a["MASK"] != "positions":
        return a["Lk"]
    return min(a["Lk"], a["Lq"] - 1 + a["WINDOW"] + a["BLOCK_N"] - 1)


def _window_reads(width: str) -> Callable[[Args], int | None]:
    """At most the keys (or values) ``_window_keys`` names, ``width`` elements each, per (batch, key
    head); None (the whole view) without a window."""
    return lambda a: _kv_heads(a) * _window_keys(a) * a[width] if _window_keys(a) < a["Lk"] else None


def _kv_heads(a: Args) -> int:
    """(batch, key head) pairs of an attention launch: its (batch, query head) programs over GROUP."""
    return max(1, a["grid"][1] * a["PACK"] // a["GROUP"])


def _attention_flops(a: Args) -> int:
    # per (batch, head) = grid axis 1 x PACK and visited (i, j) pair: q.k over E, p.v over EV, 2 FLOPs a term;
    # a soft-cap adds a divide, a tanh and a multiply per pair
    pairs = _causal_pairs(a["Lq"], a["Lk"]) if a["CAUSAL"] else a["Lq"] * _window_keys(a)
    per_pair = 2 * (a["E"] + a["EV"]) + (2 + POINTWISE_FLOPS["tanh"] if a.get("SOFTCAP") else 0)
    return a["grid"][1] * a["PACK"] * pairs * per_pair


def _new_rows(a: Args) -> int:
    """Cache rows an ``attention_append`` launch writes: Lnew per (batch, key head)."""
    return _kv_heads(a) * a["Lnew"]


def _norm_flops(a: Args) -> int:
    # layer_norm: sum, subtract, square, sum, scale; rms_norm: square, sum, scale; + weight, + bias
    per = (3 if a["RMS"] else 5) + bool(a["HAS_W"]) + bool(a["HAS_B"])
    return a["rows"] * a["cols"] * per + _row_chain_flops(a)


def _row_chain_operand(p: str, k: int) -> Callable[[Args], bool]:
    """Operand of step k of a row kernel's fused prologue (``p`` "P") or epilogue ("E"): read when the
    step runs, is binary and its operand is not a scalar (rows.row_load, rows.row_store)."""
    count = {"P": "PROLOGUE", "E": "EPILOGUE"}[p]
    return lambda a: (a.get(count) or 0) > k and a.get(f"{p}ARITY{k}") == 2 and not a.get(f"{p}IS_SCALAR{k}")


# a norm's, softmax's or reduction's fused chains' operands; without a chain their pointers are x or out
_ROW_CHAIN_READS = tuple(Access(f"{p.lower()}{k}_ptr", _row_chain_operand(p, k)) for p in "PE" for k in range(4))


def _row_chain_flops(a: Args) -> int:
    """A row kernel's fused steps per element: the prologue's once per read of x (twice when a row
    takes two passes), the epilogue's once."""
    pro = _steps_flops(a, "P")
    epi = _steps_flops(a, "E")
    return a["rows"] * a["cols"] * (pro * (1 if a["ONE_PASS"] else 2) + epi)


def _conv1x1_flops(a: Args) -> int:
    """``fuse_conv1x1``'s kernel: its input t once per program column (its taps, or a norm's scale and
    shift), then the 1x1 GEMM."""
    t = a["M"] * a["K"]
    pro = _steps_flops(a, "P")
    epi = _steps_flops(a, "E")
    taps = 2 * a["KH"] * a["KW"] + (1 if a["HAS_DW_BIAS"] else 0) if a["DEPTHWISE"] else 2 if a.get("NORM") else 0
    inputs = t * (taps + pro) * a["grid"][1]
    return inputs + a["M"] * a["COUT"] * (2 * a["K"] + (1 if a["HAS_BIAS"] else 0) + epi)


REDUCE_FLOPS = {"sum": 1, "prod": 1, "max": 1, "min": 1, "argmax": 2, "argmin": 2, "welford": 4}


def _reduce_flops(a: Args) -> int:
    """The formula per element, a fused prologue's steps per element, an epilogue's per row."""
    per = REDUCE_FLOPS.get(a["COMBINE"], 1) + (a["MAP"] != "id")
    pro = _steps_flops(a, "P")
    epi = _steps_flops(a, "E")
    return a["rows"] * (a["cols"] * (per + pro) + epi)


RESIZE_TAPS = {"nearest": 1, "nearest_exact": 1, "linear": 2, "cubic": 4}  # taps per resized dim
RESIZE_FLOPS = {"nearest": 0, "nearest_exact": 0, "linear": 3, "cubic": 7}  # per combination of taps


def _resize_reads(a: Args) -> int:
    """The input elements a resize can read: per (n, c), along each resized dim at most ``taps`` per
    output index and never more than the input size (downsampling skips rows and columns)."""
    out = a["OD"] * a["OH"] * a["OW"]
    taps = RESIZE_TAPS[a["MODE"]]
    spatial = math.prod(min(a[f"O{d}"] * taps, a[d]) for d in "DHW"[3 - a["DIMS"]:])
    return a["total"] // max(out, 1) * spatial


def _resize_flops(a: Args) -> int:
    """Per output element: linear one lerp (2 multiplies, an add) per pair of taps combined, 2^DIMS - 1
    of them; cubic 4 multiply-adds per row of 4 taps, (4^DIMS - 1) / 3 rows; nearest none."""
    taps = RESIZE_TAPS[a["MODE"]]
    return a["total"] * RESIZE_FLOPS[a["MODE"]] * (taps ** a["DIMS"] - 1) // max(taps - 1, 1)


def _part_used(k: int) -> Callable[[Args], bool]:
    return lambda a: k < a["PARTS"]


def _zero(a: Args) -> int:
    return 0


def _n(a: Args) -> int:
    return a["n"]


def _indices(count: int) -> Callable[[Args], bool]:
    return lambda a: a["NUM_INDICES"] >= count


# attention's: without a mask mask_ptr is q, never read; with SPLIT the partials replace the output and the
# combine reads the sinks; without SINKS sink_ptr is q
_ATTENTION = KernelTraffic(
    reads=(Access("q_ptr"), Access("k_ptr", at_most=_window_reads("E")), Access("v_ptr", at_most=_window_reads("EV")),
           Access("mask_ptr", lambda a: a["MASK"] != "none"),
           Access("sink_ptr", lambda a: a["SINKS"] and not a["SPLIT"])),
    writes=(Access("out_ptr", lambda a: not a["SPLIT"]), Access("part_ptr", _flag("SPLIT")),
            Access("stat_ptr", _flag("SPLIT"))),
    flops=_attention_flops,
)

# kernel -> which pointers it reads and writes (and when), and its FLOPs. One row per KERNELS entry.
TRAFFIC: dict[str, KernelTraffic] = {
    # out = OP(a, b, c); a scalar or unused operand slot passes out as a stand-in, never read
    "pointwise": KernelTraffic(
        reads=(Access("a_ptr", _pointwise_operand(0, "A_SCALAR")), Access("b_ptr", _pointwise_operand(1, "B_SCALAR")),
               Access("c_ptr", _pointwise_operand(2, "C_SCALAR"))),
        writes=(Access("out_ptr"),),
        flops=lambda a: a["n"] * _pointwise_op_flops(a["OP"], a["ALPHA"]),
    ),
    # r = OP0(p0, p1); r = OPk(r, p(k+1)) ...; unused slots pass out as a stand-in
    "pointwise_chain": KernelTraffic(
        reads=tuple(Access(f"p{k}_ptr", _chain_operand(k)) for k in range(5)),
        writes=(Access("out_ptr"),),
        flops=_chain_flops,
    ),
    # out's slices along DIM = parts 0 .. PARTS - 1; unused part slots pass out as a stand-in
    "cat": KernelTraffic(reads=tuple(Access(f"p{k}_ptr", _part_used(k)) for k in range(4)),
                         writes=(Access("out_ptr"),), flops=_zero),
    "arange": KernelTraffic(reads=(), writes=(Access("out_ptr"),), flops=_zero),
    # out[i] = x[source(i)] or the pad value: at most one read of x per output element
    "pad": KernelTraffic(reads=(Access("x_ptr", at_most=lambda a: a["total"]),), writes=(Access("out_ptr"),),
                         flops=_zero),
    # out[o] = src[direct(o) + index terms]: n elements of src at most; unused index slots repeat idx0;
    # then EPILOGUE fused pointwise steps, each reading e<k> when binary (else a stand-in)
    "gather": KernelTraffic(
        reads=(Access("src_ptr", at_most=_n), Access("idx0_ptr"),
               Access("idx1_ptr", _indices(2)), Access("idx2_ptr", _indices(3)),
               *(Access(f"e{k}_ptr", _epilogue_operand(k)) for k in range(4))),
        writes=(Access("out_ptr"),),
        flops=lambda a: a["n"] * _steps_flops(a, "E"),
    ),
    # out[r] = the dequantized row idx[r] of a quantized table: R rows of q at most (half a byte per value
    # with 4 bits), and of each table R rows of its groups; a few ops per value; then EPILOGUE fused
    # pointwise steps, each reading e<k> when binary
    "dequant_rows": KernelTraffic(
        reads=(Access("q_ptr", at_most=lambda a: a["R"] * _stored(a, a["D"])),
               Access("idx_ptr"),
               Access("qz_ptr", lambda a: "zero" in a["QUANT"], at_most=_table_rows),
               Access("qs_ptr", lambda a: "scale" in a["QUANT"], at_most=_table_rows),
               *(Access(f"e{k}_ptr", _epilogue_operand(k)) for k in range(4))),
        writes=(Access("out_ptr"),), flops=lambda a: a["R"] * a["D"] * (2 + _steps_flops(a, "E"))),
    "cumsum": KernelTraffic(reads=(Access("x_ptr"),), writes=(Access("out_ptr"),),
                            flops=lambda a: a["rows"] * a["length"]),
    "cumextreme": KernelTraffic(reads=(Access("x_ptr"),), writes=(Access("out_ptr"), Access("idx_ptr")),
                                flops=lambda a: a["rows"] * a["length"]),
    # each bag's rows gathered (the table counts at most the entries' rows) and reduced: one op per element
    # (two with per-sample weights)
    "embedding_bag": KernelTraffic(
        reads=(Access("w_ptr", at_most=lambda a: a["n_indices"] * a["D"]), Access("idx_ptr"), Access("offs_ptr"),
               Access("psw_ptr", _flag("HAS_PSW"))),
        writes=(Access("out_ptr"),),
        flops=lambda a: a["n_indices"] * a["D"] * (2 if a["HAS_PSW"] else 1)),
    # per (batch, i, j) and column: a difference, its norm's map (|d|, d^2, ...) and a combine
    "cdist": KernelTraffic(reads=(Access("a_ptr"), Access("b_ptr")), writes=(Access("out_ptr"),),
                           flops=lambda a: 3 * a["grid"][2] * a["P"] * a["R"] * a["M"]),
    # every element of a row compared with every other (two compares and a sum each); ranks below k stored
    "rank": KernelTraffic(reads=(Access("x_ptr"),), writes=(Access("values_ptr"), Access("indices_ptr")),
                          flops=lambda a: 3 * a["rows"] * a["length"] * a["length"]),
    # a row's softmax (about 4 ops an element), then as "rank", then the renormalization
    "router": KernelTraffic(reads=(Access("x_ptr"),), writes=(Access("values_ptr"), Access("indices_ptr")),
                            flops=lambda a: a["rows"] * a["length"] * (3 * a["length"] + 4)),
    # the groups' top two and ranks, then every expert ranked against the row (3 ops a pair)
    "group_router": KernelTraffic(reads=(Access("s_ptr"), Access("b_ptr")),
                                  writes=(Access("values_ptr"), Access("indices_ptr")),
                                  flops=lambda a: a["rows"] * a["length"] * (3 * a["length"] + 8)),
    # each element's bin (4 ops) compared with every bin
    "histc": KernelTraffic(reads=(Access("x_ptr"),), writes=(Access("out_ptr"),),
                           flops=lambda a: a["n"] * (4 + a["bins"])),
    # "rank" over the one row, then "histc" over the same elements
    "sort_offsets": KernelTraffic(reads=(Access("x_ptr"),),
                                  writes=(Access("values_ptr"), Access("indices_ptr"), Access("offsets_ptr")),
                                  flops=lambda a: 3 * a["n"] * a["n"] + a["n"] * (4 + a["bins"])),
    # dst[direct(o) + index terms] = src[o] (+= atomically: ACCUMULATE reads dst too); a scalar source
    # passes dst as a stand-in
    # with PAIR also dst2 from src2 at the same indices (grid axis 1)
    "scatter": KernelTraffic(
        reads=(Access("src_ptr", _not("SRC_SCALAR")), Access("idx0_ptr"),
               Access("idx1_ptr", _indices(2)), Access("idx2_ptr", _indices(3)),
               Access("dst_ptr", _flag("ACCUMULATE"), at_most=_n),
               Access("src2_ptr", lambda a: a["PAIR"] and not a["SRC_SCALAR"]),
               Access("dst2_ptr", lambda a: a["PAIR"] and a["ACCUMULATE"], at_most=_n)),
        writes=(Access("dst_ptr", at_most=_n), Access("dst2_ptr", _flag("PAIR"), at_most=_n)),
        flops=lambda a: a["n"] * (2 if a["PAIR"] else 1) if a["ACCUMULATE"] else 0,
    ),
    # C = alpha * A @ B + beta * X, then EPILOGUE fused pointwise steps, each reading e<k> when binary;
    # without a bias x_ptr is C, never read
    "matmul": KernelTraffic(
        reads=(Access("a_ptr"), Access("b_ptr"), Access("x_ptr", _flag("HAS_BIAS")),
               *(Access(f"e{k}_ptr", _epilogue_operand(k)) for k in range(4)),
               Access("p_ptr", _flag("HAS_PW")), Access("pb_ptr", _flag("HAS_PB")),  # a norm prologue's
               # the rotary epilogue's pairs and tables (sin only with tables given)
               Access("r_ptr", _flag("ROPE")), Access("rc_ptr", _flag("ROPE")),
               Access("rs_ptr", lambda a: a["ROPE"] in ("tables", "positions")), Access("rn_ptr", _flag("NORM_E")),
               # a quantized B's zero and scale tables
               Access("qz_ptr", lambda a: "zero" in a["QUANT"]), Access("qs_ptr", lambda a: "scale" in a["QUANT"])),
        writes=(Access("c_ptr"),),
        flops=_matmul_flops,
    ),
    # out[r] = x[r] @ w[e(r)], e(r) from offs: the experts' weights are reached through offs, so at most
    # the min(E, S) experts that have rows count (K x N each); 2 FLOPs per (row, column, k), then the
    # EPILOGUE steps per output element (each reading e<k> when binary); with ROWS x's rows are read
    # through rows, S of them at most; with DEST the rows' destinations too; with an rms prologue its
    # weight; with HAS_BIAS the experts' biases; a quantized w (QUANT) is its bytes (half a byte per
    # weight with 4 bits) and its zero and scale tables, as many experts'
    "grouped_mm": KernelTraffic(
        reads=(Access("x_ptr", at_most=lambda a: a["S"] * a["K"]),
               Access("w_ptr", at_most=lambda a: min(a["E"], a["S"]) * _stored(a, a["K"]) * a["N"]),
               Access("offs_ptr"), Access("rows_ptr", _flag("ROWS")), Access("dest_ptr", _flag("DEST")),
               Access("p_ptr", _flag("HAS_PW")), Access("bias_ptr", _flag("HAS_BIAS")),
               Access("qz_ptr", lambda a: "zero" in a["QUANT"], at_most=_expert_tables),
               Access("qs_ptr", lambda a: "scale" in a["QUANT"], at_most=_expert_tables),
               *(Access(f"e{k}_ptr", _epilogue_operand(k)) for k in range(4))),
        writes=(Access("out_ptr"),),
        flops=lambda a: 2 * a["S"] * a["N"] * a["K"] + a["S"] * a["N"] // (2 if a["GLU"] else 1) * _steps_flops(a, "E"),
    ),
    # without a bias bias_ptr is out, never read
    "conv2d": KernelTraffic(
        reads=(Access("x_ptr"), Access("w_ptr"), Access("bias_ptr", _flag("HAS_BIAS")),
               *(Access(f"e{k}_ptr", _epilogue_operand(k)) for k in range(4))),
        writes=(Access("out_ptr"),),
        flops=_conv_flops,
    ),
    # one multiply-add per output element and tap
    "depthwise_conv": KernelTraffic(
        reads=(Access("x_ptr"), Access("w_ptr"), Access("bias_ptr", _flag("HAS_BIAS")),
               *(Access(f"e{k}_ptr", _epilogue_operand(k)) for k in range(4))),
        writes=(Access("out_ptr"),),
        flops=lambda a: a["M"] * a["COUT"] * (2 * a["KD"] * a["KH"] * a["KW"] + (1 if a["HAS_BIAS"] else 0)),
    ),
    # a 1x1 convolution of t (K channels) computed where it is read, from a depthwise convolution's taps
    # (DEPTHWISE) or a tensor over t's shape, then the PROLOGUE steps: per program column (grid axis 1)
    # each of t's M x K elements takes KH * KW multiply-adds, the depthwise bias and those steps; then
    # 2 FLOPs per (pixel, output channel, k), the bias and the EPILOGUE steps
    "conv1x1": KernelTraffic(
        reads=(Access("x_ptr"), Access("v_ptr", _flag("DEPTHWISE")), Access("c_ptr", _flag("HAS_DW_BIAS")),
               Access("w_ptr"), Access("bias_ptr", _flag("HAS_BIAS")), *_ROW_CHAIN_READS,
               Access("var_ptr", _flag("NORM")), Access("mean_ptr", _flag("NORM")),
               Access("nw_ptr", lambda a: a.get("NORM") and a.get("HAS_NW")),
               Access("nb_ptr", lambda a: a.get("NORM") and a.get("HAS_NB"))),
        writes=(Access("out_ptr"),),
        flops=_conv1x1_flops,
    ),
    # each output element reads its grid point and 4 taps (bilinear: 3 mul-adds and 8 weight ops each
    # side) or 1 (nearest); the input counts at most the taps
    "grid_sample": KernelTraffic(
        reads=(Access("x_ptr", at_most=lambda a: a["total"] * (4 if a["MODE"] == "bilinear" else 1)),
               Access("grid_ptr")),
        writes=(Access("out_ptr"),),
        flops=lambda a: a["total"] * (20 if a["MODE"] == "bilinear" else 6),
    ),
    # one op per window tap; without indices idx_ptr is out, never written
    "pool2d": KernelTraffic(
        reads=(Access("x_ptr"),),
        writes=(Access("out_ptr"), Access("idx_ptr", _flag("WRITE_INDICES"))),
        flops=lambda a: a["total"] * a["KD"] * a["KH"] * a["KW"],
    ),
    # out = the taps of x around each output element's source index: x's elements at most as
    # _resize_reads counts them (taps actually read), the output once
    "resize": KernelTraffic(reads=(Access("x_ptr", at_most=_resize_reads),), writes=(Access("out_ptr"),),
                            flops=_resize_flops),
    # (x - mean) * rsqrt(var + eps) [* weight] [+ bias]; absent weight/bias pass mean as a stand-in
    "batch_norm": KernelTraffic(
        reads=(Access("x_ptr"), Access("mean_ptr"), Access("var_ptr"),
               Access("weight_ptr", _flag("HAS_WEIGHT")), Access("bias_ptr", _flag("HAS_BIAS"))),
        writes=(Access("out_ptr"),),
        flops=lambda a: a["numel"] * (3 + bool(a["HAS_WEIGHT"]) + bool(a["HAS_BIAS"])),
    ),
    "attention": _ATTENTION,
    # attention's, and first the new rows (read through their strides) written at their indices
    "attention_append": replace(
        _ATTENTION, reads=_ATTENTION.reads + (Access("kn_ptr"), Access("vn_ptr"), Access("idx_ptr")),
        writes=_ATTENTION.writes + (Access("k_ptr", at_most=lambda a: _new_rows(a) * a["E"]),
                                    Access("v_ptr", at_most=lambda a: _new_rows(a) * a["EV"]))),
    # per row and split: a weight (exp2), then EV multiply-adds of the partial and one of the sum
    "attention_combine": KernelTraffic(
        reads=(Access("part_ptr"), Access("stat_ptr"), Access("sink_ptr", _flag("SINKS"))),
        writes=(Access("out_ptr"),),
        flops=lambda a: a["grid"][0] * a["S"] * (2 * a["EV"] + 3),
    ),
    # max, subtract, exp, sum, divide (or subtract the log) per element
    "softmax": KernelTraffic(reads=(Access("x_ptr"), *_ROW_CHAIN_READS), writes=(Access("out_ptr"),),
                             flops=lambda a: 5 * a["rows"] * a["cols"] + _row_chain_flops(a)),
    # absent weight/bias pass x, absent statistics pass out, as stand-ins
    "norm": KernelTraffic(
        reads=(Access("x_ptr"), Access("w_ptr", _flag("HAS_W")), Access("b_ptr", _flag("HAS_B")),
               *_ROW_CHAIN_READS),
        writes=(Access("out_ptr"), Access("mean_ptr", _flag("STATS")), Access("rstd_ptr", _flag("STATS"))),
        flops=_norm_flops,
    ),
    # per row: rstd, the scale and the shift (5 ops); per element: x * scale + shift and the chains
    "norm_apply": KernelTraffic(
        reads=(Access("x_ptr"), Access("var_ptr"), Access("mean_ptr"), Access("w_ptr", _flag("HAS_W")),
               Access("b_ptr", _flag("HAS_B")), *_ROW_CHAIN_READS),
        writes=(Access("out_ptr"),),
        flops=lambda a: 5 * a["rows"] + a["rows"] * a["cols"] * (2 + _steps_flops(a, "P") + _steps_flops(a, "E")),
    ),
    # out2 (mean, or the index) only for welford and arg reductions; else out2 is out
    "reduce": KernelTraffic(
        reads=(Access("x_ptr"), *_ROW_CHAIN_READS),
        writes=(Access("out_ptr"), Access("out2_ptr", lambda a: a["COMBINE"] in ("welford", "argmax", "argmin"))),
        flops=_reduce_flops,
    ),
    # out = x * cos + rotate_half(x) * sin: two multiplies and an add per output element (rows x 2 half);
    # with PAIR also kout from kx (krows rows) over the same cos and sin; with ANGLES cos_ptr is the
    # angles (sin_ptr the same tensor) and each half position also takes a cos, a sin and two scalings
    "rotary": KernelTraffic(
        reads=(Access("x_ptr"), Access("cos_ptr"), Access("sin_ptr", lambda a: not a["ANGLES"]),
               Access("kx_ptr", _flag("PAIR")), Access("nw_ptr", _flag("NORM")),
               Access("knw_ptr", lambda a: a["NORM"] and a["PAIR"])),
        writes=(Access("out_ptr"), Access("kout_ptr", _flag("PAIR"))),
        flops=lambda a: (3 * 2 + (4 if a["ANGLES"] else 0)) * (a["rows"] + (a["krows"] if a["PAIR"] else 0)) * a["half"],
    ),
}


# --- launches ---------------------------------------------------------------------------------------
class TrafficError(RuntimeError):
    """A launch the model cannot read: a kernel without a ``TRAFFIC`` row, or arguments that do not
    fit its signature (an internal error at lower time)."""


_SIGNATURES: dict[str, inspect.Signature] = {}


def _signature(kernel: str) -> inspect.Signature:
    if kernel not in _SIGNATURES:
        fn = KERNELS[kernel]
        _SIGNATURES[kernel] = inspect.signature(getattr(fn, "fn", fn))
    return _SIGNATURES[kernel]


def kernel_params(kernel: str) -> list[str]:
    """The parameter names of a registered kernel, in signature order."""
    return list(_signature(kernel).parameters)


def launch_args(launch: Launch) -> Args:
    """The launch's arguments by parameter name (tensor arguments as plan tensor indices), and its grid."""
    if launch.kernel not in TRAFFIC or launch.kernel not in KERNELS:
        raise TrafficError(f"kernel {launch.kernel!r} has no row in kernels/traffic.py TRAFFIC")
    params = kernel_params(launch.kernel)
    if len(launch.args) > len(params):
        raise TrafficError(f"kernel {launch.kernel!r} takes {len(params)} parameters, the launch passes "
                           f"{len(launch.args)}")
    # Parameters a launch leaves out (an optional epilogue's) take their defaults.
    args: Args = {name: p.default for name, p in _signature(launch.kernel).parameters.items()
                  if p.default is not inspect.Parameter.empty}
    # Sizes that depend on a method's symbols count at their upper bounds.
    args.update({name: bound(a.value) for name, a in zip(params, launch.args)})
    args.update({name: a.value for name, a in launch.constexprs.items()})
    args["grid"] = bound(tuple(launch.grid)) + (1,) * (3 - len(launch.grid))
    return args


def launch_access(plan: DelegatePlan, launch: Launch) -> tuple[dict, dict]:
    """({(base, index): bytes read}, {(base, index): bytes written}) of one launch, per buffer."""
    entry = TRAFFIC.get(launch.kernel)
    args = launch_args(launch)
    try:
        return _bytes_by_buffer(plan, args, entry.reads), _bytes_by_buffer(plan, args, entry.writes)
    except (KeyError, IndexError, TypeError) as exc:
        raise TrafficError(f"launch of {launch.kernel!r} ({launch.op}) does not fit its traffic row: {exc!r}") from exc


def launch_flops(launch: Launch) -> int:
    args = launch_args(launch)
    try:
        return int(TRAFFIC[launch.kernel].flops(args))
    except (KeyError, IndexError, TypeError) as exc:
        raise TrafficError(f"launch of {launch.kernel!r} ({launch.op}) does not fit its FLOP formula: {exc!r}") from exc


def annotate(plan: DelegatePlan) -> DelegatePlan:
    """Fill in ``bytes_read``, ``bytes_written`` and ``flops`` of every launch of ``plan`` (in place;
    returns it)."""
    for launch in plan.launches:
        reads, writes = launch_access(plan, launch)
        launch.bytes_read = sum(reads.values())
        launch.bytes_written = sum(writes.values())
        launch.flops = launch_flops(launch)
    return plan


def _bytes_by_buffer(plan: DelegatePlan, args: Args, accesses) -> dict:
    views: dict[tuple[int, int], list] = {}
    for access in accesses:
        if not access.when(args):
            continue
        desc = plan.tensors[args[access.param]]
        if any_symbolic((desc.byte_offset, desc.shape, desc.strides)):
            desc = replace(desc, byte_offset=bound(desc.byte_offset), shape=bound(desc.shape), strides=bound(desc.strides))
        cap = None if access.at_most is None else access.at_most(args)
        views.setdefault((int(desc.base), desc.index), []).append((desc, cap))
    return {key: _buffer_bytes(group) for key, group in views.items()}


# --- the bytes of strided views -----------------------------------------------------------------------
MAX_RUNS = 1 << 20  # contiguous runs enumerated to merge overlapping views; beyond: a bound


def _itemsize(desc: TensorDesc) -> int:
    try:
        return parse_dtype(desc.dtype).itemsize
    except ValueError as exc:
        raise TrafficError(str(exc)) from None


@dataclass(frozen=True)
class _View:
    """A view as byte runs: ``count`` runs of ``run`` bytes each, starting at ``offset`` plus every
    combination of ``outer`` (size, byte stride)."""

    offset: int
    run: int
    outer: tuple[tuple[int, int], ...]
    distinct: int  # distinct bytes
    hull: tuple[int, int]  # [first, last + 1) byte

    @property
    def count(self) -> int:
        return math.prod(n for n, _ in self.outer)

    def starts(self) -> np.ndarray:
        starts = np.array([self.offset], dtype=np.int64)
        for n, s in self.outer:
            starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
        return starts


def _view(desc: TensorDesc) -> _View:
    size = _itemsize(desc)
    if math.prod(desc.shape) == 0:
        return _View(desc.byte_offset, 0, (), 0, (desc.byte_offset, desc.byte_offset))
    # Broadcast (stride 0) and size-1 dims add no bytes; the rest, innermost first.
    dims = sorted((s, n) for n, s in zip(desc.shape, desc.strides) if n > 1 and s != 0)
    span = 1 + sum((n - 1) * s for s, n in dims)  # elements from the first to the last
    hull = (desc.byte_offset, desc.byte_offset + span * size)
    run, rest = 1, list(dims)
    while rest and rest[0][0] == run:  # merge dims that continue a contiguous run
        run *= rest.pop(0)[1]
    outer = tuple((n, s * size) for s, n in reversed(rest))
    extent, disjoint = run, True
    for s, n in rest:  # each dim must step past everything inside it, else elements repeat
        if s < extent:
            disjoint = False
        extent += (n - 1) * s
    view = _View(desc.byte_offset, run * size, outer, 0, hull)
    if disjoint:
        distinct = math.prod(n for _, n in dims) * size
    elif view.count <= MAX_RUNS:
        distinct = _union([view])
    else:
        distinct = span * size  # an overlapping view too large to enumerate: its hull bounds it
    return _View(view.offset, view.run, view.outer, distinct, hull)


def _union(views: list[_View]) -> int:
    """Distinct bytes of the runs of ``views`` together."""
    starts = np.concatenate([v.starts() for v in views])
    ends = starts + np.concatenate([np.full(v.count, v.run, dtype=np.int64) for v in views])
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)  # the furthest byte covered by the runs so far
    before = np.concatenate([[np.iinfo(np.int64).min], reach[:-1]])
    return int(np.clip(ends - np.maximum(starts, before), 0, None).sum())


def _hull_union(views: list[_View]) -> int:
    total, reach = 0, None
    for lo, hi in sorted(v.hull for v in views):
        lo = lo if reach is None else max(lo, reach)
        total += max(0, hi - lo)
        reach = hi if reach is None else max(reach, hi)
    return total


def _buffer_bytes(group: list[tuple[TensorDesc, int | None]]) -> int:
    """Distinct bytes a launch touches in one buffer through ``group`` ((view, at most elements))."""
    exact, indexed = [], 0
    seen = set()
    for desc, cap in group:
        view = _view(desc)
        if cap is not None:
            indexed += min(view.distinct, cap * _itemsize(desc))
        elif view not in seen:
            seen.add(view)
            exact.append(view)
    if len(exact) <= 1:
        merged = exact[0].distinct if exact else 0
    elif _hull_union(exact) == sum(v.hull[1] - v.hull[0] for v in exact):  # apart: nothing to merge
        merged = sum(v.distinct for v in exact)
    elif sum(v.count for v in exact) <= MAX_RUNS:
        merged = _union(exact)
    else:
        merged = min(sum(v.distinct for v in exact), _hull_union(exact))
    everything = [_view(desc) for desc, _ in group]
    return min(merged + indexed, _hull_union(everything)) if indexed else merged


# --- methods ----------------------------------------------------------------------------------------
def method_traffic(method: Method) -> dict:
    """The modelled traffic of one call of ``method`` (its delegates' launches summed) next to its
    lower bound, as plain data: ``bytes_read``, ``bytes_written``, ``bytes``, ``flops``, ``launches``,
    ``lower_bound_read``, ``lower_bound_written``, ``lower_bound``, ``ratio`` (modelled bytes over
    the lower bound; 1.0 when both are 0) and ``intermediates``: the bytes launches write and read of
    values that are neither the method's inputs, constants, state nor results (their delegates' scratch,
    and values one delegate passes to another). Above the bound, what is not an intermediate is a
    bound value read or written more than once."""
    values = method.values
    source: dict[int, int] = {}  # a copy's result -> what it copied
    producer: dict[int, int] = {}  # value -> the delegate instruction that wrote it
    for position, ins in enumerate(method.instructions):
        if ins.kind in (InstrKind.COPY_H2D, InstrKind.COPY_D2H):
            source[ins.outputs[0]] = ins.inputs[0]
        elif ins.kind == InstrKind.DELEGATE:
            for v in ins.outputs:
                producer[v] = position

    def root(v: int) -> int:
        seen = set()
        while v in source and v not in seen:
            seen.add(v)
            v = source[v]
        return v

    totals = {"bytes_read": 0, "bytes_written": 0, "flops": 0, "launches": 0}
    read_of: dict[int, int] = {}  # root value -> bytes the launches read of it
    written_of: dict[int, int] = {}  # value -> bytes the launches wrote into it
    scratch = 0  # bytes the launches read from and wrote into their delegates' scratch
    for ins in method.instructions:
        if ins.kind != InstrKind.DELEGATE:
            continue
        plan = method.delegates[ins.delegate].plan
        for launch in plan.launches:
            totals["bytes_read"] += launch.bytes_read
            totals["bytes_written"] += launch.bytes_written
            totals["flops"] += launch.flops
            totals["launches"] += 1
            try:
                reads, writes = launch_access(plan, launch)
            except TrafficError:  # a kernel this build does not know: its values count in full
                reads = {(int(Base.INPUT), i): values[v].nbytes for i, v in enumerate(ins.inputs)}
                writes = {}
            scratch += sum(n for (base, _), n in (*reads.items(), *writes.items()) if base == Base.SCRATCH)
            for (base, index), n in reads.items():
                if base == Base.INPUT and index < len(ins.inputs):
                    v = root(ins.inputs[index])
                    read_of[v] = read_of.get(v, 0) + n
            for (base, index), n in writes.items():
                if base == Base.INPUT and index < len(ins.inputs):
                    v = root(ins.inputs[index])
                elif base == Base.OUTPUT and index < len(ins.outputs):
                    v = ins.outputs[index]
                else:
                    continue
                written_of[v] = written_of.get(v, 0) + n

    bound_read = sum(min(values[v].nbytes, n) for v, n in read_of.items()
                     if values[v].role in (Role.INPUT, Role.CONSTANT, Role.MUTABLE_BUFFER))
    # Written once: delegate results the method returns or writes back to state, and state that
    # launches update in place.
    results = {root(v) for v in method.outputs} | {root(new) for _, new in method.mutated_buffers}
    results = {v for v in results if v in producer}
    results |= {v for v in written_of if values[v].role == Role.MUTABLE_BUFFER}
    bound_written = sum(min(values[v].nbytes, written_of.get(v, values[v].nbytes)) for v in results)
    modelled = totals["bytes_read"] + totals["bytes_written"]
    bound = bound_read + bound_written
    # values between launches: scratch, and what a delegate passes to another through the method
    passed = sum(n for v, n in read_of.items() if values[v].role == Role.INTERMEDIATE)
    passed += sum(n for v, n in written_of.items() if v not in results and values[v].role == Role.INTERMEDIATE)
    return {
        **totals,
        "bytes": modelled,
        "lower_bound_read": bound_read,
        "lower_bound_written": bound_written,
        "lower_bound": bound,
        "ratio": modelled / bound if bound else 1.0,
        "intermediates": scratch + passed,
    }


def si_units(n: float) -> str:
    """A count with an SI prefix: 950, 1.2 K, 3.6 G."""
    for prefix in ("", " K", " M", " G", " T"):
        if abs(n) < 1000 or prefix == " T":
            return f"{n:.0f}" if not prefix else f"{n:.1f}{prefix}"
        n /= 1000
    return str(n)


def traffic_line(t: dict, size: Callable[[int], str] = str) -> str:
    """One method's :func:`method_traffic` as the line ``summary()`` and ``inspect`` print; ``size``
    formats a byte count."""
    return (f"modelled traffic: {size(t['bytes_read'])} read + {size(t['bytes_written'])} written = "
            f"{size(t['bytes'])} (lower bound {size(t['lower_bound'])}, ratio {t['ratio']:.2f}; "
            f"{size(t['intermediates'])} of values between launches); "
            f"FLOPs {si_units(t['flops'])}")
