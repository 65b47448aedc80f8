"""Launches per call (per layer and outside the layers) and modelled traffic against its lower bound,
for the models issue "fewer, fatter launches" tracks: the demo decoder, transformers' Llama and GPT-2
(tiny configs, random weights) and the ResNet-style CNN of the tests, each ratio also without the
values passed between launches (each written once and read once: what fusion within a layer leaves);
transformers' MobileNetV2 at its default config and EfficientNet-B0; then a generation step with a KV
cache, prefill and decode, for the demo's ``KVCacheDecoder`` and transformers' Llama through its
static-cache export recipe; last, Llama-3-8B's decode attention before and after packing its query
heads and splitting its keys; last, a decode step with weight-only quantized weights against bf16
ones. Needs no GPU: the figures come from the lowered plans (no kernel runs).

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


# Tiny widths (the tests' configs) and a width where a layer's weights outweigh its activations, as in
# the models an H100 runs (hidden 1024, MLP 2816, 8 heads: 25 M parameters per 2 layers).
WIDTHS = {"tiny": dict(hidden=32, mlp=64, heads=4, vocab=64),
          "wide": dict(hidden=1024, mlp=2816, heads=8, vocab=2048)}


def _hf(kind: str, layers: int, batch: int, hidden: int, mlp: int, heads: int, vocab: int):
    import transformers

    from harness import Logits

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=heads // 2, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab,
                                         n_positions=64, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    return Logits(model.eval()), (torch.randint(0, vocab, (batch, 7)),)


def _decoder(layers: int, batch: int, hidden: int, mlp: int, heads: int, vocab: int):
    if hidden == WIDTHS["tiny"]["hidden"]:  # the demo's own config
        model, (ids,) = demo_decoder(seed=0, n_layers=layers)
    else:
        model, (ids,) = demo_decoder(seed=0, n_layers=layers, dim=hidden, hidden_dim=mlp, n_heads=heads,
                                     n_kv_heads=heads // 2, vocab_size=vocab)
    return model, (ids.repeat(batch, 1),)


def _resnet(layers: int, batch: int, hidden: int, **_):
    torch.manual_seed(0)
    if hidden == WIDTHS["tiny"]["hidden"]:
        from test_resnet_block import TinyResNet

        return TinyResNet().eval(), (torch.randn(batch, 3, 16, 16),)
    import transformers  # ResNet-18's widths and depths at 224 x 224

    model = transformers.ResNetModel(transformers.ResNetConfig(
        embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2], layer_type="basic")).eval()
    return _Pooled(model), (torch.randn(batch, 3, 224, 224),)


class _Pooled(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).pooler_output


MODELS = {"demo decoder": _decoder, "HF Llama": lambda n, b, **w: _hf("llama", n, b, **w),
          "HF GPT-2": lambda n, b, **w: _hf("gpt2", n, b, **w), "ResNet": _resnet}


def _kv_demo(layers: int) -> dict:
    from tritondelegate.models import export_prefill_decode, kv_cache_decoder

    return export_prefill_decode(kv_cache_decoder(n_layers=layers), 5)


def _kv_hf(kind: str, layers: int) -> dict:
    import transformers
    from transformers.integrations.executorch import convert_and_export_with_cache

    torch.manual_seed(0)
    common = dict(vocab_size=97, max_position_embeddings=64)
    if kind == "gptj":  # interleaved partial rotary, parallel attention and MLP
        model = transformers.GPTJForCausalLM(transformers.GPTJConfig(
            vocab_size=97, n_embd=48, n_layer=layers, n_head=4, rotary_dim=6, n_positions=64))
    else:
        experts = dict(num_local_experts=4, num_experts_per_tok=2) if kind == "Mixtral" else {}  # MoE: 4, top 2
        config = getattr(transformers, f"{kind}Config")(
            hidden_size=48, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, **common, **experts)
        model = getattr(transformers, f"{kind}ForCausalLM")(config)
    model = model.eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 32}
    prompt = torch.tensor([[3, 17, 5, 9, 22]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"prefill": convert_and_export_with_cache(model, prompt, torch.arange(5)),
                "decode": convert_and_export_with_cache(model, torch.tensor([[4]]), torch.tensor([5]))}


KV_MODELS = {"demo KVCacheDecoder": _kv_demo, "HF Llama, static cache": lambda n: _kv_hf("Llama", n),
             "HF Cohere, static cache": lambda n: _kv_hf("Cohere", n),
             "HF GPT-J, static cache": lambda n: _kv_hf("gptj", n),
             "HF Mixtral, static cache": lambda n: _kv_hf("Mixtral", n)}


def _kv_steps() -> None:
    print("KV-cache generation step (prompt 5 tokens):")
    for name, make in KV_MODELS.items():
        lowered = {n: td.lower(make(n), config=CONFIG) for n in (2, 4)}
        for method in ("prefill", "decode"):
            two, four = (sum(lowered[n].reports[method].launches.values()) for n in (2, 4))
            per_layer = (four - two) / 2
            print(f"  {name} {method}: {two} launches (2 layers), {per_layer:g} per layer + "
                  f"{two - 2 * per_layer:g} outside")


class _DecodeAttention(torch.nn.Module):
    """Llama-3-8B's decode attention: 32 query heads over 8 key heads of 128, masked by position."""

    def forward(self, q, k, v, pos):
        mask = torch.arange(k.shape[-2])[None, None, None, :] <= pos[:, None, :, None]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _decode_attention() -> None:
    """Programs of the attention launch and the K/V bytes they request (programs x keys each x 512 B
    for bf16 heads of 128), one pass per query head (before packing), packed, packed and split."""
    import dataclasses

    from tritondelegate.kernels import target

    print("Llama-3-8B decode attention (bf16, H100 target): programs, K/V requested, launches")
    for keys, batch in ((1024, 1), (4096, 1), (32768, 1), (4096, 8)):
        args = (torch.randn(batch, 32, 1, 128, dtype=torch.bfloat16),
                *(torch.randn(batch, 8, keys, 128, dtype=torch.bfloat16) for _ in range(2)),
                torch.full((batch, 1), keys - 1))
        ep = torch.export.export(_DecodeAttention(), args)
        row = [f"one per query head {32 * batch}, {32 * batch * keys * 512 / 2**20:.0f} MiB"]
        for split in (False, True):
            gpu = dataclasses.replace(target.TARGETS["h100"], split_attention=split)
            lowered = td.lower(ep, config=dataclasses.replace(CONFIG, target=gpu))
            launches = [x for d in lowered.program.methods[0].delegates for x in d.plan.launches]
            attn = launches[0]
            split_n = attn.args[-1].value if attn.constexprs["SPLIT"].value else keys
            programs = attn.grid[0] * attn.grid[1] * attn.grid[2]
            requested = attn.grid[1] * attn.grid[2] * min(keys, split_n) * 512
            row.append(f"{programs}, {requested / 2**20:.0f} MiB ({len(launches)} launch{'es' * (len(launches) > 1)})")
        print(f"  cache {keys}, batch {batch}: {row[0]}; packed: {row[1]}; packed + split: {row[2]}")


