"""Folding an eval batch norm into the 2-D convolution before it: the convolution runs with
``W * scale`` and ``(b - mean) * scale + beta`` (computed once by constant folding), and the batch
norm's launch is gone."""

from __future__ import annotations

import copy
import operator
import sys
import warnings

import pytest
import torch
from torch import nn

import tritondelegate as td
import tritondelegate.passes.fuse as fuse_module
from harness import assert_close, check_dynamic
from test_resnet_block import TinyResNet
from tritondelegate.decompose import decompose
from tritondelegate.dtypes import dtype_name
from tritondelegate.passes.fold_constants import fold_constants
from tritondelegate.passes.fuse_batchnorm import fuse_batchnorm

# The module whose ``fuse_patterns`` ``lower()`` calls (``td.lower`` is the function, imported first:
# importing the submodule by name first would shadow it).
lower_module = sys.modules[td.lower.__module__]
RESIDENT = td.PropagateDeviceConfig(skip_h2d_for_constants=True)
BN_OPS = (torch.ops.aten._native_batch_norm_legit_no_training.default, torch.ops.aten.batch_norm.default,
          torch.ops.aten.native_batch_norm.default)


@pytest.fixture
def folding(monkeypatch):
    """``lower()`` runs this pass among its rewrites (already so once ``fuse_patterns`` calls it;
    a second run then finds no convolution + batch norm left)."""
    original = lower_module.fuse_patterns

    def fuse_patterns(ep, state, fold):
        done = original(ep, state, fold)
        return done + fuse_batchnorm(ep, state) if fold else done

    monkeypatch.setattr(lower_module, "fuse_patterns", fuse_patterns)


def _bn(channels, affine=True, kind=nn.BatchNorm2d):
    norm = kind(channels, affine=affine)
    norm.running_mean.normal_()
    norm.running_var.uniform_(0.5, 2.0)
    if affine:
        norm.weight.data.normal_(1.0, 0.3)
        norm.bias.data.normal_(0.0, 0.3)
    return norm


class ConvBN(nn.Module):
    def __init__(self, c_in=3, c_out=6, bias=True, affine=True, groups=1, relu=True, also_conv=False):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=1, padding=1, groups=groups, bias=bias)
        self.bn = _bn(c_out, affine)
        self.relu, self.also_conv = relu, also_conv

    def forward(self, x):
        y = self.conv(x)
        z = self.bn(y)
        z = torch.relu(z) if self.relu else z
        return (z, y) if self.also_conv else z


def _lower(model, args, dynamic_shapes=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        ep = torch.export.export(model, tuple(args), dynamic_shapes=dynamic_shapes)
        return td.lower(ep, config=td.LowerConfig(propagate_device=RESIDENT))


def _launches(lowered) -> list[str]:
    return [launch.kernel for d in lowered.program.methods[0].delegates for launch in d.plan.launches]


def _folded(lowered) -> list[str]:
    return [d for d in lowered.reports["forward"].fused if d.startswith("batch norm -> conv")]


def _check(lowered, model, x, dtype):
    """Run ``lowered`` on ``x`` (of ``dtype``) and compare with ``model`` in fp32 (same weights)."""
    results = lowered.load().load_method("forward")(x)
    with torch.no_grad():
        expected = copy.deepcopy(model).float()(x.float())
    for r, e in zip(torch.utils._pytree.tree_leaves(results), torch.utils._pytree.tree_leaves(expected)):
        assert r.dtype == dtype
        assert_close(r, e, dtype=dtype)


def _bn_nodes(ep) -> list:
    return [n for n in ep.graph_module.graph.nodes if n.op == "call_function" and n.target in BN_OPS]


# --- the rewrite on its own ------------------------------------------------------------------------

@pytest.mark.parametrize("decomposed", [True, False], ids=["legit_no_training", "batch_norm"])
def test_rewrite_then_fold(decomposed):
    """Decomposed (``_native_batch_norm_legit_no_training`` + ``getitem``) and as exported
    (``conv2d`` + ``batch_norm``, the form when kept whole): the batch norm is gone, the new weights
    are input-independent nodes that constant folding turns into two constants, the originals drop."""
    model, x = ConvBN().eval(), torch.randn(2, 3, 5, 5)
    ep = torch.export.export(model, (x,))
    ep = decompose(ep) if decomposed else ep
    assert len(_bn_nodes(ep)) == 1
    done = fuse_batchnorm(ep, set())
    assert len(done) == 1 and done[0].startswith("batch norm -> conv weights: ")
    assert _bn_nodes(ep) == []
    assert not any(n.target is operator.getitem for n in ep.graph_module.graph.nodes)
    assert fuse_batchnorm(ep, set()) == []  # a second run finds nothing to do
    assert sorted(fold_constants(ep, set())) == ["conv2d_bn_bias" if not decomposed else "convolution_bn_bias",
                                                "conv2d_bn_weight" if not decomposed else "convolution_bn_weight"]
    assert sorted(tuple(v.shape) for v in ep.constants.values()) == [(6,), (6, 3, 3, 3)]
    assert not dict(ep.named_parameters())  # conv and bn parameters dropped
    with torch.no_grad():
        assert_close(ep.module()(x), model(x))


def test_state_and_readers_block_the_rewrite():
    model, x = ConvBN(also_conv=True).eval(), torch.randn(1, 3, 4, 4)
    assert fuse_batchnorm(decompose(torch.export.export(model, (x,))), set()) == []
    # Running statistics that are program state are not constants.
    ep = decompose(torch.export.export(ConvBN().eval(), (x,)))
    assert fuse_batchnorm(ep, {"bn.running_var"}) == []
    assert len(_bn_nodes(ep)) == 1


def test_saved_statistics_read_block_the_rewrite():
    """A training-mode form's saved mean/rstd read by something: left alone."""
    aten = torch.ops.aten

    def fn(x, w, g, b, m, v):
        out, mean, rstd = aten.native_batch_norm.default(aten.convolution.default(
            x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), g, b, m, v, False, 0.1, 1e-5)
        return out + mean.sum()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3, 1, 1))
            self.norm = _bn(4)

        def forward(self, x):
            return fn(x, self.w, self.norm.weight, self.norm.bias, self.norm.running_mean, self.norm.running_var)

    ep = torch.export.export(M().eval(), (torch.randn(1, 3, 2, 2),))
    assert len(_bn_nodes(ep)) == 1
    assert fuse_batchnorm(ep, set()) == []


