"""Gathers with a pointwise epilogue (kernels/fuse_gather.py, index.gather_kernel): the chain that alone
reads an embedding's (or another gather's) result runs in the gather launch, before the store, and the
gathered tensor is never written.

Each case is compared with eager (fp16/bf16 against an fp32 reference on the same rounded inputs and
weights) and its launches are listed as (kernel, the nodes it computes).
"""

import warnings

import pytest
import torch

import tritondelegate as td
from harness import FLOAT_DTYPES, Fn, Logits, assert_close, check_dynamic, check_low, plan_launches
from tritondelegate.dtypes import dtype_name

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
VOCAB, DIM = 37, 33  # odd sizes: no dim a power of two


class Emb(torch.nn.Module):
    """``fn(embedding, *args)`` with an embedding table of ``VOCAB`` x ``dim`` and a 0-d ``scale``
    buffer (Gemma's normalizer)."""

    def __init__(self, fn, dim=DIM):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.register_buffer("scale", torch.tensor(dim ** 0.5))
        self.fn = fn

    def forward(self, *args):
        return self.fn(self, *args)


def launches(plan):
    return [(launch.kernel, launch.op) for launch in plan.launches]


def epilogue(launch):
    c = {k: v.value for k, v in launch.constexprs.items()}
    return [c[f"EOP{k}"] for k in range(c.get("EPILOGUE", 0))]


def check(model, args, dtype=torch.float32):
    """``model`` in ``dtype`` against fp32 on the same rounded values (``harness.check_low``): the plan."""
    return check_low(model, args, dtype, tolerance=dtype)[1]


def ids(*shape):
    return torch.randint(0, VOCAB, shape)


# --- fused ----------------------------------------------------------------------------------------
@dtypes
@pytest.mark.parametrize("shape", [(2, 7), (1, 1), (3, 129)], ids=str)
def test_embedding_plus_positions(shape, dtype):
    """GPT-2's ``wte(ids) + wpe(positions)``: a [seq, dim] table broadcast over the batch."""
    torch.manual_seed(0)
    model = Emb(lambda m, i, p: m.emb(i) + p)
    plan = check(model, (ids(*shape), torch.randn(shape[-1], DIM)), dtype)
    assert launches(plan) == [("gather", "embedding+add")]
    assert epilogue(plan.launches[0]) == ["add"]


@dtypes
def test_embedding_times_scalar(dtype):
    torch.manual_seed(0)
    plan = check(Emb(lambda m, i: m.emb(i) * 5.5), (ids(2, 9),), dtype)
    assert launches(plan) == [("gather", "embedding+mul")]
    assert plan.launches[0].constexprs["EIS_SCALAR0"].value


@dtypes
def test_embedding_times_normalizer(dtype):
    """Gemma: ``embedding(ids) * normalizer``, a 0-d tensor in the model's dtype."""
    torch.manual_seed(0)
    plan = check(Emb(lambda m, i: m.emb(i) * m.scale), (ids(3, 11),), dtype)
    assert launches(plan) == [("gather", "embedding+mul")]


@dtypes
def test_chain_of_three(dtype):
    """``silu(p - emb * 0.5)`` stored in fp32: emb is the right operand of a sub (a swapped step)."""
    torch.manual_seed(0)
    model = Emb(lambda m, i, p: torch.nn.functional.silu(p - m.emb(i) * 0.5).float())
    plan = check(model, (ids(2, 5), torch.randn(2, 5, DIM)), dtype)
    (launch,) = plan.launches
    assert launch.kernel == "gather" and epilogue(launch) == ["mul", "sub", "silu"]
    assert launch.constexprs["ESWAP1"].value


def test_integer_source():
    """Gathered int64 values scaled by a float: converted to fp32 as a pointwise chain converts them."""
    x, i = torch.arange(40).reshape(8, 5) - 20, torch.randint(0, 8, (6,))
    plan = check(Fn(lambda x, i: torch.index_select(x, 0, i) * 0.5), (x, i))
    assert launches(plan) == [("gather", "index_select+mul")]


def test_strided_result_operand():
    """An operand read transposed: the walk collapses the gather's strides with the operand's."""
    torch.manual_seed(0)
    model = Emb(lambda m, i, q: m.emb(i) + q.transpose(0, 1))
    plan = check(model, (ids(6, 4), torch.randn(4, 6, DIM)))
    assert launches(plan) == [("gather", "embedding+add")]


