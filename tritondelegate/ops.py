"""Custom ops of tritondelegate: bigger pieces of work that graph rewrites (``passes/fuse.py``) put in
place of a written-out pattern, so one kernel runs them.

    tritondelegate::rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor
        x * cos + rotate_half(x) * sin,   rotate_half(x) = cat((-x[..., h:], x[..., :h]), dim=-1), h = D / 2

    tritondelegate::rotary_pair(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)
        (rotary(q, cos, sin), rotary(k, cos, sin)): a layer's query and key rotated in one launch

    tritondelegate::rotary_angles(Tensor x, Tensor angles, float scale, ScalarType dtype) -> Tensor
    tritondelegate::rotary_pair_angles(Tensor q, Tensor k, Tensor angles, float scale, ScalarType dtype)
        -> (Tensor, Tensor)
        the same with the tables computed from the half-width angles ``a`` [..., D / 2] (positions times
        inverse frequencies): ``cos = (cos(cat(a, a, -1)) * scale).to(dtype)``, ``sin`` likewise, as a
        model computes them per call from its input positions; the kernel computes them inline
        (each of the four takes optional per-head norms last: ``norm`` (``q_norm``, ``k_norm``) and
        ``norm_eps``: x first becomes ``rms_norm(x, [D], norm, norm_eps)``, Qwen3's q_norm and k_norm,
        run in the same launch: ``passes/head_norm.py``; each takes ``interleaved=True`` last: ``rotate_every_two(x) = stack((-x[..., 1::2], x[..., 0::2]), -1)
        .flatten(-2)`` in place of rotate_half, GPT-J's, CodeGen's and Cohere's pairs (2i, 2i + 1), with
        tables over the whole last dim as those models repeat_interleave them, or angles
        ``repeat_interleave(a, 2, -1)`` in place of ``cat(a, a, -1)``; and ``out_dtype``: the result
        cast to it, as OLMo and Cohere cast their fp32 rotary results back to the model's dtype; the
        kernel computes in fp32 and rounds once, to the result's dtype; and ``deinterleave=True``: x's
        pairs (2i, 2i + 1) read as rotate_half's (i, i + D / 2), ``x = cat((x[..., 0::2], x[..., 1::2]),
        -1)`` first, with rotate_half's tables (DeepSeek-V3's interleaved rotary; no per-head norm))

    tritondelegate::sdpa_positions(Tensor q, Tensor k, Tensor v, Tensor positions, float? scale,
                                   bool enable_gqa, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor
        scaled_dot_product_attention(q, k, v, attn_mask=arange(Lk) <= positions): each query attends
        to the keys at or before its position (``positions`` int, broadcasting to [..., Lq, 1]), the
        mask a KV-cache decoder builds per call; the kernel compares indices instead of reading a mask.
        ``window`` > 0 keeps only the last ``window`` of them too, ``arange(Lk) > positions - window``
        (a sliding-window layer's mask); ``softcap`` > 0 soft-caps the scores as ``sdpa_softcap``,
        ``sinks`` adds a sink logit per head as ``sdpa_sinks`` (not both)

    tritondelegate::sdpa_sinks(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor sinks, float? scale,
                               bool enable_gqa) -> Tensor
        attention with a sink logit per query head (GPT-OSS): ``sinks`` [Hq] joins each row's softmax
        as one more column but adds no value, ``softmax(cat([scores, sinks], -1))[..., :-1] @ v`` with
        scores = q @ k^T * scale + mask (bool: False drops the key), as GPT-OSS's eager attention
        writes it (``passes/eager_attention.py``); one attention launch (``kernels/attention.py``)

    tritondelegate::glu_linear(Tensor x, Tensor weight, Tensor? bias, str act) -> Tensor
        y = linear(x, weight, bias);  act(y[..., 0::2]) * y[..., 1::2]
        (a gated MLP's gate and up projections as one GEMM: their weight rows interleaved, gate first;
        act one of GLU_ACTS: SwiGLU is "silu", GeGLU "gelu" or "gelu_tanh", ReGLU "relu")
    tritondelegate::glu_grouped_mm(Tensor x, Tensor weight, Tensor offs, str act) -> Tensor
        y = grouped_mm(x [S, K], weight [E, K, 2N], offs [E]);  act(y[:, 0::2]) * y[:, 1::2]
        (a Mixture-of-Experts layer's gate_up experts and their gating in one grouped GEMM: each
        expert's gate and up columns interleaved, gate first; rows of expert e are offs[e-1] <= r <
        offs[e], rows past offs[E-1] give act(0) * 0 = 0; with ``rows``: x's rows gathered first,
        x[floor_divide(rows, rows_divisor)], as transformers gathers ``hidden[perm // k]``; with ``bias``
        [E, 2N]: each row's expert's bias added before the gating, GPT-OSS's ``bias[sorted ids]``; act
        also ``clamped_swiglu`` with ``alpha`` and ``limit``, GPT-OSS's gating: ``glu_halves``)
    tritondelegate::gathered_grouped_mm(Tensor x, Tensor rows, int rows_divisor, Tensor weight, Tensor offs,
                                        Tensor? bias=None) -> Tensor
        grouped_mm(x[floor_divide(rows, rows_divisor)], weight, offs): the experts' inputs read through
        the token order, never gathered into a tensor of their own (``passes/expert_dispatch.py``); each
        of these grouped ops takes ``bias`` [E, N] last: row r adds its expert's row
    tritondelegate::scattered_grouped_mm(Tensor x, Tensor weight, Tensor offs, Tensor dest, Tensor? rows=None,
                                         int rows_divisor=1, Tensor? bias=None) -> Tensor
        y = grouped_mm(x[floor_divide(rows, rows_divisor)], weight, offs) with row r stored at row
        dest[r] (negative: from the end): ``index_put(empty, [dest], y)``, the experts' rows put back in
        token order by the GEMM's stores (``passes/expert_dispatch.py``; dest a permutation, a sort's
        indices, so every row is written; the reference leaves rows no dest names 0)
    tritondelegate::cumulative_histc(Tensor x, int bins, float min, float max, ScalarType? cast,
                                     ScalarType dtype) -> Tensor
        cumsum(histc(x.to(cast), bins, min, max), 0, dtype=dtype): a router's offsets per expert from
        its sorted expert ids in one launch (``cast`` None: x as it is)
    tritondelegate::sort_offsets(Tensor x, bool descending, int bins, float min, float max, ScalarType? cast,
                                 ScalarType dtype) -> (Tensor, Tensor, Tensor)
        (values, indices, offsets): values, indices = sort(x, stable=True, descending=descending) of a 1-D x
        and offsets = cumulative_histc(values, bins, min, max, cast, dtype), a Mixture-of-Experts
        dispatch's order of its chosen expert ids and offsets per expert in one launch
        (``passes/expert_dispatch.py``, ``kernels/sort_offsets.py``)
    tritondelegate::router_topk(Tensor x, int k, bool softmax_first, bool renormalize, ScalarType? dtype,
                                ScalarType? out_dtype) -> (Tensor, Tensor)
        a Mixture-of-Experts router's choice along the last dim, (values, indices):
        softmax_first: topk(softmax(x, -1, dtype=dtype), k), the values divided by their sum when
        renormalize; else topk(x, k) with softmax(values, -1, dtype=dtype); values cast to out_dtype
        (``passes/fuse_router.py``; one launch, ``kernels/router.py``)
    tritondelegate::group_router(Tensor scores, Tensor bias, int n_group, int topk_group, int k,
                                 bool renormalize, float eps, float scale) -> (Tensor, Tensor)
        DeepSeek-V3's group-limited choice over scores [T, E] (a sigmoid's): c = scores + bias; each
        of n_group groups scores the sum of its two largest c; c outside the topk_group best groups
        is -inf; indices = topk(c, k); weights = scores at indices, divided by (their sum + eps) when
        renormalize, times scale (``passes/fuse_router.py``; one launch, ``kernels/router.py``)
    tritondelegate::rope_linear(Tensor x, Tensor weight, Tensor? bias, Tensor pairs, Tensor cos, Tensor? sin,
                                int[] cos_dims, float scale, ScalarType? dtype, Tensor? norm_weight=None,
                                int norm_dim=0, float norm_eps=0.0) -> Tensor
        a projection whose query and key columns come out rotated (the rotary embedding in the GEMM's
        epilogue): y = linear(x, weight, bias) has its output columns in pairs, pair p = (y[..., 2p],
        y[..., 2p + 1]) stored at columns (pairs[p, 0], pairs[p, 1]) of the result, rotated when
        pairs[p, 2] >= 0 (its table indices along the last dim of cos / sin: pairs[p, 2] and pairs[p, 3]);
        ``sin`` None: cos holds half-width angles and the tables are (cos(a) * scale, sin(a) * scale)
        rounded to ``dtype``; cos of an integer dtype: it holds positions and ``sin`` inverse frequencies
        (floats), each indexed as the angles would be, whose fp32 product is the angle
        (``passes/rope_positions.py``), its tables as with angles; ``cos_dims``: the table dims that the
        rows' outer and inner leading indices (the result's rows, [outer, inner] with inner = its
        second-to-last dim) select, -1 where the tables broadcast; ``norm_weight`` (Qwen3's q_norm and
        k_norm): the first norm_weight.numel() / 2 pairs are heads of ``norm_dim`` columns (norm_dim / 2
        pairs each), each RMS-normalized over its head before the rotation, as ``rms_norm(head, [norm_dim],
        w, norm_eps)`` with w[c] = norm_weight[2p] for a pair's first column, norm_weight[2p + 1] for its
        second

Each op has a reference implementation in plain PyTorch (any device; it computes what the pattern it
replaces computes, in the same dtype order, so a host fallback matches eager exactly) and a fake
implementation (FakeTensors, symbolic shapes). The kernel registry imports this module, so the
lowering side and the runtime both have the ops registered; the runtime runs a host instruction of
this namespace only when its op is listed in ``OPS``.
"""

