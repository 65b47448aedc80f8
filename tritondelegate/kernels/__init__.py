"""Triton kernels, one op family per file, and the one registry table (``registry.py``).

Triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted, so the choice is
made here, before any kernel module is imported: without CUDA the kernels run under the Triton
interpreter on the simulated device (host memory). Set ``TRITON_INTERPRET`` yourself to override.
"""

import contextlib
import operator
import os
import sys
import threading

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreted() -> bool:
    """Whether kernels defined by this package run under the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_LIBRARY_SWAPS: list | None = None
# Interpreted launches patch module-level state (Triton's interpreter patches triton.language for the
# duration of a launch; interpreter_library swaps its helpers), so they run one at a time per process.
_INTERPRETER_LOCK = threading.RLock()


def _library_swaps() -> list:
    """(owner, name, compiled, interpreted) for each of Triton's own ``@jit`` helpers (``tl.zeros``,
    ``tl.sum`` and its combine function, ...) that was defined in compiled mode."""
    global _LIBRARY_SWAPS
    if _LIBRARY_SWAPS is None:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        owners = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m]
        _LIBRARY_SWAPS = [
            (owner, name, value, InterpretedFunction(value.fn))
            for owner in [*owners, tl.core.tensor]
            for name, value in list(vars(owner).items())
            if isinstance(value, JITFunction)
        ]
    return _LIBRARY_SWAPS


@contextlib.contextmanager
def interpreter_library():
    """Triton's library helpers as the interpreter needs them, for the duration of a block.

    Triton picks compiled or interpreted when a function is decorated. When ``triton`` was imported
    before the interpreter was chosen (a user imported transformers or torch's compiler first, or a GPU
    machine runs the simulated device), its own ``@jit`` helpers are compiled-mode functions that
    refuse to run inside an interpreted kernel. Interpreted launches run inside this block, which
    swaps in interpreted twins and puts the originals back after, so nobody else's kernels change.
    The block holds a process-wide lock: interpreted launches from several threads take turns.
    """
    with _INTERPRETER_LOCK:
        swaps = _library_swaps()
        for owner, name, _, interpreted_fn in swaps:
            setattr(owner, name, interpreted_fn)
        try:
            yield
        finally:
            for owner, name, compiled, _ in swaps:
                setattr(owner, name, compiled)


def _fix_interpreter_index() -> bool:
    """Backport triton-lang/triton#9172 to interpreters that lack it (triton 3.6).

    The interpreter holds every scalar as a 1-element array and turns it into a Python int (a
    ``range`` bound, an index) with ``int(array)``, which NumPy >= 2.4 refuses for arrays of rank > 0:
    any loop over a runtime bound (``range(0, K, BLOCK_K)``) fails with "only 0-dimensional arrays can
    be converted to Python scalars". Upstream squeezes the array first; this installs the same
    ``__index__``. Only interpreted runs see it: compiled kernels never touch the interpreter.
    Returns whether the fix was needed.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp

        original = interp._patch_lang_tensor
        probe_scope = interp._LangPatchScope()
        original(tl.tensor, probe_scope)
        try:
            operator.index(tl.tensor(interp.TensorHandle(np.array([1], np.int32), tl.int32), tl.int32))
            return False
        except TypeError:
            pass
        finally:
            probe_scope.restore()
    except (ImportError, AttributeError, TypeError):  # another interpreter layout: leave it alone
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # The scope restores in reverse order, so this override is undone before the original's.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interp._patch_lang_tensor = patch_lang_tensor
    return True


_fix_interpreter_index()
