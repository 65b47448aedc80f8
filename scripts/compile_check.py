"""Compile every kernel variant that representative models launch, for a GPU target, without a GPU.

    python scripts/compile_check.py [--arch 90] [--case SUBSTRING ...] [--list] [--json PATH]

Each case is exported and lowered with ``tritondelegate.lower`` exactly as a user would; every launch
of every delegate's plan is then specialized the way ``JITFunction.run`` specializes it on a GPU
(argument types, constexprs, the divisibility-by-16 and equal-to-1 attributes of integers and tensor
addresses, launch options) and each distinct variant is compiled down to a cubin with the installed
Triton and its bundled ptxas. The interpreter hides compiler-only failures (an unsupported construct,
a layout the backend cannot lower, too much shared memory); this finds them before a GPU run does.

Reported per variant: failure (the compiler's message), or registers per thread, stack frame per
thread (register spills; libdevice's sin/cos also keep a 32-byte array there) and shared memory. Exit
status 1 when a case fails to lower, or a variant fails to compile or needs more shared memory than the
target has. Compiled kernels land in Triton's cache (``TRITON_CACHE_DIR``), so a second run is quick.
"""

from __future__ import annotations

import os

# Kernels must be real JITFunctions, not interpreted ones: decided when they are defined (imported).
os.environ["TRITON_INTERPRET"] = "0"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch import nn  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import tritondelegate as td  # noqa: E402
from tritondelegate.binaries import concrete_methods, launch_request  # noqa: E402
from tritondelegate.dtypes import dtype_name  # noqa: E402
from tritondelegate.kernels.compile import decode_args, specialize, variant_key  # noqa: E402
from harness import Fn  # noqa: E402  (tests/harness.py: a module around a lambda)
from tritondelegate.kernels.table import KERNELS  # noqa: E402
from tritondelegate.models import MLP, DecoderConfig, LlamaStyleDecoder, demo_decoder, rotate_half  # noqa: E402

# Shared memory one block may use (opt-in maximum), by compute capability.
MAX_SHARED = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
FLOATS = (F32, F16, BF16)


# --- cases ----------------------------------------------------------------------------------------
def _randn(*shape, dtype=F32):
    return torch.randn(*shape).to(dtype)


def _decoder(dtype, seq, **cfg):
    torch.manual_seed(0)
    model = LlamaStyleDecoder(DecoderConfig(**cfg)).eval().to(dtype)
    return model, (torch.randint(0, model.cfg.vocab_size, (1, seq)),)


def _quantized(case, **kwargs):
    """A case's model with its linears weight-only quantized."""
    model, args = case
    return td.quantize_linears(model, **kwargs), args


def _demo(dtype):
    model, args = demo_decoder()
    return model.to(dtype), args


def _resnet(dtype):
    from test_resnet_block import TinyResNet

    torch.manual_seed(0)
    return TinyResNet().eval().to(dtype), (_randn(2, 3, 32, 32, dtype=dtype),)


class ConvNet(nn.Module):
    """ImageNet-sized layers: a 7x7 stride-2 stem, a 3x3 block, a depthwise and a pointwise conv."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn = nn.BatchNorm2d(64)
        self.conv = nn.Conv2d(64, 128, 3, 1, 1)
        self.dw = nn.Conv2d(128, 128, 3, 1, 1, groups=128)
        self.pw = nn.Conv2d(128, 256, 1)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.bn(self.stem(x))), 3, 2, 1)
        x = self.pw(self.dw(torch.relu(self.conv(x))))
        return F.adaptive_avg_pool2d(x, 1).flatten(1), F.avg_pool2d(x, 2), F.adaptive_max_pool2d(x, 3), F.adaptive_avg_pool2d(x, 3)


class UNet3dBlock(nn.Module):
    """A 3-D UNet / video VAE residual block at 32 channels: k3 p1 conv, ReLU (its epilogue), k3 p1 conv
    with the skip connection's add in its epilogue."""

    def __init__(self, channels=32):
        super().__init__()
        self.conv1 = nn.Conv3d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv3d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x))) + x


class Pool3d(nn.Module):
    """3-D pooling of a video model's stem output: max (with indices and without), average, adaptive
    average and adaptive max, and a LocalResponseNorm (an avg_pool3d of window (5, 1, 1))."""

    def __init__(self):
        super().__init__()
        self.lrn = nn.LocalResponseNorm(5)

    def forward(self, x):
        return (F.max_pool3d(x, (1, 3, 3), (1, 2, 2), (0, 1, 1)), F.max_pool3d(x, 3, 2, 1, return_indices=True),
                F.avg_pool3d(x, 2), F.adaptive_avg_pool3d(x, (2, 7, 7)), F.adaptive_max_pool3d(x, (2, 7, 7)),
                self.lrn(x[:, :, 0]))


class SqueezeExciteTail(nn.Module):
    """An EfficientNet-B0 block's tail at 28 x 28 (240 channels): the depthwise conv with its SiLU, the
    squeeze-and-excitation vector, and the 1x1 projection to 40 channels computing ``t * s`` as it reads
    its input (fuse_conv1x1.py: a chain prologue, no depthwise taps)."""

    def __init__(self, c=240, reduced=10, c_out=40):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 5, padding=2, groups=c)
        self.reduce, self.expand = nn.Conv2d(c, reduced, 1), nn.Conv2d(reduced, c, 1)
        self.project = nn.Conv2d(c, c_out, 1, bias=False)

    def forward(self, x):
        t = F.silu(self.dw(x))
        return self.project(t * torch.sigmoid(self.expand(F.silu(self.reduce(t.mean((2, 3), keepdim=True))))))


class _GridSample(nn.Module):
    def forward(self, x, grid):
        return (F.grid_sample(x, grid, align_corners=False),
                F.grid_sample(x, grid, mode="nearest", padding_mode="reflection", align_corners=True))


class UpsamplingNet(nn.Module):
    """Transposed convolutions of decoders: a UNet step (64 -> 32 channels, k2 s2, the ReLU and the skip
    connection's add in its epilogue) and a DCGAN / VAE decoder one (k4 s2 p1) over 64x64."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(64, 32, 2, stride=2)
        self.dcgan = nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1, bias=False)

    def forward(self, x, skip):
        return self.dcgan(torch.relu(self.up(x)) + skip)


def _sdpa(q_shape, kv_shape, dtype, ev=None, mask=None, **kwargs):
    """sdpa over q [.., Lq, E], k/v [.., Lk, E/Ev]; ``mask``: None, "bool" or "float" ([Lq, Lk])."""
    q = _randn(*q_shape, dtype=dtype)
    k = _randn(*kv_shape, dtype=dtype)
    v = _randn(*kv_shape[:-1], ev or kv_shape[-1], dtype=dtype)
    args = (q, k, v)
    if mask is not None:
        m = torch.rand(q_shape[-2], kv_shape[-2]) > 0.3
        args += (m if mask == "bool" else torch.zeros(m.shape).masked_fill(~m, float("-inf")).to(dtype),)
    return Fn(lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3] if len(a) > 3 else None,
                                                        **kwargs)), args


def _reductions(dtype):
    fn = lambda x, y: (  # noqa: E731
        x.sum(-1), x.mean(0), x.amax(-1), x.amin(0), x.argmax(-1), *x.max(1), *torch.var_mean(x, -1),
        x.norm(dim=-1), x.sum(), x.var(), y.prod(1), y.sum((0, 2)), y.permute(2, 0, 1).amax((1, 2)))
    return Fn(fn), (_randn(512, 4096, dtype=dtype), _randn(33, 17, 129, dtype=dtype))


def _int_reductions():
    fn = lambda i: (i.sum(1), i.sum(), (i > 0).sum(0), i.int().sum(-1), i.int().prod(0),  # noqa: E731
                    i.amax(1), i.min(), i.int().amin(0), i.argmax(1), i.int().argmin(0), i.max(1))
    return Fn(fn), (torch.randint(-9, 9, (300, 77)),)


def _int_division():
    """Floor and truncating division, remainder and fmod of integers (an expert's token index), and of
    floats at the dtypes below (_pointwise)."""
    fn = lambda i, j: (i // 3, torch.div(i, j, rounding_mode="trunc"), i % j, torch.fmod(i, 7),  # noqa: E731
                       torch.floor_divide(i.int(), j.int()))
    return Fn(fn), (torch.randint(-99, 99, (129, 257)), torch.randint(1, 9, (129, 257)))


def _int_ranking():
    """sort and topk at the edges the specializer sees: one-element rows (length 1 a constexpr), k = 1,
    bool and int32 keys, a 300-long row across programs, a row along a strided dim."""
    fn = lambda i, one, b: (*torch.sort(one), *torch.topk(i, 1), *torch.sort(b, stable=True),  # noqa: E731
                            *torch.sort(i.int(), dim=0, descending=True), *torch.topk(i.float(), 5, dim=0))
    return Fn(fn), (torch.randint(-9, 9, (300, 77)), torch.randint(0, 9, (5, 1)), torch.rand(4, 33) > 0.5)


def _moe_routing(dtype, tokens: int, experts: int = 128, top: int = 8):
    """A Mixture-of-Experts router as transformers writes it (Qwen3-30B-A3B: 128 experts, 8 per token):
    softmax, top-k, renormalize, the chosen experts sorted (tokens x top ids), their tokens, and the
    rows per expert counted and summed into the grouped GEMM's offsets (kernels/router.py, ranking.py,
    histogram.py); and GPT-OSS's form over 512 experts (the top k logits, then their softmax)."""
    def route(logits, wide):
        weights, chosen = torch.topk(torch.softmax(logits.float(), -1), top)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        order, perm = torch.sort(chosen.reshape(-1))
        counts = torch.histc(order.float(), experts, 0, experts - 1)
        spread = torch.histc(logits, 16)  # and a histogram over the data's own range, in its dtype
        top_logits, picked = torch.topk(wide, 4)
        return (weights.reshape(-1)[perm], perm // top, torch.cumsum(counts, 0, dtype=torch.int32), spread,
                torch.softmax(top_logits, -1, dtype=wide.dtype), picked)

    return Fn(route), (_randn(tokens, experts, dtype=dtype), _randn(tokens, 512, dtype=dtype))


