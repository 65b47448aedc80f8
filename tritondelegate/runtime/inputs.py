"""A method's call boundary: the caller's inputs checked against the method (count, structure, dtype,
shape, range of each dynamic dimension, device), the method's symbols bound from them, and the
structure its outputs are returned in."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ..dtypes import dtype_name, parse_dtype
from ..program import Method
from ..errors import ProgramError
from ..symbolic import resolve
from .memory import parse_program_device

RETURN_TYPES = "torch.return_types."  # a tuple node with this context prefix: a torch named tuple (emit.py)


class InputError(ValueError):
    """A call's inputs do not match the method (names the input)."""


def output_structure(text: str, name: str) -> pytree.TreeSpec:
    """The method's output pytree spec. A tuple node whose context names a ``torch.return_types``
    class (what ``torch.max(x, 1)`` returns, which pytree cannot serialize) becomes that class again."""
    def rebuild(spec):
        if spec.is_leaf():
            return spec
        children = [rebuild(c) for c in spec.children()]
        context = spec.context
        if spec.type is tuple and isinstance(context, str):
            cls = getattr(torch.return_types, context.removeprefix(RETURN_TYPES), None)
            if not context.startswith(RETURN_TYPES) or cls not in torch.return_types.all_return_types:
                raise ProgramError(f"method {name!r}: output structure names an unknown type {context!r}")
            return pytree.TreeSpec(cls, None, children)
        return pytree.TreeSpec(spec.type, context, children)

    return rebuild(pytree.treespec_loads(text))


class InputChecker:
    """``check(args, kwargs)``: the call's input tensors, checked, and the values of the method's
    symbols. ``allocators`` maps each device of the method to its (allocator, index)."""

    def __init__(self, method: Method, allocators: dict):
        self.method = method
        self._allocators = allocators
        self._in_spec = pytree.treespec_loads(method.input_spec)

    def check(self, args, kwargs) -> tuple[list, tuple]:
        method = self.method
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise InputError(
                f"method {method.name!r} takes {len(method.inputs)} tensor input(s) structured as the "
                f"exported example inputs ({self._expected()}); got {len(flat)} leaf value(s) with another "
                f"structure ({len(args)} positional, keywords {sorted(kwargs) or 'none'})"
            )
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{self._where(i)} must be a tensor, got {type(t).__name__}")
        key = self._bind_symbols(flat)
        env = {s.name: v for s, v in zip(method.symbols, key)}
        for i, (vid, t) in enumerate(zip(method.inputs, flat)):
            self._check_input(i, method.values[vid], t, env)
        return flat, key

    def _check_input(self, i: int, value, t: torch.Tensor, env: dict) -> None:
        where = self._where(i)
        shape = resolve(tuple(value.shape), env) if env else tuple(value.shape)
        if tuple(t.shape) != shape:
            raise InputError(f"{where} must have shape {list(shape)}{_shape_note(value)}, got {list(t.shape)}")
        if t.dtype != parse_dtype(value.dtype):
            raise InputError(f"{where} must have dtype {value.dtype}, got {dtype_name(t.dtype)}")
        if value.device == "cpu" or self._allocators[value.device][0].host_memory:
            if t.device.type != "cpu":
                raise InputError(f"{where} must be a CPU tensor, got one on {t.device}")
        else:
            kind, index = parse_program_device(value.device)
            if t.device != torch.device(kind, index):
                raise InputError(f"{where} must be on {value.device} (skip_h2d_for_method_inputs), got {t.device}")
        if value.device != "cpu" and not t.is_contiguous():
            raise InputError(f"{where} is read in place on {value.device} and must be contiguous")

    @property
    def keywords(self) -> tuple[str, ...]:
        """The names of the inputs the method was exported with as keywords (transformers' export recipes
        give ``input_ids=``, ``cache_position=``), in their order; () when all are positional."""
        args_spec, kwargs_spec = self._in_spec.children()
        return tuple(kwargs_spec.context or ()) if kwargs_spec.type is dict else ()

    def _expected(self) -> str:
        positional = self._in_spec.children()[0].num_children
        keywords = ", ".join(self.keywords)
        return f"{positional} positional" + (f", keywords {keywords}" if keywords else "")

    def _where(self, i: int) -> str:
        method = self.method
        return f"input {i} ({method.values[method.inputs[i]].name!r}) of method {method.name!r}"

    def _bind_symbols(self, flat: list) -> tuple:
        """Each symbol's value from the input dimension it is bound to, checked against its range."""
        key = []
        for symbol in self.method.symbols:
            t = flat[symbol.input]
            where = f"{self._where(symbol.input)} dimension {symbol.dim}"
            if t.dim() <= symbol.dim:
                raise InputError(f"{where} is dynamic, but the input has only {t.dim()} dimension(s)")
            n = int(t.shape[symbol.dim])
            if not symbol.min <= n <= symbol.max:
                raise InputError(f"{where} is {n}, outside its range {symbol.min}..{symbol.max} "
                                 f"(the bound it was exported and planned with)")
            key.append(n)
        return tuple(key)


def _shape_note(value) -> str:
    dims = [str(d) for d in value.shape if not isinstance(d, int)]
    return f" (dims {', '.join(dims)} from the dynamic dimensions)" if dims else ""
