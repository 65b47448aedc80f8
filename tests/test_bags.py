"""``nn.EmbeddingBag`` (kernels/bags.py): each bag's rows gathered and reduced (sum, mean, max) in one
launch, for bags of one length (a 2-D input) and of varying lengths (offsets, empty bags,
include_last_offset), with padding_idx and per-sample weights, matching eager; before, it ran on the
host. A node whose bag sizes or offset2bag a later node reads stays on the host, saying why."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness import assert_close, lower_resident

INDICES = torch.tensor([1, 2, 4, 5, 4, 3, 2, 16, 0, 2, 7])
OFFSETS = torch.tensor([0, 2, 2, 5, 9])  # bags of 2, 0, 3, 4 and 2 entries


class Weighted(nn.Module):
    """An EmbeddingBag called with offsets and per-sample weights."""

    def __init__(self, **kwargs):
        super().__init__()
        self.bag = nn.EmbeddingBag(17, 33, mode="sum", **kwargs)

    def forward(self, indices, offsets, weights):
        return self.bag(indices, offsets, per_sample_weights=weights)


class Sizes(nn.Module):
    """A bag's means and the bag sizes and offset2bag eager returns with them."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(17, 8))

    def forward(self, indices, offsets):
        return torch.ops.aten._embedding_bag(self.weight, indices, offsets, False, 1)[:3]


def _run(lowered, *args):
    with torch.no_grad():
        return lowered.load().load_method()(*args)


def _one_launch(lowered):
    assert sum(lowered.reports["forward"].launches.values()) == 1, lowered.summary()
    assert "on the host" not in lowered.summary(), lowered.summary()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bags_match_eager(mode):
    torch.manual_seed(0)
    cases = [
        (nn.EmbeddingBag(17, 33, mode=mode), (torch.randint(0, 17, (5, 3)),)),  # bags of one length
        (nn.EmbeddingBag(17, 33, mode=mode, padding_idx=2), (INDICES, OFFSETS)),
        (nn.EmbeddingBag(17, 33, mode=mode, include_last_offset=True), (INDICES, torch.tensor([0, 3, 3, 11]))),
    ]
    for bag, args in cases:
        lowered = lower_resident(bag, args)
        _one_launch(lowered)
        with torch.no_grad():
            assert_close(_run(lowered, *args), bag(*args))


def test_per_sample_weights_in_bfloat16():
    torch.manual_seed(0)
    model = Weighted(padding_idx=4).to(torch.bfloat16)
    args = (INDICES, OFFSETS, torch.randn(len(INDICES)).to(torch.bfloat16))
    lowered = lower_resident(model, args)
    _one_launch(lowered)
    got = _run(lowered, *args)
    assert got.dtype == torch.bfloat16
    with torch.no_grad():
        want = model.float()(*args[:2], args[2].float())
    assert_close(got.float(), want, torch.bfloat16)


def test_a_bag_whose_sizes_are_read_stays_on_the_host():
    model = Sizes()
    lowered = lower_resident(model, (INDICES, OFFSETS))
    assert "offset2bag, bag_size or max_indices is read" in lowered.summary(), lowered.summary()
    with torch.no_grad():
        for got, want in zip(_run(lowered, INDICES, OFFSETS), model(INDICES, OFFSETS)):
            torch.testing.assert_close(got, want)
