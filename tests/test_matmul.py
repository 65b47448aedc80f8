"""mm / addmm / bmm / baddbmm / linear through the tiled matmul kernel (kernels/matmul.py).

fp16/bf16 results are judged against fp32 eager on the same (already rounded) inputs with the harness
tolerances, unscaled: the kernel accumulates in fp32 like the reference, so the only difference that
grows with K is fp32 summation order (~1e-6 relative here); what remains is the final rounding to
fp16/bf16, one ulp at most (the interpreter truncates fp32 -> bf16 instead of rounding to nearest).
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import tritondelegate as td
from harness import FLOAT_DTYPES, TOLERANCES, Fn, check_model
from tritondelegate import decompose
from tritondelegate.kernels import matmul, target
from tritondelegate.kernels.registry import OPS

aten = torch.ops.aten


def check(fn, *args):
    """Run ``fn`` through a delegate; judge against eager fp32 on the same inputs."""
    ref = tuple(a.float() for a in args)
    return check_model(Fn(fn), args, reference_args=(Fn(fn), ref))


def matmul_launches(plan):
    return [launch for launch in plan.launches if launch.kernel == "matmul"]


# (M, N, K): each of 1, 17, 33, 129 in every position, 64 for a full tile
MM_SHAPES = [(1, 1, 1), (1, 129, 33), (17, 1, 129), (33, 17, 1), (129, 33, 17), (17, 64, 129)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("mnk", MM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mm_odd_shapes(mnk, dtype):
    M, N, K = mnk
    a, b = torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)
    _, plan = check(torch.mm, a, b)
    assert [launch.kernel for launch in plan.launches] == ["matmul"]


@pytest.mark.parametrize("name, fn, shapes", [
    ("x @ w.t()", lambda x, w: x @ w.t(), [(17, 33), (129, 33)]),
    ("a.t() @ b", lambda a, b: a.t() @ b, [(33, 17), (33, 20)]),
    ("a.t() @ b.t()", lambda a, b: a.t() @ b.t(), [(33, 17), (20, 33)]),
])
def test_transposed_operands_are_read_in_place(name, fn, shapes):
    args = [torch.randn(s) for s in shapes]
    _, plan = check(fn, *args)
    assert [launch.kernel for launch in plan.launches] == ["matmul"], name


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_linear_3d_input_is_one_launch(dtype, bias):
    lin = torch.nn.Linear(33, 20, bias=bias)
    x = torch.randn(2, 17, 33)
    _, plan = check_model(lin.to(dtype), (x.to(dtype),),
                          reference_args=(copy.deepcopy(lin).float(), (x.to(dtype).float(),)))
    assert [(launch.kernel, launch.op) for launch in plan.launches] == [("matmul", "linear")]
    assert plan.launches[0].constexprs["HAS_BIAS"].value is bias


def test_linear_strided_input_and_permuted_weight():
    class Strided(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(33, 20))  # stored [K, N]: linear reads w.t()
            self.b = torch.nn.Parameter(torch.randn(20))

        def forward(self, x):
            # x.transpose: leading dims [17, 2] with strides that do not merge -> batch axis
            return F.linear(x.transpose(0, 1), self.w.t(), self.b), F.linear(x[0], self.w.t())

    _, plan = check_model(Strided(), (torch.randn(2, 17, 33),))
    assert [launch.kernel for launch in plan.launches] == ["matmul", "matmul"]  # no copies
    assert plan.launches[0].grid[1] == 17  # the batch axis


def test_linear_1d_and_4d_inputs():
    w, b = torch.randn(20, 33), torch.randn(20)
    check(lambda x, w, b: F.linear(x, w, b), torch.randn(33), w, b)
    # three leading dims that no stride merges: one copy to contiguous, then one matmul
    x = torch.randn(3, 2, 5, 33)
    _, plan = check(lambda x, w, b: F.linear(x.permute(1, 0, 2, 3), w, b), x, w, b)
    assert [launch.kernel for launch in plan.launches] == ["pointwise", "matmul"]


@pytest.mark.parametrize("bias_shape", [(20,), (17, 20), (1, 20), (17, 1)])
def test_addmm_beta_alpha_and_bias_broadcast(bias_shape):
    bias, a, b = torch.randn(bias_shape), torch.randn(17, 33), torch.randn(33, 20)
    _, plan = check(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=-2), bias, a, b)
    assert [launch.kernel for launch in plan.launches] == ["matmul"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_addmm_dtypes(dtype):
    bias, a, b = (torch.randn(s, dtype=dtype) for s in [(129,), (33, 17), (17, 129)])
    check(lambda c, a, b: torch.addmm(c, a, b, beta=3, alpha=0.25), bias, a, b)


def test_addmm_beta_zero_ignores_bias():
    bias = torch.full((20,), float("nan"))
    a, b = torch.randn(17, 33), torch.randn(33, 20)
    (out,), plan = check(lambda c, a, b: torch.addmm(c, a, b, beta=0), bias, a, b)
    assert not out.isnan().any()
    assert plan.launches[0].constexprs["HAS_BIAS"].value is False


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bmm_with_permuted_operands(dtype):
    a = torch.randn(3, 17, 33, dtype=dtype)
    b = torch.randn(3, 20, 33, dtype=dtype)
    _, plan = check(lambda a, b: torch.bmm(a, b.permute(0, 2, 1)), a, b)
    assert [launch.kernel for launch in plan.launches] == ["matmul"]
    assert plan.launches[0].grid[1] == 3
    x = torch.randn(17, 3, 33, dtype=dtype)  # batch in the middle
    check(lambda x, b: torch.bmm(x.transpose(0, 1), b.transpose(1, 2)), x, b)


def test_matmul_4d_goes_through_bmm():
    a, b = torch.randn(2, 3, 17, 33), torch.randn(2, 3, 33, 5)
    _, plan = check(torch.matmul, a, b)
    assert len(matmul_launches(plan)) == 1


def test_baddbmm_kept_whole(monkeypatch):
    # The default decomposition splits baddbmm into bmm + mul + mul + add; kept whole it is one launch.
    monkeypatch.setattr(decompose, "KEEP_CANDIDATES", decompose.KEEP_CANDIDATES + (aten.baddbmm.default,))
    bias, a, b = torch.randn(17, 1), torch.randn(2, 17, 33), torch.randn(2, 33, 20)
    _, plan = check(lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2), bias, a, b)
    assert [(launch.kernel, launch.op) for launch in plan.launches] == [("matmul", "baddbmm")]


def test_large_batch_launches_in_chunks(monkeypatch):
    monkeypatch.setattr(matmul, "MAX_GRID_Y", 2)  # CUDA's 65535, scaled down
    a, b = torch.randn(5, 17, 16), torch.randn(5, 16, 3)
    _, plan = check(torch.bmm, a, b)
    assert [launch.grid[1] for launch in plan.launches] == [2, 2, 1]


# --- launch configuration -------------------------------------------------------------------------
def test_launch_configuration():
    big = matmul.choose_config(1, 4096, 4096, 4096, torch.bfloat16)
    assert (big.block_m, big.block_n, big.block_k, big.num_warps) == (128, 128, 64, 8)
    assert matmul.choose_config(1, 4096, 4096, 4096, torch.float32).block_k == 32
    # decode shape: the GEMV variant (tests/test_gemv.py), one row per tile, two programs per SM
    decode = matmul.choose_config(1, 1, 4096, 4096, torch.float16)
    assert decode.gemv and decode.block_m == 1 and 4096 // decode.block_n >= 2 * 132
    # past 8 rows: a 16-row tile, N split until the SMs have work
    skinny = matmul.choose_config(1, 9, 4096, 4096, torch.float16)
    assert not skinny.gemv and skinny.block_m == 16 and 4096 // skinny.block_n >= 64
    for batch, M, N, K in [(1, 1, 1, 1), (8, 17, 129, 33), (1, 4096, 1, 7), (64, 2048, 2048, 64)]:
        for dtype in FLOAT_DTYPES:
            cfg = matmul.choose_config(batch, M, N, K, dtype)
            for block in (cfg.block_m, cfg.block_n, cfg.block_k):  # tl.dot's tiles are 16 or more
                assert block >= (1 if cfg.gemv else 16) and block & (block - 1) == 0
            stage = (cfg.block_m + cfg.block_n) * cfg.block_k * dtype.itemsize
            assert 2 <= cfg.num_stages and stage * cfg.num_stages <= target.DEFAULT.pipeline_budget


def test_launch_configuration_follows_the_target():
    # A GPU with fewer SMs needs fewer tiles: a decode GEMM keeps wider tiles; less shared memory, fewer stages.
    h100 = matmul.choose_config(1, 1, 4096, 4096, torch.float16)
    small = target.Target("small", num_sms=16, shared_memory=64 * 1024)
    with target.using(small):
        few = matmul.choose_config(1, 1, 4096, 4096, torch.float16)
        big = matmul.choose_config(1, 4096, 4096, 4096, torch.float16)
    assert 4096 // few.block_n >= 16 and few.block_n > h100.block_n
    assert big.num_stages == 2 < matmul.choose_config(1, 4096, 4096, 4096, torch.float16).num_stages
    assert target.current() is target.DEFAULT  # the block restores it
    # lower() takes the target from LowerConfig: the plan's tiles change, the results do not
    model, x = torch.nn.Linear(1024, 512, bias=False), torch.randn(1, 1024)
    blocks = {}
    for name in ("h100", target.Target("four", num_sms=4, shared_memory=64 * 1024)):
        lowered = td.lower(torch.export.export(model, (x,)), config=td.LowerConfig(target=name))
        (launch,) = [launch for m in lowered.program.methods for d in m.delegates for launch in d.plan.launches]
        blocks[str(name)] = launch.constexprs["BLOCK_N"].value
    assert list(blocks.values()) == [8, 64]  # GEMV: 64 tiles of 8 columns (the least) for 132 SMs; 8 of 64 for 4
    with pytest.raises(ValueError, match="unknown target 'b200x'.*h100"):
        td.LowerConfig(target="b200x")


class NormGatedMLP(torch.nn.Module):
    """RMSNorm, then a gated MLP: the norm becomes the GLU GEMM's prologue (fusion.py, fuse_glu)."""

    def __init__(self, dim=64, hidden=256):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.down(F.silu(self.gate(h)) * self.up(h))


