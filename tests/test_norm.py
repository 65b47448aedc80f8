import copy

import pytest
import torch

from harness import FLOAT_DTYPES, Fn, check_model, export_decomposed
from tritondelegate.decompose import decompose
from tritondelegate.kernels import norm

COLS = (1, 17, 33, 129, 1025)


class LlamaRMSNorm(torch.nn.Module):
    """The hand-written RMSNorm of Llama-style models: it decomposes to pow/mean/add/rsqrt/mul."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def randomized(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


def check_in(dtype, module, x, **kwargs):
    """Run ``module`` in ``dtype`` and judge it against the fp32 module on the fp32 input."""
    low = copy.deepcopy(module).to(dtype)
    x = x.to(dtype)
    return check_model(low, (x,), reference_args=(module, (x.float(),)), **kwargs)


def kernels(plan):
    return [launch.kernel for launch in plan.launches]


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_is_one_launch(cols, dtype):
    module = randomized(torch.nn.LayerNorm(cols))
    _, plan = check_in(dtype, module, torch.randn(2, 3, cols) * 2 + 1)
    assert kernels(plan) == ["norm"]


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm(cols, dtype):
    module = randomized(torch.nn.RMSNorm(cols))
    _, plan = check_in(dtype, module, torch.randn(5, cols))
    assert kernels(plan) == ["norm"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_llama_rms_norm(dtype):
    # decomposed: pow, mean over the last dim (reduce.py), add, rsqrt, mul
    module = LlamaRMSNorm(129)
    ep = export_decomposed(module, (torch.randn(3, 129),))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.mean.dim in targets
    _, plan = check_in(dtype, module, torch.randn(2, 3, 129))
    assert "reduce" in kernels(plan)


def test_norms_without_weights_and_over_several_dims():
    fn = Fn(lambda x, w: (
        torch.nn.functional.layer_norm(x, (5, 7)),
        torch.nn.functional.layer_norm(x, (7,), eps=1e-2),
        torch.nn.functional.rms_norm(x, (5, 7)),
        torch.nn.functional.rms_norm(x, (7,), w, eps=0.5),
    ))
    check_model(fn, (torch.randn(3, 5, 7), torch.randn(7)))


def test_layer_norm_with_weight_but_no_bias_and_strided_input():
    module = Fn(lambda x, w: torch.nn.functional.layer_norm(x.transpose(1, 2), (17,), w))
    x, w = torch.randn(2, 17, 9), torch.randn(17)
    _, plan = check_model(module, (x, w))
    assert kernels(plan) == ["norm"]  # strided rows and columns need no copy


@pytest.mark.parametrize("read_stats", (False, True))
def test_native_layer_norm_outputs(read_stats):
    w, b = torch.randn(33), torch.randn(33)
    if read_stats:
        fn = Fn(lambda x: torch.native_layer_norm(x, (33,), w, b, 1e-5))
    else:
        fn = Fn(lambda x: torch.native_layer_norm(x, (33,), w, b, 1e-5)[0] * 2)
    _, plan = check_model(fn, (torch.randn(4, 3, 33) + 3,))
    assert plan.launches[0].constexprs["STATS"].value is read_stats


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_looping_rows(monkeypatch, dtype):
    # 32-wide chunks: statistics first (Welford merges for layer norm), then a normalizing pass.
    # A mean of 1000 against a spread of 1 would lose most digits in a sum-of-squares variance
    # (about 3% here); in fp32 the inputs themselves are only 6e-5 apart near 1000, so the
    # outputs agree to about 2e-4 (scale 4).
    monkeypatch.setattr(norm, "MAX_BLOCK_C", 32)
    fn = Fn(lambda x, w, b: (
        torch.native_layer_norm(x, (129,), w, b, 1e-5),
        torch.nn.functional.rms_norm(x, (129,), w),
        torch.nn.functional.layer_norm(x - 1000.0, (2, 129)),
    ))
    args = [(torch.randn(3, 2, 129) + 1000.0).to(dtype), torch.randn(129, dtype=dtype),
            torch.randn(129, dtype=dtype)]
    scale = 4 if dtype == torch.float32 else 1
    check_model(fn, args, dtype=dtype, scale=scale, reference_args=(fn, [a.float() for a in args]))


def test_layer_norm_past_the_block_cap():
    module = randomized(torch.nn.LayerNorm(norm.MAX_BLOCK_C + 3))
    check_in(torch.float16, module, torch.randn(2, norm.MAX_BLOCK_C + 3))


def test_support_reasons():
    def node(fn, x, **kwargs):
        ep = decompose(torch.export.export(Fn(fn), (x,), **kwargs))
        return next(n for n in ep.graph.nodes if n.target == torch.ops.aten.layer_norm.default)

    ln = lambda x: torch.nn.functional.layer_norm(x, (3,))  # noqa: E731
    assert norm.supported(node(ln, torch.randn(2, 3))) is None
    assert "float64" in norm.supported(node(ln, torch.randn(2, 3, dtype=torch.float64)))
    dyn = node(ln, torch.randn(4, 3), dynamic_shapes=(({0: torch.export.Dim("rows")},),))
    assert norm.supported(dyn) is None  # a dynamic dim is the plan's business (test_dynamic_kernels.py)


@pytest.mark.parametrize("shape, groups", [((2, 12, 5, 3), 4), ((3, 8, 17), 8), ((1, 6, 2, 3, 4), 1)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_group_norm(shape, groups, affine, dtype):
    """GroupNorm (wav2vec2's feature extractor, BiT, diffusion UNets): the statistics of each group's
    channels and positions, then one launch computing each channel's scale and shift and applying them
    (rounded once)."""
    from harness import TOLERANCES, lower_resident, plan_launches

    torch.manual_seed(len(shape) + groups)
    model = torch.nn.GroupNorm(groups, shape[1], affine=affine).eval()
    if affine:
        torch.nn.init.normal_(model.weight)
        torch.nn.init.normal_(model.bias)
    x = torch.randn(shape) * 3 + 1
    lowered = lower_resident(model.to(dtype), (x.to(dtype),))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["reduce", "norm_apply"]
    with torch.no_grad():  # against the same rounded operands in fp32
        expected = model.float()(x.to(dtype).float())
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(lowered.load().load_method()(x.to(dtype)).float(), expected, atol=atol, rtol=rtol)


def test_group_norm_statistics_when_read():
    fn = lambda x, w, b: torch.ops.aten.native_group_norm(x, w, b, 2, 6, 20, 3, 1e-5)  # noqa: E731
    args = (torch.randn(2, 6, 4, 5), torch.randn(6), torch.randn(6))
    check_model(Fn(fn), args)


def test_group_norm_with_a_dynamic_batch():
    from harness import lower_resident

    torch.manual_seed(5)
    model = torch.nn.GroupNorm(2, 8).eval()
    torch.nn.init.normal_(model.weight)
    batch = torch.export.Dim("batch", max=4)
    lowered = lower_resident(model, (torch.randn(2, 8, 3, 3),), dynamic_shapes=({0: batch},))
    assert not lowered.reports["forward"].nodes.host
    method = lowered.load().load_method()
    for n in (1, 4):
        x = torch.randn(n, 8, 3, 3)
        torch.testing.assert_close(method(x), model(x), atol=1e-5, rtol=1e-5)
