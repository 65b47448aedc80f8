"""The GPU a program's launch configurations are chosen for: its SM count and shared memory.

Tile sizes and pipeline depths are decided when the plan is built (``matmul.choose_config``): a
decode-shaped GEMM is split until every SM has a tile, and the software pipeline holds as many stages
as the shared memory allows. ``LowerConfig.target`` names the GPU: a :class:`Target`, a name from
:data:`TARGETS`, or None for the GPU of the machine that lowers (H100 when it has none).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass


GEMV_MAX_ROWS = 8  # the most rows a GEMV tile holds (matmul.py)


@dataclass(frozen=True)
class Target:
    name: str
    num_sms: int  # streaming multiprocessors: a grid with fewer tiles leaves some idle
    shared_memory: int  # bytes of shared memory one block may use (the opt-in maximum)
    # products of at most this many rows take matmul's GEMV variant (CUDA cores, no tl.dot); 0: none,
    # every product on tl.dot (to compare the two on a GPU)
    gemv_rows: int = GEMV_MAX_ROWS
    # short-query attention may split a long cache's keys over programs (attention.split_keys); False:
    # one pass per row tile (to compare the two on a GPU)
    split_attention: bool = True

    def __post_init__(self):
        if not isinstance(self.gemv_rows, int) or not 0 <= self.gemv_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"target {self.name!r}: gemv_rows must be an int in [0, {GEMV_MAX_ROWS}], "
                             f"got {self.gemv_rows!r}")
        if not isinstance(self.split_attention, bool):
            raise ValueError(f"target {self.name!r}: split_attention must be True or False, got {self.split_attention!r}")
        if not isinstance(self.num_sms, int) or self.num_sms < 1:
            raise ValueError(f"target {self.name!r}: num_sms must be a positive int, got {self.num_sms!r}")
        if not isinstance(self.shared_memory, int) or self.shared_memory < 16 * 1024:
            raise ValueError(f"target {self.name!r}: shared_memory must be at least 16 KiB, got {self.shared_memory!r}")

    @property
    def pipeline_budget(self) -> int:
        """Shared memory a GEMM's software pipeline may fill: 70 %, leaving room for the epilogue's
        layout conversions and the compiler's own buffers (160 KiB on Hopper)."""
        return self.shared_memory * 7 // 10

    def describe(self) -> str:
        gemv = f"GEMV up to {self.gemv_rows} rows" if self.gemv_rows else "no GEMV"
        split = "" if self.split_attention else ", attention never splits its keys"
        return f"{self.name} ({self.num_sms} SMs, {self.shared_memory // 1024} KiB shared memory per block, {gemv}{split})"


KiB = 1024
TARGETS = {
    "h100": Target("h100", 132, 227 * KiB),  # H100 SXM
    "h100-pcie": Target("h100-pcie", 114, 227 * KiB),
    "h200": Target("h200", 132, 227 * KiB),
    "a100": Target("a100", 108, 163 * KiB),
    "l40s": Target("l40s", 142, 99 * KiB),
    "l4": Target("l4", 58, 99 * KiB),
    "rtx4090": Target("rtx4090", 128, 99 * KiB),
}
DEFAULT = TARGETS["h100"]

_CURRENT: contextvars.ContextVar[Target] = contextvars.ContextVar("td_target", default=DEFAULT)


def local() -> Target:
    """The GPU of this machine (CUDA device 0), or :data:`DEFAULT` when it has none."""
    import torch

    if not torch.cuda.is_available():
        return DEFAULT
    props = torch.cuda.get_device_properties(0)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or DEFAULT.shared_memory
    return Target(props.name, props.multi_processor_count, int(shared))


def resolve(target: Target | str | None) -> Target:
    """``LowerConfig.target`` as a :class:`Target`."""
    if target is None:
        return local()
    if isinstance(target, Target):
        return target
    if isinstance(target, str) and target.lower() in TARGETS:
        return TARGETS[target.lower()]
    raise ValueError(f"unknown target {target!r}: pass a Target(name, num_sms, shared_memory) or one of "
                     f"{', '.join(TARGETS)}")


def current() -> Target:
    """The target of the lowering in progress (:func:`using`), else :data:`DEFAULT`."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(target: Target):
    """Choose launch configurations for ``target`` for the duration of the block."""
    token = _CURRENT.set(target)
    try:
        yield target
    finally:
        _CURRENT.reset(token)
