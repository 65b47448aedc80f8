"""A method with bounded dynamic dimensions, made concrete for one set of symbol values.

Every size that depends on the method's symbols is a ``symbolic.Expr`` (value shapes, view shapes,
strides and offsets, grids, size arguments of launches and host ops). :func:`specialize` evaluates
each of them once for a call's symbol values and returns a plain static method over the same memory
plan: arena offsets, segment slots and scratch blocks were planned for the upper bounds and do not
move, so the runtime builds the same prebound launches over narrower views. The loaded method keeps
one specialization per distinct size it has seen (``method.py``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..dtypes import parse_dtype
from ..plan import Arg, DelegatePlan, KernelArgKind, TensorDesc
from ..program import HostArg, HostArgKind, Instruction, Method, TensorValue
from ..symbolic import any_symbolic, resolve


def specialize(method: Method, env: dict[str, int]) -> Method:
    """``method`` with every size evaluated at ``env`` (symbol name -> value); no symbols left."""
    return replace(
        method,
        values=[_value(v, env) for v in method.values],
        instructions=[_instruction(i, env) for i in method.instructions],
        delegates=[replace(d, plan=_plan(d.plan, env)) for d in method.delegates],
        symbols=[],
    )


def _value(value: TensorValue, env) -> TensorValue:
    if not any_symbolic(value.shape):
        return value
    shape = resolve(tuple(value.shape), env)
    return replace(value, shape=shape, nbytes=math.prod(shape) * parse_dtype(value.dtype).itemsize)


def _instruction(instr: Instruction, env) -> Instruction:
    if not any(a.kind in (HostArgKind.SYM_INT, HostArgKind.SYM_INT_LIST) for a in instr.args):
        return instr
    args = [
        HostArg(HostArgKind.INT if a.kind == HostArgKind.SYM_INT else HostArgKind.INT_LIST, resolve(a.value, env),
                a.name)
        if a.kind in (HostArgKind.SYM_INT, HostArgKind.SYM_INT_LIST) else a
        for a in instr.args
    ]
    return replace(instr, args=args)


def _plan(plan: DelegatePlan, env) -> DelegatePlan:
    tensors = [
        TensorDesc(d.base, d.index, resolve(d.byte_offset, env), d.dtype, resolve(tuple(d.shape), env),
                   resolve(tuple(d.strides), env))
        if any_symbolic((d.byte_offset, d.shape, d.strides)) else d
        for d in plan.tensors
    ]
    launches = []
    for launch in plan.launches:
        grid = resolve(tuple(launch.grid), env)
        if any(g <= 0 for g in grid):
            continue  # nothing to do at this size (an empty tensor)
        args = [Arg(KernelArgKind.INT, resolve(a.value, env)) if a.kind == KernelArgKind.INT else a
                for a in launch.args]
        launches.append(replace(launch, grid=grid, args=args))
    return replace(plan, tensors=tensors, launches=launches)  # traffic figures stay the bound's

