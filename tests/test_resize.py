"""The resize kernel (kernels/resize.py): F.interpolate's nearest, nearest-exact, (bi/tri)linear and bicubic
modes over 1 to 3 spatial dims against eager, one launch per resize, in every float dtype; scale factors
up and down, explicit sizes, align_corners, strided inputs read in place, NaN and inf where eager's CPU
kernels put them, the ``.default`` overloads, bounded dynamic batch, height and width; its footprint and
traffic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from harness import (FLOAT_DTYPES, Fn, check_dynamic, check_model, export_decomposed, lower_resident,
                     plan_launches, run_delegated, run_program)
from tritondelegate.kernels import resize

aten = torch.ops.aten
SCALES = (2, 1.5, 0.5)


def _variants(mode: str, sizes: tuple, **kwargs) -> list:
    """(mode, F.interpolate kwargs): each scale factor of SCALES, and each output size of ``sizes``."""
    return ([(mode, dict(scale_factor=s, **kwargs)) for s in SCALES]
            + [(mode, dict(size=size, **kwargs)) for size in sizes])


def _corners(mode: str, sizes: tuple) -> list:
    return _variants(mode, sizes, align_corners=False) + _variants(mode, sizes, align_corners=True)


CASES = {  # spatial dims -> (input shape, variants)
    1: ((2, 3, 7), _variants("nearest", ((11,), (4,))) + _variants("nearest-exact", ((11,),))
        + _corners("linear", ((11,), (4,)))),
    2: ((2, 3, 5, 6), _variants("nearest", ((7, 9), (9, 11))) + _variants("nearest-exact", ((7, 9), (3, 4)))
        + _corners("bilinear", ((7, 9), (9, 11))) + _corners("bicubic", ((7, 9), (3, 4)))),
    3: ((1, 2, 3, 4, 5), _variants("nearest", ((4, 5, 7),)) + _variants("nearest-exact", ((2, 5, 3),))
        + _corners("trilinear", ((4, 5, 7),))),
}


def _interpolate_all(variants):
    """One model computing every variant: one export, one launch each."""
    return Fn(lambda x: tuple(F.interpolate(x, mode=mode, **kw) for mode, kw in variants))


def _kernels(plan) -> list:
    return [launch.kernel for launch in plan.launches]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("dims", sorted(CASES))
def test_every_mode_against_eager_in_one_launch_each(dims, dtype):
    shape, variants = CASES[dims]
    x = torch.randn(shape).to(dtype)
    model = _interpolate_all(variants)
    _, plan = check_model(model, (x,), reference_args=(model, (x.float(),)))
    assert _kernels(plan) == ["resize"] * len(variants)


def test_nearest_picks_exactly_eagers_source_pixels():
    """Index arithmetic in fp32 as eager's: floor(o * scale), floor((o + 0.5) * scale), and the 2-D
    kernel's copy (out == in) and halving (out == 2 * in) at scale factors that are neither 1 nor 2."""
    x = torch.arange(2 * 3 * 5 * 7, dtype=torch.float32).reshape(2, 3, 5, 7)
    fns = [lambda x: F.interpolate(x, scale_factor=(1.1, 2.1), mode="nearest"),  # 5 -> 5, 7 -> 14
           lambda x: F.interpolate(x, scale_factor=(2.19, 1.1), mode="nearest"),  # 5 -> 10, 7 -> 7
           lambda x: F.interpolate(x[:, :, 0], scale_factor=1.1, mode="nearest"),  # 1-D: no copy
           lambda x: F.interpolate(x[:, :, :, None], scale_factor=(1.3, 1.1, 1), mode="nearest"),  # 3-D
           lambda x: F.interpolate(x, size=(13, 4), mode="nearest-exact"),
           lambda x: F.interpolate(x[:, :, 0], scale_factor=0.37, mode="nearest-exact")]
    model = Fn(lambda x: tuple(fn(x) for fn in fns))
    results, plan = run_delegated(model, (x,))
    assert _kernels(plan) == ["resize"] * len(fns)
    for got, want in zip(results, model(x)):
        assert torch.equal(got, want)


def test_nearest_of_uint8_images():
    x = torch.randint(0, 256, (1, 3, 5, 6), dtype=torch.uint8)
    model = Fn(lambda x: (F.interpolate(x, scale_factor=2), F.interpolate(x, size=(3, 4), mode="nearest-exact")))
    results, plan = run_delegated(model, (x,))
    assert _kernels(plan) == ["resize", "resize"]
    for got, want in zip(results, model(x)):
        assert got.dtype == torch.uint8 and torch.equal(got, want)


