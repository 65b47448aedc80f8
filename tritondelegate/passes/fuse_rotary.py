"""(stub: being written)"""

from __future__ import annotations


def fuse_rotary(ep, *args) -> list[str]:
    return []
