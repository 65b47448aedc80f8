"""Skinny products (M <= 8, decode) through the matmul kernel's GEMV variant (kernels/matmul.py): no
tl.dot, tiles of 1 to 8 rows and 8 or more columns, with the prologues, the bias, GLU and the epilogue
as in the tiled kernel. Each case is checked against eager (fp16/bf16 against fp32 on the same rounded
inputs, harness tolerances) and its launch is checked to be the GEMV one; plan-only tests check the
tiles chosen for a decode shape on an H100 without running them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, Fn, check_dynamic, check_launches, check_model, plan_launches
from tritondelegate.dtypes import dtype_name
from tritondelegate.kernels import matmul, target

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
ROWS = pytest.mark.parametrize("M", [1, 3, 8])
N, K = 40, 70  # odd: neither a power of two, nor a multiple of the tiles
LONG_K = 300  # several K steps: 3 of 128 (fp32), 2 of 256 (fp16, bf16)
RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _c(launch) -> dict:
    return {k: v.value for k, v in launch.constexprs.items()}


def _gemv(launch, M: int) -> dict:
    """The launch's constexprs, after checking it is a GEMV matmul with M's rows (rounded up) per tile."""
    c = _c(launch)
    assert launch.kernel == "matmul" and c.get("GEMV") is True, c
    assert c["BLOCK_M"] == _pow2(M) and c["BLOCK_N"] >= 8
    return c


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _check(fn, *args):
    """Run ``fn`` through one delegate; judge against eager fp32 on the same (rounded) inputs."""
    ref = tuple(a.float() for a in args)
    _, plan = check_model(Fn(fn), args, reference_args=(Fn(fn), ref))
    return [launch for launch in plan.launches if launch.kernel == "matmul"]


# --- results against eager ------------------------------------------------------------------------
@dtypes
@ROWS
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("K", [K, LONG_K])
def test_linear(M, K, bias, dtype):
    x, w = torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype)
    b = torch.randn(N, dtype=dtype) if bias else None
    fn = (lambda x, w, b: F.linear(x, w, b)) if bias else (lambda x, w: F.linear(x, w))
    (launch,) = _check(fn, *((x, w, b) if bias else (x, w)))
    assert _gemv(launch, M)["HAS_BIAS"] is bias


@dtypes
def test_mm_and_addmm_with_alpha_beta(dtype):
    a, b, bias = torch.randn(3, K, dtype=dtype), torch.randn(K, N, dtype=dtype), torch.randn(N, dtype=dtype)
    launches = _check(lambda a, b, bias: (a @ b, torch.addmm(bias, a, b, alpha=0.5, beta=2.0)), a, b, bias)
    assert len(launches) == 2
    for launch in launches:
        _gemv(launch, 3)


@dtypes
@pytest.mark.parametrize("M", [1, 8])
def test_epilogues(M, dtype):
    """linear + silu, and linear + bias + residual add: each one launch, the result never stored."""
    x, w, b, r = (torch.randn(*s, dtype=dtype) for s in [(M, K), (N, K), (N,), (M, N)])
    launches = _check(lambda x, w, b, r: (F.silu(F.linear(x, w)), F.linear(x, w, b) + r), x, w, b, r)
    assert [_c(launch)["EOP0"] for launch in launches] == ["silu", "add"]
    for launch in launches:
        assert _gemv(launch, M)["EPILOGUE"] == 1


class NormThenLinear(nn.Module):
    """rms_norm (or layer_norm) read only by a linear with a bias: the norm is the GEMM's prologue."""

    def __init__(self, dim, out, layer=False):
        super().__init__()
        self.norm = nn.LayerNorm(dim) if layer else nn.RMSNorm(dim, eps=1e-5)
        self.norm.weight.data = 1 + 0.1 * torch.randn(dim)
        if layer:
            self.norm.bias.data = 0.1 * torch.randn(dim)
        self.lin = nn.Linear(dim, out)

    def forward(self, x):
        return self.lin(self.norm(x))


