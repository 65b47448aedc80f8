"""Picking the next token from a step's logits, on the host: greedy, or sampled.

    Sampling(temperature=0.8, top_k=50, top_p=0.95, seed=0).pick(logits)   # [B, 1] int64

Sampling follows the usual order: a token already in the sequence (``seen``) has its logit divided by
``repetition_penalty`` (multiplied when negative), the logits are divided by the temperature, then only
the ``top_k`` most likely tokens are kept, then only the smallest set of them whose probabilities add
up to ``top_p`` (the most likely token always stays), then only those at least ``min_p`` times as
likely as the most likely one, and one token is drawn from what is left. ``seed`` makes the draws
repeatable (a generator of its own, so nothing else's random state is read or moved).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of the last position's logits [B, T, V], [B, 1] int64 on the host."""
    return logits[:, -1].argmax(-1, keepdim=True).cpu()


@dataclass
class Sampling:
    """Sampled decoding; ``temperature`` > 0, ``top_k`` >= 1 or None (all), ``top_p`` in (0, 1],
    ``min_p`` in [0, 1), ``repetition_penalty`` > 0 (1: none; ``top_k=1`` with a penalty is greedy
    decoding with it)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    _generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (greedy decoding: sampling=None)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self._generator = torch.Generator()
        if self.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(self.seed)

    def pick(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row drawn from the last position's logits [B, T, V]: [B, 1] int64 on the host.
        ``seen`` [B, S]: the tokens already in each row's sequence, for the repetition penalty."""
        probs = torch.softmax(self.filtered(logits[:, -1].float().cpu(), seen), dim=-1)
        return torch.multinomial(probs, 1, generator=self._generator)

    def filtered(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` [B, V] with the repetition penalty on ``seen``'s tokens, divided by the temperature,
        -inf outside the top-k, the top-p nucleus and the min-p floor."""
        if seen is not None and self.repetition_penalty != 1:
            seen = seen.to(logits.device, torch.int64)
            scores = logits.gather(-1, seen)
            scores = torch.where(scores < 0, scores * self.repetition_penalty, scores / self.repetition_penalty)
            logits = logits.scatter(-1, seen, scores)
        logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            ordered, order = torch.sort(logits, dim=-1, descending=True)
            before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)
            drop = before >= self.top_p  # the mass before a token already reaches top_p (never the first)
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        if self.min_p > 0:  # below min_p times the most likely token's probability
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), float("-inf"))
        return logits
