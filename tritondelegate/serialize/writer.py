"""Writes a :class:`~tritondelegate.program.Program` as a program file (layout: ``header.py``).

The program's structure goes into one flatbuffer (``program.fbs``); the bytes of each in-file
constant go, once, into the aligned data segment after it; constants with ``external >= 0`` go into
safetensors files next to the program file instead, keyed by their fully-qualified name.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Sequence

import flatbuffers
import torch
from safetensors.torch import save_file

from ..dtypes import dtype_name
from ..program import FORMAT_VERSION, Constant, Program, align_up
from . import header as hdr
from . import signing
from .convert import to_object
from .generated import program_generated as fb
from .validate import external_name_problem


def save_program(program: Program, constant_data: Sequence[torch.Tensor], path,
                 binary_data: Sequence[bytes] = (), key: bytes | None = None) -> list[str]:
    """Writes ``program`` to ``path`` and its external constants next to it; returns the files written.

    ``constant_data[i]`` holds the bytes of ``program.constants[i]`` (any device; its dtype and shape
    must match the constant). The writer chooses every in-file ``Constant.data_offset`` (the value in
    ``program`` is ignored, and ``program`` is not modified); external constants get ``data_offset`` 0.
    It records each constant's checksum (``header.checksum`` of the bytes written; ignored in ``program``).
    Each name in ``program.external_files`` is a path relative to the program file's directory and is
    written as a safetensors file holding the constants that name it, keyed by ``Constant.name``.
    ``binary_data[i]`` holds the bytes of ``program.binaries[i]`` (kernel binaries), stored after the
    constants in the data segment.
    The program file is written to a temporary name and renamed, so a failed save leaves no
    half-written program behind. ``key`` (16 or more secret bytes) signs the file (``signing.py``): it
    then loads only with that key, and every checksum in it is keyed.
    """
    key = None if key is None else signing.check_key(key)
    path = os.fspath(path)
    if program.version != FORMAT_VERSION:
        raise ValueError(f"program version {program.version} cannot be written; this writer writes "
                         f"version {FORMAT_VERSION}")
    if len(constant_data) != len(program.constants):
        raise ValueError(f"{len(constant_data)} constant tensors for {len(program.constants)} constants")
    directory = os.path.dirname(os.path.abspath(path))
    external_paths = [_external_path(directory, name, path) for name in program.external_files]

    if len(binary_data) != len(program.binaries):
        raise ValueError(f"{len(binary_data)} kernel binaries' bytes for {len(program.binaries)} binaries")
    constants, data_size = _layout(program)
    binaries, data_size = _layout_binaries(program, binary_data, data_size)
    host = [_host_bytes(c, t, i) for i, (c, t) in enumerate(zip(program.constants, constant_data))]
    sums = [_checksum(data if c.external < 0 else _resolved(data), key) for c, data in zip(constants, host)]
    constants = [dataclasses.replace(c, checksum=s) for c, s in zip(constants, sums)]
    fb_bytes = _finish(_program_t(program, constants, binaries))
    _write_file(path, fb_bytes, data_size, [(c, data) for c, data in zip(constants, host) if c.external < 0]
                + list(zip(binaries, binary_data)), key, binary_data)
    for file_index, file_path in enumerate(external_paths):
        _write_external(file_path, [(c, t) for c, t in zip(constants, constant_data) if c.external == file_index])
    return [path, *external_paths]


def _checksum(data: torch.Tensor, key: bytes | None) -> int:
    return hdr.checksum(data) if key is None else signing.digest(data, key)


def _write_file(path: str, fb_bytes: bytes, data_size: int, blobs: list, key: bytes | None = None,
                binary_data: Sequence[bytes] = ()) -> None:
    """The header, the flatbuffer, the data segment with ``blobs`` ((constant or binary, its bytes)) at
    their offsets, and with a ``key`` the signature trailer (over the header, the flatbuffer and
    ``binary_data``, the kernel binaries' bytes);
    written to a temporary name and renamed, so a failure leaves no half-written file."""
    data_off = align_up(hdr.FLATBUFFER_OFFSET + len(fb_bytes), hdr.DATA_SEGMENT_ALIGNMENT)
    header = hdr.pack_header(FORMAT_VERSION, len(fb_bytes), data_off, data_size, zlib.crc32(fb_bytes))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(fb_bytes)
            for item, data in blobs:
                if item.nbytes:
                    f.write(bytes(data_off + item.data_offset - f.tell()))
                    f.write(data if isinstance(data, (bytes, bytearray)) else memoryview(data.numpy()))
            f.write(bytes(max(0, data_off + data_size - f.tell())))  # alignment of a trailing empty constant
            if f.tell() != data_off + data_size:
                raise RuntimeError(f"internal error: wrote {f.tell()} bytes, laid out {data_off + data_size}")
            if key is not None:
                f.write(signing.pack_trailer(header, fb_bytes, binary_data, key))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_external(file_path: str, constants: list) -> None:
    """A safetensors file of these (constant, tensor) pairs, keyed by the constants' names."""
    tensors, storages = {}, set()
    for c, t in constants:
        t = _resolved(t)
        # safetensors refuses views and tensors that share storage: copy those only
        if t.untyped_storage().nbytes() != t.nbytes or t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        if t.nbytes:
            storages.add(t.untyped_storage().data_ptr())
        tensors[c.name] = t
    os.makedirs(os.path.dirname(file_path), exist_ok=True)
    save_file(tensors, file_path, metadata={"format": "pt"})


def _external_path(directory: str, name: str, program_path: str) -> str:
    problem = external_name_problem(name)
    if problem:
        raise ValueError(f"external file name {name!r} {problem}")
    file_path = os.path.join(directory, name)
    if os.path.abspath(file_path) == os.path.abspath(program_path):
        raise ValueError(f"external file {name!r} is the program file itself")
    return file_path


def _host_bytes(c: Constant, t: torch.Tensor, index: int) -> torch.Tensor:
    """The constant's bytes as a contiguous host uint8 tensor, after checking it matches ``c``."""
    what = f"constant {index} ({c.name!r})"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(t).__name__}")
    dtype = dtype_name(t.dtype)
    if dtype != c.dtype or tuple(t.shape) != tuple(c.shape):
        raise ValueError(f"{what} is {c.dtype}{list(c.shape)} but its tensor is {dtype}{list(t.shape)}")
    if t.numel() * t.element_size() != c.nbytes:
        raise ValueError(f"{what} records {c.nbytes} bytes; its tensor has {t.numel() * t.element_size()}")
    if c.external >= 0:
        return t  # written by safetensors
    return _resolved(t).reshape(-1).view(torch.uint8)


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, contiguous, with no lazy conjugate or negative bit: the bytes written."""
    return t.detach().cpu().resolve_conj().resolve_neg().contiguous()


def _layout(program: Program) -> tuple[list[Constant], int]:
    """Copies of the constants with their data-segment offsets, and the data segment's size."""
    n_files = len(program.external_files)
    out, cursor, keys = [], 0, set()
    for i, c in enumerate(program.constants):
        if c.external >= n_files or c.external < -1:
            raise ValueError(f"constant {i} ({c.name!r}) names external file {c.external}; the program "
                             f"has {n_files}")
        if c.external >= 0:
            if (c.external, c.name) in keys:
                raise ValueError(f"two constants named {c.name!r} go to external file "
                                 f"{program.external_files[c.external]!r}, where names are keys")
            keys.add((c.external, c.name))
            out.append(Constant(c.name, c.dtype, tuple(c.shape), c.nbytes, 0, c.external))
            continue
        cursor = align_up(cursor, hdr.CONSTANT_ALIGNMENT)
        out.append(Constant(c.name, c.dtype, tuple(c.shape), c.nbytes, cursor, -1))
        cursor += c.nbytes
    return out, cursor


