"""Signed program files: a program saved with a secret key loads only with that key, unchanged.

Checksums (the header's CRCs, each constant's xxh3) catch damage, not intent: whoever can edit a file
can recompute them. A service that loads programs other teams wrote signs them instead:
``lowered.save(path, key=secret)`` and ``td.load(path, key=secret)``.

- The structure: an HMAC-SHA256 over the 64 header bytes and the flatbuffer, stored in a 48-byte
  trailer after the data segment (``TRAILER``). The reader checks it before it decodes the
  flatbuffer.
- The bytes the structure points to: in a signed file each constant's checksum (in-file and external
  safetensors alike) and each kernel binary's checksum is an HMAC-SHA256 of its bytes, truncated to
  64 bits (:func:`digest`), instead of xxh3/CRC32, so the MAC over the structure covers every byte the
  runtime reads. A constant is checked as it is read, as in unsigned files.
- A signed file without its key, or an unsigned file with a key, is refused (``ProgramError``): a
  caller that passes a key asks for a file that key signed.

Cost: SHA-256 (with the CPU's SHA extensions, through OpenSSL) hashes at roughly 1-2 GB/s per core,
against 10-26 GB/s for xxh3: signing adds about a second per GB of constants at save and at load.
"""

from __future__ import annotations

import hmac
import struct

import torch

from ..errors import ProgramError

MAGIC = b"TDSIGN\0\0"
HMAC_SHA256 = 1  # the algorithm id stored in the trailer
TRAILER = struct.Struct("<8sII32s")  # magic, algorithm, reserved (0), MAC


def check_key(key) -> bytes:
    """``key`` as bytes: at least 16 (128 bits of secret)."""
    if isinstance(key, str):
        raise TypeError("a signing key must be bytes (e.g. key.encode() or a key file's bytes), not str")
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"a signing key must be bytes, not {type(key).__name__}")
    key = bytes(key)
    if len(key) < 16:
        raise ValueError(f"a signing key must have at least 16 bytes, this one has {len(key)}")
    return key


def digest(data, key: bytes) -> int:
    """The keyed checksum of a signed file's constant or kernel binary: HMAC-SHA256 of its bytes (a host
    tensor, read in memory order, or bytes), the first 64 bits."""
    if isinstance(data, torch.Tensor):
        data = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    h = hmac.new(key, b"tritondelegate bytes\0", "sha256")
    h.update(data)
    return int.from_bytes(h.digest()[:8], "little")


def mac(header: bytes, flatbuffer, key: bytes) -> bytes:
    """The MAC of a program's structure: HMAC-SHA256 over its header and flatbuffer bytes."""
    h = hmac.new(key, b"tritondelegate program\0", "sha256")
    h.update(header)
    h.update(flatbuffer)
    return h.digest()


def pack_trailer(header: bytes, flatbuffer, key: bytes) -> bytes:
    return TRAILER.pack(MAGIC, HMAC_SHA256, 0, mac(header, flatbuffer, key))


def is_trailer(raw: bytes) -> bool:
    """Whether ``raw`` (the bytes after the recorded end of a file) is a signature trailer."""
    return len(raw) == TRAILER.size and raw.startswith(MAGIC)


def verify(path: str, trailer: bytes | None, header: bytes, flatbuffer, key) -> bytes | None:
    """Check a file's signature against ``key``; returns the key as bytes (None for an unsigned file
    loaded without a key). Raises ``ProgramError`` naming what does not match."""
    if trailer is None:
        if key is not None:
            raise ProgramError(f"{path}: the program is not signed, but a key was given (sign it with "
                               "LoweredProgram.save(path, key=...))")
        return None
    if key is None:
        raise ProgramError(f"{path}: the program is signed: load it with its key (td.load(path, key=...))")
    key = check_key(key)
    _, algorithm, reserved, recorded = TRAILER.unpack(trailer)
    if algorithm != HMAC_SHA256 or reserved:
        raise ProgramError(f"{path}: unknown signature algorithm {algorithm} (this runtime knows "
                           f"{HMAC_SHA256}: HMAC-SHA256)")
    if not hmac.compare_digest(recorded, mac(header, flatbuffer, key)):
        raise ProgramError(f"{path}: the signature does not match: the file was changed after it was "
                           "signed, or the key is not the one it was signed with")
    return key
