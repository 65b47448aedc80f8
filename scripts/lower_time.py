"""Export and lowering time of a Llama-3.2-1B-shaped model (transformers ``LlamaForCausalLM``: hidden
2048, 16 layers, MLP 8192, vocab 128256, tied embeddings, bf16, random weights) through transformers'
static-cache recipe (prefill of 16 and decode, cache of 1024), in bf16 or weight-only quantized with
``td.quantize_linears`` (``embeddings=True``); then the program's constants and a decode step's
launches and modelled bytes. Needs no GPU; about a minute per weights kind and 7 GB of memory.

    python scripts/lower_time.py                      # bf16, int8, int4 (groups of 64)
    python scripts/lower_time.py --weights int4 --layers 4
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tritondelegate as td  # noqa: E402
from tritondelegate.kernels.traffic import method_traffic  # noqa: E402

QUANTIZE = {"bf16": None, "int8": dict(), "int4": dict(bits=4, group_size=64)}


def _model(layers: int, weights: str):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                      tie_word_embeddings=True, max_position_embeddings=2048)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 1024}
    if QUANTIZE[weights] is not None:
        td.quantize_linears(model, embeddings=True, **QUANTIZE[weights])
    return model


def run(layers: int, weights: str) -> str:
    from transformers.integrations.executorch import convert_and_export_with_cache

    model = _model(layers, weights)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = {"prefill": convert_and_export_with_cache(model, torch.zeros(1, 16, dtype=torch.long), torch.arange(16)),
               "decode": convert_and_export_with_cache(model, torch.zeros(1, 1, dtype=torch.long), torch.tensor([16]))}
    exported = time.perf_counter() - start
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    start = time.perf_counter()
    lowered = td.lower(eps, config=config, progress=False)
    lowering = time.perf_counter() - start
    decode = next(m for m in lowered.program.methods if m.name == "decode")
    traffic = method_traffic(decode)
    launches = sum(len(d.plan.launches) for d in decode.delegates)
    constants = sum(c.nbytes for c in lowered.program.constants)
    return (f"{weights}: export {exported:.1f} s, lower {lowering:.1f} s, constants {constants / 1e9:.2f} GB, "
            f"decode {launches} launches, {(traffic['bytes_read'] + traffic['bytes_written']) / 1e6:.0f} MB")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="bf16,int8,int4", help=f"comma-separated, of {', '.join(QUANTIZE)}")
    parser.add_argument("--layers", type=int, default=16)
    opts = parser.parse_args(argv)
    for weights in opts.weights.split(","):
        print(run(opts.layers, weights), flush=True)
        gc.collect()  # the last model's graphs hold reference cycles
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB")


if __name__ == "__main__":
    main()
