"""Signed program files (serialize/signing.py): a file saved with a key loads only with that key and only
as it was saved. Checksums catch damage; a re-sealed edit (checksums recomputed) is caught only by the
signature."""

from __future__ import annotations

import copy
import dataclasses
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tritondelegate as td
from tritondelegate.errors import ProgramError
from tritondelegate.program import KernelBinary
from tritondelegate.serialize import header as hdr
from tritondelegate.serialize import load_program, save_program, signing

KEY = b"0123456789abcdef-secret"
X = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def lowered():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.PerCallCopyWarning)
        ep = torch.export.export(model, (X,))
        resident = td.PropagateDeviceConfig(skip_h2d_for_constants=True)
        in_file = td.lower(ep, config=td.LowerConfig(propagate_device=resident))
        external = td.lower(ep, config=td.LowerConfig(propagate_device=resident, external_constants=True))
    return model, in_file, external


def _run(path: Path, key=KEY):
    return td.load(path, devices="simulated", key=key).load_method()(X)


def test_a_signed_program_runs_with_its_key_only(lowered, tmp_path):
    model, in_file, _ = lowered
    path = tmp_path / "m.tdp"
    in_file.save(path, key=KEY)
    torch.testing.assert_close(_run(path), model(X).detach())
    with pytest.raises(ProgramError, match="the program is signed: load it with its key"):
        td.load(path, devices="simulated")
    with pytest.raises(ProgramError, match="signature does not match"):
        td.load(path, devices="simulated", key=b"another key of 16+ bytes")
    in_file.save(tmp_path / "plain.tdp")
    with pytest.raises(ProgramError, match="not signed, but a key was given"):
        td.load(tmp_path / "plain.tdp", key=KEY)
    # the signature is a trailer: the rest of the file is the unsigned layout with keyed checksums
    signed, plain = path.read_bytes(), (tmp_path / "plain.tdp").read_bytes()
    assert len(signed) == len(plain) + signing.TRAILER.size


def test_keys_are_bytes_of_at_least_16(lowered, tmp_path):
    _, in_file, _ = lowered
    with pytest.raises(TypeError, match="must be bytes"):
        in_file.save(tmp_path / "m.tdp", key="a text key, not bytes")
    with pytest.raises(ValueError, match="at least 16 bytes, this one has 5"):
        in_file.save(tmp_path / "m.tdp", key=b"short")
    assert not (tmp_path / "m.tdp").exists()


def _reseal(path: Path, edit) -> None:
    """Apply ``edit`` to the program and write it back with right checksums, keeping the signature
    trailer of the original: what someone without the key can do."""
    trailer = path.read_bytes()[-signing.TRAILER.size:]
    with load_program(path, key=KEY) as pf:
        program = copy.deepcopy(pf.program)
        data = [pf.constant_tensor(i).clone() for i in range(len(program.constants))]
    edit(program, data)
    save_program(program, data, path)
    path.write_bytes(path.read_bytes() + trailer)


def test_a_resealed_edit_is_refused(lowered, tmp_path):
    _, in_file, _ = lowered
    path = tmp_path / "m.tdp"

    def scale_a_weight(program, data):
        data[0].mul_(2)  # new bytes, with a checksum the writer recomputes

    def change_a_launch(program, data):
        launch = program.methods[0].delegates[0].plan.launches[0]
        launch.grid = tuple(1 for _ in launch.grid)

    for edit in (scale_a_weight, change_a_launch):
        in_file.save(path, key=KEY)
        _reseal(path, edit)
        with pytest.raises(ProgramError, match="signature does not match"):
            td.load(path, devices="simulated", key=KEY)


def test_changed_constant_bytes_are_refused_when_read(lowered, tmp_path):
    _, in_file, external = lowered
    path = tmp_path / "m.tdp"
    in_file.save(path, key=KEY)
    with load_program(path, key=KEY) as pf:
        c = pf.program.constants[0]
        start = pf.data_offset + c.data_offset
    raw = bytearray(path.read_bytes())
    raw[start] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ProgramError, match=rf"constant 0 \('{c.name}'\): its bytes in .* do not match the "
                                           "program's signature"):
        _run(path)
    # external weights: a tensor replaced by a same-shaped one is refused
    folder = tmp_path / "ext"
    folder.mkdir()
    external.save(folder / "m.tdp", key=KEY)
    weights = next(folder.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = torch.randn_like(tensors[name])
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ProgramError, match=rf"\('{name}'\): its bytes in .* do not match the program's signature"):
        _run(folder / "m.tdp")


def test_kernel_binaries_are_signed(lowered, tmp_path):
    _, in_file, _ = lowered
    blob = bytes(range(200))
    binary = KernelBinary("pointwise", "sm_90", "3.6.0", "ab" * 32, "pointwise_kernel",
                          '{"name": "pointwise_kernel"}', len(blob), zlib.crc32(blob))
    program = dataclasses.replace(in_file.program, binaries=[binary])
    path = tmp_path / "m.tdp"
    save_program(program, in_file.constant_data, path, binary_data=[blob], key=KEY)
    with load_program(path, key=KEY) as pf:
        assert pf.binary_bytes(0) == blob
        start = pf.data_offset + pf.program.binaries[0].data_offset
    # other code with a matching CRC-32 (what a re-sealer writes) is refused by the signature
    forged = bytearray(blob)
    forged[:4] = b"\xde\xad\xbe\xef"
    forged_binary = dataclasses.replace(binary, checksum=zlib.crc32(bytes(forged)))
    trailer = path.read_bytes()[-signing.TRAILER.size:]
    save_program(dataclasses.replace(program, binaries=[forged_binary]), in_file.constant_data, path,
                 binary_data=[bytes(forged)])
    path.write_bytes(path.read_bytes() + trailer)
    with pytest.raises(ProgramError, match="signature does not match"):  # the structure changed (its CRC)
        load_program(path, key=KEY)
    # the structure kept, only the bytes replaced: the binaries' own MAC refuses them
    save_program(program, in_file.constant_data, path, binary_data=[blob], key=KEY)
    raw = bytearray(path.read_bytes())
    raw[start:start + 4] = b"\xde\xad\xbe\xef"
    path.write_bytes(bytes(raw))
    with pytest.raises(ProgramError, match="kernel binary 0 .* do not match their checksum"):
        load_program(path, key=KEY)
    with pytest.raises(ProgramError, match="kernel binaries do not match the file's signature"):
        signing.verify(str(path), signing.pack_trailer(b"h", b"f", [blob], KEY), b"h", b"f", KEY).check_binaries(
            str(path), [bytes(raw[start:start + len(blob)])])


def test_a_trailer_that_is_not_a_signature_is_refused(lowered, tmp_path):
    _, in_file, _ = lowered
    path = tmp_path / "m.tdp"
    in_file.save(path)
    path.write_bytes(path.read_bytes() + bytes(signing.TRAILER.size))
    with pytest.raises(ProgramError, match="80 unexpected bytes after the recorded end"):
        load_program(path)
    assert hdr.HEADER.size == 64  # the MAC covers the header: the layout it names is signed too


def test_inspect_reads_a_signed_program_with_its_key_file(lowered, tmp_path, capsys):
    from tritondelegate import cli

    _, in_file, _ = lowered
    path = tmp_path / "m.tdp"
    in_file.save(path, key=KEY)
    (tmp_path / "key").write_bytes(KEY)
    assert cli.main(["inspect", str(path)]) == 2
    assert "the program is signed" in capsys.readouterr().err
    assert cli.main(["inspect", str(path), "--key-file", str(tmp_path / "key"), "--json"]) == 0
    assert "methods" in capsys.readouterr().out