@dtypes
def test_other_gathers(dtype):
    """index_select, gather and advanced indexing share the kernel and its epilogue."""
    torch.manual_seed(0)
    fn = Fn(lambda x, y, i, j: (torch.index_select(x, 0, i) * 2.0 + 1.0, torch.gather(x, 1, j) + y,
                                x[i, 3:] - 1.0))
    x, i, j = torch.randn(9, 13), torch.randint(0, 9, (5,)), torch.randint(0, 13, (9, 4))
    plan = check(fn, (x, torch.randn(9, 4), i, j), dtype)
    assert launches(plan) == [("gather", "index_select+mul+add"), ("gather", "gather+add_1"), ("gather", "index+sub")]


# --- not fused ------------------------------------------------------------------------------------
def test_gathered_value_also_returned():
    torch.manual_seed(0)
    plan = check(Emb(lambda m, i, p: (lambda e: (e, e + p))(m.emb(i))), (ids(2, 7), torch.randn(7, DIM)))
    assert all(not epilogue(launch) for launch in plan.launches if launch.kernel == "gather")
    assert "pointwise" in [k for k, _ in launches(plan)]


def test_gathered_value_read_twice():
    torch.manual_seed(0)
    plan = check(Emb(lambda m, i: (lambda e: e * e + 1.0)(m.emb(i))), (ids(2, 7),))
    assert [k for k, _ in launches(plan)][0] == "gather" and not epilogue(plan.launches[0])


def test_two_readers():
    torch.manual_seed(0)
    plan = check(Emb(lambda m, i, p: (lambda e: (e + p, e * 2.0))(m.emb(i))), (ids(2, 7), torch.randn(7, DIM)))
    assert [k for k, _ in launches(plan)][0] == "gather" and not epilogue(plan.launches[0])


def test_broadcast_gathered_value():
    """The chain broadcasts the gathered [5, D] over a batch of 3: the gather is not repeated per element."""
    torch.manual_seed(0)
    plan = check(Emb(lambda m, i, q: m.emb(i) + q), (ids(5), torch.randn(3, 5, DIM)))
    assert [k for k, _ in launches(plan)] == ["gather", "pointwise"]
    assert not epilogue(plan.launches[0])


def test_integer_chain_not_fused():
    """An integer chain (compute i64) on gathered integers stays a launch of its own."""
    x, i = torch.arange(40).reshape(8, 5), torch.randint(0, 8, (6,))
    plan = check(Fn(lambda x, i: torch.index_select(x, 0, i) + 3), (x, i))
    assert [k for k, _ in launches(plan)] == ["gather", "pointwise"]


# --- programs -------------------------------------------------------------------------------------
def test_dynamic_sequence_length():
    torch.manual_seed(0)
    model = Emb(lambda m, i, p: m.emb(i) * m.scale + p).eval()
    seq = torch.export.Dim("seq", max=64)
    calls = [(ids(2, n), torch.randn(n, DIM)) for n in (7, 1, 33)]
    lowered, _ = check_dynamic(model, calls, (({1: seq}, {0: seq}),))
    (launch,) = plan_launches(lowered)
    assert launch.kernel == "gather" and epilogue(launch) == ["mul", "add"]


def test_saved_and_loaded(tmp_path):
    """The fused launch's constexprs and arguments survive the program file."""
    torch.manual_seed(0)
    model = Emb(lambda m, i, p: (m.emb(i) + p) * 0.5).eval()
    args = (ids(2, 7), torch.randn(7, DIM))
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    lowered = td.lower(torch.export.export(model, args), config=config)
    assert [(k.kernel, k.op) for k in plan_launches(lowered)] == [("gather", "embedding+add+mul")]
    lowered.save(tmp_path / "gather.tdp")
    out = td.load(tmp_path / "gather.tdp").load_method("forward")(*args)
    with torch.no_grad():
        assert_close(out, model(*args))


def test_gpt2_embeddings_in_one_launch():
    """GPT-2 (2 layers): ``wte(ids) + wpe(positions)`` is one launch, 12 in all, logits as eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = Logits(transformers.GPT2LMHeadModel(config).eval())
    args = (torch.randint(0, 64, (1, 7)),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, args)
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    lowered = td.lower(ep, config=config)
    found = plan_launches(lowered)
    assert len(found) == 12
    assert found[0].kernel == "gather" and epilogue(found[0]) == ["add"]
    logits = lowered.load().load_method("forward")(*args)
    with torch.no_grad():
        assert_close(logits, model(*args))
