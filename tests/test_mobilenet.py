"""MobileNetV2 from a transformers config (random weights, nothing downloaded): every compute node
delegated (its TF-style ``constant_pad_nd`` and ReLU6 ``hardtanh`` included), one launch per
convolution (its padding read in place, its ReLU6 or residual add in its epilogue) and the logits of
eager."""

from __future__ import annotations

import collections

import pytest
import torch

import tritondelegate as td
from harness import assert_close
from tritondelegate.decompose import decompose

transformers = pytest.importorskip("transformers")


class Classifier(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values, return_dict=False)[0]


def test_mobilenet_v2_is_fully_delegated_and_matches_eager():
    # narrow (channels not rounded to 8, expansion 2) so the interpreter runs it in seconds; weights
    # drawn wide enough that the logits are O(10), not the default init's 1e-30
    config = transformers.MobileNetV2Config(image_size=32, depth_multiplier=0.1, min_depth=2, depth_divisible_by=1,
                                            expand_ratio=2, finegrained_output=False, initializer_range=0.5,
                                            num_labels=4)
    model = Classifier(transformers.MobileNetV2ForImageClassification(config).eval())
    x = torch.randn(1, 3, 32, 32)
    ep = torch.export.export(model, (x,))
    ops = collections.Counter(str(n.target) for n in decompose(ep).graph.nodes if n.op == "call_function")
    assert ops["aten.constant_pad_nd.default"] > 0 and ops["aten.hardtanh.default"] > 0
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    lowered = td.lower(ep, config=config)
    nodes = lowered.reports["forward"].nodes
    assert nodes.host == [] and nodes.delegated == nodes.total
    assert len(lowered.program.methods[0].delegates) == 1
    kernels = collections.Counter(launch.kernel for d in lowered.program.methods[0].delegates
                                  for launch in d.plan.launches)
    convs = ops["aten.convolution.default"]
    depthwise = sum(1 for n in decompose(ep).graph.nodes if n.target == torch.ops.aten.convolution.default
                    and n.args[8] == n.args[0].meta["val"].shape[1])  # groups == C_in
    # every block's depthwise convolution runs in its 1x1 projection's launch (kernels/fuse_conv1x1.py)
    assert depthwise > 0 and kernels["conv1x1"] == depthwise and "depthwise_conv" not in kernels, kernels
    assert kernels["conv2d"] + 2 * depthwise == convs and "pad" not in kernels
    assert sum(kernels.values()) <= convs - depthwise + 3
    logits = lowered.load().load_method("forward")(x)
    with torch.no_grad():
        expected = model(x)
    assert expected.abs().max() > 1
    assert_close(logits, expected)
