"""Signed program files: a program saved with a secret key loads only with that key, unchanged.

Checksums (the header's CRCs, each constant's xxh3) catch damage, not intent: whoever can edit a file
can recompute them. A service that loads programs other teams wrote signs them instead:
``lowered.save(path, key=secret)`` and ``td.load(path, key=secret)``.

- The structure: an HMAC-SHA256 over the 64 header bytes and the flatbuffer, stored in an 80-byte
  trailer after the data segment (``TRAILER``). The reader checks it before it decodes the
  flatbuffer.
- The constants: in a signed file each constant's checksum (in-file and external safetensors alike) is
  an HMAC-SHA256 of its bytes truncated to 64 bits (:func:`digest`) instead of xxh3, so the MAC over
  the structure covers every constant byte the runtime reads. A constant is checked as it is read, as
  in unsigned files.
- The kernel binaries (code the GPU runs): a second HMAC-SHA256 over their bytes, in program order,
  also in the trailer; checked at load, where their CRC-32s are checked.
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
TRAILER = struct.Struct("<8sII32s32s")  # magic, algorithm, reserved (0), structure MAC, binaries MAC


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


def _hmac(key: bytes, label: bytes, parts) -> hmac.HMAC:
    h = hmac.new(key, b"tritondelegate " + label + b"\0", "sha256")
    for part in parts:
        h.update(part)
    return h


def digest(data, key: bytes) -> int:
    """The keyed checksum of a signed file's constant: HMAC-SHA256 of its bytes (a host tensor, read in
    memory order), the first 64 bits."""
    if isinstance(data, torch.Tensor):
        data = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(_hmac(key, b"constant", [data]).digest()[:8], "little")


def pack_trailer(header: bytes, flatbuffer: bytes, binaries, key: bytes) -> bytes:
    """The trailer of a file signed with ``key``: MACs of its header and flatbuffer, and of the kernel
    binaries' bytes (in program order)."""
    return TRAILER.pack(MAGIC, HMAC_SHA256, 0, _hmac(key, b"program", [header, flatbuffer]).digest(),
                        _hmac(key, b"binaries", binaries).digest())


def is_trailer(raw: bytes) -> bool:
    """Whether ``raw`` (the bytes after the recorded end of a file) is a signature trailer."""
    return len(raw) == TRAILER.size and raw.startswith(MAGIC)


class Signature:
    """A signed file's key and the MAC its kernel binaries must match."""

    def __init__(self, key: bytes, binaries_mac: bytes):
        self.key = key
        self._binaries_mac = binaries_mac

    def check_binaries(self, path: str, binaries) -> None:
        if not hmac.compare_digest(self._binaries_mac, _hmac(self.key, b"binaries", binaries).digest()):
            raise ProgramError(f"{path}: the kernel binaries do not match the file's signature")


def verify(path: str, trailer: bytes | None, header: bytes, flatbuffer: bytes, key) -> Signature | None:
    """Check a file's signature against ``key`` (None for an unsigned file loaded without a key).
    Raises ``ProgramError`` naming what does not match."""
    if trailer is None:
        if key is not None:
            raise ProgramError(f"{path}: the program is not signed, but a key was given (sign it with "
                               "LoweredProgram.save(path, key=...))")
        return None
    if key is None:
        raise ProgramError(f"{path}: the program is signed: load it with its key (td.load(path, key=...))")
    key = check_key(key)
    _, algorithm, reserved, recorded, binaries_mac = TRAILER.unpack(trailer)
    if algorithm != HMAC_SHA256 or reserved:
        raise ProgramError(f"{path}: unknown signature algorithm {algorithm} (this runtime knows "
                           f"{HMAC_SHA256}: HMAC-SHA256)")
    if not hmac.compare_digest(recorded, _hmac(key, b"program", [header, flatbuffer]).digest()):
        raise ProgramError(f"{path}: the signature does not match: the file was changed after it was "
                           "signed, or the key is not the one it was signed with")
    return Signature(key, binaries_mac)
