"""A cat of adjacent slices of one tensor becomes the slice they tile, a view (passes/cat_slices.py):
a partial rotary's ``cat((q_rot, q_pass), -1)`` once the projection's epilogue rotated q in place."""

from __future__ import annotations

import pytest
import torch

from harness import FLOAT_DTYPES, Fn, Logits, assert_close, check_dynamic, lower_resident, plan_launches



def _rewrites(lowered) -> list[str]:
    return [f for f in lowered.reports["forward"].fused if f.startswith("cat of adjacent slices")]


def _check(fn, args, rewritten: bool, dtype=torch.float32):
    lowered = lower_resident(Fn(fn), args)
    assert bool(_rewrites(lowered)) == rewritten, lowered.reports["forward"].fused
    got = lowered.load().load_method("forward")(*args)
    expected = fn(*args)
    for g, e in zip(got if isinstance(got, (list, tuple)) else [got], expected if isinstance(expected, tuple) else [expected]):
        assert_close(g, e, dtype=dtype)
    return lowered


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_adjacent_slices_become_the_tensor(dtype):
    # y * 2 then its two halves put back together: no copy launch, one pointwise for y * 2 and the add.
    def whole(x):
        y = x * 2
        return torch.cat((y[..., :3], y[..., 3:]), dim=-1) + 1

    lowered = _check(whole, (torch.randn(2, 5, 8, dtype=dtype),), True, dtype)
    assert len(plan_launches(lowered)) == 1


def test_three_parts_tiling_a_middle_range_become_a_slice():
    def middle(x):
        y = x.exp()
        return torch.cat((y[:, 1:3], y[:, 3:4], y[:, 4:7]), dim=1).sin()

    lowered = _check(middle, (torch.randn(3, 9, 4),), True)
    assert [launch.kernel for launch in plan_launches(lowered)] == ["pointwise", "pointwise"]


@pytest.mark.parametrize("case", ["gap", "order", "other_tensor", "other_dim", "returned", "input"])
def test_what_is_not_a_view_is_not_rewritten(case):
    def fn(x, z):
        y, w = x * 2, z * 3
        parts = {
            "gap": (y[..., :3], y[..., 4:]),
            "order": (y[..., 3:], y[..., :3]),
            "other_tensor": (y[..., :3], w[..., 3:]),
            "other_dim": (y[:2], y[2:]),  # sliced along dim 0, put together along dim 1
            "returned": (y[..., :3], y[..., 3:]),
            "input": (x[..., :3], x[..., 3:]),
        }[case]
        cat = torch.cat(parts, dim=-1)
        return cat if case == "returned" else cat + 1

    _check(fn, (torch.randn(4, 8), torch.randn(4, 8)), False)


@pytest.mark.parametrize("of_the_buffer", [True, False])
def test_a_buffer_written_later(of_the_buffer):
    # Slices of the cache itself stay a copy (the cat reads it before index_copy_ writes it: a view
    # would see the write); slices of a value computed from it become a view (that value is its own).
    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(6, 4))

        def forward(self, pos, x):
            y = self.cache if of_the_buffer else self.cache * 2.0
            before = torch.cat((y[:2], y[2:]), dim=0)
            self.cache.index_copy_(0, pos, x)
            return before + 0

    lowered = lower_resident(Cache(), (torch.tensor([1]), torch.randn(1, 4)))
    assert bool(_rewrites(lowered)) != of_the_buffer
    model = Cache()
    method = lowered.load().load_method("forward")
    for step in range(3):
        pos, x = torch.tensor([step]), torch.randn(1, 4)
        assert_close(method(pos, x), model(pos, x))


def test_dynamic_sizes_off_the_cat_dim():
    seq = torch.export.Dim("seq", min=2, max=12)

    def fn(x):
        y = x.sigmoid()
        return torch.cat((y[..., :5], y[..., 5:]), dim=-1) * 3

    lowered, _ = check_dynamic(Fn(fn), [(torch.randn(1, n, 8),) for n in (2, 12, 7)], {"args": ({1: seq},)})
    assert _rewrites(lowered)


@pytest.mark.parametrize("kind", ["phi", "gpt_neox"])
def test_partial_rotary_models_lose_their_cat_copies(kind):
    import transformers

    torch.manual_seed(0)
    if kind == "phi":
        config = transformers.PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64)
        model = transformers.PhiForCausalLM(config)
    else:
        config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25)
        model = transformers.GPTNeoXForCausalLM(config)
    model = Logits(model.eval())
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    lowered = lower_resident(model, (ids,))
    assert len(_rewrites(lowered)) == 4  # q and k of each of the 2 layers
    assert sum(lowered.reports["forward"].launches.values()) == 12  # 20 with the copies
    with torch.no_grad():
        assert_close(lowered.load().load_method("forward")(ids), model(ids))


def test_a_view_of_the_cat_keeps_it_when_the_slice_is_not_contiguous():
    # y.t() sliced along its rows and put back is y.t(), which `view` cannot flatten: the cat stays.
    def fn(x):
        y = (x * 2).t()
        return torch.cat((y[:, :3], y[:, 3:]), dim=1).view(-1) + 1

    _check(fn, (torch.randn(8, 4),), False)

    def contiguous(x):
        y = x * 2
        return torch.cat((y[:3], y[3:]), dim=0).view(-1) + 1

    _check(contiguous, (torch.randn(8, 4),), True)
