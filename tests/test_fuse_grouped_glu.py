"""A Mixture-of-Experts layer's gated experts as one grouped GEMM with the gating in its epilogue
(passes/fuse_grouped_glu.py, ``GLU`` in kernels/grouped_mm.py): ``act(gate) * up`` of a grouped GEMM
split in halves becomes ``tritondelegate::glu_grouped_mm`` over the weight's halves interleaved once
by constant folding. Each case against eager on the same inputs, in every dtype, both variants (per
row and segment tiles), either half the gate; what must stay written out stays."""

from __future__ import annotations

import copy

import pytest
import torch

from harness import FLOAT_DTYPES, TOLERANCES, Fn, lower_resident, plan_launches

pytest.importorskip("transformers.integrations.moe")
GMM = torch.ops.transformers.grouped_mm_fallback
F = torch.nn.functional


class Experts(torch.nn.Module):
    """transformers' experts: gate_up [E, 2N, K] read transposed, chunked, gated; down after it."""

    def __init__(self, E, K, N, dtype, act=F.silu, gate_first=True):
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * N, K).to(dtype) / K ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(E, K, N).to(dtype) / N ** 0.5)
        self.act, self.gate_first = act, gate_first

    def forward(self, x, offs):
        gate, up = GMM(x, self.gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
        if not self.gate_first:
            gate, up = up, gate
        return GMM(self.act(gate) * up, self.down.transpose(1, 2), offs)


def _kernels(lowered) -> list:
    return [(l.kernel, l.constexprs["GLU"].value if l.kernel == "grouped_mm" else None) for l in plan_launches(lowered)]


# (rows, rows per expert): per-row tiles (decode) and segment tiles, experts without rows, a tail
@pytest.mark.parametrize("rows, counts", [(3, [1, 0, 2]), (37, [0, 17, 3, 9])])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gated_experts_run_in_one_grouped_gemm(rows, counts, dtype):
    torch.manual_seed(0)
    model = Experts(len(counts), 24, 20, dtype).eval()
    args = (torch.randn(rows, 24).to(dtype), torch.tensor(counts).cumsum(0).to(torch.int32))
    lowered = lower_resident(model, args)
    assert _kernels(lowered) == [("grouped_mm", "silu"), ("grouped_mm", "")]
    # the interleaved weight replaces the written-out one: constants stored once
    assert sum(c.nbytes for c in lowered.constant_data) == sum(p.nbytes for p in model.parameters())
    with torch.no_grad():  # against the same rounded weights and inputs in fp32
        expected = copy.deepcopy(model).float()(args[0].float(), args[1])
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(lowered.load().load_method()(*args).float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("act", [F.gelu, F.relu])
def test_the_second_half_may_be_the_gate_and_other_activations(act):
    torch.manual_seed(1)
    model = Experts(3, 16, 12, torch.float32, act=act, gate_first=False).eval()
    args = (torch.randn(20, 16), torch.tensor([5, 9, 20], dtype=torch.int32))
    lowered = lower_resident(model, args)
    assert _kernels(lowered)[0] == ("grouped_mm", {F.gelu: "gelu", F.relu: "relu"}[act])
    with torch.no_grad():
        expected = model(*args)
    torch.testing.assert_close(lowered.load().load_method()(*args), expected, atol=1e-5, rtol=1e-5)


def test_a_weight_that_is_an_input_or_a_result_read_twice_stays_written_out():
    torch.manual_seed(2)
    w = torch.randn(2, 8, 12)
    offs = torch.tensor([3, 5], dtype=torch.int32)

    def fn(x, w, offs):  # the weight is a method input: nothing to interleave once
        gate, up = GMM(x, w, offs).chunk(2, dim=-1)
        return F.silu(gate) * up

    def twice(x, offs):  # the gate's half is also returned
        gate, up = GMM(x, w, offs).chunk(2, dim=-1)
        return F.silu(gate) * up, gate

    x = torch.randn(5, 8)
    for f, args in ((Fn(fn), (x, w, offs)), (Fn(twice), (x, offs))):
        lowered = lower_resident(f, args)
        assert ("grouped_mm", "") in _kernels(lowered) and ("grouped_mm", "silu") not in _kernels(lowered)
        got, expected = lowered.load().load_method()(*args), f(*args)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


class Weighted(Experts):
    """The experts' outputs weighted per row (each token's routing weight), as transformers' MoE blocks
    do after down: a chain that reads the grouped GEMM's whole result runs in its epilogue."""

    def forward(self, x, offs, weights):
        gate, up = GMM(x, self.gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
        h = (F.silu(gate) * up) * 0.5 + 1.0  # a chain after the gating: the GLU launch's epilogue too
        return GMM(h, self.down.transpose(1, 2), offs) * weights[:, None]


@pytest.mark.parametrize("rows, counts", [(3, [1, 0, 2]), (37, [0, 17, 3, 9])])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_chains_that_read_a_grouped_result_run_in_its_epilogue(rows, counts, dtype):
    torch.manual_seed(3)
    model = Weighted(len(counts), 24, 20, dtype).eval()
    args = (torch.randn(rows, 24).to(dtype), torch.tensor(counts).cumsum(0).to(torch.int32), torch.rand(rows).to(dtype))
    lowered = lower_resident(model, args)
    launches = plan_launches(lowered)
    assert [(l.kernel, l.constexprs["GLU"].value, l.constexprs["EPILOGUE"].value) for l in launches] == [
        ("grouped_mm", "silu", 2), ("grouped_mm", "", 1)]
    with torch.no_grad():
        expected = copy.deepcopy(model).float()(args[0].float(), args[1], args[2].float())
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(lowered.load().load_method()(*args).float(), expected, atol=atol, rtol=rtol)
