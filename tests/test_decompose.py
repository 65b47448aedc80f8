"""The decomposition table (tritondelegate/decompose.py): built once per set of registered operators."""

import torch

from tritondelegate.decompose import decompose

aten = torch.ops.aten


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.silu(x @ x.T).sum(0)


def _targets(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def test_the_same_program_decomposes_the_same_every_time():
    ep = torch.export.export(Model(), (torch.randn(4, 4),))
    first, second = _targets(decompose(ep)), _targets(decompose(ep))
    assert first == second
    assert aten.silu.default in first  # kept: it has a kernel
    assert aten.silu.default not in _targets(decompose(ep, keep=()))  # the keep set is part of the key


def test_an_operator_registered_after_a_first_decomposition_is_decomposed():
    decompose(torch.export.export(Model(), (torch.randn(4, 4),)))  # the table is built and cached
    lib = torch.library.Library("td_decompose_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")

    class Twice(torch.nn.Module):
        def forward(self, x):
            return torch.ops.td_decompose_test.twice(x) + 1

    targets = _targets(decompose(torch.export.export(Twice(), (torch.randn(3),))))
    assert torch.ops.td_decompose_test.twice.default not in targets
    assert aten.mul.Tensor in targets
