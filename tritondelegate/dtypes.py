"""Dtype names as programs and launch plans store them (``"float32"``, ``"bfloat16"``): one printer and
one parser, shared by the lowering side and the runtime (this module imports only torch)."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the canonical name, never an alias such as ``"float"``."""
    return str(dtype).removeprefix("torch.")


# Every torch dtype by its canonical name (torch.float, an alias, is listed once, as "float32").
DTYPES: dict[str, torch.dtype] = {dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; raises ``ValueError`` naming ``name`` when it is not the
    canonical name of a torch dtype."""
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r} (expected a torch dtype name such as 'float32')")
    return dtype
