"""What a model takes and returns: ``nn.Sequential`` (its argument is named ``input``), arguments
named like builtins and ATen ops, named-tuple outputs, and a model that writes into its weight
(``embedding(max_norm=...)``)."""

from __future__ import annotations

import copy

import pytest
import torch

import tritondelegate as td
from harness import assert_close


def _run(model, args, tmp_path=None, **lower_kwargs):
    lowered = td.lower(torch.export.export(model, args), **lower_kwargs)
    if tmp_path is not None:
        lowered.save(tmp_path / "m.tdp")
        return lowered, td.load(tmp_path / "m.tdp").load_method("forward")
    return lowered, lowered.load().load_method("forward")


@pytest.mark.parametrize("ops", [None, ["aten.relu"]])  # all delegated; the linears left on the host
def test_sequential_lowers_saves_and_runs(tmp_path, ops):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()
    x = torch.randn(5, 4)
    _, method = _run(model, (x,), tmp_path, partitioner=td.TritonPartitioner(ops=ops))
    assert_close(method(x), model(x))
    with pytest.raises(td.InputError, match="'input'"):  # errors name the argument as the model does
        method(torch.randn(5, 3))


class BuiltinNames(torch.nn.Module):
    def forward(self, input, sum, max, getattr, output, linear, self_):
        return torch.cumprod(input, 0) * 2, (sum * max + getattr - output).relu(), torch.nn.functional.linear(linear, self_)


@pytest.mark.parametrize("ops", [None, ["aten.relu", "aten.add"]])
def test_arguments_named_like_builtins_and_aten_ops(ops):
    args = tuple(torch.randn(3, 3) for _ in range(7))
    dynamic = {"input": {0: torch.export.Dim("n", max=8)}, **dict.fromkeys(["sum", "max", "getattr", "output", "linear", "self_"])}
    ep = torch.export.export(BuiltinNames(), args, dynamic_shapes=dynamic if ops is None else None)
    method = td.lower(ep, partitioner=td.TritonPartitioner(ops=ops)).load().load_method("forward")
    for got, want in zip(method(*args), BuiltinNames()(*args)):
        assert_close(got, want)


def test_named_tuple_outputs_keep_their_type(tmp_path):
    fn = lambda x: (torch.max(x, 1), torch.min(x, 0, keepdim=True))  # noqa: E731

    class M(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    x = torch.randn(4, 6)
    _, method = _run(M(), (x,), tmp_path)
    got, expected = method(x), fn(x)
    assert type(got[0]) is torch.return_types.max and type(got[1]) is torch.return_types.min
    assert_close(got[0].values, expected[0].values)
    assert torch.equal(got[1].indices, expected[1].indices)


def test_embedding_max_norm_renormalizes_its_weight_on_the_host():
    torch.manual_seed(0)
    model = torch.nn.Embedding(10, 4, max_norm=1.0)
    reference = copy.deepcopy(model)
    ids = torch.tensor([1, 5, 1])
    with pytest.warns(td.PerCallCopyWarning, match="weight"):  # state a host op touches: copied per call
        lowered, method = _run(model, (ids,))
    host = {op: reason for _, op, reason in lowered.reports["forward"].nodes.host}
    assert "no Triton kernel" in host["aten.embedding_renorm.default"]
    assert "aten.embedding.default" not in host
    for call in (ids, torch.tensor([5, 7, 2]), ids):  # the weight is program state, renormalized per call
        assert_close(method(call), reference(call))
