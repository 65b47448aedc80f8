"""transformers' own static-cache export recipe (the reference front end for on-device generation):
prefill and decode as two methods of one program share the weights and the KV cache on the device.

Tiny configs with odd sizes and random weights; nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

import tritondelegate as td
from harness import greedy_static_cache
from tritondelegate.program import DEVICE_ALIGNMENT, align_up

transformers = pytest.importorskip("transformers")
executorch = pytest.importorskip("transformers.integrations.executorch")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 12}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "eos_token_id": 1}),  # one gate_up linear
    # soft-capped scores and logits, every other layer a sliding window of 8 keys (shorter than the prompt
    # and the 16 tokens generated), pre- and post-norms around attention and the MLP
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 12, "sliding_window": 8, "query_pre_attn_scalar": 12}),
    # Mixture of Experts: 4 experts, 2 per token, the router's top-k, sort and counts on the device too
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # the LM head tied to the input embeddings (Llama 3.2 1B/3B, Qwen2.5 0.5-3B, Gemma)
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
}
# Launches per prefill or decode call at 2 layers: 5 per layer (Q/K/V with its norm and, in its epilogue,
# q and k rotated, their angles and tables computed inline from the positions; attention with its mask
# computed inline, writing the new k/v rows into the cache first (a prompt this short is one query block,
# as a decode step), the output projection with the residual, gate/up with SwiGLU, down with the residual)
# and 3 outside (embedding, with Gemma's scale as its epilogue, positions, LM head). The static
# cache's per-layer position counter is overwritten before any read, so it is not written at all.
# Mixtral's layers run 9 each: attention's 3, the router's GEMM with the layer's RMSNorm as its prologue,
# its softmax, top-k and renormalization in one launch, the expert order (a stable sort) and the offsets
# per expert in one, gate/up as one grouped GEMM reading the token rows in the expert order in its loads
# (the norm its prologue too) with SwiGLU in its epilogue, down storing its rows in token order with the
# routing weights in its epilogue, and the sum over the chosen experts with the residual add in its epilogue.
# Gemma 2's layers run 7 each: the 5 and its norms after attention and after the MLP.
LAUNCHES = {"llama": 13, "qwen2": 13, "mistral": 13, "gemma": 13, "phi3": 13, "mixtral": 21, "gemma2": 17,
            "llama_tied": 13}
CACHE = 32
PROMPT = torch.tensor([[3, 17, 5, 9, 22]])
TOKENS = 16


def _model(name):
    config_cls, model_cls, extra = MODELS[name]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": CACHE}
    return model


def _export(model):
    n = PROMPT.shape[1]
    return {
        "prefill": executorch.convert_and_export_with_cache(model, PROMPT, torch.arange(n)),
        "decode": executorch.convert_and_export_with_cache(model, torch.tensor([[4]]), torch.tensor([n])),
    }


def _one_scatter_per_layer(program, name):
    """Each layer's k and v cache writes run in one launch, in every method: its attention launch
    (``attention_append``: a decode step, or a prompt of one query block) or one (PAIR) scatter launch;
    no other scatter runs (a Mixture of Experts layer's down GEMM stores its rows in token order itself)."""
    for method in program.program.methods:
        launches = [l for d in method.delegates for l in d.plan.launches]
        scatters = [l for l in launches if l.kernel == "scatter"]
        pairs = [l for l in scatters if "PAIR" in l.constexprs and l.constexprs["PAIR"].value]
        appends = [l for l in launches if l.kernel == "attention_append"]
        assert len(pairs) + len(appends) == COMMON["num_hidden_layers"], method.name
        assert len(scatters) == len(pairs), method.name
        if method.name == "decode":
            assert not pairs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_static_cache_generation_matches_eager(name, tmp_path):
    torch.manual_seed(0)
    model = _model(name)
    lowered = td.lower(_export(model), partitioner=td.TritonPartitioner(device="cuda:0"),
                       config=td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))
    for method in ("prefill", "decode"):
        nodes = lowered.reports[method].nodes
        assert nodes.delegated == nodes.total, nodes.host  # 100% of compute nodes
        assert len(lowered.reports[method].inplace) == 2 * COMMON["num_hidden_layers"]  # K and V per layer
        assert not lowered.reports[method].device.messages  # no per-call copy of weights or cache
        assert sum(lowered.reports[method].launches.values()) == LAUNCHES[name]
    assert all(s.device == "cuda:0" for s in lowered.state.values())
    lowered.save(tmp_path / "lm.tdp")
    program = td.load(tmp_path / "lm.tdp", devices="simulated")
    prefill, decode = program.load_method("prefill"), program.load_method("decode")
    _one_scatter_per_layer(program, name)
    window = MODELS[name][2].get("sliding_window")
    if window:  # the sliding layers' window is the attention kernel's, not a mask built per call
        windows = {l.constexprs["WINDOW"].value for m in program.program.methods for d in m.delegates
                   for l in d.plan.launches if "WINDOW" in l.constexprs}
        assert windows == {window}
    # Prefill loaded every weight already: decode loads only the constants it alone reads (folded ones).
    slots = lambda m: {v.slot for v in m.values if v.resident}  # noqa: E731
    prefill_slots, decode_slots = (slots(m) for m in program.program.methods)
    own = sum(program.program.constants[program.program.slots[s].constant].nbytes for s in decode_slots - prefill_slots)
    assert decode.stats.load_h2d_bytes == own < 1024

    eager = executorch.TorchExportableModuleWithStaticCache(model)
    expected, expected_logits = greedy_static_cache(eager, eager, PROMPT, TOKENS)
    tokens, logits = greedy_static_cache(prefill, decode, PROMPT, TOKENS)
    assert tokens == expected
    assert max((a - b).abs().max().item() for a, b in zip(logits, expected_logits)) < 1e-3
    # Per decode step only the ids and the position go in and the logits come out.
    assert decode.stats.call_h2d_bytes == 8 + 8
    assert decode.stats.call_d2h_bytes == COMMON["vocab_size"] * 4

    constants = {(s.constant, s.device) for s in program.program.slots if not s.state}
    memory = program.memory()["cuda:0"]
    held = [align_up(program.program.constants[c].nbytes, DEVICE_ALIGNMENT) for c, _ in constants]
    assert memory["constants"] == sum(held)
    assert memory["constants"] < 1.01 * sum(p.nbytes for p in model.parameters()) + DEVICE_ALIGNMENT * len(constants)

    # reset_state(), then the same prompt gives the same logits; a second prompt continues like eager.
    program.reset_state()
    again, again_logits = greedy_static_cache(prefill, decode, PROMPT, 3)
    assert again == tokens[:3]
    torch.testing.assert_close(again_logits[0], logits[0])
    second = torch.tensor([[7, 1, 50, 2, 11]])
    assert greedy_static_cache(prefill, decode, second, 4)[0] == greedy_static_cache(eager, eager, second, 4)[0]


