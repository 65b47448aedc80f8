"""A gated MLP's gate and up projections become one GEMM over their interleaved weights with the
gating in the kernel (``passes/fuse_glu.py``, ``tritondelegate::glu_linear``, ``matmul.py``'s GLU)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tritondelegate as td
import tritondelegate.passes.fuse as fuse_module
from harness import TOLERANCES, Fn, check_dynamic
from tritondelegate.models import demo_decoder

RESIDENT = td.PropagateDeviceConfig(skip_h2d_for_constants=True)
ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) + x; odd widths (24 in, 40 hidden: not powers of two)."""

    def __init__(self, act="silu", dim=24, hidden=40, bias=False, swap=False):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=bias), nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.act, self.swap = ACTS[act], swap

    def forward(self, x):
        g, u = self.act(self.gate(x)), self.up(x)
        return self.down(u * g if self.swap else g * u) + x


def _lower(model, args, dynamic_shapes=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        ep = torch.export.export(model, tuple(args), dynamic_shapes=dynamic_shapes)
        return td.lower(ep, config=td.LowerConfig(propagate_device=RESIDENT))


def _glu(lowered) -> list[str]:
    return [d for d in lowered.reports["forward"].fused if d.startswith("gated MLP")]


def _launches(lowered) -> list:
    return [launch for d in lowered.program.methods[0].delegates for launch in d.plan.launches]


def _check(model, x, reference, dtype):
    lowered = _lower(model, (x,))
    out = lowered.load().load_method("forward")(x)
    with torch.no_grad():
        expected = reference(x.float() if x.is_floating_point() else x)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    return lowered


@pytest.mark.parametrize("act,bias,swap", [("silu", False, False), ("gelu_tanh", True, True),
                                            ("gelu", False, True), ("relu", True, False)])
def test_gated_mlp_is_one_gemm_fp32(act, bias, swap):
    torch.manual_seed(0)
    model = GatedMLP(act, bias=bias, swap=swap).eval()
    lowered = _check(model, torch.randn(2, 5, 24), model, torch.float32)
    assert len(_glu(lowered)) == 1, lowered.reports["forward"].fused
    launches = _launches(lowered)
    assert [launch.kernel for launch in launches] == ["matmul", "matmul"]  # glu GEMM; down + residual
    assert launches[0].constexprs["GLU"].value == act
    # Only the interleaved weight is stored: gate's and up's own weights are gone.
    names = {c.name for c in lowered.program.constants}
    assert not {"gate.weight", "up.weight", "gate.bias", "up.bias"} & names, names


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gated_mlp_half_precision(dtype):
    torch.manual_seed(0)
    reference = GatedMLP("silu").eval()
    model = GatedMLP("silu").eval()
    model.load_state_dict(reference.state_dict())
    lowered = _check(model.to(dtype), torch.randn(3, 24).to(dtype), reference, dtype)
    assert len(_glu(lowered)) == 1


def test_unfused_baseline_has_one_more_launch(monkeypatch):
    torch.manual_seed(0)
    model, x = GatedMLP("silu").eval(), torch.randn(2, 5, 24)
    fused = len(_launches(_lower(model, (x,))))
    monkeypatch.setattr(fuse_module, "fuse_glu", lambda ep, state: [])
    assert len(_launches(_lower(model, (x,)))) == fused + 1


class ReadTwice(GatedMLP):
    """The gate's activation is also returned: the pattern stays written out, and stays correct."""

    def forward(self, x):
        g = self.act(self.gate(x))
        return self.down(g * self.up(x)), g


def test_intermediate_read_elsewhere_is_not_fused():
    torch.manual_seed(0)
    model, x = ReadTwice("silu").eval(), torch.randn(4, 24)
    lowered = _lower(model, (x,))
    assert _glu(lowered) == []
    out = lowered.load().load_method("forward")(x)
    for r, e in zip(out, model(x)):
        torch.testing.assert_close(r, e, atol=1e-5, rtol=1.3e-6)


def test_gated_mlp_returned_directly():
    torch.manual_seed(0)
    gate, up = nn.Linear(16, 20, bias=False), nn.Linear(16, 20, bias=False)

    class Returned(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = gate, up

        def forward(self, x):
            return F.silu(self.gate(x)) * self.up(x)

    model, x = Returned().eval(), torch.randn(3, 16)
    lowered = _check(model, x, model, torch.float32)
    assert len(_glu(lowered)) == 1 and len(_launches(lowered)) == 1


def test_demo_decoder_layer_has_seven_launches():
    """The demo decoder's MLP (SwiGLU, after an RMSNorm): gate/up in one GEMM with the norm as its
    prologue; every output still matches eager."""
    model, (ids,) = demo_decoder(seed=0, n_layers=1, dim=32, hidden_dim=48, vocab_size=64)
    lowered = _check(model, ids[:, :6], model, torch.float32)
    assert len(_glu(lowered)) == 1
    glu = [launch for launch in _launches(lowered) if "GLU" in launch.constexprs]
    assert len(glu) == 1 and glu[0].constexprs["PROLOGUE"].value == "rms"


def test_gated_mlp_dynamic_rows():
    torch.manual_seed(0)
    model = GatedMLP("silu").eval()
    rows = torch.export.Dim("rows", min=1, max=12)
    calls = [(torch.randn(n, 24),) for n in (1, 7, 12)]
    lowered, _ = check_dynamic(model, calls, ({0: rows},), example=calls[1])
    assert len(_glu(lowered)) == 1


def test_activation_times_a_scalar_is_not_a_gated_mlp():
    torch.manual_seed(0)
    lin = nn.Linear(16, 20)
    model = Fn(lambda x: F.silu(lin(x)) * 0.5)
    model.lin = lin
    lowered = _check(model.eval(), torch.randn(3, 16), model, torch.float32)
    assert _glu(lowered) == []


class ChunkedMLP(nn.Module):
    """Phi-3's MLP: gate and up as one ``gate_up`` linear, chunked in halves; ``gate_first``: which
    half is the gate."""

    def __init__(self, act="silu", dim=24, hidden=40, bias=False, gate_first=True):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.act, self.gate_first = ACTS[act], gate_first

    def forward(self, x):
        a, b = self.gate_up(x).chunk(2, dim=-1)
        gate, up = (a, b) if self.gate_first else (b, a)
        return self.down(up * self.act(gate)) + x


@pytest.mark.parametrize("act,bias,gate_first", [("silu", False, True), ("gelu", True, False)])
def test_chunked_gate_up_is_one_gemm(act, bias, gate_first):
    torch.manual_seed(0)
    model = ChunkedMLP(act, bias=bias, gate_first=gate_first).eval()
    lowered = _check(model, torch.randn(2, 5, 24), model, torch.float32)
    assert len(_glu(lowered)) == 1, lowered.reports["forward"].fused
    launches = _launches(lowered)
    assert [launch.kernel for launch in launches] == ["matmul", "matmul"]
    assert launches[0].constexprs["GLU"].value == act
    assert "gate_up.weight" not in {c.name for c in lowered.program.constants}


def test_chunked_gate_up_half_precision_and_a_half_read_elsewhere():
    torch.manual_seed(0)
    reference = ChunkedMLP("silu").eval()
    model = ChunkedMLP("silu").eval()
    model.load_state_dict(reference.state_dict())
    lowered = _check(model.to(torch.bfloat16), torch.randn(3, 24).to(torch.bfloat16), reference, torch.bfloat16)
    assert len(_glu(lowered)) == 1
    # the up half also returned: the pattern stays written out, and correct
    model = ChunkedUpReturned("silu").eval()
    x = torch.randn(3, 24)
    lowered = _lower(model, (x,))
    assert _glu(lowered) == []
    with torch.no_grad():
        for got, want in zip(lowered.load().load_method("forward")(x), model(x)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class ChunkedUpReturned(ChunkedMLP):
    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(up * self.act(gate)), up