def _layout_binaries(program: Program, binary_data: Sequence[bytes], cursor: int) -> tuple[list, int]:
    """Copies of the kernel binaries with their data-segment offsets (after ``cursor``), and the end."""
    out = []
    for i, (b, data) in enumerate(zip(program.binaries, binary_data)):
        if not isinstance(data, (bytes, bytearray)) or len(data) != b.nbytes or zlib.crc32(data) != b.checksum:
            raise ValueError(f"kernel binary {i} ({b.kernel!r}, {b.arch}): its bytes do not match its size "
                             "and checksum")
        cursor = align_up(cursor, hdr.CONSTANT_ALIGNMENT)
        out.append(dataclasses.replace(b, data_offset=cursor))
        cursor += b.nbytes
    return out, cursor


def _program_t(program: Program, constants: list[Constant], binaries: list | None = None) -> fb.ProgramT:
    """``program`` with these constants (and binaries) as the object tree that packs into its flatbuffer."""
    binaries = program.binaries if binaries is None else binaries
    return to_object(dataclasses.replace(program, constants=constants, binaries=binaries))


def _finish(p: fb.ProgramT) -> bytes:
    builder = flatbuffers.Builder(4096)
    builder.Finish(p.Pack(builder), file_identifier=hdr.FILE_IDENTIFIER)
    return bytes(builder.Output())
