"""Weight-only quantized Mixture-of-Experts weights stay quantized on the device
(passes/quant_weights.py with K among the rows, the grouped GEMM's ``QUANT`` in kernels/grouped_mm.py).

transformers' experts hold one weight per expert, [E, N, K], and a grouped GEMM reads it as [E, K, N]
(``weight.transpose(-2, -1)``). A model that computes those weights from integers, ``(q.to(dt) -
zero) * scale`` per row or per group of K columns, is lowered with q and its tables as the program's
constants and the grouped GEMM dequantizes each tile as it loads it, on both of its paths (segment
tiles with tl.dot, the per-row one for a few rows). The weights are checked bit for bit with one-hot
inputs, whose products are exact in any order.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import assert_close, lower_resident, plan_launches
from tritondelegate.dtypes import dtype_name
from tritondelegate.ops import pack_nibbles

E, N, K = 3, 24, 64  # K: 4 groups of 16, 2 of 32
COUNTS = {"rows": [1, 0, 2], "segments": [18, 0, 21]}  # 3 rows: the per-row path; 39: segment tiles

# form -> (bits, group size (None: one per row), zero point, the kernel's QUANT mode)
FORMS = {
    "int8_row": (8, None, False, "scale"),
    "uint8_zero_g16": (8, 16, True, "zero_scale"),
    "uint4_zero_g16": (4, 16, True, "zero_scale"),
    "int4_g32": (4, 32, False, "scale"),  # int8 values in [-8, 7]: stored two per byte, + 8, QZERO 8
}


class QExperts(nn.Module):
    """E experts' weights [E, N, K] computed from integers in one of FORMS, read by transformers'
    grouped GEMM as [E, K, N]."""

    def __init__(self, form: str, dtype: torch.dtype):
        super().__init__()
        bits, group, zero, _ = FORMS[form]
        self.packed = bits == 4 and zero  # uint8 nibbles; int4_g32 keeps one int8 value per byte
        groups = K // (group or K)
        top = 15 if bits == 4 else 255 if zero else 127
        if zero:
            q = torch.randint(0, top + 1, (E, N, K), dtype=torch.uint8)
            self.register_buffer("zero", torch.randint(0, top + 1, (E, N, groups)).to(dtype))
        else:
            low = -8 if bits == 4 else -127
            q = torch.randint(low, top // 2 + 1 if bits == 4 else top + 1, (E, N, K), dtype=torch.int8)
            self.zero = None
        self.register_buffer("q", pack_nibbles(q) if self.packed else q)
        self.register_buffer("scale", (torch.rand(E, N, groups) / 50 + 1e-3).to(dtype))

    def weight(self) -> torch.Tensor:
        q = self.q
        if self.packed:
            q = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)
        groups = self.scale.shape[-1]
        w = q.to(self.scale.dtype).view(E, N, groups, K // groups)
        if self.zero is not None:
            w = w - self.zero.unsqueeze(-1)
        return (w * self.scale.unsqueeze(-1)).view(E, N, K)

    def forward(self, x, offs):
        return torch.ops.transformers.grouped_mm_fallback(x, self.weight().transpose(-2, -1), offs)


@pytest.fixture(scope="module", autouse=True)
def _fallback():
    pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback


def _c(launch) -> dict:
    return {k: v.value for k, v in launch.constexprs.items()}


def _check(form: str, dtype: torch.dtype, path: str):
    torch.manual_seed(0)
    model = QExperts(form, dtype).eval()
    counts = COUNTS[path]
    S = sum(counts) + 1  # a row past the last offset: stored as 0
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(S, K).to(dtype)
    lowered = lower_resident(model, (x, offs))
    (launch,) = plan_launches(lowered)
    c = _c(launch)
    assert launch.kernel == "grouped_mm" and c["QUANT"] == FORMS[form][3] and c["PER_ROW"] is (path == "rows"), c
    assert c.get("QBITS", 8) == FORMS[form][0], c
    assert c.get("QZERO", 0) == (8 if form == "int4_g32" else 0), c  # a zero table of 8s neither stored nor read
    assert not lowered.reports["forward"].nodes.host

    # The integers are stored, a byte per weight (half a byte with 4 bits), with small tables; no
    # float weight
    stored = {tuple(c.shape): (c.dtype, data) for c, data in zip(lowered.program.constants, lowered.constant_data)}
    q_shape = (E, N, K // 2) if FORMS[form][0] == 4 else (E, N, K)
    assert q_shape in stored, list(stored)
    floats = [s for s, (dt, _) in stored.items() if dt == dtype_name(dtype) and len(s) == 3 and s[-1] * 2 >= K]
    assert not floats, floats
    q_dtype, q = stored[q_shape]
    assert q_dtype in ("int8", "uint8") and (form != "int8_row" or torch.equal(q, model.q))

    method = lowered.load().load_method("forward")
    with torch.no_grad():
        got = method(x, offs)
        assert_close(got, model(x, offs), dtype=dtype)
        assert (got[sum(counts):] == 0).all()
        # The kernel's weights are eager's, bit for bit: a one-hot row picks one weight per product
        hot = torch.eye(K, dtype=dtype)[torch.randperm(K)[:S]]
        out, expected = method(hot, offs), model(hot, offs)
    assert out.dtype == expected.dtype and torch.equal(out, expected), (out.float() - expected.float()).abs().max()
    return lowered


@pytest.mark.parametrize("path", sorted(COUNTS))
@pytest.mark.parametrize("form", list(FORMS))
def test_experts_stay_quantized_in_bf16(form, path):
    _check(form, torch.bfloat16, path)


@pytest.mark.parametrize("path", sorted(COUNTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
def test_experts_stay_quantized_in_fp32_and_fp16(dtype, path):
    _check("uint8_zero_g16", dtype, path)


# --- experts run through bmm (Llama 4's: every expert over every token) ---------------------------------
class BatchedExperts(QExperts):
    """QExperts' weights read by ``bmm(x [E, T, K], w [E, K, N])``, as ``Llama4TextExperts`` reads its."""

    def forward(self, x):
        return torch.bmm(x, self.weight().transpose(-2, -1))


@pytest.mark.parametrize("tokens", [1, 20], ids=["gemv", "tiles"])
@pytest.mark.parametrize("form", list(FORMS))
def test_bmm_experts_stay_quantized(form, tokens):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = BatchedExperts(form, dtype).eval()
    x = torch.randn(E, tokens, K).to(dtype)
    lowered = lower_resident(model, (x,))
    (launch,) = plan_launches(lowered)
    c = _c(launch)
    assert launch.kernel == "matmul" and c["QUANT"] == FORMS[form][3] and c.get("QBITS", 8) == FORMS[form][0], c
    assert c.get("QZERO", 0) == (8 if form == "int4_g32" else 0) and c.get("GEMV", False) is (tokens == 1), c
    stored = {tuple(c.shape): c.dtype for c in lowered.program.constants}
    assert stored.get((E, N, K // 2) if FORMS[form][0] == 4 else (E, N, K)) in ("int8", "uint8"), stored
    assert not [s for s, dt in stored.items() if dt == "bfloat16" and len(s) == 3 and s[-1] * 2 >= K], stored
    method = lowered.load().load_method("forward")
    with torch.no_grad():
        assert_close(method(x), model(x), dtype=dtype)
        # each expert's weights bit for bit: one-hot rows pick one weight per product
        hot = torch.eye(K, dtype=dtype)[torch.randperm(K)[:E * tokens]].view(E, tokens, K)
        out, expected = method(hot), model(hot)
    assert torch.equal(out, expected), (out.float() - expected.float()).abs().max()
