"""Which readers keep a weight-only quantized weight (``tritondelegate::dequant_weight``) in their kernels.

A ``dequant_weight`` node has no launch of its own: each reader loads its integers and dequantizes
them tile by tile. So every reader must be a kernel that can: a linear reading it as its weight
[N, K] (``matmul.py``), an embedding looking up its rows [V, D] (``dequant_rows.py``; a tied model's
table and LM head share it), ``mm``/``addmm`` reading it as B [K, N] (transposed), a grouped GEMM of a
Mixture-of-Experts layer reading it as its experts' weights [E, K, N] (transposed, ``grouped_mm.py``), or
``bmm`` reading it as a batch of weights [E, K, N] (transposed: Llama 4's experts run every expert so).
The support check of the op and the lowering pass (``passes/quant_weights.py``) apply these same rules.
"""

from __future__ import annotations

import torch

from .. import ops as td_ops
from . import grouped_mm as gmm
from . import index as idx
from . import matmul as mm
from .refs import node_value

aten = torch.ops.aten

# per weight rank and layout: reader op -> (the argument index of the weight, its support check)
_LINEARS = {aten.linear.default: (1, mm.supported_linear), td_ops.glu_linear: (1, mm.supported_glu),
            td_ops.rope_linear: (1, mm.supported_rope), aten.embedding.default: (0, idx.supported_embedding)}
_MM = {aten.mm.default: (1, mm.supported), aten.addmm.default: (2, mm.supported)}
_GROUPED = {aten._grouped_mm.default: (1, gmm.supported), td_ops.glu_grouped_mm: (1, gmm.supported_glu),
            td_ops.scattered_grouped_mm: (1, gmm.supported_scattered),
            td_ops.gathered_grouped_mm: (3, gmm.supported_gathered)}
_READERS = {(2, False): (_LINEARS, "a linear's weight or an embedding's table"), (2, True): (_MM, "mm's B"),
            (3, True): ({**_GROUPED, aten.bmm.default: (1, mm.supported)},
                        "a grouped GEMM's experts' weight or bmm's B (Llama 4's experts)")}


def _grouped_fallback() -> dict:
    """transformers' ``grouped_mm_fallback``, once the module that registers it is loaded."""
    op = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    return {} if op is None else {op.default: (1, gmm.supported)}


def weight_readers_refusal(node, transposed: bool, rank: int = 2) -> str | None:
    """Why not every reader of ``node`` (a weight of ``rank`` dims, its last two swapped when
    ``transposed``) is a supported kernel that reads it as its weight, and only there (None: they all
    are)."""
    if (rank, transposed) not in _READERS:
        return f"a {rank}-D weight{' transposed' if transposed else ''}: no kernel reads one quantized"
    checks, role = _READERS[(rank, transposed)]
    if rank == 3:
        checks = {**checks, **_grouped_fallback()}
    if not node.users:
        return "nothing reads it"
    for user in node.users:
        slot, check = checks.get(user.target, (None, None)) if user.op == "call_function" else (None, None)
        others = [a for i, a in enumerate(user.args) if i != slot] + list(user.kwargs.values())
        if slot is None or len(user.args) <= slot or user.args[slot] is not node or any(a is node for a in others):
            return f"{user.name} reads it other than as {role}"
        refused = check(user)
        if refused:
            return f"its reader {user.name} stays on the host: {refused}"
    return None


def supported_dequant(node) -> str | None:
    """A dequantized weight stays in its readers' kernels: every reader must read it as its weight
    (:func:`weight_readers_refusal`), with groups the K step can divide (``matmul.group_refusal``), in a
    dtype the kernels round to."""
    q, zero, scale = (node_value(a) for a in node.args[:3])
    bits, transposed = mm.dequant_flags(node)
    if not isinstance(q, torch.Tensor) or q.dim() not in (2, 3) or q.dtype not in td_ops.QUANT_DTYPES:
        return "q must be a 2-D or 3-D (experts) int8 or uint8 tensor"
    if bits not in (4, 8) or (bits == 4 and q.dtype != torch.uint8):
        return f"{bits}-bit {q.dtype} weights: the kernel reads int8 or uint8, or 4 bits packed in uint8"
    k = q.shape[-1] * (2 if bits == 4 else 1)
    for name, t in (("zero", zero), ("scale", scale)):
        if t is None:
            continue
        if t.dim() != q.dim() or t.shape[:-1] != q.shape[:-1] or k % t.shape[-1]:
            return f"{name} {tuple(t.shape)} does not hold whole groups of q's rows {tuple(q.shape)}"
        refused = mm.group_refusal(k, t.shape[-1])
        if refused:
            return refused
    if any(d not in td_ops.QUANT_FLOATS for d in node.args[3:6]):
        return f"dtypes {node.args[3:6]}: the kernel computes in fp16, bf16 or fp32"
    return weight_readers_refusal(node, transposed, q.dim())
