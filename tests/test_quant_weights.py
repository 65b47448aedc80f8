"""Weight-only quantized linears stay quantized on the device (passes/quant_weights.py, the matmul
kernel's ``QUANT`` in kernels/matmul.py, ``td.quantize_linears`` in quantize.py).

A linear whose weight a model computes from an int8 / uint8 constant (``q.to(dt) [- zero] [* scale]
[.to(dtype)]``, per row or per group of columns) is lowered with ``q`` and its zero / scale tables as
the program's constants, and the matmul kernel dequantizes each tile: the program stores a byte per
weight element, launches what the float model launches, and computes the same weights bit for bit
(checked exactly with one-hot inputs, whose products are exact in any order). Forms the kernel cannot
take fall back to plain constant folding: a float weight, resident, as before.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, assert_close, check_dynamic, lower_resident, plan_launches
from tritondelegate.dtypes import dtype_name
from tritondelegate.kernels.traffic import method_traffic
from tritondelegate.models import demo_decoder
from tritondelegate.ops import dequant_weight_reference, unpack_nibbles

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
N, K = 40, 96  # K: 6 groups of 16, 3 of 32; neither N nor K a multiple of the kernel's tiles
GEMV_ROWS, TILE_ROWS = (1, 3), (2, 20)  # M = 3: the GEMV variant; M = 40: tl.dot tiles
ROWS = pytest.mark.parametrize("rows", [GEMV_ROWS, TILE_ROWS], ids=["gemv", "tiles"])

# form -> (q's dtype, the kernel's QUANT mode)
FORMS = {
    "int8_row": (torch.int8, "scale"),  # q.to(dt) * s[:, None]
    "uint8_zero128": (torch.uint8, "scale"),  # (q.to(dt) - 128) * s[:, None]: the kernel subtracts QZERO 128
    "uint8_group16": (torch.uint8, "zero_scale"),  # ((q.view(N, K/G, G) - z) * s).view(N, K)
    "uint8_group32": (torch.uint8, "zero_scale"),
    "fp32_scale_to": (torch.int8, "scale"),  # (q.to(fp32) * s32[:, None]).to(dt)
    "gpt_fast": (torch.int8, "none"),  # F.linear(x, q.to(x.dtype)) * s: the scale as an epilogue
    # steps that round apart from the result: small fractional zeros in fp16, scales in fp32
    # (((q.to(fp16) - z).to(fp32) * s).to(x.dtype): q - z rounds to fp16), and a weight computed in bf16
    # whatever x's dtype ((q.to(bf16) * s).to(x.dtype): the product rounds to bf16)
    "uint8_frac_zero": (torch.uint8, "zero_scale"),
    "bf16_weight": (torch.int8, "scale"),
}


def _symmetric(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


class QLinear(nn.Module):
    """One linear [N, K] whose weight is computed from an integer buffer ``q`` in one of FORMS."""

    def __init__(self, form: str, dtype: torch.dtype, n: int = N, k: int = K):
        super().__init__()
        self.form, self.n, self.k = form, n, k
        w = torch.randn(n, k)
        self.b = None if form == "gpt_fast" else nn.Parameter(torch.randn(n).to(dtype))
        if form == "uint8_zero128":
            q, scale = _symmetric(w)
            self.register_buffer("q", (q.to(torch.int16) + 128).to(torch.uint8))
            self.register_buffer("s", scale.to(dtype))
        elif form.startswith(("uint8_group", "uint8_frac")):
            self.g = 32 if form == "uint8_frac_zero" else int(form.removeprefix("uint8_group"))
            groups = w.view(n, k // self.g, self.g)
            low, high = groups.amin(-1), groups.amax(-1)
            scale = (high - low) / 255
            zero = torch.round(-low / scale)
            q = torch.clamp(torch.round(groups / scale[..., None]) + zero[..., None], 0, 255)
            if form == "uint8_frac_zero":  # small fractional zeros: q - z (up to 255) rounds in fp16 and bf16
                q, zero = torch.randint(0, 256, (n, k)), torch.rand(zero.shape) * 4
            frac = form == "uint8_frac_zero"  # zeros in fp16 and scales in fp32, whatever the model's dtype
            self.register_buffer("q", q.to(torch.uint8).view(n, k))
            self.register_buffer("s", scale.to(torch.float32 if frac else dtype))
            self.register_buffer("z", zero.to(torch.float16 if frac else dtype))
        else:
            q, scale = _symmetric(w)
            self.register_buffer("q", q)
            scale_dtype = {"fp32_scale_to": torch.float32, "bf16_weight": torch.bfloat16}.get(form, dtype)
            self.register_buffer("s", scale.to(scale_dtype))

    def weight(self, dt: torch.dtype) -> torch.Tensor:
        """The float weight, as eager computes it for an input of dtype ``dt``."""
        q, s, n, k = self.q, self.s, self.n, self.k
        if self.form == "int8_row":
            return q.to(dt) * s[:, None]
        if self.form == "uint8_zero128":
            return (q.to(dt) - 128) * s[:, None]
        if self.form == "fp32_scale_to":
            return (q.to(torch.float32) * s[:, None]).to(dt)
        if self.form == "gpt_fast":
            return q.to(dt)
        if self.form == "bf16_weight":
            return (q.to(torch.bfloat16) * s[:, None]).to(dt)
        g = self.g
        if self.form == "uint8_frac_zero":  # q - z rounds to fp16, the product to fp32, the weight to dt
            t = (q.to(torch.float16).view(n, k // g, g) - self.z[..., None]).to(torch.float32)
            return (t * s[..., None]).view(n, k).to(dt)
        return ((q.to(dt).view(n, k // g, g) - self.z[..., None]) * s[..., None]).view(n, k)

    def forward(self, x):
        y = F.linear(x, self.weight(x.dtype), self.b)
        return y * self.s if self.form == "gpt_fast" else y

    def reference(self, x):
        """fp32 on the same (rounded) weight, bias and input: what harness judges low precision by."""
        b = None if self.b is None else self.b.float()
        y = F.linear(x.float(), self.weight(x.dtype).float(), b)
        return y * self.s.float() if self.form == "gpt_fast" else y


class FloatTwin(nn.Module):
    """A QLinear's computation with its dequantized weight as a plain float buffer."""

    def __init__(self, model: QLinear, dtype: torch.dtype):
        super().__init__()
        self.form, self.b = model.form, model.b
        self.register_buffer("w", model.weight(dtype))
        self.register_buffer("s", model.s)

    def forward(self, x):
        y = F.linear(x, self.w, self.b)
        return y * self.s if self.form == "gpt_fast" else y


