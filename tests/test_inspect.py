"""``tritondelegate inspect``: a program file's methods, delegates, constants, state and memory."""

import json

from test_state import _acc_program
from tritondelegate import cli


def test_inspect_lists_methods_constants_state_and_segments(tmp_path, capsys):
    lowered, acc, x = _acc_program()
    path = tmp_path / "acc.tdp"
    lowered.save(path)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in facts["methods"]] == ["step", "read"]
    step = facts["methods"][0]
    plan_launches = sum(len(d.plan.launches) for d in lowered.program.methods[0].delegates)
    assert step["launches_per_call"] == sum(d["launches"] for d in step["delegates"]) == plan_launches
    assert step["inputs"][0]["shape"] == [4, 8] and step["state_written_back"] == ["total"]
    assert facts["constants"] == [{"name": "w", "dtype": "float32", "shape": [8, 8], "bytes": 256,
                                   "resident_on": ["cuda:0"], "methods": ["read", "step"],
                                   "stored": "program file"}]
    assert facts["state"] == [{"name": "total", "device": "cuda:0", "bytes": 128}]
    assert {(s["kind"], s["bytes"]) for s in facts["segments"]} == {("constants", 256), ("state", 256)}
    assert cli.main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "state total: 128 bytes on cuda:0" in text and f"triton_0 on cuda:0: {plan_launches} launches" in text


def test_inspect_refuses_a_damaged_file(tmp_path, capsys):
    path = tmp_path / "bad.tdp"
    path.write_bytes(b"not a program")
    assert cli.main(["inspect", str(path)]) == 2
    assert "shorter than the 64-byte header" in capsys.readouterr().err


def test_inspect_shows_dynamic_dimensions(tmp_path, capsys):
    import torch
    from torch.export import Dim

    import tritondelegate as td
    from tritondelegate.models import MLP

    ep = torch.export.export(MLP([8, 16, 4]).eval(), (torch.randn(5, 8),),
                             dynamic_shapes={"x": {0: Dim("batch", max=33)}})
    path = tmp_path / "dynamic.tdp"
    td.lower(ep).save(path)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    (method,) = json.loads(capsys.readouterr().out)["methods"]
    (symbol,) = method["symbols"]
    assert (symbol["min"], symbol["max"], symbol["input"], symbol["dim"]) == (0, 33, "x", 0)
    assert method["inputs"][0]["shape"] == [symbol["name"], 8]
    assert cli.main(["inspect", str(path)]) == 0
    assert f"dynamic dimensions: {symbol['name']} = 'x' dim 0 in 0..33" in capsys.readouterr().out


def test_inspect_lists_each_launch_with_its_traffic(tmp_path, capsys):
    """``--json`` holds every launch of each delegate's plan with its modelled bytes and FLOPs, in the
    order they run; ``--launches`` prints them, each with its share of the method's bytes."""
    import torch

    import tritondelegate as td
    from tritondelegate.models import MLP

    ep = torch.export.export(MLP([8, 16, 4]).eval(), (torch.randn(5, 8),),
                             dynamic_shapes={"x": {0: torch.export.Dim("batch", max=33)}})
    lowered = td.lower(ep)
    path = tmp_path / "mlp.tdp"
    lowered.save(path)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    (method,) = json.loads(capsys.readouterr().out)["methods"]
    (delegate,) = method["delegates"]
    plan = lowered.program.methods[0].delegates[0].plan
    assert [(f["kernel"], f["op"], f["bytes_read"], f["bytes_written"], f["flops"]) for f in delegate["launch_plan"]] \
        == [(x.kernel, x.op, x.bytes_read, x.bytes_written, x.flops) for x in plan.launches]
    assert sum(f["bytes_read"] + f["bytes_written"] for f in delegate["launch_plan"]) == method["traffic"]["bytes"]
    assert any(isinstance(g, str) for f in delegate["launch_plan"] for g in f["grid"])  # the batch's expression
    assert cli.main(["inspect", str(path), "--launches"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("       ")][1:]  # past the header
    assert [row[1] for row in rows] == [x.kernel for x in plan.launches]
    assert rows[0][-1] == plan.launches[0].op
    shares = [float(next(c for c in row if c.endswith("%"))[:-1]) for row in rows]
    assert abs(sum(shares) - 100) < 0.1 * len(rows)
