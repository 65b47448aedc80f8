"""Host cost of one kernel launch: chains of 1 and 64 tiny adds on an [8] tensor, through the runtime
(a lowered method, device tensors in and out), as plain Triton launches of the runtime's pointwise kernel
and of a minimal kernel, and as eager ops."""

from bench import harness


def test_launch(benchmark, bench, chain, impl):
    benchmark.group = "launch"
    call, facts = harness.launch_runner(chain, impl, bench.stream)
    _, timing = harness.measure(benchmark, call, bench.stream, "launch")
    seconds = harness.median_s(benchmark)
    launches = facts["launches"]
    benchmark.extra_info.update(
        impl=impl, ops=chain, device=harness.DEVICE, numel=harness.LAUNCH_NUMEL, **facts,
        us_per_launch=seconds / launches * 1e6 if seconds and launches else None, **timing,
    )
