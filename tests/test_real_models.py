"""Real architectures through the public API: delegated almost whole and matching eager.

transformers' Llama and GPT-2 (tiny configs, random weights, nothing downloaded), a ResNet-style CNN,
the package's Llama-style decoder and an MLP. Each is lowered, run on the simulated device (or a GPU)
and compared with eager in fp32, and in fp16/bf16 against an fp32 reference.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tritondelegate as td
from harness import Logits, TOLERANCES
from test_resnet_block import TinyResNet
from tritondelegate.models import MLP, demo_decoder

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _hf(name, attention):
    transformers = pytest.importorskip("transformers")
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=96, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
        config._attn_implementation = attention
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=96, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)
        config._attn_implementation = attention
        model = transformers.GPT2LMHeadModel(config)
    assert model.config._attn_implementation == attention
    return Logits(model.eval()), (torch.randint(0, 96, (1, 11)),)


def _build(name):
    torch.manual_seed(0)
    if name in ("llama-sdpa", "llama-eager", "gpt2-sdpa", "gpt2-eager"):
        arch, attention = name.split("-")
        return _hf(arch, attention)
    if name == "resnet":
        return TinyResNet().eval(), (torch.randn(2, 3, 16, 16),)
    if name == "decoder":
        model, args = demo_decoder(n_layers=1)
        return model, args
    return MLP([40, 96, 33, 10]).eval(), (torch.randn(5, 40),)


MODELS = ["llama-sdpa", "llama-eager", "gpt2-sdpa", "gpt2-eager", "resnet", "decoder", "mlp"]


def _lower_and_run(model, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(torch.export.export(model, args), config=RESIDENT)
    method = lowered.load().load_method()
    with torch.no_grad():
        return lowered, method(*args)


def _cast(model, args, dtype):
    model = copy.deepcopy(model).to(dtype)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    return model, args


@pytest.mark.parametrize("name", MODELS)
def test_fp32_delegated_and_matches_eager(name):
    model, args = _build(name)
    lowered, out = _lower_and_run(model, args)
    with torch.no_grad():
        expected = model(*args)
    assert (out - expected).abs().max().item() < 1e-3
    nodes = lowered.reports["forward"].nodes
    assert nodes.delegated >= 0.95 * nodes.total, lowered.summary()
    host_ops = {op for _, op, _ in nodes.host}
    assert not any("assert" in op for op in host_ops)  # metadata checks are not host work
    assert "view/layout nodes" in lowered.summary()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama-sdpa", "llama-eager", "gpt2-sdpa", "gpt2-eager", "resnet", "decoder"])
def test_low_precision_against_fp32_reference(name, dtype):
    model, args = _build(name)
    low_model, low_args = _cast(model, args, dtype)
    _, out = _lower_and_run(low_model, low_args)
    # The reference: the same rounded weights, run in fp32.
    ref_model = copy.deepcopy(low_model).float()
    with torch.no_grad():
        expected = ref_model(*(a.float() if a.is_floating_point() else a for a in low_args))
    atol, rtol = TOLERANCES[dtype]
    # Errors grow with depth: every layer rounds its activations to `dtype`; eager in `dtype` does too.
    with torch.no_grad():
        eager_low = low_model(*low_args).float()
    eager_err = (eager_low - expected).abs().max().item()
    our_err = (out.float() - expected).abs().max().item()
    assert our_err <= max(2 * eager_err, atol + rtol * expected.abs().max().item()), (our_err, eager_err)
