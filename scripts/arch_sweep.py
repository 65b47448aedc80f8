#!/usr/bin/env python
"""Sweep transformers architectures (tiny random configs, fp32, nothing downloaded) through ``td.lower``
and the simulated device (or a GPU), comparing with eager. Prints one line per (arch, case):

    forward   torch.export of the model (logits / last hidden state), lowered, run, max abs diff to eager
    generate  decoder LMs: transformers' static-cache recipe (convert_and_export_with_cache) as a
              prefill + decode program, a few greedy tokens compared with eager's
    dynamic   forward exported with a bounded Dim (sequence length; batch for vision models), run at three
              sizes
    batch2    forward at batch 2 and an odd length
    mask      text models with a padding attention_mask input (decoders: left padding)
    eager_attn  forward with transformers' eager attention instead of SDPA
    bf16      the model and program in bf16, judged against fp32 (lowered error vs eager bf16's error)
    long      forward at 150 tokens (conv nets: a 37x37 image); long_gen: generate after a 130-token prompt
    wide      forward of a wider model (hidden 160, head_dim 40, intermediate 344, vocab 1000)
    dyn_gen   generate with a dynamic prompt length (Dim 1..16), prompts of 1, 16, 7 tokens
    fp16      as bf16, in fp16
    dyn2      text models with dynamic batch and length and a padding attention_mask
    int8      forward with the linears weight-only quantized (td.quantize_linears: int8 per row), against
              the quantized model in eager; notes integer bytes the program did not keep
    int4_gen  generate with the linears (and MoE experts) at 4 bits, zero points per group of 16, likewise
    emb_gen   as int4_gen with the embedding tables quantized too (embeddings=True: a tied head on one copy)

    python scripts/arch_sweep.py                       # every architecture, every case
    python scripts/arch_sweep.py --archs llama,gpt2 --cases forward,dynamic --timeout 300

Status: ok / mismatch (max diff) / error (exception type: first line) / skip (the model itself does not
export, or transformers lacks the architecture). ``launches`` is per call (summed over methods for
generate), ``delegated`` the share of compute nodes delegated (the lowest method's, for generate).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import time
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from harness import Logits, greedy_static_cache  # noqa: E402  (tests/harness.py)

TOKENS = 8
ATOL = 1e-4  # relative to max |eager|: fp32 end to end through a few layers


class Timeout(Exception):
    pass


class Skip(Exception):
    """The model itself (not tritondelegate) cannot run this case."""


# ----------------------------------------------------------------------------- models

DEC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)
PLAIN = {k: v for k, v in DEC.items() if k != "num_key_value_heads"}

# name -> (config class, model class, config kwargs)
DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", DEC),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**DEC, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", DEC),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**DEC, "head_dim": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {**DEC, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "decoder_sparse_step": 1}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {**DEC, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**DEC, "head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**DEC, "head_dim": 8, "sliding_window": 4}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**DEC, "head_dim": 8, "sliding_window": 4}),
    "phi": ("PhiConfig", "PhiForCausalLM", {**PLAIN, "partial_rotary_factor": 0.5}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**DEC, "pad_token_id": 0, "eos_token_id": 1}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, bos_token_id=0,
                  eos_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**PLAIN, "rotary_pct": 0.5}),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM",
                dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, n_ctx=64, rotary_dim=4,
                     bos_token_id=0, eos_token_id=0)),
    "cohere": ("CohereConfig", "CohereForCausalLM", {**DEC, "pad_token_id": 0, "bos_token_id": 1,
                                                     "eos_token_id": 2}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {**DEC, "sliding_window": 4, "pad_token_id": 0,
                                                        "bos_token_id": 1, "eos_token_id": 2}),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bos_token_id=0,
                    eos_token_id=0, max_position_embeddings=64, new_decoder_architecture=True, num_kv_heads=2)),
    "bloom": ("BloomConfig", "BloomForCausalLM",
              dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=0,
                 eos_token_id=2)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {**DEC, "partial_rotary_factor": 0.5}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {**DEC, "sliding_window": None}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", DEC),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {**DEC, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**DEC, "pad_token_id": 0, "bos_token_id": 1,
                                                  "eos_token_id": 2}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {**DEC, "pad_token_id": 0, "bos_token_id": 1,
                                                        "eos_token_id": 2}),
    "glm": ("GlmConfig", "GlmForCausalLM", {**DEC, "head_dim": 8, "pad_token_id": 0, "eos_token_id": 1}),
}

# Config variants (not separate architectures): biases, MQA/MHA, explicit head_dim, rope scalings, untied head.
ROPE = {"rope_theta": 10000.0}
VARIANTS = {
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", {**DEC, "attention_bias": True, "mlp_bias": True}),
    "llama_mqa": ("LlamaConfig", "LlamaForCausalLM", {**DEC, "num_key_value_heads": 1}),
    "llama_mha": ("LlamaConfig", "LlamaForCausalLM", {**DEC, "num_key_value_heads": 4,
                                                      "tie_word_embeddings": False}),
    "llama_hd16": ("LlamaConfig", "LlamaForCausalLM", {**DEC, "head_dim": 16}),
    "llama_rope3": ("LlamaConfig", "LlamaForCausalLM",
                    {**DEC, "rope_parameters": {**ROPE, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM",
                   {**DEC, "rope_parameters": {**ROPE, "rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16}}),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                     {**DEC, "rope_parameters": {**ROPE, "rope_type": "linear", "factor": 2.0}}),
    "llama_dynrope": ("LlamaConfig", "LlamaForCausalLM",
                      {**DEC, "rope_parameters": {**ROPE, "rope_type": "dynamic", "factor": 2.0}}),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM",
                      {**DEC, "pad_token_id": 0, "eos_token_id": 1, "original_max_position_embeddings": 16,
                       "rope_parameters": {**ROPE, "rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(4)],
                                           "long_factor": [2.0 + i / 4 for i in range(4)]}}),
    "qwen3_moe_norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       {**DEC, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # more Mixture-of-Experts routers: a shared expert with a sigmoid gate (Qwen2-MoE), sparsemixer
    # (PhiMoE), a router with a bias and sinks in attention (GPT-OSS), group-limited top-k over
    # sigmoid scores with a correction bias and MLA attention (DeepSeek-V3), and no renormalization (OLMoE)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**DEC, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   {**DEC, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {**DEC, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {**DEC, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {**DEC, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                     "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 8, "rope_scaling": None}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**DEC, "num_experts": 4, "num_experts_per_tok": 2}),
    "gemma3_mqa": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                   {**DEC, "head_dim": 16, "sliding_window": 4, "num_key_value_heads": 1,
                    "layer_types": ["sliding_attention", "full_attention"]}),
}
DECODERS.update(VARIANTS)

# More architectures of transformers (2026-12): dense, MoE, complex rotary (Llama 4, DeepSeek-V2), and
# state-space or linear-attention hybrids (Mamba, Jamba, Bamba, Falcon-H1, Qwen3-Next, Kimi-Linear, LFM2:
# forward only, since transformers' static-cache export does not carry their recurrent state). JetMoe
# (its experts split by a data-dependent size: refused at lower, naming the node) and DBRX (torch.export
# fails) are left out.
TOK = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
D = {**DEC, **TOK}
MORE = {
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {**D, "head_dim": 8}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM",
                {**D, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    "hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {**D, "head_dim": 8}),
    "hunyuan_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
                    {**D, "head_dim": 8, "num_experts": 4, "moe_topk": 2}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {**D, "head_dim": 8}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     {**D, "moe_intermediate_size": 32, "moe_k": 2, "moe_num_experts": 4,
                      "moe_num_shared_experts": 1, "moe_layer_start_index": 1}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {**D, "head_dim": 8}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", D),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", D),
    "dots1": ("Dots1Config", "Dots1ForCausalLM",
              {**D, "moe_intermediate_size": 32, "n_shared_experts": 1, "n_routed_experts": 4,
               "num_experts_per_tok": 2, "first_k_dense_replace": 1, "sliding_window": None}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {**D, "head_dim": 8}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {**D, "head_dim": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2, "n_shared_experts": 1,
                  "n_routed_experts": 4, "first_k_dense_replace": 1, "use_qk_norm": True}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {**D, "head_dim": 8}),
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", D),
    "doge": ("DogeConfig", "DogeForCausalLM", {**D, "keep_window_size": 4}),
    "doge_moe": ("DogeConfig", "DogeForCausalLM",
                 {**D, "keep_window_size": 4, "is_moe": True, "num_experts": 16, "num_experts_per_tok": 4}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              {**D, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", {**D, "num_experts": 4, "num_experts_per_tok": 2}),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM",
                {**D, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 4,
                 "layer_types": ["full_attention", "linear_attention"]}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM",
                  {**D, "head_dim": 8, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               {**D, "intermediate_size_mlp": 64, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": 4}),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM",  # no sparsity: dynamo refuses its torch.distributions
                {**D, "head_dim": 8, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
                 "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8, "laurel_rank": 4,
                 "num_kv_shared_layers": 0, "activation_sparsity_pattern": [0.0, 0.0]}),
    "vault_gemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM",
                    {**D, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4,
                     "layer_types": ["sliding_attention", "full_attention"]}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    {**D, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                     "v_head_dim": 8}),
    "jamba": ("JambaConfig", "JambaForCausalLM",
              {**D, "num_experts": 4, "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1,
               "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 4, "mamba_d_conv": 4,
               "mamba_expand": 2, "mamba_dt_rank": 4, "use_mamba_kernels": False}),
    "bamba": ("BambaConfig", "BambaForCausalLM",
              {**D, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_n_groups": 1, "mamba_d_state": 8,
               "mamba_d_conv": 4, "mamba_chunk_size": 4}),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
             {**D, "layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False}),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                 {**D, "moe_intermediate_size": 32, "num_dense_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
                  "layer_types": ["conv", "full_attention"]}),
    "mamba": ("MambaConfig", "MambaForCausalLM",
              dict(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
                   time_step_rank=4, **TOK)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM",
               dict(num_heads=4, head_dim=16, vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                    n_groups=1, chunk_size=4, expand=2, conv_kernel=4, **TOK)),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM",
                     dict(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
                          time_step_rank=4, **TOK)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  {**D, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1,
                   "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 4}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {**D, "head_dim": 8, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
                    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts_per_tok": 2,
                    "num_experts": 4, "layer_types": ["linear_attention", "full_attention"]}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                {**D, "head_dim": 8, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
                 "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                 "layer_types": ["linear_attention", "full_attention"]}),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", {**PLAIN, **TOK}),
    "mpt": ("MptConfig", "MptForCausalLM",
            dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, vocab_size=64, use_cache=True,
                 **TOK)),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM",
                dict(vocab_size=64, max_position_embeddings=64, hidden_size=32, num_layers=2, num_heads=4,
                     intermediate_size=64, attention_types=[[["global", "local"], 1]], window_size=4, **TOK)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    dict(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64, multi_query=True,
                         **TOK)),
    "xglm": ("XGLMConfig", "XGLMForCausalLM",
             dict(vocab_size=64, max_position_embeddings=64, d_model=32, ffn_dim=64, num_layers=2, attention_heads=4,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2)),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM",
               dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2)),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM",
                 {**D, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8,
                  "qk_rope_head_dim": 4, "v_head_dim": 8, "dim_model_base": 32}),
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", D),
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM",
                        dict(num_hidden_layers=2, vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_attention_heads=4, num_key_value_heads=2, lru_width=32, attention_window_size=4,
                             conv1d_width=4, block_types=["recurrent", "attention"], **TOK)),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM",
               dict(vocab_size=64, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
                    layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                    mamba_ngroups=1, n_mamba_heads=4, chunk_size=4, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=4, adapter_rank=4, use_mamba_kernels=False, **TOK)),
    "granitemoe_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                          {**D, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32,
                           "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_n_groups": 1,
                           "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 4}),
    "granitemoe_shared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                          {**D, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32}),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM",
                    {**D, "head_dim": 8, "sliding_window": 4, "num_experts": 4, "num_experts_per_tok": 2,
                     "num_shared_experts": 1, "sliding_window_pattern": 2}),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM",
                   {**D, "head_dim": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2, "n_shared_experts": 1,
                    "n_routed_experts": 4}),
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", D),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM",
                 {**D, "num_key_value_heads": 4, "moe_intermediate_size": 32, "n_shared_experts": 1,
                  "n_routed_experts": 4, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                  "v_head_dim": 8, "qk_nope_head_dim": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1}),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    {**D, "num_key_value_heads": 4, "moe_intermediate_size": 32, "n_shared_experts": 1,
                     "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 8,
                     "qk_nope_head_dim": 8, "num_experts_per_tok": 2, "num_local_experts": 4, "linear_head_dim": 8,
                     "linear_num_heads": 4, "linear_conv_kernel_dim": 4,
                     "layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"]}),
}
DECODERS.update(MORE)

ENC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=64)
# name -> (config class, model class, config kwargs, input kind)
ENCODERS = {
    "bert": ("BertConfig", "BertModel", ENC, "ids"),
    "roberta": ("RobertaConfig", "RobertaModel", {**ENC, "pad_token_id": 1}, "ids"),
    "distilbert": ("DistilBertConfig", "DistilBertModel",
                   dict(vocab_size=64, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64),
                   "ids"),
    "t5_encoder": ("T5Config", "T5EncoderModel",
                   dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=16), "ids"),
    "vit": ("ViTConfig", "ViTModel", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, image_size=16, patch_size=4, num_channels=3),
            "image"),
    "convnext": ("ConvNextConfig", "ConvNextModel",
                 dict(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=2, image_size=16),
                 "image"),
    "resnet": ("ResNetConfig", "ResNetModel",
               dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
               "image"),
    "mobilenet_v2": ("MobileNetV2Config", "MobileNetV2Model",
                     dict(num_channels=3, image_size=16, depth_multiplier=0.25, min_depth=4), "image"),
    "whisper_encoder": ("WhisperConfig", "WhisperModel",
                        dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                             max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2, decoder_start_token_id=1), "audio"),
}

# More encoders, vision and audio models of transformers (2026-12): text encoders, vision backbones at
# the input size each needs (IMAGE_SHAPE), raw audio (kind "wave"), spectrograms ("ast"), and the
# encoders of sequence-to-sequence models (GET_ENCODER: run as model.get_encoder()).
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
           patch_size=4, num_channels=3)
S2S = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
W2V = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
           num_conv_pos_embedding_groups=4, feat_extract_norm="group", do_stable_layer_norm=False)

TEXT = {
    "albert": ("AlbertConfig", "AlbertModel", {**ENC, "embedding_size": 16, **TOK}, "ids"),
    "electra": ("ElectraConfig", "ElectraModel", {**ENC, "embedding_size": 16}, "ids"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model",
                   {**ENC, "relative_attention": True, "position_buckets": 8, "max_relative_positions": 16,
                    "pos_att_type": ["p2c", "c2p"], "position_biased_input": False}, "ids"),
    "mpnet": ("MPNetConfig", "MPNetModel", {**ENC, "relative_attention_num_buckets": 32}, "ids"),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaModel", {**ENC, "pad_token_id": 1}, "ids"),
    "camembert": ("CamembertConfig", "CamembertModel", {**ENC, "pad_token_id": 1}, "ids"),
    "mobilebert": ("MobileBertConfig", "MobileBertModel",
                   {**ENC, "embedding_size": 16, "intra_bottleneck_size": 16, "true_hidden_size": 16,
                    "num_feedforward_networks": 2, "pad_token_id": 0}, "ids"),
    "convbert": ("ConvBertConfig", "ConvBertModel",
                 {**ENC, "embedding_size": 32, "head_ratio": 2, "conv_kernel_size": 3, "num_groups": 1,
                  **TOK}, "ids"),
    "squeezebert": ("SqueezeBertConfig", "SqueezeBertModel",
                    {**ENC, "embedding_size": 32, "q_groups": 4, "k_groups": 4, "v_groups": 4,
                     "post_attention_groups": 1, "intermediate_groups": 4, "output_groups": 4, "pad_token_id": 0},
                    "ids"),
    "funnel": ("FunnelConfig", "FunnelModel",
               dict(vocab_size=64, block_sizes=[1, 1], num_decoder_layers=1, d_model=32, n_head=4, d_head=8,
                    d_inner=64, max_position_embeddings=64), "ids"),
    "roformer": ("RoFormerConfig", "RoFormerModel", {**ENC, "embedding_size": 32, "pad_token_id": 0}, "ids"),
    # Nystromformer's landmark path reshapes by config.segment_means_seq_len (the padded length, fixed);
    # num_landmarks == segment_means_seq_len selects its exact-softmax path, the only one that takes any length
    "nystromformer": ("NystromformerConfig", "NystromformerModel",
                      {**ENC, "num_landmarks": 64, "segment_means_seq_len": 64, "conv_kernel_size": 3, **TOK},
                      "ids"),
    "modernbert": ("ModernBertConfig", "ModernBertModel",
                   dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, global_attn_every_n_layers=2,
                        local_attention=4, pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=2,
                        sep_token_id=1), "ids"),
    "ernie": ("ErnieConfig", "ErnieModel", ENC, "ids"),
    "megatron_bert": ("MegatronBertConfig", "MegatronBertModel", ENC, "ids"),
    "data2vec_text": ("Data2VecTextConfig", "Data2VecTextModel", {**ENC, "pad_token_id": 1}, "ids"),
    "xlm_roberta_xl": ("XLMRobertaXLConfig", "XLMRobertaXLModel", {**ENC, "pad_token_id": 1}, "ids"),
    "layoutlm": ("LayoutLMConfig", "LayoutLMModel", {**ENC, "max_2d_position_embeddings": 64}, "ids"),
    "canine": ("CanineConfig", "CanineModel",
               dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=64, downsampling_rate=2, num_hash_functions=2, num_hash_buckets=64,
                    local_transformer_stride=4, upsampling_kernel_size=3), "ids"),
    "clip_text": ("CLIPTextConfig", "CLIPTextModel", {**ENC, **TOK}, "ids"),
    "siglip_text": ("SiglipTextConfig", "SiglipTextModel", {**ENC, **TOK}, "ids"),
}

VISION = {
    "swin": ("SwinConfig", "SwinModel",
             dict(image_size=32, patch_size=2, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                  window_size=4, mlp_ratio=2.0), "image"),
    "swinv2": ("Swinv2Config", "Swinv2Model",
               dict(image_size=32, patch_size=2, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                    window_size=4, mlp_ratio=2.0), "image"),
    "deit": ("DeiTConfig", "DeiTModel", VIT, "image"),
    "beit": ("BeitConfig", "BeitModel", {**VIT, "vocab_size": 64, "use_relative_position_bias": True}, "image"),
    "dinov2": ("Dinov2Config", "Dinov2Model", {**{k: v for k, v in VIT.items() if k != "intermediate_size"},
                                               "mlp_ratio": 2}, "image"),
    "dinov2_reg": ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel",
                   {**{k: v for k, v in VIT.items() if k != "intermediate_size"}, "mlp_ratio": 2,
                    "num_register_tokens": 2}, "image"),
    "data2vec_vision": ("Data2VecVisionConfig", "Data2VecVisionModel",
                        {**VIT, "use_relative_position_bias": True}, "image"),
    "segformer": ("SegformerConfig", "SegformerModel",
                  dict(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                       patch_sizes=[3, 3], strides=[2, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                       decoder_hidden_size=32), "image"),
    "poolformer": ("PoolFormerConfig", "PoolFormerModel",
                   dict(num_channels=3, num_encoder_blocks=2, depths=[1, 1], hidden_sizes=[16, 32],
                        patch_sizes=[3, 3], strides=[2, 2], padding=[1, 1], pool_size=3, mlp_ratio=2.0), "image"),
    "efficientnet": ("EfficientNetConfig", "EfficientNetModel",
                     dict(image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320,
                          kernel_sizes=[3, 5], in_channels=[32, 16], out_channels=[16, 24], strides=[1, 2],
                          num_block_repeats=[1, 2], expand_ratios=[1, 6], depthwise_padding=[]), "image"),
    "regnet": ("RegNetConfig", "RegNetModel",
               dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
                    layer_type="y"), "image"),
    "levit": ("LevitConfig", "LevitModel",
              dict(image_size=64, num_channels=3, patch_size=16, hidden_sizes=[16, 32], num_attention_heads=[2, 4],
                   depths=[1, 1], key_dim=[8, 8], mlp_ratio=[2, 2], attention_ratio=[2, 2],
                   down_ops=[["Subsample", 8, 2, 4, 2, 2]]), "image"),
    "mobilevit": ("MobileViTConfig", "MobileViTModel",
                  dict(num_channels=3, image_size=64, patch_size=2, hidden_sizes=[16, 24, 32],
                       neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_attention_heads=4, mlp_ratio=2.0,
                       expand_ratio=2.0), "image"),
    "mobilevitv2": ("MobileViTV2Config", "MobileViTV2Model",
                    dict(num_channels=3, image_size=64, width_multiplier=0.25, n_attn_blocks=[1, 1, 1]), "image"),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2Model",
                   dict(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=2,
                        image_size=16), "image"),
    "focalnet": ("FocalNetConfig", "FocalNetModel",
                 dict(image_size=32, patch_size=2, embed_dim=16, hidden_sizes=[16, 32], depths=[1, 1],
                      focal_levels=[2, 2], focal_windows=[3, 3], mlp_ratio=2.0, drop_path_rate=0.0), "image"),
    "pvt_v2": ("PvtV2Config", "PvtV2Model",
               dict(image_size=32, num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                    hidden_sizes=[16, 32], patch_sizes=[3, 3], strides=[2, 2], num_attention_heads=[1, 2],
                    mlp_ratios=[2, 2]), "image"),
    "hiera": ("HieraConfig", "HieraModel",
              dict(embed_dim=16, image_size=[64, 64], depths=[1, 1], num_heads=[1, 2], mlp_ratio=2.0,
                   num_query_pool=1, masked_unit_attention=[True, False]), "image"),
    "vit_msn": ("ViTMSNConfig", "ViTMSNModel", VIT, "image"),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", VIT, "image"),
    "siglip_vision": ("SiglipVisionConfig", "SiglipVisionModel", VIT, "image"),
    "dinov3_vit": ("DINOv3ViTConfig", "DINOv3ViTModel",
                   dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        image_size=16, patch_size=4, num_register_tokens=2), "image"),
    "dinov3_convnext": ("DINOv3ConvNextConfig", "DINOv3ConvNextModel",
                        dict(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], image_size=16), "image"),
    "bit": ("BitConfig", "BitModel",
            dict(num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4,
                 layer_type="preactivation"), "image"),
}

AUDIO = {
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model", W2V, "wave"),
    "hubert": ("HubertConfig", "HubertModel", W2V, "wave"),
    "wavlm": ("WavLMConfig", "WavLMModel", {**W2V, "num_buckets": 8, "max_bucket_distance": 16}, "wave"),
    "data2vec_audio": ("Data2VecAudioConfig", "Data2VecAudioModel",
                       {**{k: v for k, v in W2V.items() if k not in ("num_conv_pos_embeddings",
                                                                      "feat_extract_norm",
                                                                      "do_stable_layer_norm")},
                        "conv_pos_kernel_size": 5, "num_conv_pos_embeddings": 2}, "wave"),
    "ast": ("ASTConfig", "ASTModel",
            dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, patch_size=4,
                 frequency_stride=4, time_stride=4, max_length=16, num_mel_bins=16), "ast"),
}

SEQ2SEQ = {
    "bart_encoder": ("BartConfig", "BartModel",
                     {**S2S, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2},
                     "ids"),
    "mbart_encoder": ("MBartConfig", "MBartModel",
                      {**S2S, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                       "decoder_start_token_id": 2}, "ids"),
    "pegasus_encoder": ("PegasusConfig", "PegasusModel",
                        {**S2S, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}, "ids"),
    "marian_encoder": ("MarianConfig", "MarianModel",
                       {**S2S, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}, "ids"),
    "m2m100_encoder": ("M2M100Config", "M2M100Model",
                       {**S2S, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                        "decoder_start_token_id": 2}, "ids"),
}

# Families probed (2026-12), run through ``Call`` (kind "probe": PROBE_IO names each model's keyword inputs,
# how to make them at a batch size, and how many outputs are compared; batch is the dynamic dim):
#   dense prediction on ViT / CNN backbones (depth: DPT, GLPN, Depth Anything, ZoeDepth; segmentation:
#   UperNet on ConvNeXt and Swin, Segformer / BEiT / Data2VecVision / MobileViT heads, MaskFormer,
#   Mask2Former, CLIPSeg; SAM's vision encoder and the whole SAM with one point prompt),
#   detection (DETR and Conditional DETR on a tiny ResNet, YOLOS, OWL-ViT, OWLv2, Deformable DETR, RT-DETR,
#   Grounding DINO), audio (SpeechT5's HiFi-GAN vocoder, EnCodec, DAC, UnivNet, Wav2Vec2 with a CTC head,
#   Whisper's decoder), video (VideoMAE, ViViT, TimeSformer), time series (PatchTST, PatchTSMixer, Informer
#   with full attention, Autoformer, TimesFM), and Perceiver (text), FNet (FFT), Pix2Struct's vision encoder.
# Skips: EnCodec does not export (its conv padding is computed from tensors: a data-dependent guard, with
# either pad mode); at a dynamic batch ZoeDepth, CLIPSeg, RT-DETR and TimesFM specialize the batch (export's
# "Constraints violated"). MaskFormer and Mask2Former build their losses with scipy (pip install scipy).
RESNET = dict(model_type="resnet", num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
              layer_type="basic")
TINY_DETR = dict(d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=8)
CNX4 = dict(model_type="convnext", num_channels=3, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1],
            out_features=["stage1", "stage2", "stage3", "stage4"])
SWIN4 = dict(model_type="swin", image_size=32, patch_size=2, embed_dim=8, depths=[1, 1, 1, 1],
             num_heads=[1, 1, 2, 2], window_size=2, mlp_ratio=2.0,
             out_features=["stage1", "stage2", "stage3", "stage4"])
TEXT_CFG = dict(**TOK, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16)
VIS_CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
               patch_size=8)
VIT4 = {**VIT, "num_hidden_layers": 4, "image_size": 32}
SEG = VISION["segformer"][2]
PROBE = {
    # dense prediction
    "dpt": ("DPTConfig", "DPTForDepthEstimation",
            {**VIT4, "backbone_out_indices": [0, 1, 2, 3], "neck_hidden_sizes": [8, 16, 32, 32],
             "fusion_hidden_size": 16, "use_auxiliary_head": False}, "probe"),
    "glpn": ("GLPNConfig", "GLPNForDepthEstimation",
             dict(num_encoder_blocks=4, depths=[1, 1, 1, 1], sr_ratios=[4, 2, 1, 1], hidden_sizes=[8, 16, 16, 32],
                  num_attention_heads=[1, 1, 2, 2], mlp_ratios=[2, 2, 2, 2], decoder_hidden_size=16,
                  drop_path_rate=0.0), "probe"),
    "depth_anything": ("DepthAnythingConfig", "DepthAnythingForDepthEstimation",
                       dict(backbone_config=dict(model_type="dinov2", hidden_size=32, num_hidden_layers=4,
                                                 num_attention_heads=4, mlp_ratio=2, image_size=32, patch_size=4,
                                                 out_indices=[1, 2, 3, 4], reshape_hidden_states=False),
                            patch_size=4, reassemble_hidden_size=32, neck_hidden_sizes=[8, 16, 32, 32],
                            fusion_hidden_size=16, head_hidden_size=8), "probe"),
    "zoedepth": ("ZoeDepthConfig", "ZoeDepthForDepthEstimation",
                 dict(backbone_config=dict(model_type="beit", hidden_size=32, num_hidden_layers=4,
                                           num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=4,
                                           out_indices=[1, 2, 3, 4], use_relative_position_bias=True,
                                           reshape_hidden_states=False),
                      neck_hidden_sizes=[8, 16, 32, 32], fusion_hidden_size=16, bottleneck_features=16,
                      num_relative_features=8, num_attractors=[4, 2, 2, 1], bin_embedding_dim=16,
                      bin_configurations=[dict(n_bins=8, min_depth=0.001, max_depth=10.0, name="nyu")],
                      num_patch_transformer_layers=1, patch_transformer_hidden_size=16,
                      patch_transformer_intermediate_size=32, patch_transformer_num_attention_heads=2), "probe"),
    "upernet_convnext": ("UperNetConfig", "UperNetForSemanticSegmentation",
                         dict(backbone_config=CNX4, hidden_size=16, use_auxiliary_head=False), "probe"),
    "upernet_swin": ("UperNetConfig", "UperNetForSemanticSegmentation",
                     dict(backbone_config=SWIN4, hidden_size=16, use_auxiliary_head=False), "probe"),
    "segformer_seg": ("SegformerConfig", "SegformerForSemanticSegmentation", SEG, "probe"),
    "beit_seg": ("BeitConfig", "BeitForSemanticSegmentation",
                 {**VIT4, "vocab_size": 64, "use_relative_position_bias": True, "out_indices": [1, 2, 3, 4],
                  "use_auxiliary_head": False, "pool_scales": [1, 2]}, "probe"),
    "data2vec_vision_seg": ("Data2VecVisionConfig", "Data2VecVisionForSemanticSegmentation",
                            {**VIT4, "use_relative_position_bias": True, "out_indices": [1, 2, 3, 4],
                             "use_auxiliary_head": False, "pool_scales": [1, 2]}, "probe"),
    "mobilevit_seg": ("MobileViTConfig", "MobileViTForSemanticSegmentation",
                      {**VISION["mobilevit"][2], "aspp_out_channels": 16, "atrous_rates": [2, 4, 6]}, "probe"),
    "maskformer": ("MaskFormerConfig", "MaskFormerForInstanceSegmentation",
                   dict(backbone_config=SWIN4, fpn_feature_size=32, mask_feature_size=32,
                        decoder_config=dict(model_type="detr", **TINY_DETR)), "probe"),
    "mask2former": ("Mask2FormerConfig", "Mask2FormerForUniversalSegmentation",
                    dict(backbone_config=SWIN4, feature_size=32, mask_feature_size=32, hidden_dim=32,
                         encoder_feedforward_dim=32, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
                         dim_feedforward=32, num_queries=8), "probe"),  # use_auxiliary_loss: its forward needs it
    "clipseg": ("CLIPSegConfig", "CLIPSegForImageSegmentation",
                dict(text_config=TEXT_CFG, vision_config=VIS_CFG, projection_dim=32, extract_layers=[0, 1],
                     reduce_dim=16, decoder_num_attention_heads=2, decoder_intermediate_size=32), "probe"),
    "sam_vision": ("SamVisionConfig", "SamVisionModel",
                   dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4,
                        image_size=64, patch_size=8, window_size=4, global_attn_indexes=[1], mlp_dim=64), "probe"),
    "sam": ("SamConfig", "SamModel",
            dict(vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=64, patch_size=8, window_size=4, global_attn_indexes=[1],
                                    mlp_dim=64, num_pos_feats=8),
                 prompt_encoder_config=dict(hidden_size=16, image_size=64, patch_size=8, mask_input_channels=4),
                 mask_decoder_config=dict(hidden_size=16, mlp_dim=32, num_hidden_layers=2, num_attention_heads=2,
                                          iou_head_hidden_dim=16)), "probe"),
    # detection
    "detr": ("DetrConfig", "DetrForObjectDetection",
             {**TINY_DETR, "use_timm_backbone": False, "use_pretrained_backbone": False, "backbone": None,
              "backbone_config": {**RESNET, "out_features": ["stage2"]}}, "probe"),
    "conditional_detr": ("ConditionalDetrConfig", "ConditionalDetrForObjectDetection",
                         {**TINY_DETR, "use_timm_backbone": False, "use_pretrained_backbone": False,
                          "backbone": None, "backbone_config": {**RESNET, "out_features": ["stage2"]}}, "probe"),
    "deformable_detr": ("DeformableDetrConfig", "DeformableDetrForObjectDetection",
                        {**TINY_DETR, "backbone_config": {**RESNET, "out_features": ["stage1", "stage2"]},
                         "num_feature_levels": 2, "encoder_n_points": 2, "decoder_n_points": 2,
                         "disable_custom_kernels": True}, "probe"),
    "rt_detr": ("RTDetrConfig", "RTDetrForObjectDetection",
                dict(backbone_config=dict(model_type="rt_detr_resnet", embedding_size=8, hidden_sizes=[8, 16, 32, 64],
                                          depths=[1, 1, 1, 1], layer_type="basic",
                                          out_features=["stage2", "stage3", "stage4"]),
                     encoder_hidden_dim=16, encoder_in_channels=[16, 32, 64], encoder_ffn_dim=32,
                     encoder_attention_heads=2, d_model=16, num_queries=8, decoder_in_channels=[16, 16, 16],
                     decoder_ffn_dim=32, decoder_n_points=2, decoder_layers=1, decoder_attention_heads=2,
                     num_denoising=0, anchor_image_size=None), "probe"),
    "grounding_dino": ("GroundingDinoConfig", "GroundingDinoForObjectDetection",
                       {**TINY_DETR, "backbone_config": {**SWIN4, "out_features": ["stage2", "stage3", "stage4"]},
                        "text_config": dict(model_type="bert", **TEXT_CFG), "num_feature_levels": 3,
                        "encoder_n_points": 2, "decoder_n_points": 2, "max_text_len": 16,
                        "disable_custom_kernels": True}, "probe"),
    "yolos": ("YolosConfig", "YolosForObjectDetection",
              {**VIT, "image_size": [32, 32], "num_detection_tokens": 4}, "probe"),
    "owlvit": ("OwlViTConfig", "OwlViTForObjectDetection",
               dict(text_config=TEXT_CFG, vision_config=VIS_CFG, projection_dim=32), "probe"),
    "owlv2": ("Owlv2Config", "Owlv2ForObjectDetection",
              dict(text_config=TEXT_CFG, vision_config=VIS_CFG, projection_dim=32), "probe"),
    # audio
    "hifigan": ("SpeechT5HifiGanConfig", "SpeechT5HifiGan",
                dict(model_in_dim=8, upsample_initial_channel=16, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
                     resblock_kernel_sizes=[3, 5], resblock_dilation_sizes=[[1, 3], [1, 3]]), "probe"),
    "encodec": ("EncodecConfig", "EncodecModel",
                dict(target_bandwidths=[1.5], hidden_size=16, num_filters=4, upsampling_ratios=[4, 2],
                     num_lstm_layers=1, codebook_size=16, sampling_rate=800, pad_mode="constant"), "probe"),
    "dac": ("DacConfig", "DacModel",
            dict(encoder_hidden_size=4, downsampling_ratios=[2, 4], decoder_hidden_size=16, n_codebooks=2,
                 codebook_size=16, codebook_dim=4), "probe"),
    "univnet": ("UnivNetConfig", "UnivNetModel",
                dict(model_in_channels=8, model_hidden_channels=8, num_mel_bins=8, resblock_kernel_sizes=[3],
                     resblock_stride_sizes=[4], resblock_dilation_sizes=[[1, 3]], kernel_predictor_num_blocks=1,
                     kernel_predictor_hidden_channels=8), "probe"),
    "wav2vec2_ctc": ("Wav2Vec2Config", "Wav2Vec2ForCTC", W2V, "wave"),
    "whisper_decoder": ("WhisperConfig", "WhisperForConditionalGeneration", ENCODERS["whisper_encoder"][2],
                        "probe"),
    # video
    "videomae": ("VideoMAEConfig", "VideoMAEModel", {**VIT, "num_frames": 4, "tubelet_size": 2}, "image"),
    "vivit": ("VivitConfig", "VivitModel", {**VIT, "num_frames": 4, "tubelet_size": [2, 4, 4]}, "image"),
    "timesformer": ("TimesformerConfig", "TimesformerModel", {**VIT, "num_frames": 4}, "image"),
    # time series
    "patchtst": ("PatchTSTConfig", "PatchTSTForPrediction",
                 dict(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, prediction_length=8,
                      d_model=16, num_attention_heads=2, num_hidden_layers=2, ffn_dim=32), "probe"),
    "patchtsmixer": ("PatchTSMixerConfig", "PatchTSMixerForPrediction",
                     dict(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8,
                          prediction_length=8, d_model=16, num_layers=2), "probe"),
    "informer": ("InformerConfig", "InformerModel",
                 dict(prediction_length=4, context_length=8, lags_sequence=[1, 2], num_time_features=1, d_model=16,
                      encoder_layers=2, decoder_layers=1, attention_type="full", distil=False), "probe"),
    "autoformer": ("AutoformerConfig", "AutoformerModel",
                   dict(prediction_length=4, context_length=8, lags_sequence=[1, 2], num_time_features=1, d_model=16,
                        encoder_layers=2, decoder_layers=1), "probe"),
    "timesfm": ("TimesFmConfig", "TimesFmModelForPrediction",
                dict(patch_length=8, context_length=32, horizon_length=8, num_hidden_layers=2, hidden_size=32,
                     intermediate_size=64, head_dim=8, num_attention_heads=4), "probe"),
    # others
    "perceiver": ("PerceiverConfig", "PerceiverForMaskedLM",
                  dict(num_latents=8, d_latents=32, d_model=32, num_blocks=1, num_self_attends_per_block=1,
                       num_self_attention_heads=4, num_cross_attention_heads=4, vocab_size=64,
                       max_position_embeddings=64), "probe"),
    "fnet": ("FNetConfig", "FNetModel", {**ENC, "use_tpu_fourier_optimizations": False}, "ids"),
    "pix2struct_vision": ("Pix2StructVisionConfig", "Pix2StructVisionModel",
                          dict(hidden_size=32, patch_embed_hidden_size=48, d_ff=64, d_kv=8, num_hidden_layers=2,
                               num_attention_heads=4, seq_len=16), "probe"),
}


def _img(shape):
    return lambda c, b, g: (torch.randn(b, *shape, generator=g),)


def _ids_img(c, b, g, size=32):
    return (torch.randint(0, 64, (b, 5), generator=g), torch.randn(b, 3, size, size, generator=g))


def _series(c, b, g):  # Informer / Autoformer: past window (context + largest lag), a time feature, a future
    past, n = c.context_length + max(c.lags_sequence), c.prediction_length
    t = torch.arange(past + n, dtype=torch.float32)[None, :, None].expand(b, -1, -1) / 10
    return (torch.randn(b, past, generator=g), t[:, :past].contiguous(), torch.ones(b, past),
            t[:, past:].contiguous())


def _patches(c, b, g, rows=4, cols=4):  # Pix2Struct: (row, col) ids then 3 x 4 x 4 pixels per patch
    r, k = torch.meshgrid(torch.arange(1, rows + 1.0), torch.arange(1, cols + 1.0), indexing="ij")
    ids = torch.stack([r.flatten(), k.flatten()], -1)[None].expand(b, -1, -1)
    return (torch.cat([ids, torch.randn(b, rows * cols, c.patch_embed_hidden_size, generator=g)], -1),)


# name -> (input keywords, (config, batch, generator) -> inputs, outputs compared, keyword constants, dict outputs)
PROBE_IO = {
    **{k: (["pixel_values"], _img((3, 32, 32)), 1, {}, True)
       for k in ("dpt", "glpn", "depth_anything", "zoedepth", "upernet_convnext", "upernet_swin", "segformer_seg",
                 "beit_seg", "data2vec_vision_seg")},
    "mobilevit_seg": (["pixel_values"], _img((3, 64, 64)), 1, {}, True),
    "maskformer": (["pixel_values"], _img((3, 32, 32)), 2, {}, True),
    "mask2former": (["pixel_values"], _img((3, 32, 32)), 2, {}, True),
    "clipseg": (["input_ids", "pixel_values"], _ids_img, 1, {}, True),
    "sam_vision": (["pixel_values"], _img((3, 64, 64)), 1, {}, True),
    "sam": (["pixel_values", "input_points"],
            lambda c, b, g: (torch.randn(b, 3, 64, 64, generator=g), 64 * torch.rand(b, 1, 1, 2, generator=g)), 2,
            {"multimask_output": False}, True),
    **{k: (["pixel_values"], _img((3, 32, 32)), 2, {}, True)
       for k in ("detr", "conditional_detr", "deformable_detr", "rt_detr", "yolos")},
    "grounding_dino": (["input_ids", "pixel_values"], _ids_img, 2, {}, True),
    "owlvit": (["input_ids", "pixel_values"], _ids_img, 2, {}, True),
    "owlv2": (["input_ids", "pixel_values"], _ids_img, 2, {}, True),
    "hifigan": (["spectrogram"], lambda c, b, g: (torch.randn(b, 10, c.model_in_dim, generator=g),), 1, {}, False),
    "encodec": (["input_values"], lambda c, b, g: (torch.randn(b, 1, 64, generator=g),), 2, {}, True),
    "dac": (["input_values"], lambda c, b, g: (torch.randn(b, 1, 64, generator=g),), 5, {}, True),
    "univnet": (["input_features", "noise_sequence"],
                lambda c, b, g: (torch.randn(b, 10, c.num_mel_bins, generator=g),
                                 torch.randn(b, 10, c.model_in_channels, generator=g)), 1, {}, True),
    "whisper_decoder": (["input_features", "decoder_input_ids"],
                        lambda c, b, g: (torch.randn(b, c.num_mel_bins, 2 * c.max_source_positions, generator=g),
                                         torch.randint(3, 64, (b, 5), generator=g)), 1, {"use_cache": False}, True),
    "patchtst": (["past_values"], lambda c, b, g: (torch.randn(b, 32, 3, generator=g),), 1, {}, True),
    "patchtsmixer": (["past_values"], lambda c, b, g: (torch.randn(b, 32, 3, generator=g),), 1, {}, True),
    "informer": (["past_values", "past_time_features", "past_observed_mask", "future_time_features"], _series, 1,
                 {"use_cache": False}, True),
    "autoformer": (["past_values", "past_time_features", "past_observed_mask", "future_time_features"], _series, 1,
                   {"use_cache": False}, True),
    "timesfm": (["past_values"], lambda c, b, g: (torch.randn(b, 32, generator=g),), 2, {}, True),
    "perceiver": (["inputs"], lambda c, b, g: (torch.randint(0, 64, (b, 7), generator=g),), 1, {}, True),
    "pix2struct_vision": (["flattened_patches"], _patches, 1, {}, True),
}

ENCODERS.update({**TEXT, **VISION, **AUDIO, **SEQ2SEQ, **PROBE})
GET_ENCODER = set(SEQ2SEQ) | {"whisper_encoder"}
IMAGE_SHAPE = {"swin": (3, 32, 32), "swinv2": (3, 32, 32), "segformer": (3, 32, 32), "poolformer": (3, 32, 32),
               "efficientnet": (3, 32, 32), "regnet": (3, 32, 32), "mobilevit": (3, 64, 64),
               "mobilevitv2": (3, 64, 64), "focalnet": (3, 32, 32), "pvt_v2": (3, 32, 32), "hiera": (3, 64, 64),
               "bit": (3, 32, 32), "levit": (3, 64, 64),
               "videomae": (4, 3, 16, 16), "vivit": (4, 3, 16, 16), "timesformer": (4, 3, 16, 16)}
# (channels, height, width), or (frames, channels, height, width) for video; 3 x 16 x 16 otherwise
WAVE_LEN = 400  # audio samples: 79 frames after the stride-5 conv, 39 after the stride-2 one
ARCHS = list(DECODERS) + list(ENCODERS)
CASES = ("forward", "generate", "dynamic", "batch2", "mask", "eager_attn", "bf16", "long", "long_gen", "wide", "dyn_gen", "fp16", "dyn2",
         "int8", "int4_gen", "emb_gen")


class First(torch.nn.Module):
    """An encoder / vision model as its input -> first output (last hidden state)."""

    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(**{self.key: x}, return_dict=False)[0]


class Call(torch.nn.Module):
    """A model as positional tensors (its keywords ``keys``, with constants ``fixed``) -> its first ``n``
    outputs (``dict_out=False``: a model that returns a tensor and takes no ``return_dict``)."""

    def __init__(self, model, keys, n=1, fixed=None, dict_out=True):
        super().__init__()
        self.model, self.keys, self.n, self.fixed, self.dict_out = model, keys, n, fixed or {}, dict_out

    def forward(self, *xs):
        kw = {**dict(zip(self.keys, xs)), **self.fixed}
        out = self.model(**kw, return_dict=False) if self.dict_out else self.model(**kw)
        if isinstance(out, torch.Tensor):
            return out
        return out[0] if self.n == 1 else tuple(out[:self.n])


class FreshCaches(First):
    """LeViT's attention keeps a dict of bias tables filled by its first eval call (which ``.to(dtype)``
    does not convert): emptied before each call, so the bias gather is in the program."""

    def forward(self, x):
        for m in self.model.modules():
            if hasattr(m, "attention_bias_cache"):
                m.attention_bias_cache = {}
        return super().forward(x)


WIDE = {"hidden_size": 160, "n_embd": 160, "dim": 160, "d_model": 160, "intermediate_size": 344, "hidden_dim": 344,
        "d_ff": 344, "ffn_dim": 344, "encoder_ffn_dim": 344, "moe_intermediate_size": 88, "head_dim": 40, "d_kv": 40,
        "word_embed_proj_dim": 160, "vocab_size": 1000}
LONG = {"max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256}


def _overrides(case, kwargs):
    """Config changes for the cases that need a bigger model: wide (odd large sizes), long (positions)."""
    table = {"wide": WIDE, "long": LONG, "long_gen": LONG}.get(case, {})
    over = {k: v for k, v in table.items() if k in kwargs}
    if case == "wide" and "hidden_size" not in kwargs and "hidden_sizes" not in kwargs:
        over.setdefault("hidden_size", 160)  # through the config's attribute_map (n_embd, d_model, ...)
    return {**kwargs, **over}


def _build(name, case="forward"):
    import transformers

    torch.manual_seed(0)
    if name in DECODERS:
        config_cls, model_cls, kwargs = DECODERS[name]
    else:
        config_cls, model_cls, kwargs, _ = ENCODERS[name]
    if not hasattr(transformers, config_cls) or not hasattr(transformers, model_cls):
        raise Skip(f"transformers {transformers.__version__} lacks {model_cls}")
    kwargs = _overrides(case, kwargs)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    if name in GET_ENCODER:
        model = model.get_encoder()
    _scramble(model)
    return model


@torch.no_grad()
def _scramble(model):
    """Weights that keep activations O(1) (HF's 0.02-std init makes every output tiny, so a relative
    error would hide): matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), 1-D weights 1 + N(0, 0.1^2),
    biases N(0, 0.1^2). Buffers (BatchNorm statistics, rotary tables) are left as they are."""
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            fan_in = p[0].numel() if "embed" not in name and "wte" not in name and "wpe" not in name else 1
            p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))


def _inputs(name, model, batch=1, length=7):
    """(wrapped module, example args, dim index that may be dynamic, Dim)"""
    g = torch.Generator().manual_seed(1)
    if name in DECODERS:
        return Logits(model), (torch.randint(0, 64, (batch, length), generator=g),), 1
    kind = ENCODERS[name][3]
    if kind == "ids":
        return First(model, "input_ids"), (torch.randint(0, 64, (batch, length), generator=g),), 1
    if kind == "image":
        wrap = FreshCaches if name == "levit" else First
        return wrap(model, "pixel_values"), (torch.randn(batch, *IMAGE_SHAPE.get(name, (3, 16, 16)), generator=g),), 0
    if kind == "probe":
        keys, make, n, fixed, dict_out = PROBE_IO[name]
        return Call(model, keys, n, fixed, dict_out), make(model.config, batch, g), 0
    if kind == "wave":
        return First(model, "input_values"), (torch.randn(batch, WAVE_LEN, generator=g),), 0
    c = model.config
    if kind == "ast":
        return First(model, "input_values"), (torch.randn(batch, c.max_length, c.num_mel_bins, generator=g),), 0
    return First(model, "input_features"), (torch.randn(batch, c.num_mel_bins, 2 * c.max_source_positions,
                                                        generator=g),), 0


# ----------------------------------------------------------------------------- cases

def _config():
    import tritondelegate as td

    return td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _export(module, args, **kw):
    try:
        with torch.no_grad():
            return torch.export.export(module, args, **kw)
    except Exception as e:  # the model, not tritondelegate
        raise Skip(f"torch.export: {type(e).__name__}: {_first_line(e)}") from e


def _facts(lowered):
    """(launches per call over all methods, lowest delegated %, host op counts)"""
    LOWERED[:] = [lowered]
    launches, share, host = 0, 100.0, collections.Counter()
    for report in lowered.reports.values():
        launches += sum(report.launches.values())
        nodes = report.nodes
        share = min(share, 100.0 * nodes.delegated / max(nodes.total, 1))
        host.update(str(op).replace("aten.", "") for _, op, _ in nodes.host)
        for node, op, reason in nodes.host:
            REASONS.setdefault((str(op).replace("aten.", ""), reason), []).append(node)
    return launches, share, host


REASONS = {}  # (host op, reason) -> nodes, of the latest case (printed with --verbose)
LOWERED = []  # the latest case's lowered program


def _diff(out, ref):
    outs, refs = torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)
    if len(outs) != len(refs):
        return float("inf"), f"{len(outs)} outputs, eager {len(refs)}"
    worst = 0.0
    for o, r in zip(outs, refs):
        if o.shape != r.shape:
            return float("inf"), f"shape {tuple(o.shape)} vs eager {tuple(r.shape)}"
        o, r = o.float(), r.float()
        same_nan = o.isnan() & r.isnan()
        if (o.isnan() != r.isnan()).any():
            return float("inf"), f"NaN where eager has none ({int((o.isnan() & ~r.isnan()).sum())})"
        same = same_nan | (o == r)  # and equal infinities (a -inf mask), whose difference is NaN
        o, r = o.masked_fill(same, 0), r.masked_fill(same, 0)
        d = (o - r).abs().max().item() / max(1e-6, r.abs().max().item()) if o.numel() else 0.0
        worst = max(worst, d if d == d else float("inf"))
    return worst, ""


class Masked(torch.nn.Module):
    """A text model as (input_ids, attention_mask) -> first output."""

    def __init__(self, model, causal):
        super().__init__()
        self.model, self.causal = model, causal

    def forward(self, input_ids, attention_mask):
        extra = {"use_cache": False} if self.causal else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False, **extra)[0]


def _lower_run(module, args, **export):
    import tritondelegate as td

    lowered = td.lower(_export(module, args, **export), config=_config())
    out = lowered.load().load_method("forward")(*args)
    with torch.no_grad():
        ref = module(*args)
    return lowered, out, ref


def case_batch2(name, model):
    """Batch 2 at an odd length (13 tokens; vision: batch 2)."""
    module, args, _ = _inputs(name, model, batch=2, length=13)
    lowered, out, ref = _lower_run(module, args)
    return (*_diff(out, ref), *_facts(lowered))


def case_mask(name, model):
    """Text models with a padding attention mask (decoders: left padding; encoders: right padding)."""
    if name in ENCODERS and ENCODERS[name][3] != "ids":
        raise Skip("not a text model")
    causal = name in DECODERS
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    if causal:
        mask[1, :3] = 0
    else:
        mask[1, 6:] = 0
    module = Masked(model, causal)
    lowered, out, ref = _lower_run(module, (ids, mask))
    keep = mask.bool()[..., None]  # padded positions' outputs are not meaningful
    return (*_diff(out * keep, ref * keep), *_facts(lowered))


def case_eager_attn(name, model):
    """The forward case with transformers' eager attention (matmul + softmax) instead of SDPA."""
    if getattr(model.config, "_attn_implementation", None) is None:
        raise Skip("no attention implementation switch")
    model.config._attn_implementation = "eager"
    for m in model.modules():
        if hasattr(m, "config") and m.config is not model.config and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = "eager"
    return case_forward(name, model)


