"""Weight-only quantized embedding tables (``td.quantize_linears(embeddings=True)``, ``QuantizedEmbedding``
in quantize.py, the ``dequant_rows`` kernel in kernels/dequant_rows.py).

The table stays integers on the device; a lookup gathers its rows and dequantizes them in one launch,
bit for bit what the quantized model computes in eager (a lookup is exact). A tied LM head reads the
same integers, so the program stores the table once.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.export import Dim

import tritondelegate as td
from harness import FLOAT_DTYPES, assert_close, check_dynamic, lower_resident, plan_launches
from tritondelegate.dtypes import dtype_name
from tritondelegate.kernels.table import KERNELS
from tritondelegate.kernels.traffic import method_traffic
from tritondelegate.plan import Arg, KernelArgKind
from tritondelegate.runtime.footprints import kernel_parameters
from tritondelegate.runtime.loader import InMemorySource, LoadedProgram

V, D = 97, 64  # D: 4 groups of 16
IDX = torch.tensor([[1, 5, 96, 0, 5], [7, 7, 40, 2, 63]])
FORMS = {"int8_row": dict(), "uint8_zero_g16": dict(group_size=16, zero_point=True),
         "int4_g32": dict(bits=4, group_size=32), "uint4_zero_g16": dict(bits=4, group_size=16, zero_point=True)}


class Tied(nn.Module):
    """An embedding, a linear and an LM head tied to the embedding's table."""

    def __init__(self, tied: bool = True):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.mid(self.emb(idx))))


class Lookup(nn.Module):
    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.emb = embedding

    def forward(self, idx):
        return self.emb(idx)


class Scaled(nn.Embedding):
    """An embedding subclass with a forward of its own (Gemma's: the rows scaled by sqrt(D))."""

    def forward(self, idx):
        return super().forward(idx) * (self.embedding_dim ** 0.5)


def _int_constants(lowered) -> list[tuple]:
    return [(c.dtype, tuple(c.shape)) for c in lowered.program.constants if c.dtype in ("int8", "uint8")]


def _float_tables(lowered) -> list[tuple]:
    return [tuple(c.shape) for c in lowered.program.constants
            if c.dtype not in ("int8", "uint8") and tuple(c.shape) in ((V, D), (D, V))]


# every form in bf16; two of them in the other dtypes
CASES = [(form, torch.bfloat16) for form in FORMS] + [
    (form, dtype) for form in ("int8_row", "uint4_zero_g16") for dtype in FLOAT_DTYPES if dtype != torch.bfloat16]


