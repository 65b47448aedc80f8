"""Folding an eval-mode batch norm into the 1-D, 2-D or 3-D convolution before it.

``nn.Conv2d`` followed by ``nn.BatchNorm2d`` (or ``nn.Conv1d`` and ``nn.BatchNorm1d``: a Conformer's
convolution module, a TDNN's or QuartzNet's blocks; or ``nn.Conv3d`` and ``nn.BatchNorm3d``) in eval mode
decomposes to a convolution, then a batch norm over its result with the running statistics
(``_native_batch_norm_legit_no_training`` and a ``getitem`` of its output, or ``aten.batch_norm`` /
``aten.native_batch_norm`` with ``training=False`` where one is kept whole). The batch norm is an affine
map per output channel, so it folds into the convolution's weight and bias:

    y = conv(x, W, b)                         scale = gamma / sqrt(var + eps)      (gamma None: 1)
    z = batch_norm(y, gamma, beta,     ->     W' = W * scale[:, None, None, None(, None)]
                   mean, var, eps)            b' = (b - mean) * scale + beta       (b, beta None: 0)
                                              z  = conv(x, W', b')  (same stride, padding, groups...)

``W'`` and ``b'`` are written as graph nodes (casts, ``add``/``rsqrt``/``mul``/``sub``/``view``) on the
constant placeholders, so constant folding (which runs next, and without which this pass does not
run) computes them once at lower time and stores them in place of ``W`` and the batch norm's
operands, which are dropped when nothing else reads them. One launch per convolution less, and the
batch norm's pass over the activation with it. The arithmetic runs in fp32 (fp64 for an fp64
weight). An fp16/bf16 convolution keeps its weight: its result, rounded to its dtype as eager stores
it, is scaled and shifted per channel in fp32 (``(y * scale + shift).to(dtype)``, the convolution's
epilogue), as eager's batch norm computes in fp32 (rounding ``W'`` and ``b'`` to half precision lost
what the normalization's cancellation needs).

Folded when the convolution is 1-D, 2-D or 3-D and not transposed, the batch norm reads its result and nothing
else does (a convolution whose output is also used elsewhere keeps it, and its batch norm), the
batch norm's other outputs (``save_mean``/``save_rstd``) are unused, and ``W``, ``b``, ``gamma``,
``beta``, ``mean`` and ``var`` are constant placeholders (parameter, buffer or lifted constant that
is not program state; ``b``, ``gamma`` and ``beta`` may be absent) with one value per output channel.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .fold_constants import constant_inputs
from .rewrite import fake, replace_node, take_provenance, tensor_val

aten = torch.ops.aten

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Batch norm forms: target -> (position of eps, position of `training` or None, returns a tuple).
_BATCH_NORMS = {
    aten._native_batch_norm_legit_no_training.default: (6, None, True),
    aten.native_batch_norm.default: (7, 5, True),
    aten.batch_norm.default: (7, 5, False),
}
_CONVS = (aten.convolution.default, aten.conv2d.default)


def _conv_operands(conv: torch.fx.Node, constants: set[torch.fx.Node]):
    """(weight, bias or None) when ``conv`` is a 1-D, 2-D or 3-D, non-transposed convolution with constant
    weight and bias, else None."""
    if conv.op != "call_function" or conv.target not in _CONVS or conv.kwargs:
        return None
    if conv.target == aten.convolution.default and (len(conv.args) < 9 or conv.args[6] is not False):
        return None  # transposed
    weight = conv.args[1]
    bias = conv.args[2] if len(conv.args) > 2 else None
    if weight not in constants or (bias is not None and bias not in constants):
        return None
    wv, yv = tensor_val(weight), tensor_val(conv)
    if wv is None or yv is None or wv.ndim not in (3, 4, 5) or yv.ndim != wv.ndim or wv.dtype not in _FLOATS:
        return None
    if not isinstance(wv.shape[0], int) or yv.dtype != wv.dtype:
        return None
    if bias is not None:
        bv = tensor_val(bias)
        if bv is None or bv.dtype != wv.dtype or tuple(bv.shape) != (wv.shape[0],):
            return None
    return weight, bias


def _batch_norm_operands(bn: torch.fx.Node, constants: set[torch.fx.Node], channels: int):
    """(gamma, beta, mean, var, eps) when ``bn`` is an eval batch norm with constant per-channel
    operands for ``channels`` channels, else None."""
    eps_at, training_at, _ = _BATCH_NORMS[bn.target]
    if bn.kwargs or len(bn.args) <= eps_at:
        return None
    if training_at is not None and bn.args[training_at] is not False:
        return None
    gamma, beta, mean, var = bn.args[1:5]
    eps = bn.args[eps_at]
    if not isinstance(eps, (int, float)):
        return None
    for arg, optional in ((gamma, True), (beta, True), (mean, False), (var, False)):
        if arg is None and optional:
            continue
        val = tensor_val(arg)
        if arg not in constants or val is None or val.dtype not in _FLOATS or tuple(val.shape) != (channels,):
            return None
    return gamma, beta, mean, var, float(eps)


def _outputs(bn: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes that read the batch norm's normalized output (the node itself when it returns one
    tensor, its ``getitem(.., 0)`` otherwise); None when another of its outputs is read."""
    if not _BATCH_NORMS[bn.target][2]:
        return [bn]
    outs = []
    for user in bn.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        if user.args[1] == 0:
            outs.append(user)
        elif user.users:
            return None  # save_mean / save_rstd read by something
    return outs


