"""pytest-benchmark setup for bench/: size lists by device, the shared session state, machine facts.

    pytest bench/ --benchmark-json=bench/results/cpu.json      # run and write results
    pytest bench/ --benchmark-disable                           # smoke check: each case once, quick sizes

``--bench-sizes`` (or ``TD_BENCH_SIZES``) picks the size list: quick, small, large or default
(small + large). ``--benchmark-disable`` defaults to quick. ``--bench-case NAME`` runs one case.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from bench import generation, harness


def pytest_addoption(parser):
    parser.addoption("--bench-sizes", choices=harness.SIZE_GROUPS, default=None,
                     help="size list for bench/ (default: TD_BENCH_SIZES, else 'default'; 'quick' with "
                          "--benchmark-disable)")
    parser.addoption("--bench-case", action="append", default=[],
                     help="run only this case (by name, e.g. mlp-w256-d4 or kv-d64-l2-v256-s64; repeatable), "
                          "whatever its size list")


def pytest_configure(config):
    # The Triton interpreter evaluates masked-off lanes too; numpy's notes about them say nothing here.
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning")


def _size_group(config) -> str:
    chosen = config.getoption("--bench-sizes") or os.environ.get("TD_BENCH_SIZES")
    if chosen:
        return chosen
    return "quick" if config.getoption("benchmark_disable", default=False) else "default"


def pytest_generate_tests(metafunc):
    names = set(metafunc.fixturenames)
    group, picked = _size_group(metafunc.config), metafunc.config.getoption("--bench-case")
    generation_names = generation.case_names()
    if {"case", "mode"} <= names or {"case", "kind"} <= names:
        # --bench-case names a latency case or a generation case: each benchmark takes its own.
        latency_names = [n for n in picked if n not in generation_names]
        chosen = harness.cases(group, latency_names) if latency_names or not picked else []
    if {"case", "mode"} <= names:
        pairs = [(c, m) for c in chosen for m in harness.MODES]
        metafunc.parametrize("case,mode", pairs, ids=[f"{c.name}-{m}" for c, m in pairs])
    elif {"case", "kind"} <= names:
        pairs = [(c, k) for c in chosen for k in harness.LOAD_KINDS[harness.DEVICE]]
        metafunc.parametrize("case,kind", pairs, ids=[f"{c.name}-{k}" for c, k in pairs])
    elif {"gen_case", "gen_mode"} <= names:
        chosen = generation.gen_cases(group, picked)
        pairs = [(c, m) for c in chosen for m in generation.GEN_MODES]
        metafunc.parametrize("gen_case,gen_mode", pairs, ids=[f"{c.name}-{m}" for c, m in pairs])
    elif {"chain", "impl"} <= names:
        pairs = [(n, i) for n in harness.LAUNCH_CHAINS for i in harness.LAUNCH_IMPLS]
        metafunc.parametrize("chain,impl", pairs, ids=[f"{n}x-{i}" for n, i in pairs])


@pytest.fixture(scope="session")
def bench():
    workdir = tempfile.mkdtemp(prefix="td-bench-")
    try:
        yield harness.Bench(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def gen_bench(bench):
    return generation.GenBench(bench.workdir, bench.stream)


def pytest_benchmark_update_machine_info(config, machine_info):
    picked = config.getoption("--bench-case")
    sizes = f"cases {', '.join(picked)}" if picked else _size_group(config)
    machine_info["tritondelegate"] = {**harness.environment(), "sizes": sizes}