@pytest.mark.parametrize("layout", ["channels_last", "permuted"])
def test_a_strided_input_is_read_in_place(layout):
    x = torch.randn(2, 6, 5, 3)
    x = x.permute(0, 3, 1, 2) if layout == "permuted" else x.contiguous(memory_format=torch.channels_last)
    variants = [("nearest", dict(scale_factor=2)), ("bilinear", dict(size=(7, 9))),
                ("bicubic", dict(scale_factor=0.5, align_corners=True))]
    model = _interpolate_all(variants)
    _, plan = check_model(model, (x,))
    assert _kernels(plan) == ["resize"] * len(variants)  # no copy first


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in numpy
def test_nan_and_inf_propagate_as_in_eager():
    """Every tap is weighted, a zero weight too: a copy (out == in) of inf is inf * 1 + inf * 0 = NaN in
    eager's linear kernel, and a source index scale * (o + 0.5) - 0.5 rounded once (eager's fused
    multiply-add) leaves a tap's weight just above 0, so inf stays inf."""
    x = torch.tensor([[[float("inf"), 1.0, 2.0, float("nan"), -3.0]]])
    fns = [lambda x: F.interpolate(x, size=5, mode="linear"),
           lambda x: F.interpolate(x, size=5, mode="linear", align_corners=True),
           lambda x: F.interpolate(x[:, :, :1], size=3, mode="linear"),
           lambda x: F.interpolate(x, scale_factor=1.7, mode="linear"),
           lambda x: F.interpolate(x[:, None], size=(3, 7), mode="bicubic"),
           lambda x: F.interpolate(x, scale_factor=0.6, mode="nearest")]
    model = Fn(lambda x: tuple(fn(x) for fn in fns))
    results, _ = run_delegated(model, (x,))
    for got, want in zip(results, model(x)):
        torch.testing.assert_close(got, want, equal_nan=True, atol=1e-6, rtol=1e-6)


