"""LLM generation with a KV cache: prefill and decode as two methods of one program sharing its state.

A tiny KVCacheDecoder (dim 32, 2 layers, 32 positions) keeps this file well under two minutes on the
simulated device. Every generated token is compared with eager PyTorch's greedy generation.
"""

import json
import subprocess
import sys
import warnings

import pytest
import torch

import tritondelegate as td
from tritondelegate import cli
from tritondelegate.decompose import decompose
from tritondelegate.generate import Generator
from tritondelegate.kernels.traffic import method_traffic
from tritondelegate.models import (
    LlamaStyleDecoder,
    export_prefill_decode,
    generate_eager,
    hf_llama_static_cache,
    kv_cache_decoder,
    llm_constant_methods,
)
from tritondelegate.passes.fold_repeat_kv import fold_repeat_kv

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=32)
PROMPT_LEN = 8
CACHE_BYTES = 2 * TINY["n_layers"] * TINY["n_kv_heads"] * TINY["max_seq_len"] * (TINY["dim"] // TINY["n_heads"]) * 4


RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def tiny_model():
    return kv_cache_decoder(seed=0, **TINY)


def prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def lower_tiny(state_on_device: bool):
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(
        skip_h2d_for_constants=True, state_on_device=state_on_device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)  # state_on_device=False copies the cache
        return td.lower(export_prefill_decode(tiny_model(), PROMPT_LEN),
                        partitioner=td.TritonPartitioner(device="cuda:0"), config=config)


@pytest.fixture(scope="module")
def program_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("generate") / "decoder.tdp"
    lower_tiny(state_on_device=True).save(path)
    return path


def assert_logits_close(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# --- the model, in eager and as exported programs (no device) ------------------------------------
def test_prefill_matches_the_decoder_without_cache_and_eager_generation_matches_recompute():
    model = tiny_model()
    torch.manual_seed(0)
    plain = LlamaStyleDecoder(model.cfg).eval()  # the same weights (same seed), no cache
    ids = prompt(1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(PROMPT_LEN)), plain(ids), rtol=1e-5, atol=1e-5)
        tokens, logits = generate_eager(model, ids, 6)
        seq = ids
        for _ in range(6):  # greedy without a cache: the whole sequence every step
            seq = torch.cat([seq, plain(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert tokens.tolist() == seq[:, PROMPT_LEN:].tolist()
    assert [tuple(x.shape) for x in logits] == [(1, PROMPT_LEN, 64)] + [(1, 1, 64)] * 5


def test_exports_share_cache_names_and_every_compute_node_is_claimed():
    model = tiny_model()
    programs = export_prefill_decode(model, PROMPT_LEN)
    caches = sorted(model.cache_buffers())
    assert len(caches) == 2 * TINY["n_layers"]
    partitioner = td.TritonPartitioner()
    for name, ep in programs.items():
        ep = decompose(ep, keep=partitioner.ops_to_not_decompose(ep))
        assert sorted(ep.graph_signature.buffers_to_mutate.values()) == caches, name
        fold_repeat_kv(ep.graph_module)
        result = partitioner.partition(ep)
        assert result.refused == {}, f"{name}: nodes left on the host: {result.refused}"


def test_transformers_static_cache_reference_gives_the_same_logits():
    model = tiny_model()
    wrapper = hf_llama_static_cache(model)
    ids = prompt(1)
    _, expected = generate_eager(model, ids, 3)
    tokens = [expected[0][:, -1].argmax(-1, keepdim=True)]
    with torch.no_grad():
        got = [wrapper(input_ids=ids, cache_position=torch.arange(PROMPT_LEN))]
        for i in range(2):
            got.append(wrapper(input_ids=tokens[-1], cache_position=torch.tensor([PROMPT_LEN + i])))
            tokens.append(got[-1][:, -1].argmax(-1, keepdim=True))
    assert_logits_close(got, expected)


def test_prompt_length_is_checked():
    with pytest.raises(ValueError, match="prompt_len"):
        export_prefill_decode(tiny_model(), TINY["max_seq_len"])


# --- the CLI ---------------------------------------------------------------------------------------
def test_generate_cli_json():
    proc = subprocess.run([sys.executable, "-m", "tritondelegate", "generate", "--json", "--tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["device"] in ("cuda", "simulated")
    assert r["tokens"] == r["eager_tokens"] and len(r["tokens"]) == 4 and r["tokens_match"]
    assert r["max_abs_logit_error"] < 1e-3
    assert len(r["decode_steps"]) == 3
    for step in r["decode_steps"]:  # the token id and its position in, the logits out: nothing else
        assert step["h2d_bytes"] == 1 * 8 + 8 == r["expected_step_h2d_bytes"]
        assert step["d2h_bytes"] == r["config"]["vocab_size"] * 4 == r["expected_step_d2h_bytes"]
        assert step["launches"] > 0
    for name, m in r["methods"].items():
        assert m["nodes_delegated"] == m["nodes_total"], (name, m["host_nodes"])
    (memory,) = r["memory"].values()
    assert memory["state"] == r["cache_bytes"]
    assert memory["total"] == memory["constants"] + memory["state"] + memory["arenas"]
    assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0


def test_generate_cli_quantized_json():
    # 4 bits with zero points per 16 inputs, the embedding table too: the program keeps the packed
    # integers (its constants far below the float demo's) and gives the quantized model's eager tokens
    proc = subprocess.run([sys.executable, "-m", "tritondelegate", "generate", "--json", "--tokens", "3",
                           "--quantize", "uint4", "--group-size", "16", "--quantize-embeddings"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["quantize"] == "uint4, groups of 16, embeddings too"
    assert r["tokens"] == r["eager_tokens"] and r["tokens_match"] and r["max_abs_logit_error"] < 1e-3
    for name, m in r["methods"].items():
        assert m["nodes_delegated"] == m["nodes_total"], (name, m["host_nodes"])
    (memory,) = r["memory"].values()
    model = kv_cache_decoder(**r["config"])  # fp32: 4 bytes per weight, where the program holds about 1
    assert memory["constants"] < 0.3 * sum(p.numel() * p.element_size() for p in model.parameters())


def test_generate_cli_prompt_lookup_json():
    """``--lookup 6``: decode calls of the 'verify' method run the last token and a draft from the text so
    far; the tokens are greedy decoding's (eager's), in one call fewer per drafted token kept."""
    proc = subprocess.run([sys.executable, "-m", "tritondelegate", "generate", "--json", "--tokens", "50",
                           "--lookup", "6"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["tokens"] == r["eager_tokens"] and r["tokens_match"] and r["max_abs_logit_error"] < 1e-3
    look = r["lookup"]
    assert look["num_tokens"] == 6 and 0 < look["accepted"] <= look["drafted"]
    assert len(r["decode_steps"]) == 49 - look["accepted"]  # each call: its last token's successor, then those kept
    assert set(r["methods"]) == {"prefill", "verify"}
    assert max(step["h2d_bytes"] for step in r["decode_steps"]) > 16  # some calls carried a draft


# --- a loaded program: state shared by prefill and decode, kept per load ---------------------------
def test_generation_matches_eager_with_the_cache_on_the_device(program_file):
    program = td.load(program_file)
    result = Generator(program).generate(prompt(1), 4, keep_logits=True)
    tokens, logits = generate_eager(tiny_model(), prompt(1), 4)
    assert result.tokens.tolist() == tokens.tolist()
    assert_logits_close(result.logits, logits)
    for step in result.steps:
        assert (step.h2d_bytes, step.d2h_bytes) == (8 + 8, TINY["vocab_size"] * 4)
    (memory,) = result.memory.values()
    assert memory["state"] == CACHE_BYTES
    # Each weight once for both methods (plus at most the alignment of each slot).
    weights = sum(p.numel() * p.element_size() for p in tiny_model().parameters())
    assert weights <= memory["constants"] < 2 * weights
    for method in program.program.methods:  # each layer's k and v cache writes in its attention launch
        kernels = [l.kernel for d in method.delegates for l in d.plan.launches]
        assert kernels.count("attention_append") == TINY["n_layers"] and "scatter" not in kernels


def test_reset_state_restores_the_initial_cache(program_file):
    program = td.load(program_file)
    generator = Generator(program)
    first = generator.generate(prompt(1), 3, keep_logits=True)
    token, position = first.tokens[:, :1], torch.tensor([PROMPT_LEN])
    stale = generator.decode(token, position)  # attends over prompt 1's keys and values
    program.reset_state()
    empty = generator.decode(token, position)  # attends over zeros and its own entry only
    with torch.no_grad():
        expected = tiny_model()(token, position)  # a fresh model: an all-zero cache
    torch.testing.assert_close(empty, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(empty, stale, rtol=1e-3, atol=1e-3)
    program.reset_state()
    again = generator.generate(prompt(1), 3, keep_logits=True)  # the same prompt, the same logits
    assert again.tokens.tolist() == first.tokens.tolist()
    for a, b in zip(again.logits, first.logits):
        assert torch.equal(a, b)


def test_a_second_prompt_after_the_first_gives_eagers_tokens(program_file):
    generator = Generator(td.load(program_file))
    model = tiny_model()
    for ids in (prompt(1), prompt(2)):  # no reset between them, in both
        result = generator.generate(ids, 4, keep_logits=True)
        tokens, logits = generate_eager(model, ids, 4, reset=False)
        assert result.tokens.tolist() == tokens.tolist()
        assert_logits_close(result.logits, logits)


def test_two_loads_of_one_file_keep_separate_caches(program_file):
    a, b = Generator(td.load(program_file)), Generator(td.load(program_file))
    first = a.prefill(prompt(1), torch.arange(PROMPT_LEN))[:, -1].argmax(-1, keepdim=True)
    b.generate(prompt(2), 3)  # writes b's cache at the same positions
    tokens, _ = a.decode_from(first, PROMPT_LEN, 3)  # a's cache still holds prompt 1
    expected, _ = generate_eager(tiny_model(), prompt(1), 4)
    assert tokens.tolist() == expected.tolist()


def test_state_on_the_host_gives_the_same_tokens_but_copies_the_cache_every_step(tmp_path):
    path = tmp_path / "host_state.tdp"
    lower_tiny(state_on_device=False).save(path)
    result = Generator(td.load(path)).generate(prompt(1), 3)
    expected, _ = generate_eager(tiny_model(), prompt(1), 3)
    assert result.tokens.tolist() == expected.tolist()
    for step in result.steps:
        assert step.h2d_bytes > CACHE_BYTES
        assert step.d2h_bytes > CACHE_BYTES


def test_graphs_give_the_same_tokens(program_file):
    result = Generator(td.load(program_file), graphs=True).generate(prompt(1), 5)
    expected, _ = generate_eager(tiny_model(), prompt(1), 5)
    assert result.tokens.tolist() == expected.tolist()
    assert result.steps[-1].graph_replays > 0  # recorded on the second call, replayed from the third
    assert (result.steps[-1].h2d_bytes, result.steps[-1].d2h_bytes) == (8 + 8, TINY["vocab_size"] * 4)


@pytest.fixture(scope="module")
def batch_of_two():
    """The tiny decoder for max_batch=2, lowered."""
    model = kv_cache_decoder(seed=0, max_batch=2, **TINY)
    return td.lower(export_prefill_decode(model, PROMPT_LEN), partitioner=td.TritonPartitioner(device="cuda:0"),
                    config=td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True)))


def test_a_batch_of_two_prompts_gives_eagers_tokens(batch_of_two):
    """max_batch=2: two prompts side by side share positions; the rotary tables and the mask computed
    inside their launches serve both rows."""
    prompts = torch.cat([prompt(1), prompt(2)])
    result = Generator(batch_of_two.load()).generate(prompts, 4, keep_logits=True)
    tokens, logits = generate_eager(kv_cache_decoder(seed=0, max_batch=2, **TINY), prompts, 4)
    assert result.tokens.tolist() == tokens.tolist()
    assert_logits_close(result.logits, logits)


@pytest.mark.parametrize("dynamic", [False, True])
def test_last_logits_prefill_returns_the_next_tokens_logits_only(dynamic):
    """export_prefill_decode(last_logits=True): prefill's LM head reads one row per sequence (the last
    prompt position's) and returns [B, 1, vocab]; tokens and those logits are eager's."""
    model = kv_cache_decoder(seed=0, max_batch=2, **TINY)
    config = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
    bound = 12 if dynamic else None
    full = td.lower(export_prefill_decode(model, PROMPT_LEN, max_prompt_len=bound), config=config)
    last = td.lower(export_prefill_decode(model, PROMPT_LEN, max_prompt_len=bound, last_logits=True), config=config)
    assert model.logits_to_keep == 0  # restored after the export
    traffic = {name: method_traffic(p.program.methods[0])["bytes"] for name, p in (("full", full), ("last", last))}
    assert traffic["last"] < traffic["full"]
    prompts = torch.cat([prompt(1), prompt(2)])
    for length in ([PROMPT_LEN, 5, 12] if dynamic else [PROMPT_LEN]):
        generator = Generator(last.load())
        result = generator.generate(prompts[:, :length], 3, keep_logits=True)
        tokens, logits = generate_eager(model, prompts[:, :length], 3)
        assert result.tokens.tolist() == tokens.tolist()
        assert tuple(result.logits[0].shape) == (2, 1, TINY["vocab_size"])
        assert_logits_close(result.logits, [logits[0][:, -1:], *logits[1:]])
        assert generator.prefill.stats.call_d2h_bytes == 2 * TINY["vocab_size"] * 4


def tiny_static_cache_llama(transformers, layers: int, positions: int):
    """transformers' Llama (hidden 32, vocab 64, random weights, seed 0), set up for static-cache generation."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.cache_implementation = "static"
    return model


def test_generator_runs_a_transformers_static_cache_program_by_its_keywords():
    """transformers' export recipe exports prefill and decode with ``input_ids=`` and
    ``cache_position=``: the generator passes them by those names, and a positional call is refused
    with the keywords named."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.executorch import convert_and_export_with_cache

    model = tiny_static_cache_llama(transformers, layers=1, positions=16)
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 16}
    ids = prompt(3)[:, :5]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = {"prefill": convert_and_export_with_cache(model, ids, torch.arange(5)),
               "decode": convert_and_export_with_cache(model, ids[:, :1], torch.tensor([5]))}
    wrapper = transformers.integrations.executorch.TorchExportableModuleWithStaticCache(model)
    with torch.no_grad():
        expected = [wrapper(input_ids=ids, cache_position=torch.arange(5))[:, -1].argmax(-1, keepdim=True)]
        for i in range(3):
            logits = wrapper(input_ids=expected[-1], cache_position=torch.tensor([5 + i]))
            expected.append(logits[:, -1].argmax(-1, keepdim=True))
    program = td.lower(eps).load()
    generator = Generator(program)
    assert generator.decode.input_keywords == ("input_ids", "cache_position")
    torch.testing.assert_close(generator.generate(ids, 4).tokens, torch.cat(expected, dim=1))
    with pytest.raises(td.InputError, match=r"0 positional, keywords input_ids, cache_position\); got 2 leaf"):
        generator.decode(ids[:, :1], torch.tensor([9]))


# --- sampling and stop tokens ---------------------------------------------------------------------

def test_sampling_draws_repeatably_and_from_eagers_distribution(program_file):
    from tritondelegate.sampling import Sampling

    program = td.load(program_file)
    generator = Generator(program)
    runs = []
    for _ in range(2):
        program.reset_state()
        runs.append(generator.generate(prompt(1), 4, keep_logits=True,
                                       sampling=Sampling(temperature=0.9, top_k=5, seed=3)))
    torch.testing.assert_close(runs[0].tokens, runs[1].tokens)  # the same seed, the same tokens
    # each token was drawn from its step's logits: replaying the draws on those logits gives it
    replay = Sampling(temperature=0.9, top_k=5, seed=3)
    drawn = torch.cat([replay.pick(logits) for logits in runs[0].logits], dim=1)
    torch.testing.assert_close(runs[0].tokens, drawn)
    for logits, token in zip(runs[0].logits, runs[0].tokens[0]):
        assert token in torch.topk(logits[0, -1], 5).indices  # within the top 5


def test_sampling_keeps_the_top_k_and_the_nucleus_only():
    from tritondelegate.sampling import Sampling

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(Sampling(top_k=2).filtered(logits)[0, 2:]).all()
    nucleus = Sampling(top_p=0.8).filtered(logits)[0]  # 0.5 + 0.3 reach 0.8: two tokens
    assert torch.isfinite(nucleus[:2]).all() and torch.isinf(nucleus[2:]).all()
    assert torch.isfinite(Sampling(top_p=0.1).filtered(logits)[0, 0])  # the most likely always stays
    picks = Sampling(top_p=0.8, seed=0).pick(logits[:, None].expand(1, 1, 4).repeat(64, 1, 1))
    assert set(picks.flatten().tolist()) == {0, 1}
    floor = Sampling(min_p=0.2).filtered(logits)[0]  # 0.2 x 0.5: 0.05 goes, 0.15 stays
    assert torch.isfinite(floor[:3]).all() and torch.isinf(floor[3])
    penalized = Sampling(repetition_penalty=2.0).filtered(torch.tensor([[2.0, -1.0, 1.0]]), torch.tensor([[0, 1]]))
    torch.testing.assert_close(penalized, torch.tensor([[1.0, -2.0, 1.0]]))
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=1.5)
    with pytest.raises(ValueError, match="min_p"):
        Sampling(min_p=1.0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        Sampling(repetition_penalty=0)


def test_a_row_stops_at_its_stop_token_and_generation_ends_when_all_have(batch_of_two):
    program = batch_of_two.load()
    generator = Generator(program)
    prompts = torch.cat([prompt(1), prompt(2)])
    full = generator.generate(prompts, 6)
    stops = {int(full.tokens[0, 2]), int(full.tokens[1, 1])}  # row 0 stops by its 3rd token, row 1 its 2nd
    first = [min(i for i, t in enumerate(row.tolist()) if t in stops) for row in full.tokens]
    program.reset_state()
    result = generator.generate(prompts, 6, stop_tokens=stops)
    assert result.stopped == [True, True]
    for row, at in enumerate(first):  # the same tokens up to its stop token, then that token repeated
        torch.testing.assert_close(result.tokens[row, :at + 1], full.tokens[row, :at + 1])
        assert (result.tokens[row, at:] == full.tokens[row, at]).all()
    assert result.tokens.shape[1] == max(first) + 1 < 6  # no decode call once every row has stopped
    assert len(result.steps) == max(first)
    program.reset_state()
    assert generator.generate(prompts, 6, stop_tokens=[]).stopped == [False, False]


@pytest.fixture(scope="module")
def chunked():
    """The tiny decoder with a prefill of 1 to 6 tokens, lowered with its constant methods."""
    model = tiny_model()
    return td.lower(export_prefill_decode(model, 4, max_prompt_len=6),
                    partitioner=td.TritonPartitioner(device="cuda:0"), config=RESIDENT,
                    constant_methods=llm_constant_methods(model))


def long_prompt(length: int = 15) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (1, length), generator=torch.Generator().manual_seed(7))


def test_constant_methods_are_stored_in_the_file_and_a_bad_one_is_refused(chunked, tmp_path, capsys):
    expected = {"get_max_seq_len": TINY["max_seq_len"], "get_max_batch_size": 1, "get_vocab_size": TINY["vocab_size"],
                "use_kv_cache": True}
    assert chunked.constant_methods == expected
    chunked.save(tmp_path / "lm.tdp")
    assert td.load(tmp_path / "lm.tdp").constant_methods == expected
    assert cli.main(["inspect", str(tmp_path / "lm.tdp")]) == 0
    assert "constant methods: get_max_seq_len = 32, get_max_batch_size = 1," in capsys.readouterr().out
    ep = export_prefill_decode(tiny_model(), 4)["decode"]  # refused before lowering: no warnings
    for bad, error in [({"decode": 1}, "name of one of the program's methods"), ({"max len": 1}, "not an identifier"),
                       ({"eos": {"id": 2}}, "holds a dict"), ({"scale": float("inf")}, "JSON cannot store")]:
        with pytest.raises((TypeError, ValueError), match=error):
            td.lower({"decode": ep}, constant_methods=bad)
    chunked.program.constant_methods[0].value = "[1, "  # a damaged file names the entry
    try:
        chunked.save(tmp_path / "bad.tdp")
    finally:
        chunked.program.constant_methods[0].value = str(TINY["max_seq_len"])
    with pytest.raises(td.ProgramError, match="constant method 0 .'get_max_seq_len'.: its value is not JSON"):
        td.load(tmp_path / "bad.tdp")


def test_a_long_prompt_is_prefilled_in_calls_and_its_tokens_stream(chunked):
    """A 15-token prompt through a prefill of at most 6 tokens: calls of 6, 6 and 3 at their positions;
    the tokens are eager's, ``on_token`` sees each as it is picked, the kept logits are the prompt's."""
    generator = Generator(chunked.load())
    assert generator.prompt_lengths == (1, 6) and generator.max_seq_len == TINY["max_seq_len"]
    seen = []
    result = generator.generate(long_prompt(), 5, keep_logits=True, on_token=seen.append)
    tokens, logits = generate_eager(tiny_model(), long_prompt(), 5)
    assert result.tokens.tolist() == tokens.tolist() == torch.cat(seen, dim=1).tolist()
    assert_logits_close(result.logits, logits)
    assert result.next_position == 15 + 4  # the last token is picked, not yet read


def test_the_next_turn_continues_the_cache_from_next_position(chunked):
    generator = Generator(chunked.load())
    prompt, reply = long_prompt()[:, :9], long_prompt()[:, 9:]
    first = generator.generate(prompt, 4)
    second = generator.generate(torch.cat([first.tokens[:, -1:], reply], dim=1), 3, start=first.next_position)
    expected, _ = generate_eager(tiny_model(), torch.cat([prompt, first.tokens, reply], dim=1), 3)
    assert second.tokens.tolist() == expected.tolist()


def test_a_generation_that_would_pass_the_cache_is_refused_before_any_call(chunked, program_file):
    program = chunked.load()
    generator = Generator(program)
    with pytest.raises(ValueError, match="15 token.s. at position 0 and 20 new token.s. need 34 cache positions; "
                                         "the cache has 32"):
        generator.generate(long_prompt(), 20)
    with pytest.raises(ValueError, match="need 33 cache positions"):
        generator.generate(long_prompt()[:, :2], 1, start=31)
    for bad in (long_prompt()[0], long_prompt().int(), [[1, 2]]):
        with pytest.raises(ValueError, match="the prompt must be token ids .batch, length. as int64"):
            generator.generate(bad, 2)
    assert generator.prefill.stats.calls == 0
    assert generator.generate(long_prompt(), 18).tokens.shape == (1, 18)  # exactly fills the cache
    # A program without get_max_seq_len: the caller gives it; a static prefill takes its length only.
    fixed = Generator(td.load(program_file), max_seq_len=TINY["max_seq_len"])
    with pytest.raises(ValueError, match="need 39 cache positions"):
        fixed.generate(prompt(1), 32)
    with pytest.raises(ValueError, match=f"takes {PROMPT_LEN} tokens per call; a 12-token prompt splits into calls "
                                         f"of {PROMPT_LEN} with 4 left over"):
        fixed.generate(long_prompt(12), 2)


def test_the_programs_eos_ids_stop_generation_unless_stop_tokens_are_given(chunked):
    full = Generator(chunked.load()).generate(long_prompt(), 6)
    eos = int(full.tokens[0, 2])
    at = full.tokens[0].tolist().index(eos)
    with_eos = td.lower(export_prefill_decode(tiny_model(), 4, max_prompt_len=6), config=RESIDENT,
                        constant_methods={**chunked.constant_methods, "get_eos_ids": [eos]})
    generator = Generator(with_eos.load())
    stopped = generator.generate(long_prompt(), 6)
    assert stopped.stopped == [True] and stopped.tokens.shape[1] == at + 1
    generator.program.reset_state()
    assert generator.generate(long_prompt(), 6, stop_tokens=()).tokens.tolist() == full.tokens.tolist()


def test_one_dynamic_method_serves_prefill_and_decode_as_transformers_exports_it():
    """``TorchExportableModuleForDecoderOnlyLM.export`` with a dynamic length gives one ``forward``: it is
    both the prefill (an 11-token prompt in calls of at most 8) and the decode method, and its constant
    methods come from the wrapper (the cache's 32 positions, the config's eos id). The tokens are
    transformers' own static-cache generation's."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = tiny_static_cache_llama(transformers, layers=2, positions=32)
    config = model.config
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=32)
    seq = torch.export.Dim("seq", max=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = wrapper.export(input_ids=torch.zeros(1, 4, dtype=torch.long), cache_position=torch.arange(4),
                            dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}})
    methods = llm_constant_methods(wrapper)
    assert (methods["get_max_seq_len"], methods["get_eos_ids"]) == (32, [config.eos_token_id])
    lowered = td.lower({"forward": ep}, config=RESIDENT, constant_methods=methods)
    generator = Generator(lowered.load(), prefill="forward", decode="forward")
    prompt = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(3))
    result = generator.generate(prompt, 6)
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")[0, 11:]
    assert result.tokens[0, :len(expected)].tolist() == expected.tolist()
    with pytest.raises(ValueError, match="the cache has 32"):
        generator.generate(prompt, 30)


def test_a_repetition_penalty_sees_the_prompt_and_the_tokens_generated(program_file):
    """``top_k=1`` is greedy decoding; with a huge repetition penalty no token of the prompt or of the
    generation so far comes back, and without one it is the plain greedy generation."""
    from tritondelegate.sampling import Sampling

    program = td.load(program_file)
    generator = Generator(program)
    greedy = generator.generate(prompt(1), 6).tokens
    assert len(set(greedy[0].tolist())) < 6  # the tiny model repeats itself: the penalty has work to do
    program.reset_state()
    assert generator.generate(prompt(1), 6, sampling=Sampling(top_k=1)).tokens.tolist() == greedy.tolist()
    program.reset_state()
    tokens = generator.generate(prompt(1), 6, sampling=Sampling(top_k=1, repetition_penalty=1e6)).tokens[0].tolist()
    assert len(set(tokens)) == 6 and not set(tokens) & set(prompt(1)[0].tolist())
