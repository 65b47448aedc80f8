"""Weight-only quantization of a model's linears and MoE experts, in the form ``lower()`` keeps
quantized on the device.

    model = td.quantize_linears(model)                           # int8, a scale per output row
    model = td.quantize_linears(model, group_size=64)            # a scale per 64 input columns
    model = td.quantize_linears(model, zero_point=True)          # uint8 with a zero point (asymmetric)
    model = td.quantize_linears(model, bits=4, group_size=32)    # 4 bits, two per byte
    ep = torch.export.export(model, args)                        # then lower as any model

Each ``nn.Linear`` becomes a :class:`QuantizedLinear` whose forward computes its weight from the
integers, ``(q - zero) * scale``, with the op ``tritondelegate::dequant_weight``, and calls
``F.linear``: exported, ``passes/quant_weights.py`` takes that op's parts as they are (no pattern to
match, no value to check), so the program stores the integers (a byte per weight) and the matmul
kernels dequantize them tile by tile. Eager runs the same arithmetic, so the lowered program matches
the quantized model (not the float one: quantization itself changes the weights, by up to half a step
of its group's scale). A model quantized another way, its weight written out as ``q.to(dt) [- zero]
* scale`` (its own modules, or a library's that export to it), is recognized and kept quantized too.

The fused expert weights of transformers' MoE experts modules (``MixtralExperts``, ``Qwen3MoeExperts``,
``GptOssExperts``...: 3-D parameters ``gate_up_proj`` / ``up_proj`` / ``down_proj`` [E, out, in], or
[E, in, out] where the module's ``is_transposed``) are quantized the same way along their reduction
dim, each expert's rows as a linear's: the module keeps its class's forward, as a
:class:`QuantizedExperts` subclass whose properties of those names compute the float weights
(:func:`dequantize_rows`) from its int8 / uint8 buffers on each access.

All compute the weight with :func:`dequantize_rows`, for rows ``*R`` of K columns in ``groups``
groups of G, in the scale's dtype ``dt``::

    w = q.to(dt).view(*R, groups, G)          # 4 bits: ops.unpack_nibbles(q) first
    w = w - zero.unsqueeze(-1)                # with a zero point; 4 bits symmetric: w - 8
    w = (w * scale.unsqueeze(-1)).view(*R, K)
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F

from .ops import dequant_weight, pack_nibbles


def _check_rows(k: int, group_size: int | None, bits: int, what: str) -> None:
    if group_size is not None and (group_size < 1 or k % group_size):
        raise ValueError(f"group_size {group_size} does not divide the {k} input features of {what}")
    if bits not in (4, 8) or (bits == 4 and k % 2):
        raise ValueError(f"bits={bits}: 8, or 4 with an even number of input features (this has {k})")


def quantize_rows(w: torch.Tensor, group_size: int | None = None, zero_point: bool = False, bits: int = 8
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Quantize a weight [*R, K] along its last dim K, per row or per group of ``group_size`` columns:
    ``(q, zero, scale)`` as :class:`QuantizedLinear` stores them, zero and scale [*R, groups] in w's
    dtype (zero None when symmetric), q int8 [*R, K] (symmetric, in [-127, 127]), uint8 [*R, K]
    (``zero_point``, in [0, 255]), or with 4 bits uint8 [*R, K / 2], low nibble first, each in [0, 15]
    (around 8 symmetric, around the zero point otherwise). :func:`dequantize_rows` inverts it, to half a
    step of the group's scale."""
    w = w.detach()
    *rows, k = w.shape
    _check_rows(k, group_size, bits, f"a weight {tuple(w.shape)}")
    groups = 1 if group_size is None else k // group_size
    g = w.float().reshape(*rows, groups, k // groups)
    top = 2 ** bits - 1  # the unsigned range [0, top]
    zero = None
    if zero_point:
        low, high = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
        scale = ((high - low) / top).clamp(min=torch.finfo(torch.float32).tiny)
        zero = torch.round(-low / scale)
        q = torch.clamp(torch.round(g / scale) + zero, 0, top)
        zero = zero[..., 0].to(w.dtype)
    else:
        half = top // 2  # 127 or 7: symmetric around 0 (4 bits: stored around 8)
        scale = (g.abs().amax(-1, keepdim=True) / half).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.clamp(torch.round(g / scale), -half, half) + (8 if bits == 4 else 0)
    q = q.reshape(*rows, k)
    if bits == 4:
        q = pack_nibbles(q.to(torch.uint8))
    q = q.to(torch.uint8 if zero_point or bits == 4 else torch.int8)
    return q, zero, scale[..., 0].to(w.dtype)


def dequantize_rows(q: torch.Tensor, zero: torch.Tensor | None, scale: torch.Tensor, bits: int = 8,
                    k: int | None = None) -> torch.Tensor:
    """The float weight [*R, K] of :func:`quantize_rows`' parts, in the scale's dtype: the op
    ``tritondelegate::dequant_weight`` (``(q - zero) * scale`` per group, each step in that dtype; 4 bits
    symmetric: a zero point of 8), which ``passes/quant_weights.py`` takes as it is. ``k``: K, checked
    (q's last dim, twice it with 4 bits)."""
    width = q.shape[-1] * (2 if bits == 4 else 1)
    if k is not None and k != width:
        raise ValueError(f"dequantize_rows: q {tuple(q.shape)} with bits={bits} holds {width} columns, not {k}")
    symmetric = 8 if zero is None and bits == 4 else 0
    return dequant_weight(q, zero, scale, scale.dtype, scale.dtype, scale.dtype, bits, zero_point=symmetric)


class QuantizedLinear(torch.nn.Module):
    """``nn.Linear`` with its weight as integers and a scale per row, or per group of ``group_size``
    input columns (scale and zero point in the weight's dtype):

    * ``bits=8``: int8 in [-127, 127] (symmetric), or with ``zero_point`` uint8 in [0, 255] around a
      zero point per group;
    * ``bits=4``: two columns per byte of a uint8 ``qweight`` [out, in / 2] (low nibble first), each in
      [0, 15]: around 8 (symmetric, q - 8 in [-8, 7]), or around a zero point per group.

    Buffers ``qweight``, ``scale`` [out, groups] and with a zero point ``zero`` [out, groups]
    (:func:`quantize_rows`)."""

    def __init__(self, linear: torch.nn.Module, group_size: int | None = None, zero_point: bool = False,
                 bits: int = 8):
        super().__init__()
        w = _linear_weight(linear).detach()
        n, k = w.shape
        _check_rows(k, group_size, bits, str(linear))
        q, zero, scale = quantize_rows(w, group_size, zero_point, bits)
        if zero is not None:
            self.register_buffer("zero", zero)
        else:
            self.zero = None
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.bits, self.in_features, self.out_features = bits, k, n

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in], in the scale's dtype, computed on each access (what code
        that reads a linear's ``weight`` for its shape or dtype expects; its forward computes it so)."""
        return dequantize_rows(self.qweight, self.zero, self.scale, self.bits, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        group = self.in_features // self.scale.shape[1]
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.bits} bits, "
                f"group={group}, zero_point={self.zero is not None}")


