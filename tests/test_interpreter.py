"""The simulated device's interpreter fixes (tritondelegate/runtime/interpreter.py)."""

import triton.language as tl
from triton.runtime import interpreter as interp

from tritondelegate.kernels.norm import norm_kernel
from tritondelegate.runtime.interpreter import _skip_nested_patching, interpreted_kernel, interpreter_library


def test_a_device_function_call_inside_a_launch_patches_nothing_again():
    interpreted_kernel(norm_kernel)  # installs the fixes
    _skip_nested_patching()
    assert interp._patch_lang._tritondelegate_nested
    assert tl.core.is_builtin(tl.program_id)
    launch = interp._patch_lang(norm_kernel.fn)  # what a launch does when it starts
    try:
        assert not tl.core.is_builtin(tl.program_id)
        nested = interp._patch_lang(norm_kernel.fn)  # a helper called inside the launch
        assert nested._changes == []
        nested.restore()
        assert not tl.core.is_builtin(tl.program_id)  # still patched for the rest of the launch
    finally:
        launch.restore()
    assert tl.core.is_builtin(tl.program_id)
    again = interp._patch_lang(norm_kernel.fn)  # the next launch patches in full
    try:
        assert again._changes and not tl.core.is_builtin(tl.program_id)
    finally:
        again.restore()


def test_a_block_of_launches_patches_the_language_once():
    interpreted_kernel(norm_kernel)
    core_before = tl.core.is_builtin(tl.core.program_id)  # (a launch elsewhere may have left tl.core patched)
    with interpreter_library():
        assert not tl.core.is_builtin(tl.program_id) and not tl.core.is_builtin(tl.core.program_id)
        launch = interp._patch_lang(norm_kernel.fn)  # each launch inside reuses the block's patching
        assert launch._changes == []
        launch.restore()
        assert not tl.core.is_builtin(tl.program_id)
    assert tl.core.is_builtin(tl.program_id) and tl.core.is_builtin(tl.core.program_id) == core_before
