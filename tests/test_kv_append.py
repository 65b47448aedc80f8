"""A decode step's new key/value rows written into the KV cache by the attention launch that reads it
(``passes/kv_append.py``, ``attention.attention_append_kernel``): no scatter launch.

One attention layer over a static cache (random initial contents, so that a row left unwritten or
written twice shows), in a program whose methods share the cache. After every call the output is
compared with eager's and the state with eager's cache, exactly.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import tritondelegate as td
from harness import assert_close
from tritondelegate.kernels.table import KERNELS
from tritondelegate.plan import Arg, KernelArgKind
from tritondelegate.runtime.footprints import kernel_parameters
from tritondelegate.runtime.loader import InMemorySource, LoadedProgram

CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True), target="h100")


class CacheAttention(torch.nn.Module):
    """``cache[:, :, pos] = k`` (and v), then attention over the whole cache, keys kept up to the
    query's position: a static-cache decoder's attention."""

    def __init__(self, batch, heads, kv_heads, length, head_dim, dtype, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        shape = (batch, kv_heads, length, head_dim)
        self.register_buffer("k_cache", torch.randn(shape, generator=g).to(dtype))
        self.register_buffer("v_cache", torch.randn(shape, generator=g).to(dtype))
        self.heads = heads

    def forward(self, q, k, v, pos):
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        mask = torch.arange(self.k_cache.shape[2])[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


def inputs(model, lq, seed):
    g = torch.Generator().manual_seed(seed)
    b, hk, _, e = model.k_cache.shape
    dtype = model.k_cache.dtype
    return (torch.randn(b, model.heads, lq, e, generator=g).to(dtype),
            torch.randn(b, hk, lq, e, generator=g).to(dtype), torch.randn(b, hk, lq, e, generator=g).to(dtype))


def lower(model, methods: dict):
    """``methods``: name -> (lq, bound): a method takes lq new rows, or with a bound 1..bound rows."""
    eps = {}
    for name, (lq, bound) in methods.items():
        args = (*inputs(model, lq, 0), torch.arange(lq))
        shapes = None
        if bound:
            seq = torch.export.Dim("seq", max=bound)
            shapes = {"q": {2: seq}, "k": {2: seq}, "v": {2: seq}, "pos": {0: seq}}
        eps[name] = torch.export.export(model, args, dynamic_shapes=shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", td.PerCallCopyWarning)  # the cache stays on the device
        return td.lower(eps, config=CONFIG)


def kernels(lowered, name):
    (method,) = [m for m in lowered.program.methods if m.name == name]
    return [launch for d in method.delegates for launch in d.plan.launches]


def run_calls(lowered, model, calls):
    """Run ``calls`` ((method, first position, rows)) on the program and on an fp32 eager copy of ``model``
    (the reference) and a copy in its own dtype (the cache, exactly)."""
    program = lowered.load("simulated")
    memory = program._memory
    state = {s.name: i for i, s in enumerate(memory.program.slots) if s.state}
    reference = CacheAttention(*model.k_cache.shape[:1], model.heads, *model.k_cache.shape[1:], torch.float32)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    same = CacheAttention(*model.k_cache.shape[:1], model.heads, *model.k_cache.shape[1:], model.k_cache.dtype)
    same.load_state_dict(model.state_dict())
    methods = {name: program.load_method(name) for name in {c[0] for c in calls}}
    for step, (name, first, rows) in enumerate(calls):
        q, k, v = inputs(model, rows, seed=step + 1)
        pos = torch.arange(first, first + rows)
        got = methods[name](q, k, v, pos)
        with torch.no_grad():
            expected = reference(q.float(), k.float(), v.float(), pos)
            same(q, k, v, pos)
        assert_close(got, expected, dtype=q.dtype)
        for fqn, cache in (("k_cache", same.k_cache), ("v_cache", same.v_cache)):
            assert torch.equal(memory.slot_tensor(state[fqn]), cache), (step, fqn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_appends_in_the_attention_launch_and_prefill_keeps_its_scatter(dtype):
    # Batch 2, 4 query heads over 2 key heads (packed into one program per key head). The prefill takes
    # up to 200 rows: more than one query block, so it keeps its scatter; decode has none.
    model = CacheAttention(2, 4, 2, 24, 16, dtype)
    lowered = lower(model, {"prefill": (3, 200), "decode": (1, None)})
    assert [k.kernel for k in kernels(lowered, "decode")] == ["attention_append"]
    assert "scatter" in [k.kernel for k in kernels(lowered, "prefill")]
    (launch,) = kernels(lowered, "decode")
    assert launch.constexprs["PACK"].value == 2 and launch.grid[:2] == (1, 2 * 4 // 2)
    run_calls(lowered, model, [("prefill", 0, 3), ("decode", 3, 1), ("decode", 4, 1), ("prefill", 5, 2),
                               ("decode", 7, 1)])


def test_a_prompt_of_one_token_appends_too():
    model = CacheAttention(1, 2, 2, 16, 8, torch.float32)
    lowered = lower(model, {"prefill": (1, None), "decode": (1, None)})
    for name in ("prefill", "decode"):
        assert [k.kernel for k in kernels(lowered, name)] == ["attention_append"]
    run_calls(lowered, model, [("prefill", 0, 1), ("decode", 1, 1), ("decode", 2, 1)])


def test_a_dynamic_prompt_of_one_query_block_appends_its_rows():
    # Up to 8 rows of 2 packed heads: one query block at the bound, so every length appends.
    model = CacheAttention(1, 4, 2, 24, 16, torch.float32)
    lowered = lower(model, {"prefill": (3, 8), "decode": (1, None)})
    for name in ("prefill", "decode"):
        assert [k.kernel for k in kernels(lowered, name)] == ["attention_append"]
    run_calls(lowered, model, [("prefill", 0, 8), ("decode", 8, 1), ("prefill", 9, 3), ("prefill", 12, 1)])


def test_split_keys_write_the_rows_of_their_own_keys():
    # A long cache: the keys are split over programs (flash-decoding), and the new row falls in a later
    # split than the first; each split writes only the rows among its own keys.
    model = CacheAttention(1, 4, 2, 512, 16, torch.float32)
    lowered = lower(model, {"decode": (1, None)})
    append, combine = kernels(lowered, "decode")
    assert (append.kernel, combine.kernel) == ("attention_append", "attention_combine")
    assert append.constexprs["SPLIT"].value and append.grid[2] >= 2
    run_calls(lowered, model, [("decode", 300, 1), ("decode", 301, 1), ("decode", 5, 1)])


def test_query_heads_not_packed_write_the_same_rows():
    # 40 new rows of 2 query heads per key head: too many rows to pack, one query block in fp16. Both
    # query heads' programs write their key head's rows (the same bytes) before reading them.
    model = CacheAttention(1, 4, 2, 64, 16, torch.float16)
    lowered = lower(model, {"chunk": (40, None)})
    (launch,) = kernels(lowered, "chunk")
    assert launch.kernel == "attention_append"
    assert launch.constexprs["PACK"].value == 1 and launch.grid[:2] == (1, 4)
    run_calls(lowered, model, [("chunk", 0, 40), ("chunk", 20, 40)])


class ReadsCache(CacheAttention):
    def forward(self, q, k, v, pos):
        return super().forward(q, k, v, pos), self.k_cache.sum()


def test_a_cache_read_elsewhere_keeps_its_scatter():
    model = ReadsCache(1, 2, 2, 16, 8, torch.float32)
    lowered = lower(model, {"decode": (1, None)})
    assert [k.kernel for k in kernels(lowered, "decode")][:2] == ["scatter", "attention"]


@pytest.mark.parametrize("name, factor", [("Lnew", 1000), ("skn_h", 1000), ("svn_d", 1000)])
def test_a_launch_that_would_append_out_of_bounds_is_refused(name, factor):
    # More new rows than k_new and the index hold, or strides past the new rows: refused at load.
    lowered = lower(CacheAttention(1, 2, 2, 16, 8, torch.float32), {"decode": (1, None)})
    program = copy.deepcopy(lowered.program)
    (launch,) = program.methods[0].delegates[0].plan.launches
    k = kernel_parameters(KERNELS[launch.kernel])[0].index(name)
    launch.args[k] = Arg(KernelArgKind.INT, max(launch.args[k].value, 1) * factor)
    with pytest.raises(td.ProgramError, match=r"launch 0 \('attention_append'"):
        LoadedProgram(InMemorySource(program, lowered.constant_data), devices="simulated").load_method("decode")
