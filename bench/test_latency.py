"""Latency of one call, per model and mode, side by side: per_call_copy, resident, resident_io, eager,
torch_compile (see harness.py for what each mode is). Measures only; asserts nothing about time."""

from bench import harness


def test_latency(benchmark, bench, case, mode):
    benchmark.group = f"latency {case.name}"
    call, facts = bench.prepare(case).runner(mode)
    out, timing = harness.measure(benchmark, call, bench.stream, "latency")
    benchmark.extra_info.update(facts(out), **timing)
