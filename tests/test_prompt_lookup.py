"""Prompt lookup decoding (``tritondelegate.lookup``, ``Generator.generate(..., lookup=...)``): tokens
drafted from the text so far, checked in one decode call; the tokens are greedy decoding's."""

from __future__ import annotations

import warnings

import pytest
import torch

import tritondelegate as td
from test_generate import RESIDENT, lower_tiny, tiny_static_cache_llama

POSITIONS = 40  # an 11-token prompt and 30 new tokens fill it


@pytest.fixture(scope="module")
def generator():
    """transformers' Llama (2 layers) exported as one ``forward`` of 1 to 8 tokens, a cache of 40."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = tiny_static_cache_llama(transformers, layers=2, positions=POSITIONS)
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=POSITIONS)
    seq = torch.export.Dim("seq", max=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = wrapper.export(input_ids=torch.zeros(1, 4, dtype=torch.long), cache_position=torch.arange(4),
                            dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}})
    program = td.lower({"forward": ep}, config=RESIDENT).load()
    return td.Generator(program, prefill="forward", decode="forward", max_seq_len=POSITIONS)


def _prompt():
    return torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(3))


class Recorder:
    """A loaded method that records the positions of each call."""

    def __init__(self, method):
        self.inner, self.calls = method, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs["cache_position"].tolist())
        return self.inner(*args, **kwargs)


@pytest.fixture(scope="module")
def plain(generator):
    """Plain greedy decoding of 30 tokens, with its logits: up to the cache's last position."""
    return generator.generate(_prompt(), 30, keep_logits=True)


def test_the_tokens_are_greedy_decodings_in_fewer_calls(generator, plain):
    generator.decode = recorder = Recorder(generator.decode)
    try:
        seen = []
        fast = generator.generate(_prompt(), 30, keep_logits=True, lookup=td.PromptLookup(num_tokens=4),
                                  on_token=seen.append)
    finally:
        generator.decode = recorder.inner
    assert fast.tokens.tolist() == plain.tokens.tolist()
    assert torch.cat(seen, dim=1).tolist() == fast.tokens.tolist()
    assert len(fast.steps) == len(recorder.calls) < len(plain.steps) == 29
    assert fast.drafted >= fast.accepted > 0 and fast.accepted == 29 - len(fast.steps)
    assert max(len(c) for c in recorder.calls) <= 5  # the last token and at most 4 drafted
    assert recorder.calls[0][0] == 11 and fast.next_position == plain.next_position == POSITIONS
    assert max(max(c) for c in recorder.calls) == POSITIONS - 1  # no draft passes the cache's end
    # the kept logits: each generated token's, as plain decoding's steps give them
    torch.testing.assert_close(torch.cat(fast.logits[1:], dim=1), torch.cat(plain.logits[1:], dim=1),
                               atol=1e-4, rtol=1e-4)
    assert fast.as_dict()["accepted"] == fast.accepted


def test_a_stop_token_ends_an_accepted_run(generator, plain):
    plain = plain.tokens[0].tolist()
    stop = plain[20]  # a token of the repeating part, where drafts are accepted
    expected = plain[:plain.index(stop) + 1]
    fast = generator.generate(_prompt(), 30, stop_tokens=[stop], lookup=td.PromptLookup(num_tokens=4))
    assert fast.tokens[0].tolist() == expected and fast.stopped == [True]


def test_what_prompt_lookup_refuses(generator):
    with pytest.raises(ValueError, match="it takes no sampling"):
        generator.generate(_prompt(), 4, sampling=td.Sampling(), lookup=td.PromptLookup())
    with pytest.raises(ValueError, match="generates one row .* the prompt has 2"):
        generator.generate(_prompt().repeat(2, 1), 4, lookup=td.PromptLookup())
    with pytest.raises(TypeError, match="lookup must be a td.PromptLookup, got int"):
        generator.generate(_prompt(), 4, lookup=4)
    one_token = td.Generator(lower_tiny(state_on_device=True).load())  # its decode takes 1 token
    with pytest.raises(ValueError, match="decode method 'decode' takes 1 token per call"):
        one_token.generate(_prompt()[:, :8] % 32, 4, lookup=td.PromptLookup())


def test_drafts():
    text = torch.tensor([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6])
    lookup = td.PromptLookup(num_tokens=3, max_ngram=2)
    assert lookup.draft(text).tolist() == [7, 8, 1]  # the earliest earlier [5, 6], then what followed it
    assert lookup.draft(text, limit=1).tolist() == [7]
    assert lookup.draft(text, limit=0).tolist() == []
    assert td.PromptLookup(num_tokens=9).draft(text).tolist() == [7, 8, 1, 5, 6, 9, 2, 5, 6]
    # the longest tail first: [9, 2, 5] occurs nowhere earlier, [2, 5] neither, [5] does
    assert td.PromptLookup(3, max_ngram=3).draft(torch.tensor([5, 4, 3, 9, 2, 5])).tolist() == [4, 3, 9]
    assert lookup.draft(torch.tensor([1, 2, 3])).tolist() == []  # no earlier occurrence
    assert lookup.draft(torch.tensor([4])).tolist() == []
    for bad in (dict(num_tokens=0), dict(max_ngram=0), dict(num_tokens=2.5), dict(max_ngram=True)):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            td.PromptLookup(**bad)