@pytest.mark.parametrize("name,quantize", [("llama_tied", dict(bits=4, group_size=16, zero_point=True, embeddings=True)),
                                           ("phi3", dict()), ("mixtral", dict(bits=4, group_size=16))],
                         ids=["llama-tied-uint4-g16-embeddings", "phi3-int8", "mixtral-int4-g16"])
def test_weight_only_quantized_generation_matches_the_quantized_model(name, quantize, tmp_path):
    # td.quantize_linears before the recipe's export: the program keeps every linear's integers, (Mixtral)
    # its experts' and (embeddings=True) the tied table's, once for the lookups and the LM head (its
    # launches those of the float model), and gives the quantized model's own tokens and logits
    torch.manual_seed(0)
    model = td.quantize_linears(_model(name), **quantize)
    integers = sum(b.nbytes for b in model.buffers() if b.dtype in (torch.int8, torch.uint8))
    assert integers and (name != "mixtral" or not any(p.dim() == 3 for p in model.parameters()))
    lowered = td.lower(_export(model), config=td.LowerConfig(
        propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))
    for method in ("prefill", "decode"):
        assert sum(lowered.reports[method].launches.values()) == LAUNCHES[name]
        assert not lowered.reports[method].nodes.host
    assert sum(c.nbytes for c in lowered.program.constants if c.dtype in ("int8", "uint8")) == integers
    table = (COMMON["vocab_size"], COMMON["hidden_size"])  # with embeddings=True no float table is stored
    assert quantize.get("embeddings", False) is not any(tuple(c.shape) == table for c in lowered.program.constants)
    lowered.save(tmp_path / "lm.tdp")
    program = td.load(tmp_path / "lm.tdp", devices="simulated")
    eager = executorch.TorchExportableModuleWithStaticCache(model)
    expected, expected_logits = greedy_static_cache(eager, eager, PROMPT, 8)
    tokens, logits = greedy_static_cache(program.load_method("prefill"), program.load_method("decode"), PROMPT, 8)
    assert tokens == expected
    assert max((a - b).abs().max().item() for a, b in zip(logits, expected_logits)) < 1e-3


