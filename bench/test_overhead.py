"""The runtime's own host cost per call and per launch, on the null device (memory real, copies and
launches counted but not done), for the demo decoder: what a call costs the host before any GPU work.

Runs on any machine; on a GPU machine it isolates the runtime from the device. ``us_per_launch`` is
the call's host time divided by its kernel launches (per-call work included), so it is an upper bound
on the per-launch overhead.
"""

import warnings

import pytest
import torch

import tritondelegate as td
from bench import harness
from tritondelegate.models import demo_decoder

OVERHEAD_MODES = ("launches", "graphs")


@pytest.fixture(scope="module")
def decoder_program():
    model, example = demo_decoder(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(torch.export.export(model, example), config=td.LowerConfig(
            propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))
    return lowered, example


@pytest.mark.parametrize("mode", OVERHEAD_MODES)
def test_null_device_overhead(benchmark, decoder_program, mode):
    benchmark.group = "overhead"
    lowered, example = decoder_program
    method = lowered.load("null").load_method("forward", graphs=mode == "graphs")
    for _ in range(3):  # the second call records the graph
        method(*example)
    benchmark.pedantic(method, args=example, rounds=200, iterations=10, warmup_rounds=5)
    seconds = harness.median_s(benchmark)
    launches = method.stats.launches_per_call
    benchmark.extra_info.update(
        model="demo decoder", device="null", mode=mode, launches_per_call=launches,
        us_per_call=seconds * 1e6 if seconds else None,
        us_per_launch=seconds / launches * 1e6 if seconds and launches else None,
    )


@pytest.fixture(scope="module")
def dynamic_program():
    """The demo decoder exported once for every prompt length up to 64 (``Dim("seq", max=64)``)."""
    model, example = demo_decoder(seed=0)
    ep = torch.export.export(model, example, dynamic_shapes={"input_ids": {1: torch.export.Dim("seq", max=64)}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(ep, config=td.LowerConfig(
            propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))
    return lowered, model


@pytest.mark.parametrize("sizes", ["one", "alternating"])
def test_null_device_overhead_dynamic(benchmark, dynamic_program, sizes):
    """A dynamic method's host cost per call at sizes it has seen: binding the symbols and looking up
    the size's prebound launches (its expressions were evaluated on the first call at that size);
    compare ``us_per_launch`` with the static decoder's."""
    benchmark.group = "overhead"
    lowered, model = dynamic_program
    method = lowered.load("null").load_method("forward")
    lengths = [16] if sizes == "one" else [16, 5, 33, 64]
    inputs = [(torch.randint(0, model.cfg.vocab_size, (1, n)),) for n in lengths]
    for args in inputs:  # first call per size: evaluate its sizes, prebind its launches
        method(*args)
    state = {"i": 0}

    def call():
        args = inputs[state["i"] % len(inputs)]
        state["i"] += 1
        return method(*args)

    benchmark.pedantic(call, rounds=200, iterations=len(inputs) * 2, warmup_rounds=5)
    seconds = harness.median_s(benchmark)
    launches = method.stats.launches_per_call
    benchmark.extra_info.update(
        model="demo decoder, dynamic seq <= 64", device="null", mode=f"dynamic, {sizes} size(s)",
        launches_per_call=launches, us_per_call=seconds * 1e6 if seconds else None,
        us_per_launch=seconds / launches * 1e6 if seconds and launches else None,
    )
