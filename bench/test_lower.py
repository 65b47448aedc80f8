"""Time to lower: ``td.lower`` on an exported demo decoder at a real model's depth (tiny widths, so the
figure is the lowering's own per-node work, not constant sizes). Lowering must stay linear in depth: the
``layers`` pair shows the growth. Runs on any machine (lowering launches nothing)."""

import warnings

import pytest
import torch

import tritondelegate as td
from tritondelegate.models import demo_decoder

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


@pytest.mark.parametrize("layers", (8, 32))
def test_lower(benchmark, layers):
    benchmark.group = "lower"
    model, args = demo_decoder(seed=0, n_layers=layers, dim=16, n_heads=2, n_kv_heads=2, hidden_dim=32,
                               vocab_size=64, max_seq_len=16)
    exported = torch.export.export(model, args)

    def lower():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", td.PerCallCopyWarning)
            return td.lower(exported, config=RESIDENT)

    benchmark.pedantic(lower, rounds=2, iterations=1)
    benchmark.extra_info.update(model="demo decoder", layers=layers, nodes=len(exported.graph.nodes))
