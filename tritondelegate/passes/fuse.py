"""Graph rewrites that hand the kernels bigger pieces of work, run on the decomposed graph before
constant folding and partitioning:

* ``dedupe``: identity copies and repeated computations are removed first (``dedupe.py``);
* ``fuse_rms_norm``: an RMSNorm written out (``pow``/``mean``/``rsqrt``/``mul``, as Llama, Qwen2,
  Mistral and Gemma write it) becomes one ``aten.rms_norm`` (one row kernel instead of three launches);
* ``centered_norm``: an RMSNorm of ``x - mean(x)`` (Cohere's LayerNorm without bias, written out)
  becomes one ``aten.layer_norm``;
* ``norm_casts``: a norm computed in fp32 on an fp16/bf16 row and cast straight back (OLMo, Cohere,
  T5 in low precision) becomes that norm of the row (the kernel computes in fp32 anyway);
* ``fuse_gelu``: a tanh GELU written out (GPT-2's ``0.5 * x * (1 + tanh(...))``) becomes one
  ``aten.gelu(approximate="tanh")``, which runs in the epilogue of the matmul before it;
* ``fuse_activations``: swish, CLIP's quick GELU, the erf GELU and hardswish written out as x times a
  function of x, and softsign and tanhshrink (torch writes them out), become one pointwise op each,
  which runs in the epilogue of the matmul before it;
* ``fuse_rotary``: a rotary embedding written out (``x * cos + rotate_half(x) * sin``) becomes one
  ``tritondelegate::rotary`` op (one launch instead of four per tensor), and two that share their cos
  and sin tables (q and k) one ``tritondelegate::rotary_pair`` (one launch for both);
* ``halves_rotary``: a rotary written over the two halves of x (GPT-OSS's ``cat((x1 * c - x2 * s,
  x2 * c + x1 * s), -1)``) becomes ``tritondelegate::rotary`` with whole-width tables, or
  ``rotary_angles`` when the half tables come from angles, before the rotary passes pair and fuse it;
  over x's even and odd columns (DeepSeek-V3's ``x[..., 0::2]``, ``x[..., 1::2]``) the same with
  ``deinterleave=True`` (the kernel reads the pairs in place and stores the halves);
* ``complex_rotary``: a rotary written with complex numbers (``view_as_real(view_as_complex(x) *
  polar(1, a))``: Llama 4, DeepSeek-V2) becomes ``tritondelegate::rotary_angles`` of interleaved
  pairs, before the rotary passes pair and fuse it like any other;
* ``eager_attention``: attention written out (``softmax(q @ k^T * scale + mask) @ v``, transformers'
  eager attention, ``repeat_kv`` included) becomes one ``aten.scaled_dot_product_attention``, and
  GPT-OSS's with attention sinks one ``tritondelegate::sdpa_sinks``, Gemma 2's soft-capped scores one
  ``tritondelegate::sdpa_softcap`` (one launch instead of six to eight per layer), several terms added
  to the scores (position bias, ALiBi, masks) one float mask shared by the layers that add the same
  terms (``score_mask.py``), before ``position_mask`` looks at its mask;
* ``position_mask``: an attention mask built per call from positions (``arange(S) <= positions``, a
  KV-cache decoder's, and ``arange(S) > positions - window`` too, a sliding-window layer's) of an sdpa,
  ``sdpa_softcap`` or ``sdpa_sinks`` becomes ``tritondelegate::sdpa_positions``, whose kernel compares indices;
* ``quantize_weights`` (``passes/quant_weights.py``): a weight-only quantized weight, computed per
  call from int8/uint8 integers and their scales (and zero points), becomes a constant the weight
  passes below can rearrange, and stays quantized: its linears dequantize it tile by tile;
* ``fuse_glu``: a gated MLP's ``act(linear(x, Wg)) * linear(x, Wu)`` becomes one
  ``tritondelegate::glu_linear`` over the two weights interleaved (one GEMM, the gating in its epilogue);
* ``fuse_grouped_glu``: a Mixture-of-Experts layer's grouped gate/up GEMM split in halves and gated
  becomes one ``tritondelegate::glu_grouped_mm`` over the experts' weights interleaved;
* ``expert_dispatch``: a Mixture-of-Experts layer's bookkeeping around its grouped GEMMs in fewer
  launches: the gathered token rows read in the GEMM's loads, the stable sort of the chosen expert ids
  and the offsets per expert (cast, histc, cumsum) one ``tritondelegate::sort_offsets``, the rows
  stored back in token order by the down GEMM (no unsort), per-expert biases read per row;
* ``fuse_router``: a router's softmax, top-k and renormalization (or top-k, then softmax) become one
  ``tritondelegate::router_topk`` (one program per row of logits);
* ``fuse_projections``: linears that read the same input (Q/K/V; gate/up) become one linear over
  their weights concatenated (folded into one constant by ``lower()``), and views of its result;
* ``fuse_rope_linear``: a rotary embedding whose query and key are views of one projection (after
  ``fuse_projections``) moves into that projection's epilogue: one ``tritondelegate::rope_linear``
  over the weight's rows permuted into rotation pairs (permuted once by ``lower()``);
* ``rope_positions``: a rope_linear whose angles are positions times inverse frequencies (a decoder's
  step) reads those and multiplies them in its epilogue: the angles' launch is gone;
* ``cat_slices``: a cat of adjacent slices of one tensor becomes the slice they tile, a view (a
  partial rotary's ``cat((q_rot, q_pass))`` once ``fuse_rope_linear`` rotated q in place);
* ``head_norm``: per-head norms (Qwen3's q_norm and k_norm) that the epilogue did not take run in
  the rotary launch that reads them;
* ``fuse_batchnorm``: an eval batch norm after a convolution is folded into its weight and bias
  (computed once by ``lower()``); ``affine_batchnorms``: every other one with constant operands
  becomes a scale and a shift per channel (two pointwise steps that fuse with their neighbours).

Each returns a description of every rewrite it made (``summary()`` lists them).
"""