from __future__ import annotations

import torch

NAMESPACE = "tritondelegate"

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")

_lib.define("rotary(Tensor x, Tensor cos, Tensor sin, Tensor? norm=None, float norm_eps=0.0, "
            "bool interleaved=False, ScalarType? out_dtype=None, bool deinterleave=False) -> Tensor")
_lib.define("rotary_pair(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? q_norm=None, Tensor? k_norm=None, "
            "float norm_eps=0.0, bool interleaved=False, ScalarType? out_dtype=None, bool deinterleave=False) "
            "-> (Tensor, Tensor)")
_lib.define("rotary_angles(Tensor x, Tensor angles, float scale, ScalarType dtype, Tensor? norm=None, "
            "float norm_eps=0.0, bool interleaved=False, ScalarType? out_dtype=None, bool deinterleave=False) "
            "-> Tensor")
_lib.define("rotary_pair_angles(Tensor q, Tensor k, Tensor angles, float scale, ScalarType dtype, "
            "Tensor? q_norm=None, Tensor? k_norm=None, float norm_eps=0.0, bool interleaved=False, "
            "ScalarType? out_dtype=None, bool deinterleave=False) -> (Tensor, Tensor)")
_lib.define("sdpa_positions(Tensor q, Tensor k, Tensor v, Tensor positions, float? scale, bool enable_gqa, "
            "int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor")
_lib.define("sdpa_sinks(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor sinks, float? scale, "
            "bool enable_gqa) -> Tensor")
_lib.define("glu_linear(Tensor x, Tensor weight, Tensor? bias, str act) -> Tensor")
_lib.define("glu_grouped_mm(Tensor x, Tensor weight, Tensor offs, str act, Tensor? rows=None, "
            "int rows_divisor=1, Tensor? bias=None, float alpha=1.0, float limit=0.0) -> Tensor")
_lib.define("gathered_grouped_mm(Tensor x, Tensor rows, int rows_divisor, Tensor weight, Tensor offs, "
            "Tensor? bias=None) -> Tensor")
_lib.define("scattered_grouped_mm(Tensor x, Tensor weight, Tensor offs, Tensor dest, Tensor? rows=None, "
            "int rows_divisor=1, Tensor? bias=None) -> Tensor")
