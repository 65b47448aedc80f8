"""Decode tokens/s of greedy generation with a KV cache, per mode: the cache copied every call, the
cache as program state on the device, the same with CUDA graphs, and transformers' Llama with its
static cache in eager PyTorch (see bench/generation.py). Measures only; asserts nothing about time."""

from bench import harness


def test_generation(benchmark, gen_bench, gen_case, gen_mode):
    benchmark.group = f"generation {gen_case.name}"
    call, facts = gen_bench.runner(gen_case, gen_mode)
    out, timing = harness.measure(benchmark, call, gen_bench.stream, "generation")
    seconds = harness.median_s(benchmark)
    benchmark.extra_info.update(
        gen_bench.common_facts(gen_case, gen_mode), **facts(out), **timing,
        decode_tokens_per_s=gen_case.steps / seconds if seconds else None,
    )