def case_bf16(name, model, dtype=torch.bfloat16):
    """bf16 model and program, both judged against the fp32 model: lowered error vs eager bf16's error."""
    import copy

    module, args, _ = _inputs(name, model, batch=2, length=9)
    with torch.no_grad():
        ref = torch.utils._pytree.tree_leaves(module(*args))
    low = copy.deepcopy(module).to(dtype)
    low_args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    lowered, out, eager = _lower_run(low, low_args)
    err, eager_err = (_worst_error(torch.utils._pytree.tree_leaves(got), ref) for got in (out, eager))
    bad = not err <= 2 * eager_err + 1.6e-2
    note = f"err {err:.3g} vs eager's {eager_err:.3g}" if bad else ""
    return (err if bad else 0.0, note, *_facts(lowered))


def _worst_error(outs, refs) -> float:
    """The largest error of ``outs`` against the fp32 ``refs``, each output scaled by its largest value
    (at least 1); integer outputs must match exactly."""
    worst = 0.0
    for o, r in zip(outs, refs, strict=True):
        if not r.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(o, r) else float("inf"))
            continue
        r = r.float()
        worst = max(worst, (o.float() - r).abs().max().item() / max(1.0, r.abs().max().item()))
    return worst


def case_forward(name, model):
    import tritondelegate as td

    module, args, _ = _inputs(name, model)
    ep = _export(module, args)
    lowered = td.lower(ep, config=_config())
    out = lowered.load().load_method("forward")(*args)
    with torch.no_grad():
        ref = module(*args)
    return (*_diff(out, ref), *_facts(lowered))


