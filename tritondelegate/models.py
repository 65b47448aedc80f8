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

    def project(self, x, cos, sin):
        """q, k, v as [b, heads, seq, head_dim], rotary embedding applied to q and k."""
        b, seq, _ = x.shape
        q = self.q_proj(x).view(b, seq, self.cfg.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, seq, self.cfg.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, seq, self.cfg.n_kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def forward(self, x, cos, sin):
        b, seq, _ = x.shape
        q, k, v = self.project(x, cos, sin)
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
    def __init__(self, cfg: DecoderConfig, attention=Attention):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class LlamaStyleDecoder(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, cfg: DecoderConfig | None = None, layer=DecoderLayer):
        super().__init__()
        self.cfg = cfg = cfg or DecoderConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.n_layers))
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


# --- KV-cache decoder: prefill and decode as two exports of one module --------------------------------
class KVCacheAttention(Attention):
    """:class:`Attention` over a static KV cache ``[max_batch, n_kv_heads, max_seq_len, head_dim]``.

    The new keys and values are written into the cache at ``input_pos`` (``index_copy_`` along the
    sequence dim), then the queries attend over the whole cache with ``mask`` (True where
    ``key_pos <= query_pos``), so entries past the current position, stale or zero, never count.
    """

    def __init__(self, cfg: DecoderConfig, max_batch: int):
        super().__init__(cfg)
        del self.causal_mask  # masks come from the positions
        shape = (max_batch, cfg.n_kv_heads, cfg.max_seq_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, cos, sin, input_pos, mask):
        b, seq, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        k, v = self.k_cache, self.v_cache
        n_kv, length = self.cfg.n_kv_heads, self.cfg.max_seq_len
        groups = self.cfg.n_heads // n_kv
        # The existing decoder's repeat_kv pattern: lower() folds it into sdpa(enable_gqa=True).
        k = k[:, :, None].expand(b, n_kv, groups, length, self.head_dim).reshape(b, -1, length, self.head_dim)
        v = v[:, :, None].expand(b, n_kv, groups, length, self.head_dim).reshape(b, -1, length, self.head_dim)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, seq, -1))


class KVCacheDecoderLayer(DecoderLayer):
    def __init__(self, cfg: DecoderConfig, max_batch: int):
        super().__init__(cfg, attention=lambda c: KVCacheAttention(c, max_batch))

    def forward(self, x, cos, sin, input_pos, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, input_pos, mask)
        return x + self.ffn(self.ffn_norm(x))


class KVCacheDecoder(LlamaStyleDecoder):
    """The Llama-style decoder with a static KV cache per layer (buffers, the program's state).

    ``forward(input_ids [B, T] int64, input_pos [T] int64) -> logits [B, T, vocab]``: the tokens sit at
    positions ``input_pos`` of the sequence. Prefill (T = prompt length, positions 0..T-1) and decode
    (T = 1, the next position) are the same module exported with two example shapes. B must equal
    ``max_batch`` (the cache is written whole along the batch dim). The weights, their names and their
    initialization are :class:`LlamaStyleDecoder`'s: built with the same seed, a prefill from position
    0 gives that model's logits.

    ``logits_to_keep`` (as transformers names it; 0: all): only the last that many positions go through
    the final norm and the LM head, logits [B, min(T, logits_to_keep), vocab]. A prefill whose caller
    only samples the next token needs one: the LM head then reads one row per sequence, not T, and
    B x vocab logits leave the device instead of B x T x vocab (``export_prefill_decode(last_logits=True)``).
    """

    def __init__(self, cfg: DecoderConfig | None = None, max_batch: int = 1):
        super().__init__(cfg, layer=lambda c: KVCacheDecoderLayer(c, max_batch))
        self.max_batch = max_batch
        self.logits_to_keep = 0
        self.register_buffer("key_positions", torch.arange(self.cfg.max_seq_len), persistent=False)

    def forward(self, input_ids, input_pos):
        freqs = input_pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = self.key_positions[None, :] <= input_pos[:, None]  # [T, max_seq_len], True = attend
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, mask)
        if self.logits_to_keep:
            x = x[:, -self.logits_to_keep:]
        return self.lm_head(self.norm(x))

    def cache_buffers(self) -> dict[str, torch.Tensor]:
        """The KV cache buffers by fully-qualified name (the program's state)."""
        return {name: b for name, b in self.named_buffers() if name.endswith(("k_cache", "v_cache"))}

    def reset_cache(self) -> None:
        for buffer in self.cache_buffers().values():
            buffer.zero_()


