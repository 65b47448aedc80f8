"""Eval-mode batch norm: ``aten._native_batch_norm_legit_no_training`` (what ``nn.BatchNorm{1,2,3}d``
in eval mode exports to), over x of shape (N, C, *spatial), with the running statistics:

    out[n, c, s] = (x[n, c, s] - running_mean[c]) * rsqrt(running_var[c] + eps) * weight[c] + bias[c]

weight and bias are optional (``affine=False``). The op returns (out, save_mean, save_invstd); in eval
mode the last two are empty, and only ``getitem(..., 0)`` is read. The spatial dims are walked as one
strided dim, so a permuted (channels-last) input needs no copy when its spatial dims are contiguous
among themselves.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .refs import collapse, node_value

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def batch_norm_kernel(
    x_ptr, weight_ptr, bias_ptr, mean_ptr, var_ptr, out_ptr,
    numel, C, S, xs_n, xs_c, xs_s, os_n, os_c, os_s, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    s = offs % S
    rest = offs // S
    c = rest % C
    n = rest // C
    x = tl.load(x_ptr + n * xs_n + c * xs_c + s * xs_s, mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + c, mask=mask, other=0.0).to(tl.float32)
    var = tl.load(var_ptr + c, mask=mask, other=1.0).to(tl.float32)
    y = (x - mean) * tl.rsqrt(var + eps)
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + c, mask=mask, other=1.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * os_n + c * os_c + s * os_s, y.to(out_ptr.dtype.element_ty), mask=mask)


# --- host launcher --------------------------------------------------------------------------------
def _as_ncs(b, ref):
    """``ref`` (N, C, *spatial) as (N, C, S) strides, copying only when the spatial dims do not merge."""
    spatial = ref.shape[2:]
    sizes, (strides,) = collapse(spatial, [ref.strides[2:]])
    if len(sizes) > 1:
        ref = b.contiguous(ref)
        sizes, (strides,) = collapse(spatial, [ref.strides[2:]])
    s_stride = strides[0] if sizes else 1
    return ref, (ref.strides[0], ref.strides[1], s_stride)


def launch_batch_norm(b, out, x, weight, bias, mean, var, eps: float) -> None:
    """``out = batch_norm_eval(x)``; per-channel operands are 1-D TRefs (weight/bias may be None)."""
    x, x_strides = _as_ncs(b, x)
    out_ncs = (out.strides[0], out.strides[1], 1)  # out is fresh and contiguous
    n, c = x.shape[:2]
    s = math.prod(x.shape[2:])
    mean, var = b.contiguous(mean), b.contiguous(var)
    weight = b.contiguous(weight) if weight is not None else None
    bias = b.contiguous(bias) if bias is not None else None
    numel = n * c * s
    b.launch(
        "batch_norm", (triton.cdiv(numel, BLOCK),),
        x, weight if weight is not None else mean, bias if bias is not None else mean,  # mean stands in
        mean, var, out,                                                               # for absent ones
        numel, c, s, *x_strides, *out_ncs, float(eps),
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK=BLOCK,
    )


# --- support check and lowering -------------------------------------------------------------------
def supported(node) -> str | None:
    """(input, weight?, bias?, running_mean, running_var, momentum, eps)"""
    x = node_value(node.args[0])
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() < 2:
        return f"batch norm of a rank-{x.dim()} input is not supported (needs (N, C, ...))"
    for name, arg in zip(("input", "weight", "bias", "running_mean", "running_var"), node.args[:5]):
        if arg is None and name in ("weight", "bias"):
            continue
        val = node_value(arg)
        if not isinstance(val, torch.Tensor):
            return f"{name} is not a tensor"
        if val.dtype not in FLOAT_DTYPES:
            return (f"{name} dtype {val.dtype} is not supported "
                    f"(supported: {', '.join(map(str, FLOAT_DTYPES))})")
    return None


def batch_norm_no_training(b, node):
    x, weight, bias, mean, var = node.args[:5]
    eps = node.args[6] if len(node.args) > 6 else node.kwargs.get("eps", 1e-5)
    launch_batch_norm(
        b, b.out(node, 0), b.ref(x),
        b.ref(weight) if weight is not None else None, b.ref(bias) if bias is not None else None,
        b.ref(mean), b.ref(var), eps,
    )
    # save_mean / save_invstd: empty in eval mode; bound so that a getitem of them still lowers.
    b.out(node, 1)
    b.out(node, 2)