def test_fused_fp32_tiles_keep_registers():
    # fp32 with a norm prologue or a GLU: at most 32 accumulator elements per thread (64x128 over 4
    # warps and 128x128 over 8 spilled on sm_90, scripts/compile_check.py); fp16/bf16, GEMV and plain
    # launches keep their tiles
    tiles = lambda cfg: (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps)  # noqa: E731
    assert tiles(matmul.fused_config(matmul.Config(64, 128, 32, 8, 4, 4), torch.float32, True)) == (64, 128, 32, 8)
    assert tiles(matmul.fused_config(matmul.Config(128, 128, 32, 8, 8, 4), torch.float32, True)) == (128, 64, 32, 8)
    small = matmul.Config(32, 64, 32, 8, 4, 4)
    assert matmul.fused_config(small, torch.float32, True) == small
    for dtype, fused in [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)]:
        big = matmul.Config(128, 128, 64, 8, 8, 4)
        assert matmul.fused_config(big, dtype, fused) == big
    gemv = matmul.choose_config(1, 1, 4096, 4096, torch.float32)
    assert gemv.gemv and matmul.fused_config(gemv, torch.float32, True) == gemv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_fp32_launch_takes_smaller_tiles(dtype):
    # On 4 SMs, 128 rows x 512 GLU columns keep 128x128 tiles: the fp32 launch (prologue added by fusion
    # after choose_config) runs 128x64 over 8 warps on a grid to match; bf16 keeps 128x128
    torch.manual_seed(0)
    model, x = NormGatedMLP().eval().to(dtype), torch.randn(128, 64).to(dtype)
    four = target.Target("four", num_sms=4, shared_memory=228 * 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(torch.export.export(model, (x,)), config=td.LowerConfig(target=four))
    launches = [launch for m in lowered.program.methods for d in m.delegates for launch in d.plan.launches]
    (glu,) = [launch for launch in launches if "GLU" in launch.constexprs]
    meta = {k: v.value for k, v in glu.constexprs.items()}
    assert meta["PROLOGUE"] == "rms" and meta["GLU"] == "silu"
    expected = (128, 64, 8) if dtype == torch.float32 else (128, 128, 8)
    assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"]) == expected
    assert glu.grid[0] == (128 // meta["BLOCK_M"]) * (512 // meta["BLOCK_N"])
    out = lowered.load().load_method("forward")(x)
    with torch.no_grad():
        reference = copy.deepcopy(model).float()(x.float())
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), reference, atol=atol, rtol=rtol)


