"""A Mixture-of-Experts dispatch's order of its chosen expert ids and its offsets per expert in one launch
(``tritondelegate::sort_offsets``, kernels/sort_offsets.py; passes/expert_dispatch.py rewrite 7): the
stable sort's values and permutation and the cumulative counts exactly as eager's, on the simulated
device, with ties everywhere, experts no token picks, 1 to 512 experts, k = 1 to 8, int32 and int64 ids
and a dynamic number of tokens."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from harness import Fn, check_dynamic, lower_resident, plan_launches


def _order(experts: int, descending=False, dtype=torch.int32):
    """transformers' dispatch bookkeeping (grouped_mm_experts_forward), stable as the device sorts."""
    def fn(top_k_index):
        ids, perm = torch.sort(top_k_index.view(-1), stable=True, descending=descending)
        counts = torch.histc(ids.float(), bins=experts, min=0, max=experts - 1)
        return ids, perm, torch.cumsum(counts, 0, dtype=dtype)
    return fn


def _chosen(tokens: int, k: int, experts: int, dtype, skip=(), seed=0):
    """Each token's k distinct experts, none of ``skip`` (experts no token picks)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(experts) if e not in skip])
    rows = [pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(tokens)]
    return torch.stack(rows).to(dtype)


# (tokens, k, experts, id dtype, descending, programs): ranks over 3 programs and bins over 2; a decode
# step's 8 ids and 128 experts, 512 experts from 6 int32 ids, and a single expert (histc's own range: bins
# 1, min = max) each in one program
CASES = [
    (40, 4, 256, torch.int32, False, 3),
    (9, 1, 4, torch.int64, False, 1),
    (1, 8, 128, torch.int64, True, 1),
    (3, 2, 512, torch.int32, False, 1),
    (6, 1, 1, torch.int64, False, 1),
]


@pytest.mark.parametrize("tokens, k, experts, dtype, descending, programs", CASES)
def test_order_and_offsets_are_one_launch_equal_to_eager(tokens, k, experts, dtype, descending, programs):
    skip = {0, experts // 3, experts - 1} if experts > 3 else ()
    index = _chosen(tokens, k, experts, dtype, skip, seed=tokens)
    fn = _order(experts, descending, torch.int64 if dtype == torch.int64 else torch.int32)
    lowered = lower_resident(Fn(fn), (index,))
    (launch,) = plan_launches(lowered)
    assert launch.kernel == "sort_offsets" and launch.grid == (programs,)
    got = lowered.load().load_method()(index)
    expected = fn(index)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_a_dynamic_number_of_tokens():
    """One program plan for every token count up to 64 (8 ids each, 60 experts): 37, 1 and 64 tokens."""
    calls = [(_chosen(n, 8, 60, torch.int64, skip={5}, seed=n),) for n in (37, 1, 64)]
    lowered, _ = check_dynamic(Fn(_order(60)), calls, {"args": ({0: Dim("tokens", min=1, max=64)},)})
    assert [launch.kernel for launch in plan_launches(lowered)] == ["sort_offsets"]


def test_counts_of_ids_no_sort_ordered_stay_apart():
    def unsorted(index):  # the offsets count ids that no sort ordered: the sort stays a rank of its own
        ids = index.view(-1)
        offs = torch.cumsum(torch.histc(ids.float(), 8, 0, 7), 0, dtype=torch.int32)
        values, perm = torch.sort(ids + 1, stable=True)
        return values, perm, offs

    index = _chosen(5, 2, 8, torch.int64)
    lowered = lower_resident(Fn(unsorted), (index,))
    assert sorted(launch.kernel for launch in plan_launches(lowered)) == ["histc", "pointwise", "rank"]
    got, expected = lowered.load().load_method()(index), unsorted(index)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
