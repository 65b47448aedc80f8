"""Generation over a loaded program whose ``prefill`` and ``decode`` methods share a KV cache.

    program = td.load("decoder.tdp")
    generator = Generator(program, graphs=True)
    result = generator.generate(prompt, new_tokens=16)   # prompt [B, T] int64; greedy
    result.tokens, result.decode_tokens_per_s, result.steps[0], result.memory
    generator.generate(prompt, 16, sampling=Sampling(temperature=0.7, top_p=0.9, seed=0), stop_tokens=[eos])

The methods take ``(input_ids [B, T] int64, input_pos [T] int64)`` and return logits ``[B, T, vocab]``
(``tritondelegate.models.KVCacheDecoder`` exported by ``export_prefill_decode``), or take them by keyword
as ``input_ids=`` and ``cache_position=`` (transformers' static-cache export recipe,
``convert_and_export_with_cache``). The cache is the
program's state: prefill writes it, each decode step reads and extends it. Only token ids and
positions go in and logits come out; the next token is picked from the last logits on the host: their
argmax, or drawn by a :class:`~tritondelegate.sampling.Sampling`. With ``stop_tokens``, a row that
picks one of them is done (it repeats that token while the other rows go on), and generation ends
when every row is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampling import Sampling, greedy


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
    stopped: list[bool] = field(default_factory=list)  # per row: whether it picked a stop token

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
            "stopped": self.stopped,
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

    def generate(self, prompt: torch.Tensor, new_tokens: int, keep_logits: bool = False, *,
                 sampling: Sampling | None = None, stop_tokens=()) -> Generation:
        """Prefill ``prompt`` [B, T] at positions 0..T-1, then up to ``new_tokens - 1`` decode steps:
        greedy, or drawn by ``sampling``; fewer when every row has picked one of ``stop_tokens``.

        The prompt length must be one prefill takes: the length it was exported with, or any length in
        its range when exported with a dynamic prompt length. ``keep_logits`` keeps each call's
        logits (prefill [B, T, V], then [B, 1, V] per step) in the result.
        """
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
        pick = greedy if sampling is None else sampling.pick
        batch, length = prompt.shape
        start = time.perf_counter()
        logits = _call(self.prefill, prompt, torch.arange(length), self.stream)
        prefill_s = time.perf_counter() - start
        kept = [logits] if keep_logits else None
        first = pick(logits)
        start = time.perf_counter()
        tokens, steps = self.decode_from(first, length, new_tokens - 1, kept, pick=pick, stop_tokens=stop_tokens)
        decode_s = time.perf_counter() - start
        stopped = torch.isin(tokens, _ids(stop_tokens)).any(1).tolist()
        return Generation(tokens, batch * length, prefill_s, decode_s, steps, self.program.memory(), kept, stopped)

    def decode_from(self, token: torch.Tensor, position: int, steps: int, kept: list | None = None, *,
                    pick=greedy, stop_tokens=()) -> tuple[torch.Tensor, list[StepStats]]:
        """Up to ``steps`` decode calls: ``token`` [B, 1] at ``position``, then each picked successor
        (``pick(logits)`` -> [B, 1]) at the next position, until every row has picked one of
        ``stop_tokens`` (a row that has repeats its stop token). Returns (``token`` and the new tokens
        [B, 1 + calls], per-call stats); appends each call's logits to ``kept`` when given."""
        stops = _ids(stop_tokens)
        tokens, stats, done = [token], [], torch.isin(token, stops)
        for i in range(steps):
            if done.all():
                break
            logits = _call(self.decode, tokens[-1], torch.tensor([position + i]), self.stream)
            stats.append(StepStats.of(self.decode))
            if kept is not None:
                kept.append(logits)
            picked = torch.where(done, tokens[-1], pick(logits))
            done |= torch.isin(picked, stops)
            tokens.append(picked)
        return torch.cat(tokens, dim=1), stats


def _ids(tokens) -> torch.Tensor:
    """Token ids (any iterable of ints, or a tensor) as a 1-D int64 tensor."""
    return torch.as_tensor(list(tokens) if not isinstance(tokens, torch.Tensor) else tokens,
                           dtype=torch.int64).reshape(-1)


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