def test_plan_carries_launch_meta_and_no_upcast():
    _, plan = check(torch.mm, torch.randn(17, 33), torch.randn(33, 5))
    meta = {k: v.value for k, v in plan.launches[0].constexprs.items()}
    assert meta["DOT_UPCAST"] is False  # the runtime turns it on for the simulated device only
    assert {"num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"} <= set(meta)


# --- support checks -------------------------------------------------------------------------------
def _node(target, arg_vals, out_val, kwargs=None):
    graph = torch.fx.Graph()
    args = []
    for i, v in enumerate(arg_vals):
        p = graph.placeholder(f"x{i}")
        p.meta["val"] = v
        args.append(p)
    node = graph.call_function(target, tuple(args), kwargs or {})
    node.meta["val"] = out_val
    return node


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("target, args, out, words", [
    (aten.mm.default, [_meta(2, 3, dtype=torch.float64), _meta(3, 4, dtype=torch.float64)],
     _meta(2, 4, dtype=torch.float64), "torch.float64"),
    (aten.mm.default, [_meta(2, 3, dtype=torch.int64), _meta(3, 4, dtype=torch.int64)],
     _meta(2, 4, dtype=torch.int64), "torch.int64"),
    (aten.mm.default, [_meta(2, 3), _meta(3, 4, dtype=torch.float16)], _meta(2, 4), "mixed dtypes"),
    (aten.bmm.default, [_meta(2, 3), _meta(3, 4)], _meta(2, 4), "3-D"),
    (aten.addmm.default, [_meta(1, 2, 4), _meta(2, 3), _meta(3, 4)], _meta(2, 4), "broadcast"),
    (aten.linear.default, [_meta(2, 3), _meta(1, 4, 3)], _meta(2, 4), "2-D weight"),
])
def test_support_refusals(target, args, out, words):
    reason = OPS[target].support(_node(target, args, out))
    assert reason is not None and words in reason


def test_dynamic_rows_run_at_every_size_of_their_range():
    class Mm(torch.nn.Module):
        def forward(self, a, b):
            return torch.mm(a, b)

    a, b = torch.randn(17, 33), torch.randn(33, 5)
    ep = torch.export.export(Mm(), (a, b), dynamic_shapes=({0: torch.export.Dim("m", max=40)}, None))
    node = next(n for n in ep.graph.nodes if n.target is aten.mm.default)
    assert OPS[aten.mm.default].support(node) is None  # dynamic shapes are the plan's business
    method = td.lower(ep).load().load_method("forward")
    for m in (1, 40, 23):
        x = torch.randn(m, 33)
        torch.testing.assert_close(method(x, b), x @ b, atol=1e-4, rtol=1e-4)
