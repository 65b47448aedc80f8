"""Runs a delegate's launch plan on views of its input, output and scratch memory.

Views of the scratch block are built once; views of inputs and outputs are rebuilt only when the
tensors bound to them change (method-planned values keep their arena address from call to call).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math

import torch
import triton.language as tl

from ..dtypes import parse_dtype
from ..kernels.table import KERNELS
from ..plan import Base, DelegatePlan, KernelArgKind, TensorDesc
from ..errors import ProgramError
from ..symbolic import bound
from .direct import LAUNCH_OPTIONS, direct_launch
from .interpreter import interpreted_kernel, interpreter_library



class DelegateError(ProgramError):
    """A launch plan that this runtime cannot run as written (unknown kernel or dtype, a view outside
    its memory, arguments that do not fit the kernel)."""


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _view(base_bytes: torch.Tensor, desc: TensorDesc) -> torch.Tensor:
    dtype = parse_dtype(desc.dtype)
    itemsize = dtype.itemsize
    extent = 1 + sum((n - 1) * s for n, s in zip(desc.shape, desc.strides)) if math.prod(desc.shape) else 0
    end = desc.byte_offset + extent * itemsize
    if desc.byte_offset % itemsize or end > base_bytes.numel():
        raise DelegateError(
            f"tensor view [{desc.byte_offset}, {end}) of dtype {desc.dtype} does not fit its "
            f"{base_bytes.numel()}-byte base"
        )
    typed = base_bytes[desc.byte_offset : desc.byte_offset + max(extent, 1) * itemsize]
    if typed.numel() < itemsize:  # an empty tensor at the very end of its base
        typed = torch.empty(itemsize, dtype=torch.uint8, device=base_bytes.device)
    typed = typed.view(dtype)
    return typed.as_strided(desc.shape, desc.strides, typed.storage_offset())


def _kernel(name: str):
    kernel = KERNELS.get(name)
    if kernel is None:
        raise DelegateError(f"launch plan names kernel {name!r}, which this runtime does not have")
    return kernel


def _is_constexpr(param: inspect.Parameter) -> bool:
    annotation = param.annotation
    return annotation is tl.constexpr or (isinstance(annotation, str) and annotation.endswith("constexpr"))


def _skip(*args, **kwargs) -> None:
    return None


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> tuple[inspect.Signature, list[str]]:
    """A kernel function's signature and its runtime (non-constexpr) parameter names."""
    signature = inspect.signature(fn)
    return signature, [p.name for p in signature.parameters.values() if not _is_constexpr(p)]


def _check_signature(kernel, launch) -> None:
    """The plan's arguments must bind to the kernel's parameters (a damaged file must not reach a
    launch with the wrong arguments). A grid that depends on symbols is checked at its bound."""
    meta = {k: None for k in launch.constexprs if k not in LAUNCH_OPTIONS}
    signature, runtime = _parameters(kernel.fn)
    try:
        if len(launch.args) != len(runtime):  # a default must not stand in for a lost argument
            raise TypeError(f"{len(launch.args)} runtime arguments for the {len(runtime)} parameters "
                            f"{', '.join(runtime)}")
        signature.bind(*launch.args, **meta)
    except TypeError as exc:
        raise DelegateError(
            f"launch of {launch.kernel!r} (node {launch.op!r}) does not fit the kernel's parameters: {exc}"
        ) from exc
    grid = bound(tuple(launch.grid))
    if not all(isinstance(g, int) and g > 0 for g in grid) or not 1 <= len(grid) <= 3:
        raise DelegateError(f"launch of {launch.kernel!r} has grid {launch.grid}")


