"""Greedy generation over a loaded program whose ``prefill`` and ``decode`` methods share a KV cache.

    program = td.load("decoder.tdp")
    generator = Generator(program, graphs=True)
    result = generator.generate(prompt, new_tokens=16)   # prompt [B, T] int64
    result.tokens, result.decode_tokens_per_s, result.steps[0], result.memory

The methods take ``(input_ids [B, T] int64, input_pos [T] int64)`` and return logits ``[B, T, vocab]``
(``tritondelegate.models.KVCacheDecoder`` exported by ``export_prefill_decode``), or take them by keyword
as ``input_ids=`` and ``cache_position=`` (transformers' static-cache export recipe,
``convert_and_export_with_cache``). The cache is the
program's state: prefill writes it, each decode step reads and extends it. Only token ids and
positions go in and logits come out; the next token is the argmax of the last logits, on the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class StepStats:
    """What one decode call moved and launched (from ``method.stats`` right after the call)."""

    h2d_bytes: int
    d2h_bytes: int
    launches: int
    graph_replays: int
    synchronizations: int

    @classmethod
    def of(cls, method) -> "StepStats":
        s = method.stats
        return cls(s.call_h2d_bytes, s.call_d2h_bytes, s.launches_per_call, s.graph_replays_per_call,
                   s.synchronizations_per_call)


@dataclass
class Generation:
    """The result of :meth:`Generator.generate`."""

    tokens: torch.Tensor  # [B, new_tokens]: prefill's token, then one per decode step
    prompt_tokens: int  # B * T
    prefill_s: float
    decode_s: float
    steps: list[StepStats]  # one per decode step
    memory: dict  # program.memory() after the run
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # per call, with keep_logits

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Generated tokens per second of the decode phase (all batch rows); None without a step."""
        return self.tokens.shape[0] * len(self.steps) / self.decode_s if self.steps else None

    def as_dict(self) -> dict:
        """Plain data (JSON-ready), without the logits."""
        return {
            "tokens": self.tokens.tolist(),
            "prompt_tokens": self.prompt_tokens,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "steps": [s.__dict__ for s in self.steps],
            "memory": self.memory,
        }


class Generator:
    """The prefill and decode methods of one loaded program, loaded once.

    ``graphs=True`` loads decode with CUDA graphs (each delegate replayed as one graph from its third
    call). ``stream``: every copy and launch of both methods runs on it. Calls are sequential; the
    cache persists between :meth:`generate` calls until ``program.reset_state()``.
    """

    def __init__(self, program, *, graphs: bool = False, stream=None,
                 prefill: str = "prefill", decode: str = "decode"):
        self.program = program
        self.stream = stream
        self.prefill = program.load_method(prefill, stream=stream)
        self.decode = program.load_method(decode, stream=stream, graphs=graphs)

    def generate(self, prompt: torch.Tensor, new_tokens: int, keep_logits: bool = False) -> Generation:
        """Prefill ``prompt`` [B, T] at positions 0..T-1, then ``new_tokens - 1`` decode steps, greedy.

        The prompt length must be one prefill takes: the length it was exported with, or any length in
        its range when exported with a dynamic prompt length. ``keep_logits`` keeps each call's
        logits (prefill [B, T, V], then [B, 1, V] per step) in the result.
        """
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
        batch, length = prompt.shape
        start = time.perf_counter()
        logits = _call(self.prefill, prompt, torch.arange(length), self.stream)
        prefill_s = time.perf_counter() - start
        kept = [logits] if keep_logits else None
        first = _greedy(logits)
        start = time.perf_counter()
        tokens, steps = self.decode_from(first, length, new_tokens - 1, kept)
        decode_s = time.perf_counter() - start
        return Generation(tokens, batch * length, prefill_s, decode_s, steps, self.program.memory(), kept)

    def decode_from(self, token: torch.Tensor, position: int, steps: int,
                    kept: list | None = None) -> tuple[torch.Tensor, list[StepStats]]:
        """``steps`` decode calls: ``token`` [B, 1] at ``position``, then each greedy successor at the
        next position. Returns (``token`` and the ``steps`` new tokens [B, steps + 1], per-step stats);
        appends each call's logits to ``kept`` when given."""
        tokens, stats = [token], []
        for i in range(steps):
            logits = _call(self.decode, tokens[-1], torch.tensor([position + i]), self.stream)
            stats.append(StepStats.of(self.decode))
            if kept is not None:
                kept.append(logits)
            tokens.append(_greedy(logits))
        return torch.cat(tokens, dim=1), stats


POSITION_KEYWORDS = ("cache_position", "input_pos")


def _call(method, ids: torch.Tensor, positions: torch.Tensor, stream):
    """``method`` on token ids and their positions: positionally, or by the keywords it was exported with."""
    names = method.input_keywords
    if not names:
        return method(ids, positions, stream=stream)
    where = [n for n in POSITION_KEYWORDS if n in names]
    if set(names) != {"input_ids", *where[:1]} or not where:
        raise ValueError(f"method {method.name!r} takes keywords {', '.join(names)}; generation passes "
                         f"input_ids and one of {', '.join(POSITION_KEYWORDS)}")
    return method(input_ids=ids, **{where[0]: positions}, stream=stream)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of the last position's logits, [B, 1] int64 on the host."""
    return logits[:, -1].argmax(-1, keepdim=True).cpu()