def _is_linear(module: torch.nn.Module) -> bool:
    """An ``nn.Linear`` that computes a linear: its class's forward is ``nn.Linear``'s (a subclass with a
    forward of its own, Llama 4's router returning scores and indices, is left as it is)."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _is_conv1d(module: torch.nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): ``addmm(bias, x, weight)`` with weight [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear's weight as ``nn.Linear`` holds it, [out, in] (a ``Conv1D``'s transposed)."""
    return module.weight.t() if _is_conv1d(module) else module.weight


# the fused expert weights transformers' MoE integration (integrations/moe.py) reads: [E, out, in], or
# [E, in, out] where the module's ``is_transposed``
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
# experts modules that hold their weights [E, in, out] without declaring ``is_transposed``: Llama 4's,
# which runs every expert on every token through ``bmm``
TRANSPOSED_EXPERTS = ("Llama4TextExperts",)


def _expert_layout(module: torch.nn.Module) -> bool | None:
    """Whether an experts module holds its weights [E, in, out] (``is_transposed``, declared or known
    from its class), or None when it does not say."""
    declared = getattr(module, "is_transposed", None)
    if isinstance(declared, bool):
        return declared
    return True if any(c.__name__ in TRANSPOSED_EXPERTS for c in type(module).__mro__) else None


def _expert_property(name: str) -> property:
    def get(self):
        bits = self._quantized_bits.get(name)
        if bits is None:  # not quantized (kept float, or absent)
            if name in self._parameters:
                return self._parameters[name]
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        w = dequantize_rows(getattr(self, f"{name}_qweight"), getattr(self, f"{name}_zero"),
                            getattr(self, f"{name}_scale"), bits)
        return w.transpose(-2, -1) if _expert_layout(self) else w

    return property(get, doc=f"``{name}``, dequantized on each access from ``{name}_qweight`` & co.")