def _candidates(graph: torch.fx.Graph, constants: set[torch.fx.Node]):
    for bn in graph.nodes:
        if bn.op != "call_function" or bn.target not in _BATCH_NORMS or not bn.args:
            continue
        conv = bn.args[0]
        if not isinstance(conv, torch.fx.Node) or len(conv.users) != 1:
            continue
        found = _conv_operands(conv, constants)
        if found is None:
            continue
        weight, bias = found
        operands = _batch_norm_operands(bn, constants, tensor_val(weight).shape[0])
        outs = _outputs(bn)
        if operands is None or not outs:
            continue  # not foldable, or its result is not read (nothing to gain)
        if any(tensor_val(o) is None or tensor_val(o).dtype != tensor_val(conv).dtype for o in outs):
            continue
        yield conv, bn, outs, weight, bias, operands


class _Builder:
    """Creates call_function nodes with their ``meta["val"]`` computed on the inputs' fake tensors."""

    def __init__(self, graph: torch.fx.Graph, meta: dict):
        self.graph, self.meta = graph, meta

    def __call__(self, target, *args, name: str | None = None, **kwargs) -> torch.fx.Node:
        nodes = [a for a in args if isinstance(a, torch.fx.Node)]
        vals = torch.fx.map_arg(args, lambda n: n.meta["val"])
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        # Under the fake mode of the node inputs' values (symbolic sizes stay symbolic).
        node.meta["val"] = fake(lambda *_: target(*vals, **kwargs), *[n.meta["val"] for n in nodes])
        return take_provenance(node, self.meta)

    def cast(self, node: torch.fx.Node, dtype: torch.dtype, name: str | None = None) -> torch.fx.Node:
        if node.meta["val"].dtype == dtype:
            return node
        return self(aten._to_copy.default, node, dtype=dtype, name=name)


def _fold(ep: torch.export.ExportedProgram, conv, bn, outs, weight, bias, operands) -> str:
    graph = ep.graph_module.graph
    _, beta, mean, _, _ = operands
    dtype = tensor_val(weight).dtype
    channels = tensor_val(weight).shape[0]
    with graph.inserting_before(conv):
        new = _Builder(graph, conv.meta)
        compute = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for an fp64 weight
        up = lambda n: new.cast(n, compute)  # noqa: E731
        scale = _scale(new, operands, up)
        if dtype != compute:  # fp16/bf16: an fp32 scale and shift after the convolution (its epilogue)
            return _affine_after(ep, new, conv, bn, outs, operands, scale, up, channels, dtype)
        # The last node of each is named, for the summary's list of what constant folding computed.
        names = (f"{conv.name}_bn_weight", f"{conv.name}_bn_bias")
        last = (lambda i: names[i]) if dtype == compute else (lambda i: None)
        per_channel = [channels] + [1] * (tensor_val(weight).ndim - 1)  # over W's [C_out, Cg, (KD,) KH, KW]
        w = new(aten.mul.Tensor, up(weight), new(aten.view.default, scale, per_channel), name=last(0))
        shift = new(aten.sub.Tensor, up(bias), up(mean)) if bias is not None else new(aten.neg.default, up(mean))
        b = new(aten.mul.Tensor, shift, scale, name=None if beta is not None else last(1))
        if beta is not None:
            b = new(aten.add.Tensor, b, up(beta), name=last(1))
        w, b = new.cast(w, dtype, name=names[0]), new.cast(b, dtype, name=names[1])
        args = (conv.args[0], w, b, *conv.args[3:])
        folded = new(conv.target, *args)
    for out in outs:
        replace_node(ep, out, folded)
    for user in list(bn.users):
        graph.erase_node(user)  # the normalized output's getitems (now unread) and unused stats
    graph.erase_node(bn)
    graph.erase_node(conv)
    return f"batch norm -> conv weights: {bn.name} into {conv.name}"


