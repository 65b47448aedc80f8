"""The decomposition table (tritondelegate/decompose.py): built once per set of registered operators."""

import pytest
import torch

from tritondelegate.decompose import decompose
from tritondelegate.unclaimed import decompose_unclaimed

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


# --- ops no kernel claims, decomposed further by torch's decompositions ---------------------------

def _lower(model, *args, partitioner=None):
    return _lower_ep(torch.export.export(model.eval(), args), partitioner)


def _lower_ep(ep, partitioner=None):
    import warnings

    import tritondelegate as td

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        return td.lower(ep, partitioner=partitioner)


class Resize(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, x):
        return torch.nn.functional.interpolate(x, **self.kwargs)


class Flip(torch.nn.Module):
    def forward(self, x):
        return torch.flip(x, [0, -1]) * 2


class Elu(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.elu(x, alpha=0.7) + torch.nn.functional.selu(x)


UNCLAIMED = {  # core ATen keeps each of these whole; no kernel claims them
    "flip": (Flip(), (3, 4, 5)),
    "elu, selu": (Elu(), (4, 9)),
    "bidirectional GRU (flip)": (torch.nn.GRU(6, 5, batch_first=True, bidirectional=True), (2, 4, 6)),
}


@pytest.mark.parametrize("name", UNCLAIMED)
def test_an_unclaimed_op_runs_on_the_device_as_its_decomposition(name):
    torch.manual_seed(0)
    model, shape = UNCLAIMED[name]
    x = torch.randn(shape)
    lowered = _lower(model, x)
    nodes = lowered.reports["forward"].nodes
    assert nodes.delegated == nodes.total, lowered.summary()
    out = lowered.load().load_method()(x)
    with torch.no_grad():
        expected = model(x)
    expected, out = (t[0] if isinstance(t, tuple) else t for t in (expected, out))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


RESIZES = {  # kept whole (the default table would gather and lerp): the resize kernel claims each
    "nearest 2x": (Resize(scale_factor=2, mode="nearest"), (2, 3, 5, 6)),
    "nearest to 7x9": (Resize(size=(7, 9), mode="nearest"), (1, 2, 5, 6)),
    "nearest-exact 1-D": (Resize(scale_factor=1.5, mode="nearest-exact"), (2, 3, 7)),
    "bilinear": (Resize(scale_factor=2, mode="bilinear", align_corners=False), (2, 3, 5, 6)),
    "bilinear, corners aligned": (Resize(size=(9, 11), mode="bilinear", align_corners=True), (1, 3, 5, 6)),
    "linear 1-D": (Resize(scale_factor=3, mode="linear"), (2, 3, 5)),
    "bicubic": (Resize(scale_factor=1.5, mode="bicubic"), (1, 2, 5, 6)),
}


@pytest.mark.parametrize("name", RESIZES)
def test_a_resize_is_one_launch_of_the_resize_kernel(name):
    from harness import plan_launches

    torch.manual_seed(0)
    model, shape = RESIZES[name]
    x = torch.randn(shape)
    lowered = _lower(model, x)
    nodes = lowered.reports["forward"].nodes
    assert nodes.delegated == nodes.total == 1, lowered.summary()
    assert [launch.kernel for launch in plan_launches(lowered)] == ["resize"]
    torch.testing.assert_close(lowered.load().load_method()(x), model(x), atol=1e-5, rtol=1e-5)


def test_an_op_whose_decomposition_still_needs_the_host_stays_whole():
    # bicubic grid_sample (its kernel takes bilinear and nearest) decomposes into gathers of 4 index
    # tensors, which the index kernel refuses
    class Sample(torch.nn.Module):
        def forward(self, x, grid):
            return torch.nn.functional.grid_sample(x, grid, mode="bicubic", align_corners=False)

    lowered = _lower(Sample(), torch.randn(1, 3, 6, 6), torch.rand(1, 4, 5, 2) * 2 - 1)
    nodes = lowered.reports["forward"].nodes
    assert (nodes.total, nodes.delegated) == (1, 0)
    assert "grid_sampler_2d" in lowered.summary()


def test_only_what_the_partitioner_claims_counts():
    import tritondelegate as td

    x = torch.randn(3, 4, 5)
    limited = _lower(Flip(), x, partitioner=td.TritonPartitioner(ops=["aten.mul.Tensor"]))
    nodes = limited.reports["forward"].nodes
    assert (nodes.total, nodes.delegated) == (2, 1), limited.summary()  # index_select is not claimed
    assert "aten.flip.default x1" in limited.summary()
    ep = decompose(torch.export.export(Flip(), (x,)))
    assert aten.flip.default in _targets(ep)  # core ATen keeps it whole
    assert aten.flip.default not in _targets(decompose_unclaimed(ep, td.TritonPartitioner().claims))
    assert aten.flip.default in _targets(decompose_unclaimed(ep, td.Partitioner().claims))  # claims all


def test_a_node_nothing_uses_does_not_keep_an_op_whole():
    # an unused value whose only user was a metadata check (OWL-ViT's logit_scale.exp().to(dtype)): dropped
    # with the check, else a retrace drops it and that reads as flip's decomposition taking it apart
    class Dead(torch.nn.Module):
        def forward(self, x):
            x.sigmoid().to(torch.float32)
            return torch.flip(x, [0])

    import tritondelegate as td

    ep = decompose(torch.export.export(Dead(), (torch.randn(4, 9),)))
    assert _targets(ep) == [aten.flip.default]
    assert aten.flip.default not in _targets(decompose_unclaimed(ep, td.TritonPartitioner().claims))
    x = torch.randn(4, 9)
    lowered = _lower(Dead(), x)
    assert not lowered.reports["forward"].nodes.host, lowered.summary()
    torch.testing.assert_close(lowered.load().load_method()(x), torch.flip(x, [0]))


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_a_resize_at_a_dynamic_batch_runs_on_the_device(mode):
    from harness import check_dynamic

    model = Resize(scale_factor=2, mode=mode)
    calls = [(torch.randn(b, 2, 4, 5),) for b in (1, 3, 2)]
    check_dynamic(model, calls, ({0: torch.export.Dim("batch", max=3)},), example=(torch.randn(2, 2, 4, 5),))


def test_a_resize_at_a_dynamic_height_runs_on_the_device():
    # torch's decomposition would scale coordinates by height / (2 * height), a SymFloat no kernel takes;
    # the resize kernel takes the sizes and computes the scale itself
    from harness import plan_launches

    ep = torch.export.export(Resize(scale_factor=2, mode="nearest"), (torch.randn(2, 2, 5, 5),),
                             dynamic_shapes=({2: torch.export.Dim("height", min=2, max=6)},))
    lowered = _lower_ep(ep)
    assert lowered.reports["forward"].nodes.host == []
    assert [launch.kernel for launch in plan_launches(lowered)] == ["resize"]
    method = lowered.load().load_method()
    for height in (3, 6, 2):
        x = torch.randn(2, 2, height, 5)
        torch.testing.assert_close(method(x), Resize(scale_factor=2, mode="nearest")(x))
