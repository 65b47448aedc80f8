"""The errors shared by the lowering side and the runtime: this module imports nothing, so the runtime
may import it without loading any of the lowering side."""


class ProgramError(ValueError):
    """A program file (or a weights file it names) is malformed, truncated or inconsistent."""


class LoweringError(ValueError):
    """The program cannot be lowered as asked (names the node, tag or setting at fault).

    A ``ValueError``: like :class:`ProgramError`, it says that what the caller handed in (a model, a
    partition, a config) cannot be turned into a program, not that the process is in a bad state."""
