"""Decode throughput of LLM generation with a KV cache, on the shared harness (timing, rounds, device).

One model (``tritondelegate.models.KVCacheDecoder``: prefill and decode as two methods of one program
sharing the cache as program state) and one prompt, in six modes:

* ``state_on_host``   ``state_on_device=False``: the cache lives on the host and every decode call
                      copies it host-to-device and back (the behaviour before program state).
* ``state_on_device`` the cache is program state on the device, updated in place by the kernels; a
                      step moves the token id and position in and the logits out.
* ``state_on_device_graphs`` the same, decode loaded with ``graphs=True`` (replayed as CUDA graphs).
* ``state_on_device_graphs_dot`` the same, lowered for a target without the GEMV variant
                      (``Target.gemv_rows=0``): every decode projection on ``tl.dot``'s 16-row tiles,
                      to compare with the GEMV path.
* ``state_on_device_graphs_int8``, ``..._int4`` the same with the linears (and a MoE case's experts)
                      weight-only quantized (``td.quantize_linears``: int8 per row; 4 bits per group of
                      64): a step reads a byte, or half of one, per weight; tokens checked against the
                      quantized model eager.
* ``state_on_device_graphs_lookup`` the same with prompt lookup decoding (``td.PromptLookup()``): the
                      prefill method, exported for 1 to max(prompt, 11) tokens, also decodes, each call
                      the last token and the tokens drafted from the text so far; a round is the same
                      ``steps`` tokens in fewer calls (``decode_calls_per_round``, ``drafted``,
                      ``accepted``), checked against eager's.
* ``hf_eager``        transformers' ``LlamaForCausalLM`` with the same config and weights, in its static-cache
                      export recipe (``TorchExportableModuleWithStaticCache``) run eagerly on the same
                      device: the reference front end of DESIGN.md's first workload.

A Mixture-of-Experts case (``moe-...``) is transformers' ``MixtralForCausalLM`` itself, exported by its
static-cache recipe (``convert_and_export_with_cache``: prefill and decode) and lowered: the modes
``state_on_device``, ``state_on_device_graphs`` and ``hf_eager`` (the same model run eagerly through the
recipe's wrapper); the other modes are skipped for it (they vary the demo decoder's lowering).

Every lowered mode keeps its constants resident (``skip_h2d_for_constants=True``). A timed round is
``steps`` greedy decode steps from the position after the prompt (argmax of the logits, fed back),
after one prefill at setup; rounds overwrite the same cache positions, so each round does the same
work. ``decode_tokens_per_s`` = steps / the median round. On the simulated device the kernels run
under the Triton interpreter: the times are the interpreter's; the bytes and launches carry over.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import warnings
from dataclasses import dataclass

import torch

import tritondelegate as td
from tritondelegate.generate import Generator
from tritondelegate.kernels.target import local as local_target
from tritondelegate.models import export_prefill_decode, generate_eager, hf_llama_static_cache, kv_cache_decoder

from bench.harness import DEVICE, TORCH_DEVICE

GEN_MODES = ("state_on_host", "state_on_device", "state_on_device_graphs", "state_on_device_graphs_dot",
             "state_on_device_graphs_one_pass", "state_on_device_graphs_int8", "state_on_device_graphs_int4",
             "state_on_device_graphs_lookup", "hf_eager")
# prompt lookup decoding: mode -> its drafts (decode runs through the prefill method, of several tokens)
LOOKUP = {"state_on_device_graphs_lookup": td.PromptLookup()}
# lowering variants of the device-state program: mode -> the target's changes
VARIANTS = {"state_on_device_graphs_dot": {"gemv_rows": 0}, "state_on_device_graphs_one_pass": {"split_attention": False}}
# weight-only quantized variants: mode -> td.quantize_linears' arguments (a linear whose input features the
# group does not divide stays float); their tokens are checked against the quantized model run eagerly
QUANTIZED = {"state_on_device_graphs_int8": {}, "state_on_device_graphs_int4": {"bits": 4, "group_size": 64}}


MOE_MODES = ("state_on_device", "state_on_device_graphs", "hf_eager", *QUANTIZED)  # the modes a Mixtral case runs


@dataclass(frozen=True)
class GenCase:
    name: str
    config: tuple[tuple[str, int], ...]  # DecoderConfig overrides, or MixtralConfig's for a MoE case
    prompt_len: int
    steps: int  # decode steps per timed round
    moe: bool = False  # transformers' Mixtral through its static-cache recipe

    def build(self):
        """The model (seed 0) and a prompt [1, prompt_len] (seed 1)."""
        model = _mixtral(dict(self.config)) if self.moe else kv_cache_decoder(seed=0, **dict(self.config))
        vocab = model.config.vocab_size if self.moe else model.cfg.vocab_size
        prompt = torch.randint(0, vocab, (1, self.prompt_len), generator=torch.Generator().manual_seed(1))
        return model, prompt

    def export(self, model, lookup: bool = False):
        """Prefill and decode of ``model`` as a dict of exported methods; for prompt lookup, a prefill of 1
        to max(prompt, drafts + 1) tokens returning every position's logits."""
        if not self.moe:
            most = max(self.prompt_len, max(x.num_tokens for x in LOOKUP.values()) + 1) if lookup else None
            return export_prefill_decode(model, self.prompt_len, max_prompt_len=most)
        from transformers.integrations.executorch import convert_and_export_with_cache

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {"prefill": convert_and_export_with_cache(model, torch.zeros(1, self.prompt_len, dtype=torch.long),
                                                             torch.arange(self.prompt_len)),
                    "decode": convert_and_export_with_cache(model, torch.zeros(1, 1, dtype=torch.long),
                                                            torch.tensor([self.prompt_len]))}

    def facts(self, model) -> dict:
        """The model's vocabulary, weight and cache bytes."""
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        if not self.moe:
            return {"vocab_size": model.cfg.vocab_size, "weight_bytes": weights,
                    "cache_bytes": sum(b.numel() * b.element_size() for b in model.cache_buffers().values())}
        c = model.config
        head_dim = c.hidden_size // c.num_attention_heads
        cache = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * dict(self.config)["max_cache_len"] * 4
        return {"vocab_size": c.vocab_size, "weight_bytes": weights, "cache_bytes": cache,
                "experts": c.num_local_experts, "experts_per_token": c.num_experts_per_tok}


