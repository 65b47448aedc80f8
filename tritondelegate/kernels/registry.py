"""The lowering side's table: ATen overload -> how to check and lower it.

``OPS`` is what the partitioner consults (``support(node)`` returns ``None`` or a refusal reason) and
what the backend calls (``lower(builder, node)``). The table is written out here on purpose: grep for
an op, find its entry. The runtime's table of kernels by name is ``table.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import ops as td_ops  # noqa: F401  (registers the tritondelegate:: ops)
from . import activations as act
from . import attention as attn
from . import bags
from . import batch_stats as bs
from . import batchnorm as bn
from . import conv
from . import depthwise as dw
from . import creation
from . import distance as dist
from . import index as idx
from . import elementwise as ew
from . import grid_sample as gs
from . import group_norm as gn
from . import grouped_mm as gmm
from . import histogram as hist
from . import layout
from . import matmul as mm
from . import norm
from . import pad
from . import pool
from . import quant_readers as qr
from . import ranking
from . import reduce as red
from . import resize
from . import router
from . import rotary as rot
from . import scatter as sc
from . import softmax as sm
from . import sort_offsets as so

aten = torch.ops.aten


@dataclass(frozen=True)
class OpSpec:
    lower: Callable  # (LaunchBuilder, fx.Node) -> None
    support: Callable = ew.supported  # (fx.Node) -> reason | None
    is_view: bool = False  # launches nothing: the result aliases an operand


def _view(lower, support=layout.supported) -> OpSpec:
    return OpSpec(lower, support, is_view=True)


OPS: dict[object, OpSpec] = {
    # pointwise: elementwise.py
    aten.add.Tensor: OpSpec(ew.binary("add")),
    aten.add.Scalar: OpSpec(ew.binary("add")),
    aten.sub.Tensor: OpSpec(ew.binary("sub")),
    aten.sub.Scalar: OpSpec(ew.binary("sub")),
    aten.rsub.Scalar: OpSpec(ew.rsub),
    aten.rsub.Tensor: OpSpec(ew.rsub),
    aten.mul.Tensor: OpSpec(ew.binary("mul")),
    aten.mul.Scalar: OpSpec(ew.binary("mul")),
    aten.div.Tensor: OpSpec(ew.binary("div")),
    aten.div.Scalar: OpSpec(ew.binary("div")),
    aten.div.Tensor_mode: OpSpec(ew.div_mode, ew.supported_div_mode),
    aten.div.Scalar_mode: OpSpec(ew.div_mode, ew.supported_div_mode),
    aten.remainder.Tensor: OpSpec(ew.binary("remainder"), ew.supported_numeric),
    aten.remainder.Scalar: OpSpec(ew.binary("remainder"), ew.supported_numeric),
    aten.fmod.Tensor: OpSpec(ew.binary("fmod"), ew.supported_numeric),
    aten.fmod.Scalar: OpSpec(ew.binary("fmod"), ew.supported_numeric),
    aten.pow.Tensor_Scalar: OpSpec(ew.binary("pow"), ew.supported_float),
    aten.pow.Tensor_Tensor: OpSpec(ew.binary("pow"), ew.supported_float),
    aten.pow.Scalar: OpSpec(ew.pow_scalar_base, ew.supported_float),
    aten.maximum.default: OpSpec(ew.binary("maximum")),
    aten.minimum.default: OpSpec(ew.binary("minimum")),
    aten.eq.Tensor: OpSpec(ew.binary("eq")),
    aten.eq.Scalar: OpSpec(ew.binary("eq")),
    aten.ne.Tensor: OpSpec(ew.binary("ne")),
    aten.ne.Scalar: OpSpec(ew.binary("ne")),
    aten.lt.Tensor: OpSpec(ew.binary("lt")),
    aten.lt.Scalar: OpSpec(ew.binary("lt")),
    aten.le.Tensor: OpSpec(ew.binary("le")),
    aten.le.Scalar: OpSpec(ew.binary("le")),
    aten.gt.Tensor: OpSpec(ew.binary("gt")),
    aten.gt.Scalar: OpSpec(ew.binary("gt")),
    aten.ge.Tensor: OpSpec(ew.binary("ge")),
    aten.ge.Scalar: OpSpec(ew.binary("ge")),
    aten.logical_and.default: OpSpec(ew.binary("logical_and")),
    aten.logical_or.default: OpSpec(ew.binary("logical_or")),
    aten.bitwise_and.Tensor: OpSpec(ew.binary("bitwise_and")),
    aten.bitwise_or.Tensor: OpSpec(ew.binary("bitwise_or")),
    aten.bitwise_xor.Tensor: OpSpec(ew.binary("bitwise_xor"), ew.supported_integer),
    aten.bitwise_not.default: OpSpec(ew.unary("bitwise_not"), ew.supported_integer),
    aten.neg.default: OpSpec(ew.unary("neg")),
    aten.exp.default: OpSpec(ew.unary("exp"), ew.supported_float),
    aten.log.default: OpSpec(ew.unary("log"), ew.supported_float),
    aten.log1p.default: OpSpec(ew.unary("log1p"), ew.supported_float),
    aten.floor.default: OpSpec(ew.unary("floor"), ew.supported_float),
    aten.ceil.default: OpSpec(ew.unary("ceil"), ew.supported_float),
    aten.trunc.default: OpSpec(ew.unary("trunc"), ew.supported_float),
    aten.round.default: OpSpec(ew.unary("round"), ew.supported_float),
    aten.expm1.default: OpSpec(ew.unary("expm1"), ew.supported_float),
    aten.sqrt.default: OpSpec(ew.unary("sqrt"), ew.supported_float),
    aten.rsqrt.default: OpSpec(ew.unary("rsqrt"), ew.supported_float),
    aten.reciprocal.default: OpSpec(ew.unary("reciprocal"), ew.supported_float),
    aten.abs.default: OpSpec(ew.unary("abs")),
    aten.sign.default: OpSpec(ew.unary("sign")),
    aten.sigmoid.default: OpSpec(ew.unary("sigmoid"), ew.supported_float),
    aten.silu.default: OpSpec(ew.unary("silu"), ew.supported_float),
    aten.relu.default: OpSpec(ew.unary("relu")),
    aten.tanh.default: OpSpec(ew.unary("tanh"), ew.supported_float),
    aten.cos.default: OpSpec(ew.unary("cos"), ew.supported_float),
    aten.sin.default: OpSpec(ew.unary("sin"), ew.supported_float),
    aten.erf.default: OpSpec(ew.unary("erf"), ew.supported_float),
    aten.logical_not.default: OpSpec(ew.unary("logical_not")),
    aten.isinf.default: OpSpec(ew.unary("isinf")),
    aten.isnan.default: OpSpec(ew.unary("isnan")),
    aten.gelu.default: OpSpec(ew.gelu, ew.supported_float),
    aten.where.self: OpSpec(ew.where),
    aten.clamp.default: OpSpec(ew.clamp),
    aten.clamp.Tensor: OpSpec(ew.clamp),
    aten.clamp_min.default: OpSpec(ew.clamp),
    aten.clamp_max.default: OpSpec(ew.clamp),
    aten.hardtanh.default: OpSpec(ew.hardtanh),
    # activations with parameters, one pointwise op each: activations.py
    aten.leaky_relu.default: OpSpec(act.leaky_relu, ew.supported_float),
    aten.prelu.default: OpSpec(act.prelu, act.supported_prelu),
    aten.elu.default: OpSpec(act.elu, act.supported_elu),
    aten.celu.default: OpSpec(act.celu, ew.supported_float),
    aten.softplus.default: OpSpec(act.softplus, act.supported_softplus),
    aten.mish.default: OpSpec(act.unary("mish"), ew.supported_float),
    aten.hardswish.default: OpSpec(act.unary("hardswish"), ew.supported_float),
    td_ops.sigmoid_gate: OpSpec(act.sigmoid_gate, ew.supported_float),
    td_ops.softsign: OpSpec(act.unary("softsign"), ew.supported_float),
    td_ops.tanhshrink: OpSpec(act.unary("tanhshrink"), ew.supported_float),
    aten.log_sigmoid.default: OpSpec(act.unary("logsigmoid"), ew.supported_float),
    aten.hardshrink.default: OpSpec(act.hardshrink, ew.supported_float),
    aten.softshrink.default: OpSpec(act.softshrink, ew.supported_float),
    aten.threshold.default: OpSpec(act.threshold, ew.supported_float),
    aten.clone.default: OpSpec(ew.copy),
    aten._to_copy.default: OpSpec(ew.copy, ew.supported_copy),
    # views and layout: layout.py
    aten.view.default: _view(layout.view),
    aten._unsafe_view.default: _view(layout.view),
    aten.reshape.default: _view(layout.view),
    aten.alias.default: _view(layout.alias),
    aten.permute.default: _view(layout.permute),
    aten.transpose.int: _view(layout.transpose),
    aten.t.default: _view(layout.t),
    aten.expand.default: _view(layout.expand),
    aten.as_strided.default: _view(layout.as_strided, layout.supported_strided),
    aten.slice.Tensor: _view(layout.slice_),
    aten.unfold.default: _view(layout.unfold),
    aten.select.int: _view(layout.select),
    aten.unsqueeze.default: _view(layout.unsqueeze),
    aten.squeeze.dim: _view(layout.squeeze),
    aten.squeeze.dims: _view(layout.squeeze),
    aten.squeeze.default: _view(layout.squeeze),
    aten.cat.default: OpSpec(layout.cat, layout.supported_cat),
    aten.repeat.default: OpSpec(layout.repeat, layout.supported_repeat),
    aten.split_with_sizes.default: _view(layout.split_with_sizes, layout.supported_split),
    # padding: pad.py
    aten.constant_pad_nd.default: OpSpec(pad.pad, pad.supported),
    aten.reflection_pad1d.default: OpSpec(pad.pad, pad.supported),
    aten.reflection_pad2d.default: OpSpec(pad.pad, pad.supported),
    aten.reflection_pad3d.default: OpSpec(pad.pad, pad.supported),
    aten.replication_pad1d.default: OpSpec(pad.pad, pad.supported),
    aten.replication_pad2d.default: OpSpec(pad.pad, pad.supported),
    aten.replication_pad3d.default: OpSpec(pad.pad, pad.supported),
    # creation: creation.py
    aten.scalar_tensor.default: OpSpec(creation.full, creation.supported),
    aten.full.default: OpSpec(creation.full, creation.supported),
    aten.full_like.default: OpSpec(creation.full_like, creation.supported),
    aten.fill.Scalar: OpSpec(creation.full_like, creation.supported),
    aten.arange.default: OpSpec(creation.arange, creation.supported_arange),
    aten.arange.start: OpSpec(creation.arange, creation.supported_arange),
    aten.arange.start_step: OpSpec(creation.arange, creation.supported_arange),
    aten.empty.memory_format: OpSpec(creation.empty, creation.supported),
    aten.empty_permuted.default: OpSpec(creation.empty, creation.supported),
    aten.empty_like.default: OpSpec(creation.empty, creation.supported),
    aten.new_empty.default: OpSpec(creation.empty, creation.supported),
    # indexing: index.py
    aten.embedding.default: OpSpec(idx.embedding, idx.supported_embedding),
    aten.index_select.default: OpSpec(idx.index_select, idx.supported_index_select),
    aten.gather.default: OpSpec(idx.gather, idx.supported_gather),
    aten.index.Tensor: OpSpec(idx.index, idx.supported_index),
    aten.cumsum.default: OpSpec(idx.cumsum, idx.supported_cumsum),
    aten.cummax.default: OpSpec(idx.cumextreme(False), idx.supported_cumextreme),
    aten.cummin.default: OpSpec(idx.cumextreme(True), idx.supported_cumextreme),
    # bags of embeddings, reduced (nn.EmbeddingBag): bags.py
    aten._embedding_bag.default: OpSpec(bags.embedding_bag, bags.supported),
    aten._embedding_bag_forward_only.default: OpSpec(bags.embedding_bag, bags.supported),
    # pairwise distances (torch.cdist): distance.py
    aten.cdist.default: OpSpec(dist.cdist, dist.supported),
    aten._cdist_forward.default: OpSpec(dist.cdist, dist.supported),
    # sorting and counting (a Mixture-of-Experts router's top-k, expert order and tokens per expert):
    # ranking.py, histogram.py
    aten.topk.default: OpSpec(ranking.topk, ranking.supported),
    aten.sort.default: OpSpec(ranking.sort, ranking.supported),
    aten.sort.stable: OpSpec(ranking.sort, ranking.supported),
    aten.histc.default: OpSpec(hist.histc, hist.supported),
    # scatter (KV-cache updates; functional, or in place when the node is marked td_inplace): scatter.py
    aten.index_put.default: OpSpec(sc.index_put, sc.supported_index_put),
    aten.index_copy.default: OpSpec(sc.index_copy, sc.supported_index_copy),
    aten.scatter.src: OpSpec(sc.scatter, sc.supported_scatter),
    aten.scatter.value: OpSpec(sc.scatter, sc.supported_scatter),
    aten.scatter_add.default: OpSpec(sc.scatter_add, sc.supported_scatter_add),
    aten.scatter.reduce: OpSpec(sc.refused, sc.refuse_reduce),
    aten.scatter.value_reduce: OpSpec(sc.refused, sc.refuse_reduce),
    aten.scatter_reduce.two: OpSpec(sc.refused, sc.refuse_reduce),
    aten.slice_scatter.default: OpSpec(sc.slice_scatter, sc.supported_copy_into),
    aten.select_scatter.default: OpSpec(sc.select_scatter, sc.supported_copy_into),
    aten.copy.default: OpSpec(sc.copy, sc.supported_copy_into),
    # matmul: matmul.py
    aten.mm.default: OpSpec(mm.mm, mm.supported),
    aten.addmm.default: OpSpec(mm.addmm, mm.supported),
    aten.bmm.default: OpSpec(mm.bmm, mm.supported),
    aten.baddbmm.default: OpSpec(mm.baddbmm, mm.supported),
    aten.linear.default: OpSpec(mm.linear, mm.supported_linear),
    # grouped matmul (Mixture-of-Experts layers; the 2-D input, 3-D weight and offs form): grouped_mm.py
    aten._grouped_mm.default: OpSpec(gmm.grouped_mm, gmm.supported),
    # convolution: conv.py (depthwise ones: depthwise.py)
    aten.convolution.default: OpSpec(dw.convolution, conv.supported),
    # pooling: pool.py (global average pooling exports to mean.dim: reduce.py below)
    aten.max_pool2d_with_indices.default: OpSpec(pool.max_pool2d_with_indices, pool.supported),
    aten.avg_pool2d.default: OpSpec(pool.avg_pool2d, pool.supported),
    aten._adaptive_avg_pool2d.default: OpSpec(pool.adaptive_avg_pool2d, pool.supported),
    aten.adaptive_max_pool2d.default: OpSpec(pool.adaptive_max_pool2d, pool.supported),
    aten.max_pool3d_with_indices.default: OpSpec(pool.max_pool3d_with_indices, pool.supported_3d),
    aten.avg_pool3d.default: OpSpec(pool.avg_pool3d, pool.supported_3d),  # nn.LocalResponseNorm's too
    aten._adaptive_avg_pool3d.default: OpSpec(pool.adaptive_avg_pool3d, pool.supported_3d),
    aten.adaptive_max_pool3d.default: OpSpec(pool.adaptive_max_pool3d, pool.supported_3d),
    # sampling at grid points (deformable attention, spatial transformers): grid_sample.py
    aten.grid_sampler_2d.default: OpSpec(gs.grid_sampler_2d, gs.supported),
    # resizing (F.interpolate, nn.Upsample: nearest, nearest-exact, (bi/tri)linear, bicubic): resize.py
    aten.upsample_nearest1d.vec: OpSpec(resize.resize, resize.supported),
    aten.upsample_nearest1d.default: OpSpec(resize.resize, resize.supported),
    aten.upsample_nearest2d.vec: OpSpec(resize.resize, resize.supported),
    aten.upsample_nearest2d.default: OpSpec(resize.resize, resize.supported),
    aten.upsample_nearest3d.vec: OpSpec(resize.resize, resize.supported),
    aten.upsample_nearest3d.default: OpSpec(resize.resize, resize.supported),
    aten._upsample_nearest_exact1d.vec: OpSpec(resize.resize, resize.supported),
    aten._upsample_nearest_exact1d.default: OpSpec(resize.resize, resize.supported),
    aten._upsample_nearest_exact2d.vec: OpSpec(resize.resize, resize.supported),
    aten._upsample_nearest_exact2d.default: OpSpec(resize.resize, resize.supported),
    aten._upsample_nearest_exact3d.vec: OpSpec(resize.resize, resize.supported),
    aten._upsample_nearest_exact3d.default: OpSpec(resize.resize, resize.supported),
    aten.upsample_linear1d.vec: OpSpec(resize.resize, resize.supported),
    aten.upsample_linear1d.default: OpSpec(resize.resize, resize.supported),
    aten.upsample_bilinear2d.vec: OpSpec(resize.resize, resize.supported),
    aten.upsample_bilinear2d.default: OpSpec(resize.resize, resize.supported),
    aten.upsample_trilinear3d.vec: OpSpec(resize.resize, resize.supported),
    aten.upsample_trilinear3d.default: OpSpec(resize.resize, resize.supported),
    aten.upsample_bicubic2d.vec: OpSpec(resize.resize, resize.supported),
    aten.upsample_bicubic2d.default: OpSpec(resize.resize, resize.supported),
    # batch norm (eval): batchnorm.py
    aten._native_batch_norm_legit_no_training.default: OpSpec(bn.batch_norm_no_training, bn.supported),
    # batch norm with the batch's statistics (instance norm; training mode): batch_stats.py
    aten._native_batch_norm_legit.no_stats: OpSpec(bs.batch_norm_batch_stats, bs.supported),
    aten._native_batch_norm_legit.default: OpSpec(bs.batch_norm_batch_stats, bs.supported),
    aten._native_batch_norm_legit_functional.default: OpSpec(bs.batch_norm_batch_stats, bs.supported),
    # attention: attention.py
    aten.scaled_dot_product_attention.default: OpSpec(attn.sdpa, attn.supported),
    td_ops.sdpa_positions: OpSpec(attn.sdpa_positions, attn.supported_positions),  # attention.py
    td_ops.sdpa_sinks: OpSpec(attn.sdpa_sinks, attn.supported_sinks),  # attention.py
    td_ops.sdpa_softcap: OpSpec(attn.sdpa_softcap, attn.supported_softcap),  # attention.py
    # softmax: softmax.py
    aten._softmax.default: OpSpec(sm.softmax(log=False), sm.supported),
    aten._log_softmax.default: OpSpec(sm.softmax(log=True), sm.supported),
    aten.softmax.int: OpSpec(sm.softmax(log=False), sm.supported),
    aten.log_softmax.int: OpSpec(sm.softmax(log=True), sm.supported),
    # normalization: norm.py
    aten.layer_norm.default: OpSpec(norm.layer_norm, norm.supported),
    aten.native_layer_norm.default: OpSpec(norm.native_layer_norm, norm.supported),
    aten.native_group_norm.default: OpSpec(gn.native_group_norm, gn.supported),  # group_norm.py
    aten.rms_norm.default: OpSpec(norm.rms_norm, norm.supported),
    # reductions: reduce.py (mean.dim over any dims, global average pooling included)
    aten.sum.dim_IntList: OpSpec(red.sum_, red.supported_sum),
    aten.sum.default: OpSpec(red.sum_, red.supported_sum),
    aten.mean.dim: OpSpec(red.mean, red.supported_sum),
    aten.mean.default: OpSpec(red.mean, red.supported_sum),
    aten.prod.dim_int: OpSpec(red.prod, red.supported_sum),
    aten.prod.default: OpSpec(red.prod, red.supported_sum),
    aten.amax.default: OpSpec(red.extreme("max"), red.supported_extreme),
    aten.amin.default: OpSpec(red.extreme("min"), red.supported_extreme),
    aten.max.default: OpSpec(red.extreme("max"), red.supported_extreme),
    aten.min.default: OpSpec(red.extreme("min"), red.supported_extreme),
    aten.any.default: OpSpec(red.logical("sum"), red.supported_logical),
    aten.any.dim: OpSpec(red.logical("sum"), red.supported_logical),
    aten.any.dims: OpSpec(red.logical("sum"), red.supported_logical),
    aten.all.default: OpSpec(red.logical("prod"), red.supported_logical),
    aten.all.dim: OpSpec(red.logical("prod"), red.supported_logical),
    aten.all.dims: OpSpec(red.logical("prod"), red.supported_logical),
    aten.max.dim: OpSpec(red.extreme_dim("argmax"), red.supported_extreme),
    aten.min.dim: OpSpec(red.extreme_dim("argmin"), red.supported_extreme),
    aten.argmax.default: OpSpec(red.arg_extreme("argmax"), red.supported_extreme),
    aten.argmin.default: OpSpec(red.arg_extreme("argmin"), red.supported_extreme),
    aten.var.correction: OpSpec(red.var, red.supported_float),
    aten.var_mean.correction: OpSpec(red.var_mean, red.supported_float),
    aten.linalg_vector_norm.default: OpSpec(red.vector_norm, red.supported_norm),
    # tritondelegate:: ops (ops.py), put in place of written-out patterns by passes/fuse.py
    td_ops.rotary: OpSpec(rot.rotary, rot.supported),  # rotary.py
    td_ops.rotary_pair: OpSpec(rot.rotary_pair, rot.supported_pair),  # rotary.py
    td_ops.rotary_angles: OpSpec(rot.rotary_angles, rot.supported_angles),  # rotary.py
    td_ops.rotary_pair_angles: OpSpec(rot.rotary_pair_angles, rot.supported_pair_angles),  # rotary.py
    td_ops.glu_linear: OpSpec(mm.glu_linear, mm.supported_glu),  # matmul.py
    td_ops.glu_grouped_mm: OpSpec(gmm.glu_grouped_mm, gmm.supported_glu),  # grouped_mm.py
    td_ops.gathered_grouped_mm: OpSpec(gmm.gathered_grouped_mm, gmm.supported_gathered),  # grouped_mm.py
    td_ops.scattered_grouped_mm: OpSpec(gmm.scattered_grouped_mm, gmm.supported_scattered),  # grouped_mm.py
    td_ops.cumulative_histc: OpSpec(hist.cumulative_histc, hist.supported_cumulative),  # histogram.py
    td_ops.router_topk: OpSpec(router.router_topk, router.supported),  # router.py
    td_ops.group_router: OpSpec(router.group_router, router.supported_group),  # router.py
    td_ops.rope_linear: OpSpec(mm.rope_linear, mm.supported_rope),  # matmul.py
    td_ops.dequant_weight: OpSpec(mm.dequant_weight, qr.supported_dequant),  # matmul.py (no launch), quant_readers.py
    td_ops.sort_offsets: OpSpec(so.sort_offsets, so.supported),  # sort_offsets.py
}

# Ops of other libraries, by qualified overload name: present in a graph only where the library that
# registers them is loaded, and never imported from here. grouped_mm.py:
EXTERNAL_OPS: dict[str, OpSpec] = {
    "transformers::grouped_mm_fallback.default": OpSpec(gmm.grouped_mm, gmm.supported),
}


def external_name(target) -> str:
    """``namespace::name.overload`` of an operator overload; "" for anything else."""
    if not isinstance(target, torch._ops.OpOverload):
        return ""
    return f"{target.namespace}::{target._opname}.{target._overloadname}"


def lookup(target) -> OpSpec | None:
    spec = OPS.get(target)
    if spec is None and target is not None:
        spec = EXTERNAL_OPS.get(external_name(target))
    return spec
