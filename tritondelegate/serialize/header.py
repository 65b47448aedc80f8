"""The fixed header of a program file, shared by the writer and the reader.

File layout (all integers little-endian)::

    offset 0             header, HEADER.size = 64 bytes:
                           magic            8s   b"TDPROG\\0\\0"
                           version          u32  program.FORMAT_VERSION
                           header_size      u32  64
                           flatbuffer_off   u64  64
                           flatbuffer_size  u64
                           data_off         u64  a multiple of DATA_SEGMENT_ALIGNMENT
                           data_size        u64
                           file_size        u64  data_off + data_size: the whole file
                           flatbuffer_crc   u32  zlib.crc32 of the flatbuffer bytes
                           header_crc       u32  zlib.crc32 of the 60 header bytes before it
    flatbuffer_off       the flatbuffer (root table Program, file identifier "TDP1", program.fbs)
                         zero padding up to data_off
    data_off             the data segment: each in-file constant at data_off + Constant.data_offset,
                         data_offset a multiple of CONSTANT_ALIGNMENT, zero padding between them

Alignment: the data segment starts on a 4096-byte boundary, so it is page aligned in a mapping of
the file (and can be mapped, pinned or read with O_DIRECT on its own); each constant starts on a
64-byte boundary, which is at least the itemsize of every dtype (so a typed view of the mapped bytes
is always aligned), is a cache line and the widest CPU vector load, and matches the CPU allocator's
alignment in torch. Page-aligning every constant would waste up to 4 KiB per small constant (biases,
norms) for no gain: the runtime copies constants, it does not map them one by one.

The header's two checksums cover the header and the flatbuffer (the program's structure: a flipped
bit there could otherwise load as a different, plausible program). The data segment has no checksum
of its own: each constant records one of its bytes (``Constant.checksum``, :func:`checksum`, in the
data segment or in an external safetensors file), checked when the reader first hands the constant
out, so a load hashes only what it reads (a resident constant is read in full at load anyway).
"""

from __future__ import annotations

import struct
import zlib

import torch
import xxhash

MAGIC = b"TDPROG\0\0"
HEADER = struct.Struct("<8sIIQQQQQII")
FLATBUFFER_OFFSET = HEADER.size  # 64: the flatbuffer follows the header, 8-byte aligned
DATA_SEGMENT_ALIGNMENT = 4096
CONSTANT_ALIGNMENT = 64
FILE_IDENTIFIER = b"TDP1"  # program.fbs file_identifier: bytes 4..8 of the flatbuffer


def pack_header(version: int, fb_size: int, data_off: int, data_size: int, fb_crc: int) -> bytes:
    fields = HEADER.pack(MAGIC, version, HEADER.size, FLATBUFFER_OFFSET, fb_size, data_off, data_size,
                         data_off + data_size, fb_crc, 0)
    return fields[:-4] + struct.pack("<I", zlib.crc32(fields[:-4]))


def checksum(data: torch.Tensor) -> int:
    """The checksum of a constant: xxh3_64 of the bytes of ``data`` (a host tensor, read in memory
    order; a non-contiguous one is copied first)."""
    flat = data.detach().contiguous().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_64_intdigest(flat.numpy())