def _stored(lowered) -> list[tuple[str, tuple, int, torch.Tensor]]:
    """The program's resident constants: (dtype name, shape, bytes, data)."""
    return [(c.dtype, tuple(c.shape), c.nbytes, data)
            for c, data in zip(lowered.program.constants, lowered.constant_data)]


def _stored_bytes(lowered) -> int:
    return sum(c.nbytes for c in lowered.program.constants)


def _c(launch) -> dict:
    return {k: v.value for k, v in launch.constexprs.items()}


def _one_hot(shape, dtype) -> torch.Tensor:
    """Rows of the identity: ``linear`` of them is the weight's columns (plus the bias), exactly."""
    rows = shape[0] * shape[1]
    return torch.eye(shape[-1], dtype=dtype)[torch.randperm(shape[-1])[:rows]].view(shape)


def _run(lowered, *args):
    return lowered.load().load_method("forward")(*args)


# --- 1, 2: the forms, both kernel paths -----------------------------------------------------------
@pytest.mark.parametrize("form", list(FORMS))
@dtypes
@ROWS
def test_form_stays_quantized(form, dtype, rows):
    q_dtype, mode = FORMS[form]
    model = QLinear(form, dtype).eval()
    x = torch.randn(*rows, K).to(dtype)
    lowered = lower_resident(model, (x,))

    # One launch, as the float model (test_same_launches_as_the_float_model): the matmul, reading q
    # and dequantizing its tiles, on the path the shape asks for.
    (launch,) = plan_launches(lowered)
    c = _c(launch)
    assert launch.kernel == "matmul" and c["QUANT"] == mode, c
    assert c.get("QZERO", 0) == (128 if form == "uint8_zero128" else 0), c  # one zero point: no table
    assert c.get("GEMV", False) is (rows == GEMV_ROWS), c
    assert not lowered.reports["forward"].nodes.host

    # The integers are stored as they are, a byte per weight; no float [N, K] weight, only small tables.
    stored = _stored(lowered)
    weights = [s for s in stored if s[1] == (N, K)]
    assert len(weights) == 1, [s[:3] for s in stored]
    (stored_dtype, _, nbytes, data) = weights[0]
    assert stored_dtype == dtype_name(q_dtype) and nbytes == N * K and torch.equal(data, model.q)
    small = sum(s[3].numel() for s in stored if s[1] != (N, K))
    assert small <= N * (2 * K // 16 + 1), [s[:3] for s in stored]  # two tables of groups >= 16, a bias

    method = lowered.load().load_method("forward")
    with torch.no_grad():
        assert_close(method(x), model.reference(x), dtype=dtype)
        # The kernel's weights are eager's, bit for bit: with one-hot rows every product is exact.
        hot = _one_hot(x.shape, dtype)
        out, expected = method(hot), model(hot)
    assert out.dtype == expected.dtype and torch.equal(out, expected), (out.float() - expected.float()).abs().max()


@pytest.mark.parametrize("form", list(FORMS))
def test_same_launches_as_the_float_model(form):
    dtype = torch.bfloat16
    model = QLinear(form, dtype).eval()
    x = torch.randn(*GEMV_ROWS, K).to(dtype)
    quantized, plain = lower_resident(model, (x,)), lower_resident(FloatTwin(model, dtype).eval(), (x,))
    assert [launch.kernel for launch in plan_launches(quantized)] == [
        launch.kernel for launch in plan_launches(plain)] == ["matmul"]
    # The float model stores the [N, K] weight at 2 bytes per element; the quantized one a byte.
    assert _stored_bytes(plain) - _stored_bytes(quantized) >= N * K - N * (2 * K // 16) * 2
    with torch.no_grad():
        assert torch.equal(_run(quantized, x), _run(plain, x))


# --- 3: td.quantize_linears on the demo decoder ---------------------------------------------------
@functools.lru_cache(maxsize=None)
def _float_decoder():
    """The unquantized demo decoder's lowering (shared by the decoder tests): launches, fusions, bytes."""
    model, (ids,) = demo_decoder(seed=0, n_layers=2)
    lowered = lower_resident(model, (ids,))
    return [launch.kernel for launch in plan_launches(lowered)], _fusions(lowered), _stored_bytes(lowered)


def _fusions(lowered) -> list[str]:
    """The weight fusions (Q/K/V concatenation, gate/up GLU, the rotary epilogue) reported."""
    return [d for d in lowered.reports["forward"].fused
            if d.startswith(("linear x", "gated MLP", "rotary in the epilogue"))]


def _float_linear_bytes(model) -> int:
    return sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))


