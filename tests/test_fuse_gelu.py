"""A tanh GELU written out (GPT-2's NewGELUActivation) becomes one aten.gelu, fused into the epilogue
of the matmul before it (passes/fuse_gelu.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, TOLERANCES, check_dynamic

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
K = math.sqrt(2.0 / math.pi)

FORMS = {
    "gpt2": lambda x: 0.5 * x * (1.0 + torch.tanh(K * (x + 0.044715 * torch.pow(x, 3.0)))),
    "reordered": lambda x: (x * (1.0 + torch.tanh((0.044715 * (x * x * x) + x) * K))) * 0.5,
}


class LinearGelu(torch.nn.Module):
    def __init__(self, form, also_return=False):
        super().__init__()
        self.lin = torch.nn.Linear(24, 40)
        self.form, self.also_return = FORMS[form], also_return

    def forward(self, x):
        h = self.lin(x)
        if self.also_return:  # the tanh is read outside the pattern too
            t = torch.tanh(K * (h + 0.044715 * torch.pow(h, 3.0)))
            return 0.5 * h * (1.0 + t), t
        return (self.form(h),)


def _lower(model, args):
    return td.lower(torch.export.export(model, args), config=RESIDENT)


def _launches(lowered):
    return [launch for d in lowered.program.methods[0].delegates for launch in d.plan.launches]


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gelu_runs_in_the_matmul_epilogue(form, dtype):
    torch.manual_seed(0)
    model = LinearGelu(form).eval()
    x = torch.randn(3, 5, 24)
    lowered = _lower(model.to(dtype), (x.to(dtype),))
    assert len(lowered.reports["forward"].fused) == 1
    (launch,) = _launches(lowered)
    assert launch.kernel == "matmul" and launch.constexprs["EOP0"].value == "gelu_tanh"
    (out,) = lowered.load().load_method("forward")(x.to(dtype))
    (expected,) = model.float()(x)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_an_intermediate_read_elsewhere_keeps_the_pattern():
    torch.manual_seed(0)
    model = LinearGelu("gpt2", also_return=True).eval()
    x = torch.randn(4, 24)
    lowered = _lower(model, (x,))
    assert lowered.reports["forward"].fused == []
    for got, expected in zip(lowered.load().load_method("forward")(x), model(x)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_dynamic_rows():
    torch.manual_seed(0)
    lowered, _ = check_dynamic(LinearGelu("gpt2").eval(), [(torch.randn(n, 24),) for n in (5, 1, 13, 7)],
                               {"x": {0: Dim("rows", max=13)}})
    assert len(_launches(lowered)) == 1


def test_gpt2_layers_take_five_launches():
    transformers = pytest.importorskip("transformers")
    from harness import Logits

    torch.manual_seed(0)
    counts = {}
    for layers in (1, 2):
        config = transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=64, n_positions=64)
        model = Logits(transformers.GPT2LMHeadModel(config).eval())
        args = (torch.randint(0, 64, (1, 7)),)
        lowered = _lower(model, args)
        counts[layers] = len(_launches(lowered))
        with torch.no_grad():
            torch.testing.assert_close(lowered.load().load_method("forward")(*args), model(*args),
                                       atol=1e-4, rtol=1e-4)
    # layer norm + QKV, attention, projection + residual, layer norm + fc + gelu, projection + residual
    # (each layer norm the prologue of the matmul after it)
    assert counts[2] - counts[1] == 5