def case_dynamic(name, model):
    import tritondelegate as td

    module, args, dim = _inputs(name, model, batch=2)  # batch 1 would specialize a dynamic batch
    bound = 16 if dim == 1 else 4
    d = torch.export.Dim("n", min=1 if dim == 0 else 2, max=bound)
    shapes = tuple({dim: d} for _ in args)
    ep = _export(module, args, dynamic_shapes=(shapes,) if isinstance(module, Call) else shapes)  # Call: *xs
    lowered = td.lower(ep, config=_config())
    method = lowered.load().load_method("forward")
    worst, note = 0.0, ""
    for size in ((2, 5, bound) if dim == 1 else (1, 3, bound)):
        _, call, _ = _inputs(name, model, **({"length": size, "batch": 2} if dim == 1 else {"batch": size}))
        out = method(*call)
        with torch.no_grad():
            ref = module(*call)
        d_, n_ = _diff(out, ref)
        if n_ and not note:
            note = f"{n_} at n={size}"
        if d_ > worst:
            worst = d_
            note = note or (f"worst at n={size}" if d_ >= ATOL else "")
    return (worst, note, *_facts(lowered))


def case_dyn2(name, model):
    """Text models with dynamic batch (1..4) and sequence length (2..16), with a padding attention_mask
    (vision/audio: skip); calls at (1, 2), (3, 16), (2, 9)."""
    import tritondelegate as td

    if name in ENCODERS and ENCODERS[name][3] != "ids":
        raise Skip("not a text model")
    module = Masked(model, name in DECODERS)
    batch, seq = torch.export.Dim("batch", min=1, max=4), torch.export.Dim("seq", min=2, max=16)
    ids, mask = _masked_inputs(name, 2, 7)
    ep = _export(module, (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    lowered = td.lower(ep, config=_config())
    method = lowered.load().load_method("forward")
    worst, note = 0.0, ""
    for b, n in ((1, 2), (3, 16), (2, 9)):
        ids, mask = _masked_inputs(name, b, n)
        out = method(ids, mask)
        with torch.no_grad():
            ref = module(ids, mask)
        keep = mask.bool()[..., None]
        d_, n_ = _diff(out * keep, ref * keep)
        if (n_ or d_ >= ATOL) and not note:
            note = f"{n_ or 'worst'} at ({b}, {n})"
        worst = max(worst, d_)
    return (worst, note, *_facts(lowered))


def _masked_inputs(name, batch, length):
    """Ids and a padding mask: the last row padded (decoders: on the left, 2 tokens; encoders: right)."""
    ids = torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1 and length > 3:
        if name in DECODERS:
            mask[-1, :2] = 0
        else:
            mask[-1, -2:] = 0
    return ids, mask


def case_long_gen(name, model):
    """Generation with a 130-token prompt and a 200-entry cache (past the attention kernels' blocks)."""
    prompt = torch.randint(0, 64, (1, 130), generator=torch.Generator().manual_seed(3))
    return case_generate(name, model, prompt=prompt, cache=200, tokens=6)


def case_long(name, model):
    """Forward at 150 tokens (decoders and text encoders; vision: a 37x37 image)."""
    if name in ENCODERS and ENCODERS[name][3] == "audio":
        raise Skip("fixed input length")
    if name in ENCODERS and ENCODERS[name][3] == "image":
        if name == "vit":
            raise Skip("fixed image size")
        module = First(model, "pixel_values")
        args = (torch.randn(1, 3, 37, 37, generator=torch.Generator().manual_seed(1)),)
    else:
        module, args, _ = _inputs(name, model, length=150)
    lowered, out, ref = _lower_run(module, args)
    return (*_diff(out, ref), *_facts(lowered))


def case_wide(name, model):
    """Forward of a wider model: hidden 160, head_dim 40, intermediate 344, vocab 1000, 13 tokens."""
    if name in ENCODERS and ENCODERS[name][3] == "image":
        raise Skip("vision models are sized by their stage lists")
    if "long_factor" in str(getattr(model.config, "rope_parameters", "")):
        raise Skip("longrope factor lists are sized by head_dim")
    module, args, _ = _inputs(name, model, length=13)
    lowered, out, ref = _lower_run(module, args)
    return (*_diff(out, ref), *_facts(lowered))


def case_dyn_gen(name, model):
    """The static-cache recipe with a dynamic prompt length (Dim 1..16) for prefill; prompts of 1, 16 and 7
    tokens, 4 greedy tokens each, compared with eager (state reset between prompts)."""
    import tritondelegate as td
    from transformers.integrations import executorch

    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 24}
    example = torch.tensor([[3, 17, 5, 9, 22]])
    seq = torch.export.Dim("seq", min=1, max=16)
    try:
        eps = {"prefill": executorch.convert_and_export_with_cache(
                   model, example, torch.arange(5), dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}}),
               "decode": executorch.convert_and_export_with_cache(model, torch.tensor([[4]]), torch.tensor([5]))}
    except Exception as e:
        raise Skip(f"transformers export: {type(e).__name__}: {_first_line(e)}") from e
    lowered = td.lower(eps, config=_config())
    program = lowered.load()
    prefill, decode = program.load_method("prefill"), program.load_method("decode")
    worst, note = 0.0, ""
    for length in (1, 16, 7):
        prompt = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(length))
        program.reset_state()
        eager = executorch.TorchExportableModuleWithStaticCache(model)
        expected, expected_logits = greedy_static_cache(eager, eager, prompt, 4)
        tokens, logits = greedy_static_cache(prefill, decode, prompt, 4)
        worst = max(worst, max(_diff(a, b)[0] for a, b in zip(logits, expected_logits)))
        if tokens != expected and not note:
            note = f"prompt {length}: tokens {tokens} vs eager {expected}"
    return (worst, note, *_facts(lowered))