def _sort_offsets():
    """The chosen expert ids' stable order and offsets per expert in one launch (kernels/sort_offsets.py):
    Qwen3-30B-A3B's 128 experts over a 600-token prefill (8 each: ranks over many programs), DeepSeek-V3's
    256 at decode (one program counts every bin), 512 experts from int32 ids of 3 tokens, 4 each."""
    def order(*chosen):
        out = []
        for ids, experts in zip(chosen, (128, 256, 512)):
            ids, perm = torch.sort(ids.reshape(-1))
            out += [ids, perm, torch.cumsum(torch.histc(ids.float(), experts, 0, experts - 1), 0, dtype=torch.int32)]
        return out

    return Fn(order), (torch.randint(0, 128, (600, 8)), torch.randint(0, 256, (1, 8)),
                       torch.randint(0, 512, (3, 4), dtype=torch.int32))


def _group_routing(dtype, tokens: int, experts: int = 256, n_group: int = 8, topk_group: int = 4, top: int = 8):
    """DeepSeek-V3's group-limited router (256 experts in 8 groups, the best 4 groups, 8 experts) on fp32
    sigmoid scores of ``dtype`` logits (kernels/router.py ``group_router``)."""
    bias = torch.randn(experts) * 0.01

    def route(logits):
        scores = logits.float().sigmoid()
        choice = scores + bias
        groups = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        mask = torch.zeros_like(groups).scatter(1, torch.topk(groups, k=topk_group, dim=-1, sorted=False)[1], 1)
        mask = mask.unsqueeze(-1).expand(-1, n_group, experts // n_group).reshape(-1, experts)
        indices = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=top, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * 2.5, indices

    return Fn(route), (_randn(tokens, experts, dtype=dtype),)


def _rows(dtype):
    w = torch.randn(8192).to(dtype)
    fn = lambda x, y, z: (  # noqa: E731
        torch.softmax(x, -1), torch.log_softmax(x, 0), torch.softmax(y, -1), torch.softmax(z, -1),
        F.layer_norm(x, (768,)), F.layer_norm(z, (8192,), w, w), F.rms_norm(y, (17,)),
        F.rms_norm(z, (8192,), w))
    return Fn(fn), (_randn(64, 768, dtype=dtype), _randn(5, 17, dtype=dtype), _randn(16, 8192, dtype=dtype))


def _rows_fused(dtype):
    """Norms and softmaxes with pointwise prologues and epilogues (kernels/fuse_rows.py), one and two passes."""
    w = torch.randn(8192).to(dtype)
    fn = lambda x, p, y, m, z: (  # noqa: E731
        F.layer_norm(x + p, (768,)) * 2.0, torch.softmax(y * 0.125 + m, -1).float(),
        F.rms_norm(z - 1.0, (8192,), w) * w, torch.log_softmax(x + 1.0, 0) * 3.0)
    return Fn(fn), (_randn(64, 768, dtype=dtype), _randn(768, dtype=dtype), _randn(4, 8, 77, 77, dtype=dtype),
                    _randn(77, 77, dtype=dtype), _randn(16, 8192, dtype=dtype))


def _reductions_fused(dtype):
    """Reductions with pointwise prologues and epilogues (kernels/fuse_reduce.py): a Mixture-of-Experts
    tail ``residual + y.view(T, k, H).sum(1)`` over k = 8 expert rows (a middle dim: tall, narrow
    tiles) at prefill and decode; long rows' dot products and squares (prologues); a shifted max down
    the columns, scaled and cast; a scaled dot product per row plus a bias (both)."""
    fn = lambda r, y, r1, y1, a, b, c: (  # noqa: E731
        r + y.view(300, 8, 2048).sum(1), r1 + y1.view(1, 8, 2048).sum(1), (a * b).sum(-1),
        a.float().pow(2).sum(-1), ((a - 1.0).amax(0) * 0.5).float(), (a - b).mean(-1) * 0.125 + c)
    return Fn(fn), (_randn(300, 2048, dtype=dtype), _randn(2400, 2048, dtype=dtype), _randn(1, 2048, dtype=dtype),
                    _randn(8, 2048, dtype=dtype), _randn(64, 4096, dtype=dtype), _randn(64, 4096, dtype=dtype),
                    _randn(64, dtype=dtype))


class _LayerNormMLP(nn.Module):
    """GPT-2's MLP half: layer_norm -> linear + tanh GELU -> linear + residual (norm as a prologue)."""

    def __init__(self, dim=768):
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x)), approximate="tanh"))


def _layer_norm_mlp(dtype, rows):
    return _LayerNormMLP().eval().to(dtype), (_randn(1, rows, 768, dtype=dtype),)


def _softmax_vocab(dtype):
    return Fn(lambda x: torch.softmax(x, -1)), (_randn(4, 32000, dtype=dtype),)


def _indexing(dtype):
    emb = nn.Embedding(8192, 256).to(dtype)
    fn = lambda ids, x, i, j: (  # noqa: E731
        emb(ids), torch.index_select(x, 1, i), torch.gather(x, 1, j), x[i], x[i[:, None], i[None, :4]],
        torch.cumsum(x, 1), torch.cumsum(x.t(), 1), torch.cumsum(ids, 1), torch.cummax(x, 1),
        torch.cummin(x.t(), 1), torch.cummax(ids, 1))
    return Fn(fn), (torch.randint(0, 8192, (4, 300)), _randn(300, 1000, dtype=dtype),
                    torch.randint(0, 300, (40,)), torch.randint(0, 1000, (300, 7)))


def _embedding_epilogue(dtype):
    """GPT-2's ``wte(ids) + wpe`` (a [seq, dim] constant) and Gemma's ``embedding(ids) * normalizer``:
    gathers with a pointwise epilogue (kernels/fuse_gather.py)."""
    emb, pos = nn.Embedding(8192, 768).to(dtype), _randn(300, 768, dtype=dtype)
    fn = lambda ids, tok: (emb(ids) + pos, emb(tok) * 27.7)  # noqa: E731
    return Fn(fn), (torch.randint(0, 8192, (2, 300)), torch.randint(0, 8192, (4, 1)))


class _EmbeddingEpilogue(nn.Module):
    """``_embedding_epilogue``'s lookups with the table a module's (``td.quantize_linears(embeddings=True)``
    quantizes it: ``dequant_rows``, the scale its epilogue; the add stays a launch of its own, its addend
    broadcast over the batch, which the lookup's (row, column) walk cannot address)."""

    def __init__(self, dtype):
        super().__init__()
        self.emb = nn.Embedding(8192, 768).to(dtype)
        self.register_buffer("pos", _randn(300, 768, dtype=dtype))

    def forward(self, ids, tok):
        return self.emb(ids) + self.pos, self.emb(tok) * 27.7


def _shrink_activations(dtype):
    """The shrink and soft activations after a linear (in its epilogue) and a convolution, and alone
    (pointwise launches): softsign, logsigmoid, hardshrink, softshrink, tanhshrink, threshold."""
    acts = [nn.Softsign(), nn.LogSigmoid(), nn.Hardshrink(0.7), nn.Softshrink(0.7), nn.Tanhshrink(),
            nn.Threshold(0.3, -2.0)]
    linears = nn.ModuleList(nn.Linear(256, 512) for _ in acts).to(dtype)
    conv = nn.Conv2d(16, 32, 3, padding=1).to(dtype)
    fn = lambda x, img: (  # noqa: E731  (a linear per x[k]: no projections merged, each act in an epilogue)
        *(act(linear(x[k])) for k, (act, linear) in enumerate(zip(acts, linears))), *(act(x[0]) for act in acts),
        acts[-1](conv(img)))
    return Fn(fn), (_randn(len(acts), 300, 256, dtype=dtype), _randn(2, 16, 32, 32, dtype=dtype))


def _bags_and_distances(dtype):
    """EmbeddingBag (sum with per-sample weights over offsets, mean and max over bags of one length),
    cdist for each p over [2, 300, 64] x [2, 200, 64] and a small one, and Bilinear (two GEMMs)."""
    bags = [nn.EmbeddingBag(8192, 256, mode=mode).to(dtype) for mode in ("sum", "mean", "max")]
    bilinear = nn.Bilinear(64, 48, 32).to(dtype)
    fn = lambda ids, offs, w, flat, a, b, c, d: (  # noqa: E731
        bags[0](ids, offs, per_sample_weights=w), bags[1](flat), bags[2](flat),
        *(torch.cdist(a, b, p=p) for p in (2.0, 1.0, float("inf"), 0.0, 3.0)), torch.cdist(c, d),
        bilinear(c, d[:, :48]))
    return Fn(fn), (torch.randint(0, 8192, (1000,)), torch.arange(0, 1000, 7), _randn(1000, dtype=dtype),
                    torch.randint(0, 8192, (64, 20)), _randn(2, 300, 64, dtype=dtype),
                    _randn(2, 200, 64, dtype=dtype), _randn(5, 64, dtype=dtype), _randn(5, 64, dtype=dtype))