class DelegateRunner:
    def __init__(self, plan: DelegatePlan, scratch: torch.Tensor | None, simulated: bool, null: bool = False,
                 direct: bool = False):
        """``direct``: after the first call (JIT, compiling), launch the compiled kernels directly
        (``direct.py``); for a real CUDA device."""
        self.plan = plan
        self._direct_wanted = direct
        self._direct: list | None = None
        # Interpreted launches need Triton's library helpers interpreted too (see interpreter_library).
        self.scope = interpreter_library if simulated else contextlib.nullcontext
        if plan.scratch_bytes and (scratch is None or scratch.numel() < plan.scratch_bytes):
            raise DelegateError(f"delegate needs {plan.scratch_bytes} scratch bytes")
        self._kernels = [self._resolve(launch.kernel, simulated) for launch in plan.launches]
        for kernel, launch in zip(self._kernels, plan.launches):
            _check_signature(kernel, launch)
        used = {a.value for launch in plan.launches for a in launch.args if a.kind == KernelArgKind.TENSOR}
        self._views: list[torch.Tensor | None] = [
            _view(scratch, d) if d.base == Base.SCRATCH and i in used else None for i, d in enumerate(plan.tensors)
        ]
        self._bound: dict[tuple[int, int], int] = {}
        self._moving: tuple[list[int], list[int]] | None = None  # see fixed()
        # One prebound record per launch: (launch function, argument list, constexprs). Tensor
        # arguments are filled in when their memory is bound and patched only when it moves.
        self._records: list[tuple] = []
        self._uses: dict[int, list[tuple[list, int]]] = {}  # plan tensor -> (argument list, position)
        for kernel, launch in zip(self._kernels, plan.launches):
            args = [a.value if a.kind != KernelArgKind.TENSOR else self._views[a.value] for a in launch.args]
            for pos, a in enumerate(launch.args):
                if a.kind == KernelArgKind.TENSOR:
                    self._uses.setdefault(a.value, []).append((args, pos))
            constexprs = {} if null else {k: v.value for k, v in launch.constexprs.items()}
            if simulated and "DOT_UPCAST" in constexprs:
                # The Triton interpreter computes low-precision tl.dot wrongly: upcast there.
                constexprs["DOT_UPCAST"] = True
            self._records.append((_skip if null else kernel[launch.grid], args, constexprs))

    @staticmethod
    def _resolve(name: str, simulated: bool):
        """The kernel a launch names; on the simulated device, its interpreted twin (host memory)."""
        kernel = _kernel(name)
        return interpreted_kernel(kernel) if simulated else kernel

    @property
    def launches(self) -> int:
        return len(self.plan.launches)

    def _bind(self, base: Base, tensors: list[torch.Tensor], positions=None) -> None:
        for i in range(len(tensors)) if positions is None else positions:
            t = tensors[i]
            key = (int(base), i)
            if self._bound.get(key) == t.data_ptr() and t.data_ptr() != 0:
                continue
            self._bound[key] = t.data_ptr()
            raw = _as_bytes(t)
            for j, desc in enumerate(self.plan.tensors):
                if desc.base == base and desc.index == i:
                    self._views[j] = view = _view(raw, desc)
                    for args, pos in self._uses.get(j, ()):
                        args[pos] = view

    def fixed(self, inputs: list[bool], outputs: list[bool]) -> None:
        """Declare which inputs/outputs keep their memory for the runner's life (arena and program
        slots): after the first call only the others are checked for a move."""
        self._moving = ([i for i, f in enumerate(inputs) if not f], [i for i, f in enumerate(outputs) if not f])

    def _bind_call(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        moving = self._moving if self._bound else None
        if moving is None:
            self._bind(Base.INPUT, inputs)
            self._bind(Base.OUTPUT, outputs)
            return
        if moving[0]:
            self._bind(Base.INPUT, inputs, moving[0])
        if moving[1]:
            self._bind(Base.OUTPUT, outputs, moving[1])

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        self._bind_call(inputs, outputs)
        if self._direct:
            stream = torch.cuda.current_stream().cuda_stream
            for launch in self._direct:
                launch(stream)
            return
        if self._direct_wanted and self._direct is None:
            with self.scope():
                compiled = [launch(*args, **constexprs) for launch, args, constexprs in self._records]
            self._direct = self._prebind(compiled)
            return
        with self.scope():
            for launch, args, constexprs in self._records:
                launch(*args, **constexprs)

    def _prebind(self, compiled: list) -> list:
        """Direct launches of the kernels the first call compiled; [] (stay on the JIT) if any cannot be."""
        direct = []
        for kernel, launch, (_, args, constexprs), c in zip(self._kernels, self.plan.launches, self._records, compiled):
            record = direct_launch(kernel, c, launch.grid, args, constexprs)
            if record is None:
                return []
            direct.append(record)
        return direct

    def bound_launches(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> list:
        """The launch records with every tensor argument resolved now: what a captured graph replays."""
        self._bind(Base.INPUT, inputs)
        self._bind(Base.OUTPUT, outputs)
        return [(launch, list(args), constexprs) for launch, args, constexprs in self._records]
