import pytest
import torch

import tritondelegate as td
from harness import on_host
from tritondelegate.decompose import decompose

aten = torch.ops.aten


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        s = on_host(y)  # no kernel: stays on the host
        return s * 2 + y


def _partition(partitioner, model=None, args=None):
    model = model or Mixed()
    args = args or (torch.randn(3, 8),)
    ep = decompose(torch.export.export(model, args), keep=partitioner.ops_to_not_decompose(None))
    return ep, partitioner.partition(ep)


def test_partitioner_only_tags_and_keeps_reasons():
    ep, result = _partition(td.TritonPartitioner())
    names = {n.name: n for n in ep.graph_module.graph.nodes}
    assert "flip" in result.refused and "no Triton kernel for aten.flip.default" == result.refused["flip"]
    assert all(names[n].op == "call_function" for n in result.tags)
    assert set(result.tags.values()) == set(result.specs)
    assert all(s.device == "cuda:0" and s.backend_id == "TritonBackend" for s in result.specs.values())
    # The graph itself is untouched: no node carries a tag, no node was added.
    assert not any("delegation_tag" in n.meta for n in ep.graph_module.graph.nodes)
    # Nodes before and after the host op land in different delegates.
    assert result.tags["relu"] != result.tags["add"]


def test_ops_limits_what_is_claimed_by_name_or_overload():
    _, result = _partition(td.TritonPartitioner(ops=["aten.mul", aten.add.Tensor]))
    claimed = set(result.tags)
    assert "mul" in claimed and "add" in claimed and "relu" not in claimed
    assert result.refused["relu"] == "aten.relu.default is not in the partitioner's ops="


def test_ops_keeps_linear_whole_only_when_allowed():
    assert aten.linear.default in td.TritonPartitioner().ops_to_not_decompose(None)
    assert aten.linear.default not in td.TritonPartitioner(ops=["aten.mm"]).ops_to_not_decompose(None)


def test_unknown_op_name_is_a_clear_error():
    with pytest.raises(ValueError, match="aten.frobnicate.*no Triton kernel.*aten.mm"):
        td.TritonPartitioner(ops=["aten.frobnicate"])


def test_unsupported_dtype_is_refused_with_reason():
    class F64(torch.nn.Module):
        def forward(self, x):
            return x * 2

    _, result = _partition(td.TritonPartitioner(), F64(), (torch.randn(3, dtype=torch.float64),))
    assert result.tags == {}
    assert "float64" in result.refused["mul"]


def test_metadata_asserts_are_not_left_as_host_work():
    class Cast(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float16) * 2

    ep = torch.export.export(Cast(), (torch.randn(3),))
    lowered = td.lower(ep)
    host = lowered.reports["forward"].nodes.host
    assert host == []


def test_cycle_free_grouping_with_host_op_in_between():
    class Diamond(torch.nn.Module):
        def forward(self, x):
            a = x + 1
            b = on_host(a)  # host
            return a * b

    ep, result = _partition(td.TritonPartitioner(), Diamond(), (torch.randn(2, 5),))
    assert result.tags["add"] != result.tags["mul"]  # one group would be a cycle through the host op


def test_runtime_sources_do_not_name_torch_export():
    # torch itself imports torch.export, so the runtime's own sources are checked instead.
    import pathlib
    import re

    import tritondelegate.runtime as runtime
    import tritondelegate.serialize as serialize

    for package in (runtime, serialize):
        for path in pathlib.Path(package.__file__).parent.rglob("*.py"):
            imports = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", path.read_text(), re.M)
            assert not [m for m in imports if m.startswith(("torch.export", "torch._export", "torch.fx"))], path