def _mixtral(config: dict):
    """transformers' Mixtral (seed 0, fp32, eval) with a static cache of ``max_cache_len`` positions."""
    import transformers

    config = dict(config)
    cache = config.pop("max_cache_len")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(max_position_embeddings=cache, **config)).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": cache}
    return model


def _static_cache_wrapper(model, device):
    """transformers' static-cache recipe module around ``model`` on ``device``, called eagerly."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    return TorchExportableModuleWithStaticCache(model.to(device))


def gen_case(dim: int, layers: int, heads: int, kv_heads: int, hidden: int, vocab: int, seq: int,
             prompt_len: int, steps: int) -> GenCase:
    config = dict(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=hidden,
                  vocab_size=vocab, max_seq_len=seq)
    return GenCase(f"kv-d{dim}-l{layers}-v{vocab}-s{seq}", tuple(config.items()), prompt_len, steps)


def moe_case(dim: int, layers: int, heads: int, kv_heads: int, hidden: int, experts: int, top_k: int, vocab: int,
             seq: int, prompt_len: int, steps: int) -> GenCase:
    config = dict(hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  intermediate_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k, vocab_size=vocab,
                  max_cache_len=seq)
    return GenCase(f"moe-d{dim}-l{layers}-e{experts}k{top_k}-v{vocab}-s{seq}", tuple(config.items()), prompt_len,
                   steps, moe=True)


# By device; ``quick`` takes the first. The simulated device interprets every launch on the CPU: one
# tiny model, a few steps per round.
GEN_SIZES = {
    "simulated": [gen_case(64, 2, 4, 2, 176, 256, 64, 16, 4),             # 0.5 MB weights, 32 KB cache
                  moe_case(64, 2, 4, 2, 96, 4, 2, 256, 64, 16, 4)],        # 0.6 MB weights, 32 KB cache
    "cuda": [gen_case(256, 2, 4, 2, 704, 4096, 256, 32, 32),              # 14 MB weights, 0.5 MB cache
             gen_case(1024, 8, 16, 4, 2816, 16384, 1024, 128, 32),        # 495 MB weights, 16 MB cache
             moe_case(1024, 4, 16, 4, 1408, 8, 2, 16384, 1024, 128, 32)],  # 0.83 GB weights (8 experts), 8 MB cache
}
# Run by name only (``--bench-case``; scripts/gpu_bench.sh gives it its own step): a long context, decode
# attending over 3000+ keys of 4 key heads at batch 1, where splitting the keys (flash-decoding) matters.
GEN_LONG = {"simulated": [], "cuda": [gen_case(1024, 2, 16, 4, 2816, 16384, 4096, 3000, 32)]}  # 170 MB, 16 MB


def case_names() -> set[str]:
    """Every generation case of this device, by name (what ``--bench-case`` may pick)."""
    return {c.name for c in GEN_SIZES[DEVICE] + GEN_LONG[DEVICE]}


def gen_cases(group: str, names: list[str] | None = None) -> list[GenCase]:
    """The generation cases of this device: the first for ``quick``, all of them for any other size
    group; ``names`` picks by name instead (other names pick nothing: they name latency cases)."""
    table = GEN_SIZES[DEVICE]
    if names:
        return [c for c in table + GEN_LONG[DEVICE] if c.name in names]
    return table[:1] if group == "quick" else list(table)


def _eager_tokens(case: GenCase, model: torch.nn.Module, prompt: torch.Tensor) -> list[int]:
    """``model``'s greedy tokens in eager: the prefill's, then one per decode step (a MoE case through
    transformers' static-cache wrapper, the demo decoder through its own cache)."""
    if case.moe:
        wrapper = _static_cache_wrapper(model, "cpu")
        first = _step(wrapper, prompt, torch.arange(case.prompt_len))
        return _steps(wrapper, first, case.prompt_len, case.steps)[0].tolist()
    tokens, _ = generate_eager(model, prompt, case.steps + 1)
    return tokens[0].tolist()


@dataclass
class _Held:
    case: GenCase
    model: torch.nn.Module
    prompt: torch.Tensor
    tokens: list[int] | None = None  # eager greedy tokens: the prefill's, then one per decode step
    quantized: dict = dataclasses.field(default_factory=dict)  # mode -> (quantized model, its eager tokens)


class GenBench:
    """Session state: program files by (case, state_on_device), kept on disk for the session, and the
    one case held in memory (model, prompt, eager tokens)."""

    def __init__(self, workdir: str, stream):
        self.workdir, self.stream = workdir, stream
        self._files: dict[tuple[str, bool], str] = {}
        self._held: _Held | None = None

    def prepare(self, case: GenCase) -> _Held:
        if self._held is None or self._held.case != case:
            self._held = None
            gc.collect()
            self._held = _Held(case, *case.build())
        return self._held

    def eager_tokens(self, case: GenCase) -> list[int]:
        held = self.prepare(case)
        if held.tokens is None:
            if case.moe:  # exported first: the programs keep the cache values eager would write
                self.program_path(case, True)
            else:
                self.program_path(case, False)  # first: the programs read the cache eager writes
                for mode in ("state_on_device", *VARIANTS, *LOOKUP):
                    self.program_path(case, True, mode)
            held.tokens = _eager_tokens(case, held.model, held.prompt)
        return held.tokens

    def quantized(self, case: GenCase, mode: str) -> tuple[torch.nn.Module, list[int]]:
        """``case``'s model quantized as ``mode`` says (:data:`QUANTIZED`), and its eager greedy tokens
        (computed after the export, which keeps the cache values eager then writes)."""
        held = self.prepare(case)
        if mode not in held.quantized:
            model = td.quantize_linears(copy.deepcopy(held.model), **QUANTIZED[mode])
            held.quantized[mode] = (model, None)
            self.program_path(case, True, mode)
            held.quantized[mode] = (model, _eager_tokens(case, model, held.prompt))
        return held.quantized[mode]

    def program_path(self, case: GenCase, state_on_device: bool, mode: str = "state_on_device") -> str:
        """The program file for ``case``, lowered for ``mode``'s target variant (:data:`VARIANTS`), of
        its quantized model for a mode of :data:`QUANTIZED`."""
        variant = VARIANTS.get(mode, {})
        quant = QUANTIZED.get(mode)
        own = quant is not None or mode in LOOKUP  # a program of its own: quantized, or exported for lookup
        key = (case.name, state_on_device, tuple(variant.items()), mode if own else None)
        if key not in self._files:
            config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(
                skip_h2d_for_constants=True, state_on_device=state_on_device),
                target=dataclasses.replace(local_target(), **variant))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", td.PerCallCopyWarning)  # state_on_host: the copies are the point
                model = self.prepare(case).model if quant is None else self.quantized(case, mode)[0]
                lowered = td.lower(case.export(model, mode in LOOKUP),
                                   partitioner=td.TritonPartitioner(device="cuda:0"), config=config)
            place = ("device" if state_on_device else "host") + "".join(f"-{k}{v}" for k, v in variant.items())
            place += f"-{mode.rsplit('_', 1)[-1]}" if own else ""
            path = os.path.join(self.workdir, f"{case.name}.{place}.tdp")
            lowered.save(path)
            self._files[key] = path
        return self._files[key]

    def runner(self, case: GenCase, mode: str):
        """(one timed round: ``steps`` decode steps, facts about it given its output)."""
        if mode == "hf_eager":
            return self._hf_runner(case)
        if mode not in GEN_MODES:
            raise ValueError(f"unknown generation mode {mode!r}; valid: {', '.join(GEN_MODES)}")
        expected = self.eager_tokens(case) if mode not in QUANTIZED else self.quantized(case, mode)[1]
        prompt = self.prepare(case).prompt
        program = td.load(self.program_path(case, mode != "state_on_host", mode))
        generator = Generator(program, graphs=mode.startswith("state_on_device_graphs"), stream=self.stream,
                              decode="prefill" if mode in LOOKUP else "decode")
        first = generator.generate(prompt, 1).tokens  # the prefill, once

        def call():
            if mode in LOOKUP:
                return generator.lookup_from(first, case.prompt_len, case.steps, prompt, LOOKUP[mode])
            return generator.decode_from(first, case.prompt_len, case.steps)

        def facts(out):
            tokens, steps = out[:2]
            last = steps[-1]
            drafts = dict(zip(("drafted", "accepted"), out[2])) if mode in LOOKUP else {}
            return {"h2d_bytes_per_step": last.h2d_bytes, "d2h_bytes_per_step": last.d2h_bytes,
                    "launches_per_step": last.launches, "graph_replays_per_step": last.graph_replays,
                    "synchronizations_per_step": last.synchronizations, "memory": program.memory(),
                    "decode_calls_per_round": len(steps), **drafts,
                    "tokens_match_eager": tokens[0].tolist() == expected}

        return call, facts

    def _hf_runner(self, case: GenCase):
        expected = self.eager_tokens(case)
        held = self.prepare(case)
        if case.moe:
            wrapper = _static_cache_wrapper(held.model, TORCH_DEVICE)
        else:
            wrapper = hf_llama_static_cache(held.model, device=TORCH_DEVICE)
        first = _step(wrapper, held.prompt.to(TORCH_DEVICE), torch.arange(case.prompt_len, device=TORCH_DEVICE))
        if DEVICE == "cuda":
            torch.cuda.synchronize()

        def call():
            return _steps(wrapper, first, case.prompt_len, case.steps)

        def facts(out):
            cache = sum(b.numel() * b.element_size() for n, b in wrapper.named_buffers() if "_cache_" in n)
            return {"h2d_bytes_per_step": None, "d2h_bytes_per_step": None, "launches_per_step": None,
                    "memory": {TORCH_DEVICE: {"state": cache}},
                    "tokens_match_eager": out[0].cpu().tolist() == expected}

        return call, facts

    def common_facts(self, case: GenCase, mode: str) -> dict:
        return {"model": case.name, "mode": mode, "device": DEVICE, "prompt_len": case.prompt_len,
                "steps": case.steps, **case.facts(self.prepare(case).model)}


@torch.no_grad()
def _step(wrapper, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One eager call of a static-cache wrapper: the greedy next token [B, 1] on its device."""
    return wrapper(input_ids=ids, cache_position=positions)[:, -1].argmax(-1, keepdim=True)


def _steps(wrapper, first: torch.Tensor, position: int, steps: int) -> torch.Tensor:
    """``steps`` greedy decode calls of a static-cache wrapper from ``first`` at ``position``:
    [B, steps + 1] tokens, ``first`` included."""
    tokens = [first]
    for i in range(steps):
        tokens.append(_step(wrapper, tokens[-1], torch.tensor([position + i], device=first.device)))
    return torch.cat(tokens, dim=1)
