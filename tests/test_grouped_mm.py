"""Grouped matmul (kernels/grouped_mm.py): the experts of a Mixture-of-Experts layer in one launch.

transformers 5's MoE models export ``transformers::grouped_mm_fallback(input, weight, offs)`` (fp32 on
the CPU); torch's ``aten._grouped_mm`` (bf16 only when exported) has the same semantics for a 2-D input,
a 3-D weight and offs. Each case is checked against the semantics written out below as a loop, in
fp32 on the same (rounded) inputs, with the harness tolerances; both variants (segment tiles with
tl.dot, and the per-row one for a few rows) over odd sizes, experts without rows, rows past the last
offset, int32 and int64 offs, and a weight read in place through a transposed view. Then a tiny
Mixtral, Qwen3-MoE and OLMoE end to end, and ``lower()`` refusing an op no delegate claims and the
runtime could not run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, Fn, Logits, check_dynamic, check_model, plan_launches
from tritondelegate.dtypes import dtype_name
from tritondelegate.kernels import registry
from tritondelegate.kernels.table import KERNELS
from tritondelegate.plan import Arg, KernelArgKind
from tritondelegate.runtime.footprints import kernel_parameters
from tritondelegate.runtime.loader import InMemorySource, LoadedProgram

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def reference(x, w, offs):
    """transformers' ``_grouped_mm_fallback``, in fp32: rows start..end of expert i are x @ w[i];
    rows past offs[-1] are 0."""
    out = torch.zeros(x.shape[0], w.shape[2])
    start = 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].float() @ w[i].float()
        start = end
    return out


@pytest.fixture(scope="module")
def fallback():
    """The transformers op (registered when transformers' MoE integration is imported)."""
    pytest.importorskip("transformers.integrations.moe")
    return torch.ops.transformers.grouped_mm_fallback


def _operands(S, K, N, counts, dtype, offs_dtype=torch.int32, transposed=True):
    """x [S, K], w [E, K, N] (as transformers passes it: a transposed view of [E, N, K]) and offs."""
    x = torch.randn(S, K).to(dtype)
    E = len(counts)
    w = torch.randn(E, N, K).to(dtype).transpose(1, 2) if transposed else torch.randn(E, K, N).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(offs_dtype)
    return x, w, offs


def _check(op, x, w, offs, per_row: bool):
    """Run ``op`` through one delegate; judge against the loop on the same inputs in fp32. Returns
    the result and the launch's constexprs."""
    (out,), plan = check_model(Fn(lambda x, w, o: op(x, w, o)), (x, w, offs),
                               reference_args=(Fn(reference), (x.float(), w.float(), offs)))
    (launch,) = plan.launches
    c = {k: v.value for k, v in launch.constexprs.items()}
    assert launch.kernel == "grouped_mm" and c["PER_ROW"] is per_row, c
    return out, c


# (S, K, N, rows per expert): few rows (per-row variant) and segments; experts with no rows, the first
# and the last among them, rows past the last offset, one expert holding every row
CASES = {
    "rows": (3, 20, 9, [1, 0, 2]),
    "rows_tail": (7, 17, 33, [0, 2, 3, 0]),
    "segments": (40, 33, 17, [20, 0, 19]),
    "segments_tail": (37, 65, 24, [0, 17, 3, 9]),
    "one_expert": (33, 16, 17, [33]),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_the_loop(fallback, case, dtype):
    torch.manual_seed(0)
    S, K, N, counts = CASES[case]
    x, w, offs = _operands(S, K, N, counts, dtype)
    out, _ = _check(fallback, x, w, offs, per_row=S <= 8)
    assert (out[sum(counts):] == 0).all()  # rows past offs[-1]


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("S", [5, 29])
def test_offs_int32_and_int64_and_a_contiguous_weight(fallback, S, offs_dtype):
    torch.manual_seed(1)
    counts = [S // 3, 0, S - S // 3 - 1]  # one row past the end
    x, w, offs = _operands(S, 19, 11, counts, torch.float32, offs_dtype, transposed=False)
    out, _ = _check(fallback, x, w, offs, per_row=S <= 8)
    assert (out[-1] == 0).all()


def test_segment_tiles_cover_long_and_short_segments(fallback):
    """Segments of 1, 16 (one full tile), 17 and 0 rows with 16-row tiles: the grid holds
    cdiv(S, 16) + E programs, and the programs past the last tile store nothing."""
    torch.manual_seed(2)
    x, w, offs = _operands(34, 24, 40, [1, 16, 17, 0], torch.float32)
    _, c = _check(fallback, x, w, offs, per_row=False)
    assert c["BLOCK_M"] == 16


def test_aten_grouped_mm_in_bf16():
    """What torch exports on a GPU in bf16 (its strides 16-byte aligned, as its meta function asks)."""
    torch.manual_seed(3)
    for S, counts in ((6, [2, 0, 3]), (40, [9, 21, 0])):
        x, w, offs = _operands(S, 32, 24, counts, torch.bfloat16)
        _check(torch.ops.aten._grouped_mm, x, w, offs, per_row=S <= 8)


def _support(fn, *args):
    ep = torch.export.export(Fn(fn), args)
    (node,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten._grouped_mm.default]
    return registry.lookup(node.target).support(node)


def test_other_forms_of_aten_grouped_mm_are_refused_with_a_reason():
    a, b = torch.randn(4, 16, 32).bfloat16(), torch.randn(4, 32, 16).bfloat16()
    assert "input is 3-D, weight 3-D, no offs" in _support(lambda a, b: torch.ops.aten._grouped_mm(a, b), a, b)
    x, wt = torch.randn(32, 48).bfloat16(), torch.randn(48, 16).bfloat16()
    offs = torch.tensor([16, 48], dtype=torch.int32)
    assert "3-D weight" in _support(lambda x, w, o: torch.ops.aten._grouped_mm(x.t(), w, o), x, wt, offs)
    x, w = torch.randn(8, 32).bfloat16(), torch.randn(2, 32, 16).bfloat16()
    offs = torch.tensor([3, 8], dtype=torch.int32)
    assert _support(lambda x, w, o: torch.ops.aten._grouped_mm(x, w, o), x, w, offs) is None


def test_the_weight_walked_through_offs_counts_at_most_the_experts_with_rows(fallback):
    """Two rows over 8 experts of [64, 32] fp32 weights: at most 2 experts' 8 KiB each are read."""
    x, w, offs = _operands(2, 64, 32, [0, 1, 0, 0, 1, 0, 0, 0], torch.float32)
    lowered = td.lower(torch.export.export(Fn(lambda x, w, o: fallback(x, w, o)), (x, w, offs)), config=RESIDENT)
    (launch,) = plan_launches(lowered)
    assert launch.flops == 2 * 2 * 64 * 32
    x_bytes, w_bytes, offs_bytes = 2 * 64 * 4, 2 * 64 * 32 * 4, 8 * 4
    assert launch.bytes_read == x_bytes + w_bytes + offs_bytes
    assert launch.bytes_written == 2 * 32 * 4


@pytest.mark.parametrize("S", [3, 40])
def test_a_damaged_launch_is_refused_at_load(fallback, S):
    """The footprint rule (runtime/footprints.py) bounds the grid by cdiv(S, BLOCK_M) (+ E for segment
    tiles) and the operands by their views: a larger grid, S or expert count is refused before it runs."""
    x, w, offs = _operands(S, 16, 8, [1, S - 2, 0], torch.float32)
    lowered = td.lower(torch.export.export(Fn(lambda x, w, o: fallback(x, w, o)), (x, w, offs)), config=RESIDENT)

    def load(program):
        return LoadedProgram(InMemorySource(program, lowered.constant_data), devices="simulated").load_method("forward")

    torch.testing.assert_close(load(lowered.program)(x, w, offs), reference(x, w, offs))
    names = kernel_parameters(KERNELS["grouped_mm"])[0]
    for damage, match in (("grid", "grid axis 0 has"), ("S", "reaches elements"), ("E", "reaches elements")):
        program = copy.deepcopy(lowered.program)
        (launch,) = program.methods[0].delegates[0].plan.launches
        if damage == "grid":
            launch.grid = (launch.grid[0] + 1, *launch.grid[1:])
        else:
            at = names.index(damage)
            launch.args[at] = Arg(KernelArgKind.INT, launch.args[at].value + 1)
        with pytest.raises(td.ProgramError, match=match):
            load(program)


def test_a_partitioner_limited_to_the_op_claims_it(fallback):
    x, w, offs = _operands(20, 16, 8, [5, 15], torch.float32)
    ep = torch.export.export(Fn(lambda x, w, o: fallback(x, w, o) * 2), (x, w, offs))
    lowered = td.lower(ep, partitioner=td.TritonPartitioner(ops=[fallback.default]), config=RESIDENT)
    assert [launch.kernel for launch in plan_launches(lowered)] == ["grouped_mm"]
    assert [op for _, op, _ in lowered.reports["forward"].nodes.host] == ["aten.mul.Tensor"]


def test_dynamic_rows(fallback):
    """S a bounded dynamic dim: one program for every S in its range, segment tiles chosen at the bound."""
    torch.manual_seed(4)
    calls = []
    for S in (12, 30):
        x, w, offs = _operands(S, 24, 20, [S // 2, 0, S - S // 2 - 2], torch.float32)
        calls.append((x, w.contiguous(), offs))
    check_dynamic(Fn(lambda x, w, o: fallback(x, w, o)), calls, {"args": ({0: Dim("S", max=64)}, None, None)},
                  reference=reference)


def _moe(transformers, name):
    """A tiny transformers MoE causal LM: 2 layers, 4 experts, 2 per token."""
    common = dict(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2)
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=88, num_local_experts=4))
    if name == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, intermediate_size=88, moe_intermediate_size=40, num_experts=4, head_dim=12))
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**common, intermediate_size=40, num_experts=4))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_tiny_moe_matches_eager_with_every_grouped_mm_delegated(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = Logits(_moe(transformers, name).eval())
    args = (torch.randint(0, 96, (1, 9)),)
    ep = torch.export.export(model, args)
    grouped = [n.name for n in ep.graph.nodes if "grouped_mm" in str(n.target)]
    assert len(grouped) == 4  # gate/up and down of each layer
    lowered = td.lower(ep, config=RESIDENT)
    host = {name for name, _, _ in lowered.reports["forward"].nodes.host}
    assert not host & set(grouped), host
    assert sum(launch.kernel == "grouped_mm" for launch in plan_launches(lowered)) == 4
    with torch.no_grad():
        expected = model(*args)
    got = lowered.load().load_method()(*args)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# --- lower() refuses what the runtime could not run ---------------------------------------------------
@torch.library.custom_op("tdtest::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_op_that_is_not_aten_and_not_delegated_is_refused_at_lower():
    ep = torch.export.export(Fn(lambda x: torch.ops.tdtest.twice(x + 1) - 1), (torch.randn(5),))
    with pytest.raises(td.LoweringError, match=r"op 'tdtest::twice' \(node 'twice'\) is not an ATen operator and "
                                               r"no delegate claims it \(no Triton kernel for tdtest.twice.default\)"):
        td.lower(ep)


def test_a_grouped_mm_the_partitioner_leaves_out_is_refused_at_lower(fallback):
    """Refused by the partitioner (int operands), a transformers op would reach the host: lower() says so."""
    x, w, offs = torch.randint(0, 5, (6, 8)), torch.randint(0, 5, (2, 8, 4)), torch.tensor([2, 6])
    ep = torch.export.export(Fn(lambda x, w, o: fallback(x, w, o)), (x, w, offs))
    with pytest.raises(td.LoweringError, match=r"op 'transformers::grouped_mm_fallback'.*input has dtype torch.int64"):
        td.lower(ep)
