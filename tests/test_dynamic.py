"""Bounded dynamic shapes end to end: one program for every size up to a bound.

Each model is exported with ``torch.export.Dim(..., max=N)``, lowered once (memory planned for the
bound) and called at size 1, the bound and primes in between; every compute node is delegated and
every call matches eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

import tritondelegate as td
from tritondelegate import models

from harness import Fn, check_dynamic, lower_resident


def test_mlp_dynamic_batch():
    torch.manual_seed(0)
    model = models.MLP([8, 24, 16, 4]).eval()
    lowered, method = check_dynamic(model, [(torch.randn(n, 8),) for n in (5, 1, 2, 7, 13, 33)],
                                    {"x": {0: Dim("batch", max=33)}})
    (symbol,) = lowered.program.methods[0].symbols
    assert (symbol.min, symbol.max, symbol.input, symbol.dim) == (0, 33, 0, 0)


class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.nn.functional.max_pool2d(x, 2)
        x = torch.relu(self.conv2(x))
        return self.fc(x.mean(dim=(2, 3)))


def test_cnn_dynamic_batch():
    torch.manual_seed(0)
    model = TinyCNN().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2)
    check_dynamic(model, [(torch.randn(n, 3, 12, 12),) for n in (2, 1, 3, 7)], {"x": {0: Dim("batch", max=7)}})


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_decoder_dynamic_batch_and_sequence(attention):
    model, _ = models.demo_decoder(n_layers=1, attention=attention, max_seq_len=32)
    calls = [(torch.randint(0, 256, (b, s)),) for b, s in ((2, 5), (1, 1), (3, 16), (2, 7), (1, 13))]
    check_dynamic(model, calls, {"input_ids": {0: Dim("batch", max=3), 1: Dim("seq", max=16)}})


def _mlp_program(bound=33, **config):
    torch.manual_seed(0)
    model = models.MLP([8, 16, 4]).eval()
    ep = torch.export.export(model, (torch.randn(5, 8),), dynamic_shapes={"x": {0: Dim("batch", max=bound)}})
    cfg = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True), **config)
    return model, td.lower(ep, config=cfg)


def test_size_outside_the_range_is_an_input_error_and_the_next_call_works():
    model, lowered = _mlp_program(bound=9)
    method = lowered.load().load_method("forward")
    with pytest.raises(td.InputError, match=r"input 0 \('x'\) of method 'forward' dimension 0 is 10, outside its range 0..9"):
        method(torch.randn(10, 8))
    with pytest.raises(td.InputError, match=r"must have shape \[4, 8\]"):  # a static dim still checked
        method(torch.randn(4, 9))
    x = torch.randn(9, 8)
    torch.testing.assert_close(method(x), model(x), atol=1e-4, rtol=1e-4)


def test_a_dimension_without_a_bound_is_refused_naming_it():
    model = models.MLP([8, 4]).eval()
    ep = torch.export.export(model, (torch.randn(5, 8),), dynamic_shapes={"x": {0: Dim("batch")}})
    with pytest.raises(td.LoweringError, match=r"input 'x' dimension 0 is dynamic .* without an upper bound.*Dim\(\.\.\., max=N\)"):
        td.lower(ep)


def test_memory_is_planned_once_for_the_bound_and_views_narrow_per_call():
    model, lowered = _mlp_program(bound=33)
    method = lowered.program.methods[0]
    (arena,) = method.arenas
    # The output alone takes 33 rows x 4 floats at the bound; the arena holds every size.
    assert arena.nbytes >= 33 * 4 * 4
    program = lowered.load()
    f = program.load_method("forward")
    before = program.memory()
    for n in (1, 17, 33, 2):
        x = torch.randn(n, 8)
        torch.testing.assert_close(f(x), model(x), atol=1e-4, rtol=1e-4)
        assert f.stats.call_h2d_bytes == n * 8 * 4
        assert f.stats.call_d2h_bytes == n * 4 * 4
    assert program.memory() == before  # no call allocated device memory


def test_empty_batch():
    model, lowered = _mlp_program()
    out = lowered.load().load_method("forward")(torch.randn(0, 8))
    assert out.shape == (0, 4)


def test_graphs_are_captured_per_size_up_to_the_cap():
    from tritondelegate.runtime.method import MAX_GRAPH_SIZES

    model, lowered = _mlp_program(bound=MAX_GRAPH_SIZES + 2)
    method = lowered.load().load_method("forward", graphs=True)
    replays = {}
    for n in range(1, MAX_GRAPH_SIZES + 2):
        for _ in range(3):  # a delegate is captured on its second call at a size, replayed from its third
            x = torch.randn(n, 8)
            torch.testing.assert_close(method(x), model(x), atol=1e-4, rtol=1e-4)
        replays[n] = method.stats.graph_replays_per_call
    assert all(replays[n] == 1 for n in range(1, MAX_GRAPH_SIZES + 1))
    assert replays[MAX_GRAPH_SIZES + 1] == 0  # past the cap: plain launches
    x = torch.randn(1, 8)  # an early size still replays its graph
    torch.testing.assert_close(method(x), model(x), atol=1e-4, rtol=1e-4)
    assert method.stats.graph_replays_per_call == 1


def test_a_node_that_cannot_run_at_every_size_stays_on_the_host_with_the_reason():
    # bmm over up to 70000 matrices: more than one launch's grid holds, so the dynamic batch
    # cannot be lowered; the node runs on the host and the program still runs at every size.
    model = Fn(lambda a, b: torch.bmm(a, b) * 2)
    batch = Dim("batch", max=70000)
    args = (torch.randn(3, 4, 5), torch.randn(3, 5, 6))
    ep = torch.export.export(model, args, dynamic_shapes={"args": ({0: batch}, {0: batch})})
    lowered = td.lower(ep)
    host = {op: why for _, op, why in lowered.reports["forward"].nodes.host}
    assert "aten.bmm.default" in host and "exceeds one launch's 65535" in host["aten.bmm.default"]
    method = lowered.load().load_method("forward")
    for n in (1, 4):
        a, b = torch.randn(n, 4, 5), torch.randn(n, 5, 6)
        torch.testing.assert_close(method(a, b), model(a, b), atol=1e-4, rtol=1e-4)


def test_transformer_encoder_dynamic_batch_and_sequence():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=48, batch_first=True,
                                             dropout=0.0).eval()
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    calls = [(torch.randn(b, s, 32),) for b, s in ((2, 6), (1, 1), (3, 13), (2, 11), (1, 5))]
    check_dynamic(model, calls, {"src": {0: Dim("batch", max=3), 1: Dim("seq", max=13)}})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_models_with_dynamic_dims(dtype):
    torch.manual_seed(0)
    mlp = models.MLP([8, 24, 4]).eval()
    calls = [(torch.randn(n, 8),) for n in (3, 1, 17)]
    check_dynamic(copy.deepcopy(mlp).to(dtype), [(x.to(dtype),) for (x,) in calls], {"x": {0: Dim("batch", max=17)}},
                  dtype=dtype, reference=lambda x: mlp(x.float()))  # judged against fp32
    decoder, _ = models.demo_decoder(n_layers=1, max_seq_len=32)
    calls = [(torch.randint(0, 256, (1, s)),) for s in (4, 1, 13)]
    check_dynamic(copy.deepcopy(decoder).to(dtype), calls, {"input_ids": {1: Dim("seq", max=13)}}, dtype=dtype,
                  reference=decoder)


class _Hidden(torch.nn.Module):
    """A transformers encoder as (input_ids or pixel_values) -> last hidden state."""

    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(**{self.key: x}).last_hidden_state


def _hf_case(name):
    transformers = pytest.importorskip("transformers")
    from harness import Logits

    torch.manual_seed(0)
    seq = Dim("seq", max=16)
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)
        model = Logits(transformers.GPT2LMHeadModel(config).eval())
        return model, [(torch.randint(0, 64, (2, n)),) for n in (5, 1, 16, 11)], {"input_ids": {1: seq}}
    if name == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=48, vocab_size=64, max_position_embeddings=64)
        model = _Hidden(transformers.BertModel(config).eval(), "input_ids")
        calls = [(torch.randint(0, 64, (b, n)),) for b, n in ((2, 5), (1, 1), (3, 16), (2, 11))]
        return model, calls, {"x": {0: Dim("batch", max=3), 1: seq}}
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=48, image_size=16, patch_size=4)
    model = _Hidden(transformers.ViTModel(config).eval(), "pixel_values")
    return model, [(torch.randn(n, 3, 16, 16),) for n in (2, 1, 5, 3)], {"x": {0: Dim("batch", max=5)}}


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])
def test_transformers_models_with_dynamic_dims(name):
    model, calls, dynamic = _hf_case(name)
    check_dynamic(model, calls, dynamic)


def test_a_damaged_dynamic_plan_is_refused_at_load():
    # Sizes are prepared on the first call at each size; the plans are still checked when the method loads.
    _, lowered = _mlp_program()
    launch = lowered.program.methods[0].delegates[0].plan.launches[0]
    launch.args.pop()
    with pytest.raises(td.ProgramError, match="does not fit the kernel's parameters"):
        lowered.load().load_method("forward")


def test_a_data_dependent_size_is_refused_by_name():
    class Masked(torch.nn.Module):
        def forward(self, x, mask):
            return x[mask] * 2

    ep = torch.export.export(Masked(), (torch.randn(5, 3), torch.tensor([True, False, True, True, False])))
    with pytest.raises(td.LoweringError, match="size of 'index' .* depends on tensor data"):
        td.lower(ep)


def test_views_of_min_max_sizes_are_delegated():
    """Exported under no_grad, GPT-2's Conv1D flattens with ``view(-1, x.size(-1))``: the export writes
    that size as torch's own ``Min(32, 32*s)``, which the plan now states as ``min(...)`` (before, the
    views stayed on the host, splitting the delegate and copying per call)."""
    class Conv1D(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = torch.nn.Parameter(torch.randn(32, 48)), torch.nn.Parameter(torch.randn(48))

        def forward(self, x):
            return torch.addmm(self.b, x.view(-1, x.size(-1)), self.w).view(x.size()[:-1] + (48,)).relu()

    n = Dim("n", min=2, max=16)
    with torch.no_grad():
        lowered, _ = check_dynamic(Conv1D(), [(torch.randn(2, k, 32),) for k in (7, 2, 16)], ({1: n},))
    assert len(lowered.program.methods[0].delegates) == 1


def test_a_dim_of_size_one_over_the_whole_range_broadcasts():
    """MPT's ALiBi bias ``bias[:, max(0, 1 - s):, max(0, 64 - s):]`` of a [4, 1, 64] constant has dims
    1 - max(0, 1 - s) and s: the first is 1 for every s the program takes (s >= 2), so the sum
    broadcasts it over the queries, not walks it with its stride (the plan read past the constant at
    the largest size before)."""
    class Alibi(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("bias", torch.randn(4, 1, 64))

        def forward(self, scores):
            s = scores.shape[-1]
            return scores + self.bias[:, max(0, 1 - s):, max(0, 64 - s):]

    model = Alibi()
    seq = torch.export.Dim("seq", min=2, max=16)
    lowered = lower_resident(model, (torch.randn(2, 4, 5, 5),), dynamic_shapes=({2: seq, 3: seq},))
    method = lowered.load().load_method()
    for n in (2, 16, 9):
        scores = torch.randn(2, 4, n, n)
        torch.testing.assert_close(method(scores), model(scores))