@pytest.mark.parametrize("form,dtype", CASES, ids=[f"{f}-{dtype_name(d)}" for f, d in CASES])
def test_lookups_stay_quantized_and_exact(form, dtype):
    torch.manual_seed(0)
    model = td.quantize_linears(Lookup(nn.Embedding(V, D)).to(dtype).eval(), embeddings=True, **FORMS[form])
    assert isinstance(model.emb, td.QuantizedEmbedding) and "weight" not in dict(model.emb.named_parameters())
    lowered = lower_resident(model, (IDX,))
    (launch,) = plan_launches(lowered)
    assert launch.kernel == "dequant_rows"
    symmetric_4_bits = form == "int4_g32"  # around 8: the kernel subtracts 8 (QZERO), no table of 8s
    assert launch.constexprs["QUANT"].value == ("zero_scale" if "zero" in form else "scale")
    assert ("QZERO" in launch.constexprs and launch.constexprs["QZERO"].value == 8) is symmetric_4_bits
    q_shape = (V, D // 2) if FORMS[form].get("bits") == 4 else (V, D)
    assert [s for _, s in _int_constants(lowered)] == [q_shape] and not _float_tables(lowered)
    groups = D // FORMS[form].get("group_size", D)
    tables = 2 if "zero" in form else 1  # scale (and zero) [V, groups], in dtype
    assert sum(c.nbytes for c in lowered.program.constants) == (
        q_shape[0] * q_shape[1] + tables * V * groups * dtype.itemsize)
    with torch.no_grad():
        got, expected = lowered.load().load_method("forward")(IDX), model(IDX)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("form", ["int8_row", "uint4_zero_g16"])
def test_a_tied_lm_head_reads_the_same_integers(form):
    torch.manual_seed(0)
    model = td.quantize_linears(Tied().to(torch.bfloat16).eval(), embeddings=True, **FORMS[form])
    assert model.head.qweight is model.emb.qweight and model.head.scale is model.emb.scale
    lowered = lower_resident(model, (IDX,))
    assert [l.kernel for l in plan_launches(lowered)] == ["dequant_rows", "matmul", "matmul"]
    # the table once (the middle linear's integers beside it), no float table
    q_shape = (V, D // 2) if FORMS[form].get("bits") == 4 else (V, D)
    assert sorted(s for _, s in _int_constants(lowered)) == sorted([q_shape, (D, q_shape[1])])
    assert not _float_tables(lowered)
    with torch.no_grad():
        assert_close(lowered.load().load_method("forward")(IDX), model(IDX), dtype=torch.bfloat16)


def test_without_embeddings_a_tied_head_is_a_quantized_copy_beside_the_float_table():
    torch.manual_seed(0)
    model = td.quantize_linears(Tied().eval())
    assert isinstance(model.emb, nn.Embedding) and not isinstance(model.emb, td.QuantizedEmbedding)
    lowered = lower_resident(model, (IDX,))
    assert (V, D) in _float_tables(lowered) and ("int8", (V, D)) in _int_constants(lowered)
    assert [l.kernel for l in plan_launches(lowered)][0] == "gather"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_an_embedding_subclass_keeps_its_forward_and_its_scale_is_the_lookups_epilogue(dtype):
    torch.manual_seed(0)
    model = td.quantize_linears(Lookup(Scaled(V, D)).to(dtype).eval(), embeddings=True, group_size=16)
    assert isinstance(model.emb, Scaled) and isinstance(model.emb, td.QuantizedEmbedding)
    with torch.no_grad():
        expected = nn.functional.embedding(IDX, model.emb.weight) * D ** 0.5
        assert torch.equal(model(IDX), expected)
        lowered = lower_resident(model, (IDX,))
        assert torch.equal(lowered.load().load_method("forward")(IDX), expected)
    (launch,) = plan_launches(lowered)  # Gemma's scale in the lookup's epilogue, as in a float gather's
    assert launch.kernel == "dequant_rows" and launch.constexprs["EPILOGUE"].value == 1
    assert not _float_tables(lowered)


class TokensAndPositions(nn.Module):
    """GPT-2's input: token rows plus position rows, two tables."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(32, D)

    def forward(self, idx, pos):
        return self.wte(idx) + self.wpe(pos)


def test_two_lookups_added_are_two_launches():
    # the add is the second lookup's epilogue, reading the first's rows by (row, column)
    torch.manual_seed(0)
    model = td.quantize_linears(TokensAndPositions().to(torch.bfloat16).eval(), embeddings=True, group_size=16)
    args = (IDX, torch.arange(IDX.shape[1]).expand_as(IDX))
    lowered = lower_resident(model, args)
    launches = plan_launches(lowered)
    assert [launch.kernel for launch in launches] == ["dequant_rows"] * 2
    assert [launch.constexprs.get("EPILOGUE") is not None for launch in launches] == [False, True]
    with torch.no_grad():
        assert torch.equal(lowered.load().load_method("forward")(*args), model(*args))


def test_embeddings_left_float_where_asked_or_where_they_do_not_fit():
    model = nn.ModuleDict({"a": nn.Embedding(V, D), "b": nn.Embedding(V, D, max_norm=1.0), "c": nn.Embedding(V, 24),
                           "d": nn.Embedding(V, D)})
    td.quantize_linears(model, embeddings=True, group_size=16, skip=("d",))
    assert isinstance(model["a"], td.QuantizedEmbedding)
    # max_norm renormalizes looked-up rows in place; 24 columns do not split into groups of 16; skipped
    assert not any(isinstance(model[k], td.QuantizedEmbedding) for k in "bcd")


def test_a_quantized_embedding_pickles_and_copies():
    torch.manual_seed(0)
    model = td.quantize_linears(Tied().eval(), embeddings=True, bits=4, group_size=16)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone.emb) is type(model.emb) and clone.head.qweight is clone.emb.qweight
        assert torch.equal(clone(IDX), model(IDX))


def test_a_lookup_reads_only_its_rows():
    # modelled traffic: the 10 looked-up rows of q (a byte per value) and of the scale table, not the table
    model = td.quantize_linears(Lookup(nn.Embedding(V, D)).to(torch.bfloat16).eval(), embeddings=True,
                                group_size=16)
    lowered = lower_resident(model, (IDX,))
    traffic = method_traffic(lowered.program.methods[0])
    rows = IDX.numel()
    assert traffic["bytes"] == rows * D + rows * (D // 16) * 2 + IDX.numel() * 8 + rows * D * 2


@pytest.mark.parametrize("damage,match", [("grid", "grid axis 0 has"), ("R", "reaches elements"),
                                          ("V", "reaches elements"), ("q_group", "reaches elements")])
def test_a_damaged_launch_is_refused_at_load(damage, match):
    """The footprint rule (runtime/footprints.py) bounds the grid by the rows looked up and every operand
    by its view: more programs, rows, table rows or groups than the launch has are refused before it runs."""
    model = td.quantize_linears(Lookup(nn.Embedding(V, D)).eval(), embeddings=True, group_size=16, zero_point=True)
    lowered = lower_resident(model, (IDX,))

    def load(program):
        return LoadedProgram(InMemorySource(program, lowered.constant_data), devices="simulated").load_method("forward")

    with torch.no_grad():
        assert torch.equal(load(lowered.program)(IDX), model(IDX))
    program = copy.deepcopy(lowered.program)
    (launch,) = program.methods[0].delegates[0].plan.launches
    if damage == "grid":
        launch.grid = (launch.grid[0] + 1, *launch.grid[1:])
    else:
        at = kernel_parameters(KERNELS["dequant_rows"])[0].index(damage)
        launch.args[at] = Arg(KernelArgKind.INT, launch.args[at].value * 2 if damage != "q_group" else 1)
    with pytest.raises(td.ProgramError, match=match):
        load(program)


def test_a_dynamic_number_of_lookups():
    # one program for 1..16 tokens: the rows looked up are a symbolic size of the launch
    torch.manual_seed(0)
    model = td.quantize_linears(Tied().eval(), embeddings=True, bits=4, group_size=16)
    calls = [(torch.randint(0, V, (1, n)),) for n in (3, 11)]
    lowered, _ = check_dynamic(model, calls, {"idx": {1: Dim("seq", max=16)}})
    assert [launch.kernel for launch in plan_launches(lowered)] == ["dequant_rows", "matmul", "matmul"]