def case_fp16(name, model):
    """As bf16, in fp16."""
    return case_bf16(name, model, torch.float16)


def case_generate(name, model, prompt=None, cache=16, tokens=TOKENS):
    import tritondelegate as td
    from transformers.integrations import executorch

    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": cache}
    prompt = torch.tensor([[3, 17, 5, 9, 22]]) if prompt is None else prompt
    n = prompt.shape[1]
    try:
        eps = {"prefill": executorch.convert_and_export_with_cache(model, prompt, torch.arange(n)),
               "decode": executorch.convert_and_export_with_cache(model, torch.tensor([[4]]), torch.tensor([n]))}
        eager = executorch.TorchExportableModuleWithStaticCache(model)
        expected, expected_logits = greedy_static_cache(eager, eager, prompt, tokens)
    except Exception as e:
        raise Skip(f"transformers export: {type(e).__name__}: {_first_line(e)}") from e
    lowered = td.lower(eps, config=_config())
    if not lowered.state:  # a hybrid's recurrent state is not exported: eager carries it, the export not
        raise Skip("transformers export: the program keeps no cache (its state is not exported)")
    program = lowered.load()
    tokens, logits = greedy_static_cache(program.load_method("prefill"), program.load_method("decode"), prompt, tokens)
    worst = max(_diff(a, b)[0] for a, b in zip(logits, expected_logits))
    note = "" if tokens == expected else f"tokens {tokens} vs eager {expected}"
    return (worst, note, *_facts(lowered))


