"""Tiny transformers causal LMs (random weights, nothing downloaded) through the kernel registry.

The survey test lists every decomposed op that has no registry entry or that its support check
refuses, with counts, so a new transformers release that exports new ops shows up as one readable
failure. The run test lowers the whole model into one delegate and compares logits with eager.
"""

from __future__ import annotations

import collections
import operator

import pytest
import torch

from harness import Logits, assert_close, export_decomposed, run_delegated
from tritondelegate.kernels import registry

transformers = pytest.importorskip("transformers")


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": _llama, "gpt2": _gpt2}


def _model_and_args(name):
    model = Logits(MODELS[name]().eval())
    return model, (torch.randint(0, 64, (2, 7)),)


def _unsupported(ep) -> dict[str, int]:
    found = collections.Counter()
    for node in ep.graph_module.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        spec = registry.lookup(node.target)
        reason = "no registry entry" if spec is None else spec.support(node)
        if reason:
            found[f"{node.target}: {reason}"] += 1
    return dict(found)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_op_is_supported(name):
    model, args = _model_and_args(name)
    assert _unsupported(export_decomposed(model, args)) == {}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_whole_model_in_one_delegate(name):
    model, args = _model_and_args(name)
    (logits,), _ = run_delegated(model, args)
    with torch.no_grad():
        expected = model(*args)
    assert_close(logits, expected)
