"""``summary()``: a table of the methods first, then grouped details that fit a screen for a real-sized model;
``summary(verbose=True)`` lists every item."""

import warnings

import pytest
import torch

import tritondelegate as td
from tritondelegate.models import demo_decoder
from tritondelegate.summary import LIMIT, _bytes, method_facts

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))
LAYERS = 32  # a real model's depth; the dims stay tiny so that lowering stays quick


def _lower(ep, **partitioner):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        return td.lower(ep, partitioner=td.TritonPartitioner(**partitioner), config=RESIDENT)


@pytest.fixture(scope="module")
def deep():
    """A 32-layer Llama-style decoder with random weights: ~200 resident constants. Only lowered."""
    model, args = demo_decoder(seed=0, n_layers=LAYERS, dim=16, n_heads=2, n_kv_heads=2, hidden_dim=32,
                               vocab_size=64, max_seq_len=16)
    return _lower(torch.export.export(model, args))


def test_a_32_layer_model_fits_on_one_screen(deep):
    lowered = deep
    facts = method_facts(lowered, "forward")
    resident = facts["resident_constants"]
    assert len(resident) > 5 * LAYERS
    text = lowered.summary()
    lines = text.splitlines()
    assert len(lines) <= 50, text
    assert max(len(line) for line in lines) <= 200, text
    # The table first: a header and one row per method, with the figures of the method.
    header, row = lines[0].split(), lines[1].split()
    assert header[:4] == ["method", "delegated", "delegates", "launches"]
    launches = sum(d["launches"] for d in facts["delegates"])
    assert row[:4] == ["forward", f"{facts['nodes_delegated']}/{facts['nodes_total']}", "100%", "1"]
    assert row[4] == str(launches)
    # Resident constants: the largest LIMIT by size, then one line for the rest with their total.
    start = lines.index(next(line for line in lines if line.startswith("  resident constants (")))
    listed = lines[start + 1:start + 1 + LIMIT]
    by_size = sorted(resident, key=lambda r: -r["bytes"])
    assert [line.split()[0] for line in listed] == [r["name"] for r in by_size[:LIMIT]]
    rest = by_size[LIMIT:]
    assert lines[start + 1 + LIMIT] == f"    {len(rest)} more, {_bytes(sum(r['bytes'] for r in rest))}"
    # Rewrites grouped by kind with counts, on one line.
    fused = next(line for line in lines if line.startswith("  fused into bigger ops"))
    assert f"rms_norm ({2 * LAYERS + 1})" in fused and f"rotary embedding ({2 * LAYERS})" in fused
    assert "summary(verbose=True) lists every item" in text


def test_verbose_lists_every_item(deep):
    lowered = deep
    facts = method_facts(lowered, "forward")
    text = lowered.summary(verbose=True)
    for r in facts["resident_constants"]:
        assert f"    {r['name']} on {r['device']}, " in text
    for rewrite in facts["fused"]:
        assert f"    {rewrite}\n" in text
    assert ", ".join(facts["folded"]) in text
    assert "more," not in text and "verbose=True" not in text
    assert len(text.splitlines()) > len(facts["resident_constants"]) + len(facts["fused"])


def test_refused_nodes_are_grouped_by_op_with_a_count_and_a_reason():
    model, args = demo_decoder(seed=0)
    lowered = _lower(torch.export.export(model, args), ops=["aten.mm", "aten.addmm", "aten.bmm"])
    facts = method_facts(lowered, "forward")
    host = facts["host_nodes"]
    by_op = {}
    for h in host:
        by_op.setdefault(h["op"], []).append(h)
    assert len(host) > len(by_op) > 3
    text = lowered.summary()
    assert f"  on the host ({len(host)} nodes, {len(by_op)} ops):" in text
    for op, nodes in by_op.items():
        (line,) = [line for line in text.splitlines() if line.startswith(f"    {op} x")]
        assert line.startswith(f"    {op} x{len(nodes)} ({nodes[0]['node']}")
        assert line.split("): ", 1)[1].startswith(nodes[0]["reason"])
    # The per-call copies of partial delegation: the largest LIMIT, then the rest in one line.
    copies = facts["per_call_copies"]
    assert len(copies) > LIMIT + 1
    assert f"    {len(copies) - LIMIT} more, " in text
    verbose = lowered.summary(verbose=True)
    for h in host:
        assert f"    {h['node']} [{h['op']}]: {h['reason']}" in verbose
    for c in copies:
        assert f"    {c['value']} (" in verbose


def test_program_state_is_grouped_by_size_too():
    from tritondelegate.summary import _program_lines

    state = [{"name": f"layers.{i}.attn.k_cache", "device": "cuda:0", "bytes": 1024 * (i + 1), "reason": ""}
             for i in range(2 * LIMIT)]
    lines = _program_lines({"state": state, "segments": []}, verbose=False)
    assert lines[0].startswith(f"program state ({2 * LIMIT} buffers, ")
    assert lines[1] == f"  layers.{2 * LIMIT - 1}.attn.k_cache, {_bytes(2 * LIMIT * 1024)}, on cuda:0"
    assert lines[-1] == f"  {LIMIT} more, {_bytes(sum(s['bytes'] for s in state[:LIMIT]))}"
    assert len(lines) == LIMIT + 2
    assert len(_program_lines({"state": state, "segments": []}, verbose=True)) == 2 * LIMIT + 1
