"""Load time of the resident constants, next to plain copies of the same bytes measured in the same run:
pinned and pageable host-to-device on CUDA, a host copy on the simulated device."""

from bench import harness


def test_load(benchmark, bench, case, kind):
    benchmark.group = f"load {case.name}"
    call, nbytes = harness.load_runner(bench, case, kind)
    _, timing = harness.measure(benchmark, call, bench.stream, "load")
    seconds = harness.median_s(benchmark)
    benchmark.extra_info.update(
        model=case.name, family=case.family, kind=kind, device=harness.DEVICE, bytes=nbytes,
        weight_bytes=bench.weight_bytes(case), gb_per_s=nbytes / seconds / 1e9 if seconds else None, **timing,
    )
