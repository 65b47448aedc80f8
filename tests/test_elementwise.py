import pytest
import torch

from harness import FLOAT_DTYPES, Fn, check_model, run_delegated

UNARY = {
    "neg": torch.neg, "exp": torch.exp, "sqrt": lambda x: torch.sqrt(x.abs()),
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.5), "sigmoid": torch.sigmoid,
    "silu": torch.nn.functional.silu, "relu": torch.relu, "tanh": torch.tanh,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "cos": torch.cos, "sin": torch.sin, "abs": torch.abs, "log": lambda x: torch.log(x.abs() + 1),
    "reciprocal": lambda x: 1.0 / (x.abs() + 1),
    "log1p": lambda x: torch.log1p(x.abs() * 1e-3 - 5e-4),  # small arguments, where log(1 + x) loses them
    "expm1": lambda x: torch.expm1(x * 1e-3) + torch.expm1(x * 2),  # tiny arguments, and larger ones
    # halves (ties: round to even), negative zeros, large values
    "floor": lambda x: torch.floor(x * 4), "ceil": lambda x: torch.ceil(x * 4),
    "trunc": lambda x: torch.trunc(x * 4), "round": lambda x: torch.round(torch.round(x * 8) / 2),
    "sign": lambda x: torch.sign(torch.round(x)),  # zeros too
}


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unary(name, dtype):
    x = torch.randn(3, 129, dtype=dtype)
    fn = UNARY[name]
    check_model(Fn(fn), (x,), reference_args=(Fn(fn), (x.float(),)))


BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 1),
    "add_alpha": lambda a, b: torch.add(a, b, alpha=2.5), "sub_alpha": lambda a, b: torch.sub(a, b, alpha=3),
    "maximum": torch.maximum, "minimum": torch.minimum,
    "pow_tensor": torch.pow,  # the base is made positive below
    "rsub_scalar": lambda a, b: 1 - a + b,
}


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shapes", [((17, 33), (17, 33)), ((4, 1, 33), (17, 1)), ((1,), (5, 3))])
def test_binary_broadcast(name, dtype, shapes):
    a = torch.randn(shapes[0], dtype=dtype)
    b = torch.randn(shapes[1], dtype=dtype)
    if name == "pow_tensor":
        a = a.abs() + 0.25
    fn = BINARY[name]
    check_model(Fn(fn), (a, b), reference_args=(Fn(fn), (a.float(), b.float())))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scalar_operands_and_pow(dtype):
    x = torch.randn(17, 5, dtype=dtype)
    fn = lambda x: (x * 3 + 2, x - 0.5, x / 4, x.pow(2), x.pow(3), x.abs().pow(0.5), 2.0 ** x)  # noqa: E731
    check_model(Fn(fn), (x,), reference_args=(Fn(fn), (x.float(),)))


def test_comparisons_where_and_bool_ops():
    a = torch.randn(17, 33)
    b = torch.randn(33)
    fn = lambda a, b: (  # noqa: E731
        a > b, a <= 0.1, a == a, a != b, torch.where(a > b, a, b),
        (a > 0) & (b > 0), torch.logical_or(a > 0, b < 0), torch.logical_not(a > 0),
    )
    check_model(Fn(fn), (a, b))


def test_integer_arithmetic_and_casts():
    i = torch.arange(0, 341).reshape(11, 31)
    x = torch.randn(11, 31)
    fn = lambda i, x: (i + 3, i * 2 - 1, x.to(torch.int64), i.to(torch.float16), (x > 0).float(), x.half())  # noqa: E731
    check_model(Fn(fn), (i, x))


def test_strided_operands_need_no_copy():
    # A transpose and a slice feed a pointwise op directly: one launch, no copy kernel.
    a = torch.randn(33, 17)
    b = torch.randn(17, 40)
    _, plan = check_model(Fn(lambda a, b: a.t() * b[:, 3:36]), (a, b))
    assert [launch.op for launch in plan.launches] == ["mul"]


def test_where_with_scalar_branch():
    a = torch.randn(17, 33)
    check_model(Fn(lambda a: torch.where(a < 0, a, 0.0)), (a,))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_clamp(dtype):
    x = torch.randn(17, 33, dtype=dtype)
    lo = torch.randn(33, dtype=dtype)
    fn = lambda x, lo: (x.clamp(-0.5, 0.5), x.clamp(min=0.1), x.clamp(max=-0.1), torch.clamp(x, lo),  # noqa: E731
                        torch.nn.functional.normalize(x, dim=-1))
    check_model(Fn(fn), (x, lo), reference_args=(Fn(fn), (x.float(), lo.float())))


def test_clamp_integers_and_nan():
    i = torch.arange(-20, 21)
    check_model(Fn(lambda i: i.clamp(-3, 7)), (i,))
    x = torch.tensor([float("nan"), -2.0, 0.3, 5.0])
    results, _ = run_delegated(Fn(lambda x: x.clamp(-1, 1)), (x,))
    assert torch.isnan(results[0][0]) and results[0][1:].tolist() == [-1.0, 0.30000001192092896, 1.0]


def test_clamp_one_bound_keeps_int64_extremes():
    """An absent bound is no bound at all: int64 values beyond +-2**62 (once the stand-in for "none")
    pass through a one-sided clamp unchanged."""
    big = 2**63 - 1
    i = torch.tensor([-big - 1, -big, -(2**62) - 1, -3, 0, 4, 5, 6, 2**62 + 1, big - 1, big])
    fn = lambda i: (i.clamp(min=0), torch.clamp(i, max=5), i.clamp_min(-(2**62)), i.clamp_max(2**62))  # noqa: E731
    results, _ = run_delegated(Fn(fn), (i,))
    for got, want in zip(results, fn(i)):
        assert got.dtype == torch.int64 and got.tolist() == want.tolist()


def test_a_copy_over_more_dims_than_a_launch_walks_splits_into_launches():
    """A 6-D permuted copy (Hiera's unrolling) and a broadcast sum over it: one launch per index of the
    outermost dim, each over five dims (elementwise._peeled)."""
    from harness import lower_resident, plan_launches

    x = torch.randn(2 * 3 * 2 * 5 * 2 * 7)
    y = torch.randn(7, 5, 3, 2, 1, 1)
    fn = lambda x, y: (x.view(2, 3, 2, 5, 2, 7).permute(5, 3, 1, 4, 2, 0) + y).contiguous()  # noqa: E731
    lowered = lower_resident(Fn(fn), (x, y))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["pointwise"] * 7
    assert torch.equal(lowered.load().load_method()(x, y), fn(x, y))


def test_a_split_copy_keeps_a_dynamic_batch_walked():
    """Hiera's unrolling under a dynamic batch: the static dims are split, the batch is walked."""
    from harness import lower_resident

    fn = lambda x: x.view(-1, 2, 3, 2, 5, 2).permute(0, 5, 3, 1, 4, 2).contiguous() + 1  # noqa: E731
    batch = torch.export.Dim("batch", max=3)
    lowered = lower_resident(Fn(fn), (torch.randn(2, 120),), dynamic_shapes={"args": ({0: batch},)})
    method = lowered.load().load_method()
    for n in (1, 3):
        x = torch.randn(n, 120)
        assert torch.equal(method(x), fn(x))