@dtypes
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_prologue(M, norm, dtype):
    model = NormThenLinear(LONG_K, N, layer=norm == "layer").eval().to(dtype)
    (launch,) = check_launches(model, (torch.randn(1, M, LONG_K).to(dtype),), dtype)
    c = _gemv(launch, M)
    assert c["PROLOGUE"] == norm and c["HAS_PW"]


class SwiGLU(nn.Module):
    """x + down(silu(gate(rms_norm(x))) * up(rms_norm(x))): gate and up become one GLU GEMM with the norm
    as its prologue (passes/fuse_glu.py), down takes the residual add as its epilogue."""

    def __init__(self, dim=24, hidden=20):
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        h = F.rms_norm(x, (x.shape[-1],), self.w, 1e-6)
        return self.down(F.silu(self.gate(h)) * self.up(h)) + x


@dtypes
@pytest.mark.parametrize("M", [1, 3])
def test_gated_mlp(M, dtype):
    model = SwiGLU().eval().to(dtype)
    glu, down = check_launches(model, (torch.randn(M, 24).to(dtype),), dtype)
    c = _gemv(glu, M)
    assert c["GLU"] == "silu" and c["PROLOGUE"] == "rms" and c["BLOCK_N"] % 2 == 0
    assert _gemv(down, M)["EOP0"] == "add"


@dtypes
def test_bmm_one_row(dtype):
    a, b = torch.randn(4, 1, K, dtype=dtype), torch.randn(4, K, N, dtype=dtype)
    x = torch.randn(4, 1, N, dtype=dtype)
    launches = _check(lambda a, b, x: (torch.bmm(a, b), torch.baddbmm(x, a, b, alpha=0.5)), a, b, x)
    for launch in launches:
        _gemv(launch, 1)
        assert launch.grid[1] == 4  # the batch: grid axis 1


def test_transposed_operands_are_read_in_place():
    a, b = torch.randn(K, 2), torch.randn(N, K)
    (launch,) = _check(lambda a, b: a.t() @ b.t(), a, b)
    _gemv(launch, 2)


def test_dynamic_rows_up_to_eight():
    """M's upper bound picks the tile (8 rows); calls with fewer rows are masked."""
    model = NormThenLinear(K, N).eval()
    lowered, _ = check_dynamic(model, [(torch.randn(n, K),) for n in (1, 5, 8)], ({0: Dim("rows", max=8)},),
                               example=(torch.randn(5, K),))
    (launch,) = plan_launches(lowered)
    _gemv(launch, 8)


# --- which variant, and its tiles (plans only) ----------------------------------------------------
def _lower_linear(M, n_out, k_in=64, dtype=torch.float32):
    model, x = nn.Linear(k_in, n_out, bias=False).to(dtype), torch.randn(M, k_in, dtype=dtype)
    config = td.LowerConfig(propagate_device=RESIDENT.propagate_device, target="h100")
    lowered = td.lower(torch.export.export(model, (x,)), config=config)
    (launch,) = plan_launches(lowered)
    return lowered, launch


def test_gemv_is_chosen_by_shape():
    _, decode = _lower_linear(1, 512)
    assert _gemv(decode, 1)["BLOCK_K"] == 64  # K = 64: the tile is no wider than K
    _, prefill = _lower_linear(64, 512)
    assert "GEMV" not in prefill.constexprs and _c(prefill)["BLOCK_M"] >= matmul.MIN_BLOCK
    # at the threshold and just past it
    assert matmul.choose_config(1, 8, 512, 64, torch.float16).gemv
    assert not matmul.choose_config(1, 9, 512, 64, torch.float16).gemv


def test_gemv_tiles():
    for dtype, block_k in [(torch.float32, 128), (torch.float16, 256), (torch.bfloat16, 256)]:
        for M in range(1, 9):
            for batch, N, K in [(1, 1, 1), (1, 40, 70), (1, 6144, 4096), (1, 28672, 4096), (32, 777, 128),
                                (512, 1024, 16)]:
                cfg = matmul.choose_config(batch, M, N, K, dtype)
                assert cfg.gemv and cfg.block_m == _pow2(M) and cfg.block_n >= 8
                assert cfg.block_k == min(block_k, max(16, _pow2(K)))  # 512 bytes of a row
                assert cfg.block_n <= 128  # as the tiled kernel's
                for block in (cfg.block_m, cfg.block_n, cfg.block_k):
                    assert block & (block - 1) == 0
                # registers: at most 64 fp32 products per thread
                assert cfg.block_m * cfg.block_n * cfg.block_k <= 64 * 32 * cfg.num_warps
                stage = (cfg.block_m + cfg.block_n) * cfg.block_k * dtype.itemsize
                assert 2 <= cfg.num_stages and stage * cfg.num_stages <= target.DEFAULT.pipeline_budget
                # an epilogue keeps the tile (it is far below the register limit)
                assert matmul.epilogue_config(cfg, dtype, 5) == cfg


