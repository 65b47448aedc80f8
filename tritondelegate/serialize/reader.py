"""Loads a program file: checks it, decodes its :class:`~tritondelegate.program.Program`, and hands
out its constants as zero-copy views of the mapped file (or of the external safetensors files).

The runtime imports this module. It imports nothing of ``torch.export`` or of the AOT side: only the
program dataclasses, the generated flatbuffers code, torch, mmap and safetensors
(tests/test_format.py checks this).

Everything read from a file is checked before use; a bad file raises :class:`ProgramError` naming
the file and what is wrong. Checked at :func:`load_program`: the magic, the version, the header and
flatbuffer checksums, every offset and size of the header against the file's size, the flatbuffer's
identifier and structure (an accessor that fails, a vector longer than the buffer), enum values, as
``convert.py`` decodes it into the program dataclasses; then,
in ``validate.py``: dtype names, every index (value ids, constant, arena, delegate, external file,
plan tensor and delegate input/output indices), and that in-file constants lie inside the data
segment, aligned for their dtype, with ``nbytes`` matching dtype and shape; symbolic sizes: each
expression is integer arithmetic over its method's symbols (parsed, never run as arbitrary code), its
recorded bound is its value at the symbols' maxima, and each symbol is its input's dimension; in
``consistency.py``: specs, devices, value sizes, arenas and data flow. Checked when an external
constant is first asked for: the file exists and is a safetensors file, it has the key, the tensor's
dtype and shape. Checked the first time a constant's bytes are handed out: their checksum
(``header.checksum``) against the one the program records, so damaged data, or an external file whose
tensors were swapped or replaced, is an error naming the constant instead of a wrong answer.

Lifetime policy: the file is mapped once, privately (copy-on-write: writing to a tensor handed out
never reaches the file). Each tensor handed out holds the part of the mapping it views (through a
``memoryview``), so it stays valid however long it lives. :meth:`ProgramFile.close` drops the
ProgramFile's own references (the mapping and the open external files); the mapping is unmapped
then, or when the last tensor viewing it is freed. Closing is therefore always safe, and idempotent;
after it, the ProgramFile hands out nothing more. As with any mapping, the file must not be truncated
or rewritten in place while it is loaded (the writer replaces files by renaming, which is safe).
"""

from __future__ import annotations

import mmap
import os
import zlib

import torch
from safetensors import safe_open

from ..dtypes import dtype_name, parse_dtype
from ..program import FORMAT_VERSION, Constant, Program
from ..errors import ProgramError
from . import header as hdr
from . import signing
from .convert import from_buffer
from .generated import program_generated as fb
from .validate import check_program

SUPPORTED_VERSIONS = (FORMAT_VERSION,)


