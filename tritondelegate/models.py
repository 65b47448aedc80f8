"""Small models the demo, tests and benchmarks share: a Llama-style decoder and an MLP.

Weights are random (fixed seed by the caller); nothing is downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class DecoderConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 176
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    eps: float = 1e-5
    attention: str = "sdpa"  # "sdpa": scaled_dot_product_attention; "matmul": matmul + softmax


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, written out the way Llama does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        mask = torch.full((cfg.max_seq_len, cfg.max_seq_len), float("-inf")).triu(1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x, cos, sin):
        b, seq, _ = x.shape
        q = self.q_proj(x).view(b, seq, self.cfg.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, seq, self.cfg.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, seq, self.cfg.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.cfg.n_heads // self.cfg.n_kv_heads
        k = k[:, :, None].expand(b, self.cfg.n_kv_heads, groups, seq, self.head_dim).reshape(b, -1, seq, self.head_dim)
        v = v[:, :, None].expand(b, self.cfg.n_kv_heads, groups, seq, self.head_dim).reshape(b, -1, seq, self.head_dim)
        if self.cfg.attention == "sdpa":
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            scores = scores + self.causal_mask[:seq, :seq]
            out = scores.softmax(dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, seq, -1))


class FeedForward(nn.Module):
    """down(silu(gate(x)) * up(x))"""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class LlamaStyleDecoder(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, cfg: DecoderConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or DecoderConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head_dim = cfg.dim // cfg.n_heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids):
        seq = input_ids.shape[1]
        positions = torch.arange(seq, dtype=torch.float32, device=input_ids.device)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class MLP(nn.Module):
    """Linear layers with GELU between them: widths [in, h1, ..., out]."""

    def __init__(self, widths: list[int], bias: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = nn.functional.gelu(x)
        return x


def demo_decoder(seed: int = 0, **overrides) -> tuple[LlamaStyleDecoder, tuple[torch.Tensor]]:
    """The demo's model and example input, deterministic for a given seed."""
    torch.manual_seed(seed)
    model = LlamaStyleDecoder(DecoderConfig(**overrides)).eval()
    input_ids = torch.randint(0, model.cfg.vocab_size, (1, 16))
    return model, (input_ids,)
