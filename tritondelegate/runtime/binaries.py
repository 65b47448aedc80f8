"""Kernel binaries from the program file into Triton's cache, so the first call compiles nothing.

A program lowered with ``LowerConfig(kernel_archs=...)`` carries each kernel variant compiled for
those archs, with the key Triton's cache files it under. Before a CUDA device runs the program, the
binaries for its arch are put in Triton's cache (``TRITON_CACHE_DIR``) under those keys; Triton's JIT
then finds every variant compiled. A key only matches where it was computed: the same Triton
version, the same kernel sources and the same cache-relevant environment. Where nothing matches
(another arch, another Triton), kernels are compiled on first use as without binaries, and one
warning says why.
"""

from __future__ import annotations

import warnings

from ..program import KernelBinary


def device_arch(device_index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def usable(binaries: list[KernelBinary], arch: str, triton_version: str) -> tuple[list[int], str | None]:
    """Indices of the binaries this device can use, and a warning when the file's binaries do not fit."""
    if not binaries:
        return [], None
    archs = sorted({b.arch for b in binaries})
    if arch not in archs:
        return [], (f"the program carries kernel binaries for {', '.join(archs)}, but this device is {arch}: "
                    "kernels are compiled on first use")
    versions = sorted({b.triton_version for b in binaries if b.arch == arch})
    if versions != [triton_version]:
        return [], (f"the program's {arch} kernel binaries were built by Triton {', '.join(versions)}, and this "
                    f"machine has Triton {triton_version}: kernels are compiled on first use")
    return [i for i, b in enumerate(binaries) if b.arch == arch], None


def install(binary: KernelBinary, data: bytes) -> bool:
    """Put one binary in Triton's cache under its key; False when it was there already."""
    from triton.runtime.cache import get_cache_manager

    manager = get_cache_manager(binary.cache_key)
    metadata_file, binary_file = f"{binary.name}.json", f"{binary.name}.cubin"
    if manager.get_group(metadata_file) is not None:
        return False
    group = {binary_file: manager.put(data, binary_file, binary=True),
             metadata_file: manager.put(binary.metadata, metadata_file, binary=False)}
    manager.put_group(metadata_file, group)
    return True


def install_for_device(program, read_bytes, device_index: int) -> int:
    """Install the program's binaries for this device's arch; returns how many were new to the cache."""
    import triton

    indices, problem = usable(program.binaries, device_arch(device_index), triton.__version__)
    if problem:
        warnings.warn(problem, RuntimeWarning, stacklevel=3)
    return sum(install(program.binaries[i], read_bytes(i)) for i in indices)
