"""A Mixture-of-Experts router's softmax, top-k and renormalization in one launch (passes/fuse_router.py,
kernels/router.py). Each form transformers writes, against eager on the same logits: every dtype, rows
of 4 to 300 experts (one and several rank chunks), k from 1 to the row, leading dims, strided logits,
ties; and what must stay apart stays."""

from __future__ import annotations

import pytest
import torch

from harness import FLOAT_DTYPES, TOLERANCES, Fn, lower_resident, plan_launches

F = torch.nn.functional


def _softmax_topk(k, renormalize=True, to=None, upcast=False):
    """Mixtral's router (Qwen-MoE's and OLMoE's with norm_topk_prob as ``renormalize``)."""
    def route(logits):
        p = F.softmax(logits.float() if upcast else logits, dim=-1)
        v, i = torch.topk(p, k, dim=-1)
        if renormalize:
            v = v / v.sum(dim=-1, keepdim=True)
        return (v if to is None else v.to(to)), i
    return route


def _topk_softmax(k, to=None):
    """GPT-OSS's and GraniteMoE's: the top k logits, then their softmax."""
    def route(logits):
        v, i = torch.topk(logits, k, dim=-1)
        v = F.softmax(v, dim=1 if logits.dim() == 2 else -1, dtype=v.dtype)
        return (v if to is None else v.to(to)), i
    return route


def _check(fn, logits, dtype):
    lowered = lower_resident(Fn(fn), (logits,))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["router"], plan_launches(lowered)
    values, indices = lowered.load().load_method()(logits)
    want_values, want_indices = fn(logits)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(values, want_values, atol=atol, rtol=rtol)
    # the experts chosen, in order; two probabilities a rounding apart may come in either order, so
    # the choice is judged by the logits it picks
    picked = logits.float().gather(-1, indices)
    torch.testing.assert_close(picked, logits.float().gather(-1, want_indices), atol=atol, rtol=rtol)
    return lowered


@pytest.mark.parametrize("experts, k", [(4, 1), (8, 2), (60, 4), (128, 8), (300, 300)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_softmax_top_k_and_renormalization_are_one_launch(experts, k, dtype):
    torch.manual_seed(experts)
    logits = (torch.randn(5, experts) * 3).to(dtype)
    lowered = _check(_softmax_topk(k, upcast=dtype != torch.float32, to=dtype), logits, dtype)
    (launch,) = plan_launches(lowered)
    assert launch.constexprs["SOFTMAX_FIRST"].value and launch.constexprs["RENORMALIZE"].value
    assert launch.grid == (5,)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_without_renormalization_and_with_the_softmax_in_the_logits_dtype(dtype):
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 60).to(dtype)  # rows over two leading dims
    lowered = _check(_softmax_topk(4, renormalize=False), logits, dtype)
    (launch,) = plan_launches(lowered)
    want = {torch.float32: "", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    assert launch.constexprs["ROUND"].value == want and not launch.constexprs["RENORMALIZE"].value


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("experts, k", [(32, 4), (200, 2)])
def test_top_k_then_softmax_is_one_launch(experts, k, dtype):
    torch.manual_seed(2)
    logits = torch.randn(7, experts).to(dtype)
    lowered = _check(_topk_softmax(k, to=torch.float32), logits, dtype)
    assert not plan_launches(lowered)[0].constexprs["SOFTMAX_FIRST"].value


def test_strided_logits_and_ties_keep_index_order():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0]] * 3).t()  # [6, 3] read transposed: rows of 6
    fn = lambda x: _softmax_topk(4)(x.t())  # noqa: E731  three equal logits: chosen in index order
    lowered = lower_resident(Fn(fn), (logits,))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["router"]
    values, indices = lowered.load().load_method()(logits)
    assert indices.tolist() == [[1, 2, 4, 5]] * 3
    torch.testing.assert_close(values, fn(logits)[0])


