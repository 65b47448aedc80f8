"""Products over pairs of rows of two inputs: ``torch.cdist`` (kernels/distance.py, one launch for any
p; before, on the host, or 7 launches for p = 2 over more than 25 rows) and ``nn.Bilinear``
(``_trilinear`` decomposed by unclaimed.py into two GEMMs, its bias in the second's epilogue; before,
on the host), matching eager."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from harness import Fn, assert_close, lower_resident

P_VALUES = (2.0, 1.0, math.inf, 0.0, 3.0)


def _lowered_and_run(model, args):
    lowered = lower_resident(model, args)
    assert "on the host" not in lowered.summary(), lowered.summary()
    with torch.no_grad():
        return lowered, lowered.load().load_method()(*args)


def _launches(lowered) -> int:
    return sum(lowered.reports["forward"].launches.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cdist_matches_eager_for_each_p(dtype):
    """Small (the direct form in eager), over 25 rows (eager's matmul form for p = 2), and batched with
    broadcasting; each cdist one launch. Eager has no bf16 cdist: bf16 is judged against fp32."""
    torch.manual_seed(0)
    cases = [(torch.randn(5, 3), torch.randn(7, 3)), (torch.randn(33, 17), torch.randn(30, 17) + 0.5),
             (torch.randn(2, 1, 4, 5), torch.randn(3, 6, 5))]
    for x1, x2 in cases:
        args = (x1.to(dtype), x2.to(dtype))
        model = Fn(lambda a, b: tuple(torch.cdist(a, b, p=p) for p in P_VALUES))
        lowered, got = _lowered_and_run(model, args)
        assert _launches(lowered) == len(P_VALUES), lowered.summary()
        want = model(*(a.float() for a in args))
        for g, w in zip(got, want):
            assert g.dtype == dtype
            assert_close(g.float(), w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bilinear_is_two_matmuls(dtype):
    torch.manual_seed(0)
    for model, args in [(nn.Bilinear(5, 7, 9), (torch.randn(11, 5), torch.randn(11, 7))),
                        (nn.Bilinear(4, 3, 2, bias=False), (torch.randn(2, 3, 4), torch.randn(2, 3, 3)))]:
        model, args = model.to(dtype), tuple(a.to(dtype) for a in args)
        lowered, got = _lowered_and_run(model, args)
        assert _launches(lowered) == 2, lowered.summary()
        with torch.no_grad():
            want = model.float()(*(a.float() for a in args))
        assert_close(got.float(), want, dtype)