class QuantizedExperts(torch.nn.Module):
    """A transformers MoE experts module (``MixtralExperts``...) whose fused expert weights are integers,
    in a subclass of its own class (:func:`quantized_experts_class`), so its forward runs unchanged.

    Each quantized weight ``{name}`` of :data:`EXPERT_WEIGHTS` (``gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I]...) is quantized along its reduction dim K, each expert's rows as a
    linear's (:func:`quantize_rows`): buffers ``{name}_qweight`` [E, out, K] (4 bits: K / 2; K last
    even where ``is_transposed`` stores the float weight [E, in, out]), ``{name}_scale`` [E, out, groups]
    and with a zero point ``{name}_zero`` [E, out, groups] (None otherwise). The property ``{name}``
    returns :func:`dequantize_rows` of them (``.transpose(-2, -1)`` where ``is_transposed``), in the
    scale's dtype; biases stay float. ``_quantized_bits``: {name: bits} of the quantized weights."""

    _float_class: type = torch.nn.Module

    gate_up_proj = _expert_property("gate_up_proj")
    up_proj = _expert_property("up_proj")
    down_proj = _expert_property("down_proj")

    def extra_repr(self) -> str:
        parts = [super().extra_repr()]
        for name, bits in self._quantized_bits.items():
            q, scale = getattr(self, f"{name}_qweight"), getattr(self, f"{name}_scale")
            k = q.shape[-1] * (2 if bits == 4 else 1)
            parts.append(f"{name}: {bits} bits [{', '.join(map(str, q.shape[:-1]))}, {k}], "
                         f"group={k // scale.shape[-1]}, zero_point={getattr(self, f'{name}_zero') is not None}")
        return "\n".join(p for p in parts if p)

    def __reduce_ex__(self, protocol):
        # the class is made at run time: pickle (and deepcopy) rebuild it from the float class
        return _new_quantized, (QuantizedExperts, self._float_class), self.__dict__.copy()


_QUANTIZED_CLASSES: dict[tuple[type, type], type] = {}


def _quantized_class(mixin: type, cls: type) -> type:
    """The subclass of ``cls`` with the quantized ``mixin`` first (its weight properties), named
    ``Mixin[cls name]``, one per pair (cached)."""
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _QUANTIZED_CLASSES:
        _QUANTIZED_CLASSES[mixin, cls] = type(f"{mixin.__name__}[{cls.__name__}]", (mixin, cls), {
            "_float_class": cls, "__module__": __name__, "__doc__": mixin.__doc__})
    return _QUANTIZED_CLASSES[mixin, cls]


def _new_quantized(mixin: type, cls: type):
    """An empty instance of :func:`_quantized_class` (how pickle and deepcopy rebuild one)."""
    sub = _quantized_class(mixin, cls)
    return sub.__new__(sub)


def quantized_experts_class(cls: type) -> type:
    """The :class:`QuantizedExperts` subclass of an experts class, ``QuantizedExperts[cls name]``."""
    return _quantized_class(QuantizedExperts, cls)


def _expert_count(module: torch.nn.Module) -> int | None:
    """The expert count of a transformers experts module (None for any other module): one whose layout is
    known (``is_transposed``, as ``use_experts_implementation`` sets it, or :data:`TRANSPOSED_EXPERTS`)
    and that has a ``num_experts`` (or ``num_local_experts``)."""
    if isinstance(module, torch.nn.Linear) or _expert_layout(module) is None:
        return None
    count = getattr(module, "num_experts", getattr(module, "num_local_experts", None))
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _quantize_experts(module: torch.nn.Module, name: str, group_size: int | None, zero_point: bool, bits: int,
                      skip) -> None:
    """Quantize the 3-D expert weights of one experts module (see :class:`QuantizedExperts`), in place."""
    count = _expert_count(module)
    if count is None or any(fnmatch.fnmatch(name, p) for p in skip):
        return
    for weight_name in EXPERT_WEIGHTS:
        w = module._parameters.get(weight_name)
        full = f"{name}.{weight_name}" if name else weight_name
        if w is None or w.dim() != 3 or w.shape[0] != count or any(fnmatch.fnmatch(full, p) for p in skip):
            continue
        w = w.detach().transpose(-2, -1) if _expert_layout(module) else w.detach()  # [E, out, K]
        k = w.shape[-1]
        if (group_size is not None and k % group_size) or (bits == 4 and k % 2):
            continue
        q, zero, scale = quantize_rows(w, group_size, zero_point, bits)
        del module._parameters[weight_name]
        module.register_buffer(f"{weight_name}_qweight", q)
        module.register_buffer(f"{weight_name}_scale", scale)
        module.register_buffer(f"{weight_name}_zero", zero)
        if not isinstance(module, QuantizedExperts):
            module._quantized_bits = {}
            module.__class__ = quantized_experts_class(type(module))
        module._quantized_bits[weight_name] = bits


