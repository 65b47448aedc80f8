"""Decode tokens/s of greedy generation with a KV cache, per mode: the cache copied every call, the
cache as program state on the device, the same with CUDA graphs, and transformers' Llama with its
static cache in eager PyTorch; and transformers' Mixtral, a Mixture-of-Experts model, lowered and
eager (see bench/generation.py). Measures only; asserts nothing about time."""

import pytest

from bench import generation, harness


def test_generation(benchmark, gen_bench, gen_case, gen_mode):
    if gen_case.moe and gen_mode not in generation.MOE_MODES:
        pytest.skip(f"{gen_mode} varies the demo decoder's lowering; a MoE case runs {', '.join(generation.MOE_MODES)}")
    benchmark.group = f"generation {gen_case.name}"
    call, facts = gen_bench.runner(gen_case, gen_mode)
    out, timing = harness.measure(benchmark, call, gen_bench.stream, "generation")
    seconds = harness.median_s(benchmark)
    benchmark.extra_info.update(
        gen_bench.common_facts(gen_case, gen_mode), **facts(out), **timing,
        decode_tokens_per_s=gen_case.steps / seconds if seconds else None,
    )