@pytest.mark.parametrize("n_out", [2048, 6144, 28672])
def test_decode_grid_fills_an_h100(n_out):
    """One decode token through a projection of N outputs on an H100 (132 SMs): at least two programs
    per SM once N allows it (N >= 2 * 132 * 8), else the narrowest tiles (8 columns). Plan only.
    K = 1024: an 8-column program streams 16 KiB of the weight, the least narrowing allows."""
    lowered, launch = _lower_linear(1, n_out, k_in=1024, dtype=torch.bfloat16)
    c = _gemv(launch, 1)
    programs = launch.grid[0] * launch.grid[1]
    assert programs == -(-n_out // c["BLOCK_N"])
    if n_out >= 2 * 132 * 8:
        assert programs >= 2 * 132
    else:
        assert c["BLOCK_N"] == 8 and programs == n_out // 8  # 2048: 256 programs, 1.9 per SM
    lowered.load(devices="simulated").load_method("forward")  # the verifier takes the GEMV tiles


def test_a_small_product_is_not_narrowed():
    """64 x 64 fp32 (16 KiB in all): narrower tiles would add programs, not bandwidth; one program."""
    _, launch = _lower_linear(1, 64, k_in=64)
    assert _gemv(launch, 1)["BLOCK_N"] == 64 and launch.grid[0] * launch.grid[1] == 1
    _, launch = _lower_linear(1, 512, k_in=512)  # 2 KiB a column: 8 columns a program, 64 programs
    assert _gemv(launch, 1)["BLOCK_N"] == 8


def test_gemv_launch_survives_save_and_load(tmp_path):
    torch.manual_seed(0)
    model, x = SwiGLU().eval(), torch.randn(1, 24)
    td.lower(torch.export.export(model, (x,)), config=RESIDENT).save(tmp_path / "gemv.tdp")
    program = td.load(tmp_path / "gemv.tdp", devices="simulated")
    launches = plan_launches(program)
    assert all(_c(launch).get("GEMV") is True for launch in launches) and len(launches) == 2
    with torch.no_grad():
        torch.testing.assert_close(program.load_method("forward")(x), model(x), atol=1e-4, rtol=1e-4)


def test_the_target_sets_how_many_rows_take_gemv():
    """``Target.gemv_rows``: 0 keeps every product on tl.dot (to compare the two on a GPU), 2 sends
    only products of up to 2 rows to GEMV; the summary names the choice."""
    base = target.TARGETS["h100"]
    for rows, expected in ((0, [False, False]), (2, [True, False]), (8, [True, True])):
        gpu = target.Target(base.name, base.num_sms, base.shared_memory, gemv_rows=rows)
        with target.using(gpu):
            assert [matmul.choose_config(1, m, 256, 256, torch.float16).gemv for m in (2, 3)] == expected
    model, x = nn.Linear(40, 24).eval(), torch.randn(1, 40)
    off = target.Target("h100", 132, base.shared_memory, gemv_rows=0)
    lowered = td.lower(torch.export.export(model, (x,)), config=td.LowerConfig(target=off))
    (launch,) = [l for m in lowered.program.methods for d in m.delegates for l in d.plan.launches]
    assert "GEMV" not in launch.constexprs and launch.constexprs["BLOCK_M"].value == 16
    assert "no GEMV" in lowered.summary()
    torch.testing.assert_close(lowered.load().load_method("forward")(x), model(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="gemv_rows must be an int in"):
        target.Target("x", 132, base.shared_memory, gemv_rows=16)