def _quantized_bytes(model) -> int:
    """The bytes of every QuantizedLinear's integers and tables."""
    return sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, td.QuantizedLinear)
               for t in (m.qweight, m.zero, m.scale) if t is not None)


def _check_quantized_decoder(group_size, zero_point, skip=(), ratio=None):
    float_kernels, float_fusions, float_bytes = _float_decoder()
    model, (ids,) = demo_decoder(seed=0, n_layers=2)
    linear_bytes = _float_linear_bytes(model)
    td.quantize_linears(model, group_size=group_size, zero_point=zero_point, skip=skip)
    lowered = lower_resident(model, (ids,))
    launches = plan_launches(lowered)

    # Every fusion of the float model still happens, on the quantized weights: the same launches.
    assert [launch.kernel for launch in launches] == float_kernels
    assert _fusions(lowered) == float_fusions and len(float_fusions) == 6, float_fusions
    mode = "zero_scale" if zero_point else "scale"
    modes = [_c(launch).get("QUANT", "") for launch in launches if launch.kernel == "matmul"]
    kept_float = 2 * len(skip)  # one per layer for each skipped pattern (the demo's "*down*")
    assert sorted(modes) == [""] * kept_float + [mode] * (len(modes) - kept_float), modes

    # Stored: the float model's bytes, less the float weights of the quantized linears, plus their
    # integers and tables (concatenated, interleaved, permuted: never duplicated).
    skipped_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    stored = _stored_bytes(lowered)
    assert stored == float_bytes - linear_bytes + skipped_bytes + _quantized_bytes(model)
    if ratio is not None:
        assert stored < ratio * float_bytes, (stored, float_bytes)

    with torch.no_grad():
        assert_close(_run(lowered, ids), model(ids), dtype=torch.float32)
    return model, lowered


@pytest.mark.parametrize("group_size,zero_point,ratio", [(None, False, 0.40), (16, True, 0.50)],
                         ids=["per_row", "group16_zero_point"])
def test_demo_decoder_quantized(group_size, zero_point, ratio):
    # fp32 weights: a byte each instead of 4 (per row: 0.37 of the bytes with the float embedding;
    # groups of 16 with a zero point add 8 bytes per 16 weights: 0.46).
    model, _ = _check_quantized_decoder(group_size, zero_point, ratio=ratio)
    assert all(not isinstance(m, nn.Linear) for m in model.modules())  # lm_head too


def test_demo_decoder_skip_keeps_those_float():
    model, lowered = _check_quantized_decoder(16, True, skip=("*down*",))
    for layer in model.layers:
        assert type(layer.ffn.down) is nn.Linear and isinstance(layer.ffn.up, td.QuantizedLinear)
    stored = {c.name: (c.dtype, tuple(c.shape)) for c in lowered.program.constants}
    for i in range(2):
        assert stored[f"layers.{i}.ffn.down.weight"] == ("float32", (64, 176))