_lib.define("router_topk(Tensor x, int k, bool softmax_first, bool renormalize, ScalarType? dtype, "
            "ScalarType? out_dtype) -> (Tensor, Tensor)")
_lib.define("group_router(Tensor scores, Tensor bias, int n_group, int topk_group, int k, bool renormalize, "
            "float eps, float scale) -> (Tensor, Tensor)")
_lib.define("cumulative_histc(Tensor x, int bins, float min, float max, ScalarType? cast, ScalarType dtype) "
            "-> Tensor")
_lib.define("sort_offsets(Tensor x, bool descending, int bins, float min, float max, ScalarType? cast, "
            "ScalarType dtype) -> (Tensor, Tensor, Tensor)")
_lib.define("rope_linear(Tensor x, Tensor weight, Tensor? bias, Tensor pairs, Tensor cos, Tensor? sin, "
            "int[] cos_dims, float scale, ScalarType? dtype, Tensor? norm_weight=None, int norm_dim=0, "
            "float norm_eps=0.0) -> Tensor")

# The activations of a gated linear unit, by the name the pointwise kernels give them.
GLU_ACTS = {
    "silu": torch.nn.functional.silu,
    "relu": torch.nn.functional.relu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
}
# GPT-OSS's experts gate with clamps and a scaled sigmoid (``glu_halves``); the grouped GEMM takes it too.
CLAMPED_SWIGLU = "clamped_swiglu"
GROUPED_GLU_ACTS = (*GLU_ACTS, CLAMPED_SWIGLU)


