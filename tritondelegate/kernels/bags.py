"""``_embedding_bag`` (``nn.EmbeddingBag``, ``F.embedding_bag``): the rows of a table that each bag of
indices names, reduced per bag (sum, mean or max), one launch.

    bag b:   indices[t] for offsets[b] <= t < offsets[b + 1]  (the last bag to the end of indices, or to
             offsets[-1] with include_last_offset)
    sum:     out[b] = sum_t weight[indices[t]] * per_sample_weights[t]   (the weights optional)
    mean:    out[b] = sum_t weight[indices[t]] / (the bag's entries)
    max:     out[b] = max_t weight[indices[t]]

An entry equal to padding_idx (-1: none) is left out, and not counted by mean; so is an index outside
the table (an error in PyTorch). A bag with no entries is 0. A 2-D input (bags of one length, the
common case) arrives as its flat indices and offsets ``arange(0, n, length)``, a constant.

A program reduces BLOCK_D columns of one bag, BLOCK_T entries at a time (a gather of their rows and a
reduction over them), in fp32, rounding once. Only the first result (the bags) is computed: the node
is not claimed when a later node reads the others (offset2bag, bag_size, max_indices; eager's are the
values its backward needs), with that reason in ``summary()``.
"""

from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

from .refs import FLOAT_DTYPES, node_value
from .sizes import next_power_of_2

MODES = {0: "sum", 1: "mean", 2: "max"}
INDEX_DTYPES = (torch.int64, torch.int32)
BLOCK_D = 128  # columns per program at most
BLOCK_T = 16  # entries per step at most


# --- kernel ---------------------------------------------------------------------------------------
@triton.jit
def embedding_bag_kernel(
    out_ptr, w_ptr, idx_ptr, offs_ptr, psw_ptr,
    n_bags, n_indices, n_offsets, num_embeddings, D, padding_idx,
    ws_n, ws_d, is_t, os_o, ps_t, out_b, out_d,
    MODE: tl.constexpr, HAS_PSW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64)  # the grid has n_bags programs on axis 0
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    start = tl.load(offs_ptr + bag * os_o).to(tl.int64)
    end = tl.load(offs_ptr + (bag + 1) * os_o, mask=bag + 1 < n_offsets, other=n_indices).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), n_indices)
    end = tl.minimum(tl.maximum(end, start), n_indices)
    if MODE == "max":
        acc = tl.full([BLOCK_D], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    count = tl.zeros([BLOCK_T], dtype=tl.int32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        idx = tl.load(idx_ptr + t * is_t, mask=t < end, other=-1).to(tl.int64)
        valid = (t < end) & (idx != padding_idx) & (idx >= 0) & (idx < num_embeddings)
        rows = tl.load(w_ptr + idx[:, None] * ws_n + d[None, :] * ws_d, mask=valid[:, None] & d_mask[None, :],
                       other=0).to(tl.float32)
        count += valid.to(tl.int32)
        if MODE == "max":
            acc = tl.maximum(acc, tl.max(tl.where(valid[:, None], rows, float("-inf")), axis=0))
        else:
            if HAS_PSW:
                rows = rows * tl.load(psw_ptr + t * ps_t, mask=valid, other=0).to(tl.float32)[:, None]
            acc += tl.sum(rows, axis=0)
    n = tl.sum(count, axis=0)
    if MODE == "mean":
        acc = acc / tl.maximum(n, 1).to(tl.float32)
    acc = tl.where(n > 0, acc, 0.0)
    tl.store(out_ptr + bag * out_b + d * out_d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


# --- lowering ---------------------------------------------------------------------------------------
def _args(node) -> dict:
    """_embedding_bag's arguments by name, defaults filled in."""
    names = ("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
             "include_last_offset", "padding_idx")
    defaults = (None, None, None, False, 0, False, None, False, -1)
    return {name: node.args[k] if len(node.args) > k else node.kwargs.get(name, default)
            for k, (name, default) in enumerate(zip(names, defaults))}


def embedding_bag(b, node):
    """_embedding_bag / _embedding_bag_forward_only(weight [N, D], indices [T], offsets [B (+1)], ...)
    -> (out [B, D], offset2bag, bag_size, max_indices): ``out`` only (``supported`` says why)."""
    a = _args(node)
    weight, indices, offsets = (b.ref(a[k]) for k in ("weight", "indices", "offsets"))
    psw = b.ref(a["per_sample_weights"]) if a["per_sample_weights"] is not None else None
    out = b.out(node, 0)
    bags, dim = out.shape
    block_d = max(16, min(BLOCK_D, next_power_of_2(dim)))
    block_t = max(2, min(BLOCK_T, next_power_of_2(indices.shape[0])))
    b.launch("embedding_bag", (bags, triton.cdiv(dim, block_d)), out, weight, indices, offsets,
             psw if psw is not None else weight, bags, indices.shape[0], offsets.shape[0], weight.shape[0], dim,
             a["padding_idx"] if a["padding_idx"] is not None else -1, *weight.strides, indices.strides[0],
             offsets.strides[0], psw.strides[0] if psw is not None else 0, *out.strides,
             MODE=MODES[a["mode"]], HAS_PSW=psw is not None, BLOCK_T=block_t, BLOCK_D=block_d)


def supported(node) -> str | None:
    a = _args(node)
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return "offset2bag, bag_size or max_indices is read (only the bags are computed)"
    if a["mode"] not in MODES:
        return f"mode {a['mode']} is not sum (0), mean (1) or max (2)"
    weight, out = node_value(a["weight"]), node.meta.get("val")
    floats = [("weight", weight), ("result", out[0] if isinstance(out, (tuple, list)) else None)]
    if a["per_sample_weights"] is not None:
        floats.append(("per_sample_weights", node_value(a["per_sample_weights"])))
    for name, t in floats:
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            return f"{name} dtype {getattr(t, 'dtype', t)} is not supported"
    for name in ("indices", "offsets"):
        t = node_value(a[name])
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in INDEX_DTYPES:
            return f"{name} is not a 1-D int64 or int32 tensor"
    if weight.dim() != 2:
        return "the table is not 2-D"
    return None