def load_program(path, data_files: dict[str, str] | None = None, key: bytes | None = None) -> "ProgramFile":
    """Maps and checks the program file at ``path``; raises :class:`ProgramError` if it is bad (and
    ``OSError`` if it cannot be opened).

    ``data_files`` maps external file names recorded in the program to paths (default for each: the
    recorded name, relative to the program file's directory); ``constant_*`` calls can override it.
    ``key``: the secret a signed file was saved with (``signing.py``); a signed file needs it, an
    unsigned file is refused with one.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < hdr.HEADER.size:
            raise ProgramError(f"{path}: truncated: {size} bytes, shorter than the {hdr.HEADER.size}-byte "
                               "header of a program file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        program, data_off, data_size, signature = _parse(mm, path, key)
    except BaseException:
        mm.close()
        raise
    file = ProgramFile(path, program, mm, data_off, data_size, data_files, signature)
    try:
        file.check_binaries()
    except BaseException:
        file.close()
        raise
    return file


class ProgramFile:
    """A loaded program file: ``.program`` and zero-copy host views of its constants' bytes.

    Use it as a context manager, or call :meth:`close`; see the module docstring for what closing
    means for tensors already handed out.
    """

    def __init__(self, path: str, program: Program, mm: mmap.mmap, data_off: int, data_size: int,
                 data_files: dict[str, str] | None, signature: signing.Signature | None = None):
        self.path = path
        self.signature = signature  # a signed file's key: its constants' checksums are keyed
        self.program = program
        self._mm: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)
        self._data_off = data_off
        self._data_size = data_size
        self._data_files = dict(data_files or {})
        self._external: dict[str, tuple[object, frozenset[str]]] = {}  # path -> (safe_open, keys)
        self._checked: set = set()  # constants whose bytes matched their checksum: index or (index, path)

    @property
    def data_offset(self) -> int:
        """Where the data segment starts in the file."""
        return self._data_off

    def binary_bytes(self, index: int) -> bytes:
        """The bytes of ``program.binaries[index]`` (checked against its checksum at load)."""
        b = self.program.binaries[index]
        start = self._data_off + b.data_offset
        return bytes(self._mv[start:start + b.nbytes])

    def check_binaries(self) -> None:
        blobs = [self.binary_bytes(i) for i in range(len(self.program.binaries))]
        for i, (b, blob) in enumerate(zip(self.program.binaries, blobs)):
            if zlib.crc32(blob) != b.checksum:
                raise ProgramError(f"{self.path}: kernel binary {i} ({b.kernel!r}, {b.arch}): its bytes do not "
                                   "match their checksum (the file is damaged)")
        if self.signature is not None:
            self.signature.check_binaries(self.path, blobs)

    # -- constants --------------------------------------------------------------------------------

    def constant_bytes(self, index: int, data_files: dict[str, str] | None = None) -> torch.Tensor:
        """The bytes of ``program.constants[index]``: a 1-D host uint8 tensor viewing the mapped file."""
        c = self._constant(index)
        if c.external >= 0:
            return self._external_tensor(index, data_files).reshape(-1).view(torch.uint8)
        if c.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        start = self._data_off + c.data_offset
        data = torch.frombuffer(self._mv[start:start + c.nbytes], dtype=torch.uint8)
        self._check_sum(index, index, data, "the program file's data segment")
        return data

    def constant_tensor(self, index: int, data_files: dict[str, str] | None = None) -> torch.Tensor:
        """``program.constants[index]`` with its dtype and shape: a host view, not a copy."""
        c = self._constant(index)
        if c.external >= 0:
            return self._external_tensor(index, data_files)
        dtype = parse_dtype(c.dtype)
        if c.nbytes == 0:
            return torch.empty(c.shape, dtype=dtype)
        try:
            return self.constant_bytes(index).view(dtype).reshape(c.shape)
        except RuntimeError as e:  # dtypes torch cannot view bytes as (quantized, sub-byte)
            raise ProgramError(f"{self.path}: constant {index} ({c.name!r}): cannot view its bytes as "
                               f"{c.dtype}: {e}") from e

    def external_path(self, file_index: int, data_files: dict[str, str] | None = None) -> str:
        """Where ``program.external_files[file_index]`` is read from."""
        name = self.program.external_files[file_index]
        mapping = self._data_files if data_files is None else {**self._data_files, **data_files}
        if name in mapping:
            return os.fspath(mapping[name])
        return os.path.join(os.path.dirname(os.path.abspath(self.path)), name)

    # -- lifetime ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Drops this object's mapping and external files; tensors handed out stay valid."""
        if self._mm is None:
            return
        self._external.clear()
        mv, mm = self._mv, self._mm
        self._mv = self._mm = None
        mv.release()  # slices handed out to tensors are separate views: they keep the mapping
        try:
            mm.close()
        except BufferError:
            pass  # tensors still view it: it is unmapped when the last of them is freed

    def __enter__(self) -> "ProgramFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        p = self.program
        state = "closed" if self.closed else "open"
        return (f"ProgramFile({self.path!r}, {len(p.methods)} methods, {len(p.constants)} constants, "
                f"{state})")

    # -- internals --------------------------------------------------------------------------------

    def _constant(self, index: int) -> Constant:
        if self._mm is None:
            raise ValueError(f"{self.path}: the program file is closed")
        if not 0 <= index < len(self.program.constants):
            raise IndexError(f"constant {index} out of range: the program has "
                             f"{len(self.program.constants)} constants")
        return self.program.constants[index]

    def _external_tensor(self, index: int, data_files) -> torch.Tensor:
        c = self.program.constants[index]
        name = self.program.external_files[c.external]
        file_path = self.external_path(c.external, data_files)
        what = f"{file_path}: external data file {name!r} of {self.path}"
        key = f"tensor {c.name!r} (constant {index})"
        handle, keys = self._open_external(file_path, what, key)
        if c.name not in keys:
            raise ProgramError(f"{what} has no {key}; it holds {len(keys)} tensors")
        try:
            t = handle.get_tensor(c.name)
        except Exception as e:  # safetensors reports its errors as a bare Exception subclass
            raise ProgramError(f"{what}: cannot read {key}: {e}") from e
        if t.dtype != parse_dtype(c.dtype) or tuple(t.shape) != c.shape:
            raise ProgramError(f"{what}: {key} is {dtype_name(t.dtype)}{list(t.shape)}, "
                               f"but the program expects {c.dtype}{list(c.shape)}")
        if t.numel() * t.element_size() != c.nbytes:  # implied by the above; cheap to be sure
            raise ProgramError(f"{what}: {key} has {t.numel() * t.element_size()} bytes, the program "
                               f"expects {c.nbytes}")
        self._check_sum(index, (index, os.path.abspath(file_path)), t, what)
        return t

    def _check_sum(self, index: int, key, data: torch.Tensor, where: str) -> None:
        """The first time a constant is read (from one file): its bytes against its checksum."""
        c = self.program.constants[index]
        if key in self._checked:
            return
        if self.signature is not None:  # keyed: a signed file records one for every constant
            if c.checksum is None or signing.digest(data, self.signature.key) != c.checksum:
                raise ProgramError(f"{self.path}: constant {index} ({c.name!r}): its bytes in {where} do not "
                                   "match the program's signature")
        elif c.checksum is not None and hdr.checksum(data) != c.checksum:
            raise ProgramError(f"{self.path}: constant {index} ({c.name!r}): its bytes in {where} do not match "
                               "the checksum the program records for them (damaged, or not this program's data)")
        self._checked.add(key)

    def _open_external(self, file_path: str, what: str, key: str):
        cache_key = os.path.abspath(file_path)
        entry = self._external.get(cache_key)
        if entry is None:
            try:
                handle = safe_open(file_path, framework="pt")
                entry = (handle, frozenset(handle.keys()))
            except FileNotFoundError as e:
                raise ProgramError(f"{what} is missing; it holds {key} (pass data_files={{name: path}} "
                                   "to read it from elsewhere)") from e
            except Exception as e:  # truncated, not safetensors, unreadable
                raise ProgramError(f"{what}, which holds {key}, is not a valid safetensors file: {e}") from e
            self._external[cache_key] = entry
        return entry


