"""Generation over a loaded program whose ``prefill`` and ``decode`` methods share a KV cache.

    program = td.load("decoder.tdp")
    generator = Generator(program, graphs=True)
    result = generator.generate(prompt, new_tokens=16)   # prompt [B, T] int64; greedy
    result.tokens, result.decode_tokens_per_s, result.steps[0], result.memory
    generator.generate(prompt, 16, sampling=Sampling(temperature=0.7, top_p=0.9, seed=0), stop_tokens=[eos])
    generator.generate(prompt, 16, lookup=PromptLookup())  # greedy's tokens, drafted from the text: fewer calls

The methods take ``(input_ids [B, T] int64, input_pos [T] int64)`` and return logits ``[B, T, vocab]``
(``tritondelegate.models.KVCacheDecoder`` exported by ``export_prefill_decode``), or take them by keyword
as ``input_ids=`` and ``cache_position=`` (transformers' static-cache export recipe,
``convert_and_export_with_cache``). The cache is the
program's state: prefill writes it, each decode step reads and extends it. Only token ids and
positions go in and logits come out; the next token is picked from the last logits on the host: their
argmax, or drawn by a :class:`~tritondelegate.sampling.Sampling`. With ``stop_tokens``, a row that
picks one of them is done (it repeats that token while the other rows go on), and generation ends
when every row is done. With ``lookup`` (``lookup.PromptLookup``, greedy, one row, a decode method of
several tokens) each decode call also checks tokens drafted from the text so far and keeps those the
model picks itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .lookup import PromptLookup
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
    next_position: int = 0  # the position after the last token a call read: where a next turn starts
    drafted: int = 0  # with prompt lookup: tokens drafted, and of them the ones the model picked too
    accepted: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Generated tokens per second of the decode phase (all batch rows); None without a step."""
        return self.tokens.shape[0] * (self.tokens.shape[1] - 1) / self.decode_s if self.steps else None

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
            "next_position": self.next_position,
            "drafted": self.drafted,
            "accepted": self.accepted,
        }


