"""Launches per call (per layer and outside the layers) and modelled traffic against its lower bound,
for the models issue "fewer, fatter launches" tracks: the demo decoder, transformers' Llama and GPT-2
(tiny configs, random weights) and the ResNet-style CNN of the tests. Needs no GPU: the figures come
from the lowered plans (no kernel runs).

    python scripts/launch_traffic.py
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import tritondelegate as td  # noqa: E402
from tritondelegate.kernels.traffic import method_traffic  # noqa: E402
from tritondelegate.models import demo_decoder  # noqa: E402

CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _lower(model, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return td.lower(torch.export.export(model, args), config=CONFIG)


def _hf(kind: str, layers: int, batch: int):
    import transformers

    from harness import Logits

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=64, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    return Logits(model.eval()), (torch.randint(0, 64, (batch, 7)),)


def _decoder(layers: int, batch: int):
    model, (ids,) = demo_decoder(seed=0, n_layers=layers)
    return model, (ids.repeat(batch, 1),)


def _resnet(layers: int, batch: int):
    from test_resnet_block import TinyResNet

    torch.manual_seed(0)
    return TinyResNet().eval(), (torch.randn(batch, 3, 16, 16),)


MODELS = {"demo decoder": _decoder, "HF Llama": lambda n, b: _hf("llama", n, b),
          "HF GPT-2": lambda n, b: _hf("gpt2", n, b), "TinyResNet": _resnet}


def main() -> int:
    for name, make in MODELS.items():
        two, four = (sum(_lower(*make(n, 1)).reports["forward"].launches.values()) for n in (2, 4))
        per_layer = (four - two) / 2
        layers = f"{per_layer:g} per layer + {two - 2 * per_layer:g} outside" if name != "TinyResNet" else "-"
        ratios = [method_traffic(_lower(*make(2, b)).program.methods[0])["ratio"] for b in (1, 8)]
        print(f"{name}: {two} launches (2 layers), {layers}; traffic / lower bound: "
              f"{ratios[0]:.2f} at batch 1, {ratios[1]:.2f} at batch 8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
