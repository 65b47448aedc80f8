"""sort, topk and histc on the device (kernels/ranking.py, histogram.py), and the integer and floor
division a Mixture-of-Experts router computes with them: each against eager, on the simulated device.

PyTorch leaves the order of equal values' indices to the implementation (CPU topk, an unstable sort);
ours is stable, so indices are compared with ``sort(stable=True)`` and, for topk, through the values
they pick."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from harness import Fn, check_dynamic, lower_resident, plan_launches
from tritondelegate.kernels import ranking

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _run(fn, *args):
    lowered = lower_resident(Fn(fn), args)
    assert not lowered.reports["forward"].nodes.host, lowered.reports["forward"].nodes.host
    return lowered, lowered.load().load_method()(*args)


def _equal(got, expected):
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)


def _values(dtype, *shape):
    """Random values with repeats (ties), a NaN, an inf and a -inf."""
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0 if dtype == torch.uint8 else -5, 6, shape, dtype=dtype)
    x = torch.randint(-20, 20, shape).to(dtype) / 4
    flat = x.view(-1)
    flat[1], flat[-2], flat[len(flat) // 2] = float("nan"), float("inf"), float("-inf")
    return x


@pytest.mark.parametrize("dtype", FLOATS + (torch.int64, torch.int32, torch.uint8, torch.bool))
def test_sort_is_stable_along_any_dim_both_ways(dtype):
    torch.manual_seed(0)
    x = _values(dtype, 3, 37, 5)
    cases = [lambda t: torch.sort(t, stable=True), lambda t: torch.sort(t, dim=1, descending=True, stable=True),
             lambda t: torch.sort(t, dim=0, stable=True)]
    _, got = _run(lambda t: tuple(v for case in cases for v in case(t)), x)
    _equal(got, [v for case in cases for v in case(x)])


def test_a_long_row_spans_several_programs_and_loop_steps():
    torch.manual_seed(0)
    x = _values(torch.float32, 2, 300)  # BLOCK_I 64 x BLOCK_J 128: 5 programs a row, 3 steps each
    lowered, got = _run(lambda t: torch.sort(t.t(), dim=0, descending=True, stable=True), x)
    _equal(got, torch.sort(x.t(), dim=0, descending=True, stable=True))
    (launch,) = plan_launches(lowered)
    assert launch.kernel == "rank" and launch.grid == (2, 5)


@pytest.mark.parametrize("dtype", FLOATS + (torch.int64,))
def test_topk_largest_and_smallest_pick_the_values_eager_picks(dtype):
    torch.manual_seed(1)
    x = _values(dtype, 4, 9, 6)
    cases = [lambda t: torch.topk(t, 3), lambda t: torch.topk(t, 2, dim=1, largest=False),
             lambda t: torch.topk(t, 4, dim=0), lambda t: torch.topk(t, 6)]
    _, got = _run(lambda t: tuple(v for case in cases for v in case(t)), x)
    dims = [-1, 1, 0, -1]
    for k, case in enumerate(cases):
        values, indices = got[2 * k], got[2 * k + 1]
        _equal([values], [case(x).values])
        _equal([torch.take_along_dim(x, indices, dims[k])], [values])  # the indices pick those values
        # ties come in index order (a stable sort's first k)
        largest = k != 1
        _equal([indices], [torch.sort(x, dim=dims[k], descending=largest, stable=True).indices.narrow(
            dims[k], 0, indices.shape[dims[k]])])


def test_sort_of_a_dynamic_length():
    torch.manual_seed(2)
    calls = [(torch.randint(0, 8, (n,)),) for n in (40, 1, 17)]
    check_dynamic(Fn(lambda t: torch.sort(t, stable=True)), calls, {"args": ({0: Dim("n", min=1, max=64)},)})


def test_rows_past_the_bound_stay_on_the_host_with_the_reason():
    x = torch.randn(ranking.MAX_LENGTH + 1)
    lowered = td.lower(torch.export.export(Fn(lambda t: torch.sort(t + 1)), (x,)))
    ((name, op, reason),) = lowered.reports["forward"].nodes.host
    assert op == "aten.sort.default" and "compares every pair" in reason and str(ranking.MAX_LENGTH) in reason


@pytest.mark.parametrize("dtype", FLOATS)
def test_histc_counts_like_eager(dtype):
    torch.manual_seed(3)
    x = (torch.randn(7, 41) * 3).to(dtype)
    x[0, :3] = torch.tensor([float("nan"), 2.5, -2.0])  # NaN counts nowhere; max goes to the last bin
    cases = [lambda t: torch.histc(t, 9, -2, 2.5), lambda t: torch.histc(t.t()[::2], 300, -1, 1),
             lambda t: torch.histc(t[1:], 5), lambda t: torch.histc(t[:1, 5:6], 4)]  # data's range; one value
    _, got = _run(lambda t: tuple(case(t) for case in cases), x)
    _equal(got, [case(x) for case in cases])


def test_division_modes_match_eager_on_signs_zeros_and_infinities():
    a = torch.tensor([7.0, -7.0, 7.0, -7.0, 0.0, -0.0, 5.0, float("inf"), -7.5, 1e-30, 3.0])
    b = torch.tensor([2.0, 2.0, -2.0, -2.0, 3.0, 3.0, 0.0, 2.0, 2.5, -1.0, float("inf")])
    i, j = torch.arange(-9, 9), torch.tensor([4, -4, 3, -3, 7, -7, 1, -1, 2] * 2)

    def fn(a, b, i, j):
        return (torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc"), a % b,
                torch.fmod(a, b), i // j, torch.div(i, j, rounding_mode="trunc"), i % j, torch.fmod(i, j), i // 4,
                torch.remainder(i, -3))

    _, got = _run(fn, a, b, i, j)
    expected = fn(a, b, i, j)
    _equal(got, expected)
    assert torch.equal(got[0].signbit(), expected[0].signbit())  # -0.0 where eager has it


def _deepseek_v3(transformers):
    """DeepSeek-V3's router: sigmoid scores plus a correction bias, the top 1 of 2 expert groups by their
    top-2 sum, the other group masked out (``masked_fill(~mask)``), then the top 2 of 8 experts; layer 0
    dense, layer 1 routed with a shared expert."""
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, rope_scaling=None))


# (name, (sort and top-k launches, router launches, group router launches, sort and offsets launches)): the
# softmax routers' top-k is a router launch (kernels/router.py), their sort and offsets one sort_offsets;
# DeepSeek-V3's one routed layer chooses its experts by groups (sigmoid scores) in one group_router launch
MOES = [("mixtral", (0, 2, 0, 2)), ("qwen3_moe", (0, 2, 0, 2)), ("olmoe", (0, 2, 0, 2)),
        ("deepseek_v3", (0, 0, 1, 1))]


@pytest.mark.parametrize("name, counts", MOES)
def test_a_moe_router_runs_whole_on_the_device(name, counts):
    transformers = pytest.importorskip("transformers")
    from test_grouped_mm import _moe

    torch.manual_seed(0)
    model = (_deepseek_v3(transformers) if name == "deepseek_v3" else _moe(transformers, name)).eval()
    args = (torch.randint(0, 96, (1, 9)),)
    lowered = lower_resident(Fn(lambda ids: model(ids, use_cache=False).logits), args)
    report = lowered.reports["forward"]
    assert report.nodes.delegated == report.nodes.total and len(report.launches) == 1  # one delegate, no sync
    kernels = [launch.kernel for launch in plan_launches(lowered)]
    assert tuple(kernels.count(k) for k in ("rank", "router", "group_router", "sort_offsets")) == counts
    with torch.no_grad():
        expected = model(*args, use_cache=False).logits
    torch.testing.assert_close(lowered.load().load_method()(*args), expected, atol=1e-4, rtol=1e-4)
