"""Custom ops of tritondelegate: bigger pieces of work that graph rewrites (``passes/fuse.py``) put in
place of a written-out pattern, so one kernel runs them.

    tritondelegate::rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor
        x * cos + rotate_half(x) * sin,   rotate_half(x) = cat((-x[..., h:], x[..., :h]), dim=-1), h = D / 2

Each op has a reference implementation in plain PyTorch (any device; it computes what the pattern it
replaces computes, in the same dtype order, so a host fallback matches eager exactly) and a fake
implementation (FakeTensors, symbolic shapes). The kernel registry imports this module, so the
lowering side and the runtime both have the ops registered; the runtime runs a host instruction of
this namespace only when its op is listed in ``OPS``.
"""

from __future__ import annotations

import torch

NAMESPACE = "tritondelegate"

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")

_lib.define("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` exactly as a model writes it (the same ops, the same order,
    the same type promotion)."""
    return x * cos + rotate_half(x) * sin


@torch.library.impl(_lib, "rotary", "CompositeExplicitAutograd")
def _rotary(x, cos, sin):
    if x.shape[-1] % 2:
        raise ValueError(f"tritondelegate::rotary: the last dim of x ({x.shape[-1]}) is not even")
    return rotary_reference(x, cos, sin)


@torch.library.register_fake(f"{NAMESPACE}::rotary")
def _rotary_fake(x, cos, sin):
    # The formula itself on fake tensors: the result's shape, dtype and strides are the pattern's.
    return rotary_reference(x, cos, sin)


# The ops this module defines, by the name a program file stores for a host op (``OpOverload.name()``).
OPS: dict[str, torch._ops.OpOverload] = {
    "tritondelegate::rotary": torch.ops.tritondelegate.rotary.default,
}

rotary = torch.ops.tritondelegate.rotary.default