def _mobile_cnns() -> None:
    """transformers' MobileNetV2 at its default config (224 x 224; TensorFlow's SAME padding before its
    convolutions) with its classifier, and EfficientNet-B0 (its widths and depths, 224 x 224) to the
    pooled features."""
    import transformers

    from test_mobilenet import Classifier

    torch.manual_seed(0)
    b0 = transformers.EfficientNetConfig(width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280)
    models = {"MobileNetV2": Classifier(transformers.MobileNetV2ForImageClassification(
        transformers.MobileNetV2Config()).eval()),
              "EfficientNet-B0": _Pooled(transformers.EfficientNetModel(b0).eval())}
    for name, model in models.items():
        for batch in (1, 8):
            traffic = method_traffic(_lower(model, (torch.randn(batch, 3, 224, 224),)).program.methods[0])
            print(f"{name} 224 x 224, batch {batch}: {traffic['launches']} launches, "
                  f"{traffic['bytes'] / 1e6:.1f} MB modelled, lower bound {traffic['lower_bound'] / 1e6:.1f} MB "
                  f"({traffic['ratio']:.2f}x; {_beside(traffic)})")


QUANTIZED = (("bf16 weights", None), ("int8 per row", {}),
             ("uint8 + zero point, groups of 128", dict(group_size=128, zero_point=True)),
             ("4 bits, groups of 128", dict(group_size=128, bits=4)),
             ("4 bits + zero point, groups of 32", dict(group_size=32, zero_point=True, bits=4)))