def _scatter(dtype):
    """The scatter family on a KV-cache-shaped tensor: 1 to 3 index tensors, accumulating or not (fp16
    and bf16 accumulate in fp32), tensor and scalar sources."""
    aten = torch.ops.aten
    fn = lambda x, p, i, v, w, idx, src: (  # noqa: E731
        aten.index_put(x, [None, None, p], v), aten.index_put(x, [i, None, p], w, True),
        aten.index_put(x, [i, i, p], w[:, 0]), x.scatter(2, idx, src), x.scatter(2, idx, 0.5),
        x.scatter_add(2, idx, src), x.slice_scatter(v, 2, 100, 107), aten.copy(x, v[:, :, :1]))
    return Fn(fn), (_randn(2, 8, 512, 64, dtype=dtype), torch.randperm(512)[:7], torch.randint(0, 2, (7,)),
                    _randn(2, 8, 7, 64, dtype=dtype), _randn(7, 8, 64, dtype=dtype),
                    torch.randint(0, 512, (2, 8, 33, 64)), _randn(2, 8, 33, 64, dtype=dtype))


def _int_scatter():
    fn = lambda x, p, v, idx: (  # noqa: E731
        torch.ops.aten.index_put(x, [None, p], v, True), x.scatter_add(1, idx, v), x.scatter(1, idx, 7))
    return Fn(fn), (torch.randint(-9, 9, (300, 77)), torch.randint(0, 77, (5,)), torch.randint(-9, 9, (300, 5)),
                    torch.randint(0, 77, (300, 5)))


class KVCache(nn.Module):
    """A decode step's cache update, written in place into the state buffer by the reinplacing pass."""

    def __init__(self, dtype):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 8, 256, 64, dtype=dtype))

    def forward(self, pos, k):
        self.k[:, :, pos] = k
        return self.k[:, :, :1] * 2


class KVCachePair(KVCache):
    """A layer's k and v cache writes at the same positions, paired into one launch (``PAIR``); v comes
    in a projection's [b, s, h, d] layout."""

    def __init__(self, dtype):
        super().__init__(dtype)
        self.register_buffer("v", torch.zeros(1, 8, 256, 64, dtype=dtype))

    def forward(self, pos, k, v):
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v.transpose(1, 2)
        return self.k[:, :, :1] + self.v[:, :, :1]


class KVAppendAttention(nn.Module):
    """A decode step of Llama-3-8B's attention (32 query heads over 8 key/value heads of 128) over a static
    cache of ``keys``: the new k and v rows are written by the attention launch (``attention_append``,
    ``passes/kv_append.py``), split keys and packed heads as the cache's length gives."""

    def __init__(self, dtype, keys: int):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 8, keys, 128, dtype=dtype))
        self.register_buffer("v", torch.zeros(1, 8, keys, 128, dtype=dtype))

    def forward(self, q, k, v, pos):
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        mask = torch.arange(self.k.shape[-2])[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=True)


class WindowCacheAttention(nn.Module):
    """A sliding-window layer over a static cache (8 key/value heads): the new rows written at ``pos``,
    then ``tritondelegate::sdpa_positions`` with a window and a soft-cap or sinks (what
    ``passes/position_mask.py`` makes of Gemma 2's and GPT-OSS's eager attention); one query row per
    call appends its rows in the attention launch."""

    def __init__(self, dtype, heads: int, head_dim: int, keys: int, window: int, softcap: float, sinks: bool):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 8, keys, head_dim, dtype=dtype))
        self.register_buffer("v", torch.zeros(1, 8, keys, head_dim, dtype=dtype))
        self.sinks = nn.Parameter(_randn(heads, dtype=dtype)) if sinks else None
        self.window, self.softcap, self.scale = window, softcap, head_dim ** -0.5

    def forward(self, q, k, v, pos):
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        return torch.ops.tritondelegate.sdpa_positions(q, self.k, self.v, pos[:, None], self.scale, True,
                                                       window=self.window, softcap=self.softcap, sinks=self.sinks)