def test_dynamic_prompt_length_shares_the_cache_with_decode(tmp_path):
    """transformers' recipe with a dynamic prompt length (``Dim("seq", max=16)``): one prefill method
    for every prompt of 1..16 tokens and one decode method, sharing weights and cache on the device."""
    torch.manual_seed(0)
    model = _model("llama")
    seq = torch.export.Dim("seq", min=1, max=16)
    prefill_ep = executorch.convert_and_export_with_cache(
        model, PROMPT, torch.arange(PROMPT.shape[1]), dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}})
    decode_ep = executorch.convert_and_export_with_cache(model, torch.tensor([[4]]), torch.tensor([PROMPT.shape[1]]))
    lowered = td.lower({"prefill": prefill_ep, "decode": decode_ep},
                       config=td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))
    for method in ("prefill", "decode"):
        nodes = lowered.reports[method].nodes
        assert nodes.delegated == nodes.total, nodes.host
        assert not lowered.reports[method].device.messages  # weights and cache stay on the device
    (symbol,) = lowered.program.methods[0].symbols
    assert (symbol.min, symbol.max) == (1, 16)
    lowered.save(tmp_path / "lm.tdp")
    program = td.load(tmp_path / "lm.tdp", devices="simulated")
    prefill, decode = program.load_method("prefill"), program.load_method("decode")
    _one_scatter_per_layer(program, "llama")
    torch.manual_seed(1)
    for length in (1, 16, 7, 11):  # 1, the bound, primes between
        prompt = torch.randint(0, COMMON["vocab_size"], (1, length))
        program.reset_state()
        eager = executorch.TorchExportableModuleWithStaticCache(model)
        expected, expected_logits = greedy_static_cache(eager, eager, prompt, 3)
        tokens, logits = greedy_static_cache(prefill, decode, prompt, 3)
        assert tokens == expected, length
        assert max((a - b).abs().max().item() for a, b in zip(logits, expected_logits)) < 1e-3
        assert prefill.stats.call_h2d_bytes == 2 * 8 * length  # this prompt's ids and positions only


def test_a_long_cache_splits_decode_attention():
    """A 600-position cache: each decode step's attention splits its keys over programs (one more
    launch per layer, attention_combine) and a 5-token prefill's too (its 2 x 5 packed rows fill one
    block); tokens and logits stay eager's."""
    torch.manual_seed(0)
    model = _model("qwen2")
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 600}
    lowered = td.lower(_export(model), config=td.LowerConfig(
        propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))
    for method in lowered.program.methods:
        kernels = [launch.kernel for d in method.delegates for launch in d.plan.launches]
        assert kernels.count("attention_combine") == COMMON["num_hidden_layers"], method.name
        assert len(kernels) == LAUNCHES["qwen2"] + COMMON["num_hidden_layers"], method.name
    program = lowered.load()
    prefill, decode = program.load_method("prefill"), program.load_method("decode")
    eager = executorch.TorchExportableModuleWithStaticCache(model)
    expected, expected_logits = greedy_static_cache(eager, eager, PROMPT, 4)
    tokens, logits = greedy_static_cache(prefill, decode, PROMPT, 4)
    assert tokens == expected
    assert max((a - b).abs().max().item() for a, b in zip(logits, expected_logits)) < 1e-3