class Generator:
    """The prefill and decode methods of one loaded program, loaded once.

    ``graphs=True`` loads decode with CUDA graphs (each delegate replayed as one graph from its third
    call). ``stream``: every copy and launch of both methods runs on it. Calls are sequential; the
    cache persists between :meth:`generate` calls until ``program.reset_state()``.

    ``max_seq_len``: the cache's positions, which a prompt and the tokens after it must fit in; by
    default the program's ``get_max_seq_len`` constant method, else unchecked (positions past the cache
    write nothing, so their tokens would be garbage). The program's ``get_eos_ids`` are the default
    ``stop_tokens``.
    """

    def __init__(self, program, *, graphs: bool = False, stream=None,
                 prefill: str = "prefill", decode: str = "decode", max_seq_len: int | None = None):
        self.program = program
        self.stream = stream
        self.prefill = program.load_method(prefill, stream=stream)
        self.decode = program.load_method(decode, stream=stream, graphs=graphs)
        facts = program.constant_methods
        self.max_seq_len = facts.get("get_max_seq_len") if max_seq_len is None else max_seq_len
        self.eos_ids = tuple(facts.get("get_eos_ids", ()))
        self.prompt_lengths = _prompt_lengths(self.prefill)  # (min, max) tokens of one prefill call

    def generate(self, prompt: torch.Tensor, new_tokens: int, keep_logits: bool = False, *,
                 sampling: Sampling | None = None, stop_tokens=None, start: int = 0,
                 on_token: Callable[[torch.Tensor], None] | None = None,
                 lookup: PromptLookup | None = None) -> Generation:
        """Prefill ``prompt`` [B, T] at positions ``start``..``start + T - 1``, then up to
        ``new_tokens - 1`` decode steps: greedy, or drawn by ``sampling``; fewer when every row has
        picked one of ``stop_tokens`` (default: the program's ``get_eos_ids``; ``()``: none).

        A prompt longer than one prefill call takes (its exported length, or the top of its dynamic
        range) is prefilled in calls of that many tokens. ``start`` > 0 continues what the cache holds
        at positions below it (a conversation's next turn: ``start`` = the previous result's
        ``next_position``, the prompt beginning with its last token, which no call has read yet).
        ``on_token`` is called with each row's new token [B, 1] as it is picked (streaming).
        ``keep_logits`` keeps each call's logits in the result (the prompt's, then [B, 1, V] per step).
        ``lookup``: prompt lookup decoding (greedy, one row; the decode method must take several tokens
        and return every position's logits): each decode call runs the last token and up to
        ``lookup.num_tokens`` tokens drafted from the prompt and the tokens so far, and keeps the drafted
        tokens greedy decoding picks, then the model's next one ([1, kept, V] logits per call).
        """
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype != torch.int64:
            got = f"{prompt.dtype} {list(prompt.shape)}" if isinstance(prompt, torch.Tensor) else type(prompt).__name__
            raise ValueError(f"the prompt must be token ids [batch, length] as int64, got {got}")
        pick = greedy if sampling is None else _sampler(sampling, prompt)
        stop_tokens = self.eos_ids if stop_tokens is None else stop_tokens
        batch, length = prompt.shape
        if lookup is not None:
            self._check_lookup(lookup, sampling, batch)
        self._check_room(start, length, new_tokens)
        chunks = self._chunks(length)
        begin = time.perf_counter()
        logits = [_call(self.prefill, prompt[:, a:b], torch.arange(start + a, start + b), self.stream)
                  for a, b in chunks]
        prefill_s = time.perf_counter() - begin
        kept = [_prompt_logits(logits, chunks)] if keep_logits else None
        first = pick(logits[-1])
        if on_token is not None:
            on_token(first)
        begin = time.perf_counter()
        drafts = (0, 0)
        if lookup is None:
            tokens, steps = self.decode_from(first, start + length, new_tokens - 1, kept, pick=pick,
                                             stop_tokens=stop_tokens, on_token=on_token)
        else:
            tokens, steps, drafts = self.lookup_from(first, start + length, new_tokens - 1, prompt, lookup, kept,
                                                     stop_tokens=stop_tokens, on_token=on_token)
        decode_s = time.perf_counter() - begin
        stopped = torch.isin(tokens, _ids(stop_tokens)).any(1).tolist()
        return Generation(tokens, batch * length, prefill_s, decode_s, steps, self.program.memory(), kept, stopped,
                          start + length + tokens.shape[1] - 1, *drafts)

    def decode_from(self, token: torch.Tensor, position: int, steps: int, kept: list | None = None, *,
                    pick=greedy, stop_tokens=(), on_token=None) -> tuple[torch.Tensor, list[StepStats]]:
        """Up to ``steps`` decode calls: ``token`` [B, 1] at ``position``, then each picked successor
        (``pick(logits)`` -> [B, 1]) at the next position, until every row has picked one of
        ``stop_tokens`` (a row that has repeats its stop token). Returns (``token`` and the new tokens
        [B, 1 + calls], per-call stats); appends each call's logits to ``kept`` when given and passes
        each picked [B, 1] to ``on_token``."""
        if steps > 0:
            self._check_room(position, 1, steps)
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
            if on_token is not None:
                on_token(picked)
        return torch.cat(tokens, dim=1), stats

    def lookup_from(self, token: torch.Tensor, position: int, steps: int, text: torch.Tensor,
                    lookup: PromptLookup, kept: list | None = None, *, stop_tokens=(), on_token=None
                    ) -> tuple[torch.Tensor, list[StepStats], tuple[int, int]]:
        """Up to ``steps`` new tokens after ``token`` [1, 1] at ``position``, greedy, in calls that each
        run the last token and a draft (``lookup.draft`` of ``text`` [1, L], the tokens before ``token``,
        and those generated) and keep the drafted tokens the model picks, then its next one; until a stop
        token. Returns (``token`` and the new tokens [1, 1 + n], per-call stats, (drafted, accepted))."""
        if steps > 0:
            self._check_room(position, 1, steps)
        most, stops = _prompt_lengths(self.decode)[1] - 1, _ids(stop_tokens)
        text, tokens, stats, drafted, accepted = torch.cat([text[0], token[0]]), [token], [], 0, 0
        while len(tokens) <= steps and not torch.isin(tokens[-1], stops).any():
            draft = lookup.draft(text, min(most, steps - len(tokens)))
            ids = torch.cat([tokens[-1][0], draft])[None]
            logits = _call(self.decode, ids, torch.arange(position, position + ids.shape[1]), self.stream)
            stats.append(StepStats.of(self.decode))
            new = _kept_tokens(logits, draft, stops)
            drafted, accepted = drafted + draft.numel(), accepted + new.numel() - 1
            if kept is not None:
                kept.append(logits[:, :new.numel()])
            for t in new.view(-1, 1, 1):
                tokens.append(t)
                if on_token is not None:
                    on_token(t)
            text, position = torch.cat([text, new]), position + new.numel()
        return torch.cat(tokens, dim=1), stats, (drafted, accepted)

    def _check_lookup(self, lookup, sampling, batch: int) -> None:
        """That prompt lookup can run: a PromptLookup, greedy, one row, a decode method of several tokens."""
        if not isinstance(lookup, PromptLookup):
            raise TypeError(f"lookup must be a td.PromptLookup, got {type(lookup).__name__}")
        if sampling is not None:
            raise ValueError("prompt lookup keeps the tokens greedy decoding picks; it takes no sampling")
        if batch != 1:
            raise ValueError(f"prompt lookup generates one row (rows would keep different numbers of drafted "
                             f"tokens and need different positions); the prompt has {batch}")
        if _prompt_lengths(self.decode)[1] < 2:
            raise ValueError(f"decode method {self.decode.name!r} takes 1 token per call; prompt lookup needs "
                             "one that takes several (a dynamic length, as transformers' "
                             "TorchExportableModuleForDecoderOnlyLM.export(..., dynamic_shapes=...) gives)")

    def _check_room(self, start: int, length: int, new_tokens: int) -> None:
        """That ``length`` tokens at ``start`` and the ``new_tokens - 1`` calls after them fit the cache."""
        if start < 0:
            raise ValueError(f"start must be a position >= 0, got {start}")
        needed = start + length + max(new_tokens - 1, 0)
        if self.max_seq_len is not None and needed > self.max_seq_len:
            raise ValueError(f"{length} token(s) at position {start} and {new_tokens} new token(s) need "
                             f"{needed} cache positions; the cache has {self.max_seq_len} (get_max_seq_len)")

    def _chunks(self, length: int) -> list[tuple[int, int]]:
        """[a, b) token ranges of the prefill calls a prompt of ``length`` tokens takes."""
        low, high = self.prompt_lengths
        chunks = [(a, min(a + high, length)) for a in range(0, length, high)]
        last = chunks[-1][1] - chunks[-1][0] if chunks else 0
        if not chunks or last < low:
            takes = f"{low} to {high} tokens" if low < high else f"{high} tokens"
            raise ValueError(f"prefill method {self.prefill.name!r} takes {takes} per call; a {length}-token "
                             f"prompt splits into calls of {high} with {last} left over")
        return chunks