def glu_halves(act: str, g: torch.Tensor, u: torch.Tensor, alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    """A gated linear unit of gate ``g`` and up ``u``: ``act(g) * u``, or for ``clamped_swiglu`` (GPT-OSS)
    ``(clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, limit)``."""
    if act == CLAMPED_SWIGLU:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))
    return GLU_ACTS[act](g) * u


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     deinterleave: bool = False) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``interleaved``: ``rotate_every_two``) exactly as a model
    writes it (the same ops, the same order, the same type promotion). ``deinterleave``: x's pairs
    (2i, 2i + 1) moved to (i, i + D / 2) first (``a - b`` is ``a + (-b)`` exactly: DeepSeek-V3's
    ``cat((x1 * c - x2 * s, x2 * c + x1 * s))`` of ``x1, x2 = x[..., 0::2], x[..., 1::2]``)."""
    if deinterleave:
        if interleaved:
            raise ValueError("tritondelegate::rotary: interleaved and deinterleave exclude each other")
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return x * cos + (rotate_every_two(x) if interleaved else rotate_half(x)) * sin


def head_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """``x`` RMS-normalized over its last dim (each head) by ``weight``; ``x`` itself without one: the
    per-head norm (Qwen3's q_norm, k_norm) a rotary op applies first (``passes/head_norm.py``)."""
    return x if weight is None else torch.rms_norm(x, [x.shape[-1]], weight, eps)


def _cast(t: torch.Tensor, out_dtype) -> torch.Tensor:
    return t if out_dtype is None else t.to(out_dtype)


@torch.library.impl(_lib, "rotary", "CompositeExplicitAutograd")
def _rotary(x, cos, sin, norm=None, norm_eps=0.0, interleaved=False, out_dtype=None, deinterleave=False):
    if x.shape[-1] % 2:
        raise ValueError(f"tritondelegate::rotary: the last dim of x ({x.shape[-1]}) is not even")
    return _cast(rotary_reference(head_norm(x, norm, norm_eps), cos, sin, interleaved, deinterleave), out_dtype)


@torch.library.register_fake(f"{NAMESPACE}::rotary")
def _rotary_fake(x, cos, sin, norm=None, norm_eps=0.0, interleaved=False, out_dtype=None, deinterleave=False):
    # The formula itself on fake tensors: the result's shape, dtype and strides are the pattern's.
    return _cast(rotary_reference(head_norm(x, norm, norm_eps), cos, sin, interleaved, deinterleave), out_dtype)


@torch.library.impl(_lib, "rotary_pair", "CompositeExplicitAutograd")
def _rotary_pair(q, k, cos, sin, q_norm=None, k_norm=None, norm_eps=0.0, interleaved=False, out_dtype=None,
                 deinterleave=False):
    return (_rotary(q, cos, sin, q_norm, norm_eps, interleaved, out_dtype, deinterleave),
            _rotary(k, cos, sin, k_norm, norm_eps, interleaved, out_dtype, deinterleave))


@torch.library.register_fake(f"{NAMESPACE}::rotary_pair")
def _rotary_pair_fake(q, k, cos, sin, q_norm=None, k_norm=None, norm_eps=0.0, interleaved=False, out_dtype=None,
                      deinterleave=False):
    return (_rotary_fake(q, cos, sin, q_norm, norm_eps, interleaved, out_dtype, deinterleave),
            _rotary_fake(k, cos, sin, k_norm, norm_eps, interleaved, out_dtype, deinterleave))


def rotary_tables(angles: torch.Tensor, scale: float, dtype: torch.dtype,
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) as a model computes them from its half-width angles: ``emb = cat(angles, angles)``
    (``interleaved``: ``repeat_interleave(angles, 2, -1)``, each angle for a pair (2i, 2i + 1)), then
    ``(emb.cos() * scale).to(dtype)`` and ``(emb.sin() * scale).to(dtype)``."""
    emb = torch.repeat_interleave(angles, 2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


@torch.library.impl(_lib, "rotary_angles", "CompositeExplicitAutograd")
def _rotary_angles(x, angles, scale, dtype, norm=None, norm_eps=0.0, interleaved=False, out_dtype=None,
                   deinterleave=False):
    return _rotary(x, *rotary_tables(angles, scale, dtype, interleaved), norm, norm_eps, interleaved, out_dtype,
                   deinterleave)


@torch.library.register_fake(f"{NAMESPACE}::rotary_angles")
def _rotary_angles_fake(x, angles, scale, dtype, norm=None, norm_eps=0.0, interleaved=False, out_dtype=None,
                        deinterleave=False):
    return _rotary_fake(x, *rotary_tables(angles, scale, dtype, interleaved), norm, norm_eps, interleaved, out_dtype,
                        deinterleave)


@torch.library.impl(_lib, "rotary_pair_angles", "CompositeExplicitAutograd")
def _rotary_pair_angles(q, k, angles, scale, dtype, q_norm=None, k_norm=None, norm_eps=0.0, interleaved=False,
                        out_dtype=None, deinterleave=False):
    return (_rotary_angles(q, angles, scale, dtype, q_norm, norm_eps, interleaved, out_dtype, deinterleave),
            _rotary_angles(k, angles, scale, dtype, k_norm, norm_eps, interleaved, out_dtype, deinterleave))


@torch.library.register_fake(f"{NAMESPACE}::rotary_pair_angles")
def _rotary_pair_angles_fake(q, k, angles, scale, dtype, q_norm=None, k_norm=None, norm_eps=0.0, interleaved=False,
                             out_dtype=None, deinterleave=False):
    return (_rotary_angles_fake(q, angles, scale, dtype, q_norm, norm_eps, interleaved, out_dtype, deinterleave),
            _rotary_angles_fake(k, angles, scale, dtype, k_norm, norm_eps, interleaved, out_dtype, deinterleave))


def positions_mask(positions: torch.Tensor, length: int, window: int = 0) -> torch.Tensor:
    """``arange(length) <= positions``: True where a key (last dim) is at or before the query's position;
    with ``window`` > 0 also after ``positions - window`` (the last ``window`` keys up to it)."""
    index = torch.arange(length, device=positions.device)
    mask = index <= positions
    return mask & (index > positions - window) if window > 0 else mask


@torch.library.impl(_lib, "sdpa_positions", "CompositeExplicitAutograd")
def _sdpa_positions(q, k, v, positions, scale, enable_gqa, window=0, softcap=0.0, sinks=None):
    mask = positions_mask(positions, k.shape[-2], window)
    if sinks is not None and softcap:
        raise ValueError("tritondelegate::sdpa_positions takes sinks or a softcap, not both")
    if sinks is not None:
        return sdpa_sinks_reference(q, k, v, mask, sinks, scale, enable_gqa)
    if softcap:
        return sdpa_softcap_reference(q, k, v, mask, softcap, scale, enable_gqa)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                            enable_gqa=enable_gqa)


@torch.library.register_fake(f"{NAMESPACE}::sdpa_positions")
def _sdpa_positions_fake(q, k, v, positions, scale, enable_gqa, window=0, softcap=0.0, sinks=None):
    return _sdpa_positions(q, k, v, positions, scale, enable_gqa, window, softcap, sinks)


def sdpa_sinks_reference(q, k, v, attn_mask, sinks, scale, enable_gqa) -> torch.Tensor:
    """GPT-OSS's eager attention (``eager_attention_forward``) in its dtype order: the scores in q's
    dtype, the sinks a last column, the maximum subtracted, the softmax in the logits' dtype, the sink
    column dropped, the weights cast to v's dtype."""
    if enable_gqa and q.dim() >= 3:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    logits = torch.cat([scores, sinks.reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)
    return torch.matmul(probs[..., :-1].to(v.dtype), v)


@torch.library.impl(_lib, "sdpa_sinks", "CompositeExplicitAutograd")
def _sdpa_sinks(q, k, v, attn_mask, sinks, scale, enable_gqa):
    return sdpa_sinks_reference(q, k, v, attn_mask, sinks, scale, enable_gqa)


@torch.library.register_fake(f"{NAMESPACE}::sdpa_sinks")
def _sdpa_sinks_fake(q, k, v, attn_mask, sinks, scale, enable_gqa):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def glu_linear_reference(x, weight, bias, act: str) -> torch.Tensor:
    """``act(gate) * up`` with gate and up the even and odd output features of one linear: the values
    (and dtype rounding) of ``act(linear(x, w_gate)) * linear(x, w_up)``."""
    y = torch.nn.functional.linear(x, weight, bias)
    return GLU_ACTS[act](y[..., 0::2]) * y[..., 1::2]


def _check_glu(weight, act: str) -> None:
    if act not in GLU_ACTS:
        raise ValueError(f"tritondelegate::glu_linear: act {act!r} is not one of {sorted(GLU_ACTS)}")
    if weight.shape[0] % 2:
        raise ValueError(f"tritondelegate::glu_linear: the weight has {weight.shape[0]} rows, not an even count")


@torch.library.impl(_lib, "glu_linear", "CompositeExplicitAutograd")
def _glu_linear(x, weight, bias, act):
    _check_glu(weight, act)
    return glu_linear_reference(x, weight, bias, act)


@torch.library.register_fake(f"{NAMESPACE}::glu_linear")
def _glu_linear_fake(x, weight, bias, act):
    _check_glu(weight, act)
    return glu_linear_reference(x, weight, bias, act)


def grouped_mm_reference(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[r] @ weight[e]`` (``+ bias[e]``) for the rows offs[e-1] <= r < offs[e] of each expert e, 0
    past offs[E-1]: what transformers' ``grouped_mm_fallback`` computes (one ``mm`` per expert, in x's
    dtype), and its per-expert bias, gathered by the sorted expert ids, added."""
    out = x.new_zeros(x.shape[0], weight.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        end = min(max(end, start), x.shape[0])
        if end > start:
            torch.mm(x[start:end], weight[e], out=out[start:end])
            if bias is not None:
                out[start:end] += bias[e]
        start = end
    return out


def _check_glu_grouped(weight, act: str) -> None:
    if act not in GROUPED_GLU_ACTS:
        raise ValueError(f"tritondelegate::glu_grouped_mm: act {act!r} is not one of {sorted(GROUPED_GLU_ACTS)}")
    if weight.dim() != 3 or weight.shape[2] % 2:
        raise ValueError(f"tritondelegate::glu_grouped_mm: the weight {list(weight.shape)} is not [E, K, 2N]")


def gathered_rows(x: torch.Tensor, rows: torch.Tensor | None, divisor: int) -> torch.Tensor:
    """``x[floor_divide(rows, divisor)]`` (``x`` itself when ``rows`` is None): each token's row once per
    expert it goes to, in the experts' order (``rows`` a sort's indices over tokens x k, ``divisor`` k)."""
    return x if rows is None else x[torch.div(rows, divisor, rounding_mode="floor")]


@torch.library.impl(_lib, "glu_grouped_mm", "CompositeExplicitAutograd")
def _glu_grouped_mm(x, weight, offs, act, rows=None, rows_divisor=1, bias=None, alpha=1.0, limit=0.0):
    _check_glu_grouped(weight, act)
    y = grouped_mm_reference(gathered_rows(x, rows, rows_divisor), weight, offs, bias)
    return glu_halves(act, y[:, 0::2], y[:, 1::2], alpha, limit)


@torch.library.register_fake(f"{NAMESPACE}::glu_grouped_mm")
def _glu_grouped_mm_fake(x, weight, offs, act, rows=None, rows_divisor=1, bias=None, alpha=1.0, limit=0.0):
    _check_glu_grouped(weight, act)
    return x.new_empty(x.shape[0] if rows is None else rows.shape[0], weight.shape[2] // 2)


@torch.library.impl(_lib, "gathered_grouped_mm", "CompositeExplicitAutograd")
def _gathered_grouped_mm(x, rows, rows_divisor, weight, offs, bias=None):
    return grouped_mm_reference(gathered_rows(x, rows, rows_divisor), weight, offs, bias)


@torch.library.register_fake(f"{NAMESPACE}::gathered_grouped_mm")
def _gathered_grouped_mm_fake(x, rows, rows_divisor, weight, offs, bias=None):
    return x.new_empty(rows.shape[0], weight.shape[2])


@torch.library.impl(_lib, "scattered_grouped_mm", "CompositeExplicitAutograd")
def _scattered_grouped_mm(x, weight, offs, dest, rows=None, rows_divisor=1, bias=None):
    y = grouped_mm_reference(gathered_rows(x, rows, rows_divisor), weight, offs, bias)
    return torch.zeros_like(y).index_put_((dest,), y)


@torch.library.register_fake(f"{NAMESPACE}::scattered_grouped_mm")
def _scattered_grouped_mm_fake(x, weight, offs, dest, rows=None, rows_divisor=1, bias=None):
    return x.new_empty(dest.shape[0], weight.shape[2])


def router_topk_reference(x, k: int, softmax_first: bool, renormalize: bool, dtype, out_dtype):
    """A router's top k along the last dim, as ``router_topk`` defines it (module docstring)."""
    if softmax_first:
        values, indices = torch.topk(torch.softmax(x, -1, dtype=dtype), k)
        if renormalize:
            values = values / values.sum(-1, keepdim=True)
    else:
        values, indices = torch.topk(x, k)
        values = torch.softmax(values, -1, dtype=dtype)
    return (values if out_dtype is None else values.to(out_dtype)), indices


@torch.library.impl(_lib, "router_topk", "CompositeExplicitAutograd")
def _router_topk(x, k, softmax_first, renormalize, dtype, out_dtype):
    return router_topk_reference(x, k, softmax_first, renormalize, dtype, out_dtype)


@torch.library.register_fake(f"{NAMESPACE}::router_topk")
def _router_topk_fake(x, k, softmax_first, renormalize, dtype, out_dtype):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape, dtype=out_dtype or dtype or x.dtype), x.new_empty(shape, dtype=torch.int64)


