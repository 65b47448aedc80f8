"""Constant folding at lower time: input-independent subgraphs become constants, nothing else does."""

import warnings

import pytest
import torch

import tritondelegate as td
from harness import Fn
from tritondelegate.decompose import decompose
from tritondelegate.models import demo_decoder
from tritondelegate.passes.fold_constants import fold_constants

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _lower(model, args, **config):
    cfg = td.LowerConfig(propagate_device=RESIDENT.propagate_device, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        return td.lower(torch.export.export(model, args), config=cfg)


def test_rotary_tables_of_the_decoder_are_computed_once():
    model, args = demo_decoder(seed=0)
    folded = _lower(model, args)
    plain = _lower(model, args, fold_constants=False)
    # The rotary tables, the Q/K/V weights concatenated by the projection fusion (and permuted into
    # rotation pairs for the rotary epilogue) and the gate/up weights interleaved by the gated-MLP
    # fusion, per layer.
    assert folded.reports["forward"].folded[:2] == ["cos", "sin"]
    rest = folded.reports["forward"].folded[2:]
    assert sorted(n.rsplit("_", 2)[-2] for n in rest) == ["glu", "glu", "rope", "rope"], rest
    assert "computed once by lower() (constant folding): cos, sin" in folded.summary()
    launches = lambda lowered: sum(lowered.reports["forward"].launches.values())  # noqa: E731
    assert launches(folded) < launches(plain)
    method = folded.load("simulated").load_method("forward")
    with torch.no_grad():
        torch.testing.assert_close(method(*args), model(*args), atol=1e-5, rtol=1e-5)


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6))
        self.register_buffer("steps", torch.zeros(6))

    def forward(self, x):
        scale = torch.arange(6, dtype=torch.float32).exp()  # input-independent: folded
        wt = self.w.t()  # a view of a weight: left alone (free at run time)
        big = torch.ones(1).expand(600, 1000).clone()  # 2.4 MB from 4 bytes: cheaper to compute
        self.steps.add_(1.0)  # state: never folded
        noise = torch.rand(6)  # random: never folded
        return (x @ wt) * scale + self.steps + noise.sum() * 0, x.sum() + big


def test_only_input_independent_deterministic_small_results_fold():
    ep = decompose(torch.export.export(Mixed(), (torch.randn(3, 6),)))
    folded = fold_constants(ep, state={"steps"})
    values = {tuple(ep.constants[s.target].shape): ep.constants[s.target]
              for s in ep.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"}
    # the scale, and the 4 bytes the large result is computed from (the large result itself is not)
    assert len(folded) == 2 and set(values) == {(6,), (1,)}
    torch.testing.assert_close(values[(6,)], torch.arange(6, dtype=torch.float32).exp())
    torch.testing.assert_close(values[(1,)], torch.ones(1))
    ops = {str(n.target) for n in ep.graph_module.graph.nodes if n.op == "call_function"}
    assert {"aten.rand.default", "aten.permute.default"} <= ops or {"aten.rand.default", "aten.t.default"} <= ops
    assert any("expand" in op for op in ops)  # the large result stays a computation


class RepeatedMask(torch.nn.Module):
    """Swin's shifted-window mask: built from aranges (input-independent, 9.6 KB), repeated over the
    windows and heads (2.4 MB: too big to store), added to the scores."""

    def forward(self, scores):
        idx = torch.arange(49)
        mask = (idx[:, None] // 7 != idx[None, :] // 7).float() * -100.0
        return scores + mask.repeat(64, 4, 1, 1)


def test_a_result_too_big_to_store_folds_what_it_is_computed_from():
    model, args = RepeatedMask(), (torch.randn(64, 4, 49, 49),)
    lowered = _lower(model, args)
    kernels = [launch.kernel for d in lowered.program.methods[0].delegates for launch in d.plan.launches]
    assert "arange" not in kernels and len(kernels) <= 2, kernels  # the repeat and the add, at most
    assert [tuple(c.shape) for c in lowered.program.constants] == [(49, 49)]
    torch.testing.assert_close(lowered.load().load_method("forward")(*args), model(*args))


class Reused(torch.nn.Module):
    """A computed weight read by the program and by another computation that is folded too (a
    transposed copy, a row sum): the second is computed from the first's new constant."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        a = self.w * 2.0
        return x @ a, x @ a.t(), x + a.sum(0)


def test_a_folded_value_read_by_a_later_folded_one():
    model, args = Reused(), (torch.randn(3, 4),)
    ep = decompose(torch.export.export(model, args))
    assert len(fold_constants(ep)) == 3
    with torch.no_grad():
        for result, expected in zip(_lower(model, args).load().load_method("forward")(*args), model(*args)):
            torch.testing.assert_close(result, expected)


@pytest.mark.parametrize("fold", [True, False])
def test_folded_program_matches_eager_and_keeps_state(fold):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(4))
            self.register_buffer("table", torch.arange(4, dtype=torch.float32))

        def forward(self, x):
            self.count.add_(1.0)
            return x * (self.table * 2 + 1).sin() + self.count

    model, x = Counter(), torch.randn(4)
    lowered = _lower(model, (x,), fold_constants=fold)
    assert (lowered.reports["forward"].folded != []) == fold
    method = lowered.load("simulated").load_method("forward")
    eager = Counter()
    for _ in range(2):
        torch.testing.assert_close(method(x), eager(x))


def test_a_graph_reading_only_inputs_is_unchanged():
    ep = decompose(torch.export.export(Fn(lambda x: (x * 2).sum()), (torch.randn(5),)))
    before = len(ep.graph_module.graph.nodes)
    assert fold_constants(ep) == [] and len(ep.graph_module.graph.nodes) == before


def test_with_dynamic_dimensions_what_depends_on_a_size_is_kept():
    from torch.export import Dim

    class Sized(torch.nn.Module):
        def forward(self, x):
            scale = torch.arange(8, dtype=torch.float32).exp()  # input-independent: folded
            rows = torch.arange(x.shape[0], dtype=torch.float32)  # depends on the batch: kept
            return x * scale + rows[:, None]

    model = Sized()
    ep = torch.export.export(model, (torch.randn(5, 8),), dynamic_shapes={"x": {0: Dim("batch", max=33)}})
    lowered = td.lower(ep)
    folded = lowered.reports["forward"].folded
    assert len(folded) == 1 and folded[0].startswith("exp")
    method = lowered.load("simulated").load_method("forward")
    for n in (1, 33, 7):
        x = torch.randn(n, 8)
        torch.testing.assert_close(method(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_method_without_inputs():
    model = Fn(lambda: (torch.arange(5) * 2, torch.ones(3, 2).cumsum(0)))
    lowered = _lower(model, ())
    assert lowered.reports["forward"].folded  # all of it depends on no input
    out = lowered.load("simulated").load_method("forward")()
    for r, e in zip(out, model()):
        torch.testing.assert_close(r, e)
