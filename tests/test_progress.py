"""Progress bars on long work: on a terminal when the work is large or when forced, never in captured output."""

import io
import sys

import pytest
import torch

import tritondelegate as td
from tritondelegate import progress
from tritondelegate.models import MLP

RESIDENT = td.LowerConfig(propagate_device=td.PropagateDeviceConfig(skip_h2d_for_constants=True))


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("progress") / "mlp.tdp"
    ep = torch.export.export(MLP([8, 16, 4]).eval(), (torch.randn(2, 8),))
    td.lower(ep, config=RESIDENT, progress=False).save(path)
    return path


def _stderr(monkeypatch, terminal: bool) -> io.StringIO:
    err = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    return err


def test_a_large_load_on_a_terminal_shows_a_bar(mlp_file, monkeypatch):
    monkeypatch.setattr(progress, "LOAD_BYTES", 0)  # every load counts as large
    err = _stderr(monkeypatch, terminal=True)
    method = td.load(mlp_file, devices="simulated").load_method("forward")
    assert "loading 'forward'" in err.getvalue() and "B/s" in err.getvalue()
    assert method.stats.load_h2d_bytes > 0  # counted as before: the bar changes nothing else
    with torch.no_grad():
        method(torch.randn(2, 8))


def test_a_small_load_shows_nothing_unless_forced(mlp_file, monkeypatch):
    err = _stderr(monkeypatch, terminal=True)
    quiet = td.load(mlp_file, devices="simulated").load_method("forward")
    assert err.getvalue() == ""  # far below progress.LOAD_BYTES
    forced = td.load(mlp_file, devices="simulated", progress=True).load_method("forward")
    assert "loading 'forward'" in err.getvalue()
    assert forced.stats.load_h2d_bytes == quiet.stats.load_h2d_bytes > 0


def test_no_bar_in_captured_output_even_for_a_large_load(mlp_file, monkeypatch, capfd):
    monkeypatch.setattr(progress, "LOAD_BYTES", 0)
    monkeypatch.setattr(progress, "LOWER_DELAY_S", 0.0)
    err = _stderr(monkeypatch, terminal=False)
    td.load(mlp_file, devices="simulated").load_method("forward")
    ep = torch.export.export(MLP([8, 16, 4]).eval(), (torch.randn(2, 8),))
    td.lower(ep, config=RESIDENT)
    assert err.getvalue() == ""
    assert "loading" not in capfd.readouterr().err
    # progress=False wins on a terminal too
    err = _stderr(monkeypatch, terminal=True)
    td.load(mlp_file, devices="simulated", progress=False).load_method("forward")
    td.load(mlp_file, devices="simulated").load_method("forward", progress=False)
    assert err.getvalue() == ""


def test_lowering_shows_its_steps_on_a_terminal_once_it_runs_long(monkeypatch):
    ep = torch.export.export(MLP([8, 16, 4]).eval(), (torch.randn(2, 8),))
    err = _stderr(monkeypatch, terminal=True)
    td.lower(ep, config=RESIDENT)  # quicker than progress.LOWER_DELAY_S: no bar
    assert "lowering" not in err.getvalue()
    monkeypatch.setattr(progress, "LOWER_DELAY_S", 0.0)
    lowered = td.lower(ep, config=RESIDENT)
    text = err.getvalue()
    assert "lowering" in text and "decompose forward" in text and "lower forward" in text
    assert lowered.method_names == ["forward"]
    err = _stderr(monkeypatch, terminal=False)
    td.lower(ep, config=RESIDENT, progress=True)  # forced: shown wherever stderr goes
    assert "lowering" in err.getvalue()


def test_the_bar_counts_every_byte_loaded(mlp_file, monkeypatch):
    updates = []
    real = progress._Bar.update
    monkeypatch.setattr(progress._Bar, "update", lambda self, n=1: (updates.append(n), real(self, n)))
    _stderr(monkeypatch, terminal=True)
    program = td.load(mlp_file, devices="simulated", progress=True)
    method = program.load_method("forward")
    assert sum(updates) == method.stats.load_h2d_bytes > 0
    updates.clear()
    program.load_method("forward")  # the constants are there already: nothing to count
    assert sum(updates) == 0
