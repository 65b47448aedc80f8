"""Direct launches of compiled kernels: the arguments reach the launcher in the JIT's order."""

import torch

from tritondelegate.kernels.table import KERNELS
from tritondelegate.runtime.direct import DirectLaunch, direct_launch


class FakeCompiled:
    """Stands in for Triton's CompiledKernel: records what its launcher is called with."""

    function, packed_metadata = "fn-handle", ("meta",)

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


def test_direct_launch_passes_grid_stream_handles_and_every_parameter_in_order():
    kernel = KERNELS["arange"]
    out = torch.empty(17)
    args = [out, 17, 0.0, 1.0]  # out_ptr, n, start, step
    constexprs = {"IS_FLOAT": True, "BLOCK": 128, "num_warps": 4}
    compiled = FakeCompiled()
    launch = direct_launch(kernel, compiled, (3,), args, constexprs)
    assert isinstance(launch, DirectLaunch)
    launch(stream=1234)
    (call,) = compiled.calls
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)  # as the JIT passes them
    assert call[:7] == (3, 1, 1, 1234, "fn-handle", ("meta",), None) and call[7:9] == hooks
    assert call[9] is out and call[10:] == (17, 0.0, 1.0, True, 128)  # launch options are not parameters
    moved = torch.empty(17)
    args[0] = moved  # the record's list is patched when memory moves: the launch follows it
    launch(stream=1)
    assert compiled.calls[-1][9] is moved


def test_no_direct_launch_without_a_launcher_or_with_arguments_that_do_not_bind():
    kernel = KERNELS["arange"]
    assert direct_launch(kernel, object(), (1,), [torch.empty(1), 1, 0.0, 1.0], {"IS_FLOAT": True, "BLOCK": 128}) is None
    assert direct_launch(kernel, FakeCompiled(), (1,), [torch.empty(1)], {"NOPE": 1}) is None