def group_router_reference(scores, bias, n_group: int, topk_group: int, k: int, renormalize: bool, eps: float,
                           scale: float):
    """DeepSeek-V3's group-limited top-k, as ``group_router`` defines it (module docstring)."""
    choice = scores + bias
    groups = choice.view(-1, n_group, choice.shape[-1] // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(groups, k=topk_group, dim=-1)[1]
    mask = torch.zeros_like(groups).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, n_group, choice.shape[-1] // n_group).reshape(choice.shape)
    indices = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=k, dim=-1)[1]
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return weights * scale, indices


@torch.library.impl(_lib, "group_router", "CompositeExplicitAutograd")
def _group_router(scores, bias, n_group, topk_group, k, renormalize, eps, scale):
    return group_router_reference(scores, bias, n_group, topk_group, k, renormalize, eps, scale)


@torch.library.register_fake(f"{NAMESPACE}::group_router")
def _group_router_fake(scores, bias, n_group, topk_group, k, renormalize, eps, scale):
    shape = (scores.shape[0], k)
    return scores.new_empty(shape), scores.new_empty(shape, dtype=torch.int64)


def cumulative_histc_reference(x, bins: int, low: float, high: float, cast, dtype) -> torch.Tensor:
    """``cumsum(histc(x.to(cast), bins, low, high), 0, dtype=dtype)`` (no cast when ``cast`` is None)."""
    counts = torch.histc(x if cast is None else x.to(cast), bins, low, high)
    return torch.cumsum(counts, 0, dtype=dtype)


@torch.library.impl(_lib, "cumulative_histc", "CompositeExplicitAutograd")
def _cumulative_histc(x, bins, min, max, cast, dtype):
    return cumulative_histc_reference(x, bins, min, max, cast, dtype)


@torch.library.register_fake(f"{NAMESPACE}::cumulative_histc")
def _cumulative_histc_fake(x, bins, min, max, cast, dtype):
    return x.new_empty(bins, dtype=dtype)


def sort_offsets_reference(x, descending: bool, bins: int, low: float, high: float, cast, dtype):
    """``sort(x, stable=True, descending=descending)`` and the running counts of its values."""
    values, indices = torch.sort(x, stable=True, descending=descending)
    return values, indices, cumulative_histc_reference(values, bins, low, high, cast, dtype)


@torch.library.impl(_lib, "sort_offsets", "CompositeExplicitAutograd")
def _sort_offsets(x, descending, bins, min, max, cast, dtype):
    return sort_offsets_reference(x, descending, bins, min, max, cast, dtype)


