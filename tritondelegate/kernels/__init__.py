"""Triton kernels, one op family per file, and the one registry table (``registry.py``).

Triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted, so the choice is
made here, before any kernel module is imported: without CUDA the kernels run under the Triton
interpreter on the simulated device (host memory). Set ``TRITON_INTERPRET`` yourself to override.
"""

import operator
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreted() -> bool:
    """Whether kernels defined by this package run under the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