def _affine_after(ep, new, conv, bn, outs, operands, scale, up, channels: int, dtype) -> str:
    """``(conv(x) * scale + shift).to(dtype)`` with scale and shift per channel in fp32 for a half
    precision convolution: eager rounds the convolution's result to its dtype, then normalizes in fp32;
    rounding ``W * scale`` and ``b'`` to fp16/bf16 instead loses what the normalization's cancellation
    needs (LeViT in bf16: 12x eager's error). The chain runs in the convolution's epilogue."""
    _affine(ep, new, conv, bn, outs, operands, scale, up, channels, dtype, conv.name)
    return f"batch norm -> conv epilogue (fp32 scale and shift): {bn.name} after {conv.name}"


def _affine(ep, new, x, bn, outs, operands, scale, up, channels: int, dtype, prefix: str) -> None:
    """Replaces ``bn``'s outputs ``outs`` by ``(x * scale + shift).to(dtype)`` (the product and sum in
    ``scale``'s dtype), scale and shift per channel (dim 1 of x), computed by ``new`` before ``x`` or
    ``bn`` and named after ``prefix``."""
    graph = ep.graph_module.graph
    _, beta, mean, _, _ = operands
    shift = new(aten.mul.Tensor, up(mean), scale)
    shift = new(aten.sub.Tensor, up(beta), shift) if beta is not None else new(aten.neg.default, shift)
    per_channel = [channels] + [1] * (tensor_val(x).ndim - 2)  # over x's [C, (D,) (H,) (W)]
    scale = new(aten.view.default, scale, per_channel, name=f"{prefix}_bn_scale")
    shift = new(aten.view.default, shift, per_channel, name=f"{prefix}_bn_shift")
    with graph.inserting_before(bn):
        after = _Builder(graph, bn.meta)
        z = after.cast(after(aten.add.Tensor, after(aten.mul.Tensor, x, scale), shift), dtype)  # x * fp32: fp32
    for out in outs:
        replace_node(ep, out, z)
    for user in list(bn.users):
        graph.erase_node(user)
    graph.erase_node(bn)


def _scale(new, operands, up):
    """rsqrt(var + eps) * gamma, in the compute dtype ``up`` casts to."""
    gamma, _, _, var, eps = operands
    scale = new(aten.rsqrt.default, new(aten.add.Tensor, up(var), eps))
    return new(aten.mul.Tensor, scale, up(gamma)) if gamma is not None else scale


def affine_batchnorms(ep: torch.export.ExportedProgram, state: set[str] = frozenset()) -> list[str]:
    """Every eval batch norm left (after no convolution it could fold into: a pre-activation network's,
    LeViT's after its linears, one after a pooling) with constant statistics and affine parameters
    becomes ``(x * scale + shift).to(dtype)``, scale and shift per channel computed once by ``lower()``
    (fp32, or fp64 for fp64): two pointwise steps that fuse with their neighbours (a matmul's epilogue,
    an activation, a 1x1 convolution's prologue), where the batch norm kernel was a launch of its own.
    Eager's eval batch norm computes the same ``x * alpha + beta``. Returns one description each."""
    graph = ep.graph_module.graph
    constants = set(constant_inputs(ep, set(state)))
    done = []
    for bn in list(graph.nodes):
        if bn.op != "call_function" or bn.target not in _BATCH_NORMS or not bn.args:
            continue
        x, outs = bn.args[0], _outputs(bn)
        xv = tensor_val(x) if isinstance(x, torch.fx.Node) else None
        if xv is None or xv.ndim < 2 or not isinstance(xv.shape[1], int) or xv.dtype not in _FLOATS or not outs:
            continue
        operands = _batch_norm_operands(bn, constants, xv.shape[1])
        if operands is None or any(tensor_val(o) is None or tensor_val(o).dtype != xv.dtype for o in outs):
            continue
        with graph.inserting_before(bn):
            new = _Builder(graph, bn.meta)
            compute = torch.promote_types(xv.dtype, torch.float32)
            up = lambda n: new.cast(n, compute)  # noqa: E731
            _affine(ep, new, x, bn, outs, operands, _scale(new, operands, up), up, xv.shape[1], xv.dtype, bn.name)
        done.append(f"batch norm -> scale and shift per channel: {bn.name}")
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done


def fuse_batchnorm(ep: torch.export.ExportedProgram, state: set[str] = frozenset()) -> list[str]:
    """Fold every eval batch norm that follows a 1-D, 2-D or 3-D convolution with constant operands into that
    convolution's weight and bias, in place. ``state``: FQNs of program state (mutable buffers), never
    treated as constants. Returns one description per folded batch norm. Relies on constant folding
    to compute the new weights once."""
    graph = ep.graph_module.graph
    constants = set(constant_inputs(ep, set(state)))
    done = [_fold(ep, *found) for found in list(_candidates(graph, constants))]
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done
