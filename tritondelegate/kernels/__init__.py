"""Triton kernels, one op family per file, and the one registry table (``registry.py``).

Triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted, so the choice is
made here, before any kernel module is imported: without CUDA the kernels run under the Triton
interpreter on the simulated device (host memory). Set ``TRITON_INTERPRET`` yourself to override.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreted() -> bool:
    """Whether kernels defined by this package run under the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
