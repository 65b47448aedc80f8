"""Prompt lookup: draft tokens for greedy generation from the text so far, verified in one call.

A decode step at batch 1 reads every weight to produce one token; a call of a few tokens reads them once
too. When the output repeats spans of its input (a summary quoting its source, code edited in place, a
chat turn restating a name), the tokens that followed the last few generated tokens' earlier
occurrence are a good guess for the next ones. :meth:`PromptLookup.draft` proposes them;
``Generator.generate(..., lookup=PromptLookup())`` runs the last token and the draft through the decode
method in one call and keeps each drafted token the model itself picks, plus the model's own next token:
the tokens are greedy generation's, in fewer calls. transformers calls it prompt lookup decoding
(``prompt_lookup_num_tokens``, ``max_matching_ngram_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptLookup:
    """``num_tokens``: the most tokens drafted per call (also limited by the decode method's length and
    the cache). ``max_ngram``: the longest tail of the text that is looked up; shorter tails are tried
    when it does not occur earlier."""

    num_tokens: int = 10
    max_ngram: int = 2

    def __post_init__(self):
        for name in ("num_tokens", "max_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PromptLookup {name} must be an integer >= 1, got {value!r}")

    def draft(self, text: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """Up to ``min(num_tokens, limit)`` tokens that followed the earliest earlier occurrence of the
        longest tail (at most ``max_ngram`` tokens) of ``text`` [L] int64 that occurs earlier with
        tokens after it; empty when none does."""
        most = self.num_tokens if limit is None else min(self.num_tokens, limit)
        length = text.numel()
        if most < 1:
            return text[:0]
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            windows = text[:length - 1].unfold(0, n, 1)  # every n-gram that has a token after it
            hits = (windows == text[length - n:]).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[0]) + n
                return text[start:min(start + most, length)]
        return text[:0]
