"""``tritondelegate inspect PROGRAM --plot FILE.png``: each arena and segment drawn, every planned value in it."""

import sys
import warnings

import torch

import tritondelegate as td
from tritondelegate import cli
from tritondelegate.models import demo_decoder, export_prefill_decode, kv_cache_decoder
from tritondelegate.plot import COLORS, arena_panels, arena_rectangles
from tritondelegate.program import InstrKind

PNG = b"\x89PNG\r\n\x1a\n"
RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


def _save(programs, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        lowered = td.lower(programs, partitioner=td.TritonPartitioner(device="cuda:0"), config=RESIDENT)
    lowered.save(path)
    return lowered.program


def _plot(tmp_path, program_path, capsys) -> None:
    png = tmp_path / "arena.png"
    assert cli.main(["inspect", str(program_path), "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert "method " in captured.out and f"drawn into {png}" in captured.err
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000


def _check_rectangles(program) -> list[dict]:
    """Every planned value, scratch block and slot is a rectangle of its panel, inside the panel; planned
    rectangles that share bytes never share steps; temporaries lie inside their scratch block."""
    panels = {p["key"]: p for p in arena_panels(program)}
    rects = arena_rectangles(program)
    assert {r["kind"] for r in rects} <= set(COLORS) and {r["panel"] for r in rects} <= set(panels)
    for m in program.methods:
        expected = {(f"{m.name} arena {m.arenas[v.arena].device}", vid, v.arena_offset, v.nbytes)
                    for vid, v in enumerate(m.values) if v.arena >= 0}
        got = {(r["panel"], r["value"], r["offset"], r["nbytes"]) for r in rects if r["method"] == m.name
               and r["value"] >= 0}
        assert got == expected and expected
        blocks = {(r["delegate"], r["offset"], r["nbytes"]) for r in rects
                  if r["method"] == m.name and r["kind"] == "scratch"}
        assert blocks == {(i.delegate, m.delegates[i.delegate].scratch_offset, m.delegates[i.delegate].plan.scratch_bytes)
                          for i in m.instructions if i.kind == InstrKind.DELEGATE
                          and m.delegates[i.delegate].scratch_arena >= 0}
    slots = {(r["panel"], r["name"], r["offset"]) for r in rects if r["method"] is None}
    assert slots == {(f"segment {s.device} {program.segments[s.segment].kind.name.lower()}", s.name, s.offset)
                     for s in program.slots if s.segment >= 0}
    for r in rects:
        p = panels[r["panel"]]
        assert 0 <= r["offset"] and r["offset"] + r["nbytes"] <= p["bytes"], r
        assert 0 <= r["x0"] < r["x1"] <= p["steps"], r
    planned = [r for r in rects if r["kind"] != "temporary" and r["method"] is not None]
    for i, a in enumerate(planned):
        for b in planned[i + 1:]:
            if a["panel"] == b["panel"] and a["nbytes"] and b["nbytes"]:
                apart_in_time = a["x1"] <= b["x0"] or b["x1"] <= a["x0"]
                apart_in_bytes = a["offset"] + a["nbytes"] <= b["offset"] or b["offset"] + b["nbytes"] <= a["offset"]
                assert apart_in_time or apart_in_bytes, (a, b)
    for t in (r for r in rects if r["kind"] == "temporary"):
        (block,) = [r for r in planned if r["kind"] == "scratch" and r["panel"] == t["panel"]
                    and r["delegate"] == t["delegate"] and r["method"] == t["method"]]
        assert block["x0"] <= t["x0"] and t["x1"] <= block["x1"]
        assert block["offset"] <= t["offset"] and t["offset"] + t["nbytes"] <= block["offset"] + block["nbytes"]
    return rects


def test_the_demo_decoders_arena(tmp_path, capsys):
    model, example = demo_decoder(seed=0)
    path = tmp_path / "demo.tdp"
    program = _save(torch.export.export(model, example), path)
    rects = _check_rectangles(program)
    kinds = {r["kind"] for r in rects}
    assert {"input", "output", "scratch", "temporary", "constant"} <= kinds
    (arena,) = [p for p in arena_panels(program) if p["kind"] == "arena"]
    assert arena["lower_bound"] <= arena["bytes"] == program.methods[0].arenas[0].nbytes
    _plot(tmp_path, path, capsys)


def test_a_two_method_program_with_state(tmp_path, capsys):
    model = kv_cache_decoder(seed=0, vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                             max_seq_len=32)
    path = tmp_path / "generate.tdp"
    program = _save(export_prefill_decode(model, 8), path)
    rects = _check_rectangles(program)
    keys = [p["key"] for p in arena_panels(program)]
    assert keys == ["prefill arena cuda:0", "decode arena cuda:0", "segment cuda:0 constants",
                    "segment cuda:0 state"]
    state = {r["name"] for r in rects if r["kind"] == "state"}
    assert state == set(model.cache_buffers())
    _plot(tmp_path, path, capsys)


def test_without_matplotlib_the_plot_is_refused_with_the_extra_to_install(tmp_path, capsys, monkeypatch):
    from tritondelegate.models import MLP

    path = tmp_path / "mlp.tdp"
    _save(torch.export.export(MLP([8, 16, 4]).eval(), (torch.randn(2, 8),)), path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["inspect", str(path), "--plot", str(tmp_path / "a.png")]) == 2
    assert "pip install 'tritondelegate[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "a.png").exists()
