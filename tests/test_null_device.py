"""The null device: the whole runtime runs, memory is real, copies and launches are counted but not done."""

import warnings

import torch

import tritondelegate as td
from tritondelegate.models import demo_decoder


def test_null_device_runs_the_runtime_without_doing_the_work():
    model, example = demo_decoder(seed=0, n_layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(torch.export.export(model, example), config=td.LowerConfig(
            propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))
    program = lowered.load("null")
    assert program.device == "null"
    allocator = program.allocators["cuda"]
    method = program.load_method("forward", graphs=True)
    for _ in range(3):
        out = method(*example)
    assert out.shape == model(*example).shape
    assert not out.any()  # nothing was computed or copied back
    stats = method.stats
    assert stats.launches == 3 * stats.launches_per_call > 0
    assert stats.call_h2d_bytes == example[0].nbytes and stats.call_d2h_bytes == out.nbytes
    assert allocator.copied_bytes["load"] == stats.load_h2d_bytes  # counted, not copied
    assert stats.load_h2d_bytes >= sum(p.nbytes for p in model.parameters())
    assert program.memory()["cuda:0"]["constants"] >= allocator.copied_bytes["load"]
    assert stats.graph_replays_per_call == 1