def test_what_else_reads_the_steps_keeps_them_apart():
    def shared(x):  # the probabilities are returned too
        p = F.softmax(x, -1)
        return torch.topk(p, 2)[0], p

    def smallest(x):  # the k smallest: not a router
        return torch.topk(F.softmax(x, -1), 2, largest=False)

    def summed(x):  # the sum is returned too
        v, i = torch.topk(F.softmax(x, -1), 2)
        s = v.sum(-1, keepdim=True)
        return v / s, i, s

    x = torch.randn(3, 8)
    for fn in (shared, smallest, summed):
        lowered = lower_resident(Fn(fn), (x,))
        kernels = [launch.kernel for launch in plan_launches(lowered)]
        if fn is summed:  # the softmax and top-k still fuse; the renormalization stays apart
            assert kernels[0] == "router" and not plan_launches(lowered)[0].constexprs["RENORMALIZE"].value
        else:
            assert "router" not in kernels, fn.__name__
        for got, want in zip(lowered.load().load_method()(x), fn(x)):
            torch.testing.assert_close(got, want)


def test_rows_longer_than_a_program_holds_stay_softmax_and_rank():
    x = torch.randn(1, 1100)
    lowered = lower_resident(Fn(_softmax_topk(2)), (x,))
    assert "router" not in [launch.kernel for launch in plan_launches(lowered)]


# --- group-limited routers (DeepSeek-V3) ----------------------------------------------------------
class GroupRouter(torch.nn.Module):
    """transformers' DeepseekV3TopkRouter after its linear: sigmoid scores, a bias for the choice, the
    best groups by the sum of their two best, the best experts of those, weights from the scores."""

    def __init__(self, experts, n_group, topk_group, k, norm=True, scale=2.5):
        super().__init__()
        self.register_buffer("bias", torch.randn(experts) * 0.05)
        self.n_group, self.topk_group, self.k, self.norm, self.scale = n_group, topk_group, k, norm, scale

    def forward(self, logits):
        scores = logits.sigmoid()
        choice = scores + self.bias
        groups = choice.view(-1, self.n_group, choice.shape[-1] // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(groups)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, choice.shape[-1] // self.n_group)
        choice = choice.masked_fill(~score_mask.reshape(-1, choice.shape[-1]).bool(), float("-inf"))
        indices = torch.topk(choice, k=self.k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        if self.norm:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * self.scale, indices


def _by_expert(weights, indices):
    """Each row's (expert, weight) pairs in expert order: top-k with sorted=False promises no order."""
    order = indices.argsort(-1)
    return weights.gather(-1, order), indices.gather(-1, order)


@pytest.mark.parametrize("experts, n_group, topk_group, k, norm", [
    (8, 2, 1, 2, True), (64, 8, 4, 6, True), (256, 8, 4, 8, False), (40, 4, 2, 3, True)])
def test_group_limited_routing_is_one_launch(experts, n_group, topk_group, k, norm):
    torch.manual_seed(experts)
    model = GroupRouter(experts, n_group, topk_group, k, norm)
    logits = torch.randn(5, experts) * 2
    lowered = lower_resident(model, (logits,))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["pointwise", "group_router"]  # sigmoid
    got = _by_expert(*lowered.load().load_method()(logits))
    want = _by_expert(*model(logits))
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_bias_of_a_bf16_model_is_one_launch_too(bias_dtype):
    """A model cast to bf16 casts the choice bias too; its router still scores in fp32, and the add
    promotes the bias exactly, as the kernel's fp32 load of it does."""
    torch.manual_seed(1)
    model = GroupRouter(64, 8, 4, 6).to(bias_dtype)
    logits = torch.randn(5, 64) * 2
    lowered = lower_resident(model, (logits,))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["pointwise", "group_router"]
    got = _by_expert(*lowered.load().load_method()(logits))
    want = _by_expert(*model(logits))
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)


def test_a_group_router_without_its_mask_is_left_to_the_rank_kernels():
    class Plain(GroupRouter):  # no groups: the plain sigmoid router of a top-k, weights gathered
        def forward(self, logits):
            scores = logits.sigmoid()
            indices = torch.topk(scores + self.bias, k=self.k, dim=-1)[1]
            return scores.gather(1, indices), indices

    model = Plain(8, 2, 1, 2)
    logits = torch.randn(3, 8)
    lowered = lower_resident(model, (logits,))
    assert "group_router" not in [launch.kernel for launch in plan_launches(lowered)]
    for got, want in zip(lowered.load().load_method()(logits), model(logits)):
        torch.testing.assert_close(got, want)