def _kept_tokens(logits: torch.Tensor, draft: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """The tokens a call of the last token and ``draft`` gives, from its logits [1, 1 + k, V]: greedy's
    pick after each position while the draft agrees with it, then the model's next pick; cut after a
    stop token."""
    if logits.shape[1] != draft.numel() + 1:
        raise ValueError(f"the decode method returned logits for {logits.shape[1]} of {draft.numel() + 1} "
                         "positions; prompt lookup needs every position's")
    picks = logits[0].argmax(-1).cpu()  # greedy's pick after each position, in one transfer
    agree = int((picks[:-1] == draft).to(torch.int64).cumprod(0).sum())  # the draft's agreeing prefix
    new = picks[:agree + 1]
    hit = torch.isin(new, stops).nonzero().flatten()
    return new[:int(hit[0]) + 1] if hit.numel() else new


def _sampler(sampling: Sampling, prompt: torch.Tensor):
    """``sampling.pick`` as ``pick(logits)``; with a repetition penalty it also sees the prompt and the
    tokens picked so far in this generation."""
    if sampling.repetition_penalty == 1:
        return sampling.pick
    seen = [prompt]

    def pick(logits):
        token = sampling.pick(logits, torch.cat(seen, dim=1))
        seen.append(token)
        return token

    return pick


def _prompt_lengths(method) -> tuple[int, int]:
    """(min, max) prompt tokens one call of ``method`` takes: its ids' dynamic range, or their length."""
    ids = method.input_keywords.index("input_ids") if "input_ids" in method.input_keywords else 0
    program = method.method
    for symbol in program.symbols:
        if symbol.input == ids and symbol.dim == 1:
            return symbol.min, symbol.max
    length = program.values[program.inputs[ids]].shape[1]
    return length, length


def _prompt_logits(logits: list[torch.Tensor], chunks: list[tuple[int, int]]) -> torch.Tensor:
    """The prompt's logits from its prefill calls': every position's [B, T, V] when each call returned
    all of its positions, else (a program that returns the last position's only) the last call's."""
    if all(out.shape[1] == b - a for out, (a, b) in zip(logits, chunks)):
        return torch.cat(logits, dim=1)
    return logits[-1]


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