def _window_attention(dtype, heads: int, head_dim: int, seq: int, keys: int, window: int, softcap: float = 0.0,
                      sinks: bool = False):
    model = WindowCacheAttention(dtype, heads, head_dim, keys, window, softcap, sinks)
    return model, (_randn(1, heads, seq, head_dim, dtype=dtype), _randn(1, 8, seq, head_dim, dtype=dtype),
                   _randn(1, 8, seq, head_dim, dtype=dtype), torch.arange(keys // 3, keys // 3 + seq))


def _kv_append(dtype, keys: int):
    return KVAppendAttention(dtype, keys), (_randn(1, 32, 1, 128, dtype=dtype), _randn(1, 8, 1, 128, dtype=dtype),
                                            _randn(1, 8, 1, 128, dtype=dtype), torch.tensor([keys // 3]))


def _creation(dtype):
    fn = lambda x: (  # noqa: E731
        torch.arange(x.shape[-1]) + 1, torch.arange(0, 5, 0.25, dtype=dtype) * x[0, :20],
        torch.arange(3, 1003, 3, dtype=torch.int32), torch.full((3, 17), float("-inf"), dtype=dtype),
        torch.zeros_like(x), torch.triu(x, 1), torch.tril(x, -2), x.masked_fill(x > 0, -1e4),
        torch.cat([x, x * 2], 1))
    return Fn(fn), (_randn(100, 300, dtype=dtype),)


def _pointwise(dtype):
    fn = lambda x, y, i: (  # noqa: E731
        x + y, x - 2.5, 3 - x, x * y.t().t(), x / y, x ** 2, torch.pow(x.abs(), y), 2 ** x,
        torch.maximum(x, y), torch.minimum(x, y), x == y, x < 0.5, (x > y) & (x < 1), ~(x > 0) | (y > 0),
        -x, torch.exp(x), torch.log(x.abs() + 1), torch.sqrt(x.abs()), torch.rsqrt(x.abs() + 1),
        torch.reciprocal(x + 3), torch.sigmoid(x), F.silu(x), torch.relu(x), torch.tanh(x), torch.cos(x),
        torch.sin(x), F.gelu(x), F.gelu(x, approximate="tanh"), torch.where(x > 0, x, y),
        torch.clamp(x, -1, 1), torch.clamp(x, min=y), x.clamp_max(0.3), x.to(F32), x.to(torch.int32),
        i & 7, i | 8, i * 3 + 1, i.to(dtype), x[:, None, :] + y[None, :, :1].transpose(0, 1),
        F.relu6(x), F.hardtanh(x, -0.5, 0.5), x ** 2.5, torch.pow(x, y), x // y, x % 0.75,
        torch.fmod(x, y), torch.div(x, y, rounding_mode="trunc"))
    return Fn(fn), (_randn(129, 257, dtype=dtype), _randn(129, 257, dtype=dtype),
                    torch.randint(0, 99, (129, 257)))


def _pads(dtype):
    """Every padding mode over 1 to 3 dims, on an activation map and a strided view of it."""
    fn = lambda x, i: (  # noqa: E731
        F.pad(x, (1, 1, 1, 1)), F.pad(x, (0, 1, 0, 1), value=-1.0), F.pad(x, (-1, 2, 3, -2)),
        F.pad(x, (2, 2, 2, 2), mode="reflect"), F.pad(x[0], (3, 3), mode="reflect"),
        F.pad(x, (1, 2, 1, 2, 1, 2), mode="reflect"), F.pad(x, (1, 1, 1, 1), mode="replicate"),
        F.pad(x[0], (2, 1), mode="replicate"), F.pad(x.transpose(2, 3), (1, 2, 0, 1, 1, 0), mode="replicate"),
        F.pad(i, (1, 1, 2, 2), value=7))
    return Fn(fn), (_randn(2, 32, 56, 56, dtype=dtype), torch.randint(0, 99, (3, 100, 100)))


def _resizes(dtype):
    """Every resize mode (kernels/resize.py) at decoder sizes: a UNet / YOLO neck's nearest 2x and an FPN's
    bilinear 2x of a [1, 64, 40, 40] map (one read channels-last), a segmentation head's bilinear to an
    explicit size with corners aligned, nearest-exact and bicubic downsampling, 1-D linear and nearest
    (a vocoder's), a 3-D trilinear and nearest."""
    fn = lambda x, v, a: (  # noqa: E731
        F.interpolate(x, scale_factor=2), F.interpolate(x, scale_factor=2, mode="bilinear"),
        F.interpolate(x.contiguous(memory_format=torch.channels_last), scale_factor=2, mode="bilinear"),
        F.interpolate(x, size=(97, 131), mode="bilinear", align_corners=True),
        F.interpolate(x, scale_factor=0.5, mode="nearest-exact"), F.interpolate(x, scale_factor=1.5, mode="bicubic"),
        F.interpolate(a, scale_factor=3, mode="linear"), F.interpolate(a, scale_factor=2),
        F.interpolate(v, scale_factor=2, mode="trilinear"), F.interpolate(v, size=(5, 24, 24), mode="nearest"))
    return Fn(fn), (_randn(1, 64, 40, 40, dtype=dtype), _randn(1, 8, 6, 12, 12, dtype=dtype),
                    _randn(1, 80, 300, dtype=dtype))


def _matmuls(dtype):
    fn = lambda a, b, c, bias, x, y: (  # noqa: E731
        a @ b, torch.addmm(bias, a, b), torch.bmm(x, y), torch.baddbmm(x[:, :, :64], x, y, alpha=0.5),
        F.linear(c, b.t(), bias), c @ b, a.t().t() @ b[:, :17], x.transpose(1, 2) @ x)
    shapes = [(1000, 768), (768, 1024), (1, 768), (1024,), (8, 333, 64), (8, 64, 64)]
    return Fn(fn), tuple(_randn(*s, dtype=dtype) for s in shapes)


def _grouped_mm(dtype, rows):
    """A Mixture-of-Experts layer's expert products as transformers exports them
    (``transformers::grouped_mm_fallback``, weights a transposed view): gate/up and down of 8 experts,
    ``rows`` = tokens x experts per token, spread unevenly with one expert left without rows. A few
    rows take the per-row variant, more the segment tiles (kernels/grouped_mm.py). gate/up reads its
    rows through the token order (``ROWS``: x[perm // 2], passes/expert_dispatch.py)."""
    importlib.import_module("transformers.integrations.moe")  # registers the op

    op, experts, dim, hidden = torch.ops.transformers.grouped_mm_fallback, 8, 512, 1408
    counts = torch.tensor([rows - rows // 2 - rows // 4, rows // 2, 0, rows // 4, 0, 0, 0, 0])
    perm = torch.randperm(rows)
    fn = lambda x, h, wg, wd, offs: (op(x[perm // 2], wg.transpose(1, 2), offs),  # noqa: E731
                                     op(h, wd.transpose(1, 2), offs))
    return Fn(fn), (_randn(-(-rows // 2), dim, dtype=dtype), _randn(rows, hidden, dtype=dtype),
                    _randn(experts, 2 * hidden, dim, dtype=dtype), _randn(experts, dim, hidden, dtype=dtype),
                    counts.cumsum(0).to(torch.int32))


class _Experts(nn.Module):
    """A Mixture-of-Experts layer's experts as transformers runs them (8 experts, 512 -> 2 x 704 -> 512):
    the (token, slot) pairs sorted by expert, gate/up as one grouped GEMM with SwiGLU in its epilogue
    (passes/fuse_grouped_glu.py) reading the token rows through the expert order with their RMSNorm as
    its prologue (``PROLOGUE="rms"``, kernels/fusion.py), then down storing its
    rows back in token order (``DEST``) with each row's routing weight in its epilogue
    (passes/expert_dispatch.py)."""

    def __init__(self, dtype, experts=8, dim=512, hidden=704):
        super().__init__()
        self.gate_up_proj = nn.Parameter(_randn(experts, 2 * hidden, dim, dtype=dtype))
        self.down_proj = nn.Parameter(_randn(experts, dim, hidden, dtype=dtype))
        self.norm = nn.Parameter(_randn(dim, dtype=dtype))
        self.num_experts, self.is_transposed = experts, False  # as transformers' (td.quantize_linears)

    def forward(self, hidden, keys, offs, weights):
        op = torch.ops.transformers.grouped_mm_fallback
        perm = torch.sort(keys).indices
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, 1e-6)
        gate, up = op(hidden[perm // 2], self.gate_up_proj.transpose(1, 2), offs).chunk(2, dim=-1)
        y = op(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs) * weights[perm][:, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[inv]


def _moe_experts(dtype, rows, **quantize):
    """``_Experts`` over ``rows`` (token, slot) pairs; weight-only quantized with ``quantize``
    (``td.quantize_linears``'s arguments) when given."""
    importlib.import_module("transformers.integrations.moe")  # registers the op
    counts = torch.tensor([rows - rows // 2 - rows // 4, rows // 2, 0, rows // 4, 0, 0, 0, 0])
    keys = torch.repeat_interleave(torch.arange(8), counts)[torch.randperm(rows)]
    model = td.quantize_linears(_Experts(dtype), **quantize) if quantize else _Experts(dtype)
    return model, (_randn(-(-rows // 2), 512, dtype=dtype), keys,
                             counts.cumsum(0).to(torch.int32), _randn(rows, dtype=dtype))


def _llama4_experts(dtype, tokens, **quantize):
    """transformers' ``Llama4TextExperts`` (8 experts, 1024 -> 2 x 2048 -> 1024: every expert runs over
    every token through ``bmm``), weight-only quantized with ``quantize``, over ``tokens`` per expert."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    config = importlib.import_module("transformers").Llama4TextConfig(
        hidden_size=1024, intermediate_size=2048, num_local_experts=8, hidden_act="silu")
    experts = Llama4TextExperts(config).to(dtype).eval()
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.normal_(0, 0.02)
    return td.quantize_linears(experts, **quantize), (_randn(8 * tokens, 1024, dtype=dtype),)


class _GptOssExperts(nn.Module):
    """GPT-OSS's experts (8 experts, 512 -> 2 x 704 -> 512): gate/up and down with a bias per expert read
    in the GEMM (``HAS_BIAS``), GPT-OSS's clamped gating in gate/up's tile (``GLU="clamped_swiglu"``),
    down storing its rows in token order (passes/expert_dispatch.py)."""

    def __init__(self, dtype, experts=8, dim=512, hidden=704):
        super().__init__()
        self.gate_up = nn.Parameter(_randn(experts, dim, 2 * hidden, dtype=dtype))
        self.gate_up_bias = nn.Parameter(_randn(experts, 2 * hidden, dtype=dtype))
        self.down = nn.Parameter(_randn(experts, hidden, dim, dtype=dtype))
        self.down_bias = nn.Parameter(_randn(experts, dim, dtype=dtype))

    def forward(self, hidden, keys, weights):
        op, experts = torch.ops.transformers.grouped_mm_fallback, self.gate_up.shape[0]
        ids, perm = torch.sort(keys)
        offs = torch.cumsum(torch.histc(ids.float(), bins=experts, min=0, max=experts - 1), 0, dtype=torch.int32)
        y = op(hidden[perm // 2], self.gate_up, offs) + self.gate_up_bias[ids]
        gate, up = y[..., ::2].clamp(min=None, max=7.0), y[..., 1::2].clamp(min=-7.0, max=7.0)
        y = op((up + 1) * (gate * torch.sigmoid(gate * 1.702)), self.down, offs) + self.down_bias[ids]
        y = y * weights[perm][:, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[inv]


def _gpt_oss_experts(dtype, rows):
    importlib.import_module("transformers.integrations.moe")  # registers the op
    keys = torch.randint(0, 8, (rows,))
    return _GptOssExperts(dtype), (_randn(-(-rows // 2), 512, dtype=dtype), keys, _randn(rows, dtype=dtype))


def _epilogues(dtype, seq, kv):
    """Decoder-shaped GEMMs (TinyLlama's 2048 -> 5632 MLP, 16 heads of 128) with what fusion folds into
    their epilogues: SiLU(gate) * up, the residual add after down, bias + GELU, attention scores * scale
    + mask, the attention output's transpose back to [batch, seq, heads, head_dim]; and the heaviest
    epilogues there are: bias and four operand tiles, bias and three around a GELU. The attention
    weights are returned too (as ``output_attentions`` does), so that the attention stays written out
    (``passes/eager_attention.py`` leaves it) and its GEMMs keep those epilogues."""
    dim, hidden, heads = 2048, 5632, 16
    head_dim = dim // heads

    def fn(x, res, wg, wu, wd, w1, b1, q, k, v, mask, r):
        h = res + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        g = F.gelu(F.linear(x, w1, b1))
        scores = torch.softmax((q @ k.transpose(-1, -2)) * head_dim ** -0.5 + mask, -1)
        heavy = ((F.linear(x, w1, b1) * r[0] + r[1]) * r[2] - r[3], (F.gelu(F.linear(x, w1, b1) * r[0]) + r[1]) * r[2])
        return h, g, (scores @ v).transpose(1, 2).contiguous(), scores, *heavy

    shapes = [(1, seq, dim), (1, seq, dim), (hidden, dim), (hidden, dim), (dim, hidden), (hidden, dim),
              (hidden,), (1, heads, seq, head_dim), (1, heads, kv, head_dim), (1, heads, kv, head_dim), (seq, kv),
              (4, 1, seq, hidden)]
    return Fn(fn), tuple(_randn(*s, dtype=dtype) for s in shapes)


def _moe_cases(d) -> dict[str, callable]:
    """Mixture-of-Experts layers in dtype ``d``: the grouped GEMMs alone, the experts with SwiGLU in the
    gate/up epilogue, and the router, each at prefill and decode sizes."""
    return {
        "grouped_mm_prefill": lambda: _grouped_mm(d, 600),
        "grouped_mm_decode": lambda: _grouped_mm(d, 2),
        "moe_experts_prefill": lambda: _moe_experts(d, 600),
        "moe_experts_decode": lambda: _moe_experts(d, 2),
        "moe_gpt_oss_prefill": lambda: _gpt_oss_experts(d, 600),
        "moe_gpt_oss_decode": lambda: _gpt_oss_experts(d, 2),
        "moe_routing_prefill": lambda: _moe_routing(d, 600),
        "moe_routing_decode": lambda: _moe_routing(d, 1),
        "moe_group_routing_prefill": lambda: _group_routing(d, 600),
        "moe_group_routing_decode": lambda: _group_routing(d, 1),
    }


def _attention_cases(d) -> dict[str, callable]:
    """The attention cases run in each float dtype ``d``: causal, masked, wide heads, a KV-cache step's
    positions and its rows appended by the attention launch."""
    return {
        "attn_causal": lambda: _sdpa((2, 8, 512, 64), (2, 8, 512, 64), d, is_causal=True),
        "attn_gqa_causal_h128": lambda: _sdpa((1, 32, 300, 128), (1, 8, 300, 128), d, is_causal=True,
                                              enable_gqa=True),
        "attn_bool_mask_h128": lambda: _sdpa((1, 8, 1000, 128), (1, 8, 1000, 128), d, mask="bool"),
        "attn_float_mask_h96": lambda: _sdpa((2, 4, 500, 96), (2, 4, 500, 96), d, mask="float"),
        "attn_float_mask_decode": lambda: _sdpa((4, 16, 1, 128), (4, 16, 777, 128), d, mask="float"),
        "attn_h256": lambda: _sdpa((1, 4, 200, 256), (1, 4, 200, 256), d),
        "attn_h80_ev128": lambda: _sdpa((2, 3, 333, 80), (2, 3, 333, 80), d, ev=128),
        # a KV-cache step's mask from positions (passes/position_mask.py): decode over a 4096-key cache
        # and a 300-token prefill over 1024 keys
        "attn_positions_decode": lambda: _positions_sdpa(d, 1, 4096, 1000),
        "attn_positions_prefill": lambda: _positions_sdpa(d, 300, 1024, 0),
        # the new k/v rows written by the attention launch: a long cache (split keys), a short one (one pass)
        "attn_kv_append_decode": lambda: _kv_append(d, 4096),
        "attn_kv_append_short": lambda: _kv_append(d, 200),
        # sliding-window layers, mask from positions (WINDOW): Gemma-2-9B's soft-capped decode appending its
        # rows over a 4096-key cache (split keys), GPT-OSS-20B's with sinks, and a Gemma 2 prefill
        "attn_window_softcap_decode": lambda: _window_attention(d, 16, 256, 1, 4096, 1024, softcap=50.0),
        "attn_window_sinks_decode": lambda: _window_attention(d, 64, 64, 1, 4096, 128, sinks=True),
        "attn_window_softcap_prefill": lambda: _window_attention(d, 16, 256, 512, 1024, 256, softcap=50.0),
    }


def _per_dtype(d) -> dict[str, callable]:
    """The cases run in each float dtype ``d``."""
    return {**_decoder_cases(d), **_vision_cases(d), **_op_cases(d)}


def _decoder_cases(d) -> dict[str, callable]:
    """Decoder layers at prefill and decode, and MLPs, in dtype ``d``."""
    llama = dict(dim=512, n_layers=1, hidden_dim=1376)
    return {
        "demo_decoder": lambda: _demo(d),
        "decoder_prefill_h64": lambda: _decoder(d, 384, n_heads=8, n_kv_heads=2, max_seq_len=512, **llama),
        "decoder_h128": lambda: _decoder(d, 200, n_heads=4, n_kv_heads=4, max_seq_len=256, **llama),
        "decoder_decode": lambda: _decoder(d, 1, n_heads=8, n_kv_heads=2, max_seq_len=64, **llama),
        # a Llama-3-8B layer at decode (M = 1): the GEMV tiles of qkv (N 6144, rms prologue), o + residual,
        # gate/up (GLU, N 2 x 14336, rms prologue) and down (K 14336) + residual
        "decoder_decode_8b": lambda: _decoder(d, 1, dim=4096, n_layers=1, n_heads=32, n_kv_heads=8,
                                              hidden_dim=14336, max_seq_len=64),
        "decoder_8_tokens": lambda: _decoder(d, 8, n_heads=8, n_kv_heads=2, max_seq_len=64, **llama),  # GEMV, 8 rows
        # weight-only quantized (td.quantize_linears), int8 per row at decode (GEMV): the dequantization's
        # rounding per dtype; the other quantized cases are bf16's (``_quantized_cases``)
        "decoder_decode_int8": lambda: _quantized(_decoder(d, 1, n_heads=8, n_kv_heads=2, max_seq_len=64, **llama)),
        "mlp": lambda: (MLP([784, 1024, 1000]).eval().to(d), (_randn(64, 784, dtype=d),)),
        "mlp_decode": lambda: (MLP([2048, 4096, 2048]).eval().to(d), (_randn(1, 2048, dtype=d),)),
    }


def _vision_cases(d) -> dict[str, callable]:
    """Convolutions (1-D, 2-D, 3-D, transposed, depthwise, pooled), pooling and grid sampling in dtype ``d``."""
    dw7 = nn.Conv2d(96, 96, 7, padding=3, groups=96).eval().to(d)
    return {
        "resnet_tiny": lambda: _resnet(d),
        "convnet": lambda: (ConvNet().eval().to(d), (_randn(2, 3, 224, 224, dtype=d),)),
        # a VGG stage's last conv with its ReLU and 2 x 2 max pooling in one launch (the ConvNet's stem
        # pools 3 x 3 windows of stride 2): 128 -> 256 channels at 112 x 112
        "conv_pool_vgg": lambda: (nn.Sequential(nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
                                                ).eval().to(d), (_randn(1, 128, 112, 112, dtype=d),)),
        # a DenseNet-121 transition (256 -> 128 channels at 56 x 56): its 1x1 conv and 2 x 2 average pooling
        "conv_pool_densenet": lambda: (nn.Sequential(nn.BatchNorm2d(256), nn.ReLU(), nn.Conv2d(256, 128, 1, bias=False),
                                                     nn.AvgPool2d(2)).eval().to(d), (_randn(2, 256, 56, 56, dtype=d),)),
        # Whisper-base's front end: two 1-D convs with GELU epilogues (the second strided) over 3000 frames
        "conv1d_whisper": lambda: (nn.Sequential(nn.Conv1d(80, 512, 3, padding=1), nn.GELU(),
                                                 nn.Conv1d(512, 512, 3, stride=2, padding=1), nn.GELU()).eval().to(d),
                                   (_randn(1, 80, 3000, dtype=d),)),
        # a UNet up-block and a DCGAN layer (32x32 -> 64x64 -> 128x128), and HiFi-GAN's first 1-D upsampling
        # (k16 s8 p4, 512 -> 256 channels)
        "conv_transpose_2d": lambda: (UpsamplingNet().eval().to(d), (_randn(1, 64, 32, 32, dtype=d),
                                                                     _randn(1, 32, 64, 64, dtype=d))),
        "conv_transpose_1d_vocoder": lambda: (nn.ConvTranspose1d(512, 256, 16, 8, 4).eval().to(d),
                                              (_randn(1, 512, 100, dtype=d),)),
        # VideoMAE's tubelet embedding: 16 frames of 224 x 224 into 2 x 16 x 16 patches of 768 channels
        "conv3d_tubelet": lambda: (nn.Conv3d(3, 768, (2, 16, 16), (2, 16, 16)).eval().to(d),
                                   (_randn(1, 3, 16, 224, 224, dtype=d),)),
        "conv3d_unet_block": lambda: (UNet3dBlock().eval().to(d), (_randn(1, 32, 16, 64, 64, dtype=d),)),
        # a diffusion UNet's GroupNorm(32, 320) -> SiLU at 64 x 64 (the statistics, then the apply with
        # the SiLU in its epilogue: group_norm.py), and an instance norm's apply (per-channel statistics)
        "group_norm_silu": lambda: (nn.Sequential(nn.GroupNorm(32, 320), nn.SiLU()).eval().to(d),
                                    (_randn(1, 320, 64, 64, dtype=d),)),
        "instance_norm": lambda: (nn.InstanceNorm2d(64, affine=True).eval().to(d), (_randn(2, 64, 56, 56, dtype=d),)),
        # BiT's pre-activation: GroupNorm(32, 256) and ReLU computed where the 1x1 convolution to 64
        # channels reads them (fuse_conv1x1.claim_norms: NORM), at 56 x 56
        "group_norm_conv1x1": lambda: (nn.Sequential(nn.GroupNorm(32, 256), nn.ReLU(), nn.Conv2d(256, 64, 1)
                                                     ).eval().to(d), (_randn(1, 256, 56, 56, dtype=d),)),
        # depthwise (kernels/depthwise.py): MobileNetV2's inverted residual (1x1 expand, 3x3 depthwise at
        # stride 2 with its batch norm and ReLU6 computed where the 1x1 project reads it: fuse_conv1x1.py,
        # the batch norm a prologue of 2 more steps in half precision), ConvNeXt's 7x7 with a residual
        # add, a Mamba-style causal conv1d over 4096 channels (kernel 4) at a 16-token prefill and at a
        # decode step (one output), a 3-D one; a Conformer's convolution module (depthwise conv1d, batch
        # norm, SiLU, 1x1 conv1d over 256 channels and 500 frames)
        "depthwise_mobilenet": lambda: (nn.Sequential(
            nn.Conv2d(32, 192, 1), nn.ReLU6(), nn.Conv2d(192, 192, 3, stride=2, padding=1, groups=192),
            nn.BatchNorm2d(192), nn.ReLU6(), nn.Conv2d(192, 32, 1)).eval().to(d), (_randn(1, 32, 56, 56, dtype=d),)),
        "conv1x1_squeeze_excite": lambda: (SqueezeExciteTail().eval().to(d), (_randn(1, 240, 28, 28, dtype=d),)),
        "depthwise_conformer": lambda: (nn.Sequential(
            nn.Conv1d(256, 256, 31, padding=15, groups=256), nn.BatchNorm1d(256), nn.SiLU(),
            nn.Conv1d(256, 256, 1)).eval().to(d), (_randn(1, 256, 500, dtype=d),)),
        "depthwise_convnext": lambda: (Fn(lambda x: x + dw7(x)).eval(), (_randn(2, 96, 56, 56, dtype=d),)),
        "depthwise_causal_conv1d": lambda: (nn.Sequential(nn.Conv1d(4096, 4096, 4, padding=3, groups=4096), nn.SiLU()
                                                          ).eval().to(d), (_randn(1, 4096, 16, dtype=d),)),
        "depthwise_conv1d_decode": lambda: (nn.Sequential(nn.Conv1d(4096, 4096, 4, groups=4096), nn.SiLU()
                                                          ).eval().to(d), (_randn(1, 4096, 4, dtype=d),)),
        "depthwise_3d": lambda: (nn.Conv3d(32, 32, 3, padding=1, groups=32).eval().to(d),
                                 (_randn(1, 32, 8, 32, 32, dtype=d),)),
        # its next level down: 64 -> 128 channels (64 x 64 tiles) over 8 x 32 x 32, transposed back up
        "conv3d_unet_down": lambda: (nn.Sequential(nn.Conv3d(64, 128, 3, padding=1), nn.SiLU(),
                                                   nn.ConvTranspose3d(128, 64, 2, stride=2)).eval().to(d),
                                     (_randn(1, 64, 8, 32, 32, dtype=d),)),
        # a 3-D UNet's / video VAE decoder's upsampling: k2 s2, 64 -> 32 channels, 8 x 32 x 32 -> 16 x 64 x 64
        "conv_transpose_3d": lambda: (nn.ConvTranspose3d(64, 32, 2, stride=2).eval().to(d),
                                      (_randn(1, 64, 8, 32, 32, dtype=d),)),
        "pool3d": lambda: (Pool3d().eval().to(d), (_randn(2, 64, 8, 56, 56, dtype=d),)),
        # Deformable DETR's sampling: 8 heads x 32 channels of a 100 x 100 level at 300 queries x 4 points,
        # bilinear and nearest, zeros and reflection padding
        "grid_sample": lambda: (_GridSample().eval(), (_randn(8, 32, 100, 100, dtype=d),
                                                       torch.rand(8, 300, 4, 2, dtype=d) * 2 - 1)),
    }


def _op_cases(d) -> dict[str, callable]:
    """Attention, rows, reductions, indexing, scatters, pointwise chains, matmuls, MoE, rotary in dtype ``d``."""
    return {
        **_attention_cases(d),
        "reductions": lambda: _reductions(d),
        "softmax_norm": lambda: _rows(d),
        "softmax_vocab": lambda: _softmax_vocab(d),
        "rows_fused": lambda: _rows_fused(d),
        "reductions_fused": lambda: _reductions_fused(d),
        "indexing": lambda: _indexing(d),
        "embedding_epilogue": lambda: _embedding_epilogue(d),
        "shrink_activations": lambda: _shrink_activations(d),
        "bags_and_distances": lambda: _bags_and_distances(d),
        "scatter": lambda: _scatter(d),
        "kv_cache_update": lambda: (KVCache(d), (torch.tensor([5]), _randn(1, 8, 1, 64, dtype=d))),
        "kv_cache_pair": lambda: (KVCachePair(d), (torch.arange(5, 12), _randn(1, 8, 7, 64, dtype=d),
                                                   _randn(1, 7, 8, 64, dtype=d))),
        "creation": lambda: _creation(d),
        "pointwise": lambda: _pointwise(d),
        "cat_prefill": lambda: _cats(d, 300),
        "cat_decode": lambda: _cats(d, 1),
        "matmul": lambda: _matmuls(d),
        **_moe_cases(d),
        "pad": lambda: _pads(d),
        "resize": lambda: _resizes(d),
        "epilogue_prefill": lambda: _epilogues(d, 384, 384),
        "epilogue_decode": lambda: _epilogues(d, 1, 512),
        "layer_norm_mlp_prefill": lambda: _layer_norm_mlp(d, 200),
        "layer_norm_mlp_decode": lambda: _layer_norm_mlp(d, 1),
        "layer_norm_mlp_3_rows": lambda: _layer_norm_mlp(d, 3),  # GEMV tiles of 4 rows
        # written out, fused by passes/fuse_rotary.py: q [1, 8, 64, 128] and k as a projection's transpose
        # (2 heads), paired into one launch
        "rotary": lambda: (Fn(lambda q, k, c, s: (q * c + rotate_half(q) * s,
                                                  k.transpose(1, 2) * c + rotate_half(k.transpose(1, 2)) * s)),
                           (_randn(1, 8, 64, 128, dtype=d), _randn(1, 64, 2, 128, dtype=d),
                            _randn(64, 128, dtype=d), _randn(64, 128, dtype=d))),
        # q and k rotated by tables computed from input positions (a KV-cache step): passes/rotary_tables.py
        "rotary_angles": lambda: _positions_rotary(d, 16),
        "rotary_angles_decode": lambda: _positions_rotary(d, 1),
        # the rotary in the Q/K/V projection's epilogue (passes/fuse_rope_linear.py): prefill and decode
        "qkv_rope_prefill": lambda: _qkv_rope(d, 300),
        "qkv_rope_decode": lambda: _qkv_rope(d, 1),
        "qkv_rope_angles_prefill": lambda: _qkv_rope(d, 300, float_positions=True),
        "qkv_rope_angles_decode": lambda: _qkv_rope(d, 1, float_positions=True),
        "qkv_norm_rope_prefill": lambda: _qkv_rope(d, 300, head_norm=True),
        "qkv_norm_rope_decode": lambda: _qkv_rope(d, 1, head_norm=True),
        # interleaved pairs (GPT-J's rotate_every_two over rotary_dim 64 of 256-wide heads, q and k
        # [1, seq, 16, 64]): the rotary kernel over [..., 32, 2] views, prefill and decode
        "rotary_interleaved_prefill": lambda: _interleaved_rotary(d, 300),
        "rotary_interleaved_decode": lambda: _interleaved_rotary(d, 1),
        # Cohere's: tables computed from input positions, each angle repeated for its pair (ANGLES)
        "rotary_interleaved_angles_decode": lambda: _interleaved_angles(d, 1),
        # a lone rotary (no pair): one decode token against [b, 1, 1, D] tables
        "rotary_lone": lambda: (Fn(lambda x, c, s: x * c + rotate_half(x) * s),
                                (_randn(4, 8, 1, 128, dtype=d), _randn(4, 1, 1, 128, dtype=d),
                                 _randn(4, 1, 1, 128, dtype=d))),
    }


def _cats(dtype, seq: int):
    """DeepSeek-V3's query and key assembled from their parts (128 heads of 128 + 64 columns, the key's
    rotary part broadcast over the heads) and a DenseNet-style cat of four feature maps along the
    channels: one ``cat`` launch each (kernels/fuse_cat.py)."""
    def assemble(q, q_rot, kv, k_rot, f1, f2, f3, f4):
        query = torch.cat((q[..., :128], q_rot), -1)
        key = torch.cat((kv[..., :128], k_rot.expand(-1, 128, -1, -1)), -1)
        return query, key, torch.cat((f1, f2, f3, f4), 1)

    maps = [_randn(2, c, 28, 28, dtype=dtype) for c in (64, 32, 32, 32)]
    return Fn(assemble), (_randn(1, 128, seq, 192, dtype=dtype), _randn(1, 128, seq, 64, dtype=dtype),
                          _randn(1, 128, seq, 256, dtype=dtype), _randn(1, 1, seq, 64, dtype=dtype), *maps)


def _rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _interleaved_rotary(dtype, seq: int):
    """GPT-J's rotary of q and k [1, seq, 16, 64] by [1, seq, 32] sin and cos, repeated per pair."""
    def rotate(q, k, sin, cos):
        sin, cos = (torch.repeat_interleave(t[:, :, None, :], 2, 3) for t in (sin, cos))
        return q * cos + _rotate_every_two(q) * sin, k * cos + _rotate_every_two(k) * sin

    return Fn(rotate), (_randn(1, seq, 16, 64, dtype=dtype), _randn(1, seq, 16, 64, dtype=dtype),
                        _randn(1, seq, 32, dtype=dtype), _randn(1, seq, 32, dtype=dtype))


def _interleaved_angles(dtype, seq: int):
    """Cohere's rotary of q (32 heads) and k (8 heads) of 128 at ``seq`` positions, tables computed
    from the positions with each angle repeated for its pair."""
    def rotate(q, k, pos, inv_freq):
        emb = torch.repeat_interleave(pos[..., None].float() * inv_freq, 2, dim=-1)
        cos, sin = emb.cos().to(q.dtype)[:, :, None], emb.sin().to(q.dtype)[:, :, None]
        return q * cos + _rotate_every_two(q) * sin, k * cos + _rotate_every_two(k) * sin

    inv_freq = 1.0 / 10000 ** (torch.arange(0, 128, 2).float() / 128)
    return Fn(rotate), (_randn(1, seq, 32, 128, dtype=dtype), _randn(1, seq, 8, 128, dtype=dtype),
                        torch.arange(100, 100 + seq)[None], inv_freq)


def _positions_rotary(dtype, seq: int):
    """Llama's q (32 heads) and k (8 heads) at ``seq`` positions, tables computed from the positions."""
    def rotate(q, k, pos, inv_freq):
        freqs = pos.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    return Fn(rotate), (_randn(1, 32, seq, 128, dtype=dtype), _randn(1, 8, seq, 128, dtype=dtype),
                        torch.arange(100, 100 + seq), _randn(64, dtype=F32))


class _QKVRope(torch.nn.Module):
    """Llama-3-8B's Q/K/V projections (4096 -> 32 + 8 + 8 heads of 128) with q and k rotated by tables
    computed from the positions: the rotary runs in the fused projection's epilogue, which computes the
    angles from integer positions (``ROPE="positions"``) or reads them (float positions: ``"angles"``);
    ``head_norm``: Qwen3-8B's, with q and k RMS-normalized per head first (``NORM_E=128``)."""

    def __init__(self, dtype, head_norm=False):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(4096, n, bias=False, dtype=dtype) for n in (4096, 1024, 1024))
        self.register_buffer("inv_freq", _randn(64, dtype=F32))
        self.norms = [_randn(128, dtype=dtype), _randn(128, dtype=dtype)] if head_norm else []

    def _norm(self, t, k):
        if not self.norms:
            return t
        t32 = t.float()
        return self.norms[k] * (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype)

    def forward(self, x, pos):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, 128) for p in (self.q, self.k, self.v))
        q, k, v = self._norm(q, 0).transpose(1, 2), self._norm(k, 1).transpose(1, 2), v.transpose(1, 2)
        freqs = pos.float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def _qkv_rope(dtype, seq: int, head_norm=False, float_positions=False):
    positions = torch.arange(100, 100 + seq)
    return _QKVRope(dtype, head_norm), (_randn(1, seq, 4096, dtype=dtype),
                                        positions.float() if float_positions else positions)


def _positions_sdpa(dtype, seq: int, keys: int, start: int):
    """GQA attention (32 query heads, 8 key/value heads, head dim 128) of ``seq`` queries at positions
    ``start..`` over a cache of ``keys`` keys, masked by position."""
    def attend(q, k, v, pos):
        mask = torch.arange(k.shape[-2])[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return Fn(attend), (_randn(1, 32, seq, 128, dtype=dtype), _randn(1, 8, keys, 128, dtype=dtype),
                        _randn(1, 8, keys, 128, dtype=dtype), torch.arange(start, start + seq))


class _SinksAttention(nn.Module):
    """GPT-OSS-20B's attention written out, as transformers' eager attention computes it (64 query heads
    over 8 key/value heads of 64, a sink logit per head, a float mask): ``passes/eager_attention.py``
    makes it one ``tritondelegate::sdpa_sinks`` launch (the attention kernel's ``SINKS``)."""

    def __init__(self, dtype):
        super().__init__()
        self.sinks = nn.Parameter(_randn(64, dtype=dtype))

    def forward(self, q, k, v, mask):
        k, v = (t[:, :, None].expand(-1, -1, 8, -1, -1).reshape(1, 64, -1, 64) for t in (k, v))
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
        logits = torch.cat([scores, self.sinks.reshape(1, -1, 1, 1).expand(1, -1, q.shape[-2], -1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v).transpose(1, 2)


def _sinks_attention(dtype, seq: int, keys: int):
    """``seq`` queries over ``keys`` keys with GPT-OSS's sliding-window mask (128 keys, fp32 min
    outside): a decode step over a long cache splits its keys (``attention_combine`` adds the sink)."""
    pos = torch.arange(keys - seq, keys)[:, None]
    j = torch.arange(keys)[None, :]
    mask = torch.zeros(1, 1, seq, keys).masked_fill((j > pos) | (j <= pos - 128), torch.finfo(F32).min)
    return _SinksAttention(dtype), (_randn(1, 64, seq, 64, dtype=dtype), _randn(1, 8, keys, 64, dtype=dtype),
                                    _randn(1, 8, keys, 64, dtype=dtype), mask.to(dtype))


def _softcap_attention(dtype, seq: int, keys: int):
    """Gemma-2-9B's attention (16 query heads over 8 key/value heads of 256, scores soft-capped at 50, a
    float causal mask) as ``tritondelegate::sdpa_softcap``, the attention kernel's ``SOFTCAP``."""
    j, i = torch.arange(keys)[None, :], torch.arange(keys - seq, keys)[:, None]
    mask = torch.zeros(1, 1, seq, keys).masked_fill(j > i, torch.finfo(F32).min).to(dtype)
    return Fn(lambda q, k, v, m: torch.ops.tritondelegate.sdpa_softcap(q, k, v, m, 50.0, 256 ** -0.5, True)), (
        _randn(1, 16, seq, 256, dtype=dtype), _randn(1, 8, keys, 256, dtype=dtype),
        _randn(1, 8, keys, 256, dtype=dtype), mask)


def _quantized_cases() -> dict[str, callable]:
    """bf16 decoders with weight-only quantized linears: 4 bits (two per byte) per group of 32 at decode
    (GEMV); uint8 and 4 bits with zero points per group at prefill (tl.dot tiles, the K step capped to
    the group), the 4-bit ones with their embedding tables quantized (``dequant_rows``); a MoE layer's
    quantized experts at decode and at prefill."""
    llama = dict(dim=512, n_layers=1, hidden_dim=1376, n_heads=8, n_kv_heads=2)
    return {
        "decoder_decode_int4_g32/bfloat16": lambda: _quantized(
            _decoder(BF16, 1, max_seq_len=64, **llama), group_size=32, bits=4, embeddings=True),
        "decoder_prefill_uint4_g64/bfloat16": lambda: _quantized(
            _decoder(BF16, 384, max_seq_len=512, **llama), group_size=64, zero_point=True, bits=4, embeddings=True),
        "decoder_prefill_uint8_g128/bfloat16": lambda: _quantized(
            _decoder(BF16, 384, max_seq_len=512, **llama), group_size=128, zero_point=True),
        # a MoE layer's experts (the grouped GEMM's QUANT): int8 per row at decode (the per-row path),
        # 4 bits with zero points per group of 64 at prefill (segment tiles), 4 bits symmetric (below)
        "moe_experts_decode_int8/bfloat16": lambda: _moe_experts(BF16, 2, bits=8),
        # quantized embedding lookups with epilogues (a [seq, dim] addend, a scale): dequant_rows' EPILOGUE
        "embedding_epilogue_int4_g32/bfloat16": lambda: _quantized(
            (_EmbeddingEpilogue(BF16), (torch.randint(0, 8192, (2, 300)), torch.randint(0, 8192, (4, 1)))),
            bits=4, group_size=32, embeddings=True),
        "moe_experts_prefill_uint4_g64/bfloat16": lambda: _moe_experts(BF16, 600, bits=4, group_size=64,
                                                                        zero_point=True),
        # 4 bits symmetric (QZERO 8, no zero table) on both paths of the grouped GEMM
        "moe_experts_decode_int4_g32/bfloat16": lambda: _moe_experts(BF16, 2, bits=4, group_size=32),
        "moe_experts_prefill_int4_g128/bfloat16": lambda: _moe_experts(BF16, 600, bits=4, group_size=128),
        # Llama 4's experts through bmm (a batch of quantized weights, stride_qz): decode (GEMV), prefill
        "llama4_experts_decode_int4_g32/bfloat16": lambda: _llama4_experts(BF16, 1, bits=4, group_size=32),
        "llama4_experts_prefill_int8/bfloat16": lambda: _llama4_experts(BF16, 96, bits=8),
    }


def cases() -> dict[str, callable]:
    """Case name -> a function returning (model, example args). Shapes span every block-size branch
    of each kernel family (short and long rows, decode- and prefill-shaped GEMMs and attention)."""
    out = {}
    for dtype in FLOATS:
        suffix = dtype_name(dtype)
        out.update({f"{name}/{suffix}": make for name, make in _per_dtype(dtype).items()})
    out.update(_quantized_cases())
    out["reductions/int64"] = _int_reductions
    out["scatter/int64"] = _int_scatter
    out["division/int64"] = _int_division
    out["ranking/int64"] = _int_ranking
    out["sort_offsets/int64"] = _sort_offsets
    # attention sinks (GPT-OSS): decode over a 4096-key cache (packed heads, split keys) and a prefill
    out["attn_sinks_decode/bfloat16"] = lambda: _sinks_attention(BF16, 1, 4096)
    out["attn_sinks_decode_short/bfloat16"] = lambda: _sinks_attention(BF16, 1, 200)  # one pass, packed heads
    out["attn_sinks_prefill/bfloat16"] = lambda: _sinks_attention(BF16, 512, 512)
    # soft-capped scores (Gemma 2): a prefill and a decode step over a 4096-key cache (split keys)
    out["attn_softcap_prefill/bfloat16"] = lambda: _softcap_attention(BF16, 512, 512)
    out["attn_softcap_decode/bfloat16"] = lambda: _softcap_attention(BF16, 1, 4096)
    # the demo decoder's attention written out: passes/eager_attention.py makes it one attention launch
    # (a float causal mask); the written-out GEMM epilogues are epilogue_*'s, which return the weights
    out["decoder_matmul_attention/float16"] = lambda: _decoder(
        F16, 100, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=128, attention="matmul")
    for dtype in (F32, F16):  # bounded dynamic dims: each method compiled at sample sizes of its range
        suffix = dtype_name(dtype)
        out[f"dynamic_prefill/{suffix}"] = lambda d=dtype: _dynamic_prefill(d)
        out[f"dynamic_batch_mlp/{suffix}"] = lambda d=dtype: (
            MLP([784, 1024, 1000]).eval().to(d), (_randn(8, 784, dtype=d),), {"x": {0: torch.export.Dim("batch", max=64)}})
        out[f"dynamic_batch_convnet/{suffix}"] = lambda d=dtype: (
            ConvNet().eval().to(d), (_randn(2, 3, 64, 64, dtype=d),), {"x": {0: torch.export.Dim("batch", max=8)}})
        # a UNet decoder's resizes at a dynamic height and width (sizes and scales computed per call)
        out[f"dynamic_resize/{suffix}"] = lambda d=dtype: (
            Fn(lambda x: (F.interpolate(x, scale_factor=2), F.interpolate(x, scale_factor=2, mode="bilinear"))),
            (_randn(1, 32, 48, 64, dtype=d),),
            {"args": ({2: torch.export.Dim("h", min=8, max=128), 3: torch.export.Dim("w", min=8, max=128)},)})
    return out


def _dynamic_prefill(dtype):
    """The Llama-style decoder over a dynamic prompt length (batch 1, up to 384 tokens)."""
    model, (ids,) = _decoder(dtype, 100, dim=512, n_layers=1, hidden_dim=1376, n_heads=8, n_kv_heads=2,
                             max_seq_len=512)
    return model, (ids,), {"input_ids": {1: torch.export.Dim("seq", max=384)}}


# --- specialization, as JITFunction.run does it ---------------------------------------------------
@dataclass
class Variant:
    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: object
    kernel_fn: object
    uses: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    registers: int | None = None
    stack_bytes: int | None = None
    shared: int | None = None

    def describe(self) -> str:
        params = self.kernel_fn.params
        # The declared constexprs; integer arguments equal to 1 also become constants when specialized.
        shown = {params[p[0]].name: v for p, v in self.constexprs.items()
                 if len(p) == 1 and params[p[0]].is_constexpr}
        opts = f"warps={self.options.num_warps} stages={self.options.num_stages}"
        types = sorted({t for t in self.signature.values() if t.startswith("*")})
        return f"{self.kernel} {shown} {opts} {' '.join(types)}"


def _arguments(delegate, launch):
    """The launch's arguments as specialization sees them (tensor addresses relative to aligned bases)."""
    return decode_args(launch_request(delegate, launch)["args"])


def collect(selected: dict, backend, log) -> tuple[dict[str, Variant], dict[str, str]]:
    """The distinct variants the cases launch, and the cases that failed to lower (name -> error)."""
    variants: dict[str, Variant] = {}
    broken: dict[str, str] = {}
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    for name, make in selected.items():
        start = time.time()
        torch.manual_seed(0)
        try:
            model, args, *dynamic = make()  # a third item: the export's dynamic_shapes
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ep = torch.export.export(model, tuple(args), dynamic_shapes=dynamic[0] if dynamic else None)
                lowered = td.lower(ep, td.TritonPartitioner("cuda:0"), config)
        except Exception as exc:  # report it with the others; the remaining cases still run
            broken[name] = f"{type(exc).__name__}: {exc}"
            log(f"  {name}: FAILED to lower: {broken[name]}")
            continue
        launches = 0
        for method in concrete_methods(lowered.program):  # a dynamic method at sample sizes
            for delegate in method.delegates:
                for launch in delegate.plan.launches:
                    launches += 1
                    kernel = KERNELS[launch.kernel]
                    meta = {k: v.value for k, v in launch.constexprs.items()}
                    options, signature, constexprs, attrs = specialize(
                        kernel, backend, _arguments(delegate, launch), meta)
                    key = variant_key(launch.kernel, options, signature, constexprs, attrs)
                    if key not in variants:
                        variants[key] = Variant(launch.kernel, signature, constexprs, attrs, options,
                                                kernel)
                    variants[key].uses.append(f"{name}:{launch.op}")
        log(f"  {name}: {launches} launches ({time.time() - start:.1f}s)")
    return variants, broken


# --- compiling ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _captured_stderr():
    """MLIR and ptxas diagnostics are written to file descriptor 2, not to sys.stderr."""
    with tempfile.TemporaryFile(mode="w+") as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        text = []
        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            text.append(f.read())


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers per thread, stack-frame bytes per thread: where ptxas puts spills) from the cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


def compile_variant(v: Variant, target, max_shared: int) -> None:
    start = time.time()
    try:
        with _captured_stderr() as diagnostics:
            compiled = triton.compile(ASTSource(v.kernel_fn, v.signature, v.constexprs, v.attrs),
                                      target=target, options=v.options.__dict__)
    except Exception as exc:  # a compiler error of any kind is this check's finding
        root = exc
        while root.__cause__ is not None:  # Triton's CompilationError names the line; its cause says why
            root = root.__cause__
        why = f"{type(root).__name__}: {root}".strip() if root is not exc else ""
        found = (str(exc).strip(), why, diagnostics[0].strip() if diagnostics else "")
        detail = "\n".join(s for s in found if s)
        v.error = f"{type(exc).__name__}: {detail}"
        v.seconds = time.time() - start
        return
    v.seconds = time.time() - start
    v.shared = compiled.metadata.shared
    if "cubin" in compiled.asm:
        v.registers, v.stack_bytes = _resources(compiled.asm["cubin"])
    if v.shared > max_shared:
        v.error = f"needs {v.shared} bytes of shared memory; the target allows {max_shared} per block"


_JOB: tuple = ()  # (variants, target, max shared): what forked compile workers inherit


def _compile_one(index: int) -> tuple:
    variants, target, max_shared = _JOB
    v = variants[index]
    compile_variant(v, target, max_shared)
    return v.error, v.seconds, v.registers, v.stack_bytes, v.shared


def compile_all(variants: list[Variant], target, max_shared: int, jobs: int, log) -> None:
    """Compiles every variant, in ``jobs`` forked worker processes (compiling is CPU-bound and each
    variant independent); results are copied back into the variants."""
    global _JOB
    _JOB = (variants, target, max_shared)
    if jobs > 1:
        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap(_compile_one, range(len(variants)))
    else:
        pool, results = None, map(_compile_one, range(len(variants)))
    try:
        for i, (v, result) in enumerate(zip(variants, results), 1):
            v.error, v.seconds, v.registers, v.stack_bytes, v.shared = result
            status = "FAILED" if v.error else f"ok  regs={v.registers} stack={v.stack_bytes}B smem={v.shared}B"
            log(f"[{i}/{len(variants)}] {v.seconds:5.1f}s {status}  {v.describe()}  ({v.uses[0]})")
    finally:
        if pool is not None:
            pool.close()
            pool.join()


# --- main -----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability (default 90: H100/H200)")
    parser.add_argument("--case", action="append", default=[], help="only the cases whose name contains this")
    parser.add_argument("--skip-fp16-twins", action="store_true",
                        help="not the float16 cases that have a bfloat16 twin (same kernels, the other 16-bit type)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compile in this many processes (default: one per CPU)")
    parser.add_argument("--collect-only", action="store_true", help="lower the cases and count variants")
    opts = parser.parse_args(argv)

    all_cases = cases()
    if opts.list:
        print("\n".join(all_cases))
        return 0
    twins = {k for k in all_cases if k.endswith("/float16") and k[:-len("float16")] + "bfloat16" in all_cases}
    selected = {k: f for k, f in all_cases.items()
                if (not opts.case or any(s in k for s in opts.case)) and not (opts.skip_fp16_twins and k in twins)}
    if not selected:
        parser.error(f"no case matches {opts.case}; --list shows them")

    def log(msg):
        print(msg, flush=True)

    target = GPUTarget("cuda", opts.arch, 32)
    backend = make_backend(target)
    max_shared = MAX_SHARED.get(opts.arch, 99 * 1024)
    log(f"triton {triton.__version__}, torch {torch.__version__}, target sm_{opts.arch}; lowering "
        f"{len(selected)} cases")
    variants, broken = collect(selected, backend, log)
    log(f"compiling {len(variants)} distinct kernel variants")
    if opts.collect_only:
        return 0
    start = time.time()
    compile_all(list(variants.values()), target, max_shared, opts.jobs, log)

    by_kernel: dict[str, list[int]] = {}
    for v in variants.values():
        by_kernel.setdefault(v.kernel, [0, 0])[bool(v.error)] += 1
    failed = [v for v in variants.values() if v.error]
    spilling = [v for v in variants.values() if v.stack_bytes]
    log(f"\n{'kernel':<16} compiled failed")
    for name, (ok, bad) in sorted(by_kernel.items()):
        log(f"{name:<16} {ok:>8} {bad:>6}")
    log(f"{'total':<16} {len(variants) - len(failed):>8} {len(failed):>6}   ({time.time() - start:.0f}s)")
    for v in spilling:
        log(f"stack {v.stack_bytes} B/thread, {v.registers} registers: {v.describe()}  ({v.uses[0]})")
    for name, error in broken.items():
        log(f"\nFAILED to lower case {name}: {error}")
    for v in failed:
        more = " ..." if len(v.uses) > 4 else ""
        log(f"\nFAILED {v.describe()}\n  used by {', '.join(v.uses[:4])}{more}")
        lines = v.error.splitlines()
        shown = lines if len(lines) <= 8 else lines[:3] + ["..."] + lines[-3:]  # the JSON has it all
        log("  " + "\n  ".join(shown))
    if opts.json:
        rows = [{"kernel": v.kernel, "variant": v.describe(), "uses": v.uses, "error": v.error,
                 "registers": v.registers, "stack_bytes": v.stack_bytes, "shared_bytes": v.shared,
                 "seconds": round(v.seconds, 2)} for v in variants.values()]
        with open(opts.json, "w") as f:
            json.dump({"triton": triton.__version__, "arch": opts.arch, "variants": rows,
                       "cases_not_lowered": broken}, f, indent=1)
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
