"""Weight-only quantized weights stay quantized on the device.

A model quantized weight-only keeps each linear's weight as int8 or uint8 ``q`` with a scale (and
a zero point) per row or per group of G consecutive columns, and computes its float weight on every
call, in its own dtype order:

    W = ((q.to(dt) - zero) * scale).to(dtype)      zero, scale [N, 1] or, by groups, [N, K / G, 1]
                                                   against q.view(N, K / G, G), viewed back to [N, K]

or with 4 bits, q unpacked from a uint8 constant [N, K / 2], each byte's low nibble then its high one
(recognized by value, whatever expression unpacks them: :func:`_packed_source`).

Plain constant folding would compute W once at lower time and store it: twice the bytes in bf16,
four times in fp32, read again by every decode step, which is bound by exactly those bytes. Here:

1. :func:`quantize_weights` (first of the rewrites, so that the weight passes see an ordinary
   constant weight) puts a float constant in place of each such subgraph, its value W bit for bit
   (computed from the parts and checked against the subgraph's own result, once for all methods
   that compute it alike), tagged with its parts: ``placeholder.meta["quantized"]``, a
   :class:`Quantized`. ``tritondelegate::dequant_weight`` (``td.quantize_linears``' modules compute
   their weights with it) gives its parts as they are, with nothing to check.
2. The weight passes (Q/K/V concatenation, gate/up interleaving, rotary row orders) rearrange rows of
   it with ``cat``, ``stack``, ``index_select``, ``slice`` and views; constant folding evaluates those
   on the parts (:func:`evaluate`), and where only kernels that dequantize read a quantized weight
   (``kernels/quant_readers.py``: linears, ``mm``'s B, a grouped GEMM's experts [E, K, N], an
   embedding's lookups), ``fold_constants._dequantize_in_kernels`` stores the parts (q, and the
   per-group zero and scale tables) and puts ``tritondelegate::dequant_weight`` in W's place. Each
   reader loads q and dequantizes its tiles (the matmul and grouped GEMM kernels) or rows
   (``dequant_rows.py``) as it loads them; W is never stored. A tied table serves the lookups and the
   LM head from one copy.

A weight something else reads too (a ``bmm``) keeps its float constant. Anything the
rules do not know (an op on K's axis, a second scale, a mismatch with the subgraph's own values)
leaves the weight to plain folding: never a different result, at worst the bytes of today.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace

import torch
import torch.fx

from .. import ops
from ..kernels.matmul import group_refusal
from ..kernels.quant_readers import weight_readers_refusal
from .rewrite import new_node

aten = torch.ops.aten
prims = torch.ops.prims

QUANTIZED = "quantized"  # the placeholder meta key of a quantized weight's parts
PREFIX = "_quantized_weight"
_CASTS = (aten._to_copy.default, aten.to.dtype, prims.convert_element_type.default)


@dataclass(frozen=True)
class Quantized:
    """A float weight as ``ops.dequant_weight_reference(q, zero, scale, sub_dtype, mul_dtype, dtype)``.

    ``q`` is [*R, K]; ``zero`` and ``scale`` are [*R, T] (T divides K; None when absent). The weight
    is seen as [*R, K], or as [*R, groups, K / groups] while a model scales its groups (``groups``), or
    with K among the rows (``k_at``: transposed or rearranged, the rows in q's order around it; an
    expert's [E, K, N] as a grouped GEMM reads it)."""

    q: torch.Tensor
    zero: torch.Tensor | None
    scale: torch.Tensor | None
    sub_dtype: torch.dtype
    mul_dtype: torch.dtype
    dtype: torch.dtype
    stage: int = 0  # 0: converted; 1: zero subtracted; 2: scaled; 3: cast to its result dtype
    groups: int | None = None
    bits: int = 8  # 4: q is uint8 [*R, K / 2], two columns per byte (``ops.unpack_nibbles``)
    k_at: int | None = None  # K's position in the shape, before row k_at (None: last, the only place for groups)

    @property
    def k(self) -> int:
        return self.q.shape[-1] * (2 if self.bits == 4 else 1)

    @property
    def width(self) -> int:
        """The groups per row of its tables (1 without one)."""
        return next((t.shape[-1] for t in (self.zero, self.scale) if t is not None), 1)

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-1])

    @property
    def k_dims(self) -> int:
        return 1 if self.groups is None else 2

    @property
    def k_pos(self) -> int:
        """K's (first) position in the shape: the row dims before it."""
        return len(self.rows) if self.k_at is None else self.k_at

    @property
    def transposed(self) -> bool:
        """Seen with its last two dims swapped, [*E, K, N]: ``mm``'s B, a grouped GEMM's experts."""
        return self.k_at is not None and self.k_at == len(self.rows) - 1

    @property
    def shape(self) -> tuple[int, ...]:
        k, rows = self.k, self.rows
        if self.k_at is not None:
            return rows[:self.k_at] + (k,) + rows[self.k_at:]
        return rows + ((k,) if self.groups is None else (self.groups, k // self.groups))

    def dequantize(self) -> torch.Tensor:
        w = ops.dequant_weight_reference(self.q, self.zero, self.scale, self.sub_dtype, self.mul_dtype, self.dtype,
                                         self.bits)
        return w.movedim(-1, self.k_at) if self.k_at is not None else w.reshape(self.shape)

    def parts(self, fn) -> "Quantized":
        """``fn`` applied to q and to each table alike (an op on row dims only)."""
        return replace(self, q=fn(self.q), zero=_maybe(fn, self.zero), scale=_maybe(fn, self.scale))


def _maybe(fn, t):
    return None if t is None else fn(t)


# --- the rules: each op on a Quantized value, or None (the value is then plain from there on) --------
def _cast(x, dtype) -> Quantized | None:
    if isinstance(x, _Packed):  # the start, 4 bits: unpacked nibbles converted to a float dtype
        return Quantized(x.p, None, None, dtype, dtype, dtype, bits=4) if dtype in ops.QUANT_FLOATS else None
    if isinstance(x, torch.Tensor):  # the start: an integer constant converted to a float dtype
        if x.dtype in ops.QUANT_DTYPES and x.ndim >= 2 and dtype in ops.QUANT_FLOATS:
            return Quantized(x, None, None, dtype, dtype, dtype)
        return None
    if dtype is None or dtype == x.dtype:
        return x
    if dtype not in ops.QUANT_FLOATS:
        return None
    if x.stage == 0:  # q.to(a).to(b): still exact
        return replace(x, sub_dtype=dtype, mul_dtype=dtype, dtype=dtype)
    if x.stage == 1:
        return replace(x, mul_dtype=dtype, dtype=dtype)
    return replace(x, dtype=dtype, stage=3)


def _table(x: Quantized, operand) -> torch.Tensor | None:
    """A sub or mul operand as a [*R, T] table of x's groups, or None when it varies within a group."""
    if not isinstance(operand, torch.Tensor):
        if isinstance(operand, bool) or not isinstance(operand, (int, float)):
            return None
        operand = torch.tensor(operand, dtype=torch.float32)  # eager's 16-bit ops take a scalar in fp32
    if operand.ndim > len(x.shape) or (operand.ndim and operand.shape[-1] != 1):
        return None
    try:
        full = operand.expand(*x.shape[:-1], 1)
    except RuntimeError:
        return None
    table = full[..., 0]
    return table if x.groups is not None else table.unsqueeze(-1)


def _unify(x: Quantized, table: torch.Tensor) -> tuple[Quantized, torch.Tensor] | None:
    """x and a new table over the same groups: a one-group-per-row table spreads over the other's."""
    have = x.width if x.zero is not None or x.scale is not None else table.shape[-1]
    want = max(have, table.shape[-1])
    if min(have, table.shape[-1]) != 1 and have != table.shape[-1]:
        return None
    spread = lambda t: t.expand(*t.shape[:-1], want).contiguous()  # noqa: E731
    if have != want:
        x = replace(x, zero=_maybe(spread, x.zero), scale=_maybe(spread, x.scale))
    return x, spread(table)


def _arith(x, operand, stage: int) -> Quantized | None:
    if not isinstance(x, Quantized) or x.stage >= stage or (stage == 1 and x.stage != 0) or x.k_at is not None:
        return None
    table = _table(x, operand)
    unified = None if table is None else _unify(x, table)
    if unified is None:
        return None
    x, table = unified
    if isinstance(operand, torch.Tensor) and operand.ndim:  # (a 0-dim tensor promotes as a scalar does)
        result = torch.promote_types(x.dtype, operand.dtype)
    else:
        result = x.dtype
    if result not in ops.QUANT_FLOATS:
        return None
    if stage == 1:  # q.to(a) - zero: q is exact in any float dtype, so the sub runs in the result's
        return replace(x, zero=table, sub_dtype=result, mul_dtype=result, dtype=result, stage=1)
    return replace(x, scale=table, mul_dtype=result, dtype=result, stage=2)


def _reshape(x: Quantized, shape) -> Quantized | None:
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = math.prod(x.shape) // known if known else 0
    k = x.k
    kd = x.k_dims
    if x.k_at is None and len(shape) >= kd and tuple(shape[-kd:]) == x.shape[-kd:]:  # rows only
        rows = shape[:-kd]
        return x.parts(lambda t: t.reshape(*rows, t.shape[-1]))
    if x.groups is None and x.k_at is None and len(shape) >= 2 and tuple(shape[:-2]) == x.rows and shape[-2] * shape[-1] == k:
        tables = [t.shape[-1] for t in (x.zero, x.scale) if t is not None]
        if any(t not in (1, shape[-2]) for t in tables):
            return None
        spread = lambda t: t.expand(*t.shape[:-1], shape[-2]).contiguous()  # noqa: E731
        return replace(x, zero=_maybe(spread, x.zero), scale=_maybe(spread, x.scale), groups=shape[-2])
    if x.groups is not None and tuple(shape[:-1]) == x.rows and shape[-1] == k:
        return replace(x, groups=None)
    return None if x.groups is not None else _reshape_around_k(x, shape)


def _reshape_around_k(x: Quantized, shape: list) -> Quantized | None:
    """A reshape that keeps K a dim of its own (rows before it and after it each reshaped in place),
    K last or not; None when none does."""
    rows = x.rows
    before, after = math.prod(rows[:x.k_pos]), math.prod(rows[x.k_pos:])
    for p in reversed(range(len(shape))):
        if shape[p] == x.k and math.prod(shape[:p]) == before and math.prod(shape[p + 1:]) == after:
            new_rows = shape[:p] + shape[p + 1:]
            moved = x.parts(lambda t: t.reshape(*new_rows, t.shape[-1]))
            return replace(moved, k_at=None if p == len(new_rows) else p)
    return None


def _row_dim(x: Quantized, dim: int, extra: int = 0) -> tuple[int, bool] | None:
    """(the row dim of q that ``dim`` of x's shape is, whether it lies before K), or None when it is
    one of K's; with ``extra`` 1, ``dim`` of a shape one dim longer: where a new row dim goes."""
    n = len(x.shape) + extra
    dim = dim + n if dim < 0 else dim
    k, kd = x.k_pos, x.k_dims
    if not 0 <= dim < n or k < dim < k + kd or (dim == k and not extra):
        return None  # (a new dim after K is only for a K without groups)
    if dim <= k:
        return dim, True
    return (None if x.groups is not None else (dim - kd, False))


def _k_after(x: Quantized, row: tuple[int, bool], change: int) -> int | None:
    """``k_at`` once a row dim is inserted (``change`` 1) or removed (-1) at ``row`` (:func:`_row_dim`)."""
    k = x.k_pos + (change if row[1] else 0)
    return None if k == len(x.rows) + change else k


def _permute(x: Quantized, dims) -> Quantized | None:
    n = len(x.shape)
    dims = [d % n for d in dims]
    if x.groups is not None:
        if dims[len(x.rows):] != list(range(len(x.rows), n)):
            return None
        rows = dims[:len(x.rows)]
        return x.parts(lambda t: t.permute(*rows, len(rows)))
    k = x.k_pos
    at = dims.index(k)
    rows = [d if d < k else d - 1 for d in dims if d != k]
    moved = x.parts(lambda t: t.permute(*rows, len(rows)))
    return replace(moved, k_at=None if at == len(rows) else at)


def _transpose(x: Quantized, a: int, b: int) -> Quantized | None:
    dims = list(range(len(x.shape)))
    a, b = a % len(dims), b % len(dims)
    dims[a], dims[b] = dims[b], dims[a]
    return _permute(x, dims)


def _along_rows(x, dim, fn, extra: int = 0, removes: bool = False) -> Quantized | None:
    """``fn(t, d)`` on each part with ``dim`` a row dim (one more with ``extra``, one fewer with
    ``removes``), else None."""
    if not isinstance(x, Quantized):
        return None
    row = _row_dim(x, dim, extra)
    if row is None:
        return None
    return replace(x.parts(lambda t: fn(t, row[0])), k_at=_k_after(x, row, extra - removes))


def _joined(values, dim, op, extra: int) -> Quantized | None:
    """``cat`` (extra 0) or ``stack`` (extra 1) of Quantized values that differ only in their rows."""
    if not values or not all(isinstance(v, Quantized) for v in values):
        return None
    first = values[0]
    same = lambda v: (v.sub_dtype, v.mul_dtype, v.dtype, v.stage, v.groups, v.zero is None, v.scale is None,  # noqa: E731
                      v.q.dtype, v.bits, v.k_at, v.q.shape[-1],
                      tuple(t.shape[-1] for t in (v.zero, v.scale) if t is not None))
    row = _row_dim(first, dim, extra)
    if row is None or any(same(v) != same(first) for v in values):
        return None
    parts = {name: None if getattr(first, name) is None else op([getattr(v, name) for v in values], row[0])
             for name in ("q", "zero", "scale")}
    return replace(first, k_at=_k_after(first, row, extra), **parts)


def _squeeze(x, dims=None):
    if not isinstance(x, Quantized):
        return None
    n = len(x.shape)
    dims = [d for d in range(n) if x.shape[d] == 1] if dims is None else ([dims] if isinstance(dims, int) else list(dims))
    for d in sorted({d % n for d in dims if x.shape[d] == 1}, reverse=True):  # (a dim not of size 1 stays)
        x = _along_rows(x, d, lambda t, r: t.squeeze(r), removes=True)
        if x is None:
            return None
    return x


_ARITH = (aten.sub.Tensor, aten.mul.Tensor)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.t.default,
          aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
          aten.alias.default, aten.clone.default)
_IDENTITY = (aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default,
             aten.lift_fresh_copy.default)
_RULES = {
    aten.sub.Tensor: lambda x, o, alpha=1: _arith(x, o, 1) if alpha == 1 else None,
    aten.sub.Scalar: lambda x, o, alpha=1: _arith(x, o, 1) if alpha == 1 else None,
    aten.mul.Tensor: lambda x, o: _arith(x, o, 2) if isinstance(x, Quantized) else _arith(o, x, 2),
    aten.mul.Scalar: lambda x, o: _arith(x, o, 2),
    aten.view.default: lambda x, s: _reshape(x, s) if isinstance(x, Quantized) else None,
    aten._unsafe_view.default: lambda x, s: _reshape(x, s) if isinstance(x, Quantized) else None,
    aten.reshape.default: lambda x, s: _reshape(x, s) if isinstance(x, Quantized) else None,
    aten.permute.default: lambda x, d: _permute(x, d) if isinstance(x, Quantized) else None,
    aten.transpose.int: lambda x, a, b: _transpose(x, a, b) if isinstance(x, Quantized) else None,
    aten.t.default: lambda x: _permute(x, [1, 0]) if isinstance(x, Quantized) and len(x.shape) == 2 else None,
    aten.unsqueeze.default: lambda x, d: _along_rows(x, d, torch.unsqueeze, extra=1),
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.cat.default: lambda xs, dim=0: _joined(list(xs), dim, torch.cat, 0),
    aten.stack.default: lambda xs, dim=0: _joined(list(xs), dim, torch.stack, 1),
    aten.index_select.default: lambda x, d, i: _along_rows(x, d, lambda t, r: t.index_select(r, i)),
    aten.select.int: lambda x, d, i: _along_rows(x, d, lambda t, r: t.select(r, i), removes=True),
    aten.slice.Tensor: lambda x, d=0, start=None, end=None, step=1: _along_rows(
        x, d, lambda t, r: aten.slice.Tensor(t, r, start, end, step)),
}


def _dequant_op(q, zero, scale, sub_dtype, mul_dtype, dtype, bits=8, transposed=False, zero_point=0
                ) -> Quantized | None:
    """``tritondelegate::dequant_weight`` (what ``td.quantize_linears``' modules compute): its parts as
    they are (a zero point as a table of it)."""
    if not isinstance(q, torch.Tensor) or any(t is not None and not isinstance(t, torch.Tensor) for t in (zero, scale)):
        return None
    if zero is None and zero_point:
        zero = torch.full((*q.shape[:-1], 1 if scale is None else scale.shape[-1]), float(zero_point))
    x = Quantized(q, zero, scale, sub_dtype, mul_dtype, dtype, stage=3, bits=bits)
    return _transpose(x, -2, -1) if transposed else x


def from_op(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``tritondelegate::dequant_weight`` seen through views: its value is the
    op's by definition, nothing to check."""
    while node.op == "call_function" and (node.target in _VIEWS or node.target in _IDENTITY):
        node = node.args[0]
    return node.op == "call_function" and node.target == ops.dequant_weight


def _cast_rule(node: torch.fx.Node, args, kwargs) -> Quantized | None:
    x = args[0]
    if node.target == prims.convert_element_type.default:
        dtype = args[1]
    elif node.target == aten.to.dtype:
        dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    else:
        if set(kwargs) - {"dtype", "layout", "device", "memory_format", "non_blocking"}:
            return None
        dtype = kwargs.get("dtype")
    return _cast(x, dtype)


def apply(node: torch.fx.Node, args, kwargs) -> Quantized | None:
    """``node``'s value as a Quantized, from its arguments' (some Quantized), or None."""
    if node.target in _CASTS:
        return _cast_rule(node, args, kwargs)
    if node.target == ops.dequant_weight:
        return _dequant_op(*args, **kwargs)
    if not any(isinstance(a, Quantized) for a in _flat(args)):
        return None
    if node.target in _IDENTITY:
        return args[0] if isinstance(args[0], Quantized) and not kwargs.get("memory_format") else None
    if node.target in _ARITH and all(isinstance(a, Quantized) for a in args[:2]):
        # two converted integer tensors (an int8 zero point cast in the graph): the smaller is a table
        small = min((0, 1), key=lambda i: math.prod(args[i].shape))
        args = tuple(a.dequantize() if i == small else a for i, a in enumerate(args))
    rule = _RULES.get(node.target)
    if rule is None:
        return None
    try:
        return rule(*args, **kwargs)
    except (TypeError, RuntimeError, IndexError, ValueError):
        return None


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def evaluate(graph: torch.fx.Graph, constants: dict, foldable: set, values: dict) -> dict:
    """The Quantized value of each foldable node that has one, from the tagged constants
    (``meta["quantized"]``) and integer constants converted to a float dtype; ``values``: every
    foldable node's plain value (what the arguments that are not Quantized take)."""
    quant = {n: n.meta[QUANTIZED] for n in constants if isinstance(n.meta.get(QUANTIZED), Quantized)}
    for node in graph.nodes:
        if node in foldable and node not in constants and node.target is not operator.getitem:
            args, kwargs = torch.fx.map_arg((node.args, node.kwargs),
                                            lambda n: quant[n] if n in quant else values.get(n))
            if node.target in _CASTS and node.args[0] not in constants and node.args[0] not in quant:
                value = _viewed_cast(node, args, kwargs, constants, values)
            else:
                value = apply(node, args, kwargs)
            if value is not None:
                quant[node] = value
    return quant


def _viewed_cast(node: torch.fx.Node, args, kwargs, constants: dict, values: dict) -> Quantized | None:
    """A cast of integers that are not a constant themselves: nibbles unpacked from a uint8 constant
    (:func:`_packed_source`), or views of an integer constant (a group split before the cast,
    ``q.view(N, K / G, G).to(dt)``), replayed on the Quantized the constant's cast gives."""
    packed = _packed_source(node.args[0], args[0], constants)
    if packed is not None:
        return apply(node, (packed, *args[1:]), kwargs)
    chain, source = [], node.args[0]
    while isinstance(source, torch.fx.Node) and source not in constants:
        if source.op != "call_function" or source.target not in _VIEWS:
            return None
        chain.append(source)
        source = source.args[0]
    if not chain:
        return None
    value = apply(node, (constants[source], *args[1:]), kwargs)
    for view in reversed(chain):
        if value is None:
            return None
        view_args, view_kwargs = torch.fx.map_arg((view.args[1:], view.kwargs), lambda n: values.get(n))
        value = apply(view, (value, *view_args), view_kwargs)
    return value


def _packed_source(node: torch.fx.Node, value, constants: dict):
    """A Quantized stand-in (4 bits, not yet converted) when ``value``, an integer tensor computed from
    constants, holds the nibbles of a uint8 constant, low nibble first (``ops.unpack_nibbles``)."""
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dtype == torch.bool or value.ndim < 2:
        return None
    if value.shape[-1] % 2 or value.numel() == 0 or value.min() < 0 or value.max() > 15:
        return None
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        p = constants.get(n)
        if (p is not None and p.dtype == torch.uint8 and p.shape[:-1] == value.shape[:-1]
                and 2 * p.shape[-1] == value.shape[-1] and torch.equal(ops.unpack_nibbles(p), value.to(torch.uint8))):
            return _Packed(p)
        stack.extend(n.all_input_nodes)
    return None


@dataclass(frozen=True)
class _Packed:
    """A uint8 constant's nibbles, unpacked by the subgraph: what a cast to a float dtype quantizes."""

    p: torch.Tensor


def exact(value: Quantized | None, plain) -> bool:
    """Whether ``value`` is a whole [*R, K] weight equal, bit for bit, to ``plain`` (the subgraph's own)."""
    return (isinstance(value, Quantized) and value.groups is None and value.q.ndim >= 2
            and isinstance(plain, torch.Tensor) and plain.dtype == value.dtype
            and tuple(plain.shape) == value.shape and torch.equal(value.dequantize(), plain))


def narrowed(value: Quantized) -> Quantized:
    """``value`` with 4 bits per weight when its 8-bit q fits in them (a 4-bit scheme that stores one
    value per byte, as torchao's exports do): a uint8 q in [0, 15] as it is, an int8 q in [-8, 7] as
    q + 8 with 8 added to its zero points (a table of 8s without one): (q + 8) - (z + 8) = q - z
    exactly, in fp32 as the kernel subtracts."""
    q = value.q
    if value.bits != 8 or q.shape[-1] % 2 or q.numel() == 0:
        return value
    low, high = int(q.min()), int(q.max())
    if q.dtype == torch.uint8 and high <= 15:
        shift = 0
    elif q.dtype == torch.int8 and low >= -8 and high <= 7:
        shift = 8
    else:
        return value
    packed = ops.pack_nibbles((q.to(torch.int16) + shift).to(torch.uint8))
    zero = value.zero
    if shift:
        base = torch.zeros(*value.rows, value.width) if zero is None else zero.to(torch.float32)
        zero = base + shift
    return replace(value, q=packed, zero=zero, bits=4)


def constant_zero(value: Quantized) -> tuple[Quantized, int]:
    """``value`` without its zero table where every entry is one integer, and that integer (the kernels
    subtract it as a constant, ``QZERO``: a symmetric 4-bit scheme's 8s are neither stored nor read);
    else ``value`` as it is and 0."""
    zero = value.zero
    if zero is None or zero.numel() == 0:
        return value, 0
    first = zero.reshape(-1)[0].item()
    if first != int(first) or not -32768 <= first <= 32768 or not bool((zero == first).all()):
        return value, 0
    return replace(value, zero=None), int(first)


def reads_as_weight(node: torch.fx.Node, value: Quantized) -> bool:
    """Whether ``value`` is ``node``'s whole value (its shape and dtype), with groups the matmul kernel
    walks, and every reader of ``node`` is a supported matmul that reads it as its weight, and only
    there (the ``dequant_weight`` support check's rules: ``matmul.group_refusal``,
    ``quant_readers.weight_readers_refusal``)."""
    val = node.meta.get("val")
    if (value.groups is not None or (value.k_at is not None and not value.transposed)
            or not isinstance(val, torch.Tensor) or tuple(val.shape) != value.shape
            or val.dtype != value.dtype or group_refusal(value.k, value.width)):
        return False
    return weight_readers_refusal(node, value.transposed, len(value.shape)) is None


def tagged(node: torch.fx.Node, value: Quantized) -> torch.fx.Node:
    """``node`` (a new float constant's placeholder) tagged with its quantized parts."""
    node.meta[QUANTIZED] = replace(value, q=value.q.contiguous())
    return node


def dequant_node(graph: torch.fx.Graph, node: torch.fx.Node, value: Quantized, parts, zero: int = 0
                 ) -> torch.fx.Node:
    """``dequant_weight(*parts, ...)`` in ``node``'s place (``parts``: the placeholders of value's q,
    zero and scale, None where absent; ``zero``: its zero point without a table), before its first
    reader."""
    first = next(n for n in graph.nodes if n in node.users)
    with graph.inserting_before(first):
        dq = new_node(graph, ops.dequant_weight,
                      (*parts, value.sub_dtype, value.mul_dtype, value.dtype, value.bits, value.transposed, zero),
                      node.meta["val"], node.meta, f"{node.name}_dequant")
    node.replace_all_uses_with(dq)
    return dq