def _quantized_decode() -> None:
    """The demo's KV-cache decoder at the wide config in bf16 (2 layers, cache 256), and a Mixtral of 8
    experts (top 2) at hidden 512: a decode step's modelled traffic and the resident constants, float
    against weight-only quantized (``td.quantize_linears``: linears, and the Mixtral's experts)."""
    from tritondelegate.models import export_prefill_decode, kv_cache_decoder

    wide = WIDTHS["wide"]

    def decoder():
        model = kv_cache_decoder(n_layers=2, dim=wide["hidden"], hidden_dim=wide["mlp"], n_heads=wide["heads"],
                                 n_kv_heads=wide["heads"] // 2, vocab_size=wide["vocab"], max_seq_len=256)
        return model.to(torch.bfloat16), lambda m: export_prefill_decode(m, 5)

    for title, make in (("KV-cache decoder, wide config", decoder), ("HF Mixtral, 8 experts of 512 -> 1408", _moe)):
        print(f"{title}, bf16 (2 layers), decode step: traffic, lower bound, constants, launches")
        for label, kwargs in QUANTIZED:
            model, export = make()
            if kwargs is not None:
                td.quantize_linears(model, **kwargs)
            lowered = td.lower(export(model), config=CONFIG)
            method = next(m for m in lowered.program.methods if m.name == "decode")
            traffic = method_traffic(method)
            constants = lowered.summary().splitlines()
            row = next(line for line in constants if line.startswith("decode"))
            print(f"  {label}: {traffic['bytes'] / 1e6:.2f} MB modelled per call, lower bound "
                  f"{traffic['lower_bound'] / 1e6:.2f} MB ({traffic['ratio']:.2f}x), {traffic['launches']} "
                  f"launches; summary: {' '.join(row.split())}")


def _moe():
    """transformers' Mixtral in bf16: 2 layers of 8 experts (top 2), hidden 512, experts 1408 wide,
    vocabulary 2048, static cache of 256; and its prefill/decode export."""
    import transformers
    from transformers.integrations.executorch import convert_and_export_with_cache

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256))
    model = model.to(torch.bfloat16).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 256}

    def export(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {"prefill": convert_and_export_with_cache(m, torch.tensor([[3, 17, 5, 9, 22]]), torch.arange(5)),
                    "decode": convert_and_export_with_cache(m, torch.tensor([[4]]), torch.tensor([5]))}

    return model, export


def _beside(t: dict) -> str:
    """The ratio without the values between launches (each written by one launch and read by the next):
    what is left above the bound is values of the bound read or written more than once."""
    return f"{(t['bytes'] - t['intermediates']) / t['lower_bound']:.3f} without the values between launches"


def main() -> int:
    for width, dims in WIDTHS.items():
        print(f"{width}: {dims}")
        for name, make in MODELS.items():
            two, four = (sum(_lower(*make(n, 1, **dims)).reports["forward"].launches.values()) for n in (2, 4))
            per_layer = (four - two) / 2
            layers = f"{per_layer:g} per layer + {two - 2 * per_layer:g} outside" if name != "ResNet" else "-"
            traffic = [method_traffic(_lower(*make(2, b, **dims)).program.methods[0]) for b in (1, 8)]
            print(f"  {name}: {two} launches (2 layers), {layers}; traffic / lower bound: "
                  + ", ".join(f"{t['ratio']:.2f} at batch {b} ({_beside(t)})" for t, b in zip(traffic, (1, 8))))
    _mobile_cnns()
    _kv_steps()
    _decode_attention()
    _quantized_decode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
