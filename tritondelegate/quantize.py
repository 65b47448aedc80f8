"""Weight-only quantization of a model's linears, in the form ``lower()`` keeps quantized on the device.

    model = td.quantize_linears(model)                           # int8, a scale per output row
    model = td.quantize_linears(model, group_size=64)            # a scale per 64 input columns
    model = td.quantize_linears(model, zero_point=True)          # uint8 with a zero point (asymmetric)
    model = td.quantize_linears(model, bits=4, group_size=32)    # 4 bits, two per byte
    ep = torch.export.export(model, args)                        # then lower as any model

Each ``nn.Linear`` becomes a :class:`QuantizedLinear` whose forward computes its weight from the
integers, ``(q - zero) * scale``, and calls ``F.linear``: exported, that is the pattern
``passes/quant_weights.py`` recognizes, so the program stores the integers (a byte per weight) and
the matmul kernels dequantize them tile by tile. Eager runs the same arithmetic, so the lowered
program matches the quantized model (not the float one: quantization itself changes the weights,
by up to half a step of its group's scale). A model quantized another way in the same form (its own
modules, or a library's that export to it) is kept quantized too.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F

from .ops import pack_nibbles, unpack_nibbles


class QuantizedLinear(torch.nn.Module):
    """``nn.Linear`` with its weight as integers and a scale per row, or per group of ``group_size``
    input columns (scale and zero point in the weight's dtype):

    * ``bits=8``: int8 in [-127, 127] (symmetric), or with ``zero_point`` uint8 in [0, 255] around a
      zero point per group;
    * ``bits=4``: two columns per byte of a uint8 ``qweight`` [out, in / 2] (low nibble first), each in
      [0, 15]: around 8 (symmetric, q - 8 in [-8, 7]), or around a zero point per group."""

    def __init__(self, linear: torch.nn.Module, group_size: int | None = None, zero_point: bool = False,
                 bits: int = 8):
        super().__init__()
        w = _linear_weight(linear).detach()
        n, k = w.shape
        if group_size is not None and (group_size < 1 or k % group_size):
            raise ValueError(f"group_size {group_size} does not divide the {k} input features of {linear}")
        if bits not in (4, 8) or (bits == 4 and k % 2):
            raise ValueError(f"bits={bits}: 8, or 4 with an even number of input features (this has {k})")
        groups = 1 if group_size is None else k // group_size
        g = w.float().reshape(n, groups, k // groups)
        top = 2 ** bits - 1  # the unsigned range [0, top]
        if zero_point:
            low, high = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
            scale = ((high - low) / top).clamp(min=torch.finfo(torch.float32).tiny)
            zero = torch.round(-low / scale)
            q = torch.clamp(torch.round(g / scale) + zero, 0, top)
            self.register_buffer("zero", zero[..., 0].to(w.dtype))
        else:
            half = top // 2  # 127 or 7: symmetric around 0 (4 bits: stored around 8)
            scale = (g.abs().amax(-1, keepdim=True) / half).clamp(min=torch.finfo(torch.float32).tiny)
            q = torch.clamp(torch.round(g / scale), -half, half) + (8 if bits == 4 else 0)
            self.zero = None
        q = q.reshape(n, k)
        if bits == 4:
            q = pack_nibbles(q.to(torch.uint8))
        self.register_buffer("qweight", q.to(torch.uint8 if zero_point or bits == 4 else torch.int8))
        self.register_buffer("scale", scale[..., 0].to(w.dtype))
        self.bias = linear.bias
        self.bits, self.in_features, self.out_features = bits, k, n

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in], in the scale's dtype, computed on each access (what code
        that reads a linear's ``weight`` for its shape or dtype expects; its forward computes it so)."""
        n, k = self.out_features, self.in_features
        q = self.qweight
        if self.bits == 4:
            q = unpack_nibbles(q)
        groups = self.scale.shape[1]
        w = q.to(self.scale.dtype).view(n, groups, k // groups)
        if self.zero is not None:
            w = w - self.zero.unsqueeze(-1)
        elif self.bits == 4:
            w = w - 8
        return (w * self.scale.unsqueeze(-1)).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        group = self.in_features // self.scale.shape[1]
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.bits} bits, "
                f"group={group}, zero_point={self.zero is not None}")


def _is_conv1d(module: torch.nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): ``addmm(bias, x, weight)`` with weight [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear's weight as ``nn.Linear`` holds it, [out, in] (a ``Conv1D``'s transposed)."""
    return module.weight.t() if _is_conv1d(module) else module.weight


def quantize_linears(model: torch.nn.Module, *, group_size: int | None = None, zero_point: bool = False,
                     bits: int = 8, skip=()) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place; returned), and every transformers ``Conv1D``
    (GPT-2's linears, weight [in, out]), by a :class:`QuantizedLinear`, except those whose qualified
    name matches a pattern of ``skip`` (``fnmatch``, e.g. ``"lm_head"``) and those whose input features
    ``group_size`` does not divide, or (4 bits) are odd (kept float, as are embeddings)."""
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not (isinstance(child, torch.nn.Linear) or _is_conv1d(child)) or any(fnmatch.fnmatch(full, p) for p in skip):
                continue
            k = _linear_weight(child).shape[1]
            if (group_size is not None and k % group_size) or (bits == 4 and k % 2):
                continue
            setattr(module, child_name, QuantizedLinear(child, group_size, zero_point, bits))
    return model
