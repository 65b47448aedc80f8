"""The runtime's table: kernel name -> Triton kernel. Launch plans name kernels by these keys; the
runtime imports this and nothing of the lowering side (``registry.py`` is the lowering side's table of
ATen ops). Each kernel's footprint rule (``runtime/footprints.py``) and traffic row
(``kernels/traffic.py``) are checked against this table by the tests.
"""

from __future__ import annotations

from . import attention, batchnorm, conv, creation, elementwise, index, layout, matmul, norm, pad, pool, reduce, rotary
from . import bags, depthwise, distance, grid_sample, grouped_mm, histogram, ranking, resize, router, scatter, softmax
from . import dequant_rows, fuse_conv1x1, group_norm, sort_offsets

KERNELS: dict[str, object] = {
    "pointwise": elementwise.pointwise_kernel,
    "pointwise_chain": elementwise.pointwise_chain_kernel,
    "cat": layout.cat_kernel,
    "arange": creation.arange_kernel,
    "pad": pad.pad_kernel,
    "gather": index.gather_kernel,
    "dequant_rows": dequant_rows.dequant_rows_kernel,
    "cumsum": index.cumsum_kernel,
    "cumextreme": index.cumextreme_kernel,
    "cdist": distance.cdist_kernel,
    "embedding_bag": bags.embedding_bag_kernel,
    "rank": ranking.rank_kernel,
    "histc": histogram.histc_kernel,
    "sort_offsets": sort_offsets.sort_offsets_kernel,
    "router": router.router_kernel,
    "group_router": router.group_router_kernel,
    "scatter": scatter.scatter_kernel,
    "matmul": matmul.matmul_kernel,
    "grouped_mm": grouped_mm.grouped_mm_kernel,
    "conv2d": conv.conv2d_kernel,
    "depthwise_conv": depthwise.depthwise_conv_kernel,
    "conv1x1": fuse_conv1x1.conv1x1_kernel,
    "pool2d": pool.pool2d_kernel,
    "grid_sample": grid_sample.grid_sample_kernel,
    "resize": resize.resize_kernel,
    "batch_norm": batchnorm.batch_norm_kernel,
    "attention": attention.attention_kernel,
    "attention_append": attention.attention_append_kernel,
    "attention_combine": attention.attention_combine_kernel,
    "softmax": softmax.softmax_kernel,
    "norm": norm.norm_kernel,
    "norm_apply": group_norm.norm_apply_kernel,
    "reduce": reduce.reduce_kernel,
    "rotary": rotary.rotary_kernel,
}