def test_default_overloads_take_their_scales_and_sizes():
    """The ``.default`` overloads name the output size and, optionally, each dim's scale factor (which
    then sets the source index, whatever the size). Export's decomposition keeps them whole but for
    bilinear and bicubic, which its retrace decomposes through their Python autograd kernels: a graph
    that holds them (exported, not decomposed) lowers to one launch each too."""
    x = torch.randn(2, 3, 5, 6)
    fns = [lambda x: aten.upsample_nearest2d.default(x, [7, 9], 1.5, None),
           lambda x: aten._upsample_nearest_exact1d.default(x[0], [9], 2.5),
           lambda x: aten.upsample_nearest3d.default(x[None], [2, 6, 4], 0.7, None, 0.5),
           lambda x: aten.upsample_linear1d.default(x[0], [13], False),
           lambda x: aten.upsample_trilinear3d.default(x[None], [3, 6, 4], False, None, 1.5, None)]
    model = Fn(lambda x: tuple(fn(x) for fn in fns))
    _, plan = check_model(model, (x,))
    assert _kernels(plan) == ["resize"] * len(fns)
    fns = [lambda x: aten.upsample_bilinear2d.default(x, [9, 11], False, 1.7, 2.0),
           lambda x: aten.upsample_bilinear2d.default(x, [4, 4], True, 1.7, 2.0),  # corners: scales ignored
           lambda x: aten.upsample_bicubic2d.default(x, [8, 3], False, None, 0.6)]
    model = Fn(lambda x: tuple(fn(x) for fn in fns))
    results, plan = run_program(torch.export.export(model, (x,)), (x,))
    assert _kernels(plan) == ["resize"] * len(fns)
    for got, want in zip(results, model(x)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class Resize(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, x):
        return F.interpolate(x, **self.kwargs)


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_a_dynamic_batch(mode):
    lowered, _ = check_dynamic(Resize(scale_factor=1.5, mode=mode), [(torch.randn(b, 2, 4, 5),) for b in (2, 1, 3)],
                               ({0: Dim("batch", max=3)},))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["resize"]


@pytest.mark.parametrize("mode, scale", [("nearest", 2), ("bilinear", 1.5), ("nearest-exact", 0.5),
                                         ("bicubic", 2)])
def test_a_dynamic_height_and_width(mode, scale):
    # the output size int(scale * h) is exact integer arithmetic for these scales: (3 * h) // 2 for 1.5;
    # h, w >= 4: export specializes a size that could make an output size 1
    dims = ({2: Dim("h", min=4, max=7), 3: Dim("w", min=4, max=9)},)
    calls = [(torch.randn(1, 2, h, w),) for h, w in ((5, 6), (4, 9), (7, 4), (6, 5))]
    lowered, _ = check_dynamic(Resize(scale_factor=scale, mode=mode), calls, dims)
    assert [launch.kernel for launch in plan_launches(lowered)] == ["resize"]


def test_a_dynamic_size_taken_from_another_tensor():
    """An FPN's top-down path: the coarse map resized to the fine map's (dynamic) size, then added."""
    class TopDown(torch.nn.Module):
        def forward(self, coarse, fine):
            return F.interpolate(coarse, size=fine.shape[-2:], mode="nearest") + fine

    h = Dim("h", min=2, max=8)
    calls = [(torch.randn(1, 3, a, a + 1), torch.randn(1, 3, 2 * a, 2 * a + 2)) for a in (5, 2, 8, 3)]
    lowered, _ = check_dynamic(TopDown(), calls, ({2: h, 3: h + 1}, {2: 2 * h, 3: 2 * h + 2}))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["resize", "pointwise"]


def test_a_scaled_dynamic_size_prints_as_exact_integer_arithmetic():
    """int(scale * size) in double, as export traces F.interpolate's output size, is (p * size) // q for
    scale = p / q wherever the double product is exact; a scale whose product rounds is refused."""
    import sympy
    from torch.utils._sympy.functions import ToFloat, TruncToInt

    from tritondelegate.kernels import sizes

    s = sympy.Symbol("s0", integer=True, positive=True)
    with sizes.symbol_ranges({s: (2, 1000)}):
        expr = sizes.to_plan(TruncToInt(sympy.Float(1.5) * ToFloat(s)))
        assert expr.text == "((3*s0)//(2))" and expr.bound == 1500
        assert all(expr.evaluate({"s0": n}) == int(n * 1.5) for n in range(2, 1001))
        assert sizes.to_plan(TruncToInt(sympy.Float(0.375) * ToFloat(2 * s))).text == "((3*2*s0)//(8))"
        with pytest.raises(sizes.SymbolicShapeError, match="rounds in double"):
            sizes.to_plan(TruncToInt(sympy.Float(1 / 3) * ToFloat(s)))


def _node(fn, x):
    ep = export_decomposed(Fn(fn), (x,))
    return next(n for n in ep.graph.nodes if n.op == "call_function" and n.target._opname.startswith(
        ("upsample", "_upsample")))


def test_unsupported_dtypes_are_refused_with_the_reason():
    node = _node(lambda x: F.interpolate(x, scale_factor=2), torch.randn(1, 2, 3, 3, dtype=torch.float64))
    assert "dtype torch.float64 is not supported" in resize.supported(node)
    x = torch.randint(0, 9, (1, 2, 3, 3), dtype=torch.uint8)
    ep = torch.export.export(Fn(lambda x: aten.upsample_bilinear2d.vec(x, None, False, [2.0, 2.0])), (x,))
    node = next(n for n in ep.graph.nodes if n.target is aten.upsample_bilinear2d.vec)
    assert "dtype torch.uint8 is not supported" in resize.supported(node)


# --- footprint and traffic ------------------------------------------------------------------------
def _launch(fn, x):
    (launch,) = plan_launches(lower_resident(Fn(fn), (x,)))
    assert launch.kernel == "resize"
    return launch


def test_traffic_counts_the_taps_read_and_the_output_once():
    x = torch.randn(1, 2, 8, 8)
    # a 2x nearest downsample reads every other row and column: a quarter of the input
    launch = _launch(lambda x: F.interpolate(x, scale_factor=0.5), x)
    assert (launch.bytes_read, launch.bytes_written, launch.flops) == (2 * 16 * 4, 2 * 16 * 4, 0)
    # bilinear upsampling reads the whole input once; 3 lerps of 3 FLOPs per output element
    launch = _launch(lambda x: F.interpolate(x, size=(12, 10), mode="bilinear"), x)
    assert (launch.bytes_read, launch.bytes_written, launch.flops) == (2 * 64 * 4, 2 * 120 * 4, 2 * 120 * 9)
    # bicubic 4x downsampling: at most 4 taps per output row and column, 5 rows of 4 multiply-adds
    launch = _launch(lambda x: F.interpolate(x, scale_factor=0.25, mode="bicubic"), x)
    assert (launch.bytes_read, launch.flops) == (2 * 64 * 4, 2 * 4 * 35)
    launch = _launch(lambda x: F.interpolate(x, size=(8, 1), mode="bicubic"), x)
    assert launch.bytes_read == 2 * 8 * 4 * 4


def test_the_footprint_covers_the_input_and_refuses_an_empty_one():
    from tritondelegate.kernels.table import KERNELS
    from tritondelegate.runtime.delegate import DelegateError
    from tritondelegate.runtime.footprints import RULES, LaunchArgs, kernel_parameters

    launch = _launch(lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear"), torch.randn(2, 3, 5, 8))
    names = kernel_parameters(KERNELS["resize"])[0]
    ints = {name: arg.value for name, arg in zip(names, launch.args) if not name.endswith("_ptr")}
    constexprs = {name: arg.value for name, arg in launch.constexprs.items()}
    footprint = RULES["resize"].footprint(LaunchArgs("here", ints, constexprs, tuple(launch.grid)))
    x, out = footprint.accesses
    assert x.reach() == (0, 2 * 3 * 5 * 8 - 1) and out.reach() == (0, 2 * 3 * 2 * 4 - 1) and out.write
    with pytest.raises(DelegateError, match="argument 'H' is 0; the kernel clamps source indices"):
        RULES["resize"].footprint(LaunchArgs("here", {**ints, "H": 0}, constexprs, tuple(launch.grid)))