from __future__ import annotations

import torch

from .cat_slices import cat_slices
from .centered_norm import centered_norm
from .complex_rotary import complex_rotary
from .dedupe import dedupe
from .eager_attention import eager_attention
from .expert_dispatch import expert_dispatch
from .fold_constants import quantize_weights
from .fuse_batchnorm import affine_batchnorms, fuse_batchnorm
from .fuse_activations import fuse_activations
from .fuse_gelu import fuse_gelu
from .fuse_glu import fuse_glu
from .fuse_grouped_glu import fuse_grouped_glu
from .fuse_projections import fuse_projections
from .fuse_router import fuse_router
from .fuse_rope_linear import fuse_rope_linear
from .head_norm import head_norm
from .fuse_rms_norm import fuse_rms_norm
from .fuse_rotary import fuse_rotary
from .halves_rotary import halves_rotary
from .norm_casts import norm_casts
from .position_mask import position_mask
from .rope_positions import rope_positions


def fuse_patterns(ep: torch.export.ExportedProgram, state: set[str], fold: bool) -> list[str]:
    """All the rewrites, in order; ``fold``: constant folding will run (projections need it to store
    their concatenated weights once)."""
    done = (dedupe(ep) + fuse_rms_norm(ep) + centered_norm(ep) + norm_casts(ep) + fuse_gelu(ep)
            + fuse_activations(ep) + complex_rotary(ep) + halves_rotary(ep, fold) + fuse_rotary(ep, fold)
            + eager_attention(ep) + position_mask(ep))
    if fold:  # these store new constants (concatenated or folded weights): folding computes them once
        done += (quantize_weights(ep, state) + fuse_glu(ep, state) + fuse_grouped_glu(ep, state) + fuse_projections(ep, state)
                 + fuse_rope_linear(ep, state) + rope_positions(ep) + fuse_batchnorm(ep, state)
                 + affine_batchnorms(ep, state))
    done += expert_dispatch(ep) + fuse_router(ep) + cat_slices(ep) + head_norm(ep)
    if done:
        ep.graph_module.recompile()
    return done