# -------------------------------------------------------------------------------------------------
# The header and the flatbuffer.


def _parse(mm: mmap.mmap, path: str, key=None) -> tuple[Program, int, int, "signing.Signature | None"]:
    size = len(mm)

    def bad(what: str) -> ProgramError:
        return ProgramError(f"{path}: {what}")

    head = mm[: hdr.HEADER.size]
    (magic, version, header_size, fb_off, fb_size, data_off, data_size, file_size, fb_crc,
     head_crc) = hdr.HEADER.unpack(head)
    if magic != hdr.MAGIC:
        raise bad(f"not a tritondelegate program file: it starts with {magic!r}, not {hdr.MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        raise bad(f"format version {version} is not supported; this reader reads version(s) "
                  f"{', '.join(map(str, SUPPORTED_VERSIONS))}; lower the model again with this tritondelegate")
    if header_size != hdr.HEADER.size:
        raise bad(f"header size {header_size}, expected {hdr.HEADER.size} for version {version}")
    if zlib.crc32(head[:-4]) != head_crc:
        raise bad("header checksum mismatch: the header (bytes [0, 64)) is corrupt")
    trailer = None
    if size == file_size + signing.TRAILER.size and signing.is_trailer(mm[file_size:]):
        trailer, size = mm[file_size:], file_size  # a signed file: the trailer follows the recorded end
    if file_size != size:
        if size < file_size:
            raise bad(f"truncated: the header records {file_size} bytes, the file has {size}")
        raise bad(f"{size - file_size} unexpected bytes after the recorded end of the file ({file_size})")
    if fb_off < header_size or fb_off + fb_size > size:
        raise bad(f"flatbuffer [{fb_off}, {fb_off + fb_size}) lies outside the file's {size} bytes "
                  f"after the header")
    if data_off < fb_off + fb_size or data_off + data_size > size:
        raise bad(f"data segment [{data_off}, {data_off + data_size}) does not lie between the end of "
                  f"the flatbuffer ({fb_off + fb_size}) and the end of the file ({size})")
    if data_off % hdr.DATA_SEGMENT_ALIGNMENT:
        raise bad(f"data segment offset {data_off} is not a multiple of {hdr.DATA_SEGMENT_ALIGNMENT}")
    buf = bytes(mm[fb_off : fb_off + fb_size])
    if zlib.crc32(buf) != fb_crc:
        raise bad(f"flatbuffer checksum mismatch: bytes [{fb_off}, {fb_off + fb_size}) are corrupt")
    signature = signing.verify(path, trailer, head, buf, key)
    if fb_size < 8 or not fb.Program.ProgramBufferHasIdentifier(buf, 0):
        raise bad(f"the flatbuffer at {fb_off} does not carry the identifier {hdr.FILE_IDENTIFIER!r}")
    try:
        program = from_buffer(buf)
    except ProgramError as e:
        raise bad(str(e)) from None
    except Exception as e:  # the generated accessors fail in many ways on a malformed buffer
        raise bad(f"the flatbuffer at {fb_off} does not parse ({type(e).__name__}: {e})") from e
    check_program(program, path, version, data_off, data_size)
    return program, data_off, data_size, signature