def test_group_size_that_does_not_divide_in_features_leaves_the_linear_float():
    model, _ = demo_decoder(seed=0, n_layers=1)  # dim 64, hidden 176: 32 does not divide 176
    td.quantize_linears(model, group_size=32)
    layer = model.layers[0]
    assert type(layer.ffn.down) is nn.Linear
    for linear in (layer.attn.q_proj, layer.attn.o_proj, layer.ffn.gate, layer.ffn.up, model.lm_head):
        assert isinstance(linear, td.QuantizedLinear) and linear.scale.shape[1] == 64 // 32


@pytest.mark.parametrize("group_size", [32, 0, -16])
def test_quantized_linear_refuses_a_bad_group_size(group_size):
    with pytest.raises(ValueError):
        td.QuantizedLinear(nn.Linear(48, 8), group_size=group_size)


@pytest.mark.parametrize("group_size,zero_point", [(None, False), (None, True), (16, False), (16, True)])
def test_quantized_linear_rounds_within_half_a_step(group_size, zero_point):
    linear = nn.Linear(48, 24)
    quantized = td.QuantizedLinear(linear, group_size=group_size, zero_point=zero_point)
    assert quantized.qweight.dtype == (torch.uint8 if zero_point else torch.int8)
    assert quantized.scale.shape == (24, 1 if group_size is None else 48 // group_size)
    step = quantized.scale.repeat_interleave(48 // quantized.scale.shape[1], dim=1)
    with torch.no_grad():
        error = (quantized.weight - linear.weight).abs()
        assert (error <= step / 2 * 1.001 + 1e-7).all(), (error / step).max()
        x = torch.randn(5, 48)
        assert_close(quantized(x), F.linear(x, quantized.weight, linear.bias))


# --- 4: fallbacks: the weight folded to a float constant, as before -------------------------------
class PerColumnScale(nn.Module):
    """A scale per column [1, K]: not a per-row or per-group table."""

    def __init__(self):
        super().__init__()
        self.register_buffer("q", torch.randint(-127, 128, (N, K), dtype=torch.int8))
        self.register_buffer("s", torch.rand(1, K) / 100)

    def forward(self, x):
        return F.linear(x, self.q.to(x.dtype) * self.s)


class Groups(nn.Module):
    """uint8 with a zero and scale per group of ``g`` columns."""

    def __init__(self, g: int):
        super().__init__()
        self.g = g
        self.register_buffer("q", torch.randint(0, 256, (N, K), dtype=torch.uint8))
        self.register_buffer("s", torch.rand(N, K // g) / 100)
        self.register_buffer("z", torch.randint(100, 150, (N, K // g)).float())

    def forward(self, x):
        g = self.g
        return F.linear(x, ((self.q.to(x.dtype).view(N, K // g, g) - self.z[..., None]) * self.s[..., None]).view(N, K))


class TiedEmbedding(nn.Module):
    """One dequantized table read by an embedding and, as its weight, by the output linear."""

    def __init__(self):
        super().__init__()
        self.register_buffer("q", torch.randint(-127, 128, (N, K), dtype=torch.int8))
        self.register_buffer("s", torch.rand(N) / 100)

    def forward(self, ids):
        w = self.q.to(torch.float32) * self.s[:, None]
        return F.linear(F.embedding(ids, w), w)


@pytest.mark.parametrize("model,args,kernels", [
    (PerColumnScale(), (torch.randn(1, 3, K),), ["matmul"]),
    (Groups(8), (torch.randn(1, 3, K),), ["matmul"]),  # the kernel takes powers of two >= 16
], ids=["per_column_scale", "groups_of_8"])
def test_fallback_folds_a_float_weight(model, args, kernels):
    model = model.eval()
    lowered = lower_resident(model, args)
    assert not lowered.reports["forward"].nodes.host, lowered.reports["forward"].nodes.host
    assert [launch.kernel for launch in plan_launches(lowered)] == kernels
    assert all("QUANT" not in _c(launch) or _c(launch)["QUANT"] == "" for launch in plan_launches(lowered))
    # The weight is resident as one fp32 constant; no integers are stored (nothing reads them).
    stored = _stored(lowered)
    assert [(name, shape) for name, shape, _, _ in stored] == [("float32", (N, K))], [s[:3] for s in stored]
    with torch.no_grad():
        assert torch.equal(stored[0][3], _weight_of(model))
    method = lowered.load().load_method("forward")
    with torch.no_grad():
        assert_close(method(*args), model(*args))
    # Nothing but the call's own input is copied to the device: the weight is not computed per call.
    assert method.stats.call_h2d_bytes == sum(a.numel() * a.element_size() for a in args)


def test_a_table_an_embedding_and_a_linear_read_stays_quantized_once():
    # the embedding looks its rows up in the integers (kernels/dequant_rows.py), the linear reads them
    # as its weight: one int8 table and its scales, no float copy
    model = TiedEmbedding().eval()
    ids = torch.randint(0, N, (1, 3))
    lowered = lower_resident(model, (ids,))
    assert [launch.kernel for launch in plan_launches(lowered)] == ["dequant_rows", "matmul"]
    assert [(name, shape) for name, shape, _, _ in _stored(lowered)] == [("int8", (N, K)), ("float32", (N, 1))]
    with torch.no_grad():
        assert_close(lowered.load().load_method("forward")(ids), model(ids))


def _weight_of(model) -> torch.Tensor:
    """The fallback models' float weight, as eager computes it."""
    if isinstance(model, PerColumnScale):
        return model.q.to(torch.float32) * model.s
    if isinstance(model, Groups):
        g = model.g
        return ((model.q.to(torch.float32).view(N, K // g, g) - model.z[..., None]) * model.s[..., None]).view(N, K)
    return model.q.to(torch.float32) * model.s[:, None]


# --- 5: a dynamic batch ---------------------------------------------------------------------------
def test_dynamic_batch():
    model = QLinear("uint8_group16", torch.float32).eval()
    calls = [(torch.randn(n, 5, K),) for n in (2, 6)]
    lowered, _ = check_dynamic(model, calls, {"x": {0: Dim("batch", max=6)}})
    (launch,) = plan_launches(lowered)
    assert _c(launch)["QUANT"] == "zero_scale"
    assert [(name, shape) for name, shape, _, _ in _stored(lowered) if shape == (N, K)] == [("uint8", (N, K))]


# --- 6: the op ------------------------------------------------------------------------------------
def test_dequant_weight_op_is_the_grouped_arithmetic():
    q = torch.randint(0, 256, (6, 64), dtype=torch.uint8)
    zero = torch.randint(100, 150, (6, 4)).to(torch.bfloat16)
    scale = (torch.rand(6, 4) / 50).to(torch.bfloat16)
    # bf16 steps, then the weight in fp32: as a model computing in bf16 and casting its result.
    expected = ((q.to(torch.bfloat16).view(6, 4, 16) - zero[..., None]) * scale[..., None]).view(6, 64).float()
    args = (q, zero, scale, torch.bfloat16, torch.bfloat16, torch.float32)
    assert torch.equal(dequant_weight_reference(*args), expected)
    result = torch.ops.tritondelegate.dequant_weight(*args)
    assert result.dtype == torch.float32 and torch.equal(result, expected)
    # Without a zero point, scales per row (one group): q * s in fp16.
    s16 = (torch.rand(6, 1) / 50).to(torch.float16)
    assert torch.equal(torch.ops.tritondelegate.dequant_weight(q, None, s16, *(torch.float16,) * 3),
                       q.to(torch.float16) * s16)


@pytest.mark.parametrize("bad", ["float_q", "scale_groups", "zero_rows", "zero_and_zero_point", "tables_differ"])
def test_dequant_weight_op_refuses_bad_inputs(bad):
    q = torch.randint(-127, 128, (6, 64), dtype=torch.int8)
    zero, scale = torch.zeros(6, 4), torch.ones(6, 4)
    if bad == "float_q":
        q = q.float()
    elif bad == "scale_groups":
        scale = torch.ones(6, 3)  # 3 does not divide 64
    elif bad == "zero_rows":
        zero = torch.zeros(5, 4)
    elif bad == "tables_differ":  # one value per group alike
        zero = torch.zeros(6, 2)
    point = 8 if bad == "zero_and_zero_point" else 0  # a zero table or one zero point, not both
    with pytest.raises(ValueError, match="dequant_weight"):
        torch.ops.tritondelegate.dequant_weight(q, zero, scale, torch.float32, torch.float32, torch.float32,
                                                zero_point=point)


def _row_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.view(*t.shape[:-1], groups, t.shape[-1] // groups)


# (q, zero, scale, sub, mul, dtype, bits) -> the weight as eager computes it in that dtype order; q larger
# than one of the reference's blocks of rows (65536 elements), or rows longer than one block
@pytest.mark.parametrize("case", ["int8_row_bf16", "uint8_frac_zero", "nibbles_zero", "nibbles_around_8", "experts",
                                  "long_rows"])
def test_reference_in_blocks_is_eager_arithmetic(case):
    torch.manual_seed(0)
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    if case in ("int8_row_bf16", "experts", "long_rows"):
        shape = {"int8_row_bf16": (1100, 96), "experts": (3, 700, 64), "long_rows": (3, 1 << 17)}[case]
        q = torch.randint(-127, 128, shape, dtype=torch.int8)
        scale = torch.rand(*shape[:-1], 1, dtype=bf16) / 50
        args, expected = (q, None, scale, bf16, bf16, bf16), q.to(bf16) * scale
    elif case == "uint8_frac_zero":  # q - z rounds to fp16, the product to fp32, the weight to bf16
        q = torch.randint(0, 256, (1100, 96), dtype=torch.uint8)
        zero, scale = (torch.rand(1100, 3) * 4).to(fp16), torch.rand(1100, 3) / 50
        t = (_row_groups(q.to(fp16), 3) - zero[..., None]).to(fp32)
        args, expected = (q, zero, scale, fp16, fp32, bf16), (t * scale[..., None]).view(1100, 96).to(bf16)
    elif case == "nibbles_around_8":  # 4 bits symmetric: one zero point, 8, for all (no table)
        p = torch.randint(0, 256, (1100, 48), dtype=torch.uint8)
        scale = (torch.rand(1100, 3) / 50).to(bf16)
        t = _row_groups(unpack_nibbles(p).to(bf16), 3) - 8
        args, expected = (p, None, scale, bf16, bf16, bf16, 4, 8), (t * scale[..., None]).view(1100, 96)
    else:  # 4 bits, two per byte, a zero point per group of 32, fp16
        p = torch.randint(0, 256, (1100, 48), dtype=torch.uint8)
        zero, scale = torch.randint(0, 16, (1100, 3)).to(fp16), (torch.rand(1100, 3) / 50).to(fp16)
        t = _row_groups(unpack_nibbles(p).to(fp16), 3) - zero[..., None]
        args, expected = (p, zero, scale, fp16, fp16, fp16, 4), (t * scale[..., None]).view(1100, 96)
    result = dequant_weight_reference(*args)
    assert result.dtype == expected.dtype and torch.equal(result, expected)


class TwoForms(nn.Module):
    """One int8 weight [N, K] with a scale per row, computed in fp32 for a batch of 1 and in bf16 (then
    cast) for larger ones: the same constants under two subgraphs, as two exported methods see them."""

    def __init__(self):
        super().__init__()
        q, scale = _symmetric(torch.randn(N, K))
        self.register_buffer("q", q)
        self.register_buffer("s", scale)

    def forward(self, x):
        if x.shape[0] == 1:
            return F.linear(x, self.q.to(torch.float32) * self.s[:, None])
        return F.linear(x, (self.q.to(torch.bfloat16) * self.s.to(torch.bfloat16)[:, None]).to(torch.float32))


@pytest.mark.parametrize("model,checks", [
    (QLinear("uint8_group16", torch.float32), 1),  # prefill and decode compute the weight alike
    (TwoForms(), 2),
], ids=["same_subgraph", "two_subgraphs"])
def test_a_weight_is_checked_once_for_every_method_that_computes_it_alike(monkeypatch, model, checks):
    from tritondelegate.passes import quant_weights

    calls = []

    def counted(value, plain):
        calls.append(value.shape)
        return exact(value, plain)

    exact = quant_weights.exact
    monkeypatch.setattr(quant_weights, "exact", counted)
    model = model.eval()
    args = {"decode": (torch.randn(1, K),), "prefill": (torch.randn(5, K),)}
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    lowered = td.lower({name: torch.export.export(model, a) for name, a in args.items()}, config=config)
    assert calls == [(N, K)] * checks
    # both methods dequantize in their kernels: integers stored once, no float weight
    stored = [(name, shape) for name, shape, _, _ in _stored(lowered)]
    assert (("uint8" if checks == 1 else "int8"), (N, K)) in stored
    assert not [s for s in stored if s[1] == (N, K) and s[0].startswith(("float", "bfloat"))], stored
    program = lowered.load()
    with torch.no_grad():
        for name, a in args.items():
            assert_close(program.load_method(name)(*a), model(*a))


# --- 7: the traffic model -------------------------------------------------------------------------
def test_traffic_of_a_batch_1_decode_step_halves_in_bf16():
    n, k = 512, 256  # not run: only the plan's modelled bytes
    model = QLinear("int8_row", torch.bfloat16, n, k).eval()
    model.b = None
    x = torch.randn(1, k, dtype=torch.bfloat16)
    quantized = method_traffic(lower_resident(model, (x,)).program.methods[0])
    plain = method_traffic(lower_resident(FloatTwin(model, torch.bfloat16).eval(), (x,)).program.methods[0])
    # The weight is read as a byte per element, plus the bf16 scale per row; x and out as before.
    assert quantized["bytes_read"] == plain["bytes_read"] - n * k * 2 + n * k + n * 2
    assert quantized["bytes_written"] == plain["bytes_written"] == n * 2
    assert quantized["flops"] == plain["flops"] and quantized["launches"] == plain["launches"] == 1
    assert 0.49 < quantized["bytes"] / plain["bytes"] < 0.52
    assert quantized["lower_bound"] == quantized["bytes"]  # the bound counts the integers too


# --- 8: 4 bits, two per byte ----------------------------------------------------------------------
class Nibbles(nn.Module):
    """A 4-bit weight [N, K] packed two per byte in a uint8 [N, K / 2], unpacked by ``unpack``:
    "stack" (low nibble, then high: ``td.QuantizedLinear``'s), "shift" (the same by a shift table),
    or "high_first" (the high nibble first: not the kernel's order)."""

    def __init__(self, unpack: str, dtype: torch.dtype, g: int = 16):
        super().__init__()
        self.unpack, self.g = unpack, g
        self.register_buffer("p", torch.randint(0, 256, (N, K // 2), dtype=torch.uint8))
        self.register_buffer("s", (torch.rand(N, K // g) / 10).to(dtype))
        self.register_buffer("z", torch.randint(6, 10, (N, K // g)).to(dtype))

    def weight(self, dt):
        p = self.p
        if self.unpack == "stack":
            q = torch.stack([p & 15, p >> 4], dim=-1).view(N, K)
        elif self.unpack == "shift":
            q = ((p.unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 15).reshape(N, K)
        else:
            q = torch.stack([p >> 4, p & 15], dim=-1).view(N, K)
        g = self.g
        return ((q.to(dt).view(N, K // g, g) - self.z[..., None]) * self.s[..., None]).view(N, K)

    def forward(self, x):
        return F.linear(x, self.weight(x.dtype))


@pytest.mark.parametrize("unpack", ["stack", "shift"])
@dtypes
@ROWS
def test_4_bit_weights_stay_packed(unpack, dtype, rows):
    model = Nibbles(unpack, dtype).eval()
    x = torch.randn(*rows, K).to(dtype)
    lowered = lower_resident(model, (x,))
    (launch,) = plan_launches(lowered)
    c = _c(launch)
    assert c["QUANT"] == "zero_scale" and c["QBITS"] == 4 and c.get("GEMV", False) is (rows == GEMV_ROWS), c
    # The packed bytes are stored as they are: half a byte per weight.
    stored = _stored(lowered)
    (packed,) = [s for s in stored if s[1] == (N, K // 2)]
    assert packed[0] == "uint8" and torch.equal(packed[3], model.p)
    assert not [s for s in stored if s[1] == (N, K)]
    method = lowered.load().load_method("forward")
    with torch.no_grad():
        hot = _one_hot(x.shape, dtype)
        assert torch.equal(method(hot), model(hot))
        assert_close(method(x), F.linear(x.float(), model.weight(dtype).float()), dtype=dtype)


def test_4_bits_high_nibble_first_folds_a_float_weight():
    model = Nibbles("high_first", torch.float32).eval()
    x = torch.randn(1, 3, K)
    lowered = lower_resident(model, (x,))
    assert [(name, shape) for name, shape, _, _ in _stored(lowered)] == [("float32", (N, K))]
    with torch.no_grad():
        assert_close(_run(lowered, x), model(x))


@pytest.mark.parametrize("group_size,zero_point", [(None, False), (16, True), (32, False)])
def test_quantize_linears_4_bits(group_size, zero_point):
    linear = nn.Linear(K, N)
    quantized = td.QuantizedLinear(linear, group_size=group_size, zero_point=zero_point, bits=4).eval()
    assert quantized.qweight.shape == (N, K // 2) and quantized.qweight.dtype == torch.uint8
    step = quantized.scale.repeat_interleave(K // quantized.scale.shape[1], dim=1)
    with torch.no_grad():
        assert ((quantized.weight - linear.weight).abs() <= step / 2 * 1.001 + 1e-7).all()
    x = torch.randn(2, 20, K)
    lowered = lower_resident(quantized, (x,))
    (launch,) = plan_launches(lowered)
    c = _c(launch)
    assert c["QBITS"] == 4
    # symmetric: values around 8, which the kernel subtracts (QZERO); a zero table neither stored nor read
    assert (c["QUANT"], c.get("QZERO", 0)) == (("zero_scale", 0) if zero_point else ("scale", 8)), c
    groups = K // (group_size or K)
    assert sorted(tuple(s) for _, s, _, _ in _stored(lowered)) == sorted(
        [(N, K // 2), (N, groups), (N,)] + ([(N, groups)] if zero_point else []))
    with torch.no_grad():
        assert_close(_run(lowered, x), quantized(x))
    with pytest.raises(ValueError, match="bits"):
        td.QuantizedLinear(nn.Linear(K + 1, N), bits=4)


def test_demo_decoder_4_bits():
    float_kernels, float_fusions, float_bytes = _float_decoder()
    model, (ids,) = demo_decoder(seed=0, n_layers=2)
    td.quantize_linears(model, group_size=16, bits=4)
    lowered = lower_resident(model, (ids,))
    launches = plan_launches(lowered)
    assert [launch.kernel for launch in launches] == float_kernels and _fusions(lowered) == float_fusions
    assert {_c(launch).get("QBITS") for launch in launches if launch.kernel == "matmul"} == {4}
    assert _stored_bytes(lowered) < 0.36 * float_bytes  # half a byte per weight, fp32 scales per 16
    with torch.no_grad():
        assert_close(_run(lowered, ids), model(ids))


# --- 9: torchao's exported forms ------------------------------------------------------------------
class Intx(nn.Module):
    """torchao's ``IntxWeightOnlyConfig`` after export: the int8 q viewed into groups before its cast,
    the int8 zero points cast in the graph; ``bits=4``: q in [-8, 7], one value per byte."""

    def __init__(self, bits: int, dtype: torch.dtype, g: int = 32):
        super().__init__()
        self.g = g
        high = 8 if bits == 4 else 128
        self.register_buffer("q", torch.randint(-high, high, (N, K), dtype=torch.int8))
        self.register_buffer("s", (torch.rand(N, K // g) / 10).to(dtype))
        self.register_buffer("z", torch.randint(-2, 3, (N, K // g), dtype=torch.int8))

    def weight(self, dt):
        g = self.g
        w = self.q.view(N, K // g, g).to(dt)
        return ((w - self.z.view(N, K // g, 1).to(dt)) * self.s.view(N, K // g, 1)).view(N, K)

    def forward(self, x):
        return F.linear(x, self.weight(x.dtype))


@pytest.mark.parametrize("bits", [8, 4])
@dtypes
def test_torchao_intx_form(bits, dtype):
    model = Intx(bits, dtype).eval()
    x = torch.randn(2, 20, K).to(dtype)
    lowered = lower_resident(model, (x,))
    (launch,) = plan_launches(lowered)
    assert _c(launch)["QUANT"] == "zero_scale" and _c(launch).get("QBITS", 8) == bits
    stored = {s[1]: s for s in _stored(lowered)}
    if bits == 8:
        assert stored[(N, K)][0] == "int8" and torch.equal(stored[(N, K)][3], model.q)
    else:  # values in [-8, 7]: stored two per byte, as q + 8 (the zero points moved by 8 too)
        assert stored[(N, K // 2)][0] == "uint8" and (N, K) not in stored
    with torch.no_grad():
        hot = _one_hot(x.shape, dtype)
        assert torch.equal(_run(lowered, hot), model(hot))


class Int8MM(nn.Module):
    """torchao's ``Int8WeightOnlyConfig`` after export: ``mm(x, q.t().to(dt)) * scale + bias`` (the
    weight read transposed by ``mm``, its scale applied to the product)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("q", torch.randint(-127, 128, (N, K), dtype=torch.int8))
        self.register_buffer("s", torch.rand(N, 1) / 100)
        self.b = nn.Parameter(torch.randn(N).to(dtype))

    def forward(self, x):
        y = torch.mm(x.view(-1, K), self.q.t().to(x.dtype)) * self.s.to(x.dtype).view(-1)
        return y.view(*x.shape[:-1], N) + self.b


@dtypes
@ROWS
def test_torchao_int8_mm_form(dtype, rows):
    model = Int8MM(dtype).eval()
    x = torch.randn(*rows, K).to(dtype)
    lowered = lower_resident(model, (x,))
    (launch,) = plan_launches(lowered)  # the scale and the bias in the epilogue
    assert launch.kernel == "matmul" and _c(launch)["QUANT"] == "none", _c(launch)
    stored = {s[1]: s for s in _stored(lowered)}
    assert stored[(N, K)][0] == "int8" and torch.equal(stored[(N, K)][3], model.q)
    with torch.no_grad():
        # The weight's columns exactly; in 16 bits the epilogue's scale and bias add round once, at the
        # end, where eager rounds after each (an ulp apart).
        hot = _one_hot(x.shape, dtype)
        out, expected = _run(lowered, hot), model(hot)
        if dtype == torch.float32:
            assert torch.equal(out, expected)
        else:
            assert_close(out, expected, dtype=dtype)
        assert_close(_run(lowered, x), model(x), dtype=dtype)