def _quantized(case, kwargs):
    """``case`` on the model with its linears and MoE experts weight-only quantized
    (``td.quantize_linears(**kwargs)``), against the quantized model in eager; notes when the program
    holds fewer integer bytes than the quantized weights (some weight folded back to floats)."""
    def run(name, model):
        import tritondelegate as td

        td.quantize_linears(model, **kwargs)
        want = sum(b.nbytes for b in model.buffers() if b.dtype in (torch.int8, torch.uint8))  # linears', experts'
        if not want:
            raise Skip("no linear to quantize")
        worst, note, *facts = case(name, model)
        held = sum(c.nbytes for c in LOWERED[0].program.constants if c.dtype in ("int8", "uint8"))
        if held < want:
            note = "; ".join(filter(None, [note, f"{held} of {want} integer bytes kept"]))
        return (worst, note, *facts)

    return run


# ----------------------------------------------------------------------------- driver

def _first_line(e):
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:160]


def _alarm(signum, frame):
    raise Timeout("timed out")


def run_case(name, case, timeout, verbose):
    start = time.time()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    if case in ("generate", "long_gen", "dyn_gen", "int4_gen", "emb_gen") and name not in DECODERS:
        return None
    REASONS.clear()
    try:
        model = _build(name, case)
        worst, note, launches, share, host = CASE_FUNCTIONS[case](name, model)
        status = f"ok ({worst:.1e})" if worst < ATOL and not note else \
            f"mismatch ({worst:.3g}{'; ' + note if note else ''})"
        hosted = ", ".join(f"{op}x{c}" for op, c in host.most_common(4))
        extra = f"  host: {hosted}" if hosted else ""
        if verbose:
            for (op, reason), nodes in REASONS.items():
                extra += f"\n    on the host: {op} x{len(nodes)} ({nodes[0]}): {reason}"
        return f"{status:<40} launches={launches:<4} delegated={share:5.1f}%{extra}", time.time() - start
    except Skip as e:
        return f"skip ({e})", time.time() - start
    except Timeout:
        return f"error (Timeout: over {timeout}s)", time.time() - start
    except Exception as e:
        if verbose:
            traceback.print_exc()
        return f"error ({type(e).__name__}: {_first_line(e)})", time.time() - start
    finally:
        signal.alarm(0)