@torch.library.register_fake(f"{NAMESPACE}::sort_offsets")
def _sort_offsets_fake(x, descending, bins, min, max, cast, dtype):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.int64), x.new_empty(bins, dtype=dtype)


def _table_at(table: torch.Tensor, cos_dims, outer, inner, cols) -> torch.Tensor:
    """``table`` [..., W] at each row's (outer, inner) indices along ``cos_dims`` and at ``cols``
    (clamped to 0: the caller masks pass-through pairs): [rows, pairs]."""
    index = [torch.zeros((), dtype=torch.long, device=table.device)] * table.dim()
    for dim, at in zip(cos_dims, (outer, inner)):
        if dim >= 0:
            index[dim] = at[:, None]
    index[-1] = cols.clamp(min=0)[None, :]
    return table[tuple(index)]


def _head_norms(rows: torch.Tensor, weight: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """``rows`` [T, N] with its first weight.numel() columns (pairs (a, b) of heads of ``dim`` columns)
    RMS-normalized per head, as ``rms_norm`` computes it; the rest as they are."""
    n = weight.numel()
    heads = rows[:, :n].reshape(rows.shape[0], n // dim, dim // 2, 2)
    ordered = torch.cat((heads[..., 0], heads[..., 1]), dim=-1)  # each head's columns in order
    w = weight.reshape(n // dim, dim // 2, 2)
    w = torch.cat((w[..., 0], w[..., 1]), dim=-1)
    normed = torch.stack([torch.rms_norm(ordered[:, h], [dim], w[h], eps) for h in range(n // dim)], dim=1)
    normed = torch.stack((normed[..., : dim // 2], normed[..., dim // 2:]), dim=-1).reshape(rows.shape[0], n)
    return torch.cat((normed, rows[:, n:]), dim=1)


def rope_linear_reference(x, weight, bias, pairs, cos, sin, cos_dims, scale: float, dtype, norm_weight=None,
                          norm_dim: int = 0, norm_eps: float = 0.0) -> torch.Tensor:
    """The rotation of each rotated pair as ``rotary`` computes it (the same formula, in the result's
    dtype after the projection's rounding, and its per-head norm's); the other pairs pass through."""
    y = torch.nn.functional.linear(x, weight, bias)
    n = y.shape[-1]
    rows = y.reshape(-1, n)
    if norm_weight is not None:
        rows = _head_norms(rows, norm_weight, norm_dim, norm_eps)
    inner = y.shape[-2] if y.dim() >= 2 else 1
    t = torch.arange(rows.shape[0], device=y.device)
    outer, inner_at = t // inner, t % inner
    a, b = rows[:, 0::2], rows[:, 1::2]
    ja, jb = pairs[:, 2].long(), pairs[:, 3].long()
    if sin is None or not cos.is_floating_point():  # one angle per pair, tables as the model computes them
        if sin is None:
            angles = _table_at(cos, cos_dims, outer, inner_at, ja)
        else:  # positions times inverse frequencies, in fp32
            positions, freqs = (_table_at(t, cos_dims, outer, inner_at, ja).float() for t in (cos, sin))
            angles = positions * freqs
        c1 = c2 = (angles.cos() * scale).to(dtype)
        s1 = s2 = (angles.sin() * scale).to(dtype)
    else:
        c1, c2 = (_table_at(cos, cos_dims, outer, inner_at, j) for j in (ja, jb))
        s1, s2 = (_table_at(sin, cos_dims, outer, inner_at, j) for j in (ja, jb))
    rotated = (ja >= 0)[None, :]
    ya = torch.where(rotated, a * c1 + (-b) * s1, a).to(y.dtype)
    yb = torch.where(rotated, b * c2 + a * s2, b).to(y.dtype)
    out = torch.empty_like(rows)
    out[:, pairs[:, 0].long()] = ya
    out[:, pairs[:, 1].long()] = yb
    return out.reshape(y.shape)


def _check_rope(weight, pairs) -> None:
    if weight.shape[0] % 2 or pairs.dim() != 2 or pairs.shape[1] != 4 or pairs.shape[0] * 2 != weight.shape[0]:
        raise ValueError(f"tritondelegate::rope_linear: pairs {tuple(pairs.shape)} do not cover the weight's "
                         f"{weight.shape[0]} rows in pairs ([rows / 2, 4] expected)")


@torch.library.impl(_lib, "rope_linear", "CompositeExplicitAutograd")
def _rope_linear(x, weight, bias, pairs, cos, sin, cos_dims, scale, dtype, norm_weight=None, norm_dim=0,
                 norm_eps=0.0):
    _check_rope(weight, pairs)
    return rope_linear_reference(x, weight, bias, pairs, cos, sin, cos_dims, scale, dtype, norm_weight, norm_dim,
                                 norm_eps)


@torch.library.register_fake(f"{NAMESPACE}::rope_linear")
def _rope_linear_fake(x, weight, bias, pairs, cos, sin, cos_dims, scale, dtype, norm_weight=None, norm_dim=0,
                      norm_eps=0.0):
    _check_rope(weight, pairs)
    return torch.nn.functional.linear(x, weight, bias)


# The ops this module defines, by the name a program file stores for a host op (``OpOverload.name()``).
OPS: dict[str, torch._ops.OpOverload] = {
    "tritondelegate::rotary": torch.ops.tritondelegate.rotary.default,
    "tritondelegate::rotary_pair": torch.ops.tritondelegate.rotary_pair.default,
    "tritondelegate::rotary_angles": torch.ops.tritondelegate.rotary_angles.default,
    "tritondelegate::rotary_pair_angles": torch.ops.tritondelegate.rotary_pair_angles.default,
    "tritondelegate::sdpa_positions": torch.ops.tritondelegate.sdpa_positions.default,
    "tritondelegate::sdpa_sinks": torch.ops.tritondelegate.sdpa_sinks.default,
    "tritondelegate::glu_linear": torch.ops.tritondelegate.glu_linear.default,
    "tritondelegate::glu_grouped_mm": torch.ops.tritondelegate.glu_grouped_mm.default,
    "tritondelegate::gathered_grouped_mm": torch.ops.tritondelegate.gathered_grouped_mm.default,
    "tritondelegate::scattered_grouped_mm": torch.ops.tritondelegate.scattered_grouped_mm.default,
    "tritondelegate::cumulative_histc": torch.ops.tritondelegate.cumulative_histc.default,
    "tritondelegate::router_topk": torch.ops.tritondelegate.router_topk.default,
    "tritondelegate::group_router": torch.ops.tritondelegate.group_router.default,
    "tritondelegate::rope_linear": torch.ops.tritondelegate.rope_linear.default,
    "tritondelegate::sort_offsets": torch.ops.tritondelegate.sort_offsets.default,
}

rotary = torch.ops.tritondelegate.rotary.default
rotary_pair = torch.ops.tritondelegate.rotary_pair.default
rotary_angles = torch.ops.tritondelegate.rotary_angles.default
rotary_pair_angles = torch.ops.tritondelegate.rotary_pair_angles.default
sdpa_positions = torch.ops.tritondelegate.sdpa_positions.default
sdpa_sinks = torch.ops.tritondelegate.sdpa_sinks.default
glu_linear = torch.ops.tritondelegate.glu_linear.default
glu_grouped_mm = torch.ops.tritondelegate.glu_grouped_mm.default
gathered_grouped_mm = torch.ops.tritondelegate.gathered_grouped_mm.default
scattered_grouped_mm = torch.ops.tritondelegate.scattered_grouped_mm.default
cumulative_histc = torch.ops.tritondelegate.cumulative_histc.default
router_topk = torch.ops.tritondelegate.router_topk.default
group_router = torch.ops.tritondelegate.group_router.default
rope_linear = torch.ops.tritondelegate.rope_linear.default
sort_offsets = torch.ops.tritondelegate.sort_offsets.default


# --- tritondelegate::sdpa_softcap: attention with its scores soft-capped (Gemma 2) -----------------------
_lib.define("sdpa_softcap(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float softcap, float? scale, "
            "bool enable_gqa) -> Tensor")


def sdpa_softcap_reference(q, k, v, attn_mask, softcap: float, scale, enable_gqa) -> torch.Tensor:
    """Gemma 2's eager attention in its dtype order: the scaled scores in q's dtype soft-capped,
    ``softcap * tanh(scores / softcap)``, then the mask (bool: False drops the key; float: added), the
    softmax in fp32, the weights cast to v's dtype (``passes/eager_attention.py``; one attention launch,
    ``kernels/attention.py``)."""
    if enable_gqa and q.dim() >= 3:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


@torch.library.impl(_lib, "sdpa_softcap", "CompositeExplicitAutograd")
def _sdpa_softcap(q, k, v, attn_mask, softcap, scale, enable_gqa):
    return sdpa_softcap_reference(q, k, v, attn_mask, softcap, scale, enable_gqa)


@torch.library.register_fake(f"{NAMESPACE}::sdpa_softcap")
def _sdpa_softcap_fake(q, k, v, attn_mask, softcap, scale, enable_gqa):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


OPS["tritondelegate::sdpa_softcap"] = torch.ops.tritondelegate.sdpa_softcap.default
sdpa_softcap = torch.ops.tritondelegate.sdpa_softcap.default


# --- tritondelegate::sigmoid_gate: x * sigmoid(scale * x) (swish, CLIP's quick GELU) ----------------------
_lib.define("sigmoid_gate(Tensor x, float scale) -> Tensor")


@torch.library.impl(_lib, "sigmoid_gate", "CompositeExplicitAutograd")
def _sigmoid_gate(x, scale):
    """As a model writes it: ``x * torch.sigmoid(scale * x)`` (``passes/fuse_activations.py``; one
    pointwise op, so it runs in the epilogue of the linear before it)."""
    return x * torch.sigmoid(x * scale)


@torch.library.register_fake(f"{NAMESPACE}::sigmoid_gate")
def _sigmoid_gate_fake(x, scale):
    return torch.empty_like(x)


OPS["tritondelegate::sigmoid_gate"] = torch.ops.tritondelegate.sigmoid_gate.default
sigmoid_gate = torch.ops.tritondelegate.sigmoid_gate.default


# --- tritondelegate::softsign, tanhshrink: x / (1 + |x|), x - tanh(x) ----------------------------------
# torch has no ATen op for either (F.softsign and F.tanhshrink are written in these ops), so written out
# each reads x twice and cannot join the epilogue of the linear before it; as one op each it can
# (``passes/fuse_activations.py``).
_lib.define("softsign(Tensor x) -> Tensor")
_lib.define("tanhshrink(Tensor x) -> Tensor")


@torch.library.impl(_lib, "softsign", "CompositeExplicitAutograd")
def _softsign(x):
    return x / (x.abs() + 1)


@torch.library.impl(_lib, "tanhshrink", "CompositeExplicitAutograd")
def _tanhshrink(x):
    return x - x.tanh()


@torch.library.register_fake(f"{NAMESPACE}::softsign")
def _softsign_fake(x):
    return torch.empty_like(x)


@torch.library.register_fake(f"{NAMESPACE}::tanhshrink")
def _tanhshrink_fake(x):
    return torch.empty_like(x)


OPS["tritondelegate::softsign"] = torch.ops.tritondelegate.softsign.default
OPS["tritondelegate::tanhshrink"] = torch.ops.tritondelegate.tanhshrink.default
softsign = torch.ops.tritondelegate.softsign.default
tanhshrink = torch.ops.tritondelegate.tanhshrink.default


# --- tritondelegate::dequant_weight: a weight-only quantized weight (int8 / uint8), dequantized ---------
# q [*R, K] int8 or uint8; zero and scale [*R, K / G]: one per group of G consecutive columns (G = K:
# one per row); each None when absent. ``bits=4``: q is uint8 [*R, K / 2], two unsigned 4-bit values
# per byte, column 2j in byte j's low nibble and column 2j + 1 in its high one (``unpack_nibbles``).
# ``transposed``: W's last two dims swapped ([*E, K, N]: the B of an ``mm``, or each expert's weight of a
# grouped GEMM). ``zero_point``: without a zero table, one integer zero point for all (a symmetric 4-bit
# scheme's 8: no table to store or read). The float weight a model computes from them, in its dtype order:
#     t = q.to(sub_dtype) - zero          (zero converted to sub_dtype; both exact)
#     t = t.to(mul_dtype) * scale         (the product rounded to mul_dtype)
#     W = t.to(dtype)
# (each step in fp32, rounded to its dtype). A matmul whose weight this is reads q (1 byte per element)
# and dequantizes each tile in the kernel
# (``passes/quant_weights.py``, ``matmul.py``'s ``QUANT``); W is never stored.
_lib.define("dequant_weight(Tensor q, Tensor? zero, Tensor? scale, ScalarType sub_dtype, ScalarType mul_dtype, "
            "ScalarType dtype, int bits=8, bool transposed=False, int zero_point=0) -> Tensor")
QUANT_DTYPES = (torch.int8, torch.uint8)
QUANT_FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # the dtypes of its steps


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[*R, K] -> [*R, groups, K / groups] (a view)."""
    return t.view(*t.shape[:-1], groups, t.shape[-1] // groups)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [*R, K / 2] -> uint8 [*R, K]: each byte's low nibble, then its high one."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 [*R, K] of values in [0, 15] -> uint8 [*R, K / 2], as :func:`unpack_nibbles` reads them."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous()


def dequant_weight_reference(q, zero, scale, sub_dtype, mul_dtype, dtype, bits: int = 8,
                             zero_point: int = 0) -> torch.Tensor:
    """The arithmetic in fp32, rounded to each step's dtype: eager's, whose 16-bit ops compute in fp32
    and round once (the products and differences here are exact in fp32). Computed in blocks of rows,
    each small enough to stay in a CPU cache (a whole weight's fp32 intermediates would not).
    ``zero_point``: without a zero table, one zero point for every group (4 bits symmetric: 8)."""
    k = q.shape[-1] * (2 if bits == 4 else 1)
    out = torch.empty((*q.shape[:-1], k), dtype=dtype, device=q.device)
    flat = [None if t is None else t.reshape(-1, t.shape[-1]) for t in (q, zero, scale)]
    rows = out.view(-1, k)
    # (on a GPU one block: each would be a few launches)
    step = max(1, _REFERENCE_BLOCK // max(k, 1)) if q.device.type == "cpu" else max(rows.shape[0], 1)
    for i in range(0, rows.shape[0], step):
        qb, zb, sb = (None if t is None else t[i:i + step] for t in flat)
        if zb is None and zero_point:
            zb = torch.full((qb.shape[0], 1 if sb is None else sb.shape[-1]), float(zero_point), device=qb.device)
        rows[i:i + step] = _dequant_block(unpack_nibbles(qb) if bits == 4 else qb, zb, sb, sub_dtype, mul_dtype)
    return out


_REFERENCE_BLOCK = 1 << 16  # elements per block of :func:`dequant_weight_reference`


def _dequant_block(q, zero, scale, sub_dtype, mul_dtype) -> torch.Tensor:
    """Rows [n, K] of :func:`dequant_weight_reference`, rounded to ``mul_dtype``."""
    groups = next((p.shape[-1] for p in (zero, scale) if p is not None), 1)
    t = _grouped(q.to(torch.float32), groups)
    if zero is not None:
        t = (t - zero.to(torch.float32).unsqueeze(-1)).to(sub_dtype).to(mul_dtype).to(torch.float32)
    # without a zero point t holds integers of at most 8 bits: exact in every float dtype, so its
    # rounding to mul_dtype changes nothing
    if scale is not None:
        t = t * scale.to(torch.float32).unsqueeze(-1)
    return t.to(mul_dtype).view(q.shape)


def _check_dequant(q, zero, scale, bits, zero_point=0) -> None:
    if q.dtype not in QUANT_DTYPES or (bits == 4 and q.dtype != torch.uint8) or bits not in (4, 8):
        raise ValueError(f"tritondelegate::dequant_weight: q is {q.dtype} with bits={bits}; it takes int8 or "
                         "uint8 with bits=8, or uint8 with bits=4 (two values per byte)")
    k = q.shape[-1] * (2 if bits == 4 else 1)
    for name, part in (("zero", zero), ("scale", scale)):
        if part is not None and (part.shape[:-1] != q.shape[:-1] or part.shape[-1] == 0 or k % part.shape[-1]):
            raise ValueError(f"tritondelegate::dequant_weight: {name} {tuple(part.shape)} does not hold whole "
                             f"groups of q's rows {tuple(q.shape)}")
    if zero is not None and zero_point:
        raise ValueError(f"tritondelegate::dequant_weight: a zero table and zero_point={zero_point}; it takes one")
    if zero is not None and scale is not None and zero.shape != scale.shape:
        raise ValueError(f"tritondelegate::dequant_weight: zero {tuple(zero.shape)} and scale {tuple(scale.shape)} "
                         "differ; they take one value per group alike")


@torch.library.impl(_lib, "dequant_weight", "CompositeExplicitAutograd")
def _dequant_weight(q, zero, scale, sub_dtype, mul_dtype, dtype, bits=8, transposed=False, zero_point=0):
    _check_dequant(q, zero, scale, bits, zero_point)
    w = dequant_weight_reference(q, zero, scale, sub_dtype, mul_dtype, dtype, bits, zero_point)
    return w.transpose(-2, -1) if transposed else w


@torch.library.register_fake(f"{NAMESPACE}::dequant_weight")
def _dequant_weight_fake(q, zero, scale, sub_dtype, mul_dtype, dtype, bits=8, transposed=False, zero_point=0):
    _check_dequant(q, zero, scale, bits, zero_point)
    w = q.new_empty((*q.shape[:-1], q.shape[-1] * (2 if bits == 4 else 1)), dtype=dtype)
    return w.transpose(-2, -1) if transposed else w


OPS["tritondelegate::dequant_weight"] = torch.ops.tritondelegate.dequant_weight.default
dequant_weight = torch.ops.tritondelegate.dequant_weight.default