def kv_cache_decoder(seed: int = 0, max_batch: int = 1, **overrides) -> KVCacheDecoder:
    """A :class:`KVCacheDecoder` with random weights, deterministic for a given seed."""
    torch.manual_seed(seed)
    return KVCacheDecoder(DecoderConfig(**overrides), max_batch=max_batch).eval()


def export_prefill_decode(model: KVCacheDecoder, prompt_len: int, max_prompt_len: int | None = None,
                          last_logits: bool = False, verify_len: int | None = None
                          ) -> dict[str, torch.export.ExportedProgram]:
    """``{"prefill": ep, "decode": ep}``: ``model`` exported for ``prompt_len`` tokens at positions
    0..prompt_len-1 and for one token at position prompt_len. Both programs name the cache buffers
    with the same fully-qualified names, so ``td.lower`` of the dict makes them one shared state.
    Zeroes the module's cache first.

    ``max_prompt_len``: export prefill with a dynamic prompt length (``Dim("prompt", max=...)``, the
    same symbol for the ids' length and the positions), so one prefill takes any prompt of 1 up to
    that many tokens; ``prompt_len`` is then only the example.

    ``last_logits``: prefill returns the logits of the prompt's last position only, [B, 1, vocab]
    (``KVCacheDecoder.logits_to_keep = 1`` while it is exported): what generation samples from, without
    the LM head over every prompt position or their logits crossing the bus.

    ``verify_len``: also a method ``"verify"`` of 1 to ``verify_len`` tokens (a dynamic length) that
    returns every position's logits: the decode calls of prompt lookup decoding (``Generator(...,
    decode="verify")`` with ``generate(..., lookup=td.PromptLookup(...))``), which run the last token and
    a draft and keep the drafted tokens greedy decoding picks."""
    limit = model.cfg.max_seq_len - 1
    if not 0 < prompt_len <= limit or (max_prompt_len is not None and not prompt_len <= max_prompt_len <= limit):
        raise ValueError(f"need 1 <= prompt_len <= max_prompt_len <= {limit} (max_seq_len - 1), got "
                         f"prompt_len={prompt_len}, max_prompt_len={max_prompt_len}")
    batch = model.max_batch
    prefill_args = (torch.zeros(batch, prompt_len, dtype=torch.long), torch.arange(prompt_len))
    decode_args = (torch.zeros(batch, 1, dtype=torch.long), torch.tensor([prompt_len]))
    dynamic = None
    if max_prompt_len is not None:
        prompt = torch.export.Dim("prompt", min=1, max=max_prompt_len)
        dynamic = {"input_ids": {1: prompt}, "input_pos": {0: prompt}}
    # The programs hold the module's own cache tensors (not copies); td.lower snapshots their values
    # as the state's initial value. Start from an empty cache.
    model.reset_cache()
    keep, model.logits_to_keep = model.logits_to_keep, 1 if last_logits else 0
    try:
        prefill = torch.export.export(model, prefill_args, dynamic_shapes=dynamic)
    finally:
        model.logits_to_keep = keep
    programs = {"prefill": prefill, "decode": torch.export.export(model, decode_args)}
    if verify_len is not None:
        if not 2 <= verify_len <= limit:
            raise ValueError(f"need 2 <= verify_len <= {limit} (max_seq_len - 1), got {verify_len}")
        tokens = torch.export.Dim("tokens", min=1, max=verify_len)
        example = (torch.zeros(batch, 2, dtype=torch.long), torch.arange(2))
        programs["verify"] = torch.export.export(model, example, dynamic_shapes={
            "input_ids": {1: tokens}, "input_pos": {0: tokens}})
    return programs


