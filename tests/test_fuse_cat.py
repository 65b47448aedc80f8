"""Copies into adjacent slices of one buffer run as one ``cat`` launch (kernels/fuse_cat.py,
layout.cat_kernel): a cat's parts, and a tensor filled slice by slice by updates that write in place
into a result nothing else reads (kernels/scatter.py ``_spent``)."""

from __future__ import annotations

import pytest
import torch

import tritondelegate as td
from harness import Fn, assert_close, check_launches, lower_resident, plan_launches
from tritondelegate.kernels.traffic import launch_access

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]


def _kernels(launches) -> list[str]:
    return [launch.kernel for launch in launches]


def _values(shape, dtype):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, shape, dtype=dtype)
    return torch.randn(shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_three_parts_along_a_middle_dim_one_of_them_broadcast(dtype):
    torch.manual_seed(0)
    a, b, c = _values((2, 3, 5), dtype), _values((2, 4, 5), dtype), _values((1, 1, 5), dtype)
    model = Fn(lambda a, b, c: torch.cat((a, b, c.expand(2, 2, 5)), 1))
    launches = check_launches(model, (a, b, c), dtype=dtype if dtype.is_floating_point else torch.float32)
    assert _kernels(launches) == ["cat"]
    assert launches[0].constexprs["PARTS"].value == 3


def test_parts_of_other_dtypes_are_cast_as_eager_casts_them():
    torch.manual_seed(0)
    args = (torch.randn(3, 2).half(), torch.randn(3, 5), torch.randn(3, 1).bfloat16())
    model = Fn(lambda a, b, c: torch.cat((a, b, c), -1))
    lowered = lower_resident(model, args)
    got = lowered.load().load_method("forward")(*args)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, model(*args), atol=0, rtol=0)
    assert _kernels(plan_launches(lowered)) == ["cat"]


@pytest.mark.parametrize("parts, kernels", [
    (5, ["cat", "pointwise"]), (8, ["cat", "cat"]), (9, ["cat", "cat", "pointwise"])])
def test_more_parts_than_one_launch_takes(parts, kernels):
    torch.manual_seed(0)
    xs = [torch.randn(2, k + 1, 3) for k in range(parts)]
    launches = check_launches(Fn(lambda *xs: torch.cat(xs, 1)), xs)
    assert _kernels(launches) == kernels


def test_a_part_a_pointwise_op_computes_stays_fused_into_its_slice():
    """``x.cos()`` is computed straight into its slice (one chain launch); the plain copies around it
    still merge, each run of them apart."""
    torch.manual_seed(0)
    x = torch.randn(3, 6, 7)
    model = Fn(lambda x: torch.cat([x[..., :2], x[..., 1:3], x.cos(), x[..., 4:], x[..., :1]], -1))
    launches = check_launches(model, (x,))
    assert _kernels(launches) == ["cat", "pointwise_chain", "cat"]


def test_a_tensor_filled_slice_by_slice_in_either_order():
    """DeepSeek's key: an empty tensor, its per-head part, then its rotary part broadcast over the heads.
    The second update writes into the first's result (nothing else reads it): one launch, either order."""
    torch.manual_seed(0)

    def fill(kp, kr, first_rope: bool):
        k = kp.new_empty(2, 4, 7, 16)
        if first_rope:
            k[..., 8:] = kr.expand(2, 4, 7, 8)
            k[..., :8] = kp
        else:
            k[..., :8] = kp
            k[..., 8:] = kr.expand(2, 4, 7, 8)
        return k

    args = (torch.randn(2, 4, 7, 8), torch.randn(2, 1, 7, 8))
    for first_rope in (False, True):
        launches = check_launches(Fn(lambda kp, kr: fill(kp, kr, first_rope) * 2), args)
        assert _kernels(launches) == ["cat", "pointwise"], first_rope


def test_an_update_whose_base_is_read_again_copies_it():
    """The first update's result is also returned: the second must not write into it."""
    torch.manual_seed(0)

    def fill(x, a):
        y = x.clone()
        y[:, :2] = a
        z = y.clone()
        z[:, 2:] = a.sum(-1, keepdim=True)
        return y, z

    args = (torch.randn(3, 5), torch.randn(3, 2))
    lowered = lower_resident(Fn(fill), args)
    got = lowered.load().load_method("forward")(*args)
    for g, e in zip(got, Fn(fill)(*args)):
        torch.testing.assert_close(g, e)


# (cat, the second part's width, the lengths run): off the cat dim; along it (a cache's past rows and the
# new ones, the parts' ends then the method's symbols)
DYNAMIC = {"off_the_cat_dim": (lambda a, b: torch.cat((a, b), -1), 4, (2, 9, 32)),
           "along_the_cat_dim": (lambda a, b: torch.cat((a, b, a[:, :1]), 1), 3, (2, 17, 32))}


@pytest.mark.parametrize("case", sorted(DYNAMIC))
def test_dynamic_sizes(case):
    torch.manual_seed(0)
    fn, width, lengths = DYNAMIC[case]
    model, seq = Fn(fn), torch.export.Dim("seq", min=2, max=32)
    lowered = lower_resident(model, (torch.randn(2, 5, 3), torch.randn(2, 5, width)),
                             dynamic_shapes={"args": ({1: seq}, {1: seq})})
    assert _kernels(plan_launches(lowered)) == ["cat"]
    method = lowered.load().load_method("forward")
    for n in lengths:
        args = (torch.randn(2, n, 3), torch.randn(2, n, width))
        assert_close(method(*args), model(*args))


def test_the_cat_launch_moves_each_byte_once():
    torch.manual_seed(0)
    args = (torch.randn(4, 3), torch.randn(4, 5), torch.randn(1, 2))
    lowered = lower_resident(Fn(lambda a, b, c: torch.cat((a, b, c.expand(4, 2)), 1)), args)
    delegate = lowered.program.methods[0].delegates[0]
    (launch,) = delegate.plan.launches
    reads, writes = launch_access(delegate.plan, launch)
    assert sum(reads.values()) == (4 * 3 + 4 * 5 + 2) * 4  # the broadcast part's two values once
    assert sum(writes.values()) == 4 * 10 * 4
    assert launch.flops == 0


def test_a_saved_program_with_a_cat_launch_loads_verified_and_runs(tmp_path):
    """The runtime side: the file's cat launch passes the footprint check at load and runs."""
    torch.manual_seed(0)
    args = (torch.randn(3, 2, 4), torch.randn(3, 5, 4))
    lowered = lower_resident(Fn(lambda a, b: torch.cat((b, a), 1)), args)
    lowered.save(tmp_path / "cat.tdp")
    program = td.load(tmp_path / "cat.tdp", devices="simulated")
    torch.testing.assert_close(program.load_method("forward")(*args), torch.cat((args[1], args[0]), 1))
