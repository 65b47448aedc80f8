"""Launching compiled Triton kernels without the JIT's dispatch.

``kernel[grid](*args, **constexprs)`` binds every argument, builds a cache key and looks it up on each
launch. The first call of a delegate goes that way (it compiles each kernel variant once and returns
the compiled kernel); from then on each launch is a prebound record that calls the compiled kernel's
launcher directly: grid, function handle and metadata resolved once, arguments in the order the JIT
passes them (every kernel parameter, constexprs included), the caller's stream read once per call.

Launch hooks (``triton.knobs.runtime.launch_enter_hook``) are not called on this path; with a hook set,
or with a Triton whose compiled kernels lack the launcher this expects, launches stay on the JIT.
"""

from __future__ import annotations

import inspect

# Keyword arguments of a Triton launch that are not kernel parameters.
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}


class DirectLaunch:
    """One prebound launch of a compiled kernel: ``launch(stream)``."""

    __slots__ = ("run", "grid", "function", "metadata", "hooks", "args", "tail")

    def __init__(self, compiled, grid, args: list, tail: tuple, hooks: tuple = (None, None)):
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.grid = (tuple(grid) + (1, 1))[:3]
        self.hooks = hooks  # what the JIT passes for the enter/exit hooks (None, or empty hook chains)
        self.args, self.tail = args, tail  # ``args`` is the record's list: patched when memory moves

    def __call__(self, stream) -> None:
        g0, g1, g2 = self.grid
        enter, leave = self.hooks
        self.run(g0, g1, g2, stream, self.function, self.metadata, None, enter, leave, *self.args, *self.tail)


def _hooks() -> tuple:
    from triton import knobs

    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def hooks_set() -> bool:
    """Whether a launch hook is installed (older Triton: a callable or None; newer: a chain of calls)."""
    try:
        hooks = _hooks()
    except (ImportError, AttributeError):
        return True
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def direct_launch(kernel, compiled, grid, args: list, constexprs: dict) -> DirectLaunch | None:
    """The direct launch of ``compiled`` (what ``kernel[grid](*args, **constexprs)`` returned), or None
    when it cannot be built (then the JIT keeps launching)."""
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")) or hooks_set():
        return None
    params = {k: v for k, v in constexprs.items() if k not in LAUNCH_OPTIONS}
    try:
        bound = inspect.signature(kernel.fn).bind(*args, **params)
    except TypeError:
        return None
    bound.apply_defaults()
    values = list(bound.arguments.values())
    if any(v is not a for v, a in zip(values, args)):  # positional arguments come first, in order
        return None
    return DirectLaunch(compiled, grid, args, tuple(values[len(args):]), _hooks())

