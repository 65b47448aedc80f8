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
* ``hf_eager``        transformers' ``LlamaForCausalLM`` with the same config and weights, in its static-cache
                      export recipe (``TorchExportableModuleWithStaticCache``) run eagerly on the same
                      device: the reference front end of DESIGN.md's first workload.

Every lowered mode keeps its constants resident (``skip_h2d_for_constants=True``). A timed round is
``steps`` greedy decode steps from the position after the prompt (argmax of the logits, fed back),
after one prefill at setup; rounds overwrite the same cache positions, so each round does the same
work. ``decode_tokens_per_s`` = steps / the median round. On the simulated device the kernels run
under the Triton interpreter: the times are the interpreter's; the bytes and launches carry over.
"""

from __future__ import annotations

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
             "state_on_device_graphs_one_pass", "hf_eager")
# lowering variants of the device-state program: mode -> the target's changes
VARIANTS = {"state_on_device_graphs_dot": {"gemv_rows": 0}, "state_on_device_graphs_one_pass": {"split_attention": False}}


@dataclass(frozen=True)
class GenCase:
    name: str
    config: tuple[tuple[str, int], ...]  # DecoderConfig overrides
    prompt_len: int
    steps: int  # decode steps per timed round

    def build(self):
        """The model (seed 0) and a prompt [1, prompt_len] (seed 1)."""
        model = kv_cache_decoder(seed=0, **dict(self.config))
        prompt = torch.randint(0, model.cfg.vocab_size, (1, self.prompt_len),
                               generator=torch.Generator().manual_seed(1))
        return model, prompt


def gen_case(dim: int, layers: int, heads: int, kv_heads: int, hidden: int, vocab: int, seq: int,
             prompt_len: int, steps: int) -> GenCase:
    config = dict(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=hidden,
                  vocab_size=vocab, max_seq_len=seq)
    return GenCase(f"kv-d{dim}-l{layers}-v{vocab}-s{seq}", tuple(config.items()), prompt_len, steps)


# By device; ``quick`` takes the first. The simulated device interprets every launch on the CPU: one
# tiny model, a few steps per round.
GEN_SIZES = {
    "simulated": [gen_case(64, 2, 4, 2, 176, 256, 64, 16, 4)],            # 0.5 MB weights, 32 KB cache
    "cuda": [gen_case(256, 2, 4, 2, 704, 4096, 256, 32, 32),              # 14 MB weights, 0.5 MB cache
             gen_case(1024, 8, 16, 4, 2816, 16384, 1024, 128, 32)],       # 495 MB weights, 16 MB cache
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


@dataclass
class _Held:
    case: GenCase
    model: torch.nn.Module
    prompt: torch.Tensor
    tokens: list[int] | None = None  # eager greedy tokens: the prefill's, then one per decode step


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
            self.program_path(case, False)  # first: the programs read the cache eager writes
            for mode in ("state_on_device", *VARIANTS):
                self.program_path(case, True, mode)
            tokens, _ = generate_eager(held.model, held.prompt, case.steps + 1)
            held.tokens = tokens[0].tolist()
        return held.tokens

    def program_path(self, case: GenCase, state_on_device: bool, mode: str = "state_on_device") -> str:
        """The program file for ``case``, lowered for ``mode``'s target variant (:data:`VARIANTS`)."""
        variant = VARIANTS.get(mode, {})
        key = (case.name, state_on_device, tuple(variant.items()))
        if key not in self._files:
            config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(
                skip_h2d_for_constants=True, state_on_device=state_on_device),
                target=dataclasses.replace(local_target(), **variant))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", td.PerCallCopyWarning)  # state_on_host: the copies are the point
                lowered = td.lower(export_prefill_decode(self.prepare(case).model, case.prompt_len),
                                   partitioner=td.TritonPartitioner(device="cuda:0"), config=config)
            place = ("device" if state_on_device else "host") + "".join(f"-{k}{v}" for k, v in variant.items())
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
        expected = self.eager_tokens(case)
        prompt = self.prepare(case).prompt
        program = td.load(self.program_path(case, mode != "state_on_host", mode))
        generator = Generator(program, graphs=mode.startswith("state_on_device_graphs"), stream=self.stream)
        first = generator.generate(prompt, 1).tokens  # the prefill, once

        def call():
            return generator.decode_from(first, case.prompt_len, case.steps)

        def facts(out):
            tokens, steps = out
            last = steps[-1]
            return {"h2d_bytes_per_step": last.h2d_bytes, "d2h_bytes_per_step": last.d2h_bytes,
                    "launches_per_step": last.launches, "graph_replays_per_step": last.graph_replays,
                    "synchronizations_per_step": last.synchronizations, "memory": program.memory(),
                    "tokens_match_eager": tokens[0].tolist() == expected}

        return call, facts

    def _hf_runner(self, case: GenCase):
        expected = self.eager_tokens(case)
        held = self.prepare(case)
        wrapper = hf_llama_static_cache(held.model, device=TORCH_DEVICE)
        ids = held.prompt.to(TORCH_DEVICE)
        with torch.no_grad():
            logits = wrapper(input_ids=ids, cache_position=torch.arange(case.prompt_len, device=TORCH_DEVICE))
        first = logits[:, -1].argmax(-1, keepdim=True)
        positions = [torch.tensor([case.prompt_len + i], device=TORCH_DEVICE) for i in range(case.steps)]
        if DEVICE == "cuda":
            torch.cuda.synchronize()

        def call():
            tokens = [first]
            for position in positions:
                logits = wrapper(input_ids=tokens[-1], cache_position=position)
                tokens.append(logits[:, -1].argmax(-1, keepdim=True))
            return torch.cat(tokens, dim=1)

        def facts(out):
            cache = sum(b.numel() * b.element_size() for n, b in wrapper.named_buffers() if "_cache_" in n)
            return {"h2d_bytes_per_step": None, "d2h_bytes_per_step": None, "launches_per_step": None,
                    "memory": {TORCH_DEVICE: {"state": cache}},
                    "tokens_match_eager": out[0].cpu().tolist() == expected}

        return call, facts

    def common_facts(self, case: GenCase, mode: str) -> dict:
        model = self.prepare(case).model
        return {"model": case.name, "mode": mode, "device": DEVICE, "prompt_len": case.prompt_len,
                "steps": case.steps, "vocab_size": model.cfg.vocab_size,
                "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "cache_bytes": sum(b.numel() * b.element_size() for b in model.cache_buffers().values())}