CASE_FUNCTIONS = {"forward": case_forward, "generate": case_generate, "dynamic": case_dynamic,
                  "batch2": case_batch2, "mask": case_mask, "eager_attn": case_eager_attn, "bf16": case_bf16,
                  "long": case_long, "long_gen": case_long_gen, "wide": case_wide,
                  "dyn_gen": case_dyn_gen, "fp16": case_fp16,
                  "dyn2": case_dyn2, "int8": _quantized(case_forward, {}),
                  "int4_gen": _quantized(case_generate, dict(bits=4, group_size=16, zero_point=True)),
                  "emb_gen": _quantized(case_generate, dict(bits=4, group_size=16, zero_point=True, embeddings=True))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated; known: " + ",".join(ARCHS))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per (arch, case)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of errors")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    warnings.filterwarnings("ignore")
    archs, cases = opts.archs.split(","), opts.cases.split(",")
    unknown = [a for a in archs if a not in ARCHS] + [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown {unknown}; architectures: {ARCHS}; cases: {list(CASES)}")
    begin = time.time()
    for name in archs:
        for case in cases:
            result = run_case(name, case, opts.timeout, opts.verbose)
            if result is None:
                continue
            line, seconds = result
            print(f"{name:<16} {case:<9} {line}  [{seconds:.0f}s]", flush=True)
    print(f"total {time.time() - begin:.0f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