class QuantizedEmbedding(torch.nn.Module):
    """An ``nn.Embedding`` (or a subclass: Gemma's scaled one) whose table is integers, in a subclass of
    its own class (:func:`quantized_embedding_class`), so its forward runs unchanged: buffers
    ``qweight`` [V, D] (4 bits: D / 2), ``scale`` [V, groups] and with a zero point ``zero``, each row of
    the table quantized as a linear's row (:func:`quantize_rows`); ``weight`` is a property that
    dequantizes them on each access. A tied LM head (a linear whose weight was this table) becomes a
    :class:`QuantizedLinear` over the same buffers, so the program stores the table once."""

    _float_class: type = torch.nn.Module

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_rows(self.qweight, self.zero, self.scale, self.bits, self.embedding_dim)

    def extra_repr(self) -> str:
        group = self.embedding_dim // self.scale.shape[1]
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.bits} bits, group={group}, zero_point={self.zero is not None}"

    def __reduce_ex__(self, protocol):
        return _new_quantized, (QuantizedEmbedding, self._float_class), self.__dict__.copy()


def quantized_embedding_class(cls: type) -> type:
    """The :class:`QuantizedEmbedding` subclass of an embedding class, ``QuantizedEmbedding[cls name]``."""
    return _quantized_class(QuantizedEmbedding, cls)


def _quantize_embedding(module: torch.nn.Embedding, group_size, zero_point: bool, bits: int) -> bool:
    """Quantize an embedding's table in place (:class:`QuantizedEmbedding`); False (left float) where
    ``group_size`` does not divide its dim, the dim is odd at 4 bits, or it renormalizes rows (``max_norm``)."""
    d = module.embedding_dim
    if module.max_norm is not None or (group_size is not None and d % group_size) or (bits == 4 and d % 2):
        return False
    q, zero, scale = quantize_rows(module.weight, group_size, zero_point, bits)
    del module._parameters["weight"]
    module.register_buffer("qweight", q)
    module.register_buffer("scale", scale)
    module.register_buffer("zero", zero)
    module.bits = bits
    module.__class__ = quantized_embedding_class(type(module))
    return True


def _tied(linear: QuantizedLinear, table: QuantizedEmbedding) -> QuantizedLinear:
    """``linear`` (quantized like ``table``) reading ``table``'s buffers themselves: one stored copy."""
    linear.qweight, linear.scale, linear.zero = table.qweight, table.scale, table.zero
    return linear


def _quantize_embeddings(model: torch.nn.Module, group_size, zero_point: bool, bits: int, skip) -> dict:
    """Quantize every embedding of ``model`` (not matching ``skip``); {id of its float table: the module}."""
    tables = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Embedding) and not isinstance(module, QuantizedEmbedding) and not any(
                fnmatch.fnmatch(name, p) for p in skip):
            weight = module.weight
            if _quantize_embedding(module, group_size, zero_point, bits):
                tables[id(weight)] = module
    return tables


def quantize_linears(model: torch.nn.Module, *, group_size: int | None = None, zero_point: bool = False,
                     bits: int = 8, skip=(), embeddings: bool = False) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place; returned; not a subclass with a forward of its
    own), and every transformers ``Conv1D``
    (GPT-2's linears, weight [in, out]), by a :class:`QuantizedLinear`, except those whose qualified
    name matches a pattern of ``skip`` (``fnmatch``, e.g. ``"lm_head"``) and those whose input features
    ``group_size`` does not divide, or (4 bits) are odd (kept float, as are embeddings).

    Also quantizes the fused expert weights of transformers MoE experts modules (a module with an int
    ``num_experts`` or ``num_local_experts`` and a bool ``is_transposed``, as transformers'
    ``use_experts_implementation`` sets it, or of a class in :data:`TRANSPOSED_EXPERTS`: Llama 4's
    experts, [E, in, out], run through ``bmm``): each 3-D parameter of :data:`EXPERT_WEIGHTS` with a first
    dim of the expert count, along its reduction dim, into buffers ``{name}_qweight``, ``{name}_scale``
    and ``{name}_zero`` (:class:`QuantizedExperts`), except where ``skip`` matches the module's name or
    the parameter's (``"model.layers.0.mlp.experts.down_proj"``) and where ``group_size`` does not
    divide K or K is odd (4 bits): those stay float parameters, as do the experts' biases.

    With ``embeddings``, every ``nn.Embedding`` (subclasses too) is quantized as well, each row of its
    table as a linear's row (:class:`QuantizedEmbedding`), and a linear tied to one (an LM head sharing
    the input embeddings' table) reads the same integers: the program then stores the table once, where
    without it a tied LM head is a quantized copy beside the float table."""
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    tables = _quantize_embeddings(model, group_size, zero_point, bits, skip) if embeddings else {}
    for name, module in list(model.named_modules()):
        _quantize_experts(module, name, group_size, zero_point, bits, skip)
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not (_is_linear(child) or _is_conv1d(child)) or any(fnmatch.fnmatch(full, p) for p in skip):
                continue
            k = _linear_weight(child).shape[1]
            if (group_size is not None and k % group_size) or (bits == 4 and k % 2):
                continue
            linear = QuantizedLinear(child, group_size, zero_point, bits)
            table = tables.get(id(child.weight))
            setattr(module, child_name, linear if table is None else _tied(linear, table))
    return model