# --- end to end ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_conv_bn_relu(folding, dtype):
    model, x = ConvBN().eval().to(dtype), torch.randn(2, 3, 6, 5).to(dtype)
    lowered = _lower(model, (x,))
    assert len(_folded(lowered)) == 1
    kernels = _launches(lowered)
    assert kernels == ["conv2d"]  # the affine (half precision) and the relu in its epilogue
    constants = sorted((tuple(c.shape), c.dtype) for c in lowered.program.constants)
    if dtype == torch.float32:  # only the folded weight and bias (no bn parameters or statistics)
        assert constants == [((6,), "float32"), ((6, 3, 3, 3), "float32")]
    else:  # the weight and bias as they are, and the scale and shift per channel in fp32
        name = dtype_name(dtype)
        assert constants == [((6,), name), ((6, 1, 1), "float32"), ((6, 1, 1), "float32"), ((6, 3, 3, 3), name)]
    _check(lowered, model, x, dtype)


class Conv3dBN(nn.Module):
    """A 3-D UNet / video model's conv, BatchNorm3d and ReLU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 5, 3, padding=(0, 1, 1), bias=False)
        self.bn = _bn(5, kind=nn.BatchNorm3d)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_conv3d_bn_relu(folding, dtype):
    model, x = Conv3dBN().eval().to(dtype), torch.randn(2, 3, 4, 5, 6).to(dtype)
    lowered = _lower(model, (x,))
    assert len(_folded(lowered)) == 1
    assert _launches(lowered) == ["conv2d"]
    constants = sorted((tuple(c.shape), c.dtype) for c in lowered.program.constants)
    if dtype == torch.float32:
        assert constants == [((5,), "float32"), ((5, 3, 3, 3, 3), "float32")]
    else:  # the scale and shift per channel in fp32, over [C, D, H, W]
        assert constants == [((5, 1, 1, 1), "float32"), ((5, 1, 1, 1), "float32"), ((5, 3, 3, 3, 3), "float16")]
    _check(lowered, model, x, dtype)


class Conv1dBN(nn.Module):
    """A Conformer's or TDNN's conv1d, BatchNorm1d and SiLU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 5, padding=2)
        self.bn = _bn(6, kind=nn.BatchNorm1d)

    def forward(self, x):
        return nn.functional.silu(self.bn(self.conv(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv1d_bn_silu(folding, dtype):
    model, x = Conv1dBN().eval().to(dtype), torch.randn(2, 4, 9).to(dtype)
    lowered = _lower(model, (x,))
    assert len(_folded(lowered)) == 1
    assert _launches(lowered) == ["conv2d"]
    constants = sorted((tuple(c.shape), c.dtype) for c in lowered.program.constants)
    if dtype == torch.float32:
        assert constants == [((6,), "float32"), ((6, 4, 5), "float32")]
    else:  # the scale and shift per channel in fp32, over [C, L]
        assert constants == [((6,), "bfloat16"), ((6, 1), "float32"), ((6, 1), "float32"), ((6, 4, 5), "bfloat16")]
    _check(lowered, model, x, dtype)


@pytest.mark.parametrize("variant", [
    dict(bias=False), dict(affine=False), dict(bias=False, affine=False, relu=False),
    dict(c_in=4, c_out=6, groups=2), dict(c_in=5, c_out=5, groups=5, bias=False),
], ids=["no_conv_bias", "no_affine", "neither", "grouped", "depthwise"])
def test_variants(folding, variant):
    model, x = ConvBN(**variant).eval(), torch.randn(2, variant.get("c_in", 3), 5, 4)
    lowered = _lower(model, (x,))
    assert len(_folded(lowered)) == 1
    assert "batch_norm" not in _launches(lowered)
    _check(lowered, model, x, torch.float32)


def test_conv_output_also_returned(folding):
    """The convolution's own result is needed: nothing is folded into the weights; the batch norm is a
    scale and shift per channel (``affine_batchnorms``), in one launch with the ReLU; both still right."""
    model, x = ConvBN(also_conv=True).eval(), torch.randn(2, 3, 5, 5)
    lowered = _lower(model, (x,))
    assert _folded(lowered) == []
    assert _launches(lowered) == ["conv2d", "pointwise_chain"]
    assert any(d.startswith("batch norm -> scale and shift per channel") for d in lowered.reports["forward"].fused)
    _check(lowered, model, x, torch.float32)


def test_tiny_resnet(folding, monkeypatch):
    torch.manual_seed(0)
    model, x = TinyResNet().eval(), torch.randn(2, 3, 9, 9)
    lowered = _lower(model, (x,))
    # Every batch norm follows a convolution: stem 1, blocks 2 + (2 + shortcut's), depthwise-separable 1.
    assert len(_folded(lowered)) == 7
    kernels = _launches(lowered)
    assert "batch_norm" not in kernels
    _check(lowered, model, x, torch.float32)

    monkeypatch.setattr(lower_module, "fuse_patterns", fuse_module.fuse_patterns)
    monkeypatch.setattr(fuse_module, "fuse_batchnorm", lambda ep, state=frozenset(): [], raising=False)
    monkeypatch.setattr(fuse_module, "affine_batchnorms", lambda ep, state=frozenset(): [], raising=False)
    plain = _launches(_lower(model, (x,)))
    assert plain.count("batch_norm") == 7
    assert kernels.count("conv2d") == plain.count("conv2d")
    # One launch less per folded batch norm, at least (a bn may also have carried an epilogue).
    assert len(kernels) <= len(plain) - 7, (len(kernels), len(plain))


def test_dynamic_batch(folding):
    model = ConvBN(c_in=3, c_out=4).eval()
    calls = [(torch.randn(b, 3, 5, 5),) for b in (1, 7, 3)]
    batch = torch.export.Dim("batch", max=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered, _ = check_dynamic(model, calls, ({0: batch},), example=(torch.randn(2, 3, 5, 5),))
    assert len(_folded(lowered)) == 1
    assert "batch_norm" not in _launches(lowered)



# --- batch norms after no convolution: a scale and shift per channel --------------------------------
class DenseLayer(nn.Module):
    """A DenseNet layer: batch norm and ReLU of the features so far (a cat), a 1x1 conv, batch norm and
    ReLU, a 3x3 conv; its output joins the features."""

    def __init__(self, c=6, growth=4, width=8):
        super().__init__()
        self.bn1, self.conv1 = _bn(c), nn.Conv2d(c, width, 1, bias=False)
        self.bn2, self.conv2 = _bn(width), nn.Conv2d(width, growth, 3, padding=1, bias=False)

    def forward(self, a, b):
        features = torch.cat((a, b), 1)
        h = self.conv1(torch.relu(self.bn1(features)))
        return torch.cat((features, self.conv2(torch.relu(self.bn2(h)))), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_pre_activation_runs_in_the_1x1_convolution(dtype):
    torch.manual_seed(0)
    model = DenseLayer().eval().to(dtype)
    args = (torch.randn(2, 2, 5, 6).to(dtype), torch.randn(2, 4, 5, 6).to(dtype))
    lowered = _lower(model, args)
    kernels = _launches(lowered)
    assert "batch_norm" not in kernels and kernels.count("conv1x1") == 1, kernels
    assert any(d.startswith("batch norm -> scale and shift per channel") for d in lowered.reports["forward"].fused)
    result = lowered.load().load_method("forward")(*args)
    with torch.no_grad():
        expected = model.float()(*(a.float() for a in args))
    assert_close(result.float(), expected, dtype=dtype)


class LinearBN(nn.Module):
    """LeViT's MLPLayerWithBN: a linear, a BatchNorm1d over its tokens flattened, then Hardswish."""

    def __init__(self, c=8, out=12):
        super().__init__()
        self.linear, self.bn = nn.Linear(c, out, bias=False), _bn(out, kind=nn.BatchNorm1d)

    def forward(self, x):
        h = self.linear(x)
        return nn.functional.hardswish(self.bn(h.flatten(0, 1)).reshape_as(h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_batch_norm_after_a_linear_runs_in_its_epilogue(dtype):
    torch.manual_seed(0)
    model, x = LinearBN().eval().to(dtype), torch.randn(2, 5, 8).to(dtype)
    lowered = _lower(model, (x,))
    assert _launches(lowered) == ["matmul"]
    _check(lowered, model, x, dtype)