@torch.no_grad()
def generate_eager(model: KVCacheDecoder, prompt: torch.Tensor, new_tokens: int,
                   reset: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy generation in eager PyTorch: the reference for a lowered program.

    ``prompt`` [B, T] int64. Runs one prefill (positions 0..T-1), then ``new_tokens - 1`` decode steps.
    Returns (the new tokens [B, new_tokens], the logits of each call: prefill [B, T, V], then one
    [B, 1, V] per decode step). ``reset=False`` keeps the cache from earlier calls, as a loaded
    program does until ``reset_state()``.
    """
    if reset:
        model.reset_cache()
    length = prompt.shape[1]
    if length + new_tokens - 1 > model.cfg.max_seq_len:
        raise ValueError(f"{length} prompt + {new_tokens} new tokens exceed max_seq_len {model.cfg.max_seq_len}")
    logits = [model(prompt, torch.arange(length))]
    tokens = [logits[-1][:, -1].argmax(-1)]
    for step in range(new_tokens - 1):
        logits.append(model(tokens[-1][:, None], torch.tensor([length + step])))
        tokens.append(logits[-1][:, -1].argmax(-1))
    return torch.stack(tokens, dim=1), logits


def hf_llama_static_cache(model: KVCacheDecoder, device: str | torch.device = "cpu"):
    """transformers' ``LlamaForCausalLM`` with ``model``'s config and weights, wrapped in its export
    recipe for on-device runtimes (``TorchExportableModuleWithStaticCache``, a static KV cache of
    ``max_seq_len``) on ``device``: the reference front end. Call it eagerly as
    ``wrapper(input_ids=ids, cache_position=positions)`` -> logits; it gives ``model``'s logits."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    c = model.cfg
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.hidden_dim, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, max_position_embeddings=c.max_seq_len,
        rope_theta=c.rope_theta, rms_norm_eps=c.eps, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    for i in range(c.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names |= {ours + "attn_norm.weight": theirs + "input_layernorm.weight",
                  ours + "ffn_norm.weight": theirs + "post_attention_layernorm.weight",
                  ours + "ffn.gate.weight": theirs + "mlp.gate_proj.weight",
                  ours + "ffn.up.weight": theirs + "mlp.up_proj.weight",
                  ours + "ffn.down.weight": theirs + "mlp.down_proj.weight"}
        names |= {ours + f"attn.{p}_proj.weight": theirs + f"self_attn.{p}_proj.weight" for p in "qkvo"}
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict({names[k]: v for k, v in model.state_dict().items()}, strict=True)
    hf.to(device)  # before wrapping: the wrapper allocates its cache on the model's device
    hf.generation_config.use_cache = True
    hf.generation_config.cache_implementation = "static"
    return TorchExportableModuleWithStaticCache(hf, batch_size=model.max_batch, max_cache_len=c.max_seq_len)


def llm_constant_methods(module: nn.Module) -> dict:
    """What a generation runner reads about ``module`` (``lower(..., constant_methods=...)``): for a
    :class:`KVCacheDecoder` or transformers' static-cache export wrapper
    (``TorchExportableModuleWithStaticCache``, as :func:`hf_llama_static_cache` returns, or the
    ``TorchExportableModuleForDecoderOnlyLM`` around one),
    ``get_max_seq_len`` (cache positions), ``get_max_batch_size``, ``get_vocab_size``, ``use_kv_cache``,
    and from a transformers model's generation config ``get_bos_id`` and ``get_eos_ids`` where it sets them.
    """
    if isinstance(module, KVCacheDecoder):
        c = module.cfg
        return {"get_max_seq_len": c.max_seq_len, "get_max_batch_size": module.max_batch,
                "get_vocab_size": c.vocab_size, "use_kv_cache": True}
    inner = module
    while getattr(inner, "static_cache", None) is None and isinstance(getattr(inner, "model", None), nn.Module):
        inner = inner.model  # TorchExportableModuleForDecoderOnlyLM holds the static-cache wrapper
    cache, model = getattr(inner, "static_cache", None), getattr(inner, "model", None)
    if cache is None or model is None:
        raise TypeError(f"llm_constant_methods takes a KVCacheDecoder or transformers' static-cache export "
                        f"wrapper, got {type(module).__name__}")
    keys = cache.layers[0].keys  # [batch, kv heads, max_cache_len, head dim]
    methods = {"get_max_seq_len": keys.shape[2], "get_max_batch_size": keys.shape[0],
               "get_vocab_size": model.config.get_text_config().vocab_size, "use_kv_cache": True}
    generation = model.generation_config
    if generation.bos_token_id is not None:
        methods["get_bos_id"] = generation.bos_token_id
    eos = generation.eos_token_id
    if eos is not None:
        methods["get_eos_ids"] = [eos] if isinstance(eos, int) else list(eos)
    return methods
