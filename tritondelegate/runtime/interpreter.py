"""The simulated device's interpreter: this package's Triton kernels run on host memory under the
Triton interpreter, chosen per program (the device a program is loaded on), never process-wide.

Importing ``tritondelegate`` leaves ``TRITON_INTERPRET`` alone, so every ``@triton.jit`` function (the
user's and this package's) stays as Triton made it. A delegate on the simulated device launches
:func:`interpreted_kernel` twins of its kernels inside :func:`interpreter_library`. A user who sets
``TRITON_INTERPRET=1`` gets interpreted kernels everywhere, as Triton defines it; they run as they are.
"""

import contextlib
import functools
import importlib
import operator
import os
import sys
import threading
import types


def interpreted() -> bool:
    """Whether Triton itself interprets every ``@jit`` function (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def interpreted_kernel(kernel):
    """``kernel`` (a ``@triton.jit`` function) as the simulated device launches it: an interpreted twin
    (Triton's ``InterpretedFunction`` over the same Python function), or itself when Triton already
    interprets everything."""
    _fix_interpreter_index()
    _fix_bf16_rounding()
    _skip_nested_patching()
    if interpreted():
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)


_LIBRARY_SWAPS: list | None = None
# Interpreted launches patch module-level state (Triton's interpreter patches triton.language for the
# duration of a launch; interpreter_library swaps its helpers), so they run one at a time per process.
_INTERPRETER_LOCK = threading.RLock()


def _library_swaps() -> list:
    """(owner, name, compiled, interpreted) for each ``@jit`` function defined in compiled mode that an
    interpreted kernel may call: Triton's own helpers (``tl.zeros``, ``tl.sum`` and its combine
    function, ...) and this package's kernel helpers (``elementwise._formula``, ...)."""
    global _LIBRARY_SWAPS
    if _LIBRARY_SWAPS is None:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        try:  # the interpreter's type mangling imports gluon lazily, which expects compiled helpers
            importlib.import_module("triton.experimental.gluon")
        except ImportError:
            pass
        # Triton's own helpers, and the kernels and helpers of this package (all imported by now:
        # kernels/table.py imports every kernel family).
        owners = [m for name, m in list(sys.modules.items())
                  if m and name.startswith(("triton.language", "tritondelegate.kernels"))]
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

    Triton picks compiled or interpreted when a function is decorated, and unless the user set
    ``TRITON_INTERPRET=1`` every ``@jit`` function is compiled-mode: a device function called from an
    interpreted kernel refuses to run. Interpreted launches run inside this block, which swaps in
    interpreted twins and puts the originals back after, so nobody else's kernels change. It also
    patches ``triton.language`` for the interpreter once, for every launch inside (see
    ``_skip_nested_patching``), and restores it at the end. The block holds a process-wide lock:
    interpreted launches from several threads take turns.
    """
    with _INTERPRETER_LOCK:
        swaps = _library_swaps()
        for owner, name, _, interpreted_fn in swaps:
            setattr(owner, name, interpreted_fn)
        language = _patch_language()
        try:
            yield
        finally:
            language.restore()
            for owner, name, compiled, _ in swaps:
                setattr(owner, name, compiled)


def _patch_language():
    """triton.language patched for the interpreter once for a whole block of launches (a delegate call),
    as a launch would patch it, and the launches inside reuse it (see _skip_nested_patching). Where that
    fix cannot be installed (another interpreter layout), nothing: each launch patches as usual."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    _skip_nested_patching()
    if not getattr(interp._patch_lang, "_tritondelegate_nested", False):
        return types.SimpleNamespace(restore=lambda: None)
    # what the patching reads of a kernel is its globals: here both triton.language modules
    return interp._patch_lang(types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core}))


@functools.cache  # once per process
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



def _fix_bf16_rounding() -> bool:
    """Round fp32 -> bf16 conversions to nearest even under the interpreter, as the GPU does.

    The interpreter converts fp32 to bf16 by truncating the mantissa for a plain cast (``x.to(tl.bfloat16)``,
    whose default rounding on a GPU is round-to-nearest-even), and its round-to-nearest-even mode rounds
    ties up and can carry into the sign. Every bf16 store on the simulated device then differed from eager
    (and from the GPU) by an ulp, enough to flip a router's top-k in bf16. This replaces that one
    conversion with exact bit arithmetic (NaN stays a quiet NaN, overflow rounds to inf, round-toward-zero
    still truncates); every other conversion is the interpreter's own. Returns whether it was installed
    (False once it is, or for another interpreter layout)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton._C.libtriton import ir
        from triton.runtime import interpreter as interp

        original = interp._convert_float
    except (ImportError, AttributeError):
        return False
    if getattr(original, "_tritondelegate_rne", False):
        return False

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or output_dtype != tl.bfloat16 or rounding_mode == ir.ROUNDING_MODE.RTZ:
            return original(input, input_dtype, output_dtype, rounding_mode)
        bits = np.ascontiguousarray(input).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)

    convert_float._tritondelegate_rne = True
    interp._convert_float = convert_float
    return True


@functools.cache  # once per process
def _skip_nested_patching() -> bool:
    """Device-function calls inside an interpreted launch reuse the launch's patched triton.language.

    The interpreter patches ``triton.language`` (its builtins, ``tl.tensor``'s operators, ``tl.math``)
    when a launch starts and restores it when the launch ends. It also calls the same patching for every
    call of a ``@jit`` device function inside the kernel, in every program of the grid: a scan of four
    modules' members that finds each builtin already patched and patches nothing new, about 1.5 ms a
    call. Kernels that call helpers per tile spent about a sixth of their simulated time there. While a
    launch (or an ``interpreter_library`` block, which patches once for all its launches) is running, a
    call whose ``triton.language`` modules it patched gets an empty patch scope instead; the first
    patching, and any call that sees other modules, run as before. Returns whether it was
    installed (False once it is, or for another interpreter layout)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp

        original, scope_type = interp._patch_lang, interp._LangPatchScope
    except (ImportError, AttributeError):
        return False
    if getattr(original, "_tritondelegate_nested", False):
        return False
    running: list[set] = []  # the modules the running launch patched; empty between launches

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if running and langs <= running[0]:
            return scope_type()  # a device function called inside the launch
        scope = original(fn)
        if not running:  # a launch starts: its scope is restored when it ends
            running.append(langs)
            restore = scope.restore

            def restore_launch():
                running.clear()
                restore()
            scope.restore = restore_launch
        return scope

    patch_lang._tritondelegate_nested = True
    interp._patch_lang = patch_lang
    return True
