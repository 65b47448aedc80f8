"""Host ops: an instruction's ATen (or ``tritondelegate::``) operator resolved from its name, refused
when it is not safe to run from a program file, and run on the CPU with its decoded arguments.

A program file is untrusted input: a host op resolves only to an operator the dispatcher registers
(never an arbitrary attribute), and never to one that touches files or acts on the process.
"""

from __future__ import annotations

import functools
import re

import torch

from ..dtypes import parse_dtype
from ..program import HostArgKind
from ..errors import ProgramError


# The operator namespaces a program's host instructions may name (``lower()`` refuses any other).
HOST_NAMESPACES = ("aten", "tritondelegate")


def resolve_op(target: str):
    """``"aten::add.Tensor"`` -> ``torch.ops.aten.add.Tensor``; ``"tritondelegate::rotary"`` -> the op
    ``tritondelegate/ops.py`` defines (a fused op left on the host, run by its reference implementation)."""
    namespace, _, rest = target.partition("::")
    if namespace == "tritondelegate":
        from .. import ops

        op = ops.OPS.get(target.removesuffix(".default"))
        if op is None:
            raise ProgramError(f"host op {target!r} is not an operator tritondelegate/ops.py defines")
        return op
    if namespace != "aten":  # programs only hold ATen and tritondelegate host ops; refuse anything else
        raise ProgramError(f"host op {target!r} is not an ATen operator")
    name, _, overload = rest.partition(".")
    overload = overload or "default"
    # Only a name the dispatcher registers is looked up: no attribute of anything else is ever reached.
    registered = f"aten::{name}" + ("" if overload == "default" else f".{overload}")
    if not (_IDENTIFIER.fullmatch(name) and _IDENTIFIER.fullmatch(overload)) or registered not in _dispatcher_ops():
        raise ProgramError(f"host op {target!r} is not an operator this PyTorch knows")
    op = getattr(getattr(torch.ops.aten, name, None), overload, None)
    if not isinstance(op, torch._ops.OpOverload):
        raise ProgramError(f"host op {target!r} is not an operator this PyTorch knows")
    refusal = _refusal(op)
    if refusal:
        raise ProgramError(f"host op {target!r} is not allowed in a program: {refusal}")
    return op


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FILE_ARGUMENT = re.compile(r"file|path|dir")  # a str argument with such a name names a file


@functools.lru_cache(maxsize=None)
def _dispatcher_ops() -> frozenset:
    return frozenset(torch._C._dispatch_get_all_op_names())


def _refusal(op: torch._ops.OpOverload) -> str | None:
    """Why an ATen op may not run from a program file, read from its schema: it takes a file name
    (``from_file``), or it returns nothing and writes none of its arguments, so it exists for an effect
    outside its tensors (printing, process-wide settings)."""
    schema = op._schema
    for arg in schema.arguments:
        if "str" in str(arg.type) and _FILE_ARGUMENT.search(arg.name):
            return f"it takes a file name (argument {arg.name!r})"
    if not schema.returns and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "it returns nothing and writes no tensor: it acts on the process, not on tensors"
    return None


_SCALAR_DECODERS = {
    HostArgKind.NONE: lambda v: None,
    HostArgKind.INT: int,
    HostArgKind.FLOAT: float,
    HostArgKind.BOOL: bool,
    HostArgKind.STR: str,
    HostArgKind.INT_LIST: list,
    HostArgKind.FLOAT_LIST: list,
    HostArgKind.BOOL_LIST: list,
    HostArgKind.DTYPE: parse_dtype,
    HostArgKind.DEVICE: torch.device,
    HostArgKind.MEMORY_FORMAT: lambda v: getattr(torch, v),
    HostArgKind.LAYOUT: lambda v: getattr(torch, v),
}


class HostOp:
    """One host-op instruction, resolved once: ``step(env)`` reads its arguments from the method's
    environment of tensors and writes its outputs there."""

    def __init__(self, instr, values):
        self.op = resolve_op(instr.target)
        self.outputs = instr.outputs
        self.dtypes = [parse_dtype(values[vid].dtype) if vid >= 0 else None for vid in instr.outputs]
        self.args, self.kwargs = [], {}
        for arg in instr.args:
            if arg.kind == HostArgKind.TENSOR:
                value = ("t", arg.value)
            elif arg.kind == HostArgKind.TENSOR_LIST:
                value = ("l", list(arg.value))
            else:
                value = ("c", _SCALAR_DECODERS[arg.kind](arg.value))
            if arg.name:
                self.kwargs[arg.name] = value
            else:
                self.args.append(value)

    @staticmethod
    def _get(env, value):
        kind, v = value
        if kind == "t":
            return env[v]
        if kind == "l":
            return [None if i < 0 else env[i] for i in v]
        return v

    def __call__(self, env):
        result = self.op(*[self._get(env, a) for a in self.args],
                         **{k: self._get(env, v) for k, v in self.kwargs.items()})
        results = [result] if len(self.outputs) == 1 else result
        for vid, r, dtype in zip(self.outputs, results, self.dtypes):
            if vid >= 0:  # an ATen kernel that disagrees with its own meta function (fp16 batch norm's
                # running statistics): the program's declared dtype, what every later step expects
                env[vid] = r.to(dtype) if dtype is not None and r.dtype != dtype else r
