"""Identity copies and repeated computations are removed before lowering (``passes/dedupe.py``)."""

from __future__ import annotations

import warnings

import torch

import tritondelegate as td
from harness import Buffered, Fn, assert_close, export_decomposed
from tritondelegate.passes.dedupe import dedupe

aten = torch.ops.aten
CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _lower(model, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return td.lower(torch.export.export(model, args), config=CONFIG)


def _ops(lowered, method="forward") -> list[str]:
    (m,) = [m for m in lowered.program.methods if m.name == method]
    return [launch.op for d in m.delegates for launch in d.plan.launches]


def _count(ep, target) -> int:
    return sum(n.target is target for n in ep.graph_module.graph.nodes)


class Counter(torch.nn.Module):
    """transformers' static cache: every layer copies the first position into its own counter buffer,
    then recomputes the positions ``arange(T) + start`` for its cache write and writes back
    ``start + T``."""

    def __init__(self, layers=3):
        super().__init__()
        for i in range(layers):
            self.register_buffer(f"count{i}", torch.zeros((), dtype=torch.long))
        self.layers = layers

    def forward(self, x, cache_position):
        out = x
        for i in range(self.layers):
            count = getattr(self, f"count{i}")
            out = out + count.float() * (i + 2)  # what the last call wrote
            count.copy_(cache_position[0])
            positions = torch.arange(x.shape[0]) + count
            out = out + positions.float()[:, None] * (i + 1)
            count.add_(x.shape[0])
        return out


def test_identity_copies_and_repeats_are_removed():
    model, args = Counter(), (torch.randn(4, 3), torch.tensor([5, 6, 7, 8]))
    ep = export_decomposed(model, args)
    copies, adds = _count(ep, aten.copy.default), _count(ep, aten.add.Tensor)
    done = dedupe(ep)
    ep.graph_module.recompile()
    assert sum(d.startswith("identity copy: copy") for d in done) == 3, done
    assert _count(ep, aten.copy.default) == copies - 3 == 0
    assert _count(ep, aten.add.Tensor) == adds - 2  # the positions, computed once (arange merged too)
    assert torch.equal(ep.module()(*args), Counter()(*args))


def test_counter_buffers_each_keep_their_update():
    """The lowered program writes every counter (three buffers written from equal values), and the
    next call reads them: the merged nodes are never two outputs' one node."""
    model, x = Counter(), torch.randn(4, 3)
    calls = [(x, torch.tensor([5, 6, 7, 8])), (x, torch.tensor([9, 10, 11, 12])), (x, torch.tensor([1, 2, 3, 4]))]
    lowered = _lower(Counter(), calls[0])
    assert not any(op.startswith("copy") for op in _ops(lowered)), _ops(lowered)
    method = lowered.load("simulated").load_method("forward")
    for args in calls:
        assert_close(method(*args), model(*args), dtype=torch.float32)


def test_returned_repeats_stay_apart():
    model = Fn(lambda x: ((x + 1) * 2, (x + 1) * 2))
    args = (torch.randn(5),)
    ep = export_decomposed(model, args)
    dedupe(ep)
    # the inner add merges; both products are outputs and stay (one entry each in the signature)
    assert _count(ep, aten.add.Tensor) == 1 and _count(ep, aten.mul.Tensor) == 2
    lowered = _lower(model, args)
    got = lowered.load().load_method("forward")(*args)
    assert all(torch.equal(g, e) for g, e in zip(got, model(*args)))


def test_a_repeat_inside_a_model_is_one_launch():
    model = Fn(lambda x, y: torch.tanh(x * y) + torch.tanh(x * y).exp())
    args = (torch.randn(6, 7), torch.randn(6, 7))
    lowered = _lower(model, args)
    assert sum("tanh" in op for op in _ops(lowered)) == 1, _ops(lowered)
    assert_close(lowered.load().load_method("forward")(*args), model(*args), dtype=torch.float32)


def test_random_ops_never_merge():
    model = Fn(lambda x: x + torch.rand(4) + torch.rand(4))
    ep = export_decomposed(model, (torch.randn(4),))
    before = sum("rand" in str(n.target) for n in ep.graph_module.graph.nodes)
    dedupe(ep)
    assert sum("rand" in str(n.target) for n in ep.graph_module.graph.nodes) == before == 2


def test_a_cat_with_empty_parts_is_its_one_part():
    """Phi-3's ``cat((rotated, x[..., rotary_dim:]))`` with a rotary over the whole head: the cat goes.
    Its part here is a transposed product, and a view of the cat needs contiguous strides: that view
    is taken over a copy. A returned cat whose part has other strides stays."""
    def fn(x):
        t = x.transpose(0, 1) * 2  # [6, 4], transposed strides
        y = torch.cat([t, t[:, 4:]], dim=-1)  # the second part is empty
        return y.reshape(-1) + 1, torch.cat([t, t[:, 4:]], dim=-1)

    model, args = Fn(fn), (torch.randn(4, 6),)
    ep = export_decomposed(model, args)
    dedupe(ep)
    assert _count(ep, aten.cat.default) == 1  # the returned one stays
    lowered = _lower(model, args)
    for got, want in zip(lowered.load().load_method("forward")(*args), model(*args)):
        assert torch.equal(got, want)


def test_a_copy_written_back_to_a_buffer_keeps_the_buffers_new_value():
    """``buf.copy_(x[0])`` broadcast, then ``buf.copy_(x)``: the next call reads what this one wrote."""
    def fn(buf, x):
        out = buf * 1 + x
        buf.copy_(x)
        return out

    model, x = Buffered(fn, torch.zeros(3, 4)), torch.randn(3, 4)
    method = _lower(Buffered(fn, torch.zeros(3, 4)), (x,)).load().load_method("forward")
    for step in range(3):
        args = (x + step,)
        assert torch.equal(method(*args), model(*args))
