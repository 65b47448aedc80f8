"""Per-head norms (Qwen3's and Gemma3's q_norm and k_norm) in the rotary launch that reads them: the
rotary ops' ``norm`` arguments (ops.py), the kernel's ``NORM`` (kernels/rotary.py) and the rewrite
(passes/head_norm.py), through the public API. On the default target (an H100) a decode-sized
projection keeps its norms out of its epilogue (test_rope_linear.py), so they land here."""

from __future__ import annotations

import warnings

import pytest
import torch

import tritondelegate as td
from harness import FLOAT_DTYPES, Logits, assert_close, plan_launches
from test_rope_linear import Projection, _args, _check

CONFIG = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _taken(lowered, method="forward") -> int:
    return sum(f.startswith("per-head norm in the rotary") for f in lowered.reports[method].fused)


def _rotary_norms(lowered, method: int = 0) -> list[bool]:
    return [launch.constexprs["NORM"].value for launch in plan_launches(lowered, method)
            if launch.kernel == "rotary" and "NORM" in launch.constexprs]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("tables", ["positions", "inputs"])  # angles computed inline, or tables read
def test_norms_run_in_the_rotary(dtype, tables):
    model = Projection("separate", tables, head_norm=True).eval()
    lowered = _check(model, _args(model, seq=1), dtype)
    kernels = [launch.kernel for launch in plan_launches(lowered)]
    assert _taken(lowered) == 1 and _rotary_norms(lowered) == [True] and "norm" not in kernels


def test_a_norm_read_elsewhere_stays():
    """The normed query is also returned as it is: the norm's result must exist, so it stays a launch."""

    class AlsoNormed(Projection):
        def forward(self, x, positions, cos, sin):
            q, k, v = self._heads(x)
            q, k = self._norm(q, 0), self._norm(k, 1)
            cos, sin = self._tables(x.shape[1], positions, cos, sin)
            return (q * cos + torch.cat((-q[..., 4:], q[..., :4]), -1) * sin,
                    k * cos + torch.cat((-k[..., 4:], k[..., :4]), -1) * sin, v, q + 1)

    model = AlsoNormed("separate", "positions", head_norm=True).eval()
    lowered = _check(model, _args(model, seq=1))
    assert _taken(lowered) == 0 and "norm" in [launch.kernel for launch in plan_launches(lowered)]


def test_qwen3_static_cache_step():
    """transformers' Qwen3 through its static-cache export recipe, on an H100: 6 launches per layer at
    prefill and decode (the norms with the rotary; without this rewrite 8)."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.executorch import convert_and_export_with_cache

    def export(layers):
        torch.manual_seed(0)
        config = transformers.Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=64)
        model = transformers.Qwen3ForCausalLM(config).eval()
        model.generation_config.cache_implementation = "static"
        model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 32}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {"prefill": convert_and_export_with_cache(model, torch.tensor([[3, 17, 5, 9, 22]]), torch.arange(5)),
                    "decode": convert_and_export_with_cache(model, torch.tensor([[4]]), torch.tensor([5]))}

    counts = {}
    for n in (1, 2):
        lowered = td.lower(export(n), config=CONFIG)
        counts[n] = {m: sum(lowered.reports[m].launches.values()) for m in ("prefill", "decode")}
        assert all(_taken(lowered, m) == n for m in ("prefill", "decode"))
    assert all(counts[2][m] - counts[1][m] == 6 for m in ("prefill", "decode")), counts


def test_hf_qwen3_forward():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64)
    model = Logits(transformers.Qwen3ForCausalLM(config).eval())
    args = (torch.randint(0, 64, (1, 5)),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = td.lower(torch.export.export(model, args), config=CONFIG)
    assert _taken(lowered) == 2 and _rotary_norms(lowered) == [True, True]
    assert len(plan_launches(lowered)) == 2 + 6 * 2  # per layer: qkv, rotary with norms, attention, o, gate/up, down
    with torch.no_grad():
        expected = model(*args)
    assert_close(lowered.load().load_method()(*args), expected)
